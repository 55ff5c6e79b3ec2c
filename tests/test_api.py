"""The HTTP front over real tiny services: the real openai package, specdec's own client,
bad requests, the API key, /metrics, and disconnects that must free the services' sessions."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import (
    CHAT,
    COMPLETE,
    MODEL,
    MSGS,
    PROMPT,
    PROMPTS,
    chat_ids,
    delta,
    free_port,
    reference,
    scrape,
)
from starlette.responses import JSONResponse, Response

from orchestrator.http_client import (
    AsyncSpecdecClient,
    AuthenticationError,
    BadRequestError,
    ServerError,
    SpecdecClient,
    SpecdecConnectionError,
)


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
