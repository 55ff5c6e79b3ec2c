"""Concurrent generations over fake service clients (loop_fakes): crowding on shared cores
as a term of the cost model, pipelined rounds that never wait for the draft under load, and
probes whose branch calls come late."""

import asyncio

import pytest
from loop_fakes import (
    EOS,
    FakeDraft,
    FakeTarget,
    FakeTokenizer,
    run_together,
    target_text,
)

from orchestrator import adaptive
from orchestrator.generation import GenerationRequest
from orchestrator.loop import Orchestrator
from specdec.config import SamplingParams
from specdec.wire import specdec_pb2 as pb


@pytest.mark.parametrize("shared", [True, False])
def test_generations_sharing_the_cores_draft_only_while_alone(shared):
    """On shared cores the cost model's crowding term counts the generations running as the
    target's batch: two sequential generations leave the draft idle (a block drafted between
    one's calls would cost the other's pass; crowded rounds) and a generation drafts again
    once it is alone; elsewhere all of them draft."""
    target, draft = FakeTarget(), FakeDraft(wrong_every=5)
    target.prompt_len = 3
    target.compute_ms = 10.0  # as calibrated: a verify costs 10x a draft step
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=shared)

    def req(n, **kw):
        return GenerationRequest([5, 11, 23], n, SamplingParams(**kw), [], "spec", None,
                                 prompt_lookup=False)

    long, short = run_together(orch, [req(60), req(12)])
    assert long.token_ids == target_text([5, 11, 23], 60)
    assert short.token_ids == target_text([5, 11, 23], 12)
    if not shared:
        assert long.stats.crowded_rounds == short.stats.crowded_rounds == 0
        assert short.stats.draft_tokens > 0
        return
    # the short one ran beside the long one all along: every round target-only
    assert short.stats.crowded_rounds == short.stats.rounds and short.stats.draft_tokens == 0
    # the long one was crowded while the short one ran, and drafts again after it ended
    k = long.stats.k_requested
    assert 0 < long.stats.crowded_rounds < long.stats.rounds
    assert long.stats.draft_tokens > 0 and k[-1] > 0
    assert orch.active == 0
    # alone, a generation on shared cores drafts
    alone = asyncio.run(orch.generate(req(12)))
    assert alone.stats.crowded_rounds == 0 and alone.stats.draft_tokens > 0
    # a request whose text depends on k (the rejection rule), or with a fixed k, keeps it
    sampled, fixed = run_together(orch, [
        req(12, temperature=0.8, seed=3, rule="rejection"),
        GenerationRequest([5, 11, 23], 12, SamplingParams(), [], "spec", 2, prompt_lookup=False)])
    assert sampled.stats.crowded_rounds == fixed.stats.crowded_rounds == 0
    assert fixed.stats.draft_tokens > 0


def test_crowded_generations_still_take_prompt_lookups_that_pay():
    """A lookup block costs no draft compute, so crowding on shared cores does not price it:
    two generations of a prompt that repeats itself, crowded (no draft block), still verify
    the lookup blocks that the lookup's own rate finds worth it (before, crowding vetoed
    lookups too)."""
    prompt = [1, 2, 3, 4] * 5
    target, draft = FakeTarget(), FakeDraft(wrong_every=5)
    target.prompt_len = len(prompt)
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=True)
    reqs = [GenerationRequest(list(prompt), 24, SamplingParams(), [], "spec", None)
            for _ in range(2)]
    for r in run_together(orch, reqs):
        assert r.token_ids == target_text(prompt, 24)
        assert r.stats.lookup_rounds > 0 and r.stats.crowded_rounds > 0


