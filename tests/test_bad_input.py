"""Bad input at every boundary, against real tiny services: each gets a clear error (HTTP 400
with OpenAI's body, gRPC INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION /
RESOURCE_EXHAUSTED), the process keeps serving, and a generation running meanwhile is
unaffected. (tests/test_services.py and tests/test_api.py hold the first cases; these are the
rest.)"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import httpx
import pytest
from conftest import MODEL, ApiHost, ServiceThread, hf_greedy, run

from orchestrator.generation import GenerationRequest
from orchestrator.http.schemas import ServeDefaults
from orchestrator.pair import close, connect
from specdec.models.hub import load_tokenizer
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb

MAX_MESSAGE_BYTES = 64 * 1024
VERIFY = "/specdec.v1.TargetService/Verify"
VERIFY_STREAM = "/specdec.v1.TargetService/VerifyStream"
PROPOSE = "/specdec.v1.DraftService/Propose"
CLOSE_TARGET = "/specdec.v1.TargetService/CloseSession"
CLOSE_DRAFT = "/specdec.v1.DraftService/CloseSession"
PROMPT = list(range(2000, 2040))
MAX_NEW = 40
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def services(tiny_models):
    """A target and a draft of their own (sessions and limits of this module only), with a
    small message limit."""
    target = ServiceThread("target", tiny_models["target"], max_message_bytes=MAX_MESSAGE_BYTES)
    draft = ServiceThread("draft", tiny_models["near_draft"], target=tiny_models["target"],
                          max_message_bytes=MAX_MESSAGE_BYTES)
    yield {"target": target, "draft": draft}
    target.stop()
    draft.stop()


def call(address: str, method: str, payload: bytes | object, stream: bool = False):
    """Send one request (a message, or raw bytes) as is; (status code, details, response)."""
    data = payload if isinstance(payload, bytes) else payload.SerializeToString()
    with grpc.insecure_channel(address) as channel:
        try:
            if stream:
                fn = channel.stream_stream(method, request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
                responses = list(fn(iter([data]), timeout=60))
                return grpc.StatusCode.OK, "", responses[0]
            fn = channel.unary_unary(method, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
            return grpc.StatusCode.OK, "", fn(data, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None


def ref(session_id: str, prefix=()) -> pb.SessionRef:
    return pb.SessionRef(session_id=session_id, prefix_len=len(prefix),
                         prefix_hash=rolling_hash(prefix))


def still_serves(services) -> None:
    """Both services answer a good call after whatever came before."""
    code, details, raw = call(services["target"].address, VERIFY,
                              pb.VerifyRequest(session=ref("good"), tokens=[1, 2, 3],
                                               draft_tokens=[4]))
    assert code == grpc.StatusCode.OK, details
    assert pb.VerifyResponse.FromString(raw).cache_len >= 3
    code, details, raw = call(services["draft"].address, PROPOSE,
                              pb.DraftRequest(session=ref("good"), tokens=[1, 2, 3], k=3))
    assert code == grpc.StatusCode.OK, details
    assert len(pb.DraftResponse.FromString(raw).tokens) == 3


def sampled(**fields) -> pb.SamplingParams:
    """Sampling under the rejection rule: the rule whose verify calls carry draft_dists."""
    return pb.SamplingParams(**{"temperature": 1.0, "seed": 7, "rule": pb.REJECTION, **fields})


def dist(ids, probs) -> pb.SparseDist:
    return pb.SparseDist(ids=ids, probs=probs)


def _raw_draft_request_with_k(varint: bytes) -> bytes:
    """A DraftRequest whose k (field 3, uint32) carries any varint, e.g. a negative int64's
    ten bytes, which protobuf reads as its low 32 bits."""
    body = pb.DraftRequest(session=ref("rawk"), tokens=[1, 2]).SerializeToString()
    return body + b"\x18" + varint


NEGATIVE_ONE_VARINT = b"\xff" * 9 + b"\x01"

GRPC_BAD = [
    # token ids outside the vocabulary, everywhere they appear
    ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1, -7]),
     "INVALID_ARGUMENT", "tokens: token ids must be in"),
    ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1], draft_tokens=[2, 2**31 - 1]),
     "INVALID_ARGUMENT", "draft_tokens: token ids must be in"),
    ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1], draft_tokens=[2],
                                        draft_dists=[dist([2, 10**8], [0.5, 0.5])],
                                        sampling=sampled()),
     "INVALID_ARGUMENT", "draft_dists[0].ids: token ids must be in"),
    ("draft", PROPOSE, pb.DraftRequest(session=ref("d"), tokens=[5, 10**7], k=2),
     "INVALID_ARGUMENT", "tokens: token ids must be in"),
    # k: oversized (uint32 on the wire), negative as the wire spells it, a block above MAX_K
    ("draft", PROPOSE, pb.DraftRequest(session=ref("d"), tokens=[1], k=2**32 - 1),
     "INVALID_ARGUMENT", "k must be in [1, 64], got 4294967295"),
    ("draft", PROPOSE, pb.DraftRequest(session=ref("d"), tokens=[1], k=65),
     "INVALID_ARGUMENT", "k must be in [1, 64]"),
    ("draft", PROPOSE, _raw_draft_request_with_k(NEGATIVE_ONE_VARINT),
     "INVALID_ARGUMENT", "k must be in [1, 64]"),
    ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1], draft_tokens=[3] * 65),
     "INVALID_ARGUMENT", "at most 64 tokens"),
    # NaN / inf / negative probabilities, probabilities that sum above 1, repeated ids
    *[("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1], draft_tokens=[2],
                                          draft_dists=[dist(ids, probs)], sampling=sampled()),
       "INVALID_ARGUMENT", message)
      for ids, probs, message in [([2], [NAN], "probs must be in [0, 1]"),
                                  ([2], [INF], "probs must be in [0, 1]"),
                                  ([2, 3], [0.5, -0.25], "probs must be in [0, 1]"),
                                  ([2, 3], [0.75, 0.75], "sum to <= 1"),
                                  ([2, 2], [0.25, 0.25], "ids repeat"),
                                  ([2, 3], [0.5], "ids and probs differ in length")]],
    # sampling parameters the wire can carry but no one can sample with
    *[(role, method, msg, "INVALID_ARGUMENT", message)
      for params, message in [(dict(temperature=INF), "temperature must be a finite number"),
                              (dict(temperature=NAN), "temperature must be a finite number"),
                              (dict(temperature=-1.0), "temperature must be a finite number"),
                              (dict(top_p=NAN), "top_p must be in (0, 1]"),
                              (dict(top_p=-0.5), "top_p must be in (0, 1]"),
                              (dict(top_p=1.5), "top_p must be in (0, 1]"),
                              (dict(top_k=-3), "top_k must be in")]
      for role, method, msg in [
          ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1],
                                              sampling=sampled(**params))),
          ("draft", PROPOSE, pb.DraftRequest(session=ref("d"), tokens=[1], k=2,
                                             sampling=sampled(**params)))]],
    # sequences longer than the context
    ("target", VERIFY, pb.VerifyRequest(session=ref("v"), tokens=[1] * 600),
     "INVALID_ARGUMENT", "exceeds the target's context of 512"),
    ("draft", PROPOSE, pb.DraftRequest(session=ref("d"), tokens=[1] * 600, k=2),
     "INVALID_ARGUMENT", "exceeds the draft's context of 512"),
    # session references that make no sense
    ("target", VERIFY, pb.VerifyRequest(session=pb.SessionRef(session_id="v", prefix_hash=9),
                                        tokens=[1]),
     "INVALID_ARGUMENT", "prefix_hash must be 0 when prefix_len is 0"),
    ("draft", PROPOSE, pb.DraftRequest(session=pb.SessionRef(session_id="x" * 129), tokens=[1],
                                       k=2),
     "INVALID_ARGUMENT", "session_id must be 1..128 bytes"),
    ("target", VERIFY, pb.VerifyRequest(session=pb.SessionRef(session_id="never-opened",
                                                               prefix_len=2**32 - 1),
                                        tokens=[1]),
     "NOT_FOUND", "not open on this service"),
    # bytes that are no protobuf message at all, or a string field that is not UTF-8
    ("target", VERIFY, b"\xff\xff\xff\xff", "INVALID_ARGUMENT", "not a valid protobuf message"),
    ("draft", PROPOSE, b"\x0a\x03\x0a\x01\xff\x12\x01\x01\x18\x02", "INVALID_ARGUMENT",
     "not a valid protobuf message"),
]


@pytest.mark.parametrize("role,method,request_,code,message", GRPC_BAD,
                         ids=[f"{i}-{c[0]}-{c[4][:30]}" for i, c in enumerate(GRPC_BAD)])
def test_bad_wire_requests_get_clear_errors_and_the_service_keeps_serving(
        services, role, method, request_, code, message):
    got, details, _ = call(services[role].address, method, request_)
    assert got.name == code and message in details, (got, details)
    still_serves(services)


def test_corrupt_bytes_on_a_stream_end_it_with_invalid_argument(services):
    got, details, _ = call(services["target"].address, VERIFY_STREAM, b"\x0a\xff\xff",
                           stream=True)
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details, details
    got, _, raw = call(services["target"].address, VERIFY_STREAM,
                       pb.VerifyRequest(session=ref("s"), tokens=[1, 2]), stream=True)
    assert got == grpc.StatusCode.OK and pb.VerifyResponse.FromString(raw).cache_len == 2


def test_a_tiny_temperature_is_greedy_not_nan(services):
    """1e-45 (the smallest float32) would make logits / temperature overflow to NaN; sampling's
    limit as the temperature goes to 0 is greedy decoding, and that is what it gets."""
    def verdict(sampling):
        code, details, raw = call(services["target"].address, VERIFY, pb.VerifyRequest(
            session=ref("tiny-t"), tokens=PROMPT, draft_tokens=[5, 6], sampling=sampling))
        assert code == grpc.StatusCode.OK, details
        r = pb.VerifyResponse.FromString(raw)
        return r.num_accepted, r.next_token

    assert verdict(pb.SamplingParams(temperature=1e-45, seed=3)) == verdict(pb.SamplingParams())


def test_oversized_messages_are_refused_by_grpc_and_the_service_survives(services):
    huge_verify = pb.VerifyRequest(session=ref("big"), tokens=[30000] * 40000)
    huge_propose = pb.DraftRequest(session=ref("big"), tokens=[30000] * 40000, k=2)
    assert huge_verify.ByteSize() > MAX_MESSAGE_BYTES
    for role, method, msg in (("target", VERIFY, huge_verify), ("draft", PROPOSE, huge_propose)):
        got, details, _ = call(services[role].address, method, msg)
        assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, (got, details)
        assert str(MAX_MESSAGE_BYTES) in details  # gRPC says which limit
    got, details, _ = call(services["target"].address, VERIFY_STREAM, huge_verify, stream=True)
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, (got, details)
    still_serves(services)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_closed_sessions_and_disagreeing_lengths(services, role):
    address = services[role].address
    method, close_method = (VERIFY, CLOSE_TARGET) if role == "target" else (PROPOSE,
                                                                            CLOSE_DRAFT)

    def block(session: pb.SessionRef, tokens):
        if role == "target":
            return pb.VerifyRequest(session=session, tokens=tokens)
        return pb.DraftRequest(session=session, tokens=tokens, k=2)

    sid = f"lengths-{role}"
    assert call(address, method, block(ref(sid), [1, 2, 3, 4]))[0] == grpc.StatusCode.OK
    # the cache holds 4 tokens (target) or 4 + the drafted ones (draft); 50 is more than either
    code, details, _ = call(address, method, block(ref(sid, list(range(50))), [7]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "cache holds" in details, details
    code, details, _ = call(address, method, block(ref(sid, [1, 2, 9]), [7]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "hash mismatch" in details, details
    # the session is intact after both refusals
    assert call(address, method, block(ref(sid, [1, 2, 3]), [4]))[0] == grpc.StatusCode.OK
    code, _, raw = call(address, close_method, pb.CloseRequest(session_id=sid))
    assert code == grpc.StatusCode.OK and pb.CloseResponse.FromString(raw).released
    code, details, _ = call(address, method, block(ref(sid, [1, 2, 3]), [4]))
    assert code == grpc.StatusCode.NOT_FOUND and sid in details, details
    code, _, raw = call(address, close_method, pb.CloseRequest(session_id=sid))
    assert code == grpc.StatusCode.OK and not pb.CloseResponse.FromString(raw).released


def test_a_generation_is_unaffected_by_bad_requests_meanwhile(services, tiny_models):
    """Bad calls of every kind hit both services while a pipelined generation runs on them."""
    reference = hf_greedy(tiny_models["target"], PROMPT, MAX_NEW)

    async def generate():
        orch = await connect(services["target"].address, services["draft"].address)
        try:
            return await orch.generate(GenerationRequest(PROMPT, MAX_NEW, k=3))
        finally:
            await close(orch)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, generate())
        refused = 0
        while not future.done() or refused < len(GRPC_BAD):
            role, method, request_, code, _ = GRPC_BAD[refused % len(GRPC_BAD)]
            assert call(services[role].address, method, request_)[0].name == code
            refused += 1
        result = future.result()
    assert result.token_ids == reference
    assert result.stats.accepted_tokens > 0 and result.stats.re_prefills == 0


# --------------------------------------------------------------------------- HTTP

CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def api(services):
    host = ApiHost(services["target"].address, services["draft"].address)
    yield host.serve(defaults=ServeDefaults(max_tokens=8))
    host.stop()


HTTP_BAD = [
    # bytes that are not UTF-8 JSON
    (COMPLETE, b'{"model": "tiny", "prompt": "caf\xe9"}', None, "not UTF-8"),
    (COMPLETE, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None, "malformed JSON"),
    (CHAT, b"\xff\xfe\x00garbage", None, "malformed JSON"),
    (COMPLETE, b"[" * 5000 + b"]" * 5000, None, "nested too deeply"),
    (COMPLETE, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature", "finite"),
    (COMPLETE, b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', "temperature",
     "finite"),
    # JSON escapes that encode no character (lone surrogates), wherever they are
    (COMPLETE, {"model": MODEL, "prompt": "a\ud800b"}, "prompt", "not valid Unicode"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}, "messages",
     "messages[0].content: not valid Unicode"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud83d"}]}]}, "messages", "not valid Unicode"),
    (COMPLETE, {"model": "\udc80", "prompt": "x"}, "model", "not valid Unicode"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "stop": ["ok", "\ud800"]}, "stop",
     "stop[1]: not valid Unicode"),
    # wrong types, deeper than the top level
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages", None),
    (COMPLETE, {"model": MODEL, "prompt": [1, "2"]}, "prompt", None),
    # ([[1, 2]] is a batch of one prompt, served as [1, 2]: lm-eval sends that)
    (COMPLETE, {"model": MODEL, "prompt": [[1, "2"]]}, "prompt", "list of token ids"),
    (COMPLETE, {"model": MODEL, "prompt": [[[1, 2]]]}, "prompt", "list of token ids"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": "y"}},
     "stream_options", None),
    (COMPLETE, {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, "max_tokens", None),
    (COMPLETE, {"model": MODEL, "prompt": "x", "seed": True}, "seed", None),
    # values no sampler can use (temperature / top_k cross the wire as float32 / int32)
    (COMPLETE, {"model": MODEL, "prompt": "x", "temperature": 1e39}, "temperature", "finite"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "top_k": 2**40}, "top_k", "top_k must be in"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "top_k": 2**40, "stream": True}, "top_k",
     "top_k must be in"),
    (COMPLETE, {"model": MODEL, "prompt": "x", "top_k": -2}, "top_k", None),
    (COMPLETE, {"model": MODEL, "prompt": "x", "seed": 2**64}, "seed", None),
    (COMPLETE, {"model": MODEL, "prompt": "x", "specdec_k": -1}, "specdec_k", None),
    (COMPLETE, {"model": MODEL, "prompt": "x", "specdec_k": 2**63}, "specdec_k", None),
    (COMPLETE, {"model": MODEL, "prompt": [-1]}, "prompt", None),
    # prompts far above the context (512 tokens here), in bodies under the size cap (a larger
    # body gets 413: test_fronts)
    (COMPLETE, {"model": MODEL, "prompt": "lorem ipsum " * 20_000}, "prompt",
     "fills the model's context"),
    (COMPLETE, {"model": MODEL, "prompt": "lorem ipsum " * 20_000, "max_tokens": 4},
     "max_tokens", "exceeds the model's context"),
    (COMPLETE, {"model": MODEL, "prompt": [7] * 100_000, "stream": True}, "prompt",
     "fills the model's context"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x " * 300_000}]},
     "messages", "fills the model's context"),
]


def test_bad_http_requests_get_400_and_others_are_unaffected(api, tiny_models):
    tok = load_tokenizer("default")
    prompt = "Once upon a time"
    reference = tok.decode(hf_greedy(tiny_models["target"], tok(prompt)["input_ids"], 24),
                           skip_special_tokens=True)

    def good_stream() -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "stream": True}
        text = ""
        with httpx.Client(base_url=api, timeout=120) as http:
            with http.stream("POST", COMPLETE, json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        text += event["choices"][0]["text"] if event["choices"] else ""
        return text

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(good_stream) for _ in range(2)]  # while the bad ones arrive
        with httpx.Client(base_url=api, timeout=120) as http:
            for path, body, param, message in HTTP_BAD:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = http.post(path, content=content, headers=JSON)
                assert r.status_code == 400, (body if isinstance(body, bytes) else
                                              str(body)[:200], r.text[:300])
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["message"]
                assert err["param"] == param, (str(body)[:100], err)
                if message:
                    assert message in err["message"], (str(body)[:100], err)
        assert [s.result() for s in streams] == [reference, reference]
    assert good_stream() == reference  # and it goes on serving
