"""Where the services are. The render service: --render, env H3_RENDER, or the endpoints file `scripts/up.sh`
writes (run/endpoints.env). The stages: --encoder/--dit/--decoder, env H3_ENCODER/H3_DIT/H3_DECODER, or the same
file. With nothing configured, an embedded local stack (for `render`, with its own render service); a configured
address that does not answer is an error (`EndpointError`: the address, where it was set, the fix), never the tiny
model.

Its own module so every command (render, jobs, status, loadtest) shares it without importing the CLI entry point.
Torch-free: the thin client imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from client.words import rpc_words
from minimax_h3.services import SERVICE_NAMES, STAGES, Endpoints, StageClients
from stagekit.channels import Security, health_of, open_channel, replicas_of
from stagekit.errors import FailedPrecondition

if TYPE_CHECKING:
    from client.embedded import CtrlC
    from h3.v1 import common_pb2

DEFAULT_ENDPOINTS_FILE = Path("run/endpoints.env")


def _read_endpoints_file(path: Path) -> dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


class EndpointError(FailedPrecondition):
    """A configured service that does not answer, or a configuration that cannot serve the command; `str(e)` names
    the address, where it was configured and the fix. The CLI prints it and exits 1."""


def _source(args, stage: str) -> str:
    """Where the address of `stage` came from, in the user's words."""
    if getattr(args, stage, None):
        return f"--{stage}"
    if os.environ.get(f"H3_{stage.upper()}"):
        return f"H3_{stage.upper()}"
    return str(args.endpoints_file)


def configured_endpoints(args) -> Endpoints | None:
    """The stage addresses configured (flag, env var, endpoints file, in that order per stage), any subset of the
    stages; None when none is."""
    file_vals = _read_endpoints_file(Path(args.endpoints_file))
    vals = {s: (getattr(args, s, None) or os.environ.get(f"H3_{s.upper()}") or file_vals.get(f"H3_{s.upper()}")
                or "") for s in STAGES}
    return Endpoints(**vals) if any(vals.values()) else None


def require_stages(args, endpoints: Endpoints, stages, what: str) -> None:
    """EndpointError unless every stage in `stages` has an address (`what` names the command that needs them)."""
    missing = [s for s in stages if not endpoints.of(s)]
    if missing:
        flags = " ".join(f"--{s} HOST:PORT" for s in missing)
        raise EndpointError(f"{what} needs the {', '.join(missing)} stage(s) too; configured: "
                            f"{', '.join(endpoints.stages)}. Give {flags} (or H3_{missing[0].upper()}=..., "
                            f"or start all stages with scripts/up.sh)")


def unreachable_stages(ep: Endpoints, security: Security) -> list[str]:
    """The configured stages whose health check does not answer."""
    with StageClients(ep, security) as c:
        return [s for s in ep.stages if health_of(c.channels[s], SERVICE_NAMES[s]) == "UNREACHABLE"]


def check_reachable(args, ep: Endpoints, security: Security) -> None:
    """EndpointError naming each configured stage that does not answer, where it was configured, and the fix."""
    down = unreachable_stages(ep, security)
    if down:
        where = "; ".join(f"{s} at {ep.of(s)} (from {_source(args, s)})" for s in down)
        raise EndpointError(f"no answer from the configured {where}. Start the stages (scripts/up.sh), or fix the "
                            f"address; to use the embedded tiny model instead, configure nothing "
                            f"(scripts/down.sh removes {args.endpoints_file})")


def configured_render(args) -> str:
    return (getattr(args, "render", None) or os.environ.get("H3_RENDER")
            or _read_endpoints_file(Path(args.endpoints_file)).get("H3_RENDER", ""))


def _render_source(args) -> str:
    return "--render" if getattr(args, "render", None) else "H3_RENDER" if os.environ.get("H3_RENDER") \
        else str(args.endpoints_file)


def render_reachable(target: str, security: Security) -> bool:
    ch = open_channel(target, security)
    try:
        return health_of(ch, SERVICE_NAMES["render"]) != "UNREACHABLE"
    finally:
        ch.close()


def check_render_reachable(args, target: str, security: Security) -> None:
    if not render_reachable(target, security):
        raise EndpointError(f"no answer from the render service at {target} (from {_render_source(args)}). Start it "
                            f"(scripts/up.sh), or fix the address; to use the embedded tiny model instead, configure "
                            f"nothing (scripts/down.sh removes {args.endpoints_file})")


Served = list[tuple[str, "common_pb2.StageStatus | None"]]  # (stage or "stage/replica", its Status or None)


def served_behind(target: str, security: Security) -> Served:
    """What the stages behind the render service at `target` serve, from its Status (each stage's own Status as it
    read it; a stage of several replicas by each replica)."""
    from client.render_client import RenderClient

    with RenderClient(target, security) as rc:
        try:
            entries = rc.status().stages
        except grpc.RpcError as e:
            raise EndpointError(f"the render service at {target} did not say what its stages serve: "
                                f"{rpc_words(e)}") from None
    several = {e.stage.partition("/")[0] for e in entries if "/" in e.stage}
    return [(e.stage, e.status if e.HasField("status") else None) for e in entries if e.stage not in several]


