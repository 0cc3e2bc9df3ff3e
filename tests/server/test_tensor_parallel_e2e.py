"""`mlaserve serve --tp N` through the served API: the same greedy tokens and logprobs (fp32, within
1e-4) as one process for Llama and DeepSeek-V2/V3 synthetic checkpoints, also with --ep and over two
"nodes" on this machine; a killed rank (idle or mid-stream) makes requests fail quickly and /health
report it, and so does a rank that is stopped without dying (SIGSTOP); flags that cannot combine are refused
before anything starts."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from engine.ranks import BEAT_S
from models.synthetic import write_checkpoint
from tests.server.server_process import REPO, ServerProcess, alive, all_gone, child_pids, free_port

PROMPTS = ["The lighthouse keeper", "1 2 3 4 5 6", "def f(x):\n    return"]
FROZEN_S = 6.0  # --rank-timeout of the stopped-rank tests (15 s by default: the tests would wait that long)
# The soonest a stopped rank can be reported after the SIGSTOP: its last beat may precede the signal by a
# beat and a store round, and the watcher counts the stillness from that beat (engine.ranks.Heartbeat).
# A bound of FROZEN_S - 1 failed once in CI at 4.91 s.
EARLIEST_S = FROZEN_S - BEAT_S - 0.5
COMMON = ("--served-model-name", "m", "--dtype", "float32", "--max-total-tokens", "512", "--max-running-requests", "4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-serve")
    return {name: write_checkpoint(root / name, name, seed=41) for name in
            ("tiny-llama", "tiny-deepseek-v2", "tiny-deepseek-v3")}


def completions(url: str, max_tokens: int = 8) -> list[tuple[list[str], list[float]]]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for p in PROMPTS:
            r = c.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                "logprobs": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def healthy(c: httpx.Client) -> bool:
    """/health says 200; False once the engine is reported dead, or the server has exited with it."""
    try:
        return c.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def assert_refused(c: httpx.Client, server: ServerProcess) -> None:
    """A request to a server whose engine died fails: an error answer while it is still up, else the
    server has exited 1 (for its supervisor to restart it), as it does right after."""
    try:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert r.status_code >= 500 and "error" in r.json(), r.text
    except httpx.TransportError:
        pass
    assert server.proc.wait(30) == 1


def serve(model: Path, tmp_path: Path, tag: str, *args: str) -> ServerProcess:
    return ServerProcess(str(model), *COMMON, *args, log=tmp_path / f"{tag}.log").wait_ready(300)


@pytest.fixture(scope="module")
def one_process(checkpoints, tmp_path_factory) -> Callable[[str], list[tuple[list[str], list[float]]]]:
    """A checkpoint's completions served by one process (the torch forward, as the ranks run), each
    checkpoint served once for the module."""
    done: dict[str, list[tuple[list[str], list[float]]]] = {}

    def get(name: str) -> list[tuple[list[str], list[float]]]:
        if name not in done:
            one = serve(checkpoints[name], tmp_path_factory.mktemp(f"one-{name}"), "one", "--cpu-kernels", "torch")
            try:
                done[name] = completions(one.url)
            finally:
                one.stop()
        return done[name]

    return get


def assert_same(got: list[tuple[list[str], list[float]]], want: list[tuple[list[str], list[float]]]) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4, (lps, ref_lps)


# (four ranks: DeepSeek-V3's case here, Llama's in tests/executor/test_tensor_parallel.py's OmniKV cases)
CASES = [("tiny-llama", ("--tp", "2")), ("tiny-deepseek-v2", ("--tp", "2")),
         ("tiny-deepseek-v3", ("--tp", "2", "--ep", "2")), ("tiny-deepseek-v3", ("--tp", "4"))]


@pytest.mark.parametrize("name,flags", CASES, ids=[f"{n}-{'-'.join(f[1::2])}" for n, f in CASES])
def test_tp_serves_what_one_process_serves(checkpoints, one_process, tmp_path, name: str,
                                          flags: tuple[str, ...]) -> None:
    want = one_process(name)
    tp = serve(checkpoints[name], tmp_path, "tp", *flags)
    try:
        assert_same(completions(tp.url), want)
        port = int(re.search(r"rendezvous 127\.0\.0\.1:(\d+)", (tmp_path / "tp.log").read_text()).group(1))
        assert listening(port) == {"127.0.0.1"}  # the rank group's store is not open to the network
        followers = _followers(tp)
        assert len(followers) == int(flags[1]) - 1
    finally:
        assert tp.stop() == 0  # SIGTERM drains every rank
    assert all_gone(followers)
    assert f"rank {int(flags[1]) - 1} of {flags[1]} ready" in (tmp_path / "tp.log").read_text()


OMNIKV_CASES = [("tiny-llama", ("--tp", "2")), ("tiny-deepseek-v2", ("--tp", "2", "--omnikv-bank")),
                ("tiny-deepseek-v2", ("--dp", "2", "--dp-attention"))]


@pytest.mark.parametrize("name,flags", OMNIKV_CASES, ids=["llama-tp2", "deepseek-v2-tp2-bank", "deepseek-v2-dp-attention"])
def test_omnikv_split_over_ranks_serves_what_one_process_serves(checkpoints, tmp_path, name: str,
                                                                flags: tuple[str, ...]) -> None:
    """OmniKV under --tp (each rank its heads; the selection's max over heads taken by the ranks together,
    rank 0's config and rows sent to the others, a row's query window cleared on every rank when it changes
    hands) and under --dp-attention (each replica its own requests, every head): the greedy tokens and
    logprobs of one process with the same OmniKV config. One request at a time (--max-running-requests 1)
    reuses one row of the request table, so a follower that kept the previous request's window queries
    would select other tokens."""
    config = tmp_path / "omnikv.json"
    config.write_text(json.dumps({"filter_layers": [0], "budget_tokens": 2, "sink_tokens": 1, "recent_tokens": 2,
                                  "alpha": "exponential", "window": 4, "full_after_filter": False}))
    sparse = ("--omnikv", "on", "--omnikv-config", str(config), "--max-running-requests", "1")
    bank = ("--omnikv-bank",) if "--omnikv-bank" in flags else ()
    one = serve(checkpoints[name], tmp_path, "one", "--cpu-kernels", "torch", *sparse, *bank)
    try:
        want = completions(one.url, max_tokens=12)
        assert metric(one.url, "omnikv_sparse_tokens_total") > 0
        gathered = metric(one.url, "omnikv_bank_gathered_bytes_total")
    finally:
        one.stop()
    split = serve(checkpoints[name], tmp_path, "split", *flags, *sparse)
    try:
        assert_same(completions(split.url, max_tokens=12), want)
        assert metric(split.url, "omnikv_sparse_tokens_total") > 0
        # each rank banks and gathers its own (MLA: the whole latent rows): the metric counts them all
        assert metric(split.url, "omnikv_bank_gathered_bytes_total") == (2 * gathered if bank else 0)
        assert not bank or gathered > 0
    finally:
        assert split.stop() == 0


def metric(url: str, name: str) -> float:
    """The value of /metrics' series mlaserve_<name> (one series, with or without labels)."""
    metrics = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^mlaserve_{name}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.M)
    assert found is not None, metrics
    return float(found.group(1))


def listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP `port` on this machine (/proc/net/tcp, tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order 32-bit words
                out.add(str(ipaddress.ip_address(words)))
    return out


def _followers(server: ServerProcess) -> list[int]:
    """The engine's follower ranks: the `engine.ranks` processes under the server's children."""
    out = []
    for child in server.children():
        for pid in child_pids(child):
            if "engine.ranks" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                out.append(pid)
    return out


def _engines(server: ServerProcess) -> list[int]:
    """The server's engine processes (one per --dp replica): its spawned children."""
    return [p for p in server.children() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


def test_killed_rank_fails_requests_and_health(checkpoints, tmp_path) -> None:
    server = serve(checkpoints["tiny-llama"], tmp_path, "kill", "--tp", "2")
    try:
        assert len(completions(server.url)) == len(PROMPTS)
        followers = _followers(server)
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGKILL)
        t0 = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            try:
                r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
                assert r.status_code >= 500 or "error" in r.text
            except httpx.TransportError:  # the server already exited with its engine
                pass
            while healthy(c):
                assert time.monotonic() - t0 < 30, "the dead rank was not noticed"
                time.sleep(0.2)
            assert_refused(c, server)
        assert time.monotonic() - t0 < 60
    finally:
        server.stop()


def test_rank_killed_mid_stream_ends_the_stream_with_an_error(checkpoints, tmp_path) -> None:
    """A follower killed while a long request decodes: the stream ends with an error event within
    seconds (the step's collective fails, or the engine's watchdog ends the step it blocks), never
    hangs, and /health reports it."""
    server = serve(checkpoints["tiny-llama"], tmp_path, "killstream", "--tp", "2")
    try:
        followers = _followers(server)
        assert len(followers) == 1, followers
        body = {"model": "m", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            t0 = None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if t0 is None and len(events) == 8:  # decoding: kill the follower between two steps
                    os.kill(followers[0], signal.SIGKILL)
                    t0 = time.monotonic()
            assert t0 is not None, events[-3:]
            assert time.monotonic() - t0 < 15
            assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
            assert len(events) < 400
            # the engine's last words may follow the error by a moment
            while healthy(c):
                assert time.monotonic() - t0 < 15, "the dead rank was not noticed"
                time.sleep(0.1)
            assert_refused(c, server)
    finally:
        server.stop()


@pytest.mark.parametrize("when", ["mid-stream", "idle"])
def test_a_stopped_rank_is_reported_not_waited_for(checkpoints, tmp_path, when: str) -> None:
    """A follower stopped without dying (SIGSTOP: no connection closes, no collective fails) leaves rank 0
    waiting in its next broadcast for good. Its heartbeat standing still ends the engine after about
    --rank-timeout (FROZEN_S here): a running stream ends with an error naming the stopped rank, /health reports it, a new
    request fails at once, and the stopped rank is killed with the engine."""
    server = serve(checkpoints["tiny-llama"], tmp_path, f"stop-{when}", "--tp", "2", "--rank-timeout", str(FROZEN_S))
    follower = None
    try:
        followers = _followers(server)
        assert len(followers) == 1, followers
        follower = followers[0]
        limit = FROZEN_S + 10
        with httpx.Client(base_url=server.url, timeout=limit + 30) as c:
            if when == "mid-stream":
                body = {"model": "m", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
                events: list[str] = []
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    t0 = None
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                        if t0 is None and len(events) == 8:
                            os.kill(follower, signal.SIGSTOP)
                            t0 = time.monotonic()
                assert t0 is not None, events[-3:]
                assert EARLIEST_S <= time.monotonic() - t0 < limit
                assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
                assert "rank 1 stopped answering" in events[-2], events[-2]
            else:
                assert len(completions(server.url)) == len(PROMPTS)
                os.kill(follower, signal.SIGSTOP)
                t0 = time.monotonic()
            while healthy(c):
                assert time.monotonic() - t0 < limit, "the stopped rank was not noticed"
                time.sleep(0.2)
            assert time.monotonic() - t0 >= EARLIEST_S
            assert_refused(c, server)
        assert all_gone([follower], 10), "the stopped rank outlived the engine"
    finally:
        if follower is not None and alive(follower):
            os.kill(follower, signal.SIGKILL)
        server.stop()
    assert "rank 1 stopped answering" in (tmp_path / f"stop-{when}.log").read_text()


def test_two_nodes_on_one_machine(checkpoints, one_process, tmp_path) -> None:
    model = str(checkpoints["tiny-deepseek-v2"])
    want = one_process("tiny-deepseek-v2")
    port = free_port()
    node = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    other = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, *COMMON, *node,
                              "--node-rank", "1"], cwd=REPO, stdout=open(tmp_path / "node1.log", "wb"),
                             stderr=subprocess.STDOUT)
    try:
        head = serve(checkpoints["tiny-deepseek-v2"], tmp_path, "node0", *node, "--node-rank", "0")
        try:
            assert_same(completions(head.url), want)
            assert listening(port) == {"127.0.0.1"}  # an address given as an IP is the only one listened on
        finally:
            assert head.stop() == 0
        assert other.wait(60) == 0  # rank 0 told it to stop
    finally:
        if other.poll() is None:
            other.kill()
        assert not alive(other.pid) or other.wait(10) is not None


def test_nodes_started_with_other_settings_do_not_serve(checkpoints, tmp_path) -> None:
    """Node 1 started with another --dtype (its own command line, on its own machine): the ranks compare what
    they compute with once loaded, and node 0 fails to start naming the difference, node 1 exits 1. (A
    different --ep or model used to serve garbage; a different dtype, to fail at the first request.)"""
    model = str(checkpoints["tiny-deepseek-v2"])
    port = free_port()
    node = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    other = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, *COMMON, *node,
                              "--node-rank", "1", "--dtype", "bfloat16"], cwd=REPO,
                             stdout=open(tmp_path / "node1.log", "wb"), stderr=subprocess.STDOUT)
    head = None
    try:
        head = ServerProcess(model, *COMMON, *node, "--node-rank", "0", log=tmp_path / "node0.log")
        assert head.proc.wait(300) == 1
        assert other.wait(60) == 1
        says = "rank 1 differs from rank 0: "
        assert f"{says}norm weights" in (tmp_path / "node0.log").read_text()
        assert "weights dtype bfloat16 (rank 0: float32)" in (tmp_path / "node0.log").read_text()
        assert says in (tmp_path / "node1.log").read_text()
    finally:
        for p in (other, *((head.proc,) if head is not None else ())):
            if p.poll() is None:
                p.kill()


