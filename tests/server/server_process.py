"""A real `mlaserve serve` process for tests: free port, waits for /health, stops on exit; and what a
test needs to see around it (its child processes, a metric)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # prctl(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the engine process and multiprocessing's resource tracker
    are the server's children)."""
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
    """Running (a zombie has ended: it only waits for its parent to collect it)."""
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


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies (Linux), so that a test run that is
    killed (a timeout, Ctrl-C) does not leave servers and their engines running for hours."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None, log: Path | None = None,
                 new_session: bool = False) -> None:
        """`new_session`: the server leads its own process group (and session), as a service manager or
        a terminal starts it, so a test can signal the whole group (`os.killpg(proc.pid, sig)`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, "--port", str(self.port),
               "--log-level", "info", *args]  # (tests read the engine's and ranks' lines)
        out = open(log, "wb") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=new_session,
                                     preexec_fn=_stop_with_parent)

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def children(self) -> list[int]:
        """The server's child processes now (the engine once it is spawned, the resource tracker)."""
        return child_pids(self.proc.pid)

    def metric(self, name: str) -> float:
        """The value of gauge/counter `name` (its one labelled series) on /metrics; 0 when absent."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill_group(self) -> None:
        """SIGKILL to the whole group of a `new_session` server, for what a failed test left running (the
        server, or an engine process that outlived it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left in the group
            pass
        self.proc.wait()


def seconds_per_token(srv: ServerProcess, requests: int, tokens: int = 64, **fields: object) -> float:
    """Wall time per decode step with `requests` completions decoding together, measured on this machine
    (so that a test can ask for work that lasts a given time, on a slow CPU as on a fast one). `fields`:
    more of the request's JSON (a served model name, say)."""
    def one() -> None:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "warm up", "max_tokens": tokens, "ignore_eos": True, "temperature": 0, **fields})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one) for _ in range(requests)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return (time.monotonic() - t0) / tokens


def serve_preset(tmp_path_factory, preset: str, chat_template: Path | None = None, seed: int = 3):
    """A module fixture's body (`yield from serve_preset(...)`): a synthetic `preset` checkpoint served, its
    tokenizer's chat template replaced by the file `chat_template` where one is given, stopped cleanly after."""
    import json

    from models.synthetic import write_checkpoint

    model = write_checkpoint(tmp_path_factory.mktemp(preset), preset, seed=seed)
    if chat_template is not None:
        cfg_path = model / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = chat_template.read_text()
        cfg_path.write_text(json.dumps(cfg))
    srv = ServerProcess(str(model), "--max-total-tokens", "8192", "--context-length", "2048",
                        log=tmp_path_factory.mktemp("log") / "server.log")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0


def openai_client(srv: ServerProcess) -> Any:
    """The OpenAI SDK's client of a served test model (no retries: a failure is the server's answer)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def regex_literal(text: str) -> str:
    """`text` as a regex of itself for `structured_outputs.regex` (the characters xgrammar's regexes treat as
    syntax escaped)."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else c for c in text)
