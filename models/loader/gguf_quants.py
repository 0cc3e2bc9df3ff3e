"""Dequantization of GGUF tensor data (ggml block formats) to float32 torch tensors.

A quantized row is a run of fixed-size blocks; each block stores `block_size` values in
`type_size` bytes (`gguf.GGML_QUANT_SIZES`). The layouts below follow ggml's `block_*` structs
(`ggml-common.h`, decoded in `ggml-quants.c`) and `gguf/quants.py`; all fields are
little-endian, `d`/`m`/`dmin` are IEEE fp16, element indices count within the block, and a
"nibble" pair byte holds element i in its low 4 bits and element i + n in its high 4 bits.

F32, F16, BF16 — plain arrays (block of 1 value in 4 / 2 / 2 bytes); BF16 is the top half of an
fp32, so widening is a 16-bit shift.

Q8_0 — 32 values in 34 bytes: `d`, then `qs[32]` int8. x[i] = d * qs[i].

Q4_0 — 32 values in 18 bytes: `d`, then `qs[16]` nibble pairs (byte j: low nibble is element j,
high nibble element j + 16). x = d * (q - 8).

Q4_1 — 32 values in 20 bytes: `d`, `m`, then `qs[16]` as in Q4_0. x = d * q + m.

Q5_0 — 32 values in 22 bytes: `d`, `qh[4]` (a uint32; bit i is the 5th bit of element i), then
`qs[16]` low 4 bits as in Q4_0. x = d * (q - 16).

Q5_1 — 32 values in 24 bytes: `d`, `m`, `qh[4]`, `qs[16]` as in Q5_0. x = d * q + m.

Q4_K — 256 values in 144 bytes: `d`, `dmin`, `scales[12]`, `qs[128]`. Eight sub-blocks of 32
values, each with a 6-bit scale `sc` and 6-bit min `mn` packed in `scales`: for s < 4,
sc = scales[s] & 63 and mn = scales[s + 4] & 63; for s >= 4, the low 4 bits come from
scales[s + 4] (low nibble for sc, high nibble for mn) and the top 2 bits from the top 2 bits of
scales[s - 4] (sc) and scales[s] (mn). `qs` is four groups of 32 bytes; group g holds sub-block
2g in its low nibbles and 2g + 1 in its high nibbles. x = (d * sc) * q - (dmin * mn).

Q5_K — 256 values in 176 bytes: `d`, `dmin`, `scales[12]` as in Q4_K, `qh[32]`, `qs[128]` as in
Q4_K; bit s of qh[j] is the 5th bit of element 32 * s + j. x = (d * sc) * q - (dmin * mn).

Q2_K — 256 values in 84 bytes: `scales[16]` (one byte per 16 values: low nibble the scale `sc`, high
nibble the min `mn`), `qs[64]`, `d`, `dmin`. `qs` is two halves of 32 bytes; bits 2k..2k+1 of byte j of
half h are element 128h + 32k + j. x = (d * sc) * q - (dmin * mn).

Q3_K — 256 values in 110 bytes: `hmask[32]`, `qs[64]` (2-bit values laid out as Q2_K's), `scales[12]`,
`d`. Bit k of hmask[j] is the high bit of element 32k + j, and a *clear* bit subtracts 4: q = low - 4 *
(1 - high), in [-4, 4). Sixteen 6-bit scales, less 32: scale i has its low 4 bits in the low nibble of
scales[i] (i < 8) or the high nibble of scales[i - 8], and its top 2 bits in bits 2(i // 4) of
scales[8 + i % 4]. x = (d * (sc - 32)) * q.

IQ4_NL — 32 values in 18 bytes: `d`, then `qs[16]` nibble pairs as in Q4_0, each nibble an index into
the 16 signed levels `IQ4_LEVELS`. x = d * level.

IQ4_XS — 256 values in 136 bytes: `d`, `scales_h` (a uint16: bits 2b..2b+1 are the top 2 bits of
sub-block b's scale), `scales_l[4]` (nibble b % 2 of byte b // 2: the low 4 bits), `qs[128]`: eight
sub-blocks of 32 values laid out as IQ4_NL's. x = (d * (sc - 32)) * level.

Q6_K — 256 values in 210 bytes: `ql[128]`, `qh[64]`, `scales[16]` int8 (one per 16 values), and
`d` last. Two halves of 128 values, each using 64 bytes of `ql` and 32 of `qh`: within a half,
ql[j] low nibble is element j and high nibble element 64 + j (j < 64), and bits 2k..2k+1 of
qh[j] are the top 2 bits of element 32 * k + j (j < 32). x = (d * scales[i // 16]) * (q - 32).

The arithmetic is done in float32 in the same order as `gguf.quants` (products, then the offset;
no fused multiply-add), so results are bit-identical to it; ggml's C code can differ by an ulp
where the compiler contracts `d * q - m` into an FMA. Large tensors are processed in chunks of
whole blocks (4 Mi values each), so temporaries stay under ~50 MiB whatever the tensor's size.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch

from models.loader.errors import CheckpointError
from models.loader.gguf_file import READ_TYPES

T = gguf.GGMLQuantizationType
QK_K = 256

# Values decoded per chunk; bounds temporary memory (up to ~12 bytes per value) for huge tensors.
_CHUNK_VALUES = 1 << 22


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, as float32 of shape [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].clone(memory_format=torch.contiguous_format).view(torch.float16).float()


# Bit unpacking works on 64-bit words (8 bytes at once, masks repeated per byte) and interleaves
# whole words: torch's byte-wise shifts with a broadcast shift tensor, and stacks of byte runs,
# are an order of magnitude slower on CPU than these contiguous int64 ops.
_LOW = {1: 0x0101010101010101, 2: 0x0303030303030303, 4: 0x0F0F0F0F0F0F0F0F}


def _planes(q: torch.Tensor, width: int) -> torch.Tensor:
    """[..., n] bytes (n % 4 == 0) -> [..., 8 // width, n]: plane k holds bits
    [width * k, width * (k + 1)) of every byte, shifted down to bit 0."""
    wide, mask = (torch.int64, _LOW[width]) if q.shape[-1] % 8 == 0 else (torch.int32, _LOW[width] >> 32)
    # A fresh, densely strided copy: a field slice of the blocks is strided (or, for a single block,
    # "contiguous" but starting mid-block), and reinterpreting bytes as words needs aligned rows.
    w = q.clone(memory_format=torch.contiguous_format).view(wide)
    return torch.stack([(w >> (width * k)) & mask for k in range(8 // width)], dim=-2).view(torch.uint8)


def _to_float(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write integer values `q` into `out` (same number of elements) as float32; return `out`."""
    return out.copy_(q.view(out.shape))


# Each decoder fills `out` [n_blocks, block_size] (float32) from `blocks` [n_blocks, type_size].


def _dec_f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.view(torch.uint8).copy_(blocks)


def _dec_f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def _dec_bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.bfloat16))


