"""ComfyUI graphs as render requests (docs/workflows.md), against ComfyUI's own MiniMax-H3 templates from the pinned
`comfyui-workflow-templates-json` (a test extra).

1. Fidelity: every local H3 template becomes the request its widgets say (EXPECTED, each value with the widget or
   node it comes from), or is refused naming each node it cannot run and why. A refusal that comes from a table
   (a file this product does not load, a node type with a reason) is expected only while the table says so: a
   piece of the model that lands there turns its refusal into a render here.
2. Reading graphs: the editor's format without named widget values, the API format, subgraph instances' promoted
   widgets and `--set`, bypassed and muted nodes, the expression evaluator's whitelist.
3. Real renders through `client render --workflow` on the tiny model (one render service over the session's stages,
   the renders queued together so the stages batch them): every template that runs once the `--set`s its refusals
   name are given, to a valid MP4 (PNG for the image graph), its job's request checked; the cloud and ControlNet
   graphs refused by the CLI naming their nodes; an API-format graph queued with a plain `POST /prompt`, followed on
   ComfyUI's websocket and fetched through `/history` and `/view`; the same graph through `/v1/videos` and gRPC.
4. Files: `models fetch --workflow` fetches exactly the files a graph loads into ComfyUI's folders (a loopback stand-in
   for the Hub); `models check --workflow` says which graphs a models folder runs.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from PIL import Image

comfy_templates = pytest.importorskip("comfyui_workflow_templates_json")

from client.__main__ import main as cli  # noqa: E402
from h3.v1 import render_pb2  # noqa: E402
from minimax_h3.comfy import NODES, REFUSED, GraphError, interpret, read_workflow  # noqa: E402
from minimax_h3.comfy.expr import ExpressionError, evaluate  # noqa: E402
from minimax_h3.comfy import WorkflowRefused  # noqa: E402
from minimax_h3.comfy.workflow import apply_workflow, edited_graph, folder_reader, graph_problems  # noqa: E402
from minimax_h3.files import MODEL_FILES  # noqa: E402
from tests.hub_server import FakeHub, HubFile  # noqa: E402
from tests.render_svc_util import RenderService, probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(comfy_templates.__file__).parent / "templates"
FP16_VAE = "minimax_h3_video_vae_fp16.safetensors"
INT8_VAE = "minimax_h3_video_vae_int8_convrot.safetensors"
FL2VA = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
REF2VA = "minimax_h3_ref2va_pruned_int8_convrot.safetensors"
NVFP4 = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
FASTH3 = "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors"
OMNIREF = "fasth3_omniref_8step_pruned_int8_convrot.safetensors"
IMAGE_SIZE = (1024, 768)  # the size every input image has here (GetImageSize reads it)


def file_refusal(name: str) -> str | None:
    """The catalog's reason this product does not load a file (None once it does)."""
    return MODEL_FILES[name].refusal or None


def type_refusal(type_name: str) -> str | None:
    """The table's reason a node type is not run (None once a handler runs it)."""
    return REFUSED.get(type_name) if NODES[type_name].handler.__name__ == "_refused_node" else None


# The FastH3 templates' BlockSparseAttention: VSA as FastH3 is distilled for it (the OmniRef graph starts at 0 %).
VSA = dict(method="vsa", keep_percent=10.0, start_percent=0.2, end_percent=1.0, dense_blocks=(), min_tokens=12288)

