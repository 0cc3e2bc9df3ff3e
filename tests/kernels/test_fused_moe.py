"""Fused-MoE Triton kernels (`kernels/fused_moe.py`) and `--expert-backend triton`, against the `torch`
expert backend (`TorchExperts`) as the oracle, and `moe_align_block_size` against a plain Python one.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 is set here
before triton is first imported); with CUDA the same tests run compiled on the GPU, and the tests marked
`gpu` add DeepSeek-V2-Lite expert sizes and CUDA-graph capture.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import fused_moe  # noqa: E402
from kernels.fused_moe import block_config, fused_experts, moe_align_block_size  # noqa: E402
from models.loader.gguf_writer import write_gguf  # noqa: E402
from models.loader.load import load_model  # noqa: E402
from models.loader.raw_blocks import RawBlocks  # noqa: E402
from models.experts import ExpertBackend, TorchExperts, TritonExperts  # noqa: E402
from models.synthetic import write_checkpoint  # noqa: E402
from executor.model_runner import ModelRunner, RequestSlice  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    if DEVICE.type == "cpu" and not fused_moe.INTERPRETED:
        pytest.fail("kernels.fused_moe was imported before TRITON_INTERPRET=1 was set; run this module first "
                    "or export TRITON_INTERPRET=1")


# ------------------------------------------------------------------ inputs


def routing(t: int, k: int, e: int, load: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [t, k] int64, topk_weights [t, k] fp32) with distinct experts per token.

    load: 'uniform'; 'skewed' (expert 0 popular, the last expert never chosen); 'one' (every token's
    first choice is expert e // 2, so with k = 1 all tokens go to one expert)."""
    probs = torch.ones(e)
    if load == "skewed":
        probs = torch.linspace(8.0, 0.5, e)
        probs[-1] = 0.0
    rows = [torch.multinomial(probs, k, replacement=False, generator=gen) for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)
    if load == "one":
        hot = e // 2
        ids = torch.where(ids == hot, ids[:, :1], ids)  # swap the hot expert out of later slots ...
        ids[:, 0] = hot  # ... and into the first
    weights = torch.rand(t, k, generator=gen) + 0.1
    return ids, weights


def make_experts(e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator) -> TorchExperts:
    m = TorchExperts(e, h, i)
    with torch.no_grad():
        m.w13.copy_(torch.randn(e, 2 * i, h, generator=gen) / h**0.5)
        m.w2.copy_(torch.randn(e, h, i, generator=gen) / i**0.5)
    return m.to(DEVICE, dtype)


def bf16_experts(e: int, h: int, i: int, gen: torch.Generator) -> tuple[TorchExperts, TorchExperts]:
    """bf16 experts and an fp32 copy of the same (rounded) weights, whose output is the truth."""
    ref = make_experts(e, h, i, torch.bfloat16, gen)
    exact = TorchExperts(e, h, i).to(DEVICE)
    exact.load_state_dict({n: p.float() for n, p in ref.state_dict().items()})
    return ref, exact


def norm_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float()))


def assert_bf16_close(got: torch.Tensor, oracle: torch.Tensor, truth: torch.Tensor) -> None:
    """bf16 rounds at other points in the kernel than in the oracle (once after SiLU·up, not also
    before the multiply), so `got` must be about as far from the fp32 truth as the oracle is, in norm,
    and within a few bf16 ulps of max |truth| everywhere. (A fp32 -> bf16 cast that truncates instead of
    rounding to nearest, as the interpreter's does, is ~3x the oracle's distance.)"""
    got_err, oracle_err = norm_err(got, truth), norm_err(oracle, truth)
    assert got_err <= 1.5 * oracle_err + 1e-3, f"bf16 norm error {got_err:.4f}, the oracle's {oracle_err:.4f}"
    assert rel_err(got, truth) <= 1.2e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ------------------------------------------------------------------ moe_align_block_size


