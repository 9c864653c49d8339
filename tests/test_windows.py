"""Long video on the DiT (docs/long_video.md): window plans (minimax_h3.contract), window layouts, fused and
continuation sampling (minimax_h3/dit/windows.py) and the DiT engine's windowed path.

Fidelity: a plan of one window is today's render bit for bit; fused windows equal diffusers' transformer called per
window with the fusion weights computed here; continuation windows equal a diffusers-style loop over packed sequences
built here (the guide rows placed by this test); TP2 ranks agree bit for bit on every window.
"""

from __future__ import annotations

import pytest
import torch

from minimax_h3 import contract as c
from minimax_h3.contract import RenderSpec, Window, plan_windows
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout, patchify_audio, patchify_video, unpatchify_audio, unpatchify_video
from minimax_h3.dit.sampling import SamplerConfig, draw_noise
from minimax_h3.dit.windows import FusedWindows, fuse_weights, sample_continuation, sample_fused, window_layout
from stagekit.errors import InvalidArgument
from stagekit.checkpoints import WeightSource

H, W = 64, 96          # latent 4 x 6, 6 rows a latent frame


# ---------------------------------------------------------------------------------------------------------------
# Plans (torch-free contract)
# ---------------------------------------------------------------------------------------------------------------
def test_plans_align_to_clips_and_tile_the_clip():
    spec = RenderSpec(prompt="a", frames=1450)
    plan = plan_windows(spec)
    assert (plan.mode, plan.window_frames, plan.overlap, plan.picked) == ("continuation", 175, 22, True)
    assert plan.describe() == "continuation: 10 windows of 175 frames, overlap 22 (picked)"
    kept_video, kept_audio = 0, 0
    for k, w in enumerate(plan.windows):
        assert w.start % c.FRAME_CLIP == 0 and (w.frames - c.FRAME_OFFSET) % c.FRAME_CLIP == 0
        assert w.guide == (0 if k == 0 else 22)
        if k:  # a window starts `overlap` frames before the previous one ends
            assert w.start == plan.windows[k - 1].end - 22
        kept_video += w.latent_frames - w.guide_latents
        kept_audio += w.audio_latents - w.guide_audio
    # The frames each window adds tile the clip: its latents and its audio latents, the whole clip's count.
    assert kept_video == c.video_latent_frames(1450) and kept_audio == c.audio_latent_count(1450)
    assert plan.windows[-1].end == 1450
    fused = plan_windows(RenderSpec(prompt="a", frames=1450, window_mode="fused"))
    assert fused.overlap == 39 and fused.fuse == "pyramid" and not fused.picked
    starts = [w.start for w in fused.windows]
    assert starts[:3] == [0, 136, 272] and fused.windows[-1].end == 1450 and all(w.frames == 175 for w in fused.windows)


def test_one_window_until_the_single_window_limit():
    for frames in (124, 362, c.MAX_WINDOW_FRAMES):
        plan = plan_windows(RenderSpec(frames=frames))
        assert plan.mode == "single" and plan.windows == (Window(0, frames, 0, 0),)
    assert plan_windows(RenderSpec(frames=532)).mode == "continuation"  # past one window: windows, no knob needed
    assert plan_windows(RenderSpec(frames=362, window_frames=362)).mode == "single"
    assert plan_windows(RenderSpec(frames=362, window_frames=175)).mode == "continuation"
    assert plan_windows(RenderSpec(frames=124, window_mode="fused")).mode == "single"  # 124 < 175: one window
    # Several prompts take turns: windows, no knob needed.
    assert plan_windows(RenderSpec(prompt="a", more_prompts=("b",), frames=362)).describe() == \
        "continuation: 3 windows of 175 frames, overlap 22 (picked)"


def test_prompts_take_the_windows_they_fall_in():
    spec = RenderSpec(prompt="a", more_prompts=("b", "c"), frames=362, window_frames=124, window_overlap=22)
    assert [w.prompt for w in plan_windows(spec).windows] == [0, 1, 2, 2]  # spread evenly: from 0, 5.0, 10.1 s
    timed = RenderSpec(prompt="a", more_prompts=("b",), prompt_starts=(10.0,), frames=362, window_frames=124,
                       window_overlap=22)
    assert [w.prompt for w in plan_windows(timed).windows] == [0, 0, 1, 1]
    with pytest.raises(InvalidArgument, match="prompt 2 of 2 is used by no window"):
        plan_windows(RenderSpec(prompt="a", more_prompts=("b",), frames=124))
    with pytest.raises(InvalidArgument, match="must rise strictly"):
        plan_windows(RenderSpec(prompt="a", more_prompts=("b",), prompt_starts=(20.0,), frames=362))
    with pytest.raises(InvalidArgument, match="prompt 2 is empty"):
        plan_windows(RenderSpec(prompt="a", more_prompts=(" ",), frames=1450))


