"""The process bootstrap every server shares: the stages (`stagekit.stage.run_stage`, which adds ranks, the device
lease, the memory budget and the runtime on top) and the render service (`render_svc.server.main`, which adds its
job store and scheduler). One way to do each of:

1. logging: one line format per process (`setup_logging`);
2. temp files: the process's own temp directory, swept of dead processes' ones at start (`ProcessTempDir`);
3. listeners, bound before anything expensive so a taken port refuses the start at once (`listen`): the gRPC
   server (`stagekit.server.StageServer`: health, reflection, TLS, bearer token and principals, admission) and
   `/metrics` (`--metrics-port`, `stagekit.metrics.StageMetrics`);
4. serving: the servicer added, health SERVING, one banner line (`Listeners.serve`);
5. SIGTERM / SIGINT: health NOT_SERVING, the caller's drain, the server stopped, `/metrics` closed
   (`Listeners.run_until_terminated`), then an exit without interpreter finalisation (`exit_cleanly`).

Settings come from the caller's config (`stagekit.server.ServeConfig` and its subclasses, `stagekit.config`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from stagekit.procs import pid_alive
from stagekit.server import ServeConfig, StageServer, is_loopback

log = logging.getLogger("stagekit.bootstrap")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # --log-level


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")


class ProcessTempDir:
    """This process's own temp directory, `<root>/h3-<name>-<pid>` (docs/reliability.md, "Temp files").

    The directory holds a `.owner` file locked by this process for its lifetime; at start, directories of processes
    whose lock is free (dead: crashed, killed -9) are removed, whatever their service, so no temp file outlives the
    next start. A clean exit removes its own directory."""

    PATTERN = re.compile(r"h3-[a-z]+-(\d+)$")

    def __init__(self, root: Path, name: str):
        root.mkdir(parents=True, exist_ok=True)
        self.swept = self.sweep(root)
        self.path = root / f"h3-{name}-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)  # a dead process's dir under our recycled pid
        self.path.mkdir()
        self._fd = os.open(self.path / ".owner", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        if self.swept:
            log.info("removed temp dirs of stopped processes: %s", ", ".join(self.swept))

    @classmethod
    def sweep(cls, root: Path) -> list[str]:
        removed = []
        for d in root.iterdir():
            m = cls.PATTERN.match(d.name)
            if not m or not d.is_dir() or int(m.group(1)) == os.getpid():
                continue
            try:
                fd = os.open(d / ".owner", os.O_RDONLY)
            except FileNotFoundError:
                if pid_alive(int(m.group(1))):  # still being set up by a starting process
                    continue
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live process's
                finally:
                    os.close(fd)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        return removed

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)


@dataclass
class Listeners:
    """A process's bound ports: the gRPC server and, with `--metrics-port`, its `/metrics` endpoint."""

    label: str
    server: StageServer
    metrics: object | None = None  # stagekit.metrics.StageMetrics

    def serve(self, add_servicers: Callable[[grpc.Server], None], banner: str) -> None:
        """Add the servicer(s), serve, report SERVING and print `banner` (scripts wait for the port file)."""
        self.server.start(add_servicers)
        self.server.set_serving(True)
        print(f"{self.label} serving on {self.server.cfg.host}:{self.server.port} ({banner})", flush=True)

    def run_until_terminated(self, drain: Callable[[bool, float], None]) -> None:
        """Block until SIGTERM/SIGINT; then `drain(cancel_running, grace_s)` (from --cancel-on-term, --drain-s)
        between health NOT_SERVING and the server's stop; `/metrics` closes last."""
        self.server.run_until_terminated(drain)
        if self.metrics is not None:
            self.metrics.close()


def listen(cfg: ServeConfig, label: str, service_name: str, device: str = "") -> Listeners:
    """Bind the gRPC port (held, not yet serving) and, with `--metrics-port`, `/metrics` (serving at once)."""
    interceptors, metrics = [], None
    if cfg.metrics_port >= 0:
        from stagekit.metrics import StageMetrics

        metrics = StageMetrics(label, device)
        interceptors.append(metrics.interceptor())
    server = StageServer(cfg, [service_name], interceptors=interceptors, label=label)
    if metrics is not None:
        port = metrics.serve(cfg.metrics_host, cfg.metrics_port, cfg.port_file)
        scope = "loopback only; --metrics-host to expose" if is_loopback(cfg.metrics_host) else "plain HTTP, no auth"
        print(f"{label} metrics on http://{cfg.metrics_host}:{port}/metrics ({scope})", flush=True)
    return Listeners(label, server, metrics)


def exit_cleanly() -> None:
    """Exit 0 once the drain is done, without interpreter finalisation: gRPC's and torch's native threads can
    abort the process (SIGABRT) while Python tears down modules under them, turning a clean drain into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
