"""Deterministic synthetic DiT checkpoints as real safetensors files (ComfyUI layout, our key names).

* `write_tiny_checkpoint(cfg, path, variant)`: bf16 / int8_convrot / int8_convrot_pruned single files, with the
  config and q/k/v order stated in the safetensors metadata (or without, like a ComfyUI repack); a config with
  `vsa_gates` adds FastH3's VSA gate to every block, stored as the block linears are.
* `write_tiny_diffusers_dir`, `write_tiny_release_dir`: the same weights in the diffusers directory layout and in
  the raw release shard layout (per-head interleaved qkv), for loader tests.
* `iter_random_int8_convrot_weights(cfg)`: full-size random weights in the int8-convrot layout (or its pruned
  curve form), one tensor at a time (a generator, so a 33B model never sits in host RAM twice), and `write_random_int8_convrot_checkpoint`,
  which streams them into one Comfy-layout file.

Every tensor is drawn from its own generator seeded by (seed, key name), so values do not depend on iteration
order and the bf16 / int8 / pruned variants of one seed are derived from the same dense weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Iterator, Literal

import torch

from minimax_h3.contract import FL2VA
from minimax_h3.dit.checkpoint import (
                                       BF16,
                                       INT8_CONVROT,
                                       INT8_CONVROT_PRUNED,
                                       METADATA_CONFIG,
                                       METADATA_PARTITION,
                                       METADATA_QKV,
                                       Variant,
                                       expected_specs,
                                       )
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import QKV_SECTIONS, to_diffusers
from minimax_h3.kernels.int8 import encode_comfy_quant, is_power_of_4, quantize_convrot
from stagekit.checkpoints import DTYPE_BYTES, TORCH_DTYPE

TinyVariant = Literal["bf16", "int8_convrot", "int8_convrot_pruned"]
VARIANTS: dict[str, Variant] = {"bf16": BF16, "int8_convrot": INT8_CONVROT, "int8_convrot_pruned": INT8_CONVROT_PRUNED}

LINEAR_GROUPSIZE_CAP = 256  # the release uses 256 for block linears ...
ADALN_GROUPSIZE_CAP = 64  # ... and 64 for the unpruned AdaLN (2688 = 42 * 64)
INT8_UNIFORM_STD = 73.3  # std of integers uniform on [-127, 127]
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "attn.to_gate_compress")
_ST_DTYPE = TORCH_DTYPE  # safetensors dtype name -> torch dtype (stagekit's table)
_ST_NAME = {v: k for k, v in _ST_DTYPE.items()}


# ================================================================================================================
# Group sizes and per-key random tensors
# ================================================================================================================


def convrot_groupsize(*in_features: int, cap: int) -> int:
    """Largest power of 4 <= cap dividing every in_features (256 / 64 for the full model, 64 / 16 for tiny)."""
    g = cap
    while g >= 4:
        if is_power_of_4(g) and all(k % g == 0 for k in in_features):
            return g
        g //= 2
    raise ValueError(f"no ConvRot group size (power of 4, >= 4) divides in_features {in_features}")


def linear_groupsize(cfg: DiTConfig) -> int:
    return convrot_groupsize(cfg.hidden, cfg.attn_inner, cfg.ffn, cap=LINEAR_GROUPSIZE_CAP)


def adaln_groupsize(cfg: DiTConfig) -> int:
    return convrot_groupsize(cfg.time_embed_dim, cap=ADALN_GROUPSIZE_CAP)


def _generator(seed: int, key: str, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    return gen


def random_tensor(key: str, shape: tuple[int, ...], cfg: DiTConfig, seed: int, device="cpu") -> torch.Tensor:
    """fp32 value of one dense tensor: norms ~1, weights ~N(0, 1/fan_in), biases small; rope.inv_freq exact."""
    if key == "rope.inv_freq":
        f = cfg.rope_freq_dim
        exponents = torch.arange(0, 2 * f, 2, dtype=torch.float64, device=device) / (2 * f)
        return (1.0 / cfg.rope_theta**exponents).float()
    x = torch.randn(shape, generator=_generator(seed, key, device), device=device)
    if "norm" in key:
        return 1.0 + 0.1 * x
    if key.endswith(".bias"):
        return 0.02 * x
    return x / math.sqrt(shape[-1])


# ================================================================================================================
# Tiny state dicts (in memory)
# ================================================================================================================


def gated(variant: Variant, cfg: DiTConfig) -> Variant:
    """`variant` with FastH3's VSA gates stored as its block linears, when the config has them."""
    return dataclasses.replace(variant, gates="int8" if variant.linears == "int8" else "dense") if cfg.vsa_gates \
        else variant


