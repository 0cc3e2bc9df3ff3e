"""Kimi-K2's tokenizer sorts every tool's keys, deeply, before its chat template writes them (tokenization_kimi.py's
`apply_chat_template`): the prompts its model was made with. A tokenizer that says so (`sorted_tools`) gets its
request's tools that way; any other, as the request gives them."""

from __future__ import annotations

import dataclasses
import json

import pytest

TOOL = {"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}}}}


@pytest.mark.parametrize("sorted_tools", [True, False])
def test_tools_reach_the_template_sorted_where_the_tokenizer_says(sorted_tools: bool) -> None:
    from models.loader.tokenizer import load_tokenizer
    from server.metrics import Metrics
    from server.protocol import ChatCompletionRequest
    from server.serving import chat_prompt
    from server.state import ServerState

    try:
        tok = load_tokenizer("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    state = ServerState(model_name="m", metrics=Metrics("m"), tool_call_parser="hermes",
                        tokenizer=dataclasses.replace(tok, chat_template=template, sorted_tools=sorted_tools))
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]})
    text = chat_prompt(state, request)[0]
    tools = json.loads(text[: -len("hi")])
    key_orders = [list(tools[0]), list(tools[0]["function"]), list(tools[0]["function"]["parameters"]),
                  list(tools[0]["function"]["parameters"]["properties"])]
    if sorted_tools:
        assert key_orders == [sorted(k) for k in key_orders]
    else:  # (the request's order)
        assert key_orders[3] == ["days", "city"] and key_orders[2] == ["type", "required", "properties"]
