"""The render service's engine: runs one stage batch against the stage services beside it.

A *stage batch* is up to `--max-batch` render jobs sent to one stage at once, so the stage serves them in one
residency; the dispatcher (render_svc/dispatcher.py) runs one batch at a time per resource group, each in its own
thread, and hears of each job's outcome the moment its stage call ends (so the job moves on to its next stage while
the rest of the batch still runs). The engine is the executor: it runs the assignment it is given on the replica it
is given and decides nothing. The stage calls are the stage-level library (`render_svc/stage_calls.py`) and its one wire codec; tensors move render service <-> stage over
loopback and stay in this process between stages (`Work.tensors`), never in the user's client.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import (AUDIO_LATENTS, ENCODED_REFERENCE_AUDIO, EXTEND, EXTEND_REENCODE, TAIL_AUDIO,
                                 GUIDE_FRAMES, TAIL_VIDEO, SAMPLE_INPUTS, TEXT_STATES, TEXT_TAGS,
                                 VIDEO_LATENTS, RenderSpec, guide_tensor, keyframe_tensor, needed_partition,
                                 prompt_tensor, render_mode, spec_from_proto)
from minimax_h3.services import STAGES as SERVICES
from minimax_h3.services import Endpoints, StageClients
from render_svc.extend import load_guide, save_latents
from render_svc.graph import GRAPH
from render_svc.planner import QueuedJob, batch_rounds
from render_svc.stage_calls import (StageResult, decode, encode, encode_image, encode_reference, encode_tail,
                                    reference_tensors, sample)
from render_svc.stalls import StallWatch
from stagekit.channels import replicas_of
from stagekit.errors import Cancelled, StageError, error_for, status_for

log = logging.getLogger("render_svc")


@dataclass
class Work:
    """A render job in flight: its request, the tensors between its stages, and how to stop its stage call."""

    job_id: str
    request: render_pb2.RenderRequest
    spec: RenderSpec
    output: Path                      # where the decoder's MP4 lands (renamed into place once verified)
    keyframe_files: list[tuple[str, Path | bytes]] = field(default_factory=list)  # fl2va: (anchor, image), in order
    reference_files: list[Path | None] = field(default_factory=list)  # ref2va: each reference's stored file
    guide_files: list[dict[str, Path]] = field(default_factory=list)  # each guide's stored "image" / "audio" files
    source: Path | None = None        # an extension: its source job's MP4 (stored copy), which opens its MP4
    guide_file: Path | None = None    # ... and its guide cut from the source's kept latents (None: EncodeTail)
    keep_latents: bool = False        # keep the final latents beside the MP4 (the render service: for extensions)
    deadline: float = float("inf")    # unix time until which a busy stage is waited out (--job-deadline-s)
    tensors: dict = field(default_factory=dict)
    unavailable: int = 0              # stage calls refused with UNAVAILABLE so far (retried up to --stage-retries)
    busy: int = 0                     # stage calls refused as busy so far (each waited out with a longer backoff)
    stalled_on: list[str] = field(default_factory=list)  # replicas where its stage calls stalled (render_svc/stalls.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _call: object = None
    _aborted: bool = False
    _stalled: bool = False            # the watchdog stopped its current stage call
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def keyframes(self) -> list[tuple[str, bytes]]:
        """fl2va keyframe images in packed order (first, then last), read from the job store's files when a stage
        needs them (a queued job holds none in memory)."""
        return [(a, img if isinstance(img, bytes) else img.read_bytes()) for a, img in self.keyframe_files]

    @property
    def mode(self) -> str:
        """t2va, fl2va (keyframes or guides), ref2va (references) or an extension's: which route of the render graph
        the job walks."""
        extension = "" if self.source is None else EXTEND if self.guide_file is not None else EXTEND_REENCODE
        return render_mode(bool(self.keyframe_files or self.request.guides), bool(self.request.references), extension)

    @property
    def plan(self) -> tuple[str, ...]:
        """The render stages the job goes through, in order."""
        return GRAPH.route(self.mode)

    @property
    def first_stage(self) -> str:
        """Keyframes, references and guides are encoded first (`keyframes`); a text render starts at the encoder."""
        return self.plan[0]

    @property
    def partition(self) -> str:
        """The DiT partition the job needs: ref2va for references, fl2va for text and keyframes."""
        return needed_partition(bool(self.request.references))

    def queued(self, waited: int = 0) -> QueuedJob:
        """The job as the scheduler sees it waiting (render_svc/planner.py): its waits, its DiT partition and LoRAs."""
        return QueuedJob(self.job_id, waited, self.partition, lora_key(self))

    def set_call(self, call) -> None:
        with self._lock:
            self._call = call
            if self.cancelled.is_set() or self._aborted or self._stalled:
                call.cancel()

    def cancel(self) -> None:
        """The user's cancel: stop the running stage call; the job ends CANCELLED."""
        self.cancelled.set()
        self.abort()

    def abort(self) -> None:
        """Stop the running stage call without deciding the job's fate (the service is draining)."""
        with self._lock:
            self._aborted = True
            if self._call is not None:
                self._call.cancel()

    def stop_stalled(self) -> None:
        """The watchdog's stop: the replica made no progress; the job's stage runs once more elsewhere."""
        with self._lock:
            self._stalled = True
            if self._call is not None:
                self._call.cancel()

    def begin_call(self) -> None:
        """The job's next stage calls are about to start: no watchdog stop stands against them."""
        with self._lock:
            self._stalled = False
            self._call = None

    @property
    def stalled(self) -> bool:
        return self._stalled


