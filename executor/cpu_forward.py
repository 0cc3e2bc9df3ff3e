"""The CPU-native forward: a whole batch (decode, prefill, chunked prefill or mixed) in one native
call, `cpp_experts.CpuModel`, built once from a model loaded with native weights (`models.native`)
and this executor's pools. The CPU counterpart of the CUDA-graph runner: where that replays a
captured graph, this runs a plan of operators that was put together at start-up, so a decode step
costs a few Python calls instead of hundreds of torch ops.

What it needs (`unsupported_reason` says what is missing otherwise, and the runner then runs the
model's torch forward, which works with native weights too):
- every linear layer a `NativeLinear`, the embedding a `NativeEmbedding`, routed experts `CppExperts`;
- a KV cache in fp32 or bf16 (`auto_kv_dtype`: `--kv-dtype auto` gives bf16 to quantized weights);
- Llama-family layers (GQA) or DeepSeek's (MLA + dense or MoE MLPs).

MLA's absorbed matrices (w_kc [H, N, r], w_vc [H, r, V]) are one small linear per head. With
`--cpu-weight-dtype file` and a GGUF that stores them per head (`attn_k_b` / `attn_v_b`, llama.cpp's
form), they are those blocks as stored (`models.native.NativeAbsorbed`). Otherwise they are split
from kv_b_proj at load: bf16 with `bf16`, fp32 with `float32`, and with `file` in kv_b_proj's loaded
precision (the model's --dtype): an fp32 model keeps them exact, so that its outputs do not depend on
the batch (the bf16 kernels' summation order does, by a rounding).

OmniKV (models/omnikv_config.py): `set_omnikv` hands the layer plan and the query history to the
native model; a batch's `omnikv` rows then decode sparsely inside the same native call (the filter
layers select, the sparse layers attend to the selection: cpp_experts/csrc/omnikv.h), and the
forward adds what was kept to the batch's counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.attention.omnikv import OmniKVBatch, QueryHistory
from models.base import CausalLM
from models.config import DeepseekConfig, LlamaConfig, ModelConfig
from models.experts import CppExperts
from models.layers import GatedMLP
from models.loader.load import resolve_dtype
from models.llama import LlamaAttention
from models.mla import MLAAttention
from models.moe import SparseMoE
from models.native import NativeEmbedding, NativeLinear, native_modules
from models.omnikv_config import LayerPlan, OmniKVConfig
from executor.forward_batch import ForwardBatch
from executor.memory_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool


def model_unsupported_reason(model: CausalLM) -> str | None:
    """Why `NativeForward` cannot run this model whatever its cache, or None when it can."""
    if not isinstance(model.model.embed_tokens, NativeEmbedding):
        return "the model was loaded without native CPU weights"
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("kv_b_proj")]
    if linears:
        return f"{linears[0]} is a torch linear layer"
    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE) and not isinstance(mlp.experts, CppExperts):
            return f"the routed experts run on {type(mlp.experts).__name__}, not the cpp backend"
    return None


def unsupported_reason(model: CausalLM, kv_pool: KVPool) -> str | None:
    """Why `NativeForward` cannot run this model with this cache, or None when it can."""
    why = model_unsupported_reason(model)
    if why is not None:
        return why
    buffers = kv_pool.kv_buffer if isinstance(kv_pool, MLATokenToKVPool) else kv_pool.k_buffer
    if buffers[0].dtype not in (torch.float32, torch.bfloat16):
        return f"the KV cache is {buffers[0].dtype} (the native forward reads fp32 or bf16)"
    return None


def auto_kv_dtype(model: CausalLM, dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype of `--kv-dtype auto` for a model on the CPU whose activations are `dtype`.

    bf16 where the native forward runs quantized weights (GGUF blocks kept as stored: `--cpu-weight-dtype
    file`): they are approximations already, and a bf16 cache holds half of fp32's bytes, so twice the
    tokens fit and decode attention reads half as much (SmolLM2-135M Q4_1 on a 2-core Zen 3 VM, the two
    caches interleaved in one process: decode +2% after a 160-token prompt, +10% after 1536), as
    llama.cpp keeps its cache in f16 by default. `dtype` otherwise: float weights (a float checkpoint,
    `float32` or `bf16`) and the torch forward keep the model's, so that an fp32 model stays exact.
    """
    if model_unsupported_reason(model) is not None:
        return dtype
    quantized = any(m.op is not None and m.op.weight_format not in ("bf16", "f32") for m in native_modules(model))
    return torch.bfloat16 if quantized else dtype


