"""Loading MiniMax-H3 DiT checkpoints, one tensor-parallel rank at a time (docs/checkpoints.md).

Supported inputs:
  * ComfyUI single files: bf16 (or fp16 / fp32); `*_int8_convrot` (block linears int8 ConvRot g256, block AdaLN
    int8 g64); "pruned" curve-form (`adaln_t_table` [1025, 8], AdaLN weights [., 8], no time_embedder);
  * a diffusers directory (`transformer/` with shards + index + config.json): diffusers names, separate
    to_q/to_k/to_v, fc1 halves stored [value; gate];
  * the raw release shards (our names, qkv rows per-head interleaved [h0: q k v, h1: q k v, ...]).

Everything is expressed in *our* key names (= ComfyUI names, qkv [q_all; k_all; v_all], fc1 [gate; value]).

Files with our names do not show their q/k/v row order in the data, so it is decided from evidence
(`decide_qkv_layout`): our metadata, ComfyUI-only markers, the release's sharding and config.json, or
`--qkv-layout`; with none of them the checkpoint is refused, naming that flag. The block count comes from the
metadata, config.json or the known H3 configuration, never from the highest block present, so a dropped tail block
is a missing key. `check_checkpoint` validates everything from the headers (plus the tiny comfy_quant descriptors)
before a stage reports SERVING; `load_dit_weights` validates again and reads only this rank's rows / columns
(safetensors `get_slice`), as `H3DiT._tp_plan` slices them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Literal

import torch

from minimax_h3.contract import PARTITIONS
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import (DIFFUSERS_NAMES, DIFFUSERS_QKV, FC1_SECTIONS, NOT_IN_DIFFUSERS, QKV_SECTIONS,
                                              is_qkv_part, qkv_part_keys)
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.tp import ColumnParallel, RowParallel, column_range, param_style, section_ranges, validate_tp
from minimax_h3.kernels.int8 import QuantizedWeight, dequantize_convrot, int8_linear_specs, read_quant_spec
from stagekit.checkpoints import (FLOAT, TORCH_DTYPE, Checkpoint, CheckpointError, FiniteCheck, HeaderEntry,
                                  TensorReader, TensorSpec, WeightSource, key_report, metadata_json, named,
                                  open_checkpoint)

log = logging.getLogger(__name__)

COMFY_MODEL_PREFIX = "model.diffusion_model."  # DiT tensors inside a ComfyUI all-in-one checkpoint
DIFFUSERS_SUBDIR = "transformer"  # the DiT's folder inside a diffusers / release pipeline folder
METADATA_CONFIG = "h3_dit_config"  # safetensors metadata our writers add: the DiTConfig as JSON
METADATA_QKV = "h3_qkv_layout"  # ... and the q/k/v row order: "stacked" | "interleaved"
COMFY_FILE_NAME = re.compile(r"(minimax_h3|fasth3)[^/]*\.safetensors$")  # how the ComfyUI repacks are named
# config.json fields only the release's transformer/config.json uses (diffusers renamed them).
RELEASE_CONFIG_FIELDS = ("ffn_hidden_size", "latents_dim", "token_refiner_num_layers", "timestep_input_dim")

QuantMode = Literal["kernel", "dequant"]
Layout = Literal["comfy", "release", "diffusers"]
QKVLayout = Literal["stacked", "interleaved"]
QKV_LAYOUTS = ("stacked", "interleaved")
QKV_FLAG = "--qkv-layout"
# H3's two DiT partitions share one config and differ in weights only: fl2va (text, first/last frame) and ref2va
# (image / video / audio references). Nothing in the tensors shows which one a file is.
Partition = Literal["fl2va", "ref2va"]  # minimax_h3.contract.PARTITIONS
METADATA_PARTITION = "h3_partition"  # safetensors metadata our writers add: the partition
PARTITION_FLAG = "--partition"
# File names that state a partition: the ComfyUI repacks (minimax_h3_ref2va_*.safetensors, minimax_h3_fl2va_*), and
# FastVideo's FastH3 students ComfyUI's templates load as such (fastvideo_fasth3_* for text and first frame,
# fasth3_omniref_* for references).
_PARTITION_FILE_NAMES = ((re.compile(r"ref2va|r2va|omniref"), "ref2va"),
                         (re.compile(r"fl2va|t2va|fastvideo_fasth3"), "fl2va"))
# The release's two checkpoint folders, whose shards' names say nothing: the folder that is the checkpoint, by its
# exact name (transformer_ref/ holds ref2va, transformer/ the fl2va / t2va weights). No other folder name, and no
# folder around a checkpoint, is evidence.
RELEASE_PARTITION_FOLDERS = {"transformer_ref": "ref2va", "transformer": "fl2va"}

PLAN = H3DiT._tp_plan
RTOL_FP32_ROPE = 1e-5  # a stored rope.inv_freq vs its formula: fp32 evaluations differ by a few ulp (`_rope_tolerance`)


# ================================================================================================================
# Variant
# ================================================================================================================


@dataclass(frozen=True)
class Variant:
    layout: Layout  # key naming / qkv order of the source
    linears: Literal["bf16", "fp16", "fp32", "int8"]  # block attention/MLP linears (dense: their storage dtype)
    adaln: Literal["dense", "int8", "curve"]  # block AdaLN projections
    gates: Literal["", "int8", "dense"] = ""  # FastH3's VSA gates (attn.to_gate_compress) in every block: none, int8
                                              # ConvRot, or dense (bf16 / fp16 / fp32)

    @property
    def name(self) -> str:
        if self.linears == "int8":
            base = {"int8": "int8_convrot", "curve": "int8_convrot_pruned"}.get(self.adaln, "int8_adaln-dense")
        else:
            base = {"dense": self.linears, "curve": f"{self.linears}_pruned"}.get(self.adaln,
                                                                                  f"{self.linears}_adaln-int8")
        base += {"": "", "int8": "_vsa", "dense": "_vsa-dense"}[self.gates]
        return base if self.layout == "comfy" else f"{self.layout}_{base}"


BF16 = Variant("comfy", "bf16", "dense")
INT8_CONVROT = Variant("comfy", "int8", "int8")
INT8_CONVROT_PRUNED = Variant("comfy", "int8", "curve")
_DENSE_NAME = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


# ================================================================================================================
# Expected keys (our names) for a config + variant
# ================================================================================================================


@dataclass(frozen=True)
class DiTSpec(TensorSpec):
    store: str = "BF16"  # the dtype the release / ComfyUI files store it in (what the tiny writers write)


def _dense(specs: dict, key: str, shape: tuple[int, ...], store: str) -> None:
    specs[key] = DiTSpec(shape, FLOAT, store)


def _linear(specs: dict, prefix: str, n_out: int, n_in: int, store: str, bias: bool) -> None:
    _dense(specs, f"{prefix}.weight", (n_out, n_in), store)
    if bias:
        _dense(specs, f"{prefix}.bias", (n_out,), store)


def _int8_linear(specs: dict, prefix: str, n_out: int, n_in: int) -> None:
    specs.update(int8_linear_specs(prefix, n_out, n_in, DiTSpec))


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
        _dense(specs, f"{prefix}.{norm}.weight", (cfg.hidden,), "BF16")
    for norm in ("q_norm", "k_norm"):
        _dense(specs, f"{prefix}.attn.{norm}.weight", (cfg.head_dim,), "BF16")


def expected_specs(cfg: DiTConfig, variant: Variant) -> dict[str, DiTSpec]:
    """All tensors of a checkpoint of this config and variant, in our (ComfyUI) key names, file order."""
    curve = variant.adaln == "curve"
    adaln_in = cfg.adaln_curve_rank if curve else cfg.time_embed_dim
    adaln_store = "F16" if curve else "BF16"  # the pruned file stores the rank-8 projections in fp16
    s: dict[str, DiTSpec] = {}
    _linear(s, "video_patch_proj", cfg.hidden, cfg.video_patch_dim, "F32", bias=True)
    _linear(s, "audio_patch_proj", cfg.hidden, cfg.audio_in_channels, "F32", bias=True)
    _linear(s, "condition_proj", cfg.hidden, cfg.text_dim, "BF16", bias=True)
    if curve:
        _dense(s, "adaln_t_table", (cfg.adaln_curve_grid, cfg.adaln_curve_rank), "F32")
    else:
        _linear(s, "time_embedder.proj_in", cfg.time_embed_hidden, cfg.freq_dim, "F32", bias=True)
        _linear(s, "time_embedder.proj_out", cfg.time_embed_dim, cfg.time_embed_hidden, "F32", bias=True)
    _dense(s, "rope.inv_freq", (cfg.rope_freq_dim,), "F32")
    for i in range(cfg.num_refiner_layers):
        _attn_mlp_specs(s, f"token_refiner.blocks.{i}", cfg, int8=False)  # refiner stays dense in every variant
    if cfg.num_refiner_layers:
        _dense(s, "token_refiner.final_norm.weight", (cfg.hidden,), "BF16")
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        _attn_mlp_specs(s, p, cfg, int8=variant.linears == "int8")
        if variant.gates == "int8":
            _int8_linear(s, f"{p}.attn.to_gate_compress", cfg.attn_inner, cfg.hidden)
        elif variant.gates == "dense":
            _linear(s, f"{p}.attn.to_gate_compress", cfg.attn_inner, cfg.hidden, "BF16", bias=False)
        if variant.adaln == "int8":
            _int8_linear(s, f"{p}.adaln_proj.linear", cfg.adaln_out, adaln_in)
            _dense(s, f"{p}.adaln_proj.linear.bias", (cfg.adaln_out,), "BF16")
        else:
            _linear(s, f"{p}.adaln_proj.linear", cfg.adaln_out, adaln_in, adaln_store, bias=True)
    _dense(s, "final_layer.norm.weight", (cfg.hidden,), "BF16")
    _linear(s, "final_layer.adaln_proj.linear", cfg.final_adaln_out, adaln_in, adaln_store, bias=True)
    _linear(s, "final_layer.video_out", cfg.video_patch_dim, cfg.hidden, "F32", bias=True)
    _linear(s, "final_layer.audio_out", cfg.audio_in_channels, cfg.hidden, "F32", bias=True)
    return s


OPTIONAL_KEYS = NOT_IN_DIFFUSERS  # rope.inv_freq: diffusers drops it; recomputed bit-identically from the config


# ================================================================================================================
# Source layouts -> our names
# ================================================================================================================


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives and how its rows are arranged in the source."""

    keys: tuple[str, ...]  # source key(s); three for diffusers qkv (q, k, v)
    arrangement: Literal["same", "qkv_split", "qkv_interleaved", "fc1_swapped"] = "same"


