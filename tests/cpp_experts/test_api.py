"""cpp_experts API behaviour: submit/sync overlap, the GIL released during forward, and bad input
raising clear Python exceptions (never a crash or a silent wrong answer)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import cpp_experts
from tests.cpp_experts.helpers import Experts, extension_threads, reference, routing, thread_names

E, H, I, K = 8, 256, 256, 6


@pytest.fixture(scope="module")
def ex() -> Experts:
    return Experts("bf16", E, H, I, seed=11)


@pytest.fixture(scope="module")
def moe(ex: Experts) -> cpp_experts.MoE:
    return ex.build(K, None, "portable")  # the slowest path: long enough calls to observe


def test_submit_sync_overlaps_python_work(ex: Experts, moe: cpp_experts.MoE) -> None:
    T = 512
    hidden = torch.randn(T, H, dtype=torch.bfloat16)
    ids, w = routing(T, E, K, "uniform", seed=1)
    t0 = time.perf_counter()
    moe.submit(hidden, ids, w)
    t_submit = time.perf_counter() - t0
    side = torch.randn(64, 64) @ torch.randn(64, 64)  # the caller's own work meanwhile
    y = moe.sync()
    total = time.perf_counter() - t0
    assert t_submit < 0.5 * total, f"submit took {t_submit:.4f}s of {total:.4f}s: not asynchronous"
    assert torch.isfinite(side).all()
    ref = reference(ex, hidden, ids, w, quant_acts=False)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 8e-3
    torch.testing.assert_close(y, moe.forward(hidden, ids, w), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="without a pending submit"):
        moe.sync()
    moe.submit(hidden, ids, w)
    with pytest.raises(RuntimeError, match="pending"):
        moe.submit(hidden, ids, w)
    with pytest.raises(RuntimeError, match="pending"):
        moe.forward(hidden, ids, w)
    moe.sync()


def test_gil_released_during_forward(moe: cpp_experts.MoE) -> None:
    T = 1024
    hidden = torch.randn(T, H)
    ids, w = routing(T, E, K, "uniform", seed=2)
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        time.sleep(0.01)
        c0, t0 = count[0], time.perf_counter()
        moe.forward(hidden, ids, w)
        c1, dt = count[0], time.perf_counter() - t0
    finally:
        stop.set()
        th.join()
    assert dt > 0.02, "forward too short to observe"
    # With the GIL held the thread could only run in the instants around the call.
    assert c1 - c0 > 10_000, f"python thread made {c1 - c0} steps during a {dt:.3f}s forward"


def _good(T: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, w = routing(T, E, K, "uniform", seed=3)
    return torch.randn(T, H), ids, w


def test_bad_inputs_raise(moe: cpp_experts.MoE) -> None:
    x, ids, w = _good()
    cases = [
        (ValueError, "hidden must be \\[T, 256\\]", (torch.randn(4, H + 1), ids, w)),
        (ValueError, "2 dimensions", (x[0], ids, w)),
        (TypeError, "bfloat16 or float32", (x.double(), ids, w)),
        (TypeError, "torch.Tensor", (x.numpy(), ids, w)),
        (ValueError, "contiguous", (torch.randn(H, 4).T, ids, w)),
        (ValueError, "topk_ids must be \\[4, 1..6\\]", (x, torch.cat([ids, ids[:, :1]], 1), w)),  # k > top_k
        (ValueError, "topk_ids must be \\[4, 1..6\\]", (x, ids[:0, :0], w)),  # no expert a token
        (ValueError, "topk_weights must be \\[4, 5\\]", (x, ids[:, :5].contiguous(), w)),  # k = 5 but 6 weights
        (TypeError, "int32 or int64", (x, ids.float(), w)),
        (ValueError, "contiguous", (x, ids.T.contiguous().T, w)),
        (TypeError, "topk_weights must be float32", (x, ids, w.double())),
        (ValueError, "topk_weights must be \\[4, 6\\]", (x, ids, w[:3].contiguous())),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            moe.forward(*args)
    for dtype in (torch.int64, torch.int32):
        for bad in (E, -1, 1 << 30):
            b = ids.clone().to(dtype)
            b[2, 4] = bad
            with pytest.raises(ValueError, match="out of range"):
                moe.forward(x, b, w)
            with pytest.raises(ValueError, match="out of range"):
                moe.submit(x, b, w)
    for bad in (float("nan"), float("inf")):
        bw = w.clone()
        bw[1, 1] = bad
        with pytest.raises(ValueError, match="not finite"):
            moe.forward(x, ids.to(torch.int32), bw)
    with pytest.raises(ValueError, match="out must be"):
        moe.forward(x, ids, w, out=torch.empty(4, H, dtype=torch.bfloat16))
    # still works after all that
    assert torch.isfinite(moe.forward(x, ids, w)).all()


def test_fewer_experts_a_token_than_top_k(ex: Experts, moe: cpp_experts.MoE) -> None:
    """An all-to-all sends each (token, expert) pair as its own row (--dp-attention --ep): [T, k] routing with
    k from 1 to top_k, as the reference computes it, and k = 1 over the pairs of [T, top_k] routing gives
    each pair's term (they sum to the whole forward's output)."""
    T = 24
    hidden = torch.randn(T, H)
    ids, w = routing(T, E, K, "uniform", seed=7)
    for k in range(1, K + 1):
        part_ids, part_w = ids[:, :k].contiguous(), w[:, :k].contiguous()
        got = moe.forward(hidden, part_ids, part_w)
        ref = reference(ex, hidden, part_ids, part_w, quant_acts=False)
        assert ((got - ref).norm() / ref.norm()).item() < 8e-3, k
    pairs = moe.forward(hidden.repeat_interleave(K, 0), ids.reshape(-1, 1), w.reshape(-1, 1))
    whole = moe.forward(hidden, ids, w)
    torch.testing.assert_close(pairs.reshape(T, K, H).sum(1), whole, rtol=1e-4, atol=1e-4)
    moe.submit(hidden, ids[:, :1].contiguous(), w[:, :1].contiguous())
    torch.testing.assert_close(moe.sync(), moe.forward(hidden, ids[:, :1].contiguous(), w[:, :1].contiguous()),
                               rtol=0, atol=0)


def test_bad_construction_and_loading() -> None:
    with pytest.raises(ValueError, match="weight_format"):
        cpp_experts.MoE(4, 2, 64, 64, "iq2_xxs")
    with pytest.raises(ValueError, match="top_k"):
        cpp_experts.MoE(4, 5, 64, 64)
    q48 = Experts("q8_0", 1, 64, 64, seed=5).raw[0][0]
    with pytest.raises(ValueError, match="divisible by its block size 32"):  # down's 48 inputs
        cpp_experts.MoE(4, 2, 64, 48, "q8_0").load_expert(0, q48[:48].contiguous(), q48[:48].contiguous(),
                                                          torch.zeros(64 * 34, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kernel must be"):
        cpp_experts.MoE(4, 2, 64, 64, kernel="sse")
    if "amx" not in cpp_experts.info()["kernels"]:
        with pytest.raises(RuntimeError, match="amx"):  # the experts' operators refuse the forced path
            cpp_experts.MoE(4, 2, 64, 64, kernel="amx").load_expert(0, *(torch.randn(64, 64),) * 3)
    with pytest.raises(ValueError, match="num_threads"):
        cpp_experts.WorkerPool(0)
    m = cpp_experts.MoE(2, 1, 64, 64, "bf16", pool=cpp_experts.WorkerPool(1))
    g = torch.randn(64, 64)
    with pytest.raises(ValueError, match="expected shape"):
        m.load_expert(0, g, g, torch.randn(64, 32))
    with pytest.raises(TypeError, match="float tensor"):
        m.load_expert(0, g, g, g.to(torch.uint8))
    with pytest.raises(ValueError, match="expert must be"):
        m.load_expert(2, g, g, g)
    bad = g.clone()
    bad[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        m.load_expert(0, g, bad, g)
    m.load_expert(0, g, g, g)
    with pytest.raises(ValueError, match="never loaded"):
        m.finalize()
    ids = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="finalize"):
        m.forward(torch.randn(1, 64), ids, torch.ones(1, 1))

    q = Experts("q8_0", 1, 64, 64, seed=4)
    mq = cpp_experts.MoE(1, 1, 64, 64, "q8_0", pool=cpp_experts.WorkerPool(1))
    gate, up, down = q.raw[0]
    with pytest.raises(ValueError, match="expected"):
        mq.load_expert(0, gate[:, :-1].contiguous(), up, down)
    with pytest.raises(TypeError, match="uint8"):
        mq.load_expert(0, gate.to(torch.int8), up, down)
    nan_scale = gate.clone()
    nan_scale[5, 34:36] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN in block 1's d
    with pytest.raises(ValueError, match="row 5 block 1 has a non-finite scale"):
        mq.load_expert(0, nan_scale, up, down)
    mq.load_expert(0, gate.flatten(), up, down)  # flat bytes are accepted too
    mq.finalize()
    assert torch.isfinite(mq.forward(torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))).all()


def test_pool_is_its_owners(ex: Experts) -> None:
    """No process-wide pool: an operator computes on the pool it is bound to, two operators on two
    pools are independent, unbinding ends the operator's driver thread, closing joins the workers."""
    a, b = ex.build(K, 1, "portable"), ex.build(K, 1, "portable")
    a.unbind()
    b.unbind()
    x, ids, w = _good(8)
    with pytest.raises(RuntimeError, match="no worker pool is bound"):
        a.forward(x, ids, w)
    want = reference(ex, x, ids, w, quant_acts=False)
    before = extension_threads()
    pool_a, pool_b = cpp_experts.WorkerPool(3), cpp_experts.WorkerPool(2)
    assert extension_threads() == before + 2 + 1 and (pool_a.num_threads, pool_b.num_threads) == (3, 2)
    assert {"cpx-pool-1", "cpx-pool-2"} <= set(thread_names())  # named for top -H, ps -L and debuggers
    a.bind(pool_a)
    b.bind(pool_b)
    assert (a.pool, a.num_threads, b.num_threads) == (pool_a, 3, 2)
    a.submit(x, ids, w)  # starts a's driver thread
    b.submit(x, ids, w)
    ya, yb = a.sync(), b.sync()
    assert extension_threads() == before + 3 + 2
    assert torch.equal(ya, yb) and ((ya - want).norm() / want.norm()).item() < 8e-3
    a.unbind()  # driver joined; the pool keeps its workers for others
    assert extension_threads(before + 3 + 1) == before + 3 + 1 and a.pool is None and a.num_threads == 0
    pool_a.close()
    assert pool_a.closed and extension_threads(before + 1 + 1) == before + 1 + 1
    pool_a.close()  # idempotent
    assert torch.equal(b.forward(x, ids, w), yb)  # the other pool is untouched
    a.bind(pool_a)
    with pytest.raises(RuntimeError, match="was closed"):
        a.forward(x, ids, w)
    task_x, task_ids, task_w = x.clone(), ids.to(torch.int32), w.clone()
    task = a.host_task(task_x, task_ids, task_w, torch.empty_like(task_x))
    task.run_submit()  # on a closed pool the host task records the failure instead of raising
    task.run_sync()
    assert "was closed" in (task.take_error() or "")
    a.bind(pool_b)  # two operators may share a pool
    assert torch.equal(a.forward(x, ids, w), yb)
    b.unbind()
    a.unbind()
    with cpp_experts.WorkerPool(2) as scoped:
        assert not scoped.closed
    assert scoped.closed
    with pytest.raises(TypeError, match="WorkerPool"):
        a.bind(object())


