"""OmniKV through the CPU-native forward (`NativeForward.set_omnikv`, `batch.omnikv`), on the synthetic
checkpoints and the tiny HF checkpoints the other executor tests use.

Oracles: the native forward without OmniKV (a selection that keeps every position must give the same
bits), the torch reference of the selection (`kernels.attention.omnikv.importance` and
`select_positions` over the queries in the runner's `QueryHistory` and the keys in its KV cache), and
the torch forward of the same checkpoint through a `ModelRunner` with the same OmniKV config (once
the torch attention backend reads `batch.omnikv`; skipped before)."""

from __future__ import annotations

import pytest
import torch

from executor.model_runner import ModelRunner, RequestSlice
from kernels.attention.omnikv import OmniKVBatch, QueryHistory, importance, select_positions
from models.loader.load import load_model
from models.omnikv_config import OmniKVConfig
from models.synthetic import write_checkpoint
from tests.hf_models import build_hf_model


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner_for(path, cfg: OmniKVConfig | None, *, native: bool = True, kv_dtype=None, requests: int = 8,
               slots: int = 3072) -> ModelRunner:
    loaded = load_model(path, dtype="float32", cpu_weights="float32" if native else None, load_tokenizer=False,
                        progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=slots, max_running_requests=requests,
                         kv_dtype=kv_dtype, omnikv=cfg)
    assert (runner.native_forward is not None) == native, runner.native_off_reason
    return runner


def keys_of(runner: ModelRunner, layer: int) -> torch.Tensor:
    """A layer's keys as the selection reads them: GQA's K cache, or MLA's latent rows as one KV head."""
    pool = runner.kv_pool
    if hasattr(pool, "kv_buffer"):
        return pool.kv_buffer[layer].float()[:, None, :]
    return pool.k_buffer[layer].float()


def scale_of(runner: ModelRunner, layer: int) -> float:
    attn = runner.model.model.layers[layer].self_attn
    return attn.absorb_layer.scaling if hasattr(attn, "absorb_layer") else attn.layer.scaling


# ---- a selection of everything is full attention ----

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return {preset: write_checkpoint(tmp_path_factory.mktemp(preset), preset, seed=4, num_layers=6)
            for preset in ("tiny-llama", "tiny-deepseek-v2")}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v2"])
def test_whole_selection_decodes_like_full_attention(synthetic, preset, kv_dtype):
    """Budgets covering every candidate (the runner would skip such rows, so the batch's OmniKV state is
    built here): decode logits equal the full forward's bit for bit, in a batch that also holds a
    prefill chunk and a plain decode; every filter layer counts each row's whole context."""
    cfg = OmniKVConfig(filter_layers=(1, 3), budget_tokens=10 ** 6, sink_tokens=4, recent_tokens=16, alpha="uniform",
                       window=4)
    runner = runner_for(synthetic[preset], cfg, kv_dtype=kv_dtype)
    assert runner.omnikv_plan.roles == (0, 1, 0, 1, 0, 2)
    vocab = runner.config.vocab_size
    lens = [300, 170, 64]
    rows = [runner.req_to_token_pool.alloc() for _ in range(4)]
    runner.forward(runner.build_batch([RequestSlice(r, 0, prompt(n, vocab, r)) for r, n in zip(rows, lens)]))
    for step in range(4):
        slices = [RequestSlice(rows[0], lens[0] + step, prompt(1, vocab, 10 + step)),
                  RequestSlice(rows[3], 25 * step, prompt(25, vocab, 20 + step)),
                  RequestSlice(rows[1], lens[1] + step, prompt(1, vocab, 30 + step)),
                  RequestSlice(rows[2], lens[2] + step, prompt(1, vocab, 40 + step))]
        batch = runner.build_batch(slices)
        assert batch.omnikv is None
        full = runner.forward(batch)
        plan = runner.omnikv_plan
        sparse_rows = [0, 2]
        batch.omnikv = OmniKVBatch(plan.roles, plan.source, sparse_rows, [slices[b].req_pool_idx for b in sparse_rows],
                                   [slices[b].prefix_len for b in sparse_rows], [10 ** 6, 500], sink=4, recent=16,
                                   weights_for=cfg.alpha_weights, table=runner.req_to_token_pool.req_to_token,
                                   history=runner.query_history)
        got = runner.forward(batch)
        assert torch.equal(got, full), step
        ctx = sum(slices[b].prefix_len + 1 for b in sparse_rows)
        assert (batch.omnikv.selected_tokens, batch.omnikv.context_tokens) == (2 * ctx, 2 * ctx)


