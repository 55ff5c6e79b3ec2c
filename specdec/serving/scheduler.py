"""Continuous batching: one thread runs the model; calls of many sessions share its passes.

Each call is a ``Work``: a small state machine that asks for one *piece* per iteration (some new
tokens of its session and how many trailing logits it needs) and consumes the logits. Every
iteration the scheduler admits queued work (up to ``max_batch`` sessions, one call per session
at a time), gives each active work one piece, runs ONE ragged forward pass over all pieces, and
hands the logits back. Fairness: pieces of works that are decoding (verify blocks, draft steps)
go first; prompt prefill only gets what is left of a per-pass token budget, in chunks, so a long
prompt cannot stall other sessions' rounds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Callable, Protocol

import torch

from specdec.serving.engine import KVCache, LlamaEngine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Piece:
    cache: KVCache
    tokens: torch.Tensor  # [t] int64
    num_logits: int
    prefill: bool  # a prompt chunk (budgeted) rather than a decoding step


class Work(Protocol):
    session_id: str
    cancelled: bool
    compute_s: float  # time of the passes this work took part in (set by the scheduler)
    batch_size: int  # sessions in the last pass it took part in
    pass_tokens: int  # new tokens of every session in that pass
    queued_s: float  # from submission to the start of its first pass (set by the scheduler)

    def start(self) -> None:
        """Resolve the session and check the call (raises to fail the call)."""

    def next_piece(self, budget: int) -> Piece | list[Piece] | None:
        """The next piece, at most ``budget`` tokens if it is prefill; None = wait a pass. A
        list of decode pieces (each on a cache of its own) takes part in the pass as one
        piece each (the speculation cache's branches).

        May be asked more than once per pass; only the last piece given is the one consumed.
        """

    def consume(self, logits: torch.Tensor | list[torch.Tensor]) -> bool:
        """Take the piece's logits [num_logits, vocab_out] (a list, one per piece, when
        next_piece gave a list); return True when the work is done."""

    def result(self):
        """The call's answer, once done."""


@dataclasses.dataclass
class _Entry:
    work: Work
    future: concurrent.futures.Future
    queued_at: float  # time.monotonic() at submission
    ran: bool = False  # it has taken part in a pass


