"""LoRA adapters for the H3 DiT: parse the common file dialects, apply per request, unmerged, tensor-parallel.

Math (per adapted linear W [out, in]):  y = W x + sum_i  s_i * (alpha_i / r_i) * B_i (A_i x),
A_i = `lora_down` / `lora_A` [r_i, in], B_i = `lora_up` / `lora_B` [out, r_i]. The base weight is never touched,
so one resident model (dense or int8 ConvRot) serves any LoRA set, and switching sets costs only the low-rank
factors: `LoRALinear` wraps the base linear (swapped in via `H3DiT.swap_linear`) and holds this rank's A/B slices.

Key dialects understood (all map onto our / ComfyUI linear names, docs/model.md §2.2):
  * ComfyUI / musubi:   `diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight` (also `model.diffusion_model.`,
                        `lora_down` / `lora_up` and a `.alpha` scalar);
  * PEFT:               `base_model.model.<name>.lora_A.default.weight` / `.lora_B.default.weight` (or no adapter
                        name); alpha from an `adapter_config.json` next to the file (`lora_alpha`, `r`), else 1;
  * kohya:              `lora_unet_blocks_0_attn_qkv_proj.lora_down.weight` / `.lora_up.weight` / `.alpha`
                        (module path with `_` for `.`; also `lora_transformer_`);
  * diffusers targets:  `transformer.transformer_blocks.0.attn.to_q` (and to_k / to_v = the q / k / v thirds of our
                        fused qkv_proj rows, `to_qkv` = all of it), `attn.to_out.0` -> out_proj,
                        `ff.net.0.proj` -> fc1 (B rows [value; gate] swapped to our [gate; value]), `ff.net.2` ->
                        fc2, `token_refiner.refiner_blocks`, `proj_in`, `context_embedder`, `norm_out.linear`, ...
                        (the rename table of minimax_h3/dit/convert_diffusers.py).
  Scale: alpha / rank when an alpha tensor is given; else PEFT's lora_alpha / rank (or / sqrt(rank) with
  use_rslora) from adapter_config.json; else 1 (the diffusers default for alpha == rank).

Tensor parallel (by the model's plan, `H3DiT._tp_plan`, exactly like the base weight): for a column-parallel linear
(qkv by this rank's heads inside each of the q/k/v thirds, fc1 by this rank's range inside each of the gate/value
halves, AdaLN by row range) B's rows are sliced and A is whole; for a row-parallel one (out_proj, fc2) A's columns
are sliced and B is whole, so the LoRA term is a partial sum that rides on the existing fp32 all-reduce of the block
(no extra collective). Replicated linears keep both whole.

Full-tensor patches (ComfyUI's `comfy/lora.py` keys, as LightX2V's "comfyui" Turbo LoRAs carry them beside their
`lora_down` / `lora_up` / `alpha` factors): `<module>.diff` (also `.w_norm`) adds to the module's weight, `.diff_b`
(also `.b_norm`) to its bias, times the strength. They are applied to 1-D parameters (norm gains, biases: e.g.
`blocks.0.norm1.diff`, `blocks.0.adaln_proj.linear.diff_b`) in place, from a kept copy of the base values, and cut
by the TP plan like the parameter (a column-parallel bias by rows).

Not supported (rejected with a clear error naming the keys, never silently ignored): DoRA (`dora_scale`),
LoCon/LoHa/LoKr factors, `set_weight` replacements, a full `diff` of a linear's 2-D weight (linears stay unmerged,
and may be int8 or fp8; so factors and a diff never meet on one weight). A LoRA that touches the timestep modulation
(`adaln_proj` / `time_embedder` factors or weight diffs) is rejected on a curve-form ("pruned") checkpoint, whose
AdaLN input is a baked rank-8 table of the *base* time embedder: such a LoRA cannot be expressed there; an AdaLN
*bias* diff can (the curve form keeps the bias whole) and is applied.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimax_h3.contract import lora_file_names
from minimax_h3.kernels.layers import LinearMethod, Modulation, Residual, linear_method, modulated, o_rows
from stagekit.checkpoints import CheckpointError, HeaderEntry, TensorReader, read_header
from stagekit.errors import FailedPrecondition, Internal, InvalidArgument, NotFound
from stagekit.file_identity import FileIdentity

from .config import DiTConfig
from .convert_diffusers import DIFFUSERS_NAMES
from .model import H3DiT
from .ops import swiglu
from .tp import ColumnParallel, RowParallel, TPStyle, column_range, param_style, section_ranges, shard_tensor, tp_style

log = logging.getLogger(__name__)

MAX_LISTED = 12  # keys listed per category in a LoRAFileError
FINITE_CHECKED_FILES = 256  # LoRA file versions remembered as read and finite (admission reads each one once)
PEFT_CONFIG_NAME = "adapter_config.json"  # PEFT writes alpha / rank here, not into the tensors
DEFAULT_FILE_CACHE = 4  # parsed + sharded LoRA files kept per rank (device memory: the low-rank factors only)
# Prefixes in front of the module path, stripped in this order (at most one from each group).
WRAPPER_PREFIXES = ("base_model.model.",)  # PEFT
MODEL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")  # ComfyUI, diffusers pipelines
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")  # module path joined with "_"
# Anything under these names feeds the AdaLN modulation (ours, diffusers' final `norm_out.linear`, kohya forms).
TIMESTEP_MODULES = ("adaln_proj", "time_embedder", "norm_out.linear", "norm_out_linear")

_PEFT_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[A-Za-z0-9_\-]+))?\.weight$")
_KOHYA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>down|up)\.weight$")
_ALPHA_KEY = re.compile(r"^(?P<mod>.+)\.alpha$")
# ComfyUI's full-tensor patches (comfy/lora.py): `diff` / `w_norm` add to the module's weight, `diff_b` / `b_norm` to
# its bias; LightX2V's "comfyui" LoRAs carry them for norms and biases beside the low-rank factors.
_DIFF_KEY = re.compile(r"^(?P<mod>.+)\.(?P<kind>diff|diff_b|w_norm|b_norm)$")
_DIFF_SLOT = {"diff": "diff", "w_norm": "diff", "diff_b": "diff_b", "b_norm": "diff_b"}


class LoRAFileError(FailedPrecondition):
    """A LoRA file on the server that cannot be applied to this model: unreadable, keys or shapes that do not fit
    this DiT, unsupported kinds, NaN / Inf factors.

    FAILED_PRECONDITION, not the request's fault: the file sits on the server (in its loras directory, or at a path
    the operator allowed with --allow-lora-paths), so the caller cannot change it; only the operator can replace or
    remove it, and the same request succeeds once they have. A request naming a LoRA the server does not have is the
    request's fault (`resolve_lora_path`: InvalidArgument / NotFound)."""


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


