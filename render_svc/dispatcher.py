"""The dispatcher: applies the scheduler's assignments and moves each job on as its stage call ends.

One thread (`run`) asks the one scheduling decision (`planner.schedule`) for the batches to start now, from the
cluster view (render_svc/cluster.py) and the stage queues, and starts each assignment in a thread of its own on the
executor (`engine.RenderEngine.run_batch`, which runs it and decides nothing); the assignment's replica, group and
affinity are recorded in the view under the lock before the batch thread starts. Each job moves on the moment its
stage call ends (`_advance`): to its next stage's queue, to SUCCEEDED with its MP4, or to FAILED / CANCELLED. A stage
answering UNAVAILABLE is retried by queueing the job for the same stage again (--stage-retries); one answering
RESOURCE_EXHAUSTED with "retry later" is waited out with exponential backoff up to the job's deadline; a replica
silent on a batch for --stall-timeout-s loses it (render_svc/stalls.py) and each job runs that stage once more
elsewhere.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque

from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import spec_from_proto
from render_svc.book import JobBook
from render_svc.cluster import RESOURCES_TIMEOUT_S, Cluster
from render_svc.config import SchedulerConfig
from render_svc.engine import Outcome, RenderEngine, Work
from render_svc.graph import GRAPH
from render_svc.planner import Batch, BatchPlanner, schedule
from render_svc.stalls import stall_verdict
from render_svc.store import CANCELLED, FAILED, GUIDE, QUEUED, SOURCE, SUCCEEDED, JobRecord
from stagekit.errors import Cancelled, Unavailable

log = logging.getLogger("render_svc")

BUSY_HINT = "retry later"     # a stage's RESOURCE_EXHAUSTED that passes (full queue, upload slots, budget wait)
BUSY_FIRST_S, BUSY_MAX_S = 0.5, 30.0   # backoff between tries of a busy stage: doubles from the first to the max


class Dispatcher:
    """The stage queues and the jobs in flight. Its state is read and written under `cluster.lock` (the service's one
    lock)."""

    def __init__(self, cfg: SchedulerConfig, book: JobBook, cluster: Cluster, engine: RenderEngine, stopping: threading.Event,
                 abort: threading.Event, stopped: threading.Event):
        self.cfg = cfg
        self.book = book
        self.cluster = cluster
        self.engine = engine
        self.lock = cluster.lock
        self.stopping = stopping                 # SIGTERM: the drain has begun (no new batch starts)
        self.abort = abort                       # the drain stops the running batch's stage calls
        self.stopped = stopped                   # the drain is over
        self.planner = BatchPlanner(cfg.max_batch, cfg.max_wait_batches)
        self.works: dict[str, Work] = {}         # jobs in flight (queued or between / in stages)
        self.later: dict[str, tuple[float, str]] = {}  # jobs backing off a busy stage: id -> (due, stage)
        self.batch_log: deque[dict] = deque(maxlen=200)  # recent batches (the web page draws them)
        self._batch_threads: set[threading.Thread] = set()
        self._next_retention = time.monotonic() + cfg.retention_every_s

    # ---- the queues ----------------------------------------------------------------------------------------------
    def enqueue(self, rec: JobRecord) -> None:
        """Under the lock: a queued job's in-flight state, waiting for its first stage."""
        files = self.book.store.files
        frames = [(a, files.path(rec.keyframes[a])) for a in ("first", "last") if a in rec.keyframes]
        refs = [files.path(r.digest) if r.digest and not r.data else None for r in rec.request.references]
        guides = [{p: files.path(getattr(g, p).digest) for p in ("image", "audio")
                   if g.HasField(p) and getattr(g, p).digest and not getattr(g, p).data} for g in rec.request.guides]
        stored = {k: files.path(d) for k, d in rec.keyframes.items()}
        w = Work(rec.id, rec.request, spec_from_proto(rec.request.params), self.book.outputs / f"{rec.id}.mp4",
                 keyframe_files=frames, reference_files=refs, guide_files=guides,
                 deadline=rec.created + self.cfg.job_deadline_s, source=stored.get(SOURCE),
                 guide_file=stored.get(GUIDE), keep_latents=True)
        self.works[rec.id] = w
        self.planner.add(rec.id, w.first_stage)

    def withdraw(self, job_id: str) -> tuple[str | None, Work | None]:
        """Under the lock: a cancelled job out of the queues. (what it waited for, None when it is in a batch; its
        in-flight state)."""
        waiting_for = self.planner.remove(job_id)
        if waiting_for is None and job_id in self.later:
            waiting_for = f"{self.later.pop(job_id)[1]} stage (busy)"
        elif waiting_for is not None:
            waiting_for = f"{waiting_for} stage"
        work = self.works.get(job_id)
        if waiting_for is not None:
            self.works.pop(job_id, None)
        return waiting_for, work

    def _requeue(self, job_id: str, stage: str) -> None:
        with self.lock:
            self.planner.add(job_id, stage)
            self.lock.notify_all()  # its stage's group may be idle: the dispatcher starts it now

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _dispatch(self) -> int:
        """Under the lock: jobs whose busy backoff is over rejoin their stage's queue; every batch the scheduler
        assigns starts in a thread of its own, recorded in the cluster view first. Returns how many started."""
        now = time.monotonic()
        for job_id, (due, stage) in sorted(self.later.items(), key=lambda kv: kv[1][0]):
            if due <= now:
                del self.later[job_id]
                self.planner.add(job_id, stage)
        queues = self.planner.queued(lambda j: self.works[j.job_id].queued(j.waited))
        assignments = schedule(self.cluster.view(self.planner.current), queues)
        for a in assignments:
            batch = self.planner.take(a)
            self.cluster.assigned(a, batch)
            rounds = [[self.works[j] for j in r] for r in a.rounds]
            t = threading.Thread(target=self._batch_thread, args=(batch, rounds, a.group, a.replica),
                                 name=f"render-batch-{batch.number}", daemon=True)
            self._batch_threads.add(t)
            t.start()
        return len(assignments)

    def _drained(self) -> None:
        """The service is draining (SIGTERM): the running jobs go back to the queue, their attempt given back."""
        try:
            ids = self.book.store.drained()
            log.info("drain: %d running job(s) back in the queue, no attempt spent", len(ids))
        except sqlite3.Error as e:
            self.book.storage_failed(e)

    def run(self) -> None:
        """The dispatcher thread: retention and checkpoints between batches, and every idle group's next batch.
        Draining, it waits for the running batches (shutdown stops them after the grace), then gives the running
        jobs back to the queue."""
        self.cluster.polled.wait(timeout=len(self.cluster.nodes) * RESOURCES_TIMEOUT_S + 1.0)
        while not self.stopped.is_set():
            try:
                if self.stopping.is_set():
                    with self.lock:
                        while self._batch_threads:
                            self.lock.wait(0.2)
                    self._drained()
                    return
                if time.monotonic() >= self._next_retention:
                    self.book.maintain()
                    self._next_retention = time.monotonic() + self.cfg.retention_every_s
                self.book.durable(self.book.store.save_finished)
            except Unavailable:
                return
            with self.lock:
                if self._dispatch() == 0 and not self.stopping.is_set():
                    due = min((d for d, _ in self.later.values()), default=time.monotonic() + 0.5)
                    self.lock.wait(max(0.01, min(0.5, due - time.monotonic())))

    # ---- one batch -----------------------------------------------------------------------------------------------
    def _batch_thread(self, batch: Batch, rounds: list[list[Work]], group: tuple[str, ...], node: str) -> None:
        """One group's batch on its replica `node`, start to end; the group's replicas are idle again after it."""
        advanced: set[str] = set()
        works = [w for r in rounds for w in r]
        try:
            self._run_batch(batch, rounds, advanced, node)
        except Unavailable:
            log.info("shutting down: leaving batch %d (%s) to the next start", batch.number, batch.stage)
        except Exception:  # noqa: BLE001 - a scheduler bug must not strand the jobs silently
            log.exception("batch %d (%s) failed", batch.number, batch.stage)
            for w in works:
                if w.job_id not in advanced:
                    self.finish(w, FAILED, "INTERNAL", f"render service error in the {batch.stage} batch; see its log")
        finally:
            with self.lock:
                self.cluster.released(group)
                self._batch_threads.discard(threading.current_thread())
                self.lock.notify_all()

    def _run_batch(self, batch: Batch, rounds: list[list[Work]], advanced: set[str], node: str) -> None:
        """Send the batch's jobs to the stage, round after round; each moves on (`_advance`) the moment its own call
        ends."""
        live = []
        for w in (w for r in rounds for w in r):
            if w.cancelled.is_set():
                self.finish(w, CANCELLED, "CANCELLED", f"cancelled while waiting for the {batch.stage} stage")
                advanced.add(w.job_id)
                continue
            if (self.book.get(w.job_id).state == QUEUED
                    and not self.book.durable(self.book.store.start, w.job_id, batch.stage)):
                advanced.add(w.job_id)
                continue  # finished in between
            live.append(w)
        if not live:
            return
        t0 = time.time()
        log.info("batch %d: %s x %d on %s (waited %s)", batch.number, batch.stage, len(live), node,
                 sorted(batch.waited.values()))
        if self.stopping.is_set():
            raise Unavailable("draining")

        def done(w: Work, o: Outcome) -> None:
            advanced.add(w.job_id)
            with self.lock:  # until its Status shows it moving again (or answering), the other replicas take the work
                if o.stalled:
                    self.cluster.stalled(node, batch.stage, self.cfg.stall_timeout_s)
                elif not o.ok and o.code == "UNAVAILABLE":
                    self.cluster.unavailable(node, o.message)
            self._advance(w, batch, o, node)

        try:
            ids = {w.job_id for w in live}
            outcomes = self.engine.run_batch(batch.stage, [c for c in ([w for w in r if w.job_id in ids]
                                                                       for r in rounds) if c],
                                             self.book.progress, self.abort.is_set, on_done=done, node=node,
                                             stall_timeout_s=self.cfg.stall_timeout_s)
        except Cancelled:  # the drain stopped the batch
            raise Unavailable("draining") from None
        with self.lock:
            self.batch_log.append({"number": batch.number, "stage": batch.stage, "group": batch.group, "replica": node,
                                   "jobs": [w.job_id for w in live], "size": len(live), "t0": t0, "t1": time.time()})
        unavailable = sum(not o.ok and o.code == "UNAVAILABLE" and not o.stalled for o in outcomes.values())
        if unavailable == len(live):
            self.stopping.wait(min(5.0, 1.0 * max(w.unavailable for w in live)))  # the stage is down: back off

    def _advance(self, w: Work, batch: Batch, o: Outcome, node: str) -> None:
        stage = batch.stage
        if w.cancelled.is_set():
            self.finish(w, CANCELLED, "CANCELLED", f"cancelled during the {stage} stage")
            return
        if o.ok:
            r = o.result
            self.book.durable(self.book.store.add_run, w.job_id, render_pb2.StageRun(
                stage=stage, wall_s=r.wall_s, timing=r.timing, batch=batch.number, batch_size=len(batch.job_ids),
                waited_batches=batch.waited.get(w.job_id, 0), replica=node,
                cached_steps=r.extra.get("cached_steps", 0), sparse_steps=r.extra.get("sparse_steps", 0)))
            nxt = GRAPH.next_stage(stage, w.plan)
            if nxt is None:
                self.finish(w, SUCCEEDED, output_bytes=w.output.stat().st_size)
                return
            self.book.durable(self.book.store.set_stage, w.job_id, nxt)
            self._requeue(w.job_id, nxt)
            return
        if o.code == "RESOURCE_EXHAUSTED" and BUSY_HINT in o.message:
            left = w.deadline - time.time()
            if left > 0:
                delay = min(BUSY_MAX_S, BUSY_FIRST_S * 2 ** min(w.busy, 16), left)
                w.busy += 1
                self.book.progress(w.job_id, common_pb2.Progress(
                    stage=stage, phase="waiting",
                    message=f"waiting for the {stage} stage (busy): {o.message}; try {w.busy + 1} in {delay:.1f} s"))
                with self.lock:
                    self.later[w.job_id] = (time.monotonic() + delay, stage)
                    self.lock.notify_all()
                return
            self.finish(w, FAILED, "DEADLINE_EXCEEDED",
                        f"the {stage} stage stayed busy until the job's deadline ({self.cfg.job_deadline_s:g} s after "
                        f"its submission, --job-deadline-s): {o.message}")
            return
        if o.stalled:
            failure = stall_verdict(w.stalled_on, node, stage, self.cfg.stall_timeout_s)
            if failure is not None:
                self.finish(w, FAILED, "UNAVAILABLE", failure)
                return
            w.stalled_on.append(node)
            self.book.progress(w.job_id, common_pb2.Progress(
                stage=stage, phase="retrying",
                message=f"{o.message}; the {stage} stage runs once more, on another replica while there is one"))
            self._requeue(w.job_id, stage)
            return
        if o.code == "UNAVAILABLE" and w.unavailable < self.cfg.stage_retries:
            w.unavailable += 1
            self.book.progress(w.job_id, common_pb2.Progress(
                stage=stage, phase="retrying",
                message=f"the {stage} stage is unavailable ({o.message}); retry {w.unavailable} of "
                        f"{self.cfg.stage_retries}"))
            self._requeue(w.job_id, stage)
            return
        self.finish(w, FAILED, o.code, o.message)

    def finish(self, w: Work, state: int, code: str = "", message: str = "", output_bytes: int = 0) -> None:
        """The job leaves the queues and ends (`JobBook.end`)."""
        with self.lock:
            self.works.pop(w.job_id, None)
            self.later.pop(w.job_id, None)
            self.planner.remove(w.job_id)
        self.book.end(w.job_id, w.output, state, code, message, output_bytes)

    def recent(self, n: int) -> list[dict]:
        """The last `n` batches that ran."""
        with self.lock:
            return list(self.batch_log)[-n:]
