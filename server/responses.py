"""One serializer per API shape: chat completions, the Responses API (built on the chat one) and (legacy)
completions, whole or streamed.

A serializer sees text deltas per choice (already detokenized, stop strings applied) and builds the
OpenAI objects of `server/protocol.py`. Streams follow what the official SDK expects: one `id` and
`created` for every chunk, the role in each choice's first delta, `finish_reason` on the choice's
last chunk, and with `stream_options.include_usage` a final chunk with `choices: []` and the usage
(`usage: null` on every chunk before it). Logprobs go out with the text of their tokens
(`server/choices.py`), each with the token's own bytes.
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic_core import from_json, to_json

from engine.messages import TokenLogprob
from server.generation_defaults import GENERATION_FIELDS, with_defaults
from server.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatInput,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    PromptLogprob,
    PromptLogprobs,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    finite_logprob,
    sse_data,
)
from server import messages_api
from server.reasoning import (ChoiceReasoning, ReasoningParser, Split, parser_kind, single_token_call,
                              single_token_tags)
from server.responses_api import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    echoed,
    rename_error,
)
from server.tool_parsers import ToolCallDelta, whole_json
from server.tools import ToolPlan

if TYPE_CHECKING:
    from server.choices import EngineRequest, ShownLogprob
    from server.state import ClientError, ServerState


_TEXT_SLOT = "\ue000mlaserve text\ue001"  # stands for the text while a chunk template is made
_TEXT_SLOT_JSON = to_json(_TEXT_SLOT).decode()


class Serializer:
    prefix = "cmpl"

    def __init__(self, state: ServerState, body: Any, prompts: list[tuple[list[int], str]],
                 requests: list[EngineRequest], tools: ToolPlan | None = None) -> None:
        self.state, self.body, self.prompts, self.requests = state, body, prompts, requests
        self.tools = tools or ToolPlan()
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = len(requests[0].choices) if requests else 1
        self.texts: dict[int, str] = {}
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._text_events: dict[tuple[int, str], tuple[str, str] | None] = {}

    # ---- shared pieces
    def choice_index(self, r: EngineRequest, index: int) -> int:
        return r.prompt_index * self.n + index

    def usage(self, k: int | None = None) -> UsageInfo:
        """The usage so far: of the whole response, or of choice k alone (its prompt and its own tokens, what
        each chunk of vLLM's `continuous_usage_stats` stream carries)."""
        requests = self.requests if k is None else [r for r in self.requests if r.prompt_index == k // self.n]
        prompt = sum(len(r.prompt_ids) for r in requests)
        completion = sum(c.completion_tokens for r in requests for j, c in enumerate(r.choices)
                         if k is None or self.choice_index(r, j) == k)
        return UsageInfo.of(prompt, completion, sum(r.cached_tokens for r in requests))

    def chunk_usage(self, choices: list[Any]) -> UsageInfo:
        """A `continuous_usage_stats` chunk's usage: its choice's (the whole response's on a chunk of none)."""
        return self.usage(choices[0].index if len(choices) == 1 else None)

    def opening_usage(self, k: int) -> dict[str, UsageInfo]:
        """`chunk`'s usage for choice k's opening chunks (the role, an echo), which carry no generated token:
        its prompt and no completion tokens, as vLLM counts them (they are sent with the first output, whose
        token the choice's usage already counts)."""
        if not self.body.continuous_usage:
            return {}
        u = self.usage(k)
        details = u.completion_tokens_details  # (its counts at 0: the fields the later chunks carry)
        zeros = None if details is None else details.model_copy(
            update={name: 0 for name, value in details if value is not None})
        return {"usage": u.model_copy(update={"completion_tokens": 0, "total_tokens": u.prompt_tokens,
                                              "completion_tokens_details": zeros})}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.state.tokenizer
            assert tok is not None
            text = self._token_text[token_id] = tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (part of a character for a byte-level piece, where its text is U+FFFD)."""
        out = self._token_bytes.get(token_id)
        if out is None:
            tok = self.state.tokenizer
            assert tok is not None
            out = self._token_bytes[token_id] = list(tok.token_bytes(token_id))
        return out

    def prompt_logprobs(self, r: EngineRequest) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of r's prompt, with the request's: null for the first token (nothing
        predicts it), then each token's entry and its best alternatives', keyed by token id, the token's first
        (an alternative that is the token itself is not listed twice)."""
        k = getattr(self.body, "prompt_logprobs", None)
        if k is None or self.body.stream or not r.prompt_logprobs:
            return None
        out: PromptLogprobs = []
        for token, lp in zip(r.prompt_ids, r.prompt_logprobs):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_text(token))}
            for rank, (t, v) in enumerate(lp.top[:k], 1):
                entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=self.token_text(t)))
            out.append(entry)
        return out

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]) -> None:
        i = self.choice_index(r, index)
        self.texts[i] = self.texts.get(i, "") + text

    # ---- API specific
    def response(self) -> dict: ...
    def stream_start(self) -> list[Any]: ...
    def stream_delta(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]) -> list[Any]: ...

    def stream_end(self) -> list[Any]:
        return [self.chunk([], usage=self.usage())] if self.body.include_usage else []

    def chunk(self, choices: list[Any], **extra: Any) -> Any: ...

    def text_chunk(self, i: int, field: str, text: str) -> Any:
        """The chunk whose only news is choice i's `text` in `field` (no logprobs, ids or finish reason)."""
        raise NotImplementedError

    def text_event(self, i: int, field: str, text: str) -> str:
        """`text_chunk`'s SSE event, the chunk of nearly every streamed token. Its models are built and
        dumped once per choice and field, with a placeholder for the text, and each token's event is that
        JSON with the token's text put in (encoded by the same serializer): building and dumping the models
        took about half of a streamed token's Python in the server, which runs on the cores of the forward."""
        if self.body.continuous_usage:  # the usage changes chunk by chunk: no template
            return sse_data(self.text_chunk(i, field, text))
        key = (i, field)
        if key not in self._text_events:
            parts = sse_data(self.text_chunk(i, field, _TEXT_SLOT)).split(_TEXT_SLOT_JSON)
            self._text_events[key] = (parts[0], parts[1]) if len(parts) == 2 else None
        parts = self._text_events[key]
        if parts is None:  # the placeholder shows elsewhere too (a model named with it): no template
            return sse_data(self.text_chunk(i, field, text))
        return parts[0] + to_json(text).decode() + parts[1]

    # ---- SSE framing: `data: <json>` per chunk, an error as the body of an error response, `[DONE]` last
    stream_close = SSE_DONE

    def sse(self, payload: Any) -> str:
        """A chunk's event; an event already made (`text_event`) goes as it is."""
        return payload if isinstance(payload, str) else sse_data(payload)

    def stream_error(self, e: ClientError) -> list[Any]:
        return [e.body()]


