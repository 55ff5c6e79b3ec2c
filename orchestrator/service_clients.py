"""The orchestrator's view of the two services: channels, calls, and session tracking.

The orchestrator owns each generation's token history. For each service it remembers which
tokens that service's cache holds for the session (``known``), sends only what is new, and
when a service answers NOT_FOUND / FAILED_PRECONDITION (cache lost or out of step) it forgets
what it knew and re-sends the whole history: a lost cache costs time, never text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable

import grpc

from specdec.config import SamplingParams
from specdec.rpc import transport
from specdec.serving.session import extend_hashes
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SESSION_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
# Worth retrying against a target that may come back: unreachable or restarting (UNAVAILABLE),
# too slow (DEADLINE_EXCEEDED), or a transport that broke mid-stream (INTERNAL, CANCELLED when
# the server shut down). Retrying is safe: every call states the prefix it builds on.
RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


class ServiceError(Exception):
    """A service call failed; ``code`` is the gRPC status code."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{service} service: {code.name}: {details}")
        self.service = service
        self.code = code
        self.details = details

    @property
    def session_lost(self) -> bool:
        return self.code in SESSION_LOST

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE

    @property
    def request_fault(self) -> bool:
        """The call itself was wrong (its arguments): the service is fine for other calls."""
        return self.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


def _tls_failure(details: str) -> bool:
    """Whether a connection failed in the TLS handshake (a wrong CA, certificate or name)."""
    lowered = details.lower()
    return any(sign in lowered for sign in ("handshake", "certificate", "verification check"))


class History:
    """A session's committed tokens (prompt first) with the rolling hash of every prefix."""

    def __init__(self, tokens: list[int], features: FeatureLog | None = None):
        self.tokens: list[int] = []
        self.hashes: list[int] = [0]
        self.extend(tokens)
        self.features = features  # the target's features (when the draft reads them)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.tokens.extend(tokens)
        extend_hashes(self.hashes, tokens)


class FeatureLog:
    """The target's features of a session's positions, as its verdicts gave them
    (VerifyResponse.features, float16 rows kept as bytes), to pass on to a feature draft."""

    def __init__(self):
        self.start: int | None = None
        self.dim = 0
        self.data = bytearray()

    @property
    def end(self) -> int:
        """Features are held for positions start .. end - 1."""
        return 0 if self.start is None else self.start + len(self.data) // (2 * self.dim)

    def put(self, msg: pb.Features) -> bool:
        """Keep a verdict's features (they continue or overlap the ones held); False when
        they leave a gap (a verdict's features were lost: the target must send them again)."""
        if not msg.data:
            return True
        if self.start is None:
            self.start, self.dim = int(msg.start), int(msg.dim)
        elif not self.start <= msg.start <= self.end or msg.dim != self.dim:
            return False
        del self.data[(msg.start - self.start) * 2 * self.dim:]
        self.data += msg.data
        return True

    def truncate(self, end: int) -> None:
        """Keep the features of positions below ``end``."""
        if self.start is not None:
            del self.data[max(0, end - self.start) * 2 * self.dim:]

    def message(self, first: int, end: int) -> pb.Features | None:
        """The features of positions first .. end - 1 that are held, None if none."""
        if self.start is None:
            return None
        first, end = max(first, self.start), min(end, self.end)
        if first >= end:
            return None
        row = 2 * self.dim
        return pb.Features(start=first, dim=self.dim, data=bytes(
            self.data[(first - self.start) * row:(end - self.start) * row]))


@dataclasses.dataclass
class CallRecord:
    """One RPC as the orchestrator saw it (for stats and the timeline plot)."""

    service: str  # "draft" | "target"
    start: float  # time.perf_counter() at send
    end: float
    compute_ms: float  # service-side model time
    tokens: int  # draft tokens proposed / verified
    outcome: str = "ok"  # ok | cancelled | error
    re_prefilled: bool = False  # the service had lost the session; the history was re-sent
    batch_size: int = 1  # sessions that shared the service's forward pass
    sent_tokens: int = 0  # committed tokens the call appended to the service's cache
    branches: int = 0  # a speculation-cache call: the branches it drafted
    pass_tokens: int = 0  # a verify: new tokens of every session in its forward pass
    queued_ms: float = 0.0  # a verify: its wait in the target before its first pass
    after_draft: bool = False  # a verify sent after a draft call (set by the round loop)
    passes: int = 1  # a verify: forward passes it took (1 + the tokens it decoded on)

    @property
    def wall_ms(self) -> float:
        """The call's time as the orchestrator saw it, from send to answer (what the live
        cost model reads)."""
        return (self.end - self.start) * 1000.0


