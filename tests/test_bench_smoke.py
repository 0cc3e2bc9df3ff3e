"""The GPU benchmarks' `--smoke` mode: tiny shapes on the CPU, Triton under its interpreter.

The benchmarks only run for real on a GPU host; here they run end to end as subprocesses (as the lead
will run them there), so a broken import, a changed interface or a wrong correctness check shows up
before GPU time is spent. Plus in-process checks that the MLA benchmark's correctness check does
catch a wrong backend and falls back to a sub-batch reference when torch would not fit.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
pytestmark = pytest.mark.slow


def run_smoke(script: str, out: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def test_mla_decode_smoke(tmp_path: Path) -> None:
    r = run_smoke("mla_decode_gpu.py", tmp_path / "mla.json")
    assert r["smoke"] and r["backend"] == "triton" and r["peer"] == "torch"
    assert r["copy_bandwidth_GBps"] > 0 and r["machine"]["device"]
    assert (r["kv_lora_rank"], r["qk_rope_head_dim"]) == (32, 16)
    assert {(row["page_size"], row["context"]) for row in r["rows"]} == {(1, 37), (1, 130), (64, 37), (64, 130)}
    for row in r["rows"]:
        # the derived figures follow from the measured time, the bytes and the copy bandwidth
        seconds = row["us"] * 1e-6
        assert row["GBps"] == pytest.approx(row["bytes_moved"] / seconds / 1e9, rel=1e-6)
        assert row["fraction_of_copy_bw"] == pytest.approx(row["GBps"] / r["copy_bandwidth_GBps"], rel=1e-6)
        assert row["speedup_vs_peer"] == pytest.approx(row["peer_us"] / row["us"], rel=1e-6)
        assert row["correct"] and row["checked_requests"] == row["batch"]
        # a real comparison: outputs of O(1), bf16-rounding-sized differences
        assert row["ref_max_abs"] > 0.1 and row["max_abs_diff"] < 0.02 * row["ref_max_abs"] + 2e-3
        assert row["bytes_moved"] == row["batch"] * (row["context"] * 48 + row["heads"] * 48 + row["heads"] * 32) * 2
    assert r["all_correct"] and "targets" in r and r["skipped"] == []


def test_model_decode_smoke(tmp_path: Path) -> None:
    try:
        importlib.import_module("cpp_experts")
        extra = ["--hybrid"]
    except ImportError:
        extra = []
    r = run_smoke("model_decode_gpu.py", tmp_path / "model.json", *extra)
    assert r["smoke"] and r["attention_backend"] == "triton" and r["expert_backend"] == "triton"
    assert r["model"]["layers"] == 2 and r["model"]["weight_bytes"]["per_routed_expert"] > 0
    assert [row["batch"] for row in r["runs"]] == [1, 2] and [row["batch"] for row in r["peer"]] == [1, 2]
    # no CUDA here: the graphs-on runs are recorded as skipped, with the runner's reason
    assert [s["graphs"] for s in r["skipped"]] == ["on", *(["host-nodes", "split"] if extra else [])]
    assert all("cpu" in skip["reason"] for skip in r["skipped"])
    top_k = r["model"]["top_k"]
    for row in r["runs"] + r["peer"] + r["hybrid"]:
        assert row["logits_finite"] and row["tokens_per_s"] > 0
        assert 0 < row["fraction_of_ceiling"] and row["ceiling_tokens_per_s"] > 0
    assert r["runs"][0]["experts_hit_per_layer"] == [top_k]  # one token: exactly top-k experts in the one MoE layer
    assert top_k <= r["runs"][1]["experts_hit_per_layer"][0] <= 2 * top_k
    names = {c["config"] for c in r["checks"]}
    assert names == ({"graphs off", "hybrid (cpp experts), graphs off"} if extra else {"graphs off"})
    for c in r["checks"]:
        # triton (and cpp) kernels against the torch reference: close, but not the same code (a
        # check that can fail: test_model_check_catches_a_wrong_expert_backend)
        assert c["correct"] and 0 < c["rel_err_vs_ref"] < 0.05, c
    if extra:
        assert [(row["graphs"], row["batch"]) for row in r["hybrid"]] == [("off", 2)]
    assert r["all_correct"] and r["targets"]["target_batch1_tokens_per_s"] == 250.0


@pytest.fixture
def mla_bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("mla_decode_gpu")


def _case(mla_bench, backend) -> tuple[Any, Any]:
    shapes = mla_bench.SMOKE_SHAPES
    batch = mla_bench.build_decode_batch(3, 50, 1, shapes, torch.bfloat16, torch.device("cpu"), backend, seed=1)
    return batch, shapes


def test_mla_check_catches_a_wrong_backend(mla_bench) -> None:
    from kernels.attention.torch_backend import TorchAttentionBackend

    class Off(TorchAttentionBackend):
        def forward_mla_absorb(self, q_latent, q_pe, layer, batch):
            return super().forward_mla_absorb(q_latent, q_pe, layer, batch) * 1.05

    args = argparse.Namespace(repeats=1, warmup=0, peer="torch")
    timer = mla_bench.Timer(torch.device("cpu"))
    for backend, ok in ((TorchAttentionBackend(), True), (Off(), False)):
        batch, shapes = _case(mla_bench, backend)
        row = mla_bench.run_case(batch, 4, shapes, args, timer, 1e9, 1 << 30, TorchAttentionBackend(), seed=2)
        assert row["correct"] is ok, row


def test_mla_reference_on_a_sub_batch_when_torch_does_not_fit(mla_bench) -> None:
    from kernels.attention.torch_backend import TorchAttentionBackend

    args = argparse.Namespace(repeats=1, warmup=0, peer="torch")
    batch, shapes = _case(mla_bench, TorchAttentionBackend())
    row = mla_bench.run_case(batch, 4, shapes, args, mla_bench.Timer(torch.device("cpu")), 1e9, 0,
                             TorchAttentionBackend(), seed=2)
    assert row["checked_requests"] == 1 and row["peer_us"] is None and "peer_skipped" in row
    assert row["correct"] and row["max_abs_diff"] < 1e-3


def test_model_check_catches_a_wrong_expert_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model benchmark's correctness check (torch-backend logits as the oracle) passes the same model
    and fails one whose routed experts are wrong, so its "correct" in the smoke run means something."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("model_decode_gpu")
    from models.experts import TorchExperts

    class Off(TorchExperts):
        """A kernel bug of the kind the check exists for: every token goes to its neighbour's expert."""

        def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
            super().submit(hidden, (topk_ids + 1) % self.num_experts, topk_weights)

    cfg = bench.bench_config("tiny-deepseek-v2", 2)
    args = argparse.Namespace(batches=[2], hybrid=False, hybrid_batches=(), prompt_len=8, warmup=0, repeats=1, steps=2)
    device = torch.device("cpu")

    def logits(model) -> torch.Tensor:
        runner = bench.make_runner(model, cfg, args, device, attention="torch", graphs=False)
        return bench.check_logits(runner, cfg.vocab_size, seed=3, steps=2)

    ref = logits(bench.build_model(cfg, device, torch.float32, "torch", seed=4))
    same = logits(bench.build_model(cfg, device, torch.float32, "torch", seed=4))
    wrong_model = bench.build_model(cfg, device, torch.float32, "torch", seed=4)
    for module in wrong_model.modules():
        if isinstance(module, TorchExperts):
            module.__class__ = Off
    assert bench.compare("same", same, ref)["correct"]
    wrong = bench.compare("off", logits(wrong_model), ref)
    assert not wrong["correct"] and wrong["rel_err_vs_ref"] > bench.LOGITS_RTOL
