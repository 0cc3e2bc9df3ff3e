"""The engine core process boundary: EngineClient ⇄ pipe ⇄ run_engine_process, with a fake core.

`FakeCore` is a test double, not a model: completion i of a request echoes its prompt tokens
shifted by i * OFFSET, one token per step, after a short sleep per step. What is under test is the
boundary: routing of interleaved deltas, aborts, stats, crash and death reporting, shutdown. One
engine process is shared by the tests that leave it healthy; the ones that kill it get their own.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import struct
import threading
import time

import msgspec
import pytest

from engine.args import EngineArgs
from engine.client import EngineClient, _Frames
from engine.process import ALIVE_S, EXIT_ENGINE_CRASHED, EXIT_OK, EXIT_PARENT_GONE, STUCK_S, run_engine_process
from engine.messages import (
    ERR_ENGINE,
    ERR_INVALID,
    ERR_OVERLOADED,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    AbortRequest,
    EngineInfo,
    EngineReady,
    EngineStats,
    Fatal,
    GenerateRequest,
    Outputs,
    RequestOutput,
    Shutdown,
    Stats,
    StatsRequest,
    decode_from_engine,
    decode_to_engine,
    encode,
)
from executor.logprobs import TokenLogprob
from scheduler.sampling_params import SamplingParams

OFFSET = 1_000_000  # completion i's tokens are the prompt's + i * OFFSET
CRASH_TOKEN = 999_983  # a prompt starting with it makes step() raise
REFUSE_TOKEN = 999_979  # a prompt starting with it is refused as overloaded by add_request
HANG_TOKEN = 999_961  # a prompt starting with it blocks step() for good and makes failure() report a dead rank
STALL_TOKEN = 999_959  # a prompt starting with it blocks step() for good, and nothing reports why
DEAD_RANK = "rank 1 exited with code -9"


class FakeCore:
    """Echo core with the EngineCore interface; counts what it saw so tests can ask via stats()."""

    def __init__(self, args: EngineArgs, step_delay: float = 0.002, start_delay: float = 0.0,
                 fail_start: str | None = None, fail_with: type[Exception] = FileNotFoundError) -> None:
        time.sleep(start_delay)
        if fail_start is not None:
            raise fail_with(fail_start)
        self.model = args.model
        self.step_delay = step_delay
        self.reqs: dict[str, tuple[GenerateRequest, list[int]]] = {}  # rid -> (req, tokens emitted per index)
        self.aborted = 0
        self.finished = 0
        self.stats_calls = 0
        self.hung = threading.Event()

    def failure(self) -> str | None:
        """As a tensor-parallel core reports a rank that died while its step waits in a collective."""
        return DEAD_RANK if self.hung.is_set() else None

    def add_request(self, req: GenerateRequest) -> list[RequestOutput]:
        assert req.rid not in self.reqs, "the process sent one rid twice"
        if req.input_ids[0] == REFUSE_TOKEN:
            return [RequestOutput(req.rid, 0, [], finish_reason=FINISH_ERROR, error="queue full",
                                  error_code=ERR_OVERLOADED)]
        self.reqs[req.rid] = (req, [0] * req.params.n)
        return [RequestOutput(req.rid, 0, [], admitted=True)] if req.report_admission else []

    def abort(self, rid: str, index: int | None = None) -> list[RequestOutput]:
        entry = self.reqs.pop(rid, None) if index is None else self.reqs.get(rid)
        assert entry is not None, "the process aborted a request the core does not hold"
        if index is not None:  # one completion: it ends here, the others go on
            req, emitted = entry
            emitted[index] = req.params.max_tokens
            return [RequestOutput(rid, index, [], finish_reason=FINISH_ABORT)]
        self.aborted += 1
        req, emitted = entry
        # like a real core may: final outputs for some completions only; the process ends the rest
        return [RequestOutput(rid, i, [], finish_reason=FINISH_ABORT)
                for i in range(0, req.params.n, 2) if emitted[i] < req.params.max_tokens]

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        outs = []
        for rid, (req, emitted) in list(self.reqs.items()):
            if req.input_ids[0] == CRASH_TOKEN:
                raise ZeroDivisionError("fake core exploded")
            if req.input_ids[0] == HANG_TOKEN:
                self.hung.set()
                time.sleep(3600)  # the collective that never completes
            if req.input_ids[0] == STALL_TOKEN:
                time.sleep(3600)  # a hung device, a deadlock
            for i, k in enumerate(emitted):
                if k == req.params.max_tokens:
                    continue
                emitted[i] = k + 1
                done = emitted[i] == req.params.max_tokens
                outs.append(RequestOutput(rid, i, [expected_token(req, i, k)], prompt_tokens=len(req.input_ids),
                                          completion_tokens=k + 1, finish_reason=FINISH_LENGTH if done else None))
            if all(k == req.params.max_tokens for k in emitted):
                del self.reqs[rid]
                self.finished += 1
        return outs

    def has_work(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> EngineStats:
        self.stats_calls += 1
        return EngineStats(num_running=len(self.reqs), aborted_total=self.aborted,
                           finished_total={FINISH_LENGTH: self.finished, "stats_calls": self.stats_calls})

    def describe(self) -> EngineInfo:
        return EngineInfo(model=self.model, arch="fake", vocab_size=32000, context_length=4096, kv_slots=0,
                          kv_bytes_per_token=0, eos_token_ids=[])


def expected_token(req: GenerateRequest, index: int, k: int) -> int:
    return req.input_ids[k % len(req.input_ids)] + index * OFFSET


def make_req(rng: random.Random, rid: str, *, n: int = 1, max_tokens: int = 8,
             first: int | None = None) -> GenerateRequest:
    ids = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 12))]
    if first is not None:
        ids[0] = first
    return GenerateRequest(rid, ids, SamplingParams(n=n, max_tokens=max_tokens), arrival_time=time.time())


async def collect(client: EngineClient, req: GenerateRequest) -> list[RequestOutput]:
    return [out async for out in client.generate(req)]


def tokens_by_index(outs: list[RequestOutput]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for out in outs:
        got.setdefault(out.index, []).extend(out.new_token_ids)
    return got


# ---- fixtures: one event loop and one healthy engine process for the whole module ------------------


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 15):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def start(loop, args: EngineArgs | None = None, **fake_kwargs) -> EngineClient:
    factory = functools.partial(FakeCore, **fake_kwargs)
    args = args or EngineArgs(model="fake-model", startup_timeout=30)
    return run(loop, EngineClient.start(args, core_factory=factory), 40)


@pytest.fixture(scope="module")
def client(loop):
    client = start(loop)
    yield client
    run(loop, client.shutdown())


@pytest.fixture
def rng() -> random.Random:
    return random.Random()  # fresh inputs every run; a failure prints the tokens involved


# ---- the shared engine -----------------------------------------------------------------------------


def test_ready_info(client):
    info = client.info
    assert info.model == "fake-model" and info.vocab_size == 32000
    assert info.pid == client.pid != os.getpid()
    assert client.is_alive and client.exitcode is None


def test_concurrent_generate_each_gets_exactly_its_tokens(client, loop, rng):
    reqs = [make_req(rng, f"c{i}", n=rng.choice([1, 2, 3]), max_tokens=rng.randrange(1, 20)) for i in range(40)]

    async def go():
        return await asyncio.gather(*(collect(client, r) for r in reqs))

    for req, outs in zip(reqs, run(loop, go())):
        assert {o.rid for o in outs} == {req.rid}
        finals = [o for o in outs if o.finished]
        assert sorted(o.index for o in finals) == list(range(req.params.n)), "one final output per completion"
        assert all(o.finish_reason == FINISH_LENGTH for o in finals)
        assert outs[-1].finished, "the stream ends on a final output"
        want = {i: [expected_token(req, i, k) for k in range(req.params.max_tokens)] for i in range(req.params.n)}
        assert tokens_by_index(outs) == want


def test_abort_mid_stream_stops_request_and_core_sees_it(client, loop, rng):
    req = make_req(rng, "abort-me", n=3, max_tokens=100_000)

    async def go():
        before = await client.stats()
        outs = []
        async for out in client.generate(req):
            outs.append(out)
            if len(outs) == 6:
                await client.abort(req.rid)
        return before, outs, await client.stats()

    before, outs, after = run(loop, go())
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2] and all(o.finish_reason == FINISH_ABORT for o in finals)
    got = tokens_by_index(outs)
    for i, toks in got.items():  # a prefix of what the request would have produced, far from the end
        assert 2 <= len(toks) < 1000 and toks == [expected_token(req, i, k) for k in range(len(toks))]
    assert after.aborted_total == before.aborted_total + 1 and after.num_running == 0


def test_abort_of_one_completion_ends_it_alone(client, loop, rng):
    req = make_req(rng, "abort-one", n=3, max_tokens=40)

    async def go():
        outs = []
        async for out in client.generate(req):
            outs.append(out)
            if len(outs) == 6:
                await client.abort(req.rid, 1)
        return outs

    outs = run(loop, go())
    finals = {o.index: o.finish_reason for o in outs if o.finished}
    assert finals == {0: FINISH_LENGTH, 1: FINISH_ABORT, 2: FINISH_LENGTH}
    got = tokens_by_index(outs)
    assert len(got[0]) == len(got[2]) == 40 and len(got[1]) < 40


def test_held_counts_what_the_engine_has_not_ended_not_what_is_unread(client, loop, rng):
    """`held` drops as each completion's final output arrives from the engine, before its consumer takes it
    (a slow reader holds no place in the engine), and to 0 when a stream is dropped with completions left."""
    async def go():
        assert client.held == 0
        short = client.generate(make_req(rng, "held-short", n=2, max_tokens=5))
        first = await anext(short)  # then not read: the rest waits in its queue
        long = client.generate(make_req(rng, "held-long", n=3, max_tokens=100_000))
        await anext(long)
        assert first.rid == "held-short" and 3 <= client.held <= 5  # (the short one may have ended already)
        deadline = time.monotonic() + 10
        while client.held != 3:  # the short request's two ended in the engine, unread
            assert time.monotonic() < deadline, client.held
            await asyncio.sleep(0.01)
        rest = [out async for out in short]
        assert sum(o.finished for o in rest) == 2 and client.held == 3
        await long.aclose()  # dropped with its three running: aborted, no longer held
        assert client.held == 0

    run(loop, go())


def test_closing_or_cancelling_the_consumer_aborts(client, loop, rng):
    async def go():
        base = (await client.stats()).aborted_total
        gen = client.generate(make_req(rng, "close-me", max_tokens=100_000))
        await gen.__anext__()
        await gen.aclose()
        after_close = await client.stats()

        got_one = asyncio.Event()

        async def consume():
            async for _ in client.generate(make_req(rng, "cancel-me", n=2, max_tokens=100_000)):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after_cancel = await client.stats()
        again = await collect(client, make_req(rng, "after-cancel", max_tokens=3))
        return base, after_close, after_cancel, again

    base, after_close, after_cancel, again = run(loop, go())
    assert after_close.aborted_total == base + 1 and after_close.num_running == 0
    assert after_cancel.aborted_total == base + 2 and after_cancel.num_running == 0
    assert sum(len(o.new_token_ids) for o in again) == 3


def test_stats_round_trip_with_concurrent_calls(client, loop, rng):
    async def go():
        running = [asyncio.create_task(collect(client, make_req(rng, f"s{i}", max_tokens=30))) for i in range(5)]
        replies = await asyncio.gather(*(client.stats() for _ in range(25)))
        await asyncio.gather(*running)
        return replies

    replies = run(loop, go())
    calls = [r.finished_total["stats_calls"] for r in replies]
    # sent in this order over one pipe, so each caller must get the reply to its own request (the engine may
    # push its stats unasked between them)
    assert calls == sorted(set(calls)) and len(calls) == 25
    assert len({r.request_id for r in replies}) == 25
    assert all(isinstance(r, EngineStats) and 0 <= r.num_running <= 5 for r in replies)


def test_refused_request_ends_with_its_error(client, loop, rng):
    outs = run(loop, collect(client, make_req(rng, "refused", n=3, first=REFUSE_TOKEN)))
    assert len(outs) == 1 and outs[0].error_code == ERR_OVERLOADED and outs[0].finish_reason == FINISH_ERROR
    assert run(loop, client.stats()).num_running == 0


def test_a_request_no_message_can_carry_fails_alone(client, loop, rng):
    """A value past 64 bits (the server's checks would refuse it) cannot be encoded: that request ends with
    an error, and the pipe's writer, which every other request needs, keeps going."""
    bad = make_req(rng, "huge", n=2)
    bad = msgspec.structs.replace(bad, params=msgspec.structs.replace(bad.params, top_k=2**70))
    outs = run(loop, collect(client, bad))
    assert len(outs) == 1 and outs[0].finish_reason == FINISH_ERROR and outs[0].error_code == ERR_INVALID, outs
    assert client.held == 0
    good = make_req(rng, "after-huge", max_tokens=4)
    assert tokens_by_index(run(loop, collect(client, good))) == {0: [expected_token(good, 0, k) for k in range(4)]}


def test_duplicate_running_rid_is_refused(client, loop, rng):
    async def go():
        gen = client.generate(make_req(rng, "dup", max_tokens=100_000))
        await gen.__anext__()
        with pytest.raises(ValueError, match="dup"):
            await collect(client, make_req(rng, "dup"))
        await gen.aclose()

    run(loop, go())


# ---- engines that die --------------------------------------------------------------------------


def assert_all_failed(results: list[list[RequestOutput]], reqs: list[GenerateRequest], match: str) -> None:
    for req, outs in zip(reqs, results):
        last = outs[-1]
        assert last.rid == req.rid and last.finish_reason == FINISH_ERROR and last.error_code == ERR_ENGINE
        assert match in last.error, last.error
        assert all(not o.finished for o in outs[:-1])


async def start_streams(client: EngineClient, reqs: list[GenerateRequest]):
    """Starts every request and returns once each has produced a token, with the collecting tasks."""
    results: list[list[RequestOutput]] = [[] for _ in reqs]
    started = [asyncio.Event() for _ in reqs]

    async def consume(i: int) -> list[RequestOutput]:
        async for out in client.generate(reqs[i]):
            results[i].append(out)
            started[i].set()
        started[i].set()
        return results[i]

    tasks = [asyncio.create_task(consume(i)) for i in range(len(reqs))]
    for ev in started:
        await ev.wait()
    return tasks


async def fail_under_streams(client: EngineClient, rng: random.Random, reqs: list[GenerateRequest],
                             fatal: GenerateRequest, dead_reason: str):
    """Streams `reqs`, then sends `fatal`, whose step ends the engine: returns `fatal`'s outputs, the
    streams', the seconds from sending it until every stream ended, and a later request's outputs;
    the client then reports `dead_reason`, and is shut down."""
    tasks = await start_streams(client, reqs)
    t0 = time.monotonic()
    first = await collect(client, fatal)
    results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    later = await collect(client, make_req(rng, "later"))
    with pytest.raises(RuntimeError, match=re.escape(dead_reason)):
        await client.stats()
    await client.shutdown()
    return first, results, elapsed, later


def test_crash_in_step_fails_every_pending_request(loop, rng):
    client = start(loop)
    reqs = [make_req(rng, f"x{i}", n=2, max_tokens=100_000) for i in range(6)]
    boom = make_req(rng, "boom", first=CRASH_TOKEN)
    crash, results, elapsed, later = run(loop, fail_under_streams(client, rng, reqs, boom, "exploded"))
    assert elapsed < 2.0
    assert_all_failed([crash, *results, later], [make_req(rng, "boom"), *reqs, make_req(rng, "later")],
                      "ZeroDivisionError: fake core exploded")
    assert not client.is_alive and client.exitcode == EXIT_ENGINE_CRASHED


def test_killed_process_fails_every_pending_request(loop, rng):
    client = start(loop)
    reqs = [make_req(rng, f"k{i}", max_tokens=100_000) for i in range(5)]

    async def go():
        tasks = await start_streams(client, reqs)
        t0 = time.monotonic()
        os.kill(client.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        later = await collect(client, make_req(rng, "later"))
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            await client.stats()
        await client.shutdown()
        return results, elapsed, later

    results, elapsed, later = run(loop, go())
    assert elapsed < 2.0
    assert_all_failed([*results, later], [*reqs, make_req(rng, "later")], f"exit code {-signal.SIGKILL}")
    assert not client.is_alive and client.exitcode == -signal.SIGKILL


def test_a_step_blocked_by_a_reported_failure_fails_every_pending_request(loop, rng):
    """A step that cannot return (a dead rank's collective) while the core reports why: the watchdog
    ends the engine after STUCK_S with that reason, instead of leaving requests waiting for minutes."""
    client = start(loop)
    reqs = [make_req(rng, f"h{i}", n=2, max_tokens=100_000) for i in range(4)]
    hang = make_req(rng, "hang", first=HANG_TOKEN)
    hung, results, elapsed, later = run(loop, fail_under_streams(client, rng, reqs, hang, DEAD_RANK))
    assert STUCK_S <= elapsed < STUCK_S + 3.0
    assert_all_failed([hung, *results, later], [make_req(rng, "hang"), *reqs, make_req(rng, "later")],
                      f"{DEAD_RANK} (the step stayed blocked")
    assert not client.is_alive and client.exitcode == EXIT_ENGINE_CRASHED


def test_a_step_past_the_watchdog_timeout_fails_every_pending_request(loop, rng):
    """A step that never returns and nothing reports why (a hung device): --watchdog-timeout ends the
    engine with a reason that names the flag, instead of leaving the requests hanging for good."""
    limit = 1.5
    client = start(loop, EngineArgs(model="fake-model", watchdog_timeout=limit))
    reqs = [make_req(rng, f"w{i}", n=2, max_tokens=100_000) for i in range(3)]
    stall = make_req(rng, "stall", first=STALL_TOKEN)
    stalled, results, elapsed, later = run(loop, fail_under_streams(client, rng, reqs, stall, "--watchdog-timeout"))
    assert limit <= elapsed < limit + 3.0
    assert_all_failed([stalled, *results, later], [make_req(rng, "stall"), *reqs, make_req(rng, "later")],
                      f"past --watchdog-timeout ({limit:g} s)")
    assert not client.is_alive and client.exitcode == EXIT_ENGINE_CRASHED


@pytest.mark.parametrize("limit", [None, 0.0], ids=["default-watchdog-timeout", "no-limit"])
def test_a_slow_step_without_a_failure_is_left_to_finish(loop, rng, limit: float | None):
    """The watchdog does not end a step that is only long (a big prefill) when nothing has failed, at the
    default --watchdog-timeout nor with 0, which is no limit rather than a limit of 0 s."""
    args = EngineArgs(model="fake-model") if limit is None else EngineArgs(model="fake-model", watchdog_timeout=limit)
    client = start(loop, args, step_delay=STUCK_S + 1.0)
    req = make_req(rng, "slow", max_tokens=2)

    async def go():
        outs = await collect(client, req)
        await client.shutdown()
        return outs

    outs = run(loop, go())
    assert tokens_by_index(outs) == {0: [expected_token(req, 0, 0), expected_token(req, 0, 1)]}
    assert outs[-1].finish_reason == FINISH_LENGTH and client.exitcode == EXIT_OK


def test_a_frozen_engine_fails_every_pending_request(loop, rng):
    """An engine process stopped without dying (SIGSTOP) sends nothing, not even its watchdog's Alive: after
    `silent_s` the client fails every pending request and kills it, instead of waiting for good."""
    client = start(loop)
    client.silent_s = ALIVE_S + 3.0
    reqs = [make_req(rng, f"f{i}", max_tokens=100_000) for i in range(3)]

    async def go():
        tasks = await start_streams(client, reqs)
        os.kill(client.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        results = await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        later = await collect(client, make_req(rng, "later"))
        await client.shutdown()
        return results, elapsed, later

    results, elapsed, later = run(loop, go(), timeout=40)
    assert client.silent_s - 1.0 <= elapsed < client.silent_s + 3.0
    assert_all_failed([*results, later], [*reqs, make_req(rng, "later")], "engine core stopped answering")
    assert client.exitcode == -signal.SIGKILL


def test_a_quiet_engine_is_not_taken_for_a_frozen_one(loop, rng):
    """Idle, or inside a step longer than `silent_s`, the engine says nothing else, and its Alive keeps
    the client from failing it."""
    client = start(loop, step_delay=ALIVE_S + 4.0)
    client.silent_s = ALIVE_S + 3.0
    req = make_req(rng, "slow", max_tokens=1)

    async def go():
        await asyncio.sleep(client.silent_s + 1.0)  # idle
        outs = await collect(client, req)  # one step of ALIVE_S + 4 s
        await client.shutdown()
        return outs

    outs = run(loop, go(), timeout=60)
    assert tokens_by_index(outs) == {0: [expected_token(req, 0, 0)]}
    assert outs[-1].finish_reason == FINISH_LENGTH and client.exitcode == EXIT_OK


def test_a_pause_of_the_server_and_the_engine_together_is_no_frozen_engine(loop, rng):
    """`docker pause`, a cgroup freezer or a paused VM stop both processes: on resuming, the client's late
    silence check found the pipe empty (the engine had had no time to speak) and killed a healthy engine. A
    check that comes late finds the server held up too, and the silence counts from then."""
    client = start(loop)
    client.silent_s = ALIVE_S + 3.0
    req = make_req(rng, "after-pause", max_tokens=3)

    async def go():
        await asyncio.sleep(0.5)
        os.kill(client.pid, signal.SIGSTOP)
        time.sleep(client.silent_s + 2.0)  # this process (the server's loop) held up as long
        await asyncio.sleep(0.1)  # the loop resumes first: its overdue check runs before the engine can speak
        os.kill(client.pid, signal.SIGCONT)
        outs = await collect(client, req)
        await client.shutdown()
        return outs

    outs = run(loop, go(), timeout=60)
    assert tokens_by_index(outs) == {0: [expected_token(req, 0, k) for k in range(3)]}
    assert outs[-1].finish_reason == FINISH_LENGTH and client.exitcode == EXIT_OK


@pytest.mark.parametrize("pause", [0.0, 10.0], ids=["no-pause", "paused"])
def test_the_watchdog_does_not_take_a_pause_of_its_process_for_the_step(monkeypatch, pause: float):
    """The watchdog ends a step past --watchdog-timeout (4 s here). A pause of the whole engine process inside
    a step (SIGSTOP, `docker pause`) stopped the watchdog too, and the watchdog, resuming late, took the pause
    for the step's own time and ended a healthy engine. On a made-up clock: a step that has run 3 s besides a
    10 s pause is left to run; without the pause, a step of over 4 s is still ended."""
    from engine import process

    clock = [1000.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])

    class Ended(Exception):
        pass

    def leave(code: int, hooks: bool = True) -> None:
        raise Ended(code)

    monkeypatch.setattr(process, "_leave", leave)

    class Done:  # the watchdog's done.wait(WATCH_S): the clock moves by it, and by the pause once
        def __init__(self, waits: int) -> None:
            self.waits, self.calls = waits, 0

        def wait(self, timeout: float) -> bool:
            self.calls += 1
            clock[0] += timeout + (pause if self.calls == 3 else 0.0)
            return self.calls > self.waits

        def is_set(self) -> bool:
            return False

    class Conn:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send_bytes(self, data: bytes) -> None:
            self.sent.append(data)

    loop = process._EngineLoop(Conn(), FakeCore)
    loop.step_since = clock[0]
    steps = 12 if pause else 20  # 3 s of the step's own, or 5 s
    if pause:
        loop._watch(None, 4.0, Done(steps))
        assert not loop.fatal_sent
    else:
        with pytest.raises(Ended):
            loop._watch(None, 4.0, Done(steps))
        assert loop.fatal_sent and b"past --watchdog-timeout" in loop.conn.sent[-1]


def test_startup_failure_raises_with_the_childs_message(loop):
    with pytest.raises(RuntimeError, match=r"failed to start: FileNotFoundError: no such model /nope/m\.gguf"):
        start(loop, fail_start="no such model /nope/m.gguf")


def test_a_start_past_the_startup_timeout_is_ended_with_the_flag_named(loop):
    """--startup-timeout (EngineArgs.startup_timeout) bounds the model's load; the error names the flag. The
    process it started is gone afterwards (no engine left loading in the background)."""
    args = EngineArgs(model="fake-model", startup_timeout=0.5)
    factory = functools.partial(FakeCore, start_delay=20)
    children = set(mp.active_children())
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start within 0\.5 s: raise --startup-timeout"):
        run(loop, EngineClient.start(args, core_factory=factory), 15)
    assert time.monotonic() - t < 10
    assert not [p for p in mp.active_children() if p not in children]


@pytest.mark.parametrize("error, traceback", [(ValueError, False), (FileNotFoundError, False), (RuntimeError, True)])
def test_a_user_mistake_at_startup_is_left_to_the_starter_a_bug_logged_with_its_traceback(loop, capfd, error,
                                                                                          traceback):
    """A wrong setting or file (ValueError, OSError) is reported by its message alone, raised to whoever
    started the engine (the server prints it once); anything else is a bug, logged with where it was raised."""
    with pytest.raises(RuntimeError, match=rf"failed to start: {error.__name__}: filter layer 100 is outside"):
        start(loop, fail_start="filter layer 100 is outside the model's 30 layers", fail_with=error)
    err = capfd.readouterr().err
    assert ("filter layer 100" in err) == traceback, err
    assert ("Traceback (most recent call last)" in err) == traceback, err


def test_shutdown_exits_cleanly_and_ends_pending_requests(loop, rng):
    client = start(loop)
    reqs = [make_req(rng, f"d{i}", max_tokens=100_000) for i in range(3)]

    async def go():
        tasks = await start_streams(client, reqs)
        await client.shutdown(timeout=5)
        return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    results = run(loop, go())
    assert time.monotonic() - t0 < 5
    assert_all_failed(results, reqs, "shut down")
    assert client.exitcode == EXIT_OK and not client.is_alive
    run(loop, client.shutdown())  # a second call is a no-op


# ---- the client's reading of the pipe: framing, split messages, a broken or closed pipe -------------


def test_frames_reassemble_what_connection_sent_split_anywhere(rng):
    """`_Frames` against the framing `multiprocessing.connection.Connection.send_bytes` writes (the
    oracle): messages of every size, cut into random pieces, come out whole and in order."""
    a, b = socket.socketpair()
    sender = mp.connection.Connection(a.detach())
    messages = [rng.randbytes(n) for n in (0, 1, 3, 4, 5, 16_383, 16_384, 16_385, 70_000, 300_000)]
    rng.shuffle(messages)
    done = threading.Event()

    def send():
        for m in messages:
            sender.send_bytes(m)
        sender.close()
        done.set()

    threading.Thread(target=send, daemon=True).start()
    raw = bytearray()
    while chunk := b.recv(1 << 16):
        raw += chunk
    assert done.wait(5)
    b.close()
    frames, got, at = _Frames(), [], 0
    while at < len(raw):
        n = rng.choice([1, 2, 3, 5, 4096, rng.randrange(1, 200_000)])
        got += frames.feed(bytes(raw[at:at + n]))
        at += n
    assert got == messages
    big = rng.randbytes(10)  # the 12-byte header a payload over 2 GiB gets, on a small payload
    assert _Frames().feed(struct.pack("!i", -1) + struct.pack("!Q", len(big)) + big) == [big]
    with pytest.raises(ValueError, match="length of -2"):
        _Frames().feed(struct.pack("!i", -2) + b"xx")


def _scripted_engine(conn, script: str) -> None:
    """Speaks the pipe protocol by hand in place of the engine process: ready, then the first request's
    fate by `script`. 'split': a ~1 MB output written in pieces with pauses, the last piece carrying a
    second message too, then waits for Shutdown; 'garbage': bytes that are no message; 'close': closes
    its end of the pipe and stays alive; 'last_words': one token and a crash report, then exits with 3."""
    conn.send_bytes(encode(EngineReady(EngineInfo(model="m", arch="fake", vocab_size=320, context_length=64,
                                                  kv_slots=0, kv_bytes_per_token=0, eos_token_ids=[]))))
    req = decode_to_engine(conn.recv_bytes())
    if script == "split":
        data = b"".join(struct.pack("!i", len(m)) + m for m in (
            encode(Outputs([RequestOutput(req.rid, 0, list(range(200_000)))])),
            encode(Outputs([RequestOutput(req.rid, 0, [7], finish_reason=FINISH_LENGTH)]))))
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        for at in range(0, len(data), 65_537):
            sock.sendall(data[at:at + 65_537])
            time.sleep(0.005)
        while not isinstance(decode_to_engine(conn.recv_bytes()), Shutdown):
            pass
    elif script == "garbage":
        conn.send_bytes(b"\x93 no message of ours")
        time.sleep(60)
    elif script == "close":
        conn.close()
        time.sleep(60)
    elif script == "last_words":
        conn.send_bytes(encode(Outputs([RequestOutput(req.rid, 0, [5])])))
        conn.send_bytes(encode(Fatal("fake core: its last words")))
        os._exit(3)


def _start_scripted(loop, script: str) -> EngineClient:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_scripted_engine, args=(child, script), daemon=True)
    proc.start()
    child.close()
    client = EngineClient(proc, parent, loop)
    run(loop, asyncio.shield(client._ready), 30)
    return client


def test_client_takes_a_message_that_arrives_in_pieces(loop, rng):
    client = _start_scripted(loop, "split")
    outs = run(loop, collect(client, make_req(rng, "big")))
    assert [o.new_token_ids for o in outs] == [list(range(200_000)), [7]]
    assert outs[-1].finish_reason == FINISH_LENGTH
    run(loop, client.shutdown())
    assert client.exitcode == 0


@pytest.mark.parametrize("script, reason", [("garbage", "cannot read the engine core's messages"),
                                            ("close", "closed its pipe")])
def test_client_reports_a_broken_or_closed_pipe(loop, rng, script, reason):
    """A message that does not decode ends the engine (killed: the protocol is broken); a pipe closed by
    a process that stays alive is reported within a second or so. Either way what was pending ends with
    the reason, and nothing hangs."""
    client = _start_scripted(loop, script)
    t0 = time.monotonic()
    outs = run(loop, collect(client, make_req(rng, "pending", max_tokens=100)))
    assert time.monotonic() - t0 < 5
    assert [o.finish_reason for o in outs] == [FINISH_ERROR] and reason in outs[0].error
    assert outs[0].error_code == ERR_ENGINE and not client.is_alive
    run(loop, client.shutdown(timeout=1))
    assert client.exitcode == -signal.SIGKILL  # killed for the garbage, or by shutdown after the close


def test_what_the_engine_wrote_before_dying_is_read_before_its_death_is_reported(loop, rng):
    """The pipe's data and the process's sentinel can become readable together, and the loop may run
    the sentinel's callback first: the process is then reported only after what it wrote (its crash
    report) is read. Made deterministic here: the process ends while the loop is not running, and the
    sentinel's callback is run before the pipe's."""
    client = _start_scripted(loop, "last_words")
    task = loop.create_task(collect(client, make_req(rng, "dying", max_tokens=100)))
    loop.run_until_complete(asyncio.sleep(0))  # generate() has registered the stream and queued the request
    client._proc.join(15)  # the writer thread sends it; the process answers and exits
    assert client.exitcode == 3
    client._process_ended()
    outs = run(loop, task)
    assert [o.new_token_ids for o in outs] == [[5], []]
    assert outs[-1].finish_reason == FINISH_ERROR and outs[-1].error == "fake core: its last words"
    run(loop, client.shutdown(timeout=1))


# ---- the loop itself, in a thread: the raw protocol -----------------------------------------------


def test_loop_batches_outputs_per_step_and_exits_when_parent_goes(rng):
    ours, theirs = mp.Pipe()
    exit_code: list[object] = []

    def child():
        try:
            run_engine_process(EngineArgs(model="m"), theirs, functools.partial(FakeCore, start_delay=0.2))
            exit_code.append(EXIT_OK)
        except SystemExit as e:
            exit_code.append(e.code)

    thread = threading.Thread(target=child, daemon=True)
    thread.start()
    reqs = [make_req(rng, f"b{i}", max_tokens=5) for i in range(3)]
    for req in reqs:  # all waiting before the loop's first look at the pipe
        ours.send_bytes(encode(req))
    assert isinstance(decode_from_engine(ours.recv_bytes()), EngineReady)
    messages = []
    while sum(o.finished for m in messages for o in m.items) < 3:
        assert ours.poll(5)
        msg = decode_from_engine(ours.recv_bytes())
        if not isinstance(msg, Stats):  # (pushed after each STATS_PUSH_S of busy steps: a loaded machine's
            messages.append(msg)         # five steps took that long, and CI failed on one)
    assert all(isinstance(m, Outputs) for m in messages)
    assert len(messages) == 5 and all(len(m.items) == 3 for m in messages), "one message per step"
    ours.close()  # the server goes away
    thread.join(5)
    assert exit_code == [EXIT_PARENT_GONE]


# ---- the typed codec on the pipe ---------------------------------------------------------------------


def test_every_message_round_trips_typed(rng):
    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={3: -2.5, 17: 1.0}, seed=2**63 + 5, n=2,
                            max_tokens=9, stop_token_ids=(4, 8), logprobs=True, top_logprobs=2, prompt_logprobs=1)
    lp = TokenLogprob(7, float("-inf"), [(7, float("-inf")), (2, -0.25)])
    out = RequestOutput("r", 1, [5, 6], logprobs=[lp, TokenLogprob(6, -1.5)], prompt_logprobs=[None, lp],
                        finish_reason=FINISH_LENGTH, prompt_tokens=3, completion_tokens=2, first_token_time=1.5)
    info = EngineInfo(model="m", arch="deepseek", vocab_size=320, context_length=64, kv_slots=128,
                      kv_bytes_per_token=1152, eos_token_ids=[1, 2], pid=77)
    to_engine = [GenerateRequest("r", [1, 2, 3], params, 12.5), AbortRequest("r"), StatsRequest(4), Shutdown()]
    from_engine = [EngineReady(info), Outputs([out]), Stats(EngineStats(request_id=4, finished_total={"stop": 2})),
                   Fatal("boom")]
    for msg in to_engine:
        assert decode_to_engine(encode(msg)) == msg
    for msg in from_engine:
        assert decode_from_engine(encode(msg)) == msg
    back = decode_from_engine(encode(Outputs([out]))).items[0]
    assert back.logprobs[0].logprob == float("-inf") and back.logprobs[0].top[1] == (2, -0.25)
    # each direction decodes only its own messages
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(encode(Fatal("x")))
    with pytest.raises(msgspec.ValidationError):
        decode_from_engine(encode(Shutdown()))


