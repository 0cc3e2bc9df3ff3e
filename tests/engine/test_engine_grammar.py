"""Constrained requests in the engine core: grammars compile beside the step loop (a slow one holds
back only its own request), each completion keeps its own matcher, and refusals and aborts while
compiling end cleanly."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future

import pytest

from engine.messages import ERR_INVALID, FINISH_ABORT, FINISH_ERROR, GenerateRequest
from scheduler.sampling_params import SamplingParams, StructuredOutput
from tests.engine.test_engine_core import assert_no_leak, make_engine, model_dir, prompt, run_to_end, tokens  # noqa: F401

pytest.importorskip("xgrammar")

REGEX = r"(alpha|beta)-[0-9]{2,4};"


@pytest.fixture(scope="module")
def core(model_dir):  # noqa: F811
    return make_engine(model_dir)


def text_of(core, ids: list[int]) -> str:
    return core.grammars._tokenizer.decode(ids, skip_special_tokens=True)


def delayed(core, until: threading.Event, limit: float = 60.0):
    """core.grammars.submit whose grammars arrive only once `until` is set (a slow compile), or fail
    after `limit` s; returns the real one."""
    real = core.grammars.submit

    def submit(*a):
        inner, outer = real(*a), Future()

        def later() -> None:
            held = not until.wait(limit)  # the engine waited for this compile: the request ends in an error
            if not outer.set_running_or_notify_cancel():  # aborted meanwhile
                inner.cancel()
                return
            if held:
                outer.set_exception(RuntimeError(f"the grammar was held for {limit} s"))
                return
            try:
                outer.set_result(inner.result())
            except Exception as e:
                outer.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        return outer

    core.grammars.submit = submit
    return real


def test_slow_compile_does_not_stall_other_requests(core):
    """A grammar that compiles until the plain request added with it has run to its end (or 60 s): the
    plain one ends first, then the constrained one follows its grammar."""
    plain_done = threading.Event()
    real = delayed(core, plain_done)
    try:
        constrained = SamplingParams(temperature=0.9, seed=4, max_tokens=40, structured=StructuredOutput("regex", REGEX, "regex"))
        assert core.add_request(GenerateRequest("slow", prompt(9, 1), constrained)) == []
        assert core.add_request(GenerateRequest("plain", prompt(7, 2), SamplingParams(temperature=0.0, ignore_eos=True,
                                                                                      max_tokens=24))) == []
        outs: dict = {}
        order = []
        while core.has_work():
            for o in core.step():
                outs.setdefault((o.rid, o.index), []).append(o)
                if o.finish_reason:
                    order.append(o.rid)
                    plain_done.set()
        assert order == ["plain", "slow"]
        assert len(tokens(outs[("plain", 0)])) == 24
        final = outs[("slow", 0)][-1]
        assert final.finish_reason == "stop"
        assert re.fullmatch(REGEX, text_of(core, tokens(outs[("slow", 0)])))
    finally:
        core.grammars.submit = real
    assert_no_leak(core)


def test_each_completion_follows_the_grammar(core):
    p = SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=40, structured=StructuredOutput("regex", REGEX, "regex"))
    assert core.add_request(GenerateRequest("n4", prompt(12, 3), p)) == []
    outs = run_to_end(core)
    texts = {text_of(core, tokens(outs[("n4", i)])) for i in range(4)}
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(texts) > 1  # four matchers, four different documents
    assert_no_leak(core)


def test_a_grammar_that_does_not_compile_is_refused_naming_its_param(core):
    p = SamplingParams(structured=StructuredOutput("grammar", "root ::= missing_rule", "ebnf"), max_tokens=5)
    assert core.add_request(GenerateRequest("bad", prompt(5, 4), p)) == []
    outs = run_to_end(core)
    (o,) = outs[("bad", 0)]
    assert o.finish_reason == FINISH_ERROR and o.error_code == ERR_INVALID and o.error_param == "ebnf"
    assert "missing_rule" in o.error
    assert_no_leak(core)


def test_abort_while_compiling(core):
    real = delayed(core, threading.Event())
    try:
        p = SamplingParams(n=2, max_tokens=5, structured=StructuredOutput("regex", REGEX, "regex"))
        assert core.add_request(GenerateRequest("gone", prompt(5, 5), p)) == []
        assert core.stats().num_waiting == 2  # waiting for their grammar: /metrics showed none
        outs = core.abort("gone")
        assert sorted((o.index, o.finish_reason) for o in outs) == [(0, FINISH_ABORT), (1, FINISH_ABORT)]
        assert not core.has_work()
    finally:
        core.grammars.submit = real
    assert_no_leak(core)


def test_a_failing_grammar_engine_ends_only_its_request(core):
    """The grammar engine itself failing (a tokenizer it cannot read, or a crash while compiling) ends
    that request with an error; the engine and the other requests go on."""
    import xgrammar as xgr

    from executor.grammar import GrammarBackend

    real = core.grammars
    broken = GrammarBackend(real._tokenizer, real.vocab_size, real._stop_ids)
    broken._build_tokenizer_info = lambda: (_ for _ in ()).throw(ValueError("no vocabulary"))
    p = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", REGEX, "regex"))
    plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    try:
        core.grammars = broken
        assert core.add_request(GenerateRequest("no-vocab", prompt(5, 6), p)) == []
        outs = run_to_end(core)
        (o,) = outs[("no-vocab", 0)]
        assert o.error_code == ERR_INVALID and o.error_param == "regex" and "not available" in o.error
    finally:
        core.grammars = real
        broken.shutdown()
    real_read = xgr.CompiledGrammar.deserialize_json
    try:  # a compiled grammar the engine cannot read
        xgr.CompiledGrammar.deserialize_json = staticmethod(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        crash = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[0-9]{3}x", "regex"))
        assert core.add_request(GenerateRequest("crash", prompt(5, 7), crash)) == []
        assert core.add_request(GenerateRequest("fine", prompt(5, 8), plain)) == []
        outs = run_to_end(core)
        (o,) = outs[("crash", 0)]
        assert o.finish_reason == FINISH_ERROR and o.error_code == "engine_error" and "boom" in o.error
        assert len(tokens(outs[("fine", 0)])) == 6
    finally:
        xgr.CompiledGrammar.deserialize_json = real_read
    assert_no_leak(core)


def test_a_grammar_that_allowed_token_ids_cannot_start_ends_without_a_token(core):
    """response_format's grammar and allowed_token_ids with no token in common (the regex starts with a
    letter, only digits are allowed): each of n=2 completions ends at once with `stop` and no token (it
    was id 0, which neither allows), the sibling waiting for the prompt is not left waiting, and nothing
    leaks."""
    tok = core.grammars._tokenizer
    digits = tuple(sorted({i for d in "0123456789" for i in tok.encode(d, add_special_tokens=False).ids}))
    p = SamplingParams(temperature=1.0, n=2, seed=4, max_tokens=8, allowed_token_ids=digits,
                       structured=StructuredOutput("regex", REGEX, "regex"))
    assert core.add_request(GenerateRequest("never", prompt(7, 9), p)) == []
    outs = run_to_end(core)
    for i in range(2):
        assert tokens(outs[("never", i)]) == [] and outs[("never", i)][-1].finish_reason == "stop"
    assert_no_leak(core)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_with_a_dead_end_ends_there_without_a_token(core, temperature, caplog):
    """A grammar that allows nothing after its first word (its other rule only refers to itself): the
    completion ends there with `stop` and that word. Greedy, the masked argmax of all -inf was id 0, which
    the grammar refused: it was kept as the output's last token and an ERROR logged."""
    p = SamplingParams(temperature=temperature, seed=5, max_tokens=12,
                       structured=StructuredOutput("grammar", 'root ::= "alpha" x\nx ::= x', "guided_grammar"))
    assert core.add_request(GenerateRequest("dead", prompt(6, 10), p)) == []
    with caplog.at_level("WARNING"):
        outs = run_to_end(core)
    assert text_of(core, tokens(outs[("dead", 0)])) == "alpha" and outs[("dead", 0)][-1].finish_reason == "stop"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert_no_leak(core)


def test_an_admission_comes_before_the_step_that_runs_the_request(core):
    """A stream's headers go with its admission: the core reports it alone, from the step that finds the
    grammar compiled, before the step that runs the request's first prefill chunk (which may be long);
    a plain request's comes from add_request. Neither holds tokens, and the request then runs as ever."""
    structured = SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutput("regex", REGEX, "regex"))
    assert core.add_request(GenerateRequest("told", prompt(9, 5), structured, report_admission=True)) == []
    forwards = core.runner.forward_count
    outs = []
    while not outs:
        outs = core.step()
    assert [(o.rid, o.admitted, o.new_token_ids) for o in outs] == [("told", True, [])]
    assert core.runner.forward_count == forwards  # nothing of the request ran yet
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    (admitted,) = core.add_request(GenerateRequest("plain", prompt(7, 6), plain, report_admission=True))
    assert admitted.admitted and admitted.rid == "plain" and not admitted.new_token_ids
    done = run_to_end(core)
    assert re.fullmatch(REGEX, text_of(core, tokens(done[("told", 0)])))
    assert len(tokens(done[("plain", 0)])) == 3 and not any(o.admitted for outs in done.values() for o in outs)
    assert_no_leak(core)
