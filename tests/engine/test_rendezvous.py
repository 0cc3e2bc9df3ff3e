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
