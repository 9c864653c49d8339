"""The cluster view: the stage replicas as the render service knows them, fed by one Status poller.

What it holds, per replica: its last Status (and when it was asked), its devices (`planner.Resources`), whether it is
down (did not answer Status, or answered a call UNAVAILABLE while its service has other replicas), whether it is
suspect (the hung-replica rule, render_svc/stalls.py: it stalled on a batch and has not moved since), the batch its
resource group runs, and, for the replicas of a render-graph stage with affinity (the DiT), what its last assigned
batch left resident (partition and LoRAs). From the devices it forms the resource groups
(`planner.resource_groups`).

The one poller (`poll`, its own thread) asks every replica's Status every RESOURCES_EVERY_S (every
RESOURCES_UNKNOWN_EVERY_S while a replica is down, suspect or has not answered, and as often as a listener asks:
the web page's residency lanes); Submit's checks read the same Status (`statuses`), asking a replica again only when
the one held is older than they accept. Every answer goes through one place (`_record`). The dispatcher reads the
view (`view`, a frozen `planner.ClusterView`) and records each batch it assigns (`assigned`, under the lock:
running, last started, the affinity the batch leaves). Not a decision-maker: `planner.schedule` decides from the view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import grpc

from h3.v1 import common_pb2
from render_svc.engine import Replica
from render_svc.graph import GRAPH
from render_svc.planner import (Affinity, Assignment, Batch, ClusterView, ReplicaState, Resources, Serves,
                                resource_groups)
from render_svc.stalls import Suspects

log = logging.getLogger("render_svc")

RESOURCES_EVERY_S = 10.0     # the stages' Status is read again this often
RESOURCES_UNKNOWN_EVERY_S = 1.0  # ... and this often while a replica is down, suspect or has not answered yet
RESOURCES_TIMEOUT_S = 2.0    # a replica's Status answer to the poller

# Hears each poll's answers: service -> each of its replicas' Status (None: it did not answer), in replica order.
StatusListener = Callable[[Mapping[str, list[common_pb2.StageStatus | None]]], None]


class Cluster:
    """The replicas' state, read and written under `lock` (the render service's one lock)."""

    def __init__(self, replicas: Mapping[str, Replica], lock: threading.Condition, pipeline: bool = True):
        self.replicas = replicas
        self.nodes = list(replicas)               # "dit", or "dit/a", "dit/b", ... in stage order
        self.lock = lock
        self.pipeline = pipeline                  # False: one resource group of every replica
        self.seen: dict[str, tuple[float, common_pb2.StageStatus]] = {}  # node -> (when asked, its last Status)
        self.resources: dict[str, Resources] = {}
        self.down: set[str] = set()
        self.suspects = Suspects()
        self.resident = {n: Affinity() for n in self.nodes if replicas[n].service in GRAPH.affinity_services}
        self.groups: list[tuple[str, ...]] = resource_groups(self.nodes, {}, serial=True)  # until the stages answer
        self.running: dict[str, tuple[Batch, float]] = {}  # node -> the batch its group runs, its start (unix)
        self.last_started: dict[str, float] = {}  # node -> when its group last started a batch (monotonic)
        self.polled = threading.Event()           # every replica was asked once (the first batch waits for it)
        self._listeners: list[StatusListener] = []
        self._every_s = RESOURCES_EVERY_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="render-status", daemon=True)

    # ---- the one Status poller ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=len(self.nodes) * RESOURCES_TIMEOUT_S)

    def listen(self, listener: StatusListener, every_s: float) -> None:
        """`listener` hears every poll's answers; the poller asks at least every `every_s`."""
        with self.lock:
            self._listeners.append(listener)
            self._every_s = min(self._every_s, every_s)

    def _ask(self, node: str, timeout_s: float) -> common_pb2.StageStatus | None:
        r = self.replicas[node]
        try:
            return r.clients.stub(r.service).Status(common_pb2.StatusRequest(), timeout=timeout_s,
                                                    metadata=r.clients.security.metadata())
        except grpc.RpcError as e:
            log.debug("replica %s (%s) did not answer Status (%s)", node, r.address, e.code())
            return None

    def _record(self, node: str, st: common_pb2.StageStatus, asked: float) -> None:
        """Under the lock: replica `node` answered Status `st`, asked at `asked` (monotonic)."""
        if node in self.down:
            log.info("replica %s answers again", node)
        self.down.discard(node)
        self.suspects.seen(node, st, asked)
        self.seen[node] = (asked, st)
        self.resources[node] = Resources(st.host, tuple(st.device_ids) or tuple(st.devices), st.residency != "shared")

    def poll(self) -> bool:
        """Ask every replica's Status: a replica that does not answer is down (its service's other replicas take
        its jobs) and keeps the devices it named last; one that never answered shares a group with every other
        (nothing runs beside it blind). Regroups; tells the listeners. Returns whether every replica answered."""
        asked = time.monotonic()
        answers = {node: self._ask(node, RESOURCES_TIMEOUT_S) for node in self.nodes}
        with self.lock:
            for node, st in answers.items():
                if st is not None:
                    self._record(node, st, asked)
                    continue
                if node not in self.down:
                    log.warning("replica %s (%s) does not answer Status", node, self.replicas[node].address)
                self.down.add(node)
            known = dict(self.resources)
            for node in self.down:  # never heard from and getting no work: it shares nothing
                known.setdefault(node, Resources("", (), False))
            groups = resource_groups(self.nodes, known, serial=not self.pipeline)
            if groups != self.groups:
                log.info("resource groups: %s", "; ".join("+".join(g) for g in groups))
                self.groups = groups
            self.lock.notify_all()
            listeners = list(self._listeners)
        by_service: dict[str, list[common_pb2.StageStatus | None]] = {}
        for node, st in answers.items():
            by_service.setdefault(self.replicas[node].service, []).append(st)
        for listener in listeners:
            listener(MappingProxyType(by_service))
        return all(st is not None for st in answers.values())

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            known = self.poll()
            self.polled.set()
            with self.lock:
                healthy = known and not self.down and not self.suspects
                every = min(self._every_s, RESOURCES_EVERY_S if healthy else RESOURCES_UNKNOWN_EVERY_S)
            self._stop.wait(every)

    def statuses(self, service: str, max_age_s: float, timeout_s: float) -> list[common_pb2.StageStatus]:
        """Each replica of `service`'s Status, asked again when the one held is older than `max_age_s`; those that
        answer (one that does not is left to the poller)."""
        out = []
        for node in (n for n in self.nodes if self.replicas[n].service == service):
            with self.lock:
                seen = self.seen.get(node)
            if seen is None or time.monotonic() - seen[0] > max_age_s:
                asked = time.monotonic()
                st = self._ask(node, timeout_s)
                if st is None:
                    continue
                with self.lock:
                    self._record(node, st, asked)
                seen = (asked, st)
            out.append(seen[1])
        return out

    # ---- the view and what the dispatcher records in it ---------------------------------------------------------
    def view(self, last_stage: Mapping[str, str]) -> ClusterView:
        """Under the lock: the replicas as the scheduler sees them (render_svc/planner.py); `last_stage`: the stage
        each group ran last."""
        def state(node: str) -> ReplicaState:
            rep, seen = self.replicas[node], self.seen.get(node)
            st = seen[1] if seen is not None else None
            serves = None
            if st is not None and rep.service in GRAPH.affinity_services:
                serves = Serves(frozenset(st.partitions), (st.loras.directory, tuple(st.loras.names),
                                                           st.loras.paths_allowed) if st.HasField("loras") else None)
            return ReplicaState(node, rep.service, down=node in self.down, suspect=node in self.suspects,
                                busy=node in self.running, queue_depth=st.queue_depth if st is not None else 0,
                                last_started=self.last_started.get(node, 0.0), serves=serves,
                                resident=self.resident.get(node))

        return ClusterView(tuple(state(n) for n in self.nodes), tuple(self.groups), MappingProxyType(dict(last_stage)))

    def assigned(self, a: Assignment, batch: Batch) -> None:
        """Under the lock: assignment `a` starts as `batch`: its group is busy, and its replica holds what the batch
        leaves resident (its affinity)."""
        if a.resident is not None:
            self.resident[a.replica] = a.resident
        for n in a.group:
            self.running[n] = (batch, time.time())
            self.last_started[n] = time.monotonic()

    def released(self, group: tuple[str, ...]) -> None:
        """Under the lock: the group's batch ended; its replicas are idle."""
        for n in group:
            self.running.pop(n, None)

    def stalled(self, node: str, stage: str, timeout_s: float) -> None:
        """Under the lock: `node` made no progress on a `stage` batch: suspect until its Status shows it moving."""
        self.suspects.mark(node, stage, timeout_s)

    def unavailable(self, node: str, message: str) -> None:
        """Under the lock: `node` answered a call UNAVAILABLE: down until it answers Status again, while its service
        has another replica to take the work."""
        service = self.replicas[node].service
        if node not in self.down and any(n != node and self.replicas[n].service == service for n in self.nodes):
            log.warning("replica %s answered UNAVAILABLE (%s); its jobs go to the other replicas", node, message)
            self.down.add(node)

    def suspect(self, node: str) -> str:
        """Why replica `node` is out of rotation after a stall ("" when it is not)."""
        with self.lock:
            return self.suspects.reason(node)

    def group_names(self) -> list[str]:
        """The resource groups as "encoder+dit+decoder" names, in stage order."""
        with self.lock:
            return ["+".join(g) for g in self.groups]

    def running_batches(self) -> list[tuple[Batch, float]]:
        """The batches running now, each once, with their start (unix)."""
        with self.lock:
            return list({b.number: (b, t0) for b, t0 in self.running.values()}.values())
