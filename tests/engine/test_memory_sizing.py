"""How the KV cache is sized on a CPU host: a container's memory limit bounds it (its /proc/meminfo shows
the host's memory), and freed slots are reused first, so resident memory follows the tokens held; and
how many threads a container's CPU quota is worth."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from engine import cgroups
from engine.cgroups import cpu_quota, memory_room
from executor.memory_pool import TokenSlotAllocator

GiB = 1 << 30


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


def test_a_cgroup_v2_limit_bounds_the_room(tmp_path):
    root = tmp_path / "cg"
    _write(root, memory_max="max", memory_current=str(9 * GiB))  # the namespace's root: no limit
    _write(root / "kubepods" / "pod1", memory_max=str(4 * GiB), memory_current=str(GiB),
           memory_stat=f"anon {GiB - 4096}\ninactive_file {GiB // 2}\n")
    _write(root / "kubepods" / "pod1" / "ctr", memory_max="max", memory_current=str(GiB))
    room = memory_room(root, "0::/kubepods/pod1/ctr\n")
    assert room == 4 * GiB - GiB + GiB // 2  # the pod's limit, less what it uses, page cache it can drop back
    assert memory_room(root, "0::/\n") is None  # no level with a limit


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    """cgroup namespaces: /proc/self/cgroup names a path the container's mount does not have."""
    root = tmp_path / "cg"
    _write(root, memory_max=str(2 * GiB), memory_current=str(GiB // 4))
    assert memory_room(root, "0::/system.slice/docker-abc.scope\n") == 2 * GiB - GiB // 4


def test_cgroup_v1_limits_and_no_limit(tmp_path):
    root = tmp_path / "cg"
    _write(root / "memory", memory_limit_in_bytes=str(9223372036854771712), memory_usage_in_bytes=str(GiB))
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=str(3 * GiB), memory_usage_in_bytes=str(GiB),
           memory_stat=f"cache 5\ntotal_inactive_file {GiB // 4}\n")
    lines = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert memory_room(root, lines) == 2 * GiB + GiB // 4
    assert memory_room(root, "5:memory:/\n") is None  # the host's root: no limit
    assert memory_room(tmp_path / "none", lines) is None  # no cgroup file system at all


def test_freed_slots_are_handed_out_again_first():
    """Requests come and go: the slots in use over time stay within the most held at once (plus one
    request's worth), not a sweep of the whole pool."""
    rng = random.Random(0)
    pool = TokenSlotAllocator(10_000)
    held: list[torch.Tensor] = []
    touched: set[int] = set()
    for _ in range(500):
        if held and (len(held) > 6 or rng.random() < 0.5):
            pool.free(held.pop(rng.randrange(len(held))))
        got = pool.alloc(rng.randint(1, 100))
        assert got is not None
        held.append(got)
        touched.update(got.tolist())
        assert len(torch.cat(held).unique()) == sum(len(h) for h in held)  # never one slot twice
    assert len(touched) <= 8 * 100, len(touched)


def _engine(tmp_path: Path, **kw):
    from engine.args import EngineArgs
    from engine.core import EngineCore
    from models.synthetic import write_checkpoint

    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=1)
    return EngineCore(EngineArgs(model=str(model), dtype="float32", **kw))


def test_a_cache_past_the_memory_is_refused_in_words(tmp_path):
    """An explicit --max-total-tokens (or a request table of --max-running-requests) past the memory
    available: a ValueError naming the flags, the engine's one-line startup error (it was torch's
    allocation RuntimeError with its traceback, after the model had loaded)."""
    import pytest

    for kw in ({"max_total_tokens": 10**14}, {"max_total_tokens": 4096, "max_running_requests": 10**8}):
        with pytest.raises(ValueError, match=r"need [0-9.]+ GiB, more than the [0-9.]+ GiB available: lower "
                                             r"--max-total-tokens"):
            _engine(tmp_path, **kw)


