"""Stages on two hosts, through real processes (docs/scale_out.md).

Two "hosts" A and B, each with its own network, run directory and lease directory, as two machines would have:
network namespaces joined by a bridge where this process may make them (root, iproute2: tests/hosts_util.py), else two
loopback addresses (127.0.0.2, 127.0.0.3: all of 127/8 is loopback on Linux). Every server speaks TLS with a token,
as off loopback it must.

- a DiT tensor-parallel group spans the hosts: one torchrun agent per host (`--nnodes 2`, c10d rendezvous on A, gloo
  on each host's interface), A's rank 0 serving gRPC; the encoder and decoder serve on B; the render service on A
  drives all three;
- a render goes through, and its MP4 equals the one a one-host stack (the same 2-rank DiT on one host) makes; the
  two DiTs' latents for one seed are bitwise equal;
- each host's lease is its own: only B's own ranks write B's lease directory, a stage waiting on B makes the DiT
  step aside there, and while B's device is held a DiT job waits;
- each host's budget is its own: B's smaller --memory-budget-gb refuses a job at admission (RESOURCE_EXHAUSTED
  naming host B) though A has none;
- two nodes of one group sharing a lease directory are refused, and so is a multi-node group over torchrun's shared
  store (stagekit/dist.py, `multi_node_store_error`).
Shared residency (every host's budget reservations): tests/test_hosts_shared.py.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from client.render_client import RenderClient
from h3.v1 import render_pb2
from minimax_h3.contract import RenderSpec
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import sample
from stagekit.dist import RankInfo, multi_node_store_error
from stagekit.hosts import NodeInfo, plan_hosts
from stagekit.lease import DeviceLease, LeaseConfig, read_events
from tests.hosts_util import make_hosts
from tests.render_svc_util import SERVER_ENV, holding_the_device, probe, tiny_request

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=11)
BUDGET_B_GB = 0.05  # host B's per-device budget: room for SPEC's job, not for a 1344x768x124 one
LEASE_TIMEOUT_S = 8  # the DiT's wait for every host's lease: past it, the job fails and nothing stays taken


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, model_cache):
    """a: DiT rank 0 (serving) and the render service; b: DiT rank 1, encoder, decoder. Plus `ref`: the same 2-rank
    DiT and a render service on one host (127.0.0.1 in our network), for the equality checks."""
    root = tmp_path_factory.mktemp("hosts")
    h = make_hosts(root, model_cache)
    security, tls_args = h.security, h.tls_args
    ref = EmbeddedStack(StackConfig(run_dir=str(root / "one-host"), cache_dir=str(model_cache), devices="virt0",
                                    env={**SERVER_ENV, "GLOO_SOCKET_IFNAME": "lo"}, ranks={"dit": 2},
                                    security=security, extra_args={
                                        "dit": tls_args, "render": [*tls_args, "--stage-tls-ca", security.tls_ca]}))
    try:
        timeout = ["--lease-timeout-s", str(LEASE_TIMEOUT_S)]
        h.start_dit({"a": timeout, "b": [*timeout, "--memory-budget-gb", str(BUDGET_B_GB)]})
        for s in ("encoder", "decoder"):
            h.start_stage("b", s)
        ref.start_stage("dit")
        two_hosts = Endpoints(encoder=h.address("b", "encoder"), dit=h.address("a", "dit"),
                              decoder=h.address("b", "decoder"))
        h.start_render("a", two_hosts)
        ref.wait_ready("dit")
        ref_stages = Endpoints(encoder=two_hosts.encoder, dit=f"127.0.0.1:{ref.ports['dit']}",
                               decoder=two_hosts.decoder)
        ref_render = ref.start_render(ref_stages)
        yield {"hosts": h, "stages": two_hosts, "render": h.address("a", "render"), "ref_stages": ref_stages,
               "ref_render": ref_render, "security": security}
    finally:
        h.stop()
        ref.stop()
        h.net.close()


def dit_client(hosts, addr: str) -> StageClients:
    return StageClients(Endpoints(encoder=addr, dit=addr, decoder=addr), hosts["security"])


def test_render_across_two_hosts_equals_one_host(hosts, tmp_path):
    paths = {}
    for name in ("render", "ref_render"):
        paths[name] = tmp_path / f"{name}.mp4"
        with RenderClient(hosts[name], hosts["security"]) as c:
            info = c.render(tiny_request("a harbour at dusk, two hosts", steps=2, seed=7), paths[name])
        assert info.state == render_pb2.JOB_SUCCEEDED
    assert probe(paths["render"]) == {"width": 256, "height": 256, "frames": 22, "audio": 1}
    assert paths["render"].read_bytes() == paths["ref_render"].read_bytes(), "two hosts rendered another MP4"
    # Each host's lease directory saw its own stages only: the DiT's rank on each, the encoder and decoder on b (and
    # the module's tests' own holds, "test@pid...").
    h = hosts["hosts"]
    held = {host: {e["holder"].split("@")[0] for e in read_events(h.lease_dir(host)) if e["event"] == "acquire"}
            - {"test"} for host in "ab"}
    assert held == {"a": {"dit"}, "b": {"dit", "encoder", "decoder"}}, held


def test_tp_across_hosts_bitwise_equals_one_host(hosts):
    text = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with dit_client(hosts, hosts["stages"].dit) as two, dit_client(hosts, hosts["ref_stages"].dit) as one:
        v2, a2, r2 = sample(two, SPEC, text)
        v1, a1, r1 = sample(one, SPEC, text)
    assert r2.extra["ranks"] == r1.extra["ranks"] == 2
    assert torch.equal(v2, v1) and torch.equal(a2, a1), "the same seed gave other latents across hosts"


def test_each_host_keeps_its_own_lease(hosts):
    """A holder waiting on b's device makes the DiT step aside on b; while b's device is held, a DiT job waits."""
    text = torch.randn(9, 64)
    h = hosts["hosts"]
    with dit_client(hosts, hosts["stages"].dit) as c:
        sample(c, SPEC, text)  # resident: the DiT holds a's and b's leases
        t0 = time.monotonic()
        with holding_the_device(h.lease_dir("b")):  # waits until the DiT, polled on b, gives b's device back
            stepped_aside = time.monotonic() - t0
            done = threading.Event()
            th = threading.Thread(target=lambda: (sample(c, SPEC, text), done.set()))
            th.start()
            assert not done.wait(2.0), "a DiT job ran while another holder had host b's device"
        th.join(60)
        assert done.is_set()
    assert stepped_aside < 30
    unloads = [e for e in read_events(h.lease_dir("a"))
               if e["event"] == "unload_start" and e.get("reason") == "others_waiting"]
    assert unloads, "the DiT never stepped aside for the waiter on host b"


def test_a_host_busy_too_long_fails_the_job_and_keeps_nothing(hosts):
    """b's device held past --lease-timeout-s: the job fails naming host b, and a's lease, taken first, is free."""
    h = hosts["hosts"]
    with dit_client(hosts, hosts["stages"].dit) as c, holding_the_device(h.lease_dir("b")):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            sample(c, SPEC, torch.randn(9, 64))
        assert time.monotonic() - t0 >= LEASE_TIMEOUT_S - 1
        assert DeviceLease(["virt0"], LeaseConfig(h.lease_dir("a"), "probe")).holder_of("virt0") == ""
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"on host {socket.gethostname()}:{h.lease_dir('b')}" in e.value.details()


def test_each_host_keeps_its_own_budget(hosts):
    big = RenderSpec(prompt="x", width=1344, height=768, frames=124, steps=2, seed=1)
    with dit_client(hosts, hosts["stages"].dit) as c:
        with pytest.raises(grpc.RpcError) as e:
            sample(c, big, torch.randn(9, 64))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"memory budget on host {socket.gethostname()}:{hosts['hosts'].lease_dir('b')}" in e.value.details()


def test_nodes_sharing_a_lease_dir_are_refused():
    key = ("box", "/run/leases")
    plan = plan_hosts([NodeInfo(0, key, 0, ("virt0",)), None, NodeInfo(1, key, 0, ("virt0",))], False, True)
    assert "nodes 0 and 1 use one lease directory /run/leases on host box" in plan.error
    ok = plan_hosts([NodeInfo(0, key, 0, ("virt0",)), NodeInfo(1, ("box", "/other"), 1 << 30, ("virt0",))], False, True)
    assert not ok.error and ok.use_budget  # one host with a finite budget: every host keeps one


def test_a_multi_node_group_needs_a_store_per_attempt():
    one_node = RankInfo(1, 2, 1, agent_store=True, local_world_size=2)
    assert multi_node_store_error(one_node) == ""
    shared = RankInfo(1, 2, 0, agent_store=True, node_rank=1, local_world_size=1)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in multi_node_store_error(shared)
    assert multi_node_store_error(RankInfo(1, 2, 0, agent_store=False, node_rank=1, local_world_size=1)) == ""
