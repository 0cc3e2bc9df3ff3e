"""The HTTP contract against a real `mlaserve serve` process with a tiny synthetic model, driven by the
official OpenAI SDK and by raw HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import time

import httpx
import openai
import pytest

from models.loader.tokenizer import load_tokenizer
from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

KEY = "test-key-123"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(str(model_dir), "--api-key", KEY, "--max-total-tokens", "16384", "--context-length", "4096",
                        "--max-request-bytes", "65536", log=tmp_path_factory.mktemp("log") / "server.log")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(str(model_dir))


def post(server, path, body, key=KEY, timeout=60.0):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


def test_health_models_and_auth(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200  # probes that send HEAD
    for path in ("/metrics", "/version"):  # the other GET routes too, with no body (a 405 counted as an error)
        head = httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b"", (path, head)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.head(server.url + "/v1/models", headers=auth).status_code == 200
    assert httpx.head(server.url + "/v1/models").status_code == 401  # (a key protects it, HEAD or GET)
    assert httpx.get(server.url + "/metrics").status_code == 200  # open without a key
    models = client.models.list()
    assert [m.id for m in models.data] == [server_model_id(server)]
    assert client.models.retrieve(server_model_id(server)).id == server_model_id(server)
    assert_error(httpx.get(server.url + "/v1/models/nope", headers={"Authorization": f"Bearer {KEY}"}), 404,
                 code="model_not_found")
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_error(wrong, 401, code="invalid_api_key")
    assert wrong.json()["error"]["type"] == "invalid_request_error"  # OpenAI's, for a wrong key
    # two keys, whichever comes first: ambiguous (a proxy checking the first and the server the last disagree)
    for first, second in (("wrong", KEY), (KEY, "wrong")):
        twice = httpx.get(server.url + "/v1/models", headers=[("Authorization", f"Bearer {first}"),
                                                              ("Authorization", f"Bearer {second}")])
        assert_error(twice, 400, code="invalid_api_key")
    # a keyed route with a trailing slash is keyed too (its redirect, built from the Host header, was not)
    assert httpx.post(server.url + "/tokenize/", headers={"Host": "evil.example"}).status_code == 401
    err = assert_error(httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert err["message"] == "no such route: /v1/nothing-here"
    # an OpenAI endpoint this server does not offer says so (the SDK's embeddings call got "no such route")
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=server_model_id(server), input="hi")
    assert "does not offer embeddings" in e.value.body["message"], e.value.body


def server_model_id(server) -> str:
    return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def test_chat_non_streaming_usage_and_token_ids(server, client, tok):
    r = client.chat.completions.create(model=server_model_id(server), messages=MSG, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 12 == r.usage.completion_tokens
    assert choice.message.content == tok.decode(ids)
    prompt_ids = r.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.total_tokens == len(prompt_ids) + 12
    # deterministic: greedy twice gives the same text
    again = client.chat.completions.create(model=server_model_id(server), messages=MSG, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == choice.message.content


def test_chat_streaming_matches_non_streaming(server, client):
    kw = dict(model=server_model_id(server), messages=MSG, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert "\ufffd" not in text


def test_stream_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": MSG, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] > 0
    assert "prompt_token_ids" in payloads[0]
    streamed_ids = [t for p in payloads for c in p["choices"] for t in c.get("token_ids") or []]
    assert len(streamed_ids) == payloads[-1]["usage"]["completion_tokens"]
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])  # OpenAI: null until the last
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "The sea"})):
        with httpx.stream("POST", server.url + path, headers={"Authorization": f"Bearer {KEY}"},
                          json={**body, "max_tokens": 3, "stream": True}, timeout=60) as resp:
            plain = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
        assert plain and all("usage" not in p for p in plain)  # not asked for: not there
    # n > 1: every chunk carries one choice, the first ones (role, echo) too, as OpenAI and vLLM stream (a
    # client reading choices[0] lost the second choice's role and echo, sent in the first chunk)
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "The sea",
                                                                                         "echo": True})):
        with httpx.stream("POST", server.url + path, headers={"Authorization": f"Bearer {KEY}"},
                          json={**body, "max_tokens": 3, "stream": True, "n": 2, "return_token_ids": True},
                          timeout=60) as resp:
            plain = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
        assert all(len(p["choices"]) == 1 for p in plain), plain[:3]
        assert {p["choices"][0]["index"] for p in plain} == {0, 1}
        assert "prompt_token_ids" in (plain[0] if "chat" in path else plain[0]["choices"][0])  # (per choice there)


def test_completions_prompt_forms_echo_logprobs_n(server, client, tok):
    model = server_model_id(server)
    one = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = tok.encode("The sea is")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model=model, prompt=["The sea is", "Mountains are"], max_tokens=4, n=2,
                                     temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 16
    assert many.usage.prompt_tokens == len(ids) + len(tok.encode("Mountains are"))
    echo = client.completions.create(model=model, prompt="The sea is", max_tokens=3, echo=True, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("The sea is")
    lp = client.completions.create(model=model, prompt="The sea is", max_tokens=4, logprobs=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(len(t) == 3 for t in logprobs.top_logprobs)
    assert all(v <= 0 for v in logprobs.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-4 for top, v in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model=server_model_id(server), messages=MSG, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def _bytes_of(tok, *pieces: bytes) -> list[int]:
    return [i for i in range(tok.tokenizer.get_vocab_size()) if tok.token_bytes(i) in pieces]


def test_logprob_bytes_are_the_tokens_own(server, tok):
    """A byte-level token may hold part of a character (its text alone is U+FFFD): `bytes` are the
    token's own bytes, so that joined they spell the reply. The tokens of "中" (E4 B8 AD) are pushed
    with logit_bias so that partial characters come out: at +8 one reply in ten had none (measured, 6 of 60
    seeds), at +10 none of 60 missed and about a quarter of the tokens are still others."""
    parts = _bytes_of(tok, b"\xe4", b"\xb8", b"\xad")
    assert len(parts) == 3
    body = {"messages": MSG, "max_tokens": 24, "temperature": 1.0, "seed": random.randrange(2**31), "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True, "return_token_ids": True, "logit_bias": {str(i): 10 for i in parts}}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert [c["bytes"] for c in content] == [list(tok.token_bytes(i)) for i in ids]
    assert any(c["token"] == "\ufffd" and len(c["bytes"]) == 1 for c in content), content
    assert bytes(b for c in content for b in c["bytes"]).decode("utf-8", "replace") == choice["message"]["content"]
    tops = [top for c in content for top in c["top_logprobs"]]
    assert all(top["bytes"] == list(top["token"].encode()) for top in tops if "\ufffd" not in top["token"])


def test_completion_top_logprobs_list_the_chosen_token(server, client):
    """As OpenAI and vLLM do: the sampled token is in its position's top_logprobs, even when it is not
    among the `logprobs` most likely (then the dict has one more entry)."""
    r = client.completions.create(model=server_model_id(server), prompt="The sea is", max_tokens=16, temperature=2.0,
                                  seed=random.randrange(2**31), logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for token, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert token in top and 1 <= len(top) <= 2 and abs(top[token] - value) < 1e-4
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at temperature 2 some pick is not the likeliest


def test_completion_logprobs_go_up_to_vllms_20(server, client):
    """OpenAI stops at 5, vLLM at 20, and harnesses written for vLLM ask for 10 or 20 (a 400 before)."""
    r = client.completions.create(model=server_model_id(server), prompt="The sea is", max_tokens=4, temperature=0,
                                  logprobs=20)
    assert all(len(top) == 20 for top in r.choices[0].logprobs.top_logprobs)  # greedy: the chosen one is among them


def test_completion_logprobs_name_partial_characters_by_their_bytes(server, tok):
    """The legacy lists have no `bytes`: a token holding part of a character is OpenAI's `bytes:\\xe4`
    there, so that such tokens stay apart (as U+FFFD they shared one `top_logprobs` key, which held
    another token's value and fewer entries than asked for). The tokens of "中" the only ones allowed (a
    logit_bias, as in the test above, left the completions prompt without one in some draws)."""
    parts = _bytes_of(tok, b"\xe4", b"\xb8", b"\xad")
    body = {"prompt": "Write: ", "max_tokens": 24, "temperature": 1.0, "seed": random.randrange(2**31), "logprobs": 5,
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": parts}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]

    def legacy(i: int) -> str:
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(i))
        return tok.decode([i], skip_special_tokens=False)

    assert [legacy(i) for i in ids] == lp["tokens"]
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"]), lp["tokens"]
    for token, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert len(top) >= 5 and top[token] == value, (token, top, value)
        assert "\ufffd" not in "".join(top), top


def _merged_logprobs(chunks) -> dict[str, list]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for choice in c.choices:
            if choice.logprobs is not None:
                for key in out:
                    out[key] += getattr(choice.logprobs, key)
    return out


def test_logprobs_end_where_the_text_ends(server, client, tok):
    """A stop string cuts the text: the logprobs end with it. Tokens that begin at or after the cut (the
    stop string's) are not listed and every text_offset points into the text; streamed, logprobs come
    with their text and add up to the same lists."""
    for prompt in ("Once upon a time", "The sea is", "Mountains are", "Hello", "A story:"):
        kw = dict(model=server_model_id(server), prompt=prompt, max_tokens=24, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0]
        if "\ufffd" not in full.text:  # whole characters only: then the tokens' texts add up to the text
            break
    text, lp = full.text, full.logprobs
    assert "\ufffd" not in text and "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    # a stop string from the last character of token j into token j + 1: token j + 1 starts past the cut
    for j in range(len(lp.tokens) // 3, len(lp.tokens) - 2):
        cut = lp.text_offset[j + 1] - 1
        stop = text[cut : cut + 3]
        if len(lp.tokens[j + 1]) >= 2 and stop.strip() and text.index(stop) == cut:
            break
    else:
        pytest.fail(f"no stop string of the kind wanted in {text!r}")
    want = {"tokens": lp.tokens[: j + 1], "token_logprobs": lp.token_logprobs[: j + 1], "text_offset": lp.text_offset[: j + 1]}
    cut_short = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut_short.text == text[:cut] and cut_short.finish_reason == "stop"
    got = cut_short.logprobs
    assert got.tokens == want["tokens"] and got.text_offset == want["text_offset"]
    assert all(o < len(cut_short.text) for o in got.text_offset)
    streamed = _merged_logprobs(client.completions.create(**kw, stop=[stop], stream=True))
    assert streamed["tokens"] == want["tokens"] and streamed["text_offset"] == want["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    chat = client.chat.completions.create(model=kw["model"], messages=MSG, max_tokens=16, temperature=0, logprobs=True,
                                          extra_body={"ignore_eos": True})
    reply = chat.choices[0].message.content
    stop = next(reply[m : m + k] for m in range(1, len(reply)) for k in range(2, 8)
                if reply.index(reply[m : m + k]) == m)  # a cut past the first character
    cut_chat = client.chat.completions.create(model=kw["model"], messages=MSG, max_tokens=16, temperature=0,
                                              logprobs=True, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    shown, cut_at = "".join(c.token for c in cut_chat.logprobs.content), len(cut_chat.message.content)
    assert shown.startswith(cut_chat.message.content) and reply.startswith(shown)
    assert len(shown) - len(cut_chat.logprobs.content[-1].token) < cut_at <= len(shown)  # the last one holds the cut
    # streamed, the same tokens: the last one's text went out with the token before it, and its logprob
    # comes when the stop string ends the choice (it was once lost there)
    chunks = list(client.chat.completions.create(model=kw["model"], messages=MSG, max_tokens=16, temperature=0,
                                                 logprobs=True, stop=[stop], stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed_tokens = [t.token for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content
                       for t in ch.logprobs.content]
    assert streamed_tokens == [t.token for t in cut_chat.logprobs.content]
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == cut_chat.message.content


def test_streamed_chat_logprobs_join_to_the_whole_replys_whatever_stop_strings_hold_back(server, client):
    """A token whose last character may begin a stop string has its text held back: its first characters
    went out with one delta, the rest with the next, and its logprob was lost streamed (released with the
    rest, it was taken for a token before the answer). Stop strings that never match hold back every token
    here: the streamed logprobs are the whole reply's all the same. A reply cut before any content sends
    `{"content": []}` as the whole reply has it (the stream sent none)."""
    kw = dict(model=server_model_id(server), messages=MSG, max_tokens=24, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    assert "".join(tokens) == whole.message.content and len(tokens) == 24
    stops = sorted({t[-1] + "\u2603" for t in tokens if t})[:4]  # (a snowman: they never match)
    for stop in ([], stops):
        chunks = list(client.chat.completions.create(**kw, stop=stop or None, stream=True))
        got = [t for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content]
        assert [t.token for t in got] == tokens, stop
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in whole.logprobs.content], abs=1e-4)
        deltas = [ch.delta.content for c in chunks[1:] for ch in c.choices if ch.finish_reason is None]
        assert "".join(deltas) == whole.message.content and "" not in deltas  # no chunk of empty content
    cut = client.chat.completions.create(**{**kw, "stop": [whole.message.content[:2]]}).choices[0]
    assert cut.message.content == "" and cut.logprobs.content == []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={**{k: v for k, v in kw.items() if k != "extra_body"}, "ignore_eos": True,
                            "stop": [whole.message.content[:2]], "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["finish_reason"]] == [{"content": []}]


def test_completion_logprobs_0_lists_the_chosen_token(server):
    """The completions API's `logprobs: 0`: each generated token's entry in top_logprobs holds that token
    alone (as vLLM and OpenAI's legacy API), the echoed prompt's first token null (nothing predicts it)."""
    body = {"prompt": "The sea is", "max_tokens": 5, "temperature": 0, "logprobs": 0, "echo": True,
            "ignore_eos": True}
    lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None
    generated = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[-5:]
    for token, value, top in generated:
        assert top == {token: value}, (token, value, top)


def test_stop_strings_never_leak(server, client):
    model = server_model_id(server)
    full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop string ended it
    streamed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output: the text runs through the stop string, no further
    for stream_flag in (False, True):
        kept = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=[stop], stream=stream_flag,
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        parts = list(kept) if stream_flag else [kept]
        assert "".join(c.choices[0].text for c in parts if c.choices) == want + stop
        assert parts[-1].choices[0].finish_reason == "stop"


def test_allowed_token_ids_and_bad_words(server, tok):
    """vLLM's allowed_token_ids and bad_words through the completions API: the greedy reply's words are
    banned one by one and do not come back; with allowed ids, only those."""
    body = {"model": server_model_id(server), "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    free = post(server, "/v1/completions", body).json()["choices"][0]
    words = [w.strip(".,;:!?\"'") for w in free["text"].split()][:3]
    words = [w for w in words if w]
    assert words, free
    banned = post(server, "/v1/completions", {**body, "bad_words": words}).json()["choices"][0]
    for w in words:
        for text in (w, " " + w):
            ids = tok.encode(text, add_special_tokens=False)
            assert not any(banned["token_ids"][i:i + len(ids)] == ids for i in range(len(banned["token_ids"]))), (w, banned)
    allowed = sorted(set(free["token_ids"][:4]))
    only = post(server, "/v1/completions", {**body, "allowed_token_ids": allowed, "temperature": 1.0, "seed": 3})
    assert set(only.json()["choices"][0]["token_ids"]) <= set(allowed), only.text
    word = tok.decode([allowed[0]]).strip()
    one_token_word = bool(word) and any(tok.encode(t, add_special_tokens=False) == [allowed[0]] for t in (word, " " + word))
    assert one_token_word, (word, allowed)  # (the greedy reply's first tokens are words of this tokenizer)
    for bad, param in (({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
                       ({"bad_words": [" "]}, "bad_words"),
                       # nothing left to generate: a 400, not id 0 (which nothing allowed)
                       ({"allowed_token_ids": [tok.eos_token_ids[0]], "min_tokens": 2}, "min_tokens"),
                       *([({"allowed_token_ids": [allowed[0]], "bad_words": [word]}, "bad_words")] if one_token_word else [])):
        assert_error(post(server, "/v1/completions", {**body, **bad}), 400, param, None)


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, tok):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (usage and echo say so); the
    greedy reply is the one to those tokens sent alone."""
    long = " ".join(f"word{i}" for i in range(300))
    ids = tok.encode(long)
    body = {"model": server_model_id(server), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    cut = post(server, "/v1/completions", {**body, "prompt": long, "truncate_prompt_tokens": 40, "echo": True}).json()
    alone = post(server, "/v1/completions", {**body, "prompt": ids[-40:]}).json()
    assert cut["usage"]["prompt_tokens"] == 40
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert cut["choices"][0]["text"].startswith(tok.decode(ids[-40:]))  # echo shows the kept prompt
    chat = post(server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": long}],
                                                 "truncate_prompt_tokens": 25}).json()
    assert chat["usage"]["prompt_tokens"] == 25
    whole = post(server, "/v1/completions", {**body, "prompt": long, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert_error(post(server, "/v1/completions", {**body, "prompt": long, "truncate_prompt_tokens": 0}), 400,
                 "truncate_prompt_tokens", None)
    context = post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    for k in (context + 1, 2**63 - 1):  # more than any servable prompt: refused as vLLM refuses it
        assert_error(post(server, "/v1/completions", {**body, "prompt": long, "truncate_prompt_tokens": k}), 400,
                     "truncate_prompt_tokens", None)
    assert post(server, "/v1/completions", {**body, "prompt": long, "truncate_prompt_tokens": context}).status_code == 200


def test_no_stop_string_ends_before_min_tokens(server, tok):
    """vLLM's rule: a stop string is not matched in the text of the first `min_tokens` tokens; one that
    ends later (even begun earlier) still stops the completion."""
    body = {"model": server_model_id(server), "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    full = post(server, "/v1/completions", body).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    stop = text[len(tok.decode(ids[:2])) - 1:][:2]  # ends in the 3rd token's text or before
    assert stop.strip(), text
    for m in (0, 4, 9):
        early = len(tok.decode(ids[:m]))  # text of the first m tokens
        at = next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > early), None)
        for stream in (False, True):
            resp = post(server, "/v1/completions", {**body, "stop": [stop], "min_tokens": m, "stream": stream})
            if stream:
                chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
                got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
            else:
                got, reason = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["finish_reason"]
            assert got == (text if at is None else text[:at]), (m, stream, got, text)
            assert reason == ("length" if at is None else "stop")


def test_stop_token_ids_end_the_completion(server, client, tok):
    """vLLM's `stop_token_ids`: generation ends right after one of them, with finish_reason "stop"; its
    text is left out, as vLLM does."""
    model = server_model_id(server)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = post(server, "/v1/completions", body).json()["choices"][0]
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 24
    k = 5
    stop_id = full["token_ids"][k]
    choice = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    first = full["token_ids"].index(stop_id)  # greedy: the same tokens up to the first stop id
    assert choice["token_ids"] == full["token_ids"][: first + 1]
    assert choice["text"] == tok.decode(full["token_ids"][:first])  # the stop token's text is left out
    assert choice["stop_reason"] == stop_id
    kept = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == tok.decode(full["token_ids"][: first + 1])  # as vLLM: shown
    for include, scored in ((False, first), (True, first + 1)):  # the stop id's logprob goes with its text
        lp = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id], "logprobs": 1,
                                              "include_stop_str_in_output": include}).json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == scored, lp
    for stream_flag in (False, True):
        resp = client.chat.completions.create(model=model, messages=MSG, max_tokens=24, temperature=0,
                                              stream=stream_flag, extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
        if stream_flag:
            resp = list(resp)
            assert resp[-1].choices[0].finish_reason in ("stop", "length")
        else:
            assert resp.choices[0].finish_reason in ("stop", "length")


def test_the_eos_that_ends_a_reply_has_no_logprob(server, tok):
    """As OpenAI's: `logprobs.content` covers the message's text, so its tokens join to the content; the
    EOS that ended the reply (no text of its own) is counted in usage but not scored. Streamed alike."""
    model = server_model_id(server)
    eos = sorted(tok.eos_token_ids)[0]
    for bias, want_tokens in ((100, 0), (4, None)):  # EOS at once; EOS somewhat favoured (a few tokens first)
        body = {"model": model, "messages": MSG, "max_tokens": 40, "temperature": 0, "logprobs": True,
                "top_logprobs": 2, "logit_bias": {str(eos): bias}}
        resp = post(server, "/v1/chat/completions", body).json()
        choice = resp["choices"][0]
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        assert "".join(tokens) == choice["message"]["content"], choice
        if choice["finish_reason"] == "stop":
            assert len(tokens) == resp["usage"]["completion_tokens"] - 1, (tokens, resp["usage"])
        if want_tokens is not None:
            assert tokens == [] and choice["finish_reason"] == "stop", choice
        events = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60,
                            headers={"Authorization": f"Bearer {KEY}"}).text
        chunks = [json.loads(line[6:]) for line in events.splitlines()
                  if line.startswith("data: {")]
        streamed = [t["token"] for c in chunks for ch in c["choices"] for t in ((ch.get("logprobs") or {}).get("content") or [])]
        assert streamed == tokens, (streamed, tokens)


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"messages": MSG, "temperature": 5000}, 400, "temperature", None),
        ({"messages": MSG, "top_k": -5}, 400, "top_k", None),
        ({"messages": MSG, "top_k": 10**23}, 400, "top_k", None),  # once froze every later request
        ({"messages": MSG, "min_tokens": 2**64}, 400, "min_tokens", None),
        ({"messages": MSG, "min_p": 2.0}, 400, "min_p", None),
        ({"messages": MSG, "presence_penalty": 3.0}, 400, "presence_penalty", None),
        ({"messages": MSG, "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens", None),
        ({"messages": MSG, "seed": 2**70}, 400, "seed", None),
        ({"messages": MSG, "stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
        ({"messages": MSG, "stop_token_ids": ["a"]}, 400, None, None),
        ({"messages": MSG, "max_tokens": "many"}, 400, "max_tokens", None),
        ({"messages": MSG, "top_p": -0.01}, 400, "top_p", None),
        ({"messages": MSG, "n": 0}, 400, "n", None),
        ({"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, None, None),
        ({"messages": [{"role": "user", "content": []}]}, 400, "messages.[0].content", None),
        ({}, 400, "messages", None),
        ({"messages": MSG, "max_tokens": 100000}, 400, None, "context_length_exceeded"),
        ({"messages": MSG, "model": "not-this-one"}, 404, "model", "model_not_found"),
        ({"messages": MSG, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, 400, "functions", None),
        ({"messages": MSG, "function_call": "auto"}, 400, "function_call", None),
        # a named tool_choice without its function: the object form's missing field, not "should be 'none', ..."
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
         400, "tool_choice.function", None),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    assert_error(post(server, "/v1/chat/completions", body), status, param, code)


def test_an_engine_refusal_reads_as_validations_400(server):
    """A value only the engine can judge (an empty prompt among several, a token id past the vocabulary)
    is refused as the server's own validation refuses one: 400 invalid_request_error, the param, no code;
    /metrics counts it under the same label."""
    def count() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = [ln for ln in text.splitlines() if ln.startswith("mlaserve_request_errors_total{")
                and 'code="invalid_request_error"' in ln and 'status="400"' in ln]
        return float(line[0].rsplit(" ", 1)[1]) if line else 0.0

    before = count()
    for prompt in (["a", ""], [10**9]):
        err = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), 400, "prompt")
        assert err["code"] is None and err["type"] == "invalid_request_error", err
    assert count() == before + 2
    assert 'code="invalid_request"' not in httpx.get(server.url + "/metrics").text


def test_bad_json_and_large_body(server):
    resp = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                      headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert_error(resp, 400)
    big = {"messages": [{"role": "user", "content": "x" * 100_000}]}
    assert_error(post(server, "/v1/chat/completions", big), 413)
    assert_error(post(server, "/v1/completions", {"prompt": [10**9], "max_tokens": 2}), 400, "prompt")


DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's recursion limit: the stdlib parser raises RecursionError


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                  "/v1/messages/count_tokens", "/tokenize", "/detokenize"])
def test_a_body_nested_too_deeply_is_a_400_on_every_route(server, path):
    """Valid JSON nested thousands of levels deep: a 400 saying so (the routes that parsed the body with
    the stdlib's recursive parser answered 500 RecursionError), and the server answers the next request."""
    raw = b'{"prompt": "hi", "messages": [], "extra": ' + DEEP.encode() + b"}"
    resp = httpx.post(server.url + path, content=raw, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "JSON" in resp.json()["error"]["message"], resp.text
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_json_strings_nested_too_deeply_are_not_500s(server):
    """JSON *inside* strings: an assistant turn's tool-call arguments (kept as the text they are when they
    do not parse) and a guided_json schema (a 400 naming it)."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    resp = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert resp.status_code in (200, 400), resp.text
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    resp = post(server, "/v1/responses", {"input": items, "max_output_tokens": 2})
    assert resp.status_code in (200, 400), resp.text
    resp = post(server, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 2, "guided_json": DEEP})
    assert_error(resp, 400, "guided_json")


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages.[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
     "messages.[0].content.[0].text"),
    ("/v1/completions", '{"prompt": ["ok", "a\\ud800b"], "max_tokens": 2}', "prompt.[1]"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\udc00"], "stream": true}', "stop.[0]"),
    ("/v1/responses", '{"input": "a\\ud800b"}', "input"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
])
def test_an_unpaired_surrogate_is_the_clients_mistake(server, path, raw, param):
    """Valid JSON, invalid Unicode: a 400 naming the field (it used to reach the tokenizer: a 500, after
    which the server dropped the keep-alive connection); the same connection then serves the next request."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        resp = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert_error(resp, 400, param)
        assert "unpaired UTF-16 surrogate" in resp.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # the connection is still there


@pytest.mark.parametrize(("content", "ctype", "says"), [
    (b"", "application/json", "the request body is empty"),
    (b'{"messages": []}', "application/x-www-form-urlencoded", "is JSON but was not read as such"),  # curl -d
    (b'{"messages": []}', "text/plain", "is JSON but was not read as such"),
    (b'{"messages": [}', "text/plain", "must be a JSON object, not text"),
    (b'[1, 2]', "application/json", "must be a JSON object, not a JSON array"),
    (b'"hi"', "application/json", "must be a JSON object, not a JSON string"),
    (b'null', "application/json", "must be a JSON object, not JSON null"),
    (b'4.5', "application/json", "must be a JSON object, not a JSON number"),
    (b'{"a": "\xff"}', "application/json; charset=latin-1", "could not be read as JSON"),
])
def test_a_body_that_is_not_a_json_object_says_what_to_send(server, content, ctype, says):
    resp = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "content-type": ctype})
    assert_error(resp, 400)
    message = resp.json()["error"]["message"]
    assert says in message and "Content-Type: application/json" in message, message


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_every_route_reads_a_body_only_as_utf8_json_uncompressed(server, path, body):
    """Every route answers the same to a body sent as another type (the Messages and tokenize routes took it),
    compressed (a gzip body was a 'not valid JSON' 400, a plain one labelled gzip was taken: now 415), or in
    UTF-16 (taken: JSON between systems is UTF-8); the same body sent right is answered (a helper found all
    three)."""
    import gzip

    base = {"Authorization": f"Bearer {KEY}"}
    data = json.dumps({"model": server_model_id(server), **body})
    if not path.startswith("/v1/messages"):  # (Anthropic's routes answer in their own shape)
        def says(resp, status, needle):
            assert_error(resp, status)
            assert needle in resp.json()["error"]["message"], resp.json()
    else:
        def says(resp, status, needle):
            assert resp.status_code == status and resp.json()["type"] == "error", resp.text
            assert needle in resp.json()["error"]["message"], resp.json()
    with httpx.Client(base_url=server.url, headers=base, timeout=60) as client:
        says(client.post(path, content=data.encode(), headers={"content-type": "text/plain"}), 400,
             "is JSON but was not read as such")
        for coded, coding in ((gzip.compress(data.encode()), "gzip"), (data.encode(), "gzip"), (data.encode(), "br")):
            says(client.post(path, content=coded, headers={"content-type": "application/json", "content-encoding": coding}),
                 415, f"Content-Encoding '{coding}' is not supported")
        for wide in ("utf-16", "utf-16-le", "utf-32", "utf-32-be"):
            says(client.post(path, content=data.encode(wide), headers={"content-type": "application/json"}), 400,
                 "UTF-16 or UTF-32")
        ok = client.post(path, content=data.encode(), headers={"content-type": "application/json; charset=utf-8",
                                                               "content-encoding": "identity"})
        assert ok.status_code == 200, ok.text
        says(client.post(path, content=data.encode()), 400, "is JSON but was not read as such")  # no type at all
        says(client.post(path, content=b""), 400, "the request body is empty")
        says(client.post(path, content=data.encode(), headers=[("content-type", "application/json"),  # every header
                                                               ("content-encoding", "gzip"), ("content-encoding", "identity")]),
             415, "Content-Encoding 'gzip' is not supported")
        gz = client.post(path, content=gzip.compress(data.encode()), headers={"content-type": "application/json"})
        assert gz.status_code == 400 and "UTF-16" not in gz.text, gz.text  # (unlabelled: not JSON, not UTF-16)
    assert httpx.get(server.url + "/health", headers={"content-encoding": "gzip"}).status_code == 200  # no body