# =====================================================================================================================
# Targets: the model's linears with their full (unsharded) geometry
# =====================================================================================================================
@dataclass(frozen=True)
class LoRATarget:
    name: str  # our linear name, e.g. "blocks.3.attn.qkv_proj"
    in_features: int  # full, unsharded
    out_features: int  # full, unsharded
    style: TPStyle | None  # its tensor-parallel style in H3DiT._tp_plan (None = replicated)


def _unwrapped_linears(model: nn.Module) -> dict[str, nn.Module]:
    """name -> base linear module, looking through LoRALinear wrappers (whose `.base` child is not a target)."""
    out = {}
    for name in model.linear_names():
        mod = model.get_submodule(name)
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name.endswith(".base") and isinstance(model.get_submodule(parent), LoRALinear):
            continue
        out[name] = mod.base if isinstance(mod, LoRALinear) else mod
    return out


@dataclass(frozen=True)
class ParamTarget:
    """A parameter a `diff` / `diff_b` patch may change: norm gains and biases (1-D; the linear weights themselves
    only take low-rank factors: they stay unmerged)."""

    name: str  # our parameter name, e.g. "blocks.3.norm1.weight", "blocks.3.adaln_proj.linear.bias"
    shape: tuple[int, ...]  # full, unsharded
    style: TPStyle | None  # its module's tensor-parallel style (a column-parallel bias is cut by rows)


class LoRATargets(dict):
    """Our linear name -> LoRATarget (the low-rank targets), and in `.params` our parameter name -> ParamTarget (what
    the file's full-tensor patches are checked against)."""

    def __init__(self, linears: Mapping[str, LoRATarget], params: Mapping[str, ParamTarget]):
        super().__init__(linears)
        self.params = dict(params)


def model_targets(model: nn.Module) -> LoRATargets:
    """LoRA targets of an H3DiT (any TP rank, any base linear type): full shapes from the local ones."""
    n = getattr(model, "tp_size", 1)
    linears = {}
    for name, mod in _unwrapped_linears(model).items():
        style = tp_style(model._tp_plan, name)
        fin, fout = mod.in_features, mod.out_features
        if isinstance(style, RowParallel):
            fin *= n
        elif isinstance(style, ColumnParallel):
            fout *= n
        linears[name] = LoRATarget(name, fin, fout, style)
    params = {}
    for name, p in model.named_parameters():
        name = name.replace(".base.", ".")  # a LoRALinear wrapper's base: the same parameter as unwrapped
        style = param_style(model._tp_plan, name)
        shape = list(p.shape)
        if isinstance(style, ColumnParallel):
            shape[0] *= n
        elif isinstance(style, RowParallel) and name.endswith(".weight"):
            shape[1] *= n
        params[name] = ParamTarget(name, tuple(shape), style)
    return LoRATargets(linears, params)


def config_targets(cfg: DiTConfig) -> LoRATargets:
    """The same targets from a config alone (a meta-device model: no memory), for request-time validation."""
    return model_targets(H3DiT(cfg, compute_dtype=torch.float32, device="meta"))


@dataclass(frozen=True)
class _Alias:
    target: str
    section: int | None = None  # q/k/v third of qkv_proj (diffusers to_q / to_k / to_v); None = the whole output
    swap_halves: bool = False  # diffusers ff.net.0.proj stores fc1 rows [value; gate]


