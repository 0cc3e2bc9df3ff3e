"""The OpenAI Responses API (`POST /v1/responses`) at the server edge: its request, the chat completions
request it becomes, the names its errors use, and the response object and items it answers with.

    ResponsesRequest --to_chat_request--> ChatCompletionRequest --(the chat completions path: chat
        template, tool plan, structured outputs, sampling defaults, engine requests, reasoning and
        tool-call parsers)--> server.responses.ResponsesSerializer --> Response | SSE events

There is one pipeline: this module only converts shapes. A request renders exactly as the equivalent
chat completions request (same prompt tokens), samples with the same parameters (the model's defaults
for what it leaves out) and is parsed by the same reasoning and tool-call parsers.

Stateless: nothing is stored. `store` is accepted either way and every response says `store: false`;
`previous_response_id`, `conversation`, `background: true` and `item_reference` items (which need
stored responses) are refused with a 400 naming them. A client sends the whole conversation as input
items each time, as the Agents SDK does with `store=False`.

Input items become chat messages:
- a message (`{"role", "content"}`, with or without `"type": "message"`), content a string or a list
  of `input_text` / `output_text` / `refusal` parts (joined with newlines, as chat's text parts are);
- `function_call` (an earlier call of the assistant): an assistant message with `tool_calls`, joined to
  the assistant message right before it (chat's shape for one turn of text and calls);
- `function_call_output`: a `tool` message answering `call_id` (an earlier function_call must have made it);
- `reasoning` items are dropped: chat messages carry no reasoning into the prompt either.
`instructions` comes first, as a system message. `tools` (flat function tools) become chat's nested
ones, `tool_choice {"type": "function", "name"}` chat's named choice, `text.format` `response_format`,
`max_output_tokens` `max_tokens`, `include: ["message.output_text.logprobs"]` with `top_logprobs` chat's
`logprobs` / `top_logprobs` (as OpenAI's API, `top_logprobs` alone asks for nothing), `reasoning.effort`
chat's `reasoning_effort`; chat's extensions `seed` and `top_k` pass as they are. OpenAI's other `include` values and `metadata` are accepted (`metadata` is echoed; an `include`
value OpenAI's API does not know, or an `n` other than 1, is a 400; `metadata` past OpenAI's limits too);
`max_tool_calls` is echoed (it caps built-in tools' calls, and there are none here). Chat's `max_tokens`,
`max_completion_tokens` and `stop` are 400s naming them, as OpenAI's API answers them (ignored, a request
meant to stop early ran to the context's end); other fields this API does not know are ignored, as on chat
completions. `truncation: "auto"` drops a too-long conversation's oldest turns
(`server.serving._fitted`, where the prompt is rendered).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator
from pydantic import ValidationInfo, model_validator

from scheduler.sampling_params import MAX_TOP_LOGPROBS, ParamError
from server.protocol import (
    _FUNCTION_NAME,
    CacheSalt,
    ChatCompletionRequest,
    ChatTokenLogprob,
    NoStructuredExtensions,
    ReasoningEffort,
    Seed,
    _invalid,
    _Body,
    _Request,
    _Response,
    describe_validation_error,
    rename_fields,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]
_TEXT_PARTS = ("input_text", "output_text", "refusal")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# the `include` values OpenAI's API knows: accepted (this one acts on INCLUDE_LOGPROBS alone); others are a 400,
# as there
INCLUDE_VALUES = (INCLUDE_LOGPROBS, "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                  "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
                  "web_search_call.action.sources", "web_search_call.results")

# ---------------------------------------------------------------- requests


class ResponsesFunctionTool(_Request):
    """A function tool, flat (chat nests the same fields under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if value != "function":
            raise _invalid(f"tools of type {value!r} are not supported: only function tools are")
        return value


class ResponsesToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)  # merged with _Request's
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=_FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise _invalid("a text.format of type 'json_schema' needs name and schema")
        return self


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoning(_Request):
    """Echoed; the effort reaches the chat template as chat's `reasoning_effort` does (a template that reads
    none thinks as it always does)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body, NoStructuredExtensions):
    model_config = ConfigDict(allow_inf_nan=False)  # merged with _Request's

    model: str | None = None  # None: the served model
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: StrictBool | None = True
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True  # accepted; nothing is ever stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    n: Any = None  # chat's, refused unless 1: a response has one output
    # chat's length and stop fields: refused by name (the Responses API has max_output_tokens and no stop),
    # as OpenAI refuses them: ignored, a client moving from chat got an answer run to the context's end
    max_tokens: Any = None
    max_completion_tokens: Any = None
    stop: Any = None
    max_tool_calls: StrictInt | None = Field(None, ge=1)  # echoed; it caps built-in tools' calls, none here
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # counts with INCLUDE_LOGPROBS only
    truncation: Literal["disabled", "auto"] | None = None
    # stateful features, refused by to_chat_request
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: StrictBool | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template: none are stored here
    # mlaserve extension, as on chat completions: OmniKV sparse attention for this request's decode
    omnikv: StrictBool | None = None
    # extensions, as on chat completions (checked there): a seed makes a sampled response reproducible
    seed: Seed | None = None
    top_k: StrictInt | None = None
    # vLLM's, as on chat completions (checked there): the prefix cache's tenant salt, the scheduling priority
    cache_salt: CacheSalt | None = None
    priority: Seed | None = None

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value: list[str] | None) -> list[str] | None:
        for i, item in enumerate(value or ()):
            if item not in INCLUDE_VALUES:
                raise _invalid(f"include.{i}: {item!r} is not one of {list(INCLUDE_VALUES)}")
        return value

    @field_validator("n", mode="before")
    @classmethod
    def _one_output(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or value != 1):
            raise _invalid(f"n {value!r} is not supported: a response has one output (for several, send several "
                           "requests or use chat completions' n)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: 16 pairs, keys of 64 characters at most, values of 512."""
        if value is not None:
            if len(value) > 16:
                raise _invalid(f"metadata has {len(value)} keys: at most 16")
            for key, item in value.items():
                if len(key) > 64:
                    raise _invalid(f"metadata key {key[:64]!r}... is {len(key)} characters long: at most 64")
                if len(item) > 512:
                    raise _invalid(f"metadata.{key[:64]} is {len(item)} characters long: at most 512")
        return value

    @field_validator("max_tokens", "max_completion_tokens", "stop", mode="before")
    @classmethod
    def _chat_fields(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            what = ("give max_output_tokens" if info.field_name != "stop" else
                    "it has no stop sequences (chat completions has `stop`)")
            raise _invalid(f"{info.field_name} is a field of /v1/chat/completions, not of the Responses API: {what}")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and value.get("type") != "function":
            raise _invalid(f"tool_choice of type {value.get('type')!r} is not supported: give 'none', 'auto', "
                           "'required' or {'type': 'function', 'name': ...}")
        return value


class _ContentPart(_Request):
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value not in _TEXT_PARTS:
            raise _invalid(f"content parts of type {value!r} are not supported: only input_text and output_text")
        return value

    @model_validator(mode="after")
    def _has_text(self) -> _ContentPart:
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise _invalid(f"a content part of type '{self.type}' needs '{field}'")
        return self

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _string_or_parts(field: str, value: Any) -> Any:
    """A text field of an input item is a string or a list of content parts; anything else is named."""
    if not isinstance(value, (str, list)):
        raise _invalid(f"{field} must be a string or a list of content parts, got {type(value).__name__}")
    return value


def _parts_text(value: list[_ContentPart] | str) -> str:
    return value if isinstance(value, str) else "\n".join(p.value() for p in value)


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[_ContentPart] | str  # the list first: a bad part's error names the part

    _string_or_parts = field_validator("content", mode="before")(lambda v: _string_or_parts("content", v))

    def text(self) -> str:
        return _parts_text(self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: list[_ContentPart] | str
    id: str | None = None
    status: ItemStatus | None = None

    _string_or_parts = field_validator("output", mode="before")(lambda v: _string_or_parts("output", v))

    def text(self) -> str:
        return _parts_text(self.output)


class ReasoningPart(_Request):
    type: str
    text: str | None = None


class ReasoningInputItem(_Request):
    """An earlier turn's reasoning item: its `reasoning_text` (as this server writes it) becomes the next
    assistant message's `reasoning_content`, for the chat template to write or leave out; OpenAI's own
    items (a summary, encrypted content) carry none."""

    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or () if p.type == "reasoning_text" and p.text)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem
_ITEMS: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningInputItem}


