"""`engine.replicas`: the routing policy with made-up loads, per-replica settings, summed stats, and
`EngineReplicas` over real engine processes running the echo `FakeCore` (load counting, n > 1 on one
replica, a replica killed mid-stream, a replica that cannot start, shutdown)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import signal
import time
from pathlib import Path

import pytest

from engine.args import EngineArgs
from engine.process import EXIT_OK
from engine.messages import ERR_ENGINE, FINISH_ERROR, FINISH_LENGTH, EngineStats, GenerateRequest
from engine.replicas import PREFIX_BLOCK, EngineReplicas, PrefixRouter, prefix_keys, replica_args, sum_stats
from scheduler.sampling_params import SamplingParams
from tests.engine.test_engine_process import FakeCore, collect, expected_token, tokens_by_index
from tests.server.server_process import alive, all_gone, child_pids


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


# ---- the policy, with made-up loads --------------------------------------------------------------


def test_a_shared_prefix_goes_home_and_new_prefixes_spread() -> None:
    rng = random.Random(1)
    router = PrefixRouter(2)
    system = ids(rng, 6 * PREFIX_BLOCK)  # a long shared prefix: 6 of the 8 hashed blocks
    first = router.choose(system + ids(rng, 40), [0, 0])
    for _ in range(10):  # the same prefix, different tails: the same replica (its prefix cache)
        assert router.choose(system + ids(rng, rng.randrange(1, 100)), [0, 0]) == first
    # unrelated prompts one after another, both replicas idle: taken in turn, so both get work
    picks = [router.choose(ids(rng, rng.randrange(1, 300)), [0, 0]) for _ in range(10)]
    assert picks.count(0) == picks.count(1) == 5


def test_a_busy_home_is_left_for_the_least_busy_replica() -> None:
    rng = random.Random(2)
    router = PrefixRouter(3, slack=4)
    prompt = ids(rng, 200)
    home = router.choose(prompt, [0, 0, 0])
    loads = [0, 0, 0]
    loads[home] = 4  # within the slack: still home
    assert router.choose(prompt, loads) == home
    loads[home] = 5  # 5 > 0 + 4: too busy
    other = router.choose(prompt, loads)
    assert other != home and loads[other] == 0
    assert router.choose(prompt, [0, 0, 0]) == other  # the prefix's home moved with it
    # at heavy load the slack is half the least busy replica's load
    loads = [40, 40, 40]
    loads[other] = 60
    assert router.choose(prompt, loads) == other  # 60 - 40 <= 20
    loads[other] = 61
    assert router.choose(prompt, loads) != other


def test_a_full_home_is_left_while_another_replica_has_room() -> None:
    """A replica at its admission limits would refuse the request (503) while another sat idle: with
    --max-running-requests 1 --max-queued-requests 0, two requests sharing a prefix both went home."""
    rng = random.Random(6)
    router = PrefixRouter(2, room=1)
    prompt = ids(rng, 200)
    home = router.choose(prompt, [0, 0])
    loads = [0, 0]
    loads[home] = 1  # full, though within the slack
    assert router.choose(prompt, loads) != home
    assert router.choose(prompt, [1, 1]) in (0, 1)  # all full: the least busy (the engine then says 503)
    assert router.choose(ids(rng, 100), [1, 0]) == 1


def test_the_least_busy_replica_takes_a_new_prefix() -> None:
    rng = random.Random(3)
    router = PrefixRouter(4)
    for _ in range(20):
        loads = [rng.randrange(0, 10) for _ in range(4)]
        choice = router.choose(ids(rng, rng.randrange(1, 400)), loads)
        assert loads[choice] == min(loads)


def test_a_short_shared_opening_does_not_pin_a_prompt() -> None:
    """Only the first of a prompt's 8 hashed blocks is known: not enough to count as its home."""
    rng = random.Random(4)
    router = PrefixRouter(2)
    opening = ids(rng, PREFIX_BLOCK)
    home = router.choose(opening + ids(rng, 300), [0, 0])
    assert router.choose(opening + ids(rng, 300), [0, 0]) != home  # spread (turns), not pinned
    half = opening + ids(rng, 3 * PREFIX_BLOCK)
    where = router.choose(half + ids(rng, 300), [0, 0])
    assert router.choose(half + ids(rng, 300), [0, 0]) == where  # 4 of 8 blocks known: home