def _strip_model_prefix(entries: dict[str, HeaderEntry]) -> dict[str, HeaderEntry]:
    """ComfyUI "all in one" files prefix the DiT with `model.diffusion_model.` next to VAE / text-encoder tensors:
    keep only the DiT tensors, under their unprefixed names."""
    if not any(k.startswith(COMFY_MODEL_PREFIX) for k in entries):
        return entries
    n = len(COMFY_MODEL_PREFIX)
    kept = {k[n:]: replace(e, disk_key=k) for k, e in entries.items() if k.startswith(COMFY_MODEL_PREFIX)}
    log.info("ignoring %d tensors outside %r", len(entries) - len(kept), COMFY_MODEL_PREFIX)
    return kept


def _is_diffusers(keys: Iterable[str]) -> bool:
    return any(k.startswith(("transformer_blocks.", "proj_in.")) for k in keys)


def _is_qkv_rows(key: str) -> bool:
    return key.endswith((".attn.qkv_proj.weight", ".attn.qkv_proj.weight_scale"))


def map_sources(entries: dict[str, HeaderEntry], layout: Layout) -> dict[str, Source]:
    """Our key -> Source, for every tensor of the checkpoint (unknown source keys map to themselves)."""
    if layout == "comfy":
        return {k: Source((k,)) for k in entries}
    if layout == "release":
        return {k: Source((k,), "qkv_interleaved" if _is_qkv_rows(k) else "same") for k in entries}
    out: dict[str, Source] = {}
    for k in entries:
        if is_qkv_part(k):
            continue  # folded into the to_q entry
        ours = DIFFUSERS_NAMES.from_source(k)
        if DIFFUSERS_QKV in k:
            out[ours] = Source(qkv_part_keys(k), "qkv_split")
        elif ours.endswith(".mlp.fc1.weight"):
            out[ours] = Source((k,), "fc1_swapped")
        else:
            out[ours] = Source((k,))
    for k in entries:  # a to_k/to_v without its to_q: keep it visible so validation names it as unexpected
        if is_qkv_part(k) and k.replace(".to_k.", ".to_q.").replace(".to_v.", ".to_q.") not in entries:
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
    same = len({(p.shape[1:], p.dtype) for p in parts}) == 1
    return HeaderEntry(first.file, (rows, *first.shape[1:]) if same else (-1,), first.dtype)


