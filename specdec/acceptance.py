"""The acceptance rule of speculative decoding, as pure functions over tensors.

Terms (as in vLLM's rejection sampler): the draft proposes k *draft tokens*; the target
*accepts* a prefix of them; at the first rejection it emits a *recovered* token (sampled from
the residual distribution, or its argmax under greedy); when all k are accepted it emits a
*bonus* token. Either way exactly one token of the target's own follows the accepted ones, so
every round emits num_accepted + 1 tokens.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023: accept draft token x_i with
probability min(1, target_probs[i, x_i] / draft_probs[i, x_i]); on the first rejection sample
from norm(max(0, target_probs[i] - draft_probs[i])); after k acceptances sample the bonus from
target_probs[k]. The emitted tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.sampling import PositionRandom


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k] int
    target_logits: torch.Tensor,  # [k + 1, vocab]
) -> tuple[int, int]:
    """Longest prefix where the draft token equals the target's argmax, then the target's token.

    Returns (num_accepted, next_token).
    """
    k = draft_tokens.shape[0]
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    target_tokens = target_logits.argmax(-1)  # [k + 1]
    mismatch = (draft_tokens.to(target_tokens.device) != target_tokens[:k]).nonzero()
    num_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return num_accepted, int(target_tokens[num_accepted])


def verify_sampling(
    draft_tokens: torch.Tensor,  # [k] int
    draft_probs: torch.Tensor,  # [k, vocab], the distributions the draft sampled from
    target_probs: torch.Tensor,  # [k + 1, vocab], after the request's logits processing
    generators: Sequence[PositionRandom],  # k + 1 streams, one per position
) -> tuple[int, int]:
    """Rejection sampling. Returns (num_accepted, next_token)."""
    k = draft_tokens.shape[0]
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1
    assert len(generators) == k + 1
    # float64 so that the ratio test is not biased by rounding near p == q.
    draft_probs = draft_probs.double().cpu()
    target_probs = target_probs.double().cpu()
    for i in range(k):
        x = int(draft_tokens[i])
        q_x = float(draft_probs[i, x])
        p_x = float(target_probs[i, x])
        u = generators[i].uniform()
        # A draft token the draft gave zero probability cannot have been sampled from it; treat
        # it as rejected rather than divide by zero (it only happens with a broken draft).
        if q_x > 0.0 and u * q_x < p_x:  # u < p/q without dividing
            continue
        # clamp: p - q is negative wherever the draft over-proposes; those tokens get no mass.
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:
            # p == q exactly (up to rounding) yet x was rejected: only possible through rounding
            # in the two distributions; p itself is the right fallback.
            residual = target_probs[i]
            total = float(residual.sum())
        return i, generators[i].categorical(residual)
    return k, generators[k].categorical(target_probs[k])
