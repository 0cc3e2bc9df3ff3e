"""The FastAPI application: routes, auth, body limits, error shapes, health and metrics.

Request handling itself lives in `serving.py` (one serializer per API shape). This module owns the
HTTP concerns:
  * every error leaves as OpenAI's `{"error": {message, type, param, code}}` (Anthropic's shape on the Messages
    routes, `shaped`) — FastAPI's 422s become
    400 `invalid_request_error` naming the field, unknown routes 404, bodies over the limit 413;
  * every error answer (but `/health`'s) is counted once in `mlaserve_request_errors_total{code, status}`
    by a middleware outside auth and the body limit (`server.metrics.ErrorCountingMiddleware`);
  * `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`)
    when a key is set (compared in constant time); `/health`, `/metrics` and `/version` stay open (as
    vLLM leaves `/version`);
  * `/health` is 200 only while the engine (every `--dp` replica) is alive and we are not draining for
    shutdown;
  * one log line per request (`RequestLogMiddleware`: method, path, status, time, request id, never the
    prompt), and the request id (the client's `X-Request-Id`, or a new one) in every answer's `x-request-id`;
  * CORS for `--allowed-origins` (any origin by default, as vLLM and llama.cpp's server): preflights are
    answered before auth, and every answer, errors included, carries the headers a browser needs to read it.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.sampling_params import ParamError
from engine.messages import mlaserve_version
from server.messages_api import model_info, model_info_list
from server.http_protocol import SCOPE_ANSWERED, SCOPE_REQUEST_ID, log_path
from server.metrics import CLIENT_CLOSED, Departure, ErrorCountingMiddleware
from server.protocol import SEND_JSON, ModelCard, ModelList, VersionResponse, describe_validation_error
from server.serving import anthropic_error, register_routes
from server.state import ServerState, error_response

logger = logging.getLogger("mlaserve.server")


MIN_BODY_LIMIT = 1 << 20  # bytes: the derived limit never goes below this
BODY_BYTES_PER_CONTEXT_TOKEN = 16  # a token is ~4 bytes of text, more as JSON-escaped text or as ids
STATS_WAIT_S = 0.5  # /metrics waits this long for the engine's current stats, then takes the latest it sent


# routes whose answers are OpenAI's (or vLLM's) whoever asks: a proxy or shared client that sends
# `anthropic-version` on every call still reads their errors in their own shape and field names
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize")


def from_anthropic_client(scope: Scope) -> bool:
    """A request on the Messages routes, or one with an `anthropic-version` header (the Anthropic SDK sends it
    on every call, `models.list()` too) on a route both APIs share: its answers take Anthropic's shapes."""
    path = str(scope.get("path", ""))
    return path.startswith("/v1/messages") or (
        not path.startswith(OPENAI_ROUTES)
        and any(name == b"anthropic-version" for name, _ in scope.get("headers", ())))


def shaped(scope: Scope, resp: Response) -> Response:
    """An error answer in the shape the request's client reads: Anthropic's (`from_anthropic_client`), else
    OpenAI's."""
    return anthropic_error(resp) if from_anthropic_client(scope) else resp


def body_limit(fixed: int | None, context_length: int) -> int:
    """`--max-request-bytes` when given, else derived from the model's context: a prompt that fits the
    context must fit the body (16 bytes per token of context, at least 1 MiB)."""
    if fixed is not None:
        return fixed
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_CONTEXT_TOKEN * context_length)


