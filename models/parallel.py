"""Tensor and expert parallelism inside the model, on torch.distributed (gloo on CPUs, NCCL on GPUs).

One process per rank; every rank runs the same forward on the same tokens. The layers here hold
their rank's part of a weight and say which part that is (`shards`: parameter name -> `Shard` of the
HF tensor), so the checkpoint readers read only that part (models.loader.shard):

- `ColumnLinear`   y_r = x · W_r^T            output features split (q/k/v, gate/up, kv_b by heads);
- `RowLinear`      y = Σ_r x_r · W_r^T + b     input features split, one all-reduce (o_proj, down_proj);
- `VocabEmbedding` rows of the vocabulary split; a token's row comes from its owner (all-reduce);
- the LM head      each rank scores its vocabulary rows; one all-gather gives every rank the logits.

Attention is split by heads: Llama's q heads and KV heads (a KV head is repeated on consecutive ranks
when there are fewer KV heads than ranks), MLA's query heads; MLA's latent projection is replicated,
so every rank keeps the whole 576-wide latent cache of its requests. Routed experts are either split
like an MLP (each expert's intermediate size over the ranks) or, with expert parallelism, whole
experts partitioned over the ranks (`ExpertRange`); either way a MoE block ends in one all-reduce of
its partial sums (the shared experts' included).

DP attention (`ParallelLayout.dp_attention`, for MLA models whose latent cache should not be
replicated): attention, embedding and LM head are whole on every rank and each rank runs them for its
own requests only (its own KV cache); the MLP/MoE layers stay split, run on every rank's tokens
gathered (`TokenGather`), and each rank takes its rows back. Ranks step together; one with nothing to
run joins the exchanges with no tokens (`CausalLM.forward_idle`).

`current()` is the parallel layout the model is built for; `configure()` sets it (once per process,
before the model is built); the default is one rank, where every layer here is the plain layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.loader.shard import Shard


@dataclass(frozen=True)
class ParallelLayout:
    """This process's place in the model-parallel group. `ep`: routed experts partitioned over the
    tp ranks (whole experts per rank) instead of each expert split by its intermediate size."""

    tp_size: int = 1
    tp_rank: int = 0
    ep: bool = False
    group: Any = None  # torch.distributed ProcessGroup of the tp ranks (None: the default group)
    # DP attention: each rank runs attention (whole weights, its own requests and KV cache), the
    # embedding and the LM head for its own tokens; only MLP/MoE layers are split, over every rank's
    # tokens gathered (`TokenGather`)
    dp_attention: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad parallel layout: rank {self.tp_rank} of {self.tp_size}")

    @property
    def parallel(self) -> bool:
        return self.tp_size > 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's even part of `total` (which the ranks must divide)."""
        if total % self.tp_size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.tp_size}")
        n = total // self.tp_size
        return self.tp_rank * n, (self.tp_rank + 1) * n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (a no-op on one rank)."""
        if self.parallel:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        if not self.parallel:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_LAYOUT = ParallelLayout()


def current() -> ParallelLayout:
    """The layout models are built for in this process."""
    return _LAYOUT


def configure(layout: ParallelLayout) -> None:
    """Sets the layout for the models built from now on in this process."""
    global _LAYOUT
    _LAYOUT = layout


@contextmanager
def replicated_under_dp_attention() -> Iterator[None]:
    """Builds what DP attention keeps whole on every rank (attention, embedding, LM head) as on one
    rank; a no-op otherwise."""
    global _LAYOUT
    saved = _LAYOUT
    if saved.dp_attention:
        _LAYOUT = ParallelLayout()
    try:
        yield
    finally:
        _LAYOUT = saved


class TokenGather:
    """DP attention's exchange around each split MLP/MoE layer: every rank's tokens gathered (in rank
    order), the layer run on all of them (its all-reduce included), each rank's rows taken back.
    `begin` (once per forward, every rank, 0 tokens for an idle one) exchanges the token counts."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout
        self.sizes: list[int] = []

    def begin(self, num_tokens: int) -> None:
        import torch.distributed as dist

        lay = self.layout
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(lay.tp_size)]
        dist.all_gather(parts, mine, group=lay.group)
        self.sizes = [int(p.item()) for p in parts]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        most = max(self.sizes)
        padded = x.new_zeros(most, x.shape[-1])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded, group=self.layout.group)
        return torch.cat([p[:n] for p, n in zip(parts, self.sizes)])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        start = sum(self.sizes[: self.layout.tp_rank])
        return y[start : start + self.sizes[self.layout.tp_rank]]


def _rows(start: int, stop: int) -> Shard:
    return Shard(0, ((start, stop),))


