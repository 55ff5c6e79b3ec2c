"""Adaptive draft length: pick k each round to maximise expected tokens per millisecond.

With per-token acceptance a, a block of k yields E[k] = (1 - a^(k+1)) / (1 - a) tokens per
round. A round costs k draft steps plus one verify pass over k + 1 tokens (sequential), or,
pipelined, only the verify pass when the next block was drafted behind it (which needs the
whole block accepted and the draft's guess of the target's token right, about a^(k+1)). k = 0
is plain target decoding, chosen whenever speculation does not pay, so specdec is never much
slower than the target alone.

A choice is rated by orchestrator.rating, a pure function of a snapshot of acceptance, costs
and load; ``KController`` takes the snapshot and picks the best-rated choice. What a round
costs is orchestrator.costs (calibrated, or live for greedy requests: greedy
text does not depend on k; sampled requests keep the calibrated costs, so a seeded request
gives the same text every time). Every running figure is a ``Decayed``; every block that does
not pay is retried by one ``Probes``. The measurements behind each tunable are in
docs/design.md, under its name.
"""

from __future__ import annotations

from typing import Callable

from orchestrator import costs as cost_model
from orchestrator import rating
from orchestrator.costs import ADAPTIVE_K_MAX, Costs, Decayed, LiveCosts, raises_throughput
from orchestrator.rating import Snapshot, expected_tokens
from specdec.serving.branching import MAX_BRANCHES

# What orchestrator.loop and the tests import from here, the cost model's included.
__all__ = ["ADAPTIVE_K_MAX", "Acceptance", "BranchWidth", "Costs", "KController", "LATE_SHARE",
           "LiveCosts", "LOOKUP_PRIOR", "LookupPool", "LookupSizer", "POOL_DECAY", "PRIOR_A",
           "expected_tokens", "raises_throughput"]

# --- Tunables, each with its reason (measurements: docs/design.md, "Adaptive k's tunables").
PROBE_K = 2  # a probe's block: the shortest that shows acceptance past its first token
PROBE_EVERY = 16  # rounds at k = 0 between probes, or a draft that improved goes unnoticed
PROBE_BACKOFF_MAX = 8  # each unpaid probe doubles the wait up to this factor: probes cost
LOAD_MARGIN = 0.06  # under load, per other session: a gain the model cannot see is no gain
PRIOR_A = 0.5  # a generation's first acceptance: alone, an optimistic start pays
PRIOR_WEIGHT = 4.0  # the prior, in observed tokens: a few rounds outweigh it
POOL_MIN_WEIGHT = 8.0  # blocks' worth a pool holds before it is a new generation's prior
LOOKUP_PRIOR = 1.0  # a lookup block's accepted tokens before any is seen
MAX_WIDTH = 16  # candidates per acceptance length the speculation cache drafts at most
LATE_SHARE = 0.6  # of the verify pass, what a cache whose late calls are dropped is sized for
CACHE_HIT_PRIOR = 0.5  # the cache's hit rate before any verdict
GUESS_PRIOR = 2.0  # the single guess's held / predicted sums before any verdict: ratio 1
# Decay rates (the weight an old figure keeps per new observation): how fast each follows.
ACCEPTANCE_DECAY = 0.95  # a generation's acceptance (per drafted token), hits and guesses
POOL_DECAY = 0.995  # per drafted token: the last few hundred of recent generations
LOOKUP_DECAY = 0.8  # a generation's lookup blocks: bimodal, a copied span or a miss at once
LOOKUP_POOL_DECAY = 0.95  # per lookup block, over recent generations
WIDTH_DECAY = 0.8  # branch calls' time against their prediction


class Acceptance:
    """A decayed mean with the weight of what it has seen: the draft's per-token acceptance
    (``observe``: accepted tokens against rejections, a block of k yielding one rejection
    unless all of it was kept) or, for lookups, tokens accepted per block (``observe_block``).
    Pooled over an orchestrator's recent generations, ``prior()`` starts a new one."""

    def __init__(self, a: float = PRIOR_A, weight: float = 0.0, decay: float = ACCEPTANCE_DECAY,
                 default: float = PRIOR_A):
        """``a`` with ``weight``: the prior, as that many observations' worth; ``default``:
        the rate while nothing is seen."""
        self.total = Decayed(a * weight, decay)
        self.seen = Decayed(weight, decay)
        self.default = default

    @property
    def weight(self) -> float:
        return self.seen.value

    def rate(self) -> float:
        return self.total.value / self.seen.value if self.seen.value > 1e-9 else self.default

    def observe(self, k: int, accepted: int) -> None:
        self.total.add(accepted, k)
        self.seen.add(accepted + (1.0 if accepted < k else 0.0), k)

    def observe_block(self, accepted: int) -> None:
        self.total.add(accepted)
        self.seen.add(1.0)

    def prior(self) -> float:
        """This pool as a new generation's prior: its rate once it holds POOL_MIN_WEIGHT."""
        return self.rate() if self.weight >= POOL_MIN_WEIGHT else self.default


