"""One log line per request, and the request id: a client's `X-Request-Id` comes back in `x-request-id`
(a new id where it sends none, or one that does not read as an id) and names the request's line in the
server's log, with its method, path, status and time; the prompt never reaches the log."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

KEY = "log-key"
SECRET = "the launch code is 0000"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=2)
    srv = ServerProcess(str(model), "--log-level", "info", "--api-key", KEY,
                        log=tmp_path_factory.mktemp("log") / "server.log")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0


def line_of(server: ServerProcess, rid: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in server.log_path.read_text(errors="replace").splitlines() if f"request_id={rid}" in line]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no log line for {rid}: {server.log()}")


def test_each_request_is_logged_once_with_its_id(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={**auth, "X-Request-Id": "client-42"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    assert re.search(r"POST /v1/chat/completions 200 [0-9.]+ ms client=127\.0\.0\.1:\d+ request_id=client-42$",
                     line_of(server, "client-42"))
    with httpx.stream("POST", server.url + "/v1/completions", headers=auth, timeout=60,
                      json={"prompt": SECRET, "max_tokens": 4, "stream": True}) as s:
        rid = s.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)  # made up: the client sent none
        assert "[DONE]" in "".join(s.iter_text())
    assert " /v1/completions 200 " in line_of(server, rid)
    bad = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "x y;<b>"}, timeout=60)
    assert bad.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    assert " 401 " in line_of(server, bad.headers["x-request-id"])
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.headers["x-request-id"]
    time.sleep(0.5)
    text = server.log_path.read_text(errors="replace")
    assert f"request_id={health.headers['x-request-id']}" not in text  # probes: debug level only
    assert SECRET not in text


def test_a_client_that_leaves_in_the_middle_of_its_body_is_logged_499(server):
    """Its half body would answer 400, which never reaches it: the line says 499 (nginx's client closed)."""
    import socket

    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                  "x-request-id: left-midway\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n"
                  '{"model": '.encode())
        time.sleep(0.5)  # the handler is waiting on the rest
    assert re.search(r"POST /v1/completions 499 [0-9.]+ ms ", line_of(server, "left-midway"))


def test_log_level_reaches_the_engine_process(server, tmp_path):
    """--log-level set the server's logging only: the engine process logged at INFO whatever it said (six
    lines at `--log-level error`). At info (the module's server) its lines show; at warning they do not."""
    engine_info = re.compile(r" INFO engine-core\[\d+\] ")
    assert engine_info.search(server.log_path.read_text(errors="replace")), server.log()
    model = write_checkpoint(tmp_path / "tinyllama", "tiny-llama", seed=2)
    quiet = ServerProcess(str(model), "--log-level", "warning", log=tmp_path / "quiet.log").wait_ready()
    try:
        assert httpx.post(quiet.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).is_success
    finally:
        assert quiet.stop() == 0
    text = quiet.log_path.read_text(errors="replace")
    assert not engine_info.search(text) and " INFO " not in text, text
