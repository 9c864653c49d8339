"""Reference files sent to a server in chunks (the Upload RPCs) and kept by content (docs/references.md).

A caller streams a file as FileChunks (`stagekit.transport.file_chunks`: offsets in order, size and CRC-32C on the
last); the server writes them through `transport.FileReceiver` (no name until the file is complete and checked, so a
broken or refused upload leaves nothing) and names the file by its SHA-256. A request then names the file by that
digest (`Reference.digest`) instead of carrying its bytes, so a file may be larger than one gRPC message and is sent
to each server once. Uploads are streamed requests: the server's upload slots and deadlines (stagekit/server.py:
--max-uploads, --upload-idle-s, --upload-total-s) bound them as they bound every other streamed request.

Torch-free: the render service and the thin client import it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from h3.v1 import common_pb2, tensor_pb2
from stagekit.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from stagekit.transport import FileReceiver, file_chunks

MAX_FILE_BYTES = 64 << 20      # one reference file (a video clip with its soundtrack)
MAX_STORE_BYTES = 4 << 30      # all the files a server keeps; an upload beyond it is RESOURCE_EXHAUSTED
KEEP_S = 3600.0                # a file no one has named for this long is removed
DIGEST = re.compile(r"[0-9a-f]{64}")


class UploadStore:
    """Uploaded files under `root`, each named by its SHA-256. `in_use`: digests a sweep must keep whatever their age
    (the render service's unfinished jobs)."""

    def __init__(self, root: Path, max_file_bytes: int = MAX_FILE_BYTES, max_bytes: int = MAX_STORE_BYTES,
                 keep_s: float = KEEP_S, in_use: Callable[[], set[str]] = set):
        if not Path(root).is_absolute():  # a server's files live in its own run or temp dir, never where it was started
            raise ValueError(f"upload store {root!r}: an absolute directory is required")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_bytes, self.keep_s, self.in_use = max_file_bytes, max_bytes, keep_s, in_use

    def receive(self, chunks: Iterable[tensor_pb2.FileChunk]) -> tensor_pb2.UploadReply:
        """One upload -> its digest and size. InvalidArgument for a file that is too large or fails its checks,
        ResourceExhausted when the store is full; nothing is kept then."""
        self.sweep()
        held = self.stored_bytes()
        if held >= self.max_bytes:
            raise ResourceExhausted(f"the upload store holds {held} bytes (at most {self.max_bytes}); files are "
                                    f"removed {self.keep_s:g} s after their last use: retry later")
        with FileReceiver(self.root / "upload", self.max_file_bytes, InvalidArgument) as rx:
            for chunk in chunks:
                rx.feed(chunk)
            rx.verify()  # a cut-off stream fails even when its bytes match a stored file
            digest = rx.sha256.hexdigest()
            target = self.root / digest
            if target.is_file():  # sent before: keep the stored copy, as fresh as a new one
                os.utime(target)
            else:
                rx.finish(target)
        return tensor_pb2.UploadReply(digest=digest, bytes=rx.size)

    def path(self, digest: str) -> Path:
        """The stored file of `digest` (its age restarts). FailedPrecondition when there is none."""
        if not DIGEST.fullmatch(digest):
            raise InvalidArgument(f"{digest[:80]!r} is not the SHA-256 (64 hex digits) an Upload returns")
        p = self.root / digest
        try:
            os.utime(p)
        except FileNotFoundError:
            raise FailedPrecondition(f"no uploaded file {digest[:16]}...: upload it first (Upload); a file no request "
                                     f"names for {self.keep_s:g} s is removed") from None
        return p

    def read(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()

    def stored_bytes(self) -> int:
        return sum(f.stat().st_size for f in self._files())

    def sweep(self) -> None:
        """Remove the files no one has named for `keep_s` (except those in use)."""
        keep, now = self.in_use(), time.time()
        for f in self._files():
            try:
                if f.name not in keep and now - f.stat().st_mtime > self.keep_s:
                    f.unlink()
            except FileNotFoundError:
                pass

    def _files(self) -> Iterator[Path]:
        return (f for f in self.root.iterdir() if DIGEST.fullmatch(f.name) and f.is_file())


def upload(call, source: Path | bytes, name: str = "", **kw) -> str:
    """Send a file (a path, or its bytes) with a stub's Upload method `call` (`kw`: timeout, metadata); its digest."""
    return call(file_chunks(source, name), **kw).digest


def uploaded(call, ref: common_pb2.Reference, source: Path | bytes | None = None, **kw) -> common_pb2.Reference:
    """`ref` as a request names it after uploading its file (`source`, else its inline data) with `call`: its
    digest instead of its bytes."""
    out = common_pb2.Reference()
    out.CopyFrom(ref)
    out.ClearField("data")
    out.digest = upload(call, ref.data if source is None else source, ref.name, **kw)
    return out


def reference_bytes(ref: common_pb2.Reference, store: UploadStore | None) -> bytes:
    """A reference's file: inline, or the upload its digest names."""
    if ref.data or not ref.digest:
        return ref.data
    if store is None:
        raise FailedPrecondition("this server keeps no uploads: send the reference inline")
    return store.read(ref.digest)
