"""The acceptance rule of speculative decoding, as pure functions over tensors.

Terms (as in vLLM's rejection sampler): the draft proposes k *draft tokens*; the target
*accepts* a prefix of them; at the first rejection it emits a *recovered* token (sampled from
the residual distribution, or its argmax under greedy); when all k are accepted it emits a
*bonus* token. Either way exactly one token of the target's own follows the accepted ones, so
every round emits num_accepted + 1 tokens.

Three rules, one per way of choosing the target's token:

- **greedy**: the target's token at each position is its argmax; accept the longest prefix of
  draft tokens equal to those.
- **coupled** (sampling; drafter-invariant coupling, Daliri, Musco and Suresh 2024): at position n
  both models use the same Exponential(1) noise E_n[t] drawn from (seed, n, t)
  (specdec.serving.sampling.coupling_noise). The target's token is argmax_t p_n[t] / E_n[t], which is an
  exact sample of p_n (the exponential race, i.e. the Gumbel-max trick); the draft proposes
  argmax_t q_n[t] / E_n[t]. Accept the longest prefix of draft tokens equal to the target's
  tokens. The text is a function of the seed and the target alone: no k, mode, batch or draft
  can change it. Per-token acceptance P(same) >= (1 - TV(p, q)) / (1 + TV(p, q)).
- **rejection** (sampling; Leviathan et al. 2023, Chen et al. 2023): accept draft token x_i with
  probability min(1, target_probs[i, x_i] / draft_probs[i, x_i]); on the first rejection sample
  from norm(max(0, target_probs[i] - draft_probs[i])); after k acceptances sample the bonus
  from target_probs[k]. Per-token acceptance 1 - TV(p, q), the most any rule that sees only
  one draft token can reach; but which token comes out depends on q, so on the draft and on k.

Every rule emits tokens distributed exactly as the target's own (greedy: the same tokens).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.serving.sampling import PositionRandom, coupled_choice, coupled_choices


def verify_walk(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> tuple[int, int]:
    """Longest prefix of the k draft tokens equal to the target's own k + 1 tokens, then the
    target's token after it. Returns (num_accepted, next_token)."""
    k = len(draft_tokens)
    assert len(target_tokens) == k + 1, (len(target_tokens), k)
    num_accepted = next((i for i in range(k) if draft_tokens[i] != target_tokens[i]), k)
    return num_accepted, int(target_tokens[num_accepted])


def verify_coupled(
    draft_tokens: torch.Tensor,  # [k] int
    target_probs: torch.Tensor,  # [k + 1, vocab], after the request's logits processing
    seed: int,
    first_position: int,  # the position of the first draft token
) -> tuple[int, int]:
    """The walk along the target's coupled samples. Returns (num_accepted, next_token). On a
    GPU every row's race runs there and one copy fetches the k + 1 tokens; on the CPU the rows
    after the first mismatch are not computed."""
    drafts = draft_tokens.tolist()
    k = len(drafts)
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    if target_probs.device.type != "cpu":
        return verify_walk(drafts, coupled_choices(target_probs, seed, first_position))
    for i in range(k + 1):  # rows after the first mismatch are not needed
        token = coupled_choice(target_probs[i], seed, first_position + i)
        if i == k or drafts[i] != token:
            return i, token
    raise AssertionError("unreachable")


def verify_rejection(
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
