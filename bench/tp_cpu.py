"""Tensor parallelism on the CPU (gloo, ranks as processes on this machine): what each rank holds and
peaks at while loading, against one process, and a greedy decode step's time.

A synthetic Llama-shaped checkpoint (hidden 1024, 8 layers, the synthetic tokenizer's 49152-token vocabulary, ~200M parameters)
is written as fp32 safetensors and as a Q8_0 GGUF; for --tp 1, 2 and 4 every rank loads its part
(reading only that part of the file) and reports
- held: the bytes of the parameters it keeps;
- anon peak: the most private memory (RssAnon, sampled every 2 ms) it had during the load, minus what
  it had before: what loading costs the machine's memory;
- rss peak: its resident-set high-water mark (VmHWM) minus its resident set before the load, which also
  counts the file's pages mapped while they are read (page cache, shared and reclaimable);
and rank 0 times a 64-token prefill and 16 greedy decode steps (2 cores here: more ranks only add
communication, so this says what the collectives cost, not what a bigger machine gains).

    .venv/bin/python bench/tp_cpu.py [--tp 1,2,4] [--out bench/results/tp_cpu_<machine>.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_common import machine_info, machine_tag, proc_status, versions, write_json  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
          "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 8, "vocab_size": 49152,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def _rank(rank: int, world: int, port: int, path: str, out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        from models.parallel import ParallelLayout, configure

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        configure(ParallelLayout(tp_size=world, tp_rank=rank))
    from executor.model_runner import ModelRunner, RequestSlice
    from models.loader.load import load_model

    import threading

    before, anon_before = proc_status("VmRSS"), proc_status("RssAnon")
    anon_peak = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], proc_status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    done.set()
    sampler.join()
    peak = proc_status("VmHWM") - before
    anon = max(anon_peak[0], proc_status("RssAnon")) - anon_before
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=128, max_running_requests=1,
                         max_context_len=128, disable_cuda_graph=True)
    row = runner.req_to_token_pool.alloc()
    prompt = [(7 * i + 3) % 32000 for i in range(64)]  # inside the vocabulary
    t = time.perf_counter()
    logits = runner.forward(runner.build_batch([RequestSlice(row, 0, prompt)]))
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(16):
        logits = runner.forward(runner.build_batch([RequestSlice(row, 64 + i, [int(logits[-1].argmax())])]))
    decode = (time.perf_counter() - t) / 16
    out.put({"rank": rank, "held_bytes": held, "load_anon_peak_bytes": anon, "load_peak_bytes": peak, "prefill_s": prefill, "decode_s": decode})
    runner.close()
    if world > 1:
        dist.destroy_process_group()


def run(path: Path, world: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(path), out)) for r in range(world)]
    for p in procs:
        p.start()
    import queue

    got: list[dict[str, Any]] = []
    while len(got) < world:
        try:
            got.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit code {dead[0].exitcode}): see its traceback above")
    for p in procs:
        p.join(60)
    return sorted(got, key=lambda d: d["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--formats", default="safetensors,gguf")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from models.synthetic import write_checkpoint

    if not all(x.isdigit() and int(x) > 0 for x in a.tp.split(",")):
        ap.error(f"--tp {a.tp}: comma-separated rank counts above 0, e.g. 1,2")
    if not set(a.formats.split(",")) <= {"safetensors", "gguf"}:
        ap.error(f"--formats {a.formats}: safetensors, gguf or both (comma-separated)")
    sizes = [int(x) for x in a.tp.split(",")]
    result: dict[str, Any] = {"bench": "tp_cpu", "machine": machine_info(), "versions": versions(), "config": CONFIG,
                              "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "m", CONFIG, seed=3, gguf="gguf" in a.formats, gguf_qtype="Q8_0")
        files = {"safetensors": ckpt, "gguf": ckpt / "model.gguf"}
        for fmt in a.formats.split(","):
            runs = {}
            for world in sizes:
                ranks = run(files[fmt], world)
                runs[str(world)] = ranks
                held = max(r["held_bytes"] for r in ranks)
                peak = max(r["load_peak_bytes"] for r in ranks)
                anon = max(r["load_anon_peak_bytes"] for r in ranks)
                print(f"{fmt} tp={world}: held {held / 2**20:.0f} MiB, load anon peak {anon / 2**20:.0f} MiB, rss peak "
                      f"{peak / 2**20:.0f} MiB per rank (max over ranks); decode {ranks[0]['decode_s'] * 1e3:.1f} "
                      "ms/token", flush=True)
            one = runs[str(sizes[0])][0] if sizes[0] == 1 else None
            if one is not None:
                for world in sizes[1:]:
                    ranks = runs[str(world)]
                    runs[f"ratio_tp{world}"] = {
                        "held_vs_one": max(r["held_bytes"] for r in ranks) / one["held_bytes"],
                        "load_anon_peak_vs_one": max(r["load_anon_peak_bytes"] for r in ranks)
                        / one["load_anon_peak_bytes"],
                        "load_rss_peak_vs_one": max(r["load_peak_bytes"] for r in ranks) / one["load_peak_bytes"],
                        "decode_vs_one": ranks[0]["decode_s"] / one["decode_s"]}
            result["runs"][fmt] = runs
    out = a.out or f"bench/results/tp_cpu_{machine_tag(result['machine'])}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
