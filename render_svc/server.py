"""Render service: `python -m render_svc --encoder HOST:PORT --dit HOST:PORT --decoder HOST:PORT [--run-dir run]`.

Its own process, on the bootstrap every server shares (stagekit/bootstrap.py: flags/env/config file, health,
reflection, TLS + token and principals, admission, metrics, graceful drain on SIGTERM). It holds no weights, no
device and no lease: its state is the job store in --run-dir, its work the stage batches its scheduler sends to the
stages (render_svc/service.py and the parts it names).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from h3.v1 import common_pb2, render_pb2, render_pb2_grpc
from minimax_h3.services import SERVICE_NAMES, STAGES, Endpoints, StageClients
from render_svc.engine import RenderEngine, make_replicas
from render_svc.config import SchedulerConfig
from render_svc.service import RenderService
from render_svc.stalls import STALL_TIMEOUT_S
from render_svc.store import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from render_svc.webhooks import WebhookConfig, Webhooks, check_url, read_secret
from stagekit.bootstrap import LOG_LEVELS, ProcessTempDir, exit_cleanly, listen, setup_logging
from stagekit.channels import Security, health_of
from stagekit.config import parse_config
from stagekit.errors import FailedPrecondition, NotFound
from stagekit.server import Principal, ServeConfig, abort_on_error, principal_of, startup_errors
from stagekit.servicer import UploadMixin
from stagekit.transport import file_chunks

SERVICE = "h3.v1.Renderer"
GIB = 1 << 30
STREAMS = (f"/{SERVICE}/Render", f"/{SERVICE}/Watch")  # long-lived: slots of their own (--max-streams)
LIST_REPLY_BYTES = 2 << 20  # List stops adding jobs before its reply passes this (clients' 4 MiB default limit)


@dataclass(frozen=True)
class RenderConfig(ServeConfig):
    """the render service: stage endpoints, job store, batching, retention"""

    port: int = field(default=50054, metadata={"help": "gRPC port"})
    max_workers: int = field(default=64, metadata={
        "help": "Submit/Get/List/Cancel/Fetch calls handled at once; more get RESOURCE_EXHAUSTED (streams do not count)"})
    max_streams: int = field(default=512, metadata={
        "help": "Render and Watch streams followed at once (a thread each, not a --max-workers slot); more get "
                "RESOURCE_EXHAUSTED"})
    stream_methods: tuple = field(default=STREAMS, init=False)
    encoder: str = field(default="", metadata={
        "help": "text encoder endpoint: host:port, or replicas 'name=host:port,name=host:port' (names optional); "
                "each replica gets its own channel and its own share of the batches"})
    dit: str = field(default="", metadata={"help": "DiT sampler endpoint (or replicas, as --encoder)"})
    decoder: str = field(default="", metadata={"help": "decoder endpoint (or replicas, as --encoder)"})
    stage_token: str = field(default="", metadata={"help": "bearer token for the stages (default: this service's token)"})
    stage_tls_ca: str = field(default="", metadata={"help": "CA certificate of TLS stages"})
    run_dir: str = field(default="run", metadata={"help": "job database (render.sqlite3) and finished MP4s (outputs/)"})
    http_port: int = field(default=-1, metadata={
        "help": "read-only web page (queue, live progress, residency, videos) and the HTTP video API (/v1/videos): "
                "-1 off, 0 a free port; same host, TLS and token as the gRPC port"})
    http_header_s: float = field(default=10.0, metadata={
        "help": "--http-port: a connection's TLS handshake, request line and headers must arrive within this many "
                "seconds of its accept (a later request's line and headers: of its first byte), else 408 and the "
                "connection is closed"})
    http_max_connections: int = field(default=64, metadata={
        "help": "--http-port: connections open at once (a thread each); more get 503"})
    http_max_per_address: int = field(default=16, metadata={
        "help": "--http-port: connections open at once from one client address; more from it get 503"})
    http_reserved_connections: int = field(default=8, metadata={
        "help": "--http-port: of --http-max-connections, the last this many serve only requests with a valid token "
                "(others get 503), so connections without one cannot refuse every caller"})
    webhook_url: str = field(default="", metadata={
        "help": "POST a signed event here when a job ends (video.completed / video.failed / video.cancelled); "
                "needs --webhook-secret-file"})
    webhook_secret_file: str = field(default="", metadata={
        "help": "the webhooks' HMAC-SHA256 signing key (the file's text, or a Standard Webhooks whsec_ secret)"})
    webhook_attempts: int = field(default=8, metadata={"help": "attempts per webhook event before it is given up"})
    webhook_retry_s: float = field(default=2.0, metadata={
        "help": "seconds before a failed webhook attempt is retried; doubles each attempt (up to 600 s)"})
    webhook_timeout_s: float = field(default=10.0, metadata={
        "help": "one webhook attempt, whole (connect, send, the whole answer): past it the connection is cut and the "
                "attempt counts as failed"})
    max_batch: int = field(default=8, metadata={
        "help": "jobs sent to a stage in one batch (keep it <= the stages' --max-queue)"})
    max_wait_batches: int = field(default=4, metadata={
        "help": "fairness bound: a job ready for a stage waits at most this many batches of other work, while what "
                "arrives at a stage in that many batches fits one batch (docs/render_service.md)"})
    pipeline: bool = field(default=True, metadata={
        "help": "run stage batches of stages that share no device at the same time (each stage's Status names its "
                "devices); --no-pipeline: one batch service-wide at a time"})
    max_attempts: int = field(default=2, metadata={
        "help": "runs of a job: a restart during a run retries it while attempts remain, else it fails"})
    stage_retries: int = field(default=3, metadata={"help": "UNAVAILABLE answers from a stage retried per job"})
    stall_timeout_s: float = field(default=STALL_TIMEOUT_S, metadata={
        "help": "a stage replica that sends nothing on a batch's calls for this long (no progress event, no data; a "
                "load reports once, so this covers the slowest load) loses the batch: its calls are stopped, it gets "
                "no work until its Status shows it moving again, and each job runs that stage once more elsewhere"})
    job_deadline_s: float = field(default=6 * 3600.0, metadata={
        "help": "a stage that answers busy (RESOURCE_EXHAUSTED ... retry later) is waited out, with backoff, until "
                "this long after the job's submission; then the job fails DEADLINE_EXCEEDED"})
    max_jobs_queued: int = field(default=256, metadata={"help": "queued jobs beyond this get RESOURCE_EXHAUSTED"})
    keep_jobs: int = field(default=100, metadata={
        "help": "retention: newest finished jobs kept (record, events, MP4); older ones are deleted (0 = no count limit)"})
    keep_bytes_gb: float = field(default=10.0, metadata={
        "help": "retention: GiB of finished MP4s kept, oldest expired first; the newest is always kept (0 = no limit)"})
    keep_age_s: float = field(default=7 * 86400.0, metadata={
        "help": "retention: seconds a finished job is kept (record, events, MP4) (0 = no limit)"})
    retention_every_s: float = field(default=60.0, metadata={
        "help": "retention runs this often (and whenever a job ends)"})
    temp_dir: str = field(default="", metadata={
        "help": "where the service keeps temp files (default $TMPDIR): in its own h3-render-<pid> subdirectory, "
                "removed at exit; subdirectories of processes no longer running are removed at start"})
    log_level: str = field(default="INFO", metadata={"choices": LOG_LEVELS, "help": "logging level"})

    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(
            run_dir=Path(self.run_dir), max_batch=self.max_batch, max_wait_batches=self.max_wait_batches,
            max_attempts=self.max_attempts, stage_retries=self.stage_retries, max_jobs_queued=self.max_jobs_queued,
            keep_jobs=self.keep_jobs, keep_bytes=int(self.keep_bytes_gb * GIB), keep_age_s=self.keep_age_s,
            job_deadline_s=self.job_deadline_s, stall_timeout_s=self.stall_timeout_s,
            retention_every_s=self.retention_every_s, pipeline=self.pipeline)

    def endpoints(self) -> Endpoints:
        missing = [s for s in STAGES if not getattr(self, s)]
        if missing:
            raise FailedPrecondition(f"give the stage endpoints --{' --'.join(missing)} (scripts/up.sh passes them)")
        return Endpoints(self.encoder, self.dit, self.decoder)

    def stage_security(self) -> Security:
        return Security(self.stage_token or self.resolved_token(), self.stage_tls_ca)

    def webhook(self) -> WebhookConfig | None:
        """The webhook settings (None: no --webhook-url); FailedPrecondition for a URL or secret file it cannot use."""
        if not self.webhook_url:
            return None
        if not self.webhook_secret_file:
            raise FailedPrecondition("--webhook-url needs --webhook-secret-file: every delivery is signed")
        if self.webhook_attempts < 1 or not self.webhook_retry_s > 0 or not self.webhook_timeout_s > 0:
            raise FailedPrecondition("--webhook-attempts must be at least 1, --webhook-retry-s and "
                                     "--webhook-timeout-s above 0")
        check_url(self.webhook_url)
        return WebhookConfig(self.webhook_url, read_secret(self.webhook_secret_file), self.webhook_attempts,
                             self.webhook_retry_s, self.webhook_timeout_s)


class RenderServicer(UploadMixin, render_pb2_grpc.RendererServicer):
    """The Renderer API over the scheduler. Every call acts as its caller's principal (`--tokens-file`): jobs are
    its own, unless it is an admin (or the service has no tokens file: one principal, everyone's jobs). Uploaded
    reference files are shared by content (a digest names the same bytes for everyone)."""

    def __init__(self, svc: RenderService, clients: StageClients, web_url: str = "", tokens=None):
        self.svc = svc
        self.uploads = svc.uploads
        self.clients = clients
        self.web_url = web_url
        self.tokens = tokens

    def _owner(self, context) -> str | None:
        """The jobs a call may see: its principal's (None: all, for an admin)."""
        who: Principal = principal_of(self.tokens, context)
        return None if who.admin else who.name

    def _follow(self, job_id: str, from_index: int, context):
        """The job's event log from `from_index` until its terminal state (or the caller leaves). A finished job's
        log ends the stream once it is read (also when `from_index` is past its end), and so does the job's removal
        by retention (NOT_FOUND). A drain ends it with UNAVAILABLE (the job goes on after the restart)."""
        idx = from_index
        while context.is_active():
            if self.svc.stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the render service is restarting; the job goes on: Watch "
                                                           f"{job_id} again from index {idx} once it is back")
            evs = self.svc.book.wait_events(job_id, idx, timeout_s=1.0)
            for ev in evs:
                yield ev
                idx = ev.index + 1
                if ev.WhichOneof("event") == "job" and ev.job.state in (SUCCEEDED, FAILED, CANCELLED):
                    return
            if not evs and abort_on_error(context, self.svc.book.get, job_id).terminal:
                return

    def _submitter(self, context) -> tuple[str, bool]:
        """(principal name, admin) of the caller: its new jobs are its own; an admin may extend anyone's."""
        who: Principal = principal_of(self.tokens, context)
        return who.name, who.admin

    def Render(self, request, context):
        info = abort_on_error(context, self.svc.submit, request, *self._submitter(context))
        yield from self._follow(info.job_id, 0, context)
        if not context.is_active():
            return  # the caller left; the job goes on (Watch / Fetch it by id)
        rec = self.svc.book.get(info.job_id)
        if rec.state == SUCCEEDED:
            try:
                for chunk in file_chunks(Path(rec.output), f"{rec.id}.mp4", "video/mp4"):
                    yield render_pb2.RenderEvent(job_id=rec.id, time_unix=time.time(), file=chunk)
            except FileNotFoundError:
                context.abort(grpc.StatusCode.NOT_FOUND, f"job {rec.id}: the MP4 was removed by the retention limits")
        elif rec.terminal:
            context.abort(getattr(grpc.StatusCode, rec.error_code, grpc.StatusCode.UNKNOWN),
                          f"job {rec.id}: {rec.error}")

    def Submit(self, request, context):
        return abort_on_error(context, self.svc.submit, request, *self._submitter(context))

    def Extend(self, request, context):
        return abort_on_error(context, self.svc.extend, request, *self._submitter(context))

    def Get(self, request, context):
        return abort_on_error(context, self.svc.book.info, request.job_id, None, self._owner(context))

    def Watch(self, request, context):
        abort_on_error(context, self.svc.book.get, request.job_id, self._owner(context))  # NOT_FOUND first
        yield from self._follow(request.job_id, request.from_index, context)

    def Cancel(self, request, context):
        return abort_on_error(context, self.svc.cancel, request.job_id, self._owner(context))

    def List(self, request, context):
        """Newest first, at most `limit` (default 100) jobs and at most LIST_REPLY_BYTES of reply."""
        reply, size = render_pb2.ListReply(), 0
        for r in self.svc.book.list(list(request.states), min(request.limit or 100, 1000), owner=self._owner(context)):
            info = self.svc.book.info(r.id, r)
            size += info.ByteSize() + 8
            if size > LIST_REPLY_BYTES:
                break
            reply.jobs.append(info)
        return reply

    def _output(self, job_id: str, owner: str | None) -> Path:
        rec = self.svc.book.get(job_id, owner)
        if rec.state != SUCCEEDED:
            state = render_pb2.JobState.Name(rec.state)
            raise FailedPrecondition(f"job {job_id} is {state}, there is no MP4 to fetch"
                                     + (" yet; Watch it, then Fetch" if not rec.terminal else f" ({rec.error})"))
        path = Path(rec.output)
        if rec.expired or not path.exists():
            raise NotFound(f"job {job_id}: the MP4 was removed by the retention limits "
                           "(--keep-jobs / --keep-bytes-gb / --keep-age-s)")
        return path

    def Fetch(self, request, context):
        path = abort_on_error(context, self._output, request.job_id, self._owner(context))
        size = path.stat().st_size
        if request.offset > size:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} is past the end ({size} bytes)")
        yield from file_chunks(path, f"{request.job_id}.mp4", "video/mp4", request.offset)

    def _stage(self, name: str, endpoint: str, clients: StageClients, service: str, one: bool
               ) -> render_pb2.StageEndpoint:
        """A stage (or one replica) as Status shows it: its health (SUSPECT, with why, while it is out of rotation
        after a stall) and, for one address (`one`), its own Status: what it serves (a client compares its flags with
        it: `client render --models-dir`)."""
        why = self.svc.cluster.suspect(name)
        health = health_of(clients.channels[service], SERVICE_NAMES[service], 2.0)
        status = None
        if one and health != "UNREACHABLE":
            try:
                status = clients.stub(service).Status(common_pb2.StatusRequest(), timeout=2.0,
                                                      metadata=clients.security.metadata())
            except grpc.RpcError:
                pass
        return render_pb2.StageEndpoint(stage=name, endpoint=endpoint, health=f"SUSPECT ({why})" if why else health,
                                        status=status)

    def Status(self, request, context):
        counts = self.svc.book.counts()
        replicas = self.svc.engine.replicas
        stages = [self._stage(s, self.clients.endpoints.of(s), self.clients, s, s in replicas) for s in STAGES]
        stages += [self._stage(node, r.address, r.clients, r.service, True)  # each of several replicas on its own
                   for node, r in replicas.items() if node != r.service]
        cfg = self.svc.cfg
        health = f"DEGRADED ({self.svc.book.storage_error})" if self.svc.book.storage_error else "SERVING"
        return render_pb2.RenderStatus(
            health=health, queued=counts.get(QUEUED, 0), running=counts.get(RUNNING, 0),
            succeeded=counts.get(SUCCEEDED, 0), failed=counts.get(FAILED, 0), cancelled=counts.get(CANCELLED, 0),
            batches=self.svc.batches, stages=stages, web_url=self.web_url, max_batch=cfg.max_batch,
            max_wait_batches=cfg.max_wait_batches, stage_groups=self.svc.cluster.group_names())


