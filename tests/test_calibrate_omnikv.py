"""`mlaserve calibrate-omnikv` on tiny synthetic checkpoints: the table, the config it writes, the rule
it follows (placements scored by decoding retrieval probes), the recording against the OmniKV
reference (`kernels.attention.omnikv.importance`), the probes' score against full attention, the
search, and its errors."""

from __future__ import annotations

import inspect
import json
import os
import json.decoder
import json.encoder
import math
import re
from pathlib import Path

import pytest
import torch

from executor.model_runner import ModelRunner
from kernels.attention.omnikv import importance
from mlaserve.calibrate_omnikv import (
    FACT,
    MIN_GAP,
    MIN_TOKENS,
    CalibrationError,
    ProbeSet,
    build_parser,
    calibration_runner,
    fit_note,
    placements,
    probe_prompts,
    record_prefill,
    search_filter_layers,
)
from mlaserve.calibrate_omnikv import PROG
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
    table, ranking = (part.splitlines() for part in out.strip().split("\n\n"))
    header, *rows = table
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

    # the rule: the first filter layer at L // 5, the others every placement after it (3 apart, the
    # last at most L - 3), the one of lowest KL on the probes chosen; the ranking printed is the saved one
    fl = cfg.filter_layers
    assert cal["first_filter"] == fl[0] == LAYERS // 5
    best = cal["best"]
    assert cal["candidates"] == len(placements(LAYERS, fl[0], 2)) == 2  # 3 filter layers do not fit 8 layers
    assert tuple(best[0]["filter_layers"]) == fl
    assert [(b["kl"], b["filter_layers"]) for b in best] == sorted((b["kl"], b["filter_layers"]) for b in best)
    assert all(b["kl"] >= 0.0 and 0.0 <= b["agreement"] <= 1.0 for b in best)
    assert ranking[0].split() == ["filter_layers", "kl_on_probes", "agreement"]
    assert [r.split()[0] for r in ranking[1:]] == [",".join(map(str, b["filter_layers"])) for b in best]
    assert "filter layers" in err and str(output) in err and "only 2 of 3" in err


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


def test_placements_and_search():
    assert placements(12, 2, 3) == [(2, 5, 8), (2, 5, 9), (2, 6, 9)]
    assert placements(12, 2, 1) == [(2,)] and placements(8, 1, 3) == []
    assert placements(30, 6, 3, stride=4) == [(6, 9 + 4 * i, 9 + 4 * j) for i in range(5) for j in range(i + 1, 5)]
    target = (6, 13, 22)  # a score whose minimum the grid misses: the refinement must find it
    score = lambda c: sum((a - b) ** 2 for a, b in zip(c, target)) + 0.5 * len(c)  # noqa: E731
    best, scores = search_filter_layers(score, 30, 6, 3, max_candidates=20)
    assert best == target and len(scores) < len(placements(30, 6, 3)) == 136
    best, scores = search_filter_layers(score, 30, 6, 3, max_candidates=500)  # exhaustive
    assert best == target and len(scores) == 136
    best, _ = search_filter_layers(lambda c: 1.0, 30, 6, 3, max_candidates=500)
    assert best == (6, 9, 12)  # ties: the lexicographically first
    assert search_filter_layers(lambda c: 0.0, 8, 1, 3, 100)[0] == (1, 4)  # the most filter layers that fit
    for first in (0, 6):
        with pytest.raises(CalibrationError, match="--first-filter"):
            search_filter_layers(score, 8, first, 3, 100)


def _find(seq: list[int], sub: list[int]) -> int:
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub)