def test_extension_span_and_guide():
    spec = RenderSpec(prompt="a", frames=362, prefix_frames=124)  # 5.2 s + 9.9 s
    plan = plan_windows(spec)
    first = plan.windows[0]
    assert (first.start, first.guide) == (102, 22) and plan.span_start == spec.span_start == 102
    assert spec.latent_frames == c.video_latent_frames(362 - 102) and spec.guide_latents == 7
    assert spec.audio_latents == c.audio_latent_count(362) - c.audio_latent_count(102)
    assert spec.guide_audio_latents == c.audio_latent_count(124) - c.audio_latent_count(102)
    assert c.tensor_shapes([c.TAIL_VIDEO, c.TAIL_AUDIO], RenderSpec(width=256, height=256, frames=362,
                                                                    prefix_frames=124)) == {
        c.TAIL_VIDEO: (24, 7, 16, 16), c.TAIL_AUDIO: (2, 32, 37)}


@pytest.mark.parametrize("fields,match", [
    (dict(window_frames=100), "window_frames=100 is not valid"),
    (dict(window_frames=532), "window_frames=532 is not valid"),
    (dict(window_frames=39, window_mode="fused"), "no new frames"),
    (dict(window_overlap=30), "window_overlap=30 is not valid"),
    (dict(window_mode="sliding"), "window_mode 'sliding' is not valid"),
    (dict(window_fuse="pyramid"), "window_fuse applies to fused windows"),
    (dict(prefix_frames=124, window_mode="fused"), "continuation windows"),
    (dict(prefix_frames=362), "prefix_frames=362 is not valid"),
    (dict(frames=7213), "frames=7213 is not valid"),
])
def test_bad_window_settings_are_refused(fields, match):
    with pytest.raises(InvalidArgument, match=match):
        c.validate(RenderSpec(**{"prompt": "a", "frames": 362, **fields}))


def test_spec_fields_round_trip_the_proto():
    from h3.v1 import common_pb2

    spec = RenderSpec(prompt="a", frames=1450, window_frames=209, window_overlap=39, window_mode="fused",
                      window_fuse="flat", more_prompts=("b", "c"), prompt_starts=(20.0, 40.0))
    msg = common_pb2.RenderParams()
    c.spec_to_proto(spec, msg)
    assert c.spec_from_proto(msg) == spec


# ---------------------------------------------------------------------------------------------------------------
# Layouts and weights
# ---------------------------------------------------------------------------------------------------------------
def test_window_layout_at_zero_is_todays_layout_and_others_sit_on_the_clips_clock():
    cfg = DiTConfig.tiny()
    whole = build_layout(cfg, 7, 175, H, W)
    first = window_layout(cfg, 7, 7, Window(0, 175, 0, 0), H, W)
    for f in ("tag", "kind", "position_ids", "position_ids_f64", "video_idx", "audio_idx", "text_idx"):
        assert torch.equal(getattr(whole, f), getattr(first, f)), f
    later = window_layout(cfg, 5, 7, Window(102, 73, 22, 0), H, W)  # a shorter prompt, a guide of 22 frames
    rpf = later.rows_per_frame
    lat0, a0 = 102 // 17 * 5, c.audio_latent_count(102)
    wv = whole.position_ids_f64[whole.video[0] + lat0 * rpf: whole.video[1]]
    lv = later.position_ids_f64[later.video[0]: later.video[1]]
    torch.testing.assert_close(lv, wv, rtol=0, atol=1e-9)  # the same latents at the same times
    ta, wta = later.shape.audio_latents, whole.shape.audio_latents
    for ch in range(2):
        got = later.position_ids_f64[later.audio[0] + ch * ta: later.audio[0] + (ch + 1) * ta]
        want = whole.position_ids_f64[whole.audio[0] + ch * wta + a0: whole.audio[0] + ch * wta + a0 + ta]
        assert torch.equal(got, want)
    # The guide: 7 latent frames and 37 audio latents a channel in front of the targets, at the targets' times.
    ng, nga = later.num_cond_rows, later.num_ref_audio_rows
    assert (ng, nga) == (7 * rpf, 2 * 37)
    assert torch.equal(later.position_ids_f64[later.video_idx[:ng]], lv[:ng])
    assert (later.kind[later.video_idx[:ng]] == 1).all() and (later.kind[later.audio_idx[:nga]] == 3).all()
    assert (later.tag[:5] == 1).all() and (later.tag[later.audio_idx] == 2).all()


