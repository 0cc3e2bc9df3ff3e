"""Benchmark of one routed-expert MoE layer on the CPU: cpp_experts (bf16, Q8_0) against a plain
PyTorch bf16 implementation, the machine's memory read bandwidth and its bf16 matmul peak, in one
run. DeepSeek-V2-Lite expert shapes (hidden 2048, intermediate 1408, 64 experts, top-6).

Decode (small T) must stream the touched experts' weights once: floor = bytes touched / read
bandwidth. Prefill (large T) is bound by dot-product throughput: floor = flops / bf16 matmul peak.
Medians of repeats after warm-up. Weights are random (values do not change the time).

    .venv/bin/python bench/moe_cpu.py [--threads 2] [--out bench/results/moe_cpu_<host>.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import cpp_experts

E, K, H, I = 64, 6, 2048, 1408
TOKENS = (1, 4, 16, 64, 256, 1024)


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of summing a large array (reads only), with torch's threads."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / median_time(lambda: x.sum(), 5)


def matmul_peak(n: int = 4096) -> float:
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    return 2 * n**3 / median_time(lambda: torch.matmul(a, b), 3)


def torch_moe(w_gate, w_up, w_down, hidden, ids, weights) -> torch.Tensor:
    """Plain PyTorch: index each expert's tokens, F.linear, weighted index_add."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        x = hidden[tok]
        h = F.silu(F.linear(x, w_gate[e])) * F.linear(x, w_up[e])
        y = F.linear(h, w_down[e]).float() * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


def q8_blocks(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random raw Q8_0 blocks (fp16 scale + 32 int8) for a [rows, k] matrix."""
    nb = k // 32
    d = (torch.rand(rows, nb, 1, generator=g) * 1e-3 + 1e-4).half().view(torch.uint8)
    qs = torch.randint(-127, 128, (rows, nb, 32), dtype=torch.int8, generator=g).view(torch.uint8)
    return torch.cat([d, qs], dim=2).reshape(rows, nb * 34)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "cpp_experts_info": cpp_experts.info(),
        "read_bandwidth_GBps": read_bandwidth() / 1e9,
        "bf16_matmul_peak_TFLOPs": matmul_peak() / 1e12,
    }
    print(json.dumps(machine, indent=1))
    bw, peak = machine["read_bandwidth_GBps"] * 1e9, machine["bf16_matmul_peak_TFLOPs"] * 1e12

    w_gate = torch.randn(E, I, H, generator=g).div_(H**0.5).bfloat16()
    w_up = torch.randn(E, I, H, generator=g).div_(H**0.5).bfloat16()
    w_down = torch.randn(E, H, I, generator=g).div_(I**0.5).bfloat16()
    ops = {"bf16": cpp_experts.MoE(E, K, H, I, "bf16", num_threads=args.threads)}
    for e in range(E):
        ops["bf16"].load_expert(e, w_gate[e], w_up[e], w_down[e])
    ops["q8_0"] = cpp_experts.MoE(E, K, H, I, "q8_0", num_threads=args.threads)
    for e in range(E):
        ops["q8_0"].load_expert(e, q8_blocks(I, H, g), q8_blocks(I, H, g), q8_blocks(H, I, g))
    for op in ops.values():
        op.finalize()

    results = []
    for T in args.tokens:
        hidden = torch.randn(T, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        weights = torch.rand(T, K, generator=g)
        touched = ids.unique().numel()
        flops = 2 * 3 * H * I * T * K
        reps = args.repeats if T <= 256 else max(3, args.repeats // 2)
        row = {"T": T, "experts_touched": touched, "flops": flops}
        t_torch = median_time(lambda: torch_moe(w_gate, w_up, w_down, hidden, ids, weights), reps)
        row["torch_bf16_ms"] = t_torch * 1e3
        for fmt, op in ops.items():
            t = median_time(lambda: op.forward(hidden, ids, weights), reps)
            nbytes = touched * 3 * H * I * (2 if fmt == "bf16" else 34 / 32)
            row[f"{fmt}_ms"] = t * 1e3
            row[f"{fmt}_kernel"] = op.kernel
            row[f"{fmt}_GBps"] = nbytes / t / 1e9
            row[f"{fmt}_fraction_of_read_bw"] = nbytes / t / bw
            row[f"{fmt}_TFLOPs"] = flops / t / 1e12
            row[f"{fmt}_fraction_of_matmul_peak"] = flops / t / peak
            row[f"{fmt}_speedup_vs_torch_bf16"] = t_torch / t
        row["torch_bf16_fraction_of_read_bw"] = touched * 3 * H * I * 2 / t_torch / bw
        row["torch_bf16_fraction_of_matmul_peak"] = flops / t_torch / peak
        row["q8_0_speedup_vs_bf16"] = row["bf16_ms"] / row["q8_0_ms"]
        print(json.dumps(row))
        results.append(row)

    report = {
        "layer": {"experts": E, "top_k": K, "hidden": H, "intermediate": I},
        "machine": machine,
        "results": results,
        "kt_kernel": "not measured: kt-kernel was not installed in this run",
    }
    out = Path(args.out or f"bench/results/moe_cpu_{platform.node() or 'host'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
