"""Triton kernels of OmniKV's token selection (models/omnikv_config.py defines it; the torch reference is
`kernels.attention.omnikv`): the importance of every context position for a batch of decode rows, the
selection of the kept positions on the device, and a packed gather of the selected cache rows.

Every shape is fixed by the arguments (batch, window, heads, `l_max`, `max_splits`, `k_max`), and no
device value is read on the host, so the calls can be captured in a CUDA graph.

Keys and queries as the reference sees them: window queries q [B, W, H, D] (oldest first; an absent
entry has q_pos = -1 and weight 0) against keys [slots, Hkv, D] read through `req_to_token` rows; query
head h reads KV head h // (H / Hkv). MLA passes the absorbed query (q_latent ‖ q_pe, D = r + P) against
the latent cache viewed [slots, 1, r + P], so one latent row serves every head.

Importance, two passes (like split-KV decode):
  1. `_stats_split_kernel`, grid (B·W, head blocks, max_splits): per window query and head, the
     softmax max and sum of scale·q·k over the positions that query saw (0..q_pos, below ctx_len),
     one split of the positions per program; `_stats_combine_kernel` merges the splits into m, l.
  2. `_importance_kernel`, grid (B, ceil(l_max / BLOCK_N)): per key block, the key tile is read once
     per KV head and scored against every window query and every head reading that KV head;
     importance(j) = sum_w alpha_w · max_h exp(s_whj - m_wh) / l_wh. Positions past ctx_len are 0.
A key row of width D is read as two column blocks of power-of-two widths (576 = 512 + 64, 48 = 32 + 16),
so MLA's rows are not padded to 1024. Scores are fp32 (IEEE products, the cache upcast), as in the
reference: the selection must not depend on a bf16 rounding of the query.

Selection (`select_slots`): unique int64 keys (the fp32 importance bits, then the position reversed),
so ties go to the earlier position exactly as the reference's stable sort does; `_choose_kernel`, one
program per row, finds the budget-th largest key by radix select and writes the positions at or above
it in ascending order (no top-k and no sort of one long row, which PyTorch may run in one block);
then one small kernel lays out sinks + chosen + recent and looks the slots up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.triton_attention import MIN_SPLIT_LEN, _pow2, _split_len

def _column_blocks(d: int) -> tuple[int, int]:
    """(DA, DB): a row of width d read as columns [0, DA) and [DA, d), DA a power of two (DB may be 0)."""
    if d <= 16 or d & (d - 1) == 0:
        return d, 0
    da = 1 << (d.bit_length() - 1)
    return da, d - da


@triton.jit
def _scores(qa, qb, K, slots, mask_n, kv_head, stride_ks, stride_kh,
            DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr):
    """fp32 q·k of a head block (qa [BH, BLOCK_DA], qb [BH, BLOCK_DB]) against the keys at `slots`."""
    offs_a = tl.arange(0, BLOCK_DA)
    ka = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_a[:, None],
                 mask=mask_n[None, :] & (offs_a[:, None] < DA), other=0.0).to(tl.float32)
    s = tl.dot(qa, ka, out_dtype=tl.float32, input_precision="ieee")
    if DB > 0:
        offs_b = tl.arange(0, BLOCK_DB)
        kb = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + DA + offs_b[:, None],
                     mask=mask_n[None, :] & (offs_b[:, None] < DB), other=0.0).to(tl.float32)
        s += tl.dot(qb, kb, out_dtype=tl.float32, input_precision="ieee")
    return s


@triton.jit
def _load_q(Q, b, w, heads, mask_h, stride_qb, stride_qw, stride_qh,
            DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr):
    """The two column blocks of the queries of `heads` of window entry w of row b, in fp32."""
    base = Q + b * stride_qb + w * stride_qw + heads[:, None] * stride_qh
    offs_a = tl.arange(0, BLOCK_DA)
    qa = tl.load(base + offs_a[None, :], mask=mask_h[:, None] & (offs_a[None, :] < DA), other=0.0).to(tl.float32)
    offs_b = tl.arange(0, BLOCK_DB)
    qb = tl.load(base + DA + offs_b[None, :], mask=mask_h[:, None] & (offs_b[None, :] < DB),
                 other=0.0).to(tl.float32)
    return qa, qb


@triton.jit
def _stats_split_kernel(
    Q, QPOS, K, TABLE, ROWS, CTX, PART_M, PART_L,
    stride_qb, stride_qw, stride_qh, stride_pb, stride_pw,
    stride_ks, stride_kh, stride_t,
    stride_mb, stride_mw, stride_mh, stride_ms,
    scale, max_splits,
    W: tl.constexpr, KV_GROUP: tl.constexpr, HEAD_BLOCKS_PER_KV: tl.constexpr,
    DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    bw = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    b = bw // W
    w = bw % W
    kv_head = hb // HEAD_BLOCKS_PER_KV
    h_in_group = (hb % HEAD_BLOCKS_PER_KV) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h_in_group < KV_GROUP
    heads = kv_head * KV_GROUP + h_in_group

    q_pos = tl.load(QPOS + b * stride_pb + w * stride_pw).to(tl.int32)
    n = tl.load(CTX + b).to(tl.int32)
    seen = tl.maximum(tl.minimum(q_pos + 1, n), 0)  # positions 0..seen-1 (0: an absent window entry)
    split_len = _split_len(seen, max_splits, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    end = tl.minimum(start + split_len, seen)
    if start < end:
        row = tl.load(ROWS + b).to(tl.int64)
        qa, qb = _load_q(Q, b, w, heads, mask_h, stride_qb, stride_qw, stride_qh, DA, DB, BLOCK_DA, BLOCK_DB)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(TABLE + row * stride_t + offs_n, mask=mask_n, other=0).to(tl.int64)
            s = _scores(qa, qb, K, slots, mask_n, kv_head, stride_ks, stride_kh, DA, DB, BLOCK_DA, BLOCK_DB)
            s = tl.where(mask_n[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m_i = m_new
        out = b * stride_mb + w * stride_mw + heads * stride_mh + split * stride_ms
        tl.store(PART_M + out, m_i, mask=mask_h)
        tl.store(PART_L + out, l_i, mask=mask_h)


@triton.jit
def _stats_combine_kernel(
    QPOS, CTX, PART_M, PART_L, M, L,
    stride_pb, stride_pw, stride_mb, stride_mw, stride_mh, stride_ms, stride_ob, stride_ow,
    max_splits, H,
    W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
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
        split_len = _split_len(seen, max_splits, BLOCK_N, MIN_SPLIT)
        n_used = tl.cdiv(seen, split_len)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        for s in range(0, n_used):
            ptr = b * stride_mb + w * stride_mw + heads * stride_mh + s * stride_ms
            m_s = tl.load(PART_M + ptr, mask=mask_h, other=0.0)
            l_s = tl.load(PART_L + ptr, mask=mask_h, other=1.0)
            m_new = tl.maximum(m, m_s)
            l = l * tl.exp(m - m_new) + l_s * tl.exp(m_s - m_new)
            m = m_new
    tl.store(M + b * stride_ob + w * stride_ow + heads, m, mask=mask_h)
    tl.store(L + b * stride_ob + w * stride_ow + heads, l, mask=mask_h)


@triton.jit
def _importance_kernel(
    Q, QPOS, WEIGHTS, K, TABLE, ROWS, CTX, M, L, IMP,
    stride_qb, stride_qw, stride_qh, stride_pb, stride_pw, stride_wb,
    stride_ks, stride_kh, stride_t, stride_ob, stride_ow, stride_ib,
    scale, l_max,
    W: tl.constexpr, BLOCK_W: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr,
    HEAD_BLOCKS_PER_KV: tl.constexpr,
    DA: tl.constexpr, DB: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
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
                         mask=mask_n[None, :] & (offs_a[:, None] < DA), other=0.0).to(tl.float32)
            kb = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + DA + offs_b[:, None],
                         mask=mask_n[None, :] & (offs_b[:, None] < DB), other=0.0).to(tl.float32)
            for w in range(W):
                q_pos = tl.load(QPOS + b * stride_pb + w * stride_pw).to(tl.int32)
                visible = mask_n & (offs_n <= q_pos)  # nothing for an absent entry (q_pos = -1)
                top = tl.zeros([BLOCK_N], tl.float32)
                for hb in range(HEAD_BLOCKS_PER_KV):
                    h_in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
                    mask_h = h_in_group < KV_GROUP
                    heads = kv_head * KV_GROUP + h_in_group
                    qa, qb = _load_q(Q, b, w, heads, mask_h, stride_qb, stride_qw, stride_qh,
                                     DA, DB, BLOCK_DA, BLOCK_DB)
                    s = tl.dot(qa, ka, out_dtype=tl.float32, input_precision="ieee")
                    if DB > 0:
                        s += tl.dot(qb, kb, out_dtype=tl.float32, input_precision="ieee")
                    stat = b * stride_ob + w * stride_ow + heads
                    m = tl.load(M + stat, mask=mask_h, other=0.0)
                    inv_l = 1.0 / tl.load(L + stat, mask=mask_h, other=1.0)
                    p = tl.exp(s * scale - m[:, None]) * inv_l[:, None]
                    p = tl.where(mask_h[:, None] & visible[None, :], p, 0.0)
                    top = tl.maximum(top, tl.max(p, 0))
                best = tl.where(offs_w[:, None] == w, tl.maximum(best, top[None, :]), best)
    alpha = tl.load(WEIGHTS + b * stride_wb + offs_w, mask=offs_w < W, other=0.0).to(tl.float32)
    imp = tl.sum(best * alpha[:, None], 0)
    tl.store(IMP + b * stride_ib + offs_n, imp, mask=offs_n < l_max)


def importance_stats_shape(batch: int, window: int, num_heads: int, max_splits: int) -> tuple[int, ...]:
    """Shape of each fp32 split workspace (partial max, partial sum) of `importance`."""
    return (batch, window, num_heads, max_splits)


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
    max_splits: int = 8,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    block_h: int = 16,
    block_n: int | None = None,
) -> torch.Tensor:
    """importance [B, l_max] fp32 of every position of each decode row (0 at and past ctx_lens[b]).

    q [B, W, H, D] window queries (oldest first; any float dtype), q_pos [B, W] their positions (-1:
    absent), weights [B, W] alpha (0 for absent entries), keys [slots, Hkv, D] a cache view (fp32, bf16
    or fp16; unit inner stride), req_to_token [rows, max_ctx] int32 and req_rows [B] the rows of the
    requests, ctx_lens [B] = position + 1 of each row's current token. `workspace`: optional
    (part_m, part_l, m, l) fp32 buffers of `importance_stats_shape(...)` (x2) and [B, W, H] (x2)."""
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
    if workspace is None:
        part_shape = importance_stats_shape(bsz, window, num_heads, max_splits)
        workspace = (torch.empty(part_shape, dtype=torch.float32, device=dev),
                     torch.empty(part_shape, dtype=torch.float32, device=dev),
                     torch.empty(bsz, window, num_heads, dtype=torch.float32, device=dev),
                     torch.empty(bsz, window, num_heads, dtype=torch.float32, device=dev))
    part_m, part_l, m, l = workspace
    da, db = _column_blocks(d)
    block_da, block_db = _pow2(da), _pow2(db)
    block_h = min(block_h, _pow2(group))
    blocks_per_kv = triton.cdiv(group, block_h)
    if block_n is None:
        block_n = 32 if d > 256 else 64
    _stats_split_kernel[(bsz * window, num_kv_heads * blocks_per_kv, max_splits)](
        q, q_pos, keys, req_to_token, req_rows, ctx_lens, part_m, part_l,
        q.stride(0), q.stride(1), q.stride(2), q_pos.stride(0), q_pos.stride(1),
        keys.stride(0), keys.stride(1), req_to_token.stride(0),
        part_m.stride(0), part_m.stride(1), part_m.stride(2), part_m.stride(3),
        scale, max_splits,
        W=window, KV_GROUP=group, HEAD_BLOCKS_PER_KV=blocks_per_kv,
        DA=da, DB=db, BLOCK_DA=block_da, BLOCK_DB=block_db,
        BLOCK_H=block_h, BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_LEN,
        num_warps=8 if d > 256 else 4,
    )
    combine_h = min(128, triton.next_power_of_2(num_heads))
    _stats_combine_kernel[(bsz * window, triton.cdiv(num_heads, combine_h))](
        q_pos, ctx_lens, part_m, part_l, m, l,
        q_pos.stride(0), q_pos.stride(1), part_m.stride(0), part_m.stride(1), part_m.stride(2), part_m.stride(3),
        m.stride(0), m.stride(1), max_splits, num_heads,
        W=window, BLOCK_H=combine_h, BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_LEN,
    )
    _importance_kernel[(bsz, triton.cdiv(l_max, block_n))](
        q, q_pos, weights, keys, req_to_token, req_rows, ctx_lens, m, l, out,
        q.stride(0), q.stride(1), q.stride(2), q_pos.stride(0), q_pos.stride(1), weights.stride(0),
        keys.stride(0), keys.stride(1), req_to_token.stride(0), m.stride(0), m.stride(1), out.stride(0),
        scale, l_max,
        W=window, BLOCK_W=triton.next_power_of_2(window), NUM_KV_HEADS=num_kv_heads, KV_GROUP=group,
        HEAD_BLOCKS_PER_KV=blocks_per_kv, DA=da, DB=db, BLOCK_DA=block_da, BLOCK_DB=block_db,
        BLOCK_H=block_h, BLOCK_N=block_n,
        num_warps=8 if d > 256 else 4,
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


@triton.jit
def _choose_kernel(
    IMP, CTX, BUDGETS, CHOSEN, stride_ib, stride_cb, sink, recent, width, K_TOP,
    BLOCK: tl.constexpr,
):
    """The k_eff most important middle positions of row b, ascending, into CHOSEN[b, :k_eff]: a radix
    select of the k_eff-th largest key (8 passes of one byte, each a histogram of the keys that match
    the bytes fixed so far), then one pass that writes the positions whose key is at least that one.
    Keys are unique (the importance's fp32 bits, then the position reversed: ties to the earlier
    position), so exactly k_eff positions pass. No sort, and every row is one program."""
    b = tl.program_id(0)
    n = tl.load(CTX + b).to(tl.int32)
    k = tl.load(BUDGETS + b).to(tl.int32)
    lo = tl.minimum(sink, n)
    hi = tl.maximum(lo, n - recent)
    k_eff = tl.minimum(tl.minimum(k, hi - lo), K_TOP)
    digits = tl.arange(0, 512)
    prefix = tl.zeros([], tl.int64)
    fixed = tl.zeros([], tl.int64)  # the bits of prefix decided so far
    left = k_eff  # the rank still to find among the keys that match prefix
    for p in tl.static_range(8):  # byte 7 (bits 56..63) down to byte 0
        shift = 56 - 8 * p
        hist = tl.zeros([512], tl.int32)
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = _middle_keys(IMP, b, stride_ib, offs, lo, hi, width)
            match = (key >= 0) & ((key & fixed) == prefix)
            digit = tl.where(match, ((key >> shift) & 255).to(tl.int32), 511)  # 511: no match (bins 0-255 used)
            hist += tl.histogram(digit, 512)
        hist = tl.where(digits < 256, hist, 0)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this byte or a larger one
        d = tl.max(tl.where(at_least >= left, digits, 0), 0)  # the byte of the left-th largest key
        left -= tl.sum(tl.where(digits > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.int64) << shift)
        fixed = fixed | (tl.full([], 255, tl.int64) << shift)
    threshold = tl.where(k_eff > 0, prefix, 0x7FFFFFFFFFFFFFFF)  # a budget of 0 takes nothing
    base = tl.zeros([], tl.int32)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = _middle_keys(IMP, b, stride_ib, offs, lo, hi, width)
        take = (key >= threshold) & (key >= 0)
        rank = base + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(CHOSEN + b * stride_cb + rank, offs, mask=take)
        base += tl.sum(take.to(tl.int32), 0)


@triton.jit
def _middle_keys(IMP, b, stride_ib, offs, lo, hi, width):
    """int64 keys of positions offs: importance bits << 32 | (2^32 - 1 - position) between lo and hi,
    -1 elsewhere (the importance is >= +0; a -0 or NaN counts as 0)."""
    imp = tl.load(IMP + b * stride_ib + offs, mask=offs < width, other=0.0)
    bits = tl.where(imp > 0, imp, 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    key = (bits << 32) | (0xFFFFFFFF - offs.to(tl.int64))
    return tl.where((offs >= lo) & (offs < hi), key, -1)


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
    _choose_kernel[(bsz,)](
        imp, ctx_lens, budgets, chosen, imp.stride(0), chosen.stride(0), sink, recent, width, k_top,
        BLOCK=min(1024, triton.next_power_of_2(width)),
    )
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
