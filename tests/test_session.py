"""Session bookkeeping: prefix hashes, rollback, LRU eviction under a cap, idle TTL."""

import pytest

from specdec.serving.session import (
    PrefixMismatch,
    Session,
    SessionNotFound,
    SessionStore,
    resolve,
    rolling_hash,
)


class FakeCache:
    """Stands in for a KV cache with a given size (the store only reads nbytes/truncate)."""

    def __init__(self, nbytes=100):
        self.nbytes = nbytes
        self.length = 0

    def truncate(self, n):
        self.length = min(self.length, n)


def test_rolling_hash_distinguishes_order_and_length():
    assert rolling_hash([]) == 0
    assert rolling_hash([1, 2]) != rolling_hash([2, 1])
    assert rolling_hash([0]) != rolling_hash([0, 0])


def test_resolve_checks_prefix_and_rolls_back():
    store = SessionStore(10_000, 10, 60)
    s = resolve(store, "a", 0, 0, FakeCache)
    s.append([5, 6, 7, 8])
    again = resolve(store, "a", 2, rolling_hash([5, 6]), FakeCache)
    assert again is s and s.tokens == [5, 6]
    with pytest.raises(PrefixMismatch):
        resolve(store, "a", 2, rolling_hash([5, 9]), FakeCache)
    with pytest.raises(PrefixMismatch):
        resolve(store, "a", 3, rolling_hash([5, 6, 7]), FakeCache)  # cache holds only 2
    with pytest.raises(SessionNotFound):
        resolve(store, "nope", 1, rolling_hash([1]), FakeCache)
    with pytest.raises(ValueError):
        resolve(store, "", 0, 0, FakeCache)


def test_lru_eviction_keeps_the_cap_and_spares_pinned():
    store = SessionStore(cap_bytes=300, max_sessions=10, ttl_s=60)
    for sid in "abcd":
        store.put(Session(sid, FakeCache(100)))
    store.get("a")  # a is now most recently used
    dropped = store.enforce_limits(pinned=["b"])
    assert dropped == ["c"]
    assert store.nbytes <= 300 and set(store.ids()) == {"a", "b", "d"}
    assert store.evictions == 1


def test_idle_sessions_expire():
    store = SessionStore(cap_bytes=10_000, max_sessions=10, ttl_s=60.0)
    store.put(Session("old", FakeCache()))
    store.put(Session("new", FakeCache()))
    store._sessions["old"].last_used -= 120.0  # idle for two minutes (no wall-clock wait)
    assert store.enforce_limits() == ["old"]
    assert store.expirations == 1 and "new" in store
