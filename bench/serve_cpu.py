"""Served benchmark on the CPU: `mlaserve serve` against llama.cpp's `llama-server`, same GGUF, same
requests, through the OpenAI-compatible streaming `/v1/completions` API.

Workloads (each request: the same fixed prompt behind a unique request number, so neither server's
prefix cache serves it from an earlier request; `max_tokens` 128, `temperature` 0 (with `--sampled` the default
model's own temperature 0.2 and top_p 0.9, sent to every server, and a seed per request), `ignore_eos`):
  (a) 1 stream: output tokens/s = completion tokens / wall time of the request (nothing excluded),
      and TTFT (request sent -> first chunk carrying text);
  (b) N concurrent streams (default 16): aggregate output tokens/s = all completion tokens / (last
      stream's end - the common start), TTFT p50 and p99 over the streams, per-stream tokens/s.
Tokens are counted from each server's `usage` (both must report exactly `max_tokens`).
With `--shared-prefix N` every prompt starts with a shared text of about N tokens (a session number
new for each batch of streams, so no batch finds an earlier one's prefix cached, then the text),
then its own request number and the prompt above: N concurrent chats behind one system prompt,
where a server computes the shared part once or once per stream.

Peer: `llama-server -m <the same .gguf> -np N -t <cores> -c N x (prompt + max_tokens + slack)` (one
KV slice per slot; `--no-repack` on a CPU with AMX-INT8, where llama.cpp's AMX weight buffers crash),
built by `make peers` (bench/peers.py); where it is absent the peer is recorded
as skipped. Both servers are started once and stay up; while one is measured the other is idle.
`--checkout LABEL=DIR` adds an mlaserve server run from another checkout (a change against the code before
it, in the same rounds). Rounds are interleaved (ours, peer, peer, ours, ...: the order alternates) after a
warm-up of every server,
and medians over `--rounds` are reported with every raw sample. The machine may be shared and noisy.

On a shared machine each measurement waits (at most `--quiet-wait` s) until the CPUs were less
than `--quiet-threshold` busy over half a second, and is redone (fresh prompts, `--retries` times at
most) when processes other than the server and this client used more than `--retry-busy` of the
CPUs while it ran; what each saw is recorded, disturbed attempts as `discarded`. (llama.cpp's
threads spin at barriers: with one of 2 cores taken by someone else it runs many times slower.)

Floor: none computed here (served throughput mixes batching, scheduling and HTTP); the model-level
floor is in bench/deepseek_cpu.py. Targets (ours / llama-server): 1 stream >= 1.0x output tokens/s;
16 streams >= 1.5x aggregate tokens/s and TTFT p99 <= llama-server's.

    .venv/bin/python bench/serve_cpu.py [--model smollm2-135m-instruct] [--rounds 3] [--streams 16]
        [--max-tokens 128] [--ours-only] [--out bench/results/serve_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# the repository first (its packages, not an editable install's), and bench/ for the helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import cpu_common as cc  # noqa: E402
import peers  # noqa: E402

PROMPT = (
    "You are the keeper of a lighthouse on a small rocky island far out at sea. Every evening you climb the "
    "spiral staircase, trim the wick, polish the great lens and watch the ships pass in the dark. Write a "
    "long, detailed story about one winter night when a storm cut the island off from the mainland, the "
    "radio went silent, and a small boat with no lights appeared on the horizon. Describe the sea, the "
    "sounds of the wind, what you did hour by hour, and how the night ended."
)
TARGETS = {"single_tok_s_ratio": 1.0, "concurrent_aggregate_tok_s_ratio": 1.5, "concurrent_ttft_p99_ratio": 1.0}
CTX_SLACK = 64  # tokens per llama-server slot beyond prompt + max_tokens


@dataclass
class Server:
    name: str
    command: list[str]
    url: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    cwd: Path | None = None  # the checkout it runs from (default: this one)


# ----------------------------------------------------------------------------------- request side


# `--sampled`: the default model's own sampling defaults, sent explicitly so that llama-server samples
# with them too
SAMPLED = {"temperature": 0.2, "top_p": 0.9}


def request_body(prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, Any]:
    """The body every server gets: streaming, greedy (or with a seed: `SAMPLED`), EOS ignored, usage in
    the stream."""
    sampling = {"temperature": 0} if seed is None else {**SAMPLED, "seed": seed}
    return {"prompt": prompt, "max_tokens": max_tokens, **sampling, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def numbered_prompt(i: int, prompt: str = PROMPT) -> str:
    """A unique prefix per request, the same for both servers: no prefix-cache hits across requests."""
    return f"Request {i:05d}. {prompt}"


def shared_prefix(session: int, tokens: int) -> str:
    """`--shared-prefix`: a session's shared text of about `tokens` tokens (~90 a copy of PROMPT)."""
    return f"Session {session:05d}. " + " ".join([PROMPT] * max(1, round(tokens / 90))) + " "


