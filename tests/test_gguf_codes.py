"""A GGUF target's linear layers streamed as the file's own codes (specdec.models.gguf_codes,
smallm's sd_linear_g): bit for bit the float32 model's results, from a quarter of the bytes."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import needs_smallm
from specdec.serving.kernels import GroupedCodes, Linear, KernelPlan, SMALLM



def _raw(kind: str, rows: int, cols: int, seed: int = 0):
    """A tensor's raw blocks of ``kind`` and gguf's dequantization of them: quantized by gguf
    where it can (the 32-weight types), else (the K-quants, which it only reads) blocks of
    random codes, scales and minimums under fp16 super-block scales."""
    from gguf import GGMLQuantizationType, quants

    from specdec.models.gguf_codes import BLOCK_BYTES

    qtype = getattr(GGMLQuantizationType, kind)
    rng = np.random.default_rng(seed)
    if kind.endswith("_K"):
        blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // 256, 2)).astype(np.float16)
        if kind == "Q6_K":  # d last (the int8 scales before it are any bytes)
            blocks[:, :, -2:] = scales[:, :, :1].view(np.uint8)
        else:
            blocks[:, :, :4] = scales.view(np.uint8)  # d and dmin
        raw = blocks.reshape(rows, -1)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32) - 0.3
        raw = quants.quantize(w, qtype)
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                  "Q6_K"])
def test_blocks_decode_to_what_the_gguf_package_dequantizes(kind):
    """Each block type's codes, scales and minimums, dequantized as smallm forms a weight,
    equal gguf's own dequantization exactly (Q4_0 / Q5_0 codes are offset by 8 / 16, Q4_1 /
    Q5_1 have a minimum, Q4_K / Q5_K a 6-bit scale and minimum per group of 32 under the
    super-block's two, Q6_K an int8 scale per group of 16); 4-bit types give codes 0..15
    (streamed two per byte), 5-bit 0..31, Q6_K -32..31."""
    from specdec.models.gguf_codes import _blocks

    raw, want = _raw(kind, 6, 512)
    codes = GroupedCodes(*(torch.from_numpy(a) for a in _blocks(raw, kind)))
    assert torch.equal(codes.dequantize(), want)
    assert codes.bits == (4 if kind[1] == "4" else 8)
    assert codes.group == (16 if kind == "Q6_K" else 32)
    if kind == "Q6_K":  # all six bits are read
        assert int(codes.q.min()) == -32 and int(codes.q.max()) == 31
    if kind[1] == "5":  # the fifth bit is read: codes above 15 occur
        assert int(codes.q.max()) > 15 and int(codes.q.min()) >= 0


@needs_smallm
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (8, 16)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features", [1, 15, 37, 100])
def test_grouped_codes_give_the_float32_kernels_results_bit_for_bit(bits, group, threads,
                                                                    out_features):
    """sd_linear_g (8-bit codes), sd_linear_g4 (0..15, two per byte) and sd_linear_g16
    (8-bit codes in groups of 16: Q6_K's) against sd_linear on the dequantized weight:
    identical for every row count up to two chunks of 8, ragged panels, both thread shares,
    with a bias."""
    gen = torch.Generator().manual_seed(out_features)
    lo, hi = (-127, 128) if bits == 8 else (0, 16)
    q = torch.randint(lo, hi, (out_features, 96), generator=gen, dtype=torch.int8)
    d = torch.rand(out_features, 96 // group, generator=gen).half().float() / 64
    m = torch.randn(out_features, 96 // group, generator=gen).half().float()
    codes = GroupedCodes(q, d, m)
    assert codes.group == group
    w = codes.dequantize()
    b = torch.randn(out_features, generator=gen)
    plan = KernelPlan.fixed(SMALLM)
    fp32, grouped = Linear(w, b, plan), Linear(w, b, plan, codes)
    assert grouped.panels is None and grouped.bits == bits and not grouped.integer
    assert grouped.grouped.numel() == grouped.dm.shape[0] * 96 * grouped.panel * bits // 8
    # the AVX2 kernels too (8-column panels), which an AVX-512 machine runs as well
    from specdec.serving.kernels import LinDesc, pack_groups, pack_panels, run_desc

    lib = grouped.lib
    panels8, dm8, bits8 = pack_groups(codes, 8)
    plain8 = pack_panels(w, 8)
    avx2 = LinDesc.describe(panels8, 96, out_features, b, dm=dm8, bits=bits8, group=group)
    avx2_fp32 = LinDesc.describe(plain8, 96, out_features, b)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 18):
            x = torch.randn(rows, 96, generator=gen)
            assert torch.equal(grouped(x), fp32(x)), rows
            torch.testing.assert_close(grouped(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            assert torch.equal(run_desc(lib, avx2, 8, x), run_desc(lib, avx2_fp32, 8, x)), rows
    finally:
        torch.set_num_threads(before)


def _small_gguf(tmp_path):
    """A GGUF file of two tensors (Q4_1, Q8_0) and their dequantized weights."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    rng = np.random.default_rng(1)
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    deq = {}
    for name, kind in (("a", "Q4_1"), ("b", "Q8_0")):
        w = rng.standard_normal((8, 64)).astype(np.float32)
        qtype = getattr(GGMLQuantizationType, kind)
        raw = quants.quantize(w, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        deq[name] = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, deq


def test_a_weight_the_codes_do_not_encode_exactly_keeps_its_float32(tmp_path, monkeypatch):
    """exact_codes matches rows by their bytes and checks the whole weight: a weight with one
    changed element, or one that is not in the file, gets no codes."""
    from specdec.models.gguf_codes import exact_codes

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path, deq = _small_gguf(tmp_path)
    changed = deq["b"].clone()
    changed[3, 7] = torch.nextafter(changed[3, 7], torch.tensor(9.0))
    weights = {"layers.0.wqkv": torch.cat([deq["a"][4:], deq["b"][:3]]),  # rows of both
               "layers.0.wo": deq["a"].flip(0),  # reordered rows
               "layers.0.w_down": changed,
               "layers.0.w_gate_up": torch.randn(8, 64),
               "head": deq["b"]}
    codes = exact_codes(path, weights)
    assert sorted(codes) == ["head", "layers.0.wo", "layers.0.wqkv"]
    for name, c in codes.items():
        assert torch.equal(c.dequantize(), weights[name])


@needs_smallm
@pytest.mark.parametrize("threads", [1, 2])
def test_the_default_target_on_its_codes_is_the_float32_target_bit_for_bit(threads):
    """The real default target: every linear layer (and the tied head) takes the GGUF file's
    codes, and ragged passes of 1-35 rows over three sessions give the float32 smallm engine's
    logits exactly, on the whole-stack call and on the per-layer loop."""
    from specdec.models.hub import default_gguf_path, load_hf_model
    from specdec.serving.engine import LlamaEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, _ = load_hf_model("default")
        fp32 = LlamaEngine.from_hf(model, "cpu", "smallm")
        coded = LlamaEngine.from_hf(model, "cpu", "smallm", gguf=default_gguf_path(),
                                    numerics="float")
        # (the layers are Q4_1: 4-bit codes; the tied embedding and head Q8_0: 8-bit)
        assert all(layer[n].bits == 4 for layer in coded.layers
                   for n in ("qkv", "o", "gate_up", "down")) and coded.head.bits == 8
        for whole in (True, False):
            outs = []
            for engine in (fp32, coded):
                engine.whole_stack = whole
                caches = [engine.new_cache() for _ in range(3)]
                outs.append([
                    engine.forward(caches, [torch.arange(5, 40), torch.arange(100, 117),
                                            torch.tensor([7])], [1, 1, 1]),
                    engine.forward(caches, [torch.tensor([3, 4, 5, 6, 7]), torch.tensor([9]),
                                            torch.tensor([11, 12])], [5, 1, 2])])
            for a, b in zip(*outs):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    finally:
        torch.set_num_threads(before)


def test_k_quant_and_5_bit_tensors_of_a_file_are_streamed_as_codes(tmp_path, monkeypatch):
    """A file of the types a Q4_K_M / Q5_K_M model is made of: Q4_K, Q5_K, Q5_0 and Q6_K.
    Every weight gets its codes: 4-bit from Q4_K, 8-bit from the 5-bit types and Q6_K (in
    groups of 16), and a fused weight of Q6_K and Q4_K rows (q / k / v whose v is Q6_K) all
    in groups of 16; a weight with a row the file lacks gets none."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from specdec.models.gguf_codes import exact_codes

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "k.gguf"
    writer = GGUFWriter(str(path), "llama")
    weights = {}
    for i, (name, kind) in enumerate((("layers.0.wqkv", "Q4_K"), ("layers.0.wo", "Q5_K"),
                                      ("layers.0.w_gate_up", "Q5_0"), ("head", "Q6_K"))):
        raw, weights[name] = _raw(kind, 4, 256, seed=i)
        writer.add_tensor(name.replace(".", "_"), raw, raw_dtype=getattr(GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights["layers.1.wqkv"] = torch.cat([weights["layers.0.wqkv"][:2], weights["head"][1:]])
    weights["layers.1.w_down"] = torch.cat([weights["head"], torch.randn(1, 256)])
    codes = exact_codes(path, weights)
    assert sorted(codes) == ["head", "layers.0.w_gate_up", "layers.0.wo", "layers.0.wqkv",
                             "layers.1.wqkv"]
    assert {n: (c.bits, c.group) for n, c in codes.items()} == {
        "layers.0.wqkv": (4, 32), "layers.0.wo": (8, 32), "layers.0.w_gate_up": (8, 32),
        "head": (8, 16), "layers.1.wqkv": (8, 16)}
    for name, c in codes.items():
        assert torch.equal(c.dequantize(), weights[name])


def test_the_codes_are_cached_and_a_stale_cache_is_read_again(tmp_path, monkeypatch):
    """The second load reads the codes from the cache beside the converted model; a cached
    weight that no longer encodes the model's weight is not used: the file is read again."""
    from specdec.models import gguf_codes

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path, deq = _small_gguf(tmp_path)
    weights = {"layers.0.wo": deq["a"], "head": deq["b"]}
    first = gguf_codes.exact_codes(path, weights)
    cached = list((tmp_path / "cache").rglob(gguf_codes.CACHE_FILE))
    assert sorted(first) == ["head", "layers.0.wo"] and len(cached) == 1
    reads = []
    real = gguf_codes._read_codes
    monkeypatch.setattr(gguf_codes, "_read_codes", lambda *a: reads.append(1) or real(*a))
    assert sorted(gguf_codes.exact_codes(path, weights)) == sorted(first) and not reads
    stored = torch.load(cached[0], weights_only=True)
    stored["head"][0][0, 0] += 1  # a stale code
    torch.save(stored, cached[0])
    again = gguf_codes.exact_codes(path, weights)
    assert reads == [1] and torch.equal(again["head"].dequantize(), deq["b"])


@needs_smallm
@pytest.mark.parametrize("threads", [1, 2])
def test_the_shipped_draft_streams_its_stored_int8_for_the_same_logits(threads):
    """The shipped draft's matrices are stored as per-row int8 with fp16 scales: loaded, each
    layer and the head stream those codes (d the row's scale, m 0) and give the logits of
    the same draft on its dequantized float32 weights exactly, over ragged passes."""
    from specdec.models import draft_model
    from specdec.serving.arch import ArchConfig
    from specdec.serving.engine import LlamaEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        path = draft_model.shipped_draft_dir()
        coded, _, _ = draft_model.load_engine(path, "cpu", "smallm", numerics="float")
        assert all(layer[n].bits == 8 for layer in coded.layers
                   for n in ("qkv", "o", "gate_up", "down")) and coded.head.bits == 8
        meta, weights = draft_model.load_weights(path)
        vocab_map = weights.pop("vocab_map").long()
        fp32 = LlamaEngine(ArchConfig(**meta["arch"]), {k: v.float() for k, v in weights.items()},
                           "cpu", "smallm", vocab_map=vocab_map)
        assert fp32.head.bits == 0 and fp32.head.grouped is None
        outs = []
        for engine in (fp32, coded):
            caches = [engine.new_cache() for _ in range(2)]
            outs.append([engine.forward(caches, [torch.arange(5, 40), torch.tensor([7])], [1, 1]),
                         engine.forward(caches, [torch.tensor([3, 4, 5]), torch.tensor([9])],
                                        [3, 1])])
        for a, b in zip(*outs):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    finally:
        torch.set_num_threads(before)


def test_stored_codes_encode_the_dequantized_weights_exactly():
    """stored_codes on a crafted int8 matrix: d * q + 0 is the dequantized weight bit for bit,
    and a matrix whose input width is not a multiple of the group size is left to float32."""
    from specdec.models import draft_model

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    q, scale = draft_model.quantize_int8(w)
    odd_q, odd_scale = draft_model.quantize_int8(torch.randn(8, 48, generator=g))
    tensors = {"a.int8": q, "a.scale": scale, "b.int8": odd_q, "b.scale": odd_scale,
               "norm": torch.ones(64, dtype=torch.float16)}
    codes = draft_model.stored_codes(tensors)
    assert set(codes) == {"a"}
    assert torch.equal(codes["a"].dequantize(), draft_model._dequantize(tensors)["a"])
    assert codes["a"].bits == 8
