"""The grammar compiler process: compiles structured-output specs with xgrammar, away from the engine.

    engine process (GrammarBackend)                     this process (`python -m executor.grammar_compiler IN OUT`)
      hello {threads, workers} + TokenizerInfo JSON ->  builds one xgrammar GrammarCompiler
      job {id, kind, spec}                          ->  compiles on one of `workers` threads
                                                    <-  start {id}                 (the compile began: its clock runs)
                                                    <-  done {id} + CompiledGrammar JSON  | error {id, message}

Why a process: xgrammar cannot be interrupted, and some specs cost far more than their size (a JSON
Schema `pattern` `^[a-z]{1,13000}$` took 9 s to compile on the 2-core development machine, with
{1,26000} 99 s; the time grows with the cube of the bound). In the engine such a compile held a worker
thread and a core for as long as it ran, whoever had asked for it. Here the engine kills this process
when a compile outlives its time limit, fails that request, and sends the other compiles under way to a
fresh one. A spec that blows up memory while compiling kills this process only (the grammar it compiles
to is then loaded into the engine, which keeps the grammars it has compiled, up to 256 MiB).

Each message is one `multiprocessing.connection` frame: a JSON header line, then the payload bytes. The
process ignores SIGINT (a Ctrl-C to the server's process group is the engine's to handle), and exits when
the engine's end of its input pipe closes (the engine ended or stopped it), when the engine's thread that
started it ends (Linux), or on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any


class SpecError(ValueError):
    """xgrammar refused the spec: the message says why, without xgrammar's C++ location."""


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    """The compiled grammar of one spec; SpecError when xgrammar refuses it.

    JSON is compiled without free whitespace (`any_whitespace=False`: one space after `:` and `,`), so a
    small model cannot spend its tokens on an endless run of newlines inside a document; and as it is
    (`strict_mode=False`): xgrammar's strict mode closes *every* object to extra keys, which makes
    `patternProperties` or `minProperties` without `properties` impossible to satisfy. Which objects to
    close is the server's choice (`server.structured`). A structural tag's JSON Schema contents are compiled
    the same way (`_schemas_as_grammars`)."""
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=False)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(_schemas_as_grammars(json.loads(spec))))
        if kind == "json_object":
            return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "grammar":
            return compiler.compile_grammar(spec, root_rule_name="root")
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its C++ location first
        raise SpecError(reason(e)) from None
    raise SpecError(f"unknown structured output kind {kind!r}")


def _schemas_as_grammars(node: Any) -> Any:
    """A structural tag with each `json_schema` format replaced by the grammar xgrammar compiles that schema to
    with the settings of `compile_spec` (its structural tags' own JSON would allow free whitespace, and close
    every object to other keys)."""
    import xgrammar as xgr

    if isinstance(node, list):
        return [_schemas_as_grammars(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        schema = node["json_schema"]
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _schemas_as_grammars(value) for key, value in node.items()}


def reason(e: Exception) -> str:
    """xgrammar's message without the `[time] /path/file.cc:123: ` prefix of its C++ errors."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0] and ": " in text:
            text = text.split(": ", 1)[1]
    return text


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + payload


def decode(frame: bytes) -> tuple[dict[str, Any], bytes]:
    head, _, payload = frame.partition(b"\n")
    return json.loads(head), payload


def _die_with_parent() -> None:
    """Linux: SIGKILL when the engine's thread that started this process ends (its EOF would not reach a
    stopped process)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(fd_in: int, fd_out: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGQUIT):  # the engine ignores them, and passed that on
        signal.signal(sig, signal.SIG_DFL)
    _die_with_parent()
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    import xgrammar as xgr  # (seconds: the engine builds the tokenizer info meanwhile)

    hello, info_json = decode(inbox.recv_bytes())

    info = xgr.TokenizerInfo.deserialize_json(info_json.decode())
    # no cache here: the engine keeps the compiled grammars (this process may be killed at any time)
    compiler = xgr.GrammarCompiler(info, max_threads=int(hello["threads"]), cache_enabled=False)
    send_lock = threading.Lock()

    def send(header: dict[str, Any], payload: bytes = b"") -> None:
        with send_lock:
            outbox.send_bytes(encode(header, payload))

    def run(job: dict[str, Any]) -> None:
        send({"start": job["id"]})
        try:
            payload = compile_spec(compiler, job["kind"], job["spec"]).serialize_json().encode()
        except SpecError as e:
            send({"error": job["id"], "message": str(e)})
            return
        except Exception as e:  # not the spec's fault: the engine reports it as its own failure
            send({"error": job["id"], "message": f"{type(e).__name__}: {e}", "internal": True})
            return
        send({"done": job["id"]}, payload)

    pool = ThreadPoolExecutor(max_workers=int(hello["workers"]), thread_name_prefix="compile")
    while True:
        try:
            job, _ = decode(inbox.recv_bytes())
        except (EOFError, OSError):  # the engine closed the pipe (it ended, or stops this process)
            os._exit(0)
        pool.submit(run, job)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
