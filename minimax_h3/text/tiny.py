"""Embedded tiny text encoder: a deterministic tokenizer.json + a tiny Qwen3-VL-shaped checkpoint.

Written as real files in the ComfyUI layout (``model.embed_tokens.weight``, ``model.layers.{i}.*``) so
the default run and the tests go through exactly the loaders real weights use. Outputs are noise.

Also writes quantised / release-layout variants of the same weights for loader tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from minimax_h3.kernels.int8 import encode_comfy_quant, quantize_convrot
from minimax_h3.text.checkpoint import LINEARS, expected_shapes
from minimax_h3.text.config import N_BYTES, TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE, ConditionerConfig
from stagekit.checkpoints import CheckpointError, read_header

TINY_SEED = 20261130
TINY_CHECKPOINT = "qwen3vl_tiny_minimax_h3_{variant}.safetensors"
TINY_CONVROT_GROUPSIZE = 16  # power of 4 dividing the tiny in_features (64, 128)
VARIANTS = ("bf16", "fp32", "int8_convrot", "nvfp4_awq")


def build_tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE with the 256 byte symbols and no merges (every UTF-8 byte is one token), plus the
    H3 special tokens as added tokens. Constructed, not trained, so it is identical on every machine."""
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(sorted(byte_symbols))}
    if len(vocab) != N_BYTES:
        raise RuntimeError(f"byte-level alphabet has {len(vocab)} symbols, expected {N_BYTES}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()  # Qwen's tokenizer normalises NFC too
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    if tok.get_vocab_size(with_added_tokens=True) != TINY_VOCAB_SIZE:
        raise RuntimeError("tiny tokenizer size drifted")
    return tok


def tiny_weights(cfg=None, seed: int = TINY_SEED, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights by module-relative name (``embed_tokens.weight``, ``layers.{i}.*``), deterministic."""
    cfg = cfg or ConditionerConfig.tiny()
    n = num_layers or cfg.num_layers
    shapes = expected_shapes(ConditionerConfig(**{**cfg.__dict__, "num_layers": n, "total_layers": max(n, cfg.total_layers)}))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # RMSNorm gains around 1
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.startswith("embed_tokens"):
            out[name] = torch.randn(shape, generator=g)
        else:  # ~unit-variance outputs so the tiny model's states are not degenerate
            out[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    return out


def tiny_visual_weights(vcfg=None, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """fp32 vision-tower weights by module-relative name (``blocks.0.attn.qkv.weight``, ``deepstack_merger_list.*``),
    deterministic; shapes from transformers' Qwen3VLVisionModel for the tiny vision config."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from minimax_h3.text.vision import VisionConfig

    vcfg = vcfg or VisionConfig.tiny()
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3VLVisionModel(vcfg.hf_config()).state_dict().items()}
    g = torch.Generator().manual_seed(seed + 7)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        r = torch.randn(shape, generator=g)
        if name.endswith(".bias"):
            out[name] = 0.05 * r
        elif len(shape) == 1:  # LayerNorm gains around 1
            out[name] = 1.0 + 0.1 * r
        elif name.startswith("pos_embed"):
            out[name] = 0.5 * r
        else:  # ~unit-variance outputs
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            out[name] = r / fan_in ** 0.5
    return out


def _quantize_int8_tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax() / 127).clamp(min=1e-30).float()
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def _nvfp4_entries(base: str, w: torch.Tensor, g: torch.Generator, awq: bool) -> dict[str, torch.Tensor]:
    import comfy_kitchen as ck  # fixture-only dependency (quantiser)

    cols = w.shape[1]
    out = {}
    if awq:
        # AWQ smoothing: store Wq ~ W / s and s, so that (x * s) @ Wq^T == x @ W^T.
        s = torch.exp(0.3 * torch.randn(cols, generator=g))
        w = w / s
        out[f"{base}.pre_quant_scale"] = s.to(torch.bfloat16)
    gscale = (w.abs().amax() / (448.0 * 6.0)).float()
    q, bs = ck.quantize_nvfp4(w.float(), gscale, pad_16x=(w.shape[0] % 16 != 0 or cols % 16 != 0))
    out[f"{base}.weight"] = q
    out[f"{base}.weight_scale"] = bs
    out[f"{base}.weight_scale_2"] = gscale.reshape(1)
    out[f"{base}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    return out


def tiny_file_tensors(
    weights: dict[str, torch.Tensor],
    *,
    variant: str = "bf16",
    layout: str = "comfy",
    seed: int = TINY_SEED,
    awq: bool = True,
    extra_full_model: bool = False,
    visual: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """File tensors for ``weights`` in a given variant/layout.

    ``extra_full_model`` adds the parts of a full language model the conditioner ignores (final norm, lm_head).
    ``visual``: vision-tower weights, stored dense (``visual.*`` / ``model.visual.*``) in every variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if layout not in ("comfy", "release"):
        raise ValueError(f"layout must be 'comfy' or 'release', got {layout!r}")
    prefix = "model." if layout == "comfy" else "model.language_model."
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        base = prefix + name[: -len(".weight")]
        is_linear = name.startswith("layers.") and base.endswith(LINEARS)
        if variant in ("bf16", "fp32") or not (is_linear or name.startswith("embed_tokens")):
            out[prefix + name] = w.to(torch.float32 if variant == "fp32" else torch.bfloat16).contiguous()
        elif name.startswith("embed_tokens"):
            if variant == "nvfp4_awq":  # the real nvfp4 file stores the embedding int8 tensor-wise
                q, s = _quantize_int8_tensorwise(w)
                out[f"{base}.weight"], out[f"{base}.weight_scale"] = q, s
                out[f"{base}.comfy_quant"] = encode_comfy_quant(None)
            else:
                out[prefix + name] = w.to(torch.bfloat16).contiguous()
        elif variant == "int8_convrot":
            q, s = quantize_convrot(w, TINY_CONVROT_GROUPSIZE)
            out[f"{base}.weight"], out[f"{base}.weight_scale"] = q, s
            out[f"{base}.comfy_quant"] = encode_comfy_quant(TINY_CONVROT_GROUPSIZE)
        else:
            out.update(_nvfp4_entries(base, w, g, awq))
    vprefix = "visual." if layout == "comfy" else "model.visual."
    for name, w in (visual or {}).items():
        out[vprefix + name] = w.to(torch.float32 if variant == "fp32" else torch.bfloat16).contiguous()
    if extra_full_model:
        h = weights["embed_tokens.weight"].shape[1]
        out[prefix + "norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out["lm_head.weight"] = weights["embed_tokens.weight"].to(torch.bfloat16).clone()
    return out


def write_tiny_model(
    out_dir: str | Path,
    *,
    variant: str = "bf16",
    layout: str = "comfy",
    num_layers: int | None = None,
    seed: int = TINY_SEED,
    awq: bool = True,
    extra_full_model: bool = False,
    overwrite: bool = False,
    with_visual: bool = True,
    used_layers: int | None = None,
) -> Path:
    """Write ``tokenizer.json`` + the tiny checkpoint into ``out_dir``; returns the checkpoint path.

    ``num_layers`` > the used layers writes extra layers (a "full" model the loader truncates). ``used_layers``:
    the conditioning layer the header declares (``minimax_h3_te``), default the embedded model's 2; a deeper tiny
    encoder is ``num_layers == used_layers == n`` (the loader reads its depth from the file).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_path = out_dir / "tokenizer.json"
    if overwrite or not tok_path.exists():
        build_tiny_tokenizer().save(str(tok_path))
    name = TINY_CHECKPOINT.format(variant=variant if layout == "comfy" else f"{variant}_release")
    path = out_dir / name
    if path.exists() and not overwrite and (not with_visual or _has_visual(path)):
        return path  # (a file cached before the vision tower existed is rewritten)
    cfg = ConditionerConfig.tiny(num_layers=used_layers or 2)
    weights = tiny_weights(cfg, seed=seed, num_layers=num_layers)
    visual = tiny_visual_weights(cfg.vision, seed=seed) if with_visual else None
    tensors = tiny_file_tensors(weights, variant=variant, layout=layout, seed=seed, awq=awq,
                                extra_full_model=extra_full_model, visual=visual)
    meta = {
        "minimax_h3_te": json.dumps({"num_hidden_layers": cfg.num_layers, "output": f"unnormalized_hidden_after_layer_{cfg.num_layers}"}),
        "h3_tiny": json.dumps({"seed": seed, "variant": variant, "layout": layout, "note": "random weights; output is noise"}),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


def _has_visual(path: Path) -> bool:
    try:
        return any(k.startswith(("visual.", "model.visual.")) for k in read_header(path).tensors)
    except CheckpointError:  # unreadable cache file: rewrite it
        return False


def ensure_tiny_model(out_dir: str | Path) -> Path:
    """The embedded default: create the bf16 tiny model on first use, reuse it afterwards."""
    return write_tiny_model(out_dir, variant="bf16")
