"""DeepSeek-V2 / V2-Lite / V3: MLA attention (models/mla.py) + dense-first layers + MoE layers."""

from __future__ import annotations

from torch import nn

from models.rotary import RotaryEmbedding
from models.base import CausalLM, DecoderLayer, DecoderModel
from models.config import DeepseekConfig
from models.layers import GatedMLP
from models.mla import MLAAttention
from models.moe import SparseMoE
from models.parallel import replicated_under_dp_attention


def deepseek_layer(cfg: DeepseekConfig, layer_id: int, rotary: RotaryEmbedding, expert_backend: str) -> DecoderLayer:
    if cfg.is_moe_layer(layer_id):
        assert cfg.moe is not None
        mlp: nn.Module = SparseMoE(cfg.moe, cfg.hidden_size, expert_backend)
    else:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
    with replicated_under_dp_attention():
        attn = MLAAttention(cfg, layer_id, rotary)
    return DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, attn, mlp)


class DeepseekForCausalLM(CausalLM):
    def __init__(self, cfg: DeepseekConfig, expert_backend: str = "torch") -> None:
        super().__init__(cfg, DecoderModel(cfg, lambda i, rotary: deepseek_layer(cfg, i, rotary, expert_backend)))
