"""What this session's two numeric fixes cost on the CPU, measured against a floor and a reference.

1. Sampler (executor/sampler.py): `top_k` now keeps the tokens tied with the k-th value, which adds a
   pass over each row (count of logits reaching the k-th) to the partial sort. Timed: one `Sampler`
   call for B rows of temperature 1, top_k 50, top_p 0.95 (each its own seed), fp32 logits of the
   default model's and DeepSeek's vocabularies. Against: the memory floor (reading the B x V logits
   once at the machine's measured read bandwidth) and the torch reference of the same choice, HF
   transformers' warper chain (TopK, TopP, softmax, multinomial) on the same logits.
2. MLA on the torch model (models/mla.py): on a CPU every forward now absorbs (batch-invariant)
   where a fresh prefill used to expand per-head K/V. Timed: the prefill of one prompt (T tokens)
   through a V2-Lite-shaped model of one dense layer, absorbed vs expanded (the old path, forced),
   same weights, same run, rounds interleaved; the ratio absorbed / expanded is the cost.

Usage: .venv/bin/python bench/sampling_mla_cpu.py [--rounds 5] [--out bench/results/...json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the repository first (its packages, not an editable install's), and bench/ for the helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cpu_common import machine_info, read_bandwidth, versions, write_json  # noqa: E402
from executor.sampler import Sampler, SamplingRow  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def sampler_rows(rounds: int, bandwidth: float) -> list[dict]:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = []
    for vocab in (49152, 129280):
        for batch in (1, 16, 64):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
            sampler = Sampler(vocab)
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
            rows = [SamplingRow(params, seed=i, step=0, prompt_ids=[], output_ids=[], eos_token_ids=[2])
                    for i in range(batch)]
            top_k, top_p = TopKLogitsWarper(50), TopPLogitsWarper(0.95)

            def hf() -> None:
                x = top_p(None, top_k(None, logits.clone()))
                torch.multinomial(x.softmax(-1), 1)

            ours, ref = [], []
            for _ in range(rounds):  # interleaved
                ours.append(_best(lambda: sampler(logits, rows), 5))
                ref.append(_best(hf, 5))
            floor = batch * vocab * 4 / bandwidth
            o, r = statistics.median(ours), statistics.median(ref)
            out.append({"vocab": vocab, "batch": batch, "ours_ms": o * 1e3, "hf_ms": r * 1e3,
                        "floor_ms": floor * 1e3, "ours_vs_hf": o / r, "floor_fraction": floor / o})
    return out


def mla_rows(rounds: int) -> list[dict]:
    from executor.model_runner import ModelRunner, RequestSlice
    from models.loader.load import load_model
    from models.mla import MLAAttention
    from models.synthetic import write_checkpoint

    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint(Path(d) / "m", "deepseek-v2-lite", seed=1, num_layers=1)
        loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=4200, max_running_requests=2)
    absorb = MLAAttention.forward

    def expand(self, pos, x, batch):  # the old choice for a fresh prefill
        return self.forward_absorb(pos, x, batch) if batch.has_prefix else self.forward_normal(pos, x, batch)

    def prefill(ids: list[int]) -> None:
        row = runner.req_to_token_pool.alloc()
        runner.forward(runner.build_batch([RequestSlice(row, 0, ids)]))
        runner.free_request(row, len(ids))

    out = []
    for t in (128, 512, 2048):
        ids = torch.randint(0, loaded.config.vocab_size, (t,), generator=torch.Generator().manual_seed(t)).tolist()
        a, n = [], []
        for _ in range(rounds):
            MLAAttention.forward = absorb
            a.append(_best(lambda: prefill(ids), 2))
            MLAAttention.forward = expand
            n.append(_best(lambda: prefill(ids), 2))
        MLAAttention.forward = absorb
        out.append({"tokens": t, "absorbed_ms": statistics.median(a) * 1e3, "expanded_ms": statistics.median(n) * 1e3,
                    "absorbed_vs_expanded": statistics.median(a) / statistics.median(n)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    bandwidth = read_bandwidth()
    result = {"benchmark": "sampling_mla_cpu", "machine": dict(machine_info(), read_bandwidth_GBps=bandwidth / 1e9),
              "versions": versions(), "rounds": args.rounds,
              "sampler": sampler_rows(args.rounds, bandwidth), "mla_prefill": mla_rows(args.rounds)}
    for r in result["sampler"]:
        print(f"sampler V={r['vocab']:6d} B={r['batch']:2d}: {r['ours_ms']:7.2f} ms, HF {r['hf_ms']:7.2f} ms "
              f"({r['ours_vs_hf']:.2f}x), floor {r['floor_ms']:.3f} ms ({r['floor_fraction']:.1%})")
    for r in result["mla_prefill"]:
        print(f"MLA prefill T={r['tokens']:5d}: absorbed {r['absorbed_ms']:8.1f} ms, expanded {r['expanded_ms']:8.1f} ms "
              f"({r['absorbed_vs_expanded']:.2f}x)")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
