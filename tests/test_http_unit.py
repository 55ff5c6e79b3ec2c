"""The HTTP layer over a fake backend: what a body turns into (defaults, validation, choices),
the response and stream shapes, and error mapping, without services. (test_api and
test_api_real run the same routes over real services and the real pair.)"""

import asyncio
import json

import grpc
import httpx
import pytest
from conftest import run

from orchestrator.generation import Delta, GenerationResult, GenerationStats, TokenLogprob
from orchestrator.http.app import create_app
from orchestrator.http.native import native_routes
from orchestrator.http.schemas import ServeDefaults
from orchestrator.service_clients import ServiceError
from specdec.models.hub import load_tokenizer

MODEL = "fake"


class FakeBackend:
    """Answers every request with tokens derived from its seed, recording the requests."""

    def __init__(self, tokenizer, max_context: int = 64, fail: Exception | None = None):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.fail = fail
        self.seen = []
        self.labels = ["fake-pair"]

    def service_clients(self) -> dict:
        return {}

    def describe(self) -> list[dict]:
        return [{"pair": 0}]

    async def stream(self, req):
        self.seen.append(req)
        if self.fail is not None:
            raise self.fail
        ids = [1000 + (req.sampling.seed + i) % 500 for i in range(req.max_new_tokens)]
        for tok in ids:
            await asyncio.sleep(0)
            lp = [TokenLogprob(tok, -0.25, [(tok, -0.25)])] if req.logprobs is not None else []
            yield Delta(self.tokenizer.decode([tok]), [tok], lp)
        logprobs = [TokenLogprob(t, -0.25, [(t, -0.25)]) for t in ids] \
            if req.logprobs is not None else []
        yield GenerationResult(req.request_id, ids, self.tokenizer.decode(ids), "length",
                               len(req.prompt_ids), GenerationStats(mode=req.mode), logprobs)

    async def generate_on_pair(self, req, session):
        result = None
        async for item in self.stream(req):
            result = item
        return result, 0


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def call(backend, method, path, **kw):
    app = create_app(backend, MODEL, defaults=kw.pop("defaults", None))
    app.include_router(native_routes(app.state.front))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            return await http.request(method, path, **kw)

    return run(go())


def test_a_body_and_the_server_defaults_make_the_generation_request(tokenizer):
    backend = FakeBackend(tokenizer)
    defaults = ServeDefaults(max_tokens=5, temperature=0.3, mode="spec", k=2, stop=["zz"])
    r = call(backend, "POST", "/v1/completions", defaults=defaults,
             json={"model": MODEL, "prompt": "Hello", "top_k": -1, "seed": 9})
    assert r.status_code == 200, r.text
    (req,) = backend.seen
    assert req.prompt_ids == tokenizer("Hello")["input_ids"]
    assert (req.max_new_tokens, req.mode, req.k, req.stop) == (5, "spec", 2, ["zz"])
    assert (req.sampling.temperature, req.sampling.top_k, req.sampling.seed) == (0.3, 0, 9)
    r = call(backend, "POST", "/v1/completions", defaults=defaults,
             json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
                   "stop": "x", "specdec_mode": "pipelined", "specdec_k": 0})
    req = backend.seen[-1]
    assert (req.prompt_ids, req.max_new_tokens, req.stop, req.mode, req.k) == (
        [1, 2, 3], 3, ["x"], "pipelined", 0)
    assert req.sampling.greedy
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_n_choices_are_independently_seeded_generations(tokenizer):
    backend = FakeBackend(tokenizer)
    r = call(backend, "POST", "/v1/chat/completions",
             json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3,
                   "seed": 40, "max_tokens": 2, "temperature": 1.0})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [q.sampling.seed for q in backend.seen] == [40, 41, 42]
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    assert body["usage"]["completion_tokens"] == 6
    assert isinstance(body["specdec"], list) and len(body["specdec"]) == 3


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"specdec_mode": "warp"}, "specdec_mode"),
    ({"specdec_rule": "guess"}, "specdec_rule"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"prompt": [1, 10 ** 9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": "other"}, "model"),
    ({"echo": True, "stream": True}, "echo"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_a_bad_field_gets_400_naming_it_and_never_reaches_the_backend(tokenizer, body, param):
    backend = FakeBackend(tokenizer)
    r = call(backend, "POST", "/v1/completions",
             json={"model": MODEL, "prompt": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.seen == []


def test_a_stream_carries_the_text_logprobs_usage_and_done(tokenizer):
    backend = FakeBackend(tokenizer)
    r = call(backend, "POST", "/v1/completions",
             json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "seed": 3, "stream": True,
                   "logprobs": 1, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [1000 + (3 + i) % 500 for i in range(4)]
    assert text == tokenizer.decode(ids)
    lps = [lp for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
           for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == [-0.25] * 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "specdec" in chunks[-2]


@pytest.mark.parametrize("fail, status, code", [
    (ServiceError("target", grpc.StatusCode.UNAVAILABLE, "gone"), 503, "unavailable"),
    (ServiceError("target", grpc.StatusCode.INVALID_ARGUMENT, "bad"), 500, "invalid_argument"),
    (ValueError("prompt too long for the draft"), 400, None),
])
def test_backend_failures_map_to_http_errors(tokenizer, fail, status, code):
    r = call(FakeBackend(tokenizer, fail=fail), "POST", "/v1/completions",
             json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


def test_the_native_route_shares_the_request_model(tokenizer):
    backend = FakeBackend(tokenizer)
    defaults = ServeDefaults(max_tokens=4)
    r = call(backend, "POST", "/generate", defaults=defaults,
             json={"prompt": "Hi", "chat": True, "max_new_tokens": 3, "mode": "spec", "k": 1,
                   "temperature": 0.5, "seed": 2, "rule": "rejection"})
    assert r.status_code == 200, r.text
    req = backend.seen[-1]
    assert (req.max_new_tokens, req.mode, req.k) == (3, "spec", 1)
    assert (req.sampling.temperature, req.sampling.seed, req.sampling.rule) == (0.5, 2,
                                                                                "rejection")
    assert req.prompt_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    assert r.json()["pair"] == "fake-pair"
    # defaults from the server, as on the OpenAI routes
    call(backend, "POST", "/generate", defaults=defaults, json={"prompt_ids": [1, 2]})
    assert backend.seen[-1].max_new_tokens == 4
    for bad, param in (({"prompt_ids": [1], "mode": "warp"}, "mode"),
                       ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
                       ({"max_new_tokens": 2}, "prompt"),
                       ({"prompt_ids": [1], "temperature": -2}, "temperature"),
                       ({"prompt_ids": [1], "stream": True}, "stream"),
                       ({"prompt_ids": [1], "unknown": 1}, "unknown")):
        r = call(backend, "POST", "/generate", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param, (bad, r.json())


@pytest.mark.parametrize("attempt, failure, retry", [
    (0, 503, True), (0, 429, True), (0, 502, True), (0, 504, True),
    (0, 500, False), (0, 400, False), (0, 401, False),
    (0, httpx.ConnectError("refused"), True), (1, httpx.ConnectTimeout("slow"), True),
    (0, httpx.PoolTimeout("busy"), True),
    (0, httpx.ReadTimeout("the server may have started on it"), False),
    (0, httpx.RemoteProtocolError("broken"), False),
    (3, 503, False), (3, httpx.ConnectError("refused"), False),  # retries spent
])
def test_the_python_clients_retry_decision(attempt, failure, retry):
    from orchestrator.http_client import should_retry

    assert should_retry(attempt, 3, failure) is retry