class ColumnLinear(nn.Linear):
    """nn.Linear holding output features [start, stop) of the full layer (all of them on one rank).
    `ranges` overrides the even split (heads repeated across ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, what: str = "output features",
                 ranges: tuple[int, int] | None = None) -> None:
        lay = current()
        start, stop = ranges if ranges is not None else lay.split(out_features, what)
        super().__init__(in_features, stop - start, bias=bias)
        self.shards: dict[str, Shard] = {}
        if (start, stop) != (0, out_features):
            self.shards = {"weight": _rows(start, stop)}
            if bias:
                self.shards["bias"] = _rows(start, stop)


class RowLinear(nn.Module):
    """A linear layer whose input features are split over the ranks: each computes its partial
    product, one all-reduce sums them, the bias (whole on every rank) is added once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, what: str = "input features") -> None:
        super().__init__()
        self.layout = lay = current()
        start, stop = lay.split(in_features, what)
        self.in_features, self.out_features = stop - start, out_features
        self.weight = nn.Parameter(torch.empty(out_features, stop - start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = {"weight": Shard(1, ((start, stop),))} if lay.parallel else {}

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum (no bias): for blocks that reduce several terms at once."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layout.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias


def vocab_part(vocab: int) -> tuple[int, int, int]:
    """(start, stop, rows held): this rank's rows of a vocabulary split in equal parts (the last one
    padded with zero rows when the ranks do not divide it)."""
    lay = current()
    per = -(-vocab // lay.tp_size)
    start = min(lay.tp_rank * per, vocab)
    return start, min(start + per, vocab), per


class VocabEmbedding(nn.Module):
    """nn.Embedding with the vocabulary's rows split over the ranks: each looks up the tokens it owns
    (zeros for the others) and one all-reduce gives every rank every row."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.layout = current()
        self.start, self.stop, rows = vocab_part(vocab)
        self.num_embeddings, self.embedding_dim = vocab, dim
        self.weight = nn.Parameter(torch.empty(rows, dim))
        # rows past the vocabulary (padding of the last part) are zero and never looked up
        self.shards = {"weight": _rows(self.start, self.stop)} if self.layout.parallel else {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.layout.parallel:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.layout.all_reduce(out)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 logits [N, vocab] from this rank's rows of the LM head (all of them on one rank)."""
    local = F.linear(hidden, weight).float()
    lay = current()
    if not lay.parallel:
        return local
    return lay.all_gather_last(local)[:, :vocab]


def kv_heads_held(num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, KV heads held) by this rank: an even split when the ranks divide the KV heads,
    else each KV head repeated on tp/num_kv_heads consecutive ranks (the ranks of its query heads)."""
    lay = current()
    if num_kv_heads % lay.tp_size == 0:
        n = num_kv_heads // lay.tp_size
        return lay.tp_rank * n, n
    if lay.tp_size % num_kv_heads == 0:
        return lay.tp_rank // (lay.tp_size // num_kv_heads), 1
    raise ValueError(f"{num_kv_heads} KV heads cannot be spread over {lay.tp_size} tensor-parallel ranks "
                     "(one must divide the other)")


def column_linear(in_features: int, out_features: int, bias: bool = False, *, what: str = "output features",
                  ranges: tuple[int, int] | None = None) -> nn.Linear:
    """nn.Linear on one rank (what the CPU-native weights replace); its output-split part otherwise."""
    if not current().parallel:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnLinear(in_features, out_features, bias, what=what, ranges=ranges)


def row_linear(in_features: int, out_features: int, bias: bool = False, *, what: str = "input features") -> nn.Module:
    """nn.Linear on one rank; its input-split part (ending in an all-reduce) otherwise."""
    if not current().parallel:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowLinear(in_features, out_features, bias, what=what)


def embedding(vocab: int, dim: int) -> nn.Module:
    """nn.Embedding on one rank; the vocabulary-split embedding otherwise. The weight starts empty: the
    checkpoint fills it, and nn.Embedding's random init on the meta device goes through torch's Python
    reference of normal_, whose first call imports torch._dynamo (about 4 s of every engine start)."""
    if current().parallel:
        return VocabEmbedding(vocab, dim)
    return nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim))


class VocabHead(nn.Module):
    """An untied LM head's rows of the vocabulary held by this rank (`lm_logits` gathers them)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        start, stop, rows = vocab_part(vocab)
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.shards = {"weight": _rows(start, stop)}


def local_kv_heads(num_kv_heads: int) -> int:
    """KV heads one rank holds (and caches): all of them under DP attention."""
    if current().dp_attention:
        return num_kv_heads
    return kv_heads_held(num_kv_heads)[1]


def local_heads(num_heads: int) -> int:
    """Query heads one rank runs attention for: all of them on one rank and under DP attention."""
    lay = current()
    return num_heads if lay.dp_attention or not lay.parallel else tp_split(num_heads, "attention heads")


def split_heads_max() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Where the ranks split attention by heads (--tp): a max over the ranks, in place, that turns each
    rank's max over its own query heads into the max over all of them (OmniKV reduces attention weights
    over heads by max, and every rank must then select the same tokens); None where every head is local."""
    lay = current()
    if not lay.parallel or lay.dp_attention:
        return None

    def heads_max(x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=lay.group)
        return x

    return heads_max


def tp_split(total: int, what: str) -> int:
    """This rank's even part of `total` (heads, intermediate size)."""
    start, stop = current().split(total, what)
    return stop - start


@dataclass(frozen=True)
class ExpertRange:
    """Routed experts [start, stop) held by this rank under expert parallelism (all on one rank)."""

    start: int
    stop: int

    @classmethod
    def for_rank(cls, num_experts: int) -> ExpertRange:
        lay = current()
        if not lay.ep:
            return cls(0, num_experts)
        start, stop = lay.split(num_experts, "the number of routed experts")
        return cls(start, stop)

    def localize(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids -> this rank's local ids, with weight 0 for experts held elsewhere (their
        rows then add nothing: the all-reduce brings their terms from their owners)."""
        mine = (ids >= self.start) & (ids < self.stop)
        return torch.where(mine, ids - self.start, 0), torch.where(mine, weights, torch.zeros_like(weights))


def shard_plan(model: nn.Module) -> dict[str, Shard]:
    """HF parameter name -> the part of it this rank reads, from every layer's `shards`."""
    plan: dict[str, Shard] = {}
    for prefix, m in model.named_modules():
        for pname, s in getattr(m, "shards", {}).items():
            plan[f"{prefix}.{pname}" if prefix else pname] = s
    return plan