# ---- a real budget against the torch reference ----

@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    out = {}
    for i, name in enumerate(("llama_gqa_tied", "v2_lite_yarn_grouped")):
        d = tmp_path_factory.mktemp(name)
        build_hf_model(name, seed=300 + i).save_pretrained(d)
        out[name] = d
    return out


def omnikv_cfg(alpha: str) -> OmniKVConfig:
    # three layers: filters 0 and 1, layer 2 sparse on filter 1
    return OmniKVConfig(filter_layers=(0, 1), budget_ratio=0.25, sink_tokens=4, recent_tokens=16, alpha=alpha,
                        window=4, full_after_filter=False)


def decode_steps(runner: ModelRunner, vocab: int, steps: int, on_step) -> None:
    """Three OmniKV requests (contexts ~270-330), a plain decode and a prefill arriving in chunks, all in
    each forward; one OmniKV request sits out OmniKV at step 2 (a gap in its window)."""
    lens = {"a": 300, "b": 270, "c": 330, "d": 100}
    rows = {k: runner.req_to_token_pool.alloc() for k in "abcde"}
    runner.forward(runner.build_batch([RequestSlice(rows[k], 0, prompt(n, vocab, ord(k))) for k, n in lens.items()]))
    for step in range(steps):
        slices = [RequestSlice(rows["a"], lens["a"] + step, prompt(1, vocab, 100 + step), omnikv=True),
                  RequestSlice(rows["e"], 20 * step, prompt(20, vocab, 200 + step), omnikv=True),
                  RequestSlice(rows["b"], lens["b"] + step, prompt(1, vocab, 300 + step), omnikv=step != 2),
                  RequestSlice(rows["d"], lens["d"] + step, prompt(1, vocab, 400 + step)),
                  RequestSlice(rows["c"], lens["c"] + step, prompt(1, vocab, 500 + step), omnikv=True)]
        batch = runner.build_batch(slices)
        assert batch.omnikv is not None and batch.omnikv.rows == ([0, 2, 4] if step != 2 else [0, 4])
        logits = runner.forward(batch)
        on_step(step, slices, batch, logits)


def window_history(runner: ModelRunner) -> QueryHistory:
    """The runner's query history; for last_token (which keeps none) one given to the native forward
    anyway, so that the test can read the queries the selection used."""
    if runner.query_history is not None:
        return runner.query_history
    assert runner.omnikv.alpha == "last_token"
    c, plan = runner.config, runner.omnikv_plan
    dim = c.kv_lora_rank + c.qk_rope_head_dim if hasattr(c, "kv_lora_rank") else c.head_dim
    hist = QueryHistory(runner.req_to_token_pool.req_to_token.shape[0], plan.num_filters, 4, c.num_attention_heads,
                        dim, "cpu")
    runner.native_forward.set_omnikv(runner.omnikv, plan, hist)
    return hist


def native_selections(runner: ModelRunner, hist: QueryHistory, slices, batch) -> list[list[tuple[list[int], torch.Tensor]]]:
    """Per filter, per OmniKV row: the positions the native forward kept, and the reference importance
    computed from the recorded window and the stored keys; checks them against `select_positions`
    (equal up to near-ties: positions that differ have importances within 1e-5 relative)."""
    cfg, om = runner.omnikv, batch.omnikv
    table = runner.req_to_token_pool.req_to_token
    out = []
    for f, layer in enumerate(cfg.filter_layers):
        got = runner.native_forward.plan.omnikv_selection(f)
        assert len(got) == len(om.rows)
        per_row = []
        for i, b in enumerate(om.rows):
            row, pos = slices[b].req_pool_idx, slices[b].prefix_len
            q, qpos = hist.window_of(f, row, pos)
            slots = table[row, : pos + 1].long()
            pos_of = {s: p for p, s in enumerate(slots.tolist())}
            imp = importance(q, keys_of(runner, layer)[slots], qpos, cfg.alpha_weights(len(qpos)),
                             scale_of(runner, layer))
            want = [pos_of[s] for s in slots[select_positions(imp, om.budgets[i], 4, 16)].tolist()]
            positions = [pos_of[s] for s in got[i].tolist()]
            assert len(positions) == len(want) and positions == sorted(positions)
            assert_near_ties(positions, want, imp)
            per_row.append((positions, imp))
        out.append(per_row)
    return out


