"""Same seed, same noise as diffusers' MiniMax-H3 pipeline, end to end through a real DiT server's Sample RPC.

The DiT checkpoint here is the tiny model with zeroed output heads, so every velocity is exactly 0 and the sampler
carries its starting noise through unchanged in arrangement (each element only sees per-step scalars). The oracle is
diffusers' own `MiniMaxH3PrepareLatentsStep` drawing from a generator seeded like the request, pushed through our
sampler with a zero model: any difference in how the seed becomes noise -- draw order, shape, the audio rows'
arrangement -- shows up as a mismatch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from h3.v1 import dit_pb2_grpc
from minimax_h3.contract import RenderSpec
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import latent_shape, patchify_audio, patchify_video
from minimax_h3.dit.sampling import SamplerConfig, sample
from minimax_h3.dit.tiny_checkpoint import file_metadata, save_state_dict, tiny_state_dict
from render_svc.stage_calls import sample as sample_rpc
from stagekit.channels import Security, health_of, open_channel

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
CFG = DiTConfig.tiny(num_layers=1, num_heads=2)
SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=3, seed=20260511, sampler="euler")


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    """A DiT server process on loopback serving the zero-head tiny model."""
    d = tmp_path_factory.mktemp("seed")
    sd = tiny_state_dict(CFG, "bf16", seed=3)
    for k in ("final_layer.video_out.weight", "final_layer.video_out.bias", "final_layer.audio_out.weight",
              "final_layer.audio_out.bias"):
        sd[k] = torch.zeros_like(sd[k])
    weights = save_state_dict(sd, d / "zero_heads.safetensors", file_metadata(CFG))
    port_file = d / "port"
    log = open(d / "dit.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "dit_svc", "--weights", str(weights), "--port", "0",
                             "--port-file", str(port_file), "--devices", "virt0", "--lease-dir", str(d / "leases"),
                             "--cache-dir", str(d / "cache")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **SERVER_ENV})
    channel = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (d / "dit.log").read_text()[-3000:]
            if port_file.exists() and port_file.read_text().strip():
                channel = channel or open_channel(f"127.0.0.1:{port_file.read_text().strip()}")
                if health_of(channel, "h3.v1.DiTSampler") == "SERVING":
                    break
            time.sleep(0.1)
        else:
            pytest.fail("DiT server did not start:\n" + (d / "dit.log").read_text()[-3000:])

        class Clients:
            dit = dit_pb2_grpc.DiTSamplerStub(channel)
            security = Security()

        yield Clients
    finally:
        if channel is not None:
            channel.close()
        proc.terminate()
        proc.wait(30)
        log.close()


def diffusers_noise(spec: RenderSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(video rows, audio rows) as diffusers' MiniMax-H3 pipeline draws them for `spec.seed`."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLatentsStep

    shp = latent_shape(CFG, spec.frames, spec.height, spec.width)
    pipe = MiniMaxH3PrepareLatentsStep().init_pipeline()
    out = pipe(num_latent_frames=shp.latent_frames, latent_height=shp.latent_height, latent_width=shp.latent_width,
               num_audio_latents=shp.audio_latents, generator=torch.Generator().manual_seed(spec.seed),
               output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


def zero_model(xv, xa, tv, ta):
    return torch.zeros_like(xv), torch.zeros_like(xa)


def test_sample_rpc_starts_from_diffusers_noise(dit):
    pytest.importorskip("diffusers")
    text = torch.randn(5, CFG.text_dim, generator=torch.Generator().manual_seed(1))
    video, audio, _ = sample_rpc(dit, SPEC, text, timeout_s=120)
    ref_v, ref_a = diffusers_noise(SPEC)
    want_v, want_a = sample(zero_model, ref_v, ref_a, SamplerConfig.from_params(SPEC))
    assert torch.equal(patchify_video(video, CFG.patch), want_v)
    assert torch.equal(patchify_audio(audio), want_a)
    # The same stream drawn [2, 32, Ta] and transposed is other audio.
    g = torch.Generator().manual_seed(SPEC.seed)
    torch.randn(ref_v.numel(), generator=g)
    other = patchify_audio(torch.randn(2, CFG.audio_in_channels, ref_a.shape[0] // 2, generator=g))
    assert not torch.equal(sample(zero_model, ref_v, other, SamplerConfig.from_params(SPEC))[1], want_a)
