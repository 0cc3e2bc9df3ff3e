"""CPU cost of sampling one engine step (executor/sampler.py): the native draw against the torch definition.

On the CPU the sampled rows of a step are drawn by one native call (`cpp_experts.sample_rows`: temperature,
top_k, top_p, min_p, counter-based noise for the candidates alone, the best score), and their logprobs come
from another (`cpp_experts.row_logprobs`); the torch code is the definition, kept for other devices and for
the rows the native calls leave. Before it, the default model's
own defaults (temperature 0.2, top_p 0.9) cost ~0.5 ms a row on the engine's sampling thread: mt19937 draws
for all 49152 columns (~150 us), a topk (~100 us), two exps over the row, ~60 small ops. Timed: one
`Sampler` call for B rows (each its own seed), on real logits (the default model's, at B consecutive
positions of a prompt of the Python standard library's documentation), natively ("native"), in torch drawing
among the candidates ("torch") and in torch with every row whole ("whole_rows"), and, with `--baseline
FILE`, an earlier commit's executor/sampler.py (`git show 063e658:executor/sampler.py > FILE`: mt19937
noise, so other tokens), in the same run, rounds interleaved, medians; the decode step of the same model (one
request) is timed beside them for scale, and the three ways of today are checked to pick the same tokens.

    .venv/bin/python bench/sampler_cpu.py [--rounds 7] [--baseline FILE] [--out bench/results/sampler_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import cpu_common as cc  # noqa: E402

# (executor.sampler._NATIVE, _CANDIDATES) of each way of today's sampler
WAYS = {"native": (True, True), "torch": (False, True), "whole_rows": (False, False)}
# temperature, top_p, top_k, top_logprobs (0: no logprobs)
SETTINGS = {"t0.2_top_p0.9 (the default model's)": (0.2, 0.9, -1, 0), "t0.7_top_p0.95": (0.7, 0.95, -1, 0),
            "t1.0_top_k40": (1.0, 1.0, 40, 0), "t1.0 (no filter)": (1.0, 1.0, -1, 0),
            "t0.2_top_p0.9, top_logprobs 5": (0.2, 0.9, -1, 5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline", default=None, metavar="FILE", help="an earlier executor/sampler.py to time beside")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as the engine's sampling thread (engine/core.py)
    import json as json_module

    import executor.sampler as sampler_module
    from executor.cpu_forward import auto_kv_dtype
    from executor.model_runner import ModelRunner, RequestSlice
    from executor.sampler import Sampler, SamplingRow
    from models.builtin import DEFAULT_MODEL, resolve_model_path
    from models.loader.load import load_model
    from models.loader.tokenizer import load_tokenizer
    from scheduler.sampling_params import SamplingParams

    path = str(resolve_model_path(DEFAULT_MODEL))
    loaded = load_model(path, dtype="float32", cpu_weights="file", progress=False)
    ids = load_tokenizer(path).encode(json_module.__doc__)[:200]
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=16 * 256, max_running_requests=17,
                         max_context_len=512, kv_dtype=auto_kv_dtype(loaded.model, loaded.dtype))
    slots = [runner.req_to_token_pool.alloc() for _ in range(16)]
    logits = runner.forward(runner.build_batch([RequestSlice(slots[0], 0, ids)], all_logits=True)).clone()
    for slot in slots[1:]:
        runner.forward(runner.build_batch([RequestSlice(slot, 0, ids)]))
    decode: dict[int, list[float]] = {1: [], 16: []}  # the decode step of 1 and of 16 requests, for scale
    pos = len(ids)
    for _ in range(20):
        for b in decode:
            t = time.perf_counter()
            runner.forward(runner.build_batch([RequestSlice(slot, pos, [ids[pos % len(ids)]]) for slot in slots[:b]]))
            decode[b].append(time.perf_counter() - t)
        pos += 1
    vocab = loaded.config.vocab_size
    sampler = Sampler(vocab)
    baseline = None
    ways = list(WAYS)
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_sampler", args.baseline)
        module = sys.modules["baseline_sampler"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        baseline = module.Sampler(vocab)
        ways.append("baseline")
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    same = True
    for r in range(args.rounds):
        for name, (temperature, top_p, top_k, top_logprobs) in SETTINGS.items():
            for b in (1, 16):
                x = logits[-b:]
                params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=top_logprobs > 0,
                                        top_logprobs=top_logprobs)
                rows = [SamplingRow(params, i, 3, ids, [], [0]) for i in range(b)]
                picked = {}
                for way in ways if r % 2 == 0 else ways[::-1]:
                    if way != "baseline":
                        sampler_module._NATIVE, sampler_module._CANDIDATES = WAYS[way]
                    call = baseline if way == "baseline" else sampler
                    call(x, rows)
                    t = time.perf_counter()
                    for _ in range(3):
                        out = call(x, rows)
                    results.setdefault(name, {}).setdefault(f"B{b}", {}).setdefault(way, []).append(
                        (time.perf_counter() - t) / 3)
                    picked[way] = out.token_ids
                same = same and picked["native"] == picked["torch"] == picked["whole_rows"]
    sampler_module._NATIVE, sampler_module._CANDIDATES = True, True
    med = statistics.median
    summary = {}
    for name, per_b in results.items():
        summary[name] = {}
        for b, v in per_b.items():
            row = {f"{way}_ms": med(v[way]) * 1e3 for way in ways}
            row.update({f"native_speedup_vs_{way}": med(v[way]) / med(v["native"]) for way in ways if way != "native"})
            summary[name][b] = row
    machine = cc.machine_info()
    result = {"benchmark": "sampler_cpu", "machine": machine, "versions": cc.versions(), "model": DEFAULT_MODEL,
              "vocab": vocab, "rounds": args.rounds, "decode_step_ms": {f"B{b}": statistics.median(v) * 1e3 for b, v in decode.items()},
              "baseline": args.baseline,
              "same_tokens": same, "summary": summary, "raw": results}
    out = args.out or cc.RESULTS / f"sampler_cpu_{args.tag or cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("raw", "machine", "versions")}, indent=1))
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
