"""Rotary position embeddings: frequency tables for default / linear / Llama-3 / YaRN scaling.

Two pair layouts (`RopeConfig.interleaved`):

* interleaved (DeepSeek): dims (x[2i], x[2i+1]) rotate together by angle p·inv_freq[i].
* half split (Llama):     dims (x[i], x[i + d/2]) rotate together.

cos/sin are computed in fp32 as `positions * inv_freq` (the same elementwise ops HF uses, so the
tables agree bit for bit) and multiplied by YaRN's attention factor when it applies. The table covers
every position the model allows (`max_positions`), built once, so a forward never has to look at
the positions on the host (no device sync; CUDA-graph friendly).
"""

from __future__ import annotations

import math

import torch

from models.config import RopeConfig, yarn_get_mscale


def _yarn_inv_freq(cfg: RopeConfig, base_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between."""
    dim, base, factor = cfg.dim, cfg.theta, cfg.factor
    orig = cfg.original_max_position_embeddings
    assert orig is not None

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * base_freq)
    extrapolated = 1.0 / base_freq
    return interpolated * (1 - extrapolation) + extrapolated * extrapolation


def _llama3_inv_freq(cfg: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`, smooth ramp between."""
    orig = cfg.original_max_position_embeddings
    assert orig is not None
    low_freq_wavelen = orig / cfg.low_freq_factor
    high_freq_wavelen = orig / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (orig / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2] fp32, attention factor applied to cos and sin)."""
    pos_freqs = cfg.theta ** (torch.arange(0, cfg.dim, 2, dtype=torch.float32) / cfg.dim)
    inv_freq = 1.0 / pos_freqs
    if cfg.scaling_type == "default":
        return inv_freq, 1.0
    if cfg.scaling_type == "linear":
        return inv_freq / cfg.factor, 1.0
    if cfg.scaling_type == "llama3":
        return _llama3_inv_freq(cfg, inv_freq), 1.0
    if cfg.scaling_type == "yarn":
        attention_factor = cfg.attention_factor
        if attention_factor is None:
            if cfg.mscale and cfg.mscale_all_dim:
                attention_factor = yarn_get_mscale(cfg.factor, cfg.mscale) / yarn_get_mscale(
                    cfg.factor, cfg.mscale_all_dim
                )
            else:
                attention_factor = yarn_get_mscale(cfg.factor)
        return _yarn_inv_freq(cfg, pos_freqs), float(attention_factor)
    raise ValueError(f"unsupported rope scaling type {cfg.scaling_type!r}")


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q [T, Hq, dim] and k [T, Hk, dim] (the first `cfg.dim` dims of the last axis)."""

    def __init__(self, cfg: RopeConfig, max_positions: int = 4096) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin_cache", self._table(max_positions), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Rebuilds the fp32 tables (after meta-device construction or a dtype cast of the model)."""
        inv_freq, _ = rope_inv_freq(self.cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.cos_sin_cache = self._table(self.max_positions)

    def _table(self, length: int) -> torch.Tensor:
        t = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = t[:, None] * self.inv_freq[None, :]
        return torch.stack([freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor])

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] in fp32 for positions (each < max_positions)."""
        table = self.cos_sin_cache[:, positions]
        return table[0], table[1]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, H, dim] (dim == cfg.dim) with cos/sin [T, dim/2]; returns x's dtype."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        xf = x.float()
        if self.cfg.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        d = self.cfg.dim
        if q.shape[-1] == d and k.shape[-1] == d:
            return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        # partial rotary: only the first `d` dims rotate
        q = torch.cat([self.rotate(q[..., :d], cos, sin), q[..., d:]], dim=-1)
        k = torch.cat([self.rotate(k[..., :d], cos, sin), k[..., d:]], dim=-1)
        return q, k
