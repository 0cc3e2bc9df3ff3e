"""OmniKV's torch reference (kernels/attention/omnikv.py) and its wiring into the torch attention path.

Oracles: the selection rule checked against a naive per-head loop written from the definition in
models/omnikv_config.py; whole-model outputs against HF transformers' Llama and DeepSeek-V2/V3 (a
selection that keeps every token must give exactly full attention's greedy tokens); a sparse
layer's output against attention recomputed by hand over the selected rows only."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from executor.model_runner import ModelRunner, RequestSlice
from kernels.attention.omnikv import QueryHistory, importance, select_positions
from models.loader.load import load_model
from models.omnikv_config import FILTER, FULL, SPARSE, OmniKVConfig
from tests.hf_models import hf_greedy, save_hf_models


# ---------------------------------------------------------------- the config and its plan
def test_plan_roles():
    cfg = OmniKVConfig(filter_layers=(2, 5))
    plan = cfg.plan(9)
    assert plan.roles == (FULL, FULL, FILTER, FULL, SPARSE, FILTER, FULL, SPARSE, SPARSE)
    assert plan.source == (-1, -1, -1, -1, 0, -1, -1, 1, 1)
    tight = OmniKVConfig(filter_layers=(1,), full_after_filter=False).plan(4)
    assert tight.roles == (FULL, FILTER, SPARSE, SPARSE) and tight.source == (-1, -1, 0, 0)


@pytest.mark.parametrize("bad, words", [
    (dict(filter_layers=()), "1 to 3"), (dict(filter_layers=(1, 2, 3, 4)), "1 to 3"),
    (dict(filter_layers=(3, 1)), "ascending"), (dict(filter_layers=(1,), budget_ratio=0.0), "budget_ratio"),
    (dict(filter_layers=(1,), window=17), "window"), (dict(filter_layers=(1,), alpha="max"), "alpha"),
    (dict(filter_layers=(1,), recent_tokens=0), "recent_tokens"), (dict(filter_layers=(1,), budget_tokens=0), "budget_tokens"),
    # wrong JSON types, once read as something else (1.5 -> a crash mid-decode, "no" -> True, "6" -> [6])
    (dict(filter_layers=(1,), budget_tokens=1.5), "budget_tokens must be an integer"),
    (dict(filter_layers=(1,), budget_tokens=True), "budget_tokens must be an integer"),
    (dict(filter_layers=(1,), window=2.5, alpha="uniform"), "window must be an integer"),
    (dict(filter_layers=(1,), full_after_filter="no"), "full_after_filter must be true or false"),
    (dict(filter_layers="6"), "filter_layers must be a list"), (dict(filter_layers=[6.9, 17.2]), "filter_layers must be a list"),
    (dict(filter_layers=(1,), sink_tokens=2.5), "sink_tokens must be an integer"),
    (dict(filter_layers=(1,), budget_ratio="0.1"), "budget_ratio must be a number"),
    (dict(filter_layers=(1,), alpha=1), "alpha must be a string"),
    # past int64, the native call's argument type, it used to fail only when the engine started
    (dict(filter_layers=(1,), sink_tokens=10**23), "sink_tokens must be at most"),
    (dict(filter_layers=(1,), recent_tokens=2**63), "recent_tokens must be at most"),
    (dict(filter_layers=(1,), budget_tokens=2**31), "budget_tokens must be at most"),
    (dict(filter_layers=(1,), min_context=2**40), "min_context must be at most"),
])
def test_config_refuses_bad_settings(bad, words):
    with pytest.raises(ValueError, match=words):
        OmniKVConfig(**bad)


def test_config_file_round_trip_and_errors(tmp_path):
    cfg = OmniKVConfig(filter_layers=(1, 4), budget_tokens=300, window=8, alpha="exponential")
    path = tmp_path / "omnikv.json"
    cfg.save(path)
    assert OmniKVConfig.load(path) == cfg
    with pytest.raises(ValueError, match="outside the model"):
        cfg.plan(4)
    path.write_text('{"filter_layers": [1], "budget": 3}')
    with pytest.raises(ValueError, match="unknown field"):
        OmniKVConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        OmniKVConfig.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        OmniKVConfig.load(tmp_path / "missing.json")
    path.write_text("[" * 100_000 + "]" * 100_000)  # past the JSON parser's recursion limit
    with pytest.raises(ValueError, match="nests too deeply"):
        OmniKVConfig.load(path)
    path.write_bytes(b'{"filter_layers": [1], "alpha": "\xff"}')
    with pytest.raises(ValueError, match=f"{path} is not UTF-8"):
        OmniKVConfig.load(path)
    path.write_text('\ufeff{"filter_layers": [1, 4], "budget_tokens": 300, "window": 8, "alpha": "exponential"}')
    assert OmniKVConfig.load(path) == cfg  # a byte-order mark, as some editors write
    for special in (Path("/dev/zero"), tmp_path / "fifo"):  # read forever: memory, or a hang
        if special.name == "fifo":
            os.mkfifo(special)
        with pytest.raises(ValueError, match="not a regular file"):
            OmniKVConfig.load(special)
    path.write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="over 1 MiB"):
        OmniKVConfig.load(path)


def test_alpha_weights_and_budget():
    exp = OmniKVConfig(filter_layers=(1,), alpha="exponential", window=4)
    assert exp.alpha_weights(3) == [0.25, 0.5, 1.0]
    assert OmniKVConfig(filter_layers=(1,), alpha="uniform", window=4).alpha_weights(2) == [1.0, 1.0]
    assert OmniKVConfig(filter_layers=(1,)).alpha_weights(1) == [1.0]
    assert OmniKVConfig(filter_layers=(1,), budget_ratio=0.1).budget_for(1001) == math.ceil(100.1)
    cfg = OmniKVConfig(filter_layers=(1,), budget_ratio=0.1, sink_tokens=4, recent_tokens=64)
    assert not cfg.is_sparse_for(70) and cfg.is_sparse_for(1000)


# ---------------------------------------------------------------- the selection rule
def naive_importance(q, keys, q_pos, weights, scale):
    """The definition, one (query, head, key) at a time."""
    w, h, d = q.shape
    n, hkv = keys.shape[:2]
    group = h // hkv
    out = [0.0] * n
    for i in range(w):
        best = [0.0] * n
        for head in range(h):
            seen = range(q_pos[i] + 1)
            s = [float(q[i, head] @ keys[j, head // group]) * scale for j in seen]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = sum(e)
            for j in seen:
                best[j] = max(best[j], e[j] / z)
        for j in range(n):
            out[j] += weights[i] * best[j]
    return torch.tensor(out)


@pytest.mark.parametrize("h, hkv, d", [(4, 2, 8), (6, 1, 12)])  # GQA; MLA-like (one latent row for all heads)
def test_importance_matches_the_definition(h, hkv, d):
    g = torch.Generator().manual_seed(h * 10 + d)
    n = 23
    q = torch.randn(3, h, d, generator=g)
    keys = torch.randn(n, hkv, d, generator=g)
    q_pos, weights = [18, 20, 22], [0.25, 0.5, 1.0]
    got = importance(q, keys, q_pos, weights, 0.3)
    assert torch.allclose(got, naive_importance(q, keys, q_pos, weights, 0.3), atol=1e-6)


def test_select_positions_rule():
    imp = torch.tensor([9.0, 0.1, 0.5, 0.5, 0.2, 0.9, 0.5, 0.3, 0.0, 0.0])
    # sink 1, recent 2: candidates 1..7; top-3 = 5 (0.9), then the tie at 0.5 goes to 2 and 3
    assert select_positions(imp, 3, 1, 2).tolist() == [0, 2, 3, 5, 8, 9]
    assert select_positions(imp, 7, 1, 2).tolist() == list(range(10))  # k covers every candidate
    assert select_positions(imp[:3], 1, 4, 64).tolist() == [0, 1, 2]  # shorter than sink + recent
    assert select_positions(imp, 0, 0, 1).tolist() == [9]


def test_query_history_window():
    hist = QueryHistory(rows=3, num_filters=2, window=4, num_heads=2, head_dim=3, device="cpu")
    for pos in (4, 5, 6, 8, 9):
        hist.record(1, 2, pos, torch.full((2, 3), float(pos)))
    q, got = hist.window_of(1, 2, 9)
    assert got == [6, 8, 9] and q[:, 0, 0].tolist() == [6.0, 8.0, 9.0]  # 4 and 5 fell out, 7 was never recorded
    hist.clear(2)
    hist.record(1, 2, 9, torch.ones(2, 3))
    assert hist.window_of(1, 2, 9)[1] == [9]


# ---------------------------------------------------------------- the torch path, end to end
LAYERS = 6
MODELS = ["llama_gqa_tied", "v2_lite_yarn_grouped", "v3_noaux_yarn"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_hf_models(tmp_path_factory, MODELS, 40, num_hidden_layers=LAYERS)


def runner_for(path, cfg: OmniKVConfig | None) -> ModelRunner:
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=4, omnikv=cfg)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("alpha", ["last_token", "exponential"])
def test_selection_of_everything_is_full_attention(checkpoints, name, alpha, monkeypatch):
    """Budget >= context: every row goes through the sparse machinery (forced), selects everything, and
    the greedy tokens are HF's."""
    hf, path = checkpoints[name]
    cfg = OmniKVConfig(filter_layers=(1, 3), budget_tokens=10_000, sink_tokens=2, recent_tokens=3, alpha=alpha, window=4)
    monkeypatch.setattr(OmniKVConfig, "is_sparse_for", lambda self, n: True)
    runner = runner_for(path, cfg)
    ids = prompt(40, hf.config.vocab_size, seed=3)
    assert runner.generate_greedy(ids, 12, omnikv=True) == hf_greedy(hf, ids, 12)
    c = runner.omnikv_counters
    assert c.sparse_tokens == 11 and c.selected_tokens == c.context_tokens > 0