def test_default_pool_size_follows_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_THREADS", "3")
    with cpp_experts.WorkerPool() as pool:
        assert pool.num_threads == 3


def _busy_processes(n: int) -> list:
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.parametrize("wait", ["adaptive", "spin"])
def test_pool_runs_solo_while_the_cores_are_taken(monkeypatch: pytest.MonkeyPatch, wait: str) -> None:
    """With a busy process on every core, the pool's workers keep arriving late: it runs alone on the
    calling thread (counted in solo_runs) and every result stays exact; MLASERVE_CPP_EXPERTS_WAIT=spin
    keeps the workers (no solo run)."""
    import os

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: the pool has no workers to wait for")
    if wait == "spin":
        monkeypatch.setenv("MLASERVE_CPP_EXPERTS_WAIT", "spin")
    w = torch.randn(512, 1024)
    x = torch.randn(1, 1024)
    with cpp_experts.WorkerPool(cores) as pool:
        op = cpp_experts.QuantLinear.from_float(w, dtype=torch.float32, pool=pool)
        want = op(x)
        busy = _busy_processes(cores)
        try:
            time.sleep(0.3)
            deadline = time.monotonic() + 20
            calls = 0
            # 256 calls: eight of the pool's 32-run windows, any of which sends an adaptive pool solo
            while time.monotonic() < deadline and (calls < 256 or (wait == "adaptive" and pool.solo_runs == 0)):
                assert torch.equal(op(x), want)
                calls += 1
        finally:
            for p in busy:
                p.kill()
                p.wait()
        if wait == "spin":
            assert pool.solo_runs == 0
        else:
            assert pool.solo_runs > 0, f"{calls} calls under contention and no solo run"
