"""OmniKV's Triton kernels (kernels/triton_omnikv.py) and the triton backend's sparse decode against the torch
reference (kernels/attention/omnikv.py and the torch backend).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes. Inputs are random everywhere (caches,
queries, weights), KV slots are scattered, contexts ragged (1 token, one KV block, several splits), windows
have absent entries, GQA has fewer KV heads than query heads and MLA-shaped keys are r + P = 32 + 16 wide.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

pytest.importorskip("triton")

from executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from kernels import triton_omnikv  # noqa: E402
from kernels.attention import AttentionLayer, create_attention_backend  # noqa: E402
from kernels.attention.omnikv import FILTER, FULL, SPARSE, OmniKVBatch, QueryHistory, importance, select_positions  # noqa: E402

from tests.kernels.test_triton_attention import DEV, Setup as AttentionSetup  # noqa: E402


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


class Rows:
    """A cache of random keys and a req_to_token table handing out scattered slots."""

    def __init__(self, gen: torch.Generator, slots: int, heads_kv: int, d: int, dtype: torch.dtype,
                 rows: int = 6, max_ctx: int = 320) -> None:
        self.keys = _rand(gen, slots, heads_kv, d, dtype=dtype)
        perm = torch.randperm(slots, generator=gen)[: rows * max_ctx]
        self.req_to_token = perm.view(rows, max_ctx).to(DEV, torch.int32)


def _window(gen: torch.Generator, ctx: list[int], window: int, absent: set[tuple[int, int]]):
    """Positions [B, W] of each row's last `window` decode steps (oldest first; -1 where absent or before
    position 0; the current one is always present) and exponential alpha weights of the present ones."""
    q_pos = torch.full((len(ctx), window), -1, dtype=torch.int64)
    weights = torch.zeros(len(ctx), window)
    for b, n in enumerate(ctx):
        present = [w for w in range(window) if n - window + w >= 0 and ((b, w) not in absent or w == window - 1)]
        for i, w in enumerate(present):
            q_pos[b, w] = n - window + w
            weights[b, w] = 2.0 ** (i + 1 - len(present))
    return q_pos.to(DEV), weights.to(DEV)


def _reference(q, q_pos, weights, rows: Rows, req_rows, ctx, scale, b):
    n = ctx[b]
    present = [w for w in range(q.shape[1]) if int(q_pos[b, w]) >= 0]
    slots = rows.req_to_token[req_rows[b], :n].long()
    return importance(q[b, present], rows.keys[slots], [int(q_pos[b, w]) for w in present],
                      [float(weights[b, w]) for w in present], scale)


# ---------------------------------------------------------------- importance
@pytest.mark.parametrize("heads, heads_kv, d, dtype", [
    (6, 2, 24, torch.float32), (6, 2, 24, torch.bfloat16),  # GQA (24 = 16 + 8 columns)
    (5, 1, 48, torch.float32), (5, 1, 48, torch.bfloat16),  # MLA-shaped: r + P = 32 + 16, one latent row
    (4, 4, 16, torch.float16),  # MHA, a power-of-two width, an fp16 cache
    (32, 1, 48, torch.bfloat16),  # MLA, two 16-head blocks (on a GPU: bf16 tensor-core scores)
])
def test_importance_matches_reference(heads: int, heads_kv: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + d + (dtype == torch.bfloat16))
    rows = Rows(gen, 2048, heads_kv, d, dtype)
    ctx = [1, 64, 200, 2, 131]
    req_rows = [5, 0, 3, 1, 2]
    window = 3
    q = _rand(gen, len(ctx), window, heads, d, dtype=dtype)
    q_pos, weights = _window(gen, ctx, window, absent={(2, 1), (4, 0)})
    l_max = 224
    out = triton_omnikv.importance(
        q, q_pos, weights, rows.keys, rows.req_to_token, torch.tensor(req_rows, device=DEV),
        torch.tensor(ctx, device=DEV), 0.31, l_max)
    assert out.shape == (len(ctx), l_max) and out.dtype == torch.float32
    for b, n in enumerate(ctx):
        ref = _reference(q, q_pos, weights, rows, req_rows, ctx, 0.31, b)
        torch.testing.assert_close(out[b, :n], ref, atol=1e-6, rtol=1e-5)
        assert torch.all(out[b, n:] == 0)
    assert out[:, :2].sum() > 0


@pytest.mark.parametrize("block_n", [16, 64, 512])
def test_importance_any_key_block_and_one_query(block_n: int) -> None:
    """One window query per row (last_token), key blocks from many a row to one wider than every row."""
    gen = torch.Generator().manual_seed(block_n)
    rows = Rows(gen, 2048, 2, 24, torch.float32)
    ctx, req_rows = [257, 65, 9], [1, 4, 0]
    q = _rand(gen, len(ctx), 1, 4, 24)
    q_pos = torch.tensor([[n - 1] for n in ctx], device=DEV)
    weights = torch.ones(len(ctx), 1, device=DEV)
    out = triton_omnikv.importance(q, q_pos, weights, rows.keys, rows.req_to_token, torch.tensor(req_rows, device=DEV),
                                   torch.tensor(ctx, device=DEV), 0.5, 257, block_n=block_n)
    for b, n in enumerate(ctx):
        torch.testing.assert_close(out[b, :n], _reference(q, q_pos, weights, rows, req_rows, ctx, 0.5, b),
                                   atol=1e-6, rtol=1e-5)
        # one query: the max over heads of probabilities; every position gets at most 1
        assert float(out[b, :n].max()) <= 1.0 + 1e-6


def test_importance_many_heads_and_many_blocks() -> None:
    """128 query heads on one latent row (V3-shaped MLA: eight head blocks) and more key blocks than the
    combine step merges at once (it reads them in groups), as a long context has them."""
    gen = torch.Generator().manual_seed(128)
    rows = Rows(gen, 6000, 1, 48, torch.bfloat16, rows=2, max_ctx=2400)
    ctx, req_rows = [2300, 700], [1, 0]
    q = _rand(gen, len(ctx), 2, 128, 48)
    q_pos = torch.tensor([[n - 2, n - 1] for n in ctx], device=DEV)
    weights = torch.tensor([[0.5, 1.0]] * len(ctx), device=DEV)
    out = triton_omnikv.importance(q, q_pos, weights, rows.keys, rows.req_to_token, torch.tensor(req_rows, device=DEV),
                                   torch.tensor(ctx, device=DEV), 0.2, 2304)
    for b, n in enumerate(ctx):
        torch.testing.assert_close(out[b, :n], _reference(q, q_pos, weights, rows, req_rows, ctx, 0.2, b),
                                   atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- selection
def _check_selection(imp: torch.Tensor, ctx: list[int], budgets: list[int], sink: int, recent: int,
                     req_to_token: torch.Tensor, req_rows: list[int]) -> None:
    k_max = max(budgets) + sink + recent
    slots, lens, positions = triton_omnikv.select_slots(
        imp, torch.tensor(ctx, device=DEV), budgets, sink, recent, req_to_token,
        torch.tensor(req_rows, device=DEV), k_max, return_positions=True)
    assert slots.shape == (len(ctx), k_max) and slots.dtype == torch.int32 and lens.dtype == torch.int32
    for b, n in enumerate(ctx):
        want = select_positions(imp[b, :n], budgets[b], sink, recent)
        got = int(lens[b])
        assert positions[b, :got].tolist() == want.tolist(), b
        assert slots[b, :got].tolist() == req_to_token[req_rows[b], want].tolist()
        assert torch.all(positions[b, got:] == -1) and torch.all(slots[b, got:] == 0)


def test_select_matches_reference_with_ties() -> None:
    """Importance with many equal values (ties go to the earlier position), rows shorter than sink +
    recent, a budget covering every candidate, a budget of 0, and a one-token context."""
    gen = torch.Generator().manual_seed(3)
    ctx = [200, 3, 40, 1, 120, 17, 90]
    budgets = [10, 5, 30, 2, 0, 4, 25]
    imp = (torch.randint(0, 4, (len(ctx), 256), generator=gen).float() / 4).to(DEV)
    imp[:, 150:] = 0.0
    req_to_token = torch.randperm(4096, generator=gen)[: 8 * 256].view(8, 256).to(DEV, torch.int32)
    _check_selection(imp, ctx, budgets, 4, 6, req_to_token, [7, 1, 0, 3, 2, 6, 5])
    _check_selection(imp, ctx, budgets, 0, 1, req_to_token, [7, 1, 0, 3, 2, 6, 5])


def test_select_long_rows_across_blocks() -> None:
    """Rows longer than one block of the selection kernel (its radix passes and the ordered write run
    over several blocks): random importance with ties, budgets from 1 to the whole middle."""
    gen = torch.Generator().manual_seed(11)
    ctx = [2500, 1025, 2047, 1800]
    budgets = [250, 1, 2047, 900]
    imp = (torch.randint(0, 50, (len(ctx), 2560), generator=gen).float() / 7).to(DEV)
    req_to_token = torch.randperm(16384, generator=gen)[: 4 * 2560].view(4, 2560).to(DEV, torch.int32)
    _check_selection(imp, ctx, budgets, 4, 16, req_to_token, [2, 0, 3, 1])


def test_select_chunks_of_several_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer chunk programs than blocks (as at long contexts, where a chunk spans many blocks): each
    chunk's histogram, counts and ordered write run over several blocks, with ties across chunks."""
    monkeypatch.setattr(triton_omnikv, "_MAX_CHUNKS", 2)
    gen = torch.Generator().manual_seed(12)
    ctx = [3000, 2100, 1030]
    budgets = [700, 3, 1000]
    imp = (torch.randint(0, 9, (len(ctx), 3072), generator=gen).float() / 3).to(DEV)
    req_to_token = torch.randperm(16384, generator=gen)[: 3 * 3072].view(3, 3072).to(DEV, torch.int32)
    _check_selection(imp, ctx, budgets, 4, 16, req_to_token, [1, 2, 0])


