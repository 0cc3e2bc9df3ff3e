"""Integer weight-only quantized checkpoints: GPTQ, AWQ and compressed-tensors' packed and int8 formats.

These are the 4- and 8-bit safetensors that vLLM and SGLang serve (`TheBloke/*-GPTQ`, `*-AWQ`, the
`llm-compressor` W4A16 and W8A8 models). Each quantized linear weight `X.weight` is stored as integer codes
`q`, a zero point `z` and a scale `s` per group of input columns; its value is `s * (q - z)`:

- GPTQ (`quant_method: gptq`): `X.qweight` int32 [in / (32 / bits), out], the codes packed along the input
  dim, lowest bits first; `X.qzeros` int32 [groups, out / (32 / bits)] packed along the output dim; `X.scales`
  [groups, out]; `X.g_idx` [in], each input column's group (act-order checkpoints permute them). The original
  format (`checkpoint_format: gptq`) stores each zero point less one; `gptq_v2` stores it as it is.
- AWQ (`quant_method: awq`, `version: gemm`): `X.qweight` int32 [in, out / 8], packed along the output dim in
  AWQ's interleaved order (the 8 nibbles of a word are columns 0, 2, 4, 6, 1, 3, 5, 7); `X.qzeros` [groups, out / 8]
  alike; `X.scales` [groups, out]; groups are runs of `group_size` input columns.
- compressed-tensors (`quant_method: compressed-tensors`): `pack-quantized` stores `X.weight_packed` int32
  [out, in / (32 / bits)] packed along the input dim, codes offset by 2^(bits-1); `X.weight_scale` [out, groups];
  `X.weight_zero_point` [out / (32 / bits), groups] packed along the output dim (asymmetric schemes only; a
  symmetric one's zero is the offset); `X.weight_shape` the weight's [out, in]; `X.weight_g_idx` where the
  scheme had an activation order. `int-quantized` (and its older name `naive-quantized`) stores int8 codes as
  `X.weight` with `X.weight_scale` (and `X.weight_zero_point`) beside it.

What mlaserve does with them (`models.loader.int_weights`): the torch forward, and every GPU run, gets each weight
dequantized while it is read, as an FP8 checkpoint's (vLLM's GPU kernels compute on the codes; mlaserve has no
such kernel). The CPU's native kernels keep the codes as ggml blocks (Q4_0, Q5_0 or Q8_0) wherever those hold
the exact values, so that a 4-bit checkpoint stays 4-bit in memory.

This module is torch-free (the server checks a config before it starts): the scheme, and where each
weight's parts are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.loader.errors import CheckpointError

METHODS = ("gptq", "awq", "compressed-tensors")
BITS = (4, 8)
# compressed-tensors formats whose codes are integers this module reads (float-quantized is FP8's)
PACKED_FORMATS = ("pack-quantized",)
INT8_FORMATS = ("int-quantized", "naive-quantized")
MAX_GROUP = 1 << 20
# a weight's parts, by role, as suffixes of the layer's name (`X` of `X.weight`)
GPTQ_PARTS = {"codes": ".qweight", "zeros": ".qzeros", "scales": ".scales", "groups": ".g_idx"}
CT_PACKED_PARTS = {"codes": ".weight_packed", "scales": ".weight_scale", "zeros": ".weight_zero_point",
                   "shape": ".weight_shape", "groups": ".weight_g_idx"}
CT_INT8_PARTS = {"codes": ".weight", "scales": ".weight_scale", "zeros": ".weight_zero_point",
                 "groups": ".weight_g_idx"}
OPTIONAL_ROLES = frozenset({"groups"})  # (unless the scheme has an activation order)
# compressed-tensors' scales of quantized activations and KV cache: not read (activations run unquantized)
UNREAD_SUFFIXES = (".input_scale", ".input_zero_point", ".input_global_scale", ".output_scale",
                   ".output_zero_point", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class IntScheme:
    """`layout`: how the codes are stored ("gptq", "awq", "ct-packed", "ct-int8"). `group_size`: input columns
    that share a scale, 0 for one scale a row (per channel). `zero_less_one`: GPTQ's original format, whose
    zero points are stored less one. `symmetric`: compressed-tensors without zero points stored (GPTQ and AWQ
    always store them)."""

    method: str
    layout: str
    bits: int
    group_size: int
    zero_less_one: bool = False
    symmetric: bool = False
    act_order: bool = False  # each column's group stored (`g_idx`): it must be there
    per_tensor: bool = False  # one scale for the whole weight (compressed-tensors' `tensor` strategy)

    @property
    def pack(self) -> int:
        """Codes in one int32."""
        return 32 // self.bits

    @property
    def parts(self) -> dict[str, str]:
        """Role -> suffix of the tensors that make one weight."""
        if self.layout in ("gptq", "awq"):
            return {r: s for r, s in GPTQ_PARTS.items() if self.layout == "gptq" or r != "groups"}
        parts = CT_PACKED_PARTS if self.layout == "ct-packed" else CT_INT8_PARTS
        return {r: s for r, s in parts.items() if r != "zeros" or not self.symmetric}

    @property
    def optional_roles(self) -> frozenset[str]:
        """Parts a weight may lack: the group index, unless the scheme has an activation order."""
        return frozenset() if self.act_order else OPTIONAL_ROLES

    @property
    def anchor(self) -> str:
        """The suffix that marks a quantized weight (its codes)."""
        return self.parts["codes"]

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        kind = "symmetric" if self.symmetric else "zero points"
        return f"{self.method} {self.bits}-bit, {group}, {kind}"


def _int(qc: dict[str, Any], keys: tuple[str, ...], where: str, source: Any, default: Any = None) -> Any:
    """The first of `keys` present (checkpoints spell some keys two ways), checked to be an integer."""
    for key in keys:
        if key in qc:
            value = qc[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise CheckpointError(source, f"{where}: {key} must be an integer, got {value!r:.40}")
            return value
    return default


def _group(value: Any, where: str, source: Any) -> int:
    """A group size as stored (-1 or None: per channel) -> `IntScheme.group_size`."""
    if value is None or value == -1:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_GROUP:
        raise CheckpointError(source, f"{where}: group_size must be -1 or an integer from 1 to {MAX_GROUP}, "
                                      f"got {value!r:.40}")
    return value


def _bits(value: Any, where: str, source: Any, allowed: tuple[int, ...] = BITS) -> int:
    if value is None:
        raise CheckpointError(source, f"{where}: bits is missing (how many bits each weight takes)")
    if value not in allowed or isinstance(value, bool):
        raise CheckpointError(source, f"{where}: {value!r:.40}-bit weights are not supported (only "
                                      f"{' and '.join(map(str, allowed))}-bit)")
    return int(value)


def _gptq(qc: dict[str, Any], where: str, source: Any) -> IntScheme:
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(source, f"{where}: checkpoint_format {fmt!r:.40} is not supported (only 'gptq' and "
                                      "'gptq_v2'; a Marlin- or BitBLAS-repacked file is one GPU kernel's layout)")
    if qc.get("is_marlin_format"):
        raise CheckpointError(source, f"{where}: is_marlin_format is not supported (AutoGPTQ's Marlin-repacked "
                                      "file is one GPU kernel's layout): use the model's plain GPTQ files")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(k, str) and k.startswith("-:") for k in dynamic):
        raise CheckpointError(source, f"{where}: per-module overrides ('dynamic') other than modules left "
                                      "unquantized ('-:' rules) are not supported: every quantized layer must share "
                                      "bits and group_size")
    bits = _bits(_int(qc, ("bits",), where, source), where, source)
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise CheckpointError(source, f"{where}: desc_act must be true or false, got {desc_act!r:.40}")
    return IntScheme("gptq", "gptq", bits, _group(qc.get("group_size", 128), where, source),
                     zero_less_one=fmt == "gptq", act_order=desc_act)


def _awq(qc: dict[str, Any], where: str, source: Any) -> IntScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(source, f"{where}: AWQ version {qc.get('version')!r:.40} is not supported (only "
                                      "'gemm', AutoAWQ's default; GEMV files pack for one GPU kernel)")
    if qc.get("zero_point", True) is not True:
        raise CheckpointError(source, f"{where}: zero_point {qc.get('zero_point')!r:.40} is not supported (AWQ's "
                                      "GEMM files have zero points: true)")
    bits = _bits(_int(qc, ("bits", "w_bit"), where, source), where, source, (4,))
    group = _int(qc, ("group_size", "q_group_size"), where, source, 128)
    return IntScheme("awq", "awq", bits, _group(group, where, source))


def compressed_tensors_weights(qc: dict[str, Any], source: Any) -> tuple[str, dict[str, Any]]:
    """A compressed-tensors config's one weight scheme and its format (each config group's own `format`, else
    the config's): groups with different schemes, sparse or transformed weights are refused."""
    where = "config key 'quantization_config'"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(source, f"{where}: config_groups must be a non-empty object")
    for key in ("sparsity_config", "transform_config"):
        sparsity = qc.get(key)
        if sparsity and (key == "transform_config" or not isinstance(sparsity, dict)
                         or sparsity.get("format", "dense") != "dense"):
            raise CheckpointError(source, f"{where}: {key} is not supported (sparse or transformed weights)")
    weights: list[dict[str, Any]] = []
    formats = set()
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise CheckpointError(source, f"{where}: config group {name!r:.40} has no 'weights' object "
                                          "(activation-only quantization is not supported)")
        fmt = group.get("format") or qc.get("format")
        if not isinstance(fmt, str):
            raise CheckpointError(source, f"{where}: config group {name!r:.40} has no format (a string), got "
                                          f"{fmt!r:.40}")
        weights.append(group["weights"])
        formats.add(fmt)
    if len(formats) != 1 or any(w != weights[0] for w in weights):
        raise CheckpointError(source, f"{where}: config groups with different schemes are not supported "
                                      "(every quantized layer must share one)")
    return str(formats.pop()), weights[0]


