"""The HTTP front over real tiny services, as a service: /metrics, disconnects that must free
the services' sessions, and other pairs (the draft is the target; the target goes away)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from conftest import (
    ApiHost,
    CHAT,
    MODEL,
    MSGS,
    PROMPT,
    PROMPTS,
    ServiceThread,
    chat_ids,
    delta,
    reference,
    scrape,
    wait_for,
)

from orchestrator.http.schemas import ServeDefaults
from orchestrator.http_client import ServerError, SpecdecClient


# ---- metrics -----------------------------------------------------------------------------

def test_metrics_move_by_exactly_what_was_generated(host, tiny_services):
    url = host.serve()  # a fresh app: its own registry
    before = scrape(url)
    with SpecdecClient(url, model=MODEL) as client:
        results = [client.chat(PROMPTS[0], max_tokens=30, temperature=0, k=3)]
        chunks = list(client.stream_complete(PROMPTS[1], max_tokens=25, temperature=0))
    usage = chunks[-1].usage
    stats = [results[0].specdec, next(c.specdec for c in chunks if c.specdec)]
    finish = [results[0].finish_reason, next(c.finish_reason for c in chunks if c.finish_reason)]
    after = scrape(url)

    def d(name, **labels):
        return delta(after, before, "specdec:" + name, **labels)

    assert d("generation_tokens_total") == results[0].usage.completion_tokens + \
        usage.completion_tokens
    assert d("prompt_tokens_total") == results[0].usage.prompt_tokens + usage.prompt_tokens
    assert d("spec_decode_num_draft_tokens_total") == sum(s.draft_tokens for s in stats)
    assert d("spec_decode_num_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
    assert d("spec_decode_num_drafts_total") == sum(s.num_drafts for s in stats) > 0
    assert sum(s.draft_tokens for s in stats) > sum(s.accepted_tokens for s in stats)
    positions = max(len(s.accepted_per_position) for s in stats)
    for pos in range(positions):
        expected = sum(s.accepted_per_position[pos] for s in stats
                       if pos < len(s.accepted_per_position))
        assert d("spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == expected
    for reason in ("stop", "length"):
        assert d("request_success_total", finished_reason=reason) == finish.count(reason)
    assert d("time_to_first_token_seconds_count") == 2
    assert d("e2e_request_latency_seconds_count") == 2
    assert d("round_time_seconds_count") == sum(s.rounds - 1 for s in stats)
    assert after[("specdec:num_requests_running", ())] == 0
    for service in ("target", "draft"):
        assert after[("specdec:service_up", (("service", service),))] == 1
        assert after[("specdec:service_cache_cap_bytes", (("service", service),))] > 0
        assert ("specdec:service_sessions", (("service", service),)) in after
        assert ("specdec:service_cache_bytes", (("service", service),)) in after


# ---- cancellation ------------------------------------------------------------------------

def _sessions(tiny_services) -> tuple[int, int]:
    return len(tiny_services["target"].runtime.store), len(tiny_services["draft"].runtime.store)


def _long_chat(host) -> dict:
    """A chat body that takes the whole context (it cannot finish before we leave), with a
    fixed k so that the draft holds a session too (adaptive k may stop drafting)."""
    room = host.orch.max_context - len(chat_ids(host.orch.tokenizer, PROMPT))
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": room, "temperature": 0, "specdec_mode": "pipelined", "specdec_k": 3}


def test_disconnect_mid_stream_cancels_and_frees_sessions(host, api, tiny_services):
    wait_for(lambda: _sessions(tiny_services) == (0, 0), what="idle services")
    before = scrape(api)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", api + CHAT, json={**_long_chat(host), "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and '"content":"' in line and \
                        '"content":""' not in line:
                    break  # text is flowing: the generation holds sessions on both services
            # (the draft's session opens with the call behind round 1: soon, not at once)
            wait_for(lambda: _sessions(tiny_services) == (1, 1), 30, what="both sessions")
        # leaving the block closes the connection mid-stream
    wait_for(lambda: _sessions(tiny_services) == (0, 0), what="sessions to be freed")
    wait_for(lambda: scrape(api)[("specdec:num_requests_running", ())] == 0, what="idle front")
    after = scrape(api)
    assert delta(after, before, "specdec:request_success_total", finished_reason="abort") == 1
    assert delta(after, before, "specdec:request_success_total", finished_reason="length") == 0
    with SpecdecClient(api, model=MODEL) as client:  # still serving
        assert client.chat(PROMPT, max_tokens=4).usage.completion_tokens > 0


def test_disconnect_during_non_streamed_request_cancels_it(host, api, tiny_services):
    wait_for(lambda: _sessions(tiny_services) == (0, 0), what="idle services")
    before = scrape(api)
    body = json.dumps(_long_chat(host)).encode()
    port = int(api.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: scrape(api)[("specdec:num_requests_running", ())] == 1,
                 what="the generation to start")
        # the client gives up: the connection closes without reading the answer
    wait_for(lambda: _sessions(tiny_services) == (0, 0), what="sessions to be freed")
    wait_for(lambda: scrape(api)[("specdec:num_requests_running", ())] == 0, what="idle front")
    after = scrape(api)
    assert delta(after, before, "specdec:request_success_total", finished_reason="abort") == 1


# ---- other pairs: the draft is the target; the target goes away ---------------------------

def test_self_draft_accepts_everything_through_the_api(tiny_services, tiny_models, tok):
    h = ApiHost(tiny_services["target"].address, tiny_services["self_draft"].address)
    try:
        # the draft model alone: prompt-lookup blocks are not the target's own guesses
        url = h.serve(defaults=ServeDefaults(prompt_lookup=False))
        ref_text, ref_ids = reference(tiny_models, tok, chat_ids(tok, PROMPTS[2]), 24)
        with SpecdecClient(url, model=MODEL) as client:
            for mode, k in (("spec", 4), ("pipelined", None), ("target-only", None)):
                r = client.chat(PROMPTS[2], max_tokens=24, temperature=0, mode=mode, k=k)
                assert r.text == ref_text and r.usage.completion_tokens == len(ref_ids)
                assert r.specdec.mode == mode
                if mode == "target-only":
                    assert r.specdec.draft_tokens == 0
                else:
                    assert r.specdec.acceptance_rate == 1.0 and r.specdec.draft_tokens > 0
    finally:
        h.stop()


def test_target_down_gives_503_and_the_client_reports_it(tiny_models):
    target = ServiceThread("target", tiny_models["target"])
    h = ApiHost(target.address, None)
    try:
        url = h.serve()
        with SpecdecClient(url, model=MODEL) as client:
            assert client.health()
            assert client.chat(PROMPT, max_tokens=3).usage.completion_tokens > 0
        target.stop()
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["message"]
        with SpecdecClient(url, model=MODEL, max_retries=1, backoff_s=0.01) as client:
            with pytest.raises(ServerError) as err:
                client.chat(PROMPT, max_tokens=3)
            assert err.value.status_code == 503
            # streamed: the status is 200 before the failure, so it arrives as an error event
            with pytest.raises(ServerError) as err:
                list(client.stream_chat(PROMPT, max_tokens=3))
            assert err.value.status_code is None and "target" in err.value.message
            assert not client.health()
    finally:
        h.stop()
        if target.thread.is_alive():
            target.stop()
