"""A generation's request, statistics and result, as every front and the round loop see them."""

from __future__ import annotations

import dataclasses
import enum
import uuid

from orchestrator.service_clients import CallRecord
from specdec.config import MAX_K, MAX_TOP_LOGPROBS, SamplingParams

MODES = ("pipelined", "spec", "target-only")
# Plain target steps a round with no block asks the target to take on by itself (VerifyRequest
# decode_on): one call instead of a round trip per token, while a stream still gets its text
# every 1 + DECODE_ON tokens (~90 ms at this CPU's ~10 ms step).
DECODE_ON = 8
DEFAULT_MODE = "pipelined"  # the draft drafts block i+1 while the target verifies block i


@dataclasses.dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: list[str] = dataclasses.field(default_factory=list)
    mode: str = DEFAULT_MODE
    k: int | None = None  # None = adaptive
    request_id: str = ""
    # Prompt lookup before the draft model: when the history's last tokens occurred earlier,
    # propose what followed them (free, and strong on input-grounded text).
    prompt_lookup: bool = True
    # None: no log-probabilities; N (0..20): each generated token's, and its N likeliest
    # alternatives' (the target's raw log-softmax at that position)
    logprobs: int | None = None
    # Also the log-probability of each prompt token but the first (prompt scoring, `echo`)
    prompt_logprobs: bool = False
    # Pipelined: draft behind each verify for every likely verdict (the speculation cache)
    # where the request allows it; False: only the single guess past the block.
    branches: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.k is not None and not (0 <= self.k <= MAX_K):
            raise ValueError(f"k must be in [0, {MAX_K}], got {self.k}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.logprobs}")
        if not self.request_id:
            self.request_id = uuid.uuid4().hex[:16]

class Source(enum.Enum):
    """Where a round's block came from."""

    DRAFT = "draft"  # the draft model drafted it this round
    PIPELINED = "pipelined"  # ... during the previous round's verify
    LOOKUP = "lookup"  # prompt lookup
    FIRST = "first"  # the first round: empty, the draft prefills (and drafts behind it)
    NONE = "none"  # no block: k = 0, or the draft was down or failed
    CROWDED = "crowded"  # no block, chosen with other generations on the shared cores
    # (KController.crowd)


@dataclasses.dataclass
class Block:
    """A block to verify: draft tokens, the sparse q each was drawn from (rejection rule only),
    where it came from, and the k the controller asked for this round."""

    tokens: list[int]
    dists: list = dataclasses.field(default_factory=list)
    source: Source = Source.DRAFT
    k: int = 0
    draft_failed: bool = False

    def cut(self, k: int) -> "Block":
        """The block's first k tokens."""
        if len(self.tokens) <= k:
            return self
        return dataclasses.replace(self, tokens=self.tokens[:k], dists=self.dists[:k])


@dataclasses.dataclass
class Behind:
    """What the draft drafted behind a round's verify pass (pipelined), and what its verdict
    found of it."""

    guess_call: bool  # the single guess and the block past it, not speculation-cache branches
    judged: bool = False  # the verdict looked for its block (not the generation's last round)
    hit: bool = False  # it held the verdict's next block
    branches: int = 0  # speculation-cache branches it drafted
    late: bool = False  # a branch call still unanswered at the verdict, dropped

    @property
    def cache_hit(self) -> bool:
        return self.hit and not self.guess_call


@dataclasses.dataclass
class Round:
    """One verify pass: the block, how much of it the target accepted, and its own token."""

    block: Block
    accepted: int
    next_token: int
    decoded: list[int] = dataclasses.field(default_factory=list)  # decoded on after next_token
    logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)  # per token
    prompt_logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)
    committed_s: float = 0.0  # since the generation started, when its tokens were committed
    behind: Behind | None = None  # pipelined: the draft's call behind this verify, if any
    features: object = None  # the verdict's pb.Features (asked for a feature draft)

    @property
    def tokens(self) -> list[int]:
        """What the round emits: the accepted draft tokens, the target's token, and the plain
        tokens it decoded on after it."""
        return self.block.tokens[: self.accepted] + [self.next_token] + self.decoded

    @property
    def full_accept(self) -> bool:
        return self.accepted == len(self.block.tokens)


