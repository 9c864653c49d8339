"""gRPC transport settings and the one way a file travels, shared by servers and clients.

Torch-free on purpose: the thin client (`python -m client render`) imports this and nothing that pulls in torch or
numpy. Tensors travel with `stagekit.wire`; files (the MP4 down, reference files up) travel as `FileChunk`s: every
chunk carries its byte offset, the last one the file's size and CRC-32C, and a receiver keeps nothing that failed a
check.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import google_crc32c

from h3.v1 import tensor_pb2
from stagekit.errors import InvalidArgument

# gRPC's default message cap is 4 MiB; 2 MiB chunks leave ample room for framing.
MAX_CHUNK_BYTES = 2 << 20
# Chunks are <= 2 MiB; 8 MiB leaves room for framing while still refusing abuse.
MAX_MESSAGE_BYTES = 4 * MAX_CHUNK_BYTES
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Long sampling streams: keep idle connections alive through NATs and proxies.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


def file_chunks(source: Path | bytes, name: str, mime: str = "", offset: int = 0) -> Iterator[tensor_pb2.FileChunk]:
    """Stream a finished file (a path, or its bytes) from `offset` as FileChunks; the last one carries the size and
    the CRC-32C of the whole file (computed over the skipped head too, so a resumed download is checked end to end)."""
    in_memory = isinstance(source, (bytes, bytearray))
    size = len(source) if in_memory else Path(source).stat().st_size
    if not 0 <= offset <= size:
        raise InvalidArgument(f"offset {offset} is outside the file ({size} bytes)")
    crc = 0
    with io.BytesIO(source) if in_memory else open(source, "rb") as f:
        while f.tell() < offset:  # checksum the part the receiver already holds
            crc = google_crc32c.extend(crc, f.read(min(MAX_CHUNK_BYTES, offset - f.tell())))
        off = offset
        while True:
            data = f.read(MAX_CHUNK_BYTES)
            last = off + len(data) >= size
            crc = google_crc32c.extend(crc, data)
            chunk = tensor_pb2.FileChunk(name=name, mime=mime if off == 0 else "", offset=off, data=data, last=last)
            if last:
                chunk.total_bytes, chunk.crc32c = size, crc
            off += len(data)
            yield chunk
            if last:
                return


def _umask() -> int:
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _partial_file(out_path: Path) -> tuple[int, str | None]:
    """A file for the bytes of `out_path` as they arrive: without a name until it is complete (Linux O_TMPFILE in
    the target's directory), so a receiver killed mid-download leaves nothing behind; where the filesystem cannot,
    a hidden named temp file beside it. Either way with the mode any new file gets (0666 less the umask), not a
    temp file's 0600. Returns (fd, temp name or None)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(out_path.parent, flag | os.O_RDWR, 0o666), None  # the kernel applies the umask
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, name


def _publish(fd: int, tmp_name: str | None, out_path: Path) -> None:
    """Give the complete partial file its name, atomically (never a half-written `out_path`)."""
    if tmp_name is not None:
        os.replace(tmp_name, out_path)
        return
    named = str(out_path.parent / f".{out_path.name}.{os.getpid()}.done")
    try:
        os.link(f"/proc/self/fd/{fd}", named)  # name the unnamed file (needs /proc), then move it over the target
    except OSError:  # no /proc: copy it into a named temp file instead
        copy_fd, named = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
        os.fchmod(copy_fd, 0o666 & ~_umask())
        with os.fdopen(copy_fd, "wb") as dst, os.fdopen(os.dup(fd), "rb") as src:
            src.seek(0)
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    try:
        os.replace(named, out_path)
    except BaseException:
        os.unlink(named)
        raise


class FileReceiver:
    """Writes FileChunks into a file that has no name until `finish()` has checked size and CRC-32C, then gives it
    `out_path` (or the path `finish` names, in the same directory) atomically. Nothing is left behind on failure
    (use as a context manager), nor when the receiving process is killed mid-transfer. A receiver of uploads gives
    `max_bytes` (a longer file fails as it arrives) and raises its callers' error class (InvalidArgument); `sha256`
    is the digest of what arrived."""

    def __init__(self, out_path: Path, max_bytes: int = 0, error: type[Exception] = RuntimeError):
        self.out_path = Path(out_path)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.error = max_bytes, error
        fd, self.tmp = _partial_file(self.out_path)
        self.f = os.fdopen(fd, "wb")
        self.size, self.crc, self.complete = 0, 0, False
        self.sha256 = hashlib.sha256()

    def feed(self, fc: tensor_pb2.FileChunk) -> None:
        data = fc.data  # read once: each read of a bytes field is a copy of it
        if fc.offset != self.size:
            raise self.error(f"file bytes arrived at offset {fc.offset}, expected {self.size}; try again")
        if self.max_bytes and self.size + len(data) > self.max_bytes:
            raise self.error(f"the file is larger than {self.max_bytes} bytes (the limit); send a smaller one")
        self.f.write(data)
        self.crc = google_crc32c.extend(self.crc, data)
        self.sha256.update(data)
        self.size += len(data)
        if fc.last:
            if fc.total_bytes != self.size or fc.crc32c != self.crc:
                raise self.error("the file failed its size/checksum check; try again")
            self.complete = True

    def verify(self) -> None:
        """The whole file arrived and passed its size / checksum check (its last chunk said so)."""
        if not self.complete:
            raise self.error("the stream ended before the file was complete; try again")

    def finish(self, out_path: Path | None = None) -> Path:
        self.verify()
        if out_path is not None:
            self.out_path = Path(out_path)
        self.f.flush()
        _publish(self.f.fileno(), self.tmp, self.out_path)
        self.tmp = None
        self.f.close()
        return self.out_path

    def __enter__(self) -> "FileReceiver":
        return self

    def __exit__(self, *exc) -> None:
        if not self.f.closed:
            self.f.close()
        if self.tmp is not None and os.path.exists(self.tmp):
            os.unlink(self.tmp)
