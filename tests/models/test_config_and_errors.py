"""Config parsing (old and new transformers formats) and the clear errors of malformed HF checkpoints."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import DeepseekConfig, LlamaConfig, config_from_hf_dict
from models.loader.errors import CheckpointError
from models.rotary import rope_inv_freq
from models.loader.load import load_model
from tests.hf_models import save_hf_model


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("v2")
    save_hf_model("v2_lite_yarn_grouped", d)
    return d


def copy_ckpt(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def load(path):
    return load_model(path, dtype="float32", load_tokenizer=False, progress=False)


V2_OLD_STYLE = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax",
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
}


def test_v2_lite_old_and_new_rope_formats_agree():
    old = config_from_hf_dict(V2_OLD_STYLE)
    new_style = {k: v for k, v in V2_OLD_STYLE.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = dict(V2_OLD_STYLE["rope_scaling"], rope_type="yarn", rope_theta=10000.0)
    del new_style["rope_parameters"]["type"]
    new = config_from_hf_dict(new_style)
    assert isinstance(old, DeepseekConfig) and old == new
    assert old.q_lora_rank is None and old.kv_cache_dim == 576
    assert old.rope.scaling_type == "yarn" and old.rope.factor == 40 and old.rope.interleaved
    assert not old.is_moe_layer(0) and old.is_moe_layer(1)
    # the oracle for the YaRN-scaled softmax scale and the rope: HF transformers' own DeepSeek-V2 modules,
    # built from the same config.json (on the meta device: only their attributes and buffers are read)
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding

    hf_config = DeepseekV2Config(**V2_OLD_STYLE)
    with torch.device("meta"):
        hf_attention = DeepseekV2Attention(hf_config, layer_idx=0)
    assert old.softmax_scale == pytest.approx(hf_attention.scaling, rel=1e-6)
    assert old.softmax_scale != pytest.approx(192**-0.5)  # the YaRN mscale is in it
    hf_rope = DeepseekV2RotaryEmbedding(hf_config)
    inv_freq, attention_scaling = rope_inv_freq(old.rope)
    torch.testing.assert_close(inv_freq.float(), hf_rope.inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_scaling == pytest.approx(hf_rope.attention_scaling, rel=1e-6)


def test_v3_router_fields_and_moe_layer_freq():
    d = dict(V2_OLD_STYLE, model_type="deepseek_v3", q_lora_rank=1536, topk_method="noaux_tc", n_group=8,
             topk_group=4, n_routed_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
             routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=2)
    d.pop("scoring_func")
    cfg = config_from_hf_dict(d)
    assert cfg.moe.scoring_func == "sigmoid" and cfg.moe.topk_method == "noaux_tc"
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == (8, 4, 2.5)
    assert [cfg.is_moe_layer(i) for i in range(7)] == [False, False, False, False, True, False, True]


def test_a_ggufs_gating_function_is_honoured_as_llama_cpp_does():
    """A config.json's scoring_func other than its architecture's is refused (transformers ignores the key); a
    GGUF's expert_gating_func is what llama.cpp computes with, so the GGUF loader's dict keeps it."""
    from models.config import GGUF_SOURCE_KEY

    d = dict(V2_OLD_STYLE, model_type="deepseek_v3", scoring_func="softmax")
    with pytest.raises(CheckpointError, match="'scoring_func' must be 'sigmoid' for deepseek_v3"):
        config_from_hf_dict(d)
    assert config_from_hf_dict(dict(d, **{GGUF_SOURCE_KEY: True})).moe.scoring_func == "softmax"


def test_llama_gqa_and_rope_scaling():
    cfg = config_from_hf_dict({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "eos_token_id": [128001, 128008, 128009],
    })
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope.scaling_type) == (128, 8, "llama3")
    assert cfg.eos_token_ids == (128001, 128008, 128009) and not cfg.rope.interleaved


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "gpt_neox"}, "unknown architecture"),
        ({"model_type": {}}, "unknown architecture"),  # not a name at all
        ({"model_type": ["llama"]}, "unknown architecture"),
        ({"kv_lora_rank": None}, "'kv_lora_rank' is missing"),
        ({"hidden_size": "big"}, "'hidden_size' must be an integer"),
        ({"n_group": 3}, "MoE routing is inconsistent"),
        # V3 taking more experts than its kept groups hold: some masked at -inf, by a top-k's tie order
        ({"model_type": "deepseek_v3", "scoring_func": "sigmoid", "n_group": 8, "topk_group": 1, "num_experts_per_tok": 9},
         "at most the experts of topk_group groups"),
        ({"topk_method": "noaux_tc"}, "'topk_method' noaux_tc is DeepSeek-V3's routing"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope scaling type 'longrope'"),
        # what would be computed otherwise than transformers and DeepSeek's code compute it
        ({"scoring_func": "sigmoid"}, "'scoring_func' must be 'softmax' for deepseek_v2"),
        ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "'scoring_func' must be 'sigmoid' for deepseek_v3"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu': only SiLU-gated MLPs"),
        ({"model_type": "deepseek_v3", "hidden_act": "relu"}, "'hidden_act' is 'relu'"),
        ({"mlp_bias": True}, "'mlp_bias' is true"),  # (it named the first bias tensor, at load)
        # finite in Python, infinite in the kernels' float32: the first request's routing weights were inf
        ({"routed_scaling_factor": 3.5e38}, "'routed_scaling_factor' must be a finite number within float32's range"),
        ({"rope_scaling": dict(V2_OLD_STYLE["rope_scaling"], mscale=1e200)}, "'mscale' must be a finite number within"),
        # finite, but its correction squared is not in float32 (every score NaN)
        ({"rope_scaling": dict(V2_OLD_STYLE["rope_scaling"], mscale_all_dim=-1e30)}, "'mscale_all_dim' = -1e.30"),
        ({"rope_scaling": dict(V2_OLD_STYLE["rope_scaling"], mscale=3e20)}, "'mscale' = 3e.20: its YaRN correction"),
        ({"rope_scaling": dict(V2_OLD_STYLE["rope_scaling"], factor=math.e, mscale_all_dim=-10)}, r"\+ 1 = 0 would make"),
        ({"rope_scaling": "linear"}, "'rope_scaling' must be an object"),  # (a ValueError from dict())
        ({"rope_scaling": 5}, "'rope_scaling' must be an object"),
    ],
)
def test_bad_config_values_name_the_key(change, needle):
    with pytest.raises(CheckpointError, match=needle):
        config_from_hf_dict(dict(V2_OLD_STYLE, **change), "x/config.json")


def test_unknown_architecture_at_load(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*unknown architecture: model_type='mamba'"):
        load(d)


def test_missing_tensor(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load(d)


def test_missing_expert(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load(d)


def test_wrong_shape(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 90)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' has shape \(64, 90\), expected \(64, 96\)"):
        load(d)


def test_unexpected_tensor(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.q_b_proj.weight"] = torch.randn(8, 8)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_b_proj\.weight'"):
        load(d)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_safetensors(v2_dir, tmp_path, keep):
    d = copy_ckpt(v2_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(d)


def test_garbage_safetensors_header(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{not json" + b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load(d)


def test_sharded_index_checked(v2_dir, tmp_path):
    d = copy_ckpt(v2_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    (d / "model.safetensors").unlink()
    save_file({n: sd[n] for n in names[:half]}, d / "model-00001-of-00002.safetensors")
    save_file({n: sd[n] for n in names[half:]}, d / "model-00002-of-00002.safetensors")
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
                  for i, n in enumerate(names)}
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert load(d).model is not None  # sharded loads fine

    index.write_text(json.dumps({"weight_map": dict(weight_map, extra="../outside.safetensors")}))
    with pytest.raises(CheckpointError, match="points outside the model directory"):
        load(d)
    bad = dict(weight_map)
    bad[names[0]] = "model-00002-of-00002.safetensors"  # promised in the wrong shard
    index.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(CheckpointError, match=f"tensor '{names[0]}' is listed in model.safetensors.index.json but not in this shard"):
        load(d)


def test_pickle_checkpoints_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V2_OLD_STYLE))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickle checkpoints are not loaded"):
        load(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{ nope")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load(tmp_path)


def _link_into_blobs(snap, name: str, blobs, data: bytes) -> None:
    """A Hugging Face cache snapshot's file: the bytes in blobs/<hash>, the snapshot's name a relative link."""
    blob = blobs / f"blob-{len(list(blobs.iterdir()))}"
    blob.write_bytes(data)
    (snap / name).symlink_to(f"../../blobs/{blob.name}")


def test_a_hugging_face_cache_snapshot_and_a_folder_of_links_load(v2_dir, tmp_path):
    """In the hub cache every file of snapshots/<rev>/ links to ../../blobs/<hash>: a sharded model there was
    refused (its shards 'outside the model directory'). Weights and configs may link anywhere (a folder of
    links to shared weights, as transformers allows); the index's names stay inside the folder."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    sd = load_file(v2_dir / "model.safetensors")
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({n: sd[n] for n in part}, tmp_path / "tmp.safetensors")
        _link_into_blobs(snap, shard, blobs, (tmp_path / "tmp.safetensors").read_bytes())
    index = {"weight_map": {n: shard for shard, part in shards.items() for n in part}}
    _link_into_blobs(snap, "model.safetensors.index.json", blobs, json.dumps(index).encode())
    _link_into_blobs(snap, "config.json", blobs, (v2_dir / "config.json").read_bytes())
    assert load(snap).model is not None
    from models.loader.jsonfile import confined

    _link_into_blobs(snap, "chat_template.jinja", blobs, b"{{ 1 }}")
    (tmp_path / "model").symlink_to(snap)  # a friendly name for the snapshot
    for root in (snap, tmp_path / "model"):
        assert confined(root / "chat_template.jinja", root) == root / "chat_template.jinja"

    farm = tmp_path / "farm"
    farm.mkdir()
    for f in v2_dir.iterdir():
        (farm / f.name).symlink_to(f)
    assert load(farm).model is not None
    for bad in ("/etc/passwd", "../model.safetensors", "sub/../../x.safetensors", ""):
        (snap / "model.safetensors.index.json").unlink()
        _link_into_blobs(snap, "model.safetensors.index.json", blobs,
                         json.dumps({"weight_map": dict(index["weight_map"], extra=bad)}).encode())
        with pytest.raises(CheckpointError, match="points outside the model directory"):
            load(snap)


