"""GGUF files of llama.cpp's low-bit file types (Q2_K, Q3_K_*, IQ4_XS, IQ4_NL), written by llama.cpp's own
quantizer, run in the native CPU forward.

Q2_K, Q3_K, IQ4_NL and IQ4_XS are the kernels' own formats, read as stored (repacked once at load).
Two oracles: the torch forward on the values gguf's reference decoders give (the loader's decoders are
bit-identical to them: tests/models/test_gguf_quants.py), which the native forward matches to its
activations' 8-bit rounding; and llama.cpp on the same file, which decodes the blocks with its own code.
Skipped without llama-cpp-python (its quantizer writes the files)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from executor.model_runner import ModelRunner
from models.builtin import DEFAULT_MODEL, builtin_model_path
from models.loader.gguf_writer import write_gguf
from models.loader.load import load_model
from models.native import native_modules
from models.synthetic import load_preset, write_checkpoint
from tests.executor.test_cpu_forward import all_logits, native_runner, prompt, sharpen_routers
from tests.llama_cpp_oracle import open_llama, quantize_with_llama

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed: llama.cpp's quantizer and oracle skipped")


def file_types(path) -> Counter:
    return Counter(t.tensor_type.name for t in GGUFReader(path).tensors)


def torch_runner(path) -> ModelRunner:
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=8)


def llama_logits(path, ids: list[int]) -> torch.Tensor:
    llm = open_llama(path, n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[: len(ids)]))


def errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position: the largest logit difference over that position's largest logit."""
    return (got - want).abs().max(-1).values / want.abs().max(-1).values


# file type -> (block types the file must hold, formats the kernels must compute on)
SMOLLM2_FILES = {
    "Q2_K": ({"Q3_K"}, {"q3_k"}),  # SmolLM2's 576-wide rows fall back to Q4_0; Q3_K in ffn_down
    "IQ4_XS": ({"IQ4_XS", "IQ4_NL"}, {"iq4_xs", "iq4_nl"}),  # IQ4_NL where rows are not whole 256-value blocks
}


@pytest.mark.parametrize("ftype", sorted(SMOLLM2_FILES))
def test_default_model_requantized_by_llama_cpp(tmp_path, ftype):
    """The default model's file requantized by llama.cpp as a user would download it for a small machine.
    Measured (Zen 5): native against the torch forward median 2.8-3.4%, max 7.4% of a position's largest
    logit; against llama.cpp 4.2-5.3%, max 12.8%, as far as the exact torch forward is from llama.cpp
    (3.6-4.7%, max 14.7%: llama.cpp rounds activations to 8 bits per 256 values for the K-quants, we per
    32). A wrong decoder or re-encoding puts these near 100%."""
    path = tmp_path / f"smollm2-{ftype}.gguf"
    quantize_with_llama(builtin_model_path(DEFAULT_MODEL), path, ftype)
    holds, formats = SMOLLM2_FILES[ftype]
    assert holds <= set(file_types(path))
    native = native_runner(path, cpu_weights="file")
    assert formats <= {m.op.weight_format for m in native_modules(native.model)}
    ref = torch_runner(path)
    ids = prompt(48, native.config.vocab_size, seed=21)
    ours, exact, theirs = all_logits(native, ids), all_logits(ref, ids), llama_logits(path, ids)
    for got, want, median, worst in ((ours, exact, 0.05, 0.12), (ours, theirs, 0.08, 0.25), (exact, theirs, 0.08, 0.25)):
        err = errors(got, want)
        assert float(err.median()) <= median and float(err.max()) <= worst, err


@pytest.mark.parametrize("ftype, kept", [("Q3_K_S", "q3_k"), ("Q2_K", "q2_k")])
def test_deepseek_file_requantized_by_llama_cpp(tmp_path, ftype, kept):
    """A DeepSeek-V2 file (MLA, routed experts in the cpp operator) whose rows are whole 256-value blocks
    where llama.cpp's Q3_K_S puts Q3_K: attention, the dense MLP, the experts and the absorbed attn_v_b all
    compute on the Q3_K blocks (Q2_K: on Q2_K blocks, Q3_K where llama.cpp keeps it); llama.cpp's fallbacks
    (Q4_0, Q5_1) cover the narrow rows. Measured (Zen 5), Q3_K_S / Q2_K: native against the torch forward
    median 2.0% / 2.2%, max 5.0% / 3.3% of a position's largest logit; against llama.cpp 4.2% / 3.6%, max
    9.7% / 18%, the torch forward against llama.cpp 3.6% / 3.3%, max 6.5% / 19%: the Q2_K file's one
    position where llama.cpp alone differs is a routed expert its 8-bit activations (per 256 values) pick
    differently; up to two such positions are allowed."""
    cfg = load_preset("tiny-deepseek-v2")
    cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, kv_lora_rank=256,
               qk_nope_head_dim=32, qk_head_dim=40, v_head_dim=32, n_group=1, topk_group=1, topk_method="greedy")
    d = write_checkpoint(tmp_path / "ckpt", cfg, seed=13)
    sharpen_routers(d)  # so that the activations' rounding does not flip the random router's near-ties
    path = tmp_path / f"model-{ftype}.gguf"
    quantize_with_llama(write_gguf(d, d / "model.gguf", "F32"), path, ftype)
    assert kept.upper() in file_types(path)
    native = native_runner(path, cpu_weights="file")
    assert kept in {m.op.weight_format for m in native_modules(native.model)}
    experts = [layer.mlp.experts for layer in native.model.model.layers if hasattr(layer.mlp, "experts")]
    assert experts and all(kept in e.weight_format for e in experts)
    ids = prompt(32, cfg["vocab_size"], seed=6)
    ours, exact, theirs = all_logits(native, ids), all_logits(torch_runner(path), ids), llama_logits(path, ids)
    for got, want, flips in ((ours, exact, 0), (ours, theirs, 2), (exact, theirs, 2)):
        err = errors(got, want)
        assert float(err.median()) <= (0.04 if flips == 0 else 0.07) and int((err > 0.12).sum()) <= flips, err
