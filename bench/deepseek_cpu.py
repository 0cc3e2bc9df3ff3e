"""Model-level CPU benchmark on DeepSeek-V2-Lite-shaped GGUFs (bench/make_deepseek_gguf.py; Qwen3-30B-A3B-shaped
ones with `--preset qwen3-30b-a3b`): our engine against llama.cpp's `llama-bench`, on the same files, in one run.

Measured, for each file (bf16, q8_0, and q4_k_m when it exists):
  * decode tokens/s of one request: ours = (tokens - 1) / (time from the first generated token to the
    last), a `--decode-prompt`-token prompt then `--decode-tokens` tokens (default 8 then 64);
    llama-bench's `tg64` (64 tokens generated from an empty context);
  * prompt processing tokens/s of a `--prompt-tokens` prompt (default 512): ours = prompt tokens /
    (request added -> its first token: the prefill step, including the last position's logits and
    the sample); llama-bench's `pp512`.
Ours runs through the engine exactly as the server's engine process does (`engine.core.EngineCore`
with `EngineArgs(model=<file>, device="cpu", ...)`, `add_request` then `step` until the request
finishes: scheduler, runner, sampler), greedy, EOS ignored, the prefix cache off (every round's
prompt is computed, not served from the cache). The engine's defaults hold: the CPU-native forward
(`--cpu-kernels native`) with the file's blocks kept as stored (`--cpu-weight-dtype file`) and the
routed experts in the C++ pool; `--engine-arg cpu_kernels=torch` measures the torch-op forward.

Floor: a decoded token must read every weight it uses once: the bytes, in the file's own format, of
all tensors except the token embedding (one row) and the routed experts (top-k of n: 6 of 64 per
MoE layer, Qwen3-30B-A3B's 8 of 128); shared experts, router, attention, dense layers and the output head in full. floor
seconds/token = those bytes / the read bandwidth measured in the same run (a large float32 sum on
`--threads` threads); reported as floor tokens/s and each side's fraction of it. The KV cache read is
left out (a few hundred KB at these lengths).

`--profile` adds one more decode run per backend with the native forward's decode steps timed phase by
phase (`CpuModel.set_profiling`; the prompt's forward is left out: it reads far more experts): each
phase's time, its pool runs and waits, and its weight bytes over its time as a fraction of the read
measured right after; the time outside the forward is the engine's (scheduler, sampler, Python).

`--expert-backends` names the expert backends to measure (the native forward runs routed experts in
the C++ pool whatever is named; `torch` matters with `--engine-arg cpu_kernels=torch`). It needs the extension built in place (`make install`); a checkout
without it can point `MLASERVE_CPP_EXPERTS_LIB` at another checkout's `cpp_experts/_C*.so`
(recorded in the JSON). A backend that cannot load is recorded as skipped with the error.

Peer: `llama-bench -m <file> -t <threads> -p 512 -n 64 -r 1 -o json` per round, with `--repack 0` on a
CPU with AMX-INT8, where llama.cpp's AMX weight buffers crash (bench/peers.py) (built by `make
peers`; skipped with the reason when absent). Rounds interleave ours and llama-bench per file
(order alternates), medians over `--rounds` after a warm-up; the machine may be shared and noisy:
each measurement first waits (at most `--quiet-wait` s) for the CPUs to be less than
`--quiet-threshold` busy, and is redone (`--retries` times at most) when other processes used more
than `--retry-busy` of the CPUs while it ran; what each saw is recorded.

    .venv/bin/python bench/make_deepseek_gguf.py        # once: the GGUFs
    .venv/bin/python bench/deepseek_cpu.py [--types bf16 q8_0 q4_k_m] [--rounds 3] [--threads 2]
        [--decode-tokens 64] [--prompt-tokens 512] [--expert-backends cpp] [--ours-only | --peer-only]
        [--profile] [--out bench/results/deepseek_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
from engine.process import freeze_gc_heap  # noqa: E402
import make_deepseek_gguf as mk  # noqa: E402
import peers  # noqa: E402

# ------------------------------------------------------------------------------ floor arithmetic


def bytes_per_decoded_token(tensors: list[tuple[str, tuple[int, ...], int]], n_experts: int,
                            top_k: int) -> dict[str, Any]:
    """Weight bytes one decoded token reads, from (GGUF name, shape as llama.cpp lists it, bytes).

    Routed experts (`*_exps`) count top_k / n_experts of their bytes, the token embedding one row
    (of its ne[1] rows), everything else in full. Returns the total and a breakdown."""
    parts = {"token_embd_row": 0, "routed_experts": 0, "shared_experts": 0, "attention": 0, "dense_ffn": 0,
             "output": 0, "other": 0}
    total_file = 0
    for name, shape, nbytes in tensors:
        total_file += nbytes
        if name == "token_embd.weight":
            rows = shape[-1] if len(shape) > 1 else 1  # llama.cpp order: ne0 = hidden, ne1 = vocab
            parts["token_embd_row"] += nbytes // rows
        elif "_exps" in name:
            parts["routed_experts"] += nbytes * top_k // n_experts
        elif "_shexp" in name:
            parts["shared_experts"] += nbytes
        elif ".attn_" in name:
            parts["attention"] += nbytes
        elif name.startswith("output"):
            parts["output"] += nbytes
        elif ".ffn_" in name:
            parts["dense_ffn"] += nbytes  # dense layers' FFN, the router (ffn_gate_inp), ffn_norm
        else:
            parts["other"] += nbytes
    return {"bytes_per_token": sum(parts.values()), "file_tensor_bytes": total_file, "breakdown": parts}


# llama.cpp's deepseek2 tensor names (without "blk.N." and ".weight") -> the native forward's phase
# that reads them
_PHASE_OF = {"attn_q": "qkv_proj", "attn_q_a": "qkv_proj", "attn_q_b": "qkv_proj", "attn_kv_a_mqa": "qkv_proj",
             "attn_k_b": "absorb", "attn_v_b": "value_up", "attn_output": "o_proj", "ffn_gate_inp": "router",
             "ffn_gate_exps": "experts", "ffn_up_exps": "experts", "ffn_down_exps": "experts",
             "ffn_gate_shexp": "shared_experts", "ffn_up_shexp": "shared_experts",
             "ffn_down_shexp": "shared_experts", "ffn_gate": "gate_up", "ffn_up": "gate_up", "ffn_down": "down",
             "output": "lm_head"}


def phase_bytes(tensors: list[tuple[str, tuple[int, ...], int]], n_experts: int, top_k: int) -> dict[str, int]:
    """The weight bytes each phase of the native forward's profile reads a decoded token (the routed
    experts top_k / n_experts of theirs; norms and the embedding row left out): what `--profile`
    divides by a phase's time for its fraction of the read."""
    out: dict[str, int] = {}
    for name, _, nbytes in tensors:
        parts = name.split(".")
        phase = _PHASE_OF.get(parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else "")
        if phase is not None:
            out[phase] = out.get(phase, 0) + (nbytes * top_k // n_experts if phase == "experts" else nbytes)
    return out


def gguf_tensors(path: Path) -> tuple[list[tuple[str, tuple[int, ...], int]], dict[str, Any]]:
    """(name, shape, bytes) of every tensor and the MoE fields of a deepseek2 GGUF (the `gguf` package)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    tensors = [(t.name, tuple(int(x) for x in t.shape), int(t.n_bytes)) for t in r.tensors]
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int | None:
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    ft = r.fields.get("general.file_type")
    meta = {"arch": arch, "n_experts": field("expert_count"), "top_k": field("expert_used_count"),
            "n_shared": field("expert_shared_count"), "layers": field("block_count"),
            "file_type": int(ft.parts[-1][0]) if ft is not None else None}
    return tensors, meta


def floor_figures(bytes_per_token: int, read_bw: float, tok_s: float | None) -> dict[str, Any]:
    floor_tok_s = read_bw / bytes_per_token
    return {"floor_tok_s": floor_tok_s, "fraction_of_floor": None if tok_s is None else tok_s / floor_tok_s}


# ------------------------------------------------------------------------------------ llama-bench


def llama_bench_command(binary: Path, model: Path, threads: int, prompt: int, gen: int, reps: int) -> list[str]:
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", str(reps),
            "-o", "json", *peers.llama_bench_args()]


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench `-o json` -> {'pp': {...}, 'tg': {...}} with n, tokens/s (avg, samples), model info."""
    entries = json.loads(text)
    out: dict[str, Any] = {}
    for e in entries:
        n_prompt, n_gen = int(e.get("n_prompt", 0)), int(e.get("n_gen", 0))
        kind = "pp" if n_prompt and not n_gen else "tg" if n_gen and not n_prompt else "pg"
        out[kind] = {"n": n_prompt or n_gen if kind != "pg" else [n_prompt, n_gen],
                     "avg_ts": float(e["avg_ts"]), "stddev_ts": float(e.get("stddev_ts", 0.0)),
                     "samples_ts": [float(x) for x in e.get("samples_ts", [])],
                     "n_depth": e.get("n_depth", 0)}
        out.setdefault("model_type", e.get("model_type"))
        out.setdefault("model_size", e.get("model_size"))
        out.setdefault("n_threads", e.get("n_threads"))
        out.setdefault("build_commit", e.get("build_commit"))
    return out


def run_llama_bench(cmd: list[str], timeout: float) -> dict[str, Any]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        tail = "\n".join(p.stderr.splitlines()[-15:])
        return {"error": f"llama-bench exited {p.returncode}: {tail}"}
    try:
        return parse_llama_bench(p.stdout)
    except (ValueError, KeyError) as e:
        return {"error": f"could not parse llama-bench's JSON ({e}): {p.stdout[:500]}"}


# -------------------------------------------------------------------------------------------- ours


def _engine_fields() -> list[str]:
    import dataclasses

    from engine.args import EngineArgs

    return [f.name for f in dataclasses.fields(EngineArgs)]


def engine_overrides(items: list[str]) -> dict[str, Any]:
    """`--engine-arg name=value` pairs -> EngineArgs keyword arguments (a value is JSON when it parses
    as JSON, else a string): settings this script does not know, e.g. a newer engine's CPU kernel flag."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--engine-arg expects name=value, got {item!r}")
        try:
            out[name.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[name.replace("-", "_")] = value
    return out


class Ours:
    """One GGUF loaded by the engine core, the way `mlaserve serve`'s engine process loads it."""

    def __init__(self, path: Path, args: argparse.Namespace, expert_backend: str) -> None:
        from engine.args import EngineArgs
        from engine.core import EngineCore

        ctx = max(args.prompt_tokens, args.decode_prompt + args.decode_tokens) + 16
        self.engine_args = EngineArgs(model=str(path), device="cpu", dtype=args.dtype, expert_backend=expert_backend,
                                      max_running_requests=1, context_length=ctx, max_total_tokens=ctx + 16,
                                      disable_prefix_cache=True, chunked_prefill_size=max(2048, args.prompt_tokens),
                                      **engine_overrides(args.engine_arg))
        t, anon = time.perf_counter(), cc.proc_status("RssAnon")
        self.core = EngineCore(self.engine_args)
        self.load_s = time.perf_counter() - t
        self.load_anon_bytes = cc.proc_status("RssAnon") - anon  # the private memory the load kept
        self.vocab = self.core.config.vocab_size
        self._n = 0
        import torch

        model = self.core.runner.model
        self.dtype = str(next(model.parameters()).dtype)
        from models.native import native_modules

        operators = {id(m.op): m.op for m in native_modules(model)}  # a tied head shares the embedding's
        experts = [m.weights for m in model.modules() if hasattr(getattr(m, "weights", None), "memory_bytes")]
        self.resident_bytes = (sum(p.numel() * p.element_size() for p in model.parameters())
                               + sum(b.numel() * b.element_size() for b in model.buffers())
                               + sum(int(op.memory_bytes) for op in operators.values())
                               + sum(int(e.memory_bytes) for e in experts))
        self.torch_threads = torch.get_num_threads()
        freeze_gc_heap()  # as the engine process, once the model is loaded

    def request(self, ids: list[int], max_tokens: int,
                after_first: Callable[[], None] | None = None) -> dict[str, Any]:
        """One request to the end: seconds to the first token, and each later token's arrival time;
        `after_first` is called once the first token is out (before the decode steps)."""
        from engine.messages import GenerateRequest
        from scheduler.sampling_params import SamplingParams

        self._n += 1
        rid = f"bench-{self._n}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        errors = self.core.add_request(GenerateRequest(rid, list(ids), params))
        if errors:
            raise RuntimeError(f"the engine refused the request: {errors[0].error}")
        arrivals: list[float] = []
        tokens = 0
        finished = None
        while finished is None:
            outs = self.core.step()
            now = time.perf_counter()
            for o in outs:
                if o.rid != rid:
                    continue
                if o.error:
                    raise RuntimeError(o.error)
                if not arrivals and o.new_token_ids and after_first is not None:
                    after_first()
                arrivals.extend([now] * len(o.new_token_ids))
                tokens += len(o.new_token_ids)
                finished = o.finish_reason or finished
        if tokens != max_tokens:
            raise RuntimeError(f"{tokens} tokens generated, expected {max_tokens} ({finished})")
        return {"first_token_s": arrivals[0] - t0, "total_s": arrivals[-1] - t0,
                "decode_s": arrivals[-1] - arrivals[0], "tokens": tokens}

    def prompt(self, n: int, seed: int) -> list[int]:
        import random

        rng = random.Random(seed)
        return [rng.randrange(10, min(self.vocab, 100000)) for _ in range(n)]

    def pp(self, n: int, seed: int) -> dict[str, Any]:
        r = self.request(self.prompt(n, seed), 1)
        return {"tok_s": n / r["first_token_s"], "seconds": r["first_token_s"], "prompt_tokens": n}

    def tg(self, prompt: int, n: int, seed: int) -> dict[str, Any]:
        r = self.request(self.prompt(prompt, seed), n)
        return {"tok_s": (n - 1) / r["decode_s"], "seconds": r["decode_s"], "first_token_s": r["first_token_s"],
                "tokens": n}

    def profile(self, prompt: int, n: int, seed: int, phases: dict[str, int], threads: int) -> dict[str, Any]:
        """One more decode run with the native forward's decode steps timed phase by phase (the prompt's
        forward left out), each phase's fraction of the read measured right after (`cc.phase_profile`)."""
        nf = self.core.runner.native_forward
        if nf is None:
            raise RuntimeError(f"the native forward is off: {self.core.runner.native_off_reason}")
        plan = nf.plan
        plan.profile(reset=True)
        try:
            r = self.request(self.prompt(prompt, seed), n, after_first=lambda: plan.set_profiling(True))
        finally:
            plan.set_profiling(False)
        prof = plan.profile(reset=True)
        return cc.phase_profile(prof, r["decode_s"] / (n - 1), phases, cc.read_bandwidth(threads=threads))

    def close(self) -> None:
        self.core.runner.close()
        del self.core
        gc.unfreeze()  # the next backend's model replaces this one: its objects can be collected again
        gc.collect()


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", choices=mk.ALL_TYPES, default=list(mk.TYPES),
                    help="which GGUFs (missing ones are skipped and recorded)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where make_deepseek_gguf.py put them")
    ap.add_argument("--preset", choices=mk.PRESETS, default=mk.PRESET, help="the files' model (make_deepseek_gguf.py)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch and llama-bench threads (default: the usable cores)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-prompt", type=int, default=8, help="prompt length before our decode run")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="our engine's --dtype")
    ap.add_argument("--expert-backends", nargs="+", default=["cpp"], choices=("torch", "cpp"),
                    help="our engine's --expert-backend, each measured (cpp: the C++ pool, Q8_0 experts kept "
                    "quantized)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra EngineArgs field for our engine (repeatable), e.g. cpu_kernels=native")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, one more decode run with the native forward's phases timed: where a "
                    "step's time goes, and each phase's fraction of the read")
    ap.add_argument("--skip-pp", action="store_true", help="only decode (ours' prefill on bf16 is the slow part)")
    grp = ap.add_mutually_exclusive_group()
    grp.add_argument("--ours-only", action="store_true")
    grp.add_argument("--peer-only", action="store_true")
    cc.add_quiet_args(ap, retries=2)
    ap.add_argument("--peer-timeout", type=float, default=3600.0)
    ap.add_argument("--tag", default=None, help="machine tag in the result file name (default: from /proc/cpuinfo)")
    ap.add_argument("--out", default=None, help="default: bench/results/deepseek_cpu_<machine-tag>.json")
    args = ap.parse_args(argv)
    try:
        unknown = set(engine_overrides(args.engine_arg)) - set(_engine_fields())
    except ValueError as e:
        ap.error(str(e))
    if unknown:  # (it ran nothing, exit 0, with the TypeError in `skipped`)
        ap.error(f"--engine-arg {', '.join(sorted(unknown))}: not an EngineArgs field (see engine/args.py)")
    for name in ("rounds", "prompt_tokens", "decode_prompt"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (the rate is measured between the first and the last token)")
    return args


def quiet(args: argparse.Namespace) -> dict[str, Any] | None:
    """Waits for a quiet machine before a measurement (see --quiet-wait); what it saw is recorded."""
    return cc.wait_for_quiet(args.quiet_threshold, args.quiet_wait) if args.quiet_wait > 0 else None


def measured(args: argparse.Namespace, fn: Callable[[], dict[str, Any]], label: str) -> dict[str, Any]:
    """fn() after waiting for a quiet machine, redone (--retries at most) when other processes used more
    than --retry-busy of the CPUs while it ran; the result carries what was seen, and the discarded tries."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(args.retries + 1):
        gate = quiet(args)
        with cc.OthersMeter() as meter:
            r = {**fn(), "gate": gate}
        r["others_busy"] = meter.others
        if cc.should_retry(meter.others, args.retry_busy, attempt, args.retries):
            discarded.append(r)
            print(f"    {label}: other processes used {meter.others:.0%} of the CPUs: measuring again", flush=True)
            continue
        break
    r["discarded"] = discarded
    return r


def summarize_rounds(samples: list[dict[str, Any]], threshold: float) -> float | None:
    """Median tokens/s over the rounds that other processes did not disturb (all, when every one was)."""
    kept, _ = cc.undisturbed(samples, threshold)
    return cc.median([s["tok_s"] for s in kept if s.get("tok_s")])


def read_after(sample: dict[str, Any], threads: int) -> dict[str, Any]:
    """The sample with the machine's read bandwidth measured right after it (`read_after_Bps`). On a VM
    whose shared read limit moves from spell to spell (a Zen 4 VM: ~47 or ~77 GB/s for tens of seconds),
    a decode's fraction of the read at its own time says more than the one measured at the start."""
    return {**sample, "read_after_Bps": cc.read_bandwidth(threads=threads)}


def bench_file(qtype: str, path: Path, args: argparse.Namespace, threads: int, bw_samples: list[float],
               lb_binary: Path | None) -> dict[str, Any]:
    tensors, meta = gguf_tensors(path)
    traffic = bytes_per_decoded_token(tensors, meta["n_experts"] or 1, meta["top_k"] or 1)
    entry: dict[str, Any] = {"path": str(path), "file_bytes": path.stat().st_size, "gguf": meta,
                             "decode_weight_traffic": traffic, "ours": {}, "llama_bench": None, "skipped": {}}
    bw_samples.append(cc.read_bandwidth(threads=threads))
    print(f"{qtype}: {path.name}, {traffic['bytes_per_token'] / 2**20:.1f} MiB of weights per decoded token, "
          f"read bandwidth {bw_samples[-1] / 1e9:.1f} GB/s", flush=True)
    lb_cmd = (llama_bench_command(lb_binary, path, threads, 0 if args.skip_pp else args.prompt_tokens,  # (-p 0: none)
                                  args.decode_tokens, 1)
              if lb_binary else None)
    peer_rounds: list[dict[str, Any]] = []
    want_peer = lb_cmd is not None and not args.ours_only
    for backend in [] if args.peer_only else list(args.expert_backends):
        try:
            ours = Ours(path, args, backend)
        except Exception as e:  # e.g. cpp_experts not built: recorded, the other measurements go on
            entry["skipped"][f"ours_{backend}"] = f"{type(e).__name__}: {e}"
            print(f"  ours ({backend}) skipped: {entry['skipped'][f'ours_{backend}']}", flush=True)
            continue
        print(f"  ours ({backend}, {ours.dtype}) loaded in {ours.load_s:.1f} s", flush=True)
        ours.request(ours.prompt(min(64, args.prompt_tokens), 99), 4)  # warm-up
        pp: list[dict[str, Any]] = []
        tg: list[dict[str, Any]] = []
        for r in range(args.rounds):
            # llama-bench interleaved with the first loaded backend's rounds only: one set of peer samples per file
            with_peer = want_peer and len(peer_rounds) < args.rounds
            order = ["ours", "peer"] if r % 2 == 0 else ["peer", "ours"]
            for who in order:
                if who == "ours":
                    if not args.skip_pp:
                        pp.append(measured(args, lambda: ours.pp(args.prompt_tokens, seed=r), "ours pp"))
                    tg.append(measured(args, lambda: read_after(ours.tg(args.decode_prompt, args.decode_tokens,
                                                                        seed=100 + r), threads), "ours tg"))
                elif with_peer:
                    assert lb_cmd is not None
                    peer_rounds.append(measured(args, lambda: read_after(run_llama_bench(lb_cmd, args.peer_timeout),
                                                                         threads), "llama-bench"))
            print(f"  round {r + 1}: ours ({backend}) " + (f"pp {pp[-1]['tok_s']:.2f} tok/s, " if pp else "")
                  + f"tg {tg[-1]['tok_s']:.3f} tok/s (read after {tg[-1]['read_after_Bps'] / 1e9:.0f} GB/s)"
                  + (f"; llama-bench {_lb_line(peer_rounds[-1])}" if with_peer else ""),
                  flush=True)
        profile = None
        if args.profile:
            try:
                pb = phase_bytes(tensors, meta["n_experts"] or 1, meta["top_k"] or 1)
                profile = measured(args, lambda: ours.profile(args.decode_prompt, args.decode_tokens, 200, pb, threads),
                                   "ours profile")
                cc.print_phase_profile(profile)
            except RuntimeError as e:
                entry["skipped"][f"profile_{backend}"] = str(e)
                print(f"  profile skipped: {e}", flush=True)
        entry["ours"][backend] = {
            "profile": profile,
            "dtype": ours.dtype, "load_s": ours.load_s, "resident_weight_bytes": ours.resident_bytes,
            "load_anon_bytes": ours.load_anon_bytes,
            "torch_threads": ours.torch_threads, "engine_args": {k: v for k, v in vars(ours.engine_args).items()},
            "pp_tok_s": summarize_rounds(pp, args.retry_busy), "tg_tok_s": summarize_rounds(tg, args.retry_busy),
            "rounds_undisturbed": {"pp": cc.undisturbed(pp, args.retry_busy)[1],
                                   "tg": cc.undisturbed(tg, args.retry_busy)[1]},
            "pp_samples": pp, "tg_samples": tg,
        }
        ours.close()
        del ours
        gc.collect()
    while want_peer and len(peer_rounds) < args.rounds:  # --peer-only, or no backend of ours loaded
        assert lb_cmd is not None
        peer_rounds.append(measured(args, lambda: read_after(run_llama_bench(lb_cmd, args.peer_timeout), threads),
                                    "llama-bench"))
        print(f"  round {len(peer_rounds)}: llama-bench {_lb_line(peer_rounds[-1])}", flush=True)
    if args.ours_only:  # (before lb_cmd: --ours-only leaves it None, and was recorded as llama-bench missing)
        entry["skipped"]["llama_bench"] = "--ours-only"
    elif lb_cmd is None:
        entry["skipped"]["llama_bench"] = peers.absent_reason("llama-bench")
    elif peer_rounds:
        ok, undisturbed = cc.undisturbed([p for p in peer_rounds if "error" not in p], args.retry_busy)
        entry["llama_bench"] = {
            "command": lb_cmd, "rounds": peer_rounds, "rounds_undisturbed": undisturbed,
            "pp_tok_s": cc.median([p["pp"]["avg_ts"] for p in ok if "pp" in p]),
            "tg_tok_s": cc.median([p["tg"]["avg_ts"] for p in ok if "tg" in p]),
            "model_type": ok[0].get("model_type") if ok else None,
        }
        if not ok:
            entry["skipped"]["llama_bench"] = peer_rounds[0]["error"]
    return entry


def _lb_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR " + r["error"].splitlines()[0]
    return (("" if "pp" not in r else f"pp {r['pp']['avg_ts']:.2f} tok/s, ") + f"tg {r.get('tg', {}).get('avg_ts', 0):.2f} tok/s"
            f" (read after {r.get('read_after_Bps', 0) / 1e9:.0f} GB/s)")


def derive(entry: dict[str, Any], read_bw: float) -> None:
    """Floor, fractions of it, and ours / llama-bench ratios, added in place."""
    bpt = entry["decode_weight_traffic"]["bytes_per_token"]
    entry["decode_floor_tok_s"] = read_bw / bpt
    peer = entry.get("llama_bench") or {}

    def of_read(rate: float | None, sample: dict[str, Any]) -> float | None:
        return rate * bpt / sample["read_after_Bps"] if rate and sample.get("read_after_Bps") else None

    if peer:
        peer["tg_fraction_of_floor"] = floor_figures(bpt, read_bw, peer.get("tg_tok_s"))["fraction_of_floor"]
        fr = [of_read(r.get("tg", {}).get("avg_ts"), r) for r in peer.get("rounds", [])]
        peer["tg_fraction_of_read_after"] = {"rounds": fr, "median": cc.median([f for f in fr if f])}
    for o in entry["ours"].values():
        o["tg_fraction_of_floor"] = floor_figures(bpt, read_bw, o.get("tg_tok_s"))["fraction_of_floor"]
        fr = [of_read(t.get("tok_s"), t) for t in o.get("tg_samples", [])]
        o["tg_fraction_of_read_after"] = {"rounds": fr, "median": cc.median([f for f in fr if f])}
        o["tg_ratio_vs_llama_bench"] = cc.ratio(o.get("tg_tok_s"), peer.get("tg_tok_s"))
        o["pp_ratio_vs_llama_bench"] = cc.ratio(o.get("pp_tok_s"), peer.get("pp_tok_s"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or cc.cpuinfo()["cores"]
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # the engine process's setting (engine.client), before torch
    import torch

    torch.set_num_threads(threads)
    machine = cc.machine_info()
    cache = args.cache_dir or mk.default_cache_dir()
    lb = None if args.ours_only else peers.llama_cpp_bin("llama-bench")
    if not args.ours_only and lb is None:
        print("peer skipped:", peers.absent_reason("llama-bench"))
    files: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    bw: list[float] = []
    for qtype in args.types:
        path = mk.gguf_path(cache, qtype, args.layers, args.seed, args.preset)
        if not path.is_file():
            skipped[qtype] = f"{path} not found: run bench/make_deepseek_gguf.py --preset {args.preset}"
            print(f"{qtype} skipped: {skipped[qtype]}")
            continue
        files[qtype] = bench_file(qtype, path, args, threads, bw, lb)
    read_bw = cc.median(bw)
    for entry in files.values():
        derive(entry, read_bw)
    manifest = mk.model_dir(cache, args.layers, args.seed, args.preset) / "manifest.json"
    result = {
        "benchmark": "deepseek_cpu",
        "preset": args.preset,
        "machine": {**machine, "threads": threads, "load_average_at_end": list(os.getloadavg()),
                    "read_bandwidth_GBps": None if read_bw is None else read_bw / 1e9,
                    "read_bandwidth_samples_GBps": [b / 1e9 for b in bw]},
        "versions": {**cc.versions(), "llama_cpp": peers.binary_version(lb) if lb else None,
                     "cpp_experts_lib": os.environ.get("MLASERVE_CPP_EXPERTS_LIB")},
        "model": json.loads(manifest.read_text()).get("config") if manifest.is_file() else None,
        "workload": {"prompt_tokens": args.prompt_tokens, "decode_prompt": args.decode_prompt,
                     "decode_tokens": args.decode_tokens, "rounds": args.rounds, "dtype": args.dtype,
                     "expert_backends": args.expert_backends, "skip_pp": args.skip_pp,
                     "engine_overrides": engine_overrides(args.engine_arg)},
        "files": files,
        "skipped": skipped,
        "note": "medians over interleaved rounds (order alternates); the machine may be shared and noisy; "
                "floor = weight bytes per decoded token in the file's format / measured read bandwidth",
    }
    name = "deepseek_cpu" if args.preset == mk.PRESET else f"{args.preset.replace('-', '_')}_cpu"
    out = args.out or cc.RESULTS / f"{name}_{args.tag or cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    print_report(result)
    print(f"wrote {out}")
    return 0


def print_report(result: dict[str, Any]) -> None:
    print(f"{'file':8s} {'who':16s} {'pp tok/s':>10s} {'tg tok/s':>10s} {'tg floor':>10s} {'of floor':>9s} "
          f"{'pp x peer':>10s} {'tg x peer':>10s} {'of read':>8s}")
    for qtype, e in result["files"].items():
        rows = [(f"ours ({b})", o) for b, o in e["ours"].items()]
        if e.get("llama_bench"):
            rows.append(("llama-bench", e["llama_bench"]))

        def f(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        for who, r in rows:
            print(f"{qtype:8s} {who:16s} {f(r.get('pp_tok_s'), '10.2f'):>10s} {f(r.get('tg_tok_s'), '10.3f'):>10s} "
                  f"{f(e['decode_floor_tok_s'], '10.2f'):>10s} {f(r.get('tg_fraction_of_floor'), '9.3f'):>9s} "
                  f"{f(r.get('pp_ratio_vs_llama_bench'), '10.3f'):>10s} "
                  f"{f(r.get('tg_ratio_vs_llama_bench'), '10.3f'):>10s} "
                  f"{f((r.get('tg_fraction_of_read_after') or {}).get('median'), '8.3f'):>8s}")


if __name__ == "__main__":
    sys.exit(main())
