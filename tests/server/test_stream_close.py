"""A streamed answer ends its engine work and leaves the in-flight count however Starlette stops sending
it: also when the client is gone before the first part, where Starlette cancels the sending task before
the body generator starts (a generator never started runs no `finally`)."""

from __future__ import annotations

import asyncio
import types

import pytest

from server import serving
from server.metrics import Metrics
from server.state import ServerState


@pytest.mark.parametrize("client", ["gone before the first part", "reads it all"])
def test_a_stream_is_closed_and_uncounted(client: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = ServerState(model_name="m", metrics=Metrics("m"))
    state.engine = types.SimpleNamespace(any_alive=True)
    ended: list[str] = []

    async def body():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            ended.append("body")

    async def engine_work_closed() -> None:
        ended.append("engine")

    async def handle(*_):
        return serving.ClosingStream(body(), [engine_work_closed], media_type="text/event-stream")

    monkeypatch.setattr(serving, "handle", handle)
    sent: list[dict] = []

    async def run() -> None:
        resp = await serving.counted(None, state, None, None)
        assert state.inflight == 1

        async def receive() -> dict:
            if client == "reads it all":
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:  # an ASGI server's send may yield (a paused transport)
            await asyncio.sleep(0)
            sent.append(message)

        # spec 2.3, as uvicorn's: Starlette listens for the disconnect beside the sending task
        await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(run())
    assert state.inflight == 0 and "engine" in ended
    bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
    if client == "reads it all":
        assert ended == ["body", "engine"] and bodies[:2] == [b"data: 1\n\n", b"data: 2\n\n"]


def test_a_requests_arrival_is_before_its_template_and_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency metrics (TTFT, end to end, queue) count from the request's arrival: a prompt that takes
    long to render and tokenize (a megabyte: ~0.4 s) counts in them; it was stamped after."""
    import time

    from server.tools import ToolPlan

    state = ServerState(model_name="m", metrics=Metrics("m"))
    seen: dict[str, float] = {}

    def slow_build(_state, _body):
        time.sleep(0.3)
        seen["built"] = time.time()
        return [([1, 2, 3], "abc")], ToolPlan()

    def start(_state, _body, _prompts, _tools, _params, arrived=None):
        seen["arrived"] = arrived
        raise serving.ClientError(400, "enough")

    monkeypatch.setattr(serving, "build_prompts", slow_build)
    monkeypatch.setattr(serving, "request_params", lambda *_: None)
    monkeypatch.setattr(serving, "start_requests", start)
    before = time.time()
    resp = asyncio.run(serving.handle(None, state, None, None))
    assert resp.status_code == 400
    assert before <= seen["arrived"] <= seen["built"] - 0.25


def test_a_requests_sampling_parameters_are_checked_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking the sampling parameters rewrites a structured output's schema (seconds for hundreds of
    kilobytes of `anyOf`): on the event loop every stream and /health would stall meanwhile. It ran there."""
    import threading

    from scheduler.sampling_params import ParamError
    from server.tools import ToolPlan

    state = ServerState(model_name="m", metrics=Metrics("m"))
    threads: list[threading.Thread] = []

    def checked(*_args, **_kw):
        threads.append(threading.current_thread())
        raise ParamError("bad schema", "response_format")

    monkeypatch.setattr(serving, "build_prompts", lambda *_: ([([1, 2, 3], "abc")], ToolPlan()))
    monkeypatch.setattr(serving, "checked_sampling_params", checked)
    loop_thread: list[threading.Thread] = []

    async def run():
        loop_thread.append(threading.current_thread())
        return await serving.handle(None, state, types.SimpleNamespace(bad_words=None), None)

    resp = asyncio.run(run())
    assert resp.status_code == 400 and b"bad schema" in resp.body
    assert threads and threads[0] is not loop_thread[0]
