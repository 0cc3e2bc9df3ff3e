"""`mlaserve serve --speculative-config`: the answers are those of a server without it, field for field
(text, token ids, logprobs, finish reasons, stop strings, usage), streamed or not, /metrics counts the
generated tokens alike, and it counts the drafts. The model: a tiny random Llama, whose greedy text falls into the loops n-gram lookup continues."""

from __future__ import annotations

import json

import httpx
import pytest

from models.loader.tokenizer import load_tokenizer
from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=11)
    logs = tmp_path_factory.mktemp("log")
    common = ("--max-total-tokens", "8192", "--context-length", "2048")
    plain = ServerProcess(str(model), *common, log=logs / "plain.log")
    spec = ServerProcess(str(model), *common, "--speculative-config", SPEC, log=logs / "spec.log")
    try:
        yield plain.wait_ready(), spec.wait_ready(), model
    finally:
        assert plain.stop() == 0 and spec.stop() == 0
    assert "speculative decoding: ngram, 4 draft tokens, lookup 1..4" in (logs / "spec.log").read_text()


def answer(srv: ServerProcess, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    for k in ("id", "created", "system_fingerprint"):
        out.pop(k, None)
    out["usage"].pop("prompt_tokens_details", None)  # (what the prefix cache held: the servers' histories differ)
    return out


def streamed(srv: ServerProcess, body: dict) -> tuple[dict, dict, dict]:
    """Per choice index: its text and how it finished; the usage."""
    text: dict[int, str] = {}
    finish: dict[int, tuple] = {}
    usage: dict = {}
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                if c.get("finish_reason"):
                    finish[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
            usage = chunk.get("usage") or usage
    usage.pop("prompt_tokens_details", None)
    return text, finish, usage


PROMPT = "one two three four five six seven eight nine ten one two three"


def test_same_answers_as_without_speculation(servers):
    plain, spec, servers_model = servers
    base = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True}
    ids = answer(plain, base)["choices"][0]["token_ids"]
    # a stop string completed inside a loop the drafts continue: the third of a run of one token (streamed
    # with speculation, the run's tokens come several at a time, so tokens after the stop come with it)
    run = next(i for i in range(len(ids) - 4) if len(set(ids[i : i + 5])) == 1)
    stop = load_tokenizer(servers_model).decode(ids[run : run + 3])
    bodies = [
        base,
        {**base, "stop": [stop]},
        {**base, "temperature": 0.8, "seed": 7, "n": 2, "top_p": 0.95},
        {**base, "temperature": 0.7, "seed": 8, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        {**base, "max_tokens": 37, "logprobs": None},
    ]
    counted = ("mlaserve_generation_tokens_total", "mlaserve_inter_token_latency_seconds_count")
    before = [(plain.metric(m), spec.metric(m)) for m in counted]
    for body in bodies:
        want = answer(plain, body)
        assert answer(spec, body) == want, body
        assert streamed(spec, body) == streamed(plain, body), body
    # the tokens a stop string cut from a step's delta are not counted as generated (nor timed as tokens)
    for m, (p0, s0) in zip(counted, before):
        assert spec.metric(m) - s0 == plain.metric(m) - p0 > 0, m
    assert answer(spec, bodies[1])["choices"][0]["finish_reason"] == "stop"
    drafts, kept = spec.metric("mlaserve_spec_decode_draft_tokens_total"), \
        spec.metric("mlaserve_spec_decode_accepted_tokens_total")
    assert spec.metric("mlaserve_spec_decode_drafts_total") > 0 and 0 < kept <= drafts
    assert plain.metric("mlaserve_spec_decode_drafts_total") == 0
    # fewer forwards for the same tokens
    assert spec.metric("mlaserve_engine_forward_steps_total") < plain.metric("mlaserve_engine_forward_steps_total")


def test_a_bad_config_stops_the_server_before_it_binds(tmp_path):
    srv = ServerProcess("/nonexistent-model", "--speculative-config", '{"method": "eagle"}', log=tmp_path / "log")
    assert srv.proc.wait(60) == 2
    assert "--speculative-config: '{\"method\": \"eagle\"}' has method 'eagle': mlaserve proposes drafts by " \
           "n-gram lookup only" in srv.log()
