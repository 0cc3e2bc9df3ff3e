"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1/V3.1 as published, transformers' `FineGrainedFP8Config`).

Such a checkpoint stores each quantized linear weight `X.weight` as F8_E4M3 and beside it
`X.weight_scale_inv`: one scale per `weight_block_size` block (128x128 in DeepSeek's), the grid rounded
up, so a dimension that is not a multiple of the block (DeepSeek-V3's 576 rows of `kv_a_proj_with_mqa`)
has a last, partial block. The weight is `fp8 value * scale`. Embeddings, norms and routers stay bf16.
AutoFP8's checkpoints (Llama FP8s: the same `quant_method`) hold one `X.weight_scale` per weight instead,
and the static activation scales that mlaserve does not read (activations are not quantized).
llm-compressor's FP8 models (`quant_method: compressed-tensors`, format `float-quantized`: the "FP8-dynamic"
and "FP8_BLOCK" ones) hold `X.weight_scale` per tensor, per row ([rows, 1], strategy `channel`) or per
`block_structure` block (`from_compressed_tensors`).

mlaserve has no FP8 matrix kernel: the weights are dequantized while they are read
(`safetensors_loader.dequantize_fp8`), so a model holds them as an unquantized checkpoint would (in `--dtype`,
or as the CPU kernels' bf16). This module is torch-free: the server checks a config before it starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.loader.errors import CheckpointError

WEIGHT_DTYPE = "F8_E4M3"
# a weight `X.weight`'s scales: DeepSeek's block grid, or AutoFP8's / vLLM's one scale per tensor
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# what else an FP8 checkpoint may hold, for FP8 activations and KV cache: not read (activations run unquantized,
# as vLLM runs such a checkpoint on a GPU without FP8 math)
UNREAD_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")
# how a block's scale may be stored: float, or a power of two (`ue8m0`, DeepSeek-V4's and MXFP8's)
SCALE_DTYPES = frozenset({"F32", "BF16", "F16", "F8_E8M0"})
MAX_BLOCK = 1 << 16
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default, DeepSeek's


def weight_of(scale_name: str) -> str | None:
    """The weight a scale tensor's name belongs to (`X.weight_scale_inv` -> `X.weight`), or None."""
    for suffix in SCALE_SUFFIXES:
        if scale_name.endswith(suffix):
            return scale_name[: -len(suffix)] + ".weight"
    return None


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


@dataclass(frozen=True)
class BlockFP8:
    """`block`: (rows, columns) a scale covers, as config.json gives it; None where it gives none: then a
    weight has one scale (AutoFP8's) or a grid of `DEFAULT_BLOCK` blocks (transformers reads it so)."""

    block: tuple[int, int] | None

    def grids(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """The scale tensor shapes a weight of `shape` (rows, columns) may have: its block grid, one a row
        (compressed-tensors' per-channel FP8, vLLM's too), and with no block given one for the weight."""
        if self.block is not None:
            return [grid(shape, self.block), (shape[0], 1)]
        return [(1, 1), grid(shape, DEFAULT_BLOCK), (shape[0], 1)]

    def block_of(self, full: tuple[int, int], scales: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, columns) one scale of a scale tensor of shape `scales` covers: the whole weight of shape
        `full` for one scale, a row for one a row (per channel), else the block."""
        block = self.block or DEFAULT_BLOCK
        if math.prod(scales) == 1:
            return full
        if tuple(scales) != grid(full, block) and tuple(scales) == (full[0], 1):
            return (1, full[1])
        return block


def from_quant_config(qc: dict[str, Any], source: Path) -> BlockFP8:
    """The FP8 scheme of a `quantization_config` whose quant_method is 'fp8'."""
    where = "config key 'quantization_config'"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(source, f"{where}: fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(source, f"{where}: activation_scheme {scheme!r} is not one of 'dynamic', 'static'")
    block = qc.get("weight_block_size")
    if block is None:
        return BlockFP8(None)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        raise CheckpointError(source, f"{where}: weight_block_size must be two integers from 1 to {MAX_BLOCK} "
                                      f"(DeepSeek's is [128, 128]), got {block!r}")
    return BlockFP8((block[0], block[1]))


def from_compressed_tensors(weights: dict[str, Any], source: Path) -> BlockFP8:
    """The FP8 scheme of compressed-tensors' `float-quantized` format (llm-compressor's FP8 models): 8-bit
    float weights with one scale per tensor, per row (`channel`) or per `block_structure` block."""
    where = "config key 'quantization_config'"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise CheckpointError(source, f"{where}: float-quantized weights must be 8-bit floats, got "
                                      f"{weights.get('num_bits')!r:.20}-bit {weights.get('type')!r:.20}")
    if weights.get("dynamic", False):
        raise CheckpointError(source, f"{where}: dynamic weight quantization has no stored scales to read")
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        return BlockFP8(None)
    block = weights.get("block_structure")
    if (strategy != "block" or not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        raise CheckpointError(source, f"{where}: FP8 weight strategy {strategy!r:.20} is not supported (only "
                                      "'tensor', 'channel', and 'block' with a block_structure of two integers)")
    return BlockFP8((block[0], block[1]))


__all__ = ["BlockFP8", "grid", "SCALE_DTYPES", "SCALE_SUFFIXES", "UNREAD_SUFFIXES", "WEIGHT_DTYPE", "from_compressed_tensors",
           "from_quant_config", "weight_of"]
