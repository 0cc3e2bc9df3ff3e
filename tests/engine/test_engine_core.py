"""The engine core in-process, on tiny synthetic models: batching, prefix cache, chunked prefill,
retraction under memory pressure, aborts, n > 1, seeds, and its refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from models.synthetic import write_checkpoint
from engine.args import EngineArgs
from engine.core import EngineCore
from engine.messages import (
    ERR_CONTEXT,
    ERR_INVALID,
    ERR_OVERLOADED,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    GenerateRequest,
    RequestOutput,
)
from scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-deepseek-v3", "tiny-llama"])
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=11)


def make_engine(model_dir, **kw) -> EngineCore:
    args = dict(model=str(model_dir), dtype="float32", max_total_tokens=4096, max_running_requests=64,
                chunked_prefill_size=512, max_prefill_tokens=4096)
    args.update(kw)
    return EngineCore(EngineArgs(**args))


def prompt(n: int, seed: int, vocab: int = 5000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_to_end(core: EngineCore, max_steps: int = 10_000) -> dict[tuple[str, int], list[RequestOutput]]:
    outs: dict[tuple[str, int], list[RequestOutput]] = {}
    for _ in range(max_steps):
        for o in core.step():
            outs.setdefault((o.rid, o.index), []).append(o)
        if not core.has_work():
            return outs
    raise AssertionError("engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(core: EngineCore, ids: list[int], params: SamplingParams) -> list[int]:
    assert core.add_request(GenerateRequest("alone", ids, params)) == []
    return tokens(run_to_end(core)[("alone", 0)])


def assert_no_leak(core: EngineCore) -> None:
    alloc = core.runner.allocator
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.cache.protected_size() == 0
    assert alloc.available_size() + core.cache.evictable_size() == alloc.num_slots
    assert core.runner.req_to_token_pool.available_size() == core.runner.req_to_token_pool.size


def test_batch_invariance_staggered(model_dir):
    core = make_engine(model_dir, disable_prefix_cache=True)
    reqs = [(f"r{i}", prompt(3 + (i * 7) % 40, i), msgspec.structs.replace(GREEDY, max_tokens=1 + (i * 5) % 17))
            for i in range(32)]
    expected = {rid: alone(core, ids, p) for rid, ids, p in reqs}
    outs: dict = {}
    for k in range(0, 32, 4):  # four new requests every three steps
        for rid, ids, p in reqs[k : k + 4]:
            assert core.add_request(GenerateRequest(rid, ids, p)) == []
        for _ in range(3):
            for o in core.step():
                outs.setdefault((o.rid, o.index), []).append(o)
    for key, v in run_to_end(core).items():
        outs.setdefault(key, []).extend(v)
    for rid, ids, p in reqs:
        got = outs[(rid, 0)]
        assert tokens(got) == expected[rid], rid
        assert got[-1].finish_reason == FINISH_LENGTH and got[-1].completion_tokens == p.max_tokens
        assert got[-1].prompt_tokens == len(ids)
    assert_no_leak(core)


def test_paged_kv_gives_the_same_tokens(model_dir):
    """Page size 64 (the layout paged GPU kernels read): same tokens as token-granular slots."""
    reqs = [(f"p{i}", prompt(5 + 23 * i, 300 + i), msgspec.structs.replace(GREEDY, max_tokens=70 - 9 * i)) for i in range(6)]
    flat = make_engine(model_dir, disable_prefix_cache=True)
    expected = {rid: alone(flat, ids, p) for rid, ids, p in reqs}
    paged = make_engine(model_dir, page_size=64, max_total_tokens=64 * 12, chunked_prefill_size=40)
    for rid, ids, p in reqs:
        paged.add_request(GenerateRequest(rid, ids, p))
    outs = run_to_end(paged)
    assert {rid: tokens(outs[(rid, 0)]) for rid, _, _ in reqs} == expected
    assert_no_leak(paged)


def test_paged_prefix_cache_shares_whole_pages(model_dir):
    """Page size 16 with the prefix cache on: a prompt sharing 50 tokens with an earlier one finds its first
    three pages (48 tokens) cached and reads them as its own pages; prompts sharing prefixes of every length
    with one another in a pool of 20 pages (chunked prefill, n = 2, evictions, retractions, an abort) get the
    tokens they get with token-granular slots and no cache, and nothing leaks."""
    shared = prompt(50, 110)
    a, b = shared + prompt(5, 111), shared + prompt(7, 112)
    params = msgspec.structs.replace(GREEDY, max_tokens=12)
    flat = make_engine(model_dir, disable_prefix_cache=True)
    want_b = alone(flat, b, params)
    core = make_engine(model_dir, page_size=16, max_total_tokens=16 * 20, chunked_prefill_size=24)
    alone(core, a, params)
    hits_before = core.stats().prefix_cache_hit_tokens_total
    core.add_request(GenerateRequest("b", b, params))
    outs = run_to_end(core)[("b", 0)]
    assert tokens(outs) == want_b
    assert outs[-1].cached_tokens == 48 and core.stats().prefix_cache_hit_tokens_total - hits_before == 48
    assert_no_leak(core)

    base = prompt(90, 120)
    sampled = SamplingParams(temperature=1.0, seed=9, n=2, ignore_eos=True, max_tokens=18)
    reqs = [(f"s{i}", base[:k] + prompt(3 + k % 7, 130 + i), msgspec.structs.replace(GREEDY, max_tokens=20 + k % 5))
            for i, k in enumerate((0, 17, 32, 47, 64, 80, 90, 90))] + [("n2", base[:40] + prompt(9, 140), sampled)]
    expected = {}
    for rid, ids, p in reqs:
        flat.add_request(GenerateRequest(rid, ids, p))
        expected.update({key: tokens(v) for key, v in run_to_end(flat).items()})
    for rid, ids, p in reqs:
        core.add_request(GenerateRequest(rid, ids, p))
    core.add_request(GenerateRequest("gone", base[:70] + prompt(4, 150), params))
    got: dict = {}
    for _ in range(3):
        for o in core.step():
            got.setdefault((o.rid, o.index), []).append(o)
    core.abort("gone")
    for key, v in run_to_end(core).items():
        got.setdefault(key, []).extend(v)
    got.pop(("gone", 0), None)
    assert {key: tokens(v) for key, v in got.items()} == expected
    assert core.stats().retractions_total > 0 and core.stats().prefix_cache_hit_tokens_total > hits_before + 48
    core.cache.check_integrity()
    assert_no_leak(core)


def test_paged_waits_only_for_whole_pages(model_dir):
    """Page size 64: a request sharing 50 tokens with a prompt being prefilled does not wait for them (the
    cache would keep none of them: less than a page), nor do n = 3 completions of a 40-token prompt wait for
    completion 0's (with page size 1 they wait, and reuse the prompt's KV)."""
    shared, chunks = prompt(50, 190), dict(chunked_prefill_size=16, max_prefill_tokens=64)
    p = msgspec.structs.replace(GREEDY, max_tokens=2)
    a, b = GenerateRequest("a", shared + prompt(150, 191), p), GenerateRequest("b", shared + prompt(10, 192), p)

    def steps(reqs: list[GenerateRequest], **kw) -> dict[str, int]:
        core = make_engine(model_dir, **chunks, **kw)
        first = first_token_steps(core, {0: reqs}, 100)
        assert_no_leak(core)
        return first
    alone_b = steps([b], page_size=64)["b"]
    assert steps([a, b], page_size=64)["b"] == alone_b
    n3 = GenerateRequest("n", prompt(40, 193), msgspec.structs.replace(p, n=3, temperature=1.0, seed=2))
    paged = steps([n3], page_size=64)
    assert len(paged) == 3 and len(set(paged.values())) == 1, paged  # all three prefill together
    flat = steps([n3])
    assert flat["n/1"] > flat["n"], flat


def test_n_completions_score_the_prompt_once(model_dir):
    """prompt_logprobs with n = 3: completion 0 scores the prompt (computed whole), the others take its KV from
    the prefix cache instead of waiting for it and computing and scoring it again; the tokens are the same."""
    ids = prompt(60, 200)
    p = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    core = make_engine(model_dir)
    core.add_request(GenerateRequest("s", ids, p))
    outs = run_to_end(core)
    assert [o.cached_tokens for o in (outs[("s", i)][-1] for i in range(3))] == [0, 59, 59]
    assert [sum(bool(o.prompt_logprobs) for o in outs[("s", i)]) for i in range(3)] == [1, 0, 0]
    plain = make_engine(model_dir)
    plain.add_request(GenerateRequest("s", ids, msgspec.structs.replace(p, prompt_logprobs=None)))
    assert {k: tokens(v) for k, v in run_to_end(plain).items()} == {k: tokens(v) for k, v in outs.items()}


def test_unseeded_draws_differ_across_starts_unless_a_seed_is_given(model_dir):
    """A request without a seed samples differently after a restart (OpenAI's, llama.cpp's and SGLang's
    unseeded requests are random), unless the server was given --seed: then it repeats."""
    ids, p = prompt(9, 160), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {seed: [alone(make_engine(model_dir, seed=seed), ids, p) for _ in range(2)] for seed in (None, 5)}
    assert runs[None][0] != runs[None][1] and runs[5][0] == runs[5][1]


def test_a_cache_salt_shares_kv_only_with_its_own(model_dir):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for that salt only; no salt shares with no
    salt alone; the tokens are the same either way."""
    ids, core = prompt(40, 170), make_engine(model_dir)
    params = msgspec.structs.replace(GREEDY, max_tokens=4)
    cached = {}
    for rid, salt in (("none", None), ("a", "tenant-a"), ("b", "tenant-b"), ("a2", "tenant-a"), ("none2", None)):
        core.add_request(GenerateRequest(rid, ids, msgspec.structs.replace(params, cache_salt=salt)))
        outs = run_to_end(core)[(rid, 0)]
        cached[rid] = (outs[-1].cached_tokens, tokens(outs))
    assert [cached[r][0] for r in ("none", "a", "b", "a2", "none2")] == [0, 0, 0, 39, 39]
    assert len({tuple(t) for _, t in cached.values()}) == 1
    assert_no_leak(core)


