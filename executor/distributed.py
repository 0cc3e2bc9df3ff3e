"""One model over several processes (tensor parallelism): the scheduling rank leads, the others follow.

Rank 0, the engine process, schedules, allocates KV slots and samples, as it does alone. Before each
forward it broadcasts the batch to the other ranks over a gloo control group; then every rank runs
the same forward on its part of the weights, meeting in the layers' collectives (models.parallel),
and every rank ends with the whole logits (only rank 0 samples). A follower keeps a KV pool with the
same slots and a mirror of `req_to_token`, replayed from the journal of rank 0's writes
(executor.memory_pool), so a slot means the same token on every rank.

Control messages (msgspec, msgpack bytes in a uint8 tensor, its length broadcast first):
  Setup   once, after every rank loaded its weights: the pool sizes rank 0 chose, its OmniKV config
  Batch   a ForwardBatch's host fields, the table writes and the rows handed out since the last
          message, and the rows that decode with OmniKV (every rank selects their tokens alike: the
          selection's importance is a max over the heads, which the ranks take together)
  Ping    while idle, every PING_S: a dead rank is noticed (a broadcast to it fails) and a follower's
          wait never reaches the group's timeout
  Stop    the engine shuts down: followers return
A rank that dies makes the next broadcast or collective fail on the others (the connection closes):
rank 0's step raises, and the engine reports the crash as it does any other (engine.process).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

PING_S = 2.0  # idle rank 0 pings the followers this often


class Setup(msgspec.Struct, tag="setup", frozen=True):
    num_slots: int
    max_running_requests: int
    context_len: int
    kv_dtype: str
    omnikv: dict[str, Any] | None = None  # rank 0's OmniKV config (OmniKVConfig.to_dict), so every rank plans alike
    omnikv_bank: bool = False  # whether rank 0 keeps OmniKV's context bank (each rank keeps its own heads' part)


class OmniKVRows(msgspec.Struct, frozen=True):
    """The rows of a decode batch that decode with OmniKV (ModelRunner.omnikv_rows' arguments)."""

    rows: list[int]
    req_rows: list[int]
    positions: list[int]
    budgets: list[int]


class Batch(msgspec.Struct, tag="batch", frozen=True):
    mode: int
    input_ids: list[int]
    positions: list[int]
    rows: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_loc: list[int]
    logits_indices: list[int] | None
    writes: list[tuple[int, int, list[int]]]  # req_to_token: (row, start, slots)
    # req_to_token rows handed to a new request since the last message: a follower clears what it keeps
    # per row (OmniKV's query history) before it replays the writes
    fresh_rows: list[int] = []
    omnikv: OmniKVRows | None = None


class Ping(msgspec.Struct, tag="ping", frozen=True):
    pass


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Message = Setup | Batch | Ping | Stop
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def broadcast_message(msg: Message | None, group: Any) -> Message:
    """Rank 0 passes `msg`, the others None; every rank returns it."""
    import torch.distributed as dist

    if msg is not None:
        data = _encoder.encode(msg)
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, 0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group)
        return msg
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return _decoder.decode(buf.numpy().tobytes())


