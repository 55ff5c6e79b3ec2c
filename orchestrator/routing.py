"""Spread generations over several draft/target pairs; every round of one generation stays on
its pair, because the services' KV caches for that session live there.

``PairRouter`` offers what an HTTP front or the Ray app needs of an ``Orchestrator``:
``generate``, ``stream``, ``tokenizer`` and ``max_context`` (the same for every pair: one model,
one tokenizer) and ``service_clients()``, which names every pair's services, so health checks
and metrics see all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import AsyncIterator, Iterator

from orchestrator.generation import Delta, GenerationRequest, GenerationResult
from orchestrator.loop import Orchestrator

log = logging.getLogger(__name__)

POLICIES = ("least-loaded", "hash")


def rendezvous(key: str, n: int) -> int:
    """The index in [0, n) a key maps to (highest random weight hashing)."""
    assert n > 0
    scores = [hashlib.blake2b(f"{i}:{key}".encode(), digest_size=8).digest() for i in range(n)]
    return max(range(n), key=scores.__getitem__)


class PairRouter:
    """Picks one pair per generation and runs the whole generation on it.

    Policies: ``least-loaded`` takes a pair with the fewest generations in flight (among those,
    the key's rendezvous hash decides, so equal load spreads evenly); ``hash`` always sends one
    key (the caller's session key, else the request id) to the same pair.
    """

    def __init__(self, pairs: list[Orchestrator], policy: str = "least-loaded",
                 labels: list[str] | None = None):
        if not pairs:
            raise ValueError("a PairRouter needs at least one draft/target pair")
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.pairs = pairs
        self.policy = policy
        self.labels = labels or [f"pair-{i}" for i in range(len(pairs))]
        self.in_flight = [0] * len(pairs)
        self.served = [0] * len(pairs)

    @property
    def tokenizer(self):
        return self.pairs[0].tokenizer

    @property
    def max_context(self) -> int:
        return min(p.max_context for p in self.pairs)

    def service_clients(self) -> dict[str, object]:
        """Every pair's service clients, as ``<pair>/target`` and ``<pair>/draft``."""
        return {f"{label}/{name}": client
                for label, pair in zip(self.labels, self.pairs)
                for name, client in pair.service_clients().items()}

    def pick(self, key: str) -> int:
        n = len(self.pairs)
        if self.policy == "hash" or n == 1:
            return rendezvous(key, n)
        low = min(self.in_flight)
        idle = [i for i in range(n) if self.in_flight[i] == low]
        return idle[rendezvous(key, len(idle))]

    @contextlib.contextmanager
    def lease(self, key: str) -> Iterator[int]:
        """Hold one pair for the duration of a generation (counted as in flight)."""
        i = self.pick(key)
        self.in_flight[i] += 1
        self.served[i] += 1
        try:
            yield i
        finally:
            self.in_flight[i] -= 1

    async def stream(self, req: GenerationRequest,
                     session_key: str | None = None) -> AsyncIterator[Delta | GenerationResult]:
        """Stream a generation on one pair (chosen by ``session_key``, else the request id)."""
        with self.lease(session_key or req.request_id) as i:
            log.debug("request %s -> %s", req.request_id, self.labels[i])
            # Close the pair's generation here, at once, when our caller closes us early: its
            # cleanup releases the sessions on both services.
            async with contextlib.aclosing(self.pairs[i].stream(req)) as items:
                async for item in items:
                    yield item

    async def generate(self, req: GenerationRequest,
                       session_key: str | None = None) -> GenerationResult:
        result, _ = await self.generate_on_pair(req, session_key)
        return result

    async def generate_on_pair(self, req: GenerationRequest,
                               session_key: str | None = None) -> tuple[GenerationResult, int]:
        """Run a generation to the end; returns the result and the index of its pair."""
        with self.lease(session_key or req.request_id) as i:
            return await self.pairs[i].generate(req), i

    def describe(self) -> list[dict]:
        return [dict(pair=label, in_flight=self.in_flight[i], served=self.served[i])
                for i, label in enumerate(self.labels)]
