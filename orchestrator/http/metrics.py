"""Prometheus metrics of the HTTP front, defined once, in the spirit of vLLM's spec-decode metrics.

Terms (as in vLLM): a *draft* is one round's block of proposed tokens (rounds with k = 0, e.g.
target-only, draft nothing); *draft tokens* are the proposed tokens the target verified;
*accepted tokens* are those it kept. Each round also adds one token of the target's own, so

    acceptance rate          = accepted_tokens / draft_tokens
    mean acceptance length   = 1 + accepted_tokens / num_drafts   (tokens per drafted round)

Every metric lives in the app's own CollectorRegistry, so several apps in one process (tests, a
Ray replica) never collide in prometheus_client's global registry.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)

PREFIX = "specdec:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                       0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    """The front's counters, histograms and gauges, labelled by the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, [*m, *labels], registry=r)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        def gauge(name, doc, labels=()):
            return Gauge(PREFIX + name, doc, [*m, *labels], registry=r)

        self.num_drafts = counter(
            "spec_decode_num_drafts", "Rounds that verified a non-empty draft block.")
        self.num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified by the target.")
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the block (0 = first).", ["position"])
        self.pipeline_hits = counter(
            "pipeline_hits", "Pipelined rounds whose block was drafted during the previous "
            "verify (a speculation-cache hit, or plain pipelining's right guess).")
        self.pipeline_misses = counter(
            "pipeline_misses", "Pipelined verdicts the draft had drafted no block for.")
        self.cache_branches = counter(
            "speculation_cache_branches", "Branches the speculation cache drafted (a hit "
            "uses one; the others are wasted draft work).")
        self.guess_calls = counter(
            "pipeline_guess_calls", "Draft calls behind a verify that drafted the single guess "
            "of the target's token and the block past it (plain pipelining, or the cost model's "
            "choice over the speculation cache's rows).")
        self.late_branch_calls = counter(
            "speculation_cache_late_calls", "Branch calls dropped unanswered at their verdict "
            "(under load a round does not wait for the draft; each is also a pipeline miss).")
        self.crowded_rounds = counter(
            "crowded_rounds", "Rounds of no block chosen while other generations shared the "
            "cores with the draft (services on one machine; the target batches them).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens emitted to clients (completion tokens).")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason: stop, length, or abort "
            "(the client went away and the generation was cancelled).", ["finished_reason"])
        self.request_failure = counter(
            "request_failure", "Requests that failed: invalid (HTTP 4xx) or error (a service "
            "failed).", ["reason"])
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from the start of a generation to its first "
            "committed token (includes prefill).", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, "
            "one observation per request.", _TOKEN_TIME_BUCKETS)
        self.round_time = histogram(
            "round_time_seconds", "Time between consecutive verdicts of the target (one "
            "speculation round, pipelined rounds overlap their drafting).", _TOKEN_TIME_BUCKETS)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Wall time of a generation.", _LATENCY_BUCKETS)
        self.num_requests_running = gauge(
            "num_requests_running", "Generations in progress in this front.")
        self.service_up = gauge(
            "service_up", "1 when the service answered GetStats at the last scrape.", ["service"])
        self.service_sessions = gauge(
            "service_sessions", "Live sessions (KV caches) on the service.", ["service"])
        self.service_cache_bytes = gauge(
            "service_cache_bytes", "KV cache bytes allocated on the service.", ["service"])
        self.service_cache_cap_bytes = gauge(
            "service_cache_cap_bytes", "KV cache memory cap of the service.", ["service"])

    def _l(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def running(self, delta: int) -> None:
        self._l(self.num_requests_running).inc(delta)

    def observe_result(self, result) -> None:
        """Count a finished generation (a GenerationResult)."""
        s = result.stats
        self._l(self.num_drafts).inc(s.num_drafts)
        self._l(self.num_draft_tokens).inc(s.draft_tokens)
        self._l(self.num_accepted_tokens).inc(s.accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            self._l(self.num_accepted_tokens_per_pos, position=str(pos)).inc(n)
        self._l(self.pipeline_hits).inc(s.pipeline_hits)
        self._l(self.pipeline_misses).inc(s.pipeline_misses)
        self._l(self.cache_branches).inc(s.branches_drafted)
        self._l(self.late_branch_calls).inc(s.late_branch_calls)
        self._l(self.guess_calls).inc(s.guess_calls)
        self._l(self.crowded_rounds).inc(s.crowded_rounds)
        n_out = len(result.token_ids)
        self._l(self.prompt_tokens).inc(result.prompt_tokens)
        self._l(self.generation_tokens).inc(n_out)
        self._l(self.request_success, finished_reason=result.finish_reason).inc()
        if s.ttft_s > 0:
            self._l(self.time_to_first_token).observe(s.ttft_s)
        if n_out > 1 and s.wall_s > s.ttft_s:
            self._l(self.time_per_output_token).observe((s.wall_s - s.ttft_s) / (n_out - 1))
        self._l(self.e2e_latency).observe(s.wall_s)
        ends = sorted(c.end for c in s.calls if c.service == "target" and c.outcome == "ok")
        for a, b in zip(ends, ends[1:]):
            self._l(self.round_time).observe(b - a)

    def aborted(self, prompt_tokens: int, sent_tokens: int) -> None:
        """Count a generation cancelled because its client went away (it has no result: only
        what was sent is known)."""
        self._l(self.prompt_tokens).inc(prompt_tokens)
        self._l(self.generation_tokens).inc(sent_tokens)
        self._l(self.request_success, finished_reason="abort").inc()

    def failure(self, reason: str) -> None:
        self._l(self.request_failure, reason=reason).inc()

    async def refresh_services(self, services: dict) -> None:
        """Ask each service (name -> client with ``async stats()``) for its cache gauges."""

        async def one(name, client):
            try:
                st = await asyncio.wait_for(client.stats(), 5.0)
            except Exception as exc:  # a scrape must not fail because one service is down
                log.debug("GetStats on %s failed: %s", name, exc)
                self._l(self.service_up, service=name).set(0)
                return
            self._l(self.service_up, service=name).set(1)
            self._l(self.service_sessions, service=name).set(st.sessions)
            self._l(self.service_cache_bytes, service=name).set(st.cache_bytes)
            self._l(self.service_cache_cap_bytes, service=name).set(st.cache_cap_bytes)

        await asyncio.gather(*(one(n, c) for n, c in services.items() if c is not None))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