def test_fuse_weights_are_comfyuis():
    assert fuse_weights("pyramid", 5, 2, True, True).tolist() == [1, 2, 3, 2, 1]
    assert fuse_weights("pyramid", 4, 2, True, True).tolist() == [1, 2, 2, 1]
    assert fuse_weights("flat", 3, 1, False, False).tolist() == [1, 1, 1]
    w = fuse_weights("overlap-linear", 6, 3, False, True)
    assert w[:3].tolist() == pytest.approx([1e-37, 0.5, 1.0]) and w[3:].tolist() == [1, 1, 1]


# ---------------------------------------------------------------------------------------------------------------
# Against diffusers (the oracle), on tiny weights
# ---------------------------------------------------------------------------------------------------------------
diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def tiny():
    from minimax_h3.dit.convert_diffusers import from_diffusers
    from minimax_h3.dit.model import H3DiT
    from tests.test_dit_model import diffusers_model

    cfg = DiTConfig.tiny()
    dm = diffusers_model(cfg)
    m = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=64).eval()
    m.load_state_dict(from_diffusers(dm.state_dict()))
    return cfg, m, dm


def _reference_sequence(cfg, text_len: int, origin: int, w: Window):
    """A window's packed sequence built here, apart from window_layout: diffusers' one-clip layout of the window's
    shape, its media moved onto the clip's clock, and the guide (continuation) put in front of the targets at the
    targets' own times. Returns (positions, tags, video idx, audio idx, text idx, guide video rows, guide audio)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    lh, lw = H // 16, W // 16
    rpf = (lh // 2) * (lw // 2)
    pos, tags, vidx, aidx, tidx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text_len, dtype=torch.long), w.latent_frames, lh, lw, w.audio_latents, cfg.patch, 2, 2, 0, ())
    pos = pos.clone()
    pos[text_len:, 0] += origin - text_len  # the media after the longest prompt
    pos[vidx, 0] += 5 / 3 * w.start
    pos[aidx, 0] += c.audio_latent_count(w.start)
    gv, ga = w.guide_latents * rpf, w.guide_audio
    ta = w.audio_latents
    g_audio = torch.cat([aidx[:ga], aidx[ta:ta + ga]])  # each channel's first audio latents
    guide_pos = torch.cat([pos[vidx[:gv]], pos[g_audio]])
    guide_tags = torch.cat([torch.zeros(gv, dtype=torch.long), torch.full((2 * ga,), 2)])
    n = gv + 2 * ga
    pos = torch.cat([pos[:text_len], guide_pos, pos[text_len:]])
    tags = torch.cat([tags[:text_len], guide_tags, tags[text_len:]])
    video_idx = torch.cat([torch.arange(text_len, text_len + gv), vidx + n])
    audio_idx = torch.cat([torch.arange(text_len + gv, text_len + n), aidx + n])
    return pos, tags, video_idx, audio_idx, tidx, gv, 2 * ga


def _reference_forward(dm, seq, video, audio, text, tv: float, ta: float):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    pos, tags, vidx, aidx, tidx, gv, ga = seq
    ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(vidx, aidx, gv, ga, len(tidx), tv, ta, max(tv, 0.999), 1.0)
    with torch.no_grad():
        v, a = dm(video[None], audio[None], text[None], ts, ti, tags, pos.float(), vidx, aidx, tidx, return_dict=False)
    return v[0], a[0]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fuse", ["pyramid", "overlap-linear"])
def test_fused_step_equals_diffusers_per_window(tiny, fuse):
    """One fused denoise call vs diffusers' transformer called per window, the velocities weighted by fusion
    weights computed here (ComfyUI's definitions) and averaged per latent."""
    cfg, m, dm = tiny
    spec = RenderSpec(prompt="a", more_prompts=("b",), frames=56, width=W, height=H, window_frames=39,
                      window_overlap=22, window_mode="fused", window_fuse=fuse)
    plan = plan_windows(spec)
    assert [(w.start, w.frames, w.prompt) for w in plan.windows] == [(0, 39, 0), (17, 39, 1)]
    g = torch.Generator().manual_seed(3)
    texts = [torch.randn(7, cfg.text_dim, generator=g), torch.randn(5, cfg.text_dim, generator=g)]
    t_all, ta_all, rpf = c.video_latent_frames(56), c.audio_latent_count(56), 6
    xv = torch.randn(t_all * rpf, 96, generator=g)
    xa = torch.randn(2 * ta_all, 32, generator=g)
    with torch.no_grad():
        ours_v, ours_a = FusedWindows(m, cfg, plan, texts, H, W, "cpu")(xv, xa, torch.tensor(0.4), torch.tensor(0.6))

    def weights(n: int, ov: int, first: bool, last: bool) -> torch.Tensor:
        if fuse == "pyramid":
            half = (n + 1) // 2
            return torch.tensor(list(range(1, half + 1)) + list(range(n - half, 0, -1)), dtype=torch.float64)
        w = torch.ones(n, dtype=torch.float64)
        if not first:
            w[:ov] = torch.linspace(1e-37, 1, ov, dtype=torch.float64)
        if not last:
            w[n - ov:] = torch.linspace(1, 1e-37, ov, dtype=torch.float64)
        return w

    num_v, den_v = torch.zeros(t_all, rpf, 96, dtype=torch.float64), torch.zeros(t_all, 1, 1, dtype=torch.float64)
    num_a, den_a = torch.zeros(2, ta_all, 32, dtype=torch.float64), torch.zeros(1, ta_all, 1, dtype=torch.float64)
    for k, w in enumerate(plan.windows):
        seq = _reference_sequence(cfg, texts[w.prompt].shape[0], 7, w)
        l0, a0 = w.latent_start, w.audio_start
        wx = xv.view(t_all, rpf, 96)[l0:l0 + w.latent_frames].reshape(-1, 96)
        wa = xa.view(2, ta_all, 32)[:, a0:a0 + w.audio_latents].reshape(-1, 32)
        v, a = _reference_forward(dm, seq, wx, wa, texts[w.prompt], 0.4, 0.6)
        wvid = weights(w.latent_frames, 7, k == 0, k == 1)[:, None, None]
        wau = weights(w.audio_latents, 37, k == 0, k == 1)[None, :, None]
        num_v[l0:l0 + w.latent_frames] += wvid * v.double().view(-1, rpf, 96)
        den_v[l0:l0 + w.latent_frames] += wvid
        num_a[:, a0:a0 + w.audio_latents] += wau * a.double().view(2, -1, 32)
        den_a[:, a0:a0 + w.audio_latents] += wau
    ref_v, ref_a = (num_v / den_v).view(-1, 96), (num_a / den_a).view(-1, 32)
    assert rel(ours_v, ref_v) < 1e-5 and rel(ours_a, ref_a) < 1e-5, (rel(ours_v, ref_v), rel(ours_a, ref_a))


def test_continuation_equals_a_reference_loop(tiny):
    """Continuation windows vs a loop written here: diffusers' transformer and MiniMaxH3Scheduler over each window's
    packed sequence (built by `_reference_sequence`), window 2 conditioned on window 1's clean tail (video mixed
    0.999 z + 0.001 e with the clip's own noise, audio clean), its frames past the guide appended."""
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    cfg, m, dm = tiny
    spec = RenderSpec(prompt="a", frames=56, width=W, height=H, window_frames=39, window_overlap=22, steps=2,
                      sampler="euler", scheduler="diffusers")
    plan = plan_windows(spec)
    assert [(w.start, w.frames, w.guide) for w in plan.windows] == [(0, 39, 0), (17, 39, 22)]
    text = torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(4))
    t_all, ta_all = c.video_latent_frames(56), c.audio_latent_count(56)
    _, v_noise, a_noise = draw_noise(9, (), (24, t_all, 4, 6), (2 * ta_all, 32))
    with torch.no_grad():
        ours_v, ours_a = sample_continuation(m, cfg, plan, [text], H, W, (v_noise, a_noise),
                                             SamplerConfig("euler", "diffusers", steps=2), "cpu")

    video = torch.zeros(24, t_all, 4, 6)
    audio = torch.zeros(2, 32, ta_all)
    for w in plan.windows:
        seq = _reference_sequence(cfg, 7, 7, w)
        l0, a0 = w.latent_start, w.audio_start
        latents = patchify_video(v_noise[:, l0:l0 + w.latent_frames], cfg.patch)
        aud = a_noise.view(2, ta_all, 32)[:, a0:a0 + w.audio_latents].reshape(-1, 32).clone()
        gv, ga = w.guide_latents, w.guide_audio
        guide_v = patchify_video(0.999 * video[:, l0:l0 + gv] + 0.001 * v_noise[:, l0:l0 + gv], cfg.patch)
        guide_a = patchify_audio(audio[..., a0:a0 + ga])
        sv, sa = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
        sv.set_timesteps(3)
        sa.set_timesteps(3)
        for tv, ta in zip(sv.timesteps, sa.timesteps):
            v, a = _reference_forward(dm, seq, torch.cat([guide_v, latents]), torch.cat([guide_a, aud]), text,
                                      float(tv), float(ta))
            latents = sv.step(v[len(guide_v):], tv, latents, return_dict=False)[0]
            aud = sa.step(a[len(guide_a):], ta, aud, return_dict=False)[0]
        wv = unpatchify_video(latents, cfg.patch, 24, w.latent_frames, 4, 6)
        wa = unpatchify_audio(aud)
        video[:, l0 + gv:l0 + w.latent_frames] = wv[:, gv:]
        audio[..., a0 + ga:a0 + w.audio_latents] = wa[..., ga:]
    assert rel(ours_v, video) < 1e-5 and rel(ours_a, audio) < 1e-5, (rel(ours_v, video), rel(ours_a, audio))


