"""ref2va: references (images, videos with their soundtrack, audio) packed ahead of the generated rows.

DiT level, in process, on a tiny random-weight model, against diffusers' own modular MiniMax-H3 ref2va blocks (the
oracle): the packed layout and its float64 RoPE positions bit for bit, the noise (one draw per visual reference in
request order, then the target noise), and the final latents of the whole sampling loop (<= 1e-5), for (a) one
image, (b) an image, a video with its soundtrack and an audio clip, (c) a 30 fps clip resampled onto 24 fps, and
(d) the references of (b) in another order (another result, equal to diffusers' for that order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dit_svc.config import DiTConfig
from dit_svc.keyframes import condition_rows, conditioned_denoise
from dit_svc.layout import ReferenceBlock, build_ref2va_layout, patchify_audio, patchify_video
from dit_svc.model import H3DiT
from dit_svc.references import References, parse_references, ref_tensor
from dit_svc.sampling import SamplerConfig, draw_noise, sample
from stagekit.media import reference_clip_frames, resample_frames

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import (  # noqa: E402
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import (  # noqa: E402
    MiniMaxH3PrepareConditionLatentsStep,
    MiniMaxH3PrepareLatentsStep,
    MiniMaxH3Ref2VAPrepareLatentsStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3Ref2VADenoiseStep  # noqa: E402
from diffusers.modular_pipelines.modular_pipeline import SequentialPipelineBlocks  # noqa: E402
from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler  # noqa: E402

FRAMES, HEIGHT, WIDTH, TEXT_LEN, STEPS, SEED = 22, 64, 96, 9, 3, 17
TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1])


def _latents(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _clip_30fps() -> tuple[np.ndarray, np.ndarray]:
    """A 30 fps clip (40 frames) and its 24 fps resampling by our PyAV path."""
    frames = np.random.default_rng(3).integers(0, 256, (40, HEIGHT, WIDTH, 3), dtype=np.uint8)
    return frames, resample_frames(frames, 30.0)


# Each case: (kind, latent T, latent h, latent w, soundtrack / audio latents) per reference, in request order.
IMAGE = ("image", 1, 6, 4, 0)
VIDEO = ("video", 7, 4, 6, 30)
AUDIO = ("audio", 0, 0, 0, 20)
CASES = {
    "a_one_image": [IMAGE],
    "b_image_video_audio": [IMAGE, VIDEO, AUDIO],
    "c_30fps_clip": None,  # filled in from the resampled clip
    "d_reordered": [AUDIO, VIDEO, IMAGE],
}


def _case(name: str) -> list[tuple]:
    if name != "c_30fps_clip":
        return CASES[name]
    _, resampled = _clip_30fps()
    t = (reference_clip_frames(resampled.shape[0]) - 5) // 17 * 5 + 2  # latent frames of the snapped clip
    return [("video", t, 4, 6, 25), IMAGE]


def _request(name: str):
    """Our References (as the DiT service parses them) and diffusers' reference list + encoded latents."""
    tensors, ours_refs = {}, []
    for i, (kind, t, h, w, ta) in enumerate(_case(name)):
        if kind != "audio":
            tensors[ref_tensor(i, kind)] = _latents((24, t, h, w), 100 + i)
        if ta:
            tensors[ref_tensor(i, "audio")] = _latents((2, 32, ta), 200 + i)
        if kind == "image":
            ours_refs.append(MiniMaxH3ImageReference(image=np.zeros((8, 8, 3), np.uint8)))
        elif kind == "video":
            ours_refs.append(MiniMaxH3VideoReference(frames=np.zeros((1, 8, 8, 3), np.uint8),
                                                     audio=torch.zeros(2, 8) if ta else None))
        else:
            ours_refs.append(MiniMaxH3AudioReference(audio=torch.zeros(2, 8)))
    refs = parse_references(tensors, 24, 32, (1, 2, 2))
    return refs, ours_refs, [v[None] for v in refs.visual], [patchify_audio(a) for a in refs.audio]


