"""Live costs: what calls show moves the cost model, and k follows the target's load."""

import random

import pytest

from orchestrator import adaptive
from orchestrator import costs as cost_model
from orchestrator.adaptive import Costs, KController, LiveCosts, LookupSizer
from orchestrator.service_clients import CallRecord

# T(m) ms, m = 1..16, as calibrated on a 2-core CPU: flat to m ~ 6, then ~1 ms per token
CURVE = [30.0, 31, 31, 31, 31, 32, 33, 35, 36, 37, 38, 39, 40, 41, 43, 44]


def rec(service, compute_ms, tokens, sent=1, rpc_extra_ms=2.0, batch=1, outcome="ok",
        re_prefilled=False, pass_tokens=0, queued_ms=0.0, after_draft=False):
    """A call of ``compute_ms`` that took ``queued_ms`` (its wait in the service) + ``rpc_extra_ms``
    more."""
    return CallRecord(service, 0.0, (compute_ms + queued_ms + rpc_extra_ms) / 1000.0,
                      compute_ms, tokens, outcome, re_prefilled, batch, sent,
                      pass_tokens=pass_tokens, queued_ms=queued_ms, after_draft=after_draft)


def live():
    return LiveCosts(**vars(Costs.calibrated(CURVE, [3.0])))


def test_costs_follow_the_calls():
    costs = live()
    for _ in range(80):
        costs.observe(rec("target", 60.0, 4))  # a 5-token verify at twice its calibration
        costs.observe(rec("draft", 20.0, 4, rpc_extra_ms=3.0))  # 5 ms a step, 3 ms a call
    assert abs(costs.target_scale - 60.0 / 31.0) < 0.01
    assert abs(costs.target_call_ms - 2.0) < 0.01
    assert abs(costs.draft_step_ms - 5.0) < 0.01 and abs(costs.draft_call_ms - 3.0) < 0.01
    assert abs(costs.verify_ms(4) - (31.0 * 60.0 / 31.0 + 2.0)) < 0.1


def test_a_wait_in_the_target_is_costed_as_a_wait_not_as_the_calls_own_time():
    """A call that arrived during another session's pass waited for it (the target reports
    queued_ms): that wait is a share of a pass, which grows with the batch's blocks, not the
    call's own time, which every k pays alike (a 20 ms call time would make long blocks look
    cheap under load)."""
    costs = live()
    for _ in range(80):
        costs.observe(rec("target", 40.0, 1, queued_ms=20.0))
    assert abs(costs.target_call_ms - 2.0) < 0.05
    assert abs(costs.target_wait - 0.5) < 0.01


def test_a_verify_that_waits_because_it_drafted_charges_the_wait_to_drafting(monkeypatch):
    """Under load the target regroups the sessions it just answered into the next pass; a
    session that drafted first comes back late and waits for that whole pass, one that only
    verifies does not. The wait is charged to drafted rounds, so k falls to 0; charged to
    every round alike (one wait for all) it would make long blocks look cheap. (The load
    margin and the throughput condition aside: the wait's attribution alone.)"""
    monkeypatch.setattr(adaptive, "LOAD_MARGIN", 0.0)
    monkeypatch.setattr(cost_model, "LOADED_BATCH", float("inf"))

    def run(split_waits: bool) -> int:
        costs = live()
        rng = random.Random(0)
        ctl = KController(CURVE, [3.0], costs=costs)
        for _ in range(80):
            k = ctl.next_k()
            m = 4 * (k + 1)
            wait = CURVE[m - 1] if k else 0.0  # a drafted round waits a whole pass
            costs.observe(rec("target", CURVE[m - 1], k, batch=4, pass_tokens=m,
                              queued_ms=wait, after_draft=k > 0 and split_waits))
            accepted = 0
            while accepted < k and rng.random() < 0.6:
                accepted += 1
            ctl.observe(k, accepted)
        return ctl.next_k()

    assert run(split_waits=True) == 0
    assert run(split_waits=False) > 0  # the waits spread over every round: it speculates


def test_prefills_cancellations_and_re_prefills_are_not_steady_costs():
    costs = live()
    before = vars(costs).copy()
    for r in (rec("target", 900.0, 0, sent=300), rec("draft", 400.0, 4, sent=300),
              rec("draft", 1.0, 0, outcome="cancelled"),
              rec("target", 500.0, 4, re_prefilled=True)):
        costs.observe(r)
    assert vars(costs) == before


