"""Pipelined rounds over fake service clients (loop_fakes): hits and misses of the block
drafted behind each verify, the speculation cache and the single guess, the cache's width,
and the round's plan that decides the call behind each verify."""

import asyncio

from loop_fakes import (
    EOS,
    VOCAB,
    FakeDraft,
    FakeTarget,
    FakeTokenizer,
    generate,
    pipelined_exactly,
    target_next,
    target_text,
)

from orchestrator import adaptive
from orchestrator.generation import GenerationRequest
from orchestrator.loop import Orchestrator
from specdec.config import SamplingParams


def test_pipelined_rounds_hit_and_miss_with_a_poor_draft_and_cancel_the_misses():
    target, draft = FakeTarget(), FakeDraft()
    result = generate("pipelined", 3, max_new=80, target=target, draft=draft, branches=False)
    # Every verified block is the draft's continuation of the committed history: a block
    # drafted behind a verify is kept only when the verdict is what it was drafted after.
    for history, block in target.verified:
        assert block == draft.continuation(history, len(block))
    s = result.stats
    assert result.token_ids == target_text([5, 11, 23], 80)
    assert s.pipeline_hits > 0 and s.pipeline_misses > 0
    cancelled = [c for c in s.calls if c.service == "draft" and c.outcome == "cancelled"]
    assert cancelled  # a rejected block's speculative draft is cancelled, not awaited
    # a hit's block was verified without a draft call of its own that round
    assert s.tokens_per_round and max(s.tokens_per_round) >= 2


def test_the_speculation_cache_serves_the_verdicts_it_drafted_for():
    s = pipelined_exactly(3, wrong_every=3).stats
    # the fake draft's second choice is the target's token at each of its mistakes, so the
    # cache (width >= 1 per acceptance length) holds nearly every verdict
    assert s.branches_drafted > s.pipeline_hits > 2 * s.pipeline_misses
    plain = generate("pipelined", 3, max_new=80, draft=FakeDraft(wrong_every=3),
                     branches=False).stats
    assert s.pipeline_hits > plain.pipeline_hits
    assert plain.branches_drafted == 0


def test_rounds_that_draft_the_single_guess_and_rounds_that_draft_the_cache_mix(monkeypatch):
    """The cost model may draft the single guess behind some verifies and the cache behind
    others (KController.drafts_guess): each round's block is still the draft's continuation
    of the committed history, the text the target's, and both kinds of hits are counted."""
    calls = []

    def alternate(self, k, a=None):
        calls.append(k)
        return bool(k) and len(calls) % 2 == 0

    monkeypatch.setattr(adaptive.KController, "drafts_guess", alternate)
    result = pipelined_exactly(2, wrong_every=13)
    s = result.stats
    assert s.guess_calls > 0 and s.branches_drafted > 0
    assert 0 < s.cache_hits < s.pipeline_hits  # the rest were the guess's hits
    assert result.summary()["wasted_branches"] == s.branches_drafted - s.cache_hits


def test_a_miss_round_that_drafts_nothing_still_drafts_the_cache_behind_it(monkeypatch):
    """A pipelined miss drafts its block after the verdict, costed as a sequential round's
    (KController.best_k, now): where that does not pay, the round verifies no block, but the
    draft still drafts the cache's branches behind it (the target's likeliest next tokens,
    each with its block), so the next round can hit again instead of every later round
    missing, drafting nothing behind nothing."""
    monkeypatch.setattr(adaptive.KController, "best_k",
                        lambda self, a=None, now=False: 0 if now else 3)

    class Blind(FakeDraft):  # at every 7th position no candidate is the target's token
        def candidates(self, seq, width, exclude):
            if len(seq) % 7:
                return super().candidates(seq, width, exclude)
            return [(target_next(seq) + 10 + i) % (VOCAB - 1) for i in range(width)]

    target, draft = FakeTarget(), Blind(wrong_every=3)
    result = generate("pipelined", None, max_new=80, target=target, draft=draft)
    s = result.stats
    assert result.token_ids == target_text([5, 11, 23], 80)
    empty = [block for _, block in target.verified[1:] if not block]
    assert len(empty) >= 3  # miss rounds: nothing drafted now
    assert s.pipeline_misses >= len(empty) - 1
    assert s.pipeline_hits >= 3 * len(empty)  # each is followed by hits again


