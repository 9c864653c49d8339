"""The job runtime every stage shares: queue, residency, lease, rank fan-out, progress.

A stage supplies a `StageEngine` (stagekit/engine.py: load / unload / run on every rank, and its hooks). The leader's
`StageRuntime` owns one worker thread that takes jobs FIFO from a bounded queue,
makes the engine resident (taking the device lease first in exclusive mode, or
reserving room in the per-device memory budget in shared mode), broadcasts the
job to the follower ranks, runs it, and streams progress back to the waiting
RPC. Queued jobs are served in one residency (stage-batched scheduling); when
another stage waits for the devices the stage gives them back as soon as its
queue runs dry, or after `max_batch_before_yield` jobs, so nobody starves. An
idle exclusive stage also unloads after `idle_unload_s`. Jobs whose memory
estimate can never fit the budget are refused at submit (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic

from stagekit.checkpoints import WeightSource
from stagekit.dist import RankGroup
from stagekit.engine import Spec, StageEngine
from stagekit.errors import (Cancelled, DeadlineExceeded, ResourceExhausted, StageError, Unavailable, restarts_group,
                             status_for)
from stagekit.file_identity import FileIdentity, identify
from stagekit.hosts import HOST_COMMAND
from stagekit.lease import DeviceLease, RankHold

if TYPE_CHECKING:
    from stagekit.budget import MemoryBudget
    from stagekit.hosts import HostResources

log = logging.getLogger("stagekit.runtime")


def release_device_memory(device: str) -> None:
    """After an engine drops its weights: collect them now and return cached CUDA blocks, so the next stage on this
    GPU (which waits on the lease for exactly this) finds the memory free."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


RESIDENCIES = ("exclusive", "shared")  # take turns on the devices | stay resident within a memory budget


@dataclass
class RuntimeConfig:
    max_queue: int = 16             # jobs waiting beyond this are refused with RESOURCE_EXHAUSTED
    idle_unload_s: float = 30.0     # unload after this long idle (exclusive mode); <0 = never
    residency: str = "exclusive"    # "exclusive" | "shared"
    lease_timeout_s: float = 600.0  # give up waiting for the devices (lease or budget room) after this long
    max_batch_before_yield: int = 8  # with another stage waiting, serve at most this many queued jobs, then yield

    def validate(self) -> None:
        if self.residency not in RESIDENCIES:
            raise ValueError(f"residency must be 'exclusive' or 'shared', got {self.residency!r}")
        if self.max_batch_before_yield < 1:
            raise ValueError(f"max_batch_before_yield must be >= 1, got {self.max_batch_before_yield}")


@dataclass
class JobEvent:
    kind: str            # "progress" | "done" | "error"
    payload: Any = None


@dataclass(frozen=True)
class RuntimeSnapshot:
    """The runtime's state at one moment, as Status and /metrics report it (`StageRuntime.snapshot`)."""

    resident: bool
    loading: bool
    queue_depth: int
    running: bool
    jobs_done: int
    lease_holder: str  # who holds our devices' lease ("" when free, or no lease in shared residency)
    loaded_files: dict[str, FileIdentity]  # the weight files of the last load, as they were when it began


class ShutdownCancel(Unavailable):
    """A job the stage cancelled because it is shutting down (SIGTERM): UNAVAILABLE, retryable elsewhere."""


