"""Multi-rank DiT checks, shared by tests/test_dit_tp.py, test_dit_sp.py and test_lora.py (ranks launched by
tests/ranks.py): `tiny_case` / `gpu_case` build the model and inputs (`random_inputs`) every process rebuilds identically;
`assert_matches_one_rank` is the check every parallel layout must pass: all ranks hold bitwise the same output, within
a relative tolerance of one rank's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout
from minimax_h3.dit.model import H3DiT, curve_state_dict_from_mlp
from tests.ranks import run_ranks

T_VIDEO, T_AUDIO = 0.37, 0.58
GPU_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def tiny_case(form: str = "mlp", keyframes: tuple[str, ...] = ("first",)):
    """Deterministic tiny model (weights perturbed off their init) and inputs, identical in every process:
    (cfg, state dict, layout, (video rows, audio rows, text states)). `form`: the AdaLN form, "mlp" or "curve"."""
    cfg = DiTConfig.tiny(num_layers=2, num_refiner_layers=1)
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = model.state_dict()
    if form == "curve":
        sd, cfg = curve_state_dict_from_mlp(sd, cfg)
    lay = build_layout(cfg, 5, 22, 64, 96, keyframes)
    return cfg, sd, lay, random_inputs(cfg, lay, seed=1)


def random_inputs(cfg: DiTConfig, lay, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded model inputs for `lay`: (video rows [Nv, video_patch_dim], audio rows [Na, audio_in_channels], text
    states [L, text_dim])."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g),
            torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g),
            torch.randn(lay.text_len, cfg.text_dim, generator=g))


def forward(model: H3DiT, lay, x) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) velocities of `model` on the case's inputs at the fixed timesteps."""
    with torch.no_grad():
        return model(*x, torch.tensor(T_VIDEO), torch.tensor(T_AUDIO), lay)


def one_rank(cfg: DiTConfig, sd: dict, lay, x) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the whole model in this process."""
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ref.load_state_dict(sd)
    return forward(ref, lay, x)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_matches_one_rank(outs: list, ref: tuple, rtol: float, label: str) -> None:
    """`outs`: each rank's (video, audio). Every rank holds bitwise rank 0's, which is within `rtol` (relative L2)
    of `ref`, one rank's."""
    v0, a0 = outs[0]
    for v, a in outs[1:]:
        assert torch.equal(v, v0) and torch.equal(a, a0), f"{label}: ranks differ"
    ev, ea = rel(v0, ref[0]), rel(a0, ref[1])
    print(f"{label}: video rel {ev:.3e}, audio rel {ea:.3e}")
    assert ev <= rtol and ea <= rtol, label


# ---- GPU only: NCCL, release head_dim/rope, fp32 and bf16 -----------------------------------------------------------
def gpu_case(frames: int):
    """Release head_dim and rope at a small width: (cfg, state dict, layout, inputs) on the CPU."""
    cfg = DiTConfig.full(num_layers=2, num_refiner_layers=1, hidden=1024, num_heads=8, ffn=2048, text_dim=512,
                         time_embed_hidden=512, time_embed_dim=256)
    torch.manual_seed(0)
    sd = H3DiT(cfg, compute_dtype=torch.float32).state_dict()
    lay = build_layout(cfg, frames, 56, 256, 448, ("first",))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(lay.num_video_rows, 96, generator=g), torch.randn(lay.num_audio_rows, 32, generator=g),
         torch.randn(lay.text_len, cfg.text_dim, generator=g))
    return cfg, sd, lay, x


def _gpu_forward(model: H3DiT, lay, x) -> tuple[torch.Tensor, torch.Tensor]:
    model.cuda()
    with torch.no_grad():
        v, a = model(*(t.cuda() for t in x), 0.3, 0.6, lay.to("cuda"))
    return v.cpu(), a.cpu()


def _gpu_rank(rank: int, world: int, build: Callable, frames: int) -> dict:
    cfg, sd, lay, x = gpu_case(frames)
    return {str(cd): _gpu_forward(build(cfg, sd, cd, rank, world).eval(), lay, x) for cd in GPU_RTOL}


def check_two_gpus(build: Callable, frames: int, label: str) -> None:
    """Two NCCL ranks on cuda:0/1 against one GPU, in fp32 and bf16. `build(cfg, sd, compute_dtype, rank, world)`
    returns a rank's model (module-level: it is pickled by name), with its weights loaded."""
    torch.backends.cuda.matmul.allow_tf32 = False
    outs = run_ranks(_gpu_rank, 2, build, frames, backend="nccl")
    cfg, sd, lay, x = gpu_case(frames)
    for cd, tol in GPU_RTOL.items():
        ref = H3DiT(cfg, compute_dtype=cd).eval()
        ref.load_state_dict(sd)
        assert_matches_one_rank([o[str(cd)] for o in outs], _gpu_forward(ref, lay, x), tol, f"NCCL {label} {cd}")
