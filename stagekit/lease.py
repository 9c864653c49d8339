"""Per-device lease on the host: at most one stage holds a device's weights at a time.

Each physical device has a lock file named by its UUID (so CUDA_VISIBLE_DEVICES
remaps cannot make two stages think they use different cards). The lease is an
exclusive `flock`, which the kernel drops the instant the holder dies — no stale
locks after `kill -9`. On CPU a virtual device name ("virt0") plays the UUID.

The lease is taken by a stage's rank 0 for all the devices of its host (a group spanning hosts: each
other host's first rank takes that host's, on rank 0's command: stagekit/hosts.py); in addition
every rank that holds weights on a device keeps a rank hold there
(`RankHold`: `<dev>.rank.<pid>`, its own exclusive flock). A new holder, once
it has the lease, waits until no rank of another process still holds its
devices, so a follower that outlives its rank 0 (hung, or slow to exit) keeps
the device taken until it is gone too.

Holders write who they are into the lock file; waiters leave a marker file so
an idle holder knows to step aside. Markers carry a ticket (the time the wait
began) and the waiter's pid: waiters take the lock in ticket order (FIFO across
stages, so a holder that yields cannot grab the devices straight back), and a
marker whose process died is ignored and removed.

Every acquire/release, and the runtime's load/unload and the memory budget's
reservations, are appended to one event log (JSON lines, `events.jsonl`) that
tests and benchmarks read to prove the residency invariants.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stagekit.cuda import cuda_index, cuda_properties
from stagekit.procs import pid_alive

_SAFE = re.compile(r"[^A-Za-z0-9._-]")
EVENTS_FILE = "events.jsonl"

log = logging.getLogger("stagekit.lease")


def safe_name(s: str) -> str:
    return _SAFE.sub("_", s)


def device_ids(devices: list[str]) -> list[str]:
    """Stable host-wide ids for the given device names ("cuda:0", "virt0", ...): GPU UUIDs, read in a short-lived
    child so that the stage process holds no CUDA context."""
    cuda = cuda_properties([cuda_index(d) for d in devices if d.startswith("cuda")])
    return [cuda[cuda_index(d)][0] if d.startswith("cuda") else d for d in devices]


class EventLog:
    """Append-only JSON-lines log shared by every stage on the host (one line per `write`, O_APPEND)."""

    def __init__(self, lease_dir: Path, holder: str):
        self.path = Path(lease_dir) / EVENTS_FILE
        self.holder = holder

    def write(self, event: str, **extra) -> None:
        """Append one event. A record that cannot be written (disk full) is left out, with a warning: the log
        describes the work, it must not fail it."""
        rec = {"t": time.time(), "event": event, "holder": self.holder, "pid": os.getpid(), **extra}
        line = (json.dumps(rec) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("event %r not recorded in %s: %s", event, self.path, e.strerror or e)


@dataclass
class LeaseConfig:
    lease_dir: Path
    holder: str  # e.g. "dit@pid1234"


class DeviceLease:
    """Exclusive host-wide lease on a set of devices (acquired in sorted order, FIFO by ticket: no deadlock)."""

    def __init__(self, device_names: list[str], cfg: LeaseConfig):
        self.cfg = cfg
        self.ids = sorted(set(device_ids(device_names)))
        cfg.lease_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(cfg.lease_dir, cfg.holder)
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._markers: list[Path] = []
        self.acquired_at: float | None = None

    def _path(self, dev: str, suffix: str = "lock") -> Path:
        return self.cfg.lease_dir / f"{safe_name(dev)}.{suffix}"

    def _log(self, event: str, **extra) -> None:
        self.events.write(event, devices=self.ids, **extra)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    # ---- waiter markers: "<dev>.wait.<ticket_ns>.<pid>.<holder>" ---------------------------------------------------
    def _post_markers(self) -> int:
        ticket = time.time_ns()
        self._markers = []
        for dev in self.ids:
            p = self._path(dev, f"wait.{ticket}.{os.getpid()}.{safe_name(self.cfg.holder)}")
            p.touch()
            self._markers.append(p)
        return ticket

    def _clear_markers(self) -> None:
        for p in self._markers:
            p.unlink(missing_ok=True)
        self._markers = []

    def _waiters(self, dev: str) -> list[tuple[int, int, Path]]:
        """Live waiters on `dev` as (ticket, pid, marker), oldest first; dead waiters' markers are removed."""
        out = []
        for p in self.cfg.lease_dir.glob(f"{safe_name(dev)}.wait.*"):
            parts = p.name[len(safe_name(dev)) + len(".wait."):].split(".", 2)
            try:
                ticket, pid = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                continue
            if not pid_alive(pid):
                p.unlink(missing_ok=True)
                continue
            out.append((ticket, pid, p))
        return sorted(out)

    def _older_waiter(self, ticket: int) -> bool:
        mine = set(self._markers)
        return any(t < ticket and p not in mine for dev in self.ids for t, _, p in self._waiters(dev))

    def acquire(self, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Block until all devices are ours; returns seconds waited. TimeoutError if not in time.

        Waiters are served in ticket order: while an older live waiter wants one of our devices we do not
        even try the lock, so a stage that just yielded queues behind the stage it yielded to.
        """
        with self._lock:
            if self._fds:
                return 0.0
            t0 = time.monotonic()
            ticket = self._post_markers()
            try:
                while self._older_waiter(ticket):
                    self._check_timeout(t0, timeout_s, self.ids[0])
                    time.sleep(poll_s)
                for dev in self.ids:
                    fd = os.open(self._path(dev), os.O_RDWR | os.O_CREAT, 0o644)
                    while True:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            break
                        except BlockingIOError:
                            try:
                                self._check_timeout(t0, timeout_s, dev)
                            except TimeoutError:
                                os.close(fd)
                                raise
                            time.sleep(poll_s)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{self.cfg.holder} pid={os.getpid()}\n".encode(), 0)
                    self._fds.append(fd)
                self._wait_for_ranks(t0, timeout_s, poll_s)
            except BaseException:
                self._release_fds()
                raise
            finally:
                self._clear_markers()
            self.acquired_at = time.time()
            waited = time.monotonic() - t0
            self._log("acquire", waited_s=waited)
            return waited

    def _wait_for_ranks(self, t0: float, timeout_s: float | None, poll_s: float) -> None:
        """With the lease taken: wait until no rank of another process holds weights on our devices."""
        logged = False
        while True:
            busy = [(dev, who) for dev in self.ids for who in rank_holders(self.cfg.lease_dir, dev)]
            if not busy:
                return
            if not logged:
                self._log("wait_ranks", holders=[who for _, who in busy])
                logged = True
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                dev, who = busy[0]
                raise TimeoutError(f"device {dev} still holds the weights of {who} after {timeout_s:.0f} s (its rank "
                                   "group lost its leader); stop that process")
            time.sleep(poll_s)

    def _check_timeout(self, t0: float, timeout_s: float | None, dev: str) -> None:
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"device {dev} is held by {self.holder_of(dev) or 'another stage'} "
                               f"for longer than {timeout_s:.0f} s")

    def _release_fds(self) -> None:
        for fd in self._fds:
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._fds.clear()

    def release(self) -> None:
        with self._lock:
            if not self._fds:
                return
            held_s = time.time() - self.acquired_at if self.acquired_at else 0.0
            self._log("release", held_s=held_s)
            self._release_fds()
            self.acquired_at = None

    def others_waiting(self) -> bool:
        """True when another live stage has asked for one of our devices."""
        mine = set(self._markers)
        return any(p not in mine for dev in self.ids for _, _, p in self._waiters(dev))

    def holder_of(self, dev: str) -> str:
        """Who holds `dev` now ("" when free; a dead holder's leftover name is not reported). Without a lease
        holder, ranks still holding weights there (a group whose leader is gone) are reported."""
        path = self._path(dev)
        if dev in self.ids and self._fds:
            return f"{self.cfg.holder} pid={os.getpid()}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                try:
                    # A probe on our own open file: succeeds only when nobody holds the lease.
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except BlockingIOError:
                    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another stage"
            finally:
                os.close(fd)
        return ", ".join(f"{who} (leader gone)" for who in rank_holders(self.cfg.lease_dir, dev, os.getpid()))

    def holders(self) -> str:
        return ", ".join(h for h in (self.holder_of(d) for d in self.ids) if h)


class RankHold:
    """One rank's claim on its own device while it holds weights there: an exclusive flock on
    `<dev>.rank.<pid>` (the kernel drops it if the rank dies). Ranks of one group on one device (virtual devices in
    tests) each hold their own file, so they never block each other; another stage's new lease waits for all."""

    def __init__(self, device_name: str, lease_dir: Path, who: str):
        self.lease_dir = Path(lease_dir)
        self.lease_dir.mkdir(parents=True, exist_ok=True)
        self.id = device_ids([device_name])[0]
        self.who = who
        self.path = self.lease_dir / f"{safe_name(self.id)}.rank.{os.getpid()}"
        self.events = EventLog(self.lease_dir, who)
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> None:
        with self._lock:
            if self._fd is not None:
                return
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)  # our own file: at most a prober's brief shared lock on it
                try:
                    if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)  # a prober removed it as stale between our open and our lock: make it again
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.who} pid={os.getpid()}\n".encode(), 0)
            self._fd = fd
            self.events.write("rank_hold", devices=[self.id])

    def release(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            fd, self._fd = self._fd, None
            self.path.unlink(missing_ok=True)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self.events.write("rank_release", devices=[self.id])


def rank_holders(lease_dir: Path, dev: str, skip_pid: int | None = None) -> list[str]:
    """Ranks of live processes (other than `skip_pid`, default ours) holding weights on `dev`; files left by dead
    ranks are removed."""
    skip_pid = os.getpid() if skip_pid is None else skip_pid
    out = []
    for p in Path(lease_dir).glob(f"{safe_name(dev)}.rank.*"):
        try:
            pid = int(p.name.rsplit(".", 1)[1])
        except ValueError:
            continue
        if pid == skip_pid:
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                out.append(os.pread(fd, 4096, 0).decode(errors="replace").strip() or f"pid {pid}")
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            # Free: its rank died without releasing. Remove it unless the path now names a newer file.
            try:
                if os.stat(p).st_ino == os.fstat(fd).st_ino:
                    p.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    return sorted(out)


def read_events(lease_dir: Path) -> list[dict]:
    p = Path(lease_dir) / EVENTS_FILE
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def events_per_stage(events: list[dict], t0: float, t1: float, kind: str = "acquire") -> dict[str, int]:
    """How many `kind` events (e.g. "acquire": a weight swap in exclusive residency) each stage logged between t0
    and t1 (unix seconds); the stage is the holder name's part before "@" ("dit@pid1234" -> "dit")."""
    out: dict[str, int] = {}
    for e in events:
        if e["event"] == kind and t0 <= e["t"] <= t1:
            stage = e["holder"].split("@", 1)[0]
            out[stage] = out.get(stage, 0) + 1
    return out
