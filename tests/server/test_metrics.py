"""`server.metrics.Metrics`: the values in the rendered text after a random synthetic load, read back
with prometheus_client's own text parser; naming rules checked structurally and, when installed, by
`promtool check metrics` (Debian package `prometheus`); and `ErrorCountingMiddleware` on a small app
whose routes answer as the server's do (tests/server/test_error_metrics_e2e.py: the real server)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import server.metrics as metrics_mod
from engine.messages import (ERR_CONTEXT, ERR_ENGINE, ERR_INVALID, ERR_OVERLOADED, ERR_SHUTDOWN, FINISH_ABORT,
                             FINISH_ERROR, EngineStats, RequestOutput)
from server.metrics import ErrorCountingMiddleware, Metrics
from server.protocol import error_body

MODEL = "smollm2-135m-instruct"
HISTOGRAMS = {
    "ttft": "mlaserve_time_to_first_token_seconds",
    "itl": "mlaserve_inter_token_latency_seconds",
    "e2e": "mlaserve_e2e_request_latency_seconds",
    "queue": "mlaserve_request_queue_time_seconds",
}


# ---------------------------------------------------------------- reading the text back
def _samples(body: bytes) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, through prometheus_client's parser (not our code)."""
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def _check_histogram(samples: dict, name: str, observed: list[float], bounds: tuple[float, ...]) -> None:
    obs = np.asarray(observed, dtype=np.float64)
    for bound in bounds:
        want = int(np.count_nonzero(obs <= bound))
        assert _value(samples, f"{name}_bucket", le=repr(float(bound))) == want, (name, bound)
    assert _value(samples, f"{name}_bucket", le="+Inf") == len(obs)
    assert _value(samples, f"{name}_count") == len(obs)
    assert _value(samples, f"{name}_sum") == pytest.approx(float(obs.sum()), rel=1e-9, abs=1e-12)


def structural_problems(text: str) -> list[str]:
    """Naming and format rules of the exposition, checked line by line without any library."""
    problems: list[str] = []
    helps: set[str] = set()
    types: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            helps.add(name)
            if len(line.split(" ", 3)) < 4 or not line.split(" ", 3)[3].strip():
                problems.append(f"{name}: empty HELP")
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            if name not in helps:
                problems.append(f"{name}: TYPE before (or without) HELP")
            types[name] = kind
            if not re.fullmatch(r"mlaserve_[a-z0-9_]+", name):
                problems.append(f"{name}: not ^mlaserve_[a-z0-9_]+$")
            if kind == "counter" and not name.endswith("_total"):
                problems.append(f"{name}: counter without _total")
            if kind != "counter" and name.endswith("_total"):
                problems.append(f"{name}: _total on a {kind}")
            if kind == "histogram" and not name.endswith("_seconds"):
                problems.append(f"{name}: histogram not in seconds")
            if kind not in ("counter", "gauge", "histogram"):
                problems.append(f"{name}: unexpected type {kind}")
            continue
        if line.startswith("#"):
            problems.append(f"stray comment: {line}")
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)", line)
        if not m:
            problems.append(f"unparsable sample: {line}")
            continue
        name, labels = m.group(1), m.group(2) or ""
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                family = name[: -len(suffix)]
        if family not in types:
            problems.append(f"{name}: sample without TYPE")
        if f'model_name="{MODEL}"' not in labels:
            problems.append(f"{name}: no model_name label")
        if ":" in name:
            problems.append(f"{name}: colon in name")
    return problems


# ---------------------------------------------------------------- a random synthetic load
@dataclass
class Expected:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    aborted: int = 0
    errors: dict[tuple[str, str], int] = field(default_factory=dict)  # (code, status) -> count
    obs: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in HISTOGRAMS})


