"""GGUF files: `write_gguf` writes them, `GGUFCheckpoint` reads them, oracles nobody here wrote judge.

Oracles: HF transformers builds the checkpoints (its safetensors files are the truth for tensors, its
config.json for the config); the `gguf` package writes the hand-made files of the malformed-file
tests and, with its reference quantizer and `GGUFReader`, checks tensor types and quantized data;
transformers' own GGUF loader supplies the q/k un-permutation checked on the real SmolLM2 file;
llama.cpp (llama-cpp-python, skipped when absent) loads written files and its logits must match HF's.

Config fields a GGUF cannot carry (the reader assumes them; `_UNCARRIED` leaves them out of the
comparison): DeepSeek ``moe_layer_freq`` (llama.cpp has no key: 1), ``rope.mscale`` (only
``mscale_all_dim`` is stored; the reader sets mscale equal to it, as in released V2/V3),
``rope.truncate``, ``attention_bias`` (no MLA biases in llama.cpp); for V2, ``topk_method`` is
inferred (``group_limited_greedy`` iff n_group > 1). Llama 3 RoPE keeps only its per-frequency
divisors (``rope_freqs``), so its original context length is read back as 8192 with low/high
factors fitted to match; end-of-generation ids beyond eos/eot/eom are dropped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.config import config_from_hf_dict
from models.loader import gguf_loader
from models.loader.errors import CheckpointError
from models.loader.gguf_loader import GGUFCheckpoint
from models.loader.gguf_writer import write_gguf
from models.loader.load import load_model
from executor.model_runner import ModelRunner
from tests.llama_cpp_oracle import open_llama

_UNCARRIED = {"DeepseekConfig": ("moe.moe_layer_freq", "rope.mscale", "rope.truncate", "attention_bias"),
              "LlamaConfig": ("rope.truncate",)}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
         "beta_fast": 32.0, "beta_slow": 1.0}
_DEEPSEEK = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=2048)
_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
# name -> (transformers class names, config kwargs, save_pretrained kwargs)
_CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("Llama", dict(_LLAMA, max_position_embeddings=16384, attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), {}),
    "llama_tied_sharded": ("Llama", dict(_LLAMA, tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), {"max_shard_size": "60KB"}),
    "qwen2": ("Qwen2", dict(_LLAMA, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False), {}),
    "qwen3": ("Qwen3", dict(_LLAMA, head_dim=24, rope_theta=1000000.0), {}),
    "qwen3_moe": ("Qwen3Moe", dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, rope_theta=1000000.0), {}),
    "mixtral": ("Mixtral", dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), {}),
    "qwen2_moe": ("Qwen2Moe", dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, norm_topk_prob=False), {}),
    "glm4_moe": ("Glm4Moe", dict(_LLAMA, head_dim=32, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                                 rope_theta=1000000.0, moe_intermediate_size=32, n_routed_experts=4,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                 topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5), {}),
    "glm4_moe_lite": ("Glm4MoeLite", dict(_DEEPSEEK, q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True,
                                          routed_scaling_factor=1.8, rope_theta=1000000.0), {}),
    "v2_lite": ("DeepseekV2", dict(_DEEPSEEK, q_lora_rank=None, n_group=2, topk_group=1,
                                   topk_method="group_limited_greedy",
                                   rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707)), {}),
    "v2_q_lora_tied": ("DeepseekV2", dict(_DEEPSEEK, q_lora_rank=24, tie_word_embeddings=True), {}),
    "v3": ("DeepseekV3", dict(_DEEPSEEK, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=2.5, rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0)), {}),
}


# ----------------------------------------------------------------------------- HF checkpoints


def _write_tokenizer(d: Path) -> tuple[int, int]:
    """A tiny byte-level BPE (GPT-2 style) with <s>/</s>; returns their ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"the quick brown fox jumps over the lazy dog {i} times" for i in range(40)], trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return tok.token_to_id("<s>"), tok.token_to_id("</s>")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Fresh random weights everywhere: norms 1 + N(0, 0.1), vectors N(0, 0.1), matrices N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1 + 0.1 * r if "norm" in name else 0.1 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    out = {}
    for i, (name, (family, kwargs, save_kwargs)) in enumerate(_CASES.items()):
        d = tmp_path_factory.mktemp(name)
        bos, eos = _write_tokenizer(d)
        config = getattr(transformers, f"{family}Config")(**kwargs, bos_token_id=bos, eos_token_id=eos)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        _randomize(model, seed=i)
        model.save_pretrained(d, **save_kwargs)
        out[name] = d
    return out


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    """The saved HF tensors, per-expert ones stacked as the reader yields them."""
    flat: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            flat.update({k: h.get_tensor(k) for k in h.keys()})
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in flat.items():
        # Mixtral's files: transformers' conversion mapping reads block_sparse_moe.experts.N.w1 and w3 as the
        # gate and up halves, w2 as down; Qwen2-MoE's one shared_expert is the shared experts' MLP
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            name = name.replace(old, new) if ".mlp.experts." in name else name
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:
            e, rest = tail.split(".", 1)
            experts.setdefault(f"{head}.mlp.experts.{rest}", {})[int(e)] = t
        else:
            out[name] = t
    out.update({k: torch.stack([v[e] for e in range(len(v))]) for k, v in experts.items()})
    return out


