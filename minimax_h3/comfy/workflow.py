"""A ComfyUI graph as a RenderRequest (docs/workflows.md): the graph's values, what is set beside it over them, and the
files its loader nodes read in the request's own file fields.

One function, `apply_workflow`, for every caller: the CLI fills a request here before anything starts (the files
from the graph's input folder, its flags over the graph); the render service reads a request's graph here again at
Submit, for gRPC, `/v1/videos` and ComfyUI's `POST /prompt` alike, so a graph means the same wherever it comes in.
Torch- and numpy-free (the thin client imports it).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from pathlib import Path

from h3.v1 import common_pb2, render_pb2
from minimax_h3.comfy import (Graph, MediaRef, Refusal, Val, WorkflowRefused, WorkflowRender, attribute, interpret,
                              read_workflow)
from minimax_h3.contract import (IMAGE_CRF, IMAGE_FRAMES, PNG, resolve_guide_frame, sparse_to_proto, spec_from_proto,
                                 validate)
from stagekit.errors import InvalidArgument

# How the request's own fields override the graph: (params field, how it counts as set).
_OVERRIDES = (("prompt", lambda p: bool(p.prompt)), ("width", lambda p: p.HasField("width")),
              ("height", lambda p: p.HasField("height")), ("frames", lambda p: p.HasField("frames")),
              ("steps", lambda p: p.HasField("steps")), ("seed", lambda p: p.HasField("seed")),
              ("sampler", lambda p: bool(p.sampler)), ("scheduler", lambda p: bool(p.scheduler)),
              ("video_shift", lambda p: p.video_shift != 0), ("audio_shift", lambda p: p.audio_shift != 0),
              ("ref_image_size", lambda p: bool(p.ref_image_size)))
PLACEHOLDER_SIZE = (1024, 1024)  # a loaded image's size before its file is bound (only which node feeds which slot
# is read from that first pass)

ReadInput = Callable[[MediaRef], bytes]


def image_size(data: bytes, what: str) -> tuple[int, int]:
    """(width, height) from an image file's header; InvalidArgument when it is none."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidArgument(f"{what} is not an image PIL reads (PNG / JPEG)") from None


def input_name(value: str) -> str:
    """A loader node's file name as ComfyUI writes it, without the `[input]` the editor may add."""
    return re.sub(r"\s*\[input\]$", "", value)


def folder_reader(folder: Path) -> ReadInput:
    """A loader node's file from ComfyUI's input folder `folder` (the name as the node gives it, subfolders too,
    never outside it)."""
    root = folder.resolve()

    def read(ref: MediaRef) -> bytes:
        path = (root / input_name(ref.name.value)).resolve()
        if root not in path.parents:
            raise InvalidArgument(f"{ref.name.value!r} (node {ref.node}) is not a file name inside the input folder")
        try:
            return path.read_bytes()
        except OSError as e:
            raise InvalidArgument(f"{ref.name.value} (loaded by node {ref.node}) is not in {root}: "
                                  f"{e.strerror or e}") from None
    return read


def edited_graph(text: str | bytes, sets=()) -> Graph:
    """A graph read, its widgets changed by `sets` ("NODE.WIDGET=VALUE" each, in order)."""
    graph = read_workflow(text)
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq:
            raise InvalidArgument(f"--set {item!r}: write NODE.WIDGET=VALUE")
        graph.set_widget(key.strip(), value)
    return graph


def graph_problems(graph: Graph) -> tuple[WorkflowRender | None, list[Refusal]]:
    """What a graph renders and everything that keeps it from running here, files aside: the nodes refused, and a
    render spec out of the model's rules (attributed to where its value came from)."""
    found = interpret(graph, lambda ref: PLACEHOLDER_SIZE)
    problems = list(found.refusals)
    if found.render is not None:
        try:
            spec = validate(found.render.spec(), need_prompt=True)
        except InvalidArgument as e:
            problems.append(Refusal("", "", attribute(e.message, found.render, set())))
        else:
            problems += guide_problems(found.render, spec.frames)
    return found.render, problems


