"""The HTTP front over real tiny services: the real openai package, specdec's own client,
bad requests, the API key, /metrics, and disconnects that must free the services' sessions."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from conftest import ApiHost, MODEL, ServiceThread, free_port, hf_greedy, run, scrape
from starlette.responses import JSONResponse, Response

from orchestrator.http.schemas import ServeDefaults
from orchestrator.http_client import (
    AsyncSpecdecClient,
    AuthenticationError,
    BadRequestError,
    ServerError,
    SpecdecClient,
    SpecdecConnectionError,
)
from specdec.models.hub import load_tokenizer

PROMPT = "What is the capital of France?"
PROMPTS = [PROMPT, "Write a short poem about the sea.", "List three fruits."]


@pytest.fixture(scope="module")
def host(tiny_services):
    """Pipelined over the tiny target and a disagreeing draft: rejections and rollbacks."""
    h = ApiHost(tiny_services["target"].address, tiny_services["draft"].address)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def api(host) -> str:
    return host.serve()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def chat_ids(tok, content: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(tiny_models, tok, prompt_ids: list[int], n: int) -> tuple[str, list[int]]:
    """Target-only greedy text and ids from transformers (stops after EOS)."""
    ids = hf_greedy(tiny_models["target"], prompt_ids, n)
    return tok.decode(ids, skip_special_tokens=True), ids


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- the openai package ------------------------------------------------------------------

def test_openai_chat_and_completion_greedy_equal_target_only(api, tiny_models, tok):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS[:2]:
        ids = chat_ids(tok, prompt)
        ref_text, ref_ids = reference(tiny_models, tok, ids, 24)
        r = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": prompt}])
        assert r.choices[0].message.content == ref_text
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(ref_ids)
        assert r.usage.total_tokens == len(ids) + len(ref_ids)
        assert r.choices[0].finish_reason == ("length" if len(ref_ids) == 24 else "stop")
        spec = r.model_extra["specdec"]
        assert spec["mode"] == "pipelined" and spec["rounds"] > 0
        assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0

    ids = tok(PROMPT)["input_ids"]
    ref_text, ref_ids = reference(tiny_models, tok, ids, 20)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref_text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref_ids))
    # token ids as the prompt give the same completion
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == ref_text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_openai_streaming_with_usage(api, tiny_models, tok):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    ids = chat_ids(tok, PROMPTS[1])
    ref_text, ref_ids = reference(tiny_models, tok, ids, 30)
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPTS[1]}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["specdec"]["rounds"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    # completions stream without usage: no usage chunk at all
    ids = tok(PROMPTS[2])["input_ids"]
    ref_text, _ = reference(tiny_models, tok, ids, 16)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref_text
    assert all(c.usage is None for c in chunks)


def test_sampling_options_pass_through(api, tiny_models, tok):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]

    def ask(**kw):  # a fixed k: the sampled text depends on the seed and the blocks drafted
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                              extra_body={"specdec_k": 2}, **kw)

    # seeded sampling is deterministic; another seed (almost surely) differs
    a, b = ask(temperature=1.0, top_p=0.9, seed=7), ask(temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    texts = {ask(temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(texts) > 1
    # the coupled rule (default): the same seed gives the same text at any k and mode
    coupled = {client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, temperature=1.0, seed=11,
        extra_body=extra).choices[0].message.content
        for extra in ({"specdec_k": 1}, {"specdec_k": 5}, {"specdec_mode": "target-only"},
                      {"specdec_rule": "coupled", "specdec_mode": "spec"})}
    assert len(coupled) == 1, coupled
    rejection = {client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, temperature=1.0, seed=s,
        extra_body={"specdec_rule": "rejection", "specdec_k": 3}).choices[0].message.content
        for s in (1, 2, 3)}
    assert len(rejection) > 1
    # a stop string cuts the greedy text before it
    full = ask(temperature=0).choices[0].message.content
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), full
    cut = ask(temperature=0, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


# ---- specdec's own client ----------------------------------------------------------------

def test_own_client_sync_and_async(api, tiny_models, tok):
    refs = {p: reference(tiny_models, tok, chat_ids(tok, p), 20) for p in PROMPTS}
    with SpecdecClient(api, model=MODEL, timeout=60) as client:
        assert client.health() and client.models() == [MODEL]
        r = client.chat(PROMPT, max_tokens=20, temperature=0)
        assert r.text == refs[PROMPT][0] and r.usage.completion_tokens == len(refs[PROMPT][1])
        assert r.specdec.rounds > 0 and r.specdec.mode == "pipelined"
        chunks = list(client.stream_chat([{"role": "user", "content": PROMPT}], max_tokens=20,
                                         temperature=0, mode="spec", k=2))
        assert "".join(c.text for c in chunks) == refs[PROMPT][0]
        assert chunks[-1].usage.completion_tokens == len(refs[PROMPT][1])
        assert [c.specdec.mode for c in chunks if c.specdec] == ["spec"]
        assert [c.finish_reason for c in chunks if c.finish_reason] in (["length"], ["stop"])
        ids = tok(PROMPT)["input_ids"]
        plain = client.complete(ids, max_tokens=12, temperature=0)
        assert plain.text == reference(tiny_models, tok, ids, 12)[0]
        assert "".join(c.text for c in client.stream_complete(PROMPT, max_tokens=12,
                                                              temperature=0)) == plain.text

    async def concurrent():
        async with AsyncSpecdecClient(api + "/v1", model=MODEL) as client:
            answers = await asyncio.gather(*(client.chat(p, max_tokens=20, temperature=0)
                                             for p in PROMPTS))
            streamed = []
            async for chunk in client.stream_chat(PROMPT, max_tokens=20, temperature=0):
                streamed.append(chunk.text)
            return answers, "".join(streamed)

    answers, streamed = asyncio.run(concurrent())
    assert [a.text for a in answers] == [refs[p][0] for p in PROMPTS]
    assert streamed == refs[PROMPT][0]


def test_own_client_retries(host, api):
    sent = []
    hooks = {"request": [lambda request: sent.append(request.url)]}

    # nothing listens: connect errors are retried max_retries times, then raised
    dead = f"http://127.0.0.1:{free_port()}"
    with SpecdecClient(dead, max_retries=2, backoff_s=0.01,
                       http_client=httpx.Client(event_hooks=hooks)) as client:
        with pytest.raises(SpecdecConnectionError):
            client.chat(PROMPT, max_tokens=4)
    assert len(sent) == 3

    async def dead_async():
        async def hook(request):
            sent.append(request.url)

        async with AsyncSpecdecClient(dead, max_retries=1, backoff_s=0.01,
                                      http_client=httpx.AsyncClient(
                                          event_hooks={"request": [hook]})) as client:
            with pytest.raises(SpecdecConnectionError):
                await client.complete(PROMPT, max_tokens=4)

    sent.clear()
    asyncio.run(dead_async())
    assert len(sent) == 2

    # a real HTTP server answering 503 (with Retry-After) twice, then forwarding to the API
    seen = []

    async def flaky(scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        seen.append(scope["path"])
        if len(seen) <= 2:
            resp = JSONResponse({"error": {"message": "warming up", "type": "server_error",
                                           "param": None, "code": None}},
                                status_code=503, headers={"Retry-After": "0"})
        else:
            async with httpx.AsyncClient() as c:
                r = await c.post(api + scope["path"], content=body,
                                 headers={"content-type": "application/json"})
            resp = Response(r.content, r.status_code, media_type="application/json")
        await resp(scope, receive, send)

    proxy = host.serve(app=flaky)
    with SpecdecClient(proxy, model=MODEL, max_retries=3, backoff_s=0.01) as client:
        r = client.chat(PROMPT, max_tokens=6, temperature=0)
    assert len(seen) == 3 and r.usage.completion_tokens > 0
    seen.clear()
    with SpecdecClient(proxy, model=MODEL, max_retries=1, backoff_s=0.01) as client:
        with pytest.raises(ServerError) as err:
            client.chat(PROMPT, max_tokens=6)
    assert err.value.status_code == 503 and "warming up" in err.value.message
    assert len(seen) == 2

    # a 400 is not retried
    sent.clear()
    with SpecdecClient(api, model=MODEL, max_retries=3,
                       http_client=httpx.Client(event_hooks=hooks)) as client:
        with pytest.raises(BadRequestError) as err:
            client.chat(PROMPT, max_tokens=0)
    assert err.value.param == "max_tokens" and len(sent) == 1


# ---- bad requests ------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD = [
    (CHAT, {"model": "nope", "messages": MSGS}, "model"),
    (CHAT, {"messages": MSGS}, "model"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
    (COMPLETE, {"model": MODEL, "prompt": ""}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": []}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": [[1, 2], [3]]}, "prompt"),  # a batch of two
    (COMPLETE, {"model": MODEL, "prompt": [[]]}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": [[10**9]]}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": [[1, "2"]]}, "prompt"),
    (COMPLETE, {"model": MODEL, "prompt": [10**9]}, "prompt"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 10**6}, "max_tokens"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "max_tokens": 10**6, "stream": True},
     "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSGS, "temperature": -0.5}, "temperature"),
    (CHAT, {"model": MODEL, "messages": MSGS, "temperature": "hot"}, "temperature"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_p": 0}, "top_p"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_p": 1.5}, "top_p"),
    (CHAT, {"model": MODEL, "messages": MSGS, "n": 0}, "n"),
    (CHAT, {"model": MODEL, "messages": MSGS, "n": 17}, "n"),
    (CHAT, {"model": MODEL, "messages": MSGS, "seed": -1}, "seed"),
    (CHAT, {"model": MODEL, "messages": MSGS, "stop": [1]}, "stop"),
    (CHAT, {"model": MODEL, "messages": MSGS, "stream": "yes"}, "stream"),
    (CHAT, {"model": MODEL, "messages": MSGS, "specdec_mode": "fast"}, "specdec_mode"),
    (CHAT, {"model": MODEL, "messages": MSGS, "specdec_k": 999}, "specdec_k"),
    (CHAT, {"model": MODEL, "messages": MSGS, "specdec_rule": "typical"}, "specdec_rule"),
    (CHAT, {"model": MODEL, "messages": MSGS, "specdec_rule": 1}, "specdec_rule"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "echo": True, "stream": True}, "echo"),
    (CHAT, {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    (CHAT, {"model": MODEL, "messages": MSGS, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"model": MODEL, "messages": MSGS, "frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"model": MODEL, "messages": MSGS, "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "logprobs": -1}, "logprobs"),
    (CHAT, [1, 2], None),
    (CHAT, b'{"model": "tiny", "messages": [', None),
    (CHAT, b"", None),
]


def test_a_batch_of_one_prompt_is_that_prompt(api, tok):
    """prompt as [text] or [[ids]] (lm-eval's local-completions sends [[ids]]: a batch of one)
    is the same request as the text or the ids alone; a batch of several is refused by name."""
    ids = tok(PROMPT)["input_ids"]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    with httpx.Client(base_url=api, timeout=60) as http:
        answers = [http.post(COMPLETE, json={"prompt": p, **kw}) for p in
                   (PROMPT, [PROMPT], ids, [ids])]
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        first = answers[0].json()["choices"][0]
        for r in answers[1:]:
            choice = r.json()["choices"][0]
            assert choice["text"] == first["text"]
            assert choice["logprobs"]["tokens"] == first["logprobs"]["tokens"]
        # lm-eval's scoring request: echo, logprobs 1, max_tokens 1, the ids as a batch of one
        echo = http.post(COMPLETE, json={**kw, "prompt": [ids], "max_tokens": 1, "echo": True,
                                         "seed": 1234, "stop": ["\n"]})
        assert echo.status_code == 200, echo.text
        lp = echo.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert echo.json()["choices"][0]["text"].startswith(tok.decode(ids))
        two = http.post(COMPLETE, json={**kw, "prompt": [ids, ids]})
        wrong = http.post(COMPLETE, json={**kw, "prompt": [[1, "2"]]})
    assert two.status_code == wrong.status_code == 400
    err = two.json()["error"]
    assert err["param"] == "prompt" and "batch of 2" in err["message"], err
    err = wrong.json()["error"]
    assert err["param"] == "prompt" and "list of token ids" in err["message"], err


def test_bad_requests_get_400_and_the_server_keeps_serving(api):
    before = scrape(api)
    with httpx.Client(base_url=api, timeout=60) as http:
        for path, body, param in BAD:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert err["param"] == param, (body, err)
            if isinstance(body, bytes) and body:
                assert "JSON" in err["message"]
        # ... and it still serves
        ok = http.post(CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
    after = scrape(api)
    assert delta(after, before, "specdec:request_failure_total", reason="invalid") == len(BAD)

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSGS, top_p=2.0)
    assert "top_p" in str(err.value)


def test_api_key(host, tiny_models):
    url = host.serve(api_key="sekret")
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", CHAT), ("POST", COMPLETE), ("GET", "/docs")):
                r = http.request(method, path, headers=headers,
                                 json={"model": MODEL, "messages": MSGS})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sekret"}
        assert http.get("/v1/models", headers=good).status_code == 200
        assert http.get("/metrics", headers=good).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = openai.OpenAI(base_url=url + "/v1", api_key="sekret").chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4)
    assert r.usage.completion_tokens > 0
    with SpecdecClient(url, model=MODEL) as client:
        with pytest.raises(AuthenticationError):
            client.chat(PROMPT, max_tokens=4)
    with SpecdecClient(url, api_key="sekret", model=MODEL) as client:
        assert client.chat(PROMPT, max_tokens=4).usage.completion_tokens > 0


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
            assert _sessions(tiny_services) == (1, 1)
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


# ---- logprobs and n > 1 ------------------------------------------------------------------

def hf_logprobs(model_dir: str, prompt_ids: list[int], token_ids: list[int]):
    """transformers' log-softmax at each generated position: [len(token_ids), vocab]."""
    import torch

    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].float(), -1)


