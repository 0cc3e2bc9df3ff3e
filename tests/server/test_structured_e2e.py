"""Structured outputs and forced tool calls through the official OpenAI SDK, against a real server on
the default model (SmolLM2-135M-Instruct, Q4_1 GGUF). The oracle for validity is `jsonschema`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"

SCHEMAS = {
    "nested objects": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}}, "required": ["name", "address"]}}, "required": ["user"]},
    "arrays with min/max items": {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4}},
        "required": ["colors"]},
    "enum, required and optional": {"type": "object", "properties": {
        "status": {"enum": ["ok", "error", "pending"]}, "note": {"type": "string", "maxLength": 30},
        "retry": {"type": "boolean"}}, "required": ["status"]},
    "numbers with bounds": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "count": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["score", "count"]},
    "string patterns": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                         "day": {"type": "string", "format": "date"}},
                        "required": ["code", "day"]},
    "$ref and $defs": {"$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}, "type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}},
        "required": ["items"]},
    "annotations, OpenAPI's x-* and int64, strict formats": {"type": "object", "title": "Host", "x-order": 1,
        "properties": {"ip": {"type": "string", "format": "ipv4", "x-example": "10.0.0.1"},
                       "seen": {"type": "string", "format": "date-time", "contentMediaType": "text/plain"},
                       "port": {"type": "integer", "format": "int32", "minimum": 1}},
        "required": ["ip", "seen", "port", "tag"], "patternProperties": {"^tag$": {"type": "string", "maxLength": 12}},
        "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,12}/[A-Z][a-z]{2,12}$"}},
    "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather and the time in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(MODEL, "--max-total-tokens", "65536", "--context-length", "2048",
                        "--grammar-compile-timeout", "10", log=tmp_path_factory.mktemp("log") / "server.log")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def streamed(client, **kw) -> dict[int, dict]:
    """Per choice index: content, tool calls (assembled from their deltas) and finish_reason."""
    out: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": None, "calls": {}, "finish": None})  # None: never sent
            if c.delta.content is not None:
                o["content"] = (o["content"] or "") + c.delta.content
            for d in c.delta.tool_calls or ():
                call = o["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None and d.function.name and d.type == "function"  # first delta only
                    call["id"], call["name"] = d.id, d.function.name
                else:
                    assert d.function.name is None
                call["arguments"] += d.function.arguments or ""
            o["finish"] = c.finish_reason or o["finish"]
    return out


def calls_stream_and_continue(client, kw: dict, r) -> None:
    """Response `r` to `kw` made tool calls: streamed, the same content, calls and finish reason; and the
    conversation goes on, the calls and their results rendered back by the template (a longer prompt)."""
    c = r.choices[0]
    s = streamed(client, **kw)[0]
    assert s["content"] == c.message.content and s["finish"] == "tool_calls"
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    history = kw["messages"] + [{"role": "assistant", "content": None,
                                 "tool_calls": [t.model_dump() for t in c.message.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": t.id, "content": "21C"} for t in c.message.tool_calls]
    r2 = client.chat.completions.create(model=kw["model"], messages=history, tools=kw["tools"], max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_matches_its_schema(client, name):
    schema = SCHEMAS[name]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Give an example of {name} as JSON."}],
              response_format={"type": "json_schema", "json_schema": {"name": "example", "schema": schema, "strict": True}},
              max_tokens=400, temperature=0.8, seed=7)
    for n in (1, 4):
        r = client.chat.completions.create(n=n, **kw)
        assert len(r.choices) == n
        for c in r.choices:
            assert c.finish_reason == "stop", c
            check(schema, c.message.content)
        s = streamed(client, n=n, **kw)
        assert sorted(s) == list(range(n))
        for o in s.values():
            assert o["finish"] == "stop" and not o["calls"]
            check(schema, o["content"])
        if n == 1:  # the same seed gives the same document either way
            assert s[0]["content"] == r.choices[0].message.content


class Recipe(BaseModel):
    title: str = Field(max_length=40)
    minutes: int = Field(ge=1, le=240)
    vegetarian: bool
    ingredients: list[str] = Field(min_length=1, max_length=5)


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A quick soup recipe."}],
                                      response_format=Recipe, max_tokens=300, temperature=0.7, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Recipe) and 1 <= len(parsed.ingredients) <= 5


def test_json_object_regex_choice_and_grammar(client, server):
    # At OpenAI's defaults (temperature 1, top_p 1; not the model's) a sampled object may still be open
    # at max_tokens, and which seed closes one moves with the last bits of the logits (a bf16 cache's
    # summation order did it once): the first of a few seeds whose object closes must give one that parses
    for seed in range(1, 6):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Some JSON please."}],
                                           response_format={"type": "json_object"}, max_tokens=300, seed=seed,
                                           temperature=1.0, top_p=1.0)
        if r.choices[0].finish_reason == "stop":
            break
        assert r.choices[0].finish_reason == "length"
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    rx = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, seed=2,
                                       extra_body={"structured_outputs": {"regex": rx}})
    import re
    assert re.fullmatch(rx, r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    # SGLang's spelling, on the completions API
    resp = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The answer is", "max_tokens": 20, "ebnf": 'root ::= ("yes" | "no") "!"'})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] in ("yes!", "no!")
    # llama.cpp server's: a GBNF `grammar`, and `json_schema` as the schema object
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 20, "grammar": 'root ::= ("sunny" | "rainy") "."'})
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] in ("sunny.", "rainy.")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 30, "seed": 3, "json_schema": schema})
    assert resp.status_code == 200, resp.text
    if resp.json()["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(resp.json()["choices"][0]["message"]["content"])) == {"n"}
    # and llama.cpp server's response_format of type json_object with a `schema` (it was left unconstrained)
    seven = {"type": "object", "properties": {"zz": {"type": "integer", "minimum": 7, "maximum": 7}}, "required": ["zz"],
             "additionalProperties": False}
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object", "schema": seven}})
    assert resp.status_code == 200 and json.loads(resp.json()["choices"][0]["message"]["content"]) == {"zz": 7}, resp.text


def test_cut_short_by_max_tokens_is_length(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["nested objects"]}})
    assert r.choices[0].finish_reason == "length"


def test_logprobs_are_those_of_the_constrained_distribution(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=20,
                                       temperature=0, extra_body={"guided_choice": ["sunny", "rainy"]})
    first = r.choices[0].logprobs.content[0]
    alts = first.top_logprobs  # the masked tokens are none of them (they were, at -9999, past those allowed)
    assert alts and all("sunny".startswith(t.token) or "rainy".startswith(t.token) for t in alts), alts
    assert abs(sum(2.718281828 ** t.logprob for t in alts) - 1.0) < 1e-3


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_of_a_grammar(server, stream):
    """The completions API's logprobs under a grammar allowing fewer tokens than asked for: only those (a
    500 before: the masked tokens' -inf reached the JSON encoder; streamed, they were nulls)."""
    body = {"model": MODEL, "prompt": "The weather today:", "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "guided_choice": ["sunny", "rainy"], "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        tops = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["top_logprobs"]]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    else:
        choice = r.json()["choices"][0]
        tops, text = choice["logprobs"]["top_logprobs"], choice["text"]
    assert text in ("sunny", "rainy") and tops, r.text
    first = tops[0]
    assert all("sunny".startswith(t) or "rainy".startswith(t) for t in first), first
    assert abs(sum(2.718281828 ** v for v in first.values()) - 1.0) < 1e-3
    assert all(v > -9999 for top in tops for v in top.values()), tops


