"""Lifecycle RPCs (Load, Unload, Warmup, Status) shared by every stage's servicer, and the Upload RPC of the services
that take reference files."""

from __future__ import annotations

from h3.v1 import common_pb2
from stagekit.errors import FailedPrecondition
from stagekit.server import abort_on_error
from stagekit.runtime import StageRuntime
from stagekit.uploads import UploadStore


def timing_pb(t: dict) -> common_pb2.Timing:
    """A job's timing dict (queue_s, load_s, ...) as the Timing message every work RPC returns."""
    return common_pb2.Timing(**{k: v for k, v in t.items() if k in common_pb2.Timing.DESCRIPTOR.fields_by_name})


class LifecycleMixin:
    """Mixed into each generated servicer class; needs `self.runtime` and `self.describe()`."""

    runtime: StageRuntime

    def describe(self) -> dict:
        """Stage-specific Status fields (devices, weights, variant, kernels, embedded_model)."""
        return {}

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
            residency=rt.cfg.residency, kernels=kernels, jobs_done=snap.jobs_done, **d)


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
