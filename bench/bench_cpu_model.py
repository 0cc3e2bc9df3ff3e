"""CPU benchmark of the model core on one GGUF file: prefill and single-request greedy decode through our
CPU-native forward (the weights as the file stores them, `--cpu-weight-dtype file`), against llama.cpp
(llama-cpp-python, the same file, the same thread count; its extra weight buffers off on a CPU with
AMX-INT8, where they crash: bench/peers.py) in the same run.

Floor: a decode step reads every weight it multiplies by once, so seconds per token >= those bytes
(every linear layer and the output head in the kernels' packed form, which is the file's blocks
re-laid; the embedding contributes one row) / the read bandwidth. For a MoE file that counts every
routed expert, not the few a token reads: its floor fields do not apply (deepseek_cpu.py gives that
floor), but `--profile` does. The bandwidth is measured in the
same run two ways: a streaming read (an f32 QuantLinear at M = 1, several read streams per thread, as
quant_linear_cpu.py does) and a torch sum (one stream per thread); the fraction of the floor is given
for both. Rounds are interleaved (ours, then llama.cpp, per round) and medians reported: the machine is
shared and noisy. `--torch` also times the torch-op forward of the same model (fp32, the path before the
native forward) for the before/after ratio.

    .venv/bin/python bench/bench_cpu_model.py [--model smollm2-135m-instruct] [--out bench/results/x.json]

`--general-batches` also times our native forward with every decode batch built the general way (torch
tensors made per step) instead of written into the native forward's reused inputs, for that change's
before/after ratio in one run.

`--kv-ahead-off` also times our native forward with its decode program's prefetch of each layer's KV rows
off (CpuModel.kv_ahead), for that change's ratio in one run.

`--passes` also times our native forward with its decode program off (every pass a run of the thread
pool, as before that program: csrc/model.h), for that change's ratio in one run.

`--profile` adds where a decode step's time goes: the native forward's phases (q·k·v, attention, o,
gate·up, down, the LM head, ...) timed over one more generation, and the time outside the forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.client import set_cpu_wait_policy  # noqa: E402

set_cpu_wait_policy(os.environ)  # before torch starts its OpenMP threads, as for the engine process

import torch  # noqa: E402

from mlaserve.argtypes import positive_int  # noqa: E402
from bench.cpu_common import (StreamRead, machine_info, phase_profile, print_phase_profile, ratio, read_bandwidth,  # noqa: E402
                               versions, write_json)
from engine.process import freeze_gc_heap  # noqa: E402


class Ours:
    """Our model runner on the file: `native` (the CPU-native forward) or the torch-op forward."""

    def __init__(self, path: str, native: bool, prompt: list[int], n_decode: int, reused_inputs: bool = True) -> None:
        from executor.cpu_forward import auto_kv_dtype
        from executor.model_runner import ModelRunner
        from models.loader.load import load_model
        from models.native import native_modules

        loaded = load_model(path, dtype="float32", cpu_weights="file" if native else None, progress=False)
        n = len(prompt) + n_decode + 8
        # the KV cache the server gives this model by default (--kv-dtype auto: bf16 for GGUF blocks)
        self.kv_dtype = auto_kv_dtype(loaded.model, loaded.dtype)
        self.runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=n, max_running_requests=1,
                                  max_context_len=n, kv_dtype=self.kv_dtype)
        if native and self.runner.native_forward is None:
            raise RuntimeError(f"the native forward is off: {self.runner.native_off_reason}")
        if native and not reused_inputs:
            self.runner.native_forward.decode_capacity = 0  # every decode batch built the general way
        ops = {id(m.op): m.op for m in native_modules(loaded.model) if type(m).__name__ == "NativeLinear"}
        experts = [m.weights.op for m in loaded.model.modules() if hasattr(m, "weights")]
        self.weight_bytes = sum(int(op.memory_bytes) for op in ops.values()) + sum(int(e.memory_bytes) for e in experts)
        if not native:
            self.weight_bytes = sum(p.numel() * p.element_size() for n_, p in loaded.model.named_parameters()
                                    if "embed_tokens" not in n_ or loaded.config.tie_word_embeddings)
        self.prompt, self.n_decode = prompt, n_decode

    def run(self, before_decode: Callable[[], None] | None = None) -> tuple[float, float]:
        """(prefill seconds, seconds per decoded token) of one greedy generation; `before_decode` is
        called between the prefill and the first decode step."""
        from executor.model_runner import RequestSlice

        r = self.runner
        row = r.req_to_token_pool.alloc()
        t = time.perf_counter()
        logits = r.forward(r.build_batch([RequestSlice(row, 0, self.prompt)]))
        t_pre = time.perf_counter() - t
        pos = len(self.prompt)
        if before_decode is not None:
            before_decode()
        t = time.perf_counter()
        for _ in range(self.n_decode):
            tok = r.greedy(logits)[-1]  # the engine's greedy pick: the LM head's argmax (executor.sampler)
            logits = r.forward(r.build_batch([RequestSlice(row, pos, [tok])]))
            pos += 1
        t_dec = (time.perf_counter() - t) / self.n_decode
        r.free_request(row, pos)
        return t_pre, t_dec

    def profile(self) -> dict[str, Any]:
        """One more greedy generation whose decode steps have the native forward's phases timed
        (CpuModel.set_profiling): per step, each phase's time, its parallel pool runs and the caller's
        wait in them, and the time outside the forward (Python: the greedy pick, building the batch)."""
        plan = self.runner.native_forward.plan
        try:
            _, t_dec = self.run(before_decode=lambda: plan.set_profiling(True))
            prof = plan.profile(reset=True)
        finally:
            plan.set_profiling(False)
        return phase_profile(prof, t_dec)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the same file (None where the package is absent)."""

    def __init__(self, path: str, prompt: list[int], n_decode: int, threads: int) -> None:
        from bench import peers

        self.llm = peers.open_llama(path, extra_buffers=peers.extra_buffers(), n_ctx=len(prompt) + n_decode + 8,
                                    n_threads=threads, n_threads_batch=threads, n_batch=512, logits_all=False,
                                    verbose=False)
        self.prompt, self.n_decode = prompt, n_decode

    def run(self) -> tuple[float, float]:
        llm = self.llm
        llm.reset()
        if hasattr(llm._ctx, "memory_clear"):
            llm._ctx.memory_clear(True)
        elif hasattr(llm._ctx, "kv_cache_clear"):
            llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        llm.eval(self.prompt)
        t_pre = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(self.n_decode):
            llm.eval([int(self.last_logits().argmax())])
        return t_pre, (time.perf_counter() - t) / self.n_decode

    def last_logits(self):
        """The last evaluated token's logits. Without logits_all, llama-cpp-python keeps no scores
        (`llm.scores` stays zero, n_batch rows), so they are read from the context itself."""
        import numpy as np

        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))


