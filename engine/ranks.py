"""Starting and joining the ranks of a tensor-parallel engine (torch.distributed, laid out as torchrun does).

`--tp N` ranks over `--nnodes` nodes, N / nnodes per node; rank r lives on node r // (N / nnodes).
Node 0's `mlaserve serve` runs the HTTP server and the engine process; the engine process is rank 0
(it hosts the rendezvous, torch.distributed's TCP store, at --master-addr:--master-port, listening on
that address only: `rendezvous_listener`) and starts
the node's other ranks as its children. Node k > 0 runs `mlaserve serve --node-rank k` with the same
--tp, --nnodes, --master-addr and --master-port: it starts that node's ranks and waits for them, with
no HTTP server. Collectives go over gloo on CPUs and NCCL on GPUs (one GPU per rank, cuda:<local
rank>); the control messages of executor.distributed always over gloo.

Start-up: every rank loads its part of the weights (models.parallel), then all of them exchange their
status, so one rank's failure stops every rank with its reason; rank 0 then sends the pool sizes.
A rank that dies later is noticed by the next broadcast (at most executor.distributed.PING_S while
idle): rank 0 reports the crash, its children are killed, and the other nodes' ranks see the
connection close and exit. A rank that stops without dying (SIGSTOP, a debugger, a frozen host) fails
no collective: the others would wait in the next one until the group's timeout, or for good. So every
rank also signs its life in the rendezvous store (`Heartbeat`), and rank 0 (under --dp-attention every
replica) reports a rank whose sign stood still for --rank-timeout seconds as the crash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch

from engine.args import EngineArgs, engine_log_level
from engine.cgroups import usable_cpus
from engine.messages import EngineStartupError, is_settings_fault
from executor.distributed import Leader, Setup, broadcast_message, follow, gather_status
from executor.model_runner import ModelRunner
from models.loader.load import DTYPES, load_model
from models.omnikv_config import OmniKVConfig
from models.parallel import ParallelLayout, configure

logger = logging.getLogger(__name__)

RANK_ENV = "MLASERVE_RANK_SPEC"  # a rank process's settings (JSON), from the process that starts it
TIMEOUT_S = 300  # rendezvous, and any one collective: a rank that stops answering fails the others by then
BEAT_S = 1.0  # how often a rank signs its life in the rendezvous store (Heartbeat)
STOP_WAIT_S = 10.0  # at most this long for a heartbeat's store call under way when it stops


@dataclass(frozen=True)
class RankPlan:
    world: int
    nnodes: int
    node_rank: int
    addr: str
    port: int
    ep: bool
    dp_attention: bool = False  # the ranks are --dp replicas (one per process, each pinned to its CPUs)
    frozen_s: float = 15.0  # --rank-timeout: a rank whose sign stood still this long is stopped or frozen

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    def node_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @classmethod
    def of(cls, args: EngineArgs) -> RankPlan:
        return cls(args.tp, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.ep > 1,
                   frozen_s=args.rank_timeout)


def rank_device(args: EngineArgs, plan: RankPlan, rank: int) -> torch.device:
    dev = torch.device(args.device)
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank % plan.per_node)
    return dev


def rendezvous_listener(plan: RankPlan) -> socket.socket | None:
    """Rank 0's listening socket for the rendezvous store, bound to --master-addr itself (port 0: a free
    one, with no window for another process to take it), or None to let torch listen.

    torch's store listens on every interface whatever address it is given, which would open the rank
    group's store to the network for a server kept on 127.0.0.1. Bound here when the address is an IP
    literal or the ranks are on one node; a host name of a multi-node group is left to torch, since
    node 0 may resolve its own name to a loopback address (a Debian /etc/hosts line) the others
    cannot reach."""
    try:
        literal: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(plan.addr)
    except ValueError:
        literal = None
    if plan.nnodes > 1 and literal is None:
        return None
    family = socket.AF_INET6 if isinstance(literal, ipaddress.IPv6Address) else socket.AF_INET
    try:
        return socket.create_server((plan.addr, plan.port), family=family, backlog=max(128, plan.world))
    except OSError as exc:
        raise RuntimeError(f"cannot listen for the ranks' rendezvous on {plan.addr}:{plan.port} ({exc}): "
                           "--master-addr must be an address of this machine (node 0), and --master-port a free "
                           "port (0: any free one, on one node)") from exc


_JOIN = "mlaserve/join/"  # rendezvous store keys of join_group: the group's shape, each rank's claim, a refusal
JOIN_POLL_S = 0.2


def _shape(plan: RankPlan) -> dict[str, Any]:
    return {"world": plan.world, "nnodes": plan.nnodes, "ep": plan.ep, "dp_attention": plan.dp_attention}


def _shape_flags(shape: dict[str, Any]) -> str:
    if shape["dp_attention"]:
        return f"--dp {shape['world']} --dp-attention" + (" --ep" if shape["ep"] else "")
    return f"--tp {shape['world']} --nnodes {shape['nnodes']}" + (f" --ep {shape['world']}" if shape["ep"] else "")


def join_group(store: Any, plan: RankPlan, rank: int, failed: Callable[[], str | None] | None = None) -> None:
    """Each rank claims its number in the rendezvous store and checks the group's shape before
    torch's init_process_group, which waits out its whole timeout (300 s), naming nothing, for a node
    that never comes, one started with another --tp or --nnodes (another world size: it never
    completes), or two nodes started with the same --node-rank. Here: a rank of another shape or a
    taken number stops with one line (and so does rank 0, told through the store); rank 0 waits until
    every rank has claimed its number, or `failed` (its own node's ranks) says why not, or the timeout
    names the nodes that did not join."""
    where = f"the group at {plan.addr}:{plan.port}"
    claim = json.dumps({"node": plan.node_rank, "host": socket.gethostname(), "pid": os.getpid(),
                        "nonce": os.urandom(8).hex()})  # (this claim, not another process's that looks the same)
    if rank == 0:
        store.set(_JOIN + "shape", json.dumps(_shape(plan)))
    else:
        theirs = json.loads(store.get(_JOIN + "shape"))  # rank 0 sets it first (waits up to the store's timeout)
        if theirs != _shape(plan):
            why = (f"node {plan.node_rank} (rank {rank}) was started with {_shape_flags(_shape(plan))}, but node 0 "
                   f"of {where} with {_shape_flags(theirs)}: start every node with the same --tp, --nnodes and --ep")
            store.set(_JOIN + "refused", why)
            raise RuntimeError(why)
    held = store.compare_set(_JOIN + str(rank), "", claim).decode()
    if held != claim:
        other = json.loads(held)
        why = (f"rank {rank} of {where} is already taken by node {other['node']} (host {other['host']}, pid "
               f"{other['pid']}): each node needs its own --node-rank")
        raise RuntimeError(why)  # the group is not told: it runs on with the node that came first
    if rank != 0:
        return
    keys = [_JOIN + str(r) for r in range(1, plan.world)]
    deadline = time.monotonic() + TIMEOUT_S
    while not store.check(keys):
        if store.check([_JOIN + "refused"]):
            raise RuntimeError(store.get(_JOIN + "refused").decode())
        why = failed() if failed is not None else None
        if why is not None:
            raise RuntimeError(f"{why} before joining {where}")
        if time.monotonic() >= deadline:
            missing = [r for r in range(1, plan.world) if not store.check([_JOIN + str(r)])]
            if plan.dp_attention:
                raise RuntimeError(f"--dp-attention replicas {missing} did not join {where} within {TIMEOUT_S} s")
            nodes = sorted({r // plan.per_node for r in missing})
            raise RuntimeError(
                f"node(s) {nodes} (ranks {missing}) did not join {where} within {TIMEOUT_S} s: start each with "
                f"`mlaserve serve --node-rank K {_shape_flags(_shape(plan))} --master-addr {plan.addr} "
                f"--master-port {plan.port}` and the same model")
        time.sleep(JOIN_POLL_S)


def init_rank(plan: RankPlan, rank: int, device: torch.device, listener: socket.socket | None = None,
              failed: Callable[[], str | None] | None = None) -> Any:
    """Joins the group as `rank` (`join_group`; `failed`: rank 0's watch over its node's other ranks) and
    sets the model layout; returns the gloo control group. Rank 0 hosts the rendezvous store on its
    `rendezvous_listener` (None: torch listens on every interface); the store then owns the socket."""
    import torch.distributed as dist

    if device.type == "cpu":  # the node's ranks share the cores this process may use (a replica: its own)
        torch.set_num_threads(max(1, len(usable_cpus()) // (1 if plan.dp_attention else plan.per_node)))
    else:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(plan.addr, plan.port, plan.world, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listener.detach() if listener else None)
    join_group(store, plan, rank, failed)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=plan.world, timeout=timeout)
    configure(ParallelLayout(tp_size=plan.world, tp_rank=rank, ep=plan.ep, dp_attention=plan.dp_attention))
    return dist.new_group(backend="gloo")


class Heartbeat:
    """A rank's sign of life apart from the collectives, and its watch over other ranks'.

    A thread adds 1 to this rank's counter in the rendezvous store (rank 0's TCP store, over a connection
    of its own) every BEAT_S and reads the counters of the ranks in `watch`. `failure()` names the first
    watched rank whose counter stood still for `plan.frozen_s`: its process is stopped or frozen, since a thread
    of a live process keeps counting whatever its main thread waits for (collectives and kernels run
    without the GIL). The stillness is also counted in this thread's own reads, so a pause of this
    process (a suspended host) is not blamed on the others. The store lives in rank 0's process and its
    calls have no timeout once connected: where rank 0 is watched (--dp-attention), a round that has not
    come back for frozen_s + BEAT_S names rank 0. A call the store refuses (rank 0 died: the collectives
    report that first) is tried again a beat later."""

    def __init__(self, plan: RankPlan, rank: int, watch: Iterable[int] = (), what: str = "rank") -> None:
        """`what`: how a watched rank is named in the failure ("replica" under --dp-attention)."""
        import torch.distributed as dist

        self.rank, self.what, self._frozen_s = rank, what, plan.frozen_s
        self._store = dist.TCPStore(plan.addr, plan.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        now = time.monotonic()
        self._seen = {r: [-1, now, 0] for r in watch}  # rank -> [count, when it last moved, reads since]
        self._failure: str | None = None
        self._last_round = now  # when the thread last heard from the store
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(rank: int) -> str:
        return f"mlaserve/heartbeat/{rank}"

    def failure(self) -> str | None:
        if self._failure is None and self._seen and self.rank != 0 and not self._stopped.is_set():
            # the store itself waits on rank 0's process (a store call has no timeout there): a round that
            # has not come back is rank 0 stopped or frozen
            quiet = time.monotonic() - self._last_round
            if quiet >= self._frozen_s + BEAT_S:
                self._failure = (f"{self.what} 0 stopped answering: the rendezvous store it hosts gave no answer "
                                 f"for {quiet:.0f} s; its process is stopped or frozen")
                logger.error("%s", self._failure)
        return self._failure

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key(self.rank), 1)
                counts = {r: self._store.add(self._key(r), 0) for r in self._seen}
            except Exception as exc:  # the store's rank is gone (the collectives say so), or a passing fault
                logger.debug("heartbeat of rank %d: %s", self.rank, exc)
                if self._stopped.wait(BEAT_S):
                    return
                continue
            now = self._last_round = time.monotonic()
            for r, count in counts.items():
                seen = self._seen[r]
                if count != seen[0]:
                    seen[:] = [count, now, 0]
                    continue
                seen[2] += 1
                still = now - seen[1]
                if self._failure is None and still >= self._frozen_s and seen[2] >= self._frozen_s / BEAT_S - 1:
                    self._failure = (f"{self.what} {r} stopped answering: no sign of life for {still:.0f} s; its process "
                                     "is stopped or frozen")
                    logger.error("%s", self._failure)
            if self._stopped.wait(BEAT_S):
                return

    def stop(self) -> None:
        """Ends the thread and waits for its store call under way: a daemon thread still inside one when the
        interpreter exits aborts the process (SIGABRT) once the store's host goes away, and a rank that
        ended cleanly then reported exit code -6."""
        self._stopped.set()
        self._thread.join(timeout=STOP_WAIT_S)


def leave_group() -> None:
    """Leaves the process group, if joined (a peer may already be gone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone
            pass


def load_part(args: EngineArgs, device: torch.device, tokenizer: bool) -> Any:
    """This rank's part of the model: the torch forward (the CPU-native one runs in one process)."""
    return load_model(args.model, device=device, dtype=args.dtype, expert_backend=args.expert_backend,
                      cpu_weights=None, load_tokenizer=tokenizer, progress=False)


def load_rank(args: EngineArgs, group: LeadRank | DPAttentionRank) -> Any:
    """The scheduling process's part of the model (with the tokenizer), once every rank of `group` has
    loaded its own: one rank's failure fails all of them with its reason."""
    try:
        loaded = load_part(args, group.device, tokenizer=True)
    except Exception as exc:
        group.loaded(f"{type(exc).__name__}: {exc}", _failed(exc))
        raise
    group.loaded(None, rank_settings(args, loaded))
    return loaded


def rank_settings(args: EngineArgs, loaded: Any) -> dict[str, str]:
    """What the ranks must share to compute one model together, as text to compare. Another node's
    `mlaserve serve --node-rank k` is started on its own: a different --ep, --dtype or model there used
    to serve garbage or fail at the first request. The model is compared by its config and its norm
    weights (whole on every rank), not by its path, which may differ between machines; what rank 0 sends
    the others (the pools' sizes, the KV dtype) is not compared."""
    norms = hashlib.sha256()
    for name, tensor in sorted(loaded.model.state_dict().items()):
        if "norm" in name:  # small: a copy off the GPU costs nothing at start-up
            norms.update(name.encode())
            norms.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "model": f"{loaded.config.arch}, config {hashlib.sha256(repr(loaded.config).encode()).hexdigest()[:12]}",
        "norm weights": norms.hexdigest()[:12],
        "weights dtype": str(loaded.dtype).removeprefix("torch."),
        "--ep": str(args.ep),
        "--page-size": str(args.page_size),
        "--attention-backend": args.attention_backend,
        "--expert-backend": args.expert_backend,
    }


