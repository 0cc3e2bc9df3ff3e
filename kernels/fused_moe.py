"""Fused MoE for routed experts on the GPU (`--expert-backend triton`), the vLLM/SGLang scheme.

1. `moe_align_block_size` sorts the T*K (token, slot) pairs by expert and pads every expert's run
   to a multiple of BLOCK_M, so each block of BLOCK_M sorted entries belongs to one expert (one Triton
   program for decode-sized inputs, torch ops above).
2. `_fused_moe_kernel`, a grouped GEMM: one program per (block, column tile) loads the block's rows
   of A (gathered through the sorted flat indices) and only its expert's slice of the stacked
   weights B [E, N, Kdim]. Experts without tokens own no block, so their weights are never read.
3. gate_up GEMM -> `triton_layer_ops.silu_mul` -> down GEMM (times the routing weight) -> `moe_sum` over K.

Everything has sizes fixed by (T, K, E, block sizes): no host sync, no data-dependent shapes, so a
CUDA graph can capture `fused_experts`. The price is a grid sized for the worst case; programs for
blocks past `num_tokens_post_padded` return at once.

Expert ids must lie in [0, E); they are not checked (that would need a host sync).

On a CPU the kernels run only under Triton's interpreter, which is chosen when this module is
imported: set TRITON_INTERPRET=1 before the first import of triton.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from kernels import triton_utils
from kernels.triton_layer_ops import silu_mul
from kernels.triton_utils import INTERPRETED, cast_out, dot_precision

log = logging.getLogger(__name__)


#: Pairs (T*K) up to which `moe_align_block_size` is one Triton program (decode batches); above, where a
#: single program's loops would take longer than torch's kernels, torch ops.
ALIGN_KERNEL_MAX_PAIRS = 4096
_ALIGN_KERNEL_REFUSED: set[int] = set()  # expert counts whose alignment program failed to build (torch ops then)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_token_ids [max_padded] int32, expert_ids [max_blocks] int32,
    num_tokens_post_padded [1] int32).

    `sorted_token_ids` lists flat indices t*K + k grouped by expert (ascending expert, and in flat
    order within one expert), each expert's run padded with T*K to a multiple of `block_m`; the
    tail past `num_tokens_post_padded` is T*K too. `expert_ids[b]` is the expert of block b, -1 for
    blocks past the used ones. max_padded = T*K + min(E, T*K) * (block_m - 1): at most min(E, T*K)
    experts get tokens, each wasting at most block_m - 1 pad entries.

    Up to ALIGN_KERNEL_MAX_PAIRS pairs one Triton program (`_moe_align_kernel`) computes it; as ~22 torch
    ops it was ~22 kernels in every MoE layer of a decode step (~570 of a DeepSeek-V2-Lite step), each a
    launch's worth of time. Above, torch ops (`_moe_align_torch`).
    """
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    max_padded = numel + min(num_experts, numel) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    if 0 < numel <= ALIGN_KERNEL_MAX_PAIRS and num_experts not in _ALIGN_KERNEL_REFUSED:
        device = topk_ids.device
        out = (torch.empty(max_padded, dtype=torch.int32, device=device),
               torch.empty(max_blocks, dtype=torch.int32, device=device), torch.empty(1, dtype=torch.int32, device=device))
        try:
            _moe_align_kernel[(1,)](
                flat.contiguous(), *out, numel, max_padded, max_blocks,
                E=num_experts, E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=64, num_warps=8,
            )
            return out
        except (CompilationError, OutOfResources):  # this Triton or device cannot build it: torch ops, said once
            log.warning("the MoE alignment kernel does not build for %d experts here; its torch ops run instead",
                        num_experts, exc_info=True)
            _ALIGN_KERNEL_REFUSED.add(num_experts)
    return _moe_align_torch(flat.long(), num_experts, block_m, max_padded, max_blocks)


