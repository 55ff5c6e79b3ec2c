"""The model families specdec runs, each against transformers' own forward (docs/models.md).

Every family is a small random-weight model built from its real config shape (families.py):
few layers and narrow widths, but the family's own RoPE type and scaling, norms, biases, tied
or untied head, GQA ratio, head_dim and attention windows. The engine's logits must equal
transformers' (fp32: max |difference| within 1e-4 of the logits' scale) for a prefill,
single-token steps through the KV cache, and a multi-token block after a prefix as a verify
pass runs it (also after a rollback); and speculative greedy output with a random draft of
the same family must equal transformers' greedy ``generate``. Configs specdec refuses:
test_family_configs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ServiceThread, hf_greedy, run
from families import FAMILIES, QK_SCALE, make_config, make_model

from specdec.models.hub import load_hf_model
from specdec.serving.arch import ArchConfig, canonical_weights
from specdec.serving.engine import LlamaEngine
from specdec.serving.kernels import smallm_available

TOL = 1e-4  # max |engine - transformers| over a logits row, relative to the row's largest |logit|
SEQ = 40  # tokens of the reference sequence: windows of 8 are exceeded well before its end

# Draft noise (default 0.15) where the draft would otherwise have no token accepted.
DRAFT_NOISE = {"qwen2": 0.05, "gemma2": 0.05}
# Where the speculative test runs a family through the services.
GREEDY_FAMILIES = ["llama3", "llama2", "qwen2", "qwen2_sliding", "qwen3", "mistral",
                   "mistral_sliding", "gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    cache = {}

    def get(name: str, kind: str = "target"):
        key = (name, kind)
        if key not in cache:
            if kind == "target":
                cache[key] = str(make_model(name, root / name))
            else:  # same family, same seed, perturbed: agrees often, not always
                cache[key] = str(make_model(name, root / f"{name}-draft",
                                            noise=DRAFT_NOISE.get(name, 0.15)))
        return cache[key]

    return get


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, that relative to max |ref|)."""
    diff = float((out - ref).abs().max())
    return diff, diff / max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("kernels", ["onednn", "mkl", "mkl-t"] + (
    ["smallm"] if smallm_available(torch.device("cpu")) else []))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(family_dirs, name, kernels):
    model, _ = load_hf_model(family_dirs(name))
    engine = LlamaEngine.from_hf(model, kernels=kernels)
    # The RoPE frequencies are transformers' own, bit for bit (each layer type's, Gemma 3).
    rotary = model.model.rotary_emb
    for i in range(engine.arch.num_layers):
        per_type = getattr(rotary, f"{model.config.layer_types[i]}_inv_freq", None) \
            if hasattr(model.config, "layer_types") else None
        ref_freq = per_type if per_type is not None else rotary.inv_freq
        assert torch.equal(engine.inv_freqs[engine.layer_rope[i]], ref_freq), (name, i)

    worst_abs, worst = engine_vs_transformers(engine, model)
    print(f"{name} ({kernels}): max |logit difference| {worst_abs:.2e}, relative {worst:.2e}")
    assert worst < TOL, (name, worst)


# The families whose layers the engine runs on its fused C ops (LlamaEngine._native_ops); the
# others have q/k norms (qwen3, gemma3), GELU (gemma) or sandwich norms and soft-capping (gemma2)
NATIVE_FAMILIES = ["llama3", "llama2", "llama_linear", "llama_dynamic", "llama_biases", "qwen2",
                   "qwen2_sliding", "mistral", "mistral_sliding"]


