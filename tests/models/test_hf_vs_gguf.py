"""One checkpoint, two files: the HF directory and the GGUF written from it load to the same model."""

from __future__ import annotations

import pytest
import torch

from models.loader.load import load_model
from models.synthetic import write_checkpoint
from executor.model_runner import ModelRunner, RequestSlice

PRESETS = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora", "tiny-deepseek-v3", "tiny-llama", "tiny-qwen3-moe"]


def logits_of(path, ids):
    loaded = load_model(path, dtype="float32", progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=256, max_running_requests=2)
    row = runner.req_to_token_pool.alloc()
    out = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True))
    runner.free_request(row, len(ids))
    return loaded, runner, out


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_and_gguf_give_the_same_logits_and_tokens(tmp_path, preset):
    d = write_checkpoint(tmp_path / preset, preset, seed=3, gguf=True)
    text = "The quick brown fox jumps over 13 lazy dogs. 你好!"
    ids = load_model(d, dtype="float32", progress=False).tokenizer.encode(text)
    hf_loaded, hf_runner, hf_logits = logits_of(d, ids)
    gguf_loaded, gguf_runner, gguf_logits = logits_of(d / "model.gguf", ids)
    assert gguf_loaded.config.arch == hf_loaded.config.arch
    assert gguf_loaded.tokenizer.encode(text) == ids
    assert float((gguf_logits - hf_logits).abs().max() / hf_logits.abs().max()) <= 1e-5
    assert gguf_runner.generate_greedy(ids, 16) == hf_runner.generate_greedy(ids, 16)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-llama"])
def test_q8_0_gguf_stays_close(tmp_path, preset):
    d = write_checkpoint(tmp_path / preset, preset, seed=4, gguf=True, gguf_qtype="Q8_0")
    ids = list(range(5, 45))
    _, _, exact = logits_of(d, ids)
    _, _, quant = logits_of(d / "model.gguf", ids)
    row_err = (quant - exact).abs().amax(-1) / exact.abs().amax(-1)
    assert float(row_err.median()) <= 3e-2
    assert not torch.equal(quant, exact)  # really quantized


