"""The render service's engine: runs one stage batch against the stage services beside it.

The render service is built like every stage (`stagekit.stage.run_stage`): its "engine" holds no weights (load and
unload are no-ops) and each runtime job is one *stage batch* — up to `--max-batch` render jobs sent to one stage at
once, so the stage serves them in one residency. The stage calls are the stage-level library (`client.pipeline`)
and its one wire codec; tensors move render service <-> stage over loopback and stay in this process between
stages (`Work.tensors`), never in the user's client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from client.pipeline import (StageResult, decode, encode, encode_image, encode_reference, reference_tensors,
                             sample)
from client.stubs import StageClients
from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import (AUDIO_LATENTS, SAMPLE_INPUTS, TEXT_STATES, TEXT_TAGS, VIDEO_LATENTS, RenderSpec,
                                 keyframe_tensor)
from stagekit.errors import Cancelled, status_for


@dataclass
class Work:
    """A render job in flight: its request, the tensors between its stages, and how to stop its stage call."""

    job_id: str
    request: render_pb2.RenderRequest
    spec: RenderSpec
    output: Path                      # where the decoder's MP4 lands (renamed into place once verified)
    keyframe_files: list[tuple[str, Path]] = field(default_factory=list)  # fl2va: (anchor, stored image), in order
    reference_files: list[Path | None] = field(default_factory=list)  # ref2va: each reference's stored file
    deadline: float = float("inf")    # unix time until which a busy stage is waited out (--job-deadline-s)
    tensors: dict = field(default_factory=dict)
    unavailable: int = 0              # stage calls refused with UNAVAILABLE so far (retried up to --stage-retries)
    busy: int = 0                     # stage calls refused as busy so far (each waited out with a longer backoff)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _call: object = None
    _aborted: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def keyframes(self) -> list[tuple[str, bytes]]:
        """fl2va keyframe images in packed order (first, then last), read from the job store's files when a stage
        needs them (a queued job holds none in memory)."""
        return [(a, path.read_bytes()) for a, path in self.keyframe_files]

    @property
    def partition(self) -> str:
        """The DiT partition the job needs: ref2va for references, fl2va for text and keyframes."""
        return "ref2va" if self.request.references else "fl2va"

    def set_call(self, call) -> None:
        with self._lock:
            self._call = call
            if self.cancelled.is_set() or self._aborted:
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


@dataclass
class Outcome:
    ok: bool
    result: StageResult | None = None
    code: str = ""                    # gRPC status name when not ok
    message: str = ""


ProgressSink = Callable[[str, common_pb2.Progress], None]


def _merge(results: list[StageResult]) -> StageResult:
    """Several calls of one stage (two keyframes) as one result: walls and timing phases add up."""
    if len(results) == 1:
        return results[0]
    t = common_pb2.Timing()
    for r in results:
        for f in common_pb2.Timing.DESCRIPTOR.fields:
            setattr(t, f.name, getattr(t, f.name) + getattr(r.timing, f.name))
    return StageResult(results[0].stage, sum(r.wall_s for r in results), t)


def run_keyframes(c: StageClients, w: Work, progress, on_call) -> StageResult:
    """Each keyframe -> its VAE latent (the decoder's VAE encoder, at the render size); each reference -> its
    latents (the decoder's video / audio VAE encoders, on the model's rates)."""
    results = []
    for anchor, img in w.keyframes():
        lat, r = encode_image(c, img, w.spec.width, w.spec.height, w.job_id, progress, on_call=on_call)
        w.tensors[keyframe_tensor(anchor)] = lat
        results.append(r)
    for i, ref in enumerate(w.request.references):
        lat, r = encode_reference(c, ref, w.spec.frames, w.job_id, progress, on_call=on_call,
                                  source=w.reference_files[i] if i < len(w.reference_files) else None)
        w.tensors.update(reference_tensors(i, lat, ref.kind))
        results.append(r)
    return _merge(results)


def run_encoder(c: StageClients, w: Work, progress, on_call) -> StageResult:
    """Prompt (+ the same keyframe images or references, shown to the vision tower) -> text states (+ tags)."""
    images = [img for _, img in w.keyframes()]
    if w.request.references:
        states, tags, r = encode(c, w.spec.prompt, w.job_id, progress, with_tags=True, on_call=on_call,
                                 references=w.request.references, frames=w.spec.frames, sources=w.reference_files)
        w.tensors[TEXT_TAGS] = tags
    elif images:
        states, tags, r = encode(c, w.spec.prompt, w.job_id, progress, keyframes=images, width=w.spec.width,
                                 height=w.spec.height, with_tags=True, on_call=on_call)
        w.tensors[TEXT_TAGS] = tags
    else:
        states, r = encode(c, w.spec.prompt, w.job_id, progress, on_call=on_call)
    w.tensors[TEXT_STATES] = states
    return r


def run_dit(c: StageClients, w: Work, progress, on_call) -> StageResult:
    extra = {k: t for k, t in w.tensors.items() if k in SAMPLE_INPUTS and k != TEXT_STATES}
    loras = [(lo.name, lo.strength if lo.HasField("strength") else 1.0) for lo in w.request.loras]
    video, audio, r = sample(c, w.spec, w.tensors[TEXT_STATES], w.job_id, progress, extra=extra or None,
                             loras=loras, on_call=on_call)
    w.tensors = {VIDEO_LATENTS: video, AUDIO_LATENTS: audio}  # the conditioning is spent
    return r


def run_decoder(c: StageClients, w: Work, progress, on_call) -> StageResult:
    r = w.request
    res = decode(c, w.spec, w.tensors[VIDEO_LATENTS], w.tensors[AUDIO_LATENTS], w.output, w.job_id, progress,
                 crf=r.crf, upscale=(r.upscale_width, r.upscale_height), on_call=on_call)
    w.tensors = {}
    return res


STAGE_CALLS = {"keyframes": run_keyframes, "encoder": run_encoder, "dit": run_dit, "decoder": run_decoder}


class RenderEngine:
    """`Engine` of the render service (stagekit.runtime): no weights; `run` serves one stage batch."""

    name = "render"
    device_work = False  # nothing to run on a device: never moved into a device worker, no memory budget

    def __init__(self, clients: StageClients):
        self.clients = clients
        self.dit_partition = "fl2va"  # the partition the last DiT batch ended on

    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def resident_bytes(self) -> int:
        return 0

    def _one(self, stage: str, w: Work, sink: ProgressSink) -> Outcome:
        def progress(p: common_pb2.Progress) -> None:
            p.stage = stage  # the render stage (the decoder reports its keyframe work as "decoder")
            sink(w.job_id, p)

        try:
            return Outcome(True, STAGE_CALLS[stage](self.clients, w, progress, w.set_call))
        except grpc.RpcError as e:
            return Outcome(False, code=e.code().name, message=e.details() or str(e.code()))
        except Exception as e:  # noqa: BLE001 - recorded on the job
            code, msg = status_for(e)
            return Outcome(False, code=code.name, message=f"{stage}: {msg}")

    def run(self, stage: str, inputs: dict, ctx) -> dict:
        """Every job of the batch calls the stage at once (the stage queues and serves them in one residency).
        A drain with --cancel-on-term stops the calls and leaves the jobs to be retried after the restart."""
        works: list[Work] = inputs["works"]
        sink: ProgressSink = inputs["progress"]
        outcomes = {}
        for group in self._groups(stage, works):
            with ThreadPoolExecutor(max_workers=len(group), thread_name_prefix=f"batch-{stage}") as pool:
                futs = {pool.submit(self._one, stage, w, sink): w for w in group}
                while True:
                    done, pending = wait(futs, timeout=0.2)
                    if not pending:
                        break
                    if ctx.job is not None and ctx.job.should_cancel():
                        for w in works:
                            w.abort()
                if ctx.job is not None and ctx.job.should_cancel():
                    raise Cancelled("render: the batch was stopped (service draining); its jobs are retried after "
                                    "restart")
                outcomes.update({w.job_id: f.result() for f, w in futs.items()})
        return {"outcomes": outcomes, "t": time.time()}

    def _groups(self, stage: str, works: list[Work]) -> list[list[Work]]:
        """The batch's calls, in groups sent one after the other. A DiT batch goes partition by partition (the one
        the DiT ran last first), so a mixed batch swaps the DiT's weights at most once (docs/references.md)."""
        if stage != "dit":
            return [works]
        parts = sorted({w.partition for w in works}, key=lambda p: p != self.dit_partition)
        groups = [[w for w in works if w.partition == p] for p in parts]
        self.dit_partition = parts[-1]
        return groups
