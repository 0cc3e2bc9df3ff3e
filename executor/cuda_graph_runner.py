"""Decode through captured CUDA graphs (DESIGN.md §4).

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

Hybrid placement (`--expert-backend cpp` on a CUDA device) is captured too, in one of two ways
(`--hybrid-graph-mode`):

* `host-nodes` (default): the CPU experts enter the graph as host nodes (`cpp_experts.HostTask`,
  see `models.moe.CppExperts`), with pinned staging that `prepare_cuda_graph` reserves before the
  first capture; one graph launch per step, no Python per layer. Such a replay then synchronizes
  the stream, so that a failure in the host work is raised for its own batch.
* `split`: `SplitCudaGraphCapture` cuts the forward into graph pieces where the experts hand over
  host work (`models.moe.host_steps`) and runs that work eagerly between the pieces' replays: two
  host steps and three pieces per MoE layer, no host function on a driver thread.

`bench/model_decode_gpu.py --hybrid` times both against eager decode.

The capture mechanism is injected (`GraphCapture`): `CudaGraphCapture` in production; CPU tests pass
a stand-in whose replay re-runs the forward on the static buffers.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from executor.forward_batch import ForwardBatch, ForwardMode
from executor.memory_pool import KVPool, ReqToTokenPool
from kernels.attention.base import AttentionBackend
from models.moe import ExpertBackend, host_steps

logger = logging.getLogger("mlaserve.cuda_graph")


HYBRID_GRAPH_MODES = ("host-nodes", "split")


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
    """`torch.cuda.graph` capture. Every graph shares one memory pool: sizes are captured largest
    first and the smaller ones reuse its intermediate memory (graphs replay one at a time, on one
    stream, so they never need it at once)."""

    warmup_runs = 2
    splits_host_work = False

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
    """Captures a forward as graph pieces cut where a backend hands over host work (`host_steps`):
    the piece so far ends, is replayed at once (a capture records without running, and the host
    step needs the piece's real outputs), the step runs, the next piece begins. All pieces share the
    pool; tensors a step reads or writes stay referenced by it, so their memory is never reused."""

    splits_host_work = True

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        self._warm_up(run)
        pieces: list[torch.cuda.CUDAGraph] = []
        steps: list[Callable[[], None]] = []
        current: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            current.append(graph)

        def host_step(fn: Callable[[], None]) -> None:
            graph = current.pop()
            graph.capture_end()
            pieces.append(graph)
            graph.replay()
            fn()
            steps.append(fn)
            begin()

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            begin()
            try:
                with host_steps(host_step):
                    out = run()
            finally:
                if current:
                    current[-1].capture_end()
                    pieces.append(current.pop())
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return SplitGraph(pieces, steps), out


def graph_off_reason(model: torch.nn.Module, backend: AttentionBackend, device: torch.device, max_bs: int,
                     split: bool = False) -> str | None:
    """Why decode cannot run through CUDA graphs here, or None when it can (`split`: captures split
    around host work, which backends with `splits_graph` can do without being `graph_safe`)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if max_bs < 1:
        return f"--cuda-graph-max-bs is {max_bs}"
    if not backend.supports_cuda_graph:
        return f"the {type(backend).__name__} attention backend cannot be captured (--attention-backend triton can)"
    unsafe = [m for m in model.modules()
              if isinstance(m, ExpertBackend) and not (m.graph_safe or (split and m.splits_graph))]
    if unsafe:
        return (f"the {type(unsafe[0]).__name__} routed-expert backend cannot be captured: "
                f"{unsafe[0].graph_unsafe_reason()} (--expert-backend triton can be)")
    return None


class GraphedRunner(Protocol):
    """What graph capture needs of the model runner (`executor.model_runner.ModelRunner`, which owns
    and calls this module; typed structurally so the two do not import each other)."""

    model: torch.nn.Module
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    max_context_len: int
    device: torch.device


class CudaGraphRunner:
    """Captured decode forwards of one `ModelRunner`, one graph per padded batch size."""

    def __init__(self, runner: GraphedRunner, max_bs: int, capture: GraphCapture) -> None:
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
        self.experts = [m for m in self.model.modules() if isinstance(m, ExpertBackend)]
        # backends whose graphs run host code (the CPU experts of hybrid placement): a replay waits
        # for the stream so that a failure there is raised for this batch instead of passing unseen
        self.host_experts = [] if getattr(capture, "splits_host_work", False) else \
            [e for e in self.experts if e.host_work_in_graph]

    def _static_batch(self, bs: int, seq_lens_cpu: list[int], prefix_lens_cpu: list[int]) -> ForwardBatch:
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
        )

    def _fill_dummy(self, start: int, end: int) -> None:
        """Rows start..end-1 become the dummy request (row 0, seq_len 1, position 0, slot 0, token 0)."""
        if start >= end:
            return
        for buf in (self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc):
            buf[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    @torch.no_grad()
    def capture(self) -> None:
        """Records one graph per batch size, largest first (the smaller ones reuse its memory)."""
        self.backend.init_cuda_graph_state(self.max_bs, self.max_context_len, self.device)
        for experts in self.experts:
            experts.prepare_cuda_graph(self.max_bs)
        self._fill_dummy(0, self.max_bs)
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs, [1] * bs, [0] * bs)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            graph, out = self._capture(lambda b=batch: self.model.forward_prepared(b))
            self.graphs[bs], self.outputs[bs] = graph, out
        logger.info("CUDA graphs captured for decode batch sizes %s", ", ".join(map(str, self.batch_sizes)))

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode batch of one token per request, last-token logits only, within the captured sizes."""
        return (
            bool(self.graphs)
            and batch.forward_mode.is_decode()
            and batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
            and batch.logits_indices is None
            and batch.attn_backend is self.backend
            and batch.token_to_kv_pool is self.kv_pool
            and batch.req_to_token_pool is self.req_to_token_pool
        )

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
        self.graphs[padded].replay()
        if self.host_experts:
            self._raise_host_errors()
        return self.outputs[padded][:bs]

    def _raise_host_errors(self) -> None:
        """Waits for the replay (the sampler would next) and raises what failed in its host work."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        errors = [e for experts in self.host_experts if (e := experts.replay_error())]
        if errors:
            raise RuntimeError(f"the CPU routed experts failed during a decode graph replay: {errors[0]}")