def _compressed_tensors(qc: dict[str, Any], where: str, source: Any) -> IntScheme:
    fmt, w = compressed_tensors_weights(qc, source)
    if fmt not in PACKED_FORMATS + INT8_FORMATS:
        raise CheckpointError(source, f"{where}: compressed-tensors format {fmt!r:.40} is not supported (only "
                                      f"{', '.join(PACKED_FORMATS + INT8_FORMATS)} integer weights and "
                                      "float-quantized FP8 ones)")
    if w.get("type", "int") != "int":
        raise CheckpointError(source, f"{where}: weights of type {w.get('type')!r:.40} are not supported in "
                                      f"format {fmt!r} (only 'int')")
    if w.get("dynamic", False):
        raise CheckpointError(source, f"{where}: dynamic weight quantization has no stored scales to read")
    packed = fmt in PACKED_FORMATS
    strategy = w.get("strategy")
    strategies = ("group", "channel") if packed else ("group", "channel", "tensor")
    if strategy not in strategies:
        raise CheckpointError(source, f"{where}: weight strategy {strategy!r:.40} is not supported in format "
                                      f"{fmt!r} (only {', '.join(map(repr, strategies))})")
    bits = _bits(w.get("num_bits"), where, source)
    group = _group(w.get("group_size"), where, source) if strategy == "group" else 0
    if strategy == "group" and not group:
        raise CheckpointError(source, f"{where}: strategy 'group' needs a group_size")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise CheckpointError(source, f"{where}: symmetric must be true or false, got {symmetric!r:.40}")
    actorder = w.get("actorder")  # "group" (or true): each column's group is stored; "weight", "static": runs
    if actorder not in (None, False, True, "group", "weight", "static", "dynamic"):
        raise CheckpointError(source, f"{where}: actorder {actorder!r:.40} is not supported")
    return IntScheme("compressed-tensors", "ct-packed" if packed else "ct-int8", bits, group, symmetric=symmetric,
                     act_order=actorder in (True, "group"), per_tensor=strategy == "tensor")


def from_quant_config(qc: dict[str, Any], source: Any) -> IntScheme:
    """The scheme of a `quantization_config` whose quant_method is one of `METHODS`."""
    where = "config key 'quantization_config'"
    method = qc.get("quant_method")
    parse = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}[method]
    return parse(qc, where, source)


__all__ = ["IntScheme", "METHODS", "OPTIONAL_ROLES", "UNREAD_SUFFIXES", "compressed_tensors_weights",
           "from_quant_config"]
