"""`POST /v1/responses` through the official OpenAI SDK against real servers. The Responses API is the
chat completions path in another shape, so the oracle is chat completions itself (same prompt tokens,
same greedy tokens), plus the SDK's own types (every raw response and stream event validates against
`openai.types.responses`), its stream helper, and `jsonschema` for constrained outputs.

Servers: a tiny synthetic DeepSeek-V3 with the official DeepSeek-V3 chat template (it renders tool calls
and their results, so a tool round trip renders as chat renders it; random weights, so forced calls and
schemas come from the grammar engine); the default SmolLM2 model where a sensible model is needed (a
JSON-schema answer that ends by itself); a tiny DeepSeek-V2 with an R1-style template for reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from models.synthetic import write_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.test_reasoning_e2e import R1_TEMPLATE

DSV3_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
EVENT = TypeAdapter(ResponseStreamEvent)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def chat_tool(tool: dict) -> dict:
    """A Responses function tool as chat nests it."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def serve(model: Path, log: Path, *flags: str) -> ServerProcess:
    return ServerProcess(str(model), "--served-model-name", "m", "--dtype", "float32", "--max-total-tokens", "4096",
                         "--context-length", "2048", *flags, log=log).wait_ready(300)


def named_events(url: str, body: dict, types: TypeAdapter, headers: dict[str, str] | None = None) -> list[dict]:
    """A streamed request's events, for APIs that name each (`event: <type>` before its `data:` line):
    each event's data, checked against its name and validated by the SDK's event types (`types`); no
    `[DONE]` ends the stream."""
    events: list[dict] = []
    name = None
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                types.validate_python(data)
                events.append(data)
                name = None
            else:
                assert line == "", line
    return events


def sse(url: str, body: dict) -> list[dict]:
    """The raw stream of a Responses request (`named_events`); sequence numbers count up from 0."""
    events = named_events(url + "/v1/responses", body, EVENT)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "m", **body}, timeout=300)


