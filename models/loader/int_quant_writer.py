"""Writes an unquantized HF directory over as a GPTQ, AWQ or compressed-tensors checkpoint, for the tests and
benchmarks (no model hub here, and none of these quantizers runs without a GPU).

Each linear weight is rounded to the nearest point of its (row, group) grid — round-to-nearest, not GPTQ's
or AWQ's error-compensating search: any codes with any scales make a valid file, and the reader is what is
under test — and stored as the format packs it (`models.loader.int_quant`). The embeddings, the LM head,
norms and MoE routers stay as they are, as those quantizers leave them. Shards are rewritten one at a time
and the index follows them. Each writer returns the value every quantized weight now has
(`scale * (code - zero)`, fp32), the format's definition for the tests' oracles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.loader.int_weights import AWQ_ORDER
from models.loader.weight_files import INDEX_FILE

Quantize = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def quantized(name: str, t: torch.Tensor) -> bool:
    """The linear layers, as GPTQ / AWQ / llm-compressor quantize them: not the embeddings, the LM head, the
    norms or the MoE router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`)."""
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
            and "lm_head" not in name and not name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")))


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 the formats store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Codes [rows, cols] packed along the columns, `32 // bits` a word, lowest bits first; word position k
    holds column `order[k]` of its run (AWQ's interleave) or column k."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, per)
    return _int32(sum(c[:, :, order[k]] << (bits * k) for k in range(per))).contiguous()


def round_to_grid(w: torch.Tensor, bits: int, group: int, symmetric: bool, columns: torch.Tensor | None = None,
                  scale_dtype: torch.dtype = torch.float16, lowest_zero: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] on a grid per (row, group of `group` columns, 0: the whole row): codes [out, in] in
    0..2^bits-1, zeros [out, groups] and scales [out, groups] (`scale_dtype`) with w ~ scale * (code - zero).
    `columns`: each column's group, where groups are not runs (GPTQ's act order). `lowest_zero`: GPTQ's
    original format stores a zero point less one, so it cannot store 0 (its quantizers' known flaw)."""
    out, cols = w.shape
    group = group or cols
    g = columns if columns is not None else torch.arange(cols) // group
    count = int(g.max()) + 1
    top = 2**bits - 1
    w = w.float()
    lo = torch.full((out, count), math.inf).scatter_reduce(1, g.expand(out, -1), w, "amin")
    hi = torch.full((out, count), -math.inf).scatter_reduce(1, g.expand(out, -1), w, "amax")
    if symmetric:
        scale = (torch.maximum(hi.abs(), lo.abs()) / (2 ** (bits - 1) - 1)).clamp(min=1e-4).to(scale_dtype)
        zeros = torch.full((out, count), 2 ** (bits - 1))
    else:
        scale = ((hi - lo) / top).clamp(min=1e-4).to(scale_dtype)
        zeros = (-lo / scale.float()).round().clamp(lowest_zero, top).to(torch.int64)
    codes = (w / scale.float()[:, g]).round().to(torch.int64) + zeros[:, g]
    return codes.clamp(0, top), zeros, scale


def value(codes: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, columns: torch.Tensor | None = None,
          group: int = 0) -> torch.Tensor:
    """The format's definition: scale * (code - zero), fp32."""
    g = columns if columns is not None else torch.arange(codes.shape[1]) // (group or codes.shape[1])
    return scale.float()[:, g] * (codes - zeros[:, g]).float()


def rewrite(d: Path, quantize: Quantize, quantization_config: dict) -> dict[str, torch.Tensor]:
    """Replaces every quantized weight of directory `d` (one file or shards) by the tensors `quantize` makes
    of it, and sets config.json's `quantization_config`. Returns each weight's value (`value`), which
    `quantize` leaves under the weight's own name in what it returns (taken out before writing)."""
    index = d / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    weight_map: dict[str, str] = {}
    want: dict[str, torch.Tensor] = {}
    for file in files:
        out: dict[str, torch.Tensor] = {}
        for name, w in load_file(d / file).items():
            if not quantized(name, w):
                out[name] = w
                continue
            parts = quantize(name, w)
            want[name] = parts.pop("=" + name)
            out |= parts
        save_file(out, d / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, file)
    if index.is_file():
        meta = json.loads(index.read_text())
        index.write_text(json.dumps({**meta, "weight_map": weight_map}, indent=2))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}, indent=2))
    return want