def test_prefix_cache_reuses_slots_and_keeps_tokens(model_dir):
    shared = prompt(48, 100)
    a, b = shared + prompt(5, 101), shared + prompt(7, 102)
    params = msgspec.structs.replace(GREEDY, max_tokens=12)
    plain = make_engine(model_dir, disable_prefix_cache=True)
    want_b = alone(plain, b, params)

    core = make_engine(model_dir)
    alone(core, a, params)
    hits_before = core.stats().prefix_cache_hit_tokens_total
    core.add_request(GenerateRequest("b", b, params))
    outs = run_to_end(core)[("b", 0)]
    assert tokens(outs) == want_b
    assert outs[-1].cached_tokens >= len(shared)
    assert core.stats().prefix_cache_hit_tokens_total - hits_before >= len(shared)
    assert_no_leak(core)


def test_a_prompt_is_shared_while_its_request_still_runs(model_dir):
    """A prompt's KV is in the prefix cache once prefilled, not only when its request ends (as SGLang): a
    request sharing it that arrives while the first decodes reuses it (it computed it again before)."""
    shared = prompt(48, 100)
    a, b = shared + prompt(5, 101), shared + prompt(7, 102)
    params = msgspec.structs.replace(GREEDY, max_tokens=12)
    want_b = alone(make_engine(model_dir, disable_prefix_cache=True), b, params)
    core = make_engine(model_dir)
    core.add_request(GenerateRequest("a", a, params))
    while not core.scheduler.running or not core.scheduler.running[0].output_ids:
        core.step()
    core.add_request(GenerateRequest("b", b, params))
    outs = run_to_end(core)
    assert tokens(outs[("b", 0)]) == want_b and outs[("b", 0)][-1].cached_tokens >= len(shared)
    assert_no_leak(core)