@dataclass
class Outcome:
    ok: bool
    result: StageResult | None = None
    code: str = ""                    # gRPC status name when not ok
    message: str = ""
    stalled: bool = False             # the watchdog stopped the call: its replica made no progress

    def error(self) -> StageError:
        """A failed outcome as the error class of its status."""
        return error_for(grpc.StatusCode[self.code], f"render failed: {self.code}: {self.message}")


ProgressSink = Callable[[str, common_pb2.Progress], None]


# What a stage's answer about the render service itself means for the operator: its token, its principal, the
# address it was given. The user's job fails FAILED_PRECONDITION with this, never with the stage's code as if the
# user had sent a wrong token (`stage_failure`).
OPERATOR_FIXES = {
    grpc.StatusCode.UNAUTHENTICATED: "refused the render service's token: give the render service the {service} "
                                     "stage's token (--stage-token / H3_RENDER_STAGE_TOKEN; default: the render "
                                     "service's own token)",
    grpc.StatusCode.PERMISSION_DENIED: "does not let the render service's principal make this call: give the render "
                                       "service a stage token the {service} stage allows it (--stage-token)",
    grpc.StatusCode.UNIMPLEMENTED: "at {endpoint} does not serve the {service} calls: point the render service's "
                                   "--{service} at the {service} stage, of this version",
}


def stage_failure(stage: str, endpoint: str, e: grpc.RpcError) -> Outcome:
    """The outcome of a render stage whose call failed with `e`: the stage's own status and message, except (1) a
    refusal of the render service's own credentials or calls (OPERATOR_FIXES), which is FAILED_PRECONDITION naming
    the stage and what the operator fixes, logged; (2) UNKNOWN (a stage that failed outside its own error handling),
    which is INTERNAL."""
    code, details = e.code(), e.details() or e.code().name
    service = GRAPH.service_of(stage)
    fix = OPERATOR_FIXES.get(code)
    if fix is not None:
        what = fix.format(service=service, endpoint=endpoint)
        message = (f"the render service cannot use its {service} stage: the stage {what} (it answered {code.name}: "
                   f"{details})")
        log.error("%s", message)
        return Outcome(False, code=grpc.StatusCode.FAILED_PRECONDITION.name, message=message)
    if code == grpc.StatusCode.UNKNOWN:
        return Outcome(False, code=grpc.StatusCode.INTERNAL.name, message=f"{service} stage failed: {details}")
    return Outcome(False, code=code.name, message=details)


def _merge(results: list[StageResult]) -> StageResult:
    """Several calls of one stage (two keyframes) as one result: walls and timing phases add up; `extra["calls"]`
    holds each call's own extra, in order."""
    if len(results) == 1:
        return results[0]
    t = common_pb2.Timing()
    for r in results:
        for f in common_pb2.Timing.DESCRIPTOR.fields:
            setattr(t, f.name, getattr(t, f.name) + getattr(r.timing, f.name))
    return StageResult(results[0].stage, sum(r.wall_s for r in results), t, {"calls": [r.extra for r in results]})


