"""Observability: a short load test against the real stage processes, whose own Prometheus counters must agree
with the client's accounting; the metrics interceptor's status codes; server reflection as grpcurl uses it."""

from __future__ import annotations

import json
import urllib.request
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from client.__main__ import main as client_main
from client.loadtest import LoadConfig, run_loadtest, scrape_request_counts
from minimax_h3.services import SERVICE_NAMES, STAGES
from stagekit.channels import open_channel
from stagekit.metrics import StageMetrics
from tests.waits import wait_until

SAMPLE = "/h3.v1.DiTSampler/Sample"


def metrics_url(stack, stage: str) -> str:
    s, _ = stack
    port = (s.run_dir / f"{stage}.port.metrics").read_text().strip()
    return f"http://127.0.0.1:{port}/metrics"


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of every h3_ sample."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("h3_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def settled(url: str, method: str) -> dict | None:
    """The scrape once no `method` call is in flight (a stage counts a call a moment after its client has the
    status), else None. A method never called yet has no inflight sample: settled too."""
    got = scrape(url)
    return got if got.get(("h3_grpc_inflight", (("method", method),)), 0) == 0 else None


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_loadtest_accounting_matches_stage_metrics(stack, clients):
    url = metrics_url(stack, "dit")
    # Settled on both sides: a Sample an earlier test just finished is counted a moment after its client had the
    # status, so an unsettled "before" could miss it and "after" count it as ours.
    before = wait_until(lambda: settled(url, SAMPLE), what="earlier Sample calls to be counted")
    cfg = LoadConfig(stage="dit", concurrency=3, requests=6, width=256, height=256, frames=22, steps=1,
                     inject_invalid=3, timeout_s=120)
    rep = run_loadtest(clients, cfg)
    # A stage counts a call once it is over, a moment after the client has its status: wait until none is left.
    after = wait_until(lambda: settled(url, SAMPLE), what="every Sample call to be counted")
    s = rep.summary()

    # Client accounting: every request sent is a success or an error with its status code.
    assert s["sent"] == 6 == s["ok"] + sum(s["errors"].values())
    assert s["errors"] == {"INVALID_ARGUMENT": 2}, [(r.code, r.detail) for r in rep.records]
    assert s["latency_s"]["p50"] <= s["latency_s"]["p90"] <= s["latency_s"]["p99"] <= s["latency_s"]["max"]
    assert s["throughput_rps"] > 0
    for r in rep.records:
        if r.ok:  # the Timing came back, and the server-side parts fit in the client-side wall time
            assert r.stages[0].timing["compute_s"] > 0
            assert r.queue_wait_s + r.service_s <= r.latency_s + 1e-3

    # The stage's own counters agree, including the aborted RPCs with their real code.
    assert delta(before, after, "h3_grpc_requests_total", method=SAMPLE, code="OK") == s["ok"]
    assert delta(before, after, "h3_grpc_requests_total", method=SAMPLE, code="INVALID_ARGUMENT") == 2
    assert sum(v for (n, lab), v in after.items() if n == "h3_grpc_requests_total" and ("method", SAMPLE) in lab) \
        - sum(v for (n, lab), v in before.items() if n == "h3_grpc_requests_total" and ("method", SAMPLE) in lab) == 6
    # Job phases: one observation per successful job; one DiT step per job; bytes as the client counted them.
    for phase in ("queue", "lease_wait", "load", "compute", "transfer"):
        assert delta(before, after, "h3_job_phase_seconds_count", phase=phase) == s["ok"]
    assert delta(before, after, "h3_step_seconds_count") == s["ok"] * cfg.steps
    assert delta(before, after, "h3_bytes_total", direction="out", method=SAMPLE) == s["bytes_received"]
    ok_sent = sum(r.bytes_sent for r in rep.records if r.ok)
    assert ok_sent <= delta(before, after, "h3_bytes_total", direction="in", method=SAMPLE) <= s["bytes_sent"]
    assert ("h3_queue_depth", ()) in after and ("h3_resident", ()) in after
    assert after[("h3_weight_load_seconds_count", ())] >= 1
    assert any(n == "h3_device_memory_bytes" for n, _ in after)
    assert after[("h3_stage_info", (("device", "cpu"), ("residency", "exclusive"), ("stage", "dit"),
                                    ("world_size", "1")))] == 1


