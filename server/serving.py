"""`/v1/chat/completions` and `/v1/completions`: from a validated body to engine requests and back;
`/v1/responses`, which is a chat completions request in another shape (`server.responses_api` converts
the request, `ResponsesSerializer` the answer); and vLLM's `/tokenize` and `/detokenize`, which share
their prompt building.

Per request: check the model name and availability -> build the prompt ids (chat template, or the
completions prompt(s)) -> sampling parameters (the fields a body leaves out take the model's defaults,
`server.generation_defaults`) -> check the context -> one engine request per prompt (each with n
completions) -> per completion a `ChoiceText` turns token-id deltas into text deltas (incremental
detokenizer, then stop strings, both holding back what may still change) -> one serializer per API
shape emits either one JSON response or SSE chunks.

With several engine replicas (`--dp`), the response header `x-mlaserve-replica` names the replica that
served each prompt (comma-separated, in prompt order); the body is the same as with one.

A choice that hits a stop string ends there ("stop"); when every choice of an engine request has
ended, the request is aborted in the engine so its KV is freed at once. A client that disconnects
(stream or not) closes the engine stream, which aborts the request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.messages import (
    ERR_CONTEXT,
    context_message,
    ERR_ENGINE,
    ERR_OVERLOADED,
    ERR_SHUTDOWN,
    FINISH_ERROR,
    GenerateRequest,
    RequestOutput,
)
from models.loader.tokenizer import TokenizerBundle
from server.chat_template import ChatTemplateError, loops_over_content, render_messages
from server.choices import ChoiceText, EngineRequest
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.protocol import (
    ChatCompletionRequest,
    ChatInput,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    NOT_READ_AS_JSON,
    SEND_JSON,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    checked_sampling_params,
    describe_validation_error,
    error_body,
)
from server import messages_api
from server.messages_api import MessagesRequest
from server.metrics import note_answer_code
from server.responses import ChatSerializer, CompletionSerializer, MessagesSerializer, ResponsesSerializer, Serializer
from server.responses_api import InputTokens, ResponsesRequest, rename_error, to_chat_request
from server.state import ClientError, ServerState, error_response
from server.structured import EXTENSION_FIELDS
from server.reasoning import THINK_CLOSE, parser_kind, starts_in_reasoning
from server.tools import ToolPlan, plan_tools, with_call_markup, with_system
from scheduler.sampling_params import ParamError, SamplingParams, validate_prompt_ids, validate_token_ids


REPLICA_HEADER = "x-mlaserve-replica"


def prompt_param(body: Any) -> str:
    """The request field that holds the prompt, for errors about it."""
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def engine_error(out: RequestOutput, prompt_field: str) -> ClientError:
    """Maps an engine refusal or failure to its HTTP error (`prompt_field`: the request's prompt field)."""
    if out.error_code == ERR_OVERLOADED:
        return ClientError(503, out.error or "overloaded", code="overloaded", type_="service_unavailable",
                           headers={"Retry-After": "1"})
    if out.error_code == ERR_CONTEXT:
        return ClientError(400, out.error or "context length exceeded", prompt_field, "context_length_exceeded")
    if out.error_code == ERR_SHUTDOWN:
        return ClientError(503, out.error or "the server is shutting down", code="shutting_down",
                           type_="service_unavailable", headers={"Retry-After": "5"})
    if out.error_code == ERR_ENGINE:
        return ClientError(503, out.error or "the engine failed", code="engine_error", type_="service_unavailable",
                           headers={"Retry-After": "30"})
    # ERR_INVALID and the like: a 400 without a code, as the server's own validation answers
    return ClientError(400, out.error or "invalid request", out.error_param)


def register_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat(raw: Request, body: ChatCompletionRequest) -> Response:
        note_ignored_fields(body)
        return await counted(raw, state, body, ChatSerializer)

    @app.post("/v1/completions")
    async def completions(raw: Request, body: CompletionRequest) -> Response:
        note_ignored_fields(body)
        return await counted(raw, state, body, CompletionSerializer)

    @app.post("/v1/responses")
    async def responses(raw: Request, body: ResponsesRequest) -> Response:
        note_ignored_fields(body)
        return state.unavailable() or await _responses(raw, state, body)

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(body: ResponsesRequest) -> Response:
        note_ignored_fields(body)
        return state.unavailable() or await _answer(lambda: _input_tokens(state, body))

    # the routes of stored responses: nothing is stored here, which the answer says (a bare 404 read as a wrong URL)
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        if response_id == "input_tokens":  # (the counting route's path, with another method)
            return error_response(405, "method not allowed for this route: use POST", code="method_not_allowed",
                                  headers={"Allow": "POST"})
        return _not_stored(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return _not_stored(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str) -> Response:
        return _not_stored(response_id)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        return anthropic_error(state.unavailable() or await _messages(raw, state))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request) -> Response:
        return anthropic_error(state.unavailable() or await _answer(lambda: _count_tokens(state, raw)))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return state.unavailable() or await _answer(lambda: _tokenize(state, raw))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        note_ignored_fields(body)
        return state.unavailable() or await _answer(lambda: _detokenize(state, body))


async def _responses(raw: Request, state: ServerState, body: ResponsesRequest) -> Response:
    """The Responses API: the request as a chat completions request, served by the chat path with the
    Responses serializer; errors the chat path raises come back in this API's field names."""
    try:
        check_model(state, body.model)
        chat = to_chat_request(body)
        if body.truncation == "auto":  # (renders the conversation a few times: off the event loop)
            chat = await asyncio.to_thread(_fitted, state, chat)
    except ClientError as e:
        return e.response()
    except ParamError as e:
        return ClientError.bad_param(e).response()
    resp = await counted(raw, state, chat, functools.partial(ResponsesSerializer, request=body))
    if not isinstance(resp, JSONResponse) or resp.status_code < 400:
        return resp
    error, headers = _error_of(resp)
    message, param = rename_error(str(error.get("message", "")), error.get("param"))
    return error_response(resp.status_code, message, str(error.get("type", "invalid_request_error")), param,
                          error.get("code"), headers)


def _not_stored(response_id: str) -> Response:
    return error_response(404, f"no response {response_id[:80]!r} is stored: this server stores no responses (each "
                          "says store: false), so they cannot be retrieved, listed, cancelled or deleted; send the "
                          "whole conversation as input instead", "invalid_request_error", None, "not_found")


async def _input_tokens(state: ServerState, body: ResponsesRequest) -> InputTokens:
    """OpenAI's input token count: the prompt tokens of the same request to `/v1/responses` (after
    `truncation: "auto"` where it asks for it)."""
    check_model(state, body.model)
    chat = to_chat_request(body)
    if body.truncation == "auto":
        chat = await asyncio.to_thread(_fitted, state, chat)
    prompts, _ = await asyncio.to_thread(build_prompts, state, chat)
    return InputTokens(input_tokens=len(prompts[0][0]))


def _fitted(state: ServerState, chat: ChatCompletionRequest) -> ChatCompletionRequest:
    """The Responses API's `truncation: "auto"`: a conversation longer than the context (with room for
    `max_output_tokens`, or one token) loses its oldest turns, as OpenAI's drops items from its start, until
    it fits. It is cut before a user message (a template may want the conversation to start with one, and a
    cut there leaves no tool result without its call); leading system messages (`instructions`) stay. The
    shortest cut that fits is found by bisection, a render each try; where none fits, the last user turn on
    is kept and the chat path says the context is exceeded."""
    tok = state.tokenizer
    assert tok is not None
    need = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    room = state.context_length - (1 if need is None else need)
    messages = chat.messages
    head = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    cuts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]

    def cut(at: int) -> ChatCompletionRequest:
        return chat.model_copy(update={"messages": messages[:head] + messages[at:]})

    def fits(req: ChatCompletionRequest) -> bool:
        text, _ = chat_prompt(state, req)
        return len(tok.encode(text, add_special_tokens=False)) <= room

    if not cuts or fits(chat):
        return chat
    lo, hi = 0, len(cuts) - 1  # the first cut that fits is in cuts[lo..hi], or none does (then the last)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cut(cuts[mid])):
            hi = mid
        else:
            lo = mid + 1
    return cut(cuts[lo])