def test_the_cache_width_follows_the_costs_and_narrows_when_calls_run_long():
    from orchestrator.adaptive import BranchWidth, Costs

    costs = Costs(target_ms=[30.0 + 2 * i for i in range(9)], draft_step_ms=2.0,
                  draft_forward=[2.0 + 0.25 * i for i in range(16)], draft_call_ms=0.5)
    widths = BranchWidth(costs)
    wide = widths.choose(3, 3)
    # the widest whose call hides behind a 37 ms verify: 9 * (k + 1) = 36 branches
    assert wide == 9 < adaptive.MAX_WIDTH
    assert costs.branch_call_ms(3, wide, 3) <= costs.verify_ms(3) < \
        costs.branch_call_ms(3, wide + 1, 3)
    for _ in range(12):  # the calls take 3x what the costs predict (a busy draft)
        widths.observe(3, wide, 3, 3 * costs.branch_call_ms(3, wide, 3))
    assert widths.choose(3, 3) < wide
    slow = BranchWidth(Costs(target_ms=[5.0] * 9, draft_step_ms=2.0,
                             draft_forward=[2.0 + 0.25 * i for i in range(16)]))
    assert slow.choose(3, 3) == 1  # nothing wider hides behind a 5 ms verify


def test_the_cache_is_off_where_the_orchestrator_says_the_draft_shares_the_cores():
    target, draft = FakeTarget(), FakeDraft(wrong_every=3)
    target.prompt_len = 3
    # what orchestrator_for gives for local services
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=True)
    req = GenerationRequest([5, 11, 23], 60, SamplingParams(), [], "pipelined", 3,
                            prompt_lookup=False)
    result = asyncio.run(orch.generate(req))
    assert result.token_ids == target_text([5, 11, 23], 60)
    assert result.stats.branches_drafted == 0  # plain pipelining only
    assert result.stats.pipeline_hits + result.stats.pipeline_misses > 0


def test_a_rounds_plan_holds_the_call_behind_its_verify_and_the_pipeline_sends_it(monkeypatch):
    """The Planner decides what the draft drafts behind each verify (Plan.behind: the single
    guess, or the cache's branches with their width and depth) and the Pipeline sends
    exactly that: a guess call per planned guess, a branch call of the planned shape per
    planned branch call, and nothing where the plan has no call."""
    from orchestrator import planning

    plans, branch_calls = [], []
    real_plan = planning.Planner.plan

    async def recording(self, *args):
        plans.append(await real_plan(self, *args))
        return plans[-1]

    class Shapes(FakeDraft):
        async def propose_branches(self, session_id, history, block, width, depth, *args):
            branch_calls.append((len(block), width, depth))
            return await super().propose_branches(session_id, history, block, width, depth,
                                                  *args)

    monkeypatch.setattr(planning.Planner, "plan", recording)
    monkeypatch.setattr(adaptive.KController, "drafts_guess",
                        lambda self, k, a=None: bool(k) and len(plans) % 2 == 0)
    target, draft = FakeTarget(), Shapes(wrong_every=13)
    s = generate("pipelined", 2, max_new=80, target=target, draft=draft).stats
    calls = [p for p in plans if p.behind is not None]
    assert 0 < len(calls) < len(plans) and s.guess_calls == sum(p.behind.guess for p in calls)
    assert branch_calls == [(len(p.block.tokens), p.behind.width, p.behind.depth)
                            for p in calls if not p.behind.guess]
    assert branch_calls and s.guess_calls > 0
