"""The render service's scheduler: durable jobs in, stage batches out.

`submit` validates a request, records the job (SQLite, `store.JobStore`) and queues it for the first stage of its
mode's plan (`planner.RENDER_PLANS`). The stage services are split into *resource groups* (`planner.resource_groups`,
from each stage's Status: services that share a device and take its lease take turns; the others do not); one
dispatcher thread asks the one scheduling decision (`planner.schedule`) for each idle group's next stage batch and
runs it in a thread of its own (`engine.RenderEngine`), so groups that share no device run at the same time. Each job
moves on the moment its stage call ends: to its next stage's queue, to SUCCEEDED with its MP4, or to FAILED / CANCELLED. With
`pipeline=False` (--serial) all stages form one group: one batch service-wide at a time. A stage
answering UNAVAILABLE (restarting its ranks, draining) is retried by queueing the job for the same stage again
(--stage-retries); a stage answering RESOURCE_EXHAUSTED with "retry later" (its queue or its upload slots are full)
is waited out with exponential backoff up to the job's deadline (--job-deadline-s), the job showing "waiting for the
<stage> stage (busy)". A replica that sends nothing on a batch's calls for --stall-timeout-s loses the batch: its
calls are stopped, it is out of rotation until its Status shows it moving again, and each job runs that stage once
more elsewhere (render_svc/stalls.py). Cancel takes a waiting job out of the queue at once and stops a running one's
stage call.

The job store's writes that move a job on are retried until they succeed: a full disk or an I/O error stops the
scheduler where it is, is reported (log, Status, Submit's UNAVAILABLE) and is over once a write succeeds again.
A timer runs retention and checks that the database file is still there (docs/reliability.md, "Job store").
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import grpc

from h3.v1 import common_pb2, encoder_pb2, render_pb2
from minimax_h3.comfy.workflow import ReadInput, apply_workflow
from minimax_h3.contract import (MAX_GUIDES, MAX_PROMPT_BYTES, SINGLE, check_loras, check_output, check_partition,
                                 check_reference_kinds, needed_partition, plan_windows, resolve_guide_frame,
                                 spec_from_proto, validate)
from render_svc.engine import Outcome, RenderEngine, Work
from render_svc.extend import check_source, cut_guide, extension_request
from render_svc.planner import (Affinity, Batch, BatchPlanner, ClusterView, ReplicaState, Resources, Serves, next_stage,
                                resource_groups, schedule)
from render_svc.stalls import STALL_TIMEOUT_S, Suspects, stall_verdict
from render_svc.store import (CANCELLED, FAILED, GUIDE, QUEUED, RUNNING, SOURCE, SUCCEEDED, JobRecord, JobStore,
                              latents_path)
from stagekit.errors import Cancelled, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from stagekit.uploads import UploadStore, reference_bytes

log = logging.getLogger("render_svc")

MAX_LABEL_CHARS = 200
BUSY_HINT = "retry later"     # a stage's RESOURCE_EXHAUSTED that passes (full queue, upload slots, budget wait)
BUSY_FIRST_S, BUSY_MAX_S = 0.5, 30.0   # backoff between tries of a busy stage: doubles from the first to the max
STORAGE_RETRY_S = 1.0         # a failed job-store write is tried again this often


@dataclass(frozen=True)
class SchedulerConfig:
    run_dir: Path
    max_batch: int = 8               # jobs per stage batch (keep <= the stages' --max-queue)
    max_wait_batches: int = 4        # fairness bound: batches a ready job may wait
    max_attempts: int = 2            # runs of a job (a restart during a run retries it while attempts remain)
    stage_retries: int = 3           # UNAVAILABLE answers from a stage tolerated per job
    max_jobs_queued: int = 256       # QUEUED jobs beyond this: RESOURCE_EXHAUSTED
    keep_jobs: int = 100             # retention of finished outputs (0 = no limit on that axis)
    keep_bytes: int = 10 << 30
    keep_age_s: float = 7 * 86400.0
    job_deadline_s: float = 6 * 3600.0   # a busy stage is waited out until this long after the job's submission
    stall_timeout_s: float = STALL_TIMEOUT_S  # a replica silent on a batch's calls this long loses the batch
    retention_every_s: float = 60.0      # retention (and the database file check) runs this often
    pipeline: bool = True            # stage groups that share no device run at once (False: one batch at a time)


DIT_STATUS_TTL_S = 10.0  # how long the DiT's Status (its partitions and LoRAs) is trusted before it is asked again
DIT_STATUS_RECHECK_S = 1.0  # a LoRA name the DiT lacked is asked again once its Status is this old (a file just added)
STAGE_CHECK_TIMEOUT_S = 5.0  # a stage's answer to a Submit-time question (Status, CheckPrompt)
RESOURCES_EVERY_S = 10.0     # the stages' devices (their Status) are read again this often
RESOURCES_UNKNOWN_EVERY_S = 1.0  # ... and this often while a stage has not answered yet
RESOURCES_TIMEOUT_S = 2.0    # a stage's Status answer for its devices


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
    there are (minimax_h3/labels.py). Fills in each reference's thumbnail, duration and size."""
    from minimax_h3.labels import check_labels

    if req.first_frame or req.last_frame:
        raise InvalidArgument("references and first/last keyframes do not combine: the ref2va partition takes "
                              "references only (send the frame as an image reference)")
    check_reference_kinds([r.kind for r in req.references])
    sound = [describe_reference(ref, i, frames) for i, ref in enumerate(req.references)]
    check_labels(prompt, [r.kind for r in req.references], sound, [r.name for r in req.references])


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


