"""The GGUF container, read safely: header, metadata and tensor infos, with no tensor decoded.

Every count, length and offset in the file is treated as hostile: checked against the bytes that
remain before anything is allocated or sliced, so a bad file fails with a `CheckpointError` naming
the file and the field. Free of torch on purpose: the HTTP server reads a GGUF's tokenizer through
this module without loading the model stack (`models.loader.gguf_loader` decodes the tensors).

File layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 KV
count; KV pairs (string key, u32 type, value); tensor infos (string name, u32 n_dims, n_dims × u64
ne, u32 ggml type, u64 offset); padding to ``general.alignment`` (default 32); tensor data.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.loader.errors import CheckpointError

# ggml's types (ggml.h) newer than the `gguf` package's list: named when a file holds one
_NEWER_GGML_TYPES = {42: "Q2_0"}

# the block types this server reads (models.loader.gguf_quants decodes each, and checks it has them all): a
# file holding another is refused at its header, not when the load reaches that tensor (the late layers of a
# mixed-quant file came after most of a long load)
READ_TYPES: frozenset[GGMLQuantizationType] = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
    "IQ4_XS"))
_REQUANTIZE = "requantize the model (llama.cpp's llama-quantize) to a type such as Q8_0 or Q4_K_M"

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 3
# a numeric array longer than this is kept as a numpy array: a vocabulary's scores and token types (the
# longest arrays a model needs) read alike either way, and an array nobody reads costs its bytes only
_MAX_LIST_ARRAY = 1 << 16
# GGUF value types: scalar code -> struct format.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32, _BOOL = 8, 9, 6, 7
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: ggml ne reversed
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    part: int = 0  # which file of a split model holds the data (`split_paths`; 0: the first, or the only one)


class _Cursor:
    """Sequential little-endian reads from the mapped file; running past the end is a CheckpointError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(self.path, what)

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"file is truncated: {what} needs {n} bytes at offset {self.pos}, file size is {self.size}"
            )
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, code: int, what: str) -> Any:
        fmt = _SCALAR_FMT[code]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        with self.take(self.scalar(10, f"length of {what}"), what) as raw:  # (released before the error below)
            try:
                return str(raw, "utf-8")
            except UnicodeDecodeError:
                pass
        raise self.fail(f"{what} is not valid UTF-8")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row, read as `string` reads each (the same checks and errors), in one loop:
        a vocabulary's tokens and merges are 100k+ strings, read by the server and the engine at every start."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"length of {what}[{i}]")  # raises: the file is truncated
            (n,) = unpack(buf, pos)
            if pos + 8 + n > size:
                self.pos = pos + 8
                self.take(n, f"{what}[{i}]")  # raises
            try:
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos + 8 + n
                raise self.fail(f"{what}[{i}] is not valid UTF-8") from None
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _FLOAT32:
            # Shortest decimal that round-trips in float32: 1e-6 stays 1e-6, not 9.99999997e-07.
            return f32_round(self.scalar(vtype, what))
        if vtype in _SCALAR_FMT:
            return self.scalar(vtype, what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown GGUF value type {vtype}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        etype = self.scalar(4, f"element type of {what}")
        count = self.scalar(10, f"length of {what}")
        if etype in _SCALAR_NP:
            dt = np.dtype(_SCALAR_NP[etype])
            data = np.frombuffer(self.take(count * dt.itemsize, f"{count} elements of {what}"), dtype=dt)
            if count > _MAX_LIST_ARRAY:  # a copy, not a list of Python numbers (~10x the bytes in the file)
                return (data != 0) if etype == _BOOL else data.copy()
            return data.astype(bool).tolist() if etype == _BOOL else data.tolist()
        if etype not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has unknown GGUF array element type {etype}")
        if count * 8 > self.size - self.pos:  # every string or array element takes at least 8 bytes
            raise self.fail(f"file is truncated: {what} claims {count} elements, more than the file can hold")
        if etype == _STRING:
            return self.strings(count, what)
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]


