"""The KV cache of one session: keys and values of every layer, truncated by a length.

``KVCache`` is what ``LlamaEngine.forward`` (specdec.serving.engine) appends a pass's keys and
values to; rollback is setting the length, a branch of the speculation cache is ``fork``.
"""

from __future__ import annotations

import torch

from specdec.serving.arch import ArchConfig


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
        if length > self.arch.max_context:
            raise ValueError(
                f"sequence of {length} tokens exceeds the model's context of "
                f"{self.arch.max_context}"
            )
        if length > self.capacity:
            grown = max(2 * self.capacity, -(-length // self.GRANULE) * self.GRANULE)
            self._reserve(min(grown, max(self.arch.max_context, length)))

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
