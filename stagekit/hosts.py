"""A rank group on several hosts: every host's own device lease and memory budget.

The lease and the budget are files on a host (stagekit/lease.py, stagekit/budget.py): no process can take another
host's. torchrun runs a multi-host stage as nodes, one agent per host (`--nnodes`); global rank 0 (the leader, which
serves gRPC) holds its own host's lease and budget, and every other node's first rank (its *node lead*,
`LOCAL_RANK` 0) holds its host's, on the leader's command over the group's control channel:

    leader (rank 0, node 0)                                 node lead (node k)
    GroupLease.acquire: hosts in key order
      own host: DeviceLease.acquire
      host k:   broadcast ("host", ("acquire", key_k, ..)) ->  HostResources.handle: its DeviceLease.acquire
                gather                                     <-  (key_k, None | the failure)
    GroupLease.release: own, then every node           ->  release

- One host is one (host name, lease directory) key: nodes on separate machines differ by name, "hosts" on one machine
  (tests, loopback aliases) by their run directories. Hosts are taken one at a time in key order, as a DeviceLease
  takes its devices in sorted order, so two multi-host stages sharing hosts never wait on each other in a cycle.
- Each host resolves its own budget (its GPUs' memory minus --reserve-gb, or the node's --memory-budget-gb);
  admission checks a job's per-device estimate against every host's before anything is taken.
- Only the leader's worker thread drives the nodes (the runtime calls lease and budget from it alone). Status asks
  `holders()` from any thread: it answers from the leader's host and what the nodes said at their last poll, so a
  gRPC thread never enters a collective.
- A node lead that dies loses its host's lease and reservations with its flocks (the kernel drops them), and its
  group breaks: torchrun restarts it, as for any dead rank.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from stagekit.budget import MemoryBudget, fmt_bytes
from stagekit.dist import RankGroup
from stagekit.errors import ResourceExhausted
from stagekit.lease import DeviceLease

HOST_COMMAND = "host"  # what the leader broadcasts to drive the node leads; payload (op, key or None, args)

HostKey = tuple[str, str]  # (host name, lease directory)


def host_key(lease_dir: str) -> HostKey:
    return socket.gethostname(), os.path.realpath(lease_dir)


def host_label(key: HostKey) -> str:
    return f"{key[0]}:{key[1]}"


@dataclass(frozen=True)
class NodeInfo:
    """What a node lead tells the leader at start: its host, its budget (bytes per device, 0 = none) and devices."""

    node_rank: int
    key: HostKey
    budget_bytes: int
    ids: tuple[str, ...]


@dataclass(frozen=True)
class HostPlan:
    """The leader's decision at start, broadcast to every rank: the nodes, whether each host keeps a memory budget
    (shared residency, or any host with a finite one), or why the group cannot start."""

    nodes: tuple[NodeInfo, ...]
    use_budget: bool
    error: str = ""


def plan_hosts(nodes: list[NodeInfo | None], shared: bool, device_work: bool) -> HostPlan:
    """The leader's plan from every rank's gathered `NodeInfo` (None from ranks that are not a node lead)."""
    leads = tuple(n for n in nodes if n is not None)
    seen: dict[HostKey, int] = {}
    for n in leads:
        if n.key in seen:
            return HostPlan(leads, False, f"nodes {seen[n.key]} and {n.node_rank} use one lease directory "
                                          f"{n.key[1]} on host {n.key[0]}: give each node its own --lease-dir (one "
                                          "run directory per host), or run the ranks as one node")
        seen[n.key] = n.node_rank
    use_budget = device_work and (shared or any(n.budget_bytes > 0 for n in leads))
    return HostPlan(leads, use_budget)


# ---- a node lead's side -------------------------------------------------------------------------------------------
_ERRORS: Mapping[str, type[Exception]] = MappingProxyType({"TimeoutError": TimeoutError,
                                                          "ResourceExhausted": ResourceExhausted})


@dataclass(frozen=True)
class _Failure:
    """An exception crossing the control channel by value: its class name and message."""

    kind: str
    message: str

    def raise_on(self, key: HostKey) -> None:
        raise _ERRORS.get(self.kind, RuntimeError)(f"on host {host_label(key)}: {self.message}")


class HostResources:
    """A node lead's own host: its lease and budget, driven by the leader's host commands."""

    def __init__(self, key: HostKey, lease: DeviceLease, budget: MemoryBudget | None):
        self.key = key
        self.lease = lease
        self.budget = budget

    def handle(self, op: str, key: HostKey | None, args: tuple) -> tuple[HostKey, Any] | None:
        """Run `op` when it names this host (or every host: key None); the reply is gathered by the leader."""
        if key is not None and key != self.key:
            return None
        try:
            return self.key, self._do(op, *args)
        except Exception as e:  # noqa: BLE001 - handed to the leader, which raises it for the job
            return self.key, _Failure(type(e).__name__, str(e))

    def _do(self, op: str, *args) -> Any:
        if op == "acquire":
            return self.lease.acquire(timeout_s=args[0])
        if op == "release":
            self.lease.release()
            return None
        if op == "waiting":  # (someone waits for our devices, who holds the lease here)
            mine = self.budget.others_waiting() if args[0] == "budget" else self.lease.others_waiting()
            return mine, self.lease.holders()
        if op == "reserve":
            return self.budget.reserve(args[0], timeout_s=args[1])
        if op == "grow":
            return self.budget.try_grow(args[0])
        if op == "shrink":
            self.budget.shrink(args[0])
            return None
        if op == "release_budget":
            self.budget.release()
            return None
        raise ValueError(f"unknown host command {op!r}")

    def release_all(self) -> None:
        self.lease.release()
        if self.budget is not None:
            self.budget.release()


# ---- the leader's side --------------------------------------------------------------------------------------------
class RemoteHosts:
    """The leader's line to the other nodes' leads (every call: one broadcast and one gather on the control group)."""

    def __init__(self, group: RankGroup, nodes: tuple[NodeInfo, ...], own: HostKey, poll_s: float = 0.5):
        self.group = group
        self.own = own
        self.nodes = tuple(n for n in nodes if n.key != own)
        self.order = sorted(n.key for n in nodes)  # every host, the leader's included: the order they are taken in
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._polled: dict[str, tuple[float, bool]] = {}
        self.remote_holders = ""  # who held the other hosts' leases at the last poll

    def call(self, op: str, key: HostKey | None = None, *args) -> dict[HostKey, Any]:
        """Every addressed node lead's reply by host; a node's failure is raised here, naming the host."""
        with self._lock:
            self.group.broadcast_command((HOST_COMMAND, (op, key, args)))
            got = self.group.gather_objects(None) or []
        out = {}
        for reply in got:
            if reply is None:
                continue
            k, result = reply
            if isinstance(result, _Failure):
                result.raise_on(k)
            out[k] = result
        return out

    def waiting(self, what: str) -> bool:
        """Does a stage on another host wait for our devices there ("lease" or "budget")? Polled at most every
        `poll_s` (the idle loop asks ten times a second)."""
        t, was = self._polled.get(what, (0.0, False))
        if time.monotonic() - t < self.poll_s:
            return was
        replies = self.call("waiting", None, what)
        now = any(w for w, _ in replies.values())
        self.remote_holders = ", ".join(f"{who} on {host_label(k)}" for k, (_, who) in sorted(replies.items()) if who)
        self._polled[what] = (time.monotonic(), now)
        return now


    def forget(self) -> None:
        """Our devices were given back: what the last poll said no longer holds."""
        self._polled.clear()
        self.remote_holders = ""


def _remaining(t0: float, timeout_s: float | None) -> float | None:
    return None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))


class _OnEveryHost:
    """What the leader's lease and budget share: take on every host, one host at a time in key order, and give all
    of it back. `what` names it to the node leads' `waiting`; `release_op`, to their release."""

    what: str
    release_op: str

    def __init__(self, local: DeviceLease | MemoryBudget, remote: RemoteHosts):
        self.local = local
        self.remote = remote
        self.ids = local.ids
        self.events = local.events
        self._remote_held = False

    def _take_each(self, take_local: Callable[[float | None], Any], op: str, timeout_s: float | None,
                   *args) -> float:
        """`take_local(timeout)` on this host, `op` (`args`, then the time left) on the others; returns seconds
        waited. A host that cannot be taken in time gives back what was taken and raises its TimeoutError, naming
        the host."""
        t0 = time.monotonic()
        try:
            for key in self.remote.order:
                if key == self.remote.own:
                    take_local(_remaining(t0, timeout_s))
                else:
                    self._remote_held = True  # a failure below may have left other hosts taken: release them all
                    self.remote.call(op, key, *args, _remaining(t0, timeout_s))
        except BaseException:
            self.release()
            raise
        return time.monotonic() - t0

    def release(self) -> None:
        self.local.release()
        if self._remote_held:
            self._remote_held = False
            self.remote.forget()
            self.remote.call(self.release_op)

    def others_waiting(self) -> bool:
        return self.local.others_waiting() or self.remote.waiting(self.what)


