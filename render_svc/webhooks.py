"""Webhooks: one signed HTTP POST per finished job (`--webhook-url`), sent from an outbox by a loop of its own.

1. **Seeing a job end.** The loop's thread waits on the job book's `changed` condition (or one second) and reads
   the jobs that ended since its watermark (`JobBook.finished_since`): every way a job ends is seen (its last
   stage, a cancel, a failure at start-up past --max-attempts) and the scheduler is never called or waited on.
2. **The outbox.** Each ended job becomes one row of `<run-dir>/webhooks.sqlite3` (WAL, synchronous=FULL) holding
   the event's exact bytes, before any attempt; the watermark is stored with it. After a crash or a restart the
   pending rows are sent again, and jobs that ended while the service was down or before their row was written are
   found again from the watermark (it trails by WATERMARK_SLACK_S): delivery is at least once; the event id
   (`webhook-id`, the same on every attempt) lets a receiver drop a repeat.
3. **Delivery.** `POST <url>` with the event JSON, signed as Standard Webhooks signs (`webhook-id`,
   `webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>`). A 2xx
   answer delivers it; anything else (an error status, a refused or timed-out connection, a redirect) is retried
   after --webhook-retry-s, doubling up to RETRY_MAX_S, until --webhook-attempts attempts were made; then the row
   is kept as failed and logged. Each attempt runs on a thread of its own, up to MAX_IN_FLIGHT at once, so a slow
   answer holds back no other event; the loop cuts an attempt (shuts its socket down) at --webhook-timeout-s after
   its start, however the receiver trickles its answer, and counts it as failed. Only the loop touches the outbox.
4. **Faults.** A URL http.client could not send (a port out of range, non-ASCII text) is refused at the start. No
   error ends the loop: a fault in one attempt fails that attempt (logged, its row's last_error); a job whose event
   cannot be built gets a failed row with the reason; an outbox error is logged and the pass tried again.

Event: `{"id": "evt_<job id>", "object": "event", "type": "video.completed" | "video.failed" | "video.cancelled",
"created_at": <the job's end, unix seconds>, "data": <the video object of the HTTP API>}`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import socket
import sqlite3
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from render_svc.http_api import video_object
from render_svc.book import JobBook
from render_svc.store import CANCELLED, FAILED, SUCCEEDED
from stagekit.errors import FailedPrecondition

log = logging.getLogger("render_svc.webhooks")

DB_FILE = "webhooks.sqlite3"
EVENT_TYPES = {SUCCEEDED: "video.completed", FAILED: "video.failed", CANCELLED: "video.cancelled"}
MAX_IN_FLIGHT = 4           # attempts at once (a thread each)
MAX_ANSWER_BYTES = 1 << 16  # of an answer's body read before the connection is closed
RETRY_MAX_S = 600.0         # the backoff between attempts doubles up to this
WATERMARK_SLACK_S = 5.0     # ended jobs are looked for from this long before the watermark (clock steps, races)
KEEP_DONE_S = 86400.0       # delivered and failed rows are kept this long (then only the watermark guards)
SCAN_PAGE = 200
POLL_S = 1.0                # the longest the thread sleeps without a store change or a due retry

_SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
  id TEXT PRIMARY KEY,            -- the event id, evt_<job id>: one event per job
  job_id TEXT NOT NULL,
  body BLOB NOT NULL,             -- the event's JSON, sent byte for byte on every attempt
  attempts INTEGER NOT NULL DEFAULT 0,
  due REAL NOT NULL,              -- unix time of the next attempt
  state TEXT NOT NULL DEFAULT 'pending',  -- pending | delivered | failed
  last_error TEXT NOT NULL DEFAULT '',
  created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries(state, due);
CREATE TABLE IF NOT EXISTS watermark (k INTEGER PRIMARY KEY CHECK (k = 0), t REAL NOT NULL);
"""