def test_dead_replicas_are_never_chosen() -> None:
    rng = random.Random(5)
    router = PrefixRouter(3)
    prompt = ids(rng, 100)
    home = router.choose(prompt, [0, 0, 0])
    loads: list[int | None] = [5, 5, 5]
    loads[home] = None
    for _ in range(10):
        assert router.choose(prompt, loads) != home
        assert router.choose(ids(rng, 50), loads) != home
    with pytest.raises(ValueError):
        router.choose(prompt, [None, None, None])


def test_keys_and_the_map_are_bounded() -> None:
    rng = random.Random(6)
    assert len(prefix_keys(ids(rng, 10))) == 1
    assert len(prefix_keys(ids(rng, 3 * PREFIX_BLOCK + 5))) == 3
    assert len(prefix_keys(ids(rng, 10_000))) == 8
    a = ids(rng, 2 * PREFIX_BLOCK)
    assert prefix_keys(a + [1])[:2] == prefix_keys(a + [2] * PREFIX_BLOCK)[:2]  # a prefix's keys are the same
    router = PrefixRouter(2, capacity=50)
    for _ in range(100):
        router.choose(ids(rng, 300), [0, 0])
    assert router.keys_kept == 50


def test_replica_settings() -> None:
    args = EngineArgs(model="m", device="cuda:1", tp=2, seed=7)
    one, cpus = replica_args(args, 0, 1, [0, 1, 2])
    assert one is args and cpus is None  # one replica: as given
    r0, c0 = replica_args(args, 0, 2, list(range(5)))
    r1, c1 = replica_args(args, 1, 2, list(range(5)))
    assert (r0.device, r1.device) == ("cuda:1", "cuda:3")  # each replica's 2 ranks on GPUs of their own
    assert (r0.seed, r1.seed) == (7, 8)
    assert (c0, c1) == ([0, 1, 2], [3, 4])
    cpu = EngineArgs(model="m")
    assert replica_args(cpu, 1, 2, [0])[0].device == "cpu"
    assert replica_args(cpu, 1, 2, [0])[1] == [0]  # fewer CPUs than replicas: shared
    # the host's memory is shared: each of N replicas sizes its cache by 1/N of --mem-fraction
    assert replica_args(cpu, 1, 2, [0])[0].mem_fraction == cpu.mem_fraction / 2 and r0.mem_fraction == args.mem_fraction
    # and the OmniKV banks' host share: each replica knows how many engine processes the host holds
    assert (r0.host_peers, r1.host_peers, one.host_peers) == (2, 2, 1)
    assert dataclasses.replace(replica_args(cpu, 1, 2, [0])[0], seed=cpu.seed, mem_fraction=cpu.mem_fraction,
                               host_peers=1) == cpu


def test_sum_stats_adds_every_field() -> None:
    a = EngineStats(request_id=3, num_running=2, kv_slots_used=10, kv_slots_total=100, forward_seconds_total=1.5,
                    finished_total={"stop": 2, "length": 1})
    b = EngineStats(request_id=4, num_running=1, kv_slots_used=30, kv_slots_total=100, forward_seconds_total=0.25,
                    finished_total={"stop": 5, "abort": 1}, retractions_total=3)
    total = sum_stats([a, b])
    assert (total.num_running, total.kv_slots_used, total.kv_slots_total) == (3, 40, 200)
    assert total.kv_usage == 0.2 and total.forward_seconds_total == 1.75 and total.retractions_total == 3
    assert total.finished_total == {"stop": 7, "length": 1, "abort": 1} and total.request_id == 0


# ---- EngineReplicas over engine processes with the echo core ----------------------------------


