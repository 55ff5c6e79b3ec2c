"""Fake service clients for the round loop's unit tests (test_loop_unit, test_loop_pipelined,
test_loop_load): a target that verifies greedily against ``target_next``, a draft that errs
at fixed positions, and helpers that run generations over them. Not a test module."""

import asyncio
import dataclasses
import time

import grpc

from orchestrator.generation import GenerationRequest
from orchestrator.loop import Orchestrator
from orchestrator.service_clients import CallRecord, ServiceError
from specdec.config import SamplingParams
from specdec.wire import specdec_pb2 as pb

VOCAB = 97
EOS = 96


@dataclasses.dataclass
class FakeRecord(CallRecord):
    """A fake's call record: its start and end are the real ones (tests read their order),
    but the cost model reads the call's nominal time (the fake's await on an idle machine),
    so a busy machine's stall of a fake's sleep never changes what adaptive k chooses."""

    nominal_ms: float = 0.0

    @property
    def wall_ms(self) -> float:
        return self.nominal_ms


def target_next(tokens: list[int]) -> int:
    """The fake target's greedy choice after ``tokens`` (never EOS unless the prompt asks)."""
    return (tokens[-1] * 7 + len(tokens) * 3) % (VOCAB - 1)


def target_text(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target_next(seq))
    return seq[len(prompt):]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeTarget:
    """Verifies a block greedily against target_next, after a short await (so a pipelined
    draft runs beside it)."""

    def __init__(self, eos_after: int | None = None):
        self.info = pb.ModelInfo(forward_ms=[10.0 + i for i in range(9)])
        self.calls = 0
        self.eos_after = eos_after  # emit EOS as the target's token once this many are out
        self.verified: list[tuple[list[int], list[int]]] = []  # (history, block) per call
        self.compute_ms = 1.0  # what each verify reports as its pass's time

    def next_token(self, seq: list[int], prompt_len: int) -> int:
        if self.eos_after is not None and len(seq) - prompt_len >= self.eos_after:
            return EOS
        return target_next(seq)

    async def verify(self, session_id, history, draft_tokens, draft_dists, sampling,
                     request_id="", logprobs=None, prompt_logprobs=False, decode_on=0,
                     stop_ids=(), features_from=None, feature_layers=()):
        start = time.perf_counter()
        await asyncio.sleep(0.002)
        self.calls += 1
        seq = list(history.tokens)
        self.verified.append((list(seq), list(draft_tokens)))
        prompt_len = self.prompt_len
        accepted = 0
        for tok in draft_tokens:
            if tok != self.next_token(seq, prompt_len):
                break
            seq.append(tok)
            accepted += 1
        emitted = [self.next_token(seq, prompt_len)]
        while len(emitted) <= decode_on and emitted[-1] not in stop_ids:  # plain steps
            emitted.append(self.next_token(seq + emitted, prompt_len))
        resp = pb.VerifyResponse(num_accepted=accepted, next_token=emitted[0],
                                 decoded=emitted[1:], compute_ms=self.compute_ms,
                                 passes=len(emitted))
        return resp, FakeRecord("target", start, time.perf_counter(), self.compute_ms,
                                len(draft_tokens), passes=len(emitted), nominal_ms=2.0)

    async def close_session(self, session_id):
        pass


