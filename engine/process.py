"""The engine core process: owns the model and runs the step loop, talking to the server over one pipe.

    server process (EngineClient)                            engine core process (this module)
        GenerateRequest | AbortRequest | StatsRequest | Shutdown   ──▶
        ◀──  EngineReady(EngineInfo) | StartupError               once, at start-up
        ◀──  Outputs([RequestOutput, ...])                         one message per loop iteration
        ◀──  Stats(EngineStats)                                    answer to a StatsRequest, or unasked
                                                                   (request_id 0) each STATS_PUSH_S of steps
        ◀──  Fatal(reason)                                         last words after a crash
        ◀──  Alive                                                 when nothing else was sent for ALIVE_S

One loop iteration, read aloud: take every message already waiting (block on the pipe only while
the core is idle) → apply them in order → `core.step()` if the core has work → send everything
that came out of this iteration as ONE message.

What the server side relies on:
- Every completion of every accepted request gets a final output (`finish_reason` set): from the
  core, or made here when the core answers an abort without one, or an `ERR_ENGINE` error when the
  core crashes. An error output returned by `add_request` means "refused": the request is not kept.
- A crash is reported, never hidden: any exception out of the core (or a message that does not
  decode: the protocol is broken) sends an `ERR_ENGINE` error for every pending completion, then
  `Fatal(reason)`, logs the traceback, and exits with `EXIT_ENGINE_CRASHED`.
- A step that a known failure keeps from ever returning (a tensor-parallel rank died or froze and this
  rank waits in a collective it will never complete, until the group's timeout) is not waited out: a
  watchdog thread that sees `core.failure()` while a step has run for `STUCK_S` sends `Fatal(reason)`
  (the server then fails every pending request) and ends the process. A step that runs past
  `--watchdog-timeout` for a reason nobody reported (a hung device, a deadlock) ends it the same way.
- While nothing else is sent, the watchdog thread sends `Alive` every `ALIVE_S`, through long steps
  and idle time alike: a process that sends nothing for much longer is stopped or frozen, and the
  server ends it (`EngineClient.silent_s`).
- The process leaves by itself when the server goes away (EOF on the pipe, or its parent pid
  changes), so a killed server never leaves an engine holding the GPU.
- SIGINT and SIGTERM are ignored here: a signal to the process group (Ctrl-C, systemd, docker stop)
  reaches this process too, and the server alone decides how to drain and when to shut it down.

The pipe carries msgpack frames (`engine.messages.encode` / `decode_*`, typed msgspec Structs) with
`Connection.send_bytes` / `recv_bytes`: nothing is pickled or unpickled on it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Protocol

import msgspec

from engine.args import EngineArgs, engine_log_level
from engine.cgroups import quota_threads
from engine.messages import (
    ERR_ENGINE,
    FINISH_ABORT,
    FINISH_ERROR,
    AbortRequest,
    Alive,
    EngineInfo,
    EngineReady,
    EngineStartupError,
    EngineStats,
    Fatal,
    GenerateRequest,
    Outputs,
    RequestOutput,
    Shutdown,
    StartupError,
    Stats,
    StatsRequest,
    decode_to_engine,
    encode,
    is_settings_fault,
)
from models.loader.errors import out_of_memory

logger = logging.getLogger(__name__)

# exit codes of the engine core process
EXIT_OK = 0  # asked to shut down
EXIT_STARTUP_FAILED = 1  # the core could not be built; StartupError was sent
EXIT_ENGINE_CRASHED = 2  # the core raised (or a message did not decode); errors and Fatal were sent
EXIT_PARENT_GONE = 3  # the server went away

IDLE_POLL_S = 0.5  # while idle, how often to look whether the parent is still there
LOCKSTEP_POLL_S = 0.02  # the same under DP attention, where an idle replica holds the others' next step
STUCK_S = 2.0  # a step running this long while the core reports a failure is stuck: report and exit
WATCH_S = 0.25  # how often the watchdog looks at the running step
# a check this late (the watchdog here, the server's silence check) was held up with its whole process (the process
# or the machine paused: `docker pause`, a cgroup freezer, a VM paused or migrated): that time is no step's, nor
# a silence of the other side
HELD_UP_S = 5.0
ALIVE_S = 5.0  # the watchdog sends Alive when nothing else was sent for this long
# while steps run the stats go to the server unasked this often: a StatsRequest waits for the step to end (a
# long prefill on a CPU: seconds), and a scrape that could not wait showed the previous scrape's late answer
STATS_PUSH_S = 1.0
PEER_EXIT_WAIT_S = 1.0  # after a collective lost a peer, how long the ranks' account may take (_EngineLoop._cause)
# gloo's words for a peer's connection gone (a rank killed or its node down), in the error a collective raises
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed", "Read error",
              "got 0 bytes", "stopped answering rank 0's broadcast")  # (the last: executor.distributed's own)


class EngineCoreLike(Protocol):
    """What the process needs of the core (`engine.core.EngineCore`, or a test double)."""

    def add_request(self, req: GenerateRequest) -> list[RequestOutput]: ...
    def abort(self, rid: str, index: int | None = None) -> list[RequestOutput]: ...
    def step(self) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def describe(self) -> EngineInfo: ...


CoreFactory = Callable[[EngineArgs], EngineCoreLike]


DEFAULT_CORE = "engine.core:EngineCore"  # imported by name, in the engine process only


def default_core_factory(args: EngineArgs) -> EngineCoreLike:
    """The real core. The server side imports this module to spawn the process, and must never load
    torch or the model code (an import-linter contract says so), so the core is imported by name
    here, in the child, rather than by an import statement."""
    module, _, name = DEFAULT_CORE.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def freeze_gc_heap() -> None:
    """Moves every object alive now out of the cyclic garbage collector's generations. A process calls it
    once what lives as long as it does is loaded (the engine its model, the HTTP server its tokenizer and
    app): a full collection then no longer walks those objects (they made up most of its work: a few % of
    a CPU decode step in the engine; in the server ~55 ms with the event loop stopped, on a 2-core VM). At
    exit they become collectable again, so that extension modules (nanobind's leak check) do not report
    them as leaked."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def run_engine_process(args: EngineArgs, conn: Any, core_factory: CoreFactory | None = None) -> None:
    """Main of the engine core process. Returns on a clean shutdown; otherwise exits non-zero.

    `core_factory` must be picklable (a top-level function or class, or a functools.partial of
    one) because the 'spawn' start method sends it to the child; None means the real EngineCore.
    """
    child = threading.current_thread() is threading.main_thread()  # a real child process, not a test thread
    if child:
        _setup_child_process()
    code = _EngineLoop(conn, core_factory or default_core_factory, watchdog=child).run(args)
    try:
        conn.close()
    except OSError:
        pass
    if child:
        _leave(code)
    if code != EXIT_OK:
        sys.exit(code)


def _leave(code: int, hooks: bool = True) -> NoReturn:
    """Ends the engine process once its work is done and its pipe closed, without the interpreter's
    teardown: there, native extensions loaded by torch (Triton's, imported by `import torch` wherever
    it is installed) print dozens of "nanobind: leaked ..." lines on every clean stop, which reads like
    a crash in the server's log. What must still happen does: the atexit hooks run (multiprocessing's
    among them, which releases the semaphores that libraries made), then the streams are flushed.
    Without `hooks` (the watchdog, beside a step that will never return) only the streams: a hook
    could wait on what that step holds."""
    if hooks:
        atexit._run_exitfuncs()  # the hooks of a normal exit (logging's flush too), without the teardown after them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _setup_child_process() -> None:
    # Ctrl-C, `kill -TERM -- -<pgid>`, systemd's control-group kill and `docker stop` through an init
    # signal the whole process group. The server coordinates the drain and then sends SHUTDOWN, so
    # the engine ignores both signals: running requests finish instead of dying with the child.
    # (SIGKILL of the server still ends this process: EOF on the pipe / the parent pid changes.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:  # a spawned child starts with no logging configured
        logging.basicConfig(
            level=engine_log_level(os.environ),
            format="%(asctime)s %(levelname)s engine-core[%(process)d] %(name)s: %(message)s",
        )
    threads = quota_threads(os.environ)  # (neither the worker pool nor torch's OpenMP is loaded yet)
    if threads is not None:
        logging.getLogger(__name__).info("the CPU quota allows %d CPUs' time: %d threads", threads, threads)


@dataclass
class _Pending:
    """A request the core accepted and has not finished: what is needed to end it ourselves."""

    unfinished: set[int]  # completion indices still without a final output
    prompt_tokens: int
    arrival_time: float

    def final(self, rid: str, index: int, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            rid=rid, index=index, new_token_ids=[], finish_reason=reason,
            prompt_tokens=self.prompt_tokens, arrival_time=self.arrival_time,
            error=error, error_code=ERR_ENGINE if error is not None else None,
        )


class _EngineLoop:
    """The loop of one engine core process: one thread, and a watchdog that may send its last words
    (`send_lock` keeps their messages whole)."""

    def __init__(self, conn: Any, core_factory: CoreFactory, watchdog: bool = True) -> None:
        """`watchdog`: whether a stuck step may end the process (not where the loop runs in a thread of
        another program, as some tests run it)."""
        self.conn = conn
        self.watchdog = watchdog
        self.core_factory = core_factory
        self.core: EngineCoreLike | None = None
        self.parent_pid = os.getppid()
        self.pending: dict[str, _Pending] = {}
        self.outbox: list[RequestOutput] = []  # outputs not sent yet: the messages' before the step, the step's after
        # the watchdog's view of the loop: when the running step began (None: not in a step)
        self.step_since: float | None = None
        self.send_lock = threading.Lock()  # the loop and the watchdog both may send the last words
        self.fatal_sent = False
        self.last_sent = time.monotonic()  # when a message last went to the server (the watchdog's Alive)
        self.stats_sent = time.monotonic()  # when the core's stats last went (asked for or pushed)

    def run(self, args: EngineArgs) -> int:
        try:
            self.core = self.core_factory(args)
            info = msgspec.structs.replace(self.core.describe(), pid=os.getpid())
        except Exception as exc:
            oom = out_of_memory(exc)
            said = oom or f"{type(exc).__name__}: {exc}"
            told = self._send(StartupError(said, settings_fault=is_settings_fault(exc)))
            if is_settings_fault(exc) or oom or isinstance(exc, EngineStartupError):
                # a setting, a config or a file the user named is wrong, or the memory is short, and the message
                # says which: the server prints that one line (here, only where it could not be told; the
                # traceback at debug level, for a bug that raises these too)
                if not told:
                    logger.error("engine core failed to start: %s", said)
                logger.debug("engine core startup traceback", exc_info=True)
            else:
                logger.exception("engine core failed to start")
            return EXIT_STARTUP_FAILED
        if not self._send(EngineReady(info)):
            return EXIT_PARENT_GONE
        logger.info("engine core ready: %s", info)
        freeze_gc_heap()  # the model's objects live as long as the process
        done = threading.Event()
        failure = getattr(self.core, "failure", None)
        if self.watchdog:
            threading.Thread(target=self._watch, args=(failure, args.watchdog_timeout, done), name="engine-watchdog",
                             daemon=True).start()
        code = EXIT_ENGINE_CRASHED
        try:
            code = self._loop()
            return code
        finally:
            done.set()
            close = getattr(self.core, "close", None)  # the core's other processes (tensor-parallel ranks)
            if close is not None:
                try:
                    close(clean=code == EXIT_OK)
                except Exception:
                    logger.exception("closing the engine core failed")

    def _loop(self) -> int:
        assert self.core is not None
        # DP attention: the replicas step together (each iteration, whether or not this one has work),
        # and leave together once every one was asked to shut down
        together = getattr(self.core, "step_together", None)
        stopping, stop = False, False
        try:
            while True:
                code = self._take_messages(LOCKSTEP_POLL_S if together is not None else IDLE_POLL_S)
                if code is not None:
                    if together is None or code != EXIT_OK:
                        return code
                    stopping = True
                if self.outbox and not self._flush():  # (admissions and refusals: not after a long step)
                    return EXIT_PARENT_GONE
                busy = self.core.has_work()  # (replicas stepping together step idle too: no stats for those)
                if together is not None:
                    self.step_since = time.monotonic()
                    outs, stop = together(stopping)
                    self.step_since = None
                    self.outbox.extend(outs)
                elif busy:
                    self.step_since = time.monotonic()
                    self.outbox.extend(self.core.step())
                    self.step_since = None
                if self.outbox and not self._flush():
                    return EXIT_PARENT_GONE
                if busy and time.monotonic() - self.stats_sent >= STATS_PUSH_S and not self._send_stats(0):
                    return EXIT_PARENT_GONE
                if stop:
                    return EXIT_OK
        except Exception as exc:
            return self._crash(exc)

    def _flush(self) -> bool:
        """Sends the outbox as one message; False when the server is gone."""
        outs, self.outbox = self.outbox, []
        self._track(outs)
        return self._send(Outputs(outs))

    def _take_messages(self, idle_poll: float = IDLE_POLL_S) -> int | None:
        """Applies every waiting message; blocks up to `idle_poll` seconds only when the core is idle.
        Returns an exit code when the loop must end."""
        timeout = 0.0 if self.core.has_work() else idle_poll
        while True:
            try:
                if not self.conn.poll(timeout):
                    break
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                logger.info("server side closed the pipe; engine core exits")
                return EXIT_PARENT_GONE
            timeout = 0.0
            code = self._apply(decode_to_engine(data))  # a DecodeError ends the loop as a crash
            if code is not None:
                return code
        if os.getppid() != self.parent_pid:
            logger.info("server process is gone; engine core exits")
            return EXIT_PARENT_GONE
        failure = getattr(self.core, "failure", None)  # e.g. a tensor-parallel rank died while idle
        reason = failure() if failure is not None else None
        if reason is not None:
            raise RuntimeError(reason)
        return None

    def _apply(self, msg: GenerateRequest | AbortRequest | StatsRequest | Shutdown) -> int | None:
        core = self.core
        if isinstance(msg, GenerateRequest):
            self.pending[msg.rid] = _Pending(set(range(msg.params.n)), len(msg.input_ids), msg.arrival_time)
            outs = core.add_request(msg)
            if any(o.finish_reason == FINISH_ERROR for o in outs):  # refused: nothing to track
                del self.pending[msg.rid]
            self.outbox.extend(outs)
        elif isinstance(msg, AbortRequest):
            pending = self.pending.get(msg.rid)
            if pending is None:  # already finished or refused: nothing to free
                return None
            which = set(pending.unfinished) if msg.index is None else pending.unfinished & {msg.index}
            if not which:  # that completion has ended already
                return None
            if which == pending.unfinished:
                del self.pending[msg.rid]
            outs = core.abort(msg.rid, msg.index)
            self.outbox.extend(outs)
            ended = {o.index for o in outs if o.rid == msg.rid and o.finished}
            self.outbox.extend(pending.final(msg.rid, i, FINISH_ABORT) for i in sorted(which - ended))
        elif isinstance(msg, StatsRequest):
            if not self._send_stats(msg.request_id):
                return EXIT_PARENT_GONE
        elif isinstance(msg, Shutdown):
            n = len(self.pending)
            logger.info("engine core shutting down (%d request%s pending)", n, "" if n == 1 else "s")
            return EXIT_OK
        return None

    def _send_stats(self, request_id: int) -> bool:
        """The core's stats, answering StatsRequest `request_id` (0: unasked); False when the server is gone."""
        assert self.core is not None
        self.stats_sent = time.monotonic()
        return self._send(Stats(msgspec.structs.replace(self.core.stats(), request_id=request_id)))

    def _track(self, outs: list[RequestOutput]) -> None:
        """Forgets completions that have ended, so a crash or an abort only ends what is still open."""
        for out in outs:
            pending = self.pending.get(out.rid)
            if pending is None or not out.finished:
                continue
            pending.unfinished.discard(out.index)
            if not pending.unfinished:
                del self.pending[out.rid]

    def _crash(self, exc: Exception) -> int:
        logger.error("engine core crashed: %s: %s; failing %d pending requests", type(exc).__name__, exc,
                     len(self.pending), exc_info=exc)
        reason = f"engine core crashed: {self._cause(exc)}"
        outs, self.outbox = self.outbox, []
        self._track(outs)
        for rid, pending in self.pending.items():
            outs.extend(pending.final(rid, i, FINISH_ERROR, reason) for i in sorted(pending.unfinished))
        self.pending.clear()
        with self.send_lock:
            if self.fatal_sent:  # the watchdog reported first; the process is ending
                return EXIT_ENGINE_CRASHED
            self.fatal_sent = True
            try:
                self.conn.send_bytes(encode(Outputs(outs)))
                self.conn.send_bytes(encode(Fatal(reason)))
            except Exception:  # the server is gone or the outputs cannot be sent: the exit code still tells
                logger.exception("could not report the crash to the server")
        return EXIT_ENGINE_CRASHED

    def _cause(self, exc: Exception) -> str:
        """What the clients are told of a crash. A collective that failed because a peer rank went away
        raises gloo's text (a build path, the peer's address, not which rank, and a joke): the ranks' own
        account (`core.failure`: "rank 1 exited with code -9"), given a moment to see the exit, or a
        short line instead; the server log keeps the whole exception."""
        if not any(sign in str(exc) for sign in _PEER_GONE):
            return f"{type(exc).__name__}: {exc}"
        failure = getattr(self.core, "failure", None)
        deadline = time.monotonic() + PEER_EXIT_WAIT_S
        while failure is not None:
            why = failure()
            if why is not None:
                return why
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return ("a peer rank is gone: its connection closed in a collective (its process or its node ended; "
                "each node's log says which)")

    def _watch(self, failure: Callable[[], str | None] | None, limit: float, done: threading.Event) -> None:
        """The watchdog thread: a step that has run for STUCK_S while the core reports a failure will
        not return (a collective waits for a dead or frozen rank, until the group's timeout of minutes,
        or for good), so it reports the failure as the crash (the server fails every pending request on
        `Fatal`) and ends the process; the node's other ranks die with it (engine.ranks). A step past
        `limit` (--watchdog-timeout; 0: none) is ended so, whatever holds it."""
        woke, step, held = time.monotonic(), None, 0.0
        while not done.wait(WATCH_S):
            now = time.monotonic()
            late, woke = now - woke - WATCH_S, now
            if now - self.last_sent >= ALIVE_S and not self._send(Alive()):
                return  # the server is gone; the loop sees it too
            since = self.step_since
            if since != step:  # a new step (or none): no time held up in it yet
                step, held = since, 0.0
            if since is None:
                continue
            if late >= HELD_UP_S:  # the process was held up (paused with the machine, say): not the step's time
                held += late
            ran = now - since - held
            reason = failure() if failure is not None and ran >= STUCK_S else None
            if reason is not None:
                reason = f"engine core crashed: {reason} (the step stayed blocked for {ran:.1f} s)"
            elif 0 < limit <= ran:
                reason = (f"engine core crashed: a step ran for {ran:.1f} s, past --watchdog-timeout "
                          f"({limit:g} s); the engine is stuck (a hung device or a deadlock)")
            else:
                continue
            with self.send_lock:
                if self.fatal_sent or done.is_set():
                    return
                self.fatal_sent = True
                logger.error("%s; ending the engine process", reason)
                try:
                    self.conn.send_bytes(encode(Fatal(reason)))
                except Exception:  # the server is gone: the exit code still tells
                    logger.exception("could not report the crash to the server")
                _leave(EXIT_ENGINE_CRASHED, hooks=False)

    def _send(self, msg: EngineReady | StartupError | Outputs | Stats | Alive) -> bool:
        """False when the server side is gone (or, from the watchdog, when the last words were sent)."""
        try:
            with self.send_lock:
                if self.fatal_sent:
                    return False
                self.conn.send_bytes(encode(msg))
                self.last_sent = time.monotonic()
            return True
        except (OSError, EOFError):
            return False
