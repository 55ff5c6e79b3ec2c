"""A GGUF target's weights as the file stores them: grouped codes, exactly.

transformers dequantizes a GGUF file to float32 (``hub.convert_gguf``), and that float32 model
is the target. But Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K blocks all dequantize as ``d * q + m``
per group of 32 weights along a row (``d`` and ``m`` exact in float32: fp16, or for the
K-quants an fp16 times a 6-bit scale; a code ``q`` of at most 8 bits), and ``d * q`` is exact
in float32, so smallm can form each weight in registers, bit for bit, from the codes
(``sd_linear_g``, ``sd_linear_g4`` for 4-bit codes, two per byte): the same products summed
in the same order as on the float32 weight, from 1/2 + 1/4 bytes per weight (4-bit codes) or
1 + 1/4 (5- and 8-bit) instead of 4. On a memory-bound CPU that is most of a decode step.
Q6_K blocks are groups of 16 (codes q - 32, d the super-block's d times an int8 scale: still
exact), read by smallm's 16-group kernel in float (in either numerics); other types stay
float32.

The engine's weights are fused and reordered (q, k and v rows in one matrix; llama.cpp's
rotary permutation of q and k undone), so the codes are matched to them by row: every
dequantized GGUF row is indexed by its bytes, each row of an engine weight looks its own up,
and a weight takes codes only if every row is found and the codes, dequantized, equal the
weight exactly (``torch.equal``). Anything else (other block types, a row not found) stays on
its float32 path.
"""

from __future__ import annotations

import logging
import os
import pathlib

import numpy as np
import torch

from specdec.serving.kernels import GROUP, GroupedCodes

log = logging.getLogger(__name__)

# The engine weights that are linear layers (see LlamaEngine.__init__).
LINEAR_SUFFIXES = ("wqkv", "wo", "w_gate_up", "w_down")


# Bytes per block of each block type that maps onto codes: 32 weights (the K-quants: a
# super-block of 256, eight sub-blocks of 32 with their own scale and minimum).
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210}


