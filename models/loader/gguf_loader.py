"""Reads a GGUF file (llama.cpp's format) as an HF-style checkpoint: config dict, named tensors, tokenizer.

Flow: `GGUFCheckpoint(path)` memory-maps the file and parses it completely up front — header, every
metadata value, every tensor's name/shape/type/offset — treating each count, length and offset as
hostile (checked against the bytes that remain before anything is allocated or sliced). It then
builds the HF ``config.json``-style dict from the ``<arch>.*`` keys, parses it with
`config_from_hf_dict`, and checks every tensor name and shape against that config, so a bad file
fails at open with a `CheckpointError` naming the file and the key or tensor. `tensors()` then
dequantizes lazily, one tensor at a time, and undoes llama.cpp's layout changes (see
`gguf_names`): Llama q/k row permutation, DeepSeek ``attn_k_b``/``attn_v_b`` -> ``kv_b_proj``.
With ``raw_experts`` the routed experts are not decoded but yielded as `RawBlocks` (mmap views).
With a ``shard`` function (tensor parallelism, `models.loader.shard`) each rank reads and decodes
only its part of each tensor: whole rows of blocks, or whole blocks of every row.

The container itself (layout, hostile-length checks) is read by `models.loader.gguf_file`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from models.config import (
    GGUF_ROPE_DIM_KEY,
    GGUF_SOURCE_KEY,
    MAX_CONTEXT_LENGTH,
    ModelConfig,
    config_from_hf_dict,
)
from models.loader import gguf_names as gn
from models.loader.errors import CheckpointError
from models.loader.gguf_file import TensorInfo, f32_round, open_gguf
from models.loader.gguf_quants import dequantize
from models.loader.raw_blocks import RawBlocks
from models.loader.shard import SKIP, Shard, ShardFn, resolve

if TYPE_CHECKING:
    from models.loader.tokenizer import TokenizerBundle

# Routed-expert tensors `tensors(raw_experts=True)` yields undecoded (besides the fused gate_up form).
_EXPERT_TENSORS = frozenset({"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"})


class GGUFCheckpoint:
    """An opened GGUF file (memory-mapped, validated)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = open_gguf(self.path)
        # one mapping per file of a split model (`TensorInfo.part`)
        self.paths, self._bufs, self.metadata, self._infos = files.paths, files.bufs, files.metadata, files.infos
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(self.path, f"metadata key 'general.architecture' is missing or not a string: {arch!r}")
        if arch not in gn.SUPPORTED_ARCHS:
            raise CheckpointError(
                self.path, f"unknown architecture '{arch}' in general.architecture (supported: {', '.join(gn.SUPPORTED_ARCHS)})"
            )
        self.arch: str = arch
        self._hf_config = _hf_config(self.metadata, arch, self._infos, self._read, self.path)
        self._config: ModelConfig = config_from_hf_dict(self._hf_config, str(self.path))
        self._num_hf_tensors = self._check_tensors()

    # ----------------------------------------------------------------------------------- public

    def hf_config(self) -> dict[str, Any]:
        """An HF ``config.json``-style dict (`config_from_hf_dict` accepts it)."""
        return copy.deepcopy(self._hf_config)

    def num_values(self) -> int:
        """How many values the file's tensors hold, together (decoded)."""
        return sum(math.prod(info.shape) for info in self._infos.values())

    def num_tensors(self) -> int:
        """How many tensors `tensors()` yields (for progress bars; fewer when a shard function SKIPs some)."""
        return self._num_hf_tensors

    def tensors(self, raw_experts: bool = False, raw_names: frozenset[str] = frozenset(),
                shard: ShardFn | None = None) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
        """(HF parameter name, float32 CPU tensor in HF layout), one at a time, in file order.

        `raw_experts`: routed-expert tensors come as `RawBlocks` (the file's blocks, not decoded) for
        expert backends that keep them quantized; `raw_names`: so do these HF-named tensors (the CPU's
        native weights, `models.native`). Names and shapes are the same either way; Llama's q/k rows are
        reordered to HF's layout in both forms.

        `shard` (tensor parallelism): called with each HF name and full HF shape; SKIP: the tensor is
        neither read nor yielded; a `Shard`: only that part is yielded, and only the file bytes it needs
        are read and dequantized (whole rows of blocks along leading dims, whole blocks along the last;
        see `_select`). A `RawBlocks` can only be cut at block boundaries of its last dim (ValueError).
        """
        cfg = self._config
        for name, info in self._infos.items():
            if name == gn.ROPE_FREQS:
                continue
            if name in gn.GLOBAL_NAMES:
                hf = gn.GLOBAL_NAMES[name]
                if (part := resolve(shard, hf, info.shape)) is not SKIP:
                    yield hf, self._part(info, part, hf, hf in raw_names)
                continue
            layer_id, short = gn.parse_layer_name(name)  # type: ignore[misc]  # checked at open
            if layer_id >= cfg.num_hidden_layers:
                continue  # a multi-token-prediction block (`nextn_predict_layers`), not read
            if short == gn.V_B:
                continue  # merged into kv_b_proj with attn_k_b
            if short == gn.K_B:
                hf = gn.hf_layer_name(layer_id, gn.KV_B_HF)
                v_info = self._infos[gn.layer_name(layer_id, gn.V_B)]
                heads, rank, nope = info.shape
                if (part := resolve(shard, hf, (heads * (nope + v_info.shape[1]), rank))) is not SKIP:
                    yield hf, self._kv_b(info, v_info, part, hf)
                    for short_hf, blocks in ((gn.K_B_BLOCKS_HF, info), (gn.V_B_BLOCKS_HF, v_info)):
                        blocks_hf = gn.hf_layer_name(layer_id, short_hf)
                        if part is None and blocks_hf in raw_names:  # whole: every head's blocks
                            yield blocks_hf, self._raw(blocks)
            elif short == gn.GATE_UP_EXPS:
                experts, rows, cols = info.shape
                i = rows // 2
                for k, kind in enumerate(("gate", "up")):  # [E, 2I, H]: gate rows first, then up
                    hf = gn.hf_layer_name(layer_id, f"mlp.experts.{kind}_proj.weight")
                    part = resolve(shard, hf, (experts, i, cols))
                    if part is SKIP:
                        continue
                    if part is None and raw_experts:  # a view of the half, named as the fused tensor cut
                        yield hf, self._raw(info)[:, slice(None, i) if k == 0 else slice(i, None)]
                        continue
                    region: list[Ranges | None] = [None, ((k * i, (k + 1) * i),), None]
                    if part is not None:  # HF dim 1 is the half's rows, offset into the fused rows
                        off = k * i if part.dim == 1 else 0
                        region[part.dim] = tuple((off + a, off + b) for a, b in part.ranges)
                    yield hf, self._select(info, region, raw_experts, hf)
            else:
                hf = gn.hf_layer_name(layer_id, gn.LAYER_NAMES[self.arch][short])
                raw = hf in raw_names or raw_experts and short in _EXPERT_TENSORS
                if (part := resolve(shard, hf, info.shape)) is SKIP:
                    continue
                if self.arch in gn.PERMUTED_QK_ARCHS and short.split(".")[0] in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if short.startswith("attn_q") else cfg.num_key_value_heads
                    yield hf, self._qk(info, heads, part, raw, hf)
                else:
                    yield hf, self._part(info, part, hf, raw)

    def tokenizer(self) -> TokenizerBundle:
        from models.loader.tokenizer import tokenizer_from_gguf_metadata

        return tokenizer_from_gguf_metadata(self.metadata, str(self.path))

    # -------------------------------------------------------------------------------- internals

    def _where(self, info: TensorInfo) -> str:
        """The file that holds the tensor's data, for messages."""
        return str(self.paths[info.part])

    def _read(self, info: TensorInfo) -> torch.Tensor:
        raw = np.frombuffer(self._bufs[info.part], dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return dequantize(raw, info.qtype, info.shape, self._where(info), info.name)

    def _raw(self, info: TensorInfo) -> RawBlocks:
        return RawBlocks.from_buffer(self._bufs[info.part], info.offset, info.qtype, info.shape, self._where(info),
                                     info.name)

    def _blocks(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only view [*shape[:-1], row_bytes] of the mapping (nothing copied;
        offset, size and row length were checked against the file at open)."""
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        data = np.frombuffer(self._bufs[info.part], dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)

    def _select(self, info: TensorInfo, region: Sequence[Ranges | None], raw: bool, hf: str) -> torch.Tensor | RawBlocks:
        """Only `region` (per numpy dim: ranges to take in order, None for all) of tensor `info`.

        Leading dims are cut as whole rows of blocks, by slicing the mapped view (several ranges are
        concatenated, copying only those rows); the last dim at block granularity: each range widened
        to whole blocks, those blocks' bytes taken from every row, and the float result cut back to the
        range. Only the selected bytes reach `dequantize`. `raw`: the blocks themselves, undecoded,
        which cannot be cut inside a block (ValueError naming the tensor and the block size).
        """
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        data, shape = self._blocks(info), list(info.shape)
        for d, ranges in enumerate(region[:-1]):
            if ranges is not None:
                data, shape[d] = _take(data, d, ranges), sum(b - a for a, b in ranges)
        cols, cut = region[-1], None
        if cols is not None:
            wide = tuple((a // block * block, -(-b // block) * block) for a, b in cols)
            if wide != tuple(cols):
                if raw:
                    a, b = next(c for c, w in zip(cols, wide) if c != w)
                    raise ValueError(
                        f"tensor '{hf}' (GGUF '{info.name}', {info.qtype.name}) is kept as undecoded blocks of "
                        f"{block} values, so its last dim can only be split at multiples of {block}; "
                        f"shard range [{a}, {b}) is not"
                    )
                cut, base = [], 0  # where each range lies in the concatenated widened ranges
                for (a, b), (wa, wb) in zip(cols, wide):
                    cut.append((base + a - wa, base + b - wa))
                    base += wb - wa
            byte_ranges = tuple((a // block * type_size, b // block * type_size) for a, b in wide)
            data, shape[-1] = _take(data, data.ndim - 1, byte_ranges), sum(b - a for a, b in wide)
        if raw:
            return RawBlocks(info.qtype, tuple(shape), data, self._where(info), info.name + _describe(region))
        t = dequantize(data, info.qtype, shape, self._where(info), info.name)
        return t if cut is None else _cat([t[..., a:b] for a, b in cut], -1)

    def _part(self, info: TensorInfo, part: Shard | None, hf: str, raw: bool) -> torch.Tensor | RawBlocks:
        """Tensor `info` in the file's layout (= HF's), whole or only `part`."""
        if part is None:
            return self._raw(info) if raw else self._read(info)
        region: list[Ranges | None] = [None] * len(info.shape)
        region[part.dim] = part.ranges
        return self._select(info, region, raw, hf)

    def _qk(self, info: TensorInfo, heads: int, part: Shard | None, raw: bool, hf: str) -> torch.Tensor | RawBlocks:
        """Llama q/k (weight or bias) in HF row order. llama.cpp's row permutation stays inside each head,
        so a cut along rows reads the whole heads it touches, unpermutes them with that local head count
        and cuts the range out; a cut along columns commutes with the row permutation."""
        if part is None or part.dim != 0:
            return _unpermute(self._part(info, part, hf, raw), heads)
        head_dim = info.shape[0] // heads
        parts = []
        for a, b in part.ranges:
            lo, hi = a // head_dim * head_dim, -(-b // head_dim) * head_dim
            t = _unpermute(self._part(info, Shard(0, ((lo, hi),)), hf, raw), (hi - lo) // head_dim)
            parts.append(t[a - lo : b - lo])
        return _cat(parts, 0)

    def _kv_b(self, k_info: TensorInfo, v_info: TensorInfo, part: Shard | None, hf: str) -> torch.Tensor:
        """HF kv_b_proj [H*(nope+v), r] from attn_k_b [H, r, nope] and attn_v_b [H, v, r], whole or `part`.

        Rows (dim 0): only the heads the ranges touch are read from both, merged, and cut to the range.
        Latent columns (dim 1): k_b's dim 1 (whole rows of blocks) and v_b's last dim (whole blocks)."""
        if part is None:
            return gn.merge_kv_b(self._read(k_info), self._read(v_info))
        if part.dim == 1:
            k = self._select(k_info, (None, part.ranges, None), False, hf)
            v = self._select(v_info, (None, None, part.ranges), False, hf)
            return gn.merge_kv_b(k, v)  # type: ignore[arg-type]  # raw=False: tensors
        width = k_info.shape[2] + v_info.shape[1]
        parts = []
        for a, b in part.ranges:
            lo, hi = a // width, -(-b // width)
            k = self._select(k_info, (((lo, hi),), None, None), False, hf)
            v = self._select(v_info, (((lo, hi),), None, None), False, hf)
            parts.append(gn.merge_kv_b(k, v)[a - lo * width : b - lo * width])  # type: ignore[arg-type]
        return _cat(parts, 0)  # type: ignore[return-value]

    def _check_tensors(self) -> int:
        """Every tensor known, in range and of the config's shape; every required one present."""
        split_kv_b = f"{self.arch}.attention.key_length_mla" in self.metadata  # llama.cpp's rule
        fused = frozenset(p[0] for p in map(gn.parse_layer_name, self._infos) if p and p[1] == gn.GATE_UP_EXPS)
        expected, required = gn.expected_tensors(self._config, split_kv_b, fused)
        count = 0
        blocks = self._config.num_hidden_layers + self._hf_config["num_nextn_predict_layers"]
        for name, info in self._infos.items():
            parsed = gn.parse_layer_name(name)
            if parsed is not None and self._config.num_hidden_layers <= parsed[0] < blocks:
                continue  # a multi-token-prediction block's: never read
            if parsed is not None and parsed[0] >= self._config.num_hidden_layers:
                raise CheckpointError(
                    self.path,
                    f"tensor '{name}': layer {parsed[0]} is out of range "
                    f"({self.arch}.block_count = {blocks})",
                )
            if name not in expected:
                raise CheckpointError(self.path, f"unknown tensor '{name}' for architecture {self.arch}")
            if info.shape != expected[name]:
                raise CheckpointError(
                    self.path,
                    f"tensor '{name}' has shape {list(info.shape)} but the config expects {list(expected[name])} "
                    f"(numpy order, i.e. ggml ne reversed)",
                )
            short = parsed[1] if parsed else name
            count += {gn.ROPE_FREQS: 0, gn.V_B: 0, gn.GATE_UP_EXPS: 2}.get(short, 1)
        for name in required:
            if name not in self._infos:
                raise CheckpointError(self.path, f"required tensor '{name}' is missing")
        return count



Ranges = tuple[tuple[int, int], ...]


def _take(a: np.ndarray, dim: int, ranges: Ranges) -> np.ndarray:
    """`ranges` of `a` along `dim`, in order: a view for one range, else a copy of only those parts."""
    lead = (slice(None),) * dim
    parts = [a[(*lead, slice(lo, hi))] for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)


def _cat(parts: list[Any], dim: int) -> Any:
    """Float tensors or `RawBlocks` (cut along a leading dim) joined along `dim`."""
    if isinstance(parts[0], RawBlocks):
        if len(parts) == 1:
            return parts[0]
        data = np.concatenate([p.data for p in parts], axis=dim)
        p = parts[0]
        return RawBlocks(p.qtype, (*data.shape[:-1], p.shape[-1]), data, p.source, "+".join(q.name for q in parts))
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)


