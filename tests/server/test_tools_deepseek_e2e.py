"""Tool calling on a DeepSeek checkpoint served end to end: the official DeepSeek-V3 chat template
(tests/fixtures) renders the tools, the parser is chosen from it (`deepseek_v3`), and the model's own
tokens — DeepSeek's markers are tokens of its vocabulary — come back as `tool_calls`. The weights are
random, so a regex makes the model write the markup; everything after sampling is the real path."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.server_process import openai_client, regex_literal, serve_preset
from tests.server.test_structured_e2e import WEATHER, calls_stream_and_continue, streamed

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
B, E, SEP, CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_preset(tmp_path_factory, "tiny-deepseek-v3", TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_deepseek_markup_becomes_tool_calls(client):
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Weather in Paris and in Lyon?"}]
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    rx = ("Checking\\. " + regex_literal(B) + "(" + regex_literal(CB + "function" + SEP + "get_weather\n```json\n") +
          '\\{"city": "(Paris|Lyon)", "unit": "celsius"\\}' + regex_literal("\n```" + CE) + "){2}" + regex_literal(E))
    kw = dict(model=model, messages=ask, tools=[WEATHER], max_tokens=200, seed=1,
              extra_body={"structured_outputs": {"regex": rx}})
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template rendered the tools
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.strip() == "Checking."
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather", "get_weather"]
    for t in c.message.tool_calls:
        assert json.loads(t.function.arguments)["city"] in ("Paris", "Lyon")
    calls_stream_and_continue(client, kw, r)


def test_strict_tools_hold_the_calls_made_under_auto(client, server):
    """tool_choice "auto" with a strict tool: the text is free, but a call the model begins is held to the
    tools, its arguments to the strict tool's schema (OpenAI's strict mode). A bias makes the random model
    begin a call at once (the call marker is one token of DeepSeek's vocabulary); without strict it writes
    whatever it likes after it, with strict a call whose arguments validate."""
    import jsonschema

    ids = httpx.post(server.url + "/tokenize", json={"prompt": CB, "add_special_tokens": False}, timeout=60).json()
    (begin,) = ids["tokens"]
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    kw = dict(model=model, messages=ask, max_tokens=120, temperature=0, logit_bias={str(begin): 100},
              parallel_tool_calls=False)
    def valid(call) -> bool:
        try:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return call.function.name == "get_weather"

    loose = client.chat.completions.create(tools=[WEATHER], **kw).choices[0]
    assert not any(valid(t) for t in loose.message.tool_calls or ()), loose  # (free: no valid call)
    held = client.chat.completions.create(tools=[strict], **kw).choices[0]
    assert held.finish_reason == "tool_calls", held
    (call,) = held.message.tool_calls
    assert valid(call), call
    s = streamed(client, tools=[strict], **kw)[0]
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == [("get_weather", call.function.arguments)]
    # a strict tool's schema the grammar engine cannot enforce is the client's 400, as for a forced call
    bad = {**strict, "function": {**strict["function"], "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": ask, "tools": [bad], "max_tokens": 4})
    assert resp.status_code == 400 and "uniqueItems" in resp.json()["error"]["message"], resp.text
    assert resp.json()["error"]["param"] == "tools.[0].function.parameters", resp.text
    unchecked = {**bad, "function": {**bad["function"], "strict": False}}  # shown to the model only: taken
    assert httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": ask, "tools": [unchecked], "max_tokens": 4}).status_code == 200
