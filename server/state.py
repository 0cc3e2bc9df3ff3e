"""`ServerState`: what the HTTP side knows of the engine and itself; `error_response`: OpenAI's error shape.

Kept apart from `app` so that the routes (`serving`) and serializers (`responses`) can use them
without importing the application that registers them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from engine.replicas import EngineReplicas
from models.loader.tokenizer import TokenizerBundle
from server.generation_defaults import GenerationDefaults
from server.metrics import Metrics
from scheduler.sampling_params import ParamError
from server.protocol import error_body


@dataclass
class ServerState:
    model_name: str  # the id clients use in `model`
    metrics: Metrics
    api_key: str | None = None
    tool_call_parser: str = "auto"  # "auto": the one the chat template implies
    reasoning_parser: str = "auto"  # "auto": the one the chat template implies (server.reasoning.parser_kind)
    stream_keepalive: float = 15.0  # seconds a stream may send nothing before a keep-alive (0: never)
    # set once the engine is up (None while loading): its --dp replicas, one by default
    engine: EngineReplicas | None = None
    tokenizer: TokenizerBundle | None = None  # its chat_template is --chat-template's when given
    generation_defaults: GenerationDefaults | None = None  # the model's sampling defaults (set with the tokenizer)
    context_length: int = 0
    # completions the engine(s) can hold at once, running and queued (--max-running-requests +
    # --max-queued-requests, times --dp); 0: unknown, not checked
    admission_capacity: int = 0
    vocab_size: int = 0
    system_fingerprint: str | None = None  # the engine's (EngineInfo.fingerprint): chat and completions answers carry it
    start_error: str | None = None
    start_exit: int = 1  # the exit code for start_error: 2 where the model or a setting is at fault
    engine_lost: str | None = None  # why the engine (every replica) died after it was ready: the server exits 1
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    inflight: int = 0  # generation requests not yet answered in full (the drain waits for them)

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """The model's sampling defaults (`generation_defaults.values`; none before it is known)."""
        return self.generation_defaults.values if self.generation_defaults is not None else {}

    def unavailable(self, health: bool = False) -> JSONResponse | None:
        """The 503 to answer with when requests cannot be served now, else None. `health`: the 503 of
        `/health`, which also fails while one of several replicas is dead (requests still go to the rest)."""
        if self.shutting_down:
            return error_response(503, "the server is shutting down", "service_unavailable", code="shutting_down",
                                  headers={"Retry-After": "5"})
        if self.engine is None:
            return error_response(503, "the model is still loading; retry shortly", "service_unavailable",
                                  code="loading", headers={"Retry-After": "5"})
        if not self.engine.any_alive:
            return error_response(503, "the engine is not running", "service_unavailable", code="engine_dead",
                                  headers={"Retry-After": "30"})
        if health and not self.engine.is_alive:
            dead = "; ".join(f"replica {i}: {why}" for i, why in self.engine.dead())
            return error_response(503, f"{self.engine.size - self.engine.alive} of {self.engine.size} engine replicas "
                                  f"are not running ({dead}); requests go to the others", "service_unavailable",
                                  code="engine_dead", headers={"Retry-After": "30"})
        return None


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class ClientError(Exception):
    """A request the server refuses: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    @classmethod
    def bad_param(cls, e: ParamError) -> ClientError:
        """The 400 for a parameter `SamplingParams.validate` (or a prompt check) refused; `param` is its name."""
        return cls(400, e.message, e.param)
