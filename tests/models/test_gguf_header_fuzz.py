"""The default model's GGUF with bytes of its header, metadata and tensor table overwritten at random
(a fixed seed): opening it and building its tokenizer either works or fails with a `CheckpointError`,
never another exception, and the error is one printable line. Cases that once escaped are kept."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from models.builtin import DEFAULT_MODEL, builtin_model_path
from models.loader.errors import CheckpointError
from models.loader.gguf_file import map_gguf, parse_gguf
from models.loader.gguf_loader import GGUFCheckpoint

HEAD_BYTES = 1 << 21  # covers the default file's metadata and tensor table (data starts at ~1.7 MiB)
KEPT = [[(24, 127)]]  # the first key's length: its name then runs into the binary bytes after it
CASES = 80


def mutations(seed: int, n: int, data_start: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        case = []
        for _ in range(rng.choice([1, 1, 2, 4])):
            pos = rng.choice([rng.randrange(0, 64), rng.randrange(0, data_start),
                              rng.randrange(max(0, data_start - 20000), data_start)])  # the tensor table
            case.append((pos, rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])))
        out.append(case)
    return out


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> tuple[Path, bytes, int]:
    src = builtin_model_path(DEFAULT_MODEL)
    dst = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    shutil.copy(src, dst)
    _, infos = parse_gguf(map_gguf(dst), dst)
    data_start = min(info.offset for info in infos.values())
    return dst, dst.read_bytes()[:HEAD_BYTES], data_start


def test_a_damaged_header_is_a_checkpoint_error_or_loads(copy):
    path, head, data_start = copy
    outcomes = {"loaded": 0, "refused": 0}
    for case in KEPT + mutations(7, CASES, data_start):
        with open(path, "r+b") as f:
            f.write(head)  # undo the last case
            for pos, value in case:
                f.seek(pos)
                f.write(bytes([value]))
        try:
            GGUFCheckpoint(path).tokenizer()
            outcomes["loaded"] += 1
        except CheckpointError as e:
            assert str(e).isprintable() and len(str(e)) < 2100, (case, str(e)[:300])
            outcomes["refused"] += 1
        except Exception as e:  # anything else escaped the checks
            raise AssertionError(f"bytes {case}: {type(e).__name__}: {e}") from e
    assert outcomes["refused"] > CASES // 2, outcomes  # the mutations do reach the checks


def test_a_long_numeric_array_stays_an_array_of_its_bytes(tmp_path):
    """A metadata array of 20M bytes that nothing reads was a Python list (~10x its size in the file, per
    parse); a long numeric array is kept as numpy values, and a short one a list, as before."""
    import struct

    import numpy as np

    def kv_array(key: str, etype: int, values: bytes, count: int) -> bytes:
        k = key.encode()
        return struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, etype, count) + values

    big, small = np.arange(20_000_000, dtype=np.uint8), np.array([3, 1, 2], dtype=np.int32)
    body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 2) + kv_array("x.junk", 0, big.tobytes(), big.size) \
        + kv_array("x.small", 5, small.tobytes(), small.size)
    path = tmp_path / "arrays.gguf"
    path.write_bytes(body + b"\0" * (-len(body) % 32))
    meta, infos = parse_gguf(map_gguf(path), path)
    assert not infos and meta["x.small"] == [3, 1, 2]
    assert isinstance(meta["x.junk"], np.ndarray) and np.array_equal(meta["x.junk"], big)


@pytest.mark.parametrize("code,named", [(42, "type Q2_0 (ggml type 42) is not supported"),
                                        (77, "unknown ggml type 77 is not supported")])
def test_a_tensor_type_newer_than_the_reader_is_named(tmp_path, code, named):
    """llama-quantize writes Q2_0 (ggml type 42), which the gguf package does not list: the refusal was
    'unknown ggml type 42' where every other type is named."""
    import struct

    name = b"blk.0.attn_k.weight"
    body = struct.pack("<4sIQQ", b"GGUF", 3, 1, 0) + struct.pack("<Q", len(name)) + name \
        + struct.pack("<IQQIQ", 2, 64, 4, code, 0)
    path = tmp_path / "newer.gguf"
    path.write_bytes(body + b"\0" * (-len(body) % 32) + b"\0" * 4096)
    with pytest.raises(CheckpointError) as e:
        parse_gguf(map_gguf(path), path)
    assert "blk.0.attn_k.weight" in str(e.value) and named in str(e.value) and "requantize" in str(e.value)


def test_a_string_array_reads_as_the_gguf_package_reads_it_and_each_string_is_checked(tmp_path):
    """A vocabulary's strings are read in one loop (100k+ of them at each start): fresh random strings, UTF-8
    of 1-4 bytes a character, read as the gguf package reads them; a string that is not UTF-8, a string cut
    short and a length cut short each fail naming that string, its byte count and offset."""
    import struct

    import gguf

    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    alphabet = "abcXYZ019 _.\n" + "éßж" + "中文字" + "\U0001F600\U00010348"
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    key = b"tokenizer.ggml.tokens"
    head = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, len(words))
    starts, body = [], bytearray(head)
    for w in words:
        starts.append(len(body))
        raw = w.encode()
        body += struct.pack("<Q", len(raw)) + raw
    path = tmp_path / "strings.gguf"
    path.write_bytes(bytes(body) + b"\0" * (-len(body) % 32))
    meta, _ = parse_gguf(map_gguf(path), path)
    theirs = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.tokens"] == words == [theirs.contents(i) for i in range(len(words))], seed

    i = next(j for j in range(250, 300) if words[j])  # late enough that the count check passes a cut file
    n = len(words[i].encode())
    bad = bytearray(body)
    bad[starts[i] + 8] = 0xFF  # no UTF-8 byte
    what = "metadata key 'tokenizer.ggml.tokens'"
    files = {f"{what}[{i}] is not valid UTF-8": bytes(bad),
             f"file is truncated: {what}[{i}] needs {n} bytes at offset {starts[i] + 8}": bytes(body[:starts[i] + 7 + n]),
             f"file is truncated: length of {what}[{i}] needs 8 bytes at offset {starts[i]}": bytes(body[:starts[i] + 5])}
    for message, data in files.items():
        (tmp_path / "damaged.gguf").write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            parse_gguf(map_gguf(tmp_path / "damaged.gguf"), tmp_path / "damaged.gguf")
        assert message in str(info.value), (seed, str(info.value))
