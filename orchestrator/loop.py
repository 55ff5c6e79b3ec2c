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
    Source,
    TokenLogprob,
)
from orchestrator.pipeline import Pipeline
from orchestrator.planning import LOOKUP_MAX_TOKENS, Planner, record_cancelled
from orchestrator.service_clients import (
    CallRecord,
    DraftClient,
    FeatureLog,
    History,
    ServiceError,
    TargetClient,
)
from orchestrator.text import TextStream
from specdec.config import MAX_DECODE_ON
from specdec.serving.grammar import Grammars
from specdec.wire import specdec_pb2 as pb

log = logging.getLogger(__name__)


def _token_logprobs(tokens: list[int], entries) -> list[TokenLogprob]:
    """TokenLogprobs of a VerifyResponse (wire) as TokenLogprob, one per token."""
    return [TokenLogprob(t, e.logprob, list(zip(e.top_ids, e.top_logprobs)))
            for t, e in zip(tokens, entries)]


class Orchestrator:
    """Drives generations over one draft client (optional) and one target client."""

    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer,
                 eos_ids: list[int], max_context: int, shared_cores: bool = False,
                 decode_on: int = DECODE_ON):
        """``shared_cores``: the draft shares the target's cores (local services specdec
        starts on one machine). ``decode_on``: plain steps the target takes on by itself in a
        round with no block (VerifyRequest.decode_on; 0: a round trip per such token)."""
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
        # Where the draft shares the target's cores the speculation cache is off (its branches
        # slow the verify pass: the bench measured 9.2 tok/s with it against 21.0 without),
        # and adaptive k charges the draft's compute to the target's batched passes while
        # other generations run (KController.crowd).
        self.shared_cores = shared_cores
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
        # A feature-conditioned draft reads the target's features: every verify asks for
        # them (from the prompt's last position on) and the draft's calls pass them on.
        self.features = bool(draft is not None and draft.info and draft.info.features)
        self.feature_layers = list(draft.info.feature_layers) if self.features else []

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
        pipelined = req.mode == "pipelined"
        return KController(costs.target_ms, [costs.draft_step_ms], fixed_k=req.k,
                           pipelined=pipelined, costs=costs, prior_a=prior,
                           pool=pool, running=lambda: self.active,
                           branching=pipelined and self._may_branch(req),
                           drafter_invariant=req.sampling.drafter_invariant,
                           decode_on=self.decode_on, shared_cores=self.shared_cores)

    def _may_branch(self, req: GenerationRequest) -> bool:
        """Whether the request may use the speculation cache: greedy or coupled without
        penalties (a branch is then exactly the block the draft would draft after its
        verdict), over a model draft, unless the request turned it off."""
        s = req.sampling
        if not req.branches or self.shared_cores or not s.drafter_invariant or s.penalized or \
                self.draft is None:
            return False
        return not (self.draft.info and self.draft.info.drafter == "ngram")

    def _branch_widths(self, req: GenerationRequest) -> BranchWidth | None:
        """The speculation cache's width control, for the requests that may branch."""
        if not self._may_branch(req):
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
        let the draft draft past it while the target verifies it (pipelined), learn from the
        verdict, commit the round's tokens, take the block drafted behind it, and record the
        finished round (``GenerationStats.record``).
        """
        if len(req.prompt_ids) + req.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the context of {self.max_context} tokens"
            )
        session_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        stats = GenerationStats(mode=req.mode)
        history = History(req.prompt_ids, FeatureLog() if self.features else None)
        out = _Output(self.tokenizer, req, self.eos_ids)
        planner = Planner(self, req, session_id, stats)
        pipeline = Pipeline(planner) if planner.pipelined else None
        prompt_logprobs: list[TokenLogprob] = []
        started = time.perf_counter()
        carried: Block | None = None  # the next block, drafted during the last verify
        done = False
        self.active += 1
        try:
            while not done:
                first = stats.rounds == 0
                plan = await planner.plan(history, carried, out.remaining, first)
                block = plan.block
                behind = pipeline.draft_behind(history, plan) if pipeline else None
                steps = self._decode_steps(block, out.remaining, first or behind is not None)
                rnd = await self._verify(session_id, history, block, req, stats, first, steps)
                rnd.behind = behind
                planner.learn(rnd)
                prompt_logprobs = prompt_logprobs or rnd.prompt_logprobs
                taken, delta, done = out.commit(rnd.tokens, rnd.logprobs)
                history.extend(taken)
                if history.features is not None:
                    self._keep_features(session_id, history, rnd)
                rnd.committed_s = time.perf_counter() - started
                if delta is not None:
                    yield delta  # before waiting for the next block: the text goes out now
                if pipeline is not None and not done:
                    carried = await pipeline.next_block(rnd)
                stats.record(rnd)
        finally:
            self.active -= 1
            planner.cancel()
            if pipeline is not None:
                pipeline.cancel()
            stats.finish(time.perf_counter() - started)
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
                      req: GenerationRequest, stats: GenerationStats, first: bool,
                      decode_on: int = 0) -> Round:
        resp, rec = await self.target.verify(
            session_id, history, block.tokens,
            [pb.SparseDist(ids=i, probs=p) for i, p in block.dists],
            req.sampling, req.request_id, req.logprobs,
            prompt_logprobs=req.prompt_logprobs and first,
            decode_on=decode_on, stop_ids=self.eos_ids if decode_on else (),
            features_from=max(len(req.prompt_ids) - 1, 0) if history.features is not None
            else None, feature_layers=self.feature_layers,
        )
        rec.after_draft = block.source is Source.DRAFT  # (not a pipelined hit, lookup or none)
        self._record(stats, rec)
        rnd = Round(block, int(resp.num_accepted), int(resp.next_token), list(resp.decoded))
        rnd.features = resp.features if resp.HasField("features") else None
        if req.logprobs is not None:
            rnd.logprobs = _token_logprobs(rnd.tokens, resp.logprobs)
        if req.prompt_logprobs and first:
            rnd.prompt_logprobs = _token_logprobs(req.prompt_ids[1:], resp.prompt_logprobs)
        return rnd

    def _keep_features(self, session_id: str, history: History, rnd: Round) -> None:
        """Keep the verdict's features with the session's history (those of positions it
        holds: a feature predicts the next token). Where a verdict's features went missing
        the target is sent the whole history next round, which gives them all again."""
        if rnd.features is not None and not history.features.put(rnd.features):
            log.info("session %s: the target's features have a gap; re-sending its history",
                     session_id)
            self.target.forget(session_id)
        history.features.truncate(len(history) - 1)

    async def _draft(self, session_id: str, history: History, extra: list[int], k: int,
                     req: GenerationRequest, stats: GenerationStats,
                     source: Source = Source.DRAFT) -> Block | None:
        """A block of k from the draft after history + extra, or None when the draft failed
        (the round goes on without it)."""
        try:
            resp, rec = await self.draft.propose(session_id, history, extra, k, req.sampling,
                                                 req.request_id)
        except asyncio.CancelledError:
            if source is Source.PIPELINED:  # a draft behind a verify, dropped by its verdict
                record_cancelled(stats)
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
