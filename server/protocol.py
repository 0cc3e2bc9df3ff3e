"""The OpenAI API as pydantic models: what clients send, what we answer, and the error shape.

    request JSON --ChatCompletionRequest / CompletionRequest--> to_sampling_params --> SamplingParams
                 (sampling fields the body leaves out: the model's defaults, server.generation_defaults)
    engine deltas --server--> ChatCompletionResponse | ChatCompletionChunk | CompletionResponse | CompletionChunk
                  --model_dump_json / sse_data--> the wire

Requests ignore unknown fields (clients send OpenAI fields we do not implement). Every out-of-range
value fails validation *at its own field*, so the error's `loc` names it; `describe_validation_error`
turns pydantic's error list into OpenAI's message and `param` ("temperature", "messages.[0].content").
Ranges are the engine's (`SamplingParams.validate`); checks that need the vocabulary (logit_bias
ids) are left to `SamplingParams.validate(vocab_size)`.

Responses leave out `None` fields, as OpenAI does, except those OpenAI always sends: `finish_reason`
and `logprobs` on every choice (`null` on stream chunks until the end), and `param`/`code` on errors.
vLLM's `return_token_ids` adds `token_ids` to choices and `prompt_token_ids` to responses (chat) or
choices (completions, where each prompt has its own). vLLM's utility routes have their shapes here too:
`/tokenize` (`TokenizeCompletionRequest` | `TokenizeChatRequest` -> `TokenizeResponse`), `/detokenize`,
`/version`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationInfo
from pydantic import PrivateAttr, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError, from_json

from models.loader.tokenizer import OTHER_SPECIAL_TOKENS
from scheduler.sampling_params import MAX_TOP_LOGPROBS, TOP_K_ALL, ParamError, SamplingParams
from server.chat_template import template_globals
from server.generation_defaults import GENERATION_FIELDS, with_defaults
from server.structured import EXTENSION_FIELDS, structured_output

SEND_JSON = "send one JSON object, UTF-8, with the header Content-Type: application/json"
NOT_READ_AS_JSON = ("the request body is JSON but was not read as such: send it with the header "
                    "Content-Type: application/json (curl: -H 'Content-Type: application/json')")
MAX_STOP_STRINGS = 16  # OpenAI allows 4; a local server can afford more
COMPLETIONS_MAX_TOKENS = 16  # the completions API's max_tokens when absent or null (OpenAI's default)
UNLIKELY_LOGPROB = -9999.0  # what OpenAI sends for a logprob too small to represent


def _invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is exactly `message` (no "Value error, " prefix)."""
    return PydanticCustomError("invalid_value", message)


# ---------------------------------------------------------------- requests


