"""Exposure: loopback by default, TLS + bearer token off loopback, no path traversal, message size limits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, decoder_pb2, dit_pb2, encoder_pb2
from minimax_h3.contract import RenderSpec, spec_to_proto
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import encode, sample
from stagekit.channels import Security, health_of, open_channel
from stagekit.server import MAX_MESSAGE_BYTES, ServeConfig, check_exposure
from stagekit.wire import tensor_chunks
from tests.conftest import SERVER_ENV
from tests.render_svc_util import self_signed_cert, token_file

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"
GOOD = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=5)
TEXT = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))


# ---- binding beyond loopback ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,extra,ok", [
    ("127.0.0.1", {}, True), ("::1", {}, True), ("localhost", {}, True),
    ("0.0.0.0", {}, False), ("::", {}, False), ("", {}, False),
    ("0.0.0.0", {"tls_cert": "c", "tls_key": "k"}, False),          # TLS alone is not enough: a token too
    ("0.0.0.0", {"token": "t"}, False),                              # a token in clear text is not enough
    ("0.0.0.0", {"tls_cert": "c", "tls_key": "k", "token": "t"}, True),
    ("0.0.0.0", {"insecure": True}, True),
])
def test_check_exposure(host, extra, ok):
    cfg = ServeConfig(host=host, **extra)
    if ok:
        check_exposure(cfg)
    else:
        with pytest.raises(SystemExit, match="refusing to bind"):
            check_exposure(cfg)


def test_stage_refuses_public_bind_without_tls(tmp_path, model_cache):
    r = subprocess.run([sys.executable, "-m", "dit_svc", "--host", "0.0.0.0", "--port", "0", "--devices", "virt0",
                        "--cache-dir", str(model_cache), "--lease-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env={**os.environ, **SERVER_ENV})
    assert r.returncode != 0 and "serving on" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert "refusing to bind 0.0.0.0" in last and "--tls-cert" in last and "--token" in last and "--insecure" in last


# ---- TLS + token on loopback ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_dit(tmp_path_factory, model_cache):
    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(d)
    sec = Security(token=TOKEN, tls_ca=str(cert))
    tokens = token_file(d, TOKEN)
    s = EmbeddedStack(StackConfig(ranks={"dit": 1}, cache_dir=str(model_cache), run_dir=str(d / "run"), devices="virt0",
                                  env=SERVER_ENV, security=sec,
                                  extra_args={"dit": ["--tls-cert", str(cert), "--tls-key", str(key),
                                                      "--token-file", str(tokens)]}))
    s.start_stage("dit")
    s.wait_ready("dit")
    yield s, sec
    s.stop()


def _clients(port: int, sec: Security) -> StageClients:
    return StageClients(Endpoints(**{k: f"127.0.0.1:{port}" for k in ("encoder", "dit", "decoder")}), sec)


def test_tls_with_token_works(tls_dit):
    s, sec = tls_dit
    # The token came from --token-file: no other local user can read it from the process's command line.
    assert TOKEN.encode() not in Path(f"/proc/{s.procs['dit'].pid}/cmdline").read_bytes()
    with _clients(s.ports["dit"], sec) as c:
        v, a, r = sample(c, GOOD, TEXT, timeout_s=120)
        assert torch.isfinite(v).all()
        st = c.dit.Status(common_pb2.StatusRequest(), timeout=10, metadata=sec.metadata())
        assert st.stage == "dit"


@pytest.mark.parametrize("token", ["", "wrong-token", TOKEN + "x"])
def test_tls_without_or_with_wrong_token_is_unauthenticated(tls_dit, token):
    s, sec = tls_dit
    with _clients(s.ports["dit"], Security(token=token, tls_ca=sec.tls_ca)) as c:
        for call in (lambda: c.dit.Status(common_pb2.StatusRequest(), timeout=10, metadata=c.security.metadata()),
                     lambda: sample(c, GOOD, TEXT, timeout_s=30)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in e.value.details()
        # Health stays open for load balancers and probes (it reveals nothing but SERVING/NOT_SERVING).
        assert health_of(c.channels["dit"], "h3.v1.DiTSampler") == "SERVING"


def test_plaintext_client_cannot_talk_to_tls_stage(tls_dit):
    s, _ = tls_dit
    ch = open_channel(f"127.0.0.1:{s.ports['dit']}")
    try:
        with pytest.raises(grpc.RpcError) as e:
            dit_stub = __import__("h3.v1.dit_pb2_grpc", fromlist=["x"]).DiTSamplerStub(ch)
            dit_stub.Status(common_pb2.StatusRequest(), timeout=5, metadata=Security(TOKEN).metadata())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ch.close()


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* show them) with a listening socket on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, p = f[1].rsplit(":", 1)
            if int(p, 16) == port and f[3] == "0A":
                out.add(addr)
    return out


def test_metrics_stay_on_loopback_when_the_stage_binds_all_interfaces(tmp_path, model_cache):
    """A stage exposed on 0.0.0.0 (here --insecure, token from the environment) serves /metrics, which is plain
    HTTP without auth, on loopback only unless --metrics-host says otherwise; the token never shows in the command
    line."""
    env = {**os.environ, **SERVER_ENV, "H3_DIT_TOKEN": TOKEN}
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "dit_svc", "--host", "0.0.0.0", "--insecure", "true", "--port", "0",
                             "--port-file", str(port_file), "--metrics-port", "0", "--devices", "virt0",
                             "--cache-dir", str(model_cache), "--lease-dir", str(tmp_path / "leases")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving on" in line:
                break
        banner = next((x for x in lines if "metrics on" in x), "")
        assert "metrics on http://127.0.0.1:" in banner and "loopback only" in banner, "".join(lines)[-3000:]
        mport = int((tmp_path / "port.metrics").read_text())
        assert _listeners(mport) == {"0100007F"}, f"/metrics listens on {_listeners(mport)}"
        from urllib.request import urlopen

        assert b"h3_stage_info" in urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read()
        assert TOKEN.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        with _clients(int(port_file.read_text()), Security()) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.dit.Status(common_pb2.StatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.dit.Status(common_pb2.StatusRequest(), timeout=10, metadata=Security(TOKEN).metadata()).stage
    finally:
        proc.terminate()
        proc.wait(60)
        proc.stdout.close()


# ---- no path traversal through names -------------------------------------------------------------------------------
def _decode_raw(clients, spec, output_name="", job_id=""):
    def gen():
        req = decoder_pb2.DecodeRequest(job_id=job_id, format=decoder_pb2.MP4, output_name=output_name)
        spec_to_proto(spec, req.params)
        yield decoder_pb2.DecodeInput(request=req)
        for name, t in (("video_latents", torch.zeros(24, 7, 16, 16)),
                        ("audio_latents", torch.zeros(2, 32, spec.audio_latents))):
            for ch in tensor_chunks(name, t):
                yield decoder_pb2.DecodeInput(tensor=ch)
    return list(clients.decoder.Decode(gen(), timeout=120))


@pytest.mark.parametrize("name", ["../x.mp4", "../../etc/passwd", "/tmp/abs.mp4", "a/b.mp4", "x\x00.mp4", "x\n.mp4"])
def test_decoder_rejects_path_like_output_names(clients, name):
    with pytest.raises(grpc.RpcError) as e:
        _decode_raw(clients, GOOD, output_name=name)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output name" in e.value.details()


@pytest.mark.parametrize("job_id", ["../evil", "a/b"])
def test_decoder_job_id_cannot_steer_the_default_name(clients, job_id):
    with pytest.raises(grpc.RpcError) as e:
        _decode_raw(clients, GOOD, job_id=job_id)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_decoder_bare_and_hidden_names(clients):
    names = {ev.file.name for ev in _decode_raw(clients, GOOD, output_name="clip.mp4") if ev.WhichOneof("event") == "file"}
    assert names == {"clip.mp4"}
    names = {ev.file.name for ev in _decode_raw(clients, GOOD, output_name=".hidden") if ev.WhichOneof("event") == "file"}
    assert names == {"render.mp4"}, "a hidden name falls back to the default, never a dotfile"


def test_requests_carry_no_paths_or_model_names():
    """Model files are chosen by the operator's flags only: no request field names a file, dir or model, except
    the decoder's output_name (checked above). A new path-like request field must come with its own check."""
    # window_mode, window_fuse, ref_image_size: names the contract checks (plan_windows, REF_IMAGE_SIZES / the stages'
    # ImageFit.of); more_prompts: prompts, as `prompt`.
    # prefix_digest, digest: an uploaded file's SHA-256, refused unless 64 hex digits (stagekit.uploads.UploadStore.path).
    allowed = {"prompt", "sampler", "scheduler", "quality", "job_id", "output_name", "name", "dtype", "mime", "stage",
               "prefix_digest", "digest", "window_mode", "window_fuse", "more_prompts", "ref_image_size"}
    for mod in (encoder_pb2, dit_pb2, decoder_pb2, common_pb2):
        for msg in mod.DESCRIPTOR.message_types_by_name.values():
            if not msg.name.endswith(("Request", "Input", "Params", "TensorChunk", "TensorHeader")):
                continue
            for f in msg.fields:
                if f.type == f.TYPE_STRING:
                    assert f.name in allowed, f"{msg.name}.{f.name}: a string request field needs a traversal check"


