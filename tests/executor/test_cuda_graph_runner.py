"""The CUDA-graph decode runner.

Without a GPU, the capture mechanism is a stand-in whose replay re-runs the model on the runner's
static buffers (a real graph's Python decisions are frozen at capture too: the stand-in re-runs the
forward with the batch object of the capture, so anything that read per-batch host values would show).
That checks the padding, the buffer updates and that the padded static-buffer forward gives the
eager logits. The `gpu` tests capture real graphs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in its interpreter (set before importing triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import importlib.util
from collections.abc import Callable

import pytest

from kernels.attention.torch_backend import TorchAttentionBackend, _Metadata
from kernels.graph_support import GraphMode, GraphSupport
from models.config import DeepseekConfig
from models.loader.load import load_model
from models.synthetic import write_checkpoint
from executor.cuda_graph_runner import (
    CudaGraphRunner,
    GraphPlan,
    SplitGraph,
    capture_batch_sizes,
    choose_graph_mode,
    graph_off_reason,
    padded_batch_size,
)
from executor.forward_batch import ForwardBatch
from executor.model_runner import ModelRunner, RequestSlice

MODELS = ["tiny-llama", "tiny-deepseek-v3"]
MAX_CONTEXT = 64
_TRITON_ATTENTION = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("kernels.attention.triton_backend") is not None
_CPP = importlib.util.find_spec("cpp_experts") is not None


# ---------------------------------------------------------------- test doubles
def tensor_ptrs(obj: object) -> dict[str, int]:
    """Addresses of the tensors an object holds, also inside its dataclass fields (metadata records)."""
    out: dict[str, int] = {}
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            out[k] = v.data_ptr()
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.update({f"{k}.{f.name}": t.data_ptr() for f in dataclasses.fields(v)
                        if isinstance(t := getattr(v, f.name), torch.Tensor)})
    return out


class RerunGraph:
    """Stand-in for a captured CUDA graph: replay re-runs the recorded function and writes its
    result into the output tensor of the capture, as a real replay rewrites that memory. A real
    graph reads the metadata at the addresses of its capture, so replay first checks that the
    backend's metadata tensors are still those."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor, probe: Callable[[], dict[str, int]]) -> None:
        self.run, self.out, self.probe, self.replays = run, out, probe, 0
        self.captured = probe()

    def replay(self) -> None:
        assert self.probe() == self.captured, "the backend's replay hook moved metadata a graph reads"
        self.out.copy_(self.run())
        self.replays += 1


class RerunCapture:
    def __init__(self, backend: object) -> None:
        self.backend = backend

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[RerunGraph, torch.Tensor]:
        out = run()
        return RerunGraph(run, out, lambda: tensor_ptrs(self.backend)), out


class HookedTorchBackend(TorchAttentionBackend):
    """The torch backend's decode with the CUDA-graph hooks: metadata in buffers allocated once
    ([max_bs, max_context_len], every row masked to its seq_len) and rewritten in place."""

    graph_support = GraphSupport.device_only()

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        self.cg_indices = torch.zeros(max_bs, max_context_len, dtype=torch.int64, device=device)
        self.cg_mask = torch.zeros(max_bs, max_context_len, dtype=torch.bool, device=device)
        self.cg_arange = torch.arange(max_context_len, device=device)

    def _fill(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        idx, mask = self.cg_indices[:bs], self.cg_mask[:bs]
        torch.lt(self.cg_arange[None, :], batch.seq_lens[:, None], out=mask)
        idx.copy_(batch.req_to_token_pool.req_to_token[batch.req_pool_indices])
        idx.masked_fill_(~mask, 0)
        self.meta = _Metadata([], [], [], [], decode_indices=idx, decode_mask=mask)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill(batch)


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return load_model(path, dtype="float32", load_tokenizer=False, progress=False)


def make_runner(loaded, backend=None, max_bs: int = 8, page_size: int = 1) -> tuple[ModelRunner, CudaGraphRunner]:
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8,
                         max_context_len=MAX_CONTEXT, page_size=page_size)
    assert runner.graph_runner is None  # CPU: graphs off
    runner.attn_backend = backend or HookedTorchBackend()
    graphs = CudaGraphRunner(runner, max_bs, RerunCapture(runner.attn_backend))
    graphs.capture()
    return runner, graphs


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(runner: ModelRunner, lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Prefills one request per length (staggered), returns (rows, seq_lens, next tokens)."""
    rows = [runner.req_to_token_pool.alloc() for _ in lens]
    batch = runner.build_batch([RequestSlice(r, 0, prompt(n, seed=n)) for r, n in zip(rows, lens)])
    toks = runner.forward(batch).argmax(-1).tolist()
    return rows, list(lens), toks


def kv_state(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.kv_pool
    bufs = pool.kv_buffer if hasattr(pool, "kv_buffer") else pool.k_buffer + pool.v_buffer
    return [b.clone() for b in bufs]


def poison(graphs: CudaGraphRunner, runner: ModelRunner, rows: list[int], seq_lens: list[int]) -> None:
    """Static rows pointing at real requests and slots: padding that is not rewritten would write there."""
    g = torch.Generator().manual_seed(0)
    n = graphs.max_bs
    table = runner.req_to_token_pool.req_to_token
    real_slots = torch.cat([table[r, :s] for r, s in zip(rows, seq_lens)]).long()
    assert real_slots.numel() >= n
    graphs.req_pool_indices.copy_(torch.tensor(rows * n)[:n])
    graphs.out_cache_loc.copy_(real_slots[:n])
    graphs.positions.copy_(torch.randint(0, 8, (n,), generator=g))
    graphs.input_ids.copy_(torch.randint(3, 4000, (n,), generator=g))
    graphs.seq_lens.fill_(8)


@torch.no_grad()
def eager(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """The model's own forward, never a graph."""
    return runner.model(batch)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (the pool is uninitialised memory: NaNs must compare equal to themselves)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- pure functions
def test_capture_batch_sizes():
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(0) == []


def test_padded_batch_size():
    sizes = capture_batch_sizes(40)
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 17, 33, 40)] == [1, 2, 4, 4, 8, 8, 16, 24, 40, 40]
    assert padded_batch_size(41, sizes) is None
    assert padded_batch_size(1, []) is None


