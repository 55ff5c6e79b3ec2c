"""A model's architecture as the engine runs it: the config checks, RoPE, canonical weights.

``ArchConfig.from_hf`` reads a Hugging Face config and refuses any it cannot run exactly,
naming what is unsupported (docs/models.md); ``canonical_weights`` renames a Hugging Face state
dict into the engine's fused layout (specdec.serving.engine).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# transformers' activation names -> the engine's (F.silu; F.gelu with the tanh approximation)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
FULL, SLIDING = "full_attention", "sliding_attention"
# Families whose blocks differ from Llama's (HF modeling files they follow).
_GEMMA = ("gemma", "gemma2", "gemma3_text")  # sqrt(hidden) embeddings, (1 + w) RMSNorm
_SANDWICH = ("gemma2", "gemma3_text")  # norms after attention and after the MLP as well
_QK_NORM = ("qwen3", "gemma3_text")  # RMSNorm over each head's q and k, before RoPE
_LAYER_TYPES = ("qwen2", "qwen3", "gemma2", "gemma3_text")  # sliding window per config.layer_types
_HINTS = {
    "gemma3": "a multimodal Gemma 3 checkpoint; its text-only form (model_type 'gemma3_text') is "
              "supported",
    "qwen2_moe": "mixture-of-experts blocks", "qwen3_moe": "mixture-of-experts blocks",
    "mixtral": "mixture-of-experts blocks", "phi3": "fused qkv / gate_up weights and longrope",
}


def _rope_parameters(config) -> dict:
    """{layer type or "*": that type's RoPE parameters (rope_type, rope_theta, ...)}.

    transformers >= 5 keeps them in ``config.rope_parameters`` (nested by layer type for
    Gemma 3); older versions in ``rope_scaling`` next to ``rope_theta``."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if any(key in (FULL, SLIDING) for key in params):
        return {key: dict(value or {}) for key, value in params.items() if key in (FULL, SLIDING)}
    return {"*": params}


def _rope_spec(params: dict, config, what: str) -> tuple[float, tuple | None]:
    """(rope_theta, scaling) for one set of RoPE parameters; refuses what is not exact."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r}{what} is not supported (specdec runs "
            f"{', '.join(ROPE_TYPES)} RoPE exactly; YaRN, longrope and others are refused)")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not "
                         "supported")
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type in ("linear", "dynamic"):
        scaling = {"rope_type": rope_type, "factor": float(params["factor"])}
    else:  # llama3
        scaling = {
            "rope_type": rope_type, "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(
                params.get("original_max_position_embeddings") or config.max_position_embeddings),
        }
    return theta, tuple(sorted(scaling.items()))


def rope_inv_freq(theta: float, scaling, head_dim: int, max_context: int) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float32, computed as transformers computes
    them (modeling_rope_utils: default, ``_compute_linear_scaling_rope_parameters``,
    ``_compute_dynamic_ntk_parameters`` at init, ``_compute_llama3_parameters``)."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    s = dict(scaling or ())
    kind = s.get("rope_type", "default")
    if kind == "dynamic":
        # transformers' dynamic NTK base at seq_len = max_position_embeddings. It recomputes the
        # frequencies only once a sequence outgrows max_position_embeddings, which is this
        # engine's context (KVCache refuses longer sequences): within it they stay these.
        seq_len = max_context
        factor = s["factor"]
        theta = theta * ((factor * seq_len / max_context) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        inv_freq /= s["factor"]
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_context_len = s["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed, inv_freq_llama)
    return inv_freq


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    # Beyond plain Llama (the defaults are plain Llama, as older draft files are):
    model_type: str = "llama"
    rope_scaling: tuple | None = None  # (name, value) pairs for the (full-attention) layers' RoPE
    sliding_window: int | None = None  # keys within this many positions, on sliding layers
    layer_types: tuple | None = None  # per layer FULL or SLIDING; None: all full
    sliding_rope_theta: float | None = None  # RoPE base of sliding layers, if its own (Gemma 3)
    hidden_act: str = "silu"  # or "gelu_tanh"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    norm_plus_one: bool = False  # RMSNorm weights are 1 + w (Gemma; folded in at load)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits cap * tanh(x / cap) (Gemma 2)
    final_softcap: float | None = None  # output logits likewise (Gemma 2/3)

    def __post_init__(self):  # from JSON, tuples come back as lists
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(tuple(p) for p in self.rope_scaling))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    def features(self) -> list[str]:
        """What this architecture has beyond a plain Llama block (empty for plain Llama)."""
        plain = ArchConfig(*(getattr(self, f.name) for f in dataclasses.fields(self)[:9]))
        return [f.name for f in dataclasses.fields(self)[10:]
                if getattr(self, f.name) != getattr(plain, f.name)]

    @classmethod
    def from_hf(cls, config) -> "ArchConfig":
        """The engine's architecture for a transformers config, or ValueError naming what in
        it specdec cannot run exactly."""
        mt = getattr(config, "model_type", None)
        act_name = _check_supported(config, mt)
        heads = config.num_attention_heads
        layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        max_context = int(config.max_position_embeddings)
        types, window = _attention_layers(config, mt, layers, max_context)
        theta, scaling, sliding_theta = _rope_of_layers(config, types)
        keep_types = window is not None or sliding_theta is not None
        extra = _family_extras(config, mt)
        return cls(
            hidden_size=config.hidden_size,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=theta,
            max_context=max_context,
            model_type=mt,
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=tuple(types) if keep_types else None,
            sliding_rope_theta=sliding_theta,
            hidden_act=ACTIVATIONS[act_name],
            **extra,
        )

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full causal attention)."""
        if self.sliding_window is None or self.layer_types[i] != SLIDING:
            return None
        return self.sliding_window

    def layer_rope_theta(self, i: int) -> float:
        if self.sliding_rope_theta is not None and self.layer_types is not None \
                and self.layer_types[i] == SLIDING:
            return self.sliding_rope_theta
        return self.rope_theta

def _check_supported(config, mt: str | None) -> str:
    """ValueError for a model type, quantization, activation or attention specdec cannot run
    exactly; the config's activation name otherwise."""
    if mt not in SUPPORTED_MODEL_TYPES:
        hint = f" ({_HINTS[mt]})" if mt in _HINTS else ""
        raise ValueError(
            f"model type {mt!r} is not supported{hint}; specdec runs these decoder-only "
            f"families exactly: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method", "?") \
            if isinstance(config.quantization_config, dict) else "?"
        raise ValueError(f"quantized checkpoints (quantization_config, {method}) are not "
                         "supported: specdec runs float weights")
    act_name = getattr(config, "hidden_activation", None) if mt in ("gemma2", "gemma3_text") \
        else getattr(config, "hidden_act", "silu")
    if act_name not in ACTIVATIONS:
        raise ValueError(f"activation {act_name!r} is not supported (supported: "
                         f"{', '.join(ACTIVATIONS)})")
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not "
                         "supported: specdec runs causal LMs")
    return act_name


