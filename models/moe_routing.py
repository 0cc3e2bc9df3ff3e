"""DeepSeek MoE routers: router logits -> (top-k weights, top-k expert ids).

* V2 (softmax scores): ``greedy`` takes the top-k scores; ``group_limited_greedy`` first keeps the
  `topk_group` groups with the highest *max* score, then takes the top-k inside them.
* V3 (sigmoid scores, ``noaux_tc``): experts are *chosen* on score + `e_score_correction_bias`,
  groups ranked by the sum of their top-2 biased scores, but the *weights* are the unbiased scores.

Then: optional renormalisation over the chosen k (`norm_topk_prob`), and multiplication by
`routed_scaling_factor`. Everything in fp32, as the reference implementations do.

These torch ops are the reference; `select_experts(..., fused=True)` runs the same selection as one Triton
kernel (`kernels.fused_moe.route_experts`, the triton attention backend's choice on a GPU).
"""

from __future__ import annotations

import torch

from models.config import MoEConfig


def _group_mask(choice: torch.Tensor, cfg: MoEConfig, top2_sum: bool) -> torch.Tensor:
    """Boolean [T, E] mask of experts inside the `topk_group` best groups."""
    t, e = choice.shape
    grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
    if top2_sum:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand(t, cfg.n_group, e // cfg.n_group).reshape(t, e)


def choice_scores(
    router_logits: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (scores, choice), both [T, E] fp32: the experts' weights before the top-k,
    and what the top-k ranks them by (V3: biased, experts outside the kept groups -inf; V2 grouped:
    outside the kept groups 0). How close the k-th and (k+1)-th choice are is how near a routing tie is."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    if cfg.topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if cfg.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, cfg, top2_sum=True), float("-inf"))
    elif cfg.topk_method == "group_limited_greedy" and cfg.n_group > 1:
        choice = scores.masked_fill(~_group_mask(scores, cfg, top2_sum=False), 0.0)
    else:
        choice = scores
    return scores, choice


def routing_margins(
    router_logits: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (chosen expert ids [T, K] sorted, margin [T]): how far the k-th choice is
    above the best expert left out, on the choice score. A small margin is a routing decision that
    rounding noise in the hidden state can flip."""
    k = cfg.top_k
    top = choice_scores(router_logits, cfg, correction_bias)[1].topk(k + 1, dim=-1)
    return top.indices[:, :k].sort(-1).values, top.values[:, k - 1] - top.values[:, k]


def select_experts(
    router_logits: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (topk_weights [T, K] fp32, topk_ids [T, K] int64); `fused`: one Triton
    kernel instead of the torch ops."""
    if fused:
        from kernels.fused_moe import route_experts

        return route_experts(router_logits, cfg.top_k, scoring=cfg.scoring_func, method=cfg.topk_method,
                             n_group=cfg.n_group, topk_group=cfg.topk_group,
                             correction_bias=correction_bias if cfg.topk_method == "noaux_tc" else None,
                             normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    scores, choice = choice_scores(router_logits, cfg, correction_bias)
    topk_weights, topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)
    if cfg.topk_method == "noaux_tc":
        topk_weights = scores.gather(1, topk_ids)

    if cfg.norm_topk_prob:  # also for k = 1 (the weight becomes 1), as HF transformers and llama.cpp do
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * cfg.routed_scaling_factor, topk_ids
