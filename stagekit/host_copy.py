"""Checkpoint files kept in host memory between a stage's turns on the device (docs/residency.md, "Host copies").

A stage's device work runs in a worker that lives for one turn on the device (stagekit/device_worker.py), so
without help every turn reads the checkpoint files again and copies each tensor to the device through pageable
memory. Instead the stage process, which lives across turns and never holds a CUDA context, reads each file once
into a memfd (anonymous shared memory: no name under /dev/shm, freed by the kernel when its last descriptor closes,
so a killed stage leaves nothing behind). At each load its worker maps the copy read-only through
`/proc/<stage pid>/fd/<n>` (`stagekit.checkpoints.WeightSource`, handed to its engine's load); `TensorReader` then
hands out views of the copy instead of reading the file, and `Staging.to_device` moves a view to the GPU through a
small ring of pinned staging buffers: the loader's CPU threads fill one buffer while the other crosses the bus, so a
turn's load is one pass over the bytes at close to the pinned host->device rate.

Whether a stage keeps its copy is decided from the host's free memory, with no knob: a copy is made when the host
still has `HOST_RESERVE_BYTES` available after it (`/proc/meminfo` MemAvailable; shared memory is not counted
there as available, so every stage that keeps a copy lowers what the next one sees). Otherwise the stage loads
from the files each turn as before. The choice is a row of the stage's Status (`status_row`).

    stage process (no CUDA)                        device worker (one turn)
    -----------------------                        ------------------------
    HostCopies.ensure(files) -> {file: /proc/..}   WeightSource.host_copies(files, mapping, to_fill)
      memfd per file, filled once (sendfile)       TensorReader(source=.., views=True) -> views of the copy
    status_row()                                   source.to_device(view, device, dtype): staged pinned copies

Derived copies. Some of what a load puts on the device is not in the files as such: weights the file stores in bf16
that the chosen kernel wants in int8 are converted on the device at every load (the DiT's token refiner: 1.5 GB of
bf16 in, 0.77 GB of int8 out). Beside its file copies the stage keeps one memfd per such conversion (`derived`):
the first turn's worker writes its result there (`stagekit.checkpoints.WeightSource.fill`), the stage keeps it once
that load succeeded (`filled`), and every later turn copies it up like a file's tensors instead of converting
again: the bits the conversion made, so every turn computes with the same weights. A derived copy goes with its
file's copy (a file changed on disk, a host short of memory, the stage's end).

A copy is the file it read (`stagekit.file_identity.FileIdentity`: device, inode, size, mtime, ctime); `ensure` and
`held` reuse it only while the path names that same file, so new weights written over the file with its old size and
mtime (`cp -p`, `rsync -a`, `tar x`) are copied again, a deleted file's copy goes, and a file that changed while it
was copied is not kept.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stagekit.file_identity import FileIdentity, identity

log = logging.getLogger("stagekit.host_copy")

GIB = 1 << 30
# What the host keeps available beside the copies: the jobs' host tensors (latents, frames, the DiT's pinned streamed
# blocks: up to 5.1 GiB on one 22 GB card), the processes themselves and everything else the machine runs.
HOST_RESERVE_BYTES = 16 * GIB
# Read instead of /proc/meminfo MemAvailable (bytes): how tests put a host short of memory.
MEM_AVAILABLE_ENV = "H3_HOST_MEM_AVAILABLE_BYTES"
# A pinned staging buffer per loader thread and slot; tensors below SMALL_BYTES go straight through `.to`.
STAGE_BYTES = 32 << 20
STAGE_SLOTS = 2
SMALL_BYTES = 1 << 20
SENDFILE_CHUNK = 1 << 30


def mem_available() -> int:
    """The host's available memory in bytes (MemAvailable of /proc/meminfo)."""
    injected = os.environ.get(MEM_AVAILABLE_ENV)
    if injected:
        return int(injected)
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class HostCopyChoice:
    """What a stage decided about keeping its files in host memory, and from which numbers."""

    kept: bool
    nbytes: int        # the files' bytes
    available: int     # MemAvailable when it decided

    def describe(self) -> str:
        if self.kept:
            return f"kept in host memory ({self.nbytes / GIB:.2f} GiB): each turn loads from it"
        return "not kept: each turn reads the files"

    def reason(self) -> str:
        verb = "leaves" if self.kept else "would leave"
        return (f"{self.available / GIB:.1f} GiB host memory available at the decision; the copy {verb} "
                f"{(self.available - self.nbytes) / GIB:.1f} GiB (keeps at least {HOST_RESERVE_BYTES / GIB:.0f} GiB)")


def decide(nbytes: int, available: int) -> HostCopyChoice:
    return HostCopyChoice(available - nbytes >= HOST_RESERVE_BYTES, nbytes, available)


@dataclass
class _Copy:
    fd: int
    file: FileIdentity  # the file as it was copied: reused only while the path still names that file, unchanged

    @property
    def size(self) -> int:
        return self.file.size


@dataclass
class _Derived:
    fd: int
    filled: bool = False

    def nbytes(self) -> int:
        return os.fstat(self.fd).st_size