def test_probes_carry_the_fact_in_the_text_as_tokenised(checkpoint, text_file):
    loaded = load_model(checkpoint, dtype="float32", progress=False)
    tok = loaded.tokenizer
    ids = tok.encode(text_file.read_text(), add_special_tokens=False)[:600]
    prompts = probe_prompts(tok, ids, 3, 200)
    assert prompts == probe_prompts(tok, ids, 3, 200)  # seeded
    for i, p in enumerate(prompts):
        start = i * (len(ids) - 200) // 2
        window = ids[start : start + 200]
        at = int((i + 0.5) / 3 * 200)
        head = _find(p, window[:at]) + at  # the window's tokens as they were, not re-tokenised
        gap = _find(p[head:], window[at:])
        fact = tok.decode(p[head : head + gap])
        assert re.fullmatch(FACT.format(name="[a-z]+", code=r"\d{5}").strip(), fact.strip()), fact
        question = tok.decode(p[head + gap + len(window) - at :])
        assert f"access key for server {fact.split()[6]}?" in question


def test_probe_score_is_zero_when_the_selection_keeps_everything(checkpoint, text_file):
    """KL(full || OmniKV) of a plan whose budget covers the context is 0 and every greedy token agrees (the
    selection is then full attention, bit for bit); a small budget over a random model's flat attention
    moves the distributions."""
    loaded = load_model(checkpoint, dtype="float32", cpu_weights="file", progress=False)
    ids = loaded.tokenizer.encode(text_file.read_text(), add_special_tokens=False)[:400]
    prompts = probe_prompts(loaded.tokenizer, ids, 2, 300)
    full = OmniKVConfig(filter_layers=(1, 4), budget_ratio=1.0)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=2,
                         max_context_len=512, omnikv=full)
    try:
        probes = ProbeSet(runner, prompts, 6)
        free = runner.allocator.available_size()
        assert probes.score(full) == (0.0, 1.0)
        kl, agree = probes.score(OmniKVConfig(filter_layers=(1, 4), budget_tokens=4, sink_tokens=1, recent_tokens=2))
        assert kl > 1e-4 and 0.0 <= agree <= 1.0
        assert runner.allocator.available_size() == free  # the decoded tokens' slots go back every time
    finally:
        runner.close()


@pytest.mark.parametrize("case", ["missing", "short", "binary", "fifo", "device"])
def test_bad_text_exits_2_with_one_line(case, checkpoint, tmp_path, capsys):
    path = tmp_path / "text.txt"
    if case == "fifo":  # read forever (a hang), as /dev/zero (all the memory)
        os.mkfifo(path)
    elif case == "device":
        path = Path("/dev/zero")
    elif case == "short":
        path.write_text("def f(x):\n    return x + 1\n" * 4, encoding="utf-8")
    elif case == "binary":
        path.write_bytes(b"\xff\xfe\x00 not utf-8 \x80" * 100)
    code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(path), "--output",
                             str(tmp_path / "x.json"))
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith("mlaserve calibrate-omnikv: ")
    expect = {"missing": "does not exist", "short": f"at least {MIN_TOKENS}", "binary": "not UTF-8",
              "fifo": "not a regular file", "device": "not a regular file"}[case]
    assert expect in line
    assert not (tmp_path / "x.json").exists()


def test_too_shallow_model_exits_2(text_file, tmp_path, capsys):
    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=3, num_layers=3)
    code, _, err = run_cli(capsys, "--model", str(model), "--text", str(text_file), "--output",
                           str(tmp_path / "x.json"), "--max-tokens", str(TOKENS))
    assert code == 2 and "OmniKV needs at least 4" in err
    assert "prefilling" not in err and len(err.strip().splitlines()) == 1, err  # refused before any work


def test_a_first_filter_past_the_model_is_refused_before_the_prefill(checkpoint, text_file, tmp_path, capsys,
                                                                     monkeypatch):
    """The range was checked only after the recording prefill of the whole text."""
    import mlaserve.calibrate_omnikv as cal

    monkeypatch.setattr(cal, "record_prefill", lambda *a: pytest.fail("the prefill ran"))
    code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--output",
                             str(tmp_path / "x.json"), "--max-tokens", str(TOKENS), "--first-filter", "99")
    line = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and line.startswith(f"{PROG}: error: --first-filter 99 must be between 1 and"), err


