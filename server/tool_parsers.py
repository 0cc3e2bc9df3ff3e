"""Tool-call parsers: a chat model's generated text -> OpenAI `tool_calls`.

One `ToolParser` per generated choice. `feed()` takes each new piece of detokenized text and returns
the content to show now and the tool-call deltas now; `finish()` flushes what was held back. The
non-streamed response is the same machine fed the whole text at once (`parse_tool_calls`), so the two
paths agree for every chunking. That holds because each step decides only on text it has seen in
full and holds back any tail that later text could still turn into markup: the first characters of
a marker, or the closing fence and whitespace at the end of arguments. Nothing sent is taken back.

Formats (the markup of the models' own chat templates):
  deepseek_v3 (also V2.5, R1):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    ... <｜tool▁calls▁end｜>
  deepseek_v31:
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>... <｜tool▁calls▁end｜>
  hermes (Qwen2.5, Hermes 2/3):  <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call> ...
  llama3_json (Llama 3.1/3.2):   [TEXT <|python_tag|>]{"name": NAME, "parameters": ARGS}[; {...}]* [TEXT], or a JSON
                                 array of such objects
  mistral (v0.3):                TEXT [TOOL_CALLS] [{"name": NAME, "arguments": ARGS}, ...]
  mistral (tokenizer v11+):      TEXT [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...} [TEXT]
  qwen3_coder (also Qwen3.5, Nemotron 3):
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call> ...
  kimi_k2 (Kimi-K2 Instruct and Thinking; the call's id is its header, `functions.NAME:INDEX`):
    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS<|tool_call_end|>
    ... <|tool_calls_section_end|>
  glm45 / glm47 (GLM-4.5, 4.6, 4.7; GLM-4.7 without the newlines):
    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call> ...

DeepSeek, Kimi-K2 and Hermes arguments stream as they are written, after a first delta carrying id and name (a
Hermes block whose head is not `{"name": NAME, "arguments": {` is held until `</tool_call>` and read
whole). Llama output that begins a JSON object or
array is held to the end: its calls are known only once their JSON is whole. Markup that yields no call (a
malformed block, a call cut off before its name was complete) is shown as content, raw; a call cut
off in its arguments keeps the arguments sent.

Feed the text detokenized WITH the markers: DeepSeek's and Qwen's are added (non-special) tokens
and survive `skip_special_tokens`; Kimi-K2's are special tokens, kept because they are the parser's `markup`.
Llama's `<|python_tag|>` is special and optional here.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.decoder import scanstring
from typing import Any


def _json(value: Any) -> str:
    """A value as the models' templates write it (`tojson`'s separators, characters as they are)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call `index`: `id` and `name` come only on the call's first piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # text to append to function.arguments


@dataclass
class ToolCall:
    """An assembled call; `arguments` is the JSON text as the model wrote it, stripped."""

    id: str
    name: str
    arguments: str


#: how a call's id is made: from its function's name and its place among the output's calls (most makers
#: ignore both; Kimi-K2's ids spell them out)
NewId = Callable[[str, int], str]


def default_call_id(name: str = "", index: int = 0) -> str:
    """An OpenAI-style call id; ids only need to be unique within a conversation."""
    return "call_" + secrets.token_hex(12)


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """Position and marker of the earliest marker in `text`, or (-1, "")."""
    best = (-1, "")
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, marker)
    return best


def partial_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that may still grow into a marker (a proper prefix of one)."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-k:]) for marker in markers):
            return k
    return 0


class JsonEnd:
    """Where a JSON object or array that text begins with closes, the text coming in pieces: its nesting is
    followed across them, strings and their escapes included (a bracket or a marker inside a string is text).
    `depth` starts it inside that many brackets (the rest of an object whose first members were read)."""

    def __init__(self, depth: int = 0) -> None:
        self._depth, self._in_string, self._escaped = depth, False, False

    def end(self, text: str) -> int | None:
        """The index after the closing bracket in this piece, or None if the value does not close in it."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class ToolParser:
    """Streaming parser base: subclasses implement `_step`, one transition of their state machine."""

    #: the markup strings the parser reads: where a model's tokenizer has them as special tokens, their text
    #: is kept in what the parser is fed (`skip_special_tokens` still drops the other special tokens)
    markup: tuple[str, ...] = ()

    def __init__(self, new_id: NewId = default_call_id) -> None:
        self._new_id = new_id
        self._buf = ""  # text received, not yet decided on
        self._calls: list[ToolCall] = []
        self._out: list[str] = []  # content decided during the current feed()/finish()
        self._deltas: list[ToolCallDelta] = []
        self._skip_ws = False  # whitespace right after a call is layout between calls, not content
        self._state = "content"  # where a parser with states is
        self._raw = ""  # markup consumed that may yet make no call (then content: `_reject`)

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        """An assistant turn's `text` and its `calls` ((name, arguments as a JSON value) each) as the model
        writes them in this parser's markup: what a chat template that does not render calls is given as
        that turn's text, and what this parser reads back as those calls."""
        raise NotImplementedError

    @classmethod
    def for_tools(cls, new_id: NewId, tools: Sequence[Any]) -> ToolParser:
        """A parser for a request with `tools` (a markup whose values are text reads their types from them)."""
        return cls(new_id)

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str] | None:
        """(trigger, begin, end) of a call to `name` in this markup, around its arguments object: the text
        that starts a call in free text, everything the call writes up to its arguments, and after them.
        What a grammar holds calls to under tool_choice "auto" with strict tools; None where this markup
        has no such fixed frame (the calls are then read as they come, not constrained)."""
        return None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Takes newly generated text; returns the content to show now and the tool-call deltas now."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: releases held text and settles a call left open."""
        return self._drain(final=True)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """Calls assembled so far (complete after `finish`)."""
        return list(self._calls)

    def _drain(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        while self._step(final):
            pass
        out, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return out, deltas

    def _step(self, final: bool) -> bool:
        """Consumes what it can of `_buf`; False when it must wait for more text (or, if `final`, is done)."""
        raise NotImplementedError

    def _emit(self, text: str) -> None:
        if self._skip_ws:
            text = text.lstrip()
            self._skip_ws = not text
        if text:
            self._out.append(text)

    def _scan_content(self, markers: Sequence[str], final: bool) -> str | None:
        """Emits content up to the first marker and consumes the marker, returning it; without one,
        emits all but a tail that may still become a marker (all of it if `final`) and returns None."""
        i, marker = find_first(self._buf, markers)
        cut = i if i >= 0 else len(self._buf) - (0 if final else partial_len(self._buf, markers))
        self._emit(self._buf[:cut])
        self._buf = self._buf[cut + len(marker):]
        return marker or None

    def _reject(self, n: int) -> None:
        """The pending markup (`_raw`, kept by parsers whose markup can still turn out to be no call) and
        `_buf[:n]` make no call: they are content, and the parser is back in its `content` state."""
        self._emit(self._raw + self._buf[:n])
        self._raw, self._buf, self._state = "", self._buf[n:], "content"

    def _add_calls(self, calls: list[tuple[str, str]], rest: str) -> None:
        """Calls read whole ((name, arguments) each), then `rest`, the text after them, as content."""
        for name, args in calls:
            self._open_call(name)
            self._add_args(args)
        self._emit(rest)

    def _open_call(self, name: str, call_id: str | None = None) -> None:
        """A call opens: its first delta, its id (`call_id`, or a new one) and name."""
        self._calls.append(ToolCall(call_id or self._new_id(name, len(self._calls)), name, ""))
        self._deltas.append(ToolCallDelta(len(self._calls) - 1, self._calls[-1].id, name))

    def _add_args(self, text: str) -> None:
        """Appends to the open call's arguments, merging with this feed's previous piece of them."""
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index].arguments += text
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(index, arguments=text))