def _alias_table(targets: Iterable[str]) -> tuple[dict[str, _Alias], dict[str, _Alias]]:
    """(dotted module path -> alias, kohya underscore path -> alias) for our names and diffusers names."""
    dotted: dict[str, _Alias] = {}
    for name in targets:
        dotted[name] = _Alias(name)
        diff = DIFFUSERS_NAMES.to_source(name + ".weight")[: -len(".weight")]
        if name.endswith(".attn.qkv_proj"):
            attn = diff[: -len("to_q")]
            for s, part in enumerate(("to_q", "to_k", "to_v")):
                dotted[attn + part] = _Alias(name, section=s)
            dotted[attn + "to_qkv"] = _Alias(name)
        elif name.endswith(".mlp.fc1"):
            dotted[diff] = _Alias(name, swap_halves=True)
        else:
            dotted.setdefault(diff, _Alias(name))
    kohya = {k.replace(".", "_"): v for k, v in dotted.items()}
    return dotted, kohya


# =====================================================================================================================
# Parsing
# =====================================================================================================================
@dataclass
class LoRAPart:
    """One low-rank update of one target, in full (unsharded) coordinates of our layout."""

    down: torch.Tensor  # A [r, in_features]
    up: torch.Tensor  # B [rows, r]; rows = out_features, or out_features/3 for a qkv `section`
    scale: float  # alpha / r (1 without alpha)
    section: int | None = None  # qkv third (0 q, 1 k, 2 v) the rows of `up` belong to; None = all output rows

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class LoRAWeights:
    """A parsed LoRA file: our target name -> its parts (usually one; three for a diffusers to_q/to_k/to_v LoRA)."""

    source: str
    parts: dict[str, list[LoRAPart]] = field(default_factory=dict)
    patches: dict[str, torch.Tensor] = field(default_factory=dict)  # our parameter name -> its full fp32 delta

    def delta(self, target: LoRATarget) -> torch.Tensor:
        """Full dense fp32 delta W [out, in] of `target` at strength 1 (merging, tests)."""
        d = torch.zeros(target.out_features, target.in_features, dtype=torch.float32)
        for p in self.parts.get(target.name, ()):
            w = p.scale * (p.up.float() @ p.down.float())
            if p.section is None:
                d += w
            else:
                rows = target.out_features // 3
                d[p.section * rows:(p.section + 1) * rows] += w
        return d


@dataclass
class _Module:
    """What a file holds for one module path (before resolution)."""

    down: str | None = None
    up: str | None = None
    alpha: str | None = None
    diff: str | None = None  # full delta of the module's weight (ComfyUI / LightX2V `.diff`, also `.w_norm`)
    diff_b: str | None = None  # full delta of its bias (`.diff_b`, also `.b_norm`)

    @property
    def factors(self) -> bool:
        return self.down is not None or self.up is not None or self.alpha is not None


def _strip_prefixes(path: str) -> tuple[str, bool]:
    """Module path without wrapper/model prefixes -> (path, is_kohya_underscore_form)."""
    for p in WRAPPER_PREFIXES:
        if path.startswith(p):
            path = path[len(p):]
            break
    for p in MODEL_PREFIXES:
        if path.startswith(p):
            path = path[len(p):]
            break
    for p in KOHYA_PREFIXES:
        if path.startswith(p):
            return path[len(p):], True
    return path, False


def _group_keys(keys: Iterable[str]) -> tuple[dict[str, _Module], list[str], set[str]]:
    """File keys -> (module path -> its A/B/alpha keys, unsupported keys, PEFT adapter names seen)."""
    modules: dict[str, _Module] = {}
    unsupported, adapters = [], set()
    for key in keys:
        m = _PEFT_KEY.match(key)
        if m:
            adapters.add(m["adapter"] or "")
            slot = "down" if m["ab"] == "A" else "up"
        elif (m := _DIFF_KEY.match(key)) is not None:
            slot = _DIFF_SLOT[m["kind"]]
        else:
            m = _KOHYA_KEY.match(key) or _ALPHA_KEY.match(key)
            if not m:
                unsupported.append(key)
                continue
            slot = "alpha" if key.endswith(".alpha") else m["ab"]
        mod = modules.setdefault(m["mod"], _Module())
        if getattr(mod, slot) is not None:
            raise LoRAFileError(f"LoRA module {m['mod']!r} has two {slot} tensors ({getattr(mod, slot)!r}, {key!r})")
        setattr(mod, slot, key)
    return modules, unsupported, adapters


def _is_timestep_module(path: str) -> bool:
    return any(t in path for t in TIMESTEP_MODULES)


@dataclass(frozen=True)
class _Planned:
    path: str  # module path as in the file
    alias: _Alias
    mod: _Module


@dataclass(frozen=True)
class _Patch:
    key: str  # the `diff` / `diff_b` tensor in the file
    param: str  # our parameter it adds to


