"""Decoding on (VerifyRequest.decode_on): after a round with no block the target takes plain
steps by itself in the same call. Its tokens must be those of separate k = 0 calls, exactly:
greedy, the coupled rule's seeded tokens, the rejection rule's, penalties and logprobs included;
the session it leaves must continue as if those calls had been made."""

import grpc
import pytest
from conftest import TOKEN_PROMPTS, generate_on, hf_greedy, run

from specdec.config import MAX_DECODE_ON
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

PROMPT = TOKEN_PROMPTS[1]
STEPS = 6


@pytest.fixture(autouse=True)
def _close_sessions(tiny_services):
    yield
    store = tiny_services["target"].runtime.store
    for sid in store.ids():
        store.close(sid)


def _ref(sid, prefix=()):
    return pb.SessionRef(session_id=sid, prefix_len=len(prefix), prefix_hash=rolling_hash(prefix))


async def _verify(address, request):
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.TargetServiceStub(ch).Verify(request, timeout=30)


def _one_call(address, sid, sampling, steps, stop_ids=()):
    """The prompt's verdict and `steps` tokens decoded on, in one call: (tokens, logprobs, resp)."""
    resp = run(_verify(address, pb.VerifyRequest(
        session=_ref(sid), tokens=PROMPT, sampling=sampling, logprobs=True, top_logprobs=3,
        decode_on=steps, stop_ids=stop_ids)))
    tokens = [resp.next_token, *resp.decoded]
    return tokens, [(e.logprob, list(e.top_ids)) for e in resp.logprobs], resp


def _separate_calls(address, sid, sampling, n):
    """n plain k = 0 calls, each sending the token the last one emitted."""
    history, sent, tokens, logprobs = list(PROMPT), [], [], []
    for _ in range(n):
        resp = run(_verify(address, pb.VerifyRequest(
            session=_ref(sid, sent), tokens=history[len(sent):], sampling=sampling,
            logprobs=True, top_logprobs=3)))
        sent = list(history)
        history.append(resp.next_token)
        tokens.append(resp.next_token)
        logprobs += [(e.logprob, list(e.top_ids)) for e in resp.logprobs]
    return tokens, logprobs


SAMPLINGS = {
    "greedy": pb.SamplingParams(),
    "coupled": pb.SamplingParams(temperature=0.9, seed=7, rule=pb.COUPLED),
    "rejection": pb.SamplingParams(temperature=1.2, top_p=0.9, seed=3, rule=pb.REJECTION),
    "penalized": pb.SamplingParams(temperature=0.8, seed=11, rule=pb.COUPLED,
                                   repetition_penalty=1.3, presence_penalty=0.5),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_decoded_tokens_are_those_of_separate_plain_calls(tiny_services, name):
    address = tiny_services["target"].address
    sampling = SAMPLINGS[name]
    tokens, logprobs, resp = _one_call(address, f"on-{name}", sampling, STEPS)
    assert len(resp.decoded) == STEPS and resp.passes == STEPS + 1
    # the cache holds the prompt, next_token and every decoded token but the last
    assert resp.cache_len == len(PROMPT) + STEPS
    expected, expected_lp = _separate_calls(address, f"apart-{name}", sampling, STEPS + 2)
    assert tokens == expected[: STEPS + 1]
    assert len(logprobs) == STEPS + 1
    for (lp, top), (lp_e, top_e) in zip(logprobs, expected_lp):
        assert top == top_e and lp == pytest.approx(lp_e, abs=1e-5)
    # the session continues where the separate calls' would: the next plain call's token
    history = PROMPT + tokens
    nxt = run(_verify(address, pb.VerifyRequest(
        session=_ref(f"on-{name}", history[:-1]), tokens=history[-1:], sampling=sampling)))
    assert nxt.next_token == expected[STEPS + 1]


def test_decoding_on_stops_after_a_stop_id(tiny_services):
    address = tiny_services["target"].address
    greedy, _, _ = _one_call(address, "free", pb.SamplingParams(), STEPS)
    stop = greedy[3]
    first = greedy.index(stop)  # (the stop id may come earlier than at index 3)
    tokens, _, resp = _one_call(address, "stopped", pb.SamplingParams(), STEPS, stop_ids=[stop])
    assert tokens == greedy[: first + 1]
    assert resp.passes == first + 1


@pytest.mark.parametrize("request_,message", [
    (pb.VerifyRequest(session=_ref("bad"), tokens=[1], decode_on=MAX_DECODE_ON + 1), "decode_on"),
    (pb.VerifyRequest(session=_ref("bad"), tokens=[1], decode_on=2, stop_ids=[10**7]), "stop_ids"),
])
def test_bad_decode_on_is_invalid_argument(tiny_services, request_, message):
    address = tiny_services["target"].address
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(_verify(address, request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert run(_verify(address, pb.VerifyRequest(session=_ref("ok"), tokens=[1, 2]))).cache_len == 2


def test_target_only_rounds_decode_on_with_the_same_text(tiny_models, tiny_services):
    """A target-only generation of 40 tokens: the first round alone (its token goes out at
    once), then rounds of 1 + DECODE_ON tokens; the text is transformers' greedy text, and each
    call sends only the last token (the orchestrator knows what the target's session holds)."""
    from orchestrator.generation import DECODE_ON

    result = run(generate_on(tiny_services, None, PROMPT, "target-only", None,
                             decode_on=DECODE_ON))
    s = result.stats
    assert result.token_ids == hf_greedy(tiny_models["target"], PROMPT, 40)[: len(result.token_ids)]
    n = len(result.token_ids)
    assert s.tokens_per_round[0] == 1
    assert all(t == 1 + DECODE_ON for t in s.tokens_per_round[1:-1])
    assert s.rounds == 1 + -(-(n - 1) // (1 + DECODE_ON))
    assert s.decoded_tokens == n - s.rounds
    assert s.re_prefills == 0
    assert all(c.sent_tokens == 1 for c in s.calls[1:])  # the target kept what it decoded
    assert sum(c.passes for c in s.calls) == n


def test_an_orchestrator_refuses_a_decode_on_the_target_would():
    from orchestrator.loop import Orchestrator

    with pytest.raises(ValueError, match="decode_on must be in"):
        Orchestrator(None, None, None, [0], 2048, decode_on=MAX_DECODE_ON + 1)
