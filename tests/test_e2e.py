"""End to end through real processes: prompt -> encoder -> DiT -> decoder -> MP4, checked with PyAV."""

import subprocess
import sys
from pathlib import Path

import av
import grpc
import pytest

from client.render_client import render_request
from h3.v1 import common_pb2
from minimax_h3.contract import RenderSpec
from render_svc.engine import render

ROOT = Path(__file__).resolve().parents[1]


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = dict(vcodec=v.codec_context.name, width=v.width, height=v.height, fps=float(v.average_rate),
                    pix_fmt=v.codec_context.pix_fmt, acodec=a.codec_context.name, rate=a.rate,
                    channels=a.channels)
        info["frames"] = sum(1 for _ in c.decode(video=0))
    with av.open(str(path)) as c:
        samples = sum(f.samples for f in c.decode(audio=0))
    info["audio_s"] = samples / info["rate"]
    return info


@pytest.mark.parametrize("w,h,f", [(256, 256, 22), (320, 256, 39)])
def test_render_mp4(clients, tmp_path, w, h, f):
    out = tmp_path / "out.mp4"
    spec = RenderSpec(prompt="a drummer on a rooftop at dusk, loud snare hits", width=w, height=h, frames=f, steps=2,
                      seed=7)
    events = []
    res = render(clients, render_request(spec), out, on_progress=events.append)
    assert out.exists() and not list(tmp_path.glob(".out.mp4.*")), "only the finished file may exist"
    info = probe(out)
    assert info["vcodec"] == "h264" and info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == (w, h) and info["fps"] == 24 and info["frames"] == f
    assert info["acodec"] == "aac" and info["rate"] == 32000 and info["channels"] == 2
    assert abs(info["audio_s"] - f / 24) <= 1 / 24 + 0.025  # AAC frames are 1024 samples (32 ms)
    assert [s.stage for s in res.stages] == ["encoder", "dit", "decoder"]
    dit_steps = [e.step for e in events if e.stage == "dit" and e.total == 2]
    assert dit_steps[-1] == 2


def test_same_seed_same_latents_and_cache_hit(clients):
    from render_svc.stage_calls import encode, sample

    spec = RenderSpec(prompt="rain on a tin roof", width=256, height=256, frames=22, steps=2, seed=3)
    s1, r1 = encode(clients, spec.prompt)
    s2, r2 = encode(clients, spec.prompt)
    assert r2.extra["cache_hit"] and (s1 == s2).all() and s1.dtype == s2.dtype
    v1, a1, _ = sample(clients, spec, s1)
    v2, a2, _ = sample(clients, spec, s1)
    assert (v1 == v2).all() and (a1 == a2).all()


def test_status_reports_each_stage(clients):
    for stage in ("encoder", "dit", "decoder"):
        st = clients.stub(stage).Status(common_pb2.StatusRequest(), timeout=10)
        assert st.stage == stage and st.embedded_model and st.health == "SERVING"
        if stage == "dit":  # the kernel choices, the weights' placement and the window plan, with their reasons
            assert {k.op for k in st.kernels} == {"linear", "attention", "vsa", "weights", "windows"}
            assert all(k.reason for k in st.kernels)


def test_cli_render_and_status(stack, tmp_path):
    s, ep = stack
    out = tmp_path / "cli.mp4"
    args = ["--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder]
    r = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "waves", "-o", str(out), "--width", "256",
                        "--height", "256", "--frames", "22", "--steps", "1", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.exists() and "decoder" in r.stderr + r.stdout
    r = subprocess.run([sys.executable, "-m", "client", "status", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "embedded tiny model" in r.stdout and r.stdout.count("SERVING") == 3


def test_cli_rejects_bad_frames_with_nearest_counts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "x", "--frames", "100", "-o",
                        str(tmp_path / "x.mp4")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "17n+5" in r.stderr and "90 or 107" in r.stderr


@pytest.mark.parametrize("field,value,needle", [
    ("frames", 100, "17n+5"), ("width", 250, "multiple of 32"), ("steps", 0, "steps=0"),
    ("steps", 500, "steps=500"), ("steps", -3, "steps=-3"), ("sampler", "ddim", "unknown sampler"),
    ("seed", -1, "seed"), ("height", 4096, "height=4096"), ("frames", 0, "frames=0"),
])
def test_dit_rejects_bad_params(clients, field, value, needle):
    import torch

    from render_svc.stage_calls import sample

    base = dict(prompt="x", width=256, height=256, frames=22, steps=1)
    base[field] = value
    with pytest.raises(grpc.RpcError) as e:
        sample(clients, RenderSpec(**base), torch.zeros(4, 64))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_dit_rejects_wrong_text_width(clients):
    import torch

    from render_svc.stage_calls import sample

    with pytest.raises(grpc.RpcError) as e:
        sample(clients, RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1), torch.zeros(4, 65))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "65" in e.value.details()


@pytest.mark.parametrize("prompt,needle", [("", "empty"), ("word " * 3000, "limit")])
def test_encoder_rejects_bad_prompts(clients, prompt, needle):
    from render_svc.stage_calls import encode

    with pytest.raises(grpc.RpcError) as e:
        encode(clients, prompt)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_encoder_rejects_non_utf8(clients):
    from h3.v1 import encoder_pb2

    with pytest.raises(grpc.RpcError) as e:
        list(clients.encoder.Encode(encoder_pb2.EncodeRequest(prompt_bytes=b"\xff\xfe bad"), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details()


def test_decoder_rejects_mismatched_and_nan_latents(clients, tmp_path):
    import torch

    from render_svc.stage_calls import decode

    spec = RenderSpec(prompt="x", width=256, height=256, frames=22)
    good_a = torch.zeros(2, 32, spec.audio_latents)
    with pytest.raises(grpc.RpcError) as e:
        decode(clients, spec, torch.zeros(24, 7, 16, 15), good_a, tmp_path / "a.mp4")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in e.value.details()
    bad = torch.zeros(24, 7, 16, 16)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(grpc.RpcError) as e:
        decode(clients, spec, bad, good_a, tmp_path / "b.mp4")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in e.value.details()
    assert not list(tmp_path.iterdir()), "nothing may be written for a rejected request"


def test_decode_raw_frames_and_audio(clients):
    import torch

    from render_svc.stage_calls import decode_raw

    spec = RenderSpec(prompt="x", width=256, height=256, frames=22)
    frames, audio, r = decode_raw(clients, spec, torch.randn(24, spec.latent_frames, 16, 16),
                                  torch.randn(2, 32, spec.audio_latents))
    assert frames.dtype == torch.uint8 and tuple(frames.shape) == (22, 256, 256, 3)
    assert audio.shape[0] == 2 and abs(audio.shape[1] - 22 / 24 * 32000) <= 800
    assert r.extra["frames"] == 22


def test_a_failed_render_raises_the_class_of_its_status(clients, tmp_path):
    """render() raises the error class that says what the outcome means (stagekit.errors), so a caller catches it
    by meaning: a LoRA this DiT does not have is the request's (NOT_FOUND), never a bare RuntimeError."""
    from stagekit.errors import NotFound, status_for

    spec = RenderSpec(prompt="a lighthouse at night", width=256, height=256, frames=22, steps=1, seed=0)
    with pytest.raises(NotFound, match="render failed: NOT_FOUND: LoRA 'no_such_style'") as e:
        render(clients, render_request(spec, loras=[("no_such_style", 0.5)]), tmp_path / "out.mp4")
    assert status_for(e.value)[0] == grpc.StatusCode.NOT_FOUND
    assert not (tmp_path / "out.mp4").exists()
