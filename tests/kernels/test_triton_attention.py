"""The `triton` attention backend against the `torch` reference backend, on the same pools and batches.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes; with CUDA (tests marked `gpu`)
on DeepSeek's real sizes. Pools are filled with random values everywhere, KV slots are handed out by
the real allocator in a shuffled order (page size 1) or as 64-token pages, batches are ragged, head
counts are not multiples of the kernels' head block, and requests with and without a cached prefix
share a batch.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

pytest.importorskip("triton")

from kernels.attention import AttentionLayer, create_attention_backend  # noqa: E402
from kernels.attention.triton_backend import PLANS_FILE, DecodePlan, load_plans, pick_plan  # noqa: E402
from kernels import triton_attention  # noqa: E402
from executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from executor.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenSlotAllocator,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Setup:
    """Pools plus requests with cached prefixes, and a way to build a batch extending each of them."""

    def __init__(self, kind: str, page: int, dtype: torch.dtype, *, heads_kv: int = 1, dk: int = 32, dr: int = 16,
                 dv: int | None = None, slots: int = 4096, context: int = 1024, seed: int = 0, layers: int = 1) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.page, self.dtype = page, dtype
        self.req_pool = ReqToTokenPool(16, context, DEV)
        self.alloc = TokenSlotAllocator(slots, page, DEV)
        if page == 1:  # hand slots out in a shuffled order, as a long-running server does
            self.alloc._free = self.alloc._free[torch.randperm(self.alloc._free.numel(), generator=self.gen)]
        if kind == "mla":
            self.pool = MLATokenToKVPool(slots, layers, dk, dr, dtype, DEV, page)
            buffers = list(self.pool.kv_buffer)
        else:
            self.pool = MHATokenToKVPool(slots, layers, heads_kv, dk, dtype, DEV, page, v_head_dim=dv)
            buffers = [b for pair in zip(self.pool.k_buffer, self.pool.v_buffer) for b in pair]
        for buf in buffers:
            buf.copy_(self._rand(*buf.shape))
        self.lens: dict[int, int] = {}

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(DEV, self.dtype)

    def batch(self, spec: list[tuple[int, int]], mode: ForwardMode | None = None) -> ForwardBatch:
        """spec: (prefix_len, new tokens) per request; prefixes are allocated (and written randomly) first."""
        rows, locs = [], []
        for prefix, n in spec:
            row = self.req_pool.alloc()
            assert row is not None
            if prefix:
                loc = self.alloc.alloc_extend([(-1, prefix)])
                self.req_pool.write(row, 0, loc)
            last = int(self.req_pool.req_to_token[row, prefix - 1]) if prefix else -1
            loc = self.alloc.alloc_extend([(last, n)])
            self.req_pool.write(row, prefix, loc)
            rows.append(row)
            locs.append(loc)
        if mode is None:
            mode = ForwardMode.DECODE if all(p > 0 and n == 1 for p, n in spec) else ForwardMode.EXTEND
        seq = [p + n for p, n in spec]
        return ForwardBatch(
            forward_mode=mode, batch_size=len(spec),
            input_ids=torch.zeros(sum(n for _, n in spec), dtype=torch.int64, device=DEV),
            positions=torch.cat([torch.arange(p, p + n) for p, n in spec]).to(DEV),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEV),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=DEV), seq_lens_cpu=seq,
            extend_prefix_lens_cpu=[p for p, _ in spec], extend_seq_lens_cpu=[n for _, n in spec],
            out_cache_loc=torch.cat(locs).to(torch.int64), req_to_token_pool=self.req_pool, token_to_kv_pool=self.pool,
            attn_backend=None,  # type: ignore[arg-type]
        )


def _backends(**kw) -> tuple:
    return create_attention_backend("torch"), create_attention_backend("triton", **kw)


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _mla_absorb(setup: Setup, batch: ForwardBatch, heads: int, r: int, p: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    layer = AttentionLayer(0, heads, 1, r + p, r, 0.37, kv_lora_rank=r, qk_rope_head_dim=p)
    t = batch.num_tokens
    q_latent, q_pe = setup._rand(t, heads, r), setup._rand(t, heads, p)
    c_kv, k_pe = setup._rand(t, r), setup._rand(t, p)
    outs = []
    for backend in _backends(**kw):
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        backend.set_mla_kv(layer, batch, c_kv, k_pe)
        outs.append(backend.forward_mla_absorb(q_latent, q_pe, layer, batch).float())
    return outs[0], outs[1]


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [5, 20])
def test_mla_decode_matches_torch(page: int, dtype: torch.dtype, heads: int) -> None:
    setup = Setup("mla", page, dtype, seed=heads + page)
    batch = setup.batch([(1, 1), (63, 1), (64, 1), (200, 1), (517, 1)])
    ref, out = _mla_absorb(setup, batch, heads, 32, 16, num_sms=8)  # 8 SMs: several splits per request
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("num_sms", [1, 3, 64])
def test_mla_decode_any_split_plan(num_sms: int) -> None:
    """1 split (no combine work), uneven splits, and more splits than a short request can use."""
    setup = Setup("mla", 1, torch.float32, seed=num_sms)
    batch = setup.batch([(700, 1), (65, 1), (2, 1)])
    ref, out = _mla_absorb(setup, batch, 16, 32, 16, num_sms=num_sms)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_extend_with_and_without_prefix(page: int, dtype: torch.dtype) -> None:
    """A fresh prefill, extends over prefixes of odd lengths, and decode requests in one MIXED batch."""
    setup = Setup("mla", page, dtype, seed=7 + page)
    batch = setup.batch([(0, 45), (37, 20), (130, 1), (64, 70), (5, 1)], mode=ForwardMode.MIXED)
    ref, out = _mla_absorb(setup, batch, 6, 32, 16)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def test_mla_store_latent_matches_pool_write() -> None:
    setup = Setup("mla", 1, torch.float32, seed=3)
    batch = setup.batch([(0, 9), (4, 3)])
    c_kv, k_pe = setup._rand(12, 32), setup._rand(12, 16)
    expected = setup.pool.kv_buffer[0].clone()
    expected[batch.out_cache_loc] = torch.cat([c_kv, k_pe], dim=1)
    layer = AttentionLayer(0, 4, 1, 48, 32, 1.0, kv_lora_rank=32, qk_rope_head_dim=16)
    create_attention_backend("triton").set_mla_kv(layer, batch, c_kv, k_pe)
    assert torch.equal(setup.pool.kv_buffer[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows_matches_indexing(dtype: torch.dtype) -> None:
    """K / V rows [T, Hkv, D] into a [S, Hkv, D] buffer of the cache dtype, rows wider than one block."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(64, 3, 400, generator=gen).to(DEV, dtype)
    loc = torch.tensor([9, 2, 40, 63, 17], device=DEV)
    rows = torch.randn(5, 3, 400, generator=gen).to(DEV, dtype)  # the model's K / V, in the cache dtype
    expected = buf.clone()
    expected[loc] = rows
    triton_attention.store_rows(buf, loc, rows)
    assert torch.equal(buf, expected)


