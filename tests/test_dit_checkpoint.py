"""DiT checkpoint loading: variant detection, config inference, per-rank slices, header validation."""

import json
import struct
from pathlib import Path

import pytest
import torch

from minimax_h3.dit.checkpoint import CheckpointError, inspect_checkpoint, load_adaln, load_dit_weights
import minimax_h3.dit.checkpoint as ck
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import DIFFUSERS_NAMES, to_diffusers
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.tp import TPConfigError
from minimax_h3.dit.tiny_checkpoint import (
                                            adaln_curve,
                                            dense_state_dict,
                                            save_state_dict,
                                            tiny_state_dict,
                                            write_random_int8_convrot_checkpoint,
                                            write_tiny_checkpoint,
                                            write_tiny_diffusers_dir,
                                            write_tiny_release_dir,
                                            )
import minimax_h3.dit.tp as tp
from minimax_h3.kernels.int8 import Int8ConvRotLinear, QuantizedWeight
import stagekit.checkpoints as toolkit

CFG = DiTConfig.tiny()
CURVE = CFG.replace(adaln_form="curve")
VARIANTS = ("bf16", "int8_convrot", "int8_convrot_pruned")


def cfg_for(variant: str) -> DiTConfig:
    return CURVE if variant == "int8_convrot_pruned" else CFG


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dit_ckpts")
    paths = {v: write_tiny_checkpoint(CFG, root / f"tiny_{v}.safetensors", v, seed=7) for v in VARIANTS}
    paths["diffusers"] = write_tiny_diffusers_dir(CFG, root / "diffusers", seed=7)
    paths["release"] = write_tiny_release_dir(CFG, root / "release", seed=7)
    return paths


# ---- detection + inference (header only) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,variant",
    [("bf16", "bf16"), ("int8_convrot", "int8_convrot"), ("int8_convrot_pruned", "int8_convrot_pruned"),
     ("diffusers", "diffusers_bf16"), ("release", "release_bf16")],
)
def test_detect_variant_and_infer_config(ckpts, name, variant, monkeypatch):
    monkeypatch.setattr(toolkit, "safe_open", None)  # detection must not open tensors at all
    info = inspect_checkpoint(ckpts[name], base=CFG)
    assert info.variant.name == variant
    assert info.config == cfg_for(name)


def test_inferred_config_without_base(ckpts):
    # Everything except patch split / rope_theta / eps comes from shapes; the tiny file uses the defaults for those.
    assert inspect_checkpoint(ckpts["int8_convrot"]).config == CFG


def test_diffusers_writer_matches_diffusers_converter():
    """Oracle: diffusers' own single-file converter applied to our bf16 state dict gives our diffusers dir."""
    utils = pytest.importorskip("diffusers.loaders.single_file_utils")
    sd = tiny_state_dict(CFG, "bf16", seed=7)
    config = {"num_attention_heads": CFG.num_heads, "attention_head_dim": CFG.head_dim}
    oracle = utils.convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(sd), config)
    ours = to_diffusers(sd)
    assert set(ours) == set(oracle)
    assert all(torch.equal(ours[k], oracle[k]) for k in ours)


@pytest.mark.parametrize("layout", ["diffusers", "release"])
def test_other_layouts_load_equal_to_comfy(ckpts, layout):
    ref = load_dit_weights(ckpts["bf16"], CFG)
    got = load_dit_weights(ckpts[layout], CFG)
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_dtypes_follow_precision_contract(ckpts):
    w = load_dit_weights(ckpts["int8_convrot_pruned"], CURVE, dtype=torch.bfloat16)
    assert w["video_patch_proj.weight"].dtype == torch.float32
    assert w["condition_proj.weight"].dtype == torch.bfloat16
    assert w["blocks.0.adaln_proj.linear.weight"].dtype == torch.float32  # curve AdaLN runs in fp32
    assert isinstance(w["blocks.0.attn.qkv_proj.weight"], QuantizedWeight)


def test_pruned_curve_reproduces_mlp_adaln():
    dense = dense_state_dict(CFG, seed=7)
    pruned = tiny_state_dict(CFG, "int8_convrot_pruned", seed=7)
    curve = adaln_curve(dense, CFG)
    for p in ("blocks.1.adaln_proj.linear", "final_layer.adaln_proj.linear"):
        ref = curve @ dense[f"{p}.weight"].double().T + dense[f"{p}.bias"].double()
        got = pruned["adaln_t_table"].double() @ pruned[f"{p}.weight"].double().T + pruned[f"{p}.bias"].double()
        assert float((got - ref).norm() / ref.norm()) < 2e-3  # measured ~2e-4 (fp16 storage + rank-8 cut)


# ---- per-rank slices ---------------------------------------------------------------------------------------------


