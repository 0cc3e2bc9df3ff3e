"""Structured outputs on the CPU: what a JSON Schema constraint costs, served and at the grammar level.

Why: a `response_format` / `structured_outputs` request runs a grammar (xgrammar) in the engine. It is
compiled once per schema (cached), and every decode step then fills a token bitmask per constrained
row and applies it to the logits before sampling, and advances each row's matcher past the chosen
token. That per-step work is serial with the forward, so it shows up directly as lower tokens/s. The
issue's target: constrained output tokens/s >= 0.9 x unconstrained, at 1 and at 16 streams.

1. Served throughput, one `mlaserve serve` process (default model, `--threads` engine threads via
   MLASERVE_CPP_EXPERTS_THREADS), streaming `/v1/chat/completions`, greedy, `max_tokens` fixed:
   - constrained: `response_format: json_schema` with SCHEMA, an inventory of 6 to 8 items of six
     bounded fields each (~35 tokens an item), so the document is longer than `max_tokens` (128 by
     default) and every constrained request stops at the length limit like the unconstrained one;
   - unconstrained: the same messages, `ignore_eos` (a grammar decides where EOS may come, so it is
     not used there).
   Each request's user message starts with a unique number (no prefix-cache hit across requests).
   Tokens are counted from `usage.completion_tokens` (the stream's final chunk); finish reasons and
   content chunks are recorded too. Per round and mode, at each stream count:
     aggregate_tok_s = all completion tokens / (last stream's last chunk - the common send time):
         end to end, prefill and TTFT included (the target is checked on this one);
     per_stream_decode_tok_s_median = median over streams of (tokens - 1) / (last - first content
         chunk): the decode rate alone.
   Rounds interleave the modes (constrained, unconstrained, then unconstrained, constrained, ...)
   after a warm-up of both (the warm-up also compiles the schema: later requests hit the cache). The
   ratio constrained / unconstrained is taken per round, and the median of those ratios is reported
   per stream count (the ratio of the medians too). The quiet-machine gate and the redo of a disturbed
   measurement are serve_cpu.py's (cpu_common). The engine's /metrics counters, read around each
   measurement, split its span per engine step into the forward (batch building + model, prefill
   included) and the rest (sampling with the grammar work, scheduling, the pipe, HTTP): the forward does
   the same work in both modes, so `ratio_at_equal_forward` (the forward's ms per step pooled over
   both modes, the rest as measured) is the grammar's cost without the forward's run-to-run noise.

2. Grammar level, in this process on the default model's tokenizer (vocabulary 49152, stop ids from
   `eos_token_ids`), through `executor.grammar.GrammarBackend` as the engine builds it:
   - first_use_s: the first use of a new backend (xgrammar's TokenizerInfo, the compiler process's
     start, and a one-character regex; the engine pays it once, on its first constrained request);
   - cold_s: compiling each schema on a backend whose cache does not hold it, after its first use
     (the compiler process keeps no cache: xgrammar's is off there);
     warm_s: compiling the same schema again (the backend's cache). Schemas: compile_schemas()
     (the six of tests/server/test_structured_e2e.py, SCHEMA, and `json_object`). Medians over
     `--compile-repeats` fresh backends, each compiling every schema.
   - mask: `apply_grammar_masks` on fp32 [B, 49152] logits for B = 1 and 16, with torch on one thread
     (as the engine's sampler runs beside the native forward), each row a matcher walking a valid
     SCHEMA document token by token (rows staggered so they sit at different places in it); per
     step: the whole call, its two parts (the rows' bitmask fills, timed by wrapping Grammar.fill;
     the rest of the call, which applies the mask), xgrammar's own CPU kernel applying the same
     bitmask (`xgrammar_cpu_kernel`, a reference), and the rows' `accept` of the next token. Also `Sampler.__call__` (greedy) with and without the grammar: the
     sampler's whole per-step cost at that batch. Two documents (NAMES): names as the model writes
     them here ("Item 1"), and 15-character names near the field's maxLength of 20, where xgrammar
     must check many tokens against the remaining length at every fill.

3. Engine steps, the engine core in this process (no HTTP server, no client on the cores), the same
   prompts through the chat template, greedy, `--engine-rounds` interleaved rounds: per forward step,
   ms in the forward, the sampler (mask included), the rows' fills and the mask's apply within it,
   the accepts, and the rest; tokens/s and their ratio, and the ratio at an equal forward.

Reading the result: `ratios.<streams>.median_round_ratio.value` against 0.9 (1 and 16 streams).
`ratio_at_equal_forward` says how much of a shortfall is the grammar's; `engine_steps` says which
part of the per-step work it is (fill: xgrammar's matchers, one row at a time; apply: writing -inf
over the disallowed logits; the sampler's masked copy). `compile` is paid once
per schema (then cached); `first_use_s` once per engine. The machine is shared: rounds disturbed
by other processes are left out of the medians when undisturbed ones exist.

    .venv/bin/python bench/structured_cpu.py [--rounds 6] [--max-tokens 128] [--streams 1,16]
        [--threads 2] [--engine-rounds 2] [--skip-serve] [--skip-engine] [--quick]
        [--out bench/results/structured_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the repository first (its packages, not an editable install's), and bench/ for the helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
import serve_cpu  # noqa: E402
from serve_overhead_cpu import metric  # noqa: E402

FORWARD_S, FORWARD_STEPS = "mlaserve_engine_forward_seconds_total", "mlaserve_engine_forward_steps_total"

MODEL = "smollm2-135m-instruct"
VOCAB = 49152
TARGET = 0.9  # constrained / unconstrained output tokens/s, at every stream count

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3, "maxLength": 20},
    "category": {"enum": ["tool", "food", "book", "toy", "clothing"]},
    "price": {"type": "number", "minimum": 0, "maximum": 1000},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 50},
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "in_stock": {"type": "boolean"}},
    "required": ["name", "category", "price", "quantity", "sku", "in_stock"]}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 8, "items": ITEM}},
          "required": ["items"]}
PROMPT = ("List the items of a small shop's inventory as JSON: for each item its name, category, price, quantity, "
          "SKU and whether it is in stock.")
MASK_BATCHES = (1, 16)


def engine_spec(schema: dict[str, Any]) -> str:
    """The schema as the server hands it to the engine (server.structured: checked, objects closed)."""
    from server.structured import json_schema_output

    return json_schema_output(schema, "response_format").spec


def compile_schemas() -> dict[str, tuple[str, str]]:
    """name -> (kind, spec) compiled in part 2: the end-to-end test's schemas, SCHEMA, any JSON object."""
    from tests.server.test_structured_e2e import SCHEMAS

    out = {name: ("json_schema", engine_spec(s)) for name, s in SCHEMAS.items()}
    out["inventory (the throughput schema)"] = ("json_schema", engine_spec(SCHEMA))
    out["json_object"] = ("json_object", "")
    return out


