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

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.keyframes import condition_rows, conditioned_denoise
from minimax_h3.dit.layout import ReferenceBlock, build_ref2va_layout, patchify_audio, patchify_video
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.references import References, parse_references, ref_tensor
from minimax_h3.dit.sampling import SamplerConfig, draw_noise, sample
from minimax_h3.media import reference_clip_frames, resample_frames

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
    from minimax_h3.dit.convert_diffusers import from_diffusers
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
    from minimax_h3.dit.checkpoint import METADATA_PARTITION
    from minimax_h3.dit.tiny_checkpoint import file_metadata, save_state_dict, tiny_state_dict

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
    ("dit.safetensors", None, None, None),
])
def test_partition_decided_from_metadata_flag_or_name(tmp_path, name, meta, flag, want):
    from minimax_h3.dit.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(_tiny_file(tmp_path / name, meta), partition=flag)
    assert info.partition.partition == want, info.partition.evidence


def test_partition_flag_contradicting_metadata_is_refused(tmp_path):
    from minimax_h3.dit.checkpoint import inspect_checkpoint
    from stagekit.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="contradicts"):
        inspect_checkpoint(_tiny_file(tmp_path / "dit.safetensors", "fl2va"), partition="ref2va")


@pytest.mark.parametrize("folder", ["ref2va_models/weights", "weights_ref2va", "transformer", "neutral"])
def test_partition_comes_from_the_file_never_from_the_folders_around_it(tmp_path, folder):
    """`--weights FOLDER` holding an fl2va file is fl2va whatever the folder or its parent is called: only the
    file's own evidence (its name, its metadata) places it."""
    from minimax_h3.dit.checkpoint import inspect_checkpoint

    f = _tiny_file(tmp_path / folder / "minimax_h3_fl2va_bf16.safetensors")
    info = inspect_checkpoint(f.parent)
    assert info.partition.partition == "fl2va", info.partition.evidence
    assert "minimax_h3_fl2va_bf16.safetensors" in info.partition.evidence
    if folder == "ref2va_models/weights":
        assert _engine(cache_dir=tmp_path / "c", weights=str(f.parent)).partition == "fl2va"


def test_release_folders_name_their_sharded_checkpoints(tmp_path):
    """The release's own checkpoint folders (transformer/: fl2va, transformer_ref/: ref2va) hold shards that carry
    no partition in their names: the checkpoint folder's exact name places them, never a parent's."""
    from minimax_h3.dit.checkpoint import inspect_checkpoint
    from minimax_h3.dit.tiny_checkpoint import write_tiny_release_dir

    root = write_tiny_release_dir(DiTConfig.tiny(), tmp_path / "ref2va_release")
    assert inspect_checkpoint(root / "transformer").partition.partition == "fl2va"
    (root / "transformer").rename(root / "transformer_ref")
    assert inspect_checkpoint(root / "transformer_ref").partition.partition == "ref2va"
    (root / "transformer_ref").rename(root / "shards")
    assert inspect_checkpoint(root / "shards").partition.partition is None  # "ref2va_release" is no evidence


@pytest.mark.parametrize("meta,flag,folder,first,second", [
    ("ref2va", None, "", "metadata h3_partition=ref2va", "'minimax_h3_fl2va_bf16.safetensors'"),
    (None, "ref2va", "", "--partition ref2va", "'minimax_h3_fl2va_bf16.safetensors'"),
    (None, None, "transformer_ref", "'minimax_h3_fl2va_bf16.safetensors'", "'transformer_ref'"),
])
def test_contradicting_partition_evidence_is_refused_naming_both(tmp_path, meta, flag, folder, first, second):
    from minimax_h3.dit.checkpoint import inspect_checkpoint
    from stagekit.checkpoints import CheckpointError

    f = _tiny_file(tmp_path / (folder or "w") / "minimax_h3_fl2va_bf16.safetensors", meta)
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(f.parent if folder else f, partition=flag)
    msg = str(e.value)
    assert first in msg and second in msg and "contradict" in msg, msg


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
    from minimax_h3.contract import RenderSpec
    from minimax_h3.dit.references import REFERENCES_INPUT
    from stagekit.checkpoints import WeightSource
    from stagekit.errors import FailedPrecondition

    models = tmp_path / "models"
    _tiny_file(models / "minimax_h3_fl2va_bf16.safetensors", seed=0)
    _tiny_file(models / "minimax_h3_ref2va_bf16.safetensors", seed=1)
    _tiny_file(models / "text_encoders" / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors", seed=2)  # not a DiT
    eng = _engine(cache_dir=tmp_path / "c", models_dir=str(models))
    assert list(eng.partitions) == ["fl2va", "ref2va"] and eng.partition == "fl2va"
    spec = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=0)
    assert eng.weight_files(spec, {}) == eng.weight_files() == tuple(eng.partitions["fl2va"].files)
    eng.load(WeightSource(eng.weight_files(spec, {})))
    fl2va = eng.model.final_layer.video_out.weight.clone()
    ref2va = eng.weight_files(spec, {REFERENCES_INPUT: "references"})  # what the runtime loads for a ref2va job
    assert ref2va == tuple(eng.partitions["ref2va"].files)
    eng.unload()
    eng.load(WeightSource(ref2va))
    assert eng.model is not None and eng.path.name == "minimax_h3_ref2va_bf16.safetensors"
    assert not torch.equal(eng.model.final_layer.video_out.weight, fl2va)
    eng.check_partition(True)
    eng.unload()
    only_fl2va = tmp_path / "m2"
    _tiny_file(only_fl2va / "minimax_h3_fl2va_bf16.safetensors")
    eng = _engine(cache_dir=tmp_path / "c", models_dir=str(only_fl2va))
    with pytest.raises(FailedPrecondition, match="minimax_h3_ref2va_"):
        eng.check_partition(True)