@pytest.fixture(scope="module")
def tiny():
    from dit_svc.convert_diffusers import from_diffusers
    from tests.test_dit_model import diffusers_model

    cfg = DiTConfig.tiny()
    dm = diffusers_model(cfg, seed=3)
    m = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=64).eval()
    m.load_state_dict(from_diffusers(dm.state_dict()))
    return cfg, m, dm


def _diffusers_run(dm, refs, cond_latents, audio_rows, text, with_denoise=True):
    blocks = {"layout": MiniMaxH3Ref2VAPrepareLayoutStep(), "cond": MiniMaxH3PrepareConditionLatentsStep(),
              "latents": MiniMaxH3PrepareLatentsStep(), "ref_latents": MiniMaxH3Ref2VAPrepareLatentsStep()}
    if with_denoise:
        blocks.update(timesteps=MiniMaxH3SetTimestepsStep(), denoise=MiniMaxH3Ref2VADenoiseStep())
    pipe = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
    components = dict(scheduler=MiniMaxH3Scheduler(shift=12.0))
    if with_denoise:
        components.update(transformer_ref=dm, audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.update_components(**components)
    outputs = ["position_ids", "token_tags", "video_indices", "audio_indices", "text_indices",
               "num_condition_video_rows", "num_condition_audio_rows", "latents", "audio_latents", "condition_rows"]
    with torch.no_grad():
        return pipe(text_token_tags=TAGS, normalized_references=refs, condition_latents=cond_latents,
                    audio_condition_latents=audio_rows, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                    generator=torch.Generator().manual_seed(SEED), output=outputs,
                    **(dict(prompt_embeds=text[None], num_inference_steps=STEPS + 1) if with_denoise else {}))


def _ours(cfg, m, refs: References, text):
    lay = build_ref2va_layout(cfg, TEXT_LEN, FRAMES, HEIGHT, WIDTH, refs.blocks, text_tags=TAGS)
    vshape = (24, lay.shape.latent_frames, HEIGHT // 16, WIDTH // 16)
    c_noise, v_noise, a_noise = draw_noise(SEED, [v.shape for v in refs.visual], vshape,
                                           (2 * lay.shape.audio_latents, 32))
    cond = condition_rows(list(refs.visual), c_noise, cfg.patch)
    v_rows = patchify_video(v_noise, cfg.patch)
    with torch.no_grad():
        v, a = sample(conditioned_denoise(m, text, lay, cond, refs.audio_rows()), v_rows, a_noise,
                      SamplerConfig("euler", "diffusers", steps=STEPS))
    return lay, cond, v_rows, a_noise, v, a


@pytest.mark.parametrize("case", list(CASES))
def test_ref2va_matches_diffusers(tiny, case):
    from tests.test_dit_model import rel

    cfg, m, dm = tiny
    refs, d_refs, cond_latents, audio_rows = _request(case)
    text = torch.randn(TEXT_LEN, cfg.text_dim, generator=torch.Generator().manual_seed(4))
    lay, cond, v_noise, a_noise, v, a = _ours(cfg, m, refs, text)
    ref = _diffusers_run(dm, d_refs, cond_latents, audio_rows, text)
    # 1. Packed layout and RoPE positions, bit for bit (float64 as built, and the float32 the model uses).
    assert torch.equal(lay.position_ids_f64, ref["position_ids"])
    assert torch.equal(lay.tag, ref["token_tags"]) and torch.equal(lay.text_idx, ref["text_indices"])
    assert torch.equal(lay.video_idx, ref["video_indices"]) and torch.equal(lay.audio_idx, ref["audio_indices"])
    assert (lay.num_cond_rows, lay.num_ref_audio_rows) == (ref["num_condition_video_rows"],
                                                           ref["num_condition_audio_rows"])
    # 2. Noise: the conditioning mix and the target noise of the same seed (before any step).
    start = _diffusers_run(dm, d_refs, cond_latents, audio_rows, text, with_denoise=False)
    n, n_ref = lay.num_cond_rows, lay.num_ref_audio_rows
    torch.testing.assert_close(cond, start["condition_rows"], rtol=0, atol=1e-6)
    assert torch.equal(v_noise, start["latents"][n:]) and torch.equal(a_noise, start["audio_latents"][n_ref:])
    if n_ref:  # reference audio: clean, unchanged
        assert torch.equal(start["audio_latents"][:n_ref], refs.audio_rows())
    # 3. Final latents of the whole loop.
    assert torch.equal(ref["latents"][:n], start["condition_rows"])  # the references are never stepped
    assert rel(v, ref["latents"][n:]) < 1e-5 and rel(a, ref["audio_latents"][n_ref:]) < 1e-5


def test_reference_order_changes_the_result(tiny):
    """(d) vs (b): the same references in another order are another request (other clock, other result)."""
    cfg, m, _ = tiny
    text = torch.randn(TEXT_LEN, cfg.text_dim, generator=torch.Generator().manual_seed(4))
    b = _ours(cfg, m, _request("b_image_video_audio")[0], text)
    d = _ours(cfg, m, _request("d_reordered")[0], text)
    assert b[0].seq_len == d[0].seq_len and not torch.equal(b[0].position_ids_f64, d[0].position_ids_f64)
    assert not torch.allclose(b[4], d[4])


def test_rope_clock_facts():
    """docs/model.md §2.8: an image takes one slot, audio its latent count, a video the longer of its soundtrack and
    its frame span; the target starts where the clock ends."""
    cfg = DiTConfig.tiny()
    refs = [ReferenceBlock("image", 1, 6, 4), ReferenceBlock("audio", audio_latents=20),
            ReferenceBlock("video", 7, 4, 6, audio_latents=30)]
    lay = build_ref2va_layout(cfg, TEXT_LEN, FRAMES, HEIGHT, WIDTH, refs)
    pos = lay.position_ids_f64
    span = sum(5 / 3 * (1, 4, 4, 4, 4)[k % 5] for k in range(7))  # 38.33... > 30 soundtrack latents
    clock = TEXT_LEN + 1 + 20 + max(30, span)
    assert pos[TEXT_LEN, 0] == TEXT_LEN and pos[TEXT_LEN + 6, 0] == TEXT_LEN + 1  # the audio after the image
    assert pos[lay.audio[0], 0] == clock and pos[lay.video[0], 0] == clock
    assert lay.seq_len == TEXT_LEN + 3 * 2 + 2 * 20 + (2 * 30 + 7 * 6) + 2 * 37 + 7 * 6  # 2x2 patches


@pytest.mark.parametrize("tensors,needle", [
    ({ref_tensor(1, "image"): torch.zeros(24, 1, 2, 2)}, "reference 0 is missing"),
    ({ref_tensor(0, "audio"): torch.zeros(2, 32, 5)}, "at least one image or video"),
    ({ref_tensor(0, "image"): torch.zeros(24, 1, 3, 2)}, "patch"),
    ({ref_tensor(0, "image"): torch.zeros(24, 2, 2, 2)}, "expected [24, 1"),
    ({ref_tensor(0, "image"): torch.zeros(24, 1, 2, 2), ref_tensor(0, "audio"): torch.zeros(2, 32, 5)}, "alone"),
    ({ref_tensor(0, "video"): torch.full((24, 2, 2, 2), float("nan"))}, "NaN"),
    ({"ref_12_image": torch.zeros(24, 1, 2, 2)}, "unknown reference tensor"),
    ({ref_tensor(i, "video"): torch.zeros(24, 1, 2, 2) for i in range(4)}, "at most 3 video"),
])
def test_parse_references_rejects(tensors, needle):
    with pytest.raises(ValueError, match=None) as e:
        parse_references(tensors, 24, 32, (1, 2, 2))
    assert needle in str(e.value)


@pytest.mark.parametrize("n,fps", [(45, 30.0), (40, 30.0), (50, 29.97), (37, 60.0), (20, 12.0), (30, 24.0)])
def test_frames_resampled_like_diffusers(n, fps):
    """A clip's frames onto 24 fps: our PyAV `fps` filter path equals diffusers' normalisation (frames at the
    canvas, so only the rate changes)."""
    frames = np.random.default_rng(n).integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    ours = resample_frames(frames, fps)
    want = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames, fps, 10 ** 6, 32, 64, 64 * 64, 24.0)
    assert ours.shape == want.shape and np.array_equal(ours, want)
    assert ours.shape[0] == math.floor(n * 24 / fps + 0.5)


# ---------------------------------------------------------------------------------------------------------------
# Which partition a file is, and which file a request needs
# ---------------------------------------------------------------------------------------------------------------
def _tiny_file(path, partition=None, seed=0):
    from dit_svc.checkpoint import METADATA_PARTITION
    from dit_svc.tiny_checkpoint import file_metadata, save_state_dict, tiny_state_dict

    meta = file_metadata(DiTConfig.tiny())
    if partition is None:
        del meta[METADATA_PARTITION]
    else:
        meta[METADATA_PARTITION] = partition
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_state_dict(tiny_state_dict(DiTConfig.tiny(), "bf16", seed), path, meta)


@pytest.mark.parametrize("name,meta,flag,want", [
    ("minimax_h3_ref2va_pruned_int8_convrot.safetensors", None, None, "ref2va"),
    ("minimax_h3_fl2va_bf16.safetensors", None, None, "fl2va"),
    ("dit.safetensors", "ref2va", None, "ref2va"),
    ("dit.safetensors", None, "ref2va", "ref2va"),
    ("minimax_h3_fl2va_bf16.safetensors", None, "ref2va", "ref2va"),  # the flag overrides a name
    ("dit.safetensors", None, None, None),
])
def test_partition_decided_from_metadata_flag_or_name(tmp_path, name, meta, flag, want):
    from dit_svc.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(_tiny_file(tmp_path / name, meta), partition=flag)
    assert info.partition.partition == want, info.partition.evidence


def test_partition_flag_contradicting_metadata_is_refused(tmp_path):
    from dit_svc.checkpoint import inspect_checkpoint
    from stagekit.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="contradicts"):
        inspect_checkpoint(_tiny_file(tmp_path / "dit.safetensors", "fl2va"), partition="ref2va")


