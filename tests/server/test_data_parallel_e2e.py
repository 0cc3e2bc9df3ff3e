"""`mlaserve serve --dp 2` through the served API: two engine processes behind one server give the same
greedy tokens and logprobs as one engine; prompts sharing a long prefix go to one replica (and hit its
prefix cache) while unrelated prompts spread over both; a replica killed mid-stream fails only its own
requests, /health says so within seconds, new requests go to the live replica; SIGTERM drains both and
exits 0 with no engine process left."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess, all_gone, alive, seconds_per_token

COMMON = ("--served-model-name", "m", "--dtype", "float32", "--cpu-kernels", "torch", "--max-total-tokens", "512",
          "--max-running-requests", "4")
PROMPTS = ["The lighthouse keeper", "1 2 3 4 5 6", "def f(x):\n    return", "Once upon a time", "Dear diary,",
           "SELECT * FROM"]
REPLICA = "x-mlaserve-replica"
VOCAB = 49152  # tiny-llama's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dp-serve"), "tiny-llama", seed=23)


def serve(model: Path, log: Path, *args: str) -> ServerProcess:
    return ServerProcess(str(model), *COMMON, *args, log=log).wait_ready(300)


@pytest.fixture(scope="module")
def dp2(model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp("log") / "dp2.log", "--dp", "2")
    yield srv
    engines = engine_pids(srv)
    assert srv.stop() == 0, srv.log()
    assert all_gone(engines), "an engine replica outlived the server"


def engine_pids(server: ServerProcess) -> list[int]:
    """The server's engine processes (its multiprocessing-spawned children; not the resource tracker)."""
    out = []
    for pid in server.children():
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                out.append(pid)
        except OSError:
            pass
    return sorted(out)


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid`, in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def complete(url: str, prompt: str | list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


def greedy(url: str) -> tuple[list[tuple[list[str], list[float]]], list[str | None]]:
    """Tokens and logprobs of each prompt, and the replica header of each response."""
    out, replicas = [], []
    for p in PROMPTS:
        r = complete(url, p, logprobs=2)
        lp = r.json()["choices"][0]["logprobs"]
        out.append((lp["tokens"], lp["token_logprobs"]))
        replicas.append(r.headers.get(REPLICA))
    return out, replicas


def metric_series(server: ServerProcess, name: str) -> dict[str, float]:
    """{label text: value} of every series of `name` on /metrics."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_dp2_serves_what_one_engine_serves(model_dir, dp2, tmp_path) -> None:
    one = serve(model_dir, tmp_path / "dp1.log")
    try:
        want, headers = greedy(one.url)
        assert headers == [None] * len(PROMPTS)  # one engine: the response is as it always was
        assert one.metric("mlaserve_dp_replicas") == 1
    finally:
        assert one.stop() == 0
    engines = engine_pids(dp2)
    assert len(engines) == 2, engines  # two engine processes, each with the model
    if len(os.sched_getaffinity(0)) >= 2:  # each on its own share of the cores
        shares = [os.sched_getaffinity(pid) for pid in engines]
        assert all(shares) and not shares[0] & shares[1], shares
    before = [cpu_ticks(pid) for pid in engines]
    got, replicas = greedy(dp2.url)
    after = [cpu_ticks(pid) for pid in engines]
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4, (lps, ref_lps)
    assert set(replicas) == {"0", "1"}, replicas  # unrelated prompts, one after another: both replicas
    assert all(b > a for a, b in zip(before, after)), (before, after)  # and both processes computed
    assert dp2.metric("mlaserve_dp_replicas") == 2
    routed = metric_series(dp2, "mlaserve_dp_replica_requests_total")
    assert len(routed) == 2 and all(v >= 1 for v in routed.values()), routed


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(dp2) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(300)]
    homes, cached = set(), []
    for _ in range(4):
        r = complete(dp2.url, prefix + [rng.randrange(3, VOCAB) for _ in range(12)], max_tokens=4)
        homes.add(r.headers[REPLICA])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(homes) == 1, homes
    assert all(c >= 256 for c in cached[1:]), cached  # the replica that had the prefix served it
    others = {complete(dp2.url, [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 200))],
                       max_tokens=2).headers[REPLICA] for _ in range(6)}
    assert others == {"0", "1"}, others
    # a multi-prompt request: one header value per prompt, in order
    r = complete(dp2.url, [prefix + [5], [7, 8, 9]], max_tokens=2)
    assert r.headers[REPLICA].split(",")[0] in homes and len(r.headers[REPLICA].split(",")) == 2


def stream(url: str, prompt: str, max_tokens: int, out: dict, key: str, started: threading.Event) -> None:
    """A streamed completion: records its replica header and data lines."""
    lines: list[str] = []
    out[key] = lines
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}) as resp:
            out[key + "_replica"] = resp.headers.get(REPLICA)
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.HTTPError as e:
        out[key + "_error"] = repr(e)
        started.set()


def finish_reason(lines: list[str]) -> str | None:
    """The stream's finish reason; None if it has none (an error event ended it)."""
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    if any("error" in e for e in events):
        return None
    return next((c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")), None)


def two_streams(server: ServerProcess, max_tokens: int) -> tuple[list[threading.Thread], dict]:
    """Two long streams, one on each replica, both producing tokens when this returns."""
    out: dict = {}
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=stream, args=(server.url, p, max_tokens, out, k, e), daemon=True)
               for p, k, e in (("A lighthouse", "a", events[0]), ("Zebras graze at dusk", "b", events[1]))]
    for t in threads:
        t.start()
        time.sleep(0.3)  # in order, so that the second one sees the first one's load
    assert all(e.wait(120) for e in events), (out, server.log())
    assert {out["a_replica"], out["b_replica"]} == {"0", "1"}, out
    return threads, out


def test_a_killed_replica_fails_its_requests_health_503_and_the_other_serves(model_dir, tmp_path) -> None:
    # room for streams sized on this machine: a fixed 480 tokens ran out before the kill on a fast CPU
    server = serve(model_dir, tmp_path / "kill.log", "--dp", "2", "--max-total-tokens", "8192")
    try:
        engines = engine_pids(server)
        assert len(engines) == 2
        seconds_per_token(server, 1, model="m")  # the first measurement pays start-up costs
        tokens = min(8000, max(480, int(3.0 / seconds_per_token(server, 1, 128, model="m"))))
        threads, out = two_streams(server, tokens)
        os.kill(engines[0], signal.SIGKILL)
        t0 = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while (health := c.get("/health")).status_code == 200:
                assert time.monotonic() - t0 < 5, "the dead replica was not noticed"
                time.sleep(0.05)
            assert health.status_code == 503
            err = health.json()["error"]
            assert err["code"] == "engine_dead" and "1 of 2 engine replicas are not running" in err["message"], err
            dead = err["message"].split("replica ")[1][0]  # "... (replica K: why) ..."
            live = {"0": "1", "1": "0"}[dead]
            for t in threads:  # neither hangs: the dead one's stream ends with the engine's error
                t.join(60)
                assert not t.is_alive()
            by_replica = {out["a_replica"]: out["a"], out["b_replica"]: out["b"]}
            failed = by_replica[dead]
            assert '"engine_error"' in failed[-2] and failed[-1] == "data: [DONE]", failed[-3:]
            assert by_replica[live][-1] == "data: [DONE]" and finish_reason(by_replica[live]) == "length"
            for i in range(4):  # new requests, related or not, go to the live replica and are served
                r = c.post("/v1/completions", json={"model": "m", "prompt": f"A lighthouse {i}", "max_tokens": 3})
                assert r.status_code == 200 and r.headers[REPLICA] == live, r.text
            assert c.get("/health").status_code == 503  # still not healthy
        assert server.metric("mlaserve_dp_replicas") == 1
        # the failed stream is an error (counted as one, status 200), not an abort: no client left early
        assert server.metric("mlaserve_requests_aborted_total") == 0
        assert time.monotonic() - t0 < 60
    finally:
        engines = engine_pids(server)
        assert server.stop() == 0, server.log()
        assert all_gone(engines)
    # the killed replica left no semaphore behind (tqdm's multiprocessing lock: "resource_tracker: There
    # appear to be 1 leaked semaphore objects" at exit, and a file in /dev/shm)
    assert "leaked semaphore" not in server.log(), server.log()


def test_sigterm_drains_both_replicas_and_exits_0(model_dir, tmp_path) -> None:
    server = serve(model_dir, tmp_path / "term.log", "--dp", "2", "--shutdown-timeout", "120")
    engines = engine_pids(server)
    assert len(engines) == 2
    threads, out = two_streams(server, 300)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    for key in ("a", "b"):  # both replicas' streams finished in full
        assert out[key][-1] == "data: [DONE]" and finish_reason(out[key]) == "length", out[key][-3:]
    assert server.proc.wait(60) == 0, server.log()
    assert all_gone(engines), "an engine replica outlived the server"


def test_a_stream_one_of_whose_prompts_a_full_replica_refuses_is_an_http_error(model_dir, tmp_path) -> None:
    """A request's prompts may go to different replicas, which answer apart: a stream one of whose prompts a
    full replica refused began (200, the refusal an error event, no Retry-After) whenever the other
    replica's answer came first, about half the time. Its client needs the 503 to retry."""
    server = serve(model_dir, tmp_path / "full.log", "--dp", "2", "--max-running-requests", "1",
                   "--max-queued-requests", "1", "--max-total-tokens", "8192", "--shutdown-timeout", "1")
    out: dict = {}
    events = [threading.Event(), threading.Event()]
    # one replica full: a running and a queued stream, the same prompt (its home replica takes both)
    threads = [threading.Thread(target=stream, args=(server.url, "Once upon a time", 8000, out, k, e), daemon=True)
               for k, e in (("a", events[0]), ("b", events[1]))]
    try:
        for t in threads:
            t.start()
            time.sleep(0.3)
        assert events[0].wait(120), (out, server.log())
        for _ in range(6):  # one prompt goes to the free replica, the other is refused by a full one
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True})
            assert r.status_code == 503 and r.headers.get("retry-after"), r.text
            assert r.json()["error"]["code"] == "overloaded", r.text
    finally:
        assert server.stop() == 0, server.log()
        for t in threads:
            t.join(60)
