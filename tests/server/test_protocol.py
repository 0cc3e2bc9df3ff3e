"""OpenAI request validation, the mapping to SamplingParams, and response shapes.

Oracle for the shapes: the official `openai` SDK, both its pydantic types and its real client
(streaming included) talking to canned HTTP answers built from our models.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatCompletionChunk
from pydantic import ValidationError

from scheduler.sampling_params import SamplingParams, StructuredOutput
from server.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    describe_validation_error,
    error_body,
    parse_logit_bias,
    checked_sampling_params,
    sse_data,
    to_sampling_params,
)
from scheduler.sampling_params import ParamError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _param_of_error(kind: type, body: dict) -> tuple[str | None, str]:
    """(param, message) of the 400 the server answers `body` with: the JSON shape is pydantic's check,
    the sampling values' ranges are `checked_sampling_params`'s (a ParamError)."""
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        # FastAPI reports the same errors with "body" in front of the location
        errors = [dict(err, loc=("body", *err["loc"])) for err in e.errors()]
        message, param = describe_validation_error(errors)
        return param, message
    with pytest.raises(ParamError) as info:
        checked_sampling_params(req, vocab_size=1000)
    return info.value.param, info.value.message


# ---------------------------------------------------------------- requests


def test_valid_requests_and_unknown_fields_ignored() -> None:
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None},
                              {"role": "tool", "content": "42", "tool_call_id": "t"}],
         "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "text"},
         "some_future_field": 1})
    messages = chat.openai_messages()
    assert [m["content"] for m in messages] == ["be brief", "x", "a\nb", "", "42"]  # an empty reply: ""
    refused = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": "ok"}]})
    assert refused.openai_messages()[1]["content"] == "I can't."  # an assistant's refusal part: what it said
    with pytest.raises(ValidationError, match="only 'text' parts"):
        ChatCompletionRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": [
            {"type": "refusal", "refusal": "no"}]}]})
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool"]  # developer: system
    assert messages[-1]["tool_call_id"] == "t" and chat.tools[0].function.name == "f" and chat.stop_strings() == []
    comp = CompletionRequest.model_validate({**COMPLETION, "suffix": None, "best_of": 1})
    assert comp.max_tokens == 16 and comp.prompts() == ["hi"]  # OpenAI's default for completions
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["", "END"]}).stop_strings() == ["END"]
    streamed = ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.include_usage and not ChatCompletionRequest.model_validate(CHAT).include_usage


def test_nulls_mean_defaults() -> None:
    """Clients that send every field, null where unset (LangChain and others), get OpenAI's defaults."""
    nulls = {f: None for f in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                               "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                               "stream", "stream_options", "ignore_eos", "user", "return_token_ids", "min_tokens")}
    chat = ChatCompletionRequest.model_validate({**CHAT, **nulls, "logprobs": None, "top_logprobs": None,
                                                 "max_completion_tokens": None})
    assert to_sampling_params(chat) == SamplingParams()
    comp = CompletionRequest.model_validate({**COMPLETION, **nulls, "logprobs": None, "echo": None})
    assert to_sampling_params(comp) == SamplingParams(max_tokens=16)  # this API's default, sent or not


OUT_OF_RANGE = [
    # (request kind, field, value, param the error must name)
    ("chat", "modalities", ["text", "audio"], "modalities"),  # text only: refused, not ignored
    ("chat", "audio", {"voice": "alloy", "format": "wav"}, "audio"),
    ("chat", "web_search_options", {}, "web_search_options"),  # nothing is searched: refused, not ignored
    ("chat", "temperature", -0.1, "temperature"),
    ("chat", "temperature", 101.0, "temperature"),
    ("chat", "temperature", "hot", "temperature"),
    ("completion", "top_p", -0.1, "top_p"),
    ("completion", "top_p", 1.01, "top_p"),
    ("chat", "top_k", -2, "top_k"),
    ("chat", "top_k", 10**23, "top_k"),  # past 64 bits: no engine message could carry it
    ("chat", "min_tokens", 2**64, "min_tokens"),
    ("completion", "max_tokens", 2**63, "max_tokens"),
    ("chat", "min_p", 1.5, "min_p"),
    ("chat", "n", 0, "n"),
    ("completion", "n", 129, "n"),
    ("chat", "n", 1.5, "n"),
    ("chat", "max_tokens", 0, "max_tokens"),
    ("chat", "max_tokens", "5", "max_tokens"),
    ("chat", "max_tokens", True, "max_tokens"),
    ("chat", "max_completion_tokens", 0, "max_completion_tokens"),
    ("completion", "max_tokens", -3, "max_tokens"),
    ("chat", "min_tokens", -1, "min_tokens"),
    ("chat", "stop", ["s"] * 17, "stop"),
    ("chat", "stop", [1, 2], "stop.[0]"),  # the list branch's item, not "should be a string"
    ("completion", "seed", 2**64, "seed"),
    ("chat", "seed", 2**63, "seed"),  # int64, as vLLM takes it (2^63 and -2^63 drew alike)
    ("completion", "seed", -(2**63) - 1, "seed"),
    ("chat", "presence_penalty", 2.5, "presence_penalty"),
    ("completion", "frequency_penalty", -2.01, "frequency_penalty"),
    ("chat", "repetition_penalty", 0.0, "repetition_penalty"),
    ("chat", "repetition_penalty", 10.5, "repetition_penalty"),
    ("chat", "logit_bias", {"abc": 1.0}, "logit_bias"),
    ("chat", "logit_bias", {"-5": 1.0}, "logit_bias"),
    ("completion", "logit_bias", {"5": 101.0}, "logit_bias"),
    ("chat", "logit_bias", {"7": 100.0, "07": -100.0}, "logit_bias"),  # one id twice: one would silently win
    ("chat", "logprobs", 3, "logprobs"),
    ("chat", "top_logprobs", 21, "top_logprobs"),
    ("chat", "top_logprobs", -1, "top_logprobs"),
    ("completion", "logprobs", 21, "logprobs"),
    ("completion", "logprobs", True, "logprobs"),
    ("completion", "echo", "yes", "echo"),
    ("chat", "stream", "true", "stream"),
    ("chat", "ignore_eos", 2, "ignore_eos"),
    ("chat", "return_token_ids", "no", "return_token_ids"),
    ("chat", "stream_options", {"include_usage": True}, "stream_options"),  # without stream
    ("chat", "messages", [], "messages"),
    ("chat", "messages", [{"role": "bot", "content": "x"}], "messages.[0].role"),
    ("chat", "messages", [{"role": "user"}], "messages.[0].content"),
    ("chat", "messages", [{"role": "user", "content": 5}], "messages.[0].content"),
    ("chat", "messages", [{"role": "user", "content": "a"},
                          {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.[1].content"),
    ("completion", "prompt", [], "prompt"),
    ("completion", "prompt", [[]], "prompt"),
    ("completion", "prompt", [1, -2], "prompt"),
    ("completion", "prompt", [1, "a"], "prompt"),
    ("completion", "prompt", 5, "prompt"),
    ("chat", "chat_template", "{{ messages }}", "chat_template"),  # refused, not silently ignored
    # names the request or the server sets: continue_final_message and template were a 500
    ("chat", "chat_template_kwargs", {"continue_final_message": True}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"template": "x"}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"add_generation_prompt": False}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"enable_thinking": False, "bos_token": "<s>"}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"pad_token": "<pad>"}, "chat_template_kwargs"),  # the tokenizer's too
    # the functions templates are given: a string for `namespace` broke every template using it (a 400 on messages)
    ("chat", "chat_template_kwargs", {"namespace": "x"}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"raise_exception": 1}, "chat_template_kwargs"),
    ("chat", "chat_template_kwargs", {"range": 1}, "chat_template_kwargs"),
    ("chat", "documents", [{"text": "x"}, "y"], "documents.[1]"),
    ("completion", "prompt_embeds", "AAAA", "prompt_embeds"),  # vLLM's, refused: the prompt alone was answered
    ("chat", "use_beam_search", True, "use_beam_search"),  # vLLM's, not implemented: refused, not ignored
    ("completion", "prompt_logprobs", 21, "prompt_logprobs"),
    ("chat", "prompt_logprobs", -1, "prompt_logprobs"),
    ("chat", "logits_processors", ["x"], "logits_processors"),
]


