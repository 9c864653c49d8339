"""The one tensor wire codec shared by every stage.

A tensor travels as a stream of `TensorChunk` messages: the first carries a
`TensorHeader` (name, dtype, shape, byte count, CRC-32C), every chunk carries
its byte offset, the final one is flagged `last` and carries the checksum (so a
sender streams without a second pass over the data). The receiver preallocates the
tensor (in a mapping of its own, `staging_buffer`), copies each chunk straight into
place (one copy), and checks everything it was promised. Any mismatch raises
`WireError`, which servers map to INVALID_ARGUMENT; nothing is handed on until the
whole tensor has been checked.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import google_crc32c
import torch

from h3.v1 import tensor_pb2
from stagekit.checkpoints import nonfinite_flag
from stagekit.errors import Internal, InvalidArgument
from stagekit.transport import MAX_CHUNK_BYTES

# Wire names of the dtypes a stage may exchange. Explicit, so a new dtype is a
# deliberate decision rather than whatever str(torch.dtype) happens to print.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
})
_NAMES = MappingProxyType({v: k for k, v in DTYPES.items()})
# The float dtypes a stage accepts for activations and latents (float64 is refused: no stage computes in it).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
# A dtype class ("float" | "int" | "uint8", as a model's tensor table states it) -> the wire dtypes it admits.
DTYPE_CLASSES = MappingProxyType({"float": FLOAT_DTYPES, "int": INT_DTYPES, "uint8": ("uint8",)})

# Elements of a rejected tensor counted at a time (a 256 KiB temporary: the allocator's small-block cache reuses it).
FINITE_SLAB = 1 << 18

# Upper bound for one tensor (the decoded RGB of the largest canvas is ~1.1 GiB).
MAX_TENSOR_BYTES = 4 << 30


class WireError(InvalidArgument):
    """A tensor stream is malformed: wrong dtype/shape/size/checksum/order (the request is wrong)."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel on the wire; supported: {sorted(DTYPES)}") from None


def _crc32c(data: bytes, crc: int = 0) -> int:
    return google_crc32c.extend(crc, data)


def header_crc(header: tensor_pb2.TensorHeader) -> int:
    """Seed of a tensor's checksum: the CRC-32C of "name|dtype|d0,d1,...|nbytes".

    The data CRC continues from it, so a header edit that keeps the byte count (a reshape, fp16 <-> bf16) is
    caught as surely as a flipped data byte.
    """
    text = f"{header.name}|{header.dtype}|{','.join(str(d) for d in header.shape)}|{header.nbytes}"
    return _crc32c(text.encode())


