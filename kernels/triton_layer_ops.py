"""Triton kernels for a decoder layer's small ops on the GPU: RMSNorm (after the residual add, or alone),
rotary position embeddings and the gated MLP's SiLU(gate) * up, one kernel each.

Why: run as torch ops, an RMSNorm is eight kernels (upcast, square, mean, + eps, rsqrt, scale, downcast,
times the weight) and RoPE on q and k about eighteen (strided halves, four products, two sums, the stack,
the casts). An H200 profile of a DeepSeek-V2-Lite-shaped decode step at batch 1 (27 layers, CUDA graphs)
had ~1,100 such elementwise and copy kernels, ~3 ms of its 7.2 ms of device time: each costs a launch's
worth (~2 us) whatever its size.

The math is the torch reference's (`models.layers.RMSNorm`, `models.rotary.RotaryEmbedding.rotate`): fp32
throughout, the residual sum rounded to the activations' dtype (as a torch add of two such tensors), the
normalised value rounded to it before the weight (as HF does), the rotated pairs rounded once. Two
differences of rounding remain: the sum of squares is reduced in another order, and a compiled kernel may
fuse a product into a sum (an FMA). Both move an fp32 value by an ulp or so, which flips a 16-bit rounding
now and then.

Every shape is fixed by the arguments and no device value is read on the host, so the calls can be
captured in a CUDA graph. On a CPU they run under Triton's interpreter (tests); there a program takes a
block of rows, since each interpreted program costs far more than its arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import INTERPRETED, cast_out, check_device

#: Elements of one interpreted program's tile (rows x row width): numpy runs a tile at once.
_INTERPRETED_TILE = 1 << 15


def _rows_per_program(rows: int, width: int) -> int:
    """One row a program when compiled (a row of up to 8K values is one program's registers); a block of
    rows under the interpreter."""
    if not INTERPRETED:
        return 1
    return max(1, min(triton.next_power_of_2(max(1, rows)), _INTERPRETED_TILE // width))


def _warps(width: int) -> int:
    return 8 if width >= 4096 else 4 if width >= 1024 else 2


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, SUM, T, N, stride_x, stride_r, stride_o, stride_s, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """OUT = W * round(s / rms(s)) for s = X (or round(X + R), also written to SUM), BLOCK_T rows."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_N)
    row_in = rows < T
    mask = row_in[:, None] & (cols[None, :] < N)
    rows = rows.to(tl.int64)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        s = cast_out(x.to(tl.float32) + r.to(tl.float32), X.dtype.element_ty, INTERPRET)
        tl.store(SUM + rows[:, None] * stride_s + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=1) / N
    y = xf * (1.0 / tl.sqrt(mean_square + eps))[:, None]
    y = cast_out(y, X.dtype.element_ty, INTERPRET).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], cast_out(w[None, :] * y, OUT.dtype.element_ty, INTERPRET),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit column stride (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dimension of x [..., N] (any row stride), or of x + residual.

    Returns (weight * normalised, in the dtype torch would give: weight's and x's promoted; the sum
    x + residual in x's dtype, or None without a residual)."""
    check_device(x.device, "the Triton RMSNorm", "the torch forward")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match rows of width {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x2 = _rows(x)
    t = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if t == 0:
        return out, total
    r2 = _rows(residual) if residual is not None else x2
    o2, s2 = out.view(-1, n), (total.view(-1, n) if total is not None else out.view(-1, n))
    block_n = triton.next_power_of_2(n)
    block_t = _rows_per_program(t, block_n)
    _rms_norm_kernel[(triton.cdiv(t, block_t),)](
        x2, r2, weight, o2, s2, t, n, x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_N=block_n, INTERPRET=INTERPRETED,
        num_warps=_warps(block_n),
    )
    return out, total


@triton.jit
def _rope_kernel(
    X, OUT, POS, TABLE, T, H, stride_xt, stride_xh, stride_ot, stride_oh, table_rows,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """OUT = X rotated by the angles of its rows' positions, BLOCK_T rows, every head's pairs at once
    (index j over heads x pairs). TABLE [2, table_rows, HALF] holds cos and sin."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_J)
    head, pair = j // HALF, j % HALF
    row_in = rows < T
    mask = row_in[:, None] & (j[None, :] < H * HALF)
    pos = tl.load(POS + rows, mask=row_in, other=0).to(tl.int64)
    at = pos[:, None] * HALF + pair[None, :]
    cos = tl.load(TABLE + at, mask=mask, other=0.0)
    sin = tl.load(TABLE + table_rows * HALF + at, mask=mask, other=0.0)
    if INTERLEAVED:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, pair + HALF
    rows = rows.to(tl.int64)
    src = X + rows[:, None] * stride_xt + head[None, :] * stride_xh
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = OUT + rows[:, None] * stride_ot + head[None, :] * stride_oh
    dtype = OUT.dtype.element_ty
    tl.store(dst + first[None, :], cast_out(x1 * cos - x2 * sin, dtype, INTERPRET), mask=mask)
    tl.store(dst + second[None, :], cast_out(x2 * cos + x1 * sin, dtype, INTERPRET), mask=mask)


def rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, d] (any token and head strides, unit stride within a head) rotated by `positions` [T]
    through `table` [2, P, d/2] (fp32 cos and sin, every position < P): a new contiguous tensor of x's
    dtype. Pairs: (2i, 2i+1) when interleaved (DeepSeek), else (i, i + d/2) (Llama)."""
    check_device(x.device, "the Triton RoPE", "the torch forward")
    t, h, d = x.shape
    half = table.shape[-1]
    if d != 2 * half or table.dim() != 3 or table.shape[0] != 2 or table.dtype != torch.float32:
        raise ValueError(f"rotary: x {tuple(x.shape)} does not fit the table {tuple(table.shape)} {table.dtype} "
                         "(want [2, positions, d/2] fp32)")
    if positions.shape != (t,):
        raise ValueError(f"rotary: positions {tuple(positions.shape)} for {t} tokens")
    if d > 1 and x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    table = table.contiguous()
    block_j = triton.next_power_of_2(h * half)
    block_t = _rows_per_program(t, block_j)
    _rope_kernel[(triton.cdiv(t, block_t),)](
        x, out, positions, table, t, h, x.stride(0), x.stride(1), out.stride(0), out.stride(1), table.shape[1],
        HALF=half, INTERLEAVED=interleaved, BLOCK_T=block_t, BLOCK_J=block_j, INTERPRET=INTERPRETED,
        num_warps=_warps(block_j),
    )
    return out


@triton.jit
def _silu_mul_kernel(G, U, OUT, T, N, stride_g, stride_u, stride_o,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """OUT = silu(G) * U over a tile of BLOCK_T rows x BLOCK_N columns, in fp32, rounded once."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], cast_out(y, OUT.dtype.element_ty, INTERPRET), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., N] of one shape and dtype (any row stride: the two halves of a
    fused gate/up projection will do), computed in fp32 and rounded once to their dtype (torch's
    `F.silu(gate) * up` rounds twice in a 16-bit type: a step of it apart now and then). `out`
    ([rows, N] with unit column stride, rows = gate's rows), if given, gets the result; else a new
    tensor of gate's shape."""
    check_device(gate.device, "the Triton SiLU-and-multiply", "the torch forward")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and dtype")
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    t = g2.shape[0]
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif (out.shape != (t, n) or out.dtype != gate.dtype or out.device != gate.device
          or (n > 1 and out.stride(1) != 1)):
        raise ValueError(f"silu_mul: out {tuple(out.shape)} {out.dtype} does not fit {t} rows of {n} {gate.dtype} "
                         "(want [rows, N], unit column stride)")
    o2 = out if out.dim() == 2 else out.view(-1, n)
    if t == 0 or n == 0:
        return out
    block_n = min(triton.next_power_of_2(n), 2048 if INTERPRETED else 1024)
    block_t = _rows_per_program(t, block_n)
    _silu_mul_kernel[(triton.cdiv(t, block_t), triton.cdiv(n, block_n))](
        g2, u2, o2, t, n, g2.stride(0), u2.stride(0), o2.stride(0),
        BLOCK_T=block_t, BLOCK_N=block_n, INTERPRET=INTERPRETED, num_warps=_warps(block_n),
    )
    return out


__all__ = ["rms_norm", "rotary", "silu_mul"]
