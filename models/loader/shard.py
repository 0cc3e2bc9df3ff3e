"""What one tensor-parallel rank reads of a checkpoint tensor, so that no rank holds the whole checkpoint.

Both checkpoint readers (`HFCheckpoint.tensors`, `GGUFCheckpoint.tensors`) take a `ShardFn`: called
with each tensor's HF name and full HF shape, it answers `None` (read the whole tensor), `SKIP` (this
rank does not need it: neither read nor yielded) or a `Shard` (read only these index ranges along one
dim, concatenated in order: e.g. a fused gate_up tensor's gate part and up part of this rank). Kept
free of torch: the shapes and ranges are plain ints.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Shard:
    """The part of a tensor (HF name, HF layout) one rank reads: these index ranges along `dim`, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]  # [start, stop) each, within the tensor's size along dim

    def __post_init__(self) -> None:
        # Normalized to ints and tuples (lists are accepted), so shards compare and hash by value.
        try:
            dim = operator.index(self.dim)
            ranges = tuple((operator.index(a), operator.index(b)) for a, b in self.ranges)
        except (TypeError, ValueError):
            raise ValueError(f"Shard needs an int dim and (start, stop) int pairs, got {self.dim!r}, {self.ranges!r}") from None
        if isinstance(self.dim, bool) or dim < 0:
            raise ValueError(f"Shard dim must be a non-negative int, got {self.dim!r}")
        if not ranges:
            raise ValueError("Shard needs at least one range")
        for a, b in ranges:
            if not 0 <= a < b:
                raise ValueError(f"Shard range [{a}, {b}) is empty or negative (need 0 <= start < stop)")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "ranges", ranges)

    @property
    def size(self) -> int:
        """The sharded tensor's size along `dim`."""
        return sum(b - a for a, b in self.ranges)


class SkipType(enum.Enum):
    SKIP = "skip"


SKIP = SkipType.SKIP  # the rank does not need this tensor at all: not read, not yielded

ShardFn = Callable[[str, tuple[int, ...]], Shard | None | Literal[SkipType.SKIP]]


def shard_shape(shape: tuple[int, ...], shard: Shard, name: str = "<tensor>") -> tuple[int, ...]:
    """`shape` with `shard.dim` cut to the shard's size; ValueError naming `name` if it does not fit."""
    shape = tuple(shape)
    if shard.dim >= len(shape):
        raise ValueError(f"tensor '{name}' of shape {list(shape)}: shard dim {shard.dim} does not exist")
    n = shape[shard.dim]
    for a, b in shard.ranges:
        if b > n:
            raise ValueError(
                f"tensor '{name}' of shape {list(shape)}: shard range [{a}, {b}) on dim {shard.dim} "
                f"is outside its size {n}"
            )
    return (*shape[: shard.dim], shard.size, *shape[shard.dim + 1 :])


def resolve(fn: ShardFn | None, name: str, shape: tuple[int, ...]) -> Shard | None | Literal[SkipType.SKIP]:
    """What to read of tensor `name` (full HF `shape`), checked: `fn`'s answer, with a shard covering
    the whole tensor in order turned into None (so readers take their plain, whole-tensor path)."""
    if fn is None:
        return None
    s = fn(name, tuple(shape))
    if s is None or s is SKIP:
        return s
    if not isinstance(s, Shard):
        raise TypeError(f"tensor '{name}': shard function returned {s!r} (expected a Shard, None or SKIP)")
    shard_shape(shape, s, name)
    return None if s.ranges == ((0, shape[s.dim]),) else s


__all__ = ["SKIP", "Shard", "ShardFn", "SkipType", "resolve", "shard_shape"]
