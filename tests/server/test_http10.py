"""HTTP/1.0 clients over real sockets (server.http_protocol): a streamed answer, whose length is not known
up front, reaches them unframed and ends with the connection (uvicorn alone sends them chunked
framing, which HTTP/1.0 does not have); answers with a length and HTTP/1.1 clients are framed as before."""

from __future__ import annotations

import threading

from tests.server.test_connection_deadlines import FLOOD_CHUNK, connect, flood_ended, port, read_all  # noqa: F401

__all__ = ["port"]  # the module-scoped server fixture


def split(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return status, headers, body


def get(port: int, path: str, version: str, body: bytes = b"") -> bytes:
    with connect(port) as s:
        s.sendall(f"POST {path} HTTP/{version}\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
                  f"connection: close\r\n\r\n".encode() + body)
        return read_all(s)[0]


def test_a_stream_reaches_an_http10_client_unframed_and_ends_with_the_connection(port):
    flood_ended["h10"] = threading.Event()
    status, headers, body = split(get(port, "/flood?id=h10&chunks=3", "1.0"))
    assert status.split()[1] == "200"
    assert "transfer-encoding" not in headers and "content-length" not in headers
    assert headers["connection"] == "close"
    assert body == b"x" * (3 * FLOOD_CHUNK)  # no chunk sizes among the bytes: the close ended it
    assert flood_ended["h10"].wait(5)


def test_an_answer_with_a_length_keeps_it_for_http10(port):
    status, headers, body = split(get(port, "/", "1.0", b"abcde"))
    assert status.split()[1] == "200" and headers["content-length"] == str(len(body))
    assert body == b'{"got": 5}'


def test_http11_streams_stay_chunked(port):
    flood_ended["h11"] = threading.Event()
    status, headers, body = split(get(port, "/flood?id=h11&chunks=1", "1.1"))
    assert headers["transfer-encoding"] == "chunked"
    assert body == b"%x\r\n" % FLOOD_CHUNK + b"x" * FLOOD_CHUNK + b"\r\n0\r\n\r\n"
    assert flood_ended["h11"].wait(5)
