"""Loading MiniMax-H3 DiT checkpoints, one tensor-parallel rank at a time.

Supported inputs (h3_architecture.md §2.2, §2.10, §8):
  * ComfyUI single files: bf16; `*_int8_convrot` (block linears int8 ConvRot g256, block AdaLN int8 g64);
    "pruned" curve-form int8 (`adaln_t_table` [1025, 8], AdaLN weights [., 8], no time_embedder).
  * diffusers directory (`transformer/` with sharded safetensors + index + config.json): diffusers names,
    separate to_q/to_k/to_v, fc1 halves stored [value; gate].
  * raw release shards (release names, qkv rows per-head interleaved [h0: q k v, h1: q k v, ...]).

Everything is expressed in *our* key names (= ComfyUI names, qkv [q_all; k_all; v_all], fc1 [gate; value]).
Detection, config inference and validation use the safetensors headers only; tensor data is read afterwards, and
for tensor-parallel keys only this rank's rows/columns are read (safetensors `get_slice`).

TP layout for size n, rank r (must match dit_svc/tp.py):
  attn.qkv_proj   -> rows [q of heads r*h/n..(r+1)*h/n ; k of those heads ; v of those heads]  (+ weight_scale rows)
  attn.out_proj   -> columns of those heads                                                    (weight_scale whole)
  mlp.fc1         -> rows [gate r*F/n..(r+1)*F/n ; value same rows]                            (+ weight_scale rows)
  mlp.fc2         -> columns r*F/n..(r+1)*F/n                                                   (weight_scale whole)
  *.adaln_proj.linear weight/bias -> n contiguous equal row ranges
  everything else -> replicated
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Literal

import torch
from safetensors import safe_open

from dit_svc.config import DiTConfig
from stagekit.checkpoints import CheckpointError, HeaderEntry, read_header
from stagekit.quant import QuantFormatError, QuantizedWeight, dequantize_convrot, parse_comfy_quant

log = logging.getLogger(__name__)

MAX_NAMED = 10  # keys listed per category in a CheckpointError
QKV_SECTIONS = 3  # q, k, v
FC1_SECTIONS = 2  # gate, value
COMFY_MODEL_PREFIX = "model.diffusion_model."  # DiT tensors inside a ComfyUI all-in-one checkpoint

QuantMode = Literal["kernel", "dequant"]
Layout = Literal["comfy", "release", "diffusers"]
TPRule = Literal["qkv", "fc1", "cols", "rows", "replicate"]

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_TORCH_DTYPE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8}



# ================================================================================================================
# Variant
# ================================================================================================================


@dataclass(frozen=True)
class Variant:
    layout: Layout  # key naming / qkv order of the source
    linears: Literal["bf16", "int8"]  # block attention/MLP linears
    adaln: Literal["dense", "int8", "curve"]  # block AdaLN projections

    @property
    def name(self) -> str:
        known = {("bf16", "dense"): "bf16", ("int8", "int8"): "int8_convrot", ("int8", "curve"): "int8_convrot_pruned"}
        base = known.get((self.linears, self.adaln), f"{self.linears}_adaln-{self.adaln}")
        return base if self.layout == "comfy" else f"{self.layout}_{base}"


BF16 = Variant("comfy", "bf16", "dense")
INT8_CONVROT = Variant("comfy", "int8", "int8")
INT8_CONVROT_PRUNED = Variant("comfy", "int8", "curve")


# ================================================================================================================
# Expected keys (our names) for a config + variant
# ================================================================================================================


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # () for the variable-length comfy_quant blob: shape not checked
    dtype: str  # safetensors dtype used when *writing* (validation only checks the class: float / I8 / U8)


def _linear(specs: dict, prefix: str, n_out: int, n_in: int, dtype: str, bias: bool) -> None:
    specs[f"{prefix}.weight"] = TensorSpec((n_out, n_in), dtype)
    if bias:
        specs[f"{prefix}.bias"] = TensorSpec((n_out,), dtype)


def _int8_linear(specs: dict, prefix: str, n_out: int, n_in: int) -> None:
    specs[f"{prefix}.weight"] = TensorSpec((n_out, n_in), "I8")
    specs[f"{prefix}.weight_scale"] = TensorSpec((n_out, 1), "F32")
    specs[f"{prefix}.comfy_quant"] = TensorSpec((), "U8")


def _attn_mlp_specs(specs: dict, prefix: str, cfg: DiTConfig, int8: bool) -> None:
    shapes = {
        "attn.qkv_proj": (QKV_SECTIONS * cfg.attn_inner, cfg.hidden),
        "attn.out_proj": (cfg.hidden, cfg.attn_inner),
        "mlp.fc1": (FC1_SECTIONS * cfg.ffn, cfg.hidden),
        "mlp.fc2": (cfg.hidden, cfg.ffn),
    }
    for name, (n_out, n_in) in shapes.items():
        if int8:
            _int8_linear(specs, f"{prefix}.{name}", n_out, n_in)
        else:
            _linear(specs, f"{prefix}.{name}", n_out, n_in, "BF16", bias=False)
    for norm in ("norm1", "norm2"):
        specs[f"{prefix}.{norm}.weight"] = TensorSpec((cfg.hidden,), "BF16")
    for norm in ("q_norm", "k_norm"):
        specs[f"{prefix}.attn.{norm}.weight"] = TensorSpec((cfg.head_dim,), "BF16")


def expected_specs(cfg: DiTConfig, variant: Variant) -> dict[str, TensorSpec]:
    """All tensors of a checkpoint of this config and variant, in our (ComfyUI) key names, file order."""
    curve = variant.adaln == "curve"
    adaln_in = cfg.adaln_curve_rank if curve else cfg.time_embed_dim
    adaln_dtype = "F16" if curve else "BF16"  # the pruned file stores the rank-8 projections in fp16 (§2.10)
    s: dict[str, TensorSpec] = {}
    _linear(s, "video_patch_proj", cfg.hidden, cfg.video_patch_dim, "F32", bias=True)
    _linear(s, "audio_patch_proj", cfg.hidden, cfg.audio_in_channels, "F32", bias=True)
    _linear(s, "condition_proj", cfg.hidden, cfg.text_dim, "BF16", bias=True)
    if curve:
        s["adaln_t_table"] = TensorSpec((cfg.adaln_curve_grid, cfg.adaln_curve_rank), "F32")
    else:
        _linear(s, "time_embedder.proj_in", cfg.time_embed_hidden, cfg.freq_dim, "F32", bias=True)
        _linear(s, "time_embedder.proj_out", cfg.time_embed_dim, cfg.time_embed_hidden, "F32", bias=True)
    s["rope.inv_freq"] = TensorSpec((cfg.rope_freq_dim,), "F32")
    for i in range(cfg.num_refiner_layers):
        _attn_mlp_specs(s, f"token_refiner.blocks.{i}", cfg, int8=False)  # refiner stays bf16 in every variant
    if cfg.num_refiner_layers:
        s["token_refiner.final_norm.weight"] = TensorSpec((cfg.hidden,), "BF16")
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        _attn_mlp_specs(s, p, cfg, int8=variant.linears == "int8")
        if variant.adaln == "int8":
            _int8_linear(s, f"{p}.adaln_proj.linear", cfg.adaln_out, adaln_in)
            s[f"{p}.adaln_proj.linear.bias"] = TensorSpec((cfg.adaln_out,), "BF16")
        else:
            _linear(s, f"{p}.adaln_proj.linear", cfg.adaln_out, adaln_in, adaln_dtype, bias=True)
    s["final_layer.norm.weight"] = TensorSpec((cfg.hidden,), "BF16")
    _linear(s, "final_layer.adaln_proj.linear", cfg.final_adaln_out, adaln_in, adaln_dtype, bias=True)
    _linear(s, "final_layer.video_out", cfg.video_patch_dim, cfg.hidden, "F32", bias=True)
    _linear(s, "final_layer.audio_out", cfg.audio_in_channels, cfg.hidden, "F32", bias=True)
    return s


OPTIONAL_KEYS = ("rope.inv_freq",)  # diffusers drops it; recomputed bit-identically from the config


def tp_rule(key: str) -> TPRule:
    """How a key of our layout is split across tensor-parallel ranks (see module docstring)."""
    if key.endswith((".attn.qkv_proj.weight", ".attn.qkv_proj.weight_scale")):
        return "qkv"
    if key.endswith((".mlp.fc1.weight", ".mlp.fc1.weight_scale")):
        return "fc1"
    if key.endswith((".attn.out_proj.weight", ".mlp.fc2.weight")):
        return "cols"
    if ".adaln_proj.linear." in key and not key.endswith(".comfy_quant"):
        return "rows"
    return "replicate"


# ================================================================================================================
# Files and headers (no tensor data read here)
# ================================================================================================================


def _resolve_files(path: Path) -> tuple[list[Path], Path | None]:
    """Return the safetensors files of a checkpoint and the directory holding config.json (None for a single file)."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / "transformer").is_dir():
        path = path / "transformer"
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{indexes[0]}: unreadable index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{indexes[0]} lists {len(absent)} missing shard(s): {absent[:MAX_NAMED]}")
        return files, path
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files, path


