"""The draft's speculation cache: drafts for the likeliest verdicts of a block in flight.

While the target verifies block b = d_1..d_k after history H, the draft already drafts the
next block for each verdict it finds likely: the target accepts j of the k tokens (j = 0..k)
and emits its own token t at position |H| + j. For every j it takes its ``width`` likeliest
candidates for t (under greedy its largest logits, under the coupled rule its largest races
q / E with the position's shared noise; never d_{j+1}, which the target would have accepted)
and drafts ``depth`` tokens after H + d_1..d_j + t. All branches run as one ragged batch: each
is a fork of the session's KV cache, so a pass over (k + 1) * width branches costs one draft
forward over that many tokens.

A branch is exactly the block the draft would have drafted after that verdict (the same
model, the same position-tied randomness), so taking it changes nothing but the time: greedy
output stays the target's, coupled sampling stays the seeded sample. Only drafter-invariant
requests without penalties branch (the rejection rule needs q on the wire, penalties the
growing context); the others keep the single guess of plain pipelining.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.config import MAX_K, SamplingParams
from specdec.serving.drafting import checked_tokens, draft_sampling, take_features
from specdec.serving.feature_engine import wire_features
from specdec.serving.engine import KVCache, LlamaEngine
from specdec.serving.grammar import GrammarState, Grammars, mask_logits
from specdec.serving.sampling import bias_logits, coupling_noise, process_logits
from specdec.serving.scheduler import Piece, Work
from specdec.serving.session import SessionStore

MAX_BRANCHES = 64  # (k + 1) * width per call


@dataclasses.dataclass
class BranchCall:
    """A validated propose call with branches: ``tokens`` ends with the block in flight."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    tokens: list[int]
    block_len: int  # the last block_len of tokens are d_1..d_k
    width: int  # candidates for the target's token per acceptance length
    depth: int  # tokens drafted after each candidate
    sampling: SamplingParams
    request_id: str = ""
    features: tuple[int, torch.Tensor] | None = None  # (start, rows): the target's features

    @classmethod
    def from_wire(cls, req, vocab_size: int) -> "BranchCall":
        tokens = checked_tokens(req.tokens, vocab_size)
        sampling = SamplingParams.from_wire(req.sampling)
        b = req.branches
        if not (b.block_len < len(tokens)):
            raise ValueError(f"branches.block_len must be < len(tokens) = {len(tokens)} (the "
                             f"history's last token comes first), got {b.block_len}")
        if not (1 <= b.width and (b.block_len + 1) * b.width <= MAX_BRANCHES):
            raise ValueError(f"branches.width must be >= 1 with (block_len + 1) * width <= "
                             f"{MAX_BRANCHES}, got width {b.width} for a block of {b.block_len}")
        if not (1 <= b.depth <= MAX_K):
            raise ValueError(f"branches.depth must be in [1, {MAX_K}], got {b.depth}")
        if not sampling.drafter_invariant or sampling.penalized:
            raise ValueError("branches need greedy or coupled sampling without penalties")
        return cls(req.session.session_id, int(req.session.prefix_len),
                   int(req.session.prefix_hash), tokens, int(b.block_len), int(b.width),
                   int(b.depth), sampling, req.request_id[:64],
                   wire_features(req.features, req.session.prefix_len + len(tokens)))


@dataclasses.dataclass
class Branch:
    accepted: int  # j: draft tokens of the block the verdict accepts
    token: int  # t: the target's token after them
    tokens: list[int]  # the draft's block after H + d_1..d_j + t
    cache: KVCache | None = None
    position: int = 0  # sequence position of the next token to draft
    grammar: GrammarState | None = None  # the branch's own matcher (constrained requests)


@dataclasses.dataclass
class BranchProposal:
    branches: list[Branch]
    cache_len: int


def ranked(logits: torch.Tensor, sampling: SamplingParams, q_params: SamplingParams,
           position: int, target_ids: np.ndarray | None, n: int,
           exclude: int | None = None) -> list[int]:
    """The output indices the draft ranks first at ``position``: its n likeliest choices
    (greedy: largest logits; coupled: largest races q / E), without ``exclude``."""
    if sampling.greedy and n == 1 and exclude is None:
        return [int(logits.argmax())]  # what DraftWork drafts: the same op, the same ties
    if sampling.greedy:
        order = torch.topk(logits, min(n + 1, logits.shape[-1])).indices.tolist()
    else:  # coupled: the first is coupled_choice's race winner
        p = process_logits(logits, q_params).detach().cpu().numpy().astype(np.float64)
        support = np.flatnonzero(p > 0)
        ids = support if target_ids is None else target_ids[support]
        race = p[support] / coupling_noise(sampling.seed, position, ids)
        if n == 1 and exclude is None:
            return [int(support[int(np.argmax(race))])]  # coupled_choice, exactly
        order = support[np.argsort(-race)[: n + 1]].tolist()
    return [i for i in order if i != exclude][:n]