def test_loadtest_cli_json_and_html_report(stack, tmp_path, capsys):
    s, ep = stack
    report = tmp_path / "enc.html"
    rc = client_main(["loadtest", "--stage", "encoder", "--concurrency", "2", "--requests", "3", "--json",
                      "--report", str(report), "--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder,
                      "--metrics", metrics_url(stack, "encoder").split("//")[1].split("/")[0]])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["sent"] == out["ok"] == 3 and out["errors"] == {}
    assert out["cache_hits"] == 0  # distinct prompts defeat the encoder cache
    assert out["server_counts"]["encoder"]["/h3.v1.TextEncoder/Encode"] == {"OK": 3}
    page = report.read_text()
    assert page.count("<svg") == 2 and "timeline" in page and "p50" in page


def test_loadtest_pipeline_renders_through_the_render_service(stack, tmp_path, capsys):
    """`--stage pipeline` sends Render calls to the render service (the one orchestration): each finished render
    reports its stages' timing in render order, the DiT's steps, the MP4's bytes; a refused request counts with its
    code, on the client and in the render service's own counters."""
    from tests.render_svc_util import serving

    _, ep = stack
    with serving(tmp_path / "run", ep, ["--metrics-port", "0"]) as svc:
        port = (svc.stack.run_dir / "render.port.metrics").read_text().strip()
        rc = client_main(["loadtest", "--stage", "pipeline", "--concurrency", "2", "--requests", "2",
                          "--inject-invalid", "2", "--json", "--json-requests", "--render", svc.target,
                          "--metrics", f"127.0.0.1:{port}"])
    out = json.loads(capsys.readouterr().out)
    s = out["summary"]
    assert rc == 0 and s["sent"] == 2 and s["ok"] == 1 and s["errors"] == {"INVALID_ARGUMENT": 1}, s
    ok = next(r for r in out["requests"] if r["code"] == "OK")
    assert [st["stage"] for st in ok["stages"]] == ["encoder", "dit", "decoder"]
    starts = [st["offset_s"] for st in ok["stages"]]
    assert starts == sorted(starts) and starts[-1] + ok["stages"][-1]["wall_s"] <= ok["latency_s"] + 1e-3
    assert ok["stages"][1]["timing"]["compute_s"] > 0 and len(ok["step_ms"]) == 1
    assert ok["bytes_received"] > 0 and s["bytes_received"] == ok["bytes_received"]
    assert s["server_counts"]["render"]["/h3.v1.Renderer/Render"] == {"INVALID_ARGUMENT": 1, "OK": 1}


def test_loadtest_refuses_the_wrong_connection():
    from client.render_client import RenderClient
    from minimax_h3.services import Endpoints, StageClients

    with StageClients(Endpoints()) as stages, pytest.raises(ValueError, match="render service"):
        run_loadtest(stages, LoadConfig(stage="pipeline", requests=1))
    with RenderClient("127.0.0.1:1") as rc, pytest.raises(ValueError, match="StageClients"):
        run_loadtest(rc, LoadConfig(stage="encoder", requests=1))


def test_reflection_lists_and_resolves_services(stack):
    """What grpcurl does: list services, then resolve each one's full descriptor (with imports) by reflection."""
    _, ep = stack
    for stage in STAGES:
        ch = open_channel(ep.of(stage))
        try:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10))
            names = {s.name for s in resp.list_services_response.service}
            assert {SERVICE_NAMES[stage], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
            svc = pool.FindServiceByName(SERVICE_NAMES[stage])
            assert {"Load", "Unload", "Warmup", "Status"} <= {m.name for m in svc.methods}
            assert pool.FindMessageTypeByName("h3.v1.Timing").fields_by_name["lease_wait_s"]
        finally:
            ch.close()


class _Echo:
    """Handlers that end in every way an RPC can: OK, abort, an unexpected exception, abort mid-stream, and a long
    job the client leaves (cancel or deadline), noticed by the handler only afterwards, in each way it can notice:
    reading the request stream (grpc raises), yielding a response nobody takes, or never again (grpc's callback)."""

    @staticmethod
    def unary(req, ctx):
        if req == b"abort":
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if req == b"boom":
            raise RuntimeError("bug")
        return req

    @staticmethod
    def stream(req_iter, ctx):
        for req in req_iter:
            if req == b"abort":
                ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "no weights")
            if req.startswith(b"slow"):  # a long job: runs until the client has gone, however long that takes
                wait_until(lambda: not ctx.is_active(), what="the client to leave")
                if req == b"slow-then-stop":
                    return
            yield req


