"""Tokenizer fingerprint: two services may pair only when their tokenizers agree exactly."""

from __future__ import annotations

import hashlib
import json


def fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (token -> id), added tokens and special token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def eos_token_ids(tokenizer, config=None) -> list[int]:
    """End-of-sequence ids from the tokenizer and (if given) the model's generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for source in (config, getattr(config, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return sorted(ids)
