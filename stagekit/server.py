"""The one gRPC server every service shares: the stages and the render service (stagekit/bootstrap.py binds and runs
it).

`StageServer` is a grpc.server with health (grpc.health.v1), reflection,
message-size limits, keepalive, optional TLS + bearer-token auth and the
stage's servicer; it and drains gracefully on SIGTERM (docs/reliability.md,
"SIGTERM"): health flips to NOT_SERVING first, new work is refused, queued jobs
fail at once with UNAVAILABLE, the running job gets `--drain-s` to finish (or
is cancelled at once, by flag), then the process exits.

Admission (docs/reliability.md, "Stalled and flooding clients"): every call is
sorted, before it takes a handler thread, into probes (health Check), control
(Status, health Watch, reflection) and work (everything else); each class has
its own bounded number of slots and its own threads, so no number of stalled or
flooding work calls can starve health or Status; a service's long-lived streams
(the render service's Render and Watch) are a class of their own too, so
followers never take a work slot. Calls over a bound are refused
at once with RESOURCE_EXHAUSTED. Every request message is read with an idle and
a total deadline (a stalled upload gets DEADLINE_EXCEEDED), and uploads
(request-streaming work calls) have a tighter bound of their own.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stagekit.errors import Cancelled, DeadlineExceeded, InvalidArgument, StageError, status_for
from stagekit.transport import GRPC_OPTIONS, MAX_MESSAGE_BYTES  # noqa: F401 - one definition, shared with clients

log = logging.getLogger("stagekit.server")

# Servers only: one listener per port. gRPC's default SO_REUSEPORT lets a second stage bind a port another stage
# serves, and the two then split the calls; without it the second one fails to start (docs/reliability.md).
SERVER_OPTIONS = (*GRPC_OPTIONS, ("grpc.so_reuseport", 0))

# Slots (and threads) reserved for each class of call besides work; see `Admission`.
PROBE_SLOTS = 4      # health Check
CONTROL_SLOTS = 4    # Status, health Watch, reflection
SPARE_THREADS = 4    # answer refusals even when every slot is taken
PROBE_METHODS = ("/grpc.health.v1.Health/Check",)
CONTROL_METHODS = ("/grpc.health.v1.Health/Watch", "/grpc.reflection.")


@dataclass(frozen=True)
class ServeConfig:
    """serving: address, security, admission, metrics and shutdown"""

    host: str = field(default="127.0.0.1", metadata={"help": "bind address; non-loopback needs TLS + token or --insecure"})
    port: int = field(default=0, metadata={"help": "gRPC port (0 = pick a free one and print it)"})
    max_workers: int = field(default=32, metadata={
        "help": "work calls (Encode/Sample/Decode/EncodeImage/Load/Unload/Warmup) handled at once; more are refused "
                "with RESOURCE_EXHAUSTED. Health and Status have threads of their own"})
    max_streams: int = field(default=0, init=False)   # slots of the long-lived streams (services that have some)
    stream_methods: tuple = field(default=(), init=False)
    max_uploads: int = field(default=8, metadata={
        "help": "request uploads (Sample/Decode tensor streams, reference files) received at once, at most "
                "--max-workers; more are refused with RESOURCE_EXHAUSTED"})
    upload_idle_s: float = field(default=30.0, metadata={
        "help": "a call whose next request message does not arrive within this long fails with DEADLINE_EXCEEDED"})
    upload_total_s: float = field(default=600.0, metadata={
        "help": "a call's whole request (an upload) must arrive within this long, or it fails with DEADLINE_EXCEEDED"})
    tls_cert: str = field(default="", metadata={"help": "PEM server certificate"})
    tls_key: str = field(default="", metadata={"help": "PEM server private key"})
    token_file: str = field(default="", metadata={
        "help": "file holding the bearer token required in 'authorization' metadata (or set the env variable)"})
    token: str = field(default="", metadata={
        "help": "bearer token", "env_only": "a token on the command line is readable by every local user in "
                                           "/proc/<pid>/cmdline; give it with --token-file FILE or the env variable"})
    tokens_file: str = field(default="", metadata={
        "help": "file of principals, one 'NAME TOKEN' line each ('NAME TOKEN admin' for an admin): each caller is "
                "the principal its token names; with the render service a principal sees only its own jobs, an "
                "admin all"})
    insecure: bool = field(default=False, metadata={"help": "allow a non-loopback bind without TLS/token"})
    metrics_port: int = field(default=-1, metadata={"help": "Prometheus port (-1 off, 0 free port)"})
    metrics_host: str = field(default="127.0.0.1", metadata={
        "help": "address /metrics binds (plain HTTP, no auth): loopback unless you ask for more"})
    drain_s: float = field(default=30.0, metadata={
        "help": "SIGTERM: seconds the running job may take to finish before it is cancelled (queued jobs fail at once)"})
    cancel_on_term: bool = field(default=False, metadata={"help": "SIGTERM: cancel the running job instead of finishing it"})
    port_file: str = field(default="", metadata={"help": "write the bound port here once serving (for scripts)"})
    health_port: int = field(default=-1, metadata={
        "help": "a second, plain-text port on --host serving gRPC health alone (grpc.health.v1: no stage calls, no "
                "token needed), for probes that cannot speak TLS, e.g. Kubernetes' grpc probes (docs/scale_out.md); "
                "-1 off"})

    def resolved_token(self) -> str:
        """The bearer token: --token-file's contents (stripped), else --token / the env variable."""
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise SystemExit(f"--token-file {self.token_file}: cannot read it ({e.strerror})") from None
            if not token:
                raise SystemExit(f"--token-file {self.token_file} is empty")
            return token
        return self.token

    def tokens(self) -> "Tokens | None":
        """Who may call (None: anyone). --tokens-file names principals; the one token (--token-file / env) is a
        single admin principal ''."""
        table: dict[str, Principal] = {}
        if token := self.resolved_token():
            table[token] = Principal("", admin=True)
        if self.tokens_file:
            table.update(read_tokens_file(Path(self.tokens_file)))
        return Tokens(table) if table else None


