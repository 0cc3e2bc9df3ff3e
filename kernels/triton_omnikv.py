"""Triton kernels of OmniKV's token selection (models/omnikv_config.py defines it; the torch reference is
`kernels.attention.omnikv`): the importance of every context position for a batch of decode rows, the
selection of the kept positions on the device, and a packed gather of the selected cache rows.

Every shape is fixed by the arguments (batch, window, heads, `l_max`, `max_splits`, `k_max`), and no
device value is read on the host, so the calls can be captured in a CUDA graph.

Keys and queries as the reference sees them: window queries q [B, W, H, D] (oldest first; an absent
entry has q_pos = -1 and weight 0) against keys [slots, Hkv, D] read through `req_to_token` rows; query
head h reads KV head h // (H / Hkv). MLA passes the absorbed query (q_latent ‖ q_pe, D = r + P) against
the latent cache viewed [slots, 1, r + P], so one latent row serves every head.

Importance, two passes of `_importance_pass_kernel`, each one program per (row, key block), so that a
long row spreads over every SM; the block's key tile is read once per KV head and scored against every
window query and every head reading that KV head:
  1. STATS: per window query and head, the block's softmax max and sum of scale·q·k over the positions
     that query saw (0..q_pos, below ctx_len); `_stats_combine_kernel` merges the blocks into m, l.
  2. importance(j) = sum_w alpha_w · max_h exp(s_whj - m_wh) / l_wh. Positions past ctx_len are 0.
(Until 2026-11 pass 1 was a split-KV loop over (row·window, head block, split) programs. On an H200 it
took 3.3 ms a call at a 32K context, 17x pass 2, and made OmniKV decode slower than full attention.)
A key row of width D is read as two column blocks of power-of-two widths (576 = 512 + 64, 48 = 32 + 16),
so MLA's rows are not padded to 1024. Scores are fp32 sums of exact products: a 16-bit query against a
cache of its dtype multiplies on the tensor cores (a bf16 x bf16 product is exact in fp32), anything
else in IEEE fp32 (the cache upcast), as the reference: the selection must not depend on a rounding of
the query.

Selection (`select_slots`): a radix select of the budget-th largest importance (its fp32 bits, a byte a
pass) over a grid of (row, chunk) programs, then the positions above it and the earliest ones equal to
it (ties to the earlier position exactly as the reference's stable sort) written in ascending order,
each chunk at its offset (`_choose`; no top-k and no sort of one long row, and no row left to one
program); then one small kernel lays out sinks + chosen + recent and looks the slots up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.triton_attention import _pow2
from kernels.triton_utils import INTERPRETED, dot_precision

def _column_blocks(d: int) -> tuple[int, int]:
    """(DA, DB): a row of width d read as columns [0, DA) and [DA, d), DA a power of two (DB may be 0)."""
    if d <= 16 or d & (d - 1) == 0:
        return d, 0
    da = 1 << (d.bit_length() - 1)
    return da, d - da


@triton.jit
def _load_q(Q, b, w, heads, mask_h, stride_qb, stride_qw, stride_qh,
            DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
            NATIVE: tl.constexpr):
    """The two column blocks of the queries of `heads` of window entry w of row b (fp32 unless NATIVE)."""
    base = Q + b * stride_qb + w * stride_qw + heads[:, None] * stride_qh
    offs_a = tl.arange(0, BLOCK_DA)
    qa = tl.load(base + offs_a[None, :], mask=mask_h[:, None] & (offs_a[None, :] < DA), other=0.0)
    offs_b = tl.arange(0, BLOCK_DB)
    qb = tl.load(base + DA + offs_b[None, :], mask=mask_h[:, None] & (offs_b[None, :] < DB), other=0.0)
    if not NATIVE:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    return qa, qb


@triton.jit
def _importance_pass_kernel(
    Q, QPOS, WEIGHTS, K, TABLE, ROWS, CTX, PART_M, PART_L, M, L, IMP,
    stride_qb, stride_qw, stride_qh, stride_pb, stride_pw, stride_wb,
    stride_ks, stride_kh, stride_t, stride_mb, stride_mw, stride_mn, stride_ob, stride_ow, stride_ib,
    scale, l_max,
    STATS: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr, HEAD_BLOCKS_PER_KV: tl.constexpr,
    DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One key block of one row. STATS: the block's softmax max and sum per window query and head
    (PART_M / PART_L [B, W, blocks, H]). Else: the block's importance, from the merged stats M, L."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    start = blk * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    n = tl.load(CTX + b).to(tl.int32)
    offs_w = tl.arange(0, BLOCK_W)
    best = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)  # per window query: max over heads of P(j)
    if start < n:
        mask_n = offs_n < n
        row = tl.load(ROWS + b).to(tl.int64)
        slots = tl.load(TABLE + row * stride_t + offs_n, mask=mask_n, other=0).to(tl.int64)
        offs_a = tl.arange(0, BLOCK_DA)
        offs_b = tl.arange(0, BLOCK_DB)
        for kv_head in range(NUM_KV_HEADS):
            # the key tile, read once for every window query and every head of this KV head
            ka = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_a[:, None],
                         mask=mask_n[None, :] & (offs_a[:, None] < DA), other=0.0)
            kb = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + DA + offs_b[:, None],
                         mask=mask_n[None, :] & (offs_b[:, None] < DB), other=0.0)
            if not NATIVE:
                ka = ka.to(tl.float32)
                kb = kb.to(tl.float32)
            for w in range(W):
                q_pos = tl.load(QPOS + b * stride_pb + w * stride_pw).to(tl.int32)
                visible = mask_n & (offs_n <= q_pos)  # nothing for an absent entry (q_pos = -1)
                top = tl.zeros([BLOCK_N], tl.float32)
                for hb in range(HEAD_BLOCKS_PER_KV):
                    h_in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
                    mask_h = h_in_group < KV_GROUP
                    heads = kv_head * KV_GROUP + h_in_group
                    qa, qb = _load_q(Q, b, w, heads, mask_h, stride_qb, stride_qw, stride_qh,
                                     DA, DB, BLOCK_DA, BLOCK_DB, NATIVE)
                    s = tl.dot(qa, ka, out_dtype=tl.float32, input_precision=DOT_PRECISION)
                    if DB > 0:
                        s += tl.dot(qb, kb, out_dtype=tl.float32, input_precision=DOT_PRECISION)
                    s = s * scale
                    stat = b * stride_mb + w * stride_mw + heads
                    if STATS:
                        s = tl.where(visible[None, :], s, float("-inf"))
                        m_b = tl.max(s, 1)
                        l_b = tl.sum(tl.exp(s - tl.where(m_b == float("-inf"), 0.0, m_b)[:, None]), 1)
                        tl.store(PART_M + stat + blk * stride_mn, m_b, mask=mask_h)
                        tl.store(PART_L + stat + blk * stride_mn, l_b, mask=mask_h)
                    else:
                        m = tl.load(M + b * stride_ob + w * stride_ow + heads, mask=mask_h, other=0.0)
                        inv_l = 1.0 / tl.load(L + b * stride_ob + w * stride_ow + heads, mask=mask_h, other=1.0)
                        p = tl.exp(s - m[:, None]) * inv_l[:, None]
                        p = tl.where(mask_h[:, None] & visible[None, :], p, 0.0)
                        top = tl.maximum(top, tl.max(p, 0))
                if not STATS:
                    best = tl.where(offs_w[:, None] == w, tl.maximum(best, top[None, :]), best)
    if not STATS:
        alpha = tl.load(WEIGHTS + b * stride_wb + offs_w, mask=offs_w < W, other=0.0).to(tl.float32)
        imp = tl.sum(best * alpha[:, None], 0)
        tl.store(IMP + b * stride_ib + offs_n, imp, mask=offs_n < l_max)


@triton.jit
def _stats_combine_kernel(
    QPOS, CTX, PART_M, PART_L, M, L,
    stride_pb, stride_pw, stride_mb, stride_mw, stride_mn, stride_ob, stride_ow, H,
    W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """m, l [B, W, H] of each window query and head: the key blocks' partial stats merged."""
    bw = tl.program_id(0)
    hblock = tl.program_id(1)
    b = bw // W
    w = bw % W
    heads = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    q_pos = tl.load(QPOS + b * stride_pb + w * stride_pw).to(tl.int32)
    n = tl.load(CTX + b).to(tl.int32)
    seen = tl.maximum(tl.minimum(q_pos + 1, n), 0)
    m = tl.zeros([BLOCK_H], tl.float32)  # an absent entry: m = 0, l = 1 (never read: it sees no key)
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    if seen > 0:
        n_used = tl.cdiv(seen, BLOCK_N)  # blocks holding a position this query saw (each has a finite max)
        offs_s = tl.arange(0, BLOCK_S)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        for s0 in range(0, n_used, BLOCK_S):  # BLOCK_S blocks at a time (a long row has thousands)
            mask = (s0 + offs_s[:, None] < n_used) & mask_h[None, :]
            ptr = b * stride_mb + w * stride_mw + (s0 + offs_s[:, None]) * stride_mn + heads[None, :]
            m_s = tl.load(PART_M + ptr, mask=mask, other=float("-inf"))
            m_s = tl.where(mask_h[None, :], m_s, 0.0)  # heads past H: finite, so nothing below is inf - inf
            l_s = tl.load(PART_L + ptr, mask=mask, other=0.0)
            m_new = tl.maximum(m, tl.max(m_s, 0))
            l = l * tl.exp(m - m_new) + tl.sum(tl.where(mask, l_s * tl.exp(m_s - m_new[None, :]), 0.0), 0)
            m = m_new
    tl.store(M + b * stride_ob + w * stride_ow + heads, m, mask=mask_h)
    tl.store(L + b * stride_ob + w * stride_ow + heads, l, mask=mask_h)