async def _messages(raw: Request, state: ServerState) -> Response:
    """Anthropic's Messages API: the request as a chat completions request, served by the chat path with
    the Messages serializer."""
    try:
        body = await _json_body(raw, lambda _: MessagesRequest)
        check_model(state, body.model)
        _no_thread(body)
        chat = messages_api.to_chat_request(body)
    except ClientError as e:
        return e.response()
    except ParamError as e:
        return ClientError.bad_param(e).response()
    return await counted(raw, state, chat, MessagesSerializer)


async def _count_tokens(state: ServerState, raw: Request) -> messages_api.TokenCount:
    """Anthropic's token count: the prompt tokens the same request to `/v1/messages` would have."""
    body = await _json_body(raw, lambda _: messages_api.CountTokensRequest)
    check_model(state, body.model)
    _no_thread(body)
    try:
        chat = messages_api.to_chat_request(body)
        prompts, _ = await asyncio.to_thread(build_prompts, state, chat)
    except ParamError as e:
        raise ClientError.bad_param(e) from None
    return messages_api.TokenCount(input_tokens=len(prompts[0][0]))


def _no_thread(body: MessagesRequest) -> None:
    """A request continuing or starting a server-held thread is refused: its messages alone are not the
    conversation (a continue sends only the new turn), which answered without it."""
    if body.thread is not None:
        raise ClientError(400, messages_api.THREAD_MESSAGE, "thread", messages_api.THREAD_UNSUPPORTED)


def anthropic_error(resp: Response) -> Response:
    """An error answer in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, the chat
    path's field names as the Messages API's), counted in the metrics by its OpenAI code as the other
    routes' errors are; other answers as they are. The middlewares' errors (401, 413, ...) on the
    Messages routes go through here too."""
    if not isinstance(resp, JSONResponse) or resp.status_code < 400:
        return resp
    error, headers = _error_of(resp)
    note_answer_code(str(error.get("code") or error.get("type") or "other"))
    message, param = messages_api.rename_error(str(error.get("message", "")), error.get("param"))
    if (anthropic_words := messages_api.context_error(message)) is not None:
        message = anthropic_words
    elif param and param not in message:
        message = f"{param}: {message}"
    status = 529 if error.get("code") == "overloaded" else resp.status_code  # Anthropic's overload status
    return JSONResponse(messages_api.error_body(resp.status_code, message, error.get("code")),
                        status_code=status, headers=headers)


def _error_of(resp: JSONResponse) -> tuple[dict[str, Any], dict[str, str]]:
    """An OpenAI-shaped error answer's `error` object and the headers another shape of it keeps (its
    own, but the body's length and type)."""
    error = json.loads(bytes(resp.body)).get("error") or {}
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
    return error, headers