@dataclass
class Job(Generic[Spec]):
    spec: Spec
    inputs: dict
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    deadline: float | None = None            # time.monotonic() deadline
    submitted: float = field(default_factory=time.monotonic)
    events: "queue.Queue[JobEvent]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timing: dict = field(default_factory=dict)
    estimate_bytes: int = 0                   # per-device peak (weights + activations), set at submit
    # Runs on the worker thread (rank 0) just before the job, and its dict joins `inputs`: work that must wait for
    # admission, e.g. decoding keyframe images (one at a time, counted in `input_bytes`, never in a handler thread).
    prepare: Callable[[], dict] | None = None
    input_bytes: int = 0                      # bytes `prepare` will hold, added to the job's memory estimate
    cleanup: Callable[[Any], None] | None = None  # frees a result nobody will read (the decoder's temp file)
    cancel_reason: StageError | None = None   # raised at the next step boundary instead of a plain Cancelled
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = False                     # the RPC is over: nobody reads events any more
    _started: bool = False

    def cancel(self, reason: StageError | None = None) -> None:
        if reason is not None and self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancelled.set()

    def should_cancel(self) -> bool:
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)

    def close(self) -> None:
        """The RPC is over (done, failed, or the client left): cancel; a job that has not started drops its inputs
        now (a queued upload's memory is not kept until the worker reaches it); a result already delivered but
        never read is cleaned up."""
        with self._lock:
            self._closed = True
            self.cancelled.set()
            if not self._started:
                self.inputs, self.prepare = {}, None
            unread = []
            while True:
                try:
                    unread.append(self.events.get_nowait())
                except queue.Empty:
                    break
        for ev in unread:
            self._discard(ev)

    def begin(self) -> bool:
        """The worker takes the job; False when its RPC is already over (nothing to run)."""
        with self._lock:
            if self._closed:
                return False
            self._started = True
            return True

    def deliver(self, ev: JobEvent) -> None:
        """Hand the job's outcome to its RPC, or clean it up when the RPC is gone."""
        with self._lock:
            if not self._closed:
                self.events.put(ev)
                return
        self._discard(ev)

    def _discard(self, ev: JobEvent) -> None:
        if ev.kind == "done" and self.cleanup is not None:
            self.cleanup(ev.payload)


class JobContext:
    """Handed to `StageEngine.run` on every rank: agreed cancellation and progress reporting."""

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
            if self.job is not None and self.job.cancel_reason is not None:
                raise self.job.cancel_reason
            raise Cancelled(f"{self.stage}: job cancelled (client cancel, disconnect or deadline)")

    def check_cancel_local(self) -> None:
        """For work rank 0 does alone, outside any collective (the decoder's mux after the gather): raise if the job
        was cancelled. Followers (no job) never raise."""
        if self.job is not None and self.job.should_cancel():
            raise self.job.cancel_reason or Cancelled(f"{self.stage}: job cancelled (client cancel, disconnect or "
                                                      "deadline)")

    def progress(self, step: int, total: int, phase: str = "running", message: str = "", step_ms: float = 0.0) -> None:
        if self.job is None:  # followers report nothing
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed / step * (total - step) if step > 0 and total >= step else 0.0
        self.job.events.put(JobEvent("progress", dict(
            stage=self.stage, phase=phase, step=step, total=total, elapsed_s=elapsed, eta_s=eta,
            step_ms=step_ms, message=message)))


# Why a stage unloads: the `reason` of its unload_start / unloaded events, and its log line.
UNLOAD_REASONS = MappingProxyType({
    "others_waiting": "another stage waits for these devices and this queue is empty",
    "yield": "another stage waits for these devices and this stage served its batch (--max-batch-before-yield)",
    "idle": "idle for --idle-unload-s (exclusive residency)",
    "grow": "the next job needs more budget room than is free beside the other stages; re-reserving while holding "
            "nothing",
    "request": "an operator's Unload",
    "load_failed": "the load failed",
    "files": "the next job needs other weight files than the loaded ones (another partition); loading those, the "
             "devices kept",
    "worker_lost": "the device worker died",
    "shutdown": "the stage is shutting down",
})

# Commands the leader broadcasts to followers.
_LOAD, _UNLOAD, _RUN, _EXIT = "load", "unload", "run", "exit"


