"""The Kubernetes manifests (deploy/k8s) and the image they run (deploy/Dockerfile), checked without a cluster.

`kubectl apply --dry-run=client` needs an API server to discover its types, so the manifests are checked against
Kubernetes' own schemas instead (kubernetes-validate, strict: unknown fields fail), and against this project:
- every container's command parses with the real argparse of the service it starts (torchrun's for a torchrun
  line), with the ConfigMap's settings in its environment (a bad value fails as it would in the pod);
- every ConfigMap key names a setting of its service;
- the probes are gRPC probes on the port the container passes as --health-port; Services select a workload and
  target a named port of it; stage pods request GPUs; every referenced ConfigMap, claim and Secret is defined or
  created by a command in docs/scale_out.md;
- --health-port answers gRPC health in plain text beside a TLS + token port, and nothing else (a real process).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3.v1 import render_pb2, render_pb2_grpc
from stagekit.config import parse_config
from tests.render_svc_util import ROOT, SERVER_ENV, self_signed_cert, token_file, wait_for

K8S = ROOT / "deploy" / "k8s"
DOC = ROOT / "docs" / "scale_out.md"


def services() -> dict[str, tuple[type, str]]:
    """module -> (its config class, its env prefix), as each server's main() parses them."""
    from decoder_svc.server import DecoderConfigArgs
    from dit_svc.server import DiTConfigArgs
    from encoder_svc.server import EncoderConfigArgs
    from render_svc.server import RenderConfig

    return {"encoder_svc": (EncoderConfigArgs, "H3_ENCODER_"), "dit_svc": (DiTConfigArgs, "H3_DIT_"),
            "decoder_svc": (DecoderConfigArgs, "H3_DECODER_"), "render_svc": (RenderConfig, "H3_RENDER_")}


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def of_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in manifests() if d["kind"] == kind]


def workloads() -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def containers() -> list[tuple[str, dict, dict]]:
    """(workload name, pod spec, container) for every container of every workload."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"], c)
            for _, d in workloads() for c in d["spec"]["template"]["spec"]["containers"]]


def service_argv(c: dict) -> tuple[str, list[str]]:
    """The module a container runs and its arguments (after torchrun's own, which must parse with torchrun's
    parser). Kubernetes' $(VAR) references are filled with a sample value."""
    argv = [a.replace("$(POD_NAME)", "dit-lead-0") for a in [*c["command"], *c.get("args", [])]]
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = get_args_parser().parse_args(argv[1:])
        assert ns.module, f"{c['name']}: torchrun without -m"
        return ns.training_script, list(ns.training_script_args)
    assert argv[:2] == ["python", "-m"], f"{c['name']}: {argv[:3]}"
    return argv[2], argv[3:]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_manifests_pass_the_kubernetes_schemas():
    import kubernetes_validate

    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "ConfigMap", "StatefulSet"}
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata']['name']}: {e}") from None


