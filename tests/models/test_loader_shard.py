"""Tensor-parallel slice reading: `HFCheckpoint.tensors(shard=...)` and `GGUFCheckpoint.tensors(shard=...)`.

The oracle is the same file read whole (itself checked against HF elsewhere): every rank's part must
equal the whole tensor cut by the rank's ranges, exactly, and the parts of an even split concatenated
must give the whole tensor back. Checkpoints get fresh random weights every run (the seed is printed):
small Llama (q/k/v/o biases, so q/k bias rows are unpermuted too) and DeepSeek-V3 (MLA with q_lora,
MoE with shared experts) HF directories, GGUF files written from them by `write_gguf` (F32, Q8_0), and
a mixed file rewritten with `gguf`'s writer: random blocks of K-quants (256-value blocks) and 32-value
types, routed gate/up fused into ``ffn_gate_up_exps``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file
from tests.models.test_gguf_files import _write_tokenizer

from models.config import config_from_hf_dict
from models.loader import gguf_loader
from models.loader.gguf_loader import GGUFCheckpoint
from models.loader.gguf_writer import write_gguf
from models.loader.raw_blocks import RawBlocks
from models.loader.safetensors_loader import HFCheckpoint
from models.loader.shard import SKIP, Shard, shard_shape
from models.synthetic import load_preset, tensor_plan

_LLAMA = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "attention_bias": True,
          "tie_word_embeddings": False}
_DEEPSEEK = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
             "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 64, "kv_lora_rank": 256, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "qk_head_dim": 48,
             "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}
_K_TYPES = (T.Q4_K, T.Q6_K, T.Q5_K)
_SMALL_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16)
_FP16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
                T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


# ----------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(np.random.SeedSequence().entropy % (2**32))
    print(f"test_loader_shard seed {s}")
    return s


def _hf_dir(d: Path, preset: str, overrides: dict, seed: int, dtype: torch.dtype, fuse_experts: bool) -> Path:
    """An HF directory with random weights: Llama in two safetensors shards with an index (bf16),
    DeepSeek with HF v5's fused 3-D experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``)."""
    d.mkdir()
    cfg_dict = {**load_preset(preset), **overrides}
    cfg = config_from_hf_dict(cfg_dict)
    g = torch.Generator().manual_seed(seed)
    tensors = {s.name: (torch.randn(s.shape, generator=g) * s.std + s.mean).to(dtype) for s in tensor_plan(cfg)}
    if fuse_experts:
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            if f"{p}0.gate_proj.weight" not in tensors:
                continue
            e = cfg.moe.num_experts  # type: ignore[union-attr]
            kinds = {k: torch.stack([tensors.pop(f"{p}{j}.{k}_proj.weight") for j in range(e)]) for k in ("gate", "up", "down")}
            tensors[p + "gate_up_proj"] = torch.cat([kinds["gate"], kinds["up"]], dim=1)
            tensors[p + "down_proj"] = kinds["down"]
        save_file(tensors, str(d / "model.safetensors"))
    else:
        names = list(tensors)
        halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
        for f, part in halves.items():
            save_file({n: tensors[n] for n in part}, str(d / f))
        index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps(cfg_dict))
    _write_tokenizer(d)
    return d


