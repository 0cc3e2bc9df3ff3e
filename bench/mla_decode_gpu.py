"""GPU benchmark of MLA decode attention (the absorbed path): the Triton backend against the torch
reference backend and against the device's copy bandwidth, in one run.

What is timed: `forward_mla_absorb` of one layer in DECODE mode, through the attention-backend
interface, on a real `MLATokenToKVPool` / `ReqToTokenPool`, the KV slots of every request scattered
over the pool by a random permutation (of slots at page size 1, of pages at page size 64), as a
server's allocator leaves them after some churn. DeepSeek shapes: latent 576 = 512 (c_kv) + 64
(k_pe), 16 heads (V2-Lite) and 128 heads (V2/V3), bf16.

Floor: decode attention must read every cached latent row once, B*L*576*2 bytes, plus q
(B*H*576*2) and write out (B*H*512*2); time >= bytes / bandwidth, the bandwidth measured here by a
1 GiB device-to-device `copy_` (read + write counted). Reported: achieved GB/s and its fraction of
the copy bandwidth; the speedup over the torch backend on the same inputs (skipped where torch's
fp32 gather would not fit the memory budget). Medians after warm-up, L2 flushed before each call;
also the time when the call is replayed from a CUDA graph (no launch overhead), as decode runs in
the server. The Triton output is checked against torch on every case (a sub-batch of requests where
the whole batch would not fit torch's memory); the max abs difference is in the JSON and the
script exits 1 when any case is wrong. Issue targets: >= 80% of copy bandwidth at batch 64, context
4096, 16 heads; >= 10x the torch backend.

    python bench/mla_decode_gpu.py [--out bench/results/mla_decode_<device>.json] [--repeats 20]
        [--heads 16 128] [--batches 1 8 32 64 128] [--contexts 1024 4096 16384 32768] [--page-sizes 1 64]
    TRITON_INTERPRET=1 python bench/mla_decode_gpu.py --smoke --out /tmp/mla.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported anywhere: its kernels then run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    Timer,
    bench_device,
    copy_bandwidth,
    device_slug,
    machine_info,
    print_table,
    write_result,
)
from kernels.attention import AttentionLayer, create_attention_backend  # noqa: E402
from executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from executor.memory_pool import MLATokenToKVPool, ReqToTokenPool  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SOFTMAX_SCALE = 192**-0.5  # DeepSeek: 1/sqrt(qk_nope + qk_rope); the value does not change the time
Q_STD = 2.0  # scores of std ~3.5 at r + P = 576: a peaked softmax, so outputs are O(0.1-1) and a wrong kernel shows
ATOL, RTOL = 2e-3, 2e-2  # bf16 output rounding is 2^-8 relative; a wrong kernel is off by O(max |out|)
TRITON_SPLIT_ALLOWANCE = 64  # KV splits per (request, head) assumed when budgeting the kernel's fp32 partials


@dataclasses.dataclass
class Shapes:
    kv_lora_rank: int
    rope_dim: int
    heads: list[int]
    batches: list[int]
    contexts: list[int]
    page_sizes: list[int]


FULL = Shapes(512, 64, [16, 128], [1, 8, 32, 64, 128], [1024, 4096, 16384, 32768], [1, 64])
# Smoke: contexts that leave the last page part-filled at page size 64, several requests.
SMOKE_SHAPES = Shapes(32, 16, [4], [3], [37, 130], [1, 64])


def build_decode_batch(
    batch_size: int, context: int, page_size: int, shapes: Shapes, dtype: torch.dtype, device: torch.device,
    backend: Any, seed: int,
) -> ForwardBatch:
    """A DECODE batch of `batch_size` requests of `context` cached tokens each (the current token's
    KV included, as the model stores it before attending), slots scattered over a fresh one-layer pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = -(-context // page_size)
    num_slots = batch_size * pages_per_req * page_size
    pool = MLATokenToKVPool(num_slots, 1, shapes.kv_lora_rank, shapes.rope_dim, dtype, device, page_size)
    gdev = torch.Generator(device=device).manual_seed(seed)
    pool.kv_buffer[0][page_size:].normal_(generator=gdev)  # c_kv and k_pe ~ N(0, 1), as after RMSNorm / RoPE
    req_pool = ReqToTokenPool(batch_size, context, device)
    pages = torch.randperm(num_slots // page_size, generator=g) + 1  # page 0 is the reserved dummy page
    offsets = torch.arange(page_size)
    rows = []
    for i in range(batch_size):
        row = req_pool.alloc()
        assert row is not None
        mine = pages[i * pages_per_req : (i + 1) * pages_per_req]
        req_pool.write(row, 0, (mine[:, None] * page_size + offsets).reshape(-1)[:context].to(device))
        rows.append(row)
    req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch_size,
        input_ids=torch.zeros(batch_size, dtype=torch.int64, device=device),
        positions=torch.full((batch_size,), context - 1, dtype=torch.int64, device=device),
        req_pool_indices=req_pool_indices,
        seq_lens=torch.full((batch_size,), context, dtype=torch.int64, device=device),
        seq_lens_cpu=[context] * batch_size,
        extend_prefix_lens_cpu=[context - 1] * batch_size,
        extend_seq_lens_cpu=[1] * batch_size,
        out_cache_loc=req_pool.req_to_token[req_pool_indices, context - 1].to(torch.int64),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        attn_backend=backend,
    )


def sub_batch(batch: ForwardBatch, n: int, backend: Any) -> ForwardBatch:
    """The first `n` requests of a decode batch, for `backend` (same pools)."""
    return dataclasses.replace(
        batch, batch_size=n, input_ids=batch.input_ids[:n], positions=batch.positions[:n],
        req_pool_indices=batch.req_pool_indices[:n], seq_lens=batch.seq_lens[:n], seq_lens_cpu=batch.seq_lens_cpu[:n],
        extend_prefix_lens_cpu=batch.extend_prefix_lens_cpu[:n], extend_seq_lens_cpu=batch.extend_seq_lens_cpu[:n],
        out_cache_loc=batch.out_cache_loc[:n], attn_backend=backend, logits_indices=None,
    )


def pool_bytes(batch_size: int, context: int, page_size: int, shapes: Shapes) -> int:
    """What `build_decode_batch` allocates (bf16 latent rows and the int32 slot table)."""
    width = shapes.kv_lora_rank + shapes.rope_dim
    slots = batch_size * -(-context // page_size) * page_size + page_size
    return slots * width * 2 + (batch_size + 1) * context * 4


def resident_bytes(batch: ForwardBatch) -> int:
    kv = batch.token_to_kv_pool.kv_buffer[0]
    table = batch.req_to_token_pool.req_to_token
    return kv.numel() * kv.element_size() + table.numel() * table.element_size()


def torch_backend_bytes(batch_size: int, context: int, heads: int, shapes: Shapes) -> int:
    """Peak extra memory of the torch backend's decode: the gathered rows (bf16, then fp32), its slot
    table (int32 gather, int64 copy, masked copy) and mask, and up to five fp32 [B, H, L] score
    temporaries (two matmuls, their sum, the masked scores, the softmax)."""
    width = shapes.kv_lora_rank + shapes.rope_dim
    n = batch_size * context
    return n * (width * 6 + 21) + 5 * batch_size * heads * context * 4


def triton_backend_bytes(batch_size: int, heads: int, shapes: Shapes) -> int:
    return batch_size * heads * TRITON_SPLIT_ALLOWANCE * (shapes.kv_lora_rank + 2) * 4


def graph_time(fn, timer: Timer, repeats: int) -> tuple[float | None, str | None]:
    """Seconds per replay of `fn` captured in a CUDA graph, or (None, why not)."""
    if timer.device.type != "cuda":
        return None, "no CUDA device"
    try:
        stream = torch.cuda.Stream(timer.device)
        stream.wait_stream(torch.cuda.current_stream(timer.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(timer.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timer.median(graph.replay, repeats), None
    except Exception as e:  # noqa: BLE001 -- recorded in the JSON; eager timings still stand
        return None, f"{type(e).__name__}: {e}"


def run_case(
    batch: ForwardBatch, heads: int, shapes: Shapes, args: argparse.Namespace, timer: Timer, copy_bw: float,
    budget: int, peer: Any, seed: int,
) -> dict[str, Any]:
    b, ctx = batch.batch_size, batch.seq_lens_cpu[0]
    r, p = shapes.kv_lora_rank, shapes.rope_dim
    dtype, device = batch.token_to_kv_pool.dtype, timer.device
    layer = AttentionLayer(0, heads, 1, r + p, r, SOFTMAX_SCALE, kv_lora_rank=r, qk_rope_head_dim=p)
    gdev = torch.Generator(device=device).manual_seed(seed)
    q_latent = (torch.randn(b, heads, r, generator=gdev, device=device) * Q_STD).to(dtype)
    q_pe = (torch.randn(b, heads, p, generator=gdev, device=device) * Q_STD).to(dtype)
    ours = batch.attn_backend
    ours.init_forward_metadata(batch)

    def call() -> torch.Tensor:
        return ours.forward_mla_absorb(q_latent, q_pe, layer, batch)

    out = call()
    t = timer.median(call, args.repeats, args.warmup)
    t_graph, graph_error = graph_time(call, timer, args.repeats)
    nbytes = b * ctx * (r + p) * 2 + b * heads * (r + p) * 2 + b * heads * r * 2
    row: dict[str, Any] = {
        "us": t * 1e6, "graph_us": None if t_graph is None else t_graph * 1e6,
        "bytes_moved": nbytes, "GBps": nbytes / t / 1e9, "fraction_of_copy_bw": nbytes / t / copy_bw,
        "graph_fraction_of_copy_bw": None if t_graph is None else nbytes / t_graph / copy_bw,
    }
    if graph_error:
        row["graph_error"] = graph_error
    # The peer: the torch backend on the same inputs where its fp32 gather fits the budget; else it
    # is the correctness reference on the largest leading sub-batch that fits.
    room = budget - resident_bytes(batch) - triton_backend_bytes(b, heads, shapes)
    fits = max(1, min(b, room // torch_backend_bytes(1, ctx, heads, shapes)))
    ref_batch = sub_batch(batch, fits, peer)
    peer.init_forward_metadata(ref_batch)

    def call_peer() -> torch.Tensor:
        return peer.forward_mla_absorb(q_latent[:fits], q_pe[:fits], layer, ref_batch)

    ref = call_peer()
    if fits == b:
        t_peer = timer.median(call_peer, max(1, min(args.repeats, 5)), warmup=1)
        row.update(peer_us=t_peer * 1e6, speedup_vs_peer=t_peer / t)
    else:
        need = torch_backend_bytes(b, ctx, heads, shapes) / 2**30
        row.update(peer_us=None, speedup_vs_peer=None, peer_skipped=f"{args.peer} backend needs ~{need:.1f} GiB")
    diff = (out[:fits].float() - ref.float()).abs()
    ref_max = float(ref.float().abs().max())
    max_diff = float(diff.max())
    row.update(checked_requests=fits, max_abs_diff=max_diff, ref_max_abs=ref_max,
               correct=bool(torch.isfinite(out).all()) and max_diff <= ATOL + RTOL * ref_max)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, read off the rows."""
    at = {f"page_{r['page_size']}": r["fraction_of_copy_bw"] for r in rows
          if (r["batch"], r["context"], r["heads"]) == (64, 4096, 16)}
    speedups = [r["speedup_vs_peer"] for r in rows if r.get("speedup_vs_peer")]
    return {
        "fraction_of_copy_bw_at_b64_c4096_h16": at or None, "target_fraction": 0.8,
        "fraction_target_met": bool(at) and min(at.values()) >= 0.8,
        "min_speedup_vs_peer": min(speedups) if speedups else None,
        "median_speedup_vs_peer": sorted(speedups)[len(speedups) // 2] if speedups else None,
        "target_speedup": 10.0, "speedup_target_met": bool(speedups) and min(speedups) >= 10.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/mla_decode_<device>.json)")
    ap.add_argument("--backend", default="triton", help="attention backend under test")
    ap.add_argument("--peer", default="torch", help="reference backend (timed and used for the check)")
    ap.add_argument("--heads", type=int, nargs="*")
    ap.add_argument("--batches", type=int, nargs="*")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--page-sizes", type=int, nargs="*")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (median; default 20, smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3, smoke 1)")
    ap.add_argument("--mem-budget-gib", type=float, default=None,
                    help="skip cases (and torch peers) needing more (default: 85%% of free GPU memory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = SMOKE_SHAPES if args.smoke else FULL
    shapes = dataclasses.replace(base, **{k: v for k in ("heads", "batches", "contexts", "page_sizes")
                                          if (v := getattr(args, k)) is not None})
    args.repeats = args.repeats or (1 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    device = bench_device(args.smoke)
    dtype = torch.bfloat16
    if args.mem_budget_gib is not None:
        budget = int(args.mem_budget_gib * 2**30)
    elif device.type == "cuda":
        budget = int(0.85 * torch.cuda.mem_get_info(device)[0])
    else:
        budget = 1 << 30
    out_path = Path(args.out) if args.out else RESULTS / f"mla_decode_{device_slug(device)}.json"

    copy_bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (16 << 20))
    timer = Timer(device)
    ours = create_attention_backend(args.backend)
    peer = create_attention_backend(args.peer)
    result: dict[str, Any] = {
        "benchmark": "mla_decode", "smoke": args.smoke, "machine": machine_info(device),
        "copy_bandwidth_GBps": copy_bw / 1e9, "dtype": str(dtype), "backend": args.backend, "peer": args.peer,
        "kv_lora_rank": shapes.kv_lora_rank, "qk_rope_head_dim": shapes.rope_dim, "repeats": args.repeats,
        "mem_budget_GiB": budget / 2**30, "rows": [], "skipped": [],
    }
    print(f"{result['machine']['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    case = 0
    for page_size in shapes.page_sizes:
        for b in sorted(shapes.batches):
            for ctx in sorted(shapes.contexts):
                need = pool_bytes(b, ctx, page_size, shapes) + triton_backend_bytes(b, max(shapes.heads), shapes)
                key = {"page_size": page_size, "batch": b, "context": ctx}
                if need > budget:
                    result["skipped"].append({**key, "reason": f"needs {need / 2**30:.1f} GiB > budget"})
                    continue
                batch = build_decode_batch(b, ctx, page_size, shapes, dtype, device, ours, args.seed + case)
                for heads in shapes.heads:
                    case += 1
                    row = {**key, "heads": heads, **run_case(batch, heads, shapes, args, timer, copy_bw, budget,
                                                             peer, args.seed + case)}
                    result["rows"].append(row)
                    result["targets"] = summarize(result["rows"])
                    result["all_correct"] = all(r["correct"] for r in result["rows"])
                    write_result(out_path, result)  # after every case, so a cut-off run keeps what it measured
                del batch
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    result["targets"] = summarize(result["rows"])
    result["all_correct"] = all(r["correct"] for r in result["rows"])
    write_result(out_path, result)
    print_table(result["rows"], [
        ("page_size", "page", "d"), ("heads", "H", "d"), ("batch", "B", "d"), ("context", "L", "d"),
        ("us", "us", ".1f"), ("graph_us", "graph us", ".1f"), ("GBps", "GB/s", ".0f"),
        ("fraction_of_copy_bw", "of copy", ".2f"), ("peer_us", "peer us", ".1f"),
        ("speedup_vs_peer", "speedup", ".1f"), ("max_abs_diff", "max diff", ".1e"), ("correct", "ok", ""),
    ])
    print(f"targets: {result['targets']}")
    print(f"wrote {out_path}")
    wrong = [r for r in result["rows"] if not r["correct"]]
    if wrong:
        print(f"FAIL: {args.backend} differs from {args.peer} in {len(wrong)} case(s): "
              + "; ".join(f"page {r['page_size']} H {r['heads']} B {r['batch']} L {r['context']}: "
                          f"max diff {r['max_abs_diff']:.3g} (ref max {r['ref_max_abs']:.3g})" for r in wrong),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
