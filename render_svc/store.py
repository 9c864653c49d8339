"""Durable job records: SQLite (stdlib `sqlite3`) in the render service's run dir.

Two tables: `jobs` (one row per job: its request, state, stage, attempts, timings, output) and `events` (each job's
event log, the serialized `RenderEvent`s that Watch replays from any index). Every state change and its event are
one transaction, so a restart finds each job exactly as its last committed change left it. WAL journal with
`synchronous=FULL`: a committed change survives the process and the OS crashing.

State machine: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED (terminal). `finish` only moves a job that is
not terminal yet, so a job finishes exactly once even when a cancel races its last stage. On start-up `recover`
turns RUNNING jobs back into QUEUED ones (retried from the start, `attempts` counts the runs) or, past the attempt
limit, into FAILED; a drain (SIGTERM) hands its running jobs back to the queue without spending an attempt.

Owners: every job records the principal that submitted it (`owner`, "" without a tokens file); reads and cancels
given an owner see only that owner's jobs, and idempotency keys are per owner. Keyframe images are stored once, by
content, under `keyframes/` (never in the database, never in a queued job's memory) and removed when no unfinished
job needs them. Retention (`expire`) deletes finished jobs' rows and events beyond `--keep-jobs` / `--keep-age-s`
and their MP4s (`delete`: one finished job, on its owner's request), and the WAL is checkpointed after every finished
job, so the main database file alone holds every finished job (docs/reliability.md, "Job store").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import EXTEND, EXTEND_REENCODE, plan_windows, render_mode, spec_from_proto
from render_svc.graph import GRAPH
from stagekit.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted

QUEUED, RUNNING = render_pb2.JOB_QUEUED, render_pb2.JOB_RUNNING
SUCCEEDED, FAILED, CANCELLED = render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
DB_FILE = "render.sqlite3"
MAX_SHOWN_ID = 64            # a job id echoed in an error is cut to this many characters
MAX_EVENT_INDEX = 1 << 62    # event indexes beyond any log (SQLite integers are signed 64-bit)
CHECKPOINT_S = 1.0           # the WAL is copied into the database file at most this often while jobs finish

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
  n_events INTEGER NOT NULL DEFAULT 0,
  owner TEXT NOT NULL DEFAULT '',
  keyframes TEXT NOT NULL DEFAULT '',
  seconds TEXT NOT NULL DEFAULT '',
  remixed_from TEXT NOT NULL DEFAULT ''
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
    owner: str
    keyframes: dict[str, str]   # anchor ("first" / "last") -> content digest of the stored image
    seconds: str                # the duration the HTTP API's caller asked for, as sent ("4"); "" if frames were given
    remixed_from: str           # the job whose request this one repeats with a new prompt (the HTTP API's remix)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def plan(self) -> tuple[str, ...]:
        """The render stages the job walks (its route in render_svc/graph.py), as the scheduler's `Work.plan`."""
        extension = "" if not self.request.extend_job_id else EXTEND if GUIDE in self.keyframes else EXTEND_REENCODE
        mode = render_mode(any(a in self.keyframes for a, _ in KEYFRAME_FIELDS), bool(self.request.references),
                           extension)
        return GRAPH.route(mode)

    def info(self, queue_position: int = 0, with_prompt: bool = True) -> render_pb2.JobInfo:
        """The job as a client sees it; `with_prompt=False` (its event log) leaves the prompt out: it is in the
        request the client sent, and copying it into every event would multiply its size by the events."""
        req = self.request
        width = req.upscale_width or (req.params.width if req.params.HasField("width") else 0)
        height = req.upscale_height or (req.params.height if req.params.HasField("height") else 0)
        info = render_pb2.JobInfo(
            job_id=self.id, state=self.state, params=req.params, stage=self.stage, progress=self.progress,
            attempts=self.attempts, created_unix=self.created, started_unix=self.started,
            finished_unix=self.finished, error_code=self.error_code, error=self.error,
            output_bytes=self.output_bytes, output_expired=self.expired, events=self.n_events, stages=self.runs,
            label=req.label, width=width, height=height, queue_position=queue_position,
            references=[_without_data(r) for r in req.references],
            windows=plan_windows(spec_from_proto(req.params)).describe(), extend_job_id=req.extend_job_id)
        if not with_prompt:
            info.params.ClearField("prompt")
        return info


