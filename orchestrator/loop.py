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
import logging
import time
import uuid
from typing import AsyncIterator

from orchestrator.adaptive import (
    LOOKUP_PRIOR,
    POOL_DECAY,
    PRIOR_A,
    Acceptance,
    BranchWidth,
    Costs,
    LATE_SHARE,
    KController,
    LiveCosts,
    LookupPool,
    LookupSizer,
)
from orchestrator.generation import (
    DECODE_ON,
    Block,
    Delta,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Round,
    TokenLogprob,
)
from orchestrator.service_clients import (
    CallRecord,
    DraftClient,
    History,
    ServiceError,
    TargetClient,
)
from orchestrator.text import TextStream
from specdec.config import MAX_DECODE_ON, MAX_K, SamplingParams
from specdec.serving.branching import MAX_BRANCHES
from specdec.serving.drafting import lookup
from specdec.serving.grammar import GrammarState, Grammars
from specdec.wire import specdec_pb2 as pb

log = logging.getLogger(__name__)


def _token_logprobs(tokens: list[int], entries) -> list[TokenLogprob]:
    """TokenLogprobs of a VerifyResponse (wire) as TokenLogprob, one per token."""
    return [TokenLogprob(t, e.logprob, list(zip(e.top_ids, e.top_logprobs)))
            for t, e in zip(tokens, entries)]


LOOKUP_MIN_NGRAM = 3  # matched tokens a lookup block needs to take a draft model's round
LOOKUP_MIN_NGRAM_ALONE = 1  # ... and a round the draft model would not draft (k = 0)
LOOKUP_MAX_NGRAM = 5
LOOKUP_MAX_TOKENS = 8
# Where rounds do not wait for the draft (KController.waits_for_draft), how long a verdict
# still waits for a branch call that has not answered: less than the target's regroup wait
# (ServiceConfig.regroup_ms, 5 ms), so the round still rides the others' next pass.
LATE_BRANCH_MS = 2.0


def _lookup_block(history: list[int], room: int, sampling: SamplingParams,
                  min_ngram: int, grammar: GrammarState | None = None) -> Block | None:
    """Prompt lookup: what followed the latest earlier occurrence of the history's last
    ``min_ngram``..5 tokens, as a block (q is one-hot on each proposed token), or None.
    Under a grammar the block ends before the first token the grammar refuses."""
    if room < 1:
        return None
    tokens = lookup(history, min(LOOKUP_MAX_TOKENS, room), LOOKUP_MAX_NGRAM, min_ngram)
    if tokens and grammar is not None:
        grammar.sync(history)
        tokens = tokens[: grammar.legal_prefix(tokens)]
    if not tokens:
        return None
    return Block(tokens, [] if sampling.drafter_invariant else [([t], [1.0]) for t in tokens],
                 source="lookup")


def _record_cancelled(stats: GenerationStats) -> None:
    """A draft call behind a verify that its verdict dropped, for the stats and the timeline."""
    t = time.perf_counter()
    stats.calls.append(CallRecord("draft", t, t, 0.0, 0, "cancelled"))


