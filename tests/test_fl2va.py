"""fl2va: first/last keyframe conditioning.

- DiT sampler level (in process, tiny config): the conditioning rows the model sees are 0.999·z + 0.001·ε, identical
  at every step, tagged video, at t = 0.999 and RoPE times L / L + 5/3·(F−1); the sampler integrates only target rows;
  the noises follow diffusers' draw order; one step equals diffusers' transformer on the same packed inputs.
- Services (real processes, embedded tiny stack): decoder EncodeImage, encoder keyframe presentation + tags, a whole
  fl2va render to a valid MP4 (library and CLI), and bad inputs -> INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from h3.v1 import decoder_pb2, encoder_pb2
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.keyframes import KEYFRAME_NOISE_AUG, condition_rows, conditioned_denoise
from minimax_h3.dit.layout import build_layout, patchify_video
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.sampling import draw_noise
from minimax_h3.dit.sampling import SamplerConfig, initial_noise, sample

ROOT = Path(__file__).resolve().parents[1]
W, H, F = 256, 256, 22


def _png(w: int, h: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), rng.integers(0, 256, (h, w))], -1)
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# DiT conditioning path (in process)
# ---------------------------------------------------------------------------------------------------------------
class Spy(torch.nn.Module):
    """Wraps the DiT and records what every call sees."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, xv, xa, text, tv, ta, layout):
        self.calls.append((xv.clone(), float(tv)))
        return self.model(xv, xa, text, tv, ta, layout)


@pytest.fixture(scope="module")
def tiny_dit():
    """Our DiT with the weights of a random tiny diffusers MiniMaxH3Transformer3DModel (the oracle)."""
    from minimax_h3.dit.convert_diffusers import from_diffusers
    from tests.test_dit_model import diffusers_model

    cfg = DiTConfig.tiny()
    dm = diffusers_model(cfg)
    m = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=64).eval()
    m.load_state_dict(from_diffusers(dm.state_dict()))
    return cfg, m, dm


