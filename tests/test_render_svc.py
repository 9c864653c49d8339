"""The render service through real processes: the session's stage stack (encoder, DiT, decoder on
loopback, tiny embedded model) with a `python -m render_svc` process beside it.

- one call: Render streams the job, progress of every stage, then the MP4; the job record says where it ran;
- the thin client: `python -m client render` against the service never imports torch or numpy (sys.modules of
  the client process), and `python -m client jobs list|get|watch|fetch` work;
- jobs: Submit (idempotency key), Get, Watch (resumed from an index gives the same tail), List, Fetch;
- bad requests are INVALID_ARGUMENT at submit and store nothing; unknown ids NOT_FOUND; fetch before the end
  FAILED_PRECONDITION;
- --upscale: the MP4 comes out at the asked size (libswscale Lanczos in the decoder's mux);
- fl2va: the keyframe images travel once (in the request); the keyframes batch makes the decoder resident with its
  VAE encoder alone (the residency's loaded bytes are the encoder's), the decode batch with the decode path.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from h3.v1 import common_pb2, render_pb2
from minimax_h3.services import StageClients
from stagekit.lease import read_events
from stagekit.transport import FileReceiver
from tests.render_svc_util import ROOT, TERMINAL, RenderService, probe, tiny_request


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("render"), endpoints)
    s.start()
    yield s
    s.stop()


def test_render_one_call(svc, tmp_path):
    out = tmp_path / "one.mp4"
    events = []
    with FileReceiver(out) as recv:
        # a prompt of its own: one another test rendered first (shuffled order) is a cache hit with no encoder progress
        for ev in svc.stub.Render(tiny_request("a lighthouse in a storm, one call", label="one-call"), timeout=300):
            if ev.WhichOneof("event") == "file":
                recv.feed(ev.file)
            else:
                events.append(ev)
        recv.finish()
    assert probe(out) == {"width": 256, "height": 256, "frames": 22, "audio": 1}
    first, last = events[0], events[-1]
    assert first.job.state == render_pb2.JOB_QUEUED and first.index == 0 and first.job.label == "one-call"
    assert last.job.state == render_pb2.JOB_SUCCEEDED
    assert [e.index for e in events] == list(range(len(events))), "the log is gap-free"
    stages = {e.progress.stage for e in events if e.WhichOneof("event") == "progress"}
    assert {"encoder", "dit", "decoder"} <= stages
    assert [(s.stage, s.batch_size) for s in last.job.stages] == [("encoder", 1), ("dit", 1), ("decoder", 1)]
    assert last.job.output_bytes == out.stat().st_size and last.job.attempts == 1


def test_thin_client_never_imports_torch_or_numpy(svc, tmp_path):
    out = tmp_path / "thin.mp4"
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = ['client', 'render', '--render', {svc.target!r}, '--prompt', 'rain on a tin roof', '-o', "
        f"{str(out)!r}, '--width', '256', '--height', '256', '--frames', '22', '--steps', '1', '--upscale', "
        "'384x384']\n"
        "try:\n    runpy.run_module('client', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n    rc = e.code\n"
        "print(json.dumps({'rc': rc, 'heavy': sorted(m for m in ('torch', 'numpy') if m in sys.modules)}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"rc": 0, "heavy": []}, r.stderr
    assert probe(out)["width"] == 384 and probe(out)["height"] == 384  # --upscale: scaled in the mux


def test_jobs_api_idempotent_submit_watch_resume_fetch(svc, tmp_path):
    req = tiny_request(seed=3, idempotency_key="k-api-1", label="api")
    a = svc.stub.Submit(req, timeout=30)
    b = svc.stub.Submit(req, timeout=30)
    assert a.job_id == b.job_id, "a retried submit returns the same job"
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(tiny_request(seed=4, idempotency_key="k-api-1"), timeout=30)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and a.job_id in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # nothing to fetch yet
        list(svc.stub.Fetch(render_pb2.FetchRequest(job_id=a.job_id), timeout=30))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    full = list(svc.stub.Watch(render_pb2.WatchRequest(job_id=a.job_id), timeout=300))
    assert full[-1].job.state == render_pb2.JOB_SUCCEEDED
    k = len(full) // 2
    tail = list(svc.stub.Watch(render_pb2.WatchRequest(job_id=a.job_id, from_index=k), timeout=60))
    assert [e.SerializeToString() for e in tail] == [e.SerializeToString() for e in full[k:]], "resume = same tail"
    info = svc.stub.Get(render_pb2.JobRef(job_id=a.job_id), timeout=30)
    assert info.state == render_pb2.JOB_SUCCEEDED and info.events == len(full)
    listed = svc.stub.List(render_pb2.ListRequest(states=[render_pb2.JOB_SUCCEEDED]), timeout=30).jobs
    assert a.job_id in [j.job_id for j in listed]
    out = tmp_path / "fetched.mp4"
    with FileReceiver(out) as recv:
        for c in svc.stub.Fetch(render_pb2.FetchRequest(job_id=a.job_id), timeout=60):
            recv.feed(c)
        recv.finish()
    assert out.stat().st_size == info.output_bytes and probe(out)["frames"] == 22
    resumed = list(svc.stub.Fetch(render_pb2.FetchRequest(job_id=a.job_id, offset=1000), timeout=60))
    assert resumed[0].offset == 1000 and resumed[-1].total_bytes == info.output_bytes
    assert resumed[-1].crc32c == c.crc32c  # the checksum covers the whole file either way


@pytest.mark.parametrize("change,code,needle", [
    (dict(frames=100), grpc.StatusCode.INVALID_ARGUMENT, "17n+5"),
    (dict(first_frame=b"not an image"), grpc.StatusCode.INVALID_ARGUMENT, "first_frame"),
    (dict(upscale=(385, 384)), grpc.StatusCode.INVALID_ARGUMENT, "even"),
    (dict(upscale=(1920, 480)), grpc.StatusCode.INVALID_ARGUMENT, "aspect"),
    (dict(crf=80), grpc.StatusCode.INVALID_ARGUMENT, "crf"),
])
def test_bad_requests_are_refused_and_store_nothing(svc, change, code, needle):
    before = len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=30).jobs)
    frames = change.pop("frames", 22)
    req = tiny_request(**change)
    req.params.frames = frames
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(req, timeout=30)
    assert e.value.code() == code and needle in e.value.details()
    assert len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=30).jobs) == before


def test_unknown_job_is_not_found(svc):
    for call in (lambda: svc.stub.Get(render_pb2.JobRef(job_id="nope"), timeout=10),
                 lambda: list(svc.stub.Watch(render_pb2.WatchRequest(job_id="nope"), timeout=10)),
                 lambda: list(svc.stub.Fetch(render_pb2.FetchRequest(job_id="nope"), timeout=10)),
                 lambda: svc.stub.Cancel(render_pb2.JobRef(job_id="nope"), timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_jobs_cli(svc, tmp_path):
    info = svc.stub.Submit(tiny_request(seed=9, label="cli-job"), timeout=30)
    cli = [sys.executable, "-m", "client", "jobs"]
    r = subprocess.run([*cli, "watch", info.job_id, "--render", svc.target], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "succeeded" in r.stdout and "dit" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*cli, "list", "--render", svc.target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and info.job_id in r.stdout and "cli-job" in r.stdout, r.stderr
    out = tmp_path / "cli.mp4"
    r = subprocess.run([*cli, "fetch", info.job_id, "-o", str(out), "--render", svc.target], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and probe(out)["frames"] == 22, r.stderr
    st = svc.stub.Status(common_pb2.StatusRequest(), timeout=30)
    assert st.succeeded >= 1 and [s.health for s in st.stages] == ["SERVING"] * 3
    assert all(j.state in TERMINAL for j in svc.stub.List(render_pb2.ListRequest(), timeout=30).jobs)


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (200, 300, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_fl2va_keyframes_load_only_the_vae_encoder(stack, svc, tmp_path, model_cache):
    from decoder_svc.engine import EMBEDDED_VIDEO
    from minimax_h3.files import EMBEDDED_VERSION
    from minimax_h3.vae.video import load_video_vae

    stage_stack, endpoints = stack
    with StageClients(endpoints) as c:  # start from an unloaded decoder (an earlier test's decode may be resident)
        c.decoder.Unload(common_pb2.UnloadRequest(), timeout=120)
    t0 = time.time()
    req = tiny_request("the sun sets over the sea", first_frame=_png(1), last_frame=_png(2))
    out = tmp_path / "fl2va.mp4"
    with FileReceiver(out) as recv:
        for ev in svc.stub.Render(req, timeout=300):
            if ev.WhichOneof("event") == "file":
                recv.feed(ev.file)
            elif ev.WhichOneof("event") == "job":
                info = ev.job
        recv.finish()
    assert [r.stage for r in info.stages] == ["keyframes", "encoder", "dit", "decoder"]
    assert probe(out)["frames"] == 22
    loaded = [e["bytes"] for e in read_events(stage_stack.lease_dir)
              if e["event"] == "loaded" and e["holder"].startswith("decoder@") and e["t"] >= t0]
    vae = str(model_cache / EMBEDDED_VERSION / EMBEDDED_VIDEO)
    encoder_bytes = sum(p.numel() * p.element_size()
                        for p in load_video_vae(vae, None, torch.float32, device="cpu", parts="encoder").parameters())
    assert loaded[0] == encoder_bytes and loaded[-1] > encoder_bytes, loaded  # keyframes: the encoder half alone
