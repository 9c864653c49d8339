"""The Kubernetes manifests (deploy/k8s), the image they run (deploy/Dockerfile) and the steps of docs/scale_out.md,
checked without a cluster or a Docker engine.

`kubectl apply --dry-run=client` needs an API server to discover its types, so the manifests are checked against
Kubernetes' own schemas instead (kubernetes-validate, strict: unknown fields fail), and against this project:
- every container's command parses with the real argparse of the service it starts (torchrun's for a torchrun
  line), with the ConfigMap's settings in its environment (a bad value fails as it would in the pod);
- every ConfigMap key names a setting of its service;
- the probes are gRPC probes on the port the container passes as --health-port; Services select a workload and
  target a named port of it; stage pods request GPUs; every referenced ConfigMap, claim and Secret is defined or
  created by a command in docs/scale_out.md;
- the render Service exposes the render service's HTTP port (the web page, /v1/videos) beside its gRPC port;
- the docs' steps name the manifests' Secrets and their keys, the models claim, its mount path and the Job that fills
  it; the claim's access mode allows the Job's read-write mount beside the stages' read-only ones;
- the Dockerfile's commands, run as written on a build machine without a GPU (setup.sh with `--plan`), ask for a
  torch that the index they name has (a `+cpu` wheel only on the CPU index, a CUDA build's on its cuXXX index);
- the certificate the docs' TLS step makes (its commands run as written, kubectl aside) serves the render service:
  its health port answers in plain text alone, its TLS port takes a client that trusts the docs' CA through
  127.0.0.1 (a port-forward) with the docs' token (a real process).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3.v1 import render_pb2, render_pb2_grpc
from stagekit.channels import Security, open_channel
from stagekit.config import parse_config
from tests.render_svc_util import ROOT, SERVER_ENV, wait_for

K8S = ROOT / "deploy" / "k8s"
DOC = ROOT / "docs" / "scale_out.md"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


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


def pods() -> list[tuple[str, dict]]:
    """(name, pod spec) of everything that runs a pod: the workloads and the Jobs."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for _, d in manifests()
            if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def doc_blocks() -> list[str]:
    """The ```bash blocks of docs/scale_out.md, each with its indentation removed."""
    return [re.sub(r"(?m)^ +", "", b) for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)]


def secret_commands() -> dict[str, dict[str, str]]:
    """Secret name -> {key: file} from the docs' `kubectl -n h3 create secret generic NAME --from-file=KEY=FILE ...`."""
    out = {}
    text = " ".join(DOC.read_text().split())
    for cmd in re.findall(r"kubectl -n h3 create secret generic [^\s`]+(?: --from-file=[^\s`]+)+", text):
        words = cmd.split()
        out[words[6]] = dict(w.removeprefix("--from-file=").split("=", 1) for w in words[7:])
    return out


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


def test_render_service_exposes_its_http_port():
    """The web page and the HTTP video API (/v1/videos) are on the render service's --http-port: the container
    exposes it and the render Service forwards it, beside gRPC."""
    (c,) = [c for name, _, c in containers() if name == "render"]
    module, args = service_argv(c)
    cfg = parse_config(services()[module][0], args, env_prefix="H3_RENDER_")
    assert cfg.http_port > 0, "render: no --http-port"
    assert {"name": "http", "containerPort": cfg.http_port} in c["ports"], c["ports"]
    (svc,) = [d for _, d in of_kind("Service") if d["metadata"]["name"] == "render"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"grpc", "http"}, svc["spec"]["ports"]


