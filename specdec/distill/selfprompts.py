"""Prompts the target writes itself: the user turns a chat model expects to be asked.

A chat model has learnt what users write to it, so, given its chat template opened at a user
turn and nothing after, it writes a user's message (Magpie, Xu et al. 2024, "Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing"). Sampled at temperature 1,
these are prompts in phrasings no template produces, on the topics and in the register the
target was tuned on: data of the kind its users send, for any target, without a prompt list.

The prefix is the template itself, cut where a user message would start (a marker message
rendered and cut at the marker), so it works for any chat template. Prompts are written to a
JSON-lines file as they are made (``self_written_prompts``: a rerun keeps what is there and
makes only the rest), deduplicated, and never one of the held-out sets' prompts.
"""

from __future__ import annotations

import json
import pathlib
import random

from tqdm import tqdm

from specdec.config import SamplingParams

MARK = "\u2063SPECDEC-USER-TURN\u2063"  # (invisible separators: no template rewrites them)
TEMPERATURE = 1.0  # Magpie's: lower writes the same few questions again and again
TOP_P = 0.95
MAX_PROMPT_TOKENS = 160  # a user turn longer than this is cut off: dropped
MIN_CHARS, MAX_CHARS = 12, 800
CHUNK = 96  # prompts generated (and appended to the file) at a time


def user_turn_prefix(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (with ``system``
    as the system message, else the template's default)."""
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if MARK not in text:
        raise ValueError("the chat template does not render a user message as given")
    prefix = text[:text.index(MARK)]
    return [int(t) for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]]


def finished_turn(tokenizer, tokens: list[int], eos: set[int]) -> str | None:
    """The text of a written turn that the target ended (an EOS id last), else None."""
    if not tokens or tokens[-1] not in eos:
        return None
    return tokenizer.decode(tokens[:-1], skip_special_tokens=True).strip()


def keep(text: str, seen: set[str], excluded: set[str]) -> bool:
    """A written prompt worth answering: complete, of a sensible length, new, not held out."""
    key = " ".join(text.lower().split())
    if not (MIN_CHARS <= len(text) <= MAX_CHARS) or key in seen or key in excluded:
        return False
    seen.add(key)
    return True


def self_written_prompts(engine, tokenizer, eos: set[int], n: int, path: pathlib.Path,
                         seed: int = 0, excluded: list[str] = (), batch_size: int = 96,
                         ) -> list[str]:
    """n prompts the target writes at a user turn, kept in ``path`` (JSON lines, one
    {"prompt": ...} each); those already there are kept and only the rest are made. A prompt
    ends where the target ends its turn (an EOS id); one cut off at MAX_PROMPT_TOKENS, too
    short or long, a repeat or one of ``excluded`` is dropped."""
    from specdec.distill.data import generate_answers

    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()
               if line.strip()] if path.exists() else []
    seen = {" ".join(p.lower().split()) for p in prompts}
    excluded_keys = {" ".join(p.lower().split()) for p in excluded}
    prefix = user_turn_prefix(tokenizer)
    rng = random.Random(f"{seed}:{len(prompts)}")
    with tqdm(total=n, initial=min(len(prompts), n), unit="prompt",
              desc="self-written prompts") as bar:
        while len(prompts) < n:
            jobs = [(prefix, SamplingParams(temperature=TEMPERATURE, top_p=TOP_P,
                                            seed=rng.randrange(2**32))) for _ in range(CHUNK)]
            seqs = generate_answers(engine, jobs, eos, MAX_PROMPT_TOKENS, batch_size, top_n=1)
            texts = (finished_turn(tokenizer, s.tokens, eos) for s in seqs)
            made = [t for t in texts if t is not None and keep(t, seen, excluded_keys)]
            if not made:
                raise RuntimeError(
                    f"the target wrote no usable user turn in {CHUNK} tries (each must end its "
                    f"turn within {MAX_PROMPT_TOKENS} tokens and be new): a chat model is needed")
            made = made[:n - len(prompts)]
            with path.open("a", encoding="utf-8") as f:
                for text in made:
                    f.write(json.dumps({"prompt": text}) + "\n")
            prompts += made
            bar.update(len(made))
    return prompts[:n]
