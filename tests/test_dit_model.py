"""H3 DiT: layout/patchify vs diffusers' pipeline helpers, parity vs diffusers MiniMaxH3Transformer3DModel (fp32,
tiny random config), curve-form AdaLN vs an equivalent unpruned model, and model plumbing (chunking, linear swap,
dtype, errors). diffusers is a test oracle only."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import from_diffusers, to_diffusers
from minimax_h3.contract import audio_latent_count, snap_frames, video_latent_frames
from minimax_h3.dit.layout import (
                                   build_layout,
                                   patchify_audio,
                                   patchify_video,
                                   unpatchify_audio,
                                   unpatchify_video,
                                   )
from minimax_h3.dit.model import H3DiT, curve_state_dict_from_mlp
from minimax_h3.dit.tiny_checkpoint import diffusers_config

try:  # oracle only; the GPU machine has no diffusers, its GPU test below does not need it
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )
except ImportError:  # pragma: no cover
    MiniMaxH3Transformer3DModel = None
needs_diffusers = pytest.mark.skipif(MiniMaxH3Transformer3DModel is None, reason="diffusers (test oracle) missing")

PARITY_RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def diffusers_model(cfg: DiTConfig, seed: int = 0) -> MiniMaxH3Transformer3DModel:
    torch.manual_seed(seed)
    m = MiniMaxH3Transformer3DModel.from_config(diffusers_config(cfg)).eval()
    with torch.no_grad():  # default init leaves norms at 1: perturb everything so every weight matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def inputs(cfg: DiTConfig, layout, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layout.num_video_rows, cfg.video_patch_dim, generator=g),
            torch.randn(layout.num_audio_rows, cfg.audio_in_channels, generator=g),
            torch.randn(layout.text_len, cfg.text_dim, generator=g))


def diffusers_forward(dm, layout, video, audio, text, tv: float, ta: float):
    ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_idx, layout.audio_idx, layout.num_cond_rows, 0, layout.text_len, tv, ta, max(tv, 0.999), 1.0)
    with torch.no_grad():
        v, a = dm(video[None], audio[None], text[None], ts, ti, layout.tag, layout.position_ids,
                  layout.video_idx, layout.audio_idx, layout.text_idx, return_dict=False)
    return v[0], a[0]


@pytest.fixture(scope="module")
def tiny():
    cfg = DiTConfig.tiny()
    dm = diffusers_model(cfg)
    ours = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ours.load_state_dict(from_diffusers(dm.state_dict()))
    return cfg, dm, ours


# ---- config ---------------------------------------------------------------------------------------------------------
def test_config_values_and_validation():
    full = DiTConfig.full()
    assert (full.attn_inner, full.rope_dim, full.video_patch_dim, full.adaln_out, full.final_adaln_out) == \
        (7168, 96, 96, 96768, 10752)
    tiny = DiTConfig.tiny()
    assert tiny.rope_dim == 12 and tiny.head_dim == 16
    with pytest.raises(ValueError, match="rope_freq_dim"):
        DiTConfig.tiny(rope_freq_dim=3)
    with pytest.raises(ValueError, match="adaln_form"):
        DiTConfig.tiny(adaln_form="svd")
    assert DiTConfig.tiny(adaln_form="curve").adaln_in == 8


# ---- geometry / layout ----------------------------------------------------------------------------------------------
def test_latent_counts():
    assert (video_latent_frames(124), audio_latent_count(124)) == (37, 207)
    assert (video_latent_frames(362), audio_latent_count(362)) == (107, 603)
    assert video_latent_frames(5) == 2 and snap_frames(120) == 124 and snap_frames(124) == 124
    with pytest.raises(ValueError, match="17"):
        video_latent_frames(120)
    with pytest.raises(ValueError, match="multiple of 32"):
        build_layout(DiTConfig.tiny(), 4, 124, 480, 840)


@needs_diffusers
@pytest.mark.parametrize("frames,height,width,keyframes,text_len", [
    (124, 480, 832, (), 38),
    (22, 64, 96, ("first", "last"), 7),
    (362, 768, 1344, ("last",), 5),
    (5, 32, 32, ("first",), 3),
])
def test_layout_matches_diffusers_pipeline(frames, height, width, keyframes, text_len):
    cfg = DiTConfig.tiny()
    text_tags = torch.ones(text_len, dtype=torch.long)
    text_tags[1:3] = 0  # vision-block tokens carry the video tag
    lay = build_layout(cfg, text_len, frames, height, width, keyframes, text_tags=text_tags)
    s = lay.shape
    pos, tags, vidx, aidx, tidx, ncond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, s.latent_frames, s.latent_height, s.latent_width, s.audio_latents, cfg.patch, 2, 2, 0, keyframes)
    assert torch.equal(lay.position_ids_f64, pos)  # bitwise, float64
    assert torch.equal(lay.position_ids, pos.float())
    assert torch.equal(lay.tag, tags) and torch.equal(lay.video_idx, vidx)
    assert torch.equal(lay.audio_idx, aidx) and torch.equal(lay.text_idx, tidx)
    assert lay.num_cond_rows == ncond
    if (frames, height, width, text_len) == (124, 480, 832, 38):
        assert lay.seq_len == 14882 and lay.rows_per_frame == 390


@needs_diffusers
def test_patchify_roundtrip_and_matches_diffusers():
    x = torch.randn(24, 7, 6, 10)
    rows = patchify_video(x, (1, 2, 2))
    assert torch.equal(rows, patchify_video_latents(x[None], (1, 2, 2)))
    assert torch.equal(patchify_video(x[None], (1, 2, 2)), rows)
    assert torch.equal(unpatchify_video(rows, (1, 2, 2), 24, 7, 6, 10), x)
    assert rows[0, 1].item() == x[0, 0, 0, 1].item() and rows[0, 4].item() == x[1, 0, 0, 0].item()
    a = torch.randn(2, 32, 9)
    arows = patchify_audio(a)
    assert arows.shape == (18, 32) and torch.equal(arows[9], a[1, :, 0])
    assert torch.equal(unpatchify_audio(arows), a)


# ---- conversion / parity --------------------------------------------------------------------------------------------
@needs_diffusers
def test_convert_roundtrip(tiny):
    cfg, dm, ours = tiny
    ref = dm.state_dict()
    back = to_diffusers(ours.state_dict())
    assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    assert set(ours.state_dict()) == set(from_diffusers(ref))
    # release keys: fused qkv [q;k;v], fc1 [gate; value]
    q = ref["transformer_blocks.0.attn.to_q.weight"]
    assert torch.equal(ours.state_dict()["blocks.0.attn.qkv_proj.weight"][: q.shape[0]], q)
    val = ref["transformer_blocks.0.ff.net.0.proj.weight"][: cfg.ffn]
    assert torch.equal(ours.state_dict()["blocks.0.mlp.fc1.weight"][cfg.ffn:], val)


@needs_diffusers
@pytest.mark.parametrize("keyframes,tv,ta", [((), 0.3, 0.55), (("first", "last"), 0.42, 0.61), ((), 0.0, 0.0)])
def test_parity_with_diffusers(tiny, keyframes, tv, ta):
    cfg, dm, ours = tiny
    lay = build_layout(cfg, 6, 22, 64, 96, keyframes)
    video, audio, text = inputs(cfg, lay)
    dv, da = diffusers_forward(dm, lay, video, audio, text, tv, ta)
    with torch.no_grad():
        ov, oa = ours(video, audio, text, torch.tensor(tv), torch.tensor(ta), lay)
    assert ov.dtype == oa.dtype == torch.float32
    ev, ea = rel(ov, dv), rel(oa, da)
    print(f"parity keyframes={keyframes} t=({tv},{ta}): video rel {ev:.3e}, audio rel {ea:.3e}")
    assert ev <= PARITY_RTOL and ea <= PARITY_RTOL


@needs_diffusers
def test_timestep_table(tiny):
    cfg, _, ours = tiny
    lay = build_layout(cfg, 3, 22, 64, 96, ("first",))
    # One timestep per kind (video, cond, audio, ref audio); every row indexes its kind's (no device sync).
    ts, ti = ours.timestep_table(torch.tensor(0.2), torch.tensor(0.2), lay)
    assert ts.tolist() == pytest.approx([0.2, 0.999, 0.2, 1.0])
    row_t = ts.index_select(0, ti)
    assert row_t[lay.cond[0]].item() == pytest.approx(0.999) and row_t[0].item() == pytest.approx(0.2)
    ts, ti = ours.timestep_table(1.0, 0.5, lay)  # cond row t = max(t_video, 0.999) = 1 = t_video
    row_t = ts.index_select(0, ti)
    assert row_t[0].item() == 1.0 and row_t[lay.audio[0]].item() == 0.5 and row_t[lay.cond[0]].item() == 1.0


# ---- curve-form AdaLN -----------------------------------------------------------------------------------------------
@needs_diffusers
def test_curve_form_matches_unpruned_construction():
    # time_embed_dim 8 = curve rank, so the centred curve is exactly representable; on grid points
    # (t = k/1024) the lerp is exact and the curve model must reproduce the unpruned one.
    cfg = DiTConfig.tiny(time_embed_dim=8)
    dm = diffusers_model(cfg, seed=3)
    full_sd = from_diffusers(dm.state_dict())
    mlp = H3DiT(cfg, compute_dtype=torch.float32).eval()
    mlp.load_state_dict(full_sd)
    curve_sd, ccfg = curve_state_dict_from_mlp(full_sd, cfg)
    curve = H3DiT(ccfg, compute_dtype=torch.float32).eval()
    curve.load_state_dict(curve_sd)
    keys = set(curve.state_dict())
    assert "adaln_t_table" in keys and not any(k.startswith("time_embedder.") for k in keys)
    assert curve.state_dict()["blocks.0.adaln_proj.linear.weight"].shape == (cfg.adaln_out, 8)
    lay = build_layout(cfg, 4, 22, 64, 96)
    video, audio, text = inputs(cfg, lay)
    with torch.no_grad():
        for tv, ta in ((256 / 1024, 768 / 1024), (0.0, 1.0)):
            (mv, ma), (cv, ca) = mlp(video, audio, text, tv, ta, lay), curve(video, audio, text, tv, ta, lay)
            print(f"curve vs unpruned on grid t=({tv},{ta}): {rel(cv, mv):.3e} {rel(ca, ma):.3e}")
            assert rel(cv, mv) < 1e-5 and rel(ca, ma) < 1e-5
        # off grid (and keyframe rows at 0.999): interpolation error only
        lay2 = build_layout(cfg, 4, 22, 64, 96, ("first",))
        video, audio, text = inputs(cfg, lay2)
        (mv, ma), (cv, ca) = mlp(video, audio, text, 0.3337, 0.5001, lay2), curve(video, audio, text, 0.3337, 0.5001, lay2)
        print(f"curve vs unpruned off grid: {rel(cv, mv):.3e} {rel(ca, ma):.3e}")
        assert rel(cv, mv) < 1e-2 and rel(ca, ma) < 1e-2
    with pytest.raises(ValueError, match="diffusers"):
        to_diffusers(curve_sd)


# ---- plumbing -------------------------------------------------------------------------------------------------------
@needs_diffusers
def test_chunking_swap_dtype_and_errors(tiny):
    cfg, dm, ours = tiny
    lay = build_layout(cfg, 6, 22, 64, 96, ("last",))
    video, audio, text = inputs(cfg, lay)
    with torch.no_grad():
        ref_v, ref_a = ours(video, audio, text, 0.3, 0.5, lay)
        # chunk size must not change results
        big = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=100000).eval()
        big.load_state_dict(ours.state_dict())
        bv, ba = big(video, audio, text, 0.3, 0.5, lay)
        assert rel(bv, ref_v) < 1e-6 and rel(ba, ref_a) < 1e-6
        # swap a linear by name for any x W^T module
        names = big.linear_names()
        assert "blocks.1.mlp.fc1" in names and "final_layer.adaln_proj.linear" in names and "condition_proj" in names
        old = big.get_submodule("blocks.1.mlp.fc1")
        lin = nn.Linear(old.in_features, old.out_features, bias=False)
        lin.weight.copy_(old.weight)
        big.swap_linear("blocks.1.mlp.fc1", lin)
        sv, sa = big(video, audio, text, 0.3, 0.5, lay)
        assert rel(sv, ref_v) < 1e-6 and rel(sa, ref_a) < 1e-6
        with pytest.raises(KeyError):
            big.swap_linear("blocks.1.norm1", lin)
        # bf16 compute + release storage dtypes: residual / outputs stay fp32, result close
        half = H3DiT(cfg, compute_dtype=torch.bfloat16).eval()
        half.load_state_dict(ours.state_dict())
        half.cast_release_dtypes(torch.bfloat16)
        assert half.video_patch_proj.weight.dtype == torch.float32
        for name in ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in", "final_layer.video_out",
                     "final_layer.audio_out"):
            assert half.get_submodule(name).compute_dtype == torch.float32, name
        for name in ("condition_proj", "blocks.0.attn.qkv_proj", "blocks.0.adaln_proj.linear",
                     "token_refiner.blocks.0.mlp.fc2"):
            assert half.get_submodule(name).compute_dtype == torch.bfloat16, name
        assert half.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
        hv, ha = half(video, audio, text, 0.3, 0.5, lay)
        assert hv.dtype == torch.float32 and rel(hv, ref_v) < 3e-2 and rel(ha, ref_a) < 3e-2
    with pytest.raises(ValueError, match="video_rows"):
        ours(video[1:], audio, text, 0.3, 0.5, lay)
    with pytest.raises(ValueError, match="text_states"):
        ours(video, audio, text[1:], 0.3, 0.5, lay)
    with pytest.raises(ValueError, match="rope.inv_freq"):
        ours.load_state_dict({**ours.state_dict(), "rope.inv_freq": torch.ones(5)})
    ours.load_state_dict({**ours.state_dict(), "rope.inv_freq": ours.rope.inv_freq.clone()})  # accepted, ignored


@needs_diffusers
def test_int8_convrot_linear_swaps_in(tiny):
    quant = pytest.importorskip("minimax_h3.kernels.int8")
    cfg, _, ours = tiny
    lay = build_layout(cfg, 6, 22, 64, 96)
    video, audio, text = inputs(cfg, lay)
    m = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    m.load_state_dict(ours.state_dict())
    sd = m.state_dict()
    with torch.no_grad():
        ref_v, _ = m(video, audio, text, 0.3, 0.5, lay)
        for i in range(cfg.num_layers):  # the 4 block linears per block, as in the Comfy int8 files
            for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
                name = f"blocks.{i}.{leaf}"
                m.swap_linear(name, quant.Int8ConvRotLinear.from_float(
                    sd[name + ".weight"], groupsize=16, mode="dequant", compute_dtype=torch.float32))
        assert "blocks.0.attn.qkv_proj.weight_scale" in m.state_dict()
        qv, _ = m(video, audio, text, 0.3, 0.5, lay)
    err = rel(qv, ref_v)
    print(f"int8 ConvRot (dequant) block linears vs fp32: video rel {err:.3e}")
    assert 0 < err < 5e-2


# ---- GPU-only -------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_full_width_smoke():
    import time

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = DiTConfig.tiny()
    torch.manual_seed(0)
    ours = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    lay = build_layout(cfg, 6, 22, 64, 96, ("first", "last"))
    video, audio, text = inputs(cfg, lay)
    gpu = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval().cuda()
    gpu.load_state_dict(ours.state_dict())
    with torch.no_grad():
        cv, ca = ours(video, audio, text, 0.3, 0.5, lay)
        gv, ga = gpu(video.cuda(), audio.cuda(), text.cuda(), 0.3, 0.5, lay.to("cuda"))
    print(f"cuda vs cpu fp32: {rel(gv.cpu(), cv):.3e} {rel(ga.cpu(), ca):.3e}")
    assert rel(gv.cpu(), cv) < 1e-5 and rel(ga.cpu(), ca) < 1e-5

    # Release widths, 2 blocks, 832x480x124 t2va (S = 14882), bf16 storage + compute.
    full = DiTConfig.full(num_layers=2, num_refiner_layers=1)
    torch.manual_seed(0)
    m = H3DiT(full, compute_dtype=torch.bfloat16, device="cuda").eval().cast_release_dtypes(torch.bfloat16)
    lay = build_layout(full, 38, 124, 480, 832).to("cuda")
    assert lay.seq_len == 14882
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(lay.num_video_rows, 96, device="cuda", generator=g)
    a = torch.randn(lay.num_audio_rows, 32, device="cuda", generator=g)
    t = torch.randn(38, full.text_dim, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        m(v, a, t, 0.4, 0.5, lay)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        ov, oa = m(v, a, t, 0.4, 0.5, lay)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        m.compute_dtype = torch.float32
        for mod in m.modules():
            if hasattr(mod, "compute_dtype") and mod.compute_dtype == torch.bfloat16:
                mod.compute_dtype = torch.float32
        fv, fa = m(v, a, t, 0.4, 0.5, lay)
    print(f"full width 2 blocks S=14882 bf16: {dt * 1e3:.1f} ms, activation peak {peak:.2f} GiB, "
          f"bf16 vs fp32 compute rel {rel(ov, fv):.3e} / {rel(oa, fa):.3e}")
    assert torch.isfinite(ov).all() and torch.isfinite(oa).all()
    assert peak < 8.0 and rel(ov, fv) < 5e-2 and rel(oa, fa) < 5e-2
