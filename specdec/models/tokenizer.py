"""Tokenizer facts every part shares: the fingerprint two services must agree on, the
end-of-sequence ids, and prompt encoding (the one place a chat template is applied)."""

from __future__ import annotations

import hashlib
import json
import pathlib


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
    """End-of-sequence ids as transformers stops on them: the tokenizer's, the model config's
    and those of the model directory's ``generation_config.json`` (where chat models such as
    Llama 3 list their end-of-turn tokens)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for source in (config, _generation_config(config)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def _generation_config(config):
    """The GenerationConfig saved beside a model config loaded from a directory, if any."""
    path = pathlib.Path(getattr(config, "_name_or_path", "") or "")
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template, with the generation
    prompt appended (the assistant's turn opened)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool | None) -> list[int]:
    """Prompt ids. A string: chat (default when the tokenizer has a template) wraps it as one
    user message and applies the chat template. A list of messages: always the template."""
    if isinstance(prompt, list):
        return chat_prompt_ids(tokenizer, prompt)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return [int(t) for t in tokenizer(prompt)["input_ids"]]
