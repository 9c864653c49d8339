"""Block weight streaming (minimax_h3/dit/streaming.py, docs/one_card.md): the per-job decision, bitwise identity of a
streamed forward with a resident one, and the DiT service choosing, reporting and refusing by the numbers."""

from __future__ import annotations

import grpc
import pytest
import torch

from dit_svc.engine import DiTEngine, DiTEngineConfig, activation_bytes, target_rows
from h3.v1 import common_pb2
from minimax_h3.contract import RenderSpec
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.streaming import GIB, SLOTS, BlockStream, Placement, plan_placement
from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
from minimax_h3.kernels.tuning import chunk_rows
from render_svc.stage_calls import sample
from stagekit.dist import RankGroup, RankInfo
from stagekit.errors import ResourceExhausted
from tests.test_residency import start_stages

MiB = 1 << 20


def full_size_activations(width: int, height: int, frames: int, tp: int = 1, text_len: int = 512) -> int:
    """The activation estimate of the full H3 model (fp16 compute, eager row chunks) on one of `tp` ranks."""
    cfg = DiTConfig()
    rows = text_len + target_rows(cfg, RenderSpec(prompt="x", width=width, height=height, frames=frames))
    return activation_bytes(cfg, rows, torch.float16, chunk_rows("sm_90").eager, tp=tp)


# The pruned int8 file on one rank: 50 blocks of ~0.36 GiB and ~1.7 GiB that always stays (embeddings, refiner,
# output heads, the AdaLN table); a 22 GiB card leaves ~20.5 GiB to the DiT beside its context and the idle stages.
BLOCK, OTHER, N = int(0.36 * GIB), int(1.7 * GIB), 50


@pytest.mark.parametrize("shape, tp, room_gib, streamed", [
    ((960, 544, 73), 1, None, 0),        # no limit: nothing streams
    ((960, 544, 73), 1, 80.0, 0),        # a big card: nothing streams
    ((512, 288, 56), 1, 23.0, 0),        # a small clip fits a 24 GB card whole
    ((960, 544, 73), 1, 20.5, None),     # some stream
    ((832, 480, 124), 1, 20.5, None),
    ((1344, 768, 124), 1, 20.5, None),   # some stream
    ((960, 544, 362), 1, 20.5, None),    # the 15 s clip on one card
    ((1920, 1088, 362), 2, 19.0, None),  # one TP2 rank of the 15 s 1080p clip, under 19.5 GiB
])
def test_plan_streams_the_fewest_blocks_that_fit(shape, tp, room_gib, streamed):
    act = full_size_activations(*shape, tp=tp)
    block, other = BLOCK // tp, OTHER // tp
    room = None if room_gib is None else int(room_gib * GIB)
    p = plan_placement(N, block, other, act, room)
    if streamed is not None:
        assert len(p.streamed) == streamed
    full = other + N * block + act
    if p.streamed:
        assert full > room and p.need_bytes <= room
        # one block fewer streamed would not fit: the fewest
        assert p.need_bytes + block > room
        assert p.describe().startswith(f"streaming {len(p.streamed)} of {N} blocks")
        gaps = [b - a for a, b in zip(p.streamed, p.streamed[1:])]
        assert not gaps or max(gaps) - min(gaps) <= 1, p.streamed  # spread over the depth
    else:
        assert p.need_bytes == full and p.describe() == f"all {N} blocks resident"


def test_plan_refuses_with_the_numbers():
    act = full_size_activations(1920, 1088, 362, tp=1)
    with pytest.raises(ResourceExhausted) as ei:
        plan_placement(N, BLOCK, OTHER, act, int(20.5 * GIB), what="a 1920x1088x362 DiT job")
    msg = str(ei.value)
    assert "1920x1088x362" in msg and "needs an estimated" in msg and "memory budget is 20.50 GiB" in msg
    assert f"{SLOTS} block slots" in msg and "activations" in msg and "more ranks" in msg
    # Two blocks or fewer: streaming saves nothing, so the whole model must fit.
    with pytest.raises(ResourceExhausted):
        plan_placement(2, 100, 10, 50, 200)
    assert plan_placement(2, 100, 10, 50, 260).streamed == ()


