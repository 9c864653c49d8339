"""Load test one stage, or whole renders, through the generated stubs.

    python -m client loadtest --stage dit --concurrency 4 --requests 20 --width 256 --height 256 --frames 22 --steps 1
    python -m client loadtest --stage encoder --concurrency 8 --duration 30 --rps 5 --json
    python -m client loadtest --stage pipeline --concurrency 2 --requests 6 --report out.html

1. **One stage** (`encoder`, `dit`, `decoder`): each request is one call of the stage-level library
   (`render_svc.stage_calls`: `encode`, `sample`, `decode` / `decode_raw`), so it is sent, streamed, counted
   (`on_bytes`) and checked against the contract's results exactly as the render service's own stage calls are.
   A stage listed with several replicas (`scripts/up.sh --dit-replicas ...` writes them into the endpoints file)
   is one channel with gRPC's round_robin: the requests spread over every replica.
2. **Whole renders** (`pipeline`): each request is one `Render` call of a render service (`--render`, `H3_RENDER`
   or the endpoints file; else one is started over the configured stages, or an embedded stack with its own). The
   render service orchestrates renders, and it alone: a load tester chaining the stage calls itself would measure
   an orchestration no user gets (no batching across callers, no job store, no fairness bound). The client does
   not import the render service's code; it calls its API, and each stage's timing comes back in the job's
   `StageRun`s.

Inputs are synthetic but valid: distinct prompts for the encoder (so its prompt cache misses; `--cache-hits`
measures the cached path), random text states [L, text_dim] for the DiT (text_dim and dtype from one Encode
call, or `--text-dim`), random latents of the contract's shapes for the decoder. `--inject-invalid K` makes
every K-th request deliberately invalid (INVALID_ARGUMENT) to exercise error accounting and alerts.

Reports p50/p90/p99 latency, throughput, errors by status code, and queue wait (queue + lease wait) vs service
time (load + compute + transfer) from the Timing every stage returns. With no endpoints configured it starts an
embedded stack (with `--metrics-port 0`) and adds the tested services' own request counters to the report.
"""

from __future__ import annotations

import html
import io
import json
import math
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import TYPE_CHECKING

import grpc

from client.render_client import RenderClient, render_request
from h3.v1 import common_pb2, decoder_pb2, encoder_pb2, render_pb2
from minimax_h3.contract import SAMPLE_OUTPUTS, RenderSpec, tensor_shapes
from minimax_h3.services import SERVICE_NAMES, STAGES, StageClients
from stagekit.errors import StageError

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI that registers this command stays torch-free
    import torch

    from render_svc.stage_calls import StageResult

METHODS = {"encoder": ["/h3.v1.TextEncoder/Encode"], "dit": ["/h3.v1.DiTSampler/Sample"],
           "decoder": ["/h3.v1.Decoder/Decode"]}
# A render: the render service's Render call, and the stage calls it makes.
METHODS["pipeline"] = ["/h3.v1.Renderer/Render"] + METHODS["encoder"] + METHODS["dit"] + METHODS["decoder"]
# The services whose own request counts a run of each kind reports (their /metrics, where known).
SERVICES = {"encoder": ("encoder",), "dit": ("dit",), "decoder": ("decoder",), "pipeline": ("render", *STAGES)}
PHASES = ("queue_s", "lease_wait_s", "load_s", "compute_s", "unload_s", "transfer_s")
INVALID_WIDTH = 250  # not a multiple of 32: every stage rejects it with INVALID_ARGUMENT


@dataclass
class LoadConfig:
    stage: str = "dit"                # encoder | dit | decoder | pipeline
    concurrency: int = 1
    requests: int = 0                 # total requests (0: use duration_s)
    duration_s: float = 0.0           # issue requests for this long
    rps: float = 0.0                  # start at most this many requests per second (0: as fast as concurrency allows)
    width: int = 256
    height: int = 256
    frames: int = 22
    steps: int = 1
    cache_hits: bool = False          # encoder: one prompt for all requests (the cached path)
    inject_invalid: int = 0           # every K-th request deliberately invalid (0: never)
    text_dim: int = 0                 # DiT: text state width (0: discover with one Encode call)
    text_len: int = 0                 # DiT: text state length (0: as the discovery Encode returned, else 32)
    decode_format: str = "mp4"        # decoder: mp4 | raw
    timeout_s: float = 600.0          # per-RPC deadline
    seed: int = 0

    def validate(self) -> None:
        if self.stage not in ("encoder", "dit", "decoder", "pipeline"):
            raise ValueError(f"--stage {self.stage!r}: use encoder, dit, decoder or pipeline")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if (self.requests > 0) == (self.duration_s > 0):
            raise ValueError("give exactly one of --requests N or --duration S (both positive)")
        if self.rps < 0 or self.inject_invalid < 0:
            raise ValueError("--rps and --inject-invalid must be >= 0")
        if self.decode_format not in ("mp4", "raw"):
            raise ValueError(f"--format {self.decode_format!r}: use mp4 or raw")


