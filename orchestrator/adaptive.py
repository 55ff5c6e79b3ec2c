"""Adaptive draft length: pick k each round to maximise expected tokens per second.

With per-token acceptance a, a block of k yields E[k] = (1 - a^(k+1)) / (1 - a) tokens per
round. A round costs k draft steps plus one verify pass over k + 1 tokens (sequential), or,
pipelined, only the verify pass when the next block was drafted behind it (which needs the
whole block accepted and the draft's guess of the target's token right, about a^(k+1)). k = 0
is plain target decoding, chosen whenever speculation does not pay, so specdec is never much
slower than the target alone.

Costs (``Costs``) start from the services' start-up calibration (GetInfo.forward_ms) and, for
greedy requests, follow what the services' calls actually cost (``LiveCosts``: decayed averages
of each call's compute and of its time beyond compute), so services started together, slowed
by neighbours or batching other sessions are costed as they are. Greedy text does not depend
on k. Sampled requests keep the calibrated costs, so k depends only on the acceptance history
and a seeded request gives the same text every time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specdec.serving.branching import MAX_BRANCHES

# The longest block adaptive k chooses (a request's fixed k may go to specdec.config.MAX_K).
ADAPTIVE_K_MAX = 8
PROBE_EVERY = 16  # rounds at k = 0 between probes of the acceptance
# Each probe that leaves speculation unpaid doubles the rounds to the next one, up to this
# factor (one that pays resets it). A probe costs a draft call that catches up on the tokens
# since the last one, or a lookup's longer verify pass, against a round that is one target
# step: with the target on its GGUF codes (a step of ~9 ms on 2 shared cores), probes every
# 16 rounds cost the shipped draft's chat rounds 9% against target-only (measured: 5 draft
# and 4 lookup probes in 93 rounds, 3 of their 42 tokens accepted).
PROBE_BACKOFF_MAX = 8
# While the target batches other sessions, speculate only for a predicted gain above this
# share per other session in the target's passes. What the model leaves out costs
# speculation more as sessions share the passes: those that do not draft wait for the
# longer passes of those that do, a miss's draft call queues behind the others' draft work,
# and answers finish unevenly. Measured on separate cores (1 each), 8 clients (passes of
# ~4.7 sessions): rounds the model predicted ~17% faster at k = 1 gave 0.87x target-only's
# aggregate throughput; a margin of 25% there brought it to 0.96-1.05x.
LOAD_MARGIN = 0.06
# The target's passes hold other sessions (on average over recent calls) above this many
LOADED_BATCH = 1.5


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] at per-token acceptance a and block length k."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclasses.dataclass
class Costs:
    """What a round costs, in ms: a verify pass, a draft step, and each call's time beyond the
    services' compute (RPC, scheduling).

    A verify pass of a block of k shares the target's forward with the other sessions in its
    batch (``target_batch`` of them, each with about k + 1 tokens), so it costs the calibrated
    T(m) at m = target_batch * (k + 1) tokens (``target_ms[m - 1]``, extended past its end at
    the slope of its upper half), times ``target_scale`` (what the calls show against the calibration).
    Under load a longer block therefore costs more, and k shrinks, down to 0.
    """

    target_ms: list[float]
    draft_step_ms: float = 0.0
    target_scale: float = 1.0
    target_call_ms: float = 1.0
    draft_call_ms: float = 1.0
    target_batch: float = 1.0
    draft_forward: list[float] = dataclasses.field(default_factory=list)  # calibrated D(m)
    # Under load a verify also waits for the pass the target is running when it arrives
    # (other sessions'): that wait, as a share of a pass, grows with the passes' length.
    # Apart for verifies that follow a draft call: a session that drafts between its rounds
    # comes back after the others have started their pass together (the target regroups the
    # sessions it just answered), and waits for that whole pass; one whose block was ready
    # (a pipelined hit, a lookup) waits less, and a round of no block is costed with none:
    # when no session drafts, all of them are back in the next pass together (measured on
    # one core, 4 sessions, target-only: waits of 0.01 of a pass), however long the waits
    # are while others draft.
    target_wait: float = 0.0
    target_wait_drafted: float = 0.0

    @classmethod
    def calibrated(cls, target_ms: list[float], draft_ms: list[float]) -> "Costs":
        return cls(list(target_ms) or [1.0] * (ADAPTIVE_K_MAX + 1),
                   draft_ms[0] if draft_ms else 0.0, draft_forward=list(draft_ms))

    def forward_ms(self, tokens: float) -> float:
        """Calibrated T(m) of one target forward over ``tokens`` new tokens."""
        return _curve(self.target_ms, tokens)

    def branch_call_ms(self, k: int, width: int, depth: int) -> float:
        """A speculation-cache call (draft side): one pass over the block's k + 1 verdict rows,
        then ``depth`` passes over (k + 1) * width branches at once."""
        if not self.draft_forward:
            return (1 + depth) * self.draft_step_ms + self.draft_call_ms
        scale = self.draft_step_ms / self.draft_forward[0] if self.draft_forward[0] else 1.0
        return scale * (_curve(self.draft_forward, k + 1)
                        + depth * _curve(self.draft_forward, (k + 1) * width)) \
            + self.draft_call_ms

    def pass_ms(self, tokens: float) -> float:
        """One target forward pass over ``tokens`` new tokens (every session's)."""
        return self.forward_ms(tokens) * self.target_scale

    def verify_ms(self, k: int, drafted: bool = False) -> float:
        """A verify call for a block of k (``drafted``: sent after a draft call): its pass,
        the wait for the pass in progress when it arrives, and the call's own time."""
        if not k:  # a session that only verifies is back in the target's next pass at once
            wait = 0.0
        else:
            wait = self.target_wait_drafted if drafted else self.target_wait
        return self.pass_ms(self.target_batch * (k + 1)) * (1.0 + wait) + self.target_call_ms

    def draft_ms(self, k: int) -> float:
        """A draft call for k tokens (one step each)."""
        return k * self.draft_step_ms + self.draft_call_ms

    def probe_every(self) -> float:
        """Rounds between probes of a block that does not pay (the draft's, a lookup's):
        PROBE_EVERY alone, times the sessions in the target's passes under load, where a probe
        costs more than its own round (it lengthens, or leaves, the pass they share)."""
        return PROBE_EVERY * max(1.0, self.target_batch)


def _curve(t: list[float], tokens: float) -> float:
    """A calibrated forward-cost curve t[m - 1] = T(m), extended past its end at the slope of
    its upper half (a small pass is all overhead; the cost per token grows as the pass grows)."""
    n = len(t)
    if tokens <= n:
        return t[max(int(round(tokens)), 1) - 1]
    half = n // 2
    slope = (t[-1] - t[half]) / (n - 1 - half) if n - 1 > half else t[0]
    return t[-1] + slope * (tokens - n)


@dataclasses.dataclass
class LiveCosts(Costs):
    """Costs that follow the calls as they happen (decayed averages; one per orchestrator, so a
    new generation starts from what the last ones saw).

    While the target batches other sessions, its passes are costed by a line fitted to the
    verify calls' own passes (compute ms against the pass's tokens, every session's; decayed
    least squares) instead of the scaled start-up calibration, which times one session over
    m tokens: a pass over several sessions grows faster per token than that (measured here on
    one core: ~3.5 ms per token from 6 sessions x 1 token to 5 x 2-3, against ~1.2 ms along
    the calibration), so k stays 0 where speculation only lengthens the batch's passes.
    """

    decay: float = 0.9
    fit_decay: float = 0.97
    # decayed sums of the target's passes: weight, tokens, ms, tokens^2, tokens * ms
    passes: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 5)

    def pass_ms(self, tokens: float) -> float:
        # the line while passes hold more than one session on average; alone, the calibration
        line = self._pass_line() if self.target_batch > LOADED_BATCH else None
        if line is None:
            return super().pass_ms(tokens)
        # (never below a one-token pass: a line fitted to noisy passes can cross zero)
        intercept, slope = line
        return max(intercept + slope * tokens, super().pass_ms(1.0))

    def _pass_line(self) -> tuple[float, float] | None:
        """(ms, ms per token) of the fitted pass cost, or None while the passes seen are too
        few or too alike to tell a slope."""
        w, sx, sy, sxx, sxy = self.passes
        if w < 6.0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 0.5:
            return None
        slope = max((sxy / w - mx * my) / var, 0.0)
        return my - slope * mx, slope

    def observe(self, rec) -> None:
        """Fold in one call (an orchestrator.service_clients.CallRecord)."""
        if rec.outcome != "ok" or rec.re_prefilled or rec.sent_tokens > MAX_STEADY_TOKENS:
            return  # cancelled, or a prefill: not what a steady round costs
        beyond = max(0.0, (rec.end - rec.start) * 1000.0 - rec.compute_ms)
        d = self.decay
        if rec.service == "target":
            batch = max(rec.batch_size, 1)
            tokens = rec.pass_tokens or batch * (rec.sent_tokens + rec.tokens)
            self.target_scale = d * self.target_scale + (1 - d) * rec.compute_ms / max(
                self.forward_ms(tokens), 1e-6)
            self.target_batch = d * self.target_batch + (1 - d) * batch
            # The target reports how long the call waited before its first pass: that wait,
            # as a share of a pass, and the rest beyond compute, the call's own time (RPC,
            # bookkeeping). (Learnt from lone calls only, the call's time took in the waits of
            # calls that arrived during another session's pass: 20-30 ms for ~1.5 ms.)
            queued = min(rec.queued_ms, beyond)
            self.target_call_ms = d * self.target_call_ms + (1 - d) * (beyond - queued)
            wait = queued / max(rec.compute_ms, 1e-6)
            if rec.after_draft:
                self.target_wait_drafted = d * self.target_wait_drafted + (1 - d) * wait
            else:
                self.target_wait = d * self.target_wait + (1 - d) * wait
            g, x, y = self.fit_decay, float(tokens), rec.compute_ms
            self.passes = [g * a + b for a, b in zip(self.passes, (1.0, x, y, x * x, x * y))]
        elif rec.tokens > 0 and not rec.branches:  # (a branch call is costed apart)
            # A draft call runs one pass per token (the first also takes the committed tokens).
            self.draft_step_ms = d * self.draft_step_ms + (1 - d) * rec.compute_ms / rec.tokens
            self.draft_call_ms = d * self.draft_call_ms + (1 - d) * beyond


