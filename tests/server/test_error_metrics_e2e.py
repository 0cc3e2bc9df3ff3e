"""`mlaserve_request_errors_total{code, status}` through a real server: every error answer, whoever
refuses the request (auth, the body limit, validation, the routes, admission in the engine, shutdown),
moves exactly one series by exactly 1, read from real `/metrics` scrapes; successes and `/health`'s
503 move none. An engine refusal, which the route also reports with `on_error`, counts once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

KEY = "sk-test-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4096
CONTEXT = 8192
LONG = CONTEXT - 64  # max_tokens of a stream that holds the one running slot for seconds


def errors(url: str) -> dict[tuple[str, str], float]:
    """(code, status) -> value of mlaserve_request_errors_total, from a real scrape."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "mlaserve_request_errors":
            for s in fam.samples:
                if s.name == "mlaserve_request_errors_total":
                    out[s.labels["code"], s.labels["status"]] = s.value
    return out


def delta(before: dict, after: dict) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=21)


def _server(model_dir: Path, log: Path, *extra: str) -> ServerProcess:
    return ServerProcess(str(model_dir), "--dtype", "float32", "--context-length", str(CONTEXT),
                         "--max-running-requests", "1", "--max-queued-requests", "0",
                         "--max-request-bytes", str(BODY_LIMIT), *extra, env={"MLASERVE_API_KEY": KEY},
                         log=log).wait_ready()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = _server(model_dir, tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# (id, method, path, request kwargs, expected status, expected (code, status) counted; None: nothing)
CASES: list[tuple[str, str, str, dict[str, Any], int, tuple[str, str] | None]] = [
    ("chat ok", "POST", "/v1/chat/completions", {"json": CHAT}, 200, None),
    ("stream ok", "POST", "/v1/completions", {"json": {"prompt": "a", "max_tokens": 4, "stream": True}}, 200, None),
    ("context too long", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": CONTEXT + 1}}, 400,
     ("context_length_exceeded", "400")),
    ("top_p 5", "POST", "/v1/completions", {"json": {"prompt": "a", "top_p": 5}}, 400,
     ("invalid_request_error", "400")),
    ("top_p 5 streamed", "POST", "/v1/completions", {"json": {"prompt": "a", "top_p": 5, "stream": True}}, 400,
     ("invalid_request_error", "400")),
    ("unknown model", "POST", "/v1/chat/completions", {"json": {**CHAT, "model": "nope"}}, 404,
     ("model_not_found", "404")),
    ("unknown model card", "GET", "/v1/models/nope", {}, 404, ("model_not_found", "404")),
    ("no key", "POST", "/v1/completions", {"json": {"prompt": "a"}, "headers": {"Authorization": "Bearer wrong"}},
     401, ("invalid_api_key", "401")),
    ("body too large", "POST", "/v1/completions", {"json": {"prompt": "x" * BODY_LIMIT}}, 413,
     ("request_too_large", "413")),
    ("field missing", "POST", "/v1/chat/completions", {"json": {"max_tokens": 4}}, 400,
     ("invalid_request_error", "400")),
    ("wrong type", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": "many"}}, 400,
     ("invalid_request_error", "400")),
    ("not json", "POST", "/v1/completions", {"content": b"{not json", "headers": {"Content-Type": "application/json"}},
     400, ("invalid_request_error", "400")),
    ("no route", "GET", "/v2/nothing", {}, 404, ("not_found", "404")),
    ("wrong method", "DELETE", "/v1/models", {}, 405, ("method_not_allowed", "405")),
    ("tokenize unknown model", "POST", "/tokenize", {"json": {"prompt": "a", "model": "nope"}}, 404,
     ("model_not_found", "404")),
    ("detokenize bad id", "POST", "/detokenize", {"json": {"tokens": [10**9]}}, 400,
     ("invalid_request_error", "400")),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "counted"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_error_answer_counts_once(server: ServerProcess, method: str, path: str, kwargs: dict[str, Any],
                                       status: int, counted: tuple[str, str] | None) -> None:
    before = errors(server.url)
    headers = {**AUTH, **kwargs.pop("headers", {})} if "headers" in kwargs else dict(AUTH)
    resp = httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)
    assert resp.status_code == status, resp.text
    if counted is not None:
        error = resp.json()["error"]
        assert (error["code"] or error["type"]) == counted[0], error
    assert delta(before, errors(server.url)) == ({counted: 1} if counted else {})


def _hold_the_slot(url: str, held: dict, release: threading.Event) -> None:
    """A long stream on the one running slot: records its status once the first chunk came, then holds
    the connection until `release` (closing it aborts the request: an abort, not an error)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=300, json={
                "prompt": "hold", "max_tokens": LONG, "stream": True, "ignore_eos": True}) as resp:
            for _ in resp.iter_lines():  # keep reading (leaving the iterator would close the connection)
                held["status"] = resp.status_code
                if release.is_set():
                    break
            held["ended"] = True
    except httpx.HTTPError as e:
        held["error"] = repr(e)


def _while_held(url: str, check: Callable[[], None]) -> None:
    """`check()` while a long stream holds the server's one running slot."""
    held: dict = {}
    release = threading.Event()
    t = threading.Thread(target=_hold_the_slot, args=(url, held, release), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while "status" not in held and "error" not in held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held.get("status") == 200, held
        check()
        assert "ended" not in held, "the held stream ended before the check was done"
    finally:
        release.set()
        t.join(60)


def test_an_engine_refusal_counts_once(server: ServerProcess) -> None:
    """503 `overloaded` comes from the engine: the route notes it (`on_error`) and answers it; one count."""
    def check() -> None:
        before = errors(server.url)
        resp = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "one too many", "max_tokens": 4})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded", resp.text
        after.update(errors(server.url))
        assert delta(before, after) == {("overloaded", "503"): 1}

    after: dict = {}
    aborted = server.metric("mlaserve_requests_aborted_total")
    _while_held(server.url, check)
    # the held stream was then closed by its client: an abort, not an error
    deadline = time.monotonic() + 10
    while server.metric("mlaserve_requests_aborted_total") == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("mlaserve_requests_aborted_total") == aborted + 1
    assert errors(server.url) == after