def test_unknown_fields_and_kinds_are_errors():
    good = msgspec.msgpack.decode(encode(StatsRequest(1)))
    with pytest.raises(msgspec.ValidationError, match="extra"):
        decode_to_engine(msgspec.msgpack.encode({**good, "extra": 1}))
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(msgspec.msgpack.encode({**good, "type": "Reboot"}))
    with pytest.raises(msgspec.ValidationError):  # a field of the wrong type is not coerced
        decode_to_engine(msgspec.msgpack.encode({**good, "request_id": "1"}))
    req = msgspec.msgpack.decode(encode(GenerateRequest("r", [1], SamplingParams())))
    req["params"]["temprature"] = 0.5  # a typo in a nested struct
    with pytest.raises(msgspec.ValidationError, match="temprature"):
        decode_to_engine(msgspec.msgpack.encode(req))


def test_undecodable_message_is_a_reported_crash_not_a_hang(rng):
    """The engine loop meets bytes that are not a ToEngine message: the protocol is broken, so it fails
    what is pending with an engine error, says Fatal and exits as crashed."""
    ours, theirs = mp.Pipe()
    exit_code: list[object] = []

    def child():
        try:
            run_engine_process(EngineArgs(model="m"), theirs, functools.partial(FakeCore, step_delay=0.05))
            exit_code.append(EXIT_OK)
        except SystemExit as e:
            exit_code.append(e.code)

    thread = threading.Thread(target=child, daemon=True)
    thread.start()
    assert isinstance(decode_from_engine(ours.recv_bytes()), EngineReady)
    ours.send_bytes(encode(make_req(rng, "pending", max_tokens=1000)))
    ours.send_bytes(msgspec.msgpack.encode({"type": "Reboot"}))
    got = []
    while not got or not isinstance(got[-1], Fatal):
        assert ours.poll(5), "the engine loop went silent"
        got.append(decode_from_engine(ours.recv_bytes()))
    errors = [o for m in got if isinstance(m, Outputs) for o in m.items if o.finish_reason == FINISH_ERROR]
    assert [o.rid for o in errors] == ["pending"] and errors[0].error_code == ERR_ENGINE
    assert "Reboot" in got[-1].reason or "type" in got[-1].reason
    thread.join(5)
    assert exit_code == [EXIT_ENGINE_CRASHED]


