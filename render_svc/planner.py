"""What runs where: the render service's one scheduling decision, `schedule(view, queues) -> assignments`, pure.

`schedule` takes plain frozen data: a `ClusterView` (the stage replicas, their resource groups, which are down or
suspect, which are busy, each DiT replica's resident partition and LoRAs) and the `Queues` (the jobs ready for each
stage, their waits and their DiT needs), and returns the batches to start now (`Assignment`: stage, group, replica,
job ids in the rounds they are sent in). The dispatcher (render_svc/dispatcher.py) takes the view from the cluster
view (render_svc/cluster.py) under the service's lock, calls `schedule`, applies each assignment to the queues
(`BatchPlanner.take`) and the cluster view (the DiT's affinity), and hands it to the engine (render_svc/engine.py),
which runs it and decides nothing.

Every job moves through the render stages of its mode's route (render_svc/graph.py, `GRAPH`). A job
*ready* for a stage waits in that stage's FIFO queue. A *resource group* is a set of stage replicas that take turns
on a device (`resource_groups`); each group runs one *batch* at a time: up to `max_batch` jobs of one of its stages,
sent to the stage together so it serves them in one residency (one weight swap for the batch, docs/residency.md).
Groups that share no device run their batches at the same time.

Which replica serves a group's stage (`serving_replicas`): one in rotation (not down, not suspect) while its service
has one, the shortest queue first; which jobs it may take (`may_serve`): those it serves by its Status (a DiT: the
job's partition and LoRAs), and those no replica in rotation serves (its own refusal then ends the job). Idle groups
take work in `preference` order: a DiT that holds the oldest DiT job's partition and LoRAs first (no swap).

Choosing a group's batch (`choose_batch`; docs/render_service.md, "Stage batching"), among the stages the group serves:
- Stay on the stage the group ran last while it has ready jobs: its weights are resident, so the batch costs no swap.
- But a ready job never waits more than `max_wait` batches. Every batch its group starts without it counts one wait
  for it; a task's *slack* is `max_wait - waited` of the oldest job in it (a task = one batch-sized FIFO chunk of a
  stage's queue). Staying is allowed only if every other task of the group can still run in time after it
  (earliest-deadline-first: sorted slacks s_k >= k + 1); otherwise the task with the least slack runs now
  (ties: the later stage first, finishing work in flight).
The bound holds while the work fits the batches: when what arrives at a group's stages during `max_wait` batches fits
one batch (tests/test_render_svc_batching.py simulates such loads). Beyond that the service is overloaded and no
order can keep it; the least-slack task still goes first, so waits stay ordered by age.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from minimax_h3.contract import check_loras, needed_partition
from render_svc.graph import GRAPH
from stagekit.errors import FailedPrecondition, InvalidArgument, NotFound

@dataclass(frozen=True)
class Resources:
    """What a stage service holds, from its Status: its devices (lease ids: GPU UUIDs or virtual names) on its host,
    and whether it takes turns on them (exclusive residency) or stays resident beside others (shared)."""

    host: str
    devices: tuple[str, ...]
    exclusive: bool

    def conflicts(self, other: "Resources") -> bool:
        """Two services take turns when they share a device and either of them takes the device's lease."""
        shared = {(self.host, d) for d in self.devices} & {(other.host, d) for d in other.devices}
        return bool(shared) and (self.exclusive or other.exclusive)


