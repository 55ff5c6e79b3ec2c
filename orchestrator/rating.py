"""The rating of a round's choice: its expected tokens per millisecond, a pure function of a
snapshot of acceptance, costs and load (``Snapshot``). orchestrator.adaptive's policy
(``KController``) takes the snapshot and picks the best-rated choice.

A choice is a block length k from a block source: the draft model (``rate``: drafted after
the verdict, or pipelined behind the verify as the speculation cache's branches or the single
guess) or prompt lookup (``lookup_rate``). With per-token acceptance a, a block of k yields
E[k] = (1 - a^(k+1)) / (1 - a) tokens per round (``expected_tokens``).
"""

from __future__ import annotations

import dataclasses

from orchestrator.costs import Costs, raises_throughput


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a round's rating depends on, taken at one moment (KController.snapshot)."""

    costs: Costs
    a: float  # the draft's per-token acceptance
    pipelined: bool = False  # the draft drafts behind each verify
    branching: bool = False  # ... the speculation cache's branches, ``width`` per length
    cache_hit: float = 0.5  # the share of verdicts the cache holds a branch for
    guess_held: float = 1.0  # the single guess: verdicts it held (decayed sum) ...
    guess_predicted: float = 1.0  # ... against what the acceptance predicted for them
    width: int = 1
    waits: bool = True  # rounds may wait for the draft (KController.waits_for_draft)
    decode_on: int = 0  # plain steps the target takes on in a round of no block
    crowd: float = 0.0  # generations on the draft's shared cores (KController.crowd)


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] at per-token acceptance a and block length k."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def guess_hit(s: Snapshot, k: int) -> float:
    """The share of verdicts of a block of k that the single guess holds: a^(k+1), times
    what the guesses held against that prediction."""
    return min(1.0, s.a ** (k + 1) * s.guess_held / max(s.guess_predicted, 1e-9))


def miss_rate(s: Snapshot, k: int, now: bool = False, guess: bool = False) -> float:
    """The share of rounds of k whose block is drafted after the last verdict (between
    two verify calls), not behind the verify pass: every sequential round; pipelined,
    the verdicts the speculation cache had no branch for, or without the cache (or
    ``guess``: drafting only the single guess behind this round, see ``drafts_guess``)
    those that did not keep the whole block and the draft's guess of the target's token.
    ``now``: this round's block is drafted after the verdict (a pipelined miss): 1.
    Where rounds do not wait for the draft no block is: 0 (a miss is a round of no block
    instead, see ``round_ms``)."""
    if not s.waits:
        return 0.0
    if now or not s.pipelined:
        return 1.0
    if s.branching and not guess:
        return 1.0 - s.cache_hit
    return 1.0 - guess_hit(s, k)


def behind_ms(s: Snapshot, k: int, guess: bool = False) -> float:
    """The draft's call behind a verify pass of k: branches, or the block past the guess."""
    if s.branching and not guess:
        return s.costs.branch_call_ms(k, s.width, k)
    return s.costs.draft_ms(k) + s.costs.draft_step_ms


def round_ms(s: Snapshot, k: int, now: bool = False, guess: bool = False) -> float:
    """What a round of k costs, in ms (per token for k = 0 where the target decodes on)."""
    costs = s.costs
    verify = costs.verify_ms(k)
    if k == 0:  # per token: the call's own time is shared by the tokens it decodes on
        # (not where the cache drafts branches behind a round of no block: none then)
        steps = 0 if s.pipelined and s.branching else s.decode_on
        return verify - costs.target_call_ms * steps / (1.0 + steps)
    if not s.waits:  # a hit's verify, else a round of no block
        return s.cache_hit * max(verify, behind_ms(s, k)) + \
            (1.0 - s.cache_hit) * costs.verify_ms(0)
    draft = costs.draft_ms(k)
    sequential = draft + costs.verify_ms(k, drafted=True)  # a miss: draft, then verify
    miss = miss_rate(s, k, now, guess)
    if miss >= 1.0:
        return sequential
    # a hit costs the longer of the verify and the draft behind it
    return (1.0 - miss) * max(verify, behind_ms(s, k, guess)) + miss * sequential


def round_tokens(s: Snapshot, k: int) -> float:
    """Expected tokens of a round of k: E[k], or where rounds do not wait for the draft,
    E[k] on a hit and the target's one token on a miss."""
    if k and not s.waits:
        return s.cache_hit * expected_tokens(s.a, k) + (1.0 - s.cache_hit)
    return expected_tokens(s.a, k)


def may_guess(s: Snapshot, k: int, now: bool = False) -> bool:
    """Whether a round of k may draft the single guess behind its verify, the cache on."""
    return bool(k) and s.pipelined and s.branching and not now and s.waits


def rate(s: Snapshot, k: int, now: bool = False) -> float:
    """Expected tokens per millisecond of a round of k from the draft model (``now``: of a
    round whose block is drafted after the verdict, as ``miss_rate``)."""
    ms = round_ms(s, k, now)
    if may_guess(s, k, now):  # the cheaper of the cache and the guess behind it
        ms = min(ms, round_ms(s, k, now, guess=True))
    return round_tokens(s, k) / ms


def drafts_guess(s: Snapshot, k: int) -> bool:
    """Whether, behind a verify of k, the draft should draft only its guess of the target's
    token and the block past it (plain pipelining's one row), not the speculation cache's
    k + 1 verdict rows (times the width), though the cache is on: where the draft's pass
    grows with its rows and its acceptance is high, the guess hits nearly as often for a
    cheaper call. Chosen by the shorter predicted round (the same tokens either way), only
    where rounds wait for the draft."""
    return may_guess(s, k) and round_ms(s, k, guess=True) < round_ms(s, k)


def raises(s: Snapshot, k: int, now: bool = False) -> bool:
    """Under load, whether a block of k raises the target's aggregate throughput
    (costs.raises_throughput at this snapshot's miss rate; crowded, with the block's k
    draft steps on the shared cores)."""
    return raises_throughput(s.costs, k, expected_tokens(s.a, k), miss_rate(s, k, now),
                             s.crowd, k * s.costs.draft_step_ms if s.crowd else 0.0)


def lookup_rate(costs: Costs, size: int, accepted: float) -> float:
    """Expected tokens per millisecond of a round with a prompt-lookup block of ``size``
    whose blocks get ``accepted`` tokens accepted on average (no draft call: only the longer
    verify pass is weighed)."""
    return (1.0 + accepted) / costs.verify_ms(size)
