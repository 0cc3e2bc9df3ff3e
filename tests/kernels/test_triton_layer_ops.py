"""The Triton RMSNorm and RoPE kernels (`kernels/triton_layer_ops.py`) against the torch reference (the
models' own `RMSNorm` and `RotaryEmbedding` run as torch ops), and their wiring: the triton attention
backend's forwards run every norm and rotation through them.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set here before triton is first imported); with
CUDA the same tests run compiled. Inputs are fresh random values: rows that are views with a row stride
(as a split of a projection gives), odd widths, 1 to 64 tokens, positions across the whole table.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import triton_layer_ops  # noqa: E402
from kernels.triton_layer_ops import rms_norm, rotary, silu_mul  # noqa: E402
from models.config import RopeConfig  # noqa: E402
from models.layers import RMSNorm  # noqa: E402
from models.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    if DEVICE.type == "cpu" and not triton_layer_ops.INTERPRETED:
        pytest.fail("kernels were imported before TRITON_INTERPRET=1 was set; export TRITON_INTERPRET=1")


def assert_rounding_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the kernels' two rounding differences (the sum of squares' order, a fused multiply-add):
    fp32 within a few ulps; a 16-bit value at most one step of its type away, and few of them."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=4e-6, atol=1e-6)
        return
    step = 2.0 ** -(7 if ref.dtype == torch.bfloat16 else 10)  # a 16-bit value's step, relative to it
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= step * ref.float().abs() * 1.01 + 1e-6).all()), f"max difference {diff.max().item()}"
    assert float((diff > 0).float().mean()) <= 0.02


def rows_view(t: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[t, n] with a row stride past n, as a column slice of a projection's output."""
    return torch.randn(t, n + 9, generator=gen).mul(3).to(DEVICE, dtype)[:, 5 : 5 + n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 2048), (3, 576), (17, 33), (64, 512)])
def test_rms_norm_matches_the_torch_norm(dtype: torch.dtype, t: int, n: int) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + n)
    norm = RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=gen))
    norm = norm.to(DEVICE, dtype)
    x = rows_view(t, n, dtype, gen)
    residual = torch.randn(t, n, generator=gen).to(DEVICE, dtype)

    out, total = rms_norm(x, norm.weight, norm.eps)
    assert total is None
    assert_rounding_close(out, norm(x))
    assert_rounding_close(norm(x, fused=True), norm(x))

    ref_out, ref_total = norm.forward_residual(x, residual)
    got_out, got_total = norm.forward_residual(x, residual, fused=True)
    assert torch.equal(got_total, ref_total)  # one rounding of one sum: no order to differ in
    assert_rounding_close(got_out, ref_out)


