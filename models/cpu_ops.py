"""How the models layer reaches the `cpp_experts` extension: importing it (only where a native operator
is used), and turning one weight — a float tensor or a GGUF tensor's `RawBlocks` — into a
`cpp_experts.QuantLinear` as the CPU weight mode says (`models.native` for dense layers,
`models.experts.cpu_weights` for routed experts)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from models.loader.gguf_quants import SUPPORTED_TYPES
from models.loader.raw_blocks import RawBlocks

logger = logging.getLogger(__name__)

def import_cpp_experts() -> Any:
    """The extension, imported only when the cpp backend is used."""
    try:
        import cpp_experts
    except ImportError as e:
        raise ImportError(
            f"--expert-backend cpp needs the cpp_experts extension, which does not import ({e}); "
            "build it with `pip install -e .` or use --expert-backend torch"
        ) from e
    return cpp_experts


CPU_WEIGHT_DTYPES = ("file", "bf16", "float32", "q8_0")
# modes that quantize float weights as they load (a file's quantized blocks stay as they are)
QUANTIZE_ON_LOAD = {"q8_0": GGMLQuantizationType.Q8_0}
_FLOAT_TYPES = ("F32", "F16", "BF16")
_warned_types: set[str] = set()


def keeps_blocks(mode: str) -> bool:
    """Whether a file's quantized blocks reach the kernels as stored under `mode` (else decoded)."""
    return mode == "file" or mode in QUANTIZE_ON_LOAD


def _float_dtype(mode: str, source: str) -> torch.dtype:
    """The dtype a float weight is held in: `source` is its dtype in the file (f32, f16, bf16)."""
    if mode == "bf16":
        return torch.bfloat16
    if mode == "float32":
        return torch.float32
    return torch.bfloat16 if source == "bf16" else torch.float32


def make_operator(weight: torch.Tensor | RawBlocks, mode: str, what: str) -> Any:
    """A `cpp_experts.QuantLinear` holding `weight` ([out, in]) as `mode` says. `q8_0` quantizes a float weight
    to Q8_0 blocks with the `gguf` package's quantizer (llama.cpp's converter's: one fp16 scale per 32 values,
    max |x| / 127), where its rows are whole blocks."""
    ext = import_cpp_experts()
    out_features, in_features = (int(d) for d in weight.shape)
    target = QUANTIZE_ON_LOAD.get(mode)
    if isinstance(weight, RawBlocks):
        name = weight.qtype.name.lower()
        values = ext.LINEAR_BLOCKS.get(name, (0, 0))[0]
        if target is not None and weight.qtype.name in _FLOAT_TYPES:
            weight = weight.dequantize()  # a float tensor, quantized below
        elif keeps_blocks(mode) and name in ext.LINEAR_BLOCKS and in_features % values == 0:
            return ext.QuantLinear.from_gguf(weight.data, weight.qtype, out_features, in_features)
        else:
            if (keeps_blocks(mode) and weight.qtype.name not in _FLOAT_TYPES and weight.qtype.name not in _warned_types
                    and weight.qtype in SUPPORTED_TYPES):  # else decoding refuses it, with the error that says so
                _warned_types.add(weight.qtype.name)
                logger.warning("%s (%s): the CPU kernels do not compute on this block type%s; decoded to bf16 "
                               "(further %s weights too)", what, weight.qtype.name,
                               f" at {in_features} inputs" if name in ext.LINEAR_BLOCKS else "", weight.qtype.name)
            source = weight.qtype.name.lower() if weight.qtype.name in _FLOAT_TYPES else "bf16"
            return ext.QuantLinear.from_float(weight.dequantize(), dtype=_float_dtype(mode, source))
    if target is not None and in_features % GGML_QUANT_SIZES[target][0] == 0:
        blocks = gguf_quantize(weight.detach().float().contiguous().numpy(), target)
        return ext.QuantLinear.from_gguf(blocks, target, out_features, in_features)
    source = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(weight.dtype, "f32")
    return ext.QuantLinear.from_float(weight, dtype=_float_dtype(mode, source))