def test_graphs_off_reasons(model):
    runner = ModelRunner(model.model, model.config, max_total_tokens=64, max_running_requests=2, max_context_len=32)
    assert runner.graph_runner is None
    cuda = torch.device("cuda")
    assert "cpu" in graph_off_reason(model.model, HookedTorchBackend(), torch.device("cpu"), 8)
    assert "cuda-graph-max-bs" in graph_off_reason(model.model, HookedTorchBackend(), cuda, 0)
    assert "TorchAttentionBackend" in graph_off_reason(model.model, TorchAttentionBackend(), cuda, 8)
    why = graph_off_reason(model.model, HookedTorchBackend(), cuda, 8)
    if isinstance(model.config, DeepseekConfig):
        assert "TorchExperts" in why  # the torch experts sync with the host
    else:
        assert why is None


# ---------------------------------------------------------------- stand-in graph, hooked torch backend
# The cpp experts round their activations to bf16. A replay runs the padded batch (4 rows where eager
# runs 3), and torch's fp32 matmul may sum in another order at another M (it does on AVX2 hosts), so
# an fp32 ulp before an expert layer can flip one bf16 rounding: ~1e-4 on the logits, not 1e-5.
CPP_EXPERTS_TOL = 1e-3


def check_replays(runner: ModelRunner, graphs: CudaGraphRunner, lens: list[int], steps: list[list[int]],
                  tol: float) -> None:
    """Prefills requests of `lens`, then decodes the requests picked at each step both eagerly and by
    replay, with the static buffers poisoned before each replay: same logits, padding rows are the
    dummy request, only the batch's own KV slots (and the dummy page) change, buffers stay in place."""
    rows, seq_lens, toks = prefill(runner, lens)
    static_ptrs = tensor_ptrs(graphs)
    out_ptrs = {bs: o.data_ptr() for bs, o in graphs.outputs.items()}
    for picked in steps:
        batch = runner.build_batch([RequestSlice(rows[i], seq_lens[i], [toks[i]]) for i in picked])
        assert graphs.can_run(batch)
        want = eager(runner, batch)  # writes the batch's KV; the replay rewrites the same slots
        before = kv_state(runner)
        poison(graphs, runner, rows, seq_lens)
        got = graphs.replay(batch)
        bs, padded = len(picked), padded_batch_size(len(picked), graphs.batch_sizes)
        assert got.shape == want.shape and got.data_ptr() == out_ptrs[padded]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert graphs.req_pool_indices[bs:padded].eq(0).all() and graphs.out_cache_loc[bs:padded].eq(0).all()
        assert graphs.seq_lens[bs:padded].eq(1).all() and graphs.positions[bs:padded].eq(0).all()
        touched = torch.zeros(before[0].shape[0], dtype=torch.bool)
        touched[batch.out_cache_loc] = True
        touched[: runner.allocator.page_size] = True
        for old, new in zip(before, kv_state(runner)):
            assert same_bits(old[~touched], new[~touched])
            torch.testing.assert_close(new[batch.out_cache_loc], old[batch.out_cache_loc], rtol=tol, atol=tol)
        assert tensor_ptrs(graphs) == static_ptrs
        for i, t in zip(picked, want.argmax(-1).tolist()):
            seq_lens[i] += 1
            toks[i] = t
    assert sum(g.replays for g in graphs.graphs.values()) == len(steps)


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_matches_eager_and_padding_stays_in_dummy_page(model, page_size):
    runner, graphs = make_runner(model, page_size=page_size)
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    # the replay hook rewrote the very buffers each graph captured (RerunGraph checks it on replay)
    assert all({"meta.decode_indices", "meta.decode_mask"} <= set(g.captured) for g in graphs.graphs.values())
    check_replays(runner, graphs, [3, 9, 14, 6, 11],
                  [[2], [0, 3, 4], [0, 1, 2, 3, 4], [1, 4, 2], [4], [3, 0, 1, 2, 4]], tol=1e-5)


