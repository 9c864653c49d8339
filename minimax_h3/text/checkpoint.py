"""Text-encoder (Qwen3-VL-32B language model, truncated to 50 layers) checkpoint reading.

Layouts (names relative to the language model; docs/model.md §6):

- ComfyUI single file ``qwen3vl_32b_minimax_h3_{bf16,int8_convrot,nvfp4_awq}.safetensors``:
  ``model.embed_tokens.weight``, ``model.layers.{0..49}.*``, ``visual.*``; no final norm / lm_head.
- Release / transformers (``Qwen3VLForConditionalGeneration``, one file or an index of shards):
  ``model.language_model.{embed_tokens,layers.{0..63},norm}.*``, ``model.visual.*``, ``lm_head.weight``.

Per linear the weight is one of (detected from the header, per tensor):

- dense      ``weight`` BF16/F16/F32 [out, in]
- int8       ``weight`` I8 [out, in] + ``weight_scale`` F32 [out, 1] (or scalar) + ``comfy_quant`` JSON,
             ConvRot-rotated when the JSON says so (dequantised by ``minimax_h3.kernels.int8``)
- nvfp4      ``weight`` U8 [out, in/2] + ``weight_scale`` F8-E4M3 (swizzled) + ``weight_scale_2`` F32
             (+ optional ``pre_quant_scale`` AWQ vector, ``input_scale``, ``comfy_quant``) (``minimax_h3.kernels.nvfp4``)

The embedding may also be int8 tensor-wise (one scalar scale; seen in the nvfp4 file's header inventory).
Layers at or beyond ``cfg.num_layers`` (the release has 64) are never read; the final norm and
lm_head are skipped on purpose (the conditioning is the *pre-norm* residual after layer 50).

Reading is lazy: :class:`TextEncoderCheckpoint` reads the header(s) with the stage toolkit
(stagekit.checkpoints) and validates the whole checkpoint from them -- every used layer, the comfy_quant
descriptors, and the vision tower when the file has one -- before the stage serves; tensors are read layer by
layer. Every problem is a CheckpointError naming the file and the first offending tensor.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from minimax_h3.kernels import nvfp4
from minimax_h3.kernels.int8 import QuantFormatError, dequantize_convrot, parse_comfy_quant
from minimax_h3.text.config import ConditionerConfig
from minimax_h3.text.vision import VisionConfig, infer_vision_config
from stagekit.checkpoints import (FLOAT, CheckpointError, HeaderEntry, KeyReport, NameMap, TensorReader, TensorSpec,
                                  key_report, open_checkpoint)

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

# Where the language model sits in a file, by layout: our module-relative names <-> file names.
LAYOUT_NAMES = {"comfy": NameMap.prefix("model."), "release": NameMap.prefix("model.language_model.")}
VISUAL_PREFIXES = ("visual.", "model.visual.")
# Tensors of a full language model that the conditioner does not use: it stops before the final norm.
UNUSED_EXACT = ("lm_head.weight", "model.norm.weight", "model.language_model.norm.weight")
# Extra per-weight tensors a quantised linear may carry.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DENSE_LABEL = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
H3_TE_METADATA = "minimax_h3_te"  # safetensors metadata: {"num_hidden_layers": 50, "output": "unnormalized_hidden_after_layer_50"}


def expected_shapes(cfg: ConditionerConfig) -> dict[str, tuple[int, ...]]:
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


def conditioner_config_for(path: str | Path) -> ConditionerConfig:
    """The conditioner's geometry, decided from the file's header (no tensor data read): the full model (the
    residual after layer 50 of Qwen3-VL-32B) unless the embedding (``[vocab, hidden]``) is the tiny family's width;
    a tiny-family file runs the layers its header declares (``minimax_h3_te.num_hidden_layers``), or all the
    layers its keys hold when it declares none. A file whose keys lack a declared (or intermediate) layer is
    refused by TextEncoderCheckpoint's validation, which names the first missing key."""
    ckpt = open_checkpoint(path)
    tiny = ConditionerConfig.tiny()
    names = [n for n in LAYOUT_NAMES.values() if n.to_source(f"{EMBED}.weight") in ckpt.tensors]
    if not names or ckpt.tensors[names[0].to_source(f"{EMBED}.weight")].shape[-1] != tiny.hidden_size:
        return ConditionerConfig.full()  # not the tiny family (or no embedding: the full validation names it)
    te_meta = ckpt.metadata.get(H3_TE_METADATA)
    if te_meta is not None:
        try:
            declared = int(json.loads(te_meta)["num_hidden_layers"])
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(ckpt.files[0], f"header metadata {H3_TE_METADATA}={te_meta} has no integer "
                                                 f"num_hidden_layers ({e})") from None
        if declared < 1:
            raise CheckpointError(ckpt.files[0], f"header metadata {H3_TE_METADATA} declares {declared} layers")
        return ConditionerConfig.tiny(num_layers=declared)
    ids = {int(m.group(1)) for k in ckpt.tensors if (m := _LAYER_RE.match(names[0].from_source(k)))}
    if not ids:
        raise CheckpointError(ckpt.files[0], "no decoder layers: a tiny text encoder needs at least one",
                              names[0].to_source("layers.0.input_layernorm.weight"))
    return ConditionerConfig.tiny(num_layers=max(ids) + 1)


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
        raise ValueError(f"unknown weight format {self.format!r}")

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
    vision: VisionConfig | None = None  # the vision tower's dims (validated against the file), None without one


