"""GPU benchmark of OmniKV decode on a DeepSeek-V2-Lite-shaped model (MLA: 16 heads, 512-wide latent +
64 RoPE, random weights built on the device as `model_decode_gpu.py` builds them): the decode step time
with full attention and with OmniKV at contexts 4K to 128K, in one run, through `ModelRunner` and the
triton attention backend, and the latent cache a request holds on the device.

Each context: one random prompt, prefilled in chunks (or, with `--fill random`, its KV rows drawn at
random straight into the pool: the same decode work, without minutes of prefill at 128K), short enough
that every timed decode step of every batch size stays within the context; a second request row shares
its prompt KV (as the prefix cache shares it), so full attention and OmniKV decode over the same cache. Rounds of `--steps` decode steps alternate between
the two (the order flips every round); medians. `--batch B` decodes B such requests in each step: the
prompt's KV rows are copied to B - 1 more sets of slots (so each request reads memory of its own, as
distinct requests do, without B prefills) and each copy starts from another token, so their tokens and
selections part ways. Batches are where OmniKV can pay on a GPU: at batch 1 the step is bound by
reading the weights, and the KV read that OmniKV cuts grows with the batch. Memory: the largest batch
times the longest context of KV (about 31 KB a token for the 27-layer model). Full attention and
OmniKV are timed eagerly and, with `--graphs on`, through CUDA graphs (OmniKV decodes replay graphs of
their own, captured per context bucket at the first step: `omnikv_graph_keys`); the graphs-on speedup
is the number for a server.

Correctness, before timing, with graphs and without, at each `--batch` size: decode rows forced
through the sparse machinery with selections that keep the whole context must give full attention's
logits within a relative error of 1e-2 (bf16; the sparse kernels read the same rows through their own
table, a wrong table or length is off by O(1)), every copy of the prompt must give copy 0's logits
within the same error, and every logit must be finite; the script exits 1 otherwise.

The config: filter layers from `--filter-layers` (default `OmniKVConfig.default_for`, as an
uncalibrated server would use: random weights have nothing to calibrate), `--budget` of the context
(default 0.1) plus the default sink and recent tokens. Issue target: >= 1.6x decode at 32K and beyond
(OmniKV reports 1.68x at 128K on Llama-3-8B).

`--bank on` runs the same on a runner with OmniKV's context bank (`--omnikv-bank`: the sparse layers'
KV in pinned host memory, the selected rows gathered to the device at each filter layer). Its rows
record the device and host bytes of a request's KV (`kv_device_bytes_per_request`,
`kv_host_bytes_per_request`; without the bank every byte is on the device), the device memory the
pool took when the runner was made (`pool_device_bytes`, measured), and the extra device memory one
OmniKV decode step peaks at (`omnikv_step_peak_bytes`: the bank's gathered rows and the workspaces).
On a bank runner the "full" rows are full-attention requests on that server: their sparse layers'
rows come from the host too, the whole context of them. Bank and no-bank runners are timed one after
the other (not interleaved); compare their rows as such.

    python bench/omnikv_gpu.py [--contexts 4096 8192 16384 32768 65536 131072] [--budget 0.1]
        [--graphs on off] [--bank off on] [--batch 1 8] [--steps 16] [--rounds 3] [--profile CONTEXT]
        [--out bench/results/omnikv_gpu_<device>.json]
    TRITON_INTERPRET=1 python bench/omnikv_gpu.py --smoke --out /tmp/omnikv.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from model_decode_gpu import RESULTS, V2_LITE_LAYERS, _sync, bench_config, build_model, release_memory  # noqa: E402 (sets TRITON_INTERPRET for --smoke first)

import torch  # noqa: E402

from bench_common import bench_device, device_slug, machine_info, print_table, write_result  # noqa: E402
from executor.model_runner import ModelRunner, RequestSlice  # noqa: E402
from models.omnikv_config import OmniKVConfig  # noqa: E402

PREFILL_CHUNK = 8192  # prompt tokens per prefill forward
CHECK_STEPS = 4
CHECK_RTOL = 1e-2


@dataclasses.dataclass(frozen=True)
class KeepEverything(OmniKVConfig):
    """A budget covering the context, and every decode row still sent through the sparse machinery
    (filter layers select, sparse layers read their selection's table): full attention's result."""

    def is_sparse_for(self, context: int) -> bool:
        return True


class Rows:
    """A prompt prefilled once and held `copies` times: copy 0 is the prefill's slots, every other copy
    the same KV rows copied to slots of its own (distinct memory, as distinct requests read, without
    prefilling each). Each copy has a full-attention row and an OmniKV row reading its prompt slots (as
    the prefix cache shares them); copy i starts decoding from `first[i]` (the prompt's own next token
    for copy 0), so the copies' tokens, and their OmniKV selections, part ways. `step` decodes one token
    for every row of one kind in a single forward (a batch of `copies` rows); `release` frees everything."""

    def __init__(self, runner: ModelRunner, prompt: list[int], copies: int = 1,
                 first: list[int] | None = None, fill: str = "prefill") -> None:
        if len(first or []) < copies - 1:
            raise ValueError(f"{copies} copies need {copies - 1} first tokens beside the prompt's own")
        self.runner = runner
        pool, alloc = runner.req_to_token_pool, runner.allocator
        self.rows: list[int] = []
        self.slots: list[torch.Tensor] = []  # each copy's prompt slots (int64, on the table's device)
        self.shared = len(prompt)
        self.n: dict[int, int] = {}  # tokens each row holds (its decode tokens from `shared` on)
        try:
            for _ in range(2 * copies):
                row = pool.alloc()
                if row is None:
                    raise RuntimeError(f"the runner has no room for {2 * copies} request rows")
                self.rows.append(row)
            self.full, self.omni = self.rows[0::2], self.rows[1::2]
            if fill == "prefill":
                logits = None
                for start in range(0, len(prompt), PREFILL_CHUNK):
                    logits = runner.forward(runner.build_batch(
                        [RequestSlice(self.full[0], start, prompt[start : start + PREFILL_CHUNK])]))
                assert logits is not None
                first_token = int(logits[-1].argmax())
                self.slots.append(pool.req_to_token[self.full[0], : len(prompt)].to(torch.int64))
            else:  # "random": the prompt's KV rows drawn at random instead of computed
                loc = alloc.alloc(len(prompt))
                if loc is None:
                    raise RuntimeError(f"the KV pool has no room for a {len(prompt)}-token prompt")
                self.slots.append(loc.to(torch.int64))
                g = torch.Generator(runner.device).manual_seed(len(prompt))
                for layer in range(runner.config.num_hidden_layers):
                    for buf in runner.kv_pool.layer_buffers(layer):
                        rows = torch.randn((len(prompt), *buf.shape[1:]), generator=g, device=runner.device)
                        buf[self.slots[0].to(buf.device)] = rows.to(buf.dtype).to(buf.device)
                first_token = prompt[-1]
            for _ in range(1, copies):
                loc = alloc.alloc(len(prompt))
                if loc is None:
                    raise RuntimeError(f"the KV pool has no room for {copies} copies of a {len(prompt)}-token prompt")
                loc = loc.to(torch.int64)
                self.slots.append(loc)
                for layer in range(runner.config.num_hidden_layers):
                    for buf in runner.kv_pool.layer_buffers(layer):
                        buf[loc.to(buf.device)] = buf[self.slots[0].to(buf.device)]
            for i in range(copies):
                for row in (self.full[i], self.omni[i]):
                    pool.write(row, 0, self.slots[i])
        except BaseException:
            self.release()
            raise
        starts = [first_token] + list(first or [])[: copies - 1]
        self.n = {row: len(prompt) for row in self.rows}
        self.tok = {row: starts[i // 2] for i, row in enumerate(self.rows)}

    def step(self, omnikv: bool, tokens: list[int] | None = None, copies: int | None = None) -> torch.Tensor:
        """One decode token for every row of one kind of the first `copies` copies (default all),
        teacher-forced by `tokens`, else greedy; the logits [copies, vocab]."""
        r = self.runner
        rows = (self.omni if omnikv else self.full)[:copies]
        toks = [self.tok[row] for row in rows] if tokens is None else tokens
        logits = r.forward(r.build_batch([RequestSlice(row, self.n[row], [t], omnikv=omnikv)
                                          for row, t in zip(rows, toks)]))
        for row, nxt in zip(rows, logits.argmax(-1).tolist()):
            self.tok[row] = nxt
            self.n[row] += 1
        return logits

    def release(self) -> None:
        r = self.runner
        table = r.req_to_token_pool.req_to_token
        for loc in self.slots:
            r.allocator.free(loc)
        self.slots = []
        for row in self.rows:
            r.allocator.free(table[row, self.shared : self.n.get(row, self.shared)].to(torch.int64))
            r.req_to_token_pool.free(row)
        self.rows = []


def check(runner: ModelRunner, cfg: OmniKVConfig, context: int, vocab: int, seed: int,
          copies: int = 1) -> dict[str, Any]:
    """OmniKV whose selections keep the whole context against full attention, teacher-forced, in batches
    of `copies` requests; and every copy's full-attention logits against copy 0's (the same KV rows
    and tokens: a wrongly copied prompt, or a batch row reading another's slots, is off by O(1))."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab, (context,), generator=g).tolist()
    forced = torch.randint(2, vocab, (CHECK_STEPS,), generator=g).tolist()
    runner.set_omnikv(KeepEverything(filter_layers=cfg.filter_layers, budget_tokens=context + CHECK_STEPS,
                                     window=cfg.window, alpha=cfg.alpha))
    rows = Rows(runner, prompt, copies, forced[:1] * (copies - 1))
    before = runner.omnikv_counters.sparse_tokens
    try:
        full = torch.stack([rows.step(False, [t] * copies).float().cpu() for t in forced])  # [steps, copies, vocab]
        sparse = torch.stack([rows.step(True, [t] * copies).float().cpu() for t in forced])
    finally:
        rows.release()
        runner.set_omnikv(cfg)
    finite = bool(torch.isfinite(full).all() and torch.isfinite(sparse).all())
    rel = float((sparse - full).norm() / full.norm()) if finite else float("inf")
    copy_rel = max((float((full[:, i] - full[:, 0]).norm() / full[:, 0].norm()) for i in range(1, copies)),
                   default=0.0) if finite else float("inf")
    sparse_rows = runner.omnikv_counters.sparse_tokens - before  # the check is void unless the rows went sparse
    return {"context": context, "batch": copies, "finite": finite, "rel_err": rel, "copies_rel_err": copy_rel,
            "sparse_decodes": sparse_rows,
            "correct": finite and rel <= CHECK_RTOL and copy_rel <= CHECK_RTOL and sparse_rows == CHECK_STEPS * copies}


def steps_per_timing(args: argparse.Namespace) -> int:
    """Decode tokens one timing adds to a row: warm-ups, the peak-memory step and the timed rounds."""
    return args.warmup + 1 + args.steps * args.rounds


def context_rows(runner: ModelRunner, context: int, args: argparse.Namespace, vocab: int, seed: int,
                 timings: int, copies: int) -> Rows:
    """One random prompt at `context`, held `copies` times, short enough that `timings` timings of a
    row all stay within `context` tokens (a power of two is also an OmniKV graph's bucket: one token
    more would time a graph twice as wide). Every batch size of a context times these rows: one
    prefill per context, not per batch size."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = context - timings * steps_per_timing(args)
    prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
    return Rows(runner, prompt, copies, torch.randint(2, vocab, (copies - 1,), generator=g).tolist(), args.fill)


def time_context(runner: ModelRunner, rows: Rows, context: int, args: argparse.Namespace, graphs: bool,
                 batch: int = 1) -> dict[str, Any]:
    """Decode steps of the first `batch` requests of `rows` at `context`, full attention against OmniKV
    (one forward per step for the whole batch of each kind)."""
    device = runner.device
    modes = [("full", False), ("omnikv", True)]
    times: dict[str, list[float]] = {name: [] for name, _ in modes}
    peak = None
    for _, sparse in modes:  # warm-up (graph replays, Triton compiles)
        for _ in range(args.warmup):
            rows.step(sparse, copies=batch)
    if device.type == "cuda":  # the device memory one OmniKV step adds at its peak (bank rows, workspaces)
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        rows.step(True, copies=batch)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        rows.step(True, copies=batch)  # the same tokens per timing as on a GPU
    for rnd in range(args.rounds):
        for name, sparse in (modes if rnd % 2 == 0 else modes[::-1]):
            _sync(device)
            t = time.perf_counter()
            for _ in range(args.steps):
                rows.step(sparse, copies=batch)
            _sync(device)
            times[name].append((time.perf_counter() - t) / args.steps)
    full, sparse = statistics.median(times["full"]), statistics.median(times["omnikv"])
    cfg = runner.omnikv
    assert cfg is not None
    pool = runner.kv_pool
    return {"context": context, "batch": batch, "prompt_len": rows.shared, "graphs": graphs,
            "bank": runner.context_bank is not None, "full_ms": full * 1e3, "omnikv_ms": sparse * 1e3,
            "speedup": full / sparse, "full_tok_s": batch / full, "omnikv_tok_s": batch / sparse,
            "selected_per_sparse_layer": cfg.budget_for(context) + cfg.sink_tokens
            + cfg.recent_tokens, "kv_bytes_per_request": context * pool.bytes_per_token(),
            "kv_device_bytes_per_request": context * (pool.bytes_per_token() - pool.host_bytes_per_token()),
            "kv_host_bytes_per_request": context * pool.host_bytes_per_token(),
            "omnikv_step_peak_bytes": peak, "round_times_s": times}


def profile_context(runner: ModelRunner, context: int, vocab: int, seed: int, steps: int = 3) -> dict[str, Any]:
    """Where an eager decode step's device time goes at `context`, OmniKV against full attention: the
    kernels' total device time per step (torch.profiler), the top rows printed."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(seed)
    rows = Rows(runner, torch.randint(2, vocab, (context - 2 * (steps + 2) - 1,), generator=g).tolist())
    out: dict[str, Any] = {"context": context}
    try:
        for name, sparse in (("full", False), ("omnikv", True)):
            for _ in range(2):
                rows.step(sparse)
            _sync(runner.device)
            cuda = runner.device.type == "cuda"  # (the smoke run profiles the CPU ops instead)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    rows.step(sparse)
                _sync(runner.device)
            own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
            events = sorted(prof.key_averages(), key=lambda e: -own(e))
            top = [{"kernel": e.key[:90], "calls_per_step": e.count / steps, "ms_per_step": own(e) / steps / 1e3}
                   for e in events[:20]]
            out[name] = {"device_ms_per_step": sum(own(e) for e in events) / steps / 1e3, "top": top}
            print(f"profile at {context}, {name}: {out[name]['device_ms_per_step']:.2f} ms of kernels per step", flush=True)
            for r in top:
                print(f"  {r['ms_per_step']:8.3f} ms  x{r['calls_per_step']:5.1f}  {r['kernel']}", flush=True)
    finally:
        rows.release()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny 6-layer model on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/omnikv_gpu_<device>.json)")
    ap.add_argument("--preset", default=None, help="model preset (default deepseek-v2-lite; smoke: tiny-deepseek-v2)")
    ap.add_argument("--layers", type=int, default=None, help=f"layers (default {V2_LITE_LAYERS}; smoke: 6)")
    ap.add_argument("--contexts", type=int, nargs="*", default=None)
    ap.add_argument("--budget", type=float, default=0.1, help="share of the context selected (default 0.1)")
    ap.add_argument("--filter-layers", type=int, nargs="*", default=None)
    ap.add_argument("--window", type=int, default=1,
                    help="observation window (default 1: the current query, whose importance comes from the filter "
                    "layer's own attention scores; above 1 the importance passes score the keys again)")
    ap.add_argument("--alpha", default=None, help="window weights (default: last_token, exponential with --window > 1)")
    ap.add_argument("--graphs", nargs="*", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--bank", nargs="*", choices=["on", "off"], default=["off", "on"],
                    help="runners without and with OmniKV's context bank (default: both)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timed round (default 16; smoke 2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 3; smoke 1)")
    ap.add_argument("--batch", type=int, nargs="*", default=[1],
                    help="decode batch sizes: that many requests of each context decode together (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                    help="the timed contexts' KV: a prefill of a random prompt (default), or random rows written "
                    "straight into the pool (seconds instead of minutes at 128K; the decode step's work is the same, "
                    "the checks always prefill)")
    ap.add_argument("--check-context", type=int, default=None,
                    help="context of the correctness checks (default: the first context, at most 4096)")
    ap.add_argument("--profile", type=int, default=None, metavar="CONTEXT",
                    help="also profile eager decode steps' kernels at this context (first, on an eager runner "
                    "without the bank)")
    args = ap.parse_args()
    smoke = args.smoke
    device = bench_device(smoke)
    preset = args.preset or ("tiny-deepseek-v2" if smoke else "deepseek-v2-lite")
    layers = args.layers or (6 if smoke else V2_LITE_LAYERS)
    contexts = args.contexts or ([96, 160] if smoke else [4096, 8192, 16384, 32768, 65536, 131072])
    args.warmup = 1 if smoke else 2
    check_context = args.check_context or min(contexts[0], 4096)
    args.steps = args.steps or (2 if smoke else 16)
    args.rounds = args.rounds or (1 if smoke else 3)
    dtype = torch.float32 if smoke else torch.bfloat16
    cfg_model = bench_config(preset, layers)
    fl = tuple(args.filter_layers) if args.filter_layers else OmniKVConfig.default_for(layers).filter_layers
    omni = OmniKVConfig(filter_layers=fl, budget_ratio=args.budget, window=args.window,
                        alpha=args.alpha or ("exponential" if args.window > 1 else "last_token"))
    model = build_model(cfg_model, device, dtype, "torch" if smoke else "triton", args.seed)
    if not args.batch or min(args.batch) < 1:
        ap.error("--batch takes sizes of 1 or more")
    batches = sorted(set(args.batch))
    # slots: the largest batch's copies of the longest prompt, two rows' decode tokens per copy
    per_request = max(max(contexts), check_context) + 2 * (args.steps * args.rounds + 8) + 8
    result: dict[str, Any] = {"bench": "omnikv_gpu", "smoke": smoke, "machine": machine_info(device), "preset": preset,
                              "layers": layers, "dtype": str(dtype), "fill": args.fill, "omnikv": omni.to_dict(),
                              "plan_roles": list(omni.plan(layers).roles), "checks": [], "runs": []}
    ok = True
    out = args.out or str(RESULTS / f"omnikv_gpu_{device_slug(device)}.json")
    @contextlib.contextmanager
    def opened(graphs: bool, bank: bool) -> Iterator[tuple[ModelRunner, int | None]]:
        """A runner over the model (and the device memory its pool took), closed and freed after."""
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        runner = ModelRunner(model, cfg_model, max_total_tokens=(max(batches) + 1) * per_request,
                             max_running_requests=2 * max(batches), max_context_len=per_request, device=device,
                             attention_backend="triton", cuda_graph_max_bs=max(batches), disable_cuda_graph=not graphs,
                             omnikv=omni, omnikv_bank=bank)
        pool_bytes = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
        try:
            yield runner, pool_bytes
        finally:
            runner.close()
            del runner
            release_memory()

    if args.profile:  # first, so that a run cut short still has it
        with opened(graphs=False, bank=False) as (runner, _):
            result["profile"] = profile_context(runner, args.profile, cfg_model.vocab_size, args.seed)
        write_result(out, result)
    for graphs, bank in [(g == "on", b == "on") for b in args.bank for g in args.graphs]:
        if graphs and device.type != "cuda":
            continue
        with opened(graphs, bank) as (runner, pool_bytes):
            # each runner: graphed OmniKV decodes are checked as eager ones are
            for bs in batches:  # each batch size (each its own graph when graphed)
                c = {**check(runner, omni, check_context, cfg_model.vocab_size, args.seed, bs), "graphs": graphs,
                     "bank": bank}
                result["checks"].append(c)
                ok = ok and c["correct"]
                print(f"check at {c['context']}, batch {bs} (graphs {'on' if graphs else 'off'}, bank "
                      f"{'on' if bank else 'off'}): rel err {c['rel_err']:.2e}, copies {c['copies_rel_err']:.2e} "
                      f"({'ok' if c['correct'] else 'WRONG'})", flush=True)
            for ctx in contexts:
                t_prefill = time.perf_counter()
                rows = context_rows(runner, ctx, args, cfg_model.vocab_size, args.seed + ctx, len(batches),
                                    max(batches))
                _sync(device)
                print(f"ctx {ctx:6d}: prompt of {rows.shared} ({args.fill}) held {max(batches)} times in "
                      f"{time.perf_counter() - t_prefill:.1f} s", flush=True)
                try:
                    for bs in batches:
                        row = time_context(runner, rows, ctx, args, graphs, bs)
                        row["pool_device_bytes"] = pool_bytes
                        if runner.graph_runner is not None:
                            row["omnikv_graph_keys"] = sorted(runner.graph_runner.omnikv_graphs)
                        result["runs"].append(row)
                        print(f"ctx {ctx:6d} batch {bs:3d} graphs {'on ' if graphs else 'off'} bank "
                              f"{'on ' if bank else 'off'}: full {row['full_ms']:8.2f} ms, OmniKV "
                              f"{row['omnikv_ms']:8.2f} ms, x{row['speedup']:.2f}, KV on the device "
                              f"{row['kv_device_bytes_per_request'] / 2**20:.0f} MiB/request", flush=True)
                        write_result(out, result)  # after every row: a run cut short keeps what it measured
                finally:
                    rows.release()
    print_table(result["runs"], [("context", "context", "d"), ("batch", "batch", "d"), ("graphs", "graphs", ""),
                                 ("bank", "bank", ""), ("full_ms", "full ms", ".2f"), ("omnikv_ms", "OmniKV ms", ".2f"),
                                 ("speedup", "x", ".2f")])
    write_result(out, result)
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