def raises_throughput(costs: Costs, k: int, tokens: float, miss: float) -> bool:
    """Under load, whether a session's block of k, yielding ``tokens`` per round, raises the
    target's aggregate throughput; ``miss``: the share of its rounds whose block is drafted
    between two verify calls (not ready when the verdict comes).

    With B sessions in its passes the target runs pass after pass, and its passes are what
    every session shares. A session whose block is ready at the verdict (a hit, a lookup)
    rides the next pass with k + 1 tokens; one that drafts between its calls (a miss) comes
    back after the others' next pass has started (past the scheduler's regroup wait), so that
    pass runs without it and it rides the one after. Per round of this session: a hit costs
    pass(B + k) for B - 1 + E tokens, a miss pass(B - 1) + pass(B + k) for 2 (B - 1) + E;
    target-only rounds give B tokens per pass(B). (Per session, in wall time, a drafted round
    can pay while the pass it leaves costs the others more: on separate cores, 2 clients,
    drafting in 14% of rounds gave 0.92x target-only's aggregate throughput.) Alone, the
    target waits for this session anyway: True."""
    b = costs.target_batch
    if not k or b <= LOADED_BATCH:
        return True
    total = (b - 1.0) * (1.0 + miss) + tokens
    ms = costs.pass_ms(b + k) + miss * costs.pass_ms(b - 1.0)
    return total / ms > b / costs.pass_ms(b)