def named_sse(payload: dict[str, Any]) -> str:
    """An SSE event named by its payload's `type` (`event:` line, then `data:`), as the Responses and
    Anthropic's Messages APIs stream."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChatSerializer(Serializer):
    """With a tool plan, each choice's text goes through its own tool-call parser: markup becomes
    `tool_calls` (whole, or as deltas when streaming) and never shows in `content`; a choice that
    called tools and stopped by itself ends with finish_reason "tool_calls"."""

    prefix = "chatcmpl"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.parsers: dict[int, Any] = {}  # choice index -> its streaming tool-call parser
        # reasoning (server/reasoning.py): per choice its parser, the reasoning and answer text split so
        # far, and the tokens generated inside the reasoning (usage.completion_tokens_details)
        tok = self.state.tokenizer
        self.reasoning_kind = parser_kind(self.state.reasoning_parser, tok.chat_template if tok else None)
        self.reasoners: dict[int, ChoiceReasoning] = {}
        self.split: dict[int, Split] = {}
        self.tag_ids = None  # <think>, </think> ids where each is one token (for the count), only when parsing
        self.call_id = None  # and <tool_call>'s, which ends qwen3's block (Kimi's section marker, kimi_k2's)
        # streamed, per choice: logprobs of tokens none of whose text has gone out yet as answer text
        self.unplaced: dict[int, list[ShownLogprob]] = {}
        self.answered: dict[int, int] = {}  # streamed: where in its generated text the answer sent so far ends
        self.logprobs_sent: set[int] = set()  # streamed: choices that have sent a `logprobs` object
        self.floor: dict[int, int] = {}  # streamed: where in its generated text the answer may start (past `</think>`)
        if tok is not None and self.reasoning_kind != "none":
            self.tag_ids = single_token_tags(lambda t: tok.encode(t, add_special_tokens=False))
            self.call_id = single_token_call(lambda t: tok.encode(t, add_special_tokens=False), self.reasoning_kind)
        self.echo = self.echo_split()
        # with the reasoning left out (include_reasoning false), neither token ids nor logprobs are sent, as
        # vLLM does: the ids would spell the reasoning out
        hidden = not self.shows_reasoning and self.reasoning_kind != "none"
        self.wants_logprobs = bool(getattr(self.body, "logprobs", False)) and not hidden
        self.wants_ids = bool(getattr(self.body, "return_token_ids", False)) and not hidden

    def echo_split(self) -> Split:
        """What vLLM's chat `echo` puts before every choice: the final message's text where it is the
        assistant's, its `<think>` block (if any) as reasoning when a reasoning parser is in use."""
        body = self.body
        if not (isinstance(body, ChatCompletionRequest) and body.echo and body.messages[-1].role == "assistant"):
            return Split()
        text = body.messages[-1].text()
        if self.reasoning_kind == "none":
            return Split("", text)
        parser = ReasoningParser("qwen3")  # a block only where the text opens one
        head, tail = parser.feed(text), parser.finish()
        return Split(head.reasoning + tail.reasoning, head.content + tail.content)

    @property
    def shows_reasoning(self) -> bool:
        """Whether the reply carries its reasoning (vLLM's `include_reasoning: false` leaves it out; it is still
        parsed apart from the answer and counted in `reasoning_tokens`)."""
        return getattr(self.body, "include_reasoning", None) is not False

    def reason(self, i: int, text: str, ids: list[int], final: bool) -> Split:
        """Choice i's new text split into reasoning and answer (all answer without a reasoning parser)."""
        if self.reasoning_kind == "none":
            return Split("", text)
        return self.reasoner(i).feed(text, ids, final)

    def reasoner(self, i: int) -> ChoiceReasoning:
        """Choice i's reasoning parser, started where the prompt leaves it (made on first use)."""
        reasoner = self.reasoners.get(i)
        if reasoner is None:
            reasoner = self.reasoners[i] = ChoiceReasoning(
                self.reasoning_kind, self.prompts[0][1] if self.prompts else "",
                self.body.continued_text() if isinstance(self.body, ChatInput) else None, self.tag_ids, self.call_id)
        return reasoner

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]) -> None:
        super().add(r, index, text, ids, lps)
        i = self.choice_index(r, index)
        part = self.reason(i, text, ids, r.choices[index].finish_reason is not None)
        whole = self.split.setdefault(i, Split())
        whole.reasoning += part.reasoning
        whole.content += part.content

    def usage(self, k: int | None = None) -> UsageInfo:
        usage = super().usage(k)
        predicted = None
        if getattr(self.body, "prediction", None) is not None:  # (its draft tokens kept and not, summed)
            # (tokens verified past a stop string were kept as drafts, then cut with the text: not in the reply)
            counts = [(min(c.predicted[0], c.completion_tokens), c.predicted[1]) for r in self.requests
                      for j, c in enumerate(r.choices) if k is None or self.choice_index(r, j) == k]
            predicted = (sum(a for a, _ in counts), sum(b for _, b in counts))
        if self.reasoning_kind == "none" and predicted is None:
            return usage
        prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, None
        if usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens
        reasoning = None
        if self.reasoning_kind != "none":
            reasoning = sum(r.tokens.count for i, r in self.reasoners.items() if k is None or i == k)
        return UsageInfo.of(prompt, completion, cached, reasoning_tokens=reasoning, predicted=predicted)

    # a call forced by a named tool_choice ends with "stop", as OpenAI's (and vLLM's) do
    named_call_stops = True

    def finish_reason(self, reason: str | None, parser: Any) -> str | None:
        """"tool_calls" for a reply that called tools and stopped (`named_call_stops`), each call whole: a
        stop string that cut a call's arguments (a forced call's grammar does not keep them out) leaves
        "stop", as max_tokens leaves "length", so that a cut call is never reported as made."""
        called = reason == "stop" and parser is not None and parser.tool_calls and \
            not (self.tools.named and self.named_call_stops) and \
            all(whole_json(c.arguments) for c in parser.tool_calls)
        return "tool_calls" if called else reason

    def token_logprobs(self, lps: list[ShownLogprob]) -> list[ChatTokenLogprob]:
        """Each token's text, bytes and logprob, and its alternatives' (chat's shape; the Responses API's
        output_text part has the same)."""
        return [ChatTokenLogprob(**self.named(lp.token_id, chosen=True), logprob=lp.logprob,
                                 top_logprobs=[TopLogprob(**self.named(t), logprob=v) for t, v in lp.top])
                for lp, *_ in lps]

    def named(self, token_id: int, chosen: bool = False) -> dict[str, Any]:
        """A logprob's `token` and `bytes`: the token's text and own bytes, or with vLLM's
        return_tokens_as_token_ids `token_id:N`, and as vLLM writes them, the chosen token's own bytes and an
        alternative's that name's."""
        if getattr(self.body, "return_tokens_as_token_ids", False):
            name = f"token_id:{token_id}"
            return {"token": name, "bytes": self.token_bytes(token_id) if chosen else list(name.encode())}
        return {"token": self.token_text(token_id), "bytes": self.token_bytes(token_id)}

    def chat_logprobs(self, lps: list[ShownLogprob]) -> ChatChoiceLogprobs | None:
        return ChatChoiceLogprobs(content=self.token_logprobs(lps)) if self.wants_logprobs else None

    def unshown(self, lps: list[ShownLogprob]) -> list[ShownLogprob]:
        """`lps` without the special tokens the reply's text leaves out (`skip_special_tokens`): their text is
        no part of the content the logprobs join to (one between words was listed, one at the end not)."""
        tok = self.state.tokenizer
        if tok is None or not self.body.skip_special_tokens:
            return lps
        special = tok.special_ids
        return [s for s in lps if not (s.lp.token_id in special and s.end <= s.offset)]

    def content_logprobs(self, i: int, lps: list[ShownLogprob], split: Split, content: str) -> list[ShownLogprob]:
        """Of choice i's logprobs, those of the tokens whose text is its answer `content` (as OpenAI's
        `logprobs.content` joins to the content): those starting inside the answer's span of the generated
        text (after the reasoning; within the text the tool-call parser left, when it took calls out of it)."""
        lps = self.unshown(lps)
        generated = self.texts.get(i, "")
        if not content:  # tokens with no text at all (ids past the tokenizer's) are an empty answer's
            return [] if generated else [s for s in lps if s.end <= s.offset]
        start, end = max(generated.rfind(split.content), 0), len(generated)
        if content != split.content and (at := generated.find(content, start)) >= 0:
            start, end = at, at + len(content)
        # (" Answer" after `</think>`, its space stripped); a token with no text of its own belongs where it
        # stands, at the answer's end too (it was left out there: one entry short of the tokens)
        return [s for s in lps if s.overlaps(start, end) or s.end <= s.offset and start <= s.offset <= end]

    def placed_logprobs(self, i: int, lps: list[ShownLogprob], raw: str, text: str, elsewhere: bool,
                        ended: bool = False, finished: bool = False) -> list[ShownLogprob]:
        """`_placed_logprobs`, and where the choice `finished`, the tokens with no text of their own still
        waiting at the answer's end (ids past the tokenizer: no answer text would ever release them)."""
        out = self._placed_logprobs(i, lps, raw, text, elsewhere, ended)
        waiting = self.unplaced.get(i, [])
        if finished and (textless := [s for s in waiting if s.end <= s.offset]):
            self.unplaced[i] = [s for s in waiting if s.end > s.offset]
            out = out + textless
        return out

    def _placed_logprobs(self, i: int, lps: list[ShownLogprob], raw: str, text: str,
                         elsewhere: bool, ended: bool = False) -> list[ShownLogprob]:
        """Streamed: the logprobs to send with choice i's new answer `text`, out of its generated text `raw`
        (this delta's). As the whole answer's `content_logprobs`: those of the tokens that start inside the
        answer text, found in the generated text after what was answered before; tokens before it (their
        text went to reasoning or a call) are dropped, tokens after it wait for the answer text they start.
        One delta may hold several tokens (a speculative step's), some of them reasoning or a call's markup.
        With nothing answered, tokens whose text went elsewhere are dropped. A token released with no new
        text, whose text starts inside the answer sent before, goes now: the last token before a stop string,
        whose text the stop string cut (its first characters were sent with the token before it). A token
        whose first characters went out before it was released (held back as a possible stop string) goes
        with the delta that finishes its text. Where the reasoning `ended` in this delta, its answer text is
        after the end tag: the last place it is found (an answer starting like the tag was found in the tag),
        and with no answer text yet, the answer starts past all generated so far."""
        if not self.wants_logprobs:
            return []
        generated = self.texts[i] = self.texts.get(i, "") + raw  # (what `add` keeps when not streamed)
        pending = self.unplaced.setdefault(i, [])
        pending += self.unshown(lps)
        if not text:
            sent = self.answered.get(i, 0)
            inside = [s for s in pending if s.offset < sent]
            self.unplaced[i] = [] if elsewhere else [s for s in pending if s.offset >= sent]
            if ended:
                self.floor[i] = len(generated)
            return inside
        lo = max(self.answered.get(i, 0), self.floor.get(i, 0), pending[0].offset if pending else 0)
        at = generated.rfind(text, lo) if ended else generated.find(text, lo)
        if at < 0:  # (an answer that is not the generated text as it is: each token with the text after it)
            self.unplaced[i] = []
            return pending
        end = self.answered[i] = at + len(text)
        self.unplaced[i] = [s for s in pending if s.offset >= end]
        return [s for s in pending if s.overlaps(at, end)]

    def message(self, split: Split) -> tuple[ChatResponseMessage, Any]:
        """The whole message of a choice: its reasoning apart, its answer through a fresh tool-call parser
        when tools are in play."""
        reasoning = (self.echo.reasoning + split.reasoning) or None
        # a reply that is all reasoning (cut before `</think>`) has no answer: null, as vLLM's reasoning parsers say
        empty = None if reasoning is not None else ""
        reasoning = reasoning if self.shows_reasoning else None
        if self.tools.new_parser is None:
            return ChatResponseMessage(content=(self.echo.content + split.content) or empty,
                                       reasoning_content=reasoning), None
        parser = self.tools.new_parser()
        content, _ = parser.feed(split.content)
        content = self.echo.content + content + parser.finish()[0]
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in parser.tool_calls]
        forced = self.tools.forced  # a forced call's reply has no content, even cut before it began
        return ChatResponseMessage(content=content or (None if calls or forced else empty), reasoning_content=reasoning,
                                   tool_calls=calls or None), parser

    def finish_splits(self) -> None:
        """Text the reasoning parsers held back at the end (a cut-off tag) joins each choice's split."""
        for i, reasoner in self.reasoners.items():
            tail, whole = reasoner.parser.finish(), self.split.setdefault(i, Split())
            whole.reasoning += tail.reasoning
            whole.content += tail.content

    def response(self) -> dict:
        ids = self.wants_ids
        self.finish_splits()
        choices = []
        for r in self.requests:
            for i, c in enumerate(r.choices):
                k = self.choice_index(r, i)
                split = self.split.get(k, Split())
                message, parser = self.message(split)
                answer = (message.content or "")[len(self.echo.content):]  # (an echo has no logprobs)
                choices.append(ChatCompletionChoice(
                    index=k, message=message,
                    logprobs=self.chat_logprobs(self.content_logprobs(k, c.logprobs, split, answer)),
                    finish_reason=self.finish_reason(c.finish_reason, parser), stop_reason=c.stop_reason,
                    token_ids=c.token_ids if ids else None,
                ))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.state.model_name,
            system_fingerprint=self.state.system_fingerprint, choices=choices, usage=self.usage(),
            prompt_token_ids=self.requests[0].prompt_ids if self.body.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs(self.requests[0]),
        ).model_dump()

    def chunk(self, choices: list[Any], **extra: Any) -> ChatCompletionChunk:
        if self.body.continuous_usage and "usage" not in extra:  # the usage so far on every chunk
            extra["usage"] = self.chunk_usage(choices)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                                   system_fingerprint=self.state.system_fingerprint, choices=choices,
                                   **extra).usage_null(self.body.include_usage)

    def stream_start(self) -> list[Any]:
        # a forced tool call's reply has no content (null, as the whole answer says), else it starts as ""
        content = None if self.tools.forced else ""
        ids = self.requests[0].prompt_ids if self.body.return_token_ids else None
        out = []
        for i in range(len(self.requests) * self.n):  # one chunk a choice, as OpenAI and vLLM stream
            first = ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=content))
            out.append(self.chunk([first], prompt_token_ids=ids if i == 0 else None, **self.opening_usage(i)))
            out += [self.chunk([ChatCompletionChunkChoice(index=i, delta=DeltaMessage(**{field: text}))],
                               **self.opening_usage(i))
                    for field, text in (("reasoning_content", self.echo.reasoning if self.shows_reasoning else ""),
                                        ("content", self.echo.content)) if text]
        return out

    def parse_delta(self, r: EngineRequest, index: int, text: str, ids: list[int]) -> tuple[str, str, list[ToolCallDelta], Any]:
        """A choice's new text as (reasoning, answer, tool-call deltas, its tool-call parser or None), through
        its reasoning parser, then its tool-call parser (both finished on the choice's last delta)."""
        choice = r.choices[index]
        i = self.choice_index(r, index)
        part = self.reason(i, text, ids, choice.finish_reason is not None)
        text, deltas, parser = part.content, [], None
        if self.tools.new_parser is not None:
            if i not in self.parsers:
                self.parsers[i] = self.tools.new_parser()
            parser = self.parsers[i]
            text, deltas = parser.feed(text)
            if choice.finish_reason is not None:
                tail, more = parser.finish()
                text, deltas = text + tail, deltas + more
        return part.reasoning, text, deltas, parser

    def text_chunk(self, i: int, field: str, text: str) -> ChatCompletionChunk:
        return self.chunk([ChatCompletionChunkChoice(index=i, delta=DeltaMessage(**{field: text}))])

    def placed_delta(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]
                     ) -> tuple[str, str, list[ToolCallDelta], Any, list[ShownLogprob]]:
        """`parse_delta`, and the logprobs that go with the delta's answer text (`placed_logprobs`)."""
        i = self.choice_index(r, index)
        was_reasoning = self.reasoning_kind != "none" and self.reasoner(i).parser.in_reasoning
        reasoning, answer, deltas, parser = self.parse_delta(r, index, text, ids)
        ended = was_reasoning and not self.reasoners[i].parser.in_reasoning  # (its `</think>`'s text went nowhere)
        finished = r.choices[index].finish_reason is not None
        return reasoning, answer, deltas, parser, self.placed_logprobs(i, lps, text, answer,
                                                                       bool(reasoning or deltas or ended), ended,
                                                                       finished)

    def stream_delta(self, r, index, text, ids, lps):
        choice = r.choices[index]
        i = self.choice_index(r, index)
        out = []
        reasoning, text, deltas, parser, lps = self.placed_delta(r, index, text, ids, lps)
        reasoning = (reasoning or None) if self.shows_reasoning else None
        calls = [_delta_tool_call(d) for d in deltas] or None
        ids_out = ids if self.wants_ids else None
        finished = choice.finish_reason is not None
        # logprobs with no text of their own (a token the stop string cut) go with the finish, not in a chunk of
        # empty content; a choice that never sent logprobs sends its empty list there, as the whole reply has
        # `{"content": []}`
        late = self.wants_logprobs and finished and not (text or reasoning or calls or ids_out) and \
            (bool(lps) or i not in self.logprobs_sent)
        plain = not (calls or self.wants_ids or self.wants_logprobs)  # then one field, nothing else
        if plain and bool(text) != bool(reasoning):
            out.append(self.text_event(i, "content", text) if text else self.text_event(i, "reasoning_content", reasoning))
        elif not late and (text or reasoning or calls or ids_out or (self.wants_logprobs and lps)):
            out.append(self.chunk([ChatCompletionChunkChoice(
                index=i, delta=DeltaMessage(content=text if text or not (calls or reasoning) else None,
                                            reasoning_content=reasoning, tool_calls=calls),
                logprobs=self.chat_logprobs(lps), token_ids=ids_out,
            )]))
            self.logprobs_sent.add(i)
        if finished:
            out.append(self.chunk([ChatCompletionChunkChoice(
                index=i, delta=DeltaMessage(), finish_reason=self.finish_reason(choice.finish_reason, parser),
                stop_reason=choice.stop_reason, logprobs=self.chat_logprobs(lps) if late else None)]))
        return out