def test_stand_in_notices_moved_metadata(model):
    """The pointer check is live: a replay hook that allocates fresh metadata is caught."""
    runner, graphs = make_runner(model)
    rows, seq_lens, toks = prefill(runner, [4, 6])
    batch = runner.build_batch([RequestSlice(r, n, [t]) for r, n, t in zip(rows, seq_lens, toks)])
    backend = runner.attn_backend
    backend.init_forward_metadata_replay_cuda_graph = backend.init_forward_metadata  # allocates
    with pytest.raises(AssertionError, match="moved metadata"):
        graphs.replay(batch)


def test_model_runner_forward_dispatch(model):
    """runner.forward replays for decode batches within the captured sizes, else runs eagerly."""
    runner, graphs = make_runner(model, max_bs=4)
    runner.graph_runner = graphs
    rows, seq_lens, toks = prefill(runner, [4, 7, 5, 8, 6])  # an EXTEND batch: eager
    assert sum(g.replays for g in graphs.graphs.values()) == 0

    def decode(picked: list[int]) -> torch.Tensor:
        batch = runner.build_batch([RequestSlice(rows[i], seq_lens[i], [toks[i]]) for i in picked])
        out = runner.forward(batch)
        for i, t in zip(picked, out.argmax(-1).tolist()):
            seq_lens[i] += 1
            toks[i] = t
        return out

    decode([0, 1, 2])
    assert graphs.graphs[4].replays == 1
    decode([0, 1, 2, 3, 4])  # above max_bs: eager
    assert graphs.graphs[4].replays == 1
    scoring = runner.build_batch([RequestSlice(rows[0], seq_lens[0], [toks[0]])], all_logits=True)
    assert not graphs.can_run(scoring)  # prompt scoring asks for logits indices
    mixed = runner.build_batch([RequestSlice(rows[1], seq_lens[1], [toks[1]]),
                                RequestSlice(runner.req_to_token_pool.alloc(), 0, [5, 6])])
    assert not graphs.can_run(mixed)


def greedy_staggered(runner: ModelRunner, lens: list[int], max_new: list[int]) -> list[list[int]]:
    """Greedy continuations of requests prefilled together and finishing at different steps, so the
    decode batch shrinks (and runs at several padded sizes)."""
    rows, seq_lens, toks = prefill(runner, lens)
    out = [[t] for t in toks]
    while live := [i for i in range(len(lens)) if len(out[i]) < max_new[i]]:
        batch = runner.build_batch([RequestSlice(rows[i], seq_lens[i], [toks[i]]) for i in live])
        for i, t in zip(live, runner.forward(batch).argmax(-1).tolist()):
            seq_lens[i] += 1
            toks[i] = t
            out[i].append(t)
    for r, n in zip(rows, seq_lens):
        runner.free_request(r, n)
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_with_graphs_equals_eager(model, page_size):
    lens, max_new = [5, 12, 3, 9, 7, 4], [6, 3, 8, 5, 2, 7]
    eager_runner = ModelRunner(model.model, model.config, max_total_tokens=512, max_running_requests=8,
                               max_context_len=MAX_CONTEXT, page_size=page_size)
    runner, graphs = make_runner(model, page_size=page_size)
    runner.graph_runner = graphs
    assert greedy_staggered(runner, lens, max_new) == greedy_staggered(eager_runner, lens, max_new)
    assert {bs for bs, g in graphs.graphs.items() if g.replays} == {8, 4, 2, 1}
    assert runner.allocator.available_size() == 512


# ---------------------------------------------------------------- the triton backends


@pytest.mark.skipif(not _TRITON_ATTENTION, reason="needs triton and kernels/attention/triton_backend.py")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in graph runs the kernels interpreted on CPU "
                    "tensors; on a GPU host test_cuda_graph_greedy_equals_eager captures real graphs")
def test_triton_backend_with_stand_in_graph(model):
    """The triton attention backend's graph hooks (kernels interpreted on CPU, so few steps): replays
    of padded batches of staggered requests give the eager logits, and the metadata each graph
    captured is rewritten in place. Llama runs paged (page 4: the page table is regathered in place),
    DeepSeek with page size 1 and the triton experts."""
    from kernels.attention import create_attention_backend

    page_size = 1
    if isinstance(model.config, DeepseekConfig):
        model = load_model(model.source, dtype="float32", expert_backend="triton", load_tokenizer=False,
                           progress=False)
        assert graph_off_reason(model.model, create_attention_backend("triton"), torch.device("cuda"), 8) is None
    else:
        page_size = 4
    runner, graphs = make_runner(model, backend=create_attention_backend("triton"), max_bs=4, page_size=page_size)
    assert all(any("." in k for k in g.captured) for g in graphs.graphs.values())  # metadata records were probed
    check_replays(runner, graphs, [3, 10, 6], [[0, 2, 1], [2, 0]], tol=1e-4)


# ---------------------------------------------------------------- OmniKV decodes through graphs
@pytest.mark.skipif(not _TRITON_ATTENTION, reason="needs triton and kernels/attention/triton_backend.py")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in graph runs the kernels interpreted on CPU "
                    "tensors; on a GPU host bench/omnikv_gpu.py checks graphed OmniKV decodes against eager ones")
