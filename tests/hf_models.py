"""Tiny random HF transformers checkpoints (the oracle), written with `save_pretrained`.

Weights are re-drawn with std 1/sqrt(fan_in) and norm weights near (not at) 1, so activations stay
O(1) through the layers and a mistake anywhere (a missed norm weight, a wrong rope layout, a wrong
softmax scale) moves the logits visibly; HF's default init (std 0.02) would make them near-uniform.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, max_position_embeddings=512, rms_norm_eps=1e-6)

DEEPSEEK_MLA = dict(
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=24, intermediate_size=96, moe_intermediate_size=40, n_shared_experts=1,
)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # V2-Lite style: no q-LoRA, group-limited greedy routing, YaRN, one dense layer first
    "v2_lite_yarn_grouped": ("deepseek_v2", dict(
        DEEPSEEK_MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    )),
    # V2 with q-LoRA, plain greedy routing, no rope scaling, all layers MoE
    "v2_qlora_greedy": ("deepseek_v2", dict(
        DEEPSEEK_MLA, q_lora_rank=24, n_routed_experts=6, num_experts_per_tok=2, topk_method="greedy",
        first_k_dense_replace=0, n_shared_experts=2,
    )),
    # V3: sigmoid + correction bias, group-limited noaux_tc, YaRN, dense-first, renormalised, scaled
    "v3_noaux_yarn": ("deepseek_v3", dict(
        DEEPSEEK_MLA, q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    )),
    # V3 without q-LoRA, half-split rope (rope_interleave false), tied embeddings, no groups
    "v3_tied_halfsplit": ("deepseek_v3", dict(
        DEEPSEEK_MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=0, rope_interleave=False,
        tie_word_embeddings=True,
    )),
    # Llama: GQA 4/2, tied embeddings
    "llama_gqa_tied": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
    )),
    # Llama: MHA, Llama-3 rope scaling, untied, head_dim != hidden/heads
    "llama_rope3_untied": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=112, tie_word_embeddings=False,
        rope_theta=50000.0, max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128},
    )),
    # Llama: GQA 4/1, heads of 100 (OpenLLaMA-3B's): not a multiple of the kernels' 16-column blocks
    "llama_hd100_gqa4": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=100, intermediate_size=96, tie_word_embeddings=False,
    )),
    # Qwen2 (Qwen2.5's): biases on q, k, v (not o), tied, theta 1e6, a window that use_sliding_window leaves off
    "qwen2_tied": ("qwen2", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=64, max_window_layers=2,
    )),
    # Qwen3: q_norm / k_norm on every head, head_dim apart from hidden / heads, untied
    "qwen3_gqa": ("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96, tie_word_embeddings=False,
        attention_bias=False, rope_theta=1000000.0,
    )),
    # Qwen3-MoE (Qwen3-30B-A3B's layout, small): Qwen3's attention, 8 experts top-3 renormalised, no shared
    # experts, layer 1 dense (`mlp_only_layers`), head_dim hidden / heads (Qwen3MoeConfig has no default)
    "qwen3_moe": ("qwen3_moe", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=40, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        rope_theta=1000000.0,
    )),
    # Qwen2-MoE (Qwen1.5-MoE's layout): Qwen2's attention biases, 6 experts top-2 unnormalised and one shared
    # expert of its own width whose output a sigmoid gate scales; every second layer MoE (decoder_sparse_step)
    "qwen2_moe": ("qwen2_moe", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=40, num_experts=6,
        num_experts_per_tok=2, shared_expert_intermediate_size=72, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[2], tie_word_embeddings=False, rope_theta=1000000.0,
    )),
    # Mixtral: every layer's MLP 6 experts of intermediate_size, top-2 renormalised; files name them
    # block_sparse_moe.experts.N.w1/w3/w2
    "mixtral": ("mixtral", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, num_local_experts=6,
        num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
    )),
    # GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's MLA (v_head_dim apart from qk_nope) and routing, GLM's
    # defaults: one dense layer first (mlp_layer_types), no groups, weights renormalised and scaled
    "glm4_moe_lite": ("glm4_moe_lite", dict(
        DEEPSEEK_MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.8, tie_word_embeddings=False, rope_theta=1000000.0,
    )),
    # GLM-4.5 (glm4_moe): GQA 4/2 with half of each head rotated, q/k/v biases (o none), q/k norms, V3's routing
    # over 8 experts in 2 groups with a shared expert, one dense layer first
    "glm4_moe": ("glm4_moe", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=40,
        n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=1000000.0, tie_word_embeddings=False,
    )),
}


def build_hf_model(name: str, seed: int = 0, **overrides: Any):
    """The named tiny model; `overrides` replace config fields (e.g. num_hidden_layers)."""
    import transformers

    model_type, extra = CONFIGS[name]
    kwargs = {**COMMON, **extra, **overrides}
    cls_cfg, cls_model = {
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "glm4_moe_lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    config = cls_cfg(**kwargs)
    model = cls_model(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in pname or p.numel() == 0:  # (n_shared_experts 0: empty weights)
                continue
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                std = 1.0 if "embed" in pname else 1 / math.sqrt(p.shape[-1])
                p.copy_(std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def save_hf_model(name: str, out_dir: Path, seed: int = 0):
    model = build_hf_model(name, seed)
    model.save_pretrained(out_dir)
    return model


def save_hf_models(tmp_path_factory: Any, names: list[str], seed: int, **overrides: Any) -> dict[str, tuple[Any, Path]]:
    """A module fixture's checkpoints: name -> (the HF model, its saved folder), seeds seed, seed + 1, ..."""
    out = {}
    for i, name in enumerate(names):
        d = tmp_path_factory.mktemp(name)
        model = build_hf_model(name, seed=seed + i, **overrides)
        model.save_pretrained(d)
        out[name] = (model, d)
    return out


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full re-forward each step (no cache involved on the oracle side)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]
