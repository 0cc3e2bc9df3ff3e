"""One integer-quantized weight (`models.loader.int_quant`'s formats) read from its parts: unpacked to the
integers its scales multiply, then dequantized or written as ggml blocks for the CPU's kernels.

`IntWeight.values` is `q - z` for every value: the code less its group's zero point, an integer of at most
9 bits. The weight is `scale * values` (exact in fp32 for fp16 and bf16 scales, as llama.cpp's converter and
compressed-tensors compute it). `block_type` picks the smallest ggml block type that holds it exactly, and
`blocks` writes it so: Q4_0 (`d * (q - 8)`) where every value lies in [-8, 7] (symmetric 4-bit schemes), Q5_0 (`d * (q - 16)`) in
[-16, 15] (4-bit with zero points: AWQ, asymmetric GPTQ), Q8_0 (`d * q`) in [-128, 127], each block's `d` its
group's scale, which must be an fp16 value. Anything else (groups that are not runs of whole 32-column
blocks, act-order GPTQ's permuted groups, scales fp16 cannot hold) is dequantized instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.loader.errors import CheckpointError
from models.loader.int_quant import IntScheme

BLOCK = 32
# AWQ packs the 8 columns of a word in this order: nibble i holds column AWQ_ORDER[i] (its column j sits in
# nibble AWQ_NIBBLE[j])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))
# block types by the range of values they hold exactly: (type, lowest, highest)
BLOCK_TYPES = ((GGMLQuantizationType.Q4_0, -8, 7), (GGMLQuantizationType.Q5_0, -16, 15),
               (GGMLQuantizationType.Q8_0, -128, 127))


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int16 codes, `32 // bits` a word along `dim`, the lowest bits first."""
    words = packed.to(torch.int32)
    if dim == 0:
        words = words.t()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1).to(torch.int16)
    return codes.t() if dim == 0 else codes


def awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """AWQ's unpacked columns (nibble order within each word) in column order."""
    rows, cols = codes.shape
    return codes.reshape(rows, cols // 8, 8)[:, :, list(AWQ_NIBBLE)].reshape(rows, cols)


@dataclass
class IntWeight:
    """A weight [out, in] as `scales[:, group of column] * values`. `columns`: each input column's group where
    the groups are not runs of `group_size` columns (act-order GPTQ); None where they are."""

    values: torch.Tensor  # int16 [out, in]
    scales: torch.Tensor  # [out, groups], as stored
    group_size: int  # columns a group (`in` for one a row)
    columns: torch.Tensor | None = None  # int64 [in]

    def group_of_columns(self) -> torch.Tensor:
        return column_groups(self.columns, self.values.shape[1], self.group_size)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self.scales.to(torch.float32).index_select(1, self.group_of_columns())
        return (scale * self.values.to(torch.float32)).to(dtype)

    def block_type(self) -> tuple[GGMLQuantizationType | None, str]:
        """The smallest block type holding these values exactly, or None and why none does."""
        cols = self.values.shape[1]
        if cols % BLOCK:
            return None, f"rows of {cols} values are no whole {BLOCK}-value blocks"
        if self.columns is not None:
            return None, "act-order groups are not runs of columns"
        if self.group_size % BLOCK:
            return None, f"groups of {self.group_size} columns are no whole {BLOCK}-value blocks"
        d = self.scales.to(torch.float16)
        if not bool(torch.isfinite(d).all()) or not torch.equal(d.to(self.scales.dtype), self.scales):
            return None, f"{str(self.scales.dtype).removeprefix('torch.')} scales that fp16 cannot hold"
        lo, hi = int(self.values.min()), int(self.values.max())
        qtype = next((t for t, low, high in BLOCK_TYPES if low <= lo and hi <= high), None)
        return qtype, "" if qtype else f"codes less zero points from {lo} to {hi}"

    def blocks(self, qtype: GGMLQuantizationType) -> np.ndarray:
        """The values as `qtype` blocks (one `block_type` allows for them): uint8 [out, row bytes]."""
        out, cols = self.values.shape
        nb = cols // BLOCK
        d = self.scales.to(torch.float16).index_select(1, torch.arange(nb) * BLOCK // self.group_size).contiguous()
        parts = [d.view(torch.uint8).reshape(out, nb, 2)]
        v = self.values.reshape(out, nb, BLOCK)
        if qtype is GGMLQuantizationType.Q8_0:
            parts.append(v.to(torch.int8).view(torch.uint8))
        else:
            u = (v + (8 if qtype is GGMLQuantizationType.Q4_0 else 16)).to(torch.uint8)
            if qtype is GGMLQuantizationType.Q5_0:  # each value's 5th bit: bit i of a little-endian uint32
                high = ((u >> 4) & 1).reshape(out, nb, 4, 8) << torch.arange(8, dtype=torch.uint8)
                parts.append(high.sum(-1, dtype=torch.uint8))
                u = u & 15
            parts.append(u[..., :16] | (u[..., 16:] << 4))  # byte j: element j low, element j + 16 high
        return torch.cat(parts, dim=-1).reshape(out, nb * GGML_QUANT_SIZES[qtype][1]).numpy()


def column_groups(columns: torch.Tensor | None, count: int, group_size: int) -> torch.Tensor:
    """Each of `count` input columns' group: `columns` as stored (act order), else runs of `group_size`."""
    return columns if columns is not None else torch.arange(count) // group_size


def widest(types: list[GGMLQuantizationType]) -> GGMLQuantizationType:
    """Of block types each holding a part of a weight, the one that holds every part."""
    order = [t for t, _, _ in BLOCK_TYPES]
    return max(types, key=order.index)


def _groups(g_idx: torch.Tensor | None, count: int, groups: int, group_size: int, source: str, name: str
            ) -> torch.Tensor | None:
    """A stored per-column group index, checked; None where it is the plain `column // group_size`."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    if bool(((g < 0) | (g >= groups)).any()):
        raise CheckpointError(source, f"tensor '{name}' names groups outside 0..{groups - 1}: the checkpoint is "
                                      "corrupt")
    if torch.equal(g, column_groups(None, count, group_size)):
        return None
    return g


def read_int_weight(scheme: IntScheme, parts: dict[str, torch.Tensor], shape: tuple[int, int], source: str,
                    names: dict[str, str]) -> IntWeight:
    """The weight of logical `shape` [out, in] from its parts (by role, shapes checked by the caller from
    the headers: `HFCheckpoint`)."""
    out, cols = shape
    group = scheme.group_size or cols
    scales = parts["scales"].reshape(1, 1).expand(out, 1) if scheme.per_tensor else parts["scales"]
    bad = int((~torch.isfinite(scales)).sum())
    if bad:
        raise CheckpointError(source, f"tensor '{names['scales']}' holds {bad} scale(s) that are not finite: the "
                                      "checkpoint is corrupt")
    if scheme.layout in ("gptq", "awq"):
        scales = scales.t()  # [groups, out] -> [out, groups]
        if scheme.layout == "gptq":
            codes = unpack(parts["codes"], scheme.bits, 0)  # [in, out]
            zeros = unpack(parts["zeros"], scheme.bits, 1)[:, :out]
        else:
            codes = awq_columns(unpack(parts["codes"], scheme.bits, 1))
            zeros = awq_columns(unpack(parts["zeros"], scheme.bits, 1))
        if scheme.zero_less_one:
            zeros = zeros + 1
        columns = _groups(parts.get("groups"), cols, scales.shape[1], group, source, names.get("groups", ""))
        values = (codes - zeros.index_select(0, column_groups(columns, cols, group))).t().contiguous()
        return IntWeight(values, scales.contiguous(), group, columns)
    if scheme.layout == "ct-packed":
        codes = unpack(parts["codes"], scheme.bits, 1)[:, :cols]
        zeros = (unpack(parts["zeros"], scheme.bits, 0)[:out] if "zeros" in parts
                 else torch.full((out, scales.shape[1]), 1 << (scheme.bits - 1), dtype=torch.int16))
    else:
        codes = parts["codes"].to(torch.int16)
        zeros = parts["zeros"].to(torch.int16) if "zeros" in parts else torch.zeros((out, 1), dtype=torch.int16)
    columns = _groups(parts.get("groups"), cols, scales.shape[1], group, source, names.get("groups", ""))
    values = codes - zeros.expand(out, scales.shape[1]).index_select(1, column_groups(columns, cols, group))
    return IntWeight(values, scales, group, columns)


__all__ = ["AWQ_ORDER", "IntWeight", "awq_columns", "read_int_weight", "unpack", "widest"]
