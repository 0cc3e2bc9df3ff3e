"""Admission through the real server: with --max-running-requests R and --max-queued-requests Q, of
many concurrent requests exactly R + Q are admitted (R run, Q wait) and the rest get 503 `overloaded`
with Retry-After, at once (once full, before the request is rendered and tokenized, but after its model
and sampling parameters are checked); a request for more completions (n, or prompts x n) than R + Q is
refused with 400 naming `n` (or `prompt`). What counts is what the engine holds, not what clients have
yet to read."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

EXTRA = 4  # requests beyond R + Q


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=12)


def long_stream(url: str, key: int, out: dict, release: threading.Event, tokens: set | None = None) -> None:
    """A long streamed completion: records its status (200 once admitted, 503 when refused), then in
    `tokens` its key once its first event came (it runs), and holds the connection until `release`
    (closing it aborts the request in the engine)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "prompt": f"request {key}", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as resp:
            out[key] = (resp.status_code, resp.headers.get("retry-after"),
                        resp.read().decode() if resp.status_code != 200 else "")
            if resp.status_code == 200:
                if tokens is not None:
                    lines = resp.iter_lines()  # (kept until released: closing it closes the connection)
                    while not next(lines).startswith("data: "):
                        pass
                    tokens.add(key)
                release.wait(120)
    except httpx.HTTPError as e:
        out[key] = (None, None, repr(e))


@pytest.mark.parametrize(("running", "queued"), [(1, 2), (2, 0), (4, 4)])
def test_exactly_running_plus_queued_are_admitted(model_dir, tmp_path, running, queued):
    srv = ServerProcess(str(model_dir), "--max-running-requests", str(running), "--max-queued-requests", str(queued),
                        "--context-length", "4096", log=tmp_path / "log").wait_ready()
    total = running + queued + EXTRA
    out: dict = {}
    tokens: set = set()
    release = threading.Event()
    threads = [threading.Thread(target=long_stream, args=(srv.url, i, out, release, tokens), daemon=True)
               for i in range(total)]
    try:
        for t in threads:
            t.start()
        # every request is answered at once: refusals, and the admitted streams' headers (the running ones
        # stream, the queued ones wait for a slot)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(out) >= total and len(tokens) >= running:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # no queued request may get a token while the running ones still run
        refused = [k for k, v in list(out.items()) if v[0] == 503]
        streaming = [k for k, v in list(out.items()) if v[0] == 200]
        assert len(streaming) == running + queued and len(refused) == total - running - queued, (out, srv.log())
        assert len(tokens) == running, "a queued request got tokens while nothing finished"
        assert (srv.metric("mlaserve_num_requests_running"), srv.metric("mlaserve_num_requests_waiting")) == (
            running, queued)
        for k in refused:
            status, retry_after, body = out[k]
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert retry_after and error["code"] == "overloaded", (retry_after, error)
            assert f"--max-queued-requests {queued}" in error["message"], error
            assert f"it holds {running + queued} completions" in error["message"], error
        # full, the server refuses before it tokenizes: a prompt past the context is not even read (it had
        # waited behind the rendering and tokenizing of every request before it, refused in the engine) ...
        resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": "word " * 5000, "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded", resp.text
        assert f"it holds {running + queued} completions" in resp.json()["error"]["message"], resp.text
        assert resp.headers.get("retry-after"), resp.headers
        model = httpx.get(srv.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        resp = httpx.post(srv.url + "/v1/messages", timeout=60, json={"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]})
        assert resp.status_code == 529 and resp.json()["error"]["type"] == "overloaded_error", resp.text
        # ... but a request retrying would not mend still gets its own error: a wrong model, a bad parameter,
        # ids outside the vocabulary, tools, a tool_choice or a history that cannot work
        resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": "x", "model": "nope"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "temperature": -1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature", resp.text
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}})
        assert resp.status_code == 400 and "response_format" in resp.json()["error"]["param"], resp.text
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for body, param in (({"prompt": [10 ** 9]}, "prompt"),
                            ({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
                            ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
                             "messages"),
                            ({"messages": [{"role": "user", "content": "x"}], "tools": [
                                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
                             "tools.[0].function.parameters"),
                            ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
                                "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
                                    "tags": {"type": "array", "uniqueItems": True}}}}}]},
                             "tools.[0].function.parameters")):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            resp = httpx.post(srv.url + path, timeout=60, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"].startswith(param), (body, resp.text)
        # more completions than the server ever holds: the client's mistake (400 naming n), not a retryable 503
        resp = httpx.post(srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "too many", "max_tokens": 2, "n": running + queued + 1})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "n" and "retry-after" not in resp.headers, resp.text
        assert f"n <= {running + queued}" in error["message"], error
        # so are more prompts x n than it ever holds, however each prompt's n fits
        resp = httpx.post(srv.url + "/v1/completions", timeout=60,
                          json={"prompt": ["a", "b"] * (running + queued), "max_tokens": 2})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "prompt" and "retry-after" not in resp.headers, resp.text
        assert f"at most {running + queued} at once" in error["message"], error
    finally:
        release.set()
        for t in threads:
            t.join(60)
        assert srv.stop() == 0, srv.log()