def summarize(samples: list[tuple[float, float]], prompt_len: int) -> dict[str, Any]:
    pre = statistics.median(s[0] for s in samples)
    dec = statistics.median(s[1] for s in samples)
    return {"prefill_s": pre, "prefill_tok_s": prompt_len / pre, "decode_s_per_token": dec, "decode_tok_s": 1 / dec,
            "decode_tok_s_samples": [1 / s[1] for s in samples], "prefill_tok_s_samples": [prompt_len / s[0] for s in samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model name or a GGUF path")
    ap.add_argument("--prompt-len", type=positive_int, default=128)
    ap.add_argument("--decode", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--torch", action="store_true", help="also time the torch-op forward (fp32)")
    ap.add_argument("--general-batches", action="store_true",
                    help="also time the native forward with decode batches built the general way")
    ap.add_argument("--passes", action="store_true",
                    help="also time the native forward with its decode program off (a pool run per pass)")
    ap.add_argument("--kv-ahead-off", action="store_true",
                    help="also time the native forward with its decode program's KV prefetch off (CpuModel.kv_ahead)")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, time the native forward's phases over one more generation")
    ap.add_argument("--out", default="bench/results/cpu_model_smollm2.json")
    args = ap.parse_args()

    import cpp_experts
    from models.builtin import resolve_model_path

    torch.set_num_threads(1)  # as the engine sets it under the native forward (engine/core.py): torch
    # only picks the next token, and its OpenMP workers would otherwise spin beside the pool after each
    # argmax (GOMP_SPINCOUNT is set before torch is imported, as the engine process does)
    try:
        path = str(resolve_model_path(args.model))
    except FileNotFoundError as e:
        ap.error(f"--model: {e}")
    prompt = torch.randint(10, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    pool = cpp_experts.WorkerPool(args.threads)
    stream = StreamRead(pool, 256 << 20)
    contenders: dict[str, Any] = {"ours_native": Ours(path, True, prompt, args.decode)}
    if args.general_batches:
        contenders["ours_native_general_batches"] = Ours(path, True, prompt, args.decode, reused_inputs=False)
    if args.passes:
        contenders["ours_native_passes"] = Ours(path, True, prompt, args.decode)
        contenders["ours_native_passes"].runner.native_forward.plan.decode_program = False
    if args.kv_ahead_off:
        contenders["ours_native_no_kv_ahead"] = Ours(path, True, prompt, args.decode)
        contenders["ours_native_no_kv_ahead"].runner.native_forward.plan.kv_ahead = False
    if args.torch:
        contenders["ours_torch_fp32"] = Ours(path, False, prompt, args.decode)
    try:
        contenders["llama_cpp"] = LlamaCpp(path, prompt, args.decode, args.threads)
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is skipped", flush=True)
    freeze_gc_heap()  # as the engine process, once the models are loaded
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
    stream_bw: list[float] = []
    sum_bw: list[float] = []
    for c in contenders.values():
        c.run()  # warm-up
    # the machine's memory bandwidth drifts (a shared host: 47 to 72 GB/s within minutes on a 2-core
    # Zen 5 VM), so each run's fraction of the floor is taken against stream reads right before and
    # right after it, and the reported fraction is the median of those paired fractions
    paired: dict[str, list[float]] = {k: [] for k in contenders}
    # the bytes a token reads: each of ours its own weights, the peer the same file's (as ours_native)
    weight_bytes = {k: (c if k.startswith("ours") else contenders["ours_native"]).weight_bytes
                    for k, c in contenders.items()}
    for rnd in range(args.rounds):
        sum_bw.append(read_bandwidth(256 << 20, threads=args.threads))
        before = stream.sample()
        stream_bw.append(before)
        for name, c in contenders.items():
            samples[name].append(c.run())
            after = stream.sample()
            paired[name].append(weight_bytes[name] / samples[name][-1][1] / ((before + after) / 2))
            before = after
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {1 / v[-1][1]:.1f} tok/s" for k, v in samples.items()), flush=True)
    profile = contenders["ours_native"].profile() if args.profile else None
    pool.close()

    sbw, tbw = statistics.median(stream_bw), statistics.median(sum_bw)
    results: dict[str, Any] = {}
    for name, s in samples.items():
        r = summarize(s, args.prompt_len)
        nbytes = weight_bytes[name]
        r["weight_bytes_per_token"] = nbytes
        r["kv_dtype"] = str(contenders[name].kv_dtype).replace("torch.", "") if name.startswith("ours") else "f16"
        r["floor_tok_s_stream_read"] = sbw / nbytes
        r["fraction_of_floor_stream_read"] = statistics.median(paired[name])
        r["fraction_of_floor_stream_read_samples"] = paired[name]
        r["fraction_of_floor_stream_read_of_medians"] = r["decode_tok_s"] * nbytes / sbw
        r["fraction_of_floor_sum_read"] = r["decode_tok_s"] * nbytes / tbw
        results[name] = r
    if profile is not None:
        results["ours_native"]["profile"] = profile
    peer = results.get("llama_cpp")
    ratio_of: Callable[[str, str], float | None] = lambda a, k: ratio(results[a][k], peer[k]) if peer else None
    report = {
        "machine": {**machine_info(), "threads": args.threads, "stream_read_GBps": sbw / 1e9,
                    "stream_read_samples_GBps": [v / 1e9 for v in stream_bw], "sum_read_GBps": tbw / 1e9,
                    "sum_read_samples_GBps": [v / 1e9 for v in sum_bw]},
        "versions": versions(), "model": args.model, "file": path, "prompt_len": args.prompt_len,
        "decode_tokens": args.decode, "rounds": args.rounds, "results": results,
        "ratios": {"decode_native_vs_llama_cpp": ratio_of("ours_native", "decode_tok_s"),
                   "prefill_native_vs_llama_cpp": ratio_of("ours_native", "prefill_tok_s")},
    }
    if "ours_native_general_batches" in results:
        report["ratios"]["decode_reused_inputs_vs_general_batches"] = ratio(
            results["ours_native"]["decode_tok_s"], results["ours_native_general_batches"]["decode_tok_s"])
    if "ours_native_passes" in results:
        report["ratios"]["decode_program_vs_passes"] = ratio(results["ours_native"]["decode_tok_s"],
                                                            results["ours_native_passes"]["decode_tok_s"])
    if "ours_native_no_kv_ahead" in results:
        report["ratios"]["decode_kv_ahead_vs_off"] = ratio(results["ours_native"]["decode_tok_s"],
                                                          results["ours_native_no_kv_ahead"]["decode_tok_s"])
    if "ours_torch_fp32" in results:
        report["ratios"]["decode_native_vs_torch_fp32"] = ratio(results["ours_native"]["decode_tok_s"],
                                                               results["ours_torch_fp32"]["decode_tok_s"])
        report["ratios"]["prefill_native_vs_torch_fp32"] = ratio(results["ours_native"]["prefill_tok_s"],
                                                                results["ours_torch_fp32"]["prefill_tok_s"])
    out = write_json(args.out, report)
    print(f"stream read {sbw / 1e9:.1f} GB/s, torch sum {tbw / 1e9:.1f} GB/s, {args.threads} threads")
    for name, r in results.items():
        print(f"{name:28s} prefill {r['prefill_tok_s']:8.1f} tok/s  decode {r['decode_tok_s']:7.1f} tok/s  "
              f"floor {r['floor_tok_s_stream_read']:7.1f}  of floor {r['fraction_of_floor_stream_read']:.2f}")
    print({k: None if v is None else round(v, 3) for k, v in report["ratios"].items()})
    if profile is not None:
        print_phase_profile(profile)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