# (GQA with the bank, MLA without it; MLA's Triton bank: test_context_bank. Every case runs every kernel
# under Triton's interpreter, ~1 min each)
@pytest.mark.parametrize("preset, window, alpha, bank", [("tiny-llama", 3, "exponential", True),
                                                         ("tiny-deepseek-v2", 1, "last_token", False)])
def test_omnikv_decodes_replay_their_own_graphs(tmp_path, preset, window, alpha, bank):
    """Decode batches with OmniKV rows replay graphs captured per (padded size, context bucket, mixed):
    the same logits, metrics and query history as the eager OmniKV forward, whether every row is an
    OmniKV row or some attend fully, and the graph's forward reads no per-step host value (its
    OmniKVBatch has none: a stand-in replay that reached for one would fail). With the context bank
    the graphs gather the sparse layers' rows in the replay too. A new OmniKV config drops the graphs."""
    from kernels.attention import create_attention_backend
    from models.omnikv_config import OmniKVConfig

    from executor.cuda_graph_runner import omnikv_width

    loaded = load_model(write_checkpoint(tmp_path / preset, preset, seed=6, num_layers=6), dtype="float32",
                        load_tokenizer=False, progress=False)
    cfg = OmniKVConfig(filter_layers=(1, 3), budget_tokens=6, sink_tokens=2, recent_tokens=3, window=window,
                       alpha=alpha)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=8,
                         max_context_len=128, omnikv=cfg, omnikv_bank=bank, native_forward=False)
    assert 2 in runner.omnikv_plan.roles  # some layers read a selection
    runner.attn_backend = create_attention_backend("triton")
    graphs = CudaGraphRunner(runner, 4, CaptureRunCapture(runner.attn_backend))
    graphs.capture()
    runner.graph_runner = graphs
    lens = [21, 40, 30]
    rows, seq_lens, toks = prefill(runner, lens)
    history = runner.query_history
    steps = [([0, 1, 2], {0, 1, 2}), ([2, 0], {0, 2}), ([0, 1, 2], {1}), ([1], {1}), ([0, 1, 2], {0, 1, 2})]
    for picked, sparse_rows in steps:  # (rows decoding, those with OmniKV)
        batch = runner.build_batch([RequestSlice(rows[i], seq_lens[i], [toks[i]], omnikv=i in sparse_rows)
                                    for i in picked])
        assert batch.omnikv is not None and batch.omnikv.covers(len(picked)) == (len(sparse_rows) == len(picked))
        assert graphs.can_run(batch)
        want = eager(runner, batch)
        selected, context = batch.omnikv.selected_tokens, batch.omnikv.context_tokens
        assert selected > 0 and context > selected
        batch.omnikv.selected_tokens = batch.omnikv.context_tokens = 0
        hist_before = (history.q.clone(), history.pos.clone()) if history is not None else None
        poison(graphs, runner, rows, seq_lens)
        got = graphs.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert (batch.omnikv.selected_tokens, batch.omnikv.context_tokens) == (selected, context)
        if history is not None:  # the replay recorded what the eager forward had (row 0: the dummy's); q to
            # rounding: the padded batch's projections may sum in another order
            assert torch.equal(history.pos[1:], hist_before[1][1:])
            torch.testing.assert_close(history.q[1:], hist_before[0][1:], rtol=1e-4, atol=1e-5)
        for i, t in zip(picked, want.argmax(-1).tolist()):
            seq_lens[i] += 1
            toks[i] = t
    # padded sizes 4, 2, 4, 1, 4; longest contexts 41, 32, 43, 43, 45: buckets 64, 32, 64, 64, 64
    assert sorted(graphs.omnikv_graphs) == [(1, 64, False), (2, 32, False), (4, 64, False), (4, 64, True)]
    assert omnikv_width(41, 128) == 64 and omnikv_width(65, 128) == 128 and omnikv_width(300, 128) == 128
    assert sum(g.replays for g in graphs.omnikv_graphs.values()) == len(steps)
    assert not any(g.replays for g in graphs.graphs.values())
    if bank:
        assert all(graphs.omnikv_batches[key].banked for key in graphs.omnikv_graphs)  # the replays' gathers
    runner.set_omnikv(dataclasses.replace(cfg, budget_tokens=9))
    assert graphs.omnikv_graphs == {} and graphs.omnikv_outputs == {}


class CaptureRunCapture(RerunCapture):
    """The stand-in, closer to a real capture: the forward runs as `CudaGraphCapture` runs it (a
    warm-up run, then the capture run) without the metadata being made again in between, and a replay
    re-runs it with the backend's per-forward state (views and tables it keeps in Python between
    layers) as the capture run left it, since a real graph replays the kernels of that run, reading
    the tensors that run read. A backend that carried a view over from a warm-up run into the capture
    would replay a stale table here too.

    A real graph also keeps no Python object alive: tensors made before its capture that it reads
    (the OmniKV batch's alpha table) live only as long as their owner. The captured batch's OmniKV
    state is therefore reached through a weak reference here, so a replay fails if the runner did not
    keep it with the graph.

    One warm-up run, not `CudaGraphCapture.warmup_runs`: state a warm-up leaves for the capture is
    left by the first, and each interpreted forward costs seconds here (a GPU's second warm-up is for
    lazy initialisation, which the stand-in does not have)."""

    warmup_runs = 1

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[RerunGraph, torch.Tensor]:
        import weakref

        for _ in range(self.warmup_runs):
            run()
        out = run()
        state = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self.backend).items()}
        batch = (run.__defaults__ or (None,))[0]  # the runner's `lambda b=batch: ...`
        if batch is not None and batch.omnikv is not None:
            batch.omnikv = weakref.proxy(batch.omnikv)

        def replayed() -> torch.Tensor:
            vars(self.backend).update({k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()})
            return run()

        return RerunGraph(replayed, out, lambda: tensor_ptrs(self.backend)), out