def test_chat_and_completions_carry_the_engines_system_fingerprint(server, client):
    """OpenAI's system_fingerprint on every answer and chunk of both APIs: one value, the engine's hash of its
    weights and settings (it was never sent)."""
    import re

    model = server_model_id(server)
    chat = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    seen = {client.chat.completions.create(**chat).system_fingerprint,
            client.completions.create(model=model, prompt="hi", max_tokens=2).system_fingerprint}
    seen |= {c.system_fingerprint for c in client.chat.completions.create(**chat, stream=True)}
    seen |= {c.system_fingerprint for c in client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True,
                                                                     stream_options={"include_usage": True})}
    (fingerprint,) = seen
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint)


def test_32_concurrent_streams(server):
    async def one(i: int, client: openai.AsyncOpenAI):
        stream = await client.chat.completions.create(
            model=server_model_id(server), messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=8 + i % 5, stream=True, stream_options={"include_usage": True}, temperature=0.5, seed=i,
            extra_body={"ignore_eos": True})
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
            if c.usage:
                usage = c.usage
        return i, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(i, client) for i in range(32)))

    results = asyncio.run(main())
    assert all(u is not None and u.completion_tokens == 8 + i % 5 for i, u in results)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_mid_stream_aborts(server):
    aborted_before = metric(server, "mlaserve_requests_aborted_total")
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Go on and on", "max_tokens": 4000, "stream": True, "ignore_eos": True},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    # 4000 tokens take far longer than this wait: the request must have been aborted, not finished
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if metric(server, "mlaserve_num_requests_running") == 0 and metric(server, "mlaserve_kv_cache_usage_ratio") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "mlaserve_num_requests_running") == 0
    assert metric(server, "mlaserve_kv_cache_usage_ratio") == 0
    assert metric(server, "mlaserve_requests_aborted_total") == aborted_before + 1
    # what finished requests left in the prefix cache is held apart from the usage ratio
    assert metric(server, "mlaserve_prefix_cache_tokens") > 0


