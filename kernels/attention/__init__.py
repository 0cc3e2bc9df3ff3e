"""Attention backends. `create_attention_backend(name, ...)` imports a backend only when chosen."""

from __future__ import annotations

from typing import Any

from kernels.attention.base import AttentionBackend, AttentionLayer

BACKENDS = ("torch", "triton")


def create_attention_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Builds the named backend. Unknown names get an error listing the known ones."""
    if name == "torch":
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        from kernels.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")


__all__ = ["AttentionBackend", "AttentionLayer", "BACKENDS", "create_attention_backend"]