MAX_STEADY_TOKENS = 16  # committed tokens a steady round's call sends at most (more: prefill)


# A generation that starts while others run starts from the acceptance of the orchestrator's
# recent generations once they drafted this many blocks' worth (else from PRIOR_A): each used
# to start at 0.5 and draft its first rounds at it, though the shipped draft's acceptance is
# 0.2-0.45 on most text. Under load those were nearly all its drafted rounds (measured on
# separate cores, 4 clients, 48 tokens a request: 6% of rounds drafted, each a draft call and
# a missed pass; target-only rounds for the rest). A generation alone keeps PRIOR_A: there an
# optimistic start costs a few drafted rounds that hide behind the verify pass, and a low
# prior near the break-even left rounds at k = 0 whose acceptance only probes could correct
# (measured on separate cores, 8 prompts one at a time: tokens/round 1.07-1.26 instead of
# 1.33-1.66 on four of them, ~5% fewer tok/s).
PRIOR_A = 0.5
PRIOR_WEIGHT = 4.0
POOL_MIN_WEIGHT = 8.0
POOL_DECAY = 0.995  # per drafted token: the last few hundred drafted tokens


class Acceptance:
    """The draft's per-token acceptance as decayed counts: accepted tokens against rejections
    (geometric model: a block of k yields one rejection unless all of it was kept)."""

    def __init__(self, a: float = PRIOR_A, weight: float = 0.0, decay: float = 0.95):
        """``a`` with ``weight``: the prior, as that many observed tokens' worth."""
        self.acc = a * weight
        self.rej = (1.0 - a) * weight
        self.decay = decay

    @property
    def weight(self) -> float:
        return self.acc + self.rej

    def rate(self) -> float:
        return self.acc / self.weight if self.weight > 1e-9 else PRIOR_A

    def observe(self, k: int, accepted: int) -> None:
        self.acc = self.acc * self.decay ** k + accepted
        self.rej = self.rej * self.decay ** k + (1.0 if accepted < k else 0.0)

    def prior(self) -> float:
        """This pool as a new generation's prior: its rate once it holds POOL_MIN_WEIGHT."""
        return self.rate() if self.weight >= POOL_MIN_WEIGHT else PRIOR_A


