"""The round loop over fake service clients: fast checks of what every mode must keep (the
target's tokens, EOS and length limits, stats that add up, pipelining's hits and misses, a
failing draft) without models or gRPC. The real services are tested in test_pipeline and
test_real_pair."""

import asyncio
import time

import grpc
import pytest

from orchestrator import adaptive
from orchestrator.generation import DECODE_ON, GenerationRequest
from orchestrator.loop import Orchestrator
from orchestrator.service_clients import CallRecord, ServiceError
from specdec.config import SamplingParams
from specdec.wire import specdec_pb2 as pb

VOCAB = 97
EOS = 96


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
                     stop_ids=()):
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
        return resp, CallRecord("target", start, time.perf_counter(), self.compute_ms,
                                len(draft_tokens), passes=len(emitted))

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
        await asyncio.sleep(0.006 if extra else 0.001)
        out = self.continuation(seq, k)
        return pb.DraftResponse(tokens=out), CallRecord("draft", start, time.perf_counter(),
                                                        0.5, k)

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
        rec = CallRecord("draft", start, time.perf_counter(), 0.5,
                         sum(len(b.tokens) for b in branches), branches=len(branches))
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


@pytest.mark.parametrize("mode", ["target-only", "spec", "pipelined"])
@pytest.mark.parametrize("k", [None, 1, 4])
def test_every_mode_emits_the_targets_tokens(mode, k):
    result = generate(mode, k)
    assert result.token_ids == target_text([5, 11, 23], 40)
    s = result.stats
    assert s.rounds == len(s.tokens_per_round) == len(s.k_requested)
    assert sum(s.tokens_per_round) >= len(result.token_ids)  # the last round may overshoot
    assert s.accepted_tokens == sum(s.accepted_per_position)
    assert s.draft_tokens == sum(k * n for k, n in s.rounds_per_k.items())
    if mode == "target-only":  # the first token alone, then 1 + DECODE_ON a call
        assert s.draft_tokens == 0 and s.rounds == 1 + -(-39 // (1 + DECODE_ON))
        assert s.decoded_tokens == 40 - s.rounds


def test_pipelined_rounds_hit_and_miss_with_a_poor_draft_and_cancel_the_misses():
    target, draft = FakeTarget(), FakeDraft()
    result = generate("pipelined", 3, max_new=80, target=target, draft=draft, branches=False)
    # Every verified block is the draft's continuation of the committed history: a block
    # drafted behind a verify is kept only when the verdict is what it was drafted after.
    for history, block in target.verified:
        assert block == draft.continuation(history, len(block))
    s = result.stats
    assert result.token_ids == target_text([5, 11, 23], 80)
    assert s.pipeline_hits > 0 and s.pipeline_misses > 0
    cancelled = [c for c in s.calls if c.service == "draft" and c.outcome == "cancelled"]
    assert cancelled  # a rejected block's speculative draft is cancelled, not awaited
    # a hit's block was verified without a draft call of its own that round
    assert s.tokens_per_round and max(s.tokens_per_round) >= 2


@pytest.mark.parametrize("shared", [False, True])
def test_sequential_rounds_prefill_the_draft_beside_the_targets_prefill(shared):
    """spec's first round verifies no block: the draft prefills the prompt (a 1-token call)
    while the target prefills it, and the next round's draft call goes after that one; where
    the draft shares the target's cores, its prefill waits for the target's first token."""
    draft = FakeDraft(wrong_every=5)
    result = generate("spec", 3, draft=draft, max_new=20, shared_cores=shared)
    assert result.token_ids == target_text([5, 11, 23], 20)
    calls = result.stats.calls
    first_verify = next(c for c in calls if c.service == "target")
    first_draft, *later = [c for c in calls if c.service == "draft"]
    assert result.stats.tokens_per_round[0] == 1 and result.stats.draft_tokens > 0
    assert all(c.start >= first_draft.end for c in later)  # one call at a time
    assert draft.calls == len(later) + 1
    if shared:  # the draft's first call (its prefill) after the target's prefill
        assert first_draft.start >= first_verify.end and first_draft.tokens == 3
    else:
        assert first_draft.tokens == 1 and first_draft.start < first_verify.end
        assert later


def test_eos_ends_the_generation_where_the_target_emits_it():
    for mode in ("target-only", "spec", "pipelined"):
        result = generate(mode, 3, target=FakeTarget(eos_after=9))
        assert result.finish_reason == "stop"
        assert result.token_ids == target_text([5, 11, 23], 9) + [EOS], mode


def test_a_failing_draft_costs_speed_not_tokens():
    draft = FakeDraft(fail_calls={2, 3})
    result = generate("spec", 2, draft=draft)
    assert result.token_ids == target_text([5, 11, 23], 40)
    assert result.stats.draft_failures == 2
    # each failed round's token and those the target decoded on after it
    assert result.stats.tokens_without_draft == 2 * (1 + DECODE_ON)
    assert draft.failed  # a service failure (not the request's fault) marks the draft down


def test_the_length_limit_holds_inside_an_accepted_block():
    result = generate("spec", 4, max_new=7)
    assert result.token_ids == target_text([5, 11, 23], 7)
    assert result.finish_reason == "length"


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


def test_the_speculation_cache_serves_the_verdicts_it_drafted_for():
    s = pipelined_exactly(3, wrong_every=3).stats
    # the fake draft's second choice is the target's token at each of its mistakes, so the
    # cache (width >= 1 per acceptance length) holds nearly every verdict
    assert s.branches_drafted > s.pipeline_hits > 2 * s.pipeline_misses
    plain = generate("pipelined", 3, max_new=80, draft=FakeDraft(wrong_every=3),
                     branches=False).stats
    assert s.pipeline_hits > plain.pipeline_hits
    assert plain.branches_drafted == 0


def test_rounds_that_draft_the_single_guess_and_rounds_that_draft_the_cache_mix(monkeypatch):
    """The cost model may draft the single guess behind some verifies and the cache behind
    others (KController.drafts_guess): each round's block is still the draft's continuation
    of the committed history, the text the target's, and both kinds of hits are counted."""
    calls = []

    def alternate(self, k, a=None):
        calls.append(k)
        return bool(k) and len(calls) % 2 == 0

    monkeypatch.setattr(adaptive.KController, "drafts_guess", alternate)
    result = pipelined_exactly(2, wrong_every=13)
    s = result.stats
    assert s.guess_calls > 0 and s.branches_drafted > 0
    assert 0 < s.cache_hits < s.pipeline_hits  # the rest were the guess's hits
    assert result.summary()["wasted_branches"] == s.branches_drafted - s.cache_hits


def test_a_miss_round_that_drafts_nothing_still_drafts_the_cache_behind_it(monkeypatch):
    """A pipelined miss drafts its block after the verdict, costed as a sequential round's
    (KController.best_k, now): where that does not pay, the round verifies no block, but the
    draft still drafts the cache's branches behind it (the target's likeliest next tokens,
    each with its block), so the next round can hit again instead of every later round
    missing, drafting nothing behind nothing."""
    monkeypatch.setattr(adaptive.KController, "best_k",
                        lambda self, a=None, now=False: 0 if now else 3)

    class Blind(FakeDraft):  # at every 7th position no candidate is the target's token
        def candidates(self, seq, width, exclude):
            if len(seq) % 7:
                return super().candidates(seq, width, exclude)
            return [(target_next(seq) + 10 + i) % (VOCAB - 1) for i in range(width)]

    target, draft = FakeTarget(), Blind(wrong_every=3)
    result = generate("pipelined", None, max_new=80, target=target, draft=draft)
    s = result.stats
    assert result.token_ids == target_text([5, 11, 23], 80)
    empty = [block for _, block in target.verified[1:] if not block]
    assert len(empty) >= 3  # miss rounds: nothing drafted now
    assert s.pipeline_misses >= len(empty) - 1
    assert s.pipeline_hits >= 3 * len(empty)  # each is followed by hits again


def test_the_cache_width_follows_the_costs_and_narrows_when_calls_run_long():
    from orchestrator.adaptive import BranchWidth, Costs

    costs = Costs(target_ms=[30.0 + 2 * i for i in range(9)], draft_step_ms=2.0,
                  draft_forward=[2.0 + 0.25 * i for i in range(16)], draft_call_ms=0.5)
    widths = BranchWidth(costs)
    wide = widths.choose(3, 3)
    # the widest whose call hides behind a 37 ms verify: 9 * (k + 1) = 36 branches
    assert wide == 9 < adaptive.MAX_WIDTH
    assert costs.branch_call_ms(3, wide, 3) <= costs.verify_ms(3) < \
        costs.branch_call_ms(3, wide + 1, 3)
    for _ in range(12):  # the calls take 3x what the costs predict (a busy draft)
        widths.observe(3, wide, 3, 3 * costs.branch_call_ms(3, wide, 3))
    assert widths.choose(3, 3) < wide
    slow = BranchWidth(Costs(target_ms=[5.0] * 9, draft_step_ms=2.0,
                             draft_forward=[2.0 + 0.25 * i for i in range(16)]))
    assert slow.choose(3, 3) == 1  # nothing wider hides behind a 5 ms verify


def test_the_cache_is_off_where_the_orchestrator_says_the_draft_shares_the_cores():
    target, draft = FakeTarget(), FakeDraft(wrong_every=3)
    target.prompt_len = 3
    # what orchestrator_for gives for local services
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=True)
    req = GenerationRequest([5, 11, 23], 60, SamplingParams(), [], "pipelined", 3,
                            prompt_lookup=False)
    result = asyncio.run(orch.generate(req))
    assert result.token_ids == target_text([5, 11, 23], 60)
    assert result.stats.branches_drafted == 0  # plain pipelining only
    assert result.stats.pipeline_hits + result.stats.pipeline_misses > 0