def test_requests_arriving_together_compute_their_shared_prefix_once(model_dir):
    """Two requests sharing a prefix that arrive in one step: the second waits while the first's prefill
    has SHARED_PREFIX_WAIT or more of their shared tokens to compute, then finds them cached (each
    computed all of them before). Tokens as alone; a third unrelated request is not held up."""
    from scheduler.scheduler import SHARED_PREFIX_WAIT

    shared = prompt(100, 110)
    a, b, c = shared + prompt(5, 111), shared + prompt(7, 112), prompt(30, 113)
    params = msgspec.structs.replace(GREEDY, max_tokens=6)
    plain = make_engine(model_dir, disable_prefix_cache=True)
    want = {rid: alone(plain, ids, params) for rid, ids in (("a", a), ("b", b), ("c", c))}
    core = make_engine(model_dir, chunked_prefill_size=16, max_prefill_tokens=64)
    for rid, ids in (("a", a), ("b", b), ("c", c)):
        core.add_request(GenerateRequest(rid, ids, params))
    core.step()
    assert {r.rid for r in core.scheduler.running} == {"a", "c"}  # b waits, c does not
    outs = run_to_end(core)
    assert {rid: tokens(outs[(rid, 0)]) for rid in want} == want
    assert outs[("b", 0)][-1].cached_tokens > len(shared) - SHARED_PREFIX_WAIT
    assert outs[("c", 0)][-1].cached_tokens == 0
    assert_no_leak(core)


def first_token_steps(core: EngineCore, arrivals: dict[int, list[GenerateRequest]], steps: int) -> dict[str, int]:
    """The step at which each completion's first token came (keyed by rid, and `rid/i` for completion i > 0);
    `arrivals`: requests added before a step."""
    first: dict[str, int] = {}
    for step in range(steps):
        for req in arrivals.get(step, []):
            core.add_request(req)
        for o in core.step():
            if o.new_token_ids:
                first.setdefault(f"{o.rid}/{o.index}" if o.index else o.rid, step)
        if not core.has_work() and step > max(arrivals):
            break
    return first


def test_a_request_waiting_on_a_shared_prefix_keeps_its_slot(model_dir):
    """B waits while A prefills their shared 200 tokens; C, unrelated and later, must not take the one slot
    left meanwhile (it did, and kept it for its 300 tokens: B's first token came at A's end)."""
    shared = prompt(200, 130)
    long, short = msgspec.structs.replace(GREEDY, max_tokens=300), msgspec.structs.replace(GREEDY, max_tokens=5)
    reqs = [GenerateRequest("A", shared + prompt(4, 131), long), GenerateRequest("B", shared + prompt(4, 132), short),
            GenerateRequest("C", prompt(8, 133), long)]
    firsts = {}
    for cache in (False, True):
        core = make_engine(model_dir, disable_prefix_cache=not cache, max_running_requests=2, chunked_prefill_size=16,
                           max_prefill_tokens=64)
        firsts[cache] = first_token_steps(core, {0: reqs}, 2000)
        assert_no_leak(core)
    assert firsts[True]["B"] <= firsts[False]["B"] < 50 and firsts[True]["C"] < 300, firsts


def test_prompts_scored_do_not_hold_a_request_waiting(model_dir):
    """Prompts scored (prompt_logprobs) compute from their first token whatever is cached: a stream of them
    over a cached context held a request on that context waiting as long as it lasted."""
    ctx = prompt(200, 140)
    core = make_engine(model_dir, chunked_prefill_size=16, max_prefill_tokens=64)
    alone(core, ctx + [7], msgspec.structs.replace(GREEDY, max_tokens=1))  # the context is cached
    score = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, prompt_logprobs=0)
    arrivals = {step: [GenerateRequest(f"s{step}", ctx + prompt(5, 141 + step), score)] for step in range(0, 120, 4)}
    arrivals[1] = [GenerateRequest("gen", ctx + prompt(5, 142), msgspec.structs.replace(GREEDY, max_tokens=3))]
    assert first_token_steps(core, arrivals, 400)["gen"] <= 3
    assert_no_leak(core)


def test_the_chunks_of_an_aborted_prompt_stay_cached(model_dir):
    """The chunks a prompt prefilled before its request was aborted (a client gone) are cached: the retry
    reuses them."""
    ids = prompt(64, 120)
    params = msgspec.structs.replace(GREEDY, max_tokens=4)
    want = alone(make_engine(model_dir, disable_prefix_cache=True), ids, params)
    core = make_engine(model_dir, chunked_prefill_size=16, max_prefill_tokens=16)
    core.add_request(GenerateRequest("gone", ids, params))
    core.step()
    core.step()  # 32 of its 64 tokens
    core.abort("gone")
    core.add_request(GenerateRequest("retry", ids, params))
    outs = run_to_end(core)[("retry", 0)]
    assert tokens(outs) == want and outs[-1].cached_tokens >= 32
    assert_no_leak(core)