def _comparable(cfg):
    """`cfg` with the fields GGUF cannot carry set to None."""
    for path in _UNCARRIED[type(cfg).__name__]:
        head, _, field = path.rpartition(".")
        parent = getattr(cfg, head) if head else cfg
        if parent is None:
            continue
        parent = dataclasses.replace(parent, **{field: None})
        cfg = dataclasses.replace(cfg, **{head: parent}) if head else parent
    return cfg


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("case", list(_CASES))
def test_f32_round_trip_equals_hf(hf_dirs: dict[str, Path], tmp_path: Path, case: str) -> None:
    d = hf_dirs[case]
    ck = GGUFCheckpoint(write_gguf(d, tmp_path / "m.gguf"))
    got = dict(ck.tensors())
    want = _hf_tensors(d)
    assert sorted(got) == sorted(want)
    assert ck.num_tensors() == len(got)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    hf_cfg = config_from_hf_dict(json.loads((d / "config.json").read_text()))
    gguf_cfg = config_from_hf_dict(ck.hf_config())
    assert _comparable(gguf_cfg) == _comparable(hf_cfg)
    if hasattr(gguf_cfg, "moe") and gguf_cfg.moe is not None:  # the values assumed for what is not stored
        assert gguf_cfg.moe.moe_layer_freq == 1 and gguf_cfg.rope.mscale == gguf_cfg.rope.mscale_all_dim
    text = "the lazy dog jumps 3 times!"
    want_ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
    assert ck.tokenizer().encode(text, add_special_tokens=False) == want_ids


def test_hf_saved_moe_layer_freq_converts_as_transformers_computes(tmp_path: Path) -> None:
    """transformers ignores `moe_layer_freq` and saves experts in every layer after the dense lead: the file
    is converted as saved (it was refused: llama.cpp has no key for the frequency) and computes as HF."""
    import transformers

    from tests.models.test_hf_parity import prefill_logits, prompt, rel_err

    d = tmp_path / "hf"
    d.mkdir()
    bos, eos = _write_tokenizer(d)
    config = transformers.DeepseekV2Config(**dict(_DEEPSEEK, q_lora_rank=None, moe_layer_freq=2),
                                           bos_token_id=bos, eos_token_id=eos)
    hf = transformers.DeepseekV2ForCausalLM(config).float().eval()
    _randomize(hf, seed=7)
    hf.save_pretrained(d)
    ids = prompt(24, 320, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    loaded = load_model(write_gguf(d, tmp_path / "m.gguf"), dtype="float32", load_tokenizer=False, progress=False)
    assert loaded.config.moe.moe_layer_freq == 1
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=64, max_running_requests=2)
    assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4


