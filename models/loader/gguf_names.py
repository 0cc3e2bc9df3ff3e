"""llama.cpp's GGUF conventions, in one place for both directions (reading and writing): tensor
names, the shape llama.cpp requires of each tensor (`expected_tensors`), layout changes, and the
Llama 3 RoPE divisors it stores instead of settings.

Names: GGUF tensors are ``<global name>.weight`` or ``blk.<N>.<layer name>.{weight,bias}``; the
tables below map the part after ``blk.N.`` to the part after ``model.layers.N.`` of the HF
parameter name (the same pairs llama.cpp's ``gguf-py/gguf/tensor_mapping.py`` lists).

Layouts differ from HF in exactly three places, each undone by a pair of functions here:

* Llama ``attn_q``/``attn_k`` rows are permuted: llama.cpp rotates interleaved pairs (x[2i],
  x[2i+1]) while HF Llama rotates half-split pairs (x[i], x[i + d/2]), so the converter reorders
  each head's rows from [first half, second half] to [h0, h0', h1, h1', ...]
  (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``). `permute_qk` / `unpermute_qk`.
* DeepSeek ``kv_b_proj`` [H*(nope+v), r] is split per head into ``attn_k_b`` = k part transposed,
  numpy shape [H, r, nope], and ``attn_v_b`` [H, v, r] (``DeepseekV2Model.modify_tensors``), so
  llama.cpp can absorb it into q and the output. `split_kv_b` / `merge_kv_b`.
* Routed experts are stacked: ``ffn_{gate,up,down}_exps`` hold [E, I, H] / [E, I, H] / [E, H, I]
  (numpy order), i.e. ``torch.stack`` of the per-expert HF matrices.

Shapes here are numpy order (ggml ``ne`` reversed), as `gguf_quants.dequantize` takes them.
The metadata keys themselves are the `gguf` package's (``gguf.Keys``, ``GGUFWriter.add_*``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from models.config import DeepseekConfig, LlamaConfig, ModelConfig
from models.loader.gguf_file import f32_round

ARCH_LLAMA = "llama"
ARCH_QWEN2 = "qwen2"
ARCH_QWEN3 = "qwen3"
ARCH_QWEN2MOE = "qwen2moe"
ARCH_QWEN3MOE = "qwen3moe"
ARCH_GLM4MOE = "glm4moe"
ARCH_DEEPSEEK2 = "deepseek2"
SUPPORTED_ARCHS = (ARCH_LLAMA, ARCH_QWEN2, ARCH_QWEN3, ARCH_QWEN2MOE, ARCH_QWEN3MOE, ARCH_GLM4MOE, ARCH_DEEPSEEK2)
# Llama-family architectures and the HF model_type each is read as; llama.cpp's converter permutes the
# q and k rows of `llama` files only (its other ones rotate half-split, as HF does: rows as stored)
LLAMA_ARCHS = {ARCH_LLAMA: "llama", ARCH_QWEN2: "qwen2", ARCH_QWEN3: "qwen3", ARCH_QWEN2MOE: "qwen2_moe",
               ARCH_QWEN3MOE: "qwen3_moe", ARCH_GLM4MOE: "glm4_moe"}
PERMUTED_QK_ARCHS = (ARCH_LLAMA,)
ROPE_FREQS_ARCHS = (ARCH_LLAMA,)  # the Llama-family architectures whose llama.cpp graph applies `rope_freqs.weight`

# Tensors outside the layers: GGUF name -> HF name.
GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp keeps Llama 3 RoPE scaling as a per-frequency factor tensor (no HF parameter).
ROPE_FREQS = "rope_freqs.weight"

_ATTN_LLAMA = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_FFN_DENSE = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
# A MoE layer's router and routed experts (stacked [E, ...])
_FFN_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
# Shared experts (DeepSeek's, Qwen2-MoE's one) and Qwen2-MoE's gate on their output
_FFN_SHARED = {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
SHARED_GATE = "ffn_gate_inp_shexp.weight"

# Per-layer tensors: GGUF name after "blk.N." -> HF name after "model.layers.N.". (Which ones a layer has is
# `expected_tensors`' business: the experts' only in a MoE layer, Mixtral's in a `llama` file.)
LLAMA_LAYER_NAMES: dict[str, str] = {
    **_NORMS,
    **{f"{g}.{s}": f"{h}.{s}" for g, h in {**_ATTN_LLAMA, **_FFN_DENSE}.items() for s in ("weight", "bias")},
    **_FFN_EXPERTS,
}

DEEPSEEK2_LAYER_NAMES: dict[str, str] = {
    **_NORMS,
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # legacy files; current ones split it (below)
    "attn_output.weight": "self_attn.o_proj.weight",
    **{f"{g}.weight": f"{h}.weight" for g, h in _FFN_DENSE.items()},
    **_FFN_EXPERTS,
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **_FFN_SHARED,
}

# DeepSeek tensors that do not map one-to-one (handled by the functions below).
K_B, V_B = "attn_k_b.weight", "attn_v_b.weight"  # together: self_attn.kv_b_proj.weight
GATE_UP_EXPS = "ffn_gate_up_exps.weight"  # llama.cpp's optional fused form: [E, 2I, H], gate first
KV_B_HF = "self_attn.kv_b_proj.weight"
# attn_k_b / attn_v_b as stored, for the CPU's native weights (models.native.NativeAbsorbed), besides kv_b_proj
K_B_BLOCKS_HF, V_B_BLOCKS_HF = "self_attn.w_kc_native.weight", "self_attn.w_vc_native.weight"

QWEN3_LAYER_NAMES: dict[str, str] = {
    **LLAMA_LAYER_NAMES, "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}

QWEN2MOE_LAYER_NAMES: dict[str, str] = {**LLAMA_LAYER_NAMES, **_FFN_SHARED, SHARED_GATE: "mlp.shared_expert_gate.weight"}

# GLM-4.5: Qwen3's names, the norm before the MLP stored as `post_attention_norm` (llama.cpp's glm4moe has no ffn_norm),
# DeepSeek-V3's routing bias and shared experts
POST_NORM = "post_attention_norm.weight"
GLM4MOE_LAYER_NAMES: dict[str, str] = {
    **{k: v for k, v in QWEN3_LAYER_NAMES.items() if k != "ffn_norm.weight"},
    POST_NORM: "post_attention_layernorm.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **_FFN_SHARED,
}

LAYER_NAMES: dict[str, dict[str, str]] = {ARCH_LLAMA: LLAMA_LAYER_NAMES, ARCH_QWEN2: LLAMA_LAYER_NAMES,
                                          ARCH_QWEN3: QWEN3_LAYER_NAMES, ARCH_QWEN2MOE: QWEN2MOE_LAYER_NAMES,
                                          ARCH_QWEN3MOE: QWEN3_LAYER_NAMES, ARCH_GLM4MOE: GLM4MOE_LAYER_NAMES,
                                          ARCH_DEEPSEEK2: DEEPSEEK2_LAYER_NAMES}


def llama_arch(cfg: LlamaConfig) -> str:
    """The GGUF architecture a Llama-family config is written as (llama.cpp's converter's choice; Mixtral is
    `llama` with experts; GLM-4.5's routing, DeepSeek-V3's, is glm4moe's alone)."""
    if cfg.moe is not None and cfg.moe.topk_method == "noaux_tc":
        return ARCH_GLM4MOE
    if cfg.qk_norm and cfg.moe is not None:
        return ARCH_QWEN3MOE
    if cfg.moe is not None and cfg.moe.shared_gate:
        return ARCH_QWEN2MOE
    if cfg.qk_norm:
        return ARCH_QWEN3
    if cfg.attention_bias and not cfg.out_bias:
        return ARCH_QWEN2
    return ARCH_LLAMA


def layer_name(layer_id: int, name: str) -> str:
    return f"blk.{layer_id}.{name}"


def hf_layer_name(layer_id: int, name: str) -> str:
    return f"model.layers.{layer_id}.{name}"


def parse_layer_name(name: str) -> tuple[int, str] | None:
    """``blk.3.attn_q.weight`` -> (3, ``attn_q.weight``); None for a name outside the layers."""
    if not name.startswith("blk."):
        return None
    idx, _, rest = name[4:].partition(".")
    if not idx.isdecimal() or not rest or (len(idx) > 1 and idx[0] == "0"):
        return None
    return int(idx), rest


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF half-split rows -> llama.cpp interleaved rows, per head (`LlamaModel.permute`).

    `num_heads` is the number of heads the tensor holds (KV heads for k_proj). Works on weights
    [heads*d, in] and biases [heads*d].
    """
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of `permute_qk`: llama.cpp interleaved rows -> HF half-split rows."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def interleave_mla_rope_rows(w: torch.Tensor, cfg: DeepseekConfig, kv_a: bool) -> torch.Tensor:
    """A half-split (`rope_interleave: false`) MLA projection's rotary rows in llama.cpp's interleaved order (its
    deepseek2 rotates adjacent pairs), as `permute_qk` orders Llama's: q_proj / q_b_proj [H*(nope+rope), in] per
    head, kv_a_proj_with_mqa [r+rope, in] in its last rows. The scores are unchanged (q's and k's rotary dims move
    alike); the file then reads as interleaved, as llama.cpp and our reader take every deepseek2 file."""
    rope = cfg.qk_rope_head_dim
    if kv_a:
        return torch.cat([w[:-rope], permute_qk(w[-rope:], 1)])
    heads = w.reshape(cfg.num_attention_heads, cfg.qk_head_dim, *w.shape[1:])
    nope, pe = heads[:, :-rope], heads[:, -rope:]
    pe = permute_qk(pe.reshape(-1, *w.shape[1:]), cfg.num_attention_heads).reshape(pe.shape)
    return torch.cat([nope, pe], dim=1).reshape(w.shape)


def split_kv_b(kv_b: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF kv_b_proj [H*(nope+v), r] -> (attn_k_b [H, r, nope], attn_v_b [H, v, r]), as llama.cpp."""
    kv = kv_b.reshape(num_heads, nope_dim + v_dim, kv_b.shape[-1])
    k_b, v_b = torch.split(kv, [nope_dim, v_dim], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_kv_b`: (k_b [H, r, nope], v_b [H, v, r]) -> kv_b_proj [H*(nope+v), r]."""
    kv = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
    return kv.reshape(-1, kv.shape[-1]).contiguous()


def llama3_rope_factors(
    theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original_len: int
) -> list[float]:
    """Per-frequency divisors llama.cpp stores as ``rope_freqs.weight`` for Llama 3 RoPE scaling.

    Same arithmetic as ``LlamaModel.generate_extra_tensors`` in ``convert_hf_to_gguf.py``: keep
    high frequencies, divide low ones by `factor`, blend in between.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = original_len / low_freq_factor
    high_wavelen = original_len / high_freq_factor
    out: list[float] = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out



def llama3_from_rope_factors(factors: list[float], theta: float, dim: int) -> dict[str, Any] | None:
    """Inverse of `llama3_rope_factors`: HF ``rope_parameters`` that reproduce `factors`, or None.

    Only two numbers shape the blend (its end points in wavelength), so the original context length
    is taken as Meta's 8192 and the low/high factors fitted to the blended part; the result is
    returned only if it reproduces the stored divisors. All ones: no scaling ({}).
    """
    f = np.asarray(factors, dtype=np.float64)
    if f.size == 0 or not np.isfinite(f).all() or (f <= 0).any():
        return None
    factor = f32_round(f.max())
    if factor <= 1.0:  # all ones: none; divisors below one (llama.cpp applies them) are no Llama 3 scaling
        return {} if (f == 1.0).all() else None
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    orig = 8192
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2
    if mid.sum() >= 2:  # blend weight s = orig / (high - low) / wavelen - low / (high - low)
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(1 / wavelen[mid], s, 1)
        if a > 0:
            candidates.append((float(f"{-minus_b * orig / a:.6g}"), float(f"{(1 - minus_b) * orig / a:.6g}")))
    for low, high in candidates:
        if np.allclose(llama3_rope_factors(theta, dim, factor, low, high, orig), f, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
    return None

def expected_tensors(
    cfg: ModelConfig, split_kv_b: bool = True, fused_gate_up: frozenset[int] = frozenset()
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """(every GGUF tensor `cfg` allows -> numpy shape, the names that must be present).

    The shapes of llama.cpp's ``create_tensor`` calls (``src/models/{llama,deepseek2}.cpp``),
    reversed. `split_kv_b`: current ``attn_k_b``/``attn_v_b`` form, else legacy ``attn_kv_b``.
    `fused_gate_up`: MoE layers stored with ``ffn_gate_up_exps`` instead of gate and up.
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    allowed: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    required = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tie_word_embeddings else ["output.weight"])
    if isinstance(cfg, LlamaConfig):
        allowed[ROPE_FREQS] = (cfg.rope.dim // 2,)
    for i in range(cfg.num_hidden_layers):
        if isinstance(cfg, LlamaConfig):
            layer, need = _llama_layer(cfg, i, i in fused_gate_up)
        else:
            layer, need = _deepseek_layer(cfg, i, split_kv_b, i in fused_gate_up)
        allowed.update({layer_name(i, k): s for k, s in layer.items()})
        required += [layer_name(i, k) for k in need]
    return allowed, required


def _llama_layer(cfg: LlamaConfig, i: int, fused_gate_up: bool) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    h, ff = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    # name -> (rows, cols) of the HF Linear
    mats = {"attn_q": (nq, h), "attn_k": (nkv, h), "attn_v": (nkv, h), "attn_output": (h, nq)}
    glm = llama_arch(cfg) == ARCH_GLM4MOE
    layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (h,), POST_NORM if glm else "ffn_norm.weight": (h,)}
    if cfg.is_moe_layer(i):
        m = cfg.moe
        assert m is not None
        layer.update(_expert_tensors(h, m.num_experts, m.intermediate_size, fused_gate_up))
        if m.shared_size:
            layer.update(_shared_tensors(h, m.shared_size))
        if m.shared_gate:  # Qwen2-MoE's gate on its shared expert ([1, hidden]: the converter writes HF's shape)
            layer[SHARED_GATE] = (1, h)
        if glm:  # (required there, as llama.cpp's glm4moe requires it)
            layer["exp_probs_b.bias"] = (m.num_experts,)
    else:
        mats.update({"ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)})
    need = list(layer)
    for t, shape in mats.items():
        layer[f"{t}.weight"], layer[f"{t}.bias"] = shape, shape[:1]
        need.append(f"{t}.weight")
        if (cfg.out_bias if t == "attn_output" else cfg.attention_bias) if t.startswith("attn") else cfg.mlp_bias:
            need.append(f"{t}.bias")
    if cfg.qk_norm:
        layer["attn_q_norm.weight"] = layer["attn_k_norm.weight"] = (cfg.head_dim,)
        need += ["attn_q_norm.weight", "attn_k_norm.weight"]
    return layer, need


def _deepseek_layer(
    cfg: DeepseekConfig, i: int, split_kv_b: bool, fused_gate_up: bool
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    h, nh, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_rope_head_dim
    nope, vd, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_kv_a_mqa.weight": (r + rope, h),
        "attn_kv_a_norm.weight": (r,),
        "attn_output.weight": (h, nh * vd),
    }
    if cfg.q_lora_rank:
        qr = cfg.q_lora_rank
        layer.update({"attn_q_a.weight": (qr, h), "attn_q_a_norm.weight": (qr,), "attn_q_b.weight": (nh * (nope + rope), qr)})
    else:
        layer["attn_q.weight"] = (nh * (nope + rope), h)
    if split_kv_b:
        layer.update({K_B: (nh, r, nope), V_B: (nh, vd, r)})
    else:
        layer["attn_kv_b.weight"] = (nh * (nope + vd), r)
    if cfg.is_moe_layer(i):
        assert cfg.moe is not None
        e, fi = cfg.moe.num_experts, cfg.moe.intermediate_size
        layer.update(_expert_tensors(h, e, fi, fused_gate_up))
        if cfg.moe.shared_size:
            layer.update(_shared_tensors(h, cfg.moe.shared_size))
        need = list(layer)
        layer["exp_probs_b.bias"] = (e,)  # optional: V3's routing bias
    else:
        ff = cfg.intermediate_size
        layer.update({"ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h), "ffn_down.weight": (h, ff)})
        need = list(layer)
    return layer, need


def _expert_tensors(h: int, e: int, fi: int, fused_gate_up: bool) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router and stacked routed experts (gate and up, or llama.cpp's fused gate_up)."""
    layer: dict[str, tuple[int, ...]] = {"ffn_gate_inp.weight": (e, h), "ffn_down_exps.weight": (e, h, fi)}
    if fused_gate_up:
        layer[GATE_UP_EXPS] = (e, 2 * fi, h)
    else:
        layer.update({"ffn_gate_exps.weight": (e, fi, h), "ffn_up_exps.weight": (e, fi, h)})
    return layer


def _shared_tensors(h: int, fs: int) -> dict[str, tuple[int, ...]]:
    """A MoE layer's shared experts: one gated MLP of width `fs`."""
    return {"ffn_gate_shexp.weight": (fs, h), "ffn_up_shexp.weight": (fs, h), "ffn_down_shexp.weight": (h, fs)}
