"""One MoE layer's routed-expert weights packed in a `cpp_experts.MoE` operator, and the choice of
their format.

Format, chosen per layer from its first expert whose three weights have all arrived:
- float tensors (HF checkpoints; GGUF F32/F16/BF16 blocks) -> bf16;
- GGUF blocks of a type the operator computes on (`cpp_experts.FORMATS`: Q8_0, Q4_0) -> kept
  quantized, the file's bytes as they are;
- other GGUF block types (Q4_1, Q5_K, Q6_K, ...), or an expert whose gate/up/down types differ
  (llama.cpp's mixed "_M" files) -> dequantized to bf16 with one logged warning per layer.
  Chosen over an error so every file the loader reads still serves; the warning names the tensor.
Each expert's weights are held until its three are present (GGUF blocks are views of the mapped
file, so that costs nothing), then packed; `finalize` checks that every expert arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from models.loader.raw_blocks import RawBlocks

logger = logging.getLogger(__name__)
KINDS = ("gate_proj", "up_proj", "down_proj")


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


class CpuExpertWeights:
    """The packed weights of one layer's routed experts (no threads: a pool is bound to `op` later)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int) -> None:
        self._ext = import_cpp_experts()
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = (
            num_experts, hidden_size, intermediate_size, top_k)
        self.format: str | None = None  # set by the first complete expert
        self._op: Any = None  # cpp_experts.MoE, made with the format
        self._pending: dict[int, dict[str, torch.Tensor | RawBlocks]] = {}  # expert -> kinds so far
        self._loaded: set[int] = set()
        self._warned = False

    @property
    def op(self) -> Any:
        """The `cpp_experts.MoE` operator holding the weights."""
        if self._op is None:
            raise RuntimeError("cpp experts used before their weights were loaded")
        return self._op

    @property
    def memory_bytes(self) -> int:
        """Bytes of packed weights (0 before loading)."""
        return 0 if self._op is None else int(self._op.memory_bytes)

    def load(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        if not isinstance(weight, RawBlocks):
            weight = weight.detach().to("cpu", torch.bfloat16).contiguous()
        parts = self._pending.setdefault(expert_id, {})
        parts[kind] = weight
        if len(parts) == len(KINDS):
            self._pack(expert_id, parts)
            del self._pending[expert_id]
            self._loaded.add(expert_id)

    def finalize(self) -> None:
        missing = sorted(set(range(self.num_experts)) - self._loaded)
        if missing:
            raise RuntimeError(f"cpp experts: expert(s) {missing[:5]} did not get all of gate, up and down")
        self.op.finalize()

    def _quantized_formats(self) -> set[str]:
        """The block formats the operator computes on, named like ggml's types in lower case."""
        return {f for f in self._ext.FORMATS if f != "bf16"}

    def _pack(self, expert_id: int, parts: dict[str, torch.Tensor | RawBlocks]) -> None:
        quantized = self._quantized_formats()
        formats = {
            w.qtype.name.lower() if isinstance(w, RawBlocks) and w.qtype.name.lower() in quantized else "bf16"
            for w in parts.values()
        }
        fmt = formats.pop() if len(formats) == 1 else "bf16"
        if self._op is None:
            self.format = fmt
            self._op = self._ext.MoE(self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
                                     weight_format=fmt)
        elif fmt != self.format and self.format != "bf16":
            raise ValueError(f"expert {expert_id} has {fmt} weights but this layer's earlier experts are "
                             f"{self.format} (the cpp backend keeps one format per layer)")
        if self.format == "bf16":
            self._warn_dequantized(parts.values())
            g, u, d = (w.dequantize().to(torch.bfloat16) if isinstance(w, RawBlocks) else w
                       for w in (parts[k] for k in KINDS))
        else:
            g, u, d = (parts[k].to_tensor() for k in KINDS)  # type: ignore[union-attr]
        self._op.load_expert(expert_id, g, u, d)

    def _warn_dequantized(self, weights: Iterable[torch.Tensor | RawBlocks]) -> None:
        blocks = [w for w in weights if isinstance(w, RawBlocks) and w.qtype.name not in ("F32", "F16", "BF16")]
        if blocks and not self._warned:
            self._warned = True
            types = ", ".join(sorted({w.qtype.name for w in blocks}))
            logger.warning(
                "cpp expert backend: %s (%s) and its layer's other experts are dequantized to bf16: the pool "
                "keeps only %s quantized (and needs one type for gate, up and down)",
                blocks[0].name, types, ", ".join(sorted(f.upper() for f in self._quantized_formats())),
            )