# ================================================================================================================
# q/k/v row order: decided from evidence, or stated
# ================================================================================================================


@dataclass(frozen=True)
class QKVDecision:
    layout: QKVLayout | None  # None: no evidence either way
    evidence: str


def decide_qkv_layout(ckpt: Checkpoint, entries: dict[str, HeaderEntry], declared: QKVLayout | None) -> QKVDecision:
    """The q/k/v row order of a checkpoint with our (fused qkv_proj) names. The rows look the same either way, so
    the order is taken from (1) our metadata, (2) `declared` (--qkv-layout), (3) markers only a ComfyUI repack has
    (stacked) or only the release shards have (interleaved); see docs/checkpoints.md."""
    stated = ckpt.metadata.get(METADATA_QKV)
    if stated is not None:
        if stated not in QKV_LAYOUTS:
            raise CheckpointError(ckpt.files[0], f"metadata {METADATA_QKV}={stated!r}: expected one of {QKV_LAYOUTS}")
        if declared is not None and declared != stated:
            raise CheckpointError(ckpt.files[0], f"{QKV_FLAG} {declared} contradicts the file's metadata "
                                                 f"{METADATA_QKV}={stated}; drop the flag")
        return QKVDecision(stated, f"safetensors metadata {METADATA_QKV}")
    comfy, release = [], []
    if any(k.endswith(".comfy_quant") for k in entries):
        comfy.append("ComfyUI quantisation descriptors (*.comfy_quant)")
    if any(e.disk_key.startswith(COMFY_MODEL_PREFIX) for e in entries.values()):
        comfy.append(f"the ComfyUI all-in-one prefix {COMFY_MODEL_PREFIX!r}")
    if "adaln_t_table" in entries:
        comfy.append("the ComfyUI curve-form AdaLN table (adaln_t_table)")
    if len(ckpt.files) == 1 and not ckpt.sharded and COMFY_FILE_NAME.search(ckpt.files[0].name):
        comfy.append(f"the ComfyUI repack file name {ckpt.files[0].name!r}")
    if ckpt.sharded:
        release.append("release-style sharding (an index / -NNNNN-of-NNNNN shard names; ComfyUI repacks are single "
                       "files)")
    if any(f in ckpt.config for f in RELEASE_CONFIG_FIELDS):
        release.append("the release's config.json field names")
    if declared is not None:
        against = release if declared == "stacked" else comfy
        if against:
            log.warning("%s %s overrides the evidence for the other order: %s", QKV_FLAG, declared, "; ".join(against))
        return QKVDecision(declared, QKV_FLAG)
    if comfy and release:
        return QKVDecision(None, f"contradicting evidence: {'; '.join(comfy)} vs {'; '.join(release)}")
    if comfy:
        return QKVDecision("stacked", "; ".join(comfy))
    if release:
        return QKVDecision("interleaved", "; ".join(release))
    return QKVDecision(None, "no metadata, no ComfyUI markers, no release sharding or config.json")


@dataclass(frozen=True)
class PartitionDecision:
    partition: Partition | None  # None: no evidence
    evidence: str


