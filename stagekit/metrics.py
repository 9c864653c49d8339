"""Prometheus metrics for one stage process (`--metrics-port`).

Everything lives in the stage's own `CollectorRegistry` (never the library's
global default registry), so two stages in one process (tests) or a re-created
server never collide. What is exported, all prefixed `h3_`:

    h3_grpc_requests_total{method,code}        every finished RPC with the status code its client got (aborts,
                                               cancels, deadlines included); counted when the call is over
    h3_grpc_request_seconds{method}            handler time per RPC (stream RPCs: until the last message)
    h3_grpc_inflight{method}                   RPCs started and not yet counted (0: every call is counted)
    h3_bytes_total{direction,method}           tensor / file chunk payload bytes received ("in") and sent ("out")
    h3_job_phase_seconds{phase}                per-job breakdown from the job timing: queue, lease_wait, load,
                                               compute, transfer (the same numbers the RPC's Timing returns)
    h3_step_seconds                            per-step time from progress events that carry step_ms (DiT steps)
    h3_weight_load_seconds / h3_weight_unload_seconds / h3_lease_wait_seconds   residency swaps
    h3_queue_depth, h3_running, h3_resident, h3_jobs_done   read at scrape time: from a stage's runtime; the render
                                               service reports its queued / running / finished jobs
    h3_device_memory_bytes{kind}               the engine's resident bytes (kind="engine_resident"; on a GPU they live
                                               in the device worker, stagekit/device_worker.py)
    h3_stage_info{stage,residency,world_size,device}   constant 1

The HTTP endpoint (plain, no auth) binds `--metrics-host` (loopback unless asked) on `--metrics-port` (0 = a free
port); the bound port is printed and written to `<port_file>.metrics` when a port file is used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc import _server as grpc_server
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from stagekit.server import cannot_listen

log = logging.getLogger("stagekit.metrics")

# Seconds, from a cached prompt (ms) to a long render on a small card (an hour).
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                 1800.0, 3600.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASES = ("queue", "lease_wait", "load", "compute", "transfer")


def chunk_bytes(msg: Any) -> int:
    """Payload bytes of the TensorChunk / FileChunk a stage message carries (0 for anything else)."""
    list_fields = getattr(msg, "ListFields", None)
    if list_fields is None:
        return 0
    n = 0
    for fd, value in list_fields():
        if fd.message_type is not None and fd.message_type.name in ("TensorChunk", "FileChunk"):
            n += len(value.data)
    return n


class _GaugeCollector:
    """Values read from the process at scrape time (no background thread, never stale): a stage's runtime, or
    what the render service reports (`StageMetrics.report`)."""

    DOCS = {"h3_queue_depth": "jobs waiting in the stage queue", "h3_running": "1 while a job runs",
            "h3_resident": "1 while the weights are loaded", "h3_jobs_done": "jobs finished since start"}

    def __init__(self, metrics: "StageMetrics"):
        self.m = metrics

    def collect(self):
        if self.m.gauges is None:
            return
        values = self.m.gauges()
        for name, doc in self.DOCS.items():
            yield GaugeMetricFamily(name, doc, value=float(values.get(name, 0)))
        mem = GaugeMetricFamily("h3_device_memory_bytes",
                                "the engine's resident weight bytes",
                                labels=["kind"])
        mem.add_metric(["engine_resident"], float(values.get("engine_resident", 0)))
        yield mem


class StageMetrics:
    """The metrics of one stage process; `runtime.metrics` points here (observe_load / observe_unload)."""

    def __init__(self, stage: str, device: str = "cpu", runtime: Any = None):
        self.stage = stage
        self.device = device
        self.runtime = runtime
        self.gauges: Callable[[], dict[str, float]] | None = None  # the scrape-time values (_GaugeCollector.DOCS)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("h3_grpc_requests", "finished RPCs by method and status code",
                                ["method", "code"], registry=r)
        self.request_seconds = Histogram("h3_grpc_request_seconds", "RPC handling time", ["method"],
                                         buckets=STAGE_BUCKETS, registry=r)
        self.inflight = Gauge("h3_grpc_inflight", "RPCs being handled", ["method"], registry=r)
        self.bytes = Counter("h3_bytes", "tensor/file chunk payload bytes", ["direction", "method"], registry=r)
        self.phase_seconds = Histogram("h3_job_phase_seconds", "per-job time by phase (from the job timing)",
                                       ["phase"], buckets=STAGE_BUCKETS, registry=r)
        self.step_seconds = Histogram("h3_step_seconds", "time per sampling step (progress step_ms)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.load_seconds = Histogram("h3_weight_load_seconds", "weight load time", buckets=STAGE_BUCKETS, registry=r)
        self.unload_seconds = Histogram("h3_weight_unload_seconds", "weight unload time", buckets=STAGE_BUCKETS,
                                        registry=r)
        self.lease_wait_seconds = Histogram("h3_lease_wait_seconds", "wait for the device lease / budget room before a load",
                                            buckets=STAGE_BUCKETS, registry=r)
        self.info = Gauge("h3_stage_info", "constant 1, labelled with what this process serves",
                          ["stage", "residency", "world_size", "device"], registry=r)
        r.register(_GaugeCollector(self))
        self.port = 0
        self._httpd = None

    # ---- wiring -------------------------------------------------------------------------------
    def attach(self, runtime: Any) -> None:
        """A stage: the gauges read its runtime."""
        self.runtime = runtime
        runtime.metrics = self
        self.report(self._runtime_gauges, runtime.cfg.residency, runtime.group.world_size)

    def report(self, gauges: Callable[[], dict[str, float]], residency: str = "", world_size: int = 1) -> None:
        """The scrape-time values (`h3_queue_depth`, `h3_running`, `h3_resident`, `h3_jobs_done`,
        `engine_resident` bytes; an absent one reads 0) and the process's `h3_stage_info` labels."""
        self.gauges = gauges
        self.info.labels(self.stage, residency, str(world_size), self.device).set(1)

    def _runtime_gauges(self) -> dict[str, float]:
        snap = self.runtime.snapshot()  # one moment, as Status reports it
        return {"h3_queue_depth": snap.queue_depth, "h3_running": int(snap.running),
                "h3_resident": int(snap.resident), "h3_jobs_done": snap.jobs_done,
                "engine_resident": self.resident_bytes()}

    def interceptor(self) -> "MetricsInterceptor":
        return MetricsInterceptor(self)

    def serve(self, host: str, port: int, port_file: str = "") -> int:
        """Start the HTTP endpoint; returns the bound port (written to `<port_file>.metrics`)."""
        addr = "" if host in ("0.0.0.0", "::") else host
        try:
            self._httpd, _ = start_http_server(port, addr=addr or "0.0.0.0", registry=self.registry)
        except OSError as e:
            raise cannot_listen(f"{host}:{port}", "--metrics-port", e.strerror or str(e)) from None
        self.port = self._httpd.server_address[1]
        if port_file:
            tmp = Path(port_file + ".metrics.tmp")
            tmp.write_text(str(self.port))
            tmp.replace(port_file + ".metrics")
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # ---- observations -------------------------------------------------------------------------
    def observe_load(self, seconds: float, lease_wait: float) -> None:
        self.load_seconds.observe(seconds)
        self.lease_wait_seconds.observe(lease_wait)

    def observe_unload(self, seconds: float) -> None:
        self.unload_seconds.observe(seconds)

    def observe_timing(self, timing: dict) -> None:
        """One finished job's breakdown (the dict behind the RPC's Timing); an absent phase took 0 s (e.g. no
        load when resident, no queue for a cached prompt), so every phase counts every job."""
        for phase in PHASES:
            self.phase_seconds.labels(phase).observe(float(timing.get(f"{phase}_s", 0.0)))

    def observe_progress(self, payload: dict) -> None:
        step_ms = payload.get("step_ms") or 0.0
        if step_ms > 0:
            self.step_seconds.observe(step_ms / 1000.0)

    def resident_bytes(self) -> int:
        rt = self.runtime
        try:  # the worker thread may be swapping the weights right now
            return int(rt.engine.resident_bytes()) if rt is not None and rt.resident else 0
        except Exception:  # noqa: BLE001 - a scrape never fails because of a concurrent unload
            return 0


