"""What every stage's servicer shares: a work RPC as a runtime job (`stream_job`), its status when it fails
(`job_status`), the lifecycle RPCs (Load, Unload, Warmup, Status), and the Upload RPC of the services that take
reference files."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from h3.v1 import common_pb2
from stagekit.errors import FailedPrecondition, restarts_group, status_for
from stagekit.file_identity import changes
from stagekit.server import abort_on_error
from stagekit.uploads import UploadStore

if TYPE_CHECKING:  # the render service uses UploadMixin and runs no stage runtime
    from stagekit.runtime import Job, JobEvent, StageRuntime


def timing_pb(t: dict) -> common_pb2.Timing:
    """A job's timing dict (queue_s, load_s, ...) as the Timing message every work RPC returns."""
    return common_pb2.Timing(**{k: v for k, v in t.items() if k in common_pb2.Timing.DESCRIPTOR.fields_by_name})


def stream_job(runtime: StageRuntime, job: Job, context: grpc.ServicerContext,
               on_event: Callable[[JobEvent], Iterator]) -> Iterator:
    """Submit `job`, then turn its events into response messages until done or failed.

    A client that disconnects or whose deadline passes cancels the job; the runtime notices at the next step
    boundary on every rank. When the call ends for any reason the job is closed: a queued job drops its inputs at
    once, and a result nobody will read is cleaned up (`Job.cleanup`).
    """
    remaining = context.time_remaining()
    if remaining is not None and remaining < 1e8:
        job.deadline = time.monotonic() + remaining
    context.add_callback(job.close)
    try:
        try:
            runtime.submit(job)
        except Exception as e:  # noqa: BLE001
            code, msg = status_for(e)
            context.abort(code, msg)
        while True:
            ev = job.events.get()
            if ev.kind == "error":
                code, msg = job_status(runtime, ev.payload)
                context.abort(code, msg)
            yield from on_event(ev)
            if ev.kind == "done":
                return
    finally:
        job.close()


def job_status(runtime: StageRuntime, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status of a failed job. On a multi-rank stage an unexpected error is a broken rank group (a dead or
    stuck rank, a failed collective): the runtime exits so torchrun restarts the group, so the caller sees
    UNAVAILABLE (retryable) rather than INTERNAL."""
    code, msg = status_for(exc)
    if runtime.group.world_size > 1 and restarts_group(exc):
        return grpc.StatusCode.UNAVAILABLE, (
            f"{runtime.engine.name}: rank group failed ({msg}); the stage is restarting its ranks, retry the job")
    return code, msg


class LifecycleMixin:
    """Mixed into each generated servicer class; needs `self.runtime`, whose engine has `describe()`."""

    runtime: StageRuntime

    def describe(self) -> dict:
        """Stage-specific Status fields (devices, weights, variant, kernels, embedded_model): the engine's."""
        return self.runtime.engine.describe()

    # `resident` in a lifecycle reply is the state the request left (a load that returned is resident, an unload
    # that returned is not), not a second read of the runtime, which an idle unload may have changed meanwhile.
    def Load(self, request, context):
        secs = abort_on_error(context, self.runtime.request, "load")
        return common_pb2.LifecycleReply(resident=True, seconds=secs, message="loaded")

    def Unload(self, request, context):
        secs = abort_on_error(context, self.runtime.request, "unload")
        return common_pb2.LifecycleReply(resident=False, seconds=secs, message="unloaded")

    def Warmup(self, request, context):
        """Load, through the worker thread like every lifecycle request (no engine has warm-up work of its own)."""
        secs = abort_on_error(context, self.runtime.request, "load")
        return common_pb2.LifecycleReply(resident=True, seconds=secs, message="warm")

    def Status(self, request, context):
        rt = self.runtime
        d = self.describe()
        kernels = [common_pb2.KernelChoice(op=op, kernel=k, reason=why) for op, k, why in d.pop("kernels", [])]
        snap = rt.snapshot()  # one moment: resident, lease holder, queue and running agree with each other
        return common_pb2.StageStatus(
            stage=rt.engine.name, health="NOT_SERVING" if snap.loading else "SERVING", resident=snap.resident,
            world_size=rt.group.world_size, memory_bytes=rt.engine.resident_bytes() if snap.resident else 0,
            queue_depth=snap.queue_depth, running=int(snap.running), lease_holder=snap.lease_holder,
            residency=rt.cfg.residency, kernels=kernels, jobs_done=snap.jobs_done,
            device_ids=rt.lease.ids if rt.lease is not None else [], host=socket.gethostname(),
            changed_weight_files=changes(snap.loaded_files), **d)


class UploadMixin:
    """`Upload(stream FileChunk) -> UploadReply` into `self.uploads` (stagekit/uploads.py); a servicer built without a
    store refuses uploads (its callers send references inline)."""

    uploads: UploadStore | None = None

    def Upload(self, request_iterator, context):
        return abort_on_error(context, self._receive, request_iterator)

    def _receive(self, chunks):
        if self.uploads is None:
            raise FailedPrecondition("this server keeps no uploads: send the reference inline")
        return self.uploads.receive(chunks)
