"""The integer numerics (native/intlinear.c's sd_linear_int, ``numerics="integer"``): every
kernel path equals the scalar reference bit for bit, a row's output never depends on the pass
that computes it (row counts 1..64, batch compositions, threads), the product is the quantized
one within its stated bound of the float product, and a row-count-dependent mutant is caught.
Each for the three code shapes: 4-bit and 8-bit codes in groups of 32 (Q4_1, Q8_0) and 8-bit
codes in groups of 16 (Q6_K: ``CODES``' "q6")."""

import pytest
import torch

from conftest import needs_smallm
from specdec.serving.kernels import (
    SMALLM,
    GroupedCodes,
    KernelPlan,
    Linear,
    pack_groups_int,
    smallm_library,
)

PATHS = {0: "scalar reference", 1: "byte pairs (AVX2 / AVX512BW)", 2: "VNNI"}


# The code shapes: (codes' range, group, with a minimum): Q4_1-like codes 0..15 with a minimum,
# Q8_0-like -127..127 without, Q6_K-like -32..31 in groups of 16 without.
CODES = {4: ((0, 16), 32, True), 8: ((-127, 128), 32, False), "q6": ((-32, 32), 16, False)}


def random_codes(out_features: int, in_features: int, bits, seed: int) -> GroupedCodes:
    """Codes of one of ``CODES``' shapes, d and m exact fp16 values as a GGUF file's."""
    gen = torch.Generator().manual_seed(seed)
    (lo, hi), group, with_min = CODES[bits]
    q = torch.randint(lo, hi, (out_features, in_features), generator=gen, dtype=torch.int8)
    groups = in_features // group
    d = torch.rand(out_features, groups, generator=gen).half().float() / 64
    m = torch.randn(out_features, groups, generator=gen).half().float() / 8 if with_min else \
        torch.zeros(out_features, groups)
    return GroupedCodes(q, d, m)


def int_product(codes: GroupedCodes, x: torch.Tensor, bias=None, panel=None, path=2,
                threads=1, group=None) -> torch.Tensor:
    """sd_linear_int on ``panel``'s packing, its kernel path capped at ``path``; ``group``:
    the group the kernel is told (the codes' own unless a test lies)."""
    lib, native_panel = smallm_library()
    panel = panel or native_panel
    w, dm, bits = pack_groups_int(codes, panel)
    y = torch.empty(x.shape[0], codes.q.shape[0])
    x = x.contiguous()
    lib.sd_int_cap(path)
    try:
        assert lib.sd_linear_int(x.data_ptr(), w.data_ptr(), dm.data_ptr(),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(),
                                 x.shape[0], x.shape[1], codes.q.shape[0], bits,
                                 group or codes.group, panel, threads) == 0
    finally:
        lib.sd_int_cap(2)
    return y


def panels_here() -> list[int]:
    """The panel widths whose SIMD paths this CPU runs (16 needs AVX-512, 8 AVX2)."""
    lib, native = smallm_library()
    return [p for p in (16, 8) if p <= native and lib.sd_int_path(p) > 0] or [native]


def assert_rows_identical(product, x: torch.Tensor) -> None:
    """Each row of ``product(x)`` equals that row computed alone, in every prefix of 1..len(x)
    rows, and in the rows reversed (another position in the pass)."""
    full = product(x)
    for i in range(x.shape[0]):
        assert torch.equal(product(x[i:i + 1])[0], full[i]), ("alone", i)
    for m in range(1, x.shape[0] + 1):
        assert torch.equal(product(x[:m]), full[:m]), ("first rows", m)
    assert torch.equal(product(x.flip(0)), full.flip(0)), "reversed"


@needs_smallm
@pytest.mark.parametrize("bits", [4, 8, "q6"])
@pytest.mark.parametrize("out_features", [1, 15, 37, 300])
def test_every_kernel_path_equals_the_scalar_reference(bits, out_features):
    """Each panel width's VNNI and byte-pair paths, one and two threads, give the scalar
    reference's bits for 1..17 rows, ragged panels, with a bias."""
    codes = random_codes(out_features, 96, bits, seed=out_features)
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(17, 96, generator=gen), torch.randn(out_features, generator=gen)
    lib, _ = smallm_library()
    for panel in panels_here():
        want = int_product(codes, x, bias, panel, path=0)
        for path in range(1, lib.sd_int_path(panel) + 1):
            for threads in (1, 2):
                for rows in (1, 2, 3, 5, 9, 17):
                    got = int_product(codes, x[:rows], bias, panel, path, threads)
                    assert torch.equal(got, want[:rows]), (panel, PATHS[path], threads, rows)


