"""The ranks' rendezvous socket (engine.ranks.rendezvous_listener): bound to --master-addr itself, so a
one-machine group's store is not reachable from the network; left to torch for a multi-node host name."""

from __future__ import annotations

import socket

import pytest

from engine.ranks import RankPlan, rendezvous_listener


def plan(addr: str, port: int = 0, nnodes: int = 1) -> RankPlan:
    return RankPlan(world=2, nnodes=nnodes, node_rank=0, addr=addr, port=port, ep=False)


@pytest.mark.parametrize("addr,bound", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"), ("::1", "::1")])
def test_bound_to_the_address_given(addr: str, bound: str) -> None:
    if ":" in addr and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        listener = rendezvous_listener(plan(addr))
    except RuntimeError as exc:  # a container without ::1
        if ":" in addr:
            pytest.skip(f"no IPv6 loopback: {exc}")
        raise
    assert listener is not None
    with listener:
        host, port = listener.getsockname()[:2]
        assert host == bound and port > 0  # port 0: a free one, already held
        with socket.create_connection((host, port), timeout=5):
            pass


def test_a_taken_port_or_foreign_address_is_refused_with_what_to_change() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(RuntimeError, match="--master-port"):
            rendezvous_listener(plan("127.0.0.1", taken.getsockname()[1]))
    with pytest.raises(RuntimeError, match="--master-addr must be an address of this machine"):
        rendezvous_listener(plan("192.0.2.1"))  # TEST-NET-1: never this machine's


def test_multi_node_host_names_are_left_to_torch_and_ips_bound() -> None:
    assert rendezvous_listener(plan("node0.example", 29500, nnodes=2)) is None
    listener = rendezvous_listener(plan("127.0.0.1", 0, nnodes=2))
    assert listener is not None
    listener.close()


# ---------------------------------------------------------------- join_group: the group's shape and members
def _stores(world: int):
    """A rendezvous store as rank 0 hosts it, and a function making another rank's client of it."""
    from datetime import timedelta

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", master.port, world, is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)
    return master, client


def _tp(world: int, nnodes: int, node: int, port: int) -> RankPlan:
    return RankPlan(world, nnodes, node, "127.0.0.1", port, ep=False)


def _run(target, *args):
    """`target(*args)` on a thread: (thread, box) with box["error"] its exception, if any."""
    import threading

    box: dict = {}

    def run():
        try:
            target(*args)
        except Exception as exc:  # noqa: BLE001 - what the test inspects
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_group_whose_ranks_all_come_joins() -> None:
    from engine.ranks import join_group

    master, client = _stores(4)
    lead, box = _run(join_group, master, _tp(4, 2, 0, master.port), 0)
    for rank, node in ((1, 0), (2, 1), (3, 1)):
        join_group(client(), _tp(4, 2, node, master.port), rank)
    lead.join(10)
    assert not lead.is_alive() and "error" not in box


def test_a_node_started_with_another_tp_is_refused_on_both_nodes() -> None:
    """A different world size never completed torch's rendezvous: both nodes waited 300 s, then failed
    naming no flag."""
    from engine.ranks import join_group

    master, client = _stores(4)
    lead, box = _run(join_group, master, _tp(4, 2, 0, master.port), 0)
    with pytest.raises(RuntimeError) as err:
        join_group(client(), _tp(2, 2, 1, master.port), 1)
    line = str(err.value)
    assert "node 1 (rank 1) was started with --tp 2 --nnodes 2" in line and "with --tp 4 --nnodes 2" in line, line
    lead.join(10)
    assert not lead.is_alive() and str(box["error"]) == line


def test_a_rank_taken_twice_is_refused_and_the_group_goes_on() -> None:
    from engine.ranks import join_group

    master, client = _stores(2)
    lead, box = _run(join_group, master, _tp(2, 2, 0, master.port), 0)
    join_group(client(), _tp(2, 2, 1, master.port), 1)
    lead.join(10)
    assert not lead.is_alive() and "error" not in box
    with pytest.raises(RuntimeError, match=r"rank 1 of the group at 127\.0\.0\.1:\d+ is already taken by node 1 "
                                           r"\(host .*, pid \d+\): each node needs its own --node-rank"):
        join_group(client(), _tp(2, 2, 1, master.port), 1)


def test_a_node_that_never_joins_is_named_when_rank_0_gives_up(monkeypatch) -> None:
    import engine.ranks as ranks

    monkeypatch.setattr(ranks, "TIMEOUT_S", 1)
    master, client = _stores(4)
    join = _run(ranks.join_group, client(), _tp(4, 2, 0, master.port), 1)[0]  # node 0's other rank comes
    with pytest.raises(RuntimeError) as err:
        ranks.join_group(master, _tp(4, 2, 0, master.port), 0)
    join.join(10)
    assert str(err.value).startswith(f"node(s) [1] (ranks [2, 3]) did not join the group at 127.0.0.1:{master.port} "
                                     "within 1 s: start each with `mlaserve serve --node-rank K --tp 4 --nnodes 2")


def test_rank_0_stops_waiting_when_its_own_rank_dies() -> None:
    from engine.ranks import join_group

    master, _ = _stores(2)
    with pytest.raises(RuntimeError, match="^rank 1 exited with code 1 before joining the group at"):
        join_group(master, _tp(2, 1, 0, master.port), 0, failed=lambda: "rank 1 exited with code 1")
