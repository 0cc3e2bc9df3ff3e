"""The `triton` attention backend: the kernels of `kernels/triton_attention.py` behind the interface of
docs/architecture.md §4, with the CUDA-graph hooks.

Per forward, `init_forward_metadata` builds what every layer reuses:
- decode: the KV table and its rows (page size 1: `req_to_token` and `req_pool_indices`; paged: a page
  table [B, pages] derived from `req_to_token` and rows 0..B-1), `seq_lens`, and `max_splits`;
- extend/mixed: per-request query starts, prefix and extend lengths as device tensors.

The split plan: `max_splits` depends only on the batch size rounded up to a power of two and on the
number of head blocks, so an eager decode of B requests and the replay of the graph captured for B's
padded size split every request identically (the graph sizes include every power of two), and graph
and eager decode give the same numbers. The per-request number of splits is then computed on the
device from seq_len.

CUDA graphs: `init_cuda_graph_state` allocates the paged table once; on replay the table is rewritten
in place from `req_to_token` (one gather into the same buffer); `seq_lens` and `req_pool_indices` are
the graph runner's own static buffers. Workspace tensors (split partials) are allocated inside the
forward, which a captured graph turns into fixed addresses of its memory pool.

OmniKV (`batch.omnikv`, kernels/attention/omnikv.py): at a FILTER layer the sparse rows' queries and the
layer's keys go to `observe_batched` after the attention (MLA: q_latent ‖ q_pe against the latent rows
viewed as one KV head), which selects for all sparse rows at once on the device with the kernels of
kernels/triton_omnikv.py (importance, then select_slots; at a decode step whose window is the current
query alone, the filter layer's decode attention writes its scores and log-sum-exps as it goes and the
importance comes from them, `importance_from_scores`, as the native CPU forward does: no second read of
the keys); at a SPARSE layer the attention kernels run over a
small table [B, width] of KV slots (page size 1, rows 0..B-1) in which each sparse row holds its
selection and every other row its whole context, with per-row lengths: decode reads it with seq_len =
the row's length, and a MIXED batch's extend kernel with prefix = length - new tokens (a sparse row's
one query sees its whole selection, which ends with the token itself). The table is built once per
forward and filter layer. A DECODE batch whose every row goes through the selection reads the packed
selections as they are and takes nothing from the host: such batches replay CUDA graphs
(`omnikv_graphs`; executor/cuda_graph_runner.py, where a mixed batch's full rows select everything).

OmniKV's context bank (kernels/attention/context_bank.py): at a decode step's filter layer the sparse
view (slots and lengths) goes to the bank, whose gathers (`triton_omnikv.gather_rows`, only each row's
length) copy the rows of the group's host layers into device buffers; the decode kernel of a sparse layer
then reads those buffers through the table 0..B·W-1 (`OmniKVBatch.bank_tables`). Everything else reads a
host layer where it is: the kernels take the pinned buffer's address, which the GPU maps.

Needs a CUDA device, or `TRITON_INTERPRET=1` (set before Triton is imported) for CPU testing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from kernels.attention.omnikv import FILTER, SPARSE
from kernels.graph_support import GraphSupport


PLANS_FILE = Path(__file__).resolve().parent.parent / "configs" / "decode_attention.json"


@dataclass(frozen=True)
class DecodePlan:
    """How a decode attention call is launched: the kernel's tile shape and the split plan. The defaults
    serve where no measured plan exists; `bench/tune_decode_attention.py` measures plans on a GPU and
    writes the fastest per head group and batch size to PLANS_FILE, keyed by the device's name."""

    block_h: int = 16  # query heads a program takes (they share each KV tile it reads)
    block_n: int = 32  # KV positions a tile
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 4  # about waves x SMs programs a call ...
    max_splits: int = 64  # ... in at most this many KV splits a request

    def check(self, group: int) -> None:
        """Raises ValueError unless every field is an integer in the range the kernels take for `group` query
        heads per KV head (whether a tile fits the GPU's shared memory is the tuner's to find: it writes only
        plans that ran)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{f.name} {v!r}: an integer")
        pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
        if not (pow2(self.block_h) and 16 <= self.block_h <= max(16, 1 << (group - 1).bit_length())):
            raise ValueError(f"block_h {self.block_h}: a power of two from 16 to the head group's ({group}) rounded up")
        if not (pow2(self.block_n) and 16 <= self.block_n <= 128):
            raise ValueError(f"block_n {self.block_n}: a power of two from 16 to 128")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_warps {self.num_warps} (1-16, a power of two) or num_stages {self.num_stages} (1-6)")
        if not (1 <= self.waves <= MAX_WAVES and 1 <= self.max_splits <= MAX_SPLITS):
            raise ValueError(f"waves {self.waves} (1-{MAX_WAVES}) or max_splits {self.max_splits} (1-{MAX_SPLITS})")


MAX_WAVES, MAX_SPLITS = 16, 1024  # a plan's bounds: ~16 x SMs programs of fp32 partials at most

PlanTable = dict[int, dict[int, DecodePlan]]  # head group -> batch size (a power of two) -> plan


def parse_plans(raw: object, where: str) -> PlanTable:
    """{"<group>": {"<batch>": {DecodePlan fields}}} -> PlanTable, each plan checked."""
    table: PlanTable = {}
    try:
        for group, by_batch in raw.items():  # type: ignore[union-attr]
            g = int(group)
            table[g] = {}
            for batch, fields in by_batch.items():
                plan = DecodePlan(**fields)
                plan.check(g)
                table[g][int(batch)] = plan
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a table of decode plans ({e})") from e
    return table


def load_plans(device_name: str, path: Path = PLANS_FILE) -> PlanTable:
    """The measured plans of the device named so ({} where none were measured)."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object keyed by device names")
    return parse_plans(raw.get(device_name, {}), f"{path} [{device_name!r}]")


