"""Guides at any frame (ComfyUI's MiniMaxH3AddGuide): an image and / or a sound anchored at pixel frame i.

- A guide at frame 0 / F - 1 is today's first / last keyframe, bit for bit (layout and sampled latents).
- A middle guide (image + sound) through our conditioned model call == diffusers' H3 transformer on a packed sequence
  built here from diffusers' own grid helpers: the guide image on the target grid at time L + 5/3 i, its sound clean
  at L + 5/3 i + k with its channels at the grid's w extremes.
- The wire form (`guide_frames`, `guide_<g>_image`, `guide_<g>_audio`): negative frames, the sound cut to the room
  left in the audio track, refusals naming the tensor.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from minimax_h3.contract import GUIDE_FRAMES, guide_tensor
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.guides import parse_guides
from minimax_h3.dit.keyframes import condition_rows, conditioned_denoise
from minimax_h3.dit.layout import (Guide, ReferenceBlock, build_layout, build_ref2va_layout, latent_shape,
                                   patchify_audio, patchify_video)
from minimax_h3.dit.sampling import SamplerConfig, draw_noise, sample
from stagekit.errors import InvalidArgument
from tests.test_fl2va import tiny_dit  # noqa: F401 - the fixture: our DiT with a tiny diffusers model's weights

L, F, H, W = 7, 22, 64, 96  # Ta = 37 audio latents; 4x6 latents, 2x3 = 6 rows per latent frame
TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1])


def _latents(cfg, n, seed=10):
    return [torch.randn(cfg.in_channels, 1, H // 16, W // 16, generator=torch.Generator().manual_seed(seed + i))
            for i in range(n)]


def test_first_and_last_guides_are_the_keyframes_bit_for_bit(tiny_dit):
    cfg, m, _ = tiny_dit
    kf = build_layout(cfg, L, F, H, W, ("first", "last"), text_tags=TAGS)
    gd = build_layout(cfg, L, F, H, W, text_tags=TAGS, guides=(Guide(0), Guide(F - 1)))
    for field in ("position_ids", "tag", "kind", "video_idx", "audio_idx", "text_idx"):
        assert torch.equal(getattr(kf, field), getattr(gd, field)), field
    assert kf.kinds == gd.kinds and kf.num_cond_rows == gd.num_cond_rows
    lat = _latents(cfg, 2)
    vshape = (cfg.in_channels, kf.shape.latent_frames, H // 16, W // 16)
    c_noise, v_noise, a_rows = draw_noise(3, [z.shape for z in lat], vshape, (2 * kf.shape.audio_latents, 32))
    cond = condition_rows(lat, c_noise, cfg.patch)
    text = torch.randn(L, cfg.text_dim, generator=torch.Generator().manual_seed(4))
    v_rows = patchify_video(v_noise, cfg.patch)
    with torch.no_grad():
        a = sample(conditioned_denoise(m, text, kf, cond), v_rows, a_rows, SamplerConfig(steps=2))
        b = sample(conditioned_denoise(m, text, gd, cond), v_rows, a_rows, SamplerConfig(steps=2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _reference_sequence(cfg, frame: int, n_audio: int):
    """The packed sequence of a t2va request with one guide (image + sound) at `frame`, built from diffusers' grid
    helpers in ComfyUI's order [text | guide image | guide sound | target audio | target video]: (position_ids,
    tags, video_idx, audio_idx, text_idx)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                        _fill_audio_positions, _frame_position_grid)

    shp = latent_shape(cfg, F, H, W)
    base_pos, base_tags, base_v, base_a, base_t, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        TAGS, shp.latent_frames, shp.latent_height, shp.latent_width, shp.audio_latents, cfg.patch, 2, 2, 0, ())
    hw, wg = _frame_position_grid(shp.latent_height, shp.latent_width, 2, 2)
    rpf, extra = hw.shape[0], hw.shape[0] + 2 * n_audio
    time = L + frame * 5.0 / 3.0
    pos = torch.zeros(base_pos.shape[0] + extra, 3, dtype=torch.float64)
    pos[:L] = base_pos[:L]
    pos[L:L + rpf, 0] = time
    pos[L:L + rpf, 1:] = hw
    _fill_audio_positions(pos, slice(L + rpf, L + extra), n_audio, time, wg, 2)
    pos[L + extra:] = base_pos[L:]
    tags = torch.cat([base_tags[:L], torch.zeros(rpf, dtype=torch.long), torch.full((2 * n_audio,), 2),
                      base_tags[L:]])
    video_idx = torch.cat([torch.arange(L, L + rpf), base_v + extra])
    audio_idx = torch.cat([torch.arange(L + rpf, L + extra), base_a + extra])
    return pos, tags, video_idx, audio_idx, base_t


