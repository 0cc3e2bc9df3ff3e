"""GPTQ and AWQ checkpoints on the CPU: decode speed and the memory the weights hold, against the same model's
bf16 safetensors and a Q4_0 GGUF of it (ours and llama.cpp's `llama-bench`), in one run.

The model is bench/make_deepseek_gguf.py's DeepSeek-V2-Lite-shaped checkpoint (bf16 safetensors, 4 layers,
random weights; its bf16 GGUF too). This script writes, once, into the same cache:
  * `gptq4/`: GPTQ 4-bit, symmetric, group 128 (`models.loader.int_quant_writer.write_gptq`, round to nearest):
    the CPU kernels hold it as Q4_0 blocks, the file's exact values;
  * `awq4/`: AWQ 4-bit with zero points, group 128: held as Q5_0 blocks (4-bit codes less a zero point span 5
    bits);
  * `model-q4_0.gguf`: llama.cpp's own Q4_0 (`llama-quantize` from the bf16 GGUF; built by `make peers`), beside
    make_deepseek_gguf.py's Q8_0.
A `+q8_0` format is that file loaded with `--cpu-weight-dtype q8_0`: its float linear weights (all of bf16's;
GPTQ's LM head) quantized to Q8_0 as they load (MLA's kv_b_proj stays the absorbed attention's bf16).
Each is loaded by the engine core as `mlaserve serve`'s engine process loads it (bench/deepseek_cpu.py's
`Ours`: the native CPU forward, weights as the file's blocks, routed experts in the C++ pool); the GGUF also
by `llama-bench -n <tokens>` (both GGUFs). Decode tok/s of one request (a `--decode-prompt`-token prompt, then
`--decode-tokens` tokens, greedy), interleaved rounds whose order rotates, medians; the machine may be shared
and noisy: measurements wait for a quiet machine and are redone when other processes ran (bench/cpu_common).
`resident_weight_bytes` sums the parameters, buffers and the native operators' packed weights;
`decode_weight_bytes` is what one decoded token reads of them: GPTQ and AWQ files keep
the LM head unquantized (bf16 here), where llama.cpp's Q4_0 makes it Q6_K, and MLA's kv_b_proj is dequantized
for the absorbed attention, so the 4-bit files read more a token than the Q4_0 GGUF.

    .venv/bin/python bench/make_deepseek_gguf.py --types bf16     # once
    .venv/bin/python bench/int_quant_cpu.py [--rounds 3] [--decode-tokens 32] [--out bench/results/...json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
import deepseek_cpu as ds  # noqa: E402
import make_deepseek_gguf as mk  # noqa: E402
import peers  # noqa: E402

# a "+q8_0" format is the same file loaded with --cpu-weight-dtype q8_0 (its float weights quantized as they load)
FORMATS = ("bf16", "bf16+q8_0", "gptq4", "gptq4+q8_0", "awq4", "q4_0", "q8_0")
GGUFS = ("q4_0", "q8_0")  # llama.cpp's files, measured by ours and llama-bench alike


def write_format(hf: Path, fmt: str, out: Path) -> dict[str, Any]:
    """`out`: `hf` rewritten as `fmt` (`.complete` marks a finished one)."""
    from models.loader.int_quant_writer import write_awq, write_gptq  # (torch: after --threads is set)

    done = out / ".complete"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(hf, out)
    t = time.time()
    if fmt == "gptq4":
        write_gptq(out, 4, 128, symmetric=True)
    else:
        write_awq(out, 128)
    info = {"format": fmt, "group_size": 128, "seconds": round(time.time() - t, 1),
            "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
    done.write_text(json.dumps(info) + "\n")
    return info


def gguf_file(cache: Path, qtype: str, layers: int, seed: int, threads: int) -> Path | None:
    """llama.cpp's `qtype` GGUF of the model: make_deepseek_gguf.py's, or `llama-quantize` from its bf16 one."""
    out = mk.gguf_path(cache, qtype, layers, seed)
    src = mk.gguf_path(cache, "bf16", layers, seed)
    binary = peers.llama_cpp_bin("llama-quantize")
    if not out.is_file() and src.is_file() and binary is not None:
        mk._run(mk.quantize_command(binary, src, out, qtype.upper(), threads))
    return out if out.is_file() else None


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights one decoded token reads: every dense operator (the LM head whole, tied or not; the
    embedding only a row, left out), the float parameters (norms, routers, MLA's absorbed kv_b_proj), and
    each MoE layer's routed experts at top_k of n."""
    from models.experts import CppExperts
    from models.native import NativeEmbedding, NativeLinear

    modules = list(model.modules())
    ops = {id(m.op): int(m.op.memory_bytes) for m in modules if isinstance(m, NativeLinear)}
    heads = [m for m in modules if isinstance(m, NativeLinear) and m.tied_to is not None]
    embeddings = {id(m.op) for m in modules if isinstance(m, NativeEmbedding)} - {id(m.op) for m in heads}
    dense = sum(b for k, b in ops.items() if k not in embeddings)
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(m.weights.memory_bytes * m.top_k // m.num_experts for m in modules if isinstance(m, CppExperts))
    return dense + floats + experts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="where make_deepseek_gguf.py put the model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: the usable cores")
    ap.add_argument("--decode-prompt", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    cc.add_quiet_args(ap, retries=2)
    ap.add_argument("--out", default=None, help="default: bench/results/int_quant_cpu_<machine-tag>.json")
    args = ap.parse_args(argv)
    # what deepseek_cpu's `Ours` reads
    args.prompt_tokens, args.dtype, args.engine_arg = args.decode_prompt, "auto", []
    threads = args.threads or cc.cpuinfo()["cores"]
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    import torch

    from models.experts import CppExperts
    from models.native import NativeLinear

    torch.set_num_threads(threads)
    cache = args.cache_dir or mk.default_cache_dir()
    hf = mk.model_dir(cache, args.layers, args.seed) / "hf"
    if not (hf / ".complete").is_file():
        raise SystemExit(f"{hf} not found: run bench/make_deepseek_gguf.py --types bf16")
    paths: dict[str, Path] = {}
    written: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for fmt in args.formats:
        base = fmt.removesuffix("+q8_0")
        if base == "bf16":
            paths[fmt] = hf
        elif base in GGUFS:
            gguf = gguf_file(cache, base, args.layers, args.seed, threads)
            if gguf is None:
                skipped[fmt] = f"no {base} GGUF: needs the bf16 GGUF (make_deepseek_gguf.py) and llama-quantize (make peers)"
            else:
                paths[fmt] = gguf
        else:
            out = mk.model_dir(cache, args.layers, args.seed) / base
            written[base] = write_format(hf, base, out)
            paths[fmt] = out
    ours: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    for fmt, path in paths.items():
        o = ds.Ours(path, argparse.Namespace(**{**vars(args), "engine_arg": (
            ["cpu_weight_dtype=q8_0"] if fmt.endswith("+q8_0") else [])}), "cpp")
        o.request(o.prompt(8, 99), 4)  # warm-up
        nf = o.core.runner.native_forward
        modules = list(o.core.runner.model.modules())
        formats = sorted({str(m.op.weight_format) for m in modules if isinstance(m, NativeLinear)})
        experts = sorted({str(m.weight_format) for m in modules if isinstance(m, CppExperts)})
        loaded[fmt] = o
        ours[fmt] = {"path": str(path), "load_s": o.load_s, "resident_weight_bytes": o.resident_bytes,
                     "decode_weight_bytes": decode_weight_bytes(o.core.runner.model),
                     "load_anon_bytes": o.load_anon_bytes, "native_forward": nf is not None,
                     "linear_formats": formats, "expert_formats": experts, "tg": []}
        print(f"{fmt}: loaded in {o.load_s:.1f} s, {o.resident_bytes / 2**30:.2f} GiB of weights "
              f"({ours[fmt]['decode_weight_bytes'] / 2**20:.0f} MiB read a token), linear {formats}, experts "
              f"{experts}", flush=True)
    lb = peers.llama_cpp_bin("llama-bench")
    lb_cmds = {f"llama-bench {g}": ds.llama_bench_command(lb, paths[g], threads, 0, args.decode_tokens, 1)
               for g in GGUFS if lb is not None and g in paths}
    peer: dict[str, list[dict[str, Any]]] = {w: [] for w in lb_cmds}
    who = [*loaded, *lb_cmds]
    for r in range(args.rounds):
        order = who[r % len(who):] + who[: r % len(who)]
        line = []
        for w in order:
            if w in lb_cmds:
                peer[w].append(ds.measured(args, lambda: ds.read_after(ds.run_llama_bench(lb_cmds[w], 3600), threads),
                                           w))
                line.append(f"{w} {ds._lb_line(peer[w][-1])}")
            else:
                o = loaded[w]
                ours[w]["tg"].append(ds.measured(args, lambda: ds.read_after(
                    o.tg(args.decode_prompt, args.decode_tokens, seed=100 + r), threads), f"ours {w}"))
                line.append(f"{w} {ours[w]['tg'][-1]['tok_s']:.2f}")
        print(f"round {r + 1}: " + ", ".join(line) + " tok/s", flush=True)
    for fmt, o in loaded.items():
        ours[fmt]["tg_tok_s"] = ds.summarize_rounds(ours[fmt]["tg"], args.retry_busy)
        o.close()
    gc.collect()
    peer_tok_s = {w: cc.median([p["tg"]["avg_ts"] for p in rounds if "error" not in p and "tg" in p])
                  for w, rounds in peer.items()}
    q4 = peer_tok_s.get("llama-bench q4_0")
    result = {
        "benchmark": "int_quant_cpu",
        "machine": {**cc.machine_info(), "threads": threads},
        "versions": {**cc.versions(), "llama_cpp": peers.binary_version(lb) if lb else None},
        "model": {"hf": str(hf), **mk.config_summary(hf)},
        "workload": {"decode_prompt": args.decode_prompt, "decode_tokens": args.decode_tokens, "rounds": args.rounds},
        "written": written, "ours": ours, "skipped": skipped,
        "llama_bench": {w: {"command": lb_cmds[w], "rounds": peer[w], "tg_tok_s": peer_tok_s[w]} for w in lb_cmds},
        "ratios": {f"{fmt}_over_llama_q4_0": cc.ratio(ours[fmt].get("tg_tok_s"), q4) for fmt in ours},
        "note": "medians over interleaved rounds (the order rotates); the machine may be shared and noisy",
    }
    out = args.out or cc.RESULTS / f"int_quant_cpu_{cc.machine_tag(result['machine'])}.json"
    cc.write_json(out, result)
    print(f"{'format':11s} {'weights GiB':>12s} {'MiB/token':>10s} {'tg tok/s':>10s} {'GB/s read':>10s} "
          f"{'x llama Q4_0':>13s}")
    for fmt, e in ours.items():
        ratio = result["ratios"][f"{fmt}_over_llama_q4_0"]
        rate = e["tg_tok_s"] or 0
        print(f"{fmt:11s} {e['resident_weight_bytes'] / 2**30:12.2f} {e['decode_weight_bytes'] / 2**20:10.0f} "
              f"{rate:10.2f} {rate * e['decode_weight_bytes'] / 1e9:10.1f} {'' if ratio is None else f'{ratio:.2f}x':>13s}")
    for w, rate in peer_tok_s.items():
        print(f"{w}: {rate:.2f} tok/s" if rate else f"{w}: no result")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
