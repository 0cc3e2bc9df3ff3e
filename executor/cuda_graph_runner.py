"""Decode through captured CUDA graphs (docs/architecture.md §4).

A decode step of a small batch is launch-bound: hundreds of small kernels whose launches cost more
than their work. A CUDA graph records the whole decode forward once per padded batch size and
replays it with one launch. A replay can change only the *contents* of the memory the capture read,
hence:

* the inputs live in static buffers allocated once for the largest size; a replay copies the batch's
  tensors into their first rows (device to device, no host sync) and fills the rest of the padded
  size with a dummy request;
* the attention backend keeps its per-forward metadata in buffers made once by
  `init_cuda_graph_state` and rewrites them in place (`init_forward_metadata_replay_cuda_graph`);
* the logits come back in the tensor the capture produced, valid until that size's next replay.

The dummy request sits on req_to_token row 0 (reserved; its column 0 holds slot 0) with seq_len 1,
position 0 and input id 0, and writes its KV to slot 0, in the allocator's reserved dummy page: so
padding rows never touch a real request's KV.

Batch sizes 1, 2, 4, 8, 16, ..., 64 (steps of 8), then steps of 16, up to max_bs (itself included);
a batch runs padded to the smallest captured size that holds it. Larger batches, and every
non-decode forward, run eagerly. Sampling is not captured: it runs on the returned logits, so
seeded sampling is the same with and without graphs.

How the forward is captured is read off the `GraphSupport` of the attention backend and of every
routed-expert backend (`kernels.graph_support`), by `plan_decode_graphs`:

* `capture`: every part is device work only; one plain capture.
* hybrid placement (`--expert-backend cpp` on a CUDA device): the CPU experts do host work, which
  enters the graph as `--hybrid-graph-mode` says:
  * `host-nodes` (default): as host nodes (`cpp_experts.HostTask`, see `models.experts.host_calls`),
    with pinned staging reserved by `prepare_cuda_graph` before the first capture; one graph launch
    per step, no Python per layer. Such a replay then synchronizes the stream, so that a failure in
    the host work is raised for its own batch.
  * `split`: `SplitCudaGraphCapture` cuts the forward into graph pieces where the experts hand over
    host work (its `host_step`) and runs that work eagerly between the pieces' replays: two host
    steps and three pieces per MoE layer, no host function on a driver thread.
* otherwise graphs are off, and the log says which part cannot be captured and why.

Before capturing, the runner asks each expert backend to prepare for that mode; what a backend
returns (its host tasks, say) the runner keeps as long as its graphs.
`bench/model_decode_gpu.py --hybrid` times both hybrid modes against eager decode.

OmniKV (kernels/attention/omnikv.py): a decode batch with OmniKV rows replays a graph of its own when
the attention backend can run one without the host (`omnikv_graphs`) and the capture is plain
(CAPTURE mode). Its shapes are fixed by the padded batch size and a context bucket, the smallest power
of two holding every row's context (`omnikv_width`): importance is computed over that width, and the
selection table holds the budget of that width plus the sink and recent tokens, or, when the batch
also has full-attention rows, the whole width (those rows' budgets cover their contexts: they select
everything, which is full attention). The rows' budgets (and, mixed, which rows are OmniKV rows) join
the static inputs. Such graphs are captured the first time a (size, bucket, mixed) key is met, on the
dummy request, and dropped when the runner's OmniKV config changes (`drop_omnikv_graphs`).

The capture mechanism is injected (`GraphCapture`): `CudaGraphCapture` in production; CPU tests pass
a stand-in whose replay re-runs the forward on the static buffers.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from executor.forward_batch import ForwardBatch, ForwardMode
from executor.memory_pool import KVPool, ReqToTokenPool
from kernels.attention.base import AttentionBackend
from kernels.attention.context_bank import ContextBank
from kernels.attention.omnikv import GraphRows, OmniKVBatch, QueryHistory
from kernels.graph_support import CapturedHostWork, GraphMode, GraphSupport, HostStep
from models.experts import ExpertBackend
from models.omnikv_config import LayerPlan, OmniKVConfig

logger = logging.getLogger("mlaserve.cuda_graph")


HYBRID_GRAPH_MODES = (GraphMode.HOST_NODES.value, GraphMode.SPLIT.value)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then steps of 8 up to 64, then steps of 16, ending with `max_bs` itself; [] for max_bs < 1."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_bs + 1, 16)]
    out = [s for s in sizes if s < max_bs]
    return out + [max_bs] if max_bs >= 1 else []


def padded_batch_size(bs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= bs (sizes ascending), or None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        """Warms up and records `run`; returns the graph and the output tensor its replays rewrite."""
        ...


class CudaGraphCapture:
    """`torch.cuda.graph` capture (modes CAPTURE and HOST_NODES). Every graph shares one memory
    pool: sizes are captured largest first and the smaller ones reuse its intermediate memory (graphs
    replay one at a time, on one stream, so they never need it at once)."""

    warmup_runs = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def _warm_up(self, run: Callable[[], torch.Tensor]) -> None:
        # Lazy initialisation (Triton compilation, cuBLAS workspaces) must happen before the
        # capture, on a side stream as PyTorch's graph docs ask.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        self._warm_up(run)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return graph, out


class SplitGraph:
    """Graph pieces replayed in order with a host step after each one but the last."""

    def __init__(self, pieces: list[CapturedGraph], steps: list[Callable[[], None]]) -> None:
        assert len(pieces) == len(steps) + 1
        self.pieces, self.steps = pieces, steps

    def replay(self) -> None:
        for piece, step in zip(self.pieces, self.steps):
            piece.replay()
            step()
        self.pieces[-1].replay()


class SplitCudaGraphCapture(CudaGraphCapture):
    """Captures a forward as graph pieces cut where a backend hands over host work (`host_step`):
    the piece so far ends, is replayed at once (a capture records without running, and the host
    step needs the piece's real outputs), the step runs, the next piece begins. All pieces share the
    pool; tensors a step reads or writes stay referenced by it, so their memory is never reused."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._pieces: list[torch.cuda.CUDAGraph] | None = None  # of the capture under way
        self._steps: list[Callable[[], None]] = []
        self._open: torch.cuda.CUDAGraph | None = None

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool)

    def _end(self) -> torch.cuda.CUDAGraph:
        assert self._pieces is not None and self._open is not None
        graph, self._open = self._open, None
        graph.capture_end()
        self._pieces.append(graph)
        return graph

    def host_step(self, fn: Callable[[], None]) -> None:
        if self._pieces is None:
            raise RuntimeError("a host step outside a split capture")
        self._end().replay()
        fn()
        self._steps.append(fn)
        self._begin()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        self._warm_up(run)
        self._pieces, self._steps = [], []
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                self._begin()
                try:
                    out = run()
                finally:
                    if self._open is not None:
                        self._end()
            graph = SplitGraph(self._pieces, self._steps)
        finally:
            self._pieces = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, out


