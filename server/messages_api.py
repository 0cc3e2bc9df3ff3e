"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) at the server edge:
its request, the chat completions request it becomes, and its error shape. The answer is told by
`server.responses.MessagesSerializer`.

    MessagesRequest --to_chat_request--> ChatCompletionRequest --(the chat completions path)-->
        MessagesSerializer --> Message | SSE events

As with the Responses API, this module only converts shapes: a request renders exactly as the equivalent
chat completions request (same prompt tokens) and is parsed by the same reasoning and tool-call parsers.
- `system` comes first, as a system message; a user message's `text` blocks are its text, its
  `tool_result` blocks `tool` messages (before the text, answering an earlier `tool_use` by its id); an
  assistant message's `text` blocks are its text and its `tool_use` blocks its tool calls; `thinking`
  blocks are dropped, as chat messages carry no reasoning into the prompt. Images and documents are a 400.
- A final assistant message is a prefill, as Anthropic's API has it: the model continues its text
  (`continue_final_message`) and the reply holds only what it adds.
- `tools` (`name`, `description`, `input_schema`, `strict`) become chat's function tools; `tool_choice` `auto`,
  `any`, `tool` (by `name`) and `none` chat's `auto`, `required`, a named function and `none`;
  `disable_parallel_tool_use` is `parallel_tool_calls: false`. Anthropic's server tools (a `type` such as
  `web_search_20250305`), `mcp_servers` and `container` are a 400: this server runs none. So is `thread`
  (the message-threads beta: the server would hold the conversation), with the `details.error_code` on
  which Anthropic's SDK resends the turn with the whole history and no thread.
- `max_tokens` (required), `stop_sequences` (each with some non-whitespace text), `temperature`, `top_p`,
  `top_k` (0 or more) and `stream` map one to one
  (Anthropic's newer SDKs send the sampling fields only through `extra_body`); `output_config.format`
  (`{"type": "json_schema", "schema"}`, structured outputs; the beta's `output_format` too) is chat's
  `response_format`; `temperature` keeps Anthropic's range (0 to 1); `thinking`
  `{"type": "enabled" | "disabled"}` sets the chat template's thinking switch (DeepSeek-V3.1's
  `thinking`, Qwen3's `enable_thinking`; `budget_tokens` is checked as Anthropic checks it, below
  `max_tokens`, but not enforced); `metadata`,
  `output_config.effort` and `service_tier` are accepted and ignored, and so are fields this API does not
  know, as on chat completions.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from engine.messages import context_numbers
from scheduler.sampling_params import ParamError
from server.protocol import (
    _FUNCTION_NAME,
    ChatCompletionRequest,
    NoStructuredExtensions,
    _Body,
    _invalid,
    _Request,
    _Response,
    check_part_types,
    describe_validation_error,
    rename_fields,
)

# Anthropic's error types by HTTP status (an overload, the chat path's 503 `overloaded`, is answered 529
# `overloaded_error` as Anthropic's API answers it: server.serving.anthropic_error)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


# the chat path's field names as this API's (requests are served as chat requests)
_RENAMES = (
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "output_config.format.schema"),
    # (not where a request sending chat's own field is told it is not taken here)
    (re.compile(r"\bresponse_format(\.json_schema)?\b(?! is not taken here)"), "output_config.format"),
    (re.compile(r"\btools\.\[(\d+)\]\.function\.parameters\b"), r"tools.[\1].input_schema"),
    (re.compile(r"\btools\.\[(\d+)\]\.function\."), r"tools.[\1]."),
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"'stop'"), "'stop_sequences'"),
    (re.compile(r"^stop$"), "stop_sequences"),
)


def context_error(message: str) -> str | None:
    """A context-length error's message (`engine.messages.context_message`) as Anthropic's API words it, whose
    wording clients read back (a prompt too long to send again as it is; `max_tokens` to lower); None for
    another error."""
    numbers = context_numbers(message)
    if numbers is None:
        return None
    limit, prompt, more = numbers
    if prompt > limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return (f"input length and `max_tokens` exceed context limit: {prompt} + {more} > {limit}, decrease "
            "input length or `max_tokens` and try again")