def run_keyframes(c: StageClients, w: Work, progress, on_call, on_bytes) -> StageResult:
    """Each keyframe -> its VAE latent (the decoder's VAE encoder, at the render size); each reference -> its
    latents (the decoder's video / audio VAE encoders, on the model's rates); an extension whose source's latents are
    gone -> its guide, re-encoded from the source's MP4 (EncodeTail)."""
    if w.source is not None:
        w.tensors[TAIL_VIDEO], w.tensors[TAIL_AUDIO], r = encode_tail(c, w.spec, w.source, w.job_id, progress,
                                                                         on_call=on_call)
        return r
    results = []
    for anchor, img in w.keyframes():
        lat, r = encode_image(c, img, w.spec.width, w.spec.height, w.job_id, progress, on_call=on_call,
                              on_bytes=on_bytes)
        w.tensors[keyframe_tensor(anchor)] = lat
        results.append(r)
    for i, ref in enumerate(w.request.references):
        lat, r = encode_reference(c, ref, w.spec.frames, w.job_id, progress, on_call=on_call,
                                  source=w.reference_files[i] if i < len(w.reference_files) else None,
                                  on_bytes=on_bytes, ref_image_size=w.spec.ref_image_size, width=w.spec.width,
                                  height=w.spec.height)
        w.tensors.update(reference_tensors(i, lat, ref.kind))
        results.append(r)
    for g, guide in enumerate(w.request.guides):  # an image fitted to the canvas, a sound on the model's rates
        files = w.guide_files[g] if g < len(w.guide_files) else {}
        if guide.HasField("image"):
            img = guide.image.data or files["image"].read_bytes()
            w.tensors[guide_tensor(g, "image")], r = encode_image(c, img, w.spec.width, w.spec.height, w.job_id,
                                                                   progress, on_call=on_call, on_bytes=on_bytes)
            results.append(r)
        if guide.HasField("audio"):
            lat, r = encode_reference(c, guide.audio, w.spec.frames, w.job_id, progress, on_call=on_call,
                                      source=files.get("audio"), on_bytes=on_bytes)
            w.tensors[guide_tensor(g, "audio")] = lat[ENCODED_REFERENCE_AUDIO]
            results.append(r)
    if w.request.guides:
        w.tensors[GUIDE_FRAMES] = torch.tensor([g.frame for g in w.request.guides], dtype=torch.int64)
    return _merge(results)


def run_encoder(c: StageClients, w: Work, progress, on_call, on_bytes) -> StageResult:
    """Prompt (+ the same keyframe images or references, shown to the vision tower) -> text states (+ tags)."""
    images = [img for _, img in w.keyframes()]
    if w.request.references:
        states, tags, r = encode(c, w.spec.prompt, w.job_id, progress, with_tags=True, on_call=on_call,
                                 references=w.request.references, frames=w.spec.frames, sources=w.reference_files,
                                 on_bytes=on_bytes, width=w.spec.width, height=w.spec.height,
                                 ref_image_size=w.spec.ref_image_size)
        w.tensors[TEXT_TAGS] = tags
    elif images:
        states, tags, r = encode(c, w.spec.prompt, w.job_id, progress, keyframes=images, width=w.spec.width,
                                 height=w.spec.height, with_tags=True, on_call=on_call, on_bytes=on_bytes)
        w.tensors[TEXT_TAGS] = tags
    else:
        states, r = encode(c, w.spec.prompt, w.job_id, progress, on_call=on_call, on_bytes=on_bytes)
    w.tensors[TEXT_STATES] = states
    results = [r]
    for i, prompt in enumerate(w.spec.more_prompts, 1):  # a long render's later prompts, one call each
        w.tensors[prompt_tensor(i)], r = encode(c, prompt, w.job_id, progress, on_call=on_call, on_bytes=on_bytes)
        results.append(r)
    return _merge(results)


