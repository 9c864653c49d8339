"""gRPC channels to a service's replicas (torch-free: the thin client and the render service import this).

An endpoint is a gRPC target: "127.0.0.1:50051", or several replicas "10.0.0.1:50051,10.0.0.2:50051" (also written
"ipv4:10.0.0.1:50051,10.0.0.2:50051"), each optionally named ("a=10.0.0.1:50051,b=10.0.0.2:50051"), or
"dns:///encoder.internal:50051". A channel to a list uses gRPC's own client-side round_robin balancing (names
dropped); the render service instead holds one channel per replica (`replicas_of`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagekit.errors import FailedPrecondition
from stagekit.transport import GRPC_OPTIONS

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


def _items(target: str) -> list[str]:
    """A list target's items, the `ipv4:` scheme dropped from its front."""
    t = target.strip()
    if t.startswith("ipv4:"):
        t = t[len("ipv4:"):]
    return [i.strip() for i in t.split(",") if i.strip()]


def replicas_of(target: str) -> list[tuple[str, str]]:
    """(name, address) of each replica an endpoint lists, in order: "name=host:port" items keep their name, unnamed
    items of a list are named by position ("1", "2", ...), a single unnamed address is named "" (the stage itself).
    A `dns:` target is one replica (gRPC balances within it). FailedPrecondition for a name used twice or not
    [A-Za-z0-9_.-]."""
    if target.startswith("dns:") or not target.strip():
        return [("", target)]
    items = _items(target)
    out = []
    for i, item in enumerate(items):
        name, sep, addr = item.rpartition("=")
        if not sep:
            name = "" if len(items) == 1 else str(i + 1)
        elif not _NAME.match(name):
            raise FailedPrecondition(f"replica name {name!r} in {target!r}: use letters, digits, '_', '.', '-'")
        out.append((name, addr))
    names = [n for n, _ in out]
    if len(set(names)) < len(names):
        raise FailedPrecondition(f"{target!r} names a replica twice; give each replica its own name (name=host:port)")
    return out


def grpc_target(target: str) -> str:
    """The gRPC target of an endpoint: replica names dropped; a list of IP addresses gets the `ipv4:` scheme."""
    if target.startswith("dns:") or "," not in target and "=" not in target:
        return target
    addrs = [addr for _, addr in replicas_of(target)]
    if len(addrs) == 1:
        return addrs[0]

    def ipv4(addr: str) -> bool:
        try:
            ipaddress.IPv4Address(addr.rsplit(":", 1)[0])
            return True
        except ValueError:
            return False

    return ("ipv4:" if all(map(ipv4, addrs)) else "") + ",".join(addrs)


@dataclass
class Security:
    token: str = ""           # bearer token sent as 'authorization' metadata
    tls_ca: str = ""          # PEM CA to verify servers (enables TLS)

    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def open_channel(target: str, security: Security | None = None) -> grpc.Channel:
    security = security or Security()
    target = grpc_target(target)
    options = list(GRPC_OPTIONS)
    if "," in target or target.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if security.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(security.tls_ca).read_bytes())
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def health_of(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> str:
    """'SERVING' | 'NOT_SERVING' | 'UNREACHABLE'."""
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"
