"""A Llama-family forward pass over ragged batches with per-session KV caches.

One forward call takes the new tokens of several sessions at once ("ragged" batching, as in
vLLM's flattened token layout): every linear layer runs once over all new tokens of all
sessions, so the weights are read once per pass; attention runs per session against that
session's own cache. A verify pass over k + 1 tokens, a prefill chunk and a draft step of many
sessions are all the same call.

Supports the architectures whose blocks are Llama's (llama, mistral without sliding window,
qwen2 with q/k/v biases, SmolLM), default RoPE. Weights use one canonical naming, filled from a
Hugging Face model (``from_hf``) or a specdec draft file (``specdec.draft_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F

from specdec.kernels import KERNEL_CHOICES, KernelPlan, Linear, choose_kernels, prepack_available, timed

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    @classmethod
    def from_hf(cls, config) -> "ArchConfig":
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported; specdec runs Llama-family "
                f"causal LMs ({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            if config.model_type == "mistral":
                raise ValueError("sliding-window attention is not supported")
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            max_context=int(config.max_position_embeddings),
        )


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
            self.layers.append(
                dict(
                    attn_norm=w(p + "attn_norm"),
                    qkv=Linear(w(p + "wqkv"), opt(p + "bqkv"), plan),
                    o=Linear(w(p + "wo"), None, plan),
                    mlp_norm=w(p + "mlp_norm"),
                    gate_up=Linear(w(p + "w_gate_up"), None, plan),
                    down=Linear(w(p + "w_down"), None, plan),
                )
            )
        self.norm = w("norm")
        self.head = Linear(w("head"), None, plan)
        self.vocab_in = self.embed.shape[0]
        self.vocab_out = self.head.out_features
        self.vocab_map = None if vocab_map is None else vocab_map.to(torch.long)
        half = arch.head_dim // 2
        # As Hugging Face computes it: inv_freq in float32, angles = position * inv_freq.
        self.inv_freq = 1.0 / (
            arch.rope_theta
            ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64).float() / arch.head_dim)
        )
        assert self.inv_freq.shape[0] == half
        self.inv_freq = self.inv_freq.to(self.device)
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
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [N, head_dim / 2]
        emb = torch.cat((angles, angles), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]  # [N, 1, head_dim]
        sin = emb.sin().to(self.dtype)[:, None, :]
        masks = []
        for n0, t in zip(lengths, sizes):
            if t == 1:
                masks.append(None)  # one query attends to the whole cache
            else:
                q_pos = torch.arange(n0, n0 + t, device=self.device)[:, None]
                k_pos = torch.arange(n0 + t, device=self.device)[None, :]
                masks.append(k_pos <= q_pos)  # [t, n0 + t]
        offsets = [0]
        for t in sizes:
            offsets.append(offsets[-1] + t)

        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        x = self.embed[flat]  # [N, hidden]
        n = x.shape[0]
        for li, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["attn_norm"])
            qkv = layer["qkv"](h)  # [N, (hq + 2 hkv) d]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = q.view(n, hq, d)
            k = k.view(n, hkv, d)
            v = v.view(n, hkv, d)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            outs = []
            for i, cache in enumerate(caches):
                s, e, n0 = offsets[i], offsets[i + 1], lengths[i]
                cache.k[li, :, n0 : n0 + e - s] = k[s:e].transpose(0, 1)
                cache.v[li, :, n0 : n0 + e - s] = v[s:e].transpose(0, 1)
                keys = cache.k[li, :, : n0 + e - s]  # [hkv, S, d]
                values = cache.v[li, :, : n0 + e - s]
                attn = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None],  # [1, hq, t, d]
                    keys[None],
                    values[None],
                    attn_mask=masks[i],
                    enable_gqa=hq != hkv,
                )  # [1, hq, t, d]
                outs.append(attn[0].transpose(0, 1).reshape(e - s, hq * d))
            x = x + layer["o"](torch.cat(outs) if len(outs) > 1 else outs[0])
            h = self._rms_norm(x, layer["mlp_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)

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
    """Hugging Face Llama-family state dict -> the engine's names (q/k/v and gate/up fused)."""
    out = {"embed": state["model.embed_tokens.weight"], "norm": state["model.norm.weight"]}
    out["head"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    for i in range(arch.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[f"layers.{i}.attn_norm"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm"] = state[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.wqkv"] = torch.cat(
            [state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"]]
        )
        if a + "q_proj.bias" in state:
            out[f"layers.{i}.bqkv"] = torch.cat(
                [state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"]]
            )
        out[f"layers.{i}.wo"] = state[a + "o_proj.weight"]
        out[f"layers.{i}.w_gate_up"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.w_down"] = state[p + "mlp.down_proj.weight"]
    return out
