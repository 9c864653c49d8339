"""Stages working at the same time: the render service's resource groups.

- Pure: which stage services take turns (`resource_groups`: a shared device taken by an exclusive stage joins them;
  shared residency, other devices or other hosts do not; a stage not heard from joins everything), and the planner's
  batches per group (a group batches only its own stages; its waits and its fairness bound are its own).
- Real processes: the three stages each on its own virtual device (virt0, virt1, virt2; exclusive residency). The
  render service reads their devices from their Status and runs three groups: while the decoder serves one job, the
  next goes through the encoder and the DiT. With --no-pipeline (one group) the next job waits for the decoder's
  batch. Over the session's stack (every stage on virt0) the render service runs one group.
"""

from __future__ import annotations

import random

import pytest

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, render_pb2
from render_svc.graph import GRAPH
from render_svc.planner import BatchPlanner, Resources, resource_groups
from tests.render_svc_util import SERVER_ENV, holding_the_device, serving, tiny_request, wait_for
from tests.test_render_svc_batching import move_on, next_batch

NODES = ("encoder", "dit", "decoder")
DEVICES = {"encoder": "virt0", "dit": "virt1", "decoder": "virt2"}


def test_resource_groups_follow_shared_devices():
    own = {n: Resources("h", (f"virt{i}",), True) for i, n in enumerate(NODES)}
    assert resource_groups(NODES, own) == [("encoder",), ("dit",), ("decoder",)]
    one = {n: Resources("h", ("GPU-1",), True) for n in NODES}
    assert resource_groups(NODES, one) == [NODES]
    # the DiT on two GPUs, one of them the encoder's: they take turns; the decoder on a third runs beside them
    two = {"encoder": Resources("h", ("GPU-1",), True), "dit": Resources("h", ("GPU-1", "GPU-2"), True),
           "decoder": Resources("h", ("GPU-3",), True)}
    assert resource_groups(NODES, two) == [("encoder", "dit"), ("decoder",)]
    shared = {n: Resources("h", ("GPU-1",), False) for n in NODES}  # all resident: they overlap on the card
    assert resource_groups(NODES, shared) == [("encoder",), ("dit",), ("decoder",)]
    hosts = {n: Resources(f"host{i}", ("virt0",), True) for i, n in enumerate(NODES)}  # same name, other machines
    assert resource_groups(NODES, hosts) == [("encoder",), ("dit",), ("decoder",)]
    unknown = {"encoder": own["encoder"], "decoder": own["decoder"]}  # the DiT has not answered yet
    assert resource_groups(NODES, unknown) == [NODES]
    assert resource_groups(NODES, own, serial=True) == [NODES]


def test_planner_batches_each_group_on_its_own_stages():
    p = BatchPlanner(max_batch=8, max_wait=4)
    for i in range(3):
        p.add(f"e{i}", "encoder")
        p.add(f"d{i}", "decoder")
    b = next_batch(p, ("keyframes", "encoder", "dit"), "A")
    assert (b.stage, b.job_ids, b.group) == ("encoder", ["e0", "e1", "e2"], "A")
    # the decoder's jobs did not wait for group A's batch: it is not their group
    d = next_batch(p, ("decoder",), "B")
    assert d.stage == "decoder" and set(d.waited.values()) == {0}
    assert next_batch(p, ("keyframes", "encoder", "dit"), "A") is None


@pytest.mark.parametrize("max_batch,max_wait", [(8, 4), (4, 3)])
def test_planner_fairness_bound_holds_per_group(max_batch, max_wait):
    """Two groups share the planner's queues (keyframes + decoder on one device, encoder + DiT on another); under
    arrivals within capacity no ready job waits more than max_wait batches of its own group, and the groups'
    batches still hold several jobs."""
    groups = {"vae": ("keyframes", "decoder"), "gpu": ("encoder", "dit")}
    rng = random.Random(1)
    p = BatchPlanner(max_batch=max_batch, max_wait=max_wait)
    worst, n, served, batches = 0, 0, 0, 0
    for _ in range(3000):
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            p.add(f"j{n}", rng.choice(GRAPH.stages[:2]))
            n += 1
        for name, stages in groups.items():
            b = next_batch(p, stages, name)
            if b is None:
                continue
            assert b.stage in stages and b.group == name
            worst = max(worst, *b.waited.values())
            served, batches = served + len(b.job_ids), batches + 1
            move_on(p, b)
    assert worst <= max_wait and served / batches > 1.2, (worst, served / batches)