def rounded_batch(batch_size: int) -> int:
    """The batch size rounded up to a power of two: what the split plan and the plan's choice go by, so that
    a padded (graph) batch and the unpadded (eager) one launch alike."""
    return 1 << max(0, batch_size - 1).bit_length()


def pick_plan(table: PlanTable, group: int, batch_size: int) -> DecodePlan:
    """The plan measured for this head group at the largest batch size up to `batch_size` rounded up to
    a power of two (the smallest measured above it else; the defaults for an unmeasured group). Padded
    (graph) and unpadded (eager) batches round alike, so they run the same plan."""
    by_batch = table.get(group)
    if not by_batch:
        return DecodePlan()
    rounded = rounded_batch(batch_size)
    below = [b for b in by_batch if b <= rounded]
    return by_batch[max(below) if below else min(by_batch)]


@dataclass
class _DecodeMeta:
    table: torch.Tensor  # req_to_token (page 1) or page table (paged)
    rows: torch.Tensor  # [B] row of each request in `table`
    seq_lens: torch.Tensor  # [B]
    batch_size: int


@dataclass
class _ExtendMeta:
    table: torch.Tensor
    rows: torch.Tensor
    q_start: torch.Tensor  # [B] first packed token of each request
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    max_extend_len: int
    has_prefix: bool


@dataclass
class _SparseView:
    """One SPARSE layer's KV for every row of the batch (OmniKV): slots of positions 0..lens[b]-1."""

    table: torch.Tensor  # [B, width] int32 KV slots (page size 1)
    rows: torch.Tensor  # arange(B)
    lens: torch.Tensor  # [B] keys per row: a sparse row's selection, another row's whole context