def _attention_layers(config, mt: str, layers: int, max_context: int,
                      ) -> tuple[list[str], int | None]:
    """Which layers attend within a sliding window, as each family's HF model masks them, and
    the window (None when no layer uses one)."""
    window = getattr(config, "sliding_window", None)
    if mt == "mistral":
        types = [SLIDING if window is not None else FULL] * layers
    elif mt in _LAYER_TYPES:
        types = list(getattr(config, "layer_types", None) or [FULL] * layers)
    else:  # llama, gemma: their HF models ignore any sliding_window in the config
        types = [FULL] * layers
    if mt in _LAYER_TYPES and window is not None and getattr(config, "layer_types", None) \
            is None and getattr(config, "use_sliding_window", True):
        raise ValueError("sliding_window without layer_types (a transformers version "
                         "before 5 decides the sliding layers differently) is not supported")
    for t in sorted(set(types)):
        if t not in (FULL, SLIDING):
            raise ValueError(f"attention layer type {t!r} is not supported (only "
                             f"{FULL!r} and {SLIDING!r})")
    if window is not None and int(window) >= max_context:
        window = None  # a window as long as the context masks nothing
    return types, int(window) if window is not None and SLIDING in types else None


def _rope_of_layers(config, types: list[str]) -> tuple[float, tuple | None, float | None]:
    """RoPE base and scaling of the (full-attention) layers, and the sliding-window layers'
    own base where it differs (Gemma 3: a global and a local base)."""
    rope = _rope_parameters(config)
    if "*" in rope:
        theta, scaling = _rope_spec(rope["*"], config, "")
        return theta, scaling, None
    theta, scaling = _rope_spec(rope.get(FULL) or {}, config, " (full-attention layers)")
    sliding_theta = None
    if SLIDING in types and rope.get(SLIDING):
        local, local_scaling = _rope_spec(rope[SLIDING], config, " (sliding-window layers)")
        if local_scaling is not None:
            raise ValueError(f"RoPE type {dict(local_scaling)['rope_type']!r} on "
                             "sliding-window layers is not supported")
        sliding_theta = local if local != theta else None
    return theta, scaling, sliding_theta