@pytest.mark.skipif(not smallm_available(torch.device("cpu")), reason="no native library here")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_native_layer_ops_compute_what_torch_ops_and_transformers_do(family_dirs, name):
    """The fused C ops (RMSNorm with the residual, RoPE, causal and sliding-window attention
    over the KV cache, SiLU-gating) run the plain Llama families' layers and match both
    transformers and the engine's torch ops, alone and in a ragged batch; the others keep
    torch's ops."""
    model, _ = load_hf_model(family_dirs(name))
    native = LlamaEngine.from_hf(model, kernels="mkl")
    plain = LlamaEngine(native.arch, canonical_weights(model.state_dict(), native.arch),
                        kernels="mkl", native=False)
    assert (native.native is not None) == (name in NATIVE_FAMILIES), name
    assert plain.native is None
    for engine in (native, plain):
        assert engine_vs_transformers(engine, model)[1] < TOL, name
    # Two sessions in one pass, across the sliding window: a verify block beside one step.
    ids = torch.arange(SEQ) * 37 % 5000 + 100
    out = []
    for engine in (native, plain):
        a, b = engine.new_cache(), engine.new_cache()
        engine.forward([a, b], [ids[:20], ids[5:17]], [1, 1])
        out.append(engine.forward([a, b], [ids[20:25], ids[17:18]], [5, 1]))
    for x, y in zip(*out):
        assert max_diff(x, y)[1] < TOL, name


@pytest.mark.skipif(not smallm_available(torch.device("cpu")), reason="no native library here")
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", NATIVE_FAMILIES)
def test_the_whole_layer_stack_in_one_native_call_is_the_per_layer_loop_bit_for_bit(
        family_dirs, name, quantize):
    """With every linear layer on smallm (fp32 or int8), a pass runs all the layers in one
    ``sd_layers`` call: the same ops in the same order as the per-layer Python loop, so the
    logits are equal bit for bit (biases, sliding windows, a ragged batch of a prefill, a
    verify block and a step, two threads). Where a layer's kernel is a library's, the loop
    runs."""
    model, _ = load_hf_model(family_dirs(name))
    engine = LlamaEngine.from_hf(model, kernels="smallm", quantize=quantize)
    assert engine._whole_stack(1) and engine._whole_stack(5), name
    ids = torch.arange(SEQ) * 37 % 5000 + 100
    threads = torch.get_num_threads()
    out = []
    try:
        torch.set_num_threads(2)
        for whole in (True, False):
            engine.whole_stack = whole
            a, b, c = engine.new_cache(), engine.new_cache(), engine.new_cache()
            first = engine.forward([a, b], [ids[:20], ids[5:17]], [2, 1])
            out.append(first + engine.forward([a, b, c], [ids[20:25], ids[17:18], ids[:30]],
                                              [5, 1, 3]))
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*out):
        assert torch.equal(x, y), name
    if quantize is None:
        assert not LlamaEngine.from_hf(model, kernels="mkl")._whole_stack(1)


# bfloat16 keeps 8 bits of mantissa: the engine and transformers round the same ops in the
# same dtype but not always in the same order (fused q/k/v, SDPA kernels), so rows agree to a
# few bf16 ulps of the largest logit rather than to fp32 rounding.
BF16_TOL = 3e-2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_logits_match_transformers_bf16(family_dirs, name):
    """In bfloat16 (the GPU default), the engine's float32 logits equal transformers' bf16
    forward within BF16_TOL of the largest logit: prefill, steps, a verify block, rollback.
    Norm statistics are float32 in both; Gemma's 1 + w is float32 as transformers keeps it."""
    model, _ = load_hf_model(family_dirs(name))
    with torch.no_grad():  # Gemma 2's attention logits back at init scale: at the soft-cap
        for layer in model.model.layers:  # (|score| ~ 50, a bf16 ulp 0.25) transformers' own
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):  # bf16 is 0.39
                proj.weight.div_(QK_SCALE.get(name, 1.0))  # off its fp32
    model = model.to(torch.bfloat16)
    engine = LlamaEngine.from_hf(model, dtype=torch.bfloat16)
    assert engine.dtype == torch.bfloat16 and engine.native is None and engine.kernels is None
    assert engine.embed.dtype == torch.bfloat16
    assert engine.norm.dtype == (torch.float32 if engine.arch.norm_plus_one else torch.bfloat16)
    cache = engine.new_cache()
    assert cache.pool.k.dtype == torch.bfloat16
    logits = engine.forward([cache], [torch.arange(5) + 100], [2])[0]
    assert logits.dtype == torch.float32 and logits.shape == (2, engine.vocab_out)
    worst_abs, worst = engine_vs_transformers(engine, model)
    print(f"{name} (bf16): max |logit difference| {worst_abs:.2e}, relative {worst:.2e}")
    assert worst <= BF16_TOL, (name, worst)


