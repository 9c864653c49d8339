"""Long renders and extensions through the product (docs/long_video.md), real processes: the session's stages, a
`python -m render_svc` over them, the CLI as a user runs it, gRPC's Extend and HTTP's /v1/videos/extensions through
OpenAI's Python SDK. Every MP4 is one file whose picture and sound last as long (within one AAC frame)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import av
import grpc
import numpy as np
import pytest

from h3.v1 import render_pb2
from render_svc.store import latents_path
from tests.render_svc_util import SERVER_ENV, RenderService, wait_for

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["--width", "256", "--height", "256", "--steps", "1"]
AAC_FRAME_S = 1024 / 32000


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("long"), endpoints, ["--http-port", "0"])
    s.start()
    yield s
    s.stop()


def cli(svc: RenderService, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", *args, "--render", svc.target], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**__import__("os").environ, **SERVER_ENV})


def media(path: Path) -> dict:
    """What the MP4 holds: its video frames, size, rate and duration, its sound's rate, channels and duration."""
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        return {"frames": len(frames), "size": (v.width, v.height), "fps": float(v.average_rate),
                "video_s": float(v.duration * v.time_base), "audio_s": float(a.duration * a.time_base),
                "rate": a.codec_context.sample_rate, "channels": a.codec_context.channels, "first": frames[0],
                "codecs": (v.codec_context.name, a.codec_context.name)}


def assert_one_mp4(path: Path, frames: int) -> dict:
    m = media(path)
    assert m["frames"] == frames and m["fps"] == 24 and m["codecs"] == ("h264", "aac"), m
    assert m["rate"] == 32000 and m["channels"] == 2, m
    assert abs(m["video_s"] - frames / 24) < 1e-6 and abs(m["audio_s"] - m["video_s"]) <= AAC_FRAME_S, m
    return m


@pytest.fixture(scope="module")
def long_job(svc, tmp_path_factory):
    """A render in 2 continuation windows with a prompt each, through the CLI: (job id, its MP4)."""
    out = tmp_path_factory.mktemp("out") / "long.mp4"
    r = cli(svc, "render", "--prompt", "a fox runs through snow, wind", "--prompt", "the fox leaps, a crow caws",
            "--frames", "56", "--window-frames", "39", "--window-overlap", "22", *SIZE, "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    job = next(line.split()[1] for line in r.stdout.splitlines() + r.stderr.splitlines() if line.startswith("job "))
    return job, out


def test_a_long_render_through_the_cli_is_one_mp4(svc, long_job):
    job, out = long_job
    assert_one_mp4(out, 56)
    info = svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=10)
    assert info.windows == "continuation: 2 windows of 39 frames, overlap 22"
    assert list(info.params.more_prompts) == ["the fox leaps, a crow caws"]
    assert [s.stage for s in info.stages] == ["encoder", "dit", "decoder"]
    assert latents_path(svc.stack.run_dir / "render" / "outputs" / f"{job}.mp4").is_file()  # kept for an extension


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))


def test_extend_through_the_cli_continues_the_kept_latents(svc, long_job, tmp_path):
    job, src = long_job
    out = tmp_path / "longer.mp4"
    r = cli(svc, "extend", job, "--seconds", "1", "--prompt", "the fox rests, snow falls", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"extends {job} to 90 frames" in r.stdout  # 56 frames + 1 s: the smallest 17n+5 past 80
    m = assert_one_mp4(out, 90)
    assert _psnr(m["first"], media(src)["first"]) > 25  # the stitched whole opens with the source clip
    ext = svc.stub.List(render_pb2.ListRequest(limit=1), timeout=10).jobs[0]
    assert ext.extend_job_id == job and ext.params.prefix_frames == 56 and ext.params.frames == 90
    assert ext.windows == "continuation: 1 window of 175 frames, overlap 22 (picked)"
    assert [s.stage for s in ext.stages] == ["encoder", "dit", "decoder"]  # the guide came from the kept latents


def test_extend_through_grpc_reencodes_the_mp4_when_the_latents_are_gone(svc, long_job, tmp_path):
    job, _ = long_job
    kept = latents_path(svc.stack.run_dir / "render" / "outputs" / f"{job}.mp4")
    kept.unlink()
    ext = render_pb2.ExtendRequest(job_id=job, seconds=1.0)
    ext.params.prompt = "the fox rests, snow falls"
    info = svc.stub.Extend(ext, timeout=60)
    assert info.extend_job_id == job and info.params.frames == 90
    done = svc.wait_state(info.job_id, (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED), timeout_s=300)
    assert done.state == render_pb2.JOB_SUCCEEDED, done.error
    assert [s.stage for s in done.stages] == ["keyframes", "encoder", "dit", "decoder"]  # EncodeTail, then on
    out = tmp_path / "reencoded.mp4"
    from client.render_client import RenderClient

    with RenderClient(svc.target) as rc:
        rc.fetch(info.job_id, out)
    assert_one_mp4(out, 90)

    # Refusals name the fix and store nothing.
    before = len(svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs)
    for job_id, params, code, needle in (
            ("nosuchjob", {}, grpc.StatusCode.NOT_FOUND, "no job"),
            (job, {"width": 512}, grpc.StatusCode.INVALID_ARGUMENT, "keeps its source's canvas"),
            (job, {"frames": 124}, grpc.StatusCode.INVALID_ARGUMENT, "not both")):
        bad = render_pb2.ExtendRequest(job_id=job_id, seconds=1.0)
        bad.params.prompt = "more"
        for k, v in params.items():
            setattr(bad.params, k, v)
        with pytest.raises(grpc.RpcError) as e:
            svc.stub.Extend(bad, timeout=30)
        assert e.value.code() == code and needle in e.value.details(), e.value.details()
    assert len(svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs) == before


def test_extend_through_http_with_openais_sdk(svc, long_job, tmp_path):
    openai = pytest.importorskip("openai")
    import warnings

    job, _ = long_job
    port = int((svc.stack.run_dir / "render.port.http").read_text())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    with warnings.catch_warnings():  # the SDK marks its Videos API deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        # The SDK's extend() takes a video reference as a file only; the id goes in the body, as `video[id]`.
        video = client.videos.extend(prompt="the fox rests, snow falls", seconds="1", video=openai.omit,
                                     extra_body={"video": {"id": job}})
        assert video.status in ("queued", "in_progress") and video.seconds == "3.75"  # the stitched total: 90 frames
        done = wait_for(lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v,
                        300, f"video {video.id} done")
        assert done.status == "completed", done.error
        out = tmp_path / "http.mp4"
        client.videos.download_content(video.id).write_to_file(out)
        with pytest.raises(openai.NotFoundError):
            client.videos.extend(prompt="more", seconds="1", video=openai.omit, extra_body={"video": {"id": "nope"}})
        with pytest.raises(openai.BadRequestError, match="video must name a finished video"):
            client.videos.extend(prompt="more", seconds="1", video=openai.omit)
    assert_one_mp4(out, 90)