class Backoff:
    """Exponential backoff between attempts to reach a service that failed."""

    def __init__(self, initial_s: float = 0.5, maximum_s: float = 30.0):
        self.initial_s = initial_s
        self.maximum_s = maximum_s
        self.delay_s = initial_s
        self.retry_at = 0.0
        self.failures = 0

    def failed(self) -> None:
        self.failures += 1
        self.retry_at = time.monotonic() + self.delay_s
        self.delay_s = min(self.delay_s * 2, self.maximum_s)

    def succeeded(self) -> None:
        self.failures = 0
        self.delay_s = self.initial_s
        self.retry_at = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.retry_at


class ServiceClient:
    """A channel to one service with its stub, info, and per-session cache knowledge."""

    role = ""

    def __init__(self, address: str, tls: dict | None = None,
                 max_message_bytes: int = transport.DEFAULT_MAX_MESSAGE_BYTES,
                 timeout_s: float = 30.0):
        self.address = address
        self.channel = transport.aio_channel(address, max_message_bytes, tls)
        self.timeout_s = timeout_s
        self.info: pb.ModelInfo | None = None
        # session id -> the tokens this service's cache holds for it (as far as we know)
        self.known: dict[str, list[int]] = {}
        # session id -> its open stream, while no call is in flight on it (_stream_call)
        self._streams: dict[str, grpc.aio.StreamStreamCall] = {}

    async def wait_ready(self, timeout_s: float = 300.0) -> pb.ModelInfo:
        """Wait until the service answers GetInfo (it is UNAVAILABLE while loading).

        A failed TLS handshake does not heal by waiting: it fails at once. A service that
        refuses the channel silently (mutual TLS without a client certificate, plaintext to a
        TLS port) looks like one still starting, so the wait says what it saw every 30 s.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        next_note = started + 30.0
        while True:
            try:
                self.info = await self.stub.GetInfo(pb.InfoRequest(), timeout=10)
                return self.info
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if (exc.code() not in RETRIABLE or time.monotonic() > deadline
                        or _tls_failure(details)):
                    raise ServiceError(self.role, exc.code(),
                                       f"{self.address}: {details}") from None
                if time.monotonic() > next_note:
                    log.warning("still waiting for the %s service at %s (%.0fs): %s", self.role,
                                self.address, time.monotonic() - started, details)
                    next_note += 30.0
            await asyncio.sleep(0.2)

    def ref(self, session_id: str, history: History, resend_from: int | None = None,
            ) -> tuple[pb.SessionRef, list[int]]:
        """The SessionRef for the next call and the tokens it must append (at least the last
        one, and everything from ``resend_from`` on when given)."""
        known = self.known.get(session_id, [])
        common = 0
        limit = min(len(known), len(history) - 1)  # always re-send at least the last token
        if resend_from is not None:
            limit = min(limit, resend_from)
        while common < limit and known[common] == history.tokens[common]:
            common += 1
        ref = pb.SessionRef(session_id=session_id, prefix_len=common,
                            prefix_hash=history.hashes[common])
        return ref, history.tokens[common:]

    def forget(self, session_id: str) -> None:
        self.known.pop(session_id, None)

    async def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the standard health service answers SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        """A new stream of this service's calls (VerifyStream / ProposeStream)."""
        raise NotImplementedError

    async def _stream_call(self, session_id: str, req, timeout_s: float):
        """One call over the session's stream, opened on first use.

        The stream is taken out while its call is in flight: a second call for the session
        meanwhile (a new draft call while a cancelled one winds down) opens a stream of its
        own, and a call that fails or is cancelled takes its stream down with it.
        """
        call = self._streams.pop(session_id, None) or self._open_stream()
        try:
            await call.write(req)
            # (not asyncio.wait_for: before Python 3.12 it returns the answer and swallows a
            # cancellation that arrives as the answer does, so a generation whose client left
            # ran on to its end)
            async with asyncio.timeout(timeout_s):
                resp = await call.read()
        except grpc.aio.AioRpcError:
            raise
        except asyncio.InvalidStateError:  # the stream ended (e.g. the service went away)
            raise grpc.aio.AioRpcError(await call.code(), None, None,
                                       details=await call.details()) from None
        except BaseException:
            call.cancel()
            raise
        if resp is grpc.aio.EOF:
            code = await call.code()
            raise grpc.aio.AioRpcError(code, None, None, details=await call.details())
        if session_id in self._streams:  # one is enough
            call.cancel()
        else:
            self._streams[session_id] = call
        return resp

    async def close_session(self, session_id: str) -> None:
        self.known.pop(session_id, None)
        call = self._streams.pop(session_id, None)
        if call is not None:
            try:
                await call.done_writing()
            except Exception:
                pass
            call.cancel()
        try:
            await self.stub.CloseSession(pb.CloseRequest(session_id=session_id), timeout=5)
        except grpc.aio.AioRpcError as exc:  # best effort: the TTL reclaims it otherwise
            log.debug("close %s on %s failed: %s", session_id, self.role, exc.code())

    async def stats(self) -> pb.ServiceStats:
        return await self.stub.GetStats(pb.StatsRequest(), timeout=10)

    async def close(self) -> None:
        await self.channel.close()

    def _error(self, exc: grpc.aio.AioRpcError) -> ServiceError:
        return ServiceError(self.role, exc.code(), exc.details() or "")