def _plan(shapes: Mapping[str, tuple[int, ...]], targets: Mapping[str, LoRATarget], adaln_form: str,
          source: str) -> tuple[list[_Planned], list[_Patch]]:
    """Resolve every key of a file against the model: (low-rank modules, full-tensor patches). Raises one
    LoRAFileError naming every problem, so no key of a file is ever left unapplied. Header-only."""
    modules, unsupported, adapters = _group_keys(shapes)
    if unsupported:
        raise LoRAFileError(f"{source}: {len(unsupported)} tensor(s) are neither LoRA A/B/alpha factors nor diff / "
                            f"diff_b patches (DoRA, LoCon/LoKr and set_weight replacements are not supported): "
                            f"{_listed(unsupported)}")
    if len(adapters) > 1:
        raise LoRAFileError(f"{source}: holds several PEFT adapters {sorted(adapters)}; save one adapter per file")
    params = getattr(targets, "params", {})
    dotted, kohya = _alias_table(targets)
    planned, patches, unmatched, incomplete, timestep, bad, dense = [], [], [], [], [], [], []
    for path, mod in modules.items():
        stripped, is_kohya = _strip_prefixes(path)
        alias = (kohya if is_kohya else dotted).get(stripped)
        # On a curve-form DiT the modulation's input is a baked table of the base time embedder: nothing of a
        # timestep module can change but an AdaLN bias, which the curve form keeps whole (and adds as it is).
        curve_timestep = adaln_form == "curve" and _is_timestep_module(stripped)
        if curve_timestep and (mod.factors or mod.diff is not None):
            timestep.append(path)
            continue
        module = alias.target if alias is not None else None if is_kohya else stripped
        for slot, leaf in (("diff", "weight"), ("diff_b", "bias")):
            key = getattr(mod, slot)
            if key is None:
                continue
            target = params.get(f"{module}.{leaf}")
            if target is None:
                (timestep if curve_timestep else unmatched).append(key)
            elif len(target.shape) != 1:
                dense.append(f"{key} ({target.name} {list(target.shape)})")
            elif tuple(shapes[key]) != target.shape:
                bad.append(f"{key}: {list(shapes[key])} (expected {list(target.shape)} for {target.name})")
            else:
                patches.append(_Patch(key, target.name))
        if not mod.factors:
            continue
        if alias is None:
            unmatched.append(path)
            continue
        if mod.down is None or mod.up is None:
            incomplete.append(path)
            continue
        t = targets[alias.target]
        a, b = tuple(shapes[mod.down]), tuple(shapes[mod.up])
        rows = t.out_features // 3 if alias.section is not None else t.out_features
        if len(a) != 2 or len(b) != 2 or a[1] != t.in_features or b[0] != rows or b[1] != a[0]:
            bad.append(f"{path}: A{list(a)} B{list(b)} (expected A[r, {t.in_features}] B[{rows}, r] for "
                       f"{alias.target})")
            continue
        if mod.alpha is not None and tuple(shapes[mod.alpha]) not in ((), (1,)):
            bad.append(f"{path}: alpha must be a scalar, got shape {list(shapes[mod.alpha])}")
            continue
        planned.append(_Planned(path, alias, mod))
    if timestep:
        raise LoRAFileError(
            f"{source}: this LoRA changes the timestep modulation ({_listed(timestep)}), but the loaded DiT is a "
            f"curve-form (\"pruned\") checkpoint whose AdaLN input is a baked low-rank table of the base time "
            f"embedder, so the LoRA cannot be applied. Use an unpruned checkpoint (bf16 or int8_convrot) for it.")
    problems = []
    if unmatched:
        problems.append(f"{len(unmatched)} module(s) match no linear or parameter of the model (expected ComfyUI "
                        f"names like 'blocks.0.attn.qkv_proj' or diffusers names like 'transformer_blocks.0.attn.to_q', "
                        f"optionally prefixed): {_listed(unmatched)}")
    if incomplete:
        problems.append(f"{len(incomplete)} module(s) lack their A (down) or B (up) factor: {_listed(incomplete)}")
    if bad:
        problems.append(f"{len(bad)} module(s) have shapes that do not fit the model: {_listed(bad)}")
    if dense:
        problems.append(f"{len(dense)} full-weight diff(s) of a linear: the DiT applies LoRAs unmerged (its linears "
                        f"may be int8 or fp8), so a linear takes low-rank factors only; full diffs are applied to "
                        f"norm gains and biases: {_listed(dense)}")
    if problems:
        raise LoRAFileError(f"{source} does not fit this DiT:\n  " + "\n  ".join(problems))
    if not planned and not patches:
        raise LoRAFileError(f"{source}: no LoRA factors found")
    return planned, patches


@dataclass(frozen=True)
class PeftAlpha:
    """PEFT's scaling from adapter_config.json: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. The rank
    is each module's own (so `rank_pattern` needs nothing extra); `alpha_pattern` is not supported."""

    lora_alpha: float
    rslora: bool = False

    def scale(self, rank: int) -> float:
        return self.lora_alpha / (rank ** 0.5 if self.rslora else rank)


def _peft_alpha(path: Path) -> PeftAlpha | None:
    """PEFT scaling from an adapter_config.json next to the file, if there is one."""
    cfg = path.parent / PEFT_CONFIG_NAME
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
        if data.get("alpha_pattern"):
            raise LoRAFileError(f"{cfg}: per-module alpha_pattern is not supported; bake alphas into the file")
        return PeftAlpha(float(data["lora_alpha"]), bool(data.get("use_rslora", False)))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise LoRAFileError(f"{cfg}: cannot read lora_alpha: {e}") from e