def input_items(value: list[Any]) -> list[InputItem]:
    """`input` as items, each checked; ParamError naming `input.[i]...` for one that is not an item we take."""
    items: list[InputItem] = []
    for i, raw in enumerate(value):
        if not isinstance(raw, Mapping):
            raise ParamError(f"input.[{i}]", f"input[{i}] must be an input item (an object), got {type(raw).__name__}")
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "item_reference":
            raise ParamError(f"input.[{i}].type", f"input[{i}] is an item_reference: this server stores no responses "
                             "or items, so send the item itself")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ParamError(f"input.[{i}].type", f"input[{i}] has type {kind!r}: the input items supported are "
                             "messages, function_call, function_call_output and reasoning")
        try:
            items.append(model.model_validate(raw))
        except ValidationError as e:
            message, param = describe_validation_error([{**err, "loc": ("input", i, *err["loc"])} for err in e.errors()])
            raise ParamError(param or "input", message) from None
    return items


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completions request this Responses request is; ParamError naming the Responses field for
    what cannot be converted (stateful features, bad items, a call output that answers no call)."""
    for field, given in (("previous_response_id", req.previous_response_id is not None),
                         ("conversation", req.conversation is not None), ("background", bool(req.background)),
                         ("prompt", req.prompt is not None)):
        if given:
            raise ParamError(field, f"{field} is not supported: this server is stateless and stores no responses; "
                             "send the whole conversation as input items instead")
    req.refuse_extensions("/v1/responses", "text.format")
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    called: dict[str, int] = {}  # call_id -> the index of its function_call item
    answered: set[str] = set()
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(input_items(req.input) if isinstance(req.input, list) else ()):
        if isinstance(item, ReasoningInputItem):
            reasoning = "\n".join(filter(None, (reasoning, item.text())))
            continue
        thought = {"reasoning_content": reasoning} if reasoning else {}
        reasoning = ""
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text(), **(thought if item.role == "assistant" else {})})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if item.call_id in called:
                raise ParamError(f"input.[{i}].call_id", f"input[{i}].call_id '{item.call_id}' is the call_id of "
                                 f"input[{called[item.call_id]}] too: each function_call needs its own")
            called[item.call_id] = i
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thought:  # one turn: its text and its calls
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call], **thought})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise ParamError(f"input.[{i}].call_id", f"input[{i}].call_id '{item.call_id}' matches no function_call "
                                 "item before it")
            if item.call_id in answered:
                raise ParamError(f"input.[{i}].call_id", f"input[{i}] answers function call '{item.call_id}' a second "
                                 "time: send one function_call_output for each call")
            answered.add(item.call_id)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    unanswered = [call_id for call_id in called if call_id not in answered]
    if unanswered:  # as OpenAI's: a call in the conversation has its result in it too
        at = called[unanswered[0]]
        raise ParamError(f"input.[{at}].call_id", f"no function_call_output found for function call "
                         f"'{unanswered[0]}' (input[{at}]): send each call's result as a function_call_output item")
    if not messages:
        raise ParamError("input", "input is required: a string, or a list with at least one message or function call")
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    for field in ("temperature", "top_p", "parallel_tool_calls", "user", "omnikv", "seed", "top_k", "cache_salt",
                  "priority"):
        if field in req.model_fields_set:
            chat[field] = getattr(req, field)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    if INCLUDE_LOGPROBS in (req.include or ()):
        chat["logprobs"] = True
        chat["top_logprobs"] = req.top_logprobs or 0
    if req.tools is not None:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, ResponsesToolChoiceFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            include={"name", "description", "schema_", "strict"}, exclude_none=True, by_alias=True)}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # the items were checked: this would be a conversion bug, still a 400
        message, _ = describe_validation_error(e.errors())
        raise ParamError("input", message) from None


# what the chat path calls a field -> what this API calls it (errors from the shared path are renamed)
_RENAMES = (
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\.\[(\d+)\]\.function\."), r"tools.[\1]."),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
)


def rename_error(message: str, param: str | None) -> tuple[str, str | None]:
    """An error of the chat path in this API's names (`response_format` is `text.format`, chat's
    `messages` is `input`, ...)."""
    message, param = rename_fields(_RENAMES, message, param)
    if param is not None and (param == "messages" or param.startswith("messages.")):
        param = "input"
    return message, param


# ---------------------------------------------------------------- responses


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # with include message.output_text.logprobs


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(_Response):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


class OutputFunctionCall(_Response):
    """A `function_call` output item: `call_id` is what a `function_call_output` item answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | ReasoningItem | OutputFunctionCall


class InputTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    cache_write_tokens: int = 0  # listed by the SDK's type; no cache writes are billed here


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class InputTokens(_Response):
    """`POST /v1/responses/input_tokens`: the prompt tokens the same request to `/v1/responses` would have."""
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(_Response):
    """A failed response's `error` (OpenAI's codes: a failure on the server's side is `server_error`)."""
    code: str = "server_error"
    message: str


class ResponseObject(_Response):
    keep_null = frozenset({"error", "incomplete_details", "instructions", "max_output_tokens", "max_tool_calls",
                           "previous_response_id", "reasoning", "temperature", "top_p", "usage", "user",
                           "completed_at"})
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None  # set once the status is completed
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # nothing is stored, whatever the request said
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


def echoed(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response object repeats them."""
    text: dict[str, Any] = {"format": {"type": "text"}}
    if req.text is not None:
        text = req.text.model_dump(exclude_none=True, by_alias=True)
        text.setdefault("format", {"type": "text"})
    choice: str | dict[str, Any] = "auto"
    if isinstance(req.tool_choice, ResponsesToolChoiceFunction):
        choice = req.tool_choice.model_dump()
    elif req.tool_choice is not None:
        choice = req.tool_choice
    tools = [{"parameters": None, "strict": None, **t.model_dump(exclude_none=True)} for t in req.tools or ()]
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "text": text, "tool_choice": choice, "tools": tools, "top_logprobs": req.top_logprobs or 0,
            "truncation": req.truncation or "disabled",
            "user": req.user, "metadata": dict(req.metadata or {})}
