"""Hostile or inconsistent checkpoints fail with a `CheckpointError` naming the file and the key or tensor,
before anything is allocated at the sizes a config claims; the rotary table is not sized to a claimed
context up front. Tiny generated files only (tests.hf_models, test_gguf_files' small GGUF)."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import MAX_CONTEXT_LENGTH, RopeConfig, config_from_hf_dict
from models.loader.errors import CheckpointError
from models.loader.gguf_loader import GGUFCheckpoint
from models.loader.load import check_model_fits_checkpoint, load_model
from models.registry import model_class
from models.rotary import TABLE_POSITIONS, RotaryEmbedding
from tests.hf_models import save_hf_model
from tests.models.test_config_and_errors import V2_OLD_STYLE
from tests.models.test_gguf_files import _fails, _small_gguf

LLAMA = "llama_gqa_tied"  # 3 layers, vocab 320, hidden 64, 4 heads / 2 kv heads, max_position_embeddings 512


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    save_hf_model(LLAMA, d)
    return d


def _copy(src: Path, tmp_path: Path, config: dict | None = None) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load(path: Path, native: bool = False):
    return load_model(path, dtype="float32", cpu_weights="file" if native else None, load_tokenizer=False,
                      progress=False)


def _load_fails(path: Path, native: bool, *needles: str) -> str:
    start = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        _load(path, native)
    msg = str(e.value)
    assert all(n in msg for n in needles), msg
    assert time.monotonic() - start < 30, "the error must come before the model is built at the config's size"
    return msg


# ------------------------------------------------------------- config against the checkpoint


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("change, needles", [
    ({"num_hidden_layers": 100000}, ("config.json", "'num_hidden_layers' is 100000", "no tensor of layer 3")),
    ({"vocab_size": 2**30}, ("'model.embed_tokens.weight' has shape (320, 64), expected (1073741824, 64)",
                             "config.json")),
    ({"vocab_size": 2**34}, ("config.json", "'vocab_size' = 17179869184 is out of range")),
    ({"vocab_size": 2**31 - 1, "hidden_size": 2**31 - 1, "head_dim": 16},
     ("config.json", "no model can be built at the config's sizes")),  # their product overflows int64
    ({"hidden_size": 2**20, "head_dim": 16}, ("has shape", "1048576", "config.json")),
    ({"intermediate_size": 2**28}, ("'model.layers.0.mlp.", "268435456")),
    ({"max_position_embeddings": 2**31}, ("config.json", "'max_position_embeddings' = 2147483648")),
])
def test_config_not_matching_the_weights_fails_before_allocating(llama_dir, tmp_path, change, needles, native):
    _load_fails(_copy(llama_dir, tmp_path, change), native, *needles)


def test_missing_embedding_with_huge_vocab_is_reported_before_allocating(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path, {"vocab_size": 2**30})
    sd = load_file(d / "model.safetensors")
    del sd["model.embed_tokens.weight"]
    save_file(sd, d / "model.safetensors")
    _load_fails(d, False, "missing tensor(s): model.embed_tokens.weight")


def test_too_few_layers_in_the_config_still_reported(llama_dir, tmp_path):
    _load_fails(_copy(llama_dir, tmp_path, {"num_hidden_layers": 2}), False, "unexpected tensor 'model.layers.2.")


def test_model_values_bounded_by_the_checkpoints():
    """The backstop for what names and shapes cannot tell (GGUF files, expert stacks, tensor parallelism)."""
    cfg = config_from_hf_dict(dict(V2_OLD_STYLE, num_hidden_layers=2, vocab_size=1000, hidden_size=64,
                                   intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=4,
                                   n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=2**24))
    with torch.device("meta"):
        net = model_class(cfg)(cfg, expert_backend="torch")
    weights = sum(p.numel() for p in net.parameters())
    check_model_fits_checkpoint(net, None, weights, "f.gguf", "f.gguf", sharded=False)  # the rotary table aside
    with pytest.raises(CheckpointError, match=r"f\.gguf: the config describes a model of .* holds 1,000"):
        check_model_fits_checkpoint(net, None, 1000, "f.gguf", "f.gguf", sharded=False)


# --------------------------------------------------------------------------- tensor dtypes


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.int8, "I8")])
def test_non_float_weight_is_refused(llama_dir, tmp_path, native, dtype, name):
    d = _copy(llama_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    sd[key] = torch.ones_like(sd[key]).to(dtype)
    save_file(sd, d / "model.safetensors")
    msg = _load_fails(d, native, "model.safetensors", f"tensor '{key}'", f"stored as {name}", "F32, F16 or BF16")
    assert str(d / "model.safetensors") in msg


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("key, value", [("model.layers.1.input_layernorm.weight", float("nan")),
                                        ("model.norm.weight", float("inf")),
                                        ("model.layers.0.mlp.down_proj.weight", float("-inf"))])
def test_non_finite_weight_is_refused(llama_dir, tmp_path, native, key, value):
    """A NaN or an infinity in a float tensor, a norm's too (which no kernel reads as blocks), is refused at
    load naming the tensor: it used to load, and every request got garbage."""
    d = _copy(llama_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    sd[key] = sd[key].clone()
    sd[key].view(-1)[[1, 5]] = value
    save_file(sd, d / "model.safetensors")
    _load_fails(d, native, str(d), f"tensor '{key}' holds 2 non-finite value(s)")


def test_finite_weights_whose_sum_overflows_load(llama_dir, tmp_path):
    """The finiteness check sums each tensor first: values that are finite but sum past fp16's range take
    the exact pass and load."""
    d = _copy(llama_dir, tmp_path)
    sd = {k: v.half() for k, v in load_file(d / "model.safetensors").items()}
    key = "model.layers.0.mlp.down_proj.weight"
    sd[key] = torch.full_like(sd[key], 60000.0)
    save_file(sd, d / "model.safetensors")
    assert float(_load(d).model.state_dict()[key].max()) == 60000.0


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_non_finite_gguf_router_is_refused(tmp_path, native):
    """DeepSeek's router (an F32 tensor of a GGUF) holding an infinity: refused at load (it used to load, and
    the first request stopped the engine: the experts refuse non-finite weights)."""
    from models.synthetic import write_checkpoint

    d = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=3, gguf=True, gguf_qtype="Q8_0")
    _set_gguf_tensor(d / "model.gguf", "blk.1.ffn_gate_inp.weight", float("inf"))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.gate.weight' holds .* non-finite"):
        _load(d / "model.gguf", native)


def test_overflowing_router_runs_on_the_native_forward(tmp_path):
    """Finite router weights so large that the router's logits overflow (NaN after the dot products): the
    native forward routes such a token to no expert instead of failing (the experts refuse NaN weights,
    and the engine would stop at the first request); its output is garbage either way."""
    from executor.model_runner import ModelRunner
    from models.synthetic import write_checkpoint

    d = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=3, gguf=True, gguf_qtype="Q8_0")
    _set_gguf_tensor(d / "model.gguf", "blk.1.ffn_gate_inp.weight", 3e38, every=1)
    loaded = _load(d / "model.gguf", native=True)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=64, max_running_requests=2)
    assert runner.native_forward is not None, runner.native_off_reason
    assert len(runner.generate_greedy([5, 9, 2, 7], 4)) == 4
    assert runner.allocator.available_size() == 64


def _set_gguf_tensor(path: Path, name: str, value: float, every: int = 7) -> None:
    """Writes `value` into every `every`-th value of the F32 tensor `name` of a GGUF file, in place."""
    reader = gguf.GGUFReader(path)
    info = next(t for t in reader.tensors if t.name == name)
    assert info.tensor_type == gguf.GGMLQuantizationType.F32
    with path.open("r+b") as f:
        for i in range(0, int(info.n_elements), every):
            f.seek(int(info.data_offset) + 4 * i)
            f.write(struct.pack("<f", value))


def test_load_weights_refuses_integer_tensors(llama_dir):
    net = _load(llama_dir).model
    with pytest.raises(CheckpointError, match=r"src: tensor 'model\.norm\.weight' is stored as torch\.int64"):
        net.load_weights([("model.norm.weight", torch.ones(64, dtype=torch.int64))], "src")


# ------------------------------------------------------------------------- numeric settings


@pytest.mark.parametrize("change, key", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": 3e38}, "rms_norm_eps"),  # loaded, and every norm computed garbage
    ({"rms_norm_eps": 1}, "rms_norm_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rope_scaling": {"type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 4096}}, "factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": -2}},
     "beta_fast"),
    ({"rope_scaling": {"type": "linear", "factor": -2.0}}, "factor"),
    ({"max_position_embeddings": 2**31}, "max_position_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"n_group": -2}, "n_group"),
    ({"moe_layer_freq": -1}, "moe_layer_freq"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"n_shared_experts": -1}, "n_shared_experts"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"hidden_size": 2**63}, "hidden_size"),  # torch cannot even be asked for it
    ({"n_routed_experts": 1e308}, "n_routed_experts"),
    ({"qk_rope_head_dim": 1e308}, "qk_rope_head_dim"),
    ({"n_shared_experts": 2**63}, "n_shared_experts"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": [1, 2**40]}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"),
])
def test_bad_numeric_settings_name_the_key(change, key):
    with pytest.raises(CheckpointError, match=f"x/config.json: config key '{key}'"):
        config_from_hf_dict(dict(V2_OLD_STYLE, **change), "x/config.json")


@pytest.mark.parametrize("change, needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 128}}, "'high_freq_factor' = 4.0 must exceed"),
    # the rotary dims a GGUF's rope.dimension_count gives (its loader's key)
    ({"_gguf_rope_dimension_count": 0}, "'_gguf_rope_dimension_count' must be > 0"),
    ({"_gguf_rope_dimension_count": 18}, "rotary dimension count 18 must be even and at most the head dimension 16"),
    ({"_gguf_rope_dimension_count": 7}, "rotary dimension count 7 must be even"),
    ({"_gguf_rope_dimension_count": 1e308}, "'_gguf_rope_dimension_count' = 1e.308 is out of range"),
    ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu': only SiLU-gated MLPs are supported"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
])
def test_bad_llama_settings_name_the_key(change, needle):
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(CheckpointError, match="y/config.json: .*" + needle.replace("(", r"\(")):
        config_from_hf_dict(dict(base, **change), "y/config.json")


def test_legit_long_contexts_parse():
    assert config_from_hf_dict(dict(V2_OLD_STYLE, max_position_embeddings=163840)).max_position_embeddings == 163840
    assert config_from_hf_dict(dict(V2_OLD_STYLE, max_position_embeddings=MAX_CONTEXT_LENGTH)).max_position_embeddings


def _patch_after_key(path: Path, key: str, fmt: str, value, skip: int = 4) -> Path:
    """Overwrites what follows metadata key `key`'s name, `skip` bytes on (4: its value, after the type)."""
    data = bytearray(path.read_bytes())
    at = data.find(key.encode()) + len(key) + skip
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("key, fmt, value, needle", [
    ("llama.attention.layer_norm_rms_epsilon", "<f", float("nan"), "must be a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", -1e-5, "must be > 0"),
    ("llama.rope.freq_base", "<f", 0.0, "must be > 1"),
    ("llama.rope.freq_base", "<f", float("-inf"), "must be a finite number"),
])
def test_gguf_bad_float_settings_name_the_key(tmp_path, key, fmt, value, needle):
    _fails(_patch_after_key(_small_gguf(tmp_path / "m.gguf"), key, fmt, value), f"'{key}'", needle)