def test_rms_norm_promotes_as_torch_and_refuses_misfits() -> None:
    """An fp32 weight over bf16 rows gives fp32, as `weight * x` does in torch; mismatched shapes are
    refused with what was given."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    x = rows_view(7, 96, torch.bfloat16, gen)
    out = norm(x, fused=True)
    assert out.dtype == torch.float32
    assert_rounding_close(out, norm(x))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, norm.weight[:95], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, norm.weight, 1e-5, residual=x.float())
    empty, total = rms_norm(x[:0], norm.weight, 1e-5, residual=x[:0])
    assert empty.shape == (0, 96) and total is not None and total.shape == (0, 96)


ROPES = {
    "deepseek-yarn": RopeConfig(dim=64, theta=10000.0, interleaved=True, scaling_type="yarn", factor=40.0,
                                original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
    "llama3": RopeConfig(dim=64, theta=500000.0, interleaved=False, scaling_type="llama3", factor=8.0,
                         original_max_position_embeddings=8192),
    "default-odd-heads": RopeConfig(dim=48, theta=10000.0, interleaved=False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope,heads,kv_heads", [("deepseek-yarn", 16, 1), ("llama3", 6, 2), ("default-odd-heads", 5, 5)])
@pytest.mark.parametrize("t", [1, 3, 40])
def test_rotary_matches_the_torch_rotation(dtype: torch.dtype, rope: str, heads: int, kv_heads: int, t: int) -> None:
    cfg = ROPES[rope]
    gen = torch.Generator().manual_seed(t * 100 + heads)
    emb = RotaryEmbedding(cfg, max_positions=3000).to(DEVICE)
    d, extra = cfg.dim, 16
    # q's rotated part is a view, as MLA's q_pe is of its projection ([T, H, nope + rope]); k [T, Hkv, d]
    q_full = torch.randn(t, heads, extra + d, generator=gen).to(DEVICE, dtype)
    q = q_full[..., extra:]
    k = torch.randn(t, kv_heads, d, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 3000, (t,), generator=gen).to(DEVICE)
    positions[0] = 2999  # the table's last row
    ref_q, ref_k = emb(positions, q, k)
    got_q, got_k = emb(positions, q, k, fused=True)
    assert_rounding_close(got_q, ref_q)
    assert_rounding_close(got_k, ref_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 64, 300])
def test_gpu_deepseek_v3_sizes(t: int) -> None:
    """DeepSeek-V3's widths compiled: the hidden norm (7168), the latent norms (1536, 512) and RoPE over 128
    query heads."""
    gen = torch.Generator().manual_seed(t)
    for n in (7168, 1536, 512):
        norm = RMSNorm(n, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=gen))
        norm = norm.to(DEVICE, torch.bfloat16)
        x, residual = rows_view(t, n, torch.bfloat16, gen), rows_view(t, n, torch.bfloat16, gen)
        assert_rounding_close(norm(x, fused=True), norm(x))
        ref_out, ref_total = norm.forward_residual(x, residual)
        got_out, got_total = norm.forward_residual(x, residual, fused=True)
        assert torch.equal(got_total, ref_total)
        assert_rounding_close(got_out, ref_out)
    emb = RotaryEmbedding(ROPES["deepseek-yarn"], max_positions=163840).to(DEVICE)
    q = torch.randn(t, 128, 192, generator=gen).to(DEVICE, torch.bfloat16)[..., 128:]
    k = torch.randn(t, 1, 64, generator=gen).to(DEVICE, torch.bfloat16)
    positions = torch.randint(0, 163840, (t,), generator=gen).to(DEVICE)
    for got, ref in zip(emb(positions, q, k, fused=True), emb(positions, q, k)):
        assert_rounding_close(got, ref)


def test_rotary_refuses_a_table_of_another_width() -> None:
    emb = RotaryEmbedding(RopeConfig(dim=32), max_positions=64).to(DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="table"):
        rotary(x, torch.zeros(2, dtype=torch.long, device=DEVICE), emb.cos_sin_cache, False)
    with pytest.raises(ValueError, match="positions"):
        rotary(x[..., :32], torch.zeros(3, dtype=torch.long, device=DEVICE), emb.cos_sin_cache, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 1408), (3, 33), (17, 2560), (64, 96)])
def test_silu_mul_matches_torch(dtype: torch.dtype, t: int, n: int) -> None:
    """silu(gate) * up on the two halves of one projection's rows (views with a row stride), against torch's
    ops in fp32 rounded once (the kernel's math) and torch's ops in the dtype itself (a 16-bit type rounds
    twice there: a step apart now and then)."""
    gen = torch.Generator().manual_seed(t * 7 + n)
    both = torch.randn(t, 2 * n + 3, generator=gen).mul(3).to(DEVICE, dtype)
    gate, up = both[:, :n], both[:, n + 3:]
    got = silu_mul(gate, up)
    assert got.shape == (t, n) and got.dtype == dtype and got.is_contiguous()
    assert_rounding_close(got, (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype))
    torch_ops = torch.nn.functional.silu(gate) * up
    if dtype == torch.float32:
        assert_rounding_close(got, torch_ops)
    else:
        diff = (got.float() - torch_ops.float()).abs()
        assert bool((diff <= 2 ** -6 * torch_ops.float().abs() + 1e-6).all())
    out = torch.empty(t, n, dtype=dtype, device=DEVICE)
    assert silu_mul(gate, up, out=out) is out and torch.equal(out, got)


def test_silu_mul_refuses_misfits() -> None:
    x = torch.randn(4, 8, device=DEVICE)
    assert silu_mul(x[:0], x[:0]).shape == (0, 8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(x, x[:, :4])
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(x, x.half())
    with pytest.raises(ValueError, match="does not fit"):
        silu_mul(x, x, out=torch.empty(4, 9, device=DEVICE))


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "tiny-llama"])
def test_the_triton_backend_runs_every_norm_and_rotation_through_the_kernels(preset: str, tmp_path, monkeypatch) -> None:
    """A triton-backend forward calls the kernels for every RMSNorm (the residual adds in them), every
    layer's RoPE, every gated MLP's activation (dense layers, shared experts) and every MoE router's
    selection, and gives the torch backend's logits; a torch-backend forward calls none of them."""
    from executor.model_runner import ModelRunner, RequestSlice
    from models.loader.load import load_model
    from models.synthetic import write_checkpoint

    loaded = load_model(write_checkpoint(tmp_path / preset, preset, seed=3), device=DEVICE, dtype="float32",
                        load_tokenizer=False, progress=False)
    model, cfg = loaded.model, loaded.config
    from kernels import fused_moe
    from models.layers import GatedMLP
    from models.moe import SparseMoE

    calls = {"norm": 0, "residual": 0, "rotary": 0, "silu_mul": 0, "route": 0}
    real_norm, real_rotary = triton_layer_ops.rms_norm, triton_layer_ops.rotary
    real_silu_mul, real_route = triton_layer_ops.silu_mul, fused_moe.route_experts

    def counted_norm(x, weight, eps, residual=None):
        calls["residual" if residual is not None else "norm"] += 1
        return real_norm(x, weight, eps, residual)

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(triton_layer_ops, "rms_norm", counted_norm)
    monkeypatch.setattr(triton_layer_ops, "rotary", counted("rotary", real_rotary))
    monkeypatch.setattr(triton_layer_ops, "silu_mul", counted("silu_mul", real_silu_mul))
    monkeypatch.setattr(fused_moe, "route_experts", counted("route", real_route))
    mlps = [layer.mlp for layer in model.model.layers]
    routers = sum(isinstance(m, SparseMoE) for m in mlps)
    activations = sum(isinstance(m, GatedMLP) or getattr(m, "shared_experts", None) is not None for m in mlps)
    assert activations == len(mlps) and ("deepseek" not in preset or 0 < routers < len(mlps))
    prompt = torch.randint(3, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(model, cfg, max_total_tokens=64, max_running_requests=2, device=DEVICE,
                             attention_backend=backend, disable_cuda_graph=True, native_forward=False)
        row = runner.req_to_token_pool.alloc()
        before = dict(calls)
        logits[backend] = runner.forward(runner.build_batch([RequestSlice(row, 0, prompt)]))
        layers = cfg.num_hidden_layers
        latent_norms = layers * (1 + (getattr(cfg, "q_lora_rank", None) is not None)) if "deepseek" in preset else 0
        expected = {"norm": layers + 1 + latent_norms, "residual": layers, "rotary": 2 * layers,
                    "silu_mul": activations, "route": routers}
        if backend == "torch":
            expected = {name: 0 for name in calls}
        assert {name: calls[name] - before[name] for name in calls} == expected
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
