"""Shutdown as service managers and terminals do it: a signal to the whole process group.

`kill -TERM -- -<pgid>` (systemd's KillMode=control-group, `docker stop` through an init that forwards
to the group) and Ctrl-C (SIGINT to the foreground group) reach the engine process too. The engine
process ignores them; the server drains: new work gets 503 with Retry-After, running requests finish
(or, past --shutdown-timeout, end with a `shutting_down` error), then the engine stops and the server
exits 0. A second signal exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

STREAMS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=11)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the engine process is the server's child)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def all_gone(pids: list[int], seconds: float = 10) -> bool:
    """Whether every process in `pids` has ended within `seconds` (children notice their parent's exit
    through their pipe, a moment after it)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def stream(url: str, max_tokens: int, out: dict, key: int, started: threading.Event) -> None:
    """One streamed completion; records its data lines (JSON-decoded, "[DONE]" as is)."""
    lines: list = []
    out[key] = lines
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "prompt": f"story number {key}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}) as resp:
            out[f"status{key}"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    lines.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except httpx.HTTPError as e:
        out[f"error{key}"] = repr(e)


def start_streams(srv: ServerProcess, max_tokens: int) -> tuple[list[threading.Thread], dict]:
    out: dict = {}
    events = [threading.Event() for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(srv.url, max_tokens, out, i, events[i]), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(120), f"a stream did not start: {out}\n{srv.log()}"
    return threads, out


def finish_reason(lines: list) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in lines if isinstance(c, dict) and c.get("choices")]
    return next((r for r in reversed(reasons) if r), None)


def completion_tokens(lines: list) -> int | None:
    usage = [c["usage"] for c in lines if isinstance(c, dict) and c.get("usage")]
    return usage[-1]["completion_tokens"] if usage else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_group_signal_lets_running_streams_finish_then_exits_0(model_dir, tmp_path, sig):
    max_tokens = 400
    srv = ServerProcess(str(model_dir), "--shutdown-timeout", "120", "--context-length", "2048",
                        "--max-running-requests", "8", log=tmp_path / "log", new_session=True).wait_ready()
    engines = child_pids(srv.proc.pid)
    try:
        threads, out = start_streams(srv, max_tokens)
        os.killpg(srv.proc.pid, sig)  # the server, the engine process, everything in the group
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                late = httpx.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
            except httpx.TransportError:  # already stopped listening: refused is also right
                late = None
                break
            if late.status_code == 503:
                break
            time.sleep(0.05)
        if late is not None:
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "shutting_down" and late.headers.get("retry-after")
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        for t in threads:
            t.join(180)
        for i in range(STREAMS):
            lines = out[i]
            assert f"error{i}" not in out and out[f"status{i}"] == 200, (out.get(f"error{i}"), srv.log())
            assert lines[-1] == "[DONE]", lines[-3:]
            assert finish_reason(lines) == "length" and completion_tokens(lines) == max_tokens, lines[-3:]
        assert srv.proc.wait(60) == 0, srv.log()
        assert engines and all_gone(engines), "the engine process outlived the server"
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)


def test_requests_past_the_shutdown_timeout_end_with_an_error(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), "--shutdown-timeout", "1", "--context-length", "8192",
                        "--max-running-requests", "8", log=tmp_path / "log", new_session=True).wait_ready()
    try:
        threads, out = start_streams(srv, 8000)  # far more than a second's work
        t0 = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0, srv.log()
        assert time.monotonic() - t0 < 30
        for i in range(STREAMS):
            lines = out[i]
            errors = [c["error"] for c in lines if isinstance(c, dict) and "error" in c]
            assert errors and errors[-1]["code"] == "shutting_down", lines[-3:]
            assert "--shutdown-timeout" in errors[-1]["message"]
            assert finish_reason(lines) is None  # cut short, not reported as finished
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)


def test_a_second_signal_exits_at_once(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), "--shutdown-timeout", "300", "--context-length", "8192",
                        "--max-running-requests", "8", log=tmp_path / "log", new_session=True).wait_ready()
    engines = child_pids(srv.proc.pid)
    try:
        threads, out = start_streams(srv, 8000)
        os.killpg(srv.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # the first signal drains (for up to 300 s)
        t0 = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGINT)
        srv.proc.wait(20)
        assert time.monotonic() - t0 < 15, "a second Ctrl-C must not wait for the drain"
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client stream hangs after the server exited"
        assert engines and all_gone(engines), "the engine process outlived the server"
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