def assert_near_ties(got: list[int], want: list[int], imp: torch.Tensor) -> None:
    diff = sorted(set(got) ^ set(want))
    if diff:
        vals = imp[diff]
        assert float(vals.max() - vals.min()) <= 1e-5 * float(vals.abs().max()), diff


@pytest.mark.parametrize("alpha", ["last_token", "uniform", "exponential"])
@pytest.mark.parametrize("name", ["llama_gqa_tied", "v2_lite_yarn_grouped"])
def test_selection_matches_the_reference(hf_checkpoints, name, alpha):
    """The slots each filter layer keeps (25% of ~300 tokens, 4 sinks, 16 recent, a window of 4) are the
    reference's over the runner's recorded queries and stored keys, up to near-ties; the window holds
    the row's last four OmniKV steps; the runner's counters add up what was kept."""
    runner = runner_for(hf_checkpoints[name], omnikv_cfg(alpha))
    hist = window_history(runner)
    totals = [0, 0]

    def check(step, slices, batch, logits):
        native_selections(runner, hist, slices, batch)
        om = batch.omnikv
        for f in range(2):
            for b in om.rows:  # row 2 sat out step 2: a gap in its window
                _, qpos = hist.window_of(f, slices[b].req_pool_idx, slices[b].prefix_len)
                assert len(qpos) == (min(step + 1, 4) if b != 2 or step < 2 else 3)
        totals[0] += om.selected_tokens
        totals[1] += om.context_tokens
        assert om.selected_tokens == sum(2 * (4 + 16 + k) for k in om.budgets)
        assert om.context_tokens == sum(2 * (slices[b].prefix_len + 1) for b in om.rows)

    decode_steps(runner, runner.config.vocab_size, 5, check)
    c = runner.omnikv_counters
    assert (c.sparse_tokens, c.selected_tokens, c.context_tokens) == (14, totals[0], totals[1])


@pytest.mark.parametrize("alpha", ["last_token", "uniform", "exponential"])
@pytest.mark.parametrize("name", ["llama_gqa_tied", "v2_lite_yarn_grouped"])
def test_logits_match_the_torch_forward(hf_checkpoints, name, alpha):
    """The same batches through the torch forward with the same OmniKV config: the same positions kept
    (up to near-ties) and logits within 1e-4 relative."""
    cfg = omnikv_cfg(alpha)
    native = runner_for(hf_checkpoints[name], cfg)
    hist = window_history(native)
    torch_runner = runner_for(hf_checkpoints[name], cfg, native=False)
    got, want = [], []

    def on_native(step, slices, batch, logits):
        got.append((logits, native_selections(native, hist, slices, batch)))

    def on_torch(step, slices, batch, logits):
        om = batch.omnikv
        if not om.selected:
            pytest.skip("the torch attention backend does not read batch.omnikv yet")
        table = torch_runner.req_to_token_pool.req_to_token
        kept = []
        for f in range(2):
            per_row = []
            for i, b in enumerate(om.rows):
                row, pos = slices[b].req_pool_idx, slices[b].prefix_len
                pos_of = {s: p for p, s in enumerate(table[row, : pos + 1].tolist())}
                per_row.append([pos_of[int(s)] for s in om.selected[f][i]])
            kept.append(per_row)
        want.append((logits, kept))

    decode_steps(native, native.config.vocab_size, 5, on_native)
    decode_steps(torch_runner, native.config.vocab_size, 5, on_torch)
    for step, ((a, sel_a), (b, sel_b)) in enumerate(zip(got, want)):
        for f in range(2):
            for (positions, imp), ref in zip(sel_a[f], sel_b[f]):
                assert_near_ties(positions, ref, imp)
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-4, (step, err)


