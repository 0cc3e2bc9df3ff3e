"""vLLM's `add_special_tokens` on the generation routes, for a model whose tokenizer adds a BOS: the
completions API adds it by default and leaves it out on `false`; chat leaves it out by default (the
template writes its own) and adds it on `true`. The oracle is transformers' tokenizer of the same
directory; `/tokenize` with the same flag gives the ids the route runs (it took the flag while the
routes ignored it)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

BOS = "<|endoftext|>"  # id 0 in the preset's vocabulary
USER = [{"role": "user", "content": "Tell me about the sea."}]


def _with_bos(model: Path) -> Path:
    """The preset's tokenizer made to add BOS, as Llama's and DeepSeek's do (config and post-processor)."""
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token=BOS)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = _with_bos(write_checkpoint(tmp_path_factory.mktemp("bos"), "tiny-llama", seed=4, num_layers=1))
    srv = ServerProcess(str(model), "--dtype", "float32").wait_ready()
    srv.model_dir = model
    yield srv
    assert srv.stop() == 0


def post(srv: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_add_special_tokens_reaches_the_prompt_the_model_runs(server):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(server.model_dir))
    text = "The sea is wide."
    want = {True: hf.encode(text), False: hf.encode(text, add_special_tokens=False)}
    assert want[True] == [0, *want[False]]
    for flag in (None, True, False):
        sent = {} if flag is None else {"add_special_tokens": flag}
        done = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True, **sent})
        ids = want[True if flag is None else flag]
        assert done["choices"][0]["prompt_token_ids"] == ids and done["usage"]["prompt_tokens"] == len(ids), flag
        assert post(server, "/tokenize", {"prompt": text, **sent})["tokens"] == ids
    rendered = hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    chat_want = {True: hf.encode(rendered), False: hf.encode(rendered, add_special_tokens=False)}
    assert chat_want[True] == [0, *chat_want[False]]
    for flag in (None, True, False):
        sent = {} if flag is None else {"add_special_tokens": flag}
        done = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "return_token_ids": True,
                                                     **sent})
        ids = chat_want[False if flag is None else flag]
        assert done["prompt_token_ids"] == ids and done["usage"]["prompt_tokens"] == len(ids), flag
        assert post(server, "/tokenize", {"messages": USER, **sent})["tokens"] == ids