class KController:
    def __init__(self, target_ms: list[float], draft_ms: list[float], fixed_k: int | None = None,
                 pipelined: bool = False, prior_a: float = PRIOR_A,
                 prior_weight: float = PRIOR_WEIGHT, decay: float = 0.95,
                 k_max: int = ADAPTIVE_K_MAX, costs: Costs | None = None,
                 pool: Acceptance | None = None, running: Callable[[], int] | None = None):
        """``pool``: the acceptance of the orchestrator's recent generations, told what this
        one sees (``pool.prior()`` is what the orchestrator passes as ``prior_a`` while others
        run). ``running``: how many generations the orchestrator runs now, this one included
        (the target's batch as the calls show it lags a few rounds behind)."""
        self.fixed_k = fixed_k
        self.running = running
        self.pipelined = pipelined
        self.k_max = min(k_max, max(len(target_ms) - 1, 1)) if target_ms else k_max
        self.costs = costs or Costs.calibrated(target_ms, draft_ms)
        self.decay = decay
        self.pool = pool
        self.accepted = Acceptance(prior_a, prior_weight, decay)
        self.zero_rounds = 0
        self.backoff = 1  # the probes' spacing, in probe_every()s (PROBE_BACKOFF_MAX)
        self.probing = False  # a probe block is out: its verdict sets the backoff
        # The speculation cache (pipelined rounds with branches): the share of verdicts it had
        # a branch for, decayed, and its current width (candidates per acceptance length).
        self.branching = False
        self.cache_hit = 0.5
        self.width = 1
        # The draft's single guess behind a verify (plain pipelining, or ``drafts_guess``):
        # the verdicts it held against what the acceptance predicted for them (decayed sums;
        # their ratio corrects the prediction where acceptance is not geometric).
        self.guess_held = self.guess_predicted = 2.0

    @property
    def acceptance(self) -> float:
        return self.accepted.rate()

    def observe(self, k: int, accepted: int) -> None:
        """Record a round: k drafted, ``accepted`` of them kept (k = 0: a target-only step)."""
        if k == 0:
            self.zero_rounds += 1
            return
        self.zero_rounds = 0
        self.accepted.observe(k, accepted)
        if self.pool is not None:
            self.pool.observe(k, accepted)
        if self.probing:  # a probe that left speculation unpaid: the next one comes later
            self.probing = False
            self.backoff = 1 if self.best_k() else min(2 * self.backoff, PROBE_BACKOFF_MAX)
        elif self.backoff > 1 and self.best_k():
            self.backoff = 1

    def probe_late(self) -> None:
        """A probe's branch call was still running at its verdict and was dropped (under load,
        ``waits_for_draft``): nothing was learnt, so it counts as a probe that left speculation
        unpaid. Left due, every following round sent another branch call that came as late (a
        session that has not drafted for many rounds catches up on all of them first): measured
        on separate cores, 2 clients, 48-token answers, 13-14 dropped calls per generation."""
        if self.probing:
            self.probing = False
            self.zero_rounds = 0
            self.backoff = min(2 * self.backoff, PROBE_BACKOFF_MAX)

    def probe_due(self) -> float:
        """Rounds at k = 0 before the next probe: ``Costs.probe_every`` times the backoff."""
        return self.costs.probe_every() * self.backoff

    def observe_cache(self, hit: bool) -> None:
        """Record a pipelined round's verdict: did the speculation cache hold its branch?"""
        self.cache_hit = self.decay * self.cache_hit + (1.0 - self.decay) * float(hit)

    def observe_guess(self, k: int, held: bool) -> None:
        """Record a verdict of a block of k against the draft's single guess behind it: did
        it keep the whole block and was the guess the target's token? (Drafted, or, under
        the cache, its first branch for the whole block.)"""
        d = self.decay
        self.guess_held = d * self.guess_held + float(held)
        self.guess_predicted = d * self.guess_predicted + self.acceptance ** (k + 1)

    def guess_hit(self, k: int, a: float) -> float:
        """The share of verdicts of a block of k that the single guess holds: a^(k+1), times
        what the guesses held against that prediction."""
        return min(1.0, a ** (k + 1) * self.guess_held / max(self.guess_predicted, 1e-9))

    def waits_for_draft(self) -> bool:
        """Whether a round may wait for the draft (False: a pipelined round with the
        speculation cache while the target batches other sessions, adaptive k).

        Under load a round that waits for the draft (a miss that drafts its block after the
        verdict, a branch call still running at the verdict) comes back after the others'
        next pass has started, so that pass runs without it and it rides the one after:
        measured on separate cores, 2 clients, a probe's draft call of ~23 ms per generation
        and the first rounds' misses took 0.94x target-only's aggregate throughput with 7%
        of rounds drafted. So there every round goes to the target at once: with the block
        the cache holds for its verdict, or with none (a k = 0 round, which the draft still
        drafts the cache behind, on its own hardware).
        """
        loaded = self.costs.target_batch > LOADED_BATCH or \
            (self.running is not None and self.running() > 1)
        return not (self.pipelined and self.branching and self.fixed_k is None and loaded)

    def miss_rate(self, k: int, a: float, now: bool = False, guess: bool = False) -> float:
        """The share of rounds of k whose block is drafted after the last verdict (between
        two verify calls), not behind the verify pass: every sequential round; pipelined,
        the verdicts the speculation cache had no branch for, or without the cache (or
        ``guess``: drafting only the single guess behind this round, see ``drafts_guess``)
        those that did not keep the whole block and the draft's guess of the target's token.
        ``now``: this round's block is drafted after the verdict (a pipelined miss): 1.
        Where rounds do not wait for the draft (``waits_for_draft``) no block is: 0 (a
        miss is a round of no block instead, see ``rate``)."""
        if not self.waits_for_draft():
            return 0.0
        if now or not self.pipelined:
            return 1.0
        if self.branching and not guess:
            return 1.0 - self.cache_hit
        return 1.0 - self.guess_hit(k, a)

    def _behind_ms(self, k: int, guess: bool = False) -> float:
        """The draft's call behind a verify pass of k: branches, or the block past the guess."""
        if self.branching and not guess:
            return self.costs.branch_call_ms(k, self.width, k)
        return self.costs.draft_ms(k) + self.costs.draft_step_ms

    def round_ms(self, k: int, a: float, now: bool = False, guess: bool = False) -> float:
        verify = self.costs.verify_ms(k)
        if k == 0:
            return verify
        if not self.waits_for_draft():  # a hit's verify, else a round of no block
            return self.cache_hit * max(verify, self._behind_ms(k)) + \
                (1.0 - self.cache_hit) * self.costs.verify_ms(0)
        draft = self.costs.draft_ms(k)
        sequential = draft + self.costs.verify_ms(k, drafted=True)  # a miss: draft, then verify
        miss = self.miss_rate(k, a, now, guess)
        if miss >= 1.0:
            return sequential
        # a hit costs the longer of the verify and the draft behind it
        return (1.0 - miss) * max(verify, self._behind_ms(k, guess)) + miss * sequential

    def round_tokens(self, k: int, a: float) -> float:
        """Expected tokens of a round of k: E[k], or where rounds do not wait for the draft,
        E[k] on a hit and the target's one token on a miss."""
        if k and not self.waits_for_draft():
            return self.cache_hit * expected_tokens(a, k) + (1.0 - self.cache_hit)
        return expected_tokens(a, k)

    def raises_throughput(self, k: int, a: float, now: bool = False) -> bool:
        """Under load, whether a block of k raises the target's aggregate throughput (the
        module's ``raises_throughput``, at this controller's miss rate)."""
        return raises_throughput(self.costs, k, expected_tokens(a, k),
                                 self.miss_rate(k, a, now))

    def rate(self, k: int, a: float | None = None, now: bool = False) -> float:
        """Expected tokens per millisecond at block length k (``now``: of a round whose
        block is drafted after the verdict, as ``miss_rate``)."""
        a = self.acceptance if a is None else a
        ms = self.round_ms(k, a, now)
        if self._may_guess(k, now):  # the cheaper of the cache and the guess behind it
            ms = min(ms, self.round_ms(k, a, now, guess=True))
        return self.round_tokens(k, a) / ms

    def _may_guess(self, k: int, now: bool) -> bool:
        return bool(k) and self.pipelined and self.branching and not now and \
            self.waits_for_draft()

    def drafts_guess(self, k: int, a: float | None = None) -> bool:
        """Whether, behind a verify of k, the draft should draft only its guess of the
        target's token and the block past it (plain pipelining's one row), not the
        speculation cache's k + 1 verdict rows (times the width), though the cache is on.

        The cache holds more verdicts, but every drafted token costs a pass over all its
        rows: where the draft's pass grows with its rows (a draft whose linear layers are
        compute-bound, as the int8 copy of the target on a CPU: 12 ms over one row, 29 over
        five) and its acceptance is high, the single guess hits nearly as often (a^(k+1))
        for a call that still hides behind the verify pass. Chosen by the higher predicted
        rate, as k is; only where rounds wait for the draft (alone), since a missed guess
        drafts its block after the verdict."""
        a = self.acceptance if a is None else a
        # (the same tokens either way: the higher rate is the shorter round)
        return self._may_guess(k, False) and \
            self.round_ms(k, a, guess=True) < self.round_ms(k, a)

    def best_k(self, a: float | None = None, now: bool = False) -> int:
        """The block length of the highest rate. ``now``: for a round whose block is drafted
        after the verdict, a pipelined miss. Its draft steps are paid in full whatever the
        next rounds hit, so it is chosen as a sequential round's, often shorter (a target
        pass of 40 + 6m ms, a 4 ms draft step, acceptance 0.45: drafted now, a block of 2
        costs 70 ms for 1.65 tokens, one of 1 costs 60 for 1.45; at a 60% hit rate the 2
        is the faster). The draft still drafts the cache behind it. Where rounds do not wait
        for the draft, such a round has no block: 0."""
        a = self.acceptance if a is None else a
        if now and not self.waits_for_draft():
            return 0
        ks = [k for k in range(self.k_max + 1) if self.raises_throughput(k, a, now)]
        k = max(ks, key=lambda k: (self.rate(k, a, now), -k))
        margin = LOAD_MARGIN * max(self.costs.target_batch - 1.0, 0.0)
        if k and self.rate(k, a, now) < (1.0 + margin) * self.rate(0, a, now):
            return 0  # under load, a gain within what the model leaves out is no gain
        return k

    def next_k(self, after_full_accept: bool = False, now: bool = False) -> int:
        """k for the next block (``now``: one drafted after the verdict, see ``best_k``)."""
        if self.fixed_k is not None:
            return self.fixed_k
        k = self.best_k(now=now)
        if k or self.zero_rounds < self.probe_due():
            return k
        # Occasionally try a short block, or a draft that improved would never be noticed.
        # Under load a probe costs more than its own round (it leaves the target's regrouped
        # pass for a round, the draft catches up on the tokens since its last call): probe
        # less often as more sessions share the passes.
        if not self.waits_for_draft():
            # Drafted behind the verify pass and taken on a hit, without waiting: the draft
            # behind (``after_full_accept``) and the next round's use of its block both ask,
            # so it stays due until a probe block is verified (``observe``).
            if now:
                return 0
            self.probing = True
            return 2
        if after_full_accept:
            return k
        self.zero_rounds = 0
        self.probing = True
        return 2