@needs_smallm
@pytest.mark.parametrize("bits", [4, 8, "q6"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_is_the_same_bits_in_any_pass(bits, threads):
    """Rows 1..64 of a pass, alone, in every prefix and in another order: the same bits, on
    the widest path here and split between threads (300 columns: 19 panels of 16)."""
    codes = random_codes(300, 128, bits, seed={4: 4, 8: 8, "q6": 6}[bits])
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    assert_rows_identical(lambda rows: int_product(codes, rows, threads=threads), x)


def quantized_product(codes: GroupedCodes, x: torch.Tensor) -> torch.Tensor:
    """What sd_linear_int computes, in float64 from the definition: x quantized per row and
    block of the codes' group (dx = max |x| / 127, xq = round(x / dx)),
    sum_g d dx sum(q xq) + m dx sum(xq)."""
    n, k = codes.q.shape
    g = codes.group
    xb = x.view(x.shape[0], k // g, g)
    dx = xb.abs().amax(-1) / 127  # [rows, groups]
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127).double()
    q = codes.q.view(n, k // g, g).double()
    isum = torch.einsum("rgk,ngk->rng", xq, q)
    return (codes.d.double()[None] * dx.double()[:, None] * isum
            + codes.m.double()[None] * (dx.double() * xq.sum(-1))[:, None]).sum(-1)


@needs_smallm
@pytest.mark.parametrize("bits", [4, 8, "q6"])
def test_the_product_is_the_quantized_one_within_its_bound_of_the_float_product(bits):
    """The kernel is the quantized product up to float32 rounding (relative 1e-5), and the
    quantized product is the float product within its bound: each activation moves by at
    most dx / 2, so |y_int - y| <= sum_g dx_g / 2 * sum_{k in g} |w_k| (plus rounding).
    Groups of 16 told they are 32s (the kernel's blocks and the codes' groups apart) fail
    the first check."""
    codes = random_codes(40, 128, bits, seed=3)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4)) * 3
    got, w = int_product(codes, x).double(), codes.dequantize().double()
    want = quantized_product(codes, x)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    if codes.group == 16:
        lied = int_product(codes, x, group=32).double()
        assert float((lied - want).abs().max()) > 1e-2 * float(want.abs().max())
    g = codes.group
    dx = x.view(9, 128 // g, g).abs().amax(-1).double() / 127  # [rows, groups]
    bound = (dx[:, None, :] / 2 * w.view(40, 128 // g, g).abs().sum(-1)[None]).sum(-1)
    err = (got - x.double() @ w.T).abs()
    assert bool((err <= bound * 1.0001 + 1e-5).all())
    assert float(err.max()) > 1e-4  # (the quantization shows: this is not the float product)


@needs_smallm
def test_a_row_count_dependent_mutant_is_caught():
    """The identity check fails a kernel whose order of float steps depends on the number of
    rows: above one row, the blocks' terms added in reverse order (each term the kernel's)."""
    codes = random_codes(48, 128, 4, seed=5)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))

    def mutant(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1:
            return int_product(codes, rows)
        terms = [int_product(GroupedCodes(codes.q[:, g * 32:(g + 1) * 32],
                                          codes.d[:, g:g + 1], codes.m[:, g:g + 1]),
                             rows[:, g * 32:(g + 1) * 32]) for g in range(4)]
        return sum(reversed(terms[1:]), terms[0])

    assert torch.equal(mutant(x[:1]), int_product(codes, x[:1]))
    with pytest.raises(AssertionError):
        assert_rows_identical(mutant, x)
    assert_rows_identical(lambda rows: int_product(codes, rows), x)


@needs_smallm
def test_a_linear_layer_runs_the_integer_product_only_when_asked():
    """``Linear(..., codes, integer=True)`` streams the repacked codes on sd_linear_int; without
    ``integer`` the same codes give the float32 product, as before."""
    codes = random_codes(37, 96, 4, seed=7)
    w, b = codes.dequantize(), torch.randn(37)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(8))
    plan = KernelPlan.fixed(SMALLM)
    integer, floating = Linear(w, b, plan, codes, integer=True), Linear(w, b, plan, codes)
    assert integer.integer and not floating.integer
    assert torch.equal(integer(x), int_product(codes, x, b))
    torch.testing.assert_close(floating(x), x @ w.T + b, rtol=1e-5, atol=1e-5)


def coded_engine(tiny_models, numerics: str, q6_down: bool = False, kernels: str = "auto"):
    """The tiny target on its coded weights (``coded_weights``) and their codes."""
    from specdec.serving.engine import LlamaEngine

    arch, weights, codes = coded_weights(tiny_models, q6_down)
    return LlamaEngine(arch, weights, "cpu", kernels, codes=codes, numerics=numerics)


def coded_weights(tiny_models, q6_down: bool = False):
    """(arch, weights, codes): the tiny target with every linear weight replaced by what
    Q4_1-like codes (layers) and Q8_0-like codes (head) encode, and those codes; ``q6_down``:
    the MLP's down projections as Q6_K-like codes instead (8-bit, groups of 16)."""
    from specdec.models.hub import load_hf_model
    from specdec.serving.arch import ArchConfig, canonical_weights

    model, _ = load_hf_model(tiny_models["target"])
    arch = ArchConfig.from_hf(model.config)
    weights = canonical_weights(model.state_dict(), arch)
    codes = {}
    for name, w in weights.items():
        if w.dim() != 2 or name == "embed":
            continue
        g = w.float().view(w.shape[0], -1, 32)
        if q6_down and name.endswith("w_down"):
            g = w.float().view(w.shape[0], -1, 16)
            d = (g.abs().amax(-1) / 31).half().float().clamp_min(1e-8)
            q, m = torch.round(g / d[..., None]).clamp(-32, 31), torch.zeros_like(d)
        elif name == "head":
            d = (g.abs().amax(-1) / 127).half().float().clamp_min(1e-8)
            q, m = torch.round(g / d[..., None]).clamp(-127, 127), torch.zeros_like(d)
        else:
            lo, hi = g.amin(-1), g.amax(-1)
            d, m = ((hi - lo) / 15).half().float().clamp_min(1e-8), lo.half().float()
            q = torch.round((g - m[..., None]) / d[..., None]).clamp(0, 15)
        codes[name] = GroupedCodes(q.to(torch.int8).view(w.shape), d, m)
        weights[name] = codes[name].dequantize()
    return arch, weights, codes


@needs_smallm
@pytest.mark.parametrize("threads", [1, 2])
def test_an_integer_engines_logits_are_the_same_bits_in_any_pass(tiny_models, threads):
    """A position's logits from a 1-token step, from row j of a verify block of up to 16, and
    from a pass shared with other sessions' prefills and blocks: identical, on the whole-stack
    call and the per-layer loop."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = coded_engine(tiny_models, "integer")
        assert engine.numerics == "integer" and engine.kernels.describe() == "smallm for 1+ rows"
        # the layers on the integer product, the head on the float one (its codes, any pass)
        assert all(layer[n].integer for layer in engine.layers
                   for n in ("qkv", "o", "gate_up", "down"))
        assert engine.head.grouped is not None and not engine.head.integer
        prompt, block = torch.arange(100, 140), torch.arange(500, 516)
        for whole in (True, False):
            engine.whole_stack = whole
            cache = engine.new_cache()
            engine.forward([cache], [prompt], [1])
            steps = []
            for tok in block:
                steps.append(engine.forward([cache], [tok[None]], [1])[0][0])
            steps = torch.stack(steps)
            for k in (1, 2, 5, 16):
                cache.truncate(len(prompt))
                assert torch.equal(engine.forward([cache], [block[:k]], [k])[0], steps[:k]), k
            cache.truncate(len(prompt))  # beside a prefill and another session's block
            others = [engine.new_cache(), engine.new_cache()]
            engine.forward(others[1:], [torch.arange(7, 30)], [1])
            out = engine.forward([others[0], cache, others[1]],
                                 [torch.arange(1, 60), block[:9], torch.arange(3, 8)],
                                 [1, 9, 5])
            assert torch.equal(out[1], steps[:9])
    finally:
        torch.set_num_threads(before)


@needs_smallm
def test_the_thread_count_does_not_change_a_bit(tiny_models):
    """The whole stack on one thread and on a team of two (threads started once a pass,
    attention split by query head, layerops.c's team_layers): the same logits, bit for bit,
    for a pass of three sessions' prefills, blocks and steps, in both numerics. (smallm for
    every row count: with "auto", a float engine may time oneMKL faster for a prefill, whose
    sums depend on its threads.)"""
    before = torch.get_num_threads()
    try:
        for numerics in ("integer", "float"):
            engine = coded_engine(tiny_models, numerics, kernels="smallm")
            assert engine._whole_stack(1) and engine._whole_stack(9)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                caches = [engine.new_cache() for _ in range(3)]
                first = engine.forward(caches[:2], [torch.arange(100, 140), torch.arange(7, 30)],
                                       [1, 1])
                outs.append(first + engine.forward(
                    caches, [torch.arange(500, 509), torch.arange(3, 4), torch.arange(1, 60)],
                    [9, 1, 5]))
            for a, b in zip(*outs):
                assert torch.equal(a, b), numerics
    finally:
        torch.set_num_threads(before)


@needs_smallm
def test_layers_in_groups_of_16_run_in_the_whole_stack_bit_for_bit(tiny_models):
    """Q6_K-like down projections (8-bit codes in groups of 16) in the whole-stack call and
    on a team of two threads: float numerics (sd_linear_g16) give the float32 model's logits
    exactly; integer numerics run them on the integer product too (activations in blocks of
    16), the same bits in any pass."""
    from specdec.serving.engine import LlamaEngine

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        coded = coded_engine(tiny_models, "float", q6_down=True, kernels="smallm")
        assert all(layer["down"].group == 16 and layer["down"].bits == 8
                   for layer in coded.layers)
        assert coded._whole_stack(1) and coded._whole_stack(5)
        arch, weights, _ = coded_weights(tiny_models, q6_down=True)
        plain = LlamaEngine(arch, weights, "cpu", "smallm")
        integer = coded_engine(tiny_models, "integer", q6_down=True)
        assert all(layer["down"].integer and layer["down"].group == 16
                   and layer["gate_up"].integer for layer in integer.layers)
        prompts, block = [torch.arange(100, 140), torch.arange(7, 30)], torch.arange(500, 505)
        for engine in (coded, plain, integer):
            caches = [engine.new_cache() for _ in prompts]
            engine.forward(caches, prompts, [1, 1])
            engine.out = engine.forward(caches[:1], [block], [5])[0]
            caches[0].truncate(len(prompts[0]))
            engine.steps = torch.stack([engine.forward(caches[:1], [t[None]], [1])[0][0]
                                        for t in block])
        assert torch.equal(coded.out, plain.out) and torch.equal(coded.steps, plain.steps)
        assert torch.equal(integer.out, integer.steps)
        assert not torch.equal(integer.out, coded.out)
    finally:
        torch.set_num_threads(before)


@needs_smallm
def test_integer_numerics_stay_close_to_float_and_apply_only_with_codes(tiny_models):
    """The integer engine's logits stay near the float engine's on the same codes (the tiny
    model's logits are ~+-20: within 2%), and a model without codes computes in float."""
    from specdec.models.hub import load_hf_model
    from specdec.serving.engine import LlamaEngine

    integer, floating = coded_engine(tiny_models, "integer"), coded_engine(tiny_models, "float")
    assert floating.numerics == "float"
    ids = torch.arange(200, 260)
    a = integer.forward([integer.new_cache()], [ids], [len(ids)])[0]
    b = floating.forward([floating.new_cache()], [ids], [len(ids)])[0]
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())
    model, _ = load_hf_model(tiny_models["target"])
    assert LlamaEngine.from_hf(model, numerics="integer").numerics == "float"
    with pytest.raises(ValueError, match="numerics"):
        LlamaEngine.from_hf(model, numerics="int4")


def test_a_service_config_names_its_numerics():
    """``numerics`` is one of config.NUMERICS, integer by default; anything else is refused."""
    from specdec.config import ServiceConfig

    assert ServiceConfig(model="default", role="target").numerics == "integer"
    assert ServiceConfig(model="default", role="target", numerics="integer").numerics == \
        "integer"
    with pytest.raises(ValueError, match="numerics must be one of float, integer"):
        ServiceConfig(model="default", role="target", numerics="int4")