class BranchWork(Work):
    """One branch call as scheduler work: feed the history's last token and the block (rows
    for every verdict), fork a cache per branch, then one ragged pass per drafted token over
    all branches (``next_piece`` returns a list of pieces)."""

    def __init__(self, call: BranchCall, engine: LlamaEngine, store: SessionStore,
                 q_top_k: int = 64, grammars: Grammars | None = None):
        super().__init__(call, engine, store, grammars)
        self._target_ids = None if engine.vocab_map is None else engine.vocab_map.cpu().numpy()
        self._q_params = draft_sampling(call.sampling, q_top_k)
        self.branches: list[Branch] = []
        self._active: list[Branch] = []
        self.depth = call.depth  # cut at the context's end in start()

    @property
    def history_len(self) -> int:
        """|H|: the sequence before the block in flight."""
        c = self.call
        return c.prefix_len + len(c.tokens) - c.block_len

    def start(self) -> None:
        super().start()
        c = self.call
        max_ctx = self.engine.arch.max_context
        if c.prefix_len + len(c.tokens) >= max_ctx:
            raise ValueError(f"sequence exceeds the draft's context of {max_ctx}")
        # Never draft past the context: shorter branches are still branches.
        self.depth = min(c.depth, max_ctx - c.prefix_len - len(c.tokens) - 1)
        take_features(self)

    def next_piece(self, budget: int) -> Piece | list[Piece] | None:
        feed, rows = self.call.tokens, self.call.block_len + 1
        head = len(feed) - rows  # fed as prefill; the rows come in one decode-sized piece
        if self._fed < head:
            if budget <= 0:
                return None
            n = min(budget, head - self._fed)
            self._piece_len = n
            return Piece(self.session.cache,
                         torch.tensor(feed[self._fed:self._fed + n], dtype=torch.long), 0, True)
        if self._fed == head:
            self._piece_len = rows
            return Piece(self.session.cache, torch.tensor(feed[head:], dtype=torch.long), rows,
                         False)
        return [Piece(b.cache, torch.tensor([b.tokens[-1] if b.tokens else b.token]), 1, False)
                for b in self._active]

    def consume(self, logits) -> bool:
        if isinstance(logits, list):  # one pass over the branches
            ended = set()
            for b, lg in zip(self._active, logits):
                row = self._constrained(lg[-1:], b.grammar)[0]
                if row is None:  # the grammar leaves this head nothing: the branch ends here
                    ended.add(id(b))
                    continue
                b.tokens.append(self._choose(row, b.position))
                if b.grammar is not None:
                    b.grammar.accept(b.tokens[-1])
                b.position += 1
            self._active = [b for b in self._active
                            if len(b.tokens) < self.depth and id(b) not in ended]
            return not self._active
        self._fed += self._piece_len
        if self._fed < len(self.call.tokens):
            return False
        self.session.append(self.call.tokens)
        if self.depth > 0:
            self._fork(logits)
        return not self._active

    def _constrained(self, rows: torch.Tensor, grammar: GrammarState | None) -> list:
        """rows [n, vocab_out] with the request's logit bias and, for a grammar, each row masked
        by the state after the rows before it (one row per call but for the fork's); a row the
        grammar leaves no token in this head is None."""
        vocab_map = self.engine.vocab_map
        rows = bias_logits(rows, self.call.sampling, self.engine.vocab_in, vocab_map)
        if grammar is None:
            return list(rows)
        allowed = grammar.allowed()  # [vocab]
        if vocab_map is not None:
            allowed = allowed[vocab_map.cpu()]  # [vocab_out]
        return [mask_logits(rows, allowed[None])[0] if bool(allowed.any()) else None]

    def _choose(self, logits: torch.Tensor, position: int) -> int:
        out = ranked(logits, self.call.sampling, self._q_params, position, self._target_ids, 1)[0]
        return int(self.engine.token_ids(torch.tensor([out]))[0])

    def _fork(self, rows: torch.Tensor) -> None:
        """A branch per (j, candidate t): a cache holding H + d_1..d_j, t still to feed."""
        c, h = self.call, self.history_len
        block = c.tokens[len(c.tokens) - c.block_len:]
        grammar = self.grammar
        if grammar is not None:  # the state after H; each j then takes one block token more
            grammar.sync(self.session.tokens[:h])
        for j in range(c.block_len + 1):
            exclude = None
            if j < c.block_len:  # the block's own token would have been accepted
                exclude = self._output_index(block[j])
            row = self._constrained(rows[j:j + 1], grammar)[0]
            candidates = [] if row is None else [
                out for out in ranked(row, c.sampling, self._q_params, h + j, self._target_ids,
                                      c.width, exclude)
                if row[out] > float("-inf")]  # (greedy's top n may reach masked tokens)
            for out in candidates:
                token = int(self.engine.token_ids(torch.tensor([out]))[0])
                cache = self.session.cache.fork(h + j)
                fork = None
                if grammar is not None:
                    fork = grammar.fork()
                    fork.accept(token)
                self.branches.append(Branch(j, token, [], cache, h + j + 1, fork))
            if grammar is not None and j < c.block_len and not grammar.accept(block[j]):
                break  # no verdict keeps a token the grammar refuses: no branches past it
        self._active = list(self.branches)

    def _output_index(self, token: int) -> int | None:
        """The head's output index of a token id (None: outside a reduced head)."""
        if self._target_ids is None:
            return token
        hit = np.flatnonzero(self._target_ids == token)
        return int(hit[0]) if hit.size else None

    def result(self) -> BranchProposal:
        self.session.calls += 1
        self.session.tokens_in += len(self.call.tokens)
        self.session.proposed += sum(len(b.tokens) for b in self.branches)
        self.session.compute_s += self.compute_s
        for b in self.branches:
            b.cache = None  # forks are dropped with the call
            b.grammar = None
        return BranchProposal(self.branches, len(self.session))
