"""Adaptive k across generations and sources: priors from recent generations (alone, under
load, on shared cores), prompt lookup's sizing, the pipelined guess and crowding."""

import random

import pytest
from conftest import CPU_LINE, CURVE, call_record, live_costs

from orchestrator import adaptive
from orchestrator import costs as cost_model
from orchestrator import rating
from orchestrator.adaptive import Costs, KController, LookupSizer


class ServiceClient:
    """A service client as the orchestrator reads it here: what GetInfo said (vocabulary size
    0: unknown, as from a service that does not say; the tokenizer's then)."""

    def __init__(self):
        from specdec.wire import specdec_pb2 as pb

        self.info = pb.ModelInfo(forward_ms=CURVE, vocab_size=0, drafter="model")

def test_rejection_sampled_requests_keep_the_calibrated_costs():
    """Under the rejection rule k changes a seeded request's text, so k must not follow
    timings; greedy and coupled-sampled requests (k cannot change their text) use live costs."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.loop import Orchestrator
    from specdec.config import SamplingParams

    Client = ServiceClient

    orch = Orchestrator(Client(), Client(), tokenizer=None, eos_ids=[], max_context=512)
    for _ in range(50):
        orch.live_costs.observe(call_record("target", 300.0, 4))
    greedy = orch._controller(GenerationRequest([1], 8))
    coupled = orch._controller(GenerationRequest([1], 8, SamplingParams(temperature=0.8)))
    rejection = orch._controller(GenerationRequest([1], 8, SamplingParams(
        temperature=0.8, rule="rejection")))
    assert greedy.costs is orch.live_costs and greedy.costs.target_scale > 5
    assert coupled.costs is orch.live_costs
    assert rejection.costs.target_scale == 1.0 and rejection.costs.target_ms == CURVE


def test_prompt_lookup_stops_when_its_blocks_are_rejected_and_probes_now_and_then():
    """Lookup blocks cost no draft call, only a longer verify pass: they are proposed while
    the tokens they get accepted pay for it, else only as a probe every PROBE_EVERY rounds."""
    sizer = LookupSizer(live_costs(), 8)
    assert sizer.size() == 8  # the prior: worth a try
    sizes = []
    for _ in range(48):
        size = sizer.size()
        sizes.append(size)
        if size:
            sizer.observe(0)
    assert sizes[-32:].count(8) == 1 and sizes[-32:].count(0) == 31  # probes only
    assert sizer.backoff == 2  # (the probe after 16 rounds did not pay: the next after 32)
    for _ in range(10):  # the probes start hitting: a copied span, accepted whole
        sizer.observe(8)
    assert sizer.size() == 8
    # a block that buys one token in six rounds does not pay for 8 more verified tokens
    costs = live_costs()
    rare = LookupSizer(costs, 8, prior_accepted=1 / 6)
    assert (1 + 1 / 6) / costs.verify_ms(8) < 1 / costs.verify_ms(0) and not rare.worth_it()


def test_prompt_lookup_probes_grow_rarer_under_load():
    """A probe's 8 tokens lengthen the pass every session shares: while the target's passes
    hold B sessions, a lookup that does not pay is probed every PROBE_EVERY * B rounds."""
    def probes(batch: float) -> list[int]:
        costs = live_costs()
        costs.target_batch = batch
        sizer = LookupSizer(costs, 8, prior_accepted=0.0)
        out = []
        for i in range(4000):
            if sizer.size():
                out.append(i)
                sizer.observe(0)
        return out

    every, top = adaptive.PROBE_EVERY, adaptive.PROBE_EVERY * adaptive.PROBE_BACKOFF_MAX
    alone, loaded = probes(1.0), probes(8.0)
    assert alone[:4] == [every - 1, 3 * every - 1, 7 * every - 1, 15 * every - 1]
    assert [b - a for a, b in zip(alone, alone[1:])][-3:] == [top] * 3
    assert loaded[:2] == [8 * every - 1, 24 * every - 1]


def test_a_new_generation_can_start_from_the_acceptance_its_predecessors_saw(monkeypatch):
    """The orchestrator's pool of its generations' acceptance is a new generation's prior
    once it holds enough (the orchestrator passes it while others run): a draft the last
    generations rejected is not drafted again for the first rounds of the next one. (The
    throughput condition aside: the prior alone.)"""
    monkeypatch.setattr(cost_model, "LOADED_BATCH", float("inf"))
    costs = live_costs()
    costs.target_batch = 4.0
    pool = adaptive.Acceptance(decay=adaptive.POOL_DECAY)
    assert pool.prior() == adaptive.PRIOR_A  # nothing pooled yet
    fresh = KController(CURVE, [3.0], costs=costs, prior_a=pool.prior(), pool=pool)
    assert fresh.next_k() > 0
    rng = random.Random(0)

    def kept(k):  # of a block of k, by a draft whose every token is kept with p = 0.1
        n = 0
        while n < k and rng.random() < 0.1:
            n += 1
        return n

    while pool.weight < adaptive.POOL_MIN_WEIGHT:  # the controller tells the pool
        k = fresh.next_k() or 2
        fresh.observe(k, kept(k))
    assert pool.prior() == pool.rate() < 0.25
    after = KController(CURVE, [3.0], costs=costs, prior_a=pool.prior(), pool=pool)
    assert after.next_k() == 0
    # a pool that saw a good draft: the next generation speculates at once, with a long block
    good = adaptive.Acceptance(decay=adaptive.POOL_DECAY)
    for _ in range(20):
        good.observe(4, 4)
    assert KController(CURVE, [3.0], costs=costs, prior_a=good.prior()).next_k() > \
        fresh.next_k()


def test_a_generation_starting_under_load_starts_its_lookups_from_what_recent_ones_accepted():
    """Each generation's lookup blocks start at LOOKUP_PRIOR accepted tokens alone; while
    others run, from the orchestrator's pool of recent lookups once it holds enough, so a
    prompt set whose lookups miss stops proposing them at once. Only where lookups cannot
    change the text (else a seeded request's text would depend on what ran before it)."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.loop import Orchestrator
    from specdec.config import SamplingParams

    Client = ServiceClient

    orch = Orchestrator(Client(), Client(), tokenizer=None, eos_ids=[], max_context=512)
    greedy = GenerationRequest([1], 8)
    first = orch._lookup_sizer(greedy)
    assert first.mean_accepted == adaptive.LOOKUP_PRIOR and first.pool is orch.lookups
    orch.active = 1
    first.observe(1)
    while orch.lookups.weight < adaptive.POOL_MIN_WEIGHT:
        assert orch._lookup_sizer(greedy).mean_accepted == adaptive.LOOKUP_PRIOR  # too few yet
        first.observe(0)  # blocks that missed, told to the pool
    pooled = orch.lookups.prior()
    assert 0.0 < pooled < 0.2
    loaded = orch._lookup_sizer(greedy)
    assert loaded.mean_accepted == pooled and not loaded.worth_it()
    orch.active = 0  # alone: the prior again
    assert orch._lookup_sizer(greedy).mean_accepted == adaptive.LOOKUP_PRIOR
    orch.active = 1
    rejection = orch._lookup_sizer(GenerationRequest([1], 8, SamplingParams(
        temperature=0.8, rule="rejection")))
    assert rejection.pool is None and rejection.mean_accepted == adaptive.LOOKUP_PRIOR


def test_a_pipelined_miss_drafts_its_block_as_a_sequential_round_would():
    """A pipelined round that the cache missed drafts its block after the verdict: its draft
    steps are paid in full whatever later rounds hit, so its k is the sequential round's,
    shorter than a round costed at the cache's hit rate. One core each (T(m) = 40 + 6m ms,
    a 4 ms draft step and a 3 ms call), acceptance 0.45, the cache holding 60% of the
    verdicts: a block of 2 makes 1.65 tokens, one of 1 makes 1.45; drafted now they cost 70
    ms (11 of drafting, then a 59 ms verify) against 60 (7 + 53): 23.6 against 24.2 tokens
    a second, where costed at the hit rate (a hit costs only the verify or the branch call
    behind it) the block of 2 is the faster."""
    costs = Costs.calibrated(CPU_LINE, [4.0])
    costs.draft_call_ms = 3.0
    ctl = KController(CPU_LINE, [4.0], pipelined=True, costs=costs)
    ctl.branching, ctl.cache_hit = True, 0.6
    assert ctl.best_k(0.45) == 2
    assert ctl.best_k(0.45, now=True) == 1
    snap = ctl.snapshot(0.45)
    assert rating.round_ms(snap, 2) < 65.0 < rating.round_ms(snap, 2, now=True)
    assert rating.round_ms(snap, 2, now=True) == costs.draft_ms(2) + \
        costs.verify_ms(2, drafted=True) == 70.0
    sequential = KController(CPU_LINE, [4.0], costs=costs)  # every round is drafted now
    assert sequential.best_k(0.45) == sequential.best_k(0.45, now=True) == 1


# D(m) of the target's int8 copy on one core: its pass grows with its rows (compute-bound)
INT8_DRAFT = [12.0, 16.3, 18.2, 23.0, 28.7, 33.0, 37.0, 41.2]


def _int8_pipelined(**kw) -> KController:
    """A pipelined controller over the int8 copy's costs (a 2 ms draft call), the cache on and
    holding 93% of the verdicts."""
    costs = Costs.calibrated(CPU_LINE, INT8_DRAFT)
    costs.draft_call_ms = 2.0
    ctl = KController(CPU_LINE, [12.0], pipelined=True, costs=costs, **kw)
    ctl.branching, ctl.cache_hit = True, 0.93
    return ctl


def test_behind_a_verify_a_costly_row_draft_of_high_acceptance_drafts_its_single_guess():
    """The speculation cache drafts over k + 1 verdict rows at every step. Where the draft's
    pass grows with its rows (compute-bound, as the int8 copy of the target on one core: 12 ms
    over one row, 23 over four) and its acceptance is high, the single guess (a^(k+1) of the
    verdicts) in a call that hides behind the verify pays more: at k = 3 the cache's call
    takes 94 ms behind a 65 ms verify, the guess 50. A draft of cheap rows and low acceptance
    keeps the cache (its guess holds 4% of the verdicts, the cache 60%)."""
    ctl = _int8_pipelined()
    snap = ctl.snapshot()
    assert rating.behind_ms(snap, 3) == 94.0 and rating.behind_ms(snap, 3, guess=True) == 50.0
    assert ctl.drafts_guess(3, 0.94)
    k = ctl.best_k(0.94)
    assert k >= 2 and ctl.drafts_guess(k, 0.94)
    snap = ctl.snapshot(0.94)
    guess_rate = adaptive.expected_tokens(0.94, k) / rating.round_ms(snap, k, guess=True)
    assert ctl.rate(k, 0.94) == guess_rate > adaptive.expected_tokens(0.94, k) / rating.round_ms(
        snap, k)
    # a draft miss (drafted now) and rounds under load (no waiting for the draft): no guess
    assert not ctl.drafts_guess(0, 0.94)
    ctl.costs.target_batch = 4.0
    assert not ctl.waits_for_draft() and not ctl.drafts_guess(3, 0.94)

    shipped = Costs.calibrated(CPU_LINE, [4.0 + 0.17 * m for m in range(16)])
    shipped.draft_call_ms = 2.0
    ctl = KController(CPU_LINE, [4.0], pipelined=True, costs=shipped)
    ctl.branching, ctl.cache_hit = True, 0.6
    k = ctl.best_k(0.35)
    assert k >= 1 and not ctl.drafts_guess(k, 0.35)


def test_the_guess_is_costed_at_the_verdicts_it_held_not_only_at_a_geometric_guess():
    """Acceptance is not geometric everywhere (a draft that errs at fixed positions keeps
    two of three tokens, never the whole block): where guesses stop holding the verdicts
    that a^(k+1) promised, the prediction follows what they held, and the cache comes back;
    guesses that hold bring the guess back."""
    ctl = _int8_pipelined(prior_a=0.94, prior_weight=1000.0)
    assert rating.guess_hit(ctl.snapshot(0.94), 3) == pytest.approx(0.94 ** 4) and \
        ctl.drafts_guess(3)
    for _ in range(40):
        ctl.observe_guess(3, False)
    assert rating.guess_hit(ctl.snapshot(0.94), 3) < 0.1 and not ctl.drafts_guess(3)
    for _ in range(40):
        ctl.observe_guess(3, True)
    assert rating.guess_hit(ctl.snapshot(0.94), 3) > 0.7 and ctl.drafts_guess(3)


def test_on_shared_cores_a_lone_generation_starts_from_what_its_predecessors_saw():
    """Alone, a generation starts from max(PRIOR_A, the pool's acceptance) where the draft
    has its own hardware (an optimistic start hides behind the verify pass), but from the
    pool where the draft shares the target's cores; lookups likewise. Only for requests
    whose text k cannot change."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.loop import Orchestrator
    from specdec.config import SamplingParams

    Client = ServiceClient

    def orchestrator(shared_cores: bool) -> Orchestrator:
        orch = Orchestrator(Client(), Client(), tokenizer=None, eos_ids=[], max_context=512,
                            shared_cores=shared_cores)
        for _ in range(40):  # recent generations: a draft rarely kept, lookups that miss
            orch.acceptance.observe(2, 0)
            orch.lookups.observe(0)
        return orch

    greedy = GenerationRequest([1], 8)
    orch = orchestrator(shared_cores=False)
    assert orch._controller(greedy).acceptance == adaptive.PRIOR_A
    assert orch._lookup_sizer(greedy).mean_accepted == adaptive.LOOKUP_PRIOR
    orch = orchestrator(shared_cores=True)
    assert orch._controller(greedy).acceptance < 0.1
    assert orch._lookup_sizer(greedy).mean_accepted < 0.1
    rejection = GenerationRequest([1], 8, SamplingParams(temperature=0.8, rule="rejection"))
    assert orch._controller(rejection).acceptance == adaptive.PRIOR_A


def _crowded_ctl(running: int, shared: bool = True, batch: float = 1.0,
                 **kw) -> KController:
    """A controller over a CPU target (46 + 6 m ms a pass) and a 10 ms draft step, with
    ``running`` generations, calls that show ``batch`` sessions per pass."""
    costs = Costs.calibrated(CPU_LINE, [10.0])
    costs.draft_call_ms, costs.target_batch = 2.0, batch
    kw.setdefault("drafter_invariant", True)
    return KController(CPU_LINE, [10.0], costs=costs, running=lambda: running,
                       shared_cores=shared, **kw)


def test_crowding_on_shared_cores_is_a_term_of_the_cost_model():
    """Where the draft shares the target's cores, the generations running count as the
    target's batch at once (the calls show it rounds later) and a block's draft steps as the
    cores' time the batched passes wait for (``raises_throughput``'s crowding term). At
    acceptance 0.9: alone the model drafts; 8 generations on the shared cores draft nothing,
    not even probes (no acceptance would pay there); on cores of its own the same 8 draft
    until the calls show the load; and at a load the calls show (4 sessions a pass) the
    draft's compute alone decides."""
    assert _crowded_ctl(1).best_k(0.9) > 0 and not _crowded_ctl(1).crowded()
    heavy = _crowded_ctl(8, prior_a=0.9, prior_weight=1000.0)
    assert heavy.crowded() and heavy.best_k(0.9) == heavy.best_k(1.0) == 0
    ks = []
    for _ in range(300):
        ks.append(heavy.next_k())
        heavy.observe(ks[-1], 0)
    assert ks == [0] * 300  # (a probe were due every PROBE_EVERY rounds)
    assert _crowded_ctl(8, shared=False).best_k(0.9) > 0
    assert _crowded_ctl(4, batch=4.0).best_k(0.9) == 0
    assert _crowded_ctl(4, shared=False, batch=4.0).best_k(0.9) > 0
    # only adaptive k on requests whose text k cannot change
    assert _crowded_ctl(8, fixed_k=3).crowd() == 0 and _crowded_ctl(8, fixed_k=3).next_k() == 3
    assert _crowded_ctl(8, drafter_invariant=False).crowd() == 0