class LookupPool(Acceptance):
    """Tokens accepted per lookup block over an orchestrator's recent generations."""

    def __init__(self, decay: float = LOOKUP_POOL_DECAY):
        super().__init__(LOOKUP_PRIOR, 0.0, decay, default=LOOKUP_PRIOR)

    def observe(self, accepted: int) -> None:  # (a lookup's acceptance is per block)
        self.observe_block(accepted)


class Probes:
    """When to try a block that does not pay (the draft's, a lookup's): after ``idle`` rounds
    without one reach ``every()`` times ``backoff``. Each probe that leaves
    speculation unpaid doubles the backoff, up to PROBE_BACKOFF_MAX; one that pays resets it."""

    def __init__(self, costs: Costs):
        self.costs = costs
        self.idle = 0  # rounds without a block since the last one (or probe)
        self.backoff = 1
        self.probing = False  # a probe block is out: its verdict sets the backoff

    def every(self) -> float:
        """Rounds between probes before any backoff: PROBE_EVERY, times the sessions in the
        target's passes (there a probe also lengthens theirs)."""
        return PROBE_EVERY * max(1.0, self.costs.target_batch)

    def wait(self) -> float:
        """Rounds without a block before the next probe."""
        return self.every() * self.backoff

    def due(self) -> bool:
        return self.idle >= self.wait()

    def start(self) -> None:
        self.idle = 0
        self.probing = True

    def settle(self, paid: bool) -> None:
        """A verdict: a paid block resets the backoff; an unpaid probe doubles it."""
        if paid:
            self.backoff = 1
        elif self.probing:
            self.backoff = min(2 * self.backoff, PROBE_BACKOFF_MAX)
        self.probing = False

    def late(self) -> None:
        """A probe's call came too late for its verdict: nothing learnt, an unpaid probe."""
        if self.probing:
            self.idle = 0
            self.settle(False)