def run_dit(c: StageClients, w: Work, progress, on_call, on_bytes) -> StageResult:
    if w.guide_file is not None:  # an extension's guide, cut from its source's kept latents at Submit
        w.tensors.update(load_guide(w.guide_file))
    extra = {k: t for k, t in w.tensors.items() if k in SAMPLE_INPUTS and k != TEXT_STATES}
    loras = [(lo.name, lo.strength if lo.HasField("strength") else 1.0) for lo in w.request.loras]
    video, audio, r = sample(c, w.spec, w.tensors[TEXT_STATES], w.job_id, progress, extra=extra or None,
                             loras=loras, on_call=on_call, on_bytes=on_bytes)
    w.tensors = {VIDEO_LATENTS: video, AUDIO_LATENTS: audio}  # the conditioning is spent
    if w.keep_latents:  # kept with the job: what an extension of it continues from
        save_latents(w.output, video, audio, w.spec)
    return r


def run_decoder(c: StageClients, w: Work, progress, on_call, on_bytes) -> StageResult:
    r = w.request
    res = decode(c, w.spec, w.tensors[VIDEO_LATENTS], w.tensors[AUDIO_LATENTS], w.output, w.job_id, progress,
                 crf=r.crf, upscale=(r.upscale_width, r.upscale_height), on_call=on_call, on_bytes=on_bytes,
                 prefix=w.source)
    w.tensors = {}
    return res


def lora_key(w: Work) -> tuple:
    """The LoRAs a job samples with, as a comparable key (names and strengths, in order)."""
    return tuple((lo.name, lo.strength if lo.HasField("strength") else 1.0) for lo in w.request.loras)


STAGE_CALLS = {"keyframes": run_keyframes, "encoder": run_encoder, "dit": run_dit, "decoder": run_decoder}


OutcomeSink = Callable[[Work, Outcome], None]


@dataclass
class Replica:
    """One replica of a stage service, with a channel of its own: a job's stage call (its uploads and its work)
    reaches exactly this replica."""

    node: str                          # "dit" for a lone replica, "dit/<name>" for one of several
    service: str                       # encoder | dit | decoder
    address: str
    clients: StageClients              # a channel to this replica alone

    def close(self) -> None:
        self.clients.close()


def make_replicas(endpoints: Endpoints, security=None) -> dict[str, Replica]:
    """One Replica per address each stage endpoint lists (`stagekit.channels.replicas_of`), in stage order."""
    out = {}
    for service in SERVICES:
        for name, addr in replicas_of(endpoints.of(service)):
            node = f"{service}/{name}" if name else service
            out[node] = Replica(node, service, addr, StageClients(Endpoints(**{service: addr}), security))
    return out


