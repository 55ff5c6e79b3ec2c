"""Faults during real generations: service processes killed, restarted and hung (by pid)."""

import asyncio
import os
import signal

import pytest
from conftest import free_port, hf_greedy, run

from orchestrator.generation import GenerationRequest
from orchestrator.local import ServiceProcess, service_args
from orchestrator.pair import close, connect
from orchestrator.service_clients import ServiceError

PROMPT = list(range(2000, 2040))
MAX_NEW = 60


def start(role, model, port=0, target=None, extra=()):
    extra = list(extra) + (["--target", target] if target else [])
    p = ServiceProcess(role, service_args(model, 1, ["--no-calibrate", *extra]), port=port)
    p.wait_port(300)
    return p


async def generate_with_fault(target_addr, draft_addr, fault, at_delta=3, mode="spec", k=3,
                              **connect_kw):
    orch = await connect(target_addr, draft_addr, **connect_kw)
    try:
        req = GenerationRequest(PROMPT, MAX_NEW, mode=mode, k=k)
        result, n = None, 0
        async for item in orch.stream(req):
            if hasattr(item, "stats"):
                result = item
            else:
                n += 1
                if n == at_delta:
                    await asyncio.get_running_loop().run_in_executor(None, fault)
        return result, orch
    finally:
        await close(orch)


@pytest.fixture
def reference(tiny_models):
    return hf_greedy(tiny_models["target"], PROMPT, MAX_NEW)


@pytest.mark.parametrize("mode", ["spec", "pipelined"])
def test_draft_killed_mid_generation_finishes_target_only(tiny_models, reference, mode):
    target = start("target", tiny_models["target"])
    draft = start("draft", tiny_models["near_draft"], target=tiny_models["target"])
    try:
        result, _ = run(generate_with_fault(target.address, draft.address, draft.kill, mode=mode))
        assert result.token_ids == reference
        assert result.stats.draft_failures >= 1
        assert result.stats.tokens_without_draft > 0
        assert result.stats.accepted_tokens > 0  # it did speculate before the kill
    finally:
        target.stop()
        draft.stop()


def test_draft_comes_back_and_speculation_resumes(tiny_models, reference):
    port = free_port()
    target = start("target", tiny_models["target"])
    draft = start("draft", tiny_models["near_draft"], port=port, target=tiny_models["target"])
    holder = {}

    async def scenario():
        orch = await connect(target.address, draft.address)
        try:
            draft.kill()
            first = await orch.generate(GenerationRequest(PROMPT, MAX_NEW, k=3, mode="spec"))
            holder["draft"] = await asyncio.get_running_loop().run_in_executor(
                None, lambda: start("draft", tiny_models["near_draft"], port=port,
                                    target=tiny_models["target"]))
            orch.draft.backoff.retry_at = 0.0  # don't wait out the backoff in a test
            second = await orch.generate(GenerationRequest(PROMPT, MAX_NEW, k=3, mode="spec"))
            return first, second
        finally:
            await close(orch)

    try:
        first, second = run(scenario())
        assert first.token_ids == reference and second.token_ids == reference
        # the draft was dead throughout (the first round drafts nothing anyway, its call is
        # the draft's prefill beside the target's, which failed; the last round needs no
        # draft: one token was left)
        assert first.stats.draft_failures >= 1
        assert first.stats.tokens_without_draft >= len(reference) - 2
        assert second.stats.tokens_without_draft == 0 and second.stats.draft_tokens > 0
    finally:
        target.stop()
        draft.stop()
        if "draft" in holder:
            holder["draft"].stop()


def test_draft_hung_is_bypassed_after_its_deadline(tiny_models, reference):
    target = start("target", tiny_models["target"])
    draft = start("draft", tiny_models["near_draft"], target=tiny_models["target"])

    async def scenario():
        orch = await connect(target.address, draft.address)
        orch.draft.draft_timeout_s = 1.0
        try:
            result, n = None, 0
            async for item in orch.stream(GenerationRequest(PROMPT, MAX_NEW, k=3, mode="pipelined")):
                if hasattr(item, "stats"):
                    result = item
                else:
                    n += 1
                    if n == 2:
                        os.killpg(draft.proc.pid, signal.SIGSTOP)
            return result
        finally:
            await close(orch)

    try:
        result = run(scenario())
        assert result.token_ids == reference
        assert result.stats.draft_failures >= 1 and result.stats.tokens_without_draft > 0
    finally:
        os.killpg(draft.proc.pid, signal.SIGCONT)
        target.stop()
        draft.stop()


def test_target_restarted_mid_generation_re_prefills(tiny_models, reference):
    port = free_port()
    target = start("target", tiny_models["target"], port=port)
    draft = start("draft", tiny_models["near_draft"], target=tiny_models["target"])
    restarted = {}

    def restart():
        target.kill()
        restarted["p"] = start("target", tiny_models["target"], port=port)

    try:
        # (a generation that may wait for a target that is down: --target-deadline-s)
        result, _ = run(generate_with_fault(target.address, draft.address, restart, at_delta=4,
                                            target_deadline_s=60.0))
        assert result.token_ids == reference
        assert result.stats.re_prefills >= 1
    finally:
        target.stop()
        draft.stop()
        if "p" in restarted:
            restarted["p"].stop()


def test_target_down_past_the_deadline_fails_with_a_retriable_error(tiny_models):
    target = start("target", tiny_models["target"])

    async def scenario():
        orch = await connect(target.address, None)
        orch.target.unavailable_deadline_s = 2.0
        try:
            chunks = []
            with pytest.raises(ServiceError) as info:
                async for item in orch.stream(GenerationRequest(PROMPT, MAX_NEW, mode="target-only")):
                    if hasattr(item, "stats"):
                        chunks.append("complete")  # must never be reported complete
                    else:
                        chunks.append(item.text)
                        if len(chunks) == 2:
                            target.kill()
            return info.value, chunks
        finally:
            await close(orch)

    try:
        err, chunks = run(scenario())
        assert err.retriable and err.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        assert "complete" not in chunks
    finally:
        target.stop()


class _AnswerOnCue:
    """A session stream whose answer arrives when the test says (a crafted race: a real
    stream cannot be made to answer in the same loop step as a cancellation)."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()
        self.reading = asyncio.Event()
        self.cancelled = False

    async def write(self, req):
        pass

    async def read(self):
        self.reading.set()
        return await self.answer

    def cancel(self):
        self.cancelled = True


def test_a_cancellation_that_arrives_with_the_answer_is_not_lost():
    """A client that leaves cancels its generation; if the cancel meets a service's answer in
    the same loop step, the call must still end cancelled (asyncio.wait_for before 3.12
    returned the answer instead, and the generation ran on to its end)."""
    from orchestrator.service_clients import TargetClient
    from specdec.wire import specdec_pb2 as pb

    async def main():
        client = TargetClient("127.0.0.1:9")  # the channel connects lazily: never here
        stream = _AnswerOnCue()
        client._open_stream = lambda: stream
        try:
            call = asyncio.ensure_future(client._stream_call("s", pb.VerifyRequest(), 5.0))
            await stream.reading.wait()
            stream.answer.set_result(pb.VerifyResponse(next_token=7))
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert stream.cancelled and "s" not in client._streams
        finally:
            await client.close()

    asyncio.run(main())
