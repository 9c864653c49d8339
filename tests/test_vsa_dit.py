"""VSA in the DiT (minimax_h3/dit/sparse.py, the blocks' attention in minimax_h3/dit/model.py) and FastH3 checkpoints
(minimax_h3/dit/checkpoint.py): which steps and blocks run it, the gate's input, dense where VSA keeps everything,
and the FastH3 file's VSA gates loaded from every block or refused naming the block without one."""

from __future__ import annotations

import math

import pytest
import torch

from minimax_h3.contract import SparseAttention, spec_from_proto, spec_to_proto, validate
from minimax_h3.dit.checkpoint import check_checkpoint, load_dit_weights
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import ReferenceBlock, build_layout, build_ref2va_layout
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.sampling import SamplerConfig, schedule, shift_sigma
from minimax_h3.dit.sparse import VsaStep, percent_to_sigma, plan_vsa, prefix_segments
from minimax_h3.dit.tiny_checkpoint import dense_state_dict, save_state_dict, tiny_state_dict, write_tiny_checkpoint
from minimax_h3.kernels.vsa import VsaAttention, vsa_attention, vsa_tiles
from stagekit.checkpoints import CheckpointError
from stagekit.errors import InvalidArgument

CFG = DiTConfig.tiny(vsa_gates=True)
TEXT = 20


def gated_model(zero_gates: bool = False) -> H3DiT:
    model = H3DiT(CFG, compute_dtype=torch.float32, chunk_rows=128).eval()
    sd = dense_state_dict(CFG, seed=3)
    if zero_gates:
        sd = {k: v.zero_() if k.endswith("to_gate_compress.weight") else v for k, v in sd.items()}
    model.load_state_dict(sd)
    return model


def case(keyframes=("first",)):
    layout = build_layout(CFG, TEXT, 22, 256, 256, keyframes=keyframes)  # video grid 7 x 8 x 8
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(layout.num_video_rows, CFG.video_patch_dim, generator=g),
            torch.randn(layout.num_audio_rows, CFG.audio_in_channels, generator=g),
            torch.randn(TEXT, CFG.text_dim, generator=g), torch.tensor(0.3), torch.tensor(0.5), layout)
    tiles = vsa_tiles(prefix_segments(layout, CFG.patch), (7, 8, 8))
    return args, tiles


