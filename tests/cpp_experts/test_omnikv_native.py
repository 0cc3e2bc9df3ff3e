"""OmniKV in the native forward: `CpuModel.set_omnikv` / `forward(omni_k=...)` on small random decoders
built here operator by operator (GQA and MLA layers, fp32 weights, fp32 and bf16 caches), and the
attention kernel's per-token slot lists (`PagedAttention(..., slot_lists=...)`).

Oracles: the torch reference `kernels.attention.omnikv` (`importance` + `select_positions` over the
queries the native forward recorded in the query history and the keys it stored), a torch attention
over the selected keys written out here, and the native forward itself without OmniKV: a selection
that keeps everything must give the same bits as full attention."""

from __future__ import annotations

import math

import pytest
import torch

import cpp_experts
from kernels.attention.omnikv import QueryHistory, importance, select_positions
from tests.cpp_experts.helpers import assert_bf16_dot_close, bf16_dot

HIDDEN, VOCAB, INTER = 64, 96, 80
FULL, FILTER, SPARSE = 0, 1, 2


@pytest.fixture(scope="module")
def pool():
    with cpp_experts.WorkerPool(2) as p:
        yield p


def _linear(pool, g: torch.Generator, out: int, inp: int) -> cpp_experts.QuantLinear:
    op = cpp_experts.QuantLinear.from_float(torch.randn(out, inp, generator=g) / math.sqrt(inp), dtype=torch.float32)
    op.bind(pool)
    return op


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, generator=g)


def _rope(dim: int, positions: int = 1024) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.stack([ang.cos(), ang.sin()]).float()