@pytest.mark.parametrize("frame", [9, 13])
def test_middle_guide_matches_diffusers_transformer(tiny_dit, frame):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    from tests.test_dit_model import rel

    cfg, m, dm = tiny_dit
    shp = latent_shape(cfg, F, H, W)
    room = math.floor(shp.audio_latents - 5 / 3 * frame)
    n_audio = min(19, room)
    lay = build_layout(cfg, L, F, H, W, text_tags=TAGS, guides=(Guide(frame, True, n_audio),))
    assert lay.num_cond_rows == lay.rows_per_frame and lay.num_ref_audio_rows == 2 * n_audio
    (z,) = _latents(cfg, 1)
    vshape = (cfg.in_channels, shp.latent_frames, H // 16, W // 16)
    c_noise, v_noise, a_noise = draw_noise(5, [z.shape], vshape, (2 * shp.audio_latents, 32))
    cond = condition_rows([z], c_noise, cfg.patch)
    sound = torch.randn(2, 32, n_audio, generator=torch.Generator().manual_seed(6))
    sound_rows = patchify_audio(sound)
    text = torch.randn(L, cfg.text_dim, generator=torch.Generator().manual_seed(7))
    v_rows = patchify_video(v_noise, cfg.patch)
    tv, ta = 0.3, 0.5
    with torch.no_grad():
        ours_v, ours_a = conditioned_denoise(m, text, lay, cond, sound_rows)(v_rows, a_noise, torch.tensor(tv),
                                                                           torch.tensor(ta))
    pos, tags, vidx, aidx, tidx = _reference_sequence(cfg, frame, n_audio)
    ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(vidx, aidx, lay.rows_per_frame, 2 * n_audio, L, tv, ta,
                                                           max(tv, 0.999), 1.0)
    with torch.no_grad():
        ref_v, ref_a = dm(torch.cat([cond, v_rows])[None], torch.cat([sound_rows, a_noise])[None], text[None], ts,
                          ti, tags, pos.float(), vidx, aidx, tidx, return_dict=False)
    n = lay.rows_per_frame
    ev, ea = rel(ours_v, ref_v[0, n:]), rel(ours_a, ref_a[0, 2 * n_audio:])
    print(f"guide at frame {frame}: video rel {ev:.2e}, audio rel {ea:.2e}")
    assert ev < 1e-5 and ea < 1e-5
    # and the guide moves the result: the same request without it differs
    plain = build_layout(cfg, L, F, H, W, text_tags=TAGS)
    with torch.no_grad():
        without = m(v_rows, a_noise, text, torch.tensor(tv), torch.tensor(ta), plain)[0]
    assert rel(ours_v, without) > 1e-3


def test_ref2va_guides_start_where_the_references_end():
    cfg = DiTConfig.tiny()
    refs = [ReferenceBlock("image", 1, 4, 4), ReferenceBlock("audio", audio_latents=9)]
    plain = build_ref2va_layout(cfg, L, F, H, W, refs)
    lay = build_ref2va_layout(cfg, L, F, H, W, refs, guides=(Guide(6), Guide(12, False, 3)))
    origin = plain.position_ids_f64[plain.video[0], 0].item()  # the target's first latent frame: the clock's end
    assert origin == L + 1 + 9
    img = lay.video_idx[lay.num_cond_rows - lay.rows_per_frame:lay.num_cond_rows]
    assert (lay.position_ids_f64[img, 0] == origin + 5 / 3 * 6).all()
    sound = lay.audio_idx[lay.num_ref_audio_rows - 6:lay.num_ref_audio_rows]
    assert lay.position_ids_f64[sound, 0].tolist() == [origin + 5 / 3 * 12 + k for k in (0, 1, 2)] * 2
    assert torch.equal(lay.position_ids_f64[lay.video[0]:], plain.position_ids_f64[plain.video[0]:])


def _wire(cfg, frames: list[int], images=(), sounds=()) -> dict:
    inputs = {GUIDE_FRAMES: torch.tensor(frames, dtype=torch.int64)}
    for g in images:
        inputs[guide_tensor(g, "image")] = torch.randn(cfg.in_channels, 1, H // 16, W // 16)
    for g, n in sounds:
        inputs[guide_tensor(g, "audio")] = torch.randn(2, 32, n)
    return inputs


def test_wire_form_resolves_frames_and_cuts_sounds():
    cfg = DiTConfig.tiny()
    shp = latent_shape(cfg, F, H, W)
    g = parse_guides(_wire(cfg, [0, -1, 12], images=(0, 1), sounds=((2, 100), (1, 9))), shp, cfg.in_channels, 32)
    assert [b.frame for b in g.blocks] == [0, F - 1, 12] and [b.image for b in g.blocks] == [True, True, False]
    room = math.floor(shp.audio_latents - 5 / 3 * 12)  # ComfyUI's cut: what remains from frame 12 on
    assert [b.audio_latents for b in g.blocks] == [0, 2, room]  # at the last frame 2 of 37 latents remain
    assert [a.shape[2] for a in g.audio] == [2, room] and g.audio_rows().shape == (2 * (2 + room), 32)


@pytest.mark.parametrize("frames,images,sounds,problem", [
    ([22], (0,), (), "guide frame 22 is outside the video's 22 frames"),
    ([-23], (0,), (), "guide frame -23 is outside"),
    ([3, 4], (0,), (), "guide 1 has neither guide_1_image nor guide_1_audio"),
    ([3], (0, 1), (), "guide_1_image has no frame"),
])
def test_wire_form_refusals(frames, images, sounds, problem):
    cfg = DiTConfig.tiny()
    with pytest.raises(InvalidArgument, match=problem):
        parse_guides(_wire(cfg, frames, images, sounds), latent_shape(cfg, F, H, W), cfg.in_channels, 32)
    inputs = _wire(cfg, [3], (0,))
    inputs[guide_tensor(0, "image")] = torch.randn(cfg.in_channels, 1, 2, 2)
    with pytest.raises(InvalidArgument, match=r"guide_0_image is torch.float32 \[24, 1, 2, 2\], but this render's "
                                              r"canvas needs a float \[24, 1, 4, 6\]"):
        parse_guides(inputs, latent_shape(cfg, F, H, W), cfg.in_channels, 32)


# ---------------------------------------------------------------------------------------------------------------
# Through the stages and the render service (real processes, the embedded tiny stack)
# ---------------------------------------------------------------------------------------------------------------
SW, SH, SF = 256, 256, 22  # the services' render size (the embedded model)


def _wav(seconds: float = 0.6, rate: int = 32000) -> bytes:
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def test_guide_render_mp4(clients, tmp_path):
    """A text render with a middle guide (image + sound) and a guide on the last frame (image): the decoder encodes
    the two images at the canvas and the sound, the DiT takes them, the MP4 has every frame."""
    import av

    from client.render_client import render_request
    from h3.v1 import common_pb2
    from minimax_h3.contract import RenderSpec
    from render_svc.engine import render
    from tests.test_fl2va import _png

    guides = [common_pb2.Guide(frame=10, image=common_pb2.Reference(kind="image", data=_png(300, 200, 1)),
                               audio=common_pb2.Reference(kind="audio", data=_wav(), name="tone.wav")),
              common_pb2.Guide(frame=-1, image=common_pb2.Reference(kind="image", data=_png(SW, SH, 2)))]
    spec = RenderSpec(prompt="a bell rings in a garden", width=SW, height=SH, frames=SF, steps=2, seed=3)
    out = tmp_path / "guides.mp4"
    res = render(clients, render_request(spec, guides=guides), out)
    assert [s.stage for s in res.stages] == ["decoder", "encoder", "dit", "decoder"]
    assert [c["op"] for c in res.stages[0].extra["calls"]] == ["encode_image", "encode_reference", "encode_image"]
    with av.open(str(out)) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (SW, SH) and c.streams.audio
        assert sum(1 for _ in c.decode(video=0)) == SF


def test_dit_refuses_bad_guide_tensors(clients):
    from render_svc.stage_calls import encode, sample
    from minimax_h3.contract import RenderSpec

    spec = RenderSpec(prompt="x", width=SW, height=SH, frames=SF, steps=1, seed=1)
    s, _ = encode(clients, "x")
    image = torch.zeros(24, 1, SH // 16, SW // 16)
    for extra, needle in (({GUIDE_FRAMES: torch.tensor([SF]), guide_tensor(0, "image"): image},
                           f"guide frame {SF} is outside the video's {SF} frames"),
                          ({guide_tensor(0, "image"): image}, "guide tensors without guide_frames"),
                          ({GUIDE_FRAMES: torch.tensor([2]), guide_tensor(0, "audio"): torch.zeros(2, 32, 3, 1)},
                           "guide_0_audio")):
        with pytest.raises(Exception) as e:
            sample(clients, spec, s, extra=extra)
        assert e.value.code().name == "INVALID_ARGUMENT" and needle in e.value.details(), e.value.details()


def test_cli_guides_through_the_render_service(stack, tmp_path):
    """`--guide FILE[+FILE]@WHEN`: files uploaded by digest, stored by the render service, encoded, sampled;
    refusals exit 2 naming the flag."""
    import subprocess
    import sys

    from tests.test_fl2va import ROOT, _png

    _, ep = stack
    img, snd = tmp_path / "face.png", tmp_path / "voice.wav"
    img.write_bytes(_png(SW, SH, 4))
    snd.write_bytes(_wav())
    args = ["--prompt", "someone says hello", "--width", str(SW), "--height", str(SH), "--frames", str(SF),
            "--steps", "1", "--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "client", "render", *args, *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "cli.mp4"
    r = cli("--guide", f"{img}@0.25", "--guide", f"{img}+{snd}@f-5", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 0
    for spec, needle in ((f"{img}@soon", "write FILE[+FILE]@SECONDS"), (f"{img}@f22", "guide frame 22 is outside"),
                         (f"{img}+{img}@0.5", "one image and / or one audio file"),
                         (f"{tmp_path / 'none.png'}@0.5", "cannot read")):
        r = cli("--guide", spec, "-o", str(tmp_path / "x.mp4"))
        assert r.returncode == 2 and f"error: --guide {spec}: " in r.stderr and needle in r.stderr, r.stderr


def test_http_and_admission_refusals():
    """The HTTP API's `guides` field (frame or seconds) -> the same RenderRequest; the service's admission names the
    guide."""
    import base64

    from render_svc.http_api import render_request
    from render_svc.admission import check_request
    from tests.test_fl2va import _png

    png = base64.b64encode(_png(64, 64)).decode()
    req = render_request({"prompt": "x", "size": f"{SW}x{SH}", "frames": SF,
                          "guides": [{"seconds": 0.5, "image": png}, {"frame": -1, "image": png}]}, "")
    assert [g.frame for g in req.guides] == [12, -1] and req.guides[0].image.kind == "image"
    check_request(req)
    for guide, needle in (({"seconds": 1, "frame": 2, "image": png}, "guides[0]: guides must be a list"),
                          ({"frame": 2}, None), ({"frame": 2, "video": png}, "guides[0]")):
        body = {"prompt": "x", "size": f"{SW}x{SH}", "frames": SF, "guides": [guide]}
        if needle is None:  # accepted by the parser, refused by the admission: no image, no sound
            with pytest.raises(InvalidArgument, match=r"guide 1 \(frame 2\): needs an image and / or an audio"):
                check_request(render_request(body, ""))
        else:
            with pytest.raises(InvalidArgument, match=re.escape(needle)):
                render_request(body, "")
    bad = render_request({"prompt": "x", "size": f"{SW}x{SH}", "frames": SF,
                          "guides": [{"frame": 40, "image": png}]}, "")
    with pytest.raises(InvalidArgument, match=r"guide 1 \(frame 40\): guide frame 40 is outside the video's 22"):
        check_request(bad)
