"""Tensor and expert parallelism of the models (models.parallel) on gloo, with 2 and 4 processes on this
machine: every rank reads only its part of the checkpoint, and the logits of a prefill and of greedy
decode steps equal one process's (fp32, within 1e-4), for Llama (GQA, also with fewer KV heads than
ranks) and DeepSeek-V2/V3 (MLA, MoE with experts split by intermediate size or partitioned with --ep).
The one-process oracle is the model the HF-parity tests check against transformers."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from models.synthetic import write_checkpoint

PROMPT = [11, 523, 87, 3001, 42, 977, 15, 6, 1200, 305, 77]
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(model_dir: str, omnikv: dict | None = None, backend: str = "torch",
            steps: int = STEPS) -> tuple[list[torch.Tensor], int]:
    """Logits of a prefill then `steps` greedy decodes (two requests, the second a shorter prompt, batched
    with the first's decodes), and the bytes of parameters this process holds. With `omnikv` (an
    OmniKVConfig's fields) both requests ask for OmniKV: the first's context is long enough for its
    selection to leave tokens out, the second's is not (it attends fully beside it)."""
    from executor.model_runner import ModelRunner, RequestSlice
    from models.loader.load import load_model
    from models.omnikv_config import OmniKVConfig

    loaded = load_model(model_dir, dtype="float32", expert_backend="torch", load_tokenizer=False, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=128, max_running_requests=2,
                         max_context_len=64, attention_backend=backend,
                         omnikv=None if omnikv is None else OmniKVConfig(**omnikv))
    sparse = omnikv is not None
    out = []
    a, b = runner.req_to_token_pool.alloc(), runner.req_to_token_pool.alloc()
    logits = runner.forward(runner.build_batch([RequestSlice(a, 0, PROMPT, omnikv=sparse)]))
    out.append(logits)
    tok_a, pos_a = int(logits[-1].argmax()), len(PROMPT)
    logits = runner.forward(runner.build_batch([RequestSlice(b, 0, PROMPT[:5], omnikv=sparse),
                                                RequestSlice(a, pos_a, [tok_a], omnikv=sparse)]))
    out.append(logits)
    pos_a += 1
    tok_a, tok_b, pos_b = int(logits[1].argmax()), int(logits[0].argmax()), 5
    for _ in range(steps):
        logits = runner.forward(runner.build_batch([RequestSlice(a, pos_a, [tok_a], omnikv=sparse),
                                                    RequestSlice(b, pos_b, [tok_b], omnikv=sparse)]))
        out.append(logits)
        tok_a, tok_b = int(logits[0].argmax()), int(logits[1].argmax())
        pos_a, pos_b = pos_a + 1, pos_b + 1
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if sparse:
        c = runner.omnikv_counters  # the first request's selections left tokens out
        assert c.sparse_tokens > 0 and c.selected_tokens < c.context_tokens
    runner.close()
    return out, held


def _rank(rank: int, world: int, port: int, model_dir: str, ep: bool, dp_attention: bool, results: mp.Queue,
          omnikv: dict | None = None, backend: str = "torch") -> None:
    import torch.distributed as dist

    from models.parallel import ParallelLayout, configure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    configure(ParallelLayout(tp_size=world, tp_rank=rank, ep=ep, dp_attention=dp_attention))
    try:
        if dp_attention:
            logits, held = _dp_requests(model_dir, DP_PROMPTS[rank], IDLE[1] if rank == IDLE[0] else None)
        else:
            logits, held = _greedy(model_dir, omnikv, backend, steps=2 * STEPS if omnikv else STEPS)
        results.put((rank, [t.tolist() for t in logits], held, None))
    except Exception as exc:  # reported to the test, not lost in a child
        results.put((rank, None, 0, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(model_dir: Path, world: int, ep: bool = False, dp_attention: bool = False,
                omnikv: dict | None = None, backend: str = "torch") -> list[tuple[list[torch.Tensor], int]]:
    """Each rank's (logits, parameter bytes held), ranks as processes on gloo. They are forked from a
    forkserver that has imported torch and this module once (single-threaded, as spawn's children start),
    not spawned: each spawned rank imported torch again, seconds of a 2-core machine per rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(model_dir), ep, dp_attention, results, omnikv,
                                             backend)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, logits, held, err = results.get(timeout=300)
            assert err is None, f"rank {rank}: {err}"
            got[rank] = ([torch.tensor(t) for t in logits], held)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def run_parallel(model_dir: Path, world: int, ep: bool = False, omnikv: dict | None = None,
                 backend: str = "torch") -> tuple[list[torch.Tensor], list[int]]:
    ranks = spawn_ranks(model_dir, world, ep, omnikv=omnikv, backend=backend)
    for r in range(1, world):  # every rank ends with the same whole logits
        assert all(torch.equal(a, b) for a, b in zip(ranks[r][0], ranks[0][0]))
    return ranks[0][0], [h for _, h in ranks]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {name: write_checkpoint(root / name, name, seed=31) for name in
           ("tiny-llama", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-glm4-moe",
            "tiny-glm4-moe-lite")}
    for name in ("tiny-llama", "tiny-deepseek-v2"):  # 4 layers, for OmniKV: a filter layer, then sparse layers
        out[f"{name}-4"] = write_checkpoint(root / f"{name}-4", name, seed=33, num_layers=4)
    for name in ("tiny-llama", "tiny-deepseek-v2"):  # GGUF (Q8_0 blocks: read per rank, then decoded)
        out[f"{name}.gguf"] = write_checkpoint(root / f"{name}-gguf", name, seed=32, gguf=True,
                                               gguf_qtype="Q8_0") / "model.gguf"
    return out


# (four ranks: DeepSeek-V3's case and the end-to-end tests'; the Qwen2-MoE and GLM-4.5 layers split by heads
# and by experts in their -ep cases, whose dense parts split as without --ep)
CASES = [("tiny-llama", 2, False), ("tiny-deepseek-v2", 2, False),
         ("tiny-deepseek-v2", 2, True), ("tiny-deepseek-v3", 4, True), ("tiny-deepseek-v3", 2, False),
         ("tiny-llama.gguf", 2, False), ("tiny-deepseek-v2.gguf", 2, False), ("tiny-deepseek-v2.gguf", 2, True),
         ("tiny-qwen3-moe", 2, False), ("tiny-qwen3-moe", 2, True),
         ("tiny-qwen2-moe", 2, True), ("tiny-glm4-moe", 2, True),
         ("tiny-glm4-moe-lite", 2, True)]


@pytest.mark.parametrize("name,world,ep", CASES, ids=[f"{n}-tp{w}{'-ep' if e else ''}" for n, w, e in CASES])
def test_parallel_logits_equal_one_process(checkpoints, name: str, world: int, ep: bool) -> None:
    ref, held_one = _greedy(str(checkpoints[name]))
    logits, held = run_parallel(checkpoints[name], world, ep)
    assert len(logits) == len(ref)
    for step, (got, want) in enumerate(zip(logits, ref)):
        assert got.shape == want.shape, step
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), step
    # each rank holds about 1/world of the weights (norms, routers and MLA's latent projection are
    # every rank's: small next to the split layers and the vocabulary)
    for h in held:
        assert h < held_one / world * 1.25, (h, held_one)
    assert sum(held) >= held_one


# OmniKV: layer 1 filters, layers 2 and 3 read its selection (3 tokens by importance, the first and the 2
# newest): the first request's context (12..20) loses tokens, the second's (6..14) too from its 4th step
OMNIKV = dict(filter_layers=(1,), budget_tokens=3, sink_tokens=1, recent_tokens=2, min_context=1,
              full_after_filter=False)
# (one triton case: its kernels run under Triton's interpreter, ~1 min a case; the reduction is the backends')
OMNIKV_CASES = [("tiny-llama-4", 2, "torch", "last_token"), ("tiny-deepseek-v2-4", 2, "torch", "exponential"),
                ("tiny-deepseek-v2-4", 2, "triton", "last_token"), ("tiny-llama-4", 4, "torch", "uniform")]


@pytest.mark.parametrize("name,world,backend,alpha", OMNIKV_CASES,
                         ids=[f"{n}-tp{w}-{b}-{a}" for n, w, b, a in OMNIKV_CASES])
def test_omnikv_under_tensor_parallelism_selects_as_one_process(checkpoints, name: str, world: int, backend: str,
                                                               alpha: str) -> None:
    """Each rank holds some heads, and OmniKV's importance is a max over all of them: the ranks take that max
    together (models.parallel.split_heads_max), so they select the tokens one process selects and the
    logits are one process's (a rank that selected from its own heads' scores alone attends to other
    tokens: the test fails without the reduction). With a window of queries (exponential, uniform) the
    max is taken per query before the weighted sum; the triton backend runs under Triton's interpreter."""
    omnikv = {**OMNIKV, "alpha": alpha, "window": 1 if alpha == "last_token" else 4}
    ref, _ = _greedy(str(checkpoints[name]), omnikv, backend, steps=2 * STEPS)
    full, _ = _greedy(str(checkpoints[name]), None, backend, steps=2 * STEPS)
    # the selection matters: sparse decoding moves the logits (so a wrong selection would show)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, full)) > 1e-3
    logits, _ = run_parallel(checkpoints[name], world, omnikv=omnikv, backend=backend)
    assert len(logits) == len(ref)
    for step, (got, want) in enumerate(zip(logits, ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), step


def test_parallel_layout_refuses_what_it_cannot_split(checkpoints) -> None:
    from models.parallel import ParallelLayout, configure, current
    from models.loader.load import load_model

    before = current()
    configure(ParallelLayout(tp_size=3, tp_rank=0))  # 4 heads over 3 ranks
    try:
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
            load_model(str(checkpoints["tiny-llama"]), dtype="float32", load_tokenizer=False, progress=False)
    finally:
        configure(before)


# ---- DP attention: each rank its own requests; MLP/MoE split over every rank's tokens gathered ----
DP_PROMPTS = [PROMPT, [901, 44, 17, 3002, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13], [2047, 1, 300]]
IDLE = (1, 1)  # (rank, step): that rank has nothing to run at that decode step


def _dp_requests(model_dir: str, prompt: list[int], idle_step: int | None) -> tuple[list[torch.Tensor], int]:
    """One rank's request: prefill then STEPS greedy decodes, skipping `idle_step` (forward_idle instead
    under DP attention); its logits and the parameter bytes held."""
    from executor.model_runner import ModelRunner, RequestSlice
    from models.loader.load import load_model
    from models.parallel import current

    loaded = load_model(model_dir, dtype="float32", expert_backend="torch", load_tokenizer=False, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=128, max_running_requests=2,
                         max_context_len=64)
    row = runner.req_to_token_pool.alloc()
    logits = runner.forward(runner.build_batch([RequestSlice(row, 0, prompt)]))
    out, pos = [logits], len(prompt)
    for step in range(STEPS):
        if step == idle_step:
            if current().dp_attention:
                runner.forward_idle()
            continue
        logits = runner.forward(runner.build_batch([RequestSlice(row, pos, [int(out[-1][-1].argmax())])]))
        out.append(logits)
        pos += 1
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    runner.close()
    return out, held


DP_CASES = [("tiny-deepseek-v2", 2, False), ("tiny-deepseek-v3", 2, True), ("tiny-llama", 2, False),
            ("tiny-deepseek-v2.gguf", 4, True), ("tiny-qwen3-moe", 2, True), ("tiny-qwen2-moe", 2, True),
            ("tiny-glm4-moe", 2, True)]


@pytest.mark.parametrize("name,world,ep", DP_CASES, ids=[f"{n}-dp{w}{'-ep' if e else ''}" for n, w, e in DP_CASES])
def test_dp_attention_each_rank_gets_its_own_requests_logits(checkpoints, name: str, world: int, ep: bool) -> None:
    got = spawn_ranks(checkpoints[name], world, ep, dp_attention=True)
    for rank in range(world):
        want, held_one = _dp_requests(str(checkpoints[name]), DP_PROMPTS[rank], IDLE[1] if rank == IDLE[0] else None)
        logits, held = got[rank]
        assert len(logits) == len(want)
        for step, (a, b) in enumerate(zip(logits, want)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=lambda m: f"rank {rank} step {step}: {m}")
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert held < held_one  # the MLP/MoE layers are split (attention, embedding and head are whole)
