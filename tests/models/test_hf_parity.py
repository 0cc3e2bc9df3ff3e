"""Our models against HF transformers' implementations, loaded from `save_pretrained` directories."""

from __future__ import annotations

import pytest
import torch

from models.config import SUPPORTED_MODEL_TYPES
from models.loader.load import load_model
from models.mla import MLAAttention
from executor.model_runner import ModelRunner, RequestSlice
from tests.hf_models import CONFIGS, build_hf_model, hf_greedy

NAMES = sorted(CONFIGS)
DEEPSEEK = [n for n in NAMES if SUPPORTED_MODEL_TYPES[CONFIGS[n][0]].startswith("deepseek")]  # (MLA: GLM-4.7-Flash too)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF model, directory it was saved to)."""
    out = {}
    for name in NAMES:
        d = tmp_path_factory.mktemp(name)
        model = build_hf_model(name, seed=len(out))
        model.save_pretrained(d)
        out[name] = (model, d)
    return out


def make_runner(path, dtype="float32", cpu_weights=None, **kw) -> ModelRunner:
    loaded = load_model(path, dtype=dtype, load_tokenizer=False, progress=False, cpu_weights=cpu_weights)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8, **kw)


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    row = runner.req_to_token_pool.alloc()
    logits = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True))
    runner.free_request(row, len(ids))
    return logits


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf(checkpoints, name):
    hf, path = checkpoints[name]
    runner = make_runner(path)
    ids = prompt(40, hf.config.vocab_size, seed=1)
    ours = prefill_logits(runner, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= 1e-4
    assert runner.allocator.available_size() == 512  # every slot returned


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_through_kv_cache_matches_hf(checkpoints, name):
    hf, path = checkpoints[name]
    runner = make_runner(path)
    ids = prompt(12, hf.config.vocab_size, seed=2)
    assert runner.generate_greedy(ids, 32) == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("name", DEEPSEEK)
def test_mla_normal_and_absorb_paths_agree(checkpoints, name, monkeypatch):
    _, path = checkpoints[name]
    runner = make_runner(path)
    ids = prompt(33, runner.config.vocab_size, seed=3)
    absorbed = prefill_logits(runner, ids)  # (a CPU forward always absorbs: models/mla.py)
    monkeypatch.setattr(MLAAttention, "forward", lambda self, pos, x, batch: self.forward_normal(pos, x, batch))
    normal = prefill_logits(runner, ids)
    assert rel_err(absorbed, normal) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_prefill_equals_prefix_then_extend(checkpoints, name):
    """N tokens at once == K tokens then an extend of N-K over the cached prefix (absorbed MLA path),
    also when the extend is batched with another request's fresh prefill and a decode."""
    _, path = checkpoints[name]
    runner = make_runner(path)
    vocab = runner.config.vocab_size
    a, b, c = prompt(37, vocab, 4), prompt(21, vocab, 5), prompt(9, vocab, 6)
    full_a, full_b, full_c = (prefill_logits(runner, x) for x in (a, b, c))

    rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
    k = 15
    runner.forward(runner.build_batch([RequestSlice(rows[0], 0, a[:k]), RequestSlice(rows[2], 0, c[:-1])]))
    batch = runner.build_batch(
        [RequestSlice(rows[0], k, a[k:]), RequestSlice(rows[1], 0, b), RequestSlice(rows[2], len(c) - 1, c[-1:])],
        all_logits=True,
    )
    out = runner.forward(batch)
    n_a = len(a) - k
    assert rel_err(out[:n_a], full_a[k:]) <= 1e-4
    assert rel_err(out[n_a : n_a + len(b)], full_b) <= 1e-4
    assert rel_err(out[-1:], full_c[-1:]) <= 1e-4
    for row, n in zip(rows, (len(a), len(b), len(c))):
        runner.free_request(row, n)
    assert runner.allocator.available_size() == 512


@pytest.mark.parametrize("name", ["v3_noaux_yarn", "llama_gqa_tied"])
def test_bfloat16_within_rounding(checkpoints, name):
    hf, path = checkpoints[name]
    runner = make_runner(path, dtype="bfloat16")
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    ids = prompt(24, hf.config.vocab_size, seed=7)
    ours = prefill_logits(runner, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # bf16 rounding can flip a near-tied MoE routing choice for a few tokens, so judge per row:
    # most rows must sit within bf16 noise of the fp32 oracle, and the argmax must mostly agree.
    row_err = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float((row_err <= 5e-2).float().mean()) >= 0.85, row_err
    assert float(row_err.median()) <= 3e-2
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.parametrize("forward", ["torch", "cpp_experts", "native"])
def test_one_routed_expert_renormalised_matches_hf(tmp_path, forward):
    """norm_topk_prob with a single routed expert per token: its weight is renormalised to 1 (then scaled),
    as HF transformers and llama.cpp do, not left at its raw score."""
    hf = build_hf_model("v3_noaux_yarn", seed=11, num_experts_per_tok=1, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", load_tokenizer=False, progress=False,
                        expert_backend="cpp" if forward == "cpp_experts" else "torch",
                        cpu_weights="float32" if forward == "native" else None)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8)
    assert (runner.native_forward is not None) == (forward == "native")
    ids = prompt(40, hf.config.vocab_size, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4


def test_moe_layer_freq_with_dense_layers_between_computes_as_deepseek(tmp_path):
    """A checkpoint in DeepSeek's own layout for `moe_layer_freq: 2` (a dense MLP in every other layer after
    the dense lead, as its code and vLLM build it) is read that way: the oracle is transformers' model with
    that layer's MoE replaced by its dense MLP (transformers itself ignores the key)."""
    from safetensors.torch import save_file
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

    hf = build_hf_model("v2_lite_yarn_grouped", seed=14, moe_layer_freq=2)
    hf.save_pretrained(tmp_path)
    torch.manual_seed(15)
    hf.model.layers[1].mlp = DeepseekV2MLP(hf.config).float().eval()  # layer 1 % 2: dense in DeepSeek's code
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    ids = prompt(40, hf.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for cpu_weights in (None, "float32"):  # the torch model and the native CPU forward
        loaded = load_model(tmp_path, dtype="float32", load_tokenizer=False, progress=False, cpu_weights=cpu_weights)
        assert loaded.config.moe.moe_layer_freq == 2
        runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8)
        assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4, cpu_weights


def test_linear_rope_with_mscale_all_dim_scales_the_softmax_as_hf(tmp_path):
    """DeepSeek's softmax scale takes mscale(factor, mscale_all_dim)^2 for any scaled rope (HF transformers'
    rule), not only YaRN."""
    hf = build_hf_model("v2_qlora_greedy", seed=12, rope_scaling={"type": "linear", "factor": 4.0, "mscale_all_dim": 1.0})
    hf.save_pretrained(tmp_path)
    runner = make_runner(tmp_path)
    ids = prompt(40, hf.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4


def _drop_keys(path, *keys: str) -> None:
    import json

    cfg = json.loads((path / "config.json").read_text())
    for key in keys:
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_config(path, **changes) -> None:
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# config.json variants that transformers reads in its own way: each served with HF's numbers (they were
# served with others, silently): (model, HF config overrides, keys then dropped from config.json, edits)
CONFIG_VARIANTS = {
    # V3's router keys absent: DeepseekV3Config's defaults (8 groups, 4 kept, normalized, x2.5)
    # other absent DeepSeek keys: transformers' defaults (they were 0 dense layers first, 0 shared experts,
    # no q-LoRA, no experts: a refusal naming tensors, or the model computed without them)
    "v3 dense lead absent": ("v3_noaux_yarn", dict(first_k_dense_replace=3, num_hidden_layers=4),
                             ("first_k_dense_replace",), {}),
    "v2 shared experts absent": ("v2_qlora_greedy", dict(n_shared_experts=2), ("n_shared_experts",), {}),
    "v2 q_lora_rank absent": ("v2_qlora_greedy", dict(q_lora_rank=1536), ("q_lora_rank",), {}),
    "v2 routed experts absent": ("v2_qlora_greedy", dict(n_routed_experts=64), ("n_routed_experts",), {}),
    # no shared experts: transformers saves them as empty [h, 0] weights (they were refused by name)
    "v2 no shared experts": ("v2_qlora_greedy", dict(n_shared_experts=0), (), {}),
    "v3 no shared experts": ("v3_noaux_yarn", dict(n_shared_experts=0), (), {}),
    # transformers' V2 router never renormalises, whatever norm_topk_prob says (it was renormalised)
    "v2 norm_topk_prob true": ("v2_qlora_greedy", dict(norm_topk_prob=True), (), {}),
    # dynamic NTK with mscale_all_dim: the factor still scales the softmax (it was dropped)
    "v2 dynamic mscale_all_dim": ("v2_qlora_greedy", dict(
        rope_scaling={"type": "dynamic", "factor": 4.0, "mscale_all_dim": 1.0}), (), {}),
    "v3 router defaults": ("v3_noaux_yarn", dict(n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
                           ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"), {}),
    # moe_layer_freq 2: transformers ignores it (layer 1 has experts in its file and its forward)
    "v2 moe_layer_freq saved by transformers": ("v2_lite_yarn_grouped", dict(moe_layer_freq=2), (), {}),
    # V2's rotary is interleaved whatever rope_interleave says (transformers reads no such key for V2)
    "v2 rope_interleave false": ("v2_qlora_greedy", {}, (), {"rope_interleave": False}),
    # Llama: a top-level original_max_position_embeddings wins over the scaling's (standardize_rope_params)
    "llama yarn top-level original": ("llama_gqa_tied", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), (),
        {"original_max_position_embeddings": 128}),
    # yarn without original_max_position_embeddings: max_position_embeddings (old-format rope_scaling)
    "llama yarn no original": ("llama_gqa_tied", {}, ("rope_parameters",),
                               {"rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_theta": 10000.0}),
    # dynamic NTK: the default rotary up to max_position_embeddings
    "llama dynamic": ("llama_gqa_tied", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), (), {}),
    # a transformers 5 file (rope_parameters) given a rope_scaling by hand, as model cards say to extend the
    # context: rope_scaling wins, and a top-level rope_theta fills in its theta (rope_parameters' was read)
    "llama rope_scaling beside rope_parameters": ("llama_gqa_tied", {}, (), {
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 1000.0}),
    "v3 yarn rope_scaling beside rope_parameters": ("v3_noaux_yarn", {}, (), {
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 1.0}}),
    # rope_parameters without a theta, and a top-level one: the top-level theta (10000 was read)
    "llama top-level rope_theta": ("llama_gqa_tied", {}, (), {
        "rope_parameters": {"rope_type": "default"}, "rope_theta": 500000.0}),
    # a top-level partial_rotary_factor: transformers' Llama rotates whole heads (with the default rotary;
    # with llama3 scaling its forward fails on the shapes)
    "llama partial_rotary_factor": ("llama_gqa_tied", {}, (), {"partial_rotary_factor": 0.5}),
    # Qwen3-MoE: experts in every second layer (decoder_sparse_step), layer 1 dense by mlp_only_layers too
    "qwen3_moe decoder_sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=4), (), {}),
    # the hub's files name the count `num_experts` (transformers 5 writes num_local_experts)
    "qwen3_moe num_experts key": ("qwen3_moe", {}, ("num_local_experts",), {"num_experts": 8}),
    # norm_topk_prob absent: Qwen3MoeConfig's False, the chosen experts' softmax weights as they are
    "qwen3_moe norm_topk_prob absent": ("qwen3_moe", dict(norm_topk_prob=False), ("norm_topk_prob",), {}),
    # Qwen2-MoE: q/k/v without biases (qkv_bias false), the shared expert's width absent (Qwen2MoeConfig's 5632),
    # renormalised routing
    # Mixtral without rope keys or eps: MixtralConfig's theta 1e6 and eps 1e-5 (Llama's 10000 and 1e-6 were read)
    "mixtral theta and eps absent": ("mixtral", {}, ("rope_parameters", "rms_norm_eps"), {}),
    # GLM-4.5: no partial_rotary_factor anywhere (Glm4MoeConfig's 0.5; the whole head was rotated), a rope_parameters
    # factor beside a top-level one (rope_parameters' wins), no q/k norms and no biases, the router's defaults
    "glm4_moe partial_rotary_factor absent": ("glm4_moe", {}, ("rope_parameters",), {"rope_theta": 1000000.0}),
    "glm4_moe rope_parameters factor wins": ("glm4_moe", dict(partial_rotary_factor=0.25), (),
                                             {"partial_rotary_factor": 0.75}),
    "glm4_moe plain attention": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False), (), {}),
    "glm4_moe router defaults": ("glm4_moe", dict(n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                                  first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False),
                                 ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
                                  "norm_topk_prob", "use_qk_norm"), {}),
    # GLM-4.7-Flash: the released file's first_k_dense_replace without mlp_layer_types, two dense layers by
    # mlp_layer_types, and Glm4MoeLiteConfig's router defaults (x1.8, no groups)
    "glm4_moe_lite first_k_dense_replace": ("glm4_moe_lite", {}, ("mlp_layer_types",), {"first_k_dense_replace": 1}),
    "glm4_moe_lite two dense layers": ("glm4_moe_lite", dict(mlp_layer_types=["dense", "dense", "sparse"]), (), {}),
    "glm4_moe_lite router defaults": ("glm4_moe_lite", {}, ("n_group", "topk_group", "routed_scaling_factor",
                                                             "norm_topk_prob", "mlp_layer_types"), {}),
    "qwen2_moe qkv_bias false": ("qwen2_moe", dict(qkv_bias=False, norm_topk_prob=True), (), {}),
    "qwen2_moe shared width absent": ("qwen2_moe", dict(shared_expert_intermediate_size=5632),
                                      ("shared_expert_intermediate_size",), {}),
}


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_config_variants_read_as_transformers_reads_them(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    name, overrides, dropped, edits = CONFIG_VARIANTS[variant]
    build_hf_model(name, seed=13, **overrides).save_pretrained(tmp_path)
    _drop_keys(tmp_path, *dropped)
    _edit_config(tmp_path, **edits)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # what transformers makes of it
    ids = prompt(100 if "yarn" in variant else 40, hf.config.vocab_size, seed=6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for cpu_weights in (None, "float32"):  # the torch model and the native CPU forward
        runner = make_runner(tmp_path, cpu_weights=cpu_weights)
        assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4, (variant, cpu_weights)


def test_mistral_sliding_window_cuts_the_context_to_the_window(tmp_path):
    """Mistral-7B-v0.1's `sliding_window: 4096` was refused; within one window sliding attention is full
    attention, so the context is cut to the window and logits are transformers' own (Mistral, window 16,
    a 16-token prompt)."""
    import transformers

    config = transformers.MistralConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512,
                                        sliding_window=16)
    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    assert loaded.config.max_position_embeddings == 16 and loaded.config.sliding_window == 16
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=64, max_running_requests=2)
    ids = prompt(16, 320, seed=8)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4


