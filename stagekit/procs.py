"""Processes: whether one is alive; one that dies with its parent; stopping a process group: a polite signal, a grace
period, then SIGKILL (stdlib only: the thin client uses it).

Stages, torchrun agents and benchmark items are started with `start_new_session=True`, so their process group
holds everything they started (ranks, workers); signalling the group, not the pid, leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("stagekit.procs")

PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def exit_text(code: int | None) -> str:
    """A process's end in words, from its exit code (`Popen.returncode`, `Process.exitcode`: negative for a signal)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def die_with_parent(what: str = "this process", parent: int = 0) -> None:
    """The kernel SIGKILLs this process when the thread that started it exits (Linux prctl PR_SET_PDEATHSIG), so a
    `kill -9` of a torchrun agent, a stage process or a supervisor leaves no rank, worker or launcher behind
    (docs/reliability.md, "Orphan ranks"). Exits at once when the parent (`parent`, when the caller knows its pid;
    else the parent now) is already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = parent or os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): %s may outlive its parent", ctypes.get_errno(), what)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(70)


def stop_group(proc: subprocess.Popen, grace_s: float, first: int = signal.SIGTERM,
               kill_wait_s: float | None = None) -> int | None:
    """Send `first` to `proc`'s process group (only while `proc` still runs) and wait up to `grace_s`; then SIGKILL
    whatever is left in the group (a launcher that exited may leave ranks in it) and wait up to `kill_wait_s` (None:
    until it exits). Returns `proc`'s exit code, None if it is still running."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        return None
