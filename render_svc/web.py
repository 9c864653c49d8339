"""The render service's read-only web page (stdlib `http.server`; no framework).

    GET /                   the page (render_svc/page.html): queue and running jobs with live progress, each
                            stage's residency over time, the recent stage batches, finished videos playable
    GET /api/state          what the page polls (JSON)
    GET /video/<job>.mp4    a finished job's MP4 (HTTP Range requests, so a <video> element can seek)
    /v1/...                 the HTTP video API (render_svc/http_api.py: create, get, list, cancel, content)
    /prompt, /history, ...  ComfyUI's routes (render_svc/comfy_api.py; /ws, its progress websocket, holds its
                            connection's thread while the client listens)

Same exposure rules as the gRPC port (stagekit/server.py): loopback by default; the same TLS certificate; with a
token (--token-file, the env variable, or --tokens-file) every request needs one — `Authorization: Bearer <token>`,
or once `?token=<token>` in the URL, which sets a cookie (HttpOnly, SameSite=Strict) so the page's own requests and
its <video> elements carry it (the /v1/ API takes the header only). A principal of --tokens-file sees its own jobs,
an admin all. Nothing on the page changes a job; the API's create and cancel do, as gRPC's Submit and Cancel. Residency comes from polling each stage's Status every half second while the page is served.

Limits (docs/reliability.md, "Web page"; the numbers are flags of the render service): each connection is served by
a thread of its own, the TLS handshake included (off the accept loop). A connection's TLS handshake, request line and
headers must arrive within --http-header-s of its accept, a later request's line and headers within --http-header-s
of its first byte (else 408 and the connection closed); a kept-alive connection idle for IDLE_S is closed. At most
--http-max-connections are open, --http-max-per-address of them from one client address (more get 503), and the last
--http-reserved-connections of them serve only requests that carry a valid token (others get 503); a connection still
waiting for its first request in a reserved slot is dropped for a newer connection when every slot is taken.
Connections that drip their headers or sit idle cannot refuse everyone. A request whose `Host:` names another host than the one the
page is served on gets 421 (a DNS-rebinding page in a local browser cannot read it).
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from google.protobuf.json_format import MessageToDict

from minimax_h3.services import STAGES
from render_svc import comfy_api
from render_svc.http_api import PREFIX as API_PREFIX
from render_svc.http_api import VideoAPI
from render_svc.store import SUCCEEDED
from stagekit.errors import DeadlineExceeded, FailedPrecondition
from stagekit.server import ANYONE, Principal, cannot_listen

log = logging.getLogger("render_svc.web")

PAGE = Path(__file__).with_name("page.html")
RESIDENCY_POLL_S = 0.5
RESIDENCY_KEEP_S = 900.0
_VIDEO = re.compile(r"^/video/([0-9a-f]{1,64})\.mp4$")
_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")
BEYOND_ANY_FILE = 10**18  # a Range position of more than 18 digits reads as this: past the end of any file
COOKIE = "h3_token"
IDLE_S = 30.0            # a kept-alive connection with no request for this long is closed; each read's timeout
SHOWN_PROMPT_CHARS = 300  # the page shows this much of a prompt


def _allowed_hosts(bind: str) -> set[str] | None:
    """Host names a request may carry for a page bound to `bind` (None: any, for a wildcard bind)."""
    if bind in ("", "0.0.0.0", "::"):
        return None
    hosts = {bind.lower(), f"[{bind.lower()}]"}
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = False
    return hosts | ({"localhost", "127.0.0.1", "[::1]"} if loopback else set())


@dataclass(frozen=True)
class Limits:
    """The listener's bounds (the render service's flags of the same names; docs/reliability.md, "Web page")."""

    header_s: float          # --http-header-s: a request's line and headers (the first: and the TLS handshake)
    max_connections: int     # --http-max-connections
    max_per_address: int     # --http-max-per-address
    reserved: int            # --http-reserved-connections: the last slots, for requests with a valid token

    @classmethod
    def of(cls, cfg) -> Limits:
        """The flags of `cfg` (a RenderConfig), or FailedPrecondition naming the one that cannot work."""
        lim = cls(cfg.http_header_s, cfg.http_max_connections, cfg.http_max_per_address, cfg.http_reserved_connections)
        if not (math.isfinite(lim.header_s) and lim.header_s > 0):
            raise FailedPrecondition(f"--http-header-s must be a number of seconds above 0, got {lim.header_s:g}")
        if lim.max_connections < 1 or lim.max_per_address < 1:
            raise FailedPrecondition("--http-max-connections and --http-max-per-address must be at least 1")
        if not 0 <= lim.reserved < lim.max_connections:
            raise FailedPrecondition(f"--http-reserved-connections must be from 0 to --http-max-connections - 1 "
                                     f"({lim.max_connections - 1}), got {lim.reserved}")
        return lim


@dataclass
class _Slot:
    """An open connection's place in the cap: its client address, the deadline of its first request's headers
    (monotonic), whether it is one of the reserved slots, its socket's descriptor, whether its first request's line
    and headers are still awaited (a reserved slot's connection may then be dropped for a newer one), and whether it
    was dropped."""

    host: str
    deadline: float
    reserved: bool
    fd: int
    waiting: bool = True
    dropped: bool = False


class _LateHeaders(DeadlineExceeded):
    """A request's line and headers missed their deadline. Not a TimeoutError, which http.server answers by closing
    the connection without a word."""


class _Reader(io.RawIOBase):
    """A connection's reads (under http.server's buffered `rfile`): each within the socket's timeout (IDLE_S), and
    while `deadline` is set all of them by it, however slowly the bytes trickle in."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buf)
        # Past the deadline, bytes that have arrived are still read; nothing more is waited for.
        self.sock.settimeout(min(IDLE_S, max(self.deadline - time.monotonic(), 1e-3)))
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            if time.monotonic() < self.deadline:
                raise
            raise _LateHeaders("the request line and headers missed their deadline") from None


