"""Rotary position embeddings: frequency tables for default / linear / Llama-3 / YaRN scaling.

Two pair layouts (`RopeConfig.interleaved`):

* interleaved (DeepSeek): dims (x[2i], x[2i+1]) rotate together by angle p·inv_freq[i].
* half split (Llama):     dims (x[i], x[i + d/2]) rotate together.

cos/sin are computed in fp32 as `positions * inv_freq` (the same elementwise ops HF uses, so the
tables agree bit for bit) and multiplied by YaRN's attention factor when it applies. A forward reads
them from one table (`cos_sin_cache` [2, positions, dim/2]) so that it never has to look at the
positions on the host (no device sync; CUDA-graph friendly).

The table does not cover the model's whole `max_positions` up front: a config's claim (a hostile one,
or a real 1M-token context served at 8K) would cost 4·dim bytes a position. It holds
min(max_positions, `TABLE_POSITIONS`) rows, which is every position of the released models' contexts
(DeepSeek-V3's 163,840 included), and `set_positions` sizes it to the context actually served (the
engine's `--context-length`, through `CausalLM.set_context_length`). A torch forward on the CPU that
reaches past the table grows it (the positions are on the host there: no sync).
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


TABLE_POSITIONS = 1 << 18  # rows built up front at most (262,144 positions; 64 MiB at dim 64)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q [T, Hq, dim] and k [T, Hk, dim] (the first `cfg.dim` dims of the last axis).

    `max_positions`: the model's context (positions beyond it are never valid); the table holds the
    first `table_positions` of them (see the module's docstring)."""

    def __init__(self, cfg: RopeConfig, max_positions: int = 4096) -> None:
        super().__init__()
        if max_positions <= 0:
            raise ValueError(f"max_positions must be > 0, got {max_positions}")
        self.cfg = cfg
        self.max_positions = max_positions
        self.table_positions = min(max_positions, TABLE_POSITIONS)
        with torch.device("cpu"):  # (a few values)
            inv_freq, self.attention_factor = rope_inv_freq(cfg)
        if torch.get_default_device().type == "meta":
            # shapes only (the loader builds models on the meta device; process_weights_after_loading builds
            # the tables): computed there, the ops would run torch's Python references, whose first call
            # imports torch._dynamo, seconds of every engine start
            self.register_buffer("inv_freq", torch.empty(inv_freq.shape), persistent=False)
            self.register_buffer("cos_sin_cache", torch.empty(2, self.table_positions, inv_freq.shape[0]),
                                 persistent=False)
            return
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.register_buffer("cos_sin_cache", self._table(self.table_positions), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Rebuilds the fp32 tables (after meta-device construction or a dtype cast of the model)."""
        inv_freq, _ = rope_inv_freq(self.cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.cos_sin_cache = self._table(self.table_positions)

    def set_positions(self, n: int) -> None:
        """Sizes the table to positions [0, n) (1 <= n <= max_positions): the context that will be served.
        A table already handed to a native forward or captured in a CUDA graph stays as it was there:
        call this before those are made."""
        if not 0 < n <= self.max_positions:
            raise ValueError(f"rotary table size {n} is outside 1..{self.max_positions} (the model's context)")
        if n != self.table_positions:
            self.table_positions = n
            if self.cos_sin_cache.device.type != "meta":
                self.cos_sin_cache = self._table(n)

    def _table(self, length: int) -> torch.Tensor:
        device = self.inv_freq.device
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else rope_inv_freq(self.cfg)[0].to(device)
        t = torch.arange(length, dtype=torch.float32, device=device)
        freqs = t[:, None] * inv_freq[None, :]
        return torch.stack([freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor])

    def _cover(self, positions: torch.Tensor) -> None:
        """Grows the table to cover host `positions` (see the module's docstring)."""
        if self.table_positions < self.max_positions and positions.device.type == "cpu" and positions.numel():
            need = int(positions.max()) + 1  # host tensors: no device sync
            if self.table_positions < need <= self.max_positions:
                self.set_positions(min(self.max_positions, max(need, 2 * self.table_positions)))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] in fp32 for positions (each < max_positions)."""
        self._cover(positions)
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
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused`: one Triton kernel for each of q and k where every dim rotates (kernels.triton_layer_ops;
        the triton attention backend asks for it)."""
        d = self.cfg.dim
        if fused and q.shape[-1] == d and k.shape[-1] == d:
            from kernels.triton_layer_ops import rotary

            self._cover(positions)
            table, inter = self.cos_sin_cache, self.cfg.interleaved
            return rotary(q, positions, table, inter), rotary(k, positions, table, inter)
        cos, sin = self.cos_sin(positions)
        if q.shape[-1] == d and k.shape[-1] == d:
            return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        # partial rotary: only the first `d` dims rotate
        q = torch.cat([self.rotate(q[..., :d], cos, sin), q[..., d:]], dim=-1)
        k = torch.cat([self.rotate(k[..., :d], cos, sin), k[..., d:]], dim=-1)
        return q, k
