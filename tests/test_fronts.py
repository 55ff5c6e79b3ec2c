"""The HTTP fronts over real services: every pair is watched, both fronts parse requests alike,
and an oversized request is refused before it can hold the server up."""

import asyncio
import json
import threading

import httpx
from conftest import ServiceThread, run

from orchestrator.http.app import create_app
from orchestrator.http.native import native_routes
from orchestrator.pair import close, connect
from orchestrator.routing import PairRouter

MODEL = "specdec"


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_health_and_metrics_watch_every_pair_not_only_the_first(tiny_models, tiny_services):
    second = ServiceThread("target", tiny_models["target"])

    async def go():
        pairs = [await connect(tiny_services["target"].address, tiny_services["draft"].address),
                 await connect(second.address, None)]
        router = PairRouter(pairs)
        try:
            async with _client(create_app(router, MODEL)) as http:
                assert (await http.get("/health")).status_code == 200
                await asyncio.get_running_loop().run_in_executor(None, second.stop)
                resp = await http.get("/health")
                assert resp.status_code == 503
                assert "pair-1/target" in resp.json()["error"]
                assert "pair-0/target" not in resp.json()["error"]
                text = (await http.get("/metrics")).text
                assert 'specdec:service_up{model_name="specdec",service="pair-1/target"} 0.0' in text
                assert 'specdec:service_up{model_name="specdec",service="pair-0/target"} 1.0' in text
                assert 'specdec:service_up{model_name="specdec",service="pair-0/draft"} 1.0' in text
        finally:
            for p in pairs:
                await close(p)

    run(go())


def test_the_native_route_gives_an_unseeded_request_a_fresh_seed(tiny_services):
    async def go():
        router = PairRouter([await connect(tiny_services["target"].address,
                                           tiny_services["draft"].address)])
        app = create_app(router, MODEL)
        app.include_router(native_routes(app.state.front))
        body = dict(prompt_ids=[1, 520, 3300, 12], max_new_tokens=12, temperature=1.0,
                    mode="spec")
        try:
            async with _client(app) as http:
                unseeded = [(await http.post("/generate", json=body)).json()["token_ids"]
                            for _ in range(2)]
                seeded = [(await http.post("/generate", json={**body, "seed": 5})).json()[
                    "token_ids"] for _ in range(2)]
        finally:
            await close(router.pairs[0])
        assert unseeded[0] != unseeded[1]  # as on the OpenAI routes: no seed, a fresh draw
        assert seeded[0] == seeded[1]

    run(go())


def test_an_oversized_body_gets_413_and_the_server_keeps_serving(tiny_services):
    async def go():
        orch = await connect(tiny_services["target"].address, None)
        app = create_app(orch, MODEL)
        big = json.dumps({"model": MODEL, "prompt": "x" * (3 * 1024 * 1024), "max_tokens": 1})

        async def chunks():  # no Content-Length: the limit must hold for a streamed body too
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536].encode()

        try:
            async with _client(app) as http:
                for content in (big, chunks()):
                    resp = await http.post("/v1/completions", content=content,
                                           headers={"content-type": "application/json"})
                    assert resp.status_code == 413
                    assert resp.json()["error"]["code"] == "request_too_large"
                assert (await http.get("/health")).status_code == 200
                ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                              "max_tokens": 3})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        finally:
            await close(orch)

    run(go())


def test_prompts_are_tokenized_off_the_event_loop(tiny_services, monkeypatch):
    from orchestrator.http.requests import RequestBuilder

    seen = []
    for name in ("chat_prompt", "completion_prompt"):
        real = getattr(RequestBuilder, name)

        def spy(self, *args, real=real):  # (chat_prompt also takes the body's structure)
            seen.append(threading.current_thread())
            return real(self, *args)

        monkeypatch.setattr(RequestBuilder, name, spy)

    async def go():
        orch = await connect(tiny_services["target"].address, None)
        loop_thread = threading.current_thread()
        try:
            async with _client(create_app(orch, MODEL)) as http:
                r1 = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                              "max_tokens": 2})
                r2 = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2})
        finally:
            await close(orch)
        assert r1.status_code == 200 and r2.status_code == 200
        assert len(seen) == 2 and all(t is not loop_thread for t in seen)

    run(go())
