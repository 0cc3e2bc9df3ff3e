"""CPU cost of sampling one engine step with top_p (executor/sampler.py): the partial sort and the draw among candidates.

top_p alone used to sort every row whole (49152 logits of the default model: 3.3 ms a row on the engine's
one sampling thread, longer than the model's decode step), and the default model's own defaults are
temperature 0.2, top_p 0.9. Now each row's best 64 are sorted first (`_TOP_P_FIRST`), more only where their
mass falls short of top_p; and exp's argument is clamped at -87 (`_TINY_EXP`), below which torch's CPU exp
takes a slow path (the code before also paid that: its softmax over the sorted row took 5.3 ms a row at
temperature 0.2 in this benchmark's first run, 80 ms for 16 rows). Timed: one `Sampler` call for B rows
(each its own seed), on real logits (the default model's, at B consecutive positions of a prompt of the
Python standard library's documentation), the sampler as it is against the full sort (`_TOP_P_FIRST` set to
the vocabulary, with today's clamped exp) and against every row drawn whole (`_CANDIDATES` off: filtered to
-inf, Gumbel noise at every column, argmax over the row, where now a row with top_p draws among the tokens
it left, with their noise alone), in the same run, rounds interleaved, medians; the decode step of the same model (one request)
is timed beside them for scale, and every way is checked to pick the same tokens.

    .venv/bin/python bench/sampler_cpu.py [--rounds 7] [--out bench/results/sampler_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import cpu_common as cc  # noqa: E402

# "partial": the sampler as it is; "full": top_p's full sort; "whole_rows": every row drawn whole
WAYS = ("partial", "full", "whole_rows")
SETTINGS = {"t0.2_top_p0.9 (the default model's)": (0.2, 0.9), "t0.7_top_p0.95": (0.7, 0.95), "t1.0_top_p0.9": (1.0, 0.9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
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
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=2, max_context_len=512,
                         kv_dtype=auto_kv_dtype(loaded.model, loaded.dtype))
    row = runner.req_to_token_pool.alloc()
    logits = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True)).clone()
    decode = []
    pos = len(ids)
    for _ in range(20):
        t = time.perf_counter()
        runner.forward(runner.build_batch([RequestSlice(row, pos, [ids[pos % len(ids)]])]))
        decode.append(time.perf_counter() - t)
        pos += 1
    vocab = loaded.config.vocab_size
    sampler = Sampler(vocab)
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    same = True
    for r in range(args.rounds):
        for name, (temperature, top_p) in SETTINGS.items():
            for b in (1, 16):
                x = logits[-b:]
                rows = [SamplingRow(SamplingParams(temperature=temperature, top_p=top_p), i, 3, ids, [], [0])
                        for i in range(b)]
                picked = {}
                order = WAYS if r % 2 == 0 else WAYS[::-1]
                for way in order:
                    sampler_module._TOP_P_FIRST = vocab if way == "full" else 64
                    sampler_module._CANDIDATES = way != "whole_rows"
                    sampler(x, rows)
                    t = time.perf_counter()
                    for _ in range(3):
                        out = sampler(x, rows)
                    results.setdefault(name, {}).setdefault(f"B{b}", {}).setdefault(way, []).append(
                        (time.perf_counter() - t) / 3)
                    picked[way] = out.token_ids
                same = same and picked["partial"] == picked["full"] == picked["whole_rows"]
    sampler_module._TOP_P_FIRST = 64
    sampler_module._CANDIDATES = True
    med = statistics.median
    summary = {name: {b: {"partial_ms": med(v["partial"]) * 1e3, "full_ms": med(v["full"]) * 1e3,
                          "whole_rows_ms": med(v["whole_rows"]) * 1e3,
                          "speedup": med(v["full"]) / med(v["partial"]),
                          "speedup_vs_whole_rows": med(v["whole_rows"]) / med(v["partial"])}
                      for b, v in per_b.items()} for name, per_b in results.items()}
    machine = cc.machine_info()
    result = {"benchmark": "sampler_cpu", "machine": machine, "versions": cc.versions(), "model": DEFAULT_MODEL,
              "vocab": vocab, "rounds": args.rounds, "decode_step_ms": statistics.median(decode) * 1e3,
              "same_tokens": same, "summary": summary, "raw": results}
    out = args.out or cc.RESULTS / f"sampler_cpu_{args.tag or cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("raw", "machine", "versions")}, indent=1))
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
