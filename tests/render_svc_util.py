"""Helpers shared by the render service tests (tests/test_render_svc*.py): start/stop a real render service process
over the session's stage stack, tiny requests, condition waits."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import av

from client.embedded import EmbeddedStack, StackConfig
from client.render_client import render_request
from h3.v1 import render_pb2, render_pb2_grpc
from minimax_h3.contract import RenderSpec
from minimax_h3.services import Endpoints
from stagekit.channels import open_channel
from stagekit.lease import DeviceLease, LeaseConfig, events_per_stage, read_events

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TERMINAL = (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED)


def tiny_request(prompt: str = "a lighthouse in a storm, thunder and rain", steps: int = 1, seed: int = 0,
                 **kw) -> render_pb2.RenderRequest:
    return render_request(RenderSpec(prompt=prompt, width=256, height=256, frames=22, steps=steps, seed=seed), **kw)


class RenderService:
    """A real `python -m render_svc` process over given stage endpoints; its run dir (job database) outlives it."""

    def __init__(self, run_dir: Path, stages: Endpoints, extra: list[str] = ()):
        self.stack = EmbeddedStack(StackConfig(run_dir=str(run_dir), env=SERVER_ENV,
                                               extra_args={"render": list(extra)}))
        self.stages = stages
        self.target = ""

    def start(self) -> str:
        self.target = self.stack.start_render(self.stages)
        self.channel = open_channel(self.target)
        self.stub = render_pb2_grpc.RendererStub(self.channel)
        return self.target

    @property
    def pid(self) -> int:
        return self.stack.procs["render"].pid

    def kill(self) -> None:
        """SIGKILL: no drain, nothing flushed but what SQLite committed."""
        proc = self.stack.procs.pop("render")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.channel.close()

    def stop(self) -> None:
        if "render" in self.stack.procs:
            self.channel.close()
        self.stack.stop()

    def log(self) -> str:
        return self.stack.tail("render", 200)

    def wait_state(self, job_id: str, states, timeout_s: float = 180.0) -> render_pb2.JobInfo:
        return wait_for(lambda: (i := self.stub.Get(render_pb2.JobRef(job_id=job_id), timeout=10)).state in states
                        and i, timeout_s, f"job {job_id} in {states}", self.log)


@contextmanager
def serving(run_dir: Path, stages: Endpoints, extra: list[str] = ()):
    """A started render service, stopped (SIGTERM) when the block ends."""
    svc = RenderService(run_dir, stages, extra)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def wait_for(cond, timeout_s: float, what: str, log=lambda: ""):
    """Poll `cond` until it returns something truthy (returned); fail with `what` (and a log) after the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{log()}")


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        return {"width": v.width, "height": v.height, "frames": sum(1 for _ in c.decode(video=0)),
                "audio": len(c.streams.audio)}


def swaps(lease_dir: Path, t0: float, t1: float) -> dict[str, int]:
    """Lease acquisitions (= weight swaps in exclusive residency) per stage between t0 and t1."""
    return events_per_stage(read_events(Path(lease_dir)), t0, t1)


@contextmanager
def holding_the_device(lease_dir: Path, device: str = "virt0"):
    """Hold the stages' device lease (as a waiting stage would): every stage call blocks in the stage until it is
    released, so a job stays exactly where it is (deterministic mid-stage cancels and kills)."""
    lease = DeviceLease([device], LeaseConfig(Path(lease_dir), f"test@pid{os.getpid()}"))
    lease.acquire(timeout_s=120)
    try:
        yield lease
    finally:
        lease.release()


def self_signed_cert(d: Path, ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """(cert, key) for 127.0.0.1 / localhost (and `ips`), made with the openssl CLI (the test is skipped without
    it)."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (needed to make a self-signed certificate)")
    cert, key = d / "cert.pem", d / "key.pem"
    names = ",".join(f"IP:{ip}" for ip in ("127.0.0.1", *ips)) + ",DNS:localhost"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", f"subjectAltName={names}"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def token_file(d: Path, token: str) -> Path:
    """A file holding `token`, readable by its owner only (servers take tokens from files, never the command line)."""
    f = d / "token"
    f.write_text(token + "\n")
    f.chmod(0o600)
    return f
