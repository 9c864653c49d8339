"""fl2va vision tower: parity with transformers' Qwen3-VL (processor pixels, image features + DeepStack, the
layer-k states of a keyframe presentation), presentation tags / positions, checkpoint loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from minimax_h3.images import fit_to_canvas
from minimax_h3.text.conditioner import Conditioner, ConditionerConfig
from minimax_h3.text.tiny import tiny_visual_weights, tiny_weights, write_tiny_model
from minimax_h3.text.vision import (IMAGE_MEAN, IMAGE_STD, MAX_PIXELS, MIN_PIXELS, keyframe_items, preprocess_image,
                                    smart_resize)
from stagekit.errors import FailedPrecondition, InvalidArgument

FULL_LAYERS = 4
PROMPT = "A fox jumps. <d>Hi!</d>"


@pytest.fixture(scope="module")
def cfg():
    return ConditionerConfig.tiny()


@pytest.fixture(scope="module")
def cond(tmp_path_factory, cfg):
    d = tmp_path_factory.mktemp("tiny_vl")
    path = write_tiny_model(d, variant="fp32", num_layers=FULL_LAYERS)
    return Conditioner.load(path, cfg, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def oracle(cfg, cond):
    """transformers' Qwen3VLModel (untruncated 4-layer LM + tiny vision tower) with the same weights, fp32."""
    tok = cond.tokenizer
    hf = Qwen3VLConfig(text_config=cfg.hf_text_config(num_layers=FULL_LAYERS).to_dict(),
                       vision_config=cfg.vision.hf_config().to_dict(),
                       image_token_id=tok.token_id("<|image_pad|>"), video_token_id=tok.token_id("<|video_pad|>"),
                       vision_start_token_id=tok.token_id("<|vision_start|>"),
                       vision_end_token_id=tok.token_id("<|vision_end|>"))
    hf.text_config._attn_implementation = "sdpa"
    hf.vision_config._attn_implementation = "sdpa"
    m = Qwen3VLModel(hf).eval()
    sd = {f"language_model.{k}": v for k, v in tiny_weights(cfg, num_layers=FULL_LAYERS).items()}
    sd["language_model.norm.weight"] = torch.ones(cfg.hidden_size)
    sd.update({f"visual.{k}": v for k, v in tiny_visual_weights(cfg.vision).items()})
    m.load_state_dict(sd, strict=True)
    return m


def _processor(cfg, min_pixels: int = MIN_PIXELS):
    v = cfg.vision
    return Qwen2VLImageProcessorPil(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                    merge_size=v.spatial_merge_size, image_mean=list(IMAGE_MEAN),
                                    image_std=list(IMAGE_STD),
                                    size={"shortest_edge": min_pixels, "longest_edge": MAX_PIXELS})


def _images():
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (256, 320, 3), generator=g, dtype=torch.uint8)  # a canvas: no resize
    b = torch.randint(0, 256, (256, 320, 3), generator=g, dtype=torch.uint8)
    return [a, b]


def test_preprocessing_matches_transformers_processor(cfg):
    proc = _processor(cfg)
    for img in [*_images(), torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8)]:
        ref = proc(images=[img.numpy()], return_tensors="pt")
        pv, grid = preprocess_image(img, cfg.vision)
        assert grid.tolist() == ref["image_grid_thw"][0].tolist()
        if tuple(img.shape[:2]) == smart_resize(img.shape[0], img.shape[1], 32):
            assert torch.equal(pv, ref["pixel_values"].float())
        else:  # resized: both PIL bicubic; allow rounding differences of the uint8 resample
            assert (pv - ref["pixel_values"].float()).abs().max() <= 2 / 255 * 2 + 1e-6


def test_image_token_count_is_hw_over_16_16_4(cfg):
    for h, w in ((480, 832), (256, 320), (1088, 1920)):
        _, grid = preprocess_image(torch.zeros(h, w, 3, dtype=torch.uint8), cfg.vision)
        assert int(grid.prod()) // 4 == (h // 16) * (w // 16) // 4


