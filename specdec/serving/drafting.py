"""The draft's side of a round: propose k tokens (and the q each was sampled from).

Two drafters speak the same protocol: a draft *model* (run by the batch scheduler) and the
model-free *n-gram* drafter (prompt lookup), which proposes the continuation of the latest
earlier occurrence of the history's last n tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.config import MAX_K, SamplingParams
from specdec.serving.engine import LlamaEngine
from specdec.serving.feature_engine import wire_features
from specdec.serving.grammar import Grammars, mask_logits, session_grammar
from specdec.serving.sampling import (
    bias_logits,
    coupled_choice,
    coupled_race,
    penalize,
    position_generator,
    process_logits,
    sample,
)
from specdec.serving.scheduler import Piece, Work
from specdec.serving.session import SessionStore, resolve

# A coupled draft races on the device off the CPU only; tests set this to run that path on
# the CPU, where it must give numpy's tokens.
DEVICE_RACE_ON_CPU = False


@dataclasses.dataclass
class ProposeCall:
    """A validated draft request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    tokens: list[int]
    k: int
    sampling: SamplingParams
    request_id: str = ""
    features: tuple[int, torch.Tensor] | None = None  # (start, rows): the target's features

    @classmethod
    def from_wire(cls, req, vocab_size: int) -> "ProposeCall":
        tokens = checked_tokens(req.tokens, vocab_size)
        if not (1 <= req.k <= MAX_K):
            raise ValueError(f"k must be in [1, {MAX_K}], got {req.k}")
        return cls(
            session_id=req.session.session_id,
            prefix_len=int(req.session.prefix_len),
            prefix_hash=int(req.session.prefix_hash),
            tokens=tokens,
            k=int(req.k),
            sampling=SamplingParams.from_wire(req.sampling),
            request_id=req.request_id[:64],
            features=wire_features(req.features, req.session.prefix_len + len(tokens)),
        )


def take_features(work: Work) -> None:
    """Give a draft call's features (ProposeCall / BranchCall.features) to its session's
    cache, where the draft reads them (a feature draft's); other drafts ignore them."""
    features = work.call.features
    if features is not None and hasattr(work.session.cache, "add_features"):
        work.session.cache.add_features(*features)