def _dec_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _to_float(blocks[:, 2:].view(torch.int8), out).mul_(_f16(blocks, 0))


def _dec_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _planes(blocks[:, 2:], 4).view(torch.int8) - 8
    _to_float(q, out).mul_(_f16(blocks, 0))


def _dec_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _to_float(_planes(blocks[:, 4:], 4), out).mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q5(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """5-bit values [n_blocks, 32] of Q5_0/Q5_1 blocks whose `qh` starts at byte `qh_at`."""
    n = blocks.shape[0]
    # qh is 32 bits, one per element: bit k of byte j belongs to element 8 * j + k.
    high = _planes(blocks[:, qh_at : qh_at + 4], 1).transpose(1, 2).reshape(n, 32)
    return _planes(blocks[:, qh_at + 4 :], 4).view(n, 32) | (high << 4)


def _dec_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _to_float(_q5(blocks, 2).view(torch.int8) - 16, out).mul_(_f16(blocks, 0))


def _dec_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _to_float(_q5(blocks, 4), out).mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block (d * sc, dmin * mn), each [n_blocks, 8, 1], of Q4_K/Q5_K blocks."""
    s = blocks[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return (_f16(blocks, 0) * sc).unsqueeze(-1), (_f16(blocks, 2) * mn).unsqueeze(-1)


def _dec_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    q = _planes(blocks[:, 16:].view(n, 4, 32), 4)  # [n, group, nibble, 32] = [n, sub-block, 32]
    _to_float(q, out.view(n, 8, 32)).mul_(scale).sub_(offset)


def _dec_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    q = _planes(blocks[:, 48:].view(n, 4, 32), 4).view(n, 8, 32) | (_planes(blocks[:, 16:48], 1) << 4)
    _to_float(q, out.view(n, 8, 32)).mul_(scale).sub_(offset)


def _dec_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    low = _planes(blocks[:, :128].view(n, 2, 64), 4)  # [n, half, nibble, 64] = [n, half, 4, 32]
    high = _planes(blocks[:, 128:192].view(n, 2, 32), 2)  # [n, half, 4, 32]
    q = (low.view(n, 2, 4, 32) | (high << 4)).view(torch.int8) - 32
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8)  # [n, 16]
    _to_float(q, out.view(n, 16, 16)).mul_(scale.unsqueeze(-1))


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """The 256 2-bit values [n, 16, 16] (sub-blocks of 16) of Q2_K/Q3_K's `qs[64]`."""
    return _planes(qs.reshape(qs.shape[0], 2, 32), 2).view(qs.shape[0], 16, 16)


def _dec_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    sc = blocks[:, :16].unsqueeze(-1)
    scale, offset = _f16(blocks, 80).unsqueeze(-1) * (sc & 15), _f16(blocks, 82).unsqueeze(-1) * (sc >> 4)
    _to_float(_two_bit(blocks[:, 16:80]), out.view(n, 16, 16)).mul_(scale).sub_(offset)


def _q3_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K's sixteen signed 6-bit scales [n, 16] as int8 (sc - 32)."""
    s = blocks[:, 96:108]
    low = torch.cat((s[:, :8] & 15, s[:, :8] >> 4), dim=1)
    high = torch.cat([(s[:, 8:12] >> (2 * k)) & 3 for k in range(4)], dim=1)
    return (low | (high << 4)).view(torch.int8) - 32


def _q3_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K's 256 values [n, 16, 16] as int8 in [-4, 4)."""
    n = blocks.shape[0]
    high = _planes(blocks[:, :32], 1).view(n, 16, 16)  # [n, bit k, 32] = element 32k + j
    return _two_bit(blocks[:, 32:96]).view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)


