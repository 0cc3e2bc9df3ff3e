"""Served benchmark of n-gram speculative decoding on the CPU: `mlaserve serve --speculative-config` against
the same server without it and against llama.cpp's `llama-server` (no speculation: its n-gram lookup is not
in the server we build), same GGUF, same requests, through streaming `/v1/chat/completions`.

Workloads (chat, greedy or with `--sampled` the model's own sampling defaults and a seed per request, the
model ends the reply itself, at most `--max-tokens`; each request starts with
a unique request number, so no server's prefix cache serves it from an earlier one). The texts are the
Python standard library's own, shipped with the interpreter:
  edit    "Rewrite this function, adding comments" + the source of textwrap.dedent: a reply that copies
  quote   "Repeat this text word for word" + the first paragraphs of the json module's docstring
  story   the lighthouse story of bench/serve_cpu.py: a reply that copies nothing (speculation's cost)
  extract the first docstring line of eight standard modules, listed back as JSON under a JSON schema
          (`response_format`): a structured output that copies (drafts cut by the grammar where it refuses)
each at 1 stream (output tokens/s = completion tokens / the request's wall time), and `edit` at
`--streams` concurrent streams (aggregate tokens/s). Both of our servers give the same tokens (greedy,
speculation changes no token: tests/engine/test_speculative.py); their completion tokens are checked equal.
The drafts' acceptance comes from the speculating server's /metrics, per workload.

`--checkout LABEL=DIR` adds a speculating server run from another checkout of this repository (its code
with this Python and packages; build its extension first), in the same rounds: a change to the drafts'
policy against the code before it, each against the same server without speculation.

Rounds are interleaved (the server order alternates) after a warm-up, medians over `--rounds` are reported
with every raw sample; each measurement waits for a quiet machine as bench/serve_cpu.py does.

    .venv/bin/python bench/speculative_cpu.py [--rounds 3] [--max-tokens 256] [--streams 16]
        [--spec '{"method": "ngram"}'] [--checkout before=/tmp/old-checkout] [--out bench/results/speculative_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import json as json_module
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import serve_cpu as sc  # (puts the repository and bench/ on the path)
import cpu_common as cc  # noqa: E402
import peers  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram"}'


MODULES = ("json", "textwrap", "string", "heapq", "bisect", "fnmatch", "shlex", "glob")
# the extract workload's reply: {"modules": [{"name": ..., "description": ...}, ...]}
EXTRACT_FORMAT = {"type": "json_schema", "json_schema": {"name": "modules", "strict": True, "schema": {
    "type": "object", "required": ["modules"], "additionalProperties": False, "properties": {"modules": {
        "type": "array", "items": {"type": "object", "required": ["name", "description"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string"}, "description": {"type": "string"}}}}}}}}
FORMATS = {"extract": EXTRACT_FORMAT}


def workloads() -> dict[str, str]:
    import importlib

    quote = "\n\n".join(json_module.__doc__.strip().split("\n\n")[:2])
    lines = "\n".join(f"{m}: {importlib.import_module(m).__doc__.strip().splitlines()[0]}" for m in MODULES)
    return {
        "edit": "Rewrite this Python function, keeping its code the same and adding a short comment above each "
                "line:\n\n```python\n" + inspect.getsource(textwrap.dedent) + "```",
        "quote": "Repeat the following text word for word:\n\n" + quote,
        "story": sc.PROMPT,
        "extract": "List every module below with its description copied word for word, as JSON.\n\n" + lines,
    }


class ChatState(sc.StreamState):
    """StreamState for chat chunks: the first token is the first delta with content."""

    def feed(self, event: dict[str, Any] | str | None, now: float) -> None:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                if self.t_first is None and (choice.get("delta") or {}).get("content"):
                    self.t_first = now
        super().feed(event, now)


def body(text: str, number: int, max_tokens: int, sampled: bool = False,
         response_format: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy, or (`sampled`) the model's own sampling defaults with a seed (the same for every server)."""
    out = {"messages": [{"role": "user", "content": f"Request {number:05d}. {text}"}], "max_tokens": max_tokens,
           "stream": True, "stream_options": {"include_usage": True}}
    if response_format is not None:
        out["response_format"] = response_format
    out.update({"seed": number} if sampled else {"temperature": 0})
    return out


