"""Speculative decoding (--speculative-config, scheduler/speculative.py) in the engine core, on tiny synthetic
models: whatever the drafts, a completion gets the tokens and logprobs it gets without them (the oracle: the
same engine with speculation off, itself checked against HF transformers elsewhere), and no KV slot leaks.

Drafts come two ways: the real n-gram proposer, and an oracle proposer that proposes the completion's true
continuation with random tokens changed, so that every acceptance length (none of the draft .. all of it)
and every way a step ends (a mismatch, a stop id, max_tokens, the context end) is reached on every model."""

from __future__ import annotations

import itertools
import json
import random

import msgspec
import pytest

from engine.messages import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from executor.grammar import Grammar
from models.synthetic import write_checkpoint
from scheduler import scheduler as scheduler_module
from scheduler.sampling_params import SamplingParams, StructuredOutput
from tests.engine.test_engine_core import assert_no_leak, make_engine, prompt, run_to_end, tokens

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


MODELS = ["tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v2"]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=11)


def on_models(names: str, *axes: list) -> pytest.MarkDecorator:
    """Parametrizes `model_dir` and `names` over the axes' product: every combination on tiny-llama (the
    cheapest), and each on one of the two MLA models, in a checkerboard (the parity of the combination's
    indices), so that each MLA model meets every value of every axis at half the cost of the full product."""
    cases = []
    for model in MODELS:
        for index in itertools.product(*(range(len(a)) for a in axes)):
            if model == MODELS[0] or MODELS[1 + sum(index) % 2] == model:
                cases.append((model, *(a[i] for a, i in zip(axes, index))))
    return pytest.mark.parametrize(f"model_dir,{names}", cases, indirect=["model_dir"])


_REFERENCE: dict[tuple, dict] = {}  # (model, case) -> outputs without drafts, shared by the `wrong` cases


def reference(model_dir, case: tuple, reqs) -> dict:
    """`outputs` of `reqs` on an engine without speculation, computed once per model and case: the oracle
    does not depend on how wrong the drafts are."""
    key = (str(model_dir), *case)
    if key not in _REFERENCE:
        _REFERENCE[key] = outputs(make_engine(model_dir), reqs)
    return _REFERENCE[key]


def outputs(core, reqs) -> dict:
    """(rid, index) -> (tokens, logprobs, finish reason, completion_tokens) of the requests run together."""
    for rid, ids, p in reqs:
        assert core.add_request(GenerateRequest(rid, ids, p)) == []
    outs = run_to_end(core)
    assert_no_leak(core)
    return {k: (tokens(v), [lp for o in v for lp in (o.logprobs or [])], v[-1].finish_reason, v[-1].completion_tokens)
            for k, v in outs.items()}


class OracleDrafts:
    """Stands for NgramProposer: proposes the completion's continuation in `sequences` (the one whose start
    the completion's tokens are), each token changed with chance `wrong` (seeded)."""

    sequences: list[list[int]] = []
    wrong = 0.3
    rng = random.Random(0)

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.length = cfg.num_speculative_tokens  # (always the longest draft: every length is reached)

    def verified(self, drafted: int, kept: int) -> None:
        pass

    def index(self, ids, upto) -> None:
        pass

    def propose(self, ids, seq_len, k):
        mine = ids(0, seq_len)
        for seq in self.sequences:
            if seq[:seq_len] == mine:
                draft = seq[seq_len : seq_len + k]
                return [t + 1 if self.rng.random() < self.wrong else t for t in draft]
        return []


def with_oracle(monkeypatch, sequences: list[list[int]], wrong: float) -> None:
    monkeypatch.setattr(OracleDrafts, "sequences", sequences)
    monkeypatch.setattr(OracleDrafts, "wrong", wrong)
    monkeypatch.setattr(OracleDrafts, "rng", random.Random(7))
    monkeypatch.setattr(scheduler_module, "NgramProposer", OracleDrafts)


PARAMS = {
    "greedy_logprobs": SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40, logprobs=True, top_logprobs=3),
    "sampled": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, ignore_eos=True, max_tokens=40,
                              logprobs=True),
    "penalties": SamplingParams(temperature=0.7, seed=4, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.3, ignore_eos=True, max_tokens=40),
    "n2": SamplingParams(temperature=1.0, seed=5, n=2, ignore_eos=True, max_tokens=30),
}


