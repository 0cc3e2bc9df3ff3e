"""Benchmark of one routed-expert MoE layer on the CPU: cpp_experts (bf16, Q8_0) against a plain
PyTorch bf16 implementation, the machine's memory read bandwidth and its bf16 matmul peak, in one
run. DeepSeek-V2-Lite expert shapes (hidden 2048, intermediate 1408, 64 experts, top-6).

Decode (small T) must stream the touched experts' weights once: floor = bytes touched / read
bandwidth. Prefill (large T) is bound by dot-product throughput: floor = flops / bf16 matmul peak.
Medians of repeats after warm-up. Weights are random (values do not change the time).

    .venv/bin/python bench/moe_cpu.py [--threads 2] [--out bench/results/moe_cpu_<host>.json]
        [--kt-python /path/to/venv-with-kt-kernel/bin/python]

Optional second peer: KTransformers' `kt-kernel` CPU MoE (its raw `kt_kernel_ext` extension, no
GPU needed), timed in a subprocess run by `--kt-python` (default: $MLASERVE_KT_PYTHON, else this
interpreter) on the same routing, after our kernels so the two thread pools never overlap. It is
best installed in its own venv (`pip install torch numpy; pip install --no-deps kt-kernel`); where
it is missing the JSON says "kt_kernel": "not installed ...".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# PyTorch's OpenMP workers busy-wait after each parallel op (libgomp spins ~300k times by default):
# on a 2-core box that spinner steals a core from the expert pool during the timed call. The engine
# sets the same for `--expert-backend cpp` (engine/client.py). Set before torch loads.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from cpu_common import read_bandwidth  # noqa: E402
from mlaserve.argtypes import positive_int  # noqa: E402

E, K, H, I = 64, 6, 2048, 1408
TOKENS = (1, 4, 16, 64, 256, 1024)


_FLUSH = None


def flush_caches() -> None:
    """Evicts the weights from the CPU caches (64 MiB written, 2x this box's 32 MiB L3), so small-T
    timings measure DRAM reads, not leftovers from the previous repeat."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(64 << 20, dtype=torch.uint8)
    _FLUSH.fill_(1)


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush_caches()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--tokens", type=positive_int, nargs="*", default=list(TOKENS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--kt-python", default=os.environ.get("MLASERVE_KT_PYTHON", sys.executable))
    ap.add_argument("--kt-kernel-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kt_kernel_worker:
        return kt_worker(args.threads, args.repeats)
    import cpp_experts  # here, so the kt-kernel worker runs in a venv without our extension too

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
    pool = cpp_experts.WorkerPool(args.threads)
    ops = {"bf16": cpp_experts.MoE(E, K, H, I, "bf16", pool=pool)}
    for e in range(E):
        ops["bf16"].load_expert(e, w_gate[e], w_up[e], w_down[e])
    ops["q8_0"] = cpp_experts.MoE(E, K, H, I, "q8_0", pool=pool)
    for e in range(E):
        ops["q8_0"].load_expert(e, q8_blocks(I, H, g), q8_blocks(I, H, g), q8_blocks(H, I, g))
    for op in ops.values():
        op.finalize()

    results, routing = [], {}
    for T in args.tokens:
        hidden = torch.randn(T, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        weights = torch.rand(T, K, generator=g)
        routing[T] = (ids.tolist(), weights.tolist())
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

    del ops  # free our weights and threads before the peer loads its own copy
    pool.close()
    kt = kt_kernel_peer(args.kt_python, args.threads, args.repeats, routing)
    if isinstance(kt, dict):
        for row in results:
            peer = kt["results"][str(row["T"])]
            for fmt, ours in (("bf16", "bf16"), ("int8", "q8_0")):
                row[f"kt_kernel_{fmt}_ms"] = peer[f"{fmt}_ms"]
                row[f"{ours}_speedup_vs_kt_kernel_{fmt}"] = peer[f"{fmt}_ms"] / row[f"{ours}_ms"]
            print(json.dumps({k: v for k, v in row.items() if "kt_kernel" in k or k == "T"}))
        kt = {k: v for k, v in kt.items() if k != "results"}
    report = {
        "layer": {"experts": E, "top_k": K, "hidden": H, "intermediate": I},
        "machine": machine,
        "results": results,
        "kt_kernel": kt,
    }
    out = Path(args.out or f"bench/results/moe_cpu_{platform.node() or 'host'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


# --- optional peer: kt-kernel (KTransformers' CPU MoE), timed in a separate process ------------


def kt_kernel_peer(python: str, threads: int, repeats: int, routing: dict) -> dict | str:
    """Time kt-kernel on the same routing in `python`; its report, or why there is none."""
    cmd = [python, __file__, "--kt-kernel-worker", "--threads", str(threads), "--repeats", str(repeats)]
    stdin = json.dumps({str(T): r for T, r in routing.items()})
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not measured: {python} failed to run: {e}"
    if p.returncode == 3:
        return f"not installed: {p.stdout.strip().splitlines()[-1]} (python: {python})"
    if p.returncode != 0:
        return f"not measured: kt-kernel worker failed (rc {p.returncode}): {p.stderr[-1500:]}"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]  # it also prints banners
    return json.loads(lines[-1])


def load_kt_kernel_ext():
    """kt-kernel's raw extension, chosen by its own CPU detection, without kt_kernel/__init__
    (that also imports safetensors and the serving wrappers, which this benchmark does not need)."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the kt_kernel package is not importable")
    path = Path(list(spec.submodule_search_locations)[0]) / "_cpu_detect.py"
    det_spec = importlib.util.spec_from_file_location("_kt_cpu_detect", path)
    det = importlib.util.module_from_spec(det_spec)
    det_spec.loader.exec_module(det)
    return det.initialize()


def kt_worker(threads: int, repeats: int) -> None:
    """Subprocess side: read routing from stdin, print one JSON line of kt-kernel timings.

    bf16: AMXBF16_MOE (AVX-512 BF16 backend where AMX is missing), per-expert bf16 weights.
    int8: AMXInt8_MOE (AVX-512 VNNI where AMX is missing), kt's own per-channel int8, quantized
    online from the bf16 weights; its llamafile MOE (the GGUF Q8_0 path) needs intermediate % 256
    == 0 and refuses DeepSeek-V2-Lite's 1408, so this is the nearest peer to our Q8_0.
    """
    try:
        ext, variant = load_kt_kernel_ext()
    except Exception as e:  # ImportError, or its loader failing on this CPU
        print(f"kt-kernel could not be loaded: {type(e).__name__}: {e}")
        sys.exit(3)
    import tempfile
    from importlib.metadata import version

    routing = {int(T): r for T, r in json.load(sys.stdin).items()}
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(E, *s, generator=g).div_(s[1] ** 0.5).bfloat16() for s in ((I, H), (I, H), (H, I))]
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
    cpu = ext.CPUInfer(cfg)
    mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
    p2l = torch.arange(E, dtype=torch.int64)
    tmp = tempfile.TemporaryDirectory()  # AMXInt8_MOE writes its quantized weights here

    def make(fmt: str):
        c = ext.moe.MOEConfig(E, K, H, I, mask.data_ptr())
        c.layer_idx, c.pool, c.max_len = 0, cpu.backend_, -(-max(routing) // 256) * 256  # its tiles
        if fmt == "bf16":
            c.gate_projs, c.up_projs, c.down_projs = ([[t[e].data_ptr() for e in range(E)]] for t in w)
            c.gate_scales = c.up_scales = c.down_scales = [[0] * E]
            op = ext.moe.AMXBF16_MOE(c)
        else:
            c.save, c.load, c.path = True, False, tmp.name
            c.gate_proj, c.up_proj, c.down_proj = (t.data_ptr() for t in w)
            op = ext.moe.AMXInt8_MOE(c)
        cpu.submit(op.load_weights_task(p2l.data_ptr()))
        cpu.sync()
        return op

    ops = {fmt: make(fmt) for fmt in ("bf16", "int8")}
    out_rows, check = {}, {}
    for T, (ids_l, wts_l) in routing.items():
        hidden = torch.randn(T, H, generator=g).bfloat16()
        ids, wts = torch.tensor(ids_l, dtype=torch.int64), torch.tensor(wts_l, dtype=torch.float32)
        bsz, out = torch.tensor([T], dtype=torch.int32), torch.empty(T, H, dtype=torch.bfloat16)
        row = {}
        for fmt, op in ops.items():
            task = (bsz.data_ptr(), K, ids.data_ptr(), wts.data_ptr(), hidden.data_ptr(), out.data_ptr(), False)
            def run(op=op, task=task):
                cpu.submit(op.forward_task(*task))
                cpu.sync()
            reps = repeats if T <= 256 else max(3, repeats // 2)
            row[f"{fmt}_ms"] = median_time(run, reps) * 1e3
            if T == min(routing):  # proves we drive it right: error against an fp32 reference
                ref = torch_moe(*(t.float() for t in w), hidden.float(), ids, wts)
                check[fmt] = ((out.float() - ref).norm() / ref.norm()).item()
        out_rows[str(T)] = row
    print(json.dumps({
        "version": version("kt-kernel"), "cpu_variant": variant,
        "int8_kernel": getattr(ext, "__int8_kernel__", "unknown"),
        "bf16_operator": "AMXBF16_MOE", "int8_operator": "AMXInt8_MOE (online per-channel int8)",
        "threads": threads, "python": sys.executable,
        "note": "timed via CPUInfer.submit+sync; CPUInfer adds a dispatch thread to its `threads` "
                "workers, so with threads == cores its times can come in scheduler-tick steps",
        "rel_err_vs_fp32_at_smallest_T": check, "results": out_rows,
    }))


if __name__ == "__main__":
    main()
