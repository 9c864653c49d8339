"""Text-encoder checkpoints: variant/layout detection, int8 ConvRot and NVFP4(+AWQ) dequantisation, key errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minimax_h3.kernels import nvfp4
from minimax_h3.text.checkpoint import LINEARS, CheckpointError, TextEncoderCheckpoint, expected_shapes
from minimax_h3.text.conditioner import Conditioner, ConditionerConfig
from minimax_h3.text.tiny import TINY_CONVROT_GROUPSIZE, tiny_file_tensors, tiny_weights, write_tiny_model

ck = pytest.importorskip("comfy_kitchen")

PROMPT = "Waves crash on black rocks; a gull cries. <d>Look!</d>"


@pytest.fixture(scope="module")
def cfg():
    return ConditionerConfig.tiny()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("te_variants")
    paths = {v: write_tiny_model(d, variant=v) for v in ("fp32", "bf16", "int8_convrot", "nvfp4_awq")}
    paths["release"] = write_tiny_model(d, variant="bf16", layout="release", num_layers=4, extra_full_model=True)
    return d, paths


@pytest.fixture(scope="module")
def reference(models, cfg):
    _, paths = models
    return Conditioner.load(paths["fp32"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _save(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


# ------------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize(
    "key,variant,layout",
    [("fp32", "fp32", "comfy"), ("bf16", "bf16", "comfy"), ("int8_convrot", "int8_convrot", "comfy"),
     ("nvfp4_awq", "nvfp4_awq", "comfy"), ("release", "bf16", "release")],
)
def test_variant_and_layout_from_header(models, cfg, key, variant, layout):
    _, paths = models
    info = TextEncoderCheckpoint(paths[key], cfg).info
    assert (info.variant, info.layout) == (variant, layout)
    assert sum(info.formats.values()) == 7 * cfg.num_layers
    if key == "release":
        assert info.layers_in_file == 4
        assert "lm_head.weight" in info.ignored and "model.language_model.norm.weight" in info.ignored
        assert any(k.startswith("model.language_model.layers.3.") for k in info.ignored)


def test_release_layout_equals_comfy_layout(models, cfg):
    _, paths = models
    a = Conditioner.load(paths["bf16"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    b = Conditioner.load(paths["release"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    assert torch.equal(a, b)


def test_release_shards_with_index(tmp_path, cfg, models):
    _, paths = models
    with safe_open(str(paths["release"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        _save(tmp_path / name, {k: tensors[k] for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}})
    )
    write_tiny_model(tmp_path, variant="bf16")  # also drops tokenizer.json; the extra comfy file is ignored by the index
    a = Conditioner.load(tmp_path, cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    b = Conditioner.load(paths["release"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    assert torch.equal(a, b)


def test_full_config_inventory_matches_comfy_file_shapes():
    shapes = expected_shapes(ConditionerConfig.full())
    assert len(shapes) == 1 + 50 * 11  # embed + 7 linears + 4 norms per layer, no final norm
    assert shapes["embed_tokens.weight"] == (151936, 5120)
    assert shapes["layers.49.self_attn.q_proj.weight"] == (8192, 5120)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (5120, 8192)
    assert shapes["layers.0.mlp.down_proj.weight"] == (5120, 25600)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert "layers.50.input_layernorm.weight" not in shapes


# ------------------------------------------------------------------------------------------ int8 ConvRot


def test_int8_convrot_dequant_matches_comfy_kitchen(models, cfg):
    from comfy_kitchen.backends.eager.quantization import dequantize_int8_convrot_weight

    _, paths = models
    ckpt = TextEncoderCheckpoint(paths["int8_convrot"], cfg)
    raw = ckpt.read_layer(1)["mlp.down_proj.weight"]
    assert raw.format == "int8" and raw.groupsize == TINY_CONVROT_GROUPSIZE
    ours = raw.dense(torch.float32)
    ref = dequantize_int8_convrot_weight(raw.tensors["weight"], raw.tensors["weight_scale"], TINY_CONVROT_GROUPSIZE)
    assert (ours - ref.float()).abs().max().item() <= 1e-6
    w = tiny_weights(cfg)["layers.1.mlp.down_proj.weight"]
    assert _rel(ours, w) < 0.02


def test_int8_convrot_end_to_end(models, cfg, reference):
    _, paths = models
    out = Conditioner.load(paths["int8_convrot"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    rel = _rel(out, reference)
    print(f"int8_convrot conditioner vs fp32 weights: rel err {rel:.3e}")
    assert rel < 0.05
    for mode in ("stream", "compact"):
        st = Conditioner.load(paths["int8_convrot"], cfg, device="cpu", dtype=torch.float32, mode=mode).encode(PROMPT)
        assert torch.equal(st, out), mode


# ------------------------------------------------------------------------------------------ NVFP4


@pytest.mark.parametrize("rows,cols", [(200, 96), (32, 128), (128, 64), (300, 1600)])
def test_nvfp4_unswizzle_and_dequant_match_comfy_kitchen(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g)
    s = x.abs().amax() / (448.0 * 6.0)
    q, bs = ck.quantize_nvfp4(x, s, pad_16x=True)
    plain = ck.from_blocked(bs, q.shape[0], q.shape[1] * 2 // 16)
    assert torch.equal(nvfp4.unswizzle_block_scales(bs, q.shape[0], q.shape[1] * 2 // 16).view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(nvfp4.swizzle_block_scales(plain).view(torch.uint8), bs.view(torch.uint8).reshape(-1, bs.shape[-1]))
    ref = ck.dequantize_nvfp4(q, s, bs, torch.float32)[:rows, :cols]
    ours = nvfp4.dequantize_nvfp4(q, bs, s, (rows, cols))
    assert torch.equal(ours, ref)
    # Flattened swizzled storage and the unswizzled (plain) layout give the same weight.
    assert torch.equal(nvfp4.dequantize_nvfp4(q, bs.flatten(), s, (rows, cols)), ref)
    assert torch.equal(nvfp4.dequantize_nvfp4(q, plain[:rows], s, (rows, cols), swizzled=False), ref)
    assert _rel(ours, x) < 0.15  # 4-bit round trip


def test_e2m1_nibble_order():
    packed = torch.tensor([[0x27]], dtype=torch.uint8)  # hi nibble 2 (1.0), lo nibble 7 (6.0)
    assert nvfp4.unpack_e2m1(packed).tolist() == [[1.0, 6.0]]
    assert nvfp4.unpack_e2m1(packed, hi_first=False).tolist() == [[6.0, 1.0]]
    assert nvfp4.unpack_e2m1(torch.tensor([[0xF8]], dtype=torch.uint8)).tolist() == [[-6.0, -0.0]]


def test_nvfp4_awq_pre_quant_scale_folds_into_columns():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g)
    s = torch.exp(0.3 * torch.randn(64, generator=g))
    gs = w.abs().amax() / (448.0 * 6.0)
    q, bs = ck.quantize_nvfp4(w, gs, pad_16x=True)
    wq = nvfp4.dequantize_nvfp4(q, bs, gs, (48, 64))
    folded = nvfp4.dequantize_nvfp4(q, bs, gs, (48, 64), pre_quant_scale=s)
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(x @ folded.T, (x * s) @ wq.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pre_quant_scale"):
        nvfp4.dequantize_nvfp4(q, bs, gs, (48, 64), pre_quant_scale=s[:10])


def test_nvfp4_awq_end_to_end(models, cfg, reference):
    _, paths = models
    ckpt = TextEncoderCheckpoint(paths["nvfp4_awq"], cfg)
    emb = ckpt.read_embed()
    assert emb.format == "int8" and emb.groupsize is None and emb.tensors["weight_scale"].numel() == 1
    k = ckpt.read_layer(0)["self_attn.k_proj.weight"]  # 32 rows: swizzled scales padded to 128 rows
    assert k.format == "nvfp4" and "pre_quant_scale" in k.tensors and k.tensors["weight_scale"].shape[0] == 128
    out = Conditioner.load(paths["nvfp4_awq"], cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    rel = _rel(out, reference)
    print(f"nvfp4_awq conditioner vs fp32 weights: rel err {rel:.3e}")
    assert rel < 0.3  # 4-bit weights on a random 2-layer model
    for mode in ("stream", "compact"):
        st = Conditioner.load(paths["nvfp4_awq"], cfg, device="cpu", dtype=torch.float32, mode=mode).encode(PROMPT)
        assert torch.equal(st, out), mode


def test_nvfp4_without_awq_vector(tmp_path, cfg):
    w = tiny_weights(cfg)
    p = _save(tmp_path / "te.safetensors", tiny_file_tensors(w, variant="nvfp4_awq", awq=False))
    ckpt = TextEncoderCheckpoint(p, cfg)
    assert ckpt.info.variant == "nvfp4_awq"
    dense = ckpt.read_layer(0)["mlp.up_proj.weight"].dense(torch.float32)
    assert _rel(dense, w["layers.0.mlp.up_proj.weight"]) < 0.15


# ------------------------------------------------------------------------------------------ errors


@pytest.fixture()
def bf16_tensors(cfg):
    return tiny_file_tensors(tiny_weights(cfg), variant="bf16")


def test_missing_key_is_named(tmp_path, cfg, bf16_tensors):
    del bf16_tensors["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match=r"1 missing key\(s\): model\.layers\.1\.self_attn\.k_norm\.weight"):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", bf16_tensors), cfg)


def test_too_few_layers_names_the_missing_layer(tmp_path, cfg, bf16_tensors):
    t = {k: v for k, v in bf16_tensors.items() if not k.startswith("model.layers.1.")}
    with pytest.raises(CheckpointError, match=r"11 missing key\(s\): model\.layers\.1\."):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", t), cfg)


def test_unexpected_key_is_named(tmp_path, cfg, bf16_tensors):
    bf16_tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    bf16_tensors["something.else"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"2 unexpected key\(s\): model\.layers\.0\.self_attn\.q_proj\.bias, something\.else"):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", bf16_tensors), cfg)


def test_misshapen_key_is_named(tmp_path, cfg, bf16_tensors):
    bf16_tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(100, 64, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: BF16\[100, 64\], expected \[128, 64\]"):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", bf16_tensors), cfg)


def test_broken_visual_tower_fails_at_open(tmp_path, cfg, bf16_tensors):
    """The vision tower is validated with the rest (at start-up), not when the first keyframe request loads it."""
    bf16_tensors["visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="visual.patch_embed.proj.weight"):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", bf16_tensors), cfg)


def test_int8_without_comfy_quant_is_refused(tmp_path, cfg):
    t = tiny_file_tensors(tiny_weights(cfg), variant="int8_convrot")
    del t["model.layers.0.mlp.up_proj.comfy_quant"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.comfy_quant: missing"):
        TextEncoderCheckpoint(_save(tmp_path / "a.safetensors", t), cfg)


def test_not_a_text_encoder(tmp_path, cfg):
    p = _save(tmp_path / "dit.safetensors", {"blocks.0.attn.qkv_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="no Qwen3-VL language-model tensors"):
        TextEncoderCheckpoint(p, cfg)


def test_layers_beyond_used_are_refused(models, cfg):
    _, paths = models
    ckpt = TextEncoderCheckpoint(paths["release"], cfg)  # has 4 layers, uses 2
    assert ckpt.read_layer(1)
    with pytest.raises(ValueError, match="outside the conditioner's 2 used layers"):
        ckpt.read_layer(2)


def test_header_metadata_layer_mismatch_is_refused(tmp_path, cfg, bf16_tensors):
    p = tmp_path / "a.safetensors"
    save_file(bf16_tensors, str(p), metadata={"minimax_h3_te": json.dumps({"num_hidden_layers": 3})})
    with pytest.raises(CheckpointError, match="after layer 3, but the conditioner is configured for layer 2"):
        TextEncoderCheckpoint(p, cfg)


def test_missing_file(tmp_path, cfg):
    with pytest.raises(CheckpointError, match="nope.safetensors: does not exist"):
        TextEncoderCheckpoint(tmp_path / "nope.safetensors", cfg)


# ------------------------------------------------------------------------------------------ full-size header


_ELEM = {"U8": 1, "I8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def _write_sparse_safetensors(path, specs, metadata):
    """A real safetensors file whose big tensors are holes (sparse): only `payload` bytes are written."""
    header, offset = {}, 0
    for name, (dtype, shape, _payload) in specs.items():
        n = _ELEM[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, (_d, _s, payload) in specs.items():
            if payload is not None:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(payload)
        f.truncate(start + offset)
    return path


def test_full_size_nvfp4_inventory_validates_from_the_header(tmp_path):
    """The 50-layer nvfp4 ComfyUI inventory (per a public header listing: nvfp4 linears, int8 tensor-wise
    embedding, bf16 norms, visual tower) validates; ~15.7 GB file written sparse, no weight data read."""
    full = ConditionerConfig.full()
    nv = json.dumps({"format": "nvfp4"}).encode()
    i8 = json.dumps({"format": "int8_tensorwise"}).encode()
    assert (len(nv), len(i8)) == (19, 29)  # the comfy_quant lengths in that listing
    specs = {}
    for name, shape in expected_shapes(full).items():
        base = "model." + name[: -len(".weight")]
        if base.endswith(LINEARS):
            r, c = shape
            specs[base + ".weight"] = ("U8", (r, c // 2), None)
            specs[base + ".weight_scale"] = ("F8_E4M3", (r, c // 16), None)
            specs[base + ".weight_scale_2"] = ("F32", (1,), None)
            specs[base + ".comfy_quant"] = ("U8", (19,), nv)
        elif name.startswith("embed_tokens"):
            specs[base + ".weight"] = ("I8", shape, None)
            specs[base + ".weight_scale"] = ("F32", (), None)
            specs[base + ".comfy_quant"] = ("U8", (29,), i8)
        else:
            specs[base + ".weight"] = ("BF16", shape, None)
    n_lm = len(specs)
    assert n_lm == 1954 - 551 + 50 * 4  # listing: 1954 tensors, of which 551 plain (the vision tower's, below)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    with torch.device("meta"):  # the whole vision tower: it is validated at open, like the language model
        visual = Qwen3VLVisionModel(full.vision.hf_config()).state_dict()
    specs.update({f"visual.{k}": ("BF16", tuple(v.shape), None) for k, v in visual.items()})
    assert specs["visual.patch_embed.proj.weight"][1] == (1152, 3, 2, 16, 16)
    assert specs["visual.deepstack_merger_list.0.linear_fc2.weight"][1] == (5120, 4608)
    p = _write_sparse_safetensors(tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", specs, {
        "minimax_h3_te": json.dumps({"num_hidden_layers": 50, "output": "unnormalized_hidden_after_layer_50"})})
    ckpt = TextEncoderCheckpoint(p, full)
    info = ckpt.info
    assert (info.layout, info.variant, info.layers_in_file, info.has_visual) == ("comfy", "nvfp4_awq", 50, True)
    assert info.formats == {"nvfp4_awq": 350} and not info.ignored
    k = ckpt.read("layers.49.self_attn.k_proj.weight")  # holes read as zeros
    assert k.format == "nvfp4" and k.dense(torch.bfloat16).shape == (1024, 5120)
    emb = ckpt.read_embed()
    assert emb.format == "int8" and emb.rows(torch.tensor([0, 151935]), torch.bfloat16).shape == (2, 5120)
