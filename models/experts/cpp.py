"""`CppExperts`: routed experts in the `cpp_experts` C++ operator, on CPU threads (the GIL is
released meanwhile), as one MoE layer's expert backend.

Three parts with three owners:
- the packed weights and their format (`CpuExpertWeights`), made while the model loads;
- the worker threads and host staging (`CpuExpertPool`), made and closed by the executor, which
  binds the layer to it (`bind`) before the first forward;
- how submit and sync run (`host_calls`): eagerly, or under capture as host nodes or between split
  graph pieces; the capture strategy is chosen once, when a graph runner prepares its captures.

Activations: bf16 or fp32 (fp16 goes as fp32), on the CPU or, in hybrid placement (the model on
CUDA, these experts on the CPU), on the GPU through pinned staging; see `host_calls`.
"""

from __future__ import annotations

import torch

from kernels.graph_support import GraphMode, GraphSupport, HostStep
from models.experts.base import ExpertBackend, WeightInput
from models.experts.cpu_pool import CpuExpertPool
from models.cpu_ops import import_cpp_experts
from models.experts.cpu_weights import CpuExpertWeights
from models.experts.host_calls import EagerCall, EagerCalls, HostNodeCall, HostNodeCalls, SplitCall, SplitCalls
from models.loader.raw_blocks import RawBlocks


def stream_capturing(device: torch.device) -> bool:
    """Whether work issued now for `device` is being recorded into a CUDA graph (host work must then
    be queued on the stream, not done)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CppExperts(ExpertBackend):
    """A MoE layer's routed experts on the CPU: `weights`, the executor's `pool`, and the strategies."""

    weight_input = WeightInput.GGUF_BLOCKS

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, top_k: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.top_k = top_k
        self.weights = CpuExpertWeights(num_experts, hidden_size, intermediate_size, top_k)
        self.pool: CpuExpertPool | None = None
        self._eager: EagerCalls | None = None  # set by bind
        self._captured: HostNodeCalls | SplitCalls | None = None  # set by prepare_cuda_graph
        self._call: EagerCall | HostNodeCall | SplitCall | None = None  # the submitted call, until sync

    @property
    def graph_support(self) -> GraphSupport:  # type: ignore[override]
        error = import_cpp_experts().cuda_host_launch_error()
        return GraphSupport.host_work(None if error is None else (
            f"{error}, so the CPU experts cannot be queued on the stream "
            "(--hybrid-graph-mode split needs no host functions)"))

    @property
    def weight_format(self) -> str | None:
        return self.weights.format

    @property
    def memory_bytes(self) -> int:
        """Bytes of expert weights the operator holds (0 before loading)."""
        return self.weights.memory_bytes

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, weight_format={self.weight_format}"

    # ---- weights ----
    def load_expert(self, expert_id: int, kind: str, weight: torch.Tensor | RawBlocks) -> None:
        self.weights.load(expert_id, kind, weight)

    def process_weights_after_loading(self) -> None:
        self.weights.finalize()

    # ---- the pool (the executor's) ----
    def bind(self, pool: CpuExpertPool) -> None:
        """Runs on `pool` from now on (graphs captured before keep what they were prepared with)."""
        if self._call is not None:
            raise RuntimeError("cpp experts: bind() between submit() and sync()")
        self.weights.op.bind(pool.workers)
        self.pool = pool
        self._eager = EagerCalls(self.weights.op, pool.staging)

    def unbind(self) -> None:
        if self.pool is None:
            return
        self.weights.op.unbind()
        self.pool, self._eager, self._captured = None, None, None

    # ---- compute ----
    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._call is not None:
            raise RuntimeError("submit() twice without sync()")
        if self._eager is None:
            raise RuntimeError("cpp experts have no worker pool: the executor binds one (CppExperts.bind) "
                               "before they run")
        if not stream_capturing(hidden.device):
            self._call = self._eager.submit(hidden, topk_ids, topk_weights)
        elif self._captured is None:
            raise RuntimeError("cpp experts under CUDA stream capture: call prepare_cuda_graph first")
        else:
            self._call = self._captured.submit(hidden, topk_ids, topk_weights)

    def sync(self) -> torch.Tensor:
        call, self._call = self._call, None
        assert call is not None, "sync() without submit()"
        return call.result()

    # ---- decode graphs ----
    def prepare_cuda_graph(self, max_tokens: int, mode: GraphMode,
                           host_step: HostStep | None = None) -> HostNodeCalls | SplitCalls:
        if self.pool is None or self._eager is None:
            raise RuntimeError("cpp experts: bind a pool before graphs are captured")
        op = self.weights.op  # raises before loading
        if mode is GraphMode.HOST_NODES:
            k, h = self.top_k, self.hidden_size
            self.pool.graph_staging.reserve({"x": max_tokens * h * 4, "ids": max_tokens * k * 4,
                                             "w": max_tokens * k * 4, "out": max_tokens * h * 4})
            self._captured = HostNodeCalls(op, self.pool.graph_staging)
        elif mode is GraphMode.SPLIT:
            if host_step is None:
                raise ValueError("a split capture hands the cpp experts its host step")
            self._captured = SplitCalls(self._eager, host_step)
        else:
            raise ValueError(f"cpp experts do host work: a graph cannot take them as {mode.value}")
        return self._captured
