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

from mlaserve.argtypes import positive_int


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
    if args.engine.node_rank > 0:  # another machine of a multi-node --tp: its ranks only, no HTTP server
        import logging

        from engine.ranks import serve_node

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve_node(args.engine)
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