@pytest.mark.parametrize(("kind", "field", "value", "param"), OUT_OF_RANGE,
                         ids=[f"{k}-{f}-{v!r:.20}" for k, f, v, _ in OUT_OF_RANGE])
def test_out_of_range_fails_naming_the_field(kind: str, field: str, value: object, param: str) -> None:
    cls, base = (ChatCompletionRequest, CHAT) if kind == "chat" else (CompletionRequest, COMPLETION)
    got, message = _param_of_error(cls, {**base, field: value})
    assert got == param, message
    assert param in message


def test_a_union_value_is_told_by_the_branch_of_its_shape() -> None:
    """A list sent for `str | list[...]` is told by its bad item, not by the string branch ("Input should be a
    valid string", naming the whole field, read as if no list were allowed); a tagged block's tag is no field."""
    from server.messages_api import MessagesRequest
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "x"}]}]}
    param, message = _param_of_error(MessagesRequest, body)
    assert param == "messages.[1].content.[0].input" and "dictionary" in message, message
    param, message = _param_of_error(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]})
    assert param == "messages.[0].content.[0].text" and "required" in message, message
    # a value of no branch's shape is still told by the first branch
    assert _param_of_error(ChatCompletionRequest, {**CHAT, "stop": 5})[0] == "stop"