@pytest.mark.parametrize("kv, needle", [
    ({"context_length": 2**32 - 1}, "'llama.context_length' = 4294967295 is larger than any supported context"),
    ({"context_length": 0}, "'llama.context_length' must be > 0"),
    ({"attention.head_count_kv": 0}, "'llama.attention.head_count_kv' must be > 0"),
    ({"feed_forward_length": 0}, "'llama.feed_forward_length' must be > 0"),
    ({"attention.head_count": 64}, "'llama.embedding_length' = 32 and 'llama.attention.head_count' = 64 leave heads "
                                   "of no size"),  # was a ZeroDivisionError
])
def test_gguf_bad_int_settings_name_the_key(tmp_path, kv, needle):
    _fails(_small_gguf(tmp_path / "m.gguf", kv=kv), needle)


def test_gguf_nan_rope_factor(tmp_path):
    key = "llama.rope.scaling.factor"
    p = _small_gguf(tmp_path / "m.gguf", kv={"rope.scaling.factor": 2})  # written as u32: make it f32 NaN
    _patch_after_key(p, key, "<I", 6, skip=0)  # its value type: FLOAT32 (4 bytes, as UINT32)
    _patch_after_key(p, key, "<f", float("nan"))
    _fails(p, f"'{key}'", "finite")


