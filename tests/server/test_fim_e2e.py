"""A completions `suffix` is OpenAI's fill-in-the-middle: the reply is the text between the prompt and the
suffix. The prompt is written with the model's FIM tokens, prefix-suffix-middle as llama.cpp's /infill and
DeepSeek-Coder's README write it (`<｜fim▁begin｜>prefix<｜fim▁hole｜>suffix<｜fim▁end｜>`), here checked
against transformers' tokenizer of the same checkpoint; a model without FIM tokens refuses a suffix."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import transformers

from models.loader.tokenizer import load_tokenizer
from models.synthetic import write_checkpoint
from server.serving import fim_prompt, fim_suffix
from server.state import ClientError
from tests.server.server_process import ServerProcess

PREFIX, SUFFIX = "def area(r):\n    return ", "\n\nprint(area(2.0))\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dsv3"), "tiny-deepseek-v3", seed=7)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(str(model_dir), log=tmp_path_factory.mktemp("log") / "log").wait_ready()
    yield srv
    srv.stop()


def _fim_ids(model_dir, prefix: str | list[int], suffix: str) -> list[int]:
    """DeepSeek's FIM prompt through transformers: each part tokenized alone, as llama.cpp does; BOS first
    where the model wants one and the prefix is text (token ids are taken as they are)."""
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    begin, hole, end = hf.convert_tokens_to_ids(["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
                                                 "<\uff5cfim\u2581end\uff5c>"])
    bos = [hf.bos_token_id] if hf.add_bos_token and isinstance(prefix, str) else []
    ids = hf.encode(prefix, add_special_tokens=False, split_special_tokens=True) if isinstance(prefix, str) else prefix
    return [*bos, begin, *ids, hole, *hf.encode(suffix, add_special_tokens=False, split_special_tokens=True), end]


def _complete(srv: ServerProcess, **body) -> dict:
    resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "max_tokens": 6, "temperature": 0, "logprobs": 2, "return_token_ids": True, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_suffix_is_filled_in_before_with_the_models_fim_prompt(server, model_dir) -> None:
    want = _fim_ids(model_dir, PREFIX, SUFFIX)
    fim = _complete(server, prompt=PREFIX, suffix=SUFFIX)
    assert fim["choices"][0]["prompt_token_ids"] == want and fim["usage"]["prompt_tokens"] == len(want)
    plain = _complete(server, prompt=want)  # the same ids sent as a prompt: the same middle, token for token
    for key in ("text", "token_ids", "logprobs"):
        assert fim["choices"][0][key] == plain["choices"][0][key], key
    # token ids as the prompt (no BOS added, as for any ids), several prompts, an empty suffix (the cursor at
    # the end of a file: still a FIM prompt on a FIM model)
    ids = [5, 6, 7, 8]
    got = _complete(server, prompt=[ids, ids[::-1]], suffix=SUFFIX)
    assert [c["prompt_token_ids"] for c in got["choices"]] == [_fim_ids(model_dir, p, SUFFIX) for p in (ids, ids[::-1])]
    empty = _complete(server, prompt=PREFIX, suffix="")
    assert empty["choices"][0]["prompt_token_ids"] == _fim_ids(model_dir, PREFIX, "")
    # special tokens' text is text in both parts (llama.cpp's /infill parses none: code naming them must not
    # end the prompt early), where a plain completions prompt reads it as the tokens
    eos, bos = "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    named = _complete(server, prompt=bos + "x = '" + eos + "'", suffix="y = '" + eos + "'")
    assert named["choices"][0]["prompt_token_ids"] == _fim_ids(model_dir, bos + "x = '" + eos + "'", "y = '" + eos + "'")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert hf.eos_token_id not in named["choices"][0]["prompt_token_ids"][1:-1]


def test_a_streamed_middle_is_the_whole_one(server) -> None:
    whole = _complete(server, prompt=PREFIX, suffix=SUFFIX, logprobs=None)["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 6, "temperature": 0, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole


def test_echo_with_a_suffix_is_refused(server) -> None:
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"


def test_a_model_without_fim_tokens_refuses_a_suffix(tmp_path) -> None:
    tok = load_tokenizer(write_checkpoint(tmp_path, "tiny-llama", seed=1))
    assert tok.fim_ids is None
    with pytest.raises(ClientError) as info:
        fim_suffix(tok, SUFFIX)
    assert info.value.status == 400 and info.value.param == "suffix" and "fill-in-the-middle" in info.value.message
    assert fim_suffix(tok, "") is None and fim_suffix(tok, None) is None  # nothing asked of it: a plain prompt
    assert fim_suffix(tok, "", echo=True) is None  # (so echo stands)


def test_bos_goes_first_where_the_model_wants_one_and_the_prefix_is_text(model_dir) -> None:
    tok = load_tokenizer(model_dir)
    pre, suf, mid = tok.fim_ids
    with_bos = dataclasses.replace(tok, add_bos_token=True)
    assert fim_prompt(with_bos, [11, 12], [13], bos=True) == [tok.bos_token_id, pre, 11, 12, suf, 13, mid]
    assert fim_prompt(with_bos, [11, 12], [13], bos=False) == [pre, 11, 12, suf, 13, mid]  # ids as sent
    assert fim_prompt(dataclasses.replace(tok, add_bos_token=False), [11], [], bos=True) == [pre, 11, suf, mid]


def test_truncation_cuts_the_prefix_not_the_fim_tokens(server, model_dir) -> None:
    """`truncate_prompt_tokens` keeps the prefix's last tokens, as llama.cpp's /infill cuts it: the whole
    prompt's last ones would drop the FIM prefix token."""
    want = _fim_ids(model_dir, PREFIX, SUFFIX)
    rest = len(_fim_ids(model_dir, "", SUFFIX))
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prefix = hf.encode(PREFIX, add_special_tokens=False)
    got = _complete(server, prompt=PREFIX, suffix=SUFFIX, truncate_prompt_tokens=rest + 2)
    cut = _fim_ids(model_dir, prefix[-2:], SUFFIX)
    bos = [hf.bos_token_id] if hf.add_bos_token else []
    assert got["choices"][0]["prompt_token_ids"] == bos + cut and len(bos + cut) == rest + 2
    assert _complete(server, prompt=PREFIX, suffix=SUFFIX, truncate_prompt_tokens=len(want) + 5)["choices"][0][
        "prompt_token_ids"] == want  # room for all of it: nothing cut
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX,
                                                             "truncate_prompt_tokens": rest - 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens"
