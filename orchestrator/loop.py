"""The speculation loop: draft k, verify in one pass, commit; sequential or pipelined.

- ``target-only``: every round is a verify of an empty block (one target decoding step).
- ``spec`` (sequential): the draft proposes a block, then the target verifies it.
- ``pipelined``: while the target verifies block i, the draft already drafts block i+1 from
  block i plus its own guess g of the target's next token (the draft simply keeps drafting past
  the block). When the verdict accepts all of block i and the target's token equals g, block
  i+1 goes on at once; otherwise the in-flight draft call is cancelled, the draft rolls back to
  the committed tokens (its next call's prefix says so) and drafts from the target's token.

Every mode emits exactly the target's tokens: greedy output, and sampled output under the
coupled rule, are identical to target-only's for the same seed; under the rejection rule
sampling has the target's distribution (the rules live in specdec.serving.acceptance, on the target
service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

from orchestrator.adaptive import Costs, KController, LiveCosts, LookupSizer
from orchestrator.service_clients import (
    CallRecord,
    DraftClient,
    History,
    ServiceError,
    TargetClient,
)
from orchestrator.text import TextStream
from specdec.config import MAX_K, MAX_TOP_LOGPROBS, SamplingParams
from specdec.serving.drafting import lookup
from specdec.wire import specdec_pb2 as pb

log = logging.getLogger(__name__)

MODES = ("pipelined", "spec", "target-only")


@dataclasses.dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: list[str] = dataclasses.field(default_factory=list)
    mode: str = "pipelined"
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
    pipeline_misses: int = 0  # speculative blocks dropped (rejection or wrong guess)
    re_prefills: int = 0
    tokens_without_draft: int = 0  # emitted while the draft was down or failing
    draft_failures: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    calls: list[CallRecord] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

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
            mean_tokens_per_round=round(sum(s.tokens_per_round) / s.rounds, 4) if s.rounds else 0.0,
            k_mean=round(s.k_mean, 3),
            tokens_per_s=round(n / s.wall_s, 3) if s.wall_s else 0.0,
            wall_s=round(s.wall_s, 4),
            ttft_s=round(s.ttft_s, 4),
            overlap_efficiency=round(split["overlap_efficiency"], 4),
            # Wall time per round beyond the services' compute (RPCs, the orchestrator's own
            # work, idle waits); in pipelined rounds overlapped compute counts once.
            overhead_ms_per_round=round(max(0.0, s.wall_s - _union_length(
                [(c.end - c.compute_ms / 1000.0, c.end) for c in s.calls])) / s.rounds * 1000.0,
                3) if s.rounds else 0.0,
            time_split={k: round(v, 4) for k, v in split.items() if k != "overlap_efficiency"},
            lookup_rounds=s.lookup_rounds,
            lookup_acceptance=round(s.lookup_accepted / s.lookup_drafted, 4)
            if s.lookup_drafted else 0.0,
            pipeline_hits=s.pipeline_hits,
            pipeline_misses=s.pipeline_misses,
            re_prefills=s.re_prefills,
            tokens_without_draft=s.tokens_without_draft,
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


def _token_logprobs(tokens: list[int], entries) -> list[TokenLogprob]:
    """TokenLogprobs of a VerifyResponse (wire) as TokenLogprob, one per token."""
    return [TokenLogprob(t, e.logprob, list(zip(e.top_ids, e.top_logprobs)))
            for t, e in zip(tokens, entries)]


class _Block:
    """A drafted block: tokens and their q's (sparse, rejection rule only)."""

    def __init__(self, tokens: list[int], dists: list):
        self.tokens = tokens
        self.dists = dists


LOOKUP_MIN_NGRAM = 3  # matched tokens a lookup block needs to take a draft model's round
LOOKUP_MIN_NGRAM_ALONE = 1  # ... and a round the draft model would not draft (k = 0)
LOOKUP_MAX_NGRAM = 5
LOOKUP_MAX_TOKENS = 8


def _lookup_block(history: list[int], room: int, sampling: SamplingParams,
                  min_ngram: int) -> _Block | None:
    """Prompt lookup: what followed the latest earlier occurrence of the history's last
    ``min_ngram``..5 tokens, as a block (q is one-hot on each proposed token), or None."""
    if room < 1:
        return None
    tokens = lookup(history, min(LOOKUP_MAX_TOKENS, room), LOOKUP_MAX_NGRAM, min_ngram)
    if not tokens:
        return None
    return _Block(tokens, [] if sampling.drafter_invariant else [([t], [1.0]) for t in tokens])


