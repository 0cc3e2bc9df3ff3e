"""vLLM's extensions on /v1/completions and /v1/chat/completions: `prompt_logprobs` against HF transformers'
forward of the same tiny checkpoint in fp32 (the server holds its weights in fp32 too: each prompt token's
logprob, rank in the vocabulary and best alternatives, in vLLM's shape), `cache_salt` and
`return_tokens_as_token_ids`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from models.loader.tokenizer import load_tokenizer
from models.synthetic import load_preset, write_checkpoint
from tests.server.server_process import ServerProcess


SPARE_IDS = 64  # embedding rows past the tokenizer, as Qwen's (151936 rows, 151665 tokens) and many others'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = load_preset("tiny-llama")
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), {**config, "vocab_size": config["vocab_size"] + SPARE_IDS},
                            seed=7)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(str(model_dir), "--cpu-weight-dtype", "float32", "--max-total-tokens", "4096",
                        log=tmp_path_factory.mktemp("log") / "server.log")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def check_against_hf(got: list, ids: list[int], lp: torch.Tensor, k: int, tok) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, token, entry = lp[i - 1], ids[i], got[i]
        keys = list(entry)
        assert keys[0] == str(token), "the prompt token's entry comes first"
        mine = entry[str(token)]
        assert abs(mine["logprob"] - row[token].item()) < 1e-4
        assert abs(mine["rank"] - int((row >= row[token]).sum())) <= 2  # (logits within float noise may swap)
        assert mine["decoded_token"] == tok.decode([token], skip_special_tokens=False)
        values, best = row.topk(k)
        alternatives = [int(t) for t in keys if int(t) != token or entry[t]["rank"] <= k]
        assert len(alternatives) == k
        for rank, (v, t) in enumerate(zip(values.tolist(), best.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4 and (entry[str(t)]["rank"] == rank or t == token)


def test_completions_prompt_logprobs_are_hfs(server, hf_logprobs, model_dir):
    tok = load_tokenizer(str(model_dir))
    ids = tok.encode("The sea is deep and the sky is wide, said the old sailor")
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 4, "n": 2, "seed": 1}
    choices = post(server, "/v1/completions", body).json()["choices"]
    lp = hf_logprobs(ids)
    check_against_hf(choices[0]["prompt_logprobs"], ids, lp, 4, tok)
    assert choices[1]["prompt_logprobs"] == choices[0]["prompt_logprobs"]  # the prompt's, for every choice
    # beside echo + logprobs: the legacy lists keep their own count (1 alternative and the token)
    echoed = post(server, "/v1/completions", {**body, "n": 1, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echoed["prompt_logprobs"] == choices[0]["prompt_logprobs"]
    assert all(len(top) <= 2 for top in echoed["logprobs"]["top_logprobs"][1:])
    # several prompts: each choice its own prompt's; 0 lists the prompt tokens alone
    other = tok.encode("Hello there")
    both = post(server, "/v1/completions", {"prompt": [ids, other], "max_tokens": 1, "prompt_logprobs": 0}).json()
    firsts = [c["prompt_logprobs"] for c in sorted(both["choices"], key=lambda c: c["index"])]
    assert [len(p) for p in firsts] == [len(ids), len(other)] and all(len(e) == 1 for p in firsts for e in p[1:])


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server, hf_logprobs, model_dir):
    tok = load_tokenizer(str(model_dir))
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 0,
            "prompt_logprobs": 2, "return_token_ids": True}
    r = post(server, "/v1/chat/completions", body).json()
    ids = r["prompt_token_ids"]
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 0
    check_against_hf(r["prompt_logprobs"], ids, hf_logprobs(ids), 2, tok)
    # the OpenAI SDK sends it as an extra field and reads it back as one
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    sdk = client.chat.completions.create(model=r["model"], messages=body["messages"], max_tokens=1,
                                         extra_body={"prompt_logprobs": 2})
    assert sdk.model_extra["prompt_logprobs"] == r["prompt_logprobs"]
    plain = post(server, "/v1/chat/completions", {**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value,stream,says", [
    (-1, False, "must be in [0, 20], got -1 (vLLM's -1"),
    (21, False, "must be in [0, 20], got 21"),
    (2, True, "not available when stream is true"),
    ("3", False, "integer"),
])
def test_prompt_logprobs_refusals(server, path, value, stream, says):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    resp = post(server, path, {**prompt, "max_tokens": 1, "prompt_logprobs": value, "stream": stream})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt_logprobs" and says in err["message"], err


def test_prompt_logprobs_0_while_streaming_is_taken_and_ignored_as_vllm(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "x", "max_tokens": 2, "prompt_logprobs": 0, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]" and "prompt_logprobs" not in "".join(lines)


def test_cache_salt_keeps_tenants_prefix_caches_apart(server):
    """vLLM's cache_salt on both APIs: a prompt is a prefix-cache hit only for a request bringing the salt it
    was cached under (`cached_tokens`); an empty salt is refused as vLLM refuses it."""
    text = "A tenant's long system prompt, which another tenant must not be able to time. " * 4

    def body(path: str, text: str) -> dict:
        if path == "/v1/responses":
            return {"input": text, "max_output_tokens": 1}
        return {"prompt" if path == "/v1/completions" else "messages": text if path == "/v1/completions" else
                [{"role": "user", "content": text}], "max_tokens": 1}

    def cached(path: str, salt: str | None) -> int:
        r = post(server, path, {**body(path, path + text), **({"cache_salt": salt} if salt is not None else {})})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        return details.get("cached_tokens", 0)

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        first = cached(path, f"salt-a{path}")
        assert first == 0 and cached(path, f"salt-b{path}") == 0  # not even the chat template's opening
        again = cached(path, f"salt-a{path}")
        assert again > 60 and cached(path, None) < again // 2  # (unsalted: the template's opening at most)
        err = post(server, path, {**body(path, "x"), "cache_salt": ""}).json()["error"]
        assert err["param"] == "cache_salt" and "non-empty" in err["message"], err


def test_return_tokens_as_token_ids_names_logprobs_by_id(server, model_dir):
    """vLLM's return_tokens_as_token_ids: every logprob's token (and alternative) is `token_id:N`, N the id
    the text's token was (the ids `return_token_ids` lists); as vLLM's, a chat token's bytes are its own, an
    alternative's that name's; the values do not move."""
    tok = load_tokenizer(str(model_dir))
    comp = {"prompt": "The sea is", "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "return_token_ids": True}
    plain = post(server, "/v1/completions", comp).json()["choices"][0]
    named = post(server, "/v1/completions", {**comp, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for names, texts in zip(named["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert sorted(names.values()) == sorted(texts.values()) and all(k.startswith("token_id:") for k in names)
        assert {tok.decode([int(k[9:])], skip_special_tokens=False) for k in names} == set(texts)
    chat = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "return_tokens_as_token_ids": True}
    content = post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    texts = post(server, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert [e["bytes"] for e in content] == [e["bytes"] for e in texts["logprobs"]["content"]]  # (vLLM's: the token's)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [c for chunk in chunks for choice in chunk["choices"] for c in (choice.get("logprobs") or {}).get("content") or []]
    assert streamed == content and content
    for entry in content:
        assert entry["token"].startswith("token_id:")
        assert all(alt["token"].startswith("token_id:") and alt["bytes"] == list(alt["token"].encode())
                   for alt in entry["top_logprobs"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_priority_needs_the_priority_policy(server, path):
    """vLLM's `priority`: this server admits in arrival order (--scheduling-policy fcfs, the default), so a
    priority other than 0 is a 400 naming it and the flag, as vLLM refuses it; 0 is taken."""
    body = {"prompt": "x", "max_tokens": 1} if path == "/v1/completions" else \
        {"input": "x", "max_output_tokens": 1} if path == "/v1/responses" else \
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert post(server, path, {**body, "priority": 0}).status_code == 200
    resp = post(server, path, {**body, "priority": -3})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"], err


def test_a_predicted_output_drafts_and_changes_no_token(server, model_dir):
    """OpenAI's Predicted Outputs: the prediction's tokens are speculative drafts (with no --speculative-config),
    so the reply is the one it is without a prediction, token for token, seeded sampling included; usage counts
    the prediction's draft tokens kept and not kept. Sent through the OpenAI SDK's own `prediction`. (The
    random model's text is tokenized back as it was written only so far: drafts are kept up to there.)"""
    tok = load_tokenizer(str(model_dir))
    messages = [{"role": "user", "content": "Rewrite the file."}]
    ask = dict(model=post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()["model"],
               messages=messages, max_tokens=48, temperature=1.0, seed=11,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens == 48 and len(text) > 20
    exact = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert exact.choices[0].message.content == text
    assert exact.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    ids = plain.choices[0].model_extra["token_ids"]
    same = next((m for m in range(len(ids), 0, -1) if tok.encode(tok.decode(ids[:m]), add_special_tokens=False) == ids[:m]), 0)
    details = exact.usage.completion_tokens_details
    assert same >= 10 and details.accepted_prediction_tokens >= same // 2, (same, details)
    edited = text[: len(text) // 2] + " something else entirely " + text[len(text) // 2 :]
    parts = [{"type": "text", "text": edited[:7]}, {"type": "text", "text": edited[7:]}]
    again = client.chat.completions.create(**ask, prediction={"type": "content", "content": parts})
    assert again.choices[0].message.content == text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert plain.usage.completion_tokens_details is None or plain.usage.completion_tokens_details.accepted_prediction_tokens is None
    # a stop string cuts the reply inside tokens kept as drafts: they are not counted as in the reply
    stop = tok.decode(ids[9:11])  # (early in the second draft: its later tokens are kept as drafts past the cut)
    assert same >= 15 and text.find(stop) >= len(tok.decode(ids[:8]))
    cut = client.chat.completions.create(**ask, stop=[stop], prediction={"type": "content", "content": text})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens_details.accepted_prediction_tokens <= cut.usage.completion_tokens
    # continuous usage: the opening chunk has the prediction's fields too, at 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "stream": True, "prediction": {"type": "content", "content": text},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as resp:
        usages = [json.loads(line[6:])["usage"] for line in resp.iter_lines() if line.startswith("data: {")]
    assert usages[0]["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    assert set(usages[-1]["completion_tokens_details"]) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}
    bad = post(server, "/v1/chat/completions", {"messages": messages, "prediction": {"type": "text", "content": "x"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("prediction"), bad.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_list_tokens_with_no_text(server, stream):
    """Ids past the tokenizer (an embedding padded beyond it) have no text: chat's `logprobs.content` still has
    an entry for each, at the answer's end too (the last one was left out: 2 entries for 3 tokens), named
    `token_id:N` with no bytes of their own, as the completions API names them."""
    spare = load_preset("tiny-llama")["vocab_size"] + 5
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "logit_bias": {str(spare): 100}, "stream": stream}
    if not stream:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        entries, tokens = r.json()["choices"][0]["logprobs"]["content"], r.json()["usage"]["completion_tokens"]
    else:
        entries, tokens = [], 3
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    entries += (choice.get("logprobs") or {}).get("content") or []
    assert tokens == 3 and len(entries) == 3, entries
    assert all(e["token"] == f"token_id:{spare}" or e["token"] == "" for e in entries), entries
