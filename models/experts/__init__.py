"""Routed-expert backends of a MoE layer (`models.moe.SparseMoE`), chosen once at start-up by
`--expert-backend` (`EXPERT_BACKENDS`):

- `torch` (`stacked.TorchExperts`): the reference, on the model's device, in the model's dtype;
- `cpp` (`cpp.CppExperts`): the `cpp_experts` C++ operator on CPU threads (the extension is imported
  only when this backend is built), weights packed in its own memory, threads and staging in a
  `CpuExpertPool` that the executor binds;
- `triton` (`stacked.TritonExperts`): the fused-MoE Triton kernels on CUDA, same weights as `torch`.

Each says how a decode graph can take it (`graph_support`, a `kernels.graph_support.GraphSupport`)
and what its `load_expert` takes from a GGUF file (`weight_input`).
"""

from __future__ import annotations

from models.experts.base import ExpertBackend, WeightInput
from models.experts.cpp import CppExperts
from models.experts.cpu_pool import CpuExpertPool
from models.experts.stacked import TorchExperts, TritonExperts

EXPERT_BACKENDS = ("torch", "cpp", "triton")


def create_expert_backend(
    name: str, num_experts: int, hidden_size: int, intermediate_size: int, *, top_k: int
) -> ExpertBackend:
    if name == "torch":
        return TorchExperts(num_experts, hidden_size, intermediate_size)
    if name == "cpp":
        return CppExperts(num_experts, hidden_size, intermediate_size, top_k=top_k)
    if name == "triton":
        return TritonExperts(num_experts, hidden_size, intermediate_size)
    raise ValueError(f"unknown expert backend {name!r} (available: {', '.join(EXPERT_BACKENDS)})")


__all__ = ["EXPERT_BACKENDS", "CppExperts", "CpuExpertPool", "ExpertBackend", "TorchExperts", "TritonExperts",
           "WeightInput", "create_expert_backend"]