def test_named_tool_choice_returns_a_valid_call(client):
    """The forced call ends with finish_reason "stop", streamed or not, as OpenAI's does ("required"
    and "auto" end with "tool_calls")."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=200, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check(WEATHER["function"]["parameters"], call.function.arguments)
    s = streamed(client, **kw)[0]
    assert s["finish"] == "stop" and s["content"] is None  # null, as the whole answer's (and OpenAI's stream)
    with client.chat.completions.stream(**kw) as helper:  # the SDK's stream helper assembles the same message
        final = helper.get_final_completion().choices[0].message
    assert final.content is None and [c.function.arguments for c in final.tool_calls] == [call.function.arguments]
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == [("get_weather", call.function.arguments)]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client, parallel):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=300, seed=9,
              parallel_tool_calls=parallel, n=2)
    r = client.chat.completions.create(**kw)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        assert parallel or len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            check(schemas[call.function.name], call.function.arguments)
    s = streamed(client, **kw)
    for i, c in enumerate(r.choices):
        assert s[i]["finish"] == "tool_calls" and s[i]["content"] is None
        assert [(v["name"], v["arguments"]) for v in s[i]["calls"].values()] == \
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_with_a_response_format_is_the_call(client, choice):
    """OpenAI takes a response format beside a forced call (the OpenAI Agents SDK sends both when an agent
    has an output type and tool_choice "required"): the forced turn is the call, the format is for a turn
    that answers in text. A bad format is still refused (it was a 400 either way)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
        "additionalProperties": False}}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       response_format=fmt, max_tokens=200, seed=3, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.message.content is None and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    check({t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name],
          call.function.arguments)
    bad = dict(fmt, json_schema=dict(fmt["json_schema"], schema={"type": "strin"}))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                       response_format=bad, max_tokens=20)
    assert info.value.body["param"] == "response_format"


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Shipment(BaseModel):
    to: Address
    back: Address | None = None
    boxes: int = Field(ge=1, le=9)


