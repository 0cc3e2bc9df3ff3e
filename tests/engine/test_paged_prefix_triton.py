"""The paged prefix cache read by the Triton attention kernels (interpreted on this CPU): a prompt whose first
pages another request cached reads them through its page table, in the extend kernel (its prefix) and the
decode kernel, and gets the tokens the torch reference gives without the cache. What only a GPU shows (the
kernels' speed over 64-token pages) is `bench/mla_decode_gpu.py`'s."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from engine.messages import GenerateRequest  # noqa: E402
from models.synthetic import write_checkpoint  # noqa: E402
from tests.engine.test_engine_core import GREEDY, assert_no_leak, make_engine, prompt, run_to_end, tokens  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreted kernels on CPU tensors")
@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-llama"])
def test_triton_reads_cached_pages_as_the_requests_own(name, tmp_path):
    pytest.importorskip("triton")
    model_dir = write_checkpoint(tmp_path, name, seed=13)
    shared = prompt(37, 210)
    a, b = shared + prompt(4, 211), shared + prompt(6, 212)
    params = msgspec.structs.replace(GREEDY, max_tokens=6)
    flat = make_engine(model_dir, disable_prefix_cache=True, max_total_tokens=256)
    want = {}
    for rid, ids in (("a", a), ("b", b)):
        flat.add_request(GenerateRequest(rid, ids, params))
        want[rid] = tokens(run_to_end(flat)[(rid, 0)])
    core = make_engine(model_dir, attention_backend="triton", cpu_kernels="torch", page_size=16,
                       max_total_tokens=16 * 16, chunked_prefill_size=20)
    backend = core.runner.attn_backend  # (the native CPU forward would never call it)
    calls = {"extend": 0, "decode": 0}
    for name in calls:
        real = getattr(backend, f"_{name}")

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        setattr(backend, f"_{name}", counted)
    got = {}
    for rid, ids in (("a", a), ("b", b)):
        core.add_request(GenerateRequest(rid, ids, params))
        outs = run_to_end(core)[(rid, 0)]
        got[rid] = tokens(outs)
    assert got == want and outs[-1].cached_tokens == 32
    assert calls["extend"] > 0 and calls["decode"] > 0, calls
    assert_no_leak(core)