def _together(orch, requests):
    async def run():
        return await asyncio.gather(*(orch.generate(r) for r in requests))
    return asyncio.run(run())


@pytest.mark.parametrize("shared", [True, False])
def test_generations_sharing_the_cores_draft_only_while_alone(shared):
    """On shared cores the cost model's crowding term counts the generations running as the
    target's batch: two sequential generations leave the draft idle (a block drafted between
    one's calls would cost the other's pass; crowded rounds) and a generation drafts again
    once it is alone; elsewhere all of them draft."""
    target, draft = FakeTarget(), FakeDraft(wrong_every=5)
    target.prompt_len = 3
    target.compute_ms = 10.0  # as calibrated: a verify costs 10x a draft step
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=shared)

    def req(n, **kw):
        return GenerationRequest([5, 11, 23], n, SamplingParams(**kw), [], "spec", None,
                                 prompt_lookup=False)

    long, short = _together(orch, [req(60), req(12)])
    assert long.token_ids == target_text([5, 11, 23], 60)
    assert short.token_ids == target_text([5, 11, 23], 12)
    if not shared:
        assert long.stats.crowded_rounds == short.stats.crowded_rounds == 0
        assert short.stats.draft_tokens > 0
        return
    # the short one ran beside the long one all along: every round target-only
    assert short.stats.crowded_rounds == short.stats.rounds and short.stats.draft_tokens == 0
    # the long one was crowded while the short one ran, and drafts again after it ended
    k = long.stats.k_requested
    assert 0 < long.stats.crowded_rounds < long.stats.rounds
    assert long.stats.draft_tokens > 0 and k[-1] > 0
    assert orch.active == 0
    # alone, a generation on shared cores drafts
    alone = asyncio.run(orch.generate(req(12)))
    assert alone.stats.crowded_rounds == 0 and alone.stats.draft_tokens > 0
    # a request whose text depends on k (the rejection rule), or with a fixed k, keeps it
    sampled, fixed = _together(orch, [req(12, temperature=0.8, seed=3, rule="rejection"),
                                      GenerationRequest([5, 11, 23], 12, SamplingParams(), [],
                                                        "spec", 2, prompt_lookup=False)])
    assert sampled.stats.crowded_rounds == fixed.stats.crowded_rounds == 0
    assert fixed.stats.draft_tokens > 0


