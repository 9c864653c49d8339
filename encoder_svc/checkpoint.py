"""Text-encoder (Qwen3-VL-32B language model, truncated to 50 layers) checkpoint reading.

Layouts (names relative to the language model; reference/h3_architecture.md §6):

- ComfyUI single file ``qwen3vl_32b_minimax_h3_{bf16,int8_convrot,nvfp4_awq}.safetensors``:
  ``model.embed_tokens.weight``, ``model.layers.{0..49}.*``, ``visual.*``; no final norm / lm_head.
- Release / transformers (``Qwen3VLForConditionalGeneration``, one file or an index of shards):
  ``model.language_model.{embed_tokens,layers.{0..63},norm}.*``, ``model.visual.*``, ``lm_head.weight``.

Per linear the weight is one of (detected from the header, per tensor):

- dense      ``weight`` BF16/F16/F32 [out, in]
- int8       ``weight`` I8 [out, in] + ``weight_scale`` F32 [out, 1] (or scalar) + ``comfy_quant`` JSON,
             ConvRot-rotated when the JSON says so (dequantised by ``stagekit.quant``)
- nvfp4      ``weight`` U8 [out, in/2] + ``weight_scale`` F8-E4M3 (swizzled) + ``weight_scale_2`` F32
             (+ optional ``pre_quant_scale`` AWQ vector, ``input_scale``, ``comfy_quant``) (``stagekit.nvfp4``)

The embedding may also be int8 tensor-wise (one scalar scale; seen in the nvfp4 file's header inventory).
Layers at or beyond ``cfg.num_layers`` (the release has 64) are never read; the final norm and
lm_head are skipped on purpose (the conditioning is the *pre-norm* residual after layer 50).

Reading is lazy: :class:`TextEncoderCheckpoint` opens the file(s) with safetensors (mmap) and
validates the header only; tensors are read layer by layer.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from stagekit import nvfp4
from stagekit.quant import dequantize_convrot, parse_comfy_quant

if TYPE_CHECKING:  # pragma: no cover
    from encoder_svc.conditioner import ConditionerConfig

# Module-relative parameter names of one decoder layer (== ComfyUI / transformers names).
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
EMBED = "embed_tokens"

# File-name prefixes of the language model, by layout.
LAYOUT_PREFIX = {"comfy": "model.", "release": "model.language_model."}
VISUAL_PREFIXES = ("visual.", "model.visual.")
# Tensors of a full language model that the conditioner does not use: it stops before the final norm.
UNUSED_EXACT = ("lm_head.weight", "model.norm.weight", "model.language_model.norm.weight")
# Extra per-weight tensors a quantised linear may carry.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DENSE_LABEL = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MAX_NAMES_IN_ERROR = 12
H3_TE_METADATA = "minimax_h3_te"  # safetensors metadata: {"num_hidden_layers": 50, "output": "unnormalized_hidden_after_layer_50"}


class CheckpointError(ValueError):
    """The checkpoint does not match the expected text-encoder layout (message names the keys)."""


def _names(keys, limit: int = _MAX_NAMES_IN_ERROR) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def expected_shapes(cfg: "ConditionerConfig") -> dict[str, tuple[int, ...]]:
    """Dense shape of every used parameter, by module-relative name (``embed_tokens.weight``, ``layers.i.*``)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, mlp = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    per_layer = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (mlp, h),
        "mlp.up_proj": (mlp, h),
        "mlp.down_proj": (h, mlp),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "self_attn.q_norm": (d,),
        "self_attn.k_norm": (d,),
    }
    out: dict[str, tuple[int, ...]] = {f"{EMBED}.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        for name, shape in per_layer.items():
            out[f"layers.{i}.{name}.weight"] = shape
    return out


@dataclass
class RawParam:
    """One parameter as stored: a dense tensor, or the tensors of a quantised weight."""

    format: str  # "dense" | "int8" | "nvfp4"
    tensors: dict[str, torch.Tensor]  # suffix ("weight", "weight_scale", ...) -> tensor
    shape: tuple[int, ...]  # dense shape
    groupsize: int | None = None  # int8 ConvRot group size (None = no rotation)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RawParam":
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return RawParam(self.format, moved, self.shape, self.groupsize)

    def pin_memory(self) -> "RawParam":
        return RawParam(self.format, {k: v.pin_memory() for k, v in self.tensors.items()}, self.shape, self.groupsize)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantise on the device the tensors live on."""
        t = self.tensors
        if self.format == "dense":
            return t["weight"].to(dtype)
        if self.format == "int8":
            return dequantize_convrot(t["weight"], t["weight_scale"], self.groupsize, dtype)
        if self.format == "nvfp4":
            return nvfp4.dequantize_nvfp4(
                t["weight"],
                t["weight_scale"],
                t["weight_scale_2"],
                self.shape,
                pre_quant_scale=t.get("pre_quant_scale"),
                dtype=dtype,
            )
        raise CheckpointError(f"unknown weight format {self.format!r}")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding lookup without densifying the whole table (dense or row/tensor-wise int8 only)."""
        t = self.tensors
        if self.format == "dense":
            return t["weight"][ids].to(dtype)
        if self.format == "int8" and self.groupsize is None:
            scale = t["weight_scale"].float()
            scale = scale.reshape(-1, 1)[ids] if scale.numel() > 1 else scale.reshape(())
            return (t["weight"][ids].float() * scale).to(dtype)
        return self.dense(dtype)[ids]


@dataclass(frozen=True)
class CheckpointInfo:
    """What the header says (no tensor data read)."""

    files: tuple[Path, ...]
    layout: str  # "comfy" | "release"
    variant: str  # "bf16" | "fp16" | "fp32" | "int8_convrot" | "int8" | "nvfp4_awq" | "mixed"
    formats: dict[str, int]  # linear-format -> count over the used layers
    layers_in_file: int
    ignored: tuple[str, ...]  # tensors present but deliberately unused (layers >= used, final norm, lm_head)
    has_visual: bool
    metadata: dict[str, str]
    fingerprint: str  # sha256 over the sorted (name, dtype, shape) inventory + file sizes: a cheap model id


class TextEncoderCheckpoint:
    """Lazily readable, header-validated text-encoder checkpoint (one file, a shard directory, or an index)."""

    def __init__(self, path: str | Path, cfg: "ConditionerConfig"):
        self.cfg = cfg
        self._files = _resolve_files(Path(path))
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in self._files]
        self._where: dict[str, int] = {}
        self._header: dict[str, tuple[str, tuple[int, ...]]] = {}
        metadata: dict[str, str] = {}
        for n, h in enumerate(self._handles):
            metadata.update(h.metadata() or {})
            for k in h.keys():
                sl = h.get_slice(k)
                self._where[k] = n
                self._header[k] = (sl.get_dtype(), tuple(sl.get_shape()))
        self._plan: dict[str, tuple[str, str, tuple[int, ...], int | None]] = {}
        self.info = self._validate(metadata)

    # ------------------------------------------------------------------ header validation
    def _validate(self, metadata: dict[str, str]) -> CheckpointInfo:
        cfg = self.cfg
        keys = set(self._header)
        if any(k.startswith(LAYOUT_PREFIX["release"]) for k in keys):
            layout = "release"
        elif any(k.startswith(LAYOUT_PREFIX["comfy"] + "layers.") or k == "model.embed_tokens.weight" for k in keys):
            layout = "comfy"
        else:
            raise CheckpointError(
                f"{self._files[0]}: no Qwen3-VL language-model tensors found (expected 'model.layers.*' "
                f"(ComfyUI) or 'model.language_model.layers.*' (release)); first keys: {_names(keys)}"
            )
        prefix = LAYOUT_PREFIX[layout]
        expected = expected_shapes(cfg)
        claimed: set[str] = set()
        ignored: list[str] = []
        unexpected: list[str] = []
        layer_ids: set[int] = set()
        for k in keys:
            if k.startswith(VISUAL_PREFIXES) and not k.startswith(prefix + "layers."):
                claimed.add(k)  # vision tower: kept for the fl2va/ref2va seam, not read for t2va
                continue
            if k in UNUSED_EXACT:
                ignored.append(k)
                continue
            if not k.startswith(prefix):
                unexpected.append(k)
                continue
            m = _LAYER_RE.match(k[len(prefix):])
            if m:
                layer_ids.add(int(m.group(1)))
                if int(m.group(1)) >= cfg.num_layers:
                    ignored.append(k)

        missing: list[str] = []
        misshapen: list[str] = []
        formats: dict[str, int] = {}
        for name, shape in expected.items():
            base = name[: -len(".weight")]
            wkey = prefix + name
            if wkey not in self._header:
                missing.append(wkey)
                continue
            try:
                fmt, gs = self._classify(prefix + base, shape)
            except CheckpointError as e:
                misshapen.append(str(e))
                continue
            self._plan[name] = (fmt, prefix + base, shape, gs)
            claimed.update(k for k in (wkey, *(f"{prefix}{base}.{s}" for s in QUANT_SUFFIXES)) if k in self._header)
            if name.startswith("layers.") and base.endswith(LINEARS):
                if fmt == "dense":
                    label = _DENSE_LABEL[self._header[wkey][0]]
                elif fmt == "int8":
                    label = "int8_convrot" if gs else "int8"
                else:  # nvfp4; ComfyUI calls the file "nvfp4_awq" whether or not pre_quant_scale is stored
                    label = "nvfp4_awq"
                formats[label] = formats.get(label, 0) + 1
        for k in keys:
            if k in claimed or k in ignored or k in unexpected:
                continue
            unexpected.append(k)

        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} tensor(s): {_names(unexpected)}")
        if misshapen:
            problems.append(f"{len(misshapen)} tensor(s) with wrong dtype/shape: {'; '.join(misshapen[:_MAX_NAMES_IN_ERROR])}")
        if problems:
            raise CheckpointError(
                f"{self._files[0]} is not a Qwen3-VL text encoder with hidden {cfg.hidden_size} and >= "
                f"{cfg.num_layers} layers ({layout} layout): " + " | ".join(problems)
            )
        # ComfyUI's H3 text-encoder files state the conditioning layer in the header; trust but verify.
        te_meta = metadata.get(H3_TE_METADATA)
        if te_meta is not None:
            try:
                declared = int(json.loads(te_meta).get("num_hidden_layers"))
            except (ValueError, TypeError, AttributeError):
                declared = None
            if declared is not None and declared != cfg.num_layers:
                raise CheckpointError(
                    f"{self._files[0]}: header metadata {H3_TE_METADATA}={te_meta} declares the conditioning after "
                    f"layer {declared}, but the conditioner is configured for layer {cfg.num_layers}"
                )
        layers_in_file = max(layer_ids) + 1 if layer_ids else 0
        return CheckpointInfo(
            files=tuple(self._files),
            layout=layout,
            variant=_variant(formats),
            formats=formats,
            layers_in_file=layers_in_file,
            ignored=tuple(sorted(ignored)),
            has_visual=any(k.startswith(VISUAL_PREFIXES) and not k.startswith(prefix + "layers.") for k in keys),
            metadata=metadata,
            fingerprint=self._fingerprint(),
        )

    def _classify(self, base: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
        """Format of one weight from its header entries; raises CheckpointError naming the tensor."""
        h = self._header
        dtype, wshape = h[base + ".weight"]
        has = {s for s in QUANT_SUFFIXES if f"{base}.{s}" in h}
        qdoc = self._comfy_quant(base) if "comfy_quant" in has else None
        qfmt = str((qdoc or {}).get("format", "")).lower()
        if dtype in _FLOAT_DTYPES and qdoc is None:
            if wshape != shape:
                raise CheckpointError(f"{base}.weight is {dtype}{list(wshape)}, expected {list(shape)}")
            return "dense", None
        if dtype == "I8" or qfmt.startswith("int8"):
            if dtype != "I8" or wshape != shape:
                raise CheckpointError(f"{base}.weight is {dtype}{list(wshape)}, expected I8{list(shape)}")
            if "weight_scale" not in has:
                raise CheckpointError(f"{base}.weight_scale is missing for an int8 weight")
            sdt, sshape = h[base + ".weight_scale"]
            n_scale = 1
            for s in sshape:
                n_scale *= s
            if sdt not in _FLOAT_DTYPES or n_scale not in (1, shape[0]):
                raise CheckpointError(f"{base}.weight_scale is {sdt}{list(sshape)}, expected F32 [{shape[0]}, 1] or scalar")
            if qdoc is None:
                raise CheckpointError(
                    f"{base}.comfy_quant is missing: cannot tell whether the int8 weight is ConvRot-rotated"
                )
            try:
                spec = parse_comfy_quant(qdoc)
            except ValueError as e:
                raise CheckpointError(f"{base}.comfy_quant: {e}") from e
            if spec.groupsize and shape[-1] % spec.groupsize:
                raise CheckpointError(f"{base}: in_features {shape[-1]} not a multiple of ConvRot group {spec.groupsize}")
            return "int8", spec.groupsize
        if dtype == "U8" or "nvfp4" in qfmt:
            rows, cols = shape
            if dtype != "U8" or len(wshape) != 2 or not (rows <= wshape[0] <= rows + 15) or wshape[1] * 2 < cols:
                raise CheckpointError(f"{base}.weight is {dtype}{list(wshape)}, expected U8[{rows}, {cols // 2}] (nvfp4)")
            for s in ("weight_scale", "weight_scale_2"):
                if s not in has:
                    raise CheckpointError(f"{base}.{s} is missing for an nvfp4 weight")
            sdt, sshape = h[base + ".weight_scale"]
            if sdt != "F8_E4M3":
                raise CheckpointError(f"{base}.weight_scale is {sdt}, expected F8_E4M3 block scales")
            try:
                nvfp4.block_scales_are_swizzled(sshape, wshape[0], wshape[1] * 2 // nvfp4.BLOCK_SIZE)
            except ValueError:
                try:
                    nvfp4.block_scales_are_swizzled(sshape, rows, cols // nvfp4.BLOCK_SIZE)
                except ValueError as e:
                    raise CheckpointError(f"{base}.weight_scale: {e}") from e
            if "pre_quant_scale" in has:
                pdt, pshape = h[base + ".pre_quant_scale"]
                n = 1
                for s in pshape:
                    n *= s
                if n != cols:
                    raise CheckpointError(f"{base}.pre_quant_scale is {pdt}{list(pshape)}, expected [{cols}]")
            return "nvfp4", None
        raise CheckpointError(f"{base}.weight has dtype {dtype} / comfy_quant format {qfmt!r}, which this loader does not read")

    def _comfy_quant(self, base: str) -> dict:
        raw = self._get(base + ".comfy_quant")
        try:
            doc = json.loads(bytes(raw.to(torch.uint8).flatten().tolist()).decode("utf-8").rstrip("\x00"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{base}.comfy_quant is not UTF-8 JSON: {e}") from e
        if not isinstance(doc, dict):
            raise CheckpointError(f"{base}.comfy_quant is not a JSON object")
        merged = dict(doc.get("params") or {})
        merged.update({k: v for k, v in doc.items() if k != "params"})
        return merged

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self._header):
            h.update(f"{k}|{self._header[k][0]}|{self._header[k][1]}\n".encode())
        for f in self._files:
            h.update(f"{f.name}|{f.stat().st_size}\n".encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ reading
    def _get(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def read(self, name: str) -> RawParam:
        """One used parameter by module-relative name, as stored (CPU tensors)."""
        try:
            fmt, base, shape, gs = self._plan[name]
        except KeyError:
            raise CheckpointError(f"{name!r} is not a parameter of the {self.cfg.num_layers}-layer text encoder") from None
        tensors = {"weight": self._get(base + ".weight")}
        if fmt != "dense":
            for s in QUANT_SUFFIXES:
                if s != "comfy_quant" and f"{base}.{s}" in self._header:
                    tensors[s] = self._get(f"{base}.{s}")
        return RawParam(fmt, tensors, shape, gs)

    def read_embed(self) -> RawParam:
        return self.read(f"{EMBED}.weight")

    def read_layer(self, i: int) -> dict[str, RawParam]:
        """Layer ``i``'s parameters keyed by their name inside the decoder layer (``self_attn.q_proj.weight``)."""
        if not 0 <= i < self.cfg.num_layers:
            raise CheckpointError(
                f"layer {i} is outside the conditioner's {self.cfg.num_layers} used layers "
                f"(the conditioning is the residual after layer {self.cfg.num_layers})"
            )
        return {f"{n}.weight": self.read(f"layers.{i}.{n}.weight") for n in (*LINEARS, *NORMS)}

    # ------------------------------------------------------------------ vision tower (fl2va / ref2va)
    def _visual_prefix(self) -> str | None:
        for pre in (("model.visual.",) if self.info.layout == "release" else ("visual.", "model.visual.")):
            if any(k.startswith(pre) for k in self._header):
                return pre
        return None

    def visual_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the vision tower's tensors by module-relative name (``blocks.0.attn.qkv.weight``); {} if absent."""
        pre = self._visual_prefix()
        if pre is None:
            return {}
        return {k[len(pre):]: self._header[k][1] for k in self._header if k.startswith(pre)}

    def read_visual(self) -> dict[str, torch.Tensor]:
        """The vision tower's tensors (dense float, as stored) by module-relative name. Raises CheckpointError if the
        file has no vision tower or stores it quantised (not read by this loader)."""
        pre = self._visual_prefix()
        if pre is None:
            raise CheckpointError(f"{self._files[0]} has no vision tower (no 'visual.*' tensors); keyframe (fl2va) "
                                  "conditioning needs the full Qwen3-VL text encoder file")
        out = {}
        for k, (dt, _) in self._header.items():
            if not k.startswith(pre):
                continue
            if dt not in _FLOAT_DTYPES:
                raise CheckpointError(f"{k} is stored as {dt}; only a dense (bf16/fp16/fp32) vision tower is supported")
            out[k[len(pre):]] = self._get(k)
        return out

    def close(self) -> None:
        self._handles = []


def densify(raw: dict[str, RawParam], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense tensors (on the raw tensors' device); norms keep the compute dtype too."""
    return {k: v.dense(dtype) for k, v in raw.items()}


def _variant(formats: dict[str, int]) -> str:
    if len(formats) != 1:
        return "mixed" if formats else "empty"
    (fmt,) = formats
    return fmt


def _resolve_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"text encoder checkpoint not found: {path}")
    if path.is_file() and path.name.endswith(".index.json"):
        idx = json.loads(path.read_text())
        names = sorted(set(idx.get("weight_map", {}).values()))
        if not names:
            raise CheckpointError(f"{path}: index has no weight_map")
        return [path.parent / n for n in names]
    if path.is_dir():
        idx = sorted(path.glob("*.safetensors.index.json"))
        if idx:
            return _resolve_files(idx[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        return files
    return [path]