_SETTINGS_FAULT = "settings fault"  # in a failed rank's status: its failure is the model's or a setting's


def _failed(exc: BaseException) -> dict[str, str]:
    """A failed rank's status beside its reason: whether the model or a setting is at fault."""
    return {_SETTINGS_FAULT: "yes"} if is_settings_fault(exc) else {}


def _check(statuses: list[tuple[str | None, dict[str, str] | None]], what: str = "rank") -> None:
    problems = [error for error, _ in statuses if error is not None]
    if problems:  # the model or a setting at fault where every failed rank says so: exit 2, not "restart me"
        raise EngineStartupError("; ".join(problems), settings_fault=all(
            (settings or {}).get(_SETTINGS_FAULT) == "yes" for error, settings in statuses if error is not None))
    lead = statuses[0][1] or {}
    for r, (_, settings) in enumerate(statuses[1:], start=1):
        settings = settings or {}
        differ = [f"{k} {settings.get(k)} ({what} 0: {lead.get(k)})" for k in sorted(lead.keys() | settings.keys())
                  if settings.get(k) != lead.get(k)]
        if differ:
            problems.append(f"{what} {r} differs from {what} 0: {', '.join(differ)}")
    if problems:
        raise RuntimeError(f"{'; '.join(problems)}: start every node with the same model file and settings")


