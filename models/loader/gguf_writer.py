"""HF directory -> GGUF file, written the way llama.cpp's ``convert_hf_to_gguf.py`` writes it.

Same metadata keys, tensor names, permutations and (for deepseek2) the split ``attn_k_b`` /
``attn_v_b`` form of current llama.cpp, so llama.cpp can load the result and `GGUFCheckpoint`
reads back exactly the HF tensors (F32) or their rounding (other types). See `gguf_names` for the
layout rules shared with the reader.

Flow: config.json -> typed config -> a plan of (GGUF name, shape, type, producer) from
`gn.expected_tensors`, checked against the safetensors names and shapes (a missing, misshapen or
unexpected tensor fails before anything is written) -> metadata + tokenizer + the sampling defaults of
generation_config.json (`general.sampling.*`, see `generation_config`) + tensor infos ->
tensor data, produced and quantized one tensor at a time, so memory holds one tensor (one stacked
expert kind) at a time. The file is written under a temporary name and renamed when complete.

Compared with llama.cpp's converter on the same HF directories, the files hold identical tensors
(names, types, bytes) and metadata, except ``expert_gating_func``, which we always write (llama.cpp
only when config.json names ``scoring_func``, so a V3 config without it would run softmax there).

Tensor types follow llama.cpp: 1-D tensors, ``*_norm.weight``, biases and the router
(``ffn_gate_inp``) stay F32; other matrices take `qtype` (`expert_qtype` for routed experts), or
F16 when their rows are not whole quantization blocks (llama.cpp's fallback).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from tqdm import tqdm

from models.config import DeepseekConfig, LlamaConfig, ModelConfig, MoEConfig, config_from_hf_dict, yarn_get_mscale
from models.loader import gguf_names as gn
from models.loader.errors import CheckpointError
from models.loader.generation_config import gguf_sampling_metadata
from models.loader.jsonfile import read_json
from models.loader.load import moe_layers_as_saved
from models.loader.safetensors_loader import HFCheckpoint

logger = logging.getLogger(__name__)

_T = GGMLQuantizationType
QTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "F32": (_T.F32, LlamaFileType.ALL_F32),
    "F16": (_T.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (_T.BF16, LlamaFileType.MOSTLY_BF16),
    "Q8_0": (_T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (_T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (_T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}


@dataclass
class _Planned:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order
    qtype: GGMLQuantizationType
    sources: list[str]  # HF tensors it is made of (for error messages)
    produce: Callable[[], torch.Tensor]  # float32, GGUF layout


class _Safetensors:
    """The HF checkpoint's tensors by name, read as float32, with the names already converted tracked."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = hf_dir
        self.ckpt = HFCheckpoint(hf_dir)
        self.where = self.ckpt.where()
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def use(self, name: str, shape: tuple[int, ...]) -> str:
        """Marks `name` as converted, after checking it exists with the `shape` the config implies."""
        if name not in self.where:
            raise CheckpointError(self.dir, f"required tensor '{name}' is missing from the safetensors files")
        actual = self.ckpt.shape(name)
        if actual != tuple(shape):
            raise CheckpointError(
                self.where[name], f"tensor '{name}' has shape {list(actual)} but config.json implies {list(shape)}"
            )
        self.used.add(name)
        return name

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name).to(torch.float32)


def _qtype(s: str, arg: str) -> GGMLQuantizationType:
    if s.upper() not in QTYPES:
        raise ValueError(f"{arg}={s!r} is not supported (supported: {', '.join(QTYPES)})")
    return QTYPES[s.upper()][0]