def test_probes_beyond_memory_exit_2_before_the_prefill(checkpoint, text_file, tmp_path, capsys, monkeypatch):
    """`--probes` past what memory holds is one line naming the flags to lower, said before the recording
    prefill (it used to be torch's allocation error after it)."""
    import mlaserve.calibrate_omnikv as cal

    monkeypatch.setattr(cal, "record_prefill", lambda *a: pytest.fail("the prefill ran"))
    code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--output",
                             str(tmp_path / "x.json"), "--max-tokens", str(TOKENS), "--probes", "10000000")
    line = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and line.startswith(f"{PROG}: error: 10000000 probes"), err
    assert "lower --probes, --probe-tokens or --answer-tokens" in line and "GiB free" in line
    assert not (tmp_path / "x.json").exists()


def test_probes_too_short_to_drop_a_token_are_refused_before_the_prefill(checkpoint, text_file, tmp_path, capsys,
                                                                        monkeypatch):
    """A probe OmniKV keeps whole (sink + recent + budget cover it) ties every placement at KL 0: the choice was
    blind and reported as lossless. One line naming --probe-tokens, before the prefill; a length it names runs."""
    import mlaserve.calibrate_omnikv as cal

    real = cal.record_prefill
    monkeypatch.setattr(cal, "record_prefill", lambda *a: pytest.fail("the prefill ran"))
    args = ("--model", str(checkpoint), "--text", str(text_file), "--output", str(tmp_path / "x.json"),
            "--max-tokens", str(TOKENS), "--queries", str(QUERIES), "--probes", "1", "--answer-tokens", "2")
    code, out, err = run_cli(capsys, *args, "--probe-tokens", "1")
    line = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and "OmniKV keeps every token of a context that short" in line, err
    need = int(line.split("--probe-tokens ")[1].split()[0])
    assert "a probe needs more than" in line and not (tmp_path / "x.json").exists()
    monkeypatch.setattr(cal, "record_prefill", real)
    code, out, err = run_cli(capsys, *args, "--probe-tokens", str(need))
    assert code == 0, err


def test_only_a_prefix_of_a_long_text_is_tokenized(checkpoint, text_file):
    """The first tokens of a text, from a prefix of it: the whole text was tokenized (9 GB for 64 MiB)."""
    from mlaserve.calibrate_omnikv import leading_ids

    tok = load_model(checkpoint, dtype="float32", progress=False).tokenizer
    text = text_file.read_text() * 40
    seen = []
    real_encode = tok.encode

    class Counting:
        def encode(self, t):
            seen.append(len(t))
            return real_encode(t)

    whole = tok.encode(text)
    for count in (300, 2000, len(whole) + 5):
        seen.clear()
        assert leading_ids(Counting(), text, count) == whole[:count]
        assert (max(seen) < len(text) // 4) if count < len(whole) // 8 else max(seen) == len(text), (count, seen)


def test_default_output_name(checkpoint, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--max-tokens", "256",
                           "--queries", "4", "--filters", "1")
    assert code == 0, err
    cfg = OmniKVConfig.load(tmp_path / f"omnikv-{checkpoint.name}.json")
    assert len(cfg.filter_layers) == 1 and cfg.calibration["tokens"] == 256
    assert math.isclose(cfg.budget_ratio, 0.1)


def test_lookahead_sets_the_table_not_the_gap():
    """--lookahead spans the capability table only; the filter layers' least distance is MIN_GAP, and the
    help and the "only N of M fit" note say so with the numbers the search uses."""
    lookahead = " ".join(next(a.help for a in build_parser()._actions if "--lookahead" in a.option_strings).split())
    assert "least distance" not in lookahead and f"at least {MIN_GAP} apart whatever n is" in lookahead
    for layers, first in ((8, 1), (12, 2), (30, 6)):
        for c in placements(layers, first, 2):  # every gap allowed down to MIN_GAP, the last at most L - MIN_GAP
            assert c[1] - c[0] >= MIN_GAP and c[-1] <= layers - MIN_GAP
        assert min(c[1] - c[0] for c in placements(layers, first, 2)) == MIN_GAP
        assert max(c[-1] for c in placements(layers, first, 2)) == layers - MIN_GAP
    assert placements(8, 1, 3) == []  # so 2 of 3 fit, and the note says why in the search's terms
    assert fit_note(2, 3, 1, 8) == ("only 2 of 3 filter layers fit after layer 1 in 8 layers (each at least "
                                    f"{MIN_GAP} layers after the previous, the last at most layer {8 - MIN_GAP})")
    assert fit_note(2, 3, 2, 9).endswith("; a lower --first-filter leaves room for more")  # when there is a lower one


def deny_writes_in(folder, monkeypatch):
    """A folder this process may not write in (mode 0555; for root, whom modes do not stop, os.access says so)."""
    folder.mkdir(mode=0o555)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (Path(p).absolute() != folder and real(p, mode, **kw)
                                                             if mode & os.W_OK else real(p, mode, **kw)))