def gather_status(error: str | None, group: Any, settings: dict[str, str] | None = None
                  ) -> list[tuple[str | None, dict[str, str] | None]]:
    """Every rank's start-up problem (None: ready) and the settings it computes with, on every rank: one
    rank that could not load its weights stops the others with its reason instead of leaving them
    waiting, and ranks started with different settings are found before they compute together."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (error, settings), group=group)
    return out


class Leader:
    """Rank 0's side: `ModelRunner.followers`. Every batch goes to the followers before rank 0 runs it;
    a thread pings them while no step runs. The first failure to reach them (a rank died) is kept and
    raised by the next step, and reported by `failure()` meanwhile."""

    def __init__(self, runner: Any, group: Any) -> None:
        self.runner, self.group = runner, group
        self.table = runner.req_to_token_pool
        self.table.journal = []
        self._fresh: list[int] = []
        self.table.on_alloc.append(self._fresh.append)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._error: str | None = None
        self._stopped = threading.Event()
        runner.followers = self
        self._pinger = threading.Thread(target=self._ping_loop, name="tp-ping", daemon=True)
        self._pinger.start()

    def failure(self) -> str | None:
        return self._error

    @contextlib.contextmanager
    def step(self, batch: ForwardBatch) -> Iterator[None]:
        """Sends `batch` and holds the control group while rank 0 runs it (no ping in between)."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"tensor parallelism: {self._error}")
            writes, self.table.journal = self.table.journal, []
            fresh, self._fresh[:] = list(self._fresh), []
            sparse = batch.omnikv
            msg = Batch(
                mode=int(batch.forward_mode), input_ids=batch.input_ids.tolist(), positions=batch.positions.tolist(),
                rows=batch.req_pool_indices.tolist(), seq_lens=list(batch.seq_lens_cpu),
                prefix_lens=list(batch.extend_prefix_lens_cpu), extend_lens=list(batch.extend_seq_lens_cpu),
                out_loc=batch.out_cache_loc.tolist(),
                logits_indices=None if batch.logits_indices is None else batch.logits_indices.tolist(),
                writes=writes, fresh_rows=fresh,
                omnikv=None if sparse is None else OmniKVRows(sparse.rows, sparse.req_rows, sparse.positions,
                                                              sparse.budgets))
            self._send(msg)
            yield
            self._last = time.monotonic()

    def _send(self, msg: Message) -> None:
        try:
            broadcast_message(msg, self.group)
        except Exception as exc:  # a follower is gone: nothing more can run
            # gloo's text (a build path, an address, a joke) is for the log; `failure()` reaches clients
            logger.error("tensor parallelism: broadcasting to the ranks failed: %s: %s", type(exc).__name__, exc)
            self._error = ("a rank stopped answering rank 0's broadcast (its process or its node ended, or the "
                           "connection broke; each node's log says which)")
            raise RuntimeError(f"tensor parallelism: {self._error}") from None

    def _ping_loop(self) -> None:
        while not self._stopped.wait(PING_S / 4):
            with self._lock:
                if self._error is not None or self._stopped.is_set():
                    return
                if time.monotonic() - self._last >= PING_S:
                    try:
                        self._send(Ping())
                    except RuntimeError:
                        logger.error("tensor parallelism: %s", self._error)
                        return
                    self._last = time.monotonic()

    def stop(self, tell: bool = True) -> None:
        """Ends the pings and, with `tell`, tells the followers to return (when they can still be
        reached). Idempotent. Never waits long: a ping may hold the control group for good, blocked
        in a broadcast to a rank that is stopped without dying."""
        self._stopped.set()
        if not tell or not self._lock.acquire(timeout=2 * PING_S):
            self._error = self._error or "stopped"
            return
        try:
            if self._error is None:
                with contextlib.suppress(RuntimeError):
                    self._send(Stop())
                self._error = self._error or "stopped"
        finally:
            self._lock.release()


def follow(runner: Any, group: Any) -> None:
    """A follower's loop: run every batch rank 0 sends, until Stop. Raises when rank 0 is gone."""
    table = runner.req_to_token_pool.req_to_token
    dev = runner.device
    while True:
        msg = broadcast_message(None, group)
        if isinstance(msg, Stop):
            return
        if not isinstance(msg, Batch):
            continue
        for row in msg.fresh_rows:
            for clear in runner.req_to_token_pool.on_alloc:
                clear(row)
        for row, start, slots in msg.writes:
            table[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32, device=table.device)
        ids = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        batch = ForwardBatch(
            forward_mode=ForwardMode(msg.mode), batch_size=len(msg.rows), input_ids=ids(msg.input_ids),
            positions=ids(msg.positions), req_pool_indices=ids(msg.rows), seq_lens=ids(msg.seq_lens),
            seq_lens_cpu=msg.seq_lens, extend_prefix_lens_cpu=msg.prefix_lens, extend_seq_lens_cpu=msg.extend_lens,
            out_cache_loc=ids(msg.out_loc), req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.kv_pool, attn_backend=runner.attn_backend,
            logits_indices=None if msg.logits_indices is None else ids(msg.logits_indices),
            omnikv=None if msg.omnikv is None else runner.omnikv_rows(
                msg.omnikv.rows, msg.omnikv.req_rows, msg.omnikv.positions, msg.omnikv.budgets))
        runner.forward(batch)
