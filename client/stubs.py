"""Channels and stubs for the three stages and the render service (torch-free: the thin client imports this).

An endpoint is a gRPC target: "127.0.0.1:50051", or several replicas
"ipv4:10.0.0.1:50051,10.0.0.2:50051", or "dns:///encoder.internal:50051".
Multi-address targets use gRPC's own client-side round_robin balancing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from h3.v1 import decoder_pb2_grpc, dit_pb2_grpc, encoder_pb2_grpc
from stagekit.transport import GRPC_OPTIONS

STAGES = ("encoder", "dit", "decoder")
SERVICE_NAMES = {"encoder": "h3.v1.TextEncoder", "dit": "h3.v1.DiTSampler", "decoder": "h3.v1.Decoder",
                 "render": "h3.v1.Renderer"}
_STUBS = {"encoder": encoder_pb2_grpc.TextEncoderStub, "dit": dit_pb2_grpc.DiTSamplerStub,
          "decoder": decoder_pb2_grpc.DecoderStub}


@dataclass
class Endpoints:
    encoder: str
    dit: str
    decoder: str
    render: str = ""  # the render service beside them, when one runs

    def of(self, stage: str) -> str:
        return getattr(self, stage)


@dataclass
class Security:
    token: str = ""           # bearer token sent as 'authorization' metadata
    tls_ca: str = ""          # PEM CA to verify servers (enables TLS)

    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def open_channel(target: str, security: Security | None = None) -> grpc.Channel:
    security = security or Security()
    options = list(GRPC_OPTIONS)
    if "," in target or target.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if security.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(security.tls_ca).read_bytes())
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


class StageClients:
    """One channel + stub per stage; use as a context manager to close them."""

    def __init__(self, endpoints: Endpoints, security: Security | None = None):
        self.endpoints = endpoints
        self.security = security or Security()
        self.channels = {s: open_channel(endpoints.of(s), self.security) for s in STAGES}
        self.encoder = _STUBS["encoder"](self.channels["encoder"])
        self.dit = _STUBS["dit"](self.channels["dit"])
        self.decoder = _STUBS["decoder"](self.channels["decoder"])

    def stub(self, stage: str):
        return getattr(self, stage)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def __enter__(self) -> "StageClients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def health_of(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> str:
    """'SERVING' | 'NOT_SERVING' | 'UNREACHABLE'."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"
