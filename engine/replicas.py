"""`EngineReplicas`: data parallelism (`mlaserve serve --dp N`), N whole engines behind one server.

Each replica is an `EngineClient` and its engine process, with the whole model, its own KV cache,
prefix cache and scheduler. The server talks to the set as it would to one client (`generate`,
`abort`, `abort_all`, `stats`, `info`, `shutdown`); with one replica every call is that client's.

Routing (`PrefixRouter`, per engine request; the `n` completions of a request stay together):
- cache-aware: a prompt's leading blocks of `PREFIX_BLOCK` tokens, up to `PREFIX_BLOCKS` of them,
  are hashed as prefixes (the first block, the first two, ...; a prompt shorter than one block is
  one key, itself). A bounded LRU map remembers which replica last took each key. The longest key
  of the prompt that is known names its home, used when that prefix covers at least half of the
  prompt's hashed blocks: the home's prefix cache then likely holds it;
- load: each replica's completions its engine has not ended, counted here (`EngineClient.held`: not
  those ended whose outputs a slow client has yet to read). The home is
  skipped when it has more than `max(SLACK, least // 2)` completions over the least busy replica,
  or when it is full (as many completions as its admission limits take: `--max-running-requests` +
  `--max-queued-requests`, each replica's own) while another is not; a prompt with no home, or a
  skipped one, goes to the least busy replica that is not full (ties taken in turn, so that requests
  one after another spread). The chosen replica becomes the home of all the prompt's keys.
- a dead replica is never chosen; its requests fail with `engine_error` (`EngineClient`).

`is_alive` is every replica alive (a server with a dead replica is not healthy: `/health` 503), and
`any_alive` whether requests can still be served. Counters of a replica that died stay at their
last values in `stats()`, so summed totals never go down.

Per-replica settings (`replica_args`): replica i gets the CPUs of its share of this process's
affinity mask, its own GPU(s) on CUDA (`cuda:<base + i * tp>`, each replica's ranks on its own
devices, as SGLang and vLLM place data-parallel replicas), and base seed `--seed + i` (two replicas
must not draw the same seeds for requests that bring none; without --seed, one drawn at start and logged). On a CPU the
replicas share the host's
memory: each sizes its KV cache by `--mem-fraction / N` of it (N caches of the whole fraction each
promised more than the host had, the pages touched only as tokens came, and were killed when full).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, AsyncIterator

import msgspec

from engine.args import EngineArgs, free_port
from engine.cgroups import usable_cpus
from engine.client import EngineClient
from engine.messages import (EngineInfo, EngineStartupError, EngineStats, GenerateRequest, RequestOutput,
                             overloaded_message)
from engine.process import CoreFactory

logger = logging.getLogger(__name__)

PREFIX_BLOCK = 32  # tokens per hashed block (a chat template's opening alone is rarely a whole block)
PREFIX_BLOCKS = 8  # blocks that decide the route: the first 256 tokens
ROUTES_KEPT = 1 << 16  # keys remembered (LRU)
SLACK = 4  # completions a home may have over the least busy replica (or half of the least's, if more)


def prefix_keys(ids: Sequence[int], block: int = PREFIX_BLOCK, blocks: int = PREFIX_BLOCKS) -> list[int]:
    """Keys of the prompt's leading 1, 2, .., `blocks` whole blocks (chained hashes); a prompt shorter
    than one block has one key, of itself."""
    if len(ids) < block:
        return [hash(("short", tuple(ids)))]
    keys, h = [], 0
    for start in range(0, min(len(ids) // block, blocks) * block, block):
        h = hash((h, tuple(ids[start:start + block])))
        keys.append(h)
    return keys


class PrefixRouter:
    """Chooses a replica for a prompt (the policy in the module docstring), given the replicas' loads.

    Apart from the processes so that the policy can be tested with made-up loads."""

    def __init__(self, replicas: int, *, block: int = PREFIX_BLOCK, blocks: int = PREFIX_BLOCKS,
                 capacity: int = ROUTES_KEPT, slack: int = SLACK, room: int | None = None) -> None:
        """`room`: completions one replica admits (None: no limit known)."""
        self.replicas, self.block, self.blocks, self.capacity, self.slack = replicas, block, blocks, capacity, slack
        self.room = room
        self._homes: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica that took it last
        self._turn = 0  # where the next tie among the least busy starts

    def choose(self, ids: Sequence[int], loads: Sequence[int | None]) -> int:
        """The replica for prompt `ids`; `loads[i]`: replica i's completions its engine holds, None if it is dead.
        Records the choice as the home of the prompt's keys. ValueError when every replica is dead."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no live replica")
        # a full replica would refuse the request (503) while another has room (all full: the least busy)
        open_ = [i for i in live if self.room is None or loads[i] < self.room] or live  # type: ignore[operator]
        least = min(loads[i] for i in open_)  # type: ignore[type-var]
        keys = prefix_keys(ids, self.block, self.blocks)
        home = None
        for matched in range(len(keys), 0, -1):
            h = self._homes.get(keys[matched - 1])
            if h is not None and loads[h] is not None:
                if 2 * matched >= len(keys):  # the known prefix covers at least half the hashed blocks
                    home = h
                break
        if home in open_ and loads[home] - least <= max(self.slack, least // 2):  # type: ignore[operator]
            choice = home
        else:
            tied = [i for i in open_ if loads[i] == least]
            choice = next((i for i in tied if i >= self._turn), tied[0])
            self._turn = choice + 1
        for key in keys:
            self._homes[key] = choice
            self._homes.move_to_end(key)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)
        return choice

    @property
    def keys_kept(self) -> int:
        return len(self._homes)


