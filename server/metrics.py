"""Prometheus metrics for `GET /metrics`, in base units, every series labelled `model_name`; and the
ASGI middleware that counts every error response (`ErrorCountingMiddleware`).

Exported (names are what dashboards and `promtool check metrics` see):

  from the engine's stats (`update_engine`, called by the server before each scrape)
    mlaserve_num_requests_running            gauge    completions holding KV and being generated
    mlaserve_num_requests_waiting            gauge    completions queued for admission (or for their grammar)
    mlaserve_kv_cache_usage_ratio            gauge    used KV slots / all KV slots, 0..1
    mlaserve_prefix_cache_tokens             gauge    KV slots the prefix cache holds for reuse alone (evicted
                                                      when the running requests need them; not in the ratio above)
    mlaserve_retractions_total               counter  completions pushed back to the queue under KV pressure
    mlaserve_prefix_cache_hit_tokens_total   counter  prompt tokens served from the prefix cache
    mlaserve_prefix_cache_query_tokens_total counter  prompt tokens of every completion looked up in it, counted
                                                      with the hits, when first admitted (with n > 1 each
                                                      completion's prompt is one lookup); prefix-cache hit
                                                      rate: rate(..._hit_tokens_total) / rate(this)
    mlaserve_engine_forward_steps_total      counter  model forwards run (one per busy engine step)
    mlaserve_engine_forward_seconds_total    counter  seconds in those forwards (batch building included)
    mlaserve_omnikv_sparse_tokens_total      counter  decode tokens that attended to an OmniKV selection
    mlaserve_omnikv_selected_tokens_total    counter  tokens those selections kept (summed over filter layers)
    mlaserve_omnikv_context_tokens_total     counter  the contexts they were chosen from (selected fraction:
                                                      rate(selected) / rate(context))
    mlaserve_omnikv_bank_host_bytes          gauge    host memory held by the context bank's KV (--omnikv-bank; all ranks')
    mlaserve_omnikv_bank_gathered_bytes_total counter bytes the bank's gathers copied to the device
    mlaserve_spec_decode_drafts_total        counter  speculative decoding's verification steps (--speculative-config)
    mlaserve_spec_decode_draft_tokens_total  counter  draft tokens they checked
    mlaserve_spec_decode_accepted_tokens_total counter draft tokens kept (acceptance rate: rate(accepted) /
                                                      rate(draft tokens); tokens per verification step:
                                                      1 + rate(accepted) / rate(drafts))
    (with `--dp N` each of these is the sum over the replicas; a dead replica's totals stay)
  from the replica set (`update_replicas`, before each scrape)
    mlaserve_dp_replicas                     gauge    engine replicas alive (`--dp`; 1 without)
    mlaserve_dp_replica_requests_total       counter  engine requests sent to each replica (refused ones too), label replica
  from the outputs the server receives (`on_output`, `on_abort`)
    mlaserve_prompt_tokens_total             counter  prompt tokens of requests whose prefill completed (a
                                                      prompt only scored, max_tokens 0, too)
    mlaserve_generation_tokens_total         counter  tokens generated
    mlaserve_request_success_total           counter  completions finished, label finished_reason (stop, length)
    mlaserve_requests_aborted_total          counter  completions aborted unfinished because the client went away,
                                                      in the unit of the success counter (those a shutdown cuts
                                                      off are errors, code shutting_down)
    mlaserve_time_to_first_token_seconds     histogram  arrival -> first token (a scored prompt: its prefill's
                                                      end), per completion
    mlaserve_inter_token_latency_seconds     histogram  between successive tokens of a completion
    mlaserve_e2e_request_latency_seconds     histogram  arrival -> finish, per finished completion
    mlaserve_request_queue_time_seconds      histogram  arrival -> first scheduled, per completion
  from the HTTP responses (`ErrorCountingMiddleware`, with notes from `on_error`)
    mlaserve_request_errors_total            counter  requests answered with an error, labels code and status

Why one custom collector instead of prometheus_client's Counter/Histogram objects: those add a
`*_created` gauge per series unless switched off process-wide (a global), and the engine's totals
are already counters that only need exposing. Everything lives in this object's own registry.

Errors (`mlaserve_request_errors_total{code, status}`) are counted in one place, an ASGI middleware
just inside the request log, so that whatever refuses a request — auth (401), the body limit (413), validation (400),
the routes (404 `model_not_found`, 400 `context_length_exceeded`), admission (503 `overloaded`),
shutdown (503 `shutting_down`), the engine, a crash (500) — it is counted exactly once (the answers no
handler gives: a 408 `request_timeout` for a request that did not come in time, a 400 `invalid_http`, a 431
`request_header_fields_too_large` or 414 `uri_too_long`, the
shutdown's 503 to a request still arriving, are counted by the HTTP protocol, `ServerHttpProtocol.on_error`):
- a response with status >= 400 counts once: `code` is the OpenAI body's `error.code`, else its
  `error.type` (a parameter refused by validation has no code: `invalid_request_error`), else `other`;
  an error answered in Anthropic's shape counts under the code its route noted (`note_answer_code`),
  the one the OpenAI routes' same error has; `status` is the HTTP status sent;
- a stream that fails after its 200 went out (an error event, then `[DONE]`) counts once with the code
  the server noted through `on_error` and `status="200"`: the status the client saw;
- not counted: `/health` (its 503 answers the health question; counting it would make the error rate
  follow the probe frequency), and 499 or any answer to a client that left before it (mid-body, say:
  nothing reached it; the request counts in `mlaserve_requests_aborted_total` when it had reached the engine).
`on_error(code)` inside a request only notes the code for the middleware (the routes call it where the
engine refuses or fails a request, and only the stream case needs the note); outside any request (a
unit test, a caller without the middleware) it counts at once, with the status the server maps that
engine code to. Label values are bounded (`[a-z0-9_]{1,64}`, else `other`); the engine's codes and
`invalid_request_error` are exposed at 0 from the start (`KNOWN_ERRORS`) so that `rate()` sees their first
error.

Rules the server follows for the rest (each event has exactly one source, so nothing is counted twice):
- `on_output(out, now)` for every RequestOutput delta, with the engine's finish reason as the server
  settles it (a stop string found by the server: pass the delta with `finish_reason="stop"`). A reply the
  tool parser turns into calls counts as `stop` (the client sees `tool_calls`), as in vLLM's metric. Deltas that end
  with `abort` or `error` only free state here; those are counted by `on_abort` / the middleware.
- `on_abort(rid, completions)` once when the server aborts a request it had submitted because its client went
  away, with its completions not yet finished; not when it aborts the engine's copy itself after a stop
  string, nor when an error ended the answer (an engine error, or the shutdown's: the middleware counts that
  request as an error).
- `on_request_end(rid)` in a `finally`: forgets per-request state, a no-op when already gone.
A request with n > 1 yields n completions: each is timed and counted by finish reason on its own,
its prompt tokens count once (completion 0). Methods are thread-safe (one lock).
"""