def _k_after(costs, batch, rounds=60, acceptance=0.6, pass_ms=None, wait=0.0):
    """k after ``rounds`` rounds against a target batching ``batch`` sessions, with a draft
    whose every token is accepted with probability ``acceptance``. The target's pass over m
    tokens costs ``pass_ms(m)`` (default: its calibration), and a call also waits ``wait``
    of a pass for the one in progress."""
    rng = random.Random(0)
    ctl = KController(CURVE, [3.0], costs=costs)
    pass_ms = pass_ms or costs.forward_ms
    for _ in range(rounds):
        k = ctl.next_k()
        m = batch * (k + 1)
        costs.observe(rec("target", pass_ms(m), k, batch=batch, pass_tokens=m,
                          queued_ms=wait * pass_ms(m), after_draft=k > 0))
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        ctl.observe(k, accepted)
    return ctl.next_k()


def test_k_falls_to_zero_under_a_large_batch_and_rises_when_it_empties():
    costs = live()
    alone = _k_after(costs, batch=1)
    assert alone >= 2  # a flat verify pass and a good draft: speculate
    assert _k_after(costs, batch=64) == 0  # k + 1 tokens per session cost the whole batch
    assert _k_after(costs, batch=1) >= 2  # the batch emptied: speculation resumes


def test_a_pass_line_that_crosses_zero_never_costs_a_pass_nothing():
    """Under load the passes are costed by a line fitted to them; noisy passes can fit one
    with a negative intercept (here steep: 1 ms at 8 tokens, 60 ms at 10). A pass still costs
    at least a one-token pass, so the load model divides by no zero (a ZeroDivisionError in
    raises_throughput failed a generation in the full suite's batching test)."""
    costs = live()
    for tokens, ms in [(8, 1.0), (10, 60.0)] * 6:
        costs.observe(rec("target", ms, 1, batch=4, pass_tokens=tokens))
    intercept, slope = costs._pass_line()
    assert intercept + slope * 4 < 0  # the line alone says a 4-token pass is free
    assert costs.target_batch > cost_model.LOADED_BATCH
    assert costs.pass_ms(4) == costs.pass_ms(1) > 0
    adaptive.raises_throughput(costs, 2, 2.5, 0.5)  # (raised ZeroDivisionError)


def test_k_follows_what_batched_passes_cost_not_the_one_session_calibration(monkeypatch):
    """Batched, the target's pass grows 3.5 ms per token (several sessions' rows) where its
    one-session calibration grows ~1 ms, and each call waits half a pass for the one in
    progress: k is costed by what the passes cost, so it stays 0 at 8 sessions, though the
    calibration alone would speculate there (without the load margin and the throughput
    condition: the line alone)."""
    monkeypatch.setattr(adaptive, "LOAD_MARGIN", 0.0)
    monkeypatch.setattr(cost_model, "LOADED_BATCH", float("inf"))

    def batched(m):
        return 20.0 + 3.5 * m

    costs = live()
    assert _k_after(costs, batch=8, acceptance=0.5, pass_ms=batched, wait=0.5) == 0
    assert costs.target_wait > 0.4 and costs._pass_line() is not None
    slope = costs._pass_line()[1]
    assert 3.0 < slope < 4.0
    calibrated = live()  # what the model predicts from the calibration alone, at this load
    calibrated.target_batch = 8.0
    assert KController(CURVE, [3.0], costs=calibrated).best_k(0.5) > 0
    assert _k_after(costs, batch=1) >= 2  # alone again: the calibration, and speculation


def test_under_load_a_gain_within_the_margin_is_no_gain(monkeypatch):
    """While the target batches B sessions, k > 0 needs a predicted gain over k = 0 above
    LOAD_MARGIN per other session; alone, any gain speculates. (The throughput condition
    aside: the margin alone.)"""
    monkeypatch.setattr(cost_model, "LOADED_BATCH", float("inf"))
    costs = live()
    costs.target_batch = 5.0
    ctl = KController(CURVE, [3.0], costs=costs)
    margin = adaptive.LOAD_MARGIN * 4

    def gain(a):
        return max(ctl.rate(k, a) for k in range(1, ctl.k_max + 1)) / ctl.rate(0, a) - 1.0

    grid = [i / 100 for i in range(5, 100)]
    small = next(a for a in grid if 0.0 < gain(a) < margin)
    large = next(a for a in grid if gain(a) > margin + 0.05)
    assert ctl.best_k(small) == 0
    assert ctl.best_k(large) > 0
    costs.target_batch = 1.0  # alone: the small gain is taken
    assert gain(small) > 0 and ctl.best_k(small) > 0