def parse_gguf(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Header, metadata and tensor infos, every offset and size checked against the file."""
    cur = _Cursor(buf, path)
    if bytes(cur.take(4, "magic")) != _MAGIC:
        raise CheckpointError(path, f"not a GGUF file (magic {bytes(buf[:4])!r}, expected {_MAGIC!r})")
    version = cur.scalar(4, "version")
    if version not in _SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise CheckpointError(path, f"unsupported GGUF version {version}{hint} (supported: 2, 3)")
    num_tensors = cur.scalar(10, "tensor count")
    num_kv = cur.scalar(10, "metadata count")
    # each entry takes some bytes at least (a key: its length, a type, a value; a tensor: its name's length, a
    # dimension count, one dimension, a type, an offset): a count past what the file holds is said as such
    if num_kv * 13 > cur.size - cur.pos:
        raise CheckpointError(path, f"the header's metadata count {num_kv} is more than a file of {cur.size} bytes can "
                              "hold: the file is corrupt")
    metadata: dict[str, Any] = {}
    for i in range(num_kv):
        key = cur.string(f"key of metadata entry {i}")
        if key in metadata:
            raise CheckpointError(path, f"metadata key '{key}' appears twice")
        metadata[key] = cur.value(cur.scalar(4, f"type of metadata key '{key}'"), f"metadata key '{key}'")
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(path, f"metadata key 'general.alignment' must be a power of two, got {alignment!r}")
    if num_tensors * 32 > cur.size - cur.pos:
        raise CheckpointError(path, f"the header's tensor count {num_tensors} is more than a file of {cur.size} bytes "
                              "can hold: the file is corrupt")
    raw_infos = []
    for i in range(num_tensors):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.scalar(4, f"tensor '{name}': number of dimensions")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(path, f"tensor '{name}': {n_dims} dimensions (expected 1..{_MAX_DIMS})")
        ne = [cur.scalar(10, f"tensor '{name}': dimension {d}") for d in range(n_dims)]
        type_code = cur.scalar(4, f"tensor '{name}': type")
        offset = cur.scalar(10, f"tensor '{name}': offset")
        raw_infos.append((name, ne, type_code, offset))
    data_start = -(-cur.pos // alignment) * alignment
    # writers pad with zeros; a tensor count too small leaves a tensor's info there, and every offset
    # would be read from the wrong start (silently wrong weights)
    if any(cur.buf[cur.pos : min(data_start, cur.size)]):
        raise CheckpointError(path, f"the {data_start - cur.pos} padding bytes before the tensor data at offset "
                              f"{cur.pos} are not zeros: the tensor count ({num_tensors}) is wrong or the file is "
                              "corrupt")
    infos: dict[str, TensorInfo] = {}
    unread: dict[str, list[str]] = {}  # type -> the tensors of it no decoder here reads
    for name, ne, type_code, offset in raw_infos:
        if name in infos:
            raise CheckpointError(path, f"tensor '{name}' appears twice")
        try:
            qtype = GGMLQuantizationType(type_code)
        except ValueError:
            known = f"type {_NEWER_GGML_TYPES[type_code]} (ggml type {type_code})" if type_code in _NEWER_GGML_TYPES \
                else f"unknown ggml type {type_code}"
            raise CheckpointError(path, f"tensor '{name}': {known} is not supported; {_REQUANTIZE}") from None
        if qtype not in READ_TYPES:
            unread.setdefault(qtype.name, []).append(name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise CheckpointError(
                path, f"tensor '{name}': row length {ne[0]} is not a multiple of the {qtype.name} block size {block}"
            )
        nbytes = math.prod(ne) // block * type_size
        if offset % alignment:
            raise CheckpointError(path, f"tensor '{name}': offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > cur.size:
            raise CheckpointError(
                path,
                f"tensor '{name}': data runs past the end of the file "
                f"(offset {start} + {nbytes} bytes > file size {cur.size})",
            )
        infos[name] = TensorInfo(name, qtype, tuple(reversed(ne)), start, nbytes)
    if unread:
        (kind, names), *others = unread.items()
        more = len(names) - 1 + sum(len(n) for _, n in others)
        also = f" ({more} more tensor(s) of {', '.join([kind] * (len(names) > 1) + [k for k, _ in others])} too)" \
            if more else ""
        supported = ", ".join(t.name for t in sorted(READ_TYPES))
        raise CheckpointError(path, f"tensor '{names[0]}': type {kind} is not supported (supported: {supported})"
                              f"{also}; {_REQUANTIZE}")
    _check_disjoint(infos, path)
    end = max((info.offset + info.nbytes for info in infos.values()), default=cur.size)
    if cur.size - end >= alignment:  # writers end the file at the last tensor's padding
        raise CheckpointError(path, f"{cur.size - end} bytes after the last tensor's data belong to no tensor: the "
                              f"tensor count ({num_tensors}) or offsets are wrong, or the file is corrupt")
    return metadata, infos


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_MAX_SPLITS = 9999  # llama.cpp's names hold five digits; nobody splits a model into more files than this
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def gguf_stem(name: str) -> str:
    """A GGUF file's name without `.gguf`, and without the part a split model's files add
    (`model-00001-of-00003.gguf` -> `model`): the name of the model the file holds."""
    m = _SPLIT_NAME.match(name)
    if m is not None:
        return m["prefix"]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def split_paths(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """The files of a model split by llama.cpp (`llama-gguf-split`, `convert_hf_to_gguf.py --split-max-*`):
    [path] for a whole file. The first file holds the metadata and names the count; the others are found
    beside it by llama.cpp's names, `<prefix>-00002-of-00005.gguf`. CheckpointError for another file of
    the set than the first (naming the first), a count or name that does not match, or a missing file."""
    count, no = metadata.get(SPLIT_COUNT), metadata.get(SPLIT_NO, 0)
    if count is None:
        return [path]
    for key, value in ((SPLIT_COUNT, count), (SPLIT_NO, no)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_SPLITS:
            raise CheckpointError(path, f"metadata key '{key}' must be an integer in [0, {_MAX_SPLITS}], got {value!r}")
    if count <= 1:
        return [path]
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count or int(m["no"]) != no + 1:
        raise CheckpointError(path, f"the file is part {no + 1} of a model split into {count} files, whose names "
                              f"llama.cpp gives as <name>-{no + 1:05d}-of-{count:05d}.gguf: rename the files so, or "
                              "merge them (llama-gguf-split --merge)")
    suffix = path.name[-len(".gguf"):]  # the parts' names as the first's is written (`.GGUF` too)
    first = path.with_name(f"{m['prefix']}-{1:05d}-of-{count:05d}{suffix}")
    if no != 0:
        raise CheckpointError(path, f"the file is part {no + 1} of a model split into {count} files: give the "
                              f"first, {first.name}, which holds the model's metadata")
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}{suffix}") for i in range(1, count + 1)]


def _check_disjoint(infos: dict[str, TensorInfo], path: Path) -> None:
    """No two tensors' data share a byte (llama.cpp lays them out one after the other, each padded to
    the alignment; one pointing into another's bytes is a corrupt or forged file). Gaps are allowed."""
    spans = sorted((info.offset, info.offset + info.nbytes, info.name) for info in infos.values() if info.nbytes)
    for (_, prev_end, prev), (start, end, name) in zip(spans, spans[1:]):
        if start < prev_end:
            raise CheckpointError(
                path,
                f"tensor '{name}': data at bytes [{start}, {end}) overlaps tensor '{prev}' (which ends at {prev_end}): "
                "the tensor offsets are corrupt; re-create the file",
            )


def f32_round(x: float) -> float:
    """The shortest decimal with the same float32 value: GGUF stores settings as float32, and this
    turns 9.99999997e-07 back into the 1e-06 that was written."""
    return float(str(np.float32(x)))


def map_gguf(path: Path) -> mmap.mmap:
    """The file memory-mapped read-only; a missing, unreadable or too-short file is a CheckpointError."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise CheckpointError(path, f"file is truncated: {size} bytes is too short for a GGUF header")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror or e}") from None


@dataclass
class GGUFFiles:
    """A model's GGUF file, or every file of a split one, mapped and validated: `infos` holds every file's
    tensors, each naming its file (`TensorInfo.part`, an index into `paths` and `bufs`); `metadata` is the
    first file's, which holds the model's."""

    paths: list[Path]
    bufs: list[mmap.mmap]
    metadata: dict[str, Any]
    infos: dict[str, TensorInfo]

    def close(self) -> None:
        for buf in self.bufs:
            _unmap(buf)


def open_gguf(path: Path) -> GGUFFiles:
    """The file at `path` and, for a split model's first file, the other files beside it, each validated
    as a whole file is (its own header, offsets and lengths) and the set checked against the first file's
    count. CheckpointError naming the file at fault; nothing stays mapped then."""
    bufs = [map_gguf(path)]
    try:
        metadata, infos = parse_gguf(bufs[0], path)
        paths = split_paths(path, metadata)
        count = len(paths)
        for i, part in enumerate(paths[1:], 1):
            if not part.exists():
                raise CheckpointError(part, f"missing: it is part {i + 1} of the {count} files of the model split "
                                      f"from {path.name}; put every part in the same folder")
            bufs.append(map_gguf(part))
            meta, more = parse_gguf(bufs[-1], part)
            if (meta.get(SPLIT_NO), meta.get(SPLIT_COUNT)) != (i, count):
                raise CheckpointError(part, f"its metadata says it is part {meta.get(SPLIT_NO)!r} (from 0) of "
                                      f"{meta.get(SPLIT_COUNT)!r} files, not part {i} of {count} as its name: the "
                                      "files come from different splits")
            for name, info in more.items():
                if name in infos:
                    raise CheckpointError(part, f"tensor '{name}' is also in {paths[infos[name].part].name}")
                infos[name] = replace(info, part=i)
        total = metadata.get(SPLIT_TENSORS)
        if count > 1 and total != len(infos):
            raise CheckpointError(path, f"metadata key '{SPLIT_TENSORS}' is {total!r}, but the {count} files hold "
                                  f"{len(infos)} tensors: a part is from another split or corrupt")
    except BaseException:
        for buf in bufs:
            _unmap(buf)
        raise
    return GGUFFiles(paths, bufs, metadata, infos)


def _unmap(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view of it still held by the error under way: unmapped when that goes
        pass


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata of a GGUF file (validated as `parse_gguf` does; of a split model, the first file,
    which holds the model's: another part is refused, naming the first); the mapping is closed after."""
    path = Path(path)
    buf = map_gguf(path)
    try:
        metadata = parse_gguf(buf, path)[0]
        split_paths(path, metadata)
        return metadata
    finally:
        _unmap(buf)