@dataclass(frozen=True)
class WebhookConfig:
    url: str
    secret: bytes
    attempts: int = 8            # attempts per event
    retry_s: float = 2.0         # the first backoff; it doubles up to RETRY_MAX_S
    timeout_s: float = 10.0      # one attempt, whole: connect, send, the whole answer


def read_secret(path: str) -> bytes:
    """The signing key from --webhook-secret-file: a Standard Webhooks secret (`whsec_<base64>`) is its decoded
    bytes, anything else the file's text (stripped) as UTF-8. FailedPrecondition naming the file."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise FailedPrecondition(f"--webhook-secret-file {path}: cannot read it ({e.strerror})") from None
    if not text:
        raise FailedPrecondition(f"--webhook-secret-file {path} is empty")
    if text.startswith("whsec_"):
        try:
            return base64.b64decode(text[6:], validate=True)
        except ValueError:
            raise FailedPrecondition(f"--webhook-secret-file {path}: a whsec_ secret must be base64 after the "
                                     "prefix") from None
    return text.encode()


def check_url(url: str) -> None:
    """FailedPrecondition for a --webhook-url that could not be sent as given. Any host is accepted, private and
    link-local (cloud metadata) addresses included: the URL is the operator's, never a user's."""
    shown = f"--webhook-url {url[:200]!r}"
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:  # a port that is not a number or above 65535, a broken [IPv6] host
        raise FailedPrecondition(f"{shown}: {e} (give a port from 1 to 65535, an IPv6 host in brackets)") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FailedPrecondition(f"{shown} is not an http:// or https:// URL with a host")
    if port == 0:
        raise FailedPrecondition(f"{shown}: port 0 cannot be connected to (give a port from 1 to 65535)")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise FailedPrecondition(f"{shown}: write it in ASCII without spaces or control characters (percent-encode "
                                 "the path and query, e.g. %C3%A9 for \u00e9; an international host in its xn-- form)")


def sign(secret: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value (Standard Webhooks, version 1)."""
    mac = hmac.new(secret, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


@dataclass(eq=False)
class _Attempt:
    """One POST in flight: its thread sets `why` when it ends, or the loop cuts it at `deadline` (monotonic)."""
    event_id: str
    attempts: int                 # made before this one
    deadline: float
    thread: threading.Thread | None = None
    conn: http.client.HTTPConnection | None = None   # set by the thread
    why: str | None = None        # None while it runs; "" delivered, else why not
    cut: bool = False

    def cut_now(self) -> None:
        """Ends the exchange from the loop's thread: its blocked send or receive fails at once."""
        self.cut = True
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:  # None: still connecting (the thread sees `cut` once connected) or already closed
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed by its thread meanwhile
                pass


class Webhooks:
    """The outbox, its loop and the attempts' threads. `start` after the job store is open; `stop` at the drain."""

    def __init__(self, cfg: WebhookConfig, jobs: JobBook, run_dir: Path, keep_age_s: float = 0.0):
        """`keep_age_s`: the service's --keep-age-s (the video object's `expires_at`)."""
        check_url(cfg.url)
        self.cfg = cfg
        self.jobs = jobs
        self.keep_age_s = keep_age_s
        self.db = sqlite3.connect(str(Path(run_dir) / DB_FILE), check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        with self.db:  # a new outbox starts now: jobs that ended before the webhook was configured send nothing
            self.db.execute("INSERT OR IGNORE INTO watermark (k, t) VALUES (0, ?)", (time.time(),))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="webhooks", daemon=True)
        self._in_flight: dict[str, _Attempt] = {}   # by event id; the loop's alone
        self._ending: list[_Attempt] = []           # recorded, their threads not yet ended: each holds a slot

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop once the attempts in flight ended or were cut at their deadline, each recorded (pending rows
        stay for the next start)."""
        self._stop.set()
        with self.jobs.changed:
            self.jobs.changed.notify_all()
        self._thread.join(timeout=self.cfg.timeout_s + 2 * POLL_S)

    # ---- 1. + 2. ended jobs into the outbox -----------------------------------------------------------------------
    def collect(self) -> int:
        """Rows for the jobs that ended since the watermark (returns how many were added); the watermark moves on."""
        mark = self.db.execute("SELECT t FROM watermark").fetchone()[0]
        t, added, newest = mark - WATERMARK_SLACK_S, 0, mark
        while True:
            recs = self.jobs.finished_since(t, SCAN_PAGE)
            for rec in recs:
                newest = max(newest, rec.finished)
                event_id = f"evt_{rec.id}"
                if self.db.execute("SELECT 1 FROM deliveries WHERE id = ?", (event_id,)).fetchone():
                    continue
                try:
                    body, state, why = json.dumps({
                        "id": event_id, "object": "event", "type": EVENT_TYPES[rec.state],
                        "created_at": int(rec.finished), "data": video_object(rec, keep_age_s=self.keep_age_s)}).encode(), "pending", ""
                except Exception as e:  # one job's record: its row says why, the others' events still go
                    log.exception("webhook %s: its event could not be built; it is not sent", event_id)
                    body, state, why = b"", "failed", f"the event could not be built: {type(e).__name__}: {e}"
                with self.db:
                    self.db.execute("INSERT INTO deliveries (id, job_id, body, due, created, state, last_error) "
                                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                    (event_id, rec.id, body, time.time(), time.time(), state, why))
                added += 1
            if len(recs) < SCAN_PAGE or recs[-1].finished <= t:
                break
            t = recs[-1].finished
        with self.db:
            self.db.execute("UPDATE watermark SET t = ?", (newest,))
            self.db.execute("DELETE FROM deliveries WHERE state != 'pending' AND created < ?",
                            (newest - max(KEEP_DONE_S, 2 * WATERMARK_SLACK_S),))
        return added

    # ---- 3. delivery ------------------------------------------------------------------------------------------------
    def _post(self, a: _Attempt, body: bytes) -> str:
        """One attempt, on its own thread; "" when delivered, else why not. Its socket is `a.conn.sock`, which `cut`
        shuts down at the deadline; every socket operation also times out by then."""
        u = urlsplit(self.cfg.url)
        ts = int(time.time())
        headers = {"Content-Type": "application/json", "User-Agent": "h3-render-webhooks", "webhook-id": a.event_id,
                   "webhook-timestamp": str(ts), "webhook-signature": sign(self.cfg.secret, a.event_id, ts, body)}
        timeout = max(a.deadline - time.monotonic(), 0.001)
        if u.scheme == "https":
            a.conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=timeout,
                                                 context=ssl.create_default_context())
        else:
            a.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        try:
            a.conn.connect()
            if a.cut:  # cut while connecting, before its socket could be shut down
                return self._late()
            a.conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), body, headers)
            resp = a.conn.getresponse()
            resp.read(MAX_ANSWER_BYTES)
            return "" if 200 <= resp.status < 300 else f"HTTP {resp.status} {resp.reason}"
        except (OSError, http.client.HTTPException) as e:
            return self._late() if a.cut or time.monotonic() >= a.deadline else f"{type(e).__name__}: {e}"
        finally:
            a.conn.close()

    def _late(self) -> str:
        return f"no whole answer within {self.cfg.timeout_s:g} s (--webhook-timeout-s)"

    def _run(self, a: _Attempt, body: bytes) -> None:
        """An attempt's thread: any fault of ours fails this attempt (logged, recorded on its row), never the loop."""
        try:
            a.why = self._post(a, body)
        except Exception as e:
            log.exception("webhook %s: the attempt raised", a.event_id)
            a.why = f"{type(e).__name__}: {e}"
        finally:
            with self.jobs.changed:  # wakes the loop to record it
                self.jobs.changed.notify_all()

    def _record(self, a: _Attempt, why: str) -> None:
        attempts = a.attempts + 1
        with self.db:
            if not why:
                self.db.execute("UPDATE deliveries SET state = 'delivered', attempts = ?, last_error = '' "
                                "WHERE id = ?", (attempts, a.event_id))
            elif attempts >= self.cfg.attempts:
                self.db.execute("UPDATE deliveries SET state = 'failed', attempts = ?, last_error = ? "
                                "WHERE id = ?", (attempts, why, a.event_id))
                log.error("webhook %s not delivered after %d attempts (--webhook-attempts): %s", a.event_id,
                          attempts, why)
            else:
                delay = min(RETRY_MAX_S, self.cfg.retry_s * 2 ** (attempts - 1))
                self.db.execute("UPDATE deliveries SET attempts = ?, due = ?, last_error = ? WHERE id = ?",
                                (attempts, time.time() + delay, why, a.event_id))
                log.warning("webhook %s attempt %d failed (%s); next in %.1f s", a.event_id, attempts, why, delay)

    def _reap(self) -> float:
        """Records every attempt that ended, and cuts (and records) every one past its deadline; returns the nearest
        deadline still ahead (monotonic; inf: none in flight). A cut attempt's thread keeps its slot until it ends."""
        nearest = float("inf")
        for a in list(self._in_flight.values()):
            why = a.why
            if why is None:
                if time.monotonic() < a.deadline:
                    nearest = min(nearest, a.deadline)
                    continue
                a.cut_now()
                why = self._late()
            self._record(a, why)  # a full disk raises here: the attempt stays in flight and is recorded later
            del self._in_flight[a.event_id]
            self._ending.append(a)
        self._ending = [a for a in self._ending if a.thread.is_alive()]
        return nearest

    def _dispatch(self) -> float:
        """Starts an attempt for each due pending row, up to MAX_IN_FLIGHT threads; returns when the next row not
        in flight is due (unix time; inf: none, or no free slot)."""
        free = MAX_IN_FLIGHT - len(self._in_flight) - len(self._ending)
        if free <= 0:
            return float("inf")
        rows = self.db.execute("SELECT id, body, attempts, due FROM deliveries WHERE state = 'pending' ORDER BY due "
                               "LIMIT ?", (free + len(self._in_flight),)).fetchall()
        for event_id, body, attempts, due in rows:
            if event_id in self._in_flight:
                continue
            if due > time.time():
                return due
            if free == 0:  # an attempt's end wakes the loop
                break
            a = _Attempt(event_id, attempts, time.monotonic() + self.cfg.timeout_s)
            a.thread = threading.Thread(target=self._run, args=(a, body), name=f"webhook {event_id}", daemon=True)
            self._in_flight[event_id] = a
            a.thread.start()
            free -= 1
        return float("inf")

    def _loop(self) -> None:
        """Collects, records and dispatches until stopped; then waits out the attempts in flight (each ends by its
        deadline). No error ends it: each is logged and the next pass tries again."""
        while True:
            stopping = self._stop.is_set()
            try:
                if not stopping:
                    self.collect()
                deadline = self._reap()
                due = float("inf") if stopping else self._dispatch()
                wait = min(POLL_S, due - time.time(), deadline - time.monotonic())
            except sqlite3.Error as e:  # a full disk: the outbox waits like the job store does
                log.error("webhook outbox %s: %s; retrying", DB_FILE, e)
                wait = POLL_S
            except Exception:
                log.exception("webhook outbox: an unexpected fault; retrying")
                wait = POLL_S
            if stopping and not self._in_flight:
                break
            with self.jobs.changed:  # an attempt's end and `stop` notify under this lock: neither is missed
                ended = any(a.why is not None for a in self._in_flight.values())
                if wait > 0 and not ended and self._stop.is_set() == stopping:
                    self.jobs.changed.wait(wait)
        self.db.close()
