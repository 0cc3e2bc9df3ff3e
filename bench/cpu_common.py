"""Helpers the CPU peer benchmarks (`serve_cpu.py`, `deepseek_cpu.py`) share: the machine description
and tag that name a result file, percentiles, free ports, versions, and the ours/peer ratios checked
against targets. Standard library only (torch is imported by the callers that need it).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def cpuinfo(text: str | None = None) -> dict[str, Any]:
    """CPU model, logical cores usable here, and the ISA flags that decide the kernels (from /proc/cpuinfo)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cores": cores,
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": bool({"amx_tile", "amx_bf16", "amx_int8"} & flags),
    }


def machine_info() -> dict[str, Any]:
    info = cpuinfo()
    info["node"] = platform.node()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_GiB"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["load_average_at_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


def machine_tag(info: dict[str, Any]) -> str:
    """'AMD EPYC 7B12 64-Core Processor', 2 cores -> 'amd_epyc_7b12_64_core_processor_2c'."""
    slug = re.sub(r"[^a-z0-9]+", "_", str(info.get("cpu", "cpu")).lower()).strip("_") or "cpu"
    return f"{slug}_{info.get('cores', 0)}c"


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pkg in ("mlaserve", "torch", "llama-cpp-python", "transformers", "gguf"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["mlaserve_git"] = commit + ("-dirty" if dirty else "") if commit else None
    except (OSError, subprocess.TimeoutExpired):
        out["mlaserve_git"] = None
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either side is missing or theirs is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def check_target(value: float | None, target: float, higher_is_better: bool = True) -> dict[str, Any]:
    """A ratio against its target: {'value', 'target', 'op', 'met'} (met None when not measured)."""
    met = None if value is None else (value >= target if higher_is_better else value <= target)
    return {"value": value, "target": target, "op": ">=" if higher_is_better else "<=", "met": met}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