def test_chat_templates_may_not_link_out_of_the_model_directory(tmp_path):
    """A chat template linked to /etc/passwd was rendered into every chat prompt."""
    from tokenizers import Tokenizer, models as tok_models

    from models.loader.tokenizer import load_hf_tokenizer

    d = tmp_path / "m"
    d.mkdir()
    Tokenizer(tok_models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(d / "tokenizer.json"))
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'not the model''s template' }}")
    (d / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(CheckpointError, match="chat_template.jinja: links to .*secret.txt, outside the model directory"):
        load_hf_tokenizer(d)
    (d / "chat_template.jinja").unlink()
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (d / "inner").mkdir()
    (d / "inner" / "t.jinja").write_text("{{ 1 }}")
    (d / "additional_chat_templates").symlink_to(d / "inner")  # a link within the directory is fine
    bundle = load_hf_tokenizer(d)
    assert bundle.chat_template == "{{ messages[0]['content'] }}"
    (d / "additional_chat_templates").unlink()
    (d / "additional_chat_templates").symlink_to(tmp_path)  # a folder linked out: its files are outside
    (tmp_path / "x.jinja").symlink_to(secret)
    with pytest.raises(CheckpointError, match="x.jinja: links to .*secret.txt, outside the model directory"):
        load_hf_tokenizer(d)


def test_a_tokenizer_past_the_models_vocabulary_is_refused_at_load(v2_dir, tmp_path, caplog):
    """Another model's tokenizer (ids past vocab_size) made every chat request a client's 400 'token id
    outside the vocabulary'; now the load says so. Added tokens past it are warned of (they fail if used)."""
    from tokenizers import Tokenizer, models as tok_models
    from tokenizers import AddedToken

    d = copy_ckpt(v2_dir, tmp_path)
    vocab_size = json.loads((d / "config.json").read_text())["vocab_size"]
    big = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(vocab_size + 3)}, unk_token="t0"))
    big.save(str(d / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=f"token ids up to {vocab_size + 2}, past the model's vocab_size {vocab_size}"):
        load_model(d, dtype="float32", progress=False)
    fits = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    fits.add_special_tokens([AddedToken("<pad>", special=True)])  # id vocab_size: appended without resizing
    fits.save(str(d / "tokenizer.json"))
    with caplog.at_level("WARNING"):
        assert load_model(d, dtype="float32", progress=False).tokenizer is not None
    assert f"added tokens '<pad>' ({vocab_size}) have ids past the model's vocab_size" in caplog.text


def test_rope_scaling_beside_rope_parameters_wins_and_says_what_it_drops(caplog):
    """As transformers reads it (rope_scaling or rope_parameters); a theta only rope_parameters held is dropped
    there too, so the log says so (tests/models/test_hf_parity.py compares the numbers with transformers')."""
    cfg = {k: v for k, v in V2_OLD_STYLE.items() if k not in ("rope_scaling", "rope_theta")}
    cfg.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"type": "linear", "factor": 2.0})
    with caplog.at_level("WARNING", logger="models.config"):
        rope = config_from_hf_dict(cfg, "x/config.json").rope
    assert (rope.scaling_type, rope.theta) == ("linear", 10000.0)
    assert "rope_scaling is used" in caplog.text and "theta 1e+06 is not" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="models.config"):
        config_from_hf_dict(dict(cfg, rope_scaling=None), "x/config.json")  # null beside it: rope_parameters, quietly
    assert "rope_scaling" not in caplog.text