async def _answer(work: Callable[[], Awaitable[BaseModel]]) -> Response:
    """`work`'s response as JSON, or the OpenAI-shaped error it raised."""
    try:
        return JSONResponse((await work()).model_dump())
    except ClientError as e:
        return e.response()
    except ParamError as e:
        return ClientError.bad_param(e).response()


async def _tokenize(state: ServerState, raw: Request) -> TokenizeResponse:
    """vLLM's `/tokenize`: a prompt encoded as the completions API encodes it, or messages rendered and
    encoded as the chat completions API does (`chat_prompt`), and the context length."""
    body = await _json_body(raw, _tokenize_request_model)
    check_model(state, body.model)
    tok = state.tokenizer
    assert tok is not None
    text = chat_prompt(state, body)[0] if isinstance(body, TokenizeChatRequest) \
        else body.prompt
    ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=body.add_special_tokens)  # (see handle)
    strs = [tok.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.context_length, tokens=ids, token_strs=strs)


def _tokenize_request_model(data: dict) -> type[BaseModel]:
    if "messages" in data and "prompt" in data:
        raise ClientError(400, "give either prompt or messages, not both", "messages")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


async def _detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    """vLLM's `/detokenize`: the text of token ids (special tokens included, as vLLM decodes them)."""
    check_model(state, body.model)
    validate_token_ids(body.tokens, state.vocab_size, "tokens")
    assert state.tokenizer is not None
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, skip_special_tokens=False))


