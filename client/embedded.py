"""A local stack of the three stage servers (and, when asked, the render service) as subprocesses on free loopback
ports.

Used by `render` when no render service is configured and reachable, and by the tests. Multi-rank stages run under torchrun. Stopping sends SIGTERM to
each process group (graceful drain), then SIGKILL after a grace period, so no
orphan processes remain.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minimax_h3.services import SERVICE_NAMES, STAGES, Endpoints
from stagekit.channels import Security, health_of, open_channel
from stagekit.errors import FailedPrecondition
from stagekit.procs import stop_group


class StackStartError(FailedPrecondition):
    """A stage of a local stack exited or did not serve in time; the message names its log (kept) and its last
    lines, `summary` says why in a line or a few (the stage's own `cannot start` line when it wrote one)."""

    def __init__(self, message: str, summary: str = ""):
        super().__init__(message)
        self.summary = summary or message


MODULES = {"encoder": "encoder_svc", "dit": "dit_svc", "decoder": "decoder_svc", "render": "render_svc"}


@dataclass
class StackConfig:
    ranks: dict[str, int] = field(default_factory=lambda: {"encoder": 1, "dit": 1, "decoder": 1})
    models_dir: str = ""
    cache_dir: str = ""
    run_dir: str = ""                 # logs + port files; default: a temp dir
    lease_dir: str = ""               # default: <run_dir>/leases (isolated from other stacks)
    residency: str = "exclusive"
    devices: str = ""                 # e.g. "virt0" (CPU tests) or "cuda:0,cuda:1"
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 180.0
    security: Security = field(default_factory=Security)  # how to reach stages started with --tls-cert/--token
    with_render: bool = False         # also start the render service (its job database in <run_dir>/render)


def stage_command(stage: str, ranks: int, args: list[str]) -> list[str]:
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--standalone", "--max-restarts", "3",
                "-m", MODULES[stage], *args]
    return [sys.executable, "-m", MODULES[stage], *args]