def test_one_deployment_per_stage_with_gpus():
    deployments = {d["metadata"]["name"]: d for _, d in of_kind("Deployment")}
    assert set(deployments) == {"encoder", "dit", "decoder", "render"}
    for name, d in deployments.items():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        module, _ = service_argv(c)
        assert module == f"{name}_svc", name
        ranks = int(flag(c["command"], "--nproc-per-node")) if c["command"][0] == "torchrun" else 1
        assert gpus == (0 if name == "render" else ranks), f"{name}: {gpus} GPUs for {ranks} ranks"
    assert int(deployments["dit"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
               ["nvidia.com/gpu"]) > 1


def test_commands_parse_with_each_service_and_the_configmap(monkeypatch):
    (_, cm), = of_kind("ConfigMap")
    for key, value in cm["data"].items():
        monkeypatch.setenv(key, str(value))
    table = services()
    seen = set()
    for name, _, c in containers():
        module, args = service_argv(c)
        cls, prefix = table[module]
        cfg = parse_config(cls, args, env_prefix=prefix)  # SystemExit on an unknown flag or a bad value
        seen.add(module)
        assert cfg.health_port > 0 and cfg.host == "0.0.0.0", name
        # Off the pod's loopback: TLS and a token from files (the Secrets), never --insecure.
        assert cfg.tls_cert and cfg.tls_key and cfg.token_file and not cfg.insecure, name
        if module != "render_svc":
            assert cfg.models_dir == "/models" and cfg.lease_dir.startswith("/run/h3/"), name
    assert seen == set(table)


def test_configmap_keys_name_real_settings():
    (_, cm), = of_kind("ConfigMap")
    fields = {prefix: {f.name.upper() for f in dataclasses.fields(cls)} for cls, prefix in services().values()}
    for key in cm["data"]:
        prefix = next((p for p in fields if key.startswith(p)), None)
        assert prefix is not None and key[len(prefix):] in fields[prefix], f"{key} is no service's setting"


def test_probes_are_grpc_health_on_the_health_port():
    for name, _, c in containers():
        _, args = service_argv(c)
        port = int(flag(args, "--health-port"))
        assert {"name": "health", "containerPort": port} in c["ports"], name
        probes = [c[k] for k in ("readinessProbe", "livenessProbe") if k in c]
        if name == "dit-node":  # follows rank 0 on another host: no gRPC server of its own
            assert not probes
            continue
        assert len(probes) == 2, f"{name}: readiness and liveness"
        for p in probes:
            assert p["grpc"] == {"port": port}, f"{name}: {p}"


def test_references_resolve():
    pods = [(d["metadata"]["namespace"], d["spec"]["template"]["metadata"]["labels"],
             {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]})
            for _, d in workloads()]
    for _, svc in of_kind("Service"):
        sel = svc["spec"]["selector"]
        matched = [ports for ns, labels, ports in pods
                   if ns == svc["metadata"]["namespace"] and sel.items() <= labels.items()]
        assert matched, f"Service {svc['metadata']['name']} selects no workload"
        for p in svc["spec"]["ports"]:
            assert all(p["targetPort"] in ports for ports in matched), f"{svc['metadata']['name']}: {p}"
    claims = {d["metadata"]["name"] for _, d in of_kind("PersistentVolumeClaim")}
    maps = {d["metadata"]["name"] for _, d in of_kind("ConfigMap")}
    doc = DOC.read_text()
    for name, pod, c in containers():
        for v in pod["volumes"]:
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
            if "secret" in v:  # made by the operator, as the doc says
                assert f"kubectl -n h3 create secret generic {v['secret']['secretName']} " in doc, name
        for ref in c.get("envFrom", []):
            assert ref["configMapRef"]["name"] in maps, name
        assert c["image"] in (ROOT / "deploy" / "Dockerfile").read_text(), f"{name}: {c['image']} is not built"


def test_rendezvous_names_rank_zero():
    """The two-host DiT: the node whose --local-addr sorts first is rank 0 (torchrun orders nodes by it), and that
    is the one the `dit` Service and the probes point at; the rendezvous endpoint is its pod."""
    sets = {d["metadata"]["name"]: d for _, d in of_kind("StatefulSet")}
    addrs = {}
    for name, d in sets.items():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        addrs[name] = flag(c["command"], "--local-addr").replace("$(POD_NAME)", f"{name}-0")
        endpoint = flag(c["command"], "--rdzv-endpoint")
    lead = min(addrs, key=addrs.get)
    assert lead == "dit-lead" and endpoint.startswith(addrs[lead] + ":")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_port_serves_health_alone(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    health_port = free_port()
    cmd = [sys.executable, "-m", "render_svc", "--port", "0", "--port-file", str(tmp_path / "render.port"),
           "--health-port", str(health_port), "--tls-cert", str(cert), "--tls-key", str(key),
           "--token-file", str(token_file(tmp_path, "s3cret")), "--run-dir", str(tmp_path / "run"),
           "--encoder", "127.0.0.1:1", "--dit", "127.0.0.1:1", "--decoder", "127.0.0.1:1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **SERVER_ENV, "TMPDIR": str(tmp_path)})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service: str = "") -> int | None:
                try:
                    return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                except grpc.RpcError:
                    assert proc.poll() is None, "the render service exited"
                    return None

            wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 60, "health SERVING on the port")
            assert status("h3.v1.Renderer") == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:  # the service itself is not on the plain-text port
                render_pb2_grpc.RendererStub(ch).List(render_pb2.ListRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        port = int((tmp_path / "render.port").read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # the service port speaks TLS only
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(30)