def test_crowded_generations_still_take_prompt_lookups_that_pay():
    """A lookup block costs no draft compute, so crowding on shared cores does not price it:
    two generations of a prompt that repeats itself, crowded (no draft block), still verify
    the lookup blocks that the lookup's own rate finds worth it (before, crowding vetoed
    lookups too)."""
    prompt = [1, 2, 3, 4] * 5
    target, draft = FakeTarget(), FakeDraft(wrong_every=5)
    target.prompt_len = len(prompt)
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024,
                        shared_cores=True)
    reqs = [GenerationRequest(list(prompt), 24, SamplingParams(), [], "spec", None)
            for _ in range(2)]
    for r in _together(orch, reqs):
        assert r.token_ids == target_text(prompt, 24)
        assert r.stats.lookup_rounds > 0 and r.stats.crowded_rounds > 0


def test_concurrent_pipelined_generations_never_wait_for_the_draft(monkeypatch):
    """Two pipelined generations at once on separate hardware (the cache on): a miss round
    goes to the target at once with no block instead of drafting one now, and a branch call
    still running at its verdict is dropped (counted late, and a miss) instead of awaited;
    the text is still the target's. (k is 2 for blocks behind a verify, so hits take
    blocks whatever the fake's costs say; a miss's k is the controller's own.)"""
    real_best_k = adaptive.KController.best_k
    monkeypatch.setattr(adaptive.KController, "best_k",
                        lambda self, a=None, now=False: real_best_k(self, a, now) if now else 2)

    class SlowAtTimes(FakeDraft):  # every 4th branch call outlasts its verify by far
        async def propose_branches(self, *args, **kwargs):
            if self.calls % 4 == 3:
                await asyncio.sleep(0.05)
            return await super().propose_branches(*args, **kwargs)

    target, draft = FakeTarget(), SlowAtTimes(wrong_every=3)
    # a pass that grows with its rows: narrow branch calls, so that only the slow ones are
    # late on a busy machine
    draft.info = pb.ModelInfo(forward_ms=[1.0])
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
    reqs = [GenerationRequest([5, 11, 23], 60, SamplingParams(), [], "pipelined", None,
                              prompt_lookup=False) for _ in range(2)]
    results = _together(orch, reqs)
    together = min(max(c.end for c in r.stats.calls if c.service == "target")
                   for r in results)  # until the first generation's last verdict
    for r in results:
        s = r.stats
        assert r.token_ids == target_text([5, 11, 23], 60)
        assert s.pipeline_hits > 0 and s.late_branch_calls > 0
        assert s.pipeline_misses >= s.late_branch_calls
        drafts = [c for c in s.calls if c.service == "draft"]
        assert sum(c.outcome == "cancelled" for c in drafts) == s.late_branch_calls
        # while both ran, only branch calls behind verifies (and their cancelled records):
        # no block was drafted after a verdict, between two verify calls (alone at the end
        # a generation may wait for the draft again)
        assert all(c.branches or c.outcome == "cancelled" or c.start >= together
                   for c in drafts)
        assert not any(c.after_draft for c in s.calls
                       if c.service == "target" and c.start < together)
    assert orch.active == 0
    # alone, a round waits for its branch call (no other session's pass to miss)
    alone = asyncio.run(orch.generate(reqs[0]))
    assert alone.token_ids == target_text([5, 11, 23], 60)
    assert alone.stats.late_branch_calls == 0 and alone.stats.pipeline_hits > 0


