"""Grammar-constrained decoding (xgrammar): compiled grammars and each session's matcher.

A constrained request carries its grammar as EBNF text (SamplingParams.grammar). Every service
compiles it once against its tokenizer (cached by text) and keeps, per session, a matcher that
has accepted the session's output tokens (those after ``prompt_len``). A call first
``sync``-s the matcher to the committed sequence it builds on: the tokens the matcher holds
beyond their common prefix are rolled back (the rejected draft tokens of the last round), the
missing ones accepted. So a restarted service, or an evicted session re-sent with
prefix_len = 0, rebuilds its matcher from the history alone, as it rebuilds its KV cache.

Terms: the *mask* of a position is the set of tokens the grammar allows there, given every
output token before it. A verify block's row j is masked by the state after the committed
tokens and draft tokens d_1..d_j (``block_masks``).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)

# Compiled grammars kept per service (xgrammar's compiler cache, by grammar text).
CACHE_BYTES = 64 * 1024 * 1024


class GrammarError(ValueError):
    """A grammar the library cannot compile (the message says what it refused)."""


class Grammars:
    """A tokenizer's grammar compiler and its cache. The tokenizer's xgrammar view is built on
    first use (~0.2-0.4 s): an unconstrained service never pays it."""

    def __init__(self, tokenizer, vocab_size: int | None, stop_ids: list[int]):
        self.tokenizer = tokenizer
        self._vocab_size = vocab_size  # None: the tokenizer's length
        self.stop_ids = sorted(set(stop_ids))
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size or len(self.tokenizer)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def compile(self, grammar: str):
        """The compiled grammar of EBNF text; GrammarError when it does not compile."""
        try:
            return self._get_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"grammar does not compile: {_first_line(exc)}") from None

    def state(self, grammar: str, prompt_len: int) -> "GrammarState":
        """A fresh matcher for a session whose output starts after ``prompt_len`` tokens."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(grammar), max_rollback_tokens=-1)
        return GrammarState(matcher, grammar, prompt_len, self.vocab_size)


def _first_line(exc: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source position: keep the why."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarState:
    """One session's matcher and the output tokens it has accepted."""

    def __init__(self, matcher, grammar: str, prompt_len: int, vocab_size: int):
        self.matcher = matcher
        self.grammar = grammar
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.output: list[int] = []  # tokens accepted, in order
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.full((1, self._words), -1, dtype=torch.int32)

    def sync(self, sequence: list[int]) -> None:
        """Make the matcher hold exactly the output part of ``sequence`` (prompt + committed
        tokens): roll back what it holds past their common prefix, accept the rest.
        ValueError when a committed token breaks the grammar (the caller's history is not one
        this grammar produced)."""
        target = sequence[self.prompt_len:]
        held = self.output
        common = 0
        limit = min(len(held), len(target))
        while common < limit and held[common] == target[common]:
            common += 1
        if common < len(held):
            self.matcher.rollback(len(held) - common)
            del held[common:]
        for tok in target[common:]:
            if not self.accept(tok):
                raise ValueError(f"committed token {tok} at output position {len(held)} "
                                 "breaks the request's grammar")

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
            return False
        self.output.append(int(token))
        return True

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next: bool [vocab_size] (none once a stop token ended it)."""
        if self.matcher.is_terminated():
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        # numpy, not torch ops: single-threaded, so a busy core never stalls an OpenMP team
        # over 49k bits (measured under load: tens of ms per mask with torch's shifts)
        bits = np.unpackbits(self._bitmask[0].numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].view(np.bool_))

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here. The matcher is left after
        them: the next ``sync`` rolls them back."""
        n = 0
        for tok in tokens:
            if not self.accept(tok):
                break
            n += 1
        return n

    def fork(self) -> "GrammarState":
        """An independent copy at the same point (a speculation-cache branch)."""
        copy = GrammarState(self.matcher.fork(), self.grammar, self.prompt_len, self.vocab_size)
        copy.output = list(self.output)
        return copy


def block_masks(state: GrammarState, committed: list[int],
                draft_tokens: list[int]) -> torch.Tensor:
    """The mask of each row of a verify block: row j after committed + d_1..d_j.

    Returns bool [k + 1, vocab]. Rows after a draft token the grammar refuses, or after a
    stop token that ends it, are left all-allowed: the walk stops at that token (its row gives
    it no mass; a stop token ends the generation), so they never decide an emitted token. The matcher is left after the draft tokens it accepted: the caller rolls back to
    the verdict (``state.sync``).
    """
    k = len(draft_tokens)
    state.sync(committed)
    masks = torch.ones(k + 1, state.vocab_size, dtype=torch.bool)  # [k + 1, vocab]
    for j in range(k + 1):
        masks[j] = state.allowed()
        if j == k or not state.accept(draft_tokens[j]) or state.matcher.is_terminated():
            break
    return masks


def session_grammar(session, grammars: Grammars | None, grammar: str,
                    prompt_len: int) -> GrammarState | None:
    """The session's grammar state for this call (made on the session's first constrained
    call, or again when a call brings another grammar); None when unconstrained."""
    if not grammar:
        return None
    if grammars is None:
        raise ValueError("this service cannot run grammars (it was built without a tokenizer)")
    state = session.grammar
    if state is None or state.grammar != grammar or state.prompt_len != prompt_len:
        state = session.grammar = grammars.state(grammar, prompt_len)
    return state


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with the disallowed tokens at -inf (allowed: bool [n, vocab])."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
