"""`mlaserve serve` settings: one table of flags, each also settable by an `MLASERVE_*` variable.

The table is the only list of environment variables the server reads (besides what libraries read
themselves): flag `--max-total-tokens` <-> `MLASERVE_MAX_TOTAL_TOKENS`. A flag given on the command
line wins over its variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable

from models.builtin import DEFAULT_MODEL
from engine.args import EngineArgs


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return "MLASERVE_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("model", str, DEFAULT_MODEL, "built-in model name, HF directory or .gguf file"),
    Flag("host", str, "127.0.0.1", "address to listen on"),
    Flag("port", int, 8000, "port to listen on"),
    Flag("api-key", str, None, "require `Authorization: Bearer KEY` on /v1 routes"),
    Flag("served-model-name", str, None, "model id shown by /v1/models (default: the model's name)"),
    Flag("context-length", int, None, "maximum prompt + completion tokens (default: the model's)"),
    Flag("max-running-requests", int, 64, "requests decoded together at most"),
    Flag("max-queued-requests", int, 1024, "waiting requests beyond which new ones get 503 overloaded"),
    Flag("max-total-tokens", int, None, "KV cache size in tokens (default: --mem-fraction of free memory)"),
    Flag("mem-fraction", float, 0.3, "share of free memory for the KV cache when --max-total-tokens is unset"),
    Flag("chunked-prefill-size", int, 2048, "most prompt tokens prefilled per request per step"),
    Flag("device", str, "cpu", "cpu or cuda[:N]"),
    Flag("dtype", str, "auto", "weights and activations dtype", ("auto", "float32", "bfloat16", "float16")),
    Flag("attention-backend", str, "torch", "attention implementation (triton: split-KV MLA decode and extend "
         "kernels for CUDA, with CUDA-graph decode)", ("torch", "triton")),
    Flag("expert-backend", str, "torch", "routed-expert implementation for MoE models (cpp: the C++ CPU pool; "
         "GGUF Q8_0/Q4_0 experts stay quantized; triton: fused-MoE kernel on the GPU); ignored by dense models",
         ("torch", "cpp", "triton")),
    Flag("cuda-graph-max-bs", int, 64, "largest decode batch run through a captured CUDA graph (CUDA, triton "
         "attention and, for MoE models, triton or cpp experts); larger ones run eagerly"),
    Flag("disable-cuda-graph", _bool, False, "run every decode eagerly (no CUDA graphs)"),
    Flag("hybrid-graph-mode", str, "host-nodes", "how --expert-backend cpp on a GPU enters decode graphs: "
         "host-nodes (the CPU work as host nodes of one graph) or split (graph pieces with the CPU work "
         "run between them)", ("host-nodes", "split")),
    Flag("page-size", int, 1, "KV slots per page (64 for paged attention kernels; the prefix cache needs 1)"),
    Flag("kv-dtype", str, "auto", "KV cache dtype (auto: the model's)", ("auto", "float32", "bfloat16", "float16")),
    Flag("disable-prefix-cache", _bool, False, "turn the radix prefix cache off"),
    Flag("max-request-bytes", int, None, "largest request body accepted, 413 beyond (default: 16 bytes per "
         "token of the context length, at least 1 MiB)"),
    Flag("shutdown-timeout", float, 30.0, "seconds running requests get to finish after SIGTERM/SIGINT before "
         "they are aborted"),
    Flag("log-level", str, "info", "logging level", ("debug", "info", "warning", "error")),
)


@dataclass(frozen=True)
class ServerArgs:
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    max_request_bytes: int | None  # None: derived from the context length once the model is known
    shutdown_timeout: float
    log_level: str
    engine: EngineArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlaserve serve",
        description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also be set by the "
        "environment variable shown in brackets; the flag wins.",
    )
    for f in FLAGS:
        env = os.environ.get(f.env)
        default = f.default
        if env is not None:
            try:
                default = f.type(env)
            except (ValueError, argparse.ArgumentTypeError) as e:
                p.error(f"{f.env}={env!r}: {e}")
        kw: dict[str, Any] = {"type": f.type, "default": default, "dest": f.dest,
                              "help": f"{f.help} [{f.env}] (default: {f.default})"}
        if f.choices:
            kw["choices"] = f.choices
        if f.type is _bool:
            kw["nargs"] = "?"
            kw["const"] = True
        p.add_argument(f"--{f.name}", **kw)
    return p


def parse_serve_args(argv: list[str]) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    for name in ("port", "max_running_requests", "chunked_prefill_size", "max_request_bytes", "page_size"):
        if getattr(ns, name) is not None and getattr(ns, name) <= 0:
            build_parser().error(f"--{name.replace('_', '-')} must be > 0")
    if ns.max_queued_requests < 0:
        build_parser().error("--max-queued-requests must be >= 0 (0: refuse whatever cannot run at once)")
    gpu_only = [f"--{flag}-backend triton" for flag, value in (("attention", ns.attention_backend),
                                                               ("expert", ns.expert_backend)) if value == "triton"]
    if gpu_only and not ns.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        build_parser().error(f"{' and '.join(gpu_only)} need{'' if len(gpu_only) > 1 else 's'} --device cuda (the Triton kernels run on NVIDIA GPUs); "
                             "on CPU use the torch backends (and --expert-backend cpp)")
    engine = EngineArgs(
        model=ns.model, device=ns.device, dtype=ns.dtype, attention_backend=ns.attention_backend,
        expert_backend=ns.expert_backend, context_length=ns.context_length,
        max_running_requests=ns.max_running_requests, max_queued_requests=ns.max_queued_requests,
        max_total_tokens=ns.max_total_tokens, mem_fraction=ns.mem_fraction,
        chunked_prefill_size=ns.chunked_prefill_size,
        max_prefill_tokens=max(ns.chunked_prefill_size, EngineArgs.max_prefill_tokens),
        enable_prefix_cache=not ns.disable_prefix_cache, page_size=ns.page_size,
        kv_dtype=None if ns.kv_dtype == "auto" else ns.kv_dtype,
        cuda_graph_max_bs=ns.cuda_graph_max_bs, disable_cuda_graph=ns.disable_cuda_graph,
        hybrid_graph_mode=ns.hybrid_graph_mode,
    )
    return ServerArgs(
        host=ns.host, port=ns.port, api_key=ns.api_key or None, served_model_name=ns.served_model_name,
        max_request_bytes=ns.max_request_bytes, shutdown_timeout=ns.shutdown_timeout, log_level=ns.log_level,
        engine=engine,
    )
