"""Two "hosts" on one machine for the scale-out tests (tests/test_hosts*.py, docs/scale_out.md): each with its own
network, run directory and lease directory; servers on them with TLS and a token, as off loopback they must."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from minimax_h3.services import SERVICE_NAMES, Endpoints
from stagekit.channels import Security, health_of, open_channel
from stagekit.procs import stop_group
from tests.render_svc_util import SERVER_ENV, self_signed_cert, token_file, wait_for

log = logging.getLogger(__name__)

TOKEN = "two-hosts-token"
MODULES = {"encoder": "encoder_svc", "decoder": "decoder_svc", "render": "render_svc"}


class Network:
    """Hosts "a" and "b": their address, the command prefix that runs a process on them, the interface gloo uses."""

    def __init__(self, kind: str, addrs: dict[str, str], namespaces: dict[str, str] | None = None, bridge: str = ""):
        self.kind = kind
        self.addrs = addrs
        self.namespaces = namespaces or {}
        self.bridge = bridge

    @classmethod
    def make(cls) -> "Network":
        """Namespaces when they can be made here; loopback aliases otherwise (no root, no iproute2, EPERM)."""
        if os.geteuid() == 0 and shutil.which("ip"):
            try:
                return cls._namespaces()
            except subprocess.CalledProcessError as e:
                log.warning("no network namespaces (%s); two loopback addresses play the hosts", e.stderr.strip())
        return cls("loopback", {"a": "127.0.0.2", "b": "127.0.0.3"})

    @classmethod
    def _namespaces(cls) -> "Network":
        """Two namespaces, each with an `eth0` on one bridge in ours (which reaches both): 10.251.N.2 and .3."""
        tag = str(os.getpid())
        subnet = f"10.251.{os.getpid() % 250}"
        net = cls("netns", {"a": f"{subnet}.2", "b": f"{subnet}.3"},
                  {h: f"h3-{tag}-{h}" for h in "ab"}, f"h3br{tag}")

        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

        try:
            ip("link", "add", net.bridge, "type", "bridge")
            ip("addr", "add", f"{subnet}.1/24", "dev", net.bridge)
            ip("link", "set", net.bridge, "up")
            for h, ns in net.namespaces.items():
                ip("netns", "add", ns)
                ours, theirs = f"h3v{tag}{h}", f"h3p{tag}{h}"
                ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
                ip("link", "set", theirs, "netns", ns)
                ip("link", "set", ours, "master", net.bridge)
                ip("link", "set", ours, "up")
                ip("-n", ns, "link", "set", theirs, "name", "eth0")
                ip("-n", ns, "addr", "add", f"{net.addrs[h]}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            net.close()
            raise
        return net

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host]] if self.namespaces else []

    def ifname(self, host: str) -> str:
        return "eth0" if self.namespaces else "lo"

    def free_port(self, host: str) -> int:
        """A port free on `host`: in a namespace of ours any port is (nothing else listens there)."""
        if self.namespaces:
            return 29400
        with socket.socket() as s:
            s.bind((self.addrs[host], 0))
            return s.getsockname()[1]

    def close(self) -> None:
        for ns in self.namespaces.values():  # the veth pairs go with their namespace
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


class Hosts:
    """The servers on hosts a and b: each in its host's network, with its host's run and lease directory."""

    def __init__(self, net: Network, root: Path, cache: Path, security: Security, tls_args: list[str]):
        self.net = net
        self.root = root
        self.cache = cache
        self.security = security
        self.tls_args = tls_args
        self.procs: dict[str, subprocess.Popen] = {}

    def run_dir(self, host: str) -> Path:
        return self.root / host

    def lease_dir(self, host: str) -> Path:
        return self.run_dir(host) / "leases"

    def _start(self, host: str, name: str, argv: list[str]) -> None:
        d = self.run_dir(host)
        (d / "tmp" / name).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SERVER_ENV, "GLOO_SOCKET_IFNAME": self.net.ifname(host), "TMPDIR": str(d / "tmp" / name),
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a group across hosts: docs/scale_out.md
        with open(d / f"{name}.log", "ab") as out:
            self.procs[f"{name}@{host}"] = subprocess.Popen([*self.net.prefix(host), *argv], stdout=out,
                                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def server_args(self, host: str, name: str) -> list[str]:
        d = self.run_dir(host)
        return ["--host", self.net.addrs[host], "--port", "0", "--port-file", str(d / f"{name}.port"), *self.tls_args]

    def start_stage(self, host: str, stage: str) -> None:
        self._start(host, stage, [sys.executable, "-m", MODULES[stage], *self.server_args(host, stage),
                                  "--lease-dir", str(self.lease_dir(host)), "--devices", "virt0",
                                  "--cache-dir", str(self.cache)])

    def start_render(self, host: str, stages: Endpoints) -> None:
        self._start(host, "render", [sys.executable, "-m", "render_svc", *self.server_args(host, "render"),
                                     "--run-dir", str(self.run_dir(host) / "render"),
                                     "--stage-tls-ca", self.security.tls_ca, "--encoder", stages.encoder,
                                     "--dit", stages.dit, "--decoder", stages.decoder])

    def start_dit(self, args: dict[str, list[str]], restarts: int = 0) -> None:
        """One DiT rank group over both hosts: a torchrun agent each, joined by the c10d rendezvous on a, with
        `args[host]` for that host's node and `restarts` for torchrun's --max-restarts. torchrun orders the nodes by `--local-addr`, so a's worker is rank 0 and
        serves gRPC."""
        rdzv = f"{self.net.addrs['a']}:{self.net.free_port('a')}"
        for host in "ab":
            self._start(host, "dit", [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "dit-two-hosts",
                "--rdzv-conf", f"is_host={host == 'a'}".lower(),  # a hosts the rendezvous store, named not guessed
                "--local-addr", self.net.addrs[host], "--max-restarts", str(restarts),
                "-m", "dit_svc", *self.server_args(host, "dit"), "--lease-dir", str(self.lease_dir(host)),
                "--devices", "virt0", "--cache-dir", str(self.cache), "--collective-timeout-s", "30", *args[host]])

    def address(self, host: str, name: str, timeout_s: float = 120) -> str:
        """`host:port` of `name` once it serves (health SERVING over TLS)."""
        port_file = self.run_dir(host) / f"{name}.port"
        service = SERVICE_NAMES[name]

        def serving() -> str | None:
            for key, p in self.procs.items():
                assert p.poll() is None, f"{key} exited with {p.returncode}\n{self.log()}"
            if not port_file.exists():
                return None
            target = f"{self.net.addrs[host]}:{int(port_file.read_text())}"
            ch = open_channel(target, self.security)
            try:
                return target if health_of(ch, service) == "SERVING" else None
            finally:
                ch.close()

        return wait_for(serving, timeout_s, f"{name} serving on host {host}", self.log)

    def log(self) -> str:
        return "\n".join(f"--- {path}\n" + path.read_text(errors="replace")[-2500:]
                         for path in sorted(self.root.glob("*/*.log")))

    def stop(self) -> None:
        for key in sorted(self.procs, key=lambda k: not k.startswith("render")):  # the render service first
            stop_group(self.procs[key], 20.0)


def make_hosts(root: Path, cache: Path) -> Hosts:
    """Hosts a and b with a certificate for both addresses and one token."""
    net = Network.make()
    cert, key = self_signed_cert(root, tuple(net.addrs.values()))
    security = Security(token=TOKEN, tls_ca=str(cert))
    return Hosts(net, root, cache, security,
                 ["--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file(root, TOKEN))])
