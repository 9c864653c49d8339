"""H3's contract has one home, `minimax_h3/contract.py`: its tensor table and geometry hold the model's numbers,
and no other product file writes a tensor name, a geometry constant (also as a `.get(key, default)`), a latent
shape, or a partition choice itself (an AST scan of the product packages).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minimax_h3 import contract as c
from stagekit.errors import FailedPrecondition, InvalidArgument

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("minimax_h3", "stagekit", "encoder_svc", "dit_svc", "decoder_svc", "render_svc", "client", "benchmarks",
           "scripts")
CONTRACT = ROOT / "minimax_h3" / "contract.py"
# Tensor names, and the prefixes the numbered / anchored ones are made from.
TENSOR_NAME = re.compile(r"^(%s)$" % "|".join(re.escape(n) for n in c.TENSORS))
TENSOR_PREFIX = re.compile(r"^(keyframe_|ref_(\d+_)?)$")
# A geometry constant: a name that says it is one, bound to the value it would copy (module constants, config-field
# defaults, keyword arguments).
GEOMETRY_NAMES = [(re.compile(p, re.IGNORECASE), values) for p, values in (
    (r"(^|_)fps$", {c.FPS}),
    (r"(^|_)(sample_rate|audio_rate)$", {c.AUDIO_SAMPLE_RATE}),
    (r"(^|_)hop(_length)?$", {c.AUDIO_HOP}),
    (r"(^|_)(latent_channels|in_channels)$", {c.VIDEO_LATENT_CHANNELS, c.AUDIO_LATENT_CHANNELS}),
    (r"(^|_)(vae_spatial|spatial_ratio)$", {c.VAE_SPATIAL}),
    (r"(^|_)(clip_length|clip_frames|frame_clip)$", {c.FRAME_CLIP}),
    (r"(^|_)(clip_tail|frame_offset|latents_per_clip)$", {c.FRAME_OFFSET, c.LATENTS_PER_CLIP}),
    (r"(^|_)(stereo|stereo_channels|audio_channels)$", {c.AUDIO_CHANNELS}),
    (r"(^|_)latents_per_second$", {c.AUDIO_LATENTS_PER_SECOND}),
)]


def _geometry_name(name: str, value) -> bool:
    return value is not None and any(p.search(name) and value in values for p, values in GEOMETRY_NAMES)


# Pixel <-> latent arithmetic on a size (`height // 16`), seconds from frames (`frames / 24`), latents from seconds
# (`* 40`), the sample rate anywhere.
SIZE_OPERAND = re.compile(r"height|width|(^|[^a-z])[hw]($|[^a-z])|latent", re.IGNORECASE)
FRAMES_OPERAND = re.compile(r"frame|seconds", re.IGNORECASE)


def product_files() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")
                  if p != CONTRACT and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _number(node: ast.AST) -> int | float | None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    return None


# Tensor factories whose positional arguments (or first tuple / list argument) are a shape.
TENSOR_FACTORIES = {"zeros", "ones", "empty", "randn", "rand", "full", "new_zeros", "new_ones", "new_empty",
                    "new_full"}
# Calls that read a key with a default: `d.get("latent_channels", 24)`, `getattr(cfg, "fps", 24)`.
DEFAULTED_READS = {"get": 0, "pop": 0, "setdefault": 0, "getattr": 1}
# A partition name is a contract value: a literal one may be neither chosen (`"ref2va" if refs else "fl2va"`),
# compared, returned, nor bound to a name that says it is a partition.
PARTITION_NAME = re.compile(r"partition", re.IGNORECASE)


def _shape(call: ast.Call) -> list[ast.AST]:
    args = call.args
    if args and isinstance(args[0], (ast.Tuple, ast.List)):
        return list(args[0].elts)
    return [] if call.keywords and any(k.arg == "size" for k in call.keywords) else list(args)


def _latent_shape(dims: list[ast.AST]) -> str:
    """'video latents' / 'audio latents' when a literal shape is one of the contract's latent shapes:
    [24, T, h, w] (or batched [B, 24, T, h, w]) and [2, 32, Ta]."""
    n = [_number(d) for d in dims]
    if (len(n) == 4 and n[0] == c.VIDEO_LATENT_CHANNELS) or (len(n) == 5 and n[1] == c.VIDEO_LATENT_CHANNELS):
        return "video latents"
    if len(n) == 3 and n[:2] == [c.AUDIO_CHANNELS, c.AUDIO_LATENT_CHANNELS]:
        return "audio latents"
    return ""


def _is_partition(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in c.PARTITIONS


def _named(node: ast.AST) -> str:
    return getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None) or ""


GEOMETRY_OPERANDS = {c.VAE_SPATIAL, c.FPS, c.AUDIO_LATENTS_PER_SECOND}


def contract_violations(source: str, name: str = "<src>") -> list[str]:
    """Where a source writes an inter-stage tensor name or an H3 geometry constant itself."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    out = []

    def hit(node: ast.AST, what: str) -> None:
        out.append(f"{name}:{node.lineno}: {what}: {ast.get_source_segment(source, node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if TENSOR_NAME.match(node.value) or TENSOR_PREFIX.match(node.value):
                hit(node, "tensor name")
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and re.match(r"^(keyframe_|ref_)$", str(head.value)):
                hit(node, "tensor name")
        elif isinstance(node, ast.Constant) and _number(node) == c.AUDIO_SAMPLE_RATE:
            hit(node, "audio sample rate")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, (ast.Name, ast.Attribute)) and _geometry_name(getattr(t, "id", None) or t.attr,
                                                                               _number(node.value)):
                    hit(node, "geometry constant")
        elif isinstance(node, ast.keyword) and node.arg and _geometry_name(node.arg, _number(node.value)):
            hit(node, "geometry constant")
        elif isinstance(node, ast.BinOp) and GEOMETRY_OPERANDS & {_number(node.left), _number(node.right)}:
            # (only such operations are read as text: get_source_segment splits the whole source on each call)
            left, right = (ast.get_source_segment(source, s) or "" for s in (node.left, node.right))
            n = _number(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mult)) and n == c.VAE_SPATIAL and SIZE_OPERAND.search(left):
                hit(node, "pixels <-> latents")
            elif isinstance(node.op, ast.Div) and n == c.FPS and FRAMES_OPERAND.search(left):
                hit(node, "frames -> seconds")
            elif isinstance(node.op, ast.Mult) and n == c.AUDIO_LATENTS_PER_SECOND and FRAMES_OPERAND.search(left):
                hit(node, "seconds -> audio latents")
            elif isinstance(node.op, (ast.FloorDiv, ast.Mult)) and _number(node.left) == c.VAE_SPATIAL \
                    and SIZE_OPERAND.search(right):
                hit(node, "pixels <-> latents")
        if isinstance(node, ast.Call):
            fname = _named(node.func)
            if fname in TENSOR_FACTORIES and (what := _latent_shape(_shape(node))):
                hit(node, f"{what} shape (minimax_h3.contract.tensor_shapes)")
            elif fname in DEFAULTED_READS and len(node.args) == DEFAULTED_READS[fname] + 2:
                key, default = node.args[DEFAULTED_READS[fname]:]
                if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                        and _geometry_name(key.value, _number(default)):
                    hit(node, "geometry constant as a default")
            for k in node.keywords:
                if k.arg and PARTITION_NAME.search(k.arg) and _is_partition(k.value):
                    hit(k.value, "partition name")
        elif isinstance(node, ast.IfExp) and (_is_partition(node.body) or _is_partition(node.orelse)):
            hit(node, "partition name")
        elif isinstance(node, ast.Compare) and any(map(_is_partition, [node.left, *node.comparators])):
            hit(node, "partition name")
        elif isinstance(node, ast.Return) and node.value is not None and _is_partition(node.value):
            hit(node, "partition name")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_partition(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(PARTITION_NAME.search(_named(t)) for t in targets):
                hit(node, "partition name")
        elif isinstance(node, ast.arguments):
            named = [*node.posonlyargs, *node.args]
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            for a, d in pairs:
                if PARTITION_NAME.search(a.arg) and _is_partition(d):
                    hit(d, "partition name")
    return out


def test_no_contract_copies_in_product_code():
    bad = [v for p in product_files() for v in contract_violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "write these through minimax_h3.contract:\n" + "\n".join(bad)


@pytest.mark.parametrize("src", [
    'x = {"video_latents": v}', 'name = f"keyframe_{anchor}"', 'n = f"ref_{i}_audio"', 'k.startswith("ref_")',
    'FPS = 24', 'AUDIO_RATE = 32_000', 'HOP_LENGTH = 800', 'latent_channels: int = 24', 'cfg(in_channels=24)',
    'lat = spec.height // 16', 'px = latent_w * 16', 'seconds = frames / 24', 'ta = round(frames / 24 * 40)',
    'STEREO = 2', 'clip_length: int = 17',
    'c = d.get("latent_channels", 24)', 'n = cfg.get("clip_length", 17)', 'r = getattr(cfg, "fps", 24)',
    'v = torch.zeros(24, 7, 16, 16)', 'v = torch.randn((1, 24, 7, 32, 32))', 'a = torch.randn(2, 32, spec.audio_latents)',
    'a = x.new_zeros([2, 32, ta])', 'p = "ref2va" if refs else "fl2va"', 'self.dit_partition = "fl2va"',
    'if part == "ref2va": pass', 'def f(partition="fl2va"): pass', 'write(cfg, path, partition="ref2va")',
    'def f():\n    return "fl2va"',
])
def test_scan_finds_each_kind_of_copy(src):
    assert contract_violations(src)


@pytest.mark.parametrize("src", [
    'def f():\n    """video_latents [24, T, H/16, W/16] at 32000 Hz"""', '# "text_states" // 16',
    'msg = "reference i is ref_<i>_image"', 'blocks = c // 16', 'n = heads * 16', 'AUDIO_BITRATE = 128_000',
    'MAX_SOURCE_FPS = 120', 'VIDEO_SAMPLE_FPS = 2', 'in_channels = 3', 'x = h.shape[0] // 2', 'rate = 48_000',
    'c = d.get("in_channels", 3)', 'n = d.get("layers_per_block", 2)', 'x = torch.zeros(24, 64)',
    'x = torch.randn(2, 32, 64, 8)', 'x = torch.zeros(3, 24, 7, 16)',
    'FILES = {"fl2va": "a.safetensors"}', 'out["fl2va"] = bench()', 'label = "fl2va"',
    'def f():\n    """Needs the ref2va file."""',
])
def test_scan_passes_what_is_not_a_copy(src):
    assert not contract_violations(src)


def _validate_calls(package: str) -> list[str]:
    """Calls of `minimax_h3.contract.validate` (imported by name, or as `contract.validate`) in a package."""
    out = []
    for p in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and n.module == "minimax_h3.contract" for a in n.names if a.name == "validate"}
        for node in ast.walk(tree):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and (isinstance(f, ast.Name) and f.id in names or isinstance(f, ast.Attribute)
                                               and f.attr == "validate" and getattr(f.value, "id", "") == "contract"):
                out.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return out


@pytest.mark.parametrize("package,calls", [("render_svc", 1), ("dit_svc", 1), ("decoder_svc", 1), ("encoder_svc", 0),
                                           ("minimax_h3/comfy", 2), ("minimax_h3", 2)])
def test_spec_validated_once_per_process(package, calls):
    """A render spec is validated where it enters a process (the render service's Submit, the DiT's Sample, the
    decoder's Decode; a ComfyUI graph's where the graph is read, minimax_h3/comfy/workflow.py, for the CLI and Submit
    alike) and taken as valid from there; the model code never validates it again."""
    assert len(_validate_calls(package)) == calls, _validate_calls(package)


def test_geometry_is_h3s():
    """docs/model.md §3: 124 frames -> 37 latent frames and 207 audio latents; 362 -> 107 and 603."""
    spec = c.RenderSpec(width=832, height=480, frames=124)
    assert (spec.latent_frames, spec.latent_size, spec.audio_latents) == (37, (30, 52), 207)
    assert (c.video_latent_frames(362), c.audio_latent_count(362)) == (107, 603)
    assert c.AUDIO_LATENTS_PER_SECOND == 40 and c.audio_samples(124) == 165333
    with pytest.raises(InvalidArgument, match="17\\*n \\+ 5"):
        c.video_latent_frames(120)


def test_tensor_table():
    spec = c.RenderSpec(width=256, height=512, frames=22)
    assert c.tensor_shapes(c.SAMPLE_OUTPUTS, spec) == {c.VIDEO_LATENTS: (24, 7, 32, 16), c.AUDIO_LATENTS: (2, 32, 37)}
    shapes = c.tensor_shapes(c.SAMPLE_INPUTS, spec, c.LatentGeometry(8, 16, 4), text_dim=64)
    assert shapes[c.TEXT_STATES] == (None, 64) and shapes[c.TEXT_TAGS] == (None,)
    assert shapes[c.keyframe_tensor("last")] == (8, 1, 32, 16)
    assert shapes[c.ref_tensor(11, "image")] == (8, 1, None, None) and shapes[c.ref_tensor(0, "audio")] == (2, 4, None)
    assert {r.dtype for r in c.TENSORS.values()} == {"float", "int"} and c.TENSORS[c.TEXT_TAGS].dtype == "int"
    assert shapes[c.guide_tensor(15, "image")] == (8, 1, 32, 16) and shapes[c.guide_tensor(0, "audio")] == (2, 4, None)
    assert shapes[c.GUIDE_FRAMES] == (None,) and c.TENSORS[c.GUIDE_FRAMES].dtype == "int"
    assert len(c.TENSORS) == 4 + 2 + 3 * c.MAX_REFERENCES + 1 + 2 * c.MAX_GUIDES + (c.MAX_PROMPTS - 1) + 2
    assert shapes[c.prompt_tensor(3)] == (None, 64) and c.prompt_tensor(0) == c.TEXT_STATES
    names = [c.keyframe_tensor("last"), c.TEXT_STATES, c.keyframe_tensor("first")]
    assert c.keyframe_anchors(names) == ("first", "last")
    assert c.has_references([c.ref_tensor(2, "video")]) and not c.has_references([c.TEXT_TAGS])


def test_guide_frames():
    assert c.resolve_guide_frame(0, 124) == 0 and c.resolve_guide_frame(-1, 124) == 123
    assert c.resolve_guide_frame(-124, 124) == 0 and c.resolve_guide_frame(123, 124) == 123
    for bad in (124, -125):
        with pytest.raises(InvalidArgument, match=f"guide frame {bad} is outside the video's 124 frames"):
            c.resolve_guide_frame(bad, 124)
    # ComfyUI's multiframe template: frame_idx = round(seconds * 24) for 1.5 / 3 / 5 s
    assert [c.seconds_to_frame(s) for s in (1.5, 3, 5)] == [36, 72, 120]


def test_partition_refusal_names_the_file():
    c.check_partition(True, {})  # not known: the DiT's own admission decides
    c.check_partition(False, {"fl2va": "/m/minimax_h3_fl2va_bf16.safetensors"})
    with pytest.raises(FailedPrecondition, match="minimax_h3_ref2va_.*transformer_ref.*fl2va \\(minimax_h3_fl2va_bf16"):
        c.check_partition(True, {"fl2va": "/m/minimax_h3_fl2va_bf16.safetensors"})
    with pytest.raises(FailedPrecondition, match="text or first/last-frame render needs the MiniMax-H3 fl2va"):
        c.check_partition(False, {"ref2va": "r.safetensors"})


def test_contract_is_torch_free():
    """The thin client imports it."""
    code = "import sys, minimax_h3.contract; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
