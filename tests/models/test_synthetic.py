"""Synthetic checkpoints against HF transformers: it must load them as its own, with every key used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models import synthetic
from models.config import SUPPORTED_MODEL_TYPES, DeepseekConfig, LlamaConfig, config_from_hf_dict
from models.loader.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TINY = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora", "tiny-deepseek-v3", "tiny-llama", "tiny-qwen2-moe",
        "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-glm4-moe-lite"]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _load_hf(path: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, f"HF loading reported problems: {info}"
    return model.eval()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synthetic")
    return {name: synthetic.write_checkpoint(root / name, name, seed=1) for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_in_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    path = tiny_dirs[name]
    assert {p.name for p in path.iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    }
    model = _load_hf(path)
    preset = synthetic.load_preset(name)
    assert type(model).__name__ == preset["architectures"][0]
    # Parameter count as transformers counts it (V3's correction bias is a buffer there).
    hf_count = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    assert synthetic.num_parameters(name) == hf_count
    ids = torch.randint(0, preset["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 11, preset["vocab_size"])
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 30  # O(1) activations, yet not a flat distribution
    assert (logits.argmax(-1) != logits[0, 0].argmax()).any()  # not one token everywhere


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-llama"])  # one per template
def test_tokenizer_and_chat_template_work_in_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    path = tiny_dirs[name]
    cfg = json.loads((path / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == cfg["vocab_size"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Hello, world!" in text and "Be brief." in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert 0 < max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == text
    assert cfg["bos_token_id"] == tok.bos_token_id and cfg["eos_token_id"] == tok.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


@pytest.mark.parametrize("name", sorted(synthetic.PRESETS))
def test_every_preset_parses_and_is_what_transformers_writes(name: str) -> None:
    d = synthetic.load_preset(name)
    cfg = config_from_hf_dict(d, name)
    assert isinstance(cfg, LlamaConfig if SUPPORTED_MODEL_TYPES[d["model_type"]] == "llama" else DeepseekConfig)
    hf = json.loads(transformers.AutoConfig.for_model(**d).to_json_string())
    hf.pop("transformers_version")
    assert hf == d


def test_tiny_presets_are_small_but_not_degenerate() -> None:
    for name in TINY:
        cfg = config_from_hf_dict(synthetic.load_preset(name), name)
        assert cfg.hidden_size <= 64 and cfg.num_attention_heads > 1
        if isinstance(cfg, DeepseekConfig):
            assert len({cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim}) == 3
            assert cfg.kv_lora_rank != cfg.hidden_size and cfg.moe is not None and cfg.moe.num_experts <= 8
            assert cfg.moe.first_k_dense_replace >= 1 and cfg.num_hidden_layers > cfg.moe.first_k_dense_replace
            assert cfg.vocab_size == 129280
    v2 = config_from_hf_dict(synthetic.load_preset("tiny-deepseek-v2"))
    assert v2.q_lora_rank is None and v2.moe.topk_method == "group_limited_greedy" and v2.rope.scaling_type == "yarn"
    assert config_from_hf_dict(synthetic.load_preset("tiny-deepseek-v2-qlora")).q_lora_rank is not None
    v3 = config_from_hf_dict(synthetic.load_preset("tiny-deepseek-v3"))
    assert (v3.moe.scoring_func, v3.moe.topk_method, v3.moe.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert v3.moe.n_group > v3.moe.topk_group and v3.moe.routed_scaling_factor == 2.5
    llama = config_from_hf_dict(synthetic.load_preset("tiny-llama"))
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.tie_word_embeddings) == (4, 2, True)
    qwen = config_from_hf_dict(synthetic.load_preset("tiny-qwen3-moe"))
    assert qwen.qk_norm and qwen.moe is not None and (qwen.moe.num_experts, qwen.moe.top_k) == (8, 2)
    assert all(qwen.is_moe_layer(i) for i in range(qwen.num_hidden_layers)) and qwen.moe.norm_topk_prob
    qwen2 = config_from_hf_dict(synthetic.load_preset("tiny-qwen2-moe"))
    assert qwen2.moe.shared_gate and qwen2.moe.shared_size == 48 and qwen2.attention_bias and not qwen2.out_bias
    glm = config_from_hf_dict(synthetic.load_preset("tiny-glm4-moe"))  # GQA, half the head rotated, V3's routing
    assert (glm.head_dim, glm.rope.dim, glm.moe.topk_method, glm.moe.n_group) == (32, 16, "noaux_tc", 2)
    assert glm.qk_norm and glm.attention_bias and not glm.out_bias and not glm.is_moe_layer(0) and glm.is_moe_layer(1)
    flash = config_from_hf_dict(synthetic.load_preset("tiny-glm4-moe-lite"))  # MLA, v_head_dim past qk_nope
    assert flash.arch == "deepseek_v3" and flash.v_head_dim > flash.qk_nope_head_dim and flash.moe.n_group == 1


def test_true_shape_presets_match_released_models() -> None:
    flash = config_from_hf_dict(synthetic.load_preset("glm-4.7-flash"))
    assert (flash.hidden_size, flash.num_attention_heads, flash.q_lora_rank, flash.kv_cache_dim) == (2048, 20, 768, 576)
    assert (flash.qk_head_dim, flash.v_head_dim, flash.num_hidden_layers, flash.vocab_size) == (256, 256, 47, 154880)
    assert (flash.moe.num_experts, flash.moe.top_k, flash.moe.num_shared_experts, flash.moe.intermediate_size,
            flash.moe.routed_scaling_factor) == (64, 4, 1, 1536, 1.8)
    lite = config_from_hf_dict(synthetic.load_preset("deepseek-v2-lite"))
    assert (lite.hidden_size, lite.num_attention_heads, lite.q_lora_rank, lite.kv_cache_dim) == (2048, 16, None, 576)
    assert (lite.moe.num_experts, lite.moe.top_k, lite.moe.num_shared_experts, lite.moe.intermediate_size) == (
        64, 6, 2, 1408)
    assert (lite.rope.factor, lite.rope.mscale, lite.rope.mscale_all_dim) == (40.0, 0.707, 0.707)
    v3 = config_from_hf_dict(synthetic.load_preset("deepseek-v3"))
    assert (v3.hidden_size, v3.num_attention_heads, v3.q_lora_rank, v3.vocab_size) == (7168, 128, 1536, 129280)
    assert (v3.moe.num_experts, v3.moe.top_k, v3.moe.n_group, v3.moe.topk_group) == (256, 8, 8, 4)
    assert v3.moe.first_k_dense_replace == 3 and v3.intermediate_size == 18432
    # Published totals at full depth: DeepSeek-V2-Lite 15.7B (ours: + 2 x 26,880 x 2048 for the larger
    # vocab of the tokenizer we ship), DeepSeek-V3 671B (without its MTP module).
    extra_vocab = 2 * (129280 - 102400) * 2048
    assert round((synthetic.num_parameters("deepseek-v2-lite", 27) - extra_vocab) / 1e8) == 157
    assert round(synthetic.num_parameters("deepseek-v3", 61) / 1e9) == 671
    assert synthetic.load_preset("deepseek-v3")["num_hidden_layers"] <= 2


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    again = synthetic.write_checkpoint(tmp_path / "again", "tiny-deepseek-v3", seed=1)
    first = tiny_dirs["tiny-deepseek-v3"]
    for f in sorted(first.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = _tensors(synthetic.write_checkpoint(tmp_path / "other", "tiny-deepseek-v3", seed=2))
    for name, t in _tensors(first).items():
        assert not torch.equal(t, other[name]), name


def test_weights_are_random_and_norms_not_exactly_one(tiny_dirs: dict[str, Path]) -> None:
    tensors = _tensors(tiny_dirs["tiny-deepseek-v3"])
    for name, t in tensors.items():
        head = t.flatten()[:4096]
        assert t.dtype == torch.float32 and head.unique().numel() > 0.9 * head.numel(), name
        if name.endswith("norm.weight"):
            assert 0.05 < (t - 1).abs().mean() < 0.2, name
    assert "lm_head.weight" in tensors and "lm_head.weight" not in _tensors(tiny_dirs["tiny-llama"])


def test_layers_override_and_shared_prefix(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    one = synthetic.write_checkpoint(tmp_path / "one", "tiny-deepseek-v2", seed=1, num_layers=1)
    five = synthetic.write_checkpoint(tmp_path / "five", "tiny-deepseek-v2", seed=1, num_layers=5)
    assert json.loads((one / "config.json").read_text())["num_hidden_layers"] == 1
    t1, t3, t5 = _tensors(one), _tensors(tiny_dirs["tiny-deepseek-v2"]), _tensors(five)
    assert {n.split(".")[2] for n in t5 if n.startswith("model.layers.")} == {"0", "1", "2", "3", "4"}
    assert not any(n.startswith("model.layers.1.") for n in t1)
    for name, t in t3.items():  # a layer's weights do not depend on how many layers follow it
        assert torch.equal(t, t5[name]), name
    _load_hf(five)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        synthetic.write_checkpoint(tmp_path / "zero", "tiny-deepseek-v2", num_layers=0)


def test_sharded_checkpoint_matches_single_file(tmp_path: Path, tiny_dirs: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic, "SHARD_BYTES", 64 * 1024)
    path = synthetic.write_checkpoint(tmp_path / "sharded", "tiny-llama", seed=1)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    single = _tensors(tiny_dirs["tiny-llama"])
    assert set(index["weight_map"]) == set(single) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    assert index["metadata"]["total_parameters"] == synthetic.num_parameters("tiny-llama")
    ids = torch.randint(0, 49152, (1, 9))
    with torch.no_grad():
        a = _load_hf(path)(ids).logits
        b = _load_hf(tiny_dirs["tiny-llama"])(ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_are_rounded_float32(tmp_path: Path, tiny_dirs: dict[str, Path], dtype: str) -> None:
    path = synthetic.write_checkpoint(tmp_path / dtype, "tiny-deepseek-v3", seed=1, dtype=dtype)
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    full = _tensors(tiny_dirs["tiny-deepseek-v3"])
    for name, t in _tensors(path).items():
        want = torch.float32 if name.endswith("e_score_correction_bias") else getattr(torch, dtype)
        assert t.dtype == want, name
        assert torch.equal(t, full[name].to(want)), name


def test_cli_writes_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    rc = synthetic.main(["--preset", "tiny-llama", "--out", str(out), "--seed", "3", "--layers", "1",
                         "--dtype", "bfloat16"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{synthetic.num_parameters('tiny-llama', 1):,}" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["dtype"]) == (1, "bfloat16")
    _load_hf(out)


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="tiny-llama"):
        synthetic.load_preset("no-such-preset")
    with pytest.raises(ValueError, match="dtype"):
        synthetic.write_checkpoint(tmp_path / "x", "tiny-llama", dtype="int8")
    with pytest.raises(CheckpointError, match="model_type"):
        synthetic.write_checkpoint(tmp_path / "y", {"model_type": "gpt2"})
    with pytest.raises(SystemExit):
        synthetic.main(["--preset", "no-such-preset", "--out", str(tmp_path / "z")])


def test_gguf_option_writes_a_file_the_loader_opens(tmp_path: Path) -> None:
    from models.loader.gguf_loader import GGUFCheckpoint

    path = synthetic.write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=1, gguf=True, gguf_qtype="Q8_0")
    ckpt = GGUFCheckpoint(path / "model.gguf")
    assert ckpt.hf_config()["num_hidden_layers"] == 3 and ckpt.hf_config()["n_routed_experts"] == 8
    rc = synthetic.main(["--preset", "tiny-llama", "--out", str(tmp_path / "llama"), "--gguf", "--gguf-qtype", "Q8_0"])
    assert rc == 0
    ckpt = GGUFCheckpoint(tmp_path / "llama" / "model.gguf")
    assert ckpt.hf_config()["num_hidden_layers"] == 2 and ckpt.num_tensors() > 0


def test_every_file_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """safetensors wrote the weights 0600 while the config beside them was 0644: a server running as
    another user (the Docker image's, over a read-only mount) could not read them."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = synthetic.write_checkpoint(tmp_path / "m", "tiny-llama", seed=1)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
