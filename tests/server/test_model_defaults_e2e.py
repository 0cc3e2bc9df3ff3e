"""The model's sampling defaults, `--chat-template`, `/tokenize`, `/detokenize` and `/version` through real
`mlaserve serve` processes on a tiny synthetic model (fp32, so a seeded request gives the same tokens in
any process).

Two servers share one checkpoint whose generation_config.json says temperature 0 (greedy) and top_p 0.8,
and also has two keys that cannot be used (top_k "hot", min_p 5): `auto` serves its defaults (and warns
about the bad keys), `none` OpenAI's. The oracle for "the defaults were applied" is the same request
with the values spelled out; for tokenization the `tokenizers` library on the checkpoint's
tokenizer.json."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest
from tokenizers import Tokenizer

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.test_server_e2e import assert_error

KEY = "defaults-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"temperature": 0.0, "top_p": 0.8}
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
# --chat-template: a template of our own, so that its use is visible in the prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny-llama", seed=11)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(GOOD, top_k="hot", min_p=5)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


def _serve(model_dir, log, *args):
    return ServerProcess(str(model_dir), "--dtype", "float32", "--max-total-tokens", "4096", "--api-key", KEY,
                         *args, log=log)


@pytest.fixture(scope="module")
def auto(model_dir, template_file, tmp_path_factory):
    """--generation-config auto (the default), with --chat-template and the start-up log at info."""
    srv = _serve(model_dir, tmp_path_factory.mktemp("log") / "auto.log", "--chat-template", str(template_file),
                 "--log-level", "info")
    none = _serve(model_dir, tmp_path_factory.mktemp("log") / "none.log", "--generation-config", "none")
    srv.wait_ready()
    none.wait_ready()
    srv.none = none
    yield srv
    assert none.stop() == 0
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def none(auto):
    return auto.none


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def post(srv, path, body, headers=AUTH):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120)


def complete(srv, **body):
    """The token ids of a 16-token completion of "The sea" (or of MSG with `chat=True`)."""
    chat = body.pop("chat", False)
    base = {"messages": MSG} if chat else {"prompt": "The sea"}
    r = post(srv, "/v1/chat/completions" if chat else "/v1/completions",
             {**base, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]




# ---------------------------------------------------------------- sampling defaults


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_absent_temperature_is_the_files_greedy(auto, chat) -> None:
    absent = complete(auto, chat=chat)
    assert complete(auto, chat=chat) == absent  # greedy: the same every time
    assert complete(auto, chat=chat, seed=5) == absent  # whatever the seed
    assert complete(auto, chat=chat, temperature=0) == absent  # the same as asking for it
    assert complete(auto, chat=chat, temperature=None) == absent  # null means "the default"


def prompt_ids(srv, chat: bool) -> list[int]:
    """The ids `complete` sends the model (the chat template's are this server's)."""
    if not chat:
        r = post(srv, "/v1/completions", {"prompt": "The sea", "max_tokens": 1, "return_token_ids": True})
        return r.json()["choices"][0]["prompt_token_ids"]
    r = post(srv, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "return_token_ids": True})
    return r.json()["prompt_token_ids"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_present_temperature_is_honoured(auto, none, chat) -> None:
    ids = prompt_ids(auto, chat)  # the same prompt on the server without model defaults
    # present with OpenAI's own default value: sampling at 1.0, not the file's 0 (nor its top_p 0.8
    # once top_p is sent too): what the server without model defaults does
    sent = complete(auto, chat=chat, seed=3, temperature=1, top_p=1)
    assert sent == complete(none, prompt=ids, seed=3)
    assert sent != complete(auto, chat=chat)  # not the greedy answer
    # temperature sent, top_p not: the file's top_p 0.8 still applies
    file_top_p = complete(auto, chat=chat, seed=3, temperature=1)
    assert file_top_p == complete(none, prompt=ids, seed=3, temperature=1, top_p=0.8) and file_top_p != sent


def test_generation_config_none_restores_openais_defaults(none) -> None:
    assert complete(none, seed=3) == complete(none, seed=3, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                                              repetition_penalty=1.0)
    assert complete(none, seed=3) != complete(none, seed=3, temperature=0)


def test_models_show_the_defaults_in_force(auto, none) -> None:
    card = httpx.get(auto.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["generation_defaults"] == {**OPENAI, **GOOD}
    assert httpx.get(auto.url + f"/v1/models/{card['id']}", headers=AUTH).json()["generation_defaults"] == {
        **OPENAI, **GOOD}
    assert httpx.get(none.url + "/v1/models", headers=AUTH).json()["data"][0]["generation_defaults"] == OPENAI


def test_the_log_lists_the_defaults_and_names_the_bad_keys(auto) -> None:
    log = auto.log_path.read_text()
    line = next(x for x in log.splitlines() if "sampling defaults for requests that leave them out" in x)
    assert "temperature=0.0" in line and "top_p=0.8" in line and "generation_config.json" in line, line
    warning = next(x for x in log.splitlines() if "WARNING" in x and "sampling defaults" in x)
    assert "top_k='hot'" in warning and "min_p=5" in warning, warning
    assert "OpenAI's (--generation-config none)" not in log


# ---------------------------------------------------------------- /tokenize, /detokenize, --chat-template


def test_tokenize_a_prompt(auto, tokenizer) -> None:
    text = "Hello, world! The sea is wide."
    r = post(auto, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode(text, add_special_tokens=False).ids  # this model adds no BOS
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": 4096,  # the context cut to --max-total-tokens
                    "token_strs": [tokenizer.id_to_token(i) for i in ids]}
    assert "token_strs" not in post(auto, "/tokenize", {"prompt": text, "model": None}).json()
    # the completions API encodes the prompt the same way
    done = post(auto, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True}).json()
    assert done["choices"][0]["prompt_token_ids"] == ids


def test_tokenize_messages_renders_the_chat_template_flag(auto, tokenizer) -> None:
    r = post(auto, "/tokenize", {"messages": MSG})
    assert r.status_code == 200, r.text
    text = ("<|im_start|>system: Be brief.<|im_end|>\n<|im_start|>user: Tell me about the sea.<|im_end|>\n"
            "<|im_start|>assistant: ")
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids
    # what chat completions sends the model: the same ids
    chat = post(auto, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == r.json()["tokens"]
    no_prompt = post(auto, "/tokenize", {"messages": MSG, "add_generation_prompt": False}).json()["tokens"]
    assert no_prompt == tokenizer.encode(text.removesuffix("<|im_start|>assistant: "), add_special_tokens=False).ids


def test_tokenize_messages_without_the_flag_uses_the_models_template(none) -> None:
    r = post(none, "/tokenize", {"messages": MSG, "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert "<|im_start|>" in r.json()["token_strs"] and "system" in "".join(r.json()["token_strs"])
    chat = post(none, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == r.json()["tokens"]


def test_detokenize(auto, tokenizer) -> None:
    text = "The sea is wide."
    ids = post(auto, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(auto, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    special = [*ids, tokenizer.token_to_id("<|im_end|>")]
    assert post(auto, "/detokenize", {"tokens": special}).json()["prompt"] == text + "<|im_end|>"
    assert post(auto, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.[0]"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.[0]"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": MSG, "model": "other"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.[0].role"),
    ("/tokenize", {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
])
def test_bad_tokenize_requests_get_openai_errors(auto, path, body, status, param) -> None:
    assert_error(post(auto, path, body), status, param)


def test_tokenize_bodies_that_are_not_json_objects(auto) -> None:
    for path in ("/tokenize", "/detokenize"):
        for content in (b"{bad", b"[1, 2]", b"\xff"):
            resp = httpx.post(auto.url + path, content=content, timeout=30,
                              headers={**AUTH, "Content-Type": "application/json"})
            assert_error(resp, 400)


def test_utility_routes_need_the_key_but_version_does_not(auto) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_error(post(auto, path, body, headers={}), 401, code="invalid_api_key")
        assert_error(post(auto, path, body, headers={"Authorization": "Bearer wrong"}), 401)
    r = httpx.get(auto.url + "/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("mlaserve")}