def decide_partition(ckpt: Checkpoint, declared: Partition | None = None) -> PartitionDecision:
    """Which H3 partition a checkpoint holds, from its own evidence: (1) our metadata, (2) the name of each of its
    files (the ComfyUI repack names), (3) for a checkpoint folder, the release's exact folder names (transformer/,
    transformer_ref/), and `declared` (--partition). The folders around a checkpoint are no evidence. Two pieces of
    evidence that disagree are refused, naming both: serving the wrong partition renders poor video without an
    error."""
    if declared is not None and declared not in PARTITIONS:
        raise ValueError(f"{PARTITION_FLAG} must be one of {', '.join(PARTITIONS)}, got {declared!r}")
    where = ckpt.files[0] if ckpt.root is None else ckpt.root
    evidence: list[tuple[str, str]] = []  # (partition, what states it), strongest first
    if declared is not None:
        evidence.append((declared, f"{PARTITION_FLAG} {declared}"))
    stated = ckpt.metadata.get(METADATA_PARTITION)
    if stated is not None:
        if stated not in PARTITIONS:
            raise CheckpointError(ckpt.files[0], f"metadata {METADATA_PARTITION}={stated!r}: expected one of "
                                                 f"{PARTITIONS}")
        evidence.append((stated, f"the safetensors metadata {METADATA_PARTITION}={stated}"))
    for f in ckpt.files:
        for pattern, part in _PARTITION_FILE_NAMES:
            if pattern.search(f.name.lower()):
                evidence.append((part, f"the file name {f.name!r}"))
    if ckpt.root is not None and ckpt.root.name in RELEASE_PARTITION_FOLDERS:
        evidence.append((RELEASE_PARTITION_FOLDERS[ckpt.root.name],
                         f"the release's checkpoint folder name {ckpt.root.name!r}"))
    if not evidence:
        names = ", ".join(repr(f.name) for f in ckpt.files[:2]) + (" ..." if len(ckpt.files) > 2 else "")
        return PartitionDecision(None, f"neither metadata {METADATA_PARTITION} nor a partition in the file name(s) "
                                       f"{names}" + ("" if ckpt.root is None else ", nor a release checkpoint folder "
                                                     "named transformer/ or transformer_ref/"))
    part, first = evidence[0]
    other = next(((p, what) for p, what in evidence if p != part), None)
    if other is not None:
        fix = "drop the flag" if declared is not None else "rename the file or correct its metadata"
        raise CheckpointError(where, f"{first} says {part}, but {other[1]} says {other[0]}: the partition evidence "
                                     f"contradicts itself, and the wrong partition renders poor video without an "
                                     f"error; {fix}")
    whats = list(dict.fromkeys(what for _, what in evidence))
    return PartitionDecision(part, "; ".join(whats[:2]) + (f" (+{len(whats) - 2} more)" if len(whats) > 2 else ""))


def partition_undecided(path: Path, decision: PartitionDecision) -> CheckpointError:
    return CheckpointError(
        path, f"cannot tell which MiniMax-H3 partition this DiT checkpoint is ({decision.evidence}); the two have the "
              f"same tensors, and the wrong one renders poor video without an error. Keep the release / ComfyUI file "
              f"name (minimax_h3_fl2va_*.safetensors or minimax_h3_ref2va_*.safetensors) or start the DiT with "
              f"{PARTITION_FLAG} fl2va (text and first/last frame) or {PARTITION_FLAG} ref2va (references)")


def _qkv_undecided(path: Path, decision: QKVDecision) -> CheckpointError:
    return CheckpointError(
        path, f"cannot tell the q/k/v row order of this checkpoint ({decision.evidence}); a wrong guess loads without "
              f"error and gives wrong video. Start the DiT with {QKV_FLAG} stacked (ComfyUI repacks: [q_all; k_all; "
              f"v_all]) or {QKV_FLAG} interleaved (MiniMax release shards: [h0: q k v, h1: q k v, ...])",
        "blocks.0.attn.qkv_proj.weight")


# ================================================================================================================
# Inspection: variant + config from the header
# ================================================================================================================


@dataclass
class CheckpointInfo:
    path: Path
    variant: Variant
    config: DiTConfig  # dims from shapes; block counts and non-shape fields from metadata / config.json / known H3
    config_source: str  # where the block count came from
    qkv: QKVDecision | None  # None for diffusers names (separate to_q / to_k / to_v: nothing to decide)
    entries: dict[str, HeaderEntry]  # source names
    sources: dict[str, Source]  # our names
    shapes: dict[str, HeaderEntry] = field(default_factory=dict)  # our names, assembled shape
    partition: PartitionDecision = PartitionDecision(None, "not inspected")

    @property
    def files(self) -> list[Path]:
        return sorted({e.file for e in self.entries.values()})


