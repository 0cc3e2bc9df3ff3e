"""How a CPU-expert layer's submit and sync run: three small strategies, one per way of running.

* `EagerCalls`: now. CPU activations go to the operator as they are. Hybrid placement (the model on
  CUDA): `submit` copies the activations and routing into the pool's pinned staging with
  non-blocking copies, waits on an event recorded after them (only those copies, not the whole
  stream), hands the work to the operator and returns, so the GPU runs the shared experts while the
  CPU runs the routed ones; the result's `result()` waits for the operator and queues a non-blocking
  copy back. A layer's submit waits for its own copies, which the stream orders after the previous
  layer's copy back, so a staging buffer is never overwritten while a copy still reads it.
* `HostNodeCalls`: under capture, as graph nodes: copies into the graph staging (reserved before
  capture: fixed addresses), a host node that submits (`cpp_experts.HostTask`, bound once per token
  count and buffers), then at `result()` a host node that waits for the operator and the copy back.
  A replay runs the CPU experts in stream order with no Python.
* `SplitCalls`: under a split capture: the graph piece ends at submit and at sync (`HostStep`), and
  the eager submit / sync run between the pieces' replays.

What a submit hands the operator stays referenced by its pending call until the result is taken,
because the operator reads it while the caller runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.graph_support import HostStep
from models.experts.cpu_pool import HostStaging


def pool_input(hidden: torch.Tensor) -> torch.Tensor:
    """Activations in a dtype the operator computes on (bf16 or fp32; others go as fp32)."""
    return hidden if hidden.dtype in (torch.float32, torch.bfloat16) else hidden.float()


def _queue(enqueue: Callable[[int], None], run_now: Callable[[], None], device: torch.device) -> None:
    """Host work in stream order: on a CUDA device queued on the current stream (a host node under
    capture); on the CPU (which has no stream) done now."""
    if device.type == "cuda":
        enqueue(torch.cuda.current_stream(device).cuda_stream)
    else:
        run_now()


class EagerCall:
    """A submitted eager call: the tensors the operator reads stay referenced until `result`."""

    def __init__(self, op: Any, hidden: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None) -> None:
        self.op, self.device, self.dtype = op, hidden.device, hidden.dtype
        self.tensors = (x, ids, weights, out)

    def result(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """Waits for the operator; the result on the activations' device (copied into `into` if given)."""
        x = self.tensors[0]
        out = self.op.sync() if x.shape[0] else x.new_zeros(x.shape)
        if into is not None:
            return into.copy_(out, non_blocking=True)
        if self.device.type != "cpu":
            out = out.to(self.device, non_blocking=True)
        return out.to(self.dtype)


class EagerCalls:
    def __init__(self, op: Any, staging: HostStaging) -> None:
        self.op, self.staging = op, staging

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> EagerCall:
        x, ids, weights = pool_input(hidden), topk_ids, topk_weights.float()
        out = None
        if hidden.device.type == "cpu":
            x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
        else:
            x, ids, weights = (self.staging.copy_in(name, t) for name, t in (("x", x), ("ids", ids), ("w", weights)))
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(hidden.device))
            done.synchronize()  # the three copies have landed; later GPU work keeps running
            out = self.staging.buffer("out", x.shape, x.dtype)
        if x.shape[0]:
            self.op.submit(x, ids, weights, out=out)
        return EagerCall(self.op, hidden, x, ids, weights, out)


class HostNodeCall:
    def __init__(self, task: Any, hidden: torch.Tensor, out: torch.Tensor) -> None:
        self.task, self.device, self.dtype, self.out = task, hidden.device, hidden.dtype, out

    def result(self) -> torch.Tensor:
        _queue(self.task.enqueue_sync, self.task.run_sync, self.device)
        out = self.out.clone() if self.device.type == "cpu" else self.out.to(self.device, non_blocking=True)
        return out.to(self.dtype)


class HostNodeCalls:
    """Also what the graph runner keeps for its graphs (`CapturedHostWork`): the bound tasks, which
    must outlive every graph that runs them, and their failures."""

    def __init__(self, op: Any, staging: HostStaging) -> None:
        self.op, self.staging = op, staging
        self.tasks: dict[tuple[Any, ...], Any] = {}  # (tokens, dtype, buffer addresses) -> HostTask
        self._failures_seen = 0

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> HostNodeCall:
        x = self.staging.copy_in("x", pool_input(hidden))
        ids = self.staging.copy_in("ids", topk_ids.to(torch.int32))
        weights = self.staging.copy_in("w", topk_weights.float())
        out = self.staging.buffer("out", x.shape, x.dtype)
        key = (x.shape[0], x.dtype, *(t.data_ptr() for t in (x, ids, weights, out)))
        task = self.tasks.get(key)
        if task is None:
            task = self.tasks[key] = self.op.host_task(x, ids, weights, out)
        _queue(task.enqueue_submit, task.run_submit, hidden.device)
        return HostNodeCall(task, hidden, out)

    def replay_error(self) -> str | None:
        failures = self.op.host_failures  # one read per replay; the tasks are asked only after a failure
        if failures == self._failures_seen:
            return None
        self._failures_seen = failures
        errors = [e for task in self.tasks.values() if (e := task.take_error())]
        return errors[0] if errors else None


class SplitCall:
    """One layer's host work under a split capture: its submit and sync steps run at capture and
    between the pieces' replays ever after, on the pieces' outputs (rewritten in place by each
    replay). The result goes to one device tensor made on the first run (at capture, outside any
    graph) and rewritten by every replay, so the pieces captured after it read a fixed address."""

    def __init__(self, eager: EagerCalls, step: HostStep) -> None:
        self.eager, self.step = eager, step
        self.pending: EagerCall | None = None
        self.out: torch.Tensor | None = None

    def submit_now(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self.pending = self.eager.submit(hidden, topk_ids, topk_weights)

    def sync_now(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None, "split sync step without its submit step"
        self.out = pending.result(self.out)

    def result(self) -> torch.Tensor:
        self.step(self.sync_now)
        assert self.out is not None
        return self.out


class SplitCalls:
    def __init__(self, eager: EagerCalls, step: HostStep) -> None:
        self.eager, self.step = eager, step

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> SplitCall:
        call = SplitCall(self.eager, self.step)
        self.step(lambda: call.submit_now(hidden, topk_ids, topk_weights))
        return call

    def replay_error(self) -> str | None:
        return None  # the host steps run eagerly: a failure raises at once
