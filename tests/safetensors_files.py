"""Test helpers that write safetensors files byte by byte: full-size inventories as sparse files (holes, no data),
and header edits of real files (the corrupt-file cases)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from stagekit.checkpoints import DTYPE_BYTES, HEADER_LEN_BYTES


def write_sparse_safetensors(path: str | Path, specs: dict[str, tuple], metadata: dict | None = None) -> Path:
    """A real safetensors file whose tensors are holes: `specs` name -> (dtype, shape[, payload bytes or None]);
    only payloads are written, so a 10 GB inventory costs a header."""
    header, offset = {}, 0
    for name, (dtype, shape, *_rest) in specs.items():
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = HEADER_LEN_BYTES + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (_d, _s, *rest) in specs.items():
            if rest and rest[0] is not None:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(rest[0])
        f.truncate(start + offset)
    return Path(path)


def read_raw_header(path: str | Path) -> tuple[dict, bytes]:
    """(header JSON, data bytes) of a safetensors file."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:HEADER_LEN_BYTES])
    return json.loads(data[HEADER_LEN_BYTES:HEADER_LEN_BYTES + n]), data[HEADER_LEN_BYTES + n:]


def write_raw(path: str | Path, header: dict, body: bytes) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return Path(path)


def edit_header(src: str | Path, dst: str | Path, edit) -> Path:
    """Copy `src` to `dst` with `edit(header)` applied to its JSON header, the data bytes untouched."""
    header, body = read_raw_header(src)
    edit(header)
    return write_raw(dst, header, body)


def rewrite_tensors(src: str | Path, dst: str | Path, edit) -> Path:
    """Copy a safetensors file with `edit(tensors)` applied to its tensors (a dict, changed in place), the metadata
    kept: how the tests make a file whose header is fine and whose data is not (a NaN, a zero std, a bad filter)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata=metadata)
    return Path(dst)
