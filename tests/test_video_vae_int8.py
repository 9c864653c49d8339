"""The int8 ConvRot video VAE (ComfyUI's `minimax_h3_video_vae_int8_convrot.safetensors`): layout from the file,
exact dequantisation at load, decode against a float64 reference and the fp16 original, refusals."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_h3.vae.video import (CheckpointError, VideoVAEConfig, inspect_video_vae, load_video_vae,
                                  write_tiny_video_vae)
from tests.safetensors_files import write_release_video_vae

TINY = VideoVAEConfig.tiny()  # decoder width 32, feed-forward 128: ConvRot groups of 16 divide both
GROUP = 16
# The layers ComfyUI quantises in its int8 video VAE (written out here, independently of the loader's table).
QUANTISED = re.compile(r"decoder\.transformer_blocks\.\d+\.(attn\.to_qkv|attn\.to_out|ff\.w1|ff\.w2)")
H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)


def hadamard64(g: int) -> torch.Tensor:
    h = H4
    while h.shape[0] < g:
        h = torch.kron(h, H4)
    return h / math.sqrt(g)


def quantize(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """comfy-kitchen's int8 ConvRot weight quantisation, in float64: rotate every group of g input columns by H_g,
    then per output row scale = absmax / 127, round half to even, clamp to int8."""
    n, k = w.shape
    rot = (w.double().reshape(n, k // g, g) @ hadamard64(g)).reshape(n, k)
    scale = (rot.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-30).float()
    return torch.round(rot / scale.double()).clamp(-128, 127).to(torch.int8), scale


def dequantize64(q: torch.Tensor, scale: torch.Tensor, g: int) -> torch.Tensor:
    """The reference dequantisation: (q * scale) rotated back group-wise, in float64 (exact here), rounded to fp32."""
    n, k = q.shape
    return ((q.double() * scale.double()).reshape(n, k // g, g) @ hadamard64(g)).reshape(n, k).float()


def convert(src: str, dst: str, g: int = GROUP, form: str = "tensors", only: int | None = None) -> dict:
    """The converter: an fp16 video VAE file -> its int8 ConvRot form as ComfyUI writes it: each quantised layer's
    `weight` int8 [out, in] (rotated), `weight_scale` fp32 [out, 1] and a U8 `comfy_quant` JSON descriptor
    (form "tensors"), or the descriptors as `{"layers": ...}` under `_quantization_metadata` in the safetensors
    metadata (form "metadata", ComfyUI's older one). `only`: quantise the first `only` layers. Returns
    {layer: (q, scale)}."""
    sd = load_file(src)
    with safe_open(src, "pt") as f:
        metadata = dict(f.metadata() or {})
    out, codes, described = {}, {}, {}
    for key, t in sd.items():
        layer = key[: -len(".weight")]
        if key.endswith(".weight") and QUANTISED.fullmatch(layer) and (only is None or len(codes) < only):
            q, s = quantize(t, g)
            out[key], out[layer + ".weight_scale"] = q, s
            descriptor = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": g}
            if form == "tensors":
                out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(descriptor).encode()), dtype=torch.uint8)
            else:
                described[layer] = descriptor
            codes[layer] = (q, s)
        else:
            out[key] = t
    if described:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": described})
    save_file(out, dst, metadata=metadata)
    return codes


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("int8vae")
    fp16 = str(d / "minimax_h3_video_vae_fp16.safetensors")
    write_tiny_video_vae(fp16, TINY, seed=5, dtype=torch.float16)
    int8 = str(d / "minimax_h3_video_vae_int8_convrot.safetensors")
    codes = convert(fp16, int8)
    meta = str(d / "meta_form.safetensors")
    convert(fp16, meta, form="metadata")
    return {"fp16": fp16, "int8": int8, "meta": meta, "codes": codes, "dir": d}


LATENTS = torch.randn(24, 7, 4, 6, generator=torch.Generator().manual_seed(1))


def test_layout_read_from_the_file(files):
    info = inspect_video_vae(files["int8"], parts="decoder")
    assert info.storage == "int8_convrot" and info.layout == "comfy"
    assert set(info.quant) == set(files["codes"]) and len(info.quant) == 4 * TINY.dec_layers
    assert {s.groupsize for s in info.quant.values()} == {GROUP}
    assert inspect_video_vae(files["meta"], parts="decoder").quant == info.quant
    assert inspect_video_vae(files["fp16"], parts="decoder").storage == "fp16"
    # the encoder half holds no quantised layer; an encoder-only load ignores the decoder's int8 tensors
    enc = load_video_vae(files["int8"], None, torch.float32, parts="encoder")
    assert not hasattr(enc, "decoder")


def test_decode_bitwise_equal_to_the_dequantised_reference(files):
    """Every dequantised weight is the float64 reference rounded to fp32, bit for bit; so the int8 file decodes to
    exactly what the same decoder decodes with those weights."""
    vae = load_video_vae(files["int8"], None, torch.float32, parts="decoder")
    ref = load_video_vae(files["fp16"], None, torch.float32, parts="decoder")
    state = ref.state_dict()
    for layer, (q, s) in files["codes"].items():
        state[layer + ".weight"] = dequantize64(q, s, GROUP)
    ref.load_state_dict(state)
    got = vae.state_dict()
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert torch.equal(vae.decode(LATENTS), ref.decode(LATENTS))
    # the ComfyUI metadata form is the same file
    meta = load_video_vae(files["meta"], None, torch.float32, parts="decoder").state_dict()
    assert all(torch.equal(meta[k], got[k]) for k in got)


def test_dequantisation_agrees_with_comfy_kitchen(files):
    ck = pytest.importorskip("comfy_kitchen.backends.eager.quantization")
    vae = load_video_vae(files["int8"], None, torch.float32, parts="decoder").state_dict()
    for layer, (q, s) in files["codes"].items():
        theirs = ck.dequantize_int8_convrot_weight(q, s, GROUP).float()
        assert (vae[layer + ".weight"] - theirs).abs().max().item() <= 1e-6  # fp32 matmul rounding on their side


def test_quantisation_error_against_the_fp16_original(files):
    """int8 weights (row-wise, after the rotation) against the fp16 file they were made from: about 1 % of each
    weight, a few per mille of the decoded pixels on this tiny random decoder."""
    vae = load_video_vae(files["int8"], None, torch.float32, parts="decoder")
    fp16 = load_video_vae(files["fp16"], None, torch.float32, parts="decoder")
    w, w0 = vae.state_dict(), fp16.state_dict()
    worst = max(((w[k] - w0[k]).norm() / w0[k].norm()).item() for k in (layer + ".weight" for layer in files["codes"]))
    out, out0 = vae.decode(LATENTS), fp16.decode(LATENTS)
    err = ((out - out0).norm() / out0.norm()).item()
    print(f"int8 ConvRot vs fp16: worst weight rel err {worst:.2e}, decoded frames rel err {err:.2e}, "
          f"max |diff| {(out - out0).abs().max().item():.2e}")
    assert worst < 1.5e-2 and err < 1e-2


def test_partly_quantised_file(files):
    path = str(files["dir"] / "partly.safetensors")
    convert(files["fp16"], path, only=3)
    info = inspect_video_vae(path, parts="decoder")
    assert info.storage == f"int8_convrot (3 of {4 * TINY.dec_layers} linears)"
    load_video_vae(path, None, torch.float32, parts="decoder")


def _edited(files, name: str, edit, form: str = "tensors") -> str:
    """A copy of the int8 file (or its metadata form) with `edit(tensors, metadata)` applied."""
    src = files["int8" if form == "tensors" else "meta"]
    sd = load_file(src)
    with safe_open(src, "pt") as f:
        metadata = dict(f.metadata() or {})
    edit(sd, metadata)
    path = str(files["dir"] / name)
    save_file(sd, path, metadata=metadata)
    return path


QKV = "decoder.transformer_blocks.1.attn.to_qkv"


def _descriptor(doc) -> torch.Tensor:
    return torch.tensor(list(json.dumps(doc).encode()), dtype=torch.uint8)


def _relayer(metadata: dict, fn) -> None:
    doc = json.loads(metadata["_quantization_metadata"])
    fn(doc["layers"])
    metadata["_quantization_metadata"] = json.dumps(doc)


@pytest.mark.parametrize("name,edit,form,key,problem", [
    ("no_scale", lambda sd, m: sd.pop(QKV + ".weight_scale"), "tensors", QKV + ".weight_scale", "missing"),
    ("no_descriptor", lambda sd, m: sd.pop(QKV + ".comfy_quant"), "tensors", QKV + ".comfy_quant",
     "without its comfy_quant descriptor"),
    ("scale_shape", lambda sd, m: sd.__setitem__(QKV + ".weight_scale", sd[QKV + ".weight_scale"][:, 0]), "tensors",
     QKV + ".weight_scale", "misshapen"),
    ("fp8", lambda sd, m: sd.__setitem__(QKV + ".comfy_quant", _descriptor({"format": "float8_e4m3fn"})), "tensors",
     QKV + ".comfy_quant", "unsupported comfy_quant format 'float8_e4m3fn'"),
    ("group", lambda sd, m: sd.__setitem__(QKV + ".comfy_quant", _descriptor(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64})), "tensors", QKV + ".comfy_quant",
     "group size 64 does not divide the weight's in_features 32"),
    ("float_weight", lambda sd, m: sd.__setitem__(QKV + ".weight", sd[QKV + ".weight"].half()), "tensors",
     QKV + ".weight", "wrong dtype"),
    ("proj_out", lambda sd, m: sd.__setitem__("decoder.proj_out.comfy_quant", _descriptor(
        {"format": "int8_tensorwise"})), "tensors", "decoder.proj_out.weight",
     "ComfyUI quantises only the attention and feed-forward linears"),
    ("meta_group", lambda sd, m: _relayer(m, lambda layers: layers[QKV].update(convrot_groupsize=8)), "metadata",
     QKV + ".comfy_quant", "metadata '_quantization_metadata': comfy_quant convrot_groupsize 8 is not a power of 4"),
    ("meta_contradicts", lambda sd, m: sd.__setitem__(QKV + ".comfy_quant", _descriptor(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 4})), "metadata", QKV + ".comfy_quant",
     "contradicts metadata"),
])
def test_refusals_name_file_and_key(files, name, edit, form, key, problem):
    path = _edited(files, f"{name}.safetensors", edit, form)
    with pytest.raises(CheckpointError, match=re.escape(problem)) as e:
        inspect_video_vae(path, parts="decoder")
    assert e.value.file == path and e.value.key == key


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_is_refused_at_load(files, bad):
    def edit(sd, m):
        sd[QKV + ".weight_scale"][3, 0] = bad
    path = _edited(files, f"scale_{bad}.safetensors", edit)
    inspect_video_vae(path, parts="decoder")  # the header is fine: the values are read at load
    with pytest.raises(CheckpointError, match="holds 1 NaN|holds 0 NaN and 1 Inf") as e:
        load_video_vae(path, None, torch.float16, parts="decoder")
    assert e.value.file == path and e.value.key == QKV + ".weight_scale"


def test_release_size_inventory(tmp_path):
    """The H3-size int8 file, from its header (a sparse file: tensor data are holes, only the descriptors are
    written): the layout ComfyUI ships (the decoder blocks' 144 linears int8 ConvRot g256, every other tensor
    fp16) reads as the release geometry."""
    path = write_release_video_vae(tmp_path / "minimax_h3_video_vae_int8_convrot.safetensors", int8=True)
    info = inspect_video_vae(str(path), parts="decoder")
    assert info.cfg == VideoVAEConfig.full() and info.storage == "int8_convrot" and len(info.quant) == 144
    assert {s.groupsize for s in info.quant.values()} == {256}
    size = path.stat().st_size
    print(f"H3 int8 ConvRot video VAE inventory: {size / 2**30:.3f} GiB")
    assert 2.55 < size / 2**30 < 2.65  # published as 2.62 GB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dequantised_on_the_gpu_equals_the_cpu(files):
    cpu = load_video_vae(files["int8"], None, torch.float16, parts="decoder").state_dict()
    gpu = load_video_vae(files["int8"], None, torch.float16, device="cuda", parts="decoder").state_dict()
    assert all(torch.equal(gpu[k].cpu(), cpu[k]) for k in cpu)