class TritonAttentionBackend(AttentionBackend):
    graph_support = GraphSupport.device_only()
    omnikv_graphs = True  # decode batches of OmniKV rows only can be captured (see the module docstring)
    fused_layer_ops = True

    def __init__(self, *, num_sms: int | None = None, decode_plans: PlanTable | None = None, **_: object) -> None:
        """`num_sms` (streaming multiprocessors) sizes the split plan; read from the device when None.
        `decode_plans`: the decode launch plans to use (else those measured for the device, `load_plans`)."""
        from kernels import triton_attention  # imported here: Triton is needed only when this backend is chosen

        self._k = triton_attention
        self._num_sms = num_sms
        self.decode_plans = decode_plans
        self.decode: _DecodeMeta | None = None
        self.extend: _ExtendMeta | None = None
        self._page_table: torch.Tensor | None = None  # CUDA graphs, paged: [max_bs, max_pages]
        self._graph_rows: torch.Tensor | None = None  # CUDA graphs, paged: arange(max_bs)
        self._sparse_views: dict[int, _SparseView] = {}  # OmniKV, this forward: per filter read
        self._full_view: tuple[torch.Tensor, torch.Tensor] | None = None
        self._omnikv_kernels = None  # kernels.triton_omnikv, imported at the first OmniKV filter layer
        # (layer id, scores, lse, width) a filter layer's decode attention wrote for its `_observe`
        self._filter_scores: tuple[int, torch.Tensor, torch.Tensor, int] | None = None

    def host_memory_problem(self, device: torch.device) -> str | None:
        """The kernels reach a context bank's pinned host buffers through the GPU's mapping of them: a
        store and a gather on a small pinned buffer, checked, before a server relies on it."""
        if device.type != "cuda":
            return None  # the host is the device
        from kernels import triton_omnikv

        try:
            host = torch.zeros(4, 8, dtype=torch.float32, pin_memory=True)
            rows = torch.arange(16, dtype=torch.float32, device=device).view(2, 8)
            self._k.store_rows(host, torch.tensor([1, 3], device=device), rows)
            back = triton_omnikv.gather_rows(host, torch.tensor([[3, 1]], dtype=torch.int32, device=device),
                                             torch.tensor([2], device=device), torch.empty(1, 2, 8, device=device))
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - whatever the driver or Triton says is the reason
            return f"the Triton kernels cannot use pinned host memory here ({type(e).__name__}: {e})"
        if not (torch.equal(host[1], rows[0].cpu()) and torch.equal(back[0].cpu(), rows.cpu().flip(0))):
            return "the Triton kernels read or wrote pinned host memory wrongly here"
        return None

    # ------------------------------------------------------------------ metadata
    def _check_device(self, device: torch.device) -> None:
        from kernels.triton_utils import check_device

        check_device(device, "the triton attention backend", "--attention-backend torch")

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:  # CPU tensors: the interpreter runs programs one by one, so one "SM" (the
            # kernel tests that need several splits pass num_sms)
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        return self._num_sms

    def max_splits(self, batch_size: int, head_blocks: int, device: torch.device,
                   plan: DecodePlan = DecodePlan()) -> int:
        """KV splits per request at most: enough programs for the plan's waves over the SMs, the batch
        rounded up to a power of two so that padded (graph) and unpadded (eager) batches plan alike."""
        want = -(-plan.waves * self._sms(device) // (rounded_batch(batch_size) * head_blocks))
        return max(1, min(plan.max_splits, want))

    def decode_plan(self, group: int, batch_size: int, device: torch.device) -> DecodePlan:
        if self.decode_plans is None:
            self.decode_plans = load_plans(torch.cuda.get_device_name(device)) if device.type == "cuda" else {}
        return pick_plan(self.decode_plans, group, batch_size)

    @staticmethod
    def _paged_table(req_to_token: torch.Tensor, rows: torch.Tensor, page: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, pages] page numbers: the slot of each page's first position, divided by the page size."""
        firsts = req_to_token[:, ::page]
        table = torch.index_select(firsts, 0, rows, out=out) if out is not None else firsts.index_select(0, rows)
        return table.floor_divide_(page)

    def _table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        page = batch.token_to_kv_pool.page_size
        req_to_token = batch.req_to_token_pool.req_to_token
        if page == 1:
            return req_to_token, batch.req_pool_indices, 1
        table = self._paged_table(req_to_token, batch.req_pool_indices, page)
        return table, torch.arange(batch.batch_size, device=table.device), page

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._check_device(batch.input_ids.device)
        self._sparse_views, self._full_view = {}, None
        table, rows, _ = self._table(batch)
        if batch.forward_mode.is_decode():
            self.decode = _DecodeMeta(table, rows, batch.seq_lens, batch.batch_size)
            self.extend = None
            return
        dev = batch.input_ids.device
        as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        self.extend = _ExtendMeta(
            table=table, rows=rows, q_start=as_dev(batch.extend_start_loc_cpu),
            prefix_lens=as_dev(batch.extend_prefix_lens_cpu), extend_lens=as_dev(batch.extend_seq_lens_cpu),
            max_extend_len=max(batch.extend_seq_lens_cpu), has_prefix=batch.has_prefix,
        )
        self.decode = None

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        self._check_device(device)
        self._graph_max_bs = max_bs
        self._graph_rows = torch.arange(max_bs, device=device)

    def _graph_decode_meta(self, batch: ForwardBatch) -> None:
        assert self._graph_rows is not None, "init_cuda_graph_state must run before capture"
        self._sparse_views, self._full_view = {}, None
        bs = batch.batch_size
        page = batch.token_to_kv_pool.page_size
        req_to_token = batch.req_to_token_pool.req_to_token
        if page == 1:
            self.decode = _DecodeMeta(req_to_token, batch.req_pool_indices, batch.seq_lens, bs)
        else:
            if self._page_table is None:
                pages = -(-req_to_token.shape[1] // page)
                self._page_table = torch.zeros(self._graph_max_bs, pages, dtype=req_to_token.dtype,
                                               device=req_to_token.device)
            out = self._page_table[:bs]
            self._paged_table(req_to_token, batch.req_pool_indices, page, out=out)
            self.decode = _DecodeMeta(out, self._graph_rows[:bs], batch.seq_lens, bs)
        self.extend = None

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if not batch.forward_mode.is_decode():
            raise ValueError("only decode batches are captured in CUDA graphs")
        self._graph_decode_meta(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        # page size 1: nothing to do beyond bookkeeping, the graph reads the runner's static buffers;
        # paged: the page table is regathered into the same buffer the graph reads
        self._graph_decode_meta(batch)

    # ------------------------------------------------------------------ OmniKV
    def _sparse_view(self, layer_id: int, batch: ForwardBatch) -> _SparseView | None:
        """At an OmniKV SPARSE layer, the KV every row reads (None: every row attends fully here)."""
        sparse = batch.omnikv
        if sparse is None or sparse.role(layer_id) != SPARSE:
            return None
        key = sparse.source[layer_id]  # layers reading one filter's selection share the table
        view = self._sparse_views.get(key)
        if view is None:
            # every row sparse: the selections alone, nothing built from the host's lengths (a graph's case)
            if self._full_view is None and not sparse.covers(batch.batch_size):
                req_to_token = batch.req_to_token_pool.req_to_token
                lens = batch.seq_lens_cpu
                width = max(lens)
                mask = torch.arange(width, device=req_to_token.device)[None, :] < torch.tensor(
                    lens, device=req_to_token.device)[:, None]
                indices = req_to_token[batch.req_pool_indices, :width].masked_fill(~mask, 0)
                self._full_view = (indices, mask)
            got = sparse.decode_view(layer_id, *(self._full_view or (None, None)))
            if got is None:
                return None
            table, valid = got
            view = _SparseView(table.to(torch.int32).contiguous(),
                               torch.arange(batch.batch_size, device=table.device), valid.sum(1).to(torch.int32))
            self._sparse_views[key] = view
        return view

    def _observe(self, layer: AttentionLayer, batch: ForwardBatch, q: torch.Tensor, q_rope: torch.Tensor | None,
                 keys: torch.Tensor) -> None:
        """At an OmniKV FILTER layer, after its attention: the sparse rows' queries (one token each; MLA:
        q_latent ‖ q_pe) and the layer's keys [slots, Hkv, D] (MLA: the latent rows) make the selection,
        for every sparse row at once with the kernels of kernels/triton_omnikv.py (`observe_batched`)."""
        sparse = batch.omnikv
        if sparse is None or sparse.role(layer.layer_id) != FILTER or not sparse.rows:
            return
        # a one-query window's importance from the scores this layer's decode attention wrote: then the
        # queries only say which rows (no q_pe is joined to them)
        dumped, self._filter_scores = self._filter_scores, None
        known = dumped is not None and dumped[0] == layer.layer_id and batch.forward_mode.is_decode()
        join_rope = q_rope is not None and not known
        if batch.forward_mode.is_decode() and sparse.covers(batch.batch_size):
            idx = None  # every row, in order (a captured graph's path: no index tensor from the host)
            qs = torch.cat([q, q_rope], dim=-1) if join_rope else q
        else:
            if batch.forward_mode.is_decode():
                tokens = list(sparse.rows)
            else:
                starts = batch.extend_start_loc_cpu
                tokens = [starts[b] for b in sparse.rows]
            idx = torch.tensor(tokens, dtype=torch.int64, device=q.device)
            qs = q.index_select(0, idx)
            if join_rope:
                qs = torch.cat([qs, q_rope.index_select(0, idx)], dim=-1)
        if self._omnikv_kernels is None:
            from kernels import triton_omnikv

            self._omnikv_kernels = triton_omnikv
        importance = None
        if known:
            _, scores, lse, width = dumped
            assert self.decode is not None
            importance = self._omnikv_kernels.importance_from_scores(scores, lse, self.decode.seq_lens, width)
            if idx is not None:
                importance = importance.index_select(0, idx)
        sparse.observe_batched(layer.layer_id, list(sparse.rows), qs, keys, layer.scaling, self._omnikv_kernels,
                               importance=importance)
        # the layers below read this selection: a view kept from an earlier run of the forward (a graph
        # capture's warm-up runs, made without new metadata) would hold that run's table
        self._sparse_views.pop(sparse.filter_of[layer.layer_id], None)
        first = sparse.first_sparse(layer.layer_id) if sparse.bank is not None else None
        if first is not None and batch.forward_mode.is_decode():
            view = self._sparse_view(first, batch)
            assert view is not None
            sparse.bank_prefetch(layer.layer_id, view.table, view.lens, self._omnikv_kernels.gather_rows)

    def _banked(self, layer: AttentionLayer, batch: ForwardBatch) -> tuple[torch.Tensor, ...] | None:
        """A decode step's device rows of this host layer, gathered by the context bank, flattened to
        [B·W, *row] (None: the layer reads the pool)."""
        sparse = batch.omnikv
        if sparse is None or sparse.bank is None or not batch.forward_mode.is_decode():
            return None
        rows = sparse.bank_rows(layer.layer_id)
        return None if rows is None else tuple(r.view(-1, *r.shape[2:]) for r in rows)

    def _extend(self, q, q_rope, k, k_rope, v, out, layer: AttentionLayer, batch: ForwardBatch, page: int):
        """Extend attention over the pool; at an OmniKV SPARSE layer the decode rows of a MIXED batch
        read their selections (prefix = selection - 1) and the other rows their contexts as usual."""
        m = self.extend
        assert m is not None, "init_forward_metadata must run before attention"
        table, rows, prefix_lens = m.table, m.rows, m.prefix_lens
        view = self._sparse_view(layer.layer_id, batch)
        if view is not None:
            table, rows, prefix_lens, page = view.table, view.rows, view.lens - m.extend_lens, 1
        return self._k.extend_attention(
            q, q_rope, k, k_rope, v, out, q_start=m.q_start, prefix_lens=prefix_lens,
            extend_lens=m.extend_lens, max_extend_len=m.max_extend_len, sm_scale=layer.scaling,
            table=table, rows=rows, page_size=page,
        )

    # ------------------------------------------------------------------ decode
    def _decode(
        self, q: torch.Tensor, q_rope: torch.Tensor | None, k: torch.Tensor, k_rope: torch.Tensor | None,
        v: torch.Tensor | None, out: torch.Tensor, layer: AttentionLayer, page: int, batch: ForwardBatch,
        banked: bool = False,
    ) -> torch.Tensor:
        """`banked`: k / k_rope / v are the context bank's rows of this layer, read through its table."""
        m = self.decode
        assert m is not None, "init_forward_metadata must run before attention"
        table, rows, seq_lens = m.table, m.rows, m.seq_lens
        view = self._sparse_view(layer.layer_id, batch)
        if view is not None:  # OmniKV SPARSE layer: sparse rows read their selections
            table, rows, seq_lens, page = view.table, view.rows, view.lens, 1
            if banked:
                assert batch.omnikv is not None
                table = batch.omnikv.bank_tables[batch.omnikv.source[layer.layer_id]]
        num_heads = q.shape[1]
        group = num_heads // k.shape[1]
        plan = self.decode_plan(group, m.batch_size, q.device)
        head_blocks = k.shape[1] * -(-group // plan.block_h)
        splits = self.max_splits(m.batch_size, head_blocks, q.device, plan)
        o_shape, lse_shape = self._k.decode_partials_shape(m.batch_size, num_heads, splits, out.shape[-1])
        part_o = torch.empty(o_shape, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        scores, lse = self._filter_score_buffers(layer, batch, num_heads, q.device)
        return self._k.decode_attention(
            q, q_rope, k, k_rope, v, out, table, rows, seq_lens, layer.scaling, splits,
            part_o, part_lse, page_size=page, block_h=plan.block_h, block_n=plan.block_n, scores=scores, lse=lse,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )

    def _filter_score_buffers(self, layer: AttentionLayer, batch: ForwardBatch, num_heads: int,
                              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """At an OmniKV FILTER layer of a decode step whose window is the current query alone: buffers
        that the layer's decode attention fills with its scores and log-sum-exps, from which `_observe`
        takes the importance instead of scoring every key a second time (None, None elsewhere)."""
        self._filter_scores = None
        sparse = batch.omnikv
        if (sparse is None or not sparse.rows or sparse.role(layer.layer_id) != FILTER or sparse.window != 1
                or not batch.forward_mode.is_decode()):
            return None, None
        # >= every row's context: a graph's bucket, or the batch's longest context
        width = sparse.graph.width if sparse.graph is not None else max(batch.seq_lens_cpu)
        bsz = batch.batch_size
        scores = torch.empty(bsz, num_heads, width, dtype=torch.float32, device=device)
        lse = torch.empty(bsz, num_heads, dtype=torch.float32, device=device)
        self._filter_scores = (layer.layer_id, scores, lse, width)
        return scores, lse

    # ------------------------------------------------------------------ MHA / GQA
    def _set_kv(self, layer: AttentionLayer, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """The pool's K/V store; a context bank's host layer is written by a kernel through the device's
        mapping of the pinned buffer (capturable, where the pool's indexing copies through the host)."""
        pool = batch.token_to_kv_pool
        if layer.layer_id not in pool.host_layers:
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
            return
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        self._k.store_rows(k_buf, batch.out_cache_loc, k.contiguous())
        self._k.store_rows(v_buf, batch.out_cache_loc, v.contiguous())

    def forward_extend(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        self._set_kv(layer, batch, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        out = self._extend(q, None, k_buf, None, v_buf, out, layer, batch, pool.page_size)
        self._observe(layer, batch, q, None, k_buf)
        return out

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        self._set_kv(layer, batch, k, v)
        if batch.omnikv is not None:
            batch.omnikv.bank_store(layer.layer_id, batch.out_cache_loc, (k, v))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        banked = self._banked(layer, batch)
        k_read, v_read = banked if banked is not None else (k_buf, v_buf)
        out = self._decode(q, None, k_read, None, v_read, out, layer, pool.page_size, batch, banked is not None)
        self._observe(layer, batch, q, None, k_buf)
        return out

    # ------------------------------------------------------------------ MLA
    def set_mla_kv(self, layer, batch, c_kv, k_pe):
        pool = batch.token_to_kv_pool
        self._k.store_latent(pool.get_kv_buffer(layer.layer_id), batch.out_cache_loc,
                             c_kv.contiguous(), k_pe.reshape(k_pe.shape[0], -1).contiguous())
        if batch.omnikv is not None and batch.forward_mode.is_decode():
            batch.omnikv.bank_store_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)

    def forward_mla_normal(self, q, k, v, layer, batch):
        m = self.extend
        assert m is not None, "init_forward_metadata must run before attention"
        if m.has_prefix:
            raise ValueError("forward_mla_normal cannot attend to a cached prefix; use forward_mla_absorb")
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        return self._k.extend_attention(
            q, None, k, None, v, out, q_start=m.q_start, prefix_lens=m.prefix_lens, extend_lens=m.extend_lens,
            max_extend_len=m.max_extend_len, sm_scale=layer.scaling, kv_start=m.q_start,
        )

    def forward_mla_absorb(self, q_latent, q_pe, layer, batch):
        pool = batch.token_to_kv_pool
        buf = pool.get_kv_buffer(layer.layer_id)
        r = layer.kv_lora_rank
        banked = self._banked(layer, batch)
        read = banked[0] if banked is not None else buf
        c_kv, k_pe = read[:, None, :r], read[:, None, r:]  # column views of the latent rows: one "KV head"
        out = q_latent.new_empty(q_latent.shape)
        if batch.forward_mode.is_decode():
            out = self._decode(q_latent, q_pe, c_kv, k_pe, None, out, layer, pool.page_size, batch, banked is not None)
        else:
            out = self._extend(q_latent, q_pe, c_kv, k_pe, None, out, layer, batch, pool.page_size)
        self._observe(layer, batch, q_latent, q_pe, buf[:, None, :])  # the latent rows: one "KV head" of r + P
        return out