@pytest.mark.parametrize("heads,heads_kv", [(6, 2), (9, 3), (4, 4), (40, 2)])
@pytest.mark.parametrize("page", [1, 64])
def test_gqa_extend_and_decode_match_torch(heads: int, heads_kv: int, page: int) -> None:
    setup = Setup("mha", page, torch.float32, heads_kv=heads_kv, dk=24, dv=24, seed=heads * 10 + page)
    layer = AttentionLayer(0, heads, heads_kv, 24, 24, 0.29)
    for spec, mode in (([(0, 33), (50, 17), (9, 1)], ForwardMode.MIXED), ([(100, 1), (1, 1), (66, 1)], None)):
        batch = setup.batch(spec, mode)
        t = batch.num_tokens
        q, k, v = setup._rand(t, heads, 24), setup._rand(t, heads_kv, 24), setup._rand(t, heads_kv, 24)
        outs = []
        for backend in _backends(num_sms=8):
            batch.attn_backend = backend
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k, v, layer, batch))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_mla_normal_prefill_matches_torch() -> None:
    """The expanded-K prefill over packed tensors (no pool): head width 24 + 8 not a power of two."""
    setup = Setup("mla", 1, torch.float32, seed=11)
    batch = setup.batch([(0, 40), (0, 1), (0, 77)])
    heads, d, dv = 3, 24, 20
    layer = AttentionLayer(0, heads, heads, d, dv, 0.21)
    t = batch.num_tokens
    q, k, v = setup._rand(t, heads, d), setup._rand(t, heads, d), setup._rand(t, heads, dv)
    outs = []
    for backend in _backends():
        backend.init_forward_metadata(batch)
        outs.append(backend.forward_mla_normal(q, k, v, layer, batch))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_split_plan_same_for_padded_and_unpadded_batches() -> None:
    """Eager decode of B requests and the graph captured for B's padded size split alike."""
    backend = create_attention_backend("triton", num_sms=132)
    for bs, padded in ((3, 4), (5, 8), (20, 24), (33, 40), (70, 80)):
        for blocks in (1, 8):
            assert backend.max_splits(bs, blocks, DEV) == backend.max_splits(padded, blocks, DEV)