def tiny_model(num_layers: int = 5) -> tuple[DiTConfig, H3DiT]:
    cfg = DiTConfig.tiny(num_layers=num_layers)
    torch.manual_seed(0)
    m = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, m


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_streamed_forward_is_bitwise_resident(device):
    cfg, m = tiny_model()
    m = m.to(device)
    lay = build_layout(cfg, 6, 22, 64, 96).to(device)
    g = torch.Generator().manual_seed(1)
    video = torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g).to(device)
    audio = torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g).to(device)
    text = torch.randn(lay.text_len, cfg.text_dim, generator=g).to(device)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    stream = BlockStream(m.blocks, device)
    m.block_stream = stream
    with torch.inference_mode():
        ref = m(video, audio, text, 0.3, 0.5, lay)
    n = cfg.num_layers
    for streamed in [(0,), (1, 3), (0, 1, 2, 3, 4), (2,), ()]:
        stream.apply(Placement(n, streamed, stream.block_bytes, 0, 0))
        assert stream.streamed == streamed and set(stream.host) == set(streamed)
        with torch.inference_mode():
            for _ in range(2):  # the second forward reuses the slots the first one left
                out = m(video, audio, text, 0.3, 0.5, lay)
                assert all(torch.equal(a, b) for a, b in zip(out, ref)), streamed
    # Back to resident: every weight as it was, on the device, none pointing into host buffers.
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(t.device.type == torch.device(device).type for ts in stream.tensors for t in ts)
    assert stream.slots == [] and stream.host == {}
    assert stream.bytes_copied > 0


def test_engine_plans_and_reports(tmp_path):
    """The DiT service streams when its memory budget asks for it: same latents bit for bit, the choice in the
    job's events and in Status, and a job that cannot fit even streamed refused at admission with the numbers."""
    cfg = DiTConfig.tiny(num_layers=5)
    ckpt = tmp_path / "models" / "minimax_h3_tiny_bf16.safetensors"
    ckpt.parent.mkdir()
    write_tiny_checkpoint(cfg, ckpt, "bf16", seed=3)
    cache = tmp_path / "cache"
    eng = DiTEngine(DiTEngineConfig(str(ckpt), "", cache, "cpu", torch.float32),
                    RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    spec = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=4)
    text = torch.randn(8, cfg.text_dim, generator=torch.Generator().manual_seed(2))
    act = eng.activation_bytes(spec, text.shape[0])
    block, other = eng.block_bytes(), eng.weight_bytes() - cfg.num_layers * eng.block_bytes()
    # Room for the floor plus one resident block: four of five blocks stream.
    budget = other + (SLOTS + 1) * block + act + 4096
    assert eng.plan(spec, text.shape[0], budget).streamed and len(eng.plan(spec, 8, budget).streamed) == 4
    events = []
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (plain,), _ = start_stages(["plain"], tmp_path / "a", cache, ["--weights", str(ckpt)])
    try:
        (streaming,), _ = start_stages(["streaming"], tmp_path / "b", cache,
                                       ["--weights", str(ckpt), "--memory-budget-gb", str(budget / GIB)])
    except BaseException:
        plain.stop()
        raise
    try:
        v0, a0, _ = sample(plain.clients, spec, text, job_id="plain", timeout_s=120)
        v1, a1, _ = sample(streaming.clients, spec, text, job_id="streamed", timeout_s=120,
                           on_progress=lambda ev: events.append(ev.message))
        assert torch.equal(v0, v1) and torch.equal(a0, a1)
        assert any(m == "streaming 4 of 5 blocks, 0.0 GiB a step" for m in events), events
        rows = {r.op: r for r in streaming.stub.Status(common_pb2.StatusRequest()).kernels}
        assert rows["weights"].kernel.startswith("streaming 4 of 5 blocks"), rows
        big = RenderSpec(**{**spec.__dict__, "width": 1024, "height": 1024, "frames": 124})
        with pytest.raises(grpc.RpcError) as ei:
            sample(streaming.clients, big, text, job_id="too-big", timeout_s=120)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "even with every block streamed" in ei.value.details() and "1024x1024x124" in ei.value.details()
    finally:
        plain.stop()
        streaming.stop()