def replica_args(args: EngineArgs, index: int, replicas: int,
                 cpus: Sequence[int]) -> tuple[EngineArgs, list[int] | None]:
    """Replica `index`'s settings and CPUs (see the module docstring); one replica: `args` as given."""
    if replicas == 1:
        return args, None
    changes: dict[str, Any] = {"seed": None if args.seed is None else args.seed + index, "host_peers": replicas}
    if args.dp_attention:  # the replicas are the ranks of one model (engine.ranks.DPAttentionRank)
        changes.update(dp_rank=index, dp_size=replicas)
    if args.device.startswith("cuda"):
        base = int(args.device.partition(":")[2] or 0)
        changes["device"] = f"cuda:{base + index * args.tp}"
    else:  # one memory for all of them
        changes["mem_fraction"] = args.mem_fraction / replicas
    share = sorted(cpus)
    if len(share) >= replicas:  # contiguous slices, the remainder to the first ones
        size, extra = divmod(len(share), replicas)
        start = index * size + min(index, extra)
        share = share[start:start + size + (index < extra)]
    return dataclasses.replace(args, **changes), share


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Field by field: numbers added, dicts added key by key (`request_id` is meaningless here: 0)."""
    total = EngineStats()
    for field in msgspec.structs.fields(EngineStats):
        if field.name == "request_id":
            continue
        values = [getattr(s, field.name) for s in stats]
        if isinstance(getattr(total, field.name), dict):
            merged: dict[str, Any] = {}
            for v in values:
                for k, n in v.items():
                    merged[k] = merged.get(k, 0) + n
            setattr(total, field.name, merged)
        else:
            setattr(total, field.name, sum(values))
    return total


def _as_counters(stats: EngineStats) -> EngineStats:
    """A dead replica's last stats: its totals stay, its gauges (requests, KV) are gone."""
    return msgspec.structs.replace(stats, num_running=0, num_waiting=0, kv_slots_used=0, kv_slots_total=0,
                                   prefix_cache_slots=0, omnikv_bank_host_bytes=0)