def test_a_client_gone_mid_body_is_not_an_error(server: ServerProcess) -> None:
    """A client that closes its connection while sending the body never gets an answer: nothing is counted
    (the route's 400 for the cut body goes nowhere), and the server serves the next request as ever."""
    import socket

    before = errors(server.url)
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: " + AUTH["Authorization"].encode() + b"\r\nContent-Length: 3000\r\n\r\n"
                         b'{"prompt": "half a bo')
            time.sleep(0.2)
    time.sleep(0.5)
    resp = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60, json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200
    assert delta(before, errors(server.url)) == {}


def test_shutdown_refusals_count_and_health_does_not(model_dir: Path, tmp_path: Path) -> None:
    """While draining: a new request's 503 `shutting_down` counts once; `/health`'s 503 is not an error."""
    srv = _server(model_dir, tmp_path / "server.log", "--shutdown-timeout", "60")
    try:
        def check() -> None:
            before = errors(srv.url)
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                assert time.monotonic() < deadline, "still healthy 10 s after SIGTERM"
                time.sleep(0.05)
            assert httpx.get(srv.url + "/health", timeout=5).json()["error"]["code"] == "shutting_down"
            resp = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30, json={"prompt": "late"})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down", resp.text
            assert delta(before, errors(srv.url)) == {("shutting_down", "503"): 1}

        _while_held(srv.url, check)
    finally:
        assert srv.stop() == 0, srv.log()


def finished(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "mlaserve_request_success_total"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ending_in_the_last_allowed_token_is_counted_as_stop(server: ServerProcess, stream: bool):
    """The engine ends such a completion as "length", the client is told "stop" (the string matched):
    `mlaserve_request_success_total` counted "length" (a soak saw 10 of 924 stops so)."""
    body = {"prompt": "count: 1, 2, 3,", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    first = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]
    text = first["text"]
    assert first["finish_reason"] == "length" and len(text) > 1
    # the shortest end of the text found nowhere earlier: it matches only once the last token is out
    stop = next(text[-k:] for k in range(1, len(text) + 1)
                if text[-k:].strip() and text.find(text[-k:]) == len(text) - k)
    before = finished(server.url)
    r = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop], "stream": stream}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop), choice
    else:
        assert '"finish_reason":"stop"' in r.text.replace(" ", ""), r.text
    assert delta(before, finished(server.url)) == {"stop": 1}
