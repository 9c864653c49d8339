"""Admission: everything about a render request checked before it is stored, so a request the stages would refuse
is refused at Submit with the stage's reason (InvalidArgument, NotFound or FailedPrecondition naming the fix).

`check_request` checks the request alone (sizes, the spec, keyframes, references, guides, LoRA names); `StageChecks`
asks the stages what only they can tell (the DiT's partitions, LoRAs and kernels from its Status, read through the
cluster view's one poller; the encoder's prompt rules; a ComfyUI graph's files).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import grpc

from h3.v1 import common_pb2, encoder_pb2, render_pb2
from minimax_h3.contract import (IMAGE_FRAMES, IMAGE_PROMPT_ONLY, MAX_GUIDES, MAX_PROMPT_BYTES, SINGLE, check_loras,
                                 check_output, check_partition, check_reference_kinds, needed_partition, plan_windows,
                                 resolve_guide_frame, spec_from_proto, validate)
from minimax_h3.services import StageClients
from render_svc.cluster import Cluster
from render_svc.graph import GRAPH
from stagekit.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger("render_svc")

MAX_LABEL_CHARS = 200
DIT_STATUS_TTL_S = 10.0  # how long the DiT's Status (its partitions and LoRAs) is trusted before it is asked again
DIT_STATUS_RECHECK_S = 1.0  # a LoRA name the DiT lacked is asked again once its Status is this old (a file just added)
STAGE_CHECK_TIMEOUT_S = 5.0  # a stage's answer to a Submit-time question (Status, CheckPrompt)


SERVICE_OF_ROLE = {"dit": "dit", "text_encoder": "encoder", "video_vae": "decoder", "audio_vae": "decoder"}


def served_files(st: common_pb2.StageStatus, role: str, partition: str) -> list[str]:
    """The names of the files a stage's Status says it serves for a graph file's `role`: the DiT's file of the
    request's partition, the encoder's weights, the decoder's video or audio VAE ("VIDEO + AUDIO")."""
    if role == "dit":
        paths = [st.partitions[partition]] if partition in st.partitions else []
    elif role == "text_encoder":
        paths = [st.weights]
    else:
        parts = st.weights.split(" + ")
        paths = parts[:1] if role == "video_vae" else parts[1:2]
    return [Path(p).name for p in paths if p]


def check_graph_files(graph_files, statuses: dict[str, list[common_pb2.StageStatus]], partition: str) -> None:
    """A graph names its files, and the stages serve files of their own: the graph runs only where each file it loads
    is the one its stage serves, by name, on every replica that answered (`statuses`: service -> their Status);
    FailedPrecondition naming the loader node, both files and the fixes otherwise. A stage serving the embedded tiny
    model stands for every file (its output is noise, as the CLI says)."""
    for use in graph_files:
        service = SERVICE_OF_ROLE.get(use.role)
        for st in statuses.get(service, ()) if service else ():
            if st.embedded_model:
                continue
            served = served_files(st, use.role, partition)
            if use.name.value not in served:
                fix = f"--set {use.name.key}={served[0]} or " if use.name.key and served else ""
                raise FailedPrecondition(
                    f"{use.type} node {use.node} loads {use.name.value}, but the {service} stage serves "
                    f"{', '.join(served) or 'no such file'}: {fix}start the {service} stage over a models folder with "
                    "that file (python -m client models fetch --workflow FILE fetches a graph's files)")