def test_required_tool_choice_keeps_each_tools_own_references(client):
    """Pydantic writes a nested model as `$defs` and `#/$defs/Address`; forcing one of several calls puts
    each tool's parameters into one schema, where those references must still resolve (they were a 400)."""
    ship = {"type": "function", "function": {"name": "ship", "parameters": Shipment.model_json_schema()}}
    assert "$defs" in ship["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Ship 2 boxes to Paris."}],
                                       tools=[WEATHER, ship], tool_choice="required", max_tokens=300, seed=4, n=3,
                                       parallel_tool_calls=False)
    names = set()
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            names.add(call.function.name)
            if call.function.name == "ship":
                Shipment.model_validate_json(call.function.arguments)
            else:
                check(WEATHER["function"]["parameters"], call.function.arguments)
    assert names


def nested(levels: int, wrap) -> dict:
    """A schema `levels` deep, each level made by `wrap` around the one inside it."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = wrap(schema)
    return schema


def in_array(inner: dict) -> dict:
    return {"type": "array", "items": inner, "maxItems": 1}


def in_object(inner: dict) -> dict:
    return {"type": "object", "properties": {"a": inner}}


def post(server, body):
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, **body}, timeout=60)


BAD = [
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "multipleOf": 3}}}}, "response_format", "multipleOf"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}, "response_format", "uniqueItems"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, "response_format", "not a valid JSON Schema"),
    ({"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "response_format", "leads back to itself"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}}, "response_format", "points at nothing"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}]}, "tools.[0].function.parameters", "points at nothing"),
    ({"messages": ASK, "response_format": {"type": "xml"}}, "response_format.type", None),
    # xgrammar would drop the length beside a pattern or format: an output past maxLength, answered 200
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}}}}},
     "response_format", "maxLength together with pattern"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "format": "email", "minLength": 5}}}}}],
      "tool_choice": "required"}, "tools.[0].function.parameters", "minLength together with format"),
    # lookaheads: xgrammar takes them in a schema's pattern and does not enforce them ("abc" for ^(?=zzz)...)
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^(?=zzz)[a-z]{3,6}$"}}}}, "response_format", "has a lookahead or lookbehind"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {"^(?!a)[ab]{2}$": {"type": "integer"}}}}}},
     "response_format", "has a lookahead or lookbehind"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}], "tool_choice": "required"},
     "tools.[0].function.parameters", "has a lookahead or lookbehind"),
    # deep enough to exhaust the schema checks' recursion (a 500 before the depth limit), small as a body
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
        nested(150, in_array)}}}, "response_format", "nests deeper than"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters":
        nested(100, in_object)}}]}, "tools.[0].function.parameters", "nests deeper than"),
    ({"messages": ASK, "guided_json": nested(65, in_array)}, "guided_json", "nests deeper than"),
    ({"messages": ASK, "extra_field": 1, "regex": "(", "response_format": None}, "regex", "regular expression"),
    ({"messages": ASK, "ebnf": "root ::= undefined"}, "ebnf", "undefined"),
    ({"messages": ASK, "grammar": "root ::= undefined"}, "grammar", "undefined"),
    ({"messages": ASK, "json_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json_schema", None),
    ({"messages": ASK, "grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, None, "one structured output"),
    ({"messages": ASK, "regex": "a+", "response_format": {"type": "json_object"}}, None, "one structured output"),
    ({"messages": ASK, "response_format": {"type": "text", "schema": {"type": "object"}}}, "response_format",
     "goes with type 'json_object'"),
    ({"messages": ASK, "response_format": {"type": "json_object", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)y"}}}}}, "response_format", "response_format.schema: the pattern"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "needs tools"),
    # refused where the engine compiles it: named by the tool's schema (it said tool_choice)
    ({"messages": ASK, "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.[1].function.parameters", "cannot be compiled"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.[0].function.name", None),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.[0].function.name", None),
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools", "twice"),
    # a tool's parameters are checked whatever the tool_choice (auto and none only show them to the model)
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools.[0].function.parameters", "not a valid JSON Schema"),
    ({"messages": ASK, "tool_choice": "none", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": "x"}}}]}, "tools.[0].function.parameters", "not a valid JSON Schema"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.[0].function.parameters", "must be the JSON Schema of an object"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c2", "content": "9C"}],
      "tools": [WEATHER]}, "messages.[2].tool_call_id", "c2"),
    # objects the engine could not keep to: a declared key written again as another, no object at all
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "propertyNames": {"pattern": "^a$"}}}}},
     "response_format", "propertyNames beside properties"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {}, "required": ["z"], "additionalProperties": False}}}},
     "response_format", "no object satisfies"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"at": {"type": "string", "format": "uri-template"}}}}}], "tool_choice": "required"},
     "tools.[0].function.parameters", "format 'uri-template'"),
]


@pytest.mark.parametrize("body,param,needle", BAD)
def test_bad_structured_requests_are_400s_naming_the_param(server, body, param, needle):
    resp = post(server, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if needle is not None:
        assert needle in err["message"], err


def test_a_schema_just_within_the_depth_limit_is_kept(client):
    """64 levels of JSON containers are accepted and enforced: 63 arrays around an integer."""
    schema = nested(63, in_array)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                       extra_body={"guided_json": schema})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    else:  # cut short: still a prefix of valid JSON made only of brackets, an integer and its closers
        assert set(r.choices[0].message.content) <= set("[]-0123456789 \n")


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_model_sees_the_tools_whatever_forces_the_call(server, choice):
    """The default model's template ignores `tools`: every choice but "none" lists them in a system prompt
    of ours (a forced call's arguments are filled in by a model that has read the descriptions)."""
    def rendered(tool_choice):
        ids = httpx.post(server.url + "/tokenize", timeout=60, json={
            "model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice}).json()["tokens"]
        return httpx.post(server.url + "/detokenize", timeout=60, json={"model": MODEL, "tokens": ids}).json()["prompt"]

    assert "Current weather in a city" not in rendered("none")
    text = rendered(choice)
    assert "Current weather in a city" in text and '"get_time"' in text, text
    assert ("<tool_call>" in text) == (choice == "auto"), text  # forced calls are written as bare JSON


def test_an_assistant_turn_with_neither_content_nor_calls_is_an_empty_reply(server):
    """vLLM reads it so; the default model's template would fail on its null content (a 400 that spoke
    of the template's internals)."""
    history = [*ASK, {"role": "assistant", "content": None}, {"role": "user", "content": "Well?"}]
    resp = post(server, {"messages": history, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    empty = post(server, {"messages": [*ASK, {"role": "assistant", "content": ""}, history[-1]], "max_tokens": 2})
    assert resp.json()["usage"]["prompt_tokens"] == empty.json()["usage"]["prompt_tokens"]


def test_a_schema_that_compiles_too_long_is_a_400_and_the_rest_go_on(server, client):
    """A pattern xgrammar compiles for ~100 s (`{1,26000}`): refused once it has compiled for the
    server's --grammar-compile-timeout (10 s here), while a constrained and a plain request are served
    beside it; before, it held a compile thread and a core for its whole compile."""
    from concurrent.futures import ThreadPoolExecutor

    slow = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {
        "type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{1,26000}$"}}, "required": ["id"]}}}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(post, server, {"messages": ASK, "response_format": slow})
        beside = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                                response_format={"type": "json_object"})
        # a whole object, or one cut by max_tokens (sampled at the model's defaults: which, the seed decides)
        assert beside.choices[0].finish_reason == "length" or json.loads(beside.choices[0].message.content) is not None
        assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices[0].finish_reason == "length"
        resp = refused.result()
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "response_format" and "took longer than 10 s to compile" in err["message"], err
    r = post(server, {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}})
    assert r.status_code == 200, r.text