def tokens(url: str, messages: list[dict], **extra: object) -> int:
    """How many prompt tokens chat completions renders these messages to."""
    resp = httpx.post(url + "/tokenize", json={"model": "m", "messages": messages, **extra}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


# ---------------------------------------------------------------- tiny DeepSeek-V3


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("dsv3"), "tiny-deepseek-v3", seed=3)
    srv = serve(model, tmp_path_factory.mktemp("log") / "server.log", "--chat-template", str(DSV3_TEMPLATE))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(dsv3):
    return openai.OpenAI(base_url=dsv3.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_truncation_auto_drops_the_oldest_turns(dsv3):
    """`truncation: "auto"`: a conversation past the context loses its oldest turns until it fits (OpenAI's
    rule), the instructions kept; the oracle is chat completions on the conversation from each user turn
    on: the first that fits is what the response answered, prompt token for token. Without it: a 400."""
    turns: list[dict] = []
    for k in range(8):
        turns += [{"role": "user", "content": f"question {k}: " + "sea " * 300}, {"role": "assistant", "content": f"answer {k}"}]
    turns.append({"role": "user", "content": "and now?"})
    body = {"input": turns, "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}
    refused = post(dsv3.url, body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    got = post(dsv3.url, {**body, "truncation": "auto"})
    assert got.status_code == 200, got.text
    for start in range(0, len(turns), 2):
        chat = httpx.post(dsv3.url + "/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": [{"role": "system", "content": "Be brief."}, *turns[start:]], "max_tokens": 4,
            "temperature": 0})
        if chat.status_code == 200:
            break
        assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert 0 < start < len(turns) - 1
    r = Response.model_validate(got.json())
    assert r.truncation == "auto" and r.usage.input_tokens == chat.json()["usage"]["prompt_tokens"] <= 2048 - 4
    assert r.output_text == chat.json()["choices"][0]["message"]["content"]
    # one turn alone past the context: nothing to drop, the context is exceeded
    alone = post(dsv3.url, {**body, "input": "sea " * 3000, "truncation": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "context_length_exceeded"


def test_text_is_the_chat_answer_whole_and_streamed(client, dsv3):
    ask = "Tell me about the sea."
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], max_tokens=10,
                                          temperature=0)
    raw = post(dsv3.url, {"input": ask, "max_output_tokens": 10, "temperature": 0, "store": True,
                          "metadata": {"k": "v"}, "include": [], "truncation": "auto", "reasoning": {"effort": "low"},
                          "service_tier": "auto"})  # a field this API does not serve is ignored, as on chat
    assert raw.status_code == 200, raw.text
    body = raw.json()
    r = Response.model_validate(body)  # the SDK's own type, validated strictly
    assert r.id.startswith("resp_") and r.object == "response" and body["store"] is False
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 10 and r.metadata == {"k": "v"} and r.truncation == "auto"
    assert r.error is None and r.previous_response_id is None and r.tools == [] and r.tool_choice == "auto"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    # the SDK's stream: every event parses, the deltas make the answer, the last event has it whole
    deltas, last = [], None
    for event in client.responses.create(model="m", input=ask, max_output_tokens=10, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        last = event
    assert "".join(deltas) == r.output_text
    assert last.type == f"response.{r.status}" and last.response.output_text == r.output_text
    assert (r.completed_at is not None) == (r.status == "completed")
    events = sse(dsv3.url, {"model": "m", "input": ask, "max_output_tokens": 10, "temperature": 0})
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert of_type(events, "response.output_text.done")[0]["text"] == r.output_text
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == r.output_text


def test_cut_short_by_max_output_tokens_is_incomplete(client, dsv3):
    r = client.responses.create(model="m", input="Count to a hundred.", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete" and r.output_text
    events = sse(dsv3.url, {"model": "m", "input": "Count to a hundred.", "max_output_tokens": 2, "temperature": 0})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert of_type(events, "response.output_item.done")[0]["item"]["status"] == "incomplete"


def test_logprobs_are_the_chat_logprobs(client, dsv3):
    """include message.output_text.logprobs (+ top_logprobs): the output_text part, each delta event and the
    done event carry the logprobs chat completions gives for the same request (its hidden EOS aside: a
    token whose text is not in the message has no place in it); without the include, none."""
    ask = "Tell me about the sea."
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=3)
    want = [(c.token, c.bytes, c.logprob, [(t.token, t.bytes, t.logprob) for t in c.top_logprobs])
            for c in chat.choices[0].logprobs.content]
    if chat.choices[0].finish_reason == "stop":  # ended by EOS: its logprob is listed, its text is not shown
        want = want[:-1]
    assert len(want) >= 5 and all(len(w[3]) == 3 for w in want)
    kw = dict(model="m", input=ask, max_output_tokens=10, temperature=0, top_logprobs=3)
    r = client.responses.create(**kw, include=["message.output_text.logprobs"])
    part = r.output[0].content[0]
    assert part.text == chat.choices[0].message.content and r.top_logprobs == 3
    got = [(lp.token, lp.bytes, lp.logprob, [(t.token, t.bytes, t.logprob) for t in lp.top_logprobs])
           for lp in part.logprobs]
    assert got == want
    events = sse(dsv3.url, {**kw, "include": ["message.output_text.logprobs"]})
    no_bytes = [{"token": w[0], "logprob": w[2], "top_logprobs": [{"token": t[0], "logprob": t[2]} for t in w[3]]}
                for w in want]
    assert [lp for e in of_type(events, "response.output_text.delta") for lp in e["logprobs"]] == no_bytes
    assert of_type(events, "response.output_text.done")[0]["logprobs"] == no_bytes
    final = Response.model_validate(events[-1]["response"]).output[0].content[0]
    assert [(lp.token, lp.bytes, lp.logprob) for lp in final.logprobs] == [w[:3] for w in want]
    # top_logprobs alone asks for nothing, as on OpenAI's API
    plain = client.responses.create(**kw)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text
    events = sse(dsv3.url, kw)
    assert all(e["logprobs"] == [] for e in of_type(events, "response.output_text.delta"))


def test_instructions_and_items_render_like_chat_messages(client, dsv3):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi."}, {"type": "input_text", "text": "Who are you?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "An assistant.", "annotations": []}]},
        {"type": "message", "role": "developer", "content": "Answer in French."},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # no text: nothing to carry back
        {"role": "user", "content": "And what can you do?"},
    ]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi.\nWho are you?"},
                {"role": "assistant", "content": "An assistant."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "And what can you do?"}]
    r = client.responses.create(model="m", instructions="Be brief.", input=items, max_output_tokens=4, temperature=0)
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens == tokens(dsv3.url, messages)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_function_tool_round_trip(client, dsv3):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.output_text == ""
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    # streamed: the argument deltas make the arguments, the same as the whole response's (greedy)
    events = sse(dsv3.url, kw)
    (added,) = of_type(events, "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    streamed = "".join(e["delta"] for e in of_type(events, "response.function_call_arguments.delta"))
    (done,) = of_type(events, "response.function_call_arguments.done")
    assert streamed == done["arguments"] == call.arguments
    assert events[-1]["response"]["output"][0]["arguments"] == call.arguments
    # the SDK's stream helper assembles the same call
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert [(o.name, o.arguments) for o in final.output] == [("get_weather", call.arguments)]
    # the call and its result fed back: a message, from the prompt chat renders for the same conversation
    history = ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}]
    r2 = client.responses.create(model="m", input=history, tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert [o.type for o in r2.output] == ["message"] and r2.output_text
    messages = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"}]
    assert r2.usage.input_tokens == tokens(dsv3.url, messages, tools=[chat_tool(WEATHER)]) > r.usage.input_tokens
    chat = client.chat.completions.create(model="m", messages=messages, tools=[chat_tool(WEATHER)], max_tokens=6,
                                          temperature=0)
    assert r2.output_text == chat.choices[0].message.content


def test_json_schema_on_a_random_model_completes(client, dsv3):
    """A small schema the grammar closes at once: the response completes, so the SDK's stream helper
    returns it; json_object too."""
    fmt = {"type": "json_schema", "name": "flag", "schema": FLAG, "strict": True}
    kw = dict(model="m", input="Is it ok?", text={"format": fmt}, max_output_tokens=20, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), FLAG)
    with client.responses.stream(**kw) as s:
        assert s.get_final_response().output_text == r.output_text
    r = client.responses.create(model="m", input="JSON please.", text={"format": {"type": "json_object"}},
                                max_output_tokens=40, temperature=0)
    if r.status == "completed":  # a random model may not close its object in time
        assert isinstance(json.loads(r.output_text), dict)