@dataclass
class StageTiming:
    stage: str
    offset_s: float                   # start of this stage's RPC, relative to the request's start
    wall_s: float                     # client-side duration of the RPC
    timing: dict                      # the stage's Timing (queue_s, lease_wait_s, load_s, compute_s, transfer_s)


@dataclass
class RequestRecord:
    index: int
    invalid: bool
    start_s: float                    # relative to the run's start
    end_s: float = 0.0
    code: str = "OK"                  # gRPC status name, or CLIENT_<ExceptionName> for client-side failures
    detail: str = ""
    stages: list[StageTiming] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    step_ms: list[float] = field(default_factory=list)
    cache_hit: bool | None = None

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    def count(self, direction: str, n: int) -> None:
        """A stage-level call's `on_bytes`: payload bytes sent or received."""
        if direction == "sent":
            self.bytes_sent += n
        else:
            self.bytes_received += n

    def add(self, r: StageResult, offset_s: float) -> None:
        """A stage call's result, started `offset_s` after the request."""
        self.stages.append(StageTiming(r.stage, offset_s, r.wall_s, _timing_dict(r.timing)))

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    def phase(self, name: str) -> float:
        return sum(s.timing.get(name, 0.0) for s in self.stages)

    @property
    def queue_wait_s(self) -> float:
        return self.phase("queue_s") + self.phase("lease_wait_s")

    @property
    def service_s(self) -> float:
        return self.phase("load_s") + self.phase("compute_s") + self.phase("transfer_s")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    return {"n": len(values), "mean": sum(values) / len(values) if values else 0.0, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values) if values else 0.0}


def _timing_dict(t: common_pb2.Timing) -> dict:
    return {k: getattr(t, k) for k in PHASES}


# ---- one request: a stage call, or a render -------------------------------------------------------------------


class _Inputs:
    """Synthetic, valid inputs per request (deterministic in the request index)."""

    def __init__(self, cfg: LoadConfig, run_id: str, text_shape: tuple[int, int], text_dtype: torch.dtype):
        self.cfg = cfg
        self.run_id = run_id
        self.text_shape = text_shape
        self.text_dtype = text_dtype

    def spec(self, i: int, invalid: bool) -> RenderSpec:
        c = self.cfg
        return RenderSpec(prompt=self.prompt(i, False), width=INVALID_WIDTH if invalid else c.width, height=c.height,
                          frames=c.frames, steps=c.steps, seed=c.seed + i)

    def prompt(self, i: int, invalid: bool) -> str:
        if invalid:
            return ""  # empty prompt: INVALID_ARGUMENT
        if self.cfg.cache_hits:
            return "loadtest: a red kite over a windy beach, waves and gulls"
        return f"loadtest {self.run_id} #{i}: a red kite over a windy beach, waves and gulls, take {i}"

    def _gen(self, i: int) -> torch.Generator:
        import torch

        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + i)

    def text_states(self, i: int) -> torch.Tensor:
        import torch

        return torch.randn(self.text_shape, generator=self._gen(i)).to(self.text_dtype)

    def latents(self, i: int, spec: RenderSpec) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        g = self._gen(i)
        # For an invalid spec, latents of the *valid* shape: the server must reject the declared size.
        ok = RenderSpec(width=self.cfg.width, height=self.cfg.height, frames=spec.frames)
        shapes = tensor_shapes(SAMPLE_OUTPUTS, ok)  # minimax_h3.contract: video [24, T, H/16, W/16], audio [2, 32, Ta]
        return tuple(torch.randn(shapes[n], generator=g) for n in SAMPLE_OUTPUTS)


def _encode(clients: StageClients, prompt: str, job_id: str, rec: RequestRecord, timeout_s: float,
            t_req: float) -> torch.Tensor:
    from render_svc.stage_calls import encode

    t0 = time.monotonic()
    states, r = encode(clients, prompt, job_id, timeout_s=timeout_s, on_bytes=rec.count)
    rec.cache_hit = r.extra["cache_hit"]
    rec.add(r, t0 - t_req)
    return states


def _sample(clients: StageClients, spec: RenderSpec, text: torch.Tensor, job_id: str, rec: RequestRecord,
            timeout_s: float, t_req: float) -> None:
    from render_svc.stage_calls import sample

    def progress(p: common_pb2.Progress) -> None:
        if p.step and p.step_ms:
            rec.step_ms.append(p.step_ms)

    t0 = time.monotonic()
    *_, r = sample(clients, spec, text, job_id, progress, timeout_s, on_bytes=rec.count)
    rec.add(r, t0 - t_req)


def _decode(clients: StageClients, spec: RenderSpec, video: torch.Tensor, audio: torch.Tensor, job_id: str,
            rec: RequestRecord, fmt: str, timeout_s: float, t_req: float, out: Path) -> None:
    """MP4 into `out` (removed once counted) or RAW frames and audio, each checked as the stage-level calls do."""
    from render_svc.stage_calls import decode, decode_raw

    t0 = time.monotonic()
    if fmt == "raw":
        *_, r = decode_raw(clients, spec, video, audio, job_id, timeout_s=timeout_s, on_bytes=rec.count)
    else:
        try:
            r = decode(clients, spec, video, audio, out, job_id, timeout_s=timeout_s, on_bytes=rec.count)
        finally:
            out.unlink(missing_ok=True)
    rec.add(r, t0 - t_req)


