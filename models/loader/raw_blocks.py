"""`RawBlocks`: a GGUF tensor's bytes kept in ggml's block format, for expert backends that compute on
quantized blocks themselves (the `cpp` expert backend) instead of on dequantized floats.

What crosses the loader -> model boundary: `GGUFCheckpoint.tensors(raw_experts=True)` yields a
`RawBlocks` in place of the float tensor for the routed-expert tensors (``ffn_{gate,up,down}_exps``,
and gate/up halves of ``ffn_gate_up_exps``); everything else stays a float tensor. A `RawBlocks` has
the same `shape` (values, numpy order: ggml ``ne`` reversed) as the tensor it stands for, so the
model's strict shape checks apply unchanged, and indexing its leading dims (experts, rows) gives
the blocks of that part without copying: ggml stores rows whole, so row r of a matrix is bytes
``[r * row_bytes, (r + 1) * row_bytes)``. A backend that cannot use the format calls `dequantize()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.loader.errors import CheckpointError
from models.loader.gguf_quants import dequantize


@dataclass(frozen=True)
class RawBlocks:
    qtype: GGMLQuantizationType  # ggml type of every row
    shape: tuple[int, ...]  # values, numpy order; the last dim is the one split into blocks
    data: np.ndarray  # uint8 [*shape[:-1], row_bytes]; may be a read-only view of the mapped file
    source: str  # the file, for error messages
    name: str  # the GGUF tensor name (with the part taken, e.g. "ffn_up_exps.weight[3]"), for errors

    def __post_init__(self) -> None:
        expected = (*self.shape[:-1], self.row_bytes)
        if self.data.dtype != np.uint8 or tuple(self.data.shape) != expected:
            raise CheckpointError(
                self.source,
                f"tensor '{self.name}': {self.qtype.name} data has shape {tuple(self.data.shape)} "
                f"({self.data.dtype}), expected uint8 {expected}",
            )

    @classmethod
    def from_buffer(
        cls, buf: Any, offset: int, qtype: GGMLQuantizationType, shape: tuple[int, ...], source: str, name: str
    ) -> RawBlocks:
        """A zero-copy view of a tensor stored at `offset` in `buf` (bounds checked by numpy)."""
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise CheckpointError(source, f"tensor '{name}': row length of {shape} is not a whole number of "
                                          f"{qtype.name} blocks of {block}")
        row_bytes = shape[-1] // block * type_size
        count = math.prod(shape[:-1]) * row_bytes
        data = np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset).reshape(*shape[:-1], row_bytes)
        return cls(qtype, tuple(shape), data, source, name)

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * type_size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * self.row_bytes

    def __getitem__(self, index: int | slice | tuple[int | slice, ...]) -> RawBlocks:
        """Indexes the leading dims (never the blocked last one): `w[e]` is expert e, `w[:, :n]` rows."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) >= len(self.shape) or not all(isinstance(i, (int, slice)) for i in idx):
            raise IndexError(f"RawBlocks of shape {self.shape} takes int/slice indices over its leading dims only")
        data = self.data[idx]
        part = ", ".join(str(i) if isinstance(i, int) else f"{_s(i.start)}:{_s(i.stop)}" for i in idx)
        return RawBlocks(self.qtype, (*data.shape[:-1], self.shape[-1]), data, self.source, f"{self.name}[{part}]")

    def take_rows(self, order: list[int]) -> RawBlocks:
        """A copy whose row i is row order[i] of this matrix (ggml rows are whole blocks)."""
        if len(self.shape) != 2 or sorted(order) != list(range(self.shape[0])):
            raise ValueError(f"take_rows needs a permutation of the {self.shape[0]} rows of a matrix")
        return RawBlocks(self.qtype, self.shape, np.ascontiguousarray(self.data[order]), self.source, self.name)

    def to_tensor(self) -> torch.Tensor:
        """The blocks as a new contiguous, writable uint8 CPU tensor [*shape[:-1], row_bytes]."""
        return torch.from_numpy(np.array(self.data, dtype=np.uint8, order="C", copy=True))

    def dequantize(self) -> torch.Tensor:
        """float32 values [*shape], decoded exactly as the loader decodes every other tensor."""
        return dequantize(np.ascontiguousarray(self.data).reshape(-1), self.qtype, self.shape, self.source, self.name)


def _s(v: int | None) -> str:
    return "" if v is None else str(v)


__all__ = ["RawBlocks"]