def test_fused_sampling_runs_the_whole_clip_on_the_host(tiny):
    cfg, m, _ = tiny
    spec = RenderSpec(prompt="a", frames=56, width=W, height=H, window_frames=39, window_overlap=22, window_mode="fused",
                      steps=2)
    t_all, ta_all = c.video_latent_frames(56), c.audio_latent_count(56)
    _, v_noise, a_noise = draw_noise(2, (), (24, t_all, 4, 6), (2 * ta_all, 32))
    steps = []
    with torch.no_grad():
        v, a = sample_fused(m, cfg, plan_windows(spec), [torch.randn(7, cfg.text_dim)], H, W, (v_noise, a_noise),
                            SamplerConfig(steps=2), "cpu", on_step=lambda i, n: steps.append((i, n)))
    assert v.shape == (24, t_all, 4, 6) and a.shape == (2, 32, ta_all) and torch.isfinite(v).all()
    assert steps == [(1, 2), (2, 2)]


# ---------------------------------------------------------------------------------------------------------------
# The DiT engine (embedded tiny model, in process)
# ---------------------------------------------------------------------------------------------------------------
class _Ctx:
    def __init__(self):
        self.events = []

    def progress(self, *args, **kwargs):
        self.events.append((args, kwargs))

    def should_stop(self) -> bool:
        return False


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from stagekit.dist import RankGroup, RankInfo

    eng = DiTEngine(DiTEngineConfig("", "", tmp_path_factory.mktemp("cache"), "cpu", torch.float32),
                    RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    eng.load(WeightSource(eng.weight_files()))
    return eng


def test_engine_one_window_covering_the_clip_is_todays_render_bitwise(engine):
    text = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    base = dict(prompt="x", width=256, height=256, frames=73, steps=2, seed=3)
    today = engine.run(RenderSpec(**base), {c.TEXT_STATES: text}, _Ctx())
    one = engine.run(RenderSpec(**base, window_frames=73), {c.TEXT_STATES: text}, _Ctx())
    assert engine.windows == "one window of 73 frames"
    for name in c.SAMPLE_OUTPUTS:
        assert torch.equal(today[name], one[name]), name


def test_engine_windows_prompts_and_extension(engine):
    from dit_svc.engine import GUIDE_INPUT, PROMPTS_INPUT

    g = torch.Generator().manual_seed(1)
    text, text2 = torch.randn(9, 64, generator=g), torch.randn(4, 64, generator=g)
    spec = RenderSpec(prompt="x", more_prompts=("y",), width=256, height=256, frames=73, steps=1, seed=3,
                      window_frames=39, window_overlap=22)
    ctx = _Ctx()
    out = engine.run(spec, {c.TEXT_STATES: text, PROMPTS_INPUT: [text2]}, ctx)
    assert out[c.VIDEO_LATENTS].shape == (24, c.video_latent_frames(73), 16, 16)
    assert out[c.AUDIO_LATENTS].shape == (2, 32, c.audio_latent_count(73))
    assert ctx.events[0][0] == (0, 3) and ctx.events[-1][0] == (3, 3)  # 3 windows of 1 step
    assert ctx.events[0][1]["message"].startswith("continuation: 3 windows of 39 frames, overlap 22;")
    assert ("windows", "continuation: 3 windows of 39 frames, overlap 22", "last job") in engine.kernel_rows()
    ext = RenderSpec(prompt="z", width=256, height=256, frames=124, steps=1, seed=4, prefix_frames=73)
    guide = (out[c.VIDEO_LATENTS][:, -ext.guide_latents:], out[c.AUDIO_LATENTS][..., -ext.guide_audio_latents:])
    more = engine.run(ext, {c.TEXT_STATES: text, GUIDE_INPUT: guide}, _Ctx())
    assert more[c.VIDEO_LATENTS].shape == (24, ext.latent_frames, 16, 16)
    assert torch.equal(more[c.VIDEO_LATENTS][:, :ext.guide_latents], guide[0])  # the span opens with the guide
    assert torch.equal(more[c.AUDIO_LATENTS][..., :ext.guide_audio_latents], guide[1])


def test_engine_refuses_what_windows_cannot_take(engine):
    text = torch.randn(9, 64)
    long = RenderSpec(prompt="x", width=256, height=256, frames=124, window_frames=39)
    with pytest.raises(InvalidArgument, match="takes text prompts only"):
        engine.check_conditioning(long, text, {c.TEXT_STATES: text, c.keyframe_tensor("first"): torch.zeros(24, 1, 16, 16)})
    with pytest.raises(InvalidArgument, match="no text_states_1"):
        engine.check_conditioning(RenderSpec(prompt="x", more_prompts=("y",), width=256, height=256, frames=124,
                                             window_frames=39), text, {c.TEXT_STATES: text})
    with pytest.raises(InvalidArgument, match="needs tail_video and tail_audio"):
        engine.check_conditioning(RenderSpec(prompt="x", width=256, height=256, frames=124, prefix_frames=73), text,
                                  {c.TEXT_STATES: text})
    # The placement plans one window's rows, not the clip's.
    short = RenderSpec(prompt="x", width=256, height=256, frames=39)
    assert engine.target_rows(long) == engine.target_rows(short) + 7 * 64 + 2 * 37  # a window and its guide


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallel: every rank samples every window alike
# ---------------------------------------------------------------------------------------------------------------
def _tp_windows_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from minimax_h3.dit.model import H3DiT
    from minimax_h3.dit.tp import shard_state_dict
    from tests.dit_ranks import tiny_case

    group = dist.new_group(list(range(world)))
    cfg, sd, _, _ = tiny_case()
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=group).eval()
    model.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
    return _windowed(cfg, model)


