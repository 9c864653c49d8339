"""Load: bounded queues, client deadlines, keepalive, and N concurrent clients per stage (exactly once)."""

from __future__ import annotations

import threading
import uuid
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from minimax_h3.contract import RenderSpec
from minimax_h3.services import StageClients
from render_svc import stage_calls
from render_svc.stage_calls import decode, encode, sample
from stagekit.channels import Security
from stagekit.lease import read_events
from stagekit.server import GRPC_OPTIONS
from tests.test_reliability import SLOW, TEXT, clients_for, start, start_sample_stream, status
from tests.waits import wait_until

N_CLIENTS = 8
SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=9)


# ---- N >= 8 concurrent clients against each stage of the shared stack: every job exactly once ------------------
def _done_ids(lease_dir, stage: str) -> list[str]:
    return [e["job"] for e in read_events(lease_dir) if e["event"] == "job_done" and e.get("stage") == stage]


def _run_concurrently(fn, n=N_CLIENTS):
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(fn, range(n)))


@pytest.mark.parametrize("stage", ["encoder", "dit", "decoder"])
def test_concurrent_clients_each_job_exactly_once(stack, tmp_path, stage):
    s, endpoints = stack
    tag = uuid.uuid4().hex[:6]
    ids = [f"load-{stage}-{tag}-{i}" for i in range(N_CLIENTS)]
    lat_v, lat_a = torch.randn(24, 7, 16, 16), torch.randn(2, 32, SPEC.audio_latents)

    def one(i):
        with StageClients(endpoints) as c:  # one channel per client, as separate users would have
            if stage == "encoder":
                states, r = encode(c, f"prompt {tag} number {i}: rain on leaves", ids[i], timeout_s=120)
                return states.shape[0] > 0 and not r.extra["cache_hit"]
            if stage == "dit":
                v, a, r = sample(c, RenderSpec(**{**SPEC.__dict__, "seed": i}), TEXT, ids[i], timeout_s=180)
                return bool(torch.isfinite(v).all())
            out = tmp_path / f"{i}.mp4"
            r = decode(c, SPEC, lat_v, lat_a, out, ids[i], timeout_s=180)
            return out.stat().st_size > 0 and r.extra["frames"] == 22

    assert all(_run_concurrently(one))
    done = [j for j in _done_ids(s.lease_dir, stage) if j.startswith(f"load-{stage}-{tag}-")]
    assert sorted(done) == sorted(ids), "every accepted job completes exactly once (none lost, none duplicated)"
    if stage == "decoder":
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i}.mp4" for i in range(N_CLIENTS))


# ---- bounded queue -> RESOURCE_EXHAUSTED ----------------------------------------------------------------------------
def test_full_queue_is_resource_exhausted(tmp_path, model_cache):
    s = start("dit", 1, tmp_path / "run", model_cache, ["--max-queue", "1"])
    try:
        with clients_for(s.ports["dit"]) as c:
            call1, _, stepped, box1, t1 = start_sample_stream(c, SLOW)  # running
            assert stepped.wait(60) and "error" not in box1
            call2, _, _, box2, t2 = start_sample_stream(c, SLOW)        # queued (the one slot)
            wait_until(lambda: status(c).queue_depth >= 1, what="the second job to be queued")
            assert status(c).queue_depth == 1
            with pytest.raises(grpc.RpcError) as e:                     # refused
                sample(c, SPEC, TEXT, timeout_s=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.value.details()
            call2.cancel()
            call1.cancel()
            t1.join(30)
            t2.join(30)
            wait_until(lambda: not (status(c).running or status(c).queue_depth), what="both cancelled jobs to go")
            v, a, r = sample(c, SPEC, TEXT, timeout_s=120)  # room again: served
            assert torch.isfinite(v).all()
    finally:
        s.stop()


# ---- every client RPC carries a deadline ------------------------------------------------------------------------------
class _Recorder:
    """Stands in for a stub method: records the kwargs of each call, returns an empty stream."""

    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):
        def call(*args, **kwargs):
            if args and hasattr(args[0], "__next__"):
                list(args[0])  # drain request generators like gRPC would
            self.log.append((name, kwargs))
            return iter(())
        return call