def observed(runtime: Any, job: Any, on_event: Callable[[Any], Iterator]) -> Callable[[Any], Iterator]:
    """Wrap a servicer's `on_event` so progress steps and the finished job's timing reach the metrics."""

    def wrapped(ev):
        m = getattr(runtime, "metrics", None)
        if m is None or ev.kind != "done":
            if m is not None and ev.kind == "progress":
                m.observe_progress(ev.payload)
            yield from on_event(ev)
            return
        # Hold back the last message (the done event, which carries the finished Timing) until the timing is
        # observed: a client that has its result can scrape and find the job counted.
        last = held = object()
        for msg in on_event(ev):
            if last is not held:
                yield last
            last = msg
        m.observe_timing(job.timing)
        if last is not held:
            yield last

    return wrapped


# A client's deadline timer and the server's copy of the deadline (taken from the grpc-timeout header when the
# request arrived) differ by the request's transit time, so a client's deadline can reach the server a moment before
# the server's own copy expires: a call the client leaves this close to its deadline counts as DEADLINE_EXCEEDED.
DEADLINE_SLACK_S = 0.5


def client_left(context: grpc.ServicerContext) -> bool:
    """Whether the client cancelled, passed its deadline or disconnected before it had the server's status.

    While the handler runs this is `not context.is_active()`. Once the status is sent, `is_active()` is False
    either way, and grpc's sync server keeps the answer only on the call state that `is_active()` reads (set
    from the call's close event, which tells a clean end from a cancelled one); read it there. A cancel can look
    like a clean end of the request stream to the handler and be known only at close, hence the late read."""
    state = getattr(context, "_state", None)
    if state is not None and hasattr(state, "client"):
        return state.client == grpc_server._CANCELLED  # noqa: SLF001 - grpc has no public accessor (see above)
    return not context.is_active()