def test_freeze_gc_heap_takes_the_objects_alive_out_of_collections() -> None:
    """Run in a fresh interpreter (freezing pytest's own heap would outlive the test): the objects alive
    when it is called are frozen, a full collection then walks only what came after, and at exit they
    are collectable again."""
    import subprocess
    import sys

    code = (
        "import gc, atexit\n"
        "from engine.process import freeze_gc_heap\n"
        "keep = [[i] for i in range(50000)]\n"
        "freeze_gc_heap()\n"
        "frozen = gc.get_freeze_count()\n"
        "assert frozen >= 50000, frozen\n"
        "new = [[i] for i in range(10)]\n"
        "gc.collect()\n"
        "assert gc.get_freeze_count() == frozen\n"  # a collection leaves the frozen objects alone
        "atexit._run_exitfuncs()\n"
        "assert gc.get_freeze_count() == 0\n"  # unfrozen at exit
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


GLOO_PEER_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                   "[127.0.0.1]:38319: Connection reset by peer. ... GLHF!")


def test_a_lost_peer_is_told_to_clients_by_the_ranks_account_not_gloo_text():
    """A rank killed mid-step fails the collective with gloo's text (a build path, an address, a joke):
    clients are told which rank ended when the ranks know by then, else a short line; other crashes as
    they are."""
    from types import SimpleNamespace

    from engine.process import _EngineLoop

    def cause(exc: Exception, answers: list) -> str:
        core = SimpleNamespace(failure=lambda: answers.pop(0) if answers else None)
        return _EngineLoop._cause(SimpleNamespace(core=core), exc)

    assert cause(ZeroDivisionError("boom"), ["rank 1 exited with code -9"]) == "ZeroDivisionError: boom"
    lost = RuntimeError(f"tensor parallelism: a rank stopped answering (RuntimeError: {GLOO_PEER_RESET})")
    assert cause(lost, [None, None, "rank 1 exited with code -9"]) == "rank 1 exited with code -9"
    short = cause(RuntimeError(GLOO_PEER_RESET), [])
    assert short.startswith("a peer rank is gone: its connection closed") and "gloo" not in short
    # rank 0's own broadcast error (a --dp replica's ranks): the ranks' account too, not "RuntimeError: ..."
    ours = RuntimeError("tensor parallelism: a rank stopped answering rank 0's broadcast (its process or ...)")
    assert cause(ours, ["rank 1 exited with code -9"]) == "rank 1 exited with code -9"