def test_prefix_cache_queries_are_counted_with_the_hits(model_dir):
    """A completion's prompt is counted as a prefix-cache query when its hits are, at its first admission: a
    request aborted mid-prefill had its hits counted and its query not, which pushed the hit rate above 1."""
    shared = prompt(48, 100)
    params = msgspec.structs.replace(GREEDY, max_tokens=4)
    core = make_engine(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    alone(core, shared + prompt(5, 101), params)
    before = core.stats()
    b = shared + prompt(40, 102)
    core.add_request(GenerateRequest("b", b, params))
    core.step()  # admitted: its cached prefix, then 8 of its other 40 tokens
    core.abort("b")
    run_to_end(core)
    after = core.stats()
    hits = after.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total
    assert after.prefix_cache_query_tokens_total - before.prefix_cache_query_tokens_total == len(b)
    assert len(shared) <= hits < len(b)
    assert after.prefix_cache_hit_tokens_total <= after.prefix_cache_query_tokens_total
    # a prompt scored (prompt_logprobs: echo with logprobs) is computed whole, nothing looked up: no query
    scored = msgspec.structs.replace(params, prompt_logprobs=0)
    alone(core, b + prompt(3, 103), scored)
    assert core.stats().prefix_cache_query_tokens_total == after.prefix_cache_query_tokens_total
    assert core.stats().prefix_cache_hit_tokens_total == after.prefix_cache_hit_tokens_total
    assert_no_leak(core)

    off = make_engine(model_dir, disable_prefix_cache=True)  # nothing is looked up: no queries to count
    alone(off, b, params)
    assert off.stats().prefix_cache_query_tokens_total == off.stats().prefix_cache_hit_tokens_total == 0
    assert_no_leak(off)


def test_chunked_prefill_same_tokens_and_others_keep_decoding(model_dir):
    long_ids = prompt(150, 7)
    params = msgspec.structs.replace(GREEDY, max_tokens=6)
    want = alone(make_engine(model_dir, disable_prefix_cache=True), long_ids, params)

    core = make_engine(model_dir, disable_prefix_cache=True, chunked_prefill_size=16, max_prefill_tokens=16)
    core.add_request(GenerateRequest("short", prompt(4, 8), msgspec.structs.replace(GREEDY, max_tokens=40)))
    core.step()  # the short request is prefilled and decoding
    core.add_request(GenerateRequest("long", long_ids, params))
    steps_with_short_tokens_before_long = 0
    outs: dict = {}
    long_started = False
    for _ in range(200):
        step_out = core.step()
        for o in step_out:
            outs.setdefault(o.rid, []).append(o)
        if any(o.rid == "long" and o.new_token_ids for o in step_out):
            long_started = True
        if not long_started and any(o.rid == "short" and o.new_token_ids for o in step_out):
            steps_with_short_tokens_before_long += 1
        if not core.has_work():
            break
    assert tokens(outs["long"]) == want
    assert steps_with_short_tokens_before_long >= 150 // 16  # decoding went on between the chunks
    assert_no_leak(core)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v3"])
def test_native_logprobs_do_not_depend_on_the_prefix_cache_or_the_chunks(preset, tmp_path):
    """A GGUF on the native CPU forward (its default bf16 KV cache): a request whose prompt shares an odd
    number of tokens with an earlier one (served from the prefix cache) and is prefilled in chunks of an odd
    size gives the same tokens and the same logprobs, bit for bit, as alone in one prefill. (A cached
    prefix or chunk boundary off a multiple of 4 used to regroup its tokens' attention and move the logits.)"""
    from models.loader.gguf_writer import write_gguf

    path = write_gguf(write_checkpoint(tmp_path / preset, preset, seed=5), tmp_path / "model.gguf", "Q8_0")
    ids = prompt(403, 31)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, logprobs=True, top_logprobs=3)

    def answer(core: EngineCore, rid: str, prompt_ids: list[int]) -> tuple[list[int], list]:
        assert core.add_request(GenerateRequest(rid, prompt_ids, params)) == []
        outs = run_to_end(core)[(rid, 0)]
        return tokens(outs), [(lp.token_id, lp.logprob, lp.top) for o in outs for lp in o.logprobs or []]

    native = dict(model=str(path), dtype="auto", cpu_kernels="native")
    want = answer(make_engine(path, **native, disable_prefix_cache=True), "alone", ids)
    core = make_engine(path, **native, chunked_prefill_size=13, max_prefill_tokens=13)
    answer(core, "first", ids[:37] + prompt(9, 32))  # leaves 37 of ids's tokens in the prefix cache
    got = answer(core, "again", ids)
    assert got == want
    assert core.stats().prefix_cache_hit_tokens_total >= 37
    assert_no_leak(core)


