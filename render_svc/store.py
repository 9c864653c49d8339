"""Durable job records: SQLite (stdlib `sqlite3`) in the render service's run dir.

Two tables: `jobs` (one row per job: its request, state, stage, attempts, timings, output) and `events` (each job's
event log, the serialized `RenderEvent`s that Watch replays from any index). Every state change and its event are
one transaction, so a restart finds each job exactly as its last committed change left it. WAL journal with
`synchronous=FULL`: a committed change survives the process and the OS crashing.

State machine: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED (terminal). `finish` only moves a job that is
not terminal yet, so a job finishes exactly once even when a cancel races its last stage. On start-up `recover`
turns RUNNING jobs back into QUEUED ones (retried from the start, `attempts` counts the runs) or, past the attempt
limit, into FAILED.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from h3.v1 import common_pb2, render_pb2
from stagekit.errors import AlreadyExists, FailedPrecondition, NotFound

QUEUED, RUNNING = render_pb2.JOB_QUEUED, render_pb2.JOB_RUNNING
SUCCEEDED, FAILED, CANCELLED = render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
DB_FILE = "render.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  idem_key TEXT UNIQUE,
  request BLOB NOT NULL,
  state INTEGER NOT NULL,
  stage TEXT NOT NULL DEFAULT '',
  progress BLOB,
  runs BLOB,
  attempts INTEGER NOT NULL DEFAULT 0,
  created REAL NOT NULL,
  started REAL NOT NULL DEFAULT 0,
  finished REAL NOT NULL DEFAULT 0,
  error_code TEXT NOT NULL DEFAULT '',
  error TEXT NOT NULL DEFAULT '',
  output TEXT NOT NULL DEFAULT '',
  output_bytes INTEGER NOT NULL DEFAULT 0,
  expired INTEGER NOT NULL DEFAULT 0,
  n_events INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL,
  idx INTEGER NOT NULL,
  event BLOB NOT NULL,
  PRIMARY KEY (job_id, idx)
);
"""


@dataclass
class JobRecord:
    seq: int
    id: str
    request: render_pb2.RenderRequest
    state: int
    stage: str
    progress: common_pb2.Progress
    runs: list[render_pb2.StageRun]
    attempts: int
    created: float
    started: float
    finished: float
    error_code: str
    error: str
    output: str
    output_bytes: int
    expired: bool
    n_events: int

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def info(self, queue_position: int = 0) -> render_pb2.JobInfo:
        req = self.request
        width = req.upscale_width or (req.params.width if req.params.HasField("width") else 0)
        height = req.upscale_height or (req.params.height if req.params.HasField("height") else 0)
        return render_pb2.JobInfo(
            job_id=self.id, state=self.state, params=req.params, stage=self.stage, progress=self.progress,
            attempts=self.attempts, created_unix=self.created, started_unix=self.started,
            finished_unix=self.finished, error_code=self.error_code, error=self.error,
            output_bytes=self.output_bytes, output_expired=self.expired, events=self.n_events, stages=self.runs,
            label=req.label, width=width, height=height, queue_position=queue_position,
            references=[_without_data(r) for r in req.references])


def _record(row: sqlite3.Row) -> JobRecord:
    progress = common_pb2.Progress.FromString(row["progress"]) if row["progress"] else common_pb2.Progress()
    runs = list(render_pb2.JobInfo.FromString(row["runs"]).stages) if row["runs"] else []
    return JobRecord(seq=row["seq"], id=row["id"], request=render_pb2.RenderRequest.FromString(row["request"]),
                     state=row["state"], stage=row["stage"], progress=progress, runs=runs, attempts=row["attempts"],
                     created=row["created"], started=row["started"], finished=row["finished"],
                     error_code=row["error_code"], error=row["error"], output=row["output"],
                     output_bytes=row["output_bytes"], expired=bool(row["expired"]), n_events=row["n_events"])


def _without_data(ref: common_pb2.Reference) -> common_pb2.Reference:
    out = common_pb2.Reference()
    out.CopyFrom(ref)
    out.ClearField("data")
    return out


def _without_images(req: render_pb2.RenderRequest) -> bytes:
    """A finished job's request, minus the keyframe images and the reference files (up to 6 MiB each; nothing reads
    them any more; the references' thumbnails and durations stay)."""
    r = render_pb2.RenderRequest()
    r.CopyFrom(req)
    r.ClearField("first_frame")
    r.ClearField("last_frame")
    for ref in r.references:
        ref.ClearField("data")
    return r.SerializeToString(deterministic=True)