def test_select_on_kernel_importance() -> None:
    """The whole device path (importance kernel, then select_slots) against the reference's."""
    gen = torch.Generator().manual_seed(8)
    rows = Rows(gen, 2048, 1, 48, torch.float32)
    ctx, req_rows = [300, 47, 130], [2, 0, 5]
    q = _rand(gen, len(ctx), 2, 3, 48)
    q_pos, weights = _window(gen, ctx, 2, absent=set())
    rr, cl = torch.tensor(req_rows, device=DEV), torch.tensor(ctx, device=DEV)
    imp = triton_omnikv.importance(q, q_pos, weights, rows.keys, rows.req_to_token, rr, cl, 0.2, 304)
    budgets, sink, recent = [30, 12, 200], 4, 8
    slots, lens = triton_omnikv.select_slots(imp, cl, budgets, sink, recent, rows.req_to_token, rr,
                                             max(budgets) + sink + recent)
    for b, n in enumerate(ctx):
        ref = _reference(q, q_pos, weights, rows, req_rows, ctx, 0.2, b)
        want = rows.req_to_token[req_rows[b], select_positions(ref, budgets[b], sink, recent)]
        assert slots[b, : int(lens[b])].tolist() == want.tolist()
    assert lens.tolist() == [4 + 30 + 8, 4 + 12 + 8, 130]