# the documents the mask walk follows: names as the model writes them greedily here ("Item 1"), and
# 15-character names, near the name's maxLength of 20, where xgrammar checks many tokens at fill time
NAMES = {"short names": "Item {}", "long names": "Garden widget {}"}


def valid_document(name: str = NAMES["short names"], items: int = 8) -> str:
    """A SCHEMA document as the grammar spells it (no free whitespace: ', ' and ': ')."""
    cats = ITEM["properties"]["category"]["enum"]
    return json.dumps({"items": [{"name": name.format(i), "category": cats[i % len(cats)], "price": 12.5 + i,
                                  "quantity": 3 + i, "sku": f"ABC-{1000 + i}", "in_stock": i % 2 == 0}
                                 for i in range(items)]})


# ----------------------------------------------------------------------------------- requests


def chat_body(i: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": serve_cpu.numbered_prompt(i, PROMPT)}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    return body


class ChatStreamState(serve_cpu.StreamState):
    """serve_cpu's fold of a stream, for chat chunks (text in `delta.content`), with the last content time."""

    def __init__(self, t_start: float) -> None:
        super().__init__(t_start)
        self.t_last: float | None = None
        self.content_chunks = 0

    def feed(self, event: dict[str, Any] | str | None, now: float) -> None:
        super().feed(event, now)
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    self.t_first = self.t_first or now
                    self.t_last = now
                    self.content_chunks += 1

    def sample(self, t_end: float) -> dict[str, Any]:
        s = super().sample(t_end)
        s["content_chunks"] = self.content_chunks
        s["decode_s"] = None if self.t_last is None or self.t_first is None else self.t_last - self.t_first
        if self.t_last is not None:
            s["t_end"], s["wall_s"] = self.t_last, self.t_last - self.t_start  # to the last token, not [DONE]
        return s


async def run_chat_streams(url: str, bodies: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """serve_cpu.run_streams on the chat route, each stream folded by ChatStreamState."""
    return await serve_cpu.run_streams(url, bodies, timeout, "/v1/chat/completions", ChatStreamState)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement: serve_cpu's aggregate figures plus the per-stream decode rate and finish reasons."""
    s = serve_cpu.summarize(samples)
    decode = [((x["completion_tokens"] or 0) - 1) / x["decode_s"] for x in samples
              if x.get("decode_s") and (x["completion_tokens"] or 0) > 1]
    s["per_stream_decode_tok_s_median"] = cc.median(decode)
    s["finish_reasons"] = {r: sum(1 for x in samples if x.get("finish_reason") == r)
                           for r in sorted({str(x.get("finish_reason")) for x in samples})}
    return s


def sample_problems(samples: list[dict[str, Any]], max_tokens: int) -> list[str]:
    out = []
    for i, s in enumerate(samples):
        if s.get("error"):
            out.append(f"stream {i}: {s['error']}")
        elif not s.get("completion_tokens"):
            out.append(f"stream {i}: no completion tokens in usage")
        elif s["completion_tokens"] != max_tokens:  # the tokens/s stay per token; recorded, not fatal
            out.append(f"stream {i}: {s['completion_tokens']} tokens ({s.get('finish_reason')}), not {max_tokens}")
    return out


def engine_counters(url: str) -> tuple[float, float] | None:
    """The engine's forward seconds and steps so far (its /metrics), None where they cannot be read."""
    try:
        return metric(url, FORWARD_S), metric(url, FORWARD_STEPS)
    except (Exception, SystemExit):  # a measurement without them is still one
        return None


def per_step(before: tuple[float, float] | None, after: tuple[float, float] | None, span: float) -> dict[str, Any]:
    """Per engine step of a measurement: ms in the forward (batch building and the model), and the rest
    of the span (sampling with its grammar work, scheduling, the engine pipe; prefill steps included)."""
    if before is None or after is None or after[1] <= before[1]:
        return {"engine_steps": None, "forward_ms_per_step": None, "outside_forward_ms_per_step": None}
    steps, forward = after[1] - before[1], after[0] - before[0]
    return {"engine_steps": steps, "forward_ms_per_step": 1e3 * forward / steps,
            "outside_forward_ms_per_step": 1e3 * (span - forward) / steps}


def measure(url: str, pid: int | None, label: str, make: Any, n: int, args: argparse.Namespace,
            problems: list[str]) -> dict[str, Any]:
    """One mode at one stream count: serve_cpu.measure's gate and redo, for chat streams."""
    discarded: list[dict[str, Any]] = []
    gate = None
    for attempt in range(args.retries + 1):
        gate = cc.wait_for_quiet(args.quiet_threshold, args.quiet_wait) if args.quiet_wait > 0 else None
        before = engine_counters(url)
        with cc.OthersMeter((pid,) if pid else ()) as meter:
            samples = asyncio.run(run_chat_streams(url, make(n), args.request_timeout))
        summary = summarize(samples)
        summary.update(per_step(before, engine_counters(url), summary["span_s"]))
        if cc.should_retry(meter.others, args.retry_busy, attempt, args.retries):
            discarded.append({"summary": summary, "gate": gate, "others_busy": meter.others})
            print(f"  {label:28s} other processes used {meter.others:.0%} of the CPUs: measuring again", flush=True)
            continue
        break
    bad = sample_problems(samples, args.max_tokens)
    problems.extend(f"{label}: {p}" for p in bad)
    others = "" if meter.others is None else f", others {meter.others:.0%}"
    print(f"  {label:28s} {summary['aggregate_tok_s'] or 0:8.1f} tok/s aggregate, decode "
          f"{summary['per_stream_decode_tok_s_median'] or 0:7.1f} tok/s per stream, {summary['completion_tokens']} "
          f"tokens{others}" + (f"  [{len(bad)} streams off]" if bad else ""), flush=True)
    return {"summary": summary, "samples": samples, "gate": gate, "others_busy": meter.others, "discarded": discarded}


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the undisturbed rounds, per-round ratios and their median, in place."""
    threshold = result["settings"]["retry_busy"]
    med: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for streams, modes in result["raw"].items():
        med[streams] = {}
        for mode, ms in modes.items():
            kept, used = cc.undisturbed(ms, threshold)
            med[streams][mode] = {**serve_cpu.medians([{k: v for k, v in m["summary"].items() if k != "finish_reasons"}
                                                      for m in kept]), "rounds_used": used}
        pairs = list(zip(modes["constrained"], modes["unconstrained"]))
        quiet = [(c, u) for c, u in pairs if max(c.get("others_busy") or 0, u.get("others_busy") or 0) <= threshold]
        per_round = {k: [cc.ratio(c["summary"][k], u["summary"][k]) for c, u in (quiet or pairs)]
                     for k in ("aggregate_tok_s", "per_stream_decode_tok_s_median")}
        agg = [r for r in per_round["aggregate_tok_s"] if r is not None]
        dec = [r for r in per_round["per_stream_decode_tok_s_median"] if r is not None]
        ratios[streams] = {
            "median_round_ratio": cc.check_target(cc.median(agg), TARGET),
            "round_ratios": per_round["aggregate_tok_s"],
            "decode_median_round_ratio": cc.median(dec),
            "decode_round_ratios": per_round["per_stream_decode_tok_s_median"],
            "ratio_of_medians": cc.ratio(med[streams]["constrained"].get("aggregate_tok_s"),
                                         med[streams]["unconstrained"].get("aggregate_tok_s")),
            "ratio_at_equal_forward": served_equal_forward_ratio(quiet or pairs),
            "rounds_used": len(quiet),  # undisturbed round pairs (0: all disturbed, all used)
        }
    result["medians"], result["ratios"] = med, ratios
    return result


def served_equal_forward_ratio(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
    """equal_forward_ratio for the served rounds, from the engine's counters: unconstrained / constrained
    ms per step with the forward's ms per step pooled over both modes (the rest of each as measured)."""
    c = [m["summary"] for m, _ in pairs if m["summary"].get("forward_ms_per_step") is not None]
    u = [m["summary"] for _, m in pairs if m["summary"].get("forward_ms_per_step") is not None]
    if not c or not u:
        return None
    forward = statistics.median(x["forward_ms_per_step"] for x in c + u)
    rest_c = statistics.median(x["outside_forward_ms_per_step"] for x in c)
    rest_u = statistics.median(x["outside_forward_ms_per_step"] for x in u)
    return (forward + rest_u) / (forward + rest_c)


def serve_rounds(args: argparse.Namespace, streams: list[int], problems: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Part 1: raw measurements per stream count and mode, and the server's command."""
    port = cc.free_port()
    server = serve_cpu.Server("mlaserve", serve_cpu.mlaserve_command(args.model, port, args.server_args.split()),
                              f"http://127.0.0.1:{port}")
    os.environ["MLASERVE_CPP_EXPERTS_THREADS"] = str(args.threads)  # inherited by the server and its engine
    counter = iter(range(1, 1_000_000))
    raw: dict[str, dict[str, list[Any]]] = {str(n): {"constrained": [], "unconstrained": []} for n in streams}

    def maker(constrained: bool) -> Any:
        return lambda n: [chat_body(next(counter), args.max_tokens, constrained) for _ in range(n)]

    try:
        print(f"starting mlaserve: {' '.join(server.command)}", flush=True)
        serve_cpu.start_server(server, Path(tempfile.mkdtemp(prefix="structured_cpu_")), args.start_timeout)
        pid = server.proc.pid if server.proc else None
        print("warm-up (compiles the schema)", flush=True)
        for n in sorted({1, max(streams)}):
            for constrained in (True, False):
                measure(server.url, pid, f"warm-up {n}", maker(constrained), n, args, [])
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for n in streams:
                order = (True, False) if r % 2 == 0 else (False, True)
                for constrained in order:
                    mode = "constrained" if constrained else "unconstrained"
                    raw[str(n)][mode].append(measure(server.url, pid, f"{n} streams {mode}", maker(constrained), n,
                                                     args, problems))
    finally:
        serve_cpu.stop_server(server)
    return raw, server.command


# ------------------------------------------------------------------------------ grammar level


def tokenizer_bundle() -> Any:
    from models.loader.tokenizer import load_tokenizer

    return load_tokenizer(MODEL)


def compile_times(tok: Any, repeats: int, names: list[str] | None = None) -> dict[str, Any]:
    """Part 2a: a backend's first use, cold and warm compile of each schema (medians over fresh backends)."""
    from executor.grammar import GrammarBackend

    schemas = compile_schemas()
    names = names or list(schemas)
    runs: dict[str, dict[str, list[float]]] = {n: {"cold_s": [], "warm_s": []} for n in names}
    info_s: list[float] = []
    for _ in range(repeats):
        backend = GrammarBackend(tok.tokenizer, VOCAB, tok.eos_token_ids)
        t = time.perf_counter()
        backend.compile("regex", "a", "bench")  # tokenizer info and compiler process: timed apart
        info_s.append(time.perf_counter() - t)
        for name in names:  # (each schema is new to the backend's cache: its first compile is cold)
            kind, spec = schemas[name]
            for key in ("cold_s", "warm_s"):
                t = time.perf_counter()
                backend.compile(kind, spec, "bench")
                runs[name][key].append(time.perf_counter() - t)
        backend.shutdown()
    return {"first_use_s": {"median": cc.median(info_s), "max": max(info_s), "runs": info_s},
            "schemas": {n: {"kind": schemas[n][0], "cold_s": cc.median(r["cold_s"]), "warm_s": cc.median(r["warm_s"]),
                            "cold_runs": r["cold_s"], "warm_runs": r["warm_s"]} for n, r in runs.items()},
            "repeats": repeats, "grammar_threads": GrammarBackend(tok.tokenizer, VOCAB, tok.eos_token_ids)._threads}


class _Clock:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
        return timed


def _ms(v: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(v), "mean_ms": 1e3 * statistics.fmean(v), "max_ms": 1e3 * max(v)}


def mask_costs(tok: Any, batches: tuple[int, ...] = MASK_BATCHES, max_steps: int | None = None) -> dict[str, Any]:
    """Part 2b: per-step grammar cost at each batch, for each document of NAMES."""
    import torch

    import executor.grammar as eg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's sampler thread, beside the native forward's own pool
    backend = eg.GrammarBackend(tok.tokenizer, VOCAB, tok.eos_token_ids)
    clock, fill = _Clock(), eg.Grammar.fill
    try:
        eg.Grammar.fill = clock.wrap("fill", fill)  # type: ignore[method-assign]
        compiled = backend.compile("json_schema", engine_spec(SCHEMA), "bench")
        out: dict[str, Any] = {"torch_threads": 1, "documents": {}}
        for doc_name, name in NAMES.items():
            text = valid_document(name)
            doc = tok.encode(text, add_special_tokens=False) + [int(tok.eos_token_ids[0])]
            out["documents"][doc_name] = {"document": text, "tokens": len(doc)}
            for b in batches:
                out["documents"][doc_name][str(b)] = mask_walk(backend, compiled, doc, b, tok.eos_token_ids,
                                                               max_steps, clock)
        return out
    finally:
        eg.Grammar.fill = fill  # type: ignore[method-assign]
        backend.shutdown()
        torch.set_num_threads(threads)


def mask_walk(backend: Any, compiled: Any, doc: list[int], b: int, eos: Any, max_steps: int | None,
              clock: _Clock) -> dict[str, Any]:
    """`b` matchers walk `doc` (row i starts i x stagger tokens in, so rows sit at different places);
    per step: apply_grammar_masks, its parts (the rows' fills, timed by `clock`, which wraps
    Grammar.fill; the rest of the call, which applies the mask), xgrammar's own CPU kernel applying the
    same bitmask (a reference), the greedy sampler with and without the grammar, and the rows' accepts."""
    import torch
    import xgrammar as xgr

    from executor.grammar import apply_grammar_masks
    from executor.sampler import Sampler, SamplingRow
    from scheduler.sampling_params import SamplingParams

    steps = len(doc) // 2 if max_steps is None else min(max_steps, len(doc) // 2)
    stagger = (len(doc) - steps) // b
    grammars = [backend.grammar(compiled) for _ in range(b)]
    for i, g in enumerate(grammars):
        for t in doc[: i * stagger]:
            assert g.accept(t), "the benchmark's document does not match SCHEMA"
    x0 = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b))
    x = x0.clone()
    bitmask = xgr.allocate_token_bitmask(b, VOCAB)
    sampler, params = Sampler(VOCAB), SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, seed=0, step=0, prompt_ids=[1], output_ids=[], eos_token_ids=eos, grammar=g)
            for g in grammars]
    plain = [SamplingRow(params, seed=0, step=0, prompt_ids=[1], output_ids=[], eos_token_ids=eos) for _ in range(b)]
    t: dict[str, list[float]] = {k: [] for k in ("apply_grammar_masks", "fill", "apply", "xgrammar_cpu_kernel",
                                                 "accept", "sampler_with_grammar", "sampler_without_grammar")}
    for s in range(steps):
        x.copy_(x0)  # untimed: every masking call sees unmasked logits
        clock.s.clear()
        t0 = time.perf_counter()
        apply_grammar_masks(x, grammars)
        t1 = time.perf_counter()
        filled = clock.s.get("fill", 0.0)
        masked = x.clone()
        for i, g in enumerate(grammars):  # untimed: the same bitmask for xgrammar's kernel
            g.fill(bitmask, i)
        x.copy_(x0)
        t2 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=VOCAB, indices=list(range(b)))
        t3 = time.perf_counter()
        assert torch.equal(x, masked), "apply_grammar_masks and xgrammar's kernel disagree"
        sampler(x0, rows)  # the sampler masks a copy: x0 stays unmasked
        t4 = time.perf_counter()
        sampler(x0, plain)
        t5 = time.perf_counter()
        for i, g in enumerate(grammars):
            assert g.accept(doc[i * stagger + s])
        t6 = time.perf_counter()
        for k, v in (("apply_grammar_masks", t1 - t0), ("fill", filled), ("apply", t1 - t0 - filled),
                     ("xgrammar_cpu_kernel", t3 - t2), ("sampler_with_grammar", t4 - t3),
                     ("sampler_without_grammar", t5 - t4), ("accept", t6 - t5)):
            t[k].append(v)
    return {"steps": steps, **{k: _ms(v) for k, v in t.items()}}