class HostCopies:
    """The stage process's copies of its checkpoint files, one memfd each, read once from disk.

    `ensure(files)` before each load: copies what is missing (or changed on disk since) when the host has room,
    and returns {file path: path the worker opens} for every file held (empty when the stage does not keep copies).
    `release()` closes every copy (the stage's shutdown; the kernel does it too when the process dies)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.choice: HostCopyChoice | None = None
        self._copies: dict[Path, _Copy] = {}
        self._derived: dict[str, _Derived] = {}  # derived key (stagekit.checkpoints.derived_key) -> its memfd
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self._copies.values()) + sum(d.nbytes() for d in self._derived.values())

    def ensure(self, files: list[Path | str], derived: dict[str, int] | None = None) -> dict[str, str]:
        """Before a load: the copies of `files` ({file: path the worker opens}, and the filled derived copies under
        their keys), made now where missing; {} when the host has no room. `derived` ({key: bytes}) is what the
        load may derive from the files: counted in the decision, offered by `to_fill`. A copy whose file was
        replaced or deleted since it was copied goes (with what was derived from it); a file that is gone is left
        out, and the load that reads it fails naming it."""
        with self._lock:
            files = [Path(f).resolve() for f in files]
            now = {f: identity(f) for f in files}
            for f in [f for f in files if f in self._copies and now[f] != self._copies[f].file]:
                log.info("%s: %s %s since it was copied; dropping the copy", self.stage, f,
                         "was deleted" if now[f] is None else "changed on disk")
                os.close(self._copies.pop(f).fd)
                self._drop_derived(f)
            files = [f for f in files if now[f] is not None]
            missing = [f for f in files if f not in self._copies]
            if missing:
                need = sum(now[f].size for f in missing) + sum((derived or {}).values())
                self.choice = decide(self.nbytes + need, mem_available() + self.nbytes)
                log.info("%s: checkpoint files %s (%s)", self.stage, self.choice.describe(), self.choice.reason())
                if not self.choice.kept:
                    self._release_locked()
                    return {}
                for f in missing:
                    try:
                        self._copies[f] = self._copy(f)
                    except OSError as e:  # no room after all (memory taken meanwhile), or the file changed meanwhile
                        log.warning("%s: copying %s into host memory failed (%s); each turn reads the files",
                                    self.stage, f, e)
                        self._release_locked()
                        self.choice = HostCopyChoice(False, self.choice.nbytes, self.choice.available)
                        return {}
            return self._mapping(files)

    def _mapping(self, files: list[Path]) -> dict[str, str]:
        pid = os.getpid()
        out = {str(f): f"/proc/{pid}/fd/{self._copies[f].fd}" for f in files}
        out.update({k: f"/proc/{pid}/fd/{d.fd}" for k, d in self._derived.items() if d.filled
                    and Path(k.rsplit("#", 1)[0]) in files})
        return out

    def held(self, files: list[Path | str]) -> dict[str, str]:
        """{file path: path the worker opens} when every one of `files` is held now and still names the file that was
        copied (else {}), with the filled derived copies: what the next turn's worker may map on standby. Copies
        nothing; `ensure` at the load still decides."""
        with self._lock:
            files = [Path(f).resolve() for f in files]
            if not files or any(f not in self._copies or identity(f) != self._copies[f].file for f in files):
                return {}
            return self._mapping(files)

    def to_fill(self, keys: list[str]) -> dict[str, str]:
        """{key: path the worker writes} for each derived copy in `keys` not filled yet, of a file held now (after
        `ensure`): an empty memfd the load fills (stagekit.checkpoints.WeightSource.fill)."""
        with self._lock:
            out = {}
            for k in keys:
                if Path(k.rsplit("#", 1)[0]) not in self._copies:
                    continue
                d = self._derived.get(k)
                if d is None:
                    d = self._derived[k] = _Derived(os.memfd_create(f"h3-{self.stage}-derived", os.MFD_CLOEXEC))
                if not d.filled:
                    out[k] = f"/proc/{os.getpid()}/fd/{d.fd}"
            return out

    def filled(self, keys: list[str]) -> None:
        """The load that was offered `keys` (`to_fill`) succeeded and wrote them: the next turns read them."""
        with self._lock:
            for k in keys:
                if k in self._derived:
                    self._derived[k].filled = True
                    log.info("%s: derived copy %s kept in host memory (%.2f GiB)", self.stage, k.rsplit("/", 1)[-1],
                             self._derived[k].nbytes() / GIB)

    def _drop_derived(self, file: Path) -> None:
        for k in [k for k in self._derived if Path(k.rsplit("#", 1)[0]) == file]:
            os.close(self._derived.pop(k).fd)

    def _copy(self, path: Path) -> _Copy:
        """A memfd holding the bytes of the file at `path`, with the identity of the file read; OSError when the file
        changed while it was read (its bytes may mix two versions)."""
        fd = os.memfd_create(f"h3-{self.stage}-{path.name}", os.MFD_CLOEXEC)
        try:
            with open(path, "rb") as src:
                read = FileIdentity.of(os.fstat(src.fileno()))
                done = 0
                while done < read.size:
                    n = os.sendfile(fd, src.fileno(), done, min(SENDFILE_CHUNK, read.size - done))
                    if n == 0:
                        raise OSError(f"{path} ended at byte {done} of {read.size}")
                    done += n
                if FileIdentity.of(os.fstat(src.fileno())) != read:
                    raise OSError(f"{path} changed while it was copied")
        except BaseException:
            os.close(fd)
            raise
        return _Copy(fd, read)

    def release(self) -> None:
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        for c in [*self._copies.values(), *self._derived.values()]:
            os.close(c.fd)
        self._copies.clear()
        self._derived.clear()

    def status_row(self) -> tuple[str, str, str]:
        """("host copy", the choice, its numbers) for the stage's Status kernel rows."""
        if self.choice is None:
            return ("host copy", "decided at the first load",
                    f"checkpoint files stay in host memory between turns when the host keeps "
                    f"{HOST_RESERVE_BYTES / GIB:.0f} GiB available beside them")
        return ("host copy", self.choice.describe(), self.choice.reason())


