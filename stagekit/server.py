"""The one server bootstrap all stages share.

`serve(...)` builds a grpc.server with health (grpc.health.v1), reflection,
message-size limits, keepalive, optional TLS + bearer-token auth, registers the
stage's servicer, and drains gracefully on SIGTERM: health flips to NOT_SERVING
first, new work is refused, the running job finishes (or is cancelled, by
flag), then the process exits.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stagekit.errors import StageError, status_for
from stagekit.runtime import Job, JobEvent, StageRuntime
from stagekit.transport import GRPC_OPTIONS, MAX_MESSAGE_BYTES  # noqa: F401 - one definition, shared with clients

log = logging.getLogger("stagekit.server")



@dataclass
class ServeConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "bind address; non-loopback needs TLS + token or --insecure"})
    port: int = field(default=0, metadata={"help": "gRPC port (0 = pick a free one and print it)"})
    max_workers: int = field(default=32, metadata={"help": "gRPC handler threads"})
    tls_cert: str = field(default="", metadata={"help": "PEM server certificate"})
    tls_key: str = field(default="", metadata={"help": "PEM server private key"})
    token: str = field(default="", metadata={"help": "bearer token required in 'authorization' metadata"})
    insecure: bool = field(default=False, metadata={"help": "allow a non-loopback bind without TLS/token"})
    metrics_port: int = field(default=-1, metadata={"help": "Prometheus port (-1 off, 0 free port)"})
    drain_s: float = field(default=30.0, metadata={"help": "SIGTERM: seconds to let the running job finish"})
    cancel_on_term: bool = field(default=False, metadata={"help": "SIGTERM: cancel the running job instead of finishing it"})
    port_file: str = field(default="", metadata={"help": "write the bound port here once serving (for scripts)"})


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_exposure(cfg: ServeConfig) -> None:
    """Refuse to expose a stage beyond loopback without TLS and a token, unless told to."""
    if is_loopback(cfg.host) or cfg.insecure:
        return
    missing = [n for n, v in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--token", cfg.token)) if not v]
    if missing:
        raise SystemExit(
            f"refusing to bind {cfg.host}: a non-loopback address needs {', '.join(missing)} "
            f"(or pass --insecure to accept the risk)")


class TokenAuth(grpc.ServerInterceptor):
    """Bearer-token check (constant-time compare); health checks stay open for probes."""

    _OPEN = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str):
        self._want = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization' metadata")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self._OPEN):
            return continuation(handler_call_details)
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._want):
            return continuation(handler_call_details)
        return self._deny


class StageServer:
    """A running gRPC server for one stage plus its health state."""

    def __init__(self, cfg: ServeConfig, service_names: list[str],
                 add_servicers: Callable[[grpc.Server], None], interceptors: list | None = None):
        check_exposure(cfg)
        self.cfg = cfg
        # `interceptors` run outside the auth check (metrics count refused calls too).
        interceptors = list(interceptors or []) + ([TokenAuth(cfg.token)] if cfg.token else [])
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers),
                                  options=GRPC_OPTIONS, interceptors=interceptors)
        add_servicers(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        addr = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
            self.port = self.server.add_secure_port(addr, creds)
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise SystemExit(f"could not bind {addr}")
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self) -> None:
        self.server.start()
        if self.cfg.port_file:
            tmp = Path(self.cfg.port_file + ".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(self.cfg.port_file)
        log.info("serving %s on %s:%d", ",".join(self.service_names), self.cfg.host, self.port)

    def run_until_terminated(self, runtime: StageRuntime) -> None:
        """Block until SIGTERM/SIGINT, then drain: NOT_SERVING first, then finish/cancel, then stop."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        # Poll: the kernel may deliver SIGTERM to any thread (gRPC's, torch's), and Python runs the handler only
        # when the main thread wakes; an untimed wait could sleep through the signal until something else woke it.
        while not stop.wait(0.2):
            pass
        log.info("draining: health NOT_SERVING, %s the running job", "cancelling" if self.cfg.cancel_on_term else "finishing")
        self.health.enter_graceful_shutdown()
        runtime.shutdown(cancel_running=self.cfg.cancel_on_term, grace_s=self.cfg.drain_s)
        self.server.stop(grace=2.0).wait()


def stream_job(runtime: StageRuntime, job: Job, context: grpc.ServicerContext,
               on_event: Callable[[JobEvent], Iterator]) -> Iterator:
    """Submit `job`, then turn its events into response messages until done or failed.

    A client that disconnects or whose deadline passes cancels the job; the
    runtime notices at the next step boundary on every rank.
    """
    remaining = context.time_remaining()
    if remaining is not None and remaining < 1e8:
        job.deadline = time.monotonic() + remaining
    context.add_callback(job.cancel)
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


def job_status(runtime: StageRuntime, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status of a failed job. On a multi-rank stage an unexpected error is a broken rank group (a dead or
    stuck rank, a failed collective): the runtime exits so torchrun restarts the group, so the caller sees
    UNAVAILABLE (retryable) rather than INTERNAL."""
    code, msg = status_for(exc)
    if runtime.group.world_size > 1 and code == grpc.StatusCode.INTERNAL:
        return grpc.StatusCode.UNAVAILABLE, (
            f"{runtime.engine.name}: rank group failed ({msg}); the stage is restarting its ranks, retry the job")
    return code, msg


def followers_ignore_term(is_leader: bool) -> None:
    """Ranks > 0 ignore SIGTERM/SIGINT. torchrun forwards a SIGTERM to every rank, but only rank 0 decides when
    the group stops: it drains (finishes or cancels the running job), then broadcasts exit to the followers. A
    follower dying on the signal first would break the in-flight job's collectives."""
    if not is_leader:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


@contextmanager
def startup_errors(stage: str):
    """Turn a deliberate startup failure (bad weights, missing model dir, bad flag) into one clear line and a
    non-zero exit instead of a traceback."""
    try:
        yield
    except (StageError, ValueError, OSError) as e:
        msg = e.message if isinstance(e, StageError) else str(e)
        raise SystemExit(f"{stage}: cannot start: {msg}") from None


def abort_on_error(context: grpc.ServicerContext, fn: Callable, *args):
    """Run `fn`; a deliberate error becomes the RPC's status instead of a traceback."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        code, msg = status_for(e)
        context.abort(code, msg)
