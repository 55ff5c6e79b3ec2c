"""Session bookkeeping shared by both services: rolling prefix hashes and the cache store.

The orchestrator owns each session's token history; a service keeps a KV cache for it only as a
cache. Both sides keep the rolling hash of every prefix, so a call can say exactly which prefix
it builds on and a service that lost or mis-tracks a session notices instead of computing on a
wrong cache.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Generic, Iterable, Protocol, TypeVar

log = logging.getLogger(__name__)

_HASH_MOD = (1 << 61) - 1
_HASH_MUL = 1_000_003


def extend_hashes(hashes: list[int], tokens: Iterable[int]) -> None:
    """Append the rolling hashes of ``tokens`` to ``hashes`` (hashes[n] covers n tokens)."""
    h = hashes[-1]
    for tok in tokens:
        h = (h * _HASH_MUL + int(tok) + 1) % _HASH_MOD
        hashes.append(h)


def rolling_hash(tokens: Iterable[int]) -> int:
    """Hash of a token sequence; ``rolling_hash([]) == 0``."""
    hashes = [0]
    extend_hashes(hashes, tokens)
    return hashes[-1]


class SessionError(Exception):
    """A call's session reference does not match the service's cache."""


class SessionNotFound(SessionError):
    """The service holds no cache for the session (never opened, closed, evicted, restarted)."""


class PrefixMismatch(SessionError):
    """The service's cache is shorter than the stated prefix or holds different tokens."""


class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


C = TypeVar("C", bound=HasNbytes)


class Session(Generic[C]):
    """One session's cache: the model state plus the tokens it covers and their hashes."""

    def __init__(self, session_id: str, cache: C):
        self.session_id = session_id
        self.cache = cache
        self.tokens: list[int] = []
        self.hashes: list[int] = [0]
        self.last_used = time.monotonic()
        self.opened = self.last_used
        # Per-session counters for the one log line a service writes when the session ends.
        self.calls = 0
        self.tokens_in = 0  # tokens appended by callers (prompt, committed tokens)
        self.proposed = 0  # draft tokens proposed (draft) or received for checking (target)
        self.accepted = 0  # draft tokens accepted (target)
        self.compute_s = 0.0
        self.request_id = ""
        # the session's grammar matcher (specdec.serving.grammar.GrammarState), when constrained
        self.grammar = None

    def summary(self) -> str:
        acc = f" acceptance={self.accepted / self.proposed:.3f}" if self.accepted else ""
        return (f"request={self.request_id or '-'} session={self.session_id} calls={self.calls} tokens_in={self.tokens_in} "
                f"draft_tokens={self.proposed} accepted={self.accepted}{acc} "
                f"cached={len(self.tokens)} compute_ms={self.compute_s * 1000:.1f} "
                f"age_s={time.monotonic() - self.opened:.2f}")

    def __len__(self) -> int:
        return len(self.tokens)

    def check_prefix(self, prefix_len: int, prefix_hash: int) -> None:
        """Raise PrefixMismatch unless the first prefix_len cached tokens hash to prefix_hash."""
        if prefix_len > len(self.tokens):
            raise PrefixMismatch(
                f"session {self.session_id!r}: the call builds on {prefix_len} tokens but the "
                f"cache holds {len(self.tokens)}"
            )
        if self.hashes[prefix_len] != prefix_hash:
            raise PrefixMismatch(
                f"session {self.session_id!r}: the first {prefix_len} cached tokens differ from "
                "the caller's (prefix hash mismatch)"
            )

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        del self.hashes[length + 1 :]

    def append(self, tokens: Iterable[int]) -> None:
        tokens = [int(t) for t in tokens]
        self.tokens.extend(tokens)
        extend_hashes(self.hashes, tokens)


class SessionStore(Generic[C]):
    """Sessions by id with a memory cap (LRU eviction), a count cap and an idle TTL.

    Thread-safe. Eviction never touches the sessions of the call in progress (``pinned``).
    """

    def __init__(self, cap_bytes: int, max_sessions: int, ttl_s: float):
        self.cap_bytes = cap_bytes
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: collections.OrderedDict[str, Session[C]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.cache.nbytes for s in self._sessions.values())

    def get(self, session_id: str) -> Session[C]:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFound(f"session {session_id!r} is not open on this service")
            self._sessions.move_to_end(session_id)
            session.last_used = time.monotonic()
            return session

    def put(self, session: Session[C]) -> None:
        with self._lock:
            self._sessions[session.session_id] = session
            self._sessions.move_to_end(session.session_id)

    def close(self, session_id: str) -> bool:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            log.info("closed %s", session.summary())
        return session is not None

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def evict_until(self, enough: Callable[[], bool], pinned: Iterable[str] = ()) -> list[str]:
        """Evict least recently used sessions, except ``pinned``, until ``enough()`` (a KV pool
        short of slots: a session's slots come back as its cache is freed). Returns the ids
        dropped."""
        pinned = set(pinned)
        dropped = []
        with self._lock:
            for sid in list(self._sessions):  # oldest first
                if enough():
                    break
                if sid not in pinned:
                    del self._sessions[sid]
                    self.evictions += 1
                    dropped.append(sid)
        if dropped:
            log.info("evicted sessions for KV memory: %s", dropped)
        return dropped

    def enforce_limits(self, pinned: Iterable[str] = ()) -> list[str]:
        """Expire idle sessions, then evict least recently used ones until under the caps.

        Returns the ids dropped. Sessions in ``pinned`` are kept even if over the cap.
        """
        pinned = set(pinned)
        dropped = []
        now = time.monotonic()
        with self._lock:
            for sid, s in list(self._sessions.items()):
                if sid not in pinned and now - s.last_used > self.ttl_s:
                    del self._sessions[sid]
                    self.expirations += 1
                    dropped.append(sid)
            total = sum(s.cache.nbytes for s in self._sessions.values())
            for sid in list(self._sessions):  # oldest first
                if total <= self.cap_bytes and len(self._sessions) <= self.max_sessions:
                    break
                if sid in pinned:
                    continue
                total -= self._sessions.pop(sid).cache.nbytes
                self.evictions += 1
                dropped.append(sid)
        if dropped:
            log.info("dropped sessions (ttl/cap): %s", dropped)
        return dropped


def resolve(
    store: SessionStore, session_id: str, prefix_len: int, prefix_hash: int, new_cache
) -> Session:
    """The session a call builds on, truncated to its prefix (rollback).

    prefix_len == 0 (re)starts the session with a fresh cache from ``new_cache()``. Otherwise the
    session must exist (SessionNotFound) and hold that prefix (PrefixMismatch).
    """
    if not session_id or len(session_id.encode()) > 128:
        raise ValueError("session_id must be 1..128 bytes")
    if prefix_len == 0:
        if prefix_hash != 0:
            raise ValueError("prefix_hash must be 0 when prefix_len is 0")
        session = Session(session_id, new_cache())
        store.put(session)
        return session
    session = store.get(session_id)
    session.check_prefix(prefix_len, prefix_hash)
    session.truncate(prefix_len)
    session.cache.truncate(prefix_len)
    return session