def test_memory_pressure_retracts_and_completes(model_dir):
    reqs = [(f"m{i}", prompt(20 + i, 200 + i), msgspec.structs.replace(GREEDY, max_tokens=24)) for i in range(8)]
    roomy = make_engine(model_dir, disable_prefix_cache=True)
    expected = {rid: alone(roomy, ids, p) for rid, ids, p in reqs}

    core = make_engine(model_dir, max_total_tokens=96, disable_prefix_cache=False)
    for rid, ids, p in reqs:
        assert core.add_request(GenerateRequest(rid, ids, p)) == []
    outs = run_to_end(core)
    for rid, _, _ in reqs:
        assert tokens(outs[(rid, 0)]) == expected[rid], rid
    assert core.stats().retractions_total > 0
    assert_no_leak(core)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_priority_policy_admits_the_best_first_and_retracts_the_worst(model_dir, policy):
    """vLLM's --scheduling-policy priority: of the waiting requests the lowest `priority` is admitted first
    (equal ones in arrival order), and when KV runs short the worst-priority running request is retracted,
    not the latest admitted; fcfs keeps arrival order and refuses a priority other than 0, naming it."""
    p = msgspec.structs.replace(GREEDY, max_tokens=3)
    core = make_engine(model_dir, scheduling_policy=policy, max_running_requests=1)
    core.add_request(GenerateRequest("first", prompt(6, 180), p))
    core.step()  # (it runs: the others queue behind it)
    for rid, prio in (("low", 5), ("high", -2), ("low2", 5), ("mid", 0)):
        out = core.add_request(GenerateRequest(rid, prompt(6, 181), msgspec.structs.replace(p, priority=prio)))
        if policy == "fcfs" and prio:
            assert out[0].error_code == ERR_INVALID and out[0].error_param == "priority", out
            assert "--scheduling-policy priority" in out[0].error
    finished = []
    while core.has_work():
        finished += [o.rid for o in core.step() if o.finish_reason is not None]
    assert finished == (["first", "high", "mid", "low", "low2"] if policy == "priority" else ["first", "mid"])
    assert_no_leak(core)
    if policy == "fcfs":
        return
    # KV for both decodes runs out: the low-priority one gives its KV back though admitted first
    small = make_engine(model_dir, scheduling_policy="priority", max_total_tokens=64, disable_prefix_cache=True)
    retracted = []
    retract = small.scheduler._retract
    small.scheduler._retract = lambda r: (retracted.append(r.rid), retract(r))
    long = msgspec.structs.replace(GREEDY, max_tokens=40)
    small.add_request(GenerateRequest("low", prompt(10, 182), msgspec.structs.replace(long, priority=1)))
    small.step()
    small.add_request(GenerateRequest("high", prompt(10, 183), msgspec.structs.replace(long, priority=0)))
    outs = run_to_end(small)
    assert retracted and set(retracted) == {"low"}, retracted
    assert tokens(outs[("high", 0)]) == alone(make_engine(model_dir), prompt(10, 183), long)
    assert_no_leak(small)
    # a better prompt part-way through its prefill keeps its KV: the worse decode gives its back, as vLLM
    # preempts the worst of all running requests (fcfs retracts the prompt part-way in first)
    small = make_engine(model_dir, scheduling_policy="priority", max_total_tokens=64, disable_prefix_cache=True,
                        chunked_prefill_size=4, max_prefill_tokens=4)
    retracted.clear()
    retract = small.scheduler._retract
    small.scheduler._retract = lambda r: (retracted.append(r.rid), retract(r))
    small.add_request(GenerateRequest("low", prompt(8, 182), msgspec.structs.replace(long, priority=5, max_tokens=45)))
    for _ in range(4):
        small.step()
    small.add_request(GenerateRequest("high", prompt(48, 183), msgspec.structs.replace(long, priority=-5, max_tokens=10)))
    finished = []
    while small.has_work():
        finished += [o.rid for o in small.step() if o.finish_reason is not None]
    assert "high" not in retracted and "low" in retracted and finished == ["high", "low"], (retracted, finished)
    assert_no_leak(small)


@pytest.mark.parametrize("stage", ["queued", "mid_prefill", "decoding"])
def test_abort_frees_everything(model_dir, stage):
    core = make_engine(model_dir, max_running_requests=1, chunked_prefill_size=8, max_prefill_tokens=8)
    core.add_request(GenerateRequest("first", prompt(30, 1), msgspec.structs.replace(GREEDY, max_tokens=50)))
    core.add_request(GenerateRequest("second", prompt(10, 2), msgspec.structs.replace(GREEDY, max_tokens=5)))
    target = {"queued": "second", "mid_prefill": "first", "decoding": "first"}[stage]
    core.step()  # first: 8 of 30 prompt tokens
    if stage == "decoding":
        for _ in range(6):
            core.step()
        assert core.scheduler.running[0].output_ids  # really decoding
    outs = core.abort(target)
    assert [o.finish_reason for o in outs] == [FINISH_ABORT]
    assert core.abort(target) == []  # idempotent
    rest = run_to_end(core)
    assert (target, 0) not in rest or not tokens(rest[(target, 0)])
    assert core.stats().aborted_total == 1
    assert_no_leak(core)


def test_the_system_fingerprint_follows_what_the_logits_depend_on(model_dir, tmp_path):
    """OpenAI's system_fingerprint: the same for the same files and settings, another for another KV dtype,
    forward or model file; the same for the same files copied elsewhere."""
    import re

    first = make_engine(model_dir).describe().fingerprint
    assert re.fullmatch(r"fp_[0-9a-f]{10}", first)
    assert make_engine(model_dir, max_running_requests=8).describe().fingerprint == first  # (no bearing on logits)
    assert make_engine(model_dir, kv_dtype="bfloat16").describe().fingerprint != first
    assert make_engine(model_dir, cpu_kernels="torch").describe().fingerprint != first
    copy = shutil.copytree(model_dir, tmp_path / "copy")  # the same files elsewhere (another host): the same value
    os.utime(next(copy.glob("*.safetensors")), ns=(1, 1))
    assert make_engine(copy).describe().fingerprint == first
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 2}))
    assert make_engine(copy).describe().fingerprint != first  # another file


