"""`mlaserve calibrate-omnikv` on tiny synthetic checkpoints: the table, the config it writes, the rule
it follows, the recording against the OmniKV reference (`kernels.attention.omnikv.importance`), and
its errors."""

from __future__ import annotations

import inspect
import json
import json.decoder
import json.encoder
import math

import pytest
import torch

from kernels.attention.omnikv import importance
from mlaserve.calibrate_omnikv import (
    MIN_TOKENS,
    CalibrationError,
    calibration_runner,
    choose_filter_layers,
    record_prefill,
)
from mlaserve.cli import main
from models.loader.load import load_model
from models.omnikv_config import OmniKVConfig
from models.synthetic import load_preset, write_checkpoint

LAYERS = 8
PRESETS = ["tiny-llama", "tiny-deepseek-v2"]  # GQA (forward_extend) and MLA (forward_mla_normal)
TOKENS, QUERIES, LOOKAHEAD = 320, 8, 2


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Real text: the standard library's own json package source."""
    path = tmp_path_factory.mktemp("text") / "json_source.py"
    path.write_text("".join(inspect.getsource(m) for m in (json, json.decoder, json.encoder)), encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=PRESETS)
def checkpoint(request, tmp_path_factory):
    config = load_preset(request.param)
    if "first_k_dense_replace" in config:  # dense MLA layers: attention is what is measured, MoE only costs time
        config["first_k_dense_replace"] = LAYERS
    return write_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=17, num_layers=LAYERS)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["calibrate-omnikv", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_a_config_that_follows_the_rule(checkpoint, text_file, tmp_path, capsys):
    output = tmp_path / "omnikv.json"
    code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--output", str(output),
                             "--max-tokens", str(TOKENS), "--queries", str(QUERIES), "--lookahead", str(LOOKAHEAD),
                             "--filters", "3", "--budget-ratio", "0.2")
    assert code == 0, err
    header, *rows = out.strip().splitlines()
    assert header.split() == ["layer", "capability", "own_mass"]
    assert [int(r.split()[0]) for r in rows] == list(range(LAYERS))  # one line per layer
    assert rows[-1].split()[1] == "-"  # the last layer has no following layer

    cfg = OmniKVConfig.load(output)
    assert cfg.problems(LAYERS) == [] and cfg.budget_ratio == 0.2
    cal = cfg.calibration
    assert cal["model"] == checkpoint.name and cal["text"] == text_file.name
    assert (cal["tokens"], cal["queries"], cal["lookahead"]) == (TOKENS, QUERIES, LOOKAHEAD)
    cap = cal["capability"]
    assert len(cap) == LAYERS and cap[-1] is None and all(0.0 < c <= 1.0 + 1e-6 for c in cap[:-1])
    for row, c, own in zip(rows, cap, cal["own_mass"]):  # the printed table is the saved one
        assert row.split()[1] == ("-" if c is None else f"{c:.4f}") and row.split()[2] == f"{own:.4f}"
        assert ("filter" in row.split()) == (int(row.split()[0]) in cfg.filter_layers)

    # the rule: candidates 1..L-3; the first is the earliest within the tolerance of the best; the
    # others come after it by capability, LOOKAHEAD apart
    fl = cfg.filter_layers
    candidates = range(1, LAYERS - 2)
    assert 1 <= len(fl) <= 3 and all(f in candidates for f in fl)
    best = max(cap[c] for c in candidates)
    assert fl[0] == min(c for c in candidates if cap[c] >= round(best - cal["tolerance"], 4))
    assert all(b - a >= LOOKAHEAD for a, b in zip(fl, fl[1:]))
    assert fl == choose_filter_layers(cap, 3, LOOKAHEAD, cal["tolerance"])
    assert "filter layers" in err and str(output) in err


