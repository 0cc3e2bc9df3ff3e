"""What crosses the boundary between the server side and the engine core process.

Server -> engine:  `GenerateRequest` (a new request), `AbortRequest`, `StatsRequest`.
Engine -> server:  `RequestOutput` (a delta of new tokens of one completion, or its end, or an error),
                   `EngineStats` (answer to StatsRequest).

All are plain dataclasses of ints, floats, strings and lists, cheap to send over a pipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor.logprobs import TokenLogprob
from scheduler.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from scheduler.sampling_params import SamplingParams

# finish_reason values are scheduler.request's FINISH_* (imported above); FINISH_ERROR is the engine's own
FINISH_ERROR = "error"  # the engine could not run it; see `error`

# error codes carried by RequestOutput.error_code
ERR_OVERLOADED = "overloaded"  # queue full: retry later (HTTP 503)
ERR_CONTEXT = "context_length_exceeded"  # prompt (+ max_tokens) longer than the context (HTTP 400)
ERR_INVALID = "invalid_request"  # a value the engine cannot honour (HTTP 400)
ERR_ENGINE = "engine_error"  # the engine crashed or died (HTTP 500/503)


@dataclass(frozen=True)
class GenerateRequest:
    rid: str  # unique id chosen by the server
    input_ids: list[int]  # prompt token ids
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() when the server received it


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class StatsRequest:
    request_id: int  # echoed in the reply so concurrent stats calls do not mix


@dataclass
class RequestOutput:
    """A delta for completion `index` of request `rid`: tokens since the previous delta."""

    rid: str
    index: int  # completion index, 0..n-1
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, completion 0: one per prompt token (first None)
    finish_reason: str | None = None  # set on the last delta of this completion
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far for this completion
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # human-readable, when finish_reason == "error"
    error_code: str | None = None  # one of ERR_*
    # timings (seconds since the epoch), for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    request_id: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_slots_used: int = 0
    kv_slots_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    retractions_total: int = 0
    aborted_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)  # by finish_reason

    @property
    def kv_usage(self) -> float:
        return self.kv_slots_used / self.kv_slots_total if self.kv_slots_total else 0.0