def test_stage_calls_pass_a_deadline_on_every_rpc(tmp_path):
    log = []
    fake = type("C", (), {})()
    fake.encoder = fake.dit = fake.decoder = _Recorder(log)
    fake.security = Security()
    for fn in (lambda: encode(fake, "x"), lambda: sample(fake, SPEC, TEXT),
               lambda: decode(fake, SPEC, torch.zeros(24, 7, 16, 16), torch.zeros(2, 32, SPEC.audio_latents),
                              tmp_path / "o.mp4")):
        with pytest.raises(Exception):  # empty streams: the stage call says the stage ended early
            fn()
    assert [n for n, _ in log] == ["Encode", "Sample", "Decode"]
    for name, kw in log:
        assert kw.get("timeout") and 0 < kw["timeout"] <= max(stage_calls.DEADLINES.values()), (name, kw)
    assert not list(tmp_path.iterdir()), "a failed decode leaves no partial file"


def test_every_client_rpc_call_site_has_a_timeout():
    """Static check over client/*.py and render_svc/*.py: each stub RPC call passes timeout= (a hung stage never
    hangs the client or the render service)."""
    import ast
    from pathlib import Path

    rpcs = {"Encode", "Sample", "Decode", "Status", "Load", "Unload", "Warmup", "Check"}
    missing = []
    root = Path(stage_calls.__file__).parents[1]
    for path in sorted([*(root / "client").glob("*.py"), *(root / "render_svc").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in rpcs:
                if not any(k.arg == "timeout" for k in node.keywords):
                    missing.append(f"{path.parent.name}/{path.name}:{node.lineno} {node.func.attr}")
    assert not missing, missing


# ---- keepalive: an idle long stream survives pings (our options, time-scaled 1/50) ---------------------------------
KEEPALIVE_KEYS = ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.http2.min_ping_interval_without_data_ms")


def _scaled(options, factor=50, **override):
    out = {k: (max(1, v // factor) if k in KEEPALIVE_KEYS else v) for k, v in options}
    out.update({k.replace("__", "."): v for k, v in override.items()})
    return list(out.items())


def _idle_watch(server_opts, client_opts, idle_s: float) -> str:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_opts)
    svc = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    svc.set("x", health_pb2.HealthCheckResponse.SERVING)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=client_opts)
    try:
        stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="x"), timeout=30)
        next(stream)
        threading.Timer(idle_s, lambda: svc.set("x", health_pb2.HealthCheckResponse.NOT_SERVING)).start()
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(next(stream).status)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
    finally:
        ch.close()
        server.stop(0)


def test_keepalive_settings_keep_an_idle_stream_alive():
    """A server-streaming call with no data for ~8 keepalive periods survives our client/server pairing.

    The real values (client pings every 30 s, server accepts one every 10 s) are scaled by 1/50. The control
    (a server that accepts pings less often than the client sends them) shows the pings really happen: that
    stream dies with GOAWAY too_many_pings, which is what a mismatched deployment would see mid-sample.
    """
    opts = dict(GRPC_OPTIONS)
    assert opts["grpc.keepalive_time_ms"] >= opts["grpc.http2.min_ping_interval_without_data_ms"]
    idle_s = 8 * opts["grpc.keepalive_time_ms"] / 50 / 1000
    assert _idle_watch(_scaled(GRPC_OPTIONS), _scaled(GRPC_OPTIONS), idle_s) == "NOT_SERVING"
    strict = _scaled(GRPC_OPTIONS, **{"grpc__http2__min_ping_interval_without_data_ms": 5000})
    got = _idle_watch(strict, _scaled(GRPC_OPTIONS), idle_s)
    assert got.startswith("UNAVAILABLE") and "ping" in got.lower(), got
