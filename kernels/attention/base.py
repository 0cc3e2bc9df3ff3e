"""The attention backend interface (docs/architecture.md §4).

Lifecycle per model forward:
  1. the runner builds a `ForwardBatch` and calls `init_forward_metadata(batch)` once;
  2. every attention layer calls one of the `forward_*` methods below, which read the KV of cached
     prefixes from the pool (through `batch.req_to_token_pool`) and write the new tokens' KV to
     `batch.out_cache_loc`.

Two families of layers use it:
  * MHA / GQA (Llama): `forward(q, k, v, layer, batch)` stores k, v and attends over prefix + new.
  * MLA (DeepSeek): the layer stores only the latent with `set_mla_kv`, then either
    `forward_mla_normal` (fresh prefill: per-head K/V expanded from the latent, causal, no prefix) or
    `forward_mla_absorb` (decode and extend over a cached prefix: MQA of the absorbed 512-wide query
    and the 64-wide rope query against the shared latent cache, returning the latent output).

Shapes: T = packed tokens of the batch, H = query heads, Hkv = KV heads, D = q·k width, Dv = value
width, r = kv_lora_rank, P = qk_rope_head_dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import Protocol

import torch

from kernels.attention.omnikv import OmniKVBatch
from kernels.graph_support import GraphSupport


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill or extend: any number of new tokens per request, maybe with a cached prefix
    DECODE = auto()  # exactly one new token per request
    MIXED = auto()  # extend requests and decode requests in one batch (decode ones have extend_seq_len 1)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class ReqToTokenTable(Protocol):
    """The request-slot -> KV-slot table a backend reads (`executor.memory_pool.ReqToTokenPool`)."""

    req_to_token: torch.Tensor  # int32 [rows, max_context_len]


class KVCache(Protocol):
    """What a backend reads and writes of the token-to-KV pool (`executor.memory_pool`'s MHA and MLA pools).

    MHA/GQA pools answer `set_kv` and `get_kv_buffer` -> (K, V); the MLA latent pool answers
    `set_mla_kv` and `get_kv_buffer` -> its [slots, r + P] buffer. `host_layers`: the layers held in host
    memory (OmniKV's context bank; kernels/attention/context_bank.py), empty without one."""

    page_size: int
    host_layers: frozenset[int]

    def get_kv_buffer(self, layer_id: int): ...
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def set_mla_kv(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None: ...


class ForwardBatch(Protocol):
    """What attention backends (and the models above them) read of one forward's batch.

    The executor's `executor.forward_batch.ForwardBatch` dataclass is the one implementation; kernels
    and models type against this protocol so that they never import the layers above them."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenTable
    token_to_kv_pool: KVCache
    attn_backend: AttentionBackend
    logits_indices: torch.Tensor | None
    # OmniKV: which decode rows attend to a selection of their context at which layers; backends call
    # `observe` after a FILTER layer's attention and read `slots` / `decode_view` at SPARSE layers.
    # None: every row attends to its whole context at every layer
    omnikv: OmniKVBatch | None

    @property
    def extend_start_loc_cpu(self) -> list[int]: ...
    @property
    def has_prefix(self) -> bool: ...
    def last_token_indices(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer, as the backend needs it."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q·k width per head (MLA normal path: nope + rope)
    v_head_dim: int
    scaling: float  # softmax scale
    kv_lora_rank: int = 0  # MLA only: r
    qk_rope_head_dim: int = 0  # MLA only: P


class AttentionBackend(ABC):
    #: How decode through this backend can enter a CUDA graph: a capturable backend keeps its
    #: per-forward metadata in buffers made by `init_cuda_graph_state`, rewritten in place before
    #: every replay (the hooks at the end of this class).
    graph_support: GraphSupport = GraphSupport.none("it builds its per-forward metadata in fresh tensors")
    #: Whether a decode batch with OmniKV rows whose inputs are in `OmniKVBatch.graph`'s buffers (every
    #: row through the selection) runs without reading the host, so that it can be captured too.
    omnikv_graphs: bool = False
    #: Whether MLA's fresh prefill expands per-head K/V (`forward_mla_normal`) on a CPU too: there every
    #: forward absorbs unless a backend needs the per-head keys (models/mla.py says why).
    mla_normal_on_cpu: bool = False
    #: Whether the model's layers run their small ops as this backend's fused kernels rather than as torch
    #: ops, the reference: RMSNorms (with the residual add), RoPE and the gated MLPs' SiLU * up
    #: (kernels/triton_layer_ops.py: one kernel each instead of 8, ~18 and 2 torch ops), and the MoE
    #: routers' selection (kernels.fused_moe.route_experts: one instead of 3 to ~16).
    fused_layer_ops: bool = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Computes per-forward metadata once; every layer of this forward reuses it."""

    def host_memory_problem(self, device: torch.device) -> str | None:
        """Why this backend cannot read and write host-memory KV layers (OmniKV's context bank) from
        `device`, or None. The base reads them through the host, which works everywhere."""
        return None

    # ---- MHA / GQA ----
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, H, Dv]; stores k, v in the pool first."""
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    # ---- MLA ----
    @abstractmethod
    def set_mla_kv(
        self, layer: AttentionLayer, batch: ForwardBatch, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Writes c_kv [T, r] and RoPE'd k_pe [T, P] of the new tokens to the latent pool."""

    @abstractmethod
    def forward_mla_normal(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """Fresh prefill (no request has a prefix): q, k [T, H, D], v [T, H, Dv] -> [T, H, Dv], causal per request."""

    @abstractmethod
    def forward_mla_absorb(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q_latent [T, H, r], q_pe [T, H, P] against the latent cache (prefix + new) -> [T, H, r].

        Scores are q_latent·c_kv + q_pe·k_pe; the output is the attention-weighted c_kv.
        """

    # ---- CUDA graphs (decode only) ----
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        """Allocates, once, every metadata buffer a captured decode reads (sized for `max_bs`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """`init_forward_metadata` for a padded decode batch about to be captured; its tensors are the
        graph runner's static buffers, and the metadata must be views of the preallocated buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Rewrites the preallocated metadata in place for the next replay of the graph captured for
        `batch.batch_size` (the runner has already copied the new inputs into its static buffers).
        Must not allocate tensors the graph reads, nor synchronize with the device."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
