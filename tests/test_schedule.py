"""The render service's one scheduling decision, `render_svc.planner.schedule(view, queues) -> assignments`, driven as
a function over plain data: which replica a job runs on and why (its affinity, what the replicas serve, which are
suspect or down), which batch a group runs (the fairness bound), which groups run at once (shared devices), and how a
DiT batch is sent (one partition per round)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from render_svc.graph import GRAPH
from render_svc.planner import (Affinity, Assignment, ClusterView, QueuedJob, Queues, ReplicaState, Resources,
                                Serves, resource_groups, schedule)

GRAIN = (("grain.safetensors", 1.0),)
SHELF = ("/models/loras", ("grain.safetensors",), False)  # a DiT's loras directory holding one file


def view(*replicas: ReplicaState, groups=None, last_stage=None) -> ClusterView:
    """Replicas, each a group of its own unless `groups` says otherwise."""
    return ClusterView(tuple(replicas), tuple(groups or ((r.node,) for r in replicas)),
                       MappingProxyType(last_stage or {}))


def queues(max_batch: int = 8, max_wait: int = 4, **by_stage: list[QueuedJob]) -> Queues:
    return Queues(max_batch, max_wait, MappingProxyType({s: tuple(by_stage.get(s, ())) for s in GRAPH.stages}))


def dit(name: str, **kw) -> ReplicaState:
    return ReplicaState(f"dit/{name}", "dit", **{"resident": Affinity(), **kw})


def where(assignments: list[Assignment]) -> dict[str, tuple[str, ...]]:
    """replica -> the job ids assigned to it."""
    return {a.replica: a.job_ids for a in assignments}


def test_a_job_runs_on_the_replica_that_holds_its_lora():
    """Why did this job run on dit/b: b's last job sampled with the same LoRA, so b takes it without a swap, though
    a has been idle longer and serves it as well."""
    reps = (dit("a", last_started=1.0), dit("b", last_started=5.0, resident=Affinity("fl2va", GRAIN)))
    got = schedule(view(*reps), queues(dit=[QueuedJob("j", partition="fl2va", loras=GRAIN)]))
    assert where(got) == {"dit/b": ("j",)}
    # without the affinity, the one idle longest takes it
    got = schedule(view(dit("a", last_started=1.0), dit("b", last_started=5.0)), queues(dit=[QueuedJob("j")]))
    assert where(got) == {"dit/a": ("j",)}


def test_a_job_runs_on_the_replica_that_holds_its_partition():
    reps = (dit("a"), dit("b", resident=Affinity("ref2va")))
    got = schedule(view(*reps), queues(dit=[QueuedJob("r", partition="ref2va"), QueuedJob("f")]))
    assert got[0].replica == "dit/b" and got[0].job_ids == ("r", "f")


def test_a_replica_takes_only_the_jobs_it_serves_while_another_serves_them():
    """dit/a lacks the LoRA and serves no ref2va: the LoRA job and the reference job go to dit/b, though dit/a is
    preferred (idle longest); a job no replica serves goes to one anyway (its refusal ends the job)."""
    a = dit("a", serves=Serves(frozenset({"fl2va"}), ("/models/loras", (), False)))
    b = dit("b", last_started=9.0, serves=Serves(frozenset({"fl2va", "ref2va"}), SHELF))
    jobs = [QueuedJob("lora", loras=GRAIN), QueuedJob("ref", partition="ref2va"), QueuedJob("plain"),
            QueuedJob("nowhere", loras=(("missing.safetensors", 1.0),))]
    got = where(schedule(view(a, b), queues(dit=jobs)))
    assert got == {"dit/a": ("plain", "nowhere"), "dit/b": ("lora", "ref")}


def test_a_suspect_replica_gets_nothing_while_another_serves():
    jobs = queues(dit=[QueuedJob("j0"), QueuedJob("j1")])
    assert where(schedule(view(dit("a", suspect=True), dit("b")), jobs)) == {"dit/b": ("j0", "j1")}
    # the other one busy: the suspect still waits for it
    assert schedule(view(dit("a", suspect=True), dit("b", busy=True)), jobs) == []
    # a replica that did not answer is out the same way
    assert where(schedule(view(dit("a"), dit("b", down=True)), jobs)) == {"dit/a": ("j0", "j1")}
    # the service's only replica in rotation is none: the suspect serves (as a lone replica would)
    assert where(schedule(view(dit("a", suspect=True), dit("b", down=True)), jobs)) == {"dit/a": ("j0", "j1")}


def test_the_shortest_queue_serves_a_group_stage():
    """Two encoders in one group (one device): the one whose Status shows the shorter queue takes the batch."""
    reps = (ReplicaState("encoder/a", "encoder", queue_depth=3), ReplicaState("encoder/b", "encoder", queue_depth=1))
    got = schedule(view(*reps, groups=[("encoder/a", "encoder/b")]), queues(encoder=[QueuedJob("j")]))
    assert [(a.replica, a.group) for a in got] == [("encoder/b", ("encoder/a", "encoder/b"))]


def test_jobs_older_than_max_wait_batches_go_first():
    """One group, its encoder resident (its last stage): it stays there while the DiT job can still wait, and runs
    the DiT job once it has waited --max-wait-batches batches."""
    one = view(ReplicaState("encoder", "encoder"), dit("a"), ReplicaState("decoder", "decoder"),
               groups=[("encoder", "dit/a", "decoder")], last_stage={"encoder+dit/a+decoder": "encoder"})
    fresh = [QueuedJob("e0")]
    (stay,) = schedule(one, queues(max_wait=4, encoder=fresh, dit=[QueuedJob("d", waited=3)]))
    assert (stay.stage, stay.job_ids, stay.passed) == ("encoder", ("e0",), ("d",))  # "d" waits one batch more
    (due,) = schedule(one, queues(max_wait=4, encoder=fresh, dit=[QueuedJob("d", waited=4)]))
    assert (due.stage, due.job_ids, due.passed) == ("dit", ("d",), ("e0",))


def test_stages_sharing_a_device_are_not_run_at_once():
    """The encoder and the DiT on one GPU take turns (one group: one batch); the decoder on another runs beside."""
    nodes = ("encoder", "dit", "decoder")
    groups = resource_groups(nodes, {"encoder": Resources("h", ("GPU-1",), True),
                                     "dit": Resources("h", ("GPU-1",), True),
                                     "decoder": Resources("h", ("GPU-2",), True)})
    reps = (ReplicaState("encoder", "encoder"), ReplicaState("dit", "dit", resident=Affinity()),
            ReplicaState("decoder", "decoder"))
    work = queues(encoder=[QueuedJob("e")], dit=[QueuedJob("d")], decoder=[QueuedJob("v")])
    got = schedule(view(*reps, groups=groups), work)
    assert sorted((a.group, a.stage) for a in got) == [(("decoder",), "decoder"), (("encoder", "dit"), "dit")]
    # the group busy: nothing more starts on its device
    busy = (reps[0], ReplicaState("dit", "dit", busy=True), reps[2])
    assert [a.stage for a in schedule(view(*busy, groups=groups), work)] == ["decoder"]


def test_fl2va_and_ref2va_jobs_are_not_sent_together():
    """A DiT batch goes partition by partition, the one the replica holds first; the replica holds the last one
    (and its last job's LoRAs) after it."""
    jobs = [QueuedJob("f0"), QueuedJob("r0", partition="ref2va", loras=GRAIN), QueuedJob("f1")]
    (a,) = schedule(view(dit("a", resident=Affinity("ref2va"))), queues(dit=jobs))
    assert a.rounds == (("r0",), ("f0", "f1")) and a.resident == Affinity("fl2va", ())
    (a,) = schedule(view(dit("a")), queues(dit=jobs))
    assert a.rounds == (("f0", "f1"), ("r0",)) and a.resident == Affinity("ref2va", GRAIN)


def test_each_group_batches_once_and_the_next_sees_the_first_taken():
    """Two DiT replicas, nine jobs, batches of eight: the first group takes eight, the second the ninth, which had
    waited one batch more for the first."""
    jobs = [QueuedJob(f"j{i}") for i in range(9)]
    first, second = schedule(view(dit("a"), dit("b", last_started=1.0)), queues(max_batch=8, dit=jobs))
    assert (first.replica, len(first.job_ids), first.passed) == ("dit/a", 8, ("j8",))
    assert (second.replica, second.job_ids) == ("dit/b", ("j8",))
    assert queues(max_batch=8, dit=jobs).after(first).jobs["dit"] == (QueuedJob("j8", waited=1),)


def test_the_render_graph_holds_every_plan_and_data_flows_forward():
    """The render graph (render_svc/graph.py) routes each mode as the contract's plan, in its one stage order; along
    every route each tensor a stage consumes that another stage produces comes from a stage before it; a plan naming
    a stage without a row, or out of order, is refused when the table is built."""
    from minimax_h3.contract import RENDER_PLANS
    from render_svc.graph import STEPS, RenderGraph

    assert dict(GRAPH.plans) == RENDER_PLANS
    produced_by = {name: step.stage for step in STEPS for name in step.produces}
    for mode, route in GRAPH.plans.items():
        for i, stage in enumerate(route):
            for name in GRAPH.steps[stage].consumes:
                if name in produced_by and produced_by[name] in route:
                    assert route.index(produced_by[name]) < i, (mode, stage, name)
    assert [s for s in GRAPH.stages if GRAPH.affinity(s)] == ["dit"]
    with pytest.raises(ValueError, match="without a row"):
        RenderGraph(STEPS, {"t2va": ("encoder", "upscaler")})
    with pytest.raises(ValueError, match="out of the render graph's order"):
        RenderGraph(STEPS, {"t2va": ("dit", "encoder")})
