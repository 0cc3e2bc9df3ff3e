"""The `mlaserve` command line.

Usage: mlaserve COMMAND [flags] (mlaserve COMMAND --help for its flags; mlaserve --version)

Commands:
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
    from server.args import SERVE_FLAGS, BadSetting, Parsed, combination_problem, flags_of, parse_settings, refuse
    from server.args import worker_threads_problem

    def own(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prompt", required=True, help="the text to continue ('-': read it from stdin)")
        p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
        p.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                       help="tokens to generate at most (default: 64)")

    # the engine's flags (and MLASERVE_* variables) are serve's: one definition in EngineArgs
    prog = "mlaserve generate"
    parsed = parse_settings(prog, "Greedy generation from one prompt, with the model loaded and run as `serve` runs "
                            "it.", flags_of(EngineArgs, ["model", "device", "dtype", "cpu_kernels", "cpu_weight_dtype",
                                                         "expert_backend", "kv_dtype"]), argv, extra=own)
    args = parsed.ns
    # serve's checks between settings, the ones generate does not take at their defaults
    whole = Parsed(argparse.Namespace(**{f.field: f.default for f in SERVE_FLAGS} | vars(args)), parsed.source,
                   {f.field: f for f in SERVE_FLAGS})
    problem = worker_threads_problem(os.environ) or combination_problem(whole, os.environ)
    if problem:
        refuse(prog, problem)
    text = _prompt_text(prog, args.prompt)  # before the model loads: a bad prompt costs no load

    from engine.client import set_cpu_wait_policy

    set_cpu_wait_policy(os.environ)  # before torch is imported below
    import torch

    from executor.cpu_forward import kv_dtype_setting
    from executor.model_runner import ModelRunner
    from mlaserve.model_check import load_model_checked
    from models.loader.tokenizer import TokenizerFailure
    from server.chat_template import ChatTemplateError, render_chat

    # as the engine loads it (engine.core): on a CPU with the native kernels, the weights packed for them, so
    # that the text is serve's at temperature 0 and as fast (it was the torch reference's, ~30x slower)
    native = args.device == "cpu" and args.cpu_kernels == "native"
    try:  # a missing path, a directory that is no HF model, a corrupt checkpoint: one line, as serve says it
        loaded = load_model_checked(args.model, device=args.device, dtype=args.dtype, expert_backend=args.expert_backend,
                                    cpu_weights=args.cpu_weight_dtype if native else None,
                                    progress=sys.stderr.isatty())
    except BadSetting as e:
        refuse(prog, str(e))
    tok = loaded.tokenizer
    assert tok is not None
    if args.chat:
        try:
            text = render_chat(tok.chat_template, [{"role": "user", "content": text}],
                               **tok.template_tokens())
        except ChatTemplateError as e:
            refuse(prog, f"--chat: {e}")
    try:
        ids = tok.encode(text, add_special_tokens=not args.chat)
    except TokenizerFailure as e:
        refuse(prog, str(e))
    beyond = sorted({i for i in ids if i >= loaded.config.vocab_size})
    if beyond:  # as serve refuses such a prompt (an added token the embeddings have no row for)
        named = ", ".join(f"{tok.tokenizer.id_to_token(i)!r} ({i})" for i in beyond[:5])
        refuse(prog, f"the prompt holds tokens {named} past the model's vocab_size {loaded.config.vocab_size}: "
               "the model has no embedding for them; leave them out of the prompt")
    if not ids:  # as serve answers an empty prompt of a model without a BOS token: nothing to continue from
        refuse(prog, "--prompt encodes to no tokens: give some text to continue (or --chat)")
    context = loaded.config.max_position_embeddings
    if len(ids) + args.max_tokens > context:  # as serve refuses such a request (the rotary table ends there)
        refuse(prog, f"the prompt ({len(ids)} tokens) and --max-tokens {args.max_tokens} exceed the model's context "
               f"of {context} tokens: " + (f"lower --max-tokens to at most {context - len(ids)}" if len(ids) < context
                                           else "shorten the prompt"))
    # the KV cache's dtype as the engine resolves --kv-dtype: auto is bf16 for GGUF blocks on the
    # native forward whatever the activations' dtype (on a CPU without bf16 math those are fp32, and a cache
    # of the model's dtype was another forward than serve's, whose near-ties went another way)
    kv_dtype = kv_dtype_setting(args.kv_dtype, loaded.model, loaded.dtype, torch.device(args.device))
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=len(ids) + args.max_tokens + 1,
                         max_running_requests=1, max_context_len=len(ids) + args.max_tokens + 1, device=args.device,
                         kv_dtype=kv_dtype, native_forward=native)
    start = time.perf_counter()
    out = runner.generate_greedy(ids, args.max_tokens, stop_ids=tok.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(tok.decode(out))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {elapsed:.2f}s]", file=sys.stderr)
    return 0


def _prompt_text(prog: str, prompt: str) -> str:
    """--prompt's text ('-': standard input's), which must be UTF-8 (a stray byte reaches Python as a lone
    surrogate, which no tokenizer takes); one line and exit 2 otherwise."""
    from server.args import refuse

    if prompt != "-":
        raw = prompt.encode("utf-8", "surrogateescape")
        where = "--prompt"
    elif sys.stdin is None:
        refuse(prog, "--prompt -: there is no standard input to read (it is closed); pipe the text in or give it")
    else:
        stream = getattr(sys.stdin, "buffer", None)  # (a text stream without one: a test's stand-in)
        raw = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        where = "--prompt - (standard input)"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        refuse(prog, f"{where} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}): convert it to UTF-8")


def _make_checkpoint(argv: list[str]) -> int:
    from models.synthetic import main as make_checkpoint
    from server.args import OneLineParser

    return make_checkpoint(argv, parser_class=OneLineParser)


def _calibrate_omnikv(argv: list[str]) -> int:
    from mlaserve.calibrate_omnikv import main as calibrate

    return calibrate(argv)


def _serve(argv: list[str]) -> int:
    from server.args import model_problem, parallel_problem, parse_serve_args, refuse

    args = parse_serve_args(argv)  # --help and flag errors exit here, before heavy imports
    if args.engine.node_rank > 0:  # another machine of a multi-node --tp: its ranks only, no HTTP server
        problem = model_problem(args.engine.model) or parallel_problem(  # as server.launch.serve checks on node 0
            args.engine.model, args.engine.tp, heads_split=True, ep=args.engine.ep > 1)
        if problem:
            refuse("mlaserve serve", problem)
        from engine.args import use_log_level
        from engine.ranks import serve_node

        use_log_level(args.log_level)
        return serve_node(args.engine)
    from server.launch import serve

    return serve(args)


COMMANDS = {"serve": _serve, "generate": _generate, "make-checkpoint": _make_checkpoint,
            "calibrate-omnikv": _calibrate_omnikv}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (serve's: once its imports are done)
        command = argv[0] if argv and argv[0] in COMMANDS else ""
        print(f"mlaserve{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 0 if command == "serve" else 130  # serve: as a signal while the model loads (README)
    except BrokenPipeError:  # `mlaserve serve --help | head`: the reader left; no traceback about it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not raise again
        return 1


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):  # asked for: the usage on stdout
        print(__doc__.strip())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from server.app import mlaserve_version

        print(f"mlaserve {mlaserve_version()}")
        return 0
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        import difflib

        if argv[0].startswith("-"):  # a flag where the command goes: `mlaserve --port 8000`
            what = f"{argv[0]!r} is not a command: the command comes first (e.g. mlaserve serve {argv[0]} ...)"
        else:
            close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
            what = f"unknown command {argv[0]!r}" + (f" (did you mean '{close[0]}'?)" if close else "")
        print(f"mlaserve: error: {what}; the commands: {', '.join(COMMANDS)} (see mlaserve --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
