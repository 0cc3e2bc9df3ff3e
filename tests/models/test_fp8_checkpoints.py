"""Block-scaled FP8 checkpoints (DeepSeek-V3's published format) and multi-token-prediction layers.

The oracle is transformers loading the same FP8 directory (its `FineGrainedFP8Config` dequantizes on a
machine without a GPU); it derives the block from the scale grid and so needs dimensions that divide by
it, which DeepSeek-V3's do not all (576 rows of `kv_a_proj_with_mqa` over 128-row blocks): partial blocks
are checked against the format's definition, value by value. The FP8 files are written here from fresh
random tiny models (the quantizer is not under test: any FP8 values with any scales are a valid file).
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader.errors import CheckpointError
from models.loader.gguf_writer import write_gguf
from models.loader.load import load_model
from models.loader.safetensors_loader import HFCheckpoint
from models.loader.shard import Shard
from models.native import NativeLinear
from models.synthetic import write_checkpoint
from tests.hf_models import build_hf_model
from tests.models.test_hf_parity import make_runner, prefill_logits, prompt, rel_err
from tests.server.server_process import ServerProcess

BLOCK_DIVIDES = [8, 8]  # every dimension of tests.hf_models' configs divides by 8
BLOCK_PARTIAL = [16, 32]  # 40-row kv_a_proj, 96-column o_proj, ...: partial blocks, as DeepSeek-V3's


def _quantized(name: str, t: torch.Tensor) -> bool:
    """Which weights DeepSeek-V3's checkpoint stores in FP8: the linear layers, not the embeddings, the
    LM head, the norms or the routers."""
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
            and "lm_head" not in name and not name.endswith("mlp.gate.weight"))


def to_fp8(d: Path, block: list[int] | None, scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rewrites the HF directory `d` as a block-scaled FP8 checkpoint; returns the FP8 file's tensors."""
    sd = load_file(d / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if not _quantized(name, w):
            out[name] = w
            continue
        rows, cols = w.shape
        b0, b1 = block or (rows, cols)
        grid = (math.ceil(rows / b0), math.ceil(cols / b1))
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[:rows, :cols] = w.float()
        blocks = padded.view(grid[0], b0, grid[1], b1)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448
        if scale_dtype == torch.float8_e8m0fnu:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q.view(padded.shape)[:rows, :cols].contiguous()
        out[name + "_scale_inv"] = (scale if block else scale.view(1)).to(scale_dtype).contiguous()
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    _edit_config(d, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": block})
    return out


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """The format's definition: value (i, j) times the scale of block (i // rows, j // columns)."""
    rows, cols = q.shape
    b0, b1 = block or (rows, cols)
    i = torch.arange(rows)[:, None] // b0
    j = torch.arange(cols)[None, :] // b1
    return q.float() * scale.float().reshape(math.ceil(rows / b0), math.ceil(cols / b1))[i, j]


@pytest.mark.parametrize("name, scale_dtype", [("v3_noaux_yarn", torch.float32), ("v2_lite_yarn_grouped", torch.float32),
                                               ("llama_gqa_tied", torch.float32),
                                               ("v3_tied_halfsplit", torch.float8_e8m0fnu)])
def test_fp8_checkpoint_matches_transformers(tmp_path, name, scale_dtype):
    """Our forward on the FP8 directory against transformers' on the same directory (dequantized to fp32);
    the unquantized model it was made from is visibly different, so the FP8 values are what was read."""
    from transformers import AutoModelForCausalLM

    original = build_hf_model(name, seed=31)
    original.save_pretrained(tmp_path)
    to_fp8(tmp_path, BLOCK_DIVIDES, scale_dtype)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt(40, hf.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
        unquantized = original(torch.tensor([ids])).logits[0].float()
    for cpu_weights in (None, "float32"):  # the torch model and the native CPU forward
        ours = prefill_logits(make_runner(tmp_path, cpu_weights=cpu_weights), ids)
        assert rel_err(ours, ref) <= 1e-4, cpu_weights
    assert rel_err(unquantized, ref) > 1e-3


def test_partial_blocks_follow_the_format(tmp_path):
    """Blocks that overrun a dimension (DeepSeek-V3's 576-row kv_a_proj over 128): every FP8 weight, read
    whole or cut for tensor parallelism (rows and columns, across block edges, several ranges), equals the
    definition; the scales and nothing else are left out of the checkpoint's tensors."""
    build_hf_model("v3_noaux_yarn", seed=32).save_pretrained(tmp_path)
    written = to_fp8(tmp_path, BLOCK_PARTIAL)
    ckpt = HFCheckpoint(tmp_path)
    assert set(ckpt.layout()) == {n for n in written if not n.endswith("_scale_inv")}
    fp8_names = [n for n, t in written.items() if t.dtype == torch.float8_e4m3fn]
    assert any(written[n].shape[0] % BLOCK_PARTIAL[0] for n in fp8_names)
    assert any(written[n].shape[1] % BLOCK_PARTIAL[1] for n in fp8_names)
    for name in fp8_names:
        want = dequantized(written[name], written[name + "_scale_inv"], BLOCK_PARTIAL)
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, want), name
        rows, cols = want.shape
        for shard in (Shard(0, ((3, rows - 5),)), Shard(1, ((7, cols - 1),)), Shard(0, ((1, 9), (17, rows)))):
            part = ckpt.get_shard(name, shard)
            expected = torch.cat([want[a:b] if shard.dim == 0 else want[:, a:b] for a, b in shard.ranges],
                                 dim=shard.dim)
            assert torch.equal(part, expected), (name, shard)


def test_one_scale_per_tensor(tmp_path):
    """`weight_block_size` null: a single scale for each weight."""
    build_hf_model("llama_gqa_tied", seed=33).save_pretrained(tmp_path)
    written = to_fp8(tmp_path, None)
    ckpt = HFCheckpoint(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ckpt.get(name), dequantized(written[name], written[name + "_scale_inv"], None))


@pytest.mark.parametrize("name", ["v3_noaux_yarn", "llama_gqa_tied"])
def test_bf16_kernels_take_fp8_weights_as_bf16(tmp_path, name):
    """`--cpu-weight-dtype file` (the default) keeps a weight in its file's type; an FP8 weight's nearest is
    bf16, as transformers and DeepSeek's own converter dequantize it (the kernels would otherwise hold
    fp32, twice the memory). On the dense model the forward stays close to the exact one (bf16 rounding
    flips routing choices in the tiny MoE one, FP8 or not)."""
    build_hf_model(name, seed=34).save_pretrained(tmp_path)
    written = to_fp8(tmp_path, BLOCK_PARTIAL)
    file_bf16 = make_runner(tmp_path, dtype="bfloat16", cpu_weights="file")
    formats = {n: m.op.weight_format for n, m in file_bf16.model.named_modules() if isinstance(m, NativeLinear)}
    fp8_held = {formats[n] for n in formats if f"{n}.weight_scale_inv" in written}
    assert fp8_held == {"bf16"} and "f32" in formats.values(), formats  # (this file's fp32 LM head stays fp32)
    if name.startswith("llama"):
        ids = prompt(30, 320, seed=6)
        assert rel_err(prefill_logits(file_bf16, ids), prefill_logits(make_runner(tmp_path), ids)) <= 2e-2


def test_gguf_written_from_an_fp8_checkpoint(tmp_path):
    """`write_gguf` reads the FP8 directory dequantized, its MTP layer left out: the F32 GGUF gives the
    directory's logits."""
    d = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=35)
    to_fp8(d, [32, 64])
    add_mtp_layer(d, 3)
    _edit_config(d, num_nextn_predict_layers=1)
    gguf = write_gguf(d, tmp_path / "model.gguf", "F32")
    ids = prompt(30, 320, seed=7)
    assert rel_err(prefill_logits(make_runner(gguf), ids), prefill_logits(make_runner(d), ids)) <= 1e-5


# ----------------------------------------------------------------------------- multi-token prediction


def add_mtp_layer(d: Path, layer: int) -> None:
    """DeepSeek-V3's layer 61, as published: a decoder layer's tensors (here a copy of layer 2's, FP8 ones
    with their scales) plus its own embedding, norms, projection and head."""
    sd = load_file(d / "model.safetensors")
    for name in [n for n in sd if n.startswith("model.layers.2.")]:
        sd[name.replace("model.layers.2.", f"model.layers.{layer}.")] = sd[name].clone()
    p = f"model.layers.{layer}."
    hidden, vocab = sd["model.embed_tokens.weight"].shape[1], sd["model.embed_tokens.weight"].shape[0]
    sd |= {p + "embed_tokens.weight": torch.randn(vocab, hidden), p + "enorm.weight": torch.ones(hidden),
           p + "hnorm.weight": torch.ones(hidden), p + "eh_proj.weight": torch.randn(hidden, 2 * hidden),
           p + "shared_head.norm.weight": torch.ones(hidden), p + "shared_head.head.weight": torch.randn(vocab, hidden)}
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_multi_token_prediction_layers_are_left_out(tmp_path):
    """The layers after the last (`num_nextn_predict_layers`) serve speculative decoding, which the engine
    does not do: they are not loaded, and the model is the one without them. A layer past them is still
    an unexpected tensor."""
    clean = tmp_path / "clean"
    build_hf_model("v3_noaux_yarn", seed=36).save_pretrained(clean)
    to_fp8(clean, BLOCK_PARTIAL)
    mtp = tmp_path / "mtp"
    shutil.copytree(clean, mtp)
    add_mtp_layer(mtp, 3)
    _edit_config(mtp, num_nextn_predict_layers=1)
    ids = prompt(30, 320, seed=8)
    assert torch.equal(prefill_logits(make_runner(mtp), ids), prefill_logits(make_runner(clean), ids))
    add_mtp_layer(mtp, 4)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.4\."):
        load_model(mtp, dtype="float32", load_tokenizer=False, progress=False)


# ----------------------------------------------------------------------------- hostile or unsupported files


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fp8")
    build_hf_model("llama_gqa_tied", seed=37).save_pretrained(d)
    to_fp8(d, BLOCK_PARTIAL)
    return d


KEY = "model.layers.1.mlp.down_proj.weight"


def _broken(src: Path, tmp_path: Path, edit_tensors=None, **config) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    if edit_tensors is not None:
        sd = load_file(d / "model.safetensors")
        edit_tensors(sd)
        save_file(sd, d / "model.safetensors")
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] |= config.pop("quant", {})
        cfg |= config
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _fails(d: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype="float32", load_tokenizer=False, progress=False)
    assert all(n in str(e.value) for n in needles), str(e.value)
    return str(e.value)


