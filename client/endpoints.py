"""Where the services are. The render service: --render, env H3_RENDER, or the endpoints file `scripts/up.sh`
writes (run/endpoints.env). The stages: --encoder/--dit/--decoder, env H3_ENCODER/H3_DIT/H3_DECODER, or the same
file. With none configured and reachable, an embedded local stack (for `render`, with its own render service).

Its own module so every command (render, jobs, status, loadtest) shares it without importing the CLI entry point.
Torch-free: the thin client imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from client.stubs import SERVICE_NAMES, STAGES, Endpoints, Security, StageClients, health_of, open_channel

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


def configured_render(args) -> str:
    return (args.render or os.environ.get("H3_RENDER")
            or _read_endpoints_file(Path(args.endpoints_file)).get("H3_RENDER", ""))


def _render_reachable(target: str, security: Security) -> bool:
    ch = open_channel(target, security)
    try:
        return health_of(ch, SERVICE_NAMES["render"]) != "UNREACHABLE"
    finally:
        ch.close()


def connect_render(args, security: Security, before_embedded: Callable[[], None] | None = None):
    """(render service address, stack): the configured render service if reachable; else one started here over the
    configured stages, else an embedded local stack with its own render service (stop the stack after).
    `before_embedded` runs first when the embedded stack is to be started (checks that would otherwise cost its
    start-up)."""
    from client.embedded import EmbeddedStack, StackConfig

    target = configured_render(args)
    if target and _render_reachable(target, security):
        return target, None
    if target:
        print(f"render service {target} is unreachable", file=sys.stderr)
    endpoints = configured_endpoints(args)
    over_stages = endpoints is not None and _reachable(endpoints, security)
    if not over_stages and before_embedded is not None:
        before_embedded()
    stack = EmbeddedStack(StackConfig(models_dir=args.models_dir, devices=args.devices, security=security,
                                      with_render=True, extra_args={"render": ["--http-port", "0"]}))
    if over_stages:
        print("starting a render service over the configured stages ...", file=sys.stderr)
        target = stack.start_render(endpoints)
    else:
        if endpoints is not None:
            print("configured endpoints are unreachable", file=sys.stderr)
        print("starting embedded stack (encoder, dit, decoder, render service) on loopback ...", file=sys.stderr)
        target = stack.start().render
    web = stack.run_dir / "render.port.http"
    if web.exists():
        print(f"render service web page: http://127.0.0.1:{web.read_text().strip()}/", file=sys.stderr)
    return target, stack


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


class _TokenFile(argparse.Action):
    """--token-file FILE: the token is the file's contents (stripped)."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            token = Path(value).read_text().strip()
        except OSError as e:
            parser.error(f"--token-file {value}: cannot read it ({e.strerror})")
        if not token:
            parser.error(f"--token-file {value} is empty")
        namespace.token = token


class _RefusedToken(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        parser.error("--token is not accepted on the command line (other local users can read it in "
                     "/proc/<pid>/cmdline); use --token-file FILE or the H3_TOKEN environment variable")


def add_endpoint_args(ap: argparse.ArgumentParser, render: bool = False, stages: bool = True) -> None:
    if render:
        ap.add_argument("--render", help="render service endpoint host:port (default: H3_RENDER or the endpoints file)")
    if stages:
        ap.add_argument("--encoder", help="text encoder endpoint host:port (or a list for round_robin)")
        ap.add_argument("--dit", help="DiT sampler endpoint")
        ap.add_argument("--decoder", help="decoder endpoint")
    ap.add_argument("--endpoints-file", default=str(DEFAULT_ENDPOINTS_FILE), help="file written by scripts/up.sh")
    ap.set_defaults(token=os.environ.get("H3_TOKEN", ""))
    ap.add_argument("--token-file", action=_TokenFile, help="file holding the bearer token for remote services "
                    "(default: the H3_TOKEN environment variable)")
    ap.add_argument("--token", dest="token_on_command_line", action=_RefusedToken, help=argparse.SUPPRESS)
    ap.add_argument("--tls-ca", default=os.environ.get("H3_TLS_CA", ""), help="CA certificate for TLS stages")
