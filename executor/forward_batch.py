"""`ForwardBatch`: everything one model forward needs, built by the runner, read by every layer.

Tokens of all requests are packed along one axis (T = sum of extend_seq_lens). Request i owns
tokens [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i]), at positions
extend_prefix_lens[i] .. seq_lens[i]-1; its KV for positions < extend_prefix_lens[i] is already in
the pool at req_to_token[req_pool_indices[i], :prefix].

DECODE is the special case extend_seq_lens == 1 everywhere; the attention backend picks its decode
kernel from `forward_mode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.memory_pool import KVPool, ReqToTokenPool
from kernels.attention.base import AttentionBackend, ForwardMode
from kernels.attention.omnikv import OmniKVBatch

__all__ = ["ForwardBatch", "ForwardMode"]


@dataclass
class ForwardBatch:
    """Implements `kernels.attention.base.ForwardBatch`, the protocol the kernels and models read."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its request
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64, total length after this forward (prefix + new)
    seq_lens_cpu: list[int]  # [B] host copy of seq_lens, so shapes never need a device sync
    extend_prefix_lens_cpu: list[int]  # [B] tokens already cached per request (0 for a fresh prefill)
    extend_seq_lens_cpu: list[int]  # [B] new tokens per request (1 in decode)
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token's KV is written to
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    attn_backend: AttentionBackend
    logits_indices: torch.Tensor | None = None  # [N] rows of the packed tokens needing logits; None = last per request
    omnikv: OmniKVBatch | None = None  # decode rows attending to a selection of their context (OmniKV)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        out, acc = [], 0
        for n in self.extend_seq_lens_cpu:
            out.append(acc)
            acc += n
        return out

    @property
    def has_prefix(self) -> bool:
        """Whether any request attends to KV cached before this forward."""
        return any(p > 0 for p in self.extend_prefix_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each request's last token in the packed axis."""
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)