LATE_NOTICE = (b"slow-then-read", b"slow-then-yield", b"slow-then-stop")


def test_interceptor_counts_real_status_codes():
    m = StageMetrics("test")
    handlers = {"U": grpc.unary_unary_rpc_method_handler(_Echo.unary),
                "S": grpc.stream_stream_rpc_method_handler(_Echo.stream)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[m.interceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Echo", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    m.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{m.port}/metrics"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            u, st = ch.unary_unary("/t.Echo/U"), ch.stream_stream("/t.Echo/S")
            assert u(b"hi", timeout=30) == b"hi"
            for payload, code in ((b"abort", grpc.StatusCode.RESOURCE_EXHAUSTED), (b"boom", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.RpcError) as e:
                    u(payload, timeout=30)
                assert e.value.code() == code
            assert list(st(iter([b"a", b"b"]), timeout=30)) == [b"a", b"b"]
            with pytest.raises(grpc.RpcError) as e:
                list(st(iter([b"a", b"abort", b"c"]), timeout=30))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            for slow in LATE_NOTICE:
                with pytest.raises(grpc.RpcError) as e:  # the deadline passes while the job runs
                    list(st(iter([slow, b"b"]), timeout=1.0))
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                call = st(iter([b"a", slow, b"b"]), timeout=60)  # the client cancels while the job runs
                assert next(call) == b"a"
                call.cancel()
                with pytest.raises(grpc.RpcError) as e:
                    next(call)
                assert e.value.code() == grpc.StatusCode.CANCELLED
        n = len(LATE_NOTICE)
        want = {"OK": 1, "FAILED_PRECONDITION": 1, "DEADLINE_EXCEEDED": n, "CANCELLED": n}
        # A call is counted once it is over (the abandoned ones when the server notices): wait until none is left.
        wait_until(lambda: m.registry.get_sample_value("h3_grpc_inflight", {"method": "/t.Echo/S"}) == 0
                   and m.registry.get_sample_value("h3_grpc_inflight", {"method": "/t.Echo/U"}) == 0,
                   what="every call to be counted")
        got = scrape_request_counts(url)
        assert got["/t.Echo/U"] == {"OK": 1, "RESOURCE_EXHAUSTED": 1, "UNKNOWN": 1}
        assert got["/t.Echo/S"] == want
    finally:
        server.stop(0)
        m.close()


def test_emitted_messages_work_as_grpcurl_sends_them(stack):
    """`loadtest --emit-messages` JSON -> messages built only from reflected descriptors (as grpcurl and ghz do)
    -> the stage accepts the request and finishes it."""
    from google.protobuf import json_format, message_factory

    from client.loadtest import request_messages
    from minimax_h3.dit.config import DiTConfig

    _, ep = stack
    cases = {"encoder": ("Encode", "EncodeRequest", False), "dit": ("Sample", "SampleInput", True),
             "decoder": ("Decode", "DecodeInput", True)}
    for stage, (method, input_type, streaming) in cases.items():
        cfg = LoadConfig(stage=stage, requests=1, decode_format="raw")
        msgs = json.loads(json.dumps(request_messages(cfg, 0, (4, DiTConfig.tiny().text_dim))))
        ch = open_channel(ep.of(stage))
        try:
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
            cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"h3.v1.{input_type}"))
            raw = [json_format.ParseDict(m, cls()).SerializeToString() for m in msgs]
            path = f"/{SERVICE_NAMES[stage]}/{method}"
            call = ch.stream_stream(path) if streaming else ch.unary_stream(path)
            replies = list(call(iter(raw) if streaming else raw[0], timeout=60))
            out_cls = message_factory.GetMessageClass(
                pool.FindServiceByName(SERVICE_NAMES[stage]).methods_by_name[method].output_type)
            last = out_cls.FromString(replies[-1])
            assert last.WhichOneof("event") == "done", (stage, last)
        finally:
            ch.close()
