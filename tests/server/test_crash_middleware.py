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


def test_a_tokenizer_that_panics_is_answered_and_the_server_serves_on(tmp_path) -> None:
    """A tokenizer.json regex that gives up on a text panics in Rust: pyo3 raises that as a BaseException,
    which no `except Exception` saw, so the client got a plain-text 500 past every handler. It is a
    `TokenizerFailure` now: OpenAI's 500 shape, and the server goes on."""
    import json

    import httpx

    from models.synthetic import write_checkpoint
    from tests.server.server_process import ServerProcess

    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=3)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"].insert(
        0, {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False})
    (model / "tokenizer.json").write_text(json.dumps(spec))
    srv = ServerProcess(str(model), log=tmp_path / "log").wait_ready()
    try:
        for path, body in (("/v1/completions", {"prompt": "a" * 40, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 40}], "max_tokens": 2})):
            resp = httpx.post(srv.url + path, json=body, timeout=60)
            assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error", resp.text
            assert resp.json()["error"]["message"] == "internal server error: TokenizerFailure"
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()
    assert "the model's tokenizer failed on this text: Onig: Regex search error" in srv.log_path.read_text()
