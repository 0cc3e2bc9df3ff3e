"""Building blocks shared by the model families: RMSNorm, gated MLP, and the logits head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.parallel import RowLinear, column_linear, row_linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: one Triton kernel (kernels.triton_layer_ops; the triton attention backend asks for it)."""
        if fused:
            from kernels.triton_layer_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor,
                         fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a pre-norm block's residual add and the next norm, one
        kernel when `fused`."""
        if fused:
            from kernels.triton_layer_ops import rms_norm

            out, total = rms_norm(x, self.weight, self.eps, residual)
            assert total is not None
            return out, total
        total = residual + x
        return self(total), total


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama's MLP, DeepSeek's dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        what = "the MLP's intermediate size"
        self.gate_proj = column_linear(hidden_size, intermediate_size, bias, what=what)
        self.up_proj = column_linear(hidden_size, intermediate_size, bias, what=what)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, what=what)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: SiLU(gate) * up as one Triton kernel (kernels.triton_layer_ops; the triton attention
        backend asks for it)."""
        return self.down_proj(self._activation(x, fused))

    def partial(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Under tensor parallelism, this rank's term of the output before the all-reduce (for a block
        that reduces several terms at once: a MoE layer's shared and routed experts)."""
        h = self._activation(x, fused)
        down = self.down_proj
        return down.partial(h) if isinstance(down, RowLinear) else down(h)

    def _activation(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:
            from kernels.triton_layer_ops import silu_mul

            return silu_mul(self.gate_proj(x), self.up_proj(x))
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


def compute_logits(hidden: torch.Tensor, lm_weight: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
    """Logits [N, V] in fp32 for only the rows `indices` of the final hidden states [T, H].

    Computing the vocabulary projection only where a next token is sampled (usually the last token
    of each request) saves T/B of the largest matmul in prefill.
    """
    if indices is not None:
        hidden = hidden.index_select(0, indices)
    return F.linear(hidden, lm_weight).float()
