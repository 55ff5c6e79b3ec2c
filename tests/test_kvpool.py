"""The KV pool of torch's ops: every session's keys in one preallocated store, attention for
every session of a pass in one call, forks that share positions, a pool that runs short."""

import concurrent.futures

import pytest
import torch
from conftest import BlockWork
from families import make_config

from specdec.serving.arch import ArchConfig, canonical_weights
from specdec.serving.engine import LlamaEngine
from specdec.serving.kvcache import KVPool, KVPoolFull, PooledCache

# GQA 4:1 (llama3), a sliding window (mistral_sliding), soft-capping with local and global
# layers (gemma2), q/k norms with two RoPEs (gemma3)
BATCH_FAMILIES = ["llama3", "mistral_sliding", "gemma2", "gemma3"]


def torch_engine(name: str, **overrides) -> LlamaEngine:
    """A random-weight model of family ``name`` on torch's ops (so on the KV pool)."""
    from transformers import AutoModelForCausalLM

    config, _ = make_config(name, **overrides)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    arch = ArchConfig.from_hf(model.config)
    engine = LlamaEngine(arch, canonical_weights(model.state_dict(), arch), kernels="mkl",
                         native=False)
    assert engine.native is None
    return engine


def ids(n: int, seed: int) -> torch.Tensor:
    return (torch.arange(n) * (31 + seed) + 7 * seed) % 4000 + 100


@pytest.mark.parametrize("name", BATCH_FAMILIES)
def test_one_attention_call_for_a_pass_equals_each_session_alone(name):
    """Sessions of different lengths and row counts in one pass (a verify block after a long
    cache, one step after a short one, a fresh prompt), each against its own keys only:
    logits equal to each session alone a token at a time within float32 rounding, the same
    argmax.
    (Mutants: a mask that is not causal within the block, or that lets a session see the
    padding past its keys, fail it.)"""
    engine = torch_engine(name)
    plan = [(40, 5), (7, 1), (0, 12)]  # (cached positions, new tokens) per session
    alone, joint, news = [], [], []
    for i, (cached, new) in enumerate(plan):
        prompt, block = ids(cached + new, i)[:cached], ids(cached + new, i)[cached:]
        news.append(block)
        for caches in (alone, joint):
            c = engine.new_cache()
            if cached:
                engine.forward([c], [prompt], [0])
            caches.append(c)
    # each session alone, a token a pass (no block: the causal mask is not what decides it)
    want = [torch.cat([engine.forward([c], [t[j:j + 1]], [1])[0] for j in range(len(t))])
            for c, t in zip(alone, news)]
    got = engine.forward(joint, news, [len(t) for t in news])
    for w, g in zip(want, got):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= 1e-4 * max(1.0, float(w.abs().max())), name
        assert torch.equal(g.argmax(-1), w.argmax(-1)), name
    assert [c.length for c in joint] == [45, 8, 12]


def test_a_fork_shares_its_parents_positions_and_survives_the_parent_rewriting_them():
    """A branch of the speculation cache copies slot ids, not keys; when the parent rolls back
    and writes over positions the fork still reads, those positions get fresh slots, so the
    fork's continuation equals a session that was never forked, as does the parent's.
    (Mutant: writing into a shared slot in place changes the fork's logits.)"""
    engine = torch_engine("llama3")
    pool = engine.reserve_kv()
    text = ids(40, 1)
    parent = engine.new_cache()
    engine.forward([parent], [text[:30]], [0])
    used = pool.used
    fork = parent.fork(20)
    assert pool.used == used, "a fork copied positions"
    assert (pool.refs[parent.table[:20]] == 2).all() and (pool.refs[parent.table[20:30]] == 1).all()
    # the parent rolls back to 10 and writes 15 other tokens over positions the fork reads
    parent.truncate(10)
    other = ids(15, 9)
    got_parent = engine.forward([parent], [other], [1])[0]
    got_fork = engine.forward([fork], [text[20:24]], [1])[0]
    for prefix, new, got in ((text[:10], other, got_parent), (text[:20], text[20:24], got_fork)):
        ref = engine.new_cache()
        engine.forward([ref], [prefix], [0])
        want = engine.forward([ref], [new], [1])[0]
        assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    # both still read positions 0..9; the parent's 10..19 are its own now
    assert (pool.refs[fork.table[:10]] == 2).all() and (pool.refs[fork.table[10:24]] == 1).all()
    assert not set(parent.table[10:25]) & set(fork.table[10:24])


def test_slots_come_back_when_caches_are_freed_and_a_full_pool_says_so():
    engine = torch_engine("llama3")
    arch = engine.arch
    pool = KVPool(arch, torch.device("cpu"), torch.float32, slots=64)
    assert pool.nbytes == 64 * KVPool.slot_bytes(arch, torch.float32)
    a = PooledCache(pool)
    a.ensure(20)
    a.length = 20
    assert pool.used == 32 and a.capacity == 32  # PooledCache.GRANULE at a time
    b = a.fork(20)
    b.ensure(21)  # its 20 shared positions and 12 of its own
    assert pool.used == 44
    asked = []
    pool.reclaim = asked.append
    c = PooledCache(pool)
    with pytest.raises(KVPoolFull, match="KV pool full: 32 positions asked, 20 of 64 free"):
        c.ensure(30)
    assert asked == [32], "the pool asked for nothing to be reclaimed"
    del a
    assert pool.used == 32, "slots the fork still reads were freed (or a's were not)"
    del b
    assert pool.used == 0 and pool.free == 64
    c.ensure(30)
    assert pool.used == 32