# DeepSeek markers: `｜` is U+FF5C and `▁` U+2581, as in the tokenizer's added tokens.
_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALLS_END = "<｜tool▁calls▁end｜>"
_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_CALL_END = "<｜tool▁call▁end｜>"
_SEP = "<｜tool▁sep｜>"
_ENDS = (_CALL_END, _CALLS_END)
_FENCE = "```"
_FENCE_TAG = re.compile(r"[A-Za-z][\w+-]*")  # the fence's language tag: ```json


def _deepseek_args(raw: str, done: bool, ends: Sequence[str]) -> str:
    """The arguments in `raw`, the text from a call's name to its end marker (one of `ends`; or so far,
    unless `done`): without the ```json fence and the whitespace around it (the JSON may begin on the
    fence's line), `{}` for none. While not `done`, a tail that may still become the fence's tag, the
    closing fence or an end marker is left out, so what is sent stands."""
    text = raw.lstrip()
    if text.startswith(_FENCE):
        text = text[len(_FENCE):]
        tag = _FENCE_TAG.match(text)
        if tag is not None and tag.end() == len(text) and not done:  # the tag may go on
            return ""
        text = text[tag.end() if tag else 0:].lstrip()
    elif not done and _FENCE.startswith(text):
        return ""
    if not done:
        text = text[: len(text) - partial_len(text, ends)]
    text = text.rstrip()
    ticks = len(text) - len(text.rstrip("`"))
    if ticks >= 3 or not done:
        text = text[: len(text) - min(ticks, 3)]
    text = text.rstrip()
    return text if text or not done else "{}"  # OpenAI's arguments are always a JSON object's text


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3/R1/V2.5: `function<｜tool▁sep｜>NAME` then the arguments in a ```json fence.

    The machine reads any markup of this shape: a section's begin marker, calls each between a begin and an
    end marker whose header (up to a separator) names the function, arguments as written up to the call's
    end, then the section's end marker. Its subclasses change the markers (class attributes) and how a header
    is read (`_split_header`, `_call_name`)."""

    _calls_begin, _calls_end, _call_begin, _call_end, _sep = _CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP
    markup = (_CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP)

    def __init__(self, new_id: NewId = default_call_id) -> None:
        super().__init__(new_id)
        self._state = "content"  # content | section (between calls) | header | args

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        return text + cls._calls_begin + "".join(cls._call_begin + cls._written_head(name) + _json(args)
                                                 + cls._written_tail + cls._call_end for name, args in calls) \
            + cls._calls_end

    _written_tail = "\n```"  # (what `written` puts after a call's arguments)

    @staticmethod
    def _written_head(name: str) -> str:
        return f"function{_SEP}{name}\n```json\n"

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str] | None:
        return cls._call_begin, cls._call_begin + cls._written_head(name), cls._written_tail + cls._call_end

    def _split_header(self, head: str, closed: bool) -> tuple[str, int] | None:
        """(name, where the arguments start) in `head`, the text after `<｜tool▁call▁begin｜>` up to any
        end marker (`closed` if one was seen); None while the name may still be incomplete."""
        sep = head.find(self._sep)
        if sep < 0:
            return None
        start = sep + len(self._sep)
        stops = [i for i in (head.find("\n", start), head.find(_FENCE, start)) if i >= 0]
        if closed:
            stops.append(len(head))
        return (head[start:min(stops)].strip(), min(stops)) if stops else None

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            marker = self._scan_content((self._calls_begin, self._call_begin), final)
            if marker:
                self._raw = marker
                self._state = "section" if marker == self._calls_begin else "header"
            return marker is not None
        return {"section": self._section, "header": self._header, "args": self._args}[self._state](final)

    def _section(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        for marker in (self._call_begin, self._calls_end):
            if rest.startswith(marker):
                self._raw += self._buf[: len(self._buf) - len(rest) + len(marker)]
                self._buf = rest[len(marker):]
                self._state = "header" if marker == self._call_begin else "content"
                return True
        cut = self._call_begin.startswith(rest) or self._calls_end.startswith(rest)
        if not final and cut:
            return False
        if cut and rest and not self._raw:  # a marker cut off at the end, after the section's calls: dropped
            self._buf = ""
            return False
        self._reject(0)  # anything else ends the section
        return True

    @property
    def _ends(self) -> tuple[str, ...]:
        return self._call_end, self._calls_end

    def _call_name(self, header: str) -> tuple[str, str | None] | None:
        """(name, the call's id: None for a new one) of a call whose header (`_split_header`'s) is `header`;
        None where it names no function (the markup is then content)."""
        return (header, None) if header else None

    def _header(self, final: bool) -> bool:
        end = find_first(self._buf, self._ends)[0]
        head = self._buf if end < 0 else self._buf[:end]
        split = self._split_header(head, closed=end >= 0)
        if split is None and end < 0 and not final:
            return False
        named = None if split is None else self._call_name(split[0])
        if named is None:  # no name: content up to where every chunking agrees
            self._reject(len(head) if split is None else split[1])
            return True
        assert split is not None
        self._open_call(*named)
        self._raw, self._buf, self._state = "", self._buf[split[1]:], "args"
        return True

    def _args(self, final: bool) -> bool:
        end, marker = find_first(self._buf, self._ends)
        sent = len(self._calls[-1].arguments)
        if end < 0:  # at `final` too: a call cut short keeps the arguments sent so far
            self._add_args(_deepseek_args(self._buf, False, self._ends)[sent:])
            return False
        self._add_args(_deepseek_args(self._buf[:end], True, self._ends)[sent:])
        self._buf = self._buf[end + len(marker):]
        if marker == self._call_begin:  # (its end marker left out: the next call begins; `_ends` says where)
            self._raw, self._state = marker, "header"
            return True
        self._state = "section" if marker == self._call_end else "content"
        self._skip_ws = True
        return True



class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1: `NAME<｜tool▁sep｜>ARGS`, no type and no fence."""

    _written_tail = ""

    @classmethod
    def _written_head(cls, name: str) -> str:
        return f"{name}{cls._sep}"

    def _split_header(self, head: str, closed: bool) -> tuple[str, int] | None:
        sep = head.find(self._sep)
        return None if sep < 0 else (head[:sep].strip(), sep + len(self._sep))


_KIMI_PREFIX = "functions."


def kimi_call_id(name: str, index: int) -> str:
    """Kimi-K2's call id, as its templates write one: `functions.NAME:INDEX`."""
    return f"{_KIMI_PREFIX}{name}:{index}"


# Kimi-K2's markers (special tokens of its tokenizer)
KIMI_CALLS_BEGIN, _KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, _KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
_KIMI_ARGS = "<|tool_call_argument_begin|>"
_DIGITS = re.compile(r"[0-9]+")


class KimiK2ToolParser(DeepSeekV31ToolParser):
    """Kimi-K2 (Instruct and Thinking; DeepSeek-V3's architecture): DeepSeek-V3.1's machine with Moonshot's markers,
    each call's header its id, `functions.NAME:INDEX` (INDEX numbers the calls), then its JSON
    arguments as written:

        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
        ...<|tool_calls_section_end|>

    The name is what lies between `functions.` and the header's last `:`; the call opens when the header is
    whole (at `<|tool_call_argument_begin|>`). Ids: a header in the templates' form, `functions.NAME:DIGITS`, is
    the call's id, as vLLM returns it (the templates write their own ids for past calls, and Moonshot's first
    template renders a result as `## Return of {tool_call_id}`: the model gets back the id it wrote); a header
    without the prefix or without a `:DIGITS` index still names the call (`get_weather:0`, `functions.f`), and
    such a call, or one repeating an id an earlier call of the same output has (ids must be unique for a client
    to match results to calls), gets a new id (`new_id`: by default `kimi_call_id`, the id the template writes
    for it, `functions.NAME:I`, I its place among this output's calls; where that is taken too, `call_...`).
    A header whose name is empty or holds whitespace is no call: the markup is content, as written, as
    DeepSeek's are. A bare `<|tool_call_begin|>` (no section marker) opens a call too, as llama.cpp reads
    Kimi-K2's output. No strict-tool grammar (`call_tag`): a call's index is not fixed text."""

    _calls_begin, _calls_end, _call_begin, _call_end = KIMI_CALLS_BEGIN, _KIMI_CALLS_END, KIMI_CALL_BEGIN, _KIMI_CALL_END
    _sep = _KIMI_ARGS
    markup = (KIMI_CALLS_BEGIN, _KIMI_CALLS_END, KIMI_CALL_BEGIN, _KIMI_CALL_END, _KIMI_ARGS)

    def __init__(self, new_id: NewId = kimi_call_id) -> None:
        super().__init__(new_id)

    @property
    def _ends(self) -> tuple[str, ...]:
        # a call whose `<|tool_call_end|>` the model left out ends where the next one begins, as llama.cpp reads
        # Kimi's output (its end marker is optional there); its arguments never take in the next call's markup
        return self._call_end, self._calls_end, self._call_begin

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        # (the templates count calls across the conversation; this turn's alone here)
        return text + cls._calls_begin + "".join(
            f"{cls._call_begin}{kimi_call_id(name, i)}{cls._sep}{_json(args)}{cls._call_end}"
            for i, (name, args) in enumerate(calls)) + cls._calls_end

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str] | None:
        return None

    def _call_name(self, header: str) -> tuple[str, str | None] | None:
        prefixed = header.startswith(_KIMI_PREFIX)
        body = header[len(_KIMI_PREFIX):] if prefixed else header
        name, colon, index = body.rpartition(":")
        indexed = bool(colon) and _DIGITS.fullmatch(index) is not None
        name = name if indexed else body
        if not name or any(ch.isspace() for ch in name):
            return None
        taken = {c.id for c in self._calls}
        if prefixed and indexed and header not in taken:
            return name, header
        made = self._new_id(name, len(self._calls))
        return name, made if made not in taken else default_call_id()


