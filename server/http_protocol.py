"""uvicorn's C HTTP/1.1 protocol with read and write deadlines, so a client cannot hold a connection open
forever, and answers an HTTP/1.0 client can read.

**Reading.**
uvicorn times a connection out only while it idles between requests (its keep-alive timer, cleared by
the first byte of the next request). A client that sends a request's headers a line at a time
(slowloris), sends one byte and stops, or promises a body it never sends, keeps its socket, its file
descriptor and, once the headers are in, a handler waiting on the body, for as long as it likes; a few
hundred of them exhaust the process's descriptors. `ServerHttpProtocol` gives each request's headers
`read_timeout` seconds in all, counted from the moment the server waits for that request, and its body
at most `read_timeout` seconds between two reads (nginx's client_header_timeout and
client_body_timeout). Past it the connection is closed: with a 408 in OpenAI's error shape when the
request had begun (its headers not complete, or its body not: the handler waiting on it has answered
nothing, and its next receive says the client disconnected, so its answer goes nowhere), as nginx
answers both; without a word when no byte of a request came (a fresh connection left unused, a
kept-alive one idle between requests, as nginx and uvicorn's keep-alive timer close them: a 408 there
is no answer to anything, and a client that sends its next request just then would read it as that
request's). Requests that have arrived whole are never timed: generating their answer takes as long
as it takes.

**Writing.** A client that stops reading its answer (a stuck consumer, a peer gone without a reset)
fills the socket's buffer; uvicorn then holds the handler at its next write until the buffer drains,
which may be never: the request, its connection and its output queue stay for good. When the buffer
has been full for `write_timeout` seconds and the client took none of it meanwhile (nginx's
send_timeout, also counted between two writes that make progress), the connection is dropped: the
handler sees the disconnect, and a request still generating is aborted, its KV slots freed.

The end of a client's input still ends the connection, as uvicorn has it: a client that half-closes
(`shutdown(SHUT_WR)`) looks the same as one that closed, and closing is how a client that gave up
stops its generation and frees its KV slots at once (nginx counts it as a client abort too).

**Shutdown.** After the drain, a request still arriving (headers or body half sent) is answered 503
`shutting_down` from here (`refuse_unfinished`), as the app answers every request after the signal.

**Headers' size.** The parser keeps a request's line and headers in memory until they end, whatever their
length, and only `read_timeout` bounds how long they may take: one client sending header lines as fast as it
can held gigabytes before any handler (or `--api-key`) saw the request. A request whose line and headers
pass `MAX_HEAD_BYTES` gets a 431 (a 414 when its URL does) in OpenAI's error shape and the connection closes
(nginx allows 4 × 8 KiB, Node and uvicorn's h11 parser 16 KiB).

**Connections.** Past `max_connections` open at once (the server sets it below its file-descriptor limit) a
new connection takes the place of an idle one (no request under way: between requests, or never sent a
byte), which is closed; where none is idle, the new one is closed as it comes. At the limit itself every
accept failed, asyncio logged each failure (a hundred MB of log in half a minute) and spun, and nothing new
was served until clients left; and idle connections up to the cap locked out every new client until the
read timeout closed them. A client
that pipelines more than `MAX_PIPELINED` requests behind the one being answered loses the connection: each
waiting request is held parsed, and one that sent thousands while reading no answer held gigabytes.

**Not HTTP.** What the parser refuses (a garbled request line, chunk size or header) gets a 400 in OpenAI's
error shape, where uvicorn answers in text/plain. A refused request's connection closes after a lingering
read (`_close_when_read`): the client may still be sending it, and a close with its bytes unread resets
the connection, losing the answer.

**HTTP/1.0.** uvicorn frames every answer of unknown length (a stream) as chunked, whatever the request's
version; an HTTP/1.0 client does not know chunked framing (RFC 9112 §6.1: a server must not send it one)
and would read the chunk sizes as part of the events. Such answers go to an HTTP/1.0 client as they
come, unframed, and end when the server closes the connection, which uvicorn does after every HTTP/1.0
answer anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

logger = logging.getLogger("mlaserve.server")  # the request log's lines, as server.app's

#: Keys of a request's ASGI scope shared with the request log (server.app.RequestLogMiddleware): the id it gave
#: the request, and that the connection answered it itself (an error written here: its one log line is this
#: module's, with that id, and the handler's own answer goes nowhere).
SCOPE_REQUEST_ID, SCOPE_ANSWERED = "mlaserve.request_id", "mlaserve.answered_by_connection"

MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers, at most (module docstring)
MAX_PIPELINED = 64  # requests a connection may have waiting behind the one being answered (module docstring)
LINGER_S = 2.0  # after refusing a request the client may still be sending: how long its bytes are read and dropped

HEAD, BODY, WHOLE = "head", "body", "whole"  # what the connection is reading: a request's headers, its body, nothing


def log_path(path: str, limit: int = 200) -> str:
    """A request's path as the request log writes it: percent-quoted as uvicorn's access log quotes it (a
    decoded newline or terminal escape in it would forge a log line or colour the terminal), cut at `limit`."""
    quoted = quote(path, safe="/:@!$&'()*+,;=-._~")
    return quoted if len(quoted) <= limit else quoted[:limit] + "..."


class _OneLinePerRequest(logging.Filter):
    """Drops uvicorn's warning for a request its parser refuses: `send_400_response` answers it and writes its
    own log line (status, client, request id), and a second, unformatted line would break one line per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid HTTP request received."