def _setup(cfg, keyframes, seed=5, L=7):
    frames, h, w = 22, 64, 96
    lat = [torch.randn(cfg.in_channels, 1, h // 16, w // 16, generator=torch.Generator().manual_seed(10 + i))
           for i in range(len(keyframes))]
    lay = build_layout(cfg, L, frames, h, w, keyframes, text_tags=torch.tensor([1, 1, 0, 0, 0, 1, 1]))
    vshape = (cfg.in_channels, lay.shape.latent_frames, h // 16, w // 16)
    c_noise, v_noise, a_rows = draw_noise(seed, [z.shape for z in lat], vshape,
                                          (2 * lay.shape.audio_latents, cfg.audio_in_channels))
    return lat, lay, c_noise, v_noise, a_rows, frames


@pytest.mark.parametrize("keyframes", [("first",), ("last",), ("first", "last")])
def test_conditioning_rows_fixed_and_only_targets_sampled(tiny_dit, keyframes):
    cfg, m, _ = tiny_dit
    lat, lay, c_noise, v_noise, a_noise, frames = _setup(cfg, keyframes)
    cond = condition_rows(lat, c_noise, cfg.patch)
    want = torch.cat([patchify_video(0.999 * z + 0.001 * e, cfg.patch) for z, e in zip(lat, c_noise)])
    assert KEYFRAME_NOISE_AUG == 0.001 and torch.equal(cond, want)
    spy = Spy(m)
    text = torch.randn(7, cfg.text_dim)
    denoise = conditioned_denoise(spy, text, lay, cond)
    v_rows, a_rows = patchify_video(v_noise, cfg.patch), a_noise
    with torch.no_grad():
        v0, a0 = sample(denoise, v_rows, a_rows, SamplerConfig(steps=3))
    assert v0.shape == v_rows.shape and a0.shape == a_rows.shape  # the sampler holds target rows only
    n = lay.num_cond_rows
    assert n == len(keyframes) * lay.rows_per_frame and len(spy.calls) == 3
    for xv, _ in spy.calls:  # every step: the same conditioning rows in front of the target rows
        assert torch.equal(xv[:n], cond)
    # Layout facts: video tag, t = max(t_video, 0.999), RoPE time L (first) / L + 5/3 (F - 1) (last).
    assert (lay.tag[lay.cond[0]:lay.cond[1]] == 0).all() and lay.tag[:7].tolist() == [1, 1, 0, 0, 0, 1, 1]
    ts, ti = m.timestep_table(0.25, 0.4, lay)
    assert ts[ti[lay.cond[0]]].item() == pytest.approx(0.999)
    times = lay.position_ids_f64[lay.cond[0]:lay.cond[1], 0].view(len(keyframes), -1)
    for k, anchor in enumerate(keyframes):
        want = 7.0 if anchor == "first" else 7.0 + 5 / 3 * (frames - 1)
        assert times[k].tolist() == pytest.approx([want] * lay.rows_per_frame, abs=1e-9)
    assert torch.equal(lay.position_ids_f64[lay.cond[0]:lay.cond[1], 1:],
                       lay.position_ids_f64[lay.video[0]:lay.video[0] + lay.rows_per_frame, 1:].repeat(len(keyframes), 1))


def test_noise_draw_order_matches_diffusers_and_t2va():
    """diffusers' own pipeline blocks draw the oracle: the condition step (one draw per keyframe, then noised) and
    the prepare-latents step (video latent, then audio directly as rows [2*Ta, 32]) off one generator."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareConditionLatentsStep,
                                                                        MiniMaxH3PrepareLatentsStep)
    from diffusers.modular_pipelines.modular_pipeline import SequentialPipelineBlocks
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    lat = [torch.randn(24, 1, 4, 6, generator=torch.Generator().manual_seed(3 + i)) for i in range(2)]
    conds, v, a = draw_noise(11, [z.shape for z in lat], (24, 2, 4, 6), (2 * 37, 32))
    blocks = SequentialPipelineBlocks.from_blocks_dict({"cond": MiniMaxH3PrepareConditionLatentsStep(),
                                                        "latents": MiniMaxH3PrepareLatentsStep()})
    pipe = blocks.init_pipeline()
    pipe.update_components(scheduler=MiniMaxH3Scheduler())
    ref = pipe(condition_latents=[z[None] for z in lat], num_condition_video_rows=2 * 6, num_latent_frames=2,
               latent_height=4, latent_width=6, num_audio_latents=37, generator=torch.Generator().manual_seed(11),
               output=["condition_rows", "latents", "audio_latents"])
    # The keyframe mix 0.999 z + 0.001 e is computed another way there (last-ulp differences); the noise is the same,
    # and the video / audio draws after it are bit for bit diffusers' (so the keyframe draws consumed the same stream).
    torch.testing.assert_close(condition_rows(lat, conds, (1, 2, 2)), ref["condition_rows"], rtol=0, atol=1e-6)
    assert torch.equal(patchify_video(v, (1, 2, 2)), ref["latents"]) and torch.equal(a, ref["audio_latents"])
    _, v2, a2 = draw_noise(11, [], (24, 2, 4, 6), (2 * 37, 32))
    v3, a3 = initial_noise(11, (24, 2, 4, 6), (2 * 37, 32))
    assert torch.equal(v2, v3) and torch.equal(a2, a3)  # t2va bits unchanged


def test_conditioned_step_matches_diffusers_transformer(tiny_dit):
    """One conditioned model call through our closure vs diffusers' transformer on the same packed sequence, its
    conditioning rows built the diffusers way (MiniMaxH3Scheduler.scale_noise(z, 0.999, ε), then patchify)."""
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    from tests.test_dit_model import diffusers_forward, rel

    cfg, m, dm = tiny_dit
    lat, lay, c_noise, v_noise, a_noise, frames = _setup(cfg, ("first", "last"))
    sched = MiniMaxH3Scheduler()
    ref_cond = torch.cat([patchify_video(sched.scale_noise(z[None], 0.999, e[None])[0], cfg.patch)
                          for z, e in zip(lat, c_noise)])
    cond = condition_rows(lat, c_noise, cfg.patch)
    torch.testing.assert_close(cond, ref_cond, rtol=0, atol=1e-6)
    text = torch.randn(7, cfg.text_dim)
    v_rows, a_rows = patchify_video(v_noise, cfg.patch), a_noise
    with torch.no_grad():
        ours_v, ours_a = conditioned_denoise(m, text, lay, cond)(v_rows, a_rows, torch.tensor(0.3), torch.tensor(0.5))
    ref_v, ref_a = diffusers_forward(dm, lay, torch.cat([ref_cond, v_rows]), a_rows, text, 0.3, 0.5)
    n = lay.num_cond_rows
    assert ours_v.shape == v_rows.shape
    assert rel(ours_v, ref_v[n:]) < 1e-5 and rel(ours_a, ref_a) < 1e-5


@pytest.mark.parametrize("keyframes", [("first",), ("first", "last")])
def test_fl2va_sampling_loop_matches_diffusers(tiny_dit, keyframes):
    """The whole conditioned loop (euler, diffusers grid) vs a diffusers-style loop: diffusers' transformer over
    [cond | target] rows and MiniMaxH3Scheduler.step on the target rows only (the cond rows are never stepped)."""
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    from tests.test_dit_model import diffusers_forward, rel

    cfg, m, dm = tiny_dit
    lat, lay, c_noise, v_noise, a_noise, _ = _setup(cfg, keyframes)
    cond = condition_rows(lat, c_noise, cfg.patch)
    text = torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(2))
    v_rows, a_rows = patchify_video(v_noise, cfg.patch), a_noise
    steps = 3
    with torch.no_grad():
        ov, oa = sample(conditioned_denoise(m, text, lay, cond), v_rows, a_rows,
                        SamplerConfig("euler", "diffusers", steps=steps))
    sv, sa = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    sv.set_timesteps(steps + 1)
    sa.set_timesteps(steps + 1)
    n = lay.num_cond_rows
    latents, audio = torch.cat([cond, v_rows]), a_rows.clone()
    for tv, ta in zip(sv.timesteps, sa.timesteps):
        v, a = diffusers_forward(dm, lay, latents, audio, text, float(tv), float(ta))
        latents[n:] = sv.step(v[n:], tv, latents[n:], return_dict=False)[0]
        audio = sa.step(a, ta, audio, return_dict=False)[0]
    assert torch.equal(latents[:n], cond)
    assert rel(ov, latents[n:]) < 1e-5 and rel(oa, audio) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Services (real processes)
# ---------------------------------------------------------------------------------------------------------------
def test_decoder_encode_image(clients):
    from render_svc.stage_calls import encode_image

    lat, res = encode_image(clients, _png(300, 200, 1), W, H)
    assert lat.shape == (24, 1, H // 16, W // 16) and lat.dtype == torch.float32 and torch.isfinite(lat).all()
    lat2, _ = encode_image(clients, _png(300, 200, 1), W, H)
    assert torch.equal(lat, lat2)  # posterior mean: deterministic
    # Raw RGB pixels at the canvas size == the same pixels as a (lossless) PNG.
    png = _png(W, H, 9)
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    req = decoder_pb2.EncodeImageRequest(pixels=decoder_pb2.RawImage(width=W, height=H, rgb=rgb.tobytes()),
                                         width=W, height=H)
    from stagekit.wire import TensorAssembler

    asm = TensorAssembler()
    for ev in clients.decoder.EncodeImage(req, timeout=60):
        if ev.WhichOneof("event") == "tensor":
            asm.feed(ev.tensor)
    assert torch.equal(asm.finish(["latents"])["latents"], encode_image(clients, png, W, H)[0])


@pytest.mark.parametrize("req,needle", [
    (dict(image=b"not an image at all", width=W, height=H), "not a readable"),
    (dict(image=b"", width=W, height=H), "empty"),
    (dict(image=_png(64, 64), width=250, height=H), "multiple of 32"),
    (dict(image=_png(64, 64), width=0, height=H), "multiple of 32"),
    (dict(pixels=decoder_pb2.RawImage(width=4, height=4, rgb=b"\0" * 10), width=W, height=H), "RGB image"),
    (dict(width=W, height=H), "needs `image`"),
])
def test_decoder_encode_image_rejects_bad_input(clients, req, needle):
    with pytest.raises(grpc.RpcError) as e:
        list(clients.decoder.EncodeImage(decoder_pb2.EncodeImageRequest(**req), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_encoder_keyframe_presentation_and_tags(clients):
    from render_svc.stage_calls import encode

    s0, t0, _ = encode(clients, "a fox", with_tags=True)
    assert (t0 == 1).all() and t0.shape == (s0.shape[0],)
    s, tags, res = encode(clients, "a fox", keyframes=[_png(W, H, 2), _png(W, H, 3)], width=W, height=H,
                          with_tags=True)
    n_pad = (H // 16) * (W // 16) // 4
    assert (tags == 0).sum().item() == 2 * (n_pad + 2)  # pads + vision_start/end, per keyframe
    assert s.shape[0] == tags.shape[0] == res.extra["tokens"] and s.shape[0] > s0.shape[0] + 2 * n_pad
    assert torch.equal(tags[-s0.shape[0]:], torch.ones(s0.shape[0], dtype=torch.int64))  # the prompt is last


@pytest.mark.parametrize("req,needle", [
    (dict(prompt="x", keyframes=[b"garbage"], width=W, height=H), "not a readable"),
    (dict(prompt="x", keyframes=[_png(32, 32)], width=100, height=H), "multiple of 32"),
    (dict(prompt="x", keyframes=[_png(32, 32)] * 3, width=W, height=H), "at most 2"),
])
def test_encoder_rejects_bad_keyframes(clients, req, needle):
    with pytest.raises(grpc.RpcError) as e:
        list(clients.encoder.Encode(encoder_pb2.EncodeRequest(**req), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_dit_rejects_bad_keyframe_tensors(clients):
    from minimax_h3.contract import RenderSpec
    from render_svc.stage_calls import encode, sample

    spec = RenderSpec(prompt="x", width=W, height=H, frames=F, steps=1, seed=1)
    s, _ = encode(clients, "x")
    for extra, needle in (({"keyframe_first": torch.zeros(24, 1, 8, 8)}, "canvas needs"),
                          ({"keyframe_last": torch.full((24, 1, 16, 16), float("nan"))}, "NaN"),
                          ({"text_tags": torch.full((s.shape[0],), 2, dtype=torch.int64)}, "may only hold"),
                          ({"text_tags": torch.ones(s.shape[0] + 1, dtype=torch.int64)}, "expected")):
        with pytest.raises(grpc.RpcError) as e:
            sample(clients, spec, s, extra=extra)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value.details()


def test_fl2va_render_mp4(clients, tmp_path):
    import av

    from client.render_client import render_request
    from minimax_h3.contract import RenderSpec
    from render_svc.engine import render

    out = tmp_path / "fl2va.mp4"
    spec = RenderSpec(prompt="the sun sets over the sea, waves crash", width=W, height=H, frames=F, steps=2, seed=4)
    res = render(clients, render_request(spec, first_frame=_png(400, 300, 5), last_frame=_png(W, H, 6, "JPEG")), out)
    assert [s.stage for s in res.stages] == ["decoder", "encoder", "dit", "decoder"]  # both keyframes: one stage
    assert len(res.stages[0].extra["calls"]) == 2
    with av.open(str(out)) as c:
        v = c.streams.video[0]
        assert (v.width, v.height) == (W, H) and c.streams.audio
        assert sum(1 for _ in c.decode(video=0)) == F


def test_cli_first_last_frame(stack, tmp_path):
    _, ep = stack
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(_png(W, H, 7))
    b.write_bytes(_png(500, 260, 8, "JPEG"))
    out = tmp_path / "cli.mp4"
    args = ["--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder]
    r = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "birds", "--first-frame", str(a),
                        "--last-frame", str(b), "-o", str(out), "--width", str(W), "--height", str(H), "--frames",
                        str(F), "--steps", "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.exists() and out.stat().st_size > 0
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    r = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "birds", "--first-frame", str(bad),
                        "-o", str(tmp_path / "x.mp4"), "--width", str(W), "--height", str(H), "--frames", str(F),
                        "--steps", "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    # refused by the client itself, naming the file (the stages' own refusal is tested above)
    assert r.returncode == 2 and f"error: --first-frame {bad}: keyframe is not a readable" in r.stderr, r.stderr
