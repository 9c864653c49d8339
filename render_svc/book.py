"""The job book: the durable jobs (render_svc/store.py) as the rest of the render service sees them.

The adapters (the gRPC servicer, the HTTP video API, ComfyUI's routes and socket, the web page, the webhook outbox)
read jobs only through the book's view methods (`get`, `info`, `list`, `events`, ...); the dispatcher moves jobs
on through its writes, which are retried until they succeed (`durable`): a full disk or an I/O error stops the
scheduler where it is, is reported (log, Status, Submit's UNAVAILABLE) and is over once a write succeeds again
(docs/reliability.md, "Job store"). A job's end and what it does to the files are one step for every reader
(`end`); retention runs after every success and on a timer (`maintain`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

from h3.v1 import common_pb2, render_pb2
from render_svc.store import QUEUED, SUCCEEDED, JobRecord, JobStore, latents_path
from stagekit.errors import Unavailable
from stagekit.uploads import UploadStore

log = logging.getLogger("render_svc")

STORAGE_RETRY_S = 1.0         # a failed job-store write is tried again this often


class JobBook:
    """The job store with its view API, its retried writes and its retention (`keep_*`: 0 = no limit on that
    axis). `stopping`: set once the service drains (a write that keeps failing then gives up)."""

    def __init__(self, store: JobStore, keep_jobs: int = 0, keep_bytes: int = 0, keep_age_s: float = 0.0,
                 stopping: threading.Event | None = None):
        self.store = store
        self.keep = (keep_jobs, keep_bytes, keep_age_s)
        self.stopping = stopping or threading.Event()
        self.outputs = store.outputs
        self.outputs.mkdir(parents=True, exist_ok=True)
        # Uploaded reference files, kept by content with the stored keyframes (the jobs that name them keep them).
        self.uploads = UploadStore(store.files.dir.resolve(), in_use=store.files_in_use)
        self.changed = store.changed       # notified after every committed change
        self.storage_error = ""            # the job store's last failed write, until one succeeds again

    # ---- the view ------------------------------------------------------------------------------------------------
    def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        """The job; `owner` given: only if it is that principal's (another's is NOT_FOUND, as an unknown id is)."""
        return self.store.get(job_id, owner)

    def info(self, job_id: str, rec: JobRecord | None = None, owner: str | None = None) -> render_pb2.JobInfo:
        rec = rec or self.store.get(job_id, owner)
        return rec.info(self.store.queue_position(rec))

    def list(self, states: list[int] | None = None, limit: int = 100, oldest_first: bool = False,
             owner: str | None = None, past_seq: int | None = None) -> list[JobRecord]:
        return self.store.list(states, limit, oldest_first, owner, past_seq)

    def queue_position(self, rec: JobRecord) -> int:
        return self.store.queue_position(rec)

    def queue_positions(self) -> dict[str, int]:
        return self.store.queue_positions()

    def owned(self, job_ids: set[str], owner: str) -> set[str]:
        return self.store.owned(job_ids, owner)

    def counts(self) -> dict[int, int]:
        return self.store.counts()

    def events(self, job_id: str, from_index: int) -> list[render_pb2.RenderEvent]:
        return self.store.events(job_id, from_index)

    def wait_events(self, job_id: str, from_index: int, timeout_s: float) -> list[render_pb2.RenderEvent]:
        """Events from `from_index` on; blocks up to `timeout_s` for the first one."""
        return self.store.wait_events(job_id, from_index, timeout_s)

    def finished_since(self, t: float, limit: int = 100) -> list[JobRecord]:
        return self.store.finished_since(t, limit)

    def request_with_files(self, rec: JobRecord) -> render_pb2.RenderRequest:
        """The job's request with its stored files read back (`store.KeptFiles.request_with_files`)."""
        return self.store.files.request_with_files(rec)

    def wait_terminal(self, job_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self.store.get(job_id).terminal and time.monotonic() < deadline:
                self.changed.wait(0.2)

    # ---- writes --------------------------------------------------------------------------------------------------
    def storage_failed(self, e: sqlite3.Error) -> Unavailable:
        """Note a failed job-store write (reported until a write succeeds); the status a caller gets for it."""
        msg = f"the job store {self.store.path} cannot be written ({e}); free space on its disk or fix it"
        if msg != self.storage_error:
            log.error("%s; the scheduler waits and retries", msg)
        self.storage_error = msg
        return Unavailable(f"{msg}; retry later")

    def durable(self, fn, *args):
        """`fn(*args)`, a job-store write the scheduler cannot go on without: retried until it succeeds (a full
        disk stops the scheduler here, it does not end it). Unavailable once the service is stopping."""
        while True:
            try:
                out = fn(*args)
            except sqlite3.Error as e:
                self.storage_failed(e)
                if self.stopping.wait(STORAGE_RETRY_S):
                    raise Unavailable("stopping") from None
                continue
            if self.storage_error:
                log.warning("the job store takes writes again: %s is over", self.storage_error)
                self.storage_error = ""
            return out

    def progress(self, job_id: str, p: common_pb2.Progress) -> None:
        """A stage's progress: logged when the store takes it (a lost progress event costs nothing)."""
        try:
            self.store.progress(job_id, p)
        except sqlite3.Error as e:
            self.storage_failed(e)

    def end(self, job_id: str, output: Path, state: int, code: str = "", message: str = "",
            output_bytes: int = 0) -> None:
        """The job ends (once), durably. The end and what it does to the files are one step for every reader (the
        store's lock): whoever sees this job succeeded also sees the older jobs it pushed past the retention limits
        gone; whoever sees it failed or cancelled finds no MP4 of it (`output`). A job that had already ended keeps
        its output."""
        def end() -> bool:
            with self.changed:
                done = self.store.finish(job_id, state, code, message, str(output) if state == SUCCEEDED else "",
                                         output_bytes)
                if done:
                    self.expire()
                if state != SUCCEEDED and self.store.get(job_id).state != SUCCEEDED:
                    output.unlink(missing_ok=True)
                    latents_path(output).unlink(missing_ok=True)
                return done

        if self.durable(end):
            log.info("job %s %s%s", job_id, render_pb2.JobState.Name(state), f": {code} {message}" if code else "")

    def cancel_waiting(self, job_id: str, waiting_for: str) -> None:
        """A job that waited for a stage ends CANCELLED (raises sqlite3.Error: the caller reports it)."""
        if self.store.finish(job_id, render_pb2.JOB_CANCELLED, "CANCELLED", f"cancelled while waiting for the "
                                                                            f"{waiting_for}"):
            self.expire()

    def delete(self, job_id: str, owner: str | None = None) -> None:
        """Remove a finished job's record, events and MP4."""
        try:
            output = self.store.delete(job_id, owner)
        except sqlite3.Error as e:
            raise self.storage_failed(e) from None
        if output:
            Path(output).unlink(missing_ok=True)

    def expire(self) -> None:
        for path in self.store.expire(*self.keep):
            Path(path).unlink(missing_ok=True)

    def maintain(self) -> None:
        """On the retention timer: the database file still in place (else written back), then retention."""
        if self.store.missing():
            log.error("the job database %s was deleted under the running service; writing it back", self.store.path)
            self.store.restore_file()
        self.durable(self.expire)

    def recover(self, max_attempts: int) -> list[JobRecord]:
        """At start: half-received MP4s of a run that died removed, running jobs requeued (or failed past
        `max_attempts`), retention applied; the queued jobs, oldest first."""
        for stray in self.outputs.glob(".*"):
            stray.unlink(missing_ok=True)
        requeued, failed = self.store.recover(max_attempts)
        if requeued or failed:
            log.warning("recovered after restart: %d running job(s) requeued, %d failed (attempts used up)",
                        len(requeued), len(failed))
        queued = self.store.list([QUEUED], limit=1 << 30, oldest_first=True)
        self.expire()
        return queued