class Orchestrator:
    """Drives generations over one draft client (optional) and one target client."""

    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer,
                 eos_ids: list[int], max_context: int, decode_on: int = DECODE_ON):
        if not 0 <= decode_on <= MAX_DECODE_ON:
            raise ValueError(f"decode_on must be in [0, {MAX_DECODE_ON}], got {decode_on}")
        self.target = target
        self.decode_on = decode_on  # plain steps per call in rounds without a block
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        # What rounds cost as the calls show it, shared by this orchestrator's generations;
        # None: greedy requests too use the services' start-up calibration.
        self.live_costs: LiveCosts | None = self._calibrated_costs(LiveCosts)
        # Whether the draft shares the target's cores (local services specdec starts on one
        # machine). Then the speculation cache is off (its branches slow the verify pass: the
        # bench measured 9.2 tok/s with it against 21.0 without), and adaptive k drafts only
        # while one generation runs (see _Drafting.crowded).
        self.shared_cores = False
        self.active = 0  # generations in progress
        # The cache's width control, shared by the generations (what a branch call costs
        # against its prediction carries over from one to the next).
        self.branch_widths = BranchWidth(self.live_costs) if self.live_costs else None
        # The draft's acceptance over recent generations (drafter-invariant ones): the prior
        # of the adaptive k of a generation that starts while others run (_controller).
        self.acceptance = Acceptance(decay=POOL_DECAY)
        self.lookups = LookupPool()  # ... and their lookup blocks' accepted tokens
        # Constrained requests: the front compiles their grammars here (a grammar that does
        # not compile is the client's error), and prompt-lookup blocks stop at the first
        # token the grammar refuses. The services run their own matchers.
        info = self.target.info
        self.grammars = Grammars(tokenizer, info.vocab_size if info else None, eos_ids)

    def _calibrated_costs(self, kind: type[Costs] = Costs) -> Costs:
        """Costs from the services' start-up calibration (GetInfo.forward_ms)."""
        target_ms = list(self.target.info.forward_ms) if self.target.info else []
        draft_ms = list(self.draft.info.forward_ms) if self.draft and self.draft.info else []
        return kind.calibrated(target_ms, draft_ms)

    def _record(self, stats: "GenerationStats", rec: CallRecord) -> None:
        stats.calls.append(rec)
        if self.live_costs is not None:
            self.live_costs.observe(rec)

    def service_event(self, role: str, event: str, detail: str = "") -> None:
        """What a supervisor (orchestrator.local.Supervisor) saw of a service: "down" (it
        died) or "up" (restarted and serving). A dead target fails the calls that wait for
        it at once; a dead draft is bypassed; either is used again as soon as it is back."""
        client = self.target if role == "target" else self.draft
        if client is None:
            return
        if event == "down":
            if role == "target":
                self.target.mark_down(detail)
            else:
                self.draft.mark_failed()
        elif event == "up":
            if role == "target":
                self.target.mark_up()
            else:
                self.draft.backoff.retry_at = 0.0  # its next round asks its health at once

    def service_clients(self) -> dict[str, object]:
        """The service clients by name (health checks and metrics ask each of them)."""
        return {"target": self.target, **({"draft": self.draft} if self.draft else {})}

    def _costs(self, req: GenerationRequest) -> Costs:
        if req.sampling.drafter_invariant and self.live_costs is not None:
            return self.live_costs  # k cannot change the text: cost rounds as they are
        return self._calibrated_costs()

    def _controller(self, req: GenerationRequest) -> KController:
        costs = self._costs(req)
        # The acceptance of earlier generations only where k cannot change the text (else a
        # seeded request's text would depend on what ran before it): the prior while other
        # generations run, and alone the larger of it and PRIOR_A (adaptive.PRIOR_A: alone an
        # optimistic start pays; a draft far better than PRIOR_A, the target's own int8 copy
        # at ~0.95, costs half a target step, where 0.5 is its break-even, and started each
        # generation at k = 0 until a probe: measured on separate cores, 3 chat prompts, 18
        # target-only rounds first and k mean 0.68 instead of ~1).
        # Where the draft shares the target's cores, alone too: there an optimistic start is
        # no longer cheap (the first draft call prefills the prompt on the cores the target's
        # steps need, and with the target on its GGUF codes a step is ~9 ms): measured on 2
        # shared cores, the shipped draft's chat prompts ran at 0.95x target-only with it.
        pool = self.acceptance if req.sampling.drafter_invariant else None
        prior = PRIOR_A
        if pool is not None:
            prior = pool.prior() if self.active > 0 or self.shared_cores else \
                max(PRIOR_A, pool.prior())
        return KController(costs.target_ms, [costs.draft_step_ms], fixed_k=req.k,
                           pipelined=req.mode == "pipelined", costs=costs, prior_a=prior,
                           pool=pool, running=lambda: self.active, decode_on=self.decode_on)

    def _branch_widths(self, req: GenerationRequest) -> BranchWidth | None:
        """The speculation cache's width control, for the requests that may branch: greedy
        or coupled without penalties (a branch is then exactly the block the draft would
        draft after its verdict), over a model draft, unless the request turned it off."""
        s = req.sampling
        ngram = self.draft is not None and self.draft.info and self.draft.info.drafter == "ngram"
        if not req.branches or self.shared_cores or not s.drafter_invariant or \
                s.penalized or self.draft is None or ngram:
            return None
        # branching requests are drafter-invariant: they are costed live (_costs)
        return self.branch_widths or BranchWidth(self._costs(req))

    def _lookup_sizer(self, req: GenerationRequest) -> LookupSizer:
        # As the draft's acceptance (_controller): the pool only where lookups cannot change
        # the text, as the prior only while other generations run.
        pool = self.lookups if req.sampling.drafter_invariant else None
        prior = pool.prior() if pool is not None and (self.active > 0 or self.shared_cores) \
            else LOOKUP_PRIOR
        return LookupSizer(self._costs(req), LOOKUP_MAX_TOKENS, prior, pool=pool)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run a generation to the end and return its result."""
        result = None
        async for item in self.stream(req):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Delta | GenerationResult]:
        """Yield text deltas as tokens are committed, then the GenerationResult.

        A round: plan a block (drafted, carried over from the pipelined draft, or looked up),
        let the draft draft past it while the target verifies it (pipelined), count the verdict,
        commit the round's tokens. ``stats.record`` counts every round; the drafting decides
        and learns k.
        """
        if len(req.prompt_ids) + req.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the context of {self.max_context} tokens"
            )
        session_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        stats = GenerationStats(mode=req.mode)
        history = History(req.prompt_ids)
        out = _Output(self.tokenizer, req, self.eos_ids)
        drafting = _Drafting(self, req, session_id, stats)
        pipeline = _Pipeline(drafting, self._branch_widths(req)) \
            if req.mode == "pipelined" and self.draft else None
        if pipeline is not None and pipeline.widths is not None and drafting.k_ctl is not None:
            drafting.k_ctl.branching = True  # k is costed with the cache's hit rate
        prompt_logprobs: list[TokenLogprob] = []
        started = time.perf_counter()
        carried: Block | None = None  # the next block, drafted during the last verify
        done = False
        self.active += 1
        try:
            while not done:
                block = await drafting.plan(history, carried, out.remaining, stats.rounds == 0)
                behind = False
                if pipeline is not None:
                    pipeline.draft_behind(history, block, out.remaining)
                    behind = pipeline.task is not None
                steps = self._decode_steps(block, out.remaining, stats.rounds == 0 or behind)
                rnd = await self._verify(session_id, history, block, req, stats, steps)
                stats.record(rnd)
                drafting.learn(rnd)
                prompt_logprobs = prompt_logprobs or rnd.prompt_logprobs
                taken, delta, done = out.commit(rnd.tokens, rnd.logprobs)
                history.extend(taken)
                if stats.ttft_s == 0.0:
                    stats.ttft_s = time.perf_counter() - started
                if delta is not None:
                    yield delta  # before waiting for the next block: the text goes out now
                if pipeline is not None and not done:
                    carried = await pipeline.next_block(rnd)
        finally:
            self.active -= 1
            drafting.cancel()
            if pipeline is not None:
                pipeline.cancel()
            stats.wall_s = time.perf_counter() - started
            stats.re_prefills = sum(c.re_prefilled for c in stats.calls)
            await asyncio.shield(self._close(session_id))
        yield GenerationResult(req.request_id, out.tokens, out.text.text, out.finish,
                               len(req.prompt_ids), stats, out.logprobs[: len(out.tokens)],
                               prompt_logprobs)

    def _decode_steps(self, block: Block, remaining: int, held: bool) -> int:
        """How many plain steps the target takes on by itself after this round's verdict: in
        a round with no block, unless ``held`` (the first round, whose first token goes out
        alone; a draft drafting behind the verdict, whose block would then be stale)."""
        if block.tokens or held:
            return 0
        return max(0, min(self.decode_on, remaining - 1))

    async def _verify(self, session_id: str, history: History, block: Block,
                      req: GenerationRequest, stats: GenerationStats,
                      decode_on: int = 0) -> Round:
        first = stats.rounds == 0
        resp, rec = await self.target.verify(
            session_id, history, block.tokens,
            [pb.SparseDist(ids=i, probs=p) for i, p in block.dists],
            req.sampling, req.request_id, req.logprobs,
            prompt_logprobs=req.prompt_logprobs and first,
            decode_on=decode_on, stop_ids=self.eos_ids if decode_on else (),
        )
        rec.after_draft = block.source == "draft"  # (not a pipelined hit, lookup or none)
        self._record(stats, rec)
        rnd = Round(block, int(resp.num_accepted), int(resp.next_token), list(resp.decoded))
        if req.logprobs is not None:
            rnd.logprobs = _token_logprobs(rnd.tokens, resp.logprobs)
        if req.prompt_logprobs and first:
            rnd.prompt_logprobs = _token_logprobs(req.prompt_ids[1:], resp.prompt_logprobs)
        return rnd

    async def _draft(self, session_id: str, history: History, extra: list[int], k: int,
                     req: GenerationRequest, stats: GenerationStats, source: str = "draft",
                     ) -> Block | None:
        """A block of k from the draft after history + extra, or None when the draft failed
        (the round goes on without it)."""
        try:
            resp, rec = await self.draft.propose(session_id, history, extra, k, req.sampling,
                                                 req.request_id)
        except asyncio.CancelledError:
            if source == "pipelined":  # a draft behind a verify, dropped by its verdict
                _record_cancelled(stats)
            raise
        except ServiceError as exc:
            self._draft_failed(req, stats, exc)
            return None
        self._record(stats, rec)
        return Block(list(resp.tokens), [(list(d.ids), list(d.probs)) for d in resp.dists],
                     source=source)

    def _draft_failed(self, req: GenerationRequest, stats: GenerationStats,
                      exc: ServiceError) -> None:
        stats.draft_failures += 1
        if not exc.request_fault:  # the service failed, not this request's own call:
            self.draft.mark_failed()  # every generation goes without it for a while
        log.warning("request %s: draft failed (%s); continuing without it", req.request_id, exc)

    async def _close(self, session_id: str) -> None:
        closers = [self.target.close_session(session_id)]
        if self.draft is not None:
            closers.append(self.draft.close_session(session_id))
        await asyncio.gather(*closers, return_exceptions=True)


class _Drafting:
    """The drafting side of one generation: k from the controller, the block of each round
    (prompt lookup, the draft model, or the block drafted behind the last verify), and what
    the verdicts teach the controller and the lookup sizer."""

    def __init__(self, orch: Orchestrator, req: GenerationRequest, session_id: str,
                 stats: GenerationStats):
        self.orch, self.req, self.session_id, self.stats = orch, req, session_id, stats
        speculate = req.mode != "target-only"
        self.k_ctl = orch._controller(req) if speculate and orch.draft is not None else None
        self.lookup = orch._lookup_sizer(req) if speculate and req.prompt_lookup else None
        self.grammar = orch.grammars.state(req.sampling.grammar, len(req.prompt_ids)) \
            if self.lookup is not None and req.sampling.grammar else None
        self.warmup: asyncio.Task | None = None  # the first round's draft prefill

    async def plan(self, history: History, carried: Block | None, remaining: int,
                   first_round: bool) -> Block:
        """This round's block. The first round drafts nothing: the target's prefill produces
        its first token while the draft prefills the prompt (pipelined: and drafts past its
        guess of that token), which gives time to first token = the target's prefill alone,
        and under load keeps the draft's prefills of every new generation off the target's
        path (measured on separate cores, 8 generations starting together: sequential rounds
        reached their first token 0.3-0.45 s after target-only's when the first round
        drafted)."""
        if self.crowded():  # a target-only round: the target batches it with the others'
            return Block([], source="crowded", k=0)
        # Pipelined, a round with nothing carried over (a miss) drafts its block now, after
        # the verdict: k as a sequential round's (KController.best_k).
        now = carried is None and not first_round
        k = max(min(self.next_k(now=now), remaining - 1, MAX_K), 0)
        draft = self.orch.draft
        if carried is None and self.lookup is not None:
            found = _lookup_block(history.tokens, min(self.lookup.size(), remaining - 1),
                                  self.req.sampling,
                                  LOOKUP_MIN_NGRAM if k > 0 else LOOKUP_MIN_NGRAM_ALONE,
                                  self.grammar)
            # Free to draft, but it takes the round from the draft model's block: only when
            # its expected rate beats that block's (a draft that agrees with the target 95%
            # of the time beats most lookups, the shipped draft few).
            if found is not None and (k == 0 or self.k_ctl is None or
                                      self.lookup.rate() > self.k_ctl.rate(k, now=now)):
                found.k = k
                return found
        if k == 0:
            return Block([], source="none", k=0)
        if carried is not None:
            block = carried.cut(k)
            block.k = k
            return block
        available = await draft.available()
        if first_round and available:
            # (pipelined, the draft drafts behind this round)
            if self.req.mode != "pipelined" and not self.orch.shared_cores:
                # The draft prefills the prompt (and guesses the target's first token) while
                # the target does; the next round's draft call goes after it. Not where the
                # draft shares the target's cores: there the two prefills take turns on them,
                # the draft's with its first draft call after the target's first token
                # (measured on 2 shared cores, the int8 draft, a 107-token prompt: both
                # prefills at once took 1.6 s, where the target's alone takes ~0.2 s and
                # the draft's ~0.6 s).
                self.warmup = asyncio.create_task(
                    self.draft_block(History(history.tokens), [], 1, "warmup"))
            return Block([], source="first", k=k)
        block = await self.draft_block(history, [], k) if available else None
        if block is None:
            return Block([], source="none", k=k, draft_failed=True)
        block.k = k
        return block

    def next_k(self, after_full_accept: bool = False, now: bool = False) -> int:
        """The controller's k, or 0 while the generation is ``crowded``."""
        if self.k_ctl is None or self.crowded():
            return 0
        return self.k_ctl.next_k(after_full_accept, now)

    def crowded(self) -> bool:
        """Whether other generations share the cores with this one: then it drafts nothing.

        Where the draft shares the target's cores, concurrent generations keep both services
        busy at once: the draft's passes then take the cores the target's batched verify
        needs, so a drafted token costs verify throughput instead of hiding behind it
        (measured on 2 cores, every core per service, 48 tokens per request: sequential
        rounds 0.64x and pipelined 0.29x target-only's aggregate tok/s at N = 8). Prompt
        lookup is left out too (its blocks lengthen the batched verify). The target batches
        the sessions' single-token rounds instead. Only adaptive k on requests whose text k
        cannot change.
        """
        orch = self.orch
        return orch.shared_cores and orch.active > 1 and self.k_ctl is not None and \
            self.k_ctl.fixed_k is None and self.req.sampling.drafter_invariant

    async def draft_block(self, history: History, extra: list[int], k: int,
                          source: str = "draft") -> Block | None:
        if self.warmup is not None and source != "warmup":  # one call per session at a time
            warmup, self.warmup = self.warmup, None
            await warmup
        return await self.orch._draft(self.session_id, history, extra, k, self.req,
                                      self.stats, source)

    def cancel(self) -> None:
        if self.warmup is not None:
            self.warmup.cancel()

    async def draft_branches(self, history: History, block: list[int], width: int,
                             depth: int) -> tuple[list, CallRecord] | None:
        """The speculation cache's branches behind ``block``, or None when the draft failed."""
        orch, req = self.orch, self.req
        try:
            resp, rec = await orch.draft.propose_branches(self.session_id, history, block, width,
                                                          depth, req.sampling, req.request_id)
        except asyncio.CancelledError:  # late for its verdict (_Pipeline._branch_for)
            _record_cancelled(self.stats)
            raise
        except ServiceError as exc:
            orch._draft_failed(req, self.stats, exc)
            return None
        orch._record(self.stats, rec)
        return list(resp.branches), rec

    def learn(self, rnd: Round) -> None:
        """The verdict teaches whoever drafted the block (the draft model's acceptance is
        learnt from its own blocks only)."""
        if rnd.block.source == "lookup":
            self.lookup.observe(rnd.accepted)
        elif self.k_ctl is not None:
            self.k_ctl.observe(len(rnd.block.tokens), rnd.accepted)


