"""Reasoning parsers: a completion's chain of thought (between `<think>` and `</think>`) apart from its
answer, as DeepSeek's API, vLLM and SGLang return them (`reasoning_content` beside `content`).

One parser per choice, fed the text as it is generated, in pieces of any size: a tag split across
pieces is held back until it is whole (or the text ends), so a stream and a whole response split the
same text the same way. Kinds:
- `deepseek_r1`: DeepSeek-R1 and its distills. Their chat template opens `<think>` in the prompt, so
  the output starts inside the reasoning (an output that still begins with `<think>`, from an older
  template, has it removed). Everything up to `</think>` is reasoning; output that never closes the
  block is all reasoning (the model was cut off while thinking).
- `qwen3`: Qwen3 in thinking mode writes `<think>` itself: reasoning only when the output begins with
  it (after whitespace); otherwise, and with thinking switched off, all of it is the answer. An
  unclosed block is reasoning, up to a `<tool_call>`: Qwen3 models open a call without closing the
  block, and the call is the answer's (SGLang reads it so; read as reasoning, the call was lost).
- `kimi_k2` (vLLM's name): Kimi-K2-Thinking. R1's reading (the output starts inside the reasoning, a
  `<think>` the model writes itself is removed), except that a tool call opened inside the block ends it
  (`<|tool_calls_section_begin|>`, or `<|tool_call_begin|>` without it: Kimi calls tools at the end of its
  reasoning without closing it, as vLLM's and llama.cpp's readings of it say); the call is the answer's.
- `none`: everything is the answer.
Whatever the kind, a rendered prompt that itself ends with `<think>` or `</think>` (DeepSeek-V3.1's
template writes one or the other as its `thinking` variable says) decides where the output starts
(`ReasoningParser.after_prompt`); an output that opens the block again after a prompt that opened it has
that tag removed, as vLLM does. `ChoiceReasoning` pairs a choice's parser with its reasoning-token count.
The answer's leading whitespace right after `</think>` is layout, not content, and is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.tool_parsers import HERMES_OPEN, KIMI_CALL_BEGIN, KIMI_CALLS_BEGIN, find_first, partial_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# vLLM's names of the same readings, accepted so that its command lines serve as they are (GLM-4.5 to 4.7 open the
# block themselves, or their prompt does: Qwen3's reading, which looks at the prompt)
REASONING_ALIASES = {"glm45": "qwen3"}
REASONING_PARSERS = ("auto", "deepseek_r1", "qwen3", "kimi_k2", "none", *REASONING_ALIASES)
# per kind, the markup that opens a tool call and so ends an unclosed block (its first: the one counted by id)
CALL_OPENERS = {"qwen3": (HERMES_OPEN,), "kimi_k2": (KIMI_CALLS_BEGIN, KIMI_CALL_BEGIN)}


@dataclass
class Split:
    """Text decided by one `feed` or `finish`: reasoning and answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one choice's text into reasoning and answer, incrementally (see the module docstring)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("deepseek_r1", "qwen3", "kimi_k2"):
            raise ValueError(f"unknown reasoning parser {kind!r}")
        self.kind = kind
        # "start": before the first non-space text (deciding whether a <think> opens); "think": inside
        # the reasoning; "answer": after it (or without one)
        self.state = "start"
        self._opened = kind != "qwen3"  # "start" leads into the reasoning (the prompt opened the block)
        self._buf = ""
        self._strip = False  # drop the answer's leading whitespace (right after </think>)
        self.reasoning_text = ""  # all reasoning so far (for token accounting)
        self.opened_by_output = False  # the output's own <think> (after any whitespace) opened the block
        # what ends the block: for qwen3 and kimi_k2 also a tool call opened inside it (`ended_by_call`)
        self._ends = (THINK_CLOSE, *CALL_OPENERS.get(kind, ()))
        self.ended_by_call = False

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning (the block is open, or R1's implicit one)."""
        return self.state == "think" or (self.state == "start" and self._opened)

    def after_prompt(self, prompt: str, continued: str | None = None) -> None:
        """Start where the prompt leaves the model. A prompt that ends by opening a block (R1's generation
        prompt, DeepSeek-V3.1's in thinking mode) starts inside the reasoning, one that ends by closing one
        (V3.1's default, Qwen3's with thinking off) in the answer; otherwise the kind decides. A continued
        final message (`continued`, its text, which the prompt ends with) starts where its own last tag
        leaves it, else where the tag right before it does, else in the answer: a continued message is
        not the generation prompt that opens R1's block."""
        if continued is None:
            tail = prompt.rstrip()
            if tail.endswith(THINK_OPEN):  # inside; an output that opens the block again has that tag removed
                self._opened = True
            elif tail.endswith(THINK_CLOSE):
                self.state, self._strip = "answer", True
            return
        opened, closed = continued.rfind(THINK_OPEN), continued.rfind(THINK_CLOSE)
        if opened < 0 and closed < 0:
            core = continued.strip()
            at = prompt.rfind(core) if core else -1
            self.state = "think" if at >= 0 and prompt[:at].rstrip().endswith(THINK_OPEN) else "answer"
            return
        self.state = "think" if opened > closed else "answer"
        self._strip = self.state == "answer" and not continued[closed + len(THINK_CLOSE):].strip()

    def feed(self, text: str) -> Split:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Split:
        return self._drain(final=True)

    def _drain(self, final: bool) -> Split:
        out = Split()
        while True:
            if self.state == "start":
                head = self._buf.lstrip()
                if not head and not final:
                    return out  # only whitespace yet: the block may still open
                if THINK_OPEN.startswith(head) and head != THINK_OPEN and not final:
                    return out  # "<thi": wait
                if head.startswith(THINK_OPEN):
                    self._buf = head[len(THINK_OPEN):]
                    self.state, self.opened_by_output = "think", True
                elif self._opened:
                    self.state = "think"
                else:
                    self.state = "answer"
                continue
            if self.state == "think":
                i, marker = find_first(self._buf, self._ends)
                cut = i if i >= 0 else len(self._buf) - (0 if final else partial_len(self._buf, self._ends))
                out.reasoning += self._buf[:cut]
                self.reasoning_text += self._buf[:cut]
                if i < 0:
                    self._buf = self._buf[cut:]
                    return out
                if marker == THINK_CLOSE:
                    self._buf = self._buf[i + len(THINK_CLOSE):]
                    self.state, self._strip = "answer", True
                else:  # the call and what follows are the answer's
                    self._buf, self.state, self.ended_by_call = self._buf[i:], "answer", True
                continue
            text, self._buf = self._buf, ""
            if self._strip:
                text = text.lstrip()
                self._strip = not text
            out.content += text
            return out


class ReasoningTokens:
    """Counts one choice's tokens generated inside its reasoning, the tags included. Where `<think>` and
    `</think>` are one token each (DeepSeek-R1, Qwen3), by their ids, exactly, however the tokens arrive
    grouped (`call_id`, where given: `<tool_call>`'s, which ends qwen3's block uncounted); otherwise by
    what each delta's text was: a delta that gave reasoning counts whole (one that also closes the block
    counts its answer tokens too)."""

    def __init__(self, tag_ids: tuple[int, int] | None, inside: bool, call_id: int | None = None) -> None:
        self._tags, self._call, self._inside, self._closed, self.count = tag_ids, call_id, inside, False, 0

    def add(self, ids: list[int], was_reasoning: bool, split: Split, opens: bool = False) -> None:
        """A delta's ids; `was_reasoning`: the parser was inside the reasoning before its text, `split`: what
        its text gave; `opens`: its text opened the block (the parser took the output's `<think>`, which
        may follow whitespace: its tokens before the tag are not reasoning)."""
        if self._tags is None:
            self.count += len(ids) if was_reasoning or split.reasoning else 0
            return
        open_id, close_id = self._tags
        for i in ids:
            if self._closed:
                return
            if opens and i == open_id:
                self._inside, opens = True, False
            if self._inside and i == self._call:
                self._inside, self._closed = False, True
                return
            if self._inside:
                self.count += 1
                if i == close_id:
                    self._inside, self._closed = False, True

    def close(self) -> None:
        """The block has ended without its closing tag: nothing more is counted."""
        self._inside, self._closed = False, True


def single_token_tags(encode: Callable[[str], list[int]]) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` where the tokenizer (`encode`) makes each one token."""
    ids = [encode(tag) for tag in (THINK_OPEN, THINK_CLOSE)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def single_token_call(encode: Callable[[str], list[int]], kind: str = "qwen3") -> int | None:
    """The id of the markup that opens a call inside `kind`'s block (`<tool_call>` for qwen3, Kimi's
    `<|tool_calls_section_begin|>`) where the tokenizer (`encode`) makes it one token; None for other kinds."""
    if kind not in CALL_OPENERS:
        return None
    ids = encode(CALL_OPENERS[kind][0])
    return ids[0] if len(ids) == 1 else None


class ChoiceReasoning:
    """One choice's reasoning: its parser, started where the prompt leaves it, and its token count; fed
    each delta's text and ids."""

    def __init__(self, kind: str, prompt: str, continued: str | None, tag_ids: tuple[int, int] | None,
                 call_id: int | None = None) -> None:
        """`tag_ids` (`single_token_tags`) and `call_id` (`single_token_call`): what counts by id."""
        self.parser = ReasoningParser(kind)
        self.parser.after_prompt(prompt, continued)
        self.tokens = ReasoningTokens(tag_ids, self.parser.in_reasoning, call_id if kind in CALL_OPENERS else None)

    def feed(self, text: str, ids: list[int], final: bool) -> Split:
        was_reasoning, had_opened = self.parser.in_reasoning, self.parser.opened_by_output
        out = self.parser.feed(text)
        if final:
            tail = self.parser.finish()
            out = Split(out.reasoning + tail.reasoning, out.content + tail.content)
        self.tokens.add(ids, was_reasoning, out, opens=self.parser.opened_by_output and not had_opened)
        if self.parser.ended_by_call:  # (without `<tool_call>`'s id the count stops with this delta)
            self.tokens.close()
        return out


def starts_in_reasoning(kind: str, prompt: str, continued: str | None = None) -> bool:
    """Whether a chat output parsed as `kind` after `prompt` (and a `continued` final message's text)
    starts inside the reasoning (`ReasoningParser.after_prompt`). A constrained answer's grammar then
    waits for `</think>`."""
    if kind == "none":
        return False
    parser = ReasoningParser(kind)
    parser.after_prompt(prompt, continued)
    return parser.in_reasoning


def parser_kind(choice: str, chat_template: str | None) -> str:
    """The parser a server uses: `choice` itself, or for `auto` what the chat template shows (a
    template that writes `<think>` into the assistant's turn: deepseek_r1 when the generation prompt
    ends inside the block, qwen3 when the model opens it, kimi_k2 for Kimi-K2's call markup; none without
    one)."""
    if choice != "auto":
        return REASONING_ALIASES.get(choice, choice)
    t = chat_template or ""
    if THINK_OPEN not in t:
        return "none"
    if KIMI_CALLS_BEGIN in t:  # Kimi-K2-Thinking: R1's reading, a call ending the block
        return "kimi_k2"
    if "enable_thinking" in t:  # Qwen3's switch: the model opens the block itself
        return "qwen3"
    return "deepseek_r1"
