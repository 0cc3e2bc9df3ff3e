"""HF checkpoint directories: config.json + memory-mapped *.safetensors (single or sharded).

Never unpickles: `.bin`/`.pt` checkpoints are refused with a hint to convert them. The shard index
is treated as untrusted: every file it names must sit inside the directory, and every tensor it maps
must really be in that shard. Block-scaled FP8 weights (`models.loader.fp8`) are dequantized as they are
read; integer-quantized ones (GPTQ, AWQ, compressed-tensors: `models.loader.int_quant`) are read as one
logical `X.weight` each, dequantized, or as ggml blocks for the CPU's kernels (`tensors(raw_names=...)`).
DeepSeek's multi-token-prediction layers, which this engine does not run, are left out.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from models.loader import fp8, int_quant
from models.loader.errors import CheckpointError
from models.loader.int_quant import IntScheme
from models.loader.int_weights import read_int_weight, widest
from models.loader.jsonfile import read_json
from models.loader.quantization import scheme_from_config
from models.loader.raw_blocks import RawBlocks
from models.loader.weight_files import INDEX_FILE, find_shards
from models.loader.shard import SKIP, Shard, ShardFn, resolve, shard_shape

logger = logging.getLogger(__name__)
# safetensors dtypes a weight may be stored in (F8_E4M3 too, with its scales, in an FP8 checkpoint)
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
SCALE_DTYPES = frozenset({"F32", "F16", "BF16"})  # an integer-quantized weight's scales
INT_CHUNK_VALUES = 1 << 22  # an integer-quantized weight is unpacked this many values at a time
_EXPERT_RE = re.compile(r"\.experts\.(0|[1-9][0-9]*)\.(gate|up|down)_proj\.weight$")
# Architectures whose files name tensors otherwise than the models here (transformers' own module names, which
# its loading renames): HF model_type -> (pattern, replacement) rules applied to every stored name. Mixtral's
# `block_sparse_moe.experts.N.w1/w3/w2` are the gate, up and down projections; Qwen2-MoE's one `shared_expert` is
# the shared experts' MLP.
CHECKPOINT_RENAMES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "mixtral": (
        (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    ),
    "qwen2_moe": ((re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts."),),
}
_LAYER_RE = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.")


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], full: tuple[int, int],
                   at: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`q` (a part of an FP8 weight of shape `full`, starting at row, column `at`) times the scales of its
    `block`-sized blocks, in `dtype`. One row block at a time: no full-size fp32 copy of the scales is made."""
    rows, cols = q.shape
    b0, b1 = block
    scale = scale.to(torch.float32).reshape(fp8.grid(full, block))
    col_scale = scale[:, torch.arange(at[1], at[1] + cols) // b1]  # (row blocks, cols)
    out = q.to(torch.float32)
    start = 0
    while start < rows:
        r = at[0] + start
        end = min(rows, start + b0 - r % b0)  # the rest of this row block
        out[start:end].mul_(col_scale[r // b0])
        start = end
    return out.to(dtype)


class HFCheckpoint:
    """An HF model directory, opened lazily; tensors are read shard by shard."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(self.path, "not a directory (expected an HF model directory with config.json)")
        self._config = read_json(self.path / "config.json")
        quant = scheme_from_config(self._config, self.path / "config.json")
        self._fp8 = quant if isinstance(quant, fp8.BlockFP8) else None
        self._int = quant if isinstance(quant, IntScheme) else None
        # what an FP8 weight is dequantized to: fp32 is exact (the model's parameters round it to --dtype
        # as they take it); `load_model` asks for bf16 where the CPU kernels would keep an fp32 weight fp32
        self.dequantize_dtype = torch.float32
        self._shards = find_shards(self.path)
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] | None = None
        self._scales: dict[str, tuple[str, Path]] = {}  # weight name -> its scales' name and shard
        # an integer-quantized weight's name -> its parts by role (`IntScheme.parts`): tensor name and shard
        self._int_parts: dict[str, dict[str, tuple[str, Path]]] = {}
        self._int_fallbacks: dict[str, int] = {}  # why integer-quantized weights were held dequantized -> how many
        self._layout: dict[str, tuple[int, ...]] | None = None
        self._stored: dict[str, str] = {}  # a renamed tensor's name here -> its name in the file (CHECKPOINT_RENAMES)

    def hf_config(self) -> dict[str, Any]:
        return dict(self._config)

    def _open(self, shard: Path):
        try:  # the file's own error first (safetensors says "No such file or directory" for an unreadable one)
            with open(shard, "rb"):
                pass
        except OSError as e:
            raise CheckpointError(shard, f"cannot be read: {e.strerror or e}") from None
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers/offsets
            raise CheckpointError(shard, f"not a valid safetensors file (truncated or corrupt?): {e}") from None

    def _handle(self, shard: Path):
        """A shard kept open for random access (the writer converts tensors in its own order)."""
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        return self._handles[shard]

    def where(self) -> dict[str, Path]:
        """Weight name -> shard holding it, checked against the index and for duplicates; an FP8 weight's
        scales and the multi-token-prediction layers are not among them."""
        if self._where is None:
            where: dict[str, Path] = {}
            for shard, promised in self._shards.items():
                keys = list(self._handle(shard).keys())
                if promised is not None:
                    absent = sorted(set(promised) - set(keys))
                    if absent:
                        raise CheckpointError(shard, f"tensor '{absent[0]}' is listed in {INDEX_FILE} but not in this shard")
                for name in keys if promised is None else promised:
                    if name in where:
                        raise CheckpointError(shard, f"tensor '{name}' appears in more than one shard")
                    where[name] = shard
            self._where = self._model_tensors(where)
        return self._where

    def _model_tensors(self, where: dict[str, Path]) -> dict[str, Path]:
        """`where` less what the model does not load as it is: FP8 scales (kept in `_scales`) and FP8
        activation scales, and DeepSeek's multi-token-prediction layers, which follow the model's last
        layer (`num_nextn_predict_layers` of them: DeepSeek-V3's layer 61) and serve speculative decoding,
        which this engine does not do."""
        if self._fp8 is not None:
            unread = [n for n in where if n.endswith(fp8.UNREAD_SUFFIXES)]
            for name in unread:
                del where[name]
            if unread:
                logger.info("%s: %d FP8 activation / KV-cache scales are not read (activations are not quantized)",
                            self.path, len(unread))
            scales = {n: w for n in where if (w := fp8.weight_of(n)) is not None}
            for name, weight in scales.items():
                if weight not in where or weight in scales:
                    raise CheckpointError(where[name], f"tensor '{name}' scales a tensor '{weight}' that the "
                                                       "checkpoint does not have")
                if weight in self._scales:
                    raise CheckpointError(where[name], f"tensor '{weight}' has two scales ('{name}' and "
                                                       f"'{self._scales[weight][0]}')")
                self._scales[weight] = (name, where.pop(name))
        if self._int is not None:
            self._int_weights(where)
        mtp = self._mtp_layers(where)
        for name in mtp:
            del where[name]
            self._scales.pop(name, None)
            self._int_parts.pop(name, None)
        return self._renamed(where)

    def _renamed(self, where: dict[str, Path]) -> dict[str, Path]:
        """`where` under the names the models here give the tensors (`CHECKPOINT_RENAMES`), the file's own
        remembered for reading (`_key`); the weights' scales and parts follow their weight."""
        rules = CHECKPOINT_RENAMES.get(str(self._config.get("model_type")))
        if not rules:
            return where
        out: dict[str, Path] = {}
        for name, shard in where.items():
            new = name
            for pattern, replacement in rules:
                new = pattern.sub(replacement, new)
            if new in out:
                other = self._stored.get(new, new)
                raise CheckpointError(shard, f"tensors '{other}' and '{name}' are the same weight ('{new}'): the "
                                             "checkpoint holds it twice")
            out[new] = shard
            if new != name:
                self._stored[new] = name
                for table in (self._int_parts, self._scales):
                    if name in table:
                        table[new] = table.pop(name)  # type: ignore[arg-type]
        return out

    def _key(self, name: str) -> str:
        """Tensor `name`'s name in its file."""
        return self._stored.get(name, name)

    def _int_weights(self, where: dict[str, Path]) -> None:
        """Each integer-quantized weight's parts, found by its scales (`X.scales`, `X.weight_scale`), taken out
        of `where` and kept in `_int_parts`; the weight itself is in `where` under its logical name `X.weight`,
        at its codes' shard. A part that is missing is an error naming it; activation and KV-cache scales are
        not read."""
        scheme = self._int
        assert scheme is not None
        unread = [n for n in where if n.endswith(int_quant.UNREAD_SUFFIXES)]
        parts = scheme.parts
        scale_suffix = parts["scales"]
        if scheme.symmetric:  # zero points a symmetric scheme does not use (all zero), where a file has them
            unread += [n for n in where if n.endswith(".weight_zero_point")]
        for name in unread:
            del where[name]
        if unread:
            logger.info("%s: %d activation / KV-cache scales and unused zero points are not read (activations "
                        "are not quantized)", self.path, len(unread))
        for scale_name in [n for n in where if n.endswith(scale_suffix)]:
            base = scale_name[: -len(scale_suffix)]
            found: dict[str, tuple[str, Path]] = {}
            for role, suffix in parts.items():
                name = base + suffix
                if name in where:
                    found[role] = (name, where[name])
                elif role not in scheme.optional_roles:
                    raise CheckpointError(where[scale_name], f"tensor '{scale_name}' has no '{name}' beside it: the "
                                                             f"{scheme.method} checkpoint is incomplete")
            for name, _ in found.values():
                del where[name]
            logical = base + ".weight"
            if logical in where:
                raise CheckpointError(where[logical], f"tensor '{logical}' is stored both quantized and unquantized")
            where[logical] = found["codes"][1]
            self._int_parts[logical] = found

    def _mtp_layers(self, where: dict[str, Path]) -> list[str]:
        """The tensors of the multi-token-prediction layers, checked to be such layers (an `eh_proj` each)."""
        source = self.path / "config.json"
        layers, extra = self._config.get("num_hidden_layers"), self._config.get("num_nextn_predict_layers")
        if extra is None or not isinstance(layers, int):  # (num_hidden_layers is checked with the config)
            return []
        if not isinstance(extra, int) or isinstance(extra, bool) or not 0 <= extra <= 64:
            raise CheckpointError(source, f"key 'num_nextn_predict_layers' must be an integer from 0 to 64, "
                                          f"got {extra!r:.40}")
        found: dict[int, list[str]] = {}
        for name in where:
            if (m := _LAYER_RE.match(name)) and layers <= int(m.group(1)) < layers + extra:
                found.setdefault(int(m.group(1)), []).append(name)
        for layer in sorted(found):
            if f"model.layers.{layer}.eh_proj.weight" not in found[layer]:
                raise CheckpointError(source, f"layer {layer} follows the model's last (num_hidden_layers "
                                              f"{layers}) but is no multi-token-prediction layer (it has no "
                                              "eh_proj): set num_hidden_layers to the layers the weights have")
        names = [n for group in found.values() for n in group]
        if names:
            logger.info("%s: %d tensors of the multi-token-prediction layer(s) (layers %s) are not loaded",
                        self.path, len(names), ", ".join(map(str, sorted(found))))
        return names

    def shape(self, name: str) -> tuple[int, ...]:
        self.where()  # (finds the integer-quantized weights)
        if name in self._int_parts:
            return self._checked_layout()[name]
        return tuple(self._handle(self.where()[name]).get_slice(self._key(name)).get_shape())

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the headers alone (nothing is read), after checking that every
        tensor is stored in a float type: an integer, boolean or FP8 tensor is a CheckpointError
        naming its shard, name and dtype."""
        return dict(self._checked_layout())

    def _checked_layout(self) -> dict[str, tuple[int, ...]]:
        """`layout`, built (every dtype checked) once and shared, not copied."""
        if self._layout is None:
            self._layout = {name: self._int_shape(name) if name in self._int_parts
                            else tuple(self._float_view(name, shard).get_shape())
                            for name, shard in self.where().items()}
        return self._layout

    def _int_shape(self, name: str) -> tuple[int, int]:
        """An integer-quantized weight's [out, in], from its parts' headers (and compressed-tensors' stored
        shape), every part checked to be of the dtype and shape the scheme gives it: a file's sizes are
        hostile, and a packed tensor read with the wrong ones would be garbage, not an error."""
        scheme = self._int
        assert scheme is not None
        views = {role: self._handle(shard).get_slice(n) for role, (n, shard) in self._int_parts[name].items()}
        shapes = {role: tuple(v.get_shape()) for role, v in views.items()}
        dtypes = {role: v.get_dtype() for role, v in views.items()}
        pack = scheme.pack
        codes = shapes["codes"]
        if len(codes) != 2:
            return self._bad_part(name, "codes", f"a matrix, not shape {list(codes)}")
        if scheme.layout == "gptq":
            out, cols = codes[1], codes[0] * pack
        elif scheme.layout == "awq":
            out, cols = codes[1] * pack, codes[0]
        elif scheme.layout == "ct-int8":
            out, cols = codes
        else:
            stored = views["shape"]
            if dtypes["shape"] not in ("I64", "I32") or shapes["shape"] != (2,):
                return self._bad_part(name, "shape", "two integers (I64 or I32)")
            out, cols = (int(v) for v in stored[:].tolist())
            if out != codes[0] or cols <= 0 or -(-cols // pack) != codes[1]:
                return self._bad_part(name, "shape", f"[{codes[0]}, in] with in packed as {codes[1]} words of "
                                                     f"{pack} codes, not {[out, cols]}")
        if out <= 0 or cols <= 0:
            return self._bad_part(name, "codes", f"a non-empty matrix, not shape {list(codes)}")
        groups = -(-cols // scheme.group_size) if scheme.group_size else 1
        column_major = scheme.layout in ("gptq", "awq")
        want = {"codes": ("I8" if scheme.layout == "ct-int8" else "I32", codes),
                "scales": (SCALE_DTYPES, (groups, out) if column_major else (out, groups)),  # (per tensor: below)
                "groups": (("I32", "I64"), (cols,))}
        if "zeros" in shapes:
            if column_major:
                zeros = (groups, -(-out // pack))
            elif scheme.layout == "ct-packed":
                zeros = (-(-out // pack), groups)
            else:
                zeros = (out, groups)
            want["zeros"] = ("I8" if scheme.layout == "ct-int8" else "I32", zeros)
        if scheme.per_tensor and math.prod(shapes["scales"]) == 1:
            want["scales"] = (SCALE_DTYPES, shapes["scales"])
        for role, (dtype, shape) in want.items():
            if role not in shapes:
                continue
            dtype_ok = dtypes[role] in dtype if isinstance(dtype, frozenset | tuple) else dtypes[role] == dtype
            if not dtype_ok or shapes[role] != shape:
                kinds = dtype if isinstance(dtype, str) else " or ".join(sorted(dtype))
                self._bad_part(name, role, f"{kinds} {list(shape)}, not {dtypes[role]} {list(shapes[role])} "
                                           f"({scheme.describe()}, weight [{out}, {cols}])")
        return (out, cols)

    def _bad_part(self, name: str, role: str, want: str) -> tuple[int, int]:
        part, shard = self._int_parts[name][role]
        raise CheckpointError(shard, f"tensor '{part}' (the {role} of '{name}') must be {want}")

    def num_values(self) -> int:
        """How many values the checkpoint's tensors hold, together."""
        return sum(math.prod(s) for s in self.layout().values())

    def _float_view(self, name: str, shard: Path):
        view = self._handle(shard).get_slice(self._key(name))
        dtype = view.get_dtype()
        if dtype == fp8.WEIGHT_DTYPE and self._fp8 is not None:
            self._check_scales(name, shard, tuple(view.get_shape()))
        elif dtype not in FLOAT_DTYPES:
            hint = ("an FP8 weight needs config.json's quantization_config (quant_method 'fp8') and its scales"
                    if dtype.startswith("F8") else "integer and boolean tensors, as in quantized checkpoints, "
                                                    "are not loaded: convert it to bf16 safetensors")
            raise CheckpointError(shard, f"tensor '{name}' is stored as {dtype}: weights must be F32, F16 or BF16 "
                                         f"({hint})")
        elif name in self._scales:  # as DeepSeek's converter and transformers: scales apply to FP8 values only
            logger.warning("%s: tensor '%s' is stored as %s, not FP8: its scales '%s' are not applied", shard,
                           name, dtype, self._scales[name][0])
        return view

    def _check_scales(self, name: str, shard: Path, shape: tuple[int, ...]) -> None:
        """An FP8 weight is a matrix with a scale tensor of the block grid's shape beside it."""
        assert self._fp8 is not None
        if name not in self._scales:
            raise CheckpointError(shard, f"FP8 tensor '{name}' has no scales beside it ('{name}_scale_inv' or "
                                         f"'{name}_scale'): the checkpoint is incomplete")
        if len(shape) != 2:
            raise CheckpointError(shard, f"FP8 tensor '{name}' has shape {list(shape)}: only matrices are read")
        scale_name, path = self._scales[name]
        view = self._handle(path).get_slice(scale_name)
        got = tuple(view.get_shape())
        grids = self._fp8.grids(shape)
        fits = any(got == g or (g == (1, 1) and math.prod(got) == 1) for g in grids)
        if view.get_dtype() not in fp8.SCALE_DTYPES or not fits:
            want = " or ".join(str(list(g)) for g in grids)
            raise CheckpointError(
                path, f"tensor '{scale_name}' is {view.get_dtype()} {list(got)}: the scales of the {list(shape)} "
                      f"weight must be {want} (block {list(self._fp8.block or fp8.DEFAULT_BLOCK)}), stored as "
                      f"{', '.join(sorted(fp8.SCALE_DTYPES))}")

    def _dequantized(self, name: str, q: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
        """`q`, an FP8 part of weight `name` starting at row, column `at`, as `dequantize_dtype`."""
        assert self._fp8 is not None
        scale_name, path = self._scales[name]
        scale = self._handle(path).get_tensor(scale_name)
        values = scale.to(torch.float32)
        bad = int((~((values >= 0) & torch.isfinite(values))).sum())  # (NaN is not >= 0)
        if bad:  # (a quantizer writes max|block| / 448: 0 for a block of zeros, never below; NaN is caught too)
            raise CheckpointError(path, f"tensor '{scale_name}' holds {bad} scale(s) that are negative or not "
                                        "finite: the checkpoint is corrupt")
        full = self._checked_layout()[name]
        block = self._fp8.block_of((full[0], full[1]), tuple(scale.shape))
        return dequantize_fp8(q, scale, block, (full[0], full[1]), at, self.dequantize_dtype)

    def _int_weight(self, name: str, rows: tuple[int, int] | None = None):
        """Integer-quantized weight `name`, or its output rows `rows` (a start that is a whole number of
        packed words), unpacked (`models.loader.int_weights.IntWeight`): only those rows' parts are read."""
        scheme = self._int
        assert scheme is not None
        found = self._int_parts[name]
        out, cols = self._checked_layout()[name]
        a, b = rows or (0, out)
        words = slice(a // scheme.pack, -(-b // scheme.pack))
        column_major = scheme.layout in ("gptq", "awq")
        cut = {"codes": ((slice(None), slice(a, b)) if scheme.layout == "gptq" else (slice(None), words)
                         if scheme.layout == "awq" else (slice(a, b),)),
               "zeros": (slice(None), words) if column_major else (words,) if scheme.layout == "ct-packed"
               else (slice(a, b),),
               "scales": (slice(None), slice(a, b)) if column_major else (slice(a, b),)}
        parts = {}
        for role, (part, shard) in found.items():
            try:
                view = self._handle(shard).get_slice(part)
                whole = role not in cut or (role == "scales" and scheme.per_tensor) or rows is None
                parts[role] = view[:] if whole else view[cut[role]]
            except Exception as e:
                raise CheckpointError(shard, f"tensor '{part}' cannot be read: {e}") from None
        return read_int_weight(scheme, parts, (b - a, cols), str(found["scales"][1]),
                               {role: part for role, (part, _) in found.items()})

    def _int_row_chunks(self, name: str) -> list[tuple[int, int]]:
        """Output-row ranges of about `INT_CHUNK_VALUES` values each, starting on whole packed words: a weight is
        unpacked a part at a time (a 128K-row LM head whole would take ~9 bytes a value while converted)."""
        out, cols = self._checked_layout()[name]
        step = max(32, INT_CHUNK_VALUES // max(cols, 1) // 32 * 32)
        return [(a, min(out, a + step)) for a in range(0, out, step)]

    def get_raw(self, name: str) -> torch.Tensor | RawBlocks:
        """Weight `name` as ggml blocks where it is integer-quantized and a block type holds its values exactly
        (`IntWeight.block_type`: the widest any part needs), else as `get` gives it (said once per reason)."""
        self._checked_layout()
        if name not in self._int_parts:
            return self.get(name)
        chunks = self._int_row_chunks(name)
        parts: list[tuple[GGMLQuantizationType, np.ndarray]] = []
        for rows in chunks:
            weight = self._int_weight(name, rows if len(chunks) > 1 else None)
            qtype, why = weight.block_type()
            if qtype is None:
                if why not in self._int_fallbacks:
                    logger.info("%s: integer-quantized weights held dequantized (%s), e.g. '%s'", self.path, why, name)
                self._int_fallbacks[why] = self._int_fallbacks.get(why, 0) + 1
                return self.get(name)
            parts.append((qtype, weight.blocks(qtype)))
        qtype = widest([t for t, _ in parts])
        for i, rows in enumerate(chunks):  # a part whose values a narrower type held is written again in `qtype`
            if parts[i][0] is not qtype:
                parts[i] = (qtype, self._int_weight(name, rows).blocks(qtype))
        data = parts[0][1] if len(parts) == 1 else np.concatenate([b for _, b in parts])
        return RawBlocks(qtype, self._checked_layout()[name], data, str(self.where()[name]), name)

    def get(self, name: str) -> torch.Tensor:
        self._checked_layout()  # every tensor's dtype, checked once for the checkpoint
        if name in self._int_parts:
            chunks = self._int_row_chunks(name)
            if len(chunks) == 1:
                return self._int_weight(name).dequantize(self.dequantize_dtype)
            whole = torch.empty(self._checked_layout()[name], dtype=self.dequantize_dtype)
            for a, b in chunks:
                whole[a:b] = self._int_weight(name, (a, b)).dequantize(self.dequantize_dtype)
            return whole
        shard = self.where()[name]
        try:
            tensor = self._handle(shard).get_tensor(self._key(name))
        except Exception as e:
            raise CheckpointError(shard, f"tensor '{name}' cannot be read: {e}") from None
        return self._dequantized(name, tensor, (0, 0)) if tensor.dtype == torch.float8_e4m3fn else tensor

    def get_shard(self, name: str, shard: Shard) -> torch.Tensor:
        """Only `shard` of tensor `name`, contiguous. `get_slice` indexes the memory-mapped file without
        reading it, so the other ranks' bytes are never copied: a cut along dim 0 stays a view of the
        mapping (as `get` is), any other cut is a copy of just the slice; several ranges are
        concatenated along `shard.dim`."""
        shard_shape(self.shape(name), shard, name)  # ValueError naming the tensor if it does not fit
        if name in self._int_parts:  # packed whole: dequantized, then cut
            full = self.get(name)
            lead = (slice(None),) * shard.dim
            parts = [full[(*lead, slice(a, b))] for a, b in shard.ranges]
            return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
        path = self.where()[name]
        try:
            view = self._handle(path).get_slice(self._key(name))
            lead = (slice(None),) * shard.dim
            parts = [view[(*lead, slice(a, b))] for a, b in shard.ranges]
        except Exception as e:
            raise CheckpointError(path, f"tensor '{name}' cannot be read: {e}") from None
        if parts[0].dtype == torch.float8_e4m3fn:
            self._checked_layout()
            parts = [self._dequantized(name, p, (a, 0) if shard.dim == 0 else (0, a))
                     for p, (a, _) in zip(parts, shard.ranges)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=shard.dim)

    def num_tensors(self) -> int:
        return len(self.where())

    def tensors(self, shard: ShardFn | None = None, raw_names: frozenset[str] = frozenset(),
                raw_experts: bool = False) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
        """Every tensor, shard by shard, memory-mapped; shard handles are closed at the end.

        `shard` (tensor parallelism): called with each name and full shape; SKIP leaves the tensor out
        unread, a `Shard` reads only that part (`get_shard`), None the whole tensor. `raw_names` (the CPU's
        native operators' weights) and, with `raw_experts`, the routed experts' weights come as ggml blocks
        where they are integer-quantized and blocks hold them (`get_raw`)."""
        shapes = self._checked_layout()  # every dtype checked before anything is read
        for name in self.where():
            part = resolve(shard, name, shapes[name]) if shard is not None else None
            if part is SKIP:
                continue
            if part is not None:
                yield name, self.get_shard(name, part)
            elif name in raw_names or raw_experts and _EXPERT_RE.search(name):
                yield name, self.get_raw(name)
            else:
                yield name, self.get(name)
        self._handles.clear()
