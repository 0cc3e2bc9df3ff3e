"""Which quantized checkpoint a config.json describes: `scheme_from_config` reads `quantization_config` and
hands it to the format's module (`fp8`: block-scaled FP8; `int_quant`: GPTQ, AWQ, compressed-tensors).
Torch-free: the server checks a config with it before it starts, and any other method is refused there,
before a tensor is read (its weights would only fail later, one tensor at a time, with no word of why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.loader import fp8, int_quant
from models.loader.errors import CheckpointError
from models.loader.fp8 import BlockFP8
from models.loader.int_quant import IntScheme

METHODS = ("fp8", *int_quant.METHODS)


def scheme_from_config(config: dict[str, Any], source: Path) -> BlockFP8 | IntScheme | None:
    """The checkpoint's quantization scheme (None: not quantized)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = "config key 'quantization_config'"
    if not isinstance(qc, dict):
        raise CheckpointError(source, f"{where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return fp8.from_quant_config(qc, source)
    if method in int_quant.METHODS:
        return int_quant.from_quant_config(qc, source)
    raise CheckpointError(
        source, f"{where}: quant_method {method!r:.40} is not supported (read: {', '.join(METHODS)}): use the "
                "model's unquantized (bf16) safetensors, or a GGUF of it")


__all__ = ["METHODS", "scheme_from_config"]