def test_many_request_slots_leave_a_usable_cache(tmp_path, monkeypatch):
    """Sized by --mem-fraction with a request table too large at the model's whole context: the context is
    cut to the slots, and the table with it, so both are solved together (the table at the whole
    context took the whole share and left one slot: every request refused)."""
    import engine.core

    monkeypatch.setattr(engine.core, "available_memory", lambda device: 64 * 2**20)
    core = _engine(tmp_path, max_running_requests=2000, mem_fraction=0.5)  # 2001 x 8192 x 4 B: 62.5 MiB
    slots, per_token = core.runner.allocator.num_slots, core.kv_bytes_per_token
    assert core.context_len == slots and slots * (per_token + 2001 * 4) <= 32 * 2**20
    assert slots > 32 * 2**20 // (per_token + 2001 * 4) - 2


def test_a_cache_too_small_for_any_request_is_refused_naming_its_cause(tmp_path, monkeypatch, caplog):
    """A cache cut below MIN_CONTEXT slots served every request a 400 after saying it was ready: now the
    engine refuses to start, naming the flag that made it so (a tiny --max-total-tokens, a request table
    that took the memory, a tiny --mem-fraction); a cut above it is a warning that names the cause too."""
    import pytest

    import engine.core

    with pytest.raises(ValueError, match=r"holds 1 token\(s\) \(--max-total-tokens 1\), too few"):
        _engine(tmp_path, max_total_tokens=1)
    monkeypatch.setattr(engine.core, "available_memory", lambda device: 64 * 2**20)
    with pytest.raises(ValueError, match=r"--max-running-requests 1000000: its request table takes"):
        _engine(tmp_path, max_running_requests=10**6, mem_fraction=0.5)
    with pytest.raises(ValueError, match=r"--mem-fraction 1e-06 of 0.06 GiB available"):
        _engine(tmp_path, mem_fraction=1e-6)
    with caplog.at_level("WARNING", logger="engine.core"):
        core = _engine(tmp_path, max_total_tokens=64)
    assert core.context_len == 64 and "cut to 64, the KV cache's slots (--max-total-tokens 64)" in caplog.text


def test_cpu_quotas_v2_and_v1(tmp_path):
    """`docker run --cpus 1.5` writes cpu.max "150000 100000" (v2) or cfs_quota_us 150000 (v1); the tightest
    level counts; "max" and -1 are no quota."""
    root = tmp_path / "cg"
    _write(root, cpu_max="max 100000")
    _write(root / "kubepods" / "pod1", cpu_max="400000 100000")
    _write(root / "kubepods" / "pod1" / "ctr", cpu_max="150000 100000")
    assert cpu_quota(root, "0::/kubepods/pod1/ctr\n") == 1.5
    assert cpu_quota(root, "0::/kubepods/pod1\n") == 4.0
    assert cpu_quota(root, "0::/\n") is None
    v1 = tmp_path / "v1"
    _write(v1 / "cpu,cpuacct" / "docker" / "abc", cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")
    _write(v1 / "cpu,cpuacct", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    lines = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cpu_quota(v1, lines) == 2.0
    assert cpu_quota(v1, "4:cpu,cpuacct:/\n") is None
    assert cpu_quota(tmp_path / "none", lines) is None


def test_a_cpu_quota_sets_the_threads(monkeypatch):
    """Fewer threads where the quota gives less time than the affinity mask has CPUs (the shipped Deployment
    on a 64-core node ran 64 threads on 2 CPUs' time); a user's own setting kept; none set without a quota."""
    mask = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(cgroups, "cpu_quota", lambda: 0.5)
    assert cgroups.usable_cpus() == mask[:1]
    env: dict[str, str] = {"OMP_NUM_THREADS": "3"}
    if len(mask) > 1:
        assert cgroups.quota_threads(env) == 1 and env == {"OMP_NUM_THREADS": "3", "MLASERVE_CPP_EXPERTS_THREADS": "1"}
    monkeypatch.setattr(cgroups, "cpu_quota", lambda: None)
    assert cgroups.usable_cpus() == mask and cgroups.quota_threads(env := {}) is None and env == {}