def test_a_context_longer_than_the_kv_cache_is_cut_to_it(model_dir, tmp_path):
    """--context-length above what the KV cache holds: the context is cut to the cache's slots (a longer
    request could never run to its end), so a prompt past it, or a prompt and max_tokens together past it,
    is the client's 400 `context_length_exceeded` naming the field the prompt came in (`prompt` or
    `messages`), instead of a 200 cut short when the cache runs out."""
    srv = ServerProcess(str(model_dir), "--max-total-tokens", "96", "--context-length", "4096",
                        log=tmp_path / "log").wait_ready()
    try:
        for path, body, field in (("/v1/completions", {"prompt": [5] * 150, "max_tokens": 2}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 150}],
                                                            "max_tokens": 2}, "messages"),
                                  ("/v1/completions", {"prompt": [5] * 60, "max_tokens": 60}, "prompt")):
            resp = httpx.post(srv.url + path, timeout=60, json=body)
            error = resp.json()["error"]
            assert resp.status_code == 400 and error["code"] == "context_length_exceeded", resp.text
            assert error["param"] == field and "maximum context length is 96 tokens" in error["message"], error
        assert httpx.get(srv.url + "/v1/models", timeout=60).json()["data"][0]["max_model_len"] == 96
        ok = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": [5] * 20, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        assert srv.stop() == 0, srv.log()
    assert "is cut to 96, the KV cache's slots" in srv.log_path.read_text()


