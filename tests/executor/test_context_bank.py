"""OmniKV's context bank (kernels/attention/context_bank.py): the sparse layers' KV in host memory, the
selected rows gathered at each decode step's filter layers. On this CPU host and device are the same
memory, so what is checked is the bank's logic: which layers it holds, that sparse layers read its
gathered rows, and that decoding through it gives bit for bit what decoding without it gives, with
batches that mix OmniKV and full rows, a prefill sharing the step (a MIXED batch, which reads the host
layers in place), both attention backends (Triton under TRITON_INTERPRET=1) and the HF oracle when the
budget covers the context. What only a GPU shows (pinned memory read by the device, the side stream,
device memory saved) is `bench/omnikv_gpu.py --bank`'s and the CUDA twin test below."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from executor.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from executor.model_runner import ModelRunner, RequestSlice, bank_layers  # noqa: E402
from kernels.attention.omnikv import SPARSE  # noqa: E402
from models.loader.load import load_model  # noqa: E402
from models.omnikv_config import OmniKVConfig  # noqa: E402
from tests.hf_models import hf_greedy, save_hf_models  # noqa: E402

LAYERS = 7
MODELS = ["llama_gqa_tied", "v2_lite_yarn_grouped", "v3_noaux_yarn"]
CFG = OmniKVConfig(filter_layers=(1, 4), budget_tokens=6, sink_tokens=2, recent_tokens=4, alpha="exponential", window=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_hf_models(tmp_path_factory, MODELS, 70, num_hidden_layers=LAYERS)


def runner_for(path, cfg: OmniKVConfig, bank: bool, backend: str = "torch") -> ModelRunner:
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=8, omnikv=cfg,
                       omnikv_bank=bank, attention_backend=backend, native_forward=False)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_steps(runner: ModelRunner, prompts: list[list[int]], sparse: list[bool], steps: int,
              late: list[int]) -> list[torch.Tensor]:
    """Prefill `prompts`, then `steps` batched greedy decode steps; at step 2 the prompt `late` is
    prefilled in the same forward as the decodes (a MIXED batch) and decodes with the others after.
    Returns every forward's logits; frees everything."""
    pool = runner.req_to_token_pool
    rows = [pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    logits = runner.forward(runner.build_batch([RequestSlice(r, 0, p) for r, p in zip(rows, prompts)]))
    out = [logits]
    toks = logits.argmax(-1).tolist()
    for step in range(steps):
        slices = [RequestSlice(r, n, [t], omnikv=s) for r, n, t, s in zip(rows, lens, toks, sparse)]
        if step == 2:
            rows.append(pool.alloc())
            slices.append(RequestSlice(rows[-1], 0, late))
            lens.append(len(late) - 1)
            sparse = [*sparse, True]
        logits = runner.forward(runner.build_batch(slices))
        out.append(logits)
        toks = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    for r, n in zip(rows, lens):
        runner.free_request(r, n)
    return out


def test_pools_hold_the_host_layers_apart():
    """The listed layers' buffers are host tensors (pinned only on a GPU host), the dummy page zeroed,
    and the host share of a token's bytes is theirs."""
    mla = MLATokenToKVPool(32, 4, 16, 8, torch.float32, "cpu", host_layers=(1, 3))
    assert mla.host_layers == {1, 3} and mla.host_bytes_per_token() * 2 == mla.bytes_per_token()
    assert not mla.kv_buffer[1].is_pinned() and torch.count_nonzero(mla.kv_buffer[3][:1]) == 0
    loc = torch.tensor([5, 9])
    c_kv, k_pe = torch.randn(2, 16), torch.randn(2, 8)
    mla.set_mla_kv(3, loc, c_kv, k_pe)
    assert torch.equal(mla.kv_buffer[3][loc], torch.cat([c_kv, k_pe], -1))
    mha = MHATokenToKVPool(32, 3, 2, 8, torch.float32, "cpu", host_layers=(2,))
    assert mha.host_bytes_per_token() * 3 == mha.bytes_per_token() and len(mha.layer_buffers(2)) == 2
    assert MLATokenToKVPool(32, 4, 16, 8, torch.float32).host_bytes_per_token() == 0


@pytest.mark.parametrize("name", MODELS)
def test_bank_decodes_bit_for_bit_as_without(checkpoints, name):
    """Three requests (two OmniKV, one full) decode together, a fourth joins through a MIXED batch:
    every forward's logits equal those of the same run without a bank, and the bank gathered the sparse
    layers' rows at every decode step."""
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    prompts = [prompt(40, vocab, 1), prompt(53, vocab, 2), prompt(31, vocab, 3)]
    late = prompt(45, vocab, 4)
    plain = run_steps(runner_for(path, CFG, bank=False), prompts, [True, True, False], 6, late)
    runner = runner_for(path, CFG, bank=True)
    plan = runner.omnikv_plan
    sparse_layers = [i for i, r in enumerate(plan.roles) if r == SPARSE]
    assert sparse_layers and runner.context_bank.layers() == sparse_layers == sorted(runner.kv_pool.host_layers)
    banked = run_steps(runner, prompts, [True, True, False], 6, late)
    for step, (a, b) in enumerate(zip(plain, banked)):
        assert torch.equal(a, b), f"forward {step}: the bank changed the logits"
    assert runner.context_bank.bytes_gathered > 0
    assert runner.allocator.available_size() == 1024 and runner.req_to_token_pool.available_size() == 8


def test_sparse_layers_read_the_gathered_rows(checkpoints):
    """The rows a sparse layer attends over come from the bank's gather: poisoning a group's host layers
    right after their gather (between the filter layer and the sparse layers) leaves the step's output
    unchanged, while poisoning them before the step changes it."""
    hf, path = checkpoints["v2_lite_yarn_grouped"]
    runner = runner_for(path, CFG, bank=True)
    ids = prompt(48, hf.config.vocab_size, 5)
    row = runner.req_to_token_pool.alloc()
    first = runner.forward(runner.build_batch([RequestSlice(row, 0, ids)])).argmax(-1).tolist()
    host = sorted(runner.kv_pool.host_layers)
    saved = {i: runner.kv_pool.kv_buffer[i].clone() for i in host}
    reference = runner.forward(runner.build_batch([RequestSlice(row, len(ids), first, omnikv=True)]))

    def restore():
        for i in host:
            runner.kv_pool.kv_buffer[i].copy_(saved[i])

    bank = runner.context_bank
    prefetch = bank.prefetch

    def poison_after(f, table, lens, gather):
        out = prefetch(f, table, lens, gather)
        for i in bank.groups[f]:  # the layers just gathered
            runner.kv_pool.kv_buffer[i][runner.kv_pool.page_size:].normal_()
        return out

    for poison_first in (False, True):
        restore()
        runner.allocator.free(runner.req_to_token_pool.req_to_token[row, len(ids):len(ids) + 1].to(torch.int64))
        if poison_first:
            for i in host:
                runner.kv_pool.kv_buffer[i][runner.kv_pool.page_size:].normal_()
        else:
            bank.prefetch = poison_after
        got = runner.forward(runner.build_batch([RequestSlice(row, len(ids), first, omnikv=True)]))
        bank.prefetch = prefetch
        assert torch.equal(got, reference) != poison_first


@pytest.mark.parametrize("name", MODELS)
def test_bank_with_everything_selected_is_hf(checkpoints, name, monkeypatch):
    """Budget >= context: decoding through the bank is full attention, token for token HF's."""
    hf, path = checkpoints[name]
    cfg = OmniKVConfig(filter_layers=(1, 4), budget_tokens=10_000, sink_tokens=2, recent_tokens=3)
    monkeypatch.setattr(OmniKVConfig, "is_sparse_for", lambda self, n: True)
    runner = runner_for(path, cfg, bank=True)
    ids = prompt(36, hf.config.vocab_size, seed=6)
    assert runner.generate_greedy(ids, 10, omnikv=True) == hf_greedy(hf, ids, 10)
    assert runner.context_bank.bytes_gathered > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels interpreted on CPU tensors; on a GPU host "
                    "test_gpu_bank_holds_sparse_layers_on_the_host runs the Triton bank on the device")
