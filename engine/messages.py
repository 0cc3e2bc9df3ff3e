"""What crosses the pipe between the server side (`engine.client`) and the engine process.

Server -> engine (`ToEngine`):  `GenerateRequest`, `AbortRequest`, `StatsRequest`, `Shutdown`.
Engine -> server (`FromEngine`): `EngineReady` (with `EngineInfo`) or `StartupError` once at start-up;
                                 `Outputs` (deltas of `RequestOutput`) once per loop iteration;
                                 `Stats` (an `EngineStats`, the answer to a StatsRequest);
                                 `Fatal` (last words after a crash);
                                 `Alive` (nothing else was sent for a while: the process is not frozen).

Every message is a msgspec Struct, sent as msgpack bytes (`encode`) and read back by a decoder typed
with the union of what that direction may carry (`decode_to_engine`, `decode_from_engine`). Nothing is
unpickled: a message of an unknown kind, a field one side does not know, or a value of the wrong type
is a `msgspec.ValidationError` / `DecodeError` on the reading side, never a silent default.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Union

import msgspec

from executor.logprobs import TokenLogprob
from scheduler.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from scheduler.sampling_params import SamplingParams

__all__ = [
    "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "FINISH_ERROR",
    "ERR_OVERLOADED", "ERR_CONTEXT", "ERR_INVALID", "ERR_ENGINE", "ERR_SHUTDOWN",
    "GenerateRequest", "AbortRequest", "StatsRequest", "Shutdown", "ToEngine",
    "EngineInfo", "RequestOutput", "EngineStats",
    "EngineReady", "StartupError", "Outputs", "Stats", "Fatal", "Alive", "FromEngine",
    "encode", "decode_to_engine", "decode_from_engine", "context_message", "context_numbers",
]

# finish_reason values are scheduler.request's FINISH_* (imported above); FINISH_ERROR is the engine's own
FINISH_ERROR = "error"  # the engine could not run it; see `error`

# error codes carried by RequestOutput.error_code
ERR_OVERLOADED = "overloaded"  # queue full: retry later (HTTP 503)
ERR_CONTEXT = "context_length_exceeded"  # prompt (+ max_tokens) longer than the context (HTTP 400)
ERR_INVALID = "invalid_request_error"  # a value the engine cannot honour (HTTP 400, no code: validation's label)
ERR_ENGINE = "engine_error"  # the engine crashed or died (HTTP 500/503)
ERR_SHUTDOWN = "shutting_down"  # the server is shutting down and ended it (HTTP 503)

# ERR_CONTEXT's message, from the server's check and the engine's alike; its numbers are read back where
# another API words the error its own way (Anthropic's: server.messages_api.context_error)
_CONTEXT_MESSAGE = re.compile(r"maximum context length is (\d+) tokens; the request has (\d+) prompt tokens and "
                              r"asks for (\d+) more")


def context_message(limit: int, prompt: int, more: int) -> str:
    """The message of a request whose `prompt` tokens and `more` to generate do not fit in `limit`."""
    return f"this model's maximum context length is {limit} tokens; the request has {prompt} prompt tokens and " \
           f"asks for {more} more"


def overloaded_message(held: int, running: int, queued: int, asked: int) -> str:
    """The message of a refusal by an engine that holds `held` completions, its limits `running` + `queued`,
    of a request for `asked` more."""
    return (f"the server is overloaded: it holds {held} completions, running or waiting, of at most "
            f"{running + queued} (--max-running-requests {running} + --max-queued-requests {queued}), and the "
            f"request asks for {asked}; retry later")


def context_numbers(message: str) -> tuple[int, int, int] | None:
    """(limit, prompt, more) of a `context_message`, or None for another message."""
    m = _CONTEXT_MESSAGE.search(message)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


class _Message(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of the messages on the pipe: tagged with the class name, so a decoder knows the kind."""


# ---- server -> engine ----------------------------------------------------------------------------


class GenerateRequest(_Message, frozen=True):
    rid: str  # unique id chosen by the server
    input_ids: list[int]  # prompt token ids
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() when the server received it
    # answer an `admitted` output once the request has passed the core's checks (its grammar compiled) and
    # waits to run: a stream's headers go then, not after a long prefill or queue, with refusals still errors
    report_admission: bool = False


class AbortRequest(_Message, frozen=True):
    rid: str
    index: int | None = None  # one completion of an n > 1 request (its stop string matched), else all of them


class StatsRequest(_Message, frozen=True):
    request_id: int  # echoed in the reply so concurrent stats calls do not mix


class Shutdown(_Message, frozen=True):
    """Finish nothing more: the engine process exits (the server has drained what it wanted)."""


ToEngine = Union[GenerateRequest, AbortRequest, StatsRequest, Shutdown]