def test_a_ref2va_load_reads_its_file_from_a_host_copy_as_the_fl2va_load_does(tmp_path, monkeypatch):
    """The files a job needs are known before it runs (the DiT's `weight_files`), so a stage that keeps its files in
    host memory keeps the ref2va partition's file too, and its device worker's load reads it from there."""
    from minimax_h3.contract import RenderSpec
    from minimax_h3.dit.references import REFERENCES_INPUT
    from stagekit.checkpoints import WeightSource
    from stagekit.device_worker import DeviceWorkerEngine, WorkerConfig
    from stagekit.dist import RankGroup, RankInfo
    from stagekit.host_copy import GIB, MEM_AVAILABLE_ENV

    monkeypatch.setenv(MEM_AVAILABLE_ENV, str(64 * GIB))
    models = tmp_path / "models"
    _tiny_file(models / "minimax_h3_fl2va_bf16.safetensors", seed=0)
    _tiny_file(models / "minimax_h3_ref2va_bf16.safetensors", seed=1)
    eng = _engine(cache_dir=tmp_path / "c", models_dir=str(models))
    spec = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=0)
    fl2va, ref2va = eng.weight_files(spec, {}), eng.weight_files(spec, {REFERENCES_INPUT: "references"})
    worker = DeviceWorkerEngine(eng, RankGroup(RankInfo(0, 1, 0), "gloo", 10), WorkerConfig("dit", "cpu"))
    try:
        worker.load(WeightSource(ref2va))
        assert worker.host_copies.held(list(ref2va)) and not worker.host_copies.held(list(fl2va))
        assert worker.load_report()["host_copy_bytes"] == ref2va[0].stat().st_size
        worker.unload()
        worker.load(WeightSource(fl2va))
        assert worker.host_copies.held(list(ref2va)) and worker.host_copies.held(list(fl2va))
    finally:
        worker.unload()
        worker.close()


def test_a_fault_in_the_dits_conditioning_checks_is_internal(tmp_path, monkeypatch):
    """The conditioning checks raise INVALID_ARGUMENT themselves (references, keyframes, text tags); the DiT no
    longer relabels every ValueError under them as the caller's, so a fault inside one is INTERNAL."""
    import grpc

    import dit_svc.engine as engine_mod
    from minimax_h3.contract import TEXT_TAGS, RenderSpec
    from stagekit.errors import InvalidArgument, status_for

    eng = _engine(cache_dir=tmp_path / "c", weights=str(_tiny_file(tmp_path / "dit.safetensors", "fl2va")))
    spec = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=0)
    text = torch.zeros(4, eng.model_cfg.text_dim)
    with pytest.raises(InvalidArgument, match="text_tags has shape"):
        eng.check_conditioning(spec, text, {TEXT_TAGS: torch.ones(3, dtype=torch.int64)})

    def broken(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(engine_mod, "check_text_tags", broken)
    with pytest.raises(ValueError, match="internal invariant") as e:
        eng.check_conditioning(spec, text, {TEXT_TAGS: torch.ones(4, dtype=torch.int64)})
    assert status_for(e.value)[0] == grpc.StatusCode.INTERNAL
