"""Measure launch plans of the Triton decode attention kernel on this GPU and keep the fastest.

The kernel's tile shape (query heads a program, KV positions a tile, warps, pipeline stages) and its
split plan (programs a call, splits a request) were set without a GPU to time them. This script times
candidates on MLA decode batches (DeepSeek's latent 512 + 64, bf16, KV slots scattered as a server's
allocator leaves them), for each head group (16: V2-Lite, 128: V2/V3) and batch size (1 and 16 by default;
a batch between measured sizes runs the plan of the largest measured size below it),
over short and long contexts, and writes the plan with the lowest geometric-mean time per (group,
batch) to kernels/configs/decode_attention.json under the device's name (the default plan unless another is
MIN_GAIN faster; cells the time budget did not reach are not written), where the triton attention
backend reads it (`DecodePlan`, `load_plans`). Every candidate's output is checked against the default
plan's; a plan that does not compile (too much shared memory) or differs is left out and reported.

Two stages, to fit a lent GPU's few minutes: the tile shapes at the default split plan, then split plans
with the best shape. A time budget stops the search early and keeps what was measured.

    python bench/tune_decode_attention.py [--heads 16 128] [--batches 1 16] [--contexts 4096 32768]
        [--budget 240] [--out bench/results/tune_decode_attention_<device>.json] [--no-write]
    TRITON_INTERPRET=1 python bench/tune_decode_attention.py --smoke   # CPU, tiny shapes, no plans; its report in the temp dir
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported anywhere: its kernels then run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench_common import Timer, bench_device, device_name, device_slug, machine_info, write_result  # noqa: E402
from mla_decode_gpu import FULL, SMOKE_SHAPES, SOFTMAX_SCALE, Q_STD, build_decode_batch  # noqa: E402
from kernels.attention import AttentionLayer, create_attention_backend  # noqa: E402
from kernels.attention.triton_backend import PLANS_FILE, DecodePlan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SPLIT_PLANS = [(4, 64), (1, 64), (2, 128), (4, 256), (8, 512)]  # (waves, max_splits)
MIN_GAIN = 1.03  # a plan replaces the default only when this much faster (medians of 10 calls move by a few %)


def shapes_for(group: int, smoke: bool) -> list[DecodePlan]:
    """Stage 1's candidates: tile shapes at the default split plan, the default first (three in a smoke run)."""
    top = max(16, 1 << (group - 1).bit_length())
    plans = [DecodePlan()]
    for bh, bn, warps, stages in itertools.product([16, 32, 64], [16, 32, 64], [4, 8], [2, 3]):
        plan = DecodePlan(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)
        if bh <= top and plan not in plans:
            plans.append(plan)
    return plans[:3] if smoke else plans


class Case:
    """One decode batch and its queries for one head count; `run(plan)` is one attention call."""

    def __init__(self, heads: int, batch: int, context: int, shapes: Any, device: torch.device, seed: int) -> None:
        self.heads, self.batch_size, self.context = heads, batch, context
        r, p = shapes.kv_lora_rank, shapes.rope_dim
        self.backend = create_attention_backend("triton", decode_plans={})
        self.batch = build_decode_batch(batch, context, 1, shapes, torch.bfloat16, device, self.backend, seed)
        self.layer = AttentionLayer(0, heads, 1, r + p, r, SOFTMAX_SCALE, kv_lora_rank=r, qk_rope_head_dim=p)
        g = torch.Generator(device=device).manual_seed(seed)
        self.q = (torch.randn(batch, heads, r, generator=g, device=device) * Q_STD).to(torch.bfloat16)
        self.q_pe = (torch.randn(batch, heads, p, generator=g, device=device) * Q_STD).to(torch.bfloat16)
        self.backend.init_forward_metadata(self.batch)

    def run(self, plan: DecodePlan) -> torch.Tensor:
        self.backend.decode_plans = {self.heads: {1: plan}}
        return self.backend.forward_mla_absorb(self.q, self.q_pe, self.layer, self.batch)


def measure(plan: DecodePlan, cases: list[Case], refs: list[torch.Tensor], timer: Timer, repeats: int) -> dict[str, Any]:
    """Times of `plan` on every case (seconds), or why it was left out."""
    times = []
    for case, ref in zip(cases, refs):
        try:
            out = case.run(plan)
        except Exception as e:  # noqa: BLE001 -- Triton's OutOfResources and compile errors: not a plan here
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        diff = float((out.float() - ref.float()).abs().max())
        if not math.isfinite(diff) or diff > 2e-2 + 2e-2 * float(ref.float().abs().max()):
            return {"error": f"differs from the default plan by {diff:.3g} at batch {case.batch_size}, "
                             f"context {case.context}"}
        times.append(timer.median(lambda: case.run(plan), repeats, warmup=2))
    return {"times_us": [t * 1e6 for t in times], "geomean_us": math.exp(sum(map(math.log, times)) / len(times)) * 1e6}