def capture_if_supported(runner: GraphedRunner, max_bs: int, hybrid_mode: str = "host-nodes") -> CudaGraphRunner | None:
    """The runner's captured decode graphs, or None (with one log line saying why) where they cannot
    work. `hybrid_mode` (HYBRID_GRAPH_MODES) says how CPU experts enter them."""
    if hybrid_mode not in HYBRID_GRAPH_MODES:
        raise ValueError(f"hybrid graph mode must be one of {HYBRID_GRAPH_MODES}, got {hybrid_mode!r}")
    split = hybrid_mode == "split" and any(
        isinstance(m, ExpertBackend) and m.splits_graph for m in runner.model.modules())
    reason = graph_off_reason(runner.model, runner.attn_backend, runner.device, max_bs, split=split)
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None
    with torch.cuda.device(runner.device):
        capture = (SplitCudaGraphCapture if split else CudaGraphCapture)(runner.device)
        graph_runner = CudaGraphRunner(runner, max_bs, capture)
        try:
            graph_runner.capture()
        except RuntimeError:  # a capture the driver or PyTorch refuses: serve eagerly, and say so loudly
            logger.exception("CUDA graph capture failed; decode runs eagerly (--disable-cuda-graph skips the "
                             "attempt%s)", ", --hybrid-graph-mode split avoids host nodes" if graph_runner.host_experts
                             else "")
            torch.cuda.synchronize(runner.device)
            return None
    return graph_runner