def main(argv: list[str] | None = None) -> None:
    """1. settings; 2. logging and the temp directory; 3. the listeners (a taken port refuses the start before the job
    database is opened); 4. the web page and video API, the job store, its scheduler and the webhook outbox; 5. serve
    until SIGTERM, then drain (the scheduler, then the webhook thread)."""
    cfg = parse_config(RenderConfig, argv, env_prefix="H3_RENDER_",
                       description="MiniMax-H3 render service: one-call renders and durable jobs over the stages")
    setup_logging(cfg.log_level, "render")
    with startup_errors("render"):
        temp = ProcessTempDir(Path(cfg.temp_dir or tempfile.gettempdir()), "render")
    try:
        with startup_errors("render"):
            hook_cfg = cfg.webhook()  # a webhook that could not be signed or sent refuses the start first
            listeners = listen(cfg, "render", SERVICE)
            clients = StageClients(cfg.endpoints(), cfg.stage_security())
            web = None
            if cfg.http_port >= 0:  # bound before the job database is opened: a taken port refuses the start first
                from render_svc.web import WebPage

                web = WebPage(cfg)
            svc = RenderService(cfg.scheduler(), RenderEngine(clients, make_replicas(cfg.endpoints(),
                                                                                     cfg.stage_security())))
            web_url = ""
            if web is not None:
                web_url = web.start(svc)
                print(f"render web page on {web_url}", flush=True)
            svc.start()
            hooks = None
            if hook_cfg is not None:
                hooks = Webhooks(hook_cfg, svc.book, Path(cfg.run_dir), keep_age_s=svc.cfg.keep_age_s)
                hooks.start()
            if listeners.metrics is not None:
                listeners.metrics.report(svc.gauges)
            servicer = RenderServicer(svc, clients, web_url, cfg.tokens())
            stages = ", ".join(f"{s}={clients.endpoints.of(s)}" for s in STAGES)
            listeners.serve(lambda server: render_pb2_grpc.add_RendererServicer_to_server(servicer, server),
                            f"over {stages}")
    except BaseException:
        temp.remove()
        raise

    def drain(cancel_running: bool, grace_s: float) -> None:
        svc.shutdown(cancel_running, grace_s)
        if hooks is not None:
            hooks.stop()

    listeners.run_until_terminated(drain)
    temp.remove()
    exit_cleanly()


if __name__ == "__main__":
    main(sys.argv[1:])