def _first_block(shapes: dict[str, HeaderEntry]) -> str:
    """`blocks.{i}.` of the lowest block present: variant and dims are read there (a dropped block 0 is then a
    missing key, not "not a DiT")."""
    ids = [int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.attn\.qkv_proj\.weight$", k))]
    return f"blocks.{min(ids) if ids else 0}."


def _detect_variant(path: Path, shapes: dict[str, HeaderEntry], layout: Layout) -> Variant:
    b = _first_block(shapes)
    qkv = shapes.get(b + "attn.qkv_proj.weight")
    adaln = shapes.get(b + "adaln_proj.linear.weight")
    if qkv is None or adaln is None:
        raise CheckpointError(
            path, "not a MiniMax-H3 DiT checkpoint: no `blocks.N.attn.qkv_proj.weight` / "
                  f"`blocks.N.adaln_proj.linear.weight` (first keys: {sorted(shapes)[:10]})")
    linears = "int8" if qkv.dtype == "I8" else _DENSE_NAME.get(qkv.dtype)
    if linears is None:
        raise CheckpointError(qkv.file, f"stored as {qkv.dtype}; a DiT weight is bf16 / fp16 / fp32 or int8 with "
                                        "comfy_quant", b + "attn.qkv_proj.weight")
    if "adaln_t_table" in shapes:
        adaln_kind = "curve"
    else:
        adaln_kind = "int8" if adaln.dtype == "I8" else "dense"
    # FastH3: a VSA gate in the first block means one in every block (ComfyUI's detection; `validate` names a block
    # without it), stored as that first one is.
    gate = shapes.get(b + "attn.to_gate_compress.weight")
    gates = "" if gate is None else "int8" if gate.dtype == "I8" else "dense" if gate.dtype in _DENSE_NAME else None
    if gates is None:
        raise CheckpointError(gate.file, f"stored as {gate.dtype}; a VSA gate is int8 ConvRot (with comfy_quant) or "
                                         "bf16 / fp16 / fp32", b + "attn.to_gate_compress.weight")
    return Variant(layout, linears, adaln_kind, gates)


def _dim(shapes: dict[str, HeaderEntry], key: str, axis: int, default: int) -> int:
    e = shapes.get(key)
    return e.shape[axis] if e is not None and len(e.shape) > axis else default


def _count_indexed(shapes: dict[str, HeaderEntry], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    idx = {int(m.group(1)) for k in shapes if (m := pattern.match(k))}
    return max(idx) + 1 if idx else 0


def infer_config(path: Path, shapes: dict[str, HeaderEntry], variant: Variant, base: DiTConfig | None,
                 json_cfg: dict, meta_cfg: dict | None) -> tuple[DiTConfig, str]:
    """(config, where its block counts came from). Metadata written by our tools states the whole config. Otherwise
    the dims come from the shapes and the block counts from config.json, the given `base`, or the known H3
    configuration; with none of those the checkpoint is refused (the last block present is no evidence)."""
    curve = variant.adaln == "curve"
    if meta_cfg is not None:
        try:
            fields = {f.name for f in dataclasses.fields(DiTConfig)}
            doc = {k: (tuple(v) if isinstance(v, list) else v) for k, v in meta_cfg.items() if k in fields}
            return DiTConfig(**doc), "metadata"
        except (TypeError, ValueError) as e:
            raise CheckpointError(path, f"metadata {METADATA_CONFIG} is not a valid DiT config: {e}") from e
    known = DiTConfig.full()
    fallback = base or known
    g = json_cfg.get
    patch = tuple(g("patch_size", fallback.patch))
    b = _first_block(shapes)
    head_dim = _dim(shapes, b + "attn.q_norm.weight", 0, fallback.head_dim)
    vpd = _dim(shapes, "video_patch_proj.weight", 1, fallback.video_patch_dim)
    dims = dict(
        hidden=_dim(shapes, "condition_proj.weight", 0, fallback.hidden),
        head_dim=head_dim,
        num_heads=_dim(shapes, b + "attn.qkv_proj.weight", 0, QKV_SECTIONS * fallback.attn_inner)
        // (QKV_SECTIONS * head_dim),
        ffn=_dim(shapes, b + "mlp.fc2.weight", 1, fallback.ffn),
        patch=patch,
        in_channels=vpd // math.prod(patch) if vpd % math.prod(patch) == 0 else vpd,
        audio_in_channels=_dim(shapes, "audio_patch_proj.weight", 1, fallback.audio_in_channels),
        text_dim=_dim(shapes, "condition_proj.weight", 1, fallback.text_dim),
        freq_dim=_dim(shapes, "time_embedder.proj_in.weight", 1,
                      g("freq_dim", g("timestep_input_dim", fallback.freq_dim))),
        time_embed_hidden=_dim(shapes, "time_embedder.proj_in.weight", 0,
                               g("time_embed_hidden_dim", g("time_embed_hidden_size", fallback.time_embed_hidden))),
        time_embed_dim=_dim(shapes, "time_embedder.proj_out.weight", 0, g("time_embed_dim", fallback.time_embed_dim)),
        rope_freq_dim=_dim(shapes, "rope.inv_freq", 0,
                           g("rope_freq_dim", g("rope_inv_freq_len", fallback.rope_freq_dim))),
        rope_theta=float(g("rope_theta", fallback.rope_theta)),
        eps=float(g("norm_eps", fallback.eps)),
        adaln_form="curve" if curve else "mlp",
        vsa_gates=bool(variant.gates),
    )
    if curve:
        dims["adaln_curve_grid"] = _dim(shapes, "adaln_t_table", 0, fallback.adaln_curve_grid)
        dims["adaln_curve_rank"] = _dim(shapes, "adaln_t_table", 1, fallback.adaln_curve_rank)
    else:
        dims["time_embed_dim"] = _dim(shapes, b + "adaln_proj.linear.weight", 1, dims["time_embed_dim"])
    refiner = g("num_refiner_layers", g("token_refiner_num_layers"))
    if g("num_layers") is not None and refiner is not None:
        counts, source = dict(num_layers=int(g("num_layers")), num_refiner_layers=int(refiner)), "config.json"
    elif base is not None:
        counts, source = dict(num_layers=base.num_layers, num_refiner_layers=base.num_refiner_layers), "given config"
    elif all(dims[k] == getattr(known, k) for k in ("hidden", "head_dim", "num_heads", "ffn", "text_dim")):
        counts, source = dict(num_layers=known.num_layers, num_refiner_layers=known.num_refiner_layers), "H3 release"
    else:
        raise CheckpointError(
            path, f"cannot tell how many blocks this DiT has: its dims (hidden {dims['hidden']}, {dims['num_heads']} "
                  f"heads) are not the H3 release's and neither safetensors metadata {METADATA_CONFIG!r} nor a "
                  f"config.json states num_layers (found blocks up to {_count_indexed(shapes, 'blocks.') - 1}; a "
                  "dropped tail block could not be noticed). Pass the folder holding the weights and "
                  "their config.json")
    try:
        return fallback.replace(**dims, **counts), source
    except ValueError as e:
        raise CheckpointError(path, f"checkpoint shapes give an invalid DiT config: {e}") from e


def inspect_checkpoint(path: str | Path, base: DiTConfig | None = None,
                       qkv_layout: QKVLayout | None = None, partition: Partition | None = None) -> CheckpointInfo:
    """Variant, config, q/k/v order and partition from the safetensors header(s) only (no tensor read). `base`: a
    config the caller states (its block counts are used when the checkpoint declares none). `qkv_layout`:
    --qkv-layout; `partition`: --partition."""
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"{QKV_FLAG} must be one of {', '.join(QKV_LAYOUTS)}, got {qkv_layout!r}")
    path = Path(path)
    ckpt = open_checkpoint(path, DIFFUSERS_SUBDIR)
    entries = _strip_model_prefix(ckpt.tensors)
    qkv = None
    if _is_diffusers(entries):
        layout: Layout = "diffusers"
    else:
        qkv = decide_qkv_layout(ckpt, entries, qkv_layout)
        layout = "release" if qkv.layout == "interleaved" else "comfy"
    sources = map_sources(entries, layout)
    shapes = {ours: _virtual_entry(entries, src) for ours, src in sources.items()}
    variant = _detect_variant(path, shapes, layout)
    config, source = infer_config(path, shapes, variant, base, ckpt.config, metadata_json(ckpt, METADATA_CONFIG))
    return CheckpointInfo(path, variant, config, source, qkv, entries, sources, shapes,
                          decide_partition(ckpt, partition))


def validate(info: CheckpointInfo, cfg: DiTConfig, reader: TensorReader | None = None) -> None:
    """Everything a load would trip over, before any weight is read: the AdaLN form, every key / shape / dtype
    (integers only where a comfy_quant descriptor says so), each descriptor's JSON and ConvRot group against its
    weight, and the q/k/v order. Raises CheckpointError naming the file and the first offending key."""
    file_form = "curve" if info.variant.adaln == "curve" else "mlp"
    if file_form != cfg.adaln_form:
        raise CheckpointError(
            info.path, f"a {info.variant.name} checkpoint (AdaLN {info.variant.adaln}) but the config has "
                       f"adaln_form={cfg.adaln_form!r}; use cfg.replace(adaln_form={file_form!r})")
    if bool(info.variant.gates) != cfg.vsa_gates:
        raise CheckpointError(
            info.path, f"the blocks {'have' if info.variant.gates else 'have no'} VSA gates (attn.to_gate_compress) "
                       f"but the config says vsa_gates={cfg.vsa_gates}; use cfg.replace(vsa_gates="
                       f"{bool(info.variant.gates)})")
    want = expected_specs(cfg, info.variant)
    key_report(info.shapes, want, optional=OPTIONAL_KEYS).raise_if_bad(
        info.path, f"a {info.variant.name} MiniMax-H3 DiT with {cfg.num_layers} blocks, {cfg.num_refiner_layers} "
                   f"refiner blocks, hidden {cfg.hidden} (block count from the {info.config_source})")
    reader = reader or TensorReader(info.entries)
    for key, spec in want.items():
        if spec.dtypes == {"I8"}:
            read_quant_spec(reader, info.entries, info.sources[key].keys[0])
    if "rope.inv_freq" in info.sources:  # a buffer fixed by the config: the stored one must be that formula
        stored = reader.whole(info.sources["rope.inv_freq"].keys[0]).float()
        formula = _default_inv_freq(cfg)
        rtol, atol = _rope_tolerance(info.shapes["rope.inv_freq"].dtype)
        if not torch.allclose(stored, formula, rtol=rtol, atol=atol):
            file, name = _where(info, "rope.inv_freq")
            raise CheckpointError(file, f"differs from 1 / rope_theta^(2i / {2 * cfg.rope_freq_dim}) of rope_theta "
                                        f"{cfg.rope_theta} (max |diff| {(stored - formula).abs().max().item():.3g}): "
                                        "a damaged file or another model's RoPE", name)
    if info.qkv is not None and info.qkv.layout is None:
        raise _qkv_undecided(info.path, info.qkv)


def check_checkpoint(path: str | Path, cfg: DiTConfig | None = None,
                     qkv_layout: QKVLayout | None = None, partition: Partition | None = None) -> CheckpointInfo:
    """Inspect and validate a checkpoint from its headers: what a stage runs at start-up, before SERVING. The
    partition is reported (info.partition), not required: the DiT stage refuses a file it cannot place."""
    info = inspect_checkpoint(path, base=cfg, qkv_layout=qkv_layout, partition=partition)
    validate(info, cfg or info.config)
    if info.qkv is not None:
        log.info("%s: q/k/v rows %s (%s)", info.path, info.qkv.layout, info.qkv.evidence)
    return info


# ================================================================================================================
# Reading (per rank)
# ================================================================================================================


def _check_tp(cfg: DiTConfig, tp_rank: int, tp_size: int) -> None:
    """Fail before reading anything if this TP degree cannot shard the config."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    validate_tp(cfg, tp_size)


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
        self.timings: dict[str, float] = {}  # seconds of the load's steps: "check", "read", "finite"


class _RankReader:
    """Reads this rank's part of one of our tensors, as the model's tensor-parallel plan slices it."""

    def __init__(self, info: CheckpointInfo, cfg: DiTConfig, tp_rank: int, tp_size: int, reader: TensorReader):
        self.info, self.cfg, self.rank, self.size = info, cfg, tp_rank, tp_size
        self.reader = reader

    def _rows(self, key: str, ranges: list[tuple[int, int]], per: int) -> torch.Tensor:
        """Rows `ranges` (one per section, in our row numbering) of our tensor, read from its source(s)."""
        src, r = self.info.sources[key], self.reader
        if src.arrangement == "qkv_interleaved":
            # Release rows are [head0: q k v, head1: q k v, ...]: the heads of this rank form one contiguous row
            # block, read once and reordered to [q of those heads; k; v].
            hd = self.cfg.head_dim
            h0, h1 = ranges[0][0] // hd, ranges[0][1] // hd
            block = r.rows(src.keys[0], h0 * QKV_SECTIONS * hd, h1 * QKV_SECTIONS * hd)
            return block.view(h1 - h0, QKV_SECTIONS, hd, *block.shape[1:]).transpose(0, 1).reshape(-1, *block.shape[1:])
        if src.arrangement == "same" and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
            return r.rows(src.keys[0], ranges[0][0], ranges[-1][1])  # adjacent sections: one read, no concatenation
        parts = []
        for s, (lo, hi) in enumerate(ranges):
            a, b = lo - s * per, hi - s * per  # rows inside section s
            if src.arrangement == "qkv_split":
                parts.append(r.rows(src.keys[s], a, b))
            elif src.arrangement == "fc1_swapped":  # diffusers stores [value; gate]
                other = (1 - s) * per
                parts.append(r.rows(src.keys[0], other + a, other + b))
            else:
                parts.append(r.rows(src.keys[0], lo, hi))
        return torch.cat(parts)

    def read(self, key: str) -> torch.Tensor:
        style = param_style(PLAN, key)
        shape = self.info.shapes[key].shape
        if isinstance(style, ColumnParallel):
            return self._rows(key, section_ranges(style, shape[0], self.rank, self.size), shape[0] // style.sections)
        if isinstance(style, RowParallel) and key.endswith(".weight"):
            return self.reader.cols(self.info.sources[key].keys[0], *column_range(shape[1], self.rank, self.size))
        return self.reader.whole(self.info.sources[key].keys[0])

    def read_int8(self, key: str) -> tuple[QuantizedWeight | torch.Tensor, bool]:
        """(this rank's int8 weight, or a dense fp32 tensor when it had to be dequantised; was-dequantised)."""
        prefix = key[: -len(".weight")]
        disk = self.info.sources[key].keys[0]
        g = read_quant_spec(self.reader, self.info.entries, disk).groupsize
        if not isinstance(param_style(PLAN, key), RowParallel):
            return QuantizedWeight(self.read(key), self.read(f"{prefix}.weight_scale").float(), g), False
        # Row-parallel (column-sliced) weight: every rank needs the whole per-row scale (rows are not split).
        scale = self.read(f"{prefix}.weight_scale").float()
        lo, hi = column_range(self.info.shapes[key].shape[1], self.rank, self.size)
        if not g or (lo % g == 0 and hi % g == 0):
            return QuantizedWeight(self.reader.cols(disk, lo, hi), scale, g), False
        # The ConvRot rotation mixes all g input columns of a group, so a slice that cuts through a group can neither
        # be un-rotated nor fed to the int8 kernel (whose online activation rotation works on whole groups). Read the
        # group-aligned superset, dequantise it, and cut the dense result (e.g. out_proj at TP8: 896 = 3.5 x 256).
        a, b = (lo // g) * g, -(-hi // g) * g
        dense = dequantize_convrot(self.reader.cols(disk, a, b), scale, g, torch.float32)[:, lo - a: hi - a]
        log.info("%s: TP slice [%d:%d] is not aligned to ConvRot group %d; dequantised at load", key, lo, hi, g)
        return dense.contiguous(), True


def _out_dtype(key: str, stored: str, variant: Variant, dtype: torch.dtype) -> torch.dtype:
    """Precision contract: fp32 islands stay fp32; the curve-form AdaLN runs in fp32; the rest -> dtype."""
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
        raise ValueError(f"requested keys not in a {info.variant.name} checkpoint: {named(unknown)}")
    return [k for k in names if k in keys]


def _default_inv_freq(cfg: DiTConfig) -> torch.Tensor:
    """rope.inv_freq buffer, 1 / theta^(arange(0, 2f, 2) / 2f) (diffusers drops it from its files)."""
    f = cfg.rope_freq_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float64) / (2 * f))).float()