_JSON_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _scan_object(text: str, pos: int) -> tuple[dict[str, tuple[Any, int, int]], int]:
    """Members of the JSON object at `text[pos:]` (after whitespace) as key -> (value, raw start, raw
    end), and where the object ends; ValueError if there is none. The raw spans let arguments be
    passed on exactly as written."""
    members: dict[str, tuple[Any, int, int]] = {}
    pos = _JSON_WS.match(text, pos).end()
    if not text.startswith("{", pos):
        raise ValueError("not a JSON object")
    pos = _JSON_WS.match(text, pos + 1).end()
    if text.startswith("}", pos):
        return members, pos + 1
    while True:
        if not text.startswith('"', pos):
            raise ValueError("expected a key")
        key, pos = scanstring(text, pos + 1)
        pos = _JSON_WS.match(text, pos).end()
        if not text.startswith(":", pos):
            raise ValueError("expected ':'")
        start = _JSON_WS.match(text, pos + 1).end()
        try:
            value, end = _DECODER.raw_decode(text, start)
        except RecursionError:  # the stdlib decoder recurses per nesting level
            raise ValueError("nested too deeply") from None
        members[key] = (value, start, end)
        pos = _JSON_WS.match(text, end).end()
        if text.startswith("}", pos):
            return members, pos + 1
        if not text.startswith(",", pos):
            raise ValueError("expected ',' or '}'")
        pos = _JSON_WS.match(text, pos + 1).end()


def _as_call(text: str, members: dict[str, tuple[Any, int, int]], need_args: bool) -> tuple[str, str] | None:
    """(name, raw arguments) of `{"name": ..., "arguments"|"parameters": ...}`, or None if not a call."""
    name = members.get("name", (None,))[0]
    args = members.get("arguments") or members.get("parameters")
    if not isinstance(name, str) or not name or (need_args and args is None):  # (OpenAI's names: 1 to 64 characters)
        return None
    if args and isinstance(args[0], str):  # the arguments written as a JSON string of an object: that object's
        try:                               # text (function.arguments is an object's JSON, not a string's)
            if isinstance(_DECODER.decode(args[0]), dict):
                return name, args[0].strip()
        except (ValueError, RecursionError):
            pass
    return name, text[args[1]:args[2]] if args else "{}"


HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string's extent (its escapes checked when read)


def _without_partial_close(body: str, close: str) -> str:
    """`body` less a start of `close` it ends with ("</", "</tool_call"): a cut inside the closing tag."""
    stripped = body.rstrip()
    n = partial_len(stripped, (close,))
    return stripped[:-n] if n else body


def _hermes_head(text: str) -> tuple[str, int] | bool:
    """A Hermes call object's head, `{"name": "NAME", "arguments": {` (or `"parameters"`), at the start of
    `text` (JSON whitespace anywhere between): (NAME, the index of the arguments' `{`); True while `text` may
    still grow into one; False if it cannot (another order of keys, arguments that are not an object: such
    a block is read whole once it closes)."""
    pos, name = 0, ""
    for step in ("{", '"name"', ":", None, ",", ('"arguments"', '"parameters"'), ":", "{"):
        pos = _JSON_WS.match(text, pos).end()
        if pos == len(text):
            return True
        if step is None:  # the name: a whole JSON string
            string = _STRING.match(text, pos)
            if string is None:
                return text[pos] == '"'  # (unterminated: may go on)
            try:
                name = json.loads(string.group())
            except ValueError:
                return False
            if not name:  # (no function has an empty name)
                return False
            pos = string.end()
            continue
        for literal in (step,) if isinstance(step, str) else step:
            if text.startswith(literal, pos):
                pos += len(literal)
                break
        else:
            rest = text[pos:]
            return any(literal.startswith(rest) for literal in ((step,) if isinstance(step, str) else step))
    return name, pos - 1


