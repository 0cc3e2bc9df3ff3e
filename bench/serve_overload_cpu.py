"""A retry storm on the CPU: many clients against a server held at its admission limits.

Workload: `--clients` clients each send short chat completions (`--max-tokens` tokens, a different
prompt each time) one after another for `--seconds`; a refused one (503 `overloaded`) waits the
`Retry-After` it was told and tries again with its next prompt. The server runs with
`--max-running-requests` and `--max-queued-requests` far below the clients, so most requests are
refused. Per round: admitted and refused requests per second, the refusals' median latency, and the
admitted ones' median and p99. What it shows: what a refusal costs while the server is full, and how
much of the machine the refusals leave to the admitted requests.

Servers: `mlaserve serve` from this checkout, and from each `--checkout LABEL=DIR` (the code before a
change, say), on the same model; each is started once and kept up, and the rounds interleave them.
Medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_common as cc  # noqa: E402
from bench.serve_cpu import Server, checkout, mlaserve_command, start_server, stop_server  # noqa: E402


async def _client(http: Any, url: str, i: int, end: float, out: dict[str, list[float]]) -> None:
    k = 0
    while time.monotonic() < end:
        k += 1
        body = {"messages": [{"role": "user", "content": f"Client {i} asks question {k}: tell me about the sea."}],
                "max_tokens": out["max_tokens"][0], "temperature": 0}
        t0 = time.monotonic()
        try:
            resp = await http.post(url + "/v1/chat/completions", json=body)
        except Exception as e:  # noqa: BLE001 - a transport failure is counted, not fatal
            out["failed"].append(time.monotonic() - t0)
            out["errors"].append(repr(e)[:200])
            continue
        took = time.monotonic() - t0
        if resp.status_code == 200:
            out["admitted"].append(took)
        elif resp.status_code == 503:
            out["refused"].append(took)
            await asyncio.sleep(float(resp.headers.get("retry-after") or 1))
        else:
            out["failed"].append(took)
            out["errors"].append(f"{resp.status_code}: {resp.text[:200]}")


async def one_round(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    out: dict[str, list[Any]] = {"admitted": [], "refused": [], "failed": [], "errors": [], "max_tokens": [args.max_tokens]}
    limits = httpx.Limits(max_connections=args.clients + 10, max_keepalive_connections=args.clients + 10)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as http:
        end = time.monotonic() + args.seconds
        await asyncio.gather(*(_client(http, url, i, end, out) for i in range(args.clients)))
    ok, no = sorted(out["admitted"]), out["refused"]
    if not ok:
        raise SystemExit(f"no request was admitted in {args.seconds} s: {out['errors'][:3]}")
    return {
        "admitted_per_s": len(ok) / args.seconds,
        "refused_per_s": len(no) / args.seconds,
        "refused_p50_s": statistics.median(no) if no else None,
        "admitted_p50_s": statistics.median(ok),
        "admitted_p99_s": cc.percentile(ok, 99),
        "failed": len(out["failed"]),
        "errors": sorted(set(out["errors"]))[:5],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="built-in name or .gguf path (default: the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=30, help="length of a round")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--running", type=int, default=8, help="--max-running-requests of every server")
    ap.add_argument("--queued", type=int, default=4, help="--max-queued-requests of every server")
    ap.add_argument("--ours-args", default="", help="extra flags for every mlaserve serve (one string)")
    ap.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                    help="also a server run from another checkout of this repository")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="result JSON (default: bench/results/serve_overload_cpu_<machine>.json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from models.builtin import DEFAULT_MODEL, resolve_model_path

    model = str(resolve_model_path(args.model or DEFAULT_MODEL))
    flags = ["--max-running-requests", str(args.running), "--max-queued-requests", str(args.queued),
             *args.ours_args.split()]
    servers = [Server("mlaserve", mlaserve_command(model, cc.free_port(), flags), "")]
    for label, where in map(checkout, args.checkout):
        servers.append(Server(label, mlaserve_command(model, cc.free_port(), flags), "", cwd=where))
    for s in servers:
        s.url = f"http://127.0.0.1:{s.command[s.command.index('--port') + 1]}"
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    log_dir = Path(tempfile.mkdtemp(prefix="serve_overload_"))
    try:
        for s in servers:
            start_server(s, log_dir, args.start_timeout)
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                got = asyncio.run(one_round(s.url, args))
                rounds[s.name].append(got)
                refused = f"{1000 * got['refused_p50_s']:.0f} ms" if got["refused_p50_s"] is not None else "-"
                print(f"round {r + 1}/{args.rounds} {s.name:12s} admitted {got['admitted_per_s']:.1f}/s (p50 "
                      f"{got['admitted_p50_s']:.2f} s, p99 {got['admitted_p99_s']:.2f} s), refused "
                      f"{got['refused_per_s']:.1f}/s (p50 {refused}), failed {got['failed']}", flush=True)
    finally:
        for s in servers:
            stop_server(s)
    keys = ("admitted_per_s", "refused_per_s", "refused_p50_s", "admitted_p50_s", "admitted_p99_s")
    med = {name: {k: cc.median([x[k] for x in rs if x[k] is not None]) for k in keys} for name, rs in rounds.items()}
    ours = med["mlaserve"]
    result = {
        "machine": cc.machine_info(), "versions": cc.versions(), "model": model,
        "workload": {k: getattr(args, k) for k in ("clients", "seconds", "max_tokens", "running", "queued", "rounds",
                                                   "ours_args")},
        "checkouts": {s.name: str(s.cwd) for s in servers if s.cwd is not None},
        "rounds": rounds, "medians": med,
        "ratios_ours_over": {name: {k: cc.ratio(ours[k], m[k]) for k in keys} for name, m in med.items()
                             if name != "mlaserve"},
    }
    out = args.out or cc.RESULTS / f"serve_overload_cpu_{cc.machine_tag(result['machine'])}.json"
    cc.write_json(out, result)
    for name, m in med.items():
        print(f"{name:12s} " + ", ".join(f"{k} {v:.3g}" for k, v in m.items() if v is not None))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
