"""Reasoning content through the served API: a synthetic DeepSeek checkpoint served with an R1-style chat
template (the generation prompt opens `<think>`), whose random output never closes the block: all of it
is `reasoning_content`, streamed and whole alike, and counted in `usage.completion_tokens_details`;
a JSON constraint leaves the reasoning free (it starts after `</think>`); a continued final message
(`prefix`) resumes the answer or the reasoning its text left open; `--reasoning-parser none`
gives it back as `content`; a Qwen3-style template's `enable_thinking` switch
reaches the template through `chat_template_kwargs`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess

R1_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}{% else %}"
               "<|Assistant|>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
               "<|Assistant|><think>\n{% endif %}")
# DeepSeek-V3.1's way (its `thinking` variable): the generation prompt closes the block by default and
# opens it in thinking mode; `auto` takes the R1 parser for it (the template writes `<think>`)
V31_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}{% else %}"
                "<|Assistant|></think>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                "<|Assistant|>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 17 times 23?"}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("r1"), "tiny-deepseek-v2", seed=23)


def serve(model: Path, tmp_path: Path, template: str, *flags: str) -> ServerProcess:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return ServerProcess(str(model), "--served-model-name", "m", "--dtype", "float32", "--max-total-tokens", "512",
                         "--chat-template", str(path), *flags, log=tmp_path / "server.log").wait_ready(300)


def stream(c: httpx.Client, body: dict) -> tuple[str, str, dict]:
    reasoning, content, usage = "", "", {}
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                content += ch["delta"].get("content") or ""
    return reasoning, content, usage


def test_r1_template_output_is_reasoning(model, tmp_path) -> None:
    server = serve(model, tmp_path, R1_TEMPLATE)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            whole = c.post("/v1/chat/completions", json=BODY).json()
            msg, usage = whole["choices"][0]["message"], whole["usage"]
            assert msg["reasoning_content"] and msg["content"] is None  # the block never closed: no answer (vLLM: null)
            # logprobs join to the content: the reasoning's tokens carry none (they listed all 12)
            scored = c.post("/v1/chat/completions", json={**BODY, "logprobs": True}).json()["choices"][0]
            assert scored["message"]["reasoning_content"] == msg["reasoning_content"]
            assert scored["logprobs"] == {"content": []}, scored["logprobs"]
            assert usage["completion_tokens"] == 12
            assert usage["completion_tokens_details"]["reasoning_tokens"] == 12
            # a JSON constraint applies after </think>: the reasoning before it is what it was unconstrained
            constrained = c.post("/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"}})
            assert constrained.status_code == 200, constrained.text
            assert constrained.json()["choices"][0]["message"]["reasoning_content"] == msg["reasoning_content"]
            reasoning, content, s_usage = stream(c, BODY)
            assert (reasoning, content) == (msg["reasoning_content"], "")
            assert s_usage["completion_tokens_details"]["reasoning_tokens"] == 12
            # the same tokens as plain text: the completions API does not parse reasoning
            prompt = c.post("/tokenize", json={"messages": BODY["messages"]}).json()["tokens"]
            raw = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True}).json()["choices"][0]["text"]
            assert raw == msg["reasoning_content"]
            # a continued answer (DeepSeek's prefix) is no reasoning: the template writes no <think> before it,
            # and a constraint applies from its first token; a prefix that opens a block continues the reasoning
            answer = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Sure:", "prefix": True}]}
            msg = c.post("/v1/chat/completions", json=answer).json()["choices"][0]["message"]
            assert msg["content"] and not msg.get("reasoning_content")
            assert stream(c, answer)[:2] == ("", msg["content"])
            as_json = c.post("/v1/chat/completions", json={**answer, "response_format": {"type": "json_object"}})
            assert as_json.json()["choices"][0]["message"]["content"].lstrip().startswith("{"), as_json.text
            thinking = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "<think>\nSo",
                                                                   "prefix": True}]}
            whole = c.post("/v1/chat/completions", json=thinking).json()
            assert whole["choices"][0]["message"]["reasoning_content"] and not whole["choices"][0]["message"]["content"]
            assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
            # echo: the prefix's own text in its own field, before the continuation
            echoed = c.post("/v1/chat/completions", json={**thinking, "echo": True}).json()["choices"][0]["message"]
            assert echoed["reasoning_content"] == "\nSo" + whole["choices"][0]["message"]["reasoning_content"]
            assert stream(c, {**answer, "echo": True})[:2] == ("", "Sure:" + msg["content"])
            # vLLM's include_reasoning false: the reasoning is left out (echoed and generated, whole and streamed),
            # still counted
            hidden = c.post("/v1/chat/completions", json={**thinking, "echo": True, "include_reasoning": False}).json()
            assert "reasoning_content" not in hidden["choices"][0]["message"], hidden
            assert hidden["choices"][0]["message"]["content"] is None
            assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
            assert stream(c, {**thinking, "echo": True, "include_reasoning": False})[:2] == ("", "")
            # nor do its token ids or logprobs spell it out, as vLLM leaves them out then
            meta = {**BODY, "include_reasoning": False, "return_token_ids": True, "logprobs": True}
            choice = c.post("/v1/chat/completions", json=meta).json()["choices"][0]
            assert "token_ids" not in choice and choice["logprobs"] is None, choice
            with c.stream("POST", "/v1/chat/completions", json={**meta, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert all("token_ids" not in ch and not ch.get("logprobs") for chunk in chunks for ch in chunk["choices"])
            assert len(chunks) <= 3, chunks  # the role, the finish: no empty chunk a hidden token
            shown = c.post("/v1/chat/completions", json={**answer, "include_reasoning": False}).json()
            assert shown["choices"][0]["message"]["content"] == msg["content"]
            # Anthropic's Messages API: the reasoning is a thinking block, whole and streamed
            ask = {"model": "m", "max_tokens": 12, "messages": BODY["messages"], "temperature": 0}
            m = c.post("/v1/messages", json=ask).json()
            assert m["content"] == [{"type": "thinking", "thinking": reasoning, "signature": ""}], m
            deltas = [json.loads(line[6:])["delta"] for line in c.post("/v1/messages", json={**ask, "stream": True}).text
                      .splitlines() if line.startswith("data: ") and '"content_block_delta"' in line]
            assert "".join(d["thinking"] for d in deltas) == reasoning and {d["type"] for d in deltas} == {"thinking_delta"}
    finally:
        server.stop()


def test_the_prompts_own_tag_decides_v31_thinking_mode(model, tmp_path) -> None:
    """The output after a prompt that ends with `</think>` is the answer (it was all reasoning before, for
    every DeepSeek-V3.1 request in its default mode); `thinking: true` opens the block and the output is
    reasoning again; a JSON constraint applies at once in the first and after `</think>` in the second."""
    server = serve(model, tmp_path, V31_TEMPLATE)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            answer = c.post("/v1/chat/completions", json=BODY).json()
            msg = answer["choices"][0]["message"]
            assert msg["content"] and not msg.get("reasoning_content"), msg
            assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
            assert stream(c, BODY)[:2] == ("", msg["content"])
            as_json = c.post("/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"}})
            assert as_json.json()["choices"][0]["message"]["content"].lstrip().startswith("{"), as_json.text
            thinking = {**BODY, "chat_template_kwargs": {"thinking": True}}
            whole = c.post("/v1/chat/completions", json=thinking).json()
            assert whole["choices"][0]["message"]["reasoning_content"] and not whole["choices"][0]["message"]["content"]
            assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
            constrained = c.post("/v1/chat/completions", json={**thinking, "response_format": {"type": "json_object"}})
            assert constrained.json()["choices"][0]["message"]["reasoning_content"] == \
                whole["choices"][0]["message"]["reasoning_content"]
            # Anthropic's `thinking` switch reaches the template the same way
            ask = {"model": "m", "max_tokens": 12, "messages": BODY["messages"], "temperature": 0}
            for mode, kind in ((None, "text"), ("disabled", "text"), ("enabled", "thinking")):
                body = {**ask, **({"thinking": {"type": mode, "budget_tokens": 8}} if mode else {})}  # < max_tokens
                blocks = c.post("/v1/messages", json=body).json()["content"]
                assert [b["type"] for b in blocks] == [kind], (mode, blocks)
    finally:
        server.stop()


def test_parser_none_keeps_the_text_as_content(model, tmp_path) -> None:
    server = serve(model, tmp_path, R1_TEMPLATE, "--reasoning-parser", "none")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            whole = c.post("/v1/chat/completions", json=BODY).json()
            msg = whole["choices"][0]["message"]
            assert msg["content"] and "reasoning_content" not in msg
            assert "completion_tokens_details" not in whole["usage"]
    finally:
        server.stop()


def test_qwen3_switch_reaches_the_template(model, tmp_path) -> None:
    server = serve(model, tmp_path, QWEN3_TEMPLATE)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            def rendered(kwargs: dict | None) -> str:
                body = {"messages": BODY["messages"], **({"chat_template_kwargs": kwargs} if kwargs else {})}
                ids = c.post("/tokenize", json=body).json()["tokens"]
                return c.post("/detokenize", json={"tokens": ids}).json()["prompt"]

            assert "<think>" not in rendered(None)
            assert rendered({"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
            # thinking off: the model does not open a block, so everything is the answer
            whole = c.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {"enable_thinking": False}})
            msg = whole.json()["choices"][0]["message"]
            assert whole.status_code == 200 and msg.get("reasoning_content") is None and msg["content"]
            assert whole.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    finally:
        server.stop()
