"""Which stage batch runs next, per resource group: stage batching across all queued jobs, with a fairness bound.

Every job moves through the render stages of its mode's plan (`minimax_h3.contract.RENDER_PLANS`, data). A job
*ready* for a stage waits in that stage's FIFO queue. A *resource group* is a set of stage replicas that take turns
on a device (`resource_groups`); each group runs one *batch* at a time: up to `max_batch` jobs of one of its stages,
sent to the stage together so it serves them in one residency (one weight swap for the batch, docs/residency.md).
Groups that share no device run their batches at the same time.

Choosing a group's batch (docs/render_service.md, "Stage batching"), among the stages the group serves:
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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from stagekit.errors import FailedPrecondition

STAGES = ("keyframes", "encoder", "dit", "decoder")  # every render stage, in render order (each mode's plan:
# minimax_h3.contract.RENDER_PLANS)
# The stage service each render stage calls (the decoder's VAE encoders encode keyframes and references).
SERVICE_OF = {"keyframes": "decoder", "encoder": "encoder", "dit": "dit", "decoder": "decoder"}


def next_stage(stage: str, plan: tuple[str, ...] = STAGES) -> str | None:
    """The stage after `stage` in `plan` (None after the last)."""
    i = plan.index(stage) + 1
    return plan[i] if i < len(plan) else None


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


Eligible = Callable[[str, str], bool]  # (job id, stage) -> whether a group may serve that job's stage


@dataclass
class _Ready:
    job_id: str
    waited: int = 0  # batches its group started without it since it became ready for this stage


@dataclass
class Batch:
    stage: str
    job_ids: list[str]
    number: int                     # 1-based, service-wide
    waited: dict[str, int] = field(default_factory=dict)  # batches each job waited for this stage
    group: str = ""                 # the resource group that runs it


class BatchPlanner:
    """The stage queues and each group's choice of its next batch. Not thread-safe: the render service calls it under
    its lock."""

    def __init__(self, max_batch: int, max_wait: int):
        if max_batch < 1:
            raise FailedPrecondition(f"--max-batch must be >= 1, got {max_batch}")
        if max_wait < 1:
            raise FailedPrecondition(f"--max-wait-batches must be >= 1, got {max_wait}")
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.queues: dict[str, list[_Ready]] = {s: [] for s in STAGES}
        self.batches = 0                  # batches started so far, service-wide
        self.current: dict[str, str] = {}  # group -> the stage of its last batch (its weights are likely resident)

    def add(self, job_id: str, stage: str) -> None:
        if stage not in self.queues:
            raise ValueError(f"unknown render stage {stage!r}; one of {STAGES}")
        self.queues[stage].append(_Ready(job_id))

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

    def _view(self, stages: tuple[str, ...], eligible: Eligible | None) -> dict[str, list[_Ready]]:
        """The queues of `stages`, each holding only the jobs `eligible` lets this group serve."""
        return {s: [r for r in self.queues[s] if eligible is None or eligible(r.job_id, s)] for s in stages}

    def _tasks(self, view: dict[str, list[_Ready]]) -> list[tuple[int, int, str]]:
        """(slack, -stage order, stage) per batch-sized chunk of each queue in `view`, chunk 0 first in a stage."""
        out = []
        for order, stage in enumerate(STAGES):
            q = view.get(stage, [])
            for start in range(0, len(q), self.max_batch):
                out.append((self.max_wait - q[start].waited, -order, stage))
        return out

    def choose(self, stages: tuple[str, ...] = STAGES, group: str = "", eligible: Eligible | None = None) -> str | None:
        """The stage of `group`'s next batch among its `stages` (None when none of them has a waiting job it may
        serve: `eligible(job_id, stage)`, default all)."""
        return self._choose(self._view(stages, eligible), group)

    def _choose(self, view: dict[str, list[_Ready]], group: str) -> str | None:
        tasks = self._tasks(view)
        if not tasks:
            return None
        cur = self.current.get(group)
        if cur in view and view[cur]:
            first = next(i for i, t in enumerate(tasks) if t[2] == cur)  # the current stage's oldest chunk
            rest = sorted(t[0] for i, t in enumerate(tasks) if i != first)
            if all(s >= k + 1 for k, s in enumerate(rest)):
                return cur
        return min(tasks)[2]

    def next_batch(self, stages: tuple[str, ...] = STAGES, group: str = "",
                   eligible: Eligible | None = None) -> Batch | None:
        """`group`'s next batch among its `stages` and the jobs `eligible` lets it serve (None when none waits);
        every job it could have served and left waiting counts one more wait."""
        view = self._view(stages, eligible)
        stage = self._choose(view, group)
        if stage is None:
            return None
        taken = view[stage][: self.max_batch]
        ids = {r.job_id for r in taken}
        self.queues[stage] = [r for r in self.queues[stage] if r.job_id not in ids]
        for s, q in view.items():
            for r in q:
                if r.job_id not in ids:
                    r.waited += 1
        self.batches += 1
        self.current[group] = stage
        return Batch(stage, [r.job_id for r in taken], self.batches, {r.job_id: r.waited for r in taken}, group)