# A generation's lookup blocks start from this mean accepted tokens, or, while others run,
# from what the orchestrator's recent lookups accepted (LookupPool): each generation used to
# start at 1.0 and try 2-3 blocks before its mean fell below the break-even, which under load
# lengthened the pass every session shares (measured on separate cores, 2 clients, chat
# prompts: 20 lookup rounds in 273, 122 tokens proposed for 3 accepted).
LOOKUP_PRIOR = 1.0


class LookupSizer:
    """All or nothing for prompt-lookup blocks: a block of ``size`` tokens when, at the mean
    number of tokens this generation's lookup blocks had accepted (a decayed average: their
    acceptance is bimodal, a copied span or a miss at once, so no per-token model), it beats
    the verify pass of a round without it; else none, but for a probe every PROBE_EVERY
    rounds (times the sessions in the target's passes, under load, and doubled after each
    probe that does not pay, up to PROBE_BACKOFF_MAX). A lookup costs no draft
    call: only the longer verify pass is weighed."""

    def __init__(self, costs: Costs, size: int, prior_accepted: float = LOOKUP_PRIOR,
                 decay: float = 0.8, pool: "LookupPool | None" = None):
        """``pool``: the lookups of the orchestrator's recent generations, told what this
        one's accept (``pool.prior()`` is what the orchestrator passes as ``prior_accepted``
        while others run)."""
        self.costs = costs
        self.max_size = size
        self.mean_accepted = prior_accepted
        self.decay = decay
        self.pool = pool
        self.skipped = 0
        self.backoff = 1  # as KController's: each probe that does not pay doubles the wait
        self.probing = False

    def rate(self) -> float:
        """Expected tokens per millisecond of a round with a lookup block of ``size``."""
        return (1.0 + self.mean_accepted) / self.costs.verify_ms(self.max_size)

    def worth_it(self) -> bool:
        # (Under load verify_ms costs every session's block at this size: stricter than
        # raises_throughput for a block that is ready at the verdict, as a lookup is.)
        return self.rate() > 1.0 / self.costs.verify_ms(0)

    def size(self) -> int:
        if self.worth_it():
            return self.max_size
        self.skipped += 1
        if self.skipped >= self.costs.probe_every() * self.backoff:
            self.skipped = 0
            self.probing = True
            return self.max_size
        return 0

    def observe(self, accepted: int) -> None:
        self.mean_accepted = self.decay * self.mean_accepted + (1 - self.decay) * accepted
        if self.pool is not None:
            self.pool.observe(accepted)
        if self.probing:
            self.probing = False
            self.backoff = 1 if self.worth_it() else min(2 * self.backoff, PROBE_BACKOFF_MAX)