def _random_blocks(rng: np.random.Generator, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Random data of `qtype` for values of `shape`, as uint8 [*shape[:-1], row_bytes]; every value finite."""
    if qtype in (T.F16, T.BF16):
        vals = rng.standard_normal(shape).astype(np.float32)
        raw = vals.astype(np.float16).view(np.uint8) if qtype == T.F16 else (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return raw.reshape(*shape[:-1], -1)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (math.prod(shape) // block, type_size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        blocks[:, off : off + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * type_size)


def _mixed_gguf(src: Path, dst: Path, seed: int) -> Path:
    """`src` rewritten with every matrix in random blocks of some quantized type (K-quants where rows
    are whole 256-value blocks) and routed gate/up fused into ``ffn_gate_up_exps`` (llama.cpp's form)."""
    rng = np.random.default_rng(seed)
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in r.tensors}
    k = 0
    for t in r.tensors:
        name, shape = t.name, shapes[t.name]
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            if name.endswith("ffn_up_exps.weight"):
                continue
            e, i, h = shape
            w.add_tensor(name.replace("ffn_gate_exps", "ffn_gate_up_exps"), _random_blocks(rng, T.Q4_K, (e, 2 * i, h)),
                         raw_dtype=T.Q4_K)
        elif len(shape) == 1 or ".ffn_gate_inp." in name:
            w.add_tensor(name, np.array(t.data))
        else:
            kinds = _K_TYPES if shape[-1] % 256 == 0 else _SMALL_TYPES
            qtype = kinds[k % len(kinds)]
            k += 1
            w.add_tensor(name, _random_blocks(rng, qtype, shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, seed: int) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shard")
    llama = _hf_dir(root / "llama", "tiny-llama", _LLAMA, seed, torch.bfloat16, fuse_experts=False)
    ds = _hf_dir(root / "deepseek", "tiny-deepseek-v3", _DEEPSEEK, seed + 1, torch.float32, fuse_experts=True)
    out = {"llama": llama, "deepseek": ds}
    for name, d in (("llama", llama), ("deepseek", ds)):
        out[f"{name}.F32"] = write_gguf(d, root / f"{name}.f32.gguf", "F32")
        out[f"{name}.Q8_0"] = write_gguf(d, root / f"{name}.q8_0.gguf", "Q8_0")
        out[f"{name}.mixed"] = _mixed_gguf(out[f"{name}.F32"], root / f"{name}.mixed.gguf", seed + 2)
    return out


def _open(path: Path) -> HFCheckpoint | GGUFCheckpoint:
    return HFCheckpoint(path) if path.is_dir() else GGUFCheckpoint(path)


# ------------------------------------------------------------------------------- shard functions

Variant = Callable[[str, tuple[int, ...], int, int], Shard | None]


def _pieces(size: int, m: int) -> list[tuple[int, int]] | None:
    """`size` cut into `m` consecutive non-empty pieces (uneven when m does not divide it)."""
    return None if size < m else [(size * k // m, size * (k + 1) // m) for k in range(m)]


def _even(dim_of: Callable[[tuple[int, ...]], int | None]) -> Variant:
    def variant(name: str, shape: tuple[int, ...], n: int, r: int) -> Shard | None:
        dim = dim_of(shape)
        p = None if dim is None else _pieces(shape[dim], n)
        return None if p is None else Shard(dim, (p[r],))  # type: ignore[arg-type]
    return variant


def _two_ranges(name: str, shape: tuple[int, ...], n: int, r: int) -> Shard | None:
    """Rank r takes pieces r and n + r of 2n (like a fused gate_up's gate and up parts)."""
    p = _pieces(shape[0], 2 * n)
    return None if p is None else Shard(0, (p[r], p[n + r]))


VARIANTS: dict[str, Variant] = {
    "rows": _even(lambda s: 0),
    "cols": _even(lambda s: len(s) - 1 if len(s) >= 2 else None),
    "expert_rows": _even(lambda s: 1 if len(s) == 3 else None),
    "two_ranges": _two_ranges,
}
# (variant, ranks): 3 ranks cut rows inside heads, blocks and latent-head groups (the covering paths).
CASES = [("rows", 2), ("rows", 4), ("rows", 3), ("cols", 2), ("cols", 4), ("expert_rows", 2), ("expert_rows", 4),
         ("two_ranges", 2)]


def _cut(t: torch.Tensor, s: Shard | None) -> torch.Tensor:
    return t if s is None else torch.cat([t.narrow(s.dim, a, b - a) for a, b in s.ranges], s.dim)


@pytest.fixture(scope="module")
def whole(files: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """Every file read without a shard function (the oracle)."""
    return {k: dict(_open(p).tensors()) for k, p in files.items()}


def _check_ranks(path: Path, full: dict[str, torch.Tensor], variant: Variant, n: int) -> int:
    """Reads `path` as each of `n` ranks; returns how many tensors were really cut."""
    pieces: dict[str, tuple[int, list[torch.Tensor]]] = {}
    cut = 0
    for r in range(n):
        asked: dict[str, tuple[int, ...]] = {}

        def fn(name: str, shape: tuple[int, ...], r: int = r, asked: dict = asked) -> Shard | None:
            asked[name] = shape
            return variant(name, shape, n, r)

        got = dict(_open(path).tensors(shard=fn))
        assert sorted(asked) == sorted(got) == sorted(full)
        for name, t in got.items():
            assert asked[name] == tuple(full[name].shape), name  # the full HF shape
            s = variant(name, asked[name], n, r)
            want = _cut(full[name], s)
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), (name, s)
            assert t.is_contiguous(), name
            if s is not None:
                pieces.setdefault(name, (s.dim, []))[1].append(t)
                cut += r == 0
    if variant is not _two_ranges:  # an even split: the ranks' parts in order are the whole tensor
        for name, (dim, parts) in pieces.items():
            assert len(parts) == n and torch.equal(torch.cat(parts, dim), full[name]), name
    return cut


# ----------------------------------------------------------------------------------------- tests


def test_shard_validation() -> None:
    assert shard_shape((8, 6), Shard(1, ((0, 2), (4, 6)))) == (8, 4)
    assert Shard(0, [[1, 3]]) == Shard(0, ((1, 3),))  # normalized to tuples
    for bad in [(0, ()), (0, ((3, 3),)), (0, ((-1, 2),)), (-1, ((0, 1),)), (0, ((2, 1),))]:
        with pytest.raises(ValueError):
            Shard(*bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'w'.*outside its size 8"):
        shard_shape((8, 6), Shard(0, ((4, 9),)), "w")
    with pytest.raises(ValueError, match="'w'.*dim 2 does not exist"):
        shard_shape((8, 6), Shard(2, ((0, 1),)), "w")


@pytest.mark.parametrize("variant,n", CASES, ids=[f"{v}-{n}" for v, n in CASES])
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_safetensors_ranks_give_the_whole_tensor(files, whole, arch: str, variant: str, n: int) -> None:
    cut = _check_ranks(files[arch], whole[arch], VARIANTS[variant], n)
    if variant == "expert_rows":
        assert cut == (2 if arch == "deepseek" else 0)  # HF v5's fused 3-D experts of the one MoE layer
    else:
        assert cut > 10


@pytest.mark.parametrize("variant,n", CASES, ids=[f"{v}-{n}" for v, n in CASES])
@pytest.mark.parametrize("kind", ["F32", "Q8_0", "mixed"])
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_gguf_ranks_give_the_whole_tensor(files, whole, arch: str, kind: str, variant: str, n: int) -> None:
    key = f"{arch}.{kind}"
    cut = _check_ranks(files[key], whole[key], VARIANTS[variant], n)
    if variant == "expert_rows":
        assert cut == (3 if arch == "deepseek" else 0)  # stacked gate, up, down of the one MoE layer
    else:
        assert cut > 10


def test_f32_gguf_shards_equal_hf_shards(files, whole) -> None:
    """Independent of the unsharded GGUF read: a rank's part of q/k (heads unpermuted locally) and of
    kv_b_proj (merged from the heads' attn_k_b/attn_v_b rows only) equals the HF tensor's part."""
    hf = {"llama": whole["llama"], "deepseek": dict(whole["deepseek"])}
    for kind in ("gate", "up"):  # HF v5 fused experts -> the reader's stacked names
        fused = hf["deepseek"]["model.layers.1.mlp.experts.gate_up_proj"]
        hf["deepseek"][f"model.layers.1.mlp.experts.{kind}_proj.weight"] = fused.chunk(2, dim=1)[kind == "up"]
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
             "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
             "model.layers.1.mlp.experts.up_proj.weight"]
    for arch in ("llama", "deepseek"):
        for variant, n in CASES:
            for r in range(n):
                def fn(name, shape, r=r, variant=variant, n=n):
                    return VARIANTS[variant](name, shape, n, r) if name in names else SKIP
                got = dict(GGUFCheckpoint(files[f"{arch}.F32"]).tensors(shard=fn))
                assert got and set(got) <= set(names)
                for name, t in got.items():
                    want = _cut(hf[arch][name].float(), VARIANTS[variant](name, tuple(hf[arch][name].shape), n, r))
                    assert torch.equal(t, want), (name, variant, n, r)


def test_skip_is_neither_read_nor_yielded(files, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []
    real = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda raw, q, shape, src, name: decoded.append(name) or real(raw, q, shape, src, name))
    read_hf: list[str] = []
    real_get, real_get_shard = HFCheckpoint.get, HFCheckpoint.get_shard
    monkeypatch.setattr(HFCheckpoint, "get", lambda self, n: read_hf.append(n) or real_get(self, n))
    monkeypatch.setattr(HFCheckpoint, "get_shard", lambda self, n, s: read_hf.append(n) or real_get_shard(self, n, s))

    def fn(name: str, shape: tuple[int, ...]):
        return SKIP if ("experts" in name or "lm_head" in name or "kv_b" in name) else Shard(0, ((0, 1),))

    for key in ("deepseek", "deepseek.mixed"):
        got = dict(_open(files[key]).tensors(shard=fn))
        assert got and not any("experts" in n or "lm_head" in n or "kv_b" in n for n in got)
        assert all(t.shape[0] == 1 for t in got.values())
    assert decoded and not any("exps" in n or n == "output.weight" or "attn_k_b" in n or "attn_v_b" in n for n in decoded)
    assert read_hf and not any("experts" in n or "lm_head" in n for n in read_hf)


@pytest.mark.parametrize("key", ["llama", "deepseek", "llama.Q8_0", "deepseek.mixed"])
def test_ranges_outside_the_tensor_name_it(files, key: str) -> None:
    target = "model.layers.1.mlp.down_proj.weight" if key.startswith("llama") else "model.layers.0.self_attn.kv_b_proj.weight"

    def fn(name: str, shape: tuple[int, ...]):
        return Shard(0, ((0, shape[0] + 1),)) if name == target else None

    with pytest.raises(ValueError, match=f"'{target}'.*outside its size"):
        list(_open(files[key]).tensors(shard=fn))

    def bad_dim(name: str, shape: tuple[int, ...]):
        return Shard(len(shape), ((0, 1),)) if name == target else None

    with pytest.raises(ValueError, match=f"'{target}'.*does not exist"):
        list(_open(files[key]).tensors(shard=bad_dim))
    with pytest.raises(TypeError, match=f"'{target}'"):
        list(_open(files[key]).tensors(shard=lambda n, s: "half" if n == target else None))  # type: ignore[arg-type,return-value]


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """GGUF tensor name -> bytes handed to dequantize."""
    seen: dict[str, int] = {}
    real = gguf_loader.dequantize

    def counted(raw, qtype, shape, source, name):
        seen[name] = seen.get(name, 0) + np.asarray(raw).nbytes
        return real(raw, qtype, shape, source, name)

    monkeypatch.setattr(gguf_loader, "dequantize", counted)
    return seen


def _read_one(path: Path, hf_name: str, shard: Shard | None) -> torch.Tensor:
    got = dict(GGUFCheckpoint(path).tensors(shard=lambda n, s: shard if n == hf_name else SKIP))
    return got[hf_name]


def test_a_half_shard_dequantizes_half_the_bytes(files, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _counting(monkeypatch)
    infos = GGUFCheckpoint(files["llama.mixed"])._infos
    cases = [  # (file, HF name, GGUF names read, shard, fraction of their bytes)
        ("llama.Q8_0", "model.layers.1.mlp.down_proj.weight", ["blk.1.ffn_down.weight"], Shard(0, ((128, 256),)), 0.5),
        ("llama.Q8_0", "model.layers.1.mlp.down_proj.weight", ["blk.1.ffn_down.weight"], Shard(1, ((256, 512),)), 0.5),
        ("llama.Q8_0", "model.layers.0.self_attn.q_proj.weight", ["blk.0.attn_q.weight"], Shard(0, ((64, 128),)), 0.25),
        ("llama.mixed", "model.layers.0.mlp.down_proj.weight", ["blk.0.ffn_down.weight"], Shard(1, ((0, 256),)), 0.5),
        ("llama.mixed", "model.layers.0.mlp.down_proj.weight", ["blk.0.ffn_down.weight"], Shard(0, ((0, 64),)), 0.25),
        ("deepseek.mixed", "model.layers.1.mlp.experts.gate_proj.weight", ["blk.1.ffn_gate_up_exps.weight"], None, 0.5),
        ("deepseek.mixed", "model.layers.1.mlp.experts.up_proj.weight", ["blk.1.ffn_gate_up_exps.weight"],
         Shard(1, ((0, 128),)), 0.25),
        ("deepseek.mixed", "model.layers.1.mlp.experts.up_proj.weight", ["blk.1.ffn_gate_up_exps.weight"],
         Shard(0, ((1, 2),)), 0.125),
        ("deepseek.Q8_0", "model.layers.1.mlp.experts.down_proj.weight", ["blk.1.ffn_down_exps.weight"],
         Shard(2, ((128, 256),)), 0.5),
        ("deepseek.Q8_0", "model.layers.0.self_attn.kv_b_proj.weight", ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"],
         Shard(0, ((128, 256),)), 0.5),
        ("deepseek.Q8_0", "model.layers.0.self_attn.kv_b_proj.weight", ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"],
         Shard(1, ((0, 128),)), 0.5),
    ]
    assert infos["blk.0.ffn_down.weight"].qtype in _K_TYPES  # the mixed file's 512-wide rows are K-quant blocks
    for key, hf, gguf_names, shard, fraction in cases:
        full = {n: GGUFCheckpoint(files[key])._infos[n].nbytes for n in gguf_names}
        seen.clear()
        t = _read_one(files[key], hf, shard)
        assert sorted(seen) == sorted(gguf_names), (hf, shard, seen)
        for n in gguf_names:
            assert seen[n] == full[n] * fraction, (hf, shard, n, seen[n], full[n])
        assert t.shape[shard.dim if shard else 1] == (shard.size if shard else 256)


def test_unaligned_columns_decode_only_the_covering_blocks(files, whole, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cuts inside a block are exact, and still decode only the blocks the range touches."""
    seen = _counting(monkeypatch)
    name, gname = "model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"
    qtype = GGUFCheckpoint(files["llama.mixed"])._infos[gname].qtype
    block = GGML_QUANT_SIZES[qtype][0]
    assert block == 256
    for a, b in [(10, 20), (250, 260), (300, 512), (0, 257)]:
        seen.clear()
        t = _read_one(files["llama.mixed"], name, Shard(1, ((a, b),)))
        assert torch.equal(t, whole["llama.mixed"][name][:, a:b]) and t.is_contiguous()
        blocks = -(-b // block) - a // block
        assert seen[gname] == GGUFCheckpoint(files["llama.mixed"])._infos[gname].nbytes * blocks // 2


def _assert_raw_equal(part: RawBlocks, want: RawBlocks) -> None:
    assert part.qtype == want.qtype and part.shape == want.shape
    assert np.array_equal(part.data, want.data)
    assert torch.equal(part.dequantize(), want.dequantize())


@pytest.mark.parametrize("key", ["deepseek.Q8_0", "deepseek.mixed"])
def test_raw_experts_shards_equal_the_whole_blocks_cut(files, key: str) -> None:
    ck = GGUFCheckpoint(files[key])
    full = {n: t for n, t in ck.tensors(raw_experts=True) if isinstance(t, RawBlocks)}
    assert len(full) == 3
    for dim, ranges in [(0, ((1, 3),)), (0, ((0, 1), (3, 4))), (1, ((0, 16),)), (1, ((16, 32), (100, 256)))]:
        got = dict(GGUFCheckpoint(files[key]).tensors(
            raw_experts=True, shard=lambda n, s, dim=dim, ranges=ranges: Shard(dim, ranges) if n in full else SKIP))
        assert sorted(got) == sorted(full)
        for n, part in got.items():
            assert isinstance(part, RawBlocks)
            lead = (slice(None),) * dim
            data = np.concatenate([full[n][(*lead, slice(a, b))].data for a, b in ranges], dim)
            _assert_raw_equal(part, RawBlocks(full[n].qtype, (*data.shape[:-1], full[n].shape[-1]), data, "", ""))
    # The last dim only at block boundaries: those blocks of every row, or a ValueError naming the
    # tensor and the block size.
    block = {n: GGML_QUANT_SIZES[t.qtype][0] for n, t in full.items()}
    cols = {n: (t.shape[-1] - block[n], t.shape[-1]) for n, t in full.items()}  # the last block
    got = dict(GGUFCheckpoint(files[key]).tensors(
        raw_experts=True, shard=lambda n, s: Shard(2, (cols[n],)) if n in full else SKIP))
    for n, part in got.items():
        a, b = cols[n]
        assert isinstance(part, RawBlocks) and part.shape == (*full[n].shape[:-1], b - a)
        assert torch.equal(part.dequantize(), full[n].dequantize()[..., a:b])
    down = "model.layers.1.mlp.experts.down_proj.weight"
    with pytest.raises(ValueError, match=rf"'{down}'.*multiples of {block[down]}"):
        list(GGUFCheckpoint(files[key]).tensors(
            raw_experts=True, shard=lambda n, s: Shard(2, ((0, 8),)) if n == down else SKIP))


def test_raw_names_q_rows_are_unpermuted_per_local_heads(files, whole) -> None:
    """A `RawBlocks` q_proj cut by rows (inside heads too) is the blocks of the HF rows of that part."""
    q = "model.layers.1.self_attn.q_proj.weight"
    for key in ("llama.Q8_0", "llama.mixed"):
        for ranges in [((0, 64),), ((64, 256),), ((10, 100),), ((192, 256), (0, 64))]:
            got = dict(GGUFCheckpoint(files[key]).tensors(raw_names=frozenset({q}),
                                                         shard=lambda n, s, r=ranges: Shard(0, r) if n == q else SKIP))
            assert isinstance(got[q], RawBlocks)
            assert torch.equal(got[q].dequantize(), torch.cat([whole[key][q][a:b] for a, b in ranges]))


def test_safetensors_reads_only_the_slice(files, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut tensor never goes through the whole-tensor read, and safetensors hands back only the slice."""
    name = "model.layers.1.mlp.experts.gate_up_proj"
    t = HFCheckpoint(files["deepseek"]).get_shard(name, Shard(1, ((64, 128),)))
    assert t.shape == (4, 64, 256) and t.untyped_storage().nbytes() == t.numel() * t.element_size()

    def whole_read(self, n):
        raise AssertionError(f"{n} read whole")

    monkeypatch.setattr(HFCheckpoint, "get", whole_read)
    got = dict(HFCheckpoint(files["llama"]).tensors(shard=lambda n, s: Shard(0, ((0, 1),))))
    assert len(got) == len(tensor_plan(config_from_hf_dict(json.loads((files["llama"] / "config.json").read_text()))))
