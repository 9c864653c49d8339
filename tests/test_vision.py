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
from minimax_h3.text.vision import IMAGE_MEAN, IMAGE_STD, MAX_PIXELS, MIN_PIXELS, preprocess_image, smart_resize

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


def _processor(cfg):
    v = cfg.vision
    return Qwen2VLImageProcessorPil(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                    merge_size=v.spatial_merge_size, image_mean=list(IMAGE_MEAN),
                                    image_std=list(IMAGE_STD),
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


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
    pres, feats, deepstack = cond.vision_inputs(ids, imgs)
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
    states, tags = cond.encode_presentation(prompt_ids, imgs)
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
    pres, _, _ = cond.vision_inputs(prompt_ids, imgs)
    pos, _ = oracle.get_rope_index(input_ids, mm, image_grid_thw=proc["image_grid_thw"])
    assert torch.equal(pres.position_ids, pos[:, 0])


def test_text_only_file_refuses_keyframes(tmp_path, cfg):
    c = Conditioner.load(write_tiny_model(tmp_path, variant="bf16", with_visual=False), cfg, device="cpu")
    assert c.visual is None and not c.has_vision
    with pytest.raises(ValueError, match="no vision tower"):
        c.encode_presentation(c.tokenizer.encode("x"), _images()[:1])


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
    a = cond.vision_inputs(ids, _images()[:1])[1]
    b = rel.vision_inputs(ids, _images()[:1])[1]
    assert torch.equal(a, b)