@dataclass(frozen=True)
class Principal:
    """Who a call comes from: the name its token has in --tokens-file ('' for the one --token-file token);
    an admin sees every principal's jobs."""

    name: str
    admin: bool = False


ANYONE = Principal("", admin=True)  # a service without tokens: every caller is the same principal


def read_tokens_file(path: Path) -> dict[str, Principal]:
    """`NAME TOKEN [admin]` lines (blank lines and '#' comments skipped) -> token: principal. SystemExit naming the
    line for anything else."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"--tokens-file {path}: cannot read it ({e.strerror})") from None
    out: dict[str, Principal] = {}
    names: set[str] = set()
    for n, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin") or not parts[0].isprintable():
            raise SystemExit(f"--tokens-file {path}:{n}: expected 'NAME TOKEN' or 'NAME TOKEN admin'")
        name, token = parts[0], parts[1]
        if name in names or token in out:
            raise SystemExit(f"--tokens-file {path}:{n}: the name or the token of {name!r} is used twice")
        names.add(name)
        out[token] = Principal(name, admin=len(parts) == 3)
    if not out:
        raise SystemExit(f"--tokens-file {path} names no principal ('NAME TOKEN' lines)")
    return out


class Tokens:
    """The bearer tokens a service accepts and the principal each names (constant-time compare against all)."""

    def __init__(self, table: dict[str, Principal]):
        self._table = [(f"Bearer {t}".encode(), p) for t, p in table.items()]

    def principal(self, authorization: str) -> Principal | None:
        got, found = authorization.encode(), None
        for want, p in self._table:
            if hmac.compare_digest(got, want):
                found = p
        return found

    def of(self, context: grpc.ServicerContext) -> Principal:
        """The principal of an authenticated call (TokenAuth let it in)."""
        md = dict(context.invocation_metadata() or ())
        return self.principal(md.get("authorization", "")) or Principal("?")


def principal_of(tokens: "Tokens | None", context: grpc.ServicerContext) -> Principal:
    return ANYONE if tokens is None else tokens.of(context)


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
    token = cfg.token or cfg.token_file or cfg.tokens_file
    missing = [n for n, v in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--token", token)) if not v]
    if missing:
        raise SystemExit(
            f"refusing to bind {cfg.host}: a non-loopback address needs {', '.join(missing)} "
            f"(or pass --insecure to accept the risk)")


class TokenAuth(grpc.ServerInterceptor):
    """Bearer-token check (constant-time compare); health checks stay open for probes."""

    _OPEN = ("/grpc.health.v1.Health/",)

    def __init__(self, tokens: Tokens):
        self.tokens = tokens
        self._deny = refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization' metadata")

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self._OPEN):
            return continuation(handler_call_details)
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if self.tokens.principal(got) is not None:
            return continuation(handler_call_details)
        return self._deny


def refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that fails a call without reading its request: declared request-streaming whatever the method is,
    so gRPC does not wait for a request message (a stalled client cannot hold the refusing thread)."""

    def refuse(request_iterator, context):
        context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


