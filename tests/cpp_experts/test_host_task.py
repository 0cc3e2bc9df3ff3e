"""`cpp_experts.HostTask`: a call bound to fixed buffers, run through the same native entry points
that `cuLaunchHostFunc` calls from a CUDA graph's host nodes (here on this thread, in stream order).
Checked against `MoE.forward`: rebinding-free reruns over refilled buffers (as graph replays do),
overlap of the two halves with other work, and failures recorded instead of thrown."""

from __future__ import annotations

import pytest
import torch

import cpp_experts
from tests.cpp_experts.helpers import Experts, routing

E, H, I, K = 8, 64, 96, 3


@pytest.fixture(scope="module")
def ex() -> Experts:
    return Experts("bf16", E, H, I, seed=21)


@pytest.fixture(scope="module")
def moe(ex: Experts) -> cpp_experts.MoE:
    return ex.build(K, 2, "auto")


def _buffers(T: int) -> tuple[torch.Tensor, ...]:
    return (torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, K, dtype=torch.int32),
            torch.empty(T, K, dtype=torch.float32), torch.full((T, H), float("nan"), dtype=torch.bfloat16))


@pytest.mark.parametrize("T", [1, 5, 33])
def test_reruns_read_the_buffers_current_contents(moe: cpp_experts.MoE, T: int) -> None:
    x, ids, w, out = _buffers(T)
    task = moe.host_task(x, ids, w, out)
    for rep in range(3):  # each rerun is a replay with new activations and routing
        x.copy_(torch.randn(T, H, dtype=torch.bfloat16))
        r_ids, r_w = routing(T, E, K, "skewed" if rep == 1 else "uniform", seed=100 + rep)
        ids.copy_(r_ids)
        w.copy_(r_w)
        task.run_submit()
        busy = torch.randn(128, 128) @ torch.randn(128, 128)  # the stream's work between the halves
        task.run_sync()
        assert task.take_error() is None
        assert torch.isfinite(busy).all()
        torch.testing.assert_close(out, moe.forward(x, ids, w), rtol=0, atol=0)
    assert task.runs == 3


def test_failure_is_recorded_and_output_zeroed(moe: cpp_experts.MoE) -> None:
    x, ids, w, out = _buffers(4)
    x.copy_(torch.randn(4, H, dtype=torch.bfloat16))
    r_ids, r_w = routing(4, E, K, "uniform", seed=7)
    ids.copy_(r_ids)
    w.copy_(r_w)
    task = moe.host_task(x, ids, w, out)
    failures = moe.host_failures
    w[2, 1] = float("nan")
    task.run_submit()  # must not raise: it runs on a CUDA driver thread in production
    task.run_sync()
    assert "topk_weights[2, 1] is not finite" in (task.take_error() or "")
    assert moe.host_failures == failures + 1
    assert task.take_error() is None  # taken
    assert torch.equal(out, torch.zeros_like(out))
    ids[0, 0] = E
    w[2, 1] = 0.5
    task.run_submit()
    task.run_sync()
    assert "out of range" in (task.take_error() or "")
    ids[0, 0] = 1  # good again: the same task recovers
    task.run_submit()
    task.run_sync()
    assert task.take_error() is None
    torch.testing.assert_close(out, moe.forward(x, ids, w), rtol=0, atol=0)
    assert task.runs == 3 and moe.host_failures == failures + 2


def test_binding_checks_shapes_and_dtypes(moe: cpp_experts.MoE) -> None:
    x, ids, w, out = _buffers(3)
    with pytest.raises(TypeError, match="int32"):
        moe.host_task(x, ids.long(), w, out)
    with pytest.raises(ValueError, match="out must be"):
        moe.host_task(x, ids, w, out[:2])
    with pytest.raises(ValueError, match="at least one token"):
        moe.host_task(x[:0], ids[:0], w[:0], out[:0])


def test_queueing_on_a_stream_needs_the_cuda_driver(moe: cpp_experts.MoE) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the gpu tests queue host tasks for real")
    assert cpp_experts.cuda_host_launch_error() is not None
    x, ids, w, out = _buffers(1)
    with pytest.raises(RuntimeError, match="cannot queue CPU experts on a CUDA stream"):
        moe.host_task(x, ids, w, out).enqueue_submit(0)