class EmbeddedStack:
    def __init__(self, cfg: StackConfig | None = None):
        self.cfg = cfg or StackConfig()
        # A run dir of our own (a temp dir) goes when the stack stops; a start that failed keeps it for its logs.
        self.own_run_dir = not self.cfg.run_dir
        self.run_dir = Path(self.cfg.run_dir or tempfile.mkdtemp(prefix="h3-stack-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lease_dir = Path(self.cfg.lease_dir or self.run_dir / "leases")
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.stage_endpoints: Endpoints | None = None

    def _args(self, stage: str) -> list[str]:
        c = self.cfg
        args = ["--host", "127.0.0.1", "--port", "0", "--port-file", str(self.run_dir / f"{stage}.port"),
                "--lease-dir", str(self.lease_dir), "--residency", c.residency]
        if c.models_dir:
            args += ["--models-dir", c.models_dir]
        if c.cache_dir:
            args += ["--cache-dir", c.cache_dir]
        if c.devices:
            args += ["--devices", c.devices]
        return args + list(c.extra_args.get(stage, []))

    def temp_dir(self, stage: str) -> Path:
        """The stage's TMPDIR: its temp files and torchrun's torchelastic_* dirs (emptied at start and stop)."""
        return self.run_dir / "tmp" / stage

    def start_stage(self, stage: str) -> None:
        port_file = self.run_dir / f"{stage}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.run_dir / f"{stage}.log", "ab")
        shutil.rmtree(self.temp_dir(stage), ignore_errors=True)
        self.temp_dir(stage).mkdir(parents=True)
        env = {**os.environ, **self.cfg.env, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.temp_dir(stage))}
        self.procs[stage] = subprocess.Popen(
            stage_command(stage, self.cfg.ranks.get(stage, 1), self._args(stage)),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> Endpoints:
        for stage in STAGES:
            self.start_stage(stage)
        try:
            for stage in STAGES:
                self.wait_ready(stage)
            if self.cfg.with_render:
                self.start_render(self.endpoints())
        except BaseException:
            self.stop(keep_run_dir=True)  # the error names a log in it
            raise
        return self.endpoints()

    def render_args(self, stages: Endpoints) -> list[str]:
        return ["--host", "127.0.0.1", "--port", "0", "--port-file", str(self.run_dir / "render.port"),
                "--run-dir", str(self.run_dir / "render"), "--encoder", stages.encoder, "--dit", stages.dit,
                "--decoder", stages.decoder, *self.cfg.extra_args.get("render", [])]

    def start_render(self, stages: Endpoints) -> str:
        """Start the render service over `stages` (this stack's, or stages running elsewhere); returns its address."""
        self.stage_endpoints = stages
        (self.run_dir / "render.port").unlink(missing_ok=True)
        log = open(self.run_dir / "render.log", "ab")
        shutil.rmtree(self.temp_dir("render"), ignore_errors=True)
        self.temp_dir("render").mkdir(parents=True)
        env = {**os.environ, **self.cfg.env, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.temp_dir("render"))}
        self.procs["render"] = subprocess.Popen([sys.executable, "-m", MODULES["render"], *self.render_args(stages)],
                                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.wait_ready("render")
        return f"127.0.0.1:{self.ports['render']}"

    def endpoints(self) -> Endpoints:
        stages = {s: f"127.0.0.1:{self.ports[s]}" for s in STAGES if s in self.ports}
        if len(stages) < len(STAGES):  # a render service over stages running elsewhere
            stages = {s: self.stage_endpoints.of(s) for s in STAGES}
        render = f"127.0.0.1:{self.ports['render']}" if "render" in self.ports else ""
        return Endpoints(**stages, render=render)

    def wait_ready(self, stage: str, timeout_s: float | None = None) -> int:
        deadline = time.monotonic() + (timeout_s or self.cfg.start_timeout_s)
        port_file = self.run_dir / f"{stage}.port"
        while time.monotonic() < deadline:
            proc = self.procs[stage]
            if proc.poll() is not None:
                tail = self.tail(stage)
                why = [ln for ln in tail.splitlines() if ": cannot start: " in ln]
                raise StackStartError(f"{stage} exited with {proc.returncode}; log: "
                                      f"{self.run_dir / (stage + '.log')}\n" + tail,
                                      summary=why[-1] if why else f"{stage} exited with {proc.returncode}:\n"
                                      + "\n".join(tail.splitlines()[-10:]))
            if port_file.exists():
                port = int(port_file.read_text())
                ch = open_channel(f"127.0.0.1:{port}", self.cfg.security)
                try:
                    if health_of(ch, SERVICE_NAMES[stage]) == "SERVING":
                        self.ports[stage] = port
                        return port
                finally:
                    ch.close()
            time.sleep(0.1)
        raise StackStartError(f"{stage} not serving within {timeout_s or self.cfg.start_timeout_s:.0f} s; log: "
                              f"{self.run_dir / (stage + '.log')}")

    def tail(self, stage: str, n: int = 40) -> str:
        try:
            return "\n".join((self.run_dir / f"{stage}.log").read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop_stage(self, stage: str, grace_s: float = 20.0) -> None:
        proc = self.procs.pop(stage, None)
        if proc is None:
            return
        stop_group(proc, grace_s)  # SIGTERM, then SIGKILL to what is left in the group (ranks, children)
        shutil.rmtree(self.temp_dir(stage), ignore_errors=True)

    def stop(self, keep_run_dir: bool = False) -> None:
        for stage in sorted(self.procs, key=lambda s: s != "render"):  # the render service first: it drives the rest
            self.stop_stage(stage)
        if self.own_run_dir and not keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CtrlC:
    """Ctrl-C while a local stack runs (`with CtrlC() as ctrl_c:`, the stack given as `ctrl_c.stack` once made): its
    line at once, naming what is stopped, then KeyboardInterrupt, which stops the stack; a second Ctrl-C while it
    stops kills its processes (SIGKILL to each process group). Without a stack, Ctrl-C is the plain
    KeyboardInterrupt; a process that ignores SIGINT (started in the background) keeps ignoring it."""

    def __init__(self):
        self.stack: EmbeddedStack | None = None
        self.stopping: list[subprocess.Popen] | None = None  # the stack's processes, once it stops
        self.previous = None

    def __enter__(self) -> "CtrlC":
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._interrupted)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def stop_stack(self) -> None:
        """Stop the stack; a Ctrl-C meanwhile kills it rather than cutting the stop short."""
        if self.stopping is None:
            self.stopping = list(self.stack.procs.values())
        self.stack.stop()

    def _interrupted(self, signum, frame) -> None:
        if self.stopping is not None:
            print("killing the local stack", file=sys.stderr, flush=True)
            for proc in self.stopping:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        if self.stack is None or not self.stack.procs:
            raise KeyboardInterrupt
        self.stopping = list(self.stack.procs.values())
        print(f"stopping the local stack ({', '.join(self.stack.procs)}) ... (Ctrl-C again kills it)",
              file=sys.stderr, flush=True)
        raise KeyboardInterrupt
