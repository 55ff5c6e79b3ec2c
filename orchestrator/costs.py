"""What a speculation round costs, in milliseconds: the cost model adaptive k rates its
choices with (orchestrator.adaptive).

``Costs`` start from the services' start-up calibration (GetInfo.forward_ms); ``LiveCosts``
follow what the services' calls actually cost, so services started together, slowed by
neighbours or batching other sessions are costed as they are. ``raises_throughput`` is the
model's load term: whether a block raises the target's aggregate throughput while it batches
other sessions, with crowding (the draft's compute on the target's shared cores) as a term.
The measurements behind each tunable are in docs/design.md, under its name.
"""

from __future__ import annotations

import dataclasses

# --- Tunables, each with its reason (measurements: docs/design.md, "Adaptive k's tunables").
ADAPTIVE_K_MAX = 8  # the longest block adaptive k chooses (a fixed k may go to config.MAX_K)
LOADED_BATCH = 1.5  # the target's passes hold other sessions above this many on average
MAX_STEADY_TOKENS = 16  # a call sending more committed tokens is a prefill, not a round
FIT_MIN_WEIGHT = 6.0  # passes the pass-cost line needs before it is trusted
FIT_MIN_VARIANCE = 0.5  # tokens^2 the passes must spread over to tell a slope
COST_DECAY = 0.9  # the weight old costs keep per call: they follow the last ten or so calls
FIT_DECAY = 0.97  # the pass-cost line's: slower, it needs passes of several sizes


class Decayed:
    """A running figure that forgets: ``average`` moves ``value`` a share 1 - decay toward
    each observation (a decayed mean); ``add`` keeps decay^age of it and adds the observation
    (a decayed sum; two of them give a mean with its weight)."""

    __slots__ = ("value", "decay")

    def __init__(self, value: float, decay: float):
        self.value = value
        self.decay = decay

    @staticmethod
    def mix(old: float, new: float, decay: float) -> float:
        """The decayed mean's step, for figures kept as plain floats (``LiveCosts``)."""
        return decay * old + (1 - decay) * new

    def average(self, x: float) -> None:
        self.value = self.mix(self.value, x, self.decay)

    def add(self, x: float, age: int = 1) -> None:
        self.value = self.value * self.decay ** age + x


@dataclasses.dataclass
class Costs:
    """What a round costs, in ms: a verify pass, a draft step, and each call's time beyond the
    services' compute (RPC, scheduling).

    A verify pass of a block of k shares the target's forward with the other sessions in its
    batch (``target_batch`` of them, each with about k + 1 tokens), so it costs the calibrated
    T(m) at m = target_batch * (k + 1) tokens, times ``target_scale`` (what the calls show
    against the calibration). Under load a longer block therefore costs more, and k shrinks.
    ``target_wait`` / ``target_wait_drafted``: the wait for the pass in progress when a
    verify arrives, as a share of a pass, for verifies whose block was ready and for those
    sent after a draft call (which come back after the others' pass has started).
    """

    target_ms: list[float]
    draft_step_ms: float = 0.0
    target_scale: float = 1.0
    target_call_ms: float = 1.0
    draft_call_ms: float = 1.0
    target_batch: float = 1.0
    draft_forward: list[float] = dataclasses.field(default_factory=list)  # calibrated D(m)
    target_wait: float = 0.0
    target_wait_drafted: float = 0.0

    @classmethod
    def calibrated(cls, target_ms: list[float], draft_ms: list[float]) -> "Costs":
        return cls(list(target_ms) or [1.0] * (ADAPTIVE_K_MAX + 1),
                   draft_ms[0] if draft_ms else 0.0, draft_forward=list(draft_ms))

    def forward_ms(self, tokens: float) -> float:
        """Calibrated T(m) of one target forward over ``tokens`` new tokens."""
        return _curve(self.target_ms, tokens)

    def branch_call_ms(self, k: int, width: int, depth: int) -> float:
        """A speculation-cache call (draft side): one pass over the block's k + 1 verdict rows,
        then ``depth`` passes over (k + 1) * width branches at once."""
        if not self.draft_forward:
            return (1 + depth) * self.draft_step_ms + self.draft_call_ms
        scale = self.draft_step_ms / self.draft_forward[0] if self.draft_forward[0] else 1.0
        return scale * (_curve(self.draft_forward, k + 1)
                        + depth * _curve(self.draft_forward, (k + 1) * width)) \
            + self.draft_call_ms

    def pass_ms(self, tokens: float) -> float:
        """One target forward pass over ``tokens`` new tokens (every session's)."""
        return self.forward_ms(tokens) * self.target_scale

    def verify_ms(self, k: int, drafted: bool = False) -> float:
        """A verify call for a block of k (``drafted``: sent after a draft call): its pass,
        the wait for the pass in progress when it arrives, and the call's own time."""
        if not k:  # a session that only verifies is back in the target's next pass at once
            wait = 0.0
        else:
            wait = self.target_wait_drafted if drafted else self.target_wait
        return self.pass_ms(self.target_batch * (k + 1)) * (1.0 + wait) + self.target_call_ms

    def draft_ms(self, k: int) -> float:
        """A draft call for k tokens (one step each)."""
        return k * self.draft_step_ms + self.draft_call_ms


