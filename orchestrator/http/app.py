"""The OpenAI-compatible HTTP front over an injected Orchestrator.

``create_app(backend, model_name)`` serves ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream: true`` as Server-Sent Events), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. The backend is anything with the Orchestrator's
``stream``, ``tokenizer``, ``max_context``, ``target`` and ``draft``: the app never builds
one, so the CLI, a Ray Serve replica and the tests each inject their own.

Each response carries the generation's speculative statistics in an extra ``specdec`` field,
which OpenAI clients ignore. Bad requests get HTTP 400 with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import re
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.http.metrics import CONTENT_TYPE, Metrics
from orchestrator.loop import MODES, GenerationRequest
from orchestrator.service_clients import ServiceError
from specdec.config import DEFAULT_RULE, MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_N = 16  # choices per request (each is a generation of its own, run concurrently)


@dataclasses.dataclass
class ServeDefaults:
    """Generation settings for what a request leaves out (``specdec serve``'s flags)."""

    max_tokens: int = 128
    temperature: float = 0.0  # greedy unless the request asks otherwise
    top_p: float = 1.0
    top_k: int = 0
    rule: str = DEFAULT_RULE  # acceptance rule of sampled requests (SamplingParams.rule)
    mode: str = "pipelined"
    k: int | None = None  # None = adaptive
    stop: list[str] = dataclasses.field(default_factory=list)
    prompt_lookup: bool = True  # see GenerationRequest.prompt_lookup
    # Larger bodies get 413 before they are read whole or parsed: 2 MiB holds a 128k-token
    # prompt of ordinary text, and parsing or tokenizing megabytes would hold the server up.
    max_body_bytes: int = 2 * 1024 * 1024

    def __post_init__(self) -> None:
        # Refuse bad defaults once, at start, rather than on every request.
        sampling = SamplingParams(self.temperature, self.top_k, self.top_p, rule=self.rule)
        GenerationRequest([0], self.max_tokens, sampling, self.stop, self.mode, self.k)
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


# ---- request bodies (strict: "5" is not an integer, as in OpenAI's API) --------------------

class _Body(BaseModel):
    # OpenAI clients send fields we do not use (user, metadata...): ignore them.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


def _invalid_text(value: Any) -> str | None:
    """The path of the first string in parsed JSON that is not valid Unicode, or None.

    JSON's escapes can spell lone surrogates ("\\ud800"): Python parses them into strings that
    no tokenizer and no UTF-8 response can take. Iterative: bodies may nest deeply.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((f"{path}.{key}" if path else str(key), child))
                stack.append((path or "body", key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


class _GenerationBody(_Body):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _invalid_text(data)
        if path:
            raise PydanticCustomError(
                "invalid_unicode", "{path}: not valid Unicode text (a lone surrogate escape "
                "such as \\ud800 encodes no character)",
                {"path": path, "param": path.split(".")[0].split("[")[0]})
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; as in vLLM (-1 or 0 = no limit)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # not OpenAI's; as in vLLM (1 = none)
    logit_bias: dict[str, Any] | None = None
    # specdec's own extras: how to speculate for this request
    specdec_mode: str | None = None
    specdec_k: int | None = None
    specdec_rule: str | None = None  # coupled | rejection (see SamplingParams.rule)


class CompletionBody(_GenerationBody):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


# ---- errors -------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a pydantic validation error, phrased for the client."""
    errors = exc.errors()
    if not errors:
        return _invalid("invalid request body")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "invalid_unicode":
        return _invalid(err["msg"], err["ctx"]["param"])
    if err.get("type") == "json_invalid":
        return _invalid(f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:
        return _invalid(f"request body: {err['msg']} (expected a JSON object)")
    # Union members appear in loc by type name ("stop", "str"): keep field names and indexes.
    path = [str(loc[0])] + [f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                            if isinstance(p, int) or not _is_type_tag(p)]
    name = "".join(path)
    return _invalid(f"{name}: {err['msg']}", param=str(loc[0]))


def _is_type_tag(part: str) -> bool:
    """A union member's name in a pydantic error location (not a field name)."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or \
        part.startswith("function-")


def _service_error(exc: ServiceError) -> APIError:
    status = 503 if exc.retriable else 500
    return APIError(status, f"generation failed: {exc}", code=exc.code.name.lower(),
                    type="server_error")


# ---- the app ------------------------------------------------------------------------------

def request_seed(seed: int | None) -> int:
    """A request's seed: its own, or a fresh one so that repeated sampled requests differ (as
    with OpenAI). Every front (the OpenAI routes, the Ray app's /generate) uses this."""
    return secrets.randbits(63) if seed is None else seed


def api_key_matches(authorization: bytes | str | None, api_key: str) -> bool:
    """Whether an Authorization header value is ``Bearer <api_key>``: the scheme matched
    case-insensitively (RFC 9110 section 11.1), the key in constant time."""
    if isinstance(authorization, str):
        authorization = authorization.encode("utf-8", "replace")
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return hmac.compare_digest(scheme.lower() + b" " + token.strip(),
                               b"bearer " + api_key.encode())


class _BodyLimit:
    """413 for a request body over ``limit`` bytes, by its Content-Length or, for a chunked
    body, as soon as it grows past it (plain ASGI middleware: the body is read once)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        too_large = length is not None and length.isdigit() and int(length) > self.limit
        body, more = [], not too_large
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            size += len(message.get("body", b""))
            body.append(message)
            more = message.get("more_body", False)
            if size > self.limit:
                too_large = True
                break
        if too_large:
            err = APIError(413, f"the request body exceeds {self.limit} bytes",
                           code="request_too_large")
            return await JSONResponse(err.body(), status_code=413)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)


def _replay(messages: list, receive=None):
    """An ASGI receive that hands out ``messages``, then defers to ``receive``."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        if receive is None:
            return {"type": "http.disconnect"}
        return await receive()

    return replayed


class _BearerAuth:
    """Every path but /health needs ``Authorization: Bearer KEY`` (plain ASGI middleware, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not api_key_matches(given, self.api_key):
                err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                    "KEY'", code="invalid_api_key")
                resp = JSONResponse(err.body(), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """An SSE response that always closes its generator.

    When the client disconnects during a send, Starlette cancels the send and leaves the
    generator suspended at its ``yield``; closing it here runs its cleanup (cancelling the
    generation, which closes its sessions on both services) now rather than at garbage
    collection.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                      separators=(",", ":"))
    return f"data: {data}\n\n"


def _is_result(item) -> bool:
    return hasattr(item, "finish_reason")


def _usage(results) -> dict:
    """OpenAI's usage of one response: the prompt once, every choice's tokens."""
    prompt = results[0].prompt_tokens
    n = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def specdec_stats(result) -> dict:
    """The ``specdec`` field: what speculation did for this response."""
    s = result.summary()
    out = {k: s[k] for k in ("mode", "rounds", "draft_tokens", "accepted_tokens",
                             "acceptance_rate", "mean_tokens_per_round", "k_mean", "ttft_s",
                             "wall_s", "tokens_per_s", "overlap_efficiency", "pipeline_hits",
                             "pipeline_misses", "re_prefills", "accepted_per_position")}
    out["num_drafts"] = sum(c for k, c in result.stats.rounds_per_k.items() if k > 0)
    return out


class _Front:
    """The request handling behind the routes (one per app)."""

    def __init__(self, backend, model_name: str, defaults: ServeDefaults, metrics: Metrics):
        self.backend = backend
        self.model_name = model_name
        self.defaults = defaults
        self.metrics = metrics
        self.created = int(time.time())

    # -- turning a body into a GenerationRequest --

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise _invalid(f"model {model!r} is not served here; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")

    def completion_prompt(self, body: CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise _invalid("one prompt per request (n = 1): send a string", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise _invalid("prompt must not be empty", "prompt")
        if isinstance(prompt, str):
            return [int(t) for t in self.backend.tokenizer(prompt)["input_ids"]]
        vocab = len(self.backend.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _invalid(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
        return list(prompt)

    def prompt_text(self, body: CompletionBody, prompt_ids: list[int]) -> str:
        """The prompt as echoed: the text sent, or the token ids' text."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else self.backend.tokenizer.decode(prompt_ids)

    def chat_prompt(self, body: ChatBody) -> list[int]:
        if not body.messages:
            raise _invalid("messages must not be empty", "messages")
        tokenizer = self.backend.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise _invalid("this model has no chat template: use /v1/completions", "messages")
        messages = []
        for i, m in enumerate(body.messages):
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise _invalid(f"messages[{i}].content: only text parts are supported",
                                   "messages")
                text = "".join(p.text for p in m.content)
            else:
                text = m.content or ""
            # Chat templates know "system"; OpenAI's newer name for it is "developer".
            messages.append({"role": "system" if m.role == "developer" else m.role,
                             "content": text})
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # the template rejects this conversation (e.g. role order)
            raise _invalid(f"messages: the chat template rejected them: {exc}", "messages")
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def unsupported(self, body) -> None:
        """Refuse options that would change the output and that specdec does not implement."""
        checks = [
            ("n", not 1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}"),
            ("logit_bias", bool(body.logit_bias), "not supported"),
        ]
        if isinstance(body, CompletionBody):
            checks += [("logprobs", body.logprobs is not None and
                        not 0 <= body.logprobs <= MAX_TOP_LOGPROBS,
                        f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}"),
                       ("echo", body.echo and body.stream, "echo is not supported with "
                        "stream"),
                       ("best_of", body.best_of not in (None, 1), "best_of must be 1"),
                       ("suffix", bool(body.suffix), "not supported")]
        else:
            checks += [("tools", bool(body.tools), "tools are not supported"),
                       ("top_logprobs", body.top_logprobs is not None and
                        not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS,
                        f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                        f"got {body.top_logprobs}"),
                       ("top_logprobs", bool(body.top_logprobs) and not body.logprobs,
                        "top_logprobs needs logprobs: true"),
                       ("response_format", bool(body.response_format) and
                        body.response_format.get("type") != "text",
                        "only the text response format is supported")]
        for param, bad, why in checks:
            if bad:
                raise _invalid(f"{param}: {why}", param)

    def generation_requests(self, body, prompt_ids: list[int], request_id: str,
                            max_tokens: int | None) -> list[GenerationRequest]:
        """One request per choice: choice i has seed + i (a fresh seed each without one)."""
        first = self.generation_request(body, prompt_ids, request_id, max_tokens)
        if isinstance(body, CompletionBody) and body.echo and body.logprobs is not None:
            first = dataclasses.replace(first, prompt_logprobs=True)
        if body.n == 1:
            return [first]
        reqs = []
        for i in range(body.n):
            seed = first.sampling.seed + i if body.seed is not None else request_seed(None)
            reqs.append(dataclasses.replace(first, request_id=f"{request_id}-{i}",
                                            sampling=first.sampling.replace(seed=seed % 2**64)))
        return reqs

    def generation_request(self, body, prompt_ids: list[int], request_id: str,
                           max_tokens: int | None) -> GenerationRequest:
        d = self.defaults
        room = self.backend.max_context - len(prompt_ids)
        if max_tokens is None:
            if room < 1:
                raise _invalid(f"the prompt ({len(prompt_ids)} tokens) fills the model's "
                               f"context of {self.backend.max_context} tokens", "messages"
                               if isinstance(body, ChatBody) else "prompt")
            max_tokens = min(d.max_tokens, room)
        elif max_tokens < 1:
            raise _invalid(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        elif max_tokens > room:
            raise _invalid(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the model's context of {self.backend.max_context} tokens",
                           "max_tokens", "context_length_exceeded")
        temperature = d.temperature if body.temperature is None else body.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise _invalid(f"temperature must be a finite number >= 0, got {temperature}",
                           "temperature")
        top_p = d.top_p if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise _invalid(f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = d.top_k if body.top_k is None else body.top_k
        if top_k == -1:  # vLLM's spelling of "no limit"
            top_k = 0
        seed = request_seed(body.seed)
        try:
            sampling = SamplingParams(
                temperature, top_k, top_p, seed, body.specdec_rule or d.rule,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None
                else body.repetition_penalty,
                prompt_len=len(prompt_ids))
        except ValueError as exc:  # its messages start with the field's name
            field = next((p for p in ("temperature", "top_k", "top_p", "seed", "rule",
                                      "presence_penalty", "frequency_penalty",
                                      "repetition_penalty")
                          if str(exc).startswith(p)), None)
            raise _invalid(str(exc), "specdec_rule" if field == "rule" else field)
        stop = d.stop if body.stop is None else [body.stop] if isinstance(body.stop, str) \
            else body.stop
        mode = body.specdec_mode or d.mode
        if mode not in MODES:
            raise _invalid(f"specdec_mode must be one of {', '.join(MODES)}, got {mode!r}",
                           "specdec_mode")
        k = d.k if body.specdec_k is None else body.specdec_k
        if isinstance(body, ChatBody):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        try:
            return GenerationRequest(prompt_ids, max_tokens, sampling, list(stop), mode, k,
                                     request_id, prompt_lookup=d.prompt_lookup,
                                     logprobs=logprobs)
        except ValueError as exc:
            raise _invalid(str(exc), "specdec_k" if "k must" in str(exc) else None)

    # -- running a generation --

    async def run(self, req: GenerationRequest, endpoint: str) -> AsyncIterator:
        """backend.stream plus what every request needs: the running gauge, the metrics and
        one log line. A generation cancelled from outside counts as an abort."""
        self.metrics.running(1)
        started = time.perf_counter()
        sent = 0
        result = None
        outcome = "error"
        agen = self.backend.stream(req)
        try:
            async for item in agen:
                if _is_result(item):
                    result = item
                else:
                    sent += len(item.token_ids)
                yield item
            outcome = result.finish_reason if result is not None else "error"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "abort"
            raise
        finally:
            self.metrics.running(-1)
            if result is not None:
                self.metrics.observe_result(result)
            elif outcome == "abort":
                self.metrics.aborted(len(req.prompt_ids), sent)
            else:
                self.metrics.failure("error")
            self.log_request(req, endpoint, outcome, result, sent, time.perf_counter() - started)
            # Only this closes the generation when we are closed at a yield (the client left
            # while a chunk was being sent): its finally closes both services' sessions.
            await agen.aclose()

    def log_request(self, req, endpoint, outcome, result, sent, wall_s) -> None:
        fields = dict(id=req.request_id, endpoint=endpoint, outcome=outcome,
                      prompt_tokens=len(req.prompt_ids), max_tokens=req.max_new_tokens,
                      mode=req.mode, temperature=req.sampling.temperature)
        if result is not None:
            s = specdec_stats(result)
            fields.update(completion_tokens=len(result.token_ids), rounds=s["rounds"],
                          draft_tokens=s["draft_tokens"], accepted_tokens=s["accepted_tokens"],
                          acceptance=s["acceptance_rate"],
                          tokens_per_round=s["mean_tokens_per_round"], k_mean=s["k_mean"],
                          ttft_s=s["ttft_s"], wall_s=s["wall_s"], tokens_per_s=s["tokens_per_s"])
        else:
            fields.update(completion_tokens=sent, wall_s=round(wall_s, 4))
        log.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items()))

    async def generate(self, request: Request, reqs: list[GenerationRequest], endpoint: str):
        """The whole results, one per request, or None when the client disconnected first
        (then the generations are cancelled, which frees their sessions)."""

        async def collect(req):
            result = None
            async with contextlib.aclosing(self.run(req, endpoint)) as items:
                async for item in items:
                    if _is_result(item):
                        result = item
            return result

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(collect(req)) for req in reqs]
        everything = asyncio.gather(*tasks)
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({everything, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we are cancelled (shutdown): so are the generations
            everything.cancel()
            raise
        finally:
            watch.cancel()
        if not everything.done() or everything.exception() is not None:
            # disconnected, or one choice failed: the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not everything.done() or everything.cancelled():
                return None
        try:
            return everything.result()
        except ServiceError as exc:
            raise _service_error(exc) from None
        except ValueError as exc:
            raise _invalid(str(exc)) from None

    async def _items(self, reqs: list[GenerationRequest], endpoint: str):
        """(choice index, delta or result) of every generation as they come; for n > 1 the
        generations run concurrently, and closing this closes them all."""
        if len(reqs) == 1:
            async with contextlib.aclosing(self.run(reqs[0], endpoint)) as items:
                async for item in items:
                    yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            error = None
            try:
                async with contextlib.aclosing(self.run(req, endpoint)) as items:
                    async for item in items:
                        queue.put_nowait((i, item, None))
            except Exception as exc:
                error = exc
            finally:  # the end of choice i, even when cancelled
                queue.put_nowait((i, None, error))

        tasks = [asyncio.ensure_future(pump(i, req)) for i, req in enumerate(reqs)]
        try:
            running = len(tasks)
            while running:
                i, item, exc = await queue.get()
                if exc is not None:
                    raise exc
                if item is None:
                    running -= 1
                    continue
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- log-probabilities in OpenAI's shapes --

    def _token_text(self, token_id: int) -> str:
        return self.backend.tokenizer.decode([token_id])

    def chat_logprobs(self, logprobs) -> dict:
        """choices[].logprobs of a chat completion (or of one streamed delta)."""
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in logprobs], "refusal": None}

    def completion_logprobs(self, logprobs, offset: int = 0, first_token: int | None = None,
                            ) -> dict:
        """choices[].logprobs of a text completion; text_offset counts from ``offset``. With
        ``first_token`` (echo: the prompt's first token, which nothing scores) that token
        comes first, with logprob None."""
        tokens = [self._token_text(t.token_id) for t in logprobs]
        token_logprobs: list = [t.logprob for t in logprobs]
        top: list = [{self._token_text(i): lp for i, lp in t.top} for t in logprobs]
        if first_token is not None:
            tokens.insert(0, self._token_text(first_token))
            token_logprobs.insert(0, None)
            top.insert(0, None)
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    async def events(self, reqs: list[GenerationRequest], endpoint: str, chat: bool, head: dict,
                     include_usage: bool) -> AsyncIterator[str]:
        """The SSE body of a streamed response (choices interleaved as they come, by index)."""
        extra = {"usage": None} if include_usage else {}
        want_logprobs = reqs[0].logprobs is not None
        offsets = [0] * len(reqs)  # completions: characters streamed per choice

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False,
                  logprobs=None) -> dict:
            lp = None
            if want_logprobs and logprobs is not None:
                lp = self.chat_logprobs(logprobs) if chat else \
                    self.completion_logprobs(logprobs, offsets[i])
            if chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if text is None else {"content": text})
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": lp,
                          "finish_reason": finish}
            return {**head, "choices": [choice], **extra}

        try:
            if chat:
                for i in range(len(reqs)):
                    yield _sse(chunk(i, None, role=True))
            results = [None] * len(reqs)
            # aclosing: when we are closed at a yield, the generations must be closed too
            async with contextlib.aclosing(self._items(reqs, endpoint)) as items:
                async for i, item in items:
                    if _is_result(item):
                        results[i] = item
                        last = chunk(i, None, item.finish_reason)
                        last["specdec"] = specdec_stats(item)
                        yield _sse(last)
                    elif item.text or (want_logprobs and item.logprobs):
                        yield _sse(chunk(i, item.text, logprobs=item.logprobs))
                        offsets[i] += len(item.text)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(results)})
        except ServiceError as exc:
            yield _sse(_service_error(exc).body())
        except ValueError as exc:
            yield _sse(_invalid(str(exc)).body())
        except Exception as exc:  # headers are sent: the error can only travel as an event
            log.exception("request %s failed", reqs[0].request_id)
            yield _sse(APIError(500, f"internal error: {exc}", type="server_error").body())
        yield _sse("[DONE]")

    async def respond(self, request: Request, body, prompt_ids: list[int], chat: bool,
                      max_tokens: int | None):
        self.unsupported(body)
        rid = request.headers.get("x-request-id", "")
        rid = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex[:16]
        reqs = self.generation_requests(body, prompt_ids, rid, max_tokens)
        endpoint = request.url.path
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        headers = {"X-Request-Id": rid}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(self.events(reqs, endpoint, chat, head, include_usage),
                                headers={**headers, "Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no"})
        results = await self.generate(request, reqs, endpoint)
        if results is None:  # nobody is listening any more
            return Response(status_code=499)
        want_logprobs = reqs[0].logprobs is not None
        choices = []
        for i, result in enumerate(results):
            if chat:
                lp = self.chat_logprobs(result.logprobs) if want_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant",
                                                        "content": result.text},
                                "logprobs": lp, "finish_reason": result.finish_reason})
            elif body.echo:  # the prompt, then the completion; logprobs over both
                lp = self.completion_logprobs(result.prompt_logprobs + result.logprobs,
                                              first_token=prompt_ids[0]) if want_logprobs \
                    else None
                choices.append({"index": i, "text": self.prompt_text(body, prompt_ids)
                                + result.text, "logprobs": lp,
                                "finish_reason": result.finish_reason})
            else:
                lp = self.completion_logprobs(result.logprobs) if want_logprobs else None
                choices.append({"index": i, "text": result.text, "logprobs": lp,
                                "finish_reason": result.finish_reason})
        if chat:
            head["object"] = "chat.completion"
        # one choice: its stats; several: a list, one per choice
        stats = [specdec_stats(r) for r in results]
        return JSONResponse({**head, "choices": choices, "usage": _usage(results),
                             "specdec": stats[0] if len(stats) == 1 else stats},
                            headers=headers)


def create_app(backend, model_name: str, api_key: str | None = None, *,
               defaults: ServeDefaults | None = None,
               metrics: Metrics | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``backend`` (an Orchestrator or the like), serving it
    under ``model_name``; with ``api_key`` every path but /health needs that bearer token."""
    front = _Front(backend, model_name, defaults or ServeDefaults(),
                   metrics or Metrics(model_name))
    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding")
    app.state.front = front
    app.state.metrics = front.metrics
    app.add_middleware(_BodyLimit, limit=front.defaults.max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for an unauthorized request
        app.add_middleware(_BearerAuth, api_key=api_key)

    def error_response(request: Request, err: APIError) -> JSONResponse:
        if err.status == 400 and request.url.path.startswith("/v1/"):
            front.metrics.failure("invalid")
            log.info("request endpoint=%s outcome=invalid status=400 message=%r",
                     request.url.path, err.message)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # OpenAI answers 400 for a bad body, not FastAPI's 422.
        return error_response(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not even decode the body
            cause = exc.__cause__
            why = ("it is not UTF-8" if isinstance(cause, UnicodeDecodeError) else
                   "it is nested too deeply" if isinstance(cause, RecursionError) else
                   str(exc.detail))
            return error_response(request, _invalid(f"malformed JSON body: {why}"))
        err = APIError(exc.status_code, str(exc.detail),
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        front.check_model(body.model)
        # Tokenizing (and rendering a chat template) runs off the event loop: a long prompt
        # must not hold up other requests or /health.
        prompt_ids = await asyncio.to_thread(front.completion_prompt, body)
        return await front.respond(request, body, prompt_ids, False, body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        front.check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        prompt_ids = await asyncio.to_thread(front.chat_prompt, body)
        return await front.respond(request, body, prompt_ids, True, max_tokens)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": front.created,
            "owned_by": "specdec", "max_model_len": backend.max_context}]}

    @app.get("/health")
    async def health():
        """200 while every target answers (without a draft the rounds go on, slower)."""
        targets = {name: c for name, c in backend.service_clients().items()
                   if name == "target" or name.endswith("/target")}

        async def error(client) -> str | None:
            try:
                await asyncio.wait_for(client.stats(), 5.0)
            except Exception as exc:
                return str(exc) or type(exc).__name__
            return None

        errors = dict(zip(targets, await asyncio.gather(*map(error, targets.values()))))
        failed = {name: e for name, e in errors.items() if e is not None}
        if failed:
            return JSONResponse({"status": "unavailable", "error": "; ".join(
                f"{name}: {e}" for name, e in failed.items())}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        await front.metrics.refresh_services(backend.service_clients())
        return Response(front.metrics.exposition(), media_type=CONTENT_TYPE)

    return app
