"""The job runtime every stage shares: queue, residency, lease, rank fan-out, progress.

A stage supplies an `Engine` (load / unload / run on every rank). The leader's
`StageRuntime` owns one worker thread that takes jobs FIFO from a bounded queue,
makes the engine resident (taking the device lease first), broadcasts the job to
the follower ranks, runs it, and streams progress back to the waiting RPC. When
the queue runs dry the stage stays resident until it has been idle for
`idle_unload_s`, or steps aside at once if another stage is waiting for the
devices — so a batch of queued jobs is served in one residency (stage-batched
scheduling) and nobody starves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagekit.dist import RankGroup
from stagekit.errors import Cancelled, ResourceExhausted, Unavailable, status_for
from stagekit.lease import DeviceLease

log = logging.getLogger("stagekit.runtime")


class Engine(Protocol):
    """What a stage implements; every method runs on every rank with the same arguments."""

    name: str

    def load(self) -> None: ...

    def unload(self) -> None: ...

    def run(self, spec: Any, inputs: dict, ctx: "JobContext") -> dict: ...

    def resident_bytes(self) -> int: ...


@dataclass
class RuntimeConfig:
    max_queue: int = 16             # jobs waiting beyond this are refused with RESOURCE_EXHAUSTED
    idle_unload_s: float = 30.0     # unload after this long idle (exclusive mode); <0 = never
    residency: str = "exclusive"    # "exclusive" | "shared"
    lease_timeout_s: float = 600.0  # give up waiting for the devices after this long


@dataclass
class JobEvent:
    kind: str            # "progress" | "done" | "error"
    payload: Any = None


@dataclass
class Job:
    spec: Any
    inputs: dict
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    deadline: float | None = None            # time.monotonic() deadline
    submitted: float = field(default_factory=time.monotonic)
    events: "queue.Queue[JobEvent]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timing: dict = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled.set()

    def should_cancel(self) -> bool:
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)


class JobContext:
    """Handed to `Engine.run` on every rank: agreed cancellation and progress reporting."""

    def __init__(self, group: RankGroup, job: Job | None, stage: str):
        self.group = group
        self.job = job
        self.stage = stage
        self.t0 = time.monotonic()

    def should_stop(self) -> bool:
        """Called by every rank at step boundaries; all ranks get the same answer."""
        local = self.job.should_cancel() if self.job is not None else False
        return self.group.any_flag(local)

    def check_cancel(self) -> None:
        if self.should_stop():
            raise Cancelled(f"{self.stage}: job cancelled (client cancel, disconnect or deadline)")

    def progress(self, step: int, total: int, phase: str = "running", message: str = "", step_ms: float = 0.0) -> None:
        if self.job is None:  # followers report nothing
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed / step * (total - step) if step > 0 and total >= step else 0.0
        self.job.events.put(JobEvent("progress", dict(
            stage=self.stage, phase=phase, step=step, total=total, elapsed_s=elapsed, eta_s=eta,
            step_ms=step_ms, message=message)))


# Commands the leader broadcasts to followers.
_LOAD, _UNLOAD, _RUN, _EXIT = "load", "unload", "run", "exit"


class StageRuntime:
    """Leader-side scheduler. Thread-safe `submit`; one worker thread does the work."""

    def __init__(self, engine: Engine, group: RankGroup, lease: DeviceLease | None, cfg: RuntimeConfig,
                 on_health: Callable[[bool], None] = lambda serving: None, metrics: Any = None):
        self.engine = engine
        self.group = group
        self.lease = lease
        self.cfg = cfg
        self.on_health = on_health
        self.metrics = metrics
        self.resident = False
        self.loading = False
        self.jobs_done = 0
        self.last_lease_wait = 0.0
        self.running: Job | None = None
        self._q: "queue.Queue[Job | str]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle_since = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"{engine.name}-runtime", daemon=True)
        self._thread.start()

    # ---- leader API -------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._pending

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._stop.is_set():
                raise Unavailable(f"{self.engine.name} is shutting down; retry on another replica")
            if self._pending >= self.cfg.max_queue:
                raise ResourceExhausted(
                    f"{self.engine.name} queue is full ({self._pending} jobs waiting, limit {self.cfg.max_queue}); retry later")
            self._pending += 1
        job.events.put(JobEvent("progress", dict(stage=self.engine.name, phase="queued", step=0, total=0,
                                                 elapsed_s=0.0, eta_s=0.0, step_ms=0.0,
                                                 message=f"{self._pending} in queue")))
        self._q.put(job)
        return job

    def request(self, command: str, timeout_s: float = 3600.0) -> float:
        """Load or unload on the worker thread (serialised with jobs). Returns seconds taken."""
        done: "queue.Queue[tuple[float, BaseException | None]]" = queue.Queue()
        self._q.put((command, done))  # type: ignore[arg-type]
        secs, err = done.get(timeout=timeout_s)
        if err is not None:
            raise err
        return secs

    def shutdown(self, cancel_running: bool, grace_s: float) -> None:
        """Stop taking jobs; finish or cancel the running one; fail queued ones; unload."""
        self._stop.set()
        if cancel_running and self.running is not None:
            self.running.cancel()
        self._q.put(_EXIT)
        self._thread.join(timeout=grace_s)

    # ---- worker thread ------------------------------------------------------------------------
    def _load(self) -> float:
        if self.resident:
            return 0.0
        t0 = time.monotonic()
        waited = 0.0
        self.loading = True
        self.on_health(False)
        try:
            if self.lease is not None and self.cfg.residency == "exclusive":
                waited = self.lease.acquire(timeout_s=self.cfg.lease_timeout_s)
            self.last_lease_wait = waited
            t1 = time.monotonic()
            self.group.broadcast_command((_LOAD, None))
            try:
                self.engine.load()
            except BaseException:
                self._unload_locked()
                raise
            self.resident = True
            if self.metrics is not None:
                self.metrics.observe_load(time.monotonic() - t1, waited)
            log.info("%s loaded in %.2f s (waited %.2f s for the lease)", self.engine.name, time.monotonic() - t1, waited)
        finally:
            self.loading = False
            self.on_health(True)
        return time.monotonic() - t0

    def _unload_locked(self) -> float:
        t0 = time.monotonic()
        self.group.broadcast_command((_UNLOAD, None))
        self.engine.unload()
        self.resident = False
        if self.lease is not None:
            self.lease.release()
        if self.metrics is not None:
            self.metrics.observe_unload(time.monotonic() - t0)
        return time.monotonic() - t0

    def _unload(self) -> float:
        if not self.resident:
            if self.lease is not None:
                self.lease.release()
            return 0.0
        return self._unload_locked()

    def _should_step_aside(self) -> bool:
        if not self.resident or self.cfg.residency != "exclusive":
            return False
        if self.lease is not None and self.lease.others_waiting():
            return True
        return self.cfg.idle_unload_s >= 0 and time.monotonic() - self._idle_since > self.cfg.idle_unload_s

    def _loop(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                if self._should_step_aside():
                    self._unload()
                continue
            if item == _EXIT:
                self._drain_queue()
                self._unload()
                self.group.broadcast_command((_EXIT, None))
                return
            if isinstance(item, tuple):  # lifecycle request
                command, done = item
                try:
                    secs = self._load() if command == _LOAD else self._unload()
                    done.put((secs, None))
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    done.put((0.0, e))
                continue
            self._run_job(item)
            self._idle_since = time.monotonic()
            # Stage-batched fairness: with others waiting and nothing queued, give the devices back now.
            if self._q.empty() and self.lease is not None and self.lease.others_waiting():
                self._unload()

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                with self._lock:
                    self._pending -= 1
                item.events.put(JobEvent("error", Unavailable(f"{self.engine.name} shut down before the job ran")))

    def _run_job(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
        job.timing["queue_s"] = time.monotonic() - job.submitted
        self.running = job
        try:
            if job.should_cancel():
                raise Cancelled(f"{self.engine.name}: job cancelled before it started")
            t0 = time.monotonic()
            if not self.resident:
                job.events.put(JobEvent("progress", dict(stage=self.engine.name, phase="loading", step=0, total=0,
                                                         elapsed_s=0.0, eta_s=0.0, step_ms=0.0, message="")))
            if self.resident:
                job.timing["load_s"] = 0.0
            else:
                self._load()
                job.timing["lease_wait_s"] = self.last_lease_wait
                job.timing["load_s"] = time.monotonic() - t0 - self.last_lease_wait
            t1 = time.monotonic()
            self.group.broadcast_command((_RUN, (job.spec, job.inputs)))
            result = self.engine.run(job.spec, job.inputs, JobContext(self.group, job, self.engine.name))
            job.timing["compute_s"] = time.monotonic() - t1
            self.jobs_done += 1
            job.events.put(JobEvent("done", result))
        except BaseException as e:  # noqa: BLE001 - every failure becomes the job's status
            code, msg = status_for(e)
            if code.name == "INTERNAL":
                log.error("%s job %s failed:\n%s", self.engine.name, job.job_id, traceback.format_exc())
            job.events.put(JobEvent("error", e))
            if self.group.world_size > 1 and not isinstance(e, (Cancelled, ValueError)):
                # A collective failed: the rank group is broken. Exit so torchrun restarts it.
                log.error("rank group failure (%s); exiting for torchrun to restart the group", msg)
                self.on_health(False)
                threading.Timer(0.5, _hard_exit).start()
        finally:
            self.running = None


def _hard_exit() -> None:
    import os

    os._exit(70)


def follower_loop(engine: Engine, group: RankGroup) -> None:
    """Ranks > 0: execute whatever rank 0 broadcasts until told to exit."""
    while True:
        command, payload = group.broadcast_command()
        if command == _EXIT:
            return
        if command == _LOAD:
            engine.load()
        elif command == _UNLOAD:
            engine.unload()
        elif command == _RUN:
            spec, inputs = payload
            try:
                engine.run(spec, inputs, JobContext(group, None, engine.name))
            except Exception:  # noqa: BLE001 - rank 0 reports the job's error; a broken group is torchrun's to restart
                log.warning("rank %d: job failed:\n%s", group.info.rank, traceback.format_exc())
