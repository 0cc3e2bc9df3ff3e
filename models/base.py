"""What every causal LM here shares: the decoder stack's forward over a `ForwardBatch`, the logits
head, and strict weight loading by HF parameter names.

Weight loading is strict on purpose: every parameter must be loaded exactly by a tensor of the
expected shape, and every tensor of the checkpoint must land somewhere; anything else is a
`CheckpointError` naming the tensor. Routed experts are loaded through their expert backend, from
per-expert HF names (`mlp.experts.{e}.gate_proj.weight`), stacked names
(`mlp.experts.gate_proj.weight` [E, ...]) or HF-v5's fused `mlp.experts.gate_up_proj` [E, 2I, H];
backends whose `weight_input` is GGUF_BLOCKS may get GGUF `RawBlocks` for them instead of float tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from kernels.attention.base import ForwardBatch
from models.rotary import RotaryEmbedding
from models.config import ModelConfig
from models.layers import RMSNorm, compute_logits
from models.loader.errors import CheckpointError
from models.native import NativeEmbedding, NativeLinear
from models.loader.raw_blocks import RawBlocks
from models.experts import ExpertBackend


_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight)?$")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Token embedding -> decoder layers -> final norm. `make_layer(i, rotary)` builds layer i."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int, RotaryEmbedding], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(make_layer(i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """A `DecoderModel` plus the LM head (the embedding itself when tied), with strict loading."""

    def __init__(self, cfg: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = model
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the stack over `batch`; returns fp32 logits [N, V] for `batch.logits_indices`
        (default: the last token of each request)."""
        batch.attn_backend.init_forward_metadata(batch)
        return self.forward_prepared(batch)

    def forward_prepared(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` once the backend's metadata is set: what a CUDA graph captures (the graph runner
        sets the metadata through the backend's graph hooks). Nothing here may touch the host: in
        decode every token is its request's last, so no index tensor is built."""
        hidden = self.model(batch)
        indices = batch.logits_indices
        if indices is None and not batch.forward_mode.is_decode():
            indices = batch.last_token_indices()
        head = getattr(self, "lm_head", None)
        if isinstance(head, NativeLinear):  # the CPU-native weights (models.native), tied or not
            return head(hidden if indices is None else hidden.index_select(0, indices)).float()
        return compute_logits(hidden, self.lm_weight(), indices)

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | RawBlocks]], source: str) -> None:
        """Copies HF-named tensors into the parameters (casting dtype); strict about names and shapes."""
        params = dict(self.named_parameters())
        # weights that operators hold instead of parameters (models.native), by their HF name; a tied
        # LM head shares the embedding's and is loaded by nobody
        sinks = {f"{n}.weight": m for n, m in self.named_modules()
                 if isinstance(m, (NativeLinear, NativeEmbedding)) and getattr(m, "tied_to", None) is None}
        experts = {n: m for n, m in self.named_modules() if isinstance(m, ExpertBackend)}
        expert_params = {f"{n}.{p}" for n, m in experts.items() for p, _ in m.named_parameters()}
        loaded: set[str] = set()
        expert_loaded: set[tuple[str, int, str]] = set()
        for name, tensor in weights:
            m = _EXPERT_RE.match(name)
            if m and m.group(1) in experts:
                self._load_expert(experts[m.group(1)], m, tensor, source, name, expert_loaded)
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints store the copy anyway
            sink = sinks.get(name)
            if sink is not None:
                if tuple(tensor.shape) != sink.weight_shape:
                    raise CheckpointError(
                        source, f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {sink.weight_shape}")
                try:
                    sink.load_weight(tensor, name)
                except ValueError as err:  # the operator refuses the weight (e.g. a non-finite scale)
                    raise CheckpointError(source, f"tensor '{name}': {err}") from None
                loaded.add(name)
                continue
            param = params.get(name)
            if param is None or name in expert_params:
                raise CheckpointError(source, f"unexpected tensor '{name}' (no such parameter in this architecture)")
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    source, f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted((set(params) | set(sinks)) - loaded - expert_params)
        for prefix, backend in experts.items():
            for e in range(backend.num_experts):
                for kind in ("gate_proj", "up_proj", "down_proj"):
                    if (prefix, e, kind) not in expert_loaded:
                        missing.append(f"{prefix}.{e}.{kind}.weight")
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(source, f"missing tensor(s): {', '.join(missing[:5])}{more}")
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    @staticmethod
    def _load_expert(
        backend: ExpertBackend,
        m: re.Match[str],
        tensor: torch.Tensor | RawBlocks,
        source: str,
        name: str,
        done: set[tuple[str, int, str]],
    ) -> None:
        prefix, expert, kind = m.group(1), m.group(2), m.group(3)
        e_count, h, i = backend.num_experts, backend.hidden_size, backend.intermediate_size
        per_expert = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "gate_up_proj": (2 * i, h)}[kind]
        if expert is not None:
            expected: tuple[int, ...] = per_expert
            if int(expert) >= e_count:
                raise CheckpointError(source, f"tensor '{name}': expert {expert} out of range (model has {e_count})")
        else:
            expected = (e_count, *per_expert)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(source, f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {expected}")
        # Indexing works alike on tensors and on `RawBlocks` (GGUF blocks a backend keeps quantized).
        ids = range(e_count) if expert is None else [int(expert)]
        try:
            for e in ids:
                row = tensor[e] if expert is None else tensor
                if kind == "gate_up_proj":
                    backend.load_expert(e, "gate_proj", row[:i])
                    backend.load_expert(e, "up_proj", row[i:])
                    done.update({(prefix, e, "gate_proj"), (prefix, e, "up_proj")})
                else:
                    backend.load_expert(e, kind, row)
                    done.add((prefix, e, kind))
        except ValueError as err:  # the backend refuses the weight (e.g. a format it cannot mix)
            raise CheckpointError(source, f"tensor '{name}': {err}") from None
