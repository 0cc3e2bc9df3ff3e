"""Streams beside long prompts on the CPU: how long the streams already running pause while new long
prompts are prefilled, and how soon those prompts are done.

Workload, the same for each server: `--streams` short streamed completions (greedy, `--max-tokens`
each, EOS ignored) start; `--delay` seconds later `--long` long prompts (~`--long-words` numbered
words each, a different one per round) arrive together, each asking for 3 tokens. Per round: the
longest gap between two chunks of any short stream while the long prompts are under way, the median
gap, and the seconds from the long prompts' arrival until the last one is answered.

Servers: `mlaserve serve` as configured (its CPU prefill takes one 512-token chunk a step), again with
`--ours-args` of a variant (`--variant`, e.g. `--chunked-prefill-size 2048`), and llama.cpp's
`llama-server` on the same GGUF (`-np` streams + long prompts, its default batch sizes) where `make
peers` built it. Rounds interleave the servers (each started once, kept up); medians over rounds.
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
from bench import peers  # noqa: E402
from bench.serve_cpu import (Server, llama_server_command, mlaserve_command, parse_sse, slot_context,  # noqa: E402
                             start_server, stop_server)


def long_prompt(round_index: int, j: int, words: int) -> str:
    return f"Document {round_index}-{j}. " + " ".join(f"w{k}" for k in range(words)) + "\nSummary:"


async def _short(client: Any, url: str, i: int, max_tokens: int) -> list[float]:
    body = {"prompt": f"Count slowly, stream {i}:", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            event = parse_sse(line)
            if isinstance(event, dict) and event.get("choices"):
                times.append(time.monotonic())
    return times


async def _long(client: Any, url: str, prompt: str, delay: float) -> tuple[float, float]:
    await asyncio.sleep(delay)
    t0 = time.monotonic()
    resp = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
    resp.raise_for_status()
    return t0, time.monotonic()


async def one_round(url: str, args: argparse.Namespace, round_index: int) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        shorts = [_short(client, url, i, args.max_tokens) for i in range(args.streams)]
        longs = [_long(client, url, long_prompt(round_index, j, args.long_words), args.delay) for j in range(args.long)]
        results = await asyncio.gather(*shorts, *longs)
    streams, spans = results[: args.streams], results[args.streams:]
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    gaps = [b - a for times in streams for a, b in zip(times, times[1:]) if b > start and a < end]
    if not gaps:
        raise SystemExit("the short streams had ended before the long prompts arrived: raise --max-tokens")
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_prompts_s": end - start}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="built-in name or .gguf path (default: the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=500, help="tokens per short stream")
    ap.add_argument("--long", type=int, default=5, help="long prompts arriving together")
    ap.add_argument("--long-words", type=int, default=400, help="numbered words per long prompt (~3.8 tokens each)")
    ap.add_argument("--delay", type=float, default=1.5, help="seconds between the streams' start and the long prompts")
    ap.add_argument("--ours-args", default="", help="extra flags for mlaserve serve (one string)")
    ap.add_argument("--variant", default="--chunked-prefill-size 2048",
                    help="flags of a second mlaserve configuration ('' for none)")
    ap.add_argument("--ours-only", action="store_true", help="do not start llama-server")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the usable cores)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="result JSON (default: bench/results/serve_stall_cpu_<machine>.json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from models.builtin import DEFAULT_MODEL, resolve_model_path

    gguf = str(resolve_model_path(args.model or DEFAULT_MODEL))
    machine = cc.machine_info()
    servers = [Server("mlaserve", mlaserve_command(gguf, cc.free_port(), args.ours_args.split()), "")]
    if args.variant.strip():
        servers.append(Server("mlaserve " + args.variant.strip(),
                              mlaserve_command(gguf, cc.free_port(), [*args.ours_args.split(), *args.variant.split()]), ""))
    binary = None if args.ours_only or not gguf.endswith(".gguf") else peers.llama_cpp_bin("llama-server")
    skipped = {} if binary is not None else {"llama-server": "--ours-only" if args.ours_only
                                             else peers.absent_reason("llama-server")}
    if binary is not None:
        slots = args.streams + args.long
        ctx = slots * slot_context(int(args.long_words * 4), args.max_tokens)
        servers.append(Server("llama-server", llama_server_command(binary, gguf, cc.free_port(), slots,
                                                                   args.threads or machine["cores"], ctx, []), ""))
    for s in servers:
        s.url = f"http://127.0.0.1:{s.command[s.command.index('--port') + 1]}"
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    log_dir = Path(tempfile.mkdtemp(prefix="serve_stall_"))
    try:
        for s in servers:
            start_server(s, log_dir, args.start_timeout)
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for s in order:
                got = asyncio.run(one_round(s.url, args, r))
                rounds[s.name].append(got)
                print(f"round {r + 1}/{args.rounds} {s.name:36s} longest pause {got['max_gap_s']:.2f} s, median gap "
                      f"{1000 * got['median_gap_s']:.0f} ms, long prompts done in {got['long_prompts_s']:.1f} s", flush=True)
    finally:
        for s in servers:
            stop_server(s)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rounds.items()}
    ours = med["mlaserve"]
    result = {
        "machine": machine, "versions": cc.versions(), "model": gguf, "workload": {
            k: getattr(args, k) for k in ("streams", "max_tokens", "long", "long_words", "delay", "rounds", "variant")},
        "rounds": rounds, "medians": med, "skipped": skipped,
        "ratios_ours_over": {name: {k: cc.ratio(ours[k], m[k]) for k in ours} for name, m in med.items() if name != "mlaserve"},
    }
    out = args.out or cc.RESULTS / f"serve_stall_cpu_{cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    for name, m in med.items():
        print(f"{name:38s} longest pause {m['max_gap_s']:.2f} s, median gap {1000 * m['median_gap_s']:.0f} ms, "
              f"long prompts {m['long_prompts_s']:.1f} s")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