def test_deepseek_file_layout_follows_llama_cpp(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Keys and tensors as llama.cpp's converter writes them (checked with its converter offline)."""
    r = gguf.GGUFReader(write_gguf(hf_dirs["v3"], tmp_path / "m.gguf"))
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.architecture"] == "deepseek2"
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length"] == 32 + 8 and kv["deepseek2.attention.value_length"] == 32
    assert kv["deepseek2.attention.key_length_mla"] == 24 and kv["deepseek2.attention.value_length_mla"] == 24
    assert kv["deepseek2.expert_gating_func"] == 2 and kv["deepseek2.leading_dense_block_count"] == 1
    assert kv["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    shapes = {t.name: list(t.shape) for t in r.tensors}  # ggml ne order
    assert shapes["blk.1.attn_k_b.weight"] == [16, 32, 4] and shapes["blk.1.attn_v_b.weight"] == [32, 24, 4]
    assert shapes["blk.1.ffn_gate_exps.weight"] == [64, 32, 4] and shapes["blk.1.ffn_down_exps.weight"] == [32, 64, 4]
    assert "blk.1.exp_probs_b.bias" in shapes and "blk.0.attn_kv_b.weight" not in shapes
    assert len(kv["tokenizer.ggml.tokens"]) == 320  # padded to the embedding rows, as llama.cpp needs


def test_fused_hf_v5_experts_give_the_same_file_contents(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = hf_dirs["v3"]
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (fused_dir / f.name).write_bytes(f.read_bytes())
    tensors = _hf_tensors(src)
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.cat([tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]], dim=1)
        out[p + "down_proj"] = tensors[p + "down_proj.weight"]
    save_file(out, str(fused_dir / "model.safetensors"))
    a = dict(GGUFCheckpoint(write_gguf(src, tmp_path / "a.gguf")).tensors())
    b = dict(GGUFCheckpoint(write_gguf(fused_dir, tmp_path / "b.gguf")).tensors())
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _rewrite(src: Path, dst: Path, kv: dict, tensors: dict[str, np.ndarray | None], split_max_tensors: int = 0) -> Path:
    """Copies GGUF `src` to `dst` with `gguf`'s reader and writer: `kv` overrides metadata (None
    drops a key), `tensors` replaces or adds tensors (None drops one). `split_max_tensors`: the writer
    splits the model into files of that many tensors as llama.cpp's converter does (`dst` then names the
    set: `<stem>-00001-of-0000N.gguf` and on)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents(), split_max_tensors=split_max_tensors)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = kv.get(key, f.contents())
        if value is not None:
            w.add_key_value(key, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for key, value in kv.items():
        if key not in r.fields and value is not None:
            w.add_uint32(key, value)
    for t in r.tensors:
        if t.name not in tensors:  # (quantized: the blocks as bytes, their shape and type given)
            w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        if data is not None:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_reads_legacy_kv_b_and_fused_gate_up_forms(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Older llama.cpp files keep kv_b_proj whole (no *_mla keys); --fuse-gate-up-exps fuses experts."""
    d = hf_dirs["v3"]
    new = gguf.GGUFReader(write_gguf(d, tmp_path / "new.gguf"))
    data = {t.name: np.array(t.data) for t in new.tensors}
    want = _hf_tensors(d)
    changes: dict[str, np.ndarray | None] = {}
    for i in range(3):
        changes[f"blk.{i}.attn_k_b.weight"] = changes[f"blk.{i}.attn_v_b.weight"] = None
        changes[f"blk.{i}.attn_kv_b.weight"] = want[f"model.layers.{i}.self_attn.kv_b_proj.weight"].numpy()
    for i in (1, 2):
        gate, up = data.pop(f"blk.{i}.ffn_gate_exps.weight"), data.pop(f"blk.{i}.ffn_up_exps.weight")
        changes[f"blk.{i}.ffn_gate_exps.weight"] = changes[f"blk.{i}.ffn_up_exps.weight"] = None
        changes[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    kv = {"deepseek2.attention.key_length_mla": None, "deepseek2.attention.value_length_mla": None,
          "deepseek2.attention.key_length": 24, "deepseek2.attention.value_length": 24}
    ck = GGUFCheckpoint(_rewrite(new.data.filename, tmp_path / "old.gguf", kv, changes))
    got = dict(ck.tensors())
    assert sorted(got) == sorted(want) and ck.num_tensors() == len(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    hf_cfg = config_from_hf_dict(json.loads((d / "config.json").read_text()))
    assert _comparable(config_from_hf_dict(ck.hf_config())) == _comparable(hf_cfg)


def _split(hf_dir: Path, tmp_path: Path, per_file: int, qtype: str = "Q8_0") -> tuple[Path, list[Path]]:
    """A model written whole, and the same split by the `gguf` package's writer into files of `per_file`
    tensors (llama.cpp's converter's `--split-max-tensors`): (the whole file, the split files in order)."""
    whole = write_gguf(hf_dir, tmp_path / "whole.gguf", qtype)
    (tmp_path / "split").mkdir()
    _rewrite(whole, tmp_path / "split" / "m.gguf", {}, {}, split_max_tensors=per_file)
    return whole, sorted((tmp_path / "split").glob("m-*-of-*.gguf"))


def test_a_split_model_reads_as_the_whole_file(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A model split into several files (as large GGUFs come: each file its own header and tensors, the first
    the metadata) is read from its first file with the same config and the same tensors, decoded or as raw
    expert blocks, as the whole file; llama.cpp reads both alike too (skipped where it is absent)."""
    whole, parts = _split(hf_dirs["v3"], tmp_path, per_file=9)
    assert len(parts) >= 3
    a, b = GGUFCheckpoint(whole), GGUFCheckpoint(parts[0])
    assert b.paths == parts and a.hf_config() == b.hf_config() and a.num_tensors() == b.num_tensors()
    for raw in (False, True):
        want = dict(a.tensors(raw_experts=raw))
        got = dict(b.tensors(raw_experts=raw))
        assert sorted(got) == sorted(want)
        for name, t in got.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, want[name]), name
            else:
                assert t.shape == want[name].shape and np.array_equal(np.asarray(t.data), np.asarray(want[name].data))
    from models.omnikv_config import model_label

    assert model_label(str(parts[0])) == "m" and model_label(str(whole)) == "whole"
    upper = tmp_path / "upper"  # the parts named as written, in capitals too
    upper.mkdir()
    for p in parts:
        (upper / p.name.replace(".gguf", ".GGUF")).symlink_to(p)
    assert len(GGUFCheckpoint(upper / parts[0].name.replace(".gguf", ".GGUF")).paths) == len(parts)
    if importlib.util.find_spec("llama_cpp") is not None:
        ids = [0, 5, 17, 44, 100, 250, 33, 7]
        scores = []
        for path in (whole, parts[0]):
            llm = open_llama(path, n_ctx=32, logits_all=True, verbose=False, n_threads=2)
            llm.eval(ids)
            scores.append(np.array(llm.scores[: len(ids)]))
        assert np.array_equal(scores[0], scores[1])


def test_a_split_model_given_or_kept_wrong_says_which_file(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Another part than the first names the first; a missing part, a part of another split and a count of
    tensors that does not add up are refused naming the file at fault (the checks before the server binds
    read the same)."""
    from server.args import model_problem

    _, parts = _split(hf_dirs["llama"], tmp_path, per_file=6, qtype="F32")
    n = len(parts)
    msg = _fails(parts[1], f"the file is part 2 of a model split into {n} files: give the first, {parts[0].name}")
    assert model_problem(str(parts[1])) == f"cannot load the model {parts[1]}: " + msg.removeprefix(f"{parts[1]}: ")
    moved = parts[-1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(CheckpointError, match=f"missing: it is part {n} of the {n} files of the model split from"):
        GGUFCheckpoint(parts[0])
    assert "missing: it is part" in model_problem(str(parts[0]))
    # a part of another split of the same model, renamed into the set
    (tmp_path / "o").mkdir()
    _, other_parts = _split(hf_dirs["llama"], tmp_path / "o", per_file=5, qtype="F32")
    assert len(other_parts) != n
    other_parts[-1].rename(parts[-1])
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(parts[0])
    assert str(parts[-1]) in str(e.value) and "come from different splits" in str(e.value)
    moved.rename(parts[-1])
    GGUFCheckpoint(parts[0])  # whole again
    first = tmp_path / "miscounted"
    first.mkdir()
    for p in parts:
        (first / p.name).write_bytes(p.read_bytes())
    _rewrite(parts[0], first / parts[0].name, {"split.tensors.count": 99}, {})
    _fails(first / parts[0].name, "metadata key 'split.tensors.count' is 99, but the", "files hold")
    renamed = tmp_path / "renamed.gguf"
    parts[0].rename(renamed)
    _fails(renamed, f"the file is part 1 of a model split into {n} files, whose names llama.cpp gives as "
                    f"<name>-00001-of-{n:05d}.gguf")


def _hf_copy(src: Path, dst: Path, change: dict[str, torch.Tensor | None]) -> Path:
    """`src` with its tensors in one model.safetensors, `change` applied (None deletes)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    flat: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            flat.update({k: h.get_tensor(k) for k in h.keys()})
    flat.update(change)
    save_file({k: v for k, v in flat.items() if v is not None}, str(dst / "model.safetensors"))
    return dst


def test_writer_leaves_no_partial_file(hf_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(data, qtype):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf.quants, "quantize", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        write_gguf(hf_dirs["llama"], tmp_path / "m.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_hf_checkpoints(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = hf_dirs["v2_q_lora_tied"]
    cases = {
        "missing": ({"model.layers.2.self_attn.q_a_proj.weight": None}, ["'model.layers.2.self_attn.q_a_proj.weight'", "missing"]),
        "extra": ({"model.layers.0.self_attn.extra.weight": torch.ones(2)}, ["unexpected tensor 'model.layers.0.self_attn.extra.weight'"]),
        "shape": ({"model.layers.1.mlp.shared_experts.up_proj.weight": torch.randn(16, 64)},
                  ["'model.layers.1.mlp.shared_experts.up_proj.weight'", "[16, 64]", "[32, 64]"]),
        "expert shape": ({"model.layers.2.mlp.experts.3.down_proj.weight": torch.randn(64, 16)},
                         ["'model.layers.2.mlp.experts.3.down_proj.weight'", "[64, 16]", "[64, 32]"]),
        "kv_b shape": ({"model.layers.0.self_attn.kv_b_proj.weight": torch.randn(100, 32)},
                       ["'model.layers.0.self_attn.kv_b_proj.weight'", "[100, 32]", "[160, 32]"]),
    }
    for name, (change, needles) in cases.items():
        d = _hf_copy(src, tmp_path / name.replace(" ", "_"), change)
        with pytest.raises(CheckpointError) as e:
            write_gguf(d, d / "out.gguf")
        assert all(n in str(e.value) for n in needles), str(e.value)
        assert not list(d.glob("out.gguf*")), "no partial file may be left behind"


@pytest.mark.parametrize("edit, needle", [
    ({"mlp_only_layers": [1]}, "layers [1] keep a dense MLP"),
    ({"norm_topk_prob": False}, "norm_topk_prob is false: llama.cpp's qwen3moe always renormalises"),
])
def test_qwen3_moe_llama_cpp_cannot_compute_is_refused(hf_dirs: dict[str, Path], tmp_path: Path, edit: dict,
                                                       needle: str) -> None:
    """llama.cpp's qwen3moe has experts in every layer and renormalises the chosen experts' weights: a model that
    differs would compute otherwise from its GGUF file, so none is written (llama.cpp's converter writes one)."""
    d = tmp_path / "hf"
    shutil.copytree(hf_dirs["qwen3_moe"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **edit}))
    if "mlp_only_layers" in edit:  # layer 1's dense MLP in place of its experts, as transformers saves it
        import transformers

        model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(d))
        _randomize(model, seed=3)
        model.save_pretrained(d)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        write_gguf(d, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.gguf*"))


def _bound(x: torch.Tensor, qtype: T) -> torch.Tensor:
    """Largest error per element `qtype` may make: half a quantization step plus the rounding of the
    fp16 block scales, or the rounding of the values themselves for F16/BF16. (kv_b_proj mixes F16
    k rows with quantized v rows; the quantized bound covers both.)"""
    if qtype in (T.F16, T.BF16):
        return x.abs() * (2**-11 if qtype == T.F16 else 2**-8) + 1e-7
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    half_step = {
        T.Q8_0: amax / 127 / 2,
        T.Q4_0: amax / 8,  # ggml's scale maps the signed extreme to -8, so +amax clips at 7 steps
        T.Q4_1: (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15 / 2,
    }[qtype]
    return (half_step + amax * 2**-9).expand_as(blocks).reshape(x.shape) + 1e-7


@pytest.mark.parametrize(
    ("case", "qtype", "expert_qtype"),
    [("llama", "Q8_0", None), ("v3", "Q8_0", "Q4_1"), ("v2_lite", "Q4_0", "BF16"), ("llama_tied_sharded", "F16", None)],
)
def test_quantized_write_within_rounding(
    hf_dirs: dict[str, Path], tmp_path: Path, case: str, qtype: str, expert_qtype: str | None
) -> None:
    q, eq = T[qtype], T[expert_qtype or qtype]
    path = write_gguf(hf_dirs[case], tmp_path / "q.gguf", qtype, expert_qtype=expert_qtype)
    infos = gguf.GGUFReader(path).tensors
    for t in infos:  # llama.cpp's rules: what stays F32, F16 for rows that are not whole blocks
        if t.name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight", "rope_freqs.weight")):
            assert t.tensor_type == T.F32, t.name
        elif int(t.shape[0]) % 32 and (eq if "_exps." in t.name else q) not in (T.F16, T.BF16):
            assert t.tensor_type == T.F16, t.name  # k_b rows: qk_nope 16; q_b rows: q_lora_rank 24
        else:
            assert t.tensor_type == (eq if "_exps." in t.name else q), t.name
    want = _hf_tensors(hf_dirs[case])
    for name, t in GGUFCheckpoint(path).tensors():
        ref = want[name]
        if t.dim() == 1 or name.endswith("mlp.gate.weight"):  # kept F32
            assert torch.equal(t, ref), name
            continue
        err = (t - ref).abs()
        assert err.max() > 0, f"{name} was not rounded"
        tq = eq if ".mlp.experts." in name else q
        if ref.shape[-1] % 32 and tq not in (T.F16, T.BF16):
            tq = T.F16
        assert (err <= _bound(ref, tq)).all(), name


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "v3", "glm4_moe",
                                  "glm4_moe_lite"])
def test_llama_cpp_runs_written_file_like_hf(hf_dirs: dict[str, Path], tmp_path: Path, case: str) -> None:
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    path = write_gguf(hf_dirs[case], tmp_path / "m.gguf")
    ids = [0, 5, 17, 44, 100, 250, 33, 7]
    llm = open_llama(path, n_ctx=32, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # F32 KV cache: compare fp32 with fp32
    llm.eval(ids)
    got = torch.tensor(np.array(llm.scores[: len(ids)]))
    hf = AutoModelForCausalLM.from_pretrained(hf_dirs[case], dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() / want.abs().max() < 2e-4


# ----------------------------------------------------------------------------- the real SmolLM2


def test_builtin_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from models.builtin import builtin_model_path

    path = builtin_model_path("smollm2-135m-instruct")
    ck = GGUFCheckpoint(path)
    cfg = config_from_hf_dict(ck.hf_config())
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 49152, 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.bos_token_id == 1
    # Names and shapes of everything, without paying for 135M dequantizations; the permuted Q4_1
    # projections of layer 0 for real, against gguf's dequantizer + transformers' un-permutation.
    real, raw = gguf_loader.dequantize, {}

    def dequantize(data, qtype, shape, src, name):
        if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            raw[name] = (np.array(data), qtype)
            return real(data, qtype, shape, src, name)
        return torch.empty(shape)

    monkeypatch.setattr(gguf_loader, "dequantize", dequantize)
    got = dict(ck.tensors())
    layer = {"input_layernorm.weight": (576,), "post_attention_layernorm.weight": (576,),
             "self_attn.q_proj.weight": (576, 576), "self_attn.k_proj.weight": (192, 576),
             "self_attn.v_proj.weight": (192, 576), "self_attn.o_proj.weight": (576, 576),
             "mlp.gate_proj.weight": (1536, 576), "mlp.up_proj.weight": (1536, 576), "mlp.down_proj.weight": (576, 1536)}
    want = {f"model.layers.{i}.{k}": s for i in range(30) for k, s in layer.items()}
    want.update({"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)})
    assert {n: tuple(t.shape) for n, t in got.items()} == want and ck.num_tensors() == len(want)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")):
        data, qtype = raw[gguf_name]
        assert qtype == T.Q4_1
        rows = want[f"model.layers.0.self_attn.{hf_name}.weight"][0]
        ref = gguf.quants.dequantize(data.reshape(rows, -1), qtype)
        ref = np.ascontiguousarray(proc.process(ref, gguf_name).weights)
        assert torch.equal(got[f"model.layers.0.self_attn.{hf_name}.weight"], torch.from_numpy(ref))
    assert ck.tokenizer().bos_token_id == 1


# ----------------------------------------------------------------------------- malformed files

_SMALL_SHAPES = {  # a 1-layer tied Llama, numpy order
    "token_embd.weight": (16, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
    "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
    "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_gate.weight": (64, 32),
    "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64),
}


def _small_gguf(path: Path, arch: str = "llama", drop: str | None = None, kv: dict | None = None,
                shapes: dict | None = None) -> Path:
    """A valid small GGUF written by the `gguf` package, optionally spoiled."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"context_length": 128, "embedding_length": 32, "block_count": 1, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.head_count_kv": 1}
    keys.update(kv or {})
    for k, v in keys.items():
        if f"{arch}.{k}" != drop:
            (w.add_string if isinstance(v, str) else w.add_uint32)(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    rng = np.random.default_rng(0)
    for name, shape in {**_SMALL_SHAPES, **(shapes or {})}.items():
        if name != drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fails(path: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(path)
    msg = str(e.value)
    assert str(path) in msg and all(n in msg for n in needles), msg
    return msg


def test_small_gguf_is_valid(tmp_path: Path) -> None:
    ck = GGUFCheckpoint(_small_gguf(tmp_path / "ok.gguf"))
    r = gguf.GGUFReader(ck.path)
    got = dict(ck.tensors())
    assert len(got) == ck.num_tensors() == 11
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert torch.equal(got["model.embed_tokens.weight"], torch.from_numpy(np.array(emb.data)))


def test_bad_magic(tmp_path: Path) -> None:
    p = _small_gguf(tmp_path / "m.gguf")
    p.write_bytes(b"GGUX" + p.read_bytes()[4:])
    _fails(p, "not a GGUF file")


def test_unsupported_version(tmp_path: Path) -> None:
    p = _small_gguf(tmp_path / "m.gguf")
    data = p.read_bytes()
    p.write_bytes(data[:4] + struct.pack("<I", 99) + data[8:])
    _fails(p, "unsupported GGUF version 99")


def test_truncated_at_many_points(tmp_path: Path) -> None:
    full = _small_gguf(tmp_path / "full.gguf")
    data = full.read_bytes()
    r = gguf.GGUFReader(full)
    cuts = [0, 3, 10, 20,  # magic, version, counts
            r.fields["llama.block_count"].offset + 9,  # inside a key string
            r.fields["llama.rope.freq_base"].offset + len("llama.rope.freq_base") + 14,  # inside a value
            r.tensors[3].field.offset + 5, r.tensors[-1].field.offset + 30,  # inside tensor infos
            r.data_offset, r.tensors[5].data_offset + 7, len(data) - 1]  # inside tensor data
    for i, cut in enumerate(cuts):
        p = tmp_path / f"cut{i}.gguf"
        p.write_bytes(data[:cut])
        msg = _fails(p)
        assert "truncated" in msg or "past the end of the file" in msg, (cut, msg)


@pytest.mark.parametrize("seed", range(4))
def test_garbage_and_corruption_raise_only_checkpoint_errors(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = tmp_path / "g.gguf"
    p.write_bytes(rng.bytes(5000))
    _fails(p)
    p.write_bytes(b"GGUF" + struct.pack("<I", 3) + rng.bytes(5000))  # plausible header, garbage body
    _fails(p)
    data = bytearray(_small_gguf(tmp_path / "ok.gguf").read_bytes())
    header_end = gguf.GGUFReader(tmp_path / "ok.gguf").data_offset
    for _ in range(25):  # random byte flips in the header and metadata: open, or fail cleanly
        spoiled = bytearray(data)
        for pos in rng.integers(4, header_end, size=3):
            spoiled[pos] = rng.integers(0, 256)
        p.write_bytes(bytes(spoiled))
        try:
            GGUFCheckpoint(p)
        except CheckpointError as e:
            assert str(p) in str(e)


def test_unknown_architecture(tmp_path: Path) -> None:
    _fails(_small_gguf(tmp_path / "m.gguf", arch="xyz"),
           "unknown architecture 'xyz' in general.architecture (supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, glm4moe, deepseek2)")


def test_missing_tensor(tmp_path: Path) -> None:
    _fails(_small_gguf(tmp_path / "m.gguf", drop="blk.0.attn_k.weight"), "'blk.0.attn_k.weight'", "missing")


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    _fails(_small_gguf(tmp_path / "m.gguf", shapes={"blk.0.ffn_up.weight": (48, 32)}),
           "'blk.0.ffn_up.weight'", "[48, 32]", "[64, 32]")


def test_unknown_and_out_of_range_tensors(tmp_path: Path) -> None:
    _fails(_small_gguf(tmp_path / "a.gguf", shapes={"blk.0.attn_qkv.weight": (64, 32)}), "unknown tensor 'blk.0.attn_qkv.weight'")
    _fails(_small_gguf(tmp_path / "b.gguf", shapes={"blk.1.attn_norm.weight": (32,)}), "'blk.1.attn_norm.weight'", "out of range")


def test_missing_or_mistyped_metadata_key(tmp_path: Path) -> None:
    _fails(_small_gguf(tmp_path / "a.gguf", drop="llama.embedding_length"), "'llama.embedding_length'", "missing")
    _fails(_small_gguf(tmp_path / "b.gguf", kv={"block_count": "one"}), "'llama.block_count'", "must be int")


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe"])
def test_native_forward_on_q8_0_blocks_agrees_with_llama_cpp(hf_dirs: dict[str, Path], tmp_path: Path,
                                                             case: str) -> None:
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms through the native CPU forward on a Q8_0 file
    (`--cpu-weight-dtype file`, the server's default), against llama.cpp on the same file, fp32 KV caches
    both: each position's logits within the 8-bit activations' rounding. Measured on these tiny models: 2.0%
    to 2.4% of a position's largest logit at worst for all three, as the exact fp32 forward differs from
    llama.cpp by 2.6-3.0% (llama.cpp rounds its activations too). (Not the MLA models: their 4 experts of 64
    values are chosen differently by either side's rounding at some positions, ours and llama.cpp's each 40-70%
    off the exact logits there, as measured for GLM-4.7-Flash's shape; their F32 files are compared above.)"""
    pytest.importorskip("llama_cpp")
    from models.loader.load import load_model
    from tests.models.test_hf_parity import prefill_logits
    from executor.model_runner import ModelRunner

    path = write_gguf(hf_dirs[case], tmp_path / "m.gguf", "Q8_0")
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False, cpu_weights="file")
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=64, max_running_requests=2)
    assert runner.native_forward is not None, runner.native_off_reason
    ids = [0, 5, 17, 44, 100, 250, 33, 7, 91, 12]
    ours = prefill_logits(runner, ids)
    llm = open_llama(path, n_ctx=32, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]))
    err = (ours - theirs).abs().max(-1).values / theirs.abs().max(-1).values
    assert float(err.max()) <= 0.05, err


@pytest.mark.parametrize("case, arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_more_experts_used_than_there_are_is_named_by_its_gguf_key(hf_dirs: dict[str, Path], tmp_path: Path,
                                                                   case: str, arch: str) -> None:
    src = write_gguf(hf_dirs[case], tmp_path / "m.gguf")
    bad = _rewrite(src, tmp_path / "bad.gguf", {f"{arch}.expert_used_count": 9}, {})
    _fails(bad, f"'{arch}.expert_used_count' = 9 is more than the 4 experts of '{arch}.expert_count'")


@pytest.mark.parametrize("nextn, needle", [
    (2, "'glm4moe.nextn_predict_layers' = 2 must be at least 0 and less than 'glm4moe.block_count' = 2"),
    (1, "required tensor 'blk.0.post_attention_norm.weight'"),  # (layer 1 is the block then: layer 0 must be whole)
])
def test_nextn_blocks_are_counted_from_block_count(hf_dirs: dict[str, Path], tmp_path: Path, nextn: int,
                                                   needle: str) -> None:
    """A GGUF's multi-token-prediction blocks are the last `nextn_predict_layers` of block_count: a count that
    leaves no layer is refused by its key; one that leaves some has those read in full, the rest skipped."""
    src = write_gguf(hf_dirs["glm4_moe"], tmp_path / "m.gguf")
    kv = {"glm4moe.nextn_predict_layers": nextn}
    drop = {"blk.0.post_attention_norm.weight": None} if nextn == 1 else {}
    _fails(_rewrite(src, tmp_path / "bad.gguf", kv, drop), needle)
    if nextn == 1:  # whole, layer 1 is skipped as the block: a model of the first layer
        assert GGUFCheckpoint(_rewrite(src, tmp_path / "ok.gguf", kv, {})).hf_config()["num_hidden_layers"] == 1


def _hf_variant(d: Path, name: str, **overrides: Any) -> Path:
    """tests.hf_models' tiny `name` model with config `overrides`, saved with a tokenizer the writer takes."""
    from tests.hf_models import build_hf_model

    d.mkdir()
    bos, eos = _write_tokenizer(d)
    build_hf_model(name, seed=13, bos_token_id=bos, eos_token_id=eos, **overrides).save_pretrained(d)
    return d


_YARN_08 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0,
            "attention_factor": 0.8}


@pytest.mark.parametrize("name, overrides", [
    # MLA rotating half-split pairs: its rotary rows are written in llama.cpp's interleaved order (they were
    # written as they are: llama.cpp and our reader were 0.59 off)
    ("glm4_moe_lite", dict(rope_interleave=False)),
    ("v3_tied_halfsplit", {}),
    # a YaRN attention_factor: llama.cpp ignores yarn_attn_factor there and multiplies cos and sin by
    # 0.1 ln(factor) + 1 times rope.scaling.attn_factor, now written to give the factor (it was 0.56 off)
    ("glm4_moe", dict(rope_parameters={**_YARN_08, "partial_rotary_factor": 0.5})),
    ("qwen3_gqa", dict(rope_parameters=_YARN_08)),
])
def test_written_rope_layouts_compute_as_hf_in_llama_cpp(tmp_path: Path, name: str, overrides: dict) -> None:
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    from tests.models.test_hf_parity import make_runner, prefill_logits

    d = _hf_variant(tmp_path / "hf", name, **overrides)
    path = write_gguf(d, tmp_path / "m.gguf")
    ids = [0, 5, 17, 44, 100, 250, 33, 7, 9, 120]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    llm = open_llama(path, n_ctx=32, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    for got in (torch.tensor(np.array(llm.scores[: len(ids)])), prefill_logits(make_runner(path), ids)):
        assert float((got - want).abs().max() / want.abs().max()) < 2e-4


@pytest.mark.parametrize("name, overrides, needle", [
    # llama.cpp's glm4moe (and qwen2/qwen3) apply no rope_freqs: the file would load (llama.cpp refused the
    # extra tensor) and compute unscaled
    ("glm4_moe", dict(max_position_embeddings=65536, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "llama3 rope scaling has no glm4moe GGUF form"),
    # llama.cpp's deepseek2 scales the scores by (1 + 0.1 ln factor)^2 under linear scaling (it was 0.50 off)
    ("glm4_moe_lite", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
     "linear rope scaling has no deepseek2 GGUF form"),
    ("v3_noaux_yarn", dict(rope_scaling={**_YARN_08, "mscale": 1.0, "mscale_all_dim": 1.0}),
     "a YaRN attention_factor has no deepseek2 GGUF form"),
    # llama.cpp computes shared experts always: its deepseek2 refused the file, its glm4moe was 0.62 off
    ("glm4_moe", dict(n_shared_experts=0), "n_shared_experts is 0"),
    ("glm4_moe_lite", dict(n_shared_experts=0), "n_shared_experts is 0"),
])
def test_what_llama_cpp_would_compute_otherwise_is_refused(tmp_path: Path, name: str, overrides: dict,
                                                            needle: str) -> None:
    d = _hf_variant(tmp_path / "hf", name, **overrides)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        write_gguf(d, tmp_path / "m.gguf")