class FailOnce:
    """A core factory whose first call, across processes, fails (the marker file decides)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __call__(self, args: EngineArgs) -> FakeCore:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            time.sleep(1.0)  # the lucky one is still loading when the other fails
            return FakeCore(args)
        raise FileNotFoundError("no weights here")


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def req(rid: str, prompt: list[int], *, n: int = 1, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens), arrival_time=time.time())


async def start(replicas: int = 2, **fake) -> EngineReplicas:
    return await EngineReplicas.start(EngineArgs(model="fake-model", startup_timeout=30), replicas,
                                      core_factory=functools.partial(FakeCore, **fake))


def test_two_replicas_serve_count_load_and_keep_n_together() -> None:
    rng = random.Random(7)

    async def go() -> None:
        engine = await start(step_delay=0.01)
        try:
            assert engine.size == 2 and engine.is_alive and len(set(engine.pids)) == 2
            assert all(alive(pid) for pid in engine.pids)  # type: ignore[arg-type]
            # a long request on each replica: their loads count completions while they run
            long = [req(f"long{i}", ids(rng, 10), n=3, max_tokens=100_000) for i in range(2)]
            streams = [engine.generate(r) for r in long]
            firsts = [await anext(s) for s in streams]
            served = [engine.replica_of(r.rid) for r in long]
            assert sorted(served) == [0, 1], served  # both idle: taken in turn
            assert [c.held for c in engine.clients] == [3, 3]
            assert all(f.rid == r.rid for f, r in zip(firsts, long))
            # n > 1: every completion of a request from the one replica, as one engine would give them
            reqs = [req(f"r{i}", ids(rng, rng.randrange(1, 80)), n=rng.choice([1, 2, 3]),
                        max_tokens=rng.randrange(1, 20)) for i in range(12)]
            results = await asyncio.gather(*(collect(engine, r) for r in reqs))  # type: ignore[arg-type]
            for r, outs in zip(reqs, results):
                want = {i: [expected_token(r, i, k) for k in range(r.params.max_tokens)] for i in range(r.params.n)}
                assert tokens_by_index(outs) == want
            assert [c.held for c in engine.clients] == [3, 3]  # the short ones came and went
            stats = await engine.stats()
            assert stats.num_running == 2 and stats.finished_total[FINISH_LENGTH] == len(reqs)
            assert stats.finished_total["stats_calls"] == sum(  # each replica's own, added up
                c.latest_stats.finished_total["stats_calls"] for c in engine.clients)  # type: ignore[union-attr]
            for s in streams:
                await s.aclose()  # stops early: aborts in its engine, its load goes back to 0
            assert [c.held for c in engine.clients] == [0, 0]
            assert engine.replica_of("long0") is None
            assert sum(engine.routed) == 2 + len(reqs)
        finally:
            await engine.shutdown()
        assert [c.exitcode for c in engine.clients] == [EXIT_OK, EXIT_OK]  # each was asked to stop, and did
        assert not any(alive(pid) for pid in engine.pids)  # type: ignore[arg-type]

    run(go())


def test_stats_inside_a_long_step_answer_at_once_with_the_latest_ones() -> None:
    """An engine answers stats between steps: with a timeout, a scrape during a long step gets the latest
    stats at once (no stall). Those are the ones the engine pushes unasked after its steps, a second apart at
    most: they were the previous scrape's late answer, as old as the scrape interval (the first scrape of a
    busy server read no request running)."""
    async def go() -> None:
        engine = await start(replicas=1, step_delay=1.5)
        try:
            stream = engine.generate(req("long", [1, 2, 3], max_tokens=100_000))
            await anext(stream)  # it runs: every step now takes 1.5 s
            await asyncio.sleep(1.7)  # a step ends meanwhile, and the next begins
            t0 = time.monotonic()
            now = await engine.stats(timeout=0.2)  # the first scrape, inside a step
            assert time.monotonic() - t0 < 1.0
            assert now.num_running == 1 and now.finished_total["stats_calls"] >= 1, now
            first = await engine.stats()  # no timeout: waits for the step to end
            await asyncio.sleep(3.2)  # the late replies and the pushed stats arrive between steps
            later = await engine.stats(timeout=0.2)
            assert later.finished_total["stats_calls"] > first.finished_total["stats_calls"], (first, later)
            await stream.aclose()
        finally:
            await engine.shutdown()

    run(go())


def test_a_killed_replica_fails_its_requests_and_the_other_serves() -> None:
    rng = random.Random(8)

    async def go() -> None:
        engine = await start(step_delay=0.01)
        try:
            long = [req(f"long{i}", ids(rng, 10), max_tokens=100_000) for i in range(2)]
            streams = [engine.generate(r) for r in long]
            for s in streams:
                await anext(s)
            victim = engine.replica_of("long0")
            assert victim is not None
            before = await engine.stats()
            os.kill(engine.clients[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
            t0 = time.monotonic()
            outs = [out async for out in streams[0]]  # its stream ends with the engine's error, never hangs
            assert outs[-1].finish_reason == FINISH_ERROR and outs[-1].error_code == ERR_ENGINE
            assert f"exit code {-signal.SIGKILL}" in (outs[-1].error or "")
            assert time.monotonic() - t0 < 5
            assert not engine.is_alive and engine.any_alive and engine.alive == 1
            assert [i for i, _ in engine.dead()] == [victim]
            for i in range(6):  # new requests all go to the live replica, and are served
                r = req(f"after{i}", ids(rng, 40), max_tokens=5)
                got = await collect(engine, r)  # type: ignore[arg-type]
                assert tokens_by_index(got) == {0: [expected_token(r, 0, k) for k in range(5)]}
            assert engine.routed[victim] == 1
            after = await engine.stats()  # the dead one's totals stay counted, its gauges do not
            assert after.num_running == 1 and after.finished_total[FINISH_LENGTH] == 6
            assert after.finished_total["stats_calls"] >= before.finished_total["stats_calls"]
            await streams[1].aclose()
        finally:
            await engine.shutdown()

    run(go())


def test_dp_attention_replicas_end_together_with_the_first_reason() -> None:
    """Under --dp-attention no replica steps without the others: one killed, the server ends the rest at
    once, every stream ending with the first replica's reason (not a chain of them), and no process is left."""
    rng = random.Random(9)

    async def go() -> None:
        engine = await EngineReplicas.start(EngineArgs(model="fake-model", dp_attention=True, startup_timeout=30), 3,
                                            core_factory=functools.partial(FakeCore, step_delay=0.01))
        try:
            long = [req(f"long{i}", ids(rng, 10), max_tokens=100_000) for i in range(3)]
            streams = [engine.generate(r) for r in long]
            for s in streams:
                await anext(s)
            home = [engine.replica_of(r.rid) for r in long]
            assert sorted(home) == [0, 1, 2]  # type: ignore[type-var]
            victim = home[1]
            os.kill(engine.clients[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
            t0 = time.monotonic()
            for i, s in enumerate(streams):
                outs = [out async for out in s]
                assert outs[-1].finish_reason == FINISH_ERROR and outs[-1].error_code == ERR_ENGINE
                error = outs[-1].error or ""
                assert f"exit code {-signal.SIGKILL}" in error, error
                if home[i] != victim:
                    assert error.count("--dp-attention replica") == 1 and f"replica {victim} failed" in error, error
            assert time.monotonic() - t0 < 5
            assert not engine.any_alive
            assert all_gone(engine.pids)  # type: ignore[arg-type]
        finally:
            await engine.shutdown()

    run(go())


def test_a_replica_that_cannot_start_fails_the_start_and_stops_the_others(tmp_path: Path) -> None:
    async def go() -> None:
        with pytest.raises(RuntimeError, match=r"engine replica [01] of 2 failed to start: .*no weights here"):
            await EngineReplicas.start(EngineArgs(model="fake-model", startup_timeout=30), 2,
                                       core_factory=FailOnce(tmp_path / "marker"))

    before = set(_children())
    run(go())
    deadline = time.monotonic() + 10
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_children()) - before, "a replica outlived the failed start"


def test_one_replica_is_the_client_itself() -> None:
    rng = random.Random(9)

    async def go() -> None:
        engine = await start(1)
        try:
            r = req("solo", ids(rng, 12), n=2, max_tokens=4)
            stream = engine.generate(r)
            assert stream.__qualname__.startswith("EngineClient.generate")  # type: ignore[attr-defined]
            outs = [o async for o in stream]
            assert tokens_by_index(outs) == {i: [expected_token(r, i, k) for k in range(4)] for i in range(2)}
            assert engine.routed == [1] and engine.clients[0].held == 0
        finally:
            await engine.shutdown()

    run(go())


def _children() -> list[int]:
    """This process's engine processes (multiprocessing's spawned children) still running."""
    out = []
    for pid in child_pids(os.getpid()):
        try:
            spawned = b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if spawned and alive(pid):
            out.append(pid)
    return out
