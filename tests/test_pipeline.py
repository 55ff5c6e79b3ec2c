"""Pipelined speculation: exact under sampling, seeded, and adaptive k that follows acceptance."""

import collections

import pytest
import torch
from conftest import generate_on, run

from orchestrator import rating
from orchestrator.adaptive import KController, expected_tokens
from specdec.config import SamplingParams
from specdec.serving.sampling import process_logits

SAMPLING = dict(temperature=0.7, top_k=4)
PROMPT = [1, 520, 3300, 12, 99, 7]


def exact_joint(model_dir: str, prompt: list[int], params: SamplingParams) -> dict:
    """The target's own distribution of its first two sampled tokens, from its logits."""
    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    with torch.no_grad():
        p1 = process_logits(model(torch.tensor([prompt])).logits[0, -1], params)
        joint = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = process_logits(model(torch.tensor([prompt + [t1]])).logits[0, -1], params)
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


async def _sample_many(services, mode, n):
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    orch = await connect(services["target"].address, services["near_draft"].address)
    try:
        out = []
        for seed in range(n):
            req = GenerationRequest(PROMPT, 3, SamplingParams(seed=seed, **SAMPLING), [], mode, 2)
            out.append(await orch.generate(req))
        return out
    finally:
        await close(orch)


@pytest.mark.parametrize("mode", ["pipelined", "spec"])
def test_sampling_keeps_the_target_distribution(tiny_models, tiny_services, mode):
    joint = exact_joint(tiny_models["target"], PROMPT, SamplingParams(**SAMPLING))
    n = 600
    results = run(_sample_many(tiny_services, mode, n))
    counts = collections.Counter(tuple(r.token_ids[:2]) for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    tv = 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items())
    tv += 0.5 * sum(c / n for o, c in counts.items() if o not in joint)
    assert all(o in joint for o in counts)  # never a pair the target cannot produce
    # ~3.5 standard deviations of the TV of n samples over len(joint) outcomes
    assert tv < 0.9 * (len(joint) / n) ** 0.5, tv
    assert 0.1 * drafted < accepted < 0.95 * drafted  # both acceptances and rejections


def test_the_draft_distribution_alone_would_fail_that_bound(tiny_models):
    """The bound above is tight enough to catch a rule that passed the draft's samples through."""
    target = exact_joint(tiny_models["target"], PROMPT, SamplingParams(**SAMPLING))
    draft = exact_joint(tiny_models["near_draft"], PROMPT, SamplingParams(**SAMPLING))
    tv = 0.5 * sum(abs(target.get(o, 0) - draft.get(o, 0)) for o in set(target) | set(draft))
    assert tv > 2 * 0.9 * (len(target) / 600) ** 0.5, tv


def test_same_seed_same_text(tiny_services):
    params = SamplingParams(temperature=1.0, seed=1234)
    a = run(generate_on(tiny_services, "draft", PROMPT, "pipelined", 3, max_new=24, sampling=params))
    b = run(generate_on(tiny_services, "draft", PROMPT, "pipelined", 3, max_new=24, sampling=params))
    c = run(generate_on(tiny_services, "draft", PROMPT, "pipelined", 3, max_new=24,
                      sampling=SamplingParams(temperature=1.0, seed=99)))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_k_controller_rises_with_a_perfect_draft_and_falls_with_a_random_one():
    target_ms = [50, 55, 58, 60, 63, 66, 70, 74, 78]  # T(m) for m = 1..9
    good = KController(target_ms, [4.0])
    for _ in range(30):
        k = good.next_k()
        good.observe(k, k)
    assert good.next_k() == 8 and good.acceptance > 0.9
    bad = KController(target_ms, [4.0])
    for _ in range(30):
        k = bad.next_k()
        bad.observe(k, 0)
    assert bad.next_k() == 0 and bad.acceptance < 0.2
    # while at k = 0 it still probes now and then, so a draft that got better is noticed
    probes = []
    for _ in range(40):
        k = bad.next_k()
        probes.append(k)
        bad.observe(k, 0)
    assert probes.count(0) > 30 and 2 in probes
    # never speculates when a draft step costs as much as the target
    assert KController(target_ms, [50.0], prior_a=0.3).next_k() == 0


def test_k_controller_maximises_expected_rate():
    ctl = KController([50, 55, 58, 60, 63, 66, 70, 74, 78], [5.0])
    for a in (0.2, 0.5, 0.8):
        best = ctl.best_k(a)
        rates = [expected_tokens(a, k) / rating.round_ms(ctl.snapshot(a), k) for k in range(9)]
        assert rates[best] == max(rates)


async def _generate_with_costs(services, draft_key, prompt, target_ms, draft_ms, max_new=80):
    """Generate with adaptive k, the services' start-up costs replaced by fixed figures so the
    test does not depend on how busy the machine was when the services calibrated."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    orch = await connect(services["target"].address, services[draft_key].address)
    try:
        orch.target.info.forward_ms[:] = target_ms
        orch.draft.info.forward_ms[:] = draft_ms
        orch.live_costs = None  # these figures, not the tiny services' live costs
        # the draft service's blocks only: k is learnt from them (lookup blocks bypass it)
        return await orch.generate(GenerationRequest(prompt, max_new, mode="spec", k=None,
                                                     prompt_lookup=False))
    finally:
        await close(orch)


TARGET_MS = [50, 55, 58, 60, 63, 66, 70, 74, 78]  # T(m), m = 1..9, as measured on this CPU


def test_adaptive_k_through_the_services(tiny_services):
    # The tiny target falls into loops on this prompt: the free n-gram drafter then predicts
    # them perfectly, and k climbs.
    looping = run(_generate_with_costs(tiny_services, "ngram", [5, 6, 7, 8] * 10, TARGET_MS, [0.0]))
    ks = looping.stats.k_requested
    assert ks[0] <= 5 and max(ks) == 8, ks  # climbs from the prior to the maximum
    # A draft that disagrees with the target: k falls to 0 (with a probe now and then).
    bad = run(_generate_with_costs(tiny_services, "draft", PROMPT, TARGET_MS, [5.0]))
    assert bad.stats.rounds_per_k.get(0, 0) > bad.stats.rounds / 2  # mostly target-only
    assert bad.stats.acceptance_rate < 0.3


def test_prompt_lookup_blocks_are_verified_like_any_draft(tiny_services):
    """A prompt whose text repeats: lookup proposes blocks, output equals target-only's."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    prompt = [5, 6, 7, 8, 9] * 8

    async def go():
        orch = await connect(tiny_services["target"].address, tiny_services["draft"].address)
        try:
            ref = await orch.generate(GenerationRequest(prompt, 40, mode="target-only"))
            out = {}
            for mode in ("spec", "pipelined"):
                for lookup in (True, False):
                    out[mode, lookup] = await orch.generate(
                        GenerationRequest(prompt, 40, mode=mode, prompt_lookup=lookup))
            return ref, out
        finally:
            await close(orch)

    ref, out = run(go())
    for key, result in out.items():
        assert result.token_ids == ref.token_ids, key
    for mode in ("spec", "pipelined"):
        assert out[mode, True].stats.lookup_rounds > 0
        assert out[mode, False].stats.lookup_rounds == 0
    assert ref.stats.lookup_rounds == 0  # the baseline never drafts