def test_concurrent_pipelined_generations_never_wait_for_the_draft(monkeypatch):
    """Two pipelined generations at once on separate hardware (the cache on): a miss round
    goes to the target at once with no block instead of drafting one now, and a branch call
    still running at its verdict is dropped (counted late, and a miss) instead of awaited;
    the text is still the target's. (k is 2 for blocks behind a verify, so hits take
    blocks whatever the fake's costs say; a miss's k is the controller's own.)"""
    real_best_k = adaptive.KController.best_k
    monkeypatch.setattr(adaptive.KController, "best_k",
                        lambda self, a=None, now=False: real_best_k(self, a, now) if now else 2)

    class SlowAtTimes(FakeDraft):  # every 4th branch call of a session outlasts its verify
        per_session: dict[str, int] = {}

        async def propose_branches(self, session_id, *args, **kwargs):
            n = self.per_session[session_id] = self.per_session.get(session_id, 0) + 1
            if n % 4 == 3:  # by far beside another session (a busy machine's stall is less)
                await asyncio.sleep(0.3 if orch.active > 1 else 0.05)
            return await super().propose_branches(session_id, *args, **kwargs)

    target, draft = FakeTarget(), SlowAtTimes(wrong_every=3)
    # a pass that grows with its rows: narrow branch calls, so that only the slow ones are
    # late on a busy machine
    draft.info = pb.ModelInfo(forward_ms=[1.0])
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
    reqs = [GenerationRequest([5, 11, 23], 60, SamplingParams(), [], "pipelined", None,
                              prompt_lookup=False) for _ in range(2)]
    results = run_together(orch, reqs)
    together = min(max(c.end for c in r.stats.calls if c.service == "target")
                   for r in results)  # until the first generation's last verdict
    for r in results:
        s = r.stats
        assert r.token_ids == target_text([5, 11, 23], 60)
        assert s.pipeline_hits > 0 and s.late_branch_calls > 0
        assert s.pipeline_misses >= s.late_branch_calls
        drafts = [c for c in s.calls if c.service == "draft"]
        assert sum(c.outcome == "cancelled" for c in drafts) == s.late_branch_calls
        # while both ran, only branch calls behind verifies (and their cancelled records):
        # no block was drafted after a verdict, between two verify calls (alone at the end
        # a generation may wait for the draft again)
        assert all(c.branches or c.outcome == "cancelled" or c.start >= together
                   for c in drafts)
        assert not any(c.after_draft for c in s.calls
                       if c.service == "target" and c.start < together)
    assert orch.active == 0
    # alone, a round waits for its branch call (no other session's pass to miss)
    alone = asyncio.run(orch.generate(reqs[0]))
    assert alone.token_ids == target_text([5, 11, 23], 60)
    assert alone.stats.late_branch_calls == 0 and alone.stats.pipeline_hits > 0


def test_under_load_a_probe_whose_branch_call_comes_late_backs_off():
    """Under load a probe is a branch call behind a verify; one still running at its verdict
    is dropped and counts as a probe that left speculation unpaid: the next comes after the
    doubled backoff, not behind every following round (a draft session that has not drafted
    for many rounds catches up on all of them first, and came as late each time)."""
    class AlwaysLate(FakeDraft):
        async def propose_branches(self, *args, **kwargs):
            # late by far beside another session: a busy machine's stall is less
            await asyncio.sleep(0.3 if orch.active > 1 else 0.03)
            return await super().propose_branches(*args, **kwargs)

    target, draft = FakeTarget(), AlwaysLate(wrong_every=1)
    draft.info = pb.ModelInfo(forward_ms=[1.0])
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
    reqs = [GenerationRequest([5, 11, 23], 300, SamplingParams(), [], "pipelined", None,
                              prompt_lookup=False) for _ in range(2)]
    for r in run_together(orch, reqs):
        s = r.stats
        assert r.token_ids == target_text([5, 11, 23], 300)
        assert s.late_branch_calls > 0 and s.pipeline_hits == 0  # branch calls went, all late
        # The first ones teach the cache's hit rate (no branch is ever on time) and blocks stop
        # paying; from then on only probes go, at most one every PROBE_EVERY rounds.
        verifies = [c.start for c in s.calls if c.service == "target"]
        half = verifies[len(verifies) // 2]
        late = sum(c.outcome == "cancelled" and c.start > half for c in s.calls)
        assert late <= (len(verifies) // 2) // adaptive.PROBE_EVERY, late