def _plain(status: str, message: str, headers: str = "") -> bytes:
    """A whole plain-text answer that closes the connection, for the listener's own refusals (no request parsed)."""
    body = message.encode() + b"\n"
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{headers}\r\n").encode() + body


def _range_position(digits: str) -> int:
    """A Range header's byte position, of any number of digits (int() alone refuses strings of over 4300)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else BEYOND_ANY_FILE


def _host_ok(header: str, allowed: set[str] | None) -> bool:
    if allowed is None:
        return True
    host = header.strip().lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1]
    else:
        host = host.rsplit(":", 1)[0]
    return host in allowed


class Residency:
    """Each stage's state over time, from the cluster view's Status poller (`record` hears every poll):
    [t0, t1, state] spans per stage, state one of resident, loading, unloaded, unreachable (no replica answered)."""

    def __init__(self):
        self.spans: dict[str, list[list]] = {s: [] for s in STAGES}
        self._lock = threading.Lock()

    @staticmethod
    def _state(answers: list) -> str:
        st = next((a for a in answers if a is not None), None)
        if st is None:
            return "unreachable"
        if st.health == "NOT_SERVING":
            return "loading"
        return "resident" if st.resident else "unloaded"

    def record(self, by_service) -> None:
        now = time.time()
        states = {s: self._state(by_service.get(s, [])) for s in STAGES}
        with self._lock:
            for s, state in states.items():
                spans = self.spans[s]
                if spans and spans[-1][2] == state:
                    spans[-1][1] = now
                else:
                    if spans:
                        spans[-1][1] = now
                    spans.append([now, now, state])
                while spans and spans[0][1] < now - RESIDENCY_KEEP_S:
                    spans.pop(0)

    def snapshot(self) -> dict[str, list[list]]:
        with self._lock:
            return {s: [list(x) for x in v] for s, v in self.spans.items()}


class WebPage:
    """The page's HTTP server: bound (and its port held) at construction, served from `start` once the job service
    exists, so a taken --http-port refuses the start before the job database is opened (docs/reliability.md)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.svc = None  # the RenderService, given to `start`
        self.api: VideoAPI | None = None  # the /v1/ routes over it
        self.comfy: comfy_api.ComfyAPI | None = None  # ComfyUI's routes over it
        self.residency = Residency()
        self.page = PAGE.read_bytes()
        self.limits = Limits.of(cfg)
        self._httpd, self.url = self._bind()

    def state(self, who: Principal = ANYONE) -> dict:
        snap = self.svc.snapshot(None if who.admin else who.name)
        jobs = []
        for j in snap.pop("jobs"):
            if len(j.params.prompt) > SHOWN_PROMPT_CHARS:
                j.params.prompt = j.params.prompt[:SHOWN_PROMPT_CHARS] + "..."
            jobs.append(MessageToDict(j, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
        return {"now": time.time(), "started": self.svc.started_unix, "jobs": jobs, **snap,
                "residency": self.residency.snapshot(),
                "scheduling": {"max_batch": self.svc.cfg.max_batch, "max_wait_batches": self.svc.cfg.max_wait_batches}}

    def video(self, job_id: str, who: Principal = ANYONE) -> Path | None:
        try:
            rec = self.svc.book.get(job_id, None if who.admin else who.name)
        except Exception:  # noqa: BLE001 - unknown id: 404
            return None
        path = Path(rec.output)
        return path if rec.state == SUCCEEDED and not rec.expired and path.exists() else None

    def start(self, svc) -> str:
        """Serve the page over `svc` (a RenderService); returns its URL."""
        self.svc = svc
        self.api = VideoAPI(svc, self.cfg.tokens(), self.cfg.upload_total_s)
        self.comfy = comfy_api.ComfyAPI(svc, self.cfg.tokens(), self.cfg.upload_total_s)
        threading.Thread(target=self._httpd.serve_forever, name="web", daemon=True).start()
        svc.cluster.listen(self.residency.record, RESIDENCY_POLL_S)
        if self.cfg.port_file:
            tmp = Path(self.cfg.port_file + ".http.tmp")
            tmp.write_text(str(self._httpd.server_address[1]))
            tmp.replace(self.cfg.port_file + ".http")
        return self.url

    def _bind(self) -> tuple[ThreadingHTTPServer, str]:
        page = self
        tokens = self.cfg.tokens()
        allowed = _allowed_hosts(self.cfg.host)
        header_s = self.limits.header_s

        class Handler(BaseHTTPRequestHandler):
            server_version = "h3-render"
            protocol_version = "HTTP/1.1"
            timeout = IDLE_S  # the socket's timeout: an idle connection is closed

            def log_message(self, fmt, *args):  # noqa: A003 - http.server's name
                log.debug("%s " + fmt, self.address_string(), *args)

            def __init__(self, request, client_address, server, slot: _Slot):
                self.slot = slot
                super().__init__(request, client_address, server)

            def setup(self):
                super().setup()
                self.rfile.close()  # http.server's reader, replaced by one that keeps the headers' deadline
                self.reader = _Reader(self.connection)
                self.reader.deadline = self.slot.deadline  # the first request's: from the connection's accept
                self.rfile = io.BufferedReader(self.reader)

            def handle_one_request(self):
                if self.reader.deadline is None:  # kept alive: the next request begins within IDLE_S, or never
                    try:
                        if not self.rfile.peek(1):
                            self.close_connection = True
                            return
                    except OSError:  # the idle timeout, or the client gone
                        self.close_connection = True
                        return
                    self.reader.deadline = time.monotonic() + header_s
                try:
                    super().handle_one_request()
                except _LateHeaders:
                    self.close_connection = True
                    try:
                        self.connection.settimeout(1.0)
                        self.wfile.write(_plain("408 Request Timeout", f"the request line and headers did not arrive "
                                                f"within {header_s:g} s (--http-header-s)"))
                    except OSError:
                        pass

            def parse_request(self) -> bool:
                """http.server's, which reads the headers; then the body's reads have the idle timeout alone, and a
                request in a reserved slot is served only with a valid token."""
                ok = super().parse_request()
                self.reader.deadline = None
                self.connection.settimeout(IDLE_S)
                if not self.server.arrived(self.slot):  # dropped for a newer connection: its headers may be cut
                    self.close_connection = True
                    return False
                if ok and self.slot.reserved and self._authorized(parse_qs(urlsplit(self.path).query))[0] is None:
                    self.close_connection = True
                    self._send(503, b"every connection slot for requests without a valid token is taken "
                               b"(--http-max-connections less --http-reserved-connections); retry later\n",
                               "text/plain; charset=utf-8", {"Retry-After": "1"})
                    return False
                return ok

            def _authorized(self, query: dict) -> tuple[Principal | None, str]:
                """(the caller, or None; the token to set as a cookie, or ""): from the header, cookie or URL."""
                if tokens is None:
                    return ANYONE, ""
                header = self.headers.get("Authorization", "")
                if header.startswith("Bearer ") and (who := tokens.principal(header)) is not None:
                    return who, ""
                jar = SimpleCookie(self.headers.get("Cookie", ""))
                if COOKIE in jar and (who := tokens.principal(f"Bearer {jar[COOKIE].value}")) is not None:
                    return who, ""
                given = query.get("token", [""])[0]
                if given and (who := tokens.principal(f"Bearer {given}")) is not None:
                    return who, given
                return None, ""

            def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):  # noqa: N802 - http.server's name
                self.do_GET()

            def _host_refused(self) -> bool:
                if _host_ok(self.headers.get("Host", ""), allowed):
                    return False
                self.close_connection = True
                self._send(421, b"this page answers only requests for the host it is served on\n",
                           "text/plain; charset=utf-8")
                return True

            def _api(self, url) -> bool:
                """A /v1/ request: answered by the video API (its own auth: the Authorization header only); one of
                ComfyUI's routes (/prompt, /history, /view, ...): by render_svc/comfy_api.py, with the same auth."""
                method = "GET" if self.command == "HEAD" else self.command
                if comfy_api.handles(url.path):
                    page.comfy.handle(self, method, url.path, url.query)
                    return True
                if not (url.path + "/").startswith(API_PREFIX):
                    return False
                page.api.handle(self, method, url.path, url.query)
                return True

            def do_POST(self):  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                if self._host_refused() or self._api(url):
                    return
                self.close_connection = True  # the page takes no bodies: whatever was sent is not read
                self._send(405, b"the page is read-only\n", "text/plain", {"Allow": "GET, HEAD"})

            do_DELETE = do_PUT = do_PATCH = do_POST  # noqa: N815 - http.server's names

            def do_GET(self):  # noqa: N802
                url = urlsplit(self.path)
                if self._host_refused() or self._api(url):
                    return
                who, set_cookie = self._authorized(parse_qs(url.query))
                if who is None:
                    self._send(401, b"missing or wrong token: open the page as /?token=<your token>\n",
                               "text/plain; charset=utf-8")
                    return
                if set_cookie:  # drop the token from the address bar once the cookie holds it
                    self._send(303, b"", "text/plain", {
                        "Location": url.path or "/",
                        "Set-Cookie": f"{COOKIE}={set_cookie}; HttpOnly; SameSite=Strict; Path=/"
                                      + ("; Secure" if page.cfg.tls_cert else "")})
                    return
                if url.path in ("/", "/index.html"):
                    self._send(200, page.page, "text/html; charset=utf-8")
                elif url.path == "/api/state":
                    self._send(200, json.dumps(page.state(who)).encode(), "application/json")
                elif (m := _VIDEO.match(url.path)) is not None:
                    self._video(m.group(1), who)
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _video(self, job_id: str, who: Principal) -> None:
                path = page.video(job_id, who)
                if path is None:
                    self._send(404, b"no finished video for this job (unknown, not done, or expired)\n", "text/plain")
                    return
                self._send_file(path, "video/mp4")

            def _send_file(self, path: Path, ctype: str, extra: dict | None = None) -> None:
                """The file, or the byte range the Range header asks for (one range: 206; past the end: 416).
                Opened first: a file removed meanwhile (retention) raises FileNotFoundError before anything is sent,
                and one removed while it is sent is sent whole."""
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    start, end, code = 0, size - 1, 200
                    m = _RANGE.match(self.headers.get("Range", ""))
                    if m and (m.group(1) or m.group(2)):
                        if m.group(1):
                            start = _range_position(m.group(1))
                            end = min(_range_position(m.group(2)) if m.group(2) else size - 1, size - 1)
                        else:  # suffix range: the last N bytes
                            start = max(0, size - _range_position(m.group(2)))
                        if start > end:
                            self._send(416, b"", "text/plain", {"Content-Range": f"bytes */{size}"})
                            return
                        code = 206
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Accept-Ranges", "bytes")
                    for k, v in (extra or {}).items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(end - start + 1))
                    if code == 206:
                        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    f.seek(start)
                    left = end - start + 1
                    while left > 0:
                        data = f.read(min(1 << 20, left))
                        if not data:
                            break
                        self.wfile.write(data)
                        left -= len(data)

        ctx = None
        if self.cfg.tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        try:
            httpd = _PageServer((self.cfg.host, self.cfg.http_port), Handler, ctx, self.limits)
        except OSError as e:
            raise cannot_listen(f"{self.cfg.host}:{self.cfg.http_port}", "--http-port", e.strerror or str(e)) from None
        scheme = "https" if ctx is not None else "http"
        port = httpd.server_address[1]
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return httpd, f"{scheme}://{host}:{port}/"


