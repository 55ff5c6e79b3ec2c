"""Live costs: what calls show moves the cost model, and k follows the target's load."""

import random

import pytest

from orchestrator import adaptive, rating
from orchestrator import costs as cost_model
from orchestrator.adaptive import KController
from conftest import CPU_LINE, CURVE, FLAT, call_record, live_costs, pipelined_controller

def test_costs_follow_the_calls():
    costs = live_costs()
    for _ in range(80):
        costs.observe(call_record("target", 60.0, 4))  # a 5-token verify at twice its calibration
        costs.observe(call_record("draft", 20.0, 4, rpc_extra_ms=3.0))  # 5 ms a step, 3 ms a call
    assert abs(costs.target_scale - 60.0 / 31.0) < 0.01
    assert abs(costs.target_call_ms - 2.0) < 0.01
    assert abs(costs.draft_step_ms - 5.0) < 0.01 and abs(costs.draft_call_ms - 3.0) < 0.01
    assert abs(costs.verify_ms(4) - (31.0 * 60.0 / 31.0 + 2.0)) < 0.1


def test_a_wait_in_the_target_is_costed_as_a_wait_not_as_the_calls_own_time():
    """A call that arrived during another session's pass waited for it (the target reports
    queued_ms): that wait is a share of a pass, which grows with the batch's blocks, not the
    call's own time, which every k pays alike (a 20 ms call time would make long blocks look
    cheap under load)."""
    costs = live_costs()
    for _ in range(80):
        costs.observe(call_record("target", 40.0, 1, queued_ms=20.0))
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
        costs = live_costs()
        rng = random.Random(0)
        ctl = KController(CURVE, [3.0], costs=costs)
        for _ in range(80):
            k = ctl.next_k()
            m = 4 * (k + 1)
            wait = CURVE[m - 1] if k else 0.0  # a drafted round waits a whole pass
            costs.observe(call_record("target", CURVE[m - 1], k, batch=4, pass_tokens=m,
                              queued_ms=wait, after_draft=k > 0 and split_waits))
            accepted = 0
            while accepted < k and rng.random() < 0.6:
                accepted += 1
            ctl.observe(k, accepted)
        return ctl.next_k()

    assert run(split_waits=True) == 0
    assert run(split_waits=False) > 0  # the waits spread over every round: it speculates


def test_prefills_cancellations_and_re_prefills_are_not_steady_costs():
    costs = live_costs()
    before = vars(costs).copy()
    for r in (call_record("target", 900.0, 0, sent=300), call_record("draft", 400.0, 4, sent=300),
              call_record("draft", 1.0, 0, outcome="cancelled"),
              call_record("target", 500.0, 4, re_prefilled=True)):
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
        costs.observe(call_record("target", pass_ms(m), k, batch=batch, pass_tokens=m,
                          queued_ms=wait * pass_ms(m), after_draft=k > 0))
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        ctl.observe(k, accepted)
    return ctl.next_k()


def test_k_falls_to_zero_under_a_large_batch_and_rises_when_it_empties():
    costs = live_costs()
    alone = _k_after(costs, batch=1)
    assert alone >= 2  # a flat verify pass and a good draft: speculate
    assert _k_after(costs, batch=64) == 0  # k + 1 tokens per session cost the whole batch
    assert _k_after(costs, batch=1) >= 2  # the batch emptied: speculation resumes


def test_a_pass_line_that_crosses_zero_never_costs_a_pass_nothing():
    """Under load the passes are costed by a line fitted to them; noisy passes can fit one
    with a negative intercept (here steep: 1 ms at 8 tokens, 60 ms at 10). A pass still costs
    at least a one-token pass, so the load model divides by no zero (a ZeroDivisionError in
    raises_throughput failed a generation in the full suite's batching test)."""
    costs = live_costs()
    for tokens, ms in [(8, 1.0), (10, 60.0)] * 6:
        costs.observe(call_record("target", ms, 1, batch=4, pass_tokens=tokens))
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

    costs = live_costs()
    assert _k_after(costs, batch=8, acceptance=0.5, pass_ms=batched, wait=0.5) == 0
    assert costs.target_wait > 0.4 and costs._pass_line() is not None
    slope = costs._pass_line()[1]
    assert 3.0 < slope < 4.0
    calibrated = live_costs()  # what the model predicts from the calibration alone, at this load
    calibrated.target_batch = 8.0
    assert KController(CURVE, [3.0], costs=calibrated).best_k(0.5) > 0
    assert _k_after(costs, batch=1) >= 2  # alone again: the calibration, and speculation