class GroupLease(_OnEveryHost):
    """The leader's device lease over every host of the group (the runtime's `lease`: DeviceLease's interface)."""

    what = "lease"
    release_op = "release"

    def acquire(self, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Take every host's lease, one host at a time in key order; returns seconds waited."""
        if self.local.held:  # the runtime asks only when not resident; held means every host is ours
            return 0.0
        return self._take_each(lambda left: self.local.acquire(timeout_s=left, poll_s=poll_s), "acquire", timeout_s)

    def holders(self) -> str:
        """Who holds the leases: the leader's host now, the other hosts as of their last poll (any thread)."""
        return ", ".join(h for h in (self.local.holders(), self.remote.remote_holders) if h)


class GroupBudget(_OnEveryHost):
    """The leader's memory budget over every host of the group (the runtime's `budget`: MemoryBudget's interface)."""

    what = "budget"
    release_op = "release_budget"

    def __init__(self, local: MemoryBudget, remote: RemoteHosts):
        super().__init__(local, remote)
        self.cfg = local.cfg

    @property
    def reserved(self) -> int:
        return self.local.reserved

    def check_fits(self, nbytes: int, what: str) -> None:
        """Admission on every host's budget (as resolved on that host at start)."""
        self.local.check_fits(nbytes, what)
        for n in self.remote.nodes:
            if n.budget_bytes > 0 and nbytes > n.budget_bytes:
                raise ResourceExhausted(
                    f"{what} needs an estimated {fmt_bytes(nbytes)} per device but the memory budget on host "
                    f"{host_label(n.key)} is {fmt_bytes(n.budget_bytes)} on {', '.join(n.ids)}; use a smaller "
                    "resolution or frame count, more ranks, or raise that node's --memory-budget-gb / lower its "
                    "--reserve-gb")

    def reserve(self, nbytes: int, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Reserve `nbytes` per device on every host, one host at a time in key order; returns seconds waited."""
        self.check_fits(nbytes, self.cfg.holder)
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        return self._take_each(lambda left: self.local.reserve(nbytes, timeout_s=left, poll_s=poll_s), "reserve",
                               timeout_s, nbytes)

    def try_grow(self, nbytes: int) -> bool:
        """Grow on every host without waiting; False when any host has no room now (the runtime then unloads,
        which releases every host's reservation)."""
        if not self.local.try_grow(nbytes):
            return False
        return all(self.remote.call("grow", None, nbytes).values())

    def shrink(self, nbytes: int) -> None:
        self.local.shrink(nbytes)
        self.remote.call("shrink", None, nbytes)