class Orchestrator:
    """Drives generations over one draft client (optional) and one target client."""

    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer,
                 eos_ids: list[int], max_context: int):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        # What rounds cost as the calls show it, shared by this orchestrator's generations;
        # None: greedy requests too use the services' start-up calibration.
        self.live_costs: LiveCosts | None = self._calibrated_costs(LiveCosts)

    def _calibrated_costs(self, kind: type[Costs] = Costs) -> Costs:
        """Costs from the services' start-up calibration (GetInfo.forward_ms)."""
        target_ms = list(self.target.info.forward_ms) if self.target.info else []
        draft_ms = list(self.draft.info.forward_ms) if self.draft and self.draft.info else []
        return kind.calibrated(target_ms, draft_ms)

    def _record(self, stats: "GenerationStats", rec: CallRecord) -> None:
        stats.calls.append(rec)
        if self.live_costs is not None:
            self.live_costs.observe(rec)

    def service_clients(self) -> dict[str, object]:
        """The service clients by name (health checks and metrics ask each of them)."""
        return {"target": self.target, **({"draft": self.draft} if self.draft else {})}

    def _costs(self, req: GenerationRequest) -> Costs:
        if req.sampling.drafter_invariant and self.live_costs is not None:
            return self.live_costs  # k cannot change the text: cost rounds as they are
        return self._calibrated_costs()

    def _controller(self, req: GenerationRequest) -> KController:
        costs = self._costs(req)
        return KController(costs.target_ms, [costs.draft_step_ms], fixed_k=req.k,
                           pipelined=req.mode == "pipelined", costs=costs)

    def _lookup_sizer(self, req: GenerationRequest) -> LookupSizer:
        return LookupSizer(self._costs(req), LOOKUP_MAX_TOKENS)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run a generation to the end and return its result."""
        result = None
        async for item in self.stream(req):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Delta | GenerationResult]:
        """Yield text deltas as tokens are committed, then the GenerationResult."""
        if len(req.prompt_ids) + req.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the context of {self.max_context} tokens"
            )
        session_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        stats = GenerationStats(mode=req.mode)
        history = History(req.prompt_ids)
        n_prompt = len(req.prompt_ids)
        generated: list[int] = []
        logprobs: list[TokenLogprob] = []  # in step with generated (when asked for)
        prompt_logprobs: list[TokenLogprob] = []
        streamed = 0  # generated ids already handed out in a Delta
        text = TextStream(self.tokenizer, req.stop)
        finish = "length"
        started = time.perf_counter()
        use_draft = req.mode != "target-only" and self.draft is not None
        k_ctl = self._controller(req) if use_draft else None
        lookup = (self._lookup_sizer(req)
                  if req.prompt_lookup and req.mode != "target-only" else None)
        spec_task: asyncio.Task | None = None
        block: _Block | None = None
        try:
            while True:
                remaining = req.max_new_tokens - len(generated)
                k = min(k_ctl.next_k(), remaining - 1, MAX_K) if k_ctl else 0
                k = max(k, 0)
                stats.k_requested.append(k)
                # 1. the block for this round. Pipelined, the first round drafts nothing: the
                # target's prefill produces its first token while the draft prefills and drafts
                # past its guess of that token (step 2), which gives time to first token = the
                # target's prefill alone.
                no_draft = looked_up = False
                first_pipelined = (req.mode == "pipelined" and stats.rounds == 0 and k > 0
                                   and await self.draft.available())
                if block is None and lookup is not None:
                    size = min(lookup.size(), remaining - 1)
                    block = _lookup_block(history.tokens, size, req.sampling,
                                          LOOKUP_MIN_NGRAM if k > 0 else LOOKUP_MIN_NGRAM_ALONE)
                    looked_up = block is not None
                if looked_up:
                    k = len(block.tokens)  # free to draft: the verify pass decides
                    first_pipelined = False
                    stats.lookup_rounds += 1
                elif first_pipelined:
                    block = _Block([], [])
                elif k > 0 and block is None:
                    if await self.draft.available():
                        block = await self._draft(session_id, history, [], k, req, stats)
                    no_draft = block is None
                    if block is None:
                        k = 0
                elif block is not None and len(block.tokens) > k:
                    block = _Block(block.tokens[:k], block.dists[:k])
                if k == 0 or block is None:
                    block = _Block([], [])
                # 2. pipelined: keep drafting past the block while the target verifies it
                k_next = 0
                if (req.mode == "pipelined" and (block.tokens or first_pipelined)
                        and self.draft is not None and remaining - len(block.tokens) - 1 > 0):
                    # The draft also drafts its guess of the target's token: k_next + 1 <= MAX_K.
                    k_next = min(k_ctl.next_k(after_full_accept=True), MAX_K - 1,
                                 remaining - len(block.tokens) - 2)
                if k_next > 0:
                    spec_task = asyncio.create_task(
                        self._draft(session_id, history, block.tokens, k_next + 1, req, stats,
                                    speculative=True)
                    )
                # 3. verify
                resp, rec = await self.target.verify(
                    session_id, history, block.tokens,
                    [pb.SparseDist(ids=i, probs=p) for i, p in block.dists],
                    req.sampling, req.request_id, req.logprobs,
                    prompt_logprobs=req.prompt_logprobs and stats.rounds == 0,
                )
                if req.prompt_logprobs and stats.rounds == 0:
                    prompt_logprobs = _token_logprobs(req.prompt_ids[1:], resp.prompt_logprobs)
                self._record(stats, rec)
                n_acc = int(resp.num_accepted)
                new = block.tokens[:n_acc] + [int(resp.next_token)]
                if req.logprobs is not None:
                    logprobs += _token_logprobs(new, resp.logprobs)
                stats.rounds += 1
                stats.rounds_per_k[len(block.tokens)] = stats.rounds_per_k.get(len(block.tokens), 0) + 1
                stats.draft_tokens += len(block.tokens)
                stats.accepted_tokens += n_acc
                while len(stats.accepted_per_position) < len(block.tokens):
                    stats.accepted_per_position.append(0)
                for i in range(n_acc):
                    stats.accepted_per_position[i] += 1
                stats.tokens_per_round.append(len(new))
                if no_draft:  # the draft was down or failed: this round's token came alone
                    stats.tokens_without_draft += 1
                if looked_up:  # the draft model's acceptance is learnt from its own blocks
                    stats.lookup_drafted += len(block.tokens)
                    stats.lookup_accepted += n_acc
                    lookup.observe(n_acc)
                elif k_ctl is not None and block.tokens:
                    k_ctl.observe(len(block.tokens), n_acc)
                elif k_ctl is not None:
                    k_ctl.observe(0, 0)
                # 4. the next block: from the speculation if it guessed right
                next_block = None
                if spec_task is not None:
                    if n_acc == len(block.tokens) and not spec_task.done():
                        spec = await spec_task
                    elif n_acc == len(block.tokens):
                        spec = spec_task.result()
                    else:
                        spec = None
                        spec_task.cancel()
                    if spec is not None and spec.tokens and spec.tokens[0] == resp.next_token:
                        next_block = _Block(spec.tokens[1:], spec.dists[1:])
                        stats.pipeline_hits += 1
                    else:
                        stats.pipeline_misses += 1
                    spec_task = None
                block = next_block if next_block is not None and next_block.tokens else None
                # 5. commit, then stop conditions
                done = False
                for i, tok in enumerate(new):
                    generated.append(tok)
                    if tok in self.eos_ids:
                        finish, done = "stop", True
                        break
                    if len(generated) >= req.max_new_tokens:
                        done = True
                        break
                history.extend(new[: i + 1])
                if stats.ttft_s == 0.0:
                    stats.ttft_s = time.perf_counter() - started
                delta = text.update(generated, final=done)
                if text.stopped:
                    finish, done = "stop", True
                    generated = generated[: text.stop_token_count]
                if delta or (done and streamed < len(generated)):
                    # the ids not yet streamed, none past EOS or the stop string
                    yield Delta(delta, generated[streamed:], logprobs[streamed:len(generated)])
                    streamed = len(generated)
                if done:
                    break
        finally:
            if spec_task is not None:
                spec_task.cancel()
            stats.wall_s = time.perf_counter() - started
            stats.re_prefills = sum(c.re_prefilled for c in stats.calls)
            await asyncio.shield(self._close(session_id))
        yield GenerationResult(req.request_id, generated, text.text, finish, n_prompt, stats,
                               logprobs[: len(generated)], prompt_logprobs)

    async def _draft(self, session_id: str, history: History, extra: list[int], k: int,
                     req: GenerationRequest, stats: GenerationStats,
                     speculative: bool = False) -> _Block | None:
        """A block from the draft, or None when the draft failed (the round goes on without)."""
        try:
            resp, rec = await self.draft.propose(session_id, history, extra, k, req.sampling,
                                                 req.request_id)
        except asyncio.CancelledError:
            if speculative:
                t = time.perf_counter()
                stats.calls.append(CallRecord("draft", t, t, 0.0, 0, "cancelled"))
            raise
        except ServiceError as exc:
            stats.draft_failures += 1
            if not exc.request_fault:  # the service failed, not this request's own call:
                self.draft.mark_failed()  # every generation goes without it for a while
            log.warning("request %s: draft failed (%s); continuing without it", req.request_id, exc)
            return None
        self._record(stats, rec)
        return _Block(list(resp.tokens), [(list(d.ids), list(d.probs)) for d in resp.dists])

    async def _close(self, session_id: str) -> None:
        closers = [self.target.close_session(session_id)]
        if self.draft is not None:
            closers.append(self.draft.close_session(session_id))
        await asyncio.gather(*closers, return_exceptions=True)
