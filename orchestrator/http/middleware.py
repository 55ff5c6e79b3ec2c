"""ASGI pieces of the HTTP front: bearer-key auth, the request body's size and time limit,
Server-Sent Events. (The request head's limits are below ASGI: orchestrator.http.connection.)"""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.http.errors import APIError


def api_key_matches(authorization: bytes | str | None, api_key: str) -> bool:
    """Whether an Authorization header value is ``Bearer <api_key>``: the scheme matched
    case-insensitively (RFC 9110 section 11.1), the key in constant time."""
    if isinstance(authorization, str):
        authorization = authorization.encode("utf-8", "replace")
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return hmac.compare_digest(scheme.lower() + b" " + token.strip(),
                               b"bearer " + api_key.encode())


class BodyLimit:
    """413 for a request body over ``limit`` bytes, by its Content-Length or, for a chunked
    body, as soon as it grows past it; 408, closing the connection, for a body not all in
    within ``timeout_s`` of the request's head (plain ASGI middleware: the body is read once).

    The timeout bounds the whole body, not the gap between two reads as nginx's
    client_body_timeout does: a client that sent a byte now and then would otherwise hold its
    connection and task for as long as it liked. It ends with the body: a response, however
    long, is never timed.
    """

    def __init__(self, app, limit: int, timeout_s: float | None = None):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        too_large = length is not None and length.isdigit() and int(length) > self.limit
        body: list = []
        if not too_large:
            try:
                async with asyncio.timeout(self.timeout_s):
                    too_large, disconnect = await self._read(receive, body)
            except TimeoutError:
                err = APIError(408, f"the request body did not arrive within "
                                    f"{self.timeout_s:g} s", code="request_timeout")
                # The rest of the body may still come: the connection cannot carry another
                # request, so uvicorn closes it after this response.
                resp = JSONResponse(err.body(), status_code=408, headers={"Connection": "close"})
                return await resp(scope, receive, send)
            if disconnect is not None:
                return await self.app(scope, _replay([disconnect]), send)
        if too_large:
            err = APIError(413, f"the request body exceeds {self.limit} bytes",
                           code="request_too_large")
            return await JSONResponse(err.body(), status_code=413)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive, body: list) -> tuple[bool, dict | None]:
        """Read the body's messages into ``body``: (whether it grew past the limit, the
        message that ended it early, a disconnect, or None)."""
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return False, message
            size += len(message.get("body", b""))
            body.append(message)
            more = message.get("more_body", False)
            if size > self.limit:
                return True, None
        return False, None


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


class BearerAuth:
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


class EventStream(StreamingResponse):
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


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                      separators=(",", ":"))
    return f"data: {data}\n\n"
