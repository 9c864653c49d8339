"""Where the stages are: --encoder/--dit/--decoder, env H3_ENCODER/H3_DIT/H3_DECODER, or the endpoints file
`scripts/up.sh` writes (run/endpoints.env); with none configured and reachable, an embedded local stack.

Its own module so every command (render, status, loadtest) shares it without importing the CLI entry point.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from client.stubs import SERVICE_NAMES, STAGES, Endpoints, Security, StageClients, health_of

DEFAULT_ENDPOINTS_FILE = Path("run/endpoints.env")


def _read_endpoints_file(path: Path) -> dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def configured_endpoints(args) -> Endpoints | None:
    file_vals = _read_endpoints_file(Path(args.endpoints_file))
    vals = {}
    for s in STAGES:
        vals[s] = getattr(args, s) or os.environ.get(f"H3_{s.upper()}") or file_vals.get(f"H3_{s.upper()}")
    if not any(vals.values()):
        return None
    missing = [s for s, v in vals.items() if not v]
    if missing:
        raise SystemExit(f"endpoints configured for some stages but not {missing}; give --{' --'.join(missing)}")
    return Endpoints(**vals)


def _reachable(ep: Endpoints, security: Security) -> bool:
    with StageClients(ep, security) as c:
        return all(health_of(c.channels[s], SERVICE_NAMES[s]) != "UNREACHABLE" for s in STAGES)


def connect_or_start(args, security: Security, extra_args: dict[str, list[str]] | None = None):
    """(endpoints, stack): the configured stages if reachable, else an embedded local stack (stop it after)."""
    from client.embedded import EmbeddedStack, StackConfig

    endpoints = configured_endpoints(args)
    if endpoints is not None and _reachable(endpoints, security):
        return endpoints, None
    if endpoints is not None:
        print("configured endpoints are unreachable; starting an embedded local stack", file=sys.stderr)
    stack = EmbeddedStack(StackConfig(models_dir=args.models_dir, devices=args.devices, extra_args=extra_args or {}))
    print("starting embedded stack (encoder, dit, decoder) on loopback ...", file=sys.stderr)
    return stack.start(), stack


def add_endpoint_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--encoder", help="text encoder endpoint host:port (or a list for round_robin)")
    ap.add_argument("--dit", help="DiT sampler endpoint")
    ap.add_argument("--decoder", help="decoder endpoint")
    ap.add_argument("--endpoints-file", default=str(DEFAULT_ENDPOINTS_FILE), help="file written by scripts/up.sh")
    ap.add_argument("--token", default=os.environ.get("H3_TOKEN", ""), help="bearer token for remote stages")
    ap.add_argument("--tls-ca", default=os.environ.get("H3_TLS_CA", ""), help="CA certificate for TLS stages")