_ONE_LINE = _OneLinePerRequest()


class ServerHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that drops a connection whose request does not arrive, or whose answer is not
    read, in time (module docstring)."""

    def __init__(self, *args: Any, read_timeout: float, write_timeout: float,
                 on_error: Callable[[str, str], None] | None = None, max_connections: int = 0, **kwargs: Any) -> None:
        """`on_error(code, status)`: called for each error this connection answers itself (a 408, a 400 for
        what is not HTTP, the shutdown's 503): no handler's answer, so the error metrics are told here."""
        super().__init__(*args, **kwargs)
        self.logger.addFilter(_ONE_LINE)  # uvicorn's error logger (added once: the filter is one object)
        self.read_timeout, self.write_timeout = read_timeout, write_timeout
        self.max_connections = max_connections  # 0: no limit
        self._overflowed = False  # pipelined past MAX_PIPELINED: the connection is being closed
        self.on_error = on_error
        self._reading = HEAD
        self._begun = False  # a byte of the request being read has come (HEAD: its line or headers began)
        self._deadline: asyncio.TimerHandle | None = None
        self._write_stall: asyncio.TimerHandle | None = None  # armed while the socket's buffer is full
        self._stalled_bytes = 0  # the buffer's size when the write stall was (re)armed
        # the request's line and headers: as parsed (a header counts once whole), and as received in reads
        # that held nothing else (a header still arriving, which the parser buffers), each checked alone
        self._head_parsed = self._head_read = 0
        self._head_events = 0  # requests begun and heads completed: a read that saw none held only a head
        self._lingering = False  # answered an unreadable request: dropping what still comes until the close
        self._head_too_large: str | None = None  # what passed MAX_HEAD_BYTES: "url" or "headers"

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._arm_write_stall()

    def resume_writing(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        super().resume_writing()

    def _arm_write_stall(self) -> None:
        self._stalled_bytes = self.transport.get_write_buffer_size()
        self._write_stall = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def _write_timed_out(self) -> None:
        self._write_stall = None
        # no write is added while the buffer is full (the handler waits), so a smaller buffer means the
        # client took some: a slow reader that keeps reading is not dropped, however slow
        if self.transport.get_write_buffer_size() < self._stalled_bytes:
            self._arm_write_stall()
            return
        logger.info("dropping the connection of client=%s: its answer went unread for %g s (--write-timeout)",
                    self._client(), self.write_timeout)
        self.transport.abort()  # not close(): that would wait for the buffer to drain, as the writes did

    def _client(self) -> str:
        """The peer's address as the request log writes it."""
        peer = self.transport.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"

    def refuse_unfinished(self) -> bool:
        """At shutdown, after the drain: a request still arriving (its headers begun, or its body awaited by
        a handler that has answered nothing) gets a 503 `shutting_down` and the connection closes, as an
        idle one does. Left to uvicorn, the handler waiting on the body was cancelled after uvicorn's own
        grace and the client got uvicorn's text/plain 500 (and the log a traceback). Whether it did."""
        if not self._unanswered():
            return False
        self._disarm()
        self._write_error(b"503 Service Unavailable", "the server is shutting down; send the request to another "
                          "replica or retry once it is back", "shutting_down", "service_unavailable", retry_after=5)
        self.transport.close()
        return True

    def drop_if_stalled(self) -> bool:
        """At shutdown, after the drain: aborts the connection if its client has stopped reading its answer
        (the write buffer is full), as --write-timeout would later. Whether it did."""
        if self._write_stall is None or self.transport.is_closing():
            return False
        self.transport.abort()
        return True

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _answering(self) -> bool:
        """A response is under way: while it is, the client's next request is not timed (a pipelining
        client waits for it, and uvicorn stops reading until then)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self._reading == WHOLE or self.transport.is_closing():
            return
        if self.flow.read_paused:  # this side stopped reading (a body past uvicorn's buffer): not the client's fault
            self._arm()
            return
        if self._reading == HEAD and not self._begun:  # nothing asked: nothing to answer
            logger.debug("closing a connection idle for %g s", self.read_timeout)
        elif self._unanswered():  # the client is told why (a handler waiting on the body then sees the close)
            self._write_error(b"408 Request Timeout", f"the request did not arrive within {self.read_timeout:g} s; "
                              "send it whole, promptly", "request_timeout")
        self.transport.close()

    def _idle(self) -> bool:
        """Nothing under way: no request begun, none answered or waiting behind one (a client between its
        requests, or one that never sent a byte). Past max_connections such a connection gives its place to a
        new one: idle connections by the thousand had locked out every new client, /health too, until the
        read timeout closed them."""
        return not (self.transport is None or self.transport.is_closing() or self._lingering or self._begun
                    or self._reading != HEAD or self._answering() or self.pipeline)

    def _unanswered(self) -> bool:
        """A request has begun (headers or body under way) and nothing answers it yet: no handler runs for
        it, or the one waiting on its body has sent nothing, and no earlier answer is still going out. An
        error of ours may then be written on the connection, which closes after it."""
        if self.transport.is_closing() or self._lingering or self._reading == WHOLE or self.pipeline:
            return False
        if self._reading == HEAD:
            return self._begun and not self._answering()
        return self.cycle is not None and not self.cycle.response_started

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser refuses (a bad request line, chunk size or header): OpenAI's error shape, where
        uvicorn sends text/plain. A head past `MAX_HEAD_BYTES` stops the parser the same way, and is told as a
        414 (its URL) or a 431."""
        if self._overflowed or self.transport.is_closing():
            return self._unanswered_line("its connection was closing")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._end_after_answer()  # a later request's error: the earlier one, whole, is answered first
            return self._unanswered_line("it came pipelined behind a request still being answered; the connection "
                                         "closes after that answer")
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._close_when_read()  # its own body broke while its answer goes out: an error would land inside it
            return self._unanswered_line("its body broke while its answer went out; the connection closes")
        if self._head_too_large:
            self._refuse_large_head()
            return
        self._write_error(b"400 Bad Request", "the request is not valid HTTP/1.1 (its request line, headers or "
                          "chunked framing could not be parsed)", "invalid_http")
        self._close_when_read()

    def _write_error(self, status: bytes, message: str, code: str, kind: str = "invalid_request_error",
                     retry_after: int | None = None) -> None:
        """An error answer of our own, written where no handler answers (none has run, or the one waiting
        on the body has sent nothing); the connection closes after it. It has a request id and a log line,
        as every answer the app gives (no method or path: the request line may not have come whole)."""
        scope = self.cycle.scope if self.cycle is not None and self._reading == BODY else None  # a handler's request
        rid = scope.get(SCOPE_REQUEST_ID) if scope is not None else None
        rid = rid if isinstance(rid, str) else uuid.uuid4().hex
        if scope is not None:
            scope[SCOPE_ANSWERED] = True
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        retry = b"retry-after: %d\r\n" % retry_after if retry_after is not None else b""
        self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n%s"
                             b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, retry, rid.encode(), len(body), body))
        client = self._client()
        what = f"{scope.get('method')} {log_path(str(scope.get('path', '')))}" if scope is not None else "- -"
        logger.info("%s %s client=%s request_id=%s (%s)", what, status.decode().split()[0], client, rid, code)
        if self.on_error is not None:
            self.on_error(code, status.decode().split()[0])

    def _unanswered_line(self, why: str) -> None:
        """The log's line for a request the parser refused and no answer can tell (uvicorn's own warning for it
        is filtered out: `_OneLinePerRequest`)."""
        logger.info("- - - client=%s (invalid_http, not answered: %s)", self._client(), why)

    def _refuse_large_head(self) -> None:
        if self._head_too_large == "url":  # (it comes before the headers, each piece of it passed on at once)
            self._write_error(b"414 URI Too Long", f"the request's URL is over {MAX_HEAD_BYTES} bytes",
                              "uri_too_long")
        else:
            self._write_error(b"431 Request Header Fields Too Large", f"the request line and headers are over "
                              f"{MAX_HEAD_BYTES} bytes; send fewer or shorter headers",
                              "request_header_fields_too_large")
        self._close_when_read()

    def _end_after_answer(self) -> None:
        """A request that cannot be read came after one whose answer is under way (pipelined): that answer goes
        out whole, then the connection closes (uvicorn closes after an answer that does not keep it alive);
        meanwhile what the client sends is dropped. Its error would have landed inside that answer, or in
        place of it."""
        assert self.cycle is not None
        self._lingering = True
        self._disarm()
        self.pipeline.clear()
        self.cycle.keep_alive = False

    def _close_when_read(self) -> None:
        """Ends a connection whose client may still be sending (the rest of a refused request): closing with
        its bytes unread would reset the connection, and the client would lose the answer before reading it.
        So, as nginx's lingering close, the answer goes out with a FIN, what still comes is read and dropped,
        and the connection closes when the client closes it or after `LINGER_S`."""
        self._lingering = True
        self._disarm()
        self.pipeline.clear()  # requests read after this one are not answered: the connection ends
        if self.cycle is not None and not self.cycle.response_complete:  # its handler's answer goes nowhere
            self.cycle.disconnected = True  # (as after a close: its writes are dropped, its reads see the end)
            self.cycle.message_event.set()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _count_head(self, n: int, part: str) -> None:
        """Counts `n` parsed bytes of the request's line and headers; past the limit the parser is stopped (the
        error it raises is answered by `send_400_response`) before anything starts a handler."""
        self._head_parsed += n
        if self._head_parsed > MAX_HEAD_BYTES:
            self._head_too_large = part
            raise ValueError(f"request {part} too large")

    # the connection and the parser's events, in the order they come
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            idle = next((c for c in self.connections if c is not self and isinstance(c, ServerHttpProtocol)
                         and c._idle()), None)
            if idle is None:
                _warn_at_most_every(10.0, "closing new connections: %d are open, the most this server keeps "
                                    "(below its file-descriptor limit), each in a request", len(self.connections) - 1)
                transport.close()
                return
            idle.transport.close()  # (a client between requests, or one that never sent a byte, makes room)
        self._arm()  # the first request's headers are due from now

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a refused request (`_close_when_read`)
        events = self._head_events
        super().data_received(data)
        if self._reading == HEAD and self._begun and events == self._head_events and not self.transport.is_closing():
            self._head_read += len(data)  # all of it went to a head still arriving (one long line, say)
            if self._head_read > MAX_HEAD_BYTES:
                self._head_too_large = "headers"
                self.send_400_response("request headers too large")

    def on_message_begin(self) -> None:
        if self._overflowed:
            raise ValueError("too many pipelined requests")  # stops the parser (send_400_response: nothing sent)
        if self._reading == WHOLE and self._deadline is None and not self._answering():
            self._arm()  # a request after a whole one, with no answer under way: due from its first byte
        self._reading = HEAD
        self._begun = True
        self._head_parsed = self._head_read = 0
        self._head_events += 1
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url), "url")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4, "headers")  # with ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_events += 1
        self._head_parsed = 0  # (a chunked body's trailers are counted alone)
        answering = self._answering()  # an earlier request's: this one waits in uvicorn's pipeline
        self._reading = BODY
        if answering or (self.parser.should_upgrade() and self._should_upgrade()):  # a WebSocket is not timed
            self._disarm()
        else:
            self._arm()  # the body's first read is due within the timeout
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.parser.get_http_version() == "1.0":
            close_delimited(self.cycle)
        if len(self.pipeline) > MAX_PIPELINED:
            _warn_at_most_every(10.0, "closing a connection with over %d pipelined requests waiting", MAX_PIPELINED)
            self._overflowed = True
            self.pipeline.clear()
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        if self._deadline is not None:
            self._arm()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading = WHOLE
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a whole request starts now: nothing to time until it is answered
        super().on_response_complete()
        if pipelined or self.transport.is_closing():
            return
        if self._reading == WHOLE:
            self._reading = HEAD  # waiting for the next request (uvicorn's keep-alive timer may close first)
            self._begun = False
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        super().connection_lost(exc)


