"""`EngineClient`: the server side's handle on the engine core process (see `engine_process`).

    asyncio code ─generate/abort/stats─▶ EngineClient ─writer thread─▶ pipe ─▶ engine core process
    per-request asyncio.Queue ◀─ event loop reader ◀─ pipe ◀───────────────────────┘

Threads and ownership (which calls are safe from where):
- Every `async` method, and `start`, must run on ONE event loop: the loop that awaited `start()`.
  The per-request queues, stats futures and the stream table belong to that loop and are touched
  only by it; there are no locks.
- `is_alive`, `info`, `pid`, `exitcode` and `held` are plain reads, safe from any thread; `kill` is
  one `os.kill`, safe from a signal handler.
- The pipe is read on the event loop itself (`add_reader`), never blocking: each time it is readable
  the loop takes what is there and dispatches every whole message, in the order the engine sent them.
  A streamed token thus wakes one thread of this process, not a reader thread that then wakes the loop:
  on a machine whose cores also run the model, every wake-up here is time taken from the forward. The
  process sentinel is watched the same way.
- The writer thread alone calls `conn.send_bytes`, fed by a `queue.SimpleQueue`; so a large prompt never
  stalls the event loop while the engine is busy in a step (and the two sides can never deadlock
  with both writing into full pipes). Sends keep the order of the calls.
- The pipe is closed only after the writer thread has ended and the loop stopped reading it.

Request life: `generate(req)` registers a queue, sends the request, and yields `RequestOutput`
deltas until every completion (0..n-1) has its final output. An error output (`finish_reason ==
"error"`, e.g. refused as overloaded, or `ERR_ENGINE`) ends the whole request. A consumer that
stops early (`aclose()`, cancellation, or dropping the iterator) aborts the request in the engine.
`held` counts the completions the engine still holds (+n at the send, -1 at each final output as it
arrives from the engine, whether or not its consumer has taken it yet, the rest when the stream ends):
what the engine counts against its --max-running-requests + --max-queued-requests, known without asking
it, which a router of several engines (`engine.replicas`) balances on.

Death: EOF on the pipe, the process sentinel, the engine's own `Fatal`, or a message that does not
decode as a `FromEngine` (the protocol is broken: the process is killed) marks the client dead: every pending request gets an `ERR_ENGINE` error output (nothing hangs), later
`generate` calls yield the same error at once, and `stats()` raises RuntimeError. `fail(reason)` does
the same from outside (the engine is killed), and `on_dead` hears of every death once. An engine that
sends nothing for `EngineClient.silent_s` (it sends `Alive` every engine.process.ALIVE_S while it has
nothing else to say) is stopped or frozen: it is failed so, rather than waited for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import multiprocessing as mp
import queue
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Collection

from engine.args import EngineArgs
from engine.process import HELD_UP_S, CoreFactory, run_engine_process
from engine.messages import (
    ERR_ENGINE,
    ERR_INVALID,
    ERR_SHUTDOWN,
    FINISH_ERROR,
    AbortRequest,
    EngineInfo,
    EngineReady,
    EngineStartupError,
    EngineStats,
    Fatal,
    FromEngine,
    GenerateRequest,
    Outputs,
    RequestOutput,
    Shutdown,
    StartupError,
    Stats,
    StatsRequest,
    ToEngine,
    decode_from_engine,
    encode,
)

logger = logging.getLogger(__name__)

SILENCE_CHECK_S = 1.0  # how often the loop looks at the silence


def set_cpu_wait_policy(environ: Any) -> None:
    """How long torch's OpenMP threads spin before they sleep between parallel regions, for a process
    that has not imported torch yet (a value the user set is kept).

    libgomp's default spins ~300k iterations. On a machine whose cores are shared (the server's own
    threads, the C++ expert pool, any other busy process) a spinning worker holds a core that the
    thread everyone waits for needs. Measured by bench/cpu_contention.py on 2 cores, 64 tokens, one
    competing `yes`: libgomp's default 22x slower than quiet; OMP_WAIT_POLICY=PASSIVE no slowdown but
    +73% when quiet (every wake-up pays); 10k spins 3.4x, +4% when quiet: the default here.
    """
    environ.setdefault("GOMP_SPINCOUNT", "10000")


def _run_pinned(cpus: list[int], *args: Any) -> None:
    """The engine process's target when it gets a share of the CPUs: pinned before anything (torch, the
    native worker pool) reads the affinity mask to size its threads."""
    os.sched_setaffinity(0, cpus)
    run_engine_process(*args)


_STOP = object()  # tells the writer thread to end


class _Frames:
    """Whole messages out of the bytes of a `multiprocessing.connection.Connection` stream, fed in pieces
    as they arrive: each message is a 4-byte big-endian signed length and the payload, or -1 and an 8-byte
    length first for a payload over 2 GiB (`Connection.send_bytes`' framing). ValueError for a length no
    sender writes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames, at = [], 0
        while len(buf) - at >= 4:
            (size,) = struct.unpack_from("!i", buf, at)
            head = 4
            if size == -1:
                if len(buf) - at < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, at + 4)
                head = 12
            elif size < 0:
                raise ValueError(f"a message length of {size} bytes")
            if len(buf) - at - head < size:
                break
            frames.append(bytes(buf[at + head:at + head + size]))
            at += head + size
        del buf[:at]
        return frames


