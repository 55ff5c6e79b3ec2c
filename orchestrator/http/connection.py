"""The request head's size and time limits, in uvicorn's HTTP protocol (below ASGI, where
uvicorn has no bound of its own)."""

from __future__ import annotations

import asyncio
import functools
import http
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from orchestrator.http.errors import APIError


class HeadLimit(AutoHTTPProtocol):
    """uvicorn's HTTP protocol (httptools, or h11 without it), with a bound on each request's
    head, its request line and headers: a head over ``max_bytes`` gets 431, and a head not all
    in within ``timeout_s`` of its first byte (or of the connection's opening) closes the
    connection, answering 408 when part of it came.

    uvicorn bounds neither: its keep-alive timer runs only between requests, and httptools
    takes headers of any size (h11's max_incomplete_event_size only counts a head that is still
    incomplete after a read, so a large head in one read passes). Once the head is in, the
    body is BodyLimit's; a response in progress is never cut. Give uvicorn.Config
    ``http=HeadLimit.factory(timeout_s, max_bytes)``.
    """

    @classmethod
    def factory(cls, timeout_s: float, max_bytes: int):
        """uvicorn.Config's ``http`` for these bounds (ValueError for bad ones)."""
        if not timeout_s > 0:
            raise ValueError(f"the header timeout must be > 0 s, got {timeout_s}")
        if max_bytes < 1024:
            raise ValueError(f"the header size limit must be >= 1024 bytes, got {max_bytes}")
        return functools.partial(cls, timeout_s=timeout_s, max_bytes=max_bytes)

    def __init__(self, *args, timeout_s: float, max_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s = timeout_s
        self.max_head_bytes = max_bytes
        self.head_bytes = 0  # of the head being read
        self.head_timer: asyncio.TimerHandle | None = None
        self.last_cycle = None  # uvicorn's request cycle last seen: a new one, a head parsed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # The parser is fed at most the head's remaining room at a time, so a head over the
        # limit is refused before it is parsed whole. A piece may end one head and begin a
        # pipelined next one: those first bytes go uncounted (at most max_bytes) and untimed
        # until more come, bounded meanwhile by uvicorn's keep-alive timer, which starts when
        # the response before them ends.
        self._end_head_if_parsed()
        while data and self._reading_head() and not self.transport.is_closing():
            room = self.max_head_bytes - self.head_bytes
            if room <= 0:
                self._refuse(431, f"the request headers exceed {self.max_head_bytes} bytes",
                             "request_headers_too_large")
                return
            if self.head_timer is None:
                self._start_head_timer()
            piece, data = data[:room], data[room:]
            self.head_bytes += len(piece)
            super().data_received(piece)
            self._end_head_if_parsed()
        if data and not self.transport.is_closing():
            super().data_received(data)

    def _reading_head(self) -> bool:
        # After a request's body, what comes is the next request's head. So, to us, is the
        # rest of a body whose response went out before it was read (401, 413): it is
        # bounded alike.
        return self.cycle is None or not self.cycle.more_body or self.cycle.response_complete

    def _end_head_if_parsed(self) -> None:
        # uvicorn makes a request cycle once a head is parsed: mostly within data_received,
        # but h11 parses a pipelined head only when the response before it is done.
        if self.cycle is not self.last_cycle:
            self.last_cycle = self.cycle
            self._stop_head_timer()
            self.head_bytes = 0

    def _start_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.get_protocol() is not self:  # upgraded to a WebSocket: not ours
            return
        if self.cycle is not self.last_cycle:  # the head came in after all
            self._end_head_if_parsed()
        elif self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still being written: it may wait for it.
            self._start_head_timer()
        elif self.head_bytes:
            self._refuse(408, f"the request headers did not arrive within "
                              f"{self.head_timeout_s:g} s", "request_timeout")
        else:  # nothing came: close quietly, as an idle keep-alive connection is
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error body and close the connection; only close it
        where no request head is what the client waits on an answer to (a response is being
        written, or the unread rest of a body is coming)."""
        if self.cycle is None or (self.cycle.response_complete and not self.cycle.more_body):
            body = json.dumps(APIError(status, message, code=code).body(),
                              separators=(",", ":")).encode()
            head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    f"connection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
        self.transport.close()