def _pop(name):
    return lambda sd: sd.pop(name)


def _set(name, value):
    return lambda sd: sd.__setitem__(name, value)


@pytest.mark.parametrize("edit, needles", [
    (_pop(KEY + "_scale_inv"), [f"FP8 tensor '{KEY}' has no scales beside it", "incomplete"]),
    (_set(KEY + "_scale_inv", torch.ones(3, 3)), [f"'{KEY}_scale_inv' is F32 [3, 3]", "must be [4, 4]"]),
    (_set(KEY + "_scale_inv", torch.ones(4, 4, dtype=torch.int32)), ["is I32 [4, 4]", "F8_E8M0"]),
    # a scale that is negative (it flipped its block's sign) or not finite (a block of zero scale is one of zeros)
    (_set(KEY + "_scale_inv", torch.full((4, 4), float("nan"))), [f"'{KEY}_scale_inv' holds 16 scale(s) that"]),
    (_set(KEY + "_scale_inv", torch.rand(4, 4).index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(-1.0))),
     [f"'{KEY}_scale_inv' holds 1 scale(s) that are negative or not finite"]),
    (_set(KEY + "_scale_inv", -torch.rand(4, 4) - 0.1), [f"'{KEY}_scale_inv' holds 16 scale(s)", "corrupt"]),
    # (load_model's check of every tensor names the weight its scales made non-finite)
    (_set(KEY + "_scale_inv", torch.full((4, 4), 3e38)), [f"'{KEY}' holds", "non-finite value(s)"]),
    (_set("model.layers.9.mlp.up_proj.weight_scale_inv", torch.ones(1)),
     ["'model.layers.9.mlp.up_proj.weight_scale_inv' scales a tensor", "does not have"]),
    (_set(KEY + "_scale", torch.ones(1)), [f"'{KEY}' has two scales"]),
    (_set(KEY + "_scale_inv_scale_inv", torch.ones(1)), [f"unexpected tensor '{KEY}_scale_inv_scale_inv'"]),
    (_set(KEY, torch.ones(2, 64, 64).to(torch.float8_e4m3fn)), [f"FP8 tensor '{KEY}' has shape [2, 64, 64]"]),
    (_set(KEY, torch.ones(64, 64).to(torch.float8_e5m2)), [f"tensor '{KEY}' is stored as F8_E5M2"]),
], ids=["no-scale", "scale-grid", "scale-int", "scale-nan", "scale-one-negative", "scale-negative", "scale-overflow", "orphan-scale", "two-scales",
        "scale-of-scale", "3d", "e5m2"])