class _SessionBlock(BlockWork):
    """A verify-like call on a session of a store, as the services' works are."""

    def __init__(self, store, session, tokens):
        super().__init__(session.session_id, session.cache, tokens)
        self.store, self.session = store, session


def test_a_call_that_does_not_fit_in_the_pool_fails_alone():
    """Three calls share a pass; one needs more positions than the pool has free: the two
    that fit complete with the logits they would have had, the third waits for a later pass,
    and when it cannot fit then either (nothing is in progress to give slots back) it fails
    with RESOURCE_EXHAUSTED's MemoryError naming the pool; its session keeps its cache.
    (Mutant: admitting every piece to the pass, the call fails inside it without the
    pool's figures.)"""
    from specdec.serving.scheduler import BatchScheduler
    from specdec.serving.session import Session, SessionStore

    engine = torch_engine("llama3")
    pool = engine.reserve_kv(64 * KVPool.slot_bytes(engine.arch, engine.dtype))
    assert pool.slots == 64
    store = SessionStore(1 << 30, 16, 600.0)
    sessions = [Session(name, engine.new_cache()) for name in ("a", "big", "b")]
    for s in sessions:  # 16 slots each
        engine.forward([s.cache], [ids(8, 2)], [0])
    want = engine.forward([sessions[0].cache.fork(8)], [ids(2, 6)], [2])[0]
    sched = BatchScheduler(engine, max_batch=8, batch_wait_ms=200.0)
    try:
        calls = [_SessionBlock(store, s, ids(40 if s.session_id == "big" else 2, 6))
                 for s in sessions]
        futures = [sched.submit(c) for c in calls]
        done, _ = concurrent.futures.wait(futures, timeout=60)
        assert len(done) == 3
        for f in (futures[0], futures[2]):
            assert (f.result() - want).abs().max() <= 1e-5 * float(want.abs().max())
        with pytest.raises(MemoryError, match="not enough memory for this call's pass .*KV pool "
                                              "has 16 of 64 positions free, it needs 32"):
            futures[1].result()
        assert [s.cache.length for s in sessions] == [10, 8, 10]
        assert sched.preemptions == 0
    finally:
        sched.stop()


def test_a_service_short_of_kv_slots_evicts_idle_sessions_and_every_text_is_its_own(
        tiny_models):
    """A real target service on torch's ops (bfloat16) with a 1 MiB pool (4,096 positions of
    the tiny target): 24 concurrent generations of ~500 positions each need three times what
    it holds. A pass short of slots evicts sessions between
    their rounds (not the byte cap: it is lifted here), whose generations re-prefill, and
    every text equals its solo run. (Mutant: no reclaim makes the passes fail with
    RESOURCE_EXHAUSTED.)"""
    import asyncio

    from conftest import ServiceThread, run

    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    target = ServiceThread("target", tiny_models["target"], max_batch=16, dtype="bfloat16",
                           cache_cap_mb=1)
    try:
        pool = target.runtime.engine.pool
        assert pool is not None and pool.slots == 4096
        store = target.runtime.store
        store.cap_bytes = 1 << 40  # only the pool's shortage evicts
        prompts = [list(range(1000 + 37 * i, 1470 + 37 * i)) for i in range(24)]

        async def go(batch):
            orch = await connect(target.address, None)
            try:
                reqs = [GenerationRequest(p, 30, mode="target-only") for p in batch]
                return await asyncio.gather(*(orch.generate(r) for r in reqs))
            finally:
                await close(orch)

        solo = [run(go([p]))[0] for p in prompts[:3]]
        evicted = store.evictions
        together = run(go(prompts))
        assert [r.token_ids for r in together[:3]] == [r.token_ids for r in solo]
        assert all(len(r.token_ids) == 30 for r in together)
        assert store.evictions > evicted
        assert sum(r.stats.re_prefills for r in together) > 0
    finally:
        target.stop()


def test_when_no_call_fits_the_generation_that_came_last_is_preempted():
    """Two sessions fill the pool and each asks for more: the one whose generation came last
    is preempted (its session dropped, its slots freed, its call answered NOT_FOUND so its
    caller re-sends the prefix) and the other completes with the logits it would have had.
    (Mutant: preempting the earlier generation fails it.)"""
    import time

    from specdec.serving.scheduler import BatchScheduler
    from specdec.serving.session import Session, SessionNotFound, SessionStore

    engine = torch_engine("llama3")
    pool = engine.reserve_kv(64 * KVPool.slot_bytes(engine.arch, engine.dtype))
    ref = engine.new_cache()
    engine.forward([ref], [ids(20, 1)], [0])
    want = engine.forward([ref], [ids(20, 5)], [20])[0]
    del ref
    store = SessionStore(1 << 30, 16, 600.0)
    sessions = []
    for name in ("first", "later"):
        session = Session(name, engine.new_cache())
        session.request_id = name
        engine.forward([session.cache], [ids(20, 1)], [0])  # 32 slots each: the pool is full
        store.put(session)
        sessions.append(session)
        time.sleep(0.01)
    assert pool.free == 0
    sched = BatchScheduler(engine, max_batch=8, batch_wait_ms=200.0)
    try:
        futures = [sched.submit(_SessionBlock(store, s, ids(20, 5))) for s in reversed(sessions)]
        done, _ = concurrent.futures.wait(futures, timeout=60)
        assert len(done) == 2 and sched.preemptions == 1
        with pytest.raises(SessionNotFound, match="'later' was preempted: the KV pool is full"):
            futures[0].result()
        got = futures[1].result()
        assert (got - want).abs().max() <= 1e-5 * float(want.abs().max())
        assert store.ids() == ["first"] and sessions[1].cache.capacity == 0
    finally:
        sched.stop()