def _dec_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale = (_f16(blocks, 108) * _q3_k_scales(blocks)).unsqueeze(-1)
    _to_float(_q3_k_values(blocks), out.view(n, 16, 16)).mul_(scale)


# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml's kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_TABLE = torch.tensor(IQ4_LEVELS, dtype=torch.int8)


def _iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """The levels [n, ..., 32] of nibble-pair bytes `qs` [n, ..., 16] laid out as Q4_0's."""
    idx = _planes(qs, 4).flatten(-2)
    return _IQ4_TABLE[idx.long()]


def _dec_iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _to_float(_iq4_levels(blocks[:, 2:]), out).mul_(_f16(blocks, 0))


def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's eight signed 6-bit sub-block scales [n, 8] as int8 (sc - 32)."""
    low = _planes(blocks[:, 4:8], 4).transpose(1, 2).reshape(-1, 8)  # byte b // 2, nibble b % 2
    h = blocks[:, 2].long() | (blocks[:, 3].long() << 8)
    high = torch.stack([(h >> (2 * b)) & 3 for b in range(8)], dim=1).to(torch.uint8)
    return (low | (high << 4)).view(torch.int8) - 32


def _dec_iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale = (_f16(blocks, 0) * _iq4_xs_scales(blocks)).unsqueeze(-1)
    levels = _iq4_levels(blocks[:, 8:].reshape(n, 8, 16))
    _to_float(levels, out.view(n, 8, 32)).mul_(scale)


