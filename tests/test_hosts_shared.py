"""A DiT group across two hosts in shared residency: every host's memory budget holds the group's reservation
(docs/scale_out.md). Hosts as in tests/test_hosts.py (tests/hosts_util.py).

- a job reserves its bytes in each host's own budget ledger (b's lease directory has the DiT's reservation), and
  gives every host's back when the DiT unloads;
- a stage on b waiting for budget room makes the resident DiT step aside there; while b's budget is full, a DiT job
  waits for room, and runs once it is free;
- a rank killed on b breaks the group: rank 0 on a notices (its idle poll of b fails), stops serving and exits, and
  torchrun's agents restart the group on both hosts, which serves the next job.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from minimax_h3.contract import RenderSpec
from minimax_h3.services import SERVICE_NAMES, Endpoints, StageClients
from render_svc.stage_calls import sample
from stagekit.budget import GIB, BudgetConfig, MemoryBudget
from stagekit.channels import health_of, open_channel
from stagekit.lease import read_events
from tests.hosts_util import make_hosts
from tests.procs import rank_pids
from tests.render_svc_util import wait_for

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=3)
BUDGET_B = int(0.05 * GIB)  # host b's per-device budget; a has none (virtual devices: unlimited)


@pytest.fixture
def dit(tmp_path_factory, model_cache):
    """A DiT group over hosts a and b, fresh for each test: one counts the reservations and unloads a fresh group
    makes, the other restarts the group."""
    h = make_hosts(tmp_path_factory.mktemp("hosts-shared"), model_cache)
    try:
        shared = ["--residency", "shared"]
        h.start_dit({"a": shared, "b": [*shared, "--memory-budget-gb", str(BUDGET_B / GIB)]}, restarts=1)
        yield h
    finally:
        h.stop()
        h.net.close()


def reservations(h, host: str, event: str) -> list[dict]:
    return [e for e in read_events(h.lease_dir(host)) if e["event"] == event and e["holder"].startswith("dit@")]


def client(h) -> StageClients:
    return StageClients(Endpoints(*[h.address("a", "dit")] * 3), h.security)


def test_each_host_holds_the_reservation_and_steps_aside_for_room(dit):
    h = dit
    with client(h) as c:
        text = torch.randn(9, 64)
        sample(c, SPEC, text)  # resident: a reservation on each host
        for host in "ab":
            (resv,) = reservations(h, host, "budget_reserve")
            assert resv["bytes"] > 0 and resv["budget"] == (BUDGET_B if host == "b" else 0), resv
        # A stage on b wanting all of b's budget: the DiT, polled on b, gives b's room (and a's) back.
        other = MemoryBudget(["virt0"], BudgetConfig(h.lease_dir("b"), f"test@pid{os.getpid()}", BUDGET_B, 60.0))
        waited = other.reserve(BUDGET_B)
        try:
            assert waited < 30
            assert [e["reason"] for e in read_events(h.lease_dir("a"))
                    if e["event"] == "unload_start"] == ["others_waiting"]
            assert all(len(reservations(h, host, "budget_release")) == 1 for host in "ab")
            # b's budget is full: the next job waits for room there.
            done = threading.Event()
            th = threading.Thread(target=lambda: (sample(c, SPEC, text), done.set()))
            th.start()
            assert not done.wait(2.0), "a DiT job ran while host b's budget had no room for it"
        finally:
            other.release()
        th.join(60)
        assert done.is_set()
        assert len(reservations(h, "b", "budget_reserve")) == 2


def test_a_rank_dead_on_the_other_host_restarts_the_group(dit):
    h = dit
    old = h.address("a", "dit")
    with client(h) as c:
        sample(c, SPEC, torch.randn(9, 64))  # resident: rank 0 polls b while idle
    (follower,) = [pid for rank, pid in rank_pids(h.procs["dit@b"].pid).items() if rank == 1]
    os.kill(follower, signal.SIGKILL)
    ch = open_channel(old, h.security)
    try:
        wait_for(lambda: health_of(ch, SERVICE_NAMES["dit"]) != "SERVING", 60, "rank 0 to stop serving", h.log)
    finally:
        ch.close()
    with client(h) as c:  # the restarted group: a new rank 0 on a, serving on a port of its own (--port 0)
        v, a, r = sample(c, SPEC, torch.randn(9, 64))
    assert r.extra["ranks"] == 2 and torch.isfinite(v).all()
    assert h.procs["dit@a"].poll() is None and h.procs["dit@b"].poll() is None