def rename_error(message: str, param: str | None) -> tuple[str, str | None]:
    """An error of the chat path in this API's names (`response_format` is `output_config.format`, a
    tool's `function.parameters` its `input_schema`)."""
    return rename_fields(_RENAMES, message, param)


def error_type(status: int, code: str | None) -> str:
    """Anthropic's `error.type` for one of this server's errors."""
    if code == "overloaded":
        return "overloaded_error"
    return _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


# the code of the refusal of `thread`: Anthropic's SDK then resends the turn with the whole history and no
# `thread` (its threads' `continue_unthreaded`, the default of `beta.messages.tool_runner`), so that its flows
# work against a server that holds no conversations
THREAD_UNSUPPORTED = "thread_unsupported_request"


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An error as Anthropic's API writes it (the body of a 4xx/5xx, and a stream's `error` event)."""
    error: dict[str, Any] = {"type": error_type(status, code), "message": message}
    if code == THREAD_UNSUPPORTED:
        error["details"] = {"error_code": code, "unsupported": ["thread"]}
    return {"type": "error", "error": error}

THREAD_MESSAGE = ("thread is not supported: this server is stateless and holds no conversation; send the whole "
                  "history in messages, without thread")


# ---------------------------------------------------------------- requests


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _text_blocks(value: Any, where: str) -> Any:
    """`value` as it came when it is not a list; else the validation error for the first block that is
    not a text block with its text (pydantic's own, for a `str | list[TextBlock]` field, would only say
    that the input is not a string)."""
    value = check_part_types(value, ("text",), f"{where} holds text blocks only on this server (no images or "
                             "documents)")
    for i, block in enumerate(value if isinstance(value, list) else ()):
        if not isinstance(block.get("text"), str):
            raise _invalid(f"{where}'s text block {i} needs its text, a string")
    return value


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: StrictBool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_blocks(value, "a tool_result's content")

    def text(self) -> str:
        return _text(self.content)


class ThinkingBlock(_Request):
    """An earlier turn's reasoning, sent back by clients that keep it: its text becomes the chat message's
    `reasoning_content`, for the chat template to write or leave out (a redacted one has none)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        value = check_part_types(value, ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"),
                                 "this server reads text, tool_use, tool_result and thinking blocks (no images or "
                                 "documents)")
        for block in value if isinstance(value, list) else ():  # (here, or the union's string branch would answer)
            if block.get("type") == "tool_result":
                _text_blocks(block.get("content"), "a tool_result's content")
        return value


class ToolParam(_Request):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of a client tool, as Anthropic's API requires it
    type: str | None = None  # "custom" or absent; Anthropic's server tools name their kind here
    strict: StrictBool | None = None  # strict tool use: the calls' inputs held to the schema (chat's `strict`)

    @field_validator("type")
    @classmethod
    def _client_tools_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise _invalid(f"tool type {value!r} is one of Anthropic's server tools, which this server does not "
                           "run: describe a client tool with name, description and input_schema")
        return value

    @model_validator(mode="after")
    def _has_input_schema(self) -> "ToolParam":
        if self.input_schema is None:  # (after the type: a server tool has none, and is told so first)
            raise _invalid(f"tool {self.name!r} has no input_schema: a client tool needs one, the JSON Schema of "
                           "its input ({\"type\": \"object\", \"properties\": {...}})")
        return self