def _family_extras(config, mt: str) -> dict:
    """The ArchConfig fields of the families whose blocks differ from Llama's."""
    extra = {}
    if mt in _GEMMA:
        extra.update(embed_scale=config.hidden_size ** 0.5, norm_plus_one=True)
    if mt in _SANDWICH:
        extra.update(sandwich_norms=True,
                     attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
                     final_softcap=getattr(config, "final_logit_softcapping", None))
    if mt == "gemma2":
        extra.update(attn_softcap=getattr(config, "attn_logit_softcapping", None))
    elif mt == "gemma3_text" and getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) on "
                         "gemma3_text is not supported (transformers' Gemma 3 ignores it)")
    if mt in _QK_NORM:
        extra.update(qk_norm=True)
    return extra


class Part(NamedTuple):
    """One engine weight as a checkpoint holds it: the Hugging Face tensors concatenated (in
    order, along rows) to make it, and whether it is an RMSNorm's scale."""

    sources: tuple[str, ...]
    norm: bool = False


def canonical_layout(arch: ArchConfig, names) -> dict[str, Part]:
    """The engine's weight names -> the Hugging Face names they are made of, for a checkpoint
    holding ``names`` (a set): q/k/v and gate/up fused, the head the embedding where untied.

    Optional names, present only for the architectures that have them: ``bqkv``, ``bo``,
    ``b_gate_up``, ``b_down`` (biases), ``q_norm`` / ``k_norm`` (per-head norms),
    ``post_attn_norm`` / ``post_mlp_norm`` (Gemma 2/3)."""
    def opt(*sources: str) -> Part | None:
        return Part(sources) if sources[0] in names else None

    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    # A tied model's file may hold only one of the two (safetensors' save_model keeps one).
    out = {"embed": Part((embed if embed in names or head not in names else head,)),
           "norm": Part(("model.norm.weight",), True),
           "head": Part((head if head in names else embed,))}
    for i in range(arch.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = f"layers.{i}."
        out[q + "attn_norm"] = Part((p + "input_layernorm.weight",), True)
        if arch.sandwich_norms:  # Gemma 2/3 name its norms after what they follow
            out[q + "post_attn_norm"] = Part((p + "post_attention_layernorm.weight",), True)
            out[q + "mlp_norm"] = Part((p + "pre_feedforward_layernorm.weight",), True)
            out[q + "post_mlp_norm"] = Part((p + "post_feedforward_layernorm.weight",), True)
        else:
            out[q + "mlp_norm"] = Part((p + "post_attention_layernorm.weight",), True)
        out[q + "wqkv"] = Part((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"))
        out[q + "wo"] = Part((a + "o_proj.weight",))
        out[q + "w_gate_up"] = Part((m + "gate_proj.weight", m + "up_proj.weight"))
        out[q + "w_down"] = Part((m + "down_proj.weight",))
        optional = {
            "bqkv": opt(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
            "bo": opt(a + "o_proj.bias"),
            "b_gate_up": opt(m + "gate_proj.bias", m + "up_proj.bias"),
            "b_down": opt(m + "down_proj.bias"),
        }
        if arch.qk_norm:
            optional.update(q_norm=Part((a + "q_norm.weight",), True),
                            k_norm=Part((a + "k_norm.weight",), True))
        out.update({q + k: v for k, v in optional.items() if v is not None})
    return out


def assemble(part: Part, tensors: list[torch.Tensor], arch: ArchConfig) -> torch.Tensor:
    """One engine weight from its sources' tensors (``canonical_layout``). Gemma's RMSNorm
    scales by (1 + w), computed here once in float32 as transformers computes it on every
    call; a single source is returned as it is (no copy: a tied head is the embedding)."""
    if part.norm and arch.norm_plus_one:
        return 1.0 + tensors[0].float()
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


def canonical_weights(state: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> the engine's names (``canonical_layout``, ``assemble``)."""
    return {name: assemble(part, [state[n] for n in part.sources], arch)
            for name, part in canonical_layout(arch, set(state)).items()}
