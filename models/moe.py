"""DeepSeek MoE layer: router + routed experts (through an expert backend) + shared experts.

The routed experts sit behind `ExpertBackend`, whose `submit(...)` may return before the work is
done (the `cpp` backend computes on CPU threads) and `sync()` returns the result. The layer submits
routed work first, runs the shared experts meanwhile, then syncs — so CPU and GPU overlap when the
routed experts live on the CPU.

Backends (`EXPERT_BACKENDS`, chosen once at start-up by `--expert-backend`):
- `torch` (`TorchExperts`): the reference, on the model's device, in the model's dtype. Stacked
  weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
- `cpp` (`CppExperts`): the `cpp_experts` C++ pool on the CPU (the extension is imported only when
  this backend is built), weights in the pool's own memory; see the class for formats and devices.
- `triton` (`TritonExperts`): the fused-MoE Triton kernels (`kernels/fused_moe.py`) on CUDA, same
  weights as `torch`; no host sync, so CUDA graphs can capture it (`graph_safe`).

Weights reach a backend one (expert, kind) at a time through `load_expert`, as a float tensor in HF
layout or, for backends with `accepts_raw_blocks`, as GGUF `RawBlocks` left quantized by the loader.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.moe_routing import select_experts
from models.config import MoEConfig
from models.layers import GatedMLP
from models.loader.raw_blocks import RawBlocks

EXPERT_BACKENDS = ("torch", "cpp", "triton")
logger = logging.getLogger(__name__)


class ExpertBackend(nn.Module, ABC):
    """Computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for every token t."""

    accepts_raw_blocks = False  # True: `load_expert` takes GGUF `RawBlocks` (the loader skips decoding)
    graph_safe = False  # True: a CUDA graph may capture `submit`/`sync` (no host sync, or host work as graph nodes)
    host_work_in_graph = False  # True: captured graphs run host code (replay_error says how it went)
    splits_graph = False  # True: under a split capture (`host_steps`) its host work runs between graph pieces

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    @abstractmethod
    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        """Loads one expert's `kind` ('gate_proj' | 'up_proj' | 'down_proj') weight in HF layout
        (gate/up [I, H], down [H, I]); `RawBlocks` only where `accepts_raw_blocks`."""

    @abstractmethod
    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] fp32. May return before done."""

    @abstractmethod
    def sync(self) -> torch.Tensor:
        """Waits for the submitted work; returns [T, H] in the hidden dtype."""

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden, topk_ids, topk_weights)
        return self.sync()

    def graph_unsafe_reason(self) -> str:
        """Why a graph cannot capture this backend (asked only when `graph_safe` is False)."""
        return "it synchronizes with the host"

    def prepare_cuda_graph(self, max_tokens: int) -> None:
        """Called once before decode graphs of up to `max_tokens` tokens are captured: anything the
        captures must find already allocated (memory a graph will address) is made here."""

    def replay_error(self) -> str | None:
        """For `host_work_in_graph` backends, after the stream has been synchronized: what failed in
        the host work of the replays since the last call, or None."""
        return None


