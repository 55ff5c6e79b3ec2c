"""Continuous batching: concurrent sessions share forward passes and get their solo results."""

import asyncio

import pytest
import torch
from conftest import BlockWork, ServiceThread, StepWork, hf_greedy, run

from orchestrator.generation import GenerationRequest
from orchestrator.pair import close, connect
from specdec.config import SamplingParams

# Different prompt lengths, k's, modes, sampling settings and stop points.
CASES = [
    dict(prompt=[1, 520, 3300, 12, 99, 7], max_new=40, k=3, mode="pipelined"),
    dict(prompt=list(range(2000, 2200)), max_new=25, k=2, mode="spec"),  # long prefill
    dict(prompt=[5, 6, 7, 8] * 10, max_new=33, k=None, mode="pipelined"),
    dict(prompt=list(range(300, 320)), max_new=12, k=0, mode="target-only"),
    dict(prompt=[77, 78, 79], max_new=30, k=4, mode="spec",
         sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=5)),
    dict(prompt=list(range(900, 960)), max_new=30, k=3, mode="pipelined",
         sampling=SamplingParams(temperature=0.7, top_k=8, seed=11)),
]


@pytest.fixture(scope="module")
def batching_services(tiny_models):
    target = tiny_models["target"]
    services = {
        "target": ServiceThread("target", target, max_batch=8, batch_wait_ms=3.0, prefill_chunk=64),
        "draft": ServiceThread("draft", tiny_models["near_draft"], target=target, max_batch=8,
                               batch_wait_ms=3.0),
    }
    yield services
    for s in services.values():
        s.stop()


async def _run_cases(services, cases, cancel_index=None):
    orch = await connect(services["target"].address, services["draft"].address)
    try:
        reqs = [GenerationRequest(c["prompt"], c["max_new"], c.get("sampling", SamplingParams()),
                                  [], c["mode"], c["k"]) for c in cases]
        tasks = [asyncio.create_task(orch.generate(r)) for r in reqs]
        if cancel_index is not None:  # once its session is on the target, mid-generation
            store = services["target"].runtime.store
            prefix = reqs[cancel_index].request_id + "-"
            for _ in range(5000):
                if any(sid.startswith(prefix) for sid in store.ids()):
                    break
                await asyncio.sleep(0.001)
            tasks[cancel_index].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await close(orch)


def test_concurrent_sessions_equal_their_solo_runs(tiny_models, batching_services):
    solo = [run(_run_cases(batching_services, [c]))[0] for c in CASES]
    rt = batching_services["target"].runtime
    scheduler, pieces_run = rt.scheduler, []
    passes_before, run_pass = scheduler.forward_passes, scheduler._run

    def counted(pieces):  # the calls' pieces each pass of the concurrent run took part in
        pieces_run.append(len(pieces))
        return run_pass(pieces)

    scheduler._run = counted
    try:
        together = run(_run_cases(batching_services, CASES))
    finally:
        del scheduler._run
    for case, a, b in zip(CASES, solo, together):
        assert b.token_ids == a.token_ids, case
        if "sampling" not in case:
            assert b.token_ids == hf_greedy(tiny_models["target"], case["prompt"], case["max_new"])
    verifies = [c for r in together for c in r.stats.calls if c.service == "target"]
    assert max(c.batch_size for c in verifies) > 1  # sessions really shared forward passes
    # a pass's tokens are every session's: at least one each, and this call's own
    for c in verifies:
        assert c.pass_tokens >= max(c.batch_size, c.tokens + 1), c
    assert any(c.pass_tokens > c.tokens + c.sent_tokens for c in verifies)
    # each verify's wait before its first pass is within the call, and calls that arrived
    # during another session's pass waited for it
    for c in verifies:
        assert 0.0 <= c.queued_ms <= (c.end - c.start) * 1000.0, c
    assert any(c.queued_ms > 1.0 for c in verifies)
    # a shared pass counts once: fewer passes than pieces of calls in them (prefill chunks and
    # decoded-on steps included, which a call's `passes` leaves out or counts alike, so the
    # count rests on what ran, never on how the sessions' timing fell)
    assert scheduler.forward_passes - passes_before == len(pieces_run) < sum(pieces_run)
    assert len(rt.store) == 0 and len(batching_services["draft"].runtime.store) == 0


