"""Where a served request's time goes on the CPU: the model forward against everything else (HTTP,
tokenizing, the engine pipe, scheduling, sampling, detokenizing, SSE), at one stream.

`mlaserve serve` (the default model unless `--model`) gets one streaming, greedy completion of
`--max-tokens` tokens per round, EOS ignored. The engine's own counters (`/metrics`:
mlaserve_engine_forward_seconds_total and _steps_total, read before and after) give the seconds spent
in model forwards (batch building included) during the request; the client times the request from
send to its last token (one HTTP client held across requests). outside_forward = 1 - forward seconds / request seconds: the share of the
request spent outside the forward, end to end (issue 14's target: <= 10% at one stream). CPU seconds
of the server and engine processes per token are recorded too (the engine's include its pool's
workers). Medians over `--rounds`.

    .venv/bin/python bench/serve_overhead_cpu.py [--model smollm2-135m-instruct] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
import serve_cpu  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"{name} is not in {url}/metrics")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def one_request(client: Any, url: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    if first is None or last is None:
        raise SystemExit("the request streamed no chunk")
    return {"request_s": last - t0, "ttft_s": first - t0, "chunks": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="default: bench/results/serve_overhead_cpu_<machine>.json")
    args = ap.parse_args()
    import httpx

    machine = cc.machine_info()
    port = cc.free_port()
    server = serve_cpu.Server("mlaserve", serve_cpu.mlaserve_command(args.model, port, []), f"http://127.0.0.1:{port}")
    rounds: list[dict[str, Any]] = []
    try:
        serve_cpu.start_server(server, Path(tempfile.mkdtemp(prefix="mlaserve-overhead-")), 600)
        assert server.proc is not None
        engine = children(server.proc.pid)
        # one client for every request, as an SDK user holds one (a new httpx client costs ~30 ms here)
        client = httpx.Client()
        one_request(client, server.url, 8)  # warm-up
        for i in range(args.rounds):
            fs0 = metric(server.url, "mlaserve_engine_forward_seconds_total")
            st0 = metric(server.url, "mlaserve_engine_forward_steps_total")
            cpu0 = (cpu_seconds(server.proc.pid), sum(cpu_seconds(p) for p in engine))
            r = one_request(client, server.url, args.max_tokens)
            cpu1 = (cpu_seconds(server.proc.pid), sum(cpu_seconds(p) for p in engine))
            r["forward_s"] = metric(server.url, "mlaserve_engine_forward_seconds_total") - fs0
            r["forward_steps"] = metric(server.url, "mlaserve_engine_forward_steps_total") - st0
            r["outside_forward"] = 1.0 - r["forward_s"] / r["request_s"]
            r["server_cpu_ms_per_token"] = 1e3 * (cpu1[0] - cpu0[0]) / args.max_tokens
            r["engine_cpu_ms_per_token"] = 1e3 * (cpu1[1] - cpu0[1]) / args.max_tokens
            rounds.append(r)
            print(f"round {i + 1}: request {r['request_s']:.3f} s, forwards {r['forward_s']:.3f} s in "
                  f"{r['forward_steps']:.0f} steps, outside the forward {100 * r['outside_forward']:.1f}%, "
                  f"CPU ms/token server {r['server_cpu_ms_per_token']:.2f} engine {r['engine_cpu_ms_per_token']:.2f}",
                  flush=True)
    finally:
        serve_cpu.stop_server(server)
    med = {k: cc.median([r[k] for r in rounds]) for k in rounds[0]}
    result = {"benchmark": "serve_overhead_cpu", "model": args.model, "max_tokens": args.max_tokens,
              "rounds": rounds, "median": med, "machine": machine, "versions": cc.versions(),
              "target": cc.check_target(med["outside_forward"], 0.10, higher_is_better=False)}
    out = cc.write_json(args.out or cc.RESULTS / f"serve_overhead_cpu_{cc.machine_tag(machine)}.json", result)
    print(f"median: outside the forward {100 * med['outside_forward']:.1f}% of the request "
          f"({med['request_s']:.3f} s, forwards {med['forward_s']:.3f} s); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
