"""A round's plan: which block the next round verifies (prompt lookup, the draft model, the
block drafted behind the last verify, or none), what the draft drafts behind its verify
(pipelined), and what the verdicts teach the choice."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

from orchestrator.adaptive import LATE_SHARE, KController
from orchestrator.generation import Block, GenerationRequest, GenerationStats, Round, Source
from orchestrator.service_clients import CallRecord, History, ServiceError
from specdec.config import MAX_K, SamplingParams
from specdec.serving.branching import MAX_BRANCHES
from specdec.serving.drafting import lookup
from specdec.serving.grammar import GrammarState

if TYPE_CHECKING:
    from orchestrator.loop import Orchestrator

LOOKUP_MIN_NGRAM = 3  # matched tokens a lookup block needs to take a draft model's round
LOOKUP_MIN_NGRAM_ALONE = 1  # ... and a round the draft model would not draft (k = 0)
LOOKUP_MAX_NGRAM = 5
LOOKUP_MAX_TOKENS = 8


def lookup_block(history: list[int], room: int, sampling: SamplingParams,
                 min_ngram: int, grammar: GrammarState | None = None) -> Block | None:
    """Prompt lookup: what followed the latest earlier occurrence of the history's last
    ``min_ngram``..5 tokens, as a block (q is one-hot on each proposed token), or None.
    Under a grammar the block ends before the first token the grammar refuses."""
    if room < 1:
        return None
    tokens = lookup(history, min(LOOKUP_MAX_TOKENS, room), LOOKUP_MAX_NGRAM, min_ngram)
    if tokens and grammar is not None:
        grammar.sync(history)
        tokens = tokens[: grammar.legal_prefix(tokens)]
    if not tokens:
        return None
    return Block(tokens, [] if sampling.drafter_invariant else [([t], [1.0]) for t in tokens],
                 source=Source.LOOKUP)


@dataclasses.dataclass(frozen=True)
class DraftBehind:
    """The draft's call behind a round's verify (pipelined): its single guess of the target's
    token and ``depth`` tokens past it, or the speculation cache's branches, ``width``
    candidates per acceptance length, each ``depth`` tokens long."""

    guess: bool
    depth: int
    width: int = 1


@dataclasses.dataclass
class Plan:
    """A round's plan: the block it verifies, and the draft's call behind the verify (None:
    no call)."""

    block: Block
    behind: DraftBehind | None = None


def record_cancelled(stats: GenerationStats) -> None:
    """A draft call behind a verify that its verdict dropped, for the stats and the timeline."""
    t = time.perf_counter()
    stats.calls.append(CallRecord("draft", t, t, 0.0, 0, "cancelled"))


class Planner:
    """The drafting side of one generation: k from the controller, each round's plan (its
    block: prompt lookup, the draft model, or the block drafted behind the last verify;
    pipelined, the draft's call behind its verify), and what the verdicts teach the
    controller and the lookup sizer."""

    def __init__(self, orch: Orchestrator, req: GenerationRequest, session_id: str,
                 stats: GenerationStats):
        self.orch, self.req, self.session_id, self.stats = orch, req, session_id, stats
        speculate = req.mode != "target-only"
        self.k_ctl: KController | None = orch._controller(req) \
            if speculate and orch.draft is not None else None
        self.lookup = orch._lookup_sizer(req) if speculate and req.prompt_lookup else None
        self.grammar = orch.grammars.state(req.sampling.grammar, len(req.prompt_ids)) \
            if self.lookup is not None and req.sampling.grammar else None
        self.warmup: asyncio.Task | None = None  # the first round's draft prefill
        # Pipelined: the draft drafts behind each verify (with the speculation cache's widths
        # where the request may branch, else None).
        self.pipelined = req.mode == "pipelined" and orch.draft is not None
        self.widths = orch._branch_widths(req) if self.pipelined else None

    async def plan(self, history: History, carried: Block | None, remaining: int,
                   first_round: bool) -> Plan:
        """This round's plan: its block, and pipelined what the draft drafts behind it."""
        block = await self.block(history, carried, remaining, first_round)
        return Plan(block, self.behind(block, remaining) if self.pipelined else None)

    async def block(self, history: History, carried: Block | None, remaining: int,
                    first_round: bool) -> Block:
        """This round's block. The first round drafts nothing: the target's prefill produces
        its first token while the draft prefills the prompt (pipelined: and drafts past its
        guess of that token), which gives time to first token = the target's prefill alone,
        and under load keeps the draft's prefills of every new generation off the target's
        path (measured on separate cores, 8 generations starting together: sequential rounds
        reached their first token 0.3-0.45 s after target-only's when the first round
        drafted)."""
        # Pipelined, a round with nothing carried over (a miss) drafts its block now, after
        # the verdict: k as a sequential round's (KController.best_k).
        now = carried is None and not first_round
        k = max(min(self.next_k(now=now), remaining - 1, MAX_K), 0)
        if carried is None and self.lookup is not None:
            found = lookup_block(history.tokens, min(self.lookup.size(), remaining - 1),
                                 self.req.sampling,
                                 LOOKUP_MIN_NGRAM if k > 0 else LOOKUP_MIN_NGRAM_ALONE,
                                 self.grammar)
            # Free to draft, but it takes the round from the draft model's block: only when
            # its expected rate beats that block's (a draft that agrees with the target 95%
            # of the time beats most lookups, the shipped draft few).
            if found is not None and (k == 0 or self.k_ctl is None or
                                      self.lookup.rate() > self.k_ctl.rate(k, now=now)):
                found.k = k
                return found
        if k == 0:  # (crowded: other generations' load on the shared cores weighed in)
            return Block([], source=Source.CROWDED if self.crowded() else Source.NONE, k=0)
        if carried is not None:
            block = carried.cut(k)
            block.k = k
            return block
        available = await self.orch.draft.available()
        if first_round and available:
            # (pipelined, the draft drafts behind this round)
            if self.req.mode != "pipelined" and not self.orch.shared_cores:
                # The draft prefills the prompt (and guesses the target's first token) while
                # the target does; the next round's draft call goes after it. Not where the
                # draft shares the target's cores: there the two prefills take turns on them,
                # the draft's with its first draft call after the target's first token
                # (measured on 2 shared cores, the int8 draft, a 107-token prompt: both
                # prefills at once took 1.6 s, where the target's alone takes ~0.2 s and
                # the draft's ~0.6 s).
                self.warmup = asyncio.create_task(
                    self.draft_block(History(history.tokens), [], 1, warmup=True))
            return Block([], source=Source.FIRST, k=k)
        block = await self.draft_block(history, [], k) if available else None
        if block is None:
            return Block([], source=Source.NONE, k=k, draft_failed=True)
        block.k = k
        return block

    def behind(self, block: Block, remaining: int) -> DraftBehind | None:
        """What the draft drafts behind ``block``'s verify, if anything."""
        # Behind a round of no block too when the cache is on (a miss whose block did not pay
        # to draft now): its branches are the next token's likeliest candidates.
        if not (block.tokens or block.source is Source.FIRST or
                (self.widths is not None and block.source is Source.NONE and
                 not block.draft_failed)):
            return None
        room = remaining - len(block.tokens) - 1
        if room <= 0:
            return None
        # The draft also drafts its guess of the target's token: depth + 1 <= MAX_K.
        depth = min(self.next_k(after_full_accept=True), MAX_K - 1, room - 1)
        if depth <= 0:
            return None
        k = len(block.tokens)
        if self.widths is None or k + 1 > MAX_BRANCHES or self.k_ctl.drafts_guess(k):
            return DraftBehind(guess=True, depth=depth)  # plain pipelining's call
        width = self.widths.choose(k, depth,
                                   1.0 if self.k_ctl.waits_for_draft() else LATE_SHARE)
        self.k_ctl.use_width(width)
        return DraftBehind(guess=False, depth=depth, width=width)

    def next_k(self, after_full_accept: bool = False, now: bool = False) -> int:
        """The controller's k (0 without a draft)."""
        if self.k_ctl is None:
            return 0
        return self.k_ctl.next_k(after_full_accept, now)

    def crowded(self) -> bool:
        """Whether the controller weighs other generations on the shared cores
        (KController.crowd): a round of no block then is a crowded round."""
        return self.k_ctl is not None and self.k_ctl.crowded()

    async def draft_block(self, history: History, extra: list[int], k: int,
                          source: Source = Source.DRAFT, warmup: bool = False,
                          ) -> Block | None:
        """A block of k from the draft after history + extra, or None when the draft failed.
        ``warmup``: the first round's prefill, whose block nobody takes."""
        if self.warmup is not None and not warmup:  # one call per session at a time
            task, self.warmup = self.warmup, None
            await task
        return await self.orch._draft(self.session_id, history, extra, k, self.req,
                                      self.stats, source)

    def cancel(self) -> None:
        if self.warmup is not None:
            self.warmup.cancel()

    async def draft_branches(self, history: History, block: list[int], width: int,
                             depth: int) -> tuple[list, CallRecord] | None:
        """The speculation cache's branches behind ``block``, or None when the draft failed."""
        orch, req = self.orch, self.req
        try:
            resp, rec = await orch.draft.propose_branches(self.session_id, history, block, width,
                                                          depth, req.sampling, req.request_id)
        except asyncio.CancelledError:  # late for its verdict (Pipeline.next_block)
            record_cancelled(self.stats)
            raise
        except ServiceError as exc:
            orch._draft_failed(req, self.stats, exc)
            return None
        orch._record(self.stats, rec)
        return list(resp.branches), rec

    def learn(self, rnd: Round) -> None:
        """The verdict teaches whoever drafted the block (the draft model's acceptance is
        learnt from its own blocks only)."""
        if rnd.block.source is Source.LOOKUP:
            self.lookup.observe(rnd.accepted)
        elif self.k_ctl is not None:
            self.k_ctl.observe(len(rnd.block.tokens), rnd.accepted)