# ---- engine -> server ----------------------------------------------------------------------------


def mlaserve_version() -> str:
    """The installed package's version ("unknown" when run from a tree that was never installed): `/version`'s,
    and part of the engine's `EngineInfo.fingerprint`."""
    try:
        return importlib.metadata.version("mlaserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the engine tells the server once it is ready."""

    model: str  # the path or built-in name it loaded
    arch: str  # "deepseek" | "llama"
    vocab_size: int
    context_length: int  # longest prompt + completion, in tokens
    kv_slots: int  # tokens the KV pool holds
    kv_bytes_per_token: int
    eos_token_ids: list[int]
    fingerprint: str = ""  # OpenAI's system_fingerprint: what the logits depend on besides the request (a hash)
    pid: int = 0  # the engine process (set by the process loop, not the core)


class RequestOutput(msgspec.Struct, forbid_unknown_fields=True):
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
    # OpenAI's predicted output: its draft tokens the completion kept, and those it did not (so far)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    error: str | None = None  # human-readable, when finish_reason == "error"
    error_code: str | None = None  # one of ERR_*
    error_param: str | None = None  # the request parameter at fault (ERR_INVALID), for the 400's `param`
    admitted: bool = False  # no tokens: the request will run (asked by GenerateRequest.report_admission)
    # timings (seconds since the epoch), for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, forbid_unknown_fields=True):
    request_id: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_slots_used: int = 0
    kv_slots_total: int = 0
    prefix_cache_slots: int = 0  # KV slots the prefix cache holds for reuse alone (evictable; not in kv_slots_used)
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_query_tokens_total: int = 0  # prompt tokens of the completions the hits were looked up for
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    retractions_total: int = 0
    aborted_total: int = 0
    forward_steps_total: int = 0
    forward_seconds_total: float = 0.0  # batch building + model forward (the rest of a step is overhead)
    finished_total: dict[str, int] = {}  # by finish_reason (msgspec copies the default)
    # OmniKV: decode tokens that attended to a selection; tokens selected and the contexts they were
    # chosen from, summed over filter layers (their ratio is the fraction of the context kept)
    omnikv_sparse_tokens_total: int = 0
    omnikv_selected_tokens_total: int = 0
    omnikv_context_tokens_total: int = 0
    # OmniKV's context bank: host bytes held by the KV slots in use (gauge), and bytes its gathers copied
    # to the device (counter; each gather's whole fixed-shape buffer)
    omnikv_bank_host_bytes: int = 0
    omnikv_bank_gathered_bytes_total: int = 0
    # speculative decoding: verification steps, the draft tokens they checked, and the draft tokens kept
    spec_decode_drafts_total: int = 0
    spec_decode_draft_tokens_total: int = 0
    spec_decode_accepted_tokens_total: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_slots_used / self.kv_slots_total if self.kv_slots_total else 0.0


class EngineReady(_Message, frozen=True):
    info: EngineInfo


# what a start-up failure raises where the model, a config or a setting the user gave is at fault (the message
# says which), not the process or the machine: starting again cannot help (the server exits 2 for it)
SETTINGS_FAULTS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError,
                                                    NotADirectoryError)


def is_settings_fault(exc: BaseException) -> bool:
    """Whether a start-up failure is the model's or the settings' (`SETTINGS_FAULTS`, or an
    `EngineStartupError` that says so)."""
    return isinstance(exc, SETTINGS_FAULTS) or bool(getattr(exc, "settings_fault", False))


class EngineStartupError(RuntimeError):
    """The engine could not start, and why (from its process, or from the ranks or replicas that load it
    together). `settings_fault`: the model or a setting is at fault (`is_settings_fault`)."""

    def __init__(self, message: str, *, settings_fault: bool = False) -> None:
        super().__init__(message)
        self.settings_fault = settings_fault


class StartupError(_Message, frozen=True):
    message: str
    settings_fault: bool = False  # the model or a setting is at fault (`is_settings_fault`)


class Outputs(_Message, frozen=True):
    items: list[RequestOutput]


class Stats(_Message, frozen=True):
    stats: EngineStats


class Fatal(_Message, frozen=True):
    reason: str


class Alive(_Message, frozen=True):
    """Sent by the engine's watchdog thread when nothing else was sent for `engine.process.ALIVE_S`: the
    server takes a long silence for a process that is stopped or frozen (`EngineClient.silent_s`)."""


FromEngine = Union[EngineReady, StartupError, Outputs, Stats, Fatal, Alive]


# ---- the codec -------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: _Message) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    """Raises msgspec.DecodeError (a ValidationError among them) for anything but a ToEngine message."""
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    """Raises msgspec.DecodeError (a ValidationError among them) for anything but a FromEngine message."""
    return _from_engine.decode(data)