# What each local template's widgets say, and the nodes refused as written (node, type, why). The values: instance
# widgets of the subgraph templates (e.g. 140.value_1 = 5 s), the ResolutionSelector table the templates' own notes
# give (0.4 MP at 16:9, multiple 32 -> 864 x 480), and the Turbo switch off (the base steps' PrimitiveInt).
EXPECTED = {
    "video_minimax_h3_t2v": dict(
        values=dict(conditioning="image_to_video", seed=757358688076805, width=864, height=480, frames=124, steps=20,
                    sampler="res_multistep", scheduler="simple", video_shift=None, audio_shift=None, loras=[],
                    first_frame=None, references=[]),
        files=dict(dit=FL2VA, text_encoder=NVFP4, video_vae=INT8_VAE, audio_vae=AUDIO_VAE),
        refused=[("140:119", "VAELoader", file_refusal(INT8_VAE))]),
    "video_minimax_h3_i2v": dict(
        values=dict(conditioning="image_to_video", seed=757358688076805, width=640, height=640, frames=124, steps=20,
                    sampler="res_multistep", first_frame="transparent_rgb_gaming_mouse.png", references=[]),
        files=dict(dit=FL2VA, text_encoder=NVFP4, video_vae=INT8_VAE, audio_vae=AUDIO_VAE),
        refused=[("105:11", "VAELoader", file_refusal(INT8_VAE))]),
    "video_minimax_h3_i2v_continuation": dict(  # the template leaves the prompt for the user to write
        values=dict(conditioning="image_to_video", prompt="", seed=757358688076805, width=640, height=640,
                    frames=124, steps=20, first_frame="transparent_rgb_gaming_mouse.png"),
        files=dict(dit=FL2VA, video_vae=INT8_VAE),
        refused=[("105:11", "VAELoader", file_refusal(INT8_VAE)), ("", "", "prompt is empty")],
        fixes={"prompt is empty": ""}),  # the render's --prompt
    "video_minimax_h3_r2v": dict(
        values=dict(conditioning="reference_to_video", seed=261662374822964, width=864, height=480, frames=124,
                    steps=20, sampler="res_multistep", ref_image_size="match",
                    references=[["image", "red_superboy_on_city_roof.png"], ["image", "mecha_dragon_lightning.png"]]),
        files=dict(dit=REF2VA, text_encoder=NVFP4, video_vae=INT8_VAE, audio_vae=AUDIO_VAE),
        refused=[("119", "VAELoader", file_refusal(INT8_VAE))]),
    "video_minimax_h3_multiframe_reference": dict(  # three MiniMaxH3AddGuide: frame_idx = round(seconds * 24)
        values=dict(conditioning="reference_to_video", seed=148096032077131, width=864, height=480, frames=124,
                    steps=20, references=[["image", "h3_frame_ref_1.png"]], ref_image_size="match",
                    guides=[[36, "h3_frame_ref_2.png", None], [72, "h3_frame_ref_3.png", None],
                            [120, "h3_frame_ref_4.png", None]]),
        files=dict(dit=REF2VA, video_vae=INT8_VAE),
        refused=[("119", "VAELoader", file_refusal(INT8_VAE))],
        # the guides' seconds for a 22-frame render: frames 6, 12 and -6 (counted from the end: 16)
        render_sets=["154.value=0.25", "160.value=0.5", "168.value=-0.25"],
        render_guides=[6, 12, -6], prompt="<Picture 1> on a rooftop, thunder"),
    "video_fastvideo_fasth3_t2v": dict(
        values=dict(conditioning="image_to_video", seed=631153434041465, width=640, height=640, frames=124, steps=8,
                    sampler="res_multistep", video_shift=10, audio_shift=3, sparse_attention=VSA),
        files=dict(dit=FASTH3, video_vae=INT8_VAE),
        refused=[("105:6", "UNETLoader", file_refusal(FASTH3)), ("105:11", "VAELoader", file_refusal(INT8_VAE))]),
    "video_fastvideo_fasth3_i2v": dict(  # the size: GetImageSize(ImageScaleToTotalPixels(1024x768, 0.4 MP, 32))
        values=dict(conditioning="image_to_video", seed=793369680225544, width=736, height=576, frames=124, steps=8,
                    video_shift=10, audio_shift=3, first_frame="red_line_barrier.png", sparse_attention=VSA),
        files=dict(dit=FASTH3, video_vae=INT8_VAE),
        refused=[("105:6", "UNETLoader", file_refusal(FASTH3)), ("105:11", "VAELoader", file_refusal(INT8_VAE))]),
    "video_fasth3_ominiref_r2v": dict(  # 1 MP at 16:9, multiple 32 -> 1376 x 768
        values=dict(conditioning="reference_to_video", seed=771204598, width=1376, height=768, frames=124, steps=8,
                    sampler="euler", video_shift=12, audio_shift=3, references=[["image", "yellow_plane_ref.png"]],
                    sparse_attention=dict(VSA, start_percent=0.0), ref_image_size="match"),
        files=dict(dit=OMNIREF, video_vae=INT8_VAE),
        refused=[("127", "UNETLoader", file_refusal(OMNIREF)), ("119", "VAELoader", file_refusal(INT8_VAE))],
        prompt="<Picture 1> banks low over the sea, engine roar"),
    "image_minimax_h3_t2i": dict(  # 0.9 MP at 16:9 with multiple 8 -> 1296 x 728: not whole 32-px DiT rows
        values=dict(output="png", conditioning="text", seed=697447143149280, width=1296, height=728, frames=1,
                    steps=30, sampler="res_multistep", scheduler="simple", loras=[]),
        files=dict(dit=FL2VA, text_encoder=NVFP4, video_vae=FP16_VAE),
        refused=[("", "", "width=1296 is not valid")], fixes={"width=1296": "79.multiple=32"}),
}
LOCAL = sorted(EXPECTED)
CLOUD = sorted(p.stem for p in TEMPLATES.glob("api_minimax_h3_*.json"))
CONTROLNET = "video_minimax_h3_fun_controlnet_union"
PROMPTS = {"text": "a rooftop chase at dusk, wind and footsteps", "image_to_video": "the mouse glows, soft synth",
           "reference_to_video": "<Picture 1> meets <Picture 2> on a rooftop, thunder"}


def prompt_of(name: str) -> str:
    """The prompt a render of template `name` is given: its own where the kind's default would not fit it."""
    return EXPECTED[name].get("prompt") or PROMPTS[EXPECTED[name]["values"]["conditioning"]]


def template(name: str) -> Path:
    return TEMPLATES / f"{name}.json"


def expected_refusals(name: str) -> list[tuple[str, str, str]]:
    return [r for r in EXPECTED[name]["refused"] if r[2] is not None]


def problems_of(name: str, sets=()) -> tuple:
    graph = edited_graph(template(name).read_bytes(), sets)
    found = interpret(graph, lambda ref: IMAGE_SIZE)
    render, problems = graph_problems(graph)
    return found, problems


def fixes(name: str) -> list[str] | None:
    """The --set values that make a template run here today: the file each refused loader names to load instead (its
    refusal ends in `(--set KEY=FILE)`), and the template's listed fixes; None while a refusal has no fix (a piece
    the product does not have yet)."""
    _, problems = problems_of(name)
    out = []
    for p in problems:
        instead = re.search(r"\(--set (\S+=\S+)\)$", p.why)
        if any(f.instead and p.why.startswith(f"{f.name}: ") for f in MODEL_FILES.values()) and instead:
            out.append(instead.group(1))
            continue
        fix = next((v for k, v in EXPECTED[name].get("fixes", {}).items() if k in str(p)), None)
        if fix is None:
            return None
        out += [fix] if fix else []
    return out


# ---- 1. fidelity ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LOCAL)
def test_each_local_template_becomes_what_its_widgets_say(name):
    found, problems = problems_of(name)
    got = found.render.summary()
    want = EXPECTED[name]
    for key, value in want["values"].items():
        assert got[key] == value, (name, key, got[key], value)
    for role, file in want["files"].items():
        assert got["files"][role] == file, (name, role)
    refused = [(p.node, p.type, p.why) for p in problems]
    expected = expected_refusals(name)
    assert len(refused) == len(expected), refused
    for node, type_name, why in expected:
        assert any(r[0] == node and r[1] == type_name and why in r[2] for r in refused), (name, node, why, refused)
    # the values as the template's own widgets write them (the file is the oracle for the table above)
    raw = json.loads(template(name).read_text())
    written = [n.get("widgets_values_named", {}) for n in raw["nodes"]]
    written += [n.get("widgets_values_named", {}) for sg in raw.get("definitions", {}).get("subgraphs", [])
                for n in sg["nodes"]]
    assert any(w.get("noise_seed") == want["values"]["seed"] for w in written), name


@pytest.mark.parametrize("name", [*CLOUD, CONTROLNET])
def test_cloud_and_controlnet_templates_are_refused_naming_their_nodes(name):
    _, problems = problems_of(name)
    named = {(p.node, p.type) for p in problems}
    raw = json.loads(template(name).read_text())
    if name == CONTROLNET:
        assert ("172", "MiniMaxH3FunControlNetApply") in named, problems
        assert any("ControlNet" in p.why for p in problems)
    else:
        cloud = {(str(n["id"]), n["type"]) for n in raw["nodes"] if n["type"].startswith("MinimaxHailuo03")}
        assert cloud and cloud <= named, (cloud, named)
        assert all("MiniMax's servers" in p.why for p in problems if p.type.startswith("MinimaxHailuo03"))