# T(m) of a 1-thread CPU: ~6 ms per token from 46 ms (the default target here, one core)
CPU_LINE = [46.0 + 6.0 * m for m in range(16)]
FLAT = [10.0] * 48 + [10.0 + 0.1 * m for m in range(1, 17)]  # a GPU's: flat to 48


def _pipelined(curve, batch, cache_hit, draft=(6.0,)):
    """A pipelined controller with the speculation cache, whose draft's pass over m rows
    costs draft[m - 1] ms."""
    costs = Costs.calibrated(curve, list(draft))
    costs.target_batch = batch
    ctl = KController(curve, list(draft[:1]), pipelined=True, costs=costs)
    ctl.branching, ctl.cache_hit = True, cache_hit
    return ctl


def test_under_load_a_block_drafted_between_calls_must_raise_the_targets_throughput():
    """Two sessions on a CPU target whose pass grows 6 ms a token, a block of 1 at
    acceptance 0.5: drafted between this session's calls in half its rounds, it costs the
    pair throughput (each such round leaves the other's pass for one of its own): per round
    of this session (1 x 1.5 + 1.5) tokens / (pass(3) + 0.5 pass(1)) = 3.0 / 81 ms against
    target-only's 2 / 52. Ready at every verdict it pays: (1 + 1.5) / pass(3) = 2.5 / 58.
    Alone the target waits for this session anyway."""
    costs = _pipelined(CPU_LINE, 2.0, 0.5).costs
    assert 3.0 / 81.0 < 2.0 / 52.0 < 2.5 / 58.0
    assert not adaptive.raises_throughput(costs, 1, 1.5, miss=0.5)
    assert adaptive.raises_throughput(costs, 1, 1.5, miss=0.0)
    costs.target_batch = 1.0
    assert adaptive.raises_throughput(costs, 1, 1.5, miss=0.5)
    # sequential rounds (every block drafted between calls) and plain pipelining (a miss
    # drafts after the verdict) wait for the draft: no block under this load
    for ctl in (KController(CPU_LINE, [6.0], costs=_pipelined(CPU_LINE, 2.0, 0.5).costs),
                _pipelined(CPU_LINE, 2.0, 0.5)):
        ctl.branching = False
        assert ctl.waits_for_draft() and not ctl.raises_throughput(1, 0.5)
        assert ctl.best_k(0.5) == 0


def test_under_load_pipelined_rounds_with_the_cache_never_wait_for_the_draft():
    """With the speculation cache and other sessions in the target's passes, a miss round
    goes at once with no block (k = 0 now; the draft drafts the cache behind it), so a block
    is only ever one the cache held for the verdict: k is costed as hits' blocks and misses'
    single tokens, and must raise the target's throughput as a block ready at the verdict.
    By hand at acceptance 0.5, 80% hits (a verify of 1 costs pass(4) + 1 = 65 ms, of none
    pass(2) + 1 = 53): (0.8 x 1.5 + 0.2) / (0.8 x 65 + 0.2 x 53) = 1.4 / 62.6 against
    1 / 53 (k = 0): 1.19x, past the margin of 1.06; at 10% hits 1.05 / 54.2: 1.03x, no
    block. Alone a miss drafts now, as a sequential round."""
    ctl = _pipelined(CPU_LINE, 2.0, 0.8)
    assert not ctl.waits_for_draft() and ctl.miss_rate(1, 0.5, now=True) == 0.0
    assert ctl.best_k(0.5, now=True) == 0
    assert ctl.rate(1, 0.5) == pytest.approx(1.4 / 62.6)
    assert ctl.raises_throughput(1, 0.5) and ctl.best_k(0.5) >= 1
    assert _pipelined(CPU_LINE, 2.0, 0.1).best_k(0.5) == 0
    alone = _pipelined(CPU_LINE, 1.0, 0.8)
    assert alone.waits_for_draft() and alone.best_k(0.5, now=True) >= 1
    alone.running = lambda: 2  # a second generation just started: the calls do not show it yet
    assert not alone.waits_for_draft()
    alone.running = lambda: 1
    assert alone.waits_for_draft()
    fixed = _pipelined(CPU_LINE, 2.0, 0.8)
    fixed.fixed_k = 3  # a request's own k is drafted as asked
    assert fixed.waits_for_draft() and fixed.next_k(now=True) == 3