def test_cross_field_errors_name_the_field() -> None:
    assert _param_of_error(ChatCompletionRequest, {**CHAT, "max_tokens": 5, "min_tokens": 6})[0] == "min_tokens"
    assert _param_of_error(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 5, "max_tokens": 50,
                                                   "min_tokens": 6})[0] == "min_tokens"
    assert _param_of_error(CompletionRequest, {**COMPLETION, "min_tokens": 17})[0] == "min_tokens"  # default 16
    # a suffix is filled in before (server.serving.fim_prompt; with echo refused there, where the model is known)
    assert CompletionRequest.model_validate({**COMPLETION, "suffix": "}\n"}).suffix == "}\n"
    # legacy completion fields the server does not implement are refused, not ignored
    param, message = _param_of_error(CompletionRequest, {**COMPLETION, "best_of": 3, "n": 2})
    assert param == "best_of" and "best_of=3, n=2" in message
    assert CompletionRequest.model_validate({**COMPLETION, "best_of": 2, "n": 2, "suffix": ""}).n == 2
    for body in ({"best_of": 3}, {"best_of": 1, "n": 2}, {"best_of": 0}):  # chat ignored it (vLLM reads it there)
        param, message = _param_of_error(ChatCompletionRequest, {**CHAT, **body})
        assert param == "best_of" and "not supported" in message
    assert ChatCompletionRequest.model_validate({**CHAT, "best_of": 2, "n": 2}).n == 2
    param, message = _param_of_error(ChatCompletionRequest, {**CHAT, "top_logprobs": 3})
    assert param == "top_logprobs" and "logprobs" in message
    _, message = _param_of_error(ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]})
    assert "content part 1 has type 'input_audio'" in message and "only 'text'" in message
    _, message = _param_of_error(ChatCompletionRequest, {"model": "m"})
    assert message == "'messages' is a required field"
    assert describe_validation_error([{"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error",
                                       "ctx": {"error": "Expecting value"}}]) == \
        ("the body is not valid JSON: Expecting value", None)


def test_to_sampling_params_maps_every_field() -> None:
    """Each SamplingParams field gets a non-default value from the request: nothing is dropped."""
    chat = ChatCompletionRequest.model_validate({
        **CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"11": 5.0, " 7": -100},
        "seed": 1234, "n": 3, "max_tokens": 999, "max_completion_tokens": 50, "min_tokens": 2,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 4, "stop": "x", "user": "u", "stop_token_ids": [2, 7],
        "response_format": {"type": "json_object"}, "omnikv": True, "allowed_token_ids": [5, 9],
        "prompt_logprobs": 2, "cache_salt": "s", "priority": -4})
    sp = to_sampling_params(chat)
    default = SamplingParams()
    for name in SamplingParams.__struct_fields__:
        # bad_words_ids, prediction: tokenized by the server (server.serving.bad_words_ids, prediction_ids,
        # tested end to end)
        if name not in ("bad_words_ids", "prediction"):
            assert getattr(sp, name) != getattr(default, name), name
    assert sp == SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={11: 5.0, 7: -100.0},
                                seed=1234, n=3, max_tokens=50, min_tokens=2, stop_token_ids=(2, 7), ignore_eos=True,
                                allowed_token_ids=(5, 9),
                                logprobs=True, top_logprobs=4, structured=StructuredOutput("json_object"), omnikv=True,
                                prompt_logprobs=2, cache_salt="s", priority=-4)
    sp.validate(vocab_size=100)  # the engine's own check accepts what validation let through
    assert to_sampling_params(ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 9})).max_tokens == 9
    assert to_sampling_params(ChatCompletionRequest.model_validate({**CHAT, "top_k": 0})).top_k == -1
    assert to_sampling_params(ChatCompletionRequest.model_validate({**CHAT, "temperature": 0})).greedy

    comp = CompletionRequest.model_validate({**COMPLETION, "logprobs": 3, "max_tokens": 7, "seed": -1, "echo": True})
    sp = to_sampling_params(comp)
    assert (sp.logprobs, sp.top_logprobs, sp.max_tokens, sp.seed, sp.prompt_logprobs) == (True, 3, 7, -1, 3)
    # echo's logprobs and vLLM's prompt_logprobs: the prompt is scored with the larger count; streamed, only echo's
    for body, want in (({"prompt_logprobs": 5}, 5), ({"prompt_logprobs": 1}, 3), ({"stream": True, "prompt_logprobs": 0}, 3)):
        assert to_sampling_params(comp.model_validate({**comp.model_dump(exclude_unset=True), **body})).prompt_logprobs == want
    sp = to_sampling_params(CompletionRequest.model_validate({**COMPLETION, "logprobs": 0}))
    assert (sp.logprobs, sp.top_logprobs) == (True, 0)
    assert to_sampling_params(CompletionRequest.model_validate(COMPLETION)).logprobs is False