@pytest.mark.skipif(not file_refusal(INT8_VAE), reason="this product loads the int8 ConvRot video VAE")
def test_the_refusal_names_the_set_that_fixes_a_promoted_widget():
    _, problems = problems_of("video_minimax_h3_t2v")
    (p,) = problems
    assert str(p).startswith(f"VAELoader node 140:119: {INT8_VAE}: ")
    assert p.why.endswith(f"(--set 140.vae_name={FP16_VAE})")
    found, problems = problems_of("video_minimax_h3_t2v", [f"140.vae_name={FP16_VAE}", "140.value=true"])
    # the Turbo switch on: its LoRA (while this product does not run Turbo LoRAs) and its steps (the widget 140.value_2)
    assert found.render.steps.value == 8 and found.render.steps.where == "widget 140.value_2"
    lora = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
    assert [(p.node, p.type) for p in problems] == ([("140:134", "LoraLoaderModelOnly")] if file_refusal(lora) else [])


# ---- 2. reading graphs ----------------------------------------------------------------------------------------
def test_unnamed_widget_values_and_the_api_format_read_as_the_named_ones():
    for name in ("video_minimax_h3_t2v", "video_minimax_h3_r2v", "image_minimax_h3_t2i"):
        raw = json.loads(template(name).read_text())
        named = interpret(read_workflow(raw), lambda ref: IMAGE_SIZE).render.summary()
        for n in raw["nodes"] + [n for sg in raw.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"]]:
            n.pop("widgets_values_named", None)  # as the editor saves them: values in widget order
        unnamed = interpret(read_workflow(raw), lambda ref: IMAGE_SIZE).render.summary()
        api = interpret(read_workflow(read_workflow(template(name).read_text()).api()),
                        lambda ref: IMAGE_SIZE).render.summary()
        assert unnamed == named and api == named, name


def test_set_bypass_and_mute():
    g = read_workflow(template("video_minimax_h3_t2v").read_text())
    for key, value, needle in (("140:119.vae_name", "x", "written at 140.vae_name"),
                               ("140:131.width", "256", "comes from node 115"), ("115.nope", "1", "no widget 'nope'"),
                               ("999.value", "1", "no node '999'"), ("140.value_1", "x", "give a number")):
        with pytest.raises(GraphError, match=needle):
            g.set_widget(key, value)
    g.set_widget("140.value_1", "0.9")  # 0.9 s: round(21.6) = 22 frames, already 17n + 5
    g.set_widget("115.aspect_ratio", "1:1 (Square)")
    g.set_widget("115.megapixels", "0.0625")
    r = interpret(g).render
    assert (r.frames.value, r.width.value, r.height.value) == (22, 256, 256)
    assert r.frames.where.startswith("ComfyMathExpression node 140:132")

    raw = json.loads(template("video_minimax_h3_r2v").read_text())
    lora = next(n for n in raw["nodes"] if n["type"] == "LoraLoaderModelOnly")
    switch = next(n for n in raw["nodes"] if n["id"] == 146)
    switch["widgets_values_named"]["value"] = True  # the Turbo switch on ...
    lora["mode"] = 4  # ... its LoRA bypassed: the model passes through it
    r = interpret(read_workflow(raw), lambda ref: IMAGE_SIZE).render
    assert r.loras == [] and r.steps.value == 4
    lora["mode"] = 2  # muted: nothing feeds the switch's on_true
    found = interpret(read_workflow(raw), lambda ref: IMAGE_SIZE)
    assert any(p.node == "141" and "on_true is not connected" in p.why for p in found.refusals), found.refusals




def test_add_guide_nodes_become_the_requests_guides(inputs):
    """MiniMaxH3AddGuide (ComfyUI's node: image and / or audio at frame_idx, negative from the end, no strength):
    each one a request guide in chain order, its frame as computed, its file from the input folder."""
    req = render_pb2.RenderRequest(workflow_json=template("video_minimax_h3_multiframe_reference").read_text(),
                                   workflow_set=["168.value=-0.5"])
    req.params.prompt = "<Picture 1> on a rooftop, thunder"
    render = apply_workflow(req, folder_reader(inputs))
    assert [g.node for g in render.guides] == ["147", "162", "169"]
    assert [(g.frame, g.image.name, g.HasField("audio")) for g in req.guides] == [
        (36, "h3_frame_ref_2.png", False), (72, "h3_frame_ref_3.png", False), (-12, "h3_frame_ref_4.png", False)]
    assert [g.image.data for g in req.guides] == [(inputs / f"h3_frame_ref_{i}.png").read_bytes() for i in (2, 3, 4)]
    assert req.params.frames == 124 and [r.name for r in req.references] == ["h3_frame_ref_1.png"]
    # past the video's end: refused naming the node and where its frame came from, as ComfyUI's node refuses it
    req = render_pb2.RenderRequest(workflow_json=req.workflow_json)
    req.params.prompt, req.params.frames = "<Picture 1> on a rooftop, thunder", 56
    with pytest.raises(WorkflowRefused) as e:
        apply_workflow(req, folder_reader(inputs))
    assert [(r.node, r.type) for r in e.value.refusals] == [("162", "MiniMaxH3AddGuide"), ("169", "MiniMaxH3AddGuide")]
    assert "frame_idx 72 (ComfyMathExpression node 161 (round (a * 24))): guide frame 72 is outside the video's 56 " \
           "frames" in str(e.value)


def _multiframe_api() -> dict:
    return edited_graph(template("video_minimax_h3_multiframe_reference").read_text(), []).api()


@pytest.mark.parametrize("edit,needle", [
    (lambda g: g["147"]["inputs"].pop("image"), "it anchors nothing: connect an image and / or an audio"),
    (lambda g: g["147"]["inputs"].pop("vae"), "it anchors an image without its vae input"),
    (lambda g: g.update({"900": {"class_type": "LoadAudio", "inputs": {"audio": "voice.wav"}}})
     or g["147"]["inputs"].update(audio=["900", 0]) or g["147"]["inputs"].pop("audio_vae"),
     "it anchors a sound without its audio_vae input"),
    (lambda g: g.update({"900": {"class_type": "LoadVideo", "inputs": {"file": "clip.mp4"}},
                         "901": {"class_type": "GetVideoComponents", "inputs": {"video": ["900", 0]}}})
     or g["147"]["inputs"].update(image=["901", 0]), "this product anchors one image per guide, not a clip"),
    (lambda g: g["147"]["inputs"].update(latent=["999", 0]) or g.update(
        {"999": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}}}),
     "a guide anchors a frame of a video latent"),
])
def test_add_guide_inputs_this_product_cannot_honour_are_refused(edit, needle):
    g = _multiframe_api()
    edit(g)
    found = interpret(read_workflow(g), lambda ref: IMAGE_SIZE)
    assert any(p.node == "147" and needle in p.why for p in found.refusals), found.refusals


