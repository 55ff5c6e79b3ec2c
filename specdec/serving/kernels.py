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
them at start (``choose_kernels``) at a few row counts (1, 2, 3, 4, 6, 8 and 16: one token,
the verify blocks adaptive k chooses, a target's batched passes) and keeps, for each, the kernel
that ran its whole forward fastest; a row count between two measured ones takes the lower
one's kernel. On the AVX-512 Intel Xeon of one stop (one thread; ms per forward of the
default target): ``mkl-t`` 46 at one row, ``mkl`` 52 / 60 at two / three (oneDNN 60 / 61),
oneDNN from four on (60 at four, 90 at sixteen; ``mkl`` 84 / 123): one kernel for every block
made a block of two cost 1.30x one token, where the kernel per row count makes it 1.12x. It then
drops the weight layouts no kept kernel reads (while it measures, every candidate's layout is
held: up to three copies of the weights).

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


# The row counts ``choose_kernels`` times each kernel at (see the module's notes).
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 16)


@dataclasses.dataclass
class KernelPlan:
    """The kernel an engine's linear layers use by the input's number of rows.

    ``chosen``: (from this many rows, kernel) pairs, ascending from 1 row; a row count takes the
    kernel of the last pair at or below it. ``trying``: the kernels still to be measured (their
    weight layouts are built too)."""

    chosen: tuple[tuple[int, str], ...] = ((1, ONEDNN),)
    trying: tuple[str, ...] = ()
    _by_rows: tuple[str, ...] = dataclasses.field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.use(self.chosen)

    @classmethod
    def fixed(cls, kernel: str) -> "KernelPlan":
        """One kernel for every row count."""
        return cls(((1, kernel),))

    def use(self, chosen) -> None:
        """Set ``chosen`` (consecutive pairs of the same kernel merged)."""
        pairs = sorted(chosen)
        if not pairs or pairs[0][0] != 1:
            raise ValueError(f"a kernel plan starts at 1 row, got {pairs}")
        merged = [pairs[0]]
        for rows, kernel in pairs[1:]:
            if kernel != merged[-1][1]:
                merged.append((rows, kernel))
        self.chosen = tuple(merged)
        # kernel(rows) as a lookup: one entry per row count up to the last pair's
        last = merged[-1][0]
        self._by_rows = tuple(next(k for r, k in reversed(merged) if r <= rows)
                              for rows in range(1, last + 1))

    def kernel(self, rows: int) -> str:
        return self._by_rows[min(max(rows, 1), len(self._by_rows)) - 1]

    def used(self) -> set[str]:
        return {kernel for _, kernel in self.chosen} | set(self.trying)

    def describe(self) -> str:
        """e.g. "mkl-t for 1 row, mkl for 2-3 rows, onednn for 4+ rows"."""
        parts = []
        for i, (rows, kernel) in enumerate(self.chosen):
            end = self.chosen[i + 1][0] - 1 if i + 1 < len(self.chosen) else None
            span = f"{rows}+" if end is None else (f"{rows}" if end == rows else f"{rows}-{end}")
            parts.append(f"{kernel} for {span}" + (" row" if span == "1" else " rows"))
        return ", ".join(parts)


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
                   rows: tuple[int, ...] = MEASURED_ROWS, reps: int = 3) -> KernelPlan:
    """Set ``plan`` to the fastest of its ``trying`` kernels at each row count in ``rows``, by
    timing ``forward_ms(rows)`` (a whole forward) with each kernel, interleaved; then free the
    weight layouts that are no longer used."""
    candidates = plan.trying
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps + 1):  # rep 0 warms up (oneDNN builds its primitives per shape)
        for m in rows:
            for kernel in candidates:
                plan.use(((1, kernel),))
                ms = forward_ms(m)
                if rep:
                    times.setdefault((kernel, m), []).append(ms)
    med = {key: statistics.median(v) for key, v in times.items()}
    plan.use([(m, min(candidates, key=lambda k: med[(k, m)])) for m in rows])
    plan.trying = ()
    for lin in linears:
        lin.keep_only(plan.used())
    measured = "; ".join(f"{m}: " + " / ".join(f"{k} {med[(k, m)]:.1f}" for k in candidates)
                         for m in rows)
    log.info("linear kernels: %s (ms per forward by rows, %s)", plan.describe(), measured)
    return plan


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0