def test_random_valid_requests_pass_the_engine_check() -> None:
    """Whatever the protocol accepts, SamplingParams.validate accepts too (one set of ranges)."""
    rng = random.Random(7)
    for _ in range(300):
        body = {**CHAT, "temperature": rng.uniform(0, 100), "top_p": rng.uniform(1e-6, 1), "top_k": rng.randint(-1, 99),
                "min_p": rng.uniform(0, 1), "repetition_penalty": rng.uniform(1e-6, 10),
                "presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2),
                "n": rng.randint(1, 128), "seed": rng.randint(-(2**63), 2**63 - 1),
                "logit_bias": {str(rng.randrange(1000)): rng.uniform(-100, 100)},
                "max_tokens": rng.randint(1, 10**6), "logprobs": True, "top_logprobs": rng.randint(0, 20)}
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
        to_sampling_params(ChatCompletionRequest.model_validate(body)).validate(vocab_size=1000)


def test_parse_logit_bias() -> None:
    assert parse_logit_bias({"0": 1, "128000": -2.5}) == {0: 1.0, 128000: -2.5}
    assert parse_logit_bias(None) == {}
    with pytest.raises(ParamError, match="logit_bias keys must be token ids.*'1.5'"):
        parse_logit_bias({"1.5": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        parse_logit_bias({"token": 1.0})


# ---------------------------------------------------------------- responses


def _chat_response(**extra) -> ChatCompletionResponse:
    lp = ChatTokenLogprob(token="Hi", logprob=-0.25, bytes=list(b"Hi"),
                          top_logprobs=[TopLogprob(token="Hi", logprob=-0.25, bytes=list(b"Hi")),
                                        TopLogprob(token="\u4e16", logprob=-float("inf"), bytes=None)])
    choice = ChatCompletionChoice(index=0, message=ChatResponseMessage(content="Hi \u4e16\U0001F600"),
                                  logprobs=ChatChoiceLogprobs(content=[lp]), finish_reason="stop", token_ids=[5, 6])
    return ChatCompletionResponse(id="chatcmpl-1", created=1700000000, model="m", choices=[choice],
                                  usage=UsageInfo.of(10, 2, cached_tokens=4), **extra)


def test_chat_response_parses_with_the_sdk() -> None:
    resp = _chat_response(prompt_token_ids=[1, 2, 3])
    sdk = ChatCompletion.model_validate_json(resp.model_dump_json())
    assert sdk.choices[0].message.content == "Hi \u4e16\U0001F600" and sdk.choices[0].finish_reason == "stop"
    assert sdk.usage.total_tokens == 12 and sdk.usage.prompt_tokens_details.cached_tokens == 4
    top = sdk.choices[0].logprobs.content[0].top_logprobs
    assert top[1].logprob == -9999.0 and top[1].bytes is None  # -inf is not JSON: OpenAI's stand-in
    assert sdk.choices[0].model_extra["token_ids"] == [5, 6] and sdk.model_extra["prompt_token_ids"] == [1, 2, 3]
    choice = ChatCompletionChoice(index=0, message=ChatResponseMessage(content=""), finish_reason="length")
    plain = json.loads(ChatCompletionResponse(id="c", created=1, model="m", usage=UsageInfo.of(3, 0),
                                              choices=[choice]).model_dump_json())
    assert plain["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "", "refusal": None,
                                                           "annotations": []},
                                   "logprobs": None, "finish_reason": "length"}  # OpenAI's message fields
    assert plain["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert "prompt_token_ids" not in plain and "system_fingerprint" not in plain


def _chat_chunks() -> list[ChatCompletionChunk]:
    def chunk(choices: list, **kw) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="chatcmpl-9", created=1700000001, model="m", choices=choices, **kw)
    return [
        chunk([ChatCompletionChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
              prompt_token_ids=[1, 2]),
        chunk([ChatCompletionChunkChoice(index=0, delta=DeltaMessage(content="Hel"), token_ids=[7])]),
        chunk([ChatCompletionChunkChoice(
            index=0, delta=DeltaMessage(content="lo \U0001F600"), token_ids=[8, 9],
            logprobs=ChatChoiceLogprobs(content=[ChatTokenLogprob(token="lo", logprob=-1.0, bytes=[108, 111])]))]),
        chunk([ChatCompletionChunkChoice(index=0, delta=DeltaMessage(), finish_reason="length")]),
        chunk([], usage=UsageInfo.of(2, 3)),
    ]


def test_chat_chunks_shape_and_sdk_types() -> None:
    chunks = _chat_chunks()
    first = json.loads(chunks[0].model_dump_json())
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]  # finish_reason null is sent, as OpenAI does
    assert "usage" not in first and first["object"] == "chat.completion.chunk"
    assert json.loads(chunks[3].model_dump_json())["choices"][0]["delta"] == {}
    assert json.loads(chunks[4].model_dump_json())["choices"] == []
    for c in chunks:
        SDKChatCompletionChunk.model_validate_json(c.model_dump_json())
    assert sse_data(chunks[1]).startswith("data: {") and sse_data(chunks[1]).endswith("}\n\n")


def _client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def _sse_response(events: list[str]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(events).encode())


def test_sdk_client_streams_chat_chunks() -> None:
    """The real SDK client reads our SSE: role first, text deltas, finish_reason, usage chunk, [DONE]."""
    events = [sse_data(c) for c in _chat_chunks()] + [SSE_DONE]
    client = _client(lambda request: _sse_response(events))
    got = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                                              stream_options={"include_usage": True}))
    assert len(got) == 5 and len({(c.id, c.created) for c in got}) == 1
    assert got[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hello \U0001F600"
    assert got[3].choices[0].finish_reason == "length" and got[4].usage.completion_tokens == 3
    assert got[2].choices[0].model_extra["token_ids"] == [8, 9]


def test_sdk_client_streams_completions_and_errors() -> None:
    lp = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[None, -0.5], top_logprobs=[None, {"b": -0.5, "c": -1.5}],
                            text_offset=[0, 1])
    chunks = [CompletionChunk(id="cmpl-1", created=5, model="m",
                              choices=[CompletionChoice(index=0, text="ab", logprobs=lp)]),
              CompletionChunk(id="cmpl-1", created=5, model="m", choices=[
                  CompletionChoice(index=0, text="", finish_reason="stop", token_ids=[3])]),
              CompletionChunk(id="cmpl-1", created=5, model="m", choices=[], usage=UsageInfo.of(1, 2))]
    raw = json.loads(chunks[0].model_dump_json())
    assert raw["object"] == "text_completion" and raw["choices"][0]["finish_reason"] is None
    assert raw["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    client = _client(lambda request: _sse_response([sse_data(c) for c in chunks] + [SSE_DONE]))
    got = list(client.completions.create(model="m", prompt="x", stream=True))
    assert [c.choices[0].text for c in got if c.choices] == ["ab", ""]
    assert got[1].choices[0].finish_reason == "stop" and got[2].usage.total_tokens == 3
    assert got[0].choices[0].logprobs.top_logprobs[1] == {"b": -0.5, "c": -1.5}

    failing = [sse_data(chunks[0]), sse_data(error_body("the engine died", "server_error", code="engine_error"))]
    with pytest.raises(openai.APIError, match="the engine died") as info:
        list(_client(lambda request: _sse_response(failing)).completions.create(model="m", prompt="x", stream=True))
    assert info.value.code == "engine_error"


def test_completion_response_and_errors_through_the_sdk() -> None:
    logprobs = CompletionLogprobs(tokens=["h", "i"], token_logprobs=[-0.1, -math.inf],
                                  top_logprobs=[{"h": -0.1}, {"i": -math.inf}], text_offset=[0, 1])
    resp = CompletionResponse(id="cmpl-2", created=7, model="m", usage=UsageInfo.of(4, 2), choices=[
        CompletionChoice(index=0, text="hi", finish_reason="length", prompt_token_ids=[1, 2, 3, 4], token_ids=[5, 6],
                         logprobs=logprobs)])
    sdk = Completion.model_validate_json(resp.model_dump_json())
    assert sdk.choices[0].logprobs.token_logprobs == [-0.1, -9999.0] and sdk.usage.total_tokens == 6
    client = _client(lambda request: httpx.Response(200, json=json.loads(resp.model_dump_json())))
    assert client.completions.create(model="m", prompt="x").choices[0].model_extra["token_ids"] == [5, 6]

    body = error_body("invalid value for 'temperature': too hot", param="temperature")
    assert body == {"error": {"message": "invalid value for 'temperature': too hot", "type": "invalid_request_error",
                              "param": "temperature", "code": None}}
    with pytest.raises(openai.BadRequestError) as info:
        _client(lambda request: httpx.Response(400, json=body)).completions.create(model="m", prompt="x")
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"


def test_model_list_parses_with_the_sdk() -> None:
    listing = ModelList(data=[ModelCard(id="smollm2-135m-instruct", created=3, max_model_len=8192)])
    client = _client(lambda request: httpx.Response(200, json=json.loads(listing.model_dump_json())))
    models = list(client.models.list())
    assert models[0].id == "smollm2-135m-instruct" and models[0].owned_by == "mlaserve"
    assert models[0].object == "model" and models[0].model_extra["max_model_len"] == 8192


def _text_samples(rng: random.Random) -> list[str]:
    """Texts a token delta can carry: quotes, backslashes, control characters, non-ASCII, emoji, U+2028."""
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "/", "<", " ", "é", "中", "\u2028", "\U0001F600", "a", "Z"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(60)]


