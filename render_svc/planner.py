"""Which stage batch runs next: stage batching across all queued jobs, with a fairness bound.

Every job moves through the render stages in order (`keyframes` only for fl2va). A job *ready* for a stage waits in
that stage's FIFO queue. The scheduler runs one *batch* at a time: up to `max_batch` jobs of one stage, sent to the
stage together so it serves them in one residency (one weight swap for the batch, docs/residency.md).

Choosing the batch (docs/render_service.md, "Stage batching"):
- Stay on the stage that ran last while it has ready jobs: its weights are resident, so the batch costs no swap.
- But a ready job never waits more than `max_wait` batches. Every batch that starts without a ready job counts one
  wait for it; a task's *slack* is `max_wait - waited` of the oldest job in it (a task = one batch-sized FIFO
  chunk of a stage's queue). Staying is allowed only if every other task can still run in time after it
  (earliest-deadline-first: sorted slacks s_k >= k + 1); otherwise the task with the least slack runs now
  (ties: the later stage first, finishing work in flight).
The bound holds while the work fits the batches: when what arrives at a stage during `max_wait` batches fits
one batch (tests/test_render_svc_batching.py simulates such loads). Beyond that the service is overloaded and no
order can keep it; the least-slack task still goes first, so waits stay ordered by age.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagekit.errors import FailedPrecondition

STAGES = ("keyframes", "encoder", "dit", "decoder")  # render order; keyframes: fl2va only


def first_stage(has_keyframes: bool) -> str:
    return STAGES[0] if has_keyframes else STAGES[1]


def next_stage(stage: str) -> str | None:
    i = STAGES.index(stage) + 1
    return STAGES[i] if i < len(STAGES) else None


@dataclass
class _Ready:
    job_id: str
    since: int  # the batch counter when the job became ready for this stage


@dataclass
class Batch:
    stage: str
    job_ids: list[str]
    number: int                     # 1-based, service-wide
    waited: dict[str, int] = field(default_factory=dict)  # batches each job waited for this stage


class BatchPlanner:
    """Not thread-safe: the render service calls it under its lock."""

    def __init__(self, max_batch: int, max_wait: int):
        if max_batch < 1:
            raise FailedPrecondition(f"--max-batch must be >= 1, got {max_batch}")
        if max_wait < 1:
            raise FailedPrecondition(f"--max-wait-batches must be >= 1, got {max_wait}")
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.queues: dict[str, list[_Ready]] = {s: [] for s in STAGES}
        self.batches = 0                # batches started so far
        self.current: str | None = None  # the stage of the last batch (its weights are likely resident)

    def add(self, job_id: str, stage: str) -> None:
        if stage not in self.queues:
            raise ValueError(f"unknown render stage {stage!r}; one of {STAGES}")
        self.queues[stage].append(_Ready(job_id, self.batches))

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

    def _tasks(self) -> list[tuple[int, int, str]]:
        """(slack, -stage order, stage) per batch-sized chunk of every queue, chunk 0 first within a stage."""
        out = []
        for order, stage in enumerate(STAGES):
            q = self.queues[stage]
            for start in range(0, len(q), self.max_batch):
                out.append((self.max_wait - (self.batches - q[start].since), -order, stage))
        return out

    def choose(self) -> str | None:
        """The stage of the next batch (None when nothing waits)."""
        tasks = self._tasks()
        if not tasks:
            return None
        cur = self.current
        if cur is not None and self.queues[cur]:
            first = next(i for i, t in enumerate(tasks) if t[2] == cur)  # the current stage's oldest chunk
            rest = sorted(t[0] for i, t in enumerate(tasks) if i != first)
            if all(s >= k + 1 for k, s in enumerate(rest)):
                return cur
        return min(tasks)[2]

    def next_batch(self) -> Batch | None:
        stage = self.choose()
        if stage is None:
            return None
        q = self.queues[stage]
        taken, self.queues[stage] = q[: self.max_batch], q[self.max_batch:]
        waited = {r.job_id: self.batches - r.since for r in taken}
        self.batches += 1
        self.current = stage
        return Batch(stage, [r.job_id for r in taken], self.batches, waited)