def _blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [rows, cols], d, m float32 [rows, cols / 32]) of one tensor's raw blocks, in
    the layouts of ggml (and of gguf's ``quants``, whose dequantization they reproduce)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, BLOCK_BYTES[kind])

    def f16(at: int) -> np.ndarray:
        return b[:, :, at:at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:
        # element i of a run of 2n: the low nibble of byte i; element n + i: its high nibble
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    if kind in ("Q4_K", "Q5_K"):
        return _k_blocks(b, kind, f16(0), f16(2), nibbles)
    if kind == "Q6_K":
        return _q6_k_blocks(b)
    d = f16(0)
    if kind == "Q8_0":
        return (b[:, :, 2:].copy().view(np.int8).reshape(rows, -1), d, np.zeros_like(d))
    if kind in ("Q5_0", "Q5_1"):  # a fifth bit per weight from a 32-bit word
        at = 2 if kind == "Q5_0" else 4
        qh = b[:, :, at:at + 4].copy().view(np.uint32)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = nibbles(b[:, :, at + 4:]) | (high << 4)
    else:
        q = nibbles(b[:, :, -16:])
    # d * (q - 8) = d * q + (-8 d), each exact: codes stay unsigned (Q5_0 likewise with 16)
    m = {"Q4_0": -8.0 * d, "Q5_0": -16.0 * d}.get(kind)
    return q.astype(np.int8).reshape(rows, -1), d, f16(2) if m is None else m


def _k_blocks(b: np.ndarray, kind: str, d: np.ndarray, dmin: np.ndarray, nibbles
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks as eight groups of 32: a group's d is d * scale and its m
    -(dmin * min), both exact in float32 (an fp16 times a 6-bit integer), so d * q + m is
    gguf's d * q - dm."""
    rows, nb = b.shape[:2]
    s = b[:, :, 4:16].reshape(rows, nb, 3, 4)  # 6-bit scales and minimums, packed
    lo, mid, hi = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    scale = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    least = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    qs = b[:, :, -128:].reshape(rows, nb, 4, 32)  # 64 weights a run: two groups
    q = nibbles(qs).reshape(rows, nb, 8, 32)
    if kind == "Q5_K":  # bit g of byte i of qh: the fifth bit of weight i of group g
        qh = b[:, :, 16:48]
        q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    dg = d[:, :, None] * scale.astype(np.float32)
    mg = -(dmin[:, :, None] * least.astype(np.float32))
    return q.astype(np.int8).reshape(rows, -1), dg.reshape(rows, -1), mg.reshape(rows, -1)


def _q6_k_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks as sixteen groups of 16: codes q - 32 (6 bits: four from ql, two
    from qh), a group's d the super-block's fp16 d times its int8 scale, m 0. d * q stays
    exact in float32 (11 + 7 + 5 significant bits), so it is gguf's (d * scale) * q."""
    rows, nb = b.shape[:2]
    ql = b[:, :, :128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[:, :, 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = ((ql & 0x0F).reshape(rows, nb, 256) | ((qh & 0x03).reshape(rows, nb, 256) << 4))
    scale = b[:, :, 192:208].copy().view(np.int8).astype(np.float32)
    d = b[:, :, 208:210].copy().view(np.float16).astype(np.float32)
    dg = (d * scale).reshape(rows, -1)
    return (q.astype(np.int16) - 32).astype(np.int8).reshape(rows, -1), dg, np.zeros_like(dg)


# beside the file's converted model (hub.convert_gguf's directory); v2: groups of 16 too
CACHE_FILE = "codes-v2.pt"


def exact_codes(gguf: str | pathlib.Path, weights: dict[str, torch.Tensor]
                ) -> dict[str, GroupedCodes]:
    """Grouped codes for every linear weight of ``weights`` (canonical names) that the GGUF
    file's Q8_0 / Q4_0 / Q4_1 blocks encode exactly; {} if none do. Read once from the file
    (~6 s for the default target, most of it gguf's parsing of the tokenizer's fields) and
    cached beside its converted model; a cached weight is checked against ``weights`` again."""
    from specdec.models.hub import _gguf_cache_dir

    cache = _gguf_cache_dir(pathlib.Path(gguf)) / CACHE_FILE
    if cache.is_file():
        try:
            stored = torch.load(cache, weights_only=True)
        except (OSError, RuntimeError) as exc:
            log.warning("ignoring the unreadable codes cache %s (%s)", cache, exc)
        else:
            codes = {name: GroupedCodes(*parts) for name, parts in stored.items()
                     if name in weights and torch.equal(GroupedCodes(*parts).dequantize(),
                                                        weights[name].float())}
            if len(codes) == len(stored):
                return codes
    codes = _read_codes(gguf, weights)
    try:  # (a temporary name and a rename: services starting together never read half)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        torch.save({name: (c.q, c.d, c.m) for name, c in codes.items()}, tmp)
        os.replace(tmp, cache)
    except OSError as exc:
        log.warning("could not cache the GGUF codes in %s (%s)", cache, exc)
    return codes


def _read_codes(gguf: str | pathlib.Path, weights: dict[str, torch.Tensor]
                ) -> dict[str, GroupedCodes]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    tables, index = [], {}  # (q, d, m) per tensor; hash of a dequantized row -> (tensor, row)
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            continue
        table = GroupedCodes(*(torch.from_numpy(a) for a in _blocks(np.asarray(t.data), kind)))
        # (+ 0.0: a row is found by its bytes, and where gguf's d * (q - 16) is -0.0 for a
        # negative d, d * q + m is +0.0, the same weight: torch.equal checks the values)
        deq = table.dequantize().numpy() + np.float32(0.0)
        ti = len(tables)
        tables.append(table)
        for r in range(deq.shape[0]):
            index.setdefault(hash(deq[r].tobytes()), (ti, r))
    names = [n for n in weights if n == "head" or n.rsplit(".", 1)[-1] in LINEAR_SUFFIXES]
    codes = {}
    for name in names:
        w = weights[name].detach().to(torch.float32).contiguous()
        if w.dim() != 2 or w.shape[1] % GROUP:
            continue
        rows = w.numpy() + np.float32(0.0)
        found = [index.get(hash(rows[r].tobytes())) for r in range(rows.shape[0])]
        if any(f is None or tables[f[0]].q.shape[1] != w.shape[1] for f in found):
            continue
        # rows of tensors in groups of 32 and 16 (a fused q / k / v whose v is Q6_K): all in
        # the finer groups, each d and m repeated (exactly the same weights)
        group = min(tables[ti].group for ti, _ in found)
        of = {ti: tables[ti].regrouped(group) for ti in {ti for ti, _ in found}}
        c = GroupedCodes(*(torch.stack([getattr(of[ti], part)[r] for ti, r in found])
                           for part in ("q", "d", "m")))
        if torch.equal(c.dequantize(), w):
            codes[name] = c
    log.info("%d of %d linear weights streamed as the GGUF file's codes", len(codes), len(names))
    return codes