def importance(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    l_max: int,
    *,
    out: torch.Tensor | None = None,
    block_h: int = 16,
    block_n: int | None = None,
) -> torch.Tensor:
    """importance [B, l_max] fp32 of every position of each decode row (0 at and past ctx_lens[b]).

    q [B, W, H, D] window queries (oldest first; any float dtype), q_pos [B, W] their positions (-1:
    absent), weights [B, W] alpha (0 for absent entries), keys [slots, Hkv, D] a cache view (fp32, bf16
    or fp16; unit inner stride), req_to_token [rows, max_ctx] int32 and req_rows [B] the rows of the
    requests, ctx_lens [B] = position + 1 of each row's current token.

    Both passes run one program per (row, key block of `block_n` positions), so a long row is spread over
    the whole GPU. Where q and the keys share a 16-bit dtype, the
    scores are 16-bit tensor-core products (exact in fp32) summed in fp32; otherwise IEEE fp32. Every
    tile is at least 16 wide (`_pow2`), as the tensor cores want."""
    if q.stride(-1) != 1 or keys.stride(-1) != 1:
        raise ValueError("omnikv importance: q and keys need a unit inner stride")
    bsz, window, num_heads, d = q.shape
    num_kv_heads = keys.shape[1]
    if keys.shape[2] != d:
        raise ValueError(f"omnikv importance: query width {d} != key width {keys.shape[2]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    dev = q.device
    if out is None:
        out = torch.empty(bsz, l_max, dtype=torch.float32, device=dev)
    if bsz == 0:
        return out
    da, db = _column_blocks(d)
    block_da, block_db = _pow2(da), _pow2(db)
    block_h = min(block_h, _pow2(group))
    blocks_per_kv = triton.cdiv(group, block_h)
    if block_n is None:
        block_n = 32 if d > 256 else 64
    blocks = triton.cdiv(l_max, block_n)
    # (Triton's interpreter multiplies 16-bit tiles wrongly: there the scores stay IEEE fp32)
    native = q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    part_m = torch.empty(bsz, window, blocks, num_heads, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    m = torch.empty(bsz, window, num_heads, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    common = dict(W=window, BLOCK_W=triton.next_power_of_2(window), NUM_KV_HEADS=num_kv_heads, KV_GROUP=group,
                  HEAD_BLOCKS_PER_KV=blocks_per_kv, DA=da, DB=db, BLOCK_DA=block_da, BLOCK_DB=block_db,
                  BLOCK_H=block_h, BLOCK_N=block_n, NATIVE=native,
                  DOT_PRECISION=dot_precision(q.dtype if native else torch.float32), num_warps=8 if d > 256 else 4)
    for stats in (True, False):
        _importance_pass_kernel[(bsz, blocks)](
            q, q_pos, weights, keys, req_to_token, req_rows, ctx_lens, part_m, part_l, m, l, out,
            q.stride(0), q.stride(1), q.stride(2), q_pos.stride(0), q_pos.stride(1), weights.stride(0),
            keys.stride(0), keys.stride(1), req_to_token.stride(0),
            part_m.stride(0), part_m.stride(1), part_m.stride(2), m.stride(0), m.stride(1), out.stride(0),
            scale, l_max, STATS=stats, **common,
        )
        if stats:
            combine_h = min(128, triton.next_power_of_2(num_heads))
            _stats_combine_kernel[(bsz * window, triton.cdiv(num_heads, combine_h))](
                q_pos, ctx_lens, part_m, part_l, m, l,
                q_pos.stride(0), q_pos.stride(1), part_m.stride(0), part_m.stride(1), part_m.stride(2),
                m.stride(0), m.stride(1), num_heads,
                W=window, BLOCK_H=combine_h, BLOCK_N=block_n,
                BLOCK_S=max(2, min(triton.next_power_of_2(blocks), 4096 // combine_h)),
            )
    return out


@triton.jit
def _importance_from_scores_kernel(
    S, LSE, CTX, IMP, stride_sb, stride_sh, stride_eb, stride_ib, l_max, H,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.load(CTX + b).to(tl.int32)
    mask = offs < n
    best = tl.zeros([BLOCK_N], tl.float32)
    if tl.program_id(1) * BLOCK_N < n:
        for h in range(H):
            lse = tl.load(LSE + b * stride_eb + h)
            s = tl.load(S + b * stride_sb + h * stride_sh + offs, mask=mask, other=float("-inf"))
            best = tl.maximum(best, tl.exp(s - lse))
    tl.store(IMP + b * stride_ib + offs, tl.where(mask, best, 0.0), mask=offs < l_max)


def importance_from_scores(scores: torch.Tensor, lse: torch.Tensor, ctx_lens: torch.Tensor, l_max: int,
                           *, out: torch.Tensor | None = None, block_n: int = 512) -> torch.Tensor:
    """importance [B, l_max] of a window of the current query alone, from the scores its decode attention
    wrote (`decode_attention(..., scores=, lse=)`: scaled scores [B, H, >= l_max] and log-sum-exps
    [B, H]): max over heads of exp(s - lse), 0 at and past ctx_lens[b]. The alpha weight of a
    one-query window is a positive number per row, which no selection depends on, so it is left out:
    the keys are not read a second time."""
    bsz, heads = lse.shape
    if scores.shape[:2] != (bsz, heads) or scores.shape[2] < l_max or scores.stride(-1) != 1:
        raise ValueError(f"importance_from_scores: scores {tuple(scores.shape)} do not cover lse "
                         f"{tuple(lse.shape)} and {l_max} positions")
    if out is None:
        out = torch.empty(bsz, l_max, dtype=torch.float32, device=scores.device)
    if bsz == 0 or l_max == 0:
        return out
    block_n = min(block_n, triton.next_power_of_2(l_max))
    _importance_from_scores_kernel[(bsz, triton.cdiv(l_max, block_n))](
        scores, lse, ctx_lens, out, scores.stride(0), scores.stride(1), lse.stride(0), out.stride(0), l_max, heads,
        BLOCK_N=block_n,
    )
    return out


# ---------------------------------------------------------------------------------------- selection
@triton.jit
def _assemble_kernel(
    CHOSEN, CTX, BUDGETS, TABLE, ROWS, SLOTS, POS, LENS,
    stride_cb, stride_t, stride_sb, stride_pb,
    sink, recent, K_MAX, K_TOP,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(CTX + b).to(tl.int32)
    k = tl.load(BUDGETS + b).to(tl.int32)
    lo = tl.minimum(sink, n)
    hi = tl.maximum(lo, n - recent)
    k_eff = tl.minimum(tl.minimum(k, hi - lo), K_TOP)  # k >= hi - lo: the whole middle (all of the context)
    length = lo + k_eff + (n - hi)
    in_mid = (t >= lo) & (t < lo + k_eff)
    mid = tl.load(CHOSEN + b * stride_cb + (t - lo), mask=in_mid, other=0).to(tl.int32)
    pos = tl.where(t < lo, t, tl.where(in_mid, mid, hi + (t - lo - k_eff)))
    valid = (t < length) & (t < K_MAX)
    row = tl.load(ROWS + b).to(tl.int64)
    slot = tl.load(TABLE + row * stride_t + pos, mask=valid, other=0)
    tl.store(SLOTS + b * stride_sb + t, tl.where(valid, slot, 0).to(tl.int32), mask=t < K_MAX)
    tl.store(POS + b * stride_pb + t, tl.where(valid, pos, -1), mask=t < K_MAX)
    if tl.program_id(1) == 0:
        tl.store(LENS + b, tl.minimum(length, K_MAX))


# The k_eff most important middle positions of each row, ascending, by a radix select spread over
# (row, chunk) programs: every pass is a grid over the whole context, not one program per row.
# Keys are the importance's fp32 bits (>= +0: the bits order as the values do; a -0 or NaN counts as 0).
#   4 passes, one byte each (bits 31..24 first): `_radix_hist_kernel` writes each chunk's histogram of
#   the byte among the keys that match the bytes fixed so far, `_radix_digit_kernel` (one program a
#   row) sums the chunks, fixes the byte of the k_eff-th largest key, and keeps how many keys equal to
#   the prefix are still to take (`left`). After 4 passes the prefix is the threshold key t.
#   Then `_select_count_kernel` counts each chunk's keys > t and == t, and `_select_write_kernel`
#   writes, in position order, every key > t and the first `left` keys == t (ties to the earlier
#   position, as the reference's stable sort), each chunk at the offset the chunks before it fill.
_RADIX_PASSES = 4
_MAX_CHUNKS = 64


@triton.jit
def _middle_bits(IMP, b, stride_ib, offs, lo, hi, width):
    """int32 keys of positions offs: the importance's bits between lo and hi (importance >= +0; a -0
    or NaN counts as 0), -1 elsewhere."""
    imp = tl.load(IMP + b * stride_ib + offs, mask=offs < width, other=0.0)
    bits = tl.where(imp > 0, imp, 0.0).to(tl.int32, bitcast=True)
    return tl.where((offs >= lo) & (offs < hi), bits, -1)


@triton.jit
def _row_bounds(CTX, BUDGETS, b, sink, recent, K_TOP):
    n = tl.load(CTX + b).to(tl.int32)
    k = tl.load(BUDGETS + b).to(tl.int32)
    lo = tl.minimum(sink, n)
    hi = tl.maximum(lo, n - recent)
    k_eff = tl.minimum(tl.minimum(k, hi - lo), K_TOP)  # k >= hi - lo: the whole middle (all of the context)
    return lo, hi, k_eff


@triton.jit
def _radix_hist_kernel(
    IMP, CTX, BUDGETS, STATE, HIST, stride_ib, sink, recent, width, K_TOP, CHUNK,
    SHIFT: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    lo, hi, k_eff = _row_bounds(CTX, BUDGETS, b, sink, recent, K_TOP)
    prefix = tl.load(STATE + b * 3)
    fixed = tl.load(STATE + b * 3 + 1)
    hist = tl.zeros([512], tl.int32)
    for start in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = _middle_bits(IMP, b, stride_ib, offs, lo, hi, width)
        match = (key >= 0) & ((key & fixed) == prefix)
        digit = tl.where(match, (key >> SHIFT) & 255, 511)  # 511: no match (bins 0-255 are used)
        hist += tl.histogram(digit, 512)
    bins = tl.arange(0, 512)
    tl.store(HIST + (b * NUM_CHUNKS + c) * 256 + bins, hist, mask=bins < 256)


@triton.jit
def _radix_digit_kernel(
    CTX, BUDGETS, STATE, HIST, sink, recent, K_TOP,
    SHIFT: tl.constexpr, BYTE_MASK: tl.constexpr, FIRST: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    b = tl.program_id(0)
    lo, hi, k_eff = _row_bounds(CTX, BUDGETS, b, sink, recent, K_TOP)
    digits = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for c in range(NUM_CHUNKS):
        hist += tl.load(HIST + (b * NUM_CHUNKS + c) * 256 + digits)
    prefix = tl.load(STATE + b * 3)
    fixed = tl.load(STATE + b * 3 + 1)
    left = k_eff if FIRST else tl.load(STATE + b * 3 + 2)  # the rank still to find among keys matching prefix
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this byte or a larger one
    d = tl.max(tl.where(at_least >= left, digits, 0), 0)  # the byte of the left-th largest key
    left -= tl.sum(tl.where(digits > d, hist, 0), 0)
    tl.store(STATE + b * 3, prefix | (d << SHIFT))
    tl.store(STATE + b * 3 + 1, fixed | BYTE_MASK)
    tl.store(STATE + b * 3 + 2, left)


@triton.jit
def _select_count_kernel(
    IMP, CTX, BUDGETS, STATE, COUNTS, stride_ib, sink, recent, width, K_TOP, CHUNK,
    NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    lo, hi, k_eff = _row_bounds(CTX, BUDGETS, b, sink, recent, K_TOP)
    t = tl.load(STATE + b * 3)
    above = tl.zeros([], tl.int32)
    equal = tl.zeros([], tl.int32)
    for start in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = _middle_bits(IMP, b, stride_ib, offs, lo, hi, width)
        above += tl.sum((key > t).to(tl.int32), 0)
        equal += tl.sum((key == t).to(tl.int32), 0)
    tl.store(COUNTS + (b * NUM_CHUNKS + c) * 2, above)
    tl.store(COUNTS + (b * NUM_CHUNKS + c) * 2 + 1, equal)


@triton.jit
def _select_write_kernel(
    IMP, CTX, BUDGETS, STATE, COUNTS, CHOSEN, stride_ib, stride_cb, sink, recent, width, K_TOP, CHUNK,
    NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    lo, hi, k_eff = _row_bounds(CTX, BUDGETS, b, sink, recent, K_TOP)
    if k_eff > 0:  # a budget of 0 takes nothing
        t = tl.load(STATE + b * 3)
        left = tl.load(STATE + b * 3 + 2)  # keys == t to take: the first ones by position
        chunks = tl.arange(0, NUM_CHUNKS)
        before = chunks < c
        above_before = tl.sum(tl.where(before, tl.load(COUNTS + (b * NUM_CHUNKS + chunks) * 2), 0), 0)
        equal_before = tl.sum(tl.where(before, tl.load(COUNTS + (b * NUM_CHUNKS + chunks) * 2 + 1), 0), 0)
        base = above_before + tl.minimum(equal_before, left)  # what the chunks before this one take
        ties = equal_before  # keys == t at earlier positions
        for start in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = _middle_bits(IMP, b, stride_ib, offs, lo, hi, width)
            eq = key == t
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), 0) - 1
            take = (key > t) | (eq & (tie_rank < left))
            rank = base + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(CHOSEN + b * stride_cb + rank, offs, mask=take)
            base += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)


def _choose(imp: torch.Tensor, ctx_lens: torch.Tensor, budgets: torch.Tensor, chosen: torch.Tensor, sink: int,
            recent: int, width: int, k_top: int) -> None:
    """chosen[b, :k_eff] = row b's k_eff most important middle positions, ascending (the kernels above).
    The chunking depends on `width` alone (a graph's bucket), so the launches are fixed by the shapes."""
    bsz = imp.shape[0]
    block = min(1024, triton.next_power_of_2(width))
    chunks = min(_MAX_CHUNKS, triton.cdiv(width, block))
    chunk = block * triton.cdiv(triton.cdiv(width, block), chunks)  # positions per chunk, whole blocks
    chunks = triton.cdiv(width, chunk)
    num_chunks = triton.next_power_of_2(chunks)  # the counts' row length (padding chunks count nothing)
    dev = imp.device
    state = torch.zeros(bsz, 3, dtype=torch.int32, device=dev)  # prefix, fixed bits, keys == prefix left
    hist = torch.zeros(bsz, num_chunks, 256, dtype=torch.int32, device=dev)
    counts = torch.zeros(bsz, num_chunks, 2, dtype=torch.int32, device=dev)
    common = (sink, recent, width, k_top, chunk)
    for p in range(_RADIX_PASSES):
        shift = 24 - 8 * p
        _radix_hist_kernel[(bsz, chunks)](imp, ctx_lens, budgets, state, hist, imp.stride(0), *common,
                                          SHIFT=shift, NUM_CHUNKS=num_chunks, BLOCK=block)
        byte_mask = ((255 << shift) + 2**31) % 2**32 - 2**31  # the byte's bits as an int32 (bit 31 is the sign)
        _radix_digit_kernel[(bsz,)](ctx_lens, budgets, state, hist, sink, recent, k_top,
                                    SHIFT=shift, BYTE_MASK=byte_mask, FIRST=p == 0, NUM_CHUNKS=num_chunks)
    _select_count_kernel[(bsz, chunks)](imp, ctx_lens, budgets, state, counts, imp.stride(0), *common,
                                        NUM_CHUNKS=num_chunks, BLOCK=block)
    _select_write_kernel[(bsz, chunks)](imp, ctx_lens, budgets, state, counts, chosen, imp.stride(0), chosen.stride(0),
                                        *common, NUM_CHUNKS=num_chunks, BLOCK=block)


def select_slots(
    importance: torch.Tensor,
    ctx_lens: torch.Tensor,
    budgets: torch.Tensor | Sequence[int],
    sink: int,
    recent: int,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    k_max: int,
    *,
    return_positions: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The kept positions of each row, as KV slots: slots [B, k_max] int32 (sorted by position; 0 past
    the row's length) and lens [B] int32 (and positions [B, k_max] int32, -1 past the length, when
    `return_positions`).

    Exactly `kernels.attention.omnikv.select_positions` per row: positions 0..sink-1, the last `recent`,
    and the budgets[b] most important between them, ties to the earlier position. importance [B, L]
    (as `importance` writes it), ctx_lens [B], budgets [B] (a host sequence is checked against k_max;
    k_max must be at least min(n, budget + sink + recent) for every row, else the row is cut)."""
    bsz, width = importance.shape
    dev = importance.device
    if not isinstance(budgets, torch.Tensor):
        budgets = list(budgets)
        if budgets and max(budgets) + sink + recent > k_max:
            raise ValueError(f"select_slots: k_max {k_max} < budget {max(budgets)} + sink {sink} + recent {recent}")
        budgets = torch.tensor(budgets, dtype=torch.int32, device=dev)
    slots = torch.empty(bsz, k_max, dtype=torch.int32, device=dev)
    positions = torch.empty(bsz, k_max, dtype=torch.int32, device=dev)
    lens = torch.empty(bsz, dtype=torch.int32, device=dev)
    if bsz == 0:
        return (slots, lens, positions) if return_positions else (slots, lens)
    k_top = min(k_max, width)
    chosen = torch.empty(bsz, k_top, dtype=torch.int32, device=dev)  # ascending; only :k_eff is read
    imp = importance if importance.dtype == torch.float32 else importance.float()
    _choose(imp, ctx_lens, budgets, chosen, sink, recent, width, k_top)
    block = min(256, triton.next_power_of_2(k_max))
    _assemble_kernel[(bsz, triton.cdiv(k_max, block))](
        chosen, ctx_lens, budgets, req_to_token, req_rows, slots, positions, lens,
        chosen.stride(0), req_to_token.stride(0), slots.stride(0), positions.stride(0),
        sink, recent, k_max, k_top,  # run-time values: the budget grows with the context every few steps
        BLOCK=block,
    )
    return (slots, lens, positions) if return_positions else (slots, lens)


# ---------------------------------------------------------------------------------------- packed gather
@triton.jit
def _gather_kernel(
    SRC, SLOTS, LENS, DST, stride_s, stride_sb, stride_db, stride_dt, K_MAX,
    ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    length = tl.load(LENS + b).to(tl.int32)
    mask_t = (t < length) & (t < K_MAX)
    slot = tl.load(SLOTS + b * stride_sb + t, mask=mask_t, other=0).to(tl.int64)
    mask = mask_t[:, None] & (cols[None, :] < ROW)
    vals = tl.load(SRC + slot[:, None] * stride_s + cols[None, :], mask=mask)
    tl.store(DST + b * stride_db + t[:, None] * stride_dt + cols[None, :], vals.to(DST.dtype.element_ty), mask=mask)


def gather_rows(src: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """out[b, t] = src[slots[b, t]] for t < lens[b] (rows past a row's length are left as they were).

    src [S, ...] a cache whose rows are contiguous (the latent [S, r + P], or K / V [S, Hkv, D]),
    slots [B, k_max] int32 (as `select_slots` gives them), out [B, k_max, ...] (src's row shape; any
    float dtype, cast on the way). The packed copy a context bank makes of the selected rows."""
    rows = src.reshape(src.shape[0], -1)  # a view for every cache layout here (rows are contiguous)
    if rows.stride(-1) != 1:
        raise ValueError("gather_rows: the source rows must be contiguous")
    bsz, k_max = slots.shape
    if out is None:
        out = torch.empty((bsz, k_max, *src.shape[1:]), dtype=src.dtype, device=src.device)
    dst = out.view(bsz, k_max, -1)
    if dst.shape[-1] != rows.shape[-1] or dst.stride(-1) != 1:
        raise ValueError(f"gather_rows: out rows of {dst.shape[-1]} values != source rows of {rows.shape[-1]}")
    if bsz == 0 or k_max == 0:
        return out
    row = rows.shape[-1]
    block_r = min(256, triton.next_power_of_2(row))
    block_t = 16
    _gather_kernel[(bsz, triton.cdiv(k_max, block_t), triton.cdiv(row, block_r))](
        rows, slots, lens, dst, rows.stride(0), slots.stride(0), dst.stride(0), dst.stride(1), k_max,
        ROW=row, BLOCK_T=block_t, BLOCK_R=block_r,
    )
    return out