def style(key: str):
    return tp.param_style(H3DiT._tp_plan, key)


def reference_slice(key: str, full: torch.Tensor, cfg: DiTConfig, r: int, n: int) -> torch.Tensor:
    """The TP layout written out independently of the loader, from the model's plan."""
    s = style(key)
    if isinstance(s, tp.ColumnParallel):  # each section (q/k/v, gate/value, or all rows) cut into n parts
        return full.reshape(s.sections, n, -1, *full.shape[1:])[:, r].reshape(-1, *full.shape[1:])
    if isinstance(s, tp.RowParallel) and key.endswith(".weight"):
        m = full.shape[1] // n
        return full[:, r * m : (r + 1) * m]
    return full


@pytest.mark.parametrize("variant", VARIANTS + ("diffusers", "release"))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_rank_slices_equal_slicing_the_full_tensor(ckpts, variant, n):
    cfg = cfg_for(variant)
    full = load_dit_weights(ckpts[variant], cfg, quant_mode="kernel", dtype=torch.float32)
    for r in range(n):
        part = load_dit_weights(ckpts[variant], cfg, r, n, quant_mode="kernel", dtype=torch.float32)
        assert set(part) == set(full)
        for key, value in part.items():
            f = full[key]
            if isinstance(value, QuantizedWeight):
                assert torch.equal(value.qdata, reference_slice(key, f.qdata, cfg, r, n)), key
                scale = f.scale if isinstance(style(key), tp.RowParallel) else reference_slice(key, f.scale, cfg, r, n)
                assert torch.equal(value.scale, scale), key
            elif isinstance(f, QuantizedWeight):  # unaligned row-parallel slice: dequantised at load
                assert key in part.dequantized and isinstance(style(key), tp.RowParallel)
                want = reference_slice(key, f.dequantize(torch.float32), cfg, r, n)
                assert torch.allclose(value, want, atol=1e-6), key
            else:
                assert torch.equal(value, reference_slice(key, f, cfg, r, n)), key


def test_unaligned_slices_are_the_only_dequantised_ones(ckpts):
    # tiny linears use ConvRot group 64: out_proj has 64 input columns, fc2 128.
    assert load_dit_weights(ckpts["int8_convrot"], CFG, 0, 1).dequantized == []
    two = load_dit_weights(ckpts["int8_convrot"], CFG, 1, 2).dequantized
    assert two == ["blocks.0.attn.out_proj.weight", "blocks.1.attn.out_proj.weight"]  # 32 cols; fc2 64 is aligned
    everything = load_dit_weights(ckpts["int8_convrot"], CFG, 0, 2, quant_mode="dequant")
    assert not any(isinstance(v, QuantizedWeight) for v in everything.values())
    assert len(everything.dequantized) == 4 * CFG.num_layers + CFG.num_layers  # block linears + block AdaLN


class _SpySafeOpen:
    """Wraps safetensors.safe_open and records what is read: whole tensors and slice results."""

    def __init__(self, real):
        self.real, self.whole, self.sliced = real, [], []

    def __call__(self, *args, **kwargs):
        handle, spy = self.real(*args, **kwargs), self

        class Handle:
            def get_tensor(self, key):
                spy.whole.append(key)
                return handle.get_tensor(key)

            def get_slice(self, key):
                sl = handle.get_slice(key)

                class Slice:
                    def __getitem__(self, idx):
                        out = sl[idx]
                        spy.sliced.append((key, out.numel(), tuple(sl.get_shape())))
                        return out

                return Slice()

        return Handle()


@pytest.mark.parametrize("variant", ["int8_convrot", "diffusers", "release"])
def test_only_rank_slices_are_read(ckpts, variant, monkeypatch):
    spy = _SpySafeOpen(toolkit.safe_open)
    monkeypatch.setattr(toolkit, "safe_open", spy)
    n = 4
    load_dit_weights(ckpts[variant], cfg_for(variant), 3, n)
    sharded = [k for k in spy.whole if k.endswith(".weight") and style(DIFFUSERS_NAMES.from_source(k)) is not None
               or ".attn.to_" in k or ".ff.net." in k]
    assert sharded == [], f"whole-tensor reads of sharded keys: {sharded}"
    assert spy.sliced
    for key, numel, shape in spy.sliced:
        total = torch.Size(shape).numel()
        # A slice is 1/n of the tensor (or 1/n of one section); superset reads for unaligned int8 columns are
        # at most one ConvRot group wider.
        assert numel <= total // n + shape[0] * 64, (key, numel, total)


