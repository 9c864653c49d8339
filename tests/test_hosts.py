"""Stages on two hosts, through real processes (docs/scale_out.md).

Two "hosts" are two loopback addresses (A = 127.0.0.2, B = 127.0.0.3: all of 127/8 is loopback on Linux), each with
its own run directory and lease directory, as two machines would have:

- a DiT tensor-parallel group spans them: one torchrun agent per host (`--nnodes 2`, c10d rendezvous on A, gloo over
  `lo`), A's rank 0 serving gRPC; the encoder and decoder serve on B; the render service on A drives all three;
- a render goes through, and its MP4 equals the one a one-host stack (the same 2-rank DiT on one host) makes; the
  two DiTs' latents for one seed are bitwise equal;
- each host's lease is its own: B's lease is taken by B's rank (A's rank 0 never writes B's lease directory), a stage
  waiting on B makes the DiT step aside there, and while B's device is held a DiT job waits;
- each host's budget is its own: B's smaller --memory-budget-gb refuses a job at admission (RESOURCE_EXHAUSTED naming
  host B) though A has none.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from client.pipeline import sample
from client.render_client import RenderClient
from client.stubs import Endpoints, StageClients
from h3.v1 import render_pb2
from minimax_h3.contract import RenderSpec
from stagekit.lease import read_events
from stagekit.procs import stop_group
from tests.render_svc_util import SERVER_ENV, holding_the_device, probe, tiny_request, wait_for

A, B = "127.0.0.2", "127.0.0.3"
SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=11)
BUDGET_B_GB = 0.05  # host B's per-device budget: room for SPEC's job, not for a 1344x768x124 one
# gloo's sockets on the loopback interface (on real hosts: the interface that reaches the other nodes)
ENV = {**SERVER_ENV, "GLOO_SOCKET_IFNAME": "lo"}


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class TwoHostDiT:
    """One DiT rank group over two hosts: a torchrun agent per host, joined by the c10d rendezvous on A. Ranks are
    ordered by the agents' `--local-addr`, so A's worker is rank 0 and serves gRPC."""

    def __init__(self, root: Path, cache: Path):
        self.root = root
        self.cache = cache
        self.procs: dict[str, subprocess.Popen] = {}

    def run_dir(self, addr: str) -> Path:
        return self.root / addr

    def start(self) -> str:
        rdzv = f"{A}:{free_port(A)}"
        for addr, extra in ((A, []), (B, ["--memory-budget-gb", str(BUDGET_B_GB)])):
            d = self.run_dir(addr)
            (d / "tmp").mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "dit-two-hosts",
                   "--local-addr", addr, "--max-restarts", "0",
                   "-m", "dit_svc", "--host", addr, "--port", "0", "--port-file", str(d / "dit.port"),
                   "--lease-dir", str(d / "leases"), "--devices", "virt0", "--cache-dir", str(self.cache),
                   "--collective-timeout-s", "30", *extra]
            with open(d / "dit.log", "ab") as log:
                self.procs[addr] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                    env={**os.environ, **ENV, "TMPDIR": str(d / "tmp")})
        port = wait_for(lambda: self._port(), 120, "the two-host DiT serving on A", self.log)
        return f"{A}:{port}"

    def _port(self) -> int | None:
        for addr, p in self.procs.items():
            assert p.poll() is None, f"the DiT agent on {addr} exited with {p.returncode}\n{self.log()}"
        f = self.run_dir(A) / "dit.port"
        return int(f.read_text()) if f.exists() and f.read_text().strip() else None

    def log(self) -> str:
        return "\n".join(f"--- {addr}\n" + (self.run_dir(addr) / "dit.log").read_text(errors="replace")[-3000:]
                         for addr in self.procs)

    def stop(self) -> None:
        for p in self.procs.values():
            stop_group(p, 20.0)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, model_cache):
    """A: DiT rank 0 (serving) and the render service; B: DiT rank 1, encoder, decoder. Plus `ref`: the same
    2-rank DiT and a render service on one host (127.0.0.1), for the equality checks."""
    root = tmp_path_factory.mktemp("hosts")
    dit = TwoHostDiT(root, model_cache)
    stage_b = EmbeddedStack(StackConfig(host=B, run_dir=str(root / B), lease_dir=str(root / B / "leases"),
                                        cache_dir=str(model_cache), devices="virt0", env=ENV))
    render_a = EmbeddedStack(StackConfig(host=A, run_dir=str(root / A / "render-svc"), env=ENV))
    ref = EmbeddedStack(StackConfig(run_dir=str(root / "one-host"), cache_dir=str(model_cache), devices="virt0",
                                    env=ENV, ranks={"dit": 2}))
    ref_render = EmbeddedStack(StackConfig(run_dir=str(root / "one-host-render"), env=ENV))
    started = [dit, stage_b, ref, render_a, ref_render]
    try:
        dit_addr = dit.start()
        for s in ("encoder", "decoder"):
            stage_b.start_stage(s)
        ref.start_stage("dit")
        for s in ("encoder", "decoder"):
            stage_b.wait_ready(s)
        ref.wait_ready("dit")
        enc_b, dec_b = (f"{B}:{stage_b.ports[s]}" for s in ("encoder", "decoder"))
        two_hosts = Endpoints(encoder=enc_b, dit=dit_addr, decoder=dec_b)
        render = render_a.start_render(two_hosts)
        ref_stages = Endpoints(encoder=enc_b, dit=f"127.0.0.1:{ref.ports['dit']}", decoder=dec_b)
        yield {"dit": dit, "stages": two_hosts, "render": render, "ref_stages": ref_stages,
               "ref_render": ref_render.start_render(ref_stages), "root": root}
    finally:
        for s in reversed(started):
            s.stop()


def dit_client(addr: str) -> StageClients:
    return StageClients(Endpoints(encoder=addr, dit=addr, decoder=addr))


def test_render_across_two_hosts_equals_one_host(hosts, tmp_path):
    paths = {}
    for name, target in (("two", hosts["render"]), ("one", hosts["ref_render"])):
        with RenderClient(target) as c:
            info = c.render(tiny_request("a harbour at dusk, two hosts", steps=2, seed=7), tmp_path / f"{name}.mp4")
        assert info.state == render_pb2.JOB_SUCCEEDED
        paths[name] = tmp_path / f"{name}.mp4"
    assert probe(paths["two"]) == {"width": 256, "height": 256, "frames": 22, "audio": 1}
    assert paths["two"].read_bytes() == paths["one"].read_bytes(), "the two-host render differs from the one-host one"
    # Each host's lease directory saw its own stages only: the DiT's rank on each, the encoder and decoder on B.
    root = hosts["root"]
    held = {addr: {e["holder"].split("@")[0] for e in read_events(root / addr / "leases") if e["event"] == "acquire"}
            for addr in (A, B)}
    assert held == {A: {"dit"}, B: {"dit", "encoder", "decoder"}}, held


def test_tp_across_hosts_bitwise_equals_one_host(hosts):
    text = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with dit_client(hosts["stages"].dit) as two, dit_client(hosts["ref_stages"].dit) as one:
        v2, a2, r2 = sample(two, SPEC, text)
        v1, a1, r1 = sample(one, SPEC, text)
    assert r2.extra["ranks"] == r1.extra["ranks"] == 2
    assert torch.equal(v2, v1) and torch.equal(a2, a1), "the same seed gave other latents across hosts"


def test_each_host_keeps_its_own_lease(hosts):
    """A stage waiting on B's device makes the DiT step aside on B; while B's device is held, a DiT job waits."""
    text = torch.randn(9, 64)
    lease_b = hosts["root"] / B / "leases"
    with dit_client(hosts["stages"].dit) as c:
        sample(c, SPEC, text)  # resident: the DiT holds A's and B's leases
        t0 = time.monotonic()
        with holding_the_device(lease_b):  # waits until the DiT, polled on B, gives B's device back
            stepped_aside = time.monotonic() - t0
            done = threading.Event()
            th = threading.Thread(target=lambda: (sample(c, SPEC, text), done.set()))
            th.start()
            assert not done.wait(2.0), "a DiT job ran while another holder had host B's device"
        th.join(60)
        assert done.is_set()
    assert stepped_aside < 30
    unloads = [e for e in read_events(hosts["root"] / A / "leases")
               if e["event"] == "unload_start" and e.get("reason") == "others_waiting"]
    assert unloads, "the DiT never stepped aside for the waiter on host B"


def test_each_host_keeps_its_own_budget(hosts):
    big = RenderSpec(prompt="x", width=1344, height=768, frames=124, steps=2, seed=1)
    with dit_client(hosts["stages"].dit) as c:
        with pytest.raises(grpc.RpcError) as e:
            sample(c, big, torch.randn(9, 64))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"memory budget on host {socket.gethostname()}:" in e.value.details()
    assert str(hosts["root"] / B / "leases") in e.value.details()
