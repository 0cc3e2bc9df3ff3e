"""`load_model`: a model name, HF directory or GGUF file -> a ready model, its config and tokenizer.

The model is built on the meta device (no memory, no random init), materialised empty on the target
device, then filled tensor by tensor from the checkpoint under a progress bar; strict name and shape
checks happen in `CausalLM.load_weights`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from models.base import CausalLM
from models.builtin import resolve_model_path
from models.config import ModelConfig, config_from_hf_dict
from models.loader.errors import CheckpointError
from models.experts import EXPERT_BACKENDS, CppExperts, ExpertBackend, WeightInput
from models.native import CPU_WEIGHT_DTYPES, NativeAbsorbed, NativeEmbedding, NativeLinear, use_native_weights
from models.parallel import current as current_layout
from models.registry import model_class

if TYPE_CHECKING:
    from models.loader.tokenizer import TokenizerBundle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: "TokenizerBundle | None"
    source: Path
    dtype: torch.dtype


def cpu_has_bf16() -> bool:
    """True when the CPU does bf16 math natively (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where the hardware does bf16 math (CUDA, AVX512-BF16/AMX), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def open_checkpoint(path: Path):
    """HFCheckpoint for a directory, GGUFCheckpoint for a file."""
    if path.is_dir():
        from models.loader.safetensors_loader import HFCheckpoint

        return HFCheckpoint(path)
    from models.loader.gguf_loader import GGUFCheckpoint

    return GGUFCheckpoint(path)


def load_model(
    model: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    expert_backend: str = "torch",
    cpu_weights: str | None = None,
    load_tokenizer: bool = True,
    progress: bool = True,
) -> LoadedModel:
    """`expert_backend` ('torch' | 'cpp' | 'triton') runs a MoE model's routed experts (other models ignore it);
    with `cpp` a GGUF's quantized experts reach the backend undecoded (`RawBlocks`).

    `cpu_weights` ('file' | 'bf16' | 'float32', see `models.native`): the dense weights go to the CPU's native
    operators instead of torch parameters, and routed experts to the `cpp` backend (bf16 unless 'file' keeps a
    GGUF's blocks); None keeps torch parameters in `dtype` (the reference path, and every GPU run).
    `dtype` then still sets the KV cache's default dtype and the norms' parameters.

    Under tensor parallelism (`models.parallel.configure`, before this call) the model holds this rank's
    parts of the weights and the checkpoint is read only where they are."""
    if expert_backend not in EXPERT_BACKENDS:
        raise ValueError(f"unknown expert backend {expert_backend!r} (available: {', '.join(EXPERT_BACKENDS)})")
    path = resolve_model_path(model)
    device = torch.device(device)
    if cpu_weights is not None:
        if cpu_weights not in CPU_WEIGHT_DTYPES:
            raise ValueError(f"unknown CPU weight dtype {cpu_weights!r} (choose {', '.join(CPU_WEIGHT_DTYPES)})")
        if device.type != "cpu":
            raise ValueError(f"native CPU weights need the CPU device, not {device}")
        if current_layout().parallel:
            raise ValueError("native CPU weights run one process's forward; tensor parallelism needs the torch forward")
        expert_backend = "cpp"
    torch_dtype = resolve_dtype(dtype, device)
    ckpt = open_checkpoint(path)
    config = config_from_hf_dict(ckpt.hf_config(), str(path / "config.json" if path.is_dir() else path))
    cls = model_class(config)
    with torch.device("meta"):
        net = cls(config, expert_backend=expert_backend)
        if cpu_weights is not None:
            use_native_weights(net, cpu_weights, torch_dtype)
            for m in net.modules():
                if isinstance(m, CppExperts):
                    m.weights.mode = cpu_weights
    net = net.to_empty(device=device).to(torch_dtype)
    for module in net.modules():
        if getattr(module, "keep_fp32", False):
            module.float()
    bar = tqdm(total=ckpt.num_tensors(), desc=f"Loading {path.name}", unit="tensor", disable=not progress, leave=False)
    raw_experts = not path.is_dir() and cpu_weights in (None, "file") and any(
        isinstance(m, ExpertBackend) and m.weight_input is WeightInput.GGUF_BLOCKS for m in net.modules())
    raw_names = frozenset(f"{n}.weight" for n, m in net.named_modules()
                          if isinstance(m, (NativeLinear, NativeEmbedding, NativeAbsorbed))
                          and m.weight_input is WeightInput.GGUF_BLOCKS)
    shard = net.shard_fn()  # under tensor parallelism: only this rank's parts are read
    if path.is_dir():
        tensors = ckpt.tensors(shard=shard)
    else:
        tensors = ckpt.tensors(raw_experts=raw_experts, raw_names=raw_names, shard=shard)
    with torch.no_grad():
        net.load_weights(_progress(tensors, bar), str(path))
    bar.close()
    net.eval()
    tokenizer = None
    if load_tokenizer:
        from models.loader.tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(path) if path.is_dir() else ckpt.tokenizer()
    return LoadedModel(net, config, tokenizer, path, torch_dtype)


def _progress(it, bar: tqdm):
    for item in it:
        yield item
        bar.update(1)


__all__ = ["CheckpointError", "LoadedModel", "load_model", "resolve_dtype"]
