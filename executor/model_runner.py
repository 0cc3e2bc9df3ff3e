"""The model runner: turns "these requests get these new tokens" into a `ForwardBatch`, runs the
model, and returns logits.

It owns the pools and the attention backend for one model, and, for a model with CPU routed
experts or native CPU weights (`models.native`), the `CpuExpertPool` they run on (worker threads,
host staging), which it makes, binds to them and releases in `close()`. On the CPU, a model loaded
with native weights runs every forward through `NativeForward` (one native call per batch) when it
can, else through its torch forward (`native_off_reason` says why). It allocates KV slots for the new tokens and records them in
`req_to_token`; the scheduler makes room first (evicting cached prefixes, retracting requests), and
frees slots when a request ends (or caches them in a prefix tree), through `free_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from kernels.attention import create_attention_backend
from kernels.attention.context_bank import ContextBank
from kernels.attention.omnikv import SPARSE, OmniKVBatch, QueryHistory
from models.base import CausalLM
from models.config import DeepseekConfig, ModelConfig
from models.experts import CppExperts, CpuExpertPool
from models.native import native_modules
from models.omnikv_config import LayerPlan, OmniKVConfig
from models.parallel import local_heads, local_kv_heads, split_heads_max
from executor.cpu_forward import NativeForward, unsupported_reason
from executor.cuda_graph_runner import CudaGraphRunner, capture_if_supported
from executor.forward_batch import ForwardBatch, ForwardMode
from executor.memory_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool, TokenSlotAllocator
from executor.sampler import argmax_rows


@dataclass
class OmniKVCounters:
    """What OmniKV did, summed over forwards (the engine's metrics): decode tokens that attended to a
    selection, and the tokens selected against the context they were chosen from (per filter layer)."""

    sparse_tokens: int = 0
    selected_tokens: int = 0
    context_tokens: int = 0

    def add(self, batch: OmniKVBatch) -> None:
        self.sparse_tokens += len(batch.rows)
        self.selected_tokens += batch.selected_tokens
        self.context_tokens += batch.context_tokens


class BatchSink(Protocol):
    """Where the scheduling rank sends each batch before running it (the other ranks run it too)."""

    def step(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        """Sends `batch` to the other ranks; the forward runs inside the context."""
        ...


@dataclass(frozen=True)
class RequestSlice:
    """One request's part of a forward."""

    req_pool_idx: int  # row in req_to_token
    prefix_len: int  # tokens whose KV is already cached (positions 0..prefix_len-1)
    input_ids: Sequence[int]  # the new tokens, at positions prefix_len..
    omnikv: bool = False  # decode this request with OmniKV's sparse attention (when the runner has a config)


def create_kv_pool(
    cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device, page_size: int = 1,
    host_layers: Sequence[int] = (),
) -> KVPool:
    """The latent pool for DeepSeek (MLA), per-head K/V for Llama; `host_layers` in host memory (OmniKV's
    context bank)."""
    if isinstance(cfg, DeepseekConfig):
        return MLATokenToKVPool(
            num_slots, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, device, page_size,
            host_layers=host_layers,
        )
    return MHATokenToKVPool(  # under tensor parallelism, this rank's KV heads
        num_slots, cfg.num_hidden_layers, local_kv_heads(cfg.num_key_value_heads), cfg.head_dim, dtype, device,
        page_size, host_layers=host_layers,
    )


def bank_layers(plan: LayerPlan) -> dict[int, list[int]]:
    """OmniKV's context bank: filter index -> the SPARSE layers reading its selection (held on the host)."""
    groups: dict[int, list[int]] = {}
    for layer, (role, f) in enumerate(zip(plan.roles, plan.source)):
        if role == SPARSE:
            groups.setdefault(f, []).append(layer)
    return groups


def _logits_indices(n_new: list[int], all_logits: bool | Sequence[bool], dev: torch.device) -> torch.Tensor | None:
    per_slice = [all_logits] * len(n_new) if isinstance(all_logits, bool) else list(all_logits)
    if not any(per_slice):
        return None  # the last token of each slice (the model's default)
    rows, start = [], 0
    for n, every in zip(n_new, per_slice):
        rows.extend(range(start, start + n) if every else [start + n - 1])
        start += n
    return torch.tensor(rows, dtype=torch.int64, device=dev)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int | None = None,
        device: str | torch.device = "cpu",
        kv_dtype: torch.dtype | None = None,
        attention_backend: str = "torch",
        page_size: int = 1,
        cuda_graph_max_bs: int = 64,
        disable_cuda_graph: bool = False,
        hybrid_graph_mode: str = "host-nodes",
        omnikv: OmniKVConfig | None = None,
        omnikv_bank: bool = False,
        native_forward: bool = True,
    ) -> None:
        """`omnikv_bank`: OmniKV's context bank (kernels/attention/context_bank.py): the plan's SPARSE layers'
        KV in host memory, their selected rows gathered to the device at each decode step's filter layers."""
        self.model = model
        self.config = config
        self.device = torch.device(device)
        kv_dtype = kv_dtype or next(model.parameters()).dtype
        self.max_context_len = max_context_len or config.max_position_embeddings
        # the rotary tables cover the served context, before the native forward takes them or CUDA graphs
        # capture them (models/rotary.py)
        model.set_context_length(min(self.max_context_len, config.max_position_embeddings))
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, self.max_context_len, self.device)
        self.allocator = TokenSlotAllocator(max_total_tokens, page_size, self.device)
        # OmniKV (models/omnikv_config.py): the layer plan, the filter layers' query window, and counters
        self.omnikv = omnikv
        self.omnikv_plan = omnikv.plan(config.num_hidden_layers) if omnikv is not None else None
        if omnikv_bank and self.omnikv_plan is None:
            raise ValueError("the OmniKV context bank needs an OmniKV config")
        groups = bank_layers(self.omnikv_plan) if omnikv_bank and self.omnikv_plan is not None else {}
        host_layers = sorted(layer for group in groups.values() for layer in group)
        self.kv_pool = create_kv_pool(config, max_total_tokens, kv_dtype, self.device, page_size, host_layers)
        self.context_bank = ContextBank(groups, self.kv_pool.layer_buffers, self.device) if omnikv_bank else None
        self.attn_backend = create_attention_backend(attention_backend)
        problem = self.attn_backend.host_memory_problem(self.device) if self.context_bank is not None else None
        if problem is not None:
            raise ValueError(f"the OmniKV context bank cannot run: {problem}; serve without --omnikv-bank, or "
                             "with --attention-backend torch (which copies through the host, slower)")
        self.omnikv_counters = OmniKVCounters()
        self.query_history: QueryHistory | None = None
        # under tensor parallelism each rank scores its own heads; the max over the ranks makes the selection one
        self.omnikv_heads_max = split_heads_max()
        if omnikv is not None and self.omnikv_plan is not None and omnikv.window_size > 1:
            heads = local_heads(config.num_attention_heads)  # the queries this process records: its own heads'
            dim = config.kv_lora_rank + config.qk_rope_head_dim if isinstance(config, DeepseekConfig) else config.head_dim
            self.query_history = QueryHistory(max_running_requests + 1, self.omnikv_plan.num_filters, omnikv.window,
                                              heads, dim, self.device)
            self.req_to_token_pool.on_alloc.append(self.query_history.clear)
        # CPU routed experts run on this runner's pool (a model shared by several runners runs on the
        # pool of the one running it: `forward` binds it again when another runner bound its own)
        self._cpu_experts = [m for m in model.modules() if isinstance(m, CppExperts)]
        self._native = native_modules(model)
        self.expert_pool = CpuExpertPool() if self._cpu_experts or self._native else None
        self._bind_experts()
        # the whole forward in one native call where the model allows it (CPU, native weights)
        self.native_forward: NativeForward | None = None
        self.native_off_reason: str | None = "the model was loaded without native CPU weights"
        if not native_forward:  # e.g. calibration, whose recording attention backend must see every layer
            self.native_off_reason = "the runner was asked for the torch forward"
        elif self.context_bank is not None:
            self.native_off_reason = "the OmniKV context bank runs with the torch or triton attention backend"
        elif self._native and self.device.type == "cpu":
            self.native_off_reason = unsupported_reason(model, self.kv_pool)
            if self.native_off_reason is None:
                assert self.expert_pool is not None
                self.native_forward = NativeForward(model, config, self.kv_pool, self.req_to_token_pool,
                                                    self.expert_pool.workers)
                if omnikv is not None:
                    self.native_forward.set_omnikv(omnikv, self.omnikv_plan, self.query_history)
        # tensor parallelism, on the rank that schedules: hands every batch to the other ranks first
        # (executor.distributed.Leader); None on one rank and on the ranks that follow
        self.followers: BatchSink | None = None
        self.last_argmax: list[int] | None = None  # the last forward's logits' argmax, where it found it
        self._last_logits: torch.Tensor | None = None  # the logits that last_argmax belongs to
        self.forward_count = 0  # forwards run (idle ones included): DP attention's steps must match across ranks
        # decode replays captured graphs where it can (CUDA only); None: every forward runs eagerly
        self.graph_runner: CudaGraphRunner | None = None
        if not disable_cuda_graph:
            self.graph_runner = capture_if_supported(self, min(cuda_graph_max_bs, max_running_requests),
                                                     hybrid_graph_mode)

    def build_batch(
        self,
        slices: Sequence[RequestSlice],
        *,
        all_logits: bool | Sequence[bool] = False,
        mode: ForwardMode | None = None,
    ) -> ForwardBatch:
        """Allocates KV slots for the new tokens, records them in req_to_token, packs the batch.

        `all_logits` asks for logits at every new token (prompt scoring) instead of the last only:
        for the whole batch, or per slice. Logits rows then follow the slices in order.
        """
        if not slices:
            raise ValueError("empty batch")
        if mode is None and self.native_forward is not None and not (
                all_logits if isinstance(all_logits, bool) else any(all_logits)):
            batch = self._native_decode_batch(slices)
            if batch is not None:
                return batch
        n_new = [len(s.input_ids) for s in slices]
        if min(n_new) <= 0:
            raise ValueError("every request needs at least one new token")
        total = sum(n_new)
        if self.allocator.page_size > 1:  # a request's new tokens continue its last page
            table = self.req_to_token_pool.req_to_token
            last = [int(table[s.req_pool_idx, s.prefix_len - 1]) if s.prefix_len else -1 for s in slices]
        else:
            last = [-1] * len(slices)
        loc = self.allocator.alloc_extend(list(zip(last, n_new)))
        if loc is None:  # the caller makes room first (the scheduler evicts and retracts): a bug if hit
            raise RuntimeError(f"need {total} KV slots, {self.allocator.available_size()} free")
        positions, start = [], 0
        for s, n in zip(slices, n_new):
            self.req_to_token_pool.write(s.req_pool_idx, s.prefix_len, loc[start : start + n])
            positions.extend(range(s.prefix_len, s.prefix_len + n))
            start += n
        if mode is None:  # decode slices: one new token after a cached prefix
            decodes = [n == 1 and s.prefix_len > 0 for s, n in zip(slices, n_new)]
            mode = ForwardMode.DECODE if all(decodes) else ForwardMode.MIXED if any(decodes) else ForwardMode.EXTEND
        seq_lens = [s.prefix_len + n for s, n in zip(slices, n_new)]
        dev = self.device
        omnikv = self._omnikv_batch(slices, n_new)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(slices),
            input_ids=torch.tensor([t for s in slices for t in s.input_ids], dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([s.req_pool_idx for s in slices], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=[s.prefix_len for s in slices],
            extend_seq_lens_cpu=n_new,
            out_cache_loc=loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=_logits_indices(n_new, all_logits, dev),
            omnikv=omnikv,
        )

    def _native_decode_batch(self, slices: Sequence[RequestSlice]) -> ForwardBatch | None:
        """A decode batch written into the native forward's reused inputs (NativeForward.decode_buffers)
        with plain item writes, no torch call; None where the general path must build it (not all decode
        slices, paged slots, more requests than the reused inputs hold)."""
        nf, alloc = self.native_forward, self.allocator
        assert nf is not None
        if alloc.page_size != 1 or len(slices) > nf.decode_capacity:
            return None
        table = self.req_to_token_pool
        for s in slices:  # checked before a slot is taken, so that a bad slice leaks none
            if len(s.input_ids) != 1 or s.prefix_len <= 0:
                return None
            table.check_slot(s.req_pool_idx, s.prefix_len)
        bufs = nf.decode_buffers(len(slices))
        if bufs is None:
            return None
        bufs.batch = None  # the batch these inputs held is no longer theirs, even if this one is not built
        inp = bufs.inputs
        if not alloc.alloc_into(inp.loc_mv):  # the caller makes room first (the scheduler evicts and retracts)
            raise RuntimeError(f"need {len(slices)} KV slots, {alloc.available_size()} free")
        seq_lens, prefix_lens = [], []
        for i, s in enumerate(slices):
            p = s.prefix_len
            table.write_slot(s.req_pool_idx, p, inp.loc_mv[i])
            inp.ids_mv[i], inp.pos_mv[i], inp.rows_mv[i], bufs.seq_mv[i] = s.input_ids[0], p, s.req_pool_idx, p + 1
            seq_lens.append(p + 1)
            prefix_lens.append(p)
        omnikv = self._omnikv_batch(slices, [1] * len(slices)) if self.omnikv is not None else None
        if omnikv is not None:  # each OmniKV row's budget, -1 (full attention) for the others
            for i in range(len(slices)):
                inp.omni_mv[i] = -1
            for i, k in zip(omnikv.rows, omnikv.budgets):
                inp.omni_mv[i] = k
        batch = bufs.batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(slices), input_ids=inp.input_ids, positions=inp.positions,
            req_pool_indices=inp.rows, seq_lens=bufs.seq_lens, seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=[1] * len(slices), out_cache_loc=inp.out_loc,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.kv_pool, attn_backend=self.attn_backend,
            omnikv=omnikv)
        return batch

    def set_omnikv(self, config: OmniKVConfig) -> None:
        """Decodes OmniKV rows with `config`'s plan from the next forward on, over the KV already cached
        (calibration compares plans on the same prompts). The query window must keep its size: the
        history was sized for the runner's first config."""
        if config.window_size != (self.query_history.window if self.query_history is not None else 1) or (
                self.omnikv_plan is not None and self.query_history is not None
                and config.plan(self.config.num_hidden_layers).num_filters != self.omnikv_plan.num_filters):
            raise ValueError("set_omnikv cannot change the query window or, with a window, the number of filter "
                             "layers; make a new ModelRunner")
        plan = config.plan(self.config.num_hidden_layers)
        if self.context_bank is not None and bank_layers(plan) != self.context_bank.groups:
            raise ValueError("set_omnikv cannot change which layers the context bank holds; make a new ModelRunner")
        self.omnikv, self.omnikv_plan = config, plan
        if self.graph_runner is not None:
            self.graph_runner.drop_omnikv_graphs()
        if self.native_forward is not None:
            self.native_forward.set_omnikv(config, plan, self.query_history)

    def omnikv_cuts(self, context: int) -> bool:
        """Whether a decode row asking for OmniKV over `context` tokens attends to less than all of them (a plan
        with sparse layers, a budget that leaves something out): else it computes exactly full attention."""
        cfg, plan = self.omnikv, self.omnikv_plan
        # (filter layers at the top: nothing to cut)
        return cfg is not None and plan is not None and plan.has_sparse and cfg.is_sparse_for(context)

    def _omnikv_batch(self, slices: Sequence[RequestSlice], n_new: list[int]) -> OmniKVBatch | None:
        """OmniKV's state for the decode rows that ask for it and whose context a selection can cut."""
        cfg = self.omnikv
        rows = [i for i, (s, n) in enumerate(zip(slices, n_new))
                if s.omnikv and n == 1 and s.prefix_len > 0 and self.omnikv_cuts(s.prefix_len + 1)]
        if not rows:
            return None
        assert cfg is not None
        return self.omnikv_rows(rows, [slices[i].req_pool_idx for i in rows], [slices[i].prefix_len for i in rows],
                                [cfg.budget_for(slices[i].prefix_len + 1) for i in rows])

    def omnikv_rows(self, rows: list[int], req_rows: list[int], positions: list[int], budgets: list[int]) -> OmniKVBatch:
        """OmniKV's state for a decode forward whose batch rows `rows` (their req_to_token rows, the positions
        of their new tokens, their budgets) decode sparsely: `_omnikv_batch`'s choice, or the one a
        tensor-parallel follower receives from rank 0 (executor.distributed)."""
        cfg, plan = self.omnikv, self.omnikv_plan
        if cfg is None or plan is None:
            raise ValueError("this runner has no OmniKV config")
        return OmniKVBatch(
            plan.roles, plan.source, rows, req_rows, positions, budgets, sink=cfg.sink_tokens,
            recent=cfg.recent_tokens, weights_for=cfg.alpha_weights, table=self.req_to_token_pool.req_to_token,
            history=self.query_history, bank=self.context_bank, heads_max=self.omnikv_heads_max)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits for `batch`: through a captured graph when one can run it, else eagerly. `last_argmax`
        then holds their row-wise argmax where the forward found it as it wrote them, else None.

        A decode batch's logits may be a buffer that a later forward rewrites (a graph's output, or the
        native CPU forward's reused decode inputs: valid until the next-but-one decode): copy rows to keep."""
        if (self._cpu_experts and self._cpu_experts[0].pool is not self.expert_pool) or (
                self._native and self._native[0].op.pool is not self.expert_pool.workers):
            self._bind_experts()
        native = self.native_forward
        if native is not None and self.followers is None:
            # the native CPU forward records no autograd graph and has no followers here: no context is
            # entered around it (a decode step on a CPU runs its Python just after the forward streamed the
            # weights through the caches, so each call there costs microseconds, a torch call tens)
            logits = native.forward(batch)
            self.last_argmax = native.argmax
        else:
            self.last_argmax = None
            with nullcontext() if native is not None else torch.no_grad(), \
                    self.followers.step(batch) if self.followers is not None else nullcontext():
                if native is not None:
                    logits = native.forward(batch)
                    self.last_argmax = native.argmax
                elif self.graph_runner is not None and self.graph_runner.can_run(batch):
                    logits = self.graph_runner.replay(batch)
                else:
                    logits = self.model(batch)
        if batch.omnikv is not None:
            self.omnikv_counters.add(batch.omnikv)
        self.forward_count += 1
        self._last_logits = logits
        return logits

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Row-wise argmax of `logits`, the last forward's output: the forward's own (`last_argmax`) where
        it found it, which spares reading the logits back (see executor.sampler.Sampler)."""
        if self.last_argmax is not None and logits is self._last_logits:
            return self.last_argmax
        return argmax_rows(logits)

    @torch.no_grad()
    def forward_idle(self) -> None:
        """DP attention: this rank has no batch this step but joins the others' exchanges."""
        if self._cpu_experts or self._native:
            self._bind_experts()
        self.model.forward_idle(self.attn_backend.fused_layer_ops)
        self.forward_count += 1

    def _bind_experts(self) -> None:
        if self.expert_pool is None:
            return
        if self.expert_pool.closed:
            raise RuntimeError("this ModelRunner was closed")
        for m in self._cpu_experts:
            m.bind(self.expert_pool)
        for m in self._native:
            m.bind(self.expert_pool.workers)

    def close(self) -> None:
        """Drops the captured graphs and releases the CPU experts' pool (its threads and staging); the
        model itself stays usable by other runners. Idempotent."""
        self.graph_runner = None
        self.native_forward = None
        if self.expert_pool is not None:
            if self.device.type == "cuda":  # copies into or out of the pinned staging may be in flight
                torch.cuda.synchronize(self.device)
            for m in self._cpu_experts:
                if m.pool is self.expert_pool:
                    m.unbind()
            for m in self._native:
                if m.op is not None and m.op.pool is self.expert_pool.workers:
                    m.op.unbind()
            self.expert_pool.close()

    def free_request(self, req_pool_idx: int, seq_len: int) -> None:
        """Returns a finished request's KV slots and its req_to_token row."""
        loc = self.req_to_token_pool.req_to_token[req_pool_idx, :seq_len].to(torch.int64)
        self.allocator.free(loc)
        self.req_to_token_pool.free(req_pool_idx)

    @torch.no_grad()
    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                        omnikv: bool = False) -> list[int]:
        """Greedy continuation of one prompt through the KV cache: prefill, then one decode per token
        (with OmniKV's sparse attention when `omnikv` and the runner has a config)."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            raise RuntimeError("no free request slot")
        out: list[int] = []
        seq_len = 0
        try:
            logits = self.forward(self.build_batch([RequestSlice(row, 0, list(prompt_ids))]))
            seq_len = len(prompt_ids)
            for _ in range(max_new_tokens):
                tok = self.greedy(logits)[-1]
                out.append(tok)
                if tok in stop_ids or len(out) == max_new_tokens:
                    break
                logits = self.forward(self.build_batch([RequestSlice(row, seq_len, [tok], omnikv=omnikv)]))
                seq_len += 1
        finally:
            self.free_request(row, seq_len)
        return out