def test_n_completions_share_the_prompt(model_dir):
    core = make_engine(model_dir)
    ids = prompt(40, 9)
    p = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True)
    core.add_request(GenerateRequest("n3", ids, p))
    outs = run_to_end(core)
    got = [tokens(outs[("n3", i)]) for i in range(3)]
    assert all(len(t) == 10 for t in got)
    assert len({tuple(t) for t in got}) == 3  # different completions
    assert all(outs[("n3", i)][-1].cached_tokens >= 39 for i in (1, 2))  # siblings reused the prompt KV
    # reproducible: the same seeded request again (alone) gives the same three completions
    core.add_request(GenerateRequest("again", ids, p))
    again = run_to_end(core)
    assert [tokens(again[("again", i)]) for i in range(3)] == got
    assert_no_leak(core)


def test_one_of_n_completions_can_be_ended_alone(model_dir):
    """A choice whose stop string matched (the server's call): `abort(rid, index)` ends that completion
    and frees its KV at once; its siblings go on to the tokens they would have had, and the request's
    other calls still work (a later whole abort ends only what is left)."""
    core = make_engine(model_dir)
    ids = prompt(40, 9)
    p = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    core.add_request(GenerateRequest("whole", ids, p))
    want = run_to_end(core)
    core.add_request(GenerateRequest("cut", ids, p))
    outs: dict[int, list[RequestOutput]] = {}
    for _ in range(4):
        for o in core.step():
            outs.setdefault(o.index, []).append(o)
    used = core.scheduler.kv_slots_used()
    ended = core.abort("cut", 1)
    assert [(o.index, o.finish_reason) for o in ended] == [(1, FINISH_ABORT)]
    assert core.abort("cut", 1) == []  # idempotent
    assert core.scheduler.kv_slots_used() < used and len(core.scheduler.running) == 2
    for o in ended:
        outs.setdefault(o.index, []).append(o)
    for key, more in run_to_end(core).items():
        outs.setdefault(key[1], []).extend(more)
    for i in (0, 2):
        assert tokens(outs[i]) == tokens(want[("whole", i)])
    cut = tokens(outs[1])
    assert 0 < len(cut) < 12 and cut == tokens(want[("whole", 1)])[: len(cut)]
    assert core.abort("cut") == []
    assert_no_leak(core)


def test_seeded_sampling_independent_of_batch(model_dir):
    core = make_engine(model_dir)
    ids = prompt(12, 77)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    want = alone(core, ids, p)
    core.add_request(GenerateRequest("noise1", prompt(30, 5), SamplingParams(temperature=1.3, max_tokens=20)))
    core.step()
    core.add_request(GenerateRequest("seeded", ids, p))
    core.add_request(GenerateRequest("noise2", prompt(9, 6), SamplingParams(temperature=0.7, seed=9, max_tokens=30)))
    assert tokens(run_to_end(core)[("seeded", 0)]) == want


def test_completions_of_neighbouring_seeds_are_not_shifted_copies():
    """Completion i of seed s and completion i of seed s + d used to draw the same noise d steps apart
    (their seeds were linear in s with the step's own constant): 24-71% of (s, d <= 3) pairs replayed each
    other shifted by d tokens. The engine's child seeds and the sampler's noise seeds, over 3000 seeds."""
    from engine.core import _mix_seed
    from executor.sampler import noise_seed

    shared = sum(noise_seed(_mix_seed(s, i), k) == noise_seed(_mix_seed(s + d, i), k - d)
                 for s in range(3000) for d in (1, 2, 3) for i in (1, 2, 5) for k in (4, 9))
    assert shared == 0
    children = {_mix_seed(s, i) for s in range(-50, 50) for i in range(1, 129)}
    assert len(children) == 100 * 128 and all(0 <= c < 2**63 for c in children)


def test_constraints_that_leave_nothing_to_generate(model_dir):
    """Refused when knowable at once (400 naming the parameter): bad_words banning every allowed id,
    min_tokens with only end ids allowed. Found later (a two-token bad word closing the only allowed
    id): the completion ends there with `stop` instead of emitting id 0, which nothing allowed."""
    core = make_engine(model_dir)
    eos = sorted(core.scheduler.eos_token_ids)[0]
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=(17,), max_tokens=5)
    for rid, params, param in [
        ("banned", msgspec.structs.replace(allowed, bad_words_ids=((17,),)), "bad_words"),
        ("ends", msgspec.structs.replace(allowed, allowed_token_ids=(eos,), min_tokens=2), "min_tokens"),
        ("stops", msgspec.structs.replace(allowed, allowed_token_ids=(17, 18), stop_token_ids=(18,),
                                          bad_words_ids=((17,),), min_tokens=1), "min_tokens"),
    ]:
        (o,) = core.add_request(GenerateRequest(rid, prompt(6, 1), params))
        assert o.finish_reason == FINISH_ERROR and o.error_code == ERR_INVALID and o.error_param == param, o
    for temperature in (0.0, 1.0):
        p = msgspec.structs.replace(allowed, temperature=temperature, bad_words_ids=((17, 17),), n=2, seed=3)
        assert core.add_request(GenerateRequest("later", prompt(6, 2), p)) == []
        outs = run_to_end(core)
        for i in range(2):
            assert tokens(outs[("later", i)]) == [17] and outs[("later", i)][-1].finish_reason == "stop"
    assert_no_leak(core)


