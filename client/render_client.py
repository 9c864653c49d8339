"""The thin client of the render service: one call renders, jobs are submitted, watched, fetched, cancelled.

Torch-free and numpy-free by design (tests/test_render_svc.py checks `sys.modules` of a rendering client): requests
are protobuf messages, the MP4 arrives as FileChunks checked by `stagekit.transport.FileReceiver`. Tensors never
come here; they move between the render service and the stages beside it.
"""

from __future__ import annotations

import hashlib

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from h3.v1 import common_pb2, render_pb2, render_pb2_grpc
from minimax_h3.contract import RenderSpec, spec_to_proto
from stagekit.channels import Security, open_channel
from stagekit.transport import FileReceiver
from stagekit.uploads import uploaded

TERMINAL = (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED)
EventFn = Callable[[render_pb2.RenderEvent], None]
RENDER_DEADLINE_S = 6 * 3600.0
RECONNECT_S = 300.0   # a render service unreachable (restarting) this long ends a follow: its UNAVAILABLE is raised


def state_name(state: int) -> str:
    return render_pb2.JobState.Name(state).removeprefix("JOB_").lower()


def render_request(spec: RenderSpec, *, crf: int = 0, loras=(), first_frame: bytes = b"", last_frame: bytes = b"",
                   upscale: tuple[int, int] = (0, 0), idempotency_key: str = "", label: str = "",
                   references=(), guides=()) -> render_pb2.RenderRequest:
    req = render_pb2.RenderRequest(crf=crf, first_frame=first_frame, last_frame=last_frame, upscale_width=upscale[0],
                                   upscale_height=upscale[1], idempotency_key=idempotency_key, label=label,
                                   references=list(references), guides=list(guides))
    spec_to_proto(spec, req.params)
    for name, strength in loras:
        req.loras.add(name=name, strength=strength)
    return req


class RenderClient:
    def __init__(self, target: str, security: Security | None = None):
        self.security = security or Security()
        self.channel = open_channel(target, self.security)
        self.stub = render_pb2_grpc.RendererStub(self.channel)
        self._sent: dict[str, str] = {}  # uploaded files: SHA-256 -> the digest the service named them by

    def _md(self):
        return self.security.metadata()

    def render(self, req: render_pb2.RenderRequest, out_path: Path, on_event: EventFn = lambda ev: None,
               timeout_s: float = RENDER_DEADLINE_S) -> render_pb2.JobInfo:
        """One call: events to `on_event`, the MP4 into `out_path` (renamed into place once verified). Returns the
        job's final info. A failed job raises its grpc.RpcError; the job outlives a broken connection: a service
        restart (UNAVAILABLE) once the job is queued switches to following it by id (`follow`)."""
        last, idx = None, 0
        try:
            with FileReceiver(Path(out_path)) as recv:
                for ev in self.stub.Render(req, timeout=timeout_s, metadata=self._md()):
                    if ev.WhichOneof("event") == "file":
                        recv.feed(ev.file)
                        continue
                    if ev.WhichOneof("event") == "job":
                        last = ev.job
                    idx = ev.index + 1
                    on_event(ev)
                recv.finish()
            return last
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or last is None:
                raise
        return self.follow(last.job_id, out_path, on_event, timeout_s, from_index=idx)

    def upload_references(self, req: render_pb2.RenderRequest, timeout_s: float = 600.0) -> None:
        """Send each reference and guide file of `req` in chunks (Upload) and name it by digest instead: the request
        itself stays small whatever the files (stagekit/uploads.py). A file this client sent already is not sent
        again."""
        guide_files = [getattr(g, p) for g in req.guides for p in ("image", "audio") if g.HasField(p)]
        for ref in [*req.references, *guide_files]:
            if not ref.data:
                continue
            key = hashlib.sha256(ref.data).hexdigest()
            if key not in self._sent:
                self._sent[key] = uploaded(self.stub.Upload, ref, timeout=timeout_s, metadata=self._md()).digest
            ref.ClearField("data")
            ref.digest = self._sent[key]

    def submit(self, req: render_pb2.RenderRequest) -> render_pb2.JobInfo:
        return self.stub.Submit(req, timeout=60, metadata=self._md())

    def extend(self, req: render_pb2.ExtendRequest) -> render_pb2.JobInfo:
        """A new job continuing a finished one (docs/long_video.md, "Extend")."""
        return self.stub.Extend(req, timeout=120, metadata=self._md())

    def get(self, job_id: str) -> render_pb2.JobInfo:
        return self.stub.Get(render_pb2.JobRef(job_id=job_id), timeout=30, metadata=self._md())

    def cancel(self, job_id: str) -> render_pb2.JobInfo:
        return self.stub.Cancel(render_pb2.JobRef(job_id=job_id), timeout=60, metadata=self._md())

    def list(self, states=(), limit: int = 0) -> list[render_pb2.JobInfo]:
        return list(self.stub.List(render_pb2.ListRequest(states=list(states), limit=limit), timeout=30,
                                   metadata=self._md()).jobs)

    def watch(self, job_id: str, from_index: int = 0, timeout_s: float = RENDER_DEADLINE_S
              ) -> Iterator[render_pb2.RenderEvent]:
        yield from self.stub.Watch(render_pb2.WatchRequest(job_id=job_id, from_index=from_index), timeout=timeout_s,
                                   metadata=self._md())

    def follow(self, job_id: str, out_path: Path, on_event: EventFn = lambda ev: None,
               timeout_s: float = RENDER_DEADLINE_S, from_index: int = 0) -> render_pb2.JobInfo:
        """Watch a submitted job to its end (events to `on_event`); fetch its MP4 if it succeeded. Returns its final
        info. A service restart (UNAVAILABLE) is waited out (up to RECONNECT_S) and the watch resumes where it
        broke."""
        idx, away = from_index, None
        while True:
            try:
                for ev in self.watch(job_id, idx, timeout_s):
                    away = None
                    idx = ev.index + 1
                    on_event(ev)
                break
            except grpc.RpcError as e:
                away = away or time.monotonic()
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() - away > RECONNECT_S:
                    raise
                time.sleep(1.0)
        last = self._retrying(self.get, job_id)
        if last.state == render_pb2.JOB_SUCCEEDED:
            self._retrying(self.fetch, job_id, out_path)
        return last

    @staticmethod
    def _retrying(fn, *args):
        """`fn(*args)`, retried while the service is unavailable (restarting), up to RECONNECT_S."""
        t0 = time.monotonic()
        while True:
            try:
                return fn(*args)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() - t0 > RECONNECT_S:
                    raise
                time.sleep(1.0)

    def fetch(self, job_id: str, out_path: Path, timeout_s: float = 3600.0) -> Path:
        with FileReceiver(Path(out_path)) as recv:
            for chunk in self.stub.Fetch(render_pb2.FetchRequest(job_id=job_id), timeout=timeout_s, metadata=self._md()):
                recv.feed(chunk)
            return recv.finish()

    def status(self) -> render_pb2.RenderStatus:
        return self.stub.Status(common_pb2.StatusRequest(), timeout=30, metadata=self._md())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RenderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