def test_a_stream_of_several_prompts_starts_before_the_last_runs(model_dir, tmp_path):
    """Streamed prompts beyond --max-running-requests wait their turn: the stream starts once every prompt
    is admitted, and the first prompt's tokens come before the last prompt runs (it waited for every prompt's
    first token, so it said nothing until nearly all of the work was done). A client gone early leaves
    nothing running or queued."""
    srv = ServerProcess(str(model_dir), "--max-running-requests", "1", "--context-length", "4096",
                        log=tmp_path / "log").wait_ready()
    body = {"prompt": [f"prompt {i}" for i in range(4)], "max_tokens": 8, "stream": True, "ignore_eos": True,
            "temperature": 0}
    try:
        events = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.extend(json.loads(line[6:])["choices"])
        order = [(c["index"], c["finish_reason"]) for c in events]
        # one prompt runs at a time: prompt 0 ends before prompt 3 says anything
        assert order.index((0, "length")) < min(i for i, (index, _) in enumerate(order) if index == 3), order
        whole = httpx.post(srv.url + "/v1/completions", timeout=120, json={**body, "stream": False}).json()
        for choice in whole["choices"]:
            assert "".join(c["text"] for c in events if c["index"] == choice["index"]) == choice["text"]
        for cut_after in (0, 1):  # gone before any output, and after the first event
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                              json={**body, "max_tokens": 3000}) as resp:
                lines = resp.iter_lines()  # (kept: closing it closes the connection)
                if cut_after:  # the first event came while the other prompts still waited for prompt 0
                    assert next(lines).startswith("data: {")
                    assert (srv.metric("mlaserve_num_requests_running"), srv.metric("mlaserve_num_requests_waiting")) == (1, 3)
            deadline = time.monotonic() + 30
            while (srv.metric("mlaserve_num_requests_running"), srv.metric("mlaserve_num_requests_waiting")) != (0, 0):
                assert time.monotonic() < deadline, "requests left running after the client went away"
                time.sleep(0.1)
        assert httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": "after", "max_tokens": 2}).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log_path.read_text()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_queued_stream_gets_its_headers_once_admitted(model_dir, tmp_path, path):
    """A stream's status and headers go once the engine has admitted it, not with its first token: behind a
    long prefill or a queue the client (or a proxy waiting for the first bytes) heard nothing at all. A
    refusal still comes as an HTTP error, and what the first events tell (the prompt's cached tokens in
    Anthropic's message_start) is as before."""
    srv = ServerProcess(str(model_dir), "--max-running-requests", "1", "--context-length", "4096",
                        log=tmp_path / "log").wait_ready()
    out: dict = {}
    tokens: set = set()
    release = threading.Event()
    busy = threading.Thread(target=long_stream, args=(srv.url, 0, out, release, tokens), daemon=True)
    model = httpx.get(srv.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "stream": True, "temperature": 0}
    body |= {"prompt": "queued"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "queued"}]}
    try:
        busy.start()
        deadline = time.monotonic() + 60
        while 0 not in tokens:
            assert time.monotonic() < deadline, out
            time.sleep(0.05)
        with httpx.stream("POST", srv.url + path, timeout=httpx.Timeout(120, read=15), json=body) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers.get("x-request-id")
            assert (srv.metric("mlaserve_num_requests_running"), srv.metric("mlaserve_num_requests_waiting")) == (1, 1)
            release.set()  # the busy stream ends: the queued one runs
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        if path == "/v1/messages":
            assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
        else:
            assert lines[-1] == "data: [DONE]" and any(c.get("finish_reason") for e in events for c in e["choices"])
        refused = httpx.post(srv.url + path, timeout=60, json={**body, "max_tokens": 5000})  # past the context
        assert refused.status_code == 400, refused.text
    finally:
        release.set()
        busy.join(60)
        assert srv.stop() == 0, srv.log()


def test_a_slow_reader_does_not_hold_the_server_full(model_dir, tmp_path):
    """A client that stops reading a long stream holds its answer's events in the server, not a place in the
    engine: once the engine has ended that request, the next one is admitted (the front end's refusal, when
    it counted completions until their outputs were read, answered 503 with the engine idle, up to
    --write-timeout)."""
    srv = ServerProcess(str(model_dir), "--max-running-requests", "1", "--max-queued-requests", "0",
                        "--context-length", "4096", "--write-timeout", "120", log=tmp_path / "log").wait_ready()
    body = json.dumps({"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 3500,
                       "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    slow = socket.socket()
    try:
        # a small receive buffer, read no further than the headers: the answer's ~1.5 KB events fill it and
        # the server's send buffer (4 MiB at most here) long before the engine ends
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect((host, int(port)))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert slow.recv(1024).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 120
        while srv.metric("mlaserve_num_requests_running") != 0:
            assert time.monotonic() < deadline, "the engine did not end the request"
            time.sleep(0.1)
        resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": "next", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        received = bytearray()
        slow.settimeout(60)
        while chunk := slow.recv(1 << 20):  # (to the end: the server closes the connection after it)
            received += chunk
        assert b"data: [DONE]" in received[-100:] and b'"finish_reason":"length"' in received  # its whole answer
    finally:
        slow.close()
        assert srv.stop() == 0, srv.log()