class JobStore:
    """Thread-safe (one connection behind a lock). `changed` is notified after every committed change."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._owner = self._claim(self.run_dir / "render.lock")
        self.db = sqlite3.connect(str(self.run_dir / DB_FILE), check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)

    @staticmethod
    def _claim(path: Path) -> int:
        """One render service per run dir: an flock the OS drops if the holder dies."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise FailedPrecondition(f"another render service (pid {holder or '?'}) uses the run dir {path.parent}; "
                                     "stop it or give this one another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def close(self) -> None:
        with self.lock:
            self.db.close()
        os.close(self._owner)

    # ---- reads --------------------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord:
        with self.lock:
            row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id!r} on this render service (List shows the jobs it keeps)")
        return _record(row)

    def list(self, states: list[int] | None = None, limit: int = 100, oldest_first: bool = False) -> list[JobRecord]:
        q = "SELECT * FROM jobs"
        args: list = []
        if states:
            q += f" WHERE state IN ({','.join('?' * len(states))})"
            args += list(states)
        q += f" ORDER BY seq {'ASC' if oldest_first else 'DESC'} LIMIT ?"
        with self.lock:
            return [_record(r) for r in self.db.execute(q, (*args, limit)).fetchall()]

    def has_key(self, key: str) -> bool:
        if not key:
            return False
        with self.lock:
            return self.db.execute("SELECT 1 FROM jobs WHERE idem_key = ?", (key,)).fetchone() is not None

    def counts(self) -> dict[int, int]:
        with self.lock:
            return {r[0]: r[1] for r in self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")}

    def events(self, job_id: str, from_index: int, limit: int = 1000) -> list[render_pb2.RenderEvent]:
        with self.lock:
            rows = self.db.execute("SELECT event FROM events WHERE job_id = ? AND idx >= ? ORDER BY idx LIMIT ?",
                                   (job_id, from_index, limit)).fetchall()
        return [render_pb2.RenderEvent.FromString(r[0]) for r in rows]

    def wait_events(self, job_id: str, from_index: int, timeout_s: float) -> list[render_pb2.RenderEvent]:
        """Events from `from_index` on; blocks up to `timeout_s` for the first one."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                evs = self.events(job_id, from_index)
                left = deadline - time.monotonic()
                if evs or left <= 0:
                    return evs
                self.changed.wait(left)

    # ---- writes (each one transaction + its event) ---------------------------------------------------------------
    def _append(self, job_id: str, **event) -> None:
        """Inside a transaction: log one event for the job."""
        n = self.db.execute("SELECT n_events FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        ev = render_pb2.RenderEvent(job_id=job_id, index=n, time_unix=time.time(), **event)
        self.db.execute("INSERT INTO events (job_id, idx, event) VALUES (?, ?, ?)", (job_id, n, ev.SerializeToString()))
        self.db.execute("UPDATE jobs SET n_events = ? WHERE id = ?", (n + 1, job_id))

    def _log_info(self, job_id: str) -> None:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        self._append(job_id, job=_record(row).info())

    def submit(self, req: render_pb2.RenderRequest) -> tuple[JobRecord, bool]:
        """(record, created). A known idempotency key returns its job (created=False); the same key with a different
        request is ALREADY_EXISTS."""
        blob = req.SerializeToString(deterministic=True)
        key = req.idempotency_key or None
        with self.changed:
            if key is not None:
                row = self.db.execute("SELECT * FROM jobs WHERE idem_key = ?", (key,)).fetchone()
                if row is not None:
                    rec = _record(row)
                    if _request_matches(rec, req):
                        return rec, False
                    raise AlreadyExists(f"idempotency key {key!r} already names job {rec.id} with a different "
                                        "request; use a new key for a new render")
            job_id = uuid.uuid4().hex[:16]
            with self.db:
                self.db.execute("INSERT INTO jobs (id, idem_key, request, state, created) VALUES (?, ?, ?, ?, ?)",
                                (job_id, key, blob, QUEUED, time.time()))
                self._log_info(job_id)
            self.changed.notify_all()
            return self.get(job_id), True

    def start(self, job_id: str, stage: str) -> bool:
        """QUEUED -> RUNNING in `stage` (one more attempt). False if the job is not queued (finished meanwhile)."""
        with self.changed:
            with self.db:
                cur = self.db.execute("UPDATE jobs SET state = ?, stage = ?, attempts = attempts + 1, started = ? "
                                      "WHERE id = ? AND state = ?", (RUNNING, stage, time.time(), job_id, QUEUED))
                if cur.rowcount != 1:
                    return False
                self._log_info(job_id)
            self.changed.notify_all()
            return True

    def set_stage(self, job_id: str, stage: str) -> None:
        with self.changed:
            with self.db:
                self.db.execute("UPDATE jobs SET stage = ? WHERE id = ?", (stage, job_id))
                self._log_info(job_id)
            self.changed.notify_all()

    def progress(self, job_id: str, p: common_pb2.Progress) -> None:
        with self.changed:
            with self.db:
                self.db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (p.SerializeToString(), job_id))
                self._append(job_id, progress=p)
            self.changed.notify_all()

    def add_run(self, job_id: str, run: render_pb2.StageRun) -> None:
        with self.changed:
            with self.db:
                row = self.db.execute("SELECT runs FROM jobs WHERE id = ?", (job_id,)).fetchone()
                info = render_pb2.JobInfo.FromString(row[0]) if row[0] else render_pb2.JobInfo()
                info.stages.append(run)
                self.db.execute("UPDATE jobs SET runs = ? WHERE id = ?", (info.SerializeToString(), job_id))
            self.changed.notify_all()

    def finish(self, job_id: str, state: int, error_code: str = "", error: str = "", output: str = "",
               output_bytes: int = 0) -> bool:
        """Move a job that is not terminal yet into a terminal state (once). False if it already was terminal."""
        if state not in TERMINAL:
            raise ValueError(f"finish needs a terminal state, got {render_pb2.JobState.Name(state)}")
        with self.changed:
            with self.db:
                row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None or row["state"] in TERMINAL:
                    return False
                self.db.execute(
                    "UPDATE jobs SET state = ?, finished = ?, error_code = ?, error = ?, output = ?, output_bytes = ?, "
                    "request = ? WHERE id = ?",
                    (state, time.time(), error_code, error, output, output_bytes, _without_images(_record(row).request),
                     job_id))
                self._log_info(job_id)
            self.changed.notify_all()
            return True

    def recover(self, max_attempts: int) -> tuple[list[str], list[str]]:
        """After a restart: RUNNING jobs are retried (back to QUEUED) while attempts < max_attempts, else FAILED.
        Returns (requeued ids, failed ids)."""
        requeued, failed = [], []
        with self.changed:
            for rec in self.list([RUNNING], limit=1 << 30, oldest_first=True):
                with self.db:
                    if rec.attempts < max_attempts:
                        self.db.execute("UPDATE jobs SET state = ?, stage = '' WHERE id = ?", (QUEUED, rec.id))
                        self._append(rec.id, progress=common_pb2.Progress(
                            stage="render", phase="requeued",
                            message=f"the render service restarted during attempt {rec.attempts}; retrying "
                                    f"(at most {max_attempts} attempts)"))
                        self._log_info(rec.id)
                        requeued.append(rec.id)
                    else:
                        self.db.execute(
                            "UPDATE jobs SET state = ?, finished = ?, error_code = 'UNAVAILABLE', error = ? WHERE id = ?",
                            (FAILED, time.time(), f"the render service restarted during each of its {rec.attempts} "
                                                  f"attempts (--max-attempts {max_attempts}); submit it again", rec.id))
                        self._log_info(rec.id)
                        failed.append(rec.id)
            self.changed.notify_all()
        return requeued, failed

    def expire(self, keep_jobs: int, keep_bytes: int, keep_age_s: float) -> list[str]:
        """Retention: mark the oldest finished outputs expired until the kept ones fit every limit (0 = no limit).
        Returns the output paths to delete (the caller deletes them after the commit)."""
        with self.changed:
            rows = self.db.execute("SELECT id, output, output_bytes, finished FROM jobs WHERE state = ? AND expired = 0 "
                                   "AND output != '' ORDER BY finished DESC", (SUCCEEDED,)).fetchall()
            now, total, drop = time.time(), 0, []
            for k, r in enumerate(rows):
                total += r["output_bytes"]
                if (keep_jobs and k >= keep_jobs) or (keep_bytes and total > keep_bytes) \
                        or (keep_age_s and now - r["finished"] > keep_age_s):
                    drop.append((r["id"], r["output"]))
            if drop:
                with self.db:
                    self.db.executemany("UPDATE jobs SET expired = 1 WHERE id = ?", [(i,) for i, _ in drop])
                self.changed.notify_all()
            return [p for _, p in drop]


def _request_matches(rec: JobRecord, req: render_pb2.RenderRequest) -> bool:
    """Same render? (A finished job's stored request no longer holds the keyframe images: compare without them.)"""
    stored = rec.request.SerializeToString(deterministic=True)
    if rec.terminal:
        return stored == _without_images(req) or stored == req.SerializeToString(deterministic=True)
    return stored == req.SerializeToString(deterministic=True)