def test_under_load_a_probe_is_drafted_behind_and_stays_due_until_a_block_is_verified():
    """Where rounds do not wait for the draft, a probe of a draft that does not pay is a
    block drafted behind a verify (asked with ``after_full_accept``) and taken on a hit; a
    miss round never drafts one now. It stays due until a block is verified."""
    ctl = _pipelined(CPU_LINE, 2.0, 0.5)
    for _ in range(200):  # a draft whose blocks are never kept: k = 0, probes only
        ctl.observe(ctl.next_k(), 0)
    ctl.observe(2, 0)  # (a probe just verified)
    assert ctl.best_k() == 0
    due = int(ctl.probe_due())
    assert due == int(ctl.probes.every()) * ctl.backoff and ctl.backoff > 1
    for _ in range(due):
        assert ctl.next_k(after_full_accept=True) == 0 and ctl.next_k() == 0
        ctl.observe(0, 0)
    assert ctl.next_k(now=True) == 0  # a miss goes at once
    for _ in range(3):  # behind the verify, then the next round takes it; misses keep it due
        assert ctl.next_k(after_full_accept=True) == 2 and ctl.next_k() == 2
    ctl.observe(2, 0)  # the probe's block was verified
    assert ctl.next_k(after_full_accept=True) == 0 and ctl.next_k() == 0


def test_a_flat_pass_keeps_speculation_under_load_where_the_cache_holds_the_verdicts():
    """A GPU-like target (a pass costs the same to 48 tokens): 16 sessions, a draft of
    acceptance 0.7 whose cache holds 90% of the verdicts speculate; at acceptance 0.3 and a
    cache that misses half, or in sequential rounds (every round a miss), they do not."""
    gpu_draft = (1.0,) * 64  # 1 ms a pass, however many branches
    assert _pipelined(FLAT, 16.0, 0.9, gpu_draft).best_k(0.7) > 0
    assert _pipelined(FLAT, 16.0, 0.5, gpu_draft).best_k(0.3) == 0
    sequential = KController(FLAT, [1.0], costs=_pipelined(FLAT, 16.0, 0.9, gpu_draft).costs)
    assert sequential.miss_rate(2, 0.7) == 1.0 and sequential.best_k(0.7) == 0


def test_probes_of_a_draft_that_never_pays_grow_rarer_under_load_and_after_each_miss():
    """A draft whose blocks are never accepted is probed after PROBE_EVERY rounds at k = 0
    alone, PROBE_EVERY * B while the target's passes hold B sessions, and each probe that
    leaves speculation unpaid doubles the wait, up to PROBE_BACKOFF_MAX times."""
    def gaps(batch: float) -> list[int]:
        costs = live()
        costs.target_batch = batch
        ctl = KController(CURVE, [3.0], costs=costs)
        probes = []
        for i in range(200 + 2000):  # (the first 200: the prior acceptance wears off)
            k = ctl.next_k()
            if k and i >= 200:
                probes.append(i)
            ctl.observe(k, 0)
        return [b - a for a, b in zip(probes, probes[1:])]

    top = adaptive.PROBE_BACKOFF_MAX * adaptive.PROBE_EVERY + 1  # rounds at k = 0, the probe
    alone, loaded = gaps(1.0), gaps(8.0)
    assert alone[-3:] == [top] * 3 and loaded[-1] == 8 * top - 7
    assert all(b >= a for a, b in zip(alone, alone[1:]))  # the spacing only grows


def test_a_probe_that_pays_brings_the_probes_back_to_their_first_spacing():
    """After probes that did not pay (the backoff at its cap), one whose block is accepted
    makes blocks pay again and the backoff returns to 1."""
    ctl = KController(CURVE, [3.0], costs=live())
    for _ in range(1500):
        ctl.observe(ctl.next_k(), 0)
    assert ctl.backoff == adaptive.PROBE_BACKOFF_MAX
    while not (k := ctl.next_k()):
        ctl.observe(0, 0)
    for _ in range(30):  # the probe, and the text turns easy: whole blocks accepted
        ctl.observe(k, k)
        k = ctl.next_k() or 2
    assert ctl.best_k() > 0 and ctl.backoff == 1