def parse_sse(line: str) -> dict[str, Any] | None | str:
    """One SSE line: its JSON object, "[DONE]", or None for blank/comment/other lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    return json.loads(data)


class StreamState:
    """Folds the chunks of one streamed completion into a sample (TTFT, usage, finish reason)."""

    def __init__(self, t_start: float) -> None:
        self.t_start = t_start
        self.t_first: float | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.chunks = 0
        self.done = False
        self.error: str | None = None

    def feed(self, event: dict[str, Any] | str | None, now: float) -> None:
        if event is None:
            return
        if event == "[DONE]":
            self.done = True
            return
        assert isinstance(event, dict)
        if "error" in event:
            self.error = json.dumps(event["error"])[:500]
        self.chunks += 1
        for choice in event.get("choices") or []:
            if self.t_first is None and choice.get("text"):
                self.t_first = now
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            self.usage = event["usage"]

    def sample(self, t_end: float) -> dict[str, Any]:
        usage = self.usage or {}
        return {
            "t_start": self.t_start, "t_end": t_end, "wall_s": t_end - self.t_start,
            "ttft_s": None if self.t_first is None else self.t_first - self.t_start,
            "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
            "finish_reason": self.finish_reason, "chunks": self.chunks, "done": self.done, "error": self.error,
        }


async def stream_one(client: Any, url: str, body: dict[str, Any], t0: float | None = None,
                     path: str = "/v1/completions", state_cls: type[StreamState] = StreamState) -> dict[str, Any]:
    """One streamed request folded by `state_cls` (a StreamState) into a sample."""
    t_start = time.perf_counter() if t0 is None else t0
    state = state_cls(t_start)
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                state.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
            else:
                async for line in r.aiter_lines():
                    state.feed(parse_sse(line), time.perf_counter())
    except Exception as e:  # recorded in the sample: a broken run must not look like a fast one
        state.error = f"{type(e).__name__}: {e}"
    return state.sample(time.perf_counter())


async def run_streams(url: str, bodies: list[dict[str, Any]], timeout: float, path: str = "/v1/completions",
                      state_cls: type[StreamState] = StreamState) -> list[dict[str, Any]]:
    """All bodies sent at once (one connection each); samples share the same start time."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(stream_one(client, url, b, t0, path, state_cls) for b in bodies)))


