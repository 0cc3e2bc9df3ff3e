"""Llama-family dense decoder (GQA attention through the attention backend, half-split RoPE)."""

from __future__ import annotations


import torch
from torch import nn

from kernels.attention.base import AttentionLayer, ForwardBatch
from models.rotary import RotaryEmbedding
from models.base import CausalLM, DecoderLayer, DecoderModel
from models.config import LlamaConfig
from models.layers import GatedMLP



class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rotary_emb = rotary
        self.layer = AttentionLayer(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim, cfg.softmax_scale
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = batch.attn_backend.forward(q, k, v, self.layer, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


def llama_layer(cfg: LlamaConfig, layer_id: int, rotary: RotaryEmbedding) -> DecoderLayer:
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
    return DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, LlamaAttention(cfg, layer_id, rotary), mlp)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: LlamaConfig, expert_backend: str = "torch") -> None:
        super().__init__(cfg, DecoderModel(cfg, lambda i, rotary: llama_layer(cfg, i, rotary)))