@pytest.mark.parametrize("model_name", ["smol", "named \ue000mlaserve text\ue001 on purpose"])
def test_streamed_text_events_are_the_models_json(model_name: str) -> None:
    """Nearly every streamed token goes out as a text event made from a per-stream template
    (`Serializer.text_event`); it must be byte for byte what dumping the chunk's models gives (the
    oracle: pydantic's own serialization, and the SDK's chunk types), for any text, choice index and
    usage setting, and also when the template cannot be made (a model name holding its placeholder)."""
    from server.metrics import Metrics
    from server.responses import ChatSerializer, CompletionSerializer
    from server.state import ServerState

    rng = random.Random()
    state = ServerState(model_name=model_name, metrics=Metrics(model_name))
    for usage in (False, True):
        options = {"stream": True, "stream_options": {"include_usage": usage}}
        chat = ChatSerializer(state, ChatCompletionRequest.model_validate({**CHAT, **options}), [([1], "hi")], [])
        completion = CompletionSerializer(state, CompletionRequest.model_validate({**COMPLETION, **options}),
                                          [([1], "hi")], [])
        # (the SDK's Completion type wants a finish reason: it reads streamed completions unvalidated)
        for ser, field, sdk in ((chat, "content", SDKChatCompletionChunk), (chat, "reasoning_content", SDKChatCompletionChunk),
                                (completion, "text", None)):
            for text in _text_samples(rng):
                i = rng.choice([0, 0, 3])
                event = ser.text_event(i, field, text)
                assert event == sse_data(ser.text_chunk(i, field, text))
                body = json.loads(event.removeprefix("data: "))
                assert body["id"] == ser.id and body["model"] == model_name and ("usage" in body) == usage
                choice = body["choices"][0]
                assert choice["index"] == i and (choice.get("delta") or choice)[field] == text
                assert choice["finish_reason"] is None and choice["logprobs"] is None
                if sdk is not None:
                    sdk.model_validate_json(event.removeprefix("data: "))