# ---------------------------------------------------------------- hybrid placement: CPU experts as host nodes


class HostNodeCapture(RerunCapture):
    """The stand-in, with the forward run as under stream capture: the CPU experts take their graph
    path (graph staging, host tasks bound at capture), and their queued host work runs at once on
    the CPU, in the order a stream would run it. Replays re-run it, so they reuse the bound tasks."""

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[RerunGraph, torch.Tensor]:
        import models.experts.cpp

        def captured() -> torch.Tensor:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(models.experts.cpp, "stream_capturing", lambda device: True)
                return run()

        out = captured()
        return RerunGraph(captured, out, lambda: tensor_ptrs(self.backend)), out


@pytest.mark.skipif(not _CPP, reason="needs the cpp_experts extension")
def test_cpu_experts_as_host_tasks_with_stand_in_graph(tmp_path):
    """Hybrid placement's graph path: staging reserved before capture, one host task per layer and
    padded size bound at capture and reused by every replay, replays equal to eager decode, and a
    failure in the host work raised by the replay of its own batch (the next one runs again)."""
    from models.experts.host_calls import HostNodeCalls
    from models.moe import SparseMoE

    path = write_checkpoint(tmp_path, "tiny-deepseek-v3", seed=5)
    loaded = load_model(path, dtype="float32", expert_backend="cpp", load_tokenizer=False, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8,
                         max_context_len=MAX_CONTEXT)
    runner.attn_backend = HookedTorchBackend()
    graphs = CudaGraphRunner(runner, 4, HostNodeCapture(runner.attn_backend), GraphMode.HOST_NODES)
    graphs.capture()
    moe_layers = sum(isinstance(m, SparseMoE) for m in loaded.model.modules())
    assert len(graphs.host_work) == moe_layers and all(isinstance(w, HostNodeCalls) for w in graphs.host_work)
    bound = [dict(w.tasks) for w in graphs.host_work]
    assert all(sorted(k[0] for k in b) == [1, 2, 4] for b in bound)
    check_replays(runner, graphs, [3, 9, 6], [[0, 2, 1], [2], [1, 0]], tol=CPP_EXPERTS_TOL)
    assert [dict(w.tasks) for w in graphs.host_work] == bound  # no task bound after capture
    assert sum(t.runs for b in bound for t in b.values()) > 0

    rows, seq_lens, toks = prefill(runner, [4, 5])
    batch = runner.build_batch([RequestSlice(r, n, [t]) for r, n, t in zip(rows, seq_lens, toks)])
    moe = next(m for m in loaded.model.modules() if isinstance(m, SparseMoE))
    route = moe.gate.forward
    moe.gate.forward = lambda x, fused=False: (lambda w, i: (w * float("nan"), i))(*route(x, fused))
    with pytest.raises(RuntimeError, match="failed during a decode graph replay: .*not finite"):
        graphs.replay(batch)
    moe.gate.forward = route
    torch.testing.assert_close(graphs.replay(batch), eager(runner, batch), rtol=1e-5, atol=1e-5)


class SplitStandIn(RerunCapture):
    """The stand-in for a split capture: the forward runs as under capture, and each `host_step`
    runs its step at once where a real split capture would end one graph piece and begin the next;
    replays re-run it. Counts the steps of each run."""

    def __init__(self, backend: object) -> None:
        super().__init__(backend)
        self.steps_per_run: list[int] = []
        self._count = 0

    def host_step(self, fn: Callable[[], None]) -> None:
        self._count += 1
        fn()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[RerunGraph, torch.Tensor]:
        import models.experts.cpp

        def split_run() -> torch.Tensor:
            self._count = 0
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(models.experts.cpp, "stream_capturing", lambda device: True)
                out = run()
            self.steps_per_run.append(self._count)
            return out

        out = split_run()
        return RerunGraph(split_run, out, lambda: tensor_ptrs(self.backend)), out