# =====================================================================================================================
# Worker side: host tensor -> device through pinned staging buffers
# =====================================================================================================================
class _ThreadStaging(threading.local):
    """One loader thread's staging buffers (pinned), their events and its copy stream."""

    def __init__(self):
        self.device = None
        self.buffers: list[torch.Tensor] = []
        self.events: list = []
        self.stream = None


class Staging:
    """Moves host tensors to a device through pinned staging buffers, one set per loader thread, and counts where
    the threads' time went (`seconds`). One per load (`stagekit.checkpoints.WeightSource.staging`)."""

    def __init__(self) -> None:
        self._threads = _ThreadStaging()
        self._seconds = {"pin": 0.0, "fill": 0.0, "wait": 0.0}
        self._lock = threading.Lock()

    def seconds(self) -> dict[str, float]:
        """Seconds the loader threads spent so far, summed over threads: "pin" allocating their pinned buffers,
        "fill" copying host bytes into them (the CPU side: page faults of a fresh mapping of the copy included),
        "wait" waiting for a buffer's previous chunk and each tensor's last one to reach the device (the bus side)."""
        with self._lock:
            return dict(self._seconds)

    def _add(self, what: str, seconds: float) -> None:
        with self._lock:
            self._seconds[what] += seconds

    def _buffers(self, device: torch.device) -> _ThreadStaging:
        s = self._threads
        if s.device != device:
            t0 = time.perf_counter()
            s.device = device
            s.buffers = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGE_SLOTS)]
            s.events = [None] * STAGE_SLOTS
            s.stream = torch.cuda.Stream(device)
            self._add("pin", time.perf_counter() - t0)
        return s

    def to_device(self, t: torch.Tensor, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor on `device` holding `t` (a CPU tensor, e.g. a view of a host copy), cast to `dtype` there.

        CUDA: the bytes go up as stored, chunk by chunk through this thread's pinned staging buffers on its own
        stream (the CPU fills one buffer while the other is on the bus), and the cast runs on the device. Casting
        before or after the copy gives the same bits (IEEE round-to-nearest-even either way; widening is exact).
        Elsewhere: a copy (`t` may be a read-only view), cast the same way. Returns when the copy is done."""
        device = torch.device(device)
        dtype = dtype or t.dtype
        if device.type != "cuda":
            return t.to(dtype) if dtype != t.dtype else t.clone(memory_format=torch.contiguous_format)
        src = t.contiguous()
        nbytes = src.numel() * src.element_size()
        if nbytes < SMALL_BYTES:
            return src.to(device).to(dtype)
        s = self._buffers(device)
        out = torch.empty(src.shape, dtype=src.dtype, device=device)
        flat_src = src.reshape(-1).view(torch.uint8)
        flat_out = out.view(-1).view(torch.uint8)
        s.stream.wait_stream(torch.cuda.current_stream(device))  # `out`'s memory may have been freed by queued work
        with torch.cuda.stream(s.stream):
            for j, lo in enumerate(range(0, nbytes, STAGE_BYTES)):
                k = j % STAGE_SLOTS
                n = min(STAGE_BYTES, nbytes - lo)
                t0 = time.perf_counter()
                if s.events[k] is not None:
                    s.events[k].synchronize()  # the buffer's previous chunk has left for the device
                t1 = time.perf_counter()
                # A plain memcpy (ctypes drops the GIL): the loader's threads copy in parallel without each one
                # starting a team of intra-op threads.
                ctypes.memmove(s.buffers[k].data_ptr(), flat_src.data_ptr() + lo, n)
                self._add("wait", t1 - t0)
                self._add("fill", time.perf_counter() - t1)
                flat_out[lo: lo + n].copy_(s.buffers[k][:n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s.stream)
                s.events[k] = ev
        t0 = time.perf_counter()
        s.stream.synchronize()
        self._add("wait", time.perf_counter() - t0)
        return out if dtype == out.dtype else out.to(dtype)
