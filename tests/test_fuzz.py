"""Property-based tests (hypothesis) of the two parsers facing the outside, against real tiny
services: random HTTP bodies never get a 5xx, always 200 or a 400 with OpenAI's error body;
random wire messages get OK or a status that names the caller's mistake, never UNKNOWN or
INTERNAL, and the services answer a good request after each."""

from __future__ import annotations

import json
import math
import os

import grpc
import httpx
import pytest
from conftest import MODEL, ApiHost, ServiceThread
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orchestrator.http.schemas import ServeDefaults
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

# SPECDEC_FUZZ_EXAMPLES=1000 for a longer run
FUZZ = settings(max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "60")), deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 49152  # the default tokenizer's, which the tiny models share
CONTEXT = 512


@pytest.fixture(scope="module")
def services(tiny_models):
    """Services of this module alone: the fuzzer opens and mangles sessions at will."""
    target = ServiceThread("target", tiny_models["target"])
    draft = ServiceThread("draft", tiny_models["near_draft"], target=tiny_models["target"])
    yield {"target": target, "draft": draft}
    target.stop()
    draft.stop()


# --------------------------------------------------------------------------- HTTP

SURROGATES = st.characters(categories=["Cs"])  # what "\ud800" in JSON parses to
PLAIN = st.text(max_size=24)
TEXT = st.text(st.one_of(st.characters(), SURROGATES), max_size=24) | st.sampled_from(
    ["", "Once upon a time", "What is 2 + 2?"])
LEAF = (st.none() | st.booleans() | st.integers() | st.floats() | TEXT)
ANY_JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)


def wild(plausible):
    """A field's value when anything goes: near the valid range, or any JSON at all."""
    return st.one_of(plausible, ANY_JSON)


def mutated(valid, wild_fields: dict):
    """A valid request with one or two of its fields replaced by wild values."""
    changes = st.lists(st.sampled_from(sorted(wild_fields)), min_size=1, max_size=2,
                       unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: wild_fields[n] for n in names}))
    return st.tuples(valid, changes).map(lambda pair: {**pair[0], **pair[1]})


VALID_COMMON = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.just(0.0) | st.floats(0, 2),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "specdec_mode": st.sampled_from(["pipelined", "spec", "target-only"]),
    "specdec_k": st.integers(0, 8),
    "user": PLAIN,
}
WILD_COMMON = {
    "max_tokens": wild(st.integers(-2, 6) | st.just(10**9)),
    "temperature": wild(st.floats() | st.sampled_from([1e-45, 1e39, -1.0])),
    "top_p": wild(st.floats(-1, 2)),
    "top_k": wild(st.integers(-2, 50) | st.just(2**40)),
    "seed": wild(st.integers(-1, 2**64)),
    "stop": wild(TEXT | st.lists(TEXT, max_size=3)),
    "n": wild(st.integers(0, 2)),
    "stream": wild(st.booleans()),
    "stream_options": wild(st.fixed_dictionaries({"include_usage": wild(st.booleans())})),
    "specdec_mode": wild(st.sampled_from(["pipelined", "fast"])),
    "specdec_k": wild(st.integers(-1, 65)),
    "logprobs": wild(st.booleans() | st.integers(0, 3)),
    "presence_penalty": wild(st.floats(-2, 2)),
}
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16)
VALID_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": PLAIN.filter(bool) | TOKEN_IDS}, optional=VALID_COMMON)
PART = st.fixed_dictionaries({"type": wild(st.just("text")), "text": wild(TEXT)})
VALID_CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
          "content": PLAIN}), min_size=1, max_size=3)},
    optional={"max_completion_tokens": st.integers(1, 6), **VALID_COMMON})
WILD_COMPLETION = {
    "model": wild(st.sampled_from([MODEL, "gpt-4"])), "echo": wild(st.booleans()),
    "prompt": wild(TEXT | st.lists(st.integers(), max_size=16) | st.lists(TEXT, max_size=2)),
    **WILD_COMMON}
WILD_CHAT = {
    "model": wild(st.just(MODEL)), "max_completion_tokens": wild(st.integers(-1, 6)),
    "messages": wild(st.lists(st.fixed_dictionaries(
        {"role": wild(st.sampled_from(["user", "tool", "robot"]))},
        optional={"content": wild(TEXT | st.none() | st.lists(PART, max_size=2)),
                  "name": wild(TEXT)}), max_size=3)),
    **WILD_COMMON}
