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
has it: a plain Llama pass runs the same ops as before they existed. On CPU in fp32 a plain
Llama block runs what lies between its linear layers on specdec's fused C ops
(``native/layerops.c``: three calls per layer where torch's ops were ~30, each 3-45 us to
dispatch), the other families on torch's ops (``_native_ops``); when every linear layer of a pass
runs on smallm (an int8 draft's always do), the whole layer stack is one C call
(``sd_layers``: the int8 draft's one-token forward 1.17x faster on one EPYC core, the fp32
target's 1.06-1.12x). Weights use one canonical
naming, filled from a Hugging Face model (``from_hf``) or a specdec draft file
(``specdec.models.draft_model``).
"""

from __future__ import annotations

import ctypes
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from specdec.config import DEFAULT_NUMERICS, KERNEL_CHOICES, NUMERICS
from specdec.serving.arch import ArchConfig, canonical_weights, rope_inv_freq
from specdec.serving.kernels import (
    MEASURED_ROWS,
    MKL,
    MKL_T,
    ONEDNN,
    QUANTIZATIONS,
    SMALLM,
    GroupedCodes,
    Int8Linear,
    KernelPlan,
    Linear,
    choose_kernels,
    prepack_available,
    smallm_available,
    smallm_library,
    timed,
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

    def fork(self, length: int) -> "KVCache":
        """A new cache holding a copy of this one's first ``length`` positions (a branch of
        the speculation cache), with room for a short continuation."""
        assert 0 <= length <= self.length, (length, self.length)
        fork = KVCache.__new__(KVCache)
        fork.arch, fork.length = self.arch, length
        capacity = min(max(length + self.GRANULE, self.GRANULE), max(self.arch.max_context,
                                                                       length))
        shape = (self.arch.num_layers, self.arch.num_kv_heads, capacity, self.arch.head_dim)
        fork.k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        fork.v = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        fork.k[:, :, :length] = self.k[:, :, :length]
        fork.v[:, :, :length] = self.v[:, :, :length]
        return fork


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
        quantize: str | None = None,
        native: bool = True,
        codes: dict[str, GroupedCodes] | None = None,
        numerics: str = DEFAULT_NUMERICS,
        dtype: torch.dtype | None = None,
    ):
        """``dtype``: of the weights, activations and KV cache (None: float32 on CPU, bfloat16
        elsewhere); logits leave in float32 and RMSNorm statistics are float32 whatever it is.
        ``native``: run what a layer does between its linear layers on the fused C ops
        (``native/layerops.c``) where they can run it exactly (see ``_native_ops``); False:
        always torch's ops. ``codes``: weights (by canonical name) that are also held exactly
        as grouped int8 codes (a GGUF file's blocks, ``specdec.models.gguf_codes``), which
        smallm then streams instead of their float32 (the same results). ``numerics``
        "integer": those layers compute llama.cpp's integer dot products instead
        (``sd_linear_int``), every row count on smallm, so that a position's logits are the
        same bits whichever pass computes them; it applies on CPU where smallm runs (kernels
        auto or smallm) and the model has codes, and ``self.numerics`` says what runs."""
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.arch = arch
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.dtype = dtype
        # CPU linear kernels (specdec.serving.kernels): "auto" times them at start and keeps the
        # fastest per shape; "mkl" is F.linear, "mkl-t" oneMKL on the transposed weight,
        # "onednn" prepacked weights, "smallm" specdec's own few-rows kernel. GPUs use F.linear.
        # specdec's CPU kernels are float32's: other dtypes run F.linear.
        fp32_cpu = self.device.type == "cpu" and dtype == torch.float32
        onednn = fp32_cpu and prepack_available(self.device)  # (False off CPU)
        if kernels in ("onednn", "smallm", "mkl-t") and not fp32_cpu:
            raise ValueError(f"kernels={kernels!r} runs float32 on CPU; {dtype} on "
                             f"{self.device.type} runs F.linear (kernels 'auto' or 'mkl')")
        if kernels == "onednn" and not onednn:
            raise ValueError("kernels='onednn' needs a CPU build of torch with oneDNN")
        smallm = kernels in ("auto", SMALLM) and fp32_cpu and \
            smallm_available(self.device)  # (built once)
        if kernels == "smallm" and not smallm:
            raise ValueError("kernels='smallm' needs a CPU with AVX-512 or AVX2 + FMA and a C "
                             "compiler (cc, gcc or $CC)")
        if quantize is not None and quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)} or None, got "
                             f"{quantize!r}")
        codes = codes or {}
        integer = numerics == "integer" and smallm and quantize is None and bool(codes)
        self.numerics = "integer" if integer else "float"
        plan = None  # quantized: one int8 product for every shape, nothing to choose between
        if integer:  # one kernel for every row count: no row's numbers depend on its pass
            plan = KernelPlan.fixed(SMALLM)
        elif fp32_cpu and quantize is None:
            plan = KernelPlan(trying=(MKL, MKL_T) + ((ONEDNN,) if onednn else ()) +
                              ((SMALLM,) if smallm else ())) \
                if kernels == "auto" else KernelPlan.fixed(kernels)
        self.kernels = plan

        def linear(name: str, bias: torch.Tensor | None):
            if quantize is not None:
                return Int8Linear(w(name), bias)
            return Linear(w(name), bias, plan, codes.get(name) if plan is not None else None,
                          integer=integer)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, self.dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def norm(name: str) -> torch.Tensor:
            # Gemma's (1 + w) scales the float32 statistic in float32, as transformers does
            # (``_rms_norm``); the others' w multiplies after the cast to the model's dtype.
            if arch.norm_plus_one:
                return weights[name].to(self.device, torch.float32)
            return w(name)

        self.embed = w("embed")  # [vocab_in, hidden]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"layers.{i}."
            layer = dict(
                attn_norm=norm(p + "attn_norm"),
                qkv=linear(p + "wqkv", opt(p + "bqkv")),
                o=linear(p + "wo", opt(p + "bo")),
                mlp_norm=norm(p + "mlp_norm"),
                gate_up=linear(p + "w_gate_up", opt(p + "b_gate_up")),
                down=linear(p + "w_down", opt(p + "b_down")),
            )
            # Only for the architectures that have them (a key's absence is the plain path).
            for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
                if p + name in weights:
                    layer[name] = norm(p + name)
            if arch.qk_norm and "q_norm" not in layer:
                raise ValueError(f"{arch.model_type}: layer {i} has no q_norm / k_norm weights")
            if arch.sandwich_norms and "post_attn_norm" not in layer:
                raise ValueError(f"{arch.model_type}: layer {i} has no post-attention norm")
            self.layers.append(layer)
        self.norm = norm("norm")
        self.head = linear("head", None)
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
        self.native = self._native_ops() if native else None
        self.whole_stack = True  # (see _whole_stack)
        self._stack = None  # the layers as sd_layers reads them, built at first use
        if plan is not None and plan.trying:
            choose_kernels(plan, self._linears(), self.forward_timer())
            self._stack = None  # it pointed into weight layouts the choice may have freed

    def _native_ops(self):
        """The fused layer ops' library, where they compute this model's layers: on CPU in
        float32, for the plain Llama block (SiLU MLP, RoPE over the whole head, no q/k norms,
        sandwich norms or soft-capping: Llama, Mistral, Qwen2 and the drafts; the other
        families keep torch's ops). None elsewhere, or where the library cannot be built."""
        a = self.arch
        plain = a.hidden_act == "silu" and not a.qk_norm and not a.sandwich_norms and \
            a.attn_softcap is None and a.head_dim % 2 == 0 and a.num_heads % a.num_kv_heads == 0
        if not plain or self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        built = smallm_library()
        return None if built is None else built[0]

    def _linears(self) -> list[Linear]:
        return [layer[n] for layer in self.layers for n in ("qkv", "o", "gate_up", "down")] + [
            self.head]

    def forward_timer(self, context: int = 128, max_rows: int = max(MEASURED_ROWS),
                      ) -> Callable[[int], float]:
        """ms(rows): milliseconds of one forward over ``rows`` <= ``max_rows`` new tokens after
        ``context`` tokens (one cache, prefilled once: each probe cuts it back to the context).
        What kernel choice, start-up calibration and ``specdec bench-verify`` time."""
        cache = self.new_cache()
        tokens = torch.arange(context + max_rows, device=self.device) % self.vocab_in
        self.forward([cache], [tokens[:context]], [1])
        return lambda rows: self.timed_forward(cache, context, tokens[context:context + rows])

    def timed_forward(self, cache: KVCache, context: int, tokens: torch.Tensor) -> float:
        """Milliseconds of one forward over ``tokens`` after the cache's first ``context``
        positions (the cache is cut back to them first): the one cost probe of kernel choice,
        start-up calibration, ``specdec bench-verify`` and draft evaluation."""
        cache.truncate(context)
        return timed(lambda: self.forward([cache], [tokens], [len(tokens)]))

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model, device="cpu", kernels: str = "auto",
                quantize: str | None = None, gguf=None,
                numerics: str = DEFAULT_NUMERICS,
                dtype: torch.dtype | None = None) -> "LlamaEngine":
        """From a transformers Llama-family causal LM (weights are copied); ``gguf``: the GGUF
        file it was dequantized from, whose blocks smallm then streams where they encode a
        weight exactly (``specdec.models.gguf_codes``)."""
        arch = ArchConfig.from_hf(model.config)
        weights = canonical_weights(model.state_dict(), arch)
        codes = None
        if gguf is not None and quantize is None and torch.device(device).type == "cpu" \
                and dtype in (None, torch.float32):
            from specdec.models.gguf_codes import exact_codes

            codes = exact_codes(gguf, weights)
        return cls(arch, weights, device, kernels, quantize=quantize, codes=codes,
                   numerics=numerics, dtype=dtype)

    @classmethod
    def from_checkpoint(cls, model_dir, device="cpu", kernels: str = "auto",
                        quantize: str | None = None, gguf=None,
                        numerics: str = DEFAULT_NUMERICS,
                        dtype: torch.dtype | None = None) -> "LlamaEngine":
        """From a Hugging Face model directory's safetensors, read shard by shard straight
        into ``dtype`` on ``device`` (``specdec.models.checkpoint``): the host never holds the
        model twice. Otherwise as ``from_hf``."""
        from transformers import AutoConfig

        from specdec.models.checkpoint import load_weights

        device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        arch = ArchConfig.from_hf(AutoConfig.from_pretrained(model_dir))
        weights = load_weights(model_dir, arch, device, dtype)
        codes = None
        if gguf is not None and quantize is None and device.type == "cpu" \
                and dtype == torch.float32:
            from specdec.models.gguf_codes import exact_codes

            codes = exact_codes(gguf, weights)
        return cls(arch, weights, device, kernels, quantize=quantize, codes=codes,
                   numerics=numerics, dtype=dtype)

    def new_cache(self) -> KVCache:
        return KVCache(self.arch, self.device, self.dtype)

    # -- forward ----------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm with its statistic in float32: Llama's w * norm(x).to(dtype), Gemma's
        ((1 + w) * norm(x)).to(dtype) with 1 + w held in float32 (transformers' two forms)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        if weight.dtype != x.dtype:  # float32 (1 + w) of a lower-precision model
            return (weight * xf).to(x.dtype)
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
        return self.forward_features(caches, tokens, num_logits)[0]

    def forward_features(
        self,
        caches: Sequence[KVCache],
        tokens: Sequence[torch.Tensor],
        num_logits: Sequence[int],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and with each session's logits the rows the head read them from: the
        final norm's output at those positions, [num_logits[i], hidden] (the target's
        *feature* of a position, what a feature-conditioned draft is given)."""
        p = self._layout(caches, tokens)
        x = self.embed[p.flat]  # [N, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.native is not None and self._whole_stack(x.shape[0]):
            self._native_layers(x, caches, p)
        elif self.native is not None:
            delta = None  # each layer's MLP output, added to x by the next layer's first op
            for li, layer in enumerate(self.layers):
                delta = self._native_block(x, delta, li, layer, caches, p)
            x += delta
        else:
            for li, layer in enumerate(self.layers):
                x = self._block(x, li, layer, caches, p)
        for c, n0, t in zip(caches, p.lengths, p.sizes):
            c.length = n0 + t
        rows = torch.cat([torch.arange(p.offsets[i + 1] - m, p.offsets[i + 1], device=self.device)
                          for i, m in enumerate(num_logits)])
        if rows.numel() == 0:
            return ([torch.empty(0, self.vocab_out, device=self.device) for _ in caches],
                    [x.new_empty(0, x.shape[1]) for _ in caches])
        if self.numerics == "integer" and self.native is not None:  # per row, by construction
            picked, feats = x[rows].contiguous(), torch.empty(len(rows), x.shape[1])
            self.native.sd_add_rms_norm(picked.data_ptr(), None,
                                        self.norm.data_ptr(), feats.data_ptr(), len(rows),
                                        x.shape[1], self.arch.rms_norm_eps)
        else:
            feats = self._rms_norm(x[rows], self.norm)
        logits = self.head(feats).float()  # [sum n_i, vocab_out]
        if self.arch.final_softcap is not None:  # Gemma 2/3
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return list(logits.split(list(num_logits))), list(feats.split(list(num_logits)))

    def _layout(self, caches: Sequence[KVCache], tokens: Sequence[torch.Tensor]) -> "_Pass":
        """Where each session's new tokens sit in the flat batch, their RoPE angles, and per
        attention window the first key position and causal mask of each session."""
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
        native_ropes = []  # ... for the native path: [N, head_dim / 2] (the halves are equal)
        for inv_freq in self.inv_freqs:
            angles = positions.float()[:, None] * inv_freq[None, :]  # [N, head_dim / 2]
            if self.native is not None:
                native_ropes.append((angles.cos().contiguous(), angles.sin().contiguous()))
                continue
            emb = torch.cat((angles, angles), dim=-1)
            ropes.append((emb.cos().to(self.dtype)[:, None, :],
                          emb.sin().to(self.dtype)[:, None, :]))
        offsets = [0]
        for t in sizes:
            offsets.append(offsets[-1] + t)
        if self.native is not None:  # (it masks and windows each session's keys itself)
            return _Pass(lengths, sizes, offsets, flat, ropes, {}, native_ropes)
        spans = {}
        for window in self.windows:  # None: full causal
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
        return _Pass(lengths, sizes, offsets, flat, ropes, spans, [])

    def _block(self, x: torch.Tensor, li: int, layer: dict, caches: Sequence[KVCache],
               p: "_Pass") -> torch.Tensor:
        """One decoder layer over the flat batch: attention (per session), then the MLP."""
        a = self.arch
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        n = x.shape[0]
        cos, sin = p.ropes[self.layer_rope[li]]
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
        attn_out = layer["o"](self._attend(q, k, v, li, caches, p))
        if "post_attn_norm" in layer:  # Gemma 2/3
            attn_out = self._rms_norm(attn_out, layer["post_attn_norm"])
        x = x + attn_out
        h = self._rms_norm(x, layer["mlp_norm"])
        gate, up = layer["gate_up"](h).chunk(2, dim=-1)
        mlp_out = layer["down"](self.act(gate) * up)
        if "post_mlp_norm" in layer:
            mlp_out = self._rms_norm(mlp_out, layer["post_mlp_norm"])
        return x + mlp_out

    def _whole_stack(self, rows: int) -> bool:
        """Whether a pass of ``rows`` runs every layer in one native call (``sd_layers``): the
        native path with every linear layer on smallm at that row count (int8 layers always
        are) and one RoPE. Set ``whole_stack = False`` to loop over the layers in Python (the
        same ops: tests compare the two)."""
        if not self.whole_stack:
            return False
        if self._stack is None:
            self._stack = _layer_structs(self.layers, self.layer_window) \
                if len(self.inv_freqs) == 1 else ()
        return bool(self._stack) and (self.kernels is None or self.kernels.kernel(rows) == SMALLM)

    def _native_layers(self, x: torch.Tensor, caches: Sequence[KVCache], p: "_Pass") -> None:
        """Every decoder layer over the flat batch x (in place) in one ``sd_layers`` call."""
        a, lib, m = self.arch, self.native, len(caches)
        layers, panel, _keep = self._stack
        cos, sin = p.native_ropes[0]
        f = 4  # bytes per float32
        ints, longs, ptrs = ctypes.c_int * (m + 1), ctypes.c_long * m, ctypes.c_void_p * m
        status = lib.sd_layers(
            x.data_ptr(), x.shape[0], x.shape[1], layers, len(self.layers), a.rms_norm_eps, m,
            ints(*p.offsets), ints(*p.lengths), ptrs(*(c.k.data_ptr() for c in caches)),
            ptrs(*(c.v.data_ptr() for c in caches)), longs(*(c.k.stride(0) for c in caches)),
            longs(*(c.k.stride(1) for c in caches)), cos.data_ptr(), sin.data_ptr(),
            a.attn_scale if a.attn_scale is not None else a.head_dim ** -0.5, a.num_heads,
            a.num_kv_heads, a.head_dim, panel, torch.get_num_threads())
        if status != 0:
            raise MemoryError("sd_layers: no memory for a pass's scratch rows")

    def _native_block(self, x: torch.Tensor, delta: torch.Tensor | None, li: int, layer: dict,
                      caches: Sequence[KVCache], p: "_Pass") -> torch.Tensor:
        """``_block`` on the fused C ops: x += delta (the last layer's MLP output), attention
        and its residual in place, and this layer's MLP output returned (not yet added)."""
        a, lib = self.arch, self.native
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        n, hidden = x.shape
        f = 4  # bytes per float32
        h = torch.empty_like(x)
        lib.sd_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                            layer["attn_norm"].data_ptr(), h.data_ptr(), n, hidden,
                            a.rms_norm_eps)
        qkv = layer["qkv"](h).contiguous()  # [N, (hq + 2 hkv) d]
        attn = torch.empty(n, hq * d)
        cos, sin = p.native_ropes[self.layer_rope[li]]
        window = self.layer_window[li] or 0
        scale = a.attn_scale if a.attn_scale is not None else d ** -0.5
        ld = qkv.shape[1]
        for i, cache in enumerate(caches):
            s, e = p.offsets[i], p.offsets[i + 1]
            kc, vc = cache.k, cache.v  # [layers, hkv, capacity, d], contiguous
            lib.sd_attend(qkv.data_ptr() + s * ld * f, ld, e - s, cos.data_ptr() + s * d // 2 * f,
                          sin.data_ptr() + s * d // 2 * f, kc.data_ptr() + li * kc.stride(0) * f,
                          vc.data_ptr() + li * vc.stride(0) * f, kc.stride(1), p.lengths[i],
                          window, scale, hq, hkv, d, attn.data_ptr() + s * hq * d * f)
        o = layer["o"](attn).contiguous()
        lib.sd_add_rms_norm(x.data_ptr(), o.data_ptr(), layer["mlp_norm"].data_ptr(),
                            h.data_ptr(), n, hidden, a.rms_norm_eps)
        gate_up = layer["gate_up"](h).contiguous()  # [N, 2 * intermediate]
        act = torch.empty(n, gate_up.shape[1] // 2)
        lib.sd_silu_mul(gate_up.data_ptr(), act.data_ptr(), n, act.shape[1])
        return layer["down"](act)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, li: int,
                caches: Sequence[KVCache], p: "_Pass") -> torch.Tensor:
        """Each session's new keys and values into its cache, and its queries against them:
        [N, hq * head_dim]."""
        a = self.arch
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        span = p.spans[self.layer_window[li]]
        outs = []
        for i, cache in enumerate(caches):
            s, e, n0 = p.offsets[i], p.offsets[i + 1], p.lengths[i]
            start, mask = span[i]
            cache.k[li, :, n0 : n0 + e - s] = k[s:e].transpose(0, 1)
            cache.v[li, :, n0 : n0 + e - s] = v[s:e].transpose(0, 1)
            keys = cache.k[li, :, start : n0 + e - s]  # [hkv, S, d]
            values = cache.v[li, :, start : n0 + e - s]
            if a.attn_softcap is not None:
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
        return torch.cat(outs) if len(outs) > 1 else outs[0]

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


class _Lin(ctypes.Structure):
    """layerops.c's sd_lin: one linear layer as smallm runs it."""

    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("k", ctypes.c_long), ("n", ctypes.c_long), ("dm", ctypes.c_void_p),
                ("bits", ctypes.c_long), ("integer", ctypes.c_long)]


class _Layer(ctypes.Structure):
    """layerops.c's sd_layer: one decoder layer's weights for ``sd_layers``."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", _Lin),
                ("o", _Lin), ("gate_up", _Lin), ("down", _Lin), ("window", ctypes.c_long)]


def _layer_structs(layers: list[dict], windows: list[int | None]):
    """(the sd_layer array, the panel width, the tensors it points into) for ``sd_layers``, or
    () when a linear layer has no smallm panels (its kernel is a library's)."""
    def lin(linear) -> _Lin | None:
        grouped = getattr(linear, "grouped", None)
        panels = getattr(linear, "panels", None) if grouped is None else grouped
        if panels is None:
            return None
        scale = linear.scale if isinstance(linear, Int8Linear) else None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return _Lin(panels.data_ptr(), ptr(scale), ptr(linear.bias), linear.in_features,
                    linear.out_features, ptr(getattr(linear, "dm", None)),
                    getattr(linear, "bits", 0), int(getattr(linear, "integer", False)))

    out, keep, panel = (_Layer * len(layers))(), [], 0
    for i, (layer, window) in enumerate(zip(layers, windows)):
        lins = [lin(layer[name]) for name in ("qkv", "o", "gate_up", "down")]
        if any(x is None for x in lins):
            return ()
        panel = layer["qkv"].panel
        out[i] = _Layer(layer["attn_norm"].data_ptr(), layer["mlp_norm"].data_ptr(), *lins,
                        window or 0)
        keep.append(layer)
    return out, panel, keep


class _Pass(NamedTuple):
    """The layout of one forward pass (LlamaEngine._layout)."""

    lengths: list[int]  # cached positions per session before the pass
    sizes: list[int]  # new tokens per session
    offsets: list[int]  # session i's new tokens are flat[offsets[i]:offsets[i + 1]]
    flat: torch.Tensor  # [N] every session's new tokens
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) per RoPE group
    spans: dict  # window -> per session (first key position, mask or None)
    native_ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [N, head_dim / 2]