@pytest.mark.parametrize("mode", ["pipelined", "target-only"])
def test_chat_logprobs_are_the_targets_own(api, tiny_models, tok, mode):
    """Each generated token's logprob and top alternatives equal transformers' log-softmax at
    that position, whichever pass (a verify block row or a single step) computed them."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"specdec_mode": mode, "specdec_k": 3})
    content = resp.choices[0].logprobs.content
    prompt_ids = chat_ids(tok, PROMPT)
    _, ids = reference(tiny_models, tok, prompt_ids, 24)
    assert len(content) == len(ids) == resp.usage.completion_tokens
    ref = hf_logprobs(tiny_models["target"], prompt_ids, ids)
    for j, (entry, token_id) in enumerate(zip(content, ids)):
        assert entry.token == tok.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - float(ref[j, token_id])) < 1e-4, j
        top = ref[j].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top.indices]
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(entry.top_logprobs,
                                                                     top.values))
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token
    if mode == "pipelined":  # rows of verify blocks (accepted ones: the test below)
        assert resp.specdec["draft_tokens"] > 0


def test_verify_returns_logprobs_of_accepted_and_bonus_rows(tiny_services, tiny_models, tok):
    """A block the target accepts whole: every emitted token's logprob (block rows and the
    bonus) is transformers' at that position."""
    from orchestrator.service_clients import History, TargetClient
    from specdec.config import SamplingParams

    prompt_ids = chat_ids(tok, PROMPT)
    _, ids = reference(tiny_models, tok, prompt_ids, 8)
    ref = hf_logprobs(tiny_models["target"], prompt_ids, ids[:6])

    async def verify():
        client = TargetClient(tiny_services["target"].address)
        await client.wait_ready()
        try:
            resp, _ = await client.verify("lp-test", History(prompt_ids), ids[:5], [],
                                          SamplingParams(), logprobs=2)
            await client.close_session("lp-test")
            return resp
        finally:
            await client.close()

    resp = run(verify())
    assert resp.num_accepted == 5 and resp.next_token == ids[5]
    assert len(resp.logprobs) == 6
    for j, entry in enumerate(resp.logprobs):
        assert abs(entry.logprob - float(ref[j, ids[j]])) < 1e-4, j
        assert list(entry.top_ids) == ref[j].topk(2).indices.tolist()