@pytest.mark.parametrize("case", ["directory", "no_parent", "parent_is_file", "read_only"])
def test_an_unwritable_output_is_refused_before_the_model_loads(case, text_file, tmp_path, capsys, monkeypatch):
    """Checked first: the model does not even exist here, and the run would take minutes before the write."""
    output = {"directory": tmp_path, "no_parent": tmp_path / "missing" / "o.json",
              "parent_is_file": tmp_path / "file" / "o.json", "read_only": tmp_path / "ro" / "o.json"}[case]
    if case == "parent_is_file":
        (tmp_path / "file").write_text("x")
    if case == "read_only":
        deny_writes_in(tmp_path / "ro", monkeypatch)
    code, out, err = run_cli(capsys, "--model", str(tmp_path / "no-such-model"), "--text", str(text_file),
                             "--output", str(output))
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith(f"{PROG}: error: --output {output}"), line
    expect = {"directory": "is a directory: give a file path", "no_parent": "does not exist; create it",
              "parent_is_file": "is not a directory", "read_only": "permission denied"}[case]
    assert expect in line, line


def test_an_output_the_file_system_refuses_is_refused_before_the_model_loads(text_file, tmp_path, capsys):
    """/proc takes no new files, whatever access() says (it says yes to root)."""
    output = Path("/proc/mlaserve-omnikv-test.json")
    code, out, err = run_cli(capsys, "--model", str(tmp_path / "no-such-model"), "--text", str(text_file),
                             "--output", str(output))
    line = err.strip()
    assert code == 2 and out == "" and "\n" not in line, err
    assert line.startswith(f"{PROG}: error: --output {output}") and "pass --output a writable path" in line, line
    assert not output.exists()


def test_an_existing_output_is_not_truncated_by_the_check(text_file, tmp_path, capsys):
    output = tmp_path / "kept.json"
    output.write_text('{"filter_layers": [1]}')
    code, _, err = run_cli(capsys, "--model", str(tmp_path / "no-such-model"), "--text", str(text_file),
                           "--output", str(output))
    assert code == 2 and "neither a built-in name" in err and output.read_text() == '{"filter_layers": [1]}'
    assert not list(tmp_path.glob("kept.json?*"))


def test_an_output_that_is_not_a_config_is_not_replaced(checkpoint, text_file, tmp_path, capsys):
    """--output naming the --text file (or any file but a config) replaced it with the config: the sample
    text was gone. Refused in one line before the model loads; so are empty paths, and a budget ratio of 1,
    which keeps every token (a traceback)."""
    before = text_file.read_bytes()
    for output in (text_file, ""):
        code, out, err = run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--output", str(output))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "not an OmniKV config" in run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file),
                                             "--output", str(text_file))[2]
    assert text_file.read_bytes() == before
    with pytest.raises(SystemExit) as e:
        run_cli(capsys, "--model", str(checkpoint), "--text", str(text_file), "--budget-ratio", "1")
    assert e.value.code == 2 and "must be in (0, 1)" in capsys.readouterr().err


