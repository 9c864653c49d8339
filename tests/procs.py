"""Process helpers for tests that kill, stop and inspect real stage processes (from /proc; no psutil)."""

from __future__ import annotations

import sys
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (from /proc; no psutil needed)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers under `root` (RANK from each worker's environment)."""
    out = {}
    for pid in descendants(root):
        try:
            env = dict(kv.split("=", 1) for kv in (Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
                                                 .split("\0")) if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            out[int(env["RANK"])] = pid
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def mem_kib(pid: int, field: str = "VmRSS") -> int:
    """A /proc/<pid>/status memory figure in KiB (VmRSS now, VmHWM peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def open_paths(pid: int) -> list[str]:
    """Where the process's open file descriptors point ("... (deleted)" for unlinked files)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.append(str(fd.readlink()))
        except OSError:
            continue
    return out


def big_mappings(pid: int, min_kib: int) -> list[tuple[int, int]]:
    """(size, resident) in KiB of each memory mapping of `pid` of at least `min_kib` (from /proc/<pid>/smaps). A large
    allocation is a mapping of its own, so its resident part is how much of the buffer has been written."""
    out, size = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("Rss:") and size is not None:
            if size >= min_kib:
                out.append((size, int(line.split()[1])))
            size = None
    return out


def taking_ctrl_c(argv: list[str]) -> list[str]:
    """argv for a child a test sends SIGINT: the child takes it as a user's Ctrl-C whatever this process inherited
    (a suite started in the background by a shell without job control runs with SIGINT ignored, and a child would
    inherit that, never seeing the Ctrl-C). A fresh interpreter sets SIGINT's default action and execs argv (same
    pid). Not a `preexec_fn`: Python run between fork and exec in this process, whose gRPC threads and fork handlers
    are live, can leave the child hung before it execs."""
    return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execvp(sys.argv[1], sys.argv[1:])", *argv]