def test_legacy_logprobs_keep_tokens_apart() -> None:
    """The completions API's `top_logprobs` is a dict keyed by token: partial-character tokens (all U+FFFD
    as text) are OpenAI's `bytes:\\x..`, ids past the tokenizer (no text at all) vLLM's `token_id:N`, so
    each alternative keeps its entry and the chosen token its own value."""
    from executor.logprobs import TokenLogprob
    from models.loader.tokenizer import load_tokenizer
    from server.metrics import Metrics
    from server.responses import CompletionSerializer
    from server.state import ServerState

    tok = load_tokenizer("smollm2-135m-instruct")
    size = tok.tokenizer.get_vocab_size()
    partial = [i for i in range(size) if tok.token_bytes(i) in (b"\xe4", b"\xb8", b"\xad")]
    plain = tok.encode("hello", add_special_tokens=False)[0]
    state = ServerState(model_name="m", metrics=Metrics("m"))
    state.tokenizer = tok
    ser = CompletionSerializer(state, CompletionRequest.model_validate({**COMPLETION, "logprobs": 5}), [([1], "hi")], [])
    ids = [*partial, size, size + 7, plain]
    rng = random.Random()
    values = sorted((-rng.uniform(0.1, 9) for _ in ids), reverse=True)
    chosen = ids[-1]
    out = CompletionLogprobs()
    ser._append_logprob(out, chosen, TokenLogprob(token_id=chosen, logprob=values[-1], top=list(zip(ids, values))[:5]), 0)
    names = [ser.legacy_token(i) for i in ids]
    assert names[:3] == [f"bytes:\\x{tok.token_bytes(i)[0]:02x}" for i in partial]
    assert names[3:] == [f"token_id:{size}", f"token_id:{size + 7}", "hello"]
    assert out.tokens == ["hello"] and out.token_logprobs == [values[-1]]
    assert out.top_logprobs == [{**dict(zip(names[:5], values[:5])), "hello": values[-1]}]


