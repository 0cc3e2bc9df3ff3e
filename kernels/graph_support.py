"""How a part of the decode forward can enter a CUDA graph: one description per attention backend
and per routed-expert backend, which the graph runner (`executor.cuda_graph_runner`) reads to pick
how decode is captured, or to say why it is not.

* `CAPTURE`: device work only; a graph records it as it is.
* `HOST_NODES`: it does host work (the CPU experts of hybrid placement), which a graph can run as
  host-function nodes; a replay then runs it on a CUDA driver thread, in stream order.
* `SPLIT`: its host work can run between the replays of graph pieces, the capture being cut there
  (`HostStep`); no host function on a driver thread.

A part that supports none of them cannot be captured at all, and says why (`reason`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class GraphMode(str, Enum):
    CAPTURE = "capture"
    HOST_NODES = "host-nodes"
    SPLIT = "split"


@dataclass(frozen=True)
class GraphSupport:
    """The ways a part can be captured (empty: none), and why the others are out of reach."""

    modes: frozenset[GraphMode] = frozenset()
    reason: str = ""

    @classmethod
    def none(cls, reason: str) -> GraphSupport:
        return cls(frozenset(), reason)

    @classmethod
    def device_only(cls) -> GraphSupport:
        return cls(frozenset({GraphMode.CAPTURE}))

    @classmethod
    def host_work(cls, no_host_nodes: str | None = None) -> GraphSupport:
        """Host work: between split pieces always, as host nodes unless `no_host_nodes` says why not."""
        if no_host_nodes is None:
            return cls(frozenset({GraphMode.HOST_NODES, GraphMode.SPLIT}))
        return cls(frozenset({GraphMode.SPLIT}), no_host_nodes)

    def allows(self, mode: GraphMode) -> bool:
        return mode in self.modes


# Under a split capture: `step(fn)` ends the graph piece being captured, runs `fn` now and between
# that piece's and the next one's replays ever after, and begins the next piece.
HostStep = Callable[[Callable[[], None]], None]


class CapturedHostWork(Protocol):
    """What a part with host work prepared for one graph runner's captures (host tasks, buffers the
    graphs address): kept alive by that runner as long as its graphs."""

    def replay_error(self) -> str | None:
        """After the stream has been synchronized: what failed in the host work of the replays since
        the last call, or None."""
        ...