def test_completion_logprobs_stream_as_they_come_and_match_the_whole(api):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.9, seed=3,
              logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for c in client.completions.create(stream=True, **kw):
        if c.choices and c.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
        if c.choices:
            text += c.choices[0].text
    assert text == whole.text  # seeded, coupled rule: the same sample
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)
    no_lp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4)
    assert no_lp.choices[0].logprobs is None


def test_n_choices_are_independent_seeded_generations(api):
    """n > 1: choice i is the generation with seed + i (run concurrently); usage counts all."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0)
    resp = client.chat.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [c.message.content for c in resp.choices] == \
        [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert resp.usage.prompt_tokens == singles[0].usage.prompt_tokens
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for c in client.chat.completions.create(n=3, seed=40, stream=True, **kw):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in resp.choices]


@pytest.mark.parametrize("words", [6, 320])  # 320 words: a prompt over several prefill chunks
def test_echo_scores_the_prompt_as_transformers_does(api, tiny_models, tok, words):
    """echo + logprobs (how lm-eval scores a continuation): the prompt's text and each prompt
    token's logprob given the ones before it (the first has none), then the completion."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    prompt = " ".join(["the quick brown fox jumps over a lazy dog"] * 40).split()[:words]
    prompt = " ".join(prompt)
    ids = tok(prompt)["input_ids"]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     logprobs=1, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    ref = hf_logprobs(tiny_models["target"], ids[:1], ids[1:])  # rows predicting ids[1:]
    for j, token_id in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[j + 1] - float(ref[j, token_id])) < 1e-4, j
    _, greedy = reference(tiny_models, tok, ids, 1)
    assert lp.tokens[-1] == tok.decode(greedy)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def hf_penalized_greedy(model_dir: str, prompt_ids: list[int], n: int, presence: float,
                        frequency: float, repetition: float, eos: int) -> list[int]:
    """Greedy decoding with the penalties computed independently: transformers' own
    RepetitionPenaltyLogitsProcessor, then OpenAI's presence / frequency formula."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    rep = RepetitionPenaltyLogitsProcessor(repetition)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            scores = model(torch.tensor([ids])).logits[:, -1].float()
            scores = rep(torch.tensor([ids]), scores)[0]
            for t in set(out):
                scores[t] -= presence + frequency * out.count(t)
            token = int(scores.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5),
                                       dict(frequency_penalty=2.0),
                                       dict(repetition_penalty=1.6),
                                       dict(presence_penalty=-0.5, frequency_penalty=0.4,
                                            repetition_penalty=1.2)])
def test_penalties_apply_to_target_and_draft_alike_and_keep_greedy_exact(api, tiny_models, tok,
                                                                         penalties):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf_penalized_greedy(tiny_models["target"], ids, 32,
                              penalties.get("presence_penalty", 0.0),
                              penalties.get("frequency_penalty", 0.0),
                              penalties.get("repetition_penalty", 1.0), tok.eos_token_id)
    plain = hf_greedy(tiny_models["target"], ids, 32)
    assert ref != plain  # the penalties change this text: the comparison below can fail
    for mode in ("target-only", "spec", "pipelined"):
        extra = {"specdec_mode": mode, "specdec_k": 3}
        if "repetition_penalty" in penalties:
            extra["repetition_penalty"] = penalties["repetition_penalty"]
        kw = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32,
                                         temperature=0, extra_body=extra, **kw)
        assert resp.choices[0].text == tok.decode(ref, skip_special_tokens=True), mode
    # sampled with the coupled rule: the same text in every mode
    texts = {client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=5,
        frequency_penalty=1.0, extra_body={"specdec_mode": mode, "specdec_k": 3}
    ).choices[0].text for mode in ("target-only", "spec", "pipelined")}
    assert len(texts) == 1


def test_a_block_is_penalized_row_by_row_as_single_steps_would_be(tiny_services, tiny_models,
                                                                   tok):
    """Row i of a verify block sees the block's first i tokens as output: a block of the
    penalized greedy tokens is accepted whole (here the text repeats a token of the block's
    second position at its fifth, which only the block's own rows can penalize)."""
    from orchestrator.service_clients import History, TargetClient
    from specdec.config import SamplingParams

    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf_penalized_greedy(tiny_models["target"], ids, 14, 0.0, 2.0, 1.6, -1)
    assert hf_greedy(tiny_models["target"], ids, 13)[12] == ref[9] != ref[12]
    params = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.6, prompt_len=len(ids))

    async def verify():
        client = TargetClient(tiny_services["target"].address)
        await client.wait_ready()
        try:
            resp, _ = await client.verify("pen-test", History(ids + ref[:8]), ref[8:13], [],
                                          params)
            await client.close_session("pen-test")
            return resp
        finally:
            await client.close()

    resp = run(verify())
    assert (resp.num_accepted, resp.next_token) == (5, ref[13])