def test_load_adaln_int8_group(ckpts):
    w = load_adaln(ckpts["int8_convrot"], CFG, 1, tp_rank=1, tp_size=2)
    qw = w["blocks.1.adaln_proj.linear.weight"]
    assert set(w) == {"blocks.1.adaln_proj.linear.weight", "blocks.1.adaln_proj.linear.bias"}
    assert isinstance(qw, QuantizedWeight) and qw.groupsize == 16  # tiny time_embed_dim 32 -> group 16 (full: 64)
    assert qw.shape == (CFG.adaln_out // 2, CFG.time_embed_dim)
    dense = load_adaln(ckpts["bf16"], CFG, 1, tp_rank=1, tp_size=2)["blocks.1.adaln_proj.linear.weight"]
    err = (qw.dequantize(torch.float32) - dense.float()).norm() / dense.float().norm()
    assert err < 1e-2


def test_flatten_feeds_int8_linear(ckpts):
    w = load_dit_weights(ckpts["int8_convrot"], CFG, 0, 2)
    flat = ck.flatten_state_dict(w)
    assert flat["blocks.0.attn.qkv_proj.weight"].dtype == torch.int8
    layer = Int8ConvRotLinear(CFG.hidden, 3 * CFG.attn_inner // 2, groupsize=64, mode="dequant")
    layer.load_state_dict({"weight": flat["blocks.0.attn.qkv_proj.weight"],
                           "weight_scale": flat["blocks.0.attn.qkv_proj.weight_scale"]})
    assert layer(torch.randn(2, CFG.hidden)).shape == (2, 3 * CFG.attn_inner // 2)


def test_full_size_generator_layout_on_tiny_dims(tmp_path):
    for quantize in (True, False):
        p = write_random_int8_convrot_checkpoint(CFG, tmp_path / f"rand_{quantize}.safetensors", quantize=quantize)
        info = inspect_checkpoint(p)
        assert info.variant.name == "int8_convrot" and info.config == CFG
        w = load_dit_weights(p, CFG, quant_mode="dequant", dtype=torch.float32)
        std = float(w["blocks.0.mlp.fc2.weight"].std())
        assert 0.5 < std * CFG.ffn**0.5 < 2.0


# ---- errors ------------------------------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, edit) -> Path:
    sd = tiny_state_dict(CFG, "int8_convrot", seed=7) if "int8" in src.name else tiny_state_dict(CFG, "bf16", seed=7)
    edit(sd)
    return save_state_dict(sd, dst)


def test_truncated_file(ckpts, tmp_path):
    data = ckpts["bf16"].read_bytes()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated.*final_layer.audio_out.bias"):
        load_dit_weights(bad, CFG)
    (tmp_path / "tiny.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        inspect_checkpoint(tmp_path / "tiny.safetensors")


def test_corrupt_header(ckpts, tmp_path):
    data = bytearray(ckpts["bf16"].read_bytes())
    data[20:24] = b"\x00\xff\x00\xff"
    (tmp_path / "corrupt.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        load_dit_weights(tmp_path / "corrupt.safetensors", CFG)
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length"):
        load_dit_weights(tmp_path / "garbage.safetensors", CFG)


def test_missing_extra_and_misshapen_keys_are_named(ckpts, tmp_path):
    def edit(sd):
        del sd["blocks.1.mlp.fc2.weight"]
        del sd["blocks.0.attn.q_norm.weight"]
        sd["blocks.0.lora_A.weight"] = torch.zeros(2, 2)
        sd["blocks.1.norm1.weight"] = torch.ones(CFG.hidden + 1, dtype=torch.bfloat16)
        sd["blocks.0.attn.qkv_proj.weight_scale"] = torch.ones(3, 1)

    bad = _rewrite(ckpts["int8_convrot"], tmp_path / "bad_int8.safetensors", edit)
    with pytest.raises(CheckpointError) as e:
        load_dit_weights(bad, CFG)
    msg = str(e.value)
    assert "2 missing key(s): blocks.0.attn.q_norm.weight, blocks.1.mlp.fc2.weight" in msg
    assert "1 unexpected key(s): blocks.0.lora_A.weight" in msg
    assert "2 misshapen key(s)" in msg and "blocks.1.norm1.weight" in msg and "qkv_proj.weight_scale" in msg


def test_many_missing_keys_are_counted(ckpts):
    with pytest.raises(CheckpointError, match=r"missing key\(s\).*\(\+\d+ more\)") as e:
        load_dit_weights(ckpts["bf16"], CFG.replace(num_layers=4))
    assert "20 missing" in str(e.value)  # blocks 2, 3 x 10 tensors


def test_config_mismatch_and_wrong_form(ckpts):
    with pytest.raises(CheckpointError, match="misshapen.*condition_proj.weight"):
        load_dit_weights(ckpts["bf16"], CFG.replace(text_dim=32))
    with pytest.raises(CheckpointError, match="adaln_form='curve'"):
        load_dit_weights(ckpts["int8_convrot_pruned"], CFG)


def test_missing_comfy_quant_and_bad_tp(ckpts, tmp_path):
    bad = _rewrite(ckpts["int8_convrot"], tmp_path / "noquant_int8.safetensors",
                   lambda sd: sd.pop("blocks.0.mlp.fc1.comfy_quant"))
    with pytest.raises(CheckpointError, match="blocks.0.mlp.fc1.comfy_quant"):
        load_dit_weights(bad, CFG)
    with pytest.raises(TPConfigError, match="TP degree 3 does not divide num_heads=4"):  # the operator's setting
        load_dit_weights(ckpts["bf16"], CFG, 0, 3)
    with pytest.raises(ValueError, match="tp_rank"):
        load_dit_weights(ckpts["bf16"], CFG, 2, 2)


def test_diffusers_dir_problems(ckpts, tmp_path):
    import shutil

    d = tmp_path / "diff"
    shutil.copytree(ckpts["diffusers"], d)
    index = d / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["x"] = "missing-shard.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="missing shard"):
        load_dit_weights(d, CFG)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_dit_weights(tmp_path / "nope", CFG)


def test_not_a_dit_checkpoint(tmp_path):
    p = save_state_dict({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a MiniMax-H3 DiT"):
        inspect_checkpoint(p)


def test_header_parse_is_standard(ckpts):
    """Our streaming writer produces files that safetensors itself reads (8-byte aligned header)."""
    from safetensors.torch import load_file

    sd = load_file(str(ckpts["int8_convrot"]))
    (n,) = struct.unpack("<Q", ckpts["int8_convrot"].read_bytes()[:8])
    assert n % 8 == 0 and sd["blocks.0.attn.qkv_proj.weight"].dtype == torch.int8


def test_comfy_all_in_one_prefix_is_stripped(ckpts, tmp_path):
    sd = {f"model.diffusion_model.{k}": v for k, v in tiny_state_dict(CFG, "int8_convrot", seed=7).items()}
    sd["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4)  # a VAE tensor in the same file
    p = save_state_dict(sd, tmp_path / "aio.safetensors")
    assert inspect_checkpoint(p, CFG).variant.name == "int8_convrot"
    got, ref = load_dit_weights(p, CFG, 1, 2), load_dit_weights(ckpts["int8_convrot"], CFG, 1, 2)
    assert set(got) == set(ref)
    for k, v in ref.items():
        a, b = (got[k].qdata, v.qdata) if isinstance(v, QuantizedWeight) else (got[k], v)
        assert torch.equal(a, b), k


@pytest.mark.parametrize("variant", ["bf16", "int8_convrot", "int8_convrot_pruned"])
def test_rank_slices_match_dit_tp_reference(ckpts, variant):
    """Cross-check against the model side's reference slicer (minimax_h3/dit/tp.py shard_state_dict)."""
    cfg, n = cfg_for(variant), 2
    full = ck.flatten_state_dict(load_dit_weights(ckpts[variant], cfg, dtype=torch.float32))
    for r in range(n):
        part = load_dit_weights(ckpts[variant], cfg, r, n, dtype=torch.float32)
        ref = tp.shard_state_dict(full, cfg, r, n, H3DiT._tp_plan)
        for key, value in ck.flatten_state_dict(part).items():
            if key in part.dequantized:  # unaligned int8 column slice: compare with the dequantised reference
                prefix = key[: -len(".weight")]
                dense = QuantizedWeight(full[key], full[f"{prefix}.weight_scale"], 64).dequantize(torch.float32)
                want = tp.shard_state_dict({key: dense}, cfg, r, n, H3DiT._tp_plan)[key]
                assert torch.allclose(value, want, atol=1e-6), key
            else:
                assert torch.equal(value, ref[key]), key


def assert_same_weights(want: dict, got: dict) -> None:
    """Two loads of DiT weights (`load_dit_weights`) hold the same keys, in the same order, bit for bit."""
    from minimax_h3.kernels.int8 import QuantizedWeight

    assert list(got) == list(want)
    for key, a in want.items():
        b = got[key]
        if isinstance(a, QuantizedWeight):
            assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale) and a.groupsize == b.groupsize
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), key


def test_parallel_load_equals_serial(tmp_path):
    """Reading a rank's tensors on several threads (the GPU swap-in path) gives exactly the serial result."""
    from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(DiTConfig.tiny(), tmp_path / "dit.safetensors", "int8_convrot_pruned")
    assert_same_weights(load_dit_weights(path, None, 1, 2, workers=1), load_dit_weights(path, None, 1, 2, workers=4))
