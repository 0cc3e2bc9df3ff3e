"""`mlaserve serve`: start the HTTP server at once, load the engine behind it, drain on SIGTERM.

Order of events:
  0. A --model that is no model (`server.args.model_problem`: no such path, a directory without
     config.json, a file that is not a GGUF) or a --host that does not resolve ends the command with
     one line (exit 2), before anything binds or loads.
  1. uvicorn starts listening; `/health` answers 503 "loading" and `/v1/*` 503 until ready. With
     `--runtime-file PATH` the address it bound (host, port, pid) is written there as JSON, for
     docker/healthcheck.py; the file is removed at exit.
  2. The tokenizer (with `--chat-template`'s template in place of the model's) and the model's sampling
     defaults (`--generation-config`, logged) load here; the engine core process starts and loads the
     weights (with `--dp N`, N engine processes at once, each with the whole model: `engine.replicas`).
  3. Ready (every replica): `/health` 200.
  4. SIGTERM/SIGINT, to this process or to its whole process group (the engine process ignores
     both: the server decides): `/health` and new requests get 503 with Retry-After, in-flight
     requests get up to `--shutdown-timeout` seconds to finish; what still runs then is ended with
     a `shutting_down` error; the engine process is shut down; exit code 0. A second signal stops
     at once (what still runs ends with a `shutting_down` error, the engine gets a short grace,
     then is killed; a signal while the engine is being shut down kills it).
  A signal while the model is still loading stops the load and exits 0. If the engine (any replica)
  cannot start, the error is logged and the process exits 1.
  5. The engine dies (every replica; one of several only fails `/health`): the running requests get
     their errors, new ones 503 `engine_dead`, and the process exits 1 for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from models.builtin import user_path
from models.omnikv_config import model_label
from models.loader.tokenizer import load_tokenizer
from engine.args import use_log_level
from engine.process import freeze_gc_heap
from engine.replicas import EngineReplicas
from engine.messages import is_settings_fault
from server.app import ServerState, build_app
from server.args import ServerArgs, device_problem, model_problem, omnikv_problem, parallel_problem
from server.http_protocol import ServerHttpProtocol
from server.chat_template import load_chat_template, template_problem
from server.generation_defaults import load_generation_defaults
from server.metrics import Metrics

logger = logging.getLogger("mlaserve.server")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: keep listening but answer 503 to new work, let in-flight requests
    finish (up to `grace` seconds), end the rest with an error, then stop. A second signal stops at
    once.

    uvicorn's own handler is not called: it would stop at once (its graceful wait is a fixed few
    seconds, then running streams are cancelled) and re-raise the signal after shutdown, so the
    process would die by SIGTERM instead of exiting 0."""

    ABORT_FLUSH_S = 5.0  # after ending the late requests, how long their error responses may take to go out
    POLL_S = 0.05  # how often the drain looks at the in-flight count

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float,
                 runtime_file: str | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.runtime_file = runtime_file
        self.stop_requested = False  # a stop signal came
        self.forced = False  # a second one came: stop now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.runtime_file and self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]  # what was bound (--port 0: the port chosen)
            try:
                write_runtime_file(self.runtime_file, host, port)
            except OSError as e:  # serving matters more than the file: say so, and go on
                logger.error("cannot write --runtime-file %s (%s): a health check reading it falls back to "
                             "MLASERVE_PORT", self.runtime_file, e)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # type: ignore[override]
        # A Python signal handler: it runs on the main thread (the event loop's) between two bytecodes,
        # so it only sets flags and hands the drain to the loop.
        if self.stop_requested:
            logger.warning("second signal: stopping now")
            self.forced = self.force_exit = self.should_exit = True
            return
        self.stop_requested = True
        self.state.shutting_down = True  # from now on /health and new requests get 503
        if self.state.engine is None or self._loop is None:  # still loading: nothing runs, stop the load
            logger.info("shutting down while the model loads")
            self.should_exit = True
            return
        logger.info("shutting down: draining %d in-flight request(s), up to %gs", self.state.inflight, self.grace)
        self._loop.call_soon_threadsafe(self._start_drain)  # wakes the loop, unlike call_soon from a handler

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        """Waits for the in-flight requests; past the grace ends them in the engine (their clients get a
        `shutting_down` error), waits for those answers to go out, then lets uvicorn stop."""
        await self.wait_inflight(self.grace)
        engine = self.state.engine
        if self.state.inflight > 0 and engine is not None:
            ended = engine.abort_all(f"the server is shutting down: the request did not finish within "
                                     f"--shutdown-timeout {self.grace:g} s")
            logger.warning("shutdown: ended %d request(s) still running after %gs", ended, self.grace)
            await self.wait_inflight(self.ABORT_FLUSH_S)
        if self.state.inflight > 0:
            # what is left may wait on clients that read none of their answer: drop those connections now
            # (uvicorn's own graceful wait would cancel the tasks and log an ERROR with a traceback for each)
            dropped = sum(c.drop_if_stalled() for c in list(self.server_state.connections)
                          if isinstance(c, ServerHttpProtocol))
            if dropped:
                logger.warning("shutdown: dropped %d connection(s) whose clients did not read their answers",
                               dropped)
                await self.wait_inflight(self.ABORT_FLUSH_S)
        refused = sum(c.refuse_unfinished() for c in list(self.server_state.connections)
                      if isinstance(c, ServerHttpProtocol))
        if refused:
            logger.info("shutdown: refused %d request(s) still arriving", refused)
        self.should_exit = True

    async def wait_inflight(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(self.POLL_S)


def write_runtime_file(path: str, host: str, port: int) -> None:
    """{host, port, pid} as JSON at `path`, replaced atomically: a health check that reads it while it is
    written sees the old file or the new one, never half of one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
    os.replace(tmp, target)


def remove_runtime_file(path: str | None) -> None:
    """Removes this process's runtime file; leaves one another server wrote since (the same path reused)."""
    if not path:
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(Path(path).read_text()).get("pid") == os.getpid():
            os.remove(path)


def default_model_name(model: str) -> str:
    """The served name without --served-model-name (`models.omnikv_config.model_label`): a built-in name as it
    is; a file's stem (`model.gguf` -> `model`, `model-00001-of-00003.gguf` -> `model`); a directory's own
    name, a link to it followed (`/models/current` -> the model it points to), a Hugging Face cache snapshot's
    its repository's."""
    path = user_path(model)
    return model_label(str(path.resolve()) if path.is_dir() else model)


async def _start_engine(state: ServerState, args: ServerArgs, server: _DrainingServer) -> None:
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, args.engine.model)
        if args.chat_template is not None:  # checked to compile when the flag was parsed
            tokenizer = dataclasses.replace(tokenizer, chat_template=load_chat_template(args.chat_template),
                                            named_chat_templates={})
            logger.info("chat template: --chat-template's, not the model's")
        else:
            for name, template in (("", tokenizer.chat_template), *tokenizer.named_chat_templates.items()):
                if template and (problem := template_problem(template)) is not None:
                    logger.warning("the model's %s%s: the chat requests it renders (on /v1/responses and "
                                   "/v1/messages too) will get a 400; pass --chat-template a template that compiles",
                                   f"'{name}' " if name else "", problem)
        state.tokenizer = tokenizer
        state.generation_defaults = await asyncio.to_thread(load_generation_defaults, args.engine.model,
                                                            args.generation_config)
        logger.info("sampling defaults for requests that leave them out: %s", state.generation_defaults.describe())
        engine = await EngineReplicas.start(args.engine, args.dp)
        state.context_length = engine.info.context_length
        state.admission_capacity = (args.engine.max_running_requests + args.engine.max_queued_requests) * args.dp
        state.vocab_size = engine.info.vocab_size
        state.system_fingerprint = engine.info.fingerprint or None
        state.engine = engine
        freeze_gc_heap()  # the tokenizer, the app and the libraries live as long as the server
        logger.info("ready: serving %s as '%s' on http://%s:%d%s", args.engine.model, state.model_name,
                    f"[{args.host}]" if ":" in args.host else args.host, args.port,  # (an IPv6 address bracketed)
                    f" ({args.dp} replicas)" if args.dp > 1 else "")
    except Exception as e:
        if server.stop_requested:  # e.g. a group signal reached the engine before it could ignore it
            logger.info("the engine did not start: the server was asked to stop (%s)", e)
            return
        logger.error("the engine failed to start: %s", str(e).removeprefix("engine core failed to start: "))
        state.start_error = str(e)
        # the model's files or a setting (the tokenizer's, read here; the engine's, as it says): exit 2, as a
        # bad flag does, so that a supervisor does not take it for "restart me" (exit 1)
        if is_settings_fault(e):
            state.start_exit = 2
        server.should_exit = True


