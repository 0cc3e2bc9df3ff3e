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


def test_fields_the_server_does_not_read_are_named_on_every_route(server):
    """A typo such as `stop_sequence` is ignored (a newer API's field must not break a client) but named in a
    warning, on every route: the routes whose body FastAPI validated (chat, completions, responses,
    detokenize) used to name none, only those that read their own body."""
    auth = {"Authorization": f"Bearer {KEY}"}
    user = [{"role": "user", "content": "hi"}]
    model = httpx.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
    routes = {"/v1/chat/completions": {"messages": user, "max_tokens": 2, "stop_sequence": ["x"]},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2, "zzz_typo_completions": 1},
              "/v1/responses": {"input": "hi", "max_output_tokens": 2, "frequency_penalty": 1},
              "/detokenize": {"tokens": [1, 2], "zzz_typo_detokenize": True},
              "/v1/messages": {"model": model, "messages": user, "max_tokens": 2, "stop_sequence": ["x"]},
              "/tokenize": {"prompt": "hi", "zzz_typo_tokenize": 0}}
    for path, body in routes.items():
        r = httpx.post(server.url + path, json=body, headers=auth, timeout=60)
        assert r.status_code == 200, (path, r.text)
    wanted = {"ChatCompletionRequest": "'stop_sequence'", "CompletionRequest": "'zzz_typo_completions'",
              "ResponsesRequest": "'frequency_penalty'", "DetokenizeRequest": "'zzz_typo_detokenize'",
              "MessagesRequest": "'stop_sequence'", "TokenizeCompletionRequest": "'zzz_typo_tokenize'"}
    deadline = time.monotonic() + 10
    while True:
        lines = [ln for ln in server.log_path.read_text(errors="replace").splitlines()
                 if "sent fields this server does not read" in ln]
        missing = {m: f for m, f in wanted.items() if not any(f"({m})" in ln and ln.endswith(f) for ln in lines)}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not missing, (missing, lines)
    assert " WARNING " in lines[0]


def test_a_client_that_leaves_in_the_middle_of_its_body_is_logged_499(server):
    """Its half body would answer 400, which never reaches it: the line says 499 (nginx's client closed)."""
    import socket

    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                  "x-request-id: left-midway\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n"
                  '{"model": '.encode())
        time.sleep(0.5)  # the handler is waiting on the rest
    assert re.search(r"POST /v1/completions 499 [0-9.]+ ms ", line_of(server, "left-midway"))


def test_a_request_that_is_not_http_is_one_line(server):
    """What the HTTP parser refuses is answered 400 `invalid_http` with one line of the server's own format (its
    id and client); uvicorn's own unformatted warning for it was a second line."""
    from tests.server.test_connection_deadlines import connect, read_all

    port = int(server.url.rsplit(":", 1)[1])
    before = server.log_path.read_text(errors="replace").count("Invalid HTTP request received")
    with connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n")
        raw, _ = read_all(s)
    assert raw.startswith(b"HTTP/1.1 400") and b'"invalid_http"' in raw, raw
    rid = re.search(rb"x-request-id: ([0-9a-f]{32})", raw).group(1).decode()
    assert "400" in line_of(server, rid) and "(invalid_http)" in line_of(server, rid)
    time.sleep(0.3)
    assert server.log_path.read_text(errors="replace").count("Invalid HTTP request received") == before
    # behind a request on the same connection, it cannot be answered: still one line, saying so
    before = server.log_path.read_text(errors="replace").count("(invalid_http, not answered")
    with connect(port) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nhost: x\r\n\r\nGARBAGE GARBAGE\r\n\r\n")
        raw, _ = read_all(s)
    assert raw.startswith(b"HTTP/1.1 200"), raw
    deadline = time.monotonic() + 10
    while server.log_path.read_text(errors="replace").count("(invalid_http, not answered") == before:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert "pipelined behind a request still being answered" in server.log_path.read_text(errors="replace")


def test_a_path_cannot_forge_a_log_line(server):
    """A path whose escapes decode to a newline (a forged line after it) or a terminal escape is written
    percent-quoted, as uvicorn's access log writes paths, and a long one cut; no key is needed to be logged."""
    forged = "2026-12-05 00:00:00,000 INFO mlaserve.server: POST /v1/admin 200 1.0 ms client=10.0.0.1 request_id=forged"
    path = "/v1/x%0A" + forged.replace(" ", "%20") + "%0A%1b[31m" + "y" * 500
    r = httpx.get(server.url + path, headers={"X-Request-Id": "forger"}, timeout=10)
    assert r.status_code in (401, 404)
    line = line_of(server, "forger")
    assert line.count("\n") == 0 and "\x1b" not in line and "/v1/x%0A2026-12-05%2000:00:00" in line, line
    assert "%1B%5B31myyyy" in line and "y" * 300 not in line and "y... " in line
    text = server.log_path.read_text(errors="replace")
    assert not any(ln.startswith("2026-12-05 00:00:00,000") for ln in text.splitlines())


def test_a_forwarded_for_header_cannot_forge_the_client_field(server):
    """uvicorn takes the client's address from X-Forwarded-For (a local proxy's): written quoted and cut, so a
    value with spaces cannot write the line's other fields (`client=9.9.9.9 401 0.1 ms request_id=forged`)."""
    r = httpx.get(server.url + "/version", headers={"X-Request-Id": "forwarder", "X-Forwarded-For":
                                                    "9.9.9.9 401 0.1 ms request_id=forged" + "z" * 500}, timeout=10)
    assert r.status_code == 200
    line = line_of(server, "forwarder")
    assert "request_id=forged" not in line.replace("%20request_id=forged", "") and "z" * 100 not in line, line


def test_a_body_that_stops_is_one_line_with_the_id_the_client_got(tmp_path):
    """--read-timeout past a body that stopped: the connection answers 408 and logs it with the request's
    own id (the one its answer carries); the handler's 499 for the same request is not a second line."""
    import socket

    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=2)
    srv = ServerProcess(str(model), "--read-timeout", "1.5", log=tmp_path / "server.log").wait_ready()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: stalled-body\r\n"
                      b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        assert raw.startswith(b"HTTP/1.1 408") and b"x-request-id: stalled-body" in raw, raw
        line = line_of(srv, "stalled-body")
        assert "POST /v1/completions 408" in line and "(request_timeout)" in line, line
    finally:
        assert srv.stop() == 0


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


@pytest.mark.parametrize("broken", ["default", "tool_use"])
def test_a_model_chat_template_that_does_not_compile_is_warned_of_at_start(tmp_path, broken):
    """The model's own template broken (`{% if %}`): the server starts (completions work), and its log says at
    start that chat requests will get a 400, instead of the first chat request being the first sign; so for
    a named `tool_use` template, which renders the requests with tools."""
    import json

    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=2, num_layers=1)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    templates = "{% if %}" if broken == "default" else [
        {"name": "default", "template": "{{ messages[0]['content'] }}"}, {"name": "tool_use", "template": "{% if %}"}]
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": templates}))
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    srv = ServerProcess(str(model), log=tmp_path / "server.log").wait_ready()
    try:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).is_success
        tools = [] if broken == "default" else [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        chat = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2, "tools": tools or None}, timeout=60)
        assert chat.status_code == 400 and "does not compile" in chat.json()["error"]["message"], chat.text
    finally:
        assert srv.stop() == 0
    warning = next((ln for ln in srv.log_path.read_text().splitlines() if "WARNING" in ln and "chat template" in ln), "")
    named = "" if broken == "default" else "'tool_use' "
    assert f"the model's {named}chat template does not compile" in warning and "--chat-template" in warning, srv.log()