def kv_dtype_setting(setting: str, model: CausalLM, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-dtype` as the engine and `mlaserve generate` both resolve it: `auto` by `auto_kv_dtype`, any
    other name as `--dtype` names are read."""
    return auto_kv_dtype(model, dtype) if setting == "auto" else resolve_dtype(setting, device)


def _head_linears(ext: Any, weights: torch.Tensor, dtype: torch.dtype) -> list[Any]:
    """One QuantLinear per head of `weights` [H, out, in]."""
    return [ext.QuantLinear.from_float(w, dtype=dtype) for w in weights]


def _int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as int64, without a call into torch where it is one already: a decode step's few torch calls
    run just after the forward has streamed the weights through the caches, each first one slow."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)


@dataclass
class DecodeBuffers:
    """A decode batch's inputs as `ModelRunner.build_batch` writes them for the native forward: the
    native model's (`cpp_experts.DecodeInputs`) and the batch's sequence lengths, each with its items'
    memoryview."""

    inputs: Any  # cpp_experts.DecodeInputs
    seq_lens: torch.Tensor
    seq_mv: memoryview
    batch: ForwardBatch | None = None  # the batch last written into them (a later one overwrites it)


class NativeForward:
    """`cpp_experts.CpuModel` for one model and one executor's pools, all on `workers`."""

    DECODE_CAPACITY = 64  # the largest decode batch on reused inputs (two sets of logits [64, vocab] fp32)

    def __init__(self, model: CausalLM, config: ModelConfig, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 workers: Any) -> None:
        import cpp_experts as ext

        why = unsupported_reason(model, kv_pool)
        if why is not None:
            raise ValueError(f"the native CPU forward cannot run this model: {why}")
        for m in native_modules(model):
            m.bind(workers)
        inner = model.model
        head = model.lm_head
        assert isinstance(head, NativeLinear)
        self.plan = ext.CpuModel(workers, inner.embed_tokens.op, head.op, inner.norm.weight, inner.norm.eps)
        # 0..B-1 per decode batch size B (read only: the logits rows of a decode batch)
        self._aranges: dict[int, torch.Tensor] = {}
        self.omnikv: OmniKVConfig | None = None
        # decode batches of up to this many requests run on inputs made once (`decode_buffers`): two sets,
        # used in turn, so that a batch and its logits stay valid while the next one is built and run
        self.decode_capacity = min(req_to_token_pool.size, self.DECODE_CAPACITY)
        self._decode_base: list[tuple[Any, torch.Tensor] | None] = [None, None]
        self._decode_sets: dict[tuple[int, int], DecodeBuffers] = {}
        self._decode_side = 0
        self._decode_last: DecodeBuffers | None = None  # the set decode_buffers gave last
        table = req_to_token_pool.req_to_token
        buffers = kv_pool.kv_buffer if isinstance(kv_pool, MLATokenToKVPool) else kv_pool.k_buffer
        self.plan.set_table(table, buffers[0].shape[0])
        for i, layer in enumerate(inner.layers):
            attn, norm = layer.self_attn, layer.input_layernorm
            rotary = attn.rotary_emb
            if isinstance(attn, LlamaAttention):
                assert isinstance(kv_pool, MHATokenToKVPool) and isinstance(config, LlamaConfig)
                self.plan.add_gqa(norm.weight, norm.eps, attn.q_proj.op, attn.k_proj.op, attn.v_proj.op, attn.o_proj.op,
                                  num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                                  scale=attn.layer.scaling, rope_table=rotary.cos_sin_cache, rope_dim=rotary.cfg.dim,
                                  interleaved=rotary.cfg.interleaved, k_cache=kv_pool.k_buffer[i],
                                  v_cache=kv_pool.v_buffer[i],
                                  q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
                                  k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
                                  qk_eps=attn.q_norm.eps if attn.q_norm is not None else 1e-6)
            elif isinstance(attn, MLAAttention):
                assert isinstance(kv_pool, MLATokenToKVPool) and isinstance(config, DeepseekConfig)
                lora = not hasattr(attn, "q_proj")
                exact = head.mode == "float32" or (head.mode == "file" and attn.w_kc.dtype == torch.float32)
                head_dtype = torch.float32 if exact else torch.bfloat16
                kc, vc = getattr(attn, "w_kc_native", None), getattr(attn, "w_vc_native", None)  # made in pairs
                stored = kc is not None and kc.ops is not None and vc.ops is not None
                self.plan.add_mla(
                    norm.weight, norm.eps,
                    q=None if lora else attn.q_proj.op,
                    q_a=attn.q_a_proj.op if lora else None,
                    q_a_norm=attn.q_a_layernorm.weight if lora else None,
                    q_a_eps=attn.q_a_layernorm.eps if lora else 0.0,
                    q_b=attn.q_b_proj.op if lora else None,
                    kv_a=attn.kv_a_proj_with_mqa.op, kv_norm=attn.kv_a_layernorm.weight,
                    kv_eps=attn.kv_a_layernorm.eps,
                    w_kc=kc.ops if stored else _head_linears(ext, attn.w_kc.transpose(1, 2), head_dtype),
                    w_vc=vc.ops if stored else _head_linears(ext, attn.w_vc.transpose(1, 2), head_dtype),
                    o=attn.o_proj.op, num_heads=attn.num_heads, nope_dim=attn.nope_dim, rope_dim=attn.rope_dim,
                    v_dim=attn.v_dim, kv_lora_rank=attn.kv_lora_rank, scale=attn.absorb_layer.scaling,
                    rope_table=rotary.cos_sin_cache, interleaved=rotary.cfg.interleaved, latent=kv_pool.kv_buffer[i])
            else:
                raise ValueError(f"layer {i}: no native attention for {type(attn).__name__}")
            mlp, norm = layer.mlp, layer.post_attention_layernorm
            if isinstance(mlp, GatedMLP):
                self.plan.add_dense_mlp(norm.weight, norm.eps, mlp.gate_proj.op, mlp.up_proj.op, mlp.down_proj.op)
            elif isinstance(mlp, SparseMoE):
                experts, gate, cfg = mlp.experts, mlp.gate, mlp.gate.cfg
                assert isinstance(experts, CppExperts)
                se = mlp.shared_experts
                self.plan.add_moe(
                    norm.weight, norm.eps, router=gate.weight, correction_bias=gate.e_score_correction_bias,
                    top_k=cfg.top_k, scoring=cfg.scoring_func, topk_method=cfg.topk_method, n_group=cfg.n_group,
                    topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                    routed_scaling_factor=cfg.routed_scaling_factor, experts=experts.weights.op,
                    shared=None if se is None else (se.gate_proj.op, se.up_proj.op, se.down_proj.op),
                    shared_gate=None if mlp.shared_expert_gate is None else mlp.shared_expert_gate.weight)
            else:
                raise ValueError(f"layer {i}: no native MLP for {type(mlp).__name__}")

    def decode_buffers(self, n: int) -> DecodeBuffers | None:
        """Inputs for a decode batch of `n` requests (None above `decode_capacity`): the set not used by
        the last call, so the previous batch's inputs and logits are left alone."""
        if not 1 <= n <= self.decode_capacity:
            return None
        side = self._decode_side = self._decode_side ^ 1
        bufs = self._decode_sets.get((side, n))
        if bufs is None:
            base = self._decode_base[side]
            if base is None:
                import cpp_experts as ext

                base = self._decode_base[side] = (ext.DecodeInputs(self.decode_capacity, self.plan.vocab_size),
                                                  torch.zeros(self.decode_capacity, dtype=torch.int64))
            seq_lens = base[1][:n]
            bufs = self._decode_sets[(side, n)] = DecodeBuffers(base[0].views(n), seq_lens,
                                                                memoryview(seq_lens.numpy()))
        self._decode_last = bufs
        return bufs

    def set_omnikv(self, cfg: OmniKVConfig, plan: LayerPlan, history: QueryHistory | None) -> None:
        """OmniKV for the batches that carry `omnikv` rows: the plan's roles, `cfg`'s sinks, recent tokens
        and alpha, and the filter layers' query window (`history`, None when only the current query counts)."""
        self.plan.set_omnikv(plan.roles, plan.source, sink=cfg.sink_tokens, recent=cfg.recent_tokens, alpha=cfg.alpha,
                             history_q=None if history is None else history.q,
                             history_pos=None if history is None else history.pos)
        self.omnikv = cfg

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits for the batch's logit rows (default: each request's last token); their argmax in
        `self.argmax`, as the LM head found it."""
        last = self._decode_last
        if last is not None and last.batch is batch:  # the batch just written into reused inputs
            return self._forward_decode(last, batch)
        for bufs in self._decode_sets.values():  # an earlier one's, if still intact
            if batch.input_ids is bufs.inputs.input_ids:
                if bufs.batch is not batch:
                    raise RuntimeError("this decode batch's inputs were reused by a later batch: run each batch "
                                       "before building the next but one")
                return self._forward_decode(bufs, batch)
        n_new = batch.extend_seq_lens_cpu
        rows = _int64(batch.req_pool_indices)
        if len(n_new) == int(batch.input_ids.shape[0]):  # one token per request (decode): token i is request i's
            ends = self._aranges.get(len(n_new))
            if ends is None:
                ends = self._aranges[len(n_new)] = torch.arange(len(n_new), dtype=torch.int64)
        else:
            lens = torch.tensor(n_new, dtype=torch.int64)
            rows = torch.repeat_interleave(rows, lens)
            ends = lens.cumsum(0) - 1
        logit_rows = batch.logits_indices
        if logit_rows is None:
            logit_rows = ends
        omni, omni_k = batch.omnikv, None
        if omni is not None and omni.rows:
            if self.omnikv is None:
                raise ValueError("the batch has OmniKV rows, but set_omnikv was never called")
            if any(n_new[i] != 1 for i in omni.rows):
                raise ValueError("an OmniKV row must decode exactly one token")
            omni_k = torch.full((len(rows),), -1, dtype=torch.int64)
            omni_k[ends[torch.tensor(omni.rows, dtype=torch.int64)]] = torch.tensor(omni.budgets, dtype=torch.int64)
        logits = self.plan.forward(batch.input_ids, batch.positions, rows, _int64(batch.out_cache_loc),
                                   _int64(logit_rows).contiguous(), omni_k=omni_k, argmax=True)
        if omni_k is not None:
            self._count(omni)
        return logits

    def _forward_decode(self, bufs: DecodeBuffers, batch: ForwardBatch) -> torch.Tensor:
        """A batch written into reused inputs; with OmniKV rows, their budgets are in `bufs.inputs.omni_k`."""
        omni = batch.omnikv
        if omni is None:
            return self.plan.forward_decode(bufs.inputs, argmax=True)
        if self.omnikv is None:
            raise ValueError("the batch has OmniKV rows, but set_omnikv was never called")
        logits = self.plan.forward_decode(bufs.inputs, argmax=True, omnikv=True)
        self._count(omni)
        return logits

    def _count(self, omni: OmniKVBatch) -> None:
        """Adds what the last forward's filter layers kept, and of how much context, to the batch's counters."""
        selected, context = self.plan.omnikv_counts
        omni.selected_tokens += selected
        omni.context_tokens += context

    @property
    def argmax(self) -> list[int] | None:
        """The last forward's logits rows' argmax (cpp_experts.CpuModel.forward)."""
        return self.plan.argmax
