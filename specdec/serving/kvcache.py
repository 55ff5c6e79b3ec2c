"""A session's KV cache: keys and values of every layer, truncated by a length.

What ``LlamaEngine.forward`` (specdec.serving.engine) appends a pass's keys and values to;
rollback is setting the length, a branch of the speculation cache is ``fork``. Two kinds, one
contract: ``KVCache``, a contiguous tensor per session, which the fused C layer ops of the CPU
engine read a head's keys from as one run; and ``PooledCache``, a table of slots in one
preallocated ``KVPool``, which torch's ops (GPUs, other dtypes and families) gather from in
one batched attention call per layer, and which forks without copying.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from specdec.serving.arch import ArchConfig


def _fits_context(arch: ArchConfig, length: int) -> None:
    if length > arch.max_context:
        raise ValueError(f"sequence of {length} tokens exceeds the model's context of "
                         f"{arch.max_context}")


def _grown(arch: ArchConfig, length: int, granule: int, floor: int = 0) -> int:
    """The capacity a cache takes for ``length`` positions: whole granules, at least
    ``floor``, never past the model's context."""
    return min(max(floor, -(-length // granule) * granule), max(arch.max_context, length))


class KVCache:
    """Keys and values of one session: [layers, kv_heads, capacity, head_dim] each.

    ``length`` positions are valid; truncating is setting the length (rollback is free).
    Capacity grows by doubling, up to the model's context.
    """

    GRANULE = 64

    def __init__(self, arch: ArchConfig, device: torch.device, dtype: torch.dtype):
        self.arch = arch
        self.length = 0
        self.k = torch.empty(0, device=device, dtype=dtype)
        self.v = torch.empty(0, device=device, dtype=dtype)
        self._reserve(self.GRANULE)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _reserve(self, capacity: int) -> None:
        a = self.arch
        shape = (a.num_layers, a.num_kv_heads, capacity, a.head_dim)
        k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        v = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def ensure(self, length: int) -> None:
        _fits_context(self.arch, length)
        if length > self.capacity:
            self._reserve(_grown(self.arch, length, self.GRANULE, 2 * self.capacity))

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def fork(self, length: int) -> "KVCache":
        """A new cache holding a copy of this one's first ``length`` positions (a branch of
        the speculation cache), with room for a short continuation."""
        assert 0 <= length <= self.length, (length, self.length)
        fork = KVCache.__new__(KVCache)
        fork.arch, fork.length = self.arch, length
        capacity = min(max(length + self.GRANULE, self.GRANULE), max(self.arch.max_context,
                                                                       length))
        shape = (self.arch.num_layers, self.arch.num_kv_heads, capacity, self.arch.head_dim)
        fork.k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        fork.v = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        fork.k[:, :, :length] = self.k[:, :, :length]
        fork.v[:, :, :length] = self.v[:, :, :length]
        return fork


class KVPoolFull(MemoryError):
    """No free slot in the KV pool for a pass, even after idle sessions were evicted."""


class KVPool:
    """Every pooled session's keys and values in one preallocated store, a slot per position.

    k and v are [layers, slots, kv_heads, head_dim], allocated once (on a GPU: from the free
    memory left after the weights, ``kv_pool_bytes``), so a session's growth never copies and
    a pass never asks the allocator for cache memory. A cache is a table of slot ids
    (``PooledCache``); a slot is shared by every cache whose table holds it (a branch of the
    speculation cache shares its parent's positions: forking copies ids, not keys) and is
    free again when the last of them lets go (a reference count per slot).

    ``reclaim(need)``, set by the service, is called when fewer than ``need`` slots are free:
    it evicts idle sessions (their slots come back as their caches are freed). The scheduler
    admits only the calls whose slots are free (``BatchScheduler._fitting``: the others wait,
    or the newest generation is preempted); ``KVPoolFull`` is the backstop should a pass
    still run short: the scheduler reruns it call by call, and the call that does not fit
    alone fails with RESOURCE_EXHAUSTED while the others complete.
    """

    def __init__(self, arch: ArchConfig, device: torch.device, dtype: torch.dtype, slots: int):
        if slots < 1:
            raise ValueError(f"a KV pool needs at least one slot, got {slots}")
        # slot 0 is no one's: zeros, what a pass's padding keys read (an unwritten slot may hold
        # NaN, and a masked NaN still poisons attention: 0 * NaN)
        shape = (arch.num_layers, slots + 1, arch.num_kv_heads, arch.head_dim)
        self.arch = arch
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.k[:, 0] = 0
        self.v[:, 0] = 0
        self.slots = slots
        self.slot_nbytes = self.slot_bytes(arch, dtype)
        self.refs = np.zeros(slots + 1, dtype=np.int32)  # caches holding each slot
        self._free = np.arange(slots, 0, -1, dtype=np.int64)  # a stack: _free[:_top]
        self._top = slots
        self._lock = threading.RLock()  # (a cache freed by the garbage collector lets go
        # from whichever thread runs it, possibly one that holds the lock already)
        self.reclaim: Callable[[int], None] | None = None

    @staticmethod
    def slot_bytes(arch: ArchConfig, dtype: torch.dtype) -> int:
        """Bytes of one position's keys and values over every layer."""
        return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * \
            torch.empty(0, dtype=dtype).element_size()

    @property
    def free(self) -> int:
        return self._top

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    @property
    def used(self) -> int:
        return self.slots - self._top

    def allocate(self, n: int) -> np.ndarray:
        """``n`` free slots, each now held once (KVPoolFull if there are not that many)."""
        if n > self._top and self.reclaim is not None:
            self.reclaim(n)
        with self._lock:
            if n > self._top:
                raise KVPoolFull(f"KV pool full: {n} positions asked, {self._top} of "
                                 f"{self.slots} free")
            self._top -= n
            got = self._free[self._top:self._top + n][::-1].copy()  # (ascending: a run)
            self.refs[got] = 1
            return got

    def share(self, slots: np.ndarray) -> None:
        with self._lock:
            self.refs[slots] += 1

    def release(self, slots: np.ndarray) -> None:
        """Let go of ``slots`` once each; those no cache holds any more are free."""
        if len(slots) == 0:
            return
        with self._lock:
            np.subtract.at(self.refs, slots, 1)
            freed = slots[self.refs[slots] == 0]
            freed = np.unique(freed)
            self._free[self._top:self._top + len(freed)] = freed
            self._top += len(freed)


class PooledCache:
    """One session's KV cache in a ``KVPool``: ``table[p]`` is position p's slot.

    The same contract as ``KVCache``: ``length`` positions are valid, truncating is setting
    the length, ``fork`` is a branch. Positions past the length keep their slots (capacity,
    taken from the pool GRANULE at a time); a position about to be written whose slot is
    shared (a fork still reads it) gets a fresh slot instead, so no one's keys are overwritten
    and nothing is copied.
    """

    GRANULE = 16

    def __init__(self, pool: KVPool, table: np.ndarray | None = None, length: int = 0):
        self.pool = pool
        self.arch = pool.arch
        self.length = length
        self.table = np.empty(0, dtype=np.int64) if table is None else table

    @property
    def capacity(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.pool.slot_nbytes

    def ensure(self, length: int) -> None:
        """Slots for positions [self.length, length), the next pass's writes, none shared."""
        _fits_context(self.arch, length)
        if length > self.capacity:
            more = self.pool.allocate(_grown(self.arch, length, self.GRANULE) - self.capacity)
            self.table = np.concatenate([self.table, more])
        written = self.table[self.length:length]
        shared = np.flatnonzero(self.pool.refs[written] > 1)
        if len(shared):
            fresh = self.pool.allocate(len(shared))
            self.pool.release(written[shared])
            written[shared] = fresh  # (a view: the table itself)

    def needed(self, new: int) -> int:
        """Free slots ``ensure(self.length + new)`` would take: growth and shared positions."""
        end = self.length + new
        grow = _grown(self.arch, end, self.GRANULE) - self.capacity if end > self.capacity else 0
        written = self.table[self.length:min(end, self.capacity)]
        return grow + int((self.pool.refs[written] > 1).sum())

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def fork(self, length: int) -> "PooledCache":
        """A cache holding this one's first ``length`` positions, sharing their slots."""
        assert 0 <= length <= self.length, (length, self.length)
        table = self.table[:length].copy()
        self.pool.share(table)
        return PooledCache(self.pool, table, length)

    def release(self) -> None:
        """Give every slot back (the cache is empty after it); done when it is freed."""
        table, self.table, self.length = self.table, np.empty(0, dtype=np.int64), 0
        self.pool.release(table)

    def __del__(self):
        try:
            self.release()
        except Exception:  # (interpreter shutdown: the pool may be gone already)
            pass


DEFAULT_CACHE_BYTES = 1 << 30  # a CPU service's KV memory unless --cache-cap-mb says


def kv_pool_bytes(device: torch.device, cap_bytes: int | None) -> int:
    """The KV pool's size: ``cap_bytes`` when given; otherwise, on a GPU, 90% of the device
    memory free once the weights are loaded, less 1 GiB for a pass's activations; on a CPU
    DEFAULT_CACHE_BYTES."""
    if cap_bytes:
        return cap_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(int(free * 0.9) - (1 << 30), 1 << 26)
    return DEFAULT_CACHE_BYTES