def test_refusals(model_dir):
    core = make_engine(model_dir, max_running_requests=1, max_queued_requests=1, context_length=64)
    long = core.add_request(GenerateRequest("long", prompt(60, 1), SamplingParams(max_tokens=10)))
    assert long[0].finish_reason == FINISH_ERROR and long[0].error_code == ERR_CONTEXT
    bad = core.add_request(GenerateRequest("bad", [10**9], SamplingParams()))
    assert bad[0].error_code == ERR_INVALID and "vocabulary" in bad[0].error and bad[0].error_param == "prompt"
    badp = core.add_request(GenerateRequest("badp", [5], SamplingParams(top_p=1.5)))
    assert badp[0].error_code == ERR_INVALID and "top_p" in badp[0].error and badp[0].error_param == "top_p"
    empty = core.add_request(GenerateRequest("empty", [], SamplingParams()))
    assert empty[0].error_code == ERR_INVALID and empty[0].error_param == "prompt", empty
    # more completions than running + queued ever hold: never admissible, so not a retryable overload
    many = core.add_request(GenerateRequest("many", prompt(5, 4), SamplingParams(n=3)))
    assert many[0].error_code == ERR_INVALID and many[0].error_param == "n" and "n <= 2" in many[0].error
    assert core.add_request(GenerateRequest("q1", prompt(5, 1), SamplingParams(max_tokens=4))) == []
    assert core.add_request(GenerateRequest("q2", prompt(5, 2), SamplingParams(max_tokens=4))) == []
    # admitted: 1 running + 1 queued, counted before any step has moved a request to running
    over = core.add_request(GenerateRequest("q3", prompt(5, 3), SamplingParams(max_tokens=4)))
    assert over[0].error_code == ERR_OVERLOADED
    outs = run_to_end(core)
    assert set(outs) == {("q1", 0), ("q2", 0)}
    assert_no_leak(core)


def test_context_end_finishes_with_length(model_dir):
    core = make_engine(model_dir, context_length=32)
    core.add_request(GenerateRequest("c", prompt(20, 3), GREEDY))  # no max_tokens: until the context is full
    out = run_to_end(core)[("c", 0)]
    assert out[-1].finish_reason == FINISH_LENGTH and out[-1].completion_tokens == 12
    assert_no_leak(core)


def test_prompt_logprobs_equal_log_softmax_of_full_prefill(model_dir):
    """Prompt scoring (echo + logprobs): each prompt token's logprob under the model, also when the
    prompt is prefilled in chunks and another request shares the batch; max_tokens 0 generates nothing."""
    from models.loader.load import load_model
    from executor.model_runner import ModelRunner, RequestSlice

    ids = prompt(41, 55)
    loaded = load_model(model_dir, dtype="float32", load_tokenizer=False, progress=False)
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=256, max_running_requests=2)
    row = runner.req_to_token_pool.alloc()
    full = torch.log_softmax(runner.forward(runner.build_batch([RequestSlice(row, 0, ids)], all_logits=True)), -1)
    want = [None] + [float(full[i, ids[i + 1]]) for i in range(len(ids) - 1)]

    core = make_engine(model_dir, chunked_prefill_size=16, max_prefill_tokens=16)
    alone(core, ids[:30], msgspec.structs.replace(GREEDY, max_tokens=3))  # its prefix is cached: must not be used
    core.add_request(GenerateRequest("other", prompt(9, 1), msgspec.structs.replace(GREEDY, max_tokens=20)))
    core.add_request(GenerateRequest("score", ids, SamplingParams(max_tokens=0, prompt_logprobs=2)))
    outs = run_to_end(core)[("score", 0)]
    assert tokens(outs) == [] and outs[-1].finish_reason == FINISH_LENGTH
    got = next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
    assert len(got) == len(ids) and got[0] is None
    assert [g.token_id for g in got[1:]] == ids[1:]
    assert max(abs(g.logprob - w) for g, w in zip(got[1:], want[1:])) < 1e-4
    assert all(len(g.top) == 2 and g.top[0][1] >= g.logprob - 1e-6 for g in got[1:])
    assert_no_leak(core)
    # n = 2: the second completion waits for the first's prompt, and must be let go when it only scored it (the
    # first alone scores it: the server answers every choice with the one list)
    core.add_request(GenerateRequest("score2", ids, SamplingParams(max_tokens=0, prompt_logprobs=2, n=2)))
    outs = run_to_end(core)
    for i in (0, 1):
        assert tokens(outs[("score2", i)]) == [] and outs[("score2", i)][-1].finish_reason == FINISH_LENGTH
    again = next(o.prompt_logprobs for o in outs[("score2", 0)] if o.prompt_logprobs)
    assert max(abs(g.logprob - w) for g, w in zip(again[1:], want[1:])) < 1e-4
    assert not any(o.prompt_logprobs for o in outs[("score2", 1)])
    assert_no_leak(core)


def test_a_prompt_scored_that_fills_the_pool_exactly(model_dir):
    """max_tokens 0 needs as many slots as the prompt: one that fills the KV pool exactly (a pool of the
    context's size, the default with --max-running-requests 1) is scored, n=1 and n=2 (it ended with no
    logprobs at all, and n=2 waited for ever)."""
    core = make_engine(model_dir, max_total_tokens=64, context_length=64, max_running_requests=1)
    assert core.runner.allocator.num_slots == 64
    ids = prompt(64, 56)
    for n in (1, 2):
        core.add_request(GenerateRequest(f"full{n}", ids, SamplingParams(max_tokens=0, prompt_logprobs=1, n=n)))
        outs = run_to_end(core, max_steps=200)
        for i in range(n):  # (completion 0 alone scores the prompt: n_completions_score_the_prompt_once)
            got = next((o.prompt_logprobs for o in outs[(f"full{n}", i)] if o.prompt_logprobs), None)
            assert i > 0 or (got is not None and len(got) == 64 and [g.token_id for g in got[1:]] == ids[1:]), (n, i)
            assert i == 0 or got is None
            assert outs[(f"full{n}", i)][-1].finish_reason == FINISH_LENGTH
        assert_no_leak(core)


