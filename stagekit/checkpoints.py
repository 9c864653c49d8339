"""The one checkpoint toolkit every stage loads its weights with (docs/checkpoints.md).

* `read_header(file)`: the safetensors header of one file (tensor names, shapes, dtypes, metadata), checked
  against the file size and the format's rules, without reading tensor data;
* `open_checkpoint(path)`: a single file, a directory of shards (with or without an index) or an index file ->
  all tensors' header entries, the metadata, the `config.json` beside the shards, and whether it is sharded;
* `key_report(have, want)`: missing / unexpected / misshapen / wrong-dtype keys against what an architecture
  expects, raised as one `CheckpointError` that names the file and the first offending key;
* `NameMap`: our parameter names <-> a source's names (diffusers, release prefixes), one rule table per source,
  used in both directions;
* `TensorReader`: reads whole tensors or row / column slices through safetensors, turning any read failure of a
  file that went bad after start-up into a `CheckpointError` (FAILED_PRECONDITION) naming file and tensor;
* `WeightSource`: where one load reads its weights, handed to the engine's load by the runtime: the files, each from
  disk or from the stage process's copy of it in host memory (stagekit/host_copy.py), and what the load derives from
  them (weights converted to their kernel's format) kept beside those copies (`derived`, `fill`);
  `TensorReader(source=..., views=True)` hands out views of the copies; `prefault_copies` maps them ahead of the
  turn (a worker on standby) and faults their pages in;
* `FiniteCheck` / `nonfinite_flag`: no weight holds a NaN or an Inf. `TensorReader` checks every float tensor it
  reads on the CPU; a loader that copies its tensors to a GPU checks the copies there instead, one queued flag per
  tensor and one host sync for the whole load.

`CheckpointError` is the only error a bad checkpoint raises. It is a FailedPrecondition: the server's files are
wrong, never the client's request.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import ctypes
import logging
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

from stagekit.errors import FailedPrecondition
from stagekit.host_copy import Staging

HEADER_LEN_BYTES = 8  # safetensors: little-endian u64 header length, then JSON header, then data
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NAMED = 10  # keys listed per category in a key report
INDEX_SUFFIX = ".safetensors.index.json"
CONFIG_JSON = "config.json"
SHARD_NAME = re.compile(r"-\d+-of-\d+\.safetensors$")  # `model-00001-of-00014.safetensors`

# Bytes per element of every safetensors dtype.
DTYPE_BYTES = MappingProxyType({
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
})
FLOAT = frozenset({"F64", "F32", "F16", "BF16"})  # dense float storage: loaders cast it to the compute dtype
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Elements of an fp8 tensor widened to fp32 at a time by the finiteness check (bounds the temporary to 256 MiB).
FINITE_CHUNK = 1 << 26
TORCH_DTYPE = MappingProxyType({
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
    "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,  # fp8: nvfp4_awq block scales
})


class CheckpointError(FailedPrecondition):
    """A checkpoint on disk that cannot be used: unreadable, truncated, a wrong variant, or keys that do not fit
    the architecture. `file` is the file (or checkpoint directory) and `key` the first offending tensor, when
    there is one; both lead the message."""

    def __init__(self, file: str | Path, problem: str, key: str | None = None):
        self.file = str(file)
        self.key = key
        self.problem = problem
        super().__init__(f"{file}: " + (f"{key}: " if key else "") + problem)


# =====================================================================================================================
# Headers
# =====================================================================================================================
@dataclass(frozen=True)
class HeaderEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "I8"
    disk_key: str = ""  # name inside the file when it differs from the dict key (renamed / prefix stripped)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileHeader:
    file: Path
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]


def read_header(file: str | Path) -> FileHeader:
    """Parse one safetensors header and check it against the file: every dtype known, every tensor's byte range as
    long as its shape and dtype say, the ranges tiling the data section without holes, the file long enough."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw_len = fh.read(HEADER_LEN_BYTES)
            if len(raw_len) != HEADER_LEN_BYTES:
                raise CheckpointError(file, f"truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(MAX_HEADER_BYTES, size - HEADER_LEN_BYTES):
                raise CheckpointError(file, f"corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(file, f"unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(file, "unreadable safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(file, "corrupt safetensors header: __metadata__ must map names to strings")
    data_bytes = size - HEADER_LEN_BYTES - n
    entries, spans = {}, []
    for key, info in header.items():
        try:
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(file, f"corrupt header entry: {e!r}", key) from e
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(file, f"corrupt header entry: unknown dtype {dtype!r}", key)
        if any(d < 0 for d in shape) or not 0 <= start <= end:
            raise CheckpointError(file, f"corrupt header entry: shape {list(shape)}, offsets [{start}, {end}]", key)
        if end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(file, f"corrupt header entry: {dtype}{list(shape)} needs "
                                        f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes, the offsets give {end - start}",
                                  key)
        entries[key] = HeaderEntry(file, shape, dtype)
        spans.append((start, end, key))
    cursor = 0
    for start, end, key in sorted(spans):
        if start != cursor:
            raise CheckpointError(file, f"corrupt header: tensor data starts at byte {start}, expected {cursor} "
                                        f"(overlapping or missing tensor bytes)", key)
        if end > data_bytes:
            raise CheckpointError(file, f"truncated: the tensor ends at byte {end} of the data section, which has "
                                        f"only {data_bytes} bytes", key)
        cursor = end
    if cursor != data_bytes:
        raise CheckpointError(file, f"corrupt: {data_bytes - cursor} bytes after the last tensor")
    return FileHeader(file, entries, {str(k): v for k, v in metadata.items()})


@dataclass
class Checkpoint:
    """All header entries of a checkpoint (one file, or the shards of a directory), nothing read yet."""

    path: Path  # as given
    files: list[Path]
    root: Path | None  # the directory holding the shards (None for a single file)
    sharded: bool  # an index file or `-NNNNN-of-NNNNN` shard names: the layout of a release / diffusers save
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]  # every file's `__metadata__`, merged
    config: dict = field(default_factory=dict)  # `config.json` beside the shards ({} if none)

    @property
    def config_file(self) -> Path | None:
        return None if self.root is None else self.root / CONFIG_JSON


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise CheckpointError(index, f"unreadable index: {e!r}") from e
    if not names:
        raise CheckpointError(index, "index lists no shards")
    files = [index.parent / n for n in names]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(index, f"lists {len(absent)} missing shard(s): {absent[:MAX_NAMED]}")
    return files


def resolve_files(path: str | Path, subdir: str | None = None) -> tuple[list[Path], Path | None, bool]:
    """(safetensors files, directory they live in or None for a single file, sharded?). `subdir` is looked for
    inside a directory first (`transformer/` of a diffusers pipeline folder)."""
    path = Path(path)
    if path.is_file():
        if path.name.endswith(INDEX_SUFFIX):
            return _index_files(path), path.parent, True
        return [path], None, False
    if not path.is_dir():
        raise CheckpointError(path, "does not exist")
    if subdir and (path / subdir).is_dir():
        path = path / subdir
    indexes = sorted(path.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CheckpointError(path, f"holds {len(indexes)} index files ({[p.name for p in indexes]}); keep one")
    if indexes:
        return _index_files(indexes[0]), path, True
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(path, "no *.safetensors files in this directory")
    return files, path, any(SHARD_NAME.search(f.name) for f in files)


def open_checkpoint(path: str | Path, subdir: str | None = None) -> Checkpoint:
    """Read every header of a checkpoint (no tensor data): merged entries, metadata and config.json."""
    files, root, sharded = resolve_files(path, subdir)
    tensors: dict[str, HeaderEntry] = {}
    metadata: dict[str, str] = {}
    for f in files:
        head = read_header(f)
        for key, entry in head.tensors.items():
            if key in tensors:
                raise CheckpointError(f, f"tensor also appears in {tensors[key].file}", key)
            tensors[key] = entry
        metadata.update(head.metadata)
    config = {}
    if root is not None and (root / CONFIG_JSON).is_file():
        try:
            config = json.loads((root / CONFIG_JSON).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(root / CONFIG_JSON, f"unreadable: {e}") from e
        if not isinstance(config, dict):
            raise CheckpointError(root / CONFIG_JSON, "must hold a JSON object")
    return Checkpoint(Path(path), files, root, sharded, tensors, metadata, config)


def metadata_json(ckpt: Checkpoint, key: str) -> dict | None:
    """A JSON object stored under `key` in the safetensors metadata (None when absent)."""
    text = ckpt.metadata.get(key)
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(ckpt.files[0], f"metadata {key!r} is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointError(ckpt.files[0], f"metadata {key!r} must be a JSON object")
    return doc


# =====================================================================================================================
# Key report
# =====================================================================================================================
@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of an architecture must look like: its shape (None: any) and the dtypes allowed."""

    shape: tuple[int, ...] | None
    dtypes: frozenset[str] = FLOAT


def describe_dtypes(dtypes: frozenset[str]) -> str:
    return "a float dtype" if dtypes == FLOAT else " or ".join(sorted(dtypes))


@dataclass
class KeyReport:
    """How a checkpoint's tensors differ from an architecture's (keys in our names)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshapen: list[str] = field(default_factory=list)  # "key DTYPE[shape] (expected [shape])"
    wrong_dtype: list[str] = field(default_factory=list)  # "key DTYPE[shape] (expected ...)"
    first: tuple[str, Path | None] | None = None  # (key, file) of the first problem in architecture order

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.misshapen or self.wrong_dtype)

    def raise_if_bad(self, source: str | Path, what: str) -> None:
        """One CheckpointError (one line) naming the file and the first offending key, then every problem by kind."""
        if self.ok:
            return
        key, file = self.first
        parts = [f"does not match {what}; first offending key: {key}"]
        for label, items in (("missing key(s)", self.missing), ("unexpected key(s)", self.unexpected),
                             ("misshapen key(s)", self.misshapen), ("key(s) with a wrong dtype", self.wrong_dtype)):
            if items:
                parts.append(f"{len(items)} {label}: {named(items)}")
        raise CheckpointError(file or source, "; ".join(parts), key)


def tensor_entries(sd: Mapping[str, torch.Tensor], source: str | Path) -> dict[str, HeaderEntry]:
    """Header entries for tensors already in memory (a converted state dict), so they go through the same report."""
    names = {v: k for k, v in TORCH_DTYPE.items()}
    return {k: HeaderEntry(Path(source), tuple(t.shape), names.get(t.dtype, str(t.dtype))) for k, t in sd.items()}


def named(keys: list[str]) -> str:
    more = f" ... (+{len(keys) - MAX_NAMED} more)" if len(keys) > MAX_NAMED else ""
    return ", ".join(keys[:MAX_NAMED]) + more


def key_report(have: Mapping[str, HeaderEntry], want: Mapping[str, TensorSpec], *, optional: Iterable[str] = (),
               ignored: Iterable[str] = ()) -> KeyReport:
    """Compare a checkpoint's entries (our names) with an architecture's specs. `optional` keys may be absent;
    `ignored` keys may be present and are not checked."""
    optional, ignored = set(optional), set(ignored)
    report = KeyReport()
    for k, spec in want.items():
        e = have.get(k)
        if e is None:
            if k not in optional:
                report.missing.append(k)
                report.first = report.first or (k, None)
            continue
        got = f"{k} {e.dtype}{list(e.shape)}"
        if spec.shape is not None and e.shape != spec.shape:
            report.misshapen.append(f"{got} (expected {list(spec.shape)})")
        elif e.dtype not in spec.dtypes:
            report.wrong_dtype.append(f"{got} (expected {describe_dtypes(spec.dtypes)})")
        else:
            continue
        report.first = report.first or (k, e.file)
    for k, e in have.items():
        if k not in want and k not in ignored:
            report.unexpected.append(k)
            report.first = report.first or (k, e.file)
    return report


# =====================================================================================================================
# Name mapping
# =====================================================================================================================
def _compile(pattern: str) -> re.Pattern:
    anchored = pattern.startswith("^")
    body = re.escape(pattern[1:] if anchored else pattern).replace(r"\#", r"(\d+)")
    return re.compile(("^" if anchored else "") + body)


def _template(pattern: str) -> str:
    """Replacement string: each `#` becomes the next captured index."""
    parts = (pattern[1:] if pattern.startswith("^") else pattern).replace("\\", "\\\\").split("#")
    return parts[0] + "".join(f"\\g<{n}>{p}" for n, p in enumerate(parts[1:], 1))


@dataclass(frozen=True)
class NameMap:
    """Renames between our parameter names and a source's, from one table of `(ours, theirs)` rules.

    A rule starting with `^` applies at the start of a key (the first such rule that matches, once; `("^", "^x.")`
    adds or strips the prefix `x.`); any other rule applies wherever it occurs. `#` stands for a block index and
    is carried over. The same table maps both ways, so a name map is written once per source.
    """

    rules: tuple[tuple[str, str], ...]
    _fwd: tuple = field(init=False, repr=False, compare=False)
    _back: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for ours, theirs in self.rules:
            if ours.startswith("^") != theirs.startswith("^") or ours.count("#") != theirs.count("#"):
                raise ValueError(f"name rule ({ours!r}, {theirs!r}): both sides must agree on '^' and '#'")
        compiled = lambda src, dst: (src.startswith("^"), _compile(src), _template(dst))  # noqa: E731
        object.__setattr__(self, "_fwd", tuple(compiled(o, t) for o, t in self.rules))
        object.__setattr__(self, "_back", tuple(compiled(t, o) for o, t in self.rules))

    @classmethod
    def prefix(cls, theirs: str) -> "NameMap":
        """The source puts `theirs` in front of our names."""
        return cls((("^", "^" + theirs),))

    @staticmethod
    def _apply(rules, key: str) -> str:
        anchored_done = False
        for anchored, rx, repl in rules:
            if anchored:
                if not anchored_done and rx.match(key):
                    key, anchored_done = rx.sub(repl, key, count=1), True
            else:
                key = rx.sub(repl, key)
        return key

    def to_source(self, key: str) -> str:
        return self._apply(self._fwd, key)

    def from_source(self, key: str) -> str:
        return self._apply(self._back, key)


IDENTITY = NameMap(())


# =====================================================================================================================
# Reading tensors
# =====================================================================================================================
# Where a load reads its weights: `WeightSource`, built by the runtime (stagekit/runtime.py) and handed to the
# engine's load; in a device worker's turn it carries the stage process's host copies (stagekit/host_copy.py).
_log = logging.getLogger("stagekit.checkpoints")
DERIVED_ALIGN = 64  # every tensor of a derived copy starts at a multiple of this: its views need no copy
# Bytes a prefault pass asks the kernel for at once (one madvise call, the GIL released).
PREFAULT_CHUNK = 256 << 20
MADV_POPULATE_READ = 22  # Linux 5.14+


def derived_key(file: str | Path, what: str) -> str:
    """The name of what a load derives from `file` (`what`: the conversion, e.g. "int8 linears from float16", no
    "#"): the file's path and `what`, so a derived copy goes with its file."""
    return f"{Path(file).resolve()}#{what}"


def _copy_name(name: str | Path) -> Path:
    """How a host copy is looked up: a file's resolved path, or a derived copy's key (`derived_key`)."""
    return Path(name).resolve()


class MappedCopy:
    """A host copy of one safetensors file (or a derived copy), mapped read-only (shared with the stage process
    that holds it): tensors are views of the mapping, located by the copy's own header."""

    def __init__(self, source: str):
        self.source = source
        fd = os.open(source, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            size, self.ino = st.st_size, st.st_ino
            # Not populated by the map: a worker on standby faults the pages in on a thread of its own
            # (`prefault_copies`); otherwise the loader's threads do as they copy, in parallel.
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        (n,) = struct.unpack("<Q", self.map[:HEADER_LEN_BYTES])
        header = json.loads(self.map[HEADER_LEN_BYTES: HEADER_LEN_BYTES + n])
        header.pop("__metadata__", None)
        self.spans = {k: (HEADER_LEN_BYTES + n + int(v["data_offsets"][0]),
                          HEADER_LEN_BYTES + n + int(v["data_offsets"][1]), str(v["dtype"]), tuple(v["shape"]))
                      for k, v in header.items()}
        with warnings.catch_warnings():  # read-only on purpose: nothing in a worker may write the stage's copy
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def same_copy(self, source: str) -> bool:
        """Whether `source` (a copy's path) still names the copy this maps: same path and same memfd inode (a copy
        made again after its file changed may reuse the descriptor number)."""
        if source != self.source:
            return False
        try:
            return os.stat(source).st_ino == self.ino
        except OSError:
            return False

    def tensor(self, key: str) -> torch.Tensor:
        """A read-only view of tensor `key` (a copy when its bytes are not aligned for its dtype)."""
        start, end, dtype, shape = self.spans[key]
        dt = TORCH_DTYPE.get(dtype)
        if dt is None:
            raise KeyError(f"dtype {dtype} has no torch equivalent")
        raw = self.bytes[start:end]
        if start % DTYPE_BYTES[dtype]:
            raw = raw.clone()
        return raw.view(dt).view(shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k) for k in self.spans}


def map_copies(copies: Mapping[str, str], mapped: Mapping[Path, MappedCopy] = MappingProxyType({})
               ) -> dict[Path, MappedCopy]:
    """Map the host copies `copies` ({file or derived key: path of its copy}) read-only, reusing each of `mapped`
    that is still the same copy (one a worker on standby mapped and prefaulted: `prefault_copies`)."""
    out = {}
    for name, source in copies.items():
        key = _copy_name(name)
        old = mapped.get(key)
        out[key] = old if old is not None and old.same_copy(source) else MappedCopy(source)
    return out


@dataclass(frozen=True)
class Prefault:
    """Host copies mapped ahead of a load and their pages being faulted in on `thread` (`prefault_copies`)."""

    mapped: Mapping[Path, MappedCopy]
    thread: threading.Thread
    stop: threading.Event
    took: list[float]  # the thread's seconds, once it ended

    @property
    def seconds(self) -> float | None:
        """How long the prefault ran, once it ended (None while it runs)."""
        return self.took[0] if self.took else None


def prefault_copies(copies: Mapping[str, str]) -> Prefault:
    """Map the host copies `copies` ({file or derived key: path of its copy}) now and fault their pages in on a
    background thread (madvise MADV_POPULATE_READ, a chunk at a time): a device worker on standby does it before its
    turn, so the turn's load copies from pages already mapped instead of faulting ~5 million of them in (0.15-0.2 s
    of CPU per GiB measured on a 2-core VM). Nothing touches a device. The thread (a daemon) stops early when `stop`
    is set (the load was handed other copies). A kernel without MADV_POPULATE_READ leaves the faults to the load."""
    mapped = map_copies(copies)
    stop, took = threading.Event(), []

    def populate() -> None:
        t0 = time.monotonic()
        try:
            _populate()
        finally:
            took.append(time.monotonic() - t0)

    def _populate() -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for c in mapped.values():
            base, size = c.bytes.data_ptr(), c.bytes.numel()
            for lo in range(0, size, PREFAULT_CHUNK):
                if stop.is_set():
                    return
                if madvise(base + lo, min(PREFAULT_CHUNK, size - lo), MADV_POPULATE_READ) != 0:
                    _log.info("host copy %s: pages not prefaulted (errno %d); the load faults them in", c.source,
                              ctypes.get_errno())
                    return

    t = threading.Thread(target=populate, name="prefault-host-copies", daemon=True)
    t.start()
    return Prefault(MappingProxyType(mapped), t, stop, took)


@dataclass(frozen=True)
class WeightSource:
    """Where one load reads its weights: the weight files the engine named for it (`files`,
    `StageEngine.weight_files`), each from disk, or, in a device worker's turn, from the stage process's copy of
    it in host memory (`copies`, mapped read-only; stagekit/host_copy.py). The runtime builds it and hands it to the
    engine's load; the loaders read through it (`TensorReader(source=...)`, `to_device`).

    Derived copies (stagekit/host_copy.py, "Derived copies"): what a load computes from the files (weights converted
    to their kernel's format), kept by the stage process beside the host copies. A filled one is in `copies` under
    its `derived_key` (`derived`); one the load may fill is in `to_fill` ({key: path of the stage's empty memfd}),
    written once (`fill`); `filled` lists what this load wrote, which the stage keeps once the load succeeded."""

    files: tuple[Path, ...] = ()
    copies: Mapping[Path, MappedCopy] = field(default_factory=lambda: MappingProxyType({}))
    to_fill: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    staging: Staging = field(default_factory=Staging, compare=False, repr=False)
    filled: list[str] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def host_copies(cls, files: Iterable[str | Path], copies: Mapping[str, str], to_fill: Mapping[str, str],
                    prefault: Prefault | None = None) -> "WeightSource":
        """`files`, read from the host copies `copies` ({file or derived key: path of its copy}) where there is one
        (a device worker's load): each mapped now, or the one `prefault` mapped on standby when it is the same copy
        (a prefault of other copies stops)."""
        mapped = map_copies(copies, prefault.mapped if prefault is not None else {})
        if prefault is not None and any(mapped.get(k) is not c for k, c in prefault.mapped.items()):
            prefault.stop.set()
        return cls(tuple(Path(f) for f in files), MappingProxyType(mapped), MappingProxyType(dict(to_fill)))

    def copy_of(self, file: str | Path) -> MappedCopy | None:
        """The mapped host copy of `file` (a file or a derived key), None when the load reads it from disk."""
        return self.copies.get(_copy_name(file)) if self.copies else None

    def has_copy(self, file: str | Path) -> bool:
        """Whether this load reads `file` from a host copy."""
        return self.copy_of(file) is not None

    def to_device(self, t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
        """`t` (e.g. a view of a host copy) on `device`, cast to `dtype` there, through this load's pinned staging
        buffers (stagekit/host_copy.py `Staging.to_device`)."""
        return self.staging.to_device(t, device, dtype)

    def derived(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors of a filled derived copy, as read-only views ({name: tensor}), or None when the stage holds
        none for `key` (the load converts, and fills it when offered: `fill`)."""
        copy = self.copy_of(key)
        return None if copy is None else copy.tensors()

    def fill(self, key: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Write `tensors` (any device) into the derived copy `key` when this load was offered it; returns whether
        it did. The stage process keeps it from then on only after the load succeeded (`filled`), so a worker that
        dies while writing leaves nothing the next turn would read."""
        target = self.to_fill.get(key)
        if target is None:
            return False
        header, offset = {}, 0
        for name, t in tensors.items():
            dtype = next(k for k, v in TORCH_DTYPE.items() if v == t.dtype)
            n = t.numel() * t.element_size()
            header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += -(-n // DERIVED_ALIGN) * DERIVED_ALIGN
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(HEADER_LEN_BYTES + len(blob)) % DERIVED_ALIGN)  # data starts aligned
        start = HEADER_LEN_BYTES + len(blob)
        fd = os.open(target, os.O_RDWR)
        try:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, start + offset)
            with mmap.mmap(fd, start + offset, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[:start] = struct.pack("<Q", len(blob)) + blob
                dst = torch.frombuffer(m, dtype=torch.uint8)
                for name, t in tensors.items():
                    lo, hi = header[name]["data_offsets"]
                    dst[start + lo: start + hi].view(t.dtype).view(t.shape).copy_(t)
                del dst
        finally:
            os.close(fd)
        self.filled.append(key)
        return True


def nonfinite_flag(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-dim bool tensor on `t`'s device, True when `t` holds a NaN or an Inf; None for integer and empty tensors
    (int8 weights cannot hold either; their float scales are checked as tensors of their own).

    One fused reduction, `torch.aminmax` (NaN propagates into both ends, +Inf into the max, -Inf into the min), with
    no temporary the size of the tensor: 5-15x faster than `isfinite(t).all()` on a CPU, and on a GPU queued behind
    the copy that made `t`, without a host sync. fp8 (block scales) has no such kernels: widened chunk by chunk."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    parts = t.reshape(-1).split(FINITE_CHUNK) if t.dtype in FP8 else (t,)
    ends = torch.stack([end for c in parts for end in torch.aminmax(c.float() if c.dtype in FP8 else c)])
    return ~torch.isfinite(ends).all()


def _nonfinite_problem(t: torch.Tensor) -> str:
    v = t.float() if t.dtype in FP8 else t
    n_nan, n_inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
    return (f"holds {n_nan} NaN and {n_inf} Inf value(s) in {t.dtype} {list(t.shape)}: a corrupt or badly converted "
            "checkpoint (replace the file; a weight that is not finite makes every output NaN)")


class FiniteCheck:
    """Checks that loaded weights hold no NaN or Inf, per tensor, as they stream in.

    `add(file, key, tensor)` queues one flag per float tensor on the tensor's device (no host sync: on a GPU the
    check runs on the device right after the copy); `raise_if_bad()` waits once for all of them and raises a
    CheckpointError naming the file and key of the first tensor that is not finite. On the CPU `add` costs the
    check itself and nothing else.
    """

    def __init__(self) -> None:
        self._names: list[tuple[Path | str, str]] = []
        self._flags: list[torch.Tensor] = []
        self._tensors: list[torch.Tensor] = []  # kept only to describe a bad one; the loaders hold them anyway

    def add(self, file: Path | str, key: str, t: torch.Tensor) -> None:
        flag = nonfinite_flag(t)
        if flag is not None:
            self._names.append((file, key))
            self._flags.append(flag)
            self._tensors.append(t)

    def raise_if_bad(self) -> None:
        if not self._flags:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, f in enumerate(self._flags):
            by_device.setdefault(f.device, []).append(i)
        bad = []
        for idx in by_device.values():  # one host sync per device
            flags = torch.stack([self._flags[i] for i in idx])
            if bool(flags.any()):
                bad.append(idx[int(flags.nonzero()[0])])
        names, tensors = self._names, self._tensors
        self._names, self._flags, self._tensors = [], [], []
        if bad:
            first = min(bad)
            file, key = names[first]
            raise CheckpointError(file, _nonfinite_problem(tensors[first]), key)


def check_finite_tensor(file: Path | str, key: str, t: torch.Tensor) -> None:
    """Raise a CheckpointError naming file and key when `t` holds a NaN or an Inf (one tensor, checked now)."""
    flag = nonfinite_flag(t)
    if flag is not None and bool(flag):
        raise CheckpointError(file, _nonfinite_problem(t), key)


class TensorReader:
    """Reads tensors by header entry, one safetensors handle per file; whole tensors or row / column ranges
    (`get_slice`, so a tensor-parallel rank never reads more than its part). Any failure becomes a CheckpointError
    naming file and tensor (a file replaced or truncated after start-up).

    Every float tensor read is checked for NaN / Inf on the CPU as it is read (a CheckpointError naming file and
    key). `check_finite=False` is for a loader that checks the copies on its device instead (`FiniteCheck`).

    A file the load's `source` holds a host copy of gives copies of the copy's bytes, or with `views=True` read-only
    views of them, for a loader that moves every tensor to its device with `source.to_device` (which never writes
    its source). Without a `source` every file is read from disk."""

    def __init__(self, entries: Mapping[str, HeaderEntry], *, source: WeightSource | None = None,
                 check_finite: bool = True, views: bool = False) -> None:
        self._entries = entries
        self._source = source
        self._handles: dict[Path, object] = {}
        self._check_finite = check_finite
        self._views = views

    def _open(self, key: str):
        e = self._entries[key]
        if e.file not in self._handles:
            try:
                self._handles[e.file] = safe_open(str(e.file), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, or OSError
                raise CheckpointError(e.file, f"cannot open: {exc}", key) from exc
        return self._handles[e.file], e.disk_key or key

    def _read_copy(self, copy: MappedCopy, key: str, index) -> torch.Tensor:
        e = self._entries[key]
        t = copy.tensor(e.disk_key or key)
        t = t if index is None else t[index]
        return t if self._views else t.clone(memory_format=torch.contiguous_format)

    def _read(self, key: str, index) -> torch.Tensor:
        e = self._entries[key]
        disk = e.disk_key or key
        copy = self._source.copy_of(e.file) if self._source is not None else None
        try:
            if copy is not None:
                t = self._read_copy(copy, key, index)
            else:
                handle, disk = self._open(key)
                t = handle.get_tensor(disk) if index is None else handle.get_slice(disk)[index]
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(e.file, f"cannot read the tensor (file changed since start-up?): {exc}", key) \
                from exc
        if index is None and (tuple(t.shape) != e.shape or TORCH_DTYPE.get(e.dtype, t.dtype) != t.dtype):
            raise CheckpointError(e.file, f"reads as {t.dtype}{list(t.shape)}, its header said "
                                          f"{e.dtype}{list(e.shape)} (file changed since start-up?)", key)
        if self._check_finite:
            check_finite_tensor(e.file, disk, t)
        return t

    def whole(self, key: str) -> torch.Tensor:
        return self._read(key, None)

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._read(key, slice(lo, hi))

    def cols(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._read(key, (slice(None), slice(lo, hi)))

    def close(self) -> None:
        self._handles.clear()


def check_latent_stats(key: str, stored: torch.Tensor | None, file: Path | str,
                       configured: tuple[float, ...] | None, config_file: Path | str | None,
                       rtol: float = 1e-3) -> tuple[float, ...] | None:
    """A VAE's per-channel latent statistics (`latents_mean` / `latents_std`), as stored in the weights file and / or
    given by its config.json, checked before the stage serves: a std must be > 0 (zero flattens every decode and
    divides by zero in an encode), and a file and a config that both give them must agree (`rtol` allows an fp16
    copy); else a CheckpointError naming both. Returns the values to use (the file's first), or None.
    `stored` was read through a TensorReader, so it is finite."""
    values = None if stored is None else tuple(stored.float().reshape(-1).tolist())
    if configured is not None and not all(math.isfinite(v) for v in configured):
        raise CheckpointError(config_file, "holds a NaN or an Inf", key)
    if values is not None and configured is not None:
        a, b = torch.tensor(values, dtype=torch.float64), torch.tensor(configured, dtype=torch.float64)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=1e-6):
            diff = f"max |diff| {(a - b).abs().max().item():.3g}" if a.shape == b.shape else \
                f"{a.numel()} vs {b.numel()} values"
            raise CheckpointError(file, f"contradicts {key} in {config_file} ({diff}); one of them is wrong: "
                                        "fix it or remove one of the two", key)
    chosen = values if values is not None else configured
    if key.endswith("std") and chosen is not None and not all(v > 0 for v in chosen):
        where = file if values is not None else config_file
        c = next(i for i, v in enumerate(chosen) if not v > 0)
        raise CheckpointError(where, f"channel {c} is {chosen[c]}: a standard deviation must be > 0 (a zero std "
                                     "flattens every decoded latent)", key)
    return chosen