def resource_groups(nodes: Iterable[str], known: Mapping[str, Resources],
                    serial: bool = False) -> list[tuple[str, ...]]:
    """The stage services (`nodes`) in groups that take turns: the connected parts of "conflicts" (a service whose
    resources are not known yet conflicts with every other, so nothing runs beside it blind). `serial`: one group of
    all (one batch service-wide at a time). Groups and their members keep `nodes`' order."""
    nodes = list(nodes)
    if serial:
        return [tuple(nodes)]
    parent = {n: n for n in nodes}

    def root(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ra, rb = known.get(a), known.get(b)
            if ra is None or rb is None or ra.conflicts(rb):
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    return [tuple(g) for g in groups.values()]


# ---- the decision, as data ----------------------------------------------------------------------------------------
Lora = tuple[str, float]  # a LoRA a job samples with: its name and strength


@dataclass(frozen=True)
class Affinity:
    """What a DiT replica holds after its last batch: the partition it ran last and the LoRAs of its last job (a job
    that needs the same costs the replica no weight swap)."""

    partition: str = needed_partition(False)
    loras: tuple[Lora, ...] = ()


@dataclass(frozen=True)
class Serves:
    """What a DiT replica's Status says it serves: the partitions of its files (empty: it did not say) and, when it
    said, its LoRAs (`loras_dir`, the file names in it, whether it takes absolute paths)."""

    partitions: frozenset[str] = frozenset()
    loras: tuple[str, tuple[str, ...], bool] | None = None

    def takes(self, job: "QueuedJob") -> bool:
        if self.partitions and job.partition not in self.partitions:
            return False
        if job.loras and self.loras is not None:
            try:
                check_loras([name for name, _ in job.loras], *self.loras)
            except (NotFound, InvalidArgument):
                return False
        return True


@dataclass(frozen=True)
class ReplicaState:
    """One stage replica as the scheduler sees it."""

    node: str                       # "dit", or "dit/a", "dit/b", ...
    service: str                    # encoder | dit | decoder
    down: bool = False              # did not answer Status, or answered a call UNAVAILABLE
    suspect: bool = False           # stalled on a batch and has not moved since (render_svc/stalls.py)
    busy: bool = False              # its resource group runs a batch
    queue_depth: int = 0            # from its last Status (0 before it answered)
    last_started: float = 0.0       # when its group last started a batch (time.monotonic())
    serves: Serves | None = None    # a DiT that answered Status: which jobs it serves (None: every job)
    resident: Affinity | None = None  # a DiT: what its last batch left resident

    @property
    def in_rotation(self) -> bool:
        return not self.down and not self.suspect

    def takes(self, job: "QueuedJob") -> bool:
        return self.serves is None or self.serves.takes(job)


@dataclass(frozen=True)
class ClusterView:
    """The stage replicas (in the service's order), the resource groups they form (`resource_groups`), and the stage
    each group ran last (by group name, "encoder+dit": its weights are likely resident)."""

    replicas: tuple[ReplicaState, ...]
    groups: tuple[tuple[str, ...], ...]
    last_stage: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def replica(self, node: str) -> ReplicaState:
        return next(r for r in self.replicas if r.node == node)


@dataclass(frozen=True)
class QueuedJob:
    """A job ready for a stage: how many batches its group started without it (`waited`), and what its DiT stage
    needs (its partition and LoRAs)."""

    job_id: str
    waited: int = 0
    partition: str = needed_partition(False)
    loras: tuple[Lora, ...] = ()


@dataclass(frozen=True)
class Queues:
    """Each stage's FIFO of ready jobs, and the bounds: jobs per batch, batches a ready job may wait."""

    max_batch: int
    max_wait: int
    jobs: Mapping[str, tuple[QueuedJob, ...]]

    def after(self, a: "Assignment") -> "Queues":
        """The queues once `a` has started: its jobs out, each job it passed over waiting one batch more."""
        taken, passed = set(a.job_ids), set(a.passed)
        jobs = {s: tuple(replace(j, waited=j.waited + 1) if j.job_id in passed else j
                         for j in q if j.job_id not in taken) for s, q in self.jobs.items()}
        return replace(self, jobs=MappingProxyType(jobs))


@dataclass(frozen=True)
class Assignment:
    """A batch to start: `stage` on replica `replica` of resource group `group` (its replicas, `name` "encoder+dit"),
    its jobs sent round after round (`rounds`: a
    DiT batch goes one partition per round, the one the replica holds first, so it swaps weights at most once).
    `passed`: the ready jobs the group could have served and left waiting (each counts one more wait). `resident`: a
    DiT's affinity once the batch ran."""

    stage: str
    group: tuple[str, ...]
    replica: str
    rounds: tuple[tuple[str, ...], ...]
    passed: tuple[str, ...] = ()
    resident: Affinity | None = None

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(j for r in self.rounds for j in r)

    @property
    def name(self) -> str:
        return "+".join(self.group)


# ---- the decision --------------------------------------------------------------------------------------------------
def schedule(view: ClusterView, queues: Queues) -> list[Assignment]:
    """What runs where now: a batch for every idle group that may serve a waiting job, the preferred group first
    (`preference`), each on the replica of its group that serves the batch's stage (`serving`), with the jobs that
    replica may take (`may_serve`), the batch chosen by `choose_batch`."""
    idle = [g for g in view.groups if not any(view.replica(n).busy for n in g)]
    out = []
    for group in sorted(idle, key=lambda g: preference(view, queues, g)):
        serving = serving_replicas(view, group)
        may = {stage: may_serve(view, node) for stage, node in serving.items()}
        picked = choose_batch(queues, tuple(serving), view.last_stage.get("+".join(group)),
                              lambda j, stage: may[stage](j))
        if picked is None:
            continue
        stage, taken, passed = picked
        rounds, resident = batch_rounds(stage, taken, view.replica(serving[stage]).resident)
        a = Assignment(stage, group, serving[stage], rounds, passed, resident)
        queues = queues.after(a)
        out.append(a)
    return out


def preference(view: ClusterView, queues: Queues, group: tuple[str, ...]) -> tuple:
    """The order idle groups take work in: a group whose DiT replica holds the partition and the LoRAs of the oldest
    job waiting for the DiT (each stage with affinity in the render graph) goes first (no weight swap), then the
    shortest stage queues (their Status), then the one idle longest (replicas of a stage share its work)."""
    reps = [view.replica(n) for n in group]
    swap = 0
    for stage in (s for s in GRAPH.stages if GRAPH.affinity(s)):
        first = next(iter(queues.jobs.get(stage, ())), None)
        held = [r.resident or Affinity() for r in reps if r.service == GRAPH.service_of(stage)]
        if first is not None and held:
            swap += min(int(a.partition != first.partition) + int(a.loras != first.loras) for a in held)
    return swap, sum(r.queue_depth for r in reps), max(r.last_started for r in reps)


def serving_replicas(view: ClusterView, group: tuple[str, ...]) -> dict[str, str]:
    """Render stage -> the replica of `group` that serves it now: one in rotation (while its service has any that
    is, the others get nothing), the shortest queue first."""
    out = {}
    for stage in GRAPH.stages:
        service = GRAPH.service_of(stage)
        mine = [view.replica(n) for n in group if view.replica(n).service == service]
        if any(r.in_rotation for r in view.replicas if r.service == service):
            mine = [r for r in mine if r.in_rotation]
        if mine:
            out[stage] = min(mine, key=lambda r: r.queue_depth).node
    return out


def may_serve(view: ClusterView, node: str) -> Callable[[QueuedJob], bool]:
    """Which waiting jobs replica `node` may take: those it serves (`ReplicaState.takes`), and those no replica of its
    service in rotation serves (its own refusal then ends the job, as with one replica)."""
    rep = view.replica(node)
    peers = [r for r in view.replicas if r.service == rep.service and r.in_rotation]
    return lambda job: rep.takes(job) or not any(p.takes(job) for p in peers)


def choose_batch(queues: Queues, stages: tuple[str, ...], current: str | None,
                 may_take: Callable[[QueuedJob, str], bool] = lambda job, stage: True,
                 ) -> tuple[str, tuple[QueuedJob, ...], tuple[str, ...]] | None:
    """A group's next batch among its `stages` and the jobs it may take (`may_take(job, stage)`), `current` the stage
    it ran last: (stage, the jobs taken, the ids of the others it could have served), or None when none waits."""
    view = {s: [j for j in queues.jobs.get(s, ()) if may_take(j, s)] for s in stages}
    stage = _choose(view, current, queues.max_batch, queues.max_wait)
    if stage is None:
        return None
    taken = tuple(view[stage][: queues.max_batch])
    ids = {j.job_id for j in taken}
    return stage, taken, tuple(j.job_id for q in view.values() for j in q if j.job_id not in ids)


def _choose(view: dict[str, list[QueuedJob]], current: str | None, max_batch: int, max_wait: int) -> str | None:
    """The stage of a group's next batch (earliest-deadline-first over its tasks, above); None when `view` is empty."""
    tasks = []  # (slack, -stage order, stage) per batch-sized chunk of each queue in `view`, chunk 0 first in a stage
    for order, stage in enumerate(GRAPH.stages):
        q = view.get(stage, [])
        tasks += [(max_wait - q[start].waited, -order, stage) for start in range(0, len(q), max_batch)]
    if not tasks:
        return None
    if current in view and view[current]:
        first = next(i for i, t in enumerate(tasks) if t[2] == current)  # the current stage's oldest chunk
        rest = sorted(t[0] for i, t in enumerate(tasks) if i != first)
        if all(s >= k + 1 for k, s in enumerate(rest)):
            return current
    return min(tasks)[2]


def batch_rounds(stage: str, jobs: Sequence[QueuedJob], resident: Affinity | None = None,
                 ) -> tuple[tuple[tuple[str, ...], ...], Affinity | None]:
    """A batch's job ids in the rounds they are sent in, and a DiT replica's affinity after them. A DiT batch goes
    partition by partition, the one the replica holds (`resident`) first, so a mixed batch swaps the DiT's weights at
    most once (docs/references.md); fl2va and ref2va jobs never share a round. Stages without affinity (render
    graph): one round."""
    if not GRAPH.affinity(stage):
        return (tuple(j.job_id for j in jobs),), None
    held = (resident or Affinity()).partition
    parts = sorted(dict.fromkeys(j.partition for j in jobs), key=lambda p: p != held)
    rounds = [[j for j in jobs if j.partition == p] for p in parts]
    return tuple(tuple(j.job_id for j in r) for r in rounds), Affinity(parts[-1], rounds[-1][-1].loras)


# ---- the queues' state ---------------------------------------------------------------------------------------------
@dataclass
class Batch:
    stage: str
    job_ids: list[str]
    number: int                     # 1-based, service-wide
    waited: dict[str, int] = field(default_factory=dict)  # batches each job waited for this stage
    group: str = ""                 # the resource group that runs it


class BatchPlanner:
    """The stage queues, the batches started and each group's last stage: the state `schedule` decides from
    (`queued`), and the assignments it made, applied (`take`). Not thread-safe: the render service calls it under its
    lock."""

    def __init__(self, max_batch: int, max_wait: int):
        if max_batch < 1:
            raise FailedPrecondition(f"--max-batch must be >= 1, got {max_batch}")
        if max_wait < 1:
            raise FailedPrecondition(f"--max-wait-batches must be >= 1, got {max_wait}")
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.queues: dict[str, list[QueuedJob]] = {s: [] for s in GRAPH.stages}  # job ids and waits, no DiT needs
        self.batches = 0                  # batches started so far, service-wide
        self.current: dict[str, str] = {}  # group -> the stage of its last batch (its weights are likely resident)

    def add(self, job_id: str, stage: str) -> None:
        if stage not in self.queues:
            raise ValueError(f"unknown render stage {stage!r}; one of {GRAPH.stages}")
        self.queues[stage].append(QueuedJob(job_id))

    def remove(self, job_id: str) -> str | None:
        """Take a waiting job out (cancel); returns the stage it waited for, or None if it was not waiting."""
        for stage, q in self.queues.items():
            for i, r in enumerate(q):
                if r.job_id == job_id:
                    del q[i]
                    return stage
        return None

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def stage_of(self, job_id: str) -> str | None:
        return next((s for s, q in self.queues.items() if any(r.job_id == job_id for r in q)), None)

    def queued(self, describe: Callable[[QueuedJob], QueuedJob] = lambda j: j) -> Queues:
        """The queues as `schedule` takes them; `describe` fills in a waiting job's DiT needs."""
        return Queues(self.max_batch, self.max_wait,
                      MappingProxyType({s: tuple(describe(j) for j in q) for s, q in self.queues.items()}))

    def take(self, a: Assignment) -> Batch:
        """Assignment `a` starts (`Queues.after`), and its stage is its group's last: the batch, numbered."""
        waited = {j.job_id: j.waited for j in self.queues[a.stage]}
        self.queues = {s: list(q) for s, q in self.queued().after(a).jobs.items()}
        self.batches += 1
        self.current[a.name] = a.stage
        return Batch(a.stage, list(a.job_ids), self.batches, {j: waited[j] for j in a.job_ids}, a.name)