def _record(row: sqlite3.Row) -> JobRecord:
    progress = common_pb2.Progress.FromString(row["progress"]) if row["progress"] else common_pb2.Progress()
    runs = list(render_pb2.JobInfo.FromString(row["runs"]).stages) if row["runs"] else []
    return JobRecord(seq=row["seq"], id=row["id"], request=render_pb2.RenderRequest.FromString(row["request"]),
                     state=row["state"], stage=row["stage"], progress=progress, runs=runs, attempts=row["attempts"],
                     created=row["created"], started=row["started"], finished=row["finished"],
                     error_code=row["error_code"], error=row["error"], output=row["output"],
                     output_bytes=row["output_bytes"], expired=bool(row["expired"]), n_events=row["n_events"],
                     owner=row["owner"], keyframes=json.loads(row["keyframes"]) if row["keyframes"] else {},
                     seconds=row["seconds"], remixed_from=row["remixed_from"])


def shown_id(job_id: str) -> str:
    """A job id as an error message echoes it: quoted, and cut (a caller may send megabytes)."""
    return repr(job_id[:MAX_SHOWN_ID]) + ("..." if len(job_id) > MAX_SHOWN_ID else "")


def _idem(owner: str, key: str) -> str | None:
    """The stored idempotency key: the owner's name and the key (keys are per owner; names hold no \\x1f)."""
    return f"{owner}\x1f{key}" if key else None


KEYFRAME_FIELDS = (("first", "first_frame"), ("last", "last_frame"))
SOURCE, GUIDE = "source", "guide"  # an extension's stored files: its source's MP4, the guide cut from its latents
LATENTS_SUFFIX = ".latents.safetensors"


def latents_path(output: Path) -> Path:
    """Where a job with MP4 `output` keeps its final latents (docs/long_video.md, "Extend")."""
    return Path(output).with_suffix(LATENTS_SUFFIX)


def _without_data(ref: common_pb2.Reference) -> common_pb2.Reference:
    out = common_pb2.Reference()
    out.CopyFrom(ref)
    out.ClearField("data")
    return out


def _media(req: render_pb2.RenderRequest) -> dict[str, common_pb2.Reference]:
    """The request's media files that travel as References, by what they are: `ref{i}` for each reference, then
    `guide{g}_image` / `guide{g}_audio` for each guide's."""
    out = {f"ref{i}": ref for i, ref in enumerate(req.references)}
    for g, guide in enumerate(req.guides):
        out.update({f"guide{g}_{part}": getattr(guide, part) for part in ("image", "audio") if guide.HasField(part)})
    return out


def _without_reference_files(stored: bytes) -> bytes:
    """A finished job's stored request without its reference and guide files (up to 6 MiB each; nothing reads them
    any more); the references' thumbnails, sizes and durations stay for the web page."""
    r = render_pb2.RenderRequest.FromString(stored)
    media = _media(r)
    if not media:
        return stored
    for ref in media.values():
        ref.ClearField("data")
    return r.SerializeToString(deterministic=True)


def _without_images(req: render_pb2.RenderRequest) -> bytes:
    """The request as stored: without its keyframe images, reference and guide files (stored once, by content,
    beside the database; a reference keeps the digest that names its file)."""
    r = render_pb2.RenderRequest()
    r.CopyFrom(req)
    for _, name in KEYFRAME_FIELDS:
        r.ClearField(name)
    for ref in _media(r).values():
        if ref.data:
            ref.digest = hashlib.sha256(ref.data).hexdigest()
            ref.ClearField("data")
    return r.SerializeToString(deterministic=True)