def test_recording_matches_the_omnikv_reference(checkpoint, text_file):
    """A recorded P_l row sums to 1 per head, and its max over heads is `importance` of the last query —
    for MLA against the latent cache with the absorbed query, which the recording never computes."""
    loaded = load_model(checkpoint, dtype="float32", progress=False)
    ids = loaded.tokenizer.encode(text_file.read_text())[:TOKENS]
    layer = LAYERS // 2
    runner = calibration_runner(loaded, len(ids))
    try:
        rec = record_prefill(runner, ids, QUERIES, keep_layers=[layer])
        probs = rec.probs[layer]  # [Q, H, n]
        n = len(ids)
        assert probs.shape[0] == QUERIES and probs.shape[2] == n
        assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:2]), atol=1e-5)
        assert torch.allclose(rec.head_mean[layer].sum(-1), torch.ones(QUERIES), atol=1e-5)
        assert rec.positions == list(range(n - QUERIES, n))
        first = rec.positions[0]
        assert float(probs[0, :, first + 1:].abs().max()) == 0.0  # causal: nothing after the query

        slots = runner.req_to_token_pool.req_to_token[rec.req_pool_idx, :n].long()
        q_last = rec.q[layer][-1]  # [H, D]
        attn = loaded.model.model.layers[layer].self_attn
        if hasattr(attn, "w_kc"):  # MLA: q_latent = q_nope · w_kc, against c_kv ‖ k_pe (one row for all heads)
            q_nope, q_pe = q_last.split([attn.nope_dim, attn.rope_dim], dim=-1)
            q_abs = torch.cat([torch.einsum("hn,hnr->hr", q_nope, attn.w_kc.float()), q_pe], dim=-1)
            keys = runner.kv_pool.get_kv_buffer(layer)[slots][:, None, :]
        else:
            q_abs, keys = q_last, runner.kv_pool.get_kv_buffer(layer)[0][slots]
        ref = importance(q_abs[None], keys, [n - 1], [1.0], rec.scale[layer])
        assert torch.allclose(rec.max_head[layer][-1], ref, atol=1e-5)
        assert torch.allclose(probs[-1].amax(0), ref, atol=1e-5)
    finally:
        runner.close()


def test_choose_filter_layers_rule():
    cap = [0.5, 0.90, 0.95, 0.96, 0.80, 0.97, 0.93, 0.99, 0.92, 0.90, None]  # 11 layers: candidates 1..8
    # best 0.99 (layer 7); the earliest within 0.02 of it is 5 (0.97, exactly at the edge); after it
    # 7 is the most capable, and 6 and 8 are closer than 2 to a chosen layer (9 is no candidate)
    assert choose_filter_layers(cap, 3, 2, tolerance=0.02) == (5, 7)
    assert choose_filter_layers(cap, 3, 2, tolerance=0.05) == (2, 5, 7)
    assert choose_filter_layers(cap, 3, 1, tolerance=0.0) == (7, 8)  # only what lies after the first
    assert choose_filter_layers(cap, 1, 2, tolerance=0.1) == (1,)
    with pytest.raises(CalibrationError, match="at least 4"):
        choose_filter_layers([0.9, 0.9, None], 2, 1)


@pytest.mark.parametrize("case", ["missing", "short", "binary"])
def test_bad_text_exits_2_with_one_line(case, checkpoint, tmp_path, capsys):
    path = tmp_path / "text.txt"
    if case == "short":
        path.write_text("def f(x):\n    return x + 1\n" * 4, encoding="utf-8")
    elif case == "binary":
        path.write_bytes(b"\xff\xfe\x00 not utf-8 \x80" * 100)
    code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(path), "--output",
                             str(tmp_path / "x.json"))
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith("mlaserve calibrate-omnikv: ")
    expect = {"missing": "does not exist", "short": f"at least {MIN_TOKENS}", "binary": "not UTF-8"}[case]
    assert expect in line
    assert not (tmp_path / "x.json").exists()


def test_too_shallow_model_exits_2(text_file, tmp_path, capsys):
    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=3, num_layers=3)
    code, _, err = run_cli(capsys, "--model", str(model), "--text", str(text_file), "--output",
                           str(tmp_path / "x.json"), "--max-tokens", str(TOKENS))
    assert code == 2 and "OmniKV needs at least 4" in err


def test_default_output_name(checkpoint, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--max-tokens", "256",
                           "--queries", "4", "--filters", "1")
    assert code == 0, err
    cfg = OmniKVConfig.load(tmp_path / f"omnikv-{checkpoint.name}.json")
    assert len(cfg.filter_layers) == 1 and cfg.calibration["tokens"] == 256
    assert math.isclose(cfg.budget_ratio, 0.1)