def _strip_model_prefix(entries: dict[str, HeaderEntry]) -> dict[str, HeaderEntry]:
    """ComfyUI "all in one" files prefix the DiT with `model.diffusion_model.` next to VAE / text-encoder tensors:
    keep only the DiT tensors, under their unprefixed names."""
    if not any(k.startswith(COMFY_MODEL_PREFIX) for k in entries):
        return entries
    n = len(COMFY_MODEL_PREFIX)
    kept = {k[n:]: replace(e, disk_key=k) for k, e in entries.items() if k.startswith(COMFY_MODEL_PREFIX)}
    log.info("ignoring %d tensors outside %r", len(entries) - len(kept), COMFY_MODEL_PREFIX)
    return kept


def read_headers(path: str | Path) -> tuple[dict[str, HeaderEntry], Path | None, bool]:
    """All tensors of a checkpoint (source names) -> (entries, config dir, is_directory)."""
    files, cfg_dir = _resolve_files(Path(path))
    merged: dict[str, HeaderEntry] = {}
    for f in files:
        for key, entry in read_header(f).items():
            if key in merged:
                raise CheckpointError(f"tensor {key!r} appears in both {merged[key].file} and {f}")
            merged[key] = entry
    return _strip_model_prefix(merged), cfg_dir, cfg_dir is not None