def follower_main(args: EngineArgs, plan: RankPlan, rank: int) -> None:
    """Main of a rank other than 0: load, report, then run every batch rank 0 sends until it stops."""
    # the process group's signals (Ctrl-C, docker stop) are for whoever started this rank to act on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=engine_log_level(os.environ), format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    device = rank_device(args, plan, rank)
    try:
        ctl = init_rank(plan, rank, device)
    except RuntimeError as exc:  # join_group's refusal, or the rendezvous that never came
        logger.error("rank %d: %s", rank, exc)
        sys.exit(1)
    heartbeat = Heartbeat(plan, rank)
    try:
        _follow(args, plan, rank, device, ctl)
    finally:
        heartbeat.stop()


def _follow(args: EngineArgs, plan: RankPlan, rank: int, device: torch.device, ctl: Any) -> None:
    """`follower_main`'s work while its heartbeat runs."""
    import torch.distributed as dist

    loaded, error, failed = None, None, {}
    try:
        loaded = load_part(args, device, tokenizer=False)
    except Exception as exc:
        error, failed = f"rank {rank}: {type(exc).__name__}: {exc}", _failed(exc)
        if failed:  # the model or a setting: its message says what (a traceback would bury it)
            logger.error("rank %d could not load the model: %s: %s", rank, type(exc).__name__, exc)
        else:
            logger.exception("rank %d could not load the model", rank)
    try:
        _check(gather_status(error, ctl, failed if loaded is None else rank_settings(args, loaded)))
    except RuntimeError as exc:
        if error is None:  # this rank's own failure is logged above; the group's is said here, on this node too
            logger.error("rank %d: %s", rank, exc)
        sys.exit(1)
    assert loaded is not None
    setup = broadcast_message(None, ctl)
    assert isinstance(setup, Setup)
    omnikv = None if setup.omnikv is None else OmniKVConfig.from_dict(setup.omnikv, "rank 0's OmniKV config")
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=setup.num_slots,
                         max_running_requests=setup.max_running_requests, max_context_len=setup.context_len,
                         device=device, kv_dtype=DTYPES[setup.kv_dtype], attention_backend=args.attention_backend,
                         page_size=args.page_size, disable_cuda_graph=True,
                         omnikv=omnikv, omnikv_bank=setup.omnikv_bank)
    logger.info("rank %d of %d ready on %s", rank, plan.world, device)
    try:
        follow(runner, ctl)
    except Exception as exc:  # rank 0 is gone (or a peer): nothing left to serve
        logger.error("rank %d stops: %s: %s", rank, type(exc).__name__, exc)
        sys.exit(1)
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """In a rank's process before exec: SIGKILL it when the process that started it dies (Linux), so a
    crashed engine never leaves ranks holding memory or a GPU."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_ranks(args: EngineArgs, plan: RankPlan, ranks: range) -> list[subprocess.Popen]:
    """One process per rank (`python -m engine.ranks`), its settings as JSON in the environment."""
    env = {**os.environ, RANK_ENV: json.dumps({"args": dataclasses.asdict(args), "plan": dataclasses.asdict(plan)})}
    procs = []
    for r in ranks:
        procs.append(subprocess.Popen([sys.executable, "-m", "engine.ranks", str(r)], env=env,
                                      preexec_fn=_die_with_parent))
    return procs


def stop_ranks(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class LeadRank:
    """Rank 0's part in the engine process: starts node 0's other ranks, joins the group, and after
    loading hands the runner's batches to the followers (executor.distributed.Leader)."""

    def __init__(self, args: EngineArgs) -> None:
        plan = RankPlan.of(args)
        listener = rendezvous_listener(plan)
        if listener is not None:  # --master-port 0 (one node only): the free port it was given
            plan = replace(plan, port=listener.getsockname()[1])
        self.plan = plan
        self.device = rank_device(args, plan, 0)
        self.procs = start_ranks(args, plan, range(1, plan.per_node))
        self.leader: Leader | None = None
        self.heartbeat: Heartbeat | None = None
        if plan.nnodes > 1:  # the other nodes may not be up yet: say what this waits for, and how long
            logger.info("waiting up to %d s for the %d ranks of the other %d node(s) (mlaserve serve --node-rank k "
                        "--master-addr %s --master-port %d)", TIMEOUT_S, plan.world - plan.per_node, plan.nnodes - 1,
                        plan.addr, plan.port)
        try:
            self.ctl = init_rank(plan, 0, self.device, listener, failed=self._child_exited)
        except Exception:
            stop_ranks(self.procs, 0)
            raise
        logger.info("tensor parallel: %d ranks on %d node(s), rendezvous %s:%d, experts %s", plan.world,
                    plan.nnodes, plan.addr, plan.port, "partitioned (--ep)" if plan.ep else "split by intermediate size")

    def loaded(self, error: str | None, settings: dict[str, str] | None) -> None:
        """Every rank's load status; raises with the reasons when any rank failed, or when the ranks'
        settings differ (`rank_settings`)."""
        _check(gather_status(None if error is None else f"rank 0: {error}", self.ctl, settings))

    def lead(self, runner: ModelRunner, kv_dtype: torch.dtype) -> None:
        name = next(k for k, v in DTYPES.items() if v == kv_dtype)
        omnikv = None if runner.omnikv is None else runner.omnikv.to_dict()
        if omnikv is not None:
            omnikv.pop("calibration", None)  # what calibration measured: not needed to compute
        broadcast_message(Setup(runner.allocator.num_slots, runner.req_to_token_pool.size, runner.max_context_len,
                                name, omnikv, runner.context_bank is not None), self.ctl)
        self.leader = Leader(runner, self.ctl)
        self.heartbeat = Heartbeat(self.plan, 0, watch=range(1, self.plan.world))

    def _child_exited(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"rank {rank} exited with code {p.returncode}"
        return None

    def failure(self) -> str | None:
        """Why the ranks can no longer run (a child rank died, one stopped answering a broadcast, or one
        is stopped or frozen), or None."""
        return self._child_exited() or (self.leader and self.leader.failure()) or \
            (self.heartbeat and self.heartbeat.failure()) or None

    def close(self, clean: bool = True) -> None:
        frozen = self.heartbeat is not None and self.heartbeat.failure() is not None
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.leader is not None:
            self.leader.stop(tell=clean)
        stop_ranks(self.procs, 10.0 if clean else 0.0)
        if not frozen:  # a stopped rank on another node may hold the group's teardown for good; the process ends
            leave_group()


def serve_node(args: EngineArgs) -> int:
    """`mlaserve serve --node-rank k` (k > 0): this node's ranks, until they end (rank 0 stops them)."""
    plan = RankPlan.of(args)
    procs = start_ranks(args, plan, plan.node_ranks())
    logger.info("node %d of %d: ranks %s joining %s:%d (waiting up to %d s for node 0 and the others)", plan.node_rank,
                plan.nnodes, list(plan.node_ranks()), plan.addr, plan.port, TIMEOUT_S)

    stopped: list[str] = []

    def stop(signum: int, frame: Any) -> None:
        stopped.append(signal.Signals(signum).name)
        for p in procs:
            if p.poll() is None:
                p.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [p.wait() for p in procs]
    if stopped:  # asked to stop: a clean end for a supervisor, though node 0 reports these ranks lost
        logger.info("node %d: stopped by %s; its ranks %s were ended", plan.node_rank, stopped[0],
                    list(plan.node_ranks()))
        return 0
    failed = [(r, c) for r, c in zip(plan.node_ranks(), codes) if c]
    for r, c in failed:
        logger.error("node %d: rank %d exited with code %d%s", plan.node_rank, r, c,
                     f" ({signal.strsignal(-c)})" if c < 0 else "")
    if not failed:
        logger.info("node %d: its ranks ended (node 0 stopped the group)", plan.node_rank)
    return 1 if failed else 0


def _main(argv: list[str]) -> int:
    """`python -m engine.ranks R`: rank R, its settings from the environment (start_ranks)."""
    spec = json.loads(os.environ.pop(RANK_ENV))
    follower_main(EngineArgs(**spec["args"]), RankPlan(**spec["plan"]), int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


class DPAttentionRank:
    """One replica's place among the --dp replicas under --dp-attention: rank `dp_rank` of `dp_size` in
    one process group (models.parallel's DP-attention layout), rank 0 hosting the rendezvous on the
    port the server chose. `step_together` is called by every replica once per engine-loop iteration."""

    def __init__(self, args: EngineArgs) -> None:
        plan = RankPlan(args.dp_size, 1, 0, args.master_addr, args.master_port, args.ep > 1, dp_attention=True,
                        frozen_s=args.rank_timeout)
        self.plan = plan
        self.heartbeat: Heartbeat | None = None
        self.rank = args.dp_rank
        self.device = torch.device(args.device)  # the replica's own (engine.replicas.replica_args)
        self.ctl = init_rank(plan, self.rank, self.device, rendezvous_listener(plan) if self.rank == 0 else None)
        logger.info("DP attention: replica %d of %d (rendezvous %s:%d), experts %s", self.rank, plan.world, plan.addr,
                    plan.port, "partitioned (--ep)" if plan.ep else "split by intermediate size")

    def loaded(self, error: str | None, settings: dict[str, str] | None) -> None:
        _check(gather_status(None if error is None else f"replica {self.rank}: {error}", self.ctl, settings), "replica")
        others = [r for r in range(self.plan.world) if r != self.rank]
        self.heartbeat = Heartbeat(self.plan, self.rank, watch=others, what="replica")

    def failure(self) -> str | None:
        """A replica that is stopped or frozen (the others would wait for it in the next exchange), or None."""
        return self.heartbeat.failure() if self.heartbeat is not None else None

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """(whether any replica has work, whether every replica is stopping), agreed by all."""
        import torch.distributed as dist

        flags = torch.tensor([int(has_work), -int(stopping)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctl)
        return bool(flags[0].item()), flags[1].item() == -1

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        leave_group()