BAD = [
    ({"input": "hi", "previous_response_id": "resp_123"}, 400, "previous_response_id", "stateless"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation", "stateless"),
    ({"input": "hi", "background": True}, 400, "background", None),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input.[0].type", "web_search_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.[0].type", "stores no"),
    ({"input": [{"type": "function_call_output", "output": "9C"}]}, 400, "input.[0].call_id", None),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "9C"}]}, 400, "input.[0].call_id", "c9"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f"}]},
     400, "input.[1].arguments", None),
    # as OpenAI's: every call in the conversation has its one output in it
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                    "arguments": "{}"}, {"role": "user", "content": "hm"}]},
     400, "input.[1].call_id", "no function_call_output found for function call 'c1'"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a"},
                {"type": "function_call_output", "call_id": "c1", "output": "b"}]}, 400, "input.[2].call_id", "second"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a"}]}, 400, "input.[1].call_id", "its own"),
    ({"input": [{"role": "user", "content": 5}]}, 400, "input.[0].content", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.[0].content.[0].type", "input_image"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.[0].role", None),
    ({"input": ["hi"]}, 400, "input.[0]", None),
    ({"input": []}, 400, "input", None),
    ({}, 400, "input", None),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", None),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "input", "context length"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature", None),
    ({"input": "hi", "top_p": 5.0}, 400, "top_p", None),
    ({"input": "hi", "top_logprobs": 21}, 400, "top_logprobs", None),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.[0].type", "web_search"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools.[0].name", None),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}]}, 400,
     "tools.[0].parameters", "tools.[0].parameters is not a valid JSON Schema"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", "nope"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice", None),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", None),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer",
      "multipleOf": 3}}}}, 400, "text.format", "text.format.schema: the keyword 'multipleOf'"),
    ({"input": "hi", "model": "nope"}, 404, "model", "nope"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, 400, "prompt", "not supported"),
    ({"input": "hi", "include": ["reasoning.encrypted_content", "bogus"]}, 400, "include", "include.1: 'bogus'"),
    ({"input": "hi", "n": 2}, 400, "n", "one output"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", None),
    ({"input": "hi", "seed": "x"}, 400, "seed", None),
    ({"input": "hi", "top_k": 1.5}, 400, "top_k", None),
    # the chat path's structured-output extensions: refused by name (they were ignored, the output free)
    ({"input": "hi", "structured_outputs": {"regex": "a+"}}, 400, "structured_outputs", "text.format"),
    ({"input": "hi", "regex": "a+"}, 400, "regex", "text.format"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, 400, "response_format", "text.format"),
    # chat's length and stop fields, as OpenAI's API refuses them (ignored, the answer ran to the context's end)
    ({"input": "hi", "max_tokens": 5}, 400, "max_tokens", "give max_output_tokens"),
    ({"input": "hi", "max_completion_tokens": 5}, 400, "max_completion_tokens", "give max_output_tokens"),
    ({"input": "hi", "stop": ["\n"]}, 400, "stop", "no stop sequences"),
    ({"input": "hi", "max_tool_calls": 0}, 400, "max_tool_calls", None),
    # OpenAI's metadata limits
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "at most 16"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, 400, "metadata", "at most 64"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, 400, "metadata", "at most 512"),
]