class FakeDraft:
    """Drafts target_next, except at every ``wrong_every``-th position (a poor draft), and
    fails with UNAVAILABLE on the calls listed in ``fail_calls``."""

    def __init__(self, wrong_every: int = 4, fail_calls: set[int] = frozenset()):
        # a pass costs the same over 1..16 rows (a GPU's draft): the cache's rows are cheap
        self.info = pb.ModelInfo(forward_ms=[1.0] * 16)
        self.wrong_every = wrong_every
        self.fail_calls = set(fail_calls)
        self.calls = 0
        self.failed = False

    async def available(self):
        return True

    def mark_failed(self):
        self.failed = True

    def continuation(self, seq: list[int], k: int) -> list[int]:
        """The k tokens this draft proposes after ``seq``."""
        seq, out = list(seq), []
        for _ in range(k):
            tok = target_next(seq)
            if len(seq) % self.wrong_every == 0:
                tok = (tok + 1) % (VOCAB - 1)
            out.append(tok)
            seq.append(tok)
        return out

    async def propose(self, session_id, history, extra, k, sampling, request_id=""):
        start = time.perf_counter()
        self.calls += 1
        if self.calls in self.fail_calls:
            raise ServiceError("draft", grpc.StatusCode.UNAVAILABLE, "down for the test")
        seq = list(history.tokens) + list(extra)  # (as the real client: before it awaits)
        # A draft behind a verify (extra: the block in flight) outlasts the verify pass, so
        # a verdict that drops it finds it still running.
        wait_s = 0.006 if extra else 0.001
        await asyncio.sleep(wait_s)
        out = self.continuation(seq, k)
        return pb.DraftResponse(tokens=out), FakeRecord("draft", start, time.perf_counter(),
                                                        0.5, k, nominal_ms=wait_s * 1000.0)

    def candidates(self, seq: list[int], width: int, exclude: int | None) -> list[int]:
        """This draft's ranking of the next token after ``seq``: its own choice first, then
        the one below it (the target's choice where the draft errs), then above."""
        first = self.continuation(seq, 1)[0]
        ranked = [(first + d) % (VOCAB - 1) for d in (0, -1, 1, -2, 2)][: width + 1]
        return [t for t in ranked if t != exclude][:width]

    async def propose_branches(self, session_id, history, block, width, depth, sampling,
                               request_id=""):
        start = time.perf_counter()
        self.calls += 1
        if self.calls in self.fail_calls:
            raise ServiceError("draft", grpc.StatusCode.UNAVAILABLE, "down for the test")
        await asyncio.sleep(0.001)
        seq, branches = list(history.tokens), []
        for j in range(len(block) + 1):
            exclude = block[j] if j < len(block) else None
            for t in self.candidates(seq + block[:j], width, exclude):
                branches.append(pb.BranchBlock(
                    accepted=j, token=t, tokens=self.continuation(seq + block[:j] + [t], depth)))
        rec = FakeRecord("draft", start, time.perf_counter(), 0.5,
                         sum(len(b.tokens) for b in branches), branches=len(branches),
                         nominal_ms=1.0)
        return pb.DraftResponse(branches=branches), rec

    async def close_session(self, session_id):
        pass


def generate(mode: str, k: int | None = None, draft=None, target=None, max_new: int = 40,
             prompt=(5, 11, 23), branches: bool = True, shared_cores: bool = False):
    target = target or FakeTarget()
    target.prompt_len = len(prompt)
    draft = draft if draft is not None else FakeDraft()
    # shared_cores: what orchestrator_for gives for local services
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=shared_cores)
    req = GenerationRequest(list(prompt), max_new, SamplingParams(), [], mode, k,
                            prompt_lookup=False, branches=branches)
    return asyncio.run(orch.generate(req))


def pipelined_exactly(k: int, wrong_every: int):
    """A pipelined generation of 80 tokens over a fake draft that errs every ``wrong_every``
    positions, checked: the target's text, and every verified block the draft's continuation
    of the committed history (what it drafted after that very verdict)."""
    target, draft = FakeTarget(), FakeDraft(wrong_every=wrong_every)
    result = generate("pipelined", k, max_new=80, target=target, draft=draft)
    assert result.token_ids == target_text([5, 11, 23], 80)
    for history, block in target.verified:
        assert block == draft.continuation(history, len(block))
    return result


def run_together(orch, requests):
    async def run():
        return await asyncio.gather(*(orch.generate(r) for r in requests))
    return asyncio.run(run())