def checked_tokens(tokens, vocab_size: int) -> list[int]:
    """A draft call's tokens: non-empty (drafting continues from the last), ids in the vocab."""
    tokens = list(tokens)
    if not tokens:
        raise ValueError("tokens must not be empty: drafting continues from the last one")
    bad = [t for t in tokens if not (0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"tokens: token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return tokens


@dataclasses.dataclass
class Proposal:
    tokens: list[int]
    dists: list[tuple[list[int], list[float]]]  # sparse q per token (rejection rule) or []
    cache_len: int


def draft_sampling(sampling: SamplingParams, q_top_k: int) -> SamplingParams:
    """What the draft samples from (and sends as q under the rejection rule): the request's
    temperature, top-k and top-p, its top-k cut to the draft's ``q_top_k`` (0: uncut)."""
    if sampling.greedy or not q_top_k:
        return sampling
    top_k = min(sampling.top_k, q_top_k) if sampling.top_k else q_top_k
    return SamplingParams(sampling.temperature, top_k, sampling.top_p, sampling.seed)


class DraftWork(Work):
    """One propose call as scheduler work: prefill chunks, then one pass per drafted token.

    Sampled tokens come from the draft's processed distribution truncated to its ``q_top_k``
    most likely tokens. Under the rejection rule that truncated distribution is sent as q (the
    rule stays exact because q is what the token was drawn from, and the message stays small);
    under the coupled rule the token is the exponential race over those tokens with the shared
    noise, and nothing else is sent (any proposal is exact under that rule).
    """

    def __init__(
        self, call: ProposeCall, engine: LlamaEngine, store: SessionStore, q_top_k: int = 64,
        grammars: Grammars | None = None,
    ):
        super().__init__(call, engine, store, grammars)
        self.q_top_k = q_top_k
        # the target id of each output index when the head is reduced (coupled noise is per id)
        self._target_ids = None if engine.vocab_map is None else engine.vocab_map.cpu().numpy()
        self.drafted: list[int] = []
        self.dists: list[tuple[list[int], list[float]]] = []
        self._q_params = draft_sampling(call.sampling, q_top_k)
        # Greedy, or coupled off the CPU, with no grammar to read the host, a drafted token
        # stays where the logits are, as the next step's input ([1] each), and the call
        # fetches them once at its end: no device-to-host copy between a GPU draft's steps
        # (penalties too are counted there). (A coupled race on the CPU stays numpy's:
        # torch's int64 hash costs 3x there.)
        s = call.sampling
        on_device = s.greedy or (s.rule == "coupled" and (
            engine.device.type != "cpu" or DEVICE_RACE_ON_CPU))
        self._on_device: list[torch.Tensor] | None = \
            [] if on_device and not s.grammar else None
        self._race_ids = None  # the coupled race's token ids, on the device (reduced head)
        self._committed = None  # penalized on the device: the committed tokens, there

    def start(self) -> None:
        super().start()
        c = self.call
        max_ctx = self.engine.arch.max_context
        if c.prefix_len + len(c.tokens) >= max_ctx:
            raise ValueError(f"sequence exceeds the draft's context of {max_ctx}")
        # Never draft past the context: a shorter block is still a valid block.
        self.k = min(c.k, max_ctx - c.prefix_len - len(c.tokens))
        take_features(self)

    def next_piece(self, budget: int) -> Piece | None:
        feed = self.call.tokens
        remaining = len(feed) - self._fed
        if remaining > 1:
            if budget <= 0:
                return None
            n = min(budget, remaining - 1)
            chunk, prefill, num_logits = feed[self._fed : self._fed + n], True, 0
        elif remaining == 1:
            n, chunk, prefill, num_logits = 1, feed[-1:], False, 1
        elif self._on_device is not None:  # the last drafted token, still on the device
            self._piece_len = 1
            return Piece(self.session.cache, self._on_device[-1], 1, False)
        else:
            n, chunk, prefill, num_logits = 1, self.drafted[-1:], False, 1
        self._piece_len = n
        return Piece(self.session.cache, torch.tensor(chunk, dtype=torch.long), num_logits, prefill)

    def consume(self, logits: torch.Tensor) -> bool:
        if self._fed < len(self.call.tokens):
            self._fed += self._piece_len
            if self._fed < len(self.call.tokens):
                return False
        elif self._on_device is None:
            self.session.append(self.drafted[-1:])  # the drafted token just fed
        if self._on_device is not None:
            logits = logits[-1:]
            if self.call.sampling.penalized:  # over the drafted tokens still on the device
                if self._committed is None:  # (copied there once a call)
                    self._committed = torch.tensor(
                        self.session.tokens[: self.call.prefix_len] + self.call.tokens,
                        device=logits.device)
                logits = self._penalized(logits, torch.cat([self._committed, *self._on_device]))
            logits = bias_logits(logits, self.call.sampling, self.engine.vocab_in,
                                 self.engine.vocab_map)
            self._on_device.append(self.engine.token_ids(self._device_choice(logits)))  # [1]
            if len(self._on_device) == 1:
                self.session.append(self.call.tokens)
            return len(self._on_device) >= self.k
        position = self.call.prefix_len + len(self.call.tokens) + len(self.drafted)
        sampling = self.call.sampling
        vocab_map = self.engine.vocab_map
        logits = logits[-1:]
        if sampling.penalized:  # as the target will: the draft's tokens are then likelier kept
            logits = self._penalized(logits, self.session.tokens[: self.call.prefix_len] +
                                     self.call.tokens + self.drafted)
        logits = bias_logits(logits, sampling, self.engine.vocab_in, vocab_map)
        if self.grammar is not None:  # propose only what the target can take
            if not self.drafted:
                self.grammar.sync(self.session.tokens[: self.call.prefix_len] + self.call.tokens)
            allowed = self.grammar.allowed()  # [vocab]
            if vocab_map is not None:
                allowed = allowed[vocab_map.cpu()]  # [vocab_out]
            if not bool(allowed.any()):  # nothing this head can propose: a shorter block
                if not self.drafted:
                    self.session.append(self.call.tokens)
                self.k = len(self.drafted)
                return True
            logits = mask_logits(logits, allowed[None])
        if sampling.greedy:
            out_id = int(logits[-1].argmax())
        elif sampling.rule == "coupled":
            probs = process_logits(logits[-1], self._q_params)  # [vocab_out]
            out_id = coupled_choice(probs, sampling.seed, position, self._target_ids)
        else:
            probs = process_logits(logits[-1], self._q_params)  # [vocab_out]
            out_id = sample(probs, position_generator(self.call.sampling.seed, position, "draft"))
            nz = torch.nonzero(probs > 0).flatten()
            ids = self.engine.token_ids(nz).tolist()
            self.dists.append((ids, probs[nz].tolist()))
        self.drafted.append(int(self.engine.token_ids(torch.tensor([out_id]))[0]))
        if self.grammar is not None:
            accepted = self.grammar.accept(self.drafted[-1])
            assert accepted, "a masked choice is always allowed"
        if len(self.drafted) == 1:
            self.session.append(self.call.tokens)
        return len(self.drafted) >= self.k

    def _penalized(self, logits: torch.Tensor, context) -> torch.Tensor:
        """The request's penalties on the draft's logits [1, vocab_out] after ``context`` (ids;
        a list, or a tensor where the logits are), as the target will apply them: the draft's
        tokens are then likelier kept. Penalties are over token ids: through the full
        vocabulary and back where the head is reduced."""
        vocab_map = self.engine.vocab_map
        if vocab_map is None:
            return penalize(logits, self.call.sampling, context)
        full = self.engine.full_vocab_logits(logits, self.engine.vocab_in)
        return penalize(full, self.call.sampling, context)[:, vocab_map.to(full.device)]

    def _device_choice(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafted output index [1] of the last row of ``logits``, on their device: the
        argmax (greedy) or the coupled race over the processed distribution, as
        ``coupled_choice`` runs it on the host."""
        s = self.call.sampling
        if s.greedy:
            return logits.argmax(-1)
        if self._race_ids is None and self._target_ids is not None:
            self._race_ids = torch.as_tensor(self._target_ids).to(logits.device)
        position = self.call.prefix_len + len(self.call.tokens) + len(self._on_device)
        probs = process_logits(logits[-1], self._q_params)[None]  # [1, vocab_out]
        return coupled_race(probs, s.seed, position, self._race_ids)[0]

    def result(self) -> Proposal:
        if self._on_device:  # one copy for the whole block; the session holds all it fed
            self.drafted = torch.cat(self._on_device).tolist()
            self.session.append(self.drafted[:-1])
            self._on_device = []
        self.session.calls += 1
        self.session.tokens_in += len(self.call.tokens)
        self.session.proposed += len(self.drafted)
        self.session.compute_s += self.compute_s
        return Proposal(self.drafted, self.dists, len(self.session))


class NgramCache:
    """The n-gram drafter keeps no model state; the session's tokens are its whole cache."""

    nbytes = 0

    def truncate(self, length: int) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    def __init__(self, store: SessionStore, max_ngram: int = 4, min_ngram: int = 1,
                 grammars: Grammars | None = None):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.store = store
        self.grammars = grammars
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, call: ProposeCall) -> Proposal:
        session = resolve(
            self.store, call.session_id, call.prefix_len, call.prefix_hash, NgramCache
        )
        session.request_id = call.request_id or session.request_id
        session.append(call.tokens)
        drafted = lookup(session.tokens, call.k, self.max_ngram, self.min_ngram)
        grammar = session_grammar(session, self.grammars, call.sampling.grammar,
                                  call.sampling.prompt_len)
        if grammar is not None:  # up to the first token the target could not take
            grammar.sync(session.tokens)
            drafted = drafted[: grammar.legal_prefix(drafted)]
        session.append(drafted[:-1])
        session.calls += 1
        session.tokens_in += len(call.tokens)
        session.proposed += len(drafted)
        # The proposal is deterministic: q puts all its mass on the proposed token.
        dists = [] if call.sampling.drafter_invariant else [([t], [1.0]) for t in drafted]
        return Proposal(drafted, dists, len(session))


def lookup(history: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's longest suffix.

    Tries suffix lengths max_ngram..min_ngram; returns [] when no suffix occurred before.
    """
    n_hist = len(history)
    if n_hist < 2:
        return []
    # Only an occurrence ending in the last token can match: find those once (latest first)
    # and compare suffixes there, instead of slicing at every position for every length
    # (~160 us a call on a 200-token history: every round of every generation pays it).
    last = history[-1]
    ends = [e for e, t in enumerate(history[:-1]) if t == last][::-1]
    for n in range(min(max_ngram, n_hist - 1), min_ngram - 1, -1):
        suffix = history[n_hist - n :]
        # latest start j = e - n + 1 < n_hist - n with history[j:j+n] == suffix
        for e in ends:
            j = e - n + 1
            if j >= 0 and history[j : e + 1] == suffix:
                return list(history[e + 1 : e + 1 + k])
    return []
