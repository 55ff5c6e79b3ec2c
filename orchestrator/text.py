"""Incremental detokenization with stop strings, for printing and streaming."""

from __future__ import annotations


class TextStream:
    """Turns a growing list of generated token ids into stable text deltas.

    Holds back text that may still change (an incomplete UTF-8 sequence decodes to U+FFFD) or
    that could be the start of a stop string, so a streamed stop string is never shown.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0  # characters of text already handed out
        self.text = ""
        self.stopped = False
        self.stop_token_count: int | None = None  # tokens needed to reach the stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int], final: bool = False) -> str:
        """Return the new stable text given all generated ids so far."""
        if self.stopped:
            return ""
        text = self._decode(ids)
        cut, end = None, None
        for s in self.stop:
            at = text.find(s)
            if at != -1 and (cut is None or at < cut):
                cut, end = at, at + len(s)
        if cut is not None:
            self.stopped = True
            self.text = text[:cut]
            self.stop_token_count = self._tokens_covering(ids, end)
            delta = self.text[self.emitted :]
            self.emitted = len(self.text)
            return delta
        self.text = text
        stable = len(text) if final else len(text) - self.hold
        if not final and text.endswith("\ufffd"):
            stable = min(stable, len(text.rstrip("\ufffd")))
        if stable <= self.emitted:
            return ""
        delta = text[self.emitted : stable]
        self.emitted = stable
        return delta

    def _tokens_covering(self, ids: list[int], chars: int) -> int:
        """Fewest leading tokens whose text holds the first ``chars`` characters: the tokens
        generated up to and including the one that completed the stop string (as vLLM counts
        them; the text itself ends before the stop string)."""
        for n in range(1, len(ids) + 1):
            if len(self._decode(ids[:n])) >= chars:
                return n
        return len(ids)