def test_a_cancelled_session_does_not_disturb_the_others(batching_services):
    solo = [run(_run_cases(batching_services, [c]))[0] for c in CASES]
    mixed = run(_run_cases(batching_services, CASES, cancel_index=1))
    assert isinstance(mixed[1], asyncio.CancelledError)
    for i, (a, b) in enumerate(zip(solo, mixed)):
        if i != 1:
            assert b.token_ids == a.token_ids
    assert len(batching_services["target"].runtime.store) == 0  # the cancelled one was released


def test_a_failing_session_does_not_disturb_the_others(batching_services):
    bad = dict(prompt=[10**6], max_new=5, k=2, mode="spec")  # token id outside the vocabulary
    results = run(_run_cases(batching_services, CASES[:3] + [bad]))
    assert isinstance(results[3], Exception) and "token ids must be in" in str(results[3])
    solo = [run(_run_cases(batching_services, [c]))[0] for c in CASES[:3]]
    assert [r.token_ids for r in results[:3]] == [r.token_ids for r in solo]


def test_kv_cache_cap_holds_under_batching(tiny_models):
    target = ServiceThread("target", tiny_models["target"], max_batch=8)
    try:
        store = target.runtime.store
        # the cap: what a session of 100 tokens holds. The 200-token prompt's session alone
        # exceeds it, so the pass that answers its first call (it is unpinned then) evicts
        # it whatever the timing, and its next call re-prefills; smaller idle sessions may
        # stay while under the cap.
        engine = target.runtime.engine
        probe = engine.new_cache()
        engine.forward([probe], [torch.arange(100) + 10], [1])
        store.cap_bytes = probe.nbytes
        idle_bytes = []
        orig = store.enforce_limits

        def record(pinned=()):
            dropped = orig(pinned)
            pinned = set(pinned)
            idle_bytes.append(sum(s.cache.nbytes for sid, s in list(store._sessions.items())
                                  if sid not in pinned))
            return dropped

        store.enforce_limits = record
        cases = [dict(c, mode="target-only", k=0) for c in CASES]

        async def go(batch):
            orch = await connect(target.address, None)
            try:
                reqs = [GenerationRequest(c["prompt"], c["max_new"], mode="target-only")
                        for c in batch]
                return await asyncio.gather(*(orch.generate(r) for r in reqs))
            finally:
                await close(orch)

        together = run(go(cases))
        solo = [run(go([c]))[0] for c in cases]
        assert [r.token_ids for r in together] == [r.token_ids for r in solo]
        assert store.evictions > 0  # the cap forced evictions...
        assert sum(r.stats.re_prefills for r in together) > 0  # ...which cost re-prefills only
        assert max(idle_bytes) <= store.cap_bytes  # idle sessions never exceed the cap
    finally:
        target.stop()


class _SlowEngine:
    """The tiny target's engine with passes as long as a real target's (30 ms), so that a
    session's turnaround (answer, then its next call 8 ms later) is shorter than a pass."""

    def __init__(self, engine):
        self.engine = engine
        self.passes: list[int] = []  # sessions per pass

    def forward(self, caches, tokens, num_logits):
        import time
        time.sleep(0.03)
        self.passes.append(len(caches))
        return self.engine.forward(caches, tokens, num_logits)


