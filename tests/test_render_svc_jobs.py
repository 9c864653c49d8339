"""Render service jobs survive.

The job store alone (render_svc/store.py, in process): a job finishes once, a restart requeues running jobs until
their attempts are used up, then fails them; an idempotency key names one job; another process cannot open the run
dir while a service holds it.

Through real processes (session stage stack + render_svc processes):

- a client killed mid-render (SIGKILL) loses nothing: the job finishes and `python -m client jobs fetch` gets it;
- the render service killed (SIGKILL) with jobs running and queued, then restarted on the same run dir: every job
  finishes exactly once (one terminal event each, one MP4 each, running ones retried as attempt 2);
- retention: with --keep-jobs 1 the older job is removed, its MP4 with it (Get and Fetch say NOT_FOUND and why).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest

from h3.v1 import render_pb2
from render_svc.store import JobStore
from stagekit.errors import AlreadyExists, FailedPrecondition
from tests.render_svc_util import (ROOT, TERMINAL, RenderService, holding_the_device, probe, tiny_request,
                                   wait_for)

SUCCEEDED = render_pb2.JOB_SUCCEEDED


def test_store_finishes_once_and_recovers_within_attempts(tmp_path):
    store = JobStore(tmp_path)
    a, created = store.submit(tiny_request("a", idempotency_key="key-a"))
    assert created and store.submit(tiny_request("a", idempotency_key="key-a")) == (store.get(a.id), False)
    with pytest.raises(AlreadyExists):
        store.submit(tiny_request("b", idempotency_key="key-a"))
    assert store.start(a.id, "encoder") and not store.start(a.id, "encoder")  # QUEUED -> RUNNING once
    assert store.finish(a.id, render_pb2.JOB_CANCELLED, "CANCELLED", "x")
    assert not store.finish(a.id, SUCCEEDED), "a job finishes exactly once"
    b, _ = store.submit(tiny_request("b"))
    store.start(b.id, "dit")
    assert store.recover(max_attempts=2) == ([b.id], [])  # attempt 1 of 2 was running: retried
    store.start(b.id, "encoder")
    assert store.recover(max_attempts=2) == ([], [b.id])  # attempt 2 of 2: failed, not run a third time
    rec = store.get(b.id)
    assert rec.state == render_pb2.JOB_FAILED and rec.error_code == "UNAVAILABLE" and "2 attempts" in rec.error
    with pytest.raises(FailedPrecondition):  # one service per run dir
        JobStore(tmp_path)
    store.close()
    again = JobStore(tmp_path)  # the records outlive the process that wrote them
    terminal = [e for e in again.events(b.id, 0) if e.WhichOneof("event") == "job" and e.job.state in TERMINAL]
    assert len(terminal) == 1 and again.get(a.id).state == render_pb2.JOB_CANCELLED
    again.close()


def test_client_killed_mid_render_then_fetch(stack, tmp_path):
    _, endpoints = stack
    svc = RenderService(tmp_path / "run", endpoints)
    svc.start()
    try:
        out = tmp_path / "never.mp4"
        client = subprocess.Popen(
            [sys.executable, "-m", "client", "render", "--render", svc.target, "--prompt", "a gong, long decay",
             "--width", "256", "--height", "256", "--frames", "39", "--steps", "8", "--label", "killed-client",
             "-o", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job = wait_for(lambda: next((j for j in svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs
                                     if j.label == "killed-client" and j.state == render_pb2.JOB_RUNNING), None),
                       120, "the client's job to run", svc.log)
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
        info = svc.wait_state(job.job_id, TERMINAL)
        assert info.state == SUCCEEDED, info.error
        assert not out.exists(), "the killed client wrote nothing"
        fetched = tmp_path / "later.mp4"
        r = subprocess.run([sys.executable, "-m", "client", "jobs", "fetch", job.job_id, "-o", str(fetched),
                            "--render", svc.target], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert probe(fetched) == {"width": 256, "height": 256, "frames": 39, "audio": 1}
    finally:
        svc.stop()


def test_restart_with_jobs_queued_all_finish_exactly_once(stack, tmp_path):
    s, endpoints = stack
    run_dir = tmp_path / "run"
    svc = RenderService(run_dir, endpoints, ["--max-batch", "2"])
    svc.start()
    try:
        with holding_the_device(s.lease_dir):  # the first batch blocks in the encoder, the other jobs stay queued
            ids = [svc.stub.Submit(tiny_request(f"restart {i}", steps=2, seed=i), timeout=30).job_id for i in range(5)]
            wait_for(lambda: any(j.state == render_pb2.JOB_RUNNING and j.stage == "encoder"
                                 for j in svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs),
                     60, "the first batch in the encoder", svc.log)
            before = {j.job_id: j for j in svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs}
            svc.kill()
        running = {i for i, j in before.items() if j.state == render_pb2.JOB_RUNNING}
        assert running and len(running) + sum(j.state == render_pb2.JOB_QUEUED for j in before.values()) == 5
        svc.start()  # same run dir: the SQLite job records
        infos = {i: svc.wait_state(i, TERMINAL, 240) for i in ids}
        assert all(x.state == SUCCEEDED for x in infos.values()), {i: x.error for i, x in infos.items()}
        for i in ids:
            evs = list(svc.stub.Watch(render_pb2.WatchRequest(job_id=i), timeout=60))
            finals = [e for e in evs if e.WhichOneof("event") == "job" and e.job.state in TERMINAL]
            assert len(finals) == 1, f"job {i} finished {len(finals)} times"
            assert [e.index for e in evs] == list(range(len(evs)))
            requeued = [e for e in evs if e.WhichOneof("event") == "progress" and e.progress.phase == "requeued"]
            if i in running:
                assert infos[i].attempts == 2 and len(requeued) == 1
            else:
                assert infos[i].attempts == 1 and not requeued
        outputs = sorted(p.name for p in (run_dir / "render" / "outputs").iterdir())
        want = sorted(f"{i}{suffix}" for i in ids for suffix in (".mp4", ".latents.safetensors"))
        assert outputs == want, "one MP4 per job and its kept latents (docs/long_video.md), no leftovers"
    finally:
        svc.stop()


def test_retention_removes_old_outputs(stack, tmp_path):
    _, endpoints = stack
    svc = RenderService(tmp_path / "run", endpoints, ["--keep-jobs", "1"])
    svc.start()
    try:
        infos = [svc.wait_state(svc.stub.Submit(tiny_request(f"kept? {i}", seed=i), timeout=30).job_id, TERMINAL)
                 for i in range(2)]  # one after the other: the first finishes first
        assert all(x.state == SUCCEEDED for x in infos)
        a, b = infos[0].job_id, infos[1].job_id  # the older one is over the limit
        for call in (lambda: svc.stub.Get(render_pb2.JobRef(job_id=a), timeout=10),
                     lambda: list(svc.stub.Fetch(render_pb2.FetchRequest(job_id=a), timeout=30))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "--keep-jobs" in e.value.details()
        assert sum(1 for c in svc.stub.Fetch(render_pb2.FetchRequest(job_id=b), timeout=30) if c.last) == 1
        outputs = tmp_path / "run" / "render" / "outputs"
        assert not (outputs / f"{a}.mp4").exists() and not (outputs / f"{a}.latents.safetensors").exists()
        assert (outputs / f"{b}.latents.safetensors").exists()  # kept with its MP4, removed with it
    finally:
        svc.stop()


def test_store_moves_images_of_earlier_unfinished_jobs_out_of_the_database(tmp_path):
    """A queued job recorded with its keyframe image inside the request (an earlier version's row) gets the image
    moved to keyframes/ when the store opens, as a new job's would be."""
    store = JobStore(tmp_path)
    rec, _ = store.submit(tiny_request("legacy"))
    image = b"\x89PNG fake image bytes"
    legacy = tiny_request("legacy", first_frame=image)
    with store.db:
        store.db.execute("UPDATE jobs SET request = ? WHERE id = ?", (legacy.SerializeToString(), rec.id))
    store.close()
    again = JobStore(tmp_path)
    moved = again.get(rec.id)
    assert not moved.request.first_frame and again.files.read(moved.keyframes["first"]) == image
    again.close()
