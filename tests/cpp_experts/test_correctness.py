"""cpp_experts against the torch fp32 reference, for every kernel path x weight format: token
counts 1..1024, top-k 1..8, uniform and fully skewed routing, an expert without tokens, 1 and all
threads, bf16 and fp32 activations, output written into a NaN-poisoned buffer."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

from tests.cpp_experts.helpers import (
    Experts,
    available_paths,
    expected_kernel,
    has_path,
    path_params,
    reference,
    routing,
)

E, H, I = 10, 128, 96  # I = 96: one 64-row task plus a 32-row remainder
# relative (Frobenius) error bounds per format, against the reference with quantised activations.
# Quantized formats: over 150 weight seeds the single-token case (one expert, 128 outputs, where one
# flipped Q8_0 rounding of the intermediate activation weighs most) has median 1.6e-3 and worst 6.5e-3
# (Q8_0), 5.4e-3 (Q4_0); the bound leaves twice the worst seen.
# f32 weights: exact up to fp32 summation order, or the bf16 output's own rounding (2^-9 relative).
TOL = {"bf16": 8e-3, "q8_0": 1.3e-2, "q4_0": 1.3e-2, "q4_1": 1.3e-2, "f32": 2e-5}
BF16_OUT = 4e-3
FORMATS = ["bf16", "f32", "q8_0", "q4_0", "q4_1"]
# (T, top_k, routing, threads, activation dtype)
CASES = [
    (1, 1, "uniform", 1, torch.float32),
    (1, 8, "uniform", None, torch.bfloat16),
    (3, 2, "skewed", None, torch.float32),
    (10, 6, "uniform", None, torch.float32),  # 60 slots: the run_linears path, experts of 1..n slots
    (8, 8, "skewed", 1, torch.bfloat16),  # 64 slots, the last count that path takes
    (16, 6, "uniform", 1, torch.bfloat16),
    (64, 8, "skewed", None, torch.float32),
    (257, 6, "uniform", None, torch.bfloat16),
    (257, 1, "skewed", 1, torch.float32),
    (1024, 6, "uniform", None, torch.float32),
    (1024, 1, "skewed", None, torch.bfloat16),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", path_params())
def test_matches_reference(path: str, fmt: str) -> None:
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    ex = Experts(fmt, E, H, I, seed=zlib.crc32(f"{path}/{fmt}".encode()) % 1000)  # not hash(): salted per run
    ops: dict = {}
    for i, (T, k, mode, threads, dtype) in enumerate(CASES):
        moe = ops.get((k, threads)) or ops.setdefault((k, threads), ex.build(k, threads, path))
        assert moe.kernel == expected_kernel(path, fmt), moe.kernel
        g = torch.Generator().manual_seed(100 + i)
        hidden = torch.randn(T, H, generator=g).to(dtype)
        ids, w = routing(T, E, k, mode, seed=i)
        if i % 2:
            ids = ids.to(torch.int32)
        out = torch.full((T, H), float("nan"), dtype=dtype)
        y = moe.forward(hidden, ids, w, out=out)
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
        assert torch.isfinite(y).all(), f"case {i}: non-finite output (poisoned buffer not overwritten?)"
        quantised = fmt not in ("bf16", "f32")
        ref = reference(ex, hidden, ids, w, quant_acts=quantised)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        tol = TOL[fmt] if dtype == torch.float32 else max(TOL[fmt], BF16_OUT)
        assert err < tol, f"case {i} (T={T}, k={k}, {mode}, threads={threads}, {dtype}): rel err {err:.2e}"
        worst = (y.float() - ref).abs().max().item()
        assert worst < 20 * tol * ref.abs().max().item(), f"case {i}: max abs err {worst:.3e}"
        if quantised:  # also close to the exact fp32 activations, within Q8_0 activation rounding
            exact = reference(ex, hidden, ids, w, quant_acts=False)
            assert ((y.float() - exact).norm() / exact.norm()).item() < 3e-2


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paths_agree_with_each_other(path: str, seed: int) -> None:
    """A forced path gives the same result as the portable one (same rounding, other order).

    The int8 dot products are exact, but the gate/up sums are accumulated in fp32 in another order,
    and the SiLU*up activation is re-quantized to Q8_0 before the down projection: a last-bit
    difference can move one intermediate value across a rounding boundary, which changes that
    token's whole output row by about one quantization step (over 1,000 inputs: 2.7% of runs have
    one such row, none has two; worst row 3.5e-3 relative, whole output 6.3e-4). So every row but at
    most one must agree to fp32 order, and that one within a rounding flip; a wrong kernel is off by
    O(1) on many rows.
    """
    if not has_path(path, "q8_0") and not has_path(path, "bf16"):
        pytest.skip(f"no {path} kernel")
    ex = Experts("q8_0", E, H, I, seed=7)
    T, k = 40, 6
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(1000 + seed))
    ids, w = routing(T, E, k, "uniform", seed=3 + seed)
    a = ex.build(k, None, "portable").forward(hidden, ids, w)
    b = ex.build(k, None, path).forward(hidden, ids, w)
    row_close = torch.isclose(a, b, rtol=1e-4, atol=1e-5).all(dim=1)
    assert (~row_close).sum().item() <= 1, f"{(~row_close).sum().item()} of {T} token rows differ"
    row_err = (a - b).norm(dim=1) / a.norm(dim=1)
    assert row_err.max().item() < 1e-2, f"worst row relative error {row_err.max().item():.2e}"


def test_env_var_forces_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import cpp_experts

    def loaded(fmt: str = "bf16") -> cpp_experts.MoE:
        moe = cpp_experts.MoE(1, 1, 64, 64, fmt)
        ex = Experts(fmt, 1, 64, 64, seed=1)
        moe.load_expert(0, *ex.raw[0])
        return moe

    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_KERNEL", "portable")
    assert cpp_experts.info()["forced"] == "portable"
    assert set(cpp_experts.info()["chosen"].values()) == {"portable"}
    assert loaded().kernel == "portable" and loaded("q8_0").kernel == "portable"
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_KERNEL", "avx2")
    if "avx2" in available_paths():
        assert set(cpp_experts.info()["chosen"].values()) == {"avx2"}
        assert loaded().kernel == "avx2" and loaded("q8_0").kernel == "avx2"
    else:
        with pytest.raises(RuntimeError, match="lacks AVX2"):
            loaded()
    monkeypatch.delenv("MLASERVE_CPP_EXPERTS_KERNEL")
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_THREADS", "1")
    assert cpp_experts.info()["num_threads"] == 1
    assert os.environ["MLASERVE_CPP_EXPERTS_THREADS"] == "1"


def test_cpu_vendor_and_family_match_the_kernels_report() -> None:
    """What CPUID gave the extension (its prefetch plan depends on it) is what Linux reports."""
    import cpp_experts

    if not cpp_experts.info()["x86_paths"]:
        pytest.skip("a build without its x86 paths reads no CPUID (and under qemu-user /proc/cpuinfo is the host's)")
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "cpu family" not in fields:
        pytest.skip("/proc/cpuinfo names no cpu family (not x86)")
    inf = cpp_experts.info()
    assert inf["cpu_family"] == int(fields["cpu family"])
    assert inf["cpu_vendor_amd"] == (fields.get("vendor_id") == "AuthenticAMD")


def test_info_and_memory() -> None:
    import cpp_experts

    inf = cpp_experts.info()
    assert set(inf) >= {"x86_paths", "cpu_flags", "amx_usable", "kernels", "chosen", "chosen_linear", "forced", "num_threads"}
    assert "portable" in inf["kernels"] and inf["num_threads"] >= 1
    assert set(inf["chosen"]) == set(cpp_experts.FORMATS)
    assert set(inf["chosen_linear"]) == set(cpp_experts.LINEAR_FORMATS)
    # what info() reports is what the operators choose
    assert Experts("bf16", 2, 64, 64, seed=1).build(2, 1, None).kernel == inf["chosen"]["bf16"]
    assert Experts("q8_0", 2, 64, 64, seed=1).build(2, 1, None).kernel == inf["chosen"]["q8_0"]
    if "avx2" in inf["kernels"] and "avx512_bf16" not in inf["kernels"]:
        assert inf["chosen"]["bf16"] == "avx2" and inf["chosen_linear"]["q4_1"] == "avx2"
    if "avx2" in inf["kernels"]:
        assert inf["chosen_linear"]["f32"] == "avx2"
    sizes = {}
    for fmt in ("bf16", "q8_0", "q4_0"):
        sizes[fmt] = Experts(fmt, 2, 64, 64, seed=1).build(2, 1, "portable").memory_bytes
    assert sizes["bf16"] == 2 * 3 * 64 * 64 * 2
    assert sizes["q8_0"] == 2 * 3 * 64 * 64 * 34 // 32
    assert sizes["q4_0"] == 2 * 3 * 64 * 64 * 18 // 32


def test_odd_sizes_bf16() -> None:
    """bf16 accepts sizes that are not multiples of 32 (padded internally)."""
    ex = Experts("bf16", 5, 72, 40, seed=2)
    for path in [p for p in ("portable", "avx2", "avx512") if p in available_paths() and has_path(p, "bf16")]:
        moe = ex.build(3, None, path)
        hidden = torch.randn(9, 72)
        ids, w = routing(9, 5, 3, "uniform", seed=5)
        y = moe.forward(hidden, ids, w)
        ref = reference(ex, hidden, ids, w, quant_acts=False)
        assert ((y - ref).norm() / ref.norm()).item() < TOL["bf16"]
