"""Tool calling in GLM-4.5/4.6/4.7's `<arg_key>`/`<arg_value>` markup, served end to end on GLM's own
architectures (tiny and random): GLM-4.6's chat template on a GLM-4.5-shaped model (`glm4_moe`), GLM-4.7-Flash's on
a GLM-4.7-Flash-shaped one (`glm4_moe_lite`, MLA); the templates are llama.cpp's copies (tests/fixtures). The
templates render the tools, the parser is chosen from them (`glm45`), and each value's text comes back typed by the
tool's schema. The weights are random, so a regex makes the model write the markup as each template teaches it
(GLM-4.6 with newlines, GLM-4.7 without); everything after sampling is the real path. Thinking is switched off
through `chat_template_kwargs` (the regex constrains the answer, which begins after `</think>`): GLM-4.7-Flash's
generation prompt otherwise opens the reasoning block, and its output is then reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.server.server_process import serve_preset
from tests.server.test_structured_e2e import calls_stream_and_continue

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The weather for the next days",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "hourly": {"type": "boolean"}},
                           "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time",
                                        "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module", params=[("glm_4_6.jinja", "tiny-glm4-moe"), ("glm_4_7_flash.jinja", "tiny-glm4-moe-lite")],
                ids=["glm_4_6", "glm_4_7_flash"])
def served(request, tmp_path_factory):
    template, preset = request.param
    for srv in serve_preset(tmp_path_factory, preset, FIXTURES / template):
        yield template, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_glm_markup_becomes_typed_tool_calls(served):
    template, client = served
    sep = "\\n" if template == "glm_4_6.jinja" else ""  # (a regex's newline)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Forecast for Paris or Lyon, and the time?"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=1, extra_body=off)
    call = (f"<tool_call>forecast{sep}<arg_key>city</arg_key>{sep}<arg_value>(Paris|Lyon)</arg_value>{sep}"
            f"<arg_key>days</arg_key>{sep}<arg_value>[1-7]</arg_value>{sep}<arg_key>hourly</arg_key>{sep}"
            f"<arg_value>(true|false)</arg_value>{sep}</tool_call>")
    kw = dict(model=model, messages=ask, tools=[FORECAST, NOW], max_tokens=300, seed=1,
              extra_body={**off, "structured_outputs": {"regex": f"Checking\\. {call}\\n<tool_call>now{sep}</tool_call>"}})
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered the tools
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.strip() == "Checking."
    assert [t.function.name for t in c.message.tool_calls] == ["forecast", "now"]
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert list(args) == ["city", "days", "hourly"] and args["city"] in ("Paris", "Lyon")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7 and isinstance(args["hourly"], bool)
    assert c.message.tool_calls[1].function.arguments == "{}"
    calls_stream_and_continue(client, kw, r)
    # parallel_tool_calls false: the first call alone
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert [t.function.name for t in one.choices[0].message.tool_calls] == ["forecast"]
    # a stop string that cuts a call: not reported as made ("stop"), its arguments left open
    cut = client.chat.completions.create(**kw, stop=["</arg_value>"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.tool_calls[0].function.arguments.startswith('{"city": "')
    assert not cut.message.tool_calls[0].function.arguments.endswith("}")
    assert "<tool_call>" not in (cut.message.content or "")


def test_glm_4_7_thinking_output_is_reasoning(served):
    """With thinking on (the template's default), GLM-4.7-Flash's generation prompt ends with `<think>`: the
    output starts inside the reasoning block (`--reasoning-parser auto` reads the prompt, as llama.cpp's
    test-chat.cpp reads this template's output), so a reply cut before `</think>` is all reasoning; GLM-4.6's
    leaves `<think>` to the model, whose output here opens no block: it is the answer."""
    template, client = served
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       tools=[FORECAST], temperature=0, extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
    if template == "glm_4_7_flash.jinja":
        assert reasoning and not msg.content and not msg.tool_calls
    else:
        assert not reasoning and msg.content
