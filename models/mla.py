"""Multi-head Latent Attention (DeepSeek-V2/V3), with its two computation paths.

Symbols (DeepSeek-V2/V3 values in brackets)
  T      packed tokens of the batch          H      query heads [16 / 128]
  r      kv_lora_rank [512]                  P      qk_rope_head_dim [64]
  N      qk_nope_head_dim [128]              V      v_head_dim [128]
  c_kv   normalised KV latent [T, r]         k_pe   RoPE'd key shared by all heads [T, P]

Per token the cache holds only c_kv ‖ k_pe (r + P = 576 values per layer), never per-head K or V.

`kv_b_proj` [H·(N+V), r] maps the latent to per-head keys and values. At load it is split once into
  w_kc [H, N, r]  (key part)   and   w_vc [H, r, V]  (value part, transposed).

forward_normal — prefill with no cached prefix, on CUDA (`forward` says why not on a CPU). Expand:
  k_nope, v = kv_b_proj(c_kv); run ordinary causal attention with q = (q_nope ‖ q_pe), k = (k_nope ‖ k_pe)
  per head. Compute-efficient when the query count is large; the latent still is the only thing stored.

forward_absorb — decode, extend over a cached prefix, and every forward on a CPU. Fold w_kc into the query,
  q_latent = q_nope · w_kc  [T, H, r], so that
  score(t, s) = (q_latent·c_kv[s] + q_pe·k_pe[s]) · scale
  — MQA over the latent cache, one shared "K" for all heads and no K ever expanded per head. The
  output is the weighted latent [T, H, r]; w_vc maps it to [T, H, V] before `o_proj`.
  Bandwidth-efficient: each cached token is read once (576 values) for all heads.

Both paths compute the same function (up to rounding); tests check they agree.
"""

from __future__ import annotations


import torch
from torch import nn

from kernels.attention.base import AttentionLayer, ForwardBatch
from models.rotary import RotaryEmbedding
from models.config import DeepseekConfig
from models.layers import RMSNorm
from models.parallel import column_linear, row_linear, tp_split

class MLAAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # under tensor parallelism a rank holds its query heads; the latent (kv_a) is every rank's
        heads = cfg.num_attention_heads
        self.num_heads = h = tp_split(heads, "the number of attention heads")
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = r = cfg.kv_lora_rank
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = column_linear(cfg.hidden_size, heads * qk)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = column_linear(cfg.q_lora_rank, heads * qk)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, r + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(r)
        self.kv_b_proj = column_linear(r, heads * (self.nope_dim + self.v_dim))
        self.o_proj = row_linear(heads * self.v_dim, cfg.hidden_size, cfg.attention_bias)
        self.rotary_emb = rotary
        self.register_buffer("w_kc", torch.empty(h, self.nope_dim, r), persistent=False)
        self.register_buffer("w_vc", torch.empty(h, r, self.v_dim), persistent=False)
        scale = cfg.softmax_scale
        self.normal_layer = AttentionLayer(layer_id, h, h, qk, self.v_dim, scale)
        self.absorb_layer = AttentionLayer(
            layer_id, h, 1, r + self.rope_dim, r, scale, kv_lora_rank=r, qk_rope_head_dim=self.rope_dim
        )

    def process_weights_after_loading(self) -> None:
        """Splits kv_b_proj into w_kc [H, N, r] and w_vc [H, r, V], once."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_kc = w[:, : self.nope_dim, :].contiguous()
        self.w_vc = w[:, self.nope_dim :, :].transpose(1, 2).contiguous()

    def _project(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch):
        """-> q_nope [T,H,N], q_pe [T,H,P] (RoPE'd), c_kv [T,r] (normalised), k_pe [T,1,P] (RoPE'd)."""
        t = x.shape[0]
        fused = batch.attn_backend.fused_layer_ops
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x), fused))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv, fused)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1), fused)
        return q_nope, q_pe, c_kv, k_pe

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # The path is chosen per batch (one prefix in it sends every row through absorb), and the two paths
        # round differently (normal expands the fresh, unrounded latent; absorb reads it from the pool in
        # the KV dtype): a prompt's numbers would depend on its batch, its chunks and cache hits. On a CPU
        # every row absorbs, so they do not (unless the backend needs the per-head keys: calibration); on
        # CUDA a fresh prefill expands (SGLang's choice: prefill FLOPs of long prompts), and the numbers
        # may move by rounding with the batch, as in SGLang.
        expand = x.device.type == "cuda" or batch.attn_backend.mla_normal_on_cpu
        if not expand or batch.forward_mode.is_decode() or batch.has_prefix:
            return self.forward_absorb(positions, x, batch)
        return self.forward_normal(positions, x, batch)

    def forward_normal(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self._project(positions, x, batch)
        backend = batch.attn_backend
        backend.set_mla_kv(self.absorb_layer, batch, c_kv, k_pe.squeeze(1))
        t, h = x.shape[0], self.num_heads
        k_nope, v = self.kv_b_proj(c_kv).view(t, h, -1).split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, h, self.rope_dim)], dim=-1)
        out = backend.forward_mla_normal(q, k, v, self.normal_layer, batch)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def forward_absorb(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self._project(positions, x, batch)
        backend = batch.attn_backend
        backend.set_mla_kv(self.absorb_layer, batch, c_kv, k_pe.squeeze(1))
        t = x.shape[0]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_kc.to(q_nope.dtype)).transpose(0, 1)  # [T, H, r]
        o_latent = backend.forward_mla_absorb(q_latent, q_pe, self.absorb_layer, batch)  # [T, H, r]
        out = torch.bmm(o_latent.transpose(0, 1), self.w_vc.to(o_latent.dtype))  # [H, T, V]
        return self.o_proj(out.transpose(0, 1).reshape(t, self.num_heads * self.v_dim))