def _delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    first = d.id is not None
    return DeltaToolCall(index=d.index, id=d.id, type="function" if first else None,
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))


class OutputItems:
    """A response's output items, built as the text arrives, and the stream events that tell each change.

    Items come in the order the model writes them: a `reasoning` item, a `message`, `function_call`s.
    One item is written at a time: a new kind of output (the answer after the reasoning, a call after
    text, text after a call) finishes the current item (its `.done` events) and opens the next (its
    `.added` events). A whole response is the same builder fed the whole split at once (reasoning,
    answer, calls), so it has the items a stream ends with; they differ only where text follows a call,
    which a stream tells as a second message and a whole response joins to the first. A response with
    no output at all still has its (empty) message. `event(type, **fields)` numbers the events."""

    def __init__(self, event: Callable[..., dict[str, Any]]) -> None:
        self.event = event
        self.output: list[OutputItem] = []
        self.current: OutputItem | None = None  # the item being written, the last of `output`
        self.calls: dict[int, OutputFunctionCall] = {}  # tool-call index -> its item

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._append(text, ReasoningItem, "rs", ReasoningText, "response.reasoning_text.delta")

    def text(self, text: str, logprobs: list[ChatTokenLogprob] | None = None) -> list[dict[str, Any]]:
        """Answer text and the logprobs of its tokens (kept on the part, told in the delta event)."""
        logprobs = logprobs or []
        if not text and logprobs and isinstance(self.current, OutputMessage):
            # a token whose text was sent before it (cut by a stop string): its logprobs in an empty delta
            self.current.content[0].logprobs += logprobs  # type: ignore[union-attr]
            return [self.event("response.output_text.delta", item_id=self.current.id, output_index=len(self.output) - 1,
                               content_index=0, delta="", logprobs=_event_logprobs(logprobs))]
        out = self._append(text, OutputMessage, "msg", OutputText, "response.output_text.delta",
                           logprobs=_event_logprobs(logprobs))
        if out:
            self.current.content[0].logprobs += logprobs  # type: ignore[union-attr]
        return out

    def _append(self, text: str, kind: type, prefix: str, part: type, event: str, **extra: Any) -> list[dict[str, Any]]:
        """`text` added to the current item of `kind` (a new one, with its one content part, when the
        current item is another kind) and its delta event."""
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if not isinstance(self.current, kind):
            out += self._open(kind(id=_item_id(prefix)), part())
        item = self.current
        assert item is not None
        item.content[0].text += text  # type: ignore[union-attr]
        return out + [self.event(event, item_id=item.id, output_index=len(self.output) - 1, content_index=0,
                                 delta=text, **extra)]

    def call(self, d: ToolCallDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if d.id is not None:  # a call's first piece: its id and name
            item = self.calls[d.index] = OutputFunctionCall(id=_item_id("fc"), call_id=d.id, name=d.name or "")
            out += self._open(item)
        item = self.calls.get(d.index)
        if item is None or not d.arguments:
            return out
        item.arguments += d.arguments
        return out + [self.event("response.function_call_arguments.delta", item_id=item.id,
                                 output_index=self.output.index(item), delta=d.arguments)]

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Closes the item being written ("incomplete" when the output was cut off); a response with
        nothing in it gets its empty message."""
        out: list[dict[str, Any]] = []
        if not self.output:
            out += self._open(OutputMessage(id=_item_id("msg")), OutputText())
        return out + self._close("incomplete" if incomplete else "completed")

    def _open(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[dict[str, Any]]:
        out = self._close("completed")
        self.output.append(item)
        self.current = item
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item.model_dump()))
        if part is not None:
            item.content.append(part)  # type: ignore[union-attr,arg-type]
            out.append(self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                                  part=part.model_dump()))
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.current = self.current, None
        if item is None:
            return []
        item.status = status  # type: ignore[assignment]
        index = self.output.index(item)
        at = {"item_id": item.id, "output_index": index}
        out = []
        if isinstance(item, ReasoningItem):
            text = item.content[0].text
            out += [self.event("response.reasoning_text.done", **at, content_index=0, text=text),
                    self.event("response.content_part.done", **at, content_index=0, part=item.content[0].model_dump())]
        elif isinstance(item, OutputMessage):
            text, lps = item.content[0].text, item.content[0].logprobs
            out += [self.event("response.output_text.done", **at, content_index=0, text=text,
                               logprobs=_event_logprobs(lps)),
                    self.event("response.content_part.done", **at, content_index=0, part=item.content[0].model_dump())]
        else:
            out.append(self.event("response.function_call_arguments.done", **at, arguments=item.arguments))
        out.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        return out


def _event_logprobs(lps: list[ChatTokenLogprob]) -> list[dict[str, Any]]:
    """Logprobs as the output_text delta and done events give them: no bytes."""
    return [{"token": lp.token, "logprob": lp.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs]} for lp in lps]


def _tool_use_id(call_id: str) -> str:
    """A chat tool call's id as Anthropic writes a tool_use block's (`toolu_...`); the id a client sends back
    in its tool_result is taken as it is, so the round trip holds either way."""
    return "toolu_" + call_id.removeprefix("call_")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesSerializer(ChatSerializer):
    """The Responses API's answer to a request the chat path served (`server.responses_api`): the chat
    serializer's reasoning and tool-call parsing (one choice: n is 1), told as output items
    (`OutputItems`). A stream is SSE events with `event: <type>` lines and numbered `sequence_number`s:
    `response.created`, `response.in_progress`, each item's events, then `response.completed` (or
    `response.incomplete`, output cut by `max_output_tokens`) with the whole response; no `[DONE]`. An
    error mid-stream is an `error` event."""

    stream_close = ""

    def __init__(self, *a: Any, request: ResponsesRequest, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.sequence = 0
        self.items = OutputItems(self.event)

    def event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def sse(self, payload: Any) -> str:
        return named_sse(payload)

    def stream_error(self, e: ClientError) -> list[Any]:
        """The `error` event, then `response.failed` with the response so far, the item cut short `incomplete`
        (OpenAI's streams end so; a client reads what came from it, though the SDK's `get_final_response()`
        raises for any end but `response.completed`)."""
        if self.items.current is not None:
            self.items.current.status = "incomplete"  # (its .done events are not sent: the stream failed)
        message, param = rename_error(e.message, e.param)
        failed = self.response_object("failed", self.response_usage(), error=ResponseError(message=message))
        return [self.event("error", code=e.code or e.type, message=message, param=param),
                self.event("response.failed", response=failed.model_dump())]

    def response_usage(self) -> ResponseUsage:
        u = self.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else None
        reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else 0
        return ResponseUsage(input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached or 0),
                             output_tokens=u.completion_tokens,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                             total_tokens=u.total_tokens)

    def response_object(self, status: str, usage: ResponseUsage | None = None,
                        error: ResponseError | None = None) -> ResponseObject:
        # the sampling values in force: the request's, else the model's defaults (as to_sampling_params takes them)
        sampling = with_defaults({k: getattr(self.body, k) for k in GENERATION_FIELDS if k in self.body.model_fields_set},
                                 self.state.sampling_defaults)
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.state.model_name,
            completed_at=int(time.time()) if status == "completed" else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            output=list(self.items.output), temperature=sampling["temperature"], top_p=sampling["top_p"], usage=usage,
            error=error, **echoed(self.request),
        )

    def status(self) -> str:
        choice = self.requests[0].choices[0]
        return "incomplete" if choice.finish_reason == "length" else "completed"

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]) -> None:
        """A whole response's output is built as a stream's is, its events unsent: its items in the order the
        model wrote them (text after a call is a message after the call), the same as the stream's."""
        self.stream_delta(r, index, text, ids, lps)

    def response(self) -> dict:
        status = self.status()
        self.items.finish(status == "incomplete")
        return self.response_object(status, self.response_usage()).model_dump()

    def stream_start(self) -> list[Any]:
        started = self.response_object("in_progress").model_dump()
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started)]

    def stream_delta(self, r, index, text, ids, lps):
        reasoning, text, deltas, _, shown = self.placed_delta(r, index, text, ids, lps)
        out = self.items.reasoning(reasoning) + self.items.text(text, self.token_logprobs(shown))
        for d in deltas:
            out += self.items.call(d)
        return out

    def stream_end(self) -> list[Any]:
        status = self.status()
        out = self.items.finish(status == "incomplete")
        final = self.response_object(status, self.response_usage()).model_dump()
        return out + [self.event(f"response.{status}", response=final)]