from __future__ import annotations

import bisect
import contextvars
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.messages import (
    ERR_CONTEXT,
    ERR_ENGINE,
    ERR_INVALID,
    ERR_OVERLOADED,
    ERR_SHUTDOWN,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    RequestOutput,
)

# Buckets in seconds: CPU decoding of a large MoE model takes seconds per token, a small model on a
# GPU milliseconds, so each histogram spans both ends.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Inter-token latency is finest from 5 to 40 ms, where batched CPU and GPU decode steps fall.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

SUCCESS_REASONS = (FINISH_STOP, FINISH_LENGTH)
# The HTTP status each engine error code is answered with (server.serving.engine_error maps them so): the
# status label of an `on_error` counted outside a request, and of the series exposed at 0 from the start.
ENGINE_ERROR_STATUS = {ERR_OVERLOADED: 503, ERR_CONTEXT: 400, ERR_INVALID: 400, ERR_ENGINE: 503, ERR_SHUTDOWN: 503}
# (code, status) exposed at 0; ERR_INVALID is also the label of a 400 without a code (validation's type)
KNOWN_ERRORS = tuple(ENGINE_ERROR_STATUS.items())
MAX_TRACKED_COMPLETIONS = 65536  # safety net: a server bug that never ends requests cannot grow memory forever
_CODE_RE = re.compile(r"^[a-z0-9_]{1,64}$")
# The classic text format generate_latest writes (newer prometheus_client advertises 1.0.0 by default).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Histogram:
    """Cumulative-bucket histogram state (the exposition wants cumulative counts)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, value)  # clocks of two processes may disagree by a hair
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def family(self, name: str, doc: str, model_name: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        buckets, total = [], 0
        for bound, count in zip((*[repr(float(b)) for b in self.bounds], "+Inf"), self.counts):
            total += count
            buckets.append((bound, total))
        fam.add_metric([model_name], buckets, self.sum)
        return fam


class _MonotonicTotal:
    """Exposes an engine total as a counter that never goes down, even if the engine restarts at 0."""

    def __init__(self) -> None:
        self.base: float = 0
        self.last: float = 0

    def update(self, total: float) -> None:
        if total < self.last:
            self.base += self.last
        self.last = total

    @property
    def value(self) -> float:
        return self.base + self.last


class Metrics(Collector):
    """The server's metrics; see the module docstring for names and for who calls what when."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        # from the engine
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._prefix_cache_tokens = 0
        self._retractions = _MonotonicTotal()
        self._prefix_hits = _MonotonicTotal()
        self._prefix_queries = _MonotonicTotal()
        self._forward_steps = _MonotonicTotal()
        self._forward_seconds = _MonotonicTotal()
        self._omnikv_sparse = _MonotonicTotal()
        self._omnikv_selected = _MonotonicTotal()
        self._omnikv_context = _MonotonicTotal()
        self._bank_host_bytes = 0
        self._bank_gathered = _MonotonicTotal()
        self._spec_drafts = _MonotonicTotal()
        self._spec_draft_tokens = _MonotonicTotal()
        self._spec_accepted = _MonotonicTotal()
        # from the replica set
        self._replicas_alive = 0
        self._routed: dict[str, int] = {}
        # from the outputs
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success = {reason: 0 for reason in SUCCESS_REASONS}
        self._aborted = 0
        self._errors: dict[tuple[str, str], int] = {(code, str(status)): 0 for code, status in KNOWN_ERRORS}
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._itl = _Histogram(ITL_BUCKETS)
        self._e2e = _Histogram(E2E_BUCKETS)
        self._queue = _Histogram(QUEUE_BUCKETS)
        # (rid, index) -> time the server received the completion's latest token, for inter-token latency
        self._last_token_at: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ------------------------------------------------------------------ events
    def on_output(self, out: RequestOutput, now: float) -> None:
        """One delta received at `now` (time.time(), the clock of the engine's timestamps)."""
        num_new = len(out.new_token_ids)
        key = (out.rid, out.index)
        with self._lock:
            self._generation_tokens += num_new
            # the delta holding the first token, or ending a completion with none (a prompt only scored)
            if (num_new and out.completion_tokens <= num_new) or \
                    (not out.completion_tokens and out.finish_reason in SUCCESS_REASONS):
                self._on_first_token(out, now)
            elif num_new:
                previous = self._last_token_at.get(key)
                if previous is not None:
                    gap = (now - previous) / num_new  # a delta may carry several steps' tokens
                    for _ in range(num_new):
                        self._itl.observe(gap)
            if num_new:
                self._last_token_at[key] = now
                self._last_token_at.move_to_end(key)
                while len(self._last_token_at) > MAX_TRACKED_COMPLETIONS:
                    self._last_token_at.popitem(last=False)
            if out.finished:
                self._last_token_at.pop(key, None)
                if out.finish_reason in SUCCESS_REASONS:
                    self._success[out.finish_reason] += 1
                    if out.arrival_time > 0:
                        self._e2e.observe(now - out.arrival_time)

    def _on_first_token(self, out: RequestOutput, now: float) -> None:
        if out.index == 0:
            self._prompt_tokens += out.prompt_tokens
        if out.arrival_time > 0:
            first = out.first_token_time if out.first_token_time is not None else now
            self._ttft.observe(first - out.arrival_time)
            if out.first_scheduled_time is not None:
                self._queue.observe(out.first_scheduled_time - out.arrival_time)

    def on_abort(self, rid: str, completions: int = 1) -> None:
        """The server aborted request `rid` (its client went away, or shutdown) with `completions` of its
        completions unfinished."""
        with self._lock:
            self._aborted += completions
            self._forget(rid)

    def on_error(self, code: str) -> None:
        """The engine refused or failed the current request with `code` (ERR_*). Inside a request the
        `ErrorCountingMiddleware` tracks, only noted (the first note wins): the middleware counts the
        request once, from its response, or from this note when the error came after a 200 stream had
        started. Outside one, counted at once with the status `ENGINE_ERROR_STATUS` gives the code."""
        note = _REQUEST_NOTE.get()
        if note is not None:
            if note.code is None:
                note.code = error_label(code)
            return
        status = ENGINE_ERROR_STATUS.get(code)
        self.count_error(code, str(status) if status else "unknown")

    def note_answer_code(self, code: str) -> None:
        """The current request's error answer is written in a shape whose body does not carry OpenAI's
        code (Anthropic's Messages API): the middleware counts it by `code`, as the OpenAI routes' same
        error is counted."""
        note_answer_code(code)

    def count_error(self, code: str, status: str) -> None:
        """One request answered with an error: `code` (made a bounded label value) and HTTP `status`."""
        key = (error_label(code), status if status.isdigit() or status == "unknown" else "unknown")
        with self._lock:
            self._errors[key] = self._errors.get(key, 0) + 1

    def on_request_end(self, rid: str) -> None:
        """The server is done with `rid`, however it ended: drop any timing state left for it."""
        with self._lock:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        for key in [k for k in self._last_token_at if k[0] == rid]:
            del self._last_token_at[key]

    def update_engine(self, stats: EngineStats) -> None:
        """Latest engine stats: gauges take the values, counters follow the engine's totals."""
        with self._lock:
            self._running = stats.num_running
            self._waiting = stats.num_waiting
            self._kv_usage = stats.kv_usage
            self._prefix_cache_tokens = stats.prefix_cache_slots
            self._retractions.update(stats.retractions_total)
            self._prefix_hits.update(stats.prefix_cache_hit_tokens_total)
            self._prefix_queries.update(stats.prefix_cache_query_tokens_total)
            self._forward_steps.update(stats.forward_steps_total)
            self._forward_seconds.update(stats.forward_seconds_total)
            self._omnikv_sparse.update(stats.omnikv_sparse_tokens_total)
            self._omnikv_selected.update(stats.omnikv_selected_tokens_total)
            self._omnikv_context.update(stats.omnikv_context_tokens_total)
            self._bank_host_bytes = stats.omnikv_bank_host_bytes
            self._bank_gathered.update(stats.omnikv_bank_gathered_bytes_total)
            self._spec_drafts.update(stats.spec_decode_drafts_total)
            self._spec_draft_tokens.update(stats.spec_decode_draft_tokens_total)
            self._spec_accepted.update(stats.spec_decode_accepted_tokens_total)

    def update_replicas(self, alive: int, routed: Sequence[int]) -> None:
        """How many engine replicas run, and the engine requests routed to each so far."""
        with self._lock:
            self._replicas_alive = alive
            self._routed = {str(i): n for i, n in enumerate(routed)}

    @property
    def num_tracked(self) -> int:
        """Completions whose inter-token timing state is held (tests check it returns to 0)."""
        return len(self._last_token_at)

    # ------------------------------------------------------------------ exposition
    def render(self) -> tuple[bytes, str]:
        """The body and content type for `GET /metrics` (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE

    def collect(self) -> Iterable[Metric]:
        with self._lock:  # a consistent snapshot; the text is written after the lock is released
            return list(self._families(self.model_name))

    def _families(self, m: str) -> Iterable[Metric]:
        yield _gauge("mlaserve_num_requests_running", "Completions being generated (holding KV).", m, self._running)
        yield _gauge("mlaserve_num_requests_waiting", "Completions waiting to be admitted (or for their grammar to "
                     "compile).", m, self._waiting)
        yield _gauge("mlaserve_kv_cache_usage_ratio", "Fraction of KV cache slots in use (0..1).", m, self._kv_usage)
        yield _gauge("mlaserve_prefix_cache_tokens", "KV slots held by the prefix cache alone, for reuse (evicted when "
                     "running requests need them).", m, self._prefix_cache_tokens)
        yield _counter("mlaserve_retractions", "Completions retracted to the queue under KV cache pressure.",
                       m, self._retractions.value)
        yield _counter("mlaserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                       m, self._prefix_hits.value)
        yield _counter("mlaserve_prefix_cache_query_tokens", "Prompt tokens of every completion looked up in the "
                       "prefix cache, counted with the hits (hit rate: hit tokens / these).",
                       m, self._prefix_queries.value)
        yield _counter("mlaserve_engine_forward_steps", "Model forwards run by the engine (one per busy step).",
                       m, self._forward_steps.value)
        yield _counter("mlaserve_engine_forward_seconds",
                       "Seconds in model forwards (batch building included); the rest of the engine's busy time "
                       "is scheduling, sampling and output.", m, self._forward_seconds.value)
        yield _counter("mlaserve_omnikv_sparse_tokens", "Decode tokens that attended to an OmniKV selection of their "
                       "context.", m, self._omnikv_sparse.value)
        yield _counter("mlaserve_omnikv_selected_tokens", "Tokens kept by OmniKV selections, summed over filter "
                       "layers.", m, self._omnikv_selected.value)
        yield _counter("mlaserve_omnikv_context_tokens", "Context tokens OmniKV selections were chosen from, summed "
                       "over filter layers.", m, self._omnikv_context.value)
        yield _gauge("mlaserve_omnikv_bank_host_bytes", "Host memory held by the KV of the slots in use in OmniKV's "
                     "context bank (--omnikv-bank).", m, self._bank_host_bytes)
        yield _counter("mlaserve_omnikv_bank_gathered_bytes", "Bytes OmniKV's context bank gathered to the device for "
                       "decode steps.", m, self._bank_gathered.value)
        yield _counter("mlaserve_spec_decode_drafts", "Speculative decoding's verification steps (a completion's "
                       "draft checked in one forward).", m, self._spec_drafts.value)
        yield _counter("mlaserve_spec_decode_draft_tokens", "Draft tokens checked by speculative decoding.",
                       m, self._spec_draft_tokens.value)
        yield _counter("mlaserve_spec_decode_accepted_tokens", "Draft tokens speculative decoding kept.",
                       m, self._spec_accepted.value)
        yield _gauge("mlaserve_dp_replicas", "Engine replicas alive (--dp).", m, self._replicas_alive)
        yield _counter("mlaserve_dp_replica_requests", "Engine requests sent to each replica (those it refused "
                       "as overloaded too).", m, extra_label="replica", by_value=self._routed)
        yield _counter("mlaserve_prompt_tokens", "Prompt tokens of requests whose prefill completed.",
                       m, self._prompt_tokens)
        yield _counter("mlaserve_generation_tokens", "Tokens generated.", m, self._generation_tokens)
        yield _counter("mlaserve_request_success", "Completions finished, by finish reason.", m,
                       extra_label="finished_reason", by_value=self._success)
        yield _counter("mlaserve_requests_aborted", "Completions aborted unfinished because the client went away "
                       "(a shutdown's are errors, code shutting_down).",
                       m, self._aborted)
        fam = CounterMetricFamily("mlaserve_request_errors", "Requests answered with an error, by OpenAI error code "
                                  "(else type) and HTTP status (200: a stream that failed after it started).",
                                  labels=["model_name", "code", "status"])
        for (code, status), count in sorted(self._errors.items()):
            fam.add_metric([m, code, status], count)
        yield fam
        yield self._ttft.family("mlaserve_time_to_first_token_seconds",
                                "Time from arrival to the first generated token.", m)
        yield self._itl.family("mlaserve_inter_token_latency_seconds",
                               "Time between successive generated tokens of a completion.", m)
        yield self._e2e.family("mlaserve_e2e_request_latency_seconds",
                               "Time from arrival to the end of a finished completion.", m)
        yield self._queue.family("mlaserve_request_queue_time_seconds",
                                 "Time from arrival to first being scheduled.", m)


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=["model_name"])
    fam.add_metric([model_name], value)
    return fam


def _counter(name: str, doc: str, model_name: str, value: float = 0, *, extra_label: str | None = None,
             by_value: dict[str, int] | None = None) -> CounterMetricFamily:
    """`name` without `_total` (prometheus_client appends it to the sample)."""
    if extra_label is None:
        fam = CounterMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model_name], value)
        return fam
    fam = CounterMetricFamily(name, doc, labels=["model_name", extra_label])
    for label, count in sorted((by_value or {}).items()):
        fam.add_metric([model_name, label], count)
    return fam


def error_label(code: str | None) -> str:
    """`code` as a bounded label value: `[a-z0-9_]{1,64}`, else `other`."""
    return code if code and _CODE_RE.match(code) else "other"


@dataclass
class _RequestNote:
    """What the routes noted about the request being answered (`Metrics.on_error`)."""

    code: str | None = None
    answered: str | None = None  # the code of an error answered in a shape without OpenAI's code (Anthropic's)


# Set by ErrorCountingMiddleware for the length of one HTTP request. The route, its streaming body (in a
# task that copies this context) and the engine-output pumps all see the same note object.
_REQUEST_NOTE: contextvars.ContextVar[_RequestNote | None] = contextvars.ContextVar("mlaserve_request_note",
                                                                                     default=None)

def note_answer_code(code: str) -> None:
    """`Metrics.note_answer_code` for code that has no Metrics at hand (a middleware)."""
    note = _REQUEST_NOTE.get()
    if note is not None:
        note.answered = error_label(code)


CLIENT_CLOSED = 499  # what the routes return when the client left first: never sent, not an error answer
UNCOUNTED_PATHS = frozenset({"/health"})  # its 503 is the health report itself, polled by probes
MAX_ERROR_BODY = 64 * 1024  # bytes of an error body kept to read its code (ours are a few hundred)


def error_code_of(body: bytes) -> str | None:
    """The OpenAI error body's `error.code`, else `error.type`; None when the body is not one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    for key in ("code", "type"):
        if isinstance(error.get(key), str) and error[key]:
            return error[key]
    return None