class KController:
    """Adaptive k for one generation, the policy: the block length of the best rating
    (orchestrator.rating, at this controller's ``snapshot``), with probes while k stays 0."""

    def __init__(self, target_ms: list[float], draft_ms: list[float], fixed_k: int | None = None,
                 pipelined: bool = False, prior_a: float = PRIOR_A,
                 prior_weight: float = PRIOR_WEIGHT, decay: float = ACCEPTANCE_DECAY,
                 k_max: int = ADAPTIVE_K_MAX, costs: Costs | None = None,
                 pool: Acceptance | None = None, running: Callable[[], int] | None = None,
                 branching: bool = False, drafter_invariant: bool = False,
                 decode_on: int = 0, shared_cores: bool = False):
        """``pool``: the acceptance of the orchestrator's recent generations, told what this
        one sees (``pool.prior()`` is what the orchestrator passes as ``prior_a`` while others
        run). ``running``: how many generations the orchestrator runs now, this one included
        (the target's batch as the calls show it lags a few rounds behind). ``branching``:
        pipelined rounds draft the speculation cache behind each verify (k is costed with its
        hit rate). ``drafter_invariant``: k cannot change the text (SamplingParams), so load
        may change k. ``decode_on``: the plain steps the target takes on by itself in a round
        of no block (its call's own time is then shared by 1 + decode_on tokens).
        ``shared_cores``: the draft shares the target's cores (``crowd``)."""
        self.fixed_k = fixed_k
        self.drafter_invariant = drafter_invariant
        self.decode_on = decode_on
        self.running = running
        self.shared_cores = shared_cores
        self.pipelined = pipelined
        self.k_max = min(k_max, max(len(target_ms) - 1, 1)) if target_ms else k_max
        self.costs = costs or Costs.calibrated(target_ms, draft_ms)
        self.pool = pool
        self.accepted = Acceptance(prior_a, prior_weight, decay)
        self.probes = Probes(self.costs)
        # The speculation cache (pipelined rounds with branches): the share of verdicts it had
        # a branch for, and its current width (candidates per acceptance length).
        self.branching = branching
        self.hits = Decayed(CACHE_HIT_PRIOR, decay)
        self.width = 1
        # The draft's single guess behind a verify (plain pipelining, or ``drafts_guess``):
        # the verdicts it held against what the acceptance predicted for them (decayed sums;
        # their ratio corrects the prediction where acceptance is not geometric).
        self.guess_held = Decayed(GUESS_PRIOR, decay)
        self.guess_predicted = Decayed(GUESS_PRIOR, decay)

    @property
    def acceptance(self) -> float:
        return self.accepted.rate()

    @property
    def cache_hit(self) -> float:
        return self.hits.value

    @cache_hit.setter
    def cache_hit(self, value: float) -> None:
        self.hits.value = value

    @property
    def backoff(self) -> int:
        return self.probes.backoff

    def crowd(self) -> float:
        """The crowding term's load: the generations running now (this one included) where
        the draft shares the target's cores, else 0. There concurrent generations keep both
        services busy at once: the draft's passes take the cores the target's batched verify
        needs, so a drafted token costs verify throughput instead of hiding behind it
        (measured on 2 cores, every core per service, 48 tokens per request: sequential rounds
        0.64x and pipelined 0.29x target-only's aggregate tok/s at N = 8); ``raises_throughput``
        charges it. Only adaptive k on requests whose text k cannot change."""
        if not (self.shared_cores and self.drafter_invariant and self.fixed_k is None) or \
                self.running is None:
            return 0.0
        return float(self.running())

    def crowded(self) -> bool:
        """Whether the crowding term weighs in: other generations run on the shared cores."""
        return self.crowd() > cost_model.LOADED_BATCH

    def observe(self, k: int, accepted: int) -> None:
        """Record a round: k drafted, ``accepted`` of them kept (k = 0: a target-only step)."""
        if k == 0:
            self.probes.idle += 1
            return
        self.probes.idle = 0
        self.accepted.observe(k, accepted)
        if self.pool is not None:
            self.pool.observe(k, accepted)
        if self.probes.probing or self.probes.backoff > 1:
            self.probes.settle(bool(self.best_k()))

    def probe_late(self) -> None:
        """A probe's branch call was still running at its verdict and was dropped (under
        load, ``waits_for_draft``): left due, every following round would send another."""
        self.probes.late()

    def probe_due(self) -> float:
        """Rounds at k = 0 before the next probe."""
        return self.probes.wait()

    def use_width(self, width: int) -> None:
        """The speculation cache's width behind the verify in flight (BranchWidth.choose)."""
        self.width = width

    def observe_cache(self, hit: bool) -> None:
        """Record a pipelined round's verdict: did the speculation cache hold its branch?"""
        self.hits.average(float(hit))

    def observe_guess(self, k: int, held: bool) -> None:
        """Record a verdict of a block of k against the draft's single guess behind it: did
        it keep the whole block and was the guess the target's token? (Drafted, or, under
        the cache, its first branch for the whole block.)"""
        self.guess_held.add(float(held))
        self.guess_predicted.add(self.acceptance ** (k + 1))

    def waits_for_draft(self) -> bool:
        """Whether a round may wait for the draft (False: a pipelined round with the
        speculation cache while the target batches other sessions, adaptive k). Under load a
        round that waits for the draft misses the others' next pass, so there every round
        goes to the target at once, with the block the cache holds for its verdict or none."""
        loaded = self.costs.target_batch > cost_model.LOADED_BATCH or \
            (self.running is not None and self.running() > 1)
        return not (self.pipelined and self.branching and self.fixed_k is None and loaded)

    def snapshot(self, a: float | None = None) -> Snapshot:
        """What a rating depends on now (``a``: this acceptance instead of the learnt one)."""
        return Snapshot(self.costs, self.acceptance if a is None else a, self.pipelined,
                        self.branching, self.cache_hit, self.guess_held.value,
                        self.guess_predicted.value, self.width, self.waits_for_draft(),
                        self.decode_on, self.crowd())

    # The rating at this controller's snapshot (orchestrator.rating says what each is).
    def rate(self, k: int, a: float | None = None, now: bool = False) -> float:
        return rating.rate(self.snapshot(a), k, now)

    def drafts_guess(self, k: int, a: float | None = None) -> bool:
        return rating.drafts_guess(self.snapshot(a), k)

    def best_k(self, a: float | None = None, now: bool = False) -> int:
        """The block length of the best rating. ``now``: for a round whose block is drafted
        after the verdict, a pipelined miss: its draft steps are paid in full whatever the
        next rounds hit, so it is chosen as a sequential round's, often shorter. Where rounds
        do not wait for the draft, such a round has no block: 0."""
        snap = self.snapshot(a)
        if now and not snap.waits:
            return 0
        ks = [k for k in range(self.k_max + 1) if rating.raises(snap, k, now)]
        k = max(ks, key=lambda k: (rating.rate(snap, k, now), -k))
        margin = LOAD_MARGIN * max(self.costs.target_batch - 1.0, 0.0)
        if k and rating.rate(snap, k, now) < (1.0 + margin) * rating.rate(snap, 0, now):
            return 0  # under load, a gain within what the model leaves out is no gain
        return k

    def next_k(self, after_full_accept: bool = False, now: bool = False) -> int:
        """k for the next block (``now``: one drafted after the verdict, see ``best_k``)."""
        if self.fixed_k is not None:
            return self.fixed_k
        k = self.best_k(now=now)
        if k or not self.probes.due() or not self.best_k(1.0, now):
            return k  # (no probe where no acceptance would make a block pay at this load)
        # A probe, or a draft that improved would never be noticed.
        if not self.waits_for_draft():
            # Drafted behind the verify pass and taken on a hit, without waiting: the draft
            # behind (``after_full_accept``) and the next round's use of its block both ask,
            # so it stays due until a probe block is verified (``observe``).
            if now:
                return 0
            self.probes.probing = True
            return PROBE_K
        if after_full_accept:
            return k
        self.probes.start()
        return PROBE_K