class DraftClient(ServiceClient):
    role = "draft"

    def __init__(self, *args, draft_timeout_s: float = 5.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.stub = pb_grpc.DraftServiceStub(self.channel)
        self._tickets: dict[str, int] = {}  # latest call per session: only it updates `known`
        # session id -> the end of the target's features the draft holds (a feature draft)
        self.features_sent: dict[str, int] = {}
        # A draft is an accelerator, never a dependency: past this deadline a round goes on
        # without it, and a failed draft is left alone until a health check says it is back.
        self.draft_timeout_s = draft_timeout_s
        self.down = False
        self.backoff = Backoff()
        self._probe_lock = asyncio.Lock()

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        return self.stub.ProposeStream()

    def mark_failed(self) -> None:
        if not self.down:
            log.warning("draft service %s marked down; generating target-only meanwhile",
                        self.address)
        self.down = True
        self.backoff.failed()

    async def close_session(self, session_id: str) -> None:
        self._tickets.pop(session_id, None)
        self.features_sent.pop(session_id, None)
        await super().close_session(session_id)

    async def available(self) -> bool:
        """Whether to use the draft now: up, or down but answering its health check again."""
        if not self.down:
            return True
        if not self.backoff.ready():
            return False
        async with self._probe_lock:
            if not self.down:
                return True
            if await self.healthy():
                log.warning("draft service %s is back; speculation resumes", self.address)
                self.down = False
                self.backoff.succeeded()
                self.known.clear()  # it may have restarted: re-prefill every session
                return True
            self.backoff.failed()
            return False

    def _add_features(self, session_id: str, seq: History, req: pb.DraftRequest) -> int:
        """Put in ``req`` the target's features the draft does not hold (all of them on a
        (re)start); the end of those it will hold, 0 when none go."""
        if seq.features is None:
            return 0
        prefix = req.session.prefix_len
        first = min(self.features_sent.get(session_id, 0), prefix) if prefix else 0
        msg = seq.features.message(first, len(seq) - 1)  # a feature predicts the next token
        if msg is None:
            return 0
        req.features.CopyFrom(msg)
        return msg.start + len(msg.data) // (2 * msg.dim)

    def forget(self, session_id: str) -> None:
        super().forget(session_id)
        self.features_sent.pop(session_id, None)

    async def propose(self, session_id: str, history: History, extra: list[int], k: int,
                      sampling: SamplingParams, request_id: str = "") -> tuple[pb.DraftResponse, CallRecord]:
        """Propose k tokens after history + extra (extra: uncommitted tokens, pipelining).

        Unary so that a speculative call can be cancelled; re-prefills once on a lost session.
        """
        seq = History(history.tokens + extra, history.features) if extra else history

        def request(ref, tokens):
            return pb.DraftRequest(session=ref, tokens=tokens, k=k,
                                   sampling=sampling.to_wire(pb), request_id=request_id)

        resp, rec = await self._propose(session_id, seq, request,
                                        lambda r: seq.tokens + list(r.tokens[:-1]))
        rec.tokens = len(resp.tokens)
        return resp, rec

    async def propose_branches(self, session_id: str, history: History, block: list[int],
                               width: int, depth: int, sampling: SamplingParams,
                               request_id: str = "") -> tuple[pb.DraftResponse, CallRecord]:
        """The speculation cache: while the target verifies ``block`` after ``history``, a
        block of ``depth`` for each of the likeliest verdicts (``width`` candidates for the
        target's token per acceptance length)."""
        seq = History(history.tokens + block, history.features)
        spec = pb.BranchSpec(block_len=len(block), width=width, depth=depth)

        def request(ref, tokens):
            return pb.DraftRequest(session=ref, tokens=tokens, k=depth, branches=spec,
                                   sampling=sampling.to_wire(pb), request_id=request_id)

        # the history's last token is fed again: its logits give the verdict at j = 0
        resp, rec = await self._propose(session_id, seq, request, lambda r: list(seq.tokens),
                                        resend_from=len(history) - 1)
        rec.tokens = sum(len(b.tokens) for b in resp.branches)
        rec.branches = len(resp.branches)
        return resp, rec

    async def _propose(self, session_id: str, seq: History, request, known_after,
                       resend_from: int | None = None) -> tuple[pb.DraftResponse, CallRecord]:
        """One Propose call with what both kinds share: the session's prefix, one re-prefill
        on a lost session, and what the service has seen afterwards (``known_after(resp)``;
        after a cancelled call only the prefix is known, unless a later call said more)."""
        ticket = self._tickets[session_id] = self._tickets.get(session_id, 0) + 1
        for attempt in (0, 1):
            ref, tokens = self.ref(session_id, seq, resend_from)
            req = request(ref, tokens)
            sent = self._add_features(session_id, seq, req)
            start = time.perf_counter()
            try:
                resp = await self._stream_call(session_id, req, self.draft_timeout_s)
            except asyncio.TimeoutError:
                self.forget(session_id)
                raise ServiceError("draft", grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no proposal within {self.draft_timeout_s}s") from None
            except grpc.aio.AioRpcError as exc:
                err = self._error(exc)
                self.forget(session_id)
                if err.session_lost and attempt == 0:
                    log.info("draft lost session %s (%s); re-prefilling", session_id, err.details)
                    continue
                raise err from None
            except asyncio.CancelledError:
                # The draft may have truncated to the prefix and appended part of the block.
                if self._tickets.get(session_id) == ticket:
                    self.known[session_id] = seq.tokens[: ref.prefix_len]
                    self.features_sent[session_id] = min(
                        self.features_sent.get(session_id, 0), ref.prefix_len)
                raise
            end = time.perf_counter()
            if self._tickets.get(session_id) == ticket:
                self.known[session_id] = known_after(resp)
                if sent:
                    self.features_sent[session_id] = sent
            return resp, CallRecord("draft", start, end, resp.compute_ms, 0,
                                    re_prefilled=attempt > 0, sent_tokens=len(tokens))
        raise AssertionError("unreachable")


class TargetClient(ServiceClient):
    """Verify calls go over one bidirectional stream per session (the round loop's channel).

    A target that stops answering is *down* until its health check says it serves again:
    meanwhile calls fail at once with UNAVAILABLE (or, with ``unavailable_deadline_s``, wait
    that long for it to come back), instead of each waiting out a timeout of its own."""

    role = "target"
    RECHECK_S = 0.25  # while down, a call asks the health check at most this often

    def __init__(self, *args, unavailable_deadline_s: float = 0.0,
                 prefill_s_per_token: float = 0.2, **kwargs):
        super().__init__(*args, **kwargs)
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.unavailable_deadline_s = unavailable_deadline_s
        # A call's deadline grows with the tokens it sends (a long prompt's prefill): the
        # call's own timeout_s plus this much per token (0.2 s: 5 tokens/s. Alone this CPU
        # prefills ~110-300 tokens/s; beside a stream of small requests, whose decoding keeps
        # its share of every pass, a 4,000-token prompt went at ~24 tokens/s).
        self.prefill_s_per_token = prefill_s_per_token
        self.down: str | None = None  # why the target is down, while it is
        self._checked_at = 0.0
        self._check_lock = asyncio.Lock()

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        return self.stub.VerifyStream()

    def mark_down(self, why: str) -> None:
        if self.down is None:
            log.warning("target service %s is down: %s", self.address, why)
        self.down = why
        self._checked_at = time.monotonic()

    def mark_up(self) -> None:
        if self.down is not None:
            log.warning("target service %s is back", self.address)
        self.down = None
        self.known.clear()  # it restarted: every session is re-sent in full

    async def serving(self) -> bool:
        """Whether the target serves: True while it is not known to be down; while it is,
        its health check, asked at most every RECHECK_S (concurrent callers share one)."""
        if self.down is None:
            return True
        async with self._check_lock:
            if self.down is not None and time.monotonic() - self._checked_at >= self.RECHECK_S:
                self._checked_at = time.monotonic()
                if await self.healthy(timeout_s=1.0):
                    self.mark_up()
        return self.down is None

    def call_timeout_s(self, sent_tokens: int) -> float:
        return self.timeout_s + self.prefill_s_per_token * sent_tokens

    async def verify(self, session_id: str, history: History, draft_tokens: list[int],
                     draft_dists, sampling: SamplingParams, request_id: str = "",
                     logprobs: int | None = None, prompt_logprobs: bool = False,
                     decode_on: int = 0, stop_ids: Iterable[int] = (),
                     features_from: int | None = None, feature_layers: Iterable[int] = (),
                     ) -> tuple[pb.VerifyResponse, CallRecord]:
        """Verify a block. A lost session is re-prefilled; a call that fails while the target
        still serves (a dropped connection) is sent again; a target that is down (dead,
        restarting, loading) fails the call with UNAVAILABLE at once, or after waiting up to
        ``unavailable_deadline_s`` for it to come back. ``features_from``: ask for the
        target's features of the positions the call adds from there on (a feature draft),
        with the residual after ``feature_layers`` (the draft's ModelInfo.feature_layers)."""
        deadline = time.monotonic() + self.unavailable_deadline_s
        backoff = 0.05
        lost_retries = transient_retries = 0
        re_prefilled = False
        while True:
            if not await self.serving():
                if time.monotonic() >= deadline:
                    raise ServiceError("target", grpc.StatusCode.UNAVAILABLE,
                                       f"the target service is unavailable: {self.down}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                re_prefilled = True  # what the target held is unknown now: re-send it all
                continue
            ref, tokens = self.ref(session_id, history)
            req = pb.VerifyRequest(session=ref, tokens=tokens, draft_tokens=draft_tokens,
                                   draft_dists=draft_dists, sampling=sampling.to_wire(pb),
                                   request_id=request_id, logprobs=logprobs is not None,
                                   top_logprobs=logprobs or 0, prompt_logprobs=prompt_logprobs,
                                   decode_on=decode_on, stop_ids=list(stop_ids),
                                   return_features=features_from is not None,
                                   features_from=features_from or 0,
                                   feature_layers=list(feature_layers))
            start = time.perf_counter()
            timeout_s = self.call_timeout_s(len(tokens) + decode_on)
            try:
                resp = await self._stream_call(session_id, req, timeout_s)
            except grpc.aio.AioRpcError as exc:
                err = self._error(exc)
                self.forget(session_id)
                if err.session_lost and lost_retries < 2:
                    lost_retries += 1
                    re_prefilled = True
                    log.info("target lost session %s (%s); re-prefilling", session_id, err.details)
                    continue
                if err.retriable:
                    re_prefilled = True  # what the target held is unknown now: re-send it all
                    if not await self.healthy(timeout_s=1.0):
                        self.mark_down(err.details or err.code.name)
                        continue  # (the loop's top waits for it, or fails the call)
                    if transient_retries < 2:  # the call failed, the target serves: again
                        transient_retries += 1
                        log.warning("verify failed (%s); the target serves, retrying",
                                    err.details)
                        continue
                raise err from None
            except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                self.forget(session_id)
                if isinstance(exc, asyncio.TimeoutError):
                    raise ServiceError("target", grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no verdict within {timeout_s:.1f}s") from None
                raise
            end = time.perf_counter()
            # the target holds the accepted tokens and, when it decoded on, every emitted
            # token but the last
            emitted = [resp.next_token, *resp.decoded]
            self.known[session_id] = (history.tokens + list(draft_tokens[: resp.num_accepted])
                                      + emitted[:-1])
            return resp, CallRecord("target", start, end, resp.compute_ms, len(draft_tokens),
                                    re_prefilled=re_prefilled, batch_size=resp.batch_size,
                                    sent_tokens=len(tokens), pass_tokens=resp.pass_tokens,
                                    queued_ms=resp.queued_ms, passes=max(resp.passes, 1))