@pytest.mark.parametrize("name", ["llama_gqa_tied", "v3_noaux_yarn"])
def test_a_bf16_checkpoint_with_dtype_float32_computes_in_float32(tmp_path, name):
    """`--dtype float32` on a bf16 checkpoint: the native forward's math is fp32, as transformers upcasts the
    weights (the bf16 weights were multiplied by activations rounded to bf16: 1.3e-2 nats off on a Llama,
    routing flips on a MoE). Compared with HF on the same bf16 weights read as fp32."""
    from transformers import AutoModelForCausalLM

    build_hf_model(name, seed=21).to(torch.bfloat16).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt(60, hf.config.vocab_size, seed=8)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(make_runner(tmp_path, cpu_weights="file"), ids), ref) <= 1e-4


def test_a_bf16_gguf_with_dtype_float32_computes_as_decoded_to_float32(tmp_path):
    """The same for a GGUF's BF16 tensors (dense and routed experts): `file` with `--dtype float32` computes
    as `--cpu-weight-dtype float32` (every weight decoded to fp32, exact)."""
    from models.synthetic import write_checkpoint

    gguf = write_checkpoint(tmp_path, "tiny-deepseek-v2", seed=3, gguf=True, gguf_qtype="BF16") / "model.gguf"
    ids = prompt(50, 256, seed=9)
    logits = {mode: prefill_logits(make_runner(gguf, cpu_weights=mode), ids) for mode in ("file", "float32")}
    assert rel_err(logits["file"], logits["float32"]) <= 1e-5


def test_kimi_k2_directory_computes_as_deepseek_v3(tmp_path):
    """Kimi-K2's config.json names model_type `kimi_k2` with DeepseekV3ForCausalLM and DeepSeek's config class
    (Moonshot: serve it as deepseek_v3): read as DeepSeek-V3, it computes as transformers' DeepseekV3ForCausalLM on
    the same weights (it was refused as an unknown architecture). Its released config's router keys (one group,
    x2.827) are given, as there."""
    hf = build_hf_model("v3_noaux_yarn", seed=21, n_group=1, topk_group=1, routed_scaling_factor=2.827)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    ids = prompt(60, hf.config.vocab_size, seed=8)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for cpu_weights in (None, "float32"):
        runner = make_runner(tmp_path, cpu_weights=cpu_weights)
        assert runner.config.arch == "deepseek_v3" and runner.config.moe.routed_scaling_factor == 2.827
        assert rel_err(prefill_logits(runner, ids), ref) <= 1e-4, cpu_weights