@pytest.fixture(scope="module")
def three_devices(tmp_path_factory, model_cache):
    """The three stages as real processes, each on its own virtual device (exclusive residency)."""
    s = EmbeddedStack(StackConfig(cache_dir=str(model_cache), run_dir=str(tmp_path_factory.mktemp("stack3")),
                                  env={**SERVER_ENV, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                                  extra_args={n: ["--devices", DEVICES[n], "--idle-unload-s", "5"] for n in NODES}))
    endpoints = s.start()
    yield s, endpoints
    s.stop()


def _groups(svc) -> list[str]:
    return list(svc.stub.Status(common_pb2.StatusRequest(), timeout=10).stage_groups)


def _stages_run(info: render_pb2.JobInfo) -> list[str]:
    return [r.stage for r in info.stages]


def test_a_job_goes_through_encoder_and_dit_while_another_decodes(three_devices, tmp_path):
    stack, endpoints = three_devices
    with serving(tmp_path / "render", endpoints) as svc:
        wait_for(lambda: _groups(svc) == ["encoder", "dit", "decoder"], 30, "three resource groups", svc.log)
        with holding_the_device(stack.lease_dir, DEVICES["decoder"]):  # the decoder's call waits in the stage
            a = svc.stub.Submit(tiny_request("first: rain on a tin roof"), timeout=30).job_id
            wait_for(lambda: _stages_run(svc.stub.Get(render_pb2.JobRef(job_id=a), timeout=10)) == ["encoder", "dit"],
                     60, "job a at the decoder", svc.log)
            b = svc.stub.Submit(tiny_request("second: a bell in the fog"), timeout=30).job_id
            info = wait_for(lambda: (i := svc.stub.Get(render_pb2.JobRef(job_id=b), timeout=10)).stage == "decoder"
                            and _stages_run(i) == ["encoder", "dit"] and i, 60, "job b past encoder and DiT", svc.log)
            assert info.stages[1].batch != svc.stub.Get(render_pb2.JobRef(job_id=a), timeout=10).stages[1].batch
            assert svc.stub.Get(render_pb2.JobRef(job_id=a), timeout=10).state == render_pb2.JOB_RUNNING
        for j in (a, b):
            assert svc.wait_state(j, (render_pb2.JOB_SUCCEEDED,), 90).stages[-1].stage == "decoder"


def test_serial_mode_runs_one_batch_at_a_time(three_devices, tmp_path):
    stack, endpoints = three_devices
    with serving(tmp_path / "render", endpoints, ["--no-pipeline"]) as svc:
        assert _groups(svc) == ["encoder+dit+decoder"]
        with holding_the_device(stack.lease_dir, DEVICES["decoder"]):
            a = svc.stub.Submit(tiny_request("first: waves on rocks"), timeout=30).job_id
            wait_for(lambda: _stages_run(svc.stub.Get(render_pb2.JobRef(job_id=a), timeout=10)) == ["encoder", "dit"],
                     60, "job a at the decoder", svc.log)
            b = svc.stub.Submit(tiny_request("second: wind in dry grass"), timeout=30).job_id
            # the decoder's batch holds the one group: b is not encoded while it runs
            with pytest.raises(AssertionError):
                wait_for(lambda: _stages_run(svc.stub.Get(render_pb2.JobRef(job_id=b), timeout=10)), 3, "b encoded")
        for j in (a, b):
            svc.wait_state(j, (render_pb2.JOB_SUCCEEDED,), 90)


def test_stages_on_one_device_form_one_group(stack, tmp_path):
    _, endpoints = stack
    with serving(tmp_path / "render", endpoints) as svc:
        job = svc.stub.Submit(tiny_request("one device: a kettle whistles"), timeout=30).job_id
        svc.wait_state(job, (render_pb2.JOB_SUCCEEDED,), 90)  # its first batch waited for the stages' Status
        assert _groups(svc) == ["encoder+dit+decoder"]