def _sent_as_json(content_type: str | None) -> bool:
    """FastAPI's rule for a JSON body (its strict_content_type, on by default): application/json or
    application/*+json; a body with no Content-Type is not read either."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _json_body(raw: Request, model_for: Callable[[dict], type[BaseModel]]) -> Any:
    """The body as the request model `model_for` picks for its JSON object; ClientError (400, naming the
    field as every route's validation errors do) otherwise."""
    content = await raw.body()
    if not content:  # (as the routes FastAPI reads say it)
        raise ClientError(400, f"the request body is empty: {SEND_JSON}")
    # a body of another declared type is not read, as the routes FastAPI reads refuse it (`_sent_as_json`)
    if not _sent_as_json(raw.headers.get("content-type")):
        raise ClientError(400, NOT_READ_AS_JSON)
    # the stdlib's parser, not pydantic's from_json, which refuses a lone surrogate before validation can
    # name its field; the stdlib's recurses per nesting level
    try:
        data = json.loads(content)
    except ValueError as e:
        raise ClientError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ClientError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ClientError(400, "the body must be a JSON object")
    model = model_for(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_error(e.errors())
        raise ClientError(400, message, param) from None
    note_ignored_fields(body)
    return body


log = logging.getLogger("mlaserve.server")
_IGNORED_SEEN: set[tuple[str, tuple[str, ...]]] = set()  # (model, field names) already warned of


def note_ignored_fields(body: BaseModel) -> None:
    """Logs the top-level fields a request body sent that this server does not know (they are ignored, as
    vLLM ignores them, so that clients sending fields of newer API versions keep working), so that a typo
    (`stop_sequence`, chat's `frequency_penalty` on the Responses API) is seen: a warning the first time a route's model
    gets that set of names, debug after. Names only, cut short: never values."""
    ignored = getattr(body, "unread_fields", ())
    if not ignored:
        return
    model = type(body)
    names = tuple(sorted(k[:40] for k in ignored)[:10])
    key = (model.__name__, names)
    first = key not in _IGNORED_SEEN
    if first and len(_IGNORED_SEEN) < 1024:
        _IGNORED_SEEN.add(key)
    log.log(logging.WARNING if first else logging.DEBUG,
            "a request (%s) sent fields this server does not read, ignored: %s%s", model.__name__,
            ", ".join(map(repr, names)), " ..." if len(ignored) > len(names) else "")


async def counted(raw: Request, state: ServerState, body: Any, serializer_cls: Callable[..., Serializer]) -> Response:
    """`handle`, counted in `state.inflight` until the answer is complete (for streams: sent)."""
    unavailable = state.unavailable()
    if unavailable is not None:
        return unavailable
    state.inflight += 1
    streaming = False
    try:
        resp = await handle(raw, state, body, serializer_cls)
        if isinstance(resp, ClosingStream):
            streaming = True

            async def sent() -> None:
                state.inflight -= 1

            resp.cleanups.append(sent)
        return resp
    finally:
        if not streaming:
            state.inflight -= 1


# an SSE comment: every event parser skips it (the OpenAI and Anthropic SDKs' too), on every API's stream; an
# Anthropic `ping` event would come before `message_start` on a stream still queued, where Anthropic's never does
KEEPALIVE = b": keep-alive\n\n"


class ClosingStream(StreamingResponse):
    """A stream whose `cleanups` run once Starlette is done with it, however that ended. A client gone
    before the first part is sent has Starlette cancel the sending task before it starts the body, and
    a generator never started runs no `finally`: the engine work it would abort ran on (until the
    garbage collector closed its streams) and the request stayed counted in flight."""

    def __init__(self, content: AsyncIterator[str], cleanups: list[Callable[[], Awaitable[None]]],
                 keepalive: float = 0.0, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.cleanups = cleanups
        self.keepalive = keepalive  # seconds without a send after which KEEPALIVE goes; 0: never

    async def stream_response(self, send: Any) -> None:
        """Starlette's, with a keep-alive event after each `keepalive` seconds in which nothing was sent: a
        queued stream or one in a long prefill sends nothing for a while, and proxies (nginx's 60 s
        proxy_read_timeout) and clients with read timeouts would cut it. The event goes from a timer task, so
        the stream's own events pay a lock, not a timer each."""
        seconds = self.keepalive
        if not 0 < seconds < math.inf:
            return await super().stream_response(send)
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()
        last, ended = loop.time(), False
        body = {"type": "http.response.body", "body": KEEPALIVE, "more_body": True}

        async def sending(message: Any) -> None:
            nonlocal last, ended
            async with lock:
                await send(message)
                last, ended = loop.time(), message.get("more_body") is False

        async def keep_alive() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(max(last + seconds - loop.time(), 0.0))
                async with lock:
                    if ended:
                        return
                    if loop.time() - last >= seconds:
                        await send(body)
                        last = loop.time()

        ticker = asyncio.ensure_future(keep_alive())
        try:
            await super().stream_response(sending)
        finally:
            ticker.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(ticker, return_exceptions=True)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # a disconnect cancels us: the cleanups still run
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                for cleanup in self.cleanups:
                    await cleanup()


async def handle(raw: Request, state: ServerState, body: Any, serializer_cls: Callable[..., Serializer]) -> Response:
    arrived = time.time()  # the request's arrival for its latency metrics: its template and tokenizing count
    try:
        if not _asks_structured(body):  # (its checks are cheap: a full server's refusal waits for no thread)
            _refuse_if_full(state, body)
        # on a worker thread: a prompt of a megabyte takes about half a second to encode (the tokenizer lets
        # go of the GIL), which on the event loop would stall every stream and /health for that long
        prompts, tools, params = await asyncio.to_thread(_prepared, state, body)
        requests = start_requests(state, body, prompts, tools, params, arrived)
    except ClientError as e:
        return e.response()
    except ParamError as e:
        return ClientError.bad_param(e).response()
    ser = serializer_cls(state, body, prompts, requests, tools)
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        # wait for the prompts' first outputs: engine refusals arrive first and become HTTP errors. A stream's
        # first output is its admission (the engine's checks passed, its grammar compiled), which comes at
        # once for every prompt, queued or not: its headers go then, not after a long prefill or a queue,
        # where a client or proxy waiting for the first bytes would give up
        firsts = await _race(watch, asyncio.gather(*(anext(r.stream, None) for r in requests),
                                                   return_exceptions=True))
        if firsts is None:  # the client left before the first output
            await _close_all(requests)
            for r in requests:
                state.metrics.on_abort(r.rid, len(r.choices))
            return Response(status_code=499)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:  # (every first output awaited: the streams can be closed)
            await _close_all(requests)
            raise failed
        for r, f in zip(requests, firsts):  # (what a stream's first event tells: Anthropic's message_start usage)
            if f is None:
                continue
            if f.prompt_logprobs:
                r.prompt_logprobs = f.prompt_logprobs
            if f.index == 0 and f.cached_tokens:
                r.cached_tokens = f.cached_tokens
        replicas = _replica_header(state, requests)  # (read while every stream is open)
        refused = next((f for f in firsts if f is not None and f.finish_reason == FINISH_ERROR), None)
        if refused is not None:
            await _close_all(requests)
            state.metrics.on_error(refused.error_code or "engine_error")
            resp = engine_error(refused, prompt_param(body)).response()
            resp.headers.update(replicas)
            return resp
        if body.stream:  # from here Starlette notices disconnects and cancels the stream
            watch.cancel()
            return ClosingStream(_sse(ser, _events(state, requests, firsts, prompt_param(body))),
                                 [functools.partial(_close_all, requests)], state.stream_keepalive,
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **replicas})
        result = await _race(watch, _collect(ser, _events(state, requests, firsts, prompt_param(body))))
        if result is None:
            return Response(status_code=499)
        result.headers.update(replicas)
        return result
    finally:
        watch.cancel()


First = RequestOutput | None  # a prompt's first output; None: its stream ended


def _replica_header(state: ServerState, requests: list[EngineRequest]) -> dict[str, str]:
    """`x-mlaserve-replica` with several replicas (which one served each prompt), else nothing."""
    engine = state.engine
    if engine is None or engine.size == 1:
        return {}
    return {REPLICA_HEADER: ",".join(str(engine.replica_of(r.rid)) for r in requests)}


def check_model(state: ServerState, model: str | None) -> None:
    """A request's `model`, if it names one, must be the served model's id (404 otherwise)."""
    if model and model != state.model_name:
        raise ClientError(404, f"the model '{model}' does not exist", "model", "model_not_found")


def chat_prompt(state: ServerState, body: ChatInput) -> tuple[str, ToolPlan]:
    """The prompt text of chat messages (the chat template's rendering, with the tools as the tool plan
    puts them; cut after the final message's text where it is continued) and the plan: what chat
    completions and `/tokenize` both render. ParamError for tools that cannot work; a 400 naming
    `messages` for a template that refuses them (`chat_template_kwargs` where they made it fail)."""
    tok = state.tokenizer
    assert tok is not None
    template = tok.chat_template_for(tools=bool(body.tools) and body.tool_choice != "none")
    plan = tool_plan(state, body, template)
    messages = with_call_markup(body.openai_messages(parts=bool(template) and loops_over_content(template)), template,
                                state.tool_call_parser)
    if plan.system:
        messages = with_system(messages, plan.system, template)
    extra: dict[str, Any] = dict(body.chat_template_kwargs or {})  # (none of the names set here: protocol)
    if body.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", body.reasoning_effort)
    if plan.tools:
        extra["tools"] = _deep_sorted(plan.tools) if tok.sorted_tools else plan.tools
    elif body.tools == [] and body.tool_choice != "none":  # sent empty: [] as transformers and vLLM hand it
        extra["tools"] = []
    if body.documents is not None:
        extra["documents"] = body.documents
    render = functools.partial(render_messages, template, messages, add_generation_prompt=body.generation_prompt(),
                               continue_final_message=body.continued_text() is not None, **tok.template_tokens())
    try:
        text = render(**extra)
    except ChatTemplateError as e:
        raise ClientError(400, str(e), _template_fault(render, extra, body.chat_template_kwargs)) from None
    return text, plan


def _deep_sorted(value: Any) -> Any:
    """`value` with every object's keys in order, as Kimi-K2's tokenizer hands its template the tools."""
    if isinstance(value, dict):
        return {k: _deep_sorted(v) for k, v in sorted(value.items())}
    return [_deep_sorted(v) for v in value] if isinstance(value, list) else value


def tool_plan(state: ServerState, body: ChatInput, template: str | None = None) -> ToolPlan:
    """The request's tool plan under the template its prompt is rendered with (`template`, or the one the
    tokenizer picks for it): ParamError for tools, a tool_choice or a history of calls that cannot work."""
    if template is None:
        tok = state.tokenizer
        assert tok is not None
        template = tok.chat_template_for(tools=bool(body.tools) and body.tool_choice != "none")
    return plan_tools(body, template, state.tool_call_parser)


def _template_fault(render: Callable[..., str], extra: dict[str, Any], kwargs: dict[str, Any] | None) -> str:
    """The field a template that failed to render blames: `chat_template_kwargs` where it renders without
    them (a variable of the wrong type, say), else `messages`."""
    if kwargs:
        try:
            render(**{k: v for k, v in extra.items() if k not in kwargs})
        except ChatTemplateError:
            return "messages"
        return "chat_template_kwargs"
    return "messages"


def build_prompts(state: ServerState, body: Any) -> tuple[list[tuple[list[int], str]], ToolPlan]:
    """(ids, text) per prompt, and the tool plan; chat renders its template (with the tools), completions
    take strings or ids. ParamError for tools that cannot work."""
    check_model(state, body.model)
    tok = state.tokenizer
    assert tok is not None
    if isinstance(body, ChatCompletionRequest):
        text, plan = chat_prompt(state, body)
        return _truncated(state, body, [(tok.encode(text, add_special_tokens=body.add_special_tokens), text)]), plan
    out = []
    fim = fim_suffix(tok, body.suffix, bool(body.echo))
    for p in body.prompts():
        if isinstance(p, str):  # (a FIM prompt's text is text: llama.cpp's /infill parses no special tokens)
            ids = tok.encode(p, add_special_tokens=body.add_special_tokens and fim is None, parse_special=fim is None)
        else:
            try:
                validate_prompt_ids(p, state.vocab_size, "prompt")
            except ParamError as e:
                raise ClientError.bad_param(e) from None
            ids = list(p)
        if fim is not None:
            bos = isinstance(p, str) and body.add_special_tokens
            ids = fim_prompt(tok, _fim_prefix(state, body, ids, fim, bos), fim, bos)
            out.append((ids, tok.decode(ids, skip_special_tokens=False)))
        else:
            out.append((ids, p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)))
    return (out if fim is not None else _truncated(state, body, out)), ToolPlan()


def _fim_prefix(state: ServerState, body: Any, prefix: list[int], suffix: list[int], bos: bool) -> list[int]:
    """The prefix's ids under `truncate_prompt_tokens`: its last ones, so that with the rest of the FIM prompt
    (its tokens and the suffix) it fits, as llama.cpp's /infill cuts the prefix (the whole prompt's last
    tokens would cut the FIM tokens off its start). A 400 where the rest alone does not fit."""
    k = getattr(body, "truncate_prompt_tokens", None)
    if k is None:
        return prefix
    k = _truncation(state, k)
    assert state.tokenizer is not None
    rest = len(fim_prompt(state.tokenizer, [], suffix, bos))
    if rest > k:
        raise ClientError(400, f"truncate_prompt_tokens ({k}) leaves no room for the suffix: the fill-in-the-middle "
                          f"prompt holds {rest} tokens without the prompt; send a shorter suffix or a larger value",
                          "truncate_prompt_tokens")
    return prefix[len(prefix) - (k - rest):] if len(prefix) + rest > k else prefix


def fim_suffix(tok: TokenizerBundle, suffix: str | None, echo: bool = False) -> list[int] | None:
    """The ids of a completions `suffix` where the prompt is to be written for fill-in-the-middle, else None
    (no suffix, or an empty one on a model without FIM tokens, which asks for nothing). A 400 for a suffix the
    model cannot fill in before, and for one with `echo` (OpenAI refuses the pair)."""
    if suffix is None or not suffix and tok.fim_ids is None:
        return None
    if tok.fim_ids is None:
        raise ClientError(400, "suffix (fill-in-the-middle) needs a model with fill-in-the-middle tokens (a prefix, "
                          "suffix and middle token, as code models have); this model's tokenizer has none: put the "
                          "text in the prompt instead", "suffix")
    if echo:
        raise ClientError(400, "echo is not supported with suffix: the prompt is written around the insertion with "
                          "fill-in-the-middle tokens; leave one of them out", "suffix")
    return tok.encode(suffix, add_special_tokens=False, parse_special=False)


def fim_prompt(tok: TokenizerBundle, prefix: list[int], suffix: list[int], bos: bool) -> list[int]:
    """The prefix-suffix-middle prompt llama.cpp's /infill writes (without its repository context): BOS where
    the model wants one (`bos`: a text prompt, not ids), the FIM prefix token, the prompt's ids, the FIM suffix
    token, the suffix's ids, the FIM middle token; what the model writes next is the middle."""
    assert tok.fim_ids is not None
    pre, suf, mid = tok.fim_ids
    first = [tok.bos_token_id] if bos and tok.add_bos_token and tok.bos_token_id is not None else []
    return [*first, pre, *prefix, suf, *suffix, mid]


def _truncated(state: ServerState, body: Any, prompts: list[tuple[list[int], str]]) -> list[tuple[list[int], str]]:
    """vLLM's truncate_prompt_tokens: each prompt's last k tokens (k = -1: the context length), its text
    the text of those tokens."""
    k = getattr(body, "truncate_prompt_tokens", None)
    if k is None:
        return prompts
    k = _truncation(state, k)
    tok = state.tokenizer
    assert tok is not None
    return [(ids, text) if len(ids) <= k else (ids[-k:], tok.decode(ids[-k:], skip_special_tokens=False))
            for ids, text in prompts]


def _truncation(state: ServerState, k: int) -> int:
    """The tokens `truncate_prompt_tokens` keeps (-1: the context length); a 400 past the context length."""
    if k > state.context_length:  # (vLLM refuses it too: no prompt that long can be served)
        raise ClientError(400, f"truncate_prompt_tokens ({k}) is larger than this model's context length "
                          f"({state.context_length} tokens); send at most that, or -1 for the context length",
                          "truncate_prompt_tokens")
    return state.context_length if k == -1 else k


def bad_words_ids(state: ServerState, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, as vLLM takes them: the word as written and after a space (as it reads
    mid-sentence), each once. ParamError for an empty word."""
    tok = state.tokenizer
    assert tok is not None
    out: dict[tuple[int, ...], None] = {}
    for i, word in enumerate(words):
        if not word.strip():
            raise ParamError("bad_words", f"bad_words[{i}] is empty or blank: list words to keep out")
        for text in (word, " " + word.lstrip()):
            ids = tuple(tok.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def prediction_ids(state: ServerState, text: str) -> tuple[int, ...]:
    """A predicted output's tokens, as the reply would write them (no special tokens added), at most the
    context's length of them (a longer prediction could never be followed to its end)."""
    tok = state.tokenizer
    assert tok is not None
    return tuple(tok.encode(text, add_special_tokens=False)[: state.context_length])


def _prepared(state: ServerState, body: Any) -> tuple[list[tuple[list[int], str]], ToolPlan, SamplingParams]:
    """The prompts, tool plan and sampling parameters of a request: run on a worker thread, as encoding a long
    prompt and checking and rewriting a large schema (seconds for hundreds of kilobytes of `anyOf`) would stall
    every stream and /health on the event loop."""
    _refuse_if_full(state, body)
    prompts, tools = build_prompts(state, body)
    return prompts, tools, request_params(state, body, prompts, tools)


def _asks_structured(body: Any) -> bool:
    """Whether a request asks for a structured output or sends tools, whose schemas may take long to check
    (on a thread)."""
    rf = getattr(body, "response_format", None)
    return (rf is not None and rf.type != "text") or any(getattr(body, f, None) is not None
                                                         for f in ("tools", *EXTENSION_FIELDS))


def _refuse_if_full(state: ServerState, body: Any) -> None:
    """The engine's 503 `overloaded`, raised before the request is rendered and tokenized, when every replica
    holds as many completions as it admits (`EngineReplicas.overloaded`). Under a retry storm the refusals had
    waited their turn behind that work, seconds at the median, and the work took the admitted requests' CPU.
    A mistake retrying would not mend still gets its 404 or 400 first where it is known without rendering,
    tokenizing or compiling: a wrong model, a sampling parameter, token ids outside the vocabulary, tools, a
    tool_choice or a history of calls that cannot work. The others (a prompt or max_tokens past the context,
    whose message gives the prompt's length, a grammar that does not compile, ...) wait for room. Called
    on the event loop before the request's worker-thread turn (but for a structured output, whose checks
    may take long), and on that thread again (the server may have filled meanwhile)."""
    engine = state.engine
    if engine is None:
        return
    full = engine.overloaded(len(body.prompts()) * (body.n or 1) if isinstance(body, CompletionRequest) else (body.n or 1))
    if full is None:
        return
    check_model(state, body.model)
    try:
        params = checked_sampling_params(body, state.vocab_size, state.sampling_defaults)
        if isinstance(body, ChatCompletionRequest):
            tool_plan(state, body)  # (every tool's schema, a strict one's as it will hold it, and the history)
        else:
            for p in body.prompts():
                if not isinstance(p, str):
                    validate_prompt_ids(p, state.vocab_size, "prompt")
    except ParamError as e:
        raise ClientError.bad_param(e) from None
    raise engine_error(RequestOutput(rid="", index=0, new_token_ids=[], error=full, error_code=ERR_OVERLOADED), "")


def _special_markup(state: ServerState, markup: tuple[str, ...]) -> frozenset[int]:
    """The ids of the tool-call markup strings that are special tokens of the model's tokenizer."""
    tok = state.tokenizer
    assert tok is not None
    return frozenset(t for t in map(tok.tokenizer.token_to_id, markup) if t in tok.special_ids)


def request_params(state: ServerState, body: Any, prompts: list[tuple[list[int], str]],
                   tools: ToolPlan) -> SamplingParams:
    """The checked sampling parameters of a request's prompts, its structured output rewritten for the
    engine; ClientError otherwise."""
    try:
        params = checked_sampling_params(body, state.vocab_size, state.sampling_defaults)
        if getattr(body, "bad_words", None):
            # (their ids come from the tokenizer; the engine's SamplingParams.validate checks them again)
            params = msgspec.structs.replace(params, bad_words_ids=bad_words_ids(state, body.bad_words))
        if getattr(body, "prediction", None) is not None:
            params = msgspec.structs.replace(params, prediction=prediction_ids(state, body.prediction.text()))
        # a forced call is this turn's output; a response format (checked above all the same) is for the
        # turn that answers in text, as OpenAI takes both (the Agents SDK sends both). Under "auto" the text
        # may be the answer: a response format is kept, and strict tools' calls are not held then; nor where
        # the markup is special tokens, which a grammar never lets through (the model could not call at all)
        if tools.forced or (tools.structured is not None and params.structured is None and
                            not _special_markup(state, tools.markup)):
            params = msgspec.structs.replace(params, structured=tools.structured)
    except ParamError as e:
        raise ClientError.bad_param(e) from None
    tok = state.tokenizer
    assert tok is not None
    if params.structured is not None and isinstance(body, ChatCompletionRequest) and \
            starts_in_reasoning(parser_kind(state.reasoning_parser, tok.chat_template), prompts[0][1],
                                body.continued_text()):
        # the answer is constrained, not the reasoning: the grammar starts after </think>
        after = tuple(tok.encode(THINK_CLOSE, add_special_tokens=False))
        params = msgspec.structs.replace(params, structured=msgspec.structs.replace(params.structured, after=after))
    return params


def start_requests(state: ServerState, body: Any, prompts: list[tuple[list[int], str]], tools: ToolPlan,
                   params: SamplingParams, arrived: float | None = None) -> list[EngineRequest]:
    """The engine requests of a request's prompts (`arrived`: when it came, time.time(); now if None)."""
    engine, tok = state.engine, state.tokenizer
    assert engine is not None and tok is not None
    completions, capacity = len(prompts) * params.n, state.admission_capacity
    if capacity and len(prompts) > 1 and completions > capacity:  # one prompt: the engine says so (its param "n")
        raise ClientError(400, f"{len(prompts)} prompts x n={params.n} = {completions} completions can never be "
                          f"admitted: this server holds at most {capacity} at once (--max-running-requests + "
                          "--max-queued-requests); send fewer prompts per request", "prompt")
    requests = []
    base = uuid.uuid4().hex
    # the special tokens that are the tool-call parser's markup: kept in the text it reads (see below)
    keep = _special_markup(state, tools.markup) if tools.new_parser is not None else frozenset()
    for i, (ids, _) in enumerate(prompts):
        limit = state.context_length - len(ids)
        if limit < 0 or (limit == 0 and params.max_tokens != 0) or (params.max_tokens is not None and params.max_tokens > limit):
            asked = params.max_tokens if params.max_tokens is not None else 1
            raise ClientError(400, context_message(state.context_length, len(ids), asked), prompt_param(body),
                              "context_length_exceeded")
        p = params if params.max_tokens is not None else msgspec.structs.replace(params, max_tokens=limit)
        req = GenerateRequest(f"{base}-{i}", ids, p, time.time() if arrived is None else arrived,
                              report_admission=bool(body.stream))
        # a tool-call parser reads its markup, which may be special tokens (Llama's <|python_tag|>, Mistral's
        # [TOOL_CALLS]): those are kept in the text (the other special tokens are skipped as ever), and EOS
        # ids left out of it like stop ids
        parsing = tools.new_parser is not None
        specials = body.skip_special_tokens is False  # special tokens' text shows
        include = bool(body.include_stop_str_in_output)  # as vLLM: a stop id's text too
        stop_ids, eos = frozenset(p.stop_token_ids), frozenset(() if p.ignore_eos else tok.eos_token_ids)
        shown_eos = frozenset(tok.eos_token_ids) if specials else frozenset()  # (skipped anyway otherwise)
        hidden = (frozenset() if include else stop_ids | shown_eos) | (shown_eos if parsing else frozenset())
        choices = [ChoiceText(IncrementalDetokenizer(tok, skip_special_tokens=not specials, prompt_ids=ids, keep=keep),
                              StopStringMatcher(body.stop_strings(), include), hidden, stop_ids,
                              0 if p.structured is not None and not p.structured.free else p.min_tokens, eos)
                   for _ in range(p.n)]
        requests.append(EngineRequest(req.rid, i, ids, choices, engine.generate(req)))
    return requests


async def _events(state: ServerState, requests: list[EngineRequest], firsts: list[First],
                  prompt_field: str):
    """Yields (engine request, choice index, text, ids, logprobs) as outputs arrive from all prompts.

    Closing this generator closes every engine stream (aborting what still runs in the engine)."""
    outputs = _outputs_of_one(requests[0], firsts[0]) if len(requests) == 1 else _outputs_merged(requests, firsts)
    failed = False
    try:
        async for r, out in outputs:
            if out.admitted:  # (what let a stream's headers go)
                continue
            if out.finish_reason == FINISH_ERROR:
                state.metrics.on_error(out.error_code or "engine_error")
                failed = True
                raise engine_error(out, prompt_field)
            if out.index == 0 and out.cached_tokens:
                r.cached_tokens = out.cached_tokens
            if out.prompt_logprobs and r.prompt_logprobs is None:
                r.prompt_logprobs = out.prompt_logprobs
            choice = r.choices[out.index]
            if choice.finish_reason is None:
                text, ids, lps = choice.feed(out)
                ended_here = choice.finish_reason is not None and out.finish_reason is None  # a stop string
                # counted as the client is told: a stop string matched in the last token max_tokens allows is
                # "stop" to the client, though the engine ended the completion as "length"
                told = choice.finish_reason if choice.finish_reason not in (None, out.finish_reason) else None
                seen = out
                if len(ids) < len(out.new_token_ids):  # a stop string inside a speculative step's tokens: those
                    # after it are dropped from the choice's ids and usage, and are not counted as generated
                    seen = msgspec.structs.replace(out, new_token_ids=ids, completion_tokens=choice.completion_tokens)
                state.metrics.on_output(msgspec.structs.replace(seen, finish_reason=told) if told else seen, time.time())
                if ended_here and not r.done and state.engine is not None:
                    # one of n choices: the engine stops generating it now (its siblings go on; once all
                    # have ended the stream closes, which ends the request as a whole)
                    await state.engine.abort(r.rid, out.index)
                yield r, out.index, text, ids, lps
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled caller must not cut the cleanup short
            await outputs.aclose()
        for r in requests:
            if not r.done and not failed:  # the client went away (an error is counted as one, by the middleware)
                state.metrics.on_abort(r.rid, sum(c.finish_reason is None for c in r.choices))
            state.metrics.on_request_end(r.rid)


async def _outputs_of_one(r: EngineRequest, out: First) -> AsyncIterator[tuple[EngineRequest, RequestOutput]]:
    """One engine request's outputs, read on the caller's task (a stream's tokens then take one task
    switch each, not two). Stops once every choice has ended (some maybe on stop strings: the consumer
    updates `r` before asking for more), and closing it closes the engine stream."""
    try:
        while out is not None:
            yield r, out
            if r.done:
                break
            out = await anext(r.stream, None)  # None once an error output ended the engine stream
    finally:
        with anyio.CancelScope(shield=True):
            await r.stream.aclose()


async def _outputs_merged(requests: list[EngineRequest],
                          firsts: list[First]) -> AsyncIterator[tuple[EngineRequest, RequestOutput]]:
    """Several engine requests' outputs in arrival order: one pump task per request feeds a queue. A
    request whose choices have all ended (the consumer updates it before asking for more) has its pump
    cancelled, which releases it in the engine; closing this generator cancels every pump, and each
    pump closes its engine stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(r: EngineRequest, out: First) -> None:
        try:
            while out is not None:
                queue.put_nowait((r, out))
                if out.finish_reason == FINISH_ERROR:
                    break
                out = None if r.done else await anext(r.stream, None)
        finally:
            await r.stream.aclose()
            queue.put_nowait((r, None))

    tasks = [asyncio.ensure_future(pump(r, f)) for r, f in zip(requests, firsts)]
    pump_of = {id(r): t for r, t in zip(requests, tasks)}
    live = len(tasks)
    try:
        while live:
            r, out = await queue.get()
            if out is None:
                live -= 1
                continue
            yield r, out
            if r.done:  # every choice has ended (some maybe on stop strings): release the engine now
                pump_of[id(r)].cancel()
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(ser: Serializer, events) -> JSONResponse:
    try:
        async for r, index, text, ids, lps in events:
            ser.add(r, index, text, ids, lps)
    except ClientError as e:
        return e.response()
    finally:
        await events.aclose()
    return JSONResponse(ser.response())


async def _sse(ser: Serializer, events) -> AsyncIterator[str]:
    """The stream's events. Its opening ones (Anthropic's `message_start` with the prompt's cached tokens,
    Responses' `response.created`) wait for the first output after the admission the headers went with:
    what they tell is known from then."""
    started = False

    def start() -> list[str]:
        nonlocal started
        if started:
            return []
        started = True
        return [ser.sse(chunk) for chunk in ser.stream_start()]

    try:
        async for r, index, text, ids, lps in events:
            for line in start():
                yield line
            for chunk in ser.stream_delta(r, index, text, ids, lps):
                yield ser.sse(chunk)
        for line in start():
            yield line
        for chunk in ser.stream_end():
            yield ser.sse(chunk)
        if ser.stream_close:
            yield ser.stream_close
    except ClientError as e:
        for line in start():
            yield line
        for chunk in ser.stream_error(e):
            yield ser.sse(chunk)
        if ser.stream_close:
            yield ser.stream_close  # the stream still ends as every stream does
    finally:
        # on a disconnect Starlette cancels us (anyio: every await would be cancelled again), so the
        # cleanup that aborts the engine request runs shielded
        with anyio.CancelScope(shield=True):
            await events.aclose()


async def _close_all(requests: list[EngineRequest]) -> None:
    for r in requests:
        await r.stream.aclose()


async def _wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(0.25)


async def _race(watch: asyncio.Future, work: Any) -> Any:
    """`work`'s result, or None if the client disconnected first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let the cancelled work unwind before cleanup
    return None
