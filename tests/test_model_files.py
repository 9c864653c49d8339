"""Model files whose headers are fine and whose data is not (docs/checkpoints.md, "What the data must hold").

Weights never hold a NaN or an Inf (checked per tensor as they load, named by file and key); a LoRA likewise at
admission; a stage whose own result is not finite fails the job with INTERNAL naming the stage and the step, and
passes nothing on; the VAEs' normalisation buffers and filters are checked against their definitions (and the
config.json) before a stage serves; two candidate files in --models-dir are refused naming both. Corrupt files are
written from the tiny models and, where a layout comes from diffusers, exported by diffusers itself (the oracle).
Process tests start the real servers on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from client.embedded import EmbeddedStack, StackConfig
from decoder_svc.engine import AUDIO_EXCLUDE, AUDIO_PATTERNS, VIDEO_EXCLUDE, VIDEO_PATTERNS
from dit_svc.engine import CHECKPOINT_EXCLUDE, CHECKPOINT_PATTERNS, embedded_config
from encoder_svc.engine import CHECKPOINT_PATTERNS as TE_PATTERNS
from minimax_h3.contract import SAMPLE_OUTPUTS, RenderSpec, tensor_shapes
from minimax_h3.dit.checkpoint import check_checkpoint, load_dit_weights
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.lora import LoRAFileError, check_lora_file, config_targets
from minimax_h3.dit.sampling import SamplerConfig, sample as run_sampler
from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
from minimax_h3.files import EMBEDDED_VERSION, find_checkpoint
from minimax_h3.services import Endpoints, StageClients
from minimax_h3.text.checkpoint import TextEncoderCheckpoint
from minimax_h3.text.conditioner import ConditionerConfig
from minimax_h3.text.tiny import write_tiny_model
from minimax_h3.vae.audio import AudioVAEConfig, inspect_audio_vae, load_audio_vae, write_tiny_audio_vae
from minimax_h3.vae.video import (LATENTS_STD, VideoVAEConfig, inspect_video_vae, load_video_vae,
                                  write_tiny_video_vae)
from render_svc.stage_calls import decode_raw, sample
from stagekit.checkpoints import (CheckpointError, FiniteCheck, TensorReader, nonfinite_flag, open_checkpoint)
from stagekit.errors import FailedPrecondition, Internal
from stagekit.wire import check_result
from tests.conftest import SERVER_ENV
from tests.safetensors_files import rewrite_tensors

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
GOOD = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=5)
TEXT = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))


def poisoned(src: Path, dst: Path, key: str, value: float = NAN, index: int = 3) -> Path:
    def edit(sd):
        t = sd[key].clone()
        t.view(-1)[index] = value
        sd[key] = t
    return rewrite_tensors(src, dst, edit)


# ---- the check itself -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [None, NAN, INF, -INF])
def test_nonfinite_flag_every_float_dtype(dtype, bad):
    t = torch.randn(4097)
    if bad is not None:
        t[4000] = bad
    t = t.to(dtype)
    stored = not bool(torch.isfinite(t.float()).all())  # e4m3fn has no Inf: torch's cast saturates to 448
    assert stored == (bad is not None) or (dtype == torch.float8_e4m3fn and abs(bad) == INF)
    assert bool(nonfinite_flag(t)) == stored
    assert nonfinite_flag(torch.ones(3, dtype=torch.int8)) is None and nonfinite_flag(torch.empty(0)) is None


def test_finite_check_names_the_first_bad_tensor_once():
    check = FiniteCheck()
    check.add("a.safetensors", "ok", torch.ones(5))
    check.add("a.safetensors", "blocks.0.weight_scale", torch.tensor([1.0, NAN]).to(torch.bfloat16))
    check.add("b.safetensors", "later", torch.tensor([INF]))
    with pytest.raises(CheckpointError, match=r"^a.safetensors: blocks.0.weight_scale: holds 1 NaN and 0 Inf") as e:
        check.raise_if_bad()
    assert e.value.key == "blocks.0.weight_scale"
    check.raise_if_bad()  # the flags were consumed


def test_tensor_reader_refuses_nan_naming_file_and_key(tmp_path):
    p = tmp_path / "w.safetensors"
    save_file({"good": torch.ones(8, 4), "bad": torch.tensor([[1.0, 2.0], [INF, 0.0]])}, str(p))
    entries = open_checkpoint(p).tensors
    reader = TensorReader(entries)
    assert torch.equal(reader.whole("good"), torch.ones(8, 4))
    assert reader.rows("bad", 0, 1).tolist() == [[1.0, 2.0]]  # a rank's slice is checked as read: this one is fine
    with pytest.raises(CheckpointError, match=rf"^{p}: bad: holds 0 NaN and 1 Inf"):
        reader.rows("bad", 1, 2)
    assert TensorReader(entries, check_finite=False).whole("bad").isinf().any()  # a device loader checks itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_finite_check_on_the_device():
    check = FiniteCheck()
    for i in range(50):
        check.add("f", f"t{i}", torch.randn(1000, device="cuda").to(torch.bfloat16))
    bad = torch.randn(1000, device="cuda")
    bad[999] = NAN
    check.add("f", "bad", bad)
    with pytest.raises(CheckpointError, match="f: bad: holds 1 NaN"):
        check.raise_if_bad()


def test_check_result_names_stage_tensor_and_unit():
    check_result("decoder", "frames", torch.zeros(3, 5, 2, 2), "frame", axis=1)
    t = torch.zeros(3, 5, 2, 2)
    t[1, 3, 0, 1] = NAN
    with pytest.raises(Internal, match=r"^decoder: its result frames holds 1 NaN/Inf value\(s\), first at frame 3 "
                                       r"of 5; a server fault"):
        check_result("decoder", "frames", t, "frame", axis=1)


# ---- DiT ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cfg() -> DiTConfig:
    return DiTConfig.tiny(num_layers=2, num_refiner_layers=1)


@pytest.mark.parametrize("variant,key", [("bf16", "blocks.1.mlp.fc2.weight"),
                                         ("int8_convrot", "blocks.0.attn.qkv_proj.weight_scale"),
                                         ("int8_convrot_pruned", "adaln_t_table")])
def test_dit_load_refuses_a_nonfinite_weight_naming_file_and_key(tmp_path, tiny_cfg, variant, key):
    good = write_tiny_checkpoint(tiny_cfg, tmp_path / f"minimax_h3_{variant}.safetensors", variant)
    bad = poisoned(good, tmp_path / "bad.safetensors", key)
    cfg = check_checkpoint(bad).config  # the header is fine: start-up passes, the load refuses
    load_dit_weights(good, cfg, workers=2)
    with pytest.raises(CheckpointError, match=rf"^{bad}: {key}: holds 1 NaN and 0 Inf"):
        load_dit_weights(bad, cfg, workers=2)


def test_dit_refuses_a_tampered_rope_buffer_at_startup(tmp_path, tiny_cfg):
    good = write_tiny_checkpoint(tiny_cfg, tmp_path / "good.safetensors")
    bad = rewrite_tensors(good, tmp_path / "bad.safetensors", lambda sd: sd.__setitem__("rope.inv_freq",
                                                                                      sd["rope.inv_freq"] * 1.01))
    check_checkpoint(good)
    with pytest.raises(CheckpointError, match=r"rope.inv_freq: differs from 1 / rope_theta"):
        check_checkpoint(bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dit_converted_whole_to_fp16_or_bf16_starts_and_loads(tmp_path, tiny_cfg, dtype):
    """A DiT cast to fp16 / bf16 as a whole stores rope.inv_freq rounded to that dtype: it is compared with the
    formula at the file's own rounding, and another RoPE (a different rope_theta) is still refused."""
    good = write_tiny_checkpoint(tiny_cfg, tmp_path / "minimax_h3_fl2va_bf16.safetensors")
    whole = rewrite_tensors(good, tmp_path / "minimax_h3_fl2va_whole.safetensors",
                            lambda sd: sd.update({k: v.to(dtype) for k, v in sd.items() if v.is_floating_point()}))
    info = check_checkpoint(whole)
    assert info.variant.name == {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    assert load_dit_weights(whole, info.config)["rope.inv_freq"].dtype == torch.float32
    theta = tiny_cfg.rope_theta * 2
    other = 1.0 / theta ** (torch.arange(0, 2 * tiny_cfg.rope_freq_dim, 2, dtype=torch.float64)
                            / (2 * tiny_cfg.rope_freq_dim))
    bad = rewrite_tensors(whole, tmp_path / "bad.safetensors",
                          lambda sd: sd.__setitem__("rope.inv_freq", other.to(dtype)))
    with pytest.raises(CheckpointError, match=r"rope.inv_freq: differs from 1 / rope_theta"):
        check_checkpoint(bad)


def test_sampler_names_the_first_step_whose_latents_are_not_finite():
    cfg = SamplerConfig(steps=6)
    calls = []

    def denoise(x, xa, tv, ta):
        calls.append(1)
        bad = len(calls) >= 4  # the model's output goes bad at step 4
        return (torch.full_like(x, NAN) if bad else torch.zeros_like(x)), torch.zeros_like(xa)

    with pytest.raises(Internal, match=r"^dit: the sampled latents hold NaN/Inf from step 4 of 6 on"):
        run_sampler(denoise, torch.randn(4, 8), torch.randn(2, 8), cfg)
    v, a = run_sampler(lambda x, xa, tv, ta: (torch.zeros_like(x), torch.zeros_like(xa)), torch.randn(4, 8),
                       torch.randn(2, 8), cfg)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()


def _lora(cfg: DiTConfig, bad: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    down = torch.randn(2, cfg.hidden, generator=g) * 0.1
    up = torch.randn(cfg.video_patch_dim, 2, generator=g) * 0.1
    if bad is not None:
        up[1, 1] = bad
    return {"diffusion_model.final_layer.video_out.lora_A.weight": down,
            "diffusion_model.final_layer.video_out.lora_B.weight": up}


def test_lora_with_a_nonfinite_factor_is_refused_at_admission(tmp_path, tiny_cfg):
    targets = config_targets(tiny_cfg)
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file(_lora(tiny_cfg), str(good))
    save_file(_lora(tiny_cfg, INF), str(bad))
    assert check_lora_file(good, targets) == 1
    with pytest.raises(LoRAFileError, match=rf"^LoRA {bad}: diffusion_model.final_layer.video_out.lora_B.weight: holds "
                                        r"0 NaN and 1 Inf"):
        check_lora_file(bad, targets)


@pytest.mark.parametrize("variant,suffix", [("bf16", "weight"), ("nvfp4_awq", "weight_scale")])
def test_text_encoder_refuses_a_nonfinite_weight_or_scale(tmp_path, variant, suffix):
    good = write_tiny_model(tmp_path / "te", variant=variant)
    key = next(k for k in open_checkpoint(good).tensors if ".layers.0.mlp.down_proj." in k and k.endswith(suffix))
    bad = poisoned(good, good.parent / "bad.safetensors", key)
    good.unlink()
    ckpt = TextEncoderCheckpoint(bad, ConditionerConfig.tiny())  # the header is fine
    with pytest.raises(CheckpointError, match=rf"^{bad}: {key}: holds 1 NaN"):
        ckpt.read_layer(0)


# ---- VAEs: normalisation buffers and filters, before SERVING --------------------------------------------------------
@pytest.fixture(scope="module")
def video_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("vvae") / "minimax_h3_video_vae.safetensors"
    write_tiny_video_vae(str(p), VideoVAEConfig.tiny(), 0)
    return p


@pytest.fixture(scope="module")
def audio_file(tmp_path_factory) -> Path:
    return write_tiny_audio_vae(tmp_path_factory.mktemp("avae") / "minimax_h3_audio_vae.safetensors",
                                AudioVAEConfig.tiny(), 0)


def test_video_vae_zero_std_in_the_file_is_refused_at_inspect(tmp_path, video_file):
    inspect_video_vae(str(video_file), parts="decoder")
    bad = rewrite_tensors(video_file, tmp_path / "v.safetensors",
                          lambda sd: sd.__setitem__("latents_std", torch.zeros_like(sd["latents_std"])))
    with pytest.raises(CheckpointError, match=r"latents_std: channel 0 is 0.0: a standard deviation must be > 0"):
        inspect_video_vae(str(bad), parts="decoder")
    nan = poisoned(video_file, tmp_path / "n.safetensors", "latents_mean")
    with pytest.raises(CheckpointError, match=r"latents_mean: holds 1 NaN"):
        inspect_video_vae(str(nan), parts="decoder")


def _diffusers_video_folder(d: Path, cfg: VideoVAEConfig, **config) -> Path:
    """A video_vae/ folder as diffusers' own save_pretrained writes it (config.json + weights)."""
    diffusers = pytest.importorskip("diffusers")
    ora = diffusers.AutoencoderKLMiniMaxH3(
        latent_channels=cfg.latent_channels, block_out_channels=cfg.block_channels,
        layers_per_block=cfg.num_res_blocks, norm_num_groups=cfg.norm_groups, decoder_num_layers=cfg.dec_layers,
        decoder_num_attention_heads=cfg.dec_heads, decoder_attention_head_dim=cfg.dec_head_dim,
        decoder_num_register_tokens=cfg.dec_registers, **config)
    ora.save_pretrained(str(d))
    return d


def test_video_vae_config_json_and_file_must_agree(tmp_path):
    cfg = VideoVAEConfig.tiny()
    zeros = _diffusers_video_folder(tmp_path / "zeros", cfg, latents_std=[0.0] * cfg.latent_channels)
    with pytest.raises(CheckpointError, match=r"config.json: latents_std: channel 0 is 0.0"):
        inspect_video_vae(str(zeros))
    folder = _diffusers_video_folder(tmp_path / "video_vae", cfg, latents_std=list(LATENTS_STD))
    assert inspect_video_vae(str(folder)).latents_std == pytest.approx(LATENTS_STD)
    weights = next(folder.glob("*.safetensors"))
    rewrite_tensors(weights, weights, lambda sd: sd.__setitem__("latents_std", torch.tensor(LATENTS_STD) * 1.3))
    with pytest.raises(CheckpointError) as e:
        inspect_video_vae(str(folder))
    assert str(weights) in e.value.message and str(folder / "config.json") in e.value.message
    assert "latents_std: contradicts latents_std in" in e.value.message


@pytest.mark.parametrize("key,edit,needle", [
    ("decoder.resblocks.0.activations.1.upsample.filter", lambda t: t.flip(-1) * 1.0001,
     "stored Kaiser-sinc filter differs from the formula"),
    ("latents_std", torch.zeros_like, "latents_std: channel 0 is 0.0"),
    ("pre_block.attn.zero_k_bias", torch.ones_like, "must be all zeros"),
    ("latents_mean", lambda t: t.fill_(INF), "latents_mean: holds 0 NaN and 32 Inf"),
])
def test_audio_vae_buffers_checked_at_inspect(tmp_path, audio_file, key, edit, needle):
    inspect_audio_vae(audio_file)
    bad = rewrite_tensors(audio_file, tmp_path / "a.safetensors", lambda sd: sd.__setitem__(key, edit(sd[key].clone())))
    with pytest.raises(CheckpointError, match=needle):
        inspect_audio_vae(bad)  # the start-up check, not the first job's load


def test_video_vae_nan_weight_refused_at_load(tmp_path, video_file):
    bad = poisoned(video_file, tmp_path / "v.safetensors", "decoder.x_embedder.weight")
    inspect_video_vae(str(bad), parts="decoder")  # headers and buffers are fine: it starts
    with pytest.raises(CheckpointError, match=rf"^{bad}: decoder.x_embedder.weight: holds 1 NaN"):
        load_video_vae(str(bad), parts="decoder")


def test_audio_vae_nan_weight_refused_at_load(tmp_path, audio_file):
    bad = poisoned(audio_file, tmp_path / "a.safetensors", "decoder.conv_pre.weight")
    with pytest.raises(CheckpointError, match=r"decoder.conv_pre.weight: holds 1 NaN"):
        load_audio_vae(bad, with_encoder=False)


# ---- --models-dir: one candidate per stage --------------------------------------------------------------------------
def _touch(root: Path, *names: str) -> None:
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(b"")


def test_comfyui_folder_resolves_one_file_per_stage(tmp_path):
    _touch(tmp_path, "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors",
           "diffusion_models/minimax_h3_ref2va_pruned_int8_convrot.safetensors",  # another model: told apart by name
           "text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors",
           "vae/minimax_h3_video_vae_fp16.safetensors", "vae/minimax_h3_audio_vae_fp32.safetensors",
           "loras/minimax_h3_style_lora.safetensors",
           "loras/minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors")  # a LoRA's folder: not a checkpoint
    assert find_checkpoint(tmp_path, CHECKPOINT_PATTERNS, "DiT", CHECKPOINT_EXCLUDE).name == \
        "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    assert find_checkpoint(tmp_path, TE_PATTERNS, "TE").parent.name == "text_encoders"
    assert "video" in find_checkpoint(tmp_path, VIDEO_PATTERNS, "video VAE", VIDEO_EXCLUDE).name
    assert "audio" in find_checkpoint(tmp_path, AUDIO_PATTERNS, "audio VAE", AUDIO_EXCLUDE).name
    os.symlink(tmp_path / "vae/minimax_h3_audio_vae_fp32.safetensors", tmp_path / "minimax_h3_audio_vae.safetensors")
    assert "audio" in find_checkpoint(tmp_path, AUDIO_PATTERNS, "audio VAE", AUDIO_EXCLUDE).name  # a link is one file


def test_diffusers_pipeline_folder_resolves_one_folder_per_stage(tmp_path):
    _touch(tmp_path, *(f"MiniMax-H3/{d}/diffusion_pytorch_model.safetensors"
                       for d in ("transformer", "text_encoder", "video_vae", "audio_vae")))
    assert find_checkpoint(tmp_path, CHECKPOINT_PATTERNS, "DiT", CHECKPOINT_EXCLUDE).name == "transformer"
    assert find_checkpoint(tmp_path, TE_PATTERNS, "TE").name == "text_encoder"
    assert find_checkpoint(tmp_path, VIDEO_PATTERNS, "video VAE", VIDEO_EXCLUDE).name == "video_vae"
    assert find_checkpoint(tmp_path, AUDIO_PATTERNS, "audio VAE", AUDIO_EXCLUDE).name == "audio_vae"


def test_two_candidates_are_refused_naming_both_and_the_flag(tmp_path):
    _touch(tmp_path, "a/minimax_h3_fl2va_int8_convrot.safetensors", "b/minimax_h3_fl2va_bf16.safetensors")
    with pytest.raises(FailedPrecondition) as e:
        find_checkpoint(tmp_path, CHECKPOINT_PATTERNS, "MiniMax-H3 DiT checkpoint", CHECKPOINT_EXCLUDE)
    msg = e.value.message
    assert "2 candidate MiniMax-H3 DiT checkpoints" in msg and "--weights" in msg
    assert "a/minimax_h3_fl2va_int8_convrot.safetensors" in msg and "b/minimax_h3_fl2va_bf16.safetensors" in msg


def test_a_file_inside_a_component_folder_is_one_candidate(tmp_path):
    """A named file in a folder whose name is also a pattern (`transformer/`, `video_vae/`, ...) is one checkpoint,
    not two; so is the embedded text encoder's own cache folder. A folder holding other weights beside the file is
    still a second candidate."""
    _touch(tmp_path / "m", "transformer/minimax_h3_fl2va_bf16.safetensors",
           "video_vae/minimax_h3_video_vae_fp16.safetensors", "audio_vae/minimax_h3_audio_vae_fp32.safetensors")
    m = tmp_path / "m"
    assert find_checkpoint(m, CHECKPOINT_PATTERNS, "DiT", CHECKPOINT_EXCLUDE) == \
        m / "transformer/minimax_h3_fl2va_bf16.safetensors"
    assert find_checkpoint(m, VIDEO_PATTERNS, "video VAE", VIDEO_EXCLUDE).name == "minimax_h3_video_vae_fp16.safetensors"
    assert find_checkpoint(m, AUDIO_PATTERNS, "audio VAE", AUDIO_EXCLUDE).name == "minimax_h3_audio_vae_fp32.safetensors"
    cache = tmp_path / "cache"
    te = write_tiny_model(cache / EMBEDDED_VERSION / "text_encoder")
    assert find_checkpoint(cache, TE_PATTERNS, "text encoder") == te
    TextEncoderCheckpoint(te, ConditionerConfig.tiny()).close()
    _touch(tmp_path / "x", "transformer/minimax_h3_fl2va_bf16.safetensors",
           "transformer/diffusion_pytorch_model.safetensors")
    with pytest.raises(FailedPrecondition, match="2 candidate DiTs"):
        find_checkpoint(tmp_path / "x", CHECKPOINT_PATTERNS, "DiT", CHECKPOINT_EXCLUDE)


# ---- through the real servers ---------------------------------------------------------------------------------------
def _start_fails(args: list[str], tmp_path: Path) -> str:
    r = subprocess.run([sys.executable, "-m", *args, "--port", "0", "--devices", "virt0", "--lease-dir",
                        str(tmp_path / "leases")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **SERVER_ENV})
    assert r.returncode != 0 and "serving on" not in r.stdout, r.stdout + r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_startup_refusals_of_every_stage(tmp_path, model_cache, video_file, audio_file):
    models = tmp_path / "models"
    _touch(models, "diffusion_models/minimax_h3_fl2va_int8_convrot.safetensors",
           "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors",
           "text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors",
           "text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors")
    line = _start_fails(["dit_svc", "--models-dir", str(models)], tmp_path)
    assert line.startswith("dit: cannot start:") and "2 candidate" in line and "--weights" in line
    assert "fl2va_int8_convrot" in line and "fl2va_pruned_int8_convrot" in line
    line = _start_fails(["encoder_svc", "--models-dir", str(models)], tmp_path)
    assert line.startswith("encoder: cannot start:") and "int8_convrot" in line and "nvfp4_awq" in line, line

    zero_std = rewrite_tensors(video_file, tmp_path / "v.safetensors",
                               lambda sd: sd.__setitem__("latents_std", torch.zeros_like(sd["latents_std"])))
    line = _start_fails(["decoder_svc", "--video-weights", str(zero_std), "--audio-weights", str(audio_file)],
                        tmp_path)
    assert line.startswith("decoder: cannot start:") and f"{zero_std}: latents_std: channel 0 is 0.0" in line
    key = "decoder.resblocks.0.activations.0.downsample.lowpass.filter"
    tampered = rewrite_tensors(audio_file, tmp_path / "a.safetensors", lambda sd: sd.__setitem__(key, sd[key] * 1.01))
    line = _start_fails(["decoder_svc", "--video-weights", str(video_file), "--audio-weights", str(tampered)],
                        tmp_path)
    assert f"{tampered}: {key}: stored Kaiser-sinc filter differs from the formula" in line


def _dit_server(tmp_path: Path, cache: Path, weights: Path, extra=()) -> EmbeddedStack:
    s = EmbeddedStack(StackConfig(ranks={"dit": 1}, cache_dir=str(cache), run_dir=str(tmp_path / "run"),
                                  devices="virt0", env=SERVER_ENV, lease_dir=str(tmp_path / "leases"),
                                  extra_args={"dit": ["--weights", str(weights), *extra]}))
    s.start_stage("dit")
    s.wait_ready("dit")
    return s


def _clients(s: EmbeddedStack) -> StageClients:
    return StageClients(Endpoints(**{n: f"127.0.0.1:{s.ports['dit']}" for n in ("encoder", "dit", "decoder")}))


def test_dit_never_sends_nonfinite_latents_and_refuses_a_nan_lora(tmp_path, model_cache):
    """Finite weights that overflow (3e38 in the fp32 video head): the sampled latents are Inf from step 1, and the
    DiT fails the job with INTERNAL naming the step instead of sending them to the decoder. A LoRA with an Inf is
    refused at admission with FAILED_PRECONDITION naming its file and key (a file of the server's: the operator
    replaces it, the caller cannot)."""
    cfg = embedded_config()
    good = write_tiny_checkpoint(cfg, tmp_path / "minimax_h3_tiny.safetensors", "bf16", seed=0)
    huge = rewrite_tensors(good, tmp_path / "huge.safetensors", lambda sd: sd.__setitem__(
        "final_layer.video_out.weight", torch.full_like(sd["final_layer.video_out.weight"], 3e38)))
    loras = tmp_path / "loras"
    loras.mkdir()
    save_file(_lora(cfg, NAN), str(loras / "nan.safetensors"))
    s = _dit_server(tmp_path, model_cache, huge, ["--loras-dir", str(loras)])
    try:
        c = _clients(s)
        with pytest.raises(grpc.RpcError) as e:
            sample(c, GOOD, TEXT, timeout_s=120)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "dit: the sampled latents hold NaN/Inf from step 1 of 2 on" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            sample(c, GOOD, TEXT, timeout_s=120, loras=[("nan", 1.0)])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{loras / 'nan.safetensors'}: diffusion_model.final_layer.video_out.lora_B.weight: holds 1 NaN" \
            in e.value.details()
    finally:
        s.stop()


def test_dit_nan_weight_fails_the_job_naming_file_and_key(tmp_path, model_cache):
    cfg = embedded_config()
    good = write_tiny_checkpoint(cfg, tmp_path / "minimax_h3_tiny.safetensors", "bf16", seed=0)
    bad = poisoned(good, tmp_path / "nan.safetensors", "blocks.0.mlp.fc1.weight")
    s = _dit_server(tmp_path, model_cache, bad)  # headers are fine: it serves
    try:
        with pytest.raises(grpc.RpcError) as e:
            sample(_clients(s), GOOD, TEXT, timeout_s=120)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{bad}: blocks.0.mlp.fc1.weight: holds 1 NaN and 0 Inf" in e.value.details()
    finally:
        s.stop()


def test_decoder_never_muxes_nonfinite_frames(tmp_path, model_cache, audio_file):
    """Finite video VAE weights that overflow (3e38 in the first projection): the decoded frames are NaN, and the
    decoder fails the job with INTERNAL naming the frame: a server fault, never the client's (INVALID_ARGUMENT)."""
    good = tmp_path / "minimax_h3_video_vae.safetensors"
    write_tiny_video_vae(str(good), replace(VideoVAEConfig.tiny(), tiling=False), 0, dtype=torch.float32)
    key = "decoder.x_embedder.weight"
    huge = rewrite_tensors(good, tmp_path / "huge.safetensors",
                           lambda sd: sd.__setitem__(key, torch.full_like(sd[key], 3e38)))
    s = EmbeddedStack(StackConfig(ranks={"decoder": 1}, cache_dir=str(model_cache), run_dir=str(tmp_path / "run"),
                                  devices="virt0", env=SERVER_ENV, lease_dir=str(tmp_path / "leases"),
                                  extra_args={"decoder": ["--video-weights", str(huge), "--audio-weights",
                                                          str(audio_file)]}))
    s.start_stage("decoder")
    s.wait_ready("decoder")
    try:
        g = torch.Generator().manual_seed(0)
        latents = {n: torch.randn(shape, generator=g) for n, shape in tensor_shapes(SAMPLE_OUTPUTS, GOOD).items()}
        c = StageClients(Endpoints(**{n: f"127.0.0.1:{s.ports['decoder']}" for n in ("encoder", "dit", "decoder")}))
        with pytest.raises(grpc.RpcError) as e:
            decode_raw(c, GOOD, latents["video_latents"], latents["audio_latents"], timeout_s=120)
        assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        assert "decoder: its result video frames (video VAE decode) holds" in e.value.details()
        assert "first at frame 0 of 22;" in e.value.details()
    finally:
        s.stop()


def test_config_json_stats_must_be_finite(tmp_path):
    cfg = VideoVAEConfig.tiny()
    folder = _diffusers_video_folder(tmp_path / "video_vae", cfg)
    doc = json.loads((folder / "config.json").read_text())
    doc["latents_mean"] = [NAN] * cfg.latent_channels
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"config.json: latents_mean: holds a NaN or an Inf"):
        inspect_video_vae(str(folder))
