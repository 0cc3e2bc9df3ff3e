"""What the CPU experts of one executor run on: worker threads and host staging buffers.

The executor (`executor.model_runner.ModelRunner`) makes a `CpuExpertPool` for a model with CPU
experts, binds the layers to it (`CppExperts.bind`) and closes it: nothing here lives longer than
the executor that made it, and two executors in one process share nothing.
"""

from __future__ import annotations

import torch

from models.cpu_ops import import_cpp_experts


class HostStaging:
    """Host buffers (pinned where CUDA is) for hybrid placement, one per role, shared by the layers
    of one pool.

    `fixed=False` (eager forwards) grows on demand. `fixed=True` (graphs) is sized by `reserve`
    before capture: captured copies and host tasks address its buffers, so a buffer it outgrows is
    retired, never freed, and graphs captured earlier keep working on it.
    """

    def __init__(self, fixed: bool) -> None:
        self.fixed = fixed
        self._bufs: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

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

    def release(self) -> None:
        self._bufs.clear()
        self._retired.clear()


class CpuExpertPool:
    """The native worker threads (`cpp_experts.WorkerPool`) and the host staging of one executor:
    `staging` for eager forwards, `graph_staging` for its captured graphs."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.workers = import_cpp_experts().WorkerPool(num_threads)
        self.staging = HostStaging(fixed=False)
        self.graph_staging = HostStaging(fixed=True)

    @property
    def closed(self) -> bool:
        return self.workers.closed

    def close(self) -> None:
        """Joins the worker threads and frees the staging (unbind the layers and drop the graphs
        that address it first)."""
        self.workers.close()
        self.staging.release()
        self.graph_staging.release()