@pytest.mark.skipif(not _CPP, reason="needs the cpp_experts extension")
def test_cpu_experts_split_around_with_stand_in_graph(tmp_path):
    """`--hybrid-graph-mode split`: graphs are allowed without host functions, each MoE layer hands
    over two host steps (submit, then sync) instead of binding host tasks, and replays equal eager
    decode. The pieces themselves need CUDA (the gpu test below)."""
    from models.experts.host_calls import SplitCalls
    from models.moe import SparseMoE

    path = write_checkpoint(tmp_path, "tiny-deepseek-v3", seed=5)
    loaded = load_model(path, dtype="float32", expert_backend="cpp", load_tokenizer=False, progress=False)
    cuda = torch.device("cuda")
    hooked = HookedTorchBackend()
    if not torch.cuda.is_available():  # no driver here: host nodes are impossible, a split capture is not
        assert "cuLaunchHostFunc" in graph_off_reason(loaded.model, hooked, cuda, 4)
    assert graph_off_reason(loaded.model, hooked, cuda, 4, hybrid_mode="split") is None
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=8,
                         max_context_len=MAX_CONTEXT)
    runner.attn_backend = hooked
    capture = SplitStandIn(hooked)
    with pytest.raises(ValueError, match="host_step"):
        CudaGraphRunner(runner, 4, RerunCapture(hooked), GraphMode.SPLIT)
    graphs = CudaGraphRunner(runner, 4, capture, GraphMode.SPLIT)
    graphs.capture()
    moe_layers = sum(isinstance(m, SparseMoE) for m in loaded.model.modules())
    assert len(graphs.host_work) == moe_layers and all(isinstance(w, SplitCalls) for w in graphs.host_work)
    assert moe_layers and capture.steps_per_run == [2 * moe_layers] * 3
    check_replays(runner, graphs, [3, 9, 6], [[0, 2, 1], [2], [1, 0]], tol=CPP_EXPERTS_TOL)
    assert capture.steps_per_run == [2 * moe_layers] * 6
    assert all(w.replay_error() is None for w in graphs.host_work)  # host steps raise at once instead


# ---------------------------------------------------------------- choosing how decode is captured
def test_choose_graph_mode_reads_only_the_descriptions():
    device, none = GraphSupport.device_only(), GraphSupport.none("it syncs")
    both, split_only = GraphSupport.host_work(), GraphSupport.host_work("no cuLaunchHostFunc")
    for hybrid in (GraphMode.HOST_NODES, GraphMode.SPLIT):
        assert choose_graph_mode([("a", device), ("b", device)], hybrid) == GraphPlan(GraphMode.CAPTURE)
        assert choose_graph_mode([("a", device), ("b", both), ("c", both)], hybrid) == GraphPlan(hybrid)
        off = GraphPlan(None, "a cannot be captured: it syncs")
        assert choose_graph_mode([("a", none), ("b", both)], hybrid) == off
        assert choose_graph_mode([], hybrid) == GraphPlan(GraphMode.CAPTURE)
    assert choose_graph_mode([("a", device), ("b", split_only)], GraphMode.SPLIT) == GraphPlan(GraphMode.SPLIT)
    assert choose_graph_mode([("a", device), ("b", split_only)], GraphMode.HOST_NODES) == \
        GraphPlan(None, "b cannot be captured: no cuLaunchHostFunc")
    assert both.modes == {GraphMode.HOST_NODES, GraphMode.SPLIT} and not both.allows(GraphMode.CAPTURE)
    assert split_only.modes == {GraphMode.SPLIT} and none.modes == frozenset()
    with pytest.raises(ValueError, match="hybrid graph mode"):
        graph_off_reason(torch.nn.Linear(1, 1), HookedTorchBackend(), torch.device("cuda"), 8, hybrid_mode="sometimes")


def test_each_backend_describes_its_graph_support(tmp_path, monkeypatch):
    """Attention torch/triton and experts torch/triton/cpp, the cpp ones with and without host
    functions (the driver's cuLaunchHostFunc), as the graph runner reads them."""
    from models.experts import CppExperts, TorchExperts

    torch_attn = TorchAttentionBackend().graph_support
    assert torch_attn.modes == frozenset() and torch_attn.reason
    assert TorchExperts(2, 8, 4).graph_support == GraphSupport.none("it synchronizes with the host")
    if _TRITON_ATTENTION:
        from kernels.attention import create_attention_backend
        from models.experts import TritonExperts

        assert create_attention_backend("triton").graph_support == GraphSupport.device_only()
        assert TritonExperts(2, 8, 4).graph_support == GraphSupport.device_only()
    if not _CPP:
        return
    import cpp_experts

    cpp = CppExperts(2, 64, 32, top_k=1)
    monkeypatch.setattr(cpp_experts, "cuda_host_launch_error", lambda: None)
    assert cpp.graph_support == GraphSupport.host_work()
    monkeypatch.setattr(cpp_experts, "cuda_host_launch_error", lambda: "the CUDA driver has no cuLaunchHostFunc")
    support = cpp.graph_support
    assert support.modes == {GraphMode.SPLIT} and "cuLaunchHostFunc" in support.reason
    assert "--hybrid-graph-mode split" in support.reason


