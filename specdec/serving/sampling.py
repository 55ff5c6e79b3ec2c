"""Logits processing (temperature, top-k, top-p), per-position random streams, and the shared
noise of the coupled acceptance rule."""

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


def penalize(logits: torch.Tensor, params: SamplingParams,
             context: list[int] | torch.Tensor, continuation: list[int] = ()) -> torch.Tensor:
    """The request's penalties on logits [n, vocab] whose row i follows context +
    continuation[:i] (a verify block's rows, or one row with continuation empty).

    As vLLM applies them, before temperature: repetition (HF's rule: a logit of a token seen
    anywhere in prompt or output is divided by the penalty when positive, multiplied when
    negative), then frequency (minus the penalty per occurrence in the output) and presence
    (minus the penalty once if it occurs in the output); the output is what follows the first
    ``params.prompt_len`` tokens. Returns new float32 logits; unchanged when not penalized.
    ``context`` may be a tensor on the logits' device (a draft's tokens drafted there): no
    operation here reads the device (masks and counts by scatter, not unique / bincount).
    """
    if not params.penalized:
        return logits
    n, vocab = logits.shape
    logits = logits.float().clone()
    device = logits.device  # (where the logits are: a GPU's or the CPU)
    seq = context.to(device, torch.long) if isinstance(context, torch.Tensor) else \
        torch.tensor(list(context), dtype=torch.long, device=device)
    base = seq.numel()
    if len(continuation):
        seq = torch.cat([seq, torch.tensor(list(continuation), dtype=torch.long, device=device)])
    start = min(params.prompt_len, base)
    for i in range(n):
        seen = seq[: base + i]
        if params.repetition_penalty != 1.0 and seen.numel():
            hit = torch.zeros(vocab, dtype=torch.bool, device=device)
            hit[seen] = True
            row = logits[i]
            r = params.repetition_penalty
            logits[i] = torch.where(hit, torch.where(row > 0, row / r, row * r), row)
        output = seen[start:]
        if output.numel() and (params.frequency_penalty or params.presence_penalty):
            counts = torch.zeros(vocab, device=device).index_add_(
                0, output, torch.ones(output.numel(), device=device))
            logits[i] -= params.frequency_penalty * counts
            logits[i] -= params.presence_penalty * (counts > 0).float()
    return logits


def bias_logits(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, vocab_out] plus the request's logit_bias (OpenAI's: added before
    temperature). token_ids: the target id of each column where the head is reduced (default:
    the column is the id). Returns new logits; unchanged without a bias."""
    if not params.logit_bias:
        return logits
    dense = torch.zeros(vocab_size, dtype=torch.float32)  # [vocab], on the host: filled per id
    for token, bias in params.logit_bias:
        if token < vocab_size:  # ids past the vocabulary have no logit to move
            dense[token] = bias
    if token_ids is not None:
        dense = dense[token_ids.cpu()]
    return logits.float() + dense.to(logits.device)


_DOMAINS = {"draft": 1, "target": 2, "coupling": 3}


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


_M32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """h * c mod 2**32: numpy's uint32 wraps; a torch tensor holds h in int64, where each
    partial product stays below 2**48 (uint32 arithmetic on any device)."""
    if isinstance(h, np.ndarray):
        return h * np.uint32(c)
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(token_ids, k1, k2):
    """The coupling hash of token ids (uint32 in numpy, int64 in torch) under the key (k1,
    k2): two rounds of the finalizer after the golden-ratio multiply."""
    return _fmix32(_fmix32(_mul32(token_ids, 0x9E3779B9) ^ k1) ^ k2)


def _keys(seed: int, position: int) -> np.ndarray:
    """The 64-bit key of (seed, position), as two uint32."""
    return np.random.SeedSequence([int(seed), int(position), _DOMAINS["coupling"]]) \
        .generate_state(2, np.uint32)


def coupling_noise(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """Exponential(1) noise E[t] for each token id t at (seed, position): float64, [len(ids)].

    Counter-based: E[t] is a keyed hash of t (two rounds of MurmurHash3's finalizer under a
    64-bit key drawn from a SeedSequence of (seed, position)), so any subset of the vocabulary
    costs only its size, and the draft (over its few likeliest tokens, in its own reduced
    vocabulary mapped to target ids) and the target (over its whole support) see the same
    E[t] for the same t. ``device_noise`` is the same hash on a device.
    """
    with np.errstate(over="ignore"):
        h = _hash(np.asarray(token_ids).astype(np.uint32), *_keys(seed, position))
    # U in (0, 1) (never 0 or 1), E = -log U
    return -np.log((h.astype(np.float64) + 0.5) * (1.0 / 2**32))


def device_noise(seed: int, positions: range, token_ids: torch.Tensor) -> torch.Tensor:
    """``coupling_noise`` at several positions on ``token_ids``' device: [len(positions),
    len(token_ids)] float64. The hash is integer arithmetic, exact on any device, so a GPU
    draws the very noise the CPU does (the final log: torch's, equal to numpy's on CPU)."""
    keys = torch.tensor(np.stack([_keys(seed, p) for p in positions]).astype(np.int64),
                        device=token_ids.device)  # [n, 2]
    h = _hash(token_ids.to(torch.int64)[None, :] & _M32, keys[:, :1], keys[:, 1:])
    return -torch.log((h.double() + 0.5) * (1.0 / 2**32))


def coupled_race(probs: torch.Tensor, seed: int, first_position: int,
                 token_ids: np.ndarray | torch.Tensor | None = None):
    """The exponential race of each row of probs [n, vocab], row i at position
    first_position + i, on probs' device (``device_noise``), nothing read to the host:
    (winning index per row, its race value: > 0 unless the row is all zero)."""
    n, vocab = probs.shape
    ids = torch.arange(vocab, device=probs.device) if token_ids is None else \
        torch.as_tensor(token_ids).to(probs.device)
    p = probs.detach().double()
    noise = device_noise(seed, range(first_position, first_position + n), ids)
    best = torch.where(p > 0, p / noise, -1.0).max(-1)  # (the first of equal races, as numpy)
    return best.indices, best.values


def coupled_choices(probs: torch.Tensor, seed: int, first_position: int,
                    token_ids: np.ndarray | torch.Tensor | None = None) -> list[int]:
    """``coupled_choice`` at each row of probs [n, vocab], row i at position
    first_position + i, raced on probs' device (``coupled_race``) and fetched in one copy:
    a verify block's k + 1 positions on a GPU."""
    indices, values = coupled_race(probs, seed, first_position, token_ids)
    choices, found = torch.stack([indices, (values > 0).long()]).tolist()
    assert all(found), "cannot sample from an all-zero distribution"
    return choices


def coupled_choice(probs: torch.Tensor, seed: int, position: int,
                   token_ids: np.ndarray | None = None) -> int:
    """The index i maximizing probs[i] / E[token_ids[i]] (the exponential race; the same as
    argmax of log probs + Gumbel noise): a sample of probs, and the token the coupled rule
    emits or proposes at this position.

    probs: [n] on any device (on a GPU the race runs there: ``coupled_choices``); token_ids:
    the target-vocabulary id of each index (default: the index itself).
    """
    if probs.device.type != "cpu":
        return coupled_choices(probs[None], seed, position, token_ids)[0]
    p = probs.detach().numpy().astype(np.float64)  # numpy: no torch thread pool
    support = np.flatnonzero(p > 0)
    assert support.size, "cannot sample from an all-zero distribution"
    ids = support if token_ids is None else np.asarray(token_ids)[support]
    race = p[support] / coupling_noise(seed, position, ids)
    return int(support[int(np.argmax(race))])


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
