"""The render service: durable jobs in, stage batches out.

`submit` checks a request (render_svc/admission.py: the request alone, then what only the stages can tell), records
the job in the job book (render_svc/book.py over the SQLite store, render_svc/store.py) and queues it for the first
stage of its route (render_svc/graph.py). The parts, each one concern:

- the **cluster view** (render_svc/cluster.py): the stage replicas, their devices and resource groups (services that
  share a device and take its lease take turns; the others do not), the down-set, the suspects of the hung-replica
  rule (render_svc/stalls.py) and each DiT replica's affinity, fed by one Status poller;
- the **scheduler** (`planner.schedule`, pure): which batch each idle resource group runs next, on which replica;
- the **dispatcher** (render_svc/dispatcher.py): applies the assignments (one thread per batch, so groups that
  share no device run at the same time) and moves each job on as its stage call ends; with `pipeline=False`
  (--serial) all stages form one group: one batch service-wide at a time;
- the **executor** (render_svc/engine.py): runs one assignment's stage calls and decides nothing.

Cancel takes a waiting job out of the queue at once and stops a running one's stage call. A timer runs retention and
checks that the database file is still there (docs/reliability.md, "Job store").
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from h3.v1 import render_pb2
from minimax_h3.comfy.workflow import ReadInput, apply_workflow
from minimax_h3.contract import spec_from_proto
from render_svc.admission import StageChecks, check_request
from render_svc.book import JobBook
from render_svc.cluster import Cluster
from render_svc.config import SchedulerConfig
from render_svc.dispatcher import Dispatcher
from render_svc.engine import RenderEngine
from render_svc.extend import check_source, cut_guide, extension_request
from render_svc.store import (CANCELLED, FAILED, GUIDE, QUEUED, RUNNING, SOURCE, SUCCEEDED, JobStore,
                              latents_path)
from stagekit.errors import FailedPrecondition, InvalidArgument, Unavailable
from stagekit.uploads import reference_bytes


class RenderService:
    """The service's operations (submit, extend, cancel, delete, start, drain) over its parts: `book` (the jobs, the
    adapters' one view of them), `cluster`, `dispatcher`, `engine`."""

    def __init__(self, cfg: SchedulerConfig, engine: RenderEngine):
        if not cfg.stall_timeout_s > 0:
            raise FailedPrecondition(f"--stall-timeout-s must be above 0, got {cfg.stall_timeout_s:g}")
        self.cfg = cfg
        self.engine = engine
        self.stopping = threading.Event()       # SIGTERM: the drain has begun (no new batch starts)
        self._abort = threading.Event()          # the drain stops the running batch's stage calls
        self._stop = threading.Event()           # the drain is over: Submit refuses
        self.book = JobBook(JobStore(cfg.run_dir), cfg.keep_jobs, cfg.keep_bytes, cfg.keep_age_s, self.stopping)
        self.uploads = self.book.uploads
        self.cluster = Cluster(engine.replicas, threading.Condition(), cfg.pipeline)
        self.dispatcher = Dispatcher(cfg, self.book, self.cluster, engine, self.stopping, self._abort, self._stop)
        self.checks = StageChecks(self.cluster, engine.clients)
        self.started_unix = time.time()
        self._lock = self.cluster.lock
        self._thread = threading.Thread(target=self.dispatcher.run, name="render-scheduler", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        queued = self.book.recover(self.cfg.max_attempts)
        with self._lock:
            for rec in queued:
                self.dispatcher.enqueue(rec)
        self.cluster.start()
        self._thread.start()

    def shutdown(self, cancel_running: bool, grace_s: float, cancel_wait_s: float = 15.0) -> None:
        """SIGTERM (docs/reliability.md, "SIGTERM"): no new batch starts; the running one finishes within `grace_s`
        (or its stage calls are stopped now, `cancel_running`), then is stopped. Jobs that were running go back to
        the queue with their attempt given back (`store.drained`): the next start carries them on."""
        self.stopping.set()
        if cancel_running:
            self._abort.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=grace_s)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(timeout=cancel_wait_s)
        self.cluster.stop()
        self._stop.set()

    def gauges(self) -> dict[str, float]:
        """What `/metrics` reads at scrape time (stagekit.metrics): jobs queued, running and finished."""
        counts = self.book.counts()
        return {"h3_queue_depth": counts.get(QUEUED, 0), "h3_running": counts.get(RUNNING, 0),
                "h3_jobs_done": sum(counts.get(s, 0) for s in (SUCCEEDED, FAILED, CANCELLED))}

    @property
    def batches(self) -> int:
        """Batches started so far, service-wide."""
        return self.dispatcher.planner.batches

    # ---- API ----------------------------------------------------------------------------------------------------
    def submit(self, req: render_pb2.RenderRequest, owner: str = "", admin: bool = False, *, seconds: str = "",
               remixed_from: str = "", read_input: ReadInput | None = None) -> render_pb2.JobInfo:
        """Admit and queue a request of principal `owner` (an `admin` may extend anyone's job). A ComfyUI graph
        (`workflow_json`) is read first and fills the request (minimax_h3/comfy/workflow.py; `read_input` gives the
        files its loader nodes name, for ComfyUI's own routes); `seconds`, `remixed_from`: what the HTTP API records
        beside the job (JobStore.submit)."""
        # An uploaded file (Upload) is admitted like an inline one.
        for ref in [*req.references, *(getattr(g, p) for g in req.guides for p in ("image", "audio") if g.HasField(p))]:
            ref.data = reference_bytes(ref, self.uploads)
        graph_files = apply_workflow(req, read_input).files if req.workflow_json else []
        check_request(req)
        self.checks.check(req, graph_files)
        if self._stop.is_set():
            raise Unavailable("the render service is shutting down; retry on another replica or after its restart")
        files = self._extension_files(req, None if admin else owner or None) if req.extend_job_id else None
        try:
            with self._lock:
                rec, created = self.book.store.submit(req, owner or "", self.cfg.max_jobs_queued, seconds,
                                                      remixed_from, files)
                if created:
                    self.dispatcher.enqueue(rec)
                    self._lock.notify_all()
        except sqlite3.Error as e:
            raise self.book.storage_failed(e) from None
        return self.book.info(rec.id)

    def extend(self, ext: render_pb2.ExtendRequest, owner: str = "", admin: bool = False) -> render_pb2.JobInfo:
        """A new job continuing the finished job `ext.job_id` (docs/long_video.md, "Extend"): its render request is
        the source's with the extension's prompt(s) and stitched total (`render_svc.extend.extension_request`), then
        submitted as any other."""
        src = self.book.get(ext.job_id, None if admin else owner or None)
        return self.submit(extension_request(src.request, ext, src.id), owner, admin=admin)

    def _extension_files(self, req: render_pb2.RenderRequest, access: str | None) -> dict[str, Path | bytes]:
        """What an extension needs of its source job, stored with it (the source may be removed before it runs): the
        source's MP4, and the guide cut from the source's kept latents when they cover it (else the decoder
        re-encodes the guide from the MP4). NotFound / FailedPrecondition naming the source job's problem."""
        src = self.book.get(req.extend_job_id, access)
        mp4 = check_source(src.state, src.id, src.expired, src.output)
        spec, src_spec = spec_from_proto(req.params), spec_from_proto(src.request.params)
        if (spec.width, spec.height, spec.prefix_frames) != (src_spec.width, src_spec.height, src_spec.frames):
            raise InvalidArgument(f"an extension of job {src.id} continues its {src_spec.width}x{src_spec.height}x"
                                  f"{src_spec.frames} clip: prefix_frames={src_spec.frames} on its canvas")
        if (req.upscale_width, req.upscale_height) != (src.request.upscale_width, src.request.upscale_height):
            raise InvalidArgument(f"an extension keeps its source's MP4 size ({src.info().width}x{src.info().height})")
        files: dict[str, Path | bytes] = {SOURCE: mp4}
        guide = cut_guide(latents_path(mp4), spec)
        if guide is not None:
            files[GUIDE] = guide
        return files

    def cancel(self, job_id: str, owner: str | None = None) -> render_pb2.JobInfo:
        rec = self.book.get(job_id, owner)
        if rec.terminal:
            return self.book.info(job_id, rec)
        try:
            with self._lock:
                waiting_for, work = self.dispatcher.withdraw(job_id)
                if waiting_for is not None:  # not in a batch: it ends now
                    self.book.cancel_waiting(job_id, waiting_for)
                elif work is not None:       # in the running batch: its stage call stops at the next step boundary
                    work.cancel()
        except sqlite3.Error as e:
            raise self.book.storage_failed(e) from None
        if waiting_for is None and work is not None:
            self.book.wait_terminal(job_id, timeout_s=30.0)
        return self.book.info(job_id)

    def delete(self, job_id: str, owner: str | None = None) -> None:
        """Remove a job: cancelled first if it has not ended (as `cancel`, waiting up to 30 s for a running one's
        stage call to stop), then its record, events and MP4."""
        if not self.book.get(job_id, owner).terminal:
            self.cancel(job_id, owner)
        self.book.delete(job_id, owner)

    def snapshot(self, owner: str | None = None) -> dict:
        """What the web page shows: jobs (queued, running, recent finished) and the recent batches. With `owner`,
        only that principal's jobs, and in each batch only its job ids (every batch keeps its size)."""
        active = self.book.list([QUEUED, RUNNING], limit=500, oldest_first=True, owner=owner)
        recent = self.book.list([SUCCEEDED, FAILED, CANCELLED], limit=50, owner=owner)
        pos = self.book.queue_positions()
        running = sorted(({"number": b.number, "stage": b.stage, "group": b.group, "jobs": list(b.job_ids),
                           "size": len(b.job_ids), "t0": t0} for b, t0 in self.cluster.running_batches()),
                         key=lambda b: b["number"])
        batches = self.dispatcher.recent(40)
        if owner is not None:
            mine = self.book.owned({j for b in running + batches for j in b["jobs"]}, owner)
            running, batches = ([{**b, "jobs": [j for j in b["jobs"] if j in mine]} for b in bs]
                                for bs in (running, batches))
        return {"jobs": [r.info(pos.get(r.id, 0)) for r in active + recent], "running": running, "batches": batches,
                "batches_total": self.batches, "groups": self.cluster.group_names()}
