"""A pass's layers over its flat batch: the layout, torch's ops and specdec's fused C ops.

``LayerOps`` is the part of ``LlamaEngine`` (specdec.serving.engine) that runs the decoder
layers of one forward pass: where each session's new tokens sit in the flat batch with their
RoPE angles (``_layout``), a layer on torch's ops with every session's attention in one call
against the KV pool (``_block``, ``_gather``, ``_attend``), the same on the fused C ops of
``native/layerops.c`` against each session's contiguous cache
(``_native_block``), and every layer in one ``sd_layers`` call (``_native_layers``). It reads
the engine's attributes: arch, device, dtype, layers, RoPE tables, windows and native library.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specdec.serving.kernels import SMALLM, LinDesc
from specdec.serving.kvcache import KVCache, PooledCache


class LayerOps:
    """The layer ops of ``LlamaEngine`` (a mixin: its attributes are the engine's)."""

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

    def _layout(self, caches: Sequence[KVCache], tokens: Sequence[torch.Tensor]) -> "_Pass":
        """Where each session's new tokens sit in the flat batch and their RoPE angles, with
        room for them in each cache; on torch's ops also their places in the KV pool."""
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
            return _Pass(lengths, sizes, offsets, flat, ropes, None, native_ropes)
        return _Pass(lengths, sizes, offsets, flat, ropes, self._gather(caches, lengths, sizes),
                     [])

    def _gather(self, caches: Sequence[PooledCache], lengths: list[int],
                sizes: list[int]) -> "_Gather":
        """Where a pass's B sessions sit in the KV pool, for attention in one call per layer:
        sessions padded to T queries and S keys (row r of session i is position
        lengths[i] + r), with per attention window the mask of the keys each query sees."""
        b, t_max = len(caches), max(sizes)
        ends = [n0 + t for n0, t in zip(lengths, sizes)]
        keys = np.zeros((b, max(ends)), dtype=np.int64)  # [B, S] slot ids (0: KVPool's zeros)
        rows = np.zeros((b, t_max), dtype=np.int64)  # [B, T] rows of the flat batch
        valid = np.zeros((b, t_max), dtype=bool)  # [B, T] a real query, not padding
        at = 0
        for i, (c, end, t) in enumerate(zip(caches, ends, sizes)):
            keys[i, :end] = c.table[:end]
            rows[i, :t] = np.arange(at, at + t)
            valid[i, :t] = True
            at += t
        write = np.concatenate([c.table[n0:end] for c, n0, end in zip(caches, lengths, ends)])
        run = None  # one session whose keys are consecutive slots: read in place, no gather
        if b == 1 and (np.diff(keys[0]) == 1).all():
            run = (int(keys[0, 0]), int(keys[0, 0]) + ends[0])
        q_pos = np.asarray(lengths)[:, None] + np.arange(t_max)[None, :]  # [B, T]
        k_pos = np.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
        masks = {}
        for window in self.windows:  # None: full causal
            if b == 1 and t_max == 1 and (window is None or ends[0] <= window):
                masks[window] = None  # one query that sees every key: no mask
                continue
            mask = k_pos <= q_pos[:, :, None]  # [B, T, S]: causal (so never past the session)
            if window is not None:
                mask &= k_pos > q_pos[:, :, None] - window  # transformers' sliding window
            mask[~valid] = False
            mask[~valid, 0] = True  # a padding query sees one key (all-masked rows are NaN)
            masks[window] = torch.from_numpy(mask[:, None]).to(self.device)  # [B, 1, T, S]
        move = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        if b == 1:  # its rows are the flat batch as it is: no row indices to send
            return _Gather(move(write), None if run else move(keys), None, None, masks, run)
        out = np.flatnonzero(valid)  # the real queries in [B * T] order: the flat batch's
        return _Gather(move(write), move(keys), move(rows), move(out), masks, run)

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

    def _native_layers(self, x: torch.Tensor, caches: Sequence[KVCache], p: "_Pass",
                       first: int = 0, end: int | None = None) -> None:
        """Every decoder layer (or layers first .. end - 1) over the flat batch x (in place)
        in one ``sd_layers`` call; x is then the residual stream after the last of them (so
        consecutive ranges give the bits of one call over all)."""
        a, lib, m = self.arch, self.native, len(caches)
        layers, panel, _keep = self._stack
        end = len(self.layers) if end is None else end
        cos, sin = p.native_ropes[0]
        ints, longs, ptrs = ctypes.c_int * (m + 1), ctypes.c_long * m, ctypes.c_void_p * m

        def at_first(t):  # a cache's layer ``first``
            return t.data_ptr() + first * t.stride(0) * t.element_size()

        status = lib.sd_layers(
            x.data_ptr(), x.shape[0], x.shape[1],
            ctypes.addressof(layers) + first * ctypes.sizeof(layers._type_), end - first,
            a.rms_norm_eps, m, ints(*p.offsets), ints(*p.lengths),
            ptrs(*(at_first(c.k) for c in caches)), ptrs(*(at_first(c.v) for c in caches)),
            longs(*(c.k.stride(0) for c in caches)),
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
                caches: Sequence[PooledCache], p: "_Pass") -> torch.Tensor:
        """The pass's new keys and values into the KV pool, then every session's queries
        against its keys in one attention call: [N, hq * head_dim]. q [N, hq, d], k and v
        [N, hkv, d]."""
        a, g = self.arch, p.gather
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        n, pool = q.shape[0], caches[0].pool
        pool.k[li].index_copy_(0, g.write, k)
        pool.v[li].index_copy_(0, g.write, v)
        if g.run is not None:  # one session on consecutive slots: its keys in place
            keys = pool.k[li, g.run[0]:g.run[1]].transpose(0, 1)[None]  # [1, hkv, S, d]
            values = pool.v[li, g.run[0]:g.run[1]].transpose(0, 1)[None]
        else:
            keys = pool.k[li][g.keys].transpose(1, 2)  # [B, hkv, S, d]
            values = pool.v[li][g.keys].transpose(1, 2)
        b = len(caches)
        # [B, hq, T, d]; one session's rows are the flat batch as it is
        queries = q.transpose(0, 1)[None] if b == 1 else q[g.rows].transpose(1, 2)
        mask = g.masks[self.layer_window[li]]  # [B, 1, T, S] or None
        if a.attn_softcap is not None:
            attn = self._softcapped_attention(queries, keys, values, mask)
        else:
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                  enable_gqa=hq != hkv, scale=a.attn_scale)
        attn = attn.transpose(1, 2)  # [B, T, hq, d]
        if b == 1:
            return attn.reshape(n, hq * d)
        return attn.reshape(-1, hq * d)[g.out]