# ================================================================================================================
# Source layouts -> our names
# ================================================================================================================

# Our name -> diffusers name (h3_architecture.md §2.2). Prefix renames apply to the start of a key only (an
# unanchored "proj_in." would also hit "audio_proj_in."); infix renames apply anywhere.
DIFFUSERS_PREFIX_RENAMES = (
    ("blocks.", "transformer_blocks."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
)
DIFFUSERS_INFIX_RENAMES = (
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
    (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."),
    (".mlp.fc2.", ".ff.net.2."),
)


def _rename(key: str, pairs_prefix, pairs_infix) -> str:
    for old, new in pairs_prefix:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    for old, new in pairs_infix:
        key = key.replace(old, new)
    return key


def to_diffusers_name(key: str) -> str:
    """Our (ComfyUI) name -> diffusers name. qkv maps to the `to_q` name; callers split it themselves."""
    key = _rename(key, DIFFUSERS_PREFIX_RENAMES, DIFFUSERS_INFIX_RENAMES)
    return key.replace(".attn.qkv_proj.", ".attn.to_q.")


def from_diffusers_name(key: str) -> str:
    swap = lambda pairs: tuple((b, a) for a, b in pairs)  # noqa: E731
    return _rename(key, swap(DIFFUSERS_PREFIX_RENAMES), swap(DIFFUSERS_INFIX_RENAMES))


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives and how its rows are arranged in the source."""

    keys: tuple[str, ...]  # source key(s); three for diffusers qkv (q, k, v)
    arrangement: Literal["same", "qkv_split", "qkv_interleaved", "fc1_swapped"] = "same"


def _detect_layout(src_keys: Iterable[str], is_directory: bool) -> Layout:
    src_keys = list(src_keys)
    if any(k.startswith("transformer_blocks.") or k.startswith("proj_in.") for k in src_keys):
        return "diffusers"
    # Raw release shards and the Comfy single file share names and shapes; only the qkv row order differs, and it
    # cannot be seen in the data. The release ships sharded directories; every published single file is stacked.
    return "release" if is_directory else "comfy"


def map_sources(entries: dict[str, HeaderEntry], layout: Layout) -> dict[str, Source]:
    """Our key -> Source, for every tensor of the checkpoint (unknown source keys map to themselves)."""
    if layout == "comfy":
        return {k: Source((k,)) for k in entries}
    if layout == "release":
        return {k: Source((k,), "qkv_interleaved" if k.endswith(".attn.qkv_proj.weight") else "same") for k in entries}
    out: dict[str, Source] = {}
    for k in entries:
        if ".attn.to_k." in k or ".attn.to_v." in k:
            continue  # folded into the to_q entry
        ours = from_diffusers_name(k)
        if ".attn.to_q." in k:
            ours = ours.replace(".attn.to_q.", ".attn.qkv_proj.")
            out[ours] = Source((k, k.replace(".to_q.", ".to_k."), k.replace(".to_q.", ".to_v.")), "qkv_split")
        elif ours.endswith(".mlp.fc1.weight"):
            out[ours] = Source((k,), "fc1_swapped")
        else:
            out[ours] = Source((k,))
    orphans = [k for k in entries if (".attn.to_k." in k or ".attn.to_v." in k)
               and k.replace(".to_k.", ".to_q.").replace(".to_v.", ".to_q.") not in entries]
    for k in orphans:  # a to_k/to_v without its to_q: keep it visible so validation names it as unexpected
        out[k] = Source((k,))
    return out


def _virtual_entry(entries: dict[str, HeaderEntry], src: Source) -> HeaderEntry:
    """Shape/dtype of our tensor as assembled from its source(s)."""
    first = entries[src.keys[0]]
    if src.arrangement != "qkv_split":
        return first
    parts = [entries.get(k) for k in src.keys]
    if any(p is None for p in parts):
        return HeaderEntry(first.file, (-1,), first.dtype)  # reported as misshapen
    rows = sum(p.shape[0] for p in parts)
    same_cols = len({p.shape[1:] for p in parts}) == 1
    return HeaderEntry(first.file, (rows, *first.shape[1:]) if same_cols else (-1,), first.dtype)


# ================================================================================================================
# Inspection: variant + config from the header
# ================================================================================================================


@dataclass
class CheckpointInfo:
    path: Path
    variant: Variant
    config: DiTConfig  # inferred from shapes (patch split and rope_theta/eps from config.json or the base config)
    entries: dict[str, HeaderEntry]  # source names
    sources: dict[str, Source]  # our names
    shapes: dict[str, HeaderEntry] = field(default_factory=dict)  # our names, assembled shape

    @property
    def files(self) -> list[Path]:
        return sorted({e.file for e in self.entries.values()})


def _detect_variant(shapes: dict[str, HeaderEntry], layout: Layout) -> Variant:
    qkv = shapes.get("blocks.0.attn.qkv_proj.weight")
    adaln = shapes.get("blocks.0.adaln_proj.linear.weight")
    if qkv is None or adaln is None:
        raise CheckpointError(
            "not a MiniMax-H3 DiT checkpoint: no `blocks.0.attn.qkv_proj.weight` / `blocks.0.adaln_proj.linear.weight` "
            f"(first keys: {sorted(shapes)[:MAX_NAMED]})"
        )
    linears = "int8" if qkv.dtype == "I8" else "bf16"
    if "adaln_t_table" in shapes:
        adaln_kind = "curve"
    else:
        adaln_kind = "int8" if adaln.dtype == "I8" else "dense"
    return Variant(layout, linears, adaln_kind)


def _count_indexed(shapes: dict[str, HeaderEntry], prefix: str) -> int:
    """Number of `prefix{i}.` blocks (highest index + 1, so a block missing in the middle shows up as missing keys)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    idx = {int(m.group(1)) for k in shapes if (m := pattern.match(k))}
    return max(idx) + 1 if idx else 0


def _read_json_config(cfg_dir: Path | None) -> dict:
    if cfg_dir is None or not (cfg_dir / "config.json").is_file():
        return {}
    try:
        return json.loads((cfg_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_dir / 'config.json'}: unreadable: {e}") from e


def _dim(shapes: dict[str, HeaderEntry], key: str, axis: int, default: int) -> int:
    e = shapes.get(key)
    return e.shape[axis] if e is not None and len(e.shape) > axis else default


def infer_config(shapes: dict[str, HeaderEntry], variant: Variant, base: DiTConfig, json_cfg: dict) -> DiTConfig:
    """DiTConfig dims from header shapes; what shapes cannot tell comes from config.json, then from `base`."""
    g = json_cfg.get
    patch = tuple(g("patch_size", base.patch))
    head_dim = _dim(shapes, "blocks.0.attn.q_norm.weight", 0, base.head_dim)
    hidden = _dim(shapes, "condition_proj.weight", 0, base.hidden)
    vpd = _dim(shapes, "video_patch_proj.weight", 1, base.video_patch_dim)
    changes = dict(
        hidden=hidden,
        head_dim=head_dim,
        num_heads=_dim(shapes, "blocks.0.attn.qkv_proj.weight", 0, QKV_SECTIONS * base.attn_inner)
        // (QKV_SECTIONS * head_dim),
        num_layers=_count_indexed(shapes, "blocks."),
        num_refiner_layers=_count_indexed(shapes, "token_refiner.blocks."),
        ffn=_dim(shapes, "blocks.0.mlp.fc2.weight", 1, base.ffn),
        patch=patch,
        in_channels=vpd // math.prod(patch) if vpd % math.prod(patch) == 0 else vpd,
        audio_in_channels=_dim(shapes, "audio_patch_proj.weight", 1, base.audio_in_channels),
        text_dim=_dim(shapes, "condition_proj.weight", 1, base.text_dim),
        freq_dim=_dim(shapes, "time_embedder.proj_in.weight", 1, g("freq_dim", g("timestep_input_dim", base.freq_dim))),
        time_embed_hidden=_dim(shapes, "time_embedder.proj_in.weight", 0, base.time_embed_hidden),
        time_embed_dim=_dim(shapes, "time_embedder.proj_out.weight", 0, g("time_embed_dim", base.time_embed_dim)),
        rope_freq_dim=_dim(shapes, "rope.inv_freq", 0, g("rope_freq_dim", g("rope_inv_freq_len", base.rope_freq_dim))),
        rope_theta=float(g("rope_theta", base.rope_theta)),
        eps=float(g("norm_eps", base.eps)),
        adaln_form="curve" if variant.adaln == "curve" else "mlp",
    )
    if variant.adaln == "curve":
        changes["adaln_curve_grid"] = _dim(shapes, "adaln_t_table", 0, base.adaln_curve_grid)
        changes["adaln_curve_rank"] = _dim(shapes, "adaln_t_table", 1, base.adaln_curve_rank)
    else:
        changes["time_embed_dim"] = _dim(shapes, "blocks.0.adaln_proj.linear.weight", 1, changes["time_embed_dim"])
    try:
        return base.replace(**changes)
    except ValueError as e:
        raise CheckpointError(f"checkpoint shapes give an invalid DiT config: {e}") from e


def inspect_checkpoint(
    path: str | Path, base: DiTConfig | None = None, qkv_layout: Layout | None = None
) -> CheckpointInfo:
    """Variant + inferred config from the safetensors header(s) only. `qkv_layout` overrides the comfy/release
    guess for files whose qkv order cannot be detected (a hand-merged single file of release shards)."""
    entries, cfg_dir, is_dir = read_headers(path)
    layout = _detect_layout(entries, is_dir)
    if qkv_layout is not None and layout != "diffusers":
        layout = qkv_layout
    sources = map_sources(entries, layout)
    shapes = {ours: _virtual_entry(entries, src) for ours, src in sources.items()}
    variant = _detect_variant(shapes, layout)
    config = infer_config(shapes, variant, base or DiTConfig.full(), _read_json_config(cfg_dir))
    return CheckpointInfo(Path(path), variant, config, entries, sources, shapes)


def _dtype_class(dtype: str) -> str:
    return "float" if dtype in _FLOAT_DTYPES else dtype


def _named(keys: list[str]) -> str:
    more = f" ... (+{len(keys) - MAX_NAMED} more)" if len(keys) > MAX_NAMED else ""
    return ", ".join(keys[:MAX_NAMED]) + more


def validate(info: CheckpointInfo, cfg: DiTConfig) -> None:
    """Compare the checkpoint's keys/shapes/dtype classes with what `cfg` needs; raise naming every problem kind."""
    file_form = "curve" if info.variant.adaln == "curve" else "mlp"
    if file_form != cfg.adaln_form:
        raise CheckpointError(
            f"{info.path} is a {info.variant.name} checkpoint (AdaLN {info.variant.adaln}) but the config has "
            f"adaln_form={cfg.adaln_form!r}; use cfg.replace(adaln_form={file_form!r})"
        )
    want = expected_specs(cfg, info.variant)
    have = info.shapes
    missing = [k for k in want if k not in have and k not in OPTIONAL_KEYS]
    unexpected = [k for k in have if k not in want]
    bad = []
    for k, spec in want.items():
        e = have.get(k)
        if e is None:
            continue
        shape_ok = spec.shape == () or e.shape == spec.shape
        if not shape_ok or _dtype_class(e.dtype) != _dtype_class(spec.dtype):
            bad.append(f"{k} {e.dtype}{list(e.shape)} (expected {spec.dtype}{list(spec.shape)})")
    if missing or unexpected or bad:
        parts = [f"{info.path} ({info.variant.name}) does not match the DiT config:"]
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_named(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_named(unexpected)}")
        if bad:
            parts.append(f"{len(bad)} misshapen key(s): {_named(bad)}")
        raise CheckpointError("\n  ".join(parts))


# ================================================================================================================
# Reading (per rank)
# ================================================================================================================


class _Reader:
    """Open safetensors handles, one per file; every read goes through get_slice unless it is a whole tensor."""

    def __init__(self, entries: dict[str, HeaderEntry]) -> None:
        self._entries = entries
        self._handles: dict[Path, object] = {}

    def _disk(self, key: str) -> str:
        return self._entries[key].disk_key or key

    def _handle(self, key: str):
        file = self._entries[key].file
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{file}: cannot open: {e}") from e
        return self._handles[file]

    def whole(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(self._disk(key))

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._handle(key).get_slice(self._disk(key))[lo:hi]

    def cols(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._handle(key).get_slice(self._disk(key))[:, lo:hi]


def _read_section_rows(
    reader: _Reader, src: Source, n_sections: int, section_rows: int, lo: int, hi: int, head_dim: int
) -> torch.Tensor:
    """Rows [lo, hi) of every section (q/k/v or gate/value) of our tensor, concatenated in our section order."""
    if src.arrangement == "qkv_split":
        return torch.cat([reader.rows(k, lo, hi) for k in src.keys])
    if src.arrangement == "fc1_swapped":  # diffusers stores [value; gate]
        gate = reader.rows(src.keys[0], section_rows + lo, section_rows + hi)
        return torch.cat([gate, reader.rows(src.keys[0], lo, hi)])
    if src.arrangement == "qkv_interleaved":
        return _read_interleaved_qkv(reader, src.keys[0], head_dim, lo, hi)
    key = src.keys[0]
    return torch.cat([reader.rows(key, s * section_rows + lo, s * section_rows + hi) for s in range(n_sections)])


def _read_interleaved_qkv(reader: _Reader, key: str, head_dim: int, lo: int, hi: int) -> torch.Tensor:
    """Release rows are [head0: q k v, head1: q k v, ...]; the heads of [lo, hi) form one contiguous row block,
    read once and reordered to [q of those heads; k; v]."""
    h0, h1 = lo // head_dim, hi // head_dim
    block = reader.rows(key, h0 * QKV_SECTIONS * head_dim, h1 * QKV_SECTIONS * head_dim)
    n_in = block.shape[1]
    return block.view(h1 - h0, QKV_SECTIONS, head_dim, n_in).transpose(0, 1).reshape(-1, n_in)


def _rank_range(total: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if total % tp_size:
        raise ValueError(f"{what} = {total} is not divisible by tensor-parallel size {tp_size}")
    step = total // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def _check_tp(cfg: DiTConfig, tp_rank: int, tp_size: int) -> None:
    """Fail before reading anything if this TP degree cannot shard the config."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    sharded = {"num_heads": cfg.num_heads, "ffn": cfg.ffn, "block AdaLN rows": cfg.adaln_out,
               "final AdaLN rows": cfg.final_adaln_out}
    for what, total in sharded.items():
        _rank_range(total, tp_rank, tp_size, what)


class DiTWeights(dict):
    """Our key -> Tensor or QuantizedWeight (int8 weights replace their `weight`, `weight_scale`, `comfy_quant`).

    `dequantized` names the int8 weights that had to be dequantised at load (unaligned row-parallel slices, or
    every one in quant_mode="dequant"); `variant` / `config` describe the source checkpoint.
    """

    def __init__(self, variant: Variant, config: DiTConfig) -> None:
        super().__init__()
        self.variant = variant
        self.config = config
        self.dequantized: list[str] = []


class _RankReader:
    """Reads this rank's part of one of our tensors, following `tp_rule`."""

    def __init__(self, info: CheckpointInfo, cfg: DiTConfig, tp_rank: int, tp_size: int) -> None:
        self.info, self.cfg, self.rank, self.size = info, cfg, tp_rank, tp_size
        self.reader = _Reader(info.entries)

    def read(self, key: str) -> torch.Tensor:
        src, shape = self.info.sources[key], self.info.shapes[key].shape
        rule = tp_rule(key)
        if rule == "qkv":
            h0, h1 = _rank_range(self.cfg.num_heads, self.rank, self.size, "num_heads")
            hd = self.cfg.head_dim
            return _read_section_rows(self.reader, src, QKV_SECTIONS, self.cfg.attn_inner, h0 * hd, h1 * hd, hd)
        if rule == "fc1":
            lo, hi = _rank_range(self.cfg.ffn, self.rank, self.size, "ffn")
            return _read_section_rows(self.reader, src, FC1_SECTIONS, self.cfg.ffn, lo, hi, self.cfg.head_dim)
        if rule == "rows":
            lo, hi = _rank_range(shape[0], self.rank, self.size, f"{key} rows")
            return _read_section_rows(self.reader, src, 1, shape[0], lo, hi, self.cfg.head_dim)
        if rule == "cols":
            lo, hi = self.col_range(key)
            return self.reader.cols(src.keys[0], lo, hi)
        return self.reader.whole(src.keys[0])

    def col_range(self, key: str) -> tuple[int, int]:
        return _rank_range(self.info.shapes[key].shape[1], self.rank, self.size, f"{key} columns")

    def whole(self, key: str) -> torch.Tensor:
        return self.reader.whole(self.info.sources[key].keys[0])

    def read_int8(self, key: str) -> tuple[QuantizedWeight | torch.Tensor, bool]:
        """(this rank's int8 weight, or a dense fp32 tensor when it had to be dequantised; was-dequantised)."""
        prefix = key[: -len(".weight")]
        try:
            spec = parse_comfy_quant(self.whole(f"{prefix}.comfy_quant"))
        except QuantFormatError as e:
            raise CheckpointError(f"{prefix}.comfy_quant: {e}") from e
        g = spec.groupsize
        if tp_rule(key) != "cols":
            return QuantizedWeight(self.read(key), self.read(f"{prefix}.weight_scale").float(), g), False
        # Row-parallel (column-sliced) weight: every rank needs the whole per-row scale (rows are not split).
        scale = self.whole(f"{prefix}.weight_scale").float()
        lo, hi = self.col_range(key)
        if not g or (lo % g == 0 and hi % g == 0):
            return QuantizedWeight(self.reader.cols(self.info.sources[key].keys[0], lo, hi), scale, g), False
        # The ConvRot rotation mixes all g input columns of a group, so a slice that cuts through a group can neither
        # be un-rotated nor fed to the int8 kernel (whose online activation rotation works on whole groups). Read the
        # group-aligned superset, dequantise it, and cut the dense result (e.g. out_proj at TP8: 896 = 3.5 x 256).
        a, b = (lo // g) * g, -(-hi // g) * g
        superset = self.reader.cols(self.info.sources[key].keys[0], a, b)
        dense = dequantize_convrot(superset, scale, g, torch.float32)[:, lo - a : hi - a]
        log.info("%s: TP slice [%d:%d] is not aligned to ConvRot group %d; dequantised at load", key, lo, hi, g)
        return dense.contiguous(), True


def _out_dtype(key: str, stored: str, variant: Variant, dtype: torch.dtype) -> torch.dtype:
    """Precision contract (§2.9): fp32 islands stay fp32; the curve-form AdaLN runs in fp32; the rest -> dtype."""
    if stored == "F32":
        return torch.float32
    if variant.adaln == "curve" and ".adaln_proj.linear." in key:
        return torch.float32
    return dtype


def _wanted_keys(info: CheckpointInfo, cfg: DiTConfig, keys: Iterable[str] | None) -> list[str]:
    specs = expected_specs(cfg, info.variant)
    sidecars = (".weight_scale", ".comfy_quant")  # folded into their weight
    names = [k for k in specs if not k.endswith(sidecars)]
    if keys is None:
        return names
    keys = set(keys)
    unknown = sorted(keys - set(names))
    if unknown:
        raise ValueError(f"requested keys not in a {info.variant.name} checkpoint: {_named(unknown)}")
    return [k for k in names if k in keys]


def _default_inv_freq(cfg: DiTConfig) -> torch.Tensor:
    """rope.inv_freq buffer, 1 / theta^(arange(0, 2f, 2) / 2f) (diffusers drops it from its files)."""
    f = cfg.rope_freq_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float64) / (2 * f))).float()


def load_dit_weights(
    path: str | Path,
    cfg: DiTConfig | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    quant_mode: QuantMode = "kernel",
    dtype: torch.dtype = torch.bfloat16,
    *,
    keys: Iterable[str] | None = None,
    qkv_layout: Layout | None = None,
) -> DiTWeights:
    """This rank's DiT weights, in our key names, after validating the checkpoint against `cfg`.

    cfg None: use the config inferred from the header. quant_mode "kernel": int8 weights stay QuantizedWeight
    (except unaligned row-parallel slices); "dequant": every int8 weight is dequantised to `dtype`.
    `keys` restricts the load to a subset of our weight names (e.g. one block's AdaLN).
    """
    if quant_mode not in ("kernel", "dequant"):
        raise ValueError(f"quant_mode must be 'kernel' or 'dequant', got {quant_mode!r}")
    info = inspect_checkpoint(path, base=cfg, qkv_layout=qkv_layout)
    cfg = cfg or info.config
    _check_tp(cfg, tp_rank, tp_size)
    validate(info, cfg)
    rr = _RankReader(info, cfg, tp_rank, tp_size)
    out = DiTWeights(info.variant, cfg)
    for key in _wanted_keys(info, cfg, keys):
        if key not in info.shapes:  # optional key absent (rope.inv_freq in diffusers files)
            out[key] = _default_inv_freq(cfg)
            continue
        stored = info.shapes[key].dtype
        if stored == "I8":
            value, was_dequantized = rr.read_int8(key)
            if quant_mode == "dequant" and isinstance(value, QuantizedWeight):
                value, was_dequantized = value.dequantize(dtype), True
            if was_dequantized:
                value = value.to(dtype)
                out.dequantized.append(key)
            out[key] = value
        else:
            out[key] = rr.read(key).to(_out_dtype(key, stored, info.variant, dtype))
    return out


def load_adaln(
    path: str | Path, cfg: DiTConfig, layer: int | Literal["final"], tp_rank: int = 0, tp_size: int = 1,
    quant_mode: QuantMode = "kernel", dtype: torch.dtype = torch.bfloat16,
) -> DiTWeights:
    """One AdaLN projection (weight + bias) of a block or the final layer -- the unpruned int8 one (ConvRot g64)
    comes back as a QuantizedWeight in kernel mode, the curve-form one as fp32."""
    prefix = "final_layer" if layer == "final" else f"blocks.{layer}"
    keys = [f"{prefix}.adaln_proj.linear.weight", f"{prefix}.adaln_proj.linear.bias"]
    return load_dit_weights(path, cfg, tp_rank, tp_size, quant_mode, dtype, keys=keys)


def flatten_state_dict(weights: dict[str, torch.Tensor | QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Expand QuantizedWeight entries into `weight` (int8) + `weight_scale` (fp32 [N, 1]) for load_state_dict."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if isinstance(value, QuantizedWeight):
            flat[key] = value.qdata
            flat[key[: -len("weight")] + "weight_scale"] = value.scale
        else:
            flat[key] = value
    return flat