def check_request(req: render_pb2.RenderRequest) -> None:
    """Everything about a request that can be checked before it is queued; InvalidArgument with the reason."""
    from minimax_h3.images import load_keyframe

    size = len(req.params.prompt.encode())
    if size > MAX_PROMPT_BYTES:
        raise InvalidArgument(f"prompt is {size} bytes; the text encoder takes at most {MAX_PROMPT_BYTES} bytes "
                              "(and its --max-prompt-tokens tokens): shorten it")
    spec = validate(spec_from_proto(req.params), need_prompt=True)
    check_output(spec, req.crf, req.upscale_width, req.upscale_height)
    if req.workflow_set and not req.workflow_json:
        raise InvalidArgument("workflow_set changes a graph's widgets: send the graph in workflow_json")
    if req.output_format not in ("", "mp4", "png"):
        raise InvalidArgument(f"output_format {req.output_format[:20]!r}: the outputs are 'mp4' and 'png' (an image "
                              "graph's picture)")
    if bool(spec.prefix_frames) != bool(req.extend_job_id):
        raise InvalidArgument("prefix_frames and extend_job_id make an extension together: extend a finished job "
                              "with Extend (python -m client extend, POST /v1/videos/extensions)")
    windows = plan_windows(spec)
    if windows.mode != SINGLE and (req.first_frame or req.last_frame or req.references or req.guides):
        raise InvalidArgument(f"a render sampled in windows ({windows.describe()}) takes text prompts only: keyframes, "
                              "references and guides condition one window, so render at most 515 frames with them")
    if spec.frames == IMAGE_FRAMES and (req.first_frame or req.last_frame or req.references or req.guides):
        raise InvalidArgument(IMAGE_PROMPT_ONLY)
    if len(req.label) > MAX_LABEL_CHARS or len(req.idempotency_key) > MAX_LABEL_CHARS:
        raise InvalidArgument(f"label and idempotency_key are limited to {MAX_LABEL_CHARS} characters")
    for anchor, img in (("first_frame", req.first_frame), ("last_frame", req.last_frame)):
        if img:
            try:
                load_keyframe(img, spec.width, spec.height)
            except InvalidArgument as e:
                raise InvalidArgument(f"{anchor}: {e.message}") from None
    if req.references:
        check_references(req, spec.prompt, spec.frames)
    if req.guides:
        check_guides(req, spec)
    for lo in req.loras:
        if not lo.name.strip():
            raise InvalidArgument("a LoRA needs a file name (a file in the DiT server's loras dir)")
        if lo.HasField("strength") and not math.isfinite(lo.strength):
            raise InvalidArgument(f"LoRA {lo.name!r}: strength must be finite, got {lo.strength}")


def check_references(req: render_pb2.RenderRequest, prompt: str, frames: int) -> None:
    """ref2va admission: no keyframes beside them, a mix of kinds the checkpoint takes (`check_reference_kinds`),
    each file one the decoder takes (`describe_reference`), and the prompt's labels naming exactly the references
    there are (minimax_h3/labels.py; a ComfyUI graph's prompt is taken as the graph gives it, its label problems
    logged). Fills in each reference's thumbnail, duration and size."""
    from minimax_h3.labels import check_labels, label_problems

    if req.first_frame or req.last_frame:
        raise InvalidArgument("references and first/last keyframes do not combine: the ref2va partition takes "
                              "references only (send the frame as an image reference)")
    check_reference_kinds([r.kind for r in req.references])
    sound = [describe_reference(ref, i, frames) for i, ref in enumerate(req.references)]
    labels = (prompt, [r.kind for r in req.references], sound, [r.name for r in req.references])
    if not req.workflow_json:
        check_labels(*labels)
        return
    for problem in label_problems(*labels):
        log.info("Submit: a graph's prompt: %s (taken as the graph gives it)", problem)


def check_guides(req: render_pb2.RenderRequest, spec) -> None:
    """Guide admission (minimax_h3/dit/guides.py): at most MAX_GUIDES, each an image and / or a sound at a frame of
    the video (negative: from the end), the image one the decoder's EncodeImage takes at the canvas, the sound an
    audio file the decoder takes (`check_reference_file`). InvalidArgument `guide g: ...`."""
    from minimax_h3.images import load_keyframe
    from minimax_h3.reference_files import check_reference_file

    if len(req.guides) > MAX_GUIDES:
        raise InvalidArgument(f"{len(req.guides)} guides; a render takes at most {MAX_GUIDES}")
    for g, guide in enumerate(req.guides, start=1):
        try:
            resolve_guide_frame(guide.frame, spec.frames)
            if not (guide.HasField("image") or guide.HasField("audio")):
                raise InvalidArgument("needs an image and / or an audio file")
            for part, kind in (("image", "image"), ("audio", "audio")):
                if not guide.HasField(part):
                    continue
                ref = getattr(guide, part)
                if ref.kind != kind:
                    raise InvalidArgument(f"its {part} must be a Reference of kind {kind!r}, got {ref.kind!r}")
                if part == "image":
                    load_keyframe(ref.data, spec.width, spec.height)
                else:
                    check_reference_file(kind, ref.data, spec.frames, ref.name)
        except InvalidArgument as e:
            raise InvalidArgument(f"guide {g} (frame {guide.frame}): {e.message}") from None


THUMBNAIL_PX = 96