_DECODERS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _dec_f32,
    T.F16: _dec_f16,
    T.BF16: _dec_bf16,
    T.Q8_0: _dec_q8_0,
    T.Q4_0: _dec_q4_0,
    T.Q4_1: _dec_q4_1,
    T.Q5_0: _dec_q5_0,
    T.Q5_1: _dec_q5_1,
    T.Q4_K: _dec_q4_k,
    T.Q5_K: _dec_q5_k,
    T.Q6_K: _dec_q6_k,
    T.Q2_K: _dec_q2_k,
    T.Q3_K: _dec_q3_k,
    T.IQ4_NL: _dec_iq4_nl,
    T.IQ4_XS: _dec_iq4_xs,
}

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_DECODERS)
assert SUPPORTED_TYPES == READ_TYPES, "gguf_file.READ_TYPES (a file's header check) must list every decoder here"


def _as_bytes(raw: np.ndarray | memoryview | bytes) -> np.ndarray:
    """`raw` as a flat uint8 array, without copying when it is already contiguous."""
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return np.frombuffer(raw, dtype=np.uint8)


def _validate(
    raw: np.ndarray | memoryview | bytes,
    qtype: gguf.GGMLQuantizationType | int,
    shape: Sequence[int],
    source: str,
    name: str,
) -> tuple[gguf.GGMLQuantizationType, tuple[int, ...], int, np.ndarray]:
    """Check type, shape and byte length before anything is allocated.

    Returns (type, dims, number of blocks, flat uint8 view of `raw`). Counts use Python ints
    (`math.prod`), so a hostile shape cannot wrap around int64 and slip past the length check.
    """
    where = f"tensor '{name}'"
    try:
        qtype = T(operator.index(qtype))
    except (ValueError, TypeError):
        raise CheckpointError(source, f"{where}: unknown ggml type {qtype!r}") from None
    if qtype not in _DECODERS:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise CheckpointError(source, f"{where}: type {qtype.name} is not supported (supported: {supported})")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]

    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise CheckpointError(source, f"{where}: shape {shape!r} is not a sequence of integers") from None
    if not dims or min(dims) < 0:
        raise CheckpointError(source, f"{where}: invalid shape {dims} (need at least one dim, none negative)")
    if dims[-1] % block_size:
        raise CheckpointError(
            source,
            f"{where}: last dimension {dims[-1]} of shape {dims} is not a multiple of "
            f"the {qtype.name} block size {block_size}",
        )
    n_blocks = math.prod(dims) // block_size
    data = _as_bytes(raw)
    if data.nbytes != n_blocks * type_size:
        raise CheckpointError(
            source,
            f"{where}: {qtype.name} data of shape {dims} needs {n_blocks * type_size} bytes "
            f"({n_blocks} blocks of {type_size}), got {data.nbytes}",
        )
    return qtype, dims, n_blocks, data


def dequantize(
    raw: np.ndarray | memoryview | bytes,
    qtype: gguf.GGMLQuantizationType | int,
    shape: Sequence[int],
    source: str = "<gguf>",
    name: str = "<tensor>",
) -> torch.Tensor:
    """Decode one GGUF tensor's data to a new contiguous float32 CPU tensor of `shape`.

    `raw` is the tensor's bytes (never written to); `shape` is the row-major shape, i.e. ggml's
    `ne` reversed, so its last dim is the one split into blocks. Raises `CheckpointError` naming
    `source` and `name` for an unsupported type, a last dim that is not a whole number of blocks,
    or a byte length that does not match the shape.
    """
    qtype, dims, n_blocks, data = _validate(raw, qtype, shape, source, name)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]

    decode = _DECODERS[qtype]
    out = torch.empty((n_blocks, block_size), dtype=torch.float32)
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        # np.array copies the slice: torch gets writable memory and `raw` is never aliased.
        blocks = torch.from_numpy(np.array(data[start * type_size : stop * type_size]))
        decode(blocks.view(stop - start, type_size), out[start:stop])
    return out.view(dims)
