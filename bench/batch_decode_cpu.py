"""CPU benchmark of several requests decoding together through the model core: N requests (distinct random
prompts, greedy), one forward per step for all of them, on our CPU-native forward (the file's blocks),
for N in `--batch`; tok/s is the batch's tokens a second. Where the served benchmark (serve_cpu.py) puts
16 streams against llama-server, this one isolates the forward, and compares builds of the extension:
`--lib LABEL=PATH` (repeatable) times a build of cpp_experts/_C besides the installed one, each round in
a fresh process per build (the library is chosen at import, MLASERVE_CPP_EXPERTS_LIB), the builds'
order reversed every other round; ratios are per round against the first build, then the median. Each
prompt is prefilled in one forward before its batch decodes, and that time is reported too
(`prefill_tok_s`: the median prompt's tokens a second). The forward runs on the process's thread pool
(every core it may use, as the engine's). With `--profile` each process also times the native forward's
phases over the same steps.

    .venv/bin/python bench/batch_decode_cpu.py [--batch 4 8 16] [--lib before=/tmp/old/_C.so] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.client import set_cpu_wait_policy  # noqa: E402

set_cpu_wait_policy(os.environ)  # before torch starts its OpenMP threads, as for the engine process

import torch  # noqa: E402

from bench.cpu_common import machine_info, phase_profile, versions, write_json  # noqa: E402
from engine.process import freeze_gc_heap  # noqa: E402


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: the model loaded once, then each batch size decoded (after a warm-up)."""
    from executor.cpu_forward import auto_kv_dtype
    from executor.model_runner import ModelRunner, RequestSlice
    from models.builtin import resolve_model_path
    from models.loader.load import load_model

    torch.set_num_threads(1)  # as the engine does under the native forward: torch only picks the tokens
    loaded = load_model(str(resolve_model_path(args.model)), dtype="float32", cpu_weights="file", progress=False)
    most = max(args.batch)
    per = args.prompt_len + args.warmup + args.decode + 8
    r = ModelRunner(loaded.model, loaded.config, max_total_tokens=most * per, max_running_requests=most,
                    max_context_len=per, kv_dtype=auto_kv_dtype(loaded.model, loaded.dtype))
    if r.native_forward is None:
        raise SystemExit(f"the native forward is off: {r.native_off_reason}")
    freeze_gc_heap()
    plan = r.native_forward.plan
    g = torch.Generator().manual_seed(args.seed)
    out: dict[str, Any] = {}
    for n in args.batch:
        rows = [r.req_to_token_pool.alloc() for _ in range(n)]
        toks, pos, prefill = [], [], []
        for row in rows:
            prompt = torch.randint(10, loaded.config.vocab_size, (args.prompt_len,), generator=g).tolist()
            t = time.perf_counter()
            toks.append(int(r.greedy(r.forward(r.build_batch([RequestSlice(row, 0, prompt)])))[-1]))
            prefill.append(time.perf_counter() - t)
            pos.append(args.prompt_len)

        def step() -> None:
            picks = r.greedy(r.forward(r.build_batch([RequestSlice(w, p, [t]) for w, p, t in zip(rows, pos, toks)])))
            for i, t in enumerate(picks):
                toks[i], pos[i] = int(t), pos[i] + 1

        for _ in range(args.warmup):
            step()
        plan.set_profiling(args.profile)
        t = time.perf_counter()
        for _ in range(args.decode):
            step()
        dt = (time.perf_counter() - t) / args.decode
        row_out: dict[str, Any] = {"step_ms": dt * 1e3, "tok_s": n / dt,
                                   "prefill_tok_s": args.prompt_len / statistics.median(prefill)}
        if args.profile:
            row_out["profile"] = phase_profile(plan.profile(reset=True), dt)
            plan.set_profiling(False)
        out[str(n)] = row_out
        for row, p in zip(rows, pos):
            r.free_request(row, p)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model name or a GGUF path")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8, 16], help="requests decoding together")
    ap.add_argument("--prompt-len", type=int, default=192, help="each request's prompt (its context grows from it)")
    ap.add_argument("--decode", type=int, default=48, help="timed steps per batch size")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lib", action="append", default=[], metavar="LABEL=PATH",
                    help="also time this build of cpp_experts/_C (the installed one is labelled 'installed')")
    ap.add_argument("--profile", action="store_true", help="also time the native forward's phases")
    ap.add_argument("--out", default="bench/results/batch_decode_cpu.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.batch) < 1 or args.decode < 1 or args.rounds < 1:
        ap.error("--batch, --decode and --rounds take counts of 1 or more")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    builds: dict[str, str | None] = {"installed": None}
    for spec in args.lib:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"--lib takes LABEL=PATH of a built _C library, got {spec!r}")
        builds[label] = path
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in builds}
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(builds)[::-1]
        for label in order:
            env = dict(os.environ)
            env.pop("MLASERVE_CPP_EXPERTS_LIB", None)
            if builds[label]:
                env["MLASERVE_CPP_EXPERTS_LIB"] = builds[label]
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=env, capture_output=True,
                                  text=True, timeout=1800)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"round {rnd + 1}: " + "; ".join(
            f"{label} " + ", ".join(f"{n}: {runs[label][-1][str(n)]['tok_s']:.0f}" for n in args.batch)
            + f" (prefill {runs[label][-1][str(args.batch[0])]['prefill_tok_s']:.0f})"
            for label in builds) + " tok/s", flush=True)
    first = next(iter(builds))
    result: dict[str, Any] = {
        "benchmark": "batch_decode_cpu", "machine": machine_info(),
        "versions": versions(), "model": args.model, "prompt_len": args.prompt_len, "decode_steps": args.decode,
        "rounds": args.rounds, "builds": {k: v or "installed" for k, v in builds.items()}, "results": {},
    }
    for label in builds:
        res: dict[str, Any] = {}
        for n in args.batch:
            key = str(n)
            tok = [run[key]["tok_s"] for run in runs[label]]
            pre = [run[key]["prefill_tok_s"] for run in runs[label]]
            entry: dict[str, Any] = {"tok_s": statistics.median(tok), "tok_s_samples": tok,
                                     "step_ms": statistics.median(run[key]["step_ms"] for run in runs[label]),
                                     "prefill_tok_s": statistics.median(pre), "prefill_tok_s_samples": pre}
            if label != first:  # paired per round against the first build
                pairs = [a[key]["tok_s"] / b[key]["tok_s"] for a, b in zip(runs[label], runs[first])]
                entry[f"vs_{first}"] = statistics.median(pairs)
                entry[f"vs_{first}_samples"] = pairs
                pairs = [a[key]["prefill_tok_s"] / b[key]["prefill_tok_s"] for a, b in zip(runs[label], runs[first])]
                entry[f"prefill_vs_{first}"] = statistics.median(pairs)
            if args.profile:
                phases = [run[key]["profile"]["phases"] for run in runs[label]]
                entry["phases_us_per_step"] = {
                    ph: statistics.median(p[ph]["us_per_step"] for p in phases if ph in p) for ph in phases[0]}
            res[key] = entry
        result["results"][label] = res
    for label in builds:
        print(f"{label}: " + ", ".join(f"batch {n} {result['results'][label][str(n)]['tok_s']:.0f} tok/s"
                                       + (f" ({result['results'][label][str(n)][f'vs_{first}']:.3f}x)"
                                          if label != first else "") for n in args.batch))
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
