"""Which quantized checkpoint a config.json describes: `scheme_from_config` reads `quantization_config` and
hands it to the format's module (`fp8`: FP8 weights, DeepSeek's and compressed-tensors' `float-quantized`;
`int_quant`: GPTQ, AWQ, compressed-tensors' integer formats).
Torch-free: the server checks a config with it before it starts, and any other method is refused there,
before a tensor is read (its weights would only fail later, one tensor at a time, with no word of why)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from models.loader import fp8, int_quant
from models.loader.errors import CheckpointError
from models.loader.fp8 import BlockFP8
from models.loader.int_quant import IntScheme
from models.loader.jsonfile import read_json

logger = logging.getLogger(__name__)

METHODS = ("fp8", *int_quant.METHODS)


def scheme_from_config(config: dict[str, Any], source: Path) -> BlockFP8 | IntScheme | None:
    """The checkpoint's quantization scheme (None: not quantized), from config.json (`source`):
    `quantization_config`, or `compression_config` (compressed-tensors' older name, as vLLM reads it), or else
    a `quantize_config.json` beside it (older AutoGPTQ files keep their GPTQ settings there alone)."""
    qc = config.get("quantization_config")
    key = "quantization_config"
    if qc is None and config.get("compression_config") is not None:
        qc, key = config["compression_config"], "compression_config"
    if qc is None:
        beside = Path(source).parent / "quantize_config.json"
        if not beside.is_file():
            return None
        qc = read_json(beside)
        if isinstance(qc, dict):
            qc = {"quant_method": "gptq", **qc}
        source = beside
        logger.info("%s: the GPTQ settings are read from %s (config.json has no quantization_config)",
                    source.parent, beside.name)
    where = f"config key '{key}'"
    if not isinstance(qc, dict):
        raise CheckpointError(source, f"{where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return fp8.from_quant_config(qc, source)
    if method == "compressed-tensors":
        fmt, weights = int_quant.compressed_tensors_weights(qc, source)
        if fmt == "float-quantized":
            return fp8.from_compressed_tensors(weights, source)
    if method in int_quant.METHODS:
        return int_quant.from_quant_config(qc, source)
    raise CheckpointError(
        source, f"{where}: quant_method {method!r:.40} is not supported (read: {', '.join(METHODS)}): use the "
                "model's unquantized (bf16) safetensors, or a GGUF of it")


__all__ = ["METHODS", "scheme_from_config"]