def _settle(future: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    """Resolve a future unless its caller already cancelled it."""
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled concurrently
        pass


class BatchScheduler:
    """Runs works on one engine, batching the work of concurrent sessions."""

    def __init__(
        self,
        engine: LlamaEngine,
        max_batch: int = 16,
        batch_wait_ms: float = 0.0,
        token_budget: int = 256,
        regroup_ms: float = 0.0,
        after_pass: Callable[[list[str]], None] | None = None,
        name: str = "scheduler",
    ):
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.regroup_s = regroup_ms / 1000.0
        # per session: when the last pass answered its call, and how soon its next call
        # followed the answer last time (a session that drafted between its rounds, as a
        # draft service's sessions always do, is not waited for)
        self._answered: dict[str, float] = {}
        self._gaps: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.token_budget = token_budget
        self.after_pass = after_pass
        self._queue: collections.deque[_Entry] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self.forward_passes = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        now = time.monotonic()
        with self._cond:
            if self._stop:
                raise RuntimeError("scheduler is stopped")
            answered = self._answered.pop(work.session_id, None)
            if answered is not None:
                self._gaps.pop(work.session_id, None)
                self._gaps[work.session_id] = now - answered
                while len(self._gaps) > 4 * self.max_batch:
                    self._gaps.popitem(last=False)  # the longest unheard of
            self._queue.append(_Entry(work, future, now))
            self._cond.notify()
        return future

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _admit(self, active: list[_Entry]) -> None:
        busy = {e.work.session_id for e in active}
        keep: collections.deque[_Entry] = collections.deque()
        while self._queue:
            entry = self._queue.popleft()
            if entry.work.cancelled:
                entry.future.cancel()
                continue
            if len(active) >= self.max_batch or entry.work.session_id in busy:
                keep.append(entry)
                continue
            try:
                entry.work.start()
            except Exception as exc:  # the call is wrong or its session is gone: fail it alone
                _settle(entry.future, exc=exc)
                continue
            active.append(entry)
            busy.add(entry.work.session_id)
        self._queue = keep

    def _arrived(self, active: list[_Entry], sessions: set[str]) -> bool:
        here = {e.work.session_id for e in active} | {e.work.session_id for e in self._queue}
        return sessions <= here

    def _regroup(self, active: list[_Entry], returning: set[str]) -> None:
        """Wait (up to regroup_ms) for the sessions whose calls the last pass finished to send
        their next ones. Without it, sessions that arrive during a pass run in the next one
        without those the pass just answered (back a round trip later), and concurrent
        sessions settle into groups whose passes alternate, each session waiting for the
        other group's pass every round (measured on one core, 4 sessions: passes of 2,
        every verify waiting a whole pass)."""
        now = time.monotonic()
        deadline = now + self.regroup_s
        with self._cond:
            for sid in returning:
                self._answered[sid] = now
            while len(self._answered) > 4 * self.max_batch:  # sessions that never came back
                self._answered.pop(next(iter(self._answered)))
            # only the sessions whose next call came soon after their last answer
            returning = {sid for sid in returning if self._gaps.get(sid, 0.0) < self.regroup_s}
            while not self._stop and not self._arrived(active, returning) and \
                    len(active) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                self._admit(active)

    def _loop(self) -> None:
        active: list[_Entry] = []
        returning: set[str] = set()  # sessions the last pass answered: their next call comes
        while True:
            if returning and self.regroup_s > 0:
                self._regroup(active, returning)  # (also notes when they were answered)
            returning = set()
            with self._cond:
                while not self._stop and not self._queue and not active:
                    self._cond.wait()
                if self._stop:
                    for e in list(self._queue) + active:
                        e.future.cancel()
                    return
                was_idle = not active
                self._admit(active)
            if was_idle and self.batch_wait_s > 0 and len(active) < self.max_batch:
                # Starting from idle: give concurrent sessions a moment to join this pass.
                deadline = time.monotonic() + self.batch_wait_s
                with self._cond:
                    while len(active) < self.max_batch and time.monotonic() < deadline:
                        self._cond.wait(deadline - time.monotonic())
                        self._admit(active)
            if not active:
                continue
            self._step(active)
            returning = {e.work.session_id for e in active
                         if e.future.done() and not e.future.cancelled() and
                         e.future.exception() is None}
            active[:] = [e for e in active if not e.future.done()]
            if self.after_pass is not None:
                try:
                    self.after_pass([e.work.session_id for e in active])
                except Exception:  # bookkeeping must never stop the model thread
                    log.exception("after_pass hook failed")

    def _step(self, active: list[_Entry]) -> None:
        # per work: its piece(s) this pass, and whether it gave a list (its logits go back so)
        pieces: list[tuple[_Entry, list[Piece], bool]] = []
        budget = self.token_budget
        # Decoding pieces first (they are small and someone is waiting on each), then prefill.
        for want_prefill in (False, True):
            for entry in active:
                if entry.future.done() or any(entry is p[0] for p in pieces):
                    continue
                if entry.work.cancelled:
                    entry.future.cancel()
                    continue
                try:
                    piece = entry.work.next_piece(max(budget, 0) if want_prefill else 1 << 30)
                except Exception as exc:
                    _settle(entry.future, exc=exc)
                    continue
                if piece is None:
                    continue
                many = isinstance(piece, list)
                group = piece if many else [piece]
                if not group or any(p.prefill != want_prefill for p in group):
                    continue
                if want_prefill:
                    if budget <= 0 and pieces:
                        continue
                    budget -= sum(int(p.tokens.shape[0]) for p in group)
                pieces.append((entry, group, many))
        if not pieces:
            return
        flat = [p for _, group, _ in pieces for p in group]
        now = time.monotonic()
        for entry, _, _ in pieces:
            if not entry.ran:  # what it waited for: the pass in progress, queued work
                entry.ran = True
                entry.work.queued_s = now - entry.queued_at
        started = time.perf_counter()
        try:
            logits = self.engine.forward([p.cache for p in flat], [p.tokens for p in flat],
                                         [p.num_logits for p in flat])
        except Exception as exc:
            log.exception("forward pass failed")
            for entry, _, _ in pieces:
                _settle(entry.future, exc=exc)
            return
        elapsed = time.perf_counter() - started
        self.forward_passes += 1
        pass_tokens = sum(int(p.tokens.shape[0]) for p in flat)
        at = 0
        for entry, group, many in pieces:
            lg = logits[at:at + len(group)] if many else logits[at]
            at += len(group)
            entry.work.compute_s += elapsed
            entry.work.batch_size = len(flat)
            entry.work.pass_tokens = pass_tokens
            if entry.future.done():  # cancelled while its piece ran
                continue
            try:
                if entry.work.consume(lg):
                    _settle(entry.future, entry.work.result())
            except Exception as exc:
                _settle(entry.future, exc=exc)
