"""Helpers the CPU peer benchmarks (`serve_cpu.py`, `deepseek_cpu.py`) share: the machine description
and tag that name a result file, percentiles, free ports, versions, and the ours/peer ratios checked
against targets, and the two read-bandwidth probes. Standard library at import (torch and cpp_experts
are imported by the probes, for the callers that use them).
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
import time
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
    def number(key: str) -> int | None:
        try:
            return int(fields[key])
        except (KeyError, ValueError):
            return None

    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        # family and model tell CPU generations apart where a VM's model name does not ("AMD EPYC":
        # family 25 is Zen 3 / Zen 4, 26 Zen 5), and some kernel settings follow them (cpp_experts/csrc/cpu.h)
        "cpu_family": number("cpu family"),
        "cpu_model": number("model"),
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
    # the kernels a run forced (cpp_experts reads it per process): an AVX2 run on an AVX-512 host says so
    info["forced_kernel"] = os.environ.get("MLASERVE_CPP_EXPERTS_KERNEL") or None
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


def proc_status(key: str) -> int:
    """A byte count of this process from /proc/self/status (VmRSS, RssAnon, VmHWM, ...); 0 where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes/s of a torch sum over a large fp32 tensor (reads only, one stream per thread): the median
    of `repeats` after a warm-up, on `threads` torch threads (None: as torch is set; torch's setting is
    restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return nbytes / statistics.median(times)


class StreamRead:
    """A streaming read at the machine's speed: an f32 `cpp_experts.QuantLinear` of `nbytes` at M = 1
    reads its weights as 4 contiguous streams per thread with one FMA per 32 bytes. torch's sum reads
    one stream per thread, which on some machines (a 2-core Zen 3 VM: 16 GB/s) is well below what
    several streams get (28 GB/s there, the same as a hand-written 8-stream AVX2 read loop). Made once
    (packing takes a while), sampled once per round."""

    def __init__(self, pool: Any, nbytes: int, kernel: str | None = None) -> None:
        import cpp_experts
        import torch

        self.op = cpp_experts.QuantLinear.from_float(torch.ones(nbytes // (4 * 4096), 4096), dtype=torch.float32,
                                                     pool=pool, kernel=kernel)
        self.x = torch.ones(1, 4096)
        self.nbytes = self.op.out_features * 4096 * 4

    def sample(self, calls: int = 3) -> float:
        """Bytes/s over `calls` passes after a warm one."""
        self.op(self.x)
        t = time.perf_counter()
        for _ in range(calls):
            self.op(self.x)
        return self.nbytes * calls / (time.perf_counter() - t)


def add_quiet_args(ap: Any, retries: int) -> None:
    """The flags of a benchmark that waits for a quiet machine and redoes disturbed measurements
    (`wait_for_quiet`, `should_retry`) on an argparse parser."""
    ap.add_argument("--quiet-threshold", type=float, default=0.25,
                    help="start a measurement when the CPUs were busy less than this fraction of 0.5 s ...")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="... waiting at most this many seconds (0: never wait); recorded with each sample")
    ap.add_argument("--retry-busy", type=float, default=0.1,
                    help="measure again when other processes used more than this share of the CPUs meanwhile ...")
    ap.add_argument("--retries", type=int, default=retries,
                    help="... at most this many times (the last attempt is kept)")


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


def cpu_times(stat_text: str | None = None) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from the first line of /proc/stat."""
    if stat_text is None:
        stat_text = Path("/proc/stat").read_text()
    fields = [int(x) for x in stat_text.splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return 0.0 if total <= 0 else (after[0] - before[0]) / total


def wait_for_quiet(threshold: float, max_wait: float, interval: float = 0.5) -> dict[str, Any]:
    """Waits (at most `max_wait` s) until the machine's CPUs were busy less than `threshold` of an
    `interval`: on a shared machine, start a measurement when no one else is computing. Returns the
    last busy fraction seen and the time waited (recorded with each sample). No-op without /proc/stat."""
    t0 = time.monotonic()
    busy = None
    try:
        while True:
            a = cpu_times()
            time.sleep(interval)
            busy = busy_fraction(a, cpu_times())
            if busy < threshold or time.monotonic() - t0 >= max_wait:
                break
    except (OSError, ValueError, IndexError):
        pass
    return {"busy_before": busy, "waited_s": round(time.monotonic() - t0, 2),
            "quiet": busy is not None and busy < threshold}


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def session_jiffies(sessions: set[int], proc: Path = Path("/proc")) -> int:
    """CPU time (user + system jiffies) of every live process whose session id is in `sessions`
    (a server started with `start_new_session=True` and its children: its session is its pid)."""
    total = 0
    if not sessions:
        return 0
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(rest[3]) in sessions:  # rest[0] is the state (field 3), so session (field 6) is rest[3]
            total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)
    return total


def own_jiffies() -> int:
    """This process's CPU time and that of its children already waited for (e.g. a finished llama-bench)."""
    t = os.times()
    return round((t.user + t.system + t.children_user + t.children_system) * CLK_TCK)


class OthersMeter:
    """The share of the machine's CPU time that processes other than ours used during a block.

    Ours: this process, its waited-for children, and the sessions given (started servers). Whatever
    else ran (another engineer's compiler) is what makes a sample unrepresentative."""

    def __init__(self, sessions: tuple[int, ...] = ()) -> None:
        self.sessions = set(sessions)
        self.others: float | None = None

    def _read(self) -> tuple[int, int, int]:
        busy, total = cpu_times()
        return busy, total, own_jiffies() + session_jiffies(self.sessions)

    def __enter__(self) -> "OthersMeter":
        try:
            self._a: tuple[int, int, int] | None = self._read()
        except (OSError, ValueError, IndexError):
            self._a = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._a is None:
            return
        try:
            b = self._read()
        except (OSError, ValueError, IndexError):
            return
        self.others = others_fraction(self._a, b)


def others_fraction(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """From (busy, total, ours) jiffies before and after: others' busy time / the machine's time."""
    total = b[1] - a[1]
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, ((b[0] - a[0]) - (b[2] - a[2])) / total))


