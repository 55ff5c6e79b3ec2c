"""The speculation cache (pipelined rounds draft a branch for each likely verdict): every branch
is exactly the block the draft drafts after that verdict, the text stays the target's (greedy
and coupled-sampled), hits / misses / wasted branches are counted, bad branch requests get
INVALID_ARGUMENT, and a cancelled branch call leaves the session as a fresh one would be."""

import asyncio

import grpc
import pytest
from conftest import TOKEN_PROMPTS, generate_on, run

from orchestrator.service_clients import History
from specdec.config import SamplingParams
from specdec.serving.branching import BranchCall
from specdec.serving.drafting import ProposeCall
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

GREEDY = SamplingParams()
COUPLED = SamplingParams(temperature=0.9, seed=11)


def _propose(rt, session_id, tokens, k, sampling, prefix: list[int] | None = None):
    prefix = prefix or []
    call = ProposeCall(session_id, len(prefix), rolling_hash(prefix), tokens, k, sampling)
    future, _ = rt.propose(call)
    return future.result(60).tokens


@pytest.mark.parametrize("sampling", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_every_branch_is_the_block_the_draft_drafts_after_its_verdict(tiny_services, sampling):
    rt = tiny_services["near_draft"].runtime
    history = TOKEN_PROMPTS[0]
    block = _propose(rt, "cache-main", history, 4, sampling)  # the block in flight
    # a prefix the session holds (the history but its last token), then H[-1] + the block
    call = BranchCall("cache-main", len(history) - 1, rolling_hash(history[:-1]),
                      history[-1:] + block, len(block), 2, 3, sampling)
    future, _ = rt.propose_branches(call)
    proposal = future.result(60)
    assert [(b.accepted) for b in proposal.branches] == [j for j in range(5) for _ in range(2)]
    assert proposal.cache_len == len(history) + len(block)
    for j in range(5):
        tokens = [b.token for b in proposal.branches if b.accepted == j]
        assert len(set(tokens)) == 2
        if j < len(block):
            assert block[j] not in tokens  # the target would have accepted the draft's token
    guess = _propose(rt, "cache-guess", history + block, 1, sampling)[0]
    assert proposal.branches[-2].token == guess  # j = k, first candidate: plain pipelining's
    for i, b in enumerate(proposal.branches):
        fresh = _propose(rt, f"cache-ref-{i}", history + block[:b.accepted] + [b.token], 3,
                         sampling)
        assert b.tokens == fresh, (b.accepted, b.token)


@pytest.mark.parametrize("sampling", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_pipelined_text_with_the_cache_is_the_targets(tiny_services, sampling):
    async def go():
        out = {}
        for prompt in TOKEN_PROMPTS:
            alone = await generate_on(tiny_services, None, prompt, "target-only", None, 48,
                                      sampling)
            cached = await generate_on(tiny_services, "near_draft", prompt, "pipelined", 3, 48,
                                       sampling)
            assert cached.token_ids == alone.token_ids
            out[tuple(prompt)] = cached
        return out

    results = run(go()).values()
    for r in results:
        s = r.summary()
        assert s["cache_branches"] == r.stats.branches_drafted
        assert s["wasted_branches"] == r.stats.branches_drafted - r.stats.cache_hits
    stats = [r.stats for r in results]
    hits = sum(s.pipeline_hits for s in stats)
    misses = sum(s.pipeline_misses for s in stats)
    branches = sum(s.branches_drafted for s in stats)
    assert hits > 0 and misses > 0  # a near draft: the cache holds most verdicts, not all
    assert branches > hits  # the other branches were drafted and wasted


def test_a_rejection_sampled_request_keeps_plain_pipelining(tiny_services):
    sampling = SamplingParams(temperature=0.9, seed=3, rule="rejection")
    result = run(generate_on(tiny_services, "near_draft", TOKEN_PROMPTS[1], "pipelined", 3, 32,
                             sampling))
    assert result.stats.branches_drafted == 0
    assert result.stats.pipeline_hits + result.stats.pipeline_misses > 0


def _branch_request(history, block, width=2, depth=3, sampling=GREEDY, prefix=0):
    ref = pb.SessionRef(session_id="cache-bad", prefix_len=prefix,
                        prefix_hash=rolling_hash(history[:prefix]))
    return pb.DraftRequest(session=ref, tokens=history[prefix:] + block, k=depth,
                           sampling=sampling.to_wire(pb),
                           branches=pb.BranchSpec(block_len=len(block), width=width,
                                                  depth=depth))


@pytest.mark.parametrize("change, says", [
    (dict(width=20), "width"),
    (dict(depth=65), "depth"),
    (dict(sampling=SamplingParams(temperature=0.8, seed=1, rule="rejection")), "coupled"),
    (dict(sampling=SamplingParams(presence_penalty=0.5)), "penalties"),
])
def test_bad_branch_requests_get_invalid_argument_and_the_service_keeps_serving(
        tiny_services, change, says):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services["near_draft"].address) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Propose(_branch_request(TOKEN_PROMPTS[0], [5, 6, 7, 8], **change))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in err.value.details()
            ok = await stub.Propose(_branch_request(TOKEN_PROMPTS[0], [5, 6, 7, 8]))
            assert len(ok.branches) == 10 and all(len(b.tokens) == 3 for b in ok.branches)

    run(go())


def test_the_block_must_follow_the_historys_last_token(tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services["near_draft"].address) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            req = _branch_request(TOKEN_PROMPTS[0], [5, 6])
            req.branches.block_len = len(req.tokens)  # nothing of the history left to feed
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Propose(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "block_len" in err.value.details()

    run(go())


class _Gate:
    """An engine whose passes wait until released (and say when the first one started)."""

    def __init__(self, engine):
        import threading
        self.engine, self.started, self.release = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward(self, *args, **kwargs):
        self.started.set()
        self.release.wait(60)
        return self.engine.forward(*args, **kwargs)


def test_a_cancelled_branch_call_leaves_the_session_as_a_fresh_one(tiny_services):
    """The client cancels a branch call (the verdict came, the generation ended); the next
    call on the session drafts exactly what a fresh session drafts."""
    from orchestrator.pair import close, connect

    history = History(TOKEN_PROMPTS[1])

    async def go():
        orch = await connect(tiny_services["target"].address,
                             tiny_services["near_draft"].address, tokenizer_spec="default")
        try:
            draft = orch.draft
            first, _ = await draft.propose("cache-cancel", history, [], 4, GREEDY)
            block = list(first.tokens)
            # the branch call's passes wait at a gate, so the cancel lands mid-call however
            # fast or slow the machine
            scheduler = tiny_services["near_draft"].runtime.scheduler
            gate = _Gate(scheduler.engine)
            scheduler.engine = gate
            try:
                task = asyncio.ensure_future(draft.propose_branches(
                    "cache-cancel", history, block, 4, 6, GREEDY))
                await asyncio.to_thread(gate.started.wait, 30)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                scheduler.engine = gate.engine
                gate.release.set()
            longer = History(history.tokens + block[:2] + [7])
            again, _ = await draft.propose("cache-cancel", longer, [], 5, GREEDY)
            fresh, _ = await draft.propose("cache-fresh", longer, [], 5, GREEDY)
            assert list(again.tokens) == list(fresh.tokens)
        finally:
            await close(orch)

    run(go())


def test_branches_stop_at_the_drafts_context(tiny_services):
    """Near the end of the draft's context a branch call drafts shorter branches (as a plain
    call drafts a shorter block) instead of failing."""
    rt = tiny_services["near_draft"].runtime
    max_ctx = rt.engine.arch.max_context
    history = [(7 * i) % 5000 + 10 for i in range(max_ctx - 8)]
    block = [11, 12, 13, 14]
    call = BranchCall("cache-edge", 0, 0, history + block, len(block), 1, 6, GREEDY)
    future, _ = rt.propose_branches(call)
    proposal = future.result(60)
    room = max_ctx - len(history) - len(block) - 1
    assert len(proposal.branches) == len(block) + 1
    assert all(len(b.tokens) == room for b in proposal.branches)


def test_a_greedy_draft_keeps_its_tokens_where_its_logits_are_between_steps(tiny_services):
    """Greedy, a drafted token stays on the model's device as the next step's input (no
    device-to-host copy between a GPU draft's steps) and the block is fetched once at the
    end: each step's piece is the very tensor the last step's argmax made, the block is the
    draft's own greedy continuation step by step, and the session holds what was fed.
    (Mutant: fetching the token to build the next piece fails the identity.)"""
    import torch

    from specdec.serving.drafting import DraftWork
    from specdec.serving.session import SessionStore

    rt = tiny_services["near_draft"].runtime
    engine, history, k = rt.engine, TOKEN_PROMPTS[1], 5
    work = DraftWork(ProposeCall("on-device", 0, 0, history, k, GREEDY), engine,
                     SessionStore(1 << 30, 8, 60.0))
    work.start()
    done, steps = False, 0
    while not done:
        piece = work.next_piece(1 << 20)
        if work._on_device:
            assert piece.tokens is work._on_device[-1]
            steps += 1
        logits = engine.forward([piece.cache], [piece.tokens], [piece.num_logits])[0]
        done = work.consume(logits)
    proposal = work.result()
    assert steps == k - 1
    cache = engine.new_cache()
    want, nxt = [], engine.forward([cache], [torch.tensor(history)], [1])[0]
    for _ in range(k):
        want.append(int(engine.token_ids(nxt[-1:].argmax(-1))[0]))
        nxt = engine.forward([cache], [torch.tensor(want[-1:])], [1])[0]
    assert proposal.tokens == want
    assert work.session.tokens == history + want[:-1] and proposal.cache_len == len(history) + k - 1


def drafted_block(engine, history, k, sampling, device_race: bool, monkeypatch):
    """A DraftWork's block run to the end by hand, with the coupled race on the device
    (``DEVICE_RACE_ON_CPU``) or on the host; and the step tokens it fed, when on the device."""
    from specdec.serving import drafting
    from specdec.serving.session import SessionStore

    monkeypatch.setattr(drafting, "DEVICE_RACE_ON_CPU", device_race)
    work = drafting.DraftWork(ProposeCall(f"race-{device_race}", 0, 0, history, k, sampling),
                              engine, SessionStore(1 << 30, 8, 60.0))
    work.start()
    done, fed_on_device = False, 0
    while not done:
        piece = work.next_piece(1 << 20)
        if work._on_device:
            assert piece.tokens is work._on_device[-1]  # the race's tensor, not a copy
            fed_on_device += 1
        logits = engine.forward([piece.cache], [piece.tokens], [piece.num_logits])[0]
        done = work.consume(logits)
    return work.result().tokens, fed_on_device


@pytest.mark.parametrize("seed", [1, 7, 2024])
def test_a_coupled_drafts_race_on_the_device_proposes_the_hosts_tokens(tiny_services, seed,
                                                                       monkeypatch):
    """Under the coupled rule a draft's race can run where its logits are (``coupled_race``:
    the device noise, no host read between steps): it proposes exactly the tokens numpy's
    race does, step after step, at temperature 1 and with top-k / top-p (mutant: racing at
    the block's first position every step fails)."""
    engine, history, k = tiny_services["near_draft"].runtime.engine, TOKEN_PROMPTS[1], 6
    for sampling in (SamplingParams(temperature=1.0, seed=seed),
                     SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=seed)):
        host, _ = drafted_block(engine, history, k, sampling, False, monkeypatch)
        device, fed = drafted_block(engine, history, k, sampling, True, monkeypatch)
        assert device == host and fed == k - 1, (sampling, host, device)


@pytest.mark.real
def test_the_shipped_drafts_coupled_race_on_the_device_is_the_hosts(monkeypatch):
    """The same on the real default draft, whose head covers 8,192 of the target's ids: the
    race keys its noise by target id on the device as on the host."""
    import torch

    from specdec.models.loading import load_engine, resolve_draft_spec

    engine = load_engine(resolve_draft_spec("default-draft", "default"), torch.device("cpu"))[0]
    assert engine.vocab_map is not None
    history = list(range(1000, 1040))
    for seed in (3, 11):
        sampling = SamplingParams(temperature=0.9, seed=seed)
        host, _ = drafted_block(engine, history, 5, sampling, False, monkeypatch)
        device, fed = drafted_block(engine, history, 5, sampling, True, monkeypatch)
        assert device == host and fed == 4


@pytest.mark.parametrize("seed", [2, 9])
def test_a_penalized_draft_stays_on_the_device_and_proposes_the_hosts_tokens(tiny_services,
                                                                             seed, monkeypatch):
    """Penalties are counted where the logits are, over the drafted tokens still there (no
    host read between steps): a penalized coupled draft on the device proposes what its host
    path does, and a penalized greedy draft what penalize over the host's token list gives
    step by step (mutant: penalties over the committed tokens only)."""
    import torch

    from specdec.serving.sampling import penalize

    engine, history, k = tiny_services["near_draft"].runtime.engine, TOKEN_PROMPTS[2], 6
    # penalties that favour what was written: drafted tokens then come again (the tiny
    # draft repeats nothing by itself), so a draft that forgot them drafts otherwise
    for penalties in (dict(presence_penalty=-2.0, frequency_penalty=-2.0),
                      dict(repetition_penalty=0.05), dict(presence_penalty=1.5)):
        sampling = SamplingParams(temperature=1.0, seed=seed, prompt_len=3, **penalties)
        host, _ = drafted_block(engine, history, k, sampling, False, monkeypatch)
        device, fed = drafted_block(engine, history, k, sampling, True, monkeypatch)
        assert device == host and fed == k - 1, (penalties, host, device)
        greedy = SamplingParams(prompt_len=3, **penalties)
        got, fed = drafted_block(engine, history, k, greedy, False, monkeypatch)
        assert fed == k - 1  # greedy runs on the device path on the CPU too
        cache, want = engine.new_cache(), []
        logits = engine.forward([cache], [torch.tensor(history)], [1])[0]
        for _ in range(k):
            full = engine.full_vocab_logits(logits[-1:], engine.vocab_in)
            want.append(int(penalize(full, greedy, history + want).argmax()))
            logits = engine.forward([cache], [torch.tensor(want[-1:])], [1])[0]
        assert got == want, (penalties, got, want)
