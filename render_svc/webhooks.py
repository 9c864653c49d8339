"""Webhooks: one signed HTTP POST per finished job (`--webhook-url`), delivered from a thread of its own.

1. **Seeing a job end.** The thread waits on the job store's `changed` condition (or one second) and reads the jobs
   that ended since its watermark (`JobStore.finished_since`): every way a job ends is seen (its last stage, a
   cancel, a failure at start-up past --max-attempts) and the scheduler is never called or waited on.
2. **The outbox.** Each ended job becomes one row of `<run-dir>/webhooks.sqlite3` (WAL, synchronous=FULL) holding
   the event's exact bytes, before any attempt; the watermark is stored with it. After a crash or a restart the
   pending rows are sent again, and jobs that ended while the service was down or before their row was written are
   found again from the watermark (it trails by WATERMARK_SLACK_S): delivery is at least once; the event id
   (`webhook-id`, the same on every attempt) lets a receiver drop a repeat.
3. **Delivery.** `POST <url>` with the event JSON, signed as Standard Webhooks signs (`webhook-id`,
   `webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>`). A 2xx
   answer delivers it; anything else (an error status, a refused or timed-out connection, a redirect) is retried
   after --webhook-retry-s, doubling up to RETRY_MAX_S, until --webhook-attempts attempts were made; then the row
   is kept as failed and logged. One attempt at a time, each within TIMEOUT_S.

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
import sqlite3
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from render_svc.http_api import video_object
from render_svc.store import CANCELLED, FAILED, SUCCEEDED, JobStore
from stagekit.errors import FailedPrecondition

log = logging.getLogger("render_svc.webhooks")

DB_FILE = "webhooks.sqlite3"
EVENT_TYPES = {SUCCEEDED: "video.completed", FAILED: "video.failed", CANCELLED: "video.cancelled"}
TIMEOUT_S = 10.0            # one delivery attempt: connect, send, answer
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
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FailedPrecondition(f"--webhook-url {url[:200]!r} is not an http:// or https:// URL with a host")


def sign(secret: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value (Standard Webhooks, version 1)."""
    mac = hmac.new(secret, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class Webhooks:
    """The outbox and its delivery thread. `start` after the job store is open; `stop` at the drain."""

    def __init__(self, cfg: WebhookConfig, store: JobStore, run_dir: Path, keep_age_s: float = 0.0):
        """`keep_age_s`: the service's --keep-age-s (the video object's `expires_at`)."""
        check_url(cfg.url)
        self.cfg = cfg
        self.store = store
        self.keep_age_s = keep_age_s
        self.db = sqlite3.connect(str(Path(run_dir) / DB_FILE), check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        with self.db:  # a new outbox starts now: jobs that ended before the webhook was configured send nothing
            self.db.execute("INSERT OR IGNORE INTO watermark (k, t) VALUES (0, ?)", (time.time(),))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = TIMEOUT_S + 1) -> None:
        """Ends the thread after its attempt in flight (pending rows stay for the next start)."""
        self._stop.set()
        with self.store.changed:
            self.store.changed.notify_all()
        self._thread.join(timeout=timeout_s)

    # ---- 1. + 2. ended jobs into the outbox -----------------------------------------------------------------------
    def collect(self) -> int:
        """Rows for the jobs that ended since the watermark (returns how many were added); the watermark moves on."""
        mark = self.db.execute("SELECT t FROM watermark").fetchone()[0]
        t, added, newest = mark - WATERMARK_SLACK_S, 0, mark
        while True:
            recs = self.store.finished_since(t, SCAN_PAGE)
            for rec in recs:
                newest = max(newest, rec.finished)
                event_id = f"evt_{rec.id}"
                if self.db.execute("SELECT 1 FROM deliveries WHERE id = ?", (event_id,)).fetchone():
                    continue
                body = json.dumps({"id": event_id, "object": "event", "type": EVENT_TYPES[rec.state],
                                   "created_at": int(rec.finished),
                                   "data": video_object(rec, keep_age_s=self.keep_age_s)}).encode()
                with self.db:
                    self.db.execute("INSERT INTO deliveries (id, job_id, body, due, created) VALUES (?, ?, ?, ?, ?)",
                                    (event_id, rec.id, body, time.time(), time.time()))
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
    def _post(self, event_id: str, body: bytes) -> str:
        """One attempt; "" when delivered, else why not."""
        u = urlsplit(self.cfg.url)
        ts = int(time.time())
        headers = {"Content-Type": "application/json", "User-Agent": "h3-render-webhooks", "webhook-id": event_id,
                   "webhook-timestamp": str(ts), "webhook-signature": sign(self.cfg.secret, event_id, ts, body)}
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=TIMEOUT_S,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
        try:
            conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), body, headers)
            resp = conn.getresponse()
            resp.read(1 << 16)
            return "" if 200 <= resp.status < 300 else f"HTTP {resp.status} {resp.reason}"
        except (OSError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            conn.close()

    def deliver_due(self) -> float:
        """Attempt every pending row that is due; returns when the next one is due (unix time; inf: none)."""
        while not self._stop.is_set():
            row = self.db.execute("SELECT id, body, attempts FROM deliveries WHERE state = 'pending' AND due <= ? "
                                  "ORDER BY due LIMIT 1", (time.time(),)).fetchone()
            if row is None:
                break
            event_id, body, attempts = row
            why = self._post(event_id, body)
            attempts += 1
            with self.db:
                if not why:
                    self.db.execute("UPDATE deliveries SET state = 'delivered', attempts = ?, last_error = '' "
                                    "WHERE id = ?", (attempts, event_id))
                elif attempts >= self.cfg.attempts:
                    self.db.execute("UPDATE deliveries SET state = 'failed', attempts = ?, last_error = ? "
                                    "WHERE id = ?", (attempts, why, event_id))
                    log.error("webhook %s not delivered after %d attempts (--webhook-attempts): %s", event_id,
                              attempts, why)
                else:
                    delay = min(RETRY_MAX_S, self.cfg.retry_s * 2 ** (attempts - 1))
                    self.db.execute("UPDATE deliveries SET attempts = ?, due = ?, last_error = ? WHERE id = ?",
                                    (attempts, time.time() + delay, why, event_id))
                    log.warning("webhook %s attempt %d failed (%s); next in %.1f s", event_id, attempts, why, delay)
        nxt = self.db.execute("SELECT MIN(due) FROM deliveries WHERE state = 'pending'").fetchone()[0]
        return float("inf") if nxt is None else nxt

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.collect()
                due = self.deliver_due()
            except sqlite3.Error as e:  # a full disk: the outbox waits like the job store does
                log.error("webhook outbox %s: %s; retrying", DB_FILE, e)
                due = time.time() + POLL_S
            wait = max(0.0, min(POLL_S, due - time.time()))
            if wait > 0 and not self._stop.is_set():
                with self.store.changed:
                    self.store.changed.wait(wait)
        self.db.close()