class _Slots:
    """A counted bound; `take` never blocks."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1


class _Hold:
    """One call's slot: given back exactly once (when the call ends, or earlier, e.g. an upload's end)."""

    def __init__(self, slots: _Slots):
        self._slots: _Slots | None = slots
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, None
        if slots is not None:
            slots.give()


class TimedRequests:
    """A call's request messages with an idle and a total deadline (the handler cannot time out gRPC's blocking
    request iterator, so a helper thread reads it and hands messages over through a two-message queue; that also
    keeps flow control: an upload is not read ahead of the handler).

    Raises DeadlineExceeded when the next message is late (`idle_s`) or the whole request is (`total_s`),
    Cancelled when the client goes away mid-request. `on_end` runs once the request is over (fully read, failed,
    or abandoned by `close`)."""

    def __init__(self, request_iterator, idle_s: float, total_s: float, what: str, on_end: Callable[[], None]):
        self._it = request_iterator
        self.idle_s, self.what = idle_s, what
        self._deadline = time.monotonic() + total_s
        self.total_s = total_s
        self._on_end: Callable[[], None] | None = on_end
        self._q: "queue.Queue[tuple[str, object]]" = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._over = False
        threading.Thread(target=self._pump, name="request-reader", daemon=True).start()

    def _pump(self) -> None:
        try:
            for msg in self._it:
                if not self._put(("msg", msg)):
                    return
            self._put(("end", None))
        except Exception as e:  # noqa: BLE001 - grpc.RpcError when the call ends under us
            self._put(("error", e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _end(self) -> None:
        self._over = True
        self._stop.set()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    def close(self) -> None:
        """The handler is done with the request (read or not): stop the reader, give the upload slot back."""
        self._end()

    def __iter__(self):
        return self

    def __next__(self):
        if self._over:
            raise StopIteration
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise queue.Empty
            kind, value = self._q.get(timeout=min(self.idle_s, left))
        except queue.Empty:
            self._end()
            if time.monotonic() >= self._deadline:
                raise DeadlineExceeded(f"{self.what}: the request did not arrive within {self.total_s:g} s "
                                       "(--upload-total-s); send it faster or split the work") from None
            raise DeadlineExceeded(f"{self.what}: no request message for {self.idle_s:g} s (--upload-idle-s); "
                                   "the stalled call was closed") from None
        if kind == "msg":
            return value
        self._end()
        if kind == "end":
            raise StopIteration
        raise Cancelled(f"{self.what}: the client went away during the request")


class Admission(grpc.ServerInterceptor):
    """Bounds on calls in progress per class, checked on gRPC's serving thread before a call takes a handler
    thread: probes (health Check), control (Status, health Watch, reflection) and work (the rest; those that
    stream their request are uploads and also take an upload slot until their request is in). The thread pool
    has room for every slot plus spares, so health and Status always find a thread, and a refusal is immediate.

    Every request (unary ones included: a stalled client can hold back a single message too) is read through
    `TimedRequests`, so each call's handler is re-declared request-streaming; the wire protocol is unchanged."""

    def __init__(self, cfg: "ServeConfig", label: str):
        self.cfg, self.label = cfg, label
        self.probes, self.control = _Slots(PROBE_SLOTS), _Slots(CONTROL_SLOTS)
        self.work, self.uploads = _Slots(cfg.max_workers), _Slots(cfg.max_uploads)
        self.streams = _Slots(cfg.max_streams)

    @property
    def threads(self) -> int:
        return self.cfg.max_workers + self.cfg.max_streams + PROBE_SLOTS + CONTROL_SLOTS + SPARE_THREADS

    def _class(self, method: str) -> tuple[_Slots, str]:
        if method in self.cfg.stream_methods:
            return self.streams, "streams (--max-streams)"
        if method in PROBE_METHODS:
            return self.probes, "health checks"
        if method.startswith(CONTROL_METHODS) or method.endswith("/Status"):
            return self.control, "status calls"
        return self.work, "work calls (--max-workers)"

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        slots, what = self._class(method)
        upload = slots is self.work and handler.request_streaming
        if not slots.take():
            return refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.label}: {slots.limit} {what} in progress already; retry later")
        hold = _Hold(slots)
        up_hold = None
        if upload:
            if not self.uploads.take():
                hold.release()
                return refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.label}: {self.uploads.limit} uploads in progress already (--max-uploads); "
                               "retry later")
            up_hold = _Hold(self.uploads)
        return self._wrap(handler, method, hold, up_hold)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, hold: _Hold, up_hold: _Hold | None):
        cfg = self.cfg
        name = method.rsplit("/", 1)[-1]
        label = f"{self.label} {name}"

        def release_all() -> None:
            if up_hold is not None:
                up_hold.release()
            hold.release()

        def first_request(requests: TimedRequests, context):
            """The one message of a unary-request call (or a status that says why there is none)."""
            try:
                for msg in requests:
                    return msg
                raise InvalidArgument(f"{label}: the call carried no request message")
            except StageError as e:
                context.abort(e.code, e.message)
            finally:
                requests.close()

        if handler.request_streaming:
            inner = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        @contextmanager
        def handler_arg(request_iterator, context):
            """What the handler takes: the timed request stream, or its one message; on leaving, the stream is
            closed and the call's slots are given back."""
            if not context.add_callback(release_all):  # the call already ended
                release_all()
            requests = TimedRequests(request_iterator, cfg.upload_idle_s, cfg.upload_total_s, label,
                                     up_hold.release if up_hold is not None else (lambda: None))
            try:
                yield requests if handler.request_streaming else first_request(requests, context)
            finally:
                requests.close()
                release_all()

        if handler.response_streaming:
            def behavior(request_iterator, context):
                with handler_arg(request_iterator, context) as arg:
                    yield from inner(arg, context)

            return grpc.stream_stream_rpc_method_handler(
                behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)

        def unary_behavior(request_iterator, context):
            with handler_arg(request_iterator, context) as arg:
                return inner(arg, context)

        return grpc.stream_unary_rpc_method_handler(
            unary_behavior, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def cannot_listen(addr: str, flag: str, why: str = "") -> OSError:
    """The one start-up error for a port this process cannot bind (gRPC, /metrics, the web page)."""
    why = why or "the port is in use (another server already serves it?) or the address is not on this host"
    return OSError(f"cannot listen on {addr}: {why}; stop the other server or pick another {flag}")


class StageServer:
    """A gRPC server for one stage plus its health state.

    The constructor binds the port and holds it; `start` adds the stage's servicer and serves. `run_stage` builds
    it before anything expensive (docs/reliability.md, "One listener per port"), so a taken port refuses the start
    at once, and no other server can take the port while the engine is built. Calls that arrive in between wait
    in the listen queue until `start` (their deadline permitting)."""

    def __init__(self, cfg: ServeConfig, service_names: list[str], interceptors: list | None = None, label: str = ""):
        check_exposure(cfg)
        if not 1 <= cfg.max_uploads <= cfg.max_workers:
            raise SystemExit(f"--max-uploads {cfg.max_uploads} must be between 1 and --max-workers ({cfg.max_workers})")
        self.cfg = cfg
        tokens = cfg.tokens()
        self.admission = Admission(cfg, label or service_names[0].rsplit(".", 1)[-1])
        # `interceptors` run outside the auth check (metrics count refused calls too); admission runs after auth,
        # so unauthenticated calls never take a slot.
        interceptors = list(interceptors or []) + ([TokenAuth(tokens)] if tokens else []) + [self.admission]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.admission.threads),
                                  options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        addr = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
                self.port = self.server.add_secure_port(addr, creds)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError:  # grpc >= 1.60 raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise cannot_listen(addr, "--port")
        # Health alone, in plain text, answering from now on (NOT_SERVING until the stage serves): the same
        # HealthServicer, so both ports always agree.
        self.health_server = None
        if cfg.health_port >= 0:
            self.health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=PROBE_SLOTS),
                                             options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_addr = f"{cfg.host}:{cfg.health_port}"
            try:
                bound = self.health_server.add_insecure_port(health_addr)
            except RuntimeError:
                bound = 0
            if bound == 0:
                self.server.stop(None)
                raise cannot_listen(health_addr, "--health-port")
            self.health_server.start()
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self, add_servicers: Callable[[grpc.Server], None]) -> None:
        """Add the stage's servicer(s) and serve on the port bound at construction."""
        add_servicers(self.server)
        self.server.start()
        if self.cfg.port_file:
            tmp = Path(self.cfg.port_file + ".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(self.cfg.port_file)
        log.info("serving %s on %s:%d", ",".join(self.service_names), self.cfg.host, self.port)

    def run_until_terminated(self, drain: Callable[[bool, float], None]) -> None:
        """Block until SIGTERM/SIGINT, then drain (docs/reliability.md, "SIGTERM"): NOT_SERVING first, then
        `drain(cancel_running=--cancel-on-term, grace_s=--drain-s)` (a stage's runtime: queued jobs fail at once
        with UNAVAILABLE, the running job finishes within --drain-s or is cancelled; the render service: the running
        batch likewise, its jobs requeued for the next start), then stop."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        # Poll: the kernel may deliver SIGTERM to any thread (gRPC's, torch's), and Python runs the handler only
        # when the main thread wakes; an untimed wait could sleep through the signal until something else woke it.
        while not stop.wait(0.2):
            pass
        log.info("draining: health NOT_SERVING, %s the running job", "cancelling" if self.cfg.cancel_on_term else "finishing")
        self.health.enter_graceful_shutdown()
        drain(self.cfg.cancel_on_term, self.cfg.drain_s)
        # Handlers of failed/cancelled jobs now hold their status; give them a moment to send it.
        self.server.stop(grace=5.0).wait()
        if self.health_server is not None:
            self.health_server.stop(None)


@contextmanager
def startup_errors(stage: str):
    """Turn a deliberate startup failure (bad weights, missing model dir, bad flag: a StageError; a port or file
    the OS refuses: an OSError) into one clear line and a non-zero exit. Anything else is a fault of this code and
    keeps its traceback."""
    try:
        yield
    except (StageError, OSError) as e:
        msg = e.message if isinstance(e, StageError) else str(e)
        raise SystemExit(f"{stage}: cannot start: {msg}") from None


def abort_on_error(context: grpc.ServicerContext, fn: Callable, *args):
    """Run `fn`; a deliberate error becomes the RPC's status instead of a traceback."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        code, msg = status_for(e)
        context.abort(code, msg)
