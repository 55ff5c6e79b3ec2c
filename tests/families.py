"""The model families of test_families and test_family_configs: each family's config shape
(shrunk from its named checkpoint) and random-weight models built from it. Not a test
module."""

from __future__ import annotations

import json

import torch
from conftest import perturb

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
