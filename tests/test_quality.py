"""`quality` per request through the product (real processes, the session's embedded stack): the DiT stage counts a
fast job's cached steps in SampleDone, one stage batch of both qualities applies each job's own, the render
service records the count on the job (`client jobs get` shows it), and an unknown quality is the client's mistake
everywhere it enters (gRPC, /v1/videos, the CLI)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import grpc
import pytest

from client.render_client import render_request
from h3.v1 import render_pb2
from minimax_h3.contract import QUALITIES, RenderSpec
from render_svc.engine import RenderResult, render_jobs
from render_svc.http_api import render_request as http_render_request
from render_svc.stage_calls import encode, sample
from stagekit.errors import InvalidArgument
from tests.render_svc_util import ROOT, RenderService

STEPS = 8  # the embedded DiT's block-0 residual changes 2-5 % over its first steps here: under 0.08, so some cache
SPEC = RenderSpec(prompt="a kettle whistles in a quiet kitchen", width=256, height=256, frames=22, steps=STEPS)
FAST = dataclasses.replace(SPEC, quality="fast")


def test_the_dit_counts_a_fast_jobs_cached_steps(clients):
    """The embedded DiT has one block: a cached step adds a zero tail residual, so fast gives exact's bits here;
    what differs is the count (the multi-block arithmetic: tests/test_step_cache.py)."""
    text, _ = encode(clients, SPEC.prompt)
    v_exact, a_exact, r_exact = sample(clients, SPEC, text)
    v_fast, a_fast, r_fast = sample(clients, FAST, text)
    assert r_exact.extra["cached_steps"] == 0
    assert 1 <= r_fast.extra["cached_steps"] < STEPS
    assert v_fast.equal(v_exact) and a_fast.equal(a_exact)
    with pytest.raises(grpc.RpcError) as e:
        sample(clients, dataclasses.replace(SPEC, quality="slow"), text)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "quality" in e.value.details()


def test_one_dit_batch_of_both_qualities_applies_each_jobs_own(clients, tmp_path):
    """Three jobs sent to each stage as one batch (render_svc.engine.render_jobs, as the render service does):
    the exact ones cache nothing, the fast one caches what it caches alone."""
    jobs = [(render_request(s), tmp_path / f"{i}.mp4") for i, s in enumerate((SPEC, FAST, SPEC))]
    results = render_jobs(clients, jobs)
    assert all(isinstance(r, RenderResult) for r in results), results
    cached = [next(s for s in r.stages if s.stage == "dit").extra["cached_steps"] for r in results]
    (alone,) = render_jobs(clients, [(render_request(FAST), tmp_path / "alone.mp4")])
    assert cached[0] == cached[2] == 0
    assert cached[1] == next(s for s in alone.stages if s.stage == "dit").extra["cached_steps"] >= 1


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("render-quality"), endpoints)
    s.start()
    yield s
    s.stop()


def test_the_job_record_says_how_many_steps_were_cached(svc):
    job = svc.stub.Submit(render_request(FAST), timeout=30)
    info = svc.wait_state(job.job_id, (render_pb2.JOB_SUCCEEDED,))
    assert info.params.quality == "fast"
    (dit,) = [s for s in info.stages if s.stage == "dit"]
    assert 1 <= dit.cached_steps < STEPS
    out = subprocess.run([sys.executable, "-m", "client", "jobs", "get", job.job_id, "--render", svc.target],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{dit.cached_steps} of {STEPS} steps cached" in out.stdout
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(render_request(dataclasses.replace(SPEC, quality="slow")), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exact" in e.value.details()


def test_quality_in_the_video_api_and_the_cli():
    assert http_render_request({"prompt": "x", "quality": "fast"}, "").params.quality == "fast"
    assert http_render_request({"prompt": "x"}, "").params.quality == ""  # unset: the default, exact
    with pytest.raises(InvalidArgument, match="quality must be a string"):
        http_render_request({"prompt": "x", "quality": 1}, "")
    import json

    schema = json.loads((ROOT / "render_svc" / "openapi.json").read_text())["components"]["schemas"]
    assert tuple(schema["CreateVideoRequest"]["properties"]["quality"]["enum"]) == QUALITIES
    out = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "x", "--quality", "slow"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--quality" in out.stderr and "fast" in out.stderr


def test_fast_is_for_one_window():
    """Step caching caches the steps of one window: a render sampled in windows with quality fast is refused,
    naming the plan, never run exactly or cached in part in silence."""
    from minimax_h3.contract import MAX_WINDOW_FRAMES, RenderSpec, validate
    from stagekit.errors import InvalidArgument

    validate(RenderSpec(prompt="x", width=256, height=256, frames=MAX_WINDOW_FRAMES, steps=2, quality="fast"))
    with pytest.raises(InvalidArgument, match="quality fast caches the steps of one window.*continuation"):
        validate(RenderSpec(prompt="x", width=256, height=256, frames=MAX_WINDOW_FRAMES + 17, steps=2,
                            quality="fast"))