class RenderService:
    def __init__(self, cfg: SchedulerConfig, engine: RenderEngine):
        self.cfg = cfg
        self.engine = engine
        self.store = JobStore(cfg.run_dir)
        self.outputs = self.store.outputs
        # Uploaded reference files, kept by content with the stored keyframes (the jobs that name them keep them).
        self.uploads = UploadStore(self.store.files.dir.resolve(), in_use=self.store.files_in_use)
        self.outputs.mkdir(parents=True, exist_ok=True)
        self.planner = BatchPlanner(cfg.max_batch, cfg.max_wait_batches)
        if not cfg.stall_timeout_s > 0:
            raise FailedPrecondition(f"--stall-timeout-s must be above 0, got {cfg.stall_timeout_s:g}")
        self.works: dict[str, Work] = {}         # jobs in flight (queued or between / in stages)
        self.nodes = list(engine.replicas)       # the stage replicas ("dit", or "dit/a", "dit/b", ...)
        self.resources: dict[str, Resources] = {}  # each replica's devices, from its Status
        self.status: dict[str, common_pb2.StageStatus] = {}  # each replica's last Status
        self.down: set[str] = set()              # replicas that did not answer (their jobs go to the others)
        self.suspects = Suspects()               # replicas that stalled on a batch (their jobs go to the others)
        self.resident = {n: Affinity() for n in self.nodes if engine.replicas[n].service == "dit"}  # DiT affinity
        self.groups: list[tuple[str, ...]] = resource_groups(self.nodes, {}, serial=True)  # until the stages answer
        self.running: dict[str, tuple[Batch, float]] = {}  # replica -> the batch its group runs, its start
        self.last_started: dict[str, float] = {}  # replica -> when its group last started a batch (monotonic)
        self._batch_threads: set[threading.Thread] = set()
        self._resources_read = threading.Event()  # the stages' Status was asked once (the first batch waits for it)
        self.later: dict[str, tuple[float, str]] = {}  # jobs backing off a busy stage: id -> (due, stage)
        self.storage_error = ""                  # the job store's last failed write, until one succeeds again
        self._next_retention = 0.0
        self.batch_log: deque[dict] = deque(maxlen=200)  # recent batches (the web page draws them)
        self.started_unix = time.time()
        self._lock = threading.Condition()
        self._seen: dict[str, tuple[float, common_pb2.StageStatus]] = {}  # stage replica -> (when read, Status)
        self.stopping = threading.Event()       # SIGTERM: the drain has begun (no new batch starts)
        self._abort = threading.Event()          # the drain stops the running batch's stage calls
        self._stop = threading.Event()           # the drain is over: Submit refuses
        self._thread = threading.Thread(target=self._loop, name="render-scheduler", daemon=True)
        self._watcher = threading.Thread(target=self._watch_resources, name="render-resources", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        for stray in self.outputs.glob(".*"):  # half-received MP4s of a run that died
            stray.unlink(missing_ok=True)
        requeued, failed = self.store.recover(self.cfg.max_attempts)
        if requeued or failed:
            log.warning("recovered after restart: %d running job(s) requeued, %d failed (attempts used up)",
                        len(requeued), len(failed))
        with self._lock:
            for rec in self.store.list([QUEUED], limit=1 << 30, oldest_first=True):
                self._enqueue(rec)
        self._expire()
        self._next_retention = time.monotonic() + self.cfg.retention_every_s
        self._watcher.start()
        self._thread.start()

    def shutdown(self, cancel_running: bool, grace_s: float, cancel_wait_s: float = 15.0) -> None:
        """SIGTERM (docs/reliability.md, "SIGTERM"): no new batch starts; the running one finishes within `grace_s`
        (or its stage calls are stopped now, `cancel_running`), then is stopped. Jobs that were running go back to
        the queue with their attempt given back (`store.drained`): the next start carries them on."""
        self.stopping.set()
        if cancel_running:
            self._abort.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=grace_s)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(timeout=cancel_wait_s)
        self._watcher.join(timeout=len(self.nodes) * RESOURCES_TIMEOUT_S)
        self._stop.set()

    def gauges(self) -> dict[str, float]:
        """What `/metrics` reads at scrape time (stagekit.metrics): jobs queued, running and finished."""
        counts = self.counts()
        return {"h3_queue_depth": counts.get(QUEUED, 0), "h3_running": counts.get(RUNNING, 0),
                "h3_jobs_done": sum(counts.get(s, 0) for s in (SUCCEEDED, FAILED, CANCELLED))}

    # ---- API ----------------------------------------------------------------------------------------------------
    def submit(self, req: render_pb2.RenderRequest, owner: str = "", admin: bool = False, *, seconds: str = "",
               remixed_from: str = "", read_input: ReadInput | None = None) -> render_pb2.JobInfo:
        """Admit and queue a request of principal `owner` (an `admin` may extend anyone's job). A ComfyUI graph
        (`workflow_json`) is read first and fills the request (minimax_h3/comfy/workflow.py; `read_input` gives the
        files its loader nodes name, for ComfyUI's own routes); `seconds`, `remixed_from`: what the HTTP API records
        beside the job (JobStore.submit)."""
        # An uploaded file (Upload) is admitted like an inline one.
        for ref in [*req.references, *(getattr(g, p) for g in req.guides for p in ("image", "audio") if g.HasField(p))]:
            ref.data = reference_bytes(ref, self.uploads)
        graph_files = apply_workflow(req, read_input).files if req.workflow_json else []
        check_request(req)
        self._check_with_stages(req, graph_files)
        if self._stop.is_set():
            raise Unavailable("the render service is shutting down; retry on another replica or after its restart")
        files = self._extension_files(req, None if admin else owner or None) if req.extend_job_id else None
        try:
            with self._lock:
                rec, created = self.store.submit(req, owner or "", self.cfg.max_jobs_queued, seconds, remixed_from,
                                                 files)
                if created:
                    self._enqueue(rec)
                    self._lock.notify_all()
        except sqlite3.Error as e:
            raise self._storage_failed(e) from None
        return self.info(rec.id)

    def extend(self, ext: render_pb2.ExtendRequest, owner: str = "", admin: bool = False) -> render_pb2.JobInfo:
        """A new job continuing the finished job `ext.job_id` (docs/long_video.md, "Extend"): its render request is
        the source's with the extension's prompt(s) and stitched total (`render_svc.extend.extension_request`), then
        submitted as any other."""
        src = self.store.get(ext.job_id, None if admin else owner or None)
        return self.submit(extension_request(src.request, ext, src.id), owner, admin=admin)

    def _extension_files(self, req: render_pb2.RenderRequest, access: str | None) -> dict[str, Path | bytes]:
        """What an extension needs of its source job, stored with it (the source may be removed before it runs): the
        source's MP4, and the guide cut from the source's kept latents when they cover it (else the decoder
        re-encodes the guide from the MP4). NotFound / FailedPrecondition naming the source job's problem."""
        src = self.store.get(req.extend_job_id, access)
        mp4 = check_source(src.state, src.id, src.expired, src.output)
        spec, src_spec = spec_from_proto(req.params), spec_from_proto(src.request.params)
        if (spec.width, spec.height, spec.prefix_frames) != (src_spec.width, src_spec.height, src_spec.frames):
            raise InvalidArgument(f"an extension of job {src.id} continues its {src_spec.width}x{src_spec.height}x"
                                  f"{src_spec.frames} clip: prefix_frames={src_spec.frames} on its canvas")
        if (req.upscale_width, req.upscale_height) != (src.request.upscale_width, src.request.upscale_height):
            raise InvalidArgument(f"an extension keeps its source's MP4 size ({src.info().width}x{src.info().height})")
        files: dict[str, Path | bytes] = {SOURCE: mp4}
        guide = cut_guide(latents_path(mp4), spec)
        if guide is not None:
            files[GUIDE] = guide
        return files

    def _check_with_stages(self, req: render_pb2.RenderRequest, graph_files=()) -> None:
        """What only the stages can tell, asked of them before the job is stored (InvalidArgument,
        NotFound or FailedPrecondition naming the fix, as the stage itself would answer). A stage that does not answer (or lacks the question) is not asked: its
        own admission decides when the job reaches it.

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
        check_graph_files(graph_files, {s: self._statuses(s, DIT_STATUS_TTL_S) for s in services}, partition)

    def _check_dit(self, req: render_pb2.RenderRequest, max_age_s: float) -> None:
        """Steps 1 and 2 against each DiT replica's Status (read again when older than `max_age_s`): passes when one
        replica serves the request (or none answers); else the first replica's refusal."""
        refusals = []
        for st in self._statuses("dit", max_age_s):
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

    def _statuses(self, service: str, max_age_s: float) -> list[common_pb2.StageStatus]:
        """Each replica of `service`'s Status, read again when the one held is older than `max_age_s`; those that
        answer."""
        now = time.monotonic()
        out = []
        for node, r in self.engine.replicas.items():
            if r.service != service:
                continue
            seen = self._seen.get(node)
            if seen is None or now - seen[0] > max_age_s:
                try:
                    st = r.clients.stub(service).Status(common_pb2.StatusRequest(), timeout=STAGE_CHECK_TIMEOUT_S,
                                                        metadata=r.clients.security.metadata())
                except grpc.RpcError as e:
                    log.debug("Submit: %s %s's Status did not answer (%s); its own admission decides", service, node,
                              e.code())
                    continue
                seen = self._seen[node] = (now, st)
            out.append(seen[1])
        return out

    def _check_prompt(self, prompt: str) -> None:
        """The encoder's verdict on `prompt` (CheckPrompt: the same checks its Encode makes first, on its CPU):
        its refusal, in its words, is the request's."""
        clients = self.engine.clients
        try:
            clients.encoder.CheckPrompt(encoder_pb2.PromptCheckRequest(prompt=prompt), timeout=STAGE_CHECK_TIMEOUT_S,
                                        metadata=clients.security.metadata())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(e.details()) from None
            log.debug("Submit: the encoder's CheckPrompt did not answer (%s); its Encode decides", e.code())

    def info(self, job_id: str, rec: JobRecord | None = None, owner: str | None = None) -> render_pb2.JobInfo:
        rec = rec or self.store.get(job_id, owner)
        return rec.info(self.store.queue_position(rec))

    def cancel(self, job_id: str, owner: str | None = None) -> render_pb2.JobInfo:
        rec = self.store.get(job_id, owner)
        if rec.terminal:
            return self.info(job_id, rec)
        try:
            with self._lock:
                waiting_for = self.planner.remove(job_id)
                if waiting_for is None and job_id in self.later:
                    waiting_for = f"{self.later.pop(job_id)[1]} stage (busy)"
                elif waiting_for is not None:
                    waiting_for = f"{waiting_for} stage"
                work = self.works.get(job_id)
                if waiting_for is not None:  # not in a batch: it ends now
                    self.works.pop(job_id, None)
                    if self.store.finish(job_id, CANCELLED, "CANCELLED", f"cancelled while waiting for the {waiting_for}"):
                        self._expire()
                elif work is not None:       # in the running batch: its stage call stops at the next step boundary
                    work.cancel()
        except sqlite3.Error as e:
            raise self._storage_failed(e) from None
        if waiting_for is None and work is not None:
            self._wait_terminal(job_id, timeout_s=30.0)
        return self.info(job_id)

    def delete(self, job_id: str, owner: str | None = None) -> None:
        """Remove a job: cancelled first if it has not ended (as `cancel`, waiting up to 30 s for a running one's
        stage call to stop), then its record, events and MP4."""
        if not self.store.get(job_id, owner).terminal:
            self.cancel(job_id, owner)
        try:
            output = self.store.delete(job_id, owner)
        except sqlite3.Error as e:
            raise self._storage_failed(e) from None
        if output:
            Path(output).unlink(missing_ok=True)

    def _wait_terminal(self, job_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.store.changed:
            while not self.store.get(job_id).terminal and time.monotonic() < deadline:
                self.store.changed.wait(0.2)

    # ---- the job store's faults ----------------------------------------------------------------------------------
    def _storage_failed(self, e: sqlite3.Error) -> Unavailable:
        """Note a failed job-store write (reported until a write succeeds); the status a caller gets for it."""
        msg = f"the job store {self.store.path} cannot be written ({e}); free space on its disk or fix it"
        if msg != self.storage_error:
            log.error("%s; the scheduler waits and retries", msg)
        self.storage_error = msg
        return Unavailable(f"{msg}; retry later")

    def _durable(self, fn, *args):
        """`fn(*args)`, a job-store write the scheduler cannot go on without: retried until it succeeds (a full
        disk stops the scheduler here, it does not end it). Unavailable once the service is stopping."""
        while True:
            try:
                out = fn(*args)
            except sqlite3.Error as e:
                self._storage_failed(e)
                if self.stopping.wait(STORAGE_RETRY_S):
                    raise Unavailable("stopping") from None
                continue
            if self.storage_error:
                log.warning("the job store takes writes again: %s is over", self.storage_error)
                self.storage_error = ""
            return out

    def _maintain(self) -> None:
        """On the retention timer: the database file still in place (else written back), then retention."""
        if self.store.missing():
            log.error("the job database %s was deleted under the running service; writing it back", self.store.path)
            self.store.restore_file()
        self._durable(self._expire)

    # ---- scheduling ---------------------------------------------------------------------------------------------
    def _enqueue(self, rec: JobRecord) -> None:
        """Under the lock: a queued job's in-flight state, waiting for its first stage."""
        spec = spec_from_proto(rec.request.params)
        frames = [(a, self.store.files.path(rec.keyframes[a])) for a in ("first", "last") if a in rec.keyframes]
        refs = [self.store.files.path(r.digest) if r.digest and not r.data else None for r in rec.request.references]
        guides = [{p: self.store.files.path(getattr(g, p).digest) for p in ("image", "audio")
                   if g.HasField(p) and getattr(g, p).digest and not getattr(g, p).data} for g in rec.request.guides]
        stored = {k: self.store.files.path(d) for k, d in rec.keyframes.items()}
        w = Work(rec.id, rec.request, spec, self.outputs / f"{rec.id}.mp4", keyframe_files=frames,
                 reference_files=refs, guide_files=guides, deadline=rec.created + self.cfg.job_deadline_s,
                 source=stored.get(SOURCE), guide_file=stored.get(GUIDE), keep_latents=True)
        self.works[rec.id] = w
        self.planner.add(rec.id, w.first_stage)

    def _progress(self, job_id: str, p: common_pb2.Progress) -> None:
        """A stage's progress: logged when the store takes it (a lost progress event costs nothing)."""
        try:
            self.store.progress(job_id, p)
        except sqlite3.Error as e:
            self._storage_failed(e)

    def _watch_resources(self) -> None:
        """Its own thread: every RESOURCES_EVERY_S (every second while a stage has not answered or a replica is
        suspect) each stage service's devices from its Status, and the resource groups they make."""
        while not self.stopping.is_set():
            known = self._refresh_resources()
            self._resources_read.set()
            with self._lock:
                healthy = known and not self.down and not self.suspects
            self.stopping.wait(RESOURCES_EVERY_S if healthy else RESOURCES_UNKNOWN_EVERY_S)

    def _refresh_resources(self) -> bool:
        """Read each replica's Status: its devices, queue, partitions and LoRAs; regroup. A replica that does not
        answer is down (its service's other replicas take its jobs) and keeps the devices it named last; one that
        never answered shares a group with every other (nothing runs beside it blind). Returns whether every replica
        answered."""
        answered = {}
        asked = time.monotonic()
        for node, r in self.engine.replicas.items():
            try:
                answered[node] = r.clients.stub(r.service).Status(
                    common_pb2.StatusRequest(), timeout=RESOURCES_TIMEOUT_S, metadata=r.clients.security.metadata())
            except grpc.RpcError as e:
                log.debug("replica %s (%s) did not answer Status (%s)", node, r.address, e.code())
        with self._lock:
            for node in self.nodes:
                st = answered.get(node)
                if st is None:
                    if node not in self.down:
                        log.warning("replica %s (%s) does not answer Status", node, self.engine.replicas[node].address)
                    self.down.add(node)
                    continue
                if node in self.down:
                    log.info("replica %s answers again", node)
                self.down.discard(node)
                self.suspects.seen(node, st, asked)
                self.status[node] = st
                self.resources[node] = Resources(st.host, tuple(st.device_ids) or tuple(st.devices),
                                                 st.residency != "shared")
            known = dict(self.resources)
            for node in self.down:  # never heard from and getting no work: it shares nothing
                known.setdefault(node, Resources("", (), False))
            groups = resource_groups(self.nodes, known, serial=not self.cfg.pipeline)
            if groups != self.groups:
                log.info("resource groups: %s", "; ".join("+".join(g) for g in groups))
                self.groups = groups
            self._lock.notify_all()
        return len(answered) == len(self.nodes)

    def _view(self) -> ClusterView:
        """Under the lock: the replicas as the scheduler sees them (render_svc/planner.py)."""
        def state(node: str) -> ReplicaState:
            rep, st = self.engine.replicas[node], self.status.get(node)
            serves = None
            if st is not None and rep.service == "dit":
                serves = Serves(frozenset(st.partitions), (st.loras.directory, tuple(st.loras.names),
                                                           st.loras.paths_allowed) if st.HasField("loras") else None)
            return ReplicaState(node, rep.service, down=node in self.down, suspect=node in self.suspects,
                                busy=node in self.running, queue_depth=st.queue_depth if st is not None else 0,
                                last_started=self.last_started.get(node, 0.0), serves=serves,
                                resident=self.resident.get(node))

        return ClusterView(tuple(state(n) for n in self.nodes), tuple(self.groups),
                           MappingProxyType(dict(self.planner.current)))

    def _dispatch(self) -> int:
        """Under the lock: jobs whose busy backoff is over rejoin their stage's queue; every batch the scheduler
        assigns (`planner.schedule`: each idle group's next) starts in a thread of its own, the replica's affinity
        recorded. Returns how many batches started."""
        now = time.monotonic()
        for job_id, (due, stage) in sorted(self.later.items(), key=lambda kv: kv[1][0]):
            if due <= now:
                del self.later[job_id]
                self.planner.add(job_id, stage)
        queues = self.planner.queued(lambda j: self.works[j.job_id].queued(j.waited))
        assignments = schedule(self._view(), queues)
        for a in assignments:
            batch = self.planner.take(a)
            if a.resident is not None:
                self.resident[a.replica] = a.resident
            rounds = [[self.works[j] for j in r] for r in a.rounds]
            for n in a.group:
                self.running[n] = (batch, time.time())
                self.last_started[n] = time.monotonic()
            t = threading.Thread(target=self._batch_thread, args=(batch, rounds, a.group, a.replica),
                                 name=f"render-batch-{batch.number}", daemon=True)
            self._batch_threads.add(t)
            t.start()
        return len(assignments)

    def _drained(self) -> None:
        """The service is draining (SIGTERM): the running jobs go back to the queue, their attempt given back."""
        try:
            ids = self.store.drained()
            log.info("drain: %d running job(s) back in the queue, no attempt spent", len(ids))
        except sqlite3.Error as e:
            self._storage_failed(e)

    def _loop(self) -> None:
        """The dispatcher: retention and checkpoints between batches, the stages' resources, and every idle group's
        next batch. Draining, it waits for the running batches (shutdown stops them after the grace), then gives the
        running jobs back to the queue."""
        self._resources_read.wait(timeout=len(self.nodes) * RESOURCES_TIMEOUT_S + 1.0)
        while not self._stop.is_set():
            try:
                if self.stopping.is_set():
                    with self._lock:
                        while self._batch_threads:
                            self._lock.wait(0.2)
                    self._drained()
                    return
                if time.monotonic() >= self._next_retention:
                    self._maintain()
                    self._next_retention = time.monotonic() + self.cfg.retention_every_s
                self._durable(self.store.save_finished)
            except Unavailable:
                return
            with self._lock:
                if self._dispatch() == 0 and not self.stopping.is_set():
                    due = min((d for d, _ in self.later.values()), default=time.monotonic() + 0.5)
                    self._lock.wait(max(0.01, min(0.5, due - time.monotonic())))

    def _batch_thread(self, batch: Batch, rounds: list[list[Work]], group: tuple[str, ...], node: str) -> None:
        """One group's batch on its replica `node`, start to end; the group's replicas are idle again after it."""
        advanced: set[str] = set()
        works = [w for r in rounds for w in r]
        try:
            self._run_batch(batch, rounds, advanced, node)
        except Unavailable:
            log.info("shutting down: leaving batch %d (%s) to the next start", batch.number, batch.stage)
        except Exception:  # noqa: BLE001 - a scheduler bug must not strand the jobs silently
            log.exception("batch %d (%s) failed", batch.number, batch.stage)
            for w in works:
                if w.job_id not in advanced:
                    self._finish(w, FAILED, "INTERNAL", f"render service error in the {batch.stage} batch; see its log")
        finally:
            with self._lock:
                for n in group:
                    self.running.pop(n, None)
                self._batch_threads.discard(threading.current_thread())
                self._lock.notify_all()

    def _run_batch(self, batch: Batch, rounds: list[list[Work]], advanced: set[str], node: str) -> None:
        """Send the batch's jobs to the stage, round after round; each moves on (`_advance`) the moment its own call
        ends."""
        live = []
        for w in (w for r in rounds for w in r):
            if w.cancelled.is_set():
                self._finish(w, CANCELLED, "CANCELLED", f"cancelled while waiting for the {batch.stage} stage")
                advanced.add(w.job_id)
                continue
            if self.store.get(w.job_id).state == QUEUED and not self._durable(self.store.start, w.job_id, batch.stage):
                advanced.add(w.job_id)
                continue  # finished in between
            live.append(w)
        if not live:
            return
        t0 = time.time()
        log.info("batch %d: %s x %d on %s (waited %s)", batch.number, batch.stage, len(live), node,
                 sorted(batch.waited.values()))
        if self.stopping.is_set():
            raise Unavailable("draining")

        def done(w: Work, o: Outcome) -> None:
            advanced.add(w.job_id)
            if o.stalled:
                with self._lock:  # until its Status shows it moving again, the other replicas take the work
                    self.suspects.mark(node, batch.stage, self.cfg.stall_timeout_s)
            elif not o.ok and o.code == "UNAVAILABLE":
                with self._lock:  # until it answers Status again, the service's other replicas take the work
                    if node not in self.down and any(
                            n != node and self.engine.replicas[n].service == self.engine.replicas[node].service
                            for n in self.nodes):
                        log.warning("replica %s answered UNAVAILABLE (%s); its jobs go to the other replicas",
                                    node, o.message)
                        self.down.add(node)
            self._advance(w, batch, o, node)

        try:
            ids = {w.job_id for w in live}
            outcomes = self.engine.run_batch(batch.stage, [c for c in ([w for w in r if w.job_id in ids]
                                                                       for r in rounds) if c],
                                             self._progress, self._abort.is_set, on_done=done, node=node,
                                             stall_timeout_s=self.cfg.stall_timeout_s)
        except Cancelled:  # the drain stopped the batch
            raise Unavailable("draining") from None
        with self._lock:
            self.batch_log.append({"number": batch.number, "stage": batch.stage, "group": batch.group, "replica": node,
                                   "jobs": [w.job_id for w in live], "size": len(live), "t0": t0, "t1": time.time()})
        unavailable = sum(not o.ok and o.code == "UNAVAILABLE" and not o.stalled for o in outcomes.values())
        if unavailable == len(live):
            self.stopping.wait(min(5.0, 1.0 * max(w.unavailable for w in live)))  # the stage is down: back off

    def _advance(self, w: Work, batch: Batch, o: Outcome, node: str) -> None:
        stage = batch.stage
        if w.cancelled.is_set():
            self._finish(w, CANCELLED, "CANCELLED", f"cancelled during the {stage} stage")
            return
        if o.ok:
            r = o.result
            self._durable(self.store.add_run, w.job_id, render_pb2.StageRun(
                stage=stage, wall_s=r.wall_s, timing=r.timing, batch=batch.number, batch_size=len(batch.job_ids),
                waited_batches=batch.waited.get(w.job_id, 0), replica=node,
                cached_steps=r.extra.get("cached_steps", 0), sparse_steps=r.extra.get("sparse_steps", 0)))
            nxt = next_stage(stage, w.plan)
            if nxt is None:
                size = w.output.stat().st_size
                self._finish(w, SUCCEEDED, output=str(w.output), output_bytes=size)
                return
            self._durable(self.store.set_stage, w.job_id, nxt)
            with self._lock:
                self.planner.add(w.job_id, nxt)
                self._lock.notify_all()  # its next stage's group may be idle: the dispatcher starts it now
            return
        if o.code == "RESOURCE_EXHAUSTED" and BUSY_HINT in o.message:
            left = w.deadline - time.time()
            if left > 0:
                delay = min(BUSY_MAX_S, BUSY_FIRST_S * 2 ** min(w.busy, 16), left)
                w.busy += 1
                self._progress(w.job_id, common_pb2.Progress(
                    stage=stage, phase="waiting",
                    message=f"waiting for the {stage} stage (busy): {o.message}; try {w.busy + 1} in {delay:.1f} s"))
                with self._lock:
                    self.later[w.job_id] = (time.monotonic() + delay, stage)
                    self._lock.notify_all()
                return
            self._finish(w, FAILED, "DEADLINE_EXCEEDED",
                         f"the {stage} stage stayed busy until the job's deadline ({self.cfg.job_deadline_s:g} s after "
                         f"its submission, --job-deadline-s): {o.message}")
            return
        if o.stalled:
            failure = stall_verdict(w.stalled_on, node, stage, self.cfg.stall_timeout_s)
            if failure is not None:
                self._finish(w, FAILED, "UNAVAILABLE", failure)
                return
            w.stalled_on.append(node)
            self._progress(w.job_id, common_pb2.Progress(
                stage=stage, phase="retrying",
                message=f"{o.message}; the {stage} stage runs once more, on another replica while there is one"))
            with self._lock:
                self.planner.add(w.job_id, stage)
                self._lock.notify_all()
            return
        if o.code == "UNAVAILABLE" and w.unavailable < self.cfg.stage_retries:
            w.unavailable += 1
            self._progress(w.job_id, common_pb2.Progress(
                stage=stage, phase="retrying",
                message=f"the {stage} stage is unavailable ({o.message}); retry {w.unavailable} of "
                        f"{self.cfg.stage_retries}"))
            with self._lock:
                self.planner.add(w.job_id, stage)
                self._lock.notify_all()
            return
        self._finish(w, FAILED, o.code, o.message)

    def _finish(self, w: Work, state: int, code: str = "", message: str = "", output: str = "",
                output_bytes: int = 0) -> None:
        with self._lock:
            self.works.pop(w.job_id, None)
            self.later.pop(w.job_id, None)
            self.planner.remove(w.job_id)

        # The end and what it does to the files are one step for every reader (the store's lock): whoever sees this
        # job succeeded also sees the older jobs it pushed past the retention limits gone; whoever sees it failed or
        # cancelled finds no MP4 of it. A job that had already ended keeps its output.
        def end() -> bool:
            with self.store.changed:
                done = self.store.finish(w.job_id, state, code, message, output, output_bytes)
                if done:
                    self._expire()
                if state != SUCCEEDED and self.store.get(w.job_id).state != SUCCEEDED:
                    w.output.unlink(missing_ok=True)
                    latents_path(w.output).unlink(missing_ok=True)
                return done

        finished = self._durable(end)
        if finished:
            log.info("job %s %s%s", w.job_id, render_pb2.JobState.Name(state), f": {code} {message}" if code else "")

    def _expire(self) -> None:
        c = self.cfg
        for path in self.store.expire(c.keep_jobs, c.keep_bytes, c.keep_age_s):
            Path(path).unlink(missing_ok=True)

    # ---- views --------------------------------------------------------------------------------------------------
    def suspect(self, node: str) -> str:
        """Why replica `node` is out of rotation after a stall ("" when it is not)."""
        with self._lock:
            return self.suspects.reason(node)

    def group_names(self) -> list[str]:
        """The resource groups as "encoder+dit+decoder" names, in stage order."""
        with self._lock:
            return ["+".join(g) for g in self.groups]

    def counts(self) -> dict[int, int]:
        return self.store.counts()

    def snapshot(self, owner: str | None = None) -> dict:
        """What the web page shows: jobs (queued, running, recent finished) and the recent batches. With `owner`,
        only that principal's jobs, and in each batch only its job ids (every batch keeps its size)."""
        active = self.store.list([QUEUED, RUNNING], limit=500, oldest_first=True, owner=owner)
        recent = self.store.list([SUCCEEDED, FAILED, CANCELLED], limit=50, owner=owner)
        pos = self.store.queue_positions()
        with self._lock:
            running = {b.number: {"number": b.number, "stage": b.stage, "group": b.group, "jobs": list(b.job_ids),
                                  "size": len(b.job_ids), "t0": t0} for b, t0 in self.running.values()}
            batches = list(self.batch_log)[-40:]
        running = sorted(running.values(), key=lambda b: b["number"])
        if owner is not None:
            mine = self.store.owned({j for b in running + batches for j in b["jobs"]}, owner)
            running, batches = ([{**b, "jobs": [j for j in b["jobs"] if j in mine]} for b in bs]
                                for bs in (running, batches))
        groups = self.group_names()
        return {"jobs": [r.info(pos.get(r.id, 0)) for r in active + recent], "running": running, "batches": batches,
                "batches_total": self.planner.batches, "groups": groups}