@pytest.mark.parametrize("body,status,param,needle", BAD)
def test_bad_requests_name_the_field(dsv3, body, status, param, needle):
    resp = httpx.post(dsv3.url + "/v1/responses", json={"model": "m", **body}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert needle is None or needle in err["message"], err


def test_sdk_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")


def test_input_tokens_and_the_routes_of_stored_responses(dsv3, client):
    """`POST /v1/responses/input_tokens` counts the prompt tokens the same request has (usage.input_tokens);
    the SDK's retrieve / delete / cancel / input_items calls get a 404 that says nothing is stored (a bare
    'no such route' read as a wrong URL)."""
    body = {"input": [{"role": "user", "content": "What is the weather in Paris?"}], "instructions": "Be brief.",
            "tools": [WEATHER]}
    counted = client.responses.input_tokens.count(model="m", **body)
    assert counted.object == "response.input_tokens"
    done = client.responses.create(model="m", max_output_tokens=2, temperature=0, **body)
    assert counted.input_tokens == done.usage.input_tokens > 0
    r = httpx.post(dsv3.url + "/v1/responses/input_tokens", json={"model": "m", "input": "hi", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    ids = done.id
    for call in (lambda: client.responses.retrieve(ids), lambda: client.responses.delete(ids),
                 lambda: client.responses.cancel(ids), lambda: list(client.responses.input_items.list(ids))):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found" and "this server stores no responses" in e.value.body["message"]
    for method, path, status in (("GET", "input_tokens", 405), ("POST", f"{ids}/nothing", 404)):
        r = httpx.request(method, f"{dsv3.url}/v1/responses/{path}", timeout=60)
        assert r.status_code == status and "stores no" not in r.text, r.text
    assert done.max_tool_calls is None
    assert client.responses.create(model="m", input="hi", max_output_tokens=1, max_tool_calls=2).max_tool_calls == 2


# ---------------------------------------------------------------- a reasoning model


def test_reasoning_item_and_tokens(tmp_path):
    """R1-style template: the output starts inside `<think>` and the random model never closes it, so all of
    it is a reasoning item (the chat API's `reasoning_content`), counted as reasoning tokens."""
    model = write_checkpoint(tmp_path / "r1", "tiny-deepseek-v2", seed=23)
    template = tmp_path / "r1.jinja"
    template.write_text(R1_TEMPLATE)
    srv = serve(model, tmp_path / "server.log", "--chat-template", str(template))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        ask = "What is 17 times 23?"
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], max_tokens=12,
                                              temperature=0)
        reasoning = chat.choices[0].message.to_dict()["reasoning_content"]
        raw = post(srv.url, {"input": ask, "max_output_tokens": 12, "temperature": 0}).json()
        r = Response.model_validate(raw)
        (item,) = r.output
        assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
        assert [c.text for c in item.content] == [reasoning] and r.output_text == ""
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
        assert r.status == "incomplete"
        events = sse(srv.url, {"model": "m", "input": ask, "max_output_tokens": 12, "temperature": 0})
        assert of_type(events, "response.content_part.added")[0]["part"] == {"type": "reasoning_text", "text": ""}
        assert "".join(e["delta"] for e in of_type(events, "response.reasoning_text.delta")) == reasoning
        assert of_type(events, "response.reasoning_text.done")[0]["text"] == reasoning
        final = events[-1]["response"]
        assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
        assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 12
        # a reasoning item sent back is accepted (and dropped, as chat drops reasoning from the prompt)
        again = client.responses.create(model="m", input=[{"role": "user", "content": ask}, item.model_dump(exclude_none=True),
                                                          {"role": "user", "content": "Sure?"}], max_output_tokens=1)
        assert again.usage.input_tokens == tokens(srv.url, [{"role": "user", "content": ask},
                                                            {"role": "user", "content": "Sure?"}])
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------- the default model


class Answer(BaseModel):
    city: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)