@on_models("wrong,kind", [0.0, 0.3], sorted(PARAMS))
def test_drafts_change_no_token_nor_logprob(model_dir, monkeypatch, kind, wrong):
    p = PARAMS[kind]
    reqs = [(f"r{i}", prompt(6 + 5 * i, 40 + i), p) for i in range(4)]
    plain = reference(model_dir, ("plain", kind), reqs)
    free = reference(model_dir, ("free", kind),
                     [(rid, ids, msgspec.structs.replace(p, max_tokens=60)) for rid, ids, _ in reqs])
    with_oracle(monkeypatch, [ids + free[(rid, i)][0] for rid, ids, _ in reqs for i in range(p.n)], wrong)
    core = make_engine(model_dir, speculative_config=SPEC)
    assert outputs(core, reqs) == plain
    s = core.stats()
    assert s.spec_decode_drafts_total > 0 and s.spec_decode_accepted_tokens_total <= s.spec_decode_draft_tokens_total
    if wrong == 0.0:  # every draft kept whole: four tokens a step but the last step's
        assert s.spec_decode_accepted_tokens_total == s.spec_decode_draft_tokens_total
        assert s.forward_steps_total < sum(len(t) for t, *_ in plain.values()) // 3
    else:
        assert 0 < s.spec_decode_accepted_tokens_total < s.spec_decode_draft_tokens_total
    assert s.generation_tokens_total == sum(len(t) for t, *_ in plain.values())


def test_a_step_ends_inside_its_draft(model_dir, monkeypatch):
    """A stop id, EOS after min_tokens, max_tokens and the context's end falling inside a kept draft end
    the completion there: the tokens after it are dropped with their KV."""
    base = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=50)
    ids = [prompt(7 + i, 60 + i) for i in range(4)]
    free = outputs(make_engine(model_dir), [(f"f{i}", x, base) for i, x in enumerate(ids)])
    runs = [free[(f"f{i}", 0)][0] for i in range(4)]
    reqs = [
        ("stop_id", ids[0], msgspec.structs.replace(base, stop_token_ids=(runs[0][9],))),
        ("max_tokens", ids[1], msgspec.structs.replace(base, max_tokens=13)),
        ("min_tokens", ids[2], msgspec.structs.replace(base, ignore_eos=False, min_tokens=5,
                                                       stop_token_ids=(runs[2][2], runs[2][11]))),
    ]
    with_oracle(monkeypatch, [x + r for x, r in zip(ids, runs)], wrong=0.0)
    plain = outputs(make_engine(model_dir), reqs)
    assert plain[("stop_id", 0)][2] == FINISH_STOP and plain[("max_tokens", 0)][3] == 13
    assert outputs(make_engine(model_dir, speculative_config=SPEC), reqs) == plain
    # the context's end (32 tokens) in the middle of a draft
    short = [("ctx", ids[3], msgspec.structs.replace(base, max_tokens=None))]
    plain = outputs(make_engine(model_dir, context_length=7 + 3 + 22), short)
    assert plain[("ctx", 0)][2] == FINISH_LENGTH and len(ids[3]) + plain[("ctx", 0)][3] == 32
    assert outputs(make_engine(model_dir, context_length=32, speculative_config=SPEC), short) == plain


def test_kv_pressure_retracts_and_drafts_take_what_is_left(model_dir, monkeypatch):
    """A pool too small for the completions together: they are retracted as without speculation, the
    drafts take the room left; the tokens stay the same."""
    reqs = [(f"m{i}", prompt(20 + i, 200 + i), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24))
            for i in range(8)]
    plain = outputs(make_engine(model_dir, disable_prefix_cache=True), reqs)
    with_oracle(monkeypatch, [ids + plain[(rid, 0)][0] for rid, ids, _ in reqs], wrong=0.2)
    core = make_engine(model_dir, max_total_tokens=96, speculative_config=SPEC)
    assert outputs(core, reqs) == plain
    assert core.stats().retractions_total > 0 and core.stats().spec_decode_drafts_total > 0


@pytest.mark.parametrize("kind", ["greedy_logprobs", "n2"])
def test_paged_drafts_change_no_token_nor_logprob(model_dir, monkeypatch, kind):
    """Page size 8 with drafts, the prefix cache on and a pool of 24 pages: a draft that opens a page takes
    it, a rejected draft gives back the pages wholly past what is kept (its last page keeps the stale slots
    the next tokens overwrite); the tokens, logprobs and retractions go as without drafts, nothing leaks."""
    p = PARAMS[kind]
    reqs = [(f"r{i}", prompt(6 + 5 * i, 40 + i), p) for i in range(4)]
    plain = reference(model_dir, ("plain", kind), reqs)
    free = reference(model_dir, ("free", kind),
                     [(rid, ids, msgspec.structs.replace(p, max_tokens=60)) for rid, ids, _ in reqs])
    with_oracle(monkeypatch, [ids + free[(rid, i)][0] for rid, ids, _ in reqs for i in range(p.n)], 0.3)
    core = make_engine(model_dir, speculative_config=SPEC, page_size=8, max_total_tokens=8 * 24)
    assert outputs(core, reqs) == plain
    s = core.stats()
    assert 0 < s.spec_decode_accepted_tokens_total < s.spec_decode_draft_tokens_total and s.retractions_total > 0