def test_select_refuses_a_small_buffer() -> None:
    imp = torch.rand(2, 50).to(DEV)
    with pytest.raises(ValueError, match="k_max"):
        triton_omnikv.select_slots(imp, torch.tensor([50, 50], device=DEV), [10, 3], 4, 8,
                                   torch.zeros(2, 50, dtype=torch.int32, device=DEV),
                                   torch.tensor([0, 1], device=DEV), 20)


# ---------------------------------------------------------------- packed gather
@pytest.mark.parametrize("shape, dtype", [((48,), torch.bfloat16), ((2, 24), torch.float32)])  # latent; K/V
def test_gather_rows_matches_indexing(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    src = _rand(gen, 700, *shape, dtype=dtype)
    k_max = 37
    slots = torch.randint(0, 700, (3, k_max), generator=gen).to(DEV, torch.int32)
    lens = torch.tensor([37, 5, 0], device=DEV, dtype=torch.int32)
    out = torch.full((3, k_max, *shape), 7.0, dtype=dtype, device=DEV)
    triton_omnikv.gather_rows(src, slots, lens, out)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(out[b, :n], src[slots[b, :n].long()])
        assert torch.all(out[b, n:] == 7.0)  # rows past the length are left alone
    fresh = triton_omnikv.gather_rows(src, slots, lens)
    assert fresh.shape == (3, k_max, *shape) and torch.equal(fresh[0], src[slots[0].long()])


# ---------------------------------------------------------------- OmniKVBatch.observe_batched
def _history_with_gaps(gen: torch.Generator, num_filters: int, window: int, heads: int, d: int,
                       req_rows: list[int], positions: list[int]) -> QueryHistory:
    """Random queries of some earlier steps of each row: some window entries absent, some stale (an
    older position's query in the entry), and a row with nothing recorded."""
    hist = QueryHistory(8, num_filters, window, heads, d, DEV)
    for f in range(num_filters):
        for j, (row, pos) in enumerate(zip(req_rows, positions)):
            if j == 1:
                continue  # nothing but the current query
            backs = [b for b in range(2 * window, 0, -1) if torch.rand(1, generator=gen).item() < 0.6]
            for back in backs:  # oldest first: a newer position overwrites its entry
                if pos - back >= 0:
                    hist.record(f, row, pos - back, _rand(gen, heads, d))
    return hist


def _clone_history(hist: QueryHistory | None) -> QueryHistory | None:
    if hist is None:
        return None
    twin = QueryHistory(1, 1, hist.window, 1, 1, DEV)
    twin.q, twin.pos = hist.q.clone(), hist.pos.clone()
    return twin


@pytest.mark.parametrize("heads, heads_kv, d, window, alpha", [
    (6, 2, 24, 4, "exponential"),  # GQA
    (5, 1, 48, 3, "uniform"),  # MLA-shaped: the latent rows as one KV head of r + P
    (4, 4, 16, 1, "last_token"),  # no history: the current query only
])
def test_observe_batched_matches_observe(heads: int, heads_kv: int, d: int, window: int, alpha: str) -> None:
    """The device path and the reference's per-row `observe` on the same inputs (two filter layers, rows
    of the batch that are not sparse, contexts shorter than sink + recent, budgets of 0 and of the whole
    middle): the same selections, counters, recorded history and decode views."""
    gen = torch.Generator().manual_seed(heads * 10 + window)
    rows = Rows(gen, 2048, heads_kv, d, torch.float32)
    sink, recent, scale = 3, 5, 0.3
    sparse_rows = [0, 2, 3, 5, 6]  # batch rows 1 and 4 attend fully
    req_rows = [5, 0, 3, 1, 2]
    positions = [199, 40, 2, 130, 9]
    budgets = [16, 50, 4, 0, 3]  # row 1: the whole middle; row 3: sink + recent only
    weights = {"exponential": lambda c: [2.0 ** (i - c) for i in range(1, c + 1)],
               "uniform": lambda c: [1.0] * c, "last_token": lambda c: [0.0] * (c - 1) + [1.0]}[alpha]
    roles, source = (FILTER, SPARSE, FULL, FILTER, SPARSE), (-1, 0, -1, -1, 1)
    hist = _history_with_gaps(gen, 2, window, heads, d, req_rows, positions) if window > 1 else None
    states = [OmniKVBatch(roles, source, sparse_rows, req_rows, positions, budgets, sink=sink, recent=recent,
                          weights_for=weights, table=rows.req_to_token, history=h)
              for h in (hist, _clone_history(hist))]
    ref, dev = states
    for layer_id in (0, 3):
        q = _rand(gen, 7, heads, d)  # every batch row's query; the non-sparse rows' are skipped
        ref.observe(layer_id, list(range(7)), q, rows.keys, scale)
        dev.observe_batched(layer_id, list(range(7)), q, rows.keys, scale, triton_omnikv)
    assert sorted(dev.packed) == [0, 1] and not ref.packed
    assert (dev.selected_tokens, dev.context_tokens) == (ref.selected_tokens, ref.context_tokens)
    assert ref.selected_tokens < ref.context_tokens
    for f in (0, 1):
        for i in range(len(sparse_rows)):
            assert dev.selected[f][i].dtype == torch.int64
            assert dev.selected[f][i].tolist() == ref.selected[f][i].tolist(), (f, i)
    assert [t.numel() for t in ref.selected[0]] == [3 + 16 + 5, 41, 3, 8, 10]  # 41, 10: budget >= middle
    if hist is not None:
        assert torch.equal(dev.history.pos, ref.history.pos) and torch.equal(dev.history.q, ref.history.q)
    # the decode views of both sparse layers: the sparse rows' selections, the other rows' contexts
    ctx = [positions[sparse_rows.index(b)] + 1 if b in sparse_rows else 17 + 5 * b for b in range(7)]
    table_rows = [req_rows[sparse_rows.index(b)] if b in sparse_rows else 4 for b in range(7)]
    width = max(ctx)
    mask = torch.arange(width, device=DEV)[None, :] < torch.tensor(ctx, device=DEV)[:, None]
    indices = rows.req_to_token[torch.tensor(table_rows, device=DEV), :width].long().masked_fill(~mask, 0)
    for layer_id in (1, 4):
        assert dev.slots(layer_id, 3).tolist() == ref.slots(layer_id, 3).tolist() and dev.slots(layer_id, 1) is None
        got, got_valid = dev.decode_view(layer_id, indices, mask)
        want, want_valid = ref.decode_view(layer_id, indices, mask)
        assert got.dtype == want.dtype and got_valid.sum(1).tolist() == want_valid.sum(1).tolist()
        for b in range(7):
            assert got[b][got_valid[b]].tolist() == want[b][want_valid[b]].tolist(), (layer_id, b)
            assert torch.all(got[b][~got_valid[b]] == 0)


# ---------------------------------------------------------------- the triton backend with OmniKV
ROLES = (FULL, FILTER, SPARSE, FULL, SPARSE)  # layer 2 and 4 read layer 1's selection
SOURCE = (-1, -1, 0, -1, 0)
SINK, RECENT, BUDGET = 2, 4, 8


class Setup(AttentionSetup):
    """test_triton_attention's pools and batches with one layer per role, filled with random KV."""

    def __init__(self, kind: str, page: int, dtype: torch.dtype, **kw) -> None:
        super().__init__(kind, page, dtype, context=512, layers=len(ROLES), **kw)

    def rand(self, *shape: int) -> torch.Tensor:
        return self._rand(*shape)

    def omnikv(self, batch: ForwardBatch, sparse_rows: list[int], heads: int, dim: int, window: int) -> OmniKVBatch:
        """A fresh OmniKV state; with window > 1 a history holding random queries of some earlier steps:
        pos - 1 and pos - 3 present, pos - 2 absent (with window 4: a gap inside the window, and its entry
        holds the stale query of pos - 6)."""
        history = None
        if window > 1:
            history = QueryHistory(8, 1, window, heads, dim, DEV)
            gen = torch.Generator().manual_seed(99)
            for b in sparse_rows:
                pos = batch.seq_lens_cpu[b] - 1
                for back in (6, 3, 1):  # pos - 2 stays absent
                        history.record(0, int(batch.req_pool_indices[b]), pos - back, torch.randn(heads, dim, generator=gen))
        exp = lambda present: [2.0 ** (i - present) for i in range(1, present + 1)]  # noqa: E731
        return OmniKVBatch(ROLES, SOURCE, sparse_rows, [int(batch.req_pool_indices[b]) for b in sparse_rows],
                           [batch.seq_lens_cpu[b] - 1 for b in sparse_rows], [BUDGET] * len(sparse_rows),
                           sink=SINK, recent=RECENT, weights_for=exp, table=self.req_pool.req_to_token, history=history)


def _run_layers(setup: Setup, batch: ForwardBatch, sparse_rows: list[int], step, heads: int, dim: int, window: int):
    """Every layer through the torch and the triton backend, each with its own OmniKV state."""
    results = []
    for name in ("torch", "triton"):
        backend = create_attention_backend(name, num_sms=8) if name == "triton" else create_attention_backend(name)
        batch.attn_backend = backend
        batch.omnikv = setup.omnikv(batch, sparse_rows, heads, dim, window)
        backend.init_forward_metadata(batch)
        outs = [step(backend, layer_id).float() for layer_id in range(len(ROLES))]
        results.append((outs, batch.omnikv))
    (ref, ref_state), (out, state) = results
    assert state.packed and not ref_state.packed  # the triton backend selected on the device, the torch one per row
    assert (state.selected_tokens, state.context_tokens) == (ref_state.selected_tokens, ref_state.context_tokens)
    assert state.selected_tokens < state.context_tokens
    for i in range(len(sparse_rows)):
        assert torch.equal(state.selected[0][i], ref_state.selected[0][i])
    if window > 1:  # both recorded the same current queries
        assert torch.equal(state.history.pos, ref_state.history.pos)
        assert torch.equal(state.history.q, ref_state.history.q)
    return ref, out


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("page, dtype, window", [(1, torch.float32, 4), (1, torch.float32, 1), (64, torch.bfloat16, 1)])
def test_backend_mla_sparse_decode_matches_torch(mode: ForwardMode, page: int, dtype: torch.dtype, window: int) -> None:
    setup = Setup("mla", page, dtype, seed=page + window)
    if mode == ForwardMode.DECODE:
        spec, sparse_rows = [(90, 1), (10, 1), (120, 1), (64, 1)], [0, 2, 3]
    else:
        spec, sparse_rows = [(0, 20), (80, 1), (30, 5), (110, 1)], [1, 3]
    batch = setup.batch(spec, mode)
    heads, r, p = 5, 32, 16
    t = batch.num_tokens
    data = [(setup.rand(t, heads, r), setup.rand(t, heads, p), setup.rand(t, r), setup.rand(t, p)) for _ in ROLES]

    def step(backend, layer_id):
        q_latent, q_pe, c_kv, k_pe = data[layer_id]
        layer = AttentionLayer(layer_id, heads, 1, r + p, r, 0.37, kv_lora_rank=r, qk_rope_head_dim=p)
        backend.set_mla_kv(layer, batch, c_kv, k_pe)
        return backend.forward_mla_absorb(q_latent, q_pe, layer, batch)

    ref, out = _run_layers(setup, batch, sparse_rows, step, heads, r + p, window)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for layer_id in range(len(ROLES)):
        torch.testing.assert_close(out[layer_id], ref[layer_id], **tol)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [1, 4])
