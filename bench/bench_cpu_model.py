"""CPU benchmark of the model core: prefill and single-request decode of a GGUF model through the
torch attention backend, against llama.cpp (llama-cpp-python) on the same machine, in one run.

Floor: a decode step must stream every weight once, so time >= weight bytes / memory bandwidth, with
the bandwidth measured here by a large tensor copy. Reported as ratios: achieved / floor, and
ours / llama.cpp. Medians of repeated runs after warm-up.

    .venv/bin/python bench/bench_cpu_model.py [--model smollm2-135m-instruct] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large memcpy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def bench_ours(model: str, dtype: str, prompt: list[int], n_decode: int, repeats: int) -> dict:
    from models.loader.load import load_model
    from executor.model_runner import ModelRunner, RequestSlice

    loaded = load_model(model, dtype=dtype, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=len(prompt) + n_decode + 8,
                         max_running_requests=1, max_context_len=len(prompt) + n_decode + 8)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())

    def prefill() -> float:
        row = runner.req_to_token_pool.alloc()
        t = time.perf_counter()
        runner.forward(runner.build_batch([RequestSlice(row, 0, prompt)]))
        dt = time.perf_counter() - t
        runner.free_request(row, len(prompt))
        return dt

    def decode() -> float:
        t = time.perf_counter()
        runner.generate_greedy(prompt, n_decode)
        return time.perf_counter() - t

    prefill()
    decode()
    pre = statistics.median(prefill() for _ in range(repeats))
    whole = statistics.median(decode() for _ in range(repeats))
    per_token = (whole - pre) / (n_decode - 1)
    return {"dtype": str(loaded.dtype), "weight_bytes": weight_bytes, "prefill_s": pre,
            "prefill_tok_s": len(prompt) / pre, "decode_s_per_token": per_token, "decode_tok_s": 1 / per_token}


def bench_llama_cpp(path: str, prompt: list[int], n_decode: int, repeats: int, threads: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + n_decode + 8, n_threads=threads, verbose=False)

    def run() -> tuple[float, float]:
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t = time.perf_counter()
        llm.eval(prompt)
        t_pre = time.perf_counter() - t
        for _ in range(n_decode - 1):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        return t_pre, time.perf_counter() - t

    run()
    runs = [run() for _ in range(repeats)]
    pre = statistics.median(r[0] for r in runs)
    whole = statistics.median(r[1] for r in runs)
    per_token = (whole - pre) / (n_decode - 1)
    return {"prefill_s": pre, "prefill_tok_s": len(prompt) / pre, "decode_s_per_token": per_token,
            "decode_tok_s": 1 / per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/cpu_model_smollm2.json")
    args = ap.parse_args()

    from models.builtin import resolve_model_path

    path = str(resolve_model_path(args.model))
    threads = torch.get_num_threads()
    prompt = torch.randint(10, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    bandwidth = copy_bandwidth()
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads,
                    "copy_bandwidth_GBps": bandwidth / 1e9},
        "model": args.model, "prompt_len": args.prompt_len, "decode_tokens": args.decode,
        "llama_cpp": bench_llama_cpp(path, prompt, args.decode, args.repeats, threads),
        "ours": {},
    }
    for dtype in ("float32", "bfloat16"):
        r = bench_ours(args.model, dtype, prompt, args.decode, args.repeats)
        floor = r["weight_bytes"] / bandwidth
        r["decode_floor_s"] = floor
        r["decode_fraction_of_floor"] = floor / r["decode_s_per_token"]
        if result["llama_cpp"]:
            r["decode_vs_llama_cpp"] = result["llama_cpp"]["decode_s_per_token"] / r["decode_s_per_token"]
            r["prefill_vs_llama_cpp"] = result["llama_cpp"]["prefill_s"] / r["prefill_s"]
        result["ours"][dtype] = r
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