def dense_state_dict(cfg: DiTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The bf16-release-layout weights (fp32 islands fp32, the rest bf16)."""
    specs = expected_specs(cfg, gated(BF16, cfg))
    return {k: random_tensor(k, s.shape, cfg, seed).to(_ST_DTYPE[s.store]) for k, s in specs.items()}


def _quantize_into(sd: dict, prefix: str, w: torch.Tensor, groupsize: int) -> None:
    q, scale = quantize_convrot(w.float(), groupsize)
    sd[f"{prefix}.weight"] = q
    sd[f"{prefix}.weight_scale"] = scale
    sd[f"{prefix}.comfy_quant"] = encode_comfy_quant(groupsize)


def int8_state_dict(dense: dict[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """Unpruned Comfy int8_convrot: block linears ConvRot (linear group), block AdaLN ConvRot (AdaLN group)."""
    g_lin, g_ada = linear_groupsize(cfg), adaln_groupsize(cfg)
    out: dict[str, torch.Tensor] = {}
    for key in expected_specs(cfg, gated(INT8_CONVROT, cfg)):  # file order of the int8 layout
        if key.endswith((".weight_scale", ".comfy_quant")):
            continue
        prefix = key[: -len(".weight")]
        if key.startswith("blocks.") and prefix.split(".", 2)[2] in BLOCK_LINEARS:
            _quantize_into(out, prefix, dense[key], g_lin)
        elif key.startswith("blocks.") and key.endswith(".adaln_proj.linear.weight"):
            _quantize_into(out, prefix, dense[key], g_ada)
        else:
            out[key] = dense[key]
    return out


def _sinusoid(t: torch.Tensor, freq_dim: int) -> torch.Tensor:
    """[cos(t f), sin(t f)], f_k = exp(-ln(10000) k / (freq_dim/2)); t in [0, 1], not scaled by 1000
    (docs/model.md §2.3)."""
    half = freq_dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = t.double()[:, None] * f[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def adaln_curve(dense: dict[str, torch.Tensor], cfg: DiTConfig) -> torch.Tensor:
    """silu(temb(t)) at t = k/(grid-1), k = 0..grid-1: [grid, time_embed_dim] fp64."""
    t = torch.linspace(0.0, 1.0, cfg.adaln_curve_grid, dtype=torch.float64)
    w1, b1 = dense["time_embedder.proj_in.weight"].double(), dense["time_embedder.proj_in.bias"].double()
    w2, b2 = dense["time_embedder.proj_out.weight"].double(), dense["time_embedder.proj_out.bias"].double()
    temb = torch.nn.functional.silu(_sinusoid(t, cfg.freq_dim) @ w1.T + b1) @ w2.T + b2
    return torch.nn.functional.silu(temb)


def pruned_state_dict(int8_sd: dict, dense: dict[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """Curve-form AdaLN (docs/model.md §2.10 item 3): table = U S of the rank-r SVD of the mean-centred curve;
    every AdaLN projection becomes W V_r [out, r] with the curve mean folded into its bias; time_embedder removed."""
    curve_cfg = cfg.replace(adaln_form="curve")
    curve = adaln_curve(dense, cfg)
    mean = curve.mean(dim=0)
    u, s, vh = torch.linalg.svd(curve - mean, full_matrices=False)
    r = cfg.adaln_curve_rank
    table, basis = (u[:, :r] * s[:r]).float(), vh[:r].T  # basis [time_embed_dim, r]
    out: dict[str, torch.Tensor] = {}
    for key, spec in expected_specs(curve_cfg, gated(INT8_CONVROT_PRUNED, cfg)).items():
        if key == "adaln_t_table":
            out[key] = table
        elif ".adaln_proj.linear." in key:
            w = dense[key.replace(".bias", ".weight")].double()
            value = w @ basis if key.endswith(".weight") else dense[key].double() + w @ mean
            out[key] = value.to(_ST_DTYPE[spec.store])
        else:
            out[key] = int8_sd[key]
    return out


def tiny_state_dict(cfg: DiTConfig, variant: TinyVariant, seed: int = 0) -> dict[str, torch.Tensor]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    dense = dense_state_dict(cfg.replace(adaln_form="mlp"), seed)
    if variant == "bf16":
        return dense
    int8 = int8_state_dict(dense, cfg.replace(adaln_form="mlp"))
    return int8 if variant == "int8_convrot" else pruned_state_dict(int8, dense, cfg)


# ================================================================================================================
# Writing files
# ================================================================================================================


def write_safetensors_streaming(
    path: str | Path, plan: list[tuple[str, tuple[int, ...], str]], items: Iterator[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a safetensors file whose header is known up front (`plan`: key, shape, dtype), consuming `items`
    ((key, tensor) in plan order) one at a time, so no more than one tensor is held in host memory."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, shape, dtype in plan:
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as safetensors writes it
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for (key, shape, dtype), (got_key, tensor) in zip(plan, items, strict=True):
            if got_key != key or tuple(tensor.shape) != tuple(shape) or _ST_NAME[tensor.dtype] != dtype:
                raise ValueError(
                    f"stream item {got_key} {tensor.dtype}{list(tensor.shape)} != plan {key} {dtype}{list(shape)}"
                )
            fh.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return path


def save_state_dict(sd: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    plan = [(k, tuple(t.shape), _ST_NAME[t.dtype]) for k, t in sd.items()]
    return write_safetensors_streaming(path, plan, iter(sd.items()), metadata)


def file_metadata(cfg: DiTConfig, qkv_layout: str = "stacked", partition: str = FL2VA) -> dict[str, str]:
    """What our writers state in a file: the whole config (so the block count is declared, not guessed from the
    blocks present), the q/k/v row order and the partition (docs/checkpoints.md)."""
    return {METADATA_CONFIG: json.dumps(dataclasses.asdict(cfg), separators=(",", ":")), METADATA_QKV: qkv_layout,
            METADATA_PARTITION: partition}


def write_tiny_checkpoint(cfg: DiTConfig, path: str | Path, variant: TinyVariant = "bf16", seed: int = 0,
                          metadata: bool = True, partition: str = FL2VA) -> Path:
    """One ComfyUI-layout single file of the given variant and partition (the two partitions differ in weights
    only: give them different seeds). `metadata=False` writes what a ComfyUI repack holds: the tensors and nothing
    that states the config, the q/k/v order or the partition."""
    file_cfg = cfg.replace(adaln_form="curve" if variant == "int8_convrot_pruned" else "mlp")
    meta = file_metadata(file_cfg, partition=partition) if metadata else None
    return save_state_dict(tiny_state_dict(cfg, variant, seed), path, meta)


def _write_sharded(sd: dict[str, torch.Tensor], out_dir: Path, stem: str, n_shards: int, config: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = list(sd)
    per = -(-len(keys) // n_shards)
    weight_map = {}
    for i in range(n_shards):
        name = f"{stem}-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {k: sd[k] for k in keys[i * per : (i + 1) * per]}
        save_state_dict(chunk, out_dir / name)
        weight_map.update({k: name for k in chunk})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def diffusers_config(cfg: DiTConfig) -> dict:
    return {
        "_class_name": "MiniMaxH3Transformer3DModel", "num_attention_heads": cfg.num_heads,
        "attention_head_dim": cfg.head_dim, "hidden_size": cfg.hidden, "num_layers": cfg.num_layers,
        "num_refiner_layers": cfg.num_refiner_layers, "ffn_dim": cfg.ffn, "in_channels": cfg.in_channels,
        "audio_in_channels": cfg.audio_in_channels, "patch_size": list(cfg.patch), "text_dim": cfg.text_dim,
        "freq_dim": cfg.freq_dim, "time_embed_hidden_dim": cfg.time_embed_hidden, "time_embed_dim": cfg.time_embed_dim,
        "rope_freq_dim": cfg.rope_freq_dim, "rope_theta": cfg.rope_theta, "norm_eps": cfg.eps,
        "qk_norm_eps": cfg.eps, "final_norm_eps": cfg.eps,
    }


def write_tiny_diffusers_dir(cfg: DiTConfig, root: str | Path, seed: int = 0, n_shards: int = 2) -> Path:
    """`root/transformer/` with diffusers-named bf16 shards, index json and config.json; returns root."""
    sd = to_diffusers(tiny_state_dict(cfg, "bf16", seed))
    _write_sharded(sd, Path(root) / "transformer", "diffusion_pytorch_model", n_shards, diffusers_config(cfg))
    return Path(root)


def interleave_qkv(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[q_all; k_all; v_all] -> release per-head order [h0: q k v, h1: q k v, ...]."""
    return w.view(QKV_SECTIONS, num_heads, head_dim, -1).transpose(0, 1).reshape(w.shape)


def write_tiny_release_dir(cfg: DiTConfig, root: str | Path, seed: int = 0, n_shards: int = 2) -> Path:
    """`root/transformer/` as the raw release shards: our names, qkv rows per-head interleaved."""
    sd = tiny_state_dict(cfg, "bf16", seed)
    sd = {k: interleave_qkv(t, cfg.num_heads, cfg.head_dim) if k.endswith(".attn.qkv_proj.weight") else t
          for k, t in sd.items()}
    config = {"num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim, "hidden_size": cfg.hidden,
              "num_layers": cfg.num_layers, "token_refiner_num_layers": cfg.num_refiner_layers,
              "ffn_hidden_size": cfg.ffn, "patch_size": list(cfg.patch), "latents_dim": cfg.in_channels,
              "rope_theta": cfg.rope_theta}
    _write_sharded(sd, Path(root) / "transformer", "model", n_shards, config)
    return Path(root)


# ================================================================================================================
# Full-size random int8-convrot weights (GPU benchmark)
# ================================================================================================================


def _int8_plan(cfg: DiTConfig, pruned: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, dtype) of the int8_convrot layout (`pruned`: the curve-form AdaLN variant, ≈19.5 GiB at full
    size) with the comfy_quant blob lengths filled in."""
    g_lin, g_ada = linear_groupsize(cfg), adaln_groupsize(cfg)
    layout = cfg.replace(adaln_form="curve") if pruned else cfg.replace(adaln_form="mlp")
    plan = []
    for key, spec in expected_specs(layout, gated(INT8_CONVROT_PRUNED if pruned else INT8_CONVROT, cfg)).items():
        shape = spec.shape
        if key.endswith(".comfy_quant"):
            shape = (encode_comfy_quant(g_ada if ".adaln_proj." in key else g_lin).numel(),)
        plan.append((key, shape, spec.store))
    return plan


def iter_random_int8_convrot_weights(
    cfg: DiTConfig, seed: int = 0, device: torch.device | str = "cpu", quantize: bool = True, pruned: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) of a random int8_convrot checkpoint in file order, one tensor at a time, on `device`.

    quantize=True draws Gaussian weights and ConvRot-quantizes them (realistic, needs a GPU to be quick at full
    size); quantize=False draws the int8 codes directly with scale chosen so the dequantised std is 1/sqrt(K).
    pruned=True gives the curve-form ("pruned") variant: random `adaln_t_table` and rank-r fp16 AdaLN projections
    in place of the time embedder and the int8 AdaLN (random, not an SVD of a real curve: a benchmark file).
    """
    g_lin, g_ada = linear_groupsize(cfg), adaln_groupsize(cfg)
    pending: dict[str, torch.Tensor] = {}  # weight_scale / comfy_quant follow their weight in file order
    for key, shape, dtype in _int8_plan(cfg, pruned):
        if key in pending:
            yield key, pending.pop(key)
            continue
        if dtype != "I8":
            yield key, random_tensor(key, shape, cfg, seed, device).to(_ST_DTYPE[dtype])
            continue
        prefix = key[: -len(".weight")]
        g = g_ada if ".adaln_proj." in key else g_lin
        if quantize:
            q, scale = quantize_convrot(random_tensor(key, shape, cfg, seed, device), g)
        else:
            gen = _generator(seed, key, device)
            q = torch.randint(-127, 128, shape, generator=gen, device=device, dtype=torch.int8)
            scale = torch.full((shape[0], 1), 1.0 / (INT8_UNIFORM_STD * math.sqrt(shape[1])), device=device)
        pending[f"{prefix}.weight_scale"] = scale
        pending[f"{prefix}.comfy_quant"] = encode_comfy_quant(g).to(device)
        yield key, q


def write_random_int8_convrot_checkpoint(
    cfg: DiTConfig, path: str | Path, seed: int = 0, device: torch.device | str = "cpu", quantize: bool = True,
    pruned: bool = False, partition: str = FL2VA,
) -> Path:
    """Stream a full-size random int8_convrot checkpoint of one partition to one Comfy-layout file (about 34 GB at
    full size; the `pruned` curve-form variant ≈19.5 GiB, the file the 22 GB-card users run)."""
    items = iter_random_int8_convrot_weights(cfg, seed, device, quantize, pruned)
    return write_safetensors_streaming(path, _int8_plan(cfg, pruned), items,
                                      file_metadata(cfg.replace(adaln_form="curve" if pruned else "mlp"),
                                                    partition=partition))
