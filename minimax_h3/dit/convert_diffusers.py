"""Our (release / ComfyUI) DiT names <-> diffusers' MiniMaxH3Transformer3DModel, declared once.

`DIFFUSERS_NAMES` is the rename table (a stagekit.checkpoints.NameMap, used both ways); the checkpoint loader maps
a diffusers directory's header with it, LoRA resolves diffusers-named targets with it, and `to_diffusers` /
`from_diffusers` below convert whole state dicts (tests, benchmarks, the tiny diffusers writer). Beyond renames
(docs/checkpoints.md, checked against diffusers 0.42.1):
  * fused qkv_proj [q_all; k_all; v_all] <-> separate to_q / to_k / to_v (or diffusers' fused `to_qkv`, same order);
  * fc1 rows [gate; value] (ours) <-> [value; gate] (diffusers' SwiGLU reads value first);
  * rope.inv_freq: a non-persistent buffer in diffusers, dropped (recomputed bit-identically from the config);
  * curve-form AdaLN (adaln_t_table) has no diffusers equivalent.
"""

from __future__ import annotations

from typing import Mapping

import torch

from stagekit.checkpoints import NameMap

QKV_SECTIONS = 3  # q, k, v
FC1_SECTIONS = 2  # gate, value
QKV_PARTS = ("to_q", "to_k", "to_v")
DIFFUSERS_QKV = ".attn.to_q."  # the name our fused qkv_proj maps to; to_k / to_v are its siblings
FUSED_QKV = ".attn.to_qkv."  # diffusers after `fuse_qkv_projections()`: [q; k; v] in one tensor

DIFFUSERS_NAMES = NameMap((
    ("^blocks.", "^transformer_blocks."),
    ("^token_refiner.blocks.", "^token_refiner.refiner_blocks."),
    ("^time_embedder.proj_in.", "^time_embedder.linear_1."),
    ("^time_embedder.proj_out.", "^time_embedder.linear_2."),
    ("^video_patch_proj.", "^proj_in."),
    ("^audio_patch_proj.", "^audio_proj_in."),
    ("^condition_proj.", "^context_embedder."),
    ("^final_layer.norm.", "^norm_out.norm."),
    ("^final_layer.adaln_proj.linear.", "^norm_out.linear."),
    ("^final_layer.video_out.", "^proj_out."),
    ("^final_layer.audio_out.", "^audio_proj_out."),
    (".attn.qkv_proj.", DIFFUSERS_QKV),
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
    (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."),
    (".mlp.fc2.", ".ff.net.2."),
))
NOT_IN_DIFFUSERS = ("rope.inv_freq",)


def is_qkv_part(diffusers_key: str) -> bool:
    """A diffusers `to_k` / `to_v` tensor: folded into the `to_q` entry that maps to our qkv_proj."""
    return ".attn.to_k." in diffusers_key or ".attn.to_v." in diffusers_key


def qkv_part_keys(diffusers_q_key: str) -> tuple[str, str, str]:
    """The to_q / to_k / to_v keys (in our [q; k; v] order) of a `to_q` key."""
    return tuple(diffusers_q_key.replace(DIFFUSERS_QKV, f".attn.{p}.") for p in QKV_PARTS)


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[gate; value] <-> [value; gate] (the same swap both ways)."""
    a, b = t.chunk(FC1_SECTIONS, dim=0)
    return torch.cat([b, a], dim=0)


def to_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (release/Comfy names, mlp-form AdaLN) -> diffusers MiniMaxH3Transformer3DModel state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key in NOT_IN_DIFFUSERS:
            continue
        if key == "adaln_t_table":
            raise ValueError("curve-form (pruned) AdaLN has no diffusers equivalent; convert an unpruned checkpoint")
        name = DIFFUSERS_NAMES.to_source(key)
        if DIFFUSERS_QKV in name:
            for part_key, chunk in zip(qkv_part_keys(name), t.chunk(QKV_SECTIONS, dim=0)):
                out[part_key] = chunk.clone()
        elif key.endswith(".mlp.fc1.weight"):
            out[name] = swap_halves(t)
        else:
            out[name] = t
    return out


def from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers MiniMaxH3Transformer3DModel state dict -> our (release/Comfy-named) state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if is_qkv_part(key) or key in NOT_IN_DIFFUSERS:
            continue
        if DIFFUSERS_QKV in key:
            parts = qkv_part_keys(key)
            missing = [p for p in parts if p not in sd]
            if missing:
                raise KeyError(f"{key}: need to_q, to_k and to_v; missing {missing}")
            t = torch.cat([sd[p] for p in parts], dim=0)
        elif FUSED_QKV in key:
            key = key.replace(FUSED_QKV, DIFFUSERS_QKV)
        ours = DIFFUSERS_NAMES.from_source(key)
        out[ours] = swap_halves(t) if ours.endswith(".mlp.fc1.weight") else t
    orphans = [k for k in sd if is_qkv_part(k) and k.replace(".to_k.", ".to_q.").replace(".to_v.", ".to_q.") not in sd]
    if orphans:
        raise KeyError(f"to_k / to_v without their to_q: {orphans}")
    return out
