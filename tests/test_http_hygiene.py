"""Connection hygiene of `specdec serve`'s HTTP front: a request whose head (request line and
headers) or body does not arrive in time, or whose head is too large, is answered and its
connection closed, while slow but complete requests and long responses go through. The real
app over a fake backend under a real uvicorn server on loopback, spoken to over raw sockets."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from orchestrator import serve_cli
from orchestrator.generation import Delta, GenerationResult, GenerationStats
from orchestrator.http.app import create_app
from orchestrator.http.connection import HeadLimit
from orchestrator.http.schemas import ServeDefaults

MODEL = "fake"
TIMEOUT_S = 1.0  # the server's header and body timeouts
SLACK_S = 2.0  # what a busy machine may add before a timeout is seen
MAX_HEADER_BYTES = 32 * 1024  # specdec serve's default
TOKEN_DELAY_S = 0.25  # the fake generation's time per token


class LetterTokenizer:
    """Token id i is the letter chr(97 + i % 26): all the app asks of a tokenizer when prompts
    are token ids."""

    def __len__(self) -> int:
        return 1000

    def decode(self, ids) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class SlowBackend:
    """Generates max_tokens tokens, TOKEN_DELAY_S apart."""

    tokenizer = LetterTokenizer()
    max_context = 256

    def service_clients(self) -> dict:
        return {}

    async def stream(self, req):
        ids = list(range(req.max_new_tokens))
        for tok in ids:
            await asyncio.sleep(TOKEN_DELAY_S)
            yield Delta(self.tokenizer.decode([tok]), [tok])
        yield GenerationResult(req.request_id, ids, self.tokenizer.decode(ids), "length",
                               len(req.prompt_ids), GenerationStats(mode=req.mode))


@pytest.fixture(scope="module")
def port():
    """A real uvicorn server on loopback with specdec serve's limits, TIMEOUT_S short."""
    app = create_app(SlowBackend(), MODEL,
                     defaults=ServeDefaults(body_timeout_s=TIMEOUT_S, max_tokens=2))
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="off",
        http=HeadLimit.factory(TIMEOUT_S, MAX_HEADER_BYTES)))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def request_head(method: str, path: str, length: int | None = None, close: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def completion_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": [1, 2, 3], **fields}).encode()


def read_until_closed(sock: socket.socket, within_s: float,
                      since: float | None = None) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds
    from ``since``, a time.monotonic() taken before the request was sent; default now); fails
    if it stays open longer than ``within_s``."""
    start = time.monotonic() if since is None else since
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"the connection is still open after {within_s} s; got {data[:200]!r}")
    except ConnectionResetError:
        pass  # closed with unread bytes of ours: still closed
    return data, time.monotonic() - start


def parse_response(data: bytes) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP/1.1 response."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return int(status_line.split()[1]), headers, body


def openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_body_sent_in_half_gets_408_and_the_connection_is_closed(port):
    body = completion_body()
    with connect(port) as sock:
        sent = time.monotonic()  # (the server's clock starts after this, however slow we are)
        sock.sendall(request_head("POST", "/v1/completions", len(body)) + body[:len(body) // 2])
        data, waited = read_until_closed(sock, TIMEOUT_S + SLACK_S, since=sent)
    status, headers, payload = parse_response(data)
    assert status == 408 and headers["connection"] == "close"
    assert openai_error(payload)["code"] == "request_timeout"
    assert waited >= TIMEOUT_S - 0.1  # not refused before its time


@pytest.mark.parametrize("first_request", [False, True], ids=["new", "keep-alive"])
def test_headers_sent_in_part_get_408_and_the_connection_is_closed(port, first_request):
    with connect(port) as sock:
        if first_request:  # the bound holds for every request on a connection, not only its first
            sock.sendall(request_head("GET", "/v1/models"))
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: appl")
        data, _ = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    status, headers, payload = parse_response(data)
    assert status == 408 and headers["connection"] == "close"
    assert openai_error(payload)["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed_quietly(port):
    with connect(port) as sock:
        data, _ = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    assert data == b""


@pytest.mark.parametrize("pieces", [1, 20], ids=["one-write", "trickled"])
def test_a_100kb_header_gets_431_and_the_server_serves_on(port, pieces):
    head = request_head("GET", "/v1/models").replace(
        b"\r\n\r\n", b"\r\nX-Padding: " + b"a" * 100_000 + b"\r\n\r\n")
    size = -(-len(head) // pieces)
    with connect(port) as sock:
        try:
            for i in range(0, len(head), size):
                sock.sendall(head[i:i + size])
                time.sleep(0.01 if pieces > 1 else 0)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we were done sending
        # The server closes with our unsent bytes unread, so the kernel resets the connection,
        # but the answer it sent first is still ours to read.
        data, _ = read_until_closed(sock, SLACK_S)
    status, headers, payload = parse_response(data)
    assert status == 431 and headers["connection"] == "close"
    assert openai_error(payload)["code"] == "request_headers_too_large"
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"X-Padding": "a" * 8000})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_a_slow_but_complete_request_within_the_bounds_succeeds(port):
    body = completion_body(max_tokens=1)
    head = request_head("POST", "/v1/completions", len(body), close=True)
    pieces = [head[:20], head[20:], body[:10], body[10:30], body[30:]]
    with connect(port) as sock:
        for piece in pieces:  # 4 gaps of TIMEOUT_S / 6: the head and the body in time
            sock.sendall(piece)
            time.sleep(TIMEOUT_S / 6)
        data, _ = read_until_closed(sock, 10)
    status, _, payload = parse_response(data)
    assert status == 200
    assert json.loads(payload)["choices"][0]["text"] == "a"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_response_longer_than_the_timeouts_is_not_cut(port, stream):
    tokens = int(3 * TIMEOUT_S / TOKEN_DELAY_S)  # takes three timeouts
    payload = {"model": MODEL, "prompt": [1], "max_tokens": tokens, "stream": stream}
    started = time.monotonic()
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                             json=payload) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200
            assert events[-1] == "data: [DONE]"
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        else:
            r = http.post(f"http://127.0.0.1:{port}/v1/completions", json=payload)
            assert r.status_code == 200
            text = r.json()["choices"][0]["text"]
    assert text == LetterTokenizer().decode(range(tokens))
    assert time.monotonic() - started > 2 * TIMEOUT_S  # it did outlast the timeouts


@pytest.mark.parametrize("flag, value, message", [
    ("--body-timeout-s", "0", "body_timeout_s must be > 0"),
    ("--header-timeout-s", "-1", "header timeout must be > 0"),
    ("--max-header-bytes", "100", "header size limit must be >= 1024"),
])
def test_serve_refuses_bad_limits_before_it_starts_anything(flag, value, message):
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    with pytest.raises(SystemExit, match=message):
        serve_cli.cmd_serve(parser.parse_args(["serve", flag, value]))