def _simulate(rng: np.random.Generator, num_requests: int = 40) -> tuple[list[tuple], Expected]:
    """Events (time, kind, payload) as a server would see them, interleaved across requests, and the
    values the metrics must end up with, computed here from the raw timings."""
    events: list[tuple] = []
    exp = Expected()
    for r in range(num_requests):
        rid = f"req-{r}"
        arrival = 1.7e9 + float(rng.uniform(0, 50))
        prompt_tokens = int(rng.integers(1, 300))
        fate = rng.choice(["finish", "finish", "finish", "abort", "error", "score"])
        if fate == "score":  # max_tokens 0: the prompt is prefilled (and scored), no token comes
            scheduled = arrival + float(rng.exponential(0.3))
            done_at = scheduled + float(rng.exponential(0.5))
            out = RequestOutput(rid, 0, [], finish_reason="length", prompt_tokens=prompt_tokens,
                                arrival_time=arrival, first_scheduled_time=scheduled)
            events.append((done_at, "output", out))
            events.append((done_at + 1e-3, "end", rid))
            exp.prompt_tokens += prompt_tokens
            exp.success["length"] += 1
            for key, value in (("ttft", done_at - arrival), ("queue", scheduled - arrival), ("e2e", done_at - arrival)):
                exp.obs[key].append(value)
            continue
        if fate == "error":
            code = str(rng.choice([ERR_OVERLOADED, ERR_CONTEXT, ERR_INVALID, ERR_ENGINE, ERR_SHUTDOWN]))
            out = RequestOutput(rid, 0, [], finish_reason=FINISH_ERROR, prompt_tokens=prompt_tokens,
                                error="refused", error_code=code, arrival_time=arrival)
            events.append((arrival + 1e-4, "output", out))
            events.append((arrival + 2e-4, "error", code))
            events.append((arrival + 3e-4, "end", rid))
            status = {ERR_OVERLOADED: "503", ERR_CONTEXT: "400", ERR_INVALID: "400"}.get(code, "503")
            label = "invalid_request_error" if code == ERR_INVALID else code
            exp.errors[label, status] = exp.errors.get((label, status), 0) + 1
            continue
        n = int(rng.integers(1, 4))
        abort_at = arrival + float(rng.uniform(0.05, 3.0)) if fate == "abort" else float("inf")
        last_time, unfinished = arrival, 0
        for index in range(n):
            scheduled = arrival + float(rng.exponential(0.3))
            first_token = scheduled + float(rng.exponential(0.5))
            total = int(rng.integers(1, 40))
            reason = str(rng.choice(["stop", "length"]))
            t, done, first = first_token + float(rng.uniform(0, 0.01)), 0, True
            prev = t
            while done < total and t < abort_at:
                k = min(int(rng.integers(1, 4)), total - done)
                done += k
                finished = done == total
                out = RequestOutput(rid, index, list(rng.integers(1, 50000, size=k)),
                                    finish_reason=reason if finished else None, prompt_tokens=prompt_tokens,
                                    completion_tokens=done, arrival_time=arrival, first_scheduled_time=scheduled,
                                    first_token_time=first_token)
                events.append((t, "output", out))
                exp.generation_tokens += k
                if first:
                    exp.obs["ttft"].append(first_token - arrival)
                    exp.obs["queue"].append(scheduled - arrival)
                    exp.prompt_tokens += prompt_tokens if index == 0 else 0
                else:
                    exp.obs["itl"].extend([(t - prev) / k] * k)
                if finished:
                    exp.success[reason] += 1
                    exp.obs["e2e"].append(t - arrival)
                prev, first = t, False
                last_time = max(last_time, t)
                t += float(rng.exponential(0.08))
            unfinished += done < total
        if fate == "abort":
            when = max(abort_at, last_time) + 1e-3
            events.append((when, "abort", (rid, unfinished)))
            exp.aborted += unfinished  # completions, as successes are counted
            for index in range(n):  # what the engine answers to the abort: ends without tokens
                out = RequestOutput(rid, index, [], finish_reason=FINISH_ABORT, prompt_tokens=prompt_tokens,
                                    arrival_time=arrival)
                events.append((when + 1e-3, "output", out))
        events.append((last_time + 1.0, "end", rid))
    events.sort(key=lambda e: e[0])
    return events, exp