@pytest.mark.skipif(not _CPP, reason="needs the cpp_experts extension")
@pytest.mark.parametrize("experts, hybrid, host_funcs, want", [
    ("cpp", "host-nodes", True, "host-nodes"),
    ("cpp", "split", True, "split"),
    ("cpp", "split", False, "split"),
    ("cpp", "host-nodes", False, None),  # no host functions: eager, and the log says to use split
    ("torch", "host-nodes", True, None),
])
def test_capture_if_supported_picks_the_strategy(tmp_path, monkeypatch, caplog, experts, hybrid, host_funcs, want):
    """`ModelRunner` -> `capture_if_supported` picks the capture from the parts' GraphSupport (the
    device check aside, faked to cuda): host nodes (the experts' HostNodeCalls bound per size),
    split pieces (SplitCalls, steps handed to the capture), or eager with the reason logged; greedy
    decode is the same either way."""
    import contextlib
    import logging

    import cpp_experts
    import executor.cuda_graph_runner as cgr
    from models.experts.host_calls import HostNodeCalls, SplitCalls

    path = write_checkpoint(tmp_path, "tiny-deepseek-v3", seed=5)
    loaded = load_model(path, dtype="float32", expert_backend=experts, load_tokenizer=False, progress=False)
    hooked = HookedTorchBackend()
    real_plan = cgr.plan_decode_graphs
    monkeypatch.setattr(cgr, "plan_decode_graphs", lambda model, backend, device, max_bs, mode:
                        real_plan(model, backend, torch.device("cuda"), max_bs, mode))
    monkeypatch.setattr(cpp_experts, "cuda_host_launch_error", lambda: None if host_funcs else "no cuLaunchHostFunc")
    monkeypatch.setattr("executor.model_runner.create_attention_backend", lambda name: hooked)
    monkeypatch.setattr(cgr, "CudaGraphCapture", lambda device: HostNodeCapture(hooked))
    monkeypatch.setattr(cgr, "SplitCudaGraphCapture", lambda device: SplitStandIn(hooked))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    kw = dict(max_total_tokens=512, max_running_requests=4, max_context_len=MAX_CONTEXT)
    with caplog.at_level(logging.INFO, logger="mlaserve.cuda_graph"):
        runner = ModelRunner(loaded.model, loaded.config, hybrid_graph_mode=hybrid, **kw)
    graphs = runner.graph_runner
    if want is None:
        assert graphs is None
        [off] = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
        assert ("cuLaunchHostFunc" in off and "split" in off) if experts == "cpp" else "TorchExperts" in off
        return
    kind = {"host-nodes": HostNodeCalls, "split": SplitCalls}[want]
    assert graphs.mode is GraphMode(want) and sorted(graphs.graphs) == [1, 2, 4]
    assert graphs.host_work and all(type(w) is kind for w in graphs.host_work)
    assert isinstance(graphs._capture, SplitStandIn) == (want == "split")
    eager_runner = ModelRunner(loaded.model, loaded.config, disable_cuda_graph=True, **kw)
    lens, max_new = [5, 9, 3], [4, 3, 5]
    assert greedy_staggered(runner, lens, max_new) == greedy_staggered(eager_runner, lens, max_new)
    assert sum(g.replays for g in graphs.graphs.values()) > 0
    runner.close()
    eager_runner.close()


def test_failed_capture_falls_back_to_eager_and_says_so(model, monkeypatch, caplog):
    """A capture the driver refuses must not stop the server: the error is logged with its traceback
    and decode runs eagerly. (The CUDA calls around the capture are stubbed: no GPU here.)"""
    import contextlib
    import logging

    import executor.cuda_graph_runner as cgr

    class Refused:
        def __init__(self, device: torch.device) -> None:
            pass

        def __call__(self, run: Callable[[], torch.Tensor]):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cgr, "plan_decode_graphs", lambda *a, **k: GraphPlan(GraphMode.CAPTURE))
    monkeypatch.setattr("executor.model_runner.create_attention_backend", lambda name: HookedTorchBackend())
    monkeypatch.setattr(cgr, "CudaGraphCapture", Refused)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    with caplog.at_level(logging.ERROR, logger="mlaserve.cuda_graph"):
        runner = ModelRunner(model.model, model.config, max_total_tokens=64, max_running_requests=2,
                             max_context_len=32)
    assert runner.graph_runner is None
    [record] = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert record.exc_info and "not permitted" in str(record.exc_info[1])
    row = runner.req_to_token_pool.alloc()
    assert runner.forward(runner.build_batch([RequestSlice(row, 0, [5, 6, 7])])).shape[0] == 1


def test_split_graph_replays_pieces_and_steps_in_order():
    log: list[str] = []

    class Piece:
        def __init__(self, name: str) -> None:
            self.name = name

        def replay(self) -> None:
            log.append(self.name)

    graph = SplitGraph([Piece("a"), Piece("b"), Piece("c")], [lambda: log.append("1"), lambda: log.append("2")])
    graph.replay()
    graph.replay()
    assert log == ["a", "1", "b", "2", "c"] * 2
    with pytest.raises(AssertionError):
        SplitGraph([Piece("a")], [lambda: None])


# ---------------------------------------------------------------- real CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, experts, mode", [
    ("tiny-llama", "triton", "host-nodes"), ("tiny-deepseek-v3", "triton", "host-nodes"),
    *(pytest.param("tiny-deepseek-v3", "cpp", mode, marks=pytest.mark.skipif(not _CPP, reason="needs cpp_experts"))
      for mode in ("host-nodes", "split"))])
