"""What a model service runs, without the network: model, sessions, scheduler, counters.

``TargetRuntime`` verifies blocks; ``DraftRuntime`` proposes them (with a model or n-grams).
The gRPC servicers in draft_service/ and target_service/ only parse, call these, and reply.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import statistics


from specdec.config import ServiceConfig
from specdec.serving.branching import BranchCall, BranchWork
from specdec.serving.drafting import DraftWork, NgramDrafter, Proposal, ProposeCall
from specdec.serving.engine import LlamaEngine
from specdec.serving.grammar import Grammars
from specdec.serving.kvcache import DEFAULT_CACHE_BYTES
from specdec.serving.scheduler import BatchScheduler
from specdec.serving.session import SessionStore
from specdec.serving.target import VerifyCall, VerifyResult, VerifyWork

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServiceInfo:
    """What a service tells GetInfo (the wire's ModelInfo message is made from it)."""

    model: str
    role: str
    tokenizer_fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    forward_ms: list[float]
    drafter: str = "model"
    numerics: str = ""  # what the model computes (engine.numerics); "" for the n-gram drafter
    features: bool = False  # a draft that reads the target's features (ModelInfo.features)
    feature_dim: int = 0  # the features' width (a target's hidden size)
    feature_layers: list[int] = dataclasses.field(default_factory=list)  # a feature draft's


def calibrate(engine: LlamaEngine, max_tokens: int = 16, context: int = 128, reps: int = 5) -> list[float]:
    """Median ms of one forward over m new tokens (m = 1..max_tokens) after ``context`` tokens.

    One warm-up pass over every m (oneDNN builds its primitives per shape), then ``reps``
    interleaved passes, so a slow moment of a busy machine hits every m alike. A forward over
    more tokens never costs less, so the medians are made non-decreasing in m.
    """
    forward_ms = engine.forward_timer(context, max_tokens)
    times: list[list[float]] = [[] for _ in range(max_tokens)]
    for rep in range(reps + 1):
        for m in range(1, max_tokens + 1):
            ms = forward_ms(m)
            if rep:  # rep 0 is the warm-up
                times[m - 1].append(ms)
    medians = [statistics.median(t) for t in times]
    return list(itertools.accumulate(medians, max))


class _Runtime:
    def __init__(self, config: ServiceConfig, info: ServiceInfo, engine: LlamaEngine | None,
                 tokenizer=None):
        self.config = config
        self.info = info
        self.engine = engine
        # constrained requests' grammars (None: built without a tokenizer, none are served)
        self.grammars = None if tokenizer is None else \
            Grammars(tokenizer, info.vocab_size, info.eos_token_ids)
        # torch's ops keep every session's keys in one pool, allocated now (C ops: None)
        pool = engine.reserve_kv(config.cache_cap_bytes) if engine is not None else None
        self.store: SessionStore = SessionStore(
            pool.nbytes if pool is not None else config.cache_cap_bytes or DEFAULT_CACHE_BYTES,
            config.max_sessions, config.session_ttl_s
        )
        self.calls = 0
        self.scheduler: BatchScheduler | None = None
        if engine is not None:
            if config.calibrate and not info.forward_ms:
                info.forward_ms = calibrate(engine)
            self.scheduler = BatchScheduler(
                engine,
                max_batch=config.max_batch,
                batch_wait_ms=config.batch_wait_ms,
                regroup_ms=config.regroup_ms,
                token_budget=config.prefill_chunk,
                prefill_share=config.prefill_share,
                after_pass=lambda pinned: self.store.enforce_limits(pinned),
                name=f"{config.role}-model",
            )
        if pool is not None:  # a pass short of slots first evicts sessions no call holds
            pool.reclaim = lambda need: self.store.evict_until(
                lambda: pool.free >= need, pinned=self.scheduler.busy())

    def close_session(self, session_id: str) -> bool:
        return self.store.close(session_id)

    def stats(self) -> dict:
        """Counters only: limits are enforced by the model thread between passes (from here, a
        stats scrape could evict a session a pass is computing)."""
        return dict(
            sessions=len(self.store),
            cache_bytes=self.store.nbytes,
            cache_cap_bytes=self.store.cap_bytes,
            evictions=self.store.evictions,
            expirations=self.store.expirations,
            calls=self.calls,
            forward_passes=self.scheduler.forward_passes if self.scheduler else 0,
        )

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()


class TargetRuntime(_Runtime):
    def verify(self, call: VerifyCall) -> tuple[concurrent.futures.Future, VerifyWork]:
        """Queue a verify call; the future resolves to a VerifyResult (or its error)."""
        self.calls += 1
        work = VerifyWork(call, self.engine, self.store, self.info.vocab_size, self.grammars)
        return self.scheduler.submit(work), work


class DraftRuntime(_Runtime):
    def __init__(self, config: ServiceConfig, info: ServiceInfo, engine: LlamaEngine | None,
                 q_top_k: int = 64, max_ngram: int = 4, tokenizer=None):
        super().__init__(config, info, engine, tokenizer)
        self.q_top_k = q_top_k
        self.ngram = NgramDrafter(self.store, max_ngram=max_ngram, grammars=self.grammars) \
            if engine is None else None

    def propose(self, call: ProposeCall) -> tuple[concurrent.futures.Future, object]:
        """Queue (model) or run (n-gram) a propose call; the future resolves to a Proposal."""
        self.calls += 1
        if self.ngram is not None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(self.ngram.propose(call))
            except Exception as exc:
                future.set_exception(exc)
            self.store.enforce_limits([call.session_id])
            return future, None
        work = DraftWork(call, self.engine, self.store, self.q_top_k, self.grammars)
        return self.scheduler.submit(work), work

    def propose_branches(self, call: BranchCall) -> tuple[concurrent.futures.Future, BranchWork]:
        """Queue a branch call (the speculation cache); the future resolves to a
        BranchProposal. The n-gram drafter has no distributions to branch on."""
        if self.engine is None:
            raise ValueError("branches need a draft model (this service drafts by n-gram lookup)")
        self.calls += 1
        work = BranchWork(call, self.engine, self.store, self.q_top_k, self.grammars)
        return self.scheduler.submit(work), work


__all__ = ["ServiceInfo", "TargetRuntime", "DraftRuntime", "Proposal", "VerifyResult", "calibrate"]
