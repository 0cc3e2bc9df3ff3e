"""The MoE layer of DeepSeek-V2/V3, Qwen2-MoE, Qwen3-MoE and Mixtral: router + routed experts (through an
expert backend, `models.experts`) + shared experts (DeepSeek's; Qwen2-MoE's one, gated; none in the others).

The routed experts' `submit(...)` may return before the work is done (the `cpp` backend computes on
CPU threads) and `sync()` returns the result. The layer submits routed work first, runs the shared
experts meanwhile, then syncs — so CPU and GPU overlap when the routed experts live on the CPU.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from models.config import MoEConfig
from models.experts import create_expert_backend
from models.layers import GatedMLP
from models.moe_routing import select_experts
from models.parallel import ExpertRange, current, replicated_under_dp_attention, tp_split


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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused`: the selection as one Triton kernel (`select_experts`)."""
        return select_experts(self.logits(x), self.cfg, self.e_score_correction_bias, fused)


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's `shared_expert_gate`: the shared expert's output is scaled by sigmoid(x·w), one weight [1, hidden]
    kept fp32 as the router's."""

    keep_fp32 = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x.float(), self.weight.float())).to(x.dtype)


class SparseMoE(nn.Module):
    """Router, routed experts and (where the config has them) shared experts, under every parallel layout."""

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
        # DP attention with expert parallelism: each rank's tokens go to their experts' ranks and come
        # back (all-to-all dispatch and combine) instead of every rank's tokens gathered for the block;
        # the shared experts are then every rank's, whole
        self.dispatch = lay.dp_attention and lay.ep
        with replicated_under_dp_attention() if self.dispatch else nullcontext():
            self.shared_experts = GatedMLP(hidden_size, cfg.shared_size) if cfg.shared_size else None
            self.shared_expert_gate = SharedExpertGate(hidden_size) if cfg.shared_gate else None

    @property
    def local_tokens(self) -> bool:
        """Runs on this rank's own tokens under DP attention (DecoderLayer does not gather for it)."""
        return self.dispatch

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: the router's selection and the shared experts' activation as Triton kernels (the triton
        attention backend asks for them)."""
        if self.dispatch:
            return self._forward_dispatch(x, fused)
        topk_weights, topk_ids = self.gate(x, fused)
        if self.layout.ep:
            topk_ids, topk_weights = self.expert_range.localize(topk_ids, topk_weights)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = None
        if self.shared_experts is not None:
            shared = self._shared(x, fused, partial=self.layout.parallel)
        routed = self.experts.sync()
        out = routed if shared is None else routed + shared
        if shared is None and self.layout.parallel:
            out = out.clone()  # the backend may own `routed`: reduce a copy
        # one all-reduce for the block: every rank's routed and shared terms
        return self.layout.all_reduce(out) if self.layout.parallel else out

    def _forward_dispatch(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """Routed experts over all-to-all: every (token, chosen expert) pair is sent to the rank holding
        that expert, computed there (weighted), sent back, and summed into its token; an idle rank
        takes part with no pairs."""
        import torch.distributed as dist

        lay, group = self.layout, self.layout.group
        weights, ids = self.gate(x, fused)
        per_rank = self.expert_range.stop - self.expert_range.start
        t, k = ids.shape
        owner = (ids // per_rank).reshape(-1)
        order = torch.sort(owner, stable=True).indices  # pairs grouped by destination rank
        token = torch.arange(t, device=x.device).repeat_interleave(k)[order]
        send_counts = torch.bincount(owner, minlength=lay.tp_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        def exchange(values: torch.Tensor, out_counts: list[int], in_counts: list[int]) -> torch.Tensor:
            out = values.new_empty((sum(out_counts), *values.shape[1:]))
            dist.all_to_all_single(out, values.contiguous(), output_split_sizes=out_counts,
                                   input_split_sizes=in_counts, group=group)
            return out

        rows = exchange(x[token], recv, send)
        local_ids = exchange((ids.reshape(-1)[order] % per_rank).contiguous(), recv, send)
        pair_w = exchange(weights.reshape(-1)[order].to(torch.float32), recv, send)
        if rows.shape[0]:
            done = self.experts.forward(rows, local_ids[:, None], pair_w[:, None].to(rows.dtype))
        else:
            done = rows
        back = exchange(done, send, recv)
        out = torch.zeros_like(x).index_add_(0, token, back.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self._shared(x, fused, partial=False)
        return out

    def _shared(self, x: torch.Tensor, fused: bool, partial: bool) -> torch.Tensor:
        """The shared experts' output (`partial`: this rank's part of its sum, under tensor parallelism), gated
        where the model gates it (each token's gate scales every rank's part alike)."""
        assert self.shared_experts is not None
        out = self.shared_experts.partial(x, fused) if partial else self.shared_experts(x, fused)
        return out if self.shared_expert_gate is None else out * self.shared_expert_gate(x)