# ---- message size limits, both sides ------------------------------------------------------------------------------
def test_server_refuses_oversize_message_and_keeps_serving(clients):
    big = b"a" * (MAX_MESSAGE_BYTES + 1024)
    ch = grpc.insecure_channel(clients.endpoints.encoder, options=[("grpc.max_send_message_length", -1)])
    try:
        from h3.v1 import encoder_pb2_grpc

        with pytest.raises(grpc.RpcError) as e:
            list(encoder_pb2_grpc.TextEncoderStub(ch).Encode(encoder_pb2.EncodeRequest(prompt_bytes=big), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    finally:
        ch.close()
    # Under the transport cap but over the prompt cap: refused by validation with its own message.
    with pytest.raises(grpc.RpcError) as e:
        list(clients.encoder.Encode(encoder_pb2.EncodeRequest(prompt_bytes=b"a" * (5 << 20)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in e.value.details()
    states, _ = encode(clients, "still serving after abuse", timeout_s=60)
    assert states.shape[0] > 0


def test_client_refuses_to_send_oversize_message(clients):
    with pytest.raises(grpc.RpcError) as e:
        list(clients.encoder.Encode(encoder_pb2.EncodeRequest(prompt_bytes=b"a" * (MAX_MESSAGE_BYTES + 1)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(open_channel.__globals__["GRPC_OPTIONS"])["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
