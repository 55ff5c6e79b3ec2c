"""Linear layers whose cost at few tokens stays near their cost at one token.

On CPU, ``F.linear`` goes to oneMKL SGEMM, which on AMD processors does not use its small-M
paths: a (5 x 576) x (576 x 1536) product costs 3.4x the 1-row one. oneDNN with weights
reordered once into its blocked layout (the path PyTorch's own CPU compiler takes) keeps a
5-token forward of the default target at ~1.3x a 1-token one (../shared/CPU-PERF.md). The result
is the same matrix product; it may differ from MKL in the last bits of fp32 rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def prepack_available(device: torch.device) -> bool:
    """True when oneDNN prepacked linear ops can run here (CPU builds with mkldnn)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:  # older or stripped builds
        log.warning("oneDNN prepacked linear unavailable (%s); using F.linear", exc)
        return False
    return True


class Linear:
    """y = x @ weight.T + bias, with the weight prepacked for oneDNN when ``prepack``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.prepacked = prepack
        if prepack:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
