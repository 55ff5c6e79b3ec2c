"""Linear layers on the fastest kernel this CPU has for each input shape.

Four kernels compute the same matrix product on CPU:

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
- ``smallm``: specdec's own one-thread kernel (``native/smallm.c``, AVX-512 or AVX2, built at
  first use with the system's C compiler; absent without one) on the weight packed once in
  panels of 16 or 8 output columns: it streams the weight once for all of a block's rows, so
  on a memory-bound core a block of 2-8 rows costs about one row's pass (the default target's
  linear layers on one Xeon core: 33 / 34 / 34 / 34 / 38 ms at 1 / 2 / 3 / 4 / 8 rows against
  the best of the other three's 34 / 40 / 44 / 44 / 51), where the SGEMM libraries pad a few
  rows to their micro-kernel's and turn compute-bound. With torch's threads > 1 (where the
  C compiler has OpenMP) it splits the panels between them, in torch's own OpenMP pool: the
  default target on the Xeon's 2 cores, in a target service, 25.2 / 25.8 / 26.8 / 27.7 /
  29.6 ms at 1-5 rows against the best library's 28.4 / 30.8 / 33.8 / 39.4 / 41.2.

Which is faster depends on the processor and on the number of rows M, so an engine measures
them at start (``choose_kernels``) at a few row counts (1, 2, 3, 4, 6, 8, 16 and 64: one
token, the verify blocks adaptive k chooses, a target's batched passes, a prompt's prefill
chunks) and keeps, for each, the kernel that ran its whole forward fastest; a row count between
two measured ones takes the lower one's kernel, and one past 64 the 64's. (smallm streams the
weight once per 8 rows, so a prefill is where the libraries win again: the default target
on one Xeon core, 128 / 256 rows, smallm 304 / 597 ms against mkl-t 236 / 457; without the
64-row probe prefills ran on the 16 rows' smallm.) On the AVX-512 Intel Xeon of one stop
(one thread; ms per forward of the default target): ``mkl-t`` 46 at one row, ``mkl`` 52 / 60 at two / three (oneDNN 60 / 61),
oneDNN from four on (60 at four, 90 at sixteen; ``mkl`` 84 / 123): one kernel for every block
made a block of two cost 1.30x one token, where the kernel per row count makes it 1.12x. It then
drops the weight layouts no kept kernel reads (while it measures, every candidate's layout is
held: up to three copies of the weights).

``Int8Linear`` is not a kernel choice but a model: a draft's weights quantized to int8
(``int8:<spec>``), on smallm's int8 variant.

The kernels round fp32 differently in the last bits (logits of the default target differ by up
to ~5e-5), which the exactness notes in docs/design.md account for.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specdec.config import INT8
from specdec.models.hub import cache_root

log = logging.getLogger(__name__)

MKL, MKL_T, ONEDNN, SMALLM = "mkl", "mkl-t", "onednn", "smallm"
QUANTIZATIONS = (INT8,)  # weight quantizations (Int8Linear), not kernel choices: they change
# the model

SMALLM_SOURCE = Path(__file__).parent / "native" / "smallm.c"
# The fused decoder-layer ops (the engine's native path), built into the same library.
LAYEROPS_SOURCE = Path(__file__).parent / "native" / "layerops.c"
# The integer-numerics product of grouped codes (``sd_linear_int``), built into the same library.
INTLINEAR_SOURCE = Path(__file__).parent / "native" / "intlinear.c"


def _cache_dir() -> Path:
    """Where the built kernel is kept: the project's cache (``$SPECDEC_CACHE``, default
    ~/.cache/specdec), else (a read-only home, as in some containers) the temporary directory."""
    for root in (cache_root(), Path(tempfile.gettempdir()) / f"specdec-{os.getuid()}"):
        path = Path(root) / "native"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError("no writable cache directory for the smallm kernel")


BUILD_TIMEOUT_S = 600  # a first build on a busy machine (~60 s of compiler time in all)


def _build(compiler: str, sources, out: Path, flags: list[str]) -> None:
    """Compile the sources to objects side by side (one compiler process each: the build's
    wall time is its longest file's), then link them into ``out``."""
    # (-fno-math-errno: sqrtf is an instruction, not a call that stops vectorisation)
    objects = [out.with_suffix(f".{i}.o") for i in range(len(sources))]
    procs = [subprocess.Popen([compiler, "-O3", "-fno-math-errno", "-fPIC", *flags, "-c",
                               str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for src, obj in zip(sources, objects)]
    try:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        subprocess.run([compiler, "-shared", *flags, *map(str, objects), "-o", str(out), "-lm"],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for obj in objects:
            obj.unlink(missing_ok=True)


@functools.cache
def smallm_library() -> tuple[ctypes.CDLL, int] | None:
    """The smallm kernel's library (with the fused layer ops of ``layerops.c``) and panel
    width, built once per source version (compiled to a temporary name and renamed, so services
    starting together never load half a file); None where it cannot run: no C compiler,
    neither AVX-512 nor AVX2 + FMA, a build error."""
    sources = (SMALLM_SOURCE, LAYEROPS_SOURCE, INTLINEAR_SOURCE)
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in sources)).hexdigest()[:16]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        out = _cache_dir() / f"smallm-{digest}.so"
        if not out.exists():
            if compiler is None:
                log.info("smallm kernel unavailable: no C compiler (cc, gcc or $CC)")
                return None
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            try:  # with OpenMP (the threads are torch's: the same libgomp, by its soname)
                _build(compiler, sources, tmp, ["-fopenmp"])
            except subprocess.CalledProcessError:  # a compiler without it: one thread
                _build(compiler, sources, tmp, [])
            os.replace(tmp, out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        log.warning("smallm kernel unavailable: %s %s", exc, err.decode(errors="replace")[-400:])
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.sd_lin_run.argtypes = [ptr, ptr, ptr, i32, i32, i32]
    lib.sd_lin_run.restype = i32
    lib.sd_linear_int.argtypes = [ptr] * 5 + [i32] * 7
    lib.sd_linear_int.restype = i32
    lib.sd_int_path.argtypes, lib.sd_int_path.restype = [i32], i32
    lib.sd_int_cap.argtypes, lib.sd_int_cap.restype = [i32], None
    lib.sd_quantize_rows.argtypes = [ptr, i32, i32, i32] + [ptr] * 3
    lib.sd_quantize_rows.restype = None
    lib.sd_add_rms_norm.argtypes = [ptr] * 4 + [i32, i32, f32]
    lib.sd_attend.argtypes = [ptr, i32, i32, ptr, ptr, ptr, ptr, i64, i32, i32, f32, i32, i32,
                              i32, ptr]
    lib.sd_silu_mul.argtypes = [ptr, ptr, i32, i32]
    for fn in (lib.sd_add_rms_norm, lib.sd_attend, lib.sd_silu_mul):
        fn.restype = None
    lib.sd_layers.argtypes = [ptr, i32, i32, ptr, i32, f32, i32] + [ptr] * 8 + [f32] + \
        [i32] * 5
    lib.sd_layers.restype = i32
    panel = int(lib.sd_panel())
    if panel == 0:
        log.info("smallm kernel unavailable: this CPU has neither AVX-512 nor AVX2 + FMA")
        return None
    return lib, panel


def smallm_available(device: torch.device) -> bool:
    return device.type == "cpu" and smallm_library() is not None


def pack_panels(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """[out, in] -> [panels, in, panel]: panel p holds output columns p * panel.. as rows of
    the input dimension (zero past ``out``), the layout the smallm kernel streams."""
    n, k = weight.shape
    panels = -(-n // panel)
    padded = torch.zeros(panels * panel, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(panels, panel, k).transpose(1, 2).contiguous()


GROUP = 32  # grouped codes: weights per (d, m) pair along the input dimension (smallm.c)


@dataclasses.dataclass(frozen=True)
class GroupedCodes:
    """A float32 weight [out, in] held exactly as int8 codes in groups along ``in`` (GROUP, or
    16 for a GGUF file's Q6_K): weight = d * q + m, each group with its own d and m
    ([out, in / group] each), as a GGUF file's blocks store it (``specdec.models.gguf_codes``
    builds them and checks them against the dequantized weight, bit for bit)."""

    q: torch.Tensor  # int8 [out, in]
    d: torch.Tensor  # float32 [out, in / group]
    m: torch.Tensor  # float32 [out, in / group]

    @property
    def group(self) -> int:
        """Weights per (d, m) along ``in``: GROUP (32), or 16."""
        return self.q.shape[1] // self.d.shape[1]

    @property
    def bits(self) -> int:
        """4 where every code is 0..15 in groups of 32 (Q4_0 / Q4_1 / Q4_K: smallm streams
        two per byte), else 8."""
        return 4 if self.group == GROUP and int(self.q.min()) >= 0 and \
            int(self.q.max()) <= 15 else 8

    def dequantize(self) -> torch.Tensor:
        """The weight they encode, computed as smallm computes it (d * q is exact)."""
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float()
        return (self.d[:, :, None] * q + self.m[:, :, None]).view(n, k)

    def regrouped(self, group: int) -> "GroupedCodes":
        """The same weight in groups of ``group`` (a divisor of this one's): each group's d
        and m repeated, exactly."""
        times = self.group // group
        if times == 1:
            return self
        return GroupedCodes(self.q, self.d.repeat_interleave(times, 1),
                            self.m.repeat_interleave(times, 1))


def _pack_dm(codes: GroupedCodes, panel: int) -> torch.Tensor:
    """The groups' d and m as [panels, in / group, 2, panel] (zero past ``out``)."""
    n, groups = codes.d.shape
    dm = torch.zeros(-(-n // panel) * panel, groups, 2)
    dm[:n, :, 0], dm[:n, :, 1] = codes.d, codes.m
    return dm.view(-1, panel, groups, 2).permute(0, 2, 3, 1).contiguous()


def pack_groups(codes: GroupedCodes, panel: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the codes in smallm's panels: int8, or 4-bit two k per byte, the even k in the low
    nibble; the groups' d and m as [panels, in / GROUP, 2, panel]; the codes' bits)."""
    dm = _pack_dm(codes, panel)
    panels, bits = pack_panels(codes.q, panel), codes.bits
    if bits == 4:
        u = panels.to(torch.uint8)
        panels = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    return panels, dm, bits


def pack_groups_int(codes: GroupedCodes, panel: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the codes as ``sd_linear_int`` reads them, see native/intlinear.c: 4 consecutive k of a
    column in one 32-bit lane; 4-bit codes two k per byte, k and k + 4 of each 8; 8-bit codes
    as q + 128, in groups of 32 or 16; the groups' d and m as ``pack_groups``'; the codes'
    bits)."""
    n, k = codes.q.shape
    groups, bits = k // codes.group, codes.bits
    dm = _pack_dm(codes, panel)
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=torch.int16)
    padded[:n] = codes.q.to(torch.int16)
    if bits == 4:  # [panels, panel, groups, h, half, b] -> [panels, groups, h, panel, b]
        q = padded.view(-1, panel, groups, 4, 2, 4)
        packed = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    else:  # [panels, panel, groups, h, b] -> [panels, groups, h, panel, b]
        packed = (padded + 128).view(-1, panel, groups, codes.group // 4, 4)
        packed = packed.permute(0, 2, 3, 1, 4)
    return packed.to(torch.uint8).contiguous(), dm, bits


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
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 16, 64)


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


class LinDesc(ctypes.Structure):
    """A linear layer's weight as smallm runs it: layerops.c's ``sd_lin``, the one descriptor
    of its format (float32 panels, int8 with column scales, grouped codes of 4 or 8 bits in
    groups of 32 or 16, integer or float product). Built once per layer (``describe``); C's
    ``sd_lin_run`` picks the kernel from it, for ``Linear`` and ``sd_layers`` alike."""

    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("k", ctypes.c_long), ("n", ctypes.c_long), ("dm", ctypes.c_void_p),
                ("bits", ctypes.c_long), ("integer", ctypes.c_long), ("group", ctypes.c_long)]

    @classmethod
    def describe(cls, w: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 dm: torch.Tensor | None = None, bits: int = 0, integer: bool = False,
                 group: int = GROUP) -> "LinDesc":
        """The descriptor of packed weight ``w`` (the tensors must outlive it: its owner
        holds them). ``bits``: the codes' (with ``dm``); the descriptor holds every weight's
        stored bits, 8 for int8 with ``scale`` and 32 for float32."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        stored = bits if dm is not None else 8 if scale is not None else 32
        return cls(w.data_ptr(), ptr(scale), ptr(bias), in_features, out_features, ptr(dm),
                   stored, int(integer), group)


def run_desc(lib, desc: LinDesc, panel: int, x: torch.Tensor) -> torch.Tensor:
    """smallm's product on a descriptor: [rows, in] float32 -> [rows, out]."""
    x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != desc.k:
        raise ValueError(f"smallm takes [rows, {desc.k}] float32, got {tuple(x.shape)} "
                         f"{x.dtype}")
    y = torch.empty(x.shape[0], desc.n, dtype=torch.float32)
    if lib.sd_lin_run(ctypes.byref(desc), x.data_ptr(), y.data_ptr(), x.shape[0], panel,
                      torch.get_num_threads()) != 0:
        raise MemoryError("sd_linear_int: no memory for the quantized rows")
    return y


class Linear:
    """y = x @ weight.T + bias on the kernel ``plan`` names for x's number of rows.

    ``plan`` None: F.linear only (GPU). Each kernel reads its own layout of the weight:
    ``plain`` ([out, in]: mkl), ``transposed`` ([in, out]: mkl-t), ``packed`` (oneDNN's),
    ``panels`` (smallm's, ``pack_panels``). With ``codes`` (the same weight as grouped int8
    codes, exactly) smallm reads those instead (``grouped``, ``dm``): the same results from a
    quarter of the bytes. With ``integer`` too, smallm runs the integer numerics on them
    (``sd_linear_int``, native/intlinear.c): x quantized to int8 per block of 32 (16 for
    Q6_K's groups), exact int32
    block sums; not the float product's numbers, but each row's the same in any pass.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan | None,
                 codes: GroupedCodes | None = None, integer: bool = False):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.plan = plan
        self.plain: torch.Tensor | None = weight.contiguous()
        self.transposed: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.grouped: torch.Tensor | None = None
        self.dm: torch.Tensor | None = None
        self.bits = 0
        self.group = GROUP  # the codes' weights per (d, m): 32, or 16 (Q6_K)
        self.desc: LinDesc | None = None  # smallm's descriptor of the packed weight
        self.integer = False  # the codes on sd_linear_int (``integer`` and smallm in the plan)
        kernels = plan.used() if plan is not None else {MKL}
        for name in kernels:
            KERNELS[name].build(self, codes, integer)
        self.keep_only(kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        kernel = self.plan.kernel(x.shape[0]) if self.plan is not None else MKL
        return KERNELS[kernel].run(self, x)

    def keep_only(self, kernels: set[str]) -> None:
        """Free the weight layouts no kernel in ``kernels`` reads."""
        for name, kernel in KERNELS.items():
            if name not in kernels:
                for attr in kernel.layout:
                    setattr(self, attr, None)

    def _build_smallm(self, codes: GroupedCodes | None, integer: bool) -> None:
        """smallm's layout: the codes (integer or float product) where the weight has them,
        else float32 panels; and its descriptor."""
        self.lib, self.panel = smallm_library()
        coded = codes is not None and self.in_features % GROUP == 0
        if coded and integer:
            self.grouped, self.dm, self.bits = pack_groups_int(codes, self.panel)
            self.integer = True
        elif coded:
            self.grouped, self.dm, self.bits = pack_groups(codes, self.panel)
        if coded:
            self.group = codes.group
        else:
            self.panels = pack_panels(self.plain, self.panel)
        self.bias = None if self.bias is None else self.bias.contiguous()
        self.desc = LinDesc.describe(
            self.panels if self.grouped is None else self.grouped, self.in_features,
            self.out_features, self.bias, dm=self.dm, bits=self.bits, integer=self.integer,
            group=self.group)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A CPU float32 linear kernel, declared once: its name (what ``--kernels`` takes and a
    ``KernelPlan`` holds), the ``Linear`` attributes holding the weight layout it reads,
    how that layout is built, its product, where it runs, and what it needs when it cannot.
    A new kernel is one entry of ``KERNELS`` (and its C side, if any, a branch of
    ``sd_lin_run``)."""

    name: str
    layout: tuple[str, ...]
    build: Callable[["Linear", "GroupedCodes | None", bool], None]
    run: Callable[["Linear", torch.Tensor], torch.Tensor]
    available: Callable[[torch.device], bool]
    needs: str  # what is missing where it is not available

    def __post_init__(self) -> None:
        assert self.name != "auto"


def _mkl_t(lin: "Linear", x: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, lin.transposed) if lin.bias is None else \
        torch.addmm(lin.bias, x, lin.transposed)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    # "mkl": F.linear on the weight as stored ([out, in]), oneMKL's sgemm on CPU
    Kernel(MKL, ("plain",), lambda lin, codes, integer: None,
           lambda lin, x: F.linear(x, lin.plain, lin.bias), lambda device: True, ""),
    # "mkl-t": oneMKL on the transposed weight ([in, out]): the 1-row product reads it in order
    Kernel(MKL_T, ("transposed",),
           lambda lin, codes, integer: setattr(lin, "transposed", lin.plain.t().contiguous()),
           _mkl_t, lambda device: device.type == "cpu", "a CPU"),
    # "onednn": oneDNN's prepacked weight (its own blocked layout), from 4 rows on most CPUs
    Kernel(ONEDNN, ("packed",),
           lambda lin, codes, integer: setattr(
               lin, "packed", torch.ops.mkldnn._reorder_linear_weight(lin.plain, None)),
           lambda lin, x: torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none",
                                                             [], ""),
           prepack_available, "a CPU build of torch with oneDNN"),
    # "smallm": specdec's few-rows kernel (native/smallm.c), on float32 panels or the codes
    Kernel(SMALLM, ("panels", "grouped", "dm", "desc"), Linear._build_smallm,
           lambda lin, x: run_desc(lin.lib, lin.desc, lin.panel, x),
           smallm_available, "a CPU with AVX-512 or AVX2 + FMA and a C compiler (cc, gcc or $CC)"),
)}
KERNEL_CHOICES = ("auto",) + tuple(KERNELS)  # --kernels: "auto" times them at start


class Int8Linear:
    """y = x @ (scale * q).T + bias: weight-only int8, one scale per output row (symmetric,
    scale = max |w| / 127).

    A draft's quantization, never a target's: it changes the model (the default target's
    int8 copy agrees with the fp32 target on ~95% of greedy tokens), which a draft may do and
    a target may not. What it buys is weight bytes: on CPU the product is smallm's int8 variant
    (``sd_linear_q8``: the packed int8 panels streamed once for up to 8 rows, converted to
    float in registers, activations and sums in float32), a quarter of the fp32 weight's bytes
    on a memory-bound core. Where smallm cannot run (GPUs, dtypes other than float32, no C
    compiler, neither AVX-512 nor AVX2) the weight is dequantized once and the product is
    F.linear: the same quantized model, without the speed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.contiguous()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.panels: torch.Tensor | None = None
        self.plain: torch.Tensor | None = None
        self.desc: LinDesc | None = None
        if smallm_available(weight.device) and weight.dtype == torch.float32:
            self.lib, self.panel = smallm_library()
            self.panels = pack_panels(q, self.panel)
            self.scale = scale.contiguous()
            self.desc = LinDesc.describe(self.panels, self.in_features, self.out_features,
                                         self.bias, scale=self.scale)
        else:
            self.plain = (q.float() * scale[:, None]).to(weight.device, weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            return F.linear(x, self.plain, self.bias)
        return run_desc(self.lib, self.desc, self.panel, x)


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
    """Milliseconds ``fn()`` took, its CUDA work included (kernels launch asynchronously: without
    the synchronisation a GPU forward would time its launches alone)."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1000.0