class Departure:
    """Whether the client went away before any answer started (in the middle of its body, say): whatever
    the app answers then never reaches it. `receive` is the ASGI receive to hand the app in place of the one
    given; `answered()` says whether an answer has started."""

    def __init__(self, receive: Receive, answered: Callable[[], bool]) -> None:
        self._receive, self._answered = receive, answered
        self.left = False

    async def receive(self) -> Message:
        msg = await self._receive()
        self.left = self.left or (msg["type"] == "http.disconnect" and not self._answered())
        return msg


class ErrorCountingMiddleware:
    """Counts every error answer once, by code and status (the rules are in the module docstring).

    Outside every middleware but the request log, so that the 401 of auth and the 413 of the body limit
    pass through it too; plain ASGI (not BaseHTTPMiddleware) so the routes still see client disconnects,
    and the response is forwarded untouched as it is sent (an error body is copied aside, up to
    MAX_ERROR_BODY, to read its code). A crash that escapes the app before anything was sent is the 500 `internal_error` that
    Starlette's outer ServerErrorMiddleware then answers."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics]) -> None:
        self.app = app
        self.metrics = metrics  # read per request: the server's Metrics (a getter, set after the app is built)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        note = _RequestNote()
        token = _REQUEST_NOTE.set(note)
        status = 0
        body = bytearray()

        async def watched(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body" and status >= 400 and len(body) < MAX_ERROR_BODY:
                body.extend(msg.get("body", b"")[: MAX_ERROR_BODY - len(body)])
            await send(msg)

        departure = Departure(receive, lambda: status != 0)
        crashed = False
        try:
            await self.app(scope, departure.receive, watched)
        except Exception:
            crashed = True
            raise
        finally:
            _REQUEST_NOTE.reset(token)
            if status == 0 and crashed:  # ServerErrorMiddleware answers it: 500 internal_error
                self.metrics().count_error("internal_error", "500")
            elif status >= 400 and status != CLIENT_CLOSED and not departure.left:
                self.metrics().count_error(note.answered or error_code_of(bytes(body)) or note.code or "other",
                                           str(status))
            elif status and (note.code is not None or crashed):  # failed after a 2xx had started
                self.metrics().count_error(note.code or "internal_error", str(status))
