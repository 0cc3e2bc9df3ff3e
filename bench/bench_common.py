"""Helpers the GPU benchmarks share: device naming, a median timer, and the copy-bandwidth floor.

They run on CUDA (CUDA events, L2 flushed before every timed call, so a small working set is
measured from HBM rather than from the previous repeat's cache lines) and on the CPU (`--smoke`
runs of the same scripts under TRITON_INTERPRET=1, timed with perf_counter; those numbers mean
nothing, they only prove the code path runs).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

L2_FLUSH_BYTES = 256 << 20  # H100/H200 L2 is 50 MiB; writing 256 MiB evicts it (as triton.testing.do_bench does)


def bench_device(smoke: bool) -> torch.device:
    """The CPU for --smoke runs (kernels interpreted), else the GPU; exits with a message when there is none."""
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (use --smoke for the CPU smoke run)")
    return torch.device("cuda")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def device_slug(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3', for result file names."""
    return re.sub(r"[^a-z0-9]+", "_", device_name(device).lower()).strip("_")


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(total_memory_GiB=props.total_memory / 2**30, sm_count=props.multi_processor_count,
                    cuda=torch.version.cuda)
    return info


class Timer:
    """Median wall time of a callable on one device, after warm-up."""

    def __init__(self, device: torch.device, flush_l2: bool = True) -> None:
        self.device = device
        self._flush = (
            torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            if device.type == "cuda" and flush_l2 else None
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
        """Seconds per call (median of `repeats`)."""
        for _ in range(warmup):
            fn()
        self.sync()
        if self.device.type != "cuda":
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for s, e in zip(starts, ends):
            if self._flush is not None:
                self._flush.zero_()
            s.record()
            fn()
            e.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a large device-to-device `copy_` (read + write counted): the practical memory
    bandwidth a bandwidth-bound kernel is measured against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = Timer(device, flush_l2=False).median(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / t


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], f) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