# ------------------------------------------------------------------------------- engine steps


def equal_forward_ratio(modes: dict[str, list[dict[str, Any]]]) -> float | None:
    """Constrained / unconstrained tokens per step-second with the forward's ms per step the same in
    both (the median over every run of either mode): what the work outside the forward costs, without
    the forward's run-to-run noise (the forward does the same work whether the output is constrained)."""
    runs = modes["constrained"] + modes["unconstrained"]
    if not modes["constrained"] or not modes["unconstrained"]:
        return None
    forward = statistics.median(r["forward_ms"] for r in runs)

    def step(rs: list[dict[str, Any]]) -> float:
        return forward + statistics.median(r["step_ms"] - r["forward_ms"] for r in rs)

    return step(modes["unconstrained"]) / step(modes["constrained"])


def engine_steps(stream_counts: list[int], max_tokens: int, threads: int, rounds: int) -> dict[str, Any]:
    """Part 3: the engine core in this process (no HTTP, no other process on the cores), the same chat
    prompts, greedy: per forward step, ms in the forward (the scheduler's counter), the sampler, its
    grammar masking (the rows' fills, xgrammar's apply) and the matchers' accepts, constrained or not.
    The grammar calls are timed by wrapping them in place for the run (restored after)."""
    import torch

    import executor.grammar as eg
    import executor.sampler as es
    from engine.args import EngineArgs
    from engine.core import EngineCore
    from engine.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams, StructuredOutput
    from server.chat_template import render_messages

    torch_threads = torch.get_num_threads()
    env = os.environ.get("MLASERVE_CPP_EXPERTS_THREADS")
    os.environ["MLASERVE_CPP_EXPERTS_THREADS"] = str(threads)
    clock = _Clock()
    saved = (es.apply_grammar_masks, eg.Grammar.fill, eg.Grammar.accept)
    core = None
    try:
        es.apply_grammar_masks = clock.wrap("mask", es.apply_grammar_masks)
        eg.Grammar.fill = clock.wrap("fill", eg.Grammar.fill)  # type: ignore[method-assign]
        eg.Grammar.accept = clock.wrap("accept", eg.Grammar.accept)  # type: ignore[method-assign]
        slots = max(8192, max(stream_counts) * (256 + max_tokens))
        core = EngineCore(EngineArgs(model=MODEL, max_total_tokens=slots))
        sampler = core.scheduler.sampler
        core.scheduler.sampler = clock.wrap("sampler", sampler)
        tok = tokenizer_bundle()
        spec = engine_spec(SCHEMA)
        counter = iter(range(1, 1_000_000))

        def prompt() -> list[int]:
            messages = [{"role": "user", "content": serve_cpu.numbered_prompt(next(counter), PROMPT)}]
            text = render_messages(tok.chat_template, messages, bos_token=tok.bos_token,
                               eos_token=tok.eos_token)
            return tok.encode(text, add_special_tokens=False)

        def run(constrained: bool, n: int) -> dict[str, Any]:
            structured = StructuredOutput("json_schema", spec, "response_format") if constrained else None
            for i in range(n):
                p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                                   structured=structured)
                core.add_request(GenerateRequest(f"bench-{next(counter)}", prompt(), p))
            for c in core._compiling:  # compiled (a cache hit after the warm-up) before the clock starts; they
                c.future.result()  # join the scheduler in the first timed step, prefill included as for the others
            c = core.scheduler.counters
            f0, s0 = c.forward_seconds, c.forward_steps
            clock.s.clear()
            tokens, t0 = 0, time.perf_counter()
            while core.has_work():
                tokens += sum(len(o.new_token_ids) for o in core.step())
            wall = time.perf_counter() - t0
            steps = max(1, c.forward_steps - s0)
            per = {k: 1e3 * v / steps for k, v in clock.s.items()}
            forward = 1e3 * (c.forward_seconds - f0) / steps
            return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps,
                    "step_ms": 1e3 * wall / steps,
                    "forward_ms": forward, "sampler_ms": per.get("sampler", 0.0), "mask_ms": per.get("mask", 0.0),
                    "fill_ms": per.get("fill", 0.0), "apply_ms": per.get("mask", 0.0) - per.get("fill", 0.0),
                    "accept_ms": per.get("accept", 0.0),
                    "rest_ms": 1e3 * wall / steps - forward - per.get("sampler", 0.0) - per.get("accept", 0.0)}

        for n in sorted({1, max(stream_counts)}):  # warm-up: compiles the schema, fills the caches
            run(True, n)
            run(False, n)
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {"constrained": [], "unconstrained": []}
                                                           for n in stream_counts}
        for r in range(rounds):
            for n in stream_counts:
                for constrained in ((True, False) if r % 2 == 0 else (False, True)):
                    raw[str(n)]["constrained" if constrained else "unconstrained"].append(run(constrained, n))
        med = {n: {mode: {k: cc.median([x[k] for x in xs]) for k in xs[0]} for mode, xs in modes.items()}
               for n, modes in raw.items()}
        ratios = {n: cc.ratio(m["constrained"]["tok_s"], m["unconstrained"]["tok_s"]) for n, m in med.items()}
        return {"rounds": rounds, "threads": threads, "max_tokens": max_tokens, "medians": med,
                "tok_s_ratio": ratios, "ratio_at_equal_forward": {n: equal_forward_ratio(modes)
                                                                  for n, modes in raw.items()}, "raw": raw}
    finally:
        es.apply_grammar_masks, eg.Grammar.fill, eg.Grammar.accept = saved
        if core is not None:
            if core.grammars is not None:
                core.grammars.shutdown()
            core.runner.close()
        if env is None:
            os.environ.pop("MLASERVE_CPP_EXPERTS_THREADS", None)
        else:
            os.environ["MLASERVE_CPP_EXPERTS_THREADS"] = env
        torch.set_num_threads(torch_threads)


