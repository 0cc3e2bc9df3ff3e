"""A stream that has nothing to send for --stream-keepalive seconds (queued behind a full batch, or in a
long prefill) sends a keep-alive: an SSE comment, which every event parser skips (the OpenAI and Anthropic
SDKs' too), on /v1/messages as well (a `ping` event there would come before `message_start`). Without it a proxy's read timeout (nginx's proxy_read_timeout, 60 s) cuts a
stream queued that long. A stream that sends keeps sending no keep-alives, and none follows its end."""

from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import httpx
import openai
import pytest

from models.synthetic import write_checkpoint
from server import serving
from tests.server.server_process import ServerProcess

KEEP = serving.KEEPALIVE.decode()


def _sent(body_gaps: list[float], keepalive: float) -> list[tuple[float, dict]]:
    """The (time, message) pairs a ClosingStream sends for a body of len(body_gaps) events, event i after
    a pause of body_gaps[i] seconds."""
    async def body():
        for i, gap in enumerate(body_gaps):
            await asyncio.sleep(gap)
            yield f"data: {i}\n\n"

    sent: list[tuple[float, dict]] = []

    async def run() -> None:
        resp = serving.ClosingStream(body(), [], keepalive, media_type="text/event-stream")

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await asyncio.sleep(0.01)  # a send that yields: a keep-alive must wait for it, not interleave
            sent.append((time.monotonic(), message))

        await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        await asyncio.sleep(3 * keepalive if keepalive else 0.1)  # nothing may follow the end

    asyncio.run(run())
    return sent


def _bodies(sent: list[tuple[float, dict]]) -> list[bytes]:
    return [m["body"] for _, m in sent if m["type"] == "http.response.body"]


def test_a_quiet_stream_sends_keepalives_between_its_events_and_none_after_the_end() -> None:
    sent = _sent([0.0, 0.55, 0.0], 0.1)
    assert sent[0][1]["type"] == "http.response.start"
    bodies = _bodies(sent)
    assert bodies[0] == b"data: 0\n\n" and bodies[-2:] == [b"data: 2\n\n", b""]
    between = bodies[1:bodies.index(b"data: 1\n\n")]
    assert 3 <= len(between) <= 6 and set(between) == {KEEP.encode()}, bodies
    assert sent[-1][1]["more_body"] is False and len(bodies) == len(between) + 4
    times = [t for t, m in sent if m.get("body") == KEEP.encode()]
    assert all(b - a >= 0.09 for a, b in zip(times, times[1:])), times  # one per quiet period, not a burst


def test_a_busy_stream_sends_none_and_zero_turns_them_off() -> None:
    assert KEEP.encode() not in _bodies(_sent([0.02] * 20, 0.3))
    bodies = _bodies(_sent([0.0, 0.4, 0.0], 0.0))
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("dsv3"), "tiny-deepseek-v3", seed=5)
    srv = ServerProcess(str(model), "--max-running-requests", "1", "--stream-keepalive", "0.2",
                        log=tmp_path_factory.mktemp("log") / "log").wait_ready()
    yield srv
    srv.stop()


class _Hog:
    """A long stream that holds the only running slot until released (closing it aborts it)."""

    def __init__(self, url: str) -> None:
        self.running, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        assert self.running.wait(60), "the hog never ran"

    def _run(self, url: str) -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "prompt": "hog", "max_tokens": 100000, "stream": True, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            self.running.set()
            self.release.wait(60)

    def __enter__(self) -> _Hog:
        return self

    def __exit__(self, *_: object) -> None:
        self.release.set()
        self.thread.join(30)


def _queued_raw(url: str, path: str, body: dict) -> str:
    """The raw text of a stream sent while the hog runs, the hog released after 1 s."""
    with _Hog(url) as hog:
        threading.Timer(1.0, hog.release.set).start()
        with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
            assert resp.status_code == 200
            return resp.read().decode()


def test_a_queued_chat_stream_gets_comments_first_and_the_sdk_reads_it(server) -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    models = httpx.get(server.url + "/v1/models").json()["data"]
    body["model"] = models[0]["id"]
    raw = _queued_raw(server.url, "/v1/chat/completions", body)
    head = raw[:raw.index("data: ")]
    assert head.count(": keep-alive\n\n") >= 2 and head.replace(": keep-alive\n\n", "") == "", raw[:300]
    assert raw.rstrip().endswith("data: [DONE]")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with _Hog(server.url) as hog:
        threading.Timer(1.0, hog.release.set).start()
        chunks = list(client.chat.completions.create(**body))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


def test_a_queued_messages_stream_gets_comments_before_message_start_and_the_sdk_reads_it(server) -> None:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    raw = _queued_raw(server.url, "/v1/messages", body)
    events = [e for e in raw.split("\n\n") if e]
    first = next(i for i, e in enumerate(events) if not e.startswith(":"))
    assert first >= 2 and set(events[:first]) == {": keep-alive"}, events[:3]
    assert events[first].startswith("event: message_start"), events[first]
    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    with _Hog(server.url) as hog:
        threading.Timer(1.0, hog.release.set).start()
        with client.messages.stream(model=model, max_tokens=4, messages=body["messages"]) as stream:
            message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
