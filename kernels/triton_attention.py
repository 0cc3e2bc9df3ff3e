"""Triton attention kernels over the KV pools: split-KV decode + combine, extend with a cached prefix,
and the latent-cache store. The `triton` attention backend (kernels/attention/triton_backend.py) calls
them; the `torch` backend is their oracle (tests/kernels/test_triton_attention.py).

One decode kernel serves MLA and GQA. A program owns one request, a block of up to BLOCK_H query heads
that share one KV head, and one KV split. For MLA the KV "head" is the shared latent row: every head of
the request reads the same 576-value rows, so BLOCK_H heads share each KV tile (the cache is read once
per head block, not once per head). The score is two dot products, q_latent·c_kv (512) + q_pe·k_pe
(64), over column views of one pool buffer; the value is the c_kv part of the tile already loaded.
No per-head K is ever built.

Split-KV (FlashMLA / flash-decoding): the grid is fixed at (batch, head blocks, max_splits), so a CUDA
graph can hold it; how many splits a request really uses is computed inside the kernel from its
seq_len on the device: ceil(seq_len / MIN_SPLIT_LEN) capped at max_splits, each split a multiple of
BLOCK_N tokens; programs past the last used split return at once. Each split writes its normalised
partial output and log-sum-exp in fp32; the combine kernel merges them per (request, head). A request
that uses one split (a context of up to MIN_SPLIT_LEN positions) has its output written by the split
kernel, and the combine returns at once for it.

KV slots come from `req_to_token` rows (page size 1) or from a page table of P-token pages (slot =
page * P + pos % P), chosen by the PAGE_SIZE constexpr.

Extend/prefill: queries are the new tokens; keys are every position 0..seq_len-1 of the request, read
through the same slot lookup (the new tokens' KV is stored before attention runs), with the causal
mask key_pos <= query_pos. With USE_TABLE=False the keys are packed dense tensors instead (the MLA
`forward_normal` prefill, whose per-head K/V are never in the pool).

Every kernel accumulates in fp32; fp32 inputs multiply in IEEE fp32 (not TF32), so an fp32 model matches
the torch reference. Under the interpreter (UPCAST) the dots run in fp32: its bf16 tl.dot is wrong.
"""

from __future__ import annotations


import triton
import triton.language as tl
import torch

from kernels.triton_utils import INTERPRETED, dot_precision

MIN_SPLIT_LEN = 64  # fewest KV positions a split is given (below that, splitting costs more than it saves)
COMBINE_BLOCK_S = 32  # splits the combine kernel loads at a time
COMBINE_BLOCK_DV = 128  # output columns per combine program (MLA's 512: four programs per head)


def _pow2(n: int, floor: int = 16) -> int:
    """Block width for a dimension of n (tl.dot wants powers of two, at least 16)."""
    return max(floor, triton.next_power_of_2(max(1, n)))