class TinyDecoder:
    """A CpuModel of `layers` attention (GQA or MLA) + dense MLP layers over its own KV caches and
    req_to_token table, with a slot allocator handing out shuffled slots."""

    H, HKV, D = 4, 2, 16  # GQA
    N, P, V, R = 16, 8, 12, 32  # MLA: nope, rope, value dims, kv_lora_rank

    def __init__(self, pool, kind: str, layers: int, kv_dtype: torch.dtype, seed: int, slots: int = 2048,
                 rows: int = 8, width: int = 640) -> None:
        g = torch.Generator().manual_seed(seed)
        if kind == "gqa64":  # a head dim the kernel reads a bf16 cache in paired order at (attention.cpp)
            kind, self.D = "gqa", 64
        self.kind, self.slots = kind, slots
        embed = cpp_experts.QuantLinear.from_float(torch.randn(VOCAB, HIDDEN, generator=g), dtype=torch.float32)
        embed.bind(pool)
        self.model = cpp_experts.CpuModel(pool, embed, _linear(pool, g, VOCAB, HIDDEN), _norm(g, HIDDEN), 1e-6)
        self.table = torch.zeros(rows, width, dtype=torch.int32)
        self.model.set_table(self.table, slots)
        self.caches = []
        for _ in range(layers):
            if kind == "gqa":
                H, Hkv, D = self.H, self.HKV, self.D
                k = torch.zeros(slots, Hkv, D, dtype=kv_dtype)
                v = torch.zeros(slots, Hkv, D, dtype=kv_dtype)
                self.scale = D ** -0.5
                self.model.add_gqa(_norm(g, HIDDEN), 1e-6, _linear(pool, g, H * D, HIDDEN),
                                   _linear(pool, g, Hkv * D, HIDDEN), _linear(pool, g, Hkv * D, HIDDEN),
                                   _linear(pool, g, HIDDEN, H * D), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                   scale=self.scale, rope_table=_rope(D), rope_dim=D, interleaved=False, k_cache=k,
                                   v_cache=v)
                self.caches.append(k)
            else:
                H, N, P, V, r = self.H, self.N, self.P, self.V, self.R
                latent = torch.zeros(slots, r + P, dtype=kv_dtype)
                self.scale = 0.15
                self.model.add_mla(_norm(g, HIDDEN), 1e-6, q=_linear(pool, g, H * (N + P), HIDDEN), q_a=None,
                                   q_a_norm=None, q_a_eps=0.0, q_b=None, kv_a=_linear(pool, g, r + P, HIDDEN),
                                   kv_norm=_norm(g, r), kv_eps=1e-6, w_kc=[_linear(pool, g, r, N) for _ in range(H)],
                                   w_vc=[_linear(pool, g, V, r) for _ in range(H)], o=_linear(pool, g, HIDDEN, H * V),
                                   num_heads=H, nope_dim=N, rope_dim=P, v_dim=V, kv_lora_rank=r, scale=self.scale,
                                   rope_table=_rope(P), interleaved=True, latent=latent)
                self.caches.append(latent)
            self.model.add_dense_mlp(_norm(g, HIDDEN), 1e-6, _linear(pool, g, INTER, HIDDEN),
                                     _linear(pool, g, INTER, HIDDEN), _linear(pool, g, HIDDEN, INTER))
        self.free = (torch.randperm(slots - 1, generator=g) + 1).tolist()
        self.lens: dict[int, int] = {}

    @property
    def heads_dim(self) -> tuple[int, int]:
        return (self.H, self.D) if self.kind == "gqa" else (self.H, self.R + self.P)

    def keys(self, layer: int) -> torch.Tensor:
        """The layer's keys as importance reads them: [slots, Hkv, D] fp32."""
        c = self.caches[layer].float()
        return c if self.kind == "gqa" else c[:, None, :]

    def batch(self, parts: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, ...]:
        """Allocates and records slots for each (row, new ids) after the row's cached tokens."""
        ids, pos, rows, loc, ends = [], [], [], [], []
        for row, new in parts:
            start = self.lens.get(row, 0)
            for i, tok in enumerate(new):
                s = self.free.pop()
                self.table[row, start + i] = s
                ids.append(tok)
                pos.append(start + i)
                rows.append(row)
                loc.append(s)
            self.lens[row] = start + len(new)
            ends.append(len(ids) - 1)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return t(ids), t(pos), t(rows), t(loc), t(ends)

    def forward(self, b: tuple[torch.Tensor, ...], omni_k: torch.Tensor | None = None) -> torch.Tensor:
        ids, pos, rows, loc, ends = b
        return self.model.forward(ids, pos, rows, loc, ends, omni_k=omni_k)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plan_of(layers: int, filters: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Filter layers, every later layer sparse on the nearest filter above it (full_after_filter off)."""
    roles, source, cur = [FULL] * layers, [-1] * layers, -1
    for layer in range(layers):
        if layer in filters:
            roles[layer], cur = FILTER, filters.index(layer)
        elif cur >= 0:
            roles[layer], source[layer] = SPARSE, cur
    return roles, source


def weights_for(alpha: str):
    def w(present: int) -> list[float]:
        if alpha == "last_token":
            return [0.0] * (present - 1) + [1.0]
        if alpha == "uniform":
            return [1.0] * present
        return [2.0 ** (i - present) for i in range(1, present + 1)]
    return w


def assert_same_up_to_ties(got: torch.Tensor, want: torch.Tensor, imp: torch.Tensor, table_row: torch.Tensor,
                           what: str) -> None:
    """got / want: KV slots; positions that differ must have importances within 1e-5 relative."""
    pos_of = {int(s): p for p, s in enumerate(table_row.tolist())}
    g, w = {pos_of[int(s)] for s in got}, {pos_of[int(s)] for s in want}
    assert len(got) == len(want) == len(g), what
    assert got.tolist() == sorted(got.tolist(), key=lambda s: pos_of[int(s)]), f"{what}: not in position order"
    diff = sorted(g ^ w)
    if diff:
        vals = imp[diff]
        assert float(vals.max() - vals.min()) <= 1e-5 * float(vals.abs().max()), f"{what}: differs at {diff}"


# ---- the attention kernel's slot lists ----

def _attend(q, keys, values, slots, scale):
    """q [H, D]; keys/values [slots, Hkv, *] fp32: attention over the listed slots, fp64."""
    k, v = keys[slots.long()].double(), values[slots.long()].double()
    group = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,lhd->hl", q.double(), k.repeat_interleave(group, 1)) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v.repeat_interleave(group, 1)).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_lists_attend_to_their_keys(pool, dtype):
    """A token with a slot list attends to exactly those keys; the list of its row's slots 0..pos gives
    the bits of full attention; tokens without a list keep theirs (split-KV and not: 1 to 4 tokens)."""
    attn = cpp_experts.PagedAttention(pool)
    g = torch.Generator().manual_seed(5)
    slots, H, Hkv, D = 4096, 6, 2, 24
    K = (torch.randn(slots, Hkv, D, generator=g) * 2).to(dtype)
    V = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    lat = (torch.randn(slots, 40, generator=g)).to(dtype)
    lens = [700, 37, 300, 1000]
    table = torch.zeros(6, 1024, dtype=torch.int32)
    perm = torch.randperm(slots - 1, generator=g) + 1
    start = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[start:start + n].int()
        start += n
    for T in (1, 2, 4):
        rows = torch.arange(1, T + 1, dtype=torch.int64)
        pos = torch.tensor([lens[i] - 1 for i in range(T)], dtype=torch.int64)
        q = torch.randn(T, H, D, generator=g)
        qm = torch.randn(T, H, 40, generator=g) / 40 ** 0.25
        sub = [table[i + 1, torch.sort(torch.randperm(lens[i], generator=g)[: lens[i] // 3 + 1]).values].contiguous()
               for i in range(T)]
        lists = [sub[0]] + [None] * (T - 1)
        got = attn.gqa(q, K, V, table, rows, pos, 0.2, slot_lists=lists)
        if dtype == torch.bfloat16 and bf16_dot(D):  # the vdpbf16ps kernel: its query rounded to bf16
            assert_bf16_dot_close(got[0], _attend(q[0].bfloat16().float(), K.float(), V.float(), sub[0], 0.2))
        else:
            torch.testing.assert_close(got[0], _attend(q[0], K.float(), V.float(), sub[0], 0.2), rtol=2e-5,
                                       atol=2e-5)
        full = attn.gqa(q, K, V, table, rows, pos, 0.2)
        assert torch.equal(got[1:], full[1:])
        whole = [table[i + 1, : lens[i]].contiguous() for i in range(T)]
        assert torch.equal(attn.gqa(q, K, V, table, rows, pos, 0.2, slot_lists=whole), full)
        lat3 = lat.float()[:, None, :]
        got = attn.mla(qm, lat, table, rows, pos, 32, 0.1, slot_lists=lists)
        if dtype == torch.bfloat16 and bf16_dot(32):  # the vdpbf16ps kernel: its query rounded to bf16
            assert_bf16_dot_close(got[0], _attend(qm[0].bfloat16().float(), lat3, lat3[..., :32], sub[0], 0.1))
        else:
            torch.testing.assert_close(got[0], _attend(qm[0], lat3, lat3[..., :32], sub[0], 0.1), rtol=2e-5,
                                       atol=2e-5)
        full = attn.mla(qm, lat, table, rows, pos, 32, 0.1)
        assert torch.equal(attn.mla(qm, lat, table, rows, pos, 32, 0.1, slot_lists=whole), full)
    with pytest.raises(ValueError, match="outside the pool"):
        attn.gqa(q[:1], K, V, table, rows[:1], pos[:1], 0.2, slot_lists=[torch.tensor([3, slots], dtype=torch.int32)])
    with pytest.raises(ValueError, match="one entry per token"):
        attn.gqa(q[:1], K, V, table, rows[:1], pos[:1], 0.2, slot_lists=[])


# ---- the model ----

@pytest.mark.parametrize("alpha", ["uniform", "last_token"])  # last_token: the filters' attention dumps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gqa", "gqa64", "mla"])
def test_whole_selection_gives_full_attention_bits(pool, kind, dtype, alpha):
    """Budgets that keep every position: the logits of a mixed batch (OmniKV decodes, a plain decode, a
    prefill chunk) equal the plain forward's bit for bit, and the counts are every position per filter."""
    m = TinyDecoder(pool, kind, 5, dtype, seed=11)
    roles, source = plan_of(5, (1, 3))
    hist = QueryHistory(m.table.shape[0], 2, 4, *m.heads_dim, "cpu")
    m.model.set_omnikv(roles, source, sink=4, recent=16, alpha=alpha, history_q=hist.q, history_pos=hist.pos)
    lens = {1: 300, 2: 129, 3: 64, 4: 250}
    m.forward(m.batch([(r, tokens(n, r)) for r, n in lens.items()]))
    for step in range(3):
        b = m.batch([(1, tokens(1, 50 + step)), (5, tokens(40, 60 + step)), (2, tokens(1, 70 + step)),
                     (3, tokens(1, 80 + step)), (4, tokens(1, 90 + step))])
        omni_k = torch.full((b[0].shape[0],), -1, dtype=torch.int64)
        ends = b[4]
        for i in (0, 2, 4):  # rows 1, 2, 4; row 3 decodes fully
            omni_k[ends[i]] = 10 ** 6 if i != 4 else 400
        sparse = m.forward(b, omni_k)
        counts = m.model.omnikv_counts
        full = m.forward(b)
        assert torch.equal(sparse, full), step
        ctx = sum(int(b[1][ends[i]]) + 1 for i in (0, 2, 4))
        assert counts == (2 * ctx, 2 * ctx)
        assert m.model.omnikv_counts == (0, 0)
        for f in range(2):
            sel = m.model.omnikv_selection(f)
            assert len(sel) == 3 and all(torch.equal(s, m.table[r, : int(s.numel())]) for s, r in zip(sel, (1, 2, 4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", ["last_token", "uniform", "exponential"])
@pytest.mark.parametrize("kind", ["gqa", "gqa64", "mla"])
def test_selection_matches_the_torch_reference(pool, kind, alpha, dtype):
    """A real budget (25% of ~300 tokens, 4 sinks, 16 recent), a window of 4 filled over decode steps:
    the slots kept at each filter layer are those of `importance` + `select_positions` over the recorded
    queries and the stored keys (up to near-ties); rows without a budget get the logits they get with
    nobody sparse; sparse rows' logits move. With `last_token` weights the importance comes from the
    filter layer's own attention (its dump), with the others from scoring the window's queries."""
    m = TinyDecoder(pool, kind, 4, dtype, seed=23)
    roles, source = plan_of(4, (0, 2))
    hist = QueryHistory(m.table.shape[0], 2, 4, *m.heads_dim, "cpu")
    m.model.set_omnikv(roles, source, sink=4, recent=16, alpha=alpha, history_q=hist.q, history_pos=hist.pos)
    lens = {1: 300, 2: 260, 3: 340, 4: 120}
    m.forward(m.batch([(r, tokens(n, r + 7)) for r, n in lens.items()]))
    w = weights_for(alpha)
    for step in range(6):
        parts = [(1, tokens(1, 10 + step)), (2, tokens(1, 20 + step)), (6, tokens(30, 30 + step)),
                 (3, tokens(1, 40 + step)), (4, tokens(1, 50 + step))]
        b = m.batch(parts)
        ends, pos = b[4], b[1]
        omni = [0, 1, 3] if step != 2 else [0, 3]  # row 2 sits one step out: its window has a gap
        omni_k = torch.full((b[0].shape[0],), -1, dtype=torch.int64)
        budgets = {}
        for i in omni:
            n = int(pos[ends[i]]) + 1
            budgets[i] = math.ceil(0.25 * n)
            omni_k[ends[i]] = budgets[i]
        got_logits = m.forward(b, omni_k)
        sel = [m.model.omnikv_selection(f) for f in range(2)]
        # the keys the selection read: the plain forward below writes the new tokens' own again, and
        # at filter layer 2 (after a sparse layer) they differ, which moves each head's softmax sum
        keys = {layer: m.keys(layer).clone() for layer in (0, 2)}
        full_logits = m.forward(b)
        assert torch.equal(got_logits[[2, 4]], full_logits[[2, 4]])  # the prefill chunk and the plain decode
        assert not torch.equal(got_logits[omni], full_logits[omni])
        for f, layer in enumerate((0, 2)):
            for u, i in enumerate(omni):
                row, p = parts[i][0], int(pos[ends[i]])
                qw, qpos = hist.window_of(f, row, p)
                if step >= 3 and alpha != "last_token" and i != 1:
                    assert len(qpos) == 4
                slots = m.table[row, : p + 1].long()
                dv = m.R if kind == "mla" else m.D
                if dtype == torch.bfloat16 and alpha == "last_token" and bf16_dot(dv):
                    qw = qw.bfloat16().float()  # the dump of the vdpbf16ps kernel, which rounds its query so
                imp = importance(qw, keys[layer][slots], qpos, w(len(qpos)), m.scale)
                want = slots[select_positions(imp, budgets[i], 4, 16)].int()
                assert_same_up_to_ties(sel[f][u], want, imp, m.table[row, : p + 1], f"{kind} {alpha} f{f} row {row}")


def test_omnikv_arguments_are_checked(pool):
    m = TinyDecoder(pool, "gqa", 3, torch.float32, seed=3)
    roles, source = plan_of(3, (1,))
    hist = QueryHistory(m.table.shape[0], 1, 2, *m.heads_dim, "cpu")
    m.forward(m.batch([(1, tokens(20, 1)), (2, tokens(20, 2))]))
    b = m.batch([(1, tokens(1, 3))])
    with pytest.raises(ValueError, match="no OmniKV plan"):
        m.forward(b, torch.tensor([5]))
    with pytest.raises(ValueError, match="one entry per layer|3 entries"):
        m.model.set_omnikv(roles[:2], source[:2], sink=1, recent=1, alpha="uniform")
    with pytest.raises(ValueError, match="alpha"):
        m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="max")
    with pytest.raises(ValueError, match="filter layer above"):
        m.model.set_omnikv([SPARSE, FILTER, FULL], [0, -1, -1], sink=1, recent=1, alpha="uniform")
    with pytest.raises(ValueError, match="recent"):
        m.model.set_omnikv(roles, source, sink=1, recent=0, alpha="uniform")
    bad = QueryHistory(m.table.shape[0], 1, 2, 4, 8, "cpu")
    with pytest.raises(ValueError, match="filter layer 1 makes 4 x 16"):
        m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="uniform", history_q=bad.q, history_pos=bad.pos)
    short = QueryHistory(m.table.shape[0] - 1, 1, 2, *m.heads_dim, "cpu")
    with pytest.raises(ValueError, match="req_to_token rows"):
        m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="uniform", history_q=short.q, history_pos=short.pos)
    two = QueryHistory(m.table.shape[0], 2, 2, *m.heads_dim, "cpu")
    with pytest.raises(ValueError, match="2 filter layers, the plan has 1"):
        m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="uniform", history_q=two.q, history_pos=two.pos)
    with pytest.raises(ValueError, match="go together"):
        m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="uniform", history_q=hist.q)
    m.model.set_omnikv(roles, source, sink=1, recent=1, alpha="uniform", history_q=hist.q, history_pos=hist.pos)
    with pytest.raises(ValueError, match="omni_k must be"):
        m.forward(b, torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="budget -2"):
        m.forward(b, torch.tensor([-2]))
    two_tokens = m.batch([(2, tokens(2, 4))])
    with pytest.raises(ValueError, match="only token of its request row 2"):
        m.forward(two_tokens, torch.tensor([-1, 3]))
    assert torch.equal(m.forward(b, torch.tensor([3])), m.forward(b, torch.tensor([3])))
    with pytest.raises(ValueError, match="filter"):
        m.model.omnikv_selection(1)
