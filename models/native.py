"""Dense weights held by the C++ operators (`cpp_experts.QuantLinear`) for the CPU-native forward.

`use_native_weights(model, mode)` swaps, on the meta-device model before loading, every `nn.Linear`
for a `NativeLinear` and the token embedding for a `NativeEmbedding` (and gives a tied model an LM
head that shares the embedding's operator). Their weights never become torch parameters: the loader
hands them over through `load_weight` (the strict name and shape checks of `CausalLM.load_weights`
still apply) and they are packed once for the kernels. `mode` (`--cpu-weight-dtype`):

- `file`: GGUF blocks stay as stored: the kernels compute on every block type the loader reads (Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS); float tensors keep their
  precision (bf16 as bf16, fp32 and fp16 as fp32; the loader hands bf16 over as fp32 under an explicit
  `--dtype float32`). A block type without a kernel would be decoded to
  bf16, with one warning.
- `bf16`: every weight decoded to bf16 (activations are then rounded to bf16, never to int8).
- `float32`: every weight decoded to fp32 (exact; twice bf16's memory and bandwidth).
- `q8_0`: float weights quantized to Q8_0 as they load (a bf16 checkpoint served in about half its memory, as
  llama.cpp's Q8_0 file of it; not exact), a file's quantized blocks kept as `file` keeps them.

MLA's `kv_b_proj` stays a float `nn.Linear` (its per-head halves become the absorbed matrices of the
torch forward); with `file`, a GGUF's own per-head `attn_k_b` / `attn_v_b` blocks (llama.cpp's split
form) also reach a `NativeAbsorbed` pair on the attention, so that the native forward's absorbed
products read them as stored, as llama.cpp does, rather than as fp32 decoded from them (4 bytes a
value against Q8_0's 1.06: ~4% of a DeepSeek-V2-Lite Q8_0 decode step). The MoE router stays fp32
(`models.moe.Router`). The modules still run in a torch forward
(`forward` calls the operator), so every path of the model works with them; the executor's native
forward (`executor.cpu_forward`) reads their operators directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.cpu_ops import CPU_WEIGHT_DTYPES, keeps_blocks, make_operator
from models.experts.base import WeightInput
from models.loader.raw_blocks import RawBlocks

class NativeLinear(nn.Module):
    """`nn.Linear`'s place when the weight lives in a `QuantLinear` (its bias stays a parameter, handed
    to the operator after loading)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str) -> None:
        super().__init__()
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.op: Any = None  # cpp_experts.QuantLinear, once loaded
        self._tied: list[NativeEmbedding] = []  # a tied LM head: [the embedding whose operator it shares]

    @property
    def tied_to(self) -> NativeEmbedding | None:
        return self._tied[0] if self._tied else None

    @property
    def weight_input(self) -> WeightInput:
        return WeightInput.GGUF_BLOCKS if keeps_blocks(self.mode) else WeightInput.DECODED

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def load_weight(self, weight: torch.Tensor | RawBlocks, what: str) -> None:
        self.op = make_operator(weight, self.mode, what)

    def process_weights_after_loading(self) -> None:
        if self.tied_to is not None:
            self.op = self.tied_to.op
        if self.op is None:
            raise RuntimeError("a native linear layer was never loaded")
        if self.bias is not None:
            self.op.set_bias(self.bias.detach().float())

    def bind(self, workers: Any) -> None:
        self.op.bind(workers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.op.forward(x.reshape(-1, shape[-1]).float().contiguous())
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        kind = self.op.weight_format if self.op is not None else "unloaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={kind}"


class NativeEmbedding(nn.Module):
    """The token embedding as a [vocab, hidden] `QuantLinear`: a lookup decodes the rows it needs."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.mode, self.dtype = num_embeddings, embedding_dim, mode, dtype
        self.op: Any = None

    weight_input = NativeLinear.weight_input
    load_weight = NativeLinear.load_weight

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    def process_weights_after_loading(self) -> None:
        if self.op is None:
            raise RuntimeError("the native embedding was never loaded")

    def bind(self, workers: Any) -> None:
        self.op.bind(workers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.op.rows(ids.to(torch.int64)).to(self.dtype)

    def extra_repr(self) -> str:
        kind = self.op.weight_format if self.op is not None else "unloaded"
        return f"{self.num_embeddings}, {self.embedding_dim}, weight={kind}"


class NativeAbsorbed(nn.Module):
    """One of MLA's absorbed matrices as one `QuantLinear` per head, from the GGUF tensor that holds it
    per head ([heads, out, in]: `attn_k_b` = w_kc, `attn_v_b` = w_vc). Optional: a checkpoint without
    that tensor (safetensors, llama.cpp's older single `attn_kv_b`, a tensor-parallel part) leaves
    `ops` None and the native forward takes the matrices from `kv_b_proj`."""

    optional = True  # load_weights does not miss it

    def __init__(self, heads: int, out_features: int, in_features: int, mode: str) -> None:
        super().__init__()
        self.heads, self.out_features, self.in_features, self.mode = heads, out_features, in_features, mode
        self.ops: list[Any] | None = None

    weight_input = NativeLinear.weight_input

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.out_features, self.in_features)

    def load_weight(self, weight: torch.Tensor | RawBlocks, what: str) -> None:
        self.ops = [make_operator(weight[h], self.mode, f"{what}[{h}]") for h in range(self.heads)]

    def extra_repr(self) -> str:
        kind = self.ops[0].weight_format if self.ops else "from kv_b_proj"
        return f"heads={self.heads}, out_features={self.out_features}, in_features={self.in_features}, weight={kind}"


WeightSink = NativeLinear | NativeEmbedding | NativeAbsorbed


def use_native_weights(model: nn.Module, mode: str, dtype: torch.dtype) -> None:
    """Swaps the linears (but MLA's kv_b_proj) and the embedding of `model` (built on the meta device,
    not loaded yet) for native ones; a tied model gets an `lm_head` sharing the embedding's operator."""
    if mode not in CPU_WEIGHT_DTYPES:
        raise ValueError(f"unknown CPU weight dtype {mode!r} (choose {', '.join(CPU_WEIGHT_DTYPES)})")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if mode == "file" and isinstance(child, nn.Linear) and name == "kv_b_proj" and hasattr(parent, "w_kc"):
                heads, nope, rank = parent.w_kc.shape  # MLAAttention: w_kc [H, N, r], w_vc [H, r, V]
                parent.w_kc_native = NativeAbsorbed(heads, rank, nope, mode)
                parent.w_vc_native = NativeAbsorbed(heads, parent.w_vc.shape[2], rank, mode)
            elif isinstance(child, nn.Linear) and name != "kv_b_proj":
                setattr(parent, name, NativeLinear(child.in_features, child.out_features, child.bias is not None, mode))
            elif isinstance(child, nn.Embedding):
                setattr(parent, name, NativeEmbedding(child.num_embeddings, child.embedding_dim, mode, dtype))
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "tie_word_embeddings", False) and isinstance(embed, NativeEmbedding):
        head = NativeLinear(embed.embedding_dim, embed.num_embeddings, False, mode)
        head._tied.append(embed)  # a list, so that the embedding is not registered twice as a submodule
        model.lm_head = head


def native_modules(model: nn.Module) -> list[NativeLinear | NativeEmbedding]:
    return [m for m in model.modules() if isinstance(m, (NativeLinear, NativeEmbedding))]