def test_torch_mla_numbers_do_not_depend_on_chunks_batch_or_cache(tmp_path):
    """The torch model's MLA on a CPU with a bf16 KV cache (fp32 weights): a prompt's logprobs and greedy
    tokens are the same prefilled whole or in chunks of 16, alone or beside a decoding request, and after
    a cache hit (they moved by up to 0.6 logprob: one batch took the normal path on the unrounded latent,
    another the absorbed path on the pool's bf16 copy)."""
    path = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=12)
    ids = prompt(70, 57)
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, prompt_logprobs=1)

    def run(chunk: int, beside: bool, cached: bool) -> tuple[list[int], list[float]]:
        core = make_engine(path, cpu_kernels="torch", kv_dtype="bfloat16", chunked_prefill_size=chunk,
                           max_prefill_tokens=chunk)
        if cached:
            alone(core, ids[:40], msgspec.structs.replace(p, max_tokens=1))
        if beside:
            core.add_request(GenerateRequest("other", prompt(9, 3), msgspec.structs.replace(GREEDY, max_tokens=40)))
            core.step()
        core.add_request(GenerateRequest("r", ids, p))
        outs = run_to_end(core)[("r", 0)]
        scored = next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
        return tokens(outs), [g.logprob for g in scored[1:]]

    want_tokens, want = run(512, False, False)
    for chunk, beside, cached in [(16, False, False), (512, True, False), (512, False, True), (16, True, True)]:
        got_tokens, got = run(chunk, beside, cached)
        assert got_tokens == want_tokens, (chunk, beside, cached)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (chunk, beside, cached)


def test_the_rotary_tables_cover_the_served_context(model_dir):
    """The model's rotary tables are sized to the context the engine serves (the config's own may be a
    million positions), before the runner hands them to the native forward."""
    from models.rotary import RotaryEmbedding

    core = make_engine(model_dir, context_length=100)
    tables = [m.cos_sin_cache.shape[1] for m in core.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and set(tables) == {100}
    ids = prompt(90, 7)
    assert len(alone(core, ids, msgspec.structs.replace(GREEDY, max_tokens=10))) == 10  # up to position 99


@pytest.mark.parametrize("budget", [128, 192])
def test_prompts_part_way_in_never_hold_the_pool_for_good(model_dir, budget):
    """Chunked prefill of several long prompts at once can fill the KV pool with prompts none of which can
    go on (the engine then spun with nothing to run, every request hung): the newest give their KV back
    and the oldest moves; every request ends with the tokens it gets alone."""
    p = msgspec.structs.replace(GREEDY, max_tokens=40)
    reqs = [(f"p{i}", prompt(200, 300 + i), p) for i in range(3)]
    roomy = make_engine(model_dir, disable_prefix_cache=True)
    expected = {rid: alone(roomy, ids, q) for rid, ids, q in reqs}
    core = make_engine(model_dir, max_total_tokens=300, chunked_prefill_size=64, max_prefill_tokens=budget)
    for rid, ids, q in reqs:
        assert core.add_request(GenerateRequest(rid, ids, q)) == []
    outs = run_to_end(core, max_steps=2000)
    for rid, _, _ in reqs:
        assert tokens(outs[(rid, 0)]) == expected[rid], rid
    assert core.stats().retractions_total > 0
    assert_no_leak(core)


def test_end_ids_outside_the_vocabulary_are_ignored(tmp_path, caplog):
    """A config naming an end id past the LM head (a tokenizer larger than the model) is served: the id
    can never be sampled, and masking it for min_tokens once took the whole engine down."""
    import json

    d = write_checkpoint(tmp_path / "m", "tiny-llama", seed=5)
    cfg = json.loads((d / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg["eos_token_id"]
    cfg["eos_token_id"] = [eos, vocab, vocab + 1000]
    (d / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        core = make_engine(d)
    assert f"[{vocab}, {vocab + 1000}] are outside the model's vocabulary" in caplog.text
    assert core.scheduler.eos_token_ids and max(core.scheduler.eos_token_ids) < vocab
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3)
    assert core.add_request(GenerateRequest("r", prompt(5, 1, vocab), params)) == []
    outs = run_to_end(core)[("r", 0)]
    assert outs[-1].finish_reason != FINISH_ERROR and len(tokens(outs)) >= 3
    assert_no_leak(core)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "tiny-llama"])
def test_building_the_engine_imports_neither_dynamo_nor_sympy(preset, tmp_path):
    """The loader builds the model on the meta device, where torch runs some ops (nn.Embedding's init,
    arange, empty_like) through its Python references, whose first call imports torch._dynamo (and sympy):
    4 s of every engine, rank and `mlaserve generate` start on a 2-core machine, for tensors that the
    checkpoint overwrites. A fresh process builds an engine and serves a request without them."""
    model = write_checkpoint(tmp_path / preset, preset, seed=5)
    code = f"""
import sys
from engine.args import EngineArgs
from engine.core import EngineCore
from engine.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
core = EngineCore(EngineArgs(model={str(model)!r}, max_total_tokens=1024))
core.add_request(GenerateRequest("a", list(range(5, 40)), SamplingParams(max_tokens=4)))
while core.has_work():
    core.step()
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