def test_adaptive_k_starts_from_what_earlier_generations_accepted_while_others_run():
    """A greedy generation that starts while others run starts from the orchestrator's
    pooled acceptance; alone, or rejection-sampled (k changes its text), from the fixed
    prior, whatever ran before."""
    target, draft = FakeTarget(), FakeDraft(wrong_every=1)  # never right: nothing accepted
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)

    def req(k=None, **kw):
        return GenerationRequest([5, 11, 23], 40, SamplingParams(**kw), [], "spec", k,
                                 prompt_lookup=False)

    assert orch._controller(req()).acceptance == 0.5
    result = asyncio.run(orch.generate(req(k=2)))  # a fixed k teaches the pool too
    assert result.token_ids == target_text([5, 11, 23], 40) and result.stats.accepted_tokens == 0
    assert orch.active == 0 and orch._controller(req()).acceptance == 0.5  # alone
    orch.active = 1  # as while another generation runs
    assert orch._controller(req()).acceptance < 0.1
    sampled = orch._controller(req(temperature=0.8, seed=3, rule="rejection"))
    assert sampled.acceptance == 0.5 and sampled.pool is None
    # A draft better than the prior: alone too, a new generation starts from what it accepted
    orch.active = 0
    good = Orchestrator(target, FakeDraft(wrong_every=10 ** 9), FakeTokenizer(), [EOS],
                        max_context=1024)
    stats = asyncio.run(good.generate(req(k=2))).stats
    assert stats.accepted_tokens == stats.draft_tokens > 20
    assert good.active == 0 and good._controller(req()).acceptance > 0.9