class TextEncoderCheckpoint:
    """Lazily readable, header-validated text-encoder checkpoint (one file, a shard directory, or an index)."""

    def __init__(self, path: str | Path, cfg: ConditionerConfig):
        self.cfg = cfg
        self.path = Path(path)
        ckpt = open_checkpoint(path)
        self._files = ckpt.files
        self._entries: dict[str, HeaderEntry] = ckpt.tensors
        self._header: dict[str, tuple[str, tuple[int, ...]]] = {k: (e.dtype, e.shape) for k, e in ckpt.tensors.items()}
        self._reader = TensorReader(ckpt.tensors)
        self._plan: dict[str, tuple[str, str, tuple[int, ...], int | None]] = {}
        self.info = self._validate(ckpt.metadata)

    def _error(self, problem: str, key: str | None = None) -> CheckpointError:
        file = self._entries[key].file if key in self._entries else self.path
        return CheckpointError(file, problem, key)

    # ------------------------------------------------------------------ header validation
    def _validate(self, metadata: dict[str, str]) -> CheckpointInfo:
        cfg = self.cfg
        keys = set(self._header)
        release, comfy = LAYOUT_NAMES["release"], LAYOUT_NAMES["comfy"]
        if any(release.from_source(k) != k for k in keys):
            layout = "release"
        elif any(comfy.from_source(k).startswith("layers.") or k == comfy.to_source(f"{EMBED}.weight") for k in keys):
            layout = "comfy"
        else:
            raise CheckpointError(
                self._files[0], "no Qwen3-VL language-model tensors found (expected 'model.layers.*' (ComfyUI) or "
                                f"'model.language_model.layers.*' (release)); first keys: {sorted(keys)[:10]}")
        names = LAYOUT_NAMES[layout]
        prefix = names.to_source("")
        report = KeyReport()
        claimed: set[str] = set()
        ignored: list[str] = []
        layer_ids: set[int] = set()
        for k in sorted(keys):
            if k.startswith(VISUAL_PREFIXES) and not k.startswith(prefix + "layers."):
                claimed.add(k)  # vision tower: validated below, read on the first keyframe request
            elif k in UNUSED_EXACT:
                ignored.append(k)
            elif (m := _LAYER_RE.match(names.from_source(k))) and k.startswith(prefix):
                layer_ids.add(int(m.group(1)))
                if int(m.group(1)) >= cfg.num_layers:
                    ignored.append(k)

        formats: dict[str, int] = {}
        for name, shape in expected_shapes(cfg).items():
            base = name[: -len(".weight")]
            wkey = names.to_source(name)
            if wkey not in self._header:
                report.missing.append(wkey)
                report.first = report.first or (wkey, None)
                continue
            try:
                fmt, gs = self._classify(names.to_source(base), shape)
            except CheckpointError as e:
                report.misshapen.append(f"{e.key}: {e.problem}")
                report.first = report.first or (e.key, self._entries[wkey].file)
                continue
            self._plan[name] = (fmt, names.to_source(base), shape, gs)
            claimed.update(k for k in (wkey, *(f"{names.to_source(base)}.{s}" for s in QUANT_SUFFIXES))
                           if k in self._header)
            if name.startswith("layers.") and base.endswith(LINEARS):
                if fmt == "dense":
                    label = _DENSE_LABEL[self._header[wkey][0]]
                elif fmt == "int8":
                    label = "int8_convrot" if gs else "int8"
                else:  # nvfp4; ComfyUI calls the file "nvfp4_awq" whether or not pre_quant_scale is stored
                    label = "nvfp4_awq"
                formats[label] = formats.get(label, 0) + 1
        for k in sorted(keys - claimed - set(ignored)):
            report.unexpected.append(k)
            report.first = report.first or (k, self._entries[k].file)
        report.raise_if_bad(self.path, f"a Qwen3-VL text encoder with hidden {cfg.hidden_size} and >= "
                                       f"{cfg.num_layers} layers ({layout} layout)")
        # ComfyUI's H3 text-encoder files state the conditioning layer in the header; trust but verify.
        te_meta = metadata.get(H3_TE_METADATA)
        if te_meta is not None:
            try:
                declared = int(json.loads(te_meta).get("num_hidden_layers"))
            except (ValueError, TypeError, AttributeError):
                declared = None
            if declared is not None and declared != cfg.num_layers:
                raise CheckpointError(
                    self._files[0], f"header metadata {H3_TE_METADATA}={te_meta} declares the conditioning after "
                                    f"layer {declared}, but the conditioner is configured for layer {cfg.num_layers}")
        has_visual = any(k.startswith(VISUAL_PREFIXES) and not k.startswith(prefix + "layers.") for k in keys)
        return CheckpointInfo(
            files=tuple(self._files),
            layout=layout,
            variant=_variant(formats),
            formats=formats,
            layers_in_file=max(layer_ids) + 1 if layer_ids else 0,
            ignored=tuple(sorted(ignored)),
            has_visual=has_visual,
            metadata=metadata,
            fingerprint=self._fingerprint(),
            vision=self._validate_visual(layout) if has_visual else None,
        )

    def _validate_visual(self, layout: str) -> VisionConfig:
        """The vision tower's dims, and every one of its tensors checked against Qwen3-VL's vision model of those
        dims (a meta-device build: no memory), so a broken tower fails at start-up, not at the first keyframe."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        pre = self._visual_prefix(layout)
        shapes = {k[len(pre):]: e for k, e in self._entries.items() if k.startswith(pre)}
        try:
            vcfg = infer_vision_config({k: e.shape for k, e in shapes.items()}, self.cfg.vision)
        except KeyError as e:
            raise CheckpointError(self._files[0], "missing: the vision tower's dims cannot be read without it",
                                  f"{pre}{e.args[0]}") from None
        if vcfg.out_hidden_size != self.cfg.hidden_size:
            raise CheckpointError(self._files[0], f"vision tower outputs {vcfg.out_hidden_size}-d features but the LM "
                                                  f"is {self.cfg.hidden_size}-d", f"{pre}merger.linear_fc2.weight")
        with torch.device("meta"):
            want = {k: TensorSpec(tuple(v.shape), FLOAT) for k, v in Qwen3VLVisionModel(vcfg.hf_config()).state_dict().items()}
        key_report(shapes, want).raise_if_bad(self.path, f"Qwen3-VL's vision tower (depth {vcfg.depth}, hidden "
                                                         f"{vcfg.hidden_size}; names under {pre!r})")
        return vcfg

    def _classify(self, base: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
        """Format of one weight from its header entries; raises CheckpointError naming the tensor."""
        h = self._header
        dtype, wshape = h[base + ".weight"]
        has = {s for s in QUANT_SUFFIXES if f"{base}.{s}" in h}
        qdoc = self._comfy_quant(base) if "comfy_quant" in has else None
        qfmt = str((qdoc or {}).get("format", "")).lower()
        err = self._error
        if dtype in _FLOAT_DTYPES and qdoc is None:
            if wshape != shape:
                raise err(f"{dtype}{list(wshape)}, expected {list(shape)}", base + ".weight")
            return "dense", None
        if dtype == "I8" or qfmt.startswith("int8"):
            if dtype != "I8" or wshape != shape:
                raise err(f"{dtype}{list(wshape)}, expected I8{list(shape)}", base + ".weight")
            if "weight_scale" not in has:
                raise err("missing for an int8 weight", base + ".weight_scale")
            sdt, sshape = h[base + ".weight_scale"]
            n_scale = 1
            for d in sshape:
                n_scale *= d
            if sdt not in _FLOAT_DTYPES or n_scale not in (1, shape[0]):
                raise err(f"{sdt}{list(sshape)}, expected F32 [{shape[0]}, 1] or scalar", base + ".weight_scale")
            if qdoc is None:
                raise err("missing: cannot tell whether the int8 weight is ConvRot-rotated", base + ".comfy_quant")
            try:
                spec = parse_comfy_quant(qdoc)
            except QuantFormatError as e:
                raise err(str(e), base + ".comfy_quant") from e
            if spec.groupsize and shape[-1] % spec.groupsize:
                raise err(f"ConvRot group size {spec.groupsize} does not divide the weight's in_features {shape[-1]}",
                          base + ".comfy_quant")
            return "int8", spec.groupsize
        if dtype == "U8" or "nvfp4" in qfmt:
            rows, cols = shape
            if dtype != "U8" or len(wshape) != 2 or not (rows <= wshape[0] <= rows + 15) or wshape[1] * 2 < cols:
                raise err(f"{dtype}{list(wshape)}, expected U8[{rows}, {cols // 2}] (nvfp4)", base + ".weight")
            for s in ("weight_scale", "weight_scale_2"):
                if s not in has:
                    raise err("missing for an nvfp4 weight", f"{base}.{s}")
            sdt, sshape = h[base + ".weight_scale"]
            if sdt != "F8_E4M3":
                raise err(f"{sdt}, expected F8_E4M3 block scales", base + ".weight_scale")
            try:
                nvfp4.block_scales_are_swizzled(sshape, wshape[0], wshape[1] * 2 // nvfp4.BLOCK_SIZE)
            except ValueError:
                try:
                    nvfp4.block_scales_are_swizzled(sshape, rows, cols // nvfp4.BLOCK_SIZE)
                except ValueError as e:
                    raise err(str(e), base + ".weight_scale") from e
            if "pre_quant_scale" in has:
                pdt, pshape = h[base + ".pre_quant_scale"]
                n = 1
                for d in pshape:
                    n *= d
                if n != cols:
                    raise err(f"{pdt}{list(pshape)}, expected [{cols}]", base + ".pre_quant_scale")
            return "nvfp4", None
        raise err(f"dtype {dtype} / comfy_quant format {qfmt!r}, which this loader does not read", base + ".weight")

    def _comfy_quant(self, base: str) -> dict:
        raw = self._get(base + ".comfy_quant")
        try:
            doc = json.loads(bytes(raw.to(torch.uint8).flatten().tolist()).decode("utf-8").rstrip("\x00"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"not UTF-8 JSON: {e}", base + ".comfy_quant") from e
        if not isinstance(doc, dict):
            raise self._error("not a JSON object", base + ".comfy_quant")
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
        return self._reader.whole(key)

    def read(self, name: str) -> RawParam:
        """One used parameter by module-relative name, as stored (CPU tensors)."""
        try:
            fmt, base, shape, gs = self._plan[name]
        except KeyError:
            raise CheckpointError(self.path, f"not a parameter of the {self.cfg.num_layers}-layer text encoder",
                                  name) from None
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
            raise ValueError(
                f"layer {i} is outside the conditioner's {self.cfg.num_layers} used layers "
                f"(the conditioning is the residual after layer {self.cfg.num_layers})"
            )
        return {f"{n}.weight": self.read(f"layers.{i}.{n}.weight") for n in (*LINEARS, *NORMS)}

    # ------------------------------------------------------------------ vision tower (fl2va / ref2va)
    def _visual_prefix(self, layout: str | None = None) -> str | None:
        layout = layout or self.info.layout
        for pre in (("model.visual.",) if layout == "release" else ("visual.", "model.visual.")):
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
        """The vision tower's tensors (dense float, as stored; validated at open) by module-relative name. Raises
        CheckpointError if the file has no vision tower."""
        pre = self._visual_prefix()
        if pre is None:
            raise CheckpointError(self._files[0], "no vision tower (no 'visual.*' tensors); keyframe (fl2va) "
                                                  "conditioning needs the full Qwen3-VL text encoder file")
        return {k[len(pre):]: self._get(k) for k in self._header if k.startswith(pre)}

    def close(self) -> None:
        self._reader.close()


def densify(raw: dict[str, RawParam], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense tensors (on the raw tensors' device); norms keep the compute dtype too."""
    return {k: v.dense(dtype) for k, v in raw.items()}


def _variant(formats: dict[str, int]) -> str:
    if len(formats) != 1:
        return "mixed" if formats else "empty"
    (fmt,) = formats
    return fmt