def test_broken_fp8_tensors_name_what_is_wrong(fp8_dir, tmp_path, edit, needles):
    _fails(_broken(fp8_dir, tmp_path, edit), *needles)


def test_a_zero_scale_is_a_block_of_zeros(fp8_dir, tmp_path):
    """A scale of 0 (what max|block| / 448 gives a block of zeros) is read, not refused: its block is zeros, the
    others as the format defines them."""
    rng = random.Random()
    r, c = rng.randrange(4), rng.randrange(4)
    d = _broken(fp8_dir, tmp_path, lambda sd: sd[KEY + "_scale_inv"].__setitem__((r, c), 0.0))
    written = load_file(d / "model.safetensors")
    got = HFCheckpoint(d).get(KEY)
    assert torch.equal(got, dequantized(written[KEY], written[KEY + "_scale_inv"], BLOCK_PARTIAL))
    b0, b1 = BLOCK_PARTIAL
    assert not got[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1].any() and got.any()


@pytest.mark.parametrize("quant, needles", [
    ({"quant_method": "bitsandbytes"}, ["quant_method 'bitsandbytes' is not supported", "unquantized (bf16)"]),
    ({"quant_method": None}, ["quant_method None is not supported"]),
    ({"fmt": "e5m2"}, ["fmt 'e5m2' is not supported"]),
    ({"activation_scheme": "fp4"}, ["activation_scheme 'fp4'"]),
    ({"weight_block_size": [0, 128]}, ["weight_block_size must be two integers", "[0, 128]"]),
    ({"weight_block_size": [128]}, ["weight_block_size must be two integers"]),
    ({"weight_block_size": [2**40, 128]}, ["weight_block_size must be two integers"]),
], ids=["bitsandbytes", "no-method", "e5m2", "bad-scheme", "zero-block", "one-dim", "huge-block"])
def test_unsupported_quantization_configs_are_refused_up_front(fp8_dir, tmp_path, quant, needles):
    msg = _fails(_broken(fp8_dir, tmp_path, quant=quant), "config key 'quantization_config'", *needles)
    assert "config.json" in msg