class ToolChoiceParam(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted, ignored


class MessagesRequest(_Body, NoStructuredExtensions):
    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)]  # Anthropic's API asks for at least one token
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: StrictFloat | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None  # Anthropic's range (chat's -1, "all", is not one)
    stream: StrictBool | None = False
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Anthropic's server-side features: refused rather than ignored (the reply would not have used them)
    mcp_servers: Any = None
    container: Any = None
    thread: Any = None  # server-held conversation state: refused by the route with THREAD_UNSUPPORTED

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return _text_blocks(value, "system")

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, value: list[MessageParam]) -> list[MessageParam]:
        for i, m in enumerate(value):  # Anthropic's rule: only a final assistant message (a prefill) may be empty
            if m.content in ("", []) and not (m.role == "assistant" and i == len(value) - 1):
                raise _invalid(f"messages.{i}: all messages must have non-empty content except for the optional "
                               "final assistant message")
            for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
                if isinstance(block, TextBlock) and not block.text:  # Anthropic's rule too
                    raise _invalid(f"messages.{i}.content.{j}: text content blocks must be non-empty")
        last = value[-1]
        tail = last.content if isinstance(last.content, str) else (
            last.content[-1].text if last.content and isinstance(last.content[-1], TextBlock) else "")
        if last.role == "assistant" and tail != tail.rstrip():  # Anthropic's rule: the prefill's last token
            # would be a lone space, which a model's tokenizer puts before words: what follows went astray
            raise _invalid("messages: final assistant content cannot end with trailing whitespace; leave the "
                           "whitespace out of the prefill")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _visible_stops(cls, value: list[str] | None) -> list[str] | None:
        for i, stop in enumerate(value or ()):
            if not stop.strip():  # Anthropic's rule: a stop of spaces or nothing would end any reply at once
                raise _invalid(f"stop_sequences.{i}: each stop sequence must contain non-whitespace")
        return value

    @field_validator("mcp_servers", "container")
    @classmethod
    def _server_side(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise _invalid(f"{info.field_name} is one of Anthropic's server-side features, which this server does "
                           "not run: leave it out")
        return value

    @field_validator("thinking")
    @classmethod
    def _budget(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _invalid(f"thinking.type must be 'enabled', 'disabled' or 'adaptive', not {value.get('type')!r}")
        if value is not None and value.get("type") == "enabled":
            budget = value.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise _invalid("thinking of type 'enabled' needs budget_tokens, a positive integer")
        return value
    # mlaserve extension, as on chat completions: OmniKV sparse attention for this request's decode
    omnikv: StrictBool | None = None


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a request's prompt, counted; nothing is generated."""

    max_tokens: Annotated[StrictInt, Field(ge=1)] = 1


class TokenCount(_Response):
    input_tokens: int


class ModelInfo(_Response):
    """A model as Anthropic's `/v1/models` lists it (the Anthropic SDK's `models.list()` / `retrieve()`)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339
    lifecycle: Literal["active"] = "active"  # served: open to use (the SDK's type requires the field)
    max_input_tokens: int  # the context: the prompt and max_tokens together fit in it
    max_tokens: int  # the most max_tokens can be


class ModelInfoList(_Response):
    keep_null = frozenset({"first_id", "last_id"})  # an empty page has them null, as Anthropic's
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


def model_info(model_id: str, created: int, context_length: int) -> ModelInfo:
    stamp = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ModelInfo(id=model_id, display_name=model_id, created_at=stamp, max_input_tokens=context_length,
                     max_tokens=max(1, context_length - 1))  # (a prompt takes a token at least)


def model_info_list(model_id: str, created: int, context_length: int, query: Mapping[str, str]) -> ModelInfoList:
    """The one-model page Anthropic's list would give for its cursor parameters (`after_id` / `before_id`:
    the page past that model, empty; `limit` 1 to 1000); ParamError naming a bad one."""
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= 1000:
        raise ParamError("limit", f"limit must be an integer from 1 to 1000, got {limit!r:.40}")
    cursor = next(((k, query[k]) for k in ("after_id", "before_id") if k in query), None)
    if cursor is not None and cursor[1] != model_id:
        raise ParamError(cursor[0], f"{cursor[0]} {cursor[1]!r:.80} names no model here (the model is '{model_id}')")
    if cursor is not None:  # the page past the only model
        return ModelInfoList(data=[], first_id=None, last_id=None)
    return ModelInfoList(data=[model_info(model_id, created, context_length)], first_id=model_id, last_id=model_id)


def _text(content: str | list[TextBlock] | None) -> str:
    if isinstance(content, list):
        return "\n".join(b.text for b in content)
    return content or ""


def _turns(messages: list[MessageParam]) -> list[tuple[int, str, list[Block], list[str]]]:
    """The conversation's turns as Anthropic's API reads them: consecutive messages of one role are one turn
    (their blocks in order: tool_result blocks sent one message each answer the calls together; a prefill
    split over two messages is one), and an empty final assistant message is no prefill. Each turn with the
    index of its first message, its blocks and where each came from (`messages.[i].content.[k]`); ParamError
    for a block its role cannot hold."""
    turns: list[tuple[int, str, list[Block], list[str]]] = []
    for i, m in enumerate(messages):
        blocks: list[Block] = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        for k, b in enumerate(blocks):
            if b.type not in _BLOCKS[m.role]:
                raise ParamError(f"messages.[{i}].content.[{k}]",
                                 f"{'an' if m.role[0] in 'aeiou' else 'a'} {m.role} message cannot hold a {b.type} block "
                                 f"(messages[{i}].content[{k}])")
        if m.content in ("", []):  # (only the final assistant message may be empty: the request checked it)
            continue
        if not turns or turns[-1][1] != m.role:
            turns.append((i, m.role, [], []))
        turns[-1][2].extend(blocks)
        turns[-1][3].extend(f"messages.[{i}].content.[{k}]" for k in range(len(blocks)))
    return turns


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completions request this Messages request is; ParamError naming the Messages field for
    what cannot be converted."""
    req.refuse_extensions("/v1/messages", "output_config.format")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    called: set[str] = set()
    unanswered: list[str] = []  # the previous assistant message's tool_use ids: the next message answers each
    for i, role, blocks, origins in _turns(req.messages):
        answered = {b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)}
        if missing := [u for u in unanswered if u not in answered]:  # as Anthropic's API refuses it
            raise ParamError(f"messages.[{i}]", f"tool_use ids were found without tool_result blocks immediately "
                             f"after: {', '.join(missing)}; each tool_use block must have a tool_result block in the "
                             f"next message (messages[{i}])")
        unanswered = []
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        if role == "user":
            for k, b in enumerate(blocks):
                if isinstance(b, ToolResultBlock):
                    if b.tool_use_id not in called:
                        raise ParamError(f"{origins[k]}.tool_use_id",
                                         f"tool_use_id '{b.tool_use_id}' matches no tool_use block before it")
                    text = b.text()
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                     "content": f"Error: {text}" if b.is_error else text})
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                messages.append({"role": "user", "content": "\n".join(texts)})
            continue
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        called.update(c["id"] for c in calls)
        unanswered = [c["id"] for c in calls]
        thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlock) and b.thinking]
        messages.append({"role": "assistant", "content": "\n".join(texts) if texts else None,
                         **({"tool_calls": calls} if calls else {}),
                         **({"reasoning_content": "\n".join(thoughts)} if thoughts else {})})
    if not messages or messages[-1]["role"] == "system":
        raise ParamError("messages", "messages holds no content to answer: send a user message")
    final = messages[-1]
    prefill = final["role"] == "assistant"
    if prefill and (final.get("tool_calls") or not (final["content"] or "").strip()):
        raise ParamError("messages", "the final message is the assistant's and has no text to continue: end with "
                         "a user message (with the tool_result blocks of any tool_use)")
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens,
                            "stream": bool(req.stream), "continue_final_message": prefill}
    for field in ("temperature", "top_p", "top_k", "omnikv"):
        if field in req.model_fields_set:
            chat[field] = getattr(req, field)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.tools is not None:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            **({"strict": t.strict} if t.strict is not None else {}),
            "parameters": t.input_schema or {"type": "object", "properties": {}}}} for t in req.tools]
    mode = (req.thinking or {}).get("type")
    budget = (req.thinking or {}).get("budget_tokens")
    if mode == "enabled" and "max_tokens" in req.model_fields_set and budget >= req.max_tokens:
        raise ParamError("thinking.budget_tokens", f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                         f"({req.max_tokens}), which counts the thinking too")
    if mode in ("enabled", "disabled"):  # the templates' switches: DeepSeek-V3.1's `thinking`, Qwen3's
        chat["chat_template_kwargs"] = {"thinking": mode == "enabled", "enable_thinking": mode == "enabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if req.output_format is not None:
        if fmt is not None:
            raise ParamError("output_format", "output_format and output_config.format were both given: send one "
                             "(output_config.format is the current spelling)")
        fmt = req.output_format
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ParamError("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # the blocks were checked: this would be a conversion bug, still a 400
        message, param = describe_validation_error(e.errors())
        raise ParamError(param or "messages", message) from None


def stop_reason(finish_reason: str | None, matched: str | None) -> tuple[str | None, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a choice's finish reason and the stop string
    that ended it."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "stop":
        return ("stop_sequence", matched) if matched else ("end_turn", None)
    return None, None
