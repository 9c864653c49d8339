"""A status code in the words a user reads (the code names stay in logs and metrics)."""

from __future__ import annotations

import grpc

STATUS_WORDS = {
    "INVALID_ARGUMENT": "refused", "FAILED_PRECONDITION": "the service cannot run this",
    "RESOURCE_EXHAUSTED": "the service is busy or out of memory", "UNAVAILABLE": "the service does not answer",
    "DEADLINE_EXCEEDED": "timed out", "CANCELLED": "cancelled", "NOT_FOUND": "not found",
    "ALREADY_EXISTS": "already exists", "UNAUTHENTICATED": "not signed in (give --token or H3_TOKEN)",
    "PERMISSION_DENIED": "not allowed", "INTERNAL": "the service failed", "UNKNOWN": "the service failed",
    "UNIMPLEMENTED": "the service does not offer this (another version?)", "ABORTED": "aborted",
    "OUT_OF_RANGE": "out of range", "DATA_LOSS": "data lost",
}


def status_words(code_name: str) -> str:
    return STATUS_WORDS.get(code_name, code_name.lower().replace("_", " "))


def rpc_words(e: grpc.RpcError) -> str:
    """'refused: frames=100 is not valid ...' for a failed call."""
    return f"{status_words(e.code().name)}: {e.details()}"


def job_error_words(info) -> str:
    """A failed job's error (JobInfo.error_code is a status code name) in words."""
    return f"{status_words(info.error_code)}: {info.error}"
