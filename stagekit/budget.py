"""Host-wide memory budget per device for shared residency (stages stay resident side by side).

One ledger per device, `<lease_dir>/<device>.budget.json`, guarded by an
exclusive `flock` on `<device>.budget.lock` while it is read-modified-written.
A stage reserves its bytes (weights + peak activation estimate) on every device
of its rank group *before* it loads and releases them *after* it unloads; a
reservation that would push any device over its budget waits, and fails with
RESOURCE_EXHAUSTED after `timeout_s`.

Each live reservation is backed by a lock file the reserving process holds
(`<device>.resv.<holder>`), so a stage that dies (even `kill -9`) loses its
reservation the way it loses the lease: the next ledger reader finds the lock
free and drops the entry. Every reserve / grow / release is written to the
shared event log with the device totals before and after, which is how tests
prove the budget was never exceeded.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stagekit.cuda import cuda_index, cuda_properties
from stagekit.errors import ResourceExhausted
from stagekit.lease import EventLog, safe_name
from stagekit.procs import pid_alive

GIB = 1 << 30


def fmt_bytes(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def resolve_budget_bytes(devices: list[str], memory_budget_gb: float, reserve_gb: float, cap_gb: float = 0.0) -> int:
    """Per-device budget in bytes; 0 = unlimited.

    An explicit `memory_budget_gb` wins (minus nothing: it is what stages may use). Otherwise CUDA devices get
    their total memory (or `cap_gb`, the card size all processes are held to, when smaller) minus `reserve_gb`
    (headroom for the CUDA context, cuDNN workspaces, fragmentation and other processes — the `--reserve-vram`
    idea); virtual / CPU devices have no budget.
    """
    if memory_budget_gb > 0:
        return int(memory_budget_gb * GIB)
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return 0
    total = min(total for _, total in cuda_properties([cuda_index(d) for d in cuda]).values())
    if cap_gb > 0:
        total = min(total, int(cap_gb * GIB))
    return max(0, total - int(reserve_gb * GIB))


@dataclass
class BudgetConfig:
    lease_dir: Path
    holder: str                 # e.g. "dit@pid1234"
    budget_bytes: int           # per device; 0 = unlimited (reservations are still recorded)
    timeout_s: float = 600.0    # a reservation that cannot fit within this long fails with RESOURCE_EXHAUSTED


class MemoryBudget:
    """This process's reservation on a set of devices (`ids` are lease ids: GPU UUIDs or virtual names)."""

    def __init__(self, device_ids: list[str], cfg: BudgetConfig, events: EventLog | None = None):
        self.ids = sorted(set(device_ids))
        self.cfg = cfg
        cfg.lease_dir.mkdir(parents=True, exist_ok=True)
        self.events = events or EventLog(cfg.lease_dir, cfg.holder)
        self.reserved = 0           # bytes this process holds on each of its devices
        self._keep_fds: list[int] = []
        self._marker: list[Path] = []
        self._lock = threading.Lock()

    # ---- files ---------------------------------------------------------------------------------------------------
    def _file(self, dev: str, suffix: str) -> Path:
        return self.cfg.lease_dir / f"{safe_name(dev)}.{suffix}"

    def _resv_file(self, dev: str, holder: str) -> Path:
        return self._file(dev, f"resv.{safe_name(holder)}")

    @contextmanager
    def _ledgers(self) -> Iterator[dict[str, dict]]:
        """All our devices' ledgers, locked in sorted order, written back on exit."""
        fds = []
        try:
            for dev in self.ids:
                fd = os.open(self._file(dev, "budget.lock"), os.O_RDWR | os.O_CREAT, 0o644)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
            books = {dev: self._read(dev) for dev in self.ids}
            yield books
            for dev, book in books.items():
                tmp = self._file(dev, f"budget.json.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(book))
                tmp.replace(self._file(dev, "budget.json"))
        finally:
            for fd in fds:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _read(self, dev: str) -> dict:
        try:
            book = json.loads(self._file(dev, "budget.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            book = {}
        resv = book.get("reservations", {})
        for holder in list(resv):
            if holder != self.cfg.holder and not self._alive(dev, holder):
                self.events.write("budget_drop_dead", device=dev, dead_holder=holder, bytes=resv[holder]["bytes"])
                del resv[holder]
        return {"reservations": resv}

    def _alive(self, dev: str, holder: str) -> bool:
        """A reservation lives while its owner holds its lock file (the kernel drops it when the owner dies)."""
        try:
            fd = os.open(self._resv_file(dev, holder), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    # ---- queries -------------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Bytes reserved on each of our devices by all stages."""
        with self._ledgers() as books:
            return {dev: sum(r["bytes"] for r in b["reservations"].values()) for dev, b in books.items()}

    def _waiters(self) -> list[tuple[int, Path]]:
        """Live stages waiting for room on any of our devices as (ticket, marker), oldest first.

        Markers are "<dev>.bwait.<ticket_ns>.<pid>.<holder>"; a dead waiter's marker is removed."""
        out = []
        for dev in self.ids:
            for p in self.cfg.lease_dir.glob(f"{safe_name(dev)}.bwait.*"):
                try:
                    ticket, pid = (int(x) for x in p.name.split(".bwait.", 1)[1].split(".", 2)[:2])
                except ValueError:
                    continue
                if not pid_alive(pid):
                    p.unlink(missing_ok=True)
                    continue
                out.append((ticket, p))
        return sorted(out)

    def others_waiting(self) -> bool:
        """True when another live stage is waiting for room on one of our devices."""
        mine = set(self._marker)
        return any(p not in mine for _, p in self._waiters())

    # ---- reserve / release ---------------------------------------------------------------------------------------
    def _try_set(self, nbytes: int, event: str) -> tuple[bool, dict[str, int]]:
        """Set our reservation to `nbytes` on every device if all fit; returns (ok, others' bytes per device)."""
        budget = self.cfg.budget_bytes
        with self._ledgers() as books:
            others = {dev: sum(r["bytes"] for h, r in b["reservations"].items() if h != self.cfg.holder)
                      for dev, b in books.items()}
            if budget > 0 and any(o + nbytes > budget for o in others.values()):
                return False, others
            for book in books.values():
                book["reservations"][self.cfg.holder] = {"bytes": nbytes, "pid": os.getpid(), "t": time.time()}
            # Logged inside the ledger lock: the log's order is the ledger's order.
            self.events.write(event, devices=self.ids, bytes=nbytes, budget=budget,
                              totals={dev: others[dev] + nbytes for dev in self.ids})
        return True, others

    def _hold_resv_files(self) -> None:
        if self._keep_fds:
            return
        for dev in self.ids:
            fd = os.open(self._resv_file(dev, self.cfg.holder), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._keep_fds.append(fd)

    def _drop_resv_files(self) -> None:
        for fd in self._keep_fds:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._keep_fds = []

    def check_fits(self, nbytes: int, what: str) -> None:
        """Admission: refuse at once what could never fit the device, naming the estimate and the budget."""
        budget = self.cfg.budget_bytes
        if budget > 0 and nbytes > budget:
            raise ResourceExhausted(
                f"{what} needs an estimated {fmt_bytes(nbytes)} per device but the memory budget is {fmt_bytes(budget)} "
                f"on {', '.join(self.ids)}; use a smaller resolution or frame count, more ranks, or raise "
                f"--memory-budget-gb / lower --reserve-gb")

    def try_grow(self, nbytes: int) -> bool:
        """Raise our reservation to `nbytes` without waiting (never shrinks). False when it does not fit now."""
        with self._lock:
            if nbytes <= self.reserved:
                return True
            ok, _ = self._try_set(nbytes, "budget_grow")
            if ok:
                self.reserved = nbytes
            return ok

    def shrink(self, nbytes: int) -> None:
        """Lower our reservation to `nbytes` (e.g. to the measured size after a load reserved the worst case)."""
        with self._lock:
            if self._keep_fds and 0 < nbytes < self.reserved:
                ok, _ = self._try_set(nbytes, "budget_shrink")
                if ok:
                    self.reserved = nbytes

    def reserve(self, nbytes: int, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Reserve `nbytes` on each device (replacing any smaller reservation), waiting for room.

        Returns seconds waited; ResourceExhausted (naming who holds what) after the timeout. Callers reserve
        while holding nothing else, so waiting cannot deadlock.
        """
        self.check_fits(nbytes, self.cfg.holder)
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            t0 = time.monotonic()
            self._hold_resv_files()
            try:
                # Waiters are served in ticket order: with anyone already in line we queue behind them.
                ok, others = (False, {}) if self._waiters() else self._try_set(nbytes, "budget_reserve")
                if not ok:
                    ticket = time.time_ns()
                    self._marker = [self._file(dev, f"bwait.{ticket}.{os.getpid()}.{safe_name(self.cfg.holder)}")
                                    for dev in self.ids]
                    for p in self._marker:
                        p.touch()
                    self.events.write("budget_wait", devices=self.ids, bytes=nbytes, budget=self.cfg.budget_bytes)
                    mine = set(self._marker)
                    try:
                        while True:
                            if not any(t < ticket and p not in mine for t, p in self._waiters()):
                                ok, others = self._try_set(nbytes, "budget_reserve")
                                if ok:
                                    break
                            if time.monotonic() - t0 > timeout_s:
                                raise ResourceExhausted(
                                    f"{self.cfg.holder}: {fmt_bytes(nbytes)} did not fit the {fmt_bytes(self.cfg.budget_bytes)} "
                                    f"budget within {timeout_s:.0f} s (other stages hold "
                                    + (", ".join(f"{fmt_bytes(v)} on {d}" for d, v in others.items()) or "it")
                                    + "); retry later or raise --memory-budget-gb")
                            time.sleep(poll_s)
                    finally:
                        for p in self._marker:
                            p.unlink(missing_ok=True)
                        self._marker = []
            except BaseException:
                if self.reserved == 0:
                    self._drop_resv_files()
                raise
            self.reserved = nbytes
            return time.monotonic() - t0

    def release(self) -> None:
        with self._lock:
            if not self._keep_fds:
                return
            with self._ledgers() as books:
                for book in books.values():
                    book["reservations"].pop(self.cfg.holder, None)
                totals = {dev: sum(r["bytes"] for r in b["reservations"].values()) for dev, b in books.items()}
                self.events.write("budget_release", devices=self.ids, bytes=self.reserved, budget=self.cfg.budget_bytes,
                                  totals=totals)
            self.reserved = 0
            self._drop_resv_files()