# ----------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="served model (part 2 always uses the default model's tokenizer)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="even: each order (constrained first, unconstrained first) as often")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,16", help="comma-separated stream counts")
    ap.add_argument("--threads", type=int, default=2, help="engine threads (MLASERVE_CPP_EXPERTS_THREADS)")
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--server-args", default="", help="extra flags for mlaserve serve (one string)")
    ap.add_argument("--engine-rounds", type=int, default=2, help="rounds of part 3 (the in-process engine steps)")
    ap.add_argument("--skip-serve", action="store_true", help="no server (part 1 left out)")
    ap.add_argument("--skip-engine", action="store_true", help="no in-process engine (part 3 left out)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 round, 16 tokens, streams 1,2, no quiet gate, one compile repeat")
    cc.add_quiet_args(ap, retries=2)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=None, help="default: bench/results/structured_cpu_<machine-tag>.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.compile_repeats, args.engine_rounds = 1, 16, 1, 1
        args.quiet_wait, args.retries = 0.0, 0
        if args.streams == "1,16":
            args.streams = "1,2"
    try:
        args.stream_counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--streams must be comma-separated integers, got {args.streams!r}")
    for name in ("rounds", "max_tokens", "threads", "compile_repeats", "engine_rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.stream_counts or min(args.stream_counts) < 1:
        ap.error("--streams must name stream counts >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = cc.machine_info()
    problems: list[str] = []
    tok = tokenizer_bundle()
    print("grammar compile times", flush=True)
    compiles = compile_times(tok, args.compile_repeats)
    print("per-step mask cost", flush=True)
    masks = mask_costs(tok, max_steps=20 if args.quick else None)
    raw, command = ({}, []) if args.skip_serve else serve_rounds(args, args.stream_counts, problems)
    steps = None
    if not args.skip_engine:
        print("engine steps in this process", flush=True)
        steps = engine_steps(args.stream_counts, args.max_tokens, args.threads, args.engine_rounds)
    machine["load_average_at_end"] = list(os.getloadavg())
    result: dict[str, Any] = {
        "benchmark": "structured_cpu",
        "machine": machine,
        "versions": {**cc.versions(), "xgrammar": _version("xgrammar"), "sources_sha1": sources_sha1()},
        "model": args.model,
        "settings": {"rounds": args.rounds, "max_tokens": args.max_tokens, "streams": args.stream_counts,
                     "threads": args.threads, "quick": args.quick, "retry_busy": args.retry_busy,
                     "quiet_threshold": args.quiet_threshold, "quiet_wait": args.quiet_wait, "retries": args.retries,
                     "temperature": 0, "api": "/v1/chat/completions, stream, stream_options.include_usage",
                     "constrained": "response_format json_schema SCHEMA", "unconstrained": "ignore_eos",
                     "prompt": "Request NNNNN. " + PROMPT, "schema": SCHEMA,
                     "tokens": "usage.completion_tokens", "aggregate_tok_s": "tokens / (last content chunk - send)",
                     "decode_tok_s": "(tokens - 1) / (last - first content chunk), median over streams"},
        "command": command,
        "target": {"ratio": TARGET, "on": "median over rounds of constrained / unconstrained aggregate_tok_s"},
        "compile": compiles,
        "mask": masks,
        "engine_steps": steps,
        "problems": problems,
        "raw": raw,
    }
    if raw:
        analyze(result)
    out = args.out or cc.RESULTS / f"structured_cpu_{cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    print_report(result)
    print(f"wrote {out}")
    if problems:
        print(f"{len(problems)} notes (see 'problems' in the JSON):", *problems[:10], sep="\n  ")
    return 0


def sources_sha1(paths: tuple[str, ...] = ("executor/grammar.py", "executor/sampler.py")) -> dict[str, str | None]:
    """SHA-1 of the files that decide the per-step grammar cost: with a dirty tree, which code was measured."""
    import hashlib

    out: dict[str, str | None] = {}
    for rel in paths:
        try:
            out[rel] = hashlib.sha1((cc.ROOT / rel).read_bytes()).hexdigest()
        except OSError:
            out[rel] = None
    return out


def _version(pkg: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def print_report(result: dict[str, Any]) -> None:
    for streams, r in result.get("ratios", {}).items():
        med = result["medians"][streams]
        t = r["median_round_ratio"]
        verdict = "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"
        v = "-" if t["value"] is None else f"{t['value']:.3f}"
        dec = "-" if r["decode_median_round_ratio"] is None else f"{r['decode_median_round_ratio']:.3f}"
        eq = "-" if r["ratio_at_equal_forward"] is None else f"{r['ratio_at_equal_forward']:.3f}"
        print(f"{streams:>3s} streams: constrained {med['constrained'].get('aggregate_tok_s') or 0:7.1f} tok/s, "
              f"unconstrained {med['unconstrained'].get('aggregate_tok_s') or 0:7.1f} tok/s; median round ratio "
              f"{v} (target >= {TARGET}: {verdict}); decode-only ratio {dec}")
        print(f"{'':13s}ms per engine step outside the forward: constrained "
              f"{med['constrained'].get('outside_forward_ms_per_step') or 0:.2f}, unconstrained "
              f"{med['unconstrained'].get('outside_forward_ms_per_step') or 0:.2f} (forward "
              f"{med['unconstrained'].get('forward_ms_per_step') or 0:.2f}); ratio at an equal forward {eq}")
    c = result["compile"]
    print(f"first use: {1e3 * c['first_use_s']['median']:.0f} ms (once per engine)")
    print(f"{'schema':36s} {'cold ms':>9s} {'warm ms':>9s}")
    for name, s in c["schemas"].items():
        print(f"{name:36s} {1e3 * s['cold_s']:9.1f} {1e3 * s['warm_s']:9.3f}")
    print(f"{'document':12s} {'batch':>5s} {'mask':>7s} {'fill':>7s} {'apply':>7s} {'xgr-apply':>9s} {'accept':>7s} "
          f"{'sampler+g':>9s} {'sampler':>8s}  (grammar level, mean ms per step)")
    for doc, per in result["mask"]["documents"].items():
        for b in (k for k in per if k.isdigit()):
            r = per[b]
            print(f"{doc:12s} {b:>5s} {r['apply_grammar_masks']['mean_ms']:7.3f} {r['fill']['mean_ms']:7.3f} "
                  f"{r['apply']['mean_ms']:7.3f} {r['xgrammar_cpu_kernel']['mean_ms']:9.3f} {r['accept']['mean_ms']:7.3f} "
                  f"{r['sampler_with_grammar']['mean_ms']:9.3f} {r['sampler_without_grammar']['mean_ms']:8.3f}")
    steps = result.get("engine_steps")
    if steps:
        print(f"{'engine':16s} {'tok/s':>7s} {'step':>7s} {'forward':>8s} {'sampler':>8s} {'fill':>6s} {'apply':>6s} "
              f"{'accept':>7s} {'rest':>6s}  (in-process engine, ms per step)")
        for n, modes in steps["medians"].items():
            for mode, m in modes.items():
                print(f"{n + ' ' + mode:16s} {m['tok_s']:7.1f} {m['step_ms']:7.2f} {m['forward_ms']:8.2f} "
                      f"{m['sampler_ms']:8.2f} {m['fill_ms']:6.2f} {m['apply_ms']:6.2f} {m['accept_ms']:7.3f} "
                      f"{m['rest_ms']:6.2f}")
            print(f"{'':16s} ratio {steps['tok_s_ratio'][n]:.3f}, at an equal forward "
                  f"{steps['ratio_at_equal_forward'][n]:.3f}")


if __name__ == "__main__":
    sys.exit(main())