def left_code(context: grpc.ServicerContext) -> grpc.StatusCode:
    """What a client that left saw: DEADLINE_EXCEEDED when its deadline had come, else CANCELLED."""
    expired = context.time_remaining() <= DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC with the status code its client really got.

    A call is counted once it is over: grpc's termination callback, a moment after the client has its status
    (`h3_grpc_inflight` drops then too, so "inflight 0" means "all counted"). The code is the handler's own
    (`context.abort`/`set_code`; UNKNOWN for an exception, what grpc sends; else OK) unless the client left first
    (`client_left`): then CANCELLED or DEADLINE_EXCEEDED, however late the handler noticed — by an exception from
    the request stream, a response generator closed under it, a clean-looking end of the request stream, or not
    at all. Put it first in the interceptor list so refused calls (auth) count too.
    """

    def __init__(self, metrics: StageMetrics):
        self.m = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        m = self.m

        class _Call:
            """One RPC: its handler time is observed when the handler ends, its code counted once the call is over."""

            def __init__(self, context: grpc.ServicerContext):
                self.context = context
                self.t0 = time.monotonic()
                self.lock = threading.Lock()
                self.outcome: grpc.StatusCode | None = None  # the handler's own end, once it has ended
                self.timed = self.counted = False
                m.inflight.labels(method).inc()
                # False: the call is over already (the client left before the handler started).
                self.deferred = context.add_callback(self.terminated)

            def _observe_time(self) -> None:
                if not self.timed:
                    self.timed = True
                    m.request_seconds.labels(method).observe(time.monotonic() - self.t0)

            def _count(self) -> None:
                if self.counted:
                    return
                self.counted = True
                ctx = self.context
                code = left_code(ctx) if client_left(ctx) else (self.outcome or grpc.StatusCode.CANCELLED)
                m.requests.labels(method, code.name).inc()
                m.inflight.labels(method).dec()

            def handler_ended(self, fallback: grpc.StatusCode) -> None:
                with self.lock:
                    self._observe_time()
                    self.outcome = self.context.code() or fallback
                    if not self.deferred or client_left(self.context):
                        self._count()

            def terminated(self) -> None:
                with self.lock:  # a handler still blocked here is one whose client left: it is timed until now
                    self._observe_time()
                    self._count()

        def count_in(request_iterator):
            for msg in request_iterator:
                n = chunk_bytes(msg)
                if n:
                    m.bytes.labels("in", method).inc(n)
                yield msg

        def count_out(msg):
            n = chunk_bytes(msg)
            if n:
                m.bytes.labels("out", method).inc(n)
            return msg

        def unary_response(behavior):
            def run(request, context):
                call = _Call(context)
                try:
                    resp = behavior(request, context)
                except Exception:
                    call.handler_ended(grpc.StatusCode.UNKNOWN)
                    raise
                call.handler_ended(grpc.StatusCode.OK)
                return count_out(resp)
            return run

        def stream_response(behavior):
            def run(request, context):
                call = _Call(context)
                try:
                    for resp in behavior(request, context):
                        yield count_out(resp)
                except GeneratorExit:  # grpc stopped pulling: the client left
                    call.handler_ended(grpc.StatusCode.CANCELLED)
                    raise
                except Exception:
                    call.handler_ended(grpc.StatusCode.UNKNOWN)
                    raise
                call.handler_ended(grpc.StatusCode.OK)
            return run

        if handler.request_streaming and handler.response_streaming:
            fn, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        elif handler.response_streaming:
            fn, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        elif handler.request_streaming:
            fn, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            fn, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        if handler.request_streaming:  # the request messages' bytes counted as the handler reads them
            def behavior(request_iterator, context):
                return fn(count_in(request_iterator), context)
        else:
            behavior = fn
        wrapped = stream_response(behavior) if handler.response_streaming else unary_response(behavior)
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
