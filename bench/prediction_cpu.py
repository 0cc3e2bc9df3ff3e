"""Served benchmark of OpenAI's Predicted Outputs on the CPU: the same `mlaserve serve` (no
`--speculative-config`) answering the same streamed `/v1/chat/completions` with and without a `prediction`,
and llama.cpp's `llama-server` (which takes no prediction) on the same GGUF, same requests.

Workloads (greedy, at most `--max-tokens`; each request starts with a unique request number, so no server's
prefix cache serves it from an earlier one), from the Python standard library's own text:
  quote   "Repeat the following text word for word" + the first paragraphs of the json module's docstring;
          the prediction is that text
  edit    "Rewrite this Python function, renaming `lines` to `rows`" + the source of textwrap.dedent; the
          prediction is the source as it is (the reply differs from it where the name changes)
each at 1 stream (output tokens/s = completion tokens / the request's wall time). The prediction changes no
token (every draft is verified): a non-streamed request of each workload with and without it is checked to
give the same text, and its usage's accepted and rejected prediction tokens are recorded.

Rounds are interleaved (the order alternates) after a warm-up; medians over `--rounds`, with every raw sample;
each measurement waits for a quiet machine as bench/serve_cpu.py does.

    .venv/bin/python bench/prediction_cpu.py [--rounds 3] [--max-tokens 256] [--ours-only]
        [--out bench/results/prediction_cpu_<machine-tag>.json]
"""

from __future__ import annotations

import argparse
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
from speculative_cpu import measure  # noqa: E402


def workloads() -> dict[str, tuple[str, str]]:
    """Name -> (the request's text, the prediction)."""
    quote = "\n\n".join(json_module.__doc__.strip().split("\n\n")[:2])
    source = inspect.getsource(textwrap.dedent)
    return {
        "quote": ("Repeat the following text word for word:\n\n" + quote, quote),
        "edit": ("Rewrite this Python function, renaming the variable `lines` to `rows` and changing nothing else:"
                 "\n\n```python\n" + source + "```", "```python\n" + source + "```"),
    }


def body(text: str, number: int, max_tokens: int, prediction: str | None, stream: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": [{"role": "user", "content": f"Request {number:05d}. {text}"}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    if prediction is not None:
        out["prediction"] = {"type": "content", "content": prediction}
    return out


def same_text(server: sc.Server, text: str, prediction: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One request without and one with the prediction, not streamed: whether their replies are the same,
    and the prediction's usage."""
    import httpx

    plain = httpx.post(server.url + "/v1/chat/completions", json=body(text, 99999, max_tokens, None, False),
                       timeout=timeout).json()
    predicted = httpx.post(server.url + "/v1/chat/completions", json=body(text, 99999, max_tokens, prediction, False),
                           timeout=timeout).json()
    details = predicted["usage"].get("completion_tokens_details") or {}
    return {"same_text": plain["choices"][0]["message"]["content"] == predicted["choices"][0]["message"]["content"],
            "completion_tokens": predicted["usage"]["completion_tokens"],
            "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
            "rejected_prediction_tokens": details.get("rejected_prediction_tokens")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ours-only", action="store_true")
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
    servers = [sc.Server("mlaserve", sc.mlaserve_command(gguf, cc.free_port(), []), "")]
    binary = peers.llama_cpp_bin("llama-server")
    skipped = {}
    if args.ours_only or binary is None:
        skipped["llama-server"] = "--ours-only" if args.ours_only else peers.absent_reason("llama-server")
    else:
        longest = max(sc.prompt_token_count(gguf, t) or 2048 for t, _ in texts.values())
        servers.append(sc.Server("llama-server", sc.llama_server_command(
            binary, gguf, cc.free_port(), 1, machine["cores"], sc.slot_context(longest + 64, args.max_tokens), []), ""))
    for s in servers:
        s.url = f"http://127.0.0.1:{s.command[s.command.index('--port') + 1]}"
    ours = servers[0]
    runs = [(ours, "predicted"), (ours, "plain")] + [(s, "plain") for s in servers[1:]]
    raw: dict[str, dict[str, list[Any]]] = {f"{s.name}-{kind}": {w: [] for w in texts} for s, kind in runs}
    numbers = iter(range(100000))
    log_dir = Path(tempfile.mkdtemp(prefix="prediction_cpu_"))
    checks: dict[str, Any] = {}
    try:
        for s in servers:
            print(f"starting {s.name}: {' '.join(s.command)}", flush=True)
            sc.start_server(s, log_dir, args.start_timeout)
        for s, kind in runs:  # warm-up
            measure(s, [body(texts["quote"][0], next(numbers), 32, texts["quote"][1] if kind == "predicted" else None)],
                    args)
        for w, (text, prediction) in texts.items():
            checks[w] = same_text(ours, text, prediction, args.max_tokens, args.request_timeout)
            print(f"  {w}: {checks[w]}", flush=True)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for w, (text, prediction) in texts.items():
                number = next(numbers)
                for s, kind in runs if (r + len(w)) % 2 == 0 else runs[::-1]:
                    row = measure(s, [body(text, number, args.max_tokens, prediction if kind == "predicted" else None)],
                                  args)
                    raw[f"{s.name}-{kind}"][w].append(row)
                    print(f"  {s.name}-{kind:9s} {w}: {row['aggregate_tok_s']:.1f} tok/s, "
                          f"{row['completion_tokens']} tokens {row.get('counters', {})}", flush=True)
    finally:
        for s in servers:
            sc.stop_server(s)
    result = {"benchmark": "prediction_cpu", "machine": machine,
              "versions": {**cc.versions(), "llama_cpp": peers.binary_version(binary) if binary else None},
              "model": model, "gguf": gguf, "max_tokens": args.max_tokens, "sampling": "greedy",
              "workloads": {w: {"text": t[:200], "prediction": p[:200]} for w, (t, p) in texts.items()},
              "rounds": args.rounds, "commands": {s.name: s.command for s in servers}, "skipped": skipped,
              "checks": checks, "raw": raw}
    result["summary"] = summary(raw, checks)
    out = args.out or cc.RESULTS / f"prediction_cpu_{args.tag or cc.machine_tag(machine)}.json"
    cc.write_json(out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0


def summary(raw: dict[str, dict[str, list[dict[str, Any]]]], checks: dict[str, Any]) -> dict[str, Any]:
    """Per workload: median tokens/s of each run, with against without the prediction, against llama-server."""
    out: dict[str, Any] = {}
    for w in raw["mlaserve-plain"]:
        med = {name: cc.median([row["aggregate_tok_s"] for row in rows[w] if row.get("aggregate_tok_s")])
               for name, rows in raw.items()}
        rows = raw["mlaserve-predicted"][w]
        drafted = sum(row["counters"].get("draft_tokens", 0) for row in rows)
        out[w] = {"tok_s": med,
                  "predicted_vs_plain": cc.ratio(med["mlaserve-predicted"], med["mlaserve-plain"]),
                  "predicted_vs_llama_server": cc.ratio(med["mlaserve-predicted"], med.get("llama-server-plain")),
                  "acceptance": cc.ratio(sum(row["counters"].get("accepted_tokens", 0) for row in rows), drafted),
                  "completion_tokens": {name: [row["completion_tokens"] for row in rs[w]] for name, rs in raw.items()},
                  **checks.get(w, {})}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