# ----------------------------------------------------------------------------- GGUF layout


def _offset_field(data: bytes, r: gguf.GGUFReader, name: str) -> int:
    """Byte position of tensor `name`'s u64 data offset in its tensor info."""
    pos = next(t for t in r.tensors if t.name == name).field.offset
    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def test_gguf_overlapping_tensor_data_is_refused(tmp_path):
    p = _small_gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    r = gguf.GGUFReader(p)
    up = struct.unpack_from("<Q", data, _offset_field(data, r, "blk.0.ffn_up.weight"))[0]
    struct.pack_into("<Q", data, _offset_field(data, r, "blk.0.ffn_down.weight"), up)  # same size: in range
    p.write_bytes(bytes(data))
    _fails(p, "overlaps", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight")


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_gguf_tensor_of_a_type_not_read_here_is_one_clear_error(tmp_path, native, caplog):
    """A dense weight in a block type no decoder here reads (MXFP4): one error naming the file once and the
    file's tensor, without first a warning that the weight would be decoded to bf16."""
    from models.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", "tiny-llama", seed=5, gguf=True, gguf_qtype="Q8_0") / "model.gguf"
    data = bytearray(path.read_bytes())
    r = gguf.GGUFReader(path)
    name = next(t.name for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and ".attn_q." in t.name)
    # MXFP4 blocks are half the size of Q8_0's: the retyped tensor stays inside its own bytes
    struct.pack_into("<I", data, _offset_field(data, r, name) - 4, int(gguf.GGMLQuantizationType.MXFP4))
    path.write_bytes(bytes(data))
    msg = _load_fails(path, native, f"tensor '{name}': type MXFP4 is not supported (supported: ")
    assert msg.count(str(path)) == 1, msg
    assert "decoded to bf16" not in caplog.text


def test_gguf_types_not_read_here_are_refused_at_the_header(tmp_path):
    """Tensors of types no decoder here reads, late in the file (a mixed-quant file's last layers): refused when
    the header is read, naming the first and counting the rest, not when the load reaches them."""
    from models.loader.gguf_file import open_gguf
    from models.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", "tiny-llama", seed=5, gguf=True, gguf_qtype="Q8_0") / "model.gguf"
    data = bytearray(path.read_bytes())
    r = gguf.GGUFReader(path)
    q8 = [t.name for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    last = max(int(n.split(".")[1]) for n in q8 if n.startswith("blk."))
    late = [n for n in q8 if n.startswith(f"blk.{last}.")][:2]
    for name in late:  # (MXFP4's blocks are half Q8_0's size: each stays inside its own bytes)
        struct.pack_into("<I", data, _offset_field(data, r, name) - 4, int(gguf.GGMLQuantizationType.MXFP4))
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert f"tensor '{late[0]}': type MXFP4 is not supported (supported: " in msg, msg
    assert "(1 more tensor(s) of MXFP4 too)" in msg and "llama-quantize" in msg, msg


def test_gguf_gap_between_tensors_is_legit(tmp_path):
    """Only overlap is refused: the last tensor moved further out (a gap, aligned) still opens."""
    p = _small_gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    r = gguf.GGUFReader(p)
    last = max(r.tensors, key=lambda t: t.data_offset)
    at = _offset_field(data, r, last.name)
    off = struct.unpack_from("<Q", data, at)[0]
    struct.pack_into("<Q", data, at, off + 64)
    tail = last.data_offset
    data[tail:tail] = bytes(64)  # the same bytes, 64 later
    p.write_bytes(bytes(data))
    ck = GGUFCheckpoint(p)
    assert len(dict(ck.tensors())) == ck.num_tensors()


def test_gguf_tensor_count_one_short_is_refused(tmp_path):
    """A tensor count one too small left the last tensor's info where the padding is: every offset was read
    from an earlier start and the weights loaded silently wrong (the LM head then tied to the embedding)."""
    p = _small_gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    n = struct.unpack_from("<Q", data, 8)[0]
    struct.pack_into("<Q", data, 8, n - 1)
    p.write_bytes(bytes(data))
    _fails(p, f"tensor count ({n - 1})")


@pytest.mark.parametrize("at,what", [(8, "tensor count"), (16, "metadata count")])
def test_gguf_counts_past_what_the_file_holds_are_said_as_such(tmp_path, at, what):
    """A tensor or metadata count of 2^60 was reported as a truncated file ("name of tensor 272 needs ...
    bytes"): the count is what is wrong."""
    p = _small_gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    struct.pack_into("<Q", data, at, 1 << 60)
    p.write_bytes(bytes(data))
    _fails(p, f"the header's {what} {1 << 60} is more than a file of {len(data)} bytes can hold")


def test_gguf_data_past_the_last_tensor_is_refused(tmp_path):
    p = _small_gguf(tmp_path / "m.gguf")
    p.write_bytes(p.read_bytes() + bytes(4096))
    _fails(p, "4096 bytes after the last tensor's data belong to no tensor")


def test_gguf_string_not_utf8_is_a_checkpoint_error(tmp_path):
    """It was a BufferError from closing the mapping while the error still held a view of it (and
    `mlaserve serve` died with a traceback naming neither file nor key)."""
    from models.loader.gguf_file import read_gguf_metadata

    p = _small_gguf(tmp_path / "m.gguf")
    data = p.read_bytes()
    p.write_bytes(data.replace(b"llama.context_length", b"llama.context_lengt\xff", 1))
    for read in (GGUFCheckpoint, read_gguf_metadata):
        with pytest.raises(CheckpointError, match="not valid UTF-8"):
            read(p)


@pytest.mark.parametrize("name, body, needle", [
    ("config.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("config.json", '{"vocab_size": ' + "9" * 5000 + "}", "not valid JSON"),  # past Python's digit limit
    ("config.json", None, "'rms_norm_eps' must be a finite number within float32's range"),  # an integer past a float's range
])
def test_hf_json_files_that_python_cannot_read_name_the_file(llama_dir, tmp_path, name, body, needle):
    d = _copy(llama_dir, tmp_path)
    if body is None:
        cfg = (d / name).read_text()
        body = json.dumps({**json.loads(cfg), "rms_norm_eps": 0}).replace('"rms_norm_eps": 0', '"rms_norm_eps": 1' + "0" * 400)
    (d / name).write_text(body)
    _load_fails(d, False, str(d / name), needle)


def test_a_fifo_named_like_a_shard_is_refused_not_read(llama_dir, tmp_path):
    import os

    d = _copy(llama_dir, tmp_path)
    os.mkfifo(d / "zz.safetensors")
    _load_fails(d, False, "zz.safetensors", "not a regular file")


# ---------------------------------------------------------------------------------- rotary


def _direct(cfg: RopeConfig, positions: list[int]) -> torch.Tensor:
    rot = RotaryEmbedding(cfg, max(positions) + 1)
    rot.set_positions(max(positions) + 1)
    return rot.cos_sin_cache[:, positions]


def test_rotary_table_capped_and_sized_to_the_context():
    cfg = RopeConfig(dim=16, theta=10000.0)
    with torch.device("meta"):
        rot = RotaryEmbedding(cfg, MAX_CONTEXT_LENGTH)
    rot = rot.to_empty(device="cpu")
    assert rot.cos_sin_cache.shape == (2, TABLE_POSITIONS, 8)  # not 2^24 rows
    rot.process_weights_after_loading()
    assert rot.cos_sin_cache.shape == (2, TABLE_POSITIONS, 8)
    full = rot.cos_sin_cache.clone()
    rot.set_positions(4096)  # the served context
    assert rot.cos_sin_cache.shape == (2, 4096, 8) and torch.equal(rot.cos_sin_cache, full[:, :4096])
    with pytest.raises(ValueError, match="outside 1..16777216"):
        rot.set_positions(MAX_CONTEXT_LENGTH + 1)


def test_rotary_grows_on_the_cpu_past_its_table():
    cfg = RopeConfig(dim=8, theta=500000.0)
    rot = RotaryEmbedding(cfg, 1 << 20)
    rot.set_positions(1000)
    pos = torch.tensor([5, 999, 300000])
    cos, sin = rot.cos_sin(pos)
    assert rot.table_positions >= 300001
    ref = _direct(cfg, [5, 999, 300000])
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])