def test_docs_steps_name_the_manifests_secrets_keys_claim_and_job():
    """Step by step (docs/scale_out.md) as the manifests have it: each Secret a pod reads is made by a `create secret`
    step with every key the pods read from it (a file under its mount, or a secretKeyRef); the models claim is filled
    by the Job the steps apply, mounted where the stages look; a claim that one pod writes while several pods mount
    it is ReadWriteMany; every path the steps apply exists."""
    made = secret_commands()
    cm = {k: str(v) for _, d in of_kind("ConfigMap") for k, v in d["data"].items()}
    for name, pod in pods():
        for c in pod["containers"]:
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            words = [*c.get("command", []), *c.get("args", [])]
            for v in pod["volumes"]:
                if "secret" not in v:
                    continue
                secret, where = v["secret"]["secretName"], mounts[v["name"]]["mountPath"]
                assert secret in made, f"{name}: Secret {secret} is made by no step"
                for w in words:
                    if w.startswith(where + "/"):
                        key = w[len(where) + 1:]
                        assert key in made[secret], f"{name}: {w} is key {key!r}, not made in {secret}: {made[secret]}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in made.get(ref["name"], {}), f"{name}: {e['name']} from {ref} is made by no step"
    # The models: one claim, filled by the Job, read where the ConfigMap points the stages.
    (path, job), = [(p, d) for p, d in manifests() if d["kind"] == "Job"]
    (vol,) = job["spec"]["template"]["spec"]["volumes"]
    claim = vol["persistentVolumeClaim"]["claimName"]
    (jc,) = job["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in jc["volumeMounts"] if m["name"] == vol["name"]]
    assert jc["command"] == ["python", "-m", "client", "models", "fetch", "--to", mount["mountPath"]], jc["command"]
    assert not mount.get("readOnly"), "the Job writes the models"
    for name, pod, c in containers():
        if name == "render":
            continue
        (v,) = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
        assert v["persistentVolumeClaim"]["readOnly"], f"{name} mounts {claim} read-write"
        (m,) = [m for m in c["volumeMounts"] if m["name"] == v["name"]]
        assert m["mountPath"] == mount["mountPath"] and m["readOnly"], name
    assert {v for k, v in cm.items() if k.endswith("_MODELS_DIR")} == {mount["mountPath"]}
    (pvc,) = [d for _, d in of_kind("PersistentVolumeClaim") if d["metadata"]["name"] == claim]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], pvc["spec"]["accessModes"]
    steps = "\n".join(doc_blocks())
    job_file = str(path.relative_to(ROOT))
    assert f"kubectl apply -f {job_file}" in steps and f"job/{job['metadata']['name']} " in steps
    for applied in re.findall(r"kubectl apply((?: -f \S+)+)", steps):
        for target in applied.split()[1::2]:
            assert (ROOT / target).exists(), f"the docs apply {target}, which does not exist"
    assert f"docker build -f {DOCKERFILE.relative_to(ROOT)} -t {jc['image']} ." in steps


# ---- the image ---------------------------------------------------------------------------------------------------


def dockerfile() -> tuple[dict[str, str], list[tuple[dict[str, str], str]]]:
    """(ARG defaults, [(the ENV set before it, RUN command)]) of deploy/Dockerfile, continuation lines joined."""
    args, env, runs = {}, {}, []
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "ENV":
            env.update(w.split("=", 1) for w in shlex.split(rest))
        elif word == "RUN":
            runs.append((dict(env), rest))
    return args, runs


def no_gpu_path(tmp_path: Path) -> str:
    """A PATH with the tools setup.sh's --plan uses and no nvidia-smi: a build machine without a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "dirname", "sed", "cat", "tail"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def planned_torch(plan: str) -> tuple[str, str]:
    """(torch requirement, index URL) of setup.sh's `plan: pip install torch... --index-url URL` line."""
    (spec, index), = re.findall(r"^plan: pip install (torch\S*) --index-url (\S+)", plan, re.M)
    return spec, index


def test_the_image_build_asks_for_a_torch_its_index_has(tmp_path):
    """Each RUN of the Dockerfile that runs scripts/setup.sh, run as written (the shell expands the build args) with
    --plan, on a machine without a GPU, for the default build and every other TORCH_BUILD: the torch it asks for is on
    the index it names (PyTorch's indexes: `+cpu` only on .../cpu; a CUDA build's `torch==V` as `V+cuXXX` on
    .../cuXXX), it is the build asked for, and nothing checks for a GPU the build machine lacks."""
    from client.machine import CUDA_BUILDS, TORCH_INDEX

    builds = ("cpu", *(tag for tag, _, _ in CUDA_BUILDS))
    args, runs = dockerfile()
    setup = [(env, part.strip()) for env, cmd in runs for part in cmd.split("&&") if "scripts/setup.sh" in part]
    assert setup, "the Dockerfile runs no scripts/setup.sh"
    path = no_gpu_path(tmp_path)
    # As written (the ARG defaults), then each build through the ARG the Dockerfile names for it.
    for build in ("", *builds):
        for env, part in setup:
            given = {"TORCH_BUILD": build} if build else {}
            r = subprocess.run([shutil.which("bash"), "-c", part + " --plan"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60, env={**env, "PATH": path, "PYTHON": sys.executable, **args, **given})
            assert r.returncode == 0, f"{part} ({given or args}): {r.stdout}{r.stderr}"
            spec, index = planned_torch(r.stdout)
            tag = index.removeprefix(TORCH_INDEX)
            local = spec.partition("+")[2]
            assert index.startswith(TORCH_INDEX) and tag in builds, index
            assert local in ("", tag) and (local == "cpu") == (tag == "cpu"), f"{spec} is not on {index}"
            assert tag == (build or args["TORCH_BUILD"]), (given or args, index)
            assert "check that torch sees the GPU" not in r.stdout, r.stdout
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "run", ".git"} <= set(ignore), "COPY . . would bring this checkout's .venv / run dir along"
    assert re.search(r"^WORKDIR /opt/h3-stages$", DOCKERFILE.read_text(), re.M)
    assert re.search(r"^ENV PATH=/opt/h3-stages/\.venv/bin:", DOCKERFILE.read_text(), re.M)