def _render(rc: RenderClient, req: render_pb2.RenderRequest, rec: RequestRecord, timeout_s: float, t_req: float,
            out: Path) -> None:
    """One render through the render service's Render call. Each stage's run comes in the job event logged as it
    ends (JobInfo.stages grows by one): its offset is that event's arrival less the stage's wall time."""

    def on_event(ev: render_pb2.RenderEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "progress" and ev.progress.stage == "dit" and ev.progress.step and ev.progress.step_ms:
            rec.step_ms.append(ev.progress.step_ms)
        elif kind == "job":
            now = time.monotonic() - t_req
            for run in ev.job.stages[len(rec.stages):]:
                rec.stages.append(StageTiming(run.stage, max(0.0, now - run.wall_s), run.wall_s,
                                              _timing_dict(run.timing)))

    try:
        info = rc.render(req, out, on_event, timeout_s=timeout_s)
        rec.bytes_received += info.output_bytes
    finally:
        out.unlink(missing_ok=True)


def _one(conn: StageClients | RenderClient, cfg: LoadConfig, inp: _Inputs, rec: RequestRecord, t_req: float,
         out_dir: Path) -> None:
    i, bad = rec.index, rec.invalid
    job_id = f"lt-{inp.run_id}-{i}"
    out = out_dir / f"{i}.mp4"
    if cfg.stage == "encoder":
        _encode(conn, inp.prompt(i, bad), job_id, rec, cfg.timeout_s, t_req)
    elif cfg.stage == "dit":
        _sample(conn, inp.spec(i, bad), inp.text_states(i), job_id, rec, cfg.timeout_s, t_req)
    elif cfg.stage == "decoder":
        spec = inp.spec(i, bad)
        video, audio = inp.latents(i, spec)
        _decode(conn, spec, video, audio, job_id, rec, cfg.decode_format, cfg.timeout_s, t_req, out)
    else:
        spec = replace(inp.spec(i, False), prompt=inp.prompt(i, bad))
        _render(conn, render_request(spec, label=f"loadtest {inp.run_id} #{i}"), rec, cfg.timeout_s, t_req, out)


def _discover_text(clients: StageClients, cfg: LoadConfig) -> tuple[tuple[int, int], torch.dtype]:
    """[L, text_dim] and dtype of the text states the DiT takes: from the flags, or one Encode call."""
    import torch

    if cfg.stage != "dit":
        return (0, 0), torch.float32
    if cfg.text_dim:
        return (cfg.text_len or 32, cfg.text_dim), torch.float32
    probe = RequestRecord(-1, False, 0.0)
    states = _encode(clients, "loadtest: text state shape probe", "lt-probe", probe, cfg.timeout_s, time.monotonic())
    return (cfg.text_len or states.shape[0], states.shape[1]), states.dtype


# ---- the run ----------------------------------------------------------------------------------------------------


@dataclass
class LoadReport:
    config: dict
    started_unix: float
    wall_s: float
    records: list[RequestRecord]
    server: dict = field(default_factory=dict)   # stage -> {method -> {code -> count}} (metrics delta), if scraped

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        errors = Counter(r.code for r in self.records if not r.ok)
        lat = [r.latency_s for r in ok]
        phases = {p: _dist([r.phase(p) for r in ok]) for p in PHASES}
        per_stage = {}
        for st in ("encoder", "dit", "decoder"):
            walls = [s.wall_s for r in ok for s in r.stages if s.stage == st]
            if walls:
                per_stage[st] = _dist(walls)
        steps = [ms for r in ok for ms in r.step_ms]
        return {
            "stage": self.config["stage"], "concurrency": self.config["concurrency"],
            "sent": len(self.records), "ok": len(ok), "errors": dict(sorted(errors.items())),
            "wall_s": self.wall_s, "throughput_rps": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "latency_s": _dist(lat),
            "queue_wait_s": _dist([r.queue_wait_s for r in ok]),
            "service_s": _dist([r.service_s for r in ok]),
            "phases_s": phases, "stage_wall_s": per_stage,
            "step_ms": _dist(steps) if steps else None,
            "cache_hits": sum(1 for r in ok if r.cache_hit) if self.config["stage"] == "encoder" else None,
            "bytes_sent": sum(r.bytes_sent for r in self.records),
            "bytes_received": sum(r.bytes_received for r in self.records),
            "server_counts": self.server or None,
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "config": self.config, "started_unix": self.started_unix,
                "requests": [{**asdict(r), "latency_s": r.latency_s, "queue_wait_s": r.queue_wait_s,
                              "service_s": r.service_s} for r in self.records]}


def run_loadtest(conn: StageClients | RenderClient, cfg: LoadConfig,
                 on_done: Callable[[RequestRecord], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> LoadReport:
    """Drive `cfg.concurrency` workers until `cfg.requests` were sent or `cfg.duration_s` passed.

    `conn`: the stages' clients for a stage's test, the render service's client for "pipeline". `on_start` runs
    after the setup calls (text-shape probe, cache priming), right before the first request: the place to snapshot
    server-side counters."""
    cfg.validate()
    if (cfg.stage == "pipeline") != isinstance(conn, RenderClient):
        how = "a render service's RenderClient" if cfg.stage == "pipeline" else "the stages' StageClients"
        raise ValueError(f"--stage {cfg.stage} is tested through {how}, got a {type(conn).__name__}")
    run_id = uuid.uuid4().hex[:8]
    shape, dtype = _discover_text(conn, cfg)
    inp = _Inputs(cfg, run_id, shape, dtype)
    if cfg.stage == "encoder" and cfg.cache_hits:  # prime the cache: every measured request is a hit
        _encode(conn, inp.prompt(0, False), f"lt-{run_id}-prime", RequestRecord(-1, False, 0.0), cfg.timeout_s,
                time.monotonic())
    if on_start is not None:
        on_start()
    with TemporaryDirectory(prefix="h3-loadtest-") as out_dir:  # each MP4 lives here until its bytes are counted
        return _drive(conn, cfg, inp, Path(out_dir), on_done)


def _drive(conn: StageClients | RenderClient, cfg: LoadConfig, inp: _Inputs, out_dir: Path,
           on_done: Callable[[RequestRecord], None] | None) -> LoadReport:
    records: list[RequestRecord] = []
    lock = threading.Lock()
    issued = [0]
    started_unix = time.time()
    t0 = time.monotonic()

    def next_index() -> int | None:
        with lock:
            i = issued[0]
            if cfg.requests and i >= cfg.requests:
                return None
            if cfg.duration_s and time.monotonic() - t0 >= cfg.duration_s:
                return None
            if cfg.duration_s and cfg.rps and i / cfg.rps >= cfg.duration_s:
                return None  # its start slot lies beyond the run
            issued[0] += 1
            return i

    def worker():
        while (i := next_index()) is not None:
            if cfg.rps:
                wait = t0 + i / cfg.rps - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            bad = bool(cfg.inject_invalid) and (i + 1) % cfg.inject_invalid == 0
            t_req = time.monotonic()
            rec = RequestRecord(i, bad, t_req - t0)
            try:
                _one(conn, cfg, inp, rec, t_req, out_dir)
            except grpc.RpcError as e:
                rec.code, rec.detail = e.code().name, e.details() or ""
            except StageError as e:  # e.g. a result that breaks the contract: the stage's fault, with its status
                rec.code, rec.detail = e.code.name, e.message
            except Exception as e:  # noqa: BLE001 - a client-side failure is one error of its own kind
                rec.code, rec.detail = f"CLIENT_{type(e).__name__}", str(e)
            rec.end_s = time.monotonic() - t0
            with lock:
                records.append(rec)
            if on_done is not None:
                on_done(rec)

    threads = [threading.Thread(target=worker, name=f"loadtest-{k}", daemon=True) for k in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records.sort(key=lambda r: r.index)
    return LoadReport(asdict(cfg), started_unix, time.monotonic() - t0, records)


# ---- Prometheus scrape (the stages' own view) ------------------------------------------------------------------


def scrape_request_counts(url: str, timeout_s: float = 5.0, settle_s: float = 0.0,
                          methods: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """{method: {code: count}} from a stage's /metrics (h3_grpc_requests_total).

    A stage counts a call once it is over, a moment after its client has the status; with `settle_s`, first wait
    (up to that long) until none of `methods` is in flight (h3_grpc_inflight), so calls just finished are in."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + settle_s
    while True:
        text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
        out: dict[str, dict[str, float]] = {}
        inflight = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "h3_grpc_requests_total":
                    out.setdefault(s.labels["method"], {})[s.labels["code"]] = s.value
                elif s.name == "h3_grpc_inflight" and s.labels["method"] in methods:
                    inflight += s.value
        if inflight == 0 or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)


def count_delta(before: dict, after: dict, methods: list[str]) -> dict[str, dict[str, int]]:
    out = {}
    for m in methods:
        codes = set(after.get(m, {})) | set(before.get(m, {}))
        d = {c: int(after.get(m, {}).get(c, 0) - before.get(m, {}).get(c, 0)) for c in sorted(codes)}
        out[m] = {c: n for c, n in d.items() if n}
    return out


# ---- text / HTML / PNG reports -------------------------------------------------------------------------------


def format_text(rep: LoadReport) -> str:
    s = rep.summary()
    lines = [f"loadtest {s['stage']}: {s['sent']} sent, {s['ok']} ok, errors {s['errors'] or '{}'}, "
             f"concurrency {s['concurrency']}, {s['wall_s']:.2f} s, {s['throughput_rps']:.3f} req/s"]
    lines.append(f"{'':<18}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")

    def row(name, d, scale=1.0, unit="s"):
        lines.append(f"{name + ' (' + unit + ')':<18}" + "".join(f"{d[k] * scale:>9.3f}" for k in ("mean", "p50", "p90", "p99", "max")))

    row("latency", s["latency_s"])
    row("queue wait", s["queue_wait_s"])
    row("service", s["service_s"])
    for p in PHASES:
        if s["phases_s"][p]["max"] > 0:
            row(f" {p[:-2]}", s["phases_s"][p])
    for st, d in s["stage_wall_s"].items():
        if len(s["stage_wall_s"]) > 1:
            row(f" {st} wall", d)
    if s["step_ms"]:
        row("step", s["step_ms"], unit="ms")
    if s["cache_hits"] is not None:
        lines.append(f"encoder cache hits: {s['cache_hits']}/{s['ok']}")
    lines.append(f"bytes sent {s['bytes_sent']:,}  received {s['bytes_received']:,}")
    if s["server_counts"]:
        for stage, methods in s["server_counts"].items():
            for m, codes in methods.items():
                lines.append(f"server {stage} {m}: {codes}")
    return "\n".join(lines)


COLORS = {"queue_s": "#f0a030", "lease_wait_s": "#d04040", "load_s": "#8060c0", "compute_s": "#3070c0",
          "transfer_s": "#40a060", "other": "#b0b0b0", "error": "#e03030", "hist": "#3070c0"}
LEGEND = [("queue", "queue_s"), ("lease wait", "lease_wait_s"), ("load", "load_s"), ("compute", "compute_s"),
          ("transfer", "transfer_s"), ("client/network", "other"), ("failed", "error")]


class _Canvas:
    """Rectangles, lines and text; rendered as SVG or (with Pillow) PNG. Enough for a histogram and a Gantt."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.items: list[tuple] = []

    def rect(self, x, y, w, h, fill, title=""):
        self.items.append(("rect", x, y, max(w, 0.5), h, fill, title))

    def line(self, x1, y1, x2, y2, color="#444"):
        self.items.append(("line", x1, y1, x2, y2, color))

    def text(self, x, y, s, anchor="start", size=11):
        self.items.append(("text", x, y, s, anchor, size))

    def svg(self) -> str:
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
               f'font-family="sans-serif" viewBox="0 0 {self.w} {self.h}">',
               f'<rect x="0" y="0" width="{self.w}" height="{self.h}" fill="white"/>']
        for it in self.items:
            if it[0] == "rect":
                _, x, y, w, h, fill, title = it
                t = f"<title>{html.escape(title)}</title>" if title else ""
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}">{t}</rect>')
            elif it[0] == "line":
                _, x1, y1, x2, y2, c = it
                out.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{c}"/>')
            else:
                _, x, y, s, anchor, size = it
                out.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">'
                           f'{html.escape(s)}</text>')
        out.append("</svg>")
        return "\n".join(out)

    def png(self) -> bytes:
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.w, self.h), "white")
        d = ImageDraw.Draw(img)
        for it in self.items:
            if it[0] == "rect":
                _, x, y, w, h, fill, _ = it
                d.rectangle([x, y, x + max(w, 1), y + h], fill=fill)
            elif it[0] == "line":
                _, x1, y1, x2, y2, c = it
                d.line([x1, y1, x2, y2], fill=c)
            else:
                _, x, y, s, anchor, _ = it
                tw = d.textlength(s)
                x = x - tw if anchor == "end" else (x - tw / 2 if anchor == "middle" else x)
                d.text((x, y - 10), s, fill="black")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()


