"""A stand-in for the Hugging Face Hub's file API on loopback, for `client models fetch` (HF_ENDPOINT=its URL).

It answers what `huggingface_hub` asks of a file: `HEAD /{repo}/resolve/{revision}/{path}` with the headers the Hub
sends for an LFS file (X-Repo-Commit, ETag / X-Linked-Etag = the sha256, X-Linked-Size) and `GET` of the same URL,
with `Range: bytes=N-` answered 206. Per file a test can make it lie about the sha256 or the size, or stall: send
`stall_after` bytes of the first GET, then hold the connection until `release` is set.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0" * 39 + "1"


@dataclass
class HubFile:
    data: bytes
    sha256: str = ""          # what the server claims (default: the real one)
    size: int = 0             # what the server claims (default: the real one)
    stall_after: int = 0      # first GET: send this many bytes, then wait for `release`
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.sha256 = self.sha256 or hashlib.sha256(self.data).hexdigest()
        self.size = self.size or len(self.data)


class FakeHub:
    def __init__(self, files: dict[str, HubFile]):
        self.files = files  # "repo/path" -> file, e.g. "Comfy-Org/MiniMax-H3/vae/x.safetensors"
        self.gets: list[tuple[str, str]] = []  # (repo/path, Range header) of every GET
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _file(self):
                repo_path, sep, rest = self.path.partition("/resolve/")
                _rev, _, path = rest.partition("/")
                return f"{repo_path.lstrip('/')}/{path}", hub.files.get(f"{repo_path.lstrip('/')}/{path}") if sep else None

            def _head(self, f: HubFile, length: int, status: int = 200, extra: dict | None = None):
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{f.sha256}"')
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(f.size))
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self):
                _, f = self._file()
                if f is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._head(f, f.size)

            def do_GET(self):
                key, f = self._file()
                if f is None:
                    self.send_error(404)
                    return
                rng = self.headers.get("Range", "")
                first = not any(k == key for k, _ in hub.gets)
                hub.gets.append((key, rng))
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng.startswith("bytes=") else 0
                body = f.data[start:]
                if start:
                    self._head(f, len(body), 206, {"Content-Range": f"bytes {start}-{len(f.data) - 1}/{len(f.data)}"})
                else:
                    self._head(f, len(body))
                try:
                    if first and f.stall_after:
                        self.wfile.write(body[:f.stall_after])
                        self.wfile.flush()
                        f.release.wait(60)
                        return
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.release.set()
        self.server.shutdown()
        self.server.server_close()
