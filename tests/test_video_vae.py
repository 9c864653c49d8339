"""H3 video VAE: parity with diffusers' AutoencoderKLMiniMaxH3 (oracle only), work-unit sharding, checkpoints."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from minimax_h3.vae.tiling import num_decoded_frames, split_tiles
from tests.ranks import run_ranks
from tests.safetensors_files import write_sparse_safetensors
from minimax_h3.vae.video import (
                                  IMAGENET_MEAN,
                                  IMAGENET_STD,
                                  LATENTS_MEAN,
                                  LATENTS_STD,
                                  CheckpointError,
                                  VideoVAE,
                                  VideoVAEConfig,
                                  assemble,
                                  comfy_to_diffusers_state_dict,
                                  decode_unit,
                                  detect_layout,
                                  inspect_video_vae,
                                  load_video_vae,
                                  plan_decode,
                                  write_tiny_video_vae,
                                  )

TINY = VideoVAEConfig.tiny()
# Small tiles keep the CPU tests fast while exercising many tiles and the slack distribution.
SMALL_TILES = replace(TINY, tile_px=64, tile_overlap_min_px=32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _oracle(cfg: VideoVAEConfig, vae: VideoVAE):
    # imported lazily so the gloo worker processes (which import this module) start fast
    diffusers = pytest.importorskip("diffusers")
    ora = diffusers.AutoencoderKLMiniMaxH3(
        latent_channels=cfg.latent_channels, block_out_channels=cfg.block_channels,
        layers_per_block=cfg.num_res_blocks, norm_num_groups=cfg.norm_groups, decoder_num_layers=cfg.dec_layers,
        decoder_num_attention_heads=cfg.dec_heads, decoder_attention_head_dim=cfg.dec_head_dim,
        decoder_num_register_tokens=cfg.dec_registers, latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD)
    ora.load_state_dict(comfy_to_diffusers_state_dict(vae.state_dict(), cfg), strict=True)
    ora.enable_tiling(cfg.tile_px, cfg.tile_px, cfg.tile_overlap_min_px, cfg.tile_overlap_min_px)
    return ora.eval()


def _stats():
    return (torch.tensor(LATENTS_MEAN).view(-1, 1, 1, 1), torch.tensor(LATENTS_STD).view(-1, 1, 1, 1))


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vae") / "tiny_video_vae.safetensors")
    write_tiny_video_vae(path, TINY, seed=3, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def vae(tiny_file):
    return load_video_vae(tiny_file, None, torch.float32)


@pytest.fixture(scope="module")
def oracle(vae):
    return _oracle(TINY, vae)


# ---------------------------------------------------------------- geometry


def test_release_geometry():
    full = VideoVAEConfig.full()
    assert (full.spatial_ratio, full.temporal_ratio, full.dec_dim, full.rope_dim) == (16, 4, 2048, 48)
    plan = plan_decode(full, 37, 30, 52)  # 832x480, 124 frames
    g = plan[0].geom
    assert g.num_frames == 124 and g.num_chunks == 7 and g.frame_overlap == 5
    assert g.tiles_w.overlaps == (64, 64, 64) and g.tiles_h.overlaps == (144, 144)
    assert len(plan) == 7 * 12 and g.frames_per_unit == 22
    assert [num_decoded_frames(full, t) for t in (1, 2, 7, 8, 12, 107)] == [1, 5, 22, 26, 39, 362]
    assert split_tiles(200, 256, 64, 16).lengths == (200,)


# ---------------------------------------------------------------- decoder parity


@pytest.mark.parametrize("cfg,shape", [
    (TINY, (3, 17, 17)),  # release 256/64 tiles: 2x2 tiles (240 px overlap after slack), padded chunk cut
    (SMALL_TILES, (8, 6, 5)),  # 64/32 tiles: 2x2 with 16 px slack on W, 2 chunks cross-faded, padding cut
    (SMALL_TILES, (12, 9, 2)),  # 4 tile rows (48/32/32 overlaps) x 1 column, 2 chunks, no padding
])
def test_decode_matches_diffusers(vae, cfg, shape):
    vae_c = VideoVAE(cfg).eval()
    vae_c.load_state_dict(vae.state_dict())
    ora = _oracle(cfg, vae_c)
    g = plan_decode(cfg, *shape)[0].geom
    assert len(g.tiles_h.starts) >= 2 and (len(g.tiles_w.starts) >= 2 or g.num_chunks >= 2)
    z = torch.randn(24, *shape, generator=torch.Generator().manual_seed(0))
    m, s = _stats()
    with torch.no_grad():
        ref_raw = ora.decode((z * s + m)[None]).sample[0]
    ref = (ref_raw * torch.tensor(IMAGENET_STD).view(3, 1, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1, 1))
    ref = ref.clamp(0, 1)
    plan = plan_decode(cfg, *shape)
    results = [decode_unit(vae_c, z, u) for u in plan]
    raw = assemble(plan, results, finalize=False)
    out = assemble(plan, results)
    assert raw.shape == ref_raw.shape == (3, g.num_frames, shape[1] * 16, shape[2] * 16)
    err_raw, err = _rel(raw, ref_raw), _rel(out, ref)
    print(f"decode {shape} tile {cfg.tile_px}: rel err raw {err_raw:.3e} final {err:.3e}")
    assert err_raw <= 1e-4 and err <= 1e-4
    assert 0.05 < (out > 0).float().mean() and (out < 1).float().mean() > 0.05  # not trivially clamped


def test_decode_short_and_single_frame(vae):
    for t, frames in ((1, 1), (2, 5), (3, 9)):
        out = vae.decode(torch.randn(24, t, 2, 3))
        assert out.shape == (3, frames, 32, 48) and out.min() >= 0 and out.max() <= 1


# ---------------------------------------------------------------- work units


def test_units_any_order_bitwise(vae):
    cfg = SMALL_TILES
    vae_c = VideoVAE(cfg).eval()
    vae_c.load_state_dict(vae.state_dict())
    z = torch.randn(24, 8, 6, 5, generator=torch.Generator().manual_seed(1))
    ref = vae_c.decode(z)
    plan = plan_decode(cfg, 8, 6, 5)
    order = list(range(len(plan)))
    random.Random(0).shuffle(order)
    # two 'ranks' each decode an interleaved share in shuffled order; rank 0 gathers into a dict
    shares = [{k: decode_unit(vae_c, z, plan[k]) for k in order if k % 2 == r} for r in range(2)]
    gathered = {**shares[1], **shares[0]}
    assert torch.equal(assemble(plan, gathered), ref)
    as_list = [gathered[k] for k in range(len(plan))]
    assert torch.equal(assemble(plan, as_list), ref)
    with pytest.raises(ValueError, match="missing"):
        assemble(plan, {k: v for k, v in gathered.items() if k != 3})


def _decode_share(rank: int, world: int, path: str):
    """Each rank decodes its interleaved share of the units (in reverse order); rank 0 gathers and assembles."""
    cfg = SMALL_TILES
    model = load_video_vae(path, cfg, torch.float32)
    z = torch.randn(24, 8, 6, 5, generator=torch.Generator().manual_seed(1))
    plan = plan_decode(cfg, 8, 6, 5)
    mine = {u.index: decode_unit(model, z, u) for u in reversed(plan) if u.index % world == rank}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        return assemble(plan, {k: v for part in gathered for k, v in part.items()})
    return None


def test_units_two_gloo_ranks(tiny_file):
    frames = run_ranks(_decode_share, 2, tiny_file)[0]
    model = load_video_vae(tiny_file, SMALL_TILES, torch.float32)
    ref = model.decode(torch.randn(24, 8, 6, 5, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(frames, ref)


def test_bad_latents(vae):
    with pytest.raises(ValueError, match="channels"):
        vae.decode(torch.randn(16, 3, 2, 2))
    z = torch.randn(24, 3, 2, 2)
    z[0, 1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        vae.decode(z)
    with pytest.raises(ValueError, match=r"\[C, T, h, w\]"):
        vae.decode(torch.randn(24, 2, 2))
    plan = plan_decode(TINY, 3, 2, 2)
    with pytest.raises(ValueError, match="planned for"):
        decode_unit(vae, torch.randn(24, 4, 2, 2), plan[0])
    with pytest.raises(ValueError, match="non-finite"):
        decode_unit(vae, z, plan[0])


def test_bf16_autocast_close(vae):
    cfg = SMALL_TILES
    vae_c = VideoVAE(cfg).eval()
    vae_c.load_state_dict(vae.state_dict())
    z = torch.randn(24, 3, 5, 5, generator=torch.Generator().manual_seed(2))
    ref = vae_c.decode(z)
    low = vae_c.decode(z, autocast_dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and (low - ref).abs().max() < 0.1


# ---------------------------------------------------------------- encoder parity


@pytest.mark.parametrize("frames,h,w,tile", [(18, 48, 32, 32), (1, 64, 80, 48)])
def test_encode_matches_diffusers(vae, frames, h, w, tile):
    # 18 frames = 2 clips (second padded by repetition) -> 5*2 - 3 = 7 latents; 32 px tiles: H = 48 two tiles,
    # W = 32 one tile. Still image: 48 px tiles / 16 px overlap: H = 64 two tiles with 16 px slack, W = 80 two tiles.
    cfg = replace(TINY, tile_px=tile, tile_overlap_min_px=16)
    vae_c = VideoVAE(cfg).eval()
    vae_c.load_state_dict(vae.state_dict())
    ora = _oracle(cfg, vae_c)
    video = torch.rand(3, frames, h, w, generator=torch.Generator().manual_seed(5))
    mine = vae_c.encode(video)
    im, ist = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1, 1)
    with torch.no_grad():
        post = ora.encode((video[None] - im) / ist).latent_dist
    m, s = _stats()
    ref = (post.mean[0] - m) / s
    assert mine.shape == ref.shape == (24, 7 if frames == 18 else 1, h // 16, w // 16)
    err = _rel(mine, ref)
    print(f"encode {(frames, h, w)}: rel err {err:.3e}")
    assert err <= 1e-4
    logvar = vae_c.encode_moments(video)[24:]
    assert _rel(logvar, post.logvar[0]) <= 1e-4


def test_bad_video(vae):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        vae.encode(torch.rand(3, 1, 32, 32) * 2 - 1)
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.encode(torch.rand(3, 1, 40, 32))
    with pytest.raises(ValueError, match="parts='decoder'"):
        VideoVAE(TINY, parts="decoder").encode(torch.rand(3, 1, 32, 32))


# ---------------------------------------------------------------- checkpoints


def test_tiny_writer_deterministic_and_comfy_layout(tmp_path, tiny_file, vae):
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    write_tiny_video_vae(a, TINY, seed=7)
    write_tiny_video_vae(b, TINY, seed=7)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    sd = load_file(a)
    assert sd["decoder.x_embedder.weight"].dtype == torch.float16
    assert set(sd) - set(VideoVAE(TINY).state_dict()) == {"decoder.mask_token", "latents_mean", "latents_std"}
    assert detect_layout(a) == "comfy" and detect_layout(tiny_file) == "release"
    # fp16 file loaded into fp32: matmul weights upcast, norms and scales fp32
    m = load_video_vae(a, None, torch.float32, parts="decoder")
    assert not hasattr(m, "encoder") and m.decoder.transformer_blocks[0].scale1.dtype == torch.float32
    assert set(vae.state_dict()) == set(load_file(tiny_file)) - {"decoder.mask_token", "latents_mean", "latents_std"}


def test_diffusers_layout_roundtrip(tmp_path, vae, oracle):
    d = tmp_path / "diffusers_vae"
    oracle.save_pretrained(str(d))
    assert detect_layout(str(d)) == "diffusers"
    m = load_video_vae(str(d), None, torch.float32)
    assert m.cfg == TINY
    ref = vae.state_dict()
    got = m.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert m.latents_mean == pytest.approx(LATENTS_MEAN) and m.latents_std == pytest.approx(LATENTS_STD)


def test_checkpoint_errors(tmp_path, tiny_file):
    sd = load_file(tiny_file)
    meta = {"h3_video_vae_config": TINY.to_json()}

    def write(name, d, metadata=meta):
        p = str(tmp_path / name)
        save_file(d, p, metadata=metadata)
        return p

    missing = write("missing.safetensors", {k: v for k, v in sd.items() if k != "decoder.proj_out.bias"})
    with pytest.raises(CheckpointError, match=r"missing.*decoder\.proj_out\.bias"):
        load_video_vae(missing)
    # a decoder-only load does not need the encoder keys
    enc_less = write("noenc.safetensors", {k: v for k, v in sd.items() if not k.startswith("encoder.")})
    load_video_vae(enc_less, parts="decoder")
    with pytest.raises(CheckpointError, match=r"missing.*encoder\.conv_in"):
        load_video_vae(enc_less, parts="encoder")
    extra = write("extra.safetensors", {**sd, "decoder.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected.*decoder\.bogus\.weight"):
        load_video_vae(extra)
    shaped = dict(sd)
    shaped["decoder.register_tokens"] = torch.zeros(1, 3, TINY.dec_dim)
    with pytest.raises(CheckpointError, match=r"misshapen.*register_tokens"):
        load_video_vae(write("shape.safetensors", shaped))
    # without the config metadata the file is read with the H3 geometry: the tiny file contradicts it, and the error
    # names the file and its first misshapen key (not a wrong head count, as a shape-based guess would); cfg works
    bare = write("bare.safetensors", sd, metadata=None)
    with pytest.raises(CheckpointError, match=r"bare.safetensors: decoder\.\S+: does not match .*H3 release geometry.*config\.json"):
        load_video_vae(bare, parts="decoder")
    load_video_vae(bare, TINY)
    with pytest.raises(CheckpointError):
        load_video_vae(str(tmp_path / "nope.safetensors"))


def test_h3_geometry_without_config(tmp_path):
    """A file without config.json or metadata is read with the H3 release geometry, checked from its header (the
    full-size inventory is a sparse file: a header and holes)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in VideoVAE(VideoVAEConfig.full()).state_dict().items()}
    assert shapes["decoder.proj_out.weight"] == (3072, 2048)
    assert shapes["encoder.conv_out.weight"] == (48, 1024, 3, 3, 3)
    assert shapes["decoder.transformer_blocks.0.attn.to_qkv.weight"] == (6144, 2048)
    assert shapes["decoder.transformer_blocks.0.ff.w1.weight"] == (16384, 2048)
    full = write_sparse_safetensors(tmp_path / "minimax_h3_video_vae_fp16.safetensors",
                                    {k: ("F16", shp) for k, shp in shapes.items()})
    info = inspect_video_vae(str(full), parts="decoder")
    assert info.cfg == VideoVAEConfig.full() and info.config_source == "H3 release geometry"
    assert json.loads(VideoVAEConfig.full().to_json())["tile_px"] == 256
    assert VideoVAEConfig.from_json(TINY.to_json()) == TINY


def test_units_stream_to_a_sink_chunk_by_chunk(vae):
    """With a sink, each temporal chunk's frames leave the assembler as soon as they are finished (a long clip's
    decode never holds its frames whole), in order, adding up to the whole decode bit for bit."""
    from minimax_h3.vae.tiling import StreamingAssembler

    cfg = SMALL_TILES
    vae_c = VideoVAE(cfg).eval()
    vae_c.load_state_dict(vae.state_dict())
    z = torch.randn(24, 12, 6, 5, generator=torch.Generator().manual_seed(2))
    plan = plan_decode(cfg, 12, 6, 5)
    parts = []
    asm = StreamingAssembler(plan, sink=parts.append)
    sizes = []
    for u in plan:
        asm.add(u, decode_unit(vae_c, z, u))
        sizes.append(sum(p.shape[1] for p in parts))
    assert asm.finish() is None and asm.out is None
    assert len(parts) == plan[0].geom.num_chunks + 1 and max(p.shape[1] for p in parts) <= 17
    assert sizes[0] == 0 and sizes[-1] < plan[0].geom.num_frames  # frames left as each chunk finished, the tail last
    assert torch.equal(torch.cat(parts, dim=1), vae_c.decode(z))