class StageRuntime:
    """Leader-side scheduler. Thread-safe `submit`; one worker thread does the work.

    Residency, per `cfg.residency`:
    - exclusive: the device lease is taken before `engine.load` and given back after `engine.unload`; the
      stage unloads when idle for `idle_unload_s`, when it runs dry while another stage waits, or after
      `max_batch_before_yield` jobs in a row while another stage waits (so no job starves).
    - shared: no lease; before loading, the stage reserves weights + peak activations in the per-device
      memory budget (`budget`) and releases the reservation after unloading. It stays resident until a
      stage waiting for budget room needs it to step aside (same batch / yield rules as above).
    Every load/unload is written to the host-wide event log (`load_start`, `loaded`, `unload_start`,
    `unloaded`, `yield`) next to the lease's acquire/release and the budget's reservations.

    `hold` is rank 0's own claim on its device while it holds weights (exclusive mode; every follower takes its
    own, see `follower_loop`), so a device is free only once every rank on it has let go. `follower_pids` are the
    follower ranks on this host: when the group breaks they are killed at once, so torchrun restarts the group
    without waiting out its 30 s stop grace on a hung (or SIGTERM-ignoring) rank.
    """

    def __init__(self, engine: StageEngine, group: RankGroup, lease: DeviceLease | None, cfg: RuntimeConfig,
                 on_health: Callable[[bool], None] = lambda serving: None, metrics: Any = None,
                 budget: "MemoryBudget | None" = None, hold: RankHold | None = None,
                 follower_pids: tuple[int, ...] = ()):
        cfg.validate()
        self.engine = engine
        self.hold = hold
        self.follower_pids = tuple(follower_pids)
        self.group = group
        self.lease = lease
        self.cfg = cfg
        self.on_health = on_health
        self.metrics = metrics
        self.budget = budget
        self.events = lease.events if lease is not None else (budget.events if budget is not None else None)
        self.resident = False
        self.loading = False
        self.jobs_done = 0
        self.loads = 0                 # residencies so far (each one is a swap-in)
        self.loaded_files: dict[str, FileIdentity] = {}  # the engine's weight files as the last load found them
        self._files: tuple[Path, ...] = ()  # the files the engine holds now (those of its last load)
        self.last_lease_wait = 0.0
        self.running: Job | None = None
        self._served = 0               # jobs served in the current residency
        self._measured = 0             # resident bytes seen at the last load (engines without an estimate hook)
        self._q: "queue.Queue[Job | str]" = queue.Queue()
        self._pending = 0
        # Guards the queue count and every change of the state `snapshot` reports (a job taken / finished,
        # resident, the lease given back), so a snapshot never mixes the moments before and after one change.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._idle_since = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"{engine.name}-runtime", daemon=True)
        self._thread.start()

    # ---- leader API -------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def exclusive(self) -> bool:
        return self.cfg.residency == "exclusive"

    def snapshot(self) -> RuntimeSnapshot:
        """One consistent view: never "not resident" beside our own lease, a job delivered but still running, or a
        job taken from the queue but not yet running (docs/testing.md, "Status is one moment")."""
        with self._lock:
            return RuntimeSnapshot(resident=self.resident, loading=self.loading, queue_depth=self._pending,
                                   running=self.running is not None, jobs_done=self.jobs_done,
                                   lease_holder=self.lease.holders() if self.lease is not None else "",
                                   loaded_files=self.loaded_files)

    def estimate_bytes(self, spec: Spec | None, inputs: dict | None = None) -> int:
        """Per-device peak bytes of a job (weights + activations) from the engine's hook; 0 if it has none.

        `spec=None` asks for the weights alone (an operator's Load before any job)."""
        est = self.engine.estimate_peak_bytes(spec, inputs or {})
        return int(est) if est is not None else 0

    def _refuse_if_closed(self) -> None:
        if self._stop.is_set():
            raise Unavailable(f"{self.engine.name} is shutting down; retry on another replica")
        if self._pending >= self.cfg.max_queue:
            raise ResourceExhausted(
                f"{self.engine.name} queue is full ({self._pending} jobs waiting, limit {self.cfg.max_queue}); retry later")

    def submit(self, job: Job) -> Job:
        with self._lock:
            self._refuse_if_closed()
        # Admission by memory: a job that could never fit the device is refused now, not after a swap. Inputs the
        # job decodes once admitted (keyframe images) count too.
        job.estimate_bytes = self.estimate_bytes(job.spec, job.inputs) + job.input_bytes
        if self.budget is not None:
            self.budget.check_fits(job.estimate_bytes, f"{self.engine.name} job {job.job_id}")
        with self._lock:  # checked again: a shutdown may have begun meanwhile, and must not miss this job
            self._refuse_if_closed()
            self._pending += 1
            depth = self._pending
            job.events.put(JobEvent("progress", dict(stage=self.engine.name, phase="queued", step=0, total=0,
                                                     elapsed_s=0.0, eta_s=0.0, step_ms=0.0,
                                                     message=f"{depth} in queue")))
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

    @property
    def stopping(self) -> bool:
        """SIGTERM arrived: the runtime takes no more jobs."""
        return self._stop.is_set()

    def shutdown(self, cancel_running: bool, grace_s: float, cancel_wait_s: float = 15.0) -> None:
        """SIGTERM (docs/reliability.md, "SIGTERM"): stop taking jobs; fail the queued ones now with UNAVAILABLE
        (they never started, so a retry elsewhere is safe); let the running one finish within `grace_s` (or
        cancel it now), then cancel it at its next step boundary, also UNAVAILABLE; unload; release followers."""
        name = self.engine.name
        with self._lock:
            self._stop.set()
        self._drain_queue(f"{name} is shutting down (SIGTERM): the job was queued and never started; retry it on "
                          "another replica or once the stage is back")
        self._q.put(_EXIT)
        job = self.running
        if cancel_running and job is not None:
            job.cancel(ShutdownCancel(f"{name} is shutting down (SIGTERM, --cancel-on-term): the running job was "
                                      "cancelled; retry it on another replica or once the stage is back"))
        self._thread.join(timeout=grace_s)
        job = self.running
        if self._thread.is_alive() and job is not None:
            job.cancel(ShutdownCancel(f"{name} is shutting down (SIGTERM): the job did not finish within the "
                                      f"{grace_s:g} s drain (--drain-s) and was cancelled; retry it on another "
                                      "replica or once the stage is back"))
            self._thread.join(timeout=cancel_wait_s)

    # ---- worker thread ------------------------------------------------------------------------
    def _log(self, event: str, **extra) -> None:
        if self.events is not None:
            ids = self.lease.ids if self.lease is not None else self.budget.ids
            self.events.write(event, stage=self.engine.name, devices=ids, residency=self.cfg.residency, **extra)

    def _load(self, need_bytes: int = 0, spec: Spec | None = None, files: tuple[Path, ...] | None = None,
              cancelled: Callable[[], bool] | None = None) -> float:
        """Take the devices (lease, or budget room in shared mode), then load `files` (the engine's `weight_files`
        when None; for the job `spec` when given) unless `cancelled()` says the job's client left while we waited:
        then the devices go back unloaded (raises Cancelled). Returns seconds taken."""
        if self.resident:
            return 0.0
        t0 = time.monotonic()
        waited = 0.0
        try:
            if self.exclusive and self.lease is not None:
                try:
                    waited = self.lease.acquire(timeout_s=self.cfg.lease_timeout_s)
                except TimeoutError as e:  # out of time waiting in line: no rank has done anything, no restart
                    raise DeadlineExceeded(f"{self.engine.name}: {e} (--lease-timeout-s)") from None
            elif not self.exclusive and self.budget is not None:
                waited = self.budget.reserve(self._reservation(need_bytes), timeout_s=self.cfg.lease_timeout_s)
            self.last_lease_wait = waited
            if cancelled is not None and cancelled():  # no weights (and no swap) for a client that is gone
                raise Cancelled(f"{self.engine.name}: job cancelled while it waited for the devices")
            self._load_weights(waited, spec, tuple(self.engine.weight_files()) if files is None else files)
        except BaseException:
            if not self.resident:
                self._give_back()
            raise
        return time.monotonic() - t0

    def _load_weights(self, waited: float, spec: Spec | None, files: tuple[Path, ...]) -> None:
        """Load `files` on every rank (the devices are ours), for the job `spec` when given."""
        # Health is NOT_SERVING only while weights are actually loading (not while waiting in line).
        self.loading = True
        self.on_health(False)
        try:
            self._log("load_start", waited_s=waited)
            t1 = time.monotonic()
            if self.exclusive and self.hold is not None:
                self.hold.take()
            self.group.broadcast_command((_LOAD, (spec, files)))
            # Before the load reads them: a file replaced while it loads shows as replaced, never as the one loaded.
            read = identify(files)
            try:
                load_engine(self.engine, WeightSource(files), spec)
            except BaseException:
                self._unload_locked("load_failed")
                raise
            with self._lock:
                self.resident = True
                self.loaded_files = read
                self._files = files
            if not self.exclusive and self.budget is not None and not self._has_estimate:
                # No estimate hook: the first load reserved the worst case; keep what was actually loaded.
                self._measured = self.engine.resident_bytes()
                self.budget.shrink(self._measured)
            self.loads += 1
            self._served = 0
            load_s = time.monotonic() - t1
            self._log("loaded", load_s=load_s, bytes=self.engine.resident_bytes(),
                      reserved=self.budget.reserved if self.budget is not None else 0, **self.engine.load_report())
            if self.metrics is not None:
                self.metrics.observe_load(load_s, waited)
            log.info("%s loaded in %.2f s (waited %.2f s for the devices)", self.engine.name, load_s, waited)
        finally:
            self.loading = False
            self.on_health(True)

    @property
    def _has_estimate(self) -> bool:
        return self.engine.estimate_peak_bytes(None, {}) is not None

    def _reservation(self, need_bytes: int) -> int:
        """Bytes to reserve before loading in shared mode.

        With the engine's estimate: the job's peak (or the weights alone for an operator's Load). Without one,
        later loads reserve the measured resident bytes; the first reserves the engine's `weight_bytes()` from
        its headers, or, lacking that too, the whole budget (it waits until it would fit alone, and every idle
        stage on its devices steps aside for it)."""
        if self._has_estimate:
            return max(need_bytes, self.estimate_bytes(None))
        if self._measured:
            return self._measured
        hint = self.engine.weight_bytes()
        return int(hint) if hint is not None else self.budget.cfg.budget_bytes

    def _give_back(self) -> None:
        with self._lock:  # one change for `snapshot`, together with `resident` turning false (_unload_locked)
            if self.hold is not None:
                self.hold.release()
            if self.lease is not None:
                self.lease.release()
            if self.budget is not None:
                self.budget.release()

    def _unload_locked(self, reason: str, keep_devices: bool = False) -> float:
        """Unload for `reason` (one of UNLOAD_REASONS: it goes into the event log and the stage's log); the lease or
        budget room is given back unless `keep_devices` (the next load follows at once)."""
        t0 = time.monotonic()
        log.info("%s unloading: %s", self.engine.name, UNLOAD_REASONS[reason])
        self._log("unload_start", served=self._served, reason=reason)
        self.group.broadcast_command((_UNLOAD, None))
        self.engine.unload()
        unload_s = time.monotonic() - t0
        self._log("unloaded", unload_s=unload_s, served=self._served, reason=reason)
        if self.metrics is not None:
            self.metrics.observe_unload(unload_s)
        # Held until after the weights are gone: the next holder never overlaps us. "Not resident" and the lease
        # given back are one change under the lock (`snapshot` never shows one without the other), and `resident`
        # is false before the next holder can take the lease.
        with self._lock:
            self.resident = False
            if not keep_devices:
                self._give_back()
        return unload_s

    def _unload(self, reason: str) -> float:
        if not self.resident:
            self._give_back()
            return 0.0
        return self._unload_locked(reason)

    def _others_waiting(self) -> bool:
        """Another stage wants our devices: the lease (exclusive) or budget room (shared)."""
        if self.exclusive:
            return self.lease is not None and self.lease.others_waiting()
        return self.budget is not None and self.budget.others_waiting()

    def _step_aside_reason(self) -> str | None:
        """Idle (queue empty): give the devices back when someone waits, or after the idle timeout (exclusive)."""
        if not self.resident:
            return None
        if self._others_waiting():
            return "others_waiting"
        if self.exclusive and self.cfg.idle_unload_s >= 0 \
                and time.monotonic() - self._idle_since > self.cfg.idle_unload_s:
            return "idle"
        return None

    def _loop(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                try:
                    reason = self._step_aside_reason()
                    if reason is not None:
                        self._unload(reason)
                except Exception as e:  # noqa: BLE001 - asking another host's ranks (stagekit/hosts.py) failed
                    if self.group.world_size == 1:
                        raise
                    self._group_broken(status_for(e)[1])
                    return
                continue
            if item == _EXIT:
                self._drain_queue(f"{self.engine.name} shut down before the job ran")
                self._unload("shutdown")
                self.group.broadcast_command((_EXIT, None))
                return
            if isinstance(item, tuple):  # lifecycle request
                command, done = item
                try:
                    secs = self._load() if command == _LOAD else self._unload("request")
                    done.put((secs, None))
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    done.put((0.0, e))
                self._idle_since = time.monotonic()
                continue
            self._run_job(item)
            self._idle_since = time.monotonic()
            # Stage-batched with FIFO fairness: keep serving our queue in this residency, but when another
            # stage waits, give the devices back once we run dry or have served max_batch_before_yield jobs.
            if self.resident and self.engine.lost():
                self._unload("worker_lost")
            elif self.resident and self._others_waiting():
                if self._pending == 0:
                    self._unload("others_waiting")
                elif self._served >= self.cfg.max_batch_before_yield:
                    self._log("yield", served=self._served, queued=self._pending)
                    self._unload("yield")

    def _drain_queue(self, why: str) -> None:
        """Fail everything queued (jobs and Load/Unload requests) with UNAVAILABLE `why`; keeps an _EXIT."""
        keep = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                with self._lock:
                    self._pending -= 1
                item.deliver(JobEvent("error", Unavailable(why)))
            elif isinstance(item, tuple):
                item[1].put((0.0, Unavailable(why)))
            else:
                keep.append(item)
        for item in keep:
            self._q.put(item)

    def _ensure_room(self, job: Job) -> None:
        """Shared mode: a job needing more activation room than reserved grows the reservation, or re-loads.

        Growing never waits (we hold weights); if it does not fit now we unload and reserve afresh while
        holding nothing, so two resident stages can never wait on each other.
        """
        if self.exclusive or self.budget is None or not self.resident:
            return
        if self.budget.try_grow(job.estimate_bytes):
            return
        self._unload("grow")

    def _run_job(self, job: Job) -> None:
        with self._lock:  # taken from the queue and running: one change for `snapshot`
            self._pending -= 1
            if not job.begin():  # its RPC is over: nobody waits for it
                return
            self.running = job
        job.timing["queue_s"] = time.monotonic() - job.submitted
        broken_group: str | None = None  # why the rank group broke, when it did
        try:
            if job.should_cancel():
                raise job.cancel_reason or Cancelled(f"{self.engine.name}: job cancelled before it started")
            if job.prepare is not None:
                job.inputs.update(job.prepare())
                job.prepare = None
            t0 = time.monotonic()
            self._ensure_room(job)
            files = tuple(self.engine.weight_files(job.spec, job.inputs))
            switch = self.resident and files != self._files  # another partition: loaded in place of this one
            if switch:
                self._unload_locked("files", keep_devices=True)
            if self.resident:
                job.timing["load_s"] = 0.0
            else:
                job.events.put(JobEvent("progress", dict(stage=self.engine.name, phase="loading", step=0, total=0,
                                                         elapsed_s=0.0, eta_s=0.0, step_ms=0.0, message="")))
                spec = job.spec if self.exclusive else None
                if switch:
                    self.last_lease_wait = 0.0
                    self._load_weights(0.0, spec, files)
                else:
                    self._load(job.estimate_bytes, spec, files, job.should_cancel)
                job.timing["lease_wait_s"] = self.last_lease_wait
                job.timing["load_s"] = time.monotonic() - t0 - self.last_lease_wait
            t1 = time.monotonic()
            self._log("job_start", job=job.job_id)
            self.group.broadcast_command((_RUN, (job.spec, job.inputs)))
            try:
                result = self.engine.run(job.spec, job.inputs, JobContext(self.group, job, self.engine.name))
            finally:
                self._served += 1
            self.engine.on_result(job.spec, result)
            job.timing["compute_s"] = time.monotonic() - t1
            self._log("job_done", job=job.job_id)
            outcome = JobEvent("done", result)
        except BaseException as e:  # noqa: BLE001 - every failure becomes the job's status
            reason = job.cancel_reason
            if reason is not None and isinstance(e, Cancelled):  # an engine's own cancellation: report why it was
                e = type(reason)(f"{reason.message} ({e.message})")
            code, msg = status_for(e)
            if code.name == "INTERNAL":
                log.error("%s job %s failed: %s", self.engine.name, job.job_id, msg)  # status_for logged the traceback
            outcome = JobEvent("error", e)
            if self.group.world_size > 1 and restarts_group(e):
                broken_group = msg  # a fault: the ranks' state is unknown; exit (below) so torchrun restarts the group
        # The job is over for the runtime before its client hears so: a client holding the outcome never sees it
        # still running in Status, nor jobs_done without it.
        with self._lock:
            self.running = None
            self.jobs_done += outcome.kind == "done"
        job.inputs = {}
        job.deliver(outcome)
        if broken_group is not None:
            self._group_broken(broken_group)

    def _group_broken(self, why: str) -> None:
        """The ranks' state is unknown (a dead peer, a failed collective): exit so torchrun restarts the group."""
        log.error("rank group failure (%s); exiting for torchrun to restart the group", why)
        self.on_health(False)
        self._kill_followers()
        threading.Timer(0.5, _hard_exit).start()

    def _kill_followers(self) -> None:
        """SIGKILL this host's follower ranks: a hung one would hold the restart for torchrun's whole stop grace
        (followers ignore SIGTERM so that rank 0 alone decides how a drain ends)."""
        for pid in self.follower_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.follower_pids:
            log.error("killed follower ranks %s so the group restarts now", list(self.follower_pids))


def load_engine(engine: StageEngine[Spec], source: WeightSource, spec: Spec | None = None) -> None:
    """Everything, or only what the job `spec` needs (the engine's `load_for`), from `source`."""
    if spec is not None:
        engine.load_for(spec, source)
    else:
        engine.load(source)


def _hard_exit() -> None:
    os._exit(70)


def follower_loop(engine: StageEngine, group: RankGroup, hold: RankHold | None = None,
                  host: "HostResources | None" = None) -> None:
    """Ranks > 0: execute whatever rank 0 broadcasts until told to exit. `hold` (exclusive mode) is this rank's
    claim on its own device, taken before its weights load and given back after they are gone. `host` (the first
    rank of a node other than rank 0's) is its host's lease and budget, taken and given back on rank 0's host
    commands (stagekit/hosts.py); every rank answers those, the others with None."""
    while True:
        command, payload = group.broadcast_command()
        if command == _EXIT:
            if hold is not None:
                hold.release()
            if host is not None:
                host.release_all()
            return
        if command == HOST_COMMAND:
            group.gather_objects(host.handle(*payload) if host is not None else None)
            continue
        # Rank 0 reports every failure to the caller (a bad file fails the same way on every rank); followers log
        # it and stay in step. A broken group (a dead peer) is torchrun's to restart.
        try:
            if command == _LOAD:
                if hold is not None:
                    hold.take()
                spec, files = payload
                load_engine(engine, WeightSource(files), spec)
            elif command == _UNLOAD:
                try:
                    engine.unload()
                finally:
                    if hold is not None:
                        hold.release()
            elif command == _RUN:
                spec, inputs = payload
                engine.run(spec, inputs, JobContext(group, None, engine.name))
        except Exception:  # noqa: BLE001
            log.warning("rank %d: %s failed:\n%s", group.info.rank, command, traceback.format_exc())
