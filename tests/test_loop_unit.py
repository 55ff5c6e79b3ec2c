"""The round loop over fake service clients (loop_fakes): fast checks of what every mode must
keep (the target's tokens, EOS and length limits, stats that add up, a failing draft, the
first round's prefills, adaptive k's priors and prompt lookups) without models or gRPC.
Pipelining: test_loop_pipelined; concurrent generations: test_loop_load. The real services
are tested in test_pipeline and test_real_pair."""

import asyncio

import pytest
from loop_fakes import (
    EOS,
    FakeDraft,
    FakeTarget,
    FakeTokenizer,
    generate,
    target_text,
)

from orchestrator.generation import DECODE_ON, GenerationRequest
from orchestrator.loop import Orchestrator
from specdec.config import SamplingParams


@pytest.mark.parametrize("mode", ["target-only", "spec", "pipelined"])
@pytest.mark.parametrize("k", [None, 1, 4])
def test_every_mode_emits_the_targets_tokens(mode, k):
    result = generate(mode, k)
    assert result.token_ids == target_text([5, 11, 23], 40)
    s = result.stats
    assert s.rounds == len(s.tokens_per_round) == len(s.k_requested)
    assert sum(s.tokens_per_round) >= len(result.token_ids)  # the last round may overshoot
    assert s.accepted_tokens == sum(s.accepted_per_position)
    assert s.draft_tokens == sum(k * n for k, n in s.rounds_per_k.items())
    if mode == "target-only":  # the first token alone, then 1 + DECODE_ON a call
        assert s.draft_tokens == 0 and s.rounds == 1 + -(-39 // (1 + DECODE_ON))
        assert s.decoded_tokens == 40 - s.rounds


@pytest.mark.parametrize("shared", [False, True])
def test_sequential_rounds_prefill_the_draft_beside_the_targets_prefill(shared):
    """spec's first round verifies no block: the draft prefills the prompt (a 1-token call)
    while the target prefills it, and the next round's draft call goes after that one; where
    the draft shares the target's cores, its prefill waits for the target's first token."""
    draft = FakeDraft(wrong_every=5)
    result = generate("spec", 3, draft=draft, max_new=20, shared_cores=shared)
    assert result.token_ids == target_text([5, 11, 23], 20)
    calls = result.stats.calls
    first_verify = next(c for c in calls if c.service == "target")
    first_draft, *later = [c for c in calls if c.service == "draft"]
    assert result.stats.tokens_per_round[0] == 1 and result.stats.draft_tokens > 0
    assert all(c.start >= first_draft.end for c in later)  # one call at a time
    assert draft.calls == len(later) + 1
    if shared:  # the draft's first call (its prefill) after the target's prefill
        assert first_draft.start >= first_verify.end and first_draft.tokens == 3
    else:
        assert first_draft.tokens == 1 and first_draft.start < first_verify.end
        assert later


def test_eos_ends_the_generation_where_the_target_emits_it():
    for mode in ("target-only", "spec", "pipelined"):
        result = generate(mode, 3, target=FakeTarget(eos_after=9))
        assert result.finish_reason == "stop"
        assert result.token_ids == target_text([5, 11, 23], 9) + [EOS], mode


def test_a_failing_draft_costs_speed_not_tokens():
    draft = FakeDraft(fail_calls={2, 3})
    result = generate("spec", 2, draft=draft)
    assert result.token_ids == target_text([5, 11, 23], 40)
    assert result.stats.draft_failures == 2
    # each failed round's token and those the target decoded on after it
    assert result.stats.tokens_without_draft == 2 * (1 + DECODE_ON)
    assert draft.failed  # a service failure (not the request's fault) marks the draft down


def test_the_length_limit_holds_inside_an_accepted_block():
    result = generate("spec", 4, max_new=7)
    assert result.token_ids == target_text([5, 11, 23], 7)
    assert result.finish_reason == "length"


def test_adaptive_k_starts_from_what_earlier_generations_accepted_while_others_run():
    """A greedy generation that starts while others run starts from the orchestrator's
    pooled acceptance; alone, or rejection-sampled (k changes its text), from the fixed
    prior, whatever ran before."""
    target, draft = FakeTarget(), FakeDraft(wrong_every=1)  # never right: nothing accepted
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)

    def req(k=None, **kw):
        return GenerationRequest([5, 11, 23], 40, SamplingParams(**kw), [], "spec", k,
                                 prompt_lookup=False)

    assert orch._controller(req()).acceptance == 0.5
    result = asyncio.run(orch.generate(req(k=2)))  # a fixed k teaches the pool too
    assert result.token_ids == target_text([5, 11, 23], 40) and result.stats.accepted_tokens == 0
    assert orch.active == 0 and orch._controller(req()).acceptance == 0.5  # alone
    orch.active = 1  # as while another generation runs
    assert orch._controller(req()).acceptance < 0.1
    sampled = orch._controller(req(temperature=0.8, seed=3, rule="rejection"))
    assert sampled.acceptance == 0.5 and sampled.pool is None
    # A draft better than the prior: alone too, a new generation starts from what it accepted
    orch.active = 0
    good = Orchestrator(target, FakeDraft(wrong_every=10 ** 9), FakeTokenizer(), [EOS],
                        max_context=1024)
    stats = asyncio.run(good.generate(req(k=2))).stats
    assert stats.accepted_tokens == stats.draft_tokens > 20
    assert good.active == 0 and good._controller(req()).acceptance > 0.9


def test_a_prompt_lookup_takes_a_round_only_where_it_beats_the_draft_models_block():
    """A prompt that repeats itself offers a lookup block at its first round. Over a draft
    that has been right every time (pooled acceptance ~1: its block of 8 beats a lookup at
    its prior), the draft drafts; over a draft that is never right, the lookup takes it."""
    prompt = [1, 2, 3, 4] * 5
    seen = {}
    for name, wrong_every in (("perfect", 10 ** 9), ("never right", 1)):
        target, draft = FakeTarget(), FakeDraft(wrong_every=wrong_every)
        orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
        for p, lookup in (([5, 11, 23], False), (prompt, True)):  # the first fills the pool
            target.prompt_len = len(p)
            req = GenerationRequest(list(p), 24, SamplingParams(), [], "spec", None,
                                    prompt_lookup=lookup)
            result = asyncio.run(orch.generate(req))
            assert result.token_ids == target_text(p, 24)
        seen[name] = result.stats.lookup_rounds
    assert seen["perfect"] == 0
    assert seen["never right"] >= 1