@contextlib.contextmanager
def _signals_kill_engine(state: ServerState) -> Iterator[None]:
    """While the engine is being stopped (uvicorn's handlers are gone by then), a SIGINT/SIGTERM kills
    the engine process so that the stop is immediate: without this, SIGINT would cancel the shutdown
    half-way (asyncio.run's handler) and SIGTERM would kill this process alone."""

    def kill(sig: int, frame: FrameType | None) -> None:
        engine = state.engine
        if engine is not None and engine.kill():
            logger.warning("signal %d while stopping the engine: killed it", sig)

    previous = {sig: signal.signal(sig, kill) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


ENGINE_WATCH_S = 0.5  # how often the server looks whether its engine still runs


async def _exit_when_the_engine_dies(state: ServerState, server: _DrainingServer) -> None:
    """Once every replica is gone, the server cannot answer anything again: the requests that were running
    get their errors out (up to ABORT_FLUSH_S), then the server exits 1, so that whatever supervises it
    (Docker's restart policy, systemd, Kubernetes) starts a new one, as vLLM's server exits with its
    engine. Until then `/health` and new requests get 503 `engine_dead`."""
    while not server.should_exit and not server.stop_requested:
        engine = state.engine
        if engine is not None and not engine.any_alive:
            why = "; ".join(f"replica {i}: {reason}" if engine.size > 1 else reason for i, reason in engine.dead())
            state.engine_lost = why
            logger.error("the engine is gone (%s): the server exits 1 so that its supervisor restarts it", why)
            await server.wait_inflight(server.ABORT_FLUSH_S)
            server.should_exit = True
            return
        await asyncio.sleep(ENGINE_WATCH_S)


FD_RESERVE = 256  # file descriptors kept from client connections: the engine's pipes, logs, files being read


def connection_limit(target: int = 65536) -> int:
    """Raises this process's soft limit on open files towards `target` (the hard limit allowing; the default
    soft limit of 1024 let a thousand idle clients lock out every other), and returns how many client
    connections to keep open at most: the limit less `FD_RESERVE`, or less half of it where the limit is
    that low (a container's `ulimit -n 100`: a floor above the limit itself let accepts fail in a loop that
    logged without end, which is what the cap is for)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # not allowed: the limit as it is
            logger.info("could not raise the open-file limit from %d: %s", soft, e)
    limit = target if soft == resource.RLIM_INFINITY else soft
    return max(1, limit - min(FD_RESERVE, limit // 2))


async def serve_async(args: ServerArgs) -> int:
    state = ServerState(model_name=args.served_model_name or default_model_name(args.engine.model),
                        metrics=None, api_key=args.api_key,  # type: ignore[arg-type]
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        stream_keepalive=args.stream_keepalive)
    state.metrics = Metrics(state.model_name)
    app = build_app(state, args.max_request_bytes, args.allowed_origins)
    # lifespan off: the app has no startup/shutdown hooks, and uvicorn's lifespan task, left pending by a
    # forced stop, would be cancelled at exit with a traceback in the log
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=False, lifespan="off",
                            http=functools.partial(ServerHttpProtocol, read_timeout=args.read_timeout,
                                                   write_timeout=args.write_timeout,
                                                   on_error=state.metrics.count_error,
                                                   max_connections=connection_limit()))
    server = _DrainingServer(config, state, args.shutdown_timeout, args.runtime_file)
    starter = asyncio.create_task(_start_engine(state, args, server))
    watcher = asyncio.create_task(_exit_when_the_engine_dies(state, server))
    try:
        await server.serve()
    finally:  # also when uvicorn fails (a port in use exits from inside serve): never leave the engine running
        remove_runtime_file(args.runtime_file)  # no longer listening
        with _signals_kill_engine(state):
            starter.cancel()  # a load still under way: EngineReplicas.start kills the half-started processes
            watcher.cancel()
            await asyncio.gather(starter, watcher, return_exceptions=True)
            if state.engine is not None:
                if server.forced:  # what still runs gets a shutting_down error, not "the engine died"
                    state.engine.abort_all("the server is shutting down: stopped at once by a second signal")
                await state.engine.shutdown(timeout=2 if server.forced else 10)
    return state.start_exit if state.start_error else 1 if state.engine_lost else 0


def serve(args: ServerArgs) -> int:
    use_log_level(args.log_level)
    problem = model_problem(args.engine.model)  # before the port is bound: the engine would find it only later
    problem = problem or parallel_problem(args.engine.model, args.dp if args.engine.dp_attention else args.engine.tp,
                                          heads_split=not args.engine.dp_attention, ep=args.engine.ep > 1)
    problem = problem or omnikv_problem(args.engine.model, args.engine.omnikv_config)
    problem = problem or device_problem(args.engine.device, args.dp, args.engine.tp // args.engine.nnodes)
    if problem:
        print(f"mlaserve serve: error: {problem}", file=sys.stderr)
        return 2
    try:  # before the model loads; uvicorn's own message would not name the host
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        print(f"mlaserve serve: error: --host {args.host!r} is not an address this machine can listen on "
              f"({e.strerror}); use an IP address such as 127.0.0.1 or 0.0.0.0, or a resolvable name", file=sys.stderr)
        return 2
    in_use = port_in_use(args.host, args.port)
    if in_use:  # before the model loads (uvicorn's own message comes after it, without the flags)
        print(f"mlaserve serve: error: cannot listen on {args.host} port {args.port}: {in_use}; pass another "
              "--port (MLASERVE_PORT; or --host, MLASERVE_HOST), or stop what holds it", file=sys.stderr)
        return 2
    eng = args.engine
    if (eng.tp > 1 or eng.dp_attention) and eng.node_rank == 0 and eng.master_port:  # rank 0 will listen there
        in_use = port_in_use(eng.master_addr, eng.master_port)
        if in_use:
            print(f"mlaserve serve: error: cannot listen for the ranks' rendezvous on {eng.master_addr} port "
                  f"{eng.master_port}: {in_use}; pass another --master-port (0: any free one, on one node), or stop "
                  "what holds it", file=sys.stderr)
            return 2
    return asyncio.run(serve_async(args))


def port_in_use(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound now, None if it can: each address as asyncio's create_server (which
    uvicorn calls) binds it, with SO_REUSEADDR and IPV6_V6ONLY, skipping a family the machine lacks; as
    there, no address at all is a failure (a --host that is not this machine's)."""
    unavailable, bound = None, False
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE):
        try:
            s = socket.socket(family, kind, proto)
        except OSError:
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    return e.strerror or str(e)
                unavailable = f"{e.strerror}: no interface of this machine has that address"
                continue  # (asyncio skips it: that family is not enabled)
            bound = True
    return None if bound else unavailable
