"""A served request on a CPU shared with another busy process: how much slower than on a quiet machine,
under each wait policy of torch's OpenMP threads.

Servers run the same model side by side (idle, an engine polls its pipe twice a second), one per
wait policy (`POLICIES`: mlaserve's default, libgomp's own spin-then-sleep, passive, short spins). Each round times one greedy completion of `--tokens` tokens on each
server quiet, then with a competing `yes > /dev/null`; rounds are interleaved so machine noise hits
every policy alike. Reported: medians, the slowdown under contention, and each policy's cost when
quiet against libgomp's default.

    .venv/bin/python bench/cpu_contention.py [--model smollm2-135m-instruct] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the environment of each server's engine: {} -> mlaserve's default (engine.client.set_cpu_wait_policy)
POLICIES: dict[str, dict[str, str]] = {
    "default": {},
    "spin": {"OMP_WAIT_POLICY": ""},  # libgomp's own: ~300k spins, then sleep
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-10k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "10000"},
    "spin-100k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "100000"},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, policy: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(policy)
    proc = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not get ready in 300 s")


def timed_request(url: str, tokens: int) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True})
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == tokens
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--out", default=str(RESULTS / "cpu_contention.json"))
    args = ap.parse_args()

    servers = {name: start_server(args.model, POLICIES[name]) for name in args.policies}
    times: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name in servers}
    try:
        for _, url in servers.values():
            timed_request(url, 8)  # warm-up
        for r in range(args.rounds):
            for name, (_, url) in servers.items():
                times[name]["quiet"].append(timed_request(url, args.tokens))
                busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
                try:
                    time.sleep(0.2)
                    times[name]["busy"].append(timed_request(url, args.tokens))
                finally:
                    busy.kill()
                    busy.wait()
                print(f"round {r + 1}: {name:8s} quiet {times[name]['quiet'][-1]:6.2f} s, "
                      f"busy {times[name]['busy'][-1]:6.2f} s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)

    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    result = {
        "benchmark": "cpu_contention", "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "competitor": "one `yes > /dev/null` process",
        "seconds": times, "median_s": med,
        "slowdown_busy_vs_quiet": {name: m["busy"] / m["quiet"] for name, m in med.items()},
        "quiet_cost_vs_spin": {name: m["quiet"] / med["spin"]["quiet"] - 1.0 for name, m in med.items()}
        if "spin" in med else None,
        "policies": {name: POLICIES[name] for name in med},
        "targets": {"slowdown_busy_vs_quiet": 2.5, "quiet_cost_vs_spin": 0.05},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, m in med.items():
        print(f"{name:8s} quiet {m['quiet']:6.2f} s  busy {m['busy']:6.2f} s  "
              f"slowdown {m['busy'] / m['quiet']:5.1f}x")
    for name, cost in (result["quiet_cost_vs_spin"] or {}).items():
        print(f"{name:10s} quiet cost vs spin: {100 * cost:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