def test_fields_a_server_does_not_read_are_named_in_the_log_once(caplog) -> None:
    """Unknown top-level fields are ignored (as vLLM does), and logged so that a typo shows: a warning the
    first time a route's model gets that set of names, debug after; names only (cut to 40 characters, ten
    at most), never their values; aliases and known fields are not named."""
    import logging

    from server import serving
    from server.messages_api import MessagesRequest
    from server.responses_api import ResponsesRequest

    serving._IGNORED_SEEN.clear()
    with caplog.at_level(logging.DEBUG, logger="mlaserve.server"):
        for _ in range(2):
            serving.note_ignored_fields(ResponsesRequest.model_validate({"input": "hi", "frequency_penalty": 1,
                                                                         "temperature": 0}))
        serving.note_ignored_fields(MessagesRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
             "stop_sequence": ["SECRET"]}))
        serving.note_ignored_fields(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}))
        serving.note_ignored_fields(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **{f"x{'y' * 50}{i}": i for i in range(12)}}))
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records[0] == (logging.WARNING, "a request (ResponsesRequest) sent fields this server does not read, "
                                           "ignored: 'frequency_penalty'")
    assert records[1][0] == logging.DEBUG and records[2][0] == logging.WARNING and "'stop_sequence'" in records[2][1]
    assert "SECRET" not in caplog.text and len(records) == 4
    assert records[3][1].endswith(" ...") and records[3][1].count("'x") == 10 and "y" * 41 not in records[3][1]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_whole_answer_keeps_the_order_the_model_wrote(api: str) -> None:
    """Text the model writes after a tool call comes after the call in a whole (unstreamed) Responses output
    and Messages content, as the stream tells it; the whole answer is what the stream's events add up to (the
    Anthropic SDK's own accumulator reads them), for random splits of the same text into deltas. It put all
    text first, before the calls."""
    import types

    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    from server import messages_api, responses_api
    from server.metrics import Metrics
    from server.responses import MessagesSerializer, ResponsesSerializer
    from server.state import ServerState
    from server.tools import plan_tools

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
    template = (fixtures / "deepseek_v3.jinja").read_text()
    b, e, sep, cb, ce = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    rng = random.Random()
    city = rng.choice(["Paris", "Lyon", "Nîmes"])
    text = (f"Checking {city}. {b}{cb}function{sep}get_weather\n```json\n{{\"city\": \"{city}\"}}\n```{ce}{e}"
            f" Then I answer, {rng.randrange(100)}.")
    # (a cut where the calls end, as that marker is a token of its own; within one delta of several tokens, a
    # speculative step's, text after the call still goes before it)
    cuts = sorted({*rng.sample(range(1, len(text)), rng.randint(1, 12)), text.index(e) + len(e)})
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    state = ServerState(model_name="m", metrics=Metrics("m"))

    def serve(stream: bool) -> tuple[Any, list[Any]]:
        if api == "responses":
            req = responses_api.ResponsesRequest.model_validate({
                "model": "m", "input": "weather?", "stream": stream,
                "tools": [{"type": "function", "name": "get_weather", "parameters": weather}]})
            chat = responses_api.to_chat_request(req)
            make: Any = functools.partial(ResponsesSerializer, request=req)
        else:
            chat = messages_api.to_chat_request(messages_api.MessagesRequest.model_validate({
                "model": "m", "max_tokens": 50, "stream": stream, "messages": [{"role": "user", "content": "weather?"}],
                "tools": [{"name": "get_weather", "input_schema": weather}]}))
            make = MessagesSerializer
        choice = types.SimpleNamespace(finish_reason=None, stop_reason=None, logprobs=[], completion_tokens=0,
                                       stops=types.SimpleNamespace(matched=None))
        r = types.SimpleNamespace(prompt_index=0, prompt_ids=[1, 2, 3], choices=[choice], cached_tokens=0)
        ser = make(state, chat, [([1, 2, 3], "weather?")], [r], plan_tools(chat, template))
        events = ser.stream_start() if stream else []
        for k, piece in enumerate(pieces):
            choice.completion_tokens += 1
            if k == len(pieces) - 1:
                choice.finish_reason = "stop"
            if stream:
                events += ser.stream_delta(r, 0, piece, [k], [])
            else:
                ser.add(r, 0, piece, [k], [])
        return (ser.stream_end() if stream else ser.response()), events

    whole, _ = serve(stream=False)
    end, events = serve(stream=True)
    if api == "responses":
        streamed = end[-1]["response"]["output"]
        kinds = [(i["type"], i.get("content", [{}])[0].get("text") or i.get("arguments")) for i in whole["output"]]
        assert kinds == [("message", f"Checking {city}. "), ("function_call", f'{{"city": "{city}"}}'),
                         ("message", text[text.index(e) + len(e):].lstrip())]  # (the parser drops the space)
        strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
        assert strip(whole["output"]) == strip(streamed)
    else:
        assert [b["type"] for b in whole["content"]] == ["text", "tool_use", "text"]
        assert whole["content"][1]["input"] == {"city": city} and whole["stop_reason"] == "tool_use"
        assert whole["content"][2]["text"] == text[text.index(e) + len(e):].lstrip()
        message, bufs = None, {}
        for event in [*events, *end]:
            message = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(event),
                                       current_snapshot=message, json_bufs=bufs)
        assert message is not None
        sdk = message.model_dump(exclude_none=True)
        assert [{k: v for k, v in b.items() if k != "id"} for b in sdk["content"]] == \
            [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]