def align_oracle(ids: list[list[int]], e: int, block_m: int) -> tuple[list[int], list[int], int]:
    flat = [x for row in ids for x in row]
    pad = len(flat)
    sorted_ids: list[int] = []
    experts: list[int] = []
    for ex in range(e):
        run = [f for f, x in enumerate(flat) if x == ex]
        if not run:
            continue
        run += [pad] * (-len(run) % block_m)
        sorted_ids += run
        experts += [ex] * (len(run) // block_m)
    return sorted_ids, experts, len(sorted_ids)


@pytest.mark.parametrize(
    "t,k,e,block_m,load",
    [(0, 2, 4, 16, "uniform"), (1, 1, 4, 16, "uniform"), (3, 2, 8, 16, "skewed"), (17, 6, 8, 4, "skewed"),
     (64, 8, 16, 16, "uniform"), (40, 1, 16, 8, "one"), (33, 3, 4, 32, "one"), (200, 6, 64, 16, "skewed"),
     (5, 6, 6, 16, "uniform"), (70, 6, 160, 16, "skewed"), (9, 8, 256, 64, "uniform")],
)
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_align_matches_python_oracle(t: int, k: int, e: int, block_m: int, load: str, path: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of computing it: the one Triton program (decode-sized inputs) and torch ops (larger ones)."""
    if path == "torch":
        monkeypatch.setattr(fused_moe, "ALIGN_KERNEL_MAX_PAIRS", 0)
    gen = torch.Generator().manual_seed(1000 * t + 10 * k + e)
    ids, _ = routing(t, k, e, load, gen)
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(DEVICE), e, block_m)
    want_sorted, want_experts, want_total = align_oracle(ids.tolist(), e, block_m)
    max_padded = t * k + min(e, t * k) * (block_m - 1)
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (-(-max_padded // block_m),)
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    assert total.tolist() == [want_total]
    assert sorted_ids.tolist() == want_sorted + [t * k] * (max_padded - want_total)
    assert expert_ids.tolist() == want_experts + [-1] * (expert_ids.numel() - len(want_experts))


def test_align_falls_back_to_torch_ops_where_the_kernel_does_not_build(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A Triton or device that cannot build the alignment program (too many registers, say) gets the torch
    ops' result, with one warning, and is not asked again for that expert count."""
    from triton.runtime.errors import OutOfResources

    launches = []

    class Refused:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise OutOfResources(300000, 232448, "shared memory")
            return launch

    monkeypatch.setattr(fused_moe, "_moe_align_kernel", Refused())
    monkeypatch.setattr(fused_moe, "_ALIGN_KERNEL_REFUSED", set())
    ids, _ = routing(9, 6, 64, "skewed", torch.Generator().manual_seed(8))
    want_sorted, want_experts, want_total = align_oracle(ids.tolist(), 64, 16)
    for _ in range(2):
        with caplog.at_level("WARNING", logger="kernels.fused_moe"):
            sorted_ids, expert_ids, total = moe_align_block_size(ids.to(DEVICE), 64, 16)
        assert total.tolist() == [want_total] and sorted_ids.tolist()[:want_total] == want_sorted
        assert expert_ids.tolist()[: len(want_experts)] == want_experts
    assert len(launches) == 1 and fused_moe._ALIGN_KERNEL_REFUSED == {64}
    assert sum("alignment kernel does not build for 64 experts" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------ router selection vs HF's routers

ROUTERS = {  # name: (HF architecture, our MoEConfig fields): real routers' expert and group counts
    "v2_lite_greedy": ("v2", dict(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy",
                                  n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    "v2_group_limited": ("v2", dict(num_experts=160, top_k=6, scoring_func="softmax",
                                    topk_method="group_limited_greedy", n_group=8, topk_group=3,
                                    norm_topk_prob=False, routed_scaling_factor=16.0)),
    "v3_noaux_tc": ("v3", dict(num_experts=256, top_k=8, scoring_func="sigmoid", topk_method="noaux_tc",
                               n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3_one_group_unnormalised": ("v3", dict(num_experts=72, top_k=4, scoring_func="sigmoid", topk_method="noaux_tc",
                                             n_group=1, topk_group=1, norm_topk_prob=False,
                                             routed_scaling_factor=1.0)),
    "v3_groups_of_nine": ("v3", dict(num_experts=36, top_k=3, scoring_func="sigmoid", topk_method="noaux_tc",
                                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5)),
}


def hf_router(arch: str, fields: dict, hidden: int, gen: torch.Generator):
    """HF transformers' own router module (the oracle) with random weights and, for V3, a random correction
    bias of the size that separates experts in real checkpoints."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    common = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=fields["num_experts"], num_experts_per_tok=fields["top_k"],
                  n_group=fields["n_group"], topk_group=fields["topk_group"],
                  routed_scaling_factor=fields["routed_scaling_factor"])
    if arch == "v2":
        router = DeepseekV2TopkRouter(DeepseekV2Config(topk_method=fields["topk_method"], **common))
    else:
        router = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=fields["norm_topk_prob"], **common))
        router.e_score_correction_bias.copy_(torch.randn(fields["num_experts"], generator=gen) * 0.3)
    router.weight.data.copy_(torch.randn(router.weight.shape, generator=gen) / hidden ** 0.5 * 2)
    return router


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("t", [1, 5, 64])
def test_router_kernel_matches_hf_routers(name: str, t: int) -> None:
    """The fused selection (`Router(x, fused=True)`, `route_experts`) picks HF's experts with HF's weights,
    as the torch selection does. Rows where HF's k-th and (k+1)-th choice lie within 1e-6 of each other (an
    ulp's reordering could swap them) are left out, and there must be few of them."""
    from models.config import MoEConfig
    from models.moe import Router

    arch, fields = ROUTERS[name]
    hidden = 48
    gen = torch.Generator().manual_seed(t * 100 + len(name))
    ref = hf_router(arch, fields, hidden, gen)
    cfg = MoEConfig(intermediate_size=8, num_shared_experts=1, first_k_dense_replace=0, moe_layer_freq=1, **fields)
    ours = Router(cfg, hidden)
    ours.weight.data.copy_(ref.weight.data)
    if arch == "v3":
        ours.e_score_correction_bias.data.copy_(ref.e_score_correction_bias)
    x = torch.randn(t, hidden, generator=gen)
    with torch.no_grad():
        _, want_w, want_ids = ref(x)
    ours = ours.to(DEVICE)
    got_w, got_ids = ours(x.to(DEVICE), fused=True)
    torch_w, torch_ids = ours(x.to(DEVICE))
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64 and got_ids.shape == (t, fields["top_k"])
    assert all(len(set(row)) == len(row) for row in got_ids.tolist()), "an expert chosen twice for one token"

    from models.moe_routing import routing_margins

    _, margin = routing_margins(ours.logits(x.to(DEVICE)), cfg, ours.e_score_correction_bias)
    clear = (margin.cpu() > 1e-6).tolist()
    assert sum(clear) >= t - max(1, t // 20)

    def by_expert(w: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
        return [dict(zip(i, v)) for i, v in zip(ids.cpu().tolist(), w.cpu().tolist())]

    want, got, via_torch = by_expert(want_w, want_ids), by_expert(got_w, got_ids), by_expert(torch_w, torch_ids)
    for row in range(t):
        if not clear[row]:
            continue
        assert set(got[row]) == set(want[row]) == set(via_torch[row]), f"row {row}"
        for expert, w in want[row].items():
            assert got[row][expert] == pytest.approx(w, rel=2e-6, abs=1e-7), f"row {row}, expert {expert}"
    if arch == "v3":
        ranked = (ours.logits(x.to(DEVICE)).sigmoid() + ours.e_score_correction_bias).gather(1, got_ids)
    else:
        ranked = got_w
    assert bool((ranked[:, :-1] >= ranked[:, 1:]).all()), "the ids come best first (V3: by the biased score)"


def test_router_kernel_groups_decide() -> None:
    """The cases above would pass a kernel that ignored the groups unless the groups change the choice: here
    every token's best experts (by score alone) are spread so that the groups do change it, and the kernel
    follows the groups (V2: a group's best expert ranks it; V3: its best two biased scores)."""
    from kernels.fused_moe import route_experts
    from models.moe_routing import select_experts
    from models.config import MoEConfig

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 64, generator=gen) * 3
    for method, scoring in (("group_limited_greedy", "softmax"), ("noaux_tc", "sigmoid")):
        cfg = MoEConfig(num_experts=64, top_k=6, intermediate_size=8, num_shared_experts=0, scoring_func=scoring,
                        topk_method=method, n_group=8, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                        first_k_dense_replace=0, moe_layer_freq=1)
        plain = route_experts(logits.to(DEVICE), 6, scoring=scoring, method="greedy")[1].sort(-1).values
        got = select_experts(logits.to(DEVICE), cfg, fused=True)[1].sort(-1).values
        want = select_experts(logits, cfg)[1].sort(-1).values
        assert torch.equal(got.cpu(), want)
        assert int((plain.cpu() != want).any(-1).sum()) >= 16  # the groups changed most tokens' choice
        assert all(len({e // 8 for e in r}) <= 2 for r in got.tolist())


def test_router_kernel_ties_bias_and_misfits() -> None:
    """Equal scores give distinct experts, the lower index first; V3's bias moves the choice but not the
    weights; a strided logits view reads right; no tokens give empty results; what does not fit is refused."""
    from kernels.fused_moe import route_experts

    tied = torch.zeros(3, 16, device=DEVICE)
    w, ids = route_experts(tied, 4, scoring="softmax", method="greedy")
    assert ids.tolist() == [[0, 1, 2, 3]] * 3 and torch.allclose(w, torch.full_like(w, 1 / 16))
    w, ids = route_experts(tied, 4, scoring="sigmoid", method="noaux_tc", n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3  # groups tie too: the first two groups, then their first experts
    bias = torch.zeros(16, device=DEVICE)
    bias[[15, 9]] = 1.0
    w, ids = route_experts(tied, 2, scoring="sigmoid", method="noaux_tc", correction_bias=bias, normalize=True)
    assert ids.tolist() == [[9, 15]] * 3 and w.tolist() == [[0.5, 0.5]] * 3  # weights: the unbiased scores
    bias = torch.full((16,), -1.0, device=DEVICE)
    bias[13] = -0.9  # group 3 wins; every biased score is below 0, and the other groups' experts stay out
    w, ids = route_experts(tied, 4, scoring="sigmoid", method="noaux_tc", n_group=4, topk_group=1,
                           correction_bias=bias)
    assert ids.tolist() == [[13, 12, 14, 15]] * 3

    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(7, 40, generator=gen).to(DEVICE)
    w, ids = route_experts(wide[:, 3:35], 5, scoring="softmax", method="greedy", normalize=True, scale=2.0)
    want = wide[:, 3:35].softmax(-1).topk(5, -1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(w, want.values / want.values.sum(-1, keepdim=True) * 2.0)

    w, ids = route_experts(torch.empty(0, 16, device=DEVICE), 4, scoring="softmax", method="greedy")
    assert w.shape == ids.shape == (0, 4)
    for bad, what in [(dict(top_k=17), "does not fit"), (dict(n_group=3, method="noaux_tc"), "does not fit"),
                      (dict(n_group=4, topk_group=1, top_k=5, method="noaux_tc"), "does not fit"),
                      (dict(method="topk"), "unknown"), (dict(scoring="relu"), "unknown")]:
        args = dict(top_k=4, scoring="softmax", method="greedy") | bad
        with pytest.raises(ValueError, match=what):
            route_experts(tied, args.pop("top_k"), **args)
    with pytest.raises(ValueError, match="fp32"):
        route_experts(tied.half(), 4, scoring="softmax", method="greedy")
    with pytest.raises(ValueError, match="bias"):
        route_experts(tied, 4, scoring="sigmoid", method="noaux_tc", correction_bias=torch.zeros(8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,h", [(1, 6, 2048), (5, 1, 40), (17, 8, 7168), (64, 2, 33)])
def test_moe_sum_matches_torch_sum(dtype: torch.dtype, t: int, k: int, h: int) -> None:
    """The sum over the K slots against torch.sum (fp32 accumulation, one rounding): fp32 within an ulp or
    two (another order of the adds), 16-bit values at most a step apart and rarely; x may be a view with
    token and slot strides of its own."""
    from kernels.fused_moe import moe_sum

    gen = torch.Generator().manual_seed(t * 31 + k * 7 + h)
    base = torch.randn(t, k + 1, h + 5, generator=gen).mul(4).to(DEVICE, dtype)
    x = base[:, 1:, 3 : 3 + h]
    out = torch.empty(t, h, dtype=dtype, device=DEVICE)
    assert moe_sum(x, out) is out
    want = torch.sum(x, dim=1)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)
    else:
        step = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        diff = (out.float() - want.float()).abs()
        assert bool((diff <= step * want.float().abs() * 1.01 + 1e-3).all())
        assert float((diff > 0).float().mean()) <= 0.02
    with pytest.raises(ValueError, match="do not fit"):
        moe_sum(x, torch.empty(t, h + 1, dtype=dtype, device=DEVICE))


# ------------------------------------------------------------------ fused_experts vs TorchExperts

CASES = [  # t, k, e, h, i, load
    (1, 1, 4, 40, 24, "uniform"),
    (1, 8, 16, 40, 24, "uniform"),
    (3, 2, 4, 40, 24, "skewed"),
    (17, 6, 8, 40, 24, "skewed"),
    (17, 1, 8, 40, 24, "one"),
    (64, 2, 16, 40, 24, "one"),
    (64, 8, 16, 48, 40, "skewed"),
]


@pytest.mark.parametrize("t,k,e,h,i,load", CASES)
def test_fused_experts_fp32(t: int, k: int, e: int, h: int, i: int, load: str) -> None:
    gen = torch.Generator().manual_seed(7 + t * k * e)
    ref = make_experts(e, h, i, torch.float32, gen)
    ids, weights = routing(t, k, e, load, gen)
    x = torch.randn(t, h, generator=gen).to(DEVICE)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    want = ref(x, ids, weights)
    got = fused_experts(x, ref.w13, ref.w2, weights, ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("t,k,e,h,i,load", [c for c in CASES if c[0] > 1])
def test_fused_experts_bf16(t: int, k: int, e: int, h: int, i: int, load: str) -> None:
    gen = torch.Generator().manual_seed(11 + t * k * e)
    ref, exact = bf16_experts(e, h, i, gen)
    ids, weights = routing(t, k, e, load, gen)
    x = torch.randn(t, h, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    truth = exact(x.float(), ids, weights)
    got = fused_experts(x, ref.w13, ref.w2, weights, ids)
    assert got.dtype == torch.bfloat16
    assert_bf16_close(got, ref(x, ids, weights), truth)


def test_out_argument_and_strided_hidden() -> None:
    gen = torch.Generator().manual_seed(3)
    t, k, e, h, i = 9, 3, 8, 40, 24
    ref = make_experts(e, h, i, torch.float32, gen)
    ids, weights = routing(t, k, e, "uniform", gen)
    wide = torch.randn(t, 2 * h, generator=gen).to(DEVICE)
    x = wide[:, ::2]  # a row stride of 2h and a column stride of 2
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    out = torch.full((t, h), float("nan"), device=DEVICE)
    assert fused_experts(x, ref.w13, ref.w2, weights, ids, out=out) is out
    assert rel_err(out, ref(x.contiguous(), ids, weights)) <= 1e-5


def test_no_tokens() -> None:
    gen = torch.Generator().manual_seed(4)
    ref = make_experts(4, 40, 24, torch.float32, gen)
    x = torch.empty(0, 40, device=DEVICE)
    got = fused_experts(x, ref.w13, ref.w2, torch.empty(0, 2, device=DEVICE),
                        torch.empty(0, 2, dtype=torch.long, device=DEVICE))
    assert got.shape == (0, 40)


def test_shape_mismatch_is_a_clear_error() -> None:
    gen = torch.Generator().manual_seed(5)
    ref = make_experts(4, 40, 24, torch.float32, gen)
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="want \\[E, 2I, H\\]"):
        fused_experts(x, ref.w13, ref.w2, torch.ones(3, 2, device=DEVICE),
                      torch.zeros(3, 2, dtype=torch.long, device=DEVICE))


def test_block_config_grows_with_tokens_per_expert() -> None:
    assert block_config(1, 6, 64).block_m == 16  # decode
    sizes = [block_config(t, 6, 64).block_m for t in (1, 64, 512, 4096)]
    assert sizes == sorted(sizes) and sizes[-1] > 16


# ------------------------------------------------------------------ the backend


@pytest.mark.parametrize("t", [1, 7])
def test_triton_backend_matches_torch_backend(t: int) -> None:
    """The backend as a MoE layer uses it (load_expert one HF weight at a time, submit, sync) against
    the torch reference backend holding the same weights."""
    gen = torch.Generator().manual_seed(31 + t)
    e, h, i, k = 6, 40, 24, 2
    triton_experts, torch_experts = TritonExperts(e, h, i).to(DEVICE), TorchExperts(e, h, i).to(DEVICE)
    for expert in range(e):
        for kind, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
            triton_experts.load_expert(expert, kind, w.to(DEVICE))
            torch_experts.load_expert(expert, kind, w.to(DEVICE))
    ids, weights = routing(t, k, e, "uniform", gen)
    x = torch.randn(t, h, generator=gen).to(DEVICE)
    want = torch_experts(x, ids.to(DEVICE), weights.to(DEVICE))
    got = triton_experts(x, ids.to(DEVICE), weights.to(DEVICE))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(6)
    m = TritonExperts(4, 40, 24)
    ids, weights = routing(2, 2, 4, "uniform", gen)
    from kernels import triton_utils

    monkeypatch.setattr(triton_utils, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="triton expert backend needs a CUDA device"):
        m.submit(torch.randn(2, 40), ids, weights)


def test_backend_dequantizes_gguf_blocks() -> None:
    """TritonExperts loads like TorchExperts: GGUF blocks arrive dequantized into the stacked weights."""
    import gguf

    e, h, i = 2, 64, 32
    values = torch.randn(i, h, generator=torch.Generator().manual_seed(8)).numpy()
    qt = gguf.GGMLQuantizationType.Q8_0
    blocks = RawBlocks(qt, (i, h), gguf.quants.quantize(values, qt), "mem", "blk.1.ffn_up_exps.weight[1]")
    m = TritonExperts(e, h, i)
    m.load_expert(1, "up_proj", blocks)
    assert torch.equal(m.w13.data[1, i:], torch.from_numpy(gguf.quants.dequantize(blocks.data, qt)))


# ------------------------------------------------------------------ whole model


def runner_for(path, expert_backend: str) -> ModelRunner:
    loaded = load_model(path, device=DEVICE, dtype="float32", expert_backend=expert_backend,
                        load_tokenizer=False, progress=False)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=256, max_running_requests=2, device=DEVICE)


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    row = runner.req_to_token_pool.alloc()
    out = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True))
    runner.free_request(row, len(ids))
    return out


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v3"), "tiny-deepseek-v3", seed=21)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_model_logits_match_torch_backend(preset: str, tmp_path, v3_dir) -> None:
    path = v3_dir if preset == "tiny-deepseek-v3" else write_checkpoint(tmp_path / preset, preset, seed=20)
    ref, test = runner_for(path, "torch"), runner_for(path, "triton")
    experts = [m for m in test.model.modules() if isinstance(m, ExpertBackend)]
    assert experts and all(type(m) is TritonExperts for m in experts)
    ids = torch.randint(5, 129_000, (19,), generator=torch.Generator().manual_seed(22)).tolist()
    want, got = prefill_logits(ref, ids), prefill_logits(test, ids)
    assert rel_err(got, want) <= 1e-4
    assert test.generate_greedy(ids, 4) == ref.generate_greedy(ids, 4)  # decode steps: one token each


def test_model_from_gguf_with_quantized_experts(v3_dir) -> None:
    """A GGUF's Q8_0 experts reach TritonExperts decoded, as they reach TorchExperts."""
    path = write_gguf(v3_dir, v3_dir / "experts-q8_0.gguf", "F32", expert_qtype="Q8_0")
    ids = torch.randint(5, 129_000, (11,), generator=torch.Generator().manual_seed(23)).tolist()
    want, got = prefill_logits(runner_for(path, "torch"), ids), prefill_logits(runner_for(path, "triton"), ids)
    assert rel_err(got, want) <= 1e-4


# ------------------------------------------------------------------ GPU: real sizes, CUDA graphs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 64, 512])
def test_v2_lite_sizes_bf16_on_cuda(t: int) -> None:
    """DeepSeek-V2-Lite's routed experts: E=64, K=6, H=2048, I=1408."""
    e, k, h, i = 64, 6, 2048, 1408
    gen = torch.Generator().manual_seed(30 + t)
    ref, exact = bf16_experts(e, h, i, gen)
    ids, weights = routing(t, k, e, "skewed", gen)
    x = torch.randn(t, h, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    truth = exact(x.float(), ids, weights)
    got = fused_experts(x, ref.w13, ref.w2, weights, ids)
    assert_bf16_close(got, ref(x, ids, weights), truth)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_follows_new_routing() -> None:
    """Captured once, replayed with other tokens and other experts: the graph holds no routing-dependent
    shapes, so its results equal eager runs."""
    e, k, h, i, t = 64, 6, 2048, 1408, 8
    gen = torch.Generator().manual_seed(40)
    ref = make_experts(e, h, i, torch.bfloat16, gen)
    x = torch.zeros(t, h, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.zeros(t, k, device=DEVICE, dtype=torch.long)
    weights = torch.zeros(t, k, device=DEVICE)
    fill = [routing(t, k, e, load, gen) + (torch.randn(t, h, generator=gen),) for load in ("uniform", "skewed", "one")]

    def set_inputs(j: int) -> None:
        ids.copy_(fill[j][0]), weights.copy_(fill[j][1]), x.copy_(fill[j][2])

    set_inputs(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_experts(x, ref.w13, ref.w2, weights, ids)  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, ref.w13, ref.w2, weights, ids)
    for j in (1, 2, 0):
        set_inputs(j)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, ref.w13, ref.w2, weights, ids), rtol=0, atol=0)