class CompletionSerializer(Serializer):
    prefix = "cmpl"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        body: CompletionRequest = self.body
        self.echo = bool(body.echo)
        self._echoed: set[int] = set()  # the prompts (ids of their EngineRequests) whose echo a stream has sent

    def completion_logprobs(self, r: EngineRequest, lps: list[ShownLogprob], echoed: bool = False) -> CompletionLogprobs | None:
        """The legacy parallel lists: with `echoed`, the echoed prompt's tokens first (nothing predicts the
        first one: its logprob is null), then `lps`. `text_offset` counts from the start of the choice's
        text, the echoed prompt included."""
        if self.body.logprobs is None:
            return None
        out = CompletionLogprobs()
        base = len(self.prompt_text(r))
        if echoed and self.echo and r.prompt_logprobs:
            # a token's offset: the characters its bytes' predecessors complete (a token inside a character
            # split over several points at that character), as the generated tokens' offsets are counted
            text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            offset = 0
            for token, lp in zip(r.prompt_ids, r.prompt_logprobs):
                self._append_logprob(out, token, lp, min(offset, base))
                offset += len(text.decode(bytes(self.token_bytes(token))))
        for lp, at, _ in lps:
            self._append_logprob(out, lp.token_id, lp, base + at)
        return out

    def legacy_token(self, token_id: int) -> str:
        """A token as the legacy lists name it: its text, or for one holding part of a character OpenAI's
        `bytes:\\xe6\\x97` (its text alone would be U+FFFD, the same for every such token, and the
        `top_logprobs` keys would collide); an id past the tokenizer's (an LM head padded wider) has no
        text or bytes: vLLM's `token_id:N`."""
        text = self.token_text(token_id)
        if (not text and not self.token_bytes(token_id)) or self.body.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        if "\ufffd" in text:
            raw = bytes(self.token_bytes(token_id))
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def _append_logprob(self, out: CompletionLogprobs, token: int, lp: TokenLogprob | None, offset: int) -> None:
        text = self.legacy_token(token)
        top = None
        if lp is not None:  # logprobs 0 included: the chosen token alone
            top = {}
            # best first (as many as `logprobs` asks: vLLM's prompt_logprobs may have asked for more); where two
            # ids show the same text, the better one's value
            for t, v in lp.top[: self.body.logprobs or 0]:
                top.setdefault(self.legacy_token(t), finite_logprob(v))
            top[text] = finite_logprob(lp.logprob)  # the chosen token is always listed, as OpenAI and vLLM do
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else finite_logprob(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)

    def prompt_text(self, r: EngineRequest) -> str:
        return self.prompts[r.prompt_index][1] if self.echo else ""

    def response(self) -> dict:
        ids = self.body.return_token_ids
        choices = []
        for r in self.requests:
            for k, c in enumerate(r.choices):
                i = self.choice_index(r, k)
                choices.append(CompletionChoice(
                    index=i, text=self.prompt_text(r) + self.texts.get(i, ""),
                    logprobs=self.completion_logprobs(r, c.logprobs, echoed=True),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=c.token_ids if ids else None, prompt_token_ids=r.prompt_ids if ids else None,
                    prompt_logprobs=self.prompt_logprobs(r),
                ))
        return CompletionResponse(
            id=self.id, created=self.created, model=self.state.model_name,
            system_fingerprint=self.state.system_fingerprint, choices=choices, usage=self.usage(),
            prompt_token_ids=self.requests[0].prompt_ids if ids and len(self.requests) == 1 else None,
        ).model_dump()

    def chunk(self, choices: list[Any], **extra: Any) -> CompletionChunk:
        if self.body.continuous_usage and "usage" not in extra:  # the usage so far on every chunk
            extra["usage"] = self.chunk_usage(choices)
        return CompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                               system_fingerprint=self.state.system_fingerprint, choices=choices,
                               **extra).usage_null(self.body.include_usage)

    def stream_start(self) -> list[Any]:
        return []  # (each prompt's echo goes with its first output: `_echo`)

    def _echo(self, r: EngineRequest) -> list[Any]:
        """Prompt r's echoed text (its logprobs, its ids) once, one chunk a choice, as OpenAI and vLLM stream
        it (a client reading choices[0] lost the other echoes). Sent with the prompt's first output, which
        brings its prompt logprobs: sent for every prompt at the stream's start, a prompt whose first output
        came later had none."""
        if (not self.echo and not self.body.return_token_ids) or id(r) in self._echoed:
            return []
        self._echoed.add(id(r))
        return [self.chunk([
            CompletionChoice(index=self.choice_index(r, k), text=self.prompt_text(r),
                             logprobs=self.completion_logprobs(r, [], echoed=True) if self.echo else None,
                             prompt_token_ids=r.prompt_ids if self.body.return_token_ids else None)],
            **self.opening_usage(self.choice_index(r, k)))
            for k in range(self.n)]

    def text_chunk(self, i: int, field: str, text: str) -> CompletionChunk:
        return self.chunk([CompletionChoice(index=i, text=text)])

    def stream_delta(self, r, index, text, ids, lps):
        choice = r.choices[index]
        i = self.choice_index(r, index)
        echo = self._echo(r)
        if not (text or choice.finish_reason or (self.body.return_token_ids and ids) or
                (self.body.logprobs is not None and lps)):
            return echo
        if text and choice.finish_reason is None and self.body.logprobs is None and not self.body.return_token_ids:
            return [*echo, self.text_event(i, "text", text)]
        return [*echo, self.chunk([CompletionChoice(
            index=i, text=text, logprobs=self.completion_logprobs(r, lps), finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason, token_ids=ids if self.body.return_token_ids else None,
        )])]