QWEN25 = dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
              use_sliding_window=False, sliding_window=32768, max_window_layers=2)


def test_yarn_serves_its_whole_reach():
    """Qwen2.5's long-context config keeps the trained 32768 in max_position_embeddings and YaRN x4 over it: the
    model serves 131072 positions (vLLM, SGLang and llama.cpp take it so); its frequencies are those of the
    original 32768. DeepSeek's configs already give the reach (163840 = 4096 x 40); a reach past the largest
    context is cut to it."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = config_from_hf_dict({**QWEN25, "rope_scaling": yarn})
    assert cfg.max_position_embeddings == 131072 and cfg.rope.original_max_position_embeddings == 32768
    assert config_from_hf_dict(QWEN25).max_position_embeddings == 32768
    v2 = config_from_hf_dict({**V2_OLD_STYLE, "max_position_embeddings": 163840, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}})
    assert v2.max_position_embeddings == 163840
    huge = config_from_hf_dict({**QWEN25, "rope_scaling": {**yarn, "factor": 1e6}})
    from models.config import MAX_CONTEXT_LENGTH
    assert huge.max_position_embeddings == MAX_CONTEXT_LENGTH


def test_qwen_defaults_are_transformers():
    """Keys a Qwen config leaves out take Qwen's defaults, not Llama's: Qwen3's head_dim 128 (not hidden /
    heads), a context of 32768 (not 2048)."""
    base = {k: v for k, v in QWEN25.items() if k not in ("max_position_embeddings",)}
    assert config_from_hf_dict(base).max_position_embeddings == 32768
    q3 = config_from_hf_dict({**base, "model_type": "qwen3"})
    assert q3.head_dim == 128 and q3.qk_norm and not q3.attention_bias and q3.out_bias is False
    q2 = config_from_hf_dict(base)
    assert q2.head_dim == 16 and q2.attention_bias and q2.out_bias is False and not q2.qk_norm


@pytest.mark.parametrize("keys, window", [
    ({"use_sliding_window": False}, None),
    ({"use_sliding_window": True, "max_window_layers": 2}, None),  # no layer from max_window_layers on: all full
    ({"use_sliding_window": True, "max_window_layers": 1}, 4096),
    ({"layer_types": ["full_attention", "full_attention"], "use_sliding_window": True, "max_window_layers": 0}, None),
    ({"layer_types": ["full_attention", "sliding_attention"]}, 4096),
])
def test_qwen_windows_only_where_transformers_slides(keys, window):
    cfg = config_from_hf_dict({**QWEN25, "sliding_window": 4096, **keys})
    assert cfg.sliding_window == window
    assert cfg.max_position_embeddings == (window or 32768)


QWEN3_MOE = dict(QWEN25, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 num_hidden_layers=4)


def test_qwen3_moe_reads_as_transformers_builds_it():
    """Qwen3MoeConfig's defaults and layer rule: every layer MoE unless `mlp_only_layers` lists it or (i + 1) is no
    multiple of `decoder_sparse_step`; no head_dim default (hidden / heads, unlike Qwen3's 128); softmax, greedy,
    unnormalised unless `norm_topk_prob`; `num_experts: 0` a dense model; windows on every layer when switched on."""
    cfg = config_from_hf_dict(QWEN3_MOE)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.num_shared_experts) == (8, 2, 32, 0)
    assert (m.scoring_func, m.topk_method, m.norm_topk_prob, m.routed_scaling_factor) == ("softmax", "greedy", False, 1.0)
    assert cfg.qk_norm and cfg.head_dim == 16 and not cfg.attention_bias and cfg.out_bias is False
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True] * 4
    cfg = config_from_hf_dict({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True})
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False] and cfg.moe.norm_topk_prob
    defaults = config_from_hf_dict({k: v for k, v in QWEN3_MOE.items()
                                    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")})
    assert (defaults.moe.num_experts, defaults.moe.top_k, defaults.moe.intermediate_size) == (128, 8, 768)
    assert config_from_hf_dict({**QWEN3_MOE, "num_experts": 0}).moe is None
    windowed = config_from_hf_dict({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 4096})
    assert windowed.sliding_window == 4096  # (max_window_layers, which Qwen3MoeAttention does not read, is 2 here)


@pytest.mark.parametrize("keys, needle", [
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' = 9 is more than the 8 experts ('num_experts')"),
    ({"mlp_only_layers": ["1"]}, "'mlp_only_layers' must be a list of layer numbers"),
    ({"mlp_only_layers": 1}, "'mlp_only_layers' must be list"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be > 0"),
    ({"num_experts": -1}, "'num_experts' must be >= 0"),
])
def test_qwen3_moe_bad_keys_are_named(keys, needle):
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        config_from_hf_dict({**QWEN3_MOE, **keys})


MIXTRAL = dict(model_type="mixtral", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def test_mixtral_reads_as_transformers_builds_it():
    """MixtralConfig's defaults: 8 experts of intermediate_size, top-2, always renormalised, in every layer; a
    context of 4096 * 32 and no window where the keys are absent (Mistral's window is 4096 where its key is
    absent, none where it is null)."""
    cfg = config_from_hf_dict(MIXTRAL)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob, m.num_shared_experts) == (8, 2, 96, True, 0)
    assert all(cfg.is_moe_layer(i) for i in range(2)) and not cfg.qk_norm and cfg.head_dim == 16
    assert cfg.max_position_embeddings == 131072 and cfg.sliding_window is None
    windowed = config_from_hf_dict({**MIXTRAL, "sliding_window": 4096, "num_local_experts": 4})
    assert windowed.sliding_window == 4096 and windowed.moe.num_experts == 4
    mistral = {**MIXTRAL, "model_type": "mistral"}
    assert config_from_hf_dict(mistral).sliding_window == 4096 and config_from_hf_dict(mistral).moe is None
    assert config_from_hf_dict({**mistral, "sliding_window": None}).max_position_embeddings == 131072
    with pytest.raises(CheckpointError, match=re.escape("'num_experts_per_tok' = 9 is more than the 8 experts")):
        config_from_hf_dict({**MIXTRAL, "num_experts_per_tok": 9})


def test_qwen2_moe_reads_as_transformers_builds_it():
    """Qwen2MoeConfig's defaults: 60 experts of 1408, top-4, unnormalised, one shared expert of 5632 whose output a
    sigmoid gate scales, q/k/v biases (qkv_bias) and none on o."""
    cfg = config_from_hf_dict({k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "num_experts_per_tok",
                                                                                 "moe_intermediate_size")}
                              | {"model_type": "qwen2_moe"})
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_size, m.shared_gate) == (60, 4, 1408, 5632, True)
    assert not m.norm_topk_prob and cfg.attention_bias and cfg.out_bias is False and not cfg.qk_norm
    assert not config_from_hf_dict({**QWEN3_MOE, "model_type": "qwen2_moe", "qkv_bias": False}).attention_bias
    no_shared = config_from_hf_dict({**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 0})
    assert no_shared.moe.shared_size == 0 and not no_shared.moe.shared_gate


def test_absent_keys_take_each_model_types_transformers_default():
    """Keys a config leaves out are read as transformers' config class for the model type fills them (a helper
    found ours read them as Llama's): Mixtral's theta 1e6, eps 1e-5, 8 KV heads, bos 1 / eos 2; Qwen3-MoE's and
    Mistral's KV heads (4, 8); a Qwen window of 4096 where use_sliding_window turns one on without a size; and
    num_local_experts over num_experts where a Qwen3-MoE config has both (transformers maps the latter to it)."""
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=16)
    mixtral = config_from_hf_dict({**base, "model_type": "mixtral"})
    assert (mixtral.rope.theta, mixtral.rms_norm_eps, mixtral.num_key_value_heads) == (1e6, 1e-5, 8)
    assert (mixtral.bos_token_id, mixtral.eos_token_ids) == (1, (2,))
    assert config_from_hf_dict({**base, "model_type": "mixtral", "eos_token_id": None}).eos_token_ids == ()
    assert config_from_hf_dict({**base, "model_type": "qwen3_moe", "head_dim": 16}).num_key_value_heads == 4
    assert config_from_hf_dict({**base, "model_type": "mistral", "sliding_window": None}).num_key_value_heads == 8
    assert config_from_hf_dict({**base, "model_type": "llama"}).num_key_value_heads == 16
    windowed = config_from_hf_dict({**base, "model_type": "qwen3_moe", "head_dim": 16, "use_sliding_window": True})
    assert windowed.sliding_window == 4096
    both = config_from_hf_dict({**base, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8,
                                "num_local_experts": 4, "num_experts_per_tok": 2})
    assert both.moe.num_experts == 4


# GLM-4.7-Flash's released config.json (its shapes; 3 layers here)
GLM47_FLASH = dict(
    model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
    num_hidden_layers=3, num_attention_heads=20, num_key_value_heads=20, max_position_embeddings=202752,
    rope_theta=1000000.0, rope_scaling=None, partial_rotary_factor=1.0, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=64, n_shared_experts=1,
    num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=1.8, n_group=1, topk_group=1,
    topk_method="noaux_tc", first_k_dense_replace=1, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
    eos_token_id=[154820, 154827, 154829], tie_word_embeddings=False)


def test_glm47_flash_reads_as_deepseek_v3_mla():
    """GLM-4.7-Flash is DeepSeek-V3's MLA (576 latent values a token) and routing with GLM's sizes: v_head_dim 256
    beside qk_nope 192, one dense layer first, x1.8 weights renormalised, no groups."""
    cfg = config_from_hf_dict(GLM47_FLASH)
    assert cfg.arch == "deepseek_v3" and cfg.kv_cache_dim == 576 and (cfg.qk_head_dim, cfg.v_head_dim) == (256, 256)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.n_group, m.topk_group) == (64, 4, 1, 1, 1)
    assert (m.scoring_func, m.topk_method, m.norm_topk_prob, m.routed_scaling_factor) == ("sigmoid", "noaux_tc", True, 1.8)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.rope.interleaved and cfg.rope.dim == 64 and cfg.eos_token_ids == (154820, 154827, 154829)
    bare = config_from_hf_dict({k: v for k, v in GLM47_FLASH.items() if k not in (
        "q_lora_rank", "max_position_embeddings", "rms_norm_eps", "first_k_dense_replace", "n_routed_experts")})
    assert (bare.q_lora_rank, bare.max_position_embeddings, bare.rms_norm_eps) == (768, 202752, 1e-5)
    assert bare.moe.num_experts == 64 and [bare.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("keys, needle", [
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "dense layers after sparse ones"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "must list 'dense' or 'sparse' for each of the 3 layers"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "must list 'dense' or 'sparse'"),
    ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor' must be 1.0 for glm4_moe_lite"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor": None},
     "'partial_rotary_factor' must be 1.0"),
    ({"num_experts_per_tok": 65}, "MoE routing is inconsistent"),
])
def test_glm47_flash_bad_keys_are_named(keys, needle):
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        config_from_hf_dict({**GLM47_FLASH, **keys})


GLM45_AIR = dict(
    model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=4, num_attention_heads=96, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rope_theta=1000000, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=128,
    n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
    eos_token_id=[151329, 151336, 151338], tie_word_embeddings=False)


def test_glm45_air_reads_as_gqa_with_deepseek_v3_routing():
    """GLM-4.5-Air: GQA 96/8 over heads of 128 with the first 64 dims rotated half-split, q/k/v biases and no o
    bias, DeepSeek-V3's routing (sigmoid, correction bias) with one shared expert, one dense layer first."""
    cfg = config_from_hf_dict(GLM45_AIR)
    assert cfg.arch == "llama" and (cfg.num_key_value_heads, cfg.head_dim, cfg.rope.dim) == (8, 128, 64)
    assert not cfg.rope.interleaved and cfg.attention_bias and cfg.out_bias is False and not cfg.qk_norm
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.shared_size) == (128, 8, 1, 1408)
    assert (m.scoring_func, m.topk_method, m.norm_topk_prob, m.routed_scaling_factor) == ("sigmoid", "noaux_tc", True, 1.0)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert config_from_hf_dict({**GLM45_AIR, "use_qk_norm": True}).qk_norm  # (GLM-4.5's, not -Air's)
    bare = config_from_hf_dict({k: v for k, v in GLM45_AIR.items() if k not in (
        "partial_rotary_factor", "num_key_value_heads", "first_k_dense_replace", "rms_norm_eps")})
    assert (bare.rope.dim, bare.num_key_value_heads, bare.rms_norm_eps, bare.dense_layers) == (64, 8, 1e-5, {0})


@pytest.mark.parametrize("factor", [0.0, 1.5, -0.5])
def test_glm45_partial_rotary_factor_out_of_range_is_named(factor):
    with pytest.raises(CheckpointError, match=re.escape(f"'partial_rotary_factor' must be > 0 and at most 1, got {factor}")):
        config_from_hf_dict({**GLM45_AIR, "partial_rotary_factor": factor})
    assert config_from_hf_dict({**GLM45_AIR, "partial_rotary_factor": 1.0}).rope.dim == 128  # (the whole head)