class _TagBlockParser(ToolParser):
    """Calls in `<tool_call>` ... `</tool_call>` blocks (Hermes' JSON, Qwen3-Coder's XML): content up to a block's
    tag, each state `S` of the machine a method `_S`, and the text a block holds after its calls (`tail`)."""

    _OPEN, _CLOSE = HERMES_OPEN, _HERMES_CLOSE
    markup = (_OPEN, _CLOSE)

    def _open_block(self) -> None:
        """A block's opening tag was read (consumed): the state that reads what it holds."""
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            if self._scan_content((self._OPEN,), final) is None:
                return False
            self._open_block()
            return True
        return getattr(self, "_" + self._state)(final)

    def _close(self, after: str) -> None:
        """The block is closed; `after`: the text past its `</tool_call>`."""
        self._buf, self._state, self._skip_ws = after, "content", True

    def _tail(self, final: bool) -> bool:
        """Text in a block after its calls: content, up to `</tool_call>` (consumed) or a new block's tag (its
        predecessor's close left out)."""
        if final and find_first(self._buf, (self._CLOSE, self._OPEN))[0] < 0:  # a cut inside the tag: markup
            self._buf = _without_partial_close(self._buf, self._CLOSE)
        marker = self._scan_content((self._CLOSE, self._OPEN), final)
        if marker is None:
            if final:
                self._state = "content"
            return False
        if marker == self._OPEN:
            self._open_block()
        else:
            self._close(self._buf)
        return True


class HermesToolParser(_TagBlockParser):
    """Hermes / Qwen2.5: `<tool_call>` then a `{"name", "arguments"}` object, then `</tool_call>`.

    Once the head `{"name": "NAME", "arguments": {` is whole, the call opens and its arguments stream as
    they are written, up to where their object closes, or where the block does (a call cut off keeps the
    arguments sent, as DeepSeek's and OpenAI's do). The first `</tool_call>` closes the block wherever it
    is, inside a string too, as vLLM reads blocks: a stray quote must not take the rest of the reply into a
    call. The rest of the object and the closing tag are markup: other members after the arguments are
    dropped; text after the object inside the block is content; a second object there is another call, and a
    `<tool_call>` there another block (its predecessor's close left out). A block whose head is otherwise
    (keys in another order, arguments written as a string) is held until `</tool_call>` and read whole: a
    call if it is one call object, else content as written."""

    _HEAD_MAX = 512  # characters a head may take (a name is at most 64): past them the block is read whole

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        blocks = [f"{cls._OPEN}\n{_json({'name': name, 'arguments': args})}\n{cls._CLOSE}" for name, args in calls]
        return "\n".join([text, *blocks] if text else blocks)

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str] | None:
        return cls._OPEN, f'{cls._OPEN}\n{{"name": {_json(name)}, "arguments": ', f"}}\n{cls._CLOSE}"

    def __init__(self, new_id: NewId = default_call_id) -> None:
        super().__init__(new_id)
        # content | head (an object's start in a block) | block (held whole) | args | rest (after the
        # arguments) | members (more members after them) | after (the object closed) | tail (text after the
        # object: content, up to </tool_call>)
        self._state = "content"
        self._nesting = JsonEnd()
        self._lead = ""  # the markup before a held block's body, shown with it if it makes no call

    def _open_block(self) -> None:
        self._state, self._lead = "head", self._OPEN

    def _head(self, final: bool) -> bool:
        close = self._buf.find(self._CLOSE)
        text = self._buf if close < 0 else self._buf[:close]
        head = _hermes_head(text[: self._HEAD_MAX])
        if head is True and len(text) > self._HEAD_MAX:
            head = False
        if head is True and close < 0 and not final:
            return False
        if not isinstance(head, tuple):
            self._state = "block"
            return True
        name, start = head
        self._open_call(name)
        self._buf, self._state, self._nesting = self._buf[start:], "args", JsonEnd()
        return True

    def _upto_close(self) -> tuple[str, int]:
        """The text before `</tool_call>` (and before a tail that may still become it), and where the tag is
        in `_buf` (-1: not there yet)."""
        close = self._buf.find(self._CLOSE)
        if close >= 0:
            return self._buf[:close], close
        return self._buf[: len(self._buf) - partial_len(self._buf, (self._CLOSE,))], -1

    def _args(self, final: bool) -> bool:
        text, close = self._upto_close()
        text = text.rstrip()  # trailing whitespace waits: the closing bracket or more text decides
        end = self._nesting.end(text)
        if end is not None:
            self._add_args(text[:end])
            self._buf, self._state = self._buf[end:], "rest"
            return True
        self._add_args(text)  # at the block's close or the end too: a call cut short keeps what was sent
        if close >= 0:
            self._close(self._buf[close + len(self._CLOSE):])
            return True
        self._buf = "" if final else self._buf[len(text):]
        return False

    def _rest(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self._CLOSE):  # the object's `}` left out: the block still closes the call
            self._close(rest[len(self._CLOSE):])
        elif rest.startswith("}"):
            self._buf, self._state = rest[1:], "after"
        elif rest.startswith(","):
            member = rest[1:].lstrip()
            if not member and not final:
                return False
            if member.startswith('"'):  # another member: markup of the call
                self._buf, self._state, self._nesting = rest[1:], "members", JsonEnd(depth=1)
            else:
                self._end_block(final)
        elif not final and self._CLOSE.startswith(rest):
            return False
        else:
            self._end_block(final)
        return True

    def _members(self, final: bool) -> bool:
        text, close = self._upto_close()
        end = self._nesting.end(text)
        if end is not None:
            self._buf, self._state = self._buf[end:], "after"
        elif close >= 0:
            self._close(self._buf[close + len(self._CLOSE):])
        else:  # (members cut off at the end are markup of the call: dropped)
            self._buf = "" if final else self._buf[len(text):]
            return False
        return True

    def _after(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self._CLOSE):
            self._close(rest[len(self._CLOSE):])
        elif rest.startswith("{"):  # another object in the block
            self._buf, self._state, self._lead = rest, "head", ""
        elif not final and self._CLOSE.startswith(rest):
            return False
        else:
            self._end_block(final)
        return True

    def _end_block(self, final: bool) -> None:
        """Text other than the closing tag after the call: content, up to the tag (consumed) if it comes."""
        if final:  # a cut inside the tag
            self._buf = _without_partial_close(self._buf, self._CLOSE)
        self._state, self._skip_ws = "tail", True

    def _block(self, final: bool) -> bool:
        end = self._buf.find(self._CLOSE)
        if end < 0:
            if final:  # cut off before the block closed: a whole call object is still a call (vLLM's
                # `<tool_call>(.*)`: a stop string or max_tokens took only the close, or part of it), else the
                # text as written
                body, self._buf, self._state = self._buf, "", "content"
                if not self._call(_without_partial_close(body, self._CLOSE)):
                    self._emit(self._lead + body)
            return False
        body, self._buf, self._state = self._buf[:end], self._buf[end + len(self._CLOSE):], "content"
        if not self._call(body):  # as written: the tags with a block's body, not a later object's close
            self._emit(self._lead + body + (self._CLOSE if self._lead else ""))
        return True

    def _call(self, body: str) -> bool:
        """Sends `body` as a call if it is one call object (whitespace around it); False if not."""
        call = None
        try:
            members, stop = _scan_object(body, 0)
            if _JSON_WS.match(body, stop).end() == len(body):
                call = _as_call(body, members, need_args=False)
        except ValueError:
            pass
        if call is None:
            return False
        self._open_call(call[0])
        self._add_args(call[1])
        self._skip_ws = True
        return True