def test_a_scored_prompt_and_n_aborted_completions_count(server):
    """A prompt only scored (max_tokens 0) was prefilled: its prompt tokens count, and it is timed to its
    prefill's end (it counted in e2e and success, not in prompt tokens or TTFT). Aborts count completions,
    in the unit of successes: a client gone from an n=2 request is 2."""
    ttft = "mlaserve_time_to_first_token_seconds_count"
    before = {name: metric(server, name) for name in ("mlaserve_prompt_tokens_total", ttft)}
    body = post(server, "/v1/completions", {"prompt": "Score these words for me", "max_tokens": 0, "echo": True,
                                            "logprobs": 1}).json()
    assert metric(server, "mlaserve_prompt_tokens_total") - before["mlaserve_prompt_tokens_total"] == \
        body["usage"]["prompt_tokens"] > 0
    assert metric(server, ttft) == before[ttft] + 1
    aborted_before = metric(server, "mlaserve_requests_aborted_total")
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Go on and on", "max_tokens": 4000, "stream": True, "ignore_eos": True, "n": 2},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(6))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and metric(server, "mlaserve_requests_aborted_total") == aborted_before:
        time.sleep(0.2)
    assert metric(server, "mlaserve_requests_aborted_total") == aborted_before + 2


def test_metrics_text(server, tmp_path):
    post(server, "/v1/completions", {"prompt": "Count to three", "max_tokens": 3})  # (alone, it needs its own tokens)
    text = httpx.get(server.url + "/metrics").text
    for name in ("mlaserve_num_requests_running", "mlaserve_num_requests_waiting", "mlaserve_kv_cache_usage_ratio",
                 "mlaserve_prompt_tokens_total", "mlaserve_generation_tokens_total", "mlaserve_request_success_total",
                 "mlaserve_requests_aborted_total", "mlaserve_retractions_total",
                 "mlaserve_prefix_cache_hit_tokens_total", "mlaserve_time_to_first_token_seconds_bucket",
                 "mlaserve_inter_token_latency_seconds_bucket", "mlaserve_e2e_request_latency_seconds_bucket",
                 "mlaserve_request_queue_time_seconds_bucket"):
        assert name in text, name
    assert metric(server, "mlaserve_generation_tokens_total") > 0
    # every generated token took a forward, and forwards take time
    assert metric(server, "mlaserve_engine_forward_steps_total") > 0
    assert metric(server, "mlaserve_engine_forward_seconds_total") > 0
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    res = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_disconnect_while_waiting_non_streaming_aborts(server):
    aborted_before = metric(server, "mlaserve_requests_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"prompt": "Go on", "max_tokens": 4000, "ignore_eos": True}, timeout=1.0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and metric(server, "mlaserve_requests_aborted_total") == aborted_before:
        time.sleep(0.2)
    assert metric(server, "mlaserve_requests_aborted_total") == aborted_before + 1
    assert metric(server, "mlaserve_num_requests_running") == 0


def test_disconnect_before_the_first_token_aborts(model_dir, tmp_path):
    """A client that leaves while its request still waits in the queue (no token yet) is counted as an
    abort too, and its request never runs."""
    import threading

    srv = ServerProcess(str(model_dir), "--max-running-requests", "1", "--max-total-tokens", "8192",
                        log=tmp_path / "server.log").wait_ready()
    try:
        busy = httpx.Client(base_url=srv.url, timeout=60)
        first = threading.Event()

        def hold() -> None:  # keeps the one running slot busy while the test lasts
            with busy.stream("POST", "/v1/completions", json={"prompt": "Go on", "max_tokens": 4000, "stream": True,
                                                              "ignore_eos": True}) as r:
                for _ in r.iter_lines():
                    first.set()
                    if stop.is_set():
                        return

        stop = threading.Event()
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert first.wait(30)
        aborted_before = metric(srv, "mlaserve_requests_aborted_total")
        with pytest.raises(httpx.ReadTimeout):  # queued behind the holder: no first token within 1 s
            httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=1.0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and metric(srv, "mlaserve_requests_aborted_total") == aborted_before:
            time.sleep(0.2)
        assert metric(srv, "mlaserve_requests_aborted_total") == aborted_before + 1
        assert metric(srv, "mlaserve_num_requests_waiting") == 0  # it left the queue
        stop.set()
        holder.join(30)
        busy.close()
    finally:
        srv.stop()


def test_random_bodies_never_500(server):
    """Hostile bodies: random types and values for every field. Any answer but a 5xx is fine; the
    server must stay healthy and every error must have OpenAI's shape."""
    import random

    rng = random.Random(1234)
    values = [None, True, -1, 0, 1, 7, 2**70, -3.5, 0.5, 1e308, float("nan"), "", "x", "stop", [], [1, 2], ["a"],
              [[1], [2]], {}, {"a": 1}, {"include_usage": True}, [{"role": "user", "content": "hi"}],
              [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user"}],
              [{"type": "image_url"}]]
    fields = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "min_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "logit_bias", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "ignore_eos",
              "min_tokens", "user", "return_token_ids", "unknown_field"]
    for i in range(120):
        body = {f: rng.choice(values) for f in rng.sample(fields, rng.randint(1, 8))}
        if rng.random() < 0.6:
            body["messages" if i % 2 else "prompt"] = [{"role": "user", "content": "hi"}] if i % 2 else "hi"
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = min(body["max_tokens"], 4)
        body.setdefault("max_tokens", 3)
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        raw = json.dumps(body, allow_nan=True)
        resp = httpx.post(server.url + path, content=raw, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
        assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_echo_with_logprobs_scores_the_prompt(server, client, tok):
    """lm-eval style scoring: echo + logprobs (+ max_tokens 0). The logprob the server reports for a
    prompt token equals the logprob it reported when it generated that token."""
    model = server_model_id(server)
    ids = tok.encode("The sea is deep and")
    gen = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    new_ids = gen.choices[0].model_extra["token_ids"]
    scored = client.completions.create(model=model, prompt=ids + new_ids, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == scored.choices[0].text
    for got, want in zip(lp.token_logprobs[-3:], gen.choices[0].logprobs.token_logprobs):
        assert abs(got - want) < 1e-3
    streamed = list(client.completions.create(model=model, prompt=ids, max_tokens=2, echo=True, logprobs=0,
                                              stream=True, temperature=0, extra_body={"ignore_eos": True}))
    first = streamed[0].choices[0]
    assert first.text == tok.decode(ids, skip_special_tokens=False) and len(first.logprobs.tokens) == len(ids)
    # several prompts: each prompt's echo carries its logprobs, streamed as whole (the later prompts' echoes,
    # sent at the stream's start, had none: their prompt logprobs came with their own first outputs)
    body = {"prompt": ["Hello world", "The sky is blue and"], "max_tokens": 2, "temperature": 0, "echo": True,
            "logprobs": 1, "n": 2}
    whole = post(server, "/v1/completions", body).json()["choices"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "stream": True}) as resp:
        chunks = [c for line in resp.iter_lines() if line.startswith("data: {") for c in json.loads(line[6:])["choices"]]
    for choice in whole:
        echo = next(c for c in chunks if c["index"] == choice["index"])
        assert echo["logprobs"]["tokens"] and choice["text"].startswith(echo["text"]), (echo, choice)
        assert echo["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"][:len(echo["logprobs"]["tokens"])]
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400)
    # echo alone with max_tokens 0: the prompt comes back, as OpenAI's legacy API does
    echoed = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True}).json()
    assert echoed["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=False)
    assert echoed["choices"][0]["logprobs"] is None and echoed["usage"]["completion_tokens"] == 0
    # a prompt that fills the context can be scored (nothing is generated), not extended
    whole = [random.Random(3).randrange(3, 500) for _ in range(4096)]
    scored = post(server, "/v1/completions", {"prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 0}, timeout=300)
    assert scored.status_code == 200 and len(scored.json()["choices"][0]["logprobs"]["tokens"]) == 4096
    assert_error(post(server, "/v1/completions", {"prompt": whole, "max_tokens": 1}), 400, code="context_length_exceeded")


def test_echoed_prompt_offsets_point_into_the_text_where_tokens_split_characters(server, client):
    """Byte-level tokens split an emoji over several tokens: each echoed token's offset is that of the
    character it is part of, so offsets never go back and always point into the text."""
    prompt = "Emojis: \U0001F600\U0001F60E and caf\u00e9 \u6771\u4eac"
    r = client.completions.create(model=server_model_id(server), prompt=prompt, max_tokens=2, temperature=0,
                                  echo=True, logprobs=0, extra_body={"ignore_eos": True})
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text.startswith(prompt)
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and all(0 <= o < len(text) for o in offsets), (offsets, len(text))
    for token, at in zip(lp.tokens, offsets):
        if not token.startswith("bytes:"):  # a whole token's text stands at its offset (a partial one: its bytes)
            assert text[at : at + len(token)] == token, (token, at, text)
    assert offsets[len(offsets) - 2] >= len(prompt)  # the generated tokens come after the prompt


def test_omnikv_request_field(server, client):
    """`omnikv: true` decodes sparsely (counted in /metrics; the server default is off), false and unset
    do not; a wrong type is a 400 naming the field."""
    before = metric(server, "mlaserve_omnikv_sparse_tokens_total")
    words = " ".join(f"w{i}" for i in range(300))
    for choice in (None, False):
        extra = {} if choice is None else {"omnikv": choice}
        client.completions.create(model=server_model_id(server), prompt=words, max_tokens=4, temperature=0,
                                  extra_body=extra)
    assert metric(server, "mlaserve_omnikv_sparse_tokens_total") == before
    out = client.completions.create(model=server_model_id(server), prompt=words, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "omnikv": True})
    assert out.usage.completion_tokens == 6
    assert metric(server, "mlaserve_omnikv_sparse_tokens_total") == before + 5
    assert metric(server, "mlaserve_omnikv_selected_tokens_total") < metric(server, "mlaserve_omnikv_context_tokens_total")
    # no --omnikv-bank here (and the native CPU forward would ignore it): the bank's metrics read 0
    assert metric(server, "mlaserve_omnikv_bank_host_bytes") == metric(server, "mlaserve_omnikv_bank_gathered_bytes_total") == 0
    assert_error(post(server, "/v1/completions", {"model": server_model_id(server), "prompt": "hi", "omnikv": "yes"}),
                 400, param="omnikv")
    # the Responses and Messages routes carry the field too (their usage: the tokens decoded after the first)
    for path, body, used in (
            ("/v1/responses", {"input": words, "max_output_tokens": 6}, lambda u: u["output_tokens"]),
            ("/v1/messages", {"messages": [{"role": "user", "content": words}], "max_tokens": 6},
             lambda u: u["output_tokens"])):
        for choice in (False, True):
            before = metric(server, "mlaserve_omnikv_sparse_tokens_total")
            resp = post(server, path, {"model": server_model_id(server), **body, "temperature": 0, "omnikv": choice})
            assert resp.status_code == 200, resp.text
            sparse = metric(server, "mlaserve_omnikv_sparse_tokens_total") - before
            assert sparse == (used(resp.json()["usage"]) - 1 if choice else 0), (path, choice, resp.json()["usage"])
        resp = post(server, path, {"model": server_model_id(server), **body, "omnikv": "yes"})
        assert resp.status_code == 400 and "omnikv" in resp.text, resp.text


def test_continue_final_message_prefills_the_reply(server, client, model_dir):
    """A final assistant message continued (vLLM's continue_final_message, DeepSeek's prefix): the prompt is
    transformers' rendering with continue_final_message (no end of turn after the text), the reply holds
    only the continuation, which is what the completions API gives for that prompt, streamed or not (with
    vLLM's echo, the whole message)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    prefill = "The sea is"
    messages = [*MSG, {"role": "assistant", "content": prefill}]
    want = hf(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                     continue_final_message=True), add_special_tokens=False)["input_ids"]
    ended = hf(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert want != ended
    model = server_model_id(server)
    assert post(server, "/tokenize", {"messages": messages, "continue_final_message": True}).json()["tokens"] == want
    oracle = client.completions.create(model=model, prompt=want, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    kw = dict(model=model, max_tokens=10, temperature=0)
    forms = [
        dict(messages=messages, extra_body={"continue_final_message": True, "ignore_eos": True}),
        dict(messages=messages, extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                            "ignore_eos": True, "return_token_ids": True}),
        dict(messages=[*MSG, {"role": "assistant", "content": prefill, "prefix": True}],
             extra_body={"ignore_eos": True}),
    ]
    for form in forms:
        r = client.chat.completions.create(**kw, **form)
        assert r.choices[0].message.content == oracle and r.usage.prompt_tokens == len(want)
        if "return_token_ids" in form["extra_body"]:
            assert r.model_extra["prompt_token_ids"] == want
        chunks = client.chat.completions.create(stream=True, **kw, **form)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == oracle
    # vLLM's echo: the whole message, whole and streamed; nothing is echoed after a user message
    form = dict(messages=messages, extra_body={"continue_final_message": True, "ignore_eos": True, "echo": True})
    r = client.chat.completions.create(n=2, **kw, **form)
    assert [c.message.content for c in r.choices] == [prefill + oracle] * 2
    chunks = list(client.chat.completions.create(stream=True, **kw, **form))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == prefill + oracle
    r = client.chat.completions.create(messages=MSG, extra_body={"echo": True, "ignore_eos": True}, **kw)
    assert r.choices[0].message.content == client.chat.completions.create(
        messages=MSG, extra_body={"ignore_eos": True}, **kw).choices[0].message.content
    # the plain request opens a new assistant turn instead
    plain = client.chat.completions.create(messages=messages, extra_body={"return_token_ids": True}, **kw)
    assert plain.model_extra["prompt_token_ids"] == ended


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True, "messages": [*MSG, {"role": "assistant", "content": ""}]},
     "continue_final_message"),
    ({"messages": [*MSG, {"role": "assistant", "content": "", "prefix": True}]}, "messages"),  # (not the flag unsent)
    ({"messages": [{**MSG[1], "prefix": True}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "Hi", "prefix": True}, MSG[1]]}, "messages"),
])
def test_a_final_message_that_cannot_be_continued_is_a_400(server, body, param):
    body = {"model": server_model_id(server), "max_tokens": 4,
            "messages": [*MSG, {"role": "assistant", "content": "The sea is"}], **body}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk's usage is the
    tokens so far, growing one a token to the final chunk's totals; without it, null until the end."""
    body = {"model": server_model_id(server), "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            **({"messages": MSG} if "chat" in path else {"prompt": "The sea"})}
    for continuous in (True, False):
        options = {"include_usage": True, "continuous_usage_stats": continuous}
        with httpx.stream("POST", server.url + path, json={**body, "stream_options": options}, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        final = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 6
        usages = [c["usage"] for c in chunks[:-1]]
        if not continuous:
            assert usages == [None] * len(usages)
            continue
        assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in usages)
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == 6 and all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                                                              for u in usages)
    # n = 2: each chunk's usage is its own choice's, as vLLM's (the two choices' tokens were added up); a chunk
    # that carries no generated token (the role's, an echo's) counts none, and each token's chunk one more
    # (the first choice's role chunk, sent with its first token, counted that token too)
    options = {"include_usage": True, "continuous_usage_stats": True}
    echo = {"echo": True} if "chat" not in path else {}
    with httpx.stream("POST", server.url + path, json={**body, **echo, "n": 2, "stream_options": options}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    for k in (0, 1):
        mine = [c for c in chunks[:-1] if c["choices"][0]["index"] == k]
        done = [c["usage"]["completion_tokens"] for c in mine]
        assert done == sorted(done) and done[0] == 0 and done[-1] == 6, done
        generated = [c["usage"]["completion_tokens"] for c in mine if c is not mine[0]
                     and (c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content"))]
        assert generated == list(range(1, 7)), (k, done)


def test_chat_logprobs_join_to_the_content_special_tokens_left_out(server, tok):
    """A special token the reply's text leaves out (skip_special_tokens) has no entry in chat's
    `logprobs.content`, wherever it falls: one between words was listed (its text not in the content), one at
    the end was not (a helper found it). With skip_special_tokens false its text is in both. Streamed alike."""
    start = tok.tokenizer.token_to_id("<|im_start|>")
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" sea", " blue")]
    between = 0  # replies with the special token between words (the case that was listed)
    base = random.randrange(1000)
    # biases that make it about as likely as the words on this model, tried in turn until a reply has it between
    # words, then once with skip_special_tokens false
    tries = [(True, bias, base + k) for k in range(6) for bias in (4, 2, 6, 1, 8)]
    for skip, bias, seed in [*tries, (False, 4, base)]:
        if skip and between >= 2:
            continue
        body = {"model": server_model_id(server), "messages": MSG, "max_tokens": 12, "temperature": 1.5,
                "seed": seed, "ignore_eos": True, "allowed_token_ids": [start, *words],
                "logit_bias": {str(start): bias},
                "logprobs": True, "return_token_ids": True, "skip_special_tokens": skip}
        choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
        ids = choice["token_ids"]
        between += skip and start in ids and any(i != start for i in ids[ids.index(start):])
        content, entries = choice["message"]["content"] or "", choice["logprobs"]["content"]
        assert "".join(e["token"] for e in entries) == content, (skip, choice["token_ids"], entries)
        shown = [i for i in choice["token_ids"] if i != start or not skip]
        assert len(entries) == len(shown), (skip, choice["token_ids"])
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        streamed = [e for c in chunks for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
        assert streamed == entries, skip
    assert between, "no reply put the special token between words: the check above checked nothing"


def test_skip_special_tokens_false_writes_them(server, tok):
    """vLLM's `skip_special_tokens: false`: special tokens' text is written (a forced <|im_start|> here);
    by default it is skipped. EOS still ends the text unseen."""
    start = tok.tokenizer.token_to_id("<|im_start|>")
    body = {"prompt": "Once upon a time", "max_tokens": 3, "logit_bias": {str(start): 100}, "ignore_eos": True}
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == ""
    for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": MSG})):
        sent = {**body, **extra, "skip_special_tokens": False}
        if extra:
            sent.pop("prompt")
        choice = post(server, path, sent).json()["choices"][0]
        assert (choice.get("text") or choice.get("message", {}).get("content")) == "<|im_start|>" * 3, choice
    end = tok.eos_token_ids[0]
    ended = post(server, "/v1/completions", {**body, "logit_bias": {str(end): 100}, "ignore_eos": False,
                                               "skip_special_tokens": False}).json()["choices"][0]
    assert ended["text"] == "" and ended["finish_reason"] == "stop"


def test_n_choices_ended_by_stop_strings_one_by_one(server, client):
    """n choices whose stop strings match at different steps: each is ended in the engine when its own
    matches (the others go on), streamed or not, and each reads as that choice alone would."""
    model = server_model_id(server)
    kw = dict(model=model, prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=21, n=4,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices
    stop = "e"
    ended = client.completions.create(**kw, stop=[stop]).choices
    for f, e in zip(sorted(full, key=lambda c: c.index), sorted(ended, key=lambda c: c.index)):
        assert e.text == f.text.split(stop)[0], (f.text, e.text)
        assert e.finish_reason == ("stop" if stop in f.text else "length")
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stop=[stop], stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in ended}
    deadline = time.monotonic() + 10
    while metric(server, "mlaserve_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "mlaserve_num_requests_running") == 0