class GraphPlan(NamedTuple):
    """How decode is captured (`mode`), or why it is not (`off_reason`)."""

    mode: GraphMode | None
    off_reason: str | None = None


def choose_graph_mode(parts: Iterable[tuple[str, GraphSupport]], hybrid_mode: GraphMode) -> GraphPlan:
    """CAPTURE when every part is device work only; else `hybrid_mode` (HOST_NODES or SPLIT) when
    every other part allows it; else off, naming the first part that cannot be captured and why."""
    mode = GraphMode.CAPTURE
    for name, support in parts:
        if support.allows(GraphMode.CAPTURE):
            continue
        if not support.allows(hybrid_mode):
            return GraphPlan(None, f"{name} cannot be captured: {support.reason}")
        mode = hybrid_mode
    return GraphPlan(mode)


def plan_decode_graphs(model: torch.nn.Module, backend: AttentionBackend, device: torch.device, max_bs: int,
                       hybrid_mode: str = "host-nodes") -> GraphPlan:
    """How decode graphs of `model` through `backend` are captured on `device`, from the parts'
    `graph_support` (`hybrid_mode`: how parts with host work enter them, HYBRID_GRAPH_MODES)."""
    if hybrid_mode not in HYBRID_GRAPH_MODES:
        raise ValueError(f"hybrid graph mode must be one of {HYBRID_GRAPH_MODES}, got {hybrid_mode!r}")
    if device.type != "cuda":
        return GraphPlan(None, f"the device is {device.type}, not cuda")
    if max_bs < 1:
        return GraphPlan(None, f"--cuda-graph-max-bs is {max_bs}")
    attention = [(f"the {type(backend).__name__} attention backend", backend.graph_support)]
    experts = [(f"the {type(m).__name__} routed-expert backend", m.graph_support)
               for m in model.modules() if isinstance(m, ExpertBackend)]
    hints = ((attention, "--attention-backend triton can"), (attention + experts, "--expert-backend triton can be"))
    for parts, hint in hints:
        plan = choose_graph_mode(parts, GraphMode(hybrid_mode))
        if plan.off_reason is not None:
            return GraphPlan(None, f"{plan.off_reason} ({hint})")
    return plan


