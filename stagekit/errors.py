"""Errors a stage raises on purpose, each bound to the gRPC status a caller sees.

A plain `ValueError` from request validation is the caller's fault (INVALID_ARGUMENT). Server-side
problems use a class here, never a bare ValueError: a bad checkpoint raises
`stagekit.checkpoints.CheckpointError` (a FailedPrecondition), so a client is never told that a broken
file on the server was its mistake.
"""

from __future__ import annotations

import grpc


class StageError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Internal(StageError):
    """A server fault the stage detected itself: a result it must not pass on (NaN / Inf latents, states, frames)."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(StageError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(StageError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(StageError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Cancelled(StageError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(StageError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(StageError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(StageError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(StageError):
    code = grpc.StatusCode.ALREADY_EXISTS


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a caller should see for `exc`."""
    if isinstance(exc, StageError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):  # includes stagekit.wire.WireError
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if type(exc).__name__ == "SafetensorError":  # safetensors' own (not a ValueError): an unreadable checkpoint
        return grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint cannot be read: {exc}"
    if isinstance(exc, FileNotFoundError):
        return grpc.StatusCode.FAILED_PRECONDITION, f"file not found: {exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
