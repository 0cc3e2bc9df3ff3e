"""The `mlaserve` command line.

Subcommands:
  serve            serve a model over the OpenAI-compatible HTTP API (`mlaserve serve --help`)
  generate         load a model and greedily continue one prompt (a quick check that a model works)
  make-checkpoint  write a random synthetic checkpoint (tests, benchmarks) — see models/synthetic.py
  calibrate-omnikv choose OmniKV's filter layers for a model over a text, write its OmniKV config
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable


def positive_int(text: str) -> int:
    """argparse type of a count that must be > 0 (a bad one exits 2 naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type of a number in [low, high] (or (low, high] with `low_open`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be in {'(' if low_open else '['}{low:g}, {high:g}]")
        return value

    return parse


def _generate(argv: list[str]) -> int:
    from engine.args import EngineArgs
    from server.args import flags_of, parse_flags

    def own(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prompt", required=True, help="the text to continue")
        p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
        p.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                       help="tokens to generate at most (default: 64)")

    # the engine's flags (and MLASERVE_* variables) are serve's: one definition in EngineArgs
    args = parse_flags("mlaserve generate", "Greedy generation from one prompt.",
                       flags_of(EngineArgs, ["model", "device", "dtype"]), argv, extra=own)

    from engine.client import set_cpu_wait_policy

    set_cpu_wait_policy(os.environ)  # before torch is imported below
    from models.loader.load import load_model
    from executor.model_runner import ModelRunner
    from server.chat_template import render_chat

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    tok = loaded.tokenizer
    assert tok is not None
    text = args.prompt
    if args.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": text}],
                           bos_token=tok.bos_token, eos_token=tok.eos_token)
    ids = tok.encode(text, add_special_tokens=not args.chat)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=len(ids) + args.max_tokens + 1,
                         max_running_requests=1, max_context_len=len(ids) + args.max_tokens + 1, device=args.device)
    start = time.perf_counter()
    out = runner.generate_greedy(ids, args.max_tokens, stop_ids=tok.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(tok.decode(out))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {elapsed:.2f}s]", file=sys.stderr)
    return 0


def _make_checkpoint(argv: list[str]) -> int:
    from models.synthetic import main as make_checkpoint

    return make_checkpoint(argv)


def _calibrate_omnikv(argv: list[str]) -> int:
    from mlaserve.calibrate_omnikv import main as calibrate

    return calibrate(argv)


def _serve(argv: list[str]) -> int:
    from server.args import parse_serve_args

    args = parse_serve_args(argv)  # --help and flag errors exit here, before heavy imports
    from server.launch import serve

    return serve(args)


COMMANDS = {"serve": _serve, "generate": _generate, "make-checkpoint": _make_checkpoint,
            "calibrate-omnikv": _calibrate_omnikv}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
