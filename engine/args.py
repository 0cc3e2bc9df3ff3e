"""`EngineArgs`: every setting of the engine core, settled once at start-up and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineArgs:
    model: str = "smollm2-135m-instruct"  # built-in name, HF directory or .gguf file
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_dtype: str | None = None  # None: the model dtype
    attention_backend: str = "torch"
    expert_backend: str = "torch"
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_running_requests: int = 64
    max_queued_requests: int = 1024  # beyond this, new requests are refused as overloaded
    max_total_tokens: int | None = None  # KV slots; None: from mem_fraction
    mem_fraction: float = 0.3  # of free device memory (host RAM on CPU) used for KV when max_total_tokens is None
    chunked_prefill_size: int = 2048  # most prompt tokens prefilled per request per step
    max_prefill_tokens: int = 8192  # token budget of one step's prefill work
    page_size: int = 1
    cuda_graph_max_bs: int = 64  # decode batches up to this size replay captured CUDA graphs
    disable_cuda_graph: bool = False
    hybrid_graph_mode: str = "host-nodes"  # how CPU experts enter decode graphs: host-nodes | split
    enable_prefix_cache: bool = True
    seed: int = 0  # base seed for requests that bring none