class LookupSizer:
    """All or nothing for prompt-lookup blocks: a block of ``size`` tokens when, at the mean
    number of tokens this generation's lookup blocks had accepted (a decayed mean: their
    acceptance is bimodal, a copied span or a miss at once, so no per-token model), it beats
    the verify pass of a round without it; else none but the probes (``Probes``). A lookup
    costs no draft call: only the longer verify pass is weighed."""

    def __init__(self, costs: Costs, size: int, prior_accepted: float = LOOKUP_PRIOR,
                 decay: float = LOOKUP_DECAY, pool: LookupPool | None = None):
        """``pool``: the lookups of the orchestrator's recent generations, told what this
        one's accept (``pool.prior()`` is what the orchestrator passes as ``prior_accepted``
        while others run)."""
        self.costs = costs
        self.max_size = size
        self.accepted = Decayed(prior_accepted, decay)
        self.pool = pool
        self.probes = Probes(costs)

    @property
    def mean_accepted(self) -> float:
        return self.accepted.value

    @property
    def backoff(self) -> int:
        return self.probes.backoff

    def rate(self) -> float:
        """Expected tokens per millisecond of a round with a lookup block of ``size``."""
        return rating.lookup_rate(self.costs, self.max_size, self.mean_accepted)

    def worth_it(self) -> bool:
        # (Under load verify_ms costs every session's block at this size: stricter than
        # raises_throughput for a block that is ready at the verdict, as a lookup is.)
        return self.rate() > 1.0 / self.costs.verify_ms(0)

    def size(self) -> int:
        if self.worth_it():
            return self.max_size
        self.probes.idle += 1
        if self.probes.due():
            self.probes.start()
            return self.max_size
        return 0

    def observe(self, accepted: int) -> None:
        self.accepted.average(accepted)
        if self.pool is not None:
            self.pool.observe(accepted)
        if self.probes.probing:
            self.probes.settle(self.worth_it())


class BranchWidth:
    """The speculation cache's width: the most candidates per acceptance length whose draft
    call still hides behind the verify pass. First from the costs (calibrated, then live), then
    corrected by what branch calls measure against that prediction (decayed), so a draft that
    is slower than calibrated, shares its cores or batches other sessions narrows the cache."""

    def __init__(self, costs: Costs, max_width: int = MAX_WIDTH, decay: float = WIDTH_DECAY):
        self.costs = costs
        self.max_width = max_width
        self.scale = Decayed(1.0, decay)  # measured / predicted branch-call time

    def choose(self, k: int, depth: int, share: float = 1.0) -> int:
        """The width for a branch call behind a verify of k: the widest predicted to take at
        most ``share`` of the verify (less than all of it where a late call is dropped)."""
        verify = self.costs.verify_ms(k) * share
        width = 1
        for w in range(2, min(self.max_width, MAX_BRANCHES // (k + 1)) + 1):
            if self.costs.branch_call_ms(k, w, depth) * self.scale.value <= verify:
                width = w
        return width

    def observe(self, k: int, width: int, depth: int, measured_ms: float) -> None:
        predicted = self.costs.branch_call_ms(k, width, depth)
        if predicted > 0:
            self.scale.average(measured_ms / predicted)