class EngineReplicas:
    """N engine clients behind the one interface the server uses. Build it with `await EngineReplicas.start(...)`.

    Same threading rules as `EngineClient`: async methods on the loop that started it; `is_alive`,
    `any_alive`, `info`, `held` counts and `kill` are plain reads (kill: from a signal handler too)."""

    def __init__(self, clients: list[EngineClient], router: PrefixRouter | None = None, *, bound: bool = False,
                 limits: tuple[int, int] | None = None) -> None:
        """`bound`: the replicas are the ranks of one model (--dp-attention), so none works without the
        others: when one dies, the rest are ended with its reason (a replica left waiting for a dead
        or frozen peer would hold its requests until the group's timeout). `limits`: each replica's
        --max-running-requests and --max-queued-requests, for `overloaded`."""
        self.clients = clients
        self.limits = limits
        self._broken = False
        if bound:
            for i, c in enumerate(clients):
                c.on_dead = functools.partial(self._group_broken, i)
        self.router = router or PrefixRouter(len(clients))
        self.routed = [0] * len(clients)  # engine requests sent to each replica
        self._replica_of: dict[str, int] = {}  # rid -> replica, while its stream is open

    # ---- life cycle ---------------------------------------------------------------------------

    @classmethod
    async def start(cls, args: EngineArgs, replicas: int = 1, *,
                    core_factory: CoreFactory | None = None) -> EngineReplicas:
        """Starts `replicas` engines at once and waits until all are ready. If one fails, the others are
        stopped and RuntimeError says which replica failed and why (one replica: its message as is)."""
        cpus = usable_cpus()
        if args.dp_attention and args.master_port == 0:  # one rendezvous for all the replicas
            args = dataclasses.replace(args, master_port=free_port(args.master_addr))
        if replicas > 1 and args.seed is None:  # one draw for all: replica i's base seed is it + i, as --seed's
            args = dataclasses.replace(args, seed=secrets.randbits(63))
            logger.info("requests that bring no seed draw from base seed %d + the replica's index (drawn at start; "
                        "--seed %d repeats them)", args.seed, args.seed)
        tasks = []
        for i in range(replicas):
            r_args, r_cpus = replica_args(args, i, replicas, cpus)
            name = "mlaserve-engine-core" if replicas == 1 else f"mlaserve-engine-core-{i}"
            tasks.append(asyncio.ensure_future(EngineClient.start(
                r_args, core_factory=core_factory, cpus=r_cpus, name=name)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((i for i, t in enumerate(tasks) if t.done() and t.exception() is not None), None)
            if failed is not None:
                error = tasks[failed].exception()
                if replicas == 1:
                    raise error  # type: ignore[misc]
                raise EngineStartupError(f"engine replica {failed} of {replicas} failed to start: {error}",
                                         settings_fault=getattr(error, "settings_fault", False)) from error
        except BaseException:  # a failure, or start() itself cancelled: stop every replica started or starting
            for t in tasks:
                t.cancel()  # EngineClient.start kills its half-started process
            await asyncio.gather(*tasks, return_exceptions=True)
            started = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
            await asyncio.gather(*(c.shutdown(timeout=5) for c in started), return_exceptions=True)
            raise
        clients = [t.result() for t in tasks]
        if replicas > 1:
            logger.info("%d engine replicas ready (processes %s)", replicas, ", ".join(str(c.pid) for c in clients))
            for i, c in enumerate(clients):
                c.label = f"replica {i}: "  # (its death's log line says which)
        room = args.max_running_requests + args.max_queued_requests
        return cls(clients, PrefixRouter(replicas, room=room), bound=args.dp_attention,
                   limits=(args.max_running_requests, args.max_queued_requests))

    def overloaded(self, asked: int) -> str | None:
        """The engine's overload refusal of a request for `asked` completions when every live replica holds
        as many as it admits, else None. The server answers it before it renders and tokenizes the request:
        past the limits the refusals had waited their turn behind that work (seconds under a retry storm,
        whose work also took the admitted requests' CPU). What a replica holds is what its engine has not
        ended (`EngineClient.held`), not what its clients have not read. A request for more than a replica
        ever admits is left to the engine's 400."""
        if self.limits is None:
            return None
        running, queued = self.limits
        live = [c.held for c in self.clients if c.is_alive]
        if not live or min(live) < running + queued or asked > running + queued:
            return None
        # (a client's count also holds requests sent that its engine is refusing: the engine holds its limit)
        return overloaded_message(running + queued, running, queued, asked)

    def _group_broken(self, index: int, reason: str) -> None:
        """Replica `index` died (on the loop): the others are ended with its reason, once."""
        if self._broken:
            return
        self._broken = True
        for i, c in enumerate(self.clients):
            if i != index and c.is_alive:
                c.fail(f"--dp-attention replica {index} failed ({reason}); the replicas run only together")

    async def shutdown(self, timeout: float = 10) -> None:
        """Shuts every replica down at once (see `EngineClient.shutdown`)."""
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    def kill(self) -> list[int]:
        """SIGKILLs the engine processes still running; their pids."""
        return [c.pid for c in self.clients if c.kill() and c.pid is not None]

    # ---- requests -----------------------------------------------------------------------------

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """`EngineClient.generate` on the replica the router picks when iteration starts (one replica:
        that client's stream itself)."""
        if len(self.clients) == 1:
            self.routed[0] += 1
            return self.clients[0].generate(req)
        return self._routed(req)

    async def _routed(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.any_alive:
            index = self.router.choose(req.input_ids, [c.held if c.is_alive else None for c in self.clients])
            self.routed[index] += 1
        else:  # the client answers with the engine's error at once
            index = 0
        self._replica_of[req.rid] = index
        stream = self.clients[index].generate(req)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # at once, not when collected: closing it aborts the request in the engine
            self._replica_of.pop(req.rid, None)

    def replica_of(self, rid: str) -> int | None:
        """The replica serving `rid`, while its stream is open."""
        return self._replica_of.get(rid)

    async def abort(self, rid: str, index: int | None = None) -> None:
        """`EngineClient.abort` on the replica serving `rid`."""
        replica = self._replica_of.get(rid)
        if replica is not None:
            await self.clients[replica].abort(rid, index)

    def abort_all(self, reason: str) -> int:
        """`EngineClient.abort_all` on every replica; how many requests it ended."""
        return sum(c.abort_all(reason) for c in self.clients)

    async def stats(self, timeout: float | None = None) -> EngineStats:
        """The replicas' stats summed (a dead replica: its last totals). An engine answers between its
        steps, so one inside a long step (a big prefill on a CPU: seconds) that has not answered within
        `timeout` counts with the latest stats it sent: those it pushes unasked each second of steps
        (`engine.process.STATS_PUSH_S`), or a late answer. RuntimeError when all are dead."""
        if not self.any_alive:
            raise RuntimeError(self.clients[0].dead_reason or "the engine is not running")
        asks = [asyncio.ensure_future(c.stats()) for c in self.clients if c.is_alive]
        for ask in asks:  # a late one's error (the engine died meanwhile) is looked at, not logged as lost
            ask.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.wait(asks, timeout=timeout)
        for ask in asks:
            if ask.done() and not ask.cancelled():
                error = ask.exception()
                if error is not None and not isinstance(error, RuntimeError):  # RuntimeError: died meanwhile
                    raise error
        latest = [c.latest_stats or EngineStats() for c in self.clients]
        return sum_stats([s if c.is_alive else _as_counters(s) for c, s in zip(self.clients, latest)])

    # ---- state --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.clients)

    @property
    def is_alive(self) -> bool:
        """Every replica runs (what `/health` reports)."""
        return all(c.is_alive for c in self.clients)

    @property
    def any_alive(self) -> bool:
        """Some replica runs: requests can be served."""
        return any(c.is_alive for c in self.clients)

    @property
    def alive(self) -> int:
        return sum(c.is_alive for c in self.clients)

    def dead(self) -> list[tuple[int, str]]:
        """(replica, why) of each replica that is gone."""
        return [(i, c.dead_reason or "not running") for i, c in enumerate(self.clients) if not c.is_alive]

    @property
    def info(self) -> EngineInfo:
        """Replica 0's (they all load the same model with the same settings)."""
        return self.clients[0].info

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.clients]
