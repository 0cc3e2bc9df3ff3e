"""What a container's control groups allow the process: memory (the KV cache's room) and CPU time (how
many threads are worth running). /proc/meminfo and the affinity mask show the host's; a cgroup's limit
does not show there, and a cache or a thread pool sized from the host's numbers is killed or throttled.
Torch-free: the server side reads the CPU budget to check --dp before anything starts."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (the largest page multiple)
# (mount under CGROUP_ROOT, limit file, usage file, memory.stat key of the page cache that is free to drop)
_MEMORY_FILES = {"v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                 "v2": ("", "memory.max", "memory.current", "inactive_file")}
_CPU_V1_DIRS = ("cpu,cpuacct", "cpu")  # where cgroup v1 mounts its cpu controller, as Docker and systemd do


def _levels(root: Path, self_cgroup: str | None, controller: str, v1_dirs: tuple[str, ...],
            probes: tuple[str, str]) -> Iterator[tuple[str, Path]]:
    """(version, directory) of each level of the process's cgroup that may limit `controller`, from its own
    up to the mount's root (a container sees its own cgroup as the root). `probes`: the v1 and v2 files
    that mark a mount of the controller. `self_cgroup`: /proc/self/cgroup's text (read when None)."""
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    paths: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and not parts[1]:
            paths["v2"] = parts[2]
        elif len(parts) == 3 and controller in parts[1].split(","):
            paths["v1"] = parts[2]
    v1_mount = next((root / d for d in v1_dirs if (root / d / probes[0]).exists()), root / v1_dirs[0])
    for version, mount, probe in (("v1", v1_mount, probes[0]), ("v2", root, probes[1])):
        if version not in paths and not (mount / probe).exists():
            continue
        d = mount / paths.get(version, "/").lstrip("/")
        for level in [d, *d.parents] if mount in d.parents else [mount]:
            if level != mount and mount not in level.parents:
                break
            yield version, level


def _int(path: Path) -> int | None:
    """A cgroup file's number; None for "max", a missing file or anything else."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_room(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> int | None:
    """Bytes the process's memory cgroups still allow (limit - usage + reclaimable page cache), at the
    tightest level; None where no level has a limit."""
    rooms = []
    for version, level in _levels(root, self_cgroup, "memory", ("memory",), ("memory.limit_in_bytes", "memory.max")):
        _, limit_file, usage_file, inactive_key = _MEMORY_FILES[version]
        limit = _int(level / limit_file)
        if limit is None or limit >= NO_LIMIT:
            continue
        usage = _int(level / usage_file) or 0
        inactive = 0
        try:
            for stat in (level / "memory.stat").read_text().splitlines():
                key, _, value = stat.partition(" ")
                if key == inactive_key and value.strip().isdigit():
                    inactive = int(value)
        except OSError:
            pass
        rooms.append(max(0, limit - usage + inactive))
    return min(rooms) if rooms else None


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time the process's cgroups allow (`docker run --cpus`, a Kubernetes CPU limit: quota /
    period), at the tightest level; None where no level has a quota."""
    quotas = []
    for version, level in _levels(root, self_cgroup, "cpu", _CPU_V1_DIRS, ("cpu.cfs_quota_us", "cpu.max")):
        if version == "v2":
            try:
                quota, _, period = (level / "cpu.max").read_text().strip().partition(" ")
            except OSError:
                continue
            q, p = (int(quota), int(period)) if quota.isdigit() and period.isdigit() else (None, None)
        else:  # (-1: none, which _int reads as None)
            q, p = _int(level / "cpu.cfs_quota_us"), _int(level / "cpu.cfs_period_us")
        if q and p:
            quotas.append(q / p)
    return min(quotas) if quotas else None


def usable_cpus() -> list[int]:
    """The CPUs worth running threads on: the affinity mask (a container's cpuset, taskset's share), its first
    ceil(quota) where a CPU quota allows less time than the mask has CPUs (threads past it only take turns
    under the quota, each a scheduler period late)."""
    mask = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    quota = cpu_quota()
    return mask if quota is None else mask[: max(1, math.ceil(quota - 1e-9))]


def quota_threads(environ: MutableMapping[str, str]) -> int | None:
    """For a process about to load the worker pool and torch: where a CPU quota gives less time than the
    affinity mask has CPUs, as many threads as the quota gives (`MLASERVE_CPP_EXPERTS_THREADS`,
    `OMP_NUM_THREADS`; a value the user set is kept). Returns that count, None where no quota binds."""
    cpus = len(usable_cpus())
    if not hasattr(os, "sched_getaffinity") or cpus >= len(os.sched_getaffinity(0)):
        return None
    for name in ("MLASERVE_CPP_EXPERTS_THREADS", "OMP_NUM_THREADS"):
        environ.setdefault(name, str(cpus))
    return cpus
