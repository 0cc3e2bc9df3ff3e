"""Server lifecycle against real processes: SIGTERM drain, a full queue, a dying engine, env-var config,
and the built-in default model answering through the OpenAI SDK."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess, free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=8)


def stream_completion(url: str, max_tokens: int, out: dict, key: str,
                      started: threading.Event | None = None) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": "Tell a long story", "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True}) as resp:
            lines = out[key] = []
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    if started is not None:
                        started.set()
    except httpx.HTTPError as e:
        out[key + "_error"] = e


def test_sigterm_drains_in_flight_then_exits_0(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), "--shutdown-timeout", "300", "--context-length", "4096",
                        log=tmp_path / "log").wait_ready()
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=stream_completion, args=(srv.url, 800, out, "a", started))
    t.start()
    assert started.wait(60)  # the stream is running
    pooled = httpx.Client(base_url=srv.url, timeout=60)  # a client's kept-alive connection, opened before
    assert "close" not in pooled.get("/v1/models").headers.get("connection", "")
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(srv.url + "/health").status_code == 503  # still listening, not admitting
    # every answer while draining closes its connection: a pooled client's retries of the 503 reconnect
    # (to a ready server, behind a load balancer) instead of coming back here
    refused = pooled.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["connection"] == "close"
    assert pooled.get("/metrics").headers["connection"] == "close"
    pooled.close()
    t.join(300)
    assert out["a"][-1] == "data: [DONE]"  # the in-flight request finished in full
    assert srv.proc.wait(60) == 0, srv.log()


def waiting(srv) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith("mlaserve_num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_full_queue_gets_503_with_retry_after(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), "--max-running-requests", "1", "--max-queued-requests", "1",
                        "--context-length", "4096", log=tmp_path / "log").wait_ready()
    try:
        out: dict = {}
        started = threading.Event()
        threads = [threading.Thread(target=stream_completion, args=(srv.url, 1500, out, "a", started)),
                   threading.Thread(target=stream_completion, args=(srv.url, 1500, out, "b"))]
        threads[0].start()
        assert started.wait(60)  # "a" runs (the only running slot)
        threads[1].start()
        deadline = time.monotonic() + 30
        while waiting(srv) < 1 and time.monotonic() < deadline:  # "b" waits in the engine's queue
            time.sleep(0.1)
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.headers.get("retry-after") and resp.json()["error"]["code"] == "overloaded"
    finally:
        srv.stop()
        for th in threads:
            th.join(30)


def test_engine_death_fails_fast_then_the_server_exits_1(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), "--context-length", "4096", log=tmp_path / "log").wait_ready()
    try:
        out: dict = {}
        started = threading.Event()
        t = threading.Thread(target=stream_completion, args=(srv.url, 3000, out, "a", started))
        t.start()
        assert started.wait(60)
        engine_pids = [int(p) for p in os.popen(f"pgrep -P {srv.proc.pid}").read().split()]
        assert engine_pids, "no engine child process"
        for pid in engine_pids:
            os.kill(pid, signal.SIGKILL)
        t.join(15)
        assert not t.is_alive()  # the stream did not hang
        lines = out["a"]
        assert any('"error"' in line for line in lines), lines[-3:]
        # then the server exits 1, for its supervisor (Docker's restart policy, systemd) to start a new one
        assert srv.proc.wait(30) == 1
        assert "the engine is gone" in srv.log()
    finally:
        srv.stop()


def test_env_vars_configure_the_server(model_dir, tmp_path):
    srv = ServerProcess(str(model_dir), env={"MLASERVE_SERVED_MODEL_NAME": "from-env", "MLASERVE_API_KEY": "k1",
                                             "MLASERVE_CONTEXT_LENGTH": "256", "MLASERVE_READ_TIMEOUT": "1.5"},
                       log=tmp_path / "log").wait_ready()
    try:
        models = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k1"}).json()
        assert models["data"][0]["id"] == "from-env" and models["data"][0]["max_model_len"] == 256
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as idle:  # --read-timeout 1.5
            t0, raw = time.monotonic(), b""
            idle.sendall(b"POST /v1/models HTTP/1.1\r\n")  # a request begun, its headers never done
            while chunk := idle.recv(4096):
                raw += chunk
        assert raw.startswith(b"HTTP/1.1 408") and b"request_timeout" in raw and time.monotonic() - t0 < 10
    finally:
        srv.stop()


def test_default_gguf_model_chats(tmp_path):
    srv = ServerProcess("smollm2-135m-instruct", "--dtype", "float32", "--max-total-tokens", "4096",
                        log=tmp_path / "log").wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        # (not the capital of France: a near-tie that 8-bit activations, ours and llama.cpp's alike, answer in
        # French; see tests/models/test_default_model.py)
        r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is photosynthesis?"}])
        text = r.choices[0].message.content.lower()
        assert "plant" in text or "light" in text, text
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        assert srv.stop() == 0


def test_a_port_in_use_is_one_line_before_the_model_loads(model_dir):
    """uvicorn's own answer came after the model loaded: two log lines without the flag to change."""
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "mlaserve", "serve", "--model", str(model_dir), "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("mlaserve serve: error: cannot listen on 127.0.0.1 port") and "--port" in line, proc.stderr


def test_a_rendezvous_port_in_use_or_shared_with_http_is_one_line(model_dir):
    """--master-port taken (or --port itself) failed in rank 0 after uvicorn bound: two tracebacks, exit 1."""
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for extra, want in ((["--master-port", str(taken)], "cannot listen for the ranks' rendezvous on 127.0.0.1 port"),
                            (["--port", "8391", "--master-port", "8391"], "--master-port 8391 is the HTTP --port")):
            proc = subprocess.run([sys.executable, "-m", "mlaserve", "serve", "--model", str(model_dir), "--tp", "2",
                                   *extra], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and want in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_a_host_that_is_not_this_machines_is_one_line_before_the_model_loads(model_dir):
    """An address of no interface here (TEST-NET-1): uvicorn's two lines and exit 3 after the model loaded."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlaserve", "serve", "--model", str(model_dir), "--host",
                           "192.0.2.1", "--port", "8000"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert len(proc.stderr.strip().splitlines()) == 1 and line.startswith(
        "mlaserve serve: error: cannot listen on 192.0.2.1 port 8000") and "no interface" in line, proc.stderr


@pytest.mark.parametrize("parallel", [[], ["--dp", "2"], ["--tp", "2"]], ids=["one", "dp", "tp"])
def test_a_model_refused_as_it_loads_exits_2_in_one_line(model_dir, tmp_path, parallel):
    """Weights the loader refuses only as it reads them (a tensor of the wrong shape, past the checks before the
    bind) stop the server with exit 2, as a bad flag: the model is at fault, and exit 1 ("restart me") would
    have a supervisor restart a broken file forever. Under --tp the ranks' failure was a RuntimeError, exit 1,
    with a traceback."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    model = tmp_path / "cut"
    model.mkdir()
    for f in model_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(model / "model.safetensors"))
    proc = subprocess.run([sys.executable, "-m", "mlaserve", "serve", "--model", str(model), "--port",
                           str(free_port()), *parallel], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
