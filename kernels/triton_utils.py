"""What every Triton kernel module here shares: whether the kernels are interpreted, the device check,
and the dot precision."""

from __future__ import annotations

import torch
import triton

#: Whether `triton.jit` built the kernels for Triton's CPU interpreter (TRITON_INTERPRET=1 set before
#: Triton was imported), decided once at import like Triton itself does.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def check_device(device: torch.device, what: str, cpu_alternative: str) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors with the interpreter (tests)."""
    if device.type == "cuda" or (INTERPRETED and device.type == "cpu"):
        return
    raise RuntimeError(
        f"{what} needs a CUDA device (got tensors on {device}); use --device cuda, or {cpu_alternative} on a "
        "CPU (tests run the kernels on CPU with TRITON_INTERPRET=1 set before triton is imported)"
    )


def dot_precision(dtype: torch.dtype) -> str | None:
    """IEEE fp32 products for fp32 inputs (Triton would otherwise use TF32 on Ampere+, ~1e-3 off the
    torch reference); the default (native) for bf16/fp16."""
    return "ieee" if dtype == torch.float32 else None
