"""The model families specdec runs, each against transformers' own forward (docs/models.md).

Every family is a small random-weight model built from its real config shape: few layers and
narrow widths, but the family's own RoPE type and scaling, norms, biases, tied or untied head,
GQA ratio, head_dim and attention windows. The engine's logits must equal transformers' (fp32:
max |difference| within 1e-4 of the logits' scale) for a prefill, single-token steps through
the KV cache, and a multi-token block after a prefix as a verify pass runs it (also after a
rollback); and speculative greedy output with a random draft of the same family must equal
transformers' greedy ``generate``. Configs specdec cannot run exactly are refused at load with
a message naming the feature, and the CLI reports such a refusal in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, ServiceThread, hf_greedy, perturb, run

from specdec.models.hub import load_hf_model
from specdec.serving.arch import ArchConfig, canonical_weights
from specdec.serving.engine import LlamaEngine
from specdec.serving.kernels import smallm_available

TOL = 1e-4  # max |engine - transformers| over a logits row, relative to the row's largest |logit|
SEQ = 40  # tokens of the reference sequence: windows of 8 are exceeded well before its end

# name -> (transformers config class, its arguments). Shapes follow the named checkpoints,
# shrunk: hidden 64-112, 2-3 layers, max_position_embeddings 512.
FAMILIES = {
    # Llama 3.1 / 3.2: llama3 RoPE frequency scaling, GQA 4:1, theta 5e5 (3.2: tied head).
    # original_max_position_embeddings shrunk with the model, so all three bands of the scaling
    # (kept, smoothed, divided by factor) occur among its 8 frequencies (head_dim 16).
    "llama3": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Llama 2: no GQA, untied head, theta 1e4.
    "llama2": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=4,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Linear (position-interpolation) and dynamic-NTK RoPE scaling on a Llama.
    "llama_linear": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama_dynamic": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    # Llama with attention_bias (q/k/v and o_proj biases) and mlp_bias.
    "llama_biases": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=True, mlp_bias=True)),
    # Qwen2 / Qwen2.5-0.5B: q/k/v biases (o_proj none), 14 heads over 2 KV heads, tied, 1e6.
    "qwen2": ("Qwen2Config", dict(
        hidden_size=112, intermediate_size=224, num_attention_heads=14, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen2 with use_sliding_window: layers from max_window_layers on attend within a window.
    "qwen2_sliding": ("Qwen2Config", dict(
        hidden_size=112, intermediate_size=224, num_attention_heads=14, num_key_value_heads=2,
        use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Qwen3-0.6B: q/k RMSNorm per head before RoPE, no biases, explicit head_dim (4 x 32 = 128,
    # not hidden 64), GQA 2:1, tied.
    "qwen3": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Mistral 7B v0.2+: sliding_window null, GQA 4:1, untied.
    "mistral": ("MistralConfig", dict(
        hidden_size=64, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Mistral 7B v0.1: every layer attends within a sliding window (4096 of 32k there).
    "mistral_sliding": ("MistralConfig", dict(
        hidden_size=64, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2,
        sliding_window=8)),
    # Gemma 2B: sqrt(hidden) embeddings, (1 + w) RMSNorm, GeGLU (tanh), multi-query (1 KV
    # head), head_dim 16 x 8 heads = 128 != hidden 64, tied.
    "gemma": ("GemmaConfig", dict(
        hidden_size=64, intermediate_size=256, num_attention_heads=8, num_key_value_heads=1,
        head_dim=16)),
    # Gemma 2: pre and post norms around attention and MLP, attention logits soft-capped at
    # 50 and final logits at 30, query_pre_attn_scalar (27B: 144, not head_dim 128), sliding
    # window on alternate layers.
    "gemma2": ("Gemma2Config", dict(
        hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    # Gemma 3 (text, 1B shape): q/k norms, local layers with their own RoPE base (1e4) and a
    # sliding window, global layers with theta 1e6 and linear scaling 8 (4B-27B).
    "gemma3": ("Gemma3TextConfig", dict(
        hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
}
# Logit sharpening (lm_head scale) per family: fewer near-ties in the greedy comparison, but
# below Gemma 2's final soft-cap (30), where saturated logits would tie.
HEAD_SCALE = {"gemma2": 4.0}
# q and k projections scaled up so that attention logits reach Gemma 2's soft-cap (50): at
# random-init scale (|score| ~ 0.02) the cap would change nothing and could not be tested.
QK_SCALE = {"gemma2": 25.0}
# MLP output scale of tied-head models without sandwich norms (see make_model); Gemma's
# embeddings come in sqrt(hidden) louder.
RESIDUAL_SCALE = {"gemma": 240.0}
# Draft noise (default 0.15) where the draft would otherwise have no token accepted.
DRAFT_NOISE = {"qwen2": 0.05, "gemma2": 0.05}
# Where the speculative test runs a family through the services.
GREEDY_FAMILIES = ["llama3", "llama2", "qwen2", "qwen2_sliding", "qwen3", "mistral",
                   "mistral_sliding", "gemma", "gemma2", "gemma3"]


def make_config(name: str, **overrides):
    import transformers

    from specdec.models.hub import load_tokenizer

    tok = load_tokenizer("default")
    cls, kwargs = FAMILIES[name]
    kwargs = dict(dict(num_hidden_layers=2, max_position_embeddings=512, vocab_size=len(tok),
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.eos_token_id), **kwargs)
    kwargs.update(overrides)
    return getattr(transformers, cls)(**json.loads(json.dumps(kwargs))), tok


def make_model(name: str, path, seed: int = 1, noise: float = 0.0):
    """A random-weight model of family ``name`` with the default tokenizer, saved to ``path``.

    ``noise`` > 0 perturbs every weight (relative scale): a draft of the same family that
    agrees with the same-seed model often but not always.
    """
    from transformers import AutoModelForCausalLM

    config, tok = make_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their 1 / 0 init
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE.get(name, 1.0))
            layer.self_attn.k_proj.weight.mul_(QK_SCALE.get(name, 1.0))
            if config.tie_word_embeddings and name not in ("gemma2", "gemma3"):
                # A tied head reads the residual stream with the input embedding: at random
                # init the blocks add little to it, and greedy text would echo the last token;
                # a louder MLP (per token) makes the next token depend on more than the last.
                layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE.get(name, 30.0))
        sharpen = HEAD_SCALE.get(name, 20.0)
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(sharpen)
        elif name.startswith("gemma"):  # tied: sharpen the final norm, which scales by 1 + w
            model.model.norm.weight.add_(1.0).mul_(sharpen).sub_(1.0)
        else:
            model.model.norm.weight.mul_(sharpen)
        if noise:
            perturb(model, seed, noise)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


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
    assert cache.k.dtype == torch.bfloat16
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


# What cannot run exactly -> the words its refusal must contain.
REFUSED = {
    "yarn": ("llama2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                             "original_max_position_embeddings": 128}),
             "RoPE type 'yarn'"),
    "longrope": ("llama2", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8, "original_max_position_embeddings": 128}),
        "RoPE type 'longrope'"),
    "partial_rotary": ("llama2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}),
                       "partial_rotary_factor"),
    "activation": ("llama2", dict(hidden_act="gelu"), "activation 'gelu'"),
    "bidirectional": ("gemma3", dict(use_bidirectional_attention=True),
                      "use_bidirectional_attention"),
    "gemma3_attn_softcap": ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "layer_type": ("qwen2", dict(layer_types=["chunked_attention", "full_attention"]),
                   "layer type 'chunked_attention'"),
    "local_rope_scaling": ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
        "RoPE type 'linear' on sliding-window layers"),
    "quantized": ("llama2", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
                  "quantization_config"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_configs_that_cannot_run_exactly_are_refused_naming_the_feature(case):
    family, overrides, words = REFUSED[case]
    config, _ = make_config(family, **overrides)
    with pytest.raises(ValueError) as err:
        ArchConfig.from_hf(config)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("cls, words", [
    ("Gemma3Config", "'gemma3' is not supported (a multimodal Gemma 3"),
    ("Qwen2MoeConfig", "'qwen2_moe' is not supported (mixture-of-experts"),
    ("Phi3Config", "'phi3' is not supported"),
    ("GPT2Config", "'gpt2' is not supported"),
])
def test_other_model_types_are_refused_naming_the_type(cls, words):
    import transformers

    with pytest.raises(ValueError, match="supported") as err:
        ArchConfig.from_hf(getattr(transformers, cls)())
    assert words in str(err.value)


def test_what_changes_nothing_runs_as_plain_llama():
    """A window as long as the context masks nothing; a dynamic RoPE is transformers' default
    one until a sequence outgrows max_position_embeddings, which the engine refuses anyway
    (its test above checks the frequencies bit for bit); biases are weights, not features."""
    mistral, _ = make_config("mistral", sliding_window=512)
    arch = ArchConfig.from_hf(mistral)
    assert arch.sliding_window is None and arch.layer_types is None
    assert ArchConfig.from_hf(make_config("llama2")[0]).features() == []
    assert ArchConfig.from_hf(make_config("qwen2")[0]).features() == []
    llama3 = ArchConfig.from_hf(make_config("llama3")[0])
    assert llama3.features() == ["rope_scaling"]
    # Draft files written before these features existed load as the plain Llama they are.
    fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "rope_theta", "max_context")
    old = ArchConfig(**{f: getattr(llama3, f) for f in fields})
    assert old.features() == [] and old.rope_scaling is None
    # ... and ones written now round-trip through JSON.
    import dataclasses

    assert ArchConfig(**json.loads(json.dumps(dataclasses.asdict(llama3)))) == llama3
    gemma3 = ArchConfig.from_hf(make_config("gemma3")[0])
    assert ArchConfig(**json.loads(json.dumps(dataclasses.asdict(gemma3)))) == gemma3


def test_the_trainable_draft_refuses_what_it_does_not_model():
    from specdec.models.draft_model import DraftModule

    vocab = torch.arange(10)
    DraftModule(ArchConfig.from_hf(make_config("llama3")[0]), torch.zeros(100, 64), vocab)
    with pytest.raises(ValueError, match="qk_norm"):
        DraftModule(ArchConfig.from_hf(make_config("qwen3")[0]), torch.zeros(100, 64), vocab)


@pytest.fixture(scope="module")
def refused_dir(tmp_path_factory):
    """A saved tiny Llama whose config asks for YaRN RoPE."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("refused") / "yarn"
    config, tok = make_config("llama2", num_hidden_layers=1, **REFUSED["yarn"][1])
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("command", [
    ["generate", "hello", "--max-new-tokens", "2"],
    ["serve", "--port", "0"],
])
def test_the_cli_reports_a_refused_model_in_one_line(refused_dir, command):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *command, "--target", refused_dir,
         "--draft", "ngram"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: target service cannot load"), lines[0]
    assert "RoPE type 'yarn' is not supported" in lines[0]
    assert out.stdout == ""