def _nice_ticks(hi: float, n: int = 5) -> list[float]:
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [k * step for k in range(int(hi / step) + 1)]


def histogram_canvas(rep: LoadReport, w: int = 760, h: int = 260) -> _Canvas:
    c = _Canvas(w, h)
    lat = [r.latency_s for r in rep.records if r.ok]
    left, right, top, bottom = 50, 20, 25, 40
    c.text(w / 2, 16, f"latency of {len(lat)} successful requests (s)", anchor="middle", size=13)
    if not lat:
        c.text(w / 2, h / 2, "no successful requests", anchor="middle")
        return c
    lo, hi = min(lat), max(lat)
    if hi - lo < 1e-9:
        lo, hi = lo * 0.9, hi * 1.1 + 1e-6
    nb = max(5, min(30, int(math.sqrt(len(lat))) * 2))
    width = (hi - lo) / nb
    counts = [0] * nb
    for v in lat:
        counts[min(nb - 1, int((v - lo) / width))] += 1
    pw, ph = w - left - right, h - top - bottom
    cmax = max(counts)
    for k, n in enumerate(counts):
        bh = ph * n / cmax
        c.rect(left + pw * k / nb + 1, top + ph - bh, pw / nb - 2, bh, COLORS["hist"],
               f"{lo + k * width:.3f}-{lo + (k + 1) * width:.3f} s: {n}")
    c.line(left, top + ph, left + pw, top + ph)
    c.line(left, top, left, top + ph)
    for t in (t for t in _nice_ticks(cmax, 4) if t == int(t)):
        y = top + ph - ph * t / cmax
        c.text(left - 5, y + 4, f"{t:g}", anchor="end")
    for k in range(0, nb + 1, max(1, nb // 6)):
        c.text(left + pw * k / nb, top + ph + 15, f"{lo + k * width:.3g}", anchor="middle")
    for q, col in ((50, "#222"), (90, "#a0a"), (99, "#c00")):
        v = percentile(lat, q)
        x = left + pw * (v - lo) / (hi - lo)
        c.line(x, top, x, top + ph, col)
        c.text(x + 3, top + 10 + (q % 7) * 2, f"p{q} {v:.3f}")
    c.text(w / 2, h - 8, "seconds", anchor="middle")
    return c


def timeline_canvas(rep: LoadReport, w: int = 760, max_rows: int = 200) -> _Canvas:
    """A Gantt row per request: each stage's server-side phases laid out from the RPC's start, in order
    (queue, lease wait, load, compute, transfer); the rest of the RPC's client-side wall time is grey."""
    recs = rep.records[:max_rows]
    row_h = 14 if len(recs) <= 60 else 6
    left, right, top = 60, 20, 30
    h = top + row_h * len(recs) + 70
    c = _Canvas(w, h)
    c.text(w / 2, 16, f"per-request timeline ({len(recs)} of {len(rep.records)} requests)", anchor="middle", size=13)
    end = max((r.end_s for r in recs), default=1.0) or 1.0
    pw = w - left - right
    sx = pw / end
    for k, r in enumerate(recs):
        y = top + k * row_h
        if row_h >= 10:
            c.text(left - 5, y + row_h - 3, f"#{r.index}", anchor="end", size=9)
        if not r.ok:
            c.rect(left + r.start_s * sx, y + 1, (r.end_s - r.start_s) * sx, row_h - 2, COLORS["error"],
                   f"#{r.index} {r.code}: {r.detail[:120]}")
            continue
        c.rect(left + r.start_s * sx, y + 1, (r.end_s - r.start_s) * sx, row_h - 2, COLORS["other"],
               f"#{r.index} {r.latency_s:.3f} s")
        for st in r.stages:
            x = left + (r.start_s + st.offset_s) * sx
            for p in ("queue_s", "lease_wait_s", "load_s", "compute_s", "transfer_s"):
                d = st.timing.get(p, 0.0)
                if d > 0:
                    c.rect(x, y + 1, d * sx, row_h - 2, COLORS[p], f"#{r.index} {st.stage} {p[:-2]} {d:.3f} s")
                    x += d * sx
    base = top + row_h * len(recs)
    c.line(left, base + 2, left + pw, base + 2)
    for t in _nice_ticks(end, 6):
        c.text(left + t * sx, base + 16, f"{t:g}", anchor="middle")
    c.text(w / 2, base + 32, "seconds since the run started", anchor="middle")
    x = left
    for label, key in LEGEND:
        c.rect(x, base + 44, 10, 10, COLORS[key])
        c.text(x + 14, base + 53, label, size=10)
        x += 18 + 7 * len(label)
    return c


def html_report(rep: LoadReport) -> str:
    s = rep.summary()
    esc = html.escape

    def dist_row(name, d, unit="s"):
        return (f"<tr><td>{esc(name)} ({unit})</td>" + "".join(f"<td>{d[k]:.4f}</td>" for k in
                                                                ("mean", "p50", "p90", "p99", "max")) + "</tr>")

    rows = [dist_row("latency", s["latency_s"]), dist_row("queue wait", s["queue_wait_s"]),
            dist_row("service", s["service_s"])]
    rows += [dist_row(p[:-2], s["phases_s"][p]) for p in PHASES]
    rows += [dist_row(f"{st} wall", d) for st, d in s["stage_wall_s"].items()]
    if s["step_ms"]:
        rows.append(dist_row("step", s["step_ms"], "ms"))
    errs = "".join(f"<tr><td>{esc(k)}</td><td>{v}</td></tr>" for k, v in s["errors"].items()) or \
        "<tr><td colspan=2>none</td></tr>"
    server = ""
    if s["server_counts"]:
        server = "<h2>Stage metrics (h3_grpc_requests_total delta)</h2><pre>" + esc(
            json.dumps(s["server_counts"], indent=2)) + "</pre>"
    cfg = esc(json.dumps(rep.config))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>h3 loadtest {esc(s['stage'])}</title>
<style>body{{font-family:sans-serif;margin:20px;max-width:820px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}</style></head><body>
<h1>h3-stages load test: {esc(s['stage'])}</h1>
<p>{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(rep.started_unix))} &middot; {s['sent']} requests sent,
{s['ok']} ok, concurrency {s['concurrency']}, {s['wall_s']:.2f} s, <b>{s['throughput_rps']:.3f} req/s</b>,
{s['bytes_sent']:,} bytes sent / {s['bytes_received']:,} received</p>
<p><small>config: {cfg}</small></p>
<h2>Latency and time breakdown (successful requests)</h2>
<table><tr><th></th><th>mean</th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>{''.join(rows)}</table>
<p><small>queue wait = queue + lease wait; service = load + compute + transfer (upload + download), from the
Timing each stage returns.</small></p>
<h2>Errors by status code</h2><table>{errs}</table>
{server}
<h2>Latency histogram</h2>{histogram_canvas(rep).svg()}
<h2>Timeline</h2>{timeline_canvas(rep).svg()}
</body></html>
"""


def png_report(rep: LoadReport) -> bytes:
    """Histogram above timeline, one PNG (needs Pillow)."""
    from PIL import Image

    a, b = histogram_canvas(rep).png(), timeline_canvas(rep).png()
    ia, ib = Image.open(io.BytesIO(a)), Image.open(io.BytesIO(b))
    img = Image.new("RGB", (max(ia.width, ib.width), ia.height + ib.height), "white")
    img.paste(ia, (0, 0))
    img.paste(ib, (0, ia.height))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_report(rep: LoadReport, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        path.write_bytes(png_report(rep))
    else:
        path.write_text(html_report(rep), encoding="utf-8")


# ---- request messages for grpcurl / ghz ---------------------------------------------------------------------------


def request_messages(cfg: LoadConfig, index: int = 0, text_shape: tuple[int, int] = (0, 0)) -> list[dict]:
    """One valid request of `cfg.stage` as the JSON messages grpcurl (`-d @`, one object per message) and ghz
    (`-D file`, a JSON array) send: the request, then the tensor chunks (bytes base64, CRC-32C included)."""
    import torch
    from google.protobuf.json_format import MessageToDict

    from render_svc.stage_calls import decode_inputs, sample_inputs

    inp = _Inputs(cfg, "grpcurl", text_shape, torch.float32)
    if cfg.stage == "encoder":
        return [MessageToDict(encoder_pb2.EncodeRequest(prompt=inp.prompt(index, False)))]
    spec = inp.spec(index, False)
    if cfg.stage == "dit":
        if not text_shape[1]:
            raise ValueError("--stage dit needs --text-dim to write messages (5120 for the release model, "
                             "64 for the embedded tiny one)")
        msgs = list(sample_inputs(spec, f"grpcurl-{index}", inp.text_states(index)))
    elif cfg.stage == "decoder":
        msgs = list(decode_inputs(spec, f"grpcurl-{index}", *inp.latents(index, spec),
                                  decoder_pb2.RAW if cfg.decode_format == "raw" else decoder_pb2.MP4, 0))
    else:
        raise ValueError("messages are per stage: use --stage encoder, dit or decoder")
    return [MessageToDict(m) for m in msgs]


# ---- CLI ----------------------------------------------------------------------------------------------------------


def cmd_loadtest(args) -> int:
    from client.embedded import StackStartError
    from client.endpoints import EndpointError, connect_or_start, connect_render
    from client.words import rpc_words
    from stagekit.channels import Security

    cfg = LoadConfig(stage=args.stage, concurrency=args.concurrency, requests=args.requests or 0,
                     duration_s=args.duration or 0.0, rps=args.rps, width=args.width, height=args.height,
                     frames=args.frames, steps=args.steps, cache_hits=args.cache_hits,
                     inject_invalid=args.inject_invalid, text_dim=args.text_dim, text_len=args.text_len,
                     decode_format=args.format, timeout_s=args.timeout, seed=args.seed)
    try:
        if args.emit_messages:
            text_shape = (args.text_len or 32, args.text_dim)
            print(json.dumps(request_messages(cfg, 0, text_shape)))
            return 0
        cfg.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    security = Security(args.token, args.tls_ca)
    wanted = SERVICES[cfg.stage]
    metrics_urls: dict[str, str] = {}
    if args.metrics:  # the tested service's: the stage's, or for a render the render service's
        metrics_urls[wanted[0]] = args.metrics if "://" in args.metrics else f"http://{args.metrics}/metrics"
    with_metrics = {s: ["--metrics-port", "0"] for s in ("render", *STAGES)}
    # The services this test calls: a render service for "pipeline"; else one stage alone (a DiT started by itself
    # needs --text-dim, or an encoder to ask).
    needed = ("encoder", "dit") if cfg.stage == "dit" and not cfg.text_dim else (cfg.stage,)
    try:
        if cfg.stage == "pipeline":
            render, stack = connect_render(args, security, extra_args=with_metrics)
        else:
            endpoints, stack = connect_or_start(args, security, needed, with_metrics)
    except (EndpointError, StackStartError) as e:
        print(f"error: {e}" + (" (or give --text-dim, e.g. 5120, to test the DiT alone)"
                               if cfg.stage == "dit" and not cfg.text_dim else ""), file=sys.stderr)
        return 1
    if stack is not None:
        for s in wanted:
            mf = stack.run_dir / f"{s}.port.metrics"
            if mf.exists():
                metrics_urls[s] = f"http://127.0.0.1:{mf.read_text().strip()}/metrics"
    try:
        urls = {s: u for s, u in metrics_urls.items() if s in wanted}
        methods = {s: [m for m in METHODS[cfg.stage] if m.startswith(f"/{SERVICE_NAMES[s]}/")] for s in urls}
        before: dict = {}

        def snapshot() -> None:  # settled too: a call just finished (the probe, a prime) is counted before, not after
            before.update({s: scrape_request_counts(u, settle_s=10.0, methods=tuple(methods[s]))
                           for s, u in urls.items()})

        def print_request(r: RequestRecord) -> None:
            print(f"  #{r.index:<4} {r.code:<20} {r.latency_s:8.3f} s", file=sys.stderr)

        progress = None if args.json or args.quiet else print_request
        with RenderClient(render, security) if cfg.stage == "pipeline" else StageClients(endpoints, security) as conn:
            rep = run_loadtest(conn, cfg, progress, snapshot)
        if urls:
            rep.server = {}
            for s, u in urls.items():
                after = scrape_request_counts(u, settle_s=10.0, methods=tuple(methods[s]))
                rep.server[s] = count_delta(before[s], after, methods[s])
        if args.report:
            write_report(rep, Path(args.report))
            print(f"report written to {args.report}", file=sys.stderr)
        print(json.dumps(rep.to_json() if args.json_requests else rep.summary(), indent=2) if args.json
              else format_text(rep))
        return 0 if rep.summary()["ok"] == len(rep.records) or cfg.inject_invalid else 1
    except grpc.RpcError as e:
        print(f"error: {rpc_words(e)}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def add_parser(subparsers, add_endpoint_args) -> None:
    import os

    p = subparsers.add_parser("loadtest", help="load-test a stage or the pipeline (latency, throughput, errors)")
    what = p.add_argument_group("what to send")
    what.add_argument("--stage", required=True, choices=("encoder", "dit", "decoder", "pipeline"),
                      help="one stage alone (only its address is needed; dit also needs --text-dim or an encoder; "
                           "a stage listed with several replicas gets its calls spread over all of them, gRPC's "
                           "round_robin) or the whole pipeline: renders through a render service (--render; else one "
                           "is started over the stages)")
    what.add_argument("--width", type=int, default=256, help="render width (default: 256)")
    what.add_argument("--height", type=int, default=256, help="render height (default: 256)")
    what.add_argument("--frames", type=int, default=22, help="17n+5 frames (default: 22)")
    what.add_argument("--steps", type=int, default=1, help="sampling steps (default: 1)")
    what.add_argument("--seed", type=int, default=0, help="(default: 0)")
    what.add_argument("--cache-hits", action="store_true", help="encoder: repeat one prompt (measures the cached path)")
    what.add_argument("--inject-invalid", type=int, default=0, metavar="K",
                      help="make every K-th request deliberately invalid (default: 0 = none)")
    what.add_argument("--text-dim", type=int, default=0,
                      help="DiT: text state width, e.g. 5120 for H3 (default: ask the encoder once)")
    what.add_argument("--text-len", type=int, default=0, help="DiT: text state length (default: the probe's, or 32)")
    what.add_argument("--format", default="mp4", choices=("mp4", "raw"), help="decoder output format (default: mp4)")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default: 1)")
    load.add_argument("--requests", type=int, help="total requests to send")
    load.add_argument("--duration", type=float, help="send requests for this many seconds")
    load.add_argument("--rps", type=float, default=0.0, help="start at most this many requests per second "
                                                              "(default: 0 = no limit)")
    load.add_argument("--timeout", type=float, default=600.0, help="per-RPC deadline in seconds (default: 600)")
    out = p.add_argument_group("output")
    out.add_argument("--metrics", default="", help="host:port (or URL) of the tested stage's (pipeline: the render "
                                                   "service's) /metrics, to add its own request counts to the report")
    out.add_argument("--emit-messages", action="store_true",
                     help="print one valid request of --stage as a JSON array of messages (for ghz -D / grpcurl) "
                          "and exit")
    out.add_argument("--json", action="store_true", help="print the summary as JSON")
    out.add_argument("--json-requests", action="store_true", help="with --json: include every request's record")
    out.add_argument("--report", help="write a self-contained report: out.html (inline SVG) or out.png")
    out.add_argument("-q", "--quiet", action="store_true", help="no per-request lines")
    local = p.add_argument_group("local stack (started only when no stage is configured)")
    local.add_argument("--models-dir", default=os.environ.get("H3_MODELS_DIR", ""),
                       help="real checkpoints for the local stack (default: H3_MODELS_DIR, else the tiny embedded "
                            "model)")
    local.add_argument("--devices", default="", help="devices for the local stack, e.g. cuda:0 (default: CPU)")
    add_endpoint_args(p.add_argument_group("where the stages are (pipeline: the render service)"), render=True)
    p.set_defaults(fn=cmd_loadtest)