class _Layer(ctypes.Structure):
    """layerops.c's sd_layer: one decoder layer's weights for ``sd_layers``."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", LinDesc),
                ("o", LinDesc), ("gate_up", LinDesc), ("down", LinDesc),
                ("window", ctypes.c_long)]


def _layer_structs(layers: list[dict], windows: list[int | None]):
    """(the sd_layer array, the panel width, the tensors it points into) for ``sd_layers``, or
    () when a linear layer has no smallm panels (its kernel is a library's)."""
    out, keep, panel = (_Layer * len(layers))(), [], 0
    for i, (layer, window) in enumerate(zip(layers, windows)):
        lins = [getattr(layer[name], "desc", None) for name in ("qkv", "o", "gate_up", "down")]
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
    gather: "_Gather | None"  # torch's ops: the sessions' places in the KV pool
    native_ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [N, head_dim / 2]


class _Gather(NamedTuple):
    """A pass's sessions in the KV pool (LayerOps._gather), on the device."""

    write: torch.Tensor  # [N] the slot each new token's keys and values go to
    keys: torch.Tensor | None  # [B, S] each session's slots, position by position (padded;
    # None: ``run``)
    rows: torch.Tensor | None  # [B, T] each session's rows in the flat batch (padded; None: B 1)
    out: torch.Tensor | None  # [N] where the flat batch's rows are among the [B * T] queries
    masks: dict  # window -> [B, 1, T, S] bool: the keys each query attends to (None: all)
    run: tuple[int, int] | None  # one session on consecutive slots [start, end): no gather
