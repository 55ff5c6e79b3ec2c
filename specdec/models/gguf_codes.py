"""A GGUF target's weights as the file stores them: grouped codes, exactly.

transformers dequantizes a GGUF file to float32 (``hub.convert_gguf``), and that float32 model
is the target. But Q8_0, Q4_0 and Q4_1 blocks dequantize as ``d * q + m`` per block of 32
weights along a row (an fp16 ``d`` and ``m``, a code ``q`` of at most 8 bits), and ``d * q`` is
exact in float32, so smallm can form each weight in registers, bit for bit, from the codes
(``sd_linear_g``, ``sd_linear_g4`` for 4-bit codes, two per byte): the same products summed
in the same order as on the float32 weight, from 1/2 + 1/4 bytes per weight (Q4_0, Q4_1) or
1 + 1/4 (Q8_0) instead of 4. On a memory-bound CPU that is most of a decode step.

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


def _blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [rows, cols], d, m float32 [rows, cols / 32]) of one tensor's raw blocks."""
    rows = raw.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = raw.reshape(rows, -1, size)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if kind == "Q8_0":
        q = b[:, :, 2:].copy().view(np.int8)
        m = np.zeros_like(d)
    else:
        qs = b[:, :, size - 16:]
        # element i of a block: the low nibble of byte i; element i + 16: its high nibble
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int8)
        if kind == "Q4_0":  # d * (q - 8) = d * q + (-8 d), each exact: codes stay 0..15
            m = -8.0 * d
        else:
            m = b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    return q.reshape(rows, -1), d, m


CACHE_FILE = "codes.pt"  # beside the file's converted model (hub.convert_gguf's directory)


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
        if kind not in ("Q8_0", "Q4_0", "Q4_1"):
            continue
        q, d, m = (torch.from_numpy(a) for a in _blocks(np.asarray(t.data), kind))
        deq = GroupedCodes(q, d, m).dequantize().numpy()
        ti = len(tables)
        tables.append((q, d, m))
        for r in range(deq.shape[0]):
            index.setdefault(hash(deq[r].tobytes()), (ti, r))
    names = [n for n in weights if n == "head" or n.rsplit(".", 1)[-1] in LINEAR_SUFFIXES]
    codes = {}
    for name in names:
        w = weights[name].detach().to(torch.float32).contiguous()
        if w.dim() != 2 or w.shape[1] % GROUP:
            continue
        rows = w.numpy()
        found = [index.get(hash(rows[r].tobytes())) for r in range(rows.shape[0])]
        if any(f is None or tables[f[0]][0].shape[1] != w.shape[1] for f in found):
            continue
        parts = [torch.stack([tables[ti][j][r] for ti, r in found]) for j in range(3)]
        c = GroupedCodes(*parts)
        if torch.equal(c.dequantize(), w):
            codes[name] = c
    log.info("%d of %d linear weights streamed as the GGUF file's codes", len(codes), len(names))
    return codes
