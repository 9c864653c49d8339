"""Cancel a render job at every stage, through real processes (session stage stack + render_svc).

Where the job is, deterministically: the test holds the stages' device lease, so a job sent to a stage blocks
inside it (keyframes, encoder) while the next job waits in the render service's queue; the DiT and the decoder get
long work (many steps / many frames) and are cancelled once their progress shows them running. Every cancelled
job ends CANCELLED with the stage named, leaves no MP4, and the stages serve the next job.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from h3.v1 import render_pb2
from tests.render_svc_util import TERMINAL, RenderService, holding_the_device, tiny_request, wait_for


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("render-cancel"), endpoints)
    s.start()
    yield s
    s.stop()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _in_stage(svc, job_id: str, stage: str, running: bool = False):
    def check():
        info = svc.stub.Get(render_pb2.JobRef(job_id=job_id), timeout=10)
        return info.state == render_pb2.JOB_RUNNING and info.stage == stage and (
            not running or (info.progress.stage == stage and info.progress.phase == "running"
                            and info.progress.step >= 1))
    wait_for(check, 120, f"job {job_id} in the {stage} stage", svc.log)


def _cancelled(svc, job_id: str, needle: str) -> None:
    info = svc.stub.Cancel(render_pb2.JobRef(job_id=job_id), timeout=60)
    info = svc.wait_state(job_id, TERMINAL, 60) if info.state not in TERMINAL else info
    assert info.state == render_pb2.JOB_CANCELLED and info.error_code == "CANCELLED", info
    assert needle in info.error, info.error
    assert not info.output_bytes


def test_cancel_waiting_keyframes_and_encoder(stack, svc):
    s, _ = stack
    with holding_the_device(s.lease_dir):
        kf = svc.stub.Submit(tiny_request("from a keyframe", first_frame=_png()), timeout=30).job_id
        _in_stage(svc, kf, "keyframes")
        waiting = svc.stub.Submit(tiny_request("behind it"), timeout=30).job_id
        assert svc.stub.Get(render_pb2.JobRef(job_id=waiting), timeout=10).state == render_pb2.JOB_QUEUED
        _cancelled(svc, waiting, "while waiting for the encoder stage")
        _cancelled(svc, kf, "during the keyframes stage")
        enc = svc.stub.Submit(tiny_request("into the encoder"), timeout=30).job_id
        _in_stage(svc, enc, "encoder")
        _cancelled(svc, enc, "during the encoder stage")


def test_cancel_in_dit_and_decoder(svc):
    long_dit = tiny_request("a long sample", steps=200)
    long_dit.params.width, long_dit.params.height, long_dit.params.frames = 512, 512, 124
    job = svc.stub.Submit(long_dit, timeout=30).job_id
    _in_stage(svc, job, "dit", running=True)
    _cancelled(svc, job, "during the dit stage")
    long_decode = tiny_request("a long decode", steps=1)
    long_decode.params.width, long_decode.params.height, long_decode.params.frames = 512, 512, 124
    job = svc.stub.Submit(long_decode, timeout=30).job_id
    _in_stage(svc, job, "decoder", running=True)
    _cancelled(svc, job, "during the decoder stage")
    ok = svc.stub.Submit(tiny_request("after the cancels"), timeout=30).job_id
    assert svc.wait_state(ok, TERMINAL).state == render_pb2.JOB_SUCCEEDED, "the stages serve the next job"
    assert svc.stub.Cancel(render_pb2.JobRef(job_id=ok), timeout=30).state == render_pb2.JOB_SUCCEEDED, \
        "cancelling a finished job changes nothing"
