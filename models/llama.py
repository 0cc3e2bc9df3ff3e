"""Llama-family decoder (GQA attention through the attention backend, half-split RoPE): dense MLPs, or
routed experts (Qwen2-MoE, Qwen3-MoE, Mixtral) through the same MoE layer as DeepSeek's (`models.moe`)."""

from __future__ import annotations


import torch
from torch import nn

from kernels.attention.base import AttentionLayer, ForwardBatch
from models.rotary import RotaryEmbedding
from models.base import CausalLM, DecoderLayer, DecoderModel
from models.config import LlamaConfig
from models.layers import GatedMLP, RMSNorm
from models.moe import SparseMoE
from models.parallel import column_linear, kv_heads_held, replicated_under_dp_attention, row_linear, tp_split

class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # this rank's query heads and KV heads (all of them on one rank: models.parallel)
        d = self.head_dim = cfg.head_dim
        self.num_heads = tp_split(cfg.num_attention_heads, "the number of attention heads")
        kv_first, self.num_kv_heads = kv_heads_held(cfg.num_key_value_heads)
        kv_rows = (kv_first * d, (kv_first + self.num_kv_heads) * d)
        bias, total_kv = cfg.attention_bias, cfg.num_key_value_heads * d
        self.q_proj = column_linear(cfg.hidden_size, cfg.num_attention_heads * d, bias)
        self.k_proj = column_linear(cfg.hidden_size, total_kv, bias, ranges=kv_rows)
        self.v_proj = column_linear(cfg.hidden_size, total_kv, bias, ranges=kv_rows)
        self.o_proj = row_linear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.out_bias)
        # Qwen3: each query and key head RMS-normalised (one [head_dim] weight for all heads) before RoPE
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = rotary
        self.layer = AttentionLayer(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim, cfg.softmax_scale
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k, batch.attn_backend.fused_layer_ops)
        out = batch.attn_backend.forward(q, k, v, self.layer, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


def llama_layer(cfg: LlamaConfig, layer_id: int, rotary: RotaryEmbedding, expert_backend: str) -> DecoderLayer:
    if cfg.is_moe_layer(layer_id):
        assert cfg.moe is not None
        mlp: nn.Module = SparseMoE(cfg.moe, cfg.hidden_size, expert_backend)
    else:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
    with replicated_under_dp_attention():
        attn = LlamaAttention(cfg, layer_id, rotary)
    return DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, attn, mlp)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: LlamaConfig, expert_backend: str = "torch") -> None:
        super().__init__(cfg, DecoderModel(cfg, lambda i, rotary: llama_layer(cfg, i, rotary, expert_backend)))
