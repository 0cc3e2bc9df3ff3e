"""The benchmarks' smoke tests.

The CPU peer benchmarks (serve_cpu, deepseek_cpu, make_deepseek_gguf, peers): their pure parts, in
a few seconds, with no network, no llama.cpp build and no real benchmark run: argument parsing, the
result JSON's shape, the ratio/target and floor arithmetic on canned inputs, llama-bench's JSON on a
canned sample, and a missing peer recorded as skipped (never a failure).

The GPU benchmarks' `--smoke` mode (marked slow, needs triton): tiny shapes on the CPU, Triton under
its interpreter.

The benchmarks only run for real on a GPU host; here they run end to end as subprocesses (as the lead
will run them there), so a broken import, a changed interface or a wrong correctness check shows up
before GPU time is spent. Plus in-process checks that the MLA benchmark's correctness check does
catch a wrong backend and falls back to a sub-batch reference when torch would not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.attention.triton_backend import DecodePlan

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def gpu_smoke(test):
    """The GPU benchmarks' smoke tests: slow, and they need triton (kernels under its interpreter)."""
    no_triton = importlib.util.find_spec("triton") is None
    return pytest.mark.slow(pytest.mark.skipif(no_triton, reason="triton is not installed")(test))


def run_smoke(script: str, out: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@gpu_smoke
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


@gpu_smoke
def test_tune_decode_attention_smoke(tmp_path: Path) -> None:
    from kernels.attention.triton_backend import PLANS_FILE

    before = PLANS_FILE.read_text() if PLANS_FILE.exists() else None
    r = run_smoke("tune_decode_attention.py", tmp_path / "tune.json")
    assert r["smoke"] and [(f["heads"], f["batch"]) for f in r["results"]] == [(4, 1), (4, 2)]
    for found in r["results"]:
        ok = [t for t in found["tried"] if "geomean_us" in t]
        assert len(ok) >= 4 and found["tried"][0]["plan"] == dataclasses.asdict(DecodePlan())  # the default first
        fastest, default = min(ok, key=lambda t: t["geomean_us"]), found["tried"][0]
        # the fastest plan, unless within the noise margin of the default
        want = fastest if fastest["geomean_us"] * 1.03 <= default["geomean_us"] else default
        assert found["best"] == want["plan"]
        assert found["speedup_vs_default"] == pytest.approx(default["geomean_us"] / want["geomean_us"], rel=1e-9)
    assert (PLANS_FILE.read_text() if PLANS_FILE.exists() else None) == before  # a smoke run writes no plans


def test_tune_decode_attention_merges_plans_per_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The plans file keeps other devices' plans and the batch sizes not measured again, and reads back."""
    from kernels.attention.triton_backend import load_plans

    monkeypatch.syspath_prepend(str(BENCH))
    tune = importlib.import_module("tune_decode_attention")
    path = tmp_path / "plans.json"
    fast = dataclasses.asdict(DecodePlan(block_h=64, block_n=16, num_warps=8))
    tune.merge_plans(path, "GPU A", [{"heads": 128, "batch": 1, "best": fast},
                                     {"heads": 16, "batch": 4, "best": dataclasses.asdict(DecodePlan())}])
    tune.merge_plans(path, "GPU B", [{"heads": 16, "batch": 1, "best": dataclasses.asdict(DecodePlan(block_n=64))}])
    tune.merge_plans(path, "GPU A", [{"heads": 16, "batch": 64, "best": dataclasses.asdict(DecodePlan(waves=2))}])
    assert load_plans("GPU A", path) == {128: {1: DecodePlan(**fast)}, 16: {4: DecodePlan(), 64: DecodePlan(waves=2)}}
    assert load_plans("GPU B", path) == {16: {1: DecodePlan(block_n=64)}}


@gpu_smoke
def test_omnikv_decode_smoke(tmp_path: Path) -> None:
    # the timed context's KV drawn at random (--fill random); the checks prefill theirs. One context and
    # one batch size (of two rows: a row reading another's slots shows): every kernel runs interpreted here
    # (the default two contexts took 100 s, batches 1 and 2 130 s on a 2-core AVX2 machine)
    r = run_smoke("omnikv_gpu.py", tmp_path / "omnikv.json", "--batch", "2", "--fill", "random",
                  "--contexts", "96")
    assert r["smoke"] and r["layers"] == 6 and r["preset"] == "tiny-deepseek-v2" and r["fill"] == "random"
    assert r["omnikv"]["filter_layers"] == [1, 3] and 2 in r["plan_roles"]  # OmniKVConfig.default_for(6)
    assert [(c["bank"], c["batch"]) for c in r["checks"]] == [(False, 2), (True, 2)]
    for c in r["checks"]:  # 4 steps x the batch's requests went sparse
        assert c["correct"] and c["sparse_decodes"] == 4 * c["batch"]
        assert c["rel_err"] <= 1e-5 and c["copies_rel_err"] <= 1e-5  # fp32 here
    assert [(row["context"], row["batch"], row["graphs"], row["bank"]) for row in r["runs"]] == [  # no CUDA: no graphs
        (96, 2, False, False), (96, 2, False, True)]
    for row in r["runs"]:
        assert row["full_tok_s"] == pytest.approx(row["batch"] * 1e3 / row["full_ms"], rel=1e-9)
        # the bank: the one sparse layer of 6 with filter layers 1 and 3 (layer 5) on the host
        host = (48 + 8) * 4 * row["context"] if row["bank"] else 0
        assert (row["kv_host_bytes_per_request"], row["kv_device_bytes_per_request"]) == (
            host, row["kv_bytes_per_request"] - host)
        # one prompt per context, short enough for 1 timing (one per batch size) of warm-up 1, the peak step,
        # 2 steps x 1 round
        assert row["prompt_len"] == row["context"] - (1 + 1 + 2 * 1)
        assert row["full_ms"] > 0 and row["omnikv_ms"] > 0
        assert row["speedup"] == pytest.approx(row["full_ms"] / row["omnikv_ms"], rel=1e-9)
        assert row["selected_per_sparse_layer"] == math.ceil(0.1 * row["context"]) + 4 + 64
        assert row["kv_bytes_per_request"] == row["context"] * 6 * (48 + 8) * 4  # fp32 latent rows, every layer


@gpu_smoke
def test_model_decode_smoke(tmp_path: Path) -> None:
    try:
        importlib.import_module("cpp_experts")
        extra = ["--hybrid"]
    except ImportError:
        extra = []
    r = run_smoke("model_decode_gpu.py", tmp_path / "model.json", "--layer-ops", "fused", "torch", *extra)
    assert r["smoke"] and r["attention_backend"] == "triton" and r["expert_backend"] == "triton"
    assert r["model"]["layers"] == 2 and r["model"]["weight_bytes"]["per_routed_expert"] > 0
    assert [(row["layer_ops"], row["batch"]) for row in r["runs"]] == [("fused", 1), ("fused", 2), ("torch", 1),
                                                                     ("torch", 2)]
    assert [row["batch"] for row in r["peer"]] == [1, 2]
    assert set(r["targets"]["fused_layer_ops_speedup_over_torch_ops"]) == {"graphs off, batch 1", "graphs off, batch 2"}
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
    plain = {"graphs off", "graphs off, layer ops as torch ops"}
    assert names == (plain | {"hybrid (cpp experts), graphs off"} if extra else plain)
    for c in r["checks"]:
        # triton (and cpp) kernels against the torch reference: close, but not the same code (a
        # check that can fail: test_model_check_catches_a_wrong_expert_backend)
        assert c["correct"] and 0 < c["rel_err_vs_ref"] < 0.05, c
    if extra:
        assert [(row["graphs"], row["batch"]) for row in r["hybrid"]] == [("off", 2)]
    assert r["all_correct"] and r["targets"]["target_batch1_tokens_per_s"] == 250.0


@pytest.mark.slow
def test_serve_gpu_check_smoke(tmp_path: Path) -> None:
    """The served end-to-end check, its GPU server stood in for by the torch reference on the CPU: two
    real servers, the same greedy requests, streaming, a bad request and /metrics."""
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(BENCH / "serve_gpu_check.py"), "--smoke", "--max-tokens", "8",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert proc.returncode == 0 and r["failures"] == [], (r["failures"], proc.stderr[-2000:])
    assert r["smoke"] and r["greedy_agreement"].endswith("/16") and r["stream_equals_plain"]
    assert r["cuda_completion_tokens"] == r["cpu_completion_tokens"] == 16 * 8
    assert r["bad_request"]["status"] == 400 and r["bad_request"]["error"]["param"] == "max_tokens"
    assert r["metrics_lines"] > 0


def test_hybrid_routing_cpu_run(tmp_path: Path) -> None:
    """The routing diagnosis on the CPU (torch and cpp experts in bf16 against the fp32 oracle): every
    position where a bf16 run's pick lies beyond rounding from the oracle's best has a router decision
    that flipped there on a small oracle margin, the explanation the hybrid placement test relies on."""
    try:
        importlib.import_module("cpp_experts")
    except ImportError as e:
        pytest.skip(f"cpp_experts does not import: {e}")
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, str(BENCH / "hybrid_routing_gpu.py"), "--cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"torch", "cpp"} and r["oracle_min_router_margin"] >= 0
    for run in r["runs"].values():
        for row in run["positions_over_0.03"]:
            assert row["flips"] and min(f["oracle_margin"] for f in row["flips"]) < 0.02, row


def test_serve_gpu_check_tells_near_ties_from_wrong_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served check's agreement rule, on answers shaped as the completions API returns them: a
    first divergence is measured in the reference's logprobs, a pick outside its top ones is infinitely
    far, and texts that never part have no divergence."""
    monkeypatch.syspath_prepend(str(BENCH))
    check = importlib.import_module("serve_gpu_check")

    def answer(tokens: list[str], tops: list[dict[str, float]]) -> dict[str, Any]:
        return {"choices": [{"logprobs": {"tokens": tokens, "top_logprobs": tops}}]}

    ref = answer(["a", "b", "c"], [{"a": -1.0}, {"b": -2.0, "x": -2.01, "y": -3.5}, {"c": -0.5}])
    tie = check.first_divergence(answer(["a", "x", "z"], []), ref)
    assert tie["token"] == 1 and tie["test"] == "x" and tie["gap_nats"] == pytest.approx(0.01)
    assert check.first_divergence(answer(["a", "y"], []), ref)["gap_nats"] == pytest.approx(1.5)
    assert check.first_divergence(answer(["a", "q"], []), ref)["gap_nats"] == math.inf
    assert check.first_divergence(answer(["a", "b", "c"], []), ref) is None


@pytest.fixture
def mla_bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("mla_decode_gpu")


def _case(mla_bench, backend) -> tuple[Any, Any]:
    shapes = mla_bench.SMOKE_SHAPES
    batch = mla_bench.build_decode_batch(3, 50, 1, shapes, torch.bfloat16, torch.device("cpu"), backend, seed=1)
    return batch, shapes


@gpu_smoke
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


@gpu_smoke
def test_mla_reference_on_a_sub_batch_when_torch_does_not_fit(mla_bench) -> None:
    from kernels.attention.torch_backend import TorchAttentionBackend

    args = argparse.Namespace(repeats=1, warmup=0, peer="torch")
    batch, shapes = _case(mla_bench, TorchAttentionBackend())
    row = mla_bench.run_case(batch, 4, shapes, args, mla_bench.Timer(torch.device("cpu")), 1e9, 0,
                             TorchAttentionBackend(), seed=2)
    assert row["checked_requests"] == 1 and row["peer_us"] is None and "peer_skipped" in row
    assert row["correct"] and row["max_abs_diff"] < 1e-3


@gpu_smoke
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


# ------------------------------------------------------------------------------------------------
# The CPU peer benchmarks: pure parts only (no server, no llama.cpp, no model), a few seconds.


@pytest.fixture
def cpu_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """bench/ importable, the peers directory empty and no override: llama.cpp is absent."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("MLASERVE_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("MLASERVE_LLAMA_CPP_BIN", raising=False)
    monkeypatch.delenv("MLASERVE_LLAMA_CPP_SRC", raising=False)
    return argparse.Namespace(**{m: importlib.import_module(m) for m in
                                 ("peers", "cpu_common", "serve_cpu", "deepseek_cpu", "make_deepseek_gguf",
                                  "cpu_contention", "serve_overhead_cpu", "bench_cpu_model")})


CPUINFO = """processor\t: 0
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_vnni amx_tile
processor\t: 1
model name\t: AMD EPYC 7B12 64-Core Processor
"""


def test_machine_description_and_arithmetic(cpu_bench) -> None:
    cc = cpu_bench.cpu_common
    info = cc.cpuinfo(CPUINFO)
    assert info["cpu"] == "AMD EPYC 7B12 64-Core Processor" and info["cores"] >= 1
    assert info["avx2"] and info["avx512"] and info["avx512_vnni"] and info["amx"] and not info["avx512_bf16"]
    assert (info["cpu_family"], info["cpu_model"]) == (23, 49)
    assert not cc.cpuinfo("flags : sse2 avx2\n")["avx512"] and cc.cpuinfo("")["cpu_family"] is None
    assert cc.machine_tag({"cpu": "AMD EPYC 7B12 64-Core Processor", "cores": 2}) == "amd_epyc_7b12_64_core_processor_2c"
    assert cc.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert cc.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # numpy's linear interpolation
    assert cc.percentile([7.0], 99) == 7.0
    assert cc.ratio(3.0, 2.0) == 1.5 and cc.ratio(None, 2.0) is None and cc.ratio(1.0, 0.0) is None
    assert cc.check_target(1.6, 1.5)["met"] and not cc.check_target(1.4, 1.5)["met"]
    assert cc.check_target(0.9, 1.0, higher_is_better=False) == {"value": 0.9, "target": 1.0, "op": "<=", "met": True}
    assert cc.check_target(None, 1.0)["met"] is None
    # /proc/stat: user nice system idle iowait irq softirq steal -> busy excludes idle and iowait
    a = cc.cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    b = cc.cpu_times("cpu  200 0 100 850 50 0 0 0 0 0\n")
    assert a == (150, 1000) and b == (300, 1200) and cc.busy_fraction(a, b) == pytest.approx(0.75)
    assert cc.busy_fraction(a, a) == 0.0
    if Path("/proc/self/status").exists():  # this process's private memory, as the load's figure reads it
        import mmap

        before = cc.proc_status("RssAnon")
        block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE)  # fresh pages: a bytearray may reuse the heap
        for at in range(0, len(block), 4096):
            block[at] = 1
        assert cc.proc_status("RssAnon") - before >= 60 << 20
        block.close()
        assert cc.proc_status("NoSuchKey") == 0
    # others' share: machine busy minus ours (this process, its children, the servers' sessions)
    assert cc.others_fraction((100, 1000, 40), (300, 1200, 140)) == pytest.approx(0.5)
    assert cc.others_fraction((100, 1000, 40), (150, 1200, 140)) == 0.0  # never negative
    assert cc.should_retry(0.3, 0.1, attempt=0, retries=2) and not cc.should_retry(0.3, 0.1, attempt=2, retries=2)
    assert not cc.should_retry(0.05, 0.1, 0, 2) and not cc.should_retry(None, 0.1, 0, 2)
    with cc.OthersMeter((os.getpid(),)) as meter:
        sum(range(100000))
    assert meter.others is None or 0.0 <= meter.others <= 1.0
    gate = cc.wait_for_quiet(threshold=1.01, max_wait=0.0, interval=0.01)  # any machine is below 101% busy
    assert gate["quiet"] and 0.0 <= gate["busy_before"] <= 1.0 and gate["waited_s"] < 5


