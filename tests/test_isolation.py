"""One request's mistakes stay its own, and what a server keeps does not grow per request."""

import hmac

import pytest
from conftest import run

from orchestrator.generation import GenerationRequest, GenerationStats
from orchestrator.http.middleware import api_key_matches
from orchestrator.pair import close, connect
from orchestrator.service_clients import History
from specdec.config import MAX_K, ServiceConfig
from specdec.serving.runtime import DraftRuntime, ServiceInfo
from specdec.serving.session import Session

PROMPT = [1, 520, 3300, 12, 99, 7]


def test_pipelined_at_the_largest_k_keeps_the_draft_up(tiny_services):
    """The speculative call drafts k + 1 tokens; at k = MAX_K it used to ask for MAX_K + 1, the
    draft refused, and the shared draft client was marked down for every generation."""
    async def go():
        orch = await connect(tiny_services["target"].address,
                             tiny_services["near_draft"].address)
        try:
            result = await orch.generate(
                GenerationRequest(PROMPT, MAX_K + 8, mode="pipelined", k=MAX_K))
            assert result.stats.draft_failures == 0
            assert not orch.draft.down
            assert result.stats.draft_tokens > 0
            assert len(result.token_ids) == MAX_K + 8
            assert orch.draft._tickets == {}, "per-session tickets outlived their generations"
        finally:
            await close(orch)

    run(go())


def test_a_call_the_draft_refuses_as_invalid_does_not_take_the_draft_away(tiny_services):
    async def go():
        orch = await connect(tiny_services["target"].address, tiny_services["draft"].address)
        try:
            vocab = orch.draft.info.vocab_size
            req = GenerationRequest(PROMPT, 4)
            stats = GenerationStats()
            block = await orch._draft("bad-call", History([vocab + 3]), [], 2, req, stats)
            assert block is None and stats.draft_failures == 1  # this round goes without
            assert not orch.draft.down  # ... but every other generation keeps the draft
            result = await orch.generate(GenerationRequest(PROMPT, 12, mode="spec", k=2))
            assert result.stats.draft_tokens > 0 and result.stats.draft_failures == 0
        finally:
            await close(orch)

    run(go())


def test_the_draft_client_forgets_a_session_when_it_closes(tiny_services):
    async def go():
        orch = await connect(tiny_services["target"].address, tiny_services["draft"].address)
        try:
            for _ in range(3):
                await orch.generate(GenerationRequest(PROMPT, 6, mode="spec", k=2))
            assert orch.draft._tickets == {} and orch.draft.known == {}
        finally:
            await close(orch)

    run(go())


class _Cache:
    nbytes = 100
    length = 0

    def truncate(self, n):
        self.length = min(self.length, n)


def test_a_stats_scrape_never_evicts_a_session():
    """GetStats runs on the gRPC thread; evicting there could drop a session mid-pass."""
    config = ServiceConfig(model="ngram", role="draft", cache_cap_mb=1, max_sessions=2,
                           calibrate=False)
    info = ServiceInfo("ngram", "draft", "fp", 100, 512, [], [], drafter="ngram")
    rt = DraftRuntime(config, info, None)
    for sid in "abcd":  # over max_sessions, as between two passes
        rt.store.put(Session(sid, _Cache()))
    stats = rt.stats()
    assert stats["sessions"] == 4 and stats["evictions"] == 0
    assert sorted(rt.store.ids()) == list("abcd")


@pytest.mark.parametrize("header, ok", [
    ("Bearer KEY", True), ("bearer KEY", True), ("BEARER KEY", True), ("  Bearer   KEY ", True),
    (b"Bearer KEY", True), ("Bearer KEY2", False), ("Bearer", False), ("Basic KEY", False),
    ("KEY", False), ("", False), (None, False), ("Bearer key", False),
])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(header, ok):
    assert api_key_matches(header, "KEY") is ok


def test_api_key_comparison_is_constant_time(monkeypatch):
    seen = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    assert api_key_matches("Bearer KEY", "KEY")
    assert seen, "the key must be compared with hmac.compare_digest"
