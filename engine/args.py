"""`EngineArgs`: every setting of the engine, settled once at start-up and passed down.

Each field that a user sets carries its command-line flag in its metadata (`flag(...)`: help, choices,
how a string becomes the value, what range is valid). `server.args` builds `mlaserve serve`'s flags and
`MLASERVE_*` variables from these fields, and `mlaserve generate` its engine flags: a default, a choice
list or a range lives here once. Torch-free and plain data: it is sent to the engine process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class FlagSpec:
    """How a settings field appears on the command line (`--<name>`) and in the environment."""

    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # None: from the field's type (str, int, float, bool)
    check: Callable[[Any], str | None] | None = None  # the problem with a parsed value, or None
    name: str | None = None  # default: the field name, "_" -> "-"


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None,
         check: Callable[[Any], str | None] | None = None, name: str | None = None) -> Any:
    """A dataclass field with a default that is also a command-line flag."""
    return dataclasses.field(default=default, metadata={"flag": FlagSpec(help, choices, parse, check, name)})


def positive(value: int | float | None) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def non_negative(value: int | float | None) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def fraction(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


def device_name(value: str) -> str | None:
    kind, _, index = value.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return None
    return "must be cpu, cuda or cuda:N"


@dataclass(frozen=True)
class EngineArgs:
    model: str = flag("smollm2-135m-instruct", "built-in model name, HF directory or .gguf file")
    device: str = flag("cpu", "cpu or cuda[:N]", check=device_name)
    dtype: str = flag("auto", "weights and activations dtype", choices=DTYPES)
    kv_dtype: str = flag("auto", "KV cache dtype (auto: the model's)", choices=DTYPES)
    attention_backend: str = flag("torch", "attention implementation (triton: split-KV MLA decode and extend "
                                  "kernels for CUDA, with CUDA-graph decode)", choices=("torch", "triton"))
    expert_backend: str = flag("torch", "routed-expert implementation for MoE models (cpp: the C++ CPU pool; GGUF "
                               "Q8_0/Q4_0 experts stay quantized; triton: fused-MoE kernel on the GPU); ignored by "
                               "dense models", choices=("torch", "cpp", "triton"))
    context_length: int | None = flag(None, "maximum prompt + completion tokens (default: the model's)",
                                      check=positive)
    max_running_requests: int = flag(64, "requests decoded together at most", check=positive)
    max_queued_requests: int = flag(1024, "waiting requests beyond which new ones get 503 overloaded (0: refuse "
                                    "whatever cannot run at once)", check=non_negative)
    max_total_tokens: int | None = flag(None, "KV cache size in tokens (default: --mem-fraction of free memory)",
                                        check=positive)
    mem_fraction: float = flag(0.3, "share of free memory (host RAM on CPU) for the KV cache when "
                               "--max-total-tokens is unset", check=fraction)
    chunked_prefill_size: int = flag(2048, "most prompt tokens prefilled per request per step", check=positive)
    # the token budget of one step's prefill work: at least one chunk (server.args derives it)
    max_prefill_tokens: int = 8192
    page_size: int = flag(1, "KV slots per page (64 for paged attention kernels; the prefix cache needs 1)",
                          check=positive)
    cuda_graph_max_bs: int = flag(64, "largest decode batch run through a captured CUDA graph (CUDA, triton "
                                  "attention and, for MoE models, triton or cpp experts); larger ones run eagerly",
                                  check=non_negative)
    disable_cuda_graph: bool = flag(False, "run every decode eagerly (no CUDA graphs)")
    hybrid_graph_mode: str = flag("host-nodes", "how --expert-backend cpp on a GPU enters decode graphs: host-nodes "
                                  "(the CPU work as host nodes of one graph) or split (graph pieces with the CPU "
                                  "work run between them)", choices=("host-nodes", "split"))
    disable_prefix_cache: bool = flag(False, "turn the radix prefix cache off")
    seed: int = flag(0, "base seed of the requests that bring none")
