"""Tool calling at the server edge: what a request's `tools` / `tool_choice` mean for its prompt, its
sampling and the parsing of its output.

    ChatCompletionRequest (or /tokenize's messages: any ChatInput) --plan_tools--> ToolPlan
        .tools       rendered by the model's chat template (HF's `tools` variable)
        .system      our own tool prompt, for a template that ignores `tools` (the list; for "auto" and no
                     format the template implies, Hermes markup to call in)
        .structured  a grammar for forced calls ("required" or a named function), or under "auto" one of
                     free text whose calls are held to the tools (strict tools' arguments to their schemas)
        .new_parser  one parser per choice: model text -> content + tool calls (server.tool_parsers)

`tool_choice`:
- "none" (or no tools): nothing is rendered or parsed.
- "auto" (the default with tools): the template renders the tools; the parser the template implies
  (or `--tool-call-parser`) finds calls in the text. A template that never reads `tools` gets the
  tool list in a system message of ours: DeepSeek-V3's (its template writes past calls in its own
  markup, so the model answers in it) just the list; one that implies no format at all (the default
  SmolLM2 model's) the list and Hermes markup to answer in, read by the Hermes parser.
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects, one
  per call (one at most without `parallel_tool_calls`), each `parameters` to its function's schema.
- a named function: the output is constrained to that function's parameters schema, and the whole
  output is the call's arguments.
Forced calls thus come back valid even from a small model, whatever markup its template uses. For them
a template that never reads `tools` gets the tool list (no markup) in a system message of ours: the
model fills in arguments it has seen described.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from scheduler.sampling_params import ParamError, StructuredOutput
from server.chat_template import accepts_system, writes_tool_messages
from server.protocol import ChatInput, NamedToolChoice
from server.structured import check_json_schema, check_valid_schema, embedded, json_schema_output, schema_output
from server.tool_parsers import (TOOL_PARSERS, JsonEnd, NewId, ToolCall, ToolCallDelta, ToolParser, call_id_maker,
                                 default_call_id, detect_tool_parser)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# our tool prompt, for templates that do not render `tools` themselves (answered in Hermes markup)
_TOOL_PROMPT = (
    "You can call functions to help with the user's request. Their signatures, as JSON, are listed "
    "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between <tool_call> and "
    "</tool_call>, one block per call:\n<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": "
    "<arguments as a JSON object>}}\n</tool_call>"
)


# for templates that know a call format (DeepSeek-V3's writes past calls and results) but do not list
# the tools: the list alone, the model answers in the markup it was trained on
_TOOL_LIST_PROMPT = "You can call these functions, given as JSON signatures:\n{tools}"


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None = None
    system: str | None = None
    structured: StructuredOutput | None = None
    new_parser: Callable[[], MergedDeltas | RequiredToolCalls] | None = None
    # a named tool_choice: OpenAI then ends the forced call with finish_reason "stop", not "tool_calls"
    named: bool = False
    # the markup `new_parser` reads (`ToolParser.markup`): special tokens with this text stay in its input
    markup: tuple[str, ...] = ()
    # tool_choice "auto": the model may answer in text; `structured` (strict tools' calls, if any) then gives
    # way to a response format the request also asks for (that text's constraint)
    free: bool = False

    @property
    def forced(self) -> bool:
        """A call is this turn's whole output ("required" or a named function)."""
        return self.structured is not None and not self.free