def test_scales_beside_a_weight_not_stored_in_fp8_are_not_applied(fp8_dir, tmp_path, caplog):
    """As DeepSeek's converter and transformers: a scale beside a bf16/fp32 weight (the router, a norm, the
    embedding) does nothing; it was applied (a router x1000 loaded silently) or crashed with a traceback."""
    extra = {"model.layers.1.mlp.gate_proj.weight_scale_inv": torch.full((1,), 1000.0),
             "model.norm.weight_scale_inv": torch.ones(3, 3), "model.embed_tokens.weight_scale_inv": torch.ones(2)}
    d = _broken(fp8_dir, tmp_path, lambda sd: sd.update(extra) or sd.__setitem__(
        "model.layers.1.mlp.gate_proj.weight", torch.randn(128, 64)))
    ckpt = HFCheckpoint(d)
    with caplog.at_level("WARNING"):
        assert torch.equal(ckpt.get("model.norm.weight"), load_file(d / "model.safetensors")["model.norm.weight"])
    assert "'model.norm.weight' is stored as F32, not FP8: its scales 'model.norm.weight_scale_inv' are not " \
           "applied" in caplog.text
    gate = ckpt.get("model.layers.1.mlp.gate_proj.weight")
    assert torch.equal(gate, load_file(d / "model.safetensors")["model.layers.1.mlp.gate_proj.weight"])
    load_model(d, dtype="float32", load_tokenizer=False, progress=False)


