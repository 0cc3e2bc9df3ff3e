"""How the models layer reaches the `cpp_experts` extension: importing it (only where a native operator
is used), and turning one weight — a float tensor or a GGUF tensor's `RawBlocks` — into a
`cpp_experts.QuantLinear` as the CPU weight mode says (`models.native` for dense layers,
`models.experts.cpu_weights` for routed experts)."""

from __future__ import annotations

import logging
from typing import Any

import torch

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


CPU_WEIGHT_DTYPES = ("file", "bf16", "float32")
_FLOAT_TYPES = ("F32", "F16", "BF16")
_warned_types: set[str] = set()


def _float_dtype(mode: str, source: str) -> torch.dtype:
    """The dtype a float weight is held in: `source` is its dtype in the file (f32, f16, bf16)."""
    if mode == "bf16":
        return torch.bfloat16
    if mode == "float32":
        return torch.float32
    return torch.bfloat16 if source == "bf16" else torch.float32


def make_operator(weight: torch.Tensor | RawBlocks, mode: str, what: str) -> Any:
    """A `cpp_experts.QuantLinear` holding `weight` ([out, in]) as `mode` says."""
    ext = import_cpp_experts()
    out_features, in_features = (int(d) for d in weight.shape)
    if isinstance(weight, RawBlocks):
        name = weight.qtype.name.lower()
        values = ext.LINEAR_BLOCKS.get(name, (0, 0))[0]
        if mode == "file" and name in ext.LINEAR_BLOCKS and in_features % values == 0:
            return ext.QuantLinear.from_gguf(weight.data, weight.qtype, out_features, in_features)
        if (mode == "file" and weight.qtype.name not in _FLOAT_TYPES and weight.qtype.name not in _warned_types
                and weight.qtype in SUPPORTED_TYPES):  # else decoding refuses it, with the error that says so
            _warned_types.add(weight.qtype.name)
            logger.warning("%s (%s): the CPU kernels do not compute on this block type%s; decoded to bf16 "
                           "(further %s weights too)", what, weight.qtype.name,
                           f" at {in_features} inputs" if name in ext.LINEAR_BLOCKS else "", weight.qtype.name)
        source = weight.qtype.name.lower() if weight.qtype.name in _FLOAT_TYPES else "bf16"
        return ext.QuantLinear.from_float(weight.dequantize(), dtype=_float_dtype(mode, source))
    source = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(weight.dtype, "f32")
    return ext.QuantLinear.from_float(weight, dtype=_float_dtype(mode, source))