def test_backend_gqa_sparse_decode_matches_torch(mode: ForwardMode, window: int) -> None:
    heads, heads_kv, d = 6, 2, 16
    setup = Setup("mha", 1, torch.float32, heads_kv=heads_kv, dk=d, seed=5)
    if mode == ForwardMode.DECODE:
        spec, sparse_rows = [(70, 1), (120, 1), (5, 1)], [0, 1]
    else:
        spec, sparse_rows = [(40, 3), (120, 1), (0, 9)], [1]
    batch = setup.batch(spec, mode)
    t = batch.num_tokens
    data = [(setup.rand(t, heads, d), setup.rand(t, heads_kv, d), setup.rand(t, heads_kv, d)) for _ in ROLES]

    def step(backend, layer_id):
        q, k, v = data[layer_id]
        return backend.forward(q, k, v, AttentionLayer(layer_id, heads, heads_kv, d, d, 0.29), batch)

    ref, out = _run_layers(setup, batch, sparse_rows, step, heads, d, window)
    for layer_id in range(len(ROLES)):
        torch.testing.assert_close(out[layer_id], ref[layer_id], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sparse_rows", [[0, 1, 2], [1]], ids=["every-row", "some-rows"])
def test_backend_filter_layer_takes_importance_from_its_attention(sparse_rows: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step whose window is the current query: the filter layer's selection comes from the scores
    its own attention wrote (the keys are not scored a second time: `importance` would fail here), and
    equals the torch backend's per-row selection."""
    heads, heads_kv, d = 6, 2, 16
    setup = Setup("mha", 1, torch.float32, heads_kv=heads_kv, dk=d, seed=8)
    batch = setup.batch([(90, 1), (130, 1), (60, 1)], ForwardMode.DECODE)
    t = batch.num_tokens
    data = [(setup.rand(t, heads, d), setup.rand(t, heads_kv, d), setup.rand(t, heads_kv, d)) for _ in ROLES]
    called = []
    real = triton_omnikv.importance_from_scores
    monkeypatch.setattr(triton_omnikv, "importance_from_scores", lambda *a, **k: called.append(1) or real(*a, **k))

    def fail(*a, **k):
        raise AssertionError("a one-query window's importance was computed from the keys again")

    monkeypatch.setattr(triton_omnikv, "importance", fail)

    def step(backend, layer_id):
        q, k, v = data[layer_id]
        return backend.forward(q, k, v, AttentionLayer(layer_id, heads, heads_kv, d, d, 0.29), batch)

    ref, out = _run_layers(setup, batch, sparse_rows, step, heads, d, 1)
    assert called == [1]  # one filter layer
    for layer_id in range(len(ROLES)):
        torch.testing.assert_close(out[layer_id], ref[layer_id], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_importance_from_decode_scores_matches_importance(kind: str) -> None:
    """`decode_attention`'s scores and log-sum-exps give `importance`'s values for a one-query window."""
    from kernels.triton_attention import decode_attention, decode_partials_shape

    gen = torch.Generator().manual_seed(31 if kind == "gqa" else 32)
    heads, heads_kv, d, r, p = (6, 2, 24, 0, 0) if kind == "gqa" else (20, 1, 48, 32, 16)
    rows = Rows(gen, 2048, heads_kv, d, torch.float32)
    ctx, req_rows = [300, 1, 77, 129], [2, 5, 0, 3]
    bsz = len(ctx)
    q = _rand(gen, bsz, heads, d)
    splits = 3
    o_shape, l_shape = decode_partials_shape(bsz, heads, splits, d - p)
    part_o, part_lse = torch.empty(o_shape, device=DEV), torch.empty(l_shape, device=DEV)
    scores = torch.full((bsz, heads, 320), float("nan"), device=DEV)
    lse = torch.empty(bsz, heads, device=DEV)
    table, rows_t, lens = rows.req_to_token, torch.tensor(req_rows, device=DEV), torch.tensor(ctx, device=DEV)
    if kind == "gqa":
        out = torch.empty(bsz, heads, d, device=DEV)
        decode_attention(q, None, rows.keys, None, _rand(gen, 2048, heads_kv, d), out, table, rows_t, lens, 0.3,
                         splits, part_o, part_lse, scores=scores, lse=lse)
    else:
        out = torch.empty(bsz, heads, r, device=DEV)
        decode_attention(q[..., :r], q[..., r:], rows.keys[..., :r], rows.keys[..., r:], None, out, table, rows_t,
                         lens, 0.3, splits, part_o, part_lse, scores=scores, lse=lse)
    got = triton_omnikv.importance_from_scores(scores, lse, lens, 310)
    want = triton_omnikv.importance(q[:, None].contiguous(), (lens - 1)[:, None], torch.ones(bsz, 1, device=DEV),
                                    rows.keys, table, rows_t, lens, 0.3, 310)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.all(got[1, 1:] == 0) and float(got[1, 0]) == pytest.approx(1.0)


def test_backend_sparse_layer_reads_only_the_selection() -> None:
    """A sparse row's output at a SPARSE layer is attention over its selected slots only (recomputed by
    hand), and differs from full attention."""
    heads, r, p = 4, 32, 16
    setup = Setup("mla", 1, torch.float32, seed=12)
    batch = setup.batch([(100, 1), (60, 1)], ForwardMode.DECODE)
    backend = create_attention_backend("triton", num_sms=8)
    batch.attn_backend = backend
    batch.omnikv = state = setup.omnikv(batch, [0, 1], heads, r + p, 1)
    backend.init_forward_metadata(batch)
    outs = {}
    for layer_id in (1, 2):
        layer = AttentionLayer(layer_id, heads, 1, r + p, r, 0.37, kv_lora_rank=r, qk_rope_head_dim=p)
        backend.set_mla_kv(layer, batch, setup.rand(2, r), setup.rand(2, p))
        q_latent, q_pe = setup.rand(2, heads, r), setup.rand(2, heads, p)
        outs[layer_id] = (backend.forward_mla_absorb(q_latent, q_pe, layer, batch), q_latent, q_pe)
    out, q_latent, q_pe = outs[2]
    buf = setup.pool.kv_buffer[2]
    assert state.packed  # selected on the device; every row sparse: the view is as wide as the selections
    full = setup.req_pool.req_to_token[batch.req_pool_indices, :100].long()
    table, valid = state.decode_view(2, full, torch.arange(100, device=DEV)[None, :] < batch.seq_lens[:, None])
    assert table.shape == (2, SINK + BUDGET + RECENT) and bool(valid.all())
    for b in range(2):
        sel = state.slots(2, b)
        assert sel.numel() == SINK + BUDGET + RECENT
        for slots, same in ((sel, True), (setup.req_pool.req_to_token[int(batch.req_pool_indices[b]), :batch.seq_lens_cpu[b]].long(), False)):
            lat = buf[slots]
            probs = ((q_latent[b] @ lat[:, :r].T + q_pe[b] @ lat[:, r:].T) * 0.37).softmax(-1)
            assert torch.allclose(out[b], probs @ lat[:, :r], atol=2e-5) == same
