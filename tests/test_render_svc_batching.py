"""Stage batching across clients.

- The planner (render_svc/planner.py, `choose_batch`, pure): queued work is served stage by stage in batches; it
  stays on the resident stage while that keeps every other waiting job within the fairness bound, and under random
  arrivals no ready job waits more than `max_wait` batches.
- Real processes: 8 client processes x 3 jobs each (`python -m client render --prompts-file`, thin clients)
  against one render service over the session's stage stack (exclusive residency on one virtual device). Weight
  swaps, counted as lease acquisitions in the stages' event log, are far fewer than jobs x stages; every MP4 is
  valid and every job's record shows the batch it shared.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from h3.v1 import render_pb2
from render_svc.graph import GRAPH
from render_svc.planner import Assignment, Batch, BatchPlanner, choose_batch
from tests.render_svc_util import ROOT, RenderService, probe, swaps


def next_batch(p: BatchPlanner, stages: tuple[str, ...] = GRAPH.stages, group: str = "") -> Batch | None:
    """Group `group`'s next batch among its `stages` (`choose_batch` over the planner's queues), started (`take`)."""
    picked = choose_batch(p.queued(), stages, p.current.get(group))
    if picked is None:
        return None
    stage, taken, passed = picked
    return p.take(Assignment(stage, (group,), group, (tuple(j.job_id for j in taken),), passed))


def move_on(p: BatchPlanner, b: Batch) -> None:
    """The jobs of a batch that ran, each queued for its next stage (a render's last stage ends it)."""
    for j in b.job_ids:
        if (nxt := GRAPH.next_stage(b.stage, GRAPH.stages)) is not None:
            p.add(j, nxt)


def _drain(p: BatchPlanner) -> list[tuple[str, int]]:
    out = []
    while (b := next_batch(p)) is not None:
        out.append((b.stage, len(b.job_ids)))
        move_on(p, b)
    return out


def test_planner_batches_by_stage():
    p = BatchPlanner(max_batch=8, max_wait=4)
    for i in range(24):
        p.add(f"j{i}", "encoder")
    got = _drain(p)
    assert got == [("encoder", 8)] * 3 + [("dit", 8)] * 3 + [("decoder", 8)] * 3  # 3 stage changes, not 72


@pytest.mark.parametrize("max_batch,max_wait,arrivals", [
    (8, 4, (0, 0, 1, 1, 2)), (8, 4, (0,) * 7 + (4,)), (8, 3, (0, 0, 1, 1, 2)), (4, 4, (0, 1)), (16, 4, (0, 0, 1, 1, 2)),
])
def test_planner_fairness_bound_under_random_arrivals(max_batch, max_wait, arrivals):
    """Arrivals within capacity (what arrives during max_wait batches fits a batch): no ready job waits more than
    max_wait batches, while batches still hold several jobs."""
    rng = random.Random(0)
    p = BatchPlanner(max_batch=max_batch, max_wait=max_wait)
    worst, n, served, batches = 0, 0, 0, 0
    for _ in range(3000):
        for _ in range(rng.choice(arrivals)):
            p.add(f"j{n}", rng.choice(GRAPH.stages[:2]))  # fl2va jobs start with keyframes, t2va with the encoder
            n += 1
        b = next_batch(p)
        if b is None:
            continue
        worst = max(worst, *b.waited.values())
        served, batches = served + len(b.job_ids), batches + 1
        move_on(p, b)
    assert worst <= max_wait and served / batches > 1.2, (worst, served / batches)


def test_planner_stays_on_the_resident_stage_within_the_bound():
    p = BatchPlanner(max_batch=1, max_wait=3)
    p.add("a", "dit")
    for i in range(6):
        p.add(f"e{i}", "encoder")
    stages = [next_batch(p).stage for _ in range(5)]
    # encoder stays (no swap) until "a" has waited as long as the bound allows, then it runs
    assert stages[:4].count("dit") == 1 and stages.index("dit") <= 3


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("render-batch"), endpoints)
    s.start()
    yield s
    s.stop()


def test_eight_clients_three_jobs_each_share_stage_batches(stack, svc, tmp_path):
    stage_stack, _ = stack
    clients, per_client = 8, 3
    t0 = time.time()
    procs = []
    for c in range(clients):
        prompts = tmp_path / f"client{c}.txt"
        prompts.write_text("".join(f"client {c} take {k}: rain, a bell, footsteps\n" for k in range(per_client)))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "client", "render", "--render", svc.target, "--prompts-file", str(prompts),
             "-o", str(tmp_path / f"out{c}"), "--width", "256", "--height", "256", "--frames", "22", "--steps", "1",
             "--label", f"client{c}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    t1 = time.time()
    for c in range(clients):
        for k in range(per_client):
            assert probe(tmp_path / f"out{c}" / f"{k:03d}.mp4")["frames"] == 22
    jobs = [j for j in svc.stub.List(render_pb2.ListRequest(limit=100), timeout=30).jobs
            if j.label.startswith("client")]
    assert len(jobs) == clients * per_client and all(j.state == render_pb2.JOB_SUCCEEDED for j in jobs), \
        [(j.label, render_pb2.JobState.Name(j.state), j.error_code, j.error) for j in jobs
         if j.state != render_pb2.JOB_SUCCEEDED] or len(jobs)
    n = swaps(stage_stack.lease_dir, t0, t1)
    total = sum(n.values())
    print(f"weight swaps for {len(jobs)} jobs x 3 stages: {n} (total {total})")
    assert total < len(jobs) * 3, n
    runs = [r for j in jobs for r in j.stages]
    assert max(r.batch_size for r in runs) > 1 and all(r.waited_batches <= 4 for r in runs)
    assert len({r.batch for r in runs if r.stage == "decoder"}) < len(jobs), "decodes shared batches"