def sample_problems(samples: list[dict[str, Any]], max_tokens: int) -> list[str]:
    """What makes samples unusable: errors, missing usage, a wrong token count."""
    out = []
    for i, s in enumerate(samples):
        if s.get("error"):
            out.append(f"stream {i}: {s['error']}")
        elif s.get("completion_tokens") != max_tokens:
            out.append(f"stream {i}: {s.get('completion_tokens')} completion tokens in usage, expected {max_tokens}")
        elif s.get("ttft_s") is None:
            out.append(f"stream {i}: no chunk carried text")
    return out


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One round of one workload: aggregate and per-stream tokens/s, TTFT p50/p99 (seconds)."""
    tokens = [s["completion_tokens"] or 0 for s in samples]
    start = min(s["t_start"] for s in samples)
    span = max(s["t_end"] for s in samples) - start
    ttfts = [s["ttft_s"] for s in samples if s["ttft_s"] is not None]
    per_stream = [(s["completion_tokens"] or 0) / s["wall_s"] for s in samples if s["wall_s"] > 0]
    return {
        "streams": len(samples),
        "completion_tokens": sum(tokens),
        "span_s": span,
        "aggregate_tok_s": sum(tokens) / span if span > 0 else None,
        "per_stream_tok_s_median": cc.median(per_stream),
        "per_stream_tok_s_min": min(per_stream) if per_stream else None,
        "ttft_p50_s": cc.percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": cc.percentile(ttfts, 99) if ttfts else None,
    }


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of every numeric field of `summarize`."""
    keys = [k for k, v in rounds[0].items() if isinstance(v, (int, float))] if rounds else []
    return {k: cc.median([r[k] for r in rounds if r.get(k) is not None]) for k in keys}


def compare(ours: dict[str, Any], peer: dict[str, Any] | None) -> dict[str, Any]:
    """Ratios ours / llama-server of the medians, each against its target."""
    peer = peer or {}
    single = cc.ratio(ours.get("single", {}).get("aggregate_tok_s"), peer.get("single", {}).get("aggregate_tok_s"))
    agg = cc.ratio(ours.get("concurrent", {}).get("aggregate_tok_s"),
                   peer.get("concurrent", {}).get("aggregate_tok_s"))
    p99 = cc.ratio(ours.get("concurrent", {}).get("ttft_p99_s"), peer.get("concurrent", {}).get("ttft_p99_s"))
    return {
        "single_tok_s_ratio": cc.check_target(single, TARGETS["single_tok_s_ratio"]),
        "single_ttft_ratio": cc.ratio(ours.get("single", {}).get("ttft_p50_s"),
                                      peer.get("single", {}).get("ttft_p50_s")),
        "concurrent_aggregate_tok_s_ratio": cc.check_target(agg, TARGETS["concurrent_aggregate_tok_s_ratio"]),
        "concurrent_ttft_p99_ratio": cc.check_target(p99, TARGETS["concurrent_ttft_p99_ratio"], higher_is_better=False),
        "concurrent_per_stream_tok_s_ratio": cc.ratio(ours.get("concurrent", {}).get("per_stream_tok_s_median"),
                                                      peer.get("concurrent", {}).get("per_stream_tok_s_median")),
    }


# ------------------------------------------------------------------------------------ server side


def mlaserve_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning", *extra]


def llama_server_command(binary: Path, gguf: str, port: int, parallel: int, threads: int, ctx: int,
                         extra: list[str]) -> list[str]:
    return [str(binary), "-m", gguf, "-np", str(parallel), "-t", str(threads), "-c", str(ctx), "--host",
            "127.0.0.1", "--port", str(port), "--no-webui", *peers.llama_server_args(), *extra]


