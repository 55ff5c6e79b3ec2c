"""A Llama-family forward pass over ragged batches with per-session KV caches.

One forward call takes the new tokens of several sessions at once ("ragged" batching, as in
vLLM's flattened token layout): every linear layer runs once over all new tokens of all
sessions, so the weights are read once per pass; on torch's ops (GPUs) attention is one call
per layer for every session of the pass, against keys gathered from one preallocated KV pool;
the CPU's fused C ops attend per session against its contiguous cache. A verify pass over
k + 1 tokens, a prefill chunk and a draft step of many sessions are all the same call.

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
naming, filled from a Hugging Face model (``from_hf``), a safetensors checkpoint read shard by
shard (``from_checkpoint``) or a specdec draft file (``specdec.models.draft_model``).

This module builds the engine and runs a pass; a pass's layout and layer ops (torch's and the
fused C ones) are ``specdec.serving.layerops``, a session's KV cache
``specdec.serving.kvcache``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.config import DEFAULT_NUMERICS, NUMERICS
from specdec.serving.arch import ArchConfig, canonical_weights, rope_inv_freq
from specdec.serving.kernels import (
    KERNELS,
    MEASURED_ROWS,
    MKL,
    QUANTIZATIONS,
    SMALLM,
    GroupedCodes,
    Int8Linear,
    KernelPlan,
    Linear,
    choose_kernels,
    smallm_library,
    timed,
)
from specdec.serving.kvcache import KVCache, KVPool, PooledCache, kv_pool_bytes
from specdec.serving.layerops import LayerOps


class LlamaEngine(LayerOps):
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
        if kernels != "auto" and kernels not in KERNELS:
            raise ValueError(f"kernels must be one of auto, {', '.join(KERNELS)}, got "
                             f"{kernels!r}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.arch = arch
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.dtype = dtype
        codes = codes or {}
        self.kernels = plan = self._kernel_plan(kernels, quantize, numerics, codes)
        self._load_weights(weights, quantize, codes)
        self.vocab_in = self.embed.shape[0]
        self.vocab_out = self.head.out_features
        self.vocab_map = None if vocab_map is None else vocab_map.to(torch.long)
        self._rope_tables()
        self.layer_window = [arch.layer_window(i) for i in range(arch.num_layers)]
        self.windows = sorted(set(self.layer_window), key=self.layer_window.index)
        self.embed_scale = None if arch.embed_scale is None else \
            torch.tensor(arch.embed_scale, dtype=torch.float32).to(self.device, self.dtype)
        self.act = F.silu if arch.hidden_act == "silu" else \
            (lambda x: F.gelu(x, approximate="tanh"))
        self.native = self._native_ops() if native else None
        self.pool: KVPool | None = None  # torch's ops' KV store (reserve_kv; C ops: None)
        self.whole_stack = True  # (see _whole_stack)
        self._stack = None  # the layers as sd_layers reads them, built at first use
        if plan is not None and plan.trying:
            choose_kernels(plan, self._linears(), self.forward_timer())
            self._stack = None  # it pointed into weight layouts the choice may have freed

    def _kernel_plan(self, kernels: str, quantize: str | None, numerics: str,
                     codes: dict[str, GroupedCodes]) -> KernelPlan | None:
        """The CPU linear kernels' plan (None: F.linear everywhere, or int8), and
        ``self.numerics``: what runs. "auto" times the kernels at start and keeps the fastest
        per shape, any other name is that kernel alone (``kernels.KERNELS``: "mkl" F.linear,
        "mkl-t" oneMKL on the transposed weight, "onednn" prepacked weights, "smallm"
        specdec's own few-rows kernel). They are float32's: GPUs and other dtypes run
        F.linear."""
        fp32_cpu = self.device.type == "cpu" and self.dtype == torch.float32
        if kernels not in ("auto", MKL) and not fp32_cpu:
            raise ValueError(f"kernels={kernels!r} runs float32 on CPU; {self.dtype} on "
                             f"{self.device.type} runs F.linear (kernels 'auto' or 'mkl')")
        available = tuple(name for name, k in KERNELS.items()
                          if fp32_cpu and k.available(self.device))
        if kernels != "auto" and fp32_cpu and kernels not in available:
            raise ValueError(f"kernels={kernels!r} needs {KERNELS[kernels].needs}")
        smallm = kernels in ("auto", SMALLM) and SMALLM in available
        if quantize is not None and quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)} or None, got "
                             f"{quantize!r}")
        integer = numerics == "integer" and smallm and quantize is None and bool(codes)
        self.numerics = "integer" if integer else "float"
        if integer:  # one kernel for every row count: no row's numbers depend on its pass
            return KernelPlan.fixed(SMALLM)
        if fp32_cpu and quantize is None:
            return KernelPlan(trying=available) if kernels == "auto" else \
                KernelPlan.fixed(kernels)
        return None  # quantized: one int8 product for every shape, nothing to choose between

    def _load_weights(self, weights: dict[str, torch.Tensor], quantize: str | None,
                      codes: dict[str, GroupedCodes]) -> None:
        """The embedding, the layers, the final norm and the head, on the device in the
        engine's dtype (no copy where a weight is already there, as a checkpoint loads it)."""
        arch, plan, integer = self.arch, self.kernels, self.numerics == "integer"

        def linear(name: str, bias: torch.Tensor | None, integer: bool = integer):
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
        # The head computes float on its codes in either numerics: int8 activations distort
        # the vocabulary's logits most (with an integer head the default target's answer to
        # "What is the capital of France?" is a string of French nouns, as llama.cpp's is; with
        # a float head, "The capital of France is Paris."), at the same cost for one row (the
        # head streams its codes either way). Its rows are as independent of their pass as
        # the integer product's: smallm's float kernel runs every row count.
        self.head = linear("head", None, integer=False)

    def _rope_tables(self) -> None:
        """RoPE inverse frequencies as transformers computes them (float32; angles =
        position * inv_freq), one set per distinct RoPE (Gemma 3's local and global layers
        differ), and each layer's set."""
        arch = self.arch
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

    def reserve_kv(self, cap_bytes: int | None = None) -> KVPool | None:
        """Allocate the KV pool that torch's ops keep every session's keys and values in,
        ``cap_bytes`` big (None: sized from the device's free memory, ``kv_pool_bytes``), at
        most 64 contexts' worth. Engines on the fused C ops keep a contiguous cache per session
        instead (their attention reads a head's keys as one run): None for them."""
        if self.native is not None:
            return None
        if self.pool is None:
            size = kv_pool_bytes(self.device, cap_bytes)
            slots = min(size // KVPool.slot_bytes(self.arch, self.dtype),
                        64 * self.arch.max_context)
            self.pool = KVPool(self.arch, self.device, self.dtype, max(1, slots))
        return self.pool

    def new_cache(self) -> KVCache | PooledCache:
        """An empty cache for a new session: a table in the KV pool on torch's ops (reserved
        at first use if the service did not), a tensor of its own on the C ops."""
        if self.native is None:
            return PooledCache(self.reserve_kv())
        return KVCache(self.arch, self.device, self.dtype)

    # -- forward ----------------------------------------------------------------------------

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
        num_features: Sequence[int] | None = None,
        inputs: Sequence[torch.Tensor] | None = None,
        layers: Sequence[int] = (),
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and the final norm's output at each session's last ``num_features[i]``
        positions (default: ``num_logits[i]``, the rows the head read the logits from),
        [num_features[i], hidden]: the target's *feature* of a position, what a
        feature-conditioned draft is given. The head reads only the last num_logits rows.
        ``inputs``: each session's first layer's input rows [t_i, hidden] instead of its
        tokens' embeddings (a feature draft's, ``specdec.serving.feature_engine``).
        ``layers``: the residual stream after each of these layers too, before the final
        feature in each row ([num_features[i], (len(layers) + 1) * hidden]); the whole-stack
        call then runs as one call per range of layers between them (the same bits)."""
        p = self._layout(caches, tokens)
        if inputs is not None:
            x = torch.cat(list(inputs)).to(self.device, self.dtype)
        else:
            x = self.embed[p.flat]  # [N, hidden]
            if self.embed_scale is not None:
                x = x * self.embed_scale
        wanted = list(num_logits) if num_features is None else \
            [max(m, f) for m, f in zip(num_logits, num_features)]
        rows = torch.cat([torch.arange(p.offsets[i + 1] - m, p.offsets[i + 1], device=self.device)
                          for i, m in enumerate(wanted)])
        taps = {li: None for li in layers}  # each tapped layer's residual at the rows
        if self.native is not None and self._whole_stack(x.shape[0]):
            first = 0
            for end in sorted({li + 1 for li in taps} | {len(self.layers)}):
                self._native_layers(x, caches, p, first, end)
                if end - 1 in taps:
                    taps[end - 1] = x[rows]
                first = end
        elif self.native is not None:
            delta = None  # each layer's MLP output, added to x by the next layer's first op
            for li, layer in enumerate(self.layers):
                delta = self._native_block(x, delta, li, layer, caches, p)
                if li in taps:
                    taps[li] = x[rows] + delta[rows]
            x += delta
        else:
            for li, layer in enumerate(self.layers):
                x = self._block(x, li, layer, caches, p)
                if li in taps:
                    taps[li] = x[rows]
        for c, n0, t in zip(caches, p.lengths, p.sizes):
            c.length = n0 + t
        if rows.numel() == 0:
            return ([torch.empty(0, self.vocab_out, device=self.device) for _ in caches],
                    [x.new_empty(0, x.shape[1] * (len(taps) + 1)) for _ in caches])
        if self.numerics == "integer" and self.native is not None:  # per row, by construction
            picked, feats = x[rows].contiguous(), torch.empty(len(rows), x.shape[1])
            self.native.sd_add_rms_norm(picked.data_ptr(), None,
                                        self.norm.data_ptr(), feats.data_ptr(), len(rows),
                                        x.shape[1], self.arch.rms_norm_eps)
        else:
            feats = self._rms_norm(x[rows], self.norm)
        groups = list(feats.split(wanted))
        head_rows = feats if num_features is None else \
            torch.cat([g[g.shape[0] - m:] for g, m in zip(groups, num_logits)])
        logits = self.head(head_rows).float()  # [sum n_i, vocab_out]
        if self.arch.final_softcap is not None:  # Gemma 2/3
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        if taps:
            groups = list(torch.cat([*(t.to(feats.dtype) for t in taps.values()), feats], 1)
                          .split(wanted))
        if num_features is not None:
            groups = [g[g.shape[0] - f:] for g, f in zip(groups, num_features)]
        return list(logits.split(list(num_logits))), groups

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
