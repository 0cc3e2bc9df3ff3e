"""One serializer per API shape: chat completions and (legacy) completions, whole or streamed.

A serializer sees text deltas per choice (already detokenized, stop strings applied) and builds the
OpenAI objects of `server/protocol.py`. Streams follow what the official SDK expects: one `id` and
`created` for every chunk, the role in each choice's first delta, `finish_reason` on the choice's
last chunk, and with `stream_options.include_usage` a final chunk with `choices: []` and the usage.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from engine.messages import TokenLogprob
from server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
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
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from server.reasoning import ReasoningParser, Split, parser_kind
from server.tools import ToolPlan

if TYPE_CHECKING:
    from server.choices import EngineRequest
    from server.state import ServerState
    from server.tool_parsers import ToolCallDelta


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

    # ---- shared pieces
    def choice_index(self, r: EngineRequest, index: int) -> int:
        return r.prompt_index * self.n + index

    def usage(self) -> UsageInfo:
        prompt = sum(len(r.prompt_ids) for r in self.requests)
        completion = sum(c.completion_tokens for r in self.requests for c in r.choices)
        return UsageInfo.of(prompt, completion, sum(r.cached_tokens for r in self.requests))

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.state.tokenizer
            assert tok is not None
            text = self._token_text[token_id] = tok.decode([token_id], skip_special_tokens=False)
        return text

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[TokenLogprob]) -> None:
        i = self.choice_index(r, index)
        self.texts[i] = self.texts.get(i, "") + text

    # ---- API specific
    def response(self) -> dict: ...
    def stream_start(self) -> list[Any]: ...
    def stream_delta(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[TokenLogprob]) -> list[Any]: ...

    def stream_end(self) -> list[Any]:
        return [self.chunk([], usage=self.usage())] if self.body.include_usage else []

    def chunk(self, choices: list[Any], **extra: Any) -> Any: ...


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
        self.reasoners: dict[int, ReasoningParser] = {}
        self.split: dict[int, Split] = {}
        self.reasoning_tokens: dict[int, int] = {}

    def reason(self, i: int, text: str, ids: list[int], final: bool) -> Split:
        """Choice i's new text split into reasoning and answer (all answer without a reasoning parser)."""
        if self.reasoning_kind == "none":
            return Split("", text)
        parser = self.reasoners.get(i)
        if parser is None:
            parser = self.reasoners[i] = ReasoningParser(self.reasoning_kind)
        if parser.in_reasoning:
            self.reasoning_tokens[i] = self.reasoning_tokens.get(i, 0) + len(ids)
        out = parser.feed(text)
        if final:
            tail = parser.finish()
            out = Split(out.reasoning + tail.reasoning, out.content + tail.content)
        return out

    def add(self, r: EngineRequest, index: int, text: str, ids: list[int], lps: list[TokenLogprob]) -> None:
        super().add(r, index, text, ids, lps)
        i = self.choice_index(r, index)
        part = self.reason(i, text, ids, r.choices[index].finish_reason is not None)
        whole = self.split.setdefault(i, Split())
        whole.reasoning += part.reasoning
        whole.content += part.content

    def usage(self) -> UsageInfo:
        usage = super().usage()
        if self.reasoning_kind == "none":
            return usage
        prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, None
        if usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens
        return UsageInfo.of(prompt, completion, cached, reasoning_tokens=sum(self.reasoning_tokens.values()))

    def finish_reason(self, reason: str | None, parser: Any) -> str | None:
        return "tool_calls" if reason == "stop" and parser is not None and parser.tool_calls else reason

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatChoiceLogprobs | None:
        if not self.body.logprobs:
            return None
        content = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            top = [TopLogprob(token=self.token_text(t), logprob=v, bytes=list(self.token_text(t).encode()))
                   for t, v in lp.top]
            content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def message(self, split: Split) -> tuple[ChatResponseMessage, Any]:
        """The whole message of a choice: its reasoning apart, its answer through a fresh tool-call parser
        when tools are in play."""
        reasoning = split.reasoning or None
        if self.tools.new_parser is None:
            return ChatResponseMessage(content=split.content, reasoning_content=reasoning), None
        parser = self.tools.new_parser()
        content, _ = parser.feed(split.content)
        content += parser.finish()[0]
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in parser.tool_calls]
        return ChatResponseMessage(content=content or (None if calls else ""), reasoning_content=reasoning,
                                   tool_calls=calls or None), parser

    def response(self) -> dict:
        ids = self.body.return_token_ids
        for i, reasoner in self.reasoners.items():  # text held back at the end (a cut-off tag) is released
            tail, whole = reasoner.finish(), self.split.setdefault(i, Split())
            whole.reasoning += tail.reasoning
            whole.content += tail.content
        choices = []
        for r in self.requests:
            for i, c in enumerate(r.choices):
                message, parser = self.message(self.split.get(self.choice_index(r, i), Split()))
                choices.append(ChatCompletionChoice(
                    index=self.choice_index(r, i), message=message, logprobs=self.chat_logprobs(c.logprobs),
                    finish_reason=self.finish_reason(c.finish_reason, parser), token_ids=c.token_ids if ids else None,
                ))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.state.model_name, choices=choices, usage=self.usage(),
            prompt_token_ids=self.requests[0].prompt_ids if ids else None,
        ).model_dump()

    def chunk(self, choices: list[Any], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name, choices=choices, **extra)

    def stream_start(self) -> list[Any]:
        first = [ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(len(self.requests) * self.n)]
        ids = self.requests[0].prompt_ids if self.body.return_token_ids else None
        return [self.chunk(first, prompt_token_ids=ids)]

    def stream_delta(self, r, index, text, ids, lps):
        choice = r.choices[index]
        i = self.choice_index(r, index)
        out = []
        part = self.reason(i, text, ids, choice.finish_reason is not None)
        text, reasoning = part.content, part.reasoning or None
        parser, calls = None, None
        if self.tools.new_parser is not None:
            if i not in self.parsers:
                self.parsers[i] = self.tools.new_parser()
            parser = self.parsers[i]
            text, deltas = parser.feed(text)
            if choice.finish_reason is not None:
                tail, more = parser.finish()
                text, deltas = text + tail, deltas + more
            calls = [_delta_tool_call(d) for d in deltas] or None
        if text or reasoning or calls or (self.body.return_token_ids and ids) or (self.body.logprobs and lps):
            out.append(self.chunk([ChatCompletionChunkChoice(
                index=i, delta=DeltaMessage(content=text if text or not (calls or reasoning) else None,
                                            reasoning_content=reasoning, tool_calls=calls),
                logprobs=self.chat_logprobs(lps), token_ids=ids if self.body.return_token_ids else None,
            )]))
        if choice.finish_reason is not None:
            out.append(self.chunk([ChatCompletionChunkChoice(
                index=i, delta=DeltaMessage(), finish_reason=self.finish_reason(choice.finish_reason, parser))]))
        return out