@pytest.mark.parametrize("name", ["v2_lite_yarn_grouped"])  # (GQA's Triton bank: test_cuda_graph_runner's OmniKV case)
def test_triton_bank_matches_triton_without(checkpoints, name):
    """The Triton backend's bank (gather_rows over each row's length, the decode kernel over the bank's
    table): the same tokens as without a bank, logits within the kernels' float tolerance."""
    pytest.importorskip("triton")
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    prompts = [prompt(34, vocab, 7), prompt(41, vocab, 8)]
    late = prompt(30, vocab, 9)
    plain = run_steps(runner_for(path, CFG, bank=False, backend="triton"), prompts, [True, False], 4, late)
    runner = runner_for(path, CFG, bank=True, backend="triton")
    banked = run_steps(runner, prompts, [True, False], 4, late)
    for a, b in zip(plain, banked):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert runner.context_bank.bytes_gathered > 0


def test_bank_layers_follow_the_plan():
    plan = OmniKVConfig(filter_layers=(1, 4)).plan(8)
    groups = bank_layers(plan)
    assert groups == {0: [3], 1: [6, 7]}
    assert all(plan.roles[i] == SPARSE and plan.source[i] == f for f, layers in groups.items() for i in layers)


def test_a_bank_needs_a_config(checkpoints):
    _, path = checkpoints["llama_gqa_tied"]
    loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False)
    with pytest.raises(ValueError, match="needs an OmniKV config"):
        ModelRunner(loaded.model, loaded.config, max_total_tokens=64, max_running_requests=2, omnikv_bank=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host bank on a GPU: pinned host layers")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_bank_holds_sparse_layers_on_the_host(checkpoints, backend):
    """On a GPU the sparse layers' buffers are pinned host memory the device reads (Triton: directly;
    torch: through `read_rows`), the others device memory, and decoding equals decoding without a bank."""
    hf, path = checkpoints["v2_lite_yarn_grouped"]

    def on_gpu(bank: bool) -> ModelRunner:
        loaded = load_model(path, dtype="float32", load_tokenizer=False, progress=False, device="cuda")
        return ModelRunner(loaded.model, loaded.config, max_total_tokens=1024, max_running_requests=8, omnikv=CFG,
                           omnikv_bank=bank, attention_backend=backend, device="cuda", disable_cuda_graph=True)

    runner = on_gpu(True)
    assert runner.attn_backend.host_memory_problem(torch.device("cuda")) is None  # the start-up probe passed
    for i, buf in enumerate(runner.kv_pool.kv_buffer):
        assert (buf.device.type == "cpu" and buf.is_pinned()) == (i in runner.kv_pool.host_layers)
    vocab = hf.config.vocab_size
    prompts = [prompt(40, vocab, 1), prompt(53, vocab, 2)]
    plain = run_steps(on_gpu(False), prompts, [True, False], 5, prompt(45, vocab, 4))
    banked = run_steps(runner, prompts, [True, False], 5, prompt(45, vocab, 4))
    for a, b in zip(plain, banked):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