@pytest.mark.parametrize("regroup_ms", [1000.0, 0.0])
def test_sessions_answered_together_share_the_next_pass(tiny_models, regroup_ms):
    """Three sessions, each sending its next call 8 ms after its answer, started 7 ms apart.
    Regrouping waits for the sessions a pass answered, so they settle into one pass of all
    three; without it (0 ms) the later ones keep missing the pass that just started, and the
    passes alternate between groups. (The margins are a busy machine's: the wait ends when
    the sessions are back, so 1 s costs only the last pass's wait for the finished ones; a
    session misses a pass unless the model thread stalls 8 ms between two.)"""
    import threading
    import time

    from specdec.models.loading import load_engine
    from specdec.serving.scheduler import BatchScheduler

    engine = _SlowEngine(load_engine(tiny_models["target"], torch.device("cpu"))[0])
    sched = BatchScheduler(engine, max_batch=8, regroup_ms=regroup_ms)

    def client(i):
        cache = engine.engine.new_cache()
        time.sleep(0.007 * i)
        for step in range(12):
            sched.submit(StepWork(f"s{i}", cache, 5 + step)).result(timeout=10)
            time.sleep(0.008)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        sched.stop()
    steady = engine.passes[3:-3]
    together = sum(n == 3 for n in steady) / len(steady)
    if regroup_ms:
        assert together > 0.8, engine.passes
    else:
        assert together < 0.5, engine.passes


class _MemoryBound:
    """The tiny target's engine with a memory limit: a pass of more than ``limit`` new tokens
    fails as the CPU allocator fails (torch's RuntimeError), before touching any cache."""

    def __init__(self, engine, limit):
        self.engine, self.limit = engine, limit
        self.passes: list[int] = []  # new tokens per pass tried

    def forward(self, caches, tokens, num_logits):
        n = sum(int(t.shape[0]) for t in tokens)
        self.passes.append(n)
        if n > self.limit:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               f"allocate {n << 30} bytes. Error code 12")
        return self.engine.forward(caches, tokens, num_logits)


def test_a_call_that_does_not_fit_in_memory_fails_alone(tiny_models):
    """Three calls share a pass that runs out of memory: the scheduler runs each alone, so the
    two that fit complete with the logits they would have had in any pass, and only the one
    that does not fit fails, with a MemoryError saying so (which the services' run_call answers
    as RESOURCE_EXHAUSTED); its session's cache is as it was, and the scheduler keeps serving.
    (Mutant: an out-of-memory pass failed like any other fails the two that fit.)"""
    import concurrent.futures

    from specdec.models.loading import load_engine
    from specdec.serving.scheduler import BatchScheduler

    engine = load_engine(tiny_models["target"], torch.device("cpu"))[0]
    bound = _MemoryBound(engine, limit=10)
    prompt = torch.arange(20, 28)
    caches = [engine.new_cache() for _ in range(3)]
    for c in caches:
        engine.forward([c], [prompt], [0])
    ref = engine.new_cache()
    engine.forward([ref], [prompt], [0])
    want = engine.forward([ref], [torch.tensor([5, 6])], [2])[0]
    sched = BatchScheduler(bound, max_batch=8, batch_wait_ms=200.0)
    try:
        calls = [BlockWork("a", caches[0], torch.tensor([5, 6])),
                 BlockWork("big", caches[1], torch.arange(100, 116)),
                 BlockWork("b", caches[2], torch.tensor([5, 6]))]
        futures = [sched.submit(c) for c in calls]
        done, _ = concurrent.futures.wait(futures, timeout=30)
        assert len(done) == 3
        assert bound.passes[0] == 20 and sorted(bound.passes[1:]) == [2, 2, 16]
        for f in (futures[0], futures[2]):
            assert torch.equal(f.result(), want)
        with pytest.raises(MemoryError, match="not enough memory for this call's pass"):
            futures[1].result()
        assert [c.length for c in caches] == [10, 8, 10]
        after = sched.submit(BlockWork("big", caches[1], torch.tensor([5, 6]))).result(timeout=30)
        assert torch.equal(after, want)
    finally:
        sched.stop()