class _Pipeline:
    """Pipelining: while the target verifies a block, the draft drafts the next one.

    With the speculation cache (greedy or coupled requests without penalties, a model draft)
    it drafts a branch for each likely verdict (specdec.serving.branching), as wide as hides
    behind the verify pass; the next round takes the verdict's branch at once if there is one.
    Otherwise it drafts past the block, its guess of the target's token first, kept only when
    the verdict accepts the whole block and the guess was right (else cancelled; the draft
    rolls back to the committed tokens, as its next call's prefix says).
    """

    def __init__(self, drafting: _Drafting, widths: BranchWidth | None):
        self.drafting = drafting
        self.widths = widths  # None: no speculation cache for this request
        self.task: asyncio.Task | None = None
        self.branching = False  # the call in flight is a branch call
        self.shape = (0, 0, 0)  # (k, width, depth) of the branch call in flight
        self.started = 0.0  # when it was sent

    def draft_behind(self, history: History, block: Block, remaining: int) -> None:
        # Behind a round of no block too when the cache is on (a miss whose block did not pay
        # to draft now): its branches are the next token's likeliest candidates.
        if not (block.tokens or block.source == "first" or
                (self.widths is not None and block.source == "none" and
                 not block.draft_failed)):
            return
        room = remaining - len(block.tokens) - 1
        if room <= 0:
            return
        # The draft also drafts its guess of the target's token: depth + 1 <= MAX_K.
        depth = min(self.drafting.next_k(after_full_accept=True), MAX_K - 1, room - 1)
        if depth <= 0:
            return
        k = len(block.tokens)
        k_ctl = self.drafting.k_ctl
        self.branching = self.widths is not None and k + 1 <= MAX_BRANCHES and \
            not k_ctl.drafts_guess(k)
        if not self.branching:  # plain pipelining: the guess and the block past it
            self.drafting.stats.guess_calls += 1
            self.task = asyncio.create_task(
                self.drafting.draft_block(history, block.tokens, depth + 1, "pipelined"))
            return
        waits = k_ctl.waits_for_draft()
        width = self.widths.choose(k, depth, 1.0 if waits else LATE_SHARE)
        k_ctl.width = width
        self.shape = (k, width, depth)
        self.started = time.perf_counter()
        self.task = asyncio.create_task(
            self.drafting.draft_branches(history, block.tokens, width, depth))

    async def next_block(self, rnd: Round) -> Block | None:
        """The block drafted behind ``rnd`` for its verdict, else None."""
        if self.task is None:
            return None
        task, self.task = self.task, None
        if self.branching:
            return await self._branch_for(rnd, task)
        stats = self.drafting.stats
        if rnd.full_accept:
            ahead = await task
        else:
            task.cancel()
            ahead = None
        held = ahead is not None and bool(ahead.tokens) and ahead.tokens[0] == rnd.next_token
        if ahead is not None or not rnd.full_accept:  # (None after a full accept: it failed)
            self.drafting.k_ctl.observe_guess(len(rnd.block.tokens), held)
        if not held:
            stats.pipeline_misses += 1
            return None
        stats.pipeline_hits += 1
        return Block(ahead.tokens[1:], ahead.dists[1:], source="pipelined") \
            if len(ahead.tokens) > 1 else None

    async def _branch_for(self, rnd: Round, task: asyncio.Task) -> Block | None:
        stats = self.drafting.stats
        k_ctl = self.drafting.k_ctl
        if not task.done() and not k_ctl.waits_for_draft():
            await asyncio.wait({task}, timeout=LATE_BRANCH_MS / 1000.0)
            if not task.done():  # late: this round goes without a block, the call is dropped
                task.cancel()
                self.widths.observe(*self.shape, (time.perf_counter() - self.started) * 1000.0)
                k_ctl.observe_cache(False)
                k_ctl.probe_late()
                stats.pipeline_misses += 1
                stats.late_branch_calls += 1
                return None
        called = await task  # (branches, call record), or None: the draft failed
        branches = called[0] if called is not None else []
        if called is not None:
            rec = called[1]
            self.widths.observe(*self.shape, (rec.end - rec.start) * 1000.0)
        stats.branches_drafted += len(branches)
        hit = next((b for b in branches
                    if b.accepted == rnd.accepted and b.token == rnd.next_token), None)
        if called is not None:
            k_ctl.observe_cache(hit is not None)
            # the single guess would have held it: the whole block kept and the first (the
            # draft's likeliest) candidate after it the target's token
            k = len(rnd.block.tokens)
            guess = next((b for b in branches if b.accepted == k), None)
            k_ctl.observe_guess(k, guess is not None and rnd.accepted == k and
                                guess.token == rnd.next_token)
        if hit is None or not hit.tokens:
            stats.pipeline_misses += 1
            return None
        stats.pipeline_hits += 1
        stats.cache_hits += 1
        return Block(list(hit.tokens), source="pipelined")

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class _Output:
    """The committed tokens of a generation, its text, and what has been streamed of them."""

    def __init__(self, tokenizer, req: GenerationRequest, eos_ids: set[int]):
        self.req = req
        self.eos_ids = eos_ids
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # in step with tokens (when asked for)
        self.streamed = 0  # tokens already handed out in a Delta
        self.text = TextStream(tokenizer, req.stop)
        self.finish = "length"

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.tokens)

    def commit(self, new: list[int], logprobs: list[TokenLogprob],
               ) -> tuple[list[int], Delta | None, bool]:
        """Take a round's tokens up to EOS, the length limit or a stop string: returns the
        tokens that extend the history, the delta to stream (or None), and whether the
        generation is done."""
        done = False
        taken = 0
        for tok in new:
            self.tokens.append(tok)
            taken += 1
            if tok in self.eos_ids:
                self.finish, done = "stop", True
                break
            if len(self.tokens) >= self.req.max_new_tokens:
                done = True
                break
        self.logprobs += logprobs
        text = self.text.update(self.tokens, final=done)
        if self.text.stopped:
            self.finish, done = "stop", True
            self.tokens = self.tokens[: self.text.stop_token_count]
        delta = None
        if text or (done and self.streamed < len(self.tokens)):
            # the ids not yet streamed, none past EOS or the stop string
            delta = Delta(text, self.tokens[self.streamed:],
                          self.logprobs[self.streamed:len(self.tokens)])
            self.streamed = len(self.tokens)
        return new[:taken], delta, done
