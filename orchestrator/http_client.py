"""specdec's own small client for its OpenAI-compatible API (sync and async, httpx).

    from orchestrator.http_client import SpecdecClient

    with SpecdecClient("http://127.0.0.1:8000") as client:
        print(client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text)
        for chunk in client.stream_chat([{"role": "user", "content": "Hi!"}]):
            print(chunk.text, end="")

Requests that fail before any answer (connection refused, connect timeout) or with HTTP 429,
502, 503 or 504 are retried with exponential backoff (honouring ``Retry-After``); a stream is
retried only until its first byte. Other failures raise a ``SpecdecError`` subclass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any, AsyncIterator, Iterator, TypedDict

import httpx

try:
    from typing import Unpack
except ImportError:  # Python 3.10
    from typing_extensions import Unpack

RETRY_STATUS = (429, 502, 503, 504)


class SpecdecError(Exception):
    """Base of the client's errors."""


class SpecdecConnectionError(SpecdecError):
    """The server could not be reached (or the connection broke) after all retries."""


class SpecdecTimeout(SpecdecConnectionError):
    """The server did not answer in time."""


class APIError(SpecdecError):
    """The server answered with an error: ``status_code`` and OpenAI's error fields."""

    def __init__(self, status_code: int | None, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        where = f"HTTP {status_code}" if status_code else "stream error"
        super().__init__(f"{where}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class BadRequestError(APIError):
    """HTTP 400: the request is invalid (``param`` names the field)."""


class AuthenticationError(APIError):
    """HTTP 401: missing or wrong API key."""


class RateLimitError(APIError):
    """HTTP 429, after all retries."""


class ServerError(APIError):
    """HTTP 5xx (after all retries for 502/503/504), or an error event inside a stream."""


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclasses.dataclass
class SpecStats:
    """What speculation did for one response (the ``specdec`` field)."""

    mode: str
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_tokens_per_round: float
    k_mean: float
    num_drafts: int = 0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    raw: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, d: dict | None) -> "SpecStats | None":
        if not d:
            return None
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        return cls(**{k: v for k, v in d.items() if k in names}, raw=d)


@dataclasses.dataclass
class Completion:
    """A whole response (completion or chat)."""

    id: str
    model: str
    text: str
    finish_reason: str
    usage: Usage
    specdec: SpecStats | None
    raw: dict = dataclasses.field(repr=False, default_factory=dict)


@dataclasses.dataclass
class Chunk:
    """One streamed piece: new text, and at the end the finish reason, stats and usage."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    specdec: SpecStats | None = None


class Options(TypedDict, total=False):
    """Generation options of every request method (all optional; the server has defaults)."""

    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    seed: int
    stop: str | list[str]
    mode: str  # specdec_mode: pipelined | spec | target-only
    k: int  # specdec_k: draft tokens per round (default adaptive)
    rule: str  # specdec_rule: acceptance rule when sampling: coupled | rejection
    extra: dict  # more body fields, sent as they are


def _messages(messages) -> list[dict]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return list(messages)


def _body(model: str, stream: bool, max_tokens, temperature, top_p, seed, stop, mode, k,
          rule, extra) -> dict:
    body: dict[str, Any] = {"model": model, "stream": stream}
    for key, value in (("max_tokens", max_tokens), ("temperature", temperature),
                       ("top_p", top_p), ("seed", seed), ("stop", stop),
                       ("specdec_mode", mode), ("specdec_k", k), ("specdec_rule", rule)):
        if value is not None:
            body[key] = value
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def _error(status: int | None, payload: Any) -> APIError:
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(payload)[:500]}
    cls = {400: BadRequestError, 401: AuthenticationError, 429: RateLimitError}.get(
        status, ServerError if status is None or status >= 500 else APIError)
    return cls(status, err.get("message", ""), err.get("type"), err.get("param"),
               err.get("code"))


def _response_error(resp: httpx.Response, body: bytes) -> APIError:
    try:
        payload = json.loads(body)
    except ValueError:
        payload = body.decode(errors="replace")
    return _error(resp.status_code, payload)


def _parse_completion(d: dict, chat: bool) -> Completion:
    choice = d["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Completion(d["id"], d["model"], text or "", choice["finish_reason"],
                      Usage(**d["usage"]), SpecStats.parse(d.get("specdec")), d)


def _parse_event(line: str, chat: bool) -> Chunk | None:
    """A Chunk from one SSE line, None for other lines; raises on an error event."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    d = json.loads(data)
    if "error" in d:
        raise _error(None, d)
    usage = Usage(**d["usage"]) if d.get("usage") else None
    if not d.get("choices"):
        return Chunk("", usage=usage, specdec=SpecStats.parse(d.get("specdec")))
    choice = d["choices"][0]
    text = (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
    return Chunk(text, choice.get("finish_reason"), usage, SpecStats.parse(d.get("specdec")))


class _Base:
    """What both clients share: the server's root (``.../v1`` also accepted), the key, the
    model name, timeouts and the retry policy; ``http_client`` replaces the httpx client."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str = "specdec", timeout: float | httpx.Timeout = 120.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 http_client=None):
        base_url = base_url.rstrip("/")
        # Accept the OpenAI-style base URL too (".../v1").
        self.base_url = base_url[:-3] if base_url.endswith("/v1") else base_url
        self.model = model
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or self._new_http()

    def _new_http(self):
        raise NotImplementedError

    def stream_complete(self, prompt: str | list[int], **options: Unpack[Options]):
        """Chunks as the text is generated (an iterator; an async iterator from the async
        client); the last carries finish_reason, stats and usage. Stop iterating (and close
        the iterator) to cancel the generation."""
        body = _body(self.model, True, *_kw(options))
        body["prompt"] = prompt
        return self._events("/v1/completions", body, chat=False)

    def stream_chat(self, messages: str | list[dict], **options: Unpack[Options]):
        """As stream_complete, for a chat."""
        body = _body(self.model, True, *_kw(options))
        body["messages"] = _messages(messages)
        return self._events("/v1/chat/completions", body, chat=True)

    def _delay(self, attempt: int, resp: httpx.Response | None) -> float:
        """Backoff before retry ``attempt`` (0-based): Retry-After if given, else exponential
        with jitter, at most max_backoff_s."""
        if resp is not None:
            try:
                return min(float(resp.headers["retry-after"]), self.max_backoff_s)
            except (KeyError, ValueError):
                pass
        base = min(self.backoff_s * 2 ** attempt, self.max_backoff_s)
        return base * (0.5 + random.random() / 2)

    @staticmethod
    def _connect_failure(exc: Exception) -> SpecdecConnectionError:
        cls = SpecdecTimeout if isinstance(exc, httpx.TimeoutException) else \
            SpecdecConnectionError
        return cls(f"{type(exc).__name__}: {exc}")


# Failures where the server did not start on the request: safe to send it again.
_RETRY_EXC = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def should_retry(attempt: int, max_retries: int, failure: int | Exception) -> bool:
    """The clients' one retry decision (sync and async alike): try ``attempt`` (0-based)
    failed with an HTTP status or a transport exception; send it again while retries remain
    if the server never started on it (connection refused, connect or pool timeout) or asked
    for a retry (429, 502, 503, 504)."""
    if attempt >= max_retries:
        return False
    if isinstance(failure, int):
        return failure in RETRY_STATUS
    return isinstance(failure, _RETRY_EXC)


class SpecdecClient(_Base):
    """Synchronous client. ``base_url`` is the server's root (``.../v1`` also accepted)."""

    def _new_http(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SpecdecClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, method: str, path: str, body: dict | None = None,
              stream: bool = False) -> httpx.Response:
        """Send with retries; the response is open (stream=True) or read, and successful."""
        for attempt in range(self.max_retries + 1):
            req = self._http.build_request(method, self.base_url + path, json=body,
                                           headers=self.headers, timeout=self.timeout)
            try:
                resp = self._http.send(req, stream=True)
            except httpx.TransportError as exc:
                if not should_retry(attempt, self.max_retries, exc):
                    raise self._connect_failure(exc) from exc
                time.sleep(self._delay(attempt, None))
                continue
            if resp.status_code < 400:
                if not stream:
                    resp.read()
                return resp
            content = resp.read()
            resp.close()
            if not should_retry(attempt, self.max_retries, resp.status_code):
                raise _response_error(resp, content)
            time.sleep(self._delay(attempt, resp))
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        return self._send(method, path, body).json()

    def _events(self, path: str, body: dict, chat: bool) -> Iterator[Chunk]:
        resp = self._send("POST", path, body, stream=True)
        try:
            for line in resp.iter_lines():
                chunk = _parse_event(line, chat)
                if chunk is not None:
                    yield chunk
        except httpx.TransportError as exc:
            raise self._connect_failure(exc) from exc
        finally:
            resp.close()  # early exit: closing the connection cancels the generation

    def complete(self, prompt: str | list[int], **options: Unpack[Options]) -> Completion:
        """A text completion of ``prompt`` (a string or token ids)."""
        body = _body(self.model, False, *_kw(options))
        body["prompt"] = prompt
        return _parse_completion(self._json("POST", "/v1/completions", body), chat=False)

    def chat(self, messages: str | list[dict], **options: Unpack[Options]) -> Completion:
        """A chat answer; ``messages`` is OpenAI's list (or one user message as a string)."""
        body = _body(self.model, False, *_kw(options))
        body["messages"] = _messages(messages)
        return _parse_completion(self._json("POST", "/v1/chat/completions", body), chat=True)

    def models(self) -> list[str]:
        return [m["id"] for m in self._json("GET", "/v1/models")["data"]]

    def health(self) -> bool:
        """True when the server and its target service answer."""
        try:
            self._send("GET", "/health")
        except SpecdecError:
            return False
        return True

    def metrics(self) -> str:
        return self._send("GET", "/metrics").text


class AsyncSpecdecClient(_Base):
    """The asyncio twin of SpecdecClient (same methods, awaitable / async iterators)."""

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncSpecdecClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, body: dict | None = None,
                    stream: bool = False) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            req = self._http.build_request(method, self.base_url + path, json=body,
                                           headers=self.headers, timeout=self.timeout)
            try:
                resp = await self._http.send(req, stream=True)
            except httpx.TransportError as exc:
                if not should_retry(attempt, self.max_retries, exc):
                    raise self._connect_failure(exc) from exc
                await asyncio.sleep(self._delay(attempt, None))
                continue
            if resp.status_code < 400:
                if not stream:
                    await resp.aread()
                return resp
            content = await resp.aread()
            await resp.aclose()
            if not should_retry(attempt, self.max_retries, resp.status_code):
                raise _response_error(resp, content)
            await asyncio.sleep(self._delay(attempt, resp))
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        return (await self._send(method, path, body)).json()

    async def _events(self, path: str, body: dict, chat: bool) -> AsyncIterator[Chunk]:
        resp = await self._send("POST", path, body, stream=True)
        try:
            async for line in resp.aiter_lines():
                chunk = _parse_event(line, chat)
                if chunk is not None:
                    yield chunk
        except httpx.TransportError as exc:
            raise self._connect_failure(exc) from exc
        finally:
            await resp.aclose()

    async def complete(self, prompt: str | list[int],
                       **options: Unpack[Options]) -> Completion:
        body = _body(self.model, False, *_kw(options))
        body["prompt"] = prompt
        return _parse_completion(await self._json("POST", "/v1/completions", body), chat=False)

    async def chat(self, messages: str | list[dict], **options: Unpack[Options]) -> Completion:
        body = _body(self.model, False, *_kw(options))
        body["messages"] = _messages(messages)
        return _parse_completion(await self._json("POST", "/v1/chat/completions", body),
                                 chat=True)

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._json("GET", "/v1/models"))["data"]]

    async def health(self) -> bool:
        try:
            await self._send("GET", "/health")
        except SpecdecError:
            return False
        return True

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics")).text


_OPTIONS = tuple(Options.__annotations__)


def _kw(kw: dict) -> tuple:
    """The generation options of ``complete`` in _body's order; unknown names are an error."""
    unknown = set(kw) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    return tuple(kw.get(name) for name in _OPTIONS)