def plan_tools(body: ChatInput, template: str | None, parser_name: str = "auto") -> ToolPlan:
    """The request's tool plan; ParamError naming the field for tools or choices that cannot work."""
    _check_history(body)
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise ParamError("tool_choice", "tool_choice needs tools: the request has none")
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ParamError("tools", f"the function name '{dup}' is given twice in tools")
    for i, t in enumerate(tools):  # shown to the model whatever the choice: a broken one is the client's mistake
        _check_parameters(t.function.parameters, f"tools.[{i}].function.parameters")
    if not tools or choice == "none":
        return ToolPlan()
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    # ids the template accepts when the calls come back (Kimi's count the history's calls)
    new_id = call_id_maker(template, sum(len(m.tool_calls or ()) for m in body.messages if m.role == "assistant"))
    renders_tools = template is not None and "tools" in template
    listed = None if renders_tools else "\n".join(json.dumps(t, ensure_ascii=False) for t in rendered)
    # a forced call (named or required) is written as the constrained JSON, not in any markup, but the
    # model still has to see the tools' descriptions to fill in their arguments: listed in a system
    # prompt when the template does not render them
    forced_system = None if listed is None else _TOOL_LIST_PROMPT.format(tools=listed)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ParamError("tool_choice", f"tool_choice names the function '{choice.function.name}', which is not "
                             f"among tools ({', '.join(names)})")
        fn = tools[names.index(choice.function.name)].function
        where = f"tools.[{names.index(fn.name)}].function.parameters"
        # (what the engine refuses of it, a range xgrammar cannot compile say, is named by the tool's schema)
        params = fn.parameters if fn.parameters is not None else _EMPTY_PARAMETERS
        return ToolPlan(rendered, forced_system, json_schema_output(params, where),  # (checked and rewritten once)
                        lambda: MergedDeltas(NamedToolCall(fn.name, new_id)), named=True)
    if choice == "required":
        # each tool's parameters under $defs, their own references rewritten to point there
        defs = {f"tool{i}": embedded(_parameters(t.function.parameters, f"tools.[{i}].function.parameters"),
                                     f"#/$defs/tool{i}") for i, t in enumerate(tools)}
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "parameters"]}
                 for i, t in enumerate(tools)]
        schema: dict[str, Any] = {"$defs": defs, "type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(rendered, forced_system, schema_output(schema, "tool_choice"),
                        lambda: RequiredToolCalls(new_id))
    # auto: the parser the template implies (or the flag's); Hermes where nothing says otherwise
    name = reply_parser(template, parser_name)
    if name is None and renders_tools:
        raise ParamError("tools", "this model's chat template uses a tool-call format mlaserve does not recognise; "
                         f"start the server with --tool-call-parser (one of {', '.join(sorted(TOOL_PARSERS))})")
    name = name or "hermes"
    markup = TOOL_PARSERS[name].markup
    strict = _strict_calls(name, tools, body.parallel_tool_calls)
    if listed is None:
        return ToolPlan(rendered, None, strict, _parser(name, body.parallel_tool_calls, new_id, tools), markup=markup,
                        free=True)
    prompt = (_TOOL_PROMPT if name == "hermes" else _TOOL_LIST_PROMPT).format(tools=listed)
    return ToolPlan(None, prompt, strict, _parser(name, body.parallel_tool_calls, new_id, tools), markup=markup, free=True)


def _strict_calls(parser: str, tools: list[Any], parallel: bool | None) -> StructuredOutput | None:
    """Under tool_choice "auto", where a tool asks for `strict` and the parser's markup frames a call's
    arguments (`ToolParser.call_tag`): a grammar of free text in which every call is a call to one of the
    tools, a strict tool's arguments held to its parameters schema (checked as a forced call's: a keyword
    the grammar engine cannot enforce is a 400) and another's to any JSON object; one call at most without
    `parallel_tool_calls`. OpenAI's strict mode guarantees the arguments match; elsewhere strict is taken and
    the calls are read as the model writes them."""
    cls = TOOL_PARSERS[parser]
    if not any(t.function.strict for t in tools) or cls.call_tag(tools[0].function.name) is None:
        return None
    tags, triggers = [], []
    for i, t in enumerate(tools):
        trigger, begin, end = cls.call_tag(t.function.name)  # type: ignore[misc]
        schema = check_json_schema(t.function.parameters if t.function.parameters is not None else _EMPTY_PARAMETERS,
                                   f"tools.[{i}].function.parameters") if t.function.strict else {"type": "object"}
        tags.append({"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema},
                     "end": end})
        triggers += [trigger] if trigger not in triggers else []
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                                                "at_least_one": False, "stop_after_first": parallel is False}}
    return StructuredOutput("structural_tag", json.dumps(tag, ensure_ascii=False), "tools")