@pytest.mark.parametrize("plan", [
    DecodePlan(block_h=32, block_n=16, num_warps=8, num_stages=3, waves=2, max_splits=3),
    DecodePlan(block_h=16, block_n=64, num_warps=4, num_stages=1, waves=8, max_splits=256),
])
@pytest.mark.parametrize("page", [1, 64])
def test_mla_decode_under_other_launch_plans(plan: DecodePlan, page: int) -> None:
    """A measured plan (other head blocks, tiles and split counts) gives the reference's output."""
    setup = Setup("mla", page, torch.float32, seed=plan.block_n + page)
    batch = setup.batch([(5, 1), (300, 1), (129, 1)])
    plans = {20: {2: plan}}
    assert create_attention_backend("triton", decode_plans=plans).decode_plan(20, 3, DEV) is plan
    ref, out = _mla_absorb(setup, batch, 20, 32, 16, num_sms=8, decode_plans=plans)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


def test_mla_decode_combines_more_splits_than_one_load() -> None:
    """36 splits: the combine kernel's loop takes them in two loads of COMBINE_BLOCK_S (32)."""
    setup = Setup("mla", 1, torch.float32, seed=36, context=4096)
    batch = setup.batch([(2300, 1)])
    plans = {4: {1: DecodePlan(waves=1, max_splits=64)}}
    backend = create_attention_backend("triton", num_sms=64, decode_plans=plans)
    assert backend.max_splits(1, 1, DEV, plans[4][1]) == 64 and -(-2301 // triton_attention.MIN_SPLIT_LEN) == 36 > 32
    ref, out = _mla_absorb(setup, batch, 4, 32, 16, num_sms=64, decode_plans=plans)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


def test_mla_decode_wide_latent_combines_in_column_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A latent wider than one combine program's columns (160: two blocks of the compiled kernels' 128, the
    second part masked; interpreted, a combine program takes the whole row unless told otherwise)."""
    monkeypatch.setattr(triton_attention, "decode_attention",
                        functools.partial(triton_attention.decode_attention,
                                          combine_block_dv=triton_attention.COMBINE_BLOCK_DV))
    setup = Setup("mla", 1, torch.float32, dk=160, dr=16, seed=11)
    batch = setup.batch([(70, 1), (200, 1)])
    ref, out = _mla_absorb(setup, batch, 4, 160, 16, num_sms=8)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


def test_pick_plan_by_head_group_and_rounded_batch() -> None:
    small, mid, big = DecodePlan(block_n=16), DecodePlan(block_n=64), DecodePlan(block_h=64, block_n=16)
    table = {16: {2: small, 8: mid}, 128: {64: big}}
    assert pick_plan(table, 16, 1) is small  # the smallest measured size above
    assert pick_plan(table, 16, 5) is mid and pick_plan(table, 16, 8) is mid  # 5 rounds up to 8
    assert pick_plan(table, 16, 4) is small and pick_plan(table, 16, 100) is mid
    assert pick_plan(table, 128, 3) is big
    assert pick_plan(table, 32, 8) == DecodePlan()  # a group nobody measured: the defaults
    for bs, padded in ((3, 4), (5, 8), (20, 24), (33, 40)):
        assert pick_plan(table, 16, bs) is pick_plan(table, 16, padded)


def test_load_plans_checks_the_file(tmp_path) -> None:
    path = tmp_path / "plans.json"
    assert load_plans("GPU X", path) == {}  # nothing measured
    path.write_text(json.dumps({"GPU X": {"128": {"4": {"block_h": 64, "block_n": 32, "num_warps": 8}}}}))
    assert load_plans("GPU X", path) == {128: {4: DecodePlan(block_h=64, num_warps=8)}}
    assert load_plans("GPU Y", path) == {}
    for bad in ({"block_h": 48}, {"block_h": 64}, {"block_n": 8}, {"num_warps": 3}, {"waves": 0}, {"tile": 16},
                {"max_splits": 64.0}, {"waves": 2.5}, {"waves": True}, {"waves": 1000000}, {"max_splits": 10**9},
                {"block_n": 256}, {"num_stages": 8}):
        path.write_text(json.dumps({"GPU X": {"16": {"1": bad}}}))
        with pytest.raises(ValueError, match="plans.json"):
            load_plans("GPU X", path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="device names"):
        load_plans("GPU X", path)


def test_committed_plans_are_valid() -> None:
    """The measured plans shipped with the kernels parse for every device they name."""
    if not PLANS_FILE.exists():
        pytest.skip("no measured plans committed")
    for device in json.loads(PLANS_FILE.read_text()):
        assert load_plans(device)


@pytest.mark.parametrize("page", [1, 64])
def test_cuda_graph_hooks_update_metadata_in_place(page: int) -> None:
    """The replay hook rewrites the preallocated metadata (same storage) and the decode is still right."""
    setup = Setup("mla", page, torch.float32, seed=21)
    backend = create_attention_backend("triton", num_sms=8)
    backend.init_cuda_graph_state(8, setup.req_pool.max_context_len, DEV)
    first = setup.batch([(10, 1), (300, 1), (1, 1)])
    backend.init_forward_metadata_capture_cuda_graph(first)
    ptr = backend.decode.table.data_ptr()
    second = setup.batch([(129, 1), (2, 1), (77, 1)])
    backend.init_forward_metadata_replay_cuda_graph(second)
    assert backend.decode.table.data_ptr() == ptr
    layer = AttentionLayer(0, 4, 1, 48, 32, 0.5, kv_lora_rank=32, qk_rope_head_dim=16)
    q_latent, q_pe = setup._rand(3, 4, 32), setup._rand(3, 4, 16)
    second.attn_backend = backend
    out = backend.forward_mla_absorb(q_latent, q_pe, layer, second)
    ref_backend = create_attention_backend("torch")
    ref_backend.init_forward_metadata(second)
    torch.testing.assert_close(out, ref_backend.forward_mla_absorb(q_latent, q_pe, layer, second), atol=2e-5, rtol=2e-5)


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import triton_utils

    monkeypatch.setattr(triton_utils, "INTERPRETED", False)
    setup = Setup("mla", 1, torch.float32)
    batch = setup.batch([(3, 1)])
    if DEV.type == "cuda":
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        create_attention_backend("triton").init_forward_metadata(batch)


# ---------------------------------------------------------------- real sizes on a GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 64])
def test_gpu_mla_decode_deepseek_sizes(heads: int, page: int) -> None:
    setup = Setup("mla", page, torch.bfloat16, dk=512, dr=64, slots=1 << 16, context=8192, seed=heads)
    batch = setup.batch([(1, 1), (1000, 1), (4095, 1), (8000, 1), (37, 1)] * 3)
    ref, out = _mla_absorb(setup, batch, heads, 512, 64)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page", [1, 64])
def test_gpu_mla_extend_deepseek_sizes(page: int) -> None:
    setup = Setup("mla", page, torch.bfloat16, dk=512, dr=64, slots=1 << 15, context=8192, seed=5)
    batch = setup.batch([(0, 700), (1500, 300), (64, 1), (3000, 129)], mode=ForwardMode.MIXED)
    ref, out = _mla_absorb(setup, batch, 16, 512, 64)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- whole engine
@pytest.fixture(scope="module", params=["tiny-deepseek-v3", "tiny-llama"])
def model_dir(request, tmp_path_factory):
    from models.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)


@pytest.mark.parametrize("page", [1, 64])
def test_engine_with_triton_backend_matches_torch(model_dir, page: int) -> None:
    """Staggered greedy requests (fresh prefills, a prefix-cache hit, chunked prefill mixed with decodes)
    give the same tokens with the triton backend as with the torch backend."""
    from engine.args import EngineArgs
    from engine.core import EngineCore
    from engine.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    if page == 64 and "llama" in str(model_dir):
        pytest.skip("paged GQA is covered by the kernel tests above; the interpreter is slow")
    gen = torch.Generator().manual_seed(page)
    shared = torch.randint(3, 5000, (70,), generator=gen).tolist()
    prompts = [shared + [11, 12], torch.randint(3, 5000, (9,), generator=gen).tolist(), shared + [40]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5)
    results = {}
    for backend in ("torch", "triton"):
        core = EngineCore(EngineArgs(model=str(model_dir), device=str(DEV), dtype="float32", attention_backend=backend,
                                     max_total_tokens=1024, max_running_requests=8, chunked_prefill_size=32,
                                     page_size=page))
        out: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts):
            core.add_request(GenerateRequest(f"r{i}", ids, params))
            for _ in range(2 if i < 2 else 1000):  # staggered: later requests join running ones
                for o in core.step():
                    out.setdefault(o.rid, []).extend(o.new_token_ids)
                if not core.has_work():
                    break
        results[backend] = out
    assert all(len(v) == 5 for v in results["torch"].values())
    assert results["triton"] == results["torch"]


def test_serve_flags_for_the_gpu_path(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Triton backends on a CPU device are refused at start-up with a message naming the fix."""
    from server.args import parse_serve_args

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for flags in (["--attention-backend", "triton"], ["--expert-backend", "triton"]):
        with pytest.raises(SystemExit):
            parse_serve_args(flags)
        assert "--device cuda" in capsys.readouterr().err
    engine = parse_serve_args(["--device", "cuda", "--attention-backend", "triton", "--expert-backend", "triton",
                               "--cuda-graph-max-bs", "16", "--disable-cuda-graph"]).engine
    assert (engine.attention_backend, engine.expert_backend, engine.cuda_graph_max_bs, engine.disable_cuda_graph) == (
        "triton", "triton", 16, True)
    assert engine.hybrid_graph_mode == "host-nodes"
    monkeypatch.setenv("MLASERVE_HYBRID_GRAPH_MODE", "split")
    assert parse_serve_args(["--device", "cuda", "--expert-backend", "cpp"]).engine.hybrid_graph_mode == "split"
    with pytest.raises(SystemExit):
        parse_serve_args(["--hybrid-graph-mode", "sometimes"])
