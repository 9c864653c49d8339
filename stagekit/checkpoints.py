"""Safetensors checkpoints, common to every stage: the header reader and the error a bad file raises.

Only the JSON header is read (never tensor data), and the file is checked to be long enough for every tensor the
header declares, so a truncated download fails at start-up with the file and tensor named.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from stagekit.errors import FailedPrecondition

HEADER_LEN_BYTES = 8  # safetensors: little-endian u64 header length, then JSON header, then data
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(FailedPrecondition, ValueError):
    """The checkpoint on disk cannot be used with this config (corrupt, wrong variant, missing/extra/misshapen keys)."""


@dataclass(frozen=True)
class HeaderEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "I8"
    disk_key: str = ""  # name inside the file when it differs from the dict key (prefix stripped)


def read_header(file: Path) -> dict[str, HeaderEntry]:
    """Parse one safetensors header and check that the file is long enough for every tensor it declares."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw_len = fh.read(HEADER_LEN_BYTES)
            if len(raw_len) != HEADER_LEN_BYTES:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(MAX_HEADER_BYTES, size - HEADER_LEN_BYTES):
                raise CheckpointError(f"{file}: corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    data_bytes = size - HEADER_LEN_BYTES - n
    entries = {}
    for key, info in header.items():
        try:
            start, end = info["data_offsets"]
            entries[key] = HeaderEntry(file, tuple(int(d) for d in info["shape"]), str(info["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt header entry for {key!r}: {e}") from e
        if end > data_bytes:
            raise CheckpointError(
                f"{file}: truncated: tensor {key!r} ends at byte {end} of the data section, "
                f"which has only {data_bytes} bytes"
            )
    return entries