def _replay(metrics: Metrics, events: list[tuple]) -> None:
    for now, kind, payload in events:
        if kind == "output":
            metrics.on_output(payload, now)
        elif kind == "abort":
            metrics.on_abort(*payload)
        elif kind == "error":
            metrics.on_error(payload)
        else:
            metrics.on_request_end(payload)


@pytest.fixture
def loaded() -> tuple[Metrics, Expected]:
    events, exp = _simulate(np.random.default_rng())
    metrics = Metrics(MODEL)
    _replay(metrics, events)
    metrics.update_engine(EngineStats(num_running=3, num_waiting=5, kv_slots_used=417, kv_slots_total=1024,
                                      prefix_cache_hit_tokens_total=321, prefix_cache_query_tokens_total=654,
                                      retractions_total=7, prefix_cache_slots=99))
    return metrics, exp


# ---------------------------------------------------------------- tests
def test_values_after_random_load(loaded):
    metrics, exp = loaded
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    s = _samples(body)
    assert _value(s, "mlaserve_prompt_tokens_total") == exp.prompt_tokens
    assert _value(s, "mlaserve_generation_tokens_total") == exp.generation_tokens
    for reason, count in exp.success.items():
        assert _value(s, "mlaserve_request_success_total", finished_reason=reason) == count
    assert _value(s, "mlaserve_requests_aborted_total") == exp.aborted
    for (code, status), count in exp.errors.items():
        assert _value(s, "mlaserve_request_errors_total", code=code, status=status) == count
    assert _value(s, "mlaserve_prefix_cache_query_tokens_total") == 654  # the engine's, counted with its hits
    bounds = {"ttft": metrics_mod.TTFT_BUCKETS, "itl": metrics_mod.ITL_BUCKETS,
              "e2e": metrics_mod.E2E_BUCKETS, "queue": metrics_mod.QUEUE_BUCKETS}
    for key, name in HISTOGRAMS.items():
        assert exp.obs[key], f"the random load produced no {key} observation"
        _check_histogram(s, name, exp.obs[key], bounds[key])
    assert _value(s, "mlaserve_num_requests_running") == 3
    assert _value(s, "mlaserve_num_requests_waiting") == 5
    assert _value(s, "mlaserve_kv_cache_usage_ratio") == pytest.approx(417 / 1024)
    assert _value(s, "mlaserve_prefix_cache_hit_tokens_total") == 321
    assert _value(s, "mlaserve_prefix_cache_tokens") == 99
    assert _value(s, "mlaserve_retractions_total") == 7
    assert metrics.num_tracked == 0, "per-completion timing state outlived its requests"


def test_inter_token_latency_by_hand():
    """Two deltas after the first: 3 tokens 0.27 s later, 1 token 0.05 s after that (no value on a bucket bound)."""
    m = Metrics(MODEL)
    base = dict(prompt_tokens=11, arrival_time=100.0, first_scheduled_time=100.3, first_token_time=101.2)
    m.on_output(RequestOutput("r", 0, [5, 6], completion_tokens=2, **base), 101.25)
    m.on_output(RequestOutput("r", 0, [7, 8, 9], completion_tokens=5, **base), 101.52)
    m.on_output(RequestOutput("r", 0, [10], completion_tokens=6, finish_reason="length", **base), 101.57)
    s = _samples(m.render()[0])
    _check_histogram(s, HISTOGRAMS["itl"], [0.09, 0.09, 0.09, 0.05], metrics_mod.ITL_BUCKETS)
    _check_histogram(s, HISTOGRAMS["ttft"], [1.2], metrics_mod.TTFT_BUCKETS)
    _check_histogram(s, HISTOGRAMS["queue"], [0.3], metrics_mod.QUEUE_BUCKETS)
    _check_histogram(s, HISTOGRAMS["e2e"], [1.57], metrics_mod.E2E_BUCKETS)
    assert _value(s, "mlaserve_prompt_tokens_total") == 11
    assert _value(s, "mlaserve_generation_tokens_total") == 6
    assert _value(s, "mlaserve_request_success_total", finished_reason="length") == 1


