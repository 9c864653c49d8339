"""Errors by meaning, and the one place that maps them to the gRPC status a caller sees.

Five meanings; raise the class that says which one holds:

1. **The request is wrong** (the caller can fix it): `InvalidArgument`, and for a named thing the service does not
   have or already has under other terms, `NotFound` / `AlreadyExists`. Request validation raises these, never a
   bare `ValueError`. `stagekit.wire.WireError` (a malformed tensor stream) is one.
2. **A file or setting on the server is wrong** (the operator fixes it): `FailedPrecondition`, and its subclasses
   `stagekit.checkpoints.CheckpointError` (a checkpoint) and a model's kernel errors (a kernel setting this
   machine cannot honour). Never the caller's fault.
3. **Overloaded or going away** (retry later or elsewhere): `ResourceExhausted`, `Unavailable`.
4. **Cancelled or out of time**: `Cancelled`, `DeadlineExceeded`.
5. **A server fault**: `Internal` (one the stage detected itself and contained; the caller sees INTERNAL with its
   message), and everything not raised on purpose (a `ValueError` or `AssertionError` of an internal invariant, a
   `RuntimeError` from torch, ...): the caller sees INTERNAL with an error id, and the log has the id with the
   traceback.

Whether a multi-rank stage restarts its rank group after a failed job is said by the class (`restarts_group`): an
error raised on purpose, `Internal` included, leaves the ranks in step; anything else (a foreign out-of-memory
too) leaves their state unknown, so the group restarts and the caller is told to retry (UNAVAILABLE).

A few exceptions that are not ours keep their meaning (`status_for`): safetensors' errors and a missing file are
a wrong file, running out of memory is overload, a `TimeoutError` is out of time.
"""

from __future__ import annotations

import logging
import uuid
from types import MappingProxyType

import grpc

log = logging.getLogger("stagekit.errors")


class StageError(Exception):
    """An error raised on purpose. `code`: the gRPC status a caller sees; `restarts_group`: whether a multi-rank
    stage restarts its rank group after it (only when the ranks' state can no longer be trusted)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    restarts_group: bool = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# 1. The request is wrong.
class InvalidArgument(StageError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StageError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(StageError):
    code = grpc.StatusCode.ALREADY_EXISTS


# 2. A file or setting on the server is wrong.
class FailedPrecondition(StageError):
    code = grpc.StatusCode.FAILED_PRECONDITION


# 3. Overloaded or going away.
class ResourceExhausted(StageError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(StageError):
    code = grpc.StatusCode.UNAVAILABLE


# 4. Cancelled or out of time.
class Cancelled(StageError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(StageError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


# 5. A server fault.
class Internal(StageError):
    """A server fault the stage detected itself and contained where it happened (the ranks are still in step): a
    result it must not pass on (NaN / Inf latents, states, frames), a helper that broke its contract. The message
    names the stage and what broke."""

    code = grpc.StatusCode.INTERNAL


# The class that says what each status means (for a status another service answered with: `error_for`).
_BY_CODE = MappingProxyType({cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition,
                                                       ResourceExhausted, Unavailable, Cancelled, DeadlineExceeded,
                                                       Internal)})


def error_for(code: grpc.StatusCode, message: str) -> StageError:
    """The error class of a status received from another service (a stage's answer, a job's recorded outcome), so
    that a caller catches it by meaning; a status outside the five meanings is a server fault (`Internal`)."""
    return _BY_CODE.get(code, Internal)(message)


def restarts_group(exc: BaseException) -> bool:
    """Whether a multi-rank stage must restart its rank group after `exc` ended a job. An error raised on purpose
    says whether (its class's `restarts_group`); anything else (an unexpected fault, and also a foreign error of
    known meaning such as running out of memory on one rank mid-collective) leaves the ranks' state unknown."""
    return exc.restarts_group if isinstance(exc, StageError) else True


def _known_meaning(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status of an exception that is not ours but whose meaning is known; None for a fault."""
    if type(exc).__name__ == "SafetensorError":  # safetensors' own (not a ValueError): an unreadable checkpoint
        return grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint cannot be read: {exc}"
    if isinstance(exc, FileNotFoundError):
        return grpc.StatusCode.FAILED_PRECONDITION, f"file not found: {exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return None


def error_id(exc: BaseException) -> str:
    """The id of a server fault, the same on every call for one exception; logged with its traceback once."""
    eid = getattr(exc, "h3_error_id", None)
    if eid is None:
        eid = uuid.uuid4().hex[:12]
        try:
            exc.h3_error_id = eid  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__: the id is still logged
            pass
        log.error("server fault, error id %s: %s: %s", eid, type(exc).__name__, exc, exc_info=exc)
    return eid


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a caller should see for `exc` (module docstring: the five meanings)."""
    if isinstance(exc, StageError):
        return exc.code, exc.message
    known = _known_meaning(exc)
    if known is not None:
        return known
    return grpc.StatusCode.INTERNAL, (
        f"internal server error (error id {error_id(exc)}, {type(exc).__name__}); not caused by the request: "
        f"the server's log has the details under that id")