def describe_reference(ref, index: int, frames: int) -> bool:
    """Check a reference's file for a render of `frames` frames as the stages will take it
    (`minimax_h3.reference_files.check_reference_file`: size and aspect from the header, the pixels of an image,
    a video's first frame, the sound up to the render's duration) and fill in what the web page shows of it
    (thumbnail, duration, size); returns whether a video has a soundtrack (it takes an <Audio j> label).
    InvalidArgument `reference i (name): ...` for a file the stages would refuse."""
    import io

    from minimax_h3.reference_files import check_reference_file

    try:
        found = check_reference_file(ref.kind, ref.data, frames)
    except InvalidArgument as e:
        raise InvalidArgument(f"reference {index + 1} ({ref.name or ref.kind}): {e.message}") from None
    ref.width, ref.height, ref.seconds = found.width, found.height, found.seconds
    if found.picture is not None:
        thumb = found.picture.convert("RGB")
        thumb.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        buf = io.BytesIO()
        thumb.save(buf, "JPEG", quality=80)
        ref.thumbnail = buf.getvalue()
    return found.sound


class StageChecks:
    """Submit's questions to the stages: their Status through the cluster view (`cluster`), the encoder's
    CheckPrompt through `clients`."""

    def __init__(self, cluster: Cluster, clients: StageClients):
        self.cluster = cluster
        self.clients = clients

    def check(self, req: render_pb2.RenderRequest, graph_files=()) -> None:
        """What only the stages can tell, asked of them before the job is stored (InvalidArgument, NotFound or
        FailedPrecondition naming the fix, as the stage itself would answer). A stage that does not answer (or lacks
        the question) is not asked: its own admission decides when the job reaches it.

        1. The DiT's partitions (its Status): one of its files serves the request's partition (`check_partition`).
        2. The DiT's LoRAs (its Status): each LoRA named is a file in its loras directory, or a path it takes
           (`check_loras`); a name it lacked is asked once more, from a fresh Status (a file just added); and VSA
           sparse attention, where the request asks for it: the DiT's "vsa" kernel row is not "unavailable".
        With several DiT replicas, one that serves all of it is enough (the scheduler sends the job only to such
        ones).
        3. The encoder's prompt rules (its CheckPrompt): its tokenizer, its --max-prompt-tokens, its markers.
        4. A graph's files (`graph_files`): each stage serves the file the graph's loader node names (`_check_files`).
        """
        try:
            self._check_dit(req, DIT_STATUS_TTL_S)
        except NotFound:
            self._check_dit(req, DIT_STATUS_RECHECK_S)
        for prompt in (req.params.prompt, *req.params.more_prompts):
            self._check_prompt(prompt)
        self._check_files(graph_files, needed_partition(bool(req.references)))

    def _check_files(self, graph_files, partition: str) -> None:
        """Step 4 (`check_graph_files`) against each answering replica's Status."""
        services = {SERVICE_OF_ROLE[u.role] for u in graph_files if u.role in SERVICE_OF_ROLE}
        statuses = {s: self.cluster.statuses(s, DIT_STATUS_TTL_S, STAGE_CHECK_TIMEOUT_S) for s in services}
        check_graph_files(graph_files, statuses, partition)

    def _check_dit(self, req: render_pb2.RenderRequest, max_age_s: float) -> None:
        """Steps 1 and 2 against each DiT replica's Status (read again when older than `max_age_s`): passes when one
        replica serves the request (or none answers); else the first replica's refusal."""
        refusals = []
        statuses = (st for service in sorted(GRAPH.affinity_services)
                    for st in self.cluster.statuses(service, max_age_s, STAGE_CHECK_TIMEOUT_S))
        for st in statuses:
            try:
                check_partition(bool(req.references), dict(st.partitions))
                if req.loras and st.HasField("loras"):
                    check_loras([lo.name for lo in req.loras], st.loras.directory, list(st.loras.names),
                                st.loras.paths_allowed)
                vsa = next((k for k in st.kernels if k.op == "vsa"), None)
                if req.params.HasField("sparse_attention") and vsa is not None and vsa.kernel == "unavailable":
                    raise FailedPrecondition(f"this DiT does not run VSA sparse attention: {vsa.reason}")
                return
            except (FailedPrecondition, NotFound) as e:
                refusals.append(e)
        if refusals:
            raise refusals[0]

    def _check_prompt(self, prompt: str) -> None:
        """The encoder's verdict on `prompt` (CheckPrompt: the same checks its Encode makes first, on its CPU):
        its refusal, in its words, is the request's."""
        clients = self.clients
        try:
            clients.encoder.CheckPrompt(encoder_pb2.PromptCheckRequest(prompt=prompt), timeout=STAGE_CHECK_TIMEOUT_S,
                                        metadata=clients.security.metadata())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(e.details()) from None
            log.debug("Submit: the encoder's CheckPrompt did not answer (%s); its Encode decides", e.code())