_PYTHON_TAG = "<|python_tag|>"


def _llama_calls(text: str) -> tuple[list[tuple[str, str]], str] | None:
    """(the calls `text` begins with, the text after them) for `{...}; {...}` or a JSON array of call
    objects, or None if it begins with no call. As vLLM and SGLang read Llama's output, text after the
    calls does not undo them: it is content."""
    if text.startswith("["):
        return _llama_array(text)
    calls, pos = [], 0
    while True:
        try:
            members, end = _scan_object(text, pos)
        except ValueError:
            break
        call = _as_call(text, members, need_args=True)
        if call is None:
            break
        calls.append(call)
        pos = _JSON_WS.match(text, end).end()
        if not text.startswith(";", pos):
            break
        pos += 1
        after = _JSON_WS.match(text, pos).end()
        if not text.startswith("{", after):
            break
        pos = after
    return (calls, text[pos:].strip()) if calls else None


def _llama_array(text: str) -> tuple[list[tuple[str, str]], str] | None:
    """`[{call}, {call}]` and the text after it; None unless every item is a call."""
    calls, pos = [], _JSON_WS.match(text, 1).end()
    try:
        while True:
            members, end = _scan_object(text, pos)
            call = _as_call(text, members, need_args=True)
            if call is None:
                return None
            calls.append(call)
            pos = _JSON_WS.match(text, end).end()
            if text.startswith("]", pos):
                return calls, text[pos + 1:].strip()
            if not text.startswith(",", pos):
                return None
            pos = _JSON_WS.match(text, pos + 1).end()
    except ValueError:
        return None


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: output that starts with `{` or `[` (after `<|python_tag|>`, which may
    also follow some text) is held to the end and read as calls, then content (`_llama_calls`); other
    output is content, streamed as it comes."""

    markup = (_PYTHON_TAG,)

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        objects = "; ".join(_json({"name": name, "parameters": args}) for name, args in calls)
        return f"{text}{_PYTHON_TAG}{objects}" if text else objects  # (after text, the tag says calls follow)

    def __init__(self, new_id: NewId = default_call_id) -> None:
        super().__init__(new_id)
        self._mode = ""  # "" undecided | content | json

    def _step(self, final: bool) -> bool:
        if self._mode == "content":  # streamed up to a <|python_tag|> (then decided anew) or a tail that may begin one
            i = self._buf.find(_PYTHON_TAG)
            cut = i if i >= 0 else len(self._buf) - (0 if final else partial_len(self._buf, (_PYTHON_TAG,)))
            self._emit(self._buf[:cut])
            self._buf = self._buf[cut:]
            if i < 0:
                return False
            self._mode = ""
            return True
        head = self._buf.lstrip()
        tagged = head.startswith(_PYTHON_TAG)
        if tagged:
            head = head[len(_PYTHON_TAG):].lstrip()
        elif not final and _PYTHON_TAG.startswith(head):
            return False
        if not self._mode:
            if not head and not final:
                return False
            if head.startswith(("{", "[")):
                self._mode = "json"
            else:  # content; a tag before it is content too (searched for again only after it)
                at = self._buf.find(_PYTHON_TAG) + len(_PYTHON_TAG) if tagged else 0
                self._emit(self._buf[:at])
                self._buf, self._mode = self._buf[at:], "content"
            return True
        if not final:
            return False
        read = _llama_calls(head)
        if read is None:
            self._emit(self._buf)
        else:
            self._add_calls(*read)
        self._buf, self._mode = "", "content"
        return False


_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_CALL_ID = "[CALL_ID]"
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id(name: str = "", index: int = 0) -> str:
    """Mistral's call id: 9 letters and digits, which its chat templates check when the call comes back
    (v0.3's refuses any other: "Tool call IDs should be alphanumeric strings with length 9!")."""
    return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))