def test_under_load_a_gain_within_the_margin_is_no_gain(monkeypatch):
    """While the target batches B sessions, k > 0 needs a predicted gain over k = 0 above
    LOAD_MARGIN per other session; alone, any gain speculates. (The throughput condition
    aside: the margin alone.)"""
    monkeypatch.setattr(cost_model, "LOADED_BATCH", float("inf"))
    costs = live_costs()
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
def test_under_load_a_block_drafted_between_calls_must_raise_the_targets_throughput():
    """Two sessions on a CPU target whose pass grows 6 ms a token, a block of 1 at
    acceptance 0.5: drafted between this session's calls in half its rounds, it costs the
    pair throughput (each such round leaves the other's pass for one of its own): per round
    of this session (1 x 1.5 + 1.5) tokens / (pass(3) + 0.5 pass(1)) = 3.0 / 81 ms against
    target-only's 2 / 52. Ready at every verdict it pays: (1 + 1.5) / pass(3) = 2.5 / 58.
    Alone the target waits for this session anyway."""
    costs = pipelined_controller(CPU_LINE, 2.0, 0.5).costs
    assert 3.0 / 81.0 < 2.0 / 52.0 < 2.5 / 58.0
    assert not adaptive.raises_throughput(costs, 1, 1.5, miss=0.5)
    assert adaptive.raises_throughput(costs, 1, 1.5, miss=0.0)
    costs.target_batch = 1.0
    assert adaptive.raises_throughput(costs, 1, 1.5, miss=0.5)
    # sequential rounds (every block drafted between calls) and plain pipelining (a miss
    # drafts after the verdict) wait for the draft: no block under this load
    for ctl in (KController(CPU_LINE, [6.0], costs=pipelined_controller(CPU_LINE, 2.0, 0.5).costs),
                pipelined_controller(CPU_LINE, 2.0, 0.5)):
        ctl.branching = False
        assert ctl.waits_for_draft() and not rating.raises(ctl.snapshot(0.5), 1)
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
    ctl = pipelined_controller(CPU_LINE, 2.0, 0.8)
    assert not ctl.waits_for_draft() and rating.miss_rate(ctl.snapshot(0.5), 1, now=True) == 0.0
    assert ctl.best_k(0.5, now=True) == 0
    assert ctl.rate(1, 0.5) == pytest.approx(1.4 / 62.6)
    assert rating.raises(ctl.snapshot(0.5), 1) and ctl.best_k(0.5) >= 1
    assert pipelined_controller(CPU_LINE, 2.0, 0.1).best_k(0.5) == 0
    alone = pipelined_controller(CPU_LINE, 1.0, 0.8)
    assert alone.waits_for_draft() and alone.best_k(0.5, now=True) >= 1
    alone.running = lambda: 2  # a second generation just started: the calls do not show it yet
    assert not alone.waits_for_draft()
    alone.running = lambda: 1
    assert alone.waits_for_draft()
    fixed = pipelined_controller(CPU_LINE, 2.0, 0.8)
    fixed.fixed_k = 3  # a request's own k is drafted as asked
    assert fixed.waits_for_draft() and fixed.next_k(now=True) == 3


def test_under_load_a_probe_is_drafted_behind_and_stays_due_until_a_block_is_verified():
    """Where rounds do not wait for the draft, a probe of a draft that does not pay is a
    block drafted behind a verify (asked with ``after_full_accept``) and taken on a hit; a
    miss round never drafts one now. It stays due until a block is verified."""
    ctl = pipelined_controller(CPU_LINE, 2.0, 0.5)
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
    assert pipelined_controller(FLAT, 16.0, 0.9, gpu_draft).best_k(0.7) > 0
    assert pipelined_controller(FLAT, 16.0, 0.5, gpu_draft).best_k(0.3) == 0
    sequential = KController(FLAT, [1.0], costs=pipelined_controller(FLAT, 16.0, 0.9, gpu_draft).costs)
    assert rating.miss_rate(sequential.snapshot(0.7), 2) == 1.0 and sequential.best_k(0.7) == 0


def test_probes_of_a_draft_that_never_pays_grow_rarer_under_load_and_after_each_miss():
    """A draft whose blocks are never accepted is probed after PROBE_EVERY rounds at k = 0
    alone, PROBE_EVERY * B while the target's passes hold B sessions, and each probe that
    leaves speculation unpaid doubles the wait, up to PROBE_BACKOFF_MAX times."""
    def gaps(batch: float) -> list[int]:
        costs = live_costs()
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
    ctl = KController(CURVE, [3.0], costs=live_costs())
    for _ in range(1500):
        ctl.observe(ctl.next_k(), 0)
    assert ctl.backoff == adaptive.PROBE_BACKOFF_MAX
    while not (k := ctl.next_k()):
        ctl.observe(0, 0)
    for _ in range(30):  # the probe, and the text turns easy: whole blocks accepted
        ctl.observe(k, k)
        k = ctl.next_k() or 2
    assert ctl.best_k() > 0 and ctl.backoff == 1