def _rope_tolerance(stored: str) -> tuple[float, float]:
    """(rtol, atol) of a stored rope.inv_freq against `_default_inv_freq`: one unit in the last place of the dtype
    the file stores it in (a writer that computed it in fp32 and then cast the whole file to fp16 / bf16 rounds it
    once more; below the dtype's normal range its spacing is fixed), never tighter than 1e-5 (fp32 evaluations of
    the formula differ by a few ulp). Another model's RoPE (another rope_theta or rope_freq_dim) is off by far more."""
    fi = torch.finfo(TORCH_DTYPE.get(stored, torch.float32))
    return max(RTOL_FP32_ROPE, fi.eps), fi.smallest_normal * fi.eps


def _where(info: CheckpointInfo, key: str) -> tuple[Path, str]:
    """(file, name) of one of our tensors for an error message: the file's own key(s) when they differ from ours."""
    src = info.sources.get(key)
    if src is None:  # rebuilt from the config (rope.inv_freq of a diffusers file)
        return info.path, f"{key} (computed from the config)"
    disk = [info.entries[k].disk_key or k for k in src.keys]
    return info.entries[src.keys[0]].file, key if disk == [key] else f"{' / '.join(disk)} (our {key})"


def load_dit_weights(
    path: str | Path,
    cfg: DiTConfig | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    quant_mode: QuantMode = "kernel",
    dtype: torch.dtype = torch.bfloat16,
    *,
    keys: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    qkv_layout: QKVLayout | None = None,
    device: torch.device | str = "cpu",
    workers: int = 1,
    source: WeightSource | None = None,
) -> DiTWeights:
    """This rank's DiT weights, in our key names, after validating the checkpoint against `cfg` (again: a file
    replaced since start-up fails here with a CheckpointError, FAILED_PRECONDITION).

    Each tensor is read (this rank's slices only) and moved to `device` on one of `workers` threads, each with
    its own file handles: the page-cache reads and host-to-device copies of different tensors overlap (a swap-in
    is bound by them, docs/memory.md). The result does not depend on `workers`.

    cfg None: the config the checkpoint declares. quant_mode "kernel": int8 weights stay QuantizedWeight
    (except unaligned row-parallel slices); "dequant": every int8 weight is dequantised to `dtype`.
    `keys` restricts the load to a subset of our weight names (e.g. one block's AdaLN); `skip` names weights not to
    read (the caller has them already, e.g. converted at an earlier load). `source`: where the load reads the files
    (stagekit.checkpoints.WeightSource: a file the stage keeps in host memory comes from its copy); None: the disk.
    """
    if quant_mode not in ("kernel", "dequant"):
        raise ValueError(f"quant_mode must be 'kernel' or 'dequant', got {quant_mode!r}")
    t0 = time.monotonic()
    info = inspect_checkpoint(path, base=cfg, qkv_layout=qkv_layout)
    cfg = cfg or info.config
    _check_tp(cfg, tp_rank, tp_size)
    reader = TensorReader(info.entries, source=source)
    validate(info, cfg, reader)
    reader.close()
    t1 = time.monotonic()
    out = DiTWeights(info.variant, cfg)
    local = threading.local()  # one TensorReader (safetensors handles) per worker thread
    finite = FiniteCheck()  # every float tensor as loaded, on `device`: one host sync for the whole load
    # Files kept in host memory by the stage process: views of the copy, moved through pinned staging buffers and
    # cast on the device (stagekit/host_copy.py); the same bits as reading the file and casting first.
    staged = source is not None and all(source.has_copy(f) for f in {e.file for e in info.entries.values()})
    staging_before = source.staging.seconds() if staged else {}

    def move(value: torch.Tensor | QuantizedWeight, out_dtype: torch.dtype | None = None):
        if isinstance(value, QuantizedWeight):
            return (QuantizedWeight(source.to_device(value.qdata, device), source.to_device(value.scale, device),
                                    value.groupsize) if staged else value.to(device))
        if staged:
            return source.to_device(value, device, out_dtype)
        return (value if out_dtype is None else value.to(out_dtype)).to(device)

    def read(key: str) -> tuple[torch.Tensor | QuantizedWeight, bool]:
        if key not in info.shapes or (key == "rope.inv_freq" and info.shapes[key].dtype != "F32"):
            # Absent (diffusers drops it), or stored rounded to fp16 / bf16 (a file cast whole): `validate` found it
            # equal to the formula at that rounding, and the RoPE table is fp32 (precision contract): the formula.
            return _default_inv_freq(cfg).to(device), False
        if not hasattr(local, "rr"):
            # NaN / Inf: checked on `device` below, not here.
            local.reader = TensorReader(info.entries, source=source, check_finite=False, views=staged)
            local.rr = _RankReader(info, cfg, tp_rank, tp_size, local.reader)
        stored = info.shapes[key].dtype
        was_dequantized = False
        if stored == "I8":
            value, was_dequantized = local.rr.read_int8(key)
            if quant_mode == "dequant" and isinstance(value, QuantizedWeight):
                value, was_dequantized = value.dequantize(dtype), True
            if was_dequantized:
                value = value.to(dtype)
            return move(value), was_dequantized
        return move(local.rr.read(key), _out_dtype(key, stored, info.variant, dtype)), was_dequantized

    skip = set(skip)
    wanted = [k for k in _wanted_keys(info, cfg, keys) if k not in skip]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dit-load") as pool:
        for key, (value, was_dequantized) in zip(wanted, pool.map(read, wanted)):
            out[key] = value
            if was_dequantized:
                out.dequantized.append(key)
            if isinstance(value, QuantizedWeight):  # int8 cannot hold a NaN; its float scale can
                finite.add(*_where(info, key[: -len("weight")] + "weight_scale"), value.scale)
            else:
                finite.add(*_where(info, key), value)
    t2 = time.monotonic()
    finite.raise_if_bad()
    out.timings = {"check": t1 - t0, "read": t2 - t1, "finite": time.monotonic() - t2}
    if staged:  # the read's staged copies, summed over the loader threads (stagekit.host_copy.Staging.seconds)
        out.timings.update({f"read_threads_{k}": v - staging_before[k] for k, v in source.staging.seconds().items()})
    log.info("%s: checked %.2f s, read%s %.2f s, finite check %.2f s", Path(path).name, t1 - t0,
             " from the host copy" if staged else "", t2 - t1, out.timings["finite"])
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