# a v11 call's head after `[TOOL_CALLS]`: the function's name (OpenAI's characters, dots too), an id the server
# replaces, then `[ARGS]`; and what text may still grow into one
_MISTRAL_HEAD = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]")
_MISTRAL_HEAD_SO_FAR = re.compile(r"\s*[A-Za-z0-9_.-]{0,64}(?:\[CALL_ID\][A-Za-z0-9]{0,64})?")


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then, from v0.3's tokenizer, a JSON array of {"name", "arguments"} objects
    (held to the end, as Llama's JSON: `_llama_array`), or, from tokenizer v11 (Mistral Small 3, Ministral,
    Devstral), `NAME[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (a `[CALL_ID]ID` before `[ARGS]`
    is dropped: ids are this server's). Those arguments stream as they are written, up to where their object
    closes; text after it is content. A marker followed by anything else (prose that names it) is content."""

    markup = (_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID)

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        return text + _MISTRAL_CALLS + _json([{"name": name, "arguments": args} for name, args in calls])

    def __init__(self, new_id: NewId = mistral_call_id) -> None:
        super().__init__(new_id)
        self._state = "content"  # content | decide (after the marker) | array | header | args_start | args
        self._name = ""  # the function a v11 head named, opened when its arguments begin
        self._nesting = JsonEnd()

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            if self._scan_content((_MISTRAL_CALLS,), final) is None:
                return False
            self._state, self._raw = "decide", _MISTRAL_CALLS
            return True
        if self._state == "decide":  # an array (v0.3) or a name (v11)
            head = self._buf.lstrip()
            if not head and not final:
                return False
            self._state = "array" if head.startswith("[") else "header"
            return True
        return {"array": self._array, "header": self._header, "args_start": self._args_start,
                "args": self._args}[self._state](final)

    def _array(self, final: bool) -> bool:
        if not final:
            return False
        read = _llama_array(self._buf.strip())
        if read is None:
            self._reject(len(self._buf))
            return False
        self._add_calls(*read)
        self._buf, self._state = "", "content"
        return False

    def _header(self, final: bool) -> bool:
        head = _MISTRAL_HEAD.match(self._buf)
        if head is not None:
            self._raw += self._buf[: head.end()]
            self._name, self._buf, self._state = head.group(1), self._buf[head.end():], "args_start"
            return True
        so_far = _MISTRAL_HEAD_SO_FAR.match(self._buf).end()
        rest = self._buf[so_far:]
        if not final and (not rest or any(tag.startswith(rest) for tag in (_MISTRAL_ARGS, _MISTRAL_CALL_ID))):
            return False  # may still become a call's head
        self._reject(0)
        return True

    def _args_start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if not body and not final:
            return False
        if body and not body.startswith("{"):
            self._reject(0)
            return True
        self._open_call(self._name)
        self._raw, self._nesting = "", JsonEnd()
        if not body:  # `[ARGS]` and the end: a call without arguments
            self._add_args("{}")
            self._buf, self._state = "", "content"
            return False
        self._buf, self._state = body, "args"
        return True

    def _args(self, final: bool) -> bool:
        end = self._nesting.end(self._buf)
        if end is None:  # at `final` too: a call cut short keeps the arguments sent so far
            self._add_args(self._buf)
            self._buf = ""
            return False
        self._add_args(self._buf[:end])
        self._buf, self._state, self._skip_ws = self._buf[end:], "content", True
        return True



_FN_OPEN, _FN_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_TYPES = ("num", "float", "double")
_TEXT_TYPES = ("string", "str", "text", "varchar", "char")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def whole_json(text: str) -> bool:
    """Whether `text` is one whole JSON value as RFC 8259 writes them: NaN, Infinity and a number past a
    double's range (which JavaScript's JSON.parse refuses, or reads as no number) are not; a lone surrogate's
    escape is (the grammar allows every \\uXXXX, and JSON.parse reads it)."""
    return _strict_json(text)[0]


def _strict_json(text: str) -> tuple[bool, Any]:
    """(True, the value) where `text` is one whole JSON value (`whole_json`), else (False, None): read once."""
    try:
        return True, json.loads(text, parse_constant=_not_json, parse_float=_finite, parse_int=_finite_int)
    except (ValueError, RecursionError):
        return False, None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite_int(text: str) -> int:
    if len(text.lstrip("-")) > 308 and not math.isfinite(float(text)):  # (JSON.parse reads it as Infinity)
        raise ValueError(f"{text[:20]}... is past a double's range")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is past a double's range")
    return value


def _param_types(schema: Any) -> set[str]:
    """The types a parameter schema allows, lowercased: its `type` (one or a list), its `anyOf` / `oneOf`
    alternatives' types, or "string" for an `enum` of strings alone; empty where it names none."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    types = {k.strip().lower() for k in kinds if isinstance(k, str)}
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        if isinstance(alternatives, list):
            types |= {t for a in alternatives for t in _param_types(a)}
    enum = schema.get("enum")
    if not types and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        types.add("string")
    return types


def _as_kind(text: str, kind: str) -> tuple[bool, Any]:
    """(True, the value) where `text` reads as a value of schema type `kind`, else (False, None)."""
    stripped = text.strip()
    if kind.startswith(_INT_TYPES):
        return (True, int(stripped)) if _INTEGER.fullmatch(stripped) and len(stripped) <= 300 else (False, None)
    if kind.startswith(_NUMBER_TYPES):
        if not _DECIMAL.fullmatch(stripped) or len(stripped) > 300:
            return False, None
        value = float(stripped)
        if not math.isfinite(value):
            return False, None
        return (True, int(value) if value.is_integer() and abs(value) < 2**53 else value)
    if kind in ("boolean", "bool", "binary"):
        flag = {"true": True, "false": False}.get(stripped.lower())
        return (flag is not None, flag)
    if kind == "null":
        return (stripped.lower() == "null", None)
    if kind.startswith(_TEXT_TYPES) or kind == "enum":
        return True, text
    ok, value = _strict_json(stripped)  # object, array, or a type this reading does not know: JSON
    if ok:
        return True, value
    if (kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))) and len(stripped) <= 100_000:
        value = ast.literal_eval(stripped)  # (a model may write True, None or single quotes; bounded work)
        # (a literal may hold what JSON cannot: bytes, complex numbers, inf)
        return isinstance(value, (dict, list)) and whole_json(_json(value)), value
    return False, None


def _typed_param(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's types ask for, as vLLM's qwen3_coder parser reads it: null
    is None; a string type keeps the text; an integer, number or boolean type parses it (an integral number an
    int); an object or array type reads it as JSON or as a Python literal (a model may write True or single
    quotes); a schema of several types (a list, `anyOf`, `oneOf`) takes the first its text reads as, strings
    last. A text that reads as none of its types stays the text, and so does every value that would not be
    whole JSON (NaN, Infinity, a number past a double's range). A parameter the tool does not declare, or
    declares with no type, is JSON where it parses as a non-string JSON value, else the text."""
    if text.strip().lower() == "null":
        return None
    types = _param_types(schema)
    if not types:
        ok, value = _strict_json(text.strip())
        return value if ok and not isinstance(value, str) else text
    texts = [k for k in types if k.startswith(_TEXT_TYPES) or k == "enum"]
    for kind in sorted(types - {"null", *texts}) + texts:
        try:
            ok, value = _as_kind(text, kind)
        except (ValueError, TypeError, SyntaxError, OverflowError, MemoryError, RecursionError):
            continue
        if ok:
            return value
    return text


def _written_value(value: Any) -> str:
    """A parameter's value as the XML-like templates write it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else _json(value)


def _properties(parameters: Any) -> dict[str, Any]:
    """A function's parameter schemas by name (its `properties`), or none."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    return props if isinstance(props, dict) else {}


class QwenXmlToolParser(_TagBlockParser):
    """Qwen3-Coder, Qwen3.5 and Nemotron 3: `<tool_call>` blocks of XML-like calls, each parameter's value as
    text between its tags, typed by the tool's schema (`_typed_param`):

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    A call opens once `<function=NAME>` is whole; its arguments object streams a member at a time, each once its
    parameter closes (its type is known only then), and closes at `</function>` (or `</tool_call>`). A value is
    the text up to `</parameter>`, or to the next `<parameter=`, `</function>` or `</tool_call>` where the model
    left the close out (so a value cannot hold those tags), less one newline at each end. A parameter given twice
    keeps its first value; text inside a function outside its parameters, and a parameter with no name, are
    skipped. Several functions in one block are several calls; text in a block after a call is content. A block
    that does not begin with a function is content as written, and so is a call cut off before its name was
    whole; a call cut off after it (max_tokens, a stop string) keeps the members it wrote, the one being written
    too, and its object is left open, as other parsers leave a cut call's arguments: the reply is not reported
    as having made its calls (`finish_reason` stays "length" or "stop"). A tag cut off after a call is dropped.

    Qwen3-Coder sometimes leaves `<tool_call>` out: a whole `<function=NAME>` of a tool the request gives, outside
    a block, opens a call too (as llama.cpp reads it), which its `</function>` ends; the same of any other name is
    content, as prose about XML would be."""

    _NAME_MAX = 256  # characters a function or parameter name may take: past them the markup is no call
    _BARE_CALLS = True  # a known tool's `<function=NAME>` opens a call without `<tool_call>` (not GLM's markup)

    # the tags that end the text between parameters (the first opens one), and a value's (the first closes it)
    _PARAM_TAGS: tuple[str, ...] = (_PARAM_OPEN, _FN_CLOSE, _HERMES_CLOSE)
    _VALUE_ENDS: tuple[str, ...] = (_PARAM_CLOSE, _PARAM_OPEN, _FN_CLOSE, _HERMES_CLOSE)

    @classmethod
    def written(cls, text: str, calls: list[tuple[str, Any]]) -> str:
        blocks = [cls._written_call(name, args if isinstance(args, dict) else {}) for name, args in calls]
        return "\n".join([text, *blocks] if text else blocks)

    @classmethod
    def _written_call(cls, name: str, args: dict[str, Any]) -> str:
        """One call's block as the template writes it."""
        params = "".join(f"{_PARAM_OPEN}{k}>\n{_written_value(v)}\n{_PARAM_CLOSE}\n" for k, v in args.items())
        return f"{cls._OPEN}\n{_FN_OPEN}{name}>\n{params}{_FN_CLOSE}\n{cls._CLOSE}"

    @classmethod
    def for_tools(cls, new_id: NewId, tools: Sequence[Any]) -> ToolParser:
        return cls(new_id, {t.function.name: _properties(t.function.parameters) for t in tools})

    def __init__(self, new_id: NewId = default_call_id,
                 params: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(new_id)
        # content | block (in a block, before a function) | name | params (between parameters) | key | value |
        # after (a function closed) | tail (text in the block after a call: content, up to </tool_call>)
        self._state = "content"
        self._tool_params = params or {}  # function name -> its parameters' schemas
        # the openers of calls written without `<tool_call>`: the request's tools' whole `<function=NAME>`
        self._bare_openers = tuple(f"{_FN_OPEN}{n}>" for n in self._tool_params) if self._BARE_CALLS else ()
        self._bare = False  # the open call was opened by one of them (its `</function>` ends it)
        self._schemas: dict[str, Any] = {}  # the open call's
        self._written: set[str] = set()  # the open call's parameters written into its arguments
        self._param = ""  # the parameter whose value is being read

    def _open_block(self) -> None:
        self._state, self._raw = "block", self._OPEN

    def _step(self, final: bool) -> bool:
        if self._state != "content" or not self._bare_openers:
            return super()._step(final)
        marker = self._scan_content((self._OPEN, *self._bare_openers), final)
        if marker is None:
            return False
        if marker == self._OPEN:
            self._open_block()
        else:
            self._begin_call(marker[len(_FN_OPEN):-1])
            self._bare = True
        return True

    def _close(self, after: str) -> None:
        super()._close(after)
        self._bare = False

    def _markup(self, markers: Sequence[str]) -> str | None:
        """The marker `_buf` begins with after whitespace (consumed, whitespace and all, into `_raw`); "" where
        it may still begin one (only whitespace, or a marker's start: more text decides, or at the end a tag
        cut off); None where it begins none."""
        rest = self._buf.lstrip()
        for marker in markers:
            if rest.startswith(marker):
                self._raw += self._buf[: len(self._buf) - len(rest) + len(marker)]
                self._buf = rest[len(marker):]
                return marker
        return "" if not rest or any(m.startswith(rest) for m in markers) else None

    def _block(self, final: bool) -> bool:
        marker = self._markup((_FN_OPEN, self._CLOSE))
        if marker == "" and not final:
            return False
        if marker == _FN_OPEN:
            self._state = "name"
        else:  # an empty block, one that is no call, or cut off before its function: content as written
            self._reject(len(self._buf) if final else 0)
        return True

    def _tag_name(self, final: bool) -> str | None:
        """The name up to `>` (consumed); "" while it may still come; None where no valid name can."""
        end = self._buf.find(">")
        text = self._buf if end < 0 else self._buf[:end]
        if "\n" in text or "<" in text or len(text) > self._NAME_MAX or end >= 0 and not text.strip():
            return None
        if end < 0:
            return None if final else ""
        self._buf = self._buf[end + 1:]
        return text.strip()

    def _name(self, final: bool) -> bool:
        name = self._tag_name(final)
        if name == "":
            return False
        if name is None:  # no call: the markup is content, as written
            self._reject(len(self._buf) if final else 0)
            return True
        self._begin_call(name)
        return True

    def _begin_call(self, name: str) -> None:
        """A call's name is whole: the call opens, its parameters read by its tool's schemas."""
        self._open_call(name)
        self._raw, self._schemas, self._written, self._state = "", self._tool_params.get(name, {}), set(), "params"

    def _close_args(self) -> None:
        self._add_args("}" if self._written else "{}")

    def _params(self, final: bool) -> bool:
        tags = self._PARAM_TAGS
        marker = self._markup(tags)
        self._raw = ""
        if marker == "":  # (at the end: cut off, its object left open)
            return False
        if marker is None:  # text outside the parameters: skipped up to the next tag (or a tail that may begin one)
            i, _ = find_first(self._buf, tags)
            self._buf = self._buf[i:] if i >= 0 else self._buf[len(self._buf) - partial_len(self._buf, tags):]
            return i >= 0
        if marker == tags[0]:
            self._state = "key"
            return True
        self._close_args()
        if marker == _FN_CLOSE and not self._bare:
            self._state = "after"
        else:  # (the function's close left out, or a call without `<tool_call>` ended)
            self._close(self._buf)
        return True

    def _key(self, final: bool) -> bool:
        key = self._tag_name(final)
        if key == "":
            return False
        if key is None:  # no name: the parameter is skipped (cut off at the end: so is the rest)
            self._buf = "" if final else self._buf
            self._state = "params"
            return not final
        self._param, self._state = key, "value"
        return True

    @staticmethod
    def _value_text(text: str) -> str:
        """A value as written between its tags, less the layout the template puts around it."""
        text = text[1:] if text.startswith("\n") else text
        return text[:-1] if text.endswith("\n") else text

    def _value(self, final: bool) -> bool:
        ends = self._VALUE_ENDS
        i, marker = find_first(self._buf, ends)
        if i < 0 and not final:
            return False
        text = self._buf[:i] if i >= 0 else self._buf[: len(self._buf) - partial_len(self._buf, ends)]
        self._buf = "" if i < 0 else self._buf[i + (len(marker) if marker == ends[0] else 0):]
        text = self._value_text(text)
        if self._param not in self._written:
            value = _typed_param(text, self._schemas.get(self._param))
            self._add_args(("{" if not self._written else ", ") + f"{_json(self._param)}: {_json(value)}")
            self._written.add(self._param)
        self._state = "params"
        return i >= 0  # (cut off in the value: the call keeps it, its object left open)

    def _after(self, final: bool) -> bool:
        marker = self._markup((self._CLOSE, _FN_OPEN))
        if marker != _FN_OPEN:
            self._raw = ""
        if marker == "":  # (at the end: a tag cut off after the call, dropped)
            return False
        if marker == _FN_OPEN:  # another call in the same block
            self._state = "name"
        elif marker == self._CLOSE:
            self._close(self._buf)
        else:
            self._state, self._skip_ws = "tail", True
        return True


_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"


class GlmToolParser(QwenXmlToolParser):
    """GLM-4.5, GLM-4.6 and GLM-4.7 (GLM-4.7-Flash too): a `<tool_call>` block per call, the function's name, then
    each argument as a key and a value between tags, the value's text typed by the tool's schema as Qwen3-Coder's
    are (`_typed_param`):

        <tool_call>NAME
        <arg_key>KEY</arg_key>
        <arg_value>VALUE</arg_value>
        </tool_call>

    GLM-4.7's templates write the same with no newlines (`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>...`),
    and a call without arguments is `<tool_call>NAME</tool_call>`. The templates write a string value as it is
    and any other as JSON, with nothing around it: a value is the text between its tags, exactly. The name ends
    at a newline, `<arg_key>` or `</tool_call>` (whitespace before it is layout); the call opens then, and its
    arguments object streams a member at a time, each once its value closes, as Qwen3-Coder's do, and closes at
    `</tool_call>`. A value ends at its `</arg_value>` (so it may hold `<arg_key>`, as vLLM reads it), or at
    `</tool_call>` where the model left its close out; a key with
    no `<arg_value>` after it, text between the pairs, and an empty key are skipped; a key given twice keeps
    its first value. A block whose name is empty, holds whitespace or a tag other than those, or was cut off
    before it was whole, is content as written; so is text around the blocks. A call cut off after its name
    keeps the members it wrote, the one being written too, and its object is left open (Qwen3-Coder's)."""

    markup = (HERMES_OPEN, _HERMES_CLOSE, _ARG_KEY, _ARG_KEY_END, _ARG_VALUE, _ARG_VALUE_END)
    _BARE_CALLS = False
    _PARAM_TAGS = (_ARG_KEY, _HERMES_CLOSE)
    _VALUE_ENDS = (_ARG_VALUE_END, _HERMES_CLOSE)  # (a value may hold `<arg_key>`: code about GLM's markup)
    _NAME_TAGS = (_ARG_KEY, _HERMES_CLOSE)  # the tags that may end a name

    @classmethod
    def _written_call(cls, name: str, args: dict[str, Any]) -> str:
        pairs = "".join(f"{_ARG_KEY}{k}{_ARG_KEY_END}\n{_ARG_VALUE}{_written_value(v)}{_ARG_VALUE_END}\n"
                        for k, v in args.items())
        return f"{cls._OPEN}{name}\n{pairs}{cls._CLOSE}"

    def _open_block(self) -> None:
        self._state, self._raw = "name", self._OPEN

    @staticmethod
    def _value_text(text: str) -> str:
        return text

    def _name(self, final: bool) -> bool:
        body = self._buf.lstrip()
        end = min((i for i in (body.find("\n"), body.find("<")) if i >= 0), default=-1)
        name = (body if end < 0 else body[:end]).rstrip()
        rest = "" if end < 0 else body[end:]
        whole = end >= 0 and (rest[0] == "\n" or rest.startswith(self._NAME_TAGS))
        if not whole and not final and len(name) <= self._NAME_MAX and len(name.split()) <= 1 \
                and (end < 0 or any(tag.startswith(rest) for tag in self._NAME_TAGS)):
            return False  # the name, or the tag after it, may go on
        if not whole or not name or len(name) > self._NAME_MAX or len(name.split()) > 1:
            self._reject(len(self._buf) if final else 0)  # no call: the markup is content, as written
            return True
        self._buf = rest
        self._begin_call(name)
        return True

    def _key(self, final: bool) -> bool:
        end = self._buf.find(_ARG_KEY_END)
        text = self._buf[:end] if end >= 0 else self._buf[: len(self._buf) - partial_len(self._buf, (_ARG_KEY_END,))]
        if end < 0 and not final and "<" not in text and len(text) <= self._NAME_MAX:
            return False
        if end < 0 or "<" in text or not text.strip() or len(text) > self._NAME_MAX:
            # no key: the pair is skipped (cut off at the end: so is the rest)
            self._buf, self._state = "" if final else self._buf, "params"
            return not final
        self._param, self._buf, self._state = text.strip(), self._buf[end + len(_ARG_KEY_END):], "value_open"
        return True

    def _value_open(self, final: bool) -> bool:
        marker = self._markup((_ARG_VALUE,))
        self._raw = ""
        if marker == "":  # (at the end: cut off, its object left open)
            return False
        self._state = "value" if marker else "params"  # (a key without a value: skipped)
        return True


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek_v25": DeepSeekV3ToolParser,  # V2.5's template writes the same markup as V3's
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": QwenXmlToolParser,  # also Qwen3.5's and Nemotron 3's markup
    "glm45": GlmToolParser,  # GLM-4.5 and 4.6
    "glm47": GlmToolParser,  # GLM-4.7 (vLLM's name for its reading of the same markup without newlines)
    "kimi_k2": KimiK2ToolParser,  # Kimi-K2 Instruct and Thinking
}


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser for the tool-call markup a chat template teaches, or None if none is recognised."""
    if not chat_template:
        return None
    if KIMI_CALLS_BEGIN in chat_template:
        return "kimi_k2"
    if _CALLS_BEGIN in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if "<tool_call>" in chat_template:
        # Hermes (Qwen2.5, Qwen3) writes {"name", "arguments"} JSON between the tags; Qwen3-Coder, Qwen3.5 and
        # Nemotron 3 write <function=NAME> with <parameter=KEY> values; GLM-4.5 to 4.7 the name, then <arg_key>
        # and <arg_value> pairs
        if _FN_OPEN in chat_template and _PARAM_OPEN in chat_template:
            return "qwen3_coder"
        if _ARG_KEY in chat_template and _ARG_VALUE in chat_template:
            return "glm45"
        xml_args = _ARG_KEY in chat_template or _FN_OPEN in chat_template
        return "hermes" if '"arguments' in chat_template and not xml_args else None
    if _PYTHON_TAG in chat_template or ('"parameters"' in chat_template and "<|start_header_id|>" in chat_template):
        return "llama3_json"
    if _MISTRAL_CALLS in chat_template:
        return "mistral"
    return None


def call_id_maker(chat_template: str | None, earlier_calls: int = 0) -> NewId:
    """How call ids are made for a model: Mistral's 9 characters where its template writes `[TOOL_CALLS]`
    (it checks them when the calls come back), Kimi-K2's `functions.NAME:INDEX` where its template writes
    Kimi's calls (the form the model writes and reads back, forced calls' too, as vLLM makes them: INDEX counts
    the conversation's calls, `earlier_calls` of them in its history), else OpenAI's `call_...`."""
    if chat_template and _MISTRAL_CALLS in chat_template:
        return mistral_call_id
    if chat_template and KIMI_CALLS_BEGIN in chat_template:
        return lambda name, index: kimi_call_id(name, earlier_calls + index)
    return default_call_id


def parse_tool_calls(parser: str, text: str, new_id: NewId = default_call_id,
                     tools: Sequence[Any] = ()) -> tuple[str, list[ToolCall]]:
    """Non-streamed: the content and calls in a whole output, by the streaming parser fed it at once."""
    p = TOOL_PARSERS[parser].for_tools(new_id, tools)
    content, _ = p.feed(text)
    rest, _ = p.finish()
    return content + rest, p.tool_calls