def _hf_dir(name, d):
    """transformers' tiny `name` model (Mixtral's file names its experts block_sparse_moe.experts.N.w1/w2/w3,
    Qwen2-MoE's its shared_expert) with the default model's tokenizer, which llama.cpp's converter knows."""
    from models.builtin import DEFAULT_MODEL, builtin_model_path
    from models.loader.gguf_loader import GGUFCheckpoint
    from models.loader.tokenizer import save_hf_tokenizer
    from tests.hf_models import build_hf_model

    # (every layer MoE: llama.cpp's qwen2moe has no dense layers, and its converter refuses them)
    build_hf_model(name, seed=5, vocab_size=49152, **({"mlp_only_layers": []} if name == "qwen2_moe" else {})
                   ).save_pretrained(d)
    save_hf_tokenizer(GGUFCheckpoint(builtin_model_path(DEFAULT_MODEL)).tokenizer(), d)
    return d


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "mixtral", "qwen2_moe"])
def test_llama_cpp_converters_moe_file_loads_as_the_hf_directory(tmp_path, model):
    """A Qwen3-MoE, Mixtral or Qwen2-MoE GGUF as llama.cpp users have it (llama.cpp's own convert_hf_to_gguf.py, F32): our
    reader maps its names (Mixtral's q/k rows permuted), stacked experts and keys to the HF directory's model,
    logits within 1e-5 and the same tokens."""
    import os
    import subprocess
    import sys

    from bench import peers

    script = peers.convert_script()
    if script is None:
        pytest.skip("llama.cpp's sources are not unpacked (`make test` does it: bench/peers.py unpack)")
    if model == "mixtral":
        pytest.importorskip("sentencepiece", reason="llama.cpp's Llama converter imports it (`make test` installs it)")
    if not model.startswith("tiny-"):
        d = _hf_dir(model, tmp_path / "hf")
    else:
        d = write_checkpoint(tmp_path / "hf", model, seed=5)
    out = tmp_path / "converted.gguf"
    proc = subprocess.run([sys.executable, str(script), str(d), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = list(range(7, 47))
    hf_loaded, hf_runner, hf_logits = logits_of(d, ids)
    gguf_loaded, gguf_runner, gguf_logits = logits_of(out, ids)
    assert gguf_loaded.config.moe == hf_loaded.config.moe
    assert gguf_loaded.config.qk_norm == hf_loaded.config.qk_norm == (model == "tiny-qwen3-moe")
    assert float((gguf_logits - hf_logits).abs().max() / hf_logits.abs().max()) <= 1e-5
    assert gguf_runner.generate_greedy(ids, 16) == hf_runner.generate_greedy(ids, 16)


def _glm_dir(name: str, d):
    """transformers' tiny GLM model as zai-org's files hold it: the default model's tokenizer with GLM's special
    tokens added (llama.cpp's GLM converter names them) and one multi-token-prediction block after the layers
    (`num_nextn_predict_layers`: a decoder layer plus eh_proj, enorm, hnorm and shared_head.norm), which
    transformers does not build and llama.cpp's converter writes as block_count's last block."""
    import json

    from safetensors.torch import load_file, save_file

    from models.builtin import DEFAULT_MODEL, builtin_model_path
    from models.loader.gguf_loader import GGUFCheckpoint
    from models.loader.tokenizer import save_hf_tokenizer
    from tests.hf_models import build_hf_model

    model = build_hf_model(name, seed=5, vocab_size=49216)
    model.save_pretrained(d)
    bundle = GGUFCheckpoint(builtin_model_path(DEFAULT_MODEL)).tokenizer()
    bundle.tokenizer.add_special_tokens(["[gMASK]", "<sop>", "<|user|>", "<|observation|>"])
    save_hf_tokenizer(bundle, d)
    cfg = json.loads((d / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    for key in [k for k in tensors if k.startswith(f"model.layers.{n - 1}.")]:
        tensors[key.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = torch.randn(
            tensors[key].shape, generator=g)
    tensors.update({f"model.layers.{n}.{k}": torch.randn(s, generator=g) for k, s in (
        ("eh_proj.weight", (h, 2 * h)), ("enorm.weight", (h,)), ("hnorm.weight", (h,)),
        ("shared_head.norm.weight", (h,)))})
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    # (zai-org's config.json names the dense lead `first_k_dense_replace`, which llama.cpp's converter reads; the
    # `mlp_layer_types` transformers saves it ignores, writing no dense layer)
    cfg.pop("mlp_layer_types", None)
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1}))
    return d


@pytest.mark.parametrize("model", ["glm4_moe_lite", "glm4_moe"])
def test_llama_cpp_converters_glm_file_loads_as_the_hf_directory(tmp_path, model):
    """GLM-4.7-Flash (deepseek2) and GLM-4.5 (glm4moe) GGUFs as llama.cpp's own converter writes them, with the
    multi-token-prediction block it keeps (block_count one more than the layers, `nextn_predict_layers` 1): read as
    the HF directory's model, logits within 1e-5 and the same tokens, the block not read. (The block's tensors
    were refused as out of range; glm4moe files were refused as an unknown architecture.) GLM-4.7-Flash's file
    names no gating function: it is sigmoid by its routing bias."""
    import os
    import subprocess
    import sys

    from bench import peers
    from models.loader.gguf_loader import GGUFCheckpoint

    script = peers.convert_script()
    if script is None:
        pytest.skip("llama.cpp's sources are not unpacked (`make test` does it: bench/peers.py unpack)")
    d = _glm_dir(model, tmp_path / "hf")
    out = tmp_path / "converted.gguf"
    proc = subprocess.run([sys.executable, str(script), str(d), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ck = GGUFCheckpoint(out)
    arch = ck.arch
    assert arch == {"glm4_moe_lite": "deepseek2", "glm4_moe": "glm4moe"}[model]
    assert ck.metadata[f"{arch}.block_count"] == 4 and ck.metadata[f"{arch}.nextn_predict_layers"] == 1
    assert any(name.startswith("blk.3.nextn.") for name in ck._infos)
    if model == "glm4_moe_lite":  # (as zai-org's files: no scoring_func in config.json, no gating key written; the
        # routing bias says sigmoid, which llama.cpp assumes only for the released layer count and vocabulary)
        assert "deepseek2.expert_gating_func" not in ck.metadata
    assert ck.metadata["tokenizer.ggml.pre"] != "glm4"  # (the default model's pre-tokenizer)
    ids = list(range(7, 47))
    hf_loaded, hf_runner, hf_logits = logits_of(d, ids)
    gguf_loaded, gguf_runner, gguf_logits = logits_of(out, ids)
    assert gguf_loaded.config.num_hidden_layers == hf_loaded.config.num_hidden_layers == 3
    assert gguf_loaded.config.moe == hf_loaded.config.moe
    assert float((gguf_logits - hf_logits).abs().max() / hf_logits.abs().max()) <= 1e-5
    assert gguf_runner.generate_greedy(ids, 16) == hf_runner.generate_greedy(ids, 16)