def _build(plan: tuple[list[_Planned], list[_Patch]], get, source: str, peft: PeftAlpha | None) -> LoRAWeights:
    planned, patches = plan
    out = LoRAWeights(source, patches={p.param: get(p.key).float() for p in patches})
    for p in planned:
        down, up = get(p.mod.down).float(), get(p.mod.up).float()
        if p.mod.alpha is not None:
            scale = float(get(p.mod.alpha).float().reshape(())) / down.shape[0]
        else:
            scale = 1.0 if peft is None else peft.scale(down.shape[0])
        if p.alias.swap_halves:  # diffusers fc1 rows [value; gate] -> ours [gate; value]
            value, gate = up.chunk(2, dim=0)
            up = torch.cat((gate, value), dim=0)
        out.parts.setdefault(p.alias.target, []).append(LoRAPart(down, up, scale, p.alias.section))
    return out


def parse_lora_state_dict(sd: Mapping[str, torch.Tensor], targets: Mapping[str, LoRATarget],
                          adaln_form: str = "mlp", source: str = "<state dict>",
                          peft: PeftAlpha | None = None) -> LoRAWeights:
    """A LoRA state dict (any dialect above) -> LoRAWeights in our names and layout; raises LoRAFileError."""
    return _build(_plan({k: tuple(v.shape) for k, v in sd.items()}, targets, adaln_form, source), sd.__getitem__,
                  source, peft)


def _header(path: Path) -> dict[str, HeaderEntry]:
    """The LoRA file's header (stagekit's reader); an unreadable file is a LoRAFileError naming it (the operator
    replaces it), not a checkpoint that stops the server."""
    try:
        return read_header(path).tensors
    except CheckpointError as e:
        raise LoRAFileError(f"{path}: not a readable safetensors file: {e.message}") from None


def check_lora_file(path: str | Path, targets: Mapping[str, LoRATarget], adaln_form: str = "mlp") -> int:
    """Validate a LoRA file against the model (request time): keys and shapes from its header, then every tensor
    finite (read once per file version, see `_check_finite`). Returns the count of low-rank modules and full-tensor
    patches; raises LoRAFileError."""
    path = Path(path)
    entries = _header(path)
    n = sum(map(len, _plan({k: e.shape for k, e in entries.items()}, targets, adaln_form, str(path))))
    _check_finite(file_identity(path), path)
    return n


@functools.lru_cache(maxsize=FINITE_CHECKED_FILES)
def _check_finite(ident: tuple[str, FileIdentity], path: Path) -> None:
    """Read every tensor of one LoRA file version (`file_identity`: a replaced file is read again) and refuse
    a NaN or an Inf, naming the file and the key: such a factor would turn every output of the model into NaN. A
    file that passed is remembered, so a LoRA used by every request is read once."""
    entries = _header(path)
    reader = TensorReader(entries)
    try:
        for key in entries:
            reader.whole(key)
    except CheckpointError as e:
        raise LoRAFileError(f"LoRA {e.message}") from None
    finally:
        reader.close()


def load_lora_file(path: str | Path, targets: Mapping[str, LoRATarget], adaln_form: str = "mlp") -> LoRAWeights:
    """Read and parse one LoRA safetensors file (CPU, fp32 factors)."""
    path = Path(path)
    entries = _header(path)
    plan = _plan({k: e.shape for k, e in entries.items()}, targets, adaln_form, str(path))
    return _build(plan, TensorReader(entries).whole, str(path), _peft_alpha(path))