def guide_problems(render: WorkflowRender, frames: int) -> list[Refusal]:
    """The graph's guides whose frame_idx falls outside a video of `frames` frames (ComfyUI's MiniMaxH3AddGuide
    refuses them too), each naming where its frame came from and the `--set` that changes it."""
    out = []
    for g in render.guides:
        try:
            resolve_guide_frame(g.frame.value, frames)
        except InvalidArgument as e:
            out.append(Refusal(g.node, "MiniMaxH3AddGuide", f"frame_idx {g.frame.value} ({g.frame.where}): "
                                                            f"{e.message}{g.frame.hint()}"))
    return out


def apply_workflow(req: render_pb2.RenderRequest, read_input: ReadInput | None = None) -> WorkflowRender:
    """Fill `req` from its `workflow_json`: its `workflow_set` edits applied, the graph read, the request's own fields
    over the graph's values, the files the graph's loader nodes read put in first_frame / last_frame / references /
    guides (the request's own files first, else `read_input`'s). Returns what the graph became (its files and notes);
    InvalidArgument (WorkflowRefused) naming every node that cannot run here, or the value that is wrong and where it
    came from."""
    graph = edited_graph(req.workflow_json, req.workflow_set)
    first = interpret(graph, lambda ref: _probe(ref, read_input))
    render = first.result()
    files = _slot_files(req, render, read_input)
    by_node = {ref.node: data for ref, data in files.values()}

    def size_of(ref: MediaRef) -> tuple[int, int]:
        data = by_node.get(ref.node)
        if data is None:
            data = _read(ref, read_input)
        return image_size(data, f"{ref.name.value} (node {ref.node})")

    render = interpret(graph, size_of).result()
    _fill(req, render, files)
    return render


def _probe(ref: MediaRef, read_input: ReadInput | None) -> tuple[int, int]:
    try:
        return image_size(read_input(ref), ref.name.value) if read_input else PLACEHOLDER_SIZE
    except InvalidArgument:
        return PLACEHOLDER_SIZE


def _read(ref: MediaRef, read_input: ReadInput | None) -> bytes:
    if read_input is None:
        raise InvalidArgument(f"{ref.name.value} (loaded by node {ref.node}) did not come with the request")
    return read_input(ref)


def _slot_files(req: render_pb2.RenderRequest, render: WorkflowRender,
                read_input: ReadInput | None) -> dict[str, tuple[MediaRef, bytes]]:
    """slot -> (the graph's loader node, the bytes): first_frame, last_frame, reference i. The request's own files
    fill a slot (an override, or what the client read for the graph); the graph's named files the rest."""
    out: dict[str, tuple[MediaRef, bytes]] = {}
    kind = render.conditioning
    for slot in ("first_frame", "last_frame"):
        ref, data = getattr(render, slot), getattr(req, slot)
        if data and kind != "image_to_video":
            raise InvalidArgument(f"{slot}: this graph has no {slot} to fill (its prompt is encoded by a "
                                  f"{'reference' if kind == 'reference_to_video' else 'text'} node, not "
                                  "MiniMaxH3ImageToVideo)")
        if data:
            out[slot] = (ref or MediaRef("image", _given(slot), f"request.{slot}"), data)
        elif ref is not None:
            out[slot] = (ref, _missing(ref, read_input, f"send it as the request's {slot}"))
    if req.references:
        if kind != "reference_to_video":
            raise InvalidArgument("references: this graph takes no references (its prompt is encoded by "
                                  f"{'MiniMaxH3ImageToVideo' if kind == 'image_to_video' else 'a text node'}, not "
                                  "MiniMaxH3ReferenceToVideo)")
        graph_refs = render.references
        for i, ref in enumerate(req.references):  # the request's references are the render's, in its order
            node = graph_refs[i] if i < len(graph_refs) and graph_refs[i].kind == ref.kind else None
            out[f"reference {i + 1}"] = (node or MediaRef(ref.kind, _given(ref.name or ref.kind),
                                                          f"request.references[{i}]"), ref.data)
    else:
        for i, ref in enumerate(render.references):
            out[f"reference {i + 1}"] = (ref, _missing(ref, read_input, "send it as the request's reference "
                                                                        f"{i + 1}"))
    if not req.guides:  # the request's guides (what the client read for the graph, or its own) replace the graph's
        for i, g in enumerate(render.guides):
            for part, ref in (("image", g.image), ("audio", g.audio)):
                if ref is not None:
                    out[f"guide {i + 1} {part}"] = (ref, _missing(ref, read_input, f"send it in the request's guide "
                                                                                   f"{i + 1}"))
    return out