@pytest.mark.parametrize("expr,values,want", [
    ("max(5, round(a * 24)) + (5 - (max(5, round(a * 24)) % 17)) % 17", {"a": 5}, 124),
    ("max(5, round(a * 24)) + (5 - (max(5, round(a * 24)) % 17)) % 17", {"a": 2}, 56),
    ("round (a * 24)", {"a": 1.5}, 36),
    ("sum(values) if a > b else -1", {"a": 3, "b": 2}, 5),
    ("2 ** 10 // 3", {}, 341),
])
def test_math_expressions(expr, values, want):
    assert evaluate(expr, values) == want


@pytest.mark.parametrize("expr,needle", [
    ("__import__('os')", "calls '__import__'"),
    ("__import__('os').system('true')", "calls 'Attribute'"),
    ("a.__class__", "Attribute"),
    ("(lambda: 1)()", "Lambda"),
    ("9 ** 9 ** 9", "exponent"),
    ("x + 1", "not one of its values"),
    ("'text'", "constant"),
    ("1 / 0", "cannot be evaluated"),
    ("", "empty"),
])
def test_math_expressions_outside_the_whitelist_are_refused(expr, needle):
    with pytest.raises(ExpressionError, match=needle):
        evaluate(expr, {"a": 1})


# ---- 3. real renders --------------------------------------------------------------------------------------------
def png(path: Path, size=(96, 64), color=(200, 40, 40)) -> Path:
    Image.new("RGB", size, color).save(path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """ComfyUI's input folder: every file a local template loads, as a small image of IMAGE_SIZE's aspect."""
    d = tmp_path_factory.mktemp("input")
    for name in LOCAL:
        raw = json.loads(template(name).read_text())
        for n in raw["nodes"]:
            if n["type"] == "LoadImage":  # each file its own colour: a file in the wrong slot shows
                name_ = n["widgets_values_named"]["image"]
                png(d / name_, (128, 96), tuple(hashlib.sha256(name_.encode()).digest()[:3]))
    return d


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    run = tmp_path_factory.mktemp("run")
    s = RenderService(run, endpoints, ["--http-port", "0"])
    s.start()
    s.http = int((run / "render.port.http").read_text())
    yield s
    s.stop()


def test_cli_refuses_the_cloud_and_controlnet_graphs_before_anything_starts(capsys):
    for name, node in (("api_minimax_h3_t2v", "MinimaxHailuo03TextToVideoNode node 23"),
                       (CONTROLNET, "MiniMaxH3FunControlNetApply node 172")):
        assert cli(["render", "--workflow", str(template(name)), "--render", "127.0.0.1:9"]) == 2
        err = capsys.readouterr().err
        assert node in err and "cannot run here as written" in err, err


def call(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class ComfyWebsocket:
    """A minimal ComfyUI websocket client (RFC 6455 handshake, the server's unmasked text frames)."""

    def __init__(self, port: int, client_id: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws?clientId={client_id} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        self.buf = b""
        head = self._until(b"\r\n\r\n")
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        assert head.startswith(b"HTTP/1.1 101") and accept in head, head

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self.buf += self.sock.recv(65536)
        head, _, self.buf = self.buf.partition(marker)
        return head

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            assert chunk, "the websocket closed"
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def message(self) -> dict:
        b0, b1 = self._take(2)
        n = b1 & 0x7F
        n = int.from_bytes(self._take(2 if n == 126 else 8), "big") if n >= 126 else n
        assert b0 & 0x0F == 1, b0
        return json.loads(self._take(n))

    def close(self) -> None:
        self.sock.sendall(bytes([0x88, 0x80]) + os.urandom(4))
        self.sock.close()


def tiny_api_graph() -> dict:
    """The t2v template in the API format, as a script would queue it: its widgets set to a tiny render."""
    g = edited_graph(template("video_minimax_h3_t2v").read_text(), [
        f"140.vae_name={FP16_VAE}", "115.aspect_ratio=1:1 (Square)", "115.megapixels=0.0625", "140.value_1=0.9",
        "140:137.value=1", f"140.prompt={PROMPTS['text']}"])
    return g.api()


def test_templates_render_through_the_cli_and_comfyui_routes(svc, inputs, tmp_path, capsys):
    renderable = {name: f for name in LOCAL if (f := fixes(name)) is not None}
    assert {"video_minimax_h3_t2v", "video_minimax_h3_i2v", "video_minimax_h3_i2v_continuation",
            "video_minimax_h3_r2v", "video_minimax_h3_multiframe_reference", "image_minimax_h3_t2i",
            "video_fastvideo_fasth3_t2v", "video_fastvideo_fasth3_i2v",
            "video_fasth3_ominiref_r2v"} <= set(renderable)
    tiny = ["--width", "256", "--height", "256", "--steps", "1"]
    ws = ComfyWebsocket(svc.http, "tester")
    first = ws.message()
    assert first["type"] == "status" and first["data"]["sid"] == "tester", first
    jobs = {}
    for name, sets in renderable.items():  # queued together: the stages batch them
        sets = [*sets, *EXPECTED[name].get("render_sets", [])]
        image = EXPECTED[name]["values"].get("output") == "png"  # one frame: the graph's own
        args = ["render", "--workflow", str(template(name)), "--input-dir", str(inputs), "--render", svc.target,
                "--detach", "--prompt", prompt_of(name), *tiny, *([] if image else ["--frames", "22"]),
                *(x for s in sets for x in ("--set", s))]
        assert cli(args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        jobs[name] = out.split()[1]
        if "render_guides" in EXPECTED[name]:  # the request it became: the guides at the frames the graph computes
            assert cli(args + ["--explain"]) == 0, capsys.readouterr().err
            explained = json.loads(capsys.readouterr().out)
            want = [[f, g[1], g[2]]
                    for f, g in zip(EXPECTED[name]["render_guides"], EXPECTED[name]["values"]["guides"])]
            assert explained["guides"] == want and explained["graph"]["guides"] == want, explained

    # README's lines, as printed (against this test's service): the templates folder, the request, the render
    folder, *lines = readme_workflow_lines()
    shown = subprocess.run(["bash", "-c", f'{folder}; echo "$T"'], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert Path(shown.stdout.strip()) == TEMPLATES, shown
    explain, readme_render = (with_templates(shlex.split(c, comments=True)) + ["--render", svc.target] for c in lines)
    r = subprocess.run(explain, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and json.loads(r.stdout)["graph"]["files"]["video_vae"] == \
        "minimax_h3_video_vae_int8_convrot.safetensors", r.stdout + r.stderr
    readme = subprocess.Popen(readme_render, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    status, body = call(svc.http, "POST", "/prompt", json.dumps({"prompt": tiny_api_graph(),
                                                                 "client_id": "tester"}).encode())
    assert status == 200, body
    answer = json.loads(body)
    prompt_id = answer["prompt_id"]
    assert answer["node_errors"] == {} and isinstance(answer["number"], int)

    # the websocket follows the prompt: start, progress, the output, success, then "executing" with no node
    seen = []
    while not (seen and seen[-1]["type"] == "executing" and seen[-1]["data"]["node"] is None):
        m = ws.message()
        if m["data"].get("prompt_id") in (prompt_id, None):
            seen.append(m)
    kinds = [m["type"] for m in seen]
    assert kinds.index("execution_start") < kinds.index("executed") < kinds.index("execution_success"), kinds
    assert any(m["type"] == "progress" and m["data"]["max"] == 1 for m in seen), kinds
    ws.close()

    # /history lists the output the way ComfyUI does; /view serves it
    status, body = call(svc.http, "GET", f"/history/{prompt_id}")
    entry = json.loads(body)[prompt_id]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"]
    (node, out), = entry["outputs"].items()
    assert node == "92" and out["animated"] == [True]
    (image,) = out["images"]
    assert image == {"filename": f"MiniMax_H3_{prompt_id}.mp4", "subfolder": "video", "type": "output"}
    status, mp4 = call(svc.http, "GET", f"/view?filename={image['filename']}&subfolder=video&type=output")
    assert status == 200
    (tmp_path / "prompt.mp4").write_bytes(mp4)
    assert probe(tmp_path / "prompt.mp4") == {"width": 256, "height": 256, "frames": 22, "audio": 1}
    status, body = call(svc.http, "GET", "/queue")
    assert status == 200 and set(json.loads(body)) == {"queue_running", "queue_pending"}

    # each CLI render: its MP4 (PNG for the image graph) and the request it became
    for name, job in jobs.items():
        values = EXPECTED[name]["values"]
        out = tmp_path / (f"{name}.png" if values.get("output") == "png" else f"{name}.mp4")
        assert cli(["jobs", "fetch", job, "--wait", "-o", str(out), "--render", svc.target]) == 0, \
            capsys.readouterr().err
        info = svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=30)
        p = info.params
        assert (p.width, p.height, p.frames, p.steps) == (256, 256, 1 if out.suffix == ".png" else 22, 1), name
        assert p.seed == values["seed"] and p.sampler == values.get("sampler", p.sampler), name
        assert p.video_shift == (values.get("video_shift") or 0) and p.prompt == prompt_of(name)
        assert p.ref_image_size == values.get("ref_image_size", ""), name  # the graph's sizing reaches the stages
        sparse = values.get("sparse_attention")
        assert p.HasField("sparse_attention") == bool(sparse), name
        if sparse:  # the graph's BlockSparseAttention reaches the DiT (its 12288 min_tokens: dense at this size)
            assert (p.sparse_attention.keep_percent, p.sparse_attention.start_percent) == \
                (sparse["keep_percent"], sparse["start_percent"])
            assert next(s for s in info.stages if s.stage == "dit").sparse_steps == 0
        assert [r.name for r in info.references] == [r[1] for r in values.get("references", [])], name
        if out.suffix == ".png":
            with Image.open(out) as im:
                assert im.format == "PNG" and im.size == (256, 256)
            assert not list(tmp_path.glob(f".{out.name}*"))
        else:
            assert probe(out) == {"width": 256, "height": 256, "frames": 22, "audio": 1}, name
    out, err = readme.communicate(timeout=300)
    assert readme.returncode == 0, err
    assert probe(tmp_path / "t2v.mp4") == {"width": 512, "height": 288, "frames": 22, "audio": 1}
    capsys.readouterr()


def test_frames_1_renders_one_frame_as_a_png(svc, tmp_path, capsys):
    """`render --frames 1` (what the image graph becomes too): one latent frame and no sound, saved as a PNG; an .mp4
    name refused before anything starts."""
    args = ["render", "--prompt", PROMPTS["text"], "--frames", "1", "--width", "256", "--height", "256", "--steps",
            "2", "--render", svc.target]
    assert cli(args + ["-o", str(tmp_path / "fox.mp4")]) == 2
    assert "--frames 1 renders an image: name a .png" in capsys.readouterr().err
    assert cli(args + ["-o", str(tmp_path / "fox.png")]) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    with Image.open(tmp_path / "fox.png") as im:
        assert im.format == "PNG" and im.size == (256, 256)
    assert not list(tmp_path.glob(".fox.png*"))
    job = re.search(r"job ([0-9a-f]{16})", said.out + said.err).group(1)
    info = svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=30)
    assert info.params.frames == 1 and {s.stage for s in info.stages} >= {"encoder", "dit", "decoder"}
    assert cli(["jobs", "fetch", job, "-o", str(tmp_path / "fox.mp4"), "--render", svc.target]) == 0
    assert probe(tmp_path / "fox.mp4") == {"width": 256, "height": 256, "frames": 1, "audio": 0}
    # an image conditioned on a keyframe over gRPC (the CLI refuses it before anything starts): refused at Submit
    req = render_pb2.RenderRequest(first_frame=png(tmp_path / "k.png", (256, 256)).read_bytes())
    req.params.prompt, req.params.frames, req.params.width, req.params.height = PROMPTS["text"], 1, 256, 256
    req.params.steps = 1
    with pytest.raises(grpc.RpcError) as refused:
        svc.stub.Submit(req, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "renders from the prompt alone" in refused.value.details()
    assert cli(args + ["--first-frame", str(tmp_path / "k.png"), "-o", str(tmp_path / "k2.png")]) == 2
    assert "--frames 1 renders an image from the prompt alone" in capsys.readouterr().err


def readme_workflow_lines() -> list[str]:
    """README's ComfyUI block, as printed: the line that finds the templates folder, then the two that read a graph."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if b.startswith("T=$("))
    lines = block.strip().splitlines()
    assert len(lines) == 3 and all("--workflow" in c for c in lines[1:]), lines
    return lines


def with_templates(argv: list[str]) -> list[str]:
    """A README command with `$T` read as the templates folder and `.venv/bin/python` as this interpreter."""
    out = [a.replace("$T/", f"{TEMPLATES}/") for a in argv]
    return [sys.executable if a == ".venv/bin/python" else a for a in out]


def test_graphs_through_grpc_and_v1_videos_are_refused_naming_the_node(svc, inputs):
    graph = read_workflow(template("api_minimax_h3_t2v").read_text()).api()
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(render_pb2.RenderRequest(workflow_json=json.dumps(graph)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "MinimaxHailuo03TextToVideoNode node 23" in e.value.details()
    status, body = call(svc.http, "POST", "/v1/videos", json.dumps({"workflow": graph}).encode(),
                        {"Content-Type": "application/json"})
    assert status == 400 and "MinimaxHailuo03TextToVideoNode node 23" in json.loads(body)["error"]["message"]
    status, body = call(svc.http, "POST", "/prompt", json.dumps({"prompt": graph}).encode())
    answer = json.loads(body)
    assert status == 400 and answer["node_errors"]["23"]["class_type"] == "MinimaxHailuo03TextToVideoNode"
    assert "MiniMax's servers" in answer["node_errors"]["23"]["errors"][0]["message"]
    # a graph with a LoadImage needs its file: uploaded first (/upload/image), else named as missing
    i2v = edited_graph(template("video_minimax_h3_i2v").read_text(), [
        f"105.vae_name={FP16_VAE}", "115.megapixels=0.0625", "105.value_1=0.9", "105:124.value=1",
        f"105.prompt={PROMPTS['image_to_video']}"]).api()
    status, body = call(svc.http, "POST", "/prompt", json.dumps({"prompt": i2v}).encode())
    assert status == 400 and "transparent_rgb_gaming_mouse.png" in body.decode() and "/upload/image" in body.decode()
    image = (inputs / "transparent_rgb_gaming_mouse.png").read_bytes()
    form = (b'--b0undary\r\nContent-Disposition: form-data; name="image"; filename="transparent_rgb_gaming_mouse.png"'
            b"\r\nContent-Type: image/png\r\n\r\n" + image + b"\r\n--b0undary--\r\n")
    status, body = call(svc.http, "POST", "/upload/image", form,
                        {"Content-Type": "multipart/form-data; boundary=b0undary"})
    assert status == 200 and json.loads(body) == {"name": "transparent_rgb_gaming_mouse.png", "subfolder": "",
                                                  "type": "input"}
    assert call(svc.http, "GET", "/view?filename=transparent_rgb_gaming_mouse.png&type=input") == (200, image)
    status, body = call(svc.http, "POST", "/prompt", json.dumps({"prompt": i2v}).encode())
    assert status == 200, body
    info = svc.stub.Cancel(render_pb2.JobRef(job_id=json.loads(body)["prompt_id"]), timeout=60)
    assert (info.params.width, info.params.frames, info.params.seed) == (256, 22, 757358688076805)


def test_a_workflow_request_over_grpc_is_read_by_the_service(svc, inputs):
    """The service fills the request from the graph itself (a gRPC caller sends only the graph and its file)."""
    req = render_pb2.RenderRequest(workflow_json=template("video_minimax_h3_i2v").read_text(),
                                   workflow_set=[f"105.vae_name={FP16_VAE}", "115.megapixels=0.0625"],
                                   first_frame=(inputs / "transparent_rgb_gaming_mouse.png").read_bytes())
    req.params.prompt = PROMPTS["image_to_video"]
    req.params.steps = 1
    req.params.frames = 22
    filled = render_pb2.RenderRequest()
    filled.CopyFrom(req)
    apply_workflow(filled)
    assert (filled.params.width, filled.params.height, filled.params.seed) == (256, 256, 757358688076805)
    info = svc.stub.Submit(req, timeout=60)
    assert (info.params.width, info.params.seed, info.params.steps) == (256, 757358688076805, 1)
    svc.stub.Cancel(render_pb2.JobRef(job_id=info.job_id), timeout=60)
    # /v1/videos: the graph as a JSON object, its --sets as workflow_set, the fields beside it over its values
    body = {"workflow": json.loads(template("video_minimax_h3_t2v").read_text()), "prompt": PROMPTS["text"],
            "workflow_set": [f"140.vae_name={FP16_VAE}"], "size": "256x256", "frames": 22, "steps": 1}
    status, answer = call(svc.http, "POST", "/v1/videos", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    video = json.loads(answer)
    assert status == 200 and (video["size"], video["frames"], video["seed"]) == ("256x256", 22, 757358688076805), video
    call(svc.http, "POST", f"/v1/videos/{video['id']}/cancel", b"{}", {"Content-Type": "application/json"})


def test_the_service_runs_a_graph_only_on_the_files_it_names():
    """Submit's file check (render_svc.admission.check_graph_files) against the stages' Status: each file the graph
    loads must be the one its stage serves; the embedded tiny model stands for every file."""
    from h3.v1 import common_pb2
    from render_svc.admission import check_graph_files
    from stagekit.errors import FailedPrecondition

    render = interpret(edited_graph(template("video_minimax_h3_t2v").read_text(), [f"140.vae_name={FP16_VAE}"]),
                       lambda ref: IMAGE_SIZE).result()
    serving = {"dit": [common_pb2.StageStatus(partitions={"fl2va": f"/m/diffusion_models/{FL2VA}"})],
               "encoder": [common_pb2.StageStatus(weights=f"/m/text_encoders/{NVFP4}")],
               "decoder": [common_pb2.StageStatus(weights=f"/m/vae/{FP16_VAE} + /m/vae/{AUDIO_VAE}")]}
    check_graph_files(render.files, serving, "fl2va")
    int8 = "qwen3vl_32b_minimax_h3_int8_convrot.safetensors"
    serving["encoder"] = [common_pb2.StageStatus(weights=f"/m/text_encoders/{int8}")]
    with pytest.raises(FailedPrecondition, match=f"CLIPLoader node 140:128 loads {NVFP4}, but the encoder stage "
                                                  "serves qwen3vl_32b_minimax_h3_int8_convrot.safetensors: --set "
                                                  "140.clip_name=qwen3vl_32b_minimax_h3_int8_convrot.safetensors or"):
        check_graph_files(render.files, serving, "fl2va")
    serving["encoder"][0].embedded_model = True
    check_graph_files(render.files, serving, "fl2va")
    with pytest.raises(FailedPrecondition, match="the dit stage serves no such file"):
        check_graph_files(render.files, serving, "ref2va")


def test_the_cli_stays_thin_with_a_graph(inputs):
    """A graph read by the CLI (here --explain of the reference template) imports neither torch nor numpy."""
    code = ("import sys\nfrom client.__main__ import main\n"
            f"rc = main(['render', '--workflow', {str(template('video_minimax_h3_r2v'))!r}, '--input-dir', "
            f"{str(inputs)!r}, '--set', '119.vae_name={FP16_VAE}', '--prompt', "
            f"{PROMPTS['reference_to_video']!r}, '--explain'])\n"
            "print('RESULT', rc, 'torch' in sys.modules, 'numpy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "RESULT 0 False False" in r.stdout, r.stdout[-2000:] + r.stderr
    explained = json.loads(r.stdout.rsplit("RESULT", 1)[0])
    assert explained["references"] == [["image", "red_superboy_on_city_roof.png"],
                                       ["image", "mecha_dragon_lightning.png"]]
    assert explained["graph"]["files"]["dit"] == REF2VA and explained["params"]["seed"] == 261662374822964
    assert explained["params"]["ref_image_size"] == explained["graph"]["ref_image_size"] == "match"


def test_a_graphs_prompt_is_taken_as_written_its_label_problems_are_notes(svc, inputs, capsys):
    """The reference template's own prompt names <Audio 1>, which it leaves unconnected: ComfyUI passes the text
    as is, so the graph runs (its CLI notes say so) while such a prompt on a plain request is refused."""
    from minimax_h3.labels import GRAPH_LABELS_NOTE

    sets = [f"119.vae_name={FP16_VAE}"]
    args = ["render", "--workflow", str(template("video_minimax_h3_r2v")), "--input-dir", str(inputs),
            *(x for s in sets for x in ("--set", s))]
    assert cli([*args, "--explain"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    explained = json.loads(out)
    prompt = explained["params"]["prompt"]
    assert "<Audio 1>" in prompt and "<Picture 2>" in prompt
    assert "note: the prompt names <Audio 1>, but the references are: <Picture 1> = red_superboy_on_city_roof.png, " \
           "<Picture 2> = mecha_dragon_lightning.png" in err, err
    assert f"note: {GRAPH_LABELS_NOTE}" in err and GRAPH_LABELS_NOTE in explained["graph"]["notes"]
    req = render_pb2.RenderRequest(workflow_json=template("video_minimax_h3_r2v").read_text(), workflow_set=sets)
    for name in ("red_superboy_on_city_roof.png", "mecha_dragon_lightning.png"):
        req.references.add(kind="image", data=(inputs / name).read_bytes(), name=name)
    req.params.width, req.params.height, req.params.frames, req.params.steps = 256, 256, 22, 1
    req.params.prompt = "use <Picture 2> and <Picture 1> as reference frames and <Audio 1> exactly as it is"
    info = svc.stub.Submit(req, timeout=60)  # (the tiny model's byte tokenizer counts the template's own as too long)
    assert info.params.prompt == req.params.prompt
    svc.stub.Cancel(render_pb2.JobRef(job_id=info.job_id), timeout=60)
    plain = render_pb2.RenderRequest(references=req.references)
    plain.params.CopyFrom(info.params)
    with pytest.raises(grpc.RpcError) as refused:
        svc.stub.Submit(plain, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "<Audio 1>" in refused.value.details()


# ---- 4. files ---------------------------------------------------------------------------------------------------
def test_models_fetch_workflow_fetches_exactly_what_the_graph_loads(tmp_path):
    graph = template("video_minimax_h3_r2v")
    files = {f"{f.repo}/{f.repo_path}": HubFile(f.name.encode()) for f in MODEL_FILES.values()}
    files["MiniMax-AI/MiniMax-H3/tokenizer/tokenizer.json"] = HubFile(b"{}")
    to = tmp_path / "models"
    with FakeHub(files) as hub:
        r = subprocess.run([sys.executable, "-m", "client", "models", "fetch", "--workflow", str(graph), "--to",
                            str(to)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"})
    assert r.returncode == 0, r.stderr
    got = sorted(str(p.relative_to(to)) for p in to.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert got == sorted([f"diffusion_models/{REF2VA}", f"text_encoders/{NVFP4}", "text_encoders/tokenizer.json",
                          f"vae/{INT8_VAE}", f"vae/{AUDIO_VAE}"])  # the Turbo LoRA is on the branch not taken
    if file_refusal(INT8_VAE):
        assert f"note: {INT8_VAE}: {file_refusal(INT8_VAE)}" in r.stderr


def test_models_check_says_which_graphs_a_folder_runs(tmp_path, capsys):
    from tests.test_models_cli import write_tiny_models_folder

    d = write_tiny_models_folder(tmp_path / "models")  # tiny DiT, VAEs and a bf16 text encoder under release names
    mine = json.loads(template("video_minimax_h3_t2v").read_text())
    (instance,) = [n for n in mine["nodes"] if n["id"] == 140]
    instance["widgets_values_named"].update(unet_name="minimax_h3_fl2va_bf16.safetensors", vae_name=FP16_VAE,
                                            clip_name="qwen3vl_32b_minimax_h3_bf16.safetensors")
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    assert cli(["models", "check", str(d), "--workflow", str(tmp_path / "mine.json"), "--workflow",
                str(template("video_minimax_h3_t2v"))]) == 1
    out = capsys.readouterr().out
    assert "graph mine.json: runs over this folder" in out, out
    mine_t2v = out.split("graph video_minimax_h3_t2v.json: cannot run here:")[1]
    assert f"UNETLoader node 140:127 loads {FL2VA}, but the dit stage would serve minimax_h3_fl2va_bf16" in mine_t2v
    assert f"CLIPLoader node 140:128 loads {NVFP4}, but the encoder stage would serve" in mine_t2v
    if file_refusal(INT8_VAE):
        assert "VAELoader node 140:119" in mine_t2v


# ---- 5. VSA: the FastH3 graphs' BlockSparseAttention ------------------------------------------------------------
@pytest.mark.parametrize("sets,needle", [
    (["105:127.selection=sol-attn"], "method 'sol-attn': this product runs 'vsa'"),
    (["105:127.sink_conditioning=exact_kv"], "sink_conditioning 'exact_kv'"),
    (["105:127.selection.keep_percent=100"], "keep_percent=100.0 is not valid"),
])
def test_block_sparse_attention_settings_this_product_does_not_run_are_refused(sets, needle):
    _, problems = problems_of("video_fastvideo_fasth3_t2v", sets)
    assert any(p.node == "105:127" and needle in p.why for p in problems), problems


def test_block_sparse_attention_reads_dense_blocks_and_the_shift_before_it():
    found, _ = problems_of("video_fastvideo_fasth3_t2v", ["105:127.dense_blocks=0, 2-3; 47", "105:127.min_tokens=0"])
    assert found.render.sparse.dense_blocks == (0, 2, 3, 47) and found.render.sparse.min_tokens == 0
    raw = json.loads(template("video_fastvideo_fasth3_t2v").read_text())
    graph = read_workflow(raw).api()  # the shift after the sparse attention: ComfyUI's window used the one before
    shift, sparse = (next(k for k, n in graph.items() if n["class_type"] == t)
                     for t in ("MiniMaxH3SigmaShift", "BlockSparseAttention"))
    backend = graph[sparse]["inputs"]["model"]
    graph[shift]["inputs"]["model"], graph[sparse]["inputs"]["model"] = [sparse, 0], graph[shift]["inputs"]["model"]
    for n in graph.values():
        if n["class_type"] in ("BasicScheduler", "BasicGuider"):
            n["inputs"]["model"] = [shift, 0]
    assert backend  # (the attention backend node now feeds nothing the render needs)
    found = interpret(read_workflow(graph), lambda ref: IMAGE_SIZE)
    assert any(p.node == shift and "after BlockSparseAttention" in p.why for p in found.refusals), found.refusals


@pytest.fixture(scope="module")
def fasth3(stack, model_cache, tmp_path_factory):
    """A DiT stage serving a tiny FastH3 checkpoint (a VSA gate in every block) under the FastH3 file's name, beside
    the session's encoder and decoder, and a render service over the three."""
    from client.embedded import EmbeddedStack, StackConfig
    from minimax_h3.services import Endpoints
    from dit_svc.engine import embedded_config
    from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
    from tests.conftest import SERVER_ENV

    _, endpoints = stack
    run = tmp_path_factory.mktemp("fasth3")
    weights = write_tiny_checkpoint(embedded_config().replace(vsa_gates=True), run / FASTH3, "bf16", seed=7)
    dit = EmbeddedStack(StackConfig(cache_dir=str(model_cache), run_dir=str(run / "dit"), devices="virt1",
                                    env=SERVER_ENV, extra_args={"dit": ["--weights", str(weights)]}))
    dit.start_stage("dit")
    try:
        stages = Endpoints(encoder=endpoints.encoder, dit=f"127.0.0.1:{dit.wait_ready('dit')}",
                           decoder=endpoints.decoder)
        s = RenderService(run / "render", stages)
        s.start()
        yield s, stages
        s.stop()
    finally:
        dit.stop()


def test_a_fasth3_template_renders_with_vsa_on_a_fasth3_dit(fasth3, inputs, tmp_path, capsys):
    from minimax_h3.services import StageClients
    from h3.v1 import common_pb2

    svc, stages = fasth3
    with StageClients(stages) as c:
        st = c.dit.Status(common_pb2.StatusRequest(), timeout=30)
    assert st.weights.endswith(FASTH3) and st.variant.endswith("_vsa-dense"), st
    assert [(k.kernel, "CUDA" in k.reason) for k in st.kernels if k.op == "vsa"] == [("reference", True)]
    # min_tokens 0: this tiny sequence runs VSA (3 steps at shift 10: the first, sigma 1, is before 20 % of the run)
    args = ["render", "--workflow", str(template("video_fastvideo_fasth3_t2v")), "--input-dir", str(inputs),
            "--render", svc.target, "--detach", "--prompt", prompt_of("video_fastvideo_fasth3_t2v"), "--width", "256",
            "--height", "256", "--frames", "22", "--steps", "3", "--set", f"105.vae_name={FP16_VAE}",
            "--set", "105:127.min_tokens=0"]
    assert cli(args) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    assert "BlockSparseAttention node 105:127 runs VSA from 20% to 100% of the schedule" in said.err, said.err
    job = said.out.split()[1]
    assert cli(["jobs", "fetch", job, "--wait", "-o", str(tmp_path / "fasth3.mp4"), "--render", svc.target]) == 0, \
        capsys.readouterr().err
    assert probe(tmp_path / "fasth3.mp4") == {"width": 256, "height": 256, "frames": 22, "audio": 1}
    info = svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=30)
    assert info.params.sparse_attention.min_tokens == 0 and info.params.video_shift == 10
    assert next(s for s in info.stages if s.stage == "dit").sparse_steps == 2
    assert cli(["jobs", "get", job, "--render", svc.target]) == 0
    assert "0 of 3 steps cached, 2 sparse (VSA)" in capsys.readouterr().out