def test_a_config_with_a_token_budget_may_leave_the_ratio_null():
    """A config written by calibrate-omnikv has `"budget_tokens": null`; switched to a token budget, its
    `"budget_ratio": null` was refused ("must be a number")."""
    cfg = OmniKVConfig.from_dict({"filter_layers": [1], "budget_ratio": None, "budget_tokens": 100})
    assert cfg.budget_tokens == 100
    for no_budget in ({"budget_ratio": None}, {"budget_ratio": None, "budget_tokens": None}):  # no budget at all
        with pytest.raises(ValueError, match="budget_ratio must be a number"):
            OmniKVConfig.from_dict({"filter_layers": [1], **no_budget})


def test_an_unwritable_default_output_is_refused_naming_it(text_file, tmp_path, capsys, monkeypatch):
    deny_writes_in(tmp_path / "ro", monkeypatch)
    monkeypatch.chdir(tmp_path / "ro")
    code, _, err = run_cli(capsys, "--model", "nope", "--text", str(text_file))
    assert code == 2 and err.strip() == (f"{PROG}: error: the default output omnikv-nope.json (in the current directory, "
                                         f"{tmp_path / 'ro'}): cannot create a file in {tmp_path / 'ro'} (permission "
                                         "denied); pass --output a writable path")


def test_a_bad_model_is_one_line(text_file, tmp_path, capsys):
    code, out, err = run_cli(capsys, "--model", str(tmp_path / "nope"), "--text", str(text_file), "--output",
                             str(tmp_path / "o.json"))
    assert code == 2 and out == "" and "\n" not in err.strip()
    assert err.startswith(f"{PROG}: error: model '{tmp_path / 'nope'}' is neither a built-in name"), err


def test_model_labels_name_what_a_config_was_calibrated_on() -> None:
    """A config records the model by this label, and a server compares it, ignoring case: a Hugging Face
    cache snapshot is its repository, not its revision hash."""
    from models.omnikv_config import model_label

    assert model_label("/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0123abc") == "SmolLM2-135M-Instruct"
    assert model_label("/models/ds8.GGUF") == "ds8" and model_label("/models/llama8/") == "llama8"
    assert model_label("smollm2-135m-instruct") == "smollm2-135m-instruct"
    from models.builtin import builtin_model_path  # the built-in model's file by path: the same model

    assert model_label(str(builtin_model_path("smollm2-135m-instruct"))) == "smollm2-135m-instruct"


def test_a_model_whose_attention_overflows_is_refused(text_file, tmp_path, capsys):
    """Weights so large that attention overflows (finite, 3e38) gave NaN coverages and KLs: the command chose
    blindly, printed `nan%` and 100% agreement, and wrote a config holding a bare NaN (not JSON). Refused."""
    from safetensors.torch import load_file, save_file

    model = write_checkpoint(tmp_path / "big", "tiny-llama", seed=17, num_layers=4)
    weights = load_file(str(model / "model.safetensors"))
    for name in weights:
        if "q_proj" in name or "k_proj" in name:
            weights[name] = torch.full_like(weights[name], 3e38)
    save_file(weights, str(model / "model.safetensors"))
    output = tmp_path / "omnikv.json"
    code, out, err = run_cli(capsys, "--model", str(model), "--text", str(text_file), "--output", str(output),
                             "--max-tokens", str(TOKENS), "--queries", str(QUERIES), "--probes", "2")
    assert code == 2 and "are not finite numbers (NaN or infinity)" in err.strip().splitlines()[-1], err
    assert not output.exists()