@pytest.mark.slow
def test_default_model_schema_and_tool_calls(tmp_path):
    """SmolLM2 writes a JSON-schema answer that ends by itself (streamed and whole, the same greedy
    document), parses into a pydantic model through the SDK, and fills a forced call's arguments."""
    srv = ServerProcess("smollm2-135m-instruct", "--max-total-tokens", "8192", "--context-length", "2048",
                        log=tmp_path / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = "smollm2-135m-instruct"
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "country": {"type": "string", "maxLength": 20}},
                  "required": ["city", "country"]}
        kw = dict(model=model, input="Name a big city and its country, as JSON.", temperature=0, max_output_tokens=60,
                  text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
        r = client.responses.create(**kw)
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)
        events = sse(srv.url, kw)
        assert events[-1]["type"] == "response.completed"
        assert "".join(e["delta"] for e in of_type(events, "response.output_text.delta")) == r.output_text
        parsed = client.responses.parse(model=model, input="Which city is the capital of France?", text_format=Answer,
                                        max_output_tokens=60, temperature=0)
        assert isinstance(parsed.output_parsed, Answer)
        # a format beside a forced call is for a turn that answers in text (the Agents SDK sends both)
        r = client.responses.create(model=model, input="What is the weather in Paris, in celsius?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                    temperature=0, text={"format": {"type": "json_object"}})
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and r.parallel_tool_calls is False
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    finally:
        assert srv.stop() == 0


def test_reasoning_items_go_with_the_assistant_turn_after_them():
    """A reasoning item's text (as this server writes it) is the next assistant turn's reasoning_content,
    as a chat client would send it back; OpenAI's summary-only items carry none; a user turn in between
    drops it (it was no answer's reasoning)."""
    from server.responses_api import ResponsesRequest, to_chat_request

    think = lambda text: {"type": "reasoning", "id": "rs", "summary": [],  # noqa: E731
                          "content": [{"type": "reasoning_text", "text": text}]}
    items = [{"role": "user", "content": "Weather?"}, think("Look it up."),
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}, think("Now answer."),
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
             think("stray"), {"role": "user", "content": "Thanks."}]
    chat = to_chat_request(ResponsesRequest.model_validate({"model": "m", "input": items}))
    assert chat.reasoning_effort is None
    got = [(m.role, m.reasoning_content) for m in chat.messages]
    assert got == [("user", None), ("assistant", "Look it up."), ("tool", None), ("assistant", "Now answer."),
                   ("user", None)]


def test_reasoning_effort_reaches_the_chat_request():
    """`reasoning.effort` is chat's `reasoning_effort` (it reaches the template; it was accepted and dropped)."""
    from server.responses_api import ResponsesRequest, to_chat_request

    for effort in ("low", "high", "none"):
        chat = to_chat_request(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": effort}}))
        assert chat.reasoning_effort == effort


def test_seed_and_top_k_reach_the_chat_request():
    """chat's `seed` and `top_k` extensions: a seeded response is reproducible (they were dropped unread)."""
    from server.responses_api import ResponsesRequest, to_chat_request

    chat = to_chat_request(ResponsesRequest.model_validate({"input": "hi", "seed": 3, "top_k": 5}))
    assert (chat.seed, chat.top_k) == (3, 5)