def tensor_chunks(name: str, tensor: torch.Tensor, chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[tensor_pb2.TensorChunk]:
    """Encode `tensor` as chunk messages (CPU copy first if it lives on a device)."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    t = tensor.detach().to("cpu").contiguous()
    header = tensor_pb2.TensorHeader(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape))
    nbytes = t.numel() * t.element_size()
    header.nbytes = nbytes
    crc = header_crc(header)
    if nbytes == 0:
        yield tensor_pb2.TensorChunk(header=header, name=name, offset=0, data=b"", last=True, crc32c=crc)
        return
    # A flat byte view of the storage: nothing is copied until a chunk is sliced out.
    flat = t.reshape(-1).view(torch.uint8).numpy()
    for off in range(0, nbytes, chunk_bytes):
        piece = flat[off : off + chunk_bytes].tobytes()
        crc = _crc32c(piece, crc)
        last = off + chunk_bytes >= nbytes
        msg = tensor_pb2.TensorChunk(name=name, offset=off, data=piece, last=last)
        if off == 0:
            msg.header.CopyFrom(header)
        if last:
            msg.crc32c = crc
        yield msg


# glibc's malloc_trim (None with another C library): returns the free pages of every arena to the system, ~0.05 ms.
# An upload's 2 MiB messages are received on threads of their own; once glibc has raised its mmap threshold they come
# from those threads' arenas, which keep them after the free (rounds of 8 rejected 24 MiB uploads at a time left
# +80..230 MiB behind without it, +15..34 MiB with it).
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)


def staging_buffer(nbytes: int) -> torch.Tensor:
    """An upload's [nbytes] uint8 buffer in an anonymous mapping of its own, returned to the system the moment the
    last tensor viewing it is freed.

    Not from malloc: once glibc has freed one large block it raises its mmap threshold (up to 32 MiB), and blocks
    under it then come from the receiving thread's arena, which keeps them after the free. Uploads rejected on
    rotating gRPC threads would leave one buffer in each thread's arena (docs/reliability.md, "Rejected uploads")."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


class _Pending:
    __slots__ = ("header", "buf", "view", "received", "crc")

    def __init__(self, header: tensor_pb2.TensorHeader, max_bytes: int):
        if header.dtype not in DTYPES:
            raise WireError(f"tensor {header.name!r}: unknown dtype {header.dtype!r}; supported: {sorted(DTYPES)}")
        if any(d < 0 for d in header.shape):
            raise WireError(f"tensor {header.name!r}: negative dimension in shape {list(header.shape)}")
        itemsize = torch.empty((), dtype=DTYPES[header.dtype]).element_size()
        expect = math.prod(header.shape) * itemsize
        if header.nbytes != expect:
            raise WireError(
                f"tensor {header.name!r}: header says {header.nbytes} bytes but shape {list(header.shape)} "
                f"of {header.dtype} needs {expect}"
            )
        if expect > max_bytes:
            raise WireError(f"tensor {header.name!r}: {expect} bytes exceeds the limit of {max_bytes}")
        self.header = header
        self.buf = staging_buffer(expect)
        self.view = memoryview(self.buf.numpy()) if expect else None
        self.received = 0
        self.crc = header_crc(header)


class TensorAssembler:
    """Reassembles tensors from chunks, validating as it goes.

    `expect` optionally pins names to (dtype, shape): the dtype is a wire name, a tuple of accepted names, or
    None for any; the shape may use None as a wildcard dimension. A tensor that disagrees is rejected when its
    header arrives, before any of its data is accepted; `hints` adds a per-name sentence to a shape mismatch (what
    the shape follows from). `discard()` frees every buffer of an abandoned stream.
    """

    def __init__(
        self,
        expect: dict[str, tuple[str | tuple[str, ...] | None, tuple[int | None, ...] | None]] | None = None,
        max_bytes: int = MAX_TENSOR_BYTES,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        hints: dict[str, str] | None = None,
    ):
        self.expect = expect
        self.hints = hints or {}
        self.max_bytes = max_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self._pending: dict[str, _Pending] = {}
        self.done: dict[str, torch.Tensor] = {}

    def _check_expected(self, h: tensor_pb2.TensorHeader) -> None:
        if self.expect is None:
            return
        if h.name not in self.expect:
            raise WireError(f"unexpected tensor {h.name!r}; this call takes {sorted(self.expect)}")
        dtype, shape = self.expect[h.name]
        accepted = (dtype,) if isinstance(dtype, str) else dtype
        if accepted is not None and h.dtype not in accepted:
            raise WireError(f"tensor {h.name!r}: dtype {h.dtype} but {', '.join(accepted[:-1])}"
                            f"{' or ' if len(accepted) > 1 else ''}{accepted[-1]} is required")
        if shape is not None:
            got = list(h.shape)
            ok = len(got) == len(shape) and all(s is None or s == g for s, g in zip(shape, got))
            if not ok:
                want = ["*" if s is None else s for s in shape]
                hint = f": {self.hints[h.name]}" if h.name in self.hints else ""
                raise WireError(f"tensor {h.name!r}: shape {got} but {want} is required{hint}")

    def feed(self, chunk: tensor_pb2.TensorChunk) -> tuple[str, torch.Tensor] | None:
        """Take one chunk; returns (name, tensor) when a tensor is complete and verified."""
        name, data = chunk.name, chunk.data  # read once: each read of a bytes field is a copy of it
        if len(data) > self.max_chunk_bytes:
            raise WireError(f"tensor {name!r}: chunk of {len(data)} bytes exceeds {self.max_chunk_bytes}")
        if chunk.HasField("header"):
            if chunk.header.name != name:
                raise WireError(f"chunk name {name!r} disagrees with its header name {chunk.header.name!r}")
            if name in self._pending or name in self.done:
                raise WireError(f"tensor {name!r} sent twice")
            self._check_expected(chunk.header)
            self._pending[name] = _Pending(chunk.header, self.max_bytes)
        p = self._pending.get(name)
        if p is None:
            raise WireError(f"tensor {name!r}: chunk before its header (or after it completed)")
        n = len(data)
        if chunk.offset != p.received:
            what = "duplicated" if chunk.offset < p.received else "missing"
            raise WireError(f"tensor {name!r}: chunk at offset {chunk.offset}, expected {p.received} ({what} chunk)")
        if p.received + n > p.header.nbytes:
            raise WireError(f"tensor {name!r}: more data than the {p.header.nbytes} bytes declared")
        if n:
            p.view[p.received : p.received + n] = data
            p.crc = _crc32c(data, p.crc)
            p.received += n
        if not chunk.last:
            return None
        if p.received != p.header.nbytes:
            raise WireError(f"tensor {name!r}: stream ended after {p.received} of {p.header.nbytes} bytes")
        if p.crc != chunk.crc32c:
            raise WireError(f"tensor {name!r}: checksum mismatch (crc32c {p.crc:#010x} != {chunk.crc32c:#010x})")
        del self._pending[name]
        t = p.buf.view(DTYPES[p.header.dtype]).reshape(tuple(p.header.shape))
        self.done[name] = t
        return name, t

    def discard(self) -> None:
        """Free every buffer now (an abandoned or rejected upload), not when the garbage collector next runs:
        a frame kept alive by the failure's traceback still holds this object, but no longer its memory. Then
        the allocator gives back what the upload's messages left in its per-thread caches (`_malloc_trim`)."""
        for p in self._pending.values():
            if p.view is not None:
                p.view.release()
            p.buf = p.view = None
        self._pending.clear()
        self.done.clear()
        if _malloc_trim is not None:
            _malloc_trim(0)

    def finish(self, required: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """Call when the stream ends: fails on truncated tensors or missing required ones."""
        if self._pending:
            names = ", ".join(f"{k!r} ({p.received}/{p.header.nbytes} bytes)" for k, p in self._pending.items())
            raise WireError(f"stream ended with incomplete tensors: {names}")
        missing = [r for r in required if r not in self.done]
        if missing:
            raise WireError(f"stream ended without required tensors: {missing}")
        return self.done


def check_finite(name: str, t: torch.Tensor) -> None:
    """Reject NaN/Inf in a request's tensor before a stage spends time on it (the client's fault: WireError).

    No temporary the size of the tensor (`nonfinite_flag`, then a count slab by slab): a rejected upload leaves
    nothing in the allocator's per-thread caches (docs/reliability.md, "Rejected uploads")."""
    flag = nonfinite_flag(t)
    if flag is None or not bool(flag):
        return
    bad = sum(int((~torch.isfinite(s)).sum()) for s in t.reshape(-1).split(FINITE_SLAB))
    raise WireError(f"tensor {name!r} contains {bad} NaN/Inf values")


def check_result(stage: str, name: str, t: torch.Tensor, unit: str, axis: int = 0, offset: int = 0,
                 total: int | None = None) -> None:
    """A stage's own result must be finite before it is passed on: NaN / Inf there is the server's fault (its
    weights or kernels), raised as `Internal` naming the stage, the tensor and the first bad `unit` (the index along
    `axis`: a token, a frame, an audio channel; for a part of a longer result, `offset` + the index of `total`). One
    host sync when the result is finite."""
    flag = nonfinite_flag(t)
    if flag is None or not bool(flag):
        return
    ok = torch.isfinite(t)
    bad_at = (~ok).movedim(axis, 0).reshape(t.shape[axis], -1).any(dim=1)
    first = int(bad_at.nonzero()[0])
    raise Internal(f"{stage}: its result {name} holds {int((~ok).sum())} NaN/Inf value(s), first at {unit} "
                   f"{offset + first} of {t.shape[axis] if total is None else total}; a server fault (its weights or "
                   "kernels), nothing was passed on")
