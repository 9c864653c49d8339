"""H3's three stage services: their names, gRPC services and stubs, the endpoints that address them and a client's
channels to them (torch-free: the thin client and the render service import this; the channel plumbing itself is
model-agnostic, `stagekit/channels.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from h3.v1 import decoder_pb2_grpc, dit_pb2_grpc, encoder_pb2_grpc
from stagekit.channels import Security, open_channel

STAGES = ("encoder", "dit", "decoder")
SERVICE_NAMES = {"encoder": "h3.v1.TextEncoder", "dit": "h3.v1.DiTSampler", "decoder": "h3.v1.Decoder",
                 "render": "h3.v1.Renderer"}
_STUBS = {"encoder": encoder_pb2_grpc.TextEncoderStub, "dit": dit_pb2_grpc.DiTSamplerStub,
          "decoder": decoder_pb2_grpc.DecoderStub}


@dataclass
class Endpoints:
    encoder: str = ""
    dit: str = ""
    decoder: str = ""
    render: str = ""  # the render service beside them, when one runs

    def of(self, stage: str) -> str:
        return getattr(self, stage)

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages with an address (a tool may look at any subset, e.g. a DiT started alone)."""
        return tuple(s for s in STAGES if self.of(s))


class StageClients:
    """One channel + stub per stage with an address (`None` for the others); use as a context manager to close
    them."""

    def __init__(self, endpoints: Endpoints, security: Security | None = None):
        self.endpoints = endpoints
        self.security = security or Security()
        self.channels = {s: open_channel(endpoints.of(s), self.security) for s in endpoints.stages}
        for s in STAGES:
            setattr(self, s, _STUBS[s](self.channels[s]) if s in self.channels else None)

    def stub(self, stage: str):
        return getattr(self, stage)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def __enter__(self) -> "StageClients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