def _curve(t: list[float], tokens: float) -> float:
    """A calibrated forward-cost curve t[m - 1] = T(m), extended past its end at the slope of
    its upper half (a small pass is all overhead; the cost per token grows as the pass grows)."""
    n = len(t)
    if tokens <= n:
        return t[max(int(round(tokens)), 1) - 1]
    half = n // 2
    slope = (t[-1] - t[half]) / (n - 1 - half) if n - 1 > half else t[0]
    return t[-1] + slope * (tokens - n)


@dataclasses.dataclass
class LiveCosts(Costs):
    """Costs that follow the calls as they happen (one per orchestrator, so a new generation
    starts from what the last ones saw).

    While the target batches other sessions, its passes are costed by a line fitted to the
    verify calls' own passes (compute ms against the pass's tokens, every session's; decayed
    least squares) instead of the scaled start-up calibration, which times one session over
    m tokens and grows more slowly per token than a pass over several sessions does.
    """

    decay: float = COST_DECAY
    fit_decay: float = FIT_DECAY
    # decayed sums of the target's passes: weight, tokens, ms, tokens^2, tokens * ms
    passes: list[Decayed] | None = None

    def __post_init__(self):
        if self.passes is None:
            self.passes = [Decayed(0.0, self.fit_decay) for _ in range(5)]

    def pass_ms(self, tokens: float) -> float:
        # the line while passes hold more than one session on average; alone, the calibration
        line = self._pass_line() if self.target_batch > LOADED_BATCH else None
        if line is None:
            return super().pass_ms(tokens)
        # (never below a one-token pass: a line fitted to noisy passes can cross zero)
        intercept, slope = line
        return max(intercept + slope * tokens, super().pass_ms(1.0))

    def _pass_line(self) -> tuple[float, float] | None:
        """(ms, ms per token) of the fitted pass cost, or None while the passes seen are too
        few or too alike to tell a slope."""
        w, sx, sy, sxx, sxy = (p.value for p in self.passes)
        if w < FIT_MIN_WEIGHT:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < FIT_MIN_VARIANCE:
            return None
        slope = max((sxy / w - mx * my) / var, 0.0)
        return my - slope * mx, slope

    def observe(self, rec) -> None:
        """Fold in one call (an orchestrator.service_clients.CallRecord)."""
        if rec.outcome != "ok" or rec.re_prefilled or rec.sent_tokens > MAX_STEADY_TOKENS:
            return  # cancelled, or a prefill: not what a steady round costs
        beyond = max(0.0, rec.wall_ms - rec.compute_ms)
        d, mix = self.decay, Decayed.mix
        if rec.service == "target":
            batch = max(rec.batch_size, 1)
            tokens = rec.pass_tokens or batch * (rec.sent_tokens + rec.tokens)
            # a call that decoded on took rec.passes passes alike; its own time is once a call
            compute_ms = rec.compute_ms / max(rec.passes, 1)
            self.target_scale = mix(self.target_scale,
                                    compute_ms / max(self.forward_ms(tokens), 1e-6), d)
            self.target_batch = mix(self.target_batch, batch, d)
            # The target reports how long the call waited before its first pass: that wait,
            # as a share of a pass; the rest beyond compute is the call's own time.
            queued = min(rec.queued_ms, beyond)
            self.target_call_ms = mix(self.target_call_ms, beyond - queued, d)
            wait = queued / max(compute_ms, 1e-6)
            if rec.after_draft:
                self.target_wait_drafted = mix(self.target_wait_drafted, wait, d)
            else:
                self.target_wait = mix(self.target_wait, wait, d)
            x, y = float(tokens), compute_ms
            for p, v in zip(self.passes, (1.0, x, y, x * x, x * y)):
                p.add(v)
        elif rec.tokens > 0 and not rec.branches:  # (a branch call is costed apart)
            # A draft call runs one pass per token (the first also takes the committed tokens).
            self.draft_step_ms = mix(self.draft_step_ms, rec.compute_ms / rec.tokens, d)
            self.draft_call_ms = mix(self.draft_call_ms, beyond, d)


def raises_throughput(costs: Costs, k: int, tokens: float, miss: float, crowd: float = 0.0,
                      draft_ms: float = 0.0) -> bool:
    """Under load, whether a session's block of k, yielding ``tokens`` per round, raises the
    target's aggregate throughput; ``miss``: the share of its rounds whose block is drafted
    between two verify calls (not ready when the verdict comes).

    With B sessions in its passes the target runs pass after pass. A session whose block is
    ready at the verdict rides the next pass with k + 1 tokens; one that drafts between its
    calls comes back after the others' next pass has started and rides the one after. Per
    round of this session: a hit costs pass(B + k) for B - 1 + E tokens, a miss pass(B - 1) +
    pass(B + k) for 2 (B - 1) + E; target-only rounds give B tokens per pass(B). Alone, the
    target waits for this session anyway: True.

    The crowding term, where the draft shares the target's cores: B is at least ``crowd``,
    the generations running now (the calls' batch lags behind them), and the block's draft
    compute ``draft_ms`` is the cores' time too, which the target's passes wait for instead
    of it hiding behind them."""
    b = max(costs.target_batch, crowd)
    if not k or b <= LOADED_BATCH:
        return True
    total = (b - 1.0) * (1.0 + miss) + tokens
    ms = costs.pass_ms(b + k) + miss * costs.pass_ms(b - 1.0) + draft_ms
    return total / ms > b / costs.pass_ms(b)
