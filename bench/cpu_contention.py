"""A served request on a CPU shared with another busy process: how much slower than on a quiet machine,
for mlaserve under each wait policy of its one thread pool and for llama-server on the same GGUF.

Contenders run side by side (idle between requests): `mlaserve` as shipped (the cpp_experts pool's
contention policy: a caller that finds its workers late pauses, then yields, and runs solo for a while
when they keep being late), `mlaserve-spin` (MLASERVE_CPP_EXPERTS_WAIT=spin: the policy off, workers
and caller spin — the quiet-speed reference for the policy's cost) and llama-server (`-np 1 -t <cores>`,
skipped when not built: `make peers`). Each round times one greedy completion of `--tokens` tokens on
each contender quiet, then with a competing `yes > /dev/null`; rounds are interleaved so machine
noise hits every contender alike. Reported: medians, the slowdown under contention and the policy's
quiet cost against the spin reference. Targets (issue 14): slowdown <= 2.5x, quiet cost <= 5%.

The policy's quiet cost is a few percent of a ~0.2 s request, less than the quiet times drift from round
to round, so it is measured apart as well: `--quiet-pairs` back-to-back quiet requests to the shipped
policy and to spin, in alternating order, each pair's ratio taken while the machine is in one state; the
cost is the pairs' median ratio, with a bootstrap 90% interval.

    .venv/bin/python bench/cpu_contention.py [--model smollm2-135m-instruct] [--tokens 64] [--rounds 3]
        [--quiet-pairs 60]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
import peers  # noqa: E402
import serve_cpu  # noqa: E402
from mlaserve.argtypes import positive_int  # noqa: E402

POLICIES: dict[str, dict[str, str]] = {"mlaserve": {}, "mlaserve-spin": {"MLASERVE_CPP_EXPERTS_WAIT": "spin"}}
PROMPT = "Write a long story about a lighthouse keeper."


def timed_request(url: str, tokens: int) -> float:
    import httpx

    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=900, json={
        "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    got = r.json()["usage"]["completion_tokens"]
    if got != tokens:
        raise SystemExit(f"{url} returned {got} tokens, not {tokens}")
    return elapsed


def quiet_pairs(policy_url: str, spin_url: str, tokens: int, pairs: int) -> list[float]:
    """Each pair: one quiet request to each server back to back, the order alternating; its ratio
    (policy / spin) compares the two under the same state of the machine."""
    ratios = []
    for i in range(pairs):
        if i % 2 == 0:
            a = timed_request(policy_url, tokens)
            b = timed_request(spin_url, tokens)
        else:
            b = timed_request(spin_url, tokens)
            a = timed_request(policy_url, tokens)
        ratios.append(a / b)
    return ratios


def paired_cost(ratios: list[float], draws: int = 4000) -> dict[str, object]:
    """The pairs' median ratio - 1, with a percentile bootstrap 90% interval of that median."""
    rng = random.Random(0)
    meds = sorted(cc.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return {"pairs": len(ratios), "cost": cc.median(ratios) - 1.0,
            "interval_90": [meds[int(0.05 * draws)] - 1.0, meds[int(0.95 * draws) - 1] - 1.0], "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--quiet-pairs", type=int, default=60,
                    help="back-to-back quiet request pairs (shipped policy, spin) for the policy's cost (default 60)")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the usable cores)")
    ap.add_argument("--out", default=None, help="default: bench/results/cpu_contention_<machine>.json")
    args = ap.parse_args()

    from models.builtin import resolve_model_path

    machine = cc.machine_info()
    threads = args.threads or peers.cores()
    gguf = str(resolve_model_path(args.model))
    servers: list[serve_cpu.Server] = []
    for name, env in POLICIES.items():
        port = cc.free_port()
        cmd = serve_cpu.mlaserve_command(args.model, port, [])
        servers.append(serve_cpu.Server(name, ["env", *(f"{k}={v}" for k, v in env.items()), *cmd],
                                        f"http://127.0.0.1:{port}"))
    binary = peers.llama_cpp_bin("llama-server")
    skipped = None
    if binary is None:
        skipped = "llama-server is not built (make peers)"
        print(skipped, flush=True)
    else:
        port = cc.free_port()
        ctx = serve_cpu.slot_context(64, args.tokens)
        servers.append(serve_cpu.Server("llama-server", serve_cpu.llama_server_command(
            binary, gguf, port, 1, threads, ctx, []), f"http://127.0.0.1:{port}"))
    times: dict[str, dict[str, list[float]]] = {s.name: {"quiet": [], "busy": []} for s in servers}
    log_dir = Path(tempfile.mkdtemp(prefix="mlaserve-contention-"))
    try:
        for s in servers:
            serve_cpu.start_server(s, log_dir, 600)
            timed_request(s.url, 8)  # warm-up
        for r in range(args.rounds):
            for s in servers:
                times[s.name]["quiet"].append(timed_request(s.url, args.tokens))
                busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
                try:
                    time.sleep(0.2)
                    times[s.name]["busy"].append(timed_request(s.url, args.tokens))
                finally:
                    busy.kill()
                    busy.wait()
                print(f"round {r + 1}: {s.name:13s} quiet {times[s.name]['quiet'][-1]:7.2f} s, "
                      f"busy {times[s.name]['busy'][-1]:7.2f} s", flush=True)
        ratios = quiet_pairs(servers[0].url, servers[1].url, args.tokens, args.quiet_pairs)
    finally:
        for s in servers:
            serve_cpu.stop_server(s)

    med = {name: {k: cc.median(v) for k, v in t.items()} for name, t in times.items()}
    slowdown = {name: m["busy"] / m["quiet"] for name, m in med.items()}
    cost = med["mlaserve"]["quiet"] / med["mlaserve-spin"]["quiet"] - 1.0
    paired = paired_cost(ratios) if ratios else None
    result = {
        "benchmark": "cpu_contention", "model": args.model, "file": gguf, "tokens": args.tokens,
        "rounds": args.rounds, "machine": machine, "versions": cc.versions(),
        "competitor": "one `yes > /dev/null` process", "policies": POLICIES, "peer_skipped": skipped,
        "seconds": times, "median_s": med, "slowdown_busy_vs_quiet": slowdown,
        "policy_quiet_cost_vs_spin": cost, "policy_quiet_cost_paired": paired,
        "targets": {"slowdown_busy_vs_quiet": cc.check_target(slowdown["mlaserve"], 2.5, higher_is_better=False),
                    "policy_quiet_cost_vs_spin": cc.check_target(paired["cost"] if paired else cost, 0.05,
                                                                 higher_is_better=False)},
    }
    out = cc.write_json(args.out or cc.ROOT / "bench" / "results" / f"cpu_contention_{cc.machine_tag(machine)}.json",
                        result)
    for name, m in med.items():
        print(f"{name:13s} quiet {m['quiet']:7.2f} s  busy {m['busy']:7.2f} s  slowdown {slowdown[name]:5.1f}x")
    print(f"the policy's quiet cost vs spin: {100 * cost:+.1f}% (the rounds' medians)")
    if paired:
        print(f"the policy's quiet cost vs spin, {paired['pairs']} back-to-back pairs: {100 * paired['cost']:+.1f}% "
              f"(90% interval {100 * paired['interval_90'][0]:+.1f}% .. {100 * paired['interval_90'][1]:+.1f}%)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