def merge_loras(sd: Mapping[str, torch.Tensor], targets: Mapping[str, LoRATarget],
                loras: Sequence[tuple[LoRAWeights, float]]) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict with the LoRAs merged into dense weights: W + sum s * alpha/rank * up @ down, and
    each patched norm gain / bias + s * diff (fp32 math, result in the tensor's dtype). The oracle of the unmerged
    path; also usable to bake a LoRA offline."""
    out = dict(sd)
    for lw, strength in loras:
        for name in lw.parts:
            key = name + ".weight"
            out[key] = (out[key].float() + strength * lw.delta(targets[name])).to(sd[key].dtype)
        for key, delta in lw.patches.items():
            out[key] = (out[key].float() + strength * delta).to(sd[key].dtype)
    return out


# =====================================================================================================================
# Tensor-parallel slicing
# =====================================================================================================================
@dataclass
class LocalAdapter:
    """One low-rank update as this rank applies it: y[..., lo:hi] += up @ (down @ x); `scale` not yet folded."""

    down: torch.Tensor  # [r, local in]
    up: torch.Tensor  # [hi - lo, r]
    scale: float
    lo: int
    hi: int


def shard_part(part: LoRAPart, target: LoRATarget, tp_rank: int, tp_size: int) -> LocalAdapter:
    """Slice one part exactly like the base weight (H3DiT._tp_plan): column-parallel -> B rows of this rank inside
    every section; row-parallel -> A columns; replicated -> whole."""
    n, r = tp_size, tp_rank
    style = target.style
    if isinstance(style, RowParallel):
        lo, hi = column_range(target.in_features, r, n)
        return LocalAdapter(part.down[:, lo:hi].contiguous(), part.up, part.scale, 0, target.out_features)
    if isinstance(style, ColumnParallel):
        local = target.out_features // n // style.sections  # rows of one section on this rank
        if part.section is None:
            ranges = section_ranges(style, target.out_features, r, n)
            up = torch.cat([part.up[lo:hi] for lo, hi in ranges]).contiguous()
            return LocalAdapter(part.down, up, part.scale, 0, style.sections * local)
        lo, hi = section_ranges(ColumnParallel(), target.out_features // style.sections, r, n)[0]
        return LocalAdapter(part.down, part.up[lo:hi].contiguous(), part.scale, part.section * local,
                            (part.section + 1) * local)
    if part.section is not None:
        raise Internal(f"{target.name}: a sectioned LoRA part only exists for qkv_proj")
    return LocalAdapter(part.down, part.up, part.scale, 0, target.out_features)


# =====================================================================================================================
# The wrapper module
# =====================================================================================================================
@dataclass(frozen=True)
class LoRAMethod(LinearMethod):
    """The method of a LoRA-wrapped linear whose base has a method of its own (minimax_h3/kernels/layers.py, e.g. an
    fp8 linear's fused row quantisation): the base's method on the base layer, then the low-rank delta of the same
    op's plain input added (`LoRALinear.add_delta`). The base keeps its fused / quantised path; the delta sees what
    the plain method would hand the wrapper."""

    base: LinearMethod

    def apply(self, layer: "LoRALinear", x: torch.Tensor, modulation: Modulation | None = None,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        y = self.base.apply(layer.base, x, modulation, dtype)
        return layer.add_delta(y, modulated(x, modulation, dtype)) if layer.active else y

    def apply_added(self, layer: "LoRALinear", x: torch.Tensor, residual: Residual, modulation: Modulation,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        y = self.base.apply_added(layer.base, x, residual, modulation, dtype)  # makes the add: x is updated after
        return layer.add_delta(y, modulated(x, modulation, dtype)) if layer.active else y

    def apply_swiglu(self, layer: "LoRALinear", y: torch.Tensor) -> torch.Tensor:
        out = self.base.apply_swiglu(layer.base, y)
        return layer.add_delta(out, swiglu(y)) if layer.active else out

    def takes_fp8_o(self, dtype: torch.dtype) -> bool:
        return self.base.takes_fp8_o(dtype)

    def apply_fp8_o(self, layer: "LoRALinear", o, dtype: torch.dtype) -> torch.Tensor:
        y = self.base.apply_fp8_o(layer.base, o, dtype)
        return layer.add_delta(y, o_rows(o, dtype)) if layer.active else y


class LoRALinear(nn.Module):
    """y = base(x) + sum_i s_i * B_i (A_i x): any base linear (tp.Linear variants, Int8ConvRotLinear,
    Fp8RowwiseLinear, nn.Linear).

    Adapters are (down, up, strength-and-alpha scale, local output rows); they are concatenated along the rank so
    all of them cost one GEMM x A_cat^T plus one GEMM per distinct output-row range (one in the common case; three
    for a diffusers to_q/to_k/to_v LoRA on the fused qkv). Factors are kept in `dtype` (the base's compute dtype) as
    non-persistent buffers: they follow `.to()` and count in `buffers()`, but the state dict is exactly the base's
    (same keys as without the wrapper). Its `linear_method` is the base's: a plain base's input reaches `forward`;
    a base with a method of its own (fp8's fused row quantisation) keeps it, the delta added after (`LoRAMethod`).
    """

    def __init__(self, base: nn.Module, adapters: Sequence[LocalAdapter] = (), dtype: torch.dtype | None = None):
        super().__init__()
        self.base = base
        method = linear_method(base)
        self.linear_method = method if type(method) is LinearMethod else LoRAMethod(method)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.dtype = dtype or getattr(base, "compute_dtype", None) or torch.float32
        self._segments: list[tuple[int, int, int, int]] = []  # (lo, hi, c0, c1) into the output / rank dims
        self.register_buffer("lora_down", None, persistent=False)
        self.register_load_state_dict_pre_hook(self._route_to_base)
        self.set_adapters(adapters)

    # -- adapter set ------------------------------------------------------------------------------------------------
    def set_adapters(self, adapters: Sequence[LocalAdapter]) -> None:
        """Replace the active adapters (the scale of each is folded into its B here)."""
        for i in range(len(self._segments)):
            delattr(self, f"lora_up_{i}")
        self._segments = []
        if not adapters:
            self.lora_down = None
            return
        dev = self._device()
        order = sorted(adapters, key=lambda a: (a.lo, a.hi))  # same-range adapters adjacent in the rank dim
        downs, col = [], 0
        groups: list[tuple[int, int, int, list[torch.Tensor]]] = []
        for a in order:
            if a.down.shape[1] != self.in_features or a.up.shape[0] != a.hi - a.lo or a.hi > self.out_features:
                raise Internal(f"adapter shapes A{list(a.down.shape)} B{list(a.up.shape)} rows [{a.lo}, {a.hi}) do "
                               f"not fit a local linear of in {self.in_features} / out {self.out_features}")
            downs.append(a.down)
            up = a.up.float() * a.scale
            if groups and groups[-1][:2] == (a.lo, a.hi):
                groups[-1][3].append(up)
            else:
                groups.append((a.lo, a.hi, col, [up]))
            col += a.down.shape[0]
        self.lora_down = torch.cat([d.float() for d in downs]).to(device=dev, dtype=self.dtype)
        for i, (lo, hi, c0, ups) in enumerate(groups):
            up = torch.cat(ups, dim=1).to(device=dev, dtype=self.dtype)
            self.register_buffer(f"lora_up_{i}", up, persistent=False)
            self._segments.append((lo, hi, c0, c0 + up.shape[1]))

    def clear(self) -> None:
        self.set_adapters(())

    @property
    def active(self) -> bool:
        return self.lora_down is not None

    def _device(self) -> torch.device:
        for t in (*self.base.parameters(), *self.base.buffers()):
            return t.device
        return torch.device("cpu")

    # -- forward ----------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y if self.lora_down is None else self.add_delta(y, x)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [..., out] (the base's fresh output for input x [..., in], accumulated into in place) plus the active
        adapters' delta sum_i s_i * B_i (A_i x)."""
        lead = y.shape[:-1]
        y2 = y.reshape(-1, self.out_features)
        h = F.linear(x.reshape(-1, x.shape[-1]).to(self.dtype), self.lora_down)  # [rows, R], R = sum of ranks
        if h.dtype != y2.dtype:
            h = h.to(y2.dtype)
        for i, (lo, hi, c0, c1) in enumerate(self._segments):
            up = getattr(self, f"lora_up_{i}")
            out = y2 if (lo, hi) == (0, self.out_features) else y2[:, lo:hi]
            # y += h B^T as a GEMM epilogue (beta = 1): one read + one write of y, fp32 accumulation inside the GEMM,
            # no [rows, out] delta tensor. H200 bf16, 14882 rows, rank 64: +7..11 % over the base linear, vs
            # +11..20 % for `y + B(A x)` (qkv / fc1 / fc2 of the full model).
            out.addmm_(h[:, c0:c1], up.t() if up.dtype == y2.dtype else up.t().to(y2.dtype))
        return y2.view(*lead, self.out_features)

    # -- state dict = the base's (keys without ".base.") ------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.base.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    @staticmethod
    def _route_to_base(module, state_dict, prefix, *args) -> None:
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "base.")]:
            state_dict[prefix + "base." + k[len(prefix):]] = state_dict.pop(k)

    def extra_repr(self) -> str:
        rank = 0 if self.lora_down is None else self.lora_down.shape[0]
        return f"lora_rank={rank}, segments={len(self._segments)}, dtype={self.dtype}"


# =====================================================================================================================
# Per-rank manager: resolve, cache, (un)wrap
# =====================================================================================================================
@dataclass(frozen=True)
class LoRASpec:
    path: str  # resolved path of a safetensors file
    strength: float = 1.0


def file_identity(path: str | Path) -> tuple[str, FileIdentity]:
    """(real path, its `FileIdentity`): a replaced file gets a new cache entry, also one put back with the old size
    and mtime (`cp -p`, `rsync -a`)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise LoRAFileError(f"LoRA file {p} is not readable: {e}") from e
    return os.path.realpath(p), FileIdentity.of(st)


@dataclass
class _LocalFile:
    """One LoRA file as this rank applies it: its sharded low-rank adapters and its sharded patches (our parameter
    name -> fp32 delta at strength 1, on the model's device)."""

    adapters: dict[str, list[LocalAdapter]]
    patches: dict[str, torch.Tensor]


class LoRAManager:
    """Applies LoRA sets to one rank's H3DiT between requests, never changing the linears' base weights.

    `activate(specs)` is cheap when the set (files by `file_identity`, and strengths) equals the active one; a
    different set reuses the per-file cache of this rank's sharded factors (LRU, `max_files`), re-wraps the
    targeted linears and unwraps the ones no longer targeted. A file's `diff` / `diff_b` patches (norm gains and
    biases: small 1-D tensors) are added to those parameters in place, from a copy of their base values kept while
    any set patches them, so every set starts from the base. `clear()` restores the plain model.
    """

    def __init__(self, model: nn.Module, max_files: int = DEFAULT_FILE_CACHE):
        self.model = model
        self.max_files = max_files
        self.targets = model_targets(model)
        self.adaln_form = model.cfg.adaln_form
        self.tp_rank, self.tp_size = getattr(model, "tp_rank", 0), getattr(model, "tp_size", 1)
        self._files: OrderedDict[tuple, _LocalFile] = OrderedDict()
        self._base: dict[str, torch.Tensor] = {}  # base values of the parameters the active set patches
        self.active_key: tuple | None = ()  # () = the plain base model
        self.loads = 0  # files read from disk (cache misses), for tests / status

    def _param(self, name: str) -> torch.Tensor:
        module, _, leaf = name.rpartition(".")
        mod = self.model.get_submodule(module)
        return getattr(mod.base if isinstance(mod, LoRALinear) else mod, leaf)

    def _local(self, ident: tuple) -> _LocalFile:
        if ident in self._files:
            self._files.move_to_end(ident)
            return self._files[ident]
        lw = load_lora_file(ident[0], self.targets, self.adaln_form)
        self.loads += 1
        params = self.targets.params
        local = _LocalFile(
            {name: [shard_part(p, self.targets[name], self.tp_rank, self.tp_size) for p in parts]
             for name, parts in lw.parts.items()},
            {name: shard_tensor(d, params[name].style, name.rpartition(".")[2], self.tp_rank, self.tp_size)
             .to(self._param(name).device) for name, d in lw.patches.items()})
        self._files[ident] = local
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return local

    def activate(self, specs: Sequence[LoRASpec | tuple[str, float]]) -> None:
        specs = [s if isinstance(s, LoRASpec) else LoRASpec(*s) for s in specs]
        key = tuple((file_identity(s.path), float(s.strength)) for s in specs)
        if key == self.active_key:
            return
        per_target: dict[str, list[LocalAdapter]] = {}
        per_param: dict[str, torch.Tensor] = {}
        for (ident, strength) in key:
            if strength == 0.0:
                continue
            local = self._local(ident)
            for name, adapters in local.adapters.items():
                per_target.setdefault(name, []).extend(
                    LocalAdapter(a.down, a.up, a.scale * strength, a.lo, a.hi) for a in adapters)
            for name, delta in local.patches.items():
                per_param[name] = per_param.get(name, 0.0) + strength * delta
        self.active_key = None  # a failure below may leave a partial set: never match it as "active"
        self._apply(per_target)
        self._patch(per_param)
        self.active_key = key

    def clear(self) -> None:
        self.active_key = None
        self._apply({})
        self._patch({})
        self.active_key = ()

    def _apply(self, per_target: Mapping[str, Sequence[LocalAdapter]]) -> None:
        for name in self.targets:
            mod = self.model.get_submodule(name)
            adapters = per_target.get(name)
            if adapters:
                if isinstance(mod, LoRALinear):
                    mod.set_adapters(adapters)
                else:
                    self.model.swap_linear(name, LoRALinear(mod, adapters))
            elif isinstance(mod, LoRALinear):
                self.model.swap_linear(name, mod.base)  # back to the untouched base module

    @torch.no_grad()
    def _patch(self, per_param: Mapping[str, torch.Tensor]) -> None:
        """Each parameter = its base value + the set's summed delta (fp32 math, rounded once to its dtype), in place
        (the tensor a compiled or fused kernel holds stays the same); a parameter the new set leaves alone goes back
        to its base value."""
        for name in set(self._base) | set(per_param):
            p = self._param(name)
            base = self._base.setdefault(name, p.detach().clone())
            delta = per_param.get(name)
            if delta is None:
                p.copy_(base)
                del self._base[name]
            else:
                p.copy_((base.float() + delta).to(p.dtype))


# =====================================================================================================================
# Request-side path resolution (no traversal out of the LoRA directory)
# =====================================================================================================================
def resolve_lora_path(name: str, loras_dir: str | Path | None, allow_paths: bool = False) -> Path:
    """A request's LoRA reference -> an existing file. Bare file names (no directory part, not hidden) resolve under
    `loras_dir` (".safetensors" may be omitted); absolute paths only when the server allows them
    (`--allow-lora-paths`). Anything else (relative paths, "..", separators) is rejected. The request's fault:
    InvalidArgument for a name this server does not take, NotFound for a LoRA it does not have."""
    if not name or "\x00" in name:
        raise InvalidArgument("empty LoRA name")
    if os.path.isabs(name):
        if not allow_paths:
            raise InvalidArgument(f"absolute LoRA path {name!r} refused: this server only loads LoRAs by file name "
                                  f"from its loras directory (start it with --allow-lora-paths to permit paths)")
        p = Path(name)
    else:
        if "/" in name or "\\" in name or name.startswith(".") or name != os.path.basename(name):
            raise InvalidArgument(f"LoRA name {name!r} must be a bare file name inside the loras directory "
                                  f"(no directories, no '..', not hidden)")
        if not loras_dir:
            raise NotFound(f"LoRA {name!r} requested but this server has no loras directory (<models_dir>/loras)")
        p = next((q for q in (Path(loras_dir) / f for f in lora_file_names(name)) if q.is_file()),
                 Path(loras_dir) / name)
    if not p.is_file():
        where = "" if os.path.isabs(name) else f" in {loras_dir}"
        raise NotFound(f"LoRA {name!r} not found{where}")
    return p


def lora_names(loras_dir: str | Path | None) -> list[str]:
    """The bare names `resolve_lora_path` takes from `loras_dir`: its files that are not hidden, sorted (what the
    DiT's Status reports; [] without the directory)."""
    if not loras_dir:
        return []
    try:
        with os.scandir(loras_dir) as it:
            return sorted(e.name for e in it if not e.name.startswith(".") and "\\" not in e.name and e.is_file())
    except OSError:
        return []