def test_the_server_keeps_serving_after_refusals(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_auto_tool_calls_are_parsed_from_the_models_markup(client):
    """tool_choice auto: the default model's template ignores `tools`, so the server lists them in a
    system prompt of its own and reads Hermes markup back. A regex makes the model write that markup
    (text, then a call), so the parser runs on real generated tokens, streamed and not."""
    rx = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
          r'"unit": "celsius"\}\}\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, seed=4,
              extra_body={"structured_outputs": {"regex": rx}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.strip() == "Let me check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        pieces += [ch.delta.content for ch in chunk.choices if ch.delta.content]
    assert not any("<" in p or "tool_call" in p for p in pieces), pieces  # no markup leaks into content
    s = streamed(client, **kw)[0]
    assert s["content"] == c.message.content and s["finish"] == "tool_calls"
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == [("get_weather", call.function.arguments)]


def test_auto_tool_call_arguments_stream_as_written_and_a_cut_off_call_stays_a_call(client):
    """A Hermes call opens once `{"name": ..., "arguments": {` is written, and its arguments stream in
    pieces as the model writes them (the block was held to `</tool_call>` and sent as one delta). Cut off
    by max_tokens inside its arguments, the reply is the call begun, its arguments partial, with
    finish_reason "length", whole and streamed alike (it was the markup, as content)."""
    rx = (r'Let me check\.\n<tool_call>\n\{"name": "write_note", "arguments": \{"text": "[a-z ]{60,80}"\}\}\n'
          r'</tool_call>')
    note = {"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    kw = dict(model=MODEL, messages=ASK, tools=[note], seed=4, extra_body={"structured_outputs": {"regex": rx}})
    whole = client.chat.completions.create(max_tokens=200, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)["text"]
    assert 60 <= len(args) <= 80
    pieces = [d.function.arguments for chunk in client.chat.completions.create(max_tokens=200, stream=True, **kw)
              for ch in chunk.choices for d in ch.delta.tool_calls or () if d.function.arguments]
    assert "".join(pieces) == call.function.arguments and len(pieces) > 3, pieces
    n = client.chat.completions.create(max_tokens=200, **kw).usage.completion_tokens
    cut = client.chat.completions.create(max_tokens=n - 8, **kw).choices[0]  # inside the note's text
    assert cut.finish_reason == "length" and cut.message.content.strip() == "Let me check.", cut
    (partial,) = cut.message.tool_calls
    assert partial.function.name == "write_note" and partial.function.arguments.startswith('{"text": "'), partial
    assert call.function.arguments.startswith(partial.function.arguments)
    s = streamed(client, max_tokens=n - 8, **kw)[0]
    assert (s["content"], s["finish"]) == (cut.message.content, "length")
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == [("write_note", partial.function.arguments)]


def test_min_tokens_holds_with_strict_tools_under_auto(client):
    """Strict tools under auto put a grammar on free text, which may end anywhere outside a call: min_tokens
    still holds its end off (it was dropped, as for a forced call's grammar, which alone decides the end)."""
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=300,
              temperature=0)
    free = client.chat.completions.create(tools=[strict], **kw)
    n = free.usage.completion_tokens
    assert free.choices[0].finish_reason != "length" and n < 280, free  # (it ends by itself)
    held = client.chat.completions.create(tools=[strict], extra_body={"min_tokens": n + 20}, **kw)
    assert held.usage.completion_tokens >= n + 20, held


def test_chat_logprobs_join_to_the_content_not_the_call_markup(client):
    """`logprobs.content` holds the tokens of the content (OpenAI's shape): a call's markup and a forced
    call's JSON carry none, whole or streamed (they listed every generated token: the Hermes markup, or the
    forced grammar's JSON array, beside a null content)."""
    rx = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
          r'"unit": "celsius"\}\}\n</tool_call>')
    auto = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, seed=4, logprobs=True,
                top_logprobs=2, extra_body={"structured_outputs": {"regex": rx}})
    forced = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=200, seed=5, logprobs=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for kw in (auto, forced):
        c = client.chat.completions.create(**kw).choices[0]
        assert c.message.tool_calls
        tokens = [t.token for t in c.logprobs.content]
        assert "".join(tokens) == (c.message.content or ""), (tokens, c.message.content)
        streamed_tokens = [t.token for chunk in client.chat.completions.create(stream=True, **kw)
                           for ch in chunk.choices if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content]
        assert streamed_tokens == tokens