class BodyLimitMiddleware:
    """Refuses request bodies over the limit with 413, whether Content-Length says so or not. The limit
    is read per request: derived, it follows the context length the engine reports once loaded. Until
    then (context length 0) the derived limit is not known: a body over the 1 MiB floor gets the 503 of
    a loading server rather than a 413 that would wrongly tell the client its request can never fit.

    Also refused before any route reads them: a compressed body (415: a gzip body was read as broken JSON,
    and a plain one that claimed to be gzip was taken as it came), and a body in UTF-16 or UTF-32, which
    Python's JSON reader would take (RFC 8259: JSON between systems is UTF-8)."""

    def __init__(self, app: ASGIApp, state: ServerState, fixed: int | None) -> None:
        self.app = app
        self.state = state
        self.fixed = fixed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = body_limit(self.fixed, self.state.context_length)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        coding = _content_coding(scope, headers)
        if coding is not None:
            resp = error_response(415, f"request bodies are read as they come: Content-Encoding "
                                  f"{coding[:40]!r} is not supported; {SEND_JSON}, uncompressed",
                                  code="unsupported_media_type")
            return await shaped(scope, resp)(scope, receive, send)
        seen = 0
        too_large = not_utf8 = False

        async def limited() -> Message:
            nonlocal seen, too_large, not_utf8
            msg = await receive()
            if msg["type"] == "http.request":
                chunk = msg.get("body", b"")
                if seen < 4 and chunk and _wide_unicode(chunk):  # (its first bytes: one chunk holds them)
                    not_utf8 = True
                    raise _BodyRefused()
                seen += len(chunk)
                if seen > limit:
                    too_large = True
                    raise _BodyRefused()
            return msg

        async def guarded_send(msg: Message) -> None:
            if not (too_large or not_utf8):  # the app's reply to a refused body is replaced by the refusal
                await send(msg)

        try:
            await self.app(scope, limited, guarded_send)
        except _BodyRefused:
            pass
        if too_large:
            await self._refuse(scope, receive, send, limit)
        elif not_utf8:
            resp = error_response(400, f"the body is UTF-16 or UTF-32 text: {SEND_JSON}")
            await shaped(scope, resp)(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """413 naming the flag and the limit; 503 while the derived limit is not known yet."""
        context = self.state.context_length
        if self.fixed is None and not context:  # the limit will be known once the model has loaded
            resp = self.state.unavailable() or error_response(
                503, "the model is still loading; retry shortly", "service_unavailable", code="loading",
                headers={"Retry-After": "5"})
            return await shaped(scope, resp)(scope, receive, send)
        how = "set by --max-request-bytes" if self.fixed is not None else (
            f"derived from the model's {context}-token context: {BODY_BYTES_PER_CONTEXT_TOKEN} bytes per token, "
            f"at least 1 MiB")
        resp = error_response(413, f"request body larger than the limit of {limit} bytes ({how}); start the server "
                              f"with a larger --max-request-bytes to accept it", code="request_too_large")
        await shaped(scope, resp)(scope, receive, send)


class _BodyRefused(Exception):
    pass


def _wide_unicode(head: bytes) -> bool:
    """Whether a body starts as UTF-16 or UTF-32 text does, as Python's JSON reader tells them (a byte-order
    mark, or the NULs of an ASCII first character in them): that reader would take them, where the body
    must be UTF-8. (A gzip body, say, is not taken for one: it fails as JSON, as any other binary.)"""
    return json.detect_encoding(head[:4]) not in ("utf-8", "utf-8-sig")


def _content_coding(scope: Scope, headers: dict[bytes, bytes]) -> str | None:
    """The coding a request's body says it is in where it is not the body as it is (every Content-Encoding
    header's every coding counts), for a request that has a body; else None."""
    if b"content-length" not in headers and b"transfer-encoding" not in headers:
        return None  # no body (GET /health): its headers are not read
    if headers.get(b"content-length", b"").strip() == b"0":
        return None
    codings = [c.strip().lower() for name, value in scope.get("headers") or () if name == b"content-encoding"
               for c in value.decode("latin-1").split(",")]
    return next((c for c in codings if c and c != "identity"), None)


KEYED_PATHS = ("/tokenize", "/detokenize")  # beside /v1/*: what a key protects


class AuthMiddleware:
    """`/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY` (or Anthropic's
    `x-api-key: KEY`) when a key is set; compared in constant time.

    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware wraps `receive`, and handlers then never
    see the client's disconnect (which must abort the request in the engine)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.api_key
        path = scope.get("path", "")
        if scope["type"] == "http" and key and (path.startswith("/v1") or path.rstrip("/") in KEYED_PATHS):
            raw = scope.get("headers") or []
            names = [name.lower() for name, _ in raw]
            if names.count(b"authorization") > 1 or names.count(b"x-api-key") > 1:  # which one a proxy checked?
                resp = error_response(400, "send one Authorization header (and at most one x-api-key): a repeated "
                                      "one is ambiguous", "invalid_request_error", code="invalid_api_key")
                return await shaped(scope, resp)(scope, receive, send)
            headers = dict(raw)
            scheme, _, bearer = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            given = [bearer] if scheme.lower() == "bearer" else []
            given.append(headers.get(b"x-api-key", b"").decode("latin-1"))  # Anthropic's clients send this
            # either header with the key will do (a stale token in the other must not lock a client out)
            if not any([hmac.compare_digest(g.strip().encode(), key.encode()) for g in given]):
                resp = error_response(401, "invalid or missing API key (send Authorization: Bearer KEY, or "
                                      "x-api-key: KEY)", "invalid_request_error", code="invalid_api_key")  # OpenAI's type
                return await shaped(scope, resp)(scope, receive, send)
        await self.app(scope, receive, send)


class _CORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in OpenAI's error shape (Starlette's is plain text)."""

    def preflight_response(self, request_headers: Any) -> Response:
        resp = super().preflight_response(request_headers)
        if resp.status_code != 400:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
        return error_response(400, f"{bytes(resp.body).decode()}: this server's --allowed-origins does not let a "
                              "web page of this origin call it", code="cors_not_allowed", headers=headers)


REQUEST_ID_HEADER = b"x-request-id"
ANTHROPIC_REQUEST_ID_HEADER = b"request-id"  # Anthropic's API names it so
_REQUEST_ID_OK = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")  # a client's id is echoed only when it reads as one
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled by probes and scrapers: logged at debug only


class RequestLogMiddleware:
    """One log line per request when its answer has gone out (a stream: at its end): method, path, status,
    time taken, the client and the request id. The id is the client's `X-Request-Id` when it sends a sane
    one, else a new one; every answer carries it back in `x-request-id` (an Anthropic client's also in
    `request-id`, where its SDK reads it), so a client's error can be found in the server's log. Prompts
    and outputs are never logged. Outermost: it sees every answer, the middlewares' refusals included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER, b"")
        rid = given if _REQUEST_ID_OK.fullmatch(given) else uuid.uuid4().hex.encode()
        start = time.monotonic()
        status = 0

        async def tagged(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
                ids = [(REQUEST_ID_HEADER, rid)]
                if from_anthropic_client(scope):  # where Anthropic's SDK looks for it
                    ids.append((ANTHROPIC_REQUEST_ID_HEADER, rid))
                msg = {**msg, "headers": [*msg.get("headers", []), *ids]}
            await send(msg)

        departure = Departure(receive, lambda: status != 0)
        scope[SCOPE_REQUEST_ID] = rid.decode()  # (the connection's own error answer carries it too)
        try:
            await self.app(scope, departure.receive, tagged)
        finally:
            path = scope.get("path", "")
            client = scope.get("client")
            # such a request is logged as nginx logs it, 499, not with the answer it never got (a 400 for
            # the half body it left); one the connection answered itself (a 408 for a body that stopped) was
            # logged there, with this id
            if not scope.get(SCOPE_ANSWERED):
                logger.log(logging.DEBUG if path in QUIET_PATHS else logging.INFO,
                           "%s %s %s %.1f ms client=%s request_id=%s", scope.get("method"), log_path(path),
                           CLIENT_CLOSED if departure.left else status or "-", (time.monotonic() - start) * 1e3,
                           log_path(f"{client[0]}:{client[1]}", 64) if client else "-", rid.decode())  # (a
                # forwarded-for header sets it: quoted as a path is, so that it cannot forge the line's fields)


class DrainMiddleware:
    """While the server drains (after SIGTERM), every answer says `Connection: close`: a pooled client
    then reconnects, through its load balancer, to a server that is ready, instead of sending its retries
    of a 503 down the same kept-alive connection to this one until it exits (Go's Shutdown and Envoy's
    drain do the same)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def closing(msg: Message) -> None:
            if msg["type"] == "http.response.start" and self.state.shutting_down:
                msg = {**msg, "headers": [*msg.get("headers", []), (b"connection", b"close")]}
            await send(msg)

        await self.app(scope, receive, closing)


class CrashMiddleware:
    """A bug in a route answers 500 (OpenAI's type `server_error`, code `internal_error`; logged with its
    traceback) and ends there.

    Starlette's handler for Exception sends the 500 and then raises the error again, for the server to
    log, and uvicorn then drops the connection: a client's next request on that keep-alive connection
    would fail with a reset, so one bad request would disturb others. A crash after the response has
    started cannot be answered any more: it is raised on (the stream is cut)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            resp = error_response(500, f"internal server error: {type(exc).__name__}", "server_error",
                                  code="internal_error")
            await shaped(scope, resp)(scope, receive, send)


def build_app(state: ServerState, max_request_bytes: int | None = None, allowed_origins: str = "") -> FastAPI:
    """The app; `max_request_bytes` None derives the body limit from the context (`body_limit`);
    `allowed_origins`: "*", a comma-separated list of origins, or "" for no CORS (`--allowed-origins`)."""
    app = FastAPI(title="mlaserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.s = state

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(exc.errors())
        return shaped(request.scope, error_response(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            resp = error_response(404, _no_route(str(request.scope.get("path", ""))), code="not_found")
        elif exc.status_code == 405:  # with Starlette's Allow header, which RFC 9110 requires of a 405
            allow = (exc.headers or {}).get("Allow")
            if allow:  # (Starlette's order is a set's: the same every time here)
                allow = ", ".join(sorted(m.strip() for m in allow.split(",")))
            resp = error_response(405, "method not allowed for this route" + (f": use {allow}" if allow else ""),
                                  code="method_not_allowed", headers={"Allow": allow} if allow else None)
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's words
            resp = error_response(400, f"the request body could not be read as JSON: {SEND_JSON}")
        else:
            resp = error_response(exc.status_code, str(exc.detail))
        return shaped(request.scope, resp)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes and load balancers that send it
    async def health() -> Response:
        return state.unavailable(health=True) or JSONResponse({"status": "ok"})

    version = VersionResponse(version=mlaserve_version()).model_dump()

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def get_version() -> JSONResponse:
        return JSONResponse(version)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        engine = state.engine
        if engine is not None:
            state.metrics.update_replicas(engine.alive, engine.routed)
            if engine.any_alive:
                try:  # an engine inside a long step answers after it: the latest stats it sent meanwhile, no stall
                    state.metrics.update_engine(await engine.stats(timeout=STATS_WAIT_S))
                except Exception:  # a dying engine must not break the scrape
                    logger.warning("engine stats unavailable for /metrics")
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    # While the model loads, /v1/models answers the generation routes' 503 (as llama-server does):
    # clients that probe readiness with it would otherwise send requests that fail for seconds.
    # An Anthropic client (`from_anthropic_client`) gets Anthropic's shapes
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(raw: Request) -> Response:
        if state.engine is None:
            return shaped(raw.scope, state.unavailable())
        if from_anthropic_client(raw.scope):
            try:
                page = model_info_list(state.model_name, state.created, state.context_length, raw.query_params)
            except ParamError as e:
                return shaped(raw.scope, error_response(400, e.message, param=e.param))
            return JSONResponse(page.model_dump())
        return JSONResponse(ModelList(data=[_model_card(state)]).model_dump())

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def get_model(raw: Request, model_id: str) -> Response:
        if state.engine is None:
            return shaped(raw.scope, state.unavailable())
        if model_id != state.model_name:
            return shaped(raw.scope, error_response(404, f"the model '{model_id}' does not exist", param="model",
                                                    code="model_not_found"))
        if from_anthropic_client(raw.scope):
            return JSONResponse(model_info(state.model_name, state.created, state.context_length).model_dump())
        return JSONResponse(_model_card(state).model_dump())

    register_routes(app, state)
    app.add_middleware(BodyLimitMiddleware, state=state, fixed=max_request_bytes)
    app.add_middleware(AuthMiddleware, state=state)
    app.add_middleware(CrashMiddleware)
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
    if origins:  # outside auth: a preflight carries no key
        app.add_middleware(_CORS, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After", "x-mlaserve-replica", "x-request-id", "request-id"], max_age=600)
    # counts every error answer once, the 401s and 413s above included
    app.add_middleware(ErrorCountingMiddleware, metrics=lambda: state.metrics)
    app.add_middleware(DrainMiddleware, state=state)
    app.add_middleware(RequestLogMiddleware)  # outermost (added last)
    return app


# OpenAI's endpoints this server does not offer, by path prefix: a client that calls one is told so
_NOT_SERVED = {"/v1/embeddings": "embeddings", "/v1/images": "images", "/v1/audio": "audio",
               "/v1/moderations": "moderations", "/v1/files": "files", "/v1/batches": "batches",
               "/v1/fine_tuning": "fine-tuning", "/v1/assistants": "assistants", "/v1/threads": "threads",
               "/v1/vector_stores": "vector stores", "/v1/realtime": "the realtime API", "/v1/uploads": "uploads",
               "/v1/conversations": "conversations"}


def _no_route(path: str) -> str:
    for prefix, what in _NOT_SERVED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return (f"{path}: this server generates text and does not offer {what} (it serves the chat completions, "
                    "completions, Responses and Messages APIs)")
    return f"no such route: {path}"


def _model_card(state: ServerState) -> ModelCard:
    defaults = state.generation_defaults
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.context_length or None,
                     generation_defaults=defaults.in_force() if defaults is not None else None)
