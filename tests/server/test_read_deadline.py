"""The server's read deadline (server.http_protocol.ServerHttpProtocol) over real sockets, uvicorn
serving a small ASGI app in a thread: a client that sends nothing, dribbles its headers (slowloris) or
stops in the middle of its body loses the connection after the timeout (a 408 in OpenAI's error shape
when no header came whole), while a request that arrived whole may take longer than the timeout to
answer, on a fresh or a kept-alive connection, and the server keeps answering others."""

from __future__ import annotations

import asyncio
import functools
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from server.http_protocol import ServerHttpProtocol

TIMEOUT = 1.0


async def app(scope, receive, send) -> None:
    """/slow answers after 2.5 timeouts; any other path echoes the body's length."""
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(2.5 * TIMEOUT)
    out = json.dumps({"got": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=free, lifespan="off", log_level="warning",
                            http=functools.partial(ServerHttpProtocol, read_timeout=TIMEOUT))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield free
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(s: socket.socket) -> tuple[bytes, float]:
    """Everything until the server closes, and when it closed (monotonic)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out, time.monotonic()


def request(path: str = "/", body: bytes = b"", keep_alive: bool = False) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
            f"connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n").encode() + body


def assert_408(raw: bytes) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), raw
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error" and "param" in err


def test_a_silent_connection_gets_408_and_is_closed(port: int) -> None:
    with connect(port) as s:
        t0 = time.monotonic()
        raw, closed = read_all(s)
    assert_408(raw)
    assert TIMEOUT * 0.9 <= closed - t0 < TIMEOUT + 3


def test_headers_dribbled_line_by_line_are_cut_at_the_deadline(port: int) -> None:
    """Slowloris: every line comes well within the timeout, the headers as a whole do not."""
    with connect(port) as s:
        t0 = time.monotonic()
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
        lines = 0
        while time.monotonic() - t0 < TIMEOUT + 3 and not select.select([s], [], [], TIMEOUT / 4)[0]:
            s.sendall(b"x-pad-%d: y\r\n" % lines)  # until the server answers
            lines += 1
        raw, closed = read_all(s)
    assert_408(raw)
    assert TIMEOUT * 0.9 <= closed - t0 < TIMEOUT + 3 and lines >= 2


def test_a_body_that_stops_loses_the_connection_and_others_are_served(port: int) -> None:
    with connect(port) as stalled:
        stalled.sendall(request(body=b"0123456789")[:-5])  # the headers whole, half the body
        t0 = time.monotonic()
        raw, closed = read_all(stalled)
    assert raw == b""  # its handler had started: no answer, just the close
    assert TIMEOUT * 0.9 <= closed - t0 < TIMEOUT + 3
    with connect(port) as other:
        other.sendall(request(body=b"abc"))
        raw, _ = read_all(other)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"got": 3}')


def test_a_body_sent_slowly_but_steadily_is_read_whole(port: int) -> None:
    body = b"z" * 8
    with connect(port) as s:
        s.sendall(request(body=body)[:-len(body)])
        for i in range(len(body)):  # one byte each half timeout: 4 timeouts in all, never idle for one
            time.sleep(TIMEOUT / 2)
            s.sendall(body[i:i + 1])
        raw, _ = read_all(s)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"got": 8}')


def test_answers_longer_than_the_timeout_are_not_cut(port: int) -> None:
    """A whole request's answer takes what it takes, also the second on a kept-alive connection, and
    the next request there is due only from when that answer is done."""
    with connect(port) as s:
        s.sendall(request("/slow", b"ab", keep_alive=True))
        first = b""
        while b'{"got": 2}' not in first:
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT / 2)  # idle within the timeout, then a second, slow one
        s.sendall(request("/slow", b"abcd"))
        raw, _ = read_all(s)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"got": 4}')


def test_pipelined_requests_wait_untimed_behind_a_slow_answer(port: int) -> None:
    with connect(port) as s:
        s.sendall(request("/slow", b"a", keep_alive=True) + request("/", b"bc"))
        raw, _ = read_all(s)
    assert raw.count(b"HTTP/1.1 200") == 2 and raw.endswith(b'{"got": 2}'), raw

