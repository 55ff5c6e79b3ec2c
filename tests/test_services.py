"""Draft and target as real gRPC services on loopback (tiny random models), end to end."""

import grpc
import pytest
from conftest import TOKEN_PROMPTS, ServiceThread, generate_on, hf_greedy, make_tiny_model, run

from orchestrator.pair import TokenizerMismatch, connect
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

PROMPTS = TOKEN_PROMPTS


@pytest.fixture(autouse=True)
def _close_leftover_sessions(tiny_services):
    """Tests here open sessions by raw RPCs; close them so later tests see clean services."""
    yield
    for svc in tiny_services.values():
        for sid in svc.runtime.store.ids():
            svc.runtime.store.close(sid)


@pytest.mark.parametrize("mode", ["target-only", "spec", "pipelined"])
@pytest.mark.parametrize("draft_key", ["draft", "self_draft", "ngram"])
@pytest.mark.parametrize("k", [3, None])
def test_greedy_output_equals_transformers(tiny_models, tiny_services, mode, draft_key, k):
    for prompt in PROMPTS:
        ref = hf_greedy(tiny_models["target"], prompt, 40)
        result = run(generate_on(tiny_services, draft_key, prompt, mode, k))
        assert result.token_ids == ref[: len(result.token_ids)]
        assert len(result.token_ids) == 40 or result.finish_reason == "stop"
        if mode == "target-only":
            assert result.stats.draft_tokens == 0


def test_self_draft_accepts_everything(tiny_services):
    result = run(generate_on(tiny_services, "self_draft", PROMPTS[1], "spec", 4))
    assert result.stats.acceptance_rate == 1.0
    # the first round verifies no block (the draft prefills beside it), then 39 tokens at 5
    # per round
    assert result.stats.rounds == 1 + 8
    assert result.stats.tokens_per_round[0] == 1 and set(result.stats.tokens_per_round[1:-1]) == {5}


def test_bad_draft_rejections_and_pipeline_drops_are_counted(tiny_models, tiny_services):
    result = run(generate_on(tiny_services, "draft", PROMPTS[0], "pipelined", 3))
    s = result.stats
    assert s.draft_tokens > s.accepted_tokens  # rejections happened
    assert s.pipeline_misses > 0  # speculative blocks were dropped and the draft rolled back
    assert result.token_ids == hf_greedy(tiny_models["target"], PROMPTS[0], 40)


def test_lost_sessions_are_re_prefilled_without_changing_text(tiny_models, tiny_services):
    def drop_all(n):
        async def hook(i):
            if i == n:
                for key in ("target", "self_draft"):
                    store = tiny_services[key].runtime.store
                    for sid in store.ids():
                        store.close(sid)
        return hook

    prompt = PROMPTS[1]
    result = run(generate_on(tiny_services, "self_draft", prompt, "spec", 3, hook=drop_all(2)))
    assert result.stats.re_prefills >= 2  # both services lost it and were re-prefilled
    assert result.token_ids == hf_greedy(tiny_models["target"], prompt, 40)


def test_sessions_are_released_after_generation(tiny_services):
    run(generate_on(tiny_services, "draft", PROMPTS[0], "pipelined", 3))
    assert len(tiny_services["target"].runtime.store) == 0
    assert len(tiny_services["draft"].runtime.store) == 0


