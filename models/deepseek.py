"""DeepSeek-V2 / V2-Lite / V3: MLA attention (models/mla.py) + dense-first layers + MoE layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.rotary import RotaryEmbedding
from models.base import CausalLM
from models.config import DeepseekConfig
from models.layers import GatedMLP, RMSNorm
from models.mla import MLAAttention
from models.moe import DeepseekMoE

if TYPE_CHECKING:
    from scheduler.forward_batch import ForwardBatch


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, rotary: RotaryEmbedding, expert_backend: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_id):
            assert cfg.moe is not None
            self.mlp: nn.Module = DeepseekMoE(cfg.moe, cfg.hidden_size, expert_backend)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekConfig, expert_backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, self.rotary_emb, expert_backend) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        return self.norm(x)


class DeepseekForCausalLM(CausalLM):
    def __init__(self, cfg: DeepseekConfig, expert_backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = DeepseekModel(cfg, expert_backend)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