class RenderEngine:
    """Runs stage batches against the stage services beside it (one batch per resource group at a time). `clients`
    reaches every stage (a list endpoint balanced by gRPC: Submit-time questions, the web page); `replicas` are the
    work channels, one per replica (default: one per stage, `clients` itself)."""

    def __init__(self, clients: StageClients, replicas: dict[str, Replica] | None = None):
        self.clients = clients
        self.replicas = replicas or {s: Replica(s, s, clients.endpoints.of(s), clients)
                                     for s in clients.endpoints.stages}

    def _one(self, stage: str, w: Work, sink: ProgressSink, rep: Replica, watch: StallWatch) -> Outcome:
        def progress(p: common_pb2.Progress) -> None:
            watch.touch()
            p.stage = stage  # the render stage (the decoder reports its keyframe work as "decoder")
            sink(w.job_id, p)

        try:
            return Outcome(True, STAGE_CALLS[stage](rep.clients, w, progress, w.set_call, watch.touch))
        except Exception as e:  # noqa: BLE001 - recorded on the job
            if w.stalled:
                return Outcome(False, code=grpc.StatusCode.UNAVAILABLE.name, stalled=True,
                               message=f"replica {rep.node} made no progress on the {stage} stage for "
                                       f"{watch.timeout_s:g} s (--stall-timeout-s); the call was stopped")
            if isinstance(e, grpc.RpcError):
                return stage_failure(stage, rep.address, e)
            code, msg = status_for(e)
            return Outcome(False, code=code.name, message=f"{stage}: {msg}")

    def run_batch(self, stage: str, rounds: Sequence[Sequence[Work]], sink: ProgressSink,
                  stopped: Callable[[], bool] = lambda: False,
                  on_done: OutcomeSink | None = None, node: str = "",
                  stall_timeout_s: float = math.inf) -> dict[str, Outcome]:
        """Every job of the batch calls the stage (on replica `node`; default: the stage's first), round after round
        (`rounds`, as the scheduler sent them: render_svc/planner.py, `batch_rounds`), the jobs of a round at once:
        the stage queues and serves them in one residency. The outcome of each, by job id. `on_done(work, outcome)`
        hears of each job the moment its call ends (in the call's thread). Once `stopped()` (the service is
        draining) the calls are stopped and Cancelled is raised: the jobs whose call did not succeed are retried
        after the restart (`on_done` does not hear of them). Calls still open when the replica has sent nothing for
        `stall_timeout_s` are stopped, their outcomes `stalled` (render_svc/stalls.py)."""
        outcomes = {}
        rep = self.replicas[node] if node else next(r for r in self.replicas.values()
                                                    if r.service == GRAPH.service_of(stage))

        def call(w: Work, watch: StallWatch) -> Outcome:
            o = self._one(stage, w, sink, rep, watch)
            watch.touch()  # a call's end is progress: the stage moves on to the batch's next call
            if on_done is not None and (o.ok or not stopped()):
                on_done(w, o)
            return o

        for calls in rounds:
            watch = StallWatch(stall_timeout_s)
            for w in calls:
                w.begin_call()
            with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix=f"batch-{stage}") as pool:
                futs = {pool.submit(call, w, watch): w for w in calls}
                stalled = False
                while True:
                    done, pending = wait(futs, timeout=0.2)
                    if not pending:
                        break
                    if stopped():
                        for r in rounds:
                            for w in r:
                                w.abort()
                    elif not stalled and watch.stalled():
                        stalled = True
                        log.warning("replica %s sent nothing on the %s batch's %d open call(s) for %.0f s "
                                    "(--stall-timeout-s): stopping them", rep.node, stage, len(pending),
                                    watch.silent_s())
                        for f in pending:
                            futs[f].stop_stalled()
                if stopped():
                    raise Cancelled("render: the batch was stopped (service draining); its jobs are retried after "
                                    "restart")
                outcomes.update({w.job_id: f.result() for f, w in futs.items()})
        return outcomes


@dataclass
class RenderResult:
    output: Path
    stages: list[StageResult]  # in render order; a stage called several times for the job is one merged result

    @property
    def total_s(self) -> float:
        return sum(s.wall_s for s in self.stages)


def render_jobs(clients: StageClients, jobs: Sequence[tuple[render_pb2.RenderRequest, Path]],
                on_progress: Callable[[common_pb2.Progress], None] = lambda p: None) -> list[RenderResult | Outcome]:
    """The render service's orchestration without its job store and scheduler, for tools, benchmarks and tests that
    drive the stages themselves: the jobs go through the render stages in order, each stage called for all of them
    at once (one stage batch: the stage serves them in one residency). Each job's RenderResult, or the failed
    Outcome that ended it (a request the stages refuse fails with their INVALID_ARGUMENT)."""
    engine = RenderEngine(clients)
    works = [Work(f"job{i}", req, spec_from_proto(req.params), Path(out),
                  keyframe_files=[(a, img) for a, img in (("first", req.first_frame), ("last", req.last_frame)) if img])
             for i, (req, out) in enumerate(jobs)]
    done: dict[str, list[StageResult]] = {w.job_id: [] for w in works}
    failed: dict[str, Outcome] = {}
    for stage in GRAPH.stages:
        batch = [w for w in works if w.job_id not in failed and stage in w.plan]
        if not batch:
            continue
        by_id = {w.job_id: w for w in batch}
        rounds, _ = batch_rounds(stage, [w.queued() for w in batch])
        for job_id, o in engine.run_batch(stage, [[by_id[j] for j in r] for r in rounds],
                                          lambda _job_id, p: on_progress(p)).items():
            if o.ok:
                done[job_id].append(o.result)
            else:
                failed[job_id] = o
    return [failed.get(w.job_id) or RenderResult(w.output, done[w.job_id]) for w in works]


def render(clients: StageClients, request: render_pb2.RenderRequest, out_path: Path,
           on_progress: Callable[[common_pb2.Progress], None] = lambda p: None) -> RenderResult:
    """One job through `render_jobs`; a failed job raises the error class of its status (stagekit.errors), with
    its message."""
    (r,) = render_jobs(clients, [(request, out_path)], on_progress)
    if isinstance(r, Outcome):
        raise r.error()
    return r
