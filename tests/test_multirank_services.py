"""Multi-rank stages as real torchrun process groups (gloo on CPU) behind gRPC.

TP=2 DiT output equals TP=1; a 2-rank sharded decode equals the 1-rank decode bitwise;
a deadline cancels a job on every rank and the group serves the next job.
"""

import time

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from minimax_h3.contract import RenderSpec
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import decode, decode_raw, sample
from tests.conftest import SERVER_ENV

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=3, seed=11)


def start(stage, ranks, tmp_path, cache, extra=()):
    s = EmbeddedStack(StackConfig(ranks={stage: ranks}, cache_dir=str(cache), run_dir=str(tmp_path / f"{stage}{ranks}"),
                                  devices="virt0", env=SERVER_ENV, extra_args={stage: list(extra)}))
    s.start_stage(stage)
    s.wait_ready(stage)
    return s


def client_for(stack, stage):
    port = stack.ports[stage]
    ep = Endpoints(**{s: f"127.0.0.1:{port}" for s in ("encoder", "dit", "decoder")})
    return StageClients(ep)


@pytest.fixture(scope="module")
def dit_pair(tmp_path_factory, model_cache, stack):
    """The session stack's 1-rank DiT and a 2-rank one."""
    two = start("dit", 2, tmp_path_factory.mktemp("dit"), model_cache, ["--collective-timeout-s", "20"])
    yield stack[0], two
    two.stop()


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_dit_tp2_equals_tp1(dit_pair):
    one, two = dit_pair
    text = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with client_for(one, "dit") as c1, client_for(two, "dit") as c2:
        v1, a1, r1 = sample(c1, SPEC, text)
        v2, a2, r2 = sample(c2, SPEC, text)
    assert r2.extra["ranks"] == 2 and r1.extra["ranks"] == 1
    assert rel(v2, v1) <= 1e-5 and rel(a2, a1) <= 1e-5, (rel(v2, v1), rel(a2, a1))


def test_dit_deadline_cancels_on_all_ranks_then_next_job_runs(dit_pair):
    _, two = dit_pair
    text = torch.randn(9, 64)
    slow = RenderSpec(prompt="x", width=832, height=480, frames=124, steps=50, seed=1)
    with client_for(two, "dit") as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            sample(c, slow, text, timeout_s=4)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        v, a, r = sample(c, SPEC, text)  # the group is still healthy and in step
        assert torch.isfinite(v).all() and time.monotonic() - t0 < 120


def test_decoder_two_ranks_bitwise_equal_one(tmp_path, model_cache, stack):
    lat_v = torch.randn(24, SPEC.latent_frames, 16, 20, generator=torch.Generator().manual_seed(1))
    lat_a = torch.randn(2, 32, SPEC.audio_latents, generator=torch.Generator().manual_seed(2))
    spec = RenderSpec(prompt="x", width=320, height=256, frames=22)
    from h3.v1 import decoder_pb2

    def decoded(s: EmbeddedStack, ranks: int) -> tuple:
        with client_for(s, "decoder") as c:
            frames, audio, r = decode_raw(c, spec, lat_v, lat_a)  # the decode itself, before the mux
            assert r.extra["ranks"] == ranks
            path = tmp_path / f"out{ranks}.mp4"
            decode(c, spec, lat_v, lat_a, path, fmt=decoder_pb2.MP4)
            return frames, audio, path.read_bytes()

    outs = [decoded(stack[0], 1)]  # the session stack's 1-rank decoder
    s = start("decoder", 2, tmp_path, model_cache)
    try:
        outs.append(decoded(s, 2))
    finally:
        s.stop()
    (f1, a1, mp4_1), (f2, a2, mp4_2) = outs
    assert torch.equal(f1, f2), f"frames differ: {(f1.int() - f2.int()).abs().max()} max, {(f1 != f2).sum()} values"
    assert torch.equal(a1, a2), f"audio differs: {(a1 - a2).abs().max():.3g} max"
    assert mp4_1 == mp4_2, "same frames and audio, yet the MP4s differ: the mux is not deterministic"