def test_a_worker_node_asked_to_stop_exits_0(checkpoints, tmp_path) -> None:
    """SIGTERM to `serve --node-rank 1` (here while it waits for node 0): its ranks are ended and it exits 0
    saying so, for its supervisor; it used to exit 1 without a word, as if it had crashed."""
    node = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    log = tmp_path / "node1.log"
    other = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model",
                              str(checkpoints["tiny-deepseek-v2"]), *COMMON, *node, "--node-rank", "1"], cwd=REPO,
                             stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "joining" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = child_pids(other.pid)
        other.send_signal(signal.SIGTERM)
        assert other.wait(60) == 0
        assert "node 1: stopped by SIGTERM; its ranks [1] were ended" in log.read_text()
        assert all_gone(ranks)
    finally:
        if other.poll() is None:
            other.kill()


@pytest.mark.parametrize("flags,message", [
    (["--tp", "3", "--nnodes", "2"], "must be a multiple of --nnodes"),
    (["--tp", "2", "--nnodes", "2"], "needs --master-port"),
    (["--node-rank", "1"], "must be below --nnodes"),
    (["--tp", "2", "--ep", "3"], "must be 1 or the --tp size"),
    (["--tp", "0"], "must be > 0"),
    (["--tp", "2", "--rank-timeout", "0"], "--rank-timeout"),
    (["--dp-attention"], "needs --dp N > 1"),
    (["--dp", "2", "--dp-attention", "--tp", "2"], "must be 1 (the MLP/MoE layers are split over the --dp"),
    (["--dp", "2", "--dp-attention", "--ep", "4"], "must be 1 or the --dp size (2) under --dp-attention"),
    # it used to start forking 100,000 engine processes
    (["--dp", "100000"], "--dp 100000 asks for more replicas than the"),
])
def test_bad_parallel_flags_are_refused(flags: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", *flags], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: --device cuda would serve")
@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--device", "cuda:1", "--dp", "2"]])
def test_cuda_without_a_gpu_is_one_line(flags: list[str]) -> None:
    """--device cuda where torch sees no GPU: one line before anything starts (it was a traceback from the
    engine process, exit 1)."""
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", *flags], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{flags[1]}: torch " in r.stderr and "sees no CUDA device" in r.stderr, r.stderr