def reply_parser(template: str | None, parser_name: str) -> str | None:
    """The tool parser that reads a reply: the flag's (`--tool-call-parser`), else the one the template
    implies (None where it implies none)."""
    return detect_tool_parser(template) if parser_name == "auto" else parser_name


def _text_of(content: Any) -> str:
    """A message's content as one string: text parts joined by newlines (`ChatMessage.text`'s rule)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def with_system(messages: list[dict[str, Any]], text: str, template: str | None) -> list[dict[str, Any]]:
    """`text` added to the system message; where there is none, a new one first, or, for a template that
    refuses the system role (Gemma 2's), at the head of the first user message, as such models are
    prompted."""
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": f"{_text_of(messages[0].get('content'))}\n\n{text}"}, *messages[1:]]
    if messages and messages[0]["role"] == "user" and template is not None and not accepts_system(template):
        return [{**messages[0], "content": f"{text}\n\n{_text_of(messages[0].get('content'))}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def with_call_markup(messages: list[dict[str, Any]], template: str | None,
                     parser_name: str = "auto") -> list[dict[str, Any]]:
    """Past tool calls and results written into the messages' text, for a chat template that does not read
    `tool_calls` (the default SmolLM2 model's): it would render an assistant turn that called tools as empty
    (or fail on its `content: null`), so the model would see results of calls it never made. The calls are
    written in the markup of the parser that reads the reply (`parser_name` as `plan_tools` takes it; Hermes
    `<tool_call>` blocks, which our tool prompt asks for, where nothing names another), so a model that
    copies them is read back; each `tool` message's content in a `<tool_response>` block, sent as a user
    turn (as Hermes-format templates write results: one turn for consecutive results) where the template
    drops `tool` messages. A template that reads `tool_calls` gets the messages as they are (it writes
    calls in its own markup)."""
    if template is not None and "tool_calls" in template:
        return messages
    written = TOOL_PARSERS[reply_parser(template, parser_name) or "hermes"].written
    result_role = "tool" if template is None or writes_tool_messages(template) else "user"
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn the latest tool results went in
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            written_calls = []
            for c in calls:
                fn = c.get("function") or {}
                args = fn.get("arguments")
                try:
                    parsed = from_json(args) if isinstance(args, str) else args
                except ValueError:
                    parsed = args  # not JSON: written as the text it is
                written_calls.append((fn.get("name"), parsed if parsed is not None else {}))
            text = _text_of(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = written(text, written_calls)
        elif m.get("role") == "tool":
            block = f"<tool_response>\n{_text_of(m.get('content'))}\n</tool_response>"
            if results is not None and out[-1] is results:  # one user turn for a call's results, as Hermes
                results["content"] += "\n" + block  # templates write them (two in a row broke alternation)
                continue
            m = {**m, "role": result_role, "content": block}
            results = m if result_role == "user" else None
        out.append(m)
    return out


def _check_history(body: ChatInput) -> None:
    """Every `tool` message answers a call an earlier assistant message made."""
    called: set[str] = set()
    for i, m in enumerate(body.messages):
        for c in m.tool_calls or ():
            called.add(c.id)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ParamError(f"messages.[{i}].tool_call_id", f"messages[{i}] has role 'tool' and no tool_call_id")
            if m.tool_call_id not in called:
                raise ParamError(f"messages.[{i}].tool_call_id", f"messages[{i}].tool_call_id '{m.tool_call_id}' "
                                 "matches no tool call of an earlier assistant message")


def _check_parameters(schema: Any, param: str) -> None:
    """A function's parameters are a valid JSON Schema of an object (OpenAI's rule: the arguments are one
    JSON object), or absent."""
    if schema is None:
        return
    check_valid_schema(schema, param)
    kind = schema.get("type", "object") if isinstance(schema, dict) else None
    if kind != "object":
        raise ParamError(param, f"{param} must be the JSON Schema of an object (\"type\": \"object\"): a call's "
                         f"arguments are one JSON object; got type {json.dumps(kind)}")


def _parameters(schema: dict[str, Any] | None, param: str) -> dict[str, Any]:
    if schema is None:
        return _EMPTY_PARAMETERS
    check_json_schema(schema, param)
    return schema


def _parser(name: str, parallel: bool | None, new_id: NewId, tools: list[Any]) -> Callable[[], MergedDeltas]:
    cls = TOOL_PARSERS[name]
    if parallel is False:
        return lambda: MergedDeltas(FirstCallOnly(cls.for_tools(new_id, tools)))
    return lambda: MergedDeltas(cls.for_tools(new_id, tools))


class NamedToolCall:
    """tool_choice names a function: the whole (grammar-constrained) output is its arguments, streamed
    as they come."""

    def __init__(self, name: str, new_id: NewId = default_call_id) -> None:
        self.call = ToolCall(new_id(name, 0), name, "")
        self._started = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        out = []
        if text and not self._started:  # the call begins with its arguments' first character
            self._started = True
            out.append(ToolCallDelta(0, self.call.id, self.call.name, ""))
        if text:
            self.call.arguments += text
            out.append(ToolCallDelta(0, arguments=text))
        return "", out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Nothing more to send: a call is what the model began writing (a reply cut off before its first
        character, in its reasoning say, has no call, as "required"'s has none)."""
        return "", []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [self.call] if self._started else []


class RequiredToolCalls:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects (the grammar
    writes the keys in that order). Each call is sent as it is written: its id and name once its name
    is complete, then its arguments (the `parameters` object's text) as they come. A reply cut off by
    max_tokens thus ends with the calls begun so far (a call whose name was written, its arguments
    partial or still empty), as a named tool_choice's does; nothing of the array's own syntax ever
    reaches the content."""

    _NAME = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"')  # a call's start, up to its name
    _PARAMETERS = re.compile(r'\s*,\s*"parameters"\s*:\s*')  # then its arguments' key

    def __init__(self, new_id: NewId = default_call_id) -> None:
        self._new_id = new_id
        self._pending = ""  # text not consumed yet: a call's head still incomplete, or the array's tail
        self._state = "name"  # what the text goes on with: "name" (a call's start), "parameters", "args"
        self._nesting = JsonEnd()  # where the open call's parameters object closes
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        out: list[ToolCallDelta] = []
        while self._pending:
            if self._state == "name":
                head = self._NAME.match(self._pending)
                if head is None:  # wait for more (or the array's closing "}]", which is dropped)
                    break
                self.calls.append(ToolCall(self._new_id(head.group(1), len(self.calls)), head.group(1), ""))
                out.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, head.group(1), ""))
                self._pending = self._pending[head.end():]
                self._state = "parameters"
                continue
            if self._state == "parameters":
                key = self._PARAMETERS.match(self._pending)
                if key is None:
                    break
                self._pending = self._pending[key.end():]
                self._state, self._nesting = "args", JsonEnd()
                continue
            if not self.calls[-1].arguments:  # the object's text starts at its "{", wherever the pieces split
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
            end = self._nesting.end(self._pending)
            piece = self._pending if end is None else self._pending[:end]
            self.calls[-1].arguments += piece
            out.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
            self._pending = self._pending[len(piece):]
            if end is None:
                break
            self._state = "name"
        return "", merge_deltas(out)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.calls


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of the same call as one (OpenAI sends one entry per call index in a chunk; a
    client reading `tool_calls[0]` of a chunk would miss the rest)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None and d.name is None:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out


class MergedDeltas:
    """A tool parser whose deltas come merged (`merge_deltas`), whichever parser it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.feed(text)
        return content, merge_deltas(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.finish()
        return content, merge_deltas(deltas)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.inner.tool_calls


class FirstCallOnly:
    """`parallel_tool_calls: false` with a model-format parser: calls after the first are dropped."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.feed(text)
        return content, [d for d in deltas if d.index == 0]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.finish()
        return content, [d for d in deltas if d.index == 0]

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.inner.tool_calls[:1]