@torch.inference_mode()
def test_keeping_every_tile_without_a_gate_is_the_dense_model():
    model = gated_model(zero_gates=True)
    args, tiles = case()
    dense = model(*args)
    sparse = model(*args, sparse=VsaStep(VsaAttention(tiles, 1.0), frozenset()))
    for a, b in zip(sparse, dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_dense_blocks_run_dense_and_the_others_vsa():
    model = gated_model()
    args, tiles = case()
    dense = model(*args)
    step = VsaStep(VsaAttention(tiles, 0.1), frozenset())
    assert all(torch.equal(a, b) for a, b in zip(model(*args, sparse=VsaStep(step.attention, frozenset({0, 1}))),
                                                 dense))
    sparse = model(*args, sparse=step)
    assert not torch.allclose(sparse[0], dense[0], atol=1e-3)  # routing and the trained gate change the output
    only_1 = model(*args, sparse=VsaStep(step.attention, frozenset({0})))
    assert not torch.equal(only_1[0], dense[0]) and not torch.equal(only_1[0], sparse[0])


@torch.inference_mode()
def test_the_gate_reads_the_attention_input_and_vsa_gets_the_blocks_qkv():
    model = gated_model()
    args, tiles = case()
    seen = {}
    block = model.blocks[1]
    block.attn.qkv_proj.register_forward_hook(lambda m, i, o: seen.setdefault("qkv_in", []).append(i[0]))
    block.attn.to_gate_compress.register_forward_hook(lambda m, i, o: seen.setdefault("gate_in", []).append(i[0]))

    class Recording(VsaAttention):
        def __call__(self, q, k, v, gate=None):
            out = super().__call__(q, k, v, gate)
            seen["call"] = (q.clone(), k.clone(), v.clone(), gate.clone(), out.clone())
            return out

    attention = Recording(tiles, 0.25)
    model(*args, sparse=VsaStep(attention, frozenset({0})))
    assert len(seen["gate_in"]) == len(seen["qkv_in"]) == math.ceil(args[-1].seq_len / 128)  # row chunks
    assert all(torch.equal(a, b) for a, b in zip(seen["gate_in"], seen["qkv_in"]))
    q, k, v, gate, out = seen["call"]
    h, s, d = q.shape[1:]
    want_gate = torch.cat(seen["gate_in"]) @ block.attn.to_gate_compress.weight.T
    torch.testing.assert_close(gate, want_gate)
    assert torch.equal(out[0], vsa_attention(q[0], k[0], v[0], tiles, 0.25, gate.view(s, h, d).transpose(0, 1)))


def test_segments_follow_the_packed_layout():
    layout = build_layout(CFG, TEXT, 22, 256, 256, keyframes=("first", "last"))
    assert prefix_segments(layout, CFG.patch) == [TEXT, 64, 64, 74]  # text, two keyframes (8 x 8), audio
    refs = (ReferenceBlock("image", 1, 8, 12), ReferenceBlock("video", 2, 4, 4, audio_latents=5),
            ReferenceBlock("audio", audio_latents=3))
    layout = build_ref2va_layout(CFG, TEXT, 22, 256, 256, refs)
    assert prefix_segments(layout, CFG.patch) == [TEXT, 24, 10, 8, 6, 74]  # image; soundtrack, frames; sound; audio


def test_the_window_of_comfyuis_node():
    # The FastH3 templates: 8 steps `simple` at shift 10, start 0.2, end 1: dense while sigma > shift(0.8).
    sigmas = schedule(SamplerConfig(steps=8, video_shift=10.0))[0][:-1].tolist()
    start = percent_to_sigma(0.2, 10.0)
    assert start == shift_sigma(0.8, 10.0) and sigmas[1] > start > sigmas[2]
    assert (percent_to_sigma(0.0, 10.0), percent_to_sigma(1.0, 10.0)) == (1.0, 0.0)
    layout = build_layout(CFG, TEXT, 22, 256, 256)
    sp = SparseAttention(min_tokens=0, dense_blocks=(1,))
    run = plan_vsa(sp, layout, CFG.patch, sigmas, 10.0, "reference", "cpu")
    assert run.steps == (False, False, True, True, True, True, True, True) and run.sparse_steps == 6
    assert run.step.for_block(0) is run.step.attention and run.step.for_block(1) is None
    assert run.step.attention.keep == 0.1
    assert plan_vsa(SparseAttention(start_percent=0.0), layout, CFG.patch, sigmas, 10.0, "reference", "cpu") is None
    assert layout.seq_len < 12288  # the template's min_tokens: a sequence this short runs dense
    assert plan_vsa(SparseAttention(min_tokens=0, start_percent=0.0, end_percent=0.5), layout, CFG.patch, sigmas,
                    10.0, "reference", "cpu").steps == tuple(s >= shift_sigma(0.5, 10.0) for s in sigmas)


def test_sparse_attention_in_the_render_spec():
    from h3.v1 import common_pb2

    spec = validate(spec_from_proto(common_pb2.RenderParams(prompt="x")))
    assert spec.sparse is None
    msg = common_pb2.RenderParams()
    sp = SparseAttention(keep_percent=12.5, start_percent=0.25, end_percent=0.9, dense_blocks=(0, 3), min_tokens=0)
    spec_to_proto(spec.__class__(prompt="x", sparse=sp), msg)
    assert spec_from_proto(msg).sparse == sp
    for bad, needle in ((SparseAttention(method="sol-attn"), "runs vsa"), (SparseAttention(keep_percent=100),
                                                                           "keep_percent"),
                        (SparseAttention(start_percent=1.5), "start_percent"), (SparseAttention(dense_blocks=(-1,)),
                                                                                "dense_blocks")):
        with pytest.raises(InvalidArgument, match=needle):
            validate(spec.__class__(sparse=bad))


@pytest.mark.parametrize("variant,stored", [("bf16", "BF16"), ("int8_convrot_pruned", "I8")])
def test_a_fasth3_checkpoint_loads_its_gates(tmp_path, variant, stored):
    path = write_tiny_checkpoint(CFG, tmp_path / "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors",
                                 variant, metadata=False)
    cfg = CFG.replace(adaln_form="curve" if "pruned" in variant else "mlp")
    info = check_checkpoint(path, cfg)
    assert info.config.vsa_gates and info.partition.partition == "fl2va"
    assert info.shapes["blocks.1.attn.to_gate_compress.weight"].dtype == stored
    assert info.variant.name.endswith("_vsa" if stored == "I8" else "_vsa-dense")
    weights = load_dit_weights(path, cfg)
    assert all(f"blocks.{i}.attn.to_gate_compress.weight" in weights for i in range(CFG.num_layers))
    assert check_checkpoint(write_tiny_checkpoint(CFG, tmp_path / "fasth3_omniref_8step_pruned_int8_convrot"
                                                                  ".safetensors", variant, metadata=False),
                            cfg).partition.partition == "ref2va"


def test_a_block_without_its_gate_is_refused(tmp_path):
    sd = tiny_state_dict(CFG, "int8_convrot_pruned")
    for suffix in ("weight", "weight_scale", "comfy_quant"):
        del sd[f"blocks.1.attn.to_gate_compress.{suffix}"]
    path = save_state_dict(sd, tmp_path / "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.to_gate_compress\.weight"):
        check_checkpoint(path, CFG.replace(adaln_form="curve"))
    sd = tiny_state_dict(CFG, "bf16")
    sd["blocks.0.attn.to_gate_compress.weight"] = sd["blocks.0.attn.to_gate_compress.weight"].to(torch.float8_e4m3fn)
    path = save_state_dict(sd, tmp_path / "fastvideo_fasth3_fp8.safetensors")
    with pytest.raises(CheckpointError, match="a VSA gate is int8 ConvRot"):
        check_checkpoint(path, CFG)


def _vsa_rank(rank: int, world: int):
    import torch.distributed as dist

    from minimax_h3.dit.tp import shard_state_dict

    args, tiles = case()
    model = H3DiT(CFG, compute_dtype=torch.float32, chunk_rows=128,
                  tp_group=dist.new_group(list(range(world)))).eval()
    model.load_state_dict(shard_state_dict(dense_state_dict(CFG, seed=3), CFG, rank, world, H3DiT._tp_plan))
    with torch.inference_mode():
        return model(*args, sparse=VsaStep(VsaAttention(tiles, 0.25), frozenset()))


def test_tensor_parallel_vsa_matches_one_rank():
    """Each TP rank routes its own heads and gates them with its slice of to_gate_compress (column-parallel)."""
    from tests.dit_ranks import assert_matches_one_rank
    from tests.ranks import run_ranks

    args, tiles = case()
    with torch.inference_mode():
        ref = gated_model()(*args, sparse=VsaStep(VsaAttention(tiles, 0.25), frozenset()))
    assert_matches_one_rank(run_ranks(_vsa_rank, 2), ref, 1e-5, "TP2 VSA")
