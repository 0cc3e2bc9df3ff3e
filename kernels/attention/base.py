"""The attention backend interface (DESIGN.md §4).

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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from scheduler.forward_batch import ForwardBatch


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
    #: True when the decode path can be captured in a CUDA graph: its per-forward metadata then lives
    #: in buffers made by `init_cuda_graph_state` and is rewritten in place before every replay.
    supports_cuda_graph = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Computes per-forward metadata once; every layer of this forward reuses it."""

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
