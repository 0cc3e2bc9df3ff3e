"""Anthropic's `POST /v1/messages` (and `/v1/messages/count_tokens`) through the official Anthropic SDK
against a real server. The Messages API is the chat completions path in another shape, so the oracle is
chat completions itself (same prompt tokens, same greedy tokens), plus the SDK's own types (every raw
response and stream event validates against `anthropic.types`), its stream helper, and `jsonschema` for
tool inputs and structured outputs.

Server: a tiny synthetic DeepSeek-V3 with the official DeepSeek-V3 chat template (it renders tool calls
and their results, so a tool round trip renders as chat renders it; random weights, so forced calls and
schemas come from the grammar engine), behind an API key, which Anthropic's SDK sends as `x-api-key`."""

from __future__ import annotations

import json
import random
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter

from models.synthetic import write_checkpoint
from tests.server.test_responses_api import DSV3_TEMPLATE, FLAG, named_events, serve

anthropic = pytest.importorskip("anthropic")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402

KEY = "messages-key"
EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
SYSTEM, ASK = "Be brief.", "Tell me about the sea."
GREEDY = {"temperature": 0}  # the SDK sends sampling fields through extra_body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("dsv3"), "tiny-deepseek-v3", seed=3)
    srv = serve(model, tmp_path_factory.mktemp("log") / "server.log", "--chat-template", str(DSV3_TEMPLATE),
                "--api-key", KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def sse(url: str, body: dict) -> list[dict]:
    """The raw stream (`named_events`), its events in the order the API defines."""
    events = named_events(url + "/v1/messages", {"model": "m", **body}, EVENT, headers={"x-api-key": KEY})
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index = None
    for e in events[1:-2]:  # blocks one at a time: start, deltas of that index, stop
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
        else:
            assert e["index"] == open_index, e
            if e["type"] == "content_block_stop":
                open_index = None
    assert open_index is None
    return events


def streamed_blocks(events: list[dict]) -> list[dict]:
    """The content blocks a stream tells, put together (tool inputs parsed from their JSON deltas)."""
    blocks: list[dict] = []
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append({**e["content_block"], "json": ""})
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                b["json"] += d["partial_json"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["json"])
        del b["json"]
    return blocks


def test_text_is_the_chat_answer_whole_and_streamed(server, client, chat):
    want = chat.chat.completions.create(model="m", messages=[{"role": "system", "content": SYSTEM},
                                                             {"role": "user", "content": ASK}], max_tokens=10, **GREEDY)
    body = {"max_tokens": 10, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}], **GREEDY,
            "metadata": {"user_id": "u"}, "service_tier": "auto"}  # accepted, ignored
    m = client.messages.create(model="m", **{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    raw = httpx.post(server.url + "/v1/messages", json={"model": "m", **body}, headers={"x-api-key": KEY}, timeout=300)
    Message.model_validate(raw.json())
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "m"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens
    events = sse(server.url, body)
    assert streamed_blocks(events) == [{"type": "text", "text": m.content[0].text}]
    assert events[-2]["delta"]["stop_reason"] == m.stop_reason and events[-2]["usage"]["output_tokens"] == 10
    with client.messages.stream(model="m", max_tokens=10, system=SYSTEM, messages=[{"role": "user", "content": ASK}],
                                extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == m.content[0].text
        final = s.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in m.content]
    assert final.stop_reason == m.stop_reason
    # the prompt was served before: the prefix cache held it, and the stream tells the same split as the
    # whole answer (in message_start, and again in message_delta)
    assert m.usage.cache_read_input_tokens > 0
    for usage in (final.usage, events[0]["message"]["usage"], events[-2]["usage"]):
        got = usage if isinstance(usage, dict) else usage.model_dump()
        assert (got["input_tokens"], got["cache_read_input_tokens"]) == \
            (m.usage.input_tokens, m.usage.cache_read_input_tokens), usage
    count = client.messages.count_tokens(model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert count.input_tokens == want.usage.prompt_tokens


def test_stop_sequence_is_named(client):
    ask = [{"role": "user", "content": ASK}]
    text = client.messages.create(model="m", max_tokens=24, messages=ask, extra_body=GREEDY).content[0].text
    stop = text[6:9]
    assert len(stop) == 3, text
    m = client.messages.create(model="m", max_tokens=24, messages=ask, stop_sequences=[stop], extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text.split(stop)[0]


def test_a_forced_call_cut_off_by_max_tokens_is_a_tool_use_with_partial_input(client):
    """Its arguments are not JSON yet: the block's input holds the members complete so far, as the SDK reads
    the same reply streamed (it was {} while the stream gave them; a 500 once, the arguments parsed as they
    were), and stop_reason says max_tokens."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    full = client.messages.create(model="m", max_tokens=120, messages=ask, tools=[WEATHER],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    cut = [b for b in full.content if b.type == "tool_use"]
    assert full.stop_reason == "tool_use" and cut
    m = client.messages.create(model="m", max_tokens=full.usage.output_tokens - 3, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens"
    (partial,) = [b for b in m.content if b.type == "tool_use"]
    assert partial.name == cut[0].name and partial.input != cut[0].input
    with client.messages.stream(model="m", max_tokens=full.usage.output_tokens - 3, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [partial.input]


def test_forced_tool_call_and_its_result_round_trip(server, client, chat):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    # one call at most: the grammar then bounds the call's length (a random model might not end an array)
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    m = client.messages.create(model="m", max_tokens=120, messages=ask, tools=[WEATHER], tool_choice=any_one,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    named = client.messages.create(model="m", max_tokens=120, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.type for b in named.content] == ["tool_use"] and named.stop_reason == "tool_use"
    events = sse(server.url, {"max_tokens": 120, "messages": ask, "tools": [WEATHER], "tool_choice": any_one,
                              **GREEDY})
    blocks = [b for b in streamed_blocks(events) if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in blocks] == [(c.name, c.input) for c in calls]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # the result goes back as a user message's tool_result block: it renders as chat's tool message does
    call = calls[0]
    history = [*ask, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call.model_dump(
        include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "18 C, sunny"}]}, {"type": "text", "text": "And?"}]}]
    m = client.messages.create(model="m", max_tokens=8, messages=history, tools=[WEATHER], extra_body=GREEDY)
    as_chat = [*ask, {"role": "assistant", "content": "Let me look.", "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}, {"role": "user", "content": "And?"}]
    want = chat.chat.completions.create(model="m", messages=as_chat, max_tokens=8,
                                        tools=[{"type": "function", "function": {
                                            "name": WEATHER["name"], "description": WEATHER["description"],
                                            "parameters": WEATHER["input_schema"]}}], **GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert "".join(b.text for b in m.content if b.type == "text") == (want.choices[0].message.content or "")


def test_a_thread_is_refused_so_that_the_sdk_sends_the_whole_history(server, client):
    """Anthropic's message-threads beta asks the server to hold the conversation (a `continue` sends only the
    new turn): refused with the error code on which the SDK resends the turn whole and without `thread`. It
    was ignored: a continue was answered without the conversation, and the SDK's default tool runner got a
    400 about a tool_result that answered nothing."""
    for thread in ({"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            resp = httpx.post(server.url + path, headers={"x-api-key": KEY}, timeout=60, json={
                "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thread": thread})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and "stateless" in error["message"], error
            assert error["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
    if not hasattr(client.beta.messages, "tool_runner"):
        return
    from anthropic.lib.tools import beta_tool

    @beta_tool
    def get_weather(city: Literal["Paris", "Lyon"]) -> str:  # (a few choices: the random model's call ends)
        """Current weather in a city."""
        return "18 C, sunny"

    # the SDK's tool runner threads by default: its second turn sends the call's tool_result, which answers a
    # call of the first turn only if the whole history goes with it
    runner = client.beta.messages.tool_runner(model="m", max_tokens=120, tools=[get_weather],
                                              tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                              messages=[{"role": "user", "content": "Weather in Paris?"}],
                                              extra_body=GREEDY, max_iterations=2)
    replies = list(runner)
    assert len(replies) == 2 and replies[0].stop_reason == "tool_use", replies


def test_a_final_assistant_message_is_a_prefill(client, chat):
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "The sea"}]
    m = client.messages.create(model="m", max_tokens=8, messages=history, extra_body=GREEDY)
    want = chat.chat.completions.create(model="m", messages=history, max_tokens=8,
                                        extra_body={"continue_final_message": True}, **GREEDY)
    assert m.content[0].text == want.choices[0].message.content


def test_output_config_format_is_a_json_schema(client):
    m = client.messages.create(model="m", max_tokens=40, messages=[{"role": "user", "content": "Is it sunny?"}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": FLAG}}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), FLAG)


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": USER}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aaaa"}}]}]}, 400, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, 400, "matches no tool_use"),
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}, 400, "tool_result"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}, 400, "cannot hold"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "server tools"),
    ({"max_tokens": 4, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "name"),
    ({"max_tokens": 4, "messages": USER, "model": "claude-sonnet-4-5"}, 404, "does not exist"),
    # context errors in Anthropic's words, whose numbers clients read back
    ({"max_tokens": 10**7, "messages": USER}, 400, "input length and `max_tokens` exceed context limit: "),
    ({"max_tokens": 10**7, "messages": USER}, 400, " + 10000000 > "),
    ({"max_tokens": 10**7, "messages": USER}, 400, ", decrease input length or `max_tokens` and try again"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 200_000}]}, 400, "prompt is too long: "),
    # the chat path's checks, told in this API's field names
    ({"max_tokens": 0, "messages": USER}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": USER, "tools": [{**WEATHER, "input_schema": {"type": "object", "properties": 3}}]},
     400, "tools.[0].input_schema"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "get_time", "description": "the time"}]},  # required
     400, "tool 'get_time' has no input_schema"),
    ({"max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "not": {}}}}}}}, 400, "output_config.format"),
    # blocks that hold text only, told by what is wrong with them
    ({"max_tokens": 4, "messages": USER, "system": [{"type": "image", "source": {}}]}, 400, "type 'image'"),
    ({"max_tokens": 4, "messages": USER, "system": [{"type": "text"}]}, 400, "needs its text"),
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": {}}]}]}]}, 400,
     "type 'image'"),
    # Anthropic's own limits and server-side features
    ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 4, "messages": USER, "mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, 400,
     "server-side"),
    ({"max_tokens": 4, "messages": USER, "container": "c1"}, 400, "server-side"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": ""}]}, 400, "non-empty content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": []}, *USER]}, 400, "non-empty content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                  {"type": "text", "text": ""}]}]}, 400,
     "messages.0.content.1: text content blocks must be non-empty"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled"}}, 400, "budget_tokens"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "banana"}}, 400, "thinking.type must be"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "must be less than max_tokens"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": [str(i) for i in range(20)]}, 400, "'stop_sequences'"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": ["x", " \n"]}, 400,
     "stop_sequences.1: each stop sequence must contain non-whitespace"),
    ({"max_tokens": 4, "messages": USER, "top_k": -1}, 400, "top_k"),
    ({"max_tokens": 4, "messages": USER, "output_format": {"type": "json_schema", "schema": {"type": "object"}},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400, "both given"),
    # a tool_use the next message does not answer with its tool_result, as Anthropic's API refuses it
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}, {"role": "user", "content": "and?"}]}, 400,
     "without tool_result blocks immediately after: toolu_1"),
    # the chat path's structured-output extensions: refused by name (they were ignored, the output free)
    ({"max_tokens": 4, "messages": USER, "structured_outputs": {"regex": "a+"}}, 400, "output_config.format"),
    ({"max_tokens": 4, "messages": USER, "guided_json": {"type": "object"}}, 400, "guided_json is not taken here"),
    ({"max_tokens": 4, "messages": USER, "response_format": {"type": "json_object"}}, 400,
     "response_format is not taken here"),
    # a prefill ending in whitespace, as Anthropic's API refuses it (the model went astray after a lone space)
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": "The answer is "}]}, 400,
     "cannot end with trailing whitespace"),
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": [{"type": "text", "text": "So\n"}]}]}, 400,
     "cannot end with trailing whitespace"),
    # the middlewares' answers, before any route: in this API's shape too
    ({"max_tokens": 4, "messages": USER, "__key": "wrong"}, 401, "API key"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 3_000_000}]}, 413, "larger than the limit"),
])
def test_bad_requests_get_anthropic_errors(server, body, status, needle):
    key = body.pop("__key", KEY)
    resp = httpx.post(server.url + "/v1/messages", json={"model": "m", **body}, headers={"x-api-key": key}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    assert err["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                                    413: "request_too_large"}[status]
    assert needle in err["error"]["message"], err
    for chat_name in ("function.parameters", "response_format", "echo with logprobs", "completions API"):
        assert chat_name in needle or chat_name not in err["error"]["message"], err


def test_a_wrong_method_is_an_invalid_request(server):
    resp = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods
    assert resp.json()["error"]["type"] == "invalid_request_error", resp.text
    models = httpx.delete(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=60)
    assert models.status_code == 405 and models.headers["allow"] == "GET, HEAD", models.headers
    error = models.json()["error"]
    assert error["code"] == "method_not_allowed" and "use GET, HEAD" in error["message"]


def test_errors_are_counted_by_their_openai_code(server):
    """An Anthropic-shaped error counts in mlaserve_request_errors_total under the code the OpenAI routes'
    same error has (the dashboards' labels), not under Anthropic's error type."""
    def count(code: str, status: int) -> float:
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("mlaserve_request_errors_total{") and f'code="{code}"' in line and \
                    f'status="{status}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    before = count("model_not_found", 404), count("context_length_exceeded", 400)
    for body in ({"model": "nope", "max_tokens": 4}, {"model": "m", "max_tokens": 100000}):
        httpx.post(server.url + "/v1/messages", json={**body, "messages": USER}, headers={"x-api-key": KEY}, timeout=60)
    assert (count("model_not_found", 404), count("context_length_exceeded", 400)) == (before[0] + 1, before[1] + 1)


def test_output_format_is_the_betas_spelling_of_output_config_format(client):
    m = client.messages.create(model="m", max_tokens=40, messages=[{"role": "user", "content": "Is it sunny?"}],
                               extra_body={"output_format": {"type": "json_schema", "schema": FLAG}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), FLAG)


def test_an_overload_is_529_as_anthropics():
    from server.serving import anthropic_error
    from server.state import error_response

    resp = anthropic_error(error_response(503, "busy", "server_error", code="overloaded"))
    assert resp.status_code == 529 and json.loads(resp.body)["error"]["type"] == "overloaded_error"
    assert anthropic_error(error_response(503, "down", "server_error", code="engine_error")).status_code == 503


def test_either_key_header_will_do(server):
    """The Anthropic SDK sends x-api-key, and a stale bearer token beside it must not lock the client out
    (nor the other way round)."""
    body = {"model": "m", "max_tokens": 2, "messages": USER}
    for headers in ({"x-api-key": "stale", "authorization": f"Bearer {KEY}"},
                    {"x-api-key": KEY, "authorization": "Bearer stale"}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    assert httpx.post(server.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": "stale", "authorization": "Bearer stale"}).status_code == 401


def test_sdk_errors_and_the_key(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.request_id  # the SDK reads Anthropic's `request-id` header (it was None)
    reply = client.messages.with_raw_response.create(model="m", max_tokens=1, messages=USER)
    assert reply.headers["request-id"] == reply.headers["x-request-id"] and reply.parse()._request_id
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=0, messages=USER)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="m", max_tokens=4, messages=USER)
    bad = httpx.post(server.url + "/v1/messages", content=b"{", headers={"x-api-key": KEY, "content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_thinking_blocks_are_the_turns_reasoning():
    from server.messages_api import MessagesRequest, to_chat_request

    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                          {"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks."}]}
    chat = to_chat_request(MessagesRequest.model_validate(body))
    assert [(m.role, m.reasoning_content) for m in chat.messages] == [
        ("user", None), ("assistant", "Look it up."), ("user", None)]


def test_a_strict_tool_is_a_strict_function():
    """Anthropic's strict tool use is chat's `strict` (under auto, the calls are then held to the schema)."""
    from server.messages_api import MessagesRequest, to_chat_request
    from server.tools import plan_tools

    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{**WEATHER, "strict": True}, {**WEATHER, "name": "other"}]}
    chat = to_chat_request(MessagesRequest.model_validate(body))
    assert [t.function.strict for t in chat.tools] == [True, None]
    plan = plan_tools(chat, DSV3_TEMPLATE.read_text())
    assert plan.free and plan.structured.kind == "structural_tag" and '"maxLength": 16' in plan.structured.spec


def test_consecutive_messages_of_one_role_are_one_turn(server, client):
    """As Anthropic's API: consecutive user (or assistant) messages are combined into one turn, their blocks in
    order. Tool results sent one user message each answer the calls together (a 400 before), a prefill split
    over two assistant messages is one prefill, and an empty final assistant message is no prefill (a 400
    before); the prompt is the one the combined request renders."""
    from server.messages_api import MessagesRequest, to_chat_request

    def count(messages: list) -> int:
        return client.messages.count_tokens(model="m", messages=messages).input_tokens

    def chat_of(messages: list) -> list:
        chat = to_chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": messages}))
        return [m.model_dump(exclude_none=True, exclude={"reasoning_content"}) for m in chat.messages]

    rng = random.Random()
    a, b = rng.choice(["hi", "hello", "hey"]), rng.choice(["there", "you", "friend"])
    split = [{"role": "user", "content": a}, {"role": "user", "content": [{"type": "text", "text": b}]}]
    whole = [{"role": "user", "content": [{"type": "text", "text": a}, {"type": "text", "text": b}]}]
    assert chat_of(split) == chat_of(whole) and count(split) == count(whole)
    calls = {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{k}", "name": "get_weather",
                                               "input": {"city": c}} for k, c in enumerate(["Paris", "Lyon"])]}
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": t} for k, t in enumerate(["9C", "12C"])]
    one_each = [*USER, calls, *({"role": "user", "content": [r]} for r in results)]
    together = [*USER, calls, {"role": "user", "content": results}]
    assert chat_of(one_each) == chat_of(together)
    assert count(one_each) == count(together)
    prefill = [*USER, {"role": "assistant", "content": "The"}, {"role": "assistant", "content": [{"type": "text",
                                                                                                 "text": "sea"}]}]
    assert chat_of(prefill) == chat_of([*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "The"}, {"type": "text", "text": "sea"}]}])
    for empty in ("", []):
        m = client.messages.create(model="m", max_tokens=3, messages=[*USER, {"role": "assistant", "content": empty}],
                                   extra_body=GREEDY)
        assert m.content == client.messages.create(model="m", max_tokens=3, messages=USER, extra_body=GREEDY).content
        assert count([*USER, {"role": "assistant", "content": empty}]) == count(USER)
    alone = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": ""}]})
    assert alone.status_code == 400 and "no content to answer" in alone.json()["error"]["message"], alone.text


def test_the_anthropic_sdk_lists_and_retrieves_the_model(client, chat):
    """A request with `anthropic-version` (the SDK always sends it) gets Anthropic's model shapes (the SDK read
    OpenAI's list: type, display_name, created_at, has_more, first_id all None); OpenAI's clients keep theirs."""
    import datetime

    page = client.models.list()
    (info,) = page.data
    assert info.type == "model" and info.id == "m" and info.display_name == "m"
    assert isinstance(info.created_at, datetime.datetime) and page.has_more is False and page.first_id == "m"
    assert client.models.retrieve("m").id == "m"
    for raw in (client.models.with_raw_response.list().http_response.json()["data"][0],
                client.models.with_raw_response.retrieve("m").http_response.json()):  # the SDK's type, strictly
        got = anthropic.types.ModelInfo.model_validate_json(json.dumps(raw), strict=True)
        assert got.lifecycle == "active" and got.max_input_tokens - 1 == got.max_tokens > 1000, raw
    # the cursor parameters: the page after (or before) the one model is empty, as Anthropic's list pages
    # (a loop that stops on an empty page never stopped); a bad limit or an unknown cursor is a 400
    assert client.models.list(after_id="m").data == [] and client.models.list(before_id="m", limit=5).data == []
    assert [m.id for m in client.models.list(limit=1000).data] == ["m"]
    for bad in ({"limit": 0}, {"limit": 1001}, {"after_id": "other"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.models.list(**bad)
        assert e.value.body["error"]["type"] == "invalid_request_error"
    page = client.models.with_raw_response.list(after_id="m")
    assert page.http_response.json() == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    assert page.headers["request-id"]  # on every route an Anthropic client calls, where its SDK reads it
    for digits in ("%C2%B2", "%D9%A3"):  # Unicode digits Python's isdigit takes: a 400 (one was a 500)
        r = httpx.get(f"{str(client.base_url).rstrip('/')}/v1/models?limit={digits}",
                      headers={"anthropic-version": "2023-06-01", "x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError) as e:  # any route's error, in the shape this client reads
        client.get("/v1/nothing-here", cast_to=dict)
    assert e.value.body["error"]["type"] == "not_found_error"
    (card,) = chat.models.list().data
    assert card.id == "m" and card.object == "model" and card.owned_by == "mlaserve"


def test_openai_routes_answer_in_openai_shapes_whatever_headers_come(chat):
    """A proxy or shared client may send `anthropic-version` on every call: the OpenAI routes' errors kept
    Anthropic's shape then, with the Messages API's field names (`stop` refused as 'stop_sequences', no
    param or code for the SDK to read)."""
    tagged = chat.with_options(default_headers={"anthropic-version": "2023-06-01"})
    with pytest.raises(openai.BadRequestError) as e:
        tagged.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       stop=["x"] * 17)
    assert e.value.param == "stop" and "stop_sequences" not in str(e.value.body), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        tagged.completions.create(model="m", prompt="hi", max_tokens=3, extra_body={"max_tokens": "3"})
    assert e.value.param == "max_tokens" and e.value.body["type"] == "invalid_request_error", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        tagged.responses.create(model="m", input="hi", extra_body={"max_output_tokens": "x"})
    assert e.value.param == "max_output_tokens", e.value.body
