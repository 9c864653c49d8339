"""State-dict conversion between our (release / ComfyUI) DiT names and diffusers' MiniMaxH3Transformer3DModel.

Differences (h3_architecture.md §2.2, verified against diffusers 0.42.1 key names):
  * renames: video_patch_proj <-> proj_in, audio_patch_proj <-> audio_proj_in, condition_proj <-> context_embedder,
    time_embedder.proj_in/proj_out <-> time_embedder.linear_1/linear_2, token_refiner.blocks <->
    token_refiner.refiner_blocks, blocks <-> transformer_blocks, attn.q_norm/k_norm <-> attn.norm_q/norm_k,
    attn.out_proj <-> attn.to_out.0, mlp.fc1 <-> ff.net.0.proj, mlp.fc2 <-> ff.net.2, final_layer.norm <->
    norm_out.norm, final_layer.adaln_proj.linear <-> norm_out.linear, final_layer.video_out/audio_out <->
    proj_out/audio_proj_out;
  * fused qkv_proj [q_all; k_all; v_all] <-> separate to_q / to_k / to_v;
  * fc1 rows [gate; value] (ours) <-> [value; gate] (diffusers' SwiGLU reads value first);
  * rope.inv_freq: a non-persistent buffer in diffusers, dropped;
  * curve-form AdaLN (adaln_t_table) has no diffusers equivalent.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

_GLOBAL_RENAMES = {  # ours -> diffusers (exact key prefixes)
    "video_patch_proj.": "proj_in.",
    "audio_patch_proj.": "audio_proj_in.",
    "condition_proj.": "context_embedder.",
    "time_embedder.proj_in.": "time_embedder.linear_1.",
    "time_embedder.proj_out.": "time_embedder.linear_2.",
    "token_refiner.final_norm.": "token_refiner.final_norm.",
    "final_layer.norm.": "norm_out.norm.",
    "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.",
    "final_layer.audio_out.": "audio_proj_out.",
}
_BLOCK_RENAMES = {  # inside a block, ours -> diffusers (qkv and fc1 handled separately)
    "norm1.weight": "norm1.weight",
    "norm2.weight": "norm2.weight",
    "attn.q_norm.weight": "attn.norm_q.weight",
    "attn.k_norm.weight": "attn.norm_k.weight",
    "attn.out_proj.weight": "attn.to_out.0.weight",
    "mlp.fc2.weight": "ff.net.2.weight",
    "adaln_proj.linear.weight": "adaln_proj.linear.weight",
    "adaln_proj.linear.bias": "adaln_proj.linear.bias",
}
_OUR_BLOCK = re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.+)$")
_DIFF_BLOCK = re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)$")
_BLOCK_PREFIX = {"blocks": "transformer_blocks", "token_refiner.blocks": "token_refiner.refiner_blocks"}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def to_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (release/Comfy names, mlp-form AdaLN) -> diffusers MiniMaxH3Transformer3DModel state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key == "rope.inv_freq":
            continue
        if key == "adaln_t_table":
            raise ValueError("curve-form (pruned) AdaLN has no diffusers equivalent; convert an unpruned checkpoint")
        m = _OUR_BLOCK.match(key)
        if m:
            prefix = f"{_BLOCK_PREFIX[m.group(1)]}.{m.group(2)}."
            rest = m.group(3)
            if rest == "attn.qkv_proj.weight":
                q, k, v = t.chunk(3, dim=0)
                out[prefix + "attn.to_q.weight"] = q
                out[prefix + "attn.to_k.weight"] = k
                out[prefix + "attn.to_v.weight"] = v
            elif rest == "mlp.fc1.weight":
                out[prefix + "ff.net.0.proj.weight"] = _swap_halves(t)
            elif rest in _BLOCK_RENAMES:
                out[prefix + _BLOCK_RENAMES[rest]] = t
            else:
                raise KeyError(f"unexpected block key {key!r}")
            continue
        for ours, theirs in _GLOBAL_RENAMES.items():
            if key.startswith(ours):
                out[theirs + key[len(ours):]] = t
                break
        else:
            raise KeyError(f"unexpected key {key!r}")
    return out


def from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers MiniMaxH3Transformer3DModel state dict -> our (release/Comfy-named) state dict."""
    inv_global = {v: k for k, v in _GLOBAL_RENAMES.items()}
    inv_block = {v: k for k, v in _BLOCK_RENAMES.items()}
    inv_prefix = {v: k for k, v in _BLOCK_PREFIX.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        if key == "rope.inv_freq":
            continue
        m = _DIFF_BLOCK.match(key)
        if m:
            prefix = f"{inv_prefix[m.group(1)]}.{m.group(2)}."
            rest = m.group(3)
            if rest in ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"):
                qkv.setdefault(prefix, {})[rest[8]] = t
            elif rest == "attn.to_qkv.weight":  # diffusers' fused-projection mode, same [q; k; v] order
                out[prefix + "attn.qkv_proj.weight"] = t
            elif rest == "ff.net.0.proj.weight":
                out[prefix + "mlp.fc1.weight"] = _swap_halves(t)
            elif rest in inv_block:
                out[prefix + inv_block[rest]] = t
            else:
                raise KeyError(f"unexpected diffusers block key {key!r}")
            continue
        for theirs, ours in inv_global.items():
            if key.startswith(theirs):
                out[ours + key[len(theirs):]] = t
                break
        else:
            raise KeyError(f"unexpected diffusers key {key!r}")
    for prefix, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"{prefix}attn: need to_q, to_k and to_v, got {sorted(parts)}")
        out[prefix + "attn.qkv_proj.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out