def test_cuda_graph_greedy_equals_eager(tmp_path, name, experts, mode):
    """Real graphs against eager decode, token for token; with `cpp` the routed experts run on the
    CPU (hybrid placement), as host nodes of the graph or between split graph pieces."""
    path = write_checkpoint(tmp_path, name, seed=3)
    loaded = load_model(path, device="cuda", dtype="float32", expert_backend=experts, load_tokenizer=False,
                        progress=False)
    kw = dict(max_total_tokens=1024, max_running_requests=16, max_context_len=128, device="cuda",
              attention_backend="triton")
    graphed = ModelRunner(loaded.model, loaded.config, cuda_graph_max_bs=8, hybrid_graph_mode=mode, **kw)
    eager = ModelRunner(loaded.model, loaded.config, disable_cuda_graph=True, **kw)
    assert graphed.graph_runner is not None and eager.graph_runner is None
    graphs = graphed.graph_runner
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    replayed: list[int] = []
    replay = graphs.replay
    graphs.replay = lambda batch: (replayed.append(batch.batch_size), replay(batch))[1]
    lens, max_new = [5, 40, 3, 17, 9, 26, 11, 4, 30, 8], [12, 3, 16, 7, 10, 5, 14, 9, 6, 11]
    assert greedy_staggered(graphed, lens, max_new) == greedy_staggered(eager, lens, max_new)
    assert {padded_batch_size(b, graphs.batch_sizes) for b in replayed} == {1, 2, 4, 8}  # 10 and 9 ran eagerly
    if experts == "cpp" and mode == "host-nodes":
        assert graphs.host_work and all(w.replay_error() is None for w in graphs.host_work)
    if experts == "cpp" and mode == "split":
        assert all(isinstance(g, SplitGraph) and len(g.pieces) > 1 for g in graphs.graphs.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, window, alpha, bank", [("tiny-deepseek-v2", 1, "last_token", False),
                                                       ("tiny-llama", 3, "exponential", False),
                                                       ("tiny-deepseek-v2", 1, "last_token", True)])
def test_omnikv_cuda_graphs_equal_eager_omnikv(tmp_path, name, window, alpha, bank):
    """Real graphs of OmniKV decodes against the eager OmniKV forward: the same logits at every step, while
    contexts cross a bucket (64 -> 128), batch sizes change and some batches mix OmniKV and
    full-attention rows; the graphs were captured per (size, bucket, mixed) and replayed. `bank`: the
    graphed runner keeps its sparse layers in pinned host memory (the context bank, its gathers on a
    side stream inside the graphs); the eager one keeps every layer on the device."""
    from models.omnikv_config import OmniKVConfig

    path = write_checkpoint(tmp_path, name, seed=4, num_layers=6)
    loaded = load_model(path, device="cuda", dtype="float32", expert_backend="triton", load_tokenizer=False,
                        progress=False)
    cfg = OmniKVConfig(filter_layers=(1, 3), budget_tokens=6, sink_tokens=2, recent_tokens=3, window=window, alpha=alpha)
    kw = dict(max_total_tokens=2048, max_running_requests=8, max_context_len=256, device="cuda",
              attention_backend="triton", omnikv=cfg)
    graphed = ModelRunner(loaded.model, loaded.config, cuda_graph_max_bs=4, omnikv_bank=bank, **kw)
    assert bool(graphed.kv_pool.host_layers) == bank
    eager_runner = ModelRunner(loaded.model, loaded.config, disable_cuda_graph=True, **kw)
    graphs = graphed.graph_runner
    assert graphs is not None and eager_runner.graph_runner is None
    lens = [50, 61, 40]
    state = {}
    for r in (graphed, eager_runner):
        rows, seq_lens, toks = prefill(r, lens)
        state[id(r)] = (rows, seq_lens, toks)
    for step, picked in enumerate(([0, 1, 2], [1, 2], [0], [0, 1, 2]) * 5):
        sparse_rows = set(picked) if step % 3 else set(picked[:1])  # every third batch mixed (or all sparse)
        logits = []
        for r in (graphed, eager_runner):
            rows, seq_lens, toks = state[id(r)]
            batch = r.build_batch([RequestSlice(rows[i], seq_lens[i], [toks[i]], omnikv=i in sparse_rows)
                                   for i in picked])
            assert batch.omnikv is not None and (r is eager_runner or graphs.can_run(batch))
            out = r.forward(batch)
            logits.append(out.clone())
            for i, t in zip(picked, out.argmax(-1).tolist()):
                seq_lens[i] += 1
                toks[i] = t
        where = f"step {step}: rows {picked}, OmniKV rows {sorted(sparse_rows)}, graphs {sorted(graphs.omnikv_graphs)}"
        torch.testing.assert_close(logits[0], logits[1], rtol=2e-4, atol=2e-4, msg=lambda m: f"{where}: {m}")
        assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist(), where
    assert {key[1] for key in graphs.omnikv_graphs} == {64, 128} and graphs.omnikv_off_reason is None
    assert {key[2] for key in graphs.omnikv_graphs} == {False, True}
    assert graphed.omnikv_counters == eager_runner.omnikv_counters
