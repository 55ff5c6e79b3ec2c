"""Linear layers on the fastest kernel this CPU has for each input shape.

Two kernels compute the same matrix product on CPU: ``F.linear`` (oneMKL SGEMM) and oneDNN
with the weight reordered once into its blocked layout (``_reorder_linear_weight`` /
``_linear_pointwise``, the path PyTorch's own CPU compiler takes). Which is faster depends on
the processor and on the number of rows M: on an AVX2 EPYC, oneMKL gave the fastest 1-token
forward of the default target (27.4 ms vs 32.8 ms) but ran a 5-token one at ~1.7x that, since
it does not use its small-M paths on AMD processors, while oneDNN kept 5 tokens at 1.14x; on an
AVX-512 EPYC oneDNN was faster at both (30 ms vs 51 ms at one token). So an engine measures
both at start (``choose_kernels``) and keeps, for one row and for blocks of rows, the kernel
that ran its whole forward faster, dropping the other weight layout when one kernel wins both.

The kernels round fp32 differently in the last bits (logits of the default target differ by up
to ~5e-5), which the exactness notes in the README account for.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MKL, ONEDNN = "mkl", "onednn"
KERNEL_CHOICES = ("auto", ONEDNN, MKL)


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


@dataclasses.dataclass
class KernelPlan:
    """The kernel an engine's linear layers use for one input row and for several."""

    one: str = ONEDNN
    block: str = ONEDNN

    def kernel(self, rows: int) -> str:
        return self.one if rows == 1 else self.block

    def used(self) -> set[str]:
        return {self.one, self.block}


class Linear:
    """y = x @ weight.T + bias on the kernel ``plan`` names for x's number of rows.

    ``plan`` None: F.linear only (GPU, or CPU builds without oneDNN).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan | None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.plan = plan
        self.plain: torch.Tensor | None = weight.contiguous()
        self.packed: torch.Tensor | None = None
        if plan is not None and ONEDNN in plan.used():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.plan is not None and self.plan.kernel(x.shape[0]) == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.plain, self.bias)

    def keep_only(self, kernels: set[str]) -> None:
        """Free the weight layouts no kernel in ``kernels`` reads."""
        if MKL not in kernels and self.packed is not None:
            self.plain = None
        if ONEDNN not in kernels:
            self.packed = None


def choose_kernels(plan: KernelPlan, linears: list[Linear], forward_ms: Callable[[int], float],
                   block_rows: int = 5, reps: int = 5) -> KernelPlan:
    """Set ``plan`` to the faster kernel for 1 row and for ``block_rows`` rows, by timing
    ``forward_ms(rows)`` (a whole forward) with each kernel, interleaved; then free the weight
    layouts that are no longer used."""
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps + 1):  # rep 0 warms up (oneDNN builds its primitives per shape)
        for rows in (1, block_rows):
            for kernel in (MKL, ONEDNN):
                plan.one = plan.block = kernel
                ms = forward_ms(rows)
                if rep:
                    times.setdefault((kernel, rows), []).append(ms)
    med = {key: statistics.median(v) for key, v in times.items()}
    plan.one = min((MKL, ONEDNN), key=lambda k: med[(k, 1)])
    plan.block = min((MKL, ONEDNN), key=lambda k: med[(k, block_rows)])
    for lin in linears:
        lin.keep_only(plan.used())
    log.info("linear kernels: %s for 1 row (mkl %.1f / onednn %.1f ms), %s for %d rows "
             "(mkl %.1f / onednn %.1f ms)", plan.one, med[(MKL, 1)], med[(ONEDNN, 1)],
             plan.block, block_rows, med[(MKL, block_rows)], med[(ONEDNN, block_rows)])
    return plan


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0