def graph_off_reason(model: torch.nn.Module, backend: AttentionBackend, device: torch.device, max_bs: int,
                     hybrid_mode: str = "host-nodes") -> str | None:
    """Why decode cannot run through CUDA graphs here, or None when it can."""
    return plan_decode_graphs(model, backend, device, max_bs, hybrid_mode).off_reason


class GraphedRunner(Protocol):
    """What graph capture needs of the model runner (`executor.model_runner.ModelRunner`, which owns
    and calls this module; typed structurally so the two do not import each other)."""

    model: torch.nn.Module
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    max_context_len: int
    device: torch.device
    omnikv: OmniKVConfig | None
    omnikv_plan: LayerPlan | None
    query_history: QueryHistory | None
    context_bank: ContextBank | None


def omnikv_width(context: int, max_context_len: int) -> int:
    """The context bucket of an OmniKV graph: the smallest power of two >= `context` (at least 16), at
    most `max_context_len`."""
    return min(max(16, 1 << max(0, context - 1).bit_length()), max_context_len)


class CudaGraphRunner:
    """Captured decode forwards of one `ModelRunner`, one graph per padded batch size, captured in
    `mode` (from `plan_decode_graphs`). SPLIT needs a capture that can be cut around host work: its
    `host_step(fn)` (a `kernels.graph_support.HostStep`) is what the expert backends get."""

    def __init__(self, runner: GraphedRunner, max_bs: int, capture: GraphCapture,
                 mode: GraphMode = GraphMode.CAPTURE) -> None:
        self.mode = mode
        self._host_step: HostStep | None = getattr(capture, "host_step", None) if mode is GraphMode.SPLIT else None
        if mode is GraphMode.SPLIT and self._host_step is None:
            raise ValueError("a split capture needs a capture mechanism with host_step (SplitCudaGraphCapture)")
        self.batch_sizes = capture_batch_sizes(max_bs)
        if not self.batch_sizes:
            raise ValueError(f"CUDA graphs need max_bs >= 1, got {max_bs}")
        self.max_bs = self.batch_sizes[-1]
        self.model = runner.model
        self.backend = runner.attn_backend
        self.req_to_token_pool = runner.req_to_token_pool
        self.kv_pool = runner.kv_pool
        self.max_context_len = runner.max_context_len
        self.device = runner.device
        self._capture = capture
        # Static inputs, filled with the dummy request; graphs read their first rows.
        self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc = (
            torch.zeros(self.max_bs, dtype=torch.int64, device=self.device) for _ in range(4)
        )
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, CapturedGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # OmniKV decode graphs, per (padded size, context bucket), captured when first needed
        self._runner = runner  # its OmniKV config and query history are read at each capture
        self.omnikv_budgets = torch.zeros(self.max_bs, dtype=torch.int32, device=self.device)
        self.omnikv_sparse = torch.zeros(self.max_bs, dtype=torch.bool, device=self.device)
        self.omnikv_graphs: dict[tuple[int, int, bool], CapturedGraph] = {}
        self.omnikv_outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        # each OmniKV graph's OmniKVBatch, kept as long as the graph: it holds tensors made before the
        # capture that the graph reads at every replay (the alpha table), which would otherwise be freed
        # with it and their memory handed to other tensors
        self.omnikv_batches: dict[tuple[int, int, bool], OmniKVBatch] = {}
        self.omnikv_off_reason: str | None = None  # set when a capture failed: OmniKV decodes run eagerly
        self.experts = [m for m in self.model.modules() if isinstance(m, ExpertBackend)]
        # what the expert backends prepared for these graphs (host tasks, ...): kept while they are
        self.host_work: list[CapturedHostWork] = []

    def _static_batch(self, bs: int, seq_lens_cpu: list[int], prefix_lens_cpu: list[int],
                      omnikv: OmniKVBatch | None = None) -> ForwardBatch:
        """A DECODE batch over the first `bs` rows of the static buffers."""
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=prefix_lens_cpu,
            extend_seq_lens_cpu=[1] * bs,
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
            omnikv=omnikv,
        )

    def _fill_dummy(self, start: int, end: int) -> None:
        """Rows start..end-1 become the dummy request (row 0, seq_len 1, position 0, slot 0, token 0)."""
        if start >= end:
            return
        for buf in (self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc, self.omnikv_budgets,
                    self.omnikv_sparse):
            buf[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    @torch.no_grad()
    def capture(self) -> None:
        """Records one graph per batch size, largest first (the smaller ones reuse its memory)."""
        self.backend.init_cuda_graph_state(self.max_bs, self.max_context_len, self.device)
        self.host_work = [w for e in self.experts
                          if (w := e.prepare_cuda_graph(self.max_bs, self.mode, self._host_step)) is not None]
        self._fill_dummy(0, self.max_bs)
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs, [1] * bs, [0] * bs)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            graph, out = self._capture(lambda b=batch: self.model.forward_prepared(b))
            self.graphs[bs], self.outputs[bs] = graph, out
        logger.info("CUDA graphs captured for decode batch sizes %s", ", ".join(map(str, self.batch_sizes)))

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode batch of one token per request, last-token logits only, within the captured sizes
        (with OmniKV rows when OmniKV graphs can be made here)."""
        return (
            bool(self.graphs)
            and batch.forward_mode.is_decode()
            and batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
            and batch.logits_indices is None
            and (batch.omnikv is None or self._omnikv_can_run(batch))
            and batch.attn_backend is self.backend
            and batch.token_to_kv_pool is self.kv_pool
            and batch.req_to_token_pool is self.req_to_token_pool
        )

    def _omnikv_can_run(self, batch: ForwardBatch) -> bool:
        sparse = batch.omnikv
        return (
            sparse is not None
            and self.omnikv_off_reason is None
            and self.mode is GraphMode.CAPTURE  # host work (CPU experts) is bound per size at the first capture
            and self.backend.omnikv_graphs
            and self._runner.omnikv is not None and self._runner.omnikv_plan is not None
            and sparse.graph is None
        )

    def drop_omnikv_graphs(self) -> None:
        """Forgets the OmniKV graphs (their layer roles and budgets are baked in): the runner's OmniKV
        config changed. They are captured again when next needed."""
        self.omnikv_graphs.clear()
        self.omnikv_outputs.clear()
        self.omnikv_batches.clear()

    @torch.no_grad()
    def _capture_omnikv(self, bs: int, width: int, mixed: bool) -> None:
        """Records the OmniKV decode graph of `bs` rows and context bucket `width` (`mixed`: some rows
        attend fully), on the dummy request."""
        cfg, plan = self._runner.omnikv, self._runner.omnikv_plan
        assert cfg is not None and plan is not None
        k_cap = width if mixed else min(width, cfg.budget_for(width) + cfg.sink_tokens + cfg.recent_tokens)
        self._fill_dummy(0, bs)  # warm-up and capture runs write only the dummy slot and history row
        rows = GraphRows(self.req_pool_indices[:bs], self.positions[:bs], self.omnikv_budgets[:bs], width, k_cap,
                         self.omnikv_sparse[:bs] if mixed else None)
        sparse = OmniKVBatch.for_graph(plan.roles, plan.source, rows, sink=cfg.sink_tokens, recent=cfg.recent_tokens,
                                       weights_for=cfg.alpha_weights, table=self.req_to_token_pool.req_to_token,
                                       history=self._runner.query_history, bank=self._runner.context_bank,
                                       heads_max=self._runner.omnikv_heads_max)
        batch = self._static_batch(bs, [1] * bs, [0] * bs, omnikv=sparse)
        self.backend.init_forward_metadata_capture_cuda_graph(batch)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            graph, out = self._capture(lambda b=batch: self.model.forward_prepared(b))
        self.omnikv_graphs[(bs, width, mixed)], self.omnikv_outputs[(bs, width, mixed)] = graph, out
        self.omnikv_batches[(bs, width, mixed)] = sparse
        logger.info("CUDA graph captured for OmniKV decode: batch size %d, context bucket %d, selection %d%s",
                    bs, width, k_cap, " (with full-attention rows)" if mixed else "")

    @torch.no_grad()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs a decode batch (from `ModelRunner.build_batch`) through the graph of its padded size;
        returns logits [bs, V], a view of the graph's output (rewritten by the next replay)."""
        if not self.can_run(batch):
            raise ValueError(f"batch ({batch.forward_mode.name}, {batch.batch_size} requests) cannot replay a "
                             "captured graph; check can_run() first and run it eagerly")
        bs = batch.batch_size
        padded = padded_batch_size(bs, self.batch_sizes)
        assert padded is not None  # can_run checked bs <= max_bs
        graph, out = self.graphs[padded], self.outputs[padded]
        sparse = batch.omnikv
        if sparse is not None:
            width = omnikv_width(max(batch.seq_lens_cpu), self.max_context_len)
            mixed = not sparse.covers(bs)
            key = (padded, width, mixed)
            if key not in self.omnikv_graphs:
                try:
                    self._capture_omnikv(*key)
                except RuntimeError as err:  # refused by the driver or PyTorch: OmniKV decodes run eagerly
                    logger.exception("CUDA graph capture of an OmniKV decode failed; OmniKV decodes run eagerly")
                    self.omnikv_off_reason = str(err)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    return self.model(batch)
            graph, out = self.omnikv_graphs[key], self.omnikv_outputs[key]
            budgets, is_sparse = [width] * bs, [False] * bs  # a full row selects its whole context
            for b, k in zip(sparse.rows, sparse.budgets):
                budgets[b], is_sparse[b] = k, True
            self.omnikv_budgets[:bs].copy_(torch.tensor(budgets, dtype=torch.int32, device=self.device))
            if mixed:
                self.omnikv_sparse[:bs].copy_(torch.tensor(is_sparse, dtype=torch.bool, device=self.device))
        for dst, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.req_pool_indices, batch.req_pool_indices), (self.seq_lens, batch.seq_lens),
                         (self.out_cache_loc, batch.out_cache_loc)):
            dst[:bs].copy_(src, non_blocking=True)
        self._fill_dummy(bs, padded)
        pad = padded - bs
        static = self._static_batch(
            padded, list(batch.seq_lens_cpu) + [1] * pad, list(batch.extend_prefix_lens_cpu) + [0] * pad
        )
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        graph.replay()
        if self.mode is GraphMode.HOST_NODES and self.host_work:
            self._raise_host_errors()
        if sparse is not None:
            sparse.count_selection()
        return out[:bs]

    def _raise_host_errors(self) -> None:
        """Host nodes run on a driver thread, where a failure cannot raise: waits for the replay (the
        sampler would next) and raises what failed in its host work, for this batch."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        errors = [e for work in self.host_work if (e := work.replay_error())]
        if errors:
            raise RuntimeError(f"the CPU routed experts failed during a decode graph replay: {errors[0]}")


def capture_if_supported(runner: GraphedRunner, max_bs: int, hybrid_mode: str = "host-nodes") -> CudaGraphRunner | None:
    """The runner's captured decode graphs, or None (with one log line saying why) where they cannot
    work. `hybrid_mode` (HYBRID_GRAPH_MODES) says how CPU experts enter them."""
    plan = plan_decode_graphs(runner.model, runner.attn_backend, runner.device, max_bs, hybrid_mode)
    if plan.mode is None:
        logger.info("CUDA graphs off: %s", plan.off_reason)
        return None
    with torch.cuda.device(runner.device):
        capture = (SplitCudaGraphCapture if plan.mode is GraphMode.SPLIT else CudaGraphCapture)(runner.device)
        graph_runner = CudaGraphRunner(runner, max_bs, capture, plan.mode)
        try:
            graph_runner.capture()
        except RuntimeError:  # a capture the driver or PyTorch refuses: serve eagerly, and say so loudly
            logger.exception("CUDA graph capture failed; decode runs eagerly (--disable-cuda-graph skips the "
                             "attempt%s)", ", --hybrid-graph-mode split avoids host nodes"
                             if plan.mode is GraphMode.HOST_NODES else "")
            torch.cuda.synchronize(runner.device)
            return None
    return graph_runner