class TorchExperts(ExpertBackend):
    """Reference routed experts on the model's device: tokens grouped by expert, one GEMM pair each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self._result: torch.Tensor | None = None

    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        if isinstance(weight, RawBlocks):
            weight = weight.dequantize()
        i = self.intermediate_size
        target = {
            "gate_proj": self.w13.data[expert_id, :i],
            "up_proj": self.w13.data[expert_id, i:],
            "down_proj": self.w2.data[expert_id],
        }[kind]
        target.copy_(weight)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // k
        weight_of = topk_weights.reshape(-1)[order]
        out = torch.zeros(t, self.hidden_size, dtype=torch.float32, device=hidden.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gate, up = F.linear(hidden[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, tok, y.float() * weight_of[start : start + n, None])
            start += n
        self._result = out.to(hidden.dtype)

    def sync(self) -> torch.Tensor:
        assert self._result is not None, "sync() without submit()"
        out, self._result = self._result, None
        return out


class TritonExperts(TorchExperts):
    """Routed experts through the fused-MoE Triton kernels: tokens sorted into per-expert blocks and
    one grouped GEMM each for gate+up and down, reading only the weights of experts that got tokens.

    Weights and loading as `TorchExperts` (GGUF blocks are dequantized). Needs CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1 (tests). Triton is imported when the backend is built.
    """

    graph_safe = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        try:
            from kernels.fused_moe import fused_experts
        except ImportError as e:
            raise ImportError(
                f"--expert-backend triton needs the triton package, which does not import ({e}); install it "
                "(it comes with CUDA builds of PyTorch) or use --expert-backend torch"
            ) from e
        self._fused_experts = fused_experts

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._result = self._fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)


class CppExperts(ExpertBackend):
    """Routed experts in the `cpp_experts` C++ pool, on CPU threads (the GIL is released meanwhile).

    Weight format, chosen per layer from its first expert whose three weights have all arrived:
    - float tensors (HF checkpoints; GGUF F32/F16/BF16 blocks) -> bf16;
    - GGUF blocks of a type the pool computes on (`cpp_experts.FORMATS`: Q8_0, Q4_0) -> kept
      quantized, the file's bytes as they are;
    - other GGUF block types (Q4_1, Q5_K, Q6_K, ...), or an expert whose gate/up/down types differ
      (llama.cpp's mixed "_M" files) -> dequantized to bf16 with one logged warning per layer.
      Chosen over an error so every file the loader reads still serves; the warning names the tensor.
    Each expert's weights are held until its three are present (GGUF blocks are views of the mapped
    file, so that costs nothing), then handed over; `process_weights_after_loading` finalizes.

    Activations: bf16 or fp32 (fp16 goes as fp32), as contiguous CPU tensors. Hybrid placement (the
    model on CUDA, these experts on the CPU): `submit` copies the activations and routing into pinned
    host buffers with non-blocking copies, waits on an event recorded after them (only those copies,
    not the whole stream), hands the work to the pool and returns, so the GPU runs the shared experts
    while the CPU runs the routed ones; `sync` waits for the pool and queues a non-blocking copy of the
    result back. The pinned buffers are shared by every layer (`_HostStaging`): a layer's submit waits
    for its own copies, which the stream orders after the previous layer's copy back, so a buffer is
    never overwritten while a copy still reads it. What `submit` hands the pool stays referenced until
    `sync`, because the pool reads it while the caller runs on.

    Under CUDA stream capture (decode graphs) the same steps become graph nodes: the copies into
    pinned buffers reserved by `prepare_cuda_graph` (fixed addresses, shared by all layers), a host
    node that submits to the pool (`cpp_experts.HostTask`, bound to those buffers once per layer and
    token count), the shared experts' kernels, a host node that waits for the pool, and the copy
    back. A replay thus runs the CPU experts in stream order with no Python; the stream is the only
    thing that waits. Graph-safe wherever the CUDA driver offers `cuLaunchHostFunc`.

    The alternative (`splits_graph`): a capture split around the host work (`host_steps`) ends the
    graph piece at each submit and sync, and runs the eager submit / sync between the pieces'
    replays. Python then runs twice per layer and step, but nothing waits on a driver thread.
    """

    accepts_raw_blocks = True
    _KINDS = ("gate_proj", "up_proj", "down_proj")

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, top_k: int, num_threads: int | None = None
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        try:
            import cpp_experts
        except ImportError as e:
            raise ImportError(
                f"--expert-backend cpp needs the cpp_experts extension, which does not import ({e}); "
                "build it with `pip install -e .` or use --expert-backend torch"
            ) from e
        self._ext = cpp_experts
        self.top_k = top_k
        self.num_threads = num_threads
        self.weight_format: str | None = None  # set by the first complete expert
        self._moe: Any = None  # cpp_experts.MoE, built with the format
        self._pending: dict[int, dict[str, torch.Tensor | RawBlocks]] = {}  # expert -> kinds so far
        self._loaded: set[int] = set()  # experts handed to the pool
        self._warned = False
        self._inflight: _Inflight | None = None  # the submitted call, until sync
        self._graph_tasks: dict[tuple[Any, ...], Any] = {}  # (tokens, dtype, buffer addresses) -> HostTask
        self._split_sync: _SplitSync | None = None  # a split capture's pending sync step
        self._failures_seen = 0  # host-task failures already reported by replay_error

    host_work_in_graph = True
    splits_graph = True

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        return self._ext.cuda_host_launch_error() is None

    def graph_unsafe_reason(self) -> str:
        return (f"{self._ext.cuda_host_launch_error()}, so the CPU experts cannot be queued on the stream "
                "(--hybrid-graph-mode split needs no host functions)")

    @property
    def memory_bytes(self) -> int:
        """Bytes of expert weights the pool holds (0 before loading)."""
        return 0 if self._moe is None else int(self._moe.memory_bytes)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, weight_format={self.weight_format}"

    # ---- weights ----
    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        if not isinstance(weight, RawBlocks):
            weight = weight.detach().to("cpu", torch.bfloat16).contiguous()
        parts = self._pending.setdefault(expert_id, {})
        parts[kind] = weight
        if len(parts) == len(self._KINDS):
            self._hand_over(expert_id, parts)
            del self._pending[expert_id]
            self._loaded.add(expert_id)

    def _quantized_formats(self) -> set[str]:
        """The block formats the pool computes on, named like ggml's types in lower case."""
        return {f for f in self._ext.FORMATS if f != "bf16"}

    def _hand_over(self, expert_id: int, parts: dict[str, torch.Tensor | RawBlocks]) -> None:
        quantized = self._quantized_formats()
        formats = {
            w.qtype.name.lower() if isinstance(w, RawBlocks) and w.qtype.name.lower() in quantized else "bf16"
            for w in parts.values()
        }
        fmt = formats.pop() if len(formats) == 1 else "bf16"
        if self._moe is None:
            self.weight_format = fmt
            self._moe = self._ext.MoE(self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
                                      weight_format=fmt, num_threads=self.num_threads)
        elif fmt != self.weight_format and self.weight_format != "bf16":
            raise ValueError(f"expert {expert_id} has {fmt} weights but this layer's earlier experts are "
                             f"{self.weight_format} (the cpp backend keeps one format per layer)")
        if self.weight_format == "bf16":
            self._warn_dequantized(parts.values())
            g, u, d = (w.dequantize().to(torch.bfloat16) if isinstance(w, RawBlocks) else w
                       for w in (parts[k] for k in self._KINDS))
        else:
            g, u, d = (parts[k].to_tensor() for k in self._KINDS)  # type: ignore[union-attr]
        self._moe.load_expert(expert_id, g, u, d)

    def _warn_dequantized(self, weights: Any) -> None:
        blocks = [w for w in weights if isinstance(w, RawBlocks) and w.qtype.name not in ("F32", "F16", "BF16")]
        if blocks and not self._warned:
            self._warned = True
            types = ", ".join(sorted({w.qtype.name for w in blocks}))
            logger.warning(
                "cpp expert backend: %s (%s) and its layer's other experts are dequantized to bf16: the pool "
                "keeps only %s quantized (and needs one type for gate, up and down)",
                blocks[0].name, types, ", ".join(sorted(f.upper() for f in self._quantized_formats())),
            )

    def process_weights_after_loading(self) -> None:
        missing = sorted(set(range(self.num_experts)) - self._loaded)
        if missing:
            raise RuntimeError(f"cpp experts: expert(s) {missing[:5]} did not get all of gate, up and down")
        self._moe.finalize()

    # ---- compute ----
    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._moe is None:
            raise RuntimeError("cpp experts used before their weights were loaded")
        if self._inflight is not None:
            raise RuntimeError("submit() twice without sync()")
        if stream_capturing(hidden.device):
            step = _HOST_STEP.get()
            if step is None:
                self._submit_in_graph(hidden, topk_ids, topk_weights)
            else:
                self._submit_split(step, hidden, topk_ids, topk_weights)
            return
        self._submit_now(hidden, topk_ids, topk_weights)

    def _submit_now(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The eager submit (also a host step between split graph pieces)."""
        x, ids, weights = _pool_input(hidden), topk_ids, topk_weights.float()
        out = None
        if hidden.device.type == "cpu":
            x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
        else:
            staging = _HostStaging.get()
            x, ids, weights = (staging.copy_in(name, t) for name, t in (("x", x), ("ids", ids), ("w", weights)))
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(hidden.device))
            done.synchronize()  # the three copies have landed; later GPU work keeps running
            out = staging.buffer("out", x.shape, x.dtype)
        if x.shape[0] and out is None:
            self._moe.submit(x, ids, weights)
        elif x.shape[0]:
            self._moe.submit(x, ids, weights, out=out)
        self._inflight = _Inflight(hidden.device, hidden.dtype, x, ids, weights, out, None)

    def sync(self) -> torch.Tensor:
        split, self._split_sync = self._split_sync, None
        if split is not None:  # split capture: the piece ends, the wait runs between pieces
            split.step(split.run)
            assert split.result is not None
            return split.result
        call = self._inflight
        assert call is not None, "sync() without submit()"
        if call.task is not None:  # captured: a host node waits for the pool, then the graph copies back
            self._inflight = None
            _queue(call.task.enqueue_sync, call.task.run_sync, call.device)
            out = call.out.clone() if call.device.type == "cpu" else call.out.to(call.device, non_blocking=True)
            return out.to(call.dtype)
        return self._sync_now()

    def _sync_now(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """The eager sync: the result on the activations' device, copied into `into` when given."""
        call = self._inflight
        assert call is not None, "sync() without submit()"
        device, dtype, x = call.device, call.dtype, call.x
        self._inflight = None
        out = self._moe.sync() if x.shape[0] else x.new_zeros(x.shape)
        if into is not None:
            return into.copy_(out, non_blocking=True)
        if device.type != "cpu":
            out = out.to(device, non_blocking=True)
        return out.to(dtype)

    def _submit_split(self, step: Callable[[Callable[[], None]], None], hidden: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Split capture: the graph piece being captured ends here, and the eager submit runs between
        it and the next one, on these tensors: the piece's outputs, which each replay rewrites in
        place. The next piece (the shared experts) then runs on the GPU while the pool works."""
        step(lambda: self._submit_now(hidden, topk_ids, topk_weights))  # sets _inflight, as at every replay
        self._split_sync = _SplitSync(self, step)

    # ---- decode graphs ----
    def prepare_cuda_graph(self, max_tokens: int) -> None:
        if self._moe is None:
            raise RuntimeError("cpp experts: weights must be loaded before graphs are captured")
        k, h = self.top_k, self.hidden_size
        _HostStaging.for_graphs().reserve({"x": max_tokens * h * 4, "ids": max_tokens * k * 4,
                                           "w": max_tokens * k * 4, "out": max_tokens * h * 4})

    def _submit_in_graph(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The captured submit: copies into the graph's pinned buffers, then a host node that hands
        them to the pool. One task per token count and buffers, reused by every later capture."""
        staging = _HostStaging.for_graphs()
        x = staging.copy_in("x", _pool_input(hidden))
        ids = staging.copy_in("ids", topk_ids.to(torch.int32))
        weights = staging.copy_in("w", topk_weights.float())
        out = staging.buffer("out", x.shape, x.dtype)
        key = (x.shape[0], x.dtype, *(t.data_ptr() for t in (x, ids, weights, out)))
        task = self._graph_tasks.get(key)
        if task is None:
            task = self._graph_tasks[key] = self._moe.host_task(x, ids, weights, out)
        _queue(task.enqueue_submit, task.run_submit, hidden.device)
        self._inflight = _Inflight(hidden.device, hidden.dtype, x, ids, weights, out, task)

    def replay_error(self) -> str | None:
        failures = self._moe.host_failures  # one read per replay; the tasks are asked only after a failure
        if failures == self._failures_seen:
            return None
        self._failures_seen = failures
        errors = [e for task in self._graph_tasks.values() if (e := task.take_error())]
        return errors[0] if errors else None


class _Inflight(NamedTuple):
    """A submitted call: the tensors the pool may still read stay referenced here until `sync`."""

    device: torch.device  # of the activations (the result goes back there)
    dtype: torch.dtype  # of the activations
    x: torch.Tensor  # what the pool reads (host memory)
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None  # host buffer the pool writes (None: the pool allocates it)
    task: Any  # cpp_experts.HostTask under capture with host nodes, else None


def _pool_input(hidden: torch.Tensor) -> torch.Tensor:
    """Activations in a dtype the pool computes on (bf16 or fp32; others go as fp32)."""
    return hidden if hidden.dtype in (torch.float32, torch.bfloat16) else hidden.float()


class _SplitSync:
    """The sync half of a split capture's host work: waits for the pool and copies the result into
    one device tensor, made on the first run (at capture, outside any graph) and reused by every
    replay, so the pieces captured after it read a fixed address."""

    def __init__(self, experts: CppExperts, step: Callable[[Callable[[], None]], None]) -> None:
        self.experts, self.step = experts, step
        self.result: torch.Tensor | None = None

    def run(self) -> None:
        self.result = self.experts._sync_now(self.result)


# While a decode capture is split around host work (the alternative to host nodes), `host_step(fn)`
# of that capture: it ends the graph piece being captured, runs `fn` now and between that piece's
# and the next one's replays ever after, and begins the next piece.
_HOST_STEP: ContextVar[Callable[[Callable[[], None]], None] | None] = ContextVar("host_step", default=None)


@contextmanager
def host_steps(step: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """Backends with `splits_graph` hand their host work to `step` during this (split) capture."""
    token = _HOST_STEP.set(step)
    try:
        yield
    finally:
        _HOST_STEP.reset(token)


def stream_capturing(device: torch.device) -> bool:
    """Whether work issued now for `device` is being recorded into a CUDA graph (host work must then
    be queued on the stream, not done)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _queue(enqueue: Callable[[int], None], run_now: Callable[[], None], device: torch.device) -> None:
    """Host work in stream order: on a CUDA device queued on the current stream (a host node under
    capture); on the CPU (which has no stream) done now."""
    if device.type == "cuda":
        enqueue(torch.cuda.current_stream(device).cuda_stream)
    else:
        run_now()


class _HostStaging:
    """Host buffers (pinned where CUDA is) for hybrid placement, one per role, shared by all layers.

    Two instances: `get()` for eager forwards grows on demand; `for_graphs()` is sized by `reserve`
    before capture. Captured copies and host tasks address its buffers, so a buffer it outgrows is
    retired, never freed: graphs captured earlier keep working on it.
    """

    _eager: _HostStaging | None = None
    _graphs: _HostStaging | None = None

    def __init__(self, fixed: bool) -> None:
        self.fixed = fixed
        self._bufs: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    @classmethod
    def get(cls) -> _HostStaging:
        if cls._eager is None:
            cls._eager = cls(fixed=False)
        return cls._eager

    @classmethod
    def for_graphs(cls) -> _HostStaging:
        if cls._graphs is None:
            cls._graphs = cls(fixed=True)
        return cls._graphs

    def _alloc(self, name: str, nbytes: int) -> None:
        old = self._bufs.get(name)
        if old is not None and self.fixed:
            self._retired.append(old)
        self._bufs[name] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def reserve(self, sizes: dict[str, int]) -> None:
        """Makes each named buffer at least this many bytes."""
        for name, nbytes in sizes.items():
            buf = self._bufs.get(name)
            if buf is None or buf.numel() < nbytes:
                self._alloc(name, nbytes)

    def buffer(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            if self.fixed:  # growing here, under capture, would allocate pinned memory mid-capture
                raise RuntimeError(f"graph staging buffer {name!r} needs {nbytes} bytes, "
                                   f"{0 if buf is None else buf.numel()} reserved: call prepare_cuda_graph first")
            self._alloc(name, nbytes)
            buf = self._bufs[name]
        return buf[:nbytes].view(dtype).view(shape)

    def copy_in(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking copy of `t` into the host buffer `name`."""
        return self.buffer(name, t.shape, t.dtype).copy_(t, non_blocking=True)


def create_expert_backend(
    name: str, num_experts: int, hidden_size: int, intermediate_size: int, *, top_k: int
) -> ExpertBackend:
    if name == "torch":
        return TorchExperts(num_experts, hidden_size, intermediate_size)
    if name == "cpp":
        return CppExperts(num_experts, hidden_size, intermediate_size, top_k=top_k)
    if name == "triton":
        return TritonExperts(num_experts, hidden_size, intermediate_size)
    raise ValueError(f"unknown expert backend {name!r} (available: {', '.join(EXPERT_BACKENDS)})")


class Router(nn.Module):
    """Router weights (HF `mlp.gate`): logits in fp32, then DeepSeek's top-k selection.

    Its parameters stay fp32 whatever the model dtype (`keep_fp32`): the V3 correction bias separates
    experts by small margins that bf16 would erase.
    """

    keep_fp32 = True

    def __init__(self, cfg: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size), requires_grad=False)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden_size: int, expert_backend: str = "torch") -> None:
        super().__init__()
        self.gate = Router(cfg, hidden_size)
        self.experts = create_expert_backend(
            expert_backend, cfg.num_experts, hidden_size, cfg.intermediate_size, top_k=cfg.top_k
        )
        self.shared_experts = (
            GatedMLP(hidden_size, cfg.intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        routed = self.experts.sync()
        return routed if shared is None else routed + shared
