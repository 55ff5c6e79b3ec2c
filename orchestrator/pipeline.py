"""Pipelined drafting: while the target verifies a block, the draft drafts the next one."""

from __future__ import annotations

import asyncio
import time

from orchestrator.generation import Behind, Block, Round, Source
from orchestrator.planning import Plan, Planner
from orchestrator.service_clients import History

# Where rounds do not wait for the draft (KController.waits_for_draft), how long a verdict
# still waits for a branch call that has not answered: less than the target's regroup wait
# (ServiceConfig.regroup_ms, 5 ms), so the round still rides the others' next pass.
LATE_BRANCH_MS = 2.0


class Pipeline:
    """Pipelining: while the target verifies a block, the draft drafts the next one, as the
    round's plan says (``Plan.behind``, decided by the Planner).

    With the speculation cache (greedy or coupled requests without penalties, a model draft)
    it drafts a branch for each likely verdict (specdec.serving.branching), as wide as hides
    behind the verify pass; the next round takes the verdict's branch at once if there is one.
    Otherwise it drafts past the block, its guess of the target's token first, kept only when
    the verdict accepts the whole block and the guess was right (else cancelled; the draft
    rolls back to the committed tokens, as its next call's prefix says).
    """

    def __init__(self, planner: Planner):
        self.planner = planner
        self.widths = planner.widths  # None: no speculation cache for this request
        self.task: asyncio.Task | None = None
        self.behind: Behind | None = None  # what the call in flight drafts
        self.shape = (0, 0, 0)  # (k, width, depth) of the branch call in flight
        self.started = 0.0  # when it was sent

    def draft_behind(self, history: History, plan: Plan) -> Behind | None:
        """Send the draft's call behind the plan's verify, if it has one: what it drafts."""
        call, tokens = plan.behind, plan.block.tokens
        if call is None:
            return None
        self.behind = Behind(guess_call=call.guess)
        if call.guess:  # plain pipelining: the guess and the block past it
            self.task = asyncio.create_task(
                self.planner.draft_block(history, tokens, call.depth + 1, Source.PIPELINED))
            return self.behind
        self.shape = (len(tokens), call.width, call.depth)
        self.started = time.perf_counter()
        self.task = asyncio.create_task(
            self.planner.draft_branches(history, tokens, call.width, call.depth))
        return self.behind

    async def next_block(self, rnd: Round) -> Block | None:
        """The block drafted behind ``rnd`` for its verdict, else None (``rnd.behind`` says
        what the verdict found)."""
        if self.task is None:
            return None
        task, self.task = self.task, None
        behind = self.behind
        behind.judged = True
        if not behind.guess_call:
            return await self._branch_for(rnd, task, behind)
        if rnd.full_accept:
            ahead = await task
        else:
            task.cancel()
            ahead = None
        behind.hit = ahead is not None and bool(ahead.tokens) and \
            ahead.tokens[0] == rnd.next_token
        if ahead is not None or not rnd.full_accept:  # (None after a full accept: it failed)
            self.planner.k_ctl.observe_guess(len(rnd.block.tokens), behind.hit)
        if not behind.hit or len(ahead.tokens) == 1:
            return None
        return Block(ahead.tokens[1:], ahead.dists[1:], source=Source.PIPELINED)

    async def _branch_for(self, rnd: Round, task: asyncio.Task, behind: Behind) -> Block | None:
        k_ctl = self.planner.k_ctl
        if not task.done() and not k_ctl.waits_for_draft():
            await asyncio.wait({task}, timeout=LATE_BRANCH_MS / 1000.0)
            if not task.done():  # late: this round goes without a block, the call is dropped
                task.cancel()
                self.widths.observe(*self.shape, (time.perf_counter() - self.started) * 1000.0)
                k_ctl.observe_cache(False)
                k_ctl.probe_late()
                behind.late = True
                return None
        called = await task  # (branches, call record), or None: the draft failed
        branches = called[0] if called is not None else []
        if called is not None:
            rec = called[1]
            self.widths.observe(*self.shape, rec.wall_ms)
        behind.branches = len(branches)
        hit = next((b for b in branches
                    if b.accepted == rnd.accepted and b.token == rnd.next_token), None)
        if called is not None:
            k_ctl.observe_cache(hit is not None)
            # the single guess would have held it: the whole block kept and the first (the
            # draft's likeliest) candidate after it the target's token
            k = len(rnd.block.tokens)
            guess = next((b for b in branches if b.accepted == k), None)
            k_ctl.observe_guess(k, guess is not None and rnd.accepted == k and
                                guess.token == rnd.next_token)
        behind.hit = hit is not None and bool(hit.tokens)
        if not behind.hit:
            return None
        return Block(list(hit.tokens), source=Source.PIPELINED)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
