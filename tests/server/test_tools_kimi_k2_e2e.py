"""Tool calling in Kimi-K2's markup, served end to end on a tiny random DeepSeek-V3-shaped model (Kimi-K2 is
DeepSeek-V3's architecture): Moonshot's Kimi-K2 chat template (tests/fixtures, llama.cpp's copy) renders the tools,
the parser is chosen from it (`kimi_k2`), and each call comes back with the id the model wrote for it,
`functions.NAME:INDEX`, which the template writes back in the next turn's `## Return of ...`.

The tiny-deepseek-v3 tokenizer has none of Kimi's special tokens: `<|tool_calls_section_begin|>` and the other
markers are plain text there, several tokens each (on Kimi's own tokenizer they are one special token each, kept
in the parser's input as its `markup`). The weights are random, so a regex makes the model write the markup;
everything after sampling is the real path."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.server_process import openai_client, regex_literal, serve_preset
from tests.server.test_structured_e2e import WEATHER, calls_stream_and_continue, streamed

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "kimi_k2.jinja"
KS_B, KS_E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_B, K_E, K_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
NOW = {"type": "function", "function": {"name": "now", "description": "The time",
                                        "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_preset(tmp_path_factory, "tiny-deepseek-v3", TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


CALLS_RX = ("Checking\\. " + regex_literal(KS_B + K_B + "functions.get_weather:0" + K_ARGS) +
            '\\{"city": "(Paris|Lyon)", "unit": "celsius"\\}' + regex_literal(K_E + K_B + "functions.now:1" + K_ARGS + "{}" + K_E
                                                                  + KS_E))


def test_kimi_markup_becomes_tool_calls_with_the_models_ids(client, server):
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    kw = dict(model=model, messages=ask, tools=[WEATHER, NOW], max_tokens=300, seed=1,
              extra_body={"structured_outputs": {"regex": CALLS_RX}})
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template rendered the tools
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking. "
    assert [(t.id, t.function.name) for t in c.message.tool_calls] == [
        ("functions.get_weather:0", "get_weather"), ("functions.now:1", "now")]
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")
    assert c.message.tool_calls[1].function.arguments == "{}"
    s = streamed(client, **kw)[0]
    assert [v["id"] for v in s["calls"].values()] == ["functions.get_weather:0", "functions.now:1"]
    calls_stream_and_continue(client, kw, r)
    # the next turn: the template writes the calls and their results under the ids the model wrote
    history = ask + [{"role": "assistant", "content": c.message.content,
                      "tool_calls": [t.model_dump() for t in c.message.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": t.id, "content": "21C"} for t in c.message.tool_calls]
    ids = httpx.post(server.url + "/tokenize", timeout=60, json={"model": model, "messages": history, "tools": [
        WEATHER, NOW], "add_generation_prompt": True}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", timeout=60, json={"model": model, "tokens": ids}).json()["prompt"]
    for t in c.message.tool_calls:
        assert f"{K_B}{t.id}{K_ARGS}" in prompt and f"## Return of {t.id}\\n21C" in prompt, prompt
    # parallel_tool_calls false: the first call alone
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert [t.id for t in one.choices[0].message.tool_calls] == ["functions.get_weather:0"]


def test_forced_calls_get_kimi_ids(client):
    """tool_choice "required" or naming a function: the call is the constrained JSON, not the markup, and its id
    is made in Kimi's form, `functions.NAME:I`, as vLLM makes a forced call's id for Kimi-K2."""
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, NOW],
              max_tokens=120, seed=2)
    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [t.id for t in named.choices[0].message.tool_calls] == ["functions.get_weather:0"]
    required = client.chat.completions.create(**kw, tool_choice="required").choices[0]
    calls = required.message.tool_calls or []
    assert calls and [t.id for t in calls] == [f"functions.{t.function.name}:{i}" for i, t in enumerate(calls)], required


def test_a_cut_call_is_not_reported_as_made(client):
    """A stop string inside the arguments, or max_tokens: the call keeps what it wrote, the finish reason stays
    "stop" or "length", and no markup reaches the content (here the markers are several tokens, so max_tokens
    cuts one in the middle: the part written is dropped)."""
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Lyon?"}], tools=[WEATHER, NOW], seed=1,
              extra_body={"structured_outputs": {"regex": CALLS_RX}})
    cut = client.chat.completions.create(**kw, max_tokens=300, stop=['"unit"']).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == "Checking. "
    (call,) = cut.message.tool_calls
    assert call.id == "functions.get_weather:0" and call.function.arguments.startswith('{"city": "')
    assert not call.function.arguments.endswith("}")
    whole = client.chat.completions.create(**kw, max_tokens=300)
    for n in (whole.usage.completion_tokens - 1, whole.usage.completion_tokens - 4):  # (cut in the last markers)
        c = client.chat.completions.create(**kw, max_tokens=n).choices[0]
        assert c.finish_reason == "length", (n, c)
        assert "<|" not in (c.message.content or ""), (n, c)
        assert [t.function.name for t in c.message.tool_calls or ()] in ([], ["get_weather"], ["get_weather", "now"])
        s = streamed(client, **kw, max_tokens=n)[0]
        assert s["finish"] == "length" and (s["content"] or None) == (c.message.content or None)
        assert [(v["id"], v["name"], v["arguments"]) for v in s["calls"].values()] == \
            [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]
