"""PairRouter over real draft/target pairs (tiny models on loopback): a generation stays on one
pair, least-loaded routing avoids a busy pair, an early close frees the pair and its sessions."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, run

from orchestrator.generation import GenerationRequest, GenerationResult
from orchestrator.pair import close, connect
from orchestrator.routing import PairRouter, rendezvous

PROMPTS = [[1, 520, 3300, 12, 99, 7], list(range(2000, 2030))]


async def two_pairs(services, tiny_models):
    """Two Orchestrators (own channels each) over the tiny target and two different drafts."""
    target = services["target"].address
    return [await connect(target, services[d].address, tokenizer_spec=tiny_models["target"])
            for d in ("draft", "self_draft")]


def test_least_loaded_avoids_the_busy_pair_and_early_close_frees_it(tiny_models, tiny_services):
    async def body():
        pairs = await two_pairs(tiny_services, tiny_models)
        router = PairRouter(pairs)
        target = pairs[0].target
        try:
            sessions_before = (await target.stats()).sessions
            busy_stream = router.stream(GenerationRequest(PROMPTS[0], 40, mode="spec", k=2))
            first = await anext(busy_stream)  # that generation is now in flight on one pair
            assert not isinstance(first, GenerationResult)
            busy = router.in_flight.index(1)
            assert router.in_flight[1 - busy] == 0
            # Whatever its key hashes to, the next generation goes to the idle pair.
            for key in ("a", "b", "c", "d"):
                result, i = await router.generate_on_pair(
                    GenerationRequest(PROMPTS[1], 12, mode="spec", k=2), session_key=key)
                assert i == 1 - busy
                assert result.token_ids == hf_greedy(tiny_models["target"], PROMPTS[1], 12)[
                    : len(result.token_ids)]
            # Closing the stream early ends its generation at once and releases its sessions.
            await busy_stream.aclose()
            assert router.in_flight == [0, 0]
            assert router.served[busy] == 1 and router.served[1 - busy] == 4
            assert (await target.stats()).sessions == sessions_before
        finally:
            for orch in pairs:
                await close(orch)

    run(body())


def test_hash_routing_keeps_a_key_on_one_pair_under_load(tiny_models, tiny_services):
    async def body():
        pairs = await two_pairs(tiny_services, tiny_models)
        router = PairRouter(pairs, policy="hash")
        try:
            # An Orchestrator's other attributes come from the first pair.
            assert router.tokenizer is pairs[0].tokenizer
            assert router.max_context == pairs[0].max_context
            keys = [f"user-{i}" for i in range(8)]
            assert {rendezvous(k, 2) for k in keys} == {0, 1}
            router.in_flight[0] = 5  # heavy load on pair 0 does not move a hashed key
            for key in keys:
                result, i = await router.generate_on_pair(
                    GenerationRequest(PROMPTS[0], 6, mode="pipelined"), session_key=key)
                assert i == rendezvous(key, 2)
                assert result.token_ids == hf_greedy(tiny_models["target"], PROMPTS[0], 6)[
                    : len(result.token_ids)]
            router.in_flight[0] = 0
        finally:
            for orch in pairs:
                await close(orch)

    run(body())


def test_router_refuses_bad_settings():
    with pytest.raises(ValueError, match="at least one"):
        PairRouter([])
    with pytest.raises(ValueError, match="routing"):
        PairRouter([object()], policy="random")