def served_by(endpoints: Endpoints, security: Security) -> Served:
    """What each configured stage (each replica of a list) serves, from its own Status."""
    from h3.v1 import common_pb2

    out = []
    for s in endpoints.stages:
        for name, addr in replicas_of(endpoints.of(s)):
            with StageClients(Endpoints(**{s: addr}), security) as c:
                try:
                    st = c.stub(s).Status(common_pb2.StatusRequest(), timeout=5, metadata=c.security.metadata())
                except grpc.RpcError:
                    st = None
            out.append((f"{s}/{name}" if name else s, st))
    return out


def connect_render(args, security: Security, before_embedded: Callable[[], None] | None = None,
                   extra_args: dict[str, list[str]] | None = None, ctrl_c: CtrlC | None = None,
                   running: Callable[[str, str, Callable[[], Served]], None] | None = None):
    """(render service address, stack). In order: the configured render service; else one started here over the
    configured stages (all three); else, only when nothing at all is configured, an embedded local stack with its
    own render service (stop the stack after). Anything configured that does not answer is an EndpointError:
    never silently the tiny model. `before_embedded` runs before a stack is started (checks that would otherwise
    cost its start-up); `running(where, source, served)` before anything is asked of stages that run already (the
    configured render service or stages: `where` in words, `source` where they were configured, `served()` what
    their stages serve); `extra_args`: more flags per process started ("render" or a stage); `ctrl_c`: the caller's
    `client.embedded.CtrlC`, told of the stack as soon as it is made.

    A stack started here serves this client alone: its processes cancel their running job on SIGTERM
    (--cancel-on-term), so stopping it after a Ctrl-C takes seconds, not the drain a shared service gives a job."""
    from client.embedded import EmbeddedStack, StackConfig, StackStartError

    target = configured_render(args)
    if target:
        check_render_reachable(args, target, security)
        if running is not None:
            running(f"the stack behind the render service at {target}", _render_source(args),
                    lambda: served_behind(target, security))
        return target, None
    endpoints = configured_endpoints(args)
    if endpoints is not None:
        require_stages(args, endpoints, STAGES, "a render over configured stages")
        check_reachable(args, endpoints, security)
        if running is not None:
            running("the stack of the configured stages", _source(args, "encoder"),
                    lambda: served_by(endpoints, security))
    if before_embedded is not None:
        before_embedded()
    own = {"render": ["--cancel-on-term", "--http-port", "0"], **{s: ["--cancel-on-term"] for s in STAGES}}
    stack = EmbeddedStack(StackConfig(models_dir=args.models_dir, devices=args.devices, security=security,
                                      with_render=True, extra_args=_merged(own, extra_args or {})))
    if ctrl_c is not None:
        ctrl_c.stack = stack
    try:
        if endpoints is not None:
            print("starting a render service over the configured stages ...", file=sys.stderr)
            target = stack.start_render(endpoints)
        else:
            print("starting embedded stack (encoder, dit, decoder, render service) on loopback ...", file=sys.stderr)
            target = stack.start().render
    except StackStartError as e:
        stack.stop()  # why is in the message: nothing is left behind in the temp dir
        raise StackStartError(f"the local stack could not start: {e.summary}") from None
    except KeyboardInterrupt:
        stack.stop()  # what started is stopped; nothing is left behind in the temp dir
        raise
    web = stack.run_dir / "render.port.http"
    if web.exists():
        print(f"render service web page: http://127.0.0.1:{web.read_text().strip()}/", file=sys.stderr)
    return target, stack


def _merged(a: dict[str, list[str]], b: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: [*a.get(k, []), *b.get(k, [])] for k in {*a, *b}}


def connect_or_start(args, security: Security, stages, extra_args: dict[str, list[str]] | None = None):
    """(endpoints, stack): the configured stages (`stages` of them needed, each answering: else EndpointError);
    with none configured, an embedded local stack (stop it after)."""
    from client.embedded import EmbeddedStack, StackConfig

    endpoints = configured_endpoints(args)
    if endpoints is not None:
        require_stages(args, endpoints, stages, "this command")
        check_reachable(args, endpoints, security)
        return endpoints, None
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
        ap.add_argument("--encoder", help="text encoder endpoint host:port, or a list for round_robin (default: "
                                          "H3_ENCODER or the endpoints file)")
        ap.add_argument("--dit", help="DiT sampler endpoint (default: H3_DIT or the endpoints file)")
        ap.add_argument("--decoder", help="decoder endpoint (default: H3_DECODER or the endpoints file)")
    ap.add_argument("--endpoints-file", default=str(DEFAULT_ENDPOINTS_FILE),
                    help=f"file written by scripts/up.sh (default: {DEFAULT_ENDPOINTS_FILE})")
    ap.set_defaults(token=os.environ.get("H3_TOKEN", ""))
    ap.add_argument("--token-file", action=_TokenFile, help="file holding the bearer token for remote services "
                    "(default: the H3_TOKEN environment variable)")
    ap.add_argument("--token", dest="token_on_command_line", action=_RefusedToken, help=argparse.SUPPRESS)
    ap.add_argument("--tls-ca", default=os.environ.get("H3_TLS_CA", ""),
                    help="CA certificate for TLS services (default: H3_TLS_CA; none: plaintext)")