class LookupPool:
    """Mean tokens accepted per lookup block over an orchestrator's recent generations (a
    decayed mean, with the weight of what it has seen)."""

    def __init__(self, decay: float = 0.95):
        self.sum = 0.0
        self.weight = 0.0
        self.decay = decay

    def observe(self, accepted: int) -> None:
        self.sum = self.sum * self.decay + accepted
        self.weight = self.weight * self.decay + 1.0

    def prior(self) -> float:
        """The pooled mean once it holds POOL_MIN_WEIGHT blocks' worth, else LOOKUP_PRIOR."""
        return self.sum / self.weight if self.weight >= POOL_MIN_WEIGHT else LOOKUP_PRIOR


# Candidates per acceptance length the speculation cache drafts at most (BranchWidth picks the
# widest whose call hides behind the verify pass, up to this). On separate cores (one each,
# 6 + 6 shipped prompts, 96 tokens, twice, interleaved) a cap of 4 / 8 / 16 gave cache hit
# rates 0.48 / 0.55 / 0.62 and 24.6 / 25.1 / 24.9 tok/s: the draft's pass over 16 rows costs
# 1.6x its pass over one (4.1 -> 6.7 ms), so wide branch calls still hide.
MAX_WIDTH = 16
# Where a round does not wait for the draft (KController.waits_for_draft) a branch call that
# is late for its verdict is dropped: the cache is sized for this share of the verify pass,
# so the calls' spread still lands in time (measured on separate cores, 2 clients, a cache
# sized for the whole pass: branch calls of 24-28 ms at the median, 42-44 at the 90th
# percentile, against 44-45 ms verifies; 8-23 late calls of ~115 per run).
LATE_SHARE = 0.6