@pytest.mark.parametrize("name", MODELS)
def test_sparse_layer_attends_to_its_selection_only(checkpoints, name):
    """A real budget: the selection is what the rule picks from the filter layer's attention, and a
    sparse layer's output equals attention recomputed by hand over the selected rows."""
    _, path = checkpoints[name]
    cfg = OmniKVConfig(filter_layers=(1,), budget_tokens=6, sink_tokens=2, recent_tokens=4)
    runner = runner_for(path, cfg)
    ids = prompt(60, 320, seed=4)
    row = runner.req_to_token_pool.alloc()
    runner.forward(runner.build_batch([RequestSlice(row, 0, ids)]))
    batch = runner.build_batch([RequestSlice(row, len(ids), [7], omnikv=True)])
    seen: dict[int, tuple] = {}
    backend = runner.attn_backend
    for method in ("forward_decode", "_mla_decode"):
        orig = getattr(backend, method)

        def spy(*args, _orig=orig, **kw):
            out = _orig(*args, **kw)
            layer = next(a for a in args if hasattr(a, "layer_id"))
            seen[layer.layer_id] = (args, out)
            return out

        setattr(backend, method, spy)
    runner.forward(batch)
    sel = batch.omnikv.selected[0][0]
    assert sel.numel() == 2 + 6 + 4 and batch.omnikv.context_tokens == 61
    assert sel.tolist() == sorted(sel.tolist()) and int(sel[-1]) == int(runner.req_to_token_pool.req_to_token[row, 60])
    args, out = seen[3]  # layer 3: SPARSE (layer 2 is the full one after the filter)
    layer = next(a for a in args if hasattr(a, "layer_id"))
    pool = runner.kv_pool
    if "v2" in name or "v3" in name:
        q_latent, q_pe = args[0], args[1]
        lat = pool.get_kv_buffer(3)[sel].float()
        r = layer.kv_lora_rank
        s = (q_latent[0].float() @ lat[:, :r].T + q_pe[0].float() @ lat[:, r:].T) * layer.scaling
        ref = s.softmax(-1) @ lat[:, :r]
    else:
        q = args[0]
        k_buf, v_buf = pool.get_kv_buffer(3)
        k, v = k_buf[sel].float(), v_buf[sel].float()  # [n, Hkv, D]
        g = layer.num_heads // layer.num_kv_heads
        s = torch.einsum("hd,nhd->hn", q[0].float(), k.repeat_interleave(g, dim=1)) * layer.scaling
        ref = torch.einsum("hn,nhd->hd", s.softmax(-1), v.repeat_interleave(g, dim=1))
    assert torch.allclose(out[0].float(), ref, atol=1e-5)
    runner.free_request(row, 61)


def test_uncalibrated_default_leaves_a_sparse_layer():
    """The default for a model nobody calibrated decodes some layer sparsely at every depth from 2 layers
    (a 2- to 4-layer model used to get filter layers that left none, so OmniKV changed nothing), and
    keeps the rule (a fifth of the depth, the middle) where the depth allows it."""
    for layers in range(2, 80):
        cfg = OmniKVConfig.default_for(layers)
        assert SPARSE in cfg.plan(layers).roles, layers
    assert OmniKVConfig.default_for(27).filter_layers == (5, 13) and OmniKVConfig.default_for(6).filter_layers == (1, 3)
    assert OmniKVConfig.default_for(2) == OmniKVConfig(filter_layers=(0,), full_after_filter=False)