def test_engine_counters_follow_totals_across_an_engine_restart():
    rng = np.random.default_rng()
    m = Metrics(MODEL)
    first = [int(x) for x in np.sort(rng.integers(1, 1000, size=4))]
    for total in first:
        m.update_engine(EngineStats(retractions_total=total, prefix_cache_hit_tokens_total=2 * total))
    again = int(rng.integers(1, 50))  # a new engine counts from 0
    m.update_engine(EngineStats(retractions_total=again, prefix_cache_hit_tokens_total=2 * again))
    s = _samples(m.render()[0])
    assert _value(s, "mlaserve_retractions_total") == first[-1] + again
    assert _value(s, "mlaserve_prefix_cache_hit_tokens_total") == 2 * (first[-1] + again)
    seconds = [float(x) for x in np.sort(rng.uniform(0.1, 50.0, size=3))]
    for i, total in enumerate(seconds):
        m.update_engine(EngineStats(forward_steps_total=10 * (i + 1), forward_seconds_total=total))
    m.update_engine(EngineStats(forward_steps_total=3, forward_seconds_total=0.25))  # a new engine
    s = _samples(m.render()[0])
    assert _value(s, "mlaserve_engine_forward_steps_total") == 30 + 3
    assert _value(s, "mlaserve_engine_forward_seconds_total") == pytest.approx(seconds[-1] + 0.25)
    m.update_engine(EngineStats(num_running=1, kv_slots_used=0, kv_slots_total=0))  # no pool yet: ratio 0
    assert _value(_samples(m.render()[0]), "mlaserve_kv_cache_usage_ratio") == 0.0


def test_error_codes_are_bounded_label_values():
    m = Metrics(MODEL)
    m.on_error('Bad "code"\n{}')
    m.on_error("")
    m.on_error(ERR_OVERLOADED)
    m.count_error("model_not_found", "404")
    m.count_error("x" * 65, "4xx")
    s = _samples(m.render()[0])
    assert _value(s, "mlaserve_request_errors_total", code="other", status="unknown") == 3
    assert _value(s, "mlaserve_request_errors_total", code=ERR_OVERLOADED, status="503") == 1
    assert _value(s, "mlaserve_request_errors_total", code="model_not_found", status="404") == 1


def test_timing_state_is_bounded(monkeypatch):
    """Requests the server never ends (a bug) cannot grow the per-completion state without limit."""
    monkeypatch.setattr(metrics_mod, "MAX_TRACKED_COMPLETIONS", 16)
    m = Metrics(MODEL)
    for i in range(100):
        m.on_output(RequestOutput(f"r{i}", 0, [3], completion_tokens=1, arrival_time=1.0, first_token_time=1.5), 2.0)
    assert m.num_tracked == 16


def test_model_name_with_quotes_round_trips():
    name = 'org/model "v2" \\ q4'
    m = Metrics(name)
    for fam in text_string_to_metric_families(m.render()[0].decode()):
        for s in fam.samples:
            assert s.labels["model_name"] == name


def test_structure(loaded):
    metrics, _ = loaded
    text = metrics.render()[0].decode()
    assert structural_problems(text) == []
    families = {f.name for f in text_string_to_metric_families(text)}
    for required in ("mlaserve_num_requests_running", "mlaserve_num_requests_waiting", "mlaserve_kv_cache_usage_ratio",
                     "mlaserve_prompt_tokens", "mlaserve_prefix_cache_query_tokens", "mlaserve_generation_tokens",
                     "mlaserve_request_success", "mlaserve_requests_aborted", "mlaserve_retractions", "mlaserve_prefix_cache_hit_tokens",
                     "mlaserve_engine_forward_steps", "mlaserve_engine_forward_seconds", *HISTOGRAMS.values()):
        assert required in families
    for name in families:  # the module docstring lists every metric
        assert name in metrics_mod.__doc__