def _tensor_qtype(name: str, shape: tuple[int, ...], q: GGMLQuantizationType, eq: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's choice (``ModelBase.prepare_tensors``): what stays F32, what falls back to F16."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp." in name:
        return _T.F32
    t = eq if "_exps." in name else q
    return t if shape[-1] % GGML_QUANT_SIZES[t][0] == 0 else _T.F16


def write_gguf(hf_dir: str | Path, out_path: str | Path, qtype: str = "F32", *, expert_qtype: str | None = None) -> Path:
    """Converts an HF llama / deepseek_v2 / deepseek_v3 directory into a GGUF file at `out_path`."""
    from models.loader.tokenizer import load_hf_tokenizer, write_tokenizer_gguf

    hf_dir, out = Path(hf_dir), Path(out_path)
    q, eq = _qtype(qtype, "qtype"), _qtype(expert_qtype or qtype, "expert_qtype")
    raw = read_json(hf_dir / "config.json")
    cfg = config_from_hf_dict(raw, str(hf_dir / "config.json"))
    src = _Safetensors(hf_dir)
    cfg = moe_layers_as_saved(cfg, src.where, str(hf_dir / "config.json"))
    plan = _plan(cfg, src, q, eq)
    _check_unused(cfg, src)

    writer = gguf.GGUFWriter(None, _arch(cfg))
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_dir.resolve().name)
    _write_metadata(writer, cfg, raw, hf_dir / "config.json")
    writer.add_file_type(QTYPES[qtype.upper()][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    try:
        write_tokenizer_gguf(writer, load_hf_tokenizer(hf_dir))
    except ValueError as e:  # a tokenizer GGUF cannot express (CheckpointError is a ValueError too)
        raise e if isinstance(e, CheckpointError) else CheckpointError(hf_dir / "tokenizer.json", str(e)) from None
    for key, kind, value in gguf_sampling_metadata(read_json(hf_dir / "generation_config.json", required=False) or {}):
        (writer.add_int32 if kind == "int32" else writer.add_float32)(key, value)  # general.sampling.*
    _pad_vocab(writer, cfg.vocab_size)
    for p in plan:
        block, type_size = GGML_QUANT_SIZES[p.qtype]
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), math.prod(p.shape) // block * type_size, p.qtype)

    tmp = out.with_name(out.name + ".partial")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in tqdm(plan, desc=f"writing {out.name}", unit="tensor", disable=None):
            t = p.produce()
            assert tuple(t.shape) == p.shape, (p.name, p.sources)  # sources were checked by _plan
            data = t.contiguous().numpy()
            writer.write_tensor_data(data if p.qtype == _T.F32 else gguf.quants.quantize(data, p.qtype))
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def _pad_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Pads the token list to the embedding's rows with unused ``[PAD<i>]`` tokens, as llama.cpp's
    converter does: llama.cpp sizes ``token_embd`` by the token count and rejects a mismatch."""
    kv = writer.kv_data[0]
    tokens = kv.get(gguf.Keys.Tokenizer.LIST)
    if tokens is None or len(tokens.value) >= vocab_size:
        return
    n = len(tokens.value)
    tokens.value = list(tokens.value) + [f"[PAD{i}]" for i in range(n, vocab_size)]
    for key, pad in ((gguf.Keys.Tokenizer.TOKEN_TYPE, int(gguf.TokenType.UNUSED)), (gguf.Keys.Tokenizer.SCORES, -1000.0)):
        if key in kv:
            kv[key].value = list(kv[key].value) + [pad] * (vocab_size - n)


def _plan(cfg: ModelConfig, src: _Safetensors, q: GGMLQuantizationType, eq: GGMLQuantizationType) -> list[_Planned]:
    """One entry per GGUF tensor: token_embd, the layers in order, output_norm, output."""
    allowed, required = gn.expected_tensors(cfg, split_kv_b=True)
    req = set(required)
    plan: list[_Planned] = []
    for name, shape in allowed.items():
        if name == gn.ROPE_FREQS:
            if isinstance(cfg, LlamaConfig) and cfg.rope.scaling_type == "llama3":
                r = cfg.rope
                f = gn.llama3_rope_factors(r.theta, r.dim, r.factor, r.low_freq_factor, r.high_freq_factor,
                                           r.original_max_position_embeddings or 8192)
                plan.append(_Planned(name, shape, _T.F32, ["config.json rope_parameters"], lambda f=f: torch.tensor(f)))
            continue
        entry = _producer(cfg, src, name, shape, name in req)
        if entry is not None:
            plan.append(_Planned(name, shape, _tensor_qtype(name, shape, q, eq), *entry))
    order = {"token_embd.weight": 0, "output_norm.weight": 2, "output.weight": 3}
    return sorted(plan, key=lambda p: order.get(p.name, 1))  # stable: layers keep their order


def _producer(
    cfg: ModelConfig, src: _Safetensors, name: str, shape: tuple[int, ...], required: bool
) -> tuple[list[str], Callable[[], torch.Tensor]] | None:
    """(HF sources, function making GGUF tensor `name` of `shape`); None for an optional one HF lacks.

    A required one HF lacks, or any of the wrong shape, raises `CheckpointError` naming the HF tensor.
    """
    if name == "output.weight" and cfg.tie_word_embeddings:
        return None
    layer_id, short = gn.parse_layer_name(name) or (-1, name)
    pre = gn.hf_layer_name(layer_id, "")
    if short in (gn.K_B, gn.V_B):
        assert isinstance(cfg, DeepseekConfig)
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        hf = src.use(pre + gn.KV_B_HF, (cfg.num_attention_heads * (nope + v), cfg.kv_lora_rank))
        part = 0 if short == gn.K_B else 1
        return [hf], lambda: gn.split_kv_b(src.get(hf), cfg.num_attention_heads, nope, v)[part]
    if short.endswith("_exps.weight"):
        return _experts(src, pre, short.split("_")[1], shape)
    hf = gn.GLOBAL_NAMES[name] if layer_id < 0 else pre + gn.LAYER_NAMES[_arch(cfg)][short]
    if not required and hf not in src:
        return None
    src.use(hf, shape)
    kind = short.split(".")[0]
    if isinstance(cfg, LlamaConfig) and _arch(cfg) in gn.PERMUTED_QK_ARCHS and kind in ("attn_q", "attn_k"):
        heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
        return [hf], lambda: gn.permute_qk(src.get(hf), heads)
    if isinstance(cfg, DeepseekConfig) and not cfg.rope.interleaved and kind in ("attn_q", "attn_q_b", "attn_kv_a_mqa"):
        return [hf], lambda: gn.interleave_mla_rope_rows(src.get(hf), cfg, kind == "attn_kv_a_mqa")
    return [hf], lambda: src.get(hf)


def _arch(cfg: ModelConfig) -> str:
    return gn.llama_arch(cfg) if isinstance(cfg, LlamaConfig) else gn.ARCH_DEEPSEEK2


def _experts(
    src: _Safetensors, pre: str, kind: str, shape: tuple[int, ...]
) -> tuple[list[str], Callable[[], torch.Tensor]]:
    """Stacked routed experts `shape` = [E, ...] from per-expert HF tensors or HF v5's fused 3-D ones."""
    fused = pre + ("mlp.experts.down_proj" if kind == "down" else "mlp.experts.gate_up_proj")
    if fused in src:
        if kind == "down":
            return [src.use(fused, shape)], lambda: src.get(fused)
        src.use(fused, (shape[0], 2 * shape[1], shape[2]))
        return [fused], lambda: src.get(fused).chunk(2, dim=1)[0 if kind == "gate" else 1].contiguous()
    names = [src.use(f"{pre}mlp.experts.{e}.{kind}_proj.weight", shape[1:]) for e in range(shape[0])]
    return names, lambda: torch.stack([src.get(n) for n in names])


def _check_unused(cfg: ModelConfig, src: _Safetensors) -> None:
    """Every HF tensor must have gone into the plan, except those llama.cpp's converter drops too."""
    for name in sorted(set(src.where) - src.used):
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # DeepSeek multi-token-prediction layers (skipped like llama.cpp's converter)
        if name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if 0 in src.ckpt.shape(name):  # (transformers saves `n_shared_experts: 0` as empty [h, 0] weights)
            continue
        raise CheckpointError(src.where[name], f"unexpected tensor '{name}' (no GGUF counterpart for this config)")


def _write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, raw: dict[str, Any], cfg_path: Path) -> None:
    """The `<arch>.*` keys ``convert_hf_to_gguf.py`` writes (``TextModel`` + Llama/DeepseekV2 model)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.rope.dim)
    _write_rope_scaling(w, cfg, cfg_path)
    if isinstance(cfg, LlamaConfig):
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        if cfg.moe is not None:
            _write_experts(w, cfg, raw, cfg_path)
        return
    if cfg.attention_bias:
        raise CheckpointError(cfg_path, "attention_bias=true has no deepseek2 GGUF form (llama.cpp has no MLA biases)")
    # MLA is written as MQA over the latent: one KV head of kv_lora_rank + rope dims (llama.cpp).
    w.add_head_count_kv(1)
    # 0 for none, as llama.cpp's converter writes it: llama.cpp requires the key unless the model has
    # DeepSeek-V2-Lite's 27 layers
    w.add_q_lora_rank(cfg.q_lora_rank or 0)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    m = cfg.moe
    if m is None:
        w.add_leading_dense_block_count(cfg.num_hidden_layers)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_expert_shared_count(0)
        return
    _write_router(w, m, raw, cfg_path)


def _write_router(w: gguf.GGUFWriter, m: MoEConfig, raw: dict[str, Any], cfg_path: Path) -> None:
    """The expert keys of DeepSeek's MoE (deepseek2, and GLM-4.5's glm4moe, which routes as DeepSeek-V3)."""
    if not m.shared_size:  # (llama.cpp's deepseek2 refuses the file; its glm4moe computes with absent weights)
        raise CheckpointError(cfg_path, "n_shared_experts is 0: llama.cpp's deepseek2 and glm4moe always compute "
                                        "shared experts, so no GGUF file holds this model")
    if m.moe_layer_freq != 1:
        raise CheckpointError(cfg_path, f"moe_layer_freq={m.moe_layer_freq} has no GGUF key (llama.cpp assumes 1)")
    w.add_leading_dense_block_count(m.first_k_dense_replace)
    w.add_expert_count(m.num_experts)
    w.add_expert_used_count(m.top_k)
    w.add_expert_shared_count(m.num_shared_experts)
    w.add_expert_feed_forward_length(m.intermediate_size)
    if raw.get("n_group") is not None:
        w.add_expert_group_count(m.n_group)
    if raw.get("topk_group") is not None:
        w.add_expert_group_used_count(m.topk_group)
    # Written always (llama.cpp's converter only when config.json names scoring_func): a V3 config
    # without it means sigmoid, and llama.cpp would otherwise assume softmax.
    sigmoid = m.scoring_func == "sigmoid"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_weights_scale(m.routed_scaling_factor)
    if m.norm_topk_prob:
        w.add_expert_weights_norm(True)


def _write_experts(w: gguf.GGUFWriter, cfg: LlamaConfig, raw: dict[str, Any], cfg_path: Path) -> None:
    """The expert keys of Qwen2-MoE (`qwen2moe`), Qwen3-MoE (`qwen3moe`), Mixtral (`llama`, whose experts are
    feed_forward_length wide) and GLM-4.5 (`glm4moe`: DeepSeek's keys). llama.cpp has experts in every layer of each and renormalises the chosen experts'
    weights always (never for qwen2moe): a model that differs would compute otherwise there, so it is refused."""
    m, arch = cfg.moe, gn.llama_arch(cfg)
    assert m is not None
    if arch == gn.ARCH_GLM4MOE:  # (its dense layers are the leading ones, as the config reads them)
        _write_router(w, m, raw, cfg_path)
        return
    if cfg.dense_layers:
        raise CheckpointError(cfg_path, f"layers {sorted(cfg.dense_layers)} keep a dense MLP (mlp_only_layers or "
                                        f"decoder_sparse_step): llama.cpp's {arch} has experts in every layer, so no "
                                        "GGUF file holds this model")
    renormalised = arch != gn.ARCH_QWEN2MOE  # (llama.cpp's qwen2moe never renormalises, the others always)
    if m.norm_topk_prob != renormalised:
        raise CheckpointError(cfg_path, f"norm_topk_prob is {str(m.norm_topk_prob).lower()}: llama.cpp's {arch} "
                                        f"{'always' if renormalised else 'never'} renormalises the chosen experts' "
                                        "weights, so a GGUF file of this model would compute otherwise")
    w.add_expert_count(m.num_experts)
    w.add_expert_used_count(m.top_k)
    if arch != gn.ARCH_LLAMA:  # (Mixtral's experts are feed_forward_length wide)
        w.add_expert_feed_forward_length(m.intermediate_size)
    if m.shared_gate:
        w.add_expert_shared_feed_forward_length(m.shared_size)


def _write_rope_scaling(w: gguf.GGUFWriter, cfg: ModelConfig, cfg_path: Path) -> None:
    """The rope scaling keys, as llama.cpp computes them; a scaling it would compute otherwise is refused."""
    r = cfg.rope
    mla = isinstance(cfg, DeepseekConfig)
    if r.scaling_type == "linear":
        if mla:  # llama.cpp's deepseek2 scales every score by (1 + 0.1 ln factor)^2 under linear scaling
            raise CheckpointError(cfg_path, "linear rope scaling has no deepseek2 GGUF form: llama.cpp's deepseek2 "
                                            "scales attention by (1 + 0.1 ln factor)^2 under it, which transformers "
                                            "does not (only by mscale_all_dim's), so the file would compute otherwise")
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(r.factor)
    elif r.scaling_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_max_position_embeddings or cfg.max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(r.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(r.beta_slow)
        if r.attention_factor is not None:
            if mla:  # (its factor also enters deepseek2's score scale there, unlike transformers')
                raise CheckpointError(cfg_path, "a YaRN attention_factor has no deepseek2 GGUF form llama.cpp "
                                                "computes as transformers does (llama.cpp folds it into the score scale)")
            # transformers multiplies cos and sin by it; llama.cpp (its YaRN context) ignores yarn_attn_factor,
            # which our reader takes for it, and multiplies them by 0.1 ln(factor) + 1 times `rope.scaling.attn_factor`
            w.add_rope_scaling_yarn_attn_factor(r.attention_factor)
            w.add_rope_scaling_attn_factors(r.attention_factor / yarn_get_mscale(r.factor))
        if isinstance(cfg, DeepseekConfig) and r.mscale_all_dim is not None:
            if r.mscale is not None and r.mscale != r.mscale_all_dim:
                logger.warning("rope mscale %s != mscale_all_dim %s: GGUF keeps only the latter", r.mscale, r.mscale_all_dim)
            # llama.cpp's convention (TAG_DEEPSEEK2_YARN_LOG_MUL_FIX): 0.1 * mscale_all_dim.
            w.add_rope_scaling_yarn_log_mul(0.1 * r.mscale_all_dim)
    elif r.scaling_type == "llama3" and isinstance(cfg, DeepseekConfig):
        raise CheckpointError(cfg_path, "llama3 RoPE scaling is not supported for deepseek2 GGUF files")
    elif r.scaling_type == "llama3" and gn.llama_arch(cfg) not in gn.ROPE_FREQS_ARCHS:
        raise CheckpointError(cfg_path, f"llama3 rope scaling has no {gn.llama_arch(cfg)} GGUF form: llama.cpp's "
                                        f"{gn.llama_arch(cfg)} applies no rope_freqs factors, so the file would compute "
                                        "otherwise")
    # llama3 for Llama: the rope_freqs.weight tensor (see _plan), as llama.cpp does.
