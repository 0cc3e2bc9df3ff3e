"""Routed experts as stacked tensors on the model's device: w13 [E, 2I, H] (gate rows, then up rows)
and w2 [E, H, I], in the model's dtype. GGUF blocks arrive decoded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.graph_support import GraphSupport
from models.experts.base import ExpertBackend
from models.loader.raw_blocks import RawBlocks


class TorchExperts(ExpertBackend):
    """Reference routed experts: tokens grouped by expert, one GEMM pair each. The grouping reads
    the per-expert counts on the host, so a graph cannot capture it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self._result: torch.Tensor | None = None

    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        if isinstance(weight, RawBlocks):
            weight = weight.dequantize()
        i = self.intermediate_size
        target = {
            "gate_proj": self.w13.data[expert_id, :i],
            "up_proj": self.w13.data[expert_id, i:],
            "down_proj": self.w2.data[expert_id],
        }[kind]
        target.copy_(weight)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // k
        weight_of = topk_weights.reshape(-1)[order]
        out = torch.zeros(t, self.hidden_size, dtype=torch.float32, device=hidden.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gate, up = F.linear(hidden[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, tok, y.float() * weight_of[start : start + n, None])
            start += n
        self._result = out.to(hidden.dtype)

    def sync(self) -> torch.Tensor:
        assert self._result is not None, "sync() without submit()"
        out, self._result = self._result, None
        return out


class TritonExperts(TorchExperts):
    """Routed experts through the fused-MoE Triton kernels: tokens sorted into per-expert blocks and
    one grouped GEMM each for gate+up and down, reading only the weights of experts that got tokens.
    No host sync, so a graph captures it as it is.

    Weights and loading as `TorchExperts`. Needs CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1 (tests). Triton is imported when the backend is built.
    """

    graph_support = GraphSupport.device_only()

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        try:
            from kernels.fused_moe import fused_experts
        except ImportError as e:
            raise ImportError(
                f"--expert-backend triton needs the triton package, which does not import ({e}); install it "
                "(it comes with CUDA builds of PyTorch) or use --expert-backend torch"
            ) from e
        self._fused_experts = fused_experts

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._result = self._fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)
