"""Adaptive draft length: pick k each round to maximise expected tokens per second.

With per-token acceptance a, a block of k yields E[k] = (1 - a^(k+1)) / (1 - a) tokens per
round. A round costs k draft steps plus one verify pass over k + 1 tokens (sequential), or,
pipelined, only the verify pass when the next block was drafted behind it (which needs the
whole block accepted and the draft's guess of the target's token right, about a^(k+1)). k = 0
is plain target decoding, chosen whenever speculation does not pay, so specdec is never much
slower than the target alone.

Costs come from the services' start-up calibration (GetInfo.forward_ms), not from live timings,
so k depends only on the acceptance history: with a seed, the same request gives the same text.
"""

from __future__ import annotations

K_MAX = 8
PROBE_EVERY = 16  # rounds at k = 0 between probes of the acceptance


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] at per-token acceptance a and block length k."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class KController:
    def __init__(self, target_ms: list[float], draft_ms: list[float], fixed_k: int | None = None,
                 pipelined: bool = False, prior_a: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.95, overhead_ms: float = 1.0, k_max: int = K_MAX):
        self.fixed_k = fixed_k
        self.pipelined = pipelined
        self.k_max = min(k_max, max(len(target_ms) - 1, 1)) if target_ms else k_max
        self.target_ms = target_ms or [1.0] * (self.k_max + 1)
        self.draft_step_ms = draft_ms[0] if draft_ms else 0.0
        self.overhead_ms = overhead_ms
        self.decay = decay
        # Acceptance as a decayed count: accepted tokens / (accepted + rejections).
        self.acc = prior_a * prior_weight
        self.rej = (1.0 - prior_a) * prior_weight
        self.zero_rounds = 0
        self.history: list[int] = []

    @property
    def acceptance(self) -> float:
        return self.acc / max(self.acc + self.rej, 1e-9)

    def observe(self, k: int, accepted: int) -> None:
        """Record a round: k drafted, ``accepted`` of them kept (k = 0: a target-only step)."""
        if k == 0:
            self.zero_rounds += 1
            return
        self.zero_rounds = 0
        self.acc = self.acc * self.decay ** k + accepted
        # Geometric model: a block of k yields one observed rejection unless all were kept.
        self.rej = self.rej * self.decay ** k + (1.0 if accepted < k else 0.0)

    def round_ms(self, k: int, a: float) -> float:
        verify = self.target_ms[min(k, len(self.target_ms) - 1)] + self.overhead_ms
        if k == 0:
            return verify
        draft = k * self.draft_step_ms + self.overhead_ms
        if not self.pipelined:
            return draft + verify
        hit = a ** (k + 1)
        return hit * max(verify, draft + self.draft_step_ms) + (1.0 - hit) * (draft + verify)

    def rate(self, k: int, a: float | None = None) -> float:
        """Expected tokens per millisecond at block length k."""
        a = self.acceptance if a is None else a
        return expected_tokens(a, k) / self.round_ms(k, a)

    def best_k(self, a: float | None = None) -> int:
        a = self.acceptance if a is None else a
        return max(range(self.k_max + 1), key=lambda k: (self.rate(k, a), -k))

    def next_k(self, after_full_accept: bool = False) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        k = self.best_k()
        if k == 0 and self.zero_rounds >= PROBE_EVERY and not after_full_accept:
            # Occasionally try a short block, or a draft that improved would never be noticed.
            self.zero_rounds = 0
            k = 2
        if not after_full_accept:
            self.history.append(k)
        return k