def test_a_forced_call_cut_before_it_began_has_null_content(client):
    """max_tokens 1 cuts a forced call before any of it is a call: content null whole and streamed (the whole
    answer said "", the stream sent none)."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=1)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and not c.message.tool_calls, c
    s = streamed(client, **kw)[0]
    assert s["finish"] == "length" and s["content"] is None and not s["calls"]


def test_a_tool_round_trip_shows_the_model_its_own_calls(client, server):
    """The SDK's tool loop: the assistant message that called a tool (content None) goes back with the
    tool's result. The default model's template reads no `tool_calls` (it would render that turn empty,
    or fail on the None), so the server writes the call in the Hermes markup its tool prompt asks for,
    and the result in a <tool_response> block: the model sees which call the result answers."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, seed=5,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=60).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}, timeout=60).json()["prompt"]
    written = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)}, ensure_ascii=False)
    assert f"<tool_call>\n{written}\n</tool_call>" in text, text[-600:]
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text, text[-600:]


def test_required_calls_stream_as_written_and_a_cut_off_one_stays_a_call(client):
    """tool_choice "required": each call streams as the model writes it (its arguments in several pieces),
    one entry per call in a chunk; cut off by max_tokens, the reply ends with the call begun, its
    arguments partial, and nothing of the grammar's array in the content."""
    note = {"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    ask = [{"role": "user", "content": "Write a long note about the history of Rome."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[note], tool_choice="required", max_tokens=40,
                                       temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.content, c
    (call,) = c.message.tool_calls
    assert call.function.name == "write_note" and call.function.arguments.startswith('{"text": "'), call
    pieces, calls = [], {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, tools=[note], tool_choice="required",
                                                max_tokens=40, temperature=0, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.content
            entries = ch.delta.tool_calls or []
            assert len({e.index for e in entries}) == len(entries), entries  # one entry per call
            for e in entries:
                calls.setdefault(e.index, "")
                calls[e.index] += e.function.arguments or ""
                pieces.append(e.function.arguments)
    assert calls == {0: call.function.arguments} and len([p for p in pieces if p]) > 3, pieces


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_stop_string_that_cuts_a_forced_call_ends_in_stop_not_a_call_made(client, server, choice):
    """The grammar does not keep stop strings out of a forced call: "city" (a required key) cuts the
    arguments. The reply ends as cut ("stop", naming the string), as max_tokens leaves "length": it was
    "tool_calls" with arguments `{"`, and Anthropic's API said tool_use with the sequence dropped."""
    forced = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=forced, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == ("tool_calls" if choice == "required" else "stop"), whole
    assert all(json.loads(c.function.arguments)["city"] for c in whole.message.tool_calls)
    cut = client.chat.completions.create(stop=["city"], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == "city", cut
    assert "city" not in "".join(c.function.arguments for c in cut.message.tool_calls or ())
    assert streamed(client, stop=["city"], **kw)[0]["finish"] == "stop"
    if choice == "required":
        r = httpx.post(server.url + "/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": 120, "temperature": 0, "messages": ASK, "stop_sequences": ["city"],
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "tool_choice": {"type": "any"}})
        assert r.status_code == 200, r.text
        assert (r.json()["stop_reason"], r.json()["stop_sequence"]) == ("stop_sequence", "city"), r.json()