@on_models("spec,kind", [None, SPEC], sorted(PARAMS))
def test_a_predicted_output_drafts_and_changes_no_token_nor_logprob(model_dir, kind, spec):
    """OpenAI's `prediction` (SamplingParams.prediction): its tokens draft, with or without the server's n-gram
    drafts behind them, and the tokens and logprobs are those without; the completion's own output as its
    prediction is kept in long drafts (few steps), an edited one is picked up again after the edit, a
    prediction of other tokens drafts nothing kept; usage's counts add up."""
    p = PARAMS[kind]
    reqs = [(f"r{i}", prompt(6 + 5 * i, 40 + i), p) for i in range(4)]
    plain = reference(model_dir, ("plain", kind), reqs)  # (test_drafts_change_no_token_nor_logprob's requests)
    outs = plain[("r0", 0)][0]
    for name, predicted in (("exact", outs), ("edited", outs[:10] + [7, 8, 9] + outs[14:]), ("other", prompt(40, 9))):
        core = make_engine(model_dir, speculative_config=spec)
        with_prediction = [(rid, ids, msgspec.structs.replace(p, prediction=tuple(predicted))) for rid, ids, _ in reqs]
        for rid, ids, q in with_prediction:
            assert core.add_request(GenerateRequest(rid, ids, q)) == []
        got = run_to_end(core)
        assert_no_leak(core)
        assert {k: (tokens(v), [lp for o in v for lp in (o.logprobs or [])], v[-1].finish_reason) for k, v in got.items()} \
            == {k: v[:3] for k, v in plain.items()}, name
        last = got[("r0", 0)][-1]
        kept, missed = last.accepted_prediction_tokens, last.rejected_prediction_tokens
        if name == "exact":
            assert kept >= len(outs) * 3 // 4 and missed <= 2 * p.n, (kept, missed)
        elif name == "edited":
            assert kept >= len(outs) // 2, (kept, missed)
        else:
            assert kept <= 2, (kept, missed)


def test_ngram_lookup_on_a_looping_model(tmp_path):
    """The real proposer: a tiny random Llama falls into loops that n-gram lookup continues; same tokens
    and logprobs in fewer forwards."""
    model = write_checkpoint(tmp_path, "tiny-llama", seed=11)
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=60, logprobs=True, top_logprobs=2)
    base = prompt(20, 1)
    reqs = [(f"r{i}", base + base[: 5 + i] + prompt(3, 50 + i), p) for i in range(4)]
    off = make_engine(model)
    plain = outputs(off, reqs)
    on = make_engine(model, speculative_config=SPEC)
    assert outputs(on, reqs) == plain
    s = on.stats()
    assert s.spec_decode_accepted_tokens_total > 0
    assert s.forward_steps_total < off.stats().forward_steps_total
    assert s.spec_decode_drafts_total <= 4 * s.forward_steps_total


def test_no_drafts_where_a_completion_decodes_one_token_a_step(model_dir, monkeypatch):
    """OmniKV completions (server default on/auto or their own field) and a batch above
    disable_by_batch_size take no drafts."""
    reqs = [(f"o{i}", prompt(12, 5 + i), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10))
            for i in range(3)]
    plain = outputs(make_engine(model_dir), reqs)
    with_oracle(monkeypatch, [ids + plain[(rid, 0)][0] for rid, ids, _ in reqs], wrong=0.0)
    for kw in ({"omnikv": "auto"}, {"omnikv": "on"}):
        core = make_engine(model_dir, speculative_config=SPEC, **kw)
        assert outputs(core, reqs) == plain and core.stats().spec_decode_drafts_total == 0
    own = [(rid, ids, msgspec.structs.replace(p, omnikv=True)) for rid, ids, p in reqs]
    core = make_engine(model_dir, speculative_config=SPEC)
    assert outputs(core, own) == plain and core.stats().spec_decode_drafts_total == 0
    limited = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    core = make_engine(model_dir, speculative_config=limited)
    assert outputs(core, reqs) == plain and core.stats().spec_decode_drafts_total == 0  # three decode together
    assert outputs(core, reqs[:2]) == {k: v for k, v in plain.items() if k[0] != "o2"}
    assert core.stats().spec_decode_drafts_total > 0


