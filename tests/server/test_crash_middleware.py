"""`server.app.CrashMiddleware`: a bug in a route is answered (500 `internal_error`, OpenAI's shape;
Anthropic's on its Messages route) and
ends there, instead of being raised on to the server, which would drop the client's keep-alive
connection; a crash after the response started is raised on (nothing can be answered any more)."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from server.app import CrashMiddleware


async def crash(_):
    raise KeyError("a bug")


async def late_crash(_):
    async def body():
        yield b"data: {}\n\n"
        raise KeyError("a bug mid-stream")
    return StreamingResponse(body(), media_type="text/event-stream")


def app() -> Starlette:
    return Starlette(routes=[Route("/crash", crash), Route("/late", late_crash), Route("/v1/messages", crash, methods=["POST"])],
                     middleware=[Middleware(CrashMiddleware)])


def test_a_crash_is_answered_and_not_raised_on() -> None:
    client = TestClient(app())  # raise_server_exceptions: an error raised past the middleware fails here
    resp = client.get("/crash")
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "internal server error: KeyError", "type": "server_error",
                                     "param": None, "code": "internal_error"}}


def test_a_crash_in_the_messages_route_is_answered_in_anthropics_shape() -> None:
    resp = TestClient(app()).post("/v1/messages", json={})
    assert resp.status_code == 500
    assert resp.json() == {"type": "error", "error": {"type": "api_error", "message": "internal server error: KeyError"}}


def test_a_crash_after_the_response_started_is_raised_on() -> None:
    with pytest.raises(KeyError):
        TestClient(app()).get("/late")
