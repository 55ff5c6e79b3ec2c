"""A Llama-family forward pass over ragged batches with per-session KV caches.

One forward call takes the new tokens of several sessions at once ("ragged" batching, as in
vLLM's flattened token layout): every linear layer runs once over all new tokens of all
sessions, so the weights are read once per pass; attention runs per session against that
session's own cache. A verify pass over k + 1 tokens, a prefill chunk and a draft step of many
sessions are all the same call.

Runs the decoder-only families whose blocks are Llama's or a few exact variations of it, each
checked against transformers' own forward in tests/test_families.py (docs/models.md):
llama (Llama 2 / 3.x, SmolLM), mistral, qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm),
gemma, gemma2 (soft-capping, sandwich norms), gemma3_text (q/k norms, local/global RoPE);
RoPE types default, linear, dynamic (within the model's context) and llama3; sliding-window
attention, per layer. ``ArchConfig.from_hf`` refuses any config it cannot run exactly, naming
what is unsupported. Every feature beyond plain Llama is a branch taken only for a config that
has it: a plain Llama pass runs the same ops as before they existed. Weights use one canonical
naming, filled from a Hugging Face model (``from_hf``) or a specdec draft file
(``specdec.draft_model``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from specdec.kernels import KERNEL_CHOICES, KernelPlan, Linear, choose_kernels, prepack_available, timed

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
        heads = config.num_attention_heads
        layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        max_context = int(config.max_position_embeddings)
        act_name = getattr(config, "hidden_activation", None) if mt in ("gemma2", "gemma3_text") \
            else getattr(config, "hidden_act", "silu")
        if act_name not in ACTIVATIONS:
            raise ValueError(f"activation {act_name!r} is not supported (supported: "
                             f"{', '.join(ACTIVATIONS)})")
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not "
                             "supported: specdec runs causal LMs")

        # Which layers attend within a sliding window, as each family's HF model masks them.
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
        window = int(window) if window is not None and SLIDING in types else None

        rope = _rope_parameters(config)
        sliding_theta = None
        if "*" in rope:
            theta, scaling = _rope_spec(rope["*"], config, "")
        else:  # per layer type (Gemma 3: a global and a local base)
            theta, scaling = _rope_spec(rope.get(FULL) or {}, config, " (full-attention layers)")
            if SLIDING in types and rope.get(SLIDING):
                local, local_scaling = _rope_spec(rope[SLIDING], config, " (sliding-window layers)")
                if local_scaling is not None:
                    raise ValueError(f"RoPE type {dict(local_scaling)['rope_type']!r} on "
                                     "sliding-window layers is not supported")
                sliding_theta = local if local != theta else None
        keep_types = window is not None or sliding_theta is not None

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
class KVCache:
    """Keys and values of one session: [layers, kv_heads, capacity, head_dim] each.

    ``length`` positions are valid; truncating is setting the length (rollback is free).
    Capacity grows by doubling, up to the model's context.
    """

    GRANULE = 64

    def __init__(self, arch: ArchConfig, device: torch.device, dtype: torch.dtype):
        self.arch = arch
        self.length = 0
        self.k = torch.empty(0, device=device, dtype=dtype)
        self.v = torch.empty(0, device=device, dtype=dtype)
        self._reserve(self.GRANULE)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _reserve(self, capacity: int) -> None:
        a = self.arch
        shape = (a.num_layers, a.num_kv_heads, capacity, a.head_dim)
        k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        v = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def ensure(self, length: int) -> None:
        if length > self.arch.max_context:
            raise ValueError(
                f"sequence of {length} tokens exceeds the model's context of "
                f"{self.arch.max_context}"
            )
        if length > self.capacity:
            grown = max(2 * self.capacity, -(-length // self.GRANULE) * self.GRANULE)
            self._reserve(min(grown, max(self.arch.max_context, length)))

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class LlamaEngine:
    """Runs a Llama-family model over ragged batches of sessions.

    ``vocab_map`` (optional, [vocab_out] int64) says which token id each output logit is for,
    when the head covers only part of the vocabulary (reduced draft heads).
    """

    def __init__(
        self,
        arch: ArchConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        vocab_map: torch.Tensor | None = None,
    ):
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.float16
        # CPU linear kernels (specdec.kernels): "auto" times both at start and keeps the faster
        # per shape; "mkl" is F.linear; "onednn" prepacked weights. GPUs use F.linear.
        plan = None
        if kernels != "mkl" and prepack_available(self.device):
            plan = KernelPlan()
        elif kernels == "onednn":
            raise ValueError("kernels='onednn' needs a CPU build of torch with oneDNN")
        self.kernels = plan

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, self.dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("embed")  # [vocab_in, hidden]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"layers.{i}."
            layer = dict(
                attn_norm=w(p + "attn_norm"),
                qkv=Linear(w(p + "wqkv"), opt(p + "bqkv"), plan),
                o=Linear(w(p + "wo"), opt(p + "bo"), plan),
                mlp_norm=w(p + "mlp_norm"),
                gate_up=Linear(w(p + "w_gate_up"), opt(p + "b_gate_up"), plan),
                down=Linear(w(p + "w_down"), opt(p + "b_down"), plan),
            )
            # Only for the architectures that have them (a key's absence is the plain path).
            for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
                if p + name in weights:
                    layer[name] = w(p + name)
            if arch.qk_norm and "q_norm" not in layer:
                raise ValueError(f"{arch.model_type}: layer {i} has no q_norm / k_norm weights")
            if arch.sandwich_norms and "post_attn_norm" not in layer:
                raise ValueError(f"{arch.model_type}: layer {i} has no post-attention norm")
            self.layers.append(layer)
        self.norm = w("norm")
        self.head = Linear(w("head"), None, plan)
        self.vocab_in = self.embed.shape[0]
        self.vocab_out = self.head.out_features
        self.vocab_map = None if vocab_map is None else vocab_map.to(torch.long)
        # As transformers computes them: inv_freq in float32, angles = position * inv_freq.
        # One set per distinct RoPE (Gemma 3's local and global layers differ).
        thetas = [arch.layer_rope_theta(i) for i in range(arch.num_layers)] or [arch.rope_theta]
        self.rope_groups = sorted(set(thetas), key=thetas.index)
        self.inv_freqs = []
        for theta in self.rope_groups:
            scaling = arch.rope_scaling if theta == arch.rope_theta else None
            inv_freq = rope_inv_freq(theta, scaling, arch.head_dim, arch.max_context)
            assert inv_freq.shape[0] == arch.head_dim // 2
            self.inv_freqs.append(inv_freq.to(self.device))
        self.inv_freq = self.inv_freqs[0]
        self.layer_rope = [self.rope_groups.index(t) for t in thetas]
        self.layer_window = [arch.layer_window(i) for i in range(arch.num_layers)]
        self.windows = sorted(set(self.layer_window), key=self.layer_window.index)
        self.embed_scale = None if arch.embed_scale is None else \
            torch.tensor(arch.embed_scale, dtype=torch.float32).to(self.device, self.dtype)
        self.act = F.silu if arch.hidden_act == "silu" else \
            (lambda x: F.gelu(x, approximate="tanh"))
        if plan is not None:
            if kernels == "auto":
                choose_kernels(plan, self._linears(), self._forward_ms)
            else:
                for lin in self._linears():
                    lin.keep_only(plan.used())

    def _linears(self) -> list[Linear]:
        return [layer[n] for layer in self.layers for n in ("qkv", "o", "gate_up", "down")] + [
            self.head]

    def _forward_ms(self, rows: int, context: int = 128) -> float:
        """Milliseconds of one forward over ``rows`` new tokens after ``context`` tokens."""
        cache = self.new_cache()
        tokens = torch.arange(context + rows, device=self.device) % self.vocab_in
        self.forward([cache], [tokens[:context]], [1])
        return timed(lambda: self.forward([cache], [tokens[context:]], [rows]))

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model, device="cpu", kernels: str = "auto") -> "LlamaEngine":
        """From a transformers Llama-family causal LM (weights are copied)."""
        arch = ArchConfig.from_hf(model.config)
        return cls(arch, canonical_weights(model.state_dict(), arch), device, kernels)

    def new_cache(self) -> KVCache:
        return KVCache(self.arch, self.device, self.dtype)

    # -- forward ----------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def _softcapped_attention(self, q, keys, values, mask):
        """Attention with logit soft-capping, as transformers' eager Gemma 2 attention:
        scores * scale, then cap * tanh(scores / cap), mask, softmax in float32."""
        a = self.arch
        if a.num_heads != a.num_kv_heads:
            groups = a.num_heads // a.num_kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        scale = a.attn_scale if a.attn_scale is not None else a.head_dim ** -0.5
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale
        scores = torch.tanh(scores / a.attn_softcap) * a.attn_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    @torch.inference_mode()
    def forward(
        self,
        caches: Sequence[KVCache],
        tokens: Sequence[torch.Tensor],  # each [t_i] int64: new tokens of session i
        num_logits: Sequence[int],  # logits wanted for the last n_i positions of session i
    ) -> list[torch.Tensor]:
        """Append ``tokens[i]`` to ``caches[i]`` and return each session's last logits.

        Returns, per session, [num_logits[i], vocab_out] float32 (empty when 0).
        """
        a = self.arch
        lengths = [c.length for c in caches]
        sizes = [int(t.shape[0]) for t in tokens]
        for c, n0, t in zip(caches, lengths, sizes):
            assert t > 0, "every session in a forward pass needs at least one new token"
            c.ensure(n0 + t)
        flat = torch.cat([t.to(self.device, torch.long) for t in tokens])  # [N]
        positions = torch.cat(
            [torch.arange(n0, n0 + t, device=self.device) for n0, t in zip(lengths, sizes)]
        )  # [N]
        ropes = []  # (cos, sin) per RoPE group, each [N, 1, head_dim]
        for inv_freq in self.inv_freqs:
            angles = positions.float()[:, None] * inv_freq[None, :]  # [N, head_dim / 2]
            emb = torch.cat((angles, angles), dim=-1)
            ropes.append((emb.cos().to(self.dtype)[:, None, :],
                          emb.sin().to(self.dtype)[:, None, :]))
        # Per window (None: full causal) and session: the first key position and the mask.
        spans = {}
        for window in self.windows:
            per = []
            for n0, t in zip(lengths, sizes):
                start = 0 if window is None else max(0, n0 - window + 1)
                if t == 1:
                    per.append((start, None))  # one query attends to all its keys
                    continue
                q_pos = torch.arange(n0, n0 + t, device=self.device)[:, None]
                k_pos = torch.arange(start, n0 + t, device=self.device)[None, :]
                mask = k_pos <= q_pos  # [t, n0 + t - start]
                if window is not None:
                    mask &= k_pos > q_pos - window  # transformers' sliding_window_overlay
                per.append((start, mask))
            spans[window] = per
        offsets = [0]
        for t in sizes:
            offsets.append(offsets[-1] + t)

        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        softcap = a.attn_softcap is not None
        x = self.embed[flat]  # [N, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        n = x.shape[0]
        for li, layer in enumerate(self.layers):
            cos, sin = ropes[self.layer_rope[li]]
            span = spans[self.layer_window[li]]
            h = self._rms_norm(x, layer["attn_norm"])
            qkv = layer["qkv"](h)  # [N, (hq + 2 hkv) d]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = q.view(n, hq, d)
            k = k.view(n, hkv, d)
            v = v.view(n, hkv, d)
            if "q_norm" in layer:  # per-head RMSNorm before RoPE (Qwen3, Gemma 3)
                q = self._rms_norm(q, layer["q_norm"])
                k = self._rms_norm(k, layer["k_norm"])
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            outs = []
            for i, cache in enumerate(caches):
                s, e, n0 = offsets[i], offsets[i + 1], lengths[i]
                start, mask = span[i]
                cache.k[li, :, n0 : n0 + e - s] = k[s:e].transpose(0, 1)
                cache.v[li, :, n0 : n0 + e - s] = v[s:e].transpose(0, 1)
                keys = cache.k[li, :, start : n0 + e - s]  # [hkv, S, d]
                values = cache.v[li, :, start : n0 + e - s]
                if softcap:
                    attn = self._softcapped_attention(q[s:e].transpose(0, 1)[None], keys[None],
                                                      values[None], mask)
                else:
                    attn = F.scaled_dot_product_attention(
                        q[s:e].transpose(0, 1)[None],  # [1, hq, t, d]
                        keys[None],
                        values[None],
                        attn_mask=mask,
                        enable_gqa=hq != hkv,
                        scale=a.attn_scale,
                    )  # [1, hq, t, d]
                outs.append(attn[0].transpose(0, 1).reshape(e - s, hq * d))
            attn_out = layer["o"](torch.cat(outs) if len(outs) > 1 else outs[0])
            if "post_attn_norm" in layer:  # Gemma 2/3
                attn_out = self._rms_norm(attn_out, layer["post_attn_norm"])
            x = x + attn_out
            h = self._rms_norm(x, layer["mlp_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            mlp_out = layer["down"](self.act(gate) * up)
            if "post_mlp_norm" in layer:
                mlp_out = self._rms_norm(mlp_out, layer["post_mlp_norm"])
            x = x + mlp_out

        for c, n0, t in zip(caches, lengths, sizes):
            c.length = n0 + t
        rows = torch.cat(
            [
                torch.arange(offsets[i + 1] - m, offsets[i + 1], device=self.device)
                for i, m in enumerate(num_logits)
            ]
        )
        if rows.numel() == 0:
            return [torch.empty(0, self.vocab_out) for _ in caches]
        logits = self.head(self._rms_norm(x[rows], self.norm)).float()  # [sum n_i, vocab_out]
        if a.final_softcap is not None:  # Gemma 2/3
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return list(logits.split(list(num_logits)))

    def token_ids(self, out_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of output logit indices (identity without a vocab_map)."""
        return out_ids if self.vocab_map is None else self.vocab_map.to(out_ids.device)[out_ids]

    def full_vocab_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, vocab_out] -> [n, vocab_size], -inf where the head has no logit."""
        if self.vocab_map is None:
            return logits
        full = torch.full((logits.shape[0], vocab_size), float("-inf"), device=logits.device)
        full[:, self.vocab_map.to(logits.device)] = logits
        return full


def canonical_weights(state: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> the engine's names (q/k/v and gate/up fused).

    Optional names, present only for the architectures that have them: ``bqkv``, ``bo``,
    ``b_gate_up``, ``b_down`` (biases), ``q_norm`` / ``k_norm`` (per-head norms),
    ``post_attn_norm`` / ``post_mlp_norm`` (Gemma 2/3). Gemma's RMSNorm scales by (1 + w),
    computed here once in float32 as transformers computes it on every call.
    """
    def norm(name: str) -> torch.Tensor:
        w = state[name]
        return 1.0 + w.float() if arch.norm_plus_one else w

    def cat(names: list[str]) -> torch.Tensor | None:
        return torch.cat([state[n] for n in names]) if names[0] in state else None

    out = {"embed": state["model.embed_tokens.weight"], "norm": norm("model.norm.weight")}
    out["head"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    for i in range(arch.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = f"layers.{i}."
        out[q + "attn_norm"] = norm(p + "input_layernorm.weight")
        if arch.sandwich_norms:  # Gemma 2/3 name its norms after what they follow
            out[q + "post_attn_norm"] = norm(p + "post_attention_layernorm.weight")
            out[q + "mlp_norm"] = norm(p + "pre_feedforward_layernorm.weight")
            out[q + "post_mlp_norm"] = norm(p + "post_feedforward_layernorm.weight")
        else:
            out[q + "mlp_norm"] = norm(p + "post_attention_layernorm.weight")
        out[q + "wqkv"] = cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        out[q + "wo"] = state[a + "o_proj.weight"]
        out[q + "w_gate_up"] = cat([m + "gate_proj.weight", m + "up_proj.weight"])
        out[q + "w_down"] = state[m + "down_proj.weight"]
        optional = {
            "bqkv": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            "bo": state.get(a + "o_proj.bias"),
            "b_gate_up": cat([m + "gate_proj.bias", m + "up_proj.bias"]),
            "b_down": state.get(m + "down_proj.bias"),
        }
        if arch.qk_norm:
            optional.update(q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"))
        out.update({q + k: v for k, v in optional.items() if v is not None})
    return out
