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

import logging
import math
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from kernels.attention.base import ForwardBatch
from models.rotary import RotaryEmbedding
from models.config import ModelConfig
from models.layers import RMSNorm, compute_logits
from models.loader.errors import CheckpointError
from models.native import NativeAbsorbed, NativeEmbedding, NativeLinear
from models.parallel import (
    TokenGather,
    VocabEmbedding,
    VocabHead,
    current,
    embedding,
    lm_logits,
    replicated_under_dp_attention,
    shard_plan,
)
from models.loader.shard import SKIP, Shard, ShardFn
from models.loader.raw_blocks import RawBlocks
from models.experts import ExpertBackend


logger = logging.getLogger(__name__)
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight)?$")


def _is_float_weight(dtype: torch.dtype) -> bool:
    """Float types a weight is loaded from (FP8 is floating point but needs its checkpoint's scales)."""
    return dtype.is_floating_point and dtype.itemsize >= 2


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        # DP attention: the MLP runs on every rank's tokens (models.parallel.TokenGather, set by the model)
        self.tokens: TokenGather | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        fused = batch.attn_backend.fused_layer_ops
        a = self.self_attn(positions, self.input_layernorm(x, fused), batch)
        h, x = self.post_attention_layernorm.forward_residual(a, x, fused)
        return x + self.run_mlp(h, fused)

    def run_mlp(self, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The MLP (gated or MoE) on h; `fused`: its small ops as Triton kernels."""
        if self.tokens is None or getattr(self.mlp, "local_tokens", False):  # (all-to-all MoE: its own exchange)
            return self.mlp(h, fused)
        return self.tokens.scatter(self.mlp(self.tokens.gather(h), fused))


class DecoderModel(nn.Module):
    """Token embedding -> decoder layers -> final norm. `make_layer(i, rotary)` builds layer i."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int, RotaryEmbedding], nn.Module]) -> None:
        super().__init__()
        with replicated_under_dp_attention():
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(make_layer(i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        lay = current()
        self.tokens = TokenGather(lay) if lay.dp_attention else None
        for layer in self.layers:
            layer.tokens = self.tokens

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.tokens is not None:
            self.tokens.begin(int(batch.input_ids.shape[0]))
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        return self.norm(x, batch.attn_backend.fused_layer_ops)


ROTARY_TABLES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")


def _carries_nothing(name: str, tensor: torch.Tensor | RawBlocks) -> bool:
    """A tensor with no parameter that the model computes the same without: a rotary table (older checkpoints
    saved the buffers the model recomputes) or an all-zero bias (GPTQ-for-LLaMa and early AutoGPTQ wrote one
    beside every quantized layer), as vLLM skips them. A bias that is not zero would change the output: it
    stays an unexpected tensor."""
    if name.endswith(ROTARY_TABLES):
        return True
    return (name.endswith(".bias") and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            and not bool(tensor.any()))


class CausalLM(nn.Module):
    """A `DecoderModel` plus the LM head (the embedding itself when tied), with strict loading."""

    def __init__(self, cfg: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = model
        # the vocabulary is split over the ranks under tensor parallelism (whole under DP attention)
        self.vocab_parallel = current().parallel and not current().dp_attention
        if not cfg.tie_word_embeddings:
            if self.vocab_parallel:
                self.lm_head = VocabHead(cfg.vocab_size, cfg.hidden_size)
            else:
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
        if self.vocab_parallel:  # this rank's vocabulary rows, gathered
            return lm_logits(hidden if indices is None else hidden.index_select(0, indices), self.lm_weight(),
                             self.config.vocab_size)
        return compute_logits(hidden, self.lm_weight(), indices)

    @torch.no_grad()
    def forward_idle(self, fused: bool = False) -> None:
        """DP attention, on a rank with nothing to run this step: joins the other ranks' exchanges (the
        token counts, then each layer's MLP on their tokens) with no tokens of its own. `fused` as the
        busy ranks' attention backend says (`fused_layer_ops`), so that every rank routes the gathered
        tokens by the same kernels."""
        tokens = self.model.tokens
        if tokens is None:
            raise RuntimeError("forward_idle is for DP attention only")
        tokens.begin(0)
        w = self.model.norm.weight
        empty = torch.empty(0, w.shape[0], dtype=w.dtype, device=w.device)
        for layer in self.model.layers:
            layer.run_mlp(empty, fused)

    def set_context_length(self, n: int) -> None:
        """Sizes the rotary tables to the context that will be served (positions [0, n), n at most the
        config's max_position_embeddings): loading builds them for min(that, rotary.TABLE_POSITIONS).
        Call it before a runner hands the tables to the native forward or captures CUDA graphs."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.set_positions(n)

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    # ---- weights ----
    def shard_fn(self) -> ShardFn | None:
        """What this rank reads of each checkpoint tensor under tensor parallelism (None: everything):
        the layers' own parts (models.parallel) and, for routed experts, the intermediate-size part of
        each or, with expert parallelism, this rank's experts whole (the others' are never read)."""
        lay = current()
        if not lay.parallel:
            return None
        plan = shard_plan(self)
        owners = {f"{n}.experts": m for n, m in self.named_modules() if hasattr(m, "expert_range")}

        def shard(name: str, shape: tuple[int, ...]) -> Shard | None | object:
            if name in plan:
                return plan[name]
            if self.tie_word_embeddings and name == "lm_head.weight":
                return SKIP  # a tied checkpoint's copy of the embedding
            m = _EXPERT_RE.match(name)
            moe = owners.get(m.group(1)) if m else None
            if m is None or moe is None:
                return None
            expert, kind = m.group(2), m.group(3)
            rng = moe.expert_range
            if lay.ep:
                if expert is not None:
                    return None if rng.start <= int(expert) < rng.stop else SKIP
                return Shard(0, ((rng.start, rng.stop),))
            lead = 0 if expert is not None else 1  # stacked tensors [E, ...] have the expert first
            full = moe.experts.intermediate_size * lay.tp_size
            a, b = lay.split(full, "the experts' intermediate size")
            if kind == "down_proj":
                return Shard(lead + 1, ((a, b),))
            if kind == "gate_up_proj":
                return Shard(lead, ((a, b), (full + a, full + b)))
            return Shard(lead, ((a, b),))

        return shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | RawBlocks]], source: str) -> None:
        """Copies HF-named tensors into the parameters (casting dtype); strict about names and shapes."""
        params = dict(self.named_parameters())
        # weights that operators hold instead of parameters (models.native), by their HF name; a tied
        # LM head shares the embedding's and is loaded by nobody
        sinks = {f"{n}.weight": m for n, m in self.named_modules()
                 if isinstance(m, (NativeLinear, NativeEmbedding, NativeAbsorbed))
                 and getattr(m, "tied_to", None) is None}
        experts = {n: m for n, m in self.named_modules() if isinstance(m, ExpertBackend)}
        expert_params = {f"{n}.{p}" for n, m in experts.items() for p, _ in m.named_parameters()}
        # under tensor parallelism: vocabulary parts padded to equal rows, and routed experts held here
        padded = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, (VocabEmbedding, VocabHead))}
        ranges = {f"{n}.experts": m.expert_range for n, m in self.named_modules() if hasattr(m, "expert_range")}
        loaded: set[str] = set()
        expert_loaded: set[tuple[str, int, str]] = set()
        ignored: list[str] = []
        for name, tensor in weights:
            if isinstance(tensor, torch.Tensor) and not _is_float_weight(tensor.dtype):
                raise CheckpointError(
                    source, f"tensor '{name}' is stored as {tensor.dtype}: weights must be F32, F16 or BF16 "
                            "(integer, boolean and FP8 tensors, as in quantized checkpoints, are not loaded)")
            m = _EXPERT_RE.match(name)
            if m and m.group(1) in experts:
                first = ranges[m.group(1)].start if m.group(1) in ranges else 0
                self._load_expert(experts[m.group(1)], m, tensor, source, name, expert_loaded, first)
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
                except CheckpointError:  # the file's own tensor refused while decoding: it names file and tensor
                    raise
                except ValueError as err:  # the operator refuses the weight (e.g. a non-finite scale)
                    raise CheckpointError(source, f"tensor '{name}': {err}") from None
                loaded.add(name)
                continue
            param = params.get(name)
            if param is None and math.prod(tensor.shape) == 0:
                continue  # carries nothing: transformers saves `n_shared_experts: 0`'s experts as [h, 0] weights
            if param is None and _carries_nothing(name, tensor):
                ignored.append(name)
                continue
            if param is None or name in expert_params:
                raise CheckpointError(source, f"unexpected tensor '{name}' (no such parameter in this architecture)")
            target = param.data
            if name in padded and tensor.shape[1:] == param.shape[1:] and 0 < tensor.shape[0] <= param.shape[0]:
                target.zero_()  # the last vocabulary part's padding rows (models.parallel.vocab_part)
                target = target[: tensor.shape[0]]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    source, f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        if ignored:
            logger.info("%s: %d tensors that change nothing are not loaded (rotary tables, which are recomputed, and "
                        "all-zero biases of layers without one, as older GPTQ files store them), e.g. '%s'", source,
                        len(ignored), ignored[0])
        required_sinks = {n for n, m in sinks.items() if not getattr(m, "optional", False)}
        missing = sorted((set(params) | required_sinks) - loaded - expert_params)
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
        first: int = 0,
    ) -> None:
        """`first`: the global id of the backend's expert 0 (expert parallelism: a rank's experts are
        first..first+num_experts-1; per-expert tensors of the others are never read)."""
        prefix, expert, kind = m.group(1), m.group(2), m.group(3)
        if expert is not None:
            expert = str(int(expert) - first)
            if int(expert) < 0:
                raise CheckpointError(source, f"tensor '{name}': expert {int(expert) + first} is not held by this rank")
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
        except CheckpointError:
            raise
        except ValueError as err:  # the backend refuses the weight (e.g. a format it cannot mix)
            raise CheckpointError(source, f"tensor '{name}': {err}") from None
