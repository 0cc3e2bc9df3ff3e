"""Tool calling in Qwen3-Coder's XML markup, served end to end on a Qwen3-MoE checkpoint (Qwen3-Coder-30B-A3B's
architecture, tiny and random): its chat template (tests/fixtures, llama.cpp's copy) renders the tools, the parser
is chosen from it (`qwen3_coder`), and each parameter's text comes back typed by the tool's schema. The weights are
random, so a regex makes the model write the markup; everything after sampling is the real path."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.server.server_process import serve_preset
from tests.server.test_structured_e2e import calls_stream_and_continue

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3_coder.jinja"
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The weather for the next days",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "hourly": {"type": "boolean"}},
                           "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    for srv in serve_preset(tmp_path_factory, "tiny-qwen3-moe", TEMPLATE):
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_qwen3_coder_markup_becomes_typed_tool_calls(client):
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Forecast for Paris and Lyon?"}]
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    call = ("<tool_call>\\n<function=forecast>\\n<parameter=city>\\n(Paris|Lyon)\\n</parameter>\\n<parameter=days>\\n"
            "[1-7]\\n</parameter>\\n<parameter=hourly>\\n(true|false)\\n</parameter>\\n</function>\\n</tool_call>")
    kw = dict(model=model, messages=ask, tools=[FORECAST], max_tokens=300, seed=1,
              extra_body={"structured_outputs": {"regex": f"Checking\\. {call}\\n{call}"}})
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered the tools
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.strip() == "Checking."
    assert [t.function.name for t in c.message.tool_calls] == ["forecast", "forecast"]
    for t in c.message.tool_calls:
        args = json.loads(t.function.arguments)
        assert list(args) == ["city", "days", "hourly"] and args["city"] in ("Paris", "Lyon")
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7 and isinstance(args["hourly"], bool)
    calls_stream_and_continue(client, kw, r)
    # parallel_tool_calls false: the first call alone
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    # a stop string that cuts a call: not reported as made ("stop"), its arguments left open
    cut = client.chat.completions.create(**kw, stop=["</parameter>"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.tool_calls[0].function.arguments.startswith('{"city": "')
    assert not cut.message.tool_calls[0].function.arguments.endswith("}")