def test_a_prompt_lookup_takes_a_round_only_where_it_beats_the_draft_models_block():
    """A prompt that repeats itself offers a lookup block at its first round. Over a draft
    that has been right every time (pooled acceptance ~1: its block of 8 beats a lookup at
    its prior), the draft drafts; over a draft that is never right, the lookup takes it."""
    prompt = [1, 2, 3, 4] * 5
    seen = {}
    for name, wrong_every in (("perfect", 10 ** 9), ("never right", 1)):
        target, draft = FakeTarget(), FakeDraft(wrong_every=wrong_every)
        orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
        for p, lookup in (([5, 11, 23], False), (prompt, True)):  # the first fills the pool
            target.prompt_len = len(p)
            req = GenerationRequest(list(p), 24, SamplingParams(), [], "spec", None,
                                    prompt_lookup=lookup)
            result = asyncio.run(orch.generate(req))
            assert result.token_ids == target_text(p, 24)
        seen[name] = result.stats.lookup_rounds
    assert seen["perfect"] == 0
    assert seen["never right"] >= 1


def test_under_load_a_probe_whose_branch_call_comes_late_backs_off():
    """Under load a probe is a branch call behind a verify; one still running at its verdict
    is dropped and counts as a probe that left speculation unpaid: the next comes after the
    doubled backoff, not behind every following round (a draft session that has not drafted
    for many rounds catches up on all of them first, and came as late each time)."""
    class AlwaysLate(FakeDraft):
        async def propose_branches(self, *args, **kwargs):
            await asyncio.sleep(0.03)
            return await super().propose_branches(*args, **kwargs)

    target, draft = FakeTarget(), AlwaysLate(wrong_every=1)
    draft.info = pb.ModelInfo(forward_ms=[1.0])
    target.prompt_len = 3
    orch = Orchestrator(target, draft, FakeTokenizer(), [EOS], max_context=1024)
    reqs = [GenerationRequest([5, 11, 23], 300, SamplingParams(), [], "pipelined", None,
                              prompt_lookup=False) for _ in range(2)]
    for r in _together(orch, reqs):
        s = r.stats
        assert r.token_ids == target_text([5, 11, 23], 300)
        assert s.late_branch_calls > 0 and s.pipeline_hits == 0  # branch calls went, all late
        # The first ones teach the cache's hit rate (no branch is ever on time) and blocks stop
        # paying; from then on only probes go, at most one every PROBE_EVERY rounds.
        verifies = [c.start for c in s.calls if c.service == "target"]
        half = verifies[len(verifies) // 2]
        late = sum(c.outcome == "cancelled" and c.start > half for c in s.calls)
        assert late <= (len(verifies) // 2) // adaptive.PROBE_EVERY, late