@triton.jit
def _moe_align_kernel(IDS, SORTED, EXPERT_IDS, POST, numel, max_padded, max_blocks,
                      E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """`moe_align_block_size` in one program, in three passes over the pairs in chunks: the pairs per expert,
    each pair's place (its expert's run start + the pairs of that expert before it), then the pads and the
    blocks' experts. Everything it reads back is in registers (one-hot sums stand for indexing), and every
    store goes to a place no other store of the program writes: no ordering between its threads is needed."""
    experts = tl.arange(0, E_POW2)
    i = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        ids = tl.load(IDS + start + i, mask=start + i < numel, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_start = tl.sum(tl.where(experts[None, :] < experts[:, None], padded[None, :], 0), axis=1)  # [e]: runs before e
    run_end = run_start + padded
    total = tl.sum(padded, axis=0)
    tl.store(POST, total)

    earlier = i[None, :] < i[:, None]  # [i, j]: pair j of the chunk comes before pair i
    seen = tl.zeros([E_POW2], dtype=tl.int32)  # pairs of each expert in the chunks before
    for start in range(0, numel, CHUNK):
        offs = start + i
        ids = tl.load(IDS + offs, mask=offs < numel, other=-1)
        onehot = ids[:, None] == experts[None, :]
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        rank += tl.sum(tl.where(onehot, seen[None, :], 0), axis=1)
        place = tl.sum(tl.where(onehot, run_start[None, :], 0), axis=1) + rank
        tl.store(SORTED + place, offs.to(tl.int32), mask=offs < numel)
        seen += tl.sum(onehot.to(tl.int32), axis=0)

    # a position's expert: how many runs end at or before it (empty runs included; past the last run, E or more)
    for start in range(0, max_padded, CHUNK):
        p = start + i
        owner = tl.sum((run_end[None, :] <= p[:, None]).to(tl.int32), axis=1)
        onehot = owner[:, None] == experts[None, :]
        taken = tl.sum(tl.where(onehot, counts[None, :], 0), axis=1)
        offset = p - tl.sum(tl.where(onehot, run_start[None, :], 0), axis=1)
        pad = (p >= total) | (offset >= taken)
        tl.store(SORTED + p, tl.full([CHUNK], 0, tl.int32) + numel, mask=(p < max_padded) & pad)
    for start in range(0, max_blocks, CHUNK):
        b = start + i
        owner = tl.sum((run_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(EXPERT_IDS + b, tl.where(owner < E, owner, -1), mask=b < max_blocks)


def _moe_align_torch(flat: torch.Tensor, num_experts: int, block_m: int, max_padded: int,
                     max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` as torch device ops (flat: int64 expert ids)."""
    device = flat.device
    numel = flat.numel()

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(numel, device=device) - start[sorted_experts]  # position inside its expert's run
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, padded_start[sorted_experts] + rank, order.to(torch.int32))

    block_start = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)  # first e whose run ends past it
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


#: The routing methods `route_experts` knows, as the kernel's METHOD: DeepSeek's `topk_method` names.
ROUTING_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _route_kernel(
    LOGITS, BIAS, WEIGHTS, IDS, T, E, stride_l, scale,
    K: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """BLOCK_T rows of router logits -> their top-K expert ids and weights (`route_experts`). Each top-k is
    K passes of an argmax over the row in registers; a chosen expert's choice becomes -inf, below every
    other expert's, so the K ids are distinct."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    row_in = rows < T
    valid = e < E
    mask = row_in[:, None] & valid[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(LOGITS + rows[:, None] * stride_l + e[None, :], mask=mask, other=0.0).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(valid[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    choice = s
    if HAS_BIAS:
        choice += tl.load(BIAS + e, mask=valid, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(valid[None, :], choice, float("-inf"))
    if METHOD != 0 and N_GROUP > 1:
        # rank the groups (V2: by their best expert; V3: by the sum of their best two), keep TOPK_GROUP
        group = e // GROUP_SIZE
        g = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for i in tl.static_range(N_GROUP):
            member = ((group == i) & valid)[None, :]
            v = tl.where(member, choice, float("-inf"))
            best = tl.max(v, axis=1)
            if METHOD == 2 and GROUP_SIZE > 1:
                first = tl.argmax(v, axis=1)
                best += tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), v), axis=1)
            group_score = tl.where(g[None, :] == i, best[:, None], group_score)
        kept_group = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            hit = g[None, :] == tl.argmax(group_score, axis=1)[:, None]
            kept_group = tl.where(hit, 1, kept_group)
            group_score = tl.where(hit, float("-inf"), group_score)
        kept = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for i in tl.static_range(N_GROUP):
            group_kept = tl.sum(tl.where(g[None, :] == i, kept_group, 0), axis=1)
            kept = tl.where((group == i)[None, :] & (group_kept > 0)[:, None], 1, kept)
        # the reference's fill (V2: 0; V3: -inf, here the lowest finite value so that a chosen expert's -inf
        # stays below it)
        fill = -3.4028234663852886e38 if METHOD == 2 else 0.0
        choice = tl.where(valid[None, :] & (kept == 0), fill, choice)
    k = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int64)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = e[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)  # the unbiased score (V3), the choice itself otherwise
        weights = tl.where(k[None, :] == j, w[:, None], weights)
        ids = tl.where(k[None, :] == j, best.to(tl.int64)[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    out_mask = row_in[:, None] & (k[None, :] < K)
    tl.store(WEIGHTS + rows[:, None] * K + k[None, :], weights * scale, mask=out_mask)
    tl.store(IDS + rows[:, None] * K + k[None, :], ids, mask=out_mask)


def route_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    normalize: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router selection as one kernel: router_logits [T, E] fp32 -> (weights [T, K] fp32, ids
    [T, K] int64), the math of `models.moe_routing.select_experts` (which documents the methods): scores by
    softmax or sigmoid; V2's groups kept by their best score, V3's by the sum of their best two biased
    scores; the top-k; V3's weights the unbiased scores; renormalised over the k when `normalize`; times
    `scale`. The ids come best first (the reference's order is unspecified).

    Why: as torch ops the selection is 3 ops a MoE layer (V2-Lite; 4 kernels, topk being two) to 16 (V3's
    groups), each a launch's worth of time in a decode step. Rounding: the softmax's sum is reduced in another order (an
    ulp of fp32), which can swap two experts whose scores are that close; a tie between two experts (or
    groups) goes to the lower index."""
    triton_utils.check_device(router_logits.device, "the Triton MoE router", "the torch forward")
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"route_experts: want fp32 router logits [T, E], got {tuple(router_logits.shape)} "
                         f"{router_logits.dtype}")
    t, e = router_logits.shape
    if scoring not in ("softmax", "sigmoid") or method not in ROUTING_METHODS:
        raise ValueError(f"route_experts: scoring {scoring!r} / method {method!r} unknown (softmax or sigmoid; "
                         f"{', '.join(ROUTING_METHODS)})")
    grouped = method != "greedy" and n_group > 1
    if (not 0 < top_k <= e or n_group < 1 or e % n_group or not 0 < topk_group <= n_group
            or (grouped and top_k > topk_group * (e // n_group))):
        raise ValueError(f"route_experts: top_k={top_k} does not fit {e} experts in {n_group} groups, "
                         f"{topk_group} kept")
    if correction_bias is not None and correction_bias.shape != (e,):
        raise ValueError(f"route_experts: correction bias {tuple(correction_bias.shape)} for {e} experts")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(triton.next_power_of_2(t), (1 << 14) // block_e)) if INTERPRETED else 1
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids, t, e, logits.stride(0),
        float(scale), K=top_k, SIGMOID=scoring == "sigmoid", METHOD=ROUTING_METHODS[method],
        HAS_BIAS=correction_bias is not None, NORMALIZE=normalize, N_GROUP=n_group if grouped else 1,
        GROUP_SIZE=e // n_group, TOPK_GROUP=topk_group, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_G=triton.next_power_of_2(n_group), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 128 else 2,
    )
    return weights, ids


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_padded, num_valid,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,  # flat index // A_ROW_DIV picks A's row: top_k for hidden rows, 1 for [T*K, .]
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,  # work around the interpreter: 16-bit tl.dot is wrong there, bf16 casts truncate
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[f, :] = A[f // A_ROW_DIV, :] @ B[expert(f)].T (times topk_weights[f]) for the block's flat
    indices f, accumulated in fp32 and stored in C's dtype."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Groups of GROUP_M row blocks walk the column tiles together: neighbouring blocks mostly share
    # an expert, so its weight tiles are reused from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    # Used blocks end at num_tokens_post_padded (a multiple of BLOCK_M, <= len(sorted_token_ids)): no mask.
    offs_sorted = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    flat_idx = tl.load(sorted_token_ids_ptr + offs_sorted).to(tl.int64)
    row_mask = flat_idx < num_valid  # pad entries hold num_valid
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped columns are computed, never stored
    a_ptrs = a_ptr + (flat_idx[:, None] // A_ROW_DIV) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + flat_idx, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + flat_idx[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, cast_out(acc, c_ptr.dtype.element_ty, INTERPRET), mask=row_mask[:, None] & (offs_cn[None, :] < N))


@triton.jit
def _moe_sum_kernel(X, OUT, T, H, stride_xt, stride_xk, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """OUT[t] = sum over k of X[t, k] for BLOCK_T tokens x BLOCK_H columns: fp32 sums in slot order, one
    rounding."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    rows = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(X + rows[:, None] * stride_xt + k * stride_xk + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * stride_ot + cols[None, :], cast_out(acc, OUT.dtype.element_ty, INTERPRET), mask=mask)


def moe_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = x [T, K, H] summed over K (unit column strides), as torch.sum does: in fp32, rounded once.
    One small kernel where torch's reduction took ~5 us a MoE layer in an H200 profile of a decode step."""
    t, k, h = x.shape
    if out.shape != (t, h) or out.dtype != x.dtype or (h > 1 and (x.stride(2) != 1 or out.stride(1) != 1)):
        raise ValueError(f"moe_sum: x {tuple(x.shape)} {x.dtype} and out {tuple(out.shape)} {out.dtype} do not fit")
    if t == 0 or h == 0:
        return out
    block_h = min(triton.next_power_of_2(h), 1024)
    block_t = max(1, min(triton.next_power_of_2(t), (1 << 15) // block_h)) if INTERPRETED else 1
    _moe_sum_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        x, out, t, h, x.stride(0), x.stride(1), out.stride(0),
        TOP_K=k, BLOCK_T=block_t, BLOCK_H=block_h, INTERPRET=INTERPRETED, num_warps=4,
    )
    return out


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def block_config(num_tokens: int, top_k: int, num_experts: int) -> BlockConfig:
    """Tile sizes from the mean number of tokens per expert, m = ceil(T*K / E).

    Decode (m <= 16): BLOCK_M = 16, the smallest `tl.dot` tile, so few pad rows are computed; the
    GEMMs are bound by reading the weights, so long BLOCK_K rows and narrow BLOCK_N tiles give many
    programs streaming contiguous weight rows. Prefill: BLOCK_M grows with m (32, 64, 128) so each
    weight tile loaded serves more rows. Starting points in line with vLLM's defaults, not yet tuned
    on a GPU.
    """
    m = triton.cdiv(num_tokens * top_k, num_experts)
    if m <= 16:
        return BlockConfig(16, 64, 128, 1, 4, 4)
    if m <= 64:
        return BlockConfig(32, 64, 128, 8, 4, 4)
    if m <= 256:
        return BlockConfig(64, 128, 64, 8, 4, 3)
    return BlockConfig(128, 128, 64, 8, 8, 3)


def check_device(device: torch.device) -> None:
    """The kernels need CUDA, or CPU tensors with the interpreter chosen at import."""
    triton_utils.check_device(device, "the triton expert backend", "--expert-backend torch/cpp")


def _grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_row_div: int, cfg: BlockConfig,
) -> None:
    """c [T*K, N] <- grouped GEMM of a's rows with the experts' b [E, N, Kdim] (see the kernel)."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = align
    n, kdim = b.shape[1], b.shape[2]
    grid = (triton.cdiv(sorted_token_ids.numel(), cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fused_moe_kernel[grid](
        a, b, c, topk_weights if topk_weights is not None else c, sorted_token_ids, expert_ids,
        num_tokens_post_padded, n, kdim, sorted_token_ids.numel(), c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype), INTERPRET=INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) -> [T, H] in hidden's dtype.

    hidden [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, K]
    (fp32); topk_ids [T, K] int in [0, E). Weights in hidden's dtype. `out` [T, H], if given, gets
    the result (and is returned). fp32 inputs multiply in IEEE fp32 (no TF32), like torch's default.
    """
    check_device(hidden.device)
    t, h = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if w13.shape[2] != h or w2.shape != (num_experts, h, inter) or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_experts: shapes do not fit: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)} "
            f"(want [E, 2I, H]), w2 {tuple(w2.shape)} (want [E, H, I]), topk_weights "
            f"{tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}"
        )
    if out is None:
        out = torch.empty_like(hidden)
    if t == 0:
        return out

    cfg = block_config(t, top_k, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()

    gate_up = torch.empty(t * top_k, two_i, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, None, align, top_k, cfg)
    act = silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    down = torch.empty(t * top_k, h, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, down, weights, align, 1, cfg)
    return moe_sum(down.view(t, top_k, h), out)


__all__ = ["BlockConfig", "INTERPRETED", "ROUTING_METHODS", "block_config", "check_device", "fused_experts",
           "moe_align_block_size", "moe_sum", "route_experts"]