def test_rejection_sampled_requests_keep_the_calibrated_costs():
    """Under the rejection rule k changes a seeded request's text, so k must not follow
    timings; greedy and coupled-sampled requests (k cannot change their text) use live costs."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.loop import Orchestrator
    from specdec.config import SamplingParams

    class Info:
        forward_ms = CURVE
        vocab_size = 0  # unknown (as a service that does not say): the tokenizer's
        drafter = "model"

    class Client:
        info = Info()

    orch = Orchestrator(Client(), Client(), tokenizer=None, eos_ids=[], max_context=512)
    for _ in range(50):
        orch.live_costs.observe(rec("target", 300.0, 4))
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
    sizer = LookupSizer(live(), 8)
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
    costs = live()
    rare = LookupSizer(costs, 8, prior_accepted=1 / 6)
    assert (1 + 1 / 6) / costs.verify_ms(8) < 1 / costs.verify_ms(0) and not rare.worth_it()


def test_prompt_lookup_probes_grow_rarer_under_load():
    """A probe's 8 tokens lengthen the pass every session shares: while the target's passes
    hold B sessions, a lookup that does not pay is probed every PROBE_EVERY * B rounds."""
    def probes(batch: float) -> list[int]:
        costs = live()
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
    costs = live()
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

    class Info:
        forward_ms = CURVE
        vocab_size = 0  # unknown (as a service that does not say): the tokenizer's
        drafter = "model"

    class Client:
        info = Info()

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
    assert ctl.round_ms(2, 0.45) < 65.0 < ctl.round_ms(2, 0.45, now=True)
    assert ctl.round_ms(2, 0.45, now=True) == costs.draft_ms(2) + \
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
    assert ctl._behind_ms(3) == 94.0 and ctl._behind_ms(3, guess=True) == 50.0
    assert ctl.drafts_guess(3, 0.94)
    k = ctl.best_k(0.94)
    assert k >= 2 and ctl.drafts_guess(k, 0.94)
    guess_rate = adaptive.expected_tokens(0.94, k) / ctl.round_ms(k, 0.94, guess=True)
    assert ctl.rate(k, 0.94) == guess_rate > adaptive.expected_tokens(0.94, k) / ctl.round_ms(
        k, 0.94)
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
    assert ctl.guess_hit(3, 0.94) == pytest.approx(0.94 ** 4) and ctl.drafts_guess(3)
    for _ in range(40):
        ctl.observe_guess(3, False)
    assert ctl.guess_hit(3, 0.94) < 0.1 and not ctl.drafts_guess(3)
    for _ in range(40):
        ctl.observe_guess(3, True)
    assert ctl.guess_hit(3, 0.94) > 0.7 and ctl.drafts_guess(3)


def test_on_shared_cores_a_lone_generation_starts_from_what_its_predecessors_saw():
    """Alone, a generation starts from max(PRIOR_A, the pool's acceptance) where the draft
    has its own hardware (an optimistic start hides behind the verify pass), but from the
    pool where the draft shares the target's cores; lookups likewise. Only for requests
    whose text k cannot change."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.loop import Orchestrator
    from specdec.config import SamplingParams

    class Info:
        forward_ms = CURVE
        vocab_size = 0  # unknown (as a service that does not say): the tokenizer's
        drafter = "model"

    class Client:
        info = Info()

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


def test_a_generation_is_crowded_only_on_shared_cores_beside_others_with_adaptive_k():
    """The controller's veto: no block while other generations share the cores, only where
    the draft shares the target's, k is adaptive and k cannot change the text."""
    def ctl(**kw):
        return KController(FLAT, [1.0], **kw)

    assert ctl(drafter_invariant=True).crowded(active=2, shared_cores=True)
    assert not ctl(drafter_invariant=True).crowded(active=1, shared_cores=True)
    assert not ctl(drafter_invariant=True).crowded(active=2, shared_cores=False)
    assert not ctl(drafter_invariant=True, fixed_k=3).crowded(active=2, shared_cores=True)
    assert not ctl(drafter_invariant=False).crowded(active=2, shared_cores=True)