def _delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    first = d.id is not None
    return DeltaToolCall(index=d.index, id=d.id, type="function" if first else None,
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))


class CompletionSerializer(Serializer):
    prefix = "cmpl"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        body: CompletionRequest = self.body
        self.echo = bool(body.echo)
        self.offsets: dict[int, int] = {}
        self.prompt_first_token: dict[int, str] = {}

    def completion_logprobs(self, i: int, lps: list[TokenLogprob | None]) -> CompletionLogprobs | None:
        """The legacy parallel lists for these tokens; `None` entries are an echoed prompt's first token."""
        if self.body.logprobs is None:
            return None
        out = CompletionLogprobs()
        offset = self.offsets.get(i, 0)
        for lp in lps:
            if lp is None:  # nothing predicts the first prompt token
                first = self.prompt_first_token.get(i, "")
                out.tokens.append(first)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.text_offset.append(offset)
                offset += len(first)
                continue
            text = self.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top} if self.body.logprobs else None)
            out.text_offset.append(offset)
            offset += len(text)
        self.offsets[i] = offset
        return out

    def echoed_logprobs(self, r: EngineRequest) -> list[TokenLogprob | None]:
        """Prompt token logprobs to put first, when echoing with logprobs."""
        if not (self.echo and self.body.logprobs is not None and r.prompt_logprobs):
            return []
        for k in range(self.n):
            self.prompt_first_token[self.choice_index(r, k)] = self.token_text(r.prompt_ids[0])
        return list(r.prompt_logprobs)

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
                    logprobs=self.completion_logprobs(i, self.echoed_logprobs(r) + c.logprobs),
                    finish_reason=c.finish_reason,
                    token_ids=c.token_ids if ids else None, prompt_token_ids=r.prompt_ids if ids else None,
                ))
        return CompletionResponse(
            id=self.id, created=self.created, model=self.state.model_name, choices=choices, usage=self.usage(),
            prompt_token_ids=self.requests[0].prompt_ids if ids and len(self.requests) == 1 else None,
        ).model_dump()

    def chunk(self, choices: list[Any], **extra: Any) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.state.model_name, choices=choices, **extra)

    def stream_start(self) -> list[Any]:
        if not self.echo and not self.body.return_token_ids:
            return []
        return [self.chunk([
            CompletionChoice(index=self.choice_index(r, k), text=self.prompt_text(r),
                             logprobs=self.completion_logprobs(self.choice_index(r, k), self.echoed_logprobs(r))
                             if self.echo else None,
                             prompt_token_ids=r.prompt_ids if self.body.return_token_ids else None)
            for r in self.requests for k in range(self.n)
        ])]

    def stream_delta(self, r, index, text, ids, lps):
        choice = r.choices[index]
        i = self.choice_index(r, index)
        if not (text or choice.finish_reason or (self.body.return_token_ids and ids) or
                (self.body.logprobs is not None and lps)):
            return []
        return [self.chunk([CompletionChoice(
            index=i, text=text, logprobs=self.completion_logprobs(i, lps), finish_reason=choice.finish_reason,
            token_ids=ids if self.body.return_token_ids else None,
        )])]