def test_mismatched_tokenizers_are_refused(tmp_path, tiny_models, tiny_services):
    from transformers import AutoTokenizer

    other = make_tiny_model(tmp_path / "other", seed=3, layers=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<specdec-extra-token>"])
    tok.save_pretrained(other)
    svc = ServiceThread("draft", str(other), target=str(other))
    try:
        with pytest.raises(TokenizerMismatch, match="other.*different tokenizers|different tokenizers"):
            run(connect(tiny_services["target"].address, svc.address))
    finally:
        svc.stop()


async def _call(address, method, request):
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (pb_grpc.TargetServiceStub if "Verify" in method else pb_grpc.DraftServiceStub)(ch)
        return await getattr(stub, method)(request, timeout=10)


def _status(address, method, request):
    try:
        run(_call(address, method, request))
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def ref(sid, prefix=()):
    return pb.SessionRef(session_id=sid, prefix_len=len(prefix), prefix_hash=rolling_hash(prefix))


BAD_REQUESTS = [
    ("Verify", pb.VerifyRequest(session=ref("s"), tokens=[]), grpc.StatusCode.INVALID_ARGUMENT,
     "tokens must not be empty"),
    ("Verify", pb.VerifyRequest(session=ref("s"), tokens=[10**7]), grpc.StatusCode.INVALID_ARGUMENT,
     "token ids must be in"),
    ("Verify", pb.VerifyRequest(session=ref("ghost", [1, 2]), tokens=[3]), grpc.StatusCode.NOT_FOUND,
     "not open"),
    ("Verify", pb.VerifyRequest(session=ref("s"), tokens=[1], draft_tokens=[2],
                                sampling=pb.SamplingParams(temperature=1.0, rule=pb.REJECTION)),
     grpc.StatusCode.INVALID_ARGUMENT, "rejection rule needs one draft distribution per draft"),
    ("Verify", pb.VerifyRequest(session=ref("s"), tokens=[1], draft_tokens=[2],
                                sampling=pb.SamplingParams(temperature=1.0, rule=9)),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown acceptance rule 9"),
    ("Verify", pb.VerifyRequest(session=ref("s"), tokens=[1], sampling=pb.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("Propose", pb.DraftRequest(session=ref("s"), tokens=[1], k=0), grpc.StatusCode.INVALID_ARGUMENT,
     "k must be in"),
    ("Propose", pb.DraftRequest(session=ref("s"), tokens=[], k=2), grpc.StatusCode.INVALID_ARGUMENT,
     "tokens must not be empty"),
    ("Propose", pb.DraftRequest(session=ref("ghost", [4]), tokens=[1], k=2), grpc.StatusCode.NOT_FOUND,
     "not open"),
    ("Propose", pb.DraftRequest(session=pb.SessionRef(session_id=""), tokens=[1], k=2),
     grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
]


@pytest.mark.parametrize("method,request_,code,message", BAD_REQUESTS)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(tiny_services, method, request_,
                                                                   code, message):
    svc = tiny_services["target" if method == "Verify" else "draft"]
    got, details = _status(svc.address, method, request_)
    assert got == code and message in details, (got, details)
    good = (pb.VerifyRequest(session=ref("ok"), tokens=[1, 2, 3]) if method == "Verify"
            else pb.DraftRequest(session=ref("ok"), tokens=[1, 2, 3], k=2))
    assert _status(svc.address, method, good)[0] == grpc.StatusCode.OK


def test_prefix_mismatch_is_failed_precondition(tiny_services):
    addr = tiny_services["target"].address
    run(_call(addr, "Verify", pb.VerifyRequest(session=ref("m"), tokens=[1, 2, 3])))
    code, details = _status(addr, "Verify", pb.VerifyRequest(session=ref("m", [1, 9, 3]), tokens=[4]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "mismatch" in details


def test_health_and_reflection(tiny_services):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def probe(address):
        async with grpc.aio.insecure_channel(address) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"), timeout=5)
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for r in stream for s in r.list_services_response.service]
            return h.status, names

    status, names = run(probe(tiny_services["target"].address))
    assert status == 1  # SERVING
    assert "specdec.v1.TargetService" in names and "grpc.health.v1.Health" in names


def test_services_log_one_line_per_request(tiny_services, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="specdec.serving.session")
    result = run(generate_on(tiny_services, "self_draft", PROMPTS[0], "spec", 3))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("closed ")]
    assert len(lines) == 2  # one per service
    rid = result.request_id
    for line in lines:
        assert f"request={rid}" in line and "calls=" in line and "compute_ms=" in line
    target_line = next(line for line in lines if "accepted=" in line and "acceptance=" in line)
    assert f"accepted={result.stats.accepted_tokens}" in target_line


def test_draft_calls_share_a_stream_per_session_and_a_cancelled_call_drops_only_its_own(
        tiny_services):
    """Draft calls go over one stream per session; cancelling one (a dropped speculative
    propose) takes its stream down, and the session's next call, on a new stream, proposes
    exactly what a fresh session would."""
    import asyncio

    from orchestrator.service_clients import DraftClient, History
    from specdec.config import SamplingParams

    async def main():
        draft = DraftClient(tiny_services["draft"].address)
        await draft.wait_ready()
        try:
            history, greedy = History(list(PROMPTS[0])), SamplingParams()
            first, _ = await draft.propose("st-a", history, [], 3, greedy)
            stream = draft._streams["st-a"]
            history.extend(first.tokens[:1])
            again, _ = await draft.propose("st-a", history, [], 3, greedy)
            assert draft._streams["st-a"] is stream  # the same stream carried both calls
            # a call cancelled in flight, then at once the next call for the session
            slow = asyncio.create_task(draft.propose("st-a", history, list(again.tokens), 6,
                                                     greedy))
            await asyncio.sleep(0)
            slow.cancel()
            history.extend(again.tokens[:1])
            after, _ = await draft.propose("st-a", history, [], 3, greedy)
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert draft._streams["st-a"] is not stream
            fresh, _ = await draft.propose("st-b", History(list(history.tokens)), [], 3, greedy)
            assert list(after.tokens) == list(fresh.tokens)
            await draft.close_session("st-a")
            await draft.close_session("st-b")
            assert not draft._streams
        finally:
            await draft.close()

    run(main())