def _unpaired_surrogate(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where in a JSON value a string holds an unpaired UTF-16 surrogate ("\\ud800" is valid JSON but
    not Unicode text: no tokenizer or UTF-8 encoder takes it), or None."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _unpaired_surrogate(k, path) if isinstance(k, str) else None
            found = found if found is not None else _unpaired_surrogate(v, (*path, str(k)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _unpaired_surrogate(v, (*path, i))
            if found is not None:
                return found
    return None


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys `model` reads: its fields' names and aliases."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
            elif alias is not None and hasattr(alias, "choices"):  # AliasChoices
                names.update(a for a in alias.choices if isinstance(a, str))
    return frozenset(names)


class _Request(BaseModel):
    """Request objects ignore fields they do not know (clients send OpenAI fields we do not implement)."""

    model_config = ConfigDict(extra="ignore")


class NoStructuredExtensions(_Request):
    """The chat path's structured-output extension fields (vLLM's, SGLang's), on an API with its own way to
    constrain the output: declared so that a request sending one is refused by name (`refuse_extensions`)
    rather than served unconstrained, as an unknown field would be."""

    response_format: Any = None  # (chat's own field: also not this API's way)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    grammar: Any = None

    def refuse_extensions(self, api: str, native: str) -> None:
        """ParamError naming the first of chat's structured-output fields sent: `native` is this API's own way."""
        field = next((f for f in ("response_format", *EXTENSION_FIELDS) if getattr(self, f) is not None), None)
        if field is not None:
            raise ParamError(field, f"{field} is not taken here (it is a field of /v1/chat/completions): {api} "
                                    f"constrains its output with {native}")


class _Body(_Request):
    """A whole request body: its text must be Unicode, checked once here for every field (a lone
    surrogate would otherwise reach the tokenizer and fail there as a server error). It keeps the names of
    the top-level fields it ignored (`unread_fields`), so that the route can name them in the log
    (`server.serving.note_ignored_fields`) however the body was validated."""

    _unread: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_unread(cls, data: Any, handler: Any) -> Any:
        body = handler(data)
        if isinstance(data, dict) and isinstance(body, _Body):
            known = _field_names(type(body))
            body._unread = tuple(k for k in data if k not in known)
        return body

    @property
    def unread_fields(self) -> tuple[str, ...]:
        """The top-level keys the body sent that no field reads (ignored, not refused)."""
        return self._unread

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = _unpaired_surrogate(data)
        if where is not None:
            raise PydanticCustomError("unpaired_surrogate", "the text holds an unpaired UTF-16 surrogate (an escape "
                                      "such as \\ud800 without its pair): send valid Unicode", {"path": list(where)})
        return data


def check_part_types(content: Any, allowed: Collection[str], refusal: str) -> Any:
    """A message's `content` as it came, when it is not a list of parts or every part's `type` is
    allowed; otherwise the validation error naming the first other part, then `refusal` (what to send)."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind not in allowed:
                raise _invalid(f"content part {i} has type {kind!r}: {refusal}")
    return content


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class PredictionContent(_Request):
    """OpenAI's `prediction`: text the reply is expected to repeat for the most part (a file being edited)."""

    type: Literal["content"]
    content: str | list[TextContentPart]

    def text(self) -> str:
        return "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """An assistant message's earlier tool call, as the client sends it back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    """One message of `messages`; content is a string or a list of text parts (no images, audio, files)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    # DeepSeek's chat prefix completion: a final assistant message the model continues (as
    # `continue_final_message`; `ChatInput`)
    prefix: StrictBool | None = None
    # an earlier reply's reasoning, sent back as vLLM and DeepSeek's API return it (`reasoning_content`) or
    # under vLLM's newer name: the chat template decides whether it is written (Qwen3's keeps the last turns')
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("role") == "assistant" and isinstance(value, list):  # OpenAI's history may hold a
            value = [{"type": "text", "text": p["refusal"]}  # refusal the model gave: its text is what it said
                     if isinstance(p, Mapping) and p.get("type") == "refusal" and isinstance(p.get("refusal"), str)
                     else p for p in value]
        return check_part_types(value, ("text",), "only 'text' parts are supported"
                                + (" (and 'refusal' in an assistant message)" if info.data.get("role") == "assistant" else ""))

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") != "assistant":
            raise _invalid("content is required (only an assistant message may omit it)")
        if value == [] and info.data.get("role") != "assistant":  # as OpenAI's
            raise _invalid("content is an empty list: send a string or at least one text part")
        return value

    @field_validator("tool_calls", "reasoning_content", "reasoning")
    @classmethod
    def _assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise _invalid(f"only an assistant message may carry {info.field_name}")
        return value

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(_Request):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: StrictBool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Request):
    model_config = ConfigDict(populate_by_name=True)  # merged with _Request's
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema (also llama.cpp
    server's `{"type": "json_object", "schema": {...}}`)."""

    model_config = ConfigDict(populate_by_name=True)  # merged with _Request's
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_where_read(self) -> ResponseFormat:
        if self.schema_ is not None and self.type != "json_object":  # (it would be silently unconstrained)
            raise _invalid(f"response_format.schema goes with type 'json_object' (llama.cpp's form); with type "
                           f"'{self.type}' send " + ("json_schema: {name, schema}" if self.type == "json_schema"
                                                     else "type 'json_object' or 'json_schema'"))
        return self

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise _invalid("a response_format of type 'json_schema' needs json_schema.schema")
        return self


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` extension: exactly one of these constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class StreamOptions(_Request):
    include_usage: StrictBool | None = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far (not null)
    continuous_usage_stats: StrictBool | None = False


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    seen: dict[int, str] = {}
    for key, bias in (value or {}).items():
        tok = _logit_bias_id(key)
        if tok in seen:  # "7" and "07": one would silently win
            raise _invalid(f"logit_bias has token id {tok} twice ({seen[tok]!r} and {key!r}): give each id once")
        seen[tok] = key
        if not -100.0 <= bias <= 100.0:
            raise _invalid(f"logit_bias[{key!r}] = {bias}: biases must be in [-100, 100]")
    return value


def _logit_bias_id(key: str) -> int:
    text = key.strip()
    if not (text.isascii() and text.isdigit()):
        raise _invalid(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}")
    return int(text)


Seed = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 63) - 1)]  # int64, as vLLM takes it


def _salt_not_empty(value: str) -> str:
    if not value:
        raise _invalid("cache_salt must be a non-empty string if provided (as vLLM: a long random one, kept from "
                       "other tenants)")
    return value


CacheSalt = Annotated[str, AfterValidator(_salt_not_empty)]  # vLLM's cache_salt


class _GenerationRequest(_Body):
    """Fields both APIs share: their JSON types and the rules of the API's shape. The ranges of the
    sampling values are not checked here but once, by `SamplingParams.validate` (a `ParamError`
    naming the parameter), on the `SamplingParams` that `to_sampling_params` makes."""

    model_config = ConfigDict(allow_inf_nan=False)  # merged with _Request's

    model: str | None = None  # None: the served model
    max_tokens: StrictInt | None = None
    # temperature, top_p, top_k, min_p, repetition_penalty left out (or null): the model's default, else OpenAI's
    # (server.generation_defaults)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # -1 or 0: no limit
    min_p: StrictFloat | None = None
    n: StrictInt | None = 1
    stop: str | list[str] | None = None
    # vLLM's extension: the stop string that ended the text is kept at its end (the text is still cut there)
    include_stop_str_in_output: StrictBool | None = False
    # vLLM's extension: generation ends right after one of these ids (its text is left out)
    stop_token_ids: list[StrictInt] | None = None
    # vLLM's extensions: only these ids are generated; these words (as the tokenizer spells each, alone and
    # after a space) are never generated (server.serving.bad_words_ids)
    allowed_token_ids: Annotated[list[StrictInt], Field(min_length=1)] | None = None
    bad_words: list[str] | None = None
    # vLLM's extension: only the prompt's last k tokens are kept (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None

    # vLLM's extensions this server does not implement: refused when asked for, rather than ignored
    use_beam_search: StrictBool | None = None
    logits_processors: Any = None

    @field_validator("use_beam_search", "logits_processors")
    @classmethod
    def _not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        if not (value is None or value is False or value == []):  # (0 asks for prompt logprobs too)
            why = {"use_beam_search": "beam search is not implemented; sample n completions instead",
                   "logits_processors": "a logits processor is code the server would run; use logit_bias, "
                                        "allowed_token_ids or bad_words"}[info.field_name]
            raise _invalid(f"{info.field_name} is not supported: {why}")
        return value

    # OpenAI's legacy completions field (vLLM reads it on chat too): sample best_of completions, return the
    # n most likely. Only best_of == n is served; anything else is refused rather than silently ignored
    best_of: StrictInt | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise _invalid(f"best_of other than n is not supported (best_of={value}, n={n}); "
                           "ask for n choices and pick by their logprobs")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_positive(cls, value: int | None) -> int | None:
        if value == 0:
            raise _invalid("truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds)")
        return value
    # vLLM's extension: false writes special tokens (<|im_start|>, ...) into the text (EOS still ends it unseen)
    skip_special_tokens: StrictBool | None = True
    seed: Seed | None = None
    presence_penalty: StrictFloat | None = 0.0
    frequency_penalty: StrictFloat | None = 0.0
    repetition_penalty: StrictFloat | None = None
    logit_bias: Annotated[dict[str, StrictFloat] | None, AfterValidator(_check_logit_bias)] = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: each prompt token's logprob, rank and this many alternatives (not when streaming, as vLLM)
    prompt_logprobs: StrictInt | None = None
    # structured outputs: OpenAI's field, vLLM's (`structured_outputs`, older `guided_*`), SGLang's
    # (`regex`, `ebnf`, `json_schema` as text) and llama.cpp server's (`grammar`, `json_schema` as an
    # object); at most one of them (server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang's: JSON text; llama.cpp server's: the schema
    grammar: str | None = None  # llama.cpp server's GBNF
    ignore_eos: StrictBool | None = False
    # mlaserve extension: OmniKV sparse attention for this request's decode (null: the server's --omnikv)
    omnikv: StrictBool | None = None
    # vLLM's extension: the prefix cache shares this request's KV only with requests sending the same salt
    cache_salt: CacheSalt | None = None
    # vLLM's extension: lower is admitted first, under --scheduling-policy priority (else only 0 is taken)
    priority: Seed | None = None  # (an int64 too)
    user: str | None = None
    return_token_ids: StrictBool | None = False
    # vLLM's extension: logprobs name each token `token_id:N`, not by its text (what RL trainers read back)
    return_tokens_as_token_ids: StrictBool | None = False

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise _invalid("stream_options is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            whole = " (vLLM's -1, the whole vocabulary, is more than this server lists)" if value == -1 else ""
            raise _invalid(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {value}{whole}")
        if value and info.data.get("stream"):
            raise _invalid("prompt_logprobs are not available when stream is true (as vLLM): ask without streaming")
        return value

    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings dropped (they would stop before the first token)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's `continuous_usage_stats`, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


# chat_template_kwargs that are not the template's own variables: the request's fields the renderer passes
# it, and what the server sets (a collision was a 500)
_REQUEST_FIELDS_IN_TEMPLATE = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "continue_final_message", "chat_template"})
_SERVER_TEMPLATE_VARIABLES = frozenset({"bos_token", "eos_token", *OTHER_SPECIAL_TOKENS, "template"})


def _check_continued(final: ChatMessage) -> None:
    """A final message the model is to continue holds text (whitespace is text: a prefill of "\n" is
    continued) and no tool calls."""
    if final.tool_calls or not final.text():
        raise _invalid("the final message to continue needs text content (and no tool_calls): the model "
                       "continues that text")


# OpenAI's reasoning effort levels (chat's `reasoning_effort`, Responses' `reasoning.effort`)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatInput(_Body):
    """What a chat prompt is rendered from (the chat template's input): the chat completions request's
    and `/tokenize`'s with messages (`server.serving.chat_prompt` renders both)."""

    model: str | None = None  # None: the served model
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: the tokenizer's special tokens (BOS) added to the rendered prompt; off, as the template writes its
    # own (a template that writes BOS would get two)
    add_special_tokens: StrictBool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: StrictBool | None = True
    # variables for the chat template (vLLM/SGLang's extension), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: reaches the template as `reasoning_effort` (gpt-oss's reads it), unless chat_template_kwargs
    # sets it; a template that reads none thinks as it always does
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's extension: documents for retrieval-augmented templates (Command-R's, Granite's read `documents`)
    documents: list[dict[str, Any]] | None = None
    # vLLM's extensions. add_generation_prompt: open the assistant's turn after the messages (left out:
    # yes, unless the final message is continued). continue_final_message: leave the final message open,
    # without its end-of-turn markup, so the model continues it ("prefilling" the reply); the reply holds
    # only what the model adds. DeepSeek's `"prefix": true` on a final assistant message asks the same.
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = Field(False, validate_default=True)
    # OpenAI's deprecated forms of tools / tool_choice: refused rather than ignored (the functions would be
    # dropped without a word, and the model answer as if it had none)
    functions: Any = None
    function_call: Any = None
    # vLLM's per-request template: refused rather than ignored (the reply would come from the server's
    # template while the client believes its own was used; vLLM too refuses it by default, as a template
    # is code run in the server)
    chat_template: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            new = {"functions": "tools: [{\"type\": \"function\", \"function\": {...}}]",
                   "function_call": "tool_choice"}[info.field_name]
            raise _invalid(f"{info.field_name} is the deprecated form of {new.split(':')[0]}; send {new} instead")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in value or {}:
            if key in _REQUEST_FIELDS_IN_TEMPLATE:
                raise _invalid(f"chat_template_kwargs.{key}: {key} is a field of the request, not a template "
                               f"variable: send it at the top level")
            if key in _SERVER_TEMPLATE_VARIABLES:
                raise _invalid(f"chat_template_kwargs.{key} is set by the server (the model's tokenizer and chat "
                               "template): leave it out")
            if key in template_globals():  # (a string in place of `namespace` broke every template that uses it)
                raise _invalid(f"chat_template_kwargs.{key} is a function the server gives chat templates: leave it "
                               "out")
        return value

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, value: Any) -> Any:
        if value is not None:
            raise _invalid("a chat template per request is not accepted (it is code the server would run); "
                           "start the server with --chat-template FILE to use another template, and send "
                           "chat_template_kwargs for the template's variables")
        return value

    @field_validator("messages")
    @classmethod
    def _prefix_last(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(value):
            if m.prefix and (i != len(value) - 1 or m.role != "assistant"):
                raise _invalid(f"message {i} has prefix true: only the final message, an assistant message, "
                               "may be a prefix for the model to continue")
        if value and value[-1].prefix:  # (here, not below: the fault is this field's)
            _check_continued(value[-1])
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _final_message_open(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        messages = info.data.get("messages")
        if not messages or not (value or messages[-1].prefix):
            return value
        if info.data.get("add_generation_prompt"):
            raise _invalid("continuing the final message (continue_final_message, or prefix on it) leaves it "
                           "open, so add_generation_prompt cannot be true: leave it out or send false")
        _check_continued(messages[-1])
        return value

    def continued_text(self) -> str | None:
        """The final message's text when the model continues it (`continue_final_message`, or DeepSeek's
        `prefix`); None when the reply is a new message."""
        final = self.messages[-1]
        return final.text() if self.continue_final_message or final.prefix else None

    def generation_prompt(self) -> bool:
        """Whether the rendering opens the assistant's turn: as sent, else unless the final message is
        continued."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return self.continued_text() is None

    def openai_messages(self, parts: bool = False) -> list[dict[str, Any]]:
        """Messages in OpenAI's shape with text content joined (None kept for an assistant message
        that only calls tools, "" for one with neither content nor calls): what
        `server.chat_template.render_messages` takes. `parts`: content sent as a list of text parts stays
        one (for a template that walks the parts)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role  # templates know system; developer is its new name
            # content None stays None beside tool calls; alone it is an empty reply (as vLLM reads it: a
            # template that reads the content would fail on None)
            content: Any = m.text() if m.content is not None or not m.tool_calls else None
            if parts and isinstance(m.content, list):
                content = [{"type": "text", "text": p.text} for p in m.content]
            entry: dict[str, Any] = {"role": role, "content": content}
            if m.name is not None:
                entry["name"] = m.name
            if m.tool_calls:
                entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.prefix:  # DeepSeek-V3.1's template reads it (a continued reply keeps its thinking mode)
                entry["prefix"] = True
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:  # template_messages copies it under the names templates read
                entry["reasoning_content"] = reasoning
            out.append(entry)
        return out


class ChatCompletionRequest(ChatInput, _GenerationRequest):
    max_completion_tokens: StrictInt | None = None  # wins over max_tokens
    # vLLM's extension: the reply starts with the final message's text when that is an assistant message
    # (with continue_final_message: the whole message, not only what the model added)
    echo: StrictBool | None = False
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    min_tokens: StrictInt | None = 0
    # vLLM's extension: false leaves the reasoning out of the reply (still parsed apart and counted)
    include_reasoning: StrictBool | None = True
    # OpenAI's Predicted Outputs: the prediction's tokens are speculative drafts (server.serving.request_params)
    prediction: PredictionContent | None = None
    # output modalities: text only; audio output refused rather than ignored (the reply would silently
    # lack what was asked for)
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None  # OpenAI's search models' web search: refused too (nothing is searched)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise _invalid("top_logprobs needs logprobs to be true")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        other = [m for m in value or [] if m != "text"]
        if other:
            raise _invalid(f"this server answers in text only; the modalities {other} are not supported")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> Any:
        if value is not None:
            raise _invalid("audio output is not supported: this server answers in text only")
        return value

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value: Any) -> Any:
        if value is not None:
            raise _invalid("web search is not offered: this server reaches no network; give the model the text it "
                           "needs in the messages")
        return value


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    add_special_tokens: StrictBool = True  # vLLM's: BOS before a text prompt where the model wants one
    max_tokens: StrictInt | None = COMPLETIONS_MAX_TOKENS  # 0: score the prompt only
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # (vLLM's 20: OpenAI stops at 5)
    min_tokens: StrictInt | None = 0
    # OpenAI's legacy fill-in-the-middle: the completion is the text between the prompt and `suffix`, written
    # with the model's FIM tokens (server.serving.fim_prompt); a model without them refuses a non-empty one,
    # and `echo` with one is refused (server.serving.fim_suffix), as OpenAI refuses the pair
    suffix: str | None = None
    # vLLM's input as embeddings (behind its --enable-prompt-embeds): refused, as the text would answer another input
    prompt_embeds: Any = None

    @field_validator("prompt_embeds")
    @classmethod
    def _no_embeds(cls, value: Any) -> Any:
        if value is not None:
            raise _invalid("prompt_embeds is not supported: send the prompt as text or token ids")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _invalid(f"{shape}; got {'an empty list' if isinstance(value, list) else type(value).__name__}")
        if all(isinstance(v, str) for v in value):
            return value
        rows = value if all(isinstance(v, list) for v in value) else [value]
        for row in rows:
            if not row:
                raise _invalid(f"{shape}; a token-id list is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row):
                raise _invalid(f"{shape}; token ids must be non-negative integers")
        return value

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: one entry per prompt, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else p  # type: ignore[list-item,return-value]


class TokenizeCompletionRequest(_Body):
    """`POST /tokenize` with a prompt (vLLM's shape): its ids as the completions API encodes a string."""

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # BOS where the model wants one
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatInput):
    """`POST /tokenize` with messages (vLLM's shape): the ids of the chat template's rendering, as the chat
    completions API renders it (the template writes the special tokens itself)."""

    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


def parse_logit_bias(logit_bias: Mapping[str, float] | None) -> dict[int, float]:
    """OpenAI's `{"token id as string": bias}` as `{id: bias}`; ParamError("logit_bias", ...) otherwise."""
    out: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            out[_logit_bias_id(str(key))] = float(bias)
        except PydanticCustomError as e:
            raise ParamError("logit_bias", e.message()) from None
    return out


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The engine's view of a request. Stop *strings* stay with the server (`StopStringMatcher`); a
    forced tool call's grammar is added by the server's tool plan (`server.tools`). `defaults`: the
    model's sampling defaults (`GenerationDefaults.values`) for the generation fields the request leaves
    out; it applies exactly to the fields absent from the body (or null), never to a value it sent."""
    sent = {name: getattr(req, name) for name in GENERATION_FIELDS if name in req.model_fields_set}
    if sent.get("top_k") in (0, -1):
        sent["top_k"] = TOP_K_ALL  # the request's own "no limit"
    sampling = with_defaults(sent, defaults or {})
    prompt_logprobs = None if req.stream else req.prompt_logprobs  # (0 when streaming: ignored, as vLLM)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs, top_logprobs = req.logprobs, req.top_logprobs or 0
    else:
        max_tokens = _or(req.max_tokens, COMPLETIONS_MAX_TOKENS)
        logprobs, top_logprobs = req.logprobs is not None, req.logprobs or 0
        if req.echo and (req.logprobs is not None or max_tokens == 0):
            # echo with max_tokens 0 and no logprobs: the prompt alone comes back (OpenAI's legacy API); it
            # still runs through the engine, scored, so that it is checked and counted like any other
            prompt_logprobs = max(req.logprobs or 0, prompt_logprobs or 0)
    return SamplingParams(  # a field sent as null means its default, as in OpenAI's API
        **sampling,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        logit_bias=parse_logit_bias(req.logit_bias),
        seed=req.seed,
        n=_or(req.n, 1),
        max_tokens=max_tokens,
        min_tokens=_or(req.min_tokens, 0),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured_output(req),
        omnikv=req.omnikv,
        cache_salt=req.cache_salt,
        priority=req.priority or 0,
    )


def checked_sampling_params(req: ChatCompletionRequest | CompletionRequest, vocab_size: int,
                            defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """`to_sampling_params`, then `SamplingParams.validate`: the one check of the sampling values'
    ranges. Raises ParamError naming the OpenAI parameter (the server's 400 carries it in `param`)."""
    params = to_sampling_params(req, defaults)
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        try:
            params.validate(vocab_size)
        except ParamError as e:  # the chat API's own name for the limit that was used
            raise ParamError("max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")) \
                if e.param == "max_tokens" else e
        return params
    params.validate(vocab_size)
    return params


def _is_json(text: str | bytes) -> bool:
    try:
        from_json(text)
    except ValueError:
        return False
    return True


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


_JSON_KINDS = {str: "a JSON string", int: "a JSON number", float: "a JSON number", bool: "a JSON boolean",
               type(None): "JSON null", list: "a JSON array"}


def rename_fields(renames: Sequence[tuple[re.Pattern[str], str]], message: str,
                  param: str | None) -> tuple[str, str | None]:
    """An error of the chat path in another API's field names (the Responses and Messages APIs serve
    requests as chat requests): each (pattern, name) substituted in the message and the param."""
    for pattern, name in renames:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return message, param


@functools.cache
def _model_names() -> frozenset[str]:
    """Names of the request models, which pydantic puts in an error's `loc` as the union branch it tried."""
    names, todo = set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("server.") and sub.__name__ not in names:
                names.add(sub.__name__)
                todo.append(sub)
    return frozenset(names)


def _object_branch_error(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error to tell of a union field (`tool_choice`: a string or an object; a message's `content`: a
    string or a list of blocks): for a value of one branch's shape, the first error inside that branch (the
    object's missing `function`, a block's bad `input`) rather than another branch's "should be a valid
    string", which reads as if no other form existed."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    models = _model_names()

    def branch(label: Any) -> bool:  # pydantic's name for a union's branch, in an error's loc
        return isinstance(label, str) and (label in _SCALAR_BRANCHES or "[" in label or label in models)

    if not loc or not branch(loc[-1]):
        return first
    for e in errors[1:]:
        at = tuple(e.get("loc", ()))
        if at[: len(loc) - 1] == loc[:-1] and len(at) > len(loc) and branch(at[len(loc) - 1]):
            return e  # the value passed that branch's own type check: the error is inside it
    return first


_SCALAR_BRANCHES = ("str", "int", "float", "bool")


def describe_validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of the first pydantic/FastAPI validation error, OpenAI style.

    `loc` ("body", "messages", 0, "content") becomes param "messages.[0].content"; pydantic's
    union-branch names (e.g. "str", "list[int]") are dropped.
    """
    if not errors:
        return "invalid request", None
    err = errors[0]
    if tuple(err.get("loc", ())) == ("body",):  # the body as a whole: empty, or not a JSON object
        if err.get("type") == "missing":
            return f"the request body is empty: {SEND_JSON}", None
        if err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            got = err.get("input")
            if isinstance(got, (str, bytes)) and _is_json(got):  # curl -d's form type, or no type at all
                return NOT_READ_AS_JSON, None
            # raw bytes: a body not sent as JSON; anything else is what the JSON body held
            what = "text that is not JSON" if isinstance(got, bytes) else _JSON_KINDS.get(type(got), "another JSON value")
            return f"the request body must be a JSON object, not {what}: {SEND_JSON}", None
    if err.get("type") == "json_invalid":
        return f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}".rstrip(": "), None
    err = _object_branch_error(errors)
    models = _model_names()
    parts: list[str] = []
    loc = [*err.get("loc", ()), *(err.get("ctx") or {}).get("path", ())]  # ctx path: where inside the value
    for i, p in enumerate(loc):
        union = loc[i - 2] if i >= 2 and isinstance(loc[i - 1], int) else loc[i - 1] if i else None  # (of a list's item)
        if isinstance(union, str) and "tagged-union[" in union and isinstance(p, str):
            continue  # the tag's value (a block's "tool_use"), not a field
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p != "body" and not ("[" in p or p in _SCALAR_BRANCHES or p in models):
            parts.append(str(p))
    param = ".".join(parts) or None
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "missing":
        return f"'{param}' is a required field", param
    return (f"invalid value for '{param}': {msg}" if param else msg), param


# ---------------------------------------------------------------- responses

def finite_logprob(x: float) -> float:
    """A logprob JSON can carry: OpenAI's -9999.0 for one too small to represent."""
    return x if math.isfinite(x) else UNLIKELY_LOGPROB


Logprob = Annotated[float, AfterValidator(finite_logprob)]
FinishReason = Literal["stop", "length", "tool_calls"]


class _Response(BaseModel):
    """Serializes without `None` fields, except those named in `keep_null` (OpenAI sends them as null)."""

    keep_null: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_nulls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        kept = self._nulls_kept()
        return {k: v for k, v in data.items() if v is not None or k in kept}

    def _nulls_kept(self) -> frozenset[str]:
        return self.keep_null


class _StreamChunk(_Response):
    """A streamed chunk. With `stream_options.include_usage` (`usage_null(True)`) every chunk carries
    `usage`, null until the last one, which has the totals, as OpenAI streams it."""

    _usage_null: bool = PrivateAttr(default=False)

    def usage_null(self, on: bool) -> _StreamChunk:
        self._usage_null = on
        return self

    def _nulls_kept(self) -> frozenset[str]:
        return self.keep_null | {"usage"} if self._usage_null else self.keep_null


class PromptTokensDetails(_Response):
    cached_tokens: int | None = None


class CompletionTokensDetails(_Response):
    reasoning_tokens: int | None = 0
    # OpenAI's Predicted Outputs: the prediction's tokens the reply kept as drafts, and those it did not
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
           reasoning_tokens: int | None = None, predicted: tuple[int, int] | None = None) -> UsageInfo:
        details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
        generated = None
        if reasoning_tokens is not None or predicted is not None:
            accepted, rejected = predicted if predicted is not None else (None, None)
            generated = CompletionTokensDetails(reasoning_tokens=reasoning_tokens, accepted_prediction_tokens=accepted,
                                                rejected_prediction_tokens=rejected)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details,
                   completion_tokens_details=generated)


class TopLogprob(_Response):
    keep_null = frozenset({"bytes"})
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    keep_null = frozenset({"bytes"})
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    keep_null = frozenset({"content"})
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Response):
    """Legacy shape: parallel lists; `token_logprobs[0]` is null for an echoed prompt's first token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    keep_null = frozenset({"content", "refusal"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None  # OpenAI's: the model's refusal text, which only its safety layer writes
    annotations: list[Any] = Field(default_factory=list)  # OpenAI's (web search citations): none here
    reasoning_content: str | None = None  # the chain of thought (server.reasoning), as DeepSeek's API names it
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A piece of tool call `index`: the first carries id, type and name; later ones append arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionChoice(_Response):
    keep_null = frozenset({"logprobs", "finish_reason"})
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None


class PromptLogprob(_Response):
    """An entry of vLLM's `prompt_logprobs`: a token's logprob, its rank in the vocabulary (1: the model's
    first choice) and its text."""

    keep_null = frozenset({"rank"})
    logprob: Logprob
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token (the first null), keyed by token id


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the request's prompt_logprobs


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None  # only in a choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(_Response):
    keep_null = frozenset({"logprobs", "finish_reason"})
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # ids of this delta


class ChatCompletionChunk(_StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None  # the final chunk's (`choices: []`) with include_usage; null before it
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # first chunk, with return_token_ids


class CompletionChoice(_Response):
    keep_null = frozenset({"logprobs", "finish_reason"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the request's prompt_logprobs


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # single-prompt requests, with return_token_ids


class CompletionChunk(_StreamChunk):
    """Streamed completions share the response's object name ("text_completion"), as OpenAI does."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlaserve"
    max_model_len: int | None = None  # vLLM's extension: the context length
    # mlaserve's extension: the sampling value a request that leaves a field out gets (the model's
    # generation config, else OpenAI's; server.generation_defaults)
    generation_defaults: dict[str, float | int] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: each id's vocabulary entry


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    keep_null = frozenset({"param", "code"})
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, the one error shape of every route."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


# ---------------------------------------------------------------- server-sent events

SSE_DONE = "data: [DONE]\n\n"


def sse_data(payload: BaseModel | Mapping[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON (a chunk, or `error_body(...)` for an error mid-stream)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"
