"""`mlaserve serve`: start the HTTP server at once, load the engine behind it, drain on SIGTERM.

Order of events:
  1. uvicorn starts listening; `/health` answers 503 "loading" and `/v1/*` 503 until ready.
  2. The tokenizer loads here; the engine core process starts and loads the weights.
  3. Ready: `/health` 200.
  4. SIGTERM/SIGINT, to this process or to its whole process group (the engine process ignores
     both: the server decides): `/health` and new requests get 503 with Retry-After, in-flight
     requests get up to `--shutdown-timeout` seconds to finish; what still runs then is ended with
     a `shutting_down` error; the engine process is shut down; exit code 0. A second signal stops
     at once (in-flight streams are cut, the engine gets a short grace, then is killed).
  If the engine cannot start, the error is logged and the process exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import uvicorn

from models.builtin import builtin_names
from models.builtin import resolve_model_path
from models.loader.tokenizer import load_tokenizer
from engine.client import EngineClient
from server.app import ServerState, build_app
from server.args import ServerArgs
from server.metrics import Metrics

logger = logging.getLogger("mlaserve.server")


class _DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: keep listening but answer 503 to new work, let in-flight requests
    finish (up to `grace` seconds), end the rest with an error, then stop. A second signal stops at
    once."""

    ABORT_FLUSH_S = 5.0  # after ending the late requests, how long their error responses may take to go out

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.forced = False  # a second signal came
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        # not calling uvicorn's handler: it re-raises the signal after shutdown, and the process would
        # then die by SIGTERM instead of exiting 0
        if self.state.shutting_down or self.state.engine is None:
            self.forced = self.state.shutting_down
            self.force_exit = self.should_exit or self.forced  # a second signal: stop now
            self.should_exit = True
            if self.forced:
                logger.warning("second signal: stopping now")
            return
        self.state.shutting_down = True
        logger.info("shutting down: draining %d in-flight request(s), up to %.0fs", self.state.inflight, self.grace)
        self._drain = asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self._wait_inflight(self.grace)
        engine = self.state.engine
        if self.state.inflight > 0 and engine is not None:
            ended = engine.abort_all(f"the server is shutting down: the request did not finish within "
                                     f"--shutdown-timeout {self.grace:g} s")
            logger.warning("shutdown: ended %d request(s) still running after %gs", ended, self.grace)
            await self._wait_inflight(self.ABORT_FLUSH_S)
        self.should_exit = True

    async def _wait_inflight(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def default_model_name(model: str) -> str:
    """A built-in name as it is; a file's stem (`model.gguf` -> `model`); a directory's name."""
    if model in builtin_names():
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


async def _start_engine(state: ServerState, args: ServerArgs, server: _DrainingServer) -> None:
    try:
        state.tokenizer = await asyncio.to_thread(load_tokenizer, args.engine.model)
        engine = await EngineClient.start(args.engine)
        state.context_length = engine.info.context_length
        state.vocab_size = engine.info.vocab_size
        state.engine = engine
        logger.info("ready: serving %s as '%s' on http://%s:%d", args.engine.model, state.model_name,
                    args.host, args.port)
    except Exception as e:
        logger.error("the engine failed to start: %s", e)
        state.start_error = str(e)
        server.should_exit = True


async def serve_async(args: ServerArgs) -> int:
    state = ServerState(model_name=args.served_model_name or default_model_name(args.engine.model),
                        metrics=None, api_key=args.api_key)  # type: ignore[arg-type]
    state.metrics = Metrics(state.model_name)
    app = build_app(state, args.max_request_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = _DrainingServer(config, state, args.shutdown_timeout)
    starter = asyncio.create_task(_start_engine(state, args, server))
    await server.serve()
    if not starter.done():
        starter.cancel()
    if state.engine is not None:
        await state.engine.shutdown(timeout=2 if server.forced else 10)
    return 1 if state.start_error else 0


def serve(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        resolve_model_path(args.engine.model)
    except FileNotFoundError as e:
        print(f"mlaserve: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve_async(args))
