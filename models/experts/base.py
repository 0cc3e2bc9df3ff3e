"""The routed-expert backend interface: load weights one (expert, kind) at a time, then `submit` a
layer's routed work and `sync` for its result, so the layer can run its shared experts meanwhile."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar

import torch
from torch import nn

from kernels.graph_support import CapturedHostWork, GraphMode, GraphSupport, HostStep
from models.loader.raw_blocks import RawBlocks


class WeightInput(Enum):
    """What a backend's `load_expert` takes from a GGUF file (the loader decodes accordingly)."""

    DECODED = "decoded"  # float tensors: the loader dequantizes quantized blocks first
    GGUF_BLOCKS = "gguf-blocks"  # `RawBlocks` as stored in the file: the backend decides what to decode


class ExpertBackend(nn.Module, ABC):
    """Computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for every token t."""

    weight_input: ClassVar[WeightInput] = WeightInput.DECODED
    graph_support: GraphSupport = GraphSupport.none("it synchronizes with the host")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    @abstractmethod
    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        """Loads one expert's `kind` ('gate_proj' | 'up_proj' | 'down_proj') weight in HF layout
        (gate/up [I, H], down [H, I]); `RawBlocks` only where `weight_input` is GGUF_BLOCKS."""

    @abstractmethod
    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] fp32. May return before done."""

    @abstractmethod
    def sync(self) -> torch.Tensor:
        """Waits for the submitted work; returns [T, H] in the hidden dtype."""

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden, topk_ids, topk_weights)
        return self.sync()

    def prepare_cuda_graph(self, max_tokens: int, mode: GraphMode,
                           host_step: HostStep | None = None) -> CapturedHostWork | None:
        """Called by a graph runner before it captures decode graphs of up to `max_tokens` tokens in
        `mode` (one `graph_support` allows; `host_step` under SPLIT). Makes what the captures must find
        ready and returns what those graphs will hold of its host work, or None when it has none."""
        return None