def _files(req: render_pb2.RenderRequest) -> dict[str, bytes]:
    """The request's files by what they are: keyframe anchors, then `ref{i}` for each reference and `guide{g}_*` for
    each guide's image and sound, with their bytes."""
    out = {anchor: getattr(req, name) for anchor, name in KEYFRAME_FIELDS if getattr(req, name)}
    out.update({what: ref.data for what, ref in _media(req).items() if ref.data})
    return out


def _digests(req: render_pb2.RenderRequest) -> dict[str, str]:
    return {what: hashlib.sha256(data).hexdigest() for what, data in _files(req).items()}


def open_database(path: Path, outputs: Path) -> sqlite3.Connection:
    """The job database at `path`, checked and brought to the current schema. FailedPrecondition (one line naming
    the files) for a damaged database, or one without jobs beside MP4s of earlier jobs in `outputs`."""
    db = sqlite3.connect(str(path), check_same_thread=False)
    try:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        if (bad := db.execute("PRAGMA quick_check").fetchone()[0]) != "ok":
            raise sqlite3.DatabaseError(bad)
        db.executescript(_SCHEMA)
        have = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
        for col in ("owner", "keyframes", "seconds", "remixed_from"):  # written before these columns existed
            if col not in have:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {col} TEXT NOT NULL DEFAULT ''")
        jobs = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    except sqlite3.DatabaseError as e:
        db.close()
        raise FailedPrecondition(f"the job database {path} cannot be read ({e}); restore it from a backup, "
                                 f"or move it (and {outputs}) away to start with an empty job store") from None
    mp4s = sorted(outputs.glob("*.mp4")) if outputs.is_dir() else []
    if jobs == 0 and mp4s:
        db.close()
        raise FailedPrecondition(
            f"the job database {path} holds no jobs (deleted, emptied, or its -wal file lost) but "
            f"{outputs} holds {len(mp4s)} MP4(s) of earlier jobs; restore the database, or move "
            f"{outputs} away to start with an empty job store")
    return db


def claim_run_dir(path: Path) -> int:
    """One render service per run dir: an flock on `path` the OS drops if the holder dies."""
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