def write_gptq(d: Path, bits: int = 4, group: int = 128, symmetric: bool = True, v2: bool = False,
               act_order: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """GPTQ (AutoGPTQ / GPTQModel layout): `group` -1 for one group a row; `v2` stores zero points as they are
    (the original format stores each less one); `act_order` scatters each group's columns (desc_act)."""
    gen = torch.Generator().manual_seed(seed)

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = w.shape[1]
        gs = group if group > 0 else cols
        columns = None
        if act_order:
            columns = torch.empty(cols, dtype=torch.int64)
            columns[torch.randperm(cols, generator=gen)] = torch.arange(cols) // gs
        codes, zeros, scale = round_to_grid(w, bits, gs, symmetric, columns, lowest_zero=0 if v2 else 1)
        base = name[: -len(".weight")]
        g = columns if columns is not None else torch.arange(cols) // gs
        return {base + ".qweight": pack(codes, bits).t().contiguous(),  # packed along the input dim
                base + ".qzeros": pack((zeros.t() - (0 if v2 else 1)).contiguous(), bits),
                base + ".scales": scale.t().contiguous(), base + ".g_idx": g.to(torch.int32),
                "=" + name: value(codes, zeros, scale, columns, gs)}

    return rewrite(d, quantize, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                                 "sym": symmetric, "checkpoint_format": "gptq_v2" if v2 else "gptq",
                                 "true_sequential": True, "static_groups": False})


def write_awq(d: Path, group: int = 128) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: 4-bit with zero points, packed along the output dim in AWQ's order."""

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, zeros, scale = round_to_grid(w, 4, group, symmetric=False)
        base = name[: -len(".weight")]
        return {base + ".qweight": pack(codes.t().contiguous(), 4, AWQ_ORDER),
                base + ".qzeros": pack(zeros.t().contiguous(), 4, AWQ_ORDER), base + ".scales": scale.t().contiguous(),
                "=" + name: value(codes, zeros, scale, None, group)}

    return rewrite(d, quantize, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                 "version": "gemm", "modules_to_not_convert": None})


def write_compressed_tensors(d: Path, bits: int = 4, group: int | None = 128, symmetric: bool = True,
                             scale_dtype: torch.dtype = torch.bfloat16, fmt: str = "pack-quantized"
                             ) -> dict[str, torch.Tensor]:
    """llm-compressor's files, packed by compressed-tensors' own packer: `pack-quantized` (W4A16 / W8A16;
    `group` None for one scale a row) or `int-quantized` (W8A8: int8 codes, activations quantized per
    token, which mlaserve does not do)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 2 ** (bits - 1)

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, zeros, scale = round_to_grid(w, bits, group or 0, symmetric, scale_dtype=scale_dtype)
        signed, zp = (codes - offset).to(torch.int8), (zeros - offset).to(torch.int8)
        parts = {name + "_scale": scale.contiguous(), "=" + name: value(codes, zeros, scale, None, group or 0)}
        if fmt == "pack-quantized":  # (the parts are named after the weight: X.weight_packed, X.weight_scale, ...)
            parts |= {name + "_packed": pack_to_int32(signed, bits, packed_dim=1),
                      name + "_shape": torch.tensor(list(w.shape))}
            if not symmetric:
                parts[name + "_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
        else:
            parts[name] = signed
            if not symmetric:
                parts[name + "_zero_point"] = zp
        return parts

    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    activations = None if fmt == "pack-quantized" else {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}
    return rewrite(d, quantize, {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt,
                                      "input_activations": activations, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}})


__all__ = ["pack", "quantized", "round_to_grid", "value", "write_awq", "write_compressed_tensors", "write_gptq"]
