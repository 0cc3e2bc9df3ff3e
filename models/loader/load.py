"""`load_model`: a model name, HF directory or GGUF file -> a ready model, its config and tokenizer.

The model is built on the meta device (no memory, no random init), materialised empty on the target
device, then filled tensor by tensor from the checkpoint under a progress bar; strict name and shape
checks happen in `CausalLM.load_weights`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from models.base import CausalLM
from models.builtin import resolve_model_path
from models.config import ModelConfig, config_from_hf_dict
from models.loader.errors import CheckpointError
from models.experts import EXPERT_BACKENDS, CppExperts, ExpertBackend, WeightInput
from models.cpu_ops import keeps_blocks
from models.native import CPU_WEIGHT_DTYPES, NativeAbsorbed, NativeEmbedding, NativeLinear, use_native_weights
from models.loader.raw_blocks import RawBlocks
from models.parallel import current as current_layout
from models.registry import model_class
from models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from models.loader.tokenizer import TokenizerBundle

logger = logging.getLogger(__name__)
# tqdm's default lock is a multiprocessing RLock: a named POSIX semaphore per process that draws a bar, even
# a disabled one. An engine process killed (a crash, SIGKILL) leaves it behind in /dev/shm, and the server's
# resource tracker warns of a "leaked semaphore" at exit. No bar here is shared between processes.
tqdm.set_lock(threading.RLock())

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


def check_tokenizer_fits(tokenizer: "TokenizerBundle", vocab_size: int, source: str) -> None:
    """A tokenizer whose vocabulary has ids past the model's embedding rows belongs to another model: every
    prompt would fail as a client's bad token (or decode another model's text). Refused; added tokens past
    them (a pad token appended without resizing the embeddings) are only warned of, as they fail only if used."""
    tok = tokenizer.tokenizer
    top = max(tok.get_vocab(with_added_tokens=False).values(), default=-1)
    if top >= vocab_size:
        raise CheckpointError(source, f"the tokenizer has token ids up to {top}, past the model's vocab_size "
                                      f"{vocab_size}: it is another model's tokenizer")
    beyond = sorted(i for i in tok.get_added_tokens_decoder() if i >= vocab_size)
    if beyond:
        named = ", ".join(f"{tok.id_to_token(i)!r} ({i})" for i in beyond[:5]) + (" ..." if len(beyond) > 5 else "")
        logger.warning("%s: added tokens %s have ids past the model's vocab_size %d: a prompt that holds them is "
                       "refused", source, named, vocab_size)


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
    `dtype` then still sets the KV cache's default dtype and the norms' parameters; with 'float32' its `auto`
    is float32, so that the forward is exact.

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
        if cpu_weights == "float32" and dtype == "auto":
            # exact means every weight fp32: the norms and MLA's kv_b_proj follow `dtype`, which `auto`
            # would make bf16 on a CPU with bf16 math (and the activations and KV cache with them)
            dtype = "float32"
    torch_dtype = resolve_dtype(dtype, device)
    ckpt = open_checkpoint(path)
    if path.is_dir() and cpu_weights == "file" and torch_dtype == torch.bfloat16:
        ckpt.dequantize_dtype = torch.bfloat16  # an FP8 weight's nearest "file type": the kernels would keep fp32
    config_source = str(path / "config.json" if path.is_dir() else path)
    config = config_from_hf_dict(ckpt.hf_config(), config_source)
    tokenizer = None
    if load_tokenizer:  # before the weights: a tokenizer of another model fails in seconds, not after the load
        from models.loader.tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(path) if path.is_dir() else ckpt.tokenizer()
        check_tokenizer_fits(tokenizer, config.vocab_size, str(path / "tokenizer.json" if path.is_dir() else path))
    # The config is checked against the tensors before anything is built at its sizes: a config that
    # does not belong to the weights (or a hostile one) fails here, not in a huge allocation or a
    # minutes-long build of layers that the file does not have. (A GGUF file was checked at open.)
    shapes = ckpt.layout() if path.is_dir() else None
    if shapes is not None:
        check_layer_count(config, shapes, config_source)
        config = moe_layers_as_saved(config, shapes, config_source)
    cls = model_class(config)
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated yet
            net = cls(config, expert_backend=expert_backend)
            if cpu_weights is not None:
                use_native_weights(net, cpu_weights, torch_dtype)
                for m in net.modules():
                    if isinstance(m, CppExperts):
                        m.weights.mode = cpu_weights
    except (RuntimeError, OverflowError) as e:  # a tensor whose size overflows int64, say
        raise CheckpointError(config_source, f"no model can be built at the config's sizes ({e}): they are not a "
                                             "real model's; fix the config") from e
    check_model_fits_checkpoint(net, shapes, ckpt.num_values(), str(path), config_source,
                                sharded=current_layout().parallel)
    # allocated once, in the final dtype (cast while still on the meta device); not Module.to_empty, whose
    # empty_like of a meta tensor runs torch's Python reference and imports sympy (most of a second per start)
    net = net.to(torch_dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for module in net.modules():
        if getattr(module, "keep_fp32", False):
            module.float()
    bar = tqdm(total=ckpt.num_tensors(), desc=f"Loading {path.name}", unit="tensor", disable=not progress, leave=False)
    raw_experts = (cpu_weights is None or keeps_blocks(cpu_weights)) and any(
        isinstance(m, ExpertBackend) and m.weight_input is WeightInput.GGUF_BLOCKS for m in net.modules())
    raw_names = frozenset(f"{n}.weight" for n, m in net.named_modules()
                          if isinstance(m, (NativeLinear, NativeEmbedding, NativeAbsorbed))
                          and m.weight_input is WeightInput.GGUF_BLOCKS)
    shard = net.shard_fn()  # under tensor parallelism: only this rank's parts are read
    if path.is_dir():  # (raw: an integer-quantized checkpoint's weights as ggml blocks, where blocks hold them)
        tensors = ckpt.tensors(shard=shard, raw_names=raw_names, raw_experts=raw_experts)
    else:
        tensors = ckpt.tensors(raw_experts=raw_experts, raw_names=raw_names, shard=shard)
    if cpu_weights == "file" and dtype in ("float32", torch.float32):
        tensors = _bf16_as_float32(tensors)  # `--dtype float32` asked for fp32 math: bf16 kernels round activations
    with torch.no_grad():
        net.load_weights(_checked(tensors, bar, str(path)), str(path))
    bar.close()
    net.eval()
    return LoadedModel(net, config, tokenizer, path, torch_dtype)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def check_layer_count(config: ModelConfig, names: Iterable[str], config_source: str) -> None:
    """Every layer the config counts has tensors in the checkpoint (HF names). Run before the model is
    built, which costs time and memory per layer whatever the file holds."""
    present = {int(m.group(1)) for n in names if (m := _LAYER_RE.match(n))}
    first_missing = next(i for i in itertools.count() if i not in present)
    if first_missing < config.num_hidden_layers:
        found = f"layers 0..{first_missing - 1}" if first_missing else "no layer tensors at all"
        raise CheckpointError(
            config_source,
            f"config key 'num_hidden_layers' is {config.num_hidden_layers} but the checkpoint has no tensor of "
            f"layer {first_missing} (model.layers.{first_missing}.*; it holds {found}): set num_hidden_layers "
            "to the layers the weights have, or use the complete checkpoint")


def moe_layers_as_saved(config: ModelConfig, names: Iterable[str], config_source: str) -> ModelConfig:
    """`config` with `moe_layer_freq` 1 when the checkpoint has a router in every layer after the dense lead.

    DeepSeek's own code (and vLLM) makes only every `moe_layer_freq`-th layer MoE; transformers ignores the
    key, so a checkpoint it saved from a config with `moe_layer_freq: 2` has experts where that reading
    expects a dense MLP. The tensors tell which reading wrote them; a mixed file fails later as missing
    tensors."""
    moe = getattr(config, "moe", None)
    if moe is None or moe.moe_layer_freq == 1:
        return config
    names = set(names)
    skipped = [i for i in range(moe.first_k_dense_replace, config.num_hidden_layers) if i % moe.moe_layer_freq]
    if not skipped or not all(f"model.layers.{i}.mlp.gate.weight" in names for i in skipped):
        return config
    layers = ", ".join(map(str, skipped[:4])) + (" ..." if len(skipped) > 4 else "")
    logger.warning("%s: moe_layer_freq is %d but layers %s have routed experts (a checkpoint saved by transformers, "
                   "which ignores the key): every layer from first_k_dense_replace on is MoE, as there",
                   config_source, moe.moe_layer_freq, layers)
    return dataclasses.replace(config, moe=dataclasses.replace(moe, moe_layer_freq=1))


def check_model_fits_checkpoint(net: CausalLM, shapes: dict[str, tuple[int, ...]] | None, values: int,
                                source: str, config_source: str, *, sharded: bool) -> None:
    """The model built on the meta device (nothing allocated yet) against the checkpoint's tensors.

    `shapes` (HF checkpoints: tensor -> shape from the headers): every parameter and native weight the
    checkpoint has must have the model's shape (unless `sharded`: a rank holds parts), and none may be
    absent. For both formats, the values the model would allocate (parameters and buffers, rotary
    tables aside) must not exceed twice the `values` the checkpoint holds (MLA's absorbed copies of
    kv_b_proj are the only derived weights): a config whose sizes (vocab, hidden, intermediate size,
    experts) are not the weights' fails here, before the allocation it would cost."""
    sinks = {f"{n}.weight": m.weight_shape for n, m in net.named_modules()
             if isinstance(m, (NativeLinear, NativeEmbedding, NativeAbsorbed)) and getattr(m, "tied_to", None) is None}
    optional = {f"{n}.weight" for n, m in net.named_modules() if getattr(m, "optional", False)}
    expert_params = {f"{n}.{p}" for n, m in net.named_modules() if isinstance(m, ExpertBackend)
                     for p, _ in m.named_parameters()}
    rotary = {f"{n}.{b}" for n, m in net.named_modules() if isinstance(m, RotaryEmbedding)
              for b, _ in m.named_buffers(recurse=False)}
    if shapes is not None:
        wanted = {n: tuple(p.shape) for n, p in net.named_parameters() if n not in expert_params}
        wanted.update((n, tuple(s)) for n, s in sinks.items())
        missing = sorted(n for n in wanted if n not in shapes and n not in optional)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(source, f"missing tensor(s): {', '.join(missing[:5])}{more}")
        if not sharded:
            for name, shape in wanted.items():
                if name in shapes and shapes[name] != shape:
                    raise CheckpointError(
                        source,
                        f"tensor '{name}' has shape {shapes[name]}, expected {shape} from {config_source}: the "
                        "config's sizes (vocab_size, hidden_size, intermediate_size, heads, ...) are not the "
                        "weights'; fix the config or use the weights it belongs to")
    model_values = sum(t.numel() for n, t in [*net.named_parameters(), *net.named_buffers()] if n not in rotary)
    model_values += sum(math.prod(s) for s in sinks.values())
    if model_values > 2 * values:
        raise CheckpointError(
            config_source,
            f"the config describes a model of {model_values:,} weight values but the checkpoint {source} holds "
            f"{values:,}: its sizes (vocab_size, hidden_size, intermediate_size, expert counts, ...) do not match "
            "the weights; fix the config or use the checkpoint it belongs to")


