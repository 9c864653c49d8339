"""H3 as an image model: one frame (IMAGE_FRAMES) is one latent frame and no audio at all (ComfyUI's EmptyLatentImage
graph), the model call checked against diffusers' H3 transformer on the packed sequence diffusers' own layout builder
makes for one latent frame and no audio; the contract's clock and the sampler's noise for it. The render through the
stages, the CLI's `--frames 1` and the image template: tests/test_workflows.py."""

from __future__ import annotations

import pytest
import torch

from minimax_h3.contract import IMAGE_FRAMES, RenderSpec, audio_latent_count, validate, video_latent_frames
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout, latent_shape, patchify_video
from minimax_h3.dit.sampling import SamplerConfig, draw_noise, sample
from stagekit.errors import InvalidArgument
from tests.test_fl2va import tiny_dit  # noqa: F401 - the fixture: our DiT with a tiny diffusers model's weights

L, H, W = 7, 64, 96
TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1])


def test_one_frame_is_one_latent_frame_and_no_sound():
    assert IMAGE_FRAMES == 1 and video_latent_frames(1) == 1 and audio_latent_count(1) == 0
    validate(RenderSpec(prompt="a fox", width=256, height=256, frames=1))
    for bad in (2, 5, 21):
        with pytest.raises(InvalidArgument, match=f"frames={bad} is not valid: .* or 1 for an image"):
            validate(RenderSpec(prompt="a fox", width=256, height=256, frames=bad))
    shp = latent_shape(DiTConfig.tiny(), IMAGE_FRAMES, H, W)
    assert (shp.latent_frames, shp.audio_latents) == (1, 0)


def test_one_frame_model_call_matches_diffusers_transformer(tiny_dit):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                        MiniMaxH3SetTimestepsStep)

    from tests.test_dit_model import rel

    cfg, m, dm = tiny_dit
    lay = build_layout(cfg, L, IMAGE_FRAMES, H, W, text_tags=TAGS)
    # the image's noise: the video draw alone (no audio rows drawn), as for any seed
    _, v, a = draw_noise(3, (), (cfg.in_channels, 1, H // 16, W // 16), (0, cfg.audio_in_channels))
    _, v22, _ = draw_noise(3, (), (cfg.in_channels, 1, H // 16, W // 16), (2, cfg.audio_in_channels))
    assert a.shape == (0, cfg.audio_in_channels) and torch.equal(v, v22)
    v_rows = patchify_video(v, cfg.patch)
    text = torch.randn(L, cfg.text_dim, generator=torch.Generator().manual_seed(4))
    tv, ta = 0.3, 0.5
    with torch.no_grad():
        ours_v, ours_a = m(v_rows, a, text, torch.tensor(tv), torch.tensor(ta), lay)
    pos, tags, vidx, aidx, tidx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        TAGS, 1, H // 16, W // 16, 0, cfg.patch, 2, 2, 0, ())
    assert torch.equal(pos.double(), lay.position_ids_f64) and aidx.numel() == 0
    ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(vidx, aidx, 0, 0, L, tv, ta, max(tv, 0.999), 1.0)
    with torch.no_grad():
        ref_v, ref_a = dm(v_rows[None], a[None], text[None], ts, ti, tags, pos.float(), vidx, aidx, tidx,
                          return_dict=False)
    err = rel(ours_v, ref_v[0])
    print(f"one frame: video rel {err:.2e}")
    assert err < 1e-5 and ours_a.shape == ref_a[0].shape == (0, cfg.audio_in_channels)
    # and a whole sampling run of it: finite, one latent frame, no audio
    with torch.no_grad():
        x, y = sample(lambda xv, ya, t_v, t_a: m(xv, ya, text, t_v, t_a, lay), v_rows, a, SamplerConfig(steps=2))
    assert x.shape == v_rows.shape and torch.isfinite(x).all() and y.shape == (0, cfg.audio_in_channels)
