"""Typed, frozen model configs, settled once at load and passed down.

One config class per architecture family:

* `DeepseekConfig` — DeepSeek-V2 / V2-Lite / V3 (MLA attention, MoE with shared + routed experts).
* `LlamaConfig`    — Llama-family models (GQA, half-split RoPE): dense, or with routed experts (Qwen2-MoE,
                     Qwen3-MoE, Mixtral).

Both are built from an HF ``config.json`` dict by `config_from_hf_dict`, whichever transformers
version wrote it: older files carry ``rope_theta`` + ``rope_scaling`` (with ``type`` or
``rope_type``), current ones a ``rope_parameters`` dict holding ``rope_theta`` too. GGUF metadata is
first turned into such a dict by the GGUF loader, so there is one parser.

Every missing required key or invalid value raises `CheckpointError` naming the key.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from models.loader.errors import CheckpointError

RopeType = Literal["default", "linear", "yarn", "llama3"]

# The longest context a config may claim (2^24 = 16,777,216 positions: above every released model's,
# 4M for the longest Llama-architecture fine-tunes). A larger claim is a broken or hostile file: the
# engine sizes its request table and KV cache from it.
MAX_CONTEXT_LENGTH = 1 << 24
# Every other integer of a config (a size, a count, a token id) is below 2^31 in any real model; a larger
# one is a corrupt file, whose sizes' products would overflow torch's int64 shapes.
MAX_CONFIG_INT = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: a float setting past it is infinite in the kernels
# Keys only the GGUF loader sets (no config.json has them: a leading underscore): llama.cpp's
# rope.dimension_count, and that the dict is a GGUF's, whose keys llama.cpp honours as written
GGUF_ROPE_DIM_KEY = "_gguf_rope_dimension_count"
GGUF_SOURCE_KEY = "_gguf"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the first `dim` dims of a head.

    `interleaved` chooses the pair layout: DeepSeek rotates pairs (x[2i], x[2i+1]); Llama rotates
    (x[i], x[i + dim/2]) ("half split"). The angle for pair i at position p is p * inv_freq[i].
    """

    dim: int
    theta: float = 10000.0
    interleaved: bool = False
    scaling_type: RopeType = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # Llama 3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class MoEConfig:
    """Router and expert shapes of a MoE layer: DeepSeek's, Qwen3-MoE's and Mixtral's (softmax, greedy, no shared
    experts), or Qwen2-MoE's (softmax, greedy, one shared expert of its own size, its output gated by
    sigmoid(x·w): `shared_gate`).

    `scoring_func` softmax (V2) or sigmoid (V3). `topk_method`: ``greedy`` (plain top-k),
    ``group_limited_greedy`` (V2: groups ranked by their max score) or ``noaux_tc`` (V3: scores plus
    `e_score_correction_bias` for choosing, groups ranked by the sum of their top-2).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    scoring_func: Literal["softmax", "sigmoid"]
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"]
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    shared_intermediate_size: int = 0  # the shared experts' width where it is not intermediate_size x their count
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x·shared_expert_gate)

    @property
    def shared_size(self) -> int:
        """The intermediate width of the shared experts (one gated MLP; 0: none)."""
        return self.shared_intermediate_size or self.intermediate_size * self.num_shared_experts


@dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V2/V3 shapes. `q_lora_rank` is None for V2-Lite (plain `q_proj`)."""

    arch: Literal["deepseek_v2", "deepseek_v3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    moe: MoEConfig | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared RoPE key (576 for V2/V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 as DeepSeek does (HF
        transformers: for any scaled rope with an `mscale_all_dim`, not only YaRN)."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.mscale_all_dim:  # (read for the scaled types only, dynamic's too)
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        m = self.moe
        return (
            m is not None
            and layer_id >= m.first_k_dense_replace
            and layer_id % m.moe_layer_freq == 0
        )


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-family decoder with grouped-query attention: dense, or (Qwen2-MoE, Qwen3-MoE, Mixtral) with routed
    experts in the layers `is_moe_layer` names."""

    arch: Literal["llama"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections (and o, unless `o_bias` says otherwise)
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    o_bias: bool | None = None  # the output projection's bias: None as attention_bias (Qwen2: q, k, v only)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head (weights [head_dim]) before RoPE
    # Mistral's sliding-window attention: not implemented, so max_position_embeddings is cut to the window
    # (within it every key is in reach, as full attention); None for full attention
    sliding_window: int | None = None
    moe: MoEConfig | None = None  # the routed experts' shapes and routing; None: dense
    dense_layers: frozenset[int] = frozenset()  # with `moe`: the layers that keep a dense MLP (`mlp_only_layers`)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id not in self.dense_layers

    @property
    def out_bias(self) -> bool:
        return self.attention_bias if self.o_bias is None else self.o_bias


ModelConfig = DeepseekConfig | LlamaConfig

# HF `model_type` values accepted, and the family each maps to.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "llama": "llama",
    "mistral": "llama",  # same graph when sliding_window is off
    "qwen2": "llama",  # biases on q, k and v
    "qwen3": "llama",  # RMSNorm on each query and key head
    "qwen2_moe": "llama",  # Qwen2's attention, routed experts and a gated shared expert in the MLPs
    "qwen3_moe": "llama",  # Qwen3's attention, routed experts (softmax top-k, no shared experts) in the MLPs
    "mixtral": "llama",  # Mistral's attention, routed experts in every layer (softmax top-k, renormalised)
    # GLM-4.5/4.6 (-Air): GQA with half the head rotated, q/k/v biases, optional q/k norms, and DeepSeek-V3's
    # routing (sigmoid + correction bias, shared experts, dense layers first) in the MLPs
    "glm4_moe": "llama",
    "glm4_moe_lite": "deepseek_v3",  # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE, GLM's defaults
    # Kimi-K2 (Moonshot): DeepSeek-V3 itself (its config names DeepseekV3ForCausalLM and DeepSeek's DeepseekV3Config;
    # the type only tells engines apart, and Moonshot's notes say to serve it as deepseek_v3)
    "kimi_k2": "deepseek_v3",
}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1·mscale·ln(scale) + 1 for scale > 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class _Keys:
    """Reads keys out of a config dict, raising `CheckpointError` that names the key."""

    d: dict[str, Any]
    source: str
    used: set[str] = field(default_factory=set)

    def req(self, key: str, typ: type = int) -> Any:
        if key not in self.d or self.d[key] is None:
            raise CheckpointError(self.source, f"config key '{key}' is missing (expected {typ.__name__})")
        return self._cast(key, self.d[key], typ)

    def opt(self, key: str, default: Any, typ: type = int) -> Any:
        v = self.d.get(key)
        return default if v is None else self._cast(key, v, typ)

    def _cast(self, key: str, v: Any, typ: type) -> Any:
        if typ is bool:
            if not isinstance(v, bool):
                raise CheckpointError(self.source, f"config key '{key}' must be a boolean, got {v!r}")
            return v
        if typ is int:
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
                raise CheckpointError(self.source, f"config key '{key}' must be an integer, got {v!r}")
            if not -MAX_CONFIG_INT <= v <= MAX_CONFIG_INT:
                raise CheckpointError(self.source, f"config key '{key}' = {v!r} is out of range for a size, a count "
                                                   f"or an id (at most {MAX_CONFIG_INT}): the file is corrupt")
            return int(v)
        if typ is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CheckpointError(self.source, f"config key '{key}' must be a number, got {v!r}")
            # (json.loads accepts NaN and Infinity; an integer past a float's range does not fit one; the
            # kernels compute in float32, where 3.5e38 is already infinite)
            huge_int = isinstance(v, int) and not -MAX_CONFIG_INT <= v <= MAX_CONFIG_INT
            if huge_int or not math.isfinite(v) or abs(v) > FLOAT32_MAX:
                raise CheckpointError(self.source, f"config key '{key}' must be a finite number within float32's "
                                                   f"range, got {str(v)[:40]}")
            return float(v)
        if not isinstance(v, typ):
            raise CheckpointError(self.source, f"config key '{key}' must be {typ.__name__}, got {v!r}")
        return v

    def positive(self, key: str, default: Any = None) -> int:
        v = self.req(key) if default is None else self.opt(key, default)
        if v <= 0:
            raise CheckpointError(self.source, f"config key '{key}' must be > 0, got {v}")
        return v

    def at_least(self, key: str, default: int, low: int) -> int:
        """An optional integer >= `low`."""
        v = self.opt(key, default)
        if v < low:
            raise CheckpointError(self.source, f"config key '{key}' must be >= {low}, got {v}")
        return v

    def above(self, key: str, v: Any, low: float = 0.0, below: float = math.inf) -> Any:
        """`v` (read from `key`; None passes) when it is a number > `low` (and < `below`), else a CheckpointError."""
        if v is not None and not low < v < below:
            bound = f" and < {below:g}" if below < math.inf else ""
            raise CheckpointError(self.source, f"config key '{key}' must be a finite number > {low:g}{bound}, got {v!r}")
        return v

    def context(self, key: str, default: int) -> int:
        v = self.positive(key, default)
        if v > MAX_CONTEXT_LENGTH:
            raise CheckpointError(
                self.source, f"config key '{key}' = {v} is larger than any supported context ({MAX_CONTEXT_LENGTH} "
                             "positions): the file is corrupt; set it to the model's real context length")
        return v


def _rope_from_dict(k: _Keys, dim: int, interleaved: bool) -> RopeConfig:
    """The rope config, its magnitude corrections checked: YaRN's mscales are finite numbers whose corrections
    (0.1·mscale·ln(factor) + 1, squared into the softmax scale, divided into the cos/sin factor) could still be
    0, infinite in float32 or a division by 0: every score would be NaN or the same."""
    rope = _rope_kinds(k, dim, interleaved)
    corrections = {}
    if rope.mscale_all_dim:
        corrections["mscale_all_dim"] = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    if rope.scaling_type == "yarn" and rope.attention_factor is None and rope.mscale and rope.mscale_all_dim:
        corrections["mscale"] = yarn_get_mscale(rope.factor, rope.mscale)
    for key, m in corrections.items():
        if m == 0 or not abs(m) ** 2 <= FLOAT32_MAX or (key == "mscale" and not abs(
                m / corrections["mscale_all_dim"]) ** 2 <= FLOAT32_MAX):
            raise CheckpointError(k.source, f"config key '{key}' = {getattr(rope, key)}: its YaRN correction "
                                            f"0.1*{key}*ln(factor {rope.factor}) + 1 = {m:.4g} would make attention "
                                            "scores zero or infinite; the file is corrupt")
    return rope


def _rope_params(k: _Keys) -> dict[str, Any]:
    """The rope settings a config gives (a copy): `rope_scaling` where it has one, else `rope_parameters`."""
    scaling = k.d.get("rope_scaling")
    if scaling and not isinstance(scaling, dict):
        raise CheckpointError(k.source, f"config key 'rope_scaling' must be an object, got {str(scaling)[:40]!r}")
    key = "rope_scaling" if scaling else "rope_parameters"
    params = scaling or k.d.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise CheckpointError(k.source, f"config key '{key}' must be an object, got {str(params)[:40]!r}")
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; one type here
    return dict(params)


def _partial_rotary(k: _Keys, default: float) -> float:
    """The fraction of a head rotated: `rope_parameters`' `partial_rotary_factor`, else the top-level key, else the
    model type's `default` (transformers' `convert_rope_params_to_dict` order)."""
    v = _rope_params(k).get("partial_rotary_factor")
    v = k.opt("partial_rotary_factor", default, float) if v is None else _Keys({"partial_rotary_factor": v},
                                                                              k.source).req("partial_rotary_factor", float)
    if not 0 < v <= 1:
        raise CheckpointError(k.source, f"config key 'partial_rotary_factor' must be > 0 and at most 1, got {v!r}")
    return v


def _rope_kinds(k: _Keys, dim: int, interleaved: bool) -> RopeConfig:
    """Reads RoPE settings from `rope_parameters` (new) or `rope_scaling` (old), with a top-level `rope_theta`
    where they hold none. Where a config has both (a transformers 5 file given a `rope_scaling` by hand, as
    model cards say to extend the context), `rope_scaling` wins, as transformers reads it
    (`convert_rope_params_to_dict`: `rope_scaling or rope_parameters`)."""
    scaling = k.d.get("rope_scaling")
    params = _rope_params(k)
    if k.d.get("rope_theta") is not None:
        params.setdefault("rope_theta", k.d["rope_theta"])
    p = _Keys(params, k.source)
    rtype = params.get("rope_type") or params.get("type") or "default"
    # theta > 1: its log divides YaRN's correction range; at 1 every pair would turn at the same speed
    theta = p.above("rope_theta", p.opt("rope_theta", _DEFAULT_THETA.get(k.d.get("model_type"), 10000.0), float), 1.0)
    other = k.d.get("rope_parameters")
    if scaling and isinstance(other, dict) and other and other != scaling:
        lost = other.get("rope_theta")
        logger.warning("%s: has both rope_scaling and rope_parameters; rope_scaling is used, as "
                       "transformers reads it (rope type %s, theta %g)%s", k.source, rtype, theta,
                       f": rope_parameters' theta {lost:g} is not (give rope_scaling a rope_theta to keep it)"
                       if isinstance(lost, (int, float)) and lost != theta else "")
    if rtype in ("default", None):
        return RopeConfig(dim=dim, theta=theta, interleaved=interleaved)
    if rtype == "linear":
        return RopeConfig(dim=dim, theta=theta, interleaved=interleaved, scaling_type="linear",
                          factor=p.above("factor", p.req("factor", float)),
                          mscale_all_dim=p.opt("mscale_all_dim", None, float))  # DeepSeek's scale (softmax_scale)
    if rtype == "dynamic":
        # HF's dynamic NTK scaling changes the frequencies only past max_position_embeddings, which is as
        # far as a context goes here (the engine's context is at most that): there it is the default rope;
        # its factor still scales DeepSeek's softmax with an `mscale_all_dim`, as transformers does
        return RopeConfig(dim=dim, theta=theta, interleaved=interleaved, factor=p.above("factor", p.req("factor", float)),
                          mscale_all_dim=p.opt("mscale_all_dim", None, float))
    if rtype in ("llama3", "yarn"):
        # as transformers' standardize_rope_params: a top-level original_max_position_embeddings wins (Phi-3's
        # and some fine-tunes' configs keep it there), else the scaling's own, else max_position_embeddings
        if k.d.get("original_max_position_embeddings") is not None:
            orig = k.positive("original_max_position_embeddings")
        elif params.get("original_max_position_embeddings") is not None:
            orig = p.positive("original_max_position_embeddings")
        else:
            orig = k.positive("max_position_embeddings")
    if rtype == "llama3":
        low, high = p.above("low_freq_factor", p.req("low_freq_factor", float)), p.req("high_freq_factor", float)
        if not high > low:  # the ramp between them divides by high - low
            raise CheckpointError(
                k.source, f"config key 'high_freq_factor' = {high} must exceed 'low_freq_factor' = {low}")
        return RopeConfig(
            dim=dim, theta=theta, interleaved=interleaved, scaling_type="llama3",
            factor=p.above("factor", p.req("factor", float)),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=orig,
            mscale_all_dim=p.opt("mscale_all_dim", None, float),
        )
    if rtype == "yarn":
        factor = p.above("factor", p.opt("factor", None, float))
        if factor is None:
            factor = k.req("max_position_embeddings") / orig
        return RopeConfig(
            dim=dim, theta=theta, interleaved=interleaved, scaling_type="yarn", factor=factor,
            original_max_position_embeddings=orig,
            # 0 or null: the default (as before); a negative one would take the log of a negative number
            beta_fast=p.above("beta_fast", p.opt("beta_fast", 32.0, float) or 32.0),
            beta_slow=p.above("beta_slow", p.opt("beta_slow", 1.0, float) or 1.0),
            mscale=p.opt("mscale", None, float),
            mscale_all_dim=p.opt("mscale_all_dim", None, float),
            attention_factor=p.above("attention_factor", p.opt("attention_factor", None, float)),
            truncate=p.opt("truncate", True, bool),
        )
    raise CheckpointError(
        k.source, f"rope scaling type '{rtype}' is not supported (supported: default, linear, dynamic, llama3, yarn)"
    )


# transformers' names for SiLU (ACT2FN): the one gate activation the MLP and expert kernels compute
SILU_NAMES = ("silu", "swish")


def _check_activation(k: _Keys) -> None:
    act = k.opt("hidden_act", "silu", str)
    if act not in SILU_NAMES:
        raise CheckpointError(k.source, f"config key 'hidden_act' is {act!r}: only SiLU-gated MLPs are supported "
                                        "('silu'); this model's MLP would be computed wrongly")


def _eos_ids(k: _Keys) -> tuple[int, ...]:
    v = k.d.get("eos_token_id")
    if v is None:
        return ()
    ids = [v] if isinstance(v, int) else v
    if isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_CONFIG_INT
                                     for x in ids):
        return tuple(ids)
    raise CheckpointError(k.source, f"config key 'eos_token_id' must be a token id or a list of them, got {v!r}")


def _deepseek_from_dict(k: _Keys, arch: Literal["deepseek_v2", "deepseek_v3"]) -> DeepseekConfig:
    _check_activation(k)
    if k.opt("mlp_bias", False, bool):  # (transformers' V2 reads it; no DeepSeek model has such biases)
        raise CheckpointError(k.source, "config key 'mlp_bias' is true: DeepSeek MLPs with biases are not supported")
    num_heads = k.positive("num_attention_heads")
    rope_dim = k.positive("qk_rope_head_dim")
    if rope_dim % 2:
        raise CheckpointError(k.source, f"config key 'qk_rope_head_dim' must be even, got {rope_dim}")
    # transformers' defaults where a key is absent (DeepseekV2Config / DeepseekV3Config / Glm4MoeLiteConfig);
    # `q_lora_rank: null` is a plain q_proj (V2-Lite), an absent one transformers' 1536 (GLM-4.7-Flash's 768)
    model_type = k.d.get("model_type")
    glm = model_type == "glm4_moe_lite"
    q_lora_rank = k.opt("q_lora_rank", None) if "q_lora_rank" in k.d else 768 if glm else 1536
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise CheckpointError(k.source, f"config key 'q_lora_rank' must be > 0 or null, got {q_lora_rank}")
    is_v3 = arch == "deepseek_v3"
    if glm and _partial_rotary(k, 1.0) != 1.0:
        raise CheckpointError(k.source, "config key 'partial_rotary_factor' must be 1.0 for glm4_moe_lite: MLA rotates "
                                        "the whole qk_rope_head_dim (transformers' cos/sin would not fit otherwise)")
    return DeepseekConfig(
        arch=arch,
        vocab_size=k.positive("vocab_size"),
        hidden_size=k.positive("hidden_size"),
        intermediate_size=k.positive("intermediate_size"),
        num_hidden_layers=k.positive("num_hidden_layers"),
        num_attention_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=k.positive("kv_lora_rank"),
        qk_nope_head_dim=k.positive("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=k.positive("v_head_dim"),
        # (models: 1e-6..1e-5; Glm4MoeLiteConfig's default 1e-5)
        rms_norm_eps=k.above("rms_norm_eps", k.opt("rms_norm_eps", 1e-5 if glm else 1e-6, float), below=1.0),
        max_position_embeddings=k.context("max_position_embeddings",  # transformers'
                                          202752 if glm else 4096 if is_v3 else 2048),
        tie_word_embeddings=k.opt("tie_word_embeddings", False, bool),
        attention_bias=k.opt("attention_bias", False, bool),
        # V2's rotary is always interleaved (transformers and DeepSeek's code read no key); V3 may say otherwise
        rope=_rope_from_dict(k, rope_dim, interleaved=k.opt("rope_interleave", True, bool) if is_v3 else True),
        moe=_router_moe(k, model_type if glm else arch, is_v3),
        bos_token_id=k.opt("bos_token_id", None),
        eos_token_ids=_eos_ids(k),
    )


# transformers' defaults of a DeepSeek-style router where a key is absent, by model type: routed experts, groups,
# groups kept, shared experts, the weights' scale, dense layers first, experts per token and their width (None:
# the key is required)
_ROUTER_DEFAULTS: dict[str, tuple[int, int, int, int, float, int, int | None, int | None]] = {
    "deepseek_v2": (64, 1, 1, 2, 1.0, 0, None, None),
    "deepseek_v3": (256, 8, 4, 1, 2.5, 3, None, None),
    "glm4_moe_lite": (64, 1, 1, 1, 1.8, 1, 4, 1536),
    "glm4_moe": (128, 1, 1, 1, 1.0, 1, 8, 1408),
}


def _router_moe(k: _Keys, model_type: str, is_v3: bool) -> MoEConfig | None:
    """DeepSeek's MoE as a config describes it (DeepSeek-V2/V3, and GLM's, which route as V3 does): None where it
    has no routed experts. `is_v3`: sigmoid scores with the correction bias, groups ranked by their top-2 sum."""
    experts_default, groups, kept, shared, scale, dense, top_k_default, width = _ROUTER_DEFAULTS[model_type]
    num_experts = k.opt("n_routed_experts", None)
    if num_experts is None:
        num_experts = k.opt("num_local_experts", experts_default)  # (0: a dense model, as a GGUF says)
    if not num_experts:
        return None
    native = "sigmoid" if is_v3 else "softmax"
    scoring = k.opt("scoring_func", native, str)
    # transformers ignores a config.json's key and DeepSeek's own code refuses the other function; a GGUF's
    # expert_gating_func is what llama.cpp computes with
    if scoring not in ("softmax", "sigmoid") or scoring != native and not k.d.get(GGUF_SOURCE_KEY):
        raise CheckpointError(k.source, f"config key 'scoring_func' must be {native!r} for {model_type} (its router "
                                        f"scores with {native}), got {scoring!r}")
    method = k.opt("topk_method", "noaux_tc" if is_v3 else "greedy", str)
    if is_v3:
        method = "noaux_tc"  # V3 always routes with the correction bias and top-2 group scores
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise CheckpointError(
            k.source, f"config key 'topk_method' must be greedy, group_limited_greedy or noaux_tc, got {method!r}"
        )
    if method == "noaux_tc" and not is_v3:  # (transformers' V2 router has no such branch, nor DeepSeek's code)
        raise CheckpointError(k.source, "config key 'topk_method' noaux_tc is DeepSeek-V3's routing (with its "
                                        "e_score_correction_bias): a deepseek_v2 model routes with greedy or "
                                        "group_limited_greedy; for a V3 checkpoint set model_type deepseek_v3")
    n_group = k.at_least("n_group", groups, 0) or 1  # 0 or null: no groups
    topk_group = k.at_least("topk_group", kept, 0) or 1
    top_k = k.positive("num_experts_per_tok", top_k_default)
    # V3 picks its experts among the kept groups' only: more than they hold would take experts masked to
    # -inf in whatever order a top-k breaks ties, with real weights (V2's masked ones weigh 0)
    short = method == "noaux_tc" and top_k > topk_group * (num_experts // n_group)
    if num_experts % n_group or topk_group > n_group or top_k > num_experts or short:
        raise CheckpointError(
            k.source,
            f"MoE routing is inconsistent: n_routed_experts={num_experts}, n_group={n_group}, "
            f"topk_group={topk_group}, num_experts_per_tok={top_k} (experts must split evenly into groups, "
            "topk_group <= n_group, num_experts_per_tok <= n_routed_experts, and for V3 at most the experts "
            "of topk_group groups)",
        )
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=k.positive("moe_intermediate_size", width),
        num_shared_experts=k.at_least("n_shared_experts", shared, 0),
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=_norm_topk_prob(k, is_v3),
        routed_scaling_factor=k.above("routed_scaling_factor", k.opt("routed_scaling_factor", scale, float)),
        first_k_dense_replace=_mlp_layer_types(k) if model_type == "glm4_moe_lite"
        else k.at_least("first_k_dense_replace", dense, 0),
        moe_layer_freq=k.at_least("moe_layer_freq", 1, 0) or 1,
    )


def _mlp_layer_types(k: _Keys) -> int:
    """GLM-4.7-Flash's dense layers first: transformers reads `mlp_layer_types` (default: the first layer dense,
    the rest sparse) and ignores `first_k_dense_replace`, which vLLM and llama.cpp read; the released config has
    the latter alone, and both say one. Only a leading run of dense layers is supported (every GLM model's)."""
    layers = k.positive("num_hidden_layers")
    types = k.opt("mlp_layer_types", None, list)
    if types is None:
        return k.at_least("first_k_dense_replace", 1, 0)
    if len(types) < layers or any(t not in ("dense", "sparse") for t in types):
        raise CheckpointError(k.source, f"config key 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                                        f"{layers} layers, got {str(types)[:80]}")
    lead = next((i for i, t in enumerate(types[:layers]) if t == "sparse"), layers)
    if "dense" in types[lead:layers]:
        raise CheckpointError(k.source, f"config key 'mlp_layer_types' has dense layers after sparse ones "
                                        f"({str(types[:layers])[:80]}): only dense layers first are supported")
    given = k.d.get("first_k_dense_replace")
    if given is not None and given != lead:
        logger.warning("%s: mlp_layer_types makes %d dense layers first, first_k_dense_replace says %s: "
                       "mlp_layer_types is used, as transformers reads it", k.source, lead, given)
    return lead


def _norm_topk_prob(k: _Keys, is_v3: bool) -> bool:
    """Whether the chosen experts' weights are renormalised. transformers' DeepSeek-V2 never does, whatever
    its config says (DeepSeek's own code, vLLM and llama.cpp do where `norm_topk_prob` is true): a config.json
    is read as transformers reads it, and the ignored key is logged; a GGUF's `expert_weights_norm` is what
    llama.cpp computes with."""
    norm = k.opt("norm_topk_prob", is_v3, bool)
    if norm and not is_v3 and not k.d.get(GGUF_SOURCE_KEY):
        logger.warning("%s: norm_topk_prob is true, which transformers' DeepSeek-V2 ignores: the routing weights "
                       "are not renormalised, as there", k.source)
        return False
    return norm


def _llama_from_dict(k: _Keys, model_type: str = "llama") -> LlamaConfig:
    """Llama, and the models that are Llama with a difference transformers hard-codes: Qwen2 (q, k and v
    projections with biases, o without, whatever `attention_bias` says), Qwen3 (`attention_bias` for all
    four, and q_norm / k_norm), Qwen2-MoE and Qwen3-MoE (their attention, routed experts: `_qwen_moe`) and
    Mixtral (`_mixtral`)."""
    _check_activation(k)
    hidden = k.positive("hidden_size")
    num_heads = k.positive("num_attention_heads")
    num_kv_heads = k.opt("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type, num_heads))
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise CheckpointError(
            k.source, f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = k.opt("head_dim", 128 if model_type == "qwen3" else None)  # (transformers' Qwen3Config default;
    # Qwen3MoeConfig has none: hidden / heads)
    if head_dim is None:
        if hidden % num_heads:
            raise CheckpointError(k.source, f"hidden_size={hidden} is not divisible by num_attention_heads={num_heads}")
        head_dim = hidden // num_heads
    if head_dim <= 0 or head_dim % 2:
        raise CheckpointError(k.source, f"config key 'head_dim' must be a positive even number, got {head_dim}")
    # transformers' Llama rotates whole heads whatever a config.json's partial_rotary_factor says; a GGUF's
    # rope.dimension_count may rotate fewer dims (llama.cpp honours it): the GGUF loader passes it by this key
    glm = model_type == "glm4_moe"
    # (GLM-4.5 rotates half of each head, `partial_rotary_factor` 0.5 where the config names none)
    rope_dim = k.positive(GGUF_ROPE_DIM_KEY, int(head_dim * _partial_rotary(k, 0.5)) if glm else head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise CheckpointError(k.source, f"the rotary dimension count {rope_dim} must be even and at most the head "
                                        f"dimension {head_dim}")
    return LlamaConfig(
        arch="llama",
        vocab_size=k.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=k.positive("intermediate_size",
                                     {"qwen3_moe": 6144, "qwen2_moe": 5632, "glm4_moe": 10944}.get(model_type)),
        num_hidden_layers=k.positive("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=k.above("rms_norm_eps", k.opt("rms_norm_eps", 1e-5 if model_type in ("mixtral", "glm4_moe")
                                                   else 1e-6, float), below=1.0),  # (models: 1e-6..1e-5)
        max_position_embeddings=k.context("max_position_embeddings", _DEFAULT_CONTEXT.get(model_type[:4], 2048)),
        tie_word_embeddings=k.opt("tie_word_embeddings", False, bool),
        attention_bias={"qwen2": True, "qwen2_moe": k.opt("qkv_bias", True, bool)}.get(
            model_type, k.opt("attention_bias", False, bool)),
        mlp_bias=False if model_type.startswith("qwen") else k.opt("mlp_bias", False, bool),
        rope=_rope_from_dict(k, rope_dim, interleaved=False),
        # (MixtralConfig's 1 and 2 where the keys are absent)
        bos_token_id=k.opt("bos_token_id", 1) if model_type == "mixtral" and "bos_token_id" not in k.d
        else k.opt("bos_token_id", None),
        eos_token_ids=(2,) if model_type == "mixtral" and "eos_token_id" not in k.d else _eos_ids(k),
        o_bias=False if model_type in ("qwen2", "qwen2_moe", "glm4_moe") else None,
        qk_norm=model_type in ("qwen3", "qwen3_moe") or glm and k.opt("use_qk_norm", False, bool),
        **(_qwen_moe(k, model_type) if model_type in ("qwen2_moe", "qwen3_moe")
           else _mixtral(k) if model_type == "mixtral" else _glm_moe(k) if glm else {}),
    )


# transformers' defaults that differ by model type: rope theta (MixtralConfig.default_theta), KV heads where a
# config names none (Llama's: as many as the query heads)
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_KV_HEADS = {"qwen3_moe": 4, "mistral": 8, "mixtral": 8, "glm4_moe": 8}
# transformers' max_position_embeddings where a config has none, by model_type's first four letters (Llama's 2048
# otherwise): Qwen2/Qwen3 configs' 32768, MistralConfig's and MixtralConfig's 4096 * 32, Glm4MoeConfig's 131072
_DEFAULT_CONTEXT = {"qwen": 32768, "mist": 131072, "mixt": 131072, "glm4": 131072}


def _mixtral(k: _Keys) -> dict[str, Any]:
    """Mixtral's experts as transformers builds them (MixtralConfig's defaults where a key is absent): every
    layer's MLP is `num_local_experts` experts of `intermediate_size`, the top `num_experts_per_tok` by softmax,
    their weights always renormalised."""
    experts = k.positive("num_local_experts", 8)
    top_k = k.positive("num_experts_per_tok", 2)
    if top_k > experts:
        raise CheckpointError(k.source, f"config key 'num_experts_per_tok' = {top_k} is more than the {experts} "
                                        "experts ('num_local_experts')")
    return {"moe": MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=k.positive("intermediate_size"),
                             num_shared_experts=0, scoring_func="softmax", topk_method="greedy", n_group=1,
                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, first_k_dense_replace=0,
                             moe_layer_freq=1)}


def _glm_moe(k: _Keys) -> dict[str, Any]:
    """GLM-4.5's MLPs as transformers builds them (Glm4MoeConfig's defaults where a key is absent): DeepSeek-V3's
    MoE (sigmoid scores plus the correction bias choosing, shared experts) from layer `first_k_dense_replace` on,
    `moe_layer_freq` unread (every later layer is MoE)."""
    moe = _router_moe(k, "glm4_moe", is_v3=True)
    if moe is None:
        return {}
    moe = dataclasses.replace(moe, moe_layer_freq=1)
    return {"moe": moe, "dense_layers": frozenset(range(min(moe.first_k_dense_replace, k.positive("num_hidden_layers"))))}


# Qwen2MoeConfig's and Qwen3MoeConfig's defaults: experts, top-k, their width
_QWEN_MOE_DEFAULTS = {"qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}


def _qwen_moe(k: _Keys, model_type: str) -> dict[str, Any]:
    """Qwen2-MoE's and Qwen3-MoE's experts as transformers builds them (their configs' defaults where a key is
    absent): softmax over every expert's logit, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`;
    Qwen2-MoE adds one shared expert of `shared_expert_intermediate_size` gated by sigmoid(x·w), Qwen3-MoE has
    none; a layer is MoE unless `mlp_only_layers` lists it or (i + 1) is no multiple of `decoder_sparse_step`,
    and `num_experts: 0` is a dense model."""
    layers = k.positive("num_hidden_layers")
    n_experts, n_top, width = _QWEN_MOE_DEFAULTS[model_type]
    # (transformers 5 writes `num_local_experts`, the hub's files `num_experts`; transformers reads the former where
    # both are given)
    key = "num_local_experts" if k.d.get("num_local_experts") is not None else "num_experts"
    experts = k.at_least(key, n_experts, 0)
    if not experts:
        return {}
    top_k = k.positive("num_experts_per_tok", n_top)
    if top_k > experts:
        raise CheckpointError(k.source, f"config key 'num_experts_per_tok' = {top_k} is more than the {experts} "
                                        f"experts ('{key}')")
    step = k.positive("decoder_sparse_step", 1)
    only = k.opt("mlp_only_layers", [], list)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise CheckpointError(k.source, f"config key 'mlp_only_layers' must be a list of layer numbers, got {only!r}")
    shared = k.at_least("shared_expert_intermediate_size", 5632, 0) if model_type == "qwen2_moe" else 0
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=k.positive("moe_intermediate_size", width),
                    num_shared_experts=1 if shared else 0, scoring_func="softmax", topk_method="greedy", n_group=1,
                    topk_group=1, norm_topk_prob=k.opt("norm_topk_prob", False, bool), routed_scaling_factor=1.0,
                    first_k_dense_replace=0, moe_layer_freq=1, shared_intermediate_size=shared,
                    shared_gate=bool(shared))
    dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step)
    return {"moe": moe, "dense_layers": dense}


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds the typed config from a parsed HF ``config.json`` (or the GGUF loader's equivalent).

    `source` names the file in error messages.
    """
    if not isinstance(d, dict):
        raise CheckpointError(source, "config must be a JSON object")
    k = _Keys(d, source)
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            source,
            f"unknown architecture: model_type={model_type!r} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})",
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    if family == "llama":
        cfg = _yarn_positions(_llama_from_dict(k, model_type), k)
        windowed = model_type in ("mistral", "mixtral") or model_type.startswith("qwen") and _qwen_slides(
            k, cfg.num_hidden_layers)
        window = k.at_least("sliding_window", 0, 0) if windowed else 0  # 0 or null: none
        if windowed and model_type.startswith("qwen") and "sliding_window" not in k.d:
            window = 4096  # (the Qwen configs' default, used where use_sliding_window turns windows on)
        if model_type == "mistral" and "sliding_window" not in k.d:
            window = 4096  # (MistralConfig's default; a null is none)
        if window:  # attention within one window is exact: the context stops there (the engine says so)
            cfg = dataclasses.replace(cfg, sliding_window=window,
                                      max_position_embeddings=min(cfg.max_position_embeddings, window))
        return cfg
    return _yarn_positions(_deepseek_from_dict(k, family), k)  # type: ignore[arg-type]


def _qwen_slides(k: _Keys, layers: int) -> bool:
    """Whether a Qwen2/Qwen3 config has any sliding-window layer, as transformers lays them out: its configs carry
    a window either way, used only with `use_sliding_window`, and then by the layers from `max_window_layers` on
    (or as `layer_types` lists them)."""
    types = k.d.get("layer_types")
    if k.d.get("model_type") == "qwen3_moe":  # (every layer's attention, as Qwen3MoeAttention reads the window)
        return k.opt("use_sliding_window", False, bool)
    if isinstance(types, list):
        return "sliding_attention" in types[:layers]
    if k.d.get("model_type") == "qwen2_moe":  # (Qwen2MoeConfig: every other layer below max_window_layers)
        return k.opt("use_sliding_window", False, bool) and k.opt("max_window_layers", 28, int) > 0
    return k.opt("use_sliding_window", False, bool) and k.opt("max_window_layers", 28, int) < layers


def _yarn_positions(cfg: ModelConfig, k: _Keys) -> ModelConfig:
    """`cfg` serving YaRN's whole reach: the original context times the factor where that is past
    max_position_embeddings. Qwen2.5 and Qwen3 configs keep the trained 32768 / 40960 there and say
    `{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}` for 131072, the context vLLM,
    SGLang and llama.cpp serve them at (YaRN's frequencies depend on the original length alone)."""
    r = cfg.rope
    if r.scaling_type != "yarn" or r.original_max_position_embeddings is None:
        return cfg
    reach = min(int(r.original_max_position_embeddings * r.factor), MAX_CONTEXT_LENGTH)
    if reach <= cfg.max_position_embeddings:
        return cfg
    logger.info("%s: YaRN (factor %g over %d positions) serves %d positions, past max_position_embeddings %d",
                k.source, r.factor, r.original_max_position_embeddings, reach, cfg.max_position_embeddings)
    return dataclasses.replace(cfg, max_position_embeddings=reach)
