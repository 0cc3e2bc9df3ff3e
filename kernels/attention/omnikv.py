"""OmniKV in plain torch: the reference of the token selection (models/omnikv_config.py states the
definition) and the per-forward state the torch and Triton backends read.

Keys and queries are seen alike for both attention kinds: queries [.., H, D] against keys
[slots, Hkv, D] with query head h reading KV head h // (H / Hkv). GQA passes its K cache; MLA passes
the absorbed query (q_nope·w_kc ‖ q_pe, D = r + P) against the latent cache viewed as one KV head
([slots, 1, r + P]): the score is q_latent·c_kv + q_pe·k_pe, and one selected row serves every head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.attention.context_bank import ContextBank, Gather

FULL, FILTER, SPARSE = 0, 1, 2  # layer roles, as models.omnikv_config numbers them

# the max over the heads other processes hold, in place (models.parallel.split_heads_max)
HeadsMax = Callable[[torch.Tensor], torch.Tensor]


def importance(q: torch.Tensor, keys: torch.Tensor, q_pos: Sequence[int], weights: Sequence[float],
               scale: float, heads_max: HeadsMax | None = None) -> torch.Tensor:
    """sum_i w_i · max_h softmax_j(scale · q_ih·k_j) over positions j <= q_pos[i].

    q [W, H, D] (window queries, oldest first), keys [n, Hkv, D] (positions 0..n-1) -> [n] fp32.
    `heads_max`: where this process holds only some of the heads (tensor parallelism), the max over the
    other processes' heads, taken on the [W, n] max over this one's before the weighted sum."""
    w, h, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    qg = q.float().view(w, hkv, h // hkv, d)  # [W, Hkv, G, D]
    scores = torch.einsum("wkgd,nkd->wkgn", qg, keys.float()) * scale  # [W, Hkv, G, n]
    pos = torch.tensor(list(q_pos), device=q.device)
    causal = torch.arange(n, device=q.device)[None, :] > pos[:, None]  # [W, n]
    scores = scores.masked_fill(causal[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).reshape(w, h, n).amax(dim=1)  # [W, n]
    if heads_max is not None:
        probs = heads_max(probs.contiguous())
    return (torch.tensor(list(weights), dtype=torch.float32, device=q.device)[:, None] * probs).sum(0)


def kept_count(n: int, k: int, sink: int, recent: int) -> int:
    """How many positions `select_positions` keeps of a context of n (known on the host, no device read)."""
    lo, hi = min(sink, n), max(min(sink, n), n - recent)
    return n if k >= hi - lo else lo + k + (n - hi)


def select_positions(imp: torch.Tensor, k: int, sink: int, recent: int) -> torch.Tensor:
    """Sorted positions kept: 0..sink-1, the last `recent`, and the k most important between them
    (ties to the earlier position). imp [n] -> int64 positions."""
    n = int(imp.shape[0])
    lo, hi = min(sink, n), max(min(sink, n), n - recent)
    if k >= hi - lo:
        return torch.arange(n, device=imp.device)
    middle = imp[lo:hi]
    order = torch.sort(middle, descending=True, stable=True).indices[:k]  # stable: equal scores keep position order
    chosen = torch.sort(order).values + lo
    dev = imp.device
    return torch.cat([torch.arange(lo, device=dev), chosen, torch.arange(hi, n, device=dev)])


class QueryHistory:
    """The filter layers' queries of each request's recent decode steps (the window beyond the current
    query, for `uniform` / `exponential` weights). Per request row of req_to_token: q [F, W, H, D]
    and the position each entry was recorded at (-1: empty), entry = position % W. A row is cleared
    when it is handed to a new request (`clear`), so nothing of the previous owner is ever read."""

    def __init__(self, rows: int, num_filters: int, window: int, num_heads: int, head_dim: int,
                 device: torch.device | str) -> None:
        self.window = window
        self.q = torch.zeros(rows, num_filters, window, num_heads, head_dim, dtype=torch.float32, device=device)
        self.pos = torch.full((rows, num_filters, window), -1, dtype=torch.int64, device=device)

    def clear(self, row: int) -> None:
        self.pos[row].fill_(-1)

    def record(self, f: int, row: int, pos: int, q: torch.Tensor) -> None:
        e = pos % self.window
        self.q[row, f, e] = q.float()
        self.pos[row, f, e] = pos

    def window_of(self, f: int, row: int, pos: int) -> tuple[torch.Tensor, list[int]]:
        """Queries at positions pos-W+1..pos present for this row (oldest first) and their positions.
        The current query (pos) must have been recorded."""
        got = [p for p in range(pos - self.window + 1, pos + 1) if p >= 0 and int(self.pos[row, f, p % self.window]) == p]
        return self.q[row, f, [p % self.window for p in got]], got


@dataclass
class PackedSelection:
    """One filter layer's selections made on the device (`OmniKVBatch.observe_batched`): row j of
    `slots` [P, k_max] int64 holds the KV slots of batch row `batch_rows[j]`, sorted by position, 0 past
    its length; `lens_dev` [P] int64 are those lengths, and `width` (known on the host) bounds them: the
    longest selection eagerly, the capacity k_max in a captured graph (which cannot read the lengths)."""

    batch_rows: list[int]
    batch_rows_dev: torch.Tensor  # [P] int64
    slots: torch.Tensor  # [P, k_max] int64
    width: int
    lens_dev: torch.Tensor  # [P] int64


@dataclass
class GraphRows:
    """The OmniKV inputs of a captured decode graph: device buffers the graph runner rewrites before each
    replay (no per-step host value reaches the forward), and the fixed shapes the capture was made for.
    Every row of the batch goes through the selection; in a batch that mixes OmniKV and full-attention
    rows (`sparse` given), a full row's budget covers its context, so it selects everything (full
    attention) and leaves the query history as it is."""

    req_rows: torch.Tensor  # [B] int64: each row's req_to_token row
    positions: torch.Tensor  # [B] int64: the position of each row's token (context = position + 1)
    budgets: torch.Tensor  # [B] int32: k per row (0 for padding rows, >= the context for full rows)
    width: int  # importance is computed over positions 0..width-1: >= every row's context
    k_cap: int  # selection capacity: >= every row's kept count (budget + sink + recent, or the context)
    sparse: torch.Tensor | None = None  # [B] bool: the OmniKV rows of a mixed batch (None: every row)


class OmniKVBatch:
    """One forward's OmniKV state (`ForwardBatch.omnikv`).

    `rows` are the batch rows that decode with OmniKV this forward (one new token each, their
    context long enough for a selection to leave something out); every other row attends fully.
    Filter layers call `observe` after their attention, which fixes the selection the layers below
    them read through `slots` and `decode_view`. `observe_batched` (the triton backend) makes the same
    selection for all rows at once with device kernels and keeps it padded (`packed`), from which
    `decode_view` builds its table without reading the device."""

    def __init__(self, roles: Sequence[int], source: Sequence[int], rows: Sequence[int], req_rows: Sequence[int],
                 positions: Sequence[int], budgets: Sequence[int], *, sink: int, recent: int,
                 weights_for, table: torch.Tensor, history: QueryHistory | None = None,
                 graph: GraphRows | None = None, bank: ContextBank | None = None,
                 heads_max: HeadsMax | None = None) -> None:
        """`heads_max`: under tensor parallelism (attention split by heads), the max over the ranks that
        makes every rank's importance the whole model's, so that every rank selects the same tokens."""
        self.roles, self.source = list(roles), list(source)
        self.rows = list(rows)
        self._where = {b: i for i, b in enumerate(self.rows)}
        self.req_rows, self.positions, self.budgets = list(req_rows), list(positions), list(budgets)
        self.sink, self.recent = sink, recent
        self.weights_for = weights_for  # present window queries -> alpha weights (oldest first)
        self.table = table
        self.history = history
        self.graph = graph  # a captured graph's device inputs (then req_rows, positions and budgets are empty)
        self.heads_max = heads_max
        self.filter_of: dict[int, int] = {}  # layer -> the index of the last filter layer at or above it
        filters = 0
        for layer, role in enumerate(roles):
            filters += role == FILTER
            self.filter_of[layer] = filters - 1
        self.selected: dict[int, list[torch.Tensor]] = {}  # filter index -> per sparse row: KV slots (int64)
        self.packed: dict[int, PackedSelection] = {}  # filter index -> the same, padded (observe_batched)
        self._device_args: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # observe_batched's per-row inputs
        self._alpha: torch.Tensor | None = None  # [W + 1, W] weights_for(c) in row c, on the device
        self.selected_tokens = 0  # summed over filter layers and rows (metrics)
        self.context_tokens = 0
        # the context bank (kernels/attention/context_bank.py): this decode step's device rows of the host
        # layers, per layer, the [B, W] table that reads them, and the event their gathers end with
        self.bank = bank
        self.banked: dict[int, tuple[torch.Tensor, ...]] = {}
        self.bank_tables: dict[int, torch.Tensor] = {}  # filter index -> arange(B * W).view(B, W), int32
        self._bank_slots: dict[int, torch.Tensor] = {}  # filter index -> the [B, W] KV slots gathered
        self._bank_events: dict[int, torch.cuda.Event | None] = {}

    @classmethod
    def for_graph(cls, roles: Sequence[int], source: Sequence[int], graph: GraphRows, *, sink: int, recent: int,
                  weights_for, table: torch.Tensor, history: QueryHistory | None = None,
                  bank: ContextBank | None = None, heads_max: HeadsMax | None = None) -> OmniKVBatch:
        """The state a captured decode graph runs with: every one of the graph's rows goes through the
        selection (a mixed graph's full rows select their whole context), its inputs read from `graph`'s
        buffers, so a replay selects for whatever the runner wrote there."""
        batch = cls(roles, source, range(graph.req_rows.shape[0]), [], [], [], sink=sink, recent=recent,
                    weights_for=weights_for, table=table, history=history, graph=graph, bank=bank,
                    heads_max=heads_max)
        batch.alpha_table(graph.req_rows.device)  # made here, before any capture (a host-to-device copy)
        return batch

    def covers(self, batch_size: int) -> bool:
        """Whether every row of a batch of `batch_size` decodes with OmniKV."""
        return len(self.rows) == batch_size

    def count_selection(self) -> None:
        """The metrics `observe_batched` adds, from the host's positions and budgets alone: for a forward
        replayed from a graph, whose selections were made without Python."""
        filters = self.roles.count(FILTER)
        ns = [p + 1 for p in self.positions]
        self.selected_tokens += filters * sum(kept_count(n, k, self.sink, self.recent) for n, k in zip(ns, self.budgets))
        self.context_tokens += filters * sum(ns)

    def alpha_table(self, device: torch.device) -> torch.Tensor:
        """[W + 1, W]: row c holds the weights of c present window queries (oldest first), 0 beyond."""
        if self._alpha is None:
            w = self.window
            table = torch.zeros(w + 1, w, dtype=torch.float32)
            for c in range(1, w + 1):
                table[c, :c] = torch.tensor(list(self.weights_for(c)), dtype=torch.float32)
            self._alpha = table.to(device)
        return self._alpha

    def role(self, layer_id: int) -> int:
        return self.roles[layer_id]

    def first_sparse(self, filter_layer: int) -> int | None:
        """The first SPARSE layer reading filter layer `filter_layer`'s selection (None: no layer does)."""
        f = self.filter_of[filter_layer]
        return next((i for i, (r, s) in enumerate(zip(self.roles, self.source)) if r == SPARSE and s == f), None)

    def bank_prefetch(self, filter_layer: int, table: torch.Tensor, lens: torch.Tensor | None, gather: Gather) -> None:
        """At a filter layer of a decode forward, after its selection: the context bank's gathers of the
        rows `table` [B, W] (KV slots: what every sparse layer of this filter's group reads) for those
        layers. Nothing without a bank."""
        if self.bank is None or self.roles[filter_layer] != FILTER:
            return
        f = self.filter_of[filter_layer]
        for layer in [x for x in self.banked if self.source[x] != f]:  # the layers above are done with theirs:
            del self.banked[layer]  # freed first, so that one group's buffers at a time take device memory
        rows, event = self.bank.prefetch(f, table, lens, gather)
        bsz, width = table.shape
        self.banked.update(rows)
        self._bank_slots[f] = table
        self.bank_tables[f] = torch.arange(bsz * width, dtype=torch.int32, device=table.device).view(bsz, width)
        for layer in rows:
            self._bank_events[layer] = event

    def bank_store(self, layer_id: int, loc: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
        """At a host layer of a decode step, once its new KV is computed: the gather (made at the filter
        layer above, before this layer had stored anything) read the pool's stale row for each token's
        own slot, so the new rows (per buffer, [B, *row]) go into the gathered buffers where the table
        holds `loc` [B] (a row whose selection leaves its own token out gets nothing). Device ops only,
        no host read: a captured graph replays it."""
        banked = self.bank_rows(layer_id)
        if banked is None:
            return
        slots = self._bank_slots[self.source[layer_id]]
        bsz, width = slots.shape
        cols = torch.arange(width, device=slots.device)
        hit = slots == loc.to(slots.dtype)[:, None]  # [B, W]: a slot appears once in a row's table
        at = torch.where(hit, cols[None, :], width).amin(1)  # [B]: where the token's own row sits, width if absent
        found = at < width
        at = at.clamp(max=width - 1)
        b = torch.arange(bsz, device=slots.device)
        for buf, new in zip(banked, rows):
            new = new.reshape(bsz, *buf.shape[2:]).to(buf.dtype)
            keep = found.view(bsz, *[1] * (new.dim() - 1))
            buf[b, at] = torch.where(keep, new, buf[b, at])

    def bank_store_latent(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """`bank_store` of MLA's new latent rows c_kv ‖ k_pe, made only for a layer the bank gathered."""
        if layer_id in self.banked:
            self.bank_store(layer_id, loc, (torch.cat([c_kv, k_pe.reshape(k_pe.shape[0], -1)], dim=-1),))

    def bank_rows(self, layer_id: int) -> tuple[torch.Tensor, ...] | None:
        """This step's device rows of a host layer ([B, W, *row] per buffer, row b's entries in the order of
        the table they were gathered with), once their gathers are done; None where the bank made none."""
        rows = self.banked.get(layer_id)
        if rows is None:
            return None
        event = self._bank_events.pop(layer_id, None)
        if event is not None:
            torch.cuda.current_stream(rows[0].device).wait_event(event)
        return rows

    def observe(self, layer_id: int, batch_rows: Sequence[int], q: torch.Tensor, keys: torch.Tensor,
                scale: float) -> None:
        """At a filter layer: q [len(batch_rows), H, D] of those rows' decode tokens, keys [slots, Hkv, D]
        the layer's cache (the new tokens already stored)."""
        if self.roles[layer_id] != FILTER:
            return
        f = self.filter_of[layer_id]
        out = self.selected.setdefault(f, [torch.empty(0, dtype=torch.int64)] * len(self.rows))
        self.packed.pop(f, None)  # the per-row lists are the selection now
        for b, qb in zip(batch_rows, q):
            i = self._where.get(b)
            if i is None:
                continue
            row, pos = self.req_rows[i], self.positions[i]
            n = pos + 1
            if self.history is not None:
                self.history.record(f, row, pos, qb)
                qw, qpos = self.history.window_of(f, row, pos)
            else:
                qw, qpos = qb[None], [pos]
            slots = self.table[row, :n].to(torch.int64)
            imp = importance(qw, keys[slots], qpos, self.weights_for(len(qpos)), scale, self.heads_max)
            chosen = select_positions(imp, self.budgets[i], self.sink, self.recent)
            out[i] = slots[chosen]
            self.selected_tokens += int(chosen.numel())
            self.context_tokens += n

    @property
    def window(self) -> int:
        """Window queries per row (1 without a history)."""
        return self.history.window if self.history is not None else 1

    def _inputs(self, idx: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        """The device tensors of rows `idx` (indices into self.rows) that every filter layer reuses."""
        w = self.window
        g = self.graph
        if g is not None:  # the graph's buffers: positions change between replays, so nothing derived is kept
            pos = g.positions
            return {"batch_rows": torch.arange(pos.shape[0], device=device), "req_rows": g.req_rows, "pos": pos,
                    "ctx": pos + 1, "alpha": self.alpha_table(device),
                    "win_pos": pos[:, None] - (w - 1) + torch.arange(w, device=device)[None, :]}
        key = tuple(idx)
        got = self._device_args.get(key)
        if got is None:
            as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            pos = as_dev([self.positions[i] for i in idx])
            got = {
                "batch_rows": as_dev([self.rows[i] for i in idx]), "req_rows": as_dev([self.req_rows[i] for i in idx]),
                "pos": pos, "ctx": pos + 1, "alpha": self.alpha_table(device),
                "win_pos": pos[:, None] - (w - 1) + torch.arange(w, device=device)[None, :],  # [P, W] oldest first
            }
            self._device_args[key] = got
        return got

    def observe_batched(self, layer_id: int, batch_rows: Sequence[int], q: torch.Tensor, keys: torch.Tensor,
                        scale: float, kernels: ModuleType, importance: torch.Tensor | None = None) -> None:
        """`observe` for every row at once on the device, with `kernels` (kernels.triton_omnikv): the
        current queries are recorded, the present window queries gathered into [P, W, H, D] (absent
        entries: q_pos -1, weight 0), then `kernels.importance` and `kernels.select_slots`. `importance`
        [P, >= l_max]: the rows' importance already known (a one-query window's, from the filter layer's
        own decode attention: `kernels.importance_from_scores`), so the keys are not scored again and q
        only gives the rows. The selection
        is stored padded (`packed`) and per row (`selected`, views of it); the counters come from the
        host's positions and budgets, so no device value is read back."""
        if self.roles[layer_id] != FILTER:
            return
        if importance is not None and self.history is not None:
            raise ValueError("observe_batched: a known importance is one query's; this batch has a query window")
        f = self.filter_of[layer_id]
        out = self.selected.setdefault(f, [torch.empty(0, dtype=torch.int64)] * len(self.rows))
        pick = [(j, self._where[b]) for j, b in enumerate(batch_rows) if b in self._where]
        if not pick:
            return
        dev = q.device
        idx = [i for _, i in pick]
        if len(pick) != q.shape[0]:
            sel = torch.tensor([j for j, _ in pick], dtype=torch.int64, device=dev)
            q = q.index_select(0, sel)
            importance = importance.index_select(0, sel) if importance is not None else None
        a = self._inputs(idx, dev)
        if self.history is not None:
            hist, w = self.history, self.history.window
            rows = a["req_rows"]
            e = a["pos"] % w
            q_new, pos_new = q.float(), a["pos"]
            if self.graph is not None and self.graph.sparse is not None:  # a mixed graph's full rows keep theirs
                keep = ~self.graph.sparse
                q_new = torch.where(keep[:, None, None], hist.q[rows, f, e], q_new)
                pos_new = torch.where(keep, hist.pos[rows, f, e], pos_new)
            hist.q[rows, f, e] = q_new
            hist.pos[rows, f, e] = pos_new
            win_pos = a["win_pos"]
            entries = win_pos.remainder(w)
            present = (win_pos >= 0) & (hist.pos[rows[:, None], f, entries] == win_pos)  # [P, W]
            rank = present.cumsum(1) - 1  # among the present ones, oldest first
            weights = torch.where(present, a["alpha"][present.sum(1, keepdim=True), rank.clamp(min=0)], 0.0)
            # [P, W, H, D], back in the query's dtype (exact: stored as q.float()), so that a 16-bit query
            # keeps the kernels' tensor-core scores
            q_win = hist.q[rows[:, None], f, entries].to(q.dtype)
            q_pos = torch.where(present, win_pos, -1)
        else:
            q_win, q_pos = q[:, None], a["pos"][:, None]
            weights = a["alpha"][1:2].expand(len(idx), 1)
        g = self.graph
        if g is not None:  # fixed shapes, budgets on the device; the metrics come from count_selection
            imp = self._importance(kernels, importance, q_win, q_pos, weights, keys, a, scale, g.width)
            slots, lens_dev = kernels.select_slots(imp, a["ctx"], g.budgets, self.sink, self.recent, self.table,
                                                   a["req_rows"], g.k_cap)
            self.packed[f] = PackedSelection(list(self.rows), a["batch_rows"], slots.to(torch.int64), g.k_cap,
                                             lens_dev.to(torch.int64))
            return
        ns = [self.positions[i] + 1 for i in idx]
        budgets = [self.budgets[i] for i in idx]
        imp = self._importance(kernels, importance, q_win, q_pos, weights, keys, a, scale, max(ns))
        k_max = max(budgets) + self.sink + self.recent
        slots, lens_dev = kernels.select_slots(imp, a["ctx"], budgets, self.sink, self.recent, self.table,
                                               a["req_rows"], k_max)
        slots = slots.to(torch.int64)
        lens = [kept_count(n, k, self.sink, self.recent) for n, k in zip(ns, budgets)]
        self.packed[f] = PackedSelection([self.rows[i] for i in idx], a["batch_rows"], slots, max(lens),
                                         lens_dev.to(torch.int64))
        for j, (i, length) in enumerate(zip(idx, lens)):
            out[i] = slots[j, :length]
        self.selected_tokens += sum(lens)
        self.context_tokens += sum(ns)

    def _importance(self, kernels: ModuleType, known: torch.Tensor | None, q_win: torch.Tensor, q_pos: torch.Tensor,
                    weights: torch.Tensor, keys: torch.Tensor, a: dict[str, torch.Tensor], scale: float,
                    width: int) -> torch.Tensor:
        """`observe_batched`'s importance [P, width]: `known` cut to the width, else `kernels.importance`'s.
        Under tensor parallelism (`heads_max`) each rank's holds its own heads' max, so the max over the
        ranks is taken on each window query's before the weighted sum: one kernel call per window entry
        (weight 1 for it, 0 for the others; an absent entry's column is 0 everywhere), then one reduction of
        them all. With one query (a weight >= 0) the reduction of the weighted importance is the same."""
        if known is not None:
            imp = known[:, :width]
            return imp if self.heads_max is None else self.heads_max(imp.contiguous())
        q_win, q_pos = q_win.contiguous(), q_pos.contiguous()
        score = lambda w: kernels.importance(q_win, q_pos, w, keys, self.table, a["req_rows"], a["ctx"],  # noqa: E731
                                             scale, width)
        if self.heads_max is None:
            return score(weights.contiguous())
        if q_win.shape[1] == 1:
            return self.heads_max(score(weights.contiguous()))
        ones = torch.eye(q_win.shape[1], dtype=torch.float32, device=q_win.device)
        parts = self.heads_max(torch.stack([score(e.expand_as(weights).contiguous()) for e in ones]))  # [W, P, width]
        return (weights.t().float()[:, :, None] * parts).sum(0)

    def slots(self, layer_id: int, batch_row: int) -> torch.Tensor | None:
        """The KV slots batch row `batch_row` attends to at this layer, or None for all of its context."""
        if self.roles[layer_id] != SPARSE:
            return None
        i = self._where.get(batch_row)
        if i is None:
            return None
        sel = self.selected.get(self.source[layer_id])
        if sel is None:
            raise RuntimeError(f"layer {layer_id} reads a selection its filter layer never made")
        return sel[i]

    def decode_view(self, layer_id: int, indices: torch.Tensor | None, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode batch's padded [B, L] KV slots and validity mask with the sparse rows' selections in
        place of their whole contexts (None where this layer attends fully). `indices` and `mask` (every
        row's whole context) may be None when every row of the batch is a sparse row whose selection
        was made on the device (`covers`, `observe_batched`): a captured graph's case."""
        if self.roles[layer_id] != SPARSE or not self.rows:
            return None
        packed = self.packed.get(self.source[layer_id])
        if packed is not None and len(packed.batch_rows) == len(self.rows):
            return self._packed_view(packed, indices, mask)
        if indices is None or mask is None:
            raise ValueError("decode_view needs the rows' contexts unless every row's selection was made on the device")
        lists = [self.slots(layer_id, b) for b in range(indices.shape[0])]
        width = max(int(mask[b].sum()) if s is None else int(s.numel()) for b, s in enumerate(lists))
        out = torch.zeros(indices.shape[0], width, dtype=indices.dtype, device=indices.device)
        valid = torch.zeros(indices.shape[0], width, dtype=torch.bool, device=indices.device)
        for b, s in enumerate(lists):
            if s is None:
                n = int(mask[b].sum())
                out[b, :n] = indices[b, :n]
            else:
                n = int(s.numel())
                out[b, :n] = s.to(indices.device)
            valid[b, :n] = True
        return out, valid

    @staticmethod
    def _packed_view(packed: PackedSelection, indices: torch.Tensor | None, mask: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_view` from a device selection without reading the device. When it covers the batch (its
        rows are 0..B-1, in order), its padded slots as they are (0 past each length), as wide as the
        longest selection (a graph's capacity); else the other rows keep their masked contexts."""
        def keep(width: int) -> torch.Tensor:  # [P, width]: within each selection
            return torch.arange(width, device=packed.slots.device)[None, :] < packed.lens_dev[:, None]

        if indices is None or len(packed.batch_rows) == indices.shape[0]:
            slots = packed.slots[:, : packed.width]
            return (slots if indices is None else slots.to(indices.dtype)), keep(packed.width)
        assert mask is not None
        width = indices.shape[1]
        dev = indices.device
        out = indices[:, :width].masked_fill(~mask[:, :width], 0)
        valid = mask[:, :width].clone()
        sel = torch.zeros(len(packed.batch_rows), width, dtype=indices.dtype, device=dev)
        k = min(width, packed.slots.shape[1])
        sel[:, :k] = packed.slots[:, :k].to(device=dev, dtype=indices.dtype)
        kept = keep(width).to(dev)
        rows = packed.batch_rows_dev.to(dev)
        out.index_copy_(0, rows, sel.masked_fill(~kept, 0))
        valid.index_copy_(0, rows, kept)
        return out, valid