class MessagesSerializer(ChatSerializer):
    """Anthropic's Messages API's answer to a request the chat path served (`server.messages_api`): the
    chat serializer's reasoning and tool-call parsing (one choice), told as content blocks — `thinking`,
    `text`, `tool_use` in the order the model writes them. A stream is SSE events with `event: <type>`
    lines: `message_start`, each block's `content_block_start` / `_delta` (`thinking_delta`,
    `text_delta`, `input_json_delta`) / `_stop`, then `message_delta` (stop reason, the whole usage) and
    `message_stop`; an error mid-stream is an `error` event. `usage.input_tokens` counts the prompt tokens
    the prefix cache did not hold, `cache_read_input_tokens` those it did, as Anthropic counts them."""

    stream_close = ""
    named_call_stops = False  # Anthropic's API stops a forced named call with tool_use

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.block: tuple[int, str] | None = None  # the open block's index and type, while streaming
        self.blocks = 0
        self.events: list[dict[str, Any]] = []  # a whole message's events, unsent (`add`)

    def sse(self, payload: Any) -> str:
        return named_sse(payload)

    def stream_error(self, e: ClientError) -> list[Any]:
        return [messages_api.error_body(e.status, e.message, e.code)]

    def anthropic_usage(self, final: bool = True) -> dict[str, Any]:
        u = self.usage()
        cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details is not None else 0
        return {"input_tokens": u.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": u.completion_tokens if final else 0}

    def stop(self) -> tuple[str | None, str | None]:
        """Anthropic's stop reason and the stop sequence that ended the reply."""
        choice = self.requests[0].choices[0]
        return messages_api.stop_reason(self.finish_reason(choice.finish_reason, self.parsers.get(0)),
                                        choice.stops.matched)

    def message_object(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        reason, sequence = self.stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self.anthropic_usage(final)}

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[ShownLogprob]) -> None:
        """A whole message is the stream's events, unsent, added up (`_blocks`): its blocks in the order the
        model wrote them (text after a tool call is a text block after the tool_use), as the SDK's
        `get_final_message()` reads the stream."""
        self.events += self.stream_delta(r, index, text, ids, lps)

    def response(self) -> dict:
        return self.message_object(_blocks(self.events + self._close()), final=True)

    def stream_start(self) -> list[Any]:
        return [{"type": "message_start", "message": self.message_object([], final=False)}]

    def _open(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        """The events that close the open block and start a new one of `kind`."""
        out = self._close()
        self.block, self.blocks = (self.blocks, kind), self.blocks + 1
        return [*out, {"type": "content_block_start", "index": self.block[0], "content_block": {"type": kind, **fields}}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        index, self.block = self.block[0], None
        return [{"type": "content_block_stop", "index": index}]

    def _delta(self, kind: str, delta: dict[str, Any], **start: Any) -> list[dict[str, Any]]:
        out = self._open(kind, **start) if self.block is None or self.block[1] != kind else []
        assert self.block is not None
        return [*out, {"type": "content_block_delta", "index": self.block[0], "delta": delta}]

    def stream_delta(self, r, index, text, ids, lps):
        reasoning, text, deltas, _ = self.parse_delta(r, index, text, ids)
        out: list[dict[str, Any]] = []
        if reasoning:
            out += self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning}, thinking="", signature="")
        if text:
            out += self._delta("text", {"type": "text_delta", "text": text}, text="")
        for d in deltas:
            if d.id is not None:  # a new call: its own block
                out += self._open("tool_use", id=_tool_use_id(d.id), name=d.name, input={})
            if d.arguments:
                out += self._delta("tool_use", {"type": "input_json_delta", "partial_json": d.arguments})
        return out

    def stream_end(self) -> list[Any]:
        reason, sequence = self.stop()
        usage = self.anthropic_usage()
        return [*self._close(), {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage}, {"type": "message_stop"}]


def _blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a Messages stream's events add up to: each block as it started, its deltas joined
    (a tool_use's JSON text becoming its `input`)."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = blocks[e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                arguments[e["index"]] = arguments.get(e["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
    for i, text in arguments.items():
        blocks[i]["input"] = _tool_input(text)
    return blocks


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool_use block's `input`: the call's arguments as an object. Arguments cut off by max_tokens or a
    stop sequence (the reply's stop_reason says which; Anthropic's advice for max_tokens is to ask again with
    more) give the members complete so far, as Anthropic's SDK reads the same text streamed (jiter's partial
    mode: a string still open is left out), so a reply reads the same streamed or not."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