_last_warning: dict[str, float] = {}


def _warn_at_most_every(seconds: float, message: str, *args: Any) -> None:
    """A warning about what a flood of connections does, logged once per `seconds`, not once per connection."""
    now = time.monotonic()
    if now - _last_warning.get(message, -seconds) >= seconds:
        _last_warning[message] = now
        logger.warning(message, *args)


def close_delimited(cycle: RequestResponseCycle) -> None:
    """Sends `cycle`'s answer unframed when it has no length (a stream), for an HTTP/1.0 client (module
    docstring); uvicorn closes the connection after it, which is where the answer ends. Answers with
    a content-length, HEAD answers and 204/304 are left as uvicorn frames them."""
    send = cycle.send
    unframed = False

    async def send_close_delimited(message: Any) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            names = {bytes(name).lower() for name, _ in message.get("headers", [])}
            unframed = (b"content-length" not in names and b"transfer-encoding" not in names
                        and cycle.scope["method"] != "HEAD" and message["status"] not in (204, 304))
            if unframed:
                cycle.keep_alive = False  # already so for HTTP/1.0: the close is the answer's end
                cycle.chunked_encoding = False  # uvicorn then writes the body as it is, counting it down
                cycle.expected_content_length = sys.maxsize
        elif unframed and message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))  # this last piece ends it
        await send(message)

    cycle.send = send_close_delimited  # type: ignore[method-assign]