def test_a_draft_never_costs_a_retraction_nor_holds_a_prompt_back(monkeypatch, tmp_path):
    """Drafts take only room nothing else wants. Checked at every step of pools from too small to roomy,
    with prompts prefilled in chunks beside completions that draft: no completion holds a draft when one
    is retracted, and no prompt part-way in is left without its chunk while the step's prefill budget is
    unspent and drafts are in the batch."""
    model = write_checkpoint(tmp_path, "tiny-llama", seed=11)
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
    ids = [prompt(20 + 15 * i, 70 + i) for i in range(4)]
    free = outputs(make_engine(model), [(f"r{i}", x, p) for i, x in enumerate(ids)])
    with_oracle(monkeypatch, [x + free[(f"r{i}", 0)][0] for i, x in enumerate(ids)], wrong=0.1)
    problems: list[str] = []
    schedule, retract = scheduler_module.Scheduler._schedule, scheduler_module.Scheduler._retract

    def checked_schedule(self):
        slices, reqs, finished = schedule(self)
        if any(r.draft for r in reqs):
            used = sum(len(s.input_ids) for s, r in zip(slices, reqs) if not r.is_decoding)
            held = [r.rid for r in self.running if not r.is_decoding and r not in reqs]
            if held and used < self.max_prefill_tokens:
                problems.append(f"{held} held back with {used} prefill tokens and drafts in the batch")
        return slices, reqs, finished

    def checked_retract(self, r):
        if any(x.draft for x in self.running):
            problems.append(f"{r.rid} retracted while drafts were given")
        retract(self, r)

    monkeypatch.setattr(scheduler_module.Scheduler, "_schedule", checked_schedule)
    monkeypatch.setattr(scheduler_module.Scheduler, "_retract", checked_retract)
    retracted = 0
    for pool in range(80, 200, 7):
        core = make_engine(model, max_total_tokens=pool, chunked_prefill_size=16, max_prefill_tokens=16,
                           speculative_config=SPEC)
        got: dict = {}
        for i, x in enumerate(ids):
            if core.add_request(GenerateRequest(f"r{i}", x, p)):  # refused: longer than the pool
                continue
            got[(f"r{i}", 0)] = []
            for _ in range(3):
                for o in core.step():
                    got[(o.rid, o.index)] = got.get((o.rid, o.index), []) + o.new_token_ids
        for k, v in run_to_end(core).items():
            got[k] = got.get(k, []) + tokens(v)
        assert got == {k: free[k][0] for k in got}, pool
        retracted += core.stats().retractions_total
        assert_no_leak(core)
    assert not problems, problems[:5]
    assert retracted > 0  # (the small pools do retract: the check above was exercised)


GRAMMARS = {
    "regex": StructuredOutput("regex", r"(alpha|beta)-[0-9]{2,5};( (alpha|beta)-[0-9]{2,5};){0,6}", "regex"),
    "json_schema": StructuredOutput("json_schema", json.dumps({
        "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
        "required": ["a"], "additionalProperties": False})),
}


@on_models("wrong,kind", [0.0, 0.3], sorted(GRAMMARS))
def test_drafts_under_a_grammar_change_no_token(model_dir, monkeypatch, kind, wrong):
    """Structured outputs take drafts too (Grammar.along): a draft stops where the grammar refuses a token or
    before the stop id that completes the document, and position j of its verification is sampled with the
    mask after the draft's first j tokens. The tokens and logprobs are those without drafts, greedy and
    sampled; drafts of the true continuation are kept whole (the cut at the document's end loses nothing)."""
    structured = GRAMMARS[kind]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, logprobs=True, top_logprobs=2, structured=structured)
    sampled = SamplingParams(temperature=0.9, seed=6, max_tokens=40, logprobs=True, structured=structured)
    reqs = [(f"g{i}", prompt(6 + 5 * i, 70 + i), greedy if i % 2 else sampled) for i in range(4)]
    plain = reference(model_dir, ("grammar", kind), reqs)
    with_oracle(monkeypatch, [ids + plain[(rid, 0)][0] for rid, ids, _ in reqs], wrong)
    cuts: list[tuple[int, int]] = []  # (tokens proposed, tokens the grammar kept)
    along = Grammar.along

    def counted(self, draft, vocab_size):
        kept, masks = along(self, draft, vocab_size)
        cuts.append((len(draft), len(kept)))
        return kept, masks

    monkeypatch.setattr(Grammar, "along", counted)
    core = make_engine(model_dir, speculative_config=SPEC)
    assert outputs(core, reqs) == plain
    s = core.stats()
    assert s.spec_decode_drafts_total > 0 and 0 < s.spec_decode_accepted_tokens_total <= s.spec_decode_draft_tokens_total
    if wrong == 0.0:  # the true continuation: kept whole, but for the stop id the grammar's end leaves out
        assert s.spec_decode_accepted_tokens_total == s.spec_decode_draft_tokens_total
        assert s.forward_steps_total < sum(len(t) for t, *_ in plain.values()) // 2
    else:  # changed tokens: the grammar refuses most of them (the draft is cut), the model the others
        assert any(kept < proposed for proposed, kept in cuts)
