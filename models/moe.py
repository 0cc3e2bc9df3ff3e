"""DeepSeek MoE layer: router + routed experts (through an expert backend) + shared experts.

The routed experts sit behind `ExpertBackend`, whose `submit(...)` may return before the work is
done (the `cpp` backend computes on CPU threads) and `sync()` returns the result. The layer submits
routed work first, runs the shared experts meanwhile, then syncs — so CPU and GPU overlap when the
routed experts live on the CPU.

Expert weights are stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_routing import select_experts
from models.config import MoEConfig
from models.layers import GatedMLP

EXPERT_BACKENDS = ("torch",)


class ExpertBackend(nn.Module, ABC):
    """Computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for every token t."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    @abstractmethod
    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor) -> None:
        """Loads one expert's `kind` ('gate_proj' | 'up_proj' | 'down_proj') weight in HF layout."""

    @abstractmethod
    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] fp32. May return before done."""

    @abstractmethod
    def sync(self) -> torch.Tensor:
        """Waits for the submitted work; returns [T, H] in the hidden dtype."""

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden, topk_ids, topk_weights)
        return self.sync()


class TorchExperts(ExpertBackend):
    """Reference routed experts on the model's device: tokens grouped by expert, one GEMM pair each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self._result: torch.Tensor | None = None

    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor) -> None:
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


def create_expert_backend(name: str, num_experts: int, hidden_size: int, intermediate_size: int) -> ExpertBackend:
    if name == "torch":
        return TorchExperts(num_experts, hidden_size, intermediate_size)
    raise ValueError(f"unknown expert backend {name!r} (available: {', '.join(EXPERT_BACKENDS)})")


class Router(nn.Module):
    """Router weights (HF `mlp.gate`): logits in fp32, then DeepSeek's top-k selection.

    Its parameters stay fp32 whatever the model dtype (`keep_fp32`): the V3 correction bias separates
    experts by small margins that bf16 would erase.
    """

    keep_fp32 = True

    def __init__(self, cfg: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size), requires_grad=False)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden_size: int, expert_backend: str = "torch") -> None:
        super().__init__()
        self.gate = Router(cfg, hidden_size)
        self.experts = create_expert_backend(expert_backend, cfg.num_experts, hidden_size, cfg.intermediate_size)
        self.shared_experts = (
            GatedMLP(hidden_size, cfg.intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        routed = self.experts.sync()
        return routed if shared is None else routed + shared
