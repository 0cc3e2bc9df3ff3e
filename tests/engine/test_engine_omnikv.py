"""OmniKV through the engine core: the server default and the per-request choice, counters, and the
engine's guarantees kept under sparse decode (a request's tokens do not depend on what shares its
batch, the prefix cache shares prompts, retraction recomputes, nothing leaks)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

import configs
from engine.args import EngineArgs
from engine.core import EngineCore
from engine.messages import GenerateRequest
from models.omnikv_config import OmniKVConfig
from models.synthetic import write_checkpoint
from scheduler.sampling_params import SamplingParams
from tests.engine.test_engine_core import assert_no_leak, prompt, run_to_end, tokens

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
KERNELS = ["torch", "native"]


@pytest.fixture(scope="module", params=["tiny-deepseek-v3", "tiny-llama"])
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5, num_layers=6)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("omnikv") / "omnikv.json"
    OmniKVConfig(filter_layers=(1, 3), budget_tokens=8, sink_tokens=2, recent_tokens=4, min_context=40).save(path)
    return str(path)


def make_engine(model_dir, config_file, cpu_kernels, **kw) -> EngineCore:
    args = dict(model=str(model_dir), dtype="float32", max_total_tokens=4096, max_running_requests=16,
                chunked_prefill_size=64, max_prefill_tokens=256, omnikv_config=config_file, cpu_kernels=cpu_kernels)
    args.update(kw)
    return EngineCore(EngineArgs(**args))


def generate(core: EngineCore, reqs) -> dict[str, list[int]]:
    for rid, ids, p in reqs:
        assert core.add_request(GenerateRequest(rid, ids, p)) == []
    outs = run_to_end(core)
    return {rid: tokens(outs[(rid, 0)]) for rid, _, _ in reqs}


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_server_default_and_request_choice(model_dir, config_file, cpu_kernels):
    ids = prompt(50, 7)
    full = generate(make_engine(model_dir, config_file, cpu_kernels, omnikv="off"), [("a", ids, GREEDY)])["a"]
    for mode, choice, sparse in [("off", None, False), ("off", True, True), ("on", None, True), ("on", False, False),
                                 ("auto", None, True)]:
        core = make_engine(model_dir, config_file, cpu_kernels, omnikv=mode)
        got = generate(core, [("a", ids, msgspec.structs.replace(GREEDY, omnikv=choice))])["a"]
        stats = core.stats()
        assert (stats.omnikv_sparse_tokens_total > 0) == sparse, (mode, choice)
        if sparse:  # a context of 50..61 keeps 2 + 8 + 4 tokens per filter layer
            assert stats.omnikv_sparse_tokens_total == 11
            assert stats.omnikv_selected_tokens_total == 2 * 11 * 14
            assert stats.omnikv_context_tokens_total == 2 * sum(range(51, 62))
        else:
            assert got == full
        assert_no_leak(core)


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_a_prompts_last_token_is_prefilled_with_full_attention(model_dir, config_file, cpu_kernels):
    """A prompt's chunks can leave its last token alone (65 tokens in chunks of 64): that token is
    prefill, computed with full attention like the rest, so the first token and its logprob do not depend
    on the chunks (it went through sparse attention as if decoded: another first logprob, a sparse
    token counted)."""
    ids = prompt(65, 9)
    params = msgspec.structs.replace(GREEDY, omnikv=True, max_tokens=3, logprobs=True)

    def first(**kw) -> tuple[tuple[int, float], int]:
        core = make_engine(model_dir, config_file, cpu_kernels, **kw)
        assert core.add_request(GenerateRequest("a", ids, params)) == []
        outs = run_to_end(core)[("a", 0)]
        lp = next(lp for o in outs for lp in o.logprobs or [])
        return (lp.token_id, lp.logprob), core.stats().omnikv_sparse_tokens_total

    (want, sparse), (got, cut_sparse) = first(chunked_prefill_size=512), first(chunked_prefill_size=64)
    assert sparse == cut_sparse == 2  # the 2 tokens decoded after the first
    assert got[0] == want[0]  # the native forward: bit for bit; the torch one sums chunks in another order
    assert got[1] == want[1] if cpu_kernels == "native" else abs(got[1] - want[1]) < 1e-4, (got, want)


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_auto_waits_for_min_context(model_dir, config_file, cpu_kernels):
    core = make_engine(model_dir, config_file, cpu_kernels, omnikv="auto")
    generate(core, [("short", prompt(20, 3), GREEDY)])  # 20..31 tokens: below min_context 40
    assert core.stats().omnikv_sparse_tokens_total == 0


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_sparse_decode_batched_shared_and_retracted(model_dir, config_file, cpu_kernels):
    """Each request alone, then all at once with shared prompts (n = 2 and a repeated prompt): the same
    tokens. In a pool small enough to retract, every request still completes and nothing leaks (a
    retracted request's generated tokens are recomputed by a full-attention prefill, so its later
    tokens may differ from an uninterrupted sparse decode)."""
    p = msgspec.structs.replace(GREEDY, max_tokens=16, omnikv=True)
    shared = prompt(45, 99)
    reqs = [(f"r{i}", prompt(30 + 5 * i, 200 + i), p) for i in range(5)] + [("s0", shared, p), ("s1", shared, p)]
    roomy = make_engine(model_dir, config_file, cpu_kernels, disable_prefix_cache=True)
    expected = {rid: generate(roomy, [(rid, ids, q)])[rid] for rid, ids, q in reqs}
    assert roomy.stats().omnikv_sparse_tokens_total > 0

    core = make_engine(model_dir, config_file, cpu_kernels)
    assert generate(core, reqs) == expected
    assert_no_leak(core)
    assert core.add_request(GenerateRequest("n2", shared, msgspec.structs.replace(p, n=2))) == []
    outs = run_to_end(core)  # the prompt comes from the cache: s0 and s1 left it there
    assert tokens(outs[("n2", 0)]) == tokens(outs[("n2", 1)]) == expected["s0"]
    assert core.stats().prefix_cache_hit_tokens_total >= 44
    assert_no_leak(core)

    tight = make_engine(model_dir, config_file, cpu_kernels, max_total_tokens=200)
    got = generate(tight, reqs)
    assert tight.stats().retractions_total > 0
    assert all(len(t) == 16 for t in got.values())
    assert_no_leak(tight)


def test_context_bank_through_the_engine(model_dir, config_file):
    """--omnikv-bank (the torch forward: the GPU host's path, in host memory): the tokens of the run without
    a bank, with shared prompts, n = 2 and retraction; nothing leaks; its gauges and counters move. With
    the native CPU forward it is off: nothing has to move on a CPU host."""
    p = msgspec.structs.replace(GREEDY, max_tokens=14, omnikv=True)
    shared = prompt(45, 99)
    reqs = [(f"r{i}", prompt(32 + 6 * i, 300 + i), p) for i in range(4)] + [("s0", shared, p), ("s1", shared, p)]
    plain = make_engine(model_dir, config_file, "torch", disable_prefix_cache=True)
    expected = {rid: generate(plain, [(rid, ids, q)])[rid] for rid, ids, q in reqs}

    core = make_engine(model_dir, config_file, "torch", omnikv_bank=True)
    bank = core.runner.context_bank
    assert bank is not None and sorted(core.runner.kv_pool.host_layers) == bank.layers()
    assert generate(core, reqs) == expected
    stats = core.stats()
    assert stats.omnikv_bank_gathered_bytes_total == bank.bytes_gathered > 0
    assert stats.omnikv_bank_host_bytes == stats.kv_slots_used * core.runner.kv_pool.host_bytes_per_token()
    assert_no_leak(core)
    assert core.add_request(GenerateRequest("n2", shared, msgspec.structs.replace(p, n=2))) == []
    outs = run_to_end(core)
    assert tokens(outs[("n2", 0)]) == tokens(outs[("n2", 1)]) == expected["s0"]
    assert_no_leak(core)

    tight = make_engine(model_dir, config_file, "torch", omnikv_bank=True, max_total_tokens=200)
    got = generate(tight, reqs)
    assert tight.stats().retractions_total > 0 and all(len(t) == 14 for t in got.values())
    assert_no_leak(tight)

    native = make_engine(model_dir, config_file, "native", omnikv_bank=True)
    assert native.runner.context_bank is None and not native.runner.kv_pool.host_layers


def test_the_bank_host_share_is_divided_among_the_processes_of_the_host(model_dir, tmp_path, monkeypatch):
    """At most half the host memory goes to the banks of all the engine processes on the host: each of N --dp
    replicas (`host_peers`, set by the server) sizes its slots by 1/N of it (under --tp, each rank of the
    node too). It was each process half the host: N/2 of it in all."""
    import engine.core

    config_file = tmp_path / "omnikv.json"  # every layer after the first sparse: most of a token's KV banked
    OmniKVConfig(filter_layers=(0,), full_after_filter=False, budget_tokens=8).save(config_file)
    monkeypatch.setattr(engine.core, "available_memory", lambda device: 64 << 20)  # the bank's cap binds
    kw = dict(omnikv_bank=True, max_running_requests=64, mem_fraction=0.5, max_total_tokens=0, context_length=1024)
    one = make_engine(model_dir, config_file, "torch", **kw)
    two = make_engine(model_dir, config_file, "torch", host_peers=2, **kw)
    host = one.runner.kv_pool.host_bytes_per_token()
    assert host > 0 and two.runner.kv_pool.host_bytes_per_token() == host
    assert one.runner.allocator.num_slots == (64 << 20) // 2 // host
    assert two.runner.allocator.num_slots == (64 << 20) // 4 // host


def test_a_config_that_does_not_fit_the_model_is_refused(model_dir, tmp_path):
    path = tmp_path / "far.json"
    OmniKVConfig(filter_layers=(2, 9)).save(path)
    with pytest.raises(ValueError, match="outside the model's 6 layers"):
        EngineCore(EngineArgs(model=str(model_dir), dtype="float32", max_total_tokens=256, omnikv_config=str(path)))


def test_a_config_that_does_not_fit_is_refused_before_the_model_loads(model_dir, tmp_path):
    """`serve` reads the depth from the config.json or GGUF header: one line, exit 2, before the weights load
    (it used to be three ERROR lines and exit 1 after them)."""
    import subprocess
    import sys

    from models.loader.gguf_writer import write_gguf
    from server.args import omnikv_problem
    from tests.server.server_process import REPO, free_port

    path = tmp_path / "far.json"
    OmniKVConfig(filter_layers=(2, 9)).save(path)
    write_gguf(model_dir, tmp_path / "model.gguf", "Q8_0")
    for model in (str(model_dir), str(tmp_path / "model.gguf")):
        assert "outside the model's 6 layers" in omnikv_problem(model, str(path))
        assert omnikv_problem(model, None) is None
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--model", str(model_dir), "--omnikv-config",
                        str(path), "--port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "outside the model's 6 layers" in r.stderr and str(path) in r.stderr, r.stderr


def test_shipped_or_default_config_is_used_without_a_file(model_dir, tmp_path):
    cfg, origin = OmniKVConfig.for_model(str(model_dir), 6)
    assert cfg.filter_layers == (1, 3) and "uncalibrated" in origin
    # the default model's shipped config, named or by its file's path (it was the uncalibrated default by path)
    from models.builtin import builtin_model_path

    shipped = OmniKVConfig.load(Path(configs.__file__).parent / "omnikv" / "smollm2-135m-instruct.json")
    for model in ("smollm2-135m-instruct", str(builtin_model_path("smollm2-135m-instruct"))):
        cfg, origin = OmniKVConfig.for_model(model, 30)
        assert cfg == shipped and origin == "calibrated for smollm2-135m-instruct (shipped)", model
    # a path is never looked up among the shipped configs (a model at /x/m took /x/m.json for one)
    OmniKVConfig(filter_layers=(2,)).save(tmp_path / "m.json")
    (tmp_path / "m").mkdir()
    assert "uncalibrated" in OmniKVConfig.for_model(str(tmp_path / "m"), 6)[1]


def test_filter_layers_at_the_top_count_no_sparse_tokens(model_dir, tmp_path, caplog):
    """A config whose filter layers leave no layer to decode sparsely (6 layers: a filter at 4 and the full
    layer after it) changes nothing: the engine says so at start, the tokens are full attention's, and the
    metrics count no sparse token (they used to count each decode token as one)."""
    path = tmp_path / "top.json"
    OmniKVConfig(filter_layers=(4,), budget_tokens=8, sink_tokens=2, recent_tokens=4, min_context=40).save(path)
    ids = prompt(50, 7)
    full = generate(make_engine(model_dir, str(path), "native", omnikv="off"), [("a", ids, GREEDY)])["a"]
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        core = make_engine(model_dir, str(path), "native", omnikv="on")
    assert "leave no layer of the 6 to decode sparsely" in caplog.text
    assert generate(core, [("a", ids, GREEDY)])["a"] == full
    stats = core.stats()
    assert stats.omnikv_sparse_tokens_total == stats.omnikv_selected_tokens_total == 0
    assert stats.omnikv_context_tokens_total == 0
    assert_no_leak(core)


def test_a_config_of_another_model_or_a_whole_budget_is_warned_of(model_dir, tmp_path, caplog):
    """A config calibrated on another model starts (its layers fit) but says so; a budget_ratio of 1 keeps every
    token (no step is sparse), which the engine says too. A config calibrated on this model says neither."""
    other = tmp_path / "other.json"
    OmniKVConfig(filter_layers=(1, 3), budget_ratio=1.0, calibration={"model": "some-other-model"}).save(other)
    mine = tmp_path / "mine.json"
    OmniKVConfig(filter_layers=(1, 3), calibration={"model": model_dir.name}).save(mine)
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(model_dir, str(other), "native", omnikv="on")
    assert f"was calibrated on some-other-model, not on {model_dir.name}" in caplog.text
    assert "keeps every token, so no decode step is sparse" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(model_dir, str(mine), "native", omnikv="on")
    assert "calibrated on" not in caplog.text and "keeps every token" not in caplog.text


def test_a_model_too_shallow_for_a_sparse_layer_gets_advice_it_can_follow(model_dir, tmp_path, caplog, request):
    """On a 2-layer model no filter layer leaves a layer to decode sparsely while the layer after a filter runs
    full: the warning says what a model needs rather than to choose earlier filter layers (there are none);
    with full_after_filter off, a filter at 0 leaves layer 1 sparse and the warning is gone."""
    shallow = write_checkpoint(tmp_path / "shallow", request.node.callspec.params["model_dir"], seed=5, num_layers=2)
    path = tmp_path / "shallow.json"
    OmniKVConfig(filter_layers=(0,), budget_tokens=8, sink_tokens=2, recent_tokens=4).save(path)
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(shallow, str(path), "native", omnikv="on")
    assert "leave no layer of the 2 to decode sparsely" in caplog.text
    assert "a model needs a filter layer, the full layer after it (full_after_filter), then a layer" in caplog.text
    assert "choose earlier filter layers" not in caplog.text
    caplog.clear()
    OmniKVConfig(filter_layers=(0,), budget_tokens=8, sink_tokens=2, recent_tokens=4,
                 full_after_filter=False).save(path)
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(shallow, str(path), "native", omnikv="on")
    assert "decode sparsely" not in caplog.text


def test_a_budget_count_past_the_context_is_warned_of(model_dir, tmp_path, caplog):
    """budget_tokens with the sink and recent tokens covering the longest context keeps every token at every
    step: the engine says so at start, with the count that would be sparse; one just under it says nothing.
    So does an auto mode whose min_context is past the context."""
    path = tmp_path / "big.json"
    OmniKVConfig(filter_layers=(1, 3), budget_tokens=500, sink_tokens=4, recent_tokens=8).save(path)
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(model_dir, str(path), "native", omnikv="on", context_length=512)
    assert "budget_tokens 500 with 4 sink and 8 recent tokens keeps every token of the longest context (512)" \
        in caplog.text
    assert "give budget_tokens of at most 499" in caplog.text
    caplog.clear()
    OmniKVConfig(filter_layers=(1, 3), budget_tokens=499, sink_tokens=4, recent_tokens=8).save(path)
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(model_dir, str(path), "native", omnikv="on", context_length=512)
    assert "keeps every token" not in caplog.text
    # the context the KV cache leaves (--max-total-tokens below it) is the one checked: it was the longer one,
    # and a budget past the shorter context went unwarned (a helper found it)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlaserve.engine"):
        make_engine(model_dir, str(path), "native", omnikv="on", context_length=512, max_total_tokens=480)
    assert "context length 512 is cut to 480" in caplog.text
    assert "keeps every token of the longest context (480)" in caplog.text and "at most 467" in caplog.text
    # --omnikv auto from past the longest context never turns on
    caplog.clear()
    OmniKVConfig(filter_layers=(1, 3), budget_tokens=64, min_context=600).save(path)
    for mode, warned in (("auto", True), ("on", False)):
        with caplog.at_level("WARNING", logger="mlaserve.engine"):
            make_engine(model_dir, str(path), "native", omnikv=mode, context_length=512)
        assert ("turns it on from 600 tokens, past the longest context (512): it never turns on" in caplog.text) \
            == warned, mode
        caplog.clear()


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_kv_of_sparse_decode_steps_is_not_shared_by_the_prefix_cache(model_dir, config_file, cpu_kernels):
    """A chat's next turn sends the last reply back in its prompt. The KV of tokens OmniKV decoded sparsely is
    not what a full-attention prefill computes, and the prefix cache gave it to the next prompt: a request
    asking for full attention got other logprobs after a sparse one than on a fresh engine (a helper saw
    -1.084 against -0.964). The prompt's KV is still shared; the reply's is recomputed."""
    ids = prompt(60, 13)
    sparse = msgspec.structs.replace(GREEDY, omnikv=True, max_tokens=6)
    full = msgspec.structs.replace(GREEDY, omnikv=False, max_tokens=3, logprobs=True)

    def follow_up(core: EngineCore, reply: list[int]) -> tuple[list[tuple[int, float]], int]:
        assert core.add_request(GenerateRequest("b", ids + reply[:4], full)) == []
        outs = run_to_end(core)[("b", 0)]
        return [(lp.token_id, lp.logprob) for o in outs for lp in o.logprobs or []], outs[0].cached_tokens

    core = make_engine(model_dir, config_file, cpu_kernels)
    reply = generate(core, [("a", ids, sparse)])["a"]
    assert core.stats().omnikv_sparse_tokens_total > 0
    after, cached = follow_up(core, reply)
    fresh, fresh_cached = follow_up(make_engine(model_dir, config_file, cpu_kernels), reply)
    assert fresh_cached == 0 and cached == len(ids)  # the prompt's rows shared, the reply's not
    assert [t for t, _ in after] == [t for t, _ in fresh]
    # the native forward: bit for bit; the torch one sums a prompt cut at another place in another order
    tolerance = 0.0 if cpu_kernels == "native" else 1e-5
    assert all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(after, fresh)), (after, fresh)
    assert_no_leak(core)


def test_a_reply_omnikv_cut_nothing_from_is_shared(model_dir, tmp_path):
    """A config whose plan leaves no layer sparse (a filter at 4 of 6 layers and the full layer after it)
    decodes with full attention: its reply's KV is shared by the prefix cache as any other's."""
    path = tmp_path / "top.json"
    OmniKVConfig(filter_layers=(4,), budget_tokens=8, sink_tokens=2, recent_tokens=4, min_context=40).save(path)
    core = make_engine(model_dir, str(path), "native", omnikv="on")
    ids = prompt(60, 14)
    reply = generate(core, [("a", ids, msgspec.structs.replace(GREEDY, max_tokens=6))])["a"]
    assert core.add_request(GenerateRequest("b", ids + reply[:4], msgspec.structs.replace(GREEDY, max_tokens=1))) == []
    outs = run_to_end(core)[("b", 0)]
    assert outs[0].cached_tokens == len(ids) + 4 - 1  # all but the last token, which is computed for its logits
    assert_no_leak(core)