class _PageServer(ThreadingHTTPServer):
    """The accept loop only accepts: each connection's thread does its TLS handshake (by the headers' deadline) and
    serves it. A connection beyond --http-max-per-address from its client address, or beyond --http-max-connections
    when no reserved slot's connection is still waiting for its first request, is answered 503 and closed at once;
    when one is, the longest waiting of them is closed and the new connection takes its slot. So connections without
    a token cannot hold the reserved slots: they get 503 once their headers are in, and are dropped for newer ones
    until then. A connection's slot is given back before its socket is closed, so a client that sees its connection
    end finds the slot free."""

    daemon_threads = True
    address_family = socket.AF_INET

    def __init__(self, addr, handler, ctx: ssl.SSLContext | None, limits: Limits):
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.ctx = ctx
        self.limits = limits
        # The listen backlog holds a burst of twice the cap: with socketserver's 5 the kernel drops the SYNs of a burst
        # that the accept loop has not caught up with, and each client retries after 1, 3, 7 s.
        self.request_queue_size = 2 * limits.max_connections
        self.slots: dict[tuple, _Slot] = {}  # the open connections, by client (address, port)
        self._count = threading.Lock()
        super().__init__(addr, handler)

    def _take_slot(self, request, client_address) -> str:
        """A slot for the connection (""), or why there is none."""
        lim, host = self.limits, client_address[0]
        with self._count:
            if sum(s.host == host for s in self.slots.values()) >= lim.max_per_address:
                return (f"{lim.max_per_address} connections from {host} are open (--http-max-per-address); close one "
                        "or retry later")
            if len(self.slots) >= lim.max_connections and not self._drop_a_waiting_reserved():
                return f"all {lim.max_connections} connections are taken (--http-max-connections); retry later"
            reserved = len(self.slots) >= lim.max_connections - lim.reserved
            self.slots[client_address] = _Slot(host, time.monotonic() + lim.header_s, reserved, request.fileno())
            return ""

    def _drop_a_waiting_reserved(self) -> bool:
        """Under the count's lock: close the reserved slot's connection that has waited longest for its first request
        and free its slot (its thread ends on the closed socket); False if none is waiting."""
        waiting = [(slot.deadline, addr) for addr, slot in self.slots.items() if slot.reserved and slot.waiting]
        if not waiting:
            return False
        slot = self.slots.pop(min(waiting)[1])
        slot.dropped = True
        # The socket is still open: its thread removes its slot (the lock held here) before it closes it.
        with socket.fromfd(slot.fd, self.address_family, socket.SOCK_STREAM) as dup:
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client already left
        return True

    def arrived(self, slot: _Slot) -> bool:
        """The slot's request line and headers are in: from now its connection is not dropped for a newer one. False
        if it was dropped already."""
        with self._count:
            slot.waiting = False
            return not slot.dropped

    def process_request(self, request, client_address):
        refused = self._take_slot(request, client_address)
        if refused:
            try:
                request.settimeout(1.0)
                if self.ctx is None:
                    request.sendall(_plain("503 Service Unavailable", refused, "Retry-After: 1\r\n"))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        """ThreadingMixIn's, with the TLS handshake first and the slot given back before the socket is closed."""
        with self._count:
            slot = self.slots.get(client_address)
        try:
            if slot is None:
                return  # dropped for a newer connection before this thread started
            if self.ctx is not None:
                request.settimeout(max(slot.deadline - time.monotonic(), 1e-3))
                try:
                    # the handshake called here, not in wrap_socket, which closes the socket itself when it fails
                    request = self.ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                    request.do_handshake()
                except (OSError, ssl.SSLError):
                    return  # a handshake that failed or timed out: nothing to answer
            self.RequestHandlerClass(request, client_address, self, slot)
        except Exception:  # noqa: BLE001 - as socketserver: logged, and the connection closed
            self.handle_error(request, client_address)
        finally:
            with self._count:
                if slot is not None and self.slots.get(client_address) is slot:
                    del self.slots[client_address]
            self.shutdown_request(request)