@dataclasses.dataclass
class GenerationStats:
    mode: str = ""
    rounds: int = 0
    draft_tokens: int = 0  # proposed tokens that were verified
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    rounds_per_k: dict[int, int] = dataclasses.field(default_factory=dict)
    tokens_per_round: list[int] = dataclasses.field(default_factory=list)
    k_requested: list[int] = dataclasses.field(default_factory=list)  # k asked of the draft
    lookup_rounds: int = 0  # rounds whose block came from prompt lookup, not the draft model
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    pipeline_hits: int = 0  # rounds whose block was drafted during the previous verify
    pipeline_misses: int = 0  # verdicts the pipelined draft had no block for
    branches_drafted: int = 0  # speculation-cache branches drafted (hits included)
    cache_hits: int = 0  # pipeline hits that took a speculation-cache branch
    guess_calls: int = 0  # calls behind a verify that drafted the single guess, cache on or off
    late_branch_calls: int = 0  # branch calls dropped unanswered at their verdict (under load)
    re_prefills: int = 0
    tokens_without_draft: int = 0  # emitted while the draft was down or failing
    crowded_rounds: int = 0  # no block, other generations on the shared cores (Source.CROWDED)
    decoded_tokens: int = 0  # emitted by the target decoding on after a round with no block
    draft_failures: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    calls: list[CallRecord] = dataclasses.field(default_factory=list)

    def record(self, rnd: Round) -> None:
        """Count one finished round (every per-round statistic is counted here and only here;
        ``calls`` and ``draft_failures`` as they happen)."""
        n = len(rnd.block.tokens)
        self.rounds += 1
        if self.rounds == 1:
            self.ttft_s = rnd.committed_s
        self.k_requested.append(rnd.block.k)
        self.rounds_per_k[n] = self.rounds_per_k.get(n, 0) + 1
        self.draft_tokens += n
        self.accepted_tokens += rnd.accepted
        while len(self.accepted_per_position) < n:
            self.accepted_per_position.append(0)
        for i in range(rnd.accepted):
            self.accepted_per_position[i] += 1
        self.tokens_per_round.append(len(rnd.tokens))
        if rnd.block.draft_failed:  # the draft was down or failed: this round's tokens came alone
            self.tokens_without_draft += len(rnd.tokens)
        self.decoded_tokens += len(rnd.decoded)
        self.crowded_rounds += rnd.block.source is Source.CROWDED
        if rnd.block.source is Source.LOOKUP:
            self.lookup_rounds += 1
            self.lookup_drafted += n
            self.lookup_accepted += rnd.accepted
        if rnd.behind is not None:
            self._record_behind(rnd.behind)

    def _record_behind(self, behind: Behind) -> None:
        self.guess_calls += behind.guess_call
        self.branches_drafted += behind.branches
        self.late_branch_calls += behind.late
        if behind.judged:
            self.pipeline_hits += behind.hit
            self.pipeline_misses += not behind.hit
            self.cache_hits += behind.cache_hit

    def finish(self, wall_s: float) -> None:
        """The generation ended after ``wall_s``: what its calls add up to."""
        self.wall_s = wall_s
        self.re_prefills = sum(c.re_prefilled for c in self.calls)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def num_drafts(self) -> int:
        """Rounds that verified a non-empty block (vLLM's spec_decode_num_drafts)."""
        return sum(c for k, c in self.rounds_per_k.items() if k > 0)

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens emitted per round, over every round (a round without a block emits 1, plus
        what the target decoded on)."""
        return sum(self.tokens_per_round) / self.rounds if self.rounds else 0.0

    @property
    def k_mean(self) -> float:
        n = sum(self.rounds_per_k.values())
        return sum(k * c for k, c in self.rounds_per_k.items()) / n if n else 0.0

    def time_split(self) -> dict[str, float]:
        """Seconds of draft compute, verify compute, network (RPC time not computing) and idle
        (wall time when no call was in flight), and overlap efficiency."""
        draft = sum(c.compute_ms for c in self.calls if c.service == "draft") / 1000.0
        verify = sum(c.compute_ms for c in self.calls if c.service == "target") / 1000.0
        rpc_time = {"draft": 0.0, "target": 0.0}
        for c in self.calls:
            rpc_time[c.service] += c.end - c.start
        network = max(0.0, rpc_time["draft"] - draft) + max(0.0, rpc_time["target"] - verify)
        busy = _union_length([(c.start, c.end) for c in self.calls])
        wall = self.wall_s or 1e-9
        return dict(
            draft_s=draft,
            verify_s=verify,
            network_s=network,
            idle_s=max(0.0, wall - busy),
            overlap_efficiency=(draft + verify) / wall,
        )


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]  # generated ids (EOS included when it ended the text)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    prompt_tokens: int
    stats: GenerationStats
    # with GenerationRequest.logprobs: one TokenLogprob per token id, else []
    logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)
    # with GenerationRequest.prompt_logprobs: one per prompt token but the first
    prompt_logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        s = self.stats
        n = len(self.token_ids)
        split = s.time_split()
        beyond_ms = max(0.0, s.wall_s - _union_length(
            [(c.end - c.compute_ms / 1000.0, c.end) for c in s.calls])) * 1000.0
        return dict(
            request_id=self.request_id,
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=n,
            mode=s.mode,
            rounds=s.rounds,
            draft_tokens=s.draft_tokens,
            accepted_tokens=s.accepted_tokens,
            acceptance_rate=round(s.acceptance_rate, 4),
            mean_tokens_per_round=round(s.mean_tokens_per_round, 4),
            k_mean=round(s.k_mean, 3),
            tokens_per_s=round(n / s.wall_s, 3) if s.wall_s else 0.0,
            wall_s=round(s.wall_s, 4),
            ttft_s=round(s.ttft_s, 4),
            overlap_efficiency=round(split["overlap_efficiency"], 4),
            # Wall time per round and per token beyond the services' compute (RPCs, the
            # orchestrator's own work, idle waits); in pipelined rounds overlapped compute
            # counts once.
            overhead_ms_per_round=round(beyond_ms / s.rounds, 3) if s.rounds else 0.0,
            overhead_ms_per_token=round(beyond_ms / n, 3) if n else 0.0,
            decoded_tokens=s.decoded_tokens,
            time_split={k: round(v, 4) for k, v in split.items() if k != "overlap_efficiency"},
            lookup_rounds=s.lookup_rounds,
            lookup_acceptance=round(s.lookup_accepted / s.lookup_drafted, 4)
            if s.lookup_drafted else 0.0,
            pipeline_hits=s.pipeline_hits,
            pipeline_misses=s.pipeline_misses,
            cache_branches=s.branches_drafted,
            wasted_branches=s.branches_drafted - s.cache_hits,
            guess_calls=s.guess_calls,
            late_branch_calls=s.late_branch_calls,
            re_prefills=s.re_prefills,
            tokens_without_draft=s.tokens_without_draft,
            crowded_rounds=s.crowded_rounds,
            accepted_per_position=s.accepted_per_position,
        )


@dataclasses.dataclass
class Delta:
    """Streamed piece of a generation: new text and the token ids it came from."""

    text: str
    token_ids: list[int]
    logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TokenLogprob:
    """The target's log-probability of a generated token, and the likeliest alternatives at its
    position (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