def test_peers_absent_present_and_idempotent(cpu_bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peers = cpu_bench.peers
    assert peers.llama_cpp_bin("llama-server") is None and peers.convert_script() is None
    assert "make peers" in peers.absent_reason("llama-bench")
    build, src = peers.cmake_commands(Path("/s"), Path("/b"), 2)
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"} <= set(build)
    assert src[src.index("-j") + 1] == "2" and set(peers.TARGETS) <= set(src)
    # an override directory holding an executable is found first
    other = tmp_path / "other-bin"
    other.mkdir()
    exe = other / "llama-server"
    exe.write_text("#!/bin/sh\necho 'version: 1 (abc)' >&2\n")
    exe.chmod(0o755)
    monkeypatch.setenv("MLASERVE_LLAMA_CPP_BIN", str(other))
    assert peers.llama_cpp_bin("llama-server") == exe and peers.binary_version(exe) == "version: 1 (abc)"
    assert peers.llama_cpp_bin("llama-bench") is None
    # a finished build is never redone: nothing is downloaded or compiled
    version = peers.llama_cpp_version()
    peers.bin_dir(version).mkdir(parents=True)
    for t in peers.TARGETS:
        (peers.bin_dir(version) / t).write_text("")
        (peers.bin_dir(version) / t).chmod(0o755)
    (peers.tree(version) / "build.json").write_text(json.dumps({"seconds": 1.0}))

    def no_run(*a, **k):
        raise AssertionError("a built tree must not run anything")

    monkeypatch.setattr(peers.subprocess, "run", no_run)
    assert peers.build() == {"seconds": 1.0}


def test_peers_unpacks_only_the_vendored_tree(cpu_bench, tmp_path: Path) -> None:
    import tarfile

    peers = cpu_bench.peers
    root = tmp_path / "sdist" / "llama_cpp_python-9.9.9"
    for rel in ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/gguf-py/gguf/__init__.py", "llama_cpp/x.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("# stub\n")
    archive = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(root, arcname=root.name)
    src = peers.unpack(archive, "9.9.9")
    assert (src / "convert_hf_to_gguf.py").is_file() and not (src / "llama_cpp").exists()
    assert peers.convert_script("9.9.9") == src / "convert_hf_to_gguf.py" and peers.gguf_py_dir("9.9.9") == src / "gguf-py"
    assert peers.unpack(archive, "9.9.9") == src  # second time: already there


# What each server streams (trimmed): llama-server puts usage on the finishing chunk, mlaserve in a
# final chunk with no choices (stream_options.include_usage).
LLAMA_SERVER_SSE = [
    'data: {"choices":[{"text":"","index":0,"finish_reason":null}],"object":"text_completion"}',
    "",
    'data: {"choices":[{"text":" there","index":0,"finish_reason":null}],"object":"text_completion"}',
    'data: {"choices":[{"text":" was","index":0,"finish_reason":"length"}],"object":"text_completion",'
    '"usage":{"completion_tokens":3,"prompt_tokens":11,"total_tokens":14}}',
    "data: [DONE]",
]
MLASERVE_SSE = [
    'data: {"choices":[{"text":" there","index":0,"finish_reason":null}]}',
    'data: {"choices":[{"text":" was a","index":0,"finish_reason":"length"}]}',
    'data: {"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":11,"total_tokens":14}}',
    "data: [DONE]",
]


@pytest.mark.parametrize("lines", [LLAMA_SERVER_SSE, MLASERVE_SSE], ids=["llama-server", "mlaserve"])
def test_serve_stream_parsing(cpu_bench, lines: list[str]) -> None:
    sc = cpu_bench.serve_cpu
    state = sc.StreamState(t_start=10.0)
    for i, line in enumerate(lines):
        state.feed(sc.parse_sse(line), 10.0 + 0.5 * (i + 1))
    s = state.sample(t_end=13.0)
    first_text = next(i for i, ln in enumerate(lines) if '"text":" ' in ln)
    assert s["ttft_s"] == pytest.approx(0.5 * (first_text + 1))  # the first chunk with text, not an empty one
    assert (s["completion_tokens"], s["prompt_tokens"], s["finish_reason"]) == (3, 11, "length")
    assert s["done"] and s["error"] is None and s["wall_s"] == pytest.approx(3.0)
    assert sc.sample_problems([s], 3) == [] and "expected 128" in sc.sample_problems([s], 128)[0]


def _sample(t_start: float, ttft: float, wall: float, tokens: int = 128) -> dict[str, Any]:
    return {"t_start": t_start, "t_end": t_start + wall, "wall_s": wall, "ttft_s": ttft, "completion_tokens": tokens,
            "prompt_tokens": 100, "error": None}


def test_serve_summary_ratios_and_targets(cpu_bench) -> None:
    sc = cpu_bench.serve_cpu
    conc = sc.summarize([_sample(0.0, 0.1 * (i + 1), 4.0 + i) for i in range(4)])  # 4 streams, span 7 s
    assert conc["aggregate_tok_s"] == pytest.approx(4 * 128 / 7.0)
    assert conc["ttft_p50_s"] == pytest.approx(0.25) and conc["ttft_p99_s"] == pytest.approx(0.397)
    assert conc["per_stream_tok_s_min"] == pytest.approx(128 / 7.0)
    assert sc.medians([{"x": 1.0}, {"x": 5.0}, {"x": 2.0}]) == {"x": 2.0}
    ours = {"single": {"aggregate_tok_s": 30.0, "ttft_p50_s": 0.2},
            "concurrent": {"aggregate_tok_s": 160.0, "ttft_p99_s": 1.0, "per_stream_tok_s_median": 10.0}}
    peer = {"single": {"aggregate_tok_s": 40.0, "ttft_p50_s": 0.1},
            "concurrent": {"aggregate_tok_s": 100.0, "ttft_p99_s": 2.0, "per_stream_tok_s_median": 6.0}}
    r = sc.compare(ours, peer)
    assert r["single_tok_s_ratio"] == {"value": 0.75, "target": 1.0, "op": ">=", "met": False}
    assert r["concurrent_aggregate_tok_s_ratio"]["value"] == pytest.approx(1.6) and r["concurrent_aggregate_tok_s_ratio"]["met"]
    assert r["concurrent_ttft_p99_ratio"] == {"value": 0.5, "target": 1.0, "op": "<=", "met": True}
    assert r["single_ttft_ratio"] == pytest.approx(2.0)
    absent = sc.compare(ours, None)
    assert all(absent[k]["met"] is None for k in sc.TARGETS)


def test_serve_arguments_and_commands(cpu_bench, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = cpu_bench.serve_cpu
    a = sc.parse_args([])
    assert (a.rounds, a.streams, a.max_tokens, a.ours_only, a.model) == (3, 16, 128, False, None)
    assert sc.parse_args(["--ours-only", "--rounds", "1"]).ours_only
    with pytest.raises(SystemExit):
        sc.parse_args(["--rounds", "0"])
    body = sc.request_body(sc.numbered_prompt(7), 128)
    assert body["prompt"].startswith("Request 00007. ") and body["max_tokens"] == 128
    assert body["temperature"] == 0 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    sampled = sc.request_body(sc.numbered_prompt(7), 128, seed=7)
    assert sampled["seed"] == 7 and sampled["temperature"] == 0.2 and sampled["top_p"] == 0.9
    assert sc.slot_context(100, 128) == 512 and sc.slot_context(10, 20) == 256
    for amx in (False, True):  # llama.cpp's extra buffers off where its AMX ones crash
        monkeypatch.setattr(cpu_bench.peers, "amx_int8_cpu", lambda: amx)
        cmd = sc.llama_server_command(Path("/x/llama-server"), "/m.gguf", 8081, 16, 2, 8192, [])
        assert cmd[cmd.index("-np") + 1] == "16" and cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-c") + 1] == "8192"
        assert ("--no-repack" in cmd) == amx
    ours = sc.mlaserve_command("/m.gguf", 8082, ["--seed", "1"])
    assert ours[1:4] == ["-m", "mlaserve.cli", "serve"] and ours[-2:] == ["--seed", "1"]


def test_serve_without_llama_server_records_it_skipped(cpu_bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole main() with the servers and requests faked: llama-server absent -> skipped, ours measured."""
    sc = cpu_bench.serve_cpu
    started: list[str] = []
    monkeypatch.setattr(sc, "start_server", lambda server, log_dir, timeout: started.append(server.name))
    monkeypatch.setattr(sc, "stop_server", lambda server: None)
    monkeypatch.setattr(sc, "prompt_token_count", lambda model, text: 100)

    async def fake_streams(url, bodies, timeout):
        assert all(b["max_tokens"] == 8 for b in bodies)
        return [_sample(0.0, 0.05, 1.0, tokens=8) for _ in bodies]

    monkeypatch.setattr(sc, "run_streams", fake_streams)
    out = tmp_path / "serve.json"
    assert sc.main(["--rounds", "2", "--streams", "3", "--max-tokens", "8", "--quiet-wait", "0", "--retries", "0",
                    "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert started == ["mlaserve"] and "make peers" in r["skipped"]["llama-server"]
    assert set(r["medians"]) == {"mlaserve"} and r["medians"]["mlaserve"]["single"]["aggregate_tok_s"] == pytest.approx(8.0)
    assert r["medians"]["mlaserve"]["concurrent"]["aggregate_tok_s"] == pytest.approx(24.0)
    assert len(r["raw"]["mlaserve"]["concurrent"]) == 2 and len(r["raw"]["mlaserve"]["concurrent"][0]["samples"]) == 3
    assert r["ratios_ours_over_peer"]["single_tok_s_ratio"]["met"] is None and r["problems"] == []
    assert {"cpu", "cores", "avx2", "avx512", "amx"} <= set(r["machine"]) and r["workload"]["streams"] == 3
    assert r["gguf"].endswith(".gguf") and r["commands"]["mlaserve"][1:4] == ["-m", "mlaserve.cli", "serve"]


# llama-bench -o json (trimmed to the fields the parser reads, plus a few it ignores)
LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "deepseek2 16B BF16", "model_size": 4707069952,
   "n_threads": 2, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 4213988602, "avg_ts": 121.5,
   "stddev_ts": 1.5, "samples_ns": [4139960002], "samples_ts": [121.5]},
  {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "deepseek2 16B BF16", "model_size": 4707069952,
   "n_threads": 2, "n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ns": 311863587, "avg_ts": 9.25,
   "stddev_ts": 0.25, "samples_ns": [311863587], "samples_ts": [9.0, 9.5]}
]"""


def test_llama_bench_json_and_fake_binary(cpu_bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = cpu_bench.deepseek_cpu
    r = ds.parse_llama_bench(LLAMA_BENCH_JSON)
    assert r["pp"] == {"n": 512, "avg_ts": 121.5, "stddev_ts": 1.5, "samples_ts": [121.5], "n_depth": 0}
    assert r["tg"]["n"] == 64 and r["tg"]["avg_ts"] == 9.25 and r["tg"]["samples_ts"] == [9.0, 9.5]
    assert r["model_type"] == "deepseek2 16B BF16" and r["n_threads"] == 2
    # the subprocess path, with a stand-in binary that prints the sample (and one that fails)
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    (tmp_path / "out.json").write_text(LLAMA_BENCH_JSON)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.json'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MLASERVE_LLAMA_CPP_BIN", str(fake.parent))
    binary = cpu_bench.peers.llama_cpp_bin("llama-bench")
    monkeypatch.setattr(cpu_bench.peers, "amx_int8_cpu", lambda: True)  # llama.cpp's AMX buffers crash there
    assert ds.llama_bench_command(binary, Path("/m.gguf"), 2, 512, 64, 1)[-2:] == ["--repack", "0"]
    monkeypatch.setattr(cpu_bench.peers, "amx_int8_cpu", lambda: False)
    cmd = ds.llama_bench_command(binary, Path("/m.gguf"), 2, 512, 64, 1)
    assert cmd[1:] == ["-m", "/m.gguf", "-t", "2", "-p", "512", "-n", "64", "-r", "1", "-o", "json"]
    assert ds.run_llama_bench(cmd, 30)["tg"]["avg_ts"] == 9.25
    fake.write_text("#!/bin/sh\necho 'failed to load model' >&2\nexit 1\n")
    assert "failed to load model" in ds.run_llama_bench(cmd, 30)["error"]


def test_deepseek_decode_traffic_and_floor(cpu_bench) -> None:
    ds = cpu_bench.deepseek_cpu
    # (name, shape as llama.cpp lists it: ne0 first, bytes)
    tensors = [
        ("token_embd.weight", (2048, 1000), 1000 * 100),   # one row: 100 bytes
        ("blk.0.attn_norm.weight", (2048,), 8),
        ("blk.0.attn_kv_a_mqa.weight", (2048, 576), 1000),
        ("blk.0.ffn_up.weight", (2048, 10944), 5000),       # dense layer
        ("blk.1.ffn_gate_inp.weight", (2048, 64), 640),     # router
        ("blk.1.ffn_up_exps.weight", (2048, 1408, 64), 64 * 300),
        ("blk.1.ffn_down_shexp.weight", (2816, 2048), 700),
        ("output_norm.weight", (2048,), 8),
        ("output.weight", (2048, 1000), 9000),
    ]
    t = ds.bytes_per_decoded_token(tensors, n_experts=64, top_k=6)
    b = t["breakdown"]
    assert b["token_embd_row"] == 100 and b["routed_experts"] == 6 * 300 and b["shared_experts"] == 700
    assert b["attention"] == 8 + 1000 and b["dense_ffn"] == 5000 + 640 and b["output"] == 9008
    assert t["bytes_per_token"] == sum(b.values()) and t["file_tensor_bytes"] == sum(n for *_, n in tensors)
    # what --profile divides each phase's time into (the router and output head in full, experts top-k)
    assert ds.phase_bytes(tensors, n_experts=64, top_k=6) == {"qkv_proj": 1000, "gate_up": 5000, "router": 640,
                                                              "experts": 6 * 300, "shared_experts": 700,
                                                              "lm_head": 9000}
    f = ds.floor_figures(t["bytes_per_token"], read_bw=t["bytes_per_token"] * 20.0, tok_s=5.0)
    assert f == {"floor_tok_s": pytest.approx(20.0), "fraction_of_floor": pytest.approx(0.25)}
    entry = {"decode_weight_traffic": {"bytes_per_token": 1000}, "ours": {"torch": {"tg_tok_s": 2.0, "pp_tok_s": 30.0}},
             "llama_bench": {"tg_tok_s": 8.0, "pp_tok_s": 120.0}}
    ds.derive(entry, read_bw=10_000.0)
    assert entry["decode_floor_tok_s"] == pytest.approx(10.0)
    assert entry["llama_bench"]["tg_fraction_of_floor"] == pytest.approx(0.8)
    o = entry["ours"]["torch"]
    assert (o["tg_fraction_of_floor"], o["tg_ratio_vs_llama_bench"], o["pp_ratio_vs_llama_bench"]) == pytest.approx((0.2, 0.25, 0.25))
    # each round's rate against the read measured right after it
    spells = {"decode_weight_traffic": {"bytes_per_token": 1000},
              "ours": {"cpp": {"tg_tok_s": 3.0, "tg_samples": [{"tok_s": 2.0, "read_after_Bps": 4000.0},
                                                                {"tok_s": 3.0, "read_after_Bps": 6000.0},
                                                                {"tok_s": 4.0, "read_after_Bps": 4000.0}]}},
              "llama_bench": {"tg_tok_s": 2.0, "rounds": [{"tg": {"avg_ts": 2.0}, "read_after_Bps": 8000.0},
                                                          {"error": "x"}]}}
    ds.derive(spells, read_bw=10_000.0)
    assert spells["ours"]["cpp"]["tg_fraction_of_read_after"] == {"rounds": [0.5, 0.5, 1.0], "median": 0.5}
    assert spells["llama_bench"]["tg_fraction_of_read_after"] == {"rounds": [0.25, None], "median": 0.25}
    no_peer = {"decode_weight_traffic": {"bytes_per_token": 1000}, "ours": {"torch": {"tg_tok_s": 2.0}}, "llama_bench": None}
    ds.derive(no_peer, read_bw=10_000.0)
    assert no_peer["ours"]["torch"]["tg_ratio_vs_llama_bench"] is None


def test_the_other_cpu_benchmarks_parse_their_results(cpu_bench) -> None:
    """What the contention, serving-overhead and model benchmarks compute from their samples."""
    bm = cpu_bench.bench_cpu_model
    r = bm.summarize([(0.5, 0.01), (0.4, 0.02), (0.6, 0.005)], prompt_len=100)
    assert r["prefill_tok_s"] == pytest.approx(200.0) and r["decode_tok_s"] == pytest.approx(100.0)
    assert set(cpu_bench.cpu_contention.POLICIES) == {"mlaserve", "mlaserve-spin"}
    assert cpu_bench.cpu_contention.POLICIES["mlaserve-spin"] == {"MLASERVE_CPP_EXPERTS_WAIT": "spin"}
    assert cpu_bench.serve_overhead_cpu.cpu_seconds(os.getpid()) >= 0.0


def test_deepseek_arguments_and_missing_files(cpu_bench, tmp_path: Path) -> None:
    ds, mk = cpu_bench.deepseek_cpu, cpu_bench.make_deepseek_gguf
    a = ds.parse_args([])
    assert (a.types, a.rounds, a.prompt_tokens, a.decode_tokens, a.expert_backends) == (["bf16", "q8_0", "q4_k_m"], 3, 512, 64, ["cpp"])
    for bad in (["--decode-tokens", "1"], ["--ours-only", "--peer-only"], ["--types", "f16"]):
        with pytest.raises(SystemExit):
            ds.parse_args(bad)
    # no GGUF made and no llama-bench: everything recorded as skipped, nothing measured, exit 0
    out = tmp_path / "ds.json"
    assert ds.main(["--cache-dir", str(tmp_path / "models"), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["files"] == {} and set(r["skipped"]) == {"bf16", "q8_0", "q4_k_m"}
    assert "make_deepseek_gguf.py" in r["skipped"]["bf16"] and r["machine"]["read_bandwidth_GBps"] is None
    assert mk.gguf_path(tmp_path, "q8_0") == tmp_path / "deepseek-v2-lite-L4-s0" / "model-q8_0.gguf"


def test_deepseek_profile_on_a_tiny_gguf(cpu_bench, tmp_path: Path) -> None:
    """deepseek_cpu.py --profile end to end on a tiny DeepSeek-V2 Q8_0 GGUF through the engine: the
    decode steps alone are timed (not the prompt's forward), the phases fit in the forward and the
    forward in the step, and the weight-reading phases get a fraction of the read."""
    from models.synthetic import write_checkpoint

    ds, mk = cpu_bench.deepseek_cpu, cpu_bench.make_deepseek_gguf
    path = mk.gguf_path(tmp_path / "models", "q8_0")
    path.parent.mkdir(parents=True)
    write_checkpoint(tmp_path / "ckpt", "tiny-deepseek-v2", seed=5, gguf=True, gguf_qtype="Q8_0")
    (tmp_path / "ckpt" / "model.gguf").rename(path)
    out = tmp_path / "ds.json"
    assert ds.main(["--types", "q8_0", "--cache-dir", str(tmp_path / "models"), "--ours-only", "--rounds", "1",
                    "--skip-pp", "--decode-prompt", "3", "--decode-tokens", "7", "--profile", "--quiet-wait", "0",
                    "--retries", "0", "--threads", "2", "--out", str(out)]) == 0
    ours = json.loads(out.read_text())["files"]["q8_0"]["ours"]["cpp"]
    p = ours["profile"]
    assert p["decode_steps"] == 6 and p["step_us"] >= p["forward_us"] > 0 and p["read_Bps"] > 0
    phases = p["phases"]
    assert {"qkv_proj", "attention", "o_proj", "router", "experts", "shared_experts", "lm_head"} <= set(phases)
    assert 0 < sum(v["us_per_step"] for v in phases.values()) <= p["forward_us"]
    for name in ("qkv_proj", "o_proj", "experts", "shared_experts", "lm_head"):
        assert phases[name]["weight_bytes"] > 0 and phases[name]["fraction_of_read"] > 0
    assert "fraction_of_read" not in phases["attention"]


def test_make_deepseek_gguf_commands_and_cache(cpu_bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mk = cpu_bench.make_deepseek_gguf
    a = mk.parse_args([])
    assert (a.layers, a.seed, a.types, a.force) == (4, 0, ["bf16", "q8_0", "q4_k_m"], False)
    with pytest.raises(SystemExit):
        mk.parse_args(["--layers", "1"])
    cmd = mk.converter_command(Path("/src/convert_hf_to_gguf.py"), Path("/hf"), Path("/o.gguf"), "q8_0")
    assert cmd[1:] == ["/src/convert_hf_to_gguf.py", "/hf", "--outtype", "q8_0", "--outfile", "/o.gguf"]
    assert mk.quantize_command(Path("/q"), Path("/a"), Path("/b"), "Q4_K_M", 2) == ["/q", "/a", "/b", "Q4_K_M", "2"]
    # files that exist are not made again; the HF checkpoint is not written for them
    monkeypatch.setattr(mk, "make_hf", lambda *a, **k: pytest.fail("nothing to make"))
    for t in mk.TYPES:
        p = mk.gguf_path(tmp_path, t)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"GGUF")
    m = mk.make(tmp_path)
    assert m["skipped"] == {} and (m["layers"], m["preset"]) == (4, "deepseek-v2-lite")
    # q4_k_m alone, no bf16 and no llama-quantize: skipped with the reason, nothing else made
    mk.gguf_path(tmp_path, "q4_k_m").unlink()
    mk.gguf_path(tmp_path, "bf16").unlink()
    monkeypatch.setattr(mk, "make_hf", lambda *a, **k: {"stub": True})
    monkeypatch.setattr(mk, "config_summary", lambda hf: {})
    m = mk.make(tmp_path, types=("q4_k_m",))
    assert "convert_hf_to_gguf.py not found" in m["skipped"]["bf16"]  # its source, made first
    assert "make peers" in m["skipped"]["q4_k_m"] and set(m["files"]) <= {"q8_0"}


def test_glm_flash_bench_file_routes_as_transformers_in_both_engines(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's GLM-4.7-Flash files: llama.cpp's converter on `converter_input`'s view of a synthetic checkpoint
    (DeepSeek-V3's converter, DeepSeek's tokenizer, a sigmoid gating function written) gives a deepseek2 file that
    llama.cpp and we both compute as transformers' Glm4MoeLiteForCausalLM computes the checkpoint. (Without the
    written gating function llama.cpp would route by softmax at these layer counts: only GLM-4.7-Flash's released
    47 or 48 layers with its vocabulary make it assume sigmoid.)"""
    import subprocess
    import sys

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from models.synthetic import write_checkpoint
    from tests.llama_cpp_oracle import open_llama
    from tests.models.test_hf_parity import make_runner, prefill_logits

    pytest.importorskip("llama_cpp")
    monkeypatch.syspath_prepend(str(BENCH))  # (the sources `make test` unpacked, unlike cpu_bench's)
    script = importlib.import_module("peers").convert_script()
    if script is None:
        pytest.skip("llama.cpp's sources are not unpacked (`make test` does it: bench/peers.py unpack)")
    mk = importlib.import_module("make_deepseek_gguf")
    hf = write_checkpoint(tmp_path / "hf", "tiny-glm4-moe-lite", seed=3)
    out = tmp_path / "m.gguf"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(mk.converter_command(script, mk.converter_input(hf), out, "f32"), capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = [0, 5, 17, 44, 100, 250, 33, 7]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    llm = open_llama(out, n_ctx=32, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]))
    ours = prefill_logits(make_runner(out), ids)
    for got in (theirs, ours):
        assert float((got - want).abs().max() / want.abs().max()) < 2e-4


def test_serve_medians_leave_out_disturbed_rounds(cpu_bench, tmp_path: Path) -> None:
    sc = cpu_bench.serve_cpu

    def m(tok_s: float, others: float | None) -> dict[str, Any]:
        return {"summary": {"aggregate_tok_s": tok_s, "ttft_p99_s": 1.0}, "others_busy": others, "discarded": [{}]}

    assert cpu_bench.cpu_common.undisturbed([m(1, 0.5), m(2, 0.0), m(3, None)], 0.1) == ([m(2, 0.0), m(3, None)], 2)
    assert cpu_bench.cpu_common.undisturbed([m(1, 0.5), m(2, 0.6)], 0.1) == ([m(1, 0.5), m(2, 0.6)], 0)
    result = {"retry_busy": 0.1, "raw": {
        "mlaserve": {"single": [m(10, 0.0), m(1, 0.9), m(12, 0.05)], "concurrent": [m(50, 0.0)]},
        "llama-server": {"single": [m(20, 0.0)], "concurrent": [m(100, 0.7), m(40, 0.8)]}}}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(result))
    assert sc.main(["--reanalyze", str(path)]) == 0  # runs nothing: recomputes from the raw samples
    r = json.loads(path.read_text())
    assert r["medians"]["mlaserve"]["single"]["aggregate_tok_s"] == 11  # the disturbed 1 left out
    assert r["medians"]["llama-server"]["concurrent"]["aggregate_tok_s"] == 70  # all disturbed: all kept ...
    assert r["rounds_used"]["llama-server"]["concurrent"] == 0  # ... and said so
    assert r["ratios_ours_over_peer"]["single_tok_s_ratio"]["value"] == pytest.approx(11 / 20)
    assert (r["measurements_disturbed_kept"], r["measurements_discarded"]) == (3, 7)


# ------------------------------------------------------------------------------------------------
# The structured-output benchmark: the served part faked (no server), the grammar parts for real on
# the default model's tokenizer (a few seconds), and the in-process engine part in its quick size.


@pytest.fixture
def structured_bench(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("xgrammar")
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("structured_cpu")


# what mlaserve streams for a chat completion (trimmed): a role chunk, content deltas, the finish, usage
CHAT_SSE = [
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"content":"{\\"items\\""},"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"content":": ["},"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"content":"{"},"finish_reason":"length"}]}',
    'data: {"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":84,"total_tokens":87}}',
    "data: [DONE]",
]


def test_structured_stream_parsing_and_schema(structured_bench) -> None:
    import jsonschema

    from server.structured import check_json_schema

    sb = structured_bench
    state = sb.ChatStreamState(t_start=10.0)
    for i, line in enumerate(CHAT_SSE):
        state.feed(sb.serve_cpu.parse_sse(line), 10.0 + 0.5 * (i + 1))
    s = state.sample(t_end=20.0)
    # TTFT at the first chunk with content (not the role chunk); the span ends at the last content chunk
    assert s["ttft_s"] == pytest.approx(1.0) and s["decode_s"] == pytest.approx(1.0) and s["wall_s"] == pytest.approx(2.0)
    assert (s["completion_tokens"], s["content_chunks"], s["finish_reason"]) == (3, 3, "length") and s["done"]
    summary = sb.summarize([s])
    assert summary["aggregate_tok_s"] == pytest.approx(1.5) and summary["per_stream_decode_tok_s_median"] == pytest.approx(2.0)
    assert summary["finish_reasons"] == {"length": 1} and sb.sample_problems([s], 3) == []
    assert "not 128" in sb.sample_problems([s], 128)[0]
    # the bodies: the same prompt, a schema the server accepts, ignore_eos only where no grammar runs
    c, u = sb.chat_body(7, 128, True), sb.chat_body(7, 128, False)
    assert c["messages"] == u["messages"] and c["messages"][0]["content"].startswith("Request 00007. ")
    assert c["response_format"]["json_schema"]["schema"] == sb.SCHEMA and "ignore_eos" not in c and u["ignore_eos"]
    check_json_schema(sb.SCHEMA, "response_format.json_schema.schema")
    for name in sb.NAMES.values():
        jsonschema.validate(json.loads(sb.valid_document(name)), sb.SCHEMA)
    a = sb.parse_args([])
    assert (a.rounds, a.max_tokens, a.stream_counts, a.threads) == (6, 128, [1, 16], 2)
    q = sb.parse_args(["--quick"])
    assert (q.rounds, q.max_tokens, q.stream_counts, q.quiet_wait, q.retries) == (1, 16, [1, 2], 0.0, 0)
    for bad in (["--streams", "1,x"], ["--streams", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)
    # the engine-counter arithmetic: 16 steps, 0.5 s of forwards in a 1.3 s span
    assert sb.per_step((1.0, 10), (1.5, 26), 1.3) == pytest.approx(
        {"engine_steps": 16, "forward_ms_per_step": 31.25, "outside_forward_ms_per_step": 50.0})
    assert sb.per_step(None, (1.5, 26), 1.3)["forward_ms_per_step"] is None
    runs = {"constrained": [{"forward_ms": 40.0, "step_ms": 45.0}], "unconstrained": [{"forward_ms": 50.0, "step_ms": 51.0}]}
    assert sb.equal_forward_ratio(runs) == pytest.approx(46.0 / 50.0)  # forward 45 (the pooled median) in both


def test_structured_quick_run_with_the_server_faked(structured_bench, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """main(--quick) with the server and its streams faked; compile times and mask costs measured for real."""
    sb = structured_bench
    started: list[list[str]] = []
    monkeypatch.setattr(sb.serve_cpu, "start_server", lambda server, log_dir, timeout: started.append(server.command))
    monkeypatch.setattr(sb.serve_cpu, "stop_server", lambda server: None)
    counters = iter(range(10_000))
    monkeypatch.setattr(sb, "engine_counters", lambda url: (0.4 * (k := next(counters)), 16.0 * k))

    async def fake_streams(url, bodies, timeout):
        assert all(b["max_tokens"] == 16 and b["stream"] for b in bodies)
        wall = 1.25 if "response_format" in bodies[0] else 1.0  # constrained 20% slower
        return [{"t_start": 0.0, "t_end": wall, "wall_s": wall, "ttft_s": 0.1, "decode_s": wall - 0.1,
                 "completion_tokens": 16, "prompt_tokens": 84, "finish_reason": "length", "error": None}
                for _ in bodies]

    monkeypatch.setattr(sb, "run_chat_streams", fake_streams)
    out = tmp_path / "structured.json"
    assert sb.main(["--quick", "--skip-engine", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(started) == 1 and started[0][1:4] == ["-m", "mlaserve.cli", "serve"]
    assert set(r["raw"]) == {"1", "2"} and all(len(r["raw"][n][m]) == 1 for n in r["raw"] for m in r["raw"][n])
    for n in ("1", "2"):
        t = r["ratios"][n]["median_round_ratio"]
        assert t["value"] == pytest.approx(0.8) and t["target"] == 0.9 and t["met"] is False
        assert r["medians"][n]["constrained"]["aggregate_tok_s"] == pytest.approx(int(n) * 16 / 1.25)
        assert r["ratios"][n]["ratio_at_equal_forward"] is not None
    assert r["problems"] == [] and r["engine_steps"] is None and {"cpu", "cores"} <= set(r["machine"])
    assert r["settings"]["max_tokens"] == 16 and r["versions"]["xgrammar"]
    c = r["compile"]
    from tests.server.test_structured_e2e import SCHEMAS

    assert c["first_use_s"]["median"] > 0 and len(c["schemas"]) == len(SCHEMAS) + 2 and c["repeats"] == 1
    for name, s in c["schemas"].items():
        assert 0 < s["warm_s"] and len(s["cold_runs"]) == 1, name
    slow = c["schemas"]["inventory (the throughput schema)"]
    assert slow["warm_s"] < slow["cold_s"]  # the second compile is a cache hit
    for doc, per in r["mask"]["documents"].items():
        assert per["tokens"] > 100, doc
        for b in ("1", "16"):
            m = per[b]
            assert m["steps"] == 20 and 0 < m["fill"]["median_ms"] < m["apply_grammar_masks"]["median_ms"]
            assert m["apply"]["median_ms"] > 0 and m["xgrammar_cpu_kernel"]["median_ms"] > 0
            assert m["sampler_with_grammar"]["median_ms"] > m["sampler_without_grammar"]["median_ms"]


def test_structured_engine_steps(structured_bench) -> None:
    """Part 3 in its quick size: the real engine core in this process, its grammar calls timed and restored."""
    import executor.grammar as eg
    import executor.sampler as es

    sb = structured_bench
    before = (es.apply_grammar_masks, eg.Grammar.fill, eg.Grammar.accept)
    r = sb.engine_steps([1, 2], max_tokens=8, threads=2, rounds=1)
    assert (es.apply_grammar_masks, eg.Grammar.fill, eg.Grammar.accept) == before  # unwrapped again
    for n in ("1", "2"):
        c, u = r["medians"][n]["constrained"], r["medians"][n]["unconstrained"]
        assert c["tokens"] == u["tokens"] == 8 * int(n) and c["steps"] == u["steps"] == 8
        assert c["fill_ms"] > 0 and c["apply_ms"] > 0 and c["accept_ms"] > 0 and c["mask_ms"] > c["fill_ms"]
        assert u["fill_ms"] == u["apply_ms"] == u["accept_ms"] == 0 and u["forward_ms"] > 0
        assert 0 < r["ratio_at_equal_forward"][n] < 2 and r["tok_s_ratio"][n] > 0


def test_omnikv_cpu_bench_runs_end_to_end(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """bench/omnikv_cpu.py on the default model at tiny sizes: speed, fidelity, needle and divergence parts,
    OmniKV really sparse (a 10% budget of 300+ tokens), and the result file's shape; with a budget
    that keeps every token the divergence is none."""
    monkeypatch.syspath_prepend(str(BENCH))
    omnikv_cpu = importlib.import_module("omnikv_cpu")

    out = tmp_path / "omnikv.json"
    assert omnikv_cpu.main(["--contexts", "320", "--rounds", "2", "--steps", "2", "--fidelity-contexts", "600",
                            "--fidelity-prompts", "1", "--fidelity-tokens", "6", "--needle-lengths", "400",
                            "--needle-depths", "2", "--parts", "speed,fidelity,needle,divergence", "--divergence-seeds", "7",
                            "--divergence-tokens", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["dtype"], res["kv_dtype"]) == ("float32", "float32")
    assert res["config"]["filter_layers"] and res["config"]["budget_ratio"] == 0.1
    assert [r["context"] for r in res["speed"]] == [320] and res["speed"][0]["omnikv_ms"] > 0
    assert 0.0 <= res["fidelity"]["mean_teacher_forced_agreement"] <= 1.0
    assert len(res["needle"]["runs"]) == 2 and {"same", "full", "omnikv"} <= set(res["needle"]["runs"][0])
    dv = res["divergence"]
    assert dv["seeds"] == [7] and dv["steps"] == 2 * 3 and 0.0 <= dv["flip_rate"] <= 1.0
    assert 0.0 <= dv["p50_kl"] <= dv["max_kl"] and all(f["margin"] >= 0.0 for f in dv["flips"])

    # a budget >= the context: the selection keeps every token; in the served dtypes (bf16 activations
    # and cache), where the filter layers take the importance from their attention (the shipped
    # last_token window), with the layer after each filter sparse too, and other sink/recent counts
    whole = tmp_path / "whole.json"
    assert omnikv_cpu.main(["--parts", "divergence", "--budget", "1.0", "--needle-lengths", "400", "--needle-depths", "2",
                            "--divergence-seeds", "7", "--divergence-tokens", "3", "--dtype", "auto",
                            "--full-after-filter", "off", "--sink-tokens", "16", "--recent-tokens", "128",
                            "--out", str(whole)]) == 0
    res = json.loads(whole.read_text())
    # (bf16 activations where the CPU does bf16 math; the cache of GGUF blocks is bf16 either way)
    assert res["kv_dtype"] == "bfloat16" and res["dtype"] in ("bfloat16", "float32")
    assert not res["config"]["full_after_filter"]
    assert (res["config"]["sink_tokens"], res["config"]["recent_tokens"]) == (16, 128)
    dv = res["divergence"]
    assert dv["steps"] == 6 and dv["flips"] == [] and abs(dv["max_kl"]) < 1e-6


def test_omnikv_cpu_floor_part(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """The floor part at tiny sizes with a budget that keeps every token: OmniKV is its own run's full
    attention, the fp32 run is the reference itself, the served (bf16 cache) run moves a little, and
    llama.cpp (where installed), fed the same tokens at the same positions, stays close: a prompt or
    position out of line would put its KL in whole nats."""
    monkeypatch.syspath_prepend(str(BENCH))
    omnikv_cpu = importlib.import_module("omnikv_cpu")
    out = tmp_path / "floor.json"
    assert omnikv_cpu.main(["--parts", "floor", "--budget", "1.0", "--needle-lengths", "300,500", "--needle-depths", "2",
                            "--needle-tokens", "6", "--divergence-seeds", "7", "--divergence-tokens", "4",
                            "--fidelity-contexts", "400", "--floor-doc-prompts", "1", "--fidelity-tokens", "5",
                            "--out", str(out)]) == 0
    fl = json.loads(out.read_text())["floor"]
    llama = importlib.util.find_spec("llama_cpp") is not None
    assert set(fl["needle"]) == {"fp32", "kv_bf16"} | ({"llama_cpp"} if llama else set())
    for kind, steps in (("needle", 4 * 4), ("doc", 5)):
        ref, served = fl[kind]["fp32"], fl[kind]["kv_bf16"]
        assert ref["steps"] == served["steps"] == steps
        assert ref["full_vs_fp32_full"] == {"mean_kl": 0.0, "greedy_differs": 0.0}
        for run in (ref, served):
            assert abs(run["omnikv_vs_own_full"]["mean_kl"]) < 1e-6 and run["omnikv_vs_own_full"]["greedy_differs"] == 0
        assert 0.0 < served["full_vs_fp32_full"]["mean_kl"] < 0.05
        if llama:
            assert fl[kind]["llama_cpp"]["steps"] == steps and 0.0 < fl[kind]["llama_cpp"]["full_vs_fp32_full"]["mean_kl"] < 0.05
    assert fl["needle"]["fp32"]["answers"]["prompts"] == 4 and fl["needle"]["fp32"]["answers"]["full_same_as_fp32_full"] == 1.0
    assert fl["needle"]["fp32"]["answers"]["omnikv_same_as_own_full"] == 1.0
    assert len(fl["prompts"]) == 4 and {"fp32", "kv_bf16", "code"} <= set(fl["prompts"][0])
    with pytest.raises(SystemExit):  # the reference is fp32
        omnikv_cpu.main(["--parts", "floor", "--dtype", "auto", "--out", str(tmp_path / "x.json")])


def test_contention_quiet_pairs_cost(cpu_bench) -> None:
    """The policy's paired quiet cost: the pairs' median ratio, its bootstrap interval around it."""
    pc = cpu_bench.cpu_contention.paired_cost
    r = pc([1.02, 1.05, 0.98, 1.04, 1.03, 1.01, 1.10])
    assert r["cost"] == pytest.approx(0.03) and r["pairs"] == 7
    lo, hi = r["interval_90"]
    assert 0.98 - 1 <= lo <= r["cost"] <= hi <= 1.10 - 1
    assert pc([1.0] * 5)["interval_90"] == [0.0, 0.0]


def test_cpu_model_profile_on_a_tiny_gguf(cpu_bench, tmp_path: Path) -> None:
    """bench_cpu_model.py --profile on a tiny GGUF: the decode steps' phases, which add up to no more than
    the forward, itself within the step; the profile is off and empty afterwards."""
    from models.loader.gguf_writer import write_gguf
    from models.synthetic import write_checkpoint

    d = write_checkpoint(tmp_path / "ckpt", "tiny-llama", seed=3)
    write_gguf(d, tmp_path / "model.gguf", "Q4_1")
    ours = cpu_bench.bench_cpu_model.Ours(str(tmp_path / "model.gguf"), True, list(range(10, 30)), 6)
    p = ours.profile()
    assert p["decode_steps"] == 6 and p["step_us"] >= p["forward_us"] > 0
    phases = p["phases"]
    assert {"qkv_proj", "attention", "o_proj", "gate_up", "down", "lm_head"} <= set(phases)
    assert 0 < sum(v["us_per_step"] for v in phases.values()) <= p["forward_us"]
    assert sum(v["share_of_step"] for v in phases.values()) <= 1.0
    assert ours.runner.native_forward.plan.profile()["forwards"] == 0
    ours.run()
    assert ours.runner.native_forward.plan.profile()["forwards"] == 0


def test_cpu_model_general_batches_contender(cpu_bench, tmp_path: Path) -> None:
    """bench_cpu_model.py --general-batches: the same file with every decode batch built the general way,
    decoding the same greedy tokens as the reused inputs do."""
    from models.loader.gguf_writer import write_gguf
    from models.synthetic import write_checkpoint

    d = write_checkpoint(tmp_path / "ckpt", "tiny-llama", seed=4)
    write_gguf(d, tmp_path / "model.gguf", "Q4_1")
    Ours = cpu_bench.bench_cpu_model.Ours
    fast, general = (Ours(str(tmp_path / "model.gguf"), True, list(range(10, 30)), 6, reused_inputs=r) for r in (True, False))
    assert general.runner.native_forward.decode_capacity == 0 < fast.runner.native_forward.decode_capacity
    a, b = (o.runner.generate_greedy(list(range(10, 30)), 8) for o in (fast, general))
    assert a == b and len(a) == 8
    assert all(o.run()[1] > 0 for o in (fast, general))


def test_serve_stall_bench_against_a_real_server(cpu_bench, tmp_path: Path) -> None:
    """bench/serve_stall_cpu.py end to end on the default model, tiny: two streams, one long prompt arriving
    while they run, our server alone (its default and a variant); the gaps and times come from real chunks."""
    stall = importlib.import_module("serve_stall_cpu")
    out = tmp_path / "stall.json"
    # streams long enough to be running when the long prompt arrives 0.3 s in, on a fast spell of the machine too
    # (two streams of the default model have made 120 tokens in ~0.3 s)
    assert stall.main(["--rounds", "1", "--streams", "2", "--max-tokens", "400", "--long", "1", "--long-words", "300",
                       "--delay", "0.3", "--ours-only", "--variant", "--chunked-prefill-size 64", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["medians"]) == {"mlaserve", "mlaserve --chunked-prefill-size 64"}
    assert "--ours-only" in r["skipped"]["llama-server"]
    for m in r["medians"].values():
        assert 0 < m["median_gap_s"] <= m["max_gap_s"] < 60 and 0 < m["long_prompts_s"] < 60, m
    assert set(r["ratios_ours_over"]) == {"mlaserve --chunked-prefill-size 64"}


def test_overload_bench_against_real_servers(cpu_bench, tmp_path: Path) -> None:
    """bench/serve_overload_cpu.py end to end on the default model, tiny: 12 clients against limits of 1 + 1,
    this checkout beside itself given as a --checkout; admissions and refusals come from real answers."""
    overload = importlib.import_module("serve_overload_cpu")
    out = tmp_path / "overload.json"
    assert overload.main(["--rounds", "1", "--clients", "12", "--seconds", "3", "--max-tokens", "4", "--running", "1",
                          "--queued", "1", "--checkout", f"same={ROOT}", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["medians"]) == {"mlaserve", "same"} and r["checkouts"] == {"same": str(ROOT)}
    for rounds in r["rounds"].values():
        (got,) = rounds
        assert got["admitted_per_s"] > 0 and got["refused_per_s"] > 0 and got["failed"] == 0, got
        assert 0 < got["refused_p50_s"] < 10 and 0 < got["admitted_p50_s"] <= got["admitted_p99_s"] < 60, got
    assert set(r["ratios_ours_over"]) == {"same"}


def test_prediction_bench_against_a_real_server(cpu_bench, tmp_path: Path) -> None:
    """bench/prediction_cpu.py end to end on the default model, tiny: one round, 24 tokens, our server with and
    without the prediction; the check requests give the same text both ways and count the prediction's tokens."""
    prediction = importlib.import_module("prediction_cpu")
    out = tmp_path / "prediction.json"
    assert prediction.main(["--rounds", "1", "--max-tokens", "24", "--ours-only", "--quiet-wait", "0",
                            "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["raw"]) == {"mlaserve-predicted", "mlaserve-plain"} and "--ours-only" in r["skipped"]["llama-server"]
    for w in ("quote", "edit"):
        got = r["summary"][w]
        assert got["same_text"] is True and got["accepted_prediction_tokens"] + got["rejected_prediction_tokens"] > 0
        assert got["tok_s"]["mlaserve-predicted"] > 0 and got["tok_s"]["mlaserve-plain"] > 0, got


def test_quant_linear_bench_times_llama_cpps_mul_mat_beside_ours(tmp_path: Path) -> None:
    """The kernel benchmark's rows, with llama.cpp's ggml mul_mat on the same blocks where
    llama-cpp-python is installed (its ratio per row), on two small shapes."""
    out = tmp_path / "ql.json"
    proc = subprocess.run([sys.executable, str(BENCH / "quant_linear_cpu.py"), "--ms", "1", "3", "--formats", "q4_0", "q6_k",
                           "--shapes", "attn_k/attn_v", "wide_2048", "--rounds", "2", "--footprint-mib", "4", "--no-model",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {(row["shape"], row["M"], row["format"]): row for row in r["results"]}
    # q6_k needs 256-value rows: not at 576
    assert {f for _, _, f in rows} >= {"q4_0", "q6_k", "torch_bf16", "torch_f32"}
    assert ("attn_k/attn_v", 1, "q6_k") not in rows and ("wide_2048", 3, "q6_k") in rows
    assert r["smollm2_decode_linears"] == "not measured: --no-model"
    for row in rows.values():
        assert row["us"] > 0 and len(row["rounds_us"]) == 2
    if importlib.util.find_spec("llama_cpp") is None:
        assert r["machine"]["ggml_peer"].startswith("not measured")
        return
    for shape, m, fmt in [k for k in rows if k[2] in ("q4_0", "q6_k")]:
        peer = rows[(shape, m, f"ggml_{fmt}")]
        assert peer["kernel"].startswith("llama.cpp ggml mul_mat")
        assert rows[(shape, m, fmt)]["speedup_vs_ggml"] > 0 and peer["speedup_vs_ggml"] is None


def test_batch_decode_bench_compares_builds(tmp_path: Path) -> None:
    """bench/batch_decode_cpu.py end to end on the default model, tiny: the installed build against itself
    given as a second build (--lib), a process per build, with the phases timed."""
    import cpp_experts

    lib = Path(cpp_experts._C.__file__)
    out = tmp_path / "batch.json"
    proc = subprocess.run([sys.executable, str(BENCH / "batch_decode_cpu.py"), "--batch", "1", "3", "--prompt-len", "9",
                           "--decode", "3", "--warmup", "1", "--rounds", "1", "--profile", "--lib", f"same={lib}",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["builds"] == {"installed": "installed", "same": str(lib)} and r["rounds"] == 1
    for label in ("installed", "same"):
        for n in ("1", "3"):
            e = r["results"][label][n]
            assert len(e["tok_s_samples"]) == 1 and e["tok_s"] > 0 and e["step_ms"] > 0 and e["prefill_tok_s"] > 0
            assert e["phases_us_per_step"]["attention"] > 0
    same = r["results"]["same"]["3"]
    assert same["vs_installed"] == pytest.approx(statistics.median(same["vs_installed_samples"]))
    assert same["prefill_vs_installed"] > 0
    bad = subprocess.run([sys.executable, str(BENCH / "batch_decode_cpu.py"), "--lib", "nothing"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "LABEL=PATH" in bad.stderr


def test_a_terminated_server_benchmark_runs_its_cleanup() -> None:
    """SIGTERM (`timeout`, a job runner) killed a server benchmark without its `finally` blocks, and the
    servers it had started (in sessions of their own) ran on: it now ends the script as an exception does."""
    code = ("import os, signal, sys, time; sys.path.insert(0, 'bench'); import serve_cpu\n"
            "serve_cpu.stop_servers_on_term()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\nfinally:\n    print('stopped the servers')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + signal.SIGTERM and r.stdout.strip() == "stopped the servers", (r.returncode, r.stdout, r.stderr)


def test_int_quant_bench_on_a_tiny_deepseek(cpu_bench, tmp_path: Path) -> None:
    """bench/int_quant_cpu.py end to end on a tiny DeepSeek-V3 directory in place of the V2-Lite-shaped one:
    the GPTQ and AWQ copies are written once (a second run reuses them), each is served from Q4_0 / Q5_0
    blocks, and the 4-bit weights take less memory than the bf16 ones."""
    from models.synthetic import write_checkpoint

    bench = importlib.import_module("int_quant_cpu")
    mk = importlib.import_module("make_deepseek_gguf")
    hf = mk.model_dir(tmp_path, 4, 0) / "hf"
    write_checkpoint(hf, "tiny-deepseek-v3", seed=3, dtype="bfloat16")
    (hf / ".complete").write_text("{}")
    args = ["--cache-dir", str(tmp_path), "--formats", "bf16", "bf16+q8_0", "gptq4", "awq4", "--rounds", "1",
            "--decode-tokens", "3",
            "--quiet-wait", "0", "--retries", "0"]
    for run in ("first", "again"):
        out = tmp_path / f"{run}.json"
        assert bench.main([*args, "--out", str(out)]) == 0
        r = json.loads(out.read_text())
    assert set(r["ours"]) == {"bf16", "bf16+q8_0", "gptq4", "awq4"} and r["written"]["gptq4"]["group_size"] == 128
    assert "q8_0" in r["ours"]["bf16+q8_0"]["linear_formats"] and r["ours"]["bf16"]["linear_formats"] == ["bf16"]
    assert "q4_0" in r["ours"]["gptq4"]["linear_formats"] and "q5_0" in r["ours"]["awq4"]["linear_formats"]
    assert all(e["tg_tok_s"] > 0 and e["native_forward"] for e in r["ours"].values())
    assert r["ours"]["gptq4"]["resident_weight_bytes"] < r["ours"]["bf16"]["resident_weight_bytes"]