def test_a_bf16_pair_writes_the_bf16_target_only_greedy_text(family_dirs):
    """Target and draft services in bfloat16: speculative greedy text equals the bf16 target's
    own target-only text, with draft tokens both accepted and rejected."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    name = "llama3"
    prompt = [int(t) for t in torch.arange(20) * 53 % 4000 + 200]
    target = ServiceThread("target", family_dirs(name), dtype="bfloat16")
    draft = ServiceThread("draft", family_dirs(name, "draft"), target=family_dirs(name),
                          dtype="bfloat16")
    assert target.host.runtime.engine.dtype == torch.bfloat16

    async def go():
        orch = await connect(target.address, draft.address)
        try:
            return {mode: await orch.generate(GenerationRequest(
                prompt, 24, mode=mode, k=3, prompt_lookup=False))
                for mode in ("target-only", "spec")}
        finally:
            await close(orch)

    try:
        results = run(go())
    finally:
        target.stop()
        draft.stop()
    assert results["spec"].token_ids == results["target-only"].token_ids
    stats = results["spec"].stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats


def engine_vs_transformers(engine: LlamaEngine, model) -> tuple[float, float]:
    """Max (absolute, relative) logit difference from transformers' forward over a prefill,
    single steps, a verify block and a rollback into the steps followed by a block."""
    ids = torch.arange(SEQ) * 37 % 5000 + 100
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()  # [SEQ, vocab]
    cache = engine.new_cache()
    parts = [(engine.forward([cache], [ids[:24]], [24])[0], ref[:24])]  # prefill
    for i in range(24, 32):  # single-token steps against the cache
        parts.append((engine.forward([cache], [ids[i : i + 1]], [1])[0], ref[i : i + 1]))
    parts.append((engine.forward([cache], [ids[32:37]], [5])[0], ref[32:37]))  # a verify block
    cache.truncate(30)  # roll back into the steps, then a block again (a rejected draft)
    parts.append((engine.forward([cache], [ids[30:SEQ]], [SEQ - 30])[0], ref[30:SEQ]))
    diffs = [max_diff(out, r) for out, r in parts]
    return max(d[0] for d in diffs), max(d[1] for d in diffs)


@pytest.mark.parametrize("name", GREEDY_FAMILIES)
def test_speculative_greedy_equals_transformers_generate(family_dirs, name):
    """Target and a random draft of the same family as real services: spec and pipelined
    greedy output equals transformers' ``generate`` (which runs its own KV cache, sliding-window
    cache layers included), with draft tokens both accepted and rejected."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    target_dir, draft_dir = family_dirs(name), family_dirs(name, "draft")
    prompt = [int(t) for t in torch.arange(20) * 53 % 4000 + 200]
    max_new = 24
    reference = hf_greedy(target_dir, prompt, max_new)
    target = ServiceThread("target", target_dir)
    draft = ServiceThread("draft", draft_dir, target=target_dir)

    async def go():
        orch = await connect(target.address, draft.address)
        try:
            results = {}
            for mode in ("spec", "pipelined"):
                results[mode] = await orch.generate(
                    GenerationRequest(prompt, max_new, mode=mode, k=3, prompt_lookup=False))
            return results
        finally:
            await close(orch)

    try:
        results = run(go())
    finally:
        target.stop()
        draft.stop()
    for mode, result in results.items():
        assert result.token_ids == reference, (name, mode)
    stats = results["spec"].stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, (name, stats)  # both branches
    print(f"{name}: acceptance {stats.acceptance_rate:.2f} over {stats.draft_tokens} drafted")


def test_the_llama3_test_model_has_all_three_bands_of_the_scaling():
    from specdec.serving.arch import rope_inv_freq

    arch = ArchConfig.from_hf(make_config("llama3")[0])
    scaled = rope_inv_freq(arch.rope_theta, arch.rope_scaling, arch.head_dim, arch.max_context)
    ratio = scaled / rope_inv_freq(arch.rope_theta, None, arch.head_dim, arch.max_context)
    factor = dict(arch.rope_scaling)["factor"]
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(1 / factor)).any()
    assert ((ratio > 1 / factor + 1e-6) & (ratio < 1 - 1e-6)).any()  # smoothed