@pytest.mark.parametrize("extra, needle", [("1", "'1'"), (-1, "-1"), (True, "True"), (1.0, "1.0"), (1000, "1000")])
def test_bad_mtp_layer_counts_name_the_key(tmp_path, extra, needle):
    d = tmp_path / "m"
    build_hf_model("llama_gqa_tied", seed=39).save_pretrained(d)
    _edit_config(d, num_nextn_predict_layers=extra)
    _fails(d, "config.json", "key 'num_nextn_predict_layers' must be an integer from 0 to 64", needle)


def test_a_real_layer_is_not_taken_for_an_mtp_layer(tmp_path):
    """A layer counted by num_nextn_predict_layers that has no eh_proj is a decoder layer the config leaves
    out: refused, not silently dropped (a 3-layer checkpoint served as 2 layers)."""
    d = tmp_path / "m"
    build_hf_model("llama_gqa_tied", seed=40).save_pretrained(d)
    _edit_config(d, num_hidden_layers=2, num_nextn_predict_layers=2)
    _fails(d, "layer 2 follows the model's last (num_hidden_layers 2) but is no multi-token-prediction layer")


def test_autofp8_per_tensor_scales_and_static_activation_scales(tmp_path):
    """AutoFP8's layout (Llama FP8 checkpoints): `weight_scale` (one per weight), static `input_scale`s that
    are not read (activations are not quantized, as vLLM runs them without FP8 math), no block size."""
    original = build_hf_model("llama_rope3_untied", seed=41)
    original.save_pretrained(tmp_path)
    written = to_fp8(tmp_path, None)
    sd = {(n.replace("_scale_inv", "_scale") if n.endswith("_scale_inv") else n): t for n, t in written.items()}
    sd |= {n.replace(".weight_scale", ".input_scale"): torch.tensor(0.05) for n in list(sd) if n.endswith("_scale")}
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _edit_config(tmp_path, quantization_config={"quant_method": "fp8", "activation_scheme": "static"})
    ckpt = HFCheckpoint(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(ckpt.get(name), dequantized(sd[name], sd[name + "_scale"], None))
    assert not any(n.endswith(("_scale", "input_scale")) for n in ckpt.layout())
    ids = prompt(30, 320, seed=9)
    with torch.no_grad():
        ref = original(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(make_runner(tmp_path), ids), ref) <= 0.1  # per-tensor FP8 of fresh weights


def test_no_block_size_is_transformers_default(tmp_path):
    """Without `weight_block_size`, a grid of scales is of 128x128 blocks, as transformers reads it."""
    w = torch.randn(300, 260)
    q = w.to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3) + 0.5
    save_file({"x.weight": q, "x.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert torch.equal(HFCheckpoint(tmp_path).get("x.weight"), dequantized(q, scale, [128, 128]))


def test_fp8_tensors_without_a_quantization_config(fp8_dir, tmp_path):
    d = _broken(fp8_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, "is stored as F8_E4M3", "needs config.json's quantization_config")


# ----------------------------------------------------------------------------- served


def test_fp8_checkpoint_with_an_mtp_layer_is_served(tmp_path):
    """`mlaserve serve` on a DeepSeek-V3-shaped directory as published (FP8 with 128x128 blocks, partial
    ones included, an MTP layer): greedy tokens equal the same model loaded in this process."""
    d = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=38)
    to_fp8(d, [32, 64])
    add_mtp_layer(d, 3)
    _edit_config(d, num_nextn_predict_layers=1)
    loaded = load_model(d, dtype="float32", progress=False)
    runner = make_runner(d)
    ids = loaded.tokenizer.encode("The lighthouse keeper")
    want = runner.generate_greedy(ids, 8)
    reply = served_greedy(d, tmp_path, ids, 8, "--cpu-kernels", "torch")
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["choices"][0]["text"] == loaded.tokenizer.decode(want)


def served_greedy(d: Path, tmp_path: Path, ids: list[int], n: int, *flags: str) -> dict:
    """`mlaserve serve` on directory `d` (fp32, with `flags`): its /v1/completions reply to `ids`, greedy, `n`
    tokens past any end of generation."""
    server = ServerProcess(str(d), "--served-model-name", "m", "--dtype", "float32", "--max-total-tokens", "256",
                           *flags, log=tmp_path / "server.log").wait_ready(300)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        assert server.stop() == 0, server.log()


# ----------------------------------------------------------------------------- compressed-tensors FP8


def to_ct_fp8(d: Path, strategy: str, block: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Rewrites `d` as llm-compressor's FP8 checkpoint (compressed-tensors `float-quantized`): a scale per
    tensor, per row ([rows, 1]) or per block; returns each FP8 weight's value (fp8 * scale, fp32)."""
    sd = load_file(d / "model.safetensors")
    out, want = {}, {}
    for name, w in sd.items():
        if not _quantized(name, w):
            out[name] = w
            continue
        rows, cols = w.shape
        b0, b1 = {"tensor": (rows, cols), "channel": (1, cols)}.get(strategy) or block
        grid = (math.ceil(rows / b0), math.ceil(cols / b1))
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[:rows, :cols] = w.float()
        blocks = padded.view(grid[0], b0, grid[1], b1)
        scale = (blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448).to(torch.bfloat16)
        q = (blocks / scale.float()[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q.view(padded.shape)[:rows, :cols].contiguous()
        out[name + "_scale"] = scale.reshape(1) if strategy == "tensor" else scale.contiguous()
        want[name] = (q.float() * scale.float()[:, None, :, None]).view(padded.shape)[:rows, :cols]
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": block, "group_size": None, "observer": "minmax"}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    _edit_config(d, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                      "format": "float-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None})
    return want


@pytest.mark.parametrize("strategy, block", [("channel", None), ("tensor", None), ("block", BLOCK_PARTIAL)])
def test_compressed_tensors_fp8(tmp_path, strategy, block):
    """llm-compressor's FP8 files (per row, per tensor, per block with partial blocks): every weight read as
    the format defines it, and as llama.cpp's converter reads it (channel and block: it reads no per-tensor
    scale of this format); our forward matches transformers' on those values."""
    from tests.models.test_int_quant_checkpoints import _hf_with, llama_cpp_dequantized

    d, unquantized = tmp_path / "q", tmp_path / "ref"
    build_hf_model("v2_lite_yarn_grouped", seed=50).save_pretrained(d)
    shutil.copytree(d, unquantized)
    want = to_ct_fp8(d, strategy, block)
    ckpt = HFCheckpoint(d)
    assert not any(n.endswith("_scale") for n in ckpt.layout())
    for name, w in want.items():
        assert torch.equal(ckpt.get(name), w), name
    hf = _hf_with(unquantized, want)
    ids = prompt(40, hf.config.vocab_size, seed=12)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(make_runner(d), ids), ref) <= 1e-4
    if strategy != "tensor":
        theirs = llama_cpp_dequantized(d, tmp_path)
        for name, w in want.items():
            assert torch.equal(theirs[name], w), name