class BranchWidth:
    """The speculation cache's width: the most candidates per acceptance length whose draft
    call still hides behind the verify pass. First from the costs (calibrated, then live), then
    corrected by what branch calls measure against that prediction (decayed), so a draft that
    is slower than calibrated, shares its cores or batches other sessions narrows the cache."""

    def __init__(self, costs: Costs, max_width: int = MAX_WIDTH, decay: float = 0.8):
        self.costs = costs
        self.max_width = max_width
        self.decay = decay
        self.scale = 1.0  # measured / predicted branch-call time

    def choose(self, k: int, depth: int, share: float = 1.0) -> int:
        """The width for a branch call behind a verify of k: the widest predicted to take at
        most ``share`` of the verify (less than all of it where a late call is dropped)."""
        verify = self.costs.verify_ms(k) * share
        width = 1
        for w in range(2, min(self.max_width, MAX_BRANCHES // (k + 1)) + 1):
            if self.costs.branch_call_ms(k, w, depth) * self.scale <= verify:
                width = w
        return width

    def observe(self, k: int, width: int, depth: int, measured_ms: float) -> None:
        predicted = self.costs.branch_call_ms(k, width, depth)
        if predicted > 0:
            self.scale = self.decay * self.scale + (1 - self.decay) * measured_ms / predicted
