"""Chat templates: Jinja2 in a sandbox, set up as Hugging Face transformers sets it up.

Templates come from model files (tokenizer_config.json or GGUF `tokenizer.chat_template`), so they
are untrusted: rendered in `ImmutableSandboxedEnvironment`, which forbids attribute tricks and
mutation of the inputs. Models were trained on what `transformers`' `apply_chat_template` renders,
so the environment copies its globals, filters and extensions (`utils/chat_template_utils.py`):
a prompt that differs by a space from the training format is a different prompt.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from pydantic_core import from_json

from models.builtin import user_path


class ChatTemplateError(ValueError):
    """The template is missing, invalid, or refused the messages (its own `raise_exception`)."""


class ToolArguments(dict):
    """A tool call's arguments: the parsed JSON object that still reads as the JSON text it came as.

    Templates disagree on the type: Llama 3.1 and Qwen2.5 write `arguments | tojson` and want a
    mapping, DeepSeek-V3 writes `'...' + arguments + '...'` and wants the text. As a dict it gives
    `tojson`, `items` and `is mapping` the object; `+`, `~`, `string` and `{{ }}` give the text
    exactly as the client sent it. So every template renders what transformers renders when
    handed the type that template was written for.
    """

    __slots__ = ("_text",)  # the leading underscore keeps it out of the sandbox's reach

    def __init__(self, value: dict[str, Any], text: str):
        super().__init__(value)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: Any) -> Any:
        return self._text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self._text if isinstance(other, str) else NotImplemented


def template_messages(messages: list[dict[str, Any]], no_text: str | None = None) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as chat templates expect them (new dicts; the input is left alone).

    Follows transformers' own normalisation: keys whose value is None are dropped (templates
    test `'tool_calls' in message`, and Jinja's `trim` turns None into "None"), and reasoning is
    copied under the names templates read. An assistant message that calls tools without text gets
    `content: no_text` (see `render_messages`). Each call's `arguments` JSON text becomes a
    `ToolArguments`; text that is not a JSON object stays a string.
    """
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_tool_call(c) for c in m["tool_calls"]]
            m.setdefault("content", no_text)
        else:
            m.pop("tool_calls", None)  # [] means no calls; Llama 3.1 would count it as a bad one
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, "reasoning": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    call = {k: v for k, v in call.items() if v is not None}
    call.setdefault("type", "function")
    function = call.get("function")
    if isinstance(function, dict):
        function = dict(function)
        args = function.get("arguments")
        if isinstance(args, str) and not args.strip():
            function["arguments"] = ToolArguments({}, "{}")  # as vLLM: no arguments are an empty object
        elif isinstance(args, str):
            try:
                parsed = from_json(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = ToolArguments(parsed, args)
        elif isinstance(args, dict):
            function["arguments"] = ToolArguments(args, json.dumps(args, ensure_ascii=False))
        call["function"] = function
    return call


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' signature, positional order included; Jinja's own filter would HTML-escape
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}` marks the assistant's part for transformers' training masks; a prompt
    keeps the body as is. Parsed as transformers parses it (a call block), so `set` inside it is
    scoped the same way."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates may not store underscore-prefixed attributes on a namespace: {name!r}")


class _Namespace(Namespace):
    """Jinja's `namespace` minus dunder attributes, which would reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


MAX_RENDERED_CHARS = 1 << 24  # a prompt's text (16M characters) beyond any model's context; a longer one is a bomb
MAX_POWER_BITS = 1 << 16  # an integer a template's `**` may make
# `{% for %}` iterations in one rendering: real templates walk the messages and tools a few times (a
# 100,000-message request stays far below); nested loops over `range` or a long string are a CPU bomb
MAX_LOOP_ITEMS = 1 << 20
# and its time, looked at on each iteration, call (a macro recursing into itself twice never loops) and
# filter: a loop whose body filters a long text (`s | list`) is slow on few iterations. Real templates
# render in milliseconds.
MAX_RENDER_SECONDS = 5.0
# an integer a sizing filter takes (`center`'s width, `slice`'s count, `tojson`'s indent): one operation with
# a huge one allocates gigabytes or runs for minutes before any check could run; real templates pass tens.
# (Other filters take any integer: `default(131072)`, `format(200000)` are values, not sizes.)
MAX_FILTER_INT = 1 << 16
_SIZING_FILTERS = frozenset({"center", "indent", "wordwrap", "slice", "batch", "truncate", "tojson"})
# the text `wordwrap` takes (Python's textwrap: ~1 s per million characters)
MAX_WORDWRAP_CHARS = 1 << 20
# a format string (`%`, `format`, str.format): real ones are a line
MAX_FORMAT_CHARS = 1 << 16


@dataclass
class _RenderBudget:
    items_left: int
    deadline: float


_BUDGET: ContextVar[_RenderBudget] = ContextVar("chat_template_render_budget")
_LOOP_GUARD = "__mlaserve_loop_guard"  # the global every compiled `for` iterates through
_SIZE_GUARD = "__mlaserve_size_guard"  # the global every compiled `~` passes its text through
# the widths and precisions of a format's fields (printf-style, str.format's after the ':'): 10^9 builds a
# gigabyte at once. Linear patterns (no field runs past the next '%' or brace); '%%' and '{{' are text.
_FORMAT_SIZES = {"%": re.compile(r"%%|%(?:\([^)%]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?"),
                 "{": re.compile(r"\{\{|\{[^{}:]*:([^{}]*)(\{)?")}


def _text_size(value: Any, limit: int = MAX_RENDERED_CHARS) -> int:
    """About how many characters `value` writes as text (its strings' lengths plus one per item), counted
    until past `limit`: a list of a million references to one long text is small as a list, huge as text."""
    size, stack = 0, [value]
    while stack and size <= limit:
        v = stack.pop()
        if isinstance(v, str):
            size += len(v)
        elif isinstance(v, dict):
            size += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            size += len(v)
            stack.extend(v)
        else:
            size += 1
    return size


def _size_guard(value: Any) -> Any:
    """A text or list a template built (`~`, `+`, a call, a filter): at most what a prompt may hold. Each
    step at most doubles what was bounded before it, so a template that keeps doubling a text stops here,
    not out of memory."""
    text, items = isinstance(value, str), isinstance(value, (list, tuple))
    if text and len(value) > MAX_RENDERED_CHARS or items and len(value) > MAX_LOOP_ITEMS:
        what = f"text of {len(value)} characters" if text else f"list of {len(value)} items"
        raise SecurityError(f"the template built a {what}, more than a prompt may hold")
    return value


def _finalize(value: Any) -> Any:
    """What each `{{ ... }}` writes, before it becomes text: a container whose text would be past the bound
    is refused before `str()` builds it."""
    if isinstance(value, (list, tuple, dict, set, frozenset)) and _text_size(value) > MAX_RENDERED_CHARS:
        raise SecurityError(f"the template writes a value of more than {MAX_RENDERED_CHARS} characters")
    return value


def _big_int(values: Iterable[Any]) -> int | None:
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_FILTER_INT), None)


def _check_format(fmt: str, style: str, args: Iterable[Any] = ()) -> None:
    """Refuses a format (`style` '%' or '{') whose field asks for a width or precision past MAX_FILTER_INT,
    before it is applied; where a width is an argument ('%*d', '{:{}}'), refuses an integer argument past it.
    A format longer than MAX_FORMAT_CHARS is refused unread (scanning 16M characters would hold the GIL for
    seconds, outside the rendering's time limit)."""
    if len(fmt) > MAX_FORMAT_CHARS:
        raise SecurityError(f"the template formats with a text of {len(fmt)} characters, past the "
                            f"{MAX_FORMAT_CHARS} a format needs")
    for match in _FORMAT_SIZES[style].finditer(fmt):
        groups = [g for g in match.groups() if g]
        if any(g in ("*", "{") for g in groups):
            big = _big_int(args)
            if big is not None:
                raise SecurityError(f"the template formats with a width from its arguments ({big}), past the "
                                    f"{MAX_FILTER_INT} a template needs")
        if any(len(n) > 6 or int(n) > MAX_FILTER_INT for g in groups for n in re.findall(r"\d+", g)):
            raise SecurityError(f"the template formats with a field {match.group(0)[:40]!r}, a width past the "
                                f"{MAX_FILTER_INT} a template needs")


# filters that write a container as text: its text's size is measured before they run
_TEXT_FILTERS = frozenset({"join", "string", "tojson", "pprint", "xmlattr", "urlencode", "format"})
# str methods whose result size a template chooses by an argument: checked before they run
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _check_str_method(method: Any, args: tuple[Any, ...]) -> None:
    s, name = method.__self__, method.__name__
    big = _big_int(args)
    if name in _WIDTH_METHODS and big is not None:
        size = abs(big) * (s.count("\t") if name == "expandtabs" else 1)
        if size > MAX_RENDERED_CHARS:
            raise SecurityError(f"the template asks str.{name} for {size} characters, more than a prompt may hold")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = len(s) + 1 if not args[0] else s.count(args[0])
        if len(s) + count * (len(args[1]) - len(args[0])) > MAX_RENDERED_CHARS:
            raise SecurityError("the template's str.replace would build more than a prompt may hold")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        if _text_size(args[0]) + len(s) * len(args[0]) > MAX_RENDERED_CHARS:
            raise SecurityError("the template's str.join would build more than a prompt may hold")


class _GuardConcat(NodeTransformer):
    """Every `a ~ b` of a compiled template through `_size_guard`."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name(_SIZE_GUARD, "load"), [node], [], None, None, lineno=node.lineno)


def _loop_guard(iterable: Iterable[Any]) -> Iterator[Any]:
    """A `for` loop's iterable, counted against the rendering's budget (`render_chat` sets it)."""
    budget = _BUDGET.get(None)
    if budget is None:  # rendered outside render_chat (a template compiled by hand): unbounded
        yield from iterable
        return
    for item in iterable:
        budget.items_left -= 1
        if budget.items_left < 0:
            raise SecurityError(f"the template's loops ran more than {MAX_LOOP_ITEMS} times, more than any "
                                "conversation needs")
        _check_time()
        yield item


def _check_time() -> None:
    budget = _BUDGET.get(None)
    if budget is not None and time.monotonic() > budget.deadline:
        raise SecurityError(f"the template ran for more than {MAX_RENDER_SECONDS:g} s")


def _bounded_filter(name: str, f: Any) -> Any:
    """Filter `f` within the rendering's budget: its time checked, a sizing filter's integer arguments at
    most MAX_FILTER_INT, `wordwrap`'s text and any text it returns bounded."""
    sizing = name in _SIZING_FILTERS

    @wraps(f)  # (keeps Jinja's pass_context / pass_environment marks)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        for a in (*args, *kwargs.values()) if sizing else ():
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_FILTER_INT:
                raise SecurityError(f"the template passes {a} to the filter '{name}', past the {MAX_FILTER_INT} "
                                    "a template needs")
        if name == "wordwrap" and any(isinstance(a, str) and len(a) > MAX_WORDWRAP_CHARS for a in args):
            raise SecurityError(f"the template wraps a text longer than {MAX_WORDWRAP_CHARS} characters")
        if name == "format" and args and isinstance(args[0], str):
            _check_format(args[0], "%", (*args[1:], *kwargs.values()))
        if name == "join":  # a generator (`map(...)|join`) measured as the list it is
            args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
        if name == "indent" and args and isinstance(args[0], str):
            width = next((a for a in (*args[1:2], kwargs.get("width")) if isinstance(a, int)), 4)
            if args[0].count("\n") * abs(width) > MAX_RENDERED_CHARS:
                raise SecurityError(f"the template indents {args[0].count(chr(10))} lines by {width}, more than a "
                                    "prompt may hold")
        for a in (*args, *kwargs.values()) if name in _TEXT_FILTERS else ():  # (`join` of a million references
            # to one long text, `string` of it; filters that count or pick, `length` in a loop over the
            # messages say, are not walked: their results are bounded after)
            if isinstance(a, (list, tuple, dict)) and _text_size(a) > MAX_RENDERED_CHARS:
                raise SecurityError(f"the template passes texts of more than {MAX_RENDERED_CHARS} characters to "
                                    f"the filter '{name}'")
        out = f(*args, **kwargs)
        if isinstance(out, str) and len(out) > MAX_RENDERED_CHARS:
            raise SecurityError(f"the filter '{name}' made a text longer than the {MAX_RENDERED_CHARS} characters "
                                "a prompt may have")
        return _size_guard(out)
    return bounded


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with what it leaves unbounded bounded: a template from a model file asking for
    `'x' * 10**10` or `10 ** 10**9` would make the server build a 10 GB string or spend minutes on one
    integer, for every chat request. The rendered text is bounded too (`render_chat`), and so are the
    iterations and the time of its `for` loops, through `_loop_guard` (nested loops need not write a
    thing to spend minutes), the time at each call (a macro that recurses) and each filter's arguments
    and text (`_bounded_filter`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # (Jinja's own signature)
        _check_time()  # every call a template makes, its macros' too
        if isinstance(getattr(__obj, "__self__", None), str):
            _check_str_method(__obj, args)
        return _size_guard(super().call(__context, __obj, *args, **kwargs))  # (a macro doubling its output)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)  # a template's `str.format` / `format_map`, as it is looked up
        if wrapped is None:
            return None
        fmt = value.__self__
        _check_format(fmt, "{")

        def checked(*args: Any, **kwargs: Any) -> str:  # the widths its arguments give ('{:{}}')
            mapped = args[0].values() if value.__name__ == "format_map" and args and isinstance(args[0], dict) else ()
            _check_format(fmt, "{", (*args, *kwargs.values(), *mapped))
            return _size_guard(wrapped(*args, **kwargs))
        return checked

    def _generate(self, source: nodes.Template, name: str | None, filename: str | None,
                  defer_init: bool = False) -> str:
        # Jinja's documented hook between parsing and code generation; the tree is this compile's own
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [loop.iter], [], None, None,
                                   lineno=loop.iter.lineno)
        return super()._generate(_GuardConcat().visit(source), name, filename, defer_init=defer_init)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                most = MAX_RENDERED_CHARS if isinstance(seq, str) else MAX_LOOP_ITEMS  # (a list's items: any objects)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > most:
                    raise SecurityError(f"the template repeats a sequence {n} times ({len(seq) * n} items), past the "
                                        f"{most} a prompt may have")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right * abs(left).bit_length() > MAX_POWER_BITS):
            raise SecurityError(f"the template raises {left} to the power {right}, an integer past "
                                f"{MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, "%", right if isinstance(right, tuple) else right.values() if isinstance(right, dict) else (right,))
        out = super().call_binop(context, operator, left, right)
        return _size_guard(out)


@lru_cache(maxsize=1)
def template_globals() -> frozenset[str]:
    """The names a chat template finds set by the environment (Jinja's own, the helpers given, such as
    `raise_exception`, and the sandbox's guards): a request's `chat_template_kwargs` may not shadow them."""
    return frozenset(_environment().globals)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"],
                          finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters.update({name: _bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    env.globals[_LOOP_GUARD] = _loop_guard
    env.globals[_SIZE_GUARD] = _size_guard
    return env


@lru_cache(maxsize=16)
def _compile(template: str):
    env = _environment()
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None
    except RecursionError:  # Jinja's parser recurses per nesting level
        raise ChatTemplateError("chat template does not compile: it is nested too deeply") from None


def template_problem(template: str) -> str | None:
    """Why `template` cannot render anything (it does not compile), or None."""
    try:
        _compile(template)
    except ChatTemplateError as e:
        return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return None


JINJA_CHARS = "{}\n"  # a --chat-template value with one of these is a template, else a path (vLLM's rule)


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value as a template: the contents of the file it names, else the value itself
    when it reads as a Jinja template (it has '{', '}' or a newline, as vLLM decides). ChatTemplateError,
    one line, for a path that names no file, a file that cannot be read, an empty template, or one that
    does not compile."""
    try:
        path = user_path(value)
        is_file, exists = path.is_file(), path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: not a path
        is_file = exists = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read the file: {e}") from None
    elif exists:
        raise ChatTemplateError("is not a file")
    elif any(c in value for c in JINJA_CHARS):
        text = value
    else:
        raise ChatTemplateError("names no file (a value without '{', '}' or a newline is a path, not a template)")
    if not text.strip():
        raise ChatTemplateError("is an empty template")
    try:
        _compile(text)
    except ChatTemplateError as e:
        raise ChatTemplateError("; ".join(line.strip() for line in str(e).splitlines() if line.strip())) from None
    return text


# what marks the end of a continued final message's text in its rendering (a space at its end shows
# whether the template trimmed the text)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the tag transformers uses


def render_messages(template: str | None, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """`render_chat` of OpenAI-shaped messages (`template_messages`). An assistant message that only calls
    tools has `content: None` for a template that tests a content `is none` (DeepSeek's write the calls
    only then, and fail on a missing content), or where that rendering fails, "" as vLLM passes it
    (GLM-4.5's template would write "None", gpt-oss's and Qwen3's fail on None)."""
    if template and tests_content_for_none(template):
        try:
            return render_chat(template, template_messages(messages, None), **kwargs)
        except ChatTemplateError:
            if not any(m.get("tool_calls") and m.get("content") is None for m in messages):
                raise
    return render_chat(template, template_messages(messages, ""), **kwargs)


def _cut_at_continue_tag(rendered: str, final_text: str) -> str:
    """The rendering cut where the final message's text ends: transformers' `continue_final_message` cut
    (which vLLM and SGLang use), its trailing whitespace dropped where the template trimmed the text."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("the chat template does not write the final message's text as sent, so it cannot "
                                "be continued (continue_final_message / prefix); send the text the template keeps")
    at = rendered.rindex(tag)
    cut = rendered[:at]
    if rendered.startswith(_CONTINUE_TAG, at):
        return cut
    # trimmed: the text's own trailing whitespace goes (what a whitespace-only text leaves is the template's)
    trailing = len(final_text.lstrip()) - len(final_text.strip())
    return cut[:len(cut) - trailing] if trailing and cut[len(cut) - trailing:].isspace() else cut


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Renders `messages` (from `template_messages`) into the prompt text the model was trained on.

    `continue_final_message`: the text ends right after the final message's text (string content),
    without its end-of-turn markup, for the model to continue it; ChatTemplateError where the template
    does not write that text as sent.

    `extra` reaches the template as variables, e.g. `tools=[{"type": "function", "function": {...}}]`.
    `tools` and `documents` are None unless given, as transformers passes them: some templates
    test `tools is defined`, others `tools is not none`.
    """
    if not template:
        raise ChatTemplateError("this model has no chat template; use the completions API with a plain prompt")
    context = {"tools": None, "documents": None, **extra}
    final_text = None
    if continue_final_message:
        content = messages[-1].get("content") if messages else None
        if isinstance(content, list):  # text parts: the last one is continued, as transformers does
            last = max((i for i, p in enumerate(content) if isinstance(p, dict) and "text" in p), default=None)
            final_text = content[last]["text"] if last is not None else None
            if last is not None:
                content = [*content[:last], {**content[last], "text": final_text + _CONTINUE_TAG}, *content[last + 1:]]
        else:
            final_text = content
            content = f"{content}{_CONTINUE_TAG}"
        if not isinstance(final_text, str) or not final_text:
            raise ChatTemplateError("continuing the final message needs its text content")
        messages = [*messages[:-1], {**messages[-1], "content": content}]
    budget = _BUDGET.set(_RenderBudget(MAX_LOOP_ITEMS, time.monotonic() + MAX_RENDER_SECONDS))
    try:
        parts, size = [], 0
        for part in _compile(template).generate(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **context,
        ):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"chat template failed to render: it writes more than {MAX_RENDERED_CHARS} "
                                        "characters, more than any prompt")
            parts.append(part)
        rendered = "".join(parts)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
    except Exception as e:  # e.g. None + str in a template that did not expect these messages
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(budget)
    return _cut_at_continue_tag(rendered, final_text) if final_text is not None else rendered


def _reads_content(node: nodes.Node, aliases: set[str]) -> bool:
    """`node` is a message's content: `x.content`, `x['content']`, a name set from one, through filters."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.name in aliases


def _content_names(template: str) -> tuple[nodes.Template, set[str]] | None:
    """The template's syntax tree and the names it sets from a message's content (None: it does not parse)."""
    try:
        tree = _environment().parse(template)
    except TemplateError:
        return None
    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and _reads_content(a.node, set())}
    # a macro's parameter given a content (Qwen3.5's `render_content(message.content)`) reads one too
    macros = {m.name: [p.name for p in m.args] for m in tree.find_all(nodes.Macro)}
    for call in tree.find_all(nodes.Call):
        params = macros.get(call.node.name) if isinstance(call.node, nodes.Name) else None
        if params:
            names.update(p for p, arg in zip(params, call.args) if _reads_content(arg, names))
            names.update(k.key for k in call.kwargs if k.key in params and _reads_content(k.value, names))
    return tree, names


@lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether the template walks a message's `content` as a list of parts (`{% for part in
    message['content'] %}`, as Gemma 3's does): such a template gets the parts a client sent, as
    transformers passes them; any other gets their text joined by newlines (vLLM's choice for templates
    that read content as a string). Read from the template's syntax tree, as vLLM detects it."""
    parsed = _content_names(template)
    return parsed is not None and any(_reads_content(f.iter, parsed[1]) for f in parsed[0].find_all(nodes.For))


@lru_cache(maxsize=16)
def tests_content_for_none(template: str) -> bool:
    """Whether the template tests a message's content with `is none` (or `is not none`), as DeepSeek's
    templates do to tell an assistant turn that only calls tools (see `render_messages`)."""
    parsed = _content_names(template)
    return parsed is not None and any(t.name == "none" and _reads_content(t.node, parsed[1])
                                      for t in parsed[0].find_all(nodes.Test))


@lru_cache(maxsize=16)
def accepts_system(template: str) -> bool:
    """Whether the template renders a system message (Gemma 2's refuses the role)."""
    try:
        render_chat(template, [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    except ChatTemplateError:
        return False
    return True


@lru_cache(maxsize=16)
def writes_tool_messages(template: str) -> bool:
    """Whether the template writes a `tool` message's content: some write only system, user and assistant
    turns and drop any other role without a word, so a tool result would never reach the model."""
    marker = "MLASERVE-TOOL-RESULT-PROBE"
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"role": "tool", "tool_call_id": "call_0", "content": marker}]
    try:
        return marker in render_chat(template, probe)
    except ChatTemplateError:
        return False


def user_turn_ids(tokenizer: Any, content_ids: Sequence[int], question: str) -> list[int]:
    """Token ids of a one-message user turn, `content_ids` (text already tokenised) then `question`,
    through the tokenizer's chat template, ready for the answer. The template is rendered around a
    marker and split there, so the content is never re-tokenised (a window of tokens cut from a long
    text stays exactly that). Without a template: BOS where the tokenizer adds one, the content, then
    "Question: …" and "Answer:" lines. Long-context probes and benchmarks build their prompts this way."""
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    if not tokenizer.chat_template:
        bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
        return bos + list(content_ids) + encode(f"\n\nQuestion: {question}\nAnswer:")
    marker = "\x00MLASERVE-CONTENT\x00"
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": marker + "\n\n" + question}],
                       **tokenizer.template_tokens())
    before, after = text.split(marker)
    return encode(before) + list(content_ids) + encode(after)
