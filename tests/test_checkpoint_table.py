"""Corrupt-file table: every way a checkpoint can be wrong, each with its exact outcome (docs/checkpoints.md).

A case either loads -- and then gives exactly the reference weights -- or fails at start-up (`check_checkpoint`,
what a stage runs before it reports SERVING) with a CheckpointError whose file and first offending key are the ones
named here, both leading the message. The last tests run real stage processes: a bad file makes `python -m dit_svc`
/ `python -m decoder_svc` exit non-zero with one line naming file and key, and a file that goes bad after start-up
fails the job with FAILED_PRECONDITION, never INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import pytest
import torch

from minimax_h3.dit.checkpoint import METADATA_CONFIG, METADATA_QKV, check_checkpoint, load_dit_weights
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.tiny_checkpoint import (file_metadata, interleave_qkv, save_state_dict, tiny_state_dict,
                                            write_tiny_release_dir)
from minimax_h3.kernels.int8 import QuantizedWeight, encode_comfy_quant
from stagekit.checkpoints import CheckpointError, WeightSource
from stagekit.errors import status_for
from tests.safetensors_files import edit_header

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
CFG = DiTConfig.tiny(num_layers=3)  # three blocks: a first, a middle and a last one to drop
META = file_metadata(CFG)  # config (block count) + q/k/v order, as our writers state them
CFG_ONLY = {METADATA_CONFIG: META[METADATA_CONFIG]}  # block count declared, q/k/v order not
BF16 = tiny_state_dict(CFG, "bf16", seed=5)
INT8 = tiny_state_dict(CFG, "int8_convrot", seed=5)
QKV = "blocks.0.attn.qkv_proj.weight"


def _drop(sd: dict, prefix: str) -> dict:
    return {k: v for k, v in sd.items() if not k.startswith(prefix)}


def _set(sd: dict, **changes) -> dict:
    return {**sd, **{k.replace("__", "."): v for k, v in changes.items()}}


def _interleaved(sd: dict) -> dict:
    return {k: interleave_qkv(v, CFG.num_heads, CFG.head_dim) if k.endswith(".attn.qkv_proj.weight") else v
            for k, v in sd.items()}


def _file(name: str, sd: dict, metadata: dict | None = META) -> Callable[[Path], Path]:
    return lambda d: save_state_dict(sd, d / name, metadata)


def _in_folder(folder: str, name: str, sd: dict, metadata: dict | None = META, config: dict | None = None):
    def build(d: Path) -> Path:
        (d / folder).mkdir()
        save_state_dict(sd, d / folder / name, metadata)
        if config is not None:
            (d / folder / "config.json").write_text(json.dumps(config))
        return d / folder
    return build


def _truncated(n_bytes: int | None = None, keep: int | None = None) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        data = save_state_dict(BF16, d / "full.safetensors", META).read_bytes()
        (d / "cut.safetensors").write_bytes(data[:keep] if keep is not None else data[:-n_bytes])
        return d / "cut.safetensors"
    return build


def _header_edit(edit) -> Callable[[Path], Path]:
    return lambda d: edit_header(save_state_dict(BF16, d / "ok.safetensors", META), d / "edited.safetensors", edit)


def _flip_header_byte(d: Path) -> Path:
    data = bytearray(save_state_dict(BF16, d / "ok.safetensors", META).read_bytes())
    data[20] ^= 0xFF
    (d / "flipped.safetensors").write_bytes(bytes(data))
    return d / "flipped.safetensors"


def _release_folder(d: Path) -> Path:
    return write_tiny_release_dir(CFG, d / "release", seed=5)


def _entry(key: str, **changes):
    def edit(h: dict) -> None:
        h[key].update(changes)
    return edit


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Path]
    fails: tuple[str | None, str] | None = None  # (first offending key or None, message fragment); None = loads
    qkv_layout: str | None = None
    reference: dict | None = None  # what a loading case must give exactly (default: the bf16 weights)
    variant: str | None = None


CASES = [
    # -- loads ----------------------------------------------------------------------------------------------------
    Case("bf16 with metadata", _file("ok.safetensors", BF16), variant="bf16"),
    Case("int8_convrot with metadata", _file("q.safetensors", INT8), reference=INT8, variant="int8_convrot"),
    Case("fp32 conversion: loads, reported as fp32", _file("f32.safetensors", {k: v.float() for k, v in BF16.items()}),
         variant="fp32"),
    # Every tensor cast to fp16 (rope.inv_freq rounded to fp16 too, within one fp16 ulp of its formula): loads with
    # fp16-rounded values, so it is compared with no reference.
    Case("fp16 conversion: loads, reported as fp16", _file("f16.safetensors", {k: v.half() for k, v in BF16.items()}),
         reference={}, variant="fp16"),
    # A same-width float relabel cannot be seen in a header: the file loads (with other values). Documented limit.
    Case("header dtype BF16 -> F16 (same width)", _header_edit(_entry("blocks.1.norm1.weight", dtype="F16")),
         reference={}),
    # -- damaged files --------------------------------------------------------------------------------------------
    Case("truncated by 100 bytes", _truncated(100), ("final_layer.audio_out.bias", "truncated")),
    Case("truncated to 5 bytes", _truncated(keep=5), (None, "no header")),
    Case("header byte flipped", _flip_header_byte, (None, "unreadable safetensors header")),
    Case("header shape +1, data unchanged", _header_edit(_entry("blocks.1.norm1.weight", shape=[65])),
         ("blocks.1.norm1.weight", "needs 130 bytes, the offsets give 128")),
    Case("header dtype F32 -> I32 (same width)", _header_edit(_entry("video_patch_proj.weight", dtype="I32")),
         ("video_patch_proj.weight", "1 key(s) with a wrong dtype: video_patch_proj.weight I32")),
    # -- keys -----------------------------------------------------------------------------------------------------
    Case("dropped first block", _file("d0.safetensors", _drop(BF16, "blocks.0.")), ("blocks.0.attn.qkv_proj.weight",
                                                                                      "10 missing key(s)")),
    Case("dropped middle block", _file("d1.safetensors", _drop(BF16, "blocks.1.")), ("blocks.1.attn.qkv_proj.weight",
                                                                                       "10 missing key(s)")),
    Case("dropped last block", _file("d2.safetensors", _drop(BF16, "blocks.2.")), ("blocks.2.attn.qkv_proj.weight",
                                                                                     "10 missing key(s)")),
    Case("dropped last block, block count not declared",
         _file("d2.safetensors", _drop(BF16, "blocks.2."), {METADATA_QKV: "stacked"}),
         (None, "cannot tell how many blocks")),
    Case("shape +1", _file("s.safetensors", _set(BF16, blocks__1__mlp__fc2__weight=torch.zeros(64, 129,
                                                                                              dtype=torch.bfloat16))),
         ("blocks.1.mlp.fc2.weight", "misshapen key(s): blocks.1.mlp.fc2.weight BF16[64, 129] (expected [64, 128])")),
    Case("shape -1", _file("s.safetensors", _set(BF16, blocks__0__attn__q_norm__weight=torch.ones(15))),
         ("blocks.0.attn.q_norm.weight", "expected [16]")),
    Case("int32 tensor", _file("i.safetensors", _set(BF16, final_layer__video_out__bias=torch.zeros(96,
                                                                                                 dtype=torch.int32))),
         ("final_layer.video_out.bias", "expected a float dtype")),
    Case("int8 tensor no quant format declares",
         _file("i.safetensors", _set(BF16, blocks__1__mlp__fc1__weight=torch.zeros(256, 64, dtype=torch.int8))),
         ("blocks.1.mlp.fc1.weight", "I8[256, 64] (expected a float dtype)")),
    # -- quant metadata -------------------------------------------------------------------------------------------
    Case("comfy_quant not JSON", _file("q.safetensors", _set(INT8, blocks__1__attn__out_proj__comfy_quant=torch.tensor(
        list(b"{not json"), dtype=torch.uint8))), ("blocks.1.attn.out_proj.comfy_quant", "not valid JSON")),
    Case("comfy_quant of an unknown format", _file("q.safetensors", _set(
        INT8, blocks__1__attn__out_proj__comfy_quant=torch.tensor(list(b'{"format": "float8_e4m3fn"}'),
                                                                  dtype=torch.uint8))),
         ("blocks.1.attn.out_proj.comfy_quant", "unsupported comfy_quant format 'float8_e4m3fn'")),
    Case("ConvRot group larger than in_features",
         _file("q.safetensors", _set(INT8, blocks__0__attn__out_proj__comfy_quant=encode_comfy_quant(256))),
         ("blocks.0.attn.out_proj.comfy_quant", "group size 256 does not divide the weight's in_features 64")),
    # -- q/k/v order: stacked [q; k; v] (ComfyUI) vs per-head interleaved (release), in files and folders ----------
    Case("stacked file, no evidence", _file("dit.safetensors", BF16, CFG_ONLY), (QKV, "--qkv-layout stacked")),
    Case("stacked file, --qkv-layout stacked", _file("dit.safetensors", BF16, CFG_ONLY), qkv_layout="stacked"),
    Case("stacked file, ComfyUI repack name", _file("minimax_h3_fl2va_bf16.safetensors", BF16, CFG_ONLY)),
    Case("stacked file with ComfyUI quant markers", _file("dit.safetensors", INT8, CFG_ONLY), reference=INT8),
    Case("ComfyUI file alone in a folder", _in_folder("dit", "minimax_h3_fl2va_bf16.safetensors", BF16, CFG_ONLY)),
    Case("stacked file alone in a folder, no evidence", _in_folder("dit", "model.safetensors", BF16, CFG_ONLY),
         (QKV, "--qkv-layout")),
    Case("interleaved release folder (sharded, release config.json)", _release_folder, variant="release_bf16"),
    Case("interleaved single file, no evidence", _file("merged.safetensors", _interleaved(BF16), CFG_ONLY),
         (QKV, "--qkv-layout interleaved")),
    Case("interleaved single file, --qkv-layout interleaved", _file("merged.safetensors", _interleaved(BF16), CFG_ONLY),
         qkv_layout="interleaved"),
    Case("interleaved single file, metadata says so",
         _file("merged.safetensors", _interleaved(BF16), {**CFG_ONLY, METADATA_QKV: "interleaved"})),
    Case("interleaved file in a folder with the release config.json",
         _in_folder("rel", "model.safetensors", _interleaved(BF16), None,
                    {"num_layers": CFG.num_layers, "token_refiner_num_layers": CFG.num_refiner_layers,
                     "latents_dim": CFG.in_channels})),
    Case("metadata stacked, --qkv-layout interleaved", _file("ok.safetensors", BF16), (None, "contradicts"),
         qkv_layout="interleaved"),
    # -- partition: the file's own evidence, never a folder around it ---------------------------------------------
    Case("metadata fl2va, file named ref2va", _file("minimax_h3_ref2va_bf16.safetensors", BF16),
         (None, "the safetensors metadata h3_partition=fl2va says fl2va, but the file name "
                "'minimax_h3_ref2va_bf16.safetensors' says ref2va")),
    Case("fl2va file in a folder named ref2va", _in_folder("ref2va", "minimax_h3_fl2va_bf16.safetensors", BF16)),
]


def _plain(w: dict) -> dict:
    return {k: (v.qdata, v.scale) if isinstance(v, QuantizedWeight) else v for k, v in w.items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, dict]:
    d = tmp_path_factory.mktemp("refs")
    return {id(sd): _plain(load_dit_weights(save_state_dict(sd, d / f"{n}.safetensors", META), CFG,
                                            dtype=torch.float32))
            for n, sd in (("bf16", BF16), ("int8", INT8))}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_checkpoint_case(case: Case, tmp_path, references):
    path = case.build(tmp_path)
    if case.fails is not None:
        key, fragment = case.fails
        with pytest.raises(CheckpointError) as e:
            check_checkpoint(path, qkv_layout=case.qkv_layout)
        err, msg = e.value, str(e.value)
        assert err.key == key and fragment in msg, msg
        assert Path(err.file) == path or path in Path(err.file).parents, (err.file, path)  # the file (or its folder)
        assert msg.startswith(f"{err.file}: " + (f"{key}: " if key else "")), msg  # file and key lead the message
        return
    info = check_checkpoint(path, qkv_layout=case.qkv_layout)
    if case.variant:
        assert info.variant.name == case.variant
    got = _plain(load_dit_weights(path, qkv_layout=case.qkv_layout, dtype=torch.float32))
    want = references[id(BF16)] if case.reference is None else case.reference and references[id(case.reference)]
    if want:
        assert set(got) == set(want)
        for k, v in want.items():
            assert all(torch.equal(a, b) for a, b in zip(v, got[k])) if isinstance(v, tuple) else torch.equal(v, got[k]), k


def test_a_file_that_goes_bad_later_is_a_failed_precondition(tmp_path):
    path = save_state_dict(BF16, tmp_path / "ok.safetensors", META)
    check_checkpoint(path)  # start-up: fine
    path.write_bytes(path.read_bytes()[:-64])  # replaced by a truncated copy while serving
    with pytest.raises(CheckpointError) as e:
        load_dit_weights(path)
    code, msg = status_for(e.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and str(path) in msg and "final_layer.audio_out.bias" in msg


# ---- the other stages' loaders share the toolkit: a few of their cases ---------------------------------------------
def test_vae_and_encoder_cases(tmp_path):
    from safetensors.torch import load_file, save_file

    from minimax_h3.text.checkpoint import TextEncoderCheckpoint
    from minimax_h3.text.config import ConditionerConfig
    from minimax_h3.text.tiny import write_tiny_model
    from minimax_h3.vae.audio import AudioVAEConfig, inspect_audio_vae, write_tiny_audio_vae
    from minimax_h3.vae.video import CONFIG_METADATA_KEY, VideoVAEConfig, inspect_video_vae, write_tiny_video_vae

    def fails(fn, path, key, fragment):
        with pytest.raises(CheckpointError) as e:
            fn()
        assert e.value.key == key and fragment in str(e.value) and str(e.value).startswith(f"{path}: "), str(e.value)

    # video VAE: an int32 tensor; a decoder-only file without config is checked against the H3 geometry (its
    # head count is not guessed from the width), so the tiny one fails naming its first misshapen key
    video = write_tiny_video_vae(str(tmp_path / "v.safetensors"), VideoVAEConfig.tiny(), 0) and tmp_path / "v.safetensors"
    sd = load_file(str(video))
    save_file({**sd, "decoder.proj_out.bias": torch.zeros_like(sd["decoder.proj_out.bias"], dtype=torch.int32)},
              str(tmp_path / "vi.safetensors"), {CONFIG_METADATA_KEY: VideoVAEConfig.tiny().to_json()})
    fails(lambda: inspect_video_vae(str(tmp_path / "vi.safetensors"), parts="decoder"), tmp_path / "vi.safetensors",
          "decoder.proj_out.bias", "expected a float dtype")
    save_file({k: v for k, v in sd.items() if not k.startswith(("encoder.", "quant_conv."))},
              str(tmp_path / "vd.safetensors"))
    fails(lambda: inspect_video_vae(str(tmp_path / "vd.safetensors"), parts="decoder"), tmp_path / "vd.safetensors",
          "decoder.register_tokens", "H3 release geometry")
    # audio VAE: an int32 tensor
    audio = write_tiny_audio_vae(tmp_path / "a.safetensors", AudioVAEConfig.tiny(), 0)
    sd = load_file(str(audio))
    save_file({**sd, "dec_in_proj.bias": sd["dec_in_proj.bias"].to(torch.int32)}, str(tmp_path / "ai.safetensors"),
              {"h3_audio_vae_config": AudioVAEConfig.tiny().to_json()})
    fails(lambda: inspect_audio_vae(tmp_path / "ai.safetensors"), tmp_path / "ai.safetensors", "dec_in_proj.bias",
          "expected a float dtype")
    # text encoder: truncated
    te = write_tiny_model(tmp_path / "te", variant="bf16", with_visual=False)
    (tmp_path / "te" / "cut.safetensors").write_bytes(te.read_bytes()[:-10])
    fails(lambda: TextEncoderCheckpoint(tmp_path / "te" / "cut.safetensors", ConditionerConfig.tiny()),
          tmp_path / "te" / "cut.safetensors", "model.layers.1.self_attn.v_proj.weight", "truncated")


# ---- real stage processes ------------------------------------------------------------------------------------------
def _start(args: list[str], tmp_path: Path, stage: str, wait_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"{stage}_svc", *args, "--port", "0", "--devices", "virt0",
                           "--lease-dir", str(tmp_path / "leases"), "--cache-dir", str(tmp_path / "cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=wait_s, env={**os.environ, **SERVER_ENV})


@pytest.mark.parametrize("name", ["dropped last block", "stacked file, no evidence"])
def test_dit_process_refuses_a_bad_checkpoint_at_start(name, tmp_path):
    case = next(c for c in CASES if c.id == name)
    path = case.build(tmp_path)
    r = _start(["--weights", str(path)], tmp_path, "dit")
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    key, fragment = case.fails
    assert r.returncode != 0 and "serving on" not in r.stdout
    assert last.startswith(f"dit: cannot start: {path}: {key}: ") and fragment in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_decoder_process_refuses_an_int_tensor_in_the_audio_vae(tmp_path):
    from safetensors.torch import load_file, save_file

    from minimax_h3.vae.audio import AudioVAEConfig, write_tiny_audio_vae
    from minimax_h3.vae.video import VideoVAEConfig, write_tiny_video_vae

    write_tiny_video_vae(str(tmp_path / "v.safetensors"), VideoVAEConfig.tiny(), 0)
    sd = load_file(str(write_tiny_audio_vae(tmp_path / "a.safetensors", AudioVAEConfig.tiny(), 0)))
    bad = tmp_path / "a_int.safetensors"
    save_file({**sd, "decoder.conv_post.weight": sd["decoder.conv_post.weight"].to(torch.int32)}, str(bad),
              {"h3_audio_vae_config": AudioVAEConfig.tiny().to_json()})
    r = _start(["--video-weights", str(tmp_path / "v.safetensors"), "--audio-weights", str(bad)], tmp_path, "decoder")
    assert r.returncode != 0 and "serving on" not in r.stdout
    assert f"decoder: cannot start: {bad}: decoder.conv_post.weight: " in r.stderr, r.stderr[-2000:]


def test_dit_file_that_goes_bad_while_serving_fails_the_job_with_failed_precondition(tmp_path):
    from h3.v1 import dit_pb2_grpc
    from minimax_h3.contract import RenderSpec
    from render_svc.stage_calls import sample
    from stagekit.channels import Security, health_of, open_channel

    small = DiTConfig.tiny(num_layers=1, num_heads=2)
    path = save_state_dict(tiny_state_dict(small, "bf16", seed=1), tmp_path / "dit.safetensors", file_metadata(small))
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "dit_svc", "--weights", str(path), "--port", "0", "--port-file",
                             str(port_file), "--devices", "virt0", "--lease-dir", str(tmp_path / "leases")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **SERVER_ENV})
    channel = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            if port_file.exists() and port_file.read_text().strip():
                channel = channel or open_channel(f"127.0.0.1:{port_file.read_text().strip()}")
                if health_of(channel, "h3.v1.DiTSampler") == "SERVING":
                    break
            time.sleep(0.1)
        else:
            pytest.fail("DiT did not start")
        path.write_bytes(path.read_bytes()[:-64])  # the file goes bad after start-up (weights load on the first job)

        class Clients:
            dit = dit_pb2_grpc.DiTSamplerStub(channel)
            security = Security()

        with pytest.raises(grpc.RpcError) as e:
            sample(Clients, RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1), torch.zeros(3, 64),
                   timeout_s=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and str(path) in e.value.details()
    finally:
        if channel is not None:
            channel.close()
        proc.terminate()
        proc.wait(30)


def test_decoder_engine_serves_the_geometry_of_vae_folders(tmp_path):
    """video_vae/ and audio_vae/ folders in the diffusers layout (config.json beside diffusers-named weights; the
    loaders' own tests check real `save_pretrained` folders): validated at engine start-up with the folders'
    configs, which set the latent geometry the decoder accepts."""
    from safetensors.torch import save_file

    from decoder_svc.engine import DecoderEngine, DecoderEngineConfig
    from minimax_h3.contract import LatentGeometry
    from minimax_h3.vae.audio import AudioVAE, AudioVAEConfig, random_init_, unfold_weight_norm_state_dict
    from minimax_h3.vae.video import tiny_state_dict as video_state_dict
    from minimax_h3.vae.video import VideoVAEConfig, comfy_to_diffusers_state_dict
    from stagekit.dist import RankGroup, RankInfo

    v, a = VideoVAEConfig.tiny(), AudioVAEConfig.tiny()
    for name, sd, config in (
        ("video_vae", comfy_to_diffusers_state_dict(video_state_dict(v, 0), v),
         {"latent_channels": v.latent_channels, "block_out_channels": list(v.block_channels),
          "layers_per_block": v.num_res_blocks, "norm_num_groups": v.norm_groups, "decoder_num_layers": v.dec_layers,
          "decoder_num_attention_heads": v.dec_heads, "decoder_attention_head_dim": v.dec_head_dim}),
        ("audio_vae", unfold_weight_norm_state_dict((m := random_init_(AudioVAE(a), 0)).state_dict(), m),
         {"encoder_dim": a.encoder_dim, "latent_dim": a.latent_dim, "num_attention_heads": a.num_attention_heads,
          "decoder_dim": a.decoder_dim, "sampling_rate": 32000}),
    ):
        (tmp_path / name).mkdir()
        save_file({k: t.contiguous() for k, t in sd.items()}, str(tmp_path / name / "diffusion_pytorch_model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    eng = DecoderEngine(DecoderEngineConfig(str(tmp_path / "video_vae"), str(tmp_path / "audio_vae"), "",
                                            tmp_path / "cache", "cpu", torch.float32),
                        RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    assert eng.video_info.config_source == eng.audio_info.config_source == "config.json"
    assert eng.video_info.cfg.dec_heads == v.dec_heads and eng.audio_info.cfg.decoder_dim == a.decoder_dim
    assert eng.geometry == LatentGeometry(24, 16, 32)
    eng.load(WeightSource(eng.weight_files()))
    assert eng.video.cfg.dec_heads == v.dec_heads and eng.audio.cfg.num_attention_heads == a.num_attention_heads