def _bf16_as_float32(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`items` with every bf16 tensor (a safetensors one, a GGUF's BF16 blocks) as fp32, which is exact: the
    native operators hold a bf16 weight as bf16 and multiply it by activations rounded to bf16 (AVX512_BF16),
    which an explicit `--dtype float32` does not ask for. Quantized blocks stay as they are."""
    for name, t in items:
        if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
            t = t.float()
        elif isinstance(t, RawBlocks) and t.qtype.name == "BF16":
            t = t.dequantize()
        yield name, t


def _checked(items: Iterable[tuple[str, Any]], bar: tqdm, source: str) -> Iterator[tuple[str, Any]]:
    """`items` as they come, each float tensor checked to hold finite values only: a NaN or an infinity in
    a norm, a router or a bias would run (the native kernels check the quantized blocks they are given, not
    these), and the first request would get garbage, or, through a router, stop the engine. One sum a
    tensor (memory speed: a NaN or an infinity anywhere makes it non-finite); an exact pass only where
    the sum is not finite, which finite values too large for it can also cause."""
    for name, t in items:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(source, f"tensor '{name}' holds {bad} non-finite value(s) (NaN or infinity): "
                                              "the file is damaged; use an intact copy of the model")
        yield name, t
        bar.update(1)


__all__ = ["CheckpointError", "LoadedModel", "load_model", "resolve_dtype"]
