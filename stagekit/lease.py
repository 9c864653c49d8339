"""Per-device lease on the host: at most one stage holds a device's weights at a time.

Each physical device has a lock file named by its UUID (so CUDA_VISIBLE_DEVICES
remaps cannot make two stages think they use different cards). The lease is an
exclusive `flock`, which the kernel drops the instant the holder dies — no stale
locks after `kill -9`. On CPU a virtual device name ("virt0") plays the UUID.

Holders write who they are into the lock file; waiters leave a marker file so
an idle holder knows to step aside. Every acquire/release is appended to an
event log (JSON lines) that tests and benchmarks read to prove the invariant.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def device_ids(devices: list[str]) -> list[str]:
    """Stable host-wide ids for the given device names ("cuda:0", "virt0", ...)."""
    ids = []
    for d in devices:
        if d.startswith("cuda"):
            import torch

            idx = int(d.split(":")[1]) if ":" in d else 0
            ids.append("GPU-" + str(torch.cuda.get_device_properties(idx).uuid))
        else:
            ids.append(d)
    return ids


@dataclass
class LeaseConfig:
    lease_dir: Path
    holder: str  # e.g. "dit@pid1234"


class DeviceLease:
    """Exclusive host-wide lease on a set of devices (acquired in sorted order: no deadlock)."""

    def __init__(self, device_names: list[str], cfg: LeaseConfig):
        self.cfg = cfg
        self.ids = sorted(set(device_ids(device_names)))
        cfg.lease_dir.mkdir(parents=True, exist_ok=True)
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self.acquired_at: float | None = None

    def _path(self, dev: str, suffix: str = "lock") -> Path:
        return self.cfg.lease_dir / f"{_SAFE.sub('_', dev)}.{suffix}"

    def _log(self, event: str, **extra) -> None:
        rec = {"t": time.time(), "event": event, "holder": self.cfg.holder, "devices": self.ids, **extra}
        with open(self.cfg.lease_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def _waiter_marker(self, dev: str) -> Path:
        return self._path(dev, f"wait.{_SAFE.sub('_', self.cfg.holder)}")

    def acquire(self, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Block until all devices are ours; returns seconds waited. TimeoutError if not in time."""
        with self._lock:
            if self._fds:
                return 0.0
            t0 = time.monotonic()
            for dev in self.ids:
                self._waiter_marker(dev).touch()
            try:
                for dev in self.ids:
                    fd = os.open(self._path(dev), os.O_RDWR | os.O_CREAT, 0o644)
                    while True:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            break
                        except BlockingIOError:
                            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                                os.close(fd)
                                raise TimeoutError(
                                    f"device {dev} is held by {self.holder_of(dev) or 'another stage'} "
                                    f"for longer than {timeout_s:.0f} s"
                                ) from None
                            time.sleep(poll_s)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{self.cfg.holder} pid={os.getpid()}\n".encode(), 0)
                    self._fds.append(fd)
            except BaseException:
                self._release_fds()
                raise
            finally:
                for dev in self.ids:
                    self._waiter_marker(dev).unlink(missing_ok=True)
            self.acquired_at = time.time()
            self._log("acquire", waited_s=time.monotonic() - t0)
            return time.monotonic() - t0

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
            self._log("release")
            self._release_fds()
            self.acquired_at = None

    def others_waiting(self) -> bool:
        """True when another stage has asked for one of our devices."""
        mine = {self._waiter_marker(d).name for d in self.ids}
        for dev in self.ids:
            prefix = f"{_SAFE.sub('_', dev)}.wait."
            for p in self.cfg.lease_dir.glob(prefix + "*"):
                if p.name not in mine:
                    return True
        return False

    def holder_of(self, dev: str) -> str:
        try:
            return self._path(dev).read_text().strip()
        except FileNotFoundError:
            return ""

    def holders(self) -> str:
        return ", ".join(h for h in (self.holder_of(d) for d in self.ids) if h)


def read_events(lease_dir: Path) -> list[dict]:
    p = Path(lease_dir) / "events.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