@dataclass
class _Stream:
    req: GenerateRequest
    queue: asyncio.Queue  # of RequestOutput, filled by the loop callback
    held: set[int]  # the completions the engine has not ended yet (as far as the outputs received tell)


class EngineClient:
    """Talks to one engine core process. Build it with `await EngineClient.start(args)`."""

    silent_s = 30.0  # a ready engine that sends nothing this long (six of its Alive periods) is stopped or frozen

    def __init__(self, proc: Any, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._proc = proc
        self._conn = conn
        self._loop = loop
        self._streams: dict[str, _Stream] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        # the engine's latest stats, whether asked for (on time or late) or pushed between long steps
        self.latest_stats: EngineStats | None = None
        self._next_stats_id = 0
        self._info: EngineInfo | None = None
        self._ready: asyncio.Future = loop.create_future()  # -> the EngineInfo of EngineReady
        self._exited = asyncio.Event()  # the process is gone and reaped
        self._dead_reason: str | None = None
        self.label = ""  # what the log says before its reason for dying ("replica 1: ", where several run)
        self._shut_down = False
        self.on_dead: Callable[[str], None] | None = None  # called on the loop once, with the reason, when it dies
        self._held = 0  # completions sent whose final output has not come from the engine (module docstring)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._writer_main, name="engine-client-writer", daemon=True)
        self._writer.start()
        # the loop's own handle on the pipe: a duplicate, read with MSG_DONTWAIT so that the descriptor the
        # writer thread sends on stays blocking
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._frames = _Frames()
        self._reading = True
        self._pipe_timer: asyncio.TimerHandle | None = None
        self._last_heard = time.monotonic()  # when the pipe last gave anything
        self._silence_due = 0.0  # when the next silence check should run (`_check_silence`)
        self._silence_timer: asyncio.TimerHandle | None = None
        loop.add_reader(self._sock.fileno(), self._read_pipe)
        loop.add_reader(proc.sentinel, self._process_ended)

    # ---- life cycle ---------------------------------------------------------------------------

    @classmethod
    async def start(
        cls, args: EngineArgs, *, core_factory: CoreFactory | None = None,
        cpus: Collection[int] | None = None, name: str = "mlaserve-engine-core",
    ) -> "EngineClient":
        """Spawns the engine core process and waits until its model is loaded.

        Raises RuntimeError carrying the child's message when the core cannot start (an EngineStartupError
        where the child said why) or does not within `args.startup_timeout` seconds (0: no limit).
        `core_factory` (picklable) replaces the real core in tests.
        `cpus`: the only CPUs the process may run on (Linux), so that replicas do not share cores.
        """
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        set_cpu_wait_policy(os.environ)  # the child inherits it before it imports torch
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        target: Any = run_engine_process
        target_args: tuple = (args, child_conn, core_factory)
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            target, target_args = _run_pinned, (sorted(cpus), *target_args)
        proc = ctx.Process(target=target, args=target_args, name=name, daemon=True)
        proc.start()
        child_conn.close()  # only the child holds its end now, so its death gives us EOF
        client = cls(proc, parent_conn, asyncio.get_running_loop())
        limit = args.startup_timeout
        try:
            client._info = await asyncio.wait_for(asyncio.shield(client._ready), limit or None)
        except asyncio.TimeoutError:
            client._ready.cancel()
            await client._close(timeout=0)
            raise RuntimeError(f"engine core did not start within {limit:g} s: raise --startup-timeout if loading "
                               "this model takes longer") from None
        except RuntimeError:  # the child reported a failure (it exits by itself) or died
            await client._close(timeout=5)
            raise
        except BaseException:  # start() itself was cancelled: do not leave a half-started engine
            client._ready.cancel()
            await client._close(timeout=0)
            raise
        logger.info("engine core process %d ready", proc.pid)
        return client

    async def shutdown(self, timeout: float = 10) -> None:
        """Asks the engine to exit, kills it after `timeout` s; pending requests get an error."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._dead_reason is None:
            self._send(Shutdown())
            self._mark_dead("engine core was shut down")
        await self._close(timeout)

    async def _close(self, timeout: float) -> None:
        """Waits for the process to end (killing it after `timeout`), then ends both threads."""
        self._shut_down = True
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except asyncio.TimeoutError:
            if timeout > 0:
                logger.warning("engine core process %d did not exit in %g s; killing it", self._proc.pid, timeout)
            self._proc.kill()
            await asyncio.wait_for(self._exited.wait(), 10)
        self._mark_dead("engine core was shut down")
        self._outbox.put(_STOP)
        self._stop_reading()
        await self._loop.run_in_executor(None, self._writer.join, 5)
        self._sock.close()
        if self._writer.is_alive():
            logger.warning("engine client writer thread did not end; leaving the pipe open")
        else:
            self._conn.close()

    # ---- requests -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yields the deltas of `req` until every completion has finished (or an error ends it).

        The request is sent when iteration starts. Raises ValueError if `req.rid` is still running.
        A rid must never be reused: outputs the engine sent before it saw an abort would reach the
        new request (the server makes a fresh id per request).
        """
        if self._dead_reason is not None:
            yield self._error_output(req)
            return
        rid = req.rid
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already running")
        stream = _Stream(req, asyncio.Queue(), set(range(req.params.n)))
        self._streams[rid] = stream
        unfinished = set(range(req.params.n))
        self._held += len(stream.held)
        try:
            try:
                self._send(req)
            except (OverflowError, TypeError, ValueError) as e:  # a value no message can carry (an int past 64 bits)
                unfinished.clear()
                self._release(stream)
                yield RequestOutput(rid=rid, index=0, new_token_ids=[], finish_reason=FINISH_ERROR,
                                    prompt_tokens=len(req.input_ids), arrival_time=req.arrival_time,
                                    error=f"the request holds a value out of range: {e}", error_code=ERR_INVALID)
                return
            while True:
                out = await stream.queue.get()
                if out.finished:
                    unfinished.discard(out.index)
                last = not unfinished or out.finish_reason == FINISH_ERROR
                if last:  # end now, not when the consumer next asks: frees the rid and the engine
                    self._end_stream(rid, unfinished)
                yield out
                if last:
                    return
        finally:
            if self._streams.get(rid) is stream:  # the consumer stopped early
                self._end_stream(rid, unfinished)

    def _end_stream(self, rid: str, unfinished: set[int]) -> None:
        self._release(self._streams.pop(rid))  # (what is left is aborted below: the engine frees it)
        if unfinished and self._dead_reason is None:
            self._send(AbortRequest(rid))

    async def abort(self, rid: str, index: int | None = None) -> None:
        """Ends `rid` (completion `index` alone, when given) in the engine now; its stream then gets 'abort'
        outputs for what was ended."""
        if self._dead_reason is None:
            self._send(AbortRequest(rid, index))

    def abort_all(self, reason: str) -> int:
        """Ends every running request now: its stream yields an `ERR_SHUTDOWN` error saying `reason`,
        and ending the stream aborts it in the engine (which frees its KV). For a server that must stop
        before they finish. Returns how many were running."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.queue.put_nowait(RequestOutput(
                rid=stream.req.rid, index=0, new_token_ids=[], finish_reason=FINISH_ERROR,
                prompt_tokens=len(stream.req.input_ids), arrival_time=stream.req.arrival_time,
                error=reason, error_code=ERR_SHUTDOWN,
            ))
        return len(streams)

    async def stats(self) -> EngineStats:
        """The engine's counters; raises RuntimeError when the engine is dead."""
        if self._dead_reason is not None:
            raise RuntimeError(self._dead_reason)
        self._next_stats_id += 1
        request_id = self._next_stats_id
        future = self._loop.create_future()
        self._stats_waiters[request_id] = future
        try:
            self._send(StatsRequest(request_id))
            return await future
        finally:
            self._stats_waiters.pop(request_id, None)

    # ---- state --------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    @property
    def info(self) -> EngineInfo:
        """What the engine said when it was ready (model, vocab size, context, KV sizes, pid)."""
        if self._info is None:
            raise RuntimeError("the engine has not started")
        return self._info

    @property
    def held(self) -> int:
        """Completions sent to this engine that it has not ended (running or queued there), as the outputs
        received tell, whether or not their consumers have taken them: what its admission limit counts."""
        return self._held

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone (the first reason seen), None while it runs."""
        return self._dead_reason

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def fail(self, reason: str) -> None:
        """Ends the engine from outside (on the loop): every pending request fails with `reason`, and the
        process, if it still runs, is killed (its exit then changes nothing more)."""
        self._mark_dead(reason)
        self.kill()

    def kill(self) -> bool:
        """SIGKILLs the engine process if it still runs (from a signal handler too); whether it did."""
        if self._proc.pid is None or self._proc.exitcode is not None:
            return False
        try:
            os.kill(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    @property
    def exitcode(self) -> int | None:
        """None while the process runs; see engine_process.EXIT_* (negative: killed by that signal)."""
        return self._proc.exitcode

    # ---- on the event loop: messages from the engine ------------------------------------------

    def _release(self, stream: _Stream, index: int | None = None) -> None:
        """The engine no longer holds completion `index` of `stream` (every one, if None)."""
        ended = stream.held if index is None else stream.held & {index}
        self._held -= len(ended)
        stream.held -= ended

    def _dispatch(self, msg: FromEngine) -> None:
        if isinstance(msg, Outputs):
            for out in msg.items:
                stream = self._streams.get(out.rid)
                if stream is not None:  # else: a late output of a request that was aborted
                    if out.finished:  # (an error ends every completion of the request)
                        self._release(stream, None if out.finish_reason == FINISH_ERROR else out.index)
                    stream.queue.put_nowait(out)
        elif isinstance(msg, Stats):
            self.latest_stats = msg.stats
            future = self._stats_waiters.pop(msg.stats.request_id, None)
            if future is not None and not future.done():
                future.set_result(msg.stats)
        elif isinstance(msg, EngineReady):
            if not self._ready.done():
                self._ready.set_result(msg.info)
                self._arm_silence_check()
        elif isinstance(msg, StartupError):
            reason = f"engine core failed to start: {msg.message}"
            self._mark_dead(reason, EngineStartupError(reason, settings_fault=msg.settings_fault))
        elif isinstance(msg, Fatal):
            self._mark_dead(msg.reason)

    def _on_exit(self, reason: str | None) -> None:
        """The process has ended (or its pipe closed, `reason` then says so)."""
        if reason is None:
            reason = f"engine core process exited unexpectedly (exit code {self._proc.exitcode})"
            self._exited.set()
        self._mark_dead(reason)

    def _mark_dead(self, reason: str, error: RuntimeError | None = None) -> None:
        """Ends everything waiting on the engine with `reason` (a start still awaited: with `error`, if
        given); the first reason is kept."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None
        if not self._shut_down and self._ready.done():  # (before ready, whoever awaits start() reports it)
            logger.error("%s%s", self.label, reason)
        self._outbox.put(_STOP)
        for stream in self._streams.values():
            self._release(stream)
            stream.queue.put_nowait(self._error_output(stream.req))
        for future in self._stats_waiters.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))
        if not self._ready.done():
            self._ready.set_exception(error or RuntimeError(reason))
        if self.on_dead is not None and not self._shut_down:
            self.on_dead(reason)

    def _error_output(self, req: GenerateRequest) -> RequestOutput:
        return RequestOutput(
            rid=req.rid, index=0, new_token_ids=[], finish_reason=FINISH_ERROR,
            prompt_tokens=len(req.input_ids), arrival_time=req.arrival_time,
            error=self._dead_reason, error_code=ERR_ENGINE,
        )

    # ---- the writer thread --------------------------------------------------------------------

    def _send(self, msg: ToEngine) -> None:
        """Queues `msg` for the writer thread, encoded here (on the loop), so that a message that cannot be
        encoded fails its sender rather than the writer, which every request depends on."""
        self._outbox.put(encode(msg))

    def _writer_main(self) -> None:
        while (data := self._outbox.get()) is not _STOP:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):  # the engine is gone; the loop's reading of the pipe reports it
                return

    # ---- on the event loop: reading the pipe ---------------------------------------------------

    def _read_pipe(self) -> bool:
        """Takes what the pipe holds now (without blocking) and dispatches every whole message in it;
        whether there was anything to take (data or EOF)."""
        try:
            # 64 KiB a read: each call allocates its whole buffer, and 256 KiB took ~14 us more a read (a socketpair
            # microbenchmark: 17 against 2.5 us per 150-byte message)
            data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # ECONNRESET: the engine died with our messages unread
            data = b""
        self._last_heard = time.monotonic()
        if not data:
            self._pipe_closed()
            return True
        try:
            messages = [decode_from_engine(frame) for frame in self._frames.feed(data)]
        except Exception as exc:  # the protocol is broken, so the engine must go
            self._protocol_broken(exc)
            return True
        for msg in messages:
            self._dispatch(msg)
        return True

    def _arm_silence_check(self) -> None:
        self._silence_due = time.monotonic() + SILENCE_CHECK_S
        self._silence_timer = self._loop.call_later(SILENCE_CHECK_S, self._check_silence)

    def _check_silence(self) -> None:
        """On the loop, every SILENCE_CHECK_S once ready: an engine silent for `silent_s` is failed and killed.
        What the pipe holds is taken first, so a loop that was itself held up blames nobody; a check that
        comes HELD_UP_S late finds this process held up (paused with the engine, say, which then had no
        time to speak on resuming): the silence counts from now."""
        self._silence_timer = None
        if self._dead_reason is not None or self._shut_down:
            return
        while self._reading and self._read_pipe():
            pass
        now = time.monotonic()
        if now - self._silence_due >= HELD_UP_S:
            logger.info("%sthe server was held up for %.0f s (paused?): the engine's silence counts from now",
                        self.label, now - self._silence_due + SILENCE_CHECK_S)
            self._last_heard = max(self._last_heard, now)
        quiet = now - self._last_heard
        if self._dead_reason is None and quiet >= self.silent_s:
            self.fail(f"engine core stopped answering: nothing from its process for {quiet:.0f} s; it is stopped "
                      "or frozen, and was killed")
        elif self._dead_reason is None:
            self._arm_silence_check()

    def _pipe_closed(self) -> None:
        """EOF: the engine is on its way out. Its exit (the sentinel) says how; if that does not come
        within a second, the closed pipe is the reason."""
        self._stop_reading()
        if self._dead_reason is None and self._pipe_timer is None:
            self._pipe_timer = self._loop.call_later(1.0, self._on_exit, "engine core process closed its pipe")

    def _protocol_broken(self, exc: Exception) -> None:
        reason = f"engine client cannot read the engine core's messages: {type(exc).__name__}: {exc}"
        logger.error("%s", reason, exc_info=exc)
        self._stop_reading()
        self._on_exit(reason)
        self._proc.kill()  # its sentinel then reaps it

    def _process_ended(self) -> None:
        """The process is gone: take what it wrote before dying (its crash report, say), reap it, report."""
        self._loop.remove_reader(self._proc.sentinel)
        if self._pipe_timer is not None:
            self._pipe_timer.cancel()
        while self._reading and self._read_pipe():  # up to EOF: its end is closed (never blocks)
            pass
        self._stop_reading()
        self._proc.join()  # ended: returns at once, and exitcode is known
        self._on_exit(None)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._sock.fileno())
