"""DeepSeek MoE layer: router + routed experts (through an expert backend, `models.experts`) +
shared experts.

The routed experts' `submit(...)` may return before the work is done (the `cpp` backend computes on
CPU threads) and `sync()` returns the result. The layer submits routed work first, runs the shared
experts meanwhile, then syncs — so CPU and GPU overlap when the routed experts live on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import MoEConfig
from models.experts import create_expert_backend
from models.layers import GatedMLP
from models.moe_routing import select_experts
from models.parallel import ExpertRange, current, tp_split


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
        # under tensor parallelism each rank holds a part of every routed expert (its intermediate
        # size split) or, with expert parallelism, whole experts `expert_range` (models.parallel)
        self.layout = lay = current()
        self.expert_range = ExpertRange.for_rank(cfg.num_experts)
        inter = cfg.intermediate_size if lay.ep else tp_split(cfg.intermediate_size, "the experts' intermediate size")
        self.experts = create_expert_backend(
            expert_backend, self.expert_range.stop - self.expert_range.start, hidden_size, inter, top_k=cfg.top_k
        )
        self.shared_experts = (
            GatedMLP(hidden_size, cfg.intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        if self.layout.ep:
            topk_ids, topk_weights = self.expert_range.localize(topk_ids, topk_weights)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts.partial(x) if self.layout.parallel else self.shared_experts(x)
        routed = self.experts.sync()
        out = routed if shared is None else routed + shared
        if shared is None and self.layout.parallel:
            out = out.clone()  # the backend may own `routed`: reduce a copy
        # one all-reduce for the block: every rank's routed and shared terms
        return self.layout.all_reduce(out) if self.layout.parallel else out