def _windowed(cfg, model) -> dict:
    text = torch.randn(5, cfg.text_dim, generator=torch.Generator().manual_seed(7))
    t_all, ta_all = c.video_latent_frames(56), c.audio_latent_count(56)
    _, v_noise, a_noise = draw_noise(5, (), (24, t_all, 4, 6), (2 * ta_all, 32))
    out = {}
    with torch.no_grad():
        for mode in c.WINDOW_MODES:
            plan = plan_windows(RenderSpec(frames=56, width=W, height=H, window_frames=39, window_overlap=22,
                                           window_mode=mode))
            run = sample_fused if mode == "fused" else sample_continuation
            out[mode] = run(model, cfg, plan, [text], H, W, (v_noise, a_noise), SamplerConfig(steps=1), "cpu")
    return out


def test_tp2_ranks_agree_on_every_window():
    from minimax_h3.dit.model import H3DiT
    from tests.dit_ranks import assert_matches_one_rank, tiny_case
    from tests.ranks import run_ranks

    outs = run_ranks(_tp_windows_rank, 2)
    cfg, sd, _, _ = tiny_case()
    one = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    one.load_state_dict(sd)
    ref = _windowed(cfg, one)
    for mode in c.WINDOW_MODES:
        assert_matches_one_rank([o[mode] for o in outs], ref[mode], 1e-5, f"TP2 {mode} windows")
