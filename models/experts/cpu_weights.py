"""One MoE layer's routed-expert weights packed in a `cpp_experts.MoE` operator.

Each weight becomes its own `cpp_experts.QuantLinear` through `models.cpu_ops.make_operator`, the
same rule the dense layers follow (`mode`, the CPU weight mode): GGUF blocks of a type the kernels
compute on stay as stored — whatever mix the file has, e.g. Q4_K gate/up with Q6_K down in
llama.cpp's "_M" files —, float tensors keep their precision (fp32 and fp16 as fp32, bf16 as bf16), a
block type without a kernel would be decoded to bf16 with one warning; modes `bf16` and `float32`
decode everything.
An expert is handed to the operator when its three weights have arrived; `finalize` checks that
every expert did.
"""

from __future__ import annotations

from typing import Any

import torch

from models.cpu_ops import import_cpp_experts, make_operator
from models.loader.raw_blocks import RawBlocks

KINDS = ("gate_proj", "up_proj", "down_proj")


class CpuExpertWeights:
    """The packed weights of one layer's routed experts (no threads: a pool is bound to `op` later)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
                 mode: str = "file") -> None:
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = (
            num_experts, hidden_size, intermediate_size, top_k)
        self.mode = mode
        self._op: Any = None  # cpp_experts.MoE, made with the first weight
        self._pending: dict[int, dict[str, Any]] = {}  # expert -> its operators so far
        self._loaded: set[int] = set()

    @property
    def op(self) -> Any:
        """The `cpp_experts.MoE` operator holding the weights."""
        if self._op is None:
            raise RuntimeError("cpp experts used before their weights were loaded")
        return self._op

    @property
    def format(self) -> str | None:
        """The weight formats in use ("q4_k/q6_k"), None before loading."""
        return None if self._op is None else self._op.formats

    @property
    def memory_bytes(self) -> int:
        """Bytes of packed weights (0 before loading)."""
        return 0 if self._op is None else int(self._op.memory_bytes)

    def load(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        if self._op is None:
            self._op = import_cpp_experts().MoE(self.num_experts, self.top_k, self.hidden_size, self.intermediate_size)
        name = weight.name if isinstance(weight, RawBlocks) else f"expert {expert_id} {kind}"
        parts = self._pending.setdefault(expert_id, {})
        parts[kind] = make_operator(weight, self.mode, name)
        if len(parts) == len(KINDS):
            self._op.set_expert(expert_id, *(parts[k] for k in KINDS))
            del self._pending[expert_id]
            self._loaded.add(expert_id)

    def finalize(self) -> None:
        missing = sorted(set(range(self.num_experts)) - self._loaded)
        if missing:
            raise RuntimeError(f"cpp experts: expert(s) {missing[:5]} did not get all of gate, up and down")
        self.op.finalize()