def _given(name: str) -> Val:
    return Val(name, "the request")


def _missing(ref: MediaRef, read_input: ReadInput | None, fix: str) -> bytes:
    try:
        return _read(ref, read_input)
    except InvalidArgument as e:
        raise InvalidArgument(f"{e.message}; {fix}") from None


def _fill(req: render_pb2.RenderRequest, render: WorkflowRender, files: dict[str, tuple[MediaRef, bytes]]) -> None:
    """The request's fields from the render: the graph's values where the request set none, then the render spec
    checked with each wrong value attributed to where it came from."""
    p = req.params
    overridden = {name for name, given in _OVERRIDES if given(p)}
    spec = render.spec()
    for name, _ in _OVERRIDES:
        if name not in overridden:
            setattr(p, name, getattr(spec, name))
    if spec.sparse is not None and not p.HasField("sparse_attention"):  # the graph's, unless the request sets its own
        sparse_to_proto(spec.sparse, p.sparse_attention)
    if not req.loras:
        for name, strength in render.loras:
            req.loras.add(name=name.value, strength=float(strength.value))
    for slot in ("first_frame", "last_frame"):
        if slot in files:
            setattr(req, slot, files[slot][1])
    if not req.references:
        for i, ref in enumerate(render.references):
            req.references.add(kind=ref.kind, data=files[f"reference {i + 1}"][1],
                               name=os.path.basename(ref.name.value))
    graph_guides = not req.guides
    if graph_guides:
        for i, g in enumerate(render.guides):
            guide = req.guides.add(frame=g.frame.value)
            for part, ref in (("image", g.image), ("audio", g.audio)):
                if ref is not None:
                    getattr(guide, part).CopyFrom(common_pb2.Reference(
                        kind=ref.kind, data=files[f"guide {i + 1} {part}"][1], name=os.path.basename(ref.name.value)))
    if (render.output == PNG) != (p.frames == IMAGE_FRAMES):
        raise InvalidArgument(f"frames={p.frames}: this graph saves an image (SaveImage), one frame; leave out "
                              "--frames" if render.output == PNG else
                              f"frames={p.frames} is an image, but this graph saves a video (SaveVideo): give a "
                              "video's frames (17n+5), or render an image graph")
    if render.output == PNG:
        req.output_format = PNG
        req.crf = req.crf or IMAGE_CRF
    try:
        validate(spec_from_proto(p), need_prompt=True)
    except InvalidArgument as e:
        raise InvalidArgument(attribute(e.message, render, overridden)) from None
    if graph_guides and (wrong := guide_problems(render, p.frames)):
        raise WorkflowRefused(wrong)


def refused_nodes(e: InvalidArgument) -> list[tuple[str, str, str]]:
    """(node id, type, why) of each node a refusal names (a graph-level reason has no node)."""
    if isinstance(e, WorkflowRefused):
        return [(r.node, r.type, r.why) for r in e.refusals]
    return [("", "", e.message)]


def first_frame_png(mp4: Path) -> bytes:
    """An image graph's picture: the first frame of its MP4, as PNG."""
    import av

    with av.open(str(mp4)) as container:
        frame = next(container.decode(video=0))
        buf = io.BytesIO()
        frame.to_image().save(buf, "PNG")
    return buf.getvalue()