def _unit(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index the last dimension densely: make it so (a no-op for the usual views)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _kv_slots(table_ptr, row, stride_t, pos, mask, PAGE_SIZE: tl.constexpr):
    """KV pool slots of positions `pos` of the request whose table row is `row`."""
    if PAGE_SIZE == 1:
        slot = tl.load(table_ptr + row * stride_t + pos, mask=mask, other=0)
    else:
        page = tl.load(table_ptr + row * stride_t + pos // PAGE_SIZE, mask=mask, other=0)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
    return slot.to(tl.int64)


@triton.jit
def _split_len(seq_len, max_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per split (a multiple of BLOCK_N) for a request of seq_len; both kernels must agree."""
    n_splits = tl.minimum(max_splits, tl.cdiv(seq_len, MIN_SPLIT))
    n_splits = tl.maximum(n_splits, 1)
    return tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q, QR, K, KR, V, TABLE, ROWS, SEQ_LENS, PART_O, PART_LSE, SCORES, OUT, LSE,
    stride_qb, stride_qh, stride_qrb, stride_qrh,
    stride_ks, stride_kh, stride_krs, stride_krh, stride_vs, stride_vh,
    stride_t, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_sb, stride_sh,
    stride_ob, stride_oh, stride_eb,
    sm_scale, max_splits,
    KV_GROUP: tl.constexpr, HEAD_BLOCKS_PER_KV: tl.constexpr,
    DK: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MIN_SPLIT: tl.constexpr, V_FROM_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DUMP: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = hb // HEAD_BLOCKS_PER_KV
    h_in_group = (hb % HEAD_BLOCKS_PER_KV) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h_in_group < KV_GROUP
    heads = kv_head * KV_GROUP + h_in_group

    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    split_len = _split_len(seq_len, max_splits, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        row = tl.load(ROWS + b).to(tl.int64)
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :],
                    mask=mask_h[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if DR > 0:
            offs_dr = tl.arange(0, BLOCK_DR)
            qr = tl.load(QR + b * stride_qrb + heads[:, None] * stride_qrh + offs_dr[None, :],
                         mask=mask_h[:, None] & (offs_dr[None, :] < DR), other=0.0)
            if UPCAST:
                qr = qr.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        # each tile's KV slots are loaded one tile ahead, so a tile's loads wait on no table read
        slots = _kv_slots(TABLE, row, stride_t, start + tl.arange(0, BLOCK_N), start + tl.arange(0, BLOCK_N) < end,
                          PAGE_SIZE)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            next_n = offs_n + BLOCK_N
            next_slots = _kv_slots(TABLE, row, stride_t, next_n, next_n < end, PAGE_SIZE)
            k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_dk[:, None],
                        mask=mask_n[None, :] & (offs_dk[:, None] < DK), other=0.0)  # [DK, N]
            k = k.to(q.dtype)  # a no-op unless the cache dtype differs (or the interpreter upcast q)
            qk = tl.dot(q, k, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            if DR > 0:
                kr = tl.load(KR + slots[None, :] * stride_krs + kv_head * stride_krh + offs_dr[:, None],
                             mask=mask_n[None, :] & (offs_dr[:, None] < DR), other=0.0)
                kr = kr.to(qr.dtype)
                qk += tl.dot(qr, kr, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))
            if DUMP:  # every position's scaled score per head, for OmniKV's selection at a filter layer
                tl.store(SCORES + b * stride_sb + heads[:, None] * stride_sh + offs_n[None, :], qk,
                         mask=mask_h[:, None] & mask_n[None, :])
            if V_FROM_K:
                v = tl.trans(k)  # MLA: the value is the c_kv part of the tile already loaded
            else:
                v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                            mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
                v = v.to(q.dtype)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            slots = next_slots
        mask_o = mask_h[:, None] & (offs_dv[None, :] < DV)
        if split_len >= seq_len:  # the request's one split: its output is final (the combine skips it)
            tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                     (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=mask_o)
            if DUMP:
                tl.store(LSE + b * stride_eb + heads, m_i + tl.log(l_i), mask=mask_h)
        else:
            o_ptr = PART_O + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_dv[None, :]
            tl.store(o_ptr, acc / l_i[:, None], mask=mask_o)
            tl.store(PART_LSE + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_combine_kernel(
    PART_O, PART_LSE, SEQ_LENS, OUT, LSE,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, stride_eb,
    max_splits,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, DUMP: tl.constexpr,
):
    """OUT[b, h, cols] from the used splits' partials of (b, h): the log-sum-exps' max first, then the
    partial outputs weighted by exp(lse - max), BLOCK_S splits a load. No step waits on the one before
    (a running rescale would chain every split's loads), and a program takes BLOCK_DV of the columns."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    split_len = _split_len(seq_len, max_splits, BLOCK_N, MIN_SPLIT)
    n_used = tl.cdiv(seq_len, split_len)
    if n_used == 1:  # the split kernel wrote this request's output itself
        return
    offs_s = tl.arange(0, BLOCK_S)
    cols = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_c = cols < DV
    lse_ptr = PART_LSE + b * stride_lb + h * stride_lh
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        m = tl.maximum(m, tl.load(lse_ptr + s0 + offs_s, mask=s0 + offs_s < n_used, other=float("-inf")))
    m_all = tl.max(m, 0)
    l = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        mask_s = s0 + offs_s < n_used
        w = tl.exp(tl.load(lse_ptr + s0 + offs_s, mask=mask_s, other=float("-inf")) - m_all)
        o = tl.load(PART_O + b * stride_pb + h * stride_ph + (s0 + offs_s)[:, None] * stride_ps + cols[None, :],
                    mask=mask_s[:, None] & mask_c[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        l += w
    l_all = tl.sum(l, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + cols, (acc / l_all).to(OUT.dtype.element_ty), mask=mask_c)
    if DUMP:  # the head's log-sum-exp over the whole context
        if tl.program_id(2) == 0:
            tl.store(LSE + b * stride_eb + h, m_all + tl.log(l_all))


def decode_partials_shape(batch: int, num_heads: int, max_splits: int, v_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 workspace buffers (partial outputs, partial log-sum-exps) of one decode."""
    return (batch, num_heads, max_splits, v_dim), (batch, num_heads, max_splits)


def decode_attention(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    k: torch.Tensor,
    k_rope: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_splits: int,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    page_size: int = 1,
    block_h: int = 16,
    block_n: int = 32,
    scores: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    combine_block_dv: int | None = None,
) -> torch.Tensor:
    """One query token per request against its cached KV -> out [B, H, Dv].

    q [B, H, Dk] (MLA: q_latent), q_rope [B, H, Dr] or None, k [S, Hkv, Dk] and k_rope [S, Hkv, Dr]
    (strided views of the pool are fine; MLA: the c_kv and k_pe column views of one latent buffer,
    Hkv = 1), v [S, Hkv, Dv], or None when the value is k itself (MLA). `table[rows[b]]` gives request
    b's slots (page_size 1: a req_to_token row) or pages (page_size > 1: a page-table row).
    `part_o`/`part_lse` are fp32 workspaces of at least `decode_partials_shape(...)`; `max_splits`
    must be the same number they were sized with. Nothing here reads a device value on the host, so
    the call can be captured in a CUDA graph.

    `scores` [B, H, >= max seq_len] and `lse` [B, H] (fp32, given together): also the scaled score of
    every position per head (positions past a request's length are not written) and each head's
    log-sum-exp, from which OmniKV's filter layers take their selection without scoring the keys again.

    `block_h`, `block_n`, `num_warps`, `num_stages`: the launch shape (the backend takes them from its
    `DecodePlan`); every shape computes the same numbers up to fp32 summation order. `combine_block_dv`: the
    output columns of a combine program (None: COMBINE_BLOCK_DV compiled, the whole row interpreted).
    """
    q, q_rope, k, k_rope, v = (_unit(t) for t in (q, q_rope, k, k_rope, v))
    if out.stride(-1) != 1:
        raise ValueError("decode_attention: out needs a unit inner stride")
    bsz, num_heads, dk = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    dr = 0 if q_rope is None else q_rope.shape[-1]
    dv = out.shape[-1]
    v_from_k = v is None
    if v_from_k and dv != dk:
        raise ValueError("v=None (value = key) needs out width == key width")
    block_h = min(block_h, _pow2(group))
    blocks_per_kv = triton.cdiv(group, block_h)
    qr = q_rope if q_rope is not None else q
    kr = k_rope if k_rope is not None else k
    vv = k if v is None else v
    dump = scores is not None
    if dump != (lse is not None):
        raise ValueError("decode_attention: scores and lse come together")
    if dump and (scores.stride(-1) != 1 or lse.stride(-1) != 1 or scores.dtype != torch.float32
                 or lse.dtype != torch.float32):
        raise ValueError("decode_attention: scores and lse must be fp32 with a unit inner stride")
    s_buf, e_buf = (scores, lse) if dump else (part_lse, part_lse)  # (never written without DUMP)
    grid = (bsz, num_kv_heads * blocks_per_kv, max_splits)
    _decode_split_kernel[grid](
        q, qr, k, kr, vv, table, rows, seq_lens, part_o, part_lse, s_buf, out, e_buf,
        q.stride(0), q.stride(1), qr.stride(0), qr.stride(1),
        k.stride(0), k.stride(1), kr.stride(0), kr.stride(1), vv.stride(0), vv.stride(1),
        table.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        s_buf.stride(0), s_buf.stride(1), out.stride(0), out.stride(1), e_buf.stride(0),
        sm_scale, max_splits,
        KV_GROUP=group, HEAD_BLOCKS_PER_KV=blocks_per_kv, DK=dk, DR=dr, DV=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DK=_pow2(dk), BLOCK_DR=_pow2(dr), BLOCK_DV=_pow2(dv),
        PAGE_SIZE=page_size, MIN_SPLIT=MIN_SPLIT_LEN, V_FROM_K=v_from_k,
        UPCAST=INTERPRETED, DOT_PRECISION=dot_precision(q.dtype), DUMP=dump,
        num_warps=num_warps, num_stages=num_stages,
    )
    if combine_block_dv is None:  # interpreted, one program per (request, head): a program costs far more
        combine_block_dv = _pow2(dv) if INTERPRETED else COMBINE_BLOCK_DV  # than its arithmetic there
    combine_dv = min(_pow2(dv), combine_block_dv)
    _decode_combine_kernel[(bsz, num_heads, triton.cdiv(dv, combine_dv))](
        part_o, part_lse, seq_lens, out, e_buf,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), e_buf.stride(0), max_splits,
        DV=dv, BLOCK_DV=combine_dv, BLOCK_S=COMBINE_BLOCK_S, BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_LEN, DUMP=dump,
        num_warps=4,
    )
    return out


@triton.jit
def _extend_kernel(
    Q, QR, K, KR, V, OUT, TABLE, ROWS, Q_START, PREFIX_LENS, EXTEND_LENS, KV_START,
    stride_qt, stride_qh, stride_qrt, stride_qrh,
    stride_ks, stride_kh, stride_krs, stride_krh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_t,
    sm_scale,
    KV_GROUP: tl.constexpr, DK: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, USE_TABLE: tl.constexpr, V_FROM_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    mblock = tl.program_id(1)
    h = tl.program_id(2)
    kv_head = h // KV_GROUP
    n_new = tl.load(EXTEND_LENS + b).to(tl.int32)
    if mblock * BLOCK_M < n_new:
        prefix = tl.load(PREFIX_LENS + b).to(tl.int32)
        q_start = tl.load(Q_START + b).to(tl.int64)
        offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_new
        q_pos = prefix + offs_m
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_dk[None, :],
                    mask=mask_m[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if DR > 0:
            offs_dr = tl.arange(0, BLOCK_DR)
            qr = tl.load(QR + (q_start + offs_m[:, None]) * stride_qrt + h * stride_qrh + offs_dr[None, :],
                         mask=mask_m[:, None] & (offs_dr[None, :] < DR), other=0.0)
            if UPCAST:
                qr = qr.to(tl.float32)
        if USE_TABLE:
            row = tl.load(ROWS + b).to(tl.int64)
        else:
            kv_start = tl.load(KV_START + b).to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        kv_end = tl.minimum(prefix + (mblock + 1) * BLOCK_M, prefix + n_new)  # causal: nothing past the last query
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            if USE_TABLE:
                slots = _kv_slots(TABLE, row, stride_t, offs_n, mask_n, PAGE_SIZE)
            else:
                slots = kv_start + (offs_n - prefix).to(tl.int64)  # packed new tokens (no prefix here)
            k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_dk[:, None],
                        mask=mask_n[None, :] & (offs_dk[:, None] < DK), other=0.0)
            k = k.to(q.dtype)  # a no-op unless the cache dtype differs (or the interpreter upcast q)
            qk = tl.dot(q, k, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            if DR > 0:
                kr = tl.load(KR + slots[None, :] * stride_krs + kv_head * stride_krh + offs_dr[:, None],
                             mask=mask_n[None, :] & (offs_dr[:, None] < DR), other=0.0)
                kr = kr.to(qr.dtype)
                qk += tl.dot(qr, kr, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk * sm_scale, float("-inf"))
            if V_FROM_K:
                v = tl.trans(k)
            else:
                v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                            mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
                v = v.to(q.dtype)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded query row sees nothing
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision=DOT_PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o_ptr = OUT + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :]
        tl.store(o_ptr, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=mask_m[:, None] & (offs_dv[None, :] < DV))


def extend_attention(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    k: torch.Tensor,
    k_rope: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    *,
    q_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    table: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    page_size: int = 1,
    block_m: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves -> out [T, H, Dv].

    q [T, H, Dk] packed (request b's tokens start at q_start[b]), q_rope [T, H, Dr] or None. With
    `table`/`rows`, k/k_rope/v are pool views [S, Hkv, ·] holding every position (prefix and new);
    otherwise they are packed [T, Hkv, ·] tensors of the new tokens (kv_start[b] = first row, no prefix).
    v=None means the value is k (MLA). Integer tensors are per request, on q's device.
    `block_m` (queries per program) defaults to 16 for MLA's 512-wide latent, whose fp32 accumulator
    of BLOCK_M x 512 would otherwise spill registers, and 32 for ordinary head widths.
    """
    q, q_rope, k, k_rope, v = (_unit(t) for t in (q, q_rope, k, k_rope, v))
    if out.stride(-1) != 1:
        raise ValueError("extend_attention: out needs a unit inner stride")
    total, num_heads, dk = q.shape
    bsz = int(extend_lens.shape[0])
    if total == 0 or bsz == 0:
        return out
    group = num_heads // k.shape[1]
    dr = 0 if q_rope is None else q_rope.shape[-1]
    dv = out.shape[-1]
    use_table = table is not None
    if not use_table and kv_start is None:
        raise ValueError("extend_attention needs either table+rows (pool) or kv_start (packed keys)")
    qr = q_rope if q_rope is not None else q
    kr = k_rope if k_rope is not None else k
    vv = k if v is None else v
    if block_m is None:
        block_m = 16 if max(dk, dv) > 256 else 32
    dummy = q_start
    grid = (bsz, triton.cdiv(max_extend_len, block_m), num_heads)
    _extend_kernel[grid](
        q, qr, k, kr, vv, out,
        table if use_table else dummy, rows if use_table else dummy, q_start, prefix_lens, extend_lens,
        kv_start if kv_start is not None else dummy,
        q.stride(0), q.stride(1), qr.stride(0), qr.stride(1),
        k.stride(0), k.stride(1), kr.stride(0), kr.stride(1), vv.stride(0), vv.stride(1),
        out.stride(0), out.stride(1), table.stride(0) if use_table else 0,
        sm_scale,
        KV_GROUP=group, DK=dk, DR=dr, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DK=_pow2(dk), BLOCK_DR=_pow2(dr), BLOCK_DV=_pow2(dv),
        PAGE_SIZE=page_size, USE_TABLE=use_table, V_FROM_K=v is None,
        UPCAST=INTERPRETED, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=8 if max(dk, dv) > 256 else 4, num_stages=1,
    )
    return out


@triton.jit
def _store_latent_kernel(
    C_KV, K_PE, BUF, LOC, stride_c, stride_p, stride_buf,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(LOC + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(C_KV + t * stride_c + offs_r, mask=offs_r < R)
    tl.store(BUF + slot * stride_buf + offs_r, c.to(BUF.dtype.element_ty), mask=offs_r < R)
    offs_p = tl.arange(0, BLOCK_P)
    p = tl.load(K_PE + t * stride_p + offs_p, mask=offs_p < P)
    tl.store(BUF + slot * stride_buf + R + offs_p, p.to(BUF.dtype.element_ty), mask=offs_p < P)


def store_latent(buf: torch.Tensor, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """buf[loc] = c_kv ‖ k_pe in one launch: c_kv [T, r], k_pe [T, P] into the [S, r + P] latent buffer."""
    total = int(loc.shape[0])
    if total == 0:
        return
    r, p = c_kv.shape[-1], k_pe.shape[-1]
    if buf.shape[-1] != r + p or buf.stride(-1) != 1 or c_kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError(f"store_latent: buffer width {buf.shape[-1]} != {r} + {p}, or a non-unit inner stride")
    _store_latent_kernel[(total,)](
        c_kv, k_pe, buf, loc, c_kv.stride(0), k_pe.stride(0), buf.stride(0),
        R=r, P=p, BLOCK_R=triton.next_power_of_2(r), BLOCK_P=triton.next_power_of_2(p),
    )


@triton.jit
def _store_rows_kernel(SRC, BUF, LOC, stride_s, stride_buf, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(LOC + t).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(SRC + t * stride_s + offs, mask=offs < ROW)
    tl.store(BUF + slot * stride_buf + offs, v.to(BUF.dtype.element_ty), mask=offs < ROW)


def store_rows(buf: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[loc] = rows in one launch (rows [T, ...] into the [S, ...] buffer, contiguous rows, cast to its
    dtype): how K and V reach an OmniKV context bank's host layer (pinned memory the GPU maps) inside a
    CUDA graph, where torch's indexing would copy to the host first."""
    total = int(loc.shape[0])
    if total == 0:
        return
    dst, src = buf.view(buf.shape[0], -1), rows.reshape(total, -1)
    if dst.shape[1] != src.shape[1] or dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError(f"store_rows: rows of {src.shape[1]} values into a buffer of {dst.shape[1]}, or a "
                         "non-unit inner stride")
    row = dst.shape[1]
    block = min(1024, triton.next_power_of_2(row))
    _store_rows_kernel[(total, triton.cdiv(row, block))](src, dst, loc, src.stride(0), dst.stride(0), ROW=row,
                                                           BLOCK=block)