def should_retry(others: float | None, threshold: float, attempt: int, retries: int) -> bool:
    """Redo a measurement that others disturbed (others' CPU share above `threshold`), `retries` times at most."""
    return others is not None and others > threshold and attempt < retries


def undisturbed(measurements: list[dict[str, Any]], threshold: float) -> tuple[list[dict[str, Any]], int]:
    """(the rounds for the median, how many were undisturbed): the rounds in which other processes used
    at most `threshold` of the CPUs, or every round when all were disturbed (then the count is 0)."""
    quiet = [m for m in measurements if (m.get("others_busy") or 0.0) <= threshold]
    return (quiet or measurements), len(quiet)


def phase_profile(prof: dict[str, Any], step_s: float, phase_bytes: dict[str, int] | None = None,
                  read_Bps: float | None = None) -> dict[str, Any]:
    """A native forward's timed decode steps (`NativeDecodePlan.profile()`, taken over decode steps
    only: a prompt's forward reads far more weights, and averaged in it makes every phase look slow)
    and the measured seconds per step -> per step: each phase's time, share of the step, parallel pool
    runs and the caller's wait in them, and the time outside the forward. With the weight bytes each
    phase reads (`phase_bytes`) and a read bandwidth, also each phase's fraction of that read."""
    n = prof["forwards"]
    if n < 1 or step_s <= 0:
        raise ValueError("no decode step was timed: turn profiling on before the decode steps")
    step = step_s * 1e6
    fwd = prof["forward_s"] / n * 1e6
    phases: dict[str, Any] = {}
    for k, v in sorted(prof["phases"].items(), key=lambda kv: -kv[1]["s"]):
        us = v["s"] / n * 1e6
        phases[k] = {"us_per_step": us, "share_of_step": us / step, "pool_runs_per_step": v["pool_runs"] / n,
                     "wait_us_per_step": v["wait_s"] / n * 1e6}
        if phase_bytes and read_Bps and phase_bytes.get(k) and us > 0:
            phases[k]["weight_bytes"] = phase_bytes[k]
            phases[k]["fraction_of_read"] = phase_bytes[k] / (us / 1e6) / read_Bps
    return {"decode_steps": n, "step_us": step, "forward_us": fwd, "outside_forward_us": step - fwd,
            "read_Bps": read_Bps, "phases": phases}


def print_phase_profile(profile: dict[str, Any]) -> None:
    print(f"profile: step {profile['step_us']:.0f} us, forward {profile['forward_us']:.0f} us, "
          f"outside it {profile['outside_forward_us']:.0f} us")
    for k, v in profile["phases"].items():
        read = f"  {v['fraction_of_read']:.2f} of the read" if "fraction_of_read" in v else ""
        print(f"  {k:15s} {v['us_per_step']:8.1f} us  {100 * v['share_of_step']:5.1f}%  "
              f"pool runs {v['pool_runs_per_step']:5.1f}  waiting {v['wait_us_per_step']:6.1f} us{read}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