def test_structural_check_catches_bad_names():
    bad = "\n".join([
        "# HELP mlaserve_tokens Tokens.", "# TYPE mlaserve_tokens counter", f'mlaserve_tokens{{model_name="{MODEL}"}} 1',
        "# HELP vllm:x X.", "# TYPE vllm:x gauge", f'vllm:x{{model_name="{MODEL}"}} 1',
        "# TYPE mlaserve_y_total gauge", "mlaserve_y_total 2",
    ])
    problems = "\n".join(structural_problems(bad))
    for expected in ("mlaserve_tokens: counter without _total", "vllm:x: not ^mlaserve_",
                     "mlaserve_y_total: TYPE before (or without) HELP", "mlaserve_y_total: _total on a gauge",
                     "mlaserve_y_total: no model_name label", "vllm:x: colon in name"):
        assert expected in problems


def test_promtool_check_metrics(loaded):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian: apt-get install prometheus, or extract usr/bin/promtool "
                    "from its .deb); the structural check above still ran")
    metrics, _ = loaded
    body, _ = metrics.render()
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


# ---------------------------------------------------------------- the error-counting middleware
def _errors(m: Metrics) -> dict[tuple[str, str], float]:
    """(code, status) -> count of the error series that are not 0."""
    out = {}
    for (name, labels), value in _samples(m.render()[0]).items():
        if name == "mlaserve_request_errors_total" and value:
            d = dict(labels)
            out[d["code"], d["status"]] = value
    return out


@pytest.fixture
def counted_app() -> tuple[Metrics, TestClient]:
    """A Starlette app behind `ErrorCountingMiddleware` whose routes answer as the server's do: an engine
    refusal the route also reports with `on_error`, errors with and without a code, a stream that fails
    after its 200 (reported from inside the streaming body's task), a disconnect, a crash."""
    m = Metrics(MODEL)

    async def refused(_):
        m.on_error(ERR_OVERLOADED)  # as serving.handle does before answering the refusal
        return JSONResponse(error_body("full", "service_unavailable", None, "overloaded"), status_code=503)

    async def no_code(_):
        return JSONResponse(error_body("top_p must be <= 1", "invalid_request_error", "top_p", None), status_code=400)

    async def plain(_):
        return PlainTextResponse("no", status_code=418)

    async def stream(request):
        fail = request.query_params.get("fail") == "1"

        async def body():
            yield b"data: {}\n\n"
            if fail:
                m.on_error(ERR_ENGINE)  # as serving._events does, inside the streaming task
                yield b'data: {"error": {"code": "engine_error"}}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def gone(_):
        return Response(status_code=499)

    async def health(_):
        return JSONResponse(error_body("loading", "service_unavailable", None, "loading"), status_code=503)

    async def crash(_):
        raise RuntimeError("bug")

    app = Starlette(routes=[Route("/refused", refused), Route("/no-code", no_code), Route("/plain", plain),
                            Route("/stream", stream), Route("/gone", gone), Route("/health", health),
                            Route("/crash", crash)],
                    middleware=[Middleware(ErrorCountingMiddleware, metrics=lambda: m)])
    return m, TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(("path", "status", "expected"), [
    ("/refused", 503, {("overloaded", "503"): 1}),  # noted by the route and answered: once
    ("/no-code", 400, {("invalid_request_error", "400"): 1}),  # no code: the type
    ("/plain", 418, {("other", "418"): 1}),  # not an OpenAI body
    ("/stream?fail=1", 200, {("engine_error", "200"): 1}),  # failed after the 200: the noted code
    ("/stream", 200, {}),
    ("/gone", 499, {}),  # the client left: nothing was answered
    ("/health", 503, {}),  # the health report, not an error answer
    ("/crash", 500, {("internal_error", "500"): 1}),
    ("/no-such-route", 404, {("other", "404"): 1}),  # Starlette's own plain 404 (the server's has a code)
])
def test_middleware_counts_each_error_answer_once(counted_app, path, status, expected):
    m, client = counted_app
    before = _errors(m)
    assert client.get(path).status_code == status
    after = _errors(m)
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta == expected


def test_on_error_outside_a_request_counts_at_once():
    m = Metrics(MODEL)
    m.on_error(ERR_CONTEXT)
    assert _errors(m) == {(ERR_CONTEXT, "400"): 1}