def spec_counters(server: sc.Server) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            if line.startswith(f"mlaserve_spec_decode_{name}_total{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
        if line.startswith("mlaserve_engine_forward_steps_total{"):
            out["forward_steps"] = float(line.rsplit(" ", 1)[1])
    return out


def measure(server: sc.Server, bodies: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    quiet = cc.wait_for_quiet(args.quiet_threshold, args.quiet_wait)
    before = spec_counters(server) if server.name != "llama-server" else {}
    samples = asyncio.run(sc.run_streams(server.url, bodies, args.request_timeout, "/v1/chat/completions", ChatState))
    after = spec_counters(server) if server.name != "llama-server" else {}
    row = {**sc.summarize(samples), "quiet": quiet, "samples": samples,
           "counters": {k: after[k] - before.get(k, 0) for k in after}}
    errors = [s["error"] for s in samples if s.get("error")]
    if errors:
        row["errors"] = errors
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config of the speculating server")
    ap.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                    help="also a speculating server run from another checkout (its code, this Python), named "
                         "mlaserve-spec-LABEL: a change against the code before it, in the same rounds")
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--sampled", action="store_true", help="the model's own sampling defaults (SmolLM2: temperature "
                    "0.2, top_p 0.9), a seed per request, instead of greedy")
    ap.add_argument("--quiet-threshold", type=float, default=0.25)
    ap.add_argument("--quiet-wait", type=float, default=20.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from models.builtin import DEFAULT_MODEL, resolve_model_path

    model = args.model or DEFAULT_MODEL
    gguf = str(resolve_model_path(model))
    machine = cc.machine_info()
    texts = workloads()
    servers = [sc.Server("mlaserve-spec", sc.mlaserve_command(gguf, cc.free_port(), ["--speculative-config", args.spec]), ""),
               sc.Server("mlaserve", sc.mlaserve_command(gguf, cc.free_port(), []), "")]
    for item in args.checkout:
        label, where = sc.checkout(item)
        servers.append(sc.Server(f"mlaserve-spec-{label}", sc.mlaserve_command(
            gguf, cc.free_port(), ["--speculative-config", args.spec]), "", cwd=where))
    binary = peers.llama_cpp_bin("llama-server")
    skipped = {}
    if args.ours_only or binary is None:
        skipped["llama-server"] = "--ours-only" if args.ours_only else peers.absent_reason("llama-server")
    else:
        longest = max(sc.prompt_token_count(gguf, t) or 2048 for t in texts.values())
        ctx = args.streams * sc.slot_context(longest + 64, args.max_tokens)
        servers.append(sc.Server("llama-server", sc.llama_server_command(binary, gguf, cc.free_port(), args.streams,
                                                                         machine["cores"], ctx, []), ""))
    for s in servers:
        s.url = f"http://127.0.0.1:{s.command[s.command.index('--port') + 1]}"
    cases = [(w, 1) for w in texts] + [("edit", args.streams)]
    raw: dict[str, dict[str, list[Any]]] = {s.name: {f"{w}@{n}": [] for w, n in cases} for s in servers}
    numbers = iter(range(100000))
    log_dir = Path(tempfile.mkdtemp(prefix="speculative_cpu_"))
    try:
        for s in servers:
            print(f"starting {s.name}: {' '.join(s.command)}", flush=True)
            sc.start_server(s, log_dir, args.start_timeout)
        for s in servers:  # warm-up (and each response format's grammar compiled: the engine caches it)
            for w in ["edit", *FORMATS]:
                measure(s, [body(texts[w], next(numbers), 32, response_format=FORMATS.get(w))], args)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for w, n in cases:
                bodies = [body(texts[w], next(numbers), args.max_tokens, args.sampled, FORMATS.get(w))
                          for _ in range(n)]
                for s in servers if (r + len(w)) % 2 == 0 else servers[::-1]:
                    row = measure(s, bodies, args)
                    raw[s.name][f"{w}@{n}"].append(row)
                    print(f"  {s.name:14s} {w}@{n}: {row['aggregate_tok_s']:.1f} tok/s, "
                          f"{row['completion_tokens']} tokens {row.get('counters', {})}", flush=True)
    finally:
        for s in servers:
            sc.stop_server(s)
    result = {"benchmark": "speculative_cpu", "machine": machine,
              "versions": {**cc.versions(), "llama_cpp": peers.binary_version(binary) if binary else None},
              "model": model, "gguf": gguf, "spec": json.loads(args.spec), "max_tokens": args.max_tokens,
              "sampling": "the model's defaults, seeded" if args.sampled else "greedy",
              "workloads": {w: t[:200] for w, t in texts.items()}, "formats": FORMATS, "rounds": args.rounds,
              "commands": {s.name: s.command for s in servers},
              "checkouts": {s.name: str(s.cwd) for s in servers if s.cwd}, "skipped": skipped, "raw": raw}
    result["summary"] = summary(raw)
    sampled = "_sampled" if args.sampled else ""
    out = args.out or cc.RESULTS / f"speculative_cpu_{args.tag or cc.machine_tag(machine)}{sampled}.json"
    cc.write_json(out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0


def summary(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per case: median tokens/s of each server, the ratios, and the drafts' acceptance."""
    out: dict[str, Any] = {}
    for case in raw["mlaserve"]:
        med = {name: cc.median([row["aggregate_tok_s"] for row in rows[case] if row.get("aggregate_tok_s")])
               for name, rows in raw.items()}
        tokens = {name: [row["completion_tokens"] for row in rows[case]] for name, rows in raw.items()}
        out[case] = {
            "tok_s": med,
            "spec_vs_plain": cc.ratio(med["mlaserve-spec"], med["mlaserve"]),
            "spec_vs_llama_server": cc.ratio(med["mlaserve-spec"], med.get("llama-server")),
            "plain_vs_llama_server": cc.ratio(med["mlaserve"], med.get("llama-server")),
            **drafts(raw["mlaserve-spec"][case]),
            "completion_tokens": tokens,
            "same_tokens": tokens["mlaserve-spec"] == tokens["mlaserve"],
        }
        for name in raw:  # the --checkout servers
            if name.startswith("mlaserve-spec-"):
                out[case][name] = {"spec_vs_plain": cc.ratio(med[name], med["mlaserve"]),
                                   "this_vs_it": cc.ratio(med["mlaserve-spec"], med[name]), **drafts(raw[name][case]),
                                   "same_tokens": tokens[name] == tokens["mlaserve"]}
    return out


def drafts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A speculating server's drafts over its rows: the share of draft tokens kept, draft tokens a draft, and
    drafts a completion token."""
    counts = {k: sum(row["counters"].get(k, 0) for row in rows) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"acceptance": cc.ratio(counts["accepted_tokens"], counts["draft_tokens"]),
            "draft_tokens_per_step": cc.ratio(counts["draft_tokens"], counts["drafts"]),
            "drafts_per_token": cc.ratio(counts["drafts"], sum(row["completion_tokens"] for row in rows))}


if __name__ == "__main__":
    raise SystemExit(main())