class KeptFiles:
    """The files jobs need beside their requests (keyframe images, reference and guide files, an extension's source
    MP4 and guide), stored once by content digest in one folder (the upload store's: uploaded files are there
    already). Which digests are still needed is the job store's to say (`JobStore._drop_keyframes`)."""

    def __init__(self, folder: Path):
        self.dir = folder
        self.dir.mkdir(exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.dir / digest

    def read(self, digest: str) -> bytes:
        """A stored file by its digest."""
        return self.path(digest).read_bytes()

    def keep(self, req: render_pb2.RenderRequest, files: dict[str, Path | bytes] | None = None) -> dict[str, str]:
        """Write the request's keyframe images, reference and guide files (once per content), and `files` (an
        extension's: the source's MP4, hard-linked when it shares the file system, and its guide's bytes); anchor,
        `ref{i}`, `guide{g}_*` or the `files` key -> digest."""
        digests = _digests(req)
        stored = {**_files(req), **{k: v for k, v in (files or {}).items() if isinstance(v, bytes)}}
        for what, data in stored.items():
            digests[what] = digest = digests.get(what) or hashlib.sha256(data).hexdigest()
            if not self.path(digest).exists():
                tmp = self.dir / f".{digest}.{os.getpid()}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(self.path(digest))
        for what, path in (files or {}).items():
            if isinstance(path, bytes):
                continue
            digests[what] = digest = _file_digest(path)
            target = self.path(digest)
            if not target.exists():
                tmp = self.dir / f".{digest}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                try:
                    os.link(path, tmp)
                except OSError:
                    shutil.copyfile(path, tmp)
                tmp.replace(target)
        return digests

    def request_with_files(self, rec: "JobRecord") -> render_pb2.RenderRequest:
        """A copy of the job's request with its keyframe images, reference and guide files read back (kept until the
        job ends, or while another unfinished job names them); one no longer kept is FAILED_PRECONDITION naming it,
        and so is an extension (its source clip is another job's: extend that again)."""
        if rec.request.extend_job_id:
            raise FailedPrecondition(f"job {rec.id} extends job {rec.request.extend_job_id}: its request is that "
                                     "job's clip continued; extend that job again with the new prompt instead")
        req = render_pb2.RenderRequest()
        req.CopyFrom(rec.request)
        anchors, media = dict(KEYFRAME_FIELDS), _media(req)
        for what, digest in rec.keyframes.items():  # an anchor ("first", "last"), "ref{i}" or "guide{g}_*" (`_files`)
            try:
                data = self.read(digest)
            except FileNotFoundError:
                name = (anchors[what].replace("_", " ") if what in anchors else
                        f"reference {int(what[3:]) + 1} ({media[what].kind})" if what.startswith("ref") else
                        f"guide {int(what[5:].split('_')[0]) + 1}'s {what.rsplit('_', 1)[1]}")
                raise FailedPrecondition(f"job {rec.id}'s {name} is no longer kept (a job's keyframes and reference "
                                         "files are kept until it ends); submit a new job with it instead") from None
            if what in anchors:
                setattr(req, anchors[what], data)
            else:
                media[what].data = data
        return req


class JobQueries:
    """The job database's reads (thread-safe: one connection behind `lock`; `changed` is notified after every
    committed change). `JobStore` opens the database and writes it."""

    db: sqlite3.Connection
    lock: threading.RLock
    changed: threading.Condition

    def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        """The job; `owner` given: only if it is that principal's (another's is NOT_FOUND, as an unknown id is)."""
        with self.lock:
            row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id[:MAX_SHOWN_ID + 1],)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            raise NotFound(f"no job {shown_id(job_id)} on this render service (List shows the jobs it keeps; "
                           "finished jobs are removed by --keep-jobs / --keep-age-s)")
        return _record(row)

    def list(self, states: list[int] | None = None, limit: int = 100, oldest_first: bool = False,
             owner: str | None = None, past_seq: int | None = None) -> list[JobRecord]:
        """Jobs in submission order (newest first unless `oldest_first`); `past_seq`: only those after the job of
        that `seq` in this order (a page of a listing that goes on from that job)."""
        where, args = [], []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args += list(states)
        if past_seq is not None:
            where.append(f"seq {'>' if oldest_first else '<'} ?")
            args.append(past_seq)
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        q = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        q += f" ORDER BY seq {'ASC' if oldest_first else 'DESC'} LIMIT ?"
        with self.lock:
            return [_record(r) for r in self.db.execute(q, (*args, limit)).fetchall()]

    def owned(self, job_ids: set[str], owner: str) -> set[str]:
        """Those of `job_ids` that are `owner`'s jobs."""
        ids = sorted(job_ids)
        with self.lock:
            rows = self.db.execute(f"SELECT id FROM jobs WHERE owner = ? AND id IN ({','.join('?' * len(ids))})",
                                   (owner, *ids)).fetchall()
        return {r[0] for r in rows}

    def queue_position(self, rec: JobRecord) -> int:
        """A QUEUED job's 1-based place among every queued job of the service (all owners, oldest first); 0 for a
        job that started or finished. One line for the whole service, so no two jobs share a number, as they would
        counted per stage queue (a keyframes job and a prompt-only one both first of their own)."""
        if rec.state != QUEUED:
            return 0
        with self.lock:
            return self.db.execute("SELECT COUNT(*) FROM jobs WHERE state = ? AND seq <= ?",
                                   (QUEUED, rec.seq)).fetchone()[0]

    def queue_positions(self) -> dict[str, int]:
        """`queue_position` of every QUEUED job, in one query."""
        with self.lock:
            rows = self.db.execute("SELECT id FROM jobs WHERE state = ? ORDER BY seq", (QUEUED,)).fetchall()
        return {r[0]: i + 1 for i, r in enumerate(rows)}

    def finished_since(self, t: float, limit: int = 100) -> list[JobRecord]:
        """Terminal jobs that ended at `t` (unix seconds) or later, in the order they ended."""
        with self.lock:
            rows = self.db.execute("SELECT * FROM jobs WHERE state IN (?, ?, ?) AND finished >= ? "
                                   "ORDER BY finished, seq LIMIT ?", (*TERMINAL, t, limit)).fetchall()
        return [_record(r) for r in rows]

    def counts(self) -> dict[int, int]:
        with self.lock:
            return {r[0]: r[1] for r in self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")}

    def events(self, job_id: str, from_index: int, limit: int = 1000) -> list[render_pb2.RenderEvent]:
        with self.lock:
            rows = self.db.execute("SELECT event FROM events WHERE job_id = ? AND idx >= ? ORDER BY idx LIMIT ?",
                                   (job_id, min(from_index, MAX_EVENT_INDEX), limit)).fetchall()
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

    def files_in_use(self) -> set[str]:
        """Digests of the stored files unfinished jobs name (the upload store's sweep keeps them)."""
        with self.lock:
            rows = self.db.execute("SELECT keyframes FROM jobs WHERE state IN (?, ?) AND keyframes != ''",
                                   (QUEUED, RUNNING)).fetchall()
        return {d for row in rows for d in json.loads(row[0]).values()}


class JobStore(JobQueries):
    """The job database: opened, written (each write one transaction and its event), recovered and retained.

    Opening refuses (FailedPrecondition, one line naming the files) a damaged database, and a database without jobs
    beside MP4s of earlier jobs: a deleted or emptied job store, or one whose WAL was lost, is not silently replaced
    by an empty one."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / DB_FILE
        self.outputs = self.run_dir / "outputs"
        self.files = KeptFiles(self.run_dir / "keyframes")
        self._owner = claim_run_dir(self.run_dir / "render.lock")
        self._unsaved = False       # finished jobs in the WAL only, not yet in the database file
        self._checkpointed = 0.0
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        try:
            self.db = open_database(self.path, self.outputs)
        except BaseException:
            os.close(self._owner)
            raise
        self._move_images_out()

    def _move_images_out(self) -> None:
        """Unfinished jobs recorded with their keyframe images (and reference files) inside the request (by an
        earlier version): the files go to keyframes/ like a new job's."""
        with self.lock, self.db:
            for row in self.db.execute("SELECT id, request FROM jobs WHERE state IN (?, ?) AND keyframes = ''",
                                       (QUEUED, RUNNING)).fetchall():
                req = render_pb2.RenderRequest.FromString(row["request"])
                if digests := self.files.keep(req):
                    self.db.execute("UPDATE jobs SET request = ?, keyframes = ? WHERE id = ?",
                                    (_without_images(req), json.dumps(digests), row["id"]))

    def close(self) -> None:
        with self.lock:
            self.db.close()
        os.close(self._owner)

    def checkpoint(self, unless_within_s: float = 0.0) -> None:
        """Copy the WAL into the database file and empty it: what is committed no longer depends on the -wal file.
        `unless_within_s`: not if the last one is that recent (`save_finished` does it later)."""
        with self.lock:
            if time.monotonic() - self._checkpointed < unless_within_s:
                return
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._checkpointed, self._unsaved = time.monotonic(), False

    def save_finished(self) -> None:
        """Checkpoint if a job finished since the last one (the scheduler calls it between batches and when idle)."""
        if self._unsaved:
            self.checkpoint()

    def missing(self) -> bool:
        """The database file is gone from the run dir (deleted under the running service)."""
        return not self.path.exists()

    def restore_file(self) -> None:
        """Write the open database back to its path (after it was deleted under the running service) and use it."""
        with self.lock:
            fresh = sqlite3.connect(str(self.path), check_same_thread=False)
            self.db.backup(fresh)
            self.db.close()
            fresh.row_factory = sqlite3.Row
            fresh.execute("PRAGMA journal_mode=WAL")
            fresh.execute("PRAGMA synchronous=FULL")
            self.db = fresh

    # ---- writes (each one transaction + its event) ---------------------------------------------------------------
    def _append(self, job_id: str, **event) -> None:
        """Inside a transaction: log one event for the job."""
        n = self.db.execute("SELECT n_events FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        ev = render_pb2.RenderEvent(job_id=job_id, index=n, time_unix=time.time(), **event)
        self.db.execute("INSERT INTO events (job_id, idx, event) VALUES (?, ?, ?)", (job_id, n, ev.SerializeToString()))
        self.db.execute("UPDATE jobs SET n_events = ? WHERE id = ?", (n + 1, job_id))

    def _log_info(self, job_id: str) -> None:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        self._append(job_id, job=_record(row).info(with_prompt=False))

    def _drop_keyframes(self, digests) -> None:
        """Under the lock: remove stored keyframes no unfinished job needs any more."""
        for d in set(digests):
            if self.db.execute("SELECT 1 FROM jobs WHERE state IN (?, ?) AND keyframes LIKE ? LIMIT 1",
                               (QUEUED, RUNNING, f"%{d}%")).fetchone() is None:
                self.files.path(d).unlink(missing_ok=True)

    def submit(self, req: render_pb2.RenderRequest, owner: str = "", max_queued: int = 0, seconds: str = "",
               remixed_from: str = "", files: dict[str, Path | bytes] | None = None) -> tuple[JobRecord, bool]:
        """(record, created). A known idempotency key of the same owner returns its job (created=False); the same
        key with a different request is ALREADY_EXISTS. With `max_queued`, a new job beyond that many queued ones
        is RESOURCE_EXHAUSTED (checked in the same transaction as the insert: the bound holds exactly). `seconds`
        and `remixed_from` are recorded as the HTTP API's caller gave them (JobRecord); `files`: files the job needs
        beside its request (an extension's), stored like its keyframes."""
        key = _idem(owner, req.idempotency_key)
        with self.changed:
            if key is not None:
                row = self.db.execute("SELECT * FROM jobs WHERE idem_key = ?", (key,)).fetchone()
                if row is not None:
                    rec = _record(row)
                    if _request_matches(rec, req, {k: _file_digest(p) for k, p in (files or {}).items()}):
                        return rec, False
                    raise AlreadyExists(f"idempotency key {req.idempotency_key!r} already names your job {rec.id} "
                                        "with a different request; use a new key for a new render")
            if max_queued:
                queued = self.db.execute("SELECT COUNT(*) FROM jobs WHERE state = ?", (QUEUED,)).fetchone()[0]
                if queued >= max_queued:
                    raise ResourceExhausted(f"{queued} jobs are queued (--max-jobs-queued {max_queued}); retry later")
            digests = self.files.keep(req, files)
            job_id = uuid.uuid4().hex[:16]
            with self.db:
                self.db.execute("INSERT INTO jobs (id, idem_key, request, state, created, owner, keyframes, seconds, "
                                "remixed_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                (job_id, key, _without_images(req), QUEUED, time.time(), owner,
                                 json.dumps(digests) if digests else "", seconds, remixed_from))
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
        """Move a job that is not terminal yet into a terminal state (once). False if it already was terminal.
        The WAL is checkpointed after it (within CHECKPOINT_S, or when the scheduler is next idle): a finished job
        lives in the database file itself, not only in the -wal file beside it."""
        if state not in TERMINAL:
            raise ValueError(f"finish needs a terminal state, got {render_pb2.JobState.Name(state)}")
        with self.changed:
            with self.db:
                row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None or row["state"] in TERMINAL:
                    return False
                self.db.execute(
                    "UPDATE jobs SET state = ?, finished = ?, error_code = ?, error = ?, output = ?, output_bytes = ?, "
                    "request = ? WHERE id = ?", (state, time.time(), error_code, error, output, output_bytes,
                                                 _without_reference_files(row["request"]), job_id))
                self._log_info(job_id)
            self._drop_keyframes(_record(row).keyframes.values())
            self._unsaved = True
            self.changed.notify_all()
        try:
            self.checkpoint(unless_within_s=CHECKPOINT_S)
        except sqlite3.Error:
            pass  # the job's end is committed; `save_finished` checkpoints it once writes succeed again
        return True

    def delete(self, job_id: str, owner: str | None = None) -> str:
        """Remove a finished job's record and events (`owner` given: only that principal's job, as `get`); returns
        its output path for the caller to delete once this is committed. An unfinished job is FAILED_PRECONDITION:
        cancel it first."""
        with self.changed:
            rec = self.get(job_id, owner)
            if not rec.terminal:
                state = render_pb2.JobState.Name(rec.state)
                raise FailedPrecondition(f"job {rec.id} has not ended ({state}): it can be deleted once it is "
                                         "cancelled (a running stage call stops at its next step boundary); retry then")
            with self.db:
                self.db.execute("DELETE FROM events WHERE job_id = ?", (rec.id,))
                self.db.execute("DELETE FROM jobs WHERE id = ?", (rec.id,))
            self._drop_keyframes(rec.keyframes.values())
            self._unsaved = True
            self.changed.notify_all()
            return rec.output

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

    def drained(self) -> list[str]:
        """A drain (SIGTERM) stopped the running jobs: back to QUEUED with the attempt given back (the service,
        not the job, ended the run). Returns their ids."""
        ids = []
        with self.changed:
            for rec in self.list([RUNNING], limit=1 << 30, oldest_first=True):
                with self.db:
                    self.db.execute("UPDATE jobs SET state = ?, stage = '', attempts = MAX(attempts - 1, 0) "
                                    "WHERE id = ?", (QUEUED, rec.id))
                    self._append(rec.id, progress=common_pb2.Progress(
                        stage="render", phase="requeued",
                        message="the render service is restarting (drain); the job runs again after the restart "
                                "(no attempt spent)"))
                    self._log_info(rec.id)
                ids.append(rec.id)
            self.checkpoint()
            self.changed.notify_all()
        return ids

    def expire(self, keep_jobs: int, keep_bytes: int, keep_age_s: float) -> list[str]:
        """Retention (0 = no limit on that axis): finished jobs beyond the newest `keep_jobs`, or finished more than
        `keep_age_s` ago, are deleted (row and events); the MP4s of the kept ones beyond `keep_bytes` (oldest first,
        never the newest; a job's kept latents count with its MP4) are marked expired. Returns the paths to delete
        (after the commit): each MP4 and its latents."""
        now = time.time()
        with self.changed:
            rows = self.db.execute("SELECT id, output, output_bytes, finished, expired, state FROM jobs "
                                   "WHERE state IN (?, ?, ?) ORDER BY finished DESC, seq DESC", TERMINAL).fetchall()
            delete, expire, total = [], [], 0
            for k, r in enumerate(rows):
                if (keep_jobs and k >= keep_jobs) or (keep_age_s and now - r["finished"] > keep_age_s):
                    delete.append(r)
                    continue
                if r["state"] == SUCCEEDED and not r["expired"] and r["output"]:
                    total += r["output_bytes"] + _size(latents_path(Path(r["output"])))
                    if keep_bytes and total > keep_bytes and k > 0:
                        expire.append(r)
            if delete or expire:
                with self.db:
                    for i in range(0, len(delete), 500):
                        ids = [(r["id"],) for r in delete[i:i + 500]]
                        self.db.executemany("DELETE FROM events WHERE job_id = ?", ids)
                        self.db.executemany("DELETE FROM jobs WHERE id = ?", ids)
                    self.db.executemany("UPDATE jobs SET expired = 1 WHERE id = ?", [(r["id"],) for r in expire])
                self.changed.notify_all()
            return [p for r in delete + expire if r["output"]
                    for p in (r["output"], str(latents_path(Path(r["output"]))))]


def _request_matches(rec: JobRecord, req: render_pb2.RenderRequest, files: dict[str, str]) -> bool:
    """Same render? The stored request holds no keyframe images: compare it without them, and their digests (and
    those of the files beside it)."""
    return (rec.request.SerializeToString(deterministic=True) == _without_images(req)
            and rec.keyframes == {**_digests(req), **files})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _file_digest(path: Path | bytes) -> str:
    if isinstance(path, bytes):
        return hashlib.sha256(path).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