def test_a_broadcast_that_lost_a_rank_keeps_gloo_text_out_of_the_ranks_account(monkeypatch, caplog):
    """Rank 0's broadcast failing is the ranks' account (`failure()`) that clients are told; it carried
    gloo's text (seen when SIGTERM ended node 1 of a two-node --tp 2): now a short line, the text logged."""
    import threading

    import executor.distributed as distributed

    def lost(msg, group):
        raise RuntimeError(GLOO_PEER_RESET)

    monkeypatch.setattr(distributed, "broadcast_message", lost)
    leader = distributed.Leader.__new__(distributed.Leader)
    leader._error, leader._lock, leader._stopped, leader.group = None, threading.Lock(), threading.Event(), None
    with pytest.raises(RuntimeError) as e:
        leader._send(distributed.Ping())
    why = leader.failure()
    assert why is not None and why.startswith("a rank stopped answering") and "gloo" not in why and "pair.cc" not in why
    assert "gloo" not in str(e.value) and GLOO_PEER_RESET in caplog.text


def test_an_admission_is_sent_before_the_step_that_runs_the_request(loop, rng):
    """The core's answer to a new request (a stream's admission: its headers go then) is sent at once, not
    with the outputs of the step after it, which may be a long prefill (a 5000-token prompt in one chunk held
    a stream's headers 15 s)."""
    client = start(loop, step_delay=3.0)
    try:
        async def first_two() -> tuple[list[RequestOutput], list[float]]:
            req = GenerateRequest(f"r{rng.randrange(10**9)}", [5, 6, 7], SamplingParams(max_tokens=1),
                                  report_admission=True)
            outs, times, t0 = [], [], time.monotonic()
            async for out in client.generate(req):
                outs.append(out)
                times.append(time.monotonic() - t0)
            return outs, times

        outs, times = run(loop, first_two(), 30)
        assert outs[0].admitted and not outs[0].new_token_ids and outs[-1].finish_reason == FINISH_LENGTH
        assert times[0] < 1.5 <= times[-1], times  # (the step takes 3 s)
    finally:
        run(loop, client.shutdown())