def tune_group(heads: int, batch: int, contexts: list[int], shapes: Any, device: torch.device, timer: Timer,
               args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    cases = [Case(heads, batch, c, shapes, device, args.seed + c) for c in contexts]
    default = DecodePlan()
    refs = [case.run(default) for case in cases]
    tried: list[dict[str, Any]] = []

    def trial(plan: DecodePlan) -> None:
        tried.append({"plan": dataclasses.asdict(plan), **measure(plan, cases, refs, timer, args.repeats)})

    for plan in shapes_for(heads, args.smoke):
        if time.monotonic() > deadline and tried:
            break
        trial(plan)
    ok = [t for t in tried if "geomean_us" in t]
    best = DecodePlan(**min(ok, key=lambda t: t["geomean_us"])["plan"])
    for waves, cap in SPLIT_PLANS[: 2 if args.smoke else None]:
        plan = dataclasses.replace(best, waves=waves, max_splits=cap)
        if time.monotonic() > deadline or any(t["plan"] == dataclasses.asdict(plan) for t in tried):
            continue
        trial(plan)
    ok = [t for t in tried if "geomean_us" in t]
    winner = min(ok, key=lambda t: t["geomean_us"])
    base = tried[0]  # the default plan
    if "geomean_us" in base and winner["geomean_us"] * MIN_GAIN > base["geomean_us"]:
        winner = base  # within the timings' noise of the default: keep it
    del cases, refs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "heads": heads, "batch": batch, "contexts": contexts, "best": winner["plan"],
        "best_us": winner["times_us"], "default_us": base.get("times_us"),
        "speedup_vs_default": base["geomean_us"] / winner["geomean_us"] if "geomean_us" in base else None,
        "tried": tried,
    }


def merge_plans(path: Path, device: str, found: list[dict[str, Any]]) -> None:
    """Writes the best plans under the device's name, keeping the other devices' entries."""
    raw = json.loads(path.read_text()) if path.exists() else {}
    mine: dict[str, dict[str, Any]] = raw.get(device, {})
    for f in found:
        mine.setdefault(str(f["heads"]), {})[str(f["batch"])] = f["best"]
    raw[device] = {g: dict(sorted(b.items(), key=lambda kv: int(kv[0]))) for g, b in sorted(mine.items(), key=lambda kv: int(kv[0]))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1; writes no plans")
    ap.add_argument("--heads", type=int, nargs="*", help="query heads of the MLA layer (its head group)")
    ap.add_argument("--batches", type=int, nargs="*", help="batch sizes (powers of two: the plans' keys)")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls a candidate and case (median; default 10)")
    ap.add_argument("--budget", type=float, default=240, help="seconds of search at most (what was measured is kept)")
    ap.add_argument("--out", default=None, help="JSON of every candidate's times "
                    "(default bench/results/tune_decode_attention_<device>.json)")
    ap.add_argument("--plans", default=str(PLANS_FILE), help="the plans file to update (default: the one the backend reads)")
    ap.add_argument("--no-write", action="store_true", help="report only, leave the plans file alone")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = bench_device(args.smoke)
    base = SMOKE_SHAPES if args.smoke else FULL
    heads = args.heads or ([4] if args.smoke else [16, 128])
    batches = args.batches or ([1, 2] if args.smoke else [1, 16])
    contexts = args.contexts or ([37, 130] if args.smoke else [4096, 32768])
    if any(b & (b - 1) for b in batches):
        ap.error("--batches must be powers of two (the plans are looked up by the batch rounded up to one)")
    args.repeats = args.repeats or (1 if args.smoke else 10)
    timer = Timer(device)
    name = device_name(device)
    # a smoke run's report is no result: the temp dir, not bench/results (an untracked file there)
    report_path = Path(args.out) if args.out else (Path(tempfile.gettempdir()) if args.smoke else RESULTS) / \
        f"tune_decode_attention_{device_slug(device)}.json"
    report: dict[str, Any] = {"benchmark": "tune_decode_attention", "smoke": args.smoke, "machine": machine_info(device),
                              "kv_lora_rank": base.kv_lora_rank, "qk_rope_head_dim": base.rope_dim, "results": []}
    deadline = time.monotonic() + args.budget
    for h in heads:
        for b in batches:
            if time.monotonic() > deadline:
                report.setdefault("not_reached", []).append({"heads": h, "batch": b})
                continue
            found = tune_group(h, b, contexts, base, device, timer, args, deadline)
            report["results"].append(found)
            write_result(report_path, report)
            print(f"heads {h:4d} batch {b:3d}: best {found['best']} "
                  f"x{found['speedup_vs_default'] or float('nan'):.2f} vs default ({len(found['tried'])} tried)", flush=True)
    if not args.smoke and not args.no_write and report["results"]:
        merge_plans(Path(args.plans), name, report["results"])
        print(f"wrote the plans to {args.plans}")
    write_result(report_path, report)
    print(f"wrote {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