def _engine(**kw):
    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from stagekit.dist import RankGroup, RankInfo

    return DiTEngine(DiTEngineConfig(cache_dir=kw.pop("cache_dir"), device="cpu", compute_dtype=torch.float32,
                                     **{"weights": "", "models_dir": "", **kw}),
                     RankGroup(RankInfo(0, 1, 0), "gloo", 10))


def test_dit_refuses_a_file_it_cannot_place_at_start_up(tmp_path):
    from stagekit.checkpoints import CheckpointError

    path = _tiny_file(tmp_path / "dit.safetensors")
    with pytest.raises(CheckpointError, match="--partition fl2va"):
        _engine(cache_dir=tmp_path / "c", weights=str(path))
    assert _engine(cache_dir=tmp_path / "c", weights=str(path), partition="ref2va").partition == "ref2va"


def test_models_folder_with_both_partitions_swaps_per_job(tmp_path):
    """Both files are served; a job loads the one it needs (one resident at a time); a partition the folder lacks
    is refused before the job starts, naming the file it needs."""
    from stagekit.errors import FailedPrecondition

    models = tmp_path / "models"
    _tiny_file(models / "minimax_h3_fl2va_bf16.safetensors", seed=0)
    _tiny_file(models / "minimax_h3_ref2va_bf16.safetensors", seed=1)
    _tiny_file(models / "text_encoders" / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors", seed=2)  # not a DiT
    eng = _engine(cache_dir=tmp_path / "c", models_dir=str(models))
    assert list(eng.partitions) == ["fl2va", "ref2va"] and eng.partition == "fl2va"
    eng.load()
    fl2va = eng.model.final_layer.video_out.weight.clone()
    eng.use_partition("ref2va")
    assert eng.model is not None and eng.path.name == "minimax_h3_ref2va_bf16.safetensors"
    assert not torch.equal(eng.model.final_layer.video_out.weight, fl2va)
    eng.check_partition(True)
    eng.unload()
    only_fl2va = tmp_path / "m2"
    _tiny_file(only_fl2va / "minimax_h3_fl2va_bf16.safetensors")
    eng = _engine(cache_dir=tmp_path / "c", models_dir=str(only_fl2va))
    with pytest.raises(FailedPrecondition, match="minimax_h3_ref2va_"):
        eng.check_partition(True)


# ---------------------------------------------------------------------------------------------------------------
# Reference media and the stages (real processes, embedded tiny stack)
# ---------------------------------------------------------------------------------------------------------------
def media_mp4(n: int = 40, fps: int = 30, w: int = 112, h: int = 64, rate: int | None = 44100) -> bytes:
    """An H.264 clip at `fps` with an AAC stereo soundtrack at `rate` (none when rate is None)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        a = c.add_stream("aac", rate=rate) if rate else None
        if a is not None:
            a.layout = "stereo"
        rng = np.random.default_rng(0)
        for _ in range(n):
            for p in v.encode(av.VideoFrame.from_ndarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "rgb24")):
                c.mux(p)
        c.mux(v.encode())
        if a is not None:
            for s in range(0, int(n / fps * rate), 1024):
                t = (s + np.arange(1024)) / rate
                wave = (0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)])).astype(np.float32)
                frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="stereo")
                frame.sample_rate = rate
                c.mux(a.encode(frame))
            c.mux(a.encode())
    return buf.getvalue()


def media_wav(seconds: float = 1.0, rate: int = 32000, channels: int = 1) -> bytes:
    import io
    import wave

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.repeat(pcm[:, None], channels, 1).tobytes())
    return buf.getvalue()


def media_png(w: int = 96, h: int = 64, seed: int = 1) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_reference_media_on_the_model_rates():
    """Images at a 2048 px short edge; a 30 fps clip onto 24 fps, its canvas, 17n + 5 frames and its soundtrack onto
    32 kHz stereo, both cut to the render's duration; a voice at 44.1 kHz resampled; a too-short clip refused."""
    from stagekit.errors import InvalidArgument
    from stagekit.media import load_reference

    img = load_reference(media_png(300, 200), "image", FRAMES)
    assert img.frames.shape == (1, 2048, 3072, 3)
    clip = load_reference(media_mp4(n=90, fps=30), "video", 124)  # 3 s at 30 fps -> 72 frames at 24 -> 56
    assert clip.frames.shape == (56, 768, 1344, 3) and clip.source_fps == 30.0 and clip.source_rate == 44100
    assert clip.audio.shape[0] == 2 and abs(clip.audio.shape[1] - 3 * 32000) < 2048
    voice = load_reference(media_wav(2.0, 44100), "audio", FRAMES)  # cut to 22/24 s, resampled to 32 kHz
    assert voice.audio.shape == (2, round(int(22 / 24 * 44100) * 32000 / 44100)) or \
        abs(voice.audio.shape[1] - 22 / 24 * 32000) < 64
    spectrum = np.abs(np.fft.rfft(voice.audio[0]))
    assert abs(np.argmax(spectrum) * 32000 / voice.audio.shape[1] - 330) < 3  # the same tone after resampling
    with pytest.raises(InvalidArgument, match="at least 22 frames"):
        load_reference(media_mp4(n=20, fps=30, rate=None), "video", 124)
    with pytest.raises(InvalidArgument, match="cannot be used"):
        load_reference(b"not a video", "video", 124)


def test_reference_encodes_match_diffusers(tmp_path):
    """The decoder's reference encodes vs diffusers' (oracle) on tiny random VAEs: the same normalised pixels as
    diffusers' ref2va setup step (an image, a 30 fps clip), then the video VAE's posterior mean and the audio VAE's
    (diffusers' reference-encoder step) within 1e-4."""
    from decoder_svc.audio_vae import AudioVAEConfig, load_audio_vae, write_tiny_audio_vae
    from decoder_svc.video_vae import VideoVAEConfig, load_video_vae, write_tiny_video_vae
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from PIL import Image
    from stagekit.media import load_reference
    from tests.test_audio_vae import _oracle as audio_oracle
    from tests.test_video_vae import _oracle as video_oracle

    vcfg, acfg = VideoVAEConfig.tiny(), AudioVAEConfig.tiny()
    write_tiny_video_vae(str(tmp_path / "v.safetensors"), vcfg, 0)
    write_tiny_audio_vae(tmp_path / "a.safetensors", acfg, 0)
    vae = load_video_vae(str(tmp_path / "v.safetensors"), vcfg, torch.float32, parts="all")
    avae = load_audio_vae(tmp_path / "a.safetensors", acfg)
    dv, da = video_oracle(vcfg, vae), audio_oracle(acfg)
    from decoder_svc.audio_vae import unfold_weight_norm_state_dict

    sd = avae.state_dict()
    da.load_state_dict({k: v for k, v in unfold_weight_norm_state_dict(sd, avae).items()
                        if not k.startswith("latents_")})
    da.register_to_config(latents_mean=sd["latents_mean"].flatten().tolist(),
                          latents_std=sd["latents_std"].flatten().tolist())

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # An image: diffusers' setup step resizes it (PIL LANCZOS) to the same pixels.
    png = media_png(150, 100)
    ours = load_reference(png, "image", FRAMES)
    setup = MiniMaxH3Ref2VASetupStep()
    from diffusers.image_processor import VaeImageProcessor

    want = np.asarray(VaeImageProcessor(vae_scale_factor=16).resize(Image.open(__import__("io").BytesIO(png))
                                                                   .convert("RGB"), height=2048, width=3072))
    assert setup.max_images == 9 and np.array_equal(ours.frames[0], want)
    # A clip: our decode + normalisation == diffusers' decode (from_file) + normalisation, pixel for pixel.
    path = tmp_path / "clip.mp4"
    path.write_bytes(media_mp4(n=40, fps=30, rate=32000))
    clip = load_reference(path.read_bytes(), "video", FRAMES)
    ref = MiniMaxH3VideoReference.from_file(str(path))
    frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(ref.frames, ref.fps, FRAMES, 32, 768, 768 * 1344,
                                                                 24.0)
    assert np.array_equal(clip.frames, frames[:clip.frames.shape[0]]) and clip.frames.shape[0] == 22
    wave = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(ref.audio, ref.sample_rate, 32000, FRAMES / 24)
    assert torch.equal(torch.from_numpy(clip.audio), wave)  # 32 kHz already: cut and kept as is
    # Encodes: video VAE mean (ComfyUI's recipe; diffusers samples it) and the audio VAE as diffusers' step does.
    # The encoders see a 256 x 384 corner of the normalised pixels (the whole 2048 px image is minutes on a CPU).
    for media in (ours, clip):
        pixels = media.frames[:, :256, :384]
        z = vae.encode(torch.from_numpy(pixels).permute(3, 0, 1, 2))
        with torch.no_grad():
            x = (torch.from_numpy(pixels).permute(3, 0, 1, 2)[None].float() / 255
                 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)) / torch.tensor(
                [0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1)
            mean = dv.encode(x).latent_dist.mode()[0]
        m, s = vae._stats(z.device)
        assert rel(z, (mean - m) / s) < 1e-4
    pipe = SequentialPipelineBlocks.from_blocks_dict({"enc": MiniMaxH3Ref2VAReferenceEncoderStep()}).init_pipeline()
    pipe.update_components(vae=dv, audio_vae=da)
    with torch.no_grad():
        out = pipe(normalized_references=[MiniMaxH3AudioReference(audio=wave, sample_rate=32000)],
                   output="audio_condition_latents")
    ours_rows = patchify_audio(avae.normalize(avae.encode(torch.from_numpy(clip.audio).unsqueeze(1))))
    assert rel(ours_rows, out[0]) < 1e-4


def test_ref2va_render_through_the_stages(clients, tmp_path):
    """Image + voice references, W x H render, through decoder EncodeReference, the encoder's presentation and the
    embedded DiT's ref2va file, to a valid MP4; the DiT reports both partitions."""
    import av

    from client.pipeline import encode, render
    from h3.v1 import common_pb2
    from stagekit.render_params import RenderSpec

    st = clients.dit.Status(common_pb2.StatusRequest(), timeout=30)
    assert set(st.partitions) == {"fl2va", "ref2va"}
    refs = [common_pb2.Reference(kind="image", data=media_png(96, 64), name="subject.png"),
            common_pb2.Reference(kind="audio", data=media_wav(0.5), name="voice.wav")]
    spec = RenderSpec(prompt="<Picture 1> sings with the voice of <Audio 1>", width=256, height=256, frames=FRAMES,
                      steps=1, seed=3)
    s, tags, _ = encode(clients, spec.prompt, with_tags=True, references=refs, frames=FRAMES)
    n_pad = (256 // 32) * (384 // 32)  # the embedded family's 256 px short edge (2048 px for H3), 32 px a token
    assert (tags == 0).sum().item() == n_pad + 2 and s.shape[0] == tags.shape[0]
    out = tmp_path / "ref2va.mp4"
    res = render(clients, spec, out, references=refs)
    assert [r.stage for r in res.stages] == ["decoder", "decoder", "encoder", "dit", "decoder"]
    assert res.stages[0].extra["width"] == 384 and res.stages[1].extra["seconds"] == pytest.approx(0.5, abs=0.03)
    with av.open(str(out)) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (256, 256) and c.streams.audio
        assert sum(1 for _ in c.decode(video=0)) == FRAMES


def test_cli_ref_labels_checked_before_anything_starts(tmp_path):
    """A label naming no reference, or a reference the prompt never names, exits 2 before any stage starts."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "a.png").write_bytes(media_png())
    (tmp_path / "v.wav").write_bytes(media_wav(0.3))
    base = [sys.executable, "-m", "client", "render", "-o", str(tmp_path / "x.mp4"), "--frames", str(FRAMES),
            "--render", "127.0.0.1:1", "--ref", str(tmp_path / "a.png"), "--ref", str(tmp_path / "v.wav")]
    for prompt, needle in (("<Picture 1> talks like <Audio 2>", "names <Audio 2>"),
                           ("<Picture 1> walks", "never names <Audio 1> (v.wav)"),
                           ("<Picture 2> and <Audio 1>", "names <Picture 2>")):
        r = subprocess.run([*base, "--prompt", prompt], cwd=root, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
    r = subprocess.run([*base, "--prompt", "<Picture 1>", "--first-frame", str(tmp_path / "a.png")], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not combine" in r.stderr, r.stderr


def test_cli_ref_render_through_the_render_service(stack, tmp_path):
    """`render --ref subject.png --ref voice.wav`: the render service's reference stage, encoder, DiT (ref2va) and
    decoder, to an MP4; then a text render on the same stack (the DiT back on fl2va)."""
    import av

    from client.__main__ import main as client_main

    _, ep = stack
    args = ["--width", "256", "--height", "256", "--frames", str(FRAMES), "--steps", "1", "--encoder", ep.encoder,
            "--dit", ep.dit, "--decoder", ep.decoder]
    (tmp_path / "subject.png").write_bytes(media_png(80, 120))
    (tmp_path / "voice.wav").write_bytes(media_wav(0.4, 48000, channels=2))
    out = tmp_path / "ref.mp4"
    assert client_main(["render", "--prompt", "<Picture 1> says hello in <Audio 1>'s voice", "--ref",
                        str(tmp_path / "subject.png"), "--ref", str(tmp_path / "voice.wav"), "-o", str(out),
                        *args]) == 0
    assert client_main(["render", "--prompt", "waves", "-o", str(tmp_path / "t2va.mp4"), *args]) == 0
    for f in (out, tmp_path / "t2va.mp4"):
        with av.open(str(f)) as c:
            assert c.streams.video[0].width == 256 and sum(1 for _ in c.decode(video=0)) == FRAMES


def test_dit_batch_runs_partition_by_partition():
    """A mixed DiT batch is sent one partition after the other, the one the DiT ran last first: one swap."""
    from types import SimpleNamespace

    from h3.v1 import common_pb2, render_pb2
    from render_svc.engine import RenderEngine, Work

    def work(i, refs):
        req = render_pb2.RenderRequest(references=[common_pb2.Reference(kind="image", data=b"x")] if refs else [])
        return Work(f"j{i}", req, SimpleNamespace(), None)

    eng = RenderEngine(clients=None)
    works = [work(0, False), work(1, True), work(2, False), work(3, True)]
    groups = eng._groups("dit", works)
    assert [[w.job_id for w in g] for g in groups] == [["j0", "j2"], ["j1", "j3"]] and eng.dit_partition == "ref2va"
    groups = eng._groups("dit", works)  # the DiT holds ref2va now: those go first
    assert [[w.job_id for w in g] for g in groups] == [["j1", "j3"], ["j0", "j2"]] and eng.dit_partition == "fl2va"
    assert eng._groups("encoder", works) == [works]


def test_render_service_keeps_reference_thumbnails_not_files(tmp_path):
    """Admission fills in each reference's thumbnail, size and duration; JobInfo shows them (no file bytes), and a
    finished job's stored request drops the files but keeps what the web page shows. Video references are refused
    at admission while the encoder cannot present them (their thumbnail: the first frame)."""
    from h3.v1 import common_pb2, render_pb2
    from render_svc.service import check_request, describe_reference
    from render_svc.store import SUCCEEDED, JobStore
    from stagekit.errors import FailedPrecondition, InvalidArgument
    from stagekit.render_params import RenderSpec, spec_to_proto

    req = render_pb2.RenderRequest(references=[
        common_pb2.Reference(kind="image", data=media_png(300, 200), name="me.png"),
        common_pb2.Reference(kind="audio", data=media_wav(0.5), name="voice.wav")])
    spec_to_proto(RenderSpec(prompt="<Picture 1> talks like <Audio 1>", frames=FRAMES), req.params)
    check_request(req)
    image, audio = req.references
    assert (image.width, image.height) == (300, 200) and image.thumbnail[:2] == b"\xff\xd8"  # a JPEG
    assert audio.seconds == pytest.approx(0.5, abs=0.01) and not audio.thumbnail
    video = common_pb2.Reference(kind="video", data=media_mp4(n=30, fps=30), name="walk.mp4")
    assert describe_reference(video, 0) is True  # it has a soundtrack: <Audio j> before its <Video k>
    assert (video.width, video.height) == (112, 64) and video.seconds == pytest.approx(1.0, abs=0.1)
    store = JobStore(tmp_path)
    rec, _ = store.submit(req)
    info = store.get(rec.id).info()
    assert [r.name for r in info.references] == ["me.png", "voice.wav"]
    assert all(not r.data for r in info.references) and info.references[0].thumbnail == image.thumbnail
    store.start(rec.id, "keyframes")
    store.finish(rec.id, SUCCEEDED)
    stored = store.get(rec.id).request
    assert all(not r.data for r in stored.references) and stored.references[0].thumbnail == image.thumbnail
    store.close()
    bad = render_pb2.RenderRequest()
    bad.CopyFrom(req)
    bad.params.prompt = "<Picture 1> talks"  # the voice is never named
    with pytest.raises(InvalidArgument, match="never names <Audio 1> \\(voice.wav\\)"):
        check_request(bad)
    bad.params.prompt = "<Picture 1> walks like <Video 1>"
    bad.references.append(video)
    with pytest.raises(FailedPrecondition, match="not shown to the text encoder"):
        check_request(bad)