def test_setup_takes_an_index_only_with_the_torch_it_serves(tmp_path):
    """TORCH_INDEX_URL alone would pair the build's own torch (a `+cpu` wheel without a GPU) with an index that does
    not have it: refused before anything is installed, naming --build; with TORCH_SPEC the pair is the user's."""
    env = {"PATH": no_gpu_path(tmp_path), "PYTHON": sys.executable}
    cu = "https://download.pytorch.org/whl/cu128"
    r = subprocess.run(["bash", "scripts/setup.sh", "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**env, "TORCH_INDEX_URL": cu})
    assert r.returncode == 2 and f"TORCH_INDEX_URL={cu} without TORCH_SPEC" in r.stderr and "--build" in r.stderr
    assert "plan:" not in r.stdout, r.stdout
    r = subprocess.run(["bash", "scripts/setup.sh", "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**env, "TORCH_INDEX_URL": cu, "TORCH_SPEC": "torch==2.13.0"})
    assert r.returncode == 0 and planned_torch(r.stdout) == ("torch==2.13.0", cu), r.stdout + r.stderr
    r = subprocess.run(["bash", "scripts/setup.sh", "--plan", "--build", "cu99"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and "invalid choice: 'cu99'" in r.stderr and "Traceback" not in r.stderr, r.stderr


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


def docs_certificate(d: Path) -> dict[str, Path]:
    """Run the docs' TLS step as written in `d` (its kubectl lines aside: no cluster) -> {Secret key: file} of h3-tls
    and h3-token as its `create secret` lines name them."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (the docs' TLS step uses it)")
    (block,) = [b for b in doc_blocks() if "openssl req" in b]
    script = "\n".join(ln for ln in block.splitlines() if not ln.startswith("kubectl "))
    d.mkdir()
    r = subprocess.run(["bash", "-euc", script], cwd=d, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    made = secret_commands()
    files = {k: d / f for k, f in {**made["h3-tls"], **made["h3-token"]}.items()}
    assert all(f.is_file() for f in files.values()), files
    return files


def test_docs_certificate_serves_the_render_service_and_its_health_port_health_alone(tmp_path):
    """The render service with the docs' certificate, key and token (their TLS step run as written): the certificate
    names every Service a TLS client dials in the cluster (the stages the render service reaches, the render
    Service) and chains to the docs' CA; a client trusting that CA reaches the TLS port through 127.0.0.1 (a
    port-forward) with the token; the plain-text --health-port serves gRPC health alone."""
    files = docs_certificate(tmp_path / "tls")
    sans = subprocess.run(["openssl", "x509", "-in", str(files["tls.crt"]), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout
    (c,) = [c for name, _, c in containers() if name == "render"]
    _, args = service_argv(c)
    dialed = [flag(args, f"--{s}").removeprefix("dns:///").rsplit(":", 1)[0] for s in ("encoder", "dit", "decoder")]
    for host in (*dialed, "render.h3.svc.cluster.local"):
        assert f"DNS:{host}" in sans, (host, sans)
    assert subprocess.run(["openssl", "verify", "-CAfile", str(files["ca.crt"]), str(files["tls.crt"])],
                          capture_output=True).returncode == 0
    health_port = free_port()
    cmd = [sys.executable, "-m", "render_svc", "--port", "0", "--port-file", str(tmp_path / "render.port"),
           "--health-port", str(health_port), "--tls-cert", str(files["tls.crt"]), "--tls-key", str(files["tls.key"]),
           "--token-file", str(files["token"]), "--run-dir", str(tmp_path / "run"),
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
        security = Security(files["token"].read_text().strip(), str(files["ca.crt"]))
        with open_channel(f"127.0.0.1:{port}", security) as ch:
            render_pb2_grpc.RendererStub(ch).List(render_pb2.ListRequest(), timeout=10, metadata=security.metadata())
            with pytest.raises(grpc.RpcError) as e:
                render_pb2_grpc.RendererStub(ch).List(render_pb2.ListRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.terminate()
        proc.wait(30)
