"""Continuous batching: one thread runs the model; calls of many sessions share its passes.

Each call is a ``Work``: a small state machine that asks for one *piece* per iteration (some new
tokens of its session and how many trailing logits it needs) and consumes the logits. Every
iteration the scheduler admits queued work (up to ``max_batch`` sessions, one call per session
at a time), gives each active work one piece, runs ONE ragged forward pass over all pieces, and
hands the logits back.

Fairness: pieces of works that are decoding (verify blocks, draft steps) go first; prompt
prefill gets what is left, in chunks, shortest prompt first. The chunk is budgeted in *time*
(``PrefillBudget``): while a session waits on the pass (it decodes in it, or is between its
rounds and about to call again) a pass may cost at most (1 + ``prefill_share``) times a
decode-only pass, at least one prefill token, so a long prompt cannot stall other sessions'
rounds yet always progresses. A pass that no session waits on takes the full ``token_budget``
(a long prompt alone prefills at full speed). The costs are learned from the passes themselves.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import torch

from specdec.serving.engine import KVCache, LlamaEngine
from specdec.serving.grammar import Grammars, session_grammar
from specdec.serving.session import SessionNotFound, SessionStore, resolve

log = logging.getLogger(__name__)

# A session that calls again within this of its last answer is in rounds (decoding), and a
# pass is waited on while it is between them; a longer gap is a new turn, not a round.
ROUND_GAP_S = 0.5


@dataclasses.dataclass
class Piece:
    cache: KVCache
    tokens: torch.Tensor  # [t] int64
    num_logits: int
    prefill: bool  # a prompt chunk (budgeted) rather than a decoding step
    num_features: int = 0  # the target's features wanted for this many trailing positions
    feature_layers: tuple[int, ...] = ()  # ... with the residual after these layers first


def layer_columns(rows: torch.Tensor, have: Sequence[int], want: Sequence[int]) -> torch.Tensor:
    """A piece's feature rows [n, (len(want) + 1) * hidden] from a pass's that tapped the
    layers ``have`` (a superset: the union of every piece's) [n, (len(have) + 1) * hidden]."""
    if list(want) == list(have):
        return rows
    pick = [list(have).index(x) for x in want] + [len(have)]  # (the final feature last)
    return rows.unflatten(1, (len(have) + 1, -1))[:, pick].flatten(1)


class Work:
    """One call (verify, propose, branches) as scheduler work, and the bookkeeping every kind
    shares. ``call`` has the session's id, ``prefix_len``, ``prefix_hash``, ``request_id``
    and ``sampling``."""

    def __init__(self, call, engine: LlamaEngine, store: SessionStore,
                 grammars: Grammars | None = None):
        self.call = call
        self.session_id = call.session_id
        self.engine = engine
        self.store = store
        self.grammars = grammars
        self.cancelled = False
        self.compute_s = 0.0  # time of the passes this work took part in (set by the scheduler)
        self.batch_size = 0  # sessions in the last pass it took part in
        self.pass_tokens = 0  # new tokens of every session in that pass
        self.queued_s = 0.0  # from submission to the start of its first pass (set by the scheduler)
        self._fed = 0  # tokens of the call already fed to the model
        self._piece_len = 0  # tokens of the last piece given
        # with a piece that asked for features (Piece.num_features): their rows [n, hidden],
        # set by the scheduler before ``consume``
        self.piece_features: torch.Tensor | None = None

    def start(self) -> None:
        """Resolve the session and check the call (raises to fail the call). Subclasses check
        their call's lengths after this."""
        c = self.call
        self.session = resolve(self.store, c.session_id, c.prefix_len, c.prefix_hash,
                               self.engine.new_cache)
        self.session.request_id = c.request_id or self.session.request_id
        # compiled (or found in the cache) before any pass: a bad grammar fails this call alone
        self.grammar = session_grammar(self.session, self.grammars, c.sampling.grammar,
                                       c.sampling.prompt_len)

    def next_piece(self, budget: int) -> Piece | list[Piece] | None:
        """The next piece, at most ``budget`` tokens if it is prefill; None = wait a pass. A
        list of decode pieces (each on a cache of its own) takes part in the pass as one
        piece each (the speculation cache's branches).

        May be asked more than once per pass; only the last piece given is the one consumed.
        """
        raise NotImplementedError

    def consume(self, logits: torch.Tensor | list[torch.Tensor]) -> bool:
        """Take the piece's logits [num_logits, vocab_out] (a list, one per piece, when
        next_piece gave a list); return True when the work is done."""
        raise NotImplementedError

    def result(self):
        """The call's answer, once done."""
        raise NotImplementedError


@dataclasses.dataclass
class _Entry:
    work: Work
    future: concurrent.futures.Future
    queued_at: float  # time.monotonic() at submission
    ran: bool = False  # it has taken part in a pass


@dataclasses.dataclass
class _Pieces:
    """What a work gave for a pass: its piece(s), and whether as a list (its logits go back
    so)."""

    entry: _Entry
    group: list[Piece]
    many: bool

    @property
    def tokens(self) -> int:
        return sum(int(p.tokens.shape[0]) for p in self.group)


def out_of_memory(exc: BaseException) -> bool:
    """Whether a pass failed for want of memory: CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError ("can't allocate memory"), or smallm's MemoryError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                              or "out of memory" in text)


def _settle(future: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    """Resolve a future unless its caller already cancelled it. An error goes without its
    traceback: the model thread's frames hold the pass's works, whose sessions hold KV memory,
    for as long as the caller keeps the error (errors are logged where they are caught)."""
    if future.done():
        return
    try:
        if exc is not None:
            link = exc
            while link is not None and link.__traceback__ is not None:
                link.__traceback__ = None
                link = link.__context__ or link.__cause__
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled concurrently
        pass


class PrefillBudget:
    """How many prompt tokens a pass may prefill, from the costs of the passes so far.

    A pass that a session waits on may cost at most (1 + ``share``) times a decode-only pass,
    on average: its prefill chunk is ``share * decode_ms / prefill_ms_per_token`` tokens, at
    most ``token_budget``. Where one token costs more than that share (attention at a long
    context, a slow machine), the allowance of such passes carries over until it pays for one:
    the prompt gets a token every few passes (it always progresses) and the share holds. A pass
    nobody waits on takes
    ``token_budget`` tokens: big chunks are the fastest way through a prompt.

    Both costs are decayed averages of what ``observe`` is told: ``decode_ms``, the time of a
    pass without prefill; ``prefill_ms_per_token``, the time a pass took beyond that, per
    prefill token. Attention makes a token's cost grow with the context before it; the
    average follows that growth, as each chunk starts where the last one ended. Decode-only
    passes are rare while a prompt prefills beside decoding sessions, so one pass in
    ``remeasure_every`` of those (and the first) is kept decode-only to measure one afresh.
    """

    def __init__(self, token_budget: int = 256, share: float = 0.5, decay: float = 0.25,
                 remeasure_every: int = 16):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if share <= 0:
            raise ValueError(f"prefill share must be > 0, got {share}")
        self.token_budget = token_budget
        self.share = share
        self.decay = decay  # weight of the newest observation
        self.remeasure_every = remeasure_every
        self.decode_ms: float | None = None
        self.prefill_ms_per_token: float | None = None
        self.carried_ms = 0.0  # prefill time earlier shared passes were allowed but not used
        self._since_decode_only = 0  # passes since the last decode-only one

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.decay * (new - old)

    def _allowance_ms(self) -> float:
        """Prefill time the next shared pass may spend."""
        return self.carried_ms + self.share * self.decode_ms

    def observe(self, ms: float, decoding: bool, prefill_tokens: int,
                shared: bool | None = None) -> None:
        """One pass took ``ms``; ``decoding``: it carried decoding pieces; ``shared``: a
        session waited on it (default: ``decoding``)."""
        shared = decoding if shared is None else shared
        if shared and self.decode_ms is not None and self.prefill_ms_per_token:
            # a token dearer than a pass's share: what this pass was allowed and did not
            # spend carries over (up to one token's cost) until it pays for one
            left = self._allowance_ms() - prefill_tokens * self.prefill_ms_per_token
            dear = self.share * self.decode_ms < self.prefill_ms_per_token
            self.carried_ms = min(max(left, 0.0), self.prefill_ms_per_token) if dear else 0.0
        if not prefill_tokens:
            if decoding:
                self.decode_ms = self._average(self.decode_ms, ms)
                self._since_decode_only = 0
            return
        self._since_decode_only += 1
        # what the prefill added to the pass (a pass costs about a decode-only one at least)
        extra = max(ms - (self.decode_ms or 0.0), 0.0)
        self.prefill_ms_per_token = self._average(self.prefill_ms_per_token, extra / prefill_tokens)

    def tokens(self, decoding: bool, waited_on: bool = False) -> int:
        """Prefill tokens for the next pass. ``decoding``: decoding pieces are in it;
        ``waited_on``: a session waits on it without a piece in it (between its rounds)."""
        if not decoding and not waited_on:
            return self.token_budget
        if decoding and (self.decode_ms is None or
                         self._since_decode_only >= self.remeasure_every):
            return 0  # this pass measures a decode-only pass
        if self.decode_ms is None or not self.prefill_ms_per_token:
            return 1
        chunk = min(int(self.share * self.decode_ms / self.prefill_ms_per_token),
                    self.token_budget)
        if not chunk:  # a token dearer than the share: one once the allowance pays for it
            chunk = int(self._allowance_ms() >= self.prefill_ms_per_token)
        # (a pass with no decoding piece runs only if it prefills: there, at least one token)
        return chunk if decoding else max(chunk, 1)


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
        prefill_share: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``token_budget``: prefill tokens of a pass no session waits on; ``prefill_share``:
        what prefill may add to a pass that one waits on, as a fraction of a decode-only pass
        (see PrefillBudget); ``clock``: seconds, times the passes (tests inject their own)."""
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.regroup_s = regroup_ms / 1000.0
        # per session: when the last pass answered its call, and how soon its next call
        # followed the answer last time (a session that drafted between its rounds, as a
        # draft service's sessions always do, is not waited for)
        self._answered: dict[str, float] = {}
        self._gaps: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.prefill = PrefillBudget(token_budget, prefill_share)
        self.clock = clock
        self.after_pass = after_pass
        self._queue: collections.deque[_Entry] = collections.deque()
        self._active: list[_Entry] = []  # the calls taking part in passes (the model thread's)
        self._cond = threading.Condition()
        self._stop = False
        self.forward_passes = 0
        self.preemptions = 0  # sessions dropped for want of KV slots (_fitting)
        self._arrivals: collections.OrderedDict[str, float] = collections.OrderedDict()
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

    def busy(self) -> set[str]:
        """The sessions of the calls being computed (no eviction may take them)."""
        return {e.work.session_id for e in self._active}

    def _admit(self, active: list[_Entry]) -> None:
        busy = self.busy()
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
            if getattr(self.engine, "pool", None) is not None:
                self._arrival(entry.work)  # (noted at its first call, for preemption)
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
        deadline = time.monotonic() + self.regroup_s
        with self._cond:
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
        active: list[_Entry] = self._active
        returning: set[str] = set()  # sessions the last pass answered: their next call comes
        while True:
            if returning and self.regroup_s > 0:
                self._regroup(active, returning)
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

    def _note_answered(self, sessions: list[str]) -> None:
        """Note when these sessions' calls were answered (before their callers can hear it)."""
        now = time.monotonic()
        with self._cond:
            for sid in sessions:
                self._answered[sid] = now
            while len(self._answered) > 4 * self.max_batch:  # sessions that never came back
                self._answered.pop(next(iter(self._answered)))

    def _between_rounds(self) -> bool:
        """Whether a session answered lately will soon call again: one in rounds (its last
        call came within ROUND_GAP_S of the answer before it, e.g. a spec-mode session that
        drafts between its verifies), answered less than twice that gap ago (so a session
        that finished stops counting soon)."""
        now = time.monotonic()
        with self._cond:
            return any(gap < ROUND_GAP_S and now - self._answered[sid] < 2 * gap
                       for sid, gap in self._gaps.items() if sid in self._answered)

    def _ask(self, entry: _Entry, budget: int) -> _Pieces | None:
        """The work's piece(s) for this pass (None: nothing this pass)."""
        if entry.future.done():
            return None
        if entry.work.cancelled:
            entry.future.cancel()
            return None
        try:
            piece = entry.work.next_piece(budget)
        except Exception as exc:
            _settle(entry.future, exc=exc)
            return None
        if piece is None:
            return None
        many = isinstance(piece, list)
        group = piece if many else [piece]
        return _Pieces(entry, group, many) if group else None

    def _pieces(self, active: list[_Entry]) -> list[_Pieces]:
        """Each work's piece(s) for this pass: every decoding piece, then prompt chunks within
        the prefill budget, shortest prompt first (it is answered soonest)."""
        pieces: list[_Pieces] = []
        prompts: list[_Pieces] = []  # each asked for all of its prompt left
        for entry in active:
            asked = self._ask(entry, 1 << 30)
            if asked is None:
                continue
            if not any(p.prefill for p in asked.group):
                pieces.append(asked)
            elif all(p.prefill for p in asked.group):
                prompts.append(asked)
        decoding = bool(pieces)
        waited_on = bool(prompts) and not decoding and self._between_rounds()
        self._shared_pass = decoding or waited_on
        budget = self.prefill.tokens(decoding, waited_on)
        for prompt in sorted(prompts, key=lambda a: a.tokens):
            if budget <= 0:
                break
            asked = self._ask(prompt.entry, budget)
            if asked is None or not all(p.prefill for p in asked.group):
                continue
            pieces.append(asked)
            budget -= asked.tokens
            if asked.tokens >= prompt.tokens:  # its prompt is done: it decodes next pass,
                # so it waits on this one
                budget = min(budget, self.prefill.tokens(decoding=False, waited_on=True))
        return pieces

    def _fitting(self, pieces: list[_Pieces]) -> list[_Pieces]:
        """The pieces whose new positions the KV pool has slots for, after evicting idle
        sessions if short; the others wait for a later pass. When none fits, the calls in
        progress hold the pool: the session opened last is preempted (vLLM's recompute
        preemption: its cache is dropped and its call answered NOT_FOUND, so its caller
        re-sends the prefix when there is room) and the older ones go on. A call that could
        not fit in the whole pool fails (RESOURCE_EXHAUSTED). Engines on contiguous caches
        (no pool) take every piece."""
        pool = getattr(self.engine, "pool", None)
        while pool is not None and pieces:
            needs = [sum(p.cache.needed(int(p.tokens.shape[0])) for p in asked.group)
                     for asked in pieces]
            if sum(needs) > pool.free and pool.reclaim is not None:
                pool.reclaim(sum(needs))
            free, fit = pool.free, []
            for asked, need in zip(pieces, needs):
                if need <= free:
                    fit.append(asked)
                    free -= need
            if fit:
                if len(fit) < len(pieces):
                    log.info("KV pool short: %d of %d works wait for a later pass",
                             len(pieces) - len(fit), len(pieces))
                return fit
            victims = [e for e in self._active
                       if not e.future.done() and e.work.session.cache.capacity]
            if len(victims) > 1 or victims and len(pieces) > 1:
                # the generation that came last (by its first call, not a re-prefill)
                self._preempt(max(victims, key=lambda e: self._arrival(e.work)))
            else:  # what holds the pool is this call's own or no call's to give back
                for asked, need in zip(pieces, needs):
                    _settle(asked.entry.future, exc=MemoryError(
                        f"not enough memory for this call's pass ({asked.tokens} new tokens): "
                        f"the KV pool has {pool.free} of {pool.slots} positions free, it "
                        f"needs {need}"))
            pieces = [a for a in pieces if not a.entry.future.done()]
        return pieces

    def _arrival(self, work: Work) -> float:
        """When the generation a call belongs to first reached this service (by its request
        id, so a preempted and re-sent session keeps its place), else when its session
        opened."""
        rid = work.session.request_id
        if not rid:
            return work.session.opened
        if rid not in self._arrivals:
            self._arrivals[rid] = work.session.opened
            while len(self._arrivals) > 1024:
                self._arrivals.popitem(last=False)
        return self._arrivals[rid]

    def _preempt(self, entry: _Entry) -> None:
        """Drop a call's session for its KV slots; the call is answered NOT_FOUND."""
        work = entry.work
        self.preemptions += 1
        log.info("KV pool full: preempting session %s (its caller re-sends the prefix)",
                 work.session_id)
        work.store.close(work.session_id)
        work.session.cache.release()
        _settle(entry.future, exc=SessionNotFound(
            f"session {work.session_id!r} was preempted: the KV pool is full; re-send its "
            "prefix"))

    def _step(self, active: list[_Entry]) -> None:
        pieces = self._fitting(self._pieces(active))
        if not pieces:
            return
        now = time.monotonic()
        for asked in pieces:
            if not asked.entry.ran:  # what it waited for: the pass in progress, queued work
                asked.entry.ran = True
                asked.entry.work.queued_s = now - asked.entry.queued_at
        self._run(pieces)

    def _run(self, pieces: list[_Pieces]) -> None:
        """One pass over ``pieces``, its logits to their works. A pass that runs out of memory
        is run again work by work (a pass only appends to its caches when it completes), so
        the work that does not fit fails alone and the others complete."""
        flat = [p for asked in pieces for p in asked.group]
        started = self.clock()
        feats = None
        try:
            caches, tokens = [p.cache for p in flat], [p.tokens for p in flat]
            if any(p.num_features for p in flat):  # (only then: costs nothing unasked)
                layers = sorted({x for p in flat if p.num_features for x in p.feature_layers})
                logits, feats = self.engine.forward_features(
                    caches, tokens, [p.num_logits for p in flat],
                    [p.num_features for p in flat], layers=layers)
                feats = [layer_columns(f, layers, p.feature_layers) for f, p in zip(feats, flat)]
            else:
                logits = self.engine.forward(caches, tokens, [p.num_logits for p in flat])
        except Exception as exc:
            if not out_of_memory(exc):
                log.exception("forward pass failed")
            elif len(pieces) > 1:
                log.warning("a pass of %d works ran out of memory (%s): each alone",
                            len(pieces), str(exc)[:200])
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                for asked in pieces:
                    self._run([asked])
                return
            else:  # one work alone: it does not fit, the service goes on
                tokens = pieces[0].tokens
                log.warning("a call's pass of %d tokens ran out of memory: %s", tokens,
                            str(exc)[:200])
                exc = MemoryError(f"not enough memory for this call's pass ({tokens} new "
                                  f"tokens): {exc}")
            for asked in pieces:
                _settle(asked.entry.future, exc=exc)
            return
        elapsed = self.clock() - started
        self.forward_passes += 1
        self.prefill.observe(elapsed * 1000.0, decoding=any(not p.prefill for p in flat),
                             prefill_tokens=sum(a.tokens for a in pieces if a.group[0].prefill),
                             shared=self._shared_pass)
        pass_tokens = sum(a.tokens for a in pieces)
        answered: list[_Entry] = []
        at = 0
        for asked in pieces:
            entry, n = asked.entry, len(asked.group)
            lg = logits[at:at + n] if asked.many else logits[at]
            entry.work.piece_features = feats[at] if feats is not None and not asked.many \
                else None
            at += n
            entry.work.compute_s += elapsed
            entry.work.batch_size = len(flat)
            entry.work.pass_tokens = pass_tokens
            if entry.future.done():  # cancelled while its piece ran
                continue
            try:
                if entry.work.consume(lg):
                    answered.append(entry)
            except Exception as exc:
                _settle(entry.future, exc=exc)
        self._note_answered([e.work.session_id for e in answered])
        for entry in answered:
            try:
                _settle(entry.future, entry.work.result())
            except Exception as exc:
                _settle(entry.future, exc=exc)
