"""Whether a file on disk is still the one a stage read (docs/residency.md, "Host copies").

A file's size and mtime do not tell it from its replacement: `cp -p`, `rsync -a`, `tar x` and `touch -r` put new
bytes of the same size under the old mtime, and a file system with coarse timestamps gives two writes the same one.
`FileIdentity` adds what no user can set back: the device and inode (a file written elsewhere and renamed over the
path is another inode) and the ctime, which the kernel sets to its clock on every write, rename and `utime` and which
no system call sets. What remains is a rewrite in place inside the same timestamp tick as the read before it, on a
file system with coarse ctimes (since Linux 6.13 ext4, xfs, btrfs and tmpfs give a write after a `stat` a ctime of
its own).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DELETED = "deleted"
REPLACED = "replaced"


@dataclass(frozen=True)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def identity(path: Path | str) -> FileIdentity | None:
    """The identity of the file at `path` now; None when there is none (deleted, or its directory is unreadable)."""
    try:
        return FileIdentity.of(os.stat(path))
    except OSError:
        return None


def identify(files: list[Path | str]) -> dict[str, FileIdentity]:
    """{resolved path: identity} of each of `files` that exists now (a missing one is left out)."""
    ids = {str(p): identity(p) for p in (Path(f).resolve() for f in files)}
    return {f: i for f, i in ids.items() if i is not None}


def changes(read: Mapping[str, FileIdentity]) -> dict[str, str]:
    """{path: what happened} for each file of `read` ({path: its identity when it was read}) that is gone from its
    path (DELETED), is no longer the file that was read (REPLACED) or cannot be looked at now ("unreadable: ...")."""
    out = {}
    for path, was in read.items():
        try:
            now = FileIdentity.of(os.stat(path))
        except (FileNotFoundError, NotADirectoryError):
            out[path] = DELETED
            continue
        except OSError as e:
            out[path] = f"unreadable: {e.strerror}"
            continue
        if now != was:
            out[path] = REPLACED
    return out