COMPLETE, CHAT = "/v1/completions", "/v1/chat/completions"
REQUEST = st.one_of(  # valid requests, and valid ones with a field or two gone wild
    st.tuples(st.just(COMPLETE), VALID_COMPLETION | mutated(VALID_COMPLETION, WILD_COMPLETION)),
    st.tuples(st.just(CHAT), VALID_CHAT | mutated(VALID_CHAT, WILD_CHAT)),
).map(lambda pair: (pair[0], json.dumps(pair[1])))
ARBITRARY = st.tuples(  # bodies that need not even be JSON
    st.sampled_from([COMPLETE, CHAT]),
    ANY_JSON.map(json.dumps).map(str.encode) | st.binary(max_size=64)
    | st.dictionaries(st.sampled_from(sorted(WILD_CHAT)), ANY_JSON).map(json.dumps))


@pytest.fixture(scope="module")
def http(services):
    host = ApiHost(services["target"].address, services["draft"].address)
    url = host.serve(defaults=ServeDefaults(max_tokens=6))
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client
    host.stop()


def _choices_asked(body) -> int:
    """The number of choices a request asks for (``n``; 1 when absent or not a body)."""
    try:
        n = json.loads(body).get("n", 1) if isinstance(body, (str, bytes)) else 1
    except (ValueError, AttributeError):
        return 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def check_http_answer(r: httpx.Response, n: int = 1) -> None:
    """A 400 in OpenAI's error shape, or a 200 with ``n`` choices (streamed: ``n`` finishes)."""
    assert r.status_code in (200, 400), (r.status_code, r.text[:500])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert err["param"] is None or isinstance(err["param"], str)
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        body = r.json()
        assert len(body["choices"]) == n and body["usage"]["completion_tokens"] >= 0
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for chunk in map(json.loads, events[:-1]):
        assert "error" not in chunk, chunk  # a stream that began must end well
    finishes = [c["finish_reason"] for e in map(json.loads, events[:-1])
                for c in e["choices"] if c["finish_reason"]]
    assert len(finishes) == n and set(finishes) <= {"stop", "length"}


def post(http, path: str, body) -> None:
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics shows the mix
    check_http_answer(r, _choices_asked(body))


@FUZZ
@given(request=REQUEST)
def test_requests_get_200_or_a_400_with_an_openai_error(http, request):
    post(http, *request)


@FUZZ
@given(request=ARBITRARY)
def test_arbitrary_bodies_never_get_a_5xx(http, request):
    post(http, *request)


def test_http_front_still_serves_after_fuzzing(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# --------------------------------------------------------------------------- gRPC

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION}
KNOWN = list(range(100, 112))  # what session "fz-known" holds before every example

VALID_TOKEN = st.integers(0, VOCAB - 1)
TOKEN = VALID_TOKEN | st.integers(-2**31, 2**31 - 1)
FLOAT32 = st.floats(width=32) | st.sampled_from([0.0, 1.0, 0.5, 1e-45])

def known_ref(prefix: list[int]) -> pb.SessionRef:
    return pb.SessionRef(session_id="fz-known", prefix_len=len(prefix),
                         prefix_hash=rolling_hash(prefix))


VALID_SESSION = st.one_of(  # the cache's prefixes, other prefixes of it, fresh sessions
    st.integers(0, len(KNOWN)).map(lambda n: known_ref(KNOWN[:n])),
    st.lists(VALID_TOKEN, min_size=1, max_size=2 * len(KNOWN)).map(known_ref),
    st.text(min_size=1, max_size=40).map(lambda sid: pb.SessionRef(session_id=sid)))
VALID_SAMPLING = st.none() | st.builds(
    pb.SamplingParams, temperature=st.floats(1 / 16, 2.0, width=32), top_k=st.integers(0, 50),
    top_p=st.floats(1 / 16, 1.0, width=32), seed=st.integers(0, 2**64 - 1))


@st.composite
def valid_verify(draw) -> dict:
    drafts = draw(st.lists(VALID_TOKEN, max_size=8))
    sampling = draw(VALID_SAMPLING)
    dists = [] if sampling is None else [  # the draft's q: here all its mass near the token
        pb.SparseDist(ids=[t], probs=[draw(st.floats(1 / 64, 1.0, width=32))]) for t in drafts]
    return dict(session=draw(VALID_SESSION), tokens=draw(st.lists(VALID_TOKEN, min_size=1,
                                                                 max_size=12)),
                draft_tokens=drafts, draft_dists=dists, sampling=sampling)