@pytest.mark.parametrize("model,flags,message", [
    ("tiny-llama", ["--tp", "3"], "number of attention heads"),
    ("tiny-llama", ["--tp", "2", "--ep", "2"], "has none (a dense model)"),
    ("tiny-deepseek-v3", ["--dp", "3", "--dp-attention", "--ep", "3"], "is not divisible by the 3 ranks"),
])
def test_a_split_the_model_does_not_allow_is_refused_before_any_rank_starts(checkpoints, model: str, flags: list[str],
                                                                              message: str) -> None:
    """Read from the model's config before anything starts: one line, exit 2 (each rank used to load the
    model and fail with a traceback, the server then exiting 1)."""
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--model", str(checkpoints[model]), *flags],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bad_parallel_env_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "MLASERVE_TP": "two"})
    assert r.returncode == 2 and "MLASERVE_TP" in r.stderr


@pytest.mark.parametrize("flags", [("--dp", "2", "--dp-attention"), ("--dp", "2", "--dp-attention", "--ep", "2"),
                                   ("--dp", "2", "--dp-attention", "--ep", "2", "--expert-backend", "cpp")],
                         ids=["dp-attention", "dp-attention-ep", "dp-attention-ep-cpp"])  # (cpp: its pool took
# top_k experts a row only, and the all-to-all's one a pair crashed the engine on the first request)
def test_dp_attention_serves_what_one_process_serves(checkpoints, one_process, tmp_path,
                                                    flags: tuple[str, ...]) -> None:
    """Two replicas, each attention for its own requests, MLP/MoE split over both: the same tokens and
    logprobs as one process, whichever replica a prompt lands on (one of them is idle at times)."""
    want = one_process("tiny-deepseek-v2")
    dp = serve(checkpoints["tiny-deepseek-v2"], tmp_path, "dpa", *flags)
    try:
        with httpx.Client(base_url=dp.url, timeout=120) as c:  # concurrent: both replicas at once
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda p: c.post("/v1/completions", json={
                    "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                    "ignore_eos": True}), PROMPTS))
        replicas = set()
        for r in got:
            assert r.status_code == 200, r.text
            replicas.update(r.headers.get("x-mlaserve-replica", "").split(","))
        assert_same([(r.json()["choices"][0]["logprobs"]["tokens"], r.json()["choices"][0]["logprobs"]["token_logprobs"])
                     for r in got], want)
        assert replicas == {"0", "1"}, replicas  # both replicas served
        assert_same(completions(dp.url), want)  # one at a time: the other replica idles through each step
        port = int(re.search(r"rendezvous 127\.0\.0\.1:(\d+)", (tmp_path / "dpa.log").read_text()).group(1))
        assert listening(port) == {"127.0.0.1"}
    finally:
        assert dp.stop() == 0
    log = (tmp_path / "dpa.log").read_text()
    assert "DP attention: replica 1 of 2" in log and "crashed" not in log


def test_dp_attention_replica_death_is_reported(checkpoints, tmp_path) -> None:
    """The replicas step together: one killed, the other's next exchange fails, both are reported dead
    (health 503, requests fail) within seconds instead of hanging."""
    server = serve(checkpoints["tiny-deepseek-v2"], tmp_path, "dpkill", "--dp", "2", "--dp-attention")
    try:
        assert len(completions(server.url)) == len(PROMPTS)
        engines = _engines(server)
        assert len(engines) >= 2, engines
        os.kill(engines[0], signal.SIGKILL)
        t0 = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while healthy(c):
                assert time.monotonic() - t0 < 30, "the dead replica was not noticed"
                time.sleep(0.2)
            deadline = time.monotonic() + 30
            while True:  # the survivor fails at its next exchange: then nothing can serve (and the server exits)
                try:
                    r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
                except httpx.TransportError:
                    break
                if r.status_code != 200:
                    break
                assert time.monotonic() < deadline, "the surviving replica kept serving alone"
                time.sleep(0.2)
            assert_refused(c, server)
    finally:
        server.stop()


@pytest.mark.parametrize("stopped", [0, 1], ids=["replica-0-hosting-the-store", "replica-1"])
def test_dp_attention_stopped_replica_is_reported(checkpoints, tmp_path, stopped: int) -> None:
    """A replica stopped without dying (SIGSTOP) holds the other in their next exchange: the other sees its
    heartbeat stand still (or, replica 0 hosting the rendezvous store, the store stop answering) and
    reports it after about FROZEN_S, and the server then ends the stopped one too (the replicas run only
    together), so requests fail instead of hanging and no process is left."""
    server = serve(checkpoints["tiny-deepseek-v2"], tmp_path, "dpstop", "--dp", "2", "--dp-attention",
                   "--rank-timeout", str(FROZEN_S))
    engines: list[int] = []
    try:
        assert len(completions(server.url)) == len(PROMPTS)
        engines = _engines(server)
        assert len(engines) == 2, engines
        found = re.search(rf"engine-core\[(\d+)\] engine.ranks: DP attention: replica {stopped} of 2",
                          (tmp_path / "dpstop.log").read_text())
        assert found and int(found[1]) in engines, engines
        os.kill(int(found[1]), signal.SIGSTOP)
        t0 = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=FROZEN_S + 40) as c:
            while healthy(c):
                assert time.monotonic() - t0 < FROZEN_S + 10, "the stopped replica was not noticed"
                time.sleep(0.2)
            assert time.monotonic() - t0 >= EARLIEST_S
            assert all_gone(engines, 10), "a replica outlived the group"
            assert_refused(c, server)
    finally:
        for pid in engines:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        server.stop()
    log = (tmp_path / "dpstop.log").read_text()
    assert f"replica {stopped} stopped answering" in log and f"--dp-attention replica {1 - stopped} failed" in log, \
        log[-2000:]