def _unpermute(t: torch.Tensor | RawBlocks, heads: int) -> torch.Tensor | RawBlocks:
    """llama.cpp's q/k row order -> HF's, for a tensor of `heads` whole heads."""
    if isinstance(t, RawBlocks):  # the same reordering, of whole rows of blocks
        return t.take_rows(gn.unpermute_qk(torch.arange(t.shape[0])[:, None], heads)[:, 0].tolist())
    return gn.unpermute_qk(t, heads)


def _describe(region: Sequence[Ranges | None]) -> str:
    """``[:, 0:16+32:48]``-style suffix naming the part of a tensor taken (for error messages)."""
    if all(r is None for r in region):
        return ""
    return "[" + ", ".join(":" if r is None else "+".join(f"{a}:{b}" for a, b in r) for r in region) + "]"


# ------------------------------------------------------------------ metadata -> HF config dict

_MISSING = object()


class _Keys:
    """Typed reads of `<arch>.*` (and `general.*`/`tokenizer.*`) keys; errors name the key."""

    def __init__(self, metadata: dict[str, Any], arch: str, path: Path) -> None:
        self.md, self.arch, self.path = metadata, arch, path

    def full(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def __contains__(self, key: str) -> bool:
        return self.full(key) in self.md

    def get(self, key: str, typ: type, default: Any = _MISSING) -> Any:
        full = self.full(key)
        if full not in self.md:
            if default is _MISSING:
                raise CheckpointError(self.path, f"required metadata key '{full}' is missing")
            return default
        v = self.md[full]
        if typ is int and isinstance(v, list) and v and all(x == v[0] for x in v):
            v = v[0]  # llama.cpp allows per-layer arrays; only uniform ones fit our configs
        ok = {int: isinstance(v, int) and not isinstance(v, bool),
              float: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(typ, isinstance(v, typ))
        if not ok:
            raise CheckpointError(self.path, f"metadata key '{full}' must be {typ.__name__}, got {str(v)[:80]!r}")
        if typ is float and not math.isfinite(v):
            raise CheckpointError(self.path, f"metadata key '{full}' must be a finite number, got {v!r}")
        return float(v) if typ is float else v

    def positive(self, key: str, typ: type, default: Any = _MISSING, *, above: float = 0) -> Any:
        """`get`, and the value (where present) must be > `above`."""
        v = self.get(key, typ, default)
        if key in self and not v > above:
            raise CheckpointError(self.path, f"metadata key '{self.full(key)}' must be > {above:g}, got {v!r}")
        return v


def _hf_config(
    md: dict[str, Any], arch: str, infos: dict[str, TensorInfo], read: Any, path: Path
) -> dict[str, Any]:
    """The HF config.json-style dict llama.cpp's converter would have started from."""
    k = _Keys(md, arch, path)
    if "token_embd.weight" not in infos:
        raise CheckpointError(path, "required tensor 'token_embd.weight' is missing")
    vocab = infos["token_embd.weight"].shape[0]
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise CheckpointError(
            path, f"metadata key 'tokenizer.ggml.tokens' has {len(tokens)} tokens, more than the {vocab} rows of token_embd"
        )
    hidden, heads = k.positive("embedding_length", int), k.positive("attention.head_count", int)
    ctx = k.positive("context_length", int)
    if ctx > MAX_CONTEXT_LENGTH:
        raise CheckpointError(
            path, f"metadata key '{k.full('context_length')}' = {ctx} is larger than any supported context "
                  f"({MAX_CONTEXT_LENGTH} positions): the file is corrupt; set it to the model's real context length")
    layers = k.positive("block_count", int)
    if layers > len(infos):  # each layer has tensors: stops a hostile count before any loop over it
        raise CheckpointError(path, f"metadata key '{k.full('block_count')}' = {layers} but the file has {len(infos)} tensors")
    # multi-token-prediction blocks (GLM's) follow the model's layers, counted in block_count: not read here
    nextn = k.get("nextn_predict_layers", int, 0)
    if not 0 <= nextn < layers:
        raise CheckpointError(path, f"metadata key '{k.full('nextn_predict_layers')}' = {nextn} must be at least 0 and "
                                    f"less than '{k.full('block_count')}' = {layers}")
    layers -= nextn
    d: dict[str, Any] = {
        GGUF_SOURCE_KEY: True,
        "vocab_size": vocab,
        "hidden_size": hidden,
        # (qwen2moe, qwen3moe: read by llama.cpp only where the experts' keys are absent; every layer is MoE)
        "intermediate_size": k.positive("feed_forward_length", int,
                                        *((1,) if arch in (gn.ARCH_QWEN2MOE, gn.ARCH_QWEN3MOE) else ())),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn,
        "num_attention_heads": heads,
        "rms_norm_eps": k.positive("attention.layer_norm_rms_epsilon", float),
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in infos,
        "bos_token_id": k.get("tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": k.get("tokenizer.ggml.eos_token_id", int, None),
    }
    theta = k.positive("rope.freq_base", float, 10000.0, above=1)  # its log divides YaRN's ramp
    if arch in gn.LLAMA_ARCHS:
        head_dim = k.positive("attention.key_length", int, hidden // heads)
        if head_dim <= 0:  # no key_length, and fewer embedding values than heads
            raise CheckpointError(path, f"metadata keys '{k.full('embedding_length')}' = {hidden} and "
                                        f"'{k.full('attention.head_count')}' = {heads} leave heads of no size")
        rope_dim = k.positive("rope.dimension_count", int, head_dim)
        freqs = None
        if gn.ROPE_FREQS in infos:
            if infos[gn.ROPE_FREQS].shape != (rope_dim // 2,):
                raise CheckpointError(
                    path, f"tensor '{gn.ROPE_FREQS}' has shape {list(infos[gn.ROPE_FREQS].shape)}, expected [{rope_dim // 2}]"
                )
            freqs = read(infos[gn.ROPE_FREQS]).tolist()
        model_type = gn.LLAMA_ARCHS[arch]
        d.update(
            model_type=model_type, head_dim=head_dim,
            architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                            "glm4_moe": "Glm4MoeForCausalLM"}[model_type]],
            num_key_value_heads=k.positive("attention.head_count_kv", int, heads),
            attention_bias="blk.0.attn_q.bias" in infos, mlp_bias="blk.0.ffn_gate.bias" in infos,
            rope_parameters=_rope(k, theta, ctx, freqs, rope_dim, mla=False),
        )
        d[GGUF_ROPE_DIM_KEY] = rope_dim  # (as llama.cpp rotates: no model type's default, glm4_moe's half included)
        if k.get("expert_count", int, 0) and k.get("expert_used_count", int, 0) > k.get("expert_count", int):
            raise CheckpointError(path, f"metadata key '{k.full('expert_used_count')}' = "
                                        f"{k.get('expert_used_count', int)} is more than the "
                                        f"{k.get('expert_count', int)} experts of '{k.full('expert_count')}'")
        if arch == gn.ARCH_LLAMA and k.get("expert_count", int, 0):
            # Mixtral: llama.cpp's `llama` with experts of feed_forward_length in every layer, always renormalised
            d.update(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=None,
                     num_local_experts=k.positive("expert_count", int),
                     num_experts_per_tok=k.positive("expert_used_count", int))
        if arch in (gn.ARCH_QWEN2MOE, gn.ARCH_QWEN3MOE):
            # as llama.cpp computes them: every layer MoE, the chosen experts' weights always renormalised
            # (qwen3moe) or never (qwen2moe), whose shared expert is feed_forward_length wide where no key says
            experts, used = k.positive("expert_count", int), k.positive("expert_used_count", int)
            d.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=arch == gn.ARCH_QWEN3MOE,
                     decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=k.positive(
                         "expert_feed_forward_length", int, d["intermediate_size"] // used))
            if arch == gn.ARCH_QWEN2MOE:
                d.update(qkv_bias="blk.0.attn_q.bias" in infos, shared_expert_intermediate_size=k.positive(
                    "expert_shared_feed_forward_length", int, d["intermediate_size"]))
        if arch == gn.ARCH_GLM4MOE:
            if k.get("expert_gating_func", int, 2) != 2:  # (llama.cpp's default for glm4moe: sigmoid)
                raise CheckpointError(path, f"metadata key '{k.full('expert_gating_func')}' = "
                                            f"{k.get('expert_gating_func', int)}: only sigmoid (2) routing is supported "
                                            "for glm4moe (DeepSeek-V3's, with the routing bias)")
            d.update(use_qk_norm="blk.0.attn_q_norm.weight" in infos, **_router_keys(k, sigmoid=True))
        return d
    rope_dim = k.positive("rope.dimension_count", int)
    # Current files keep MLA's true head sizes in *_mla (key_length/value_length then describe the
    # latent-space MQA view: kv_lora_rank + rope and kv_lora_rank); legacy files in key/value_length.
    if "attention.key_length_mla" in k or "attention.value_length_mla" in k:
        qk_key, qk, v = "attention.key_length_mla", k.get("attention.key_length_mla", int), k.get("attention.value_length_mla", int)
    else:
        qk_key, qk = "attention.key_length", k.get("attention.key_length", int, hidden // heads)
        v = k.get("attention.value_length", int, hidden // heads)
    if qk <= rope_dim:
        raise CheckpointError(
            path, f"metadata key '{k.full(qk_key)}' = {qk} must exceed '{k.full('rope.dimension_count')}' = {rope_dim}"
        )
    gating = k.get("expert_gating_func", int, 0)  # 1: softmax, 2: sigmoid
    if gating not in (0, 1, 2):
        raise CheckpointError(path, f"metadata key '{k.full('expert_gating_func')}' = {gating} is not supported (1 softmax, 2 sigmoid)")
    is_v3 = gating == 2 or any(n.endswith(".exp_probs_b.bias") for n in infos)
    # Absent key: llama.cpp assumes softmax, right for V2; V3 (routing bias present) is sigmoid by
    # design, and its converter only omits the key when config.json omits scoring_func.
    sigmoid = gating == 2 or gating == 0 and is_v3
    d.update(
        model_type="deepseek_v3" if is_v3 else "deepseek_v2",
        architectures=["DeepseekV3ForCausalLM" if is_v3 else "DeepseekV2ForCausalLM"],
        num_key_value_heads=heads,
        q_lora_rank=k.get("attention.q_lora_rank", int, 0) or None,
        kv_lora_rank=k.positive("attention.kv_lora_rank", int),
        qk_nope_head_dim=qk - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=v,
        attention_bias=False, rope_interleave=True,
        rope_parameters=_rope(k, theta, ctx, None, rope_dim, mla=True),
    )
    if k.get("expert_count", int, 0):
        d.update(_router_keys(k, sigmoid, is_v3))
    else:
        d.update(n_routed_experts=0)  # no experts: dense (an absent key would be transformers' 64)
    return d


def _router_keys(k: _Keys, sigmoid: bool, is_v3: bool = True) -> dict[str, Any]:
    """The config keys of DeepSeek's MoE (deepseek2's, glm4moe's) from llama.cpp's expert keys."""
    n_group = k.get("expert_group_count", int, 1) or 1
    return dict(
        n_routed_experts=k.get("expert_count", int),
        num_experts_per_tok=k.get("expert_used_count", int),
        n_shared_experts=k.get("expert_shared_count", int, 0),
        moe_intermediate_size=k.get("expert_feed_forward_length", int),
        first_k_dense_replace=k.get("leading_dense_block_count", int, 0),
        routed_scaling_factor=k.get("expert_weights_scale", float, 1.0),
        norm_topk_prob=k.get("expert_weights_norm", bool, False),
        n_group=n_group,
        topk_group=k.get("expert_group_used_count", int, 1) or 1,
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if is_v3 else "group_limited_greedy" if n_group > 1 else "greedy",
        moe_layer_freq=1,  # llama.cpp has no key for it: every layer after the dense lead is MoE
    )


def _rope(k: _Keys, theta: float, ctx: int, freqs: list[float] | None, dim: int, mla: bool) -> dict[str, Any]:
    """`rope_parameters` from `<arch>.rope.*` keys (llama.cpp: no type + a factor means linear)."""
    p: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    factor = k.positive("rope.scaling.factor", float, None)
    if factor is None:
        factor = k.positive("rope.scale_linear", float, None)  # older files
    stype = k.get("rope.scaling.type", str, "linear" if factor else "none")
    if freqs is not None and stype == "none":
        llama3 = gn.llama3_from_rope_factors(freqs, theta, dim)
        if llama3 is None:
            raise CheckpointError(k.path, f"tensor '{gn.ROPE_FREQS}' does not follow Llama 3 RoPE scaling")
        return {**p, **llama3}
    if stype == "none" or stype == "linear" and factor in (None, 1.0):
        return p
    if stype == "linear":
        return {**p, "rope_type": "linear", "factor": factor}
    if stype != "yarn":
        raise CheckpointError(
            k.path, f"rope scaling type '{stype}' in metadata key '{k.full('rope.scaling.type')}' is not supported"
        )
    p.update(rope_type="yarn", factor=k.positive("rope.scaling.factor", float),
             original_max_position_embeddings=k.positive("rope.scaling.original_context_length", int, ctx))
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("yarn_attn_factor", "attention_factor")):
        if (val := k.get(f"rope.scaling.{key}", float, None)) is not None:
            p[hf] = val
    if mla and (log_mul := k.get("rope.scaling.yarn_log_multiplier", float, None)) is not None:
        # llama.cpp's converter stores 0.1 * mscale_all_dim and drops mscale; released DeepSeek V2/V3
        # configs have mscale == mscale_all_dim (0.707 / 1.0), so both are restored from it.
        p["mscale"] = p["mscale_all_dim"] = f32_round(log_mul / 0.1)
    return p