# ---- the query history ----

def test_a_reused_row_never_reads_the_previous_owner_queries(hf_checkpoints):
    """One request row: A decodes (its queries fill the row's window), ends; B takes the row, its
    positions overlapping A's. B decodes exactly as it does on a fresh runner."""
    cfg = OmniKVConfig(filter_layers=(0,), budget_tokens=40, sink_tokens=4, recent_tokens=16, alpha="uniform", window=4,
                       full_after_filter=False)
    path = hf_checkpoints["llama_gqa_tied"]

    def run(runner, ids, steps):
        row = runner.req_to_token_pool.alloc()
        assert row == 1
        out = [runner.forward(runner.build_batch([RequestSlice(row, 0, ids)]))]
        for s in range(steps):
            batch = runner.build_batch([RequestSlice(row, len(ids) + s, [int(out[-1][-1].argmax())], omnikv=True)])
            assert batch.omnikv is not None
            out.append(runner.forward(batch))
        runner.free_request(row, len(ids) + steps)
        return out

    vocab = 320
    reused = runner_for(path, cfg, requests=1)
    run(reused, prompt(300, vocab, 1), 4)  # positions 300..303 recorded in row 1
    b_ids = prompt(301, vocab, 2)
    again = run(reused, b_ids, 3)  # B at 301..303: A's entries would match 300..303
    fresh = run(runner_for(path, cfg, requests=1), b_ids, 3)
    for x, y in zip(again, fresh):
        assert torch.equal(x, y)


def test_an_omnikv_row_must_decode_one_token(hf_checkpoints):
    cfg = OmniKVConfig(filter_layers=(0,), budget_tokens=8, sink_tokens=2, recent_tokens=4, full_after_filter=False)
    runner = runner_for(hf_checkpoints["llama_gqa_tied"], cfg)
    row = runner.req_to_token_pool.alloc()
    runner.forward(runner.build_batch([RequestSlice(row, 0, prompt(40, 320, 1))]))
    batch = runner.build_batch([RequestSlice(row, 40, prompt(2, 320, 2))])
    plan = runner.omnikv_plan
    batch.omnikv = OmniKVBatch(plan.roles, plan.source, [0], [row], [40], [8], sink=2, recent=4,
                               weights_for=cfg.alpha_weights, table=runner.req_to_token_pool.req_to_token)
    with pytest.raises(ValueError, match="exactly one token"):
        runner.forward(batch)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "v2_lite_yarn_grouped"])
def test_reused_decode_inputs_carry_the_budgets(hf_checkpoints, name):
    """Decode batches on the native forward's reused inputs (OmniKV rows beside full ones, their budgets
    written as items) give the logits, selections' counts and metrics of batches built the general way."""
    got = {}
    for reused in (True, False):
        runner = runner_for(hf_checkpoints[name], omnikv_cfg("exponential"))
        if not reused:
            runner.native_forward.decode_capacity = 0
        vocab = runner.config.vocab_size
        lens = [90, 130, 75]
        rows = [runner.req_to_token_pool.alloc() for _ in lens]
        for r, n in zip(rows, lens):
            runner.forward(runner.build_batch([RequestSlice(r, 0, prompt(n, vocab, 50 + r))]))
        out = []
        for step in range(5):
            slices = [RequestSlice(r, n + step, prompt(1, vocab, 60 + 7 * step + r), omnikv=(r + step) % 3 != 0)
                      for r, n in zip(rows, lens)]
            batch = runner.build_batch(slices)
            assert batch.omnikv is not None and len(batch.omnikv.rows) == sum(s.omnikv for s in slices)
            last = runner.native_forward._decode_last
            assert (last is not None and last.batch is batch) == reused
            out.append((runner.forward(batch).clone(), batch.omnikv.selected_tokens, batch.omnikv.context_tokens))
        c = runner.omnikv_counters
        got[reused] = (out, (c.sparse_tokens, c.selected_tokens, c.context_tokens))
    (a, ca), (b, cb) = got[True], got[False]
    assert ca == cb and ca[1] < ca[2]  # the selections left something out
    for (la, sa, xa), (lb, sb, xb) in zip(a, b):
        assert torch.equal(la, lb) and (sa, xa) == (sb, xb)