def test_a_template_failing_on_chat_template_kwargs_blames_them() -> None:
    """A template that fails on a variable chat_template_kwargs gave it (a number where it adds text) is a 400
    naming `chat_template_kwargs`; one that fails on the messages still names `messages`."""
    import dataclasses

    from models.loader.tokenizer import load_tokenizer
    from server.metrics import Metrics
    from server.protocol import ChatCompletionRequest
    from server.serving import ClientError, chat_prompt
    from server.state import ServerState

    state = ServerState(model_name="m", metrics=Metrics("m"))
    template = ("{{ 'Today: ' + (date_string or 'now') }}{% for m in messages %}{{ m.content + '.' }}"
                "{% if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}{% endfor %}"
                "{% if strict is defined and strict %}{{ raise_exception('strict') }}{% endif %}")
    state.tokenizer = dataclasses.replace(load_tokenizer("smollm2-135m-instruct"), chat_template=template)
    rng = random.Random()
    day = str(rng.randrange(1, 29))

    def param(kwargs: dict | None, content: Any = "hi") -> str | None:
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": content}],
                                                     **({"chat_template_kwargs": kwargs} if kwargs else {})})
        try:
            chat_prompt(state, body)
        except ClientError as e:
            assert e.status == 400
            return e.param
        return None

    assert param({"date_string": day}) is None
    assert param({"date_string": int(day)}) == "chat_template_kwargs"
    assert param({"strict": True}) == "chat_template_kwargs"
    assert param({"date_string": day}, "boom") == param(None, "boom") == "messages"


@pytest.mark.parametrize("parser, marker", [("auto", "<tool_call>"), ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
                                            ("mistral", "[TOOL_CALLS]")])
def test_past_calls_are_written_in_the_markup_the_reply_is_read_in(parser: str, marker: str) -> None:
    """For a template that does not render tool calls (SmolLM2's), a past call is written into the assistant's
    text in the markup of the parser `--tool-call-parser` names (Hermes when it names none)."""
    from models.loader.tokenizer import load_tokenizer
    from server.metrics import Metrics
    from server.protocol import ChatCompletionRequest
    from server.serving import chat_prompt
    from server.state import ServerState

    state = ServerState(model_name="m", metrics=Metrics("m"))
    state.tokenizer = load_tokenizer("smollm2-135m-instruct")
    state.tool_call_parser = parser
    city = random.choice(["Paris", "Lyon"])
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    text, _ = chat_prompt(state, body)
    assert marker in text and city in text and "<tool_response>\nsunny\n</tool_response>" in text, text
    assert ("<tool_call>" in text) == (parser == "auto")


@pytest.mark.parametrize("arguments,whole", [
    ('{"a": 1.5e300, "b": [1, "x"]}', True), ("{}", True),
    ('{"a": "\\ud800"}', True),  # a lone surrogate's escape is JSON (JSON.parse reads it); it was taken for cut
    ('{"a": NaN}', False), ('{"a": -Infinity}', False), ('{"a": 1e999}', False),  # they were taken for whole
    ('{"a": 1' + "0" * 400 + "}", False), ('{"a": -1' + "0" * 300 + "}", True), ("[1E400]", False),
    ('{"a": 1', False), ('{"a": 1}}', False),
])
def test_a_tool_calls_arguments_are_whole_json_as_rfc_8259_writes_it(arguments, whole):
    """What decides finish_reason "tool_calls" (a call whose arguments are not one whole JSON value leaves
    "stop"): Python's and pydantic's readers take NaN, Infinity or 1e999, which JSON.parse refuses (a helper
    found it)."""
    from server.tool_parsers import whole_json

    assert whole_json(arguments) is whole
