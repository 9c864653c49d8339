"""Spawned children of a stage process: the pipe between them (`Channel`) and a function run once in a short-lived
child (`run_in_child`), so the stage process itself never initialises CUDA. The device worker
(stagekit/device_worker.py) and the CUDA facts (stagekit/cuda.py) build on it."""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
from collections.abc import Callable
from typing import Any

import grpc

from stagekit import errors
from stagekit.errors import StageError, Unavailable
from stagekit.procs import die_with_parent, exit_text


def spawn_context():
    return mp.get_context("spawn")


class Channel:
    """One end of a stage process <-> child pipe carrying messages by value (plain pickle): tensors are copied
    through the pipe, never shared by file descriptor, so nothing but the pipe ties the two processes together (no
    descriptor-passing helper, no shared segment to leak)."""

    def __init__(self, conn):
        self.conn = conn

    def send(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _call_in_child(conn, fn: Callable, args: tuple, log_level: str) -> None:
    conn = Channel(conn)
    die_with_parent("a start-up probe")
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - handed to the parent
        conn.send(("error", portable(e)))
    conn.close()


def run_in_child(fn: Callable, *args: Any, timeout_s: float = 600.0) -> Any:
    """`fn(*args)` in a short-lived spawned child; returns its result or raises its exception. For device work done
    once at start-up (the DiT's kernel probe, the GPUs' ids), so the stage process itself never holds a context.
    `fn` and its arguments and result must pickle."""
    pipe, theirs = spawn_context().Pipe()
    ours = Channel(pipe)
    proc = spawn_context().Process(target=_call_in_child, args=(theirs, fn, args, logging.getLogger().getEffectiveLevel()),
                              name=f"probe-{fn.__name__}")
    proc.start()
    theirs.close()
    try:
        if not ours.poll(timeout_s):
            raise Unavailable(f"{fn.__name__} in a child process gave no answer within {timeout_s:.0f} s")
        kind, value = ours.recv()
    except EOFError:
        proc.join()
        raise Unavailable(f"{fn.__name__} in a child process died ({exit_text(proc.exitcode)}) before answering") from None
    finally:
        ours.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if kind == "error":
        raise value
    return value


def portable(e: BaseException) -> BaseException:
    """`e`, or the nearest exception that survives pickling with the same gRPC status and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - e.g. an exception whose __init__ takes other arguments than its args
        pass
    if isinstance(e, StageError):
        base = next(c for c in type(e).__mro__ if c.__module__ == errors.__name__)
        return base(e.message)
    code, msg = errors.status_for(e)
    # A foreign error of known meaning keeps it; a fault stays one (not raised on purpose: the group restarts).
    return RuntimeError(msg) if code == grpc.StatusCode.INTERNAL else errors.error_for(code, msg)
