"""Linear layers on the fastest kernel this CPU has for each input shape.

Three kernels compute the same matrix product on CPU:

- ``mkl``: ``F.linear`` (oneMKL SGEMM on the weight as stored, [out, in]), what transformers runs;
- ``mkl-t``: oneMKL on the weight stored transposed once ([in, out], contiguous), ``x @ W^T``
  as a plain row-major product: for one row it reads the weight in the order it lies in memory,
  which on the AVX2 EPYC of this project ran the default target's 1-token forward in 54-60 ms
  against 73-86 ms with ``mkl`` and 74-80 ms with ``onednn`` (one and two threads, a slow
  hour), while for blocks of rows it is the slowest of the three;
- ``onednn``: oneDNN with the weight reordered once into its blocked layout
  (``_reorder_linear_weight`` / ``_linear_pointwise``, the path PyTorch's own CPU compiler
  takes), the fastest for blocks of rows on AMD processors, where oneMKL does not use its
  small-M paths (5 rows: ~1.4x one row's forward against ~2x with ``mkl``).

Which is faster depends on the processor and on the number of rows M, so an engine measures
them at start (``choose_kernels``) and keeps, for one row and for blocks of rows, the kernel
that ran its whole forward faster, dropping the weight layouts no kept kernel reads (while it
measures, every candidate's layout is held: up to three copies of the weights).

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

MKL, MKL_T, ONEDNN = "mkl", "mkl-t", "onednn"


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
    """The kernel an engine's linear layers use for one input row and for several, and the
    kernels still to be measured (``trying``: their weight layouts are built too)."""

    one: str = ONEDNN
    block: str = ONEDNN
    trying: tuple[str, ...] = ()

    def kernel(self, rows: int) -> str:
        return self.one if rows == 1 else self.block

    def used(self) -> set[str]:
        return {self.one, self.block, *self.trying}


class Linear:
    """y = x @ weight.T + bias on the kernel ``plan`` names for x's number of rows.

    ``plan`` None: F.linear only (GPU). Each kernel reads its own layout of the weight:
    ``plain`` ([out, in]: mkl), ``transposed`` ([in, out]: mkl-t), ``packed`` (oneDNN's).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan | None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.plan = plan
        self.plain: torch.Tensor | None = weight.contiguous()
        self.transposed: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        kernels = plan.used() if plan is not None else {MKL}
        if MKL_T in kernels:
            self.transposed = self.plain.t().contiguous()
        if ONEDNN in kernels:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, None)
        self.keep_only(kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        kernel = self.plan.kernel(x.shape[0]) if self.plan is not None else MKL
        if kernel == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if kernel == MKL_T:
            if self.bias is None:
                return torch.mm(x, self.transposed)
            return torch.addmm(self.bias, x, self.transposed)
        return F.linear(x, self.plain, self.bias)

    def keep_only(self, kernels: set[str]) -> None:
        """Free the weight layouts no kernel in ``kernels`` reads."""
        if MKL not in kernels:
            self.plain = None
        if MKL_T not in kernels:
            self.transposed = None
        if ONEDNN not in kernels:
            self.packed = None


def choose_kernels(plan: KernelPlan, linears: list[Linear], forward_ms: Callable[[int], float],
                   block_rows: int = 5, reps: int = 5) -> KernelPlan:
    """Set ``plan`` to the fastest of its ``trying`` kernels for 1 row and for ``block_rows``
    rows, by timing ``forward_ms(rows)`` (a whole forward) with each kernel, interleaved; then
    free the weight layouts that are no longer used."""
    candidates = plan.trying
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps + 1):  # rep 0 warms up (oneDNN builds its primitives per shape)
        for rows in (1, block_rows):
            for kernel in candidates:
                plan.one = plan.block = kernel
                ms = forward_ms(rows)
                if rep:
                    times.setdefault((kernel, rows), []).append(ms)
    med = {key: statistics.median(v) for key, v in times.items()}
    plan.one = min(candidates, key=lambda k: med[(k, 1)])
    plan.block = min(candidates, key=lambda k: med[(k, block_rows)])
    plan.trying = ()
    for lin in linears:
        lin.keep_only(plan.used())

    def listed(rows: int) -> str:
        return " / ".join(f"{k} {med[(k, rows)]:.1f}" for k in candidates)

    log.info("linear kernels: %s for 1 row (%s ms), %s for %d rows (%s ms)",
             plan.one, listed(1), plan.block, block_rows, listed(block_rows))
    return plan


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0