VALID_PROPOSE = st.fixed_dictionaries(dict(
    session=VALID_SESSION, tokens=st.lists(VALID_TOKEN, min_size=1, max_size=12),
    k=st.integers(1, 8), sampling=VALID_SAMPLING))
WILD_SESSION = st.builds(
    pb.SessionRef, session_id=st.sampled_from(["fz-known", "fz-other", ""]) | st.text(max_size=140),
    prefix_len=st.integers(0, 16) | st.integers(0, 2**32 - 1),
    prefix_hash=st.just(0) | st.integers(0, 2**64 - 1))
WILD_SAMPLING = st.builds(
    pb.SamplingParams, temperature=FLOAT32,
    top_k=st.integers(0, 50) | st.integers(-2**31, 2**31 - 1),
    top_p=FLOAT32, seed=st.integers(0, 2**64 - 1))
WILD_TOKENS = st.lists(TOKEN, max_size=12) | st.sampled_from([CONTEXT - 1, CONTEXT + 1]).map(
    lambda n: [7] * n)
WILD_WIRE = dict(
    session=WILD_SESSION, tokens=WILD_TOKENS, sampling=WILD_SAMPLING,
    request_id=st.text(max_size=80))
VERIFY = st.one_of(valid_verify(), mutated(valid_verify(), dict(
    WILD_WIRE, draft_tokens=st.lists(TOKEN, max_size=8) | st.just([5] * 65),
    draft_dists=st.lists(st.builds(pb.SparseDist, ids=st.lists(TOKEN, max_size=4),
                                   probs=st.lists(FLOAT32, max_size=4)), max_size=8)))
                   ).map(lambda fields: pb.VerifyRequest(**fields))
PROPOSE = st.one_of(VALID_PROPOSE, mutated(VALID_PROPOSE, dict(
    WILD_WIRE, k=st.integers(0, 8) | st.integers(0, 2**32 - 1)))
                    ).map(lambda fields: pb.DraftRequest(**fields))


@pytest.fixture(scope="module")
def stubs(services):
    with grpc.insecure_channel(services["target"].address) as t, \
            grpc.insecure_channel(services["draft"].address) as d:
        yield pb_grpc.TargetServiceStub(t), pb_grpc.DraftServiceStub(d)


def status(fn, request):
    try:
        return grpc.StatusCode.OK, fn(request, timeout=60)
    except grpc.RpcError as exc:
        assert exc.details(), exc.code()  # an error says what is wrong
        return exc.code(), None


def reset_known_session(stubs) -> None:
    target, draft = stubs
    target.Verify(pb.VerifyRequest(session=pb.SessionRef(session_id="fz-known"), tokens=KNOWN),
                  timeout=60)
    draft.Propose(pb.DraftRequest(session=pb.SessionRef(session_id="fz-known"),
                                  tokens=KNOWN, k=1), timeout=60)


def good_calls(stubs) -> None:
    """A good verify and a good propose on a fresh session, after whatever came before."""
    target, draft = stubs
    v = target.Verify(pb.VerifyRequest(session=pb.SessionRef(session_id="fz-good"),
                                       tokens=[1, 2, 3], draft_tokens=[4, 5]), timeout=60)
    assert v.cache_len >= 3 and v.num_accepted <= 2
    d = draft.Propose(pb.DraftRequest(session=pb.SessionRef(session_id="fz-good"),
                                      tokens=[1, 2, 3], k=2), timeout=60)
    assert len(d.tokens) == 2


@FUZZ
@given(request=VERIFY)
def test_random_verify_requests_get_ok_or_a_callers_status(stubs, request):
    reset_known_session(stubs)
    code, resp = status(stubs[0].Verify, request)
    event(code.name)
    assert code in ALLOWED, code
    if code == grpc.StatusCode.OK:
        assert resp.num_accepted <= len(request.draft_tokens)
        assert 0 <= resp.next_token < VOCAB
        assert resp.cache_len == request.session.prefix_len + len(request.tokens) + \
            resp.num_accepted
    good_calls(stubs)


@FUZZ
@given(request=PROPOSE)
def test_random_draft_requests_get_ok_or_a_callers_status(stubs, request):
    reset_known_session(stubs)
    code, resp = status(stubs[1].Propose, request)
    event(code.name)
    assert code in ALLOWED, code
    if code == grpc.StatusCode.OK:
        assert 1 <= len(resp.tokens) <= request.k
        assert all(0 <= t < VOCAB for t in resp.tokens)
        for d in resp.dists:  # sampling: the q each token was drawn from
            assert all(0.0 <= p <= 1.0 and math.isfinite(p) for p in d.probs)
    good_calls(stubs)
