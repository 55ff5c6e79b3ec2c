"""Logits processing (temperature, top-k, top-p) and per-position random streams."""

from __future__ import annotations

import numpy as np
import torch

from specdec.config import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the probabilities tokens are sampled from.

    logits: [..., vocab]. Returns float32 probabilities of the same shape. Greedy (temperature 0)
    gives a one-hot distribution on the argmax, so that "sampling" from it is greedy decoding.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most likely
        # token is always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


_DOMAINS = {"draft": 1, "target": 2}


class PositionRandom:
    """Random draws for one (seed, position, domain): uniforms and categorical samples.

    Backed by numpy's PCG64 seeded through a SeedSequence of the whole (seed, position, domain),
    so distinct streams share no state (torch's CPU generator keeps only 32 bits of its seed:
    two positions' streams would coincide with probability 2^-32 each).
    """

    def __init__(self, seed: int, position: int, domain: str):
        self._rng = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence([int(seed), int(position), _DOMAINS[domain]])))

    def uniform(self) -> float:
        """U in [0, 1), float64."""
        return float(self._rng.random())

    def categorical(self, probs: torch.Tensor) -> int:
        """One index drawn from probs: [n] (any device, need not sum exactly to 1)."""
        cdf = np.cumsum(probs.detach().double().cpu().numpy())
        assert cdf[-1] > 0, "cannot sample from an all-zero distribution"
        # Inverse CDF in float64; searchsorted "right" never picks an index of zero mass.
        i = int(np.searchsorted(cdf, self.uniform() * cdf[-1], side="right"))
        return min(i, len(cdf) - 1)


def position_generator(seed: int, position: int, domain: str) -> PositionRandom:
    """The random stream of (seed, position, domain), and only of them.

    Tying randomness to the token position (not to call order) makes a session that was
    re-prefilled after a lost cache, or re-drafted after a rollback, sample exactly as an
    undisturbed one would. The draft and the target use different domains, so their draws are
    independent, which the acceptance rule requires.
    """
    return PositionRandom(seed, position, domain)


def sample(probs: torch.Tensor, generator: PositionRandom) -> int:
    """Draw one token id from probs: [vocab] (on any device; drawn on the CPU)."""
    return generator.categorical(probs)


def to_sparse(probs: torch.Tensor, max_ids: int = 0) -> tuple[list[int], list[float]]:
    """The nonzero entries of probs: [vocab] as (ids, probs), most likely first.

    max_ids > 0 caps the entries; callers that cap must have *sampled* from the capped
    distribution (it is what q is), which process_logits with top_k guarantees.
    """
    nz = torch.nonzero(probs > 0).flatten()
    vals = probs[nz]
    order = torch.argsort(vals, descending=True)
    if max_ids:
        order = order[:max_ids]
    return nz[order].tolist(), vals[order].tolist()


def from_sparse(ids, probs, vocab_size: int) -> torch.Tensor:
    """Dense [vocab] float32 distribution from sparse (ids, probs)."""
    dense = torch.zeros(vocab_size, dtype=torch.float32)
    if len(ids):
        dense[torch.as_tensor(list(ids), dtype=torch.long)] = torch.as_tensor(
            list(probs), dtype=torch.float32
        )
    return dense