def test_vision_features_and_deepstack_match_transformers(cfg, cond, oracle):
    imgs = _images()
    ids = cond.tokenizer.encode(PROMPT)
    pres, feats, deepstack = cond.vision_inputs(ids, keyframe_items(cond.tokenizer.encode, imgs))
    proc = _processor(cfg)(images=[i.numpy() for i in imgs], return_tensors="pt")
    with torch.no_grad():
        ref = oracle.get_image_features(proc["pixel_values"], proc["image_grid_thw"], return_dict=True)
    torch.testing.assert_close(feats, torch.cat(ref.pooler_output), rtol=1e-5, atol=1e-5)
    assert len(deepstack) == len(cfg.vision.deepstack_visual_indexes) == len(ref.deepstack_features)
    for ours, theirs in zip(deepstack, ref.deepstack_features):
        torch.testing.assert_close(ours, torch.cat(theirs), rtol=1e-5, atol=1e-5)


def test_presentation_states_match_transformers(cfg, cond, oracle):
    imgs = _images()
    tok = cond.tokenizer
    prompt_ids = tok.encode(PROMPT)
    states, tags = cond.encode_presentation(prompt_ids, keyframe_items(tok.encode, imgs))
    # The reference presentation, built the way diffusers' fl2va text step builds it.
    pad, vs, ve = tok.token_id("<|image_pad|>"), tok.token_id("<|vision_start|>"), tok.token_id("<|vision_end|>")
    proc = _processor(cfg)(images=[i.numpy() for i in imgs], return_tensors="pt")
    ids, want_tags = [], []
    for i, grid in enumerate(proc["image_grid_thw"]):
        lab = tok.encode(f"<Picture {i + 1}>: ")
        block = [vs] + [pad] * (int(grid.prod()) // 4) + [ve]
        ids += lab + block
        want_tags += [1] * len(lab) + [0] * len(block)
    ids += prompt_ids
    want_tags += [1] * len(prompt_ids)
    assert tags.tolist() == want_tags
    input_ids = torch.tensor([ids])
    mm = (input_ids == pad).long()
    with torch.no_grad():
        out = oracle(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm,
                     pixel_values=proc["pixel_values"], image_grid_thw=proc["image_grid_thw"],
                     output_hidden_states=True, use_cache=False)
    ref = out.hidden_states[cfg.num_layers][0]
    assert states.shape == ref.shape
    torch.testing.assert_close(states, ref, rtol=1e-4, atol=1e-4)
    # Positions agree with transformers' get_rope_index.
    pres, _, _ = cond.vision_inputs(prompt_ids, keyframe_items(tok.encode, imgs))
    pos, _ = oracle.get_rope_index(input_ids, mm, image_grid_thw=proc["image_grid_thw"])
    assert torch.equal(pres.position_ids, pos[:, 0])


def test_text_only_file_refuses_keyframes(tmp_path, cfg):
    c = Conditioner.load(write_tiny_model(tmp_path, variant="bf16", with_visual=False), cfg, device="cpu")
    assert c.visual is None and not c.has_vision
    with pytest.raises(FailedPrecondition, match="no vision tower"):  # the server's file: the operator's to fix
        c.encode_presentation(c.tokenizer.encode("x"), keyframe_items(c.tokenizer.encode, _images()[:1]))


def test_fit_to_canvas_cover_crop():
    img = torch.arange(40 * 60 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(40, 60, 3)
    out = fit_to_canvas(img, 64, 32)
    assert out.shape == (32, 64, 3) and out.dtype == torch.uint8
    assert torch.equal(fit_to_canvas(out, 64, 32), out)  # identity at the canvas size
    assert np.asarray(fit_to_canvas(img, 96, 96)).shape == (96, 96, 3)


def test_full_size_vision_config_inferred_from_shapes():
    """The 32B ComfyUI file's `visual.*` inventory (351 tensors: depth 27, width 1152, 3 DeepStack mergers into
    5120) gives the Qwen3-VL vision config back; the tiny one round-trips too."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from minimax_h3.text.vision import VisionConfig, infer_vision_config

    for vc in (VisionConfig.full(), VisionConfig.tiny()):
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in Qwen3VLVisionModel(vc.hf_config()).state_dict().items()}
        assert infer_vision_config(shapes, VisionConfig.full() if vc.depth == 27 else VisionConfig.tiny()) == vc
    assert len(shapes) == 3 * 12 + 2 + 1 + 6 + 2 * 6  # tiny: blocks, patch_embed, pos_embed, merger, deepstack
    assert shapes["deepstack_merger_list.0.linear_fc2.weight"] == (64, 128)


def test_release_layout_vision_tower(tmp_path, cfg, cond):
    """`model.visual.*` (release / transformers layout) loads the same tower as ComfyUI's `visual.*`."""
    rel = Conditioner.load(write_tiny_model(tmp_path, variant="fp32", layout="release", num_layers=FULL_LAYERS),
                           cfg, device="cpu", dtype=torch.float32)
    ids = cond.tokenizer.encode("x")
    items = keyframe_items(cond.tokenizer.encode, _images()[:1])
    a = cond.vision_inputs(ids, items)[1]
    b = rel.vision_inputs(ids, items)[1]
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# ref2va: image, video (with its soundtrack) and audio references
# ---------------------------------------------------------------------------------------------------------------
class _HFTokenizer:
    """Our tokenizer as diffusers' presentation step calls a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        assert not add_special_tokens
        return {"input_ids": self.tok.encode(text)}

    def convert_tokens_to_ids(self, name: str) -> int:
        return self.tok.token_id(name)


def _video_pixels(proc, frames: list[np.ndarray], tp: int) -> torch.Tensor:
    """transformers' video-processor layout from its image processor: each frame's patches (the image processor
    repeats a frame over the temporal patch; a video patch holds consecutive frames there), the last frame repeated
    to fill the last patch, temporal patches one after the other."""
    frames = frames + [frames[-1]] * (-len(frames) % tp)
    per_frame = [proc(images=[f], return_tensors="pt")["pixel_values"].float() for f in frames]
    n, d = per_frame[0].shape
    first = [pv.reshape(n, 3, tp, d // (3 * tp))[:, :, 0] for pv in per_frame]  # [n, 3, p*p] each
    blocks = [torch.stack(first[i:i + tp], dim=2).reshape(n, d) for i in range(0, len(first), tp)]
    return torch.cat(blocks)


@pytest.mark.parametrize("n_frames", [30, 40])
def test_ref2va_presentation_with_a_video_matches_diffusers_and_transformers(cfg, cond, oracle, n_frames):
    """An image, a video with its soundtrack and a voice: labels, timestamps and blocks as diffusers' ref2va text step
    builds them (its own frame sampling and presentation), the vision features of the video's temporal patches and
    the layer-k states as transformers' Qwen3-VL computes them from pixel_values_videos / video_grid_thw, and the
    positions as its get_rope_index places the per-patch blocks (30 frames: 3 sampled, the last one repeated)."""
    from diffusers.modular_pipelines.minimax_h3 import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                        MiniMaxH3VideoReference)
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep as Step
    from PIL import Image

    from minimax_h3.media import ReferenceMedia
    from minimax_h3.text.vision import VIDEO_MIN_PIXELS, reference_parts

    tok, tp = cond.tokenizer, cfg.vision.temporal_patch_size
    rng = np.random.default_rng(n_frames)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    video = rng.integers(0, 256, (n_frames, 64, 128, 3), dtype=np.uint8)
    sound = np.zeros((2, 800), dtype=np.float32)
    ours = [ReferenceMedia("image", frames=image[None]), ReferenceMedia("video", frames=video, audio=sound),
            ReferenceMedia("audio", audio=sound)]
    theirs = [MiniMaxH3ImageReference(image=Image.fromarray(image)),
              MiniMaxH3VideoReference(frames=video, fps=24.0, audio=torch.from_numpy(sound)),
              MiniMaxH3AudioReference(audio=torch.from_numpy(sound))]
    prompt = "<Picture 1> dances like <Video 1> to <Audio 1>, singing in <Audio 2>'s voice."

    # 1. Ours: the engine's presentation.
    items, tail = reference_parts(tok.encode, ours, tp)
    states, tags = cond.encode_presentation(tail + tok.encode(prompt), items)
    pres, _, _ = cond.vision_inputs(tail + tok.encode(prompt), items)

    # 2. diffusers: frames read at 2 fps and the presentation's token ids and tags; transformers: the pixels.
    sampled, stamps = Step._sample_video_condition_frames(video, 24.0, 2.0, tp)
    assert len(stamps) == -(-len(sampled) // tp) and stamps[0] == 0.25
    img_in = _processor(cfg)(images=[image], return_tensors="pt")
    # The video's frames are within the video processor's bounds (no resize); the image processor's lower bound
    # is the video processor's for these frames.
    pv_videos = _video_pixels(_processor(cfg, VIDEO_MIN_PIXELS), sampled, tp)
    gh, gw = 64 // 16, 128 // 16
    video_grid = torch.tensor([[len(stamps), gh, gw]])
    ids, want_tags = Step._build_presentation(_HFTokenizer(tok), prompt, theirs,
                                              [int(img_in["image_grid_thw"][0].prod()) // 4], [gh * gw // 4], [stamps])
    assert pres.ids.tolist() == ids and tags.tolist() == want_tags
    assert tok.decode(ids).count("seconds>") == len(stamps) and "<0.2 seconds>" in tok.decode(ids)

    # 3. transformers' Qwen3-VL on those ids and pixels.
    input_ids = torch.tensor([ids])
    mm = (input_ids == tok.token_id("<|image_pad|>")).long() + 2 * (input_ids == tok.token_id("<|video_pad|>")).long()
    with torch.no_grad():
        out = oracle(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm,
                     pixel_values=img_in["pixel_values"], image_grid_thw=img_in["image_grid_thw"],
                     pixel_values_videos=pv_videos, video_grid_thw=video_grid, output_hidden_states=True,
                     use_cache=False)
    ref = out.hidden_states[cfg.num_layers][0]
    assert states.shape == ref.shape
    torch.testing.assert_close(states, ref, rtol=1e-4, atol=1e-4)
    pos, _ = oracle.get_rope_index(input_ids, mm, image_grid_thw=img_in["image_grid_thw"],
                                   video_grid_thw=video_grid.clone())
    assert torch.equal(pres.position_ids, pos[:, 0])


@pytest.mark.parametrize("n,fps", [(22, 24.0), (30, 24.0), (124, 24.0), (361, 24.0), (50, 30.0), (13, 24.0)])
def test_video_frames_sampled_like_diffusers(n, fps):
    """Which frames the conditioner reads and the block timestamps: diffusers' sampling, for any count and rate."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep as Step

    from minimax_h3.text.vision import sample_video

    frames = np.arange(n, dtype=np.int32).reshape(n, 1, 1, 1)
    sampled, stamps = Step._sample_video_condition_frames(frames, fps, 2.0, 2)
    indices, ours = sample_video(n, 2, fps=fps)
    assert [int(f[0, 0, 0]) for f in sampled] == indices and ours == stamps
    with pytest.raises(InvalidArgument, match="at least 13 frames"):  # a clip too short: the request's
        sample_video(12, 2)


def test_video_size_rule_matches_transformers(cfg):
    """The video processor's size rule (frames x pixels within its bounds): a 15 s clip on the widest canvas is
    scaled down, a 12 s one is not; the resized frames are the patches of an antialiased bicubic resize."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_resize

    from minimax_h3.text.vision import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, preprocess_video

    for frames, h, w in ((24, 768, 1344), (30, 768, 1344), (29, 768, 1344), (31, 1344, 768), (30, 768, 768),
                         (2, 32, 64), (11, 576, 1024), (3, 40, 72)):
        assert smart_resize(h, w, 32, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, frames=frames, temporal_patch=2) == \
            hf_video_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=VIDEO_MIN_PIXELS,
                            max_pixels=VIDEO_MAX_PIXELS)
    assert smart_resize(768, 1344, 32, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, frames=24, temporal_patch=2) == (768, 1344)
    assert smart_resize(768, 1344, 32, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, frames=30, temporal_patch=2) == (672, 1184)
    # A small clip below the lower bound is scaled up: the patches are those of the resized frames.
    frames = torch.randint(0, 256, (3, 16, 24, 3), dtype=torch.uint8)
    pv, grid = preprocess_video(frames, cfg.vision)
    rh, rw = smart_resize(16, 24, 32, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, frames=3, temporal_patch=2)
    assert grid.tolist() == [2, rh // 16, rw // 16] and pv.shape == (2 * rh * rw // 256, 3 * 2 * 16 * 16)
    assert pv.min() >= -1 and pv.max() <= 1