def test_legit_long_context_covers_every_position():
    cfg = config_from_hf_dict(dict(V2_OLD_STYLE, num_hidden_layers=1))  # DeepSeek-V2: 163840, YaRN
    rot = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
    assert rot.cos_sin_cache.shape[1] == 163840
    cos, _ = rot.cos_sin(torch.tensor([163839]))
    assert torch.isfinite(cos).all()


def test_loaded_model_table_follows_set_context_length(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path, {"max_position_embeddings": 1 << 20})
    loaded = _load(d)
    rot = loaded.model.model.rotary_emb
    assert loaded.config.max_position_embeddings == 1 << 20
    assert rot.cos_sin_cache.shape[1] == TABLE_POSITIONS and rot.cos_sin_cache.dtype == torch.float32
    loaded.model.set_context_length(2048)
    assert rot.cos_sin_cache.shape[1] == 2048
    assert math.isclose(float(rot.cos_sin_cache[0, 0, 0]), 1.0)


def test_names_from_a_file_cannot_forge_log_lines_or_drive_a_terminal(tmp_path):
    """A key holding control characters, line breaks and a terminal escape is shown escaped in the error,
    and a megabyte-long one is cut: the message stays one readable line."""
    key = "general.name\x1b[2J\x00\nERROR forged line\u2028"
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key.encode())) + key.encode()
    raw += struct.pack("<I", 99)  # no such value type
    (tmp_path / "evil.gguf").write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(tmp_path / "evil.gguf")
    msg = str(e.value)
    assert "unknown GGUF value type 99" in msg and msg.isprintable(), msg
    assert "general.name\\x1b[2J\\x00\\nERROR forged line\\u2028" in msg
    long_key = "k" * (1 << 20)
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(long_key)) + long_key.encode()
    (tmp_path / "long.gguf").write_bytes(raw + struct.pack("<I", 99))
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(tmp_path / "long.gguf")
    assert len(str(e.value)) < 2100 and "characters in all" in str(e.value)


def test_rope_divisors_below_one_are_refused_not_ignored():
    """llama.cpp divides the frequencies by `rope_freqs`; ones are no scaling, values below one (which
    llama.cpp applies) used to be read as no scaling too."""
    from models.loader.gguf_names import llama3_from_rope_factors

    assert llama3_from_rope_factors([1.0] * 32, 500000.0, 64) == {}
    assert llama3_from_rope_factors([0.5] * 32, 500000.0, 64) is None
    assert llama3_from_rope_factors([1.0] * 31 + [0.9], 500000.0, 64) is None


def test_an_unreadable_shard_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard the server may not read was called corrupt and missing ("not a valid safetensors file
    (truncated or corrupt?): No such file or directory": safetensors' own words for it); now the error is
    the file's. (Simulated: the tests run as root, whom file modes do not stop.)"""
    from models.loader import safetensors_loader
    from models.synthetic import write_checkpoint

    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=2)
    shard = model / "model.safetensors"
    real_open = open

    def guarded(path, *args, **kwargs):
        if Path(path) == shard:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_loader, "open", guarded, raising=False)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*cannot be read: Permission denied"):
        load_model(str(model), device="cpu", dtype="float32", load_tokenizer=False, progress=False)