def slot_context(prompt_tokens: int, max_tokens: int) -> int:
    """Per-slot context for llama-server: prompt + completion + slack, rounded up to 256."""
    need = prompt_tokens + max_tokens + CTX_SLACK
    return -(-need // 256) * 256


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def stop_servers_on_term() -> None:
    """SIGTERM (`timeout`, a job runner) ends the benchmark as an exception does, so the `finally` blocks
    that stop its servers run: by default it killed the script alone, and its servers (in sessions of
    their own) ran on, holding their ports and the CPU. Only from the main thread, and only where nobody
    set a handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_term)


def start_server(server: Server, log_dir: Path, timeout: float) -> None:
    import httpx

    stop_servers_on_term()
    server.log = log_dir / f"{server.name}.log"
    with server.log.open("w") as log:
        server.proc = subprocess.Popen(server.command, cwd=server.cwd or cc.ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"{server.name} exited with {server.proc.returncode}:\n{tail}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{server.name} did not get ready in {timeout:.0f} s (log: {server.log})")


def stop_server(server: Server) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    server.proc.terminate()
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


def prompt_token_count(model: str, text: str) -> int | None:
    try:
        from models.loader.tokenizer import load_tokenizer

        return len(load_tokenizer(model).encode(text))
    except Exception as e:  # the context size then falls back to a generous guess
        print(f"could not tokenize the prompt ({e}); sizing llama-server's context by a guess")
        return None


def checkout(item: str) -> tuple[str, Path]:
    """`--checkout LABEL=DIR`: (LABEL, DIR resolved); SystemExit where DIR is no checkout of this repository."""
    label, sep, where = item.partition("=")
    if not sep or not label or not (Path(where) / "mlaserve").is_dir():
        raise SystemExit(f"--checkout {item!r}: give LABEL=DIR, DIR a checkout of this repository")
    return label, Path(where).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="built-in name or .gguf path (default: the built-in default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams of workload (b)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the usable cores)")
    ap.add_argument("--ours-only", action="store_true", help="do not start llama-server")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="start every prompt of a batch with the same ~N tokens (default 0: none)")
    ap.add_argument("--sampled", action="store_true",
                    help=f"sample with {SAMPLED} and a seed per request instead of greedy")
    ap.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                    help="also an mlaserve server run from another checkout of this repository (its code, this "
                         "Python; build its extension first), named mlaserve-LABEL, in the same rounds")
    ap.add_argument("--ours-args", default="", help="extra flags for mlaserve serve (one string)")
    ap.add_argument("--peer-args", default="", help="extra flags for llama-server (one string)")
    cc.add_quiet_args(ap, retries=3)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--reanalyze", default=None, metavar="JSON",
                    help="recompute medians and ratios of a saved result from its raw samples (runs nothing)")
    ap.add_argument("--tag", default=None, help="machine tag in the result file name (default: from /proc/cpuinfo)")
    ap.add_argument("--out", default=None, help="default: bench/results/serve_cpu_<machine-tag>.json")
    args = ap.parse_args(argv)
    for name in ("rounds", "streams", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.reanalyze and not Path(args.reanalyze).is_file():
        ap.error(f"--reanalyze {args.reanalyze}: no such file (a result JSON this script wrote)")
    if args.model:
        from models.builtin import resolve_model_path

        try:
            resolve_model_path(args.model)
        except FileNotFoundError as e:
            ap.error(f"--model: {e}")
    for item in args.checkout:  # (said after the model loaded, with exit 1)
        try:
            checkout(item)
        except SystemExit as e:
            ap.error(str(e))
    return args


def measure(server: Server, workload: str, bodies: list[dict[str, Any]], args: argparse.Namespace,
            problems: list[str], fresh: Callable[[int], list[dict[str, Any]]] | None = None,
            retries: int = 0) -> dict[str, Any]:
    """One workload on one server. Waits for a quiet machine first; when other processes used more
    than --retry-busy of the CPUs meanwhile, measures again (with `fresh` bodies, so no prompt is
    served from the prefix cache) up to `retries` times, keeping the disturbed attempts as discarded."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(retries + 1):
        gate = cc.wait_for_quiet(args.quiet_threshold, args.quiet_wait) if args.quiet_wait > 0 else None
        with cc.OthersMeter((server.proc.pid,) if server.proc else ()) as meter:
            samples = asyncio.run(run_streams(server.url, bodies, args.request_timeout))
        summary = summarize(samples)
        if cc.should_retry(meter.others, args.retry_busy, attempt, retries) and fresh is not None:
            discarded.append({"summary": summary, "gate": gate, "others_busy": meter.others})
            print(f"  {server.name:12s} {workload:10s} other processes used {meter.others:.0%} of the CPUs: "
                  "measuring again", flush=True)
            bodies = fresh(len(bodies))
            continue
        break
    bad = sample_problems(samples, args.max_tokens)
    problems.extend(f"{server.name} {workload}: {p}" for p in bad)
    others = "" if meter.others is None else f", others {meter.others:.0%}"
    print(f"  {server.name:12s} {workload:10s} {summary['aggregate_tok_s'] or 0:8.1f} tok/s aggregate, "
          f"TTFT p50 {summary['ttft_p50_s'] or 0:6.3f} s p99 {summary['ttft_p99_s'] or 0:6.3f} s{others}"
          + (f"  [{len(bad)} bad streams]" if bad else ""), flush=True)
    return {"summary": summary, "samples": samples, "gate": gate, "others_busy": meter.others,
            "discarded": discarded}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyze:
        result = analyze(json.loads(Path(args.reanalyze).read_text()))
        cc.write_json(args.reanalyze, result)
        print_report(result)
        print(f"rewrote {args.reanalyze}")
        return 0
    from models.builtin import DEFAULT_MODEL, resolve_model_path

    model = args.model or DEFAULT_MODEL
    gguf = str(resolve_model_path(model))
    if not gguf.endswith(".gguf"):
        raise SystemExit(f"{gguf} is not a .gguf file: llama-server needs one")
    machine = cc.machine_info()
    threads = args.threads or machine["cores"]
    prompt_tokens = prompt_token_count(gguf, shared_prefix(0, args.shared_prefix) * bool(args.shared_prefix)
                                       + numbered_prompt(0))
    ctx = args.streams * slot_context(prompt_tokens or 4 * len(PROMPT) // 3, args.max_tokens)

    servers = [Server("mlaserve", mlaserve_command(gguf, cc.free_port(), args.ours_args.split()), "")]
    for item in args.checkout:
        label, where = checkout(item)
        servers.append(Server(f"mlaserve-{label}", mlaserve_command(gguf, cc.free_port(), args.ours_args.split()), "",
                              cwd=where))
    skipped: dict[str, str] = {}
    binary = peers.llama_cpp_bin("llama-server")
    if args.ours_only:
        skipped["llama-server"] = "--ours-only"
    elif binary is None:
        skipped["llama-server"] = peers.absent_reason("llama-server")
        print("peer skipped:", skipped["llama-server"])
    else:
        servers.append(Server("llama-server", llama_server_command(binary, gguf, cc.free_port(), args.streams,
                                                                   threads, ctx, args.peer_args.split()), ""))
    for s in servers:
        s.url = f"http://127.0.0.1:{s.command[s.command.index('--port') + 1]}"

    problems: list[str] = []
    raw: dict[str, dict[str, list[Any]]] = {s.name: {"single": [], "concurrent": []} for s in servers}
    log_dir = Path(tempfile.mkdtemp(prefix="serve_cpu_"))
    counter = iter(range(100000))

    def bodies(n: int) -> list[dict[str, Any]]:
        # the same numbers for every server in a round: each server sees the same bodies
        shared = shared_prefix(next(counter), args.shared_prefix) if args.shared_prefix else ""
        out = []
        for _ in range(n):
            i = next(counter)
            out.append(request_body(shared + numbered_prompt(i), args.max_tokens, i if args.sampled else None))
        return out

    try:
        for s in servers:
            print(f"starting {s.name}: {' '.join(s.command)}", flush=True)
            start_server(s, log_dir, args.start_timeout)
        print("warm-up", flush=True)
        warm = bodies(args.streams)
        for s in servers:
            measure(s, "warm-up", warm[:1], args, [])
            measure(s, "warm-up", warm, args, [])
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            single, concurrent = bodies(1), bodies(args.streams)
            order = servers if r % 2 == 0 else servers[::-1]
            for s in order:
                raw[s.name]["single"].append(measure(s, "1 stream", single, args, problems, bodies, args.retries))
                raw[s.name]["concurrent"].append(measure(s, f"{args.streams} streams", concurrent, args, problems,
                                                         bodies, args.retries))
    finally:
        for s in servers:
            stop_server(s)

    machine["load_average_at_end"] = list(os.getloadavg())
    result = {
        "benchmark": "serve_cpu",
        "machine": machine,
        "versions": {**cc.versions(), "llama_cpp": peers.binary_version(binary) if binary else None},
        "model": model, "gguf": gguf,
        "workload": {"max_tokens": args.max_tokens, "ignore_eos": True, "streams": args.streams,
                     "sampling": {**SAMPLED, "seed": "the request's number"} if args.sampled else {"temperature": 0},
                     "prompt": ("Session NNNNN. <PROMPT x k> " if args.shared_prefix else "") + "Request NNNNN. "
                     + PROMPT, "shared_prefix_tokens": args.shared_prefix, "prompt_tokens": prompt_tokens,
                     "api": "/v1/completions, stream, stream_options.include_usage"},
        "rounds": args.rounds,
        "commands": {s.name: s.command for s in servers},
        "checkouts": {s.name: str(s.cwd) for s in servers if s.cwd},
        "llama_server_context": ctx if "llama-server" not in skipped else None,
        "threads": threads,
        "skipped": skipped,
        "retry_busy": args.retry_busy,
        "problems": problems,
        "raw": raw,
    }
    analyze(result)
    shared = f"_shared{args.shared_prefix}" if args.shared_prefix else ""
    out = args.out or cc.RESULTS / f"serve_cpu_{args.tag or cc.machine_tag(machine)}{shared}.json"
    cc.write_json(out, result)
    print_report(result)
    print(f"wrote {out}")
    if problems:
        print(f"{len(problems)} problems (see 'problems' in the JSON):", *problems[:10], sep="\n  ")
        return 1
    return 0


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Medians (over the undisturbed rounds), ratios and targets from `result["raw"]`, added in place.
    Also what `--reanalyze` recomputes from a saved result."""
    raw, threshold = result["raw"], result.get("retry_busy", 0.1)
    med: dict[str, Any] = {}
    used: dict[str, dict[str, int]] = {}
    for name, workloads in raw.items():
        med[name], used[name] = {}, {}
        for w, ms in workloads.items():
            kept, used[name][w] = cc.undisturbed(ms, threshold)
            med[name][w] = medians([m["summary"] for m in kept])
    result["medians"] = med
    result["rounds_used"] = used  # per server and workload: undisturbed rounds in the median (0: all were disturbed)
    result["ratios_ours_over_peer"] = compare(med["mlaserve"], med.get("llama-server"))
    result["targets"] = TARGETS
    every = [m for n in raw for ws in raw[n].values() for m in ws]
    result["measurements_started_busy"] = sum(1 for m in every if m.get("gate") and not m["gate"]["quiet"])
    result["measurements_disturbed_kept"] = sum(1 for m in every if (m.get("others_busy") or 0) > threshold)
    result["measurements_discarded"] = sum(len(m.get("discarded", [])) for m in every)
    result["note"] = ("medians over interleaved rounds (order alternates), disturbed rounds (others' CPU share above "
                      "retry_busy after the retries) left out when an undisturbed one exists; the machine is shared")
    return result


def print_report(result: dict[str, Any]) -> None:
    med = result["medians"]
    rows = [("1 stream tok/s", "single", "aggregate_tok_s"), ("1 stream TTFT s", "single", "ttft_p50_s"),
            (f"{result.get('workload', {}).get('streams', 'N')} streams agg tok/s", "concurrent", "aggregate_tok_s"),
            ("  per-stream tok/s", "concurrent", "per_stream_tok_s_median"),
            ("  TTFT p50 s", "concurrent", "ttft_p50_s"), ("  TTFT p99 s", "concurrent", "ttft_p99_s")]
    names = list(med)
    print(f"{'':24s}" + "".join(f"{n:>14s}" for n in names) + ("     ratio" if len(names) == 2 else ""))
    for label, w, k in rows:
        vals = [med[n][w].get(k) for n in names]
        line = f"{label:24s}" + "".join(f"{v:14.3f}" if v is not None else f"{'-':>14s}" for v in vals)
        if len(names) == 2 and None not in vals and vals[1]:
            line += f"  {vals[0] / vals[1]:8.2f}"
        print(line)
    for name, t in result["ratios_ours_over_peer"].items():
        if isinstance(t, dict):
            v = "-" if t["value"] is None else f"{t['value']:.2f}"
            verdict = "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"
            print(f"target {name}: {v} {t['op']} {t['target']}: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