def test_a_choice_is_rated_by_a_pure_function_of_a_snapshot():
    """KController.snapshot takes what a rating depends on (acceptance, costs, the cache's
    hit rate and width, the guess's record, load, crowding, decoding on); orchestrator.rating
    rates a choice from it alone: the controller's rates are the snapshot's, and what the
    controller learns afterwards does not move a snapshot taken before."""
    from orchestrator import rating

    ctl = _int8_pipelined(decode_on=3, shared_cores=True, drafter_invariant=True,
                          running=lambda: 2)
    ctl.use_width(3)
    ctl.observe_guess(3, False)
    snap = ctl.snapshot(0.8)
    assert snap == rating.Snapshot(ctl.costs, 0.8, True, True, 0.93, ctl.guess_held.value,
                                   ctl.guess_predicted.value, 3, False, 3, 2.0)
    rates = [rating.rate(snap, k) for k in range(5)]
    assert rates == [ctl.rate(k, 0.8) for k in range(5)]
    ctl.cache_hit = 0.1
    ctl.use_width(1)
    assert [rating.rate(snap, k) for k in range(5)] == rates
    assert [ctl.rate(k, 0.8) for k in range(5)] != rates
    assert rating.lookup_rate(ctl.costs, 8, 2.0) == 3.0 / ctl.costs.verify_ms(8)
