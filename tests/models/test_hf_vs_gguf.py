"""One checkpoint, two files: the HF directory and the GGUF written from it load to the same model."""

from __future__ import annotations

import pytest
import torch

from models.loader.load import load_model
from models.synthetic import write_checkpoint
from executor.model_runner import ModelRunner, RequestSlice

PRESETS = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora", "tiny-deepseek-v3", "tiny-llama"]


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
