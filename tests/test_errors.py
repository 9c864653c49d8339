"""Errors by meaning (stagekit/errors.py): each class maps to one gRPC status; anything not raised on purpose is
INTERNAL with an error id that the log carries with its traceback; the class, not the exception type, decides
whether a multi-rank stage restarts its rank group; request validation raises the request-error class."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from stagekit.checkpoints import CheckpointError
from stagekit.dist import RankInfo
from stagekit.errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument,
                             NotFound, ResourceExhausted, Unavailable, restarts_group, status_for)
from stagekit.lease import DeviceLease, LeaseConfig
from stagekit.runtime import Job, RuntimeConfig, StageRuntime
import stagekit.runtime
from stagekit.servicer import job_status
from stagekit.wire import WireError

MEANINGS = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, False),
    (NotFound, grpc.StatusCode.NOT_FOUND, False),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, False),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, False),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, False),
    (Cancelled, grpc.StatusCode.CANCELLED, False),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, False),
    (Internal, grpc.StatusCode.INTERNAL, False),
]


@pytest.mark.parametrize("cls,code,restarts", MEANINGS)
def test_each_class_has_one_status_and_says_whether_the_group_restarts(cls, code, restarts, caplog):
    got_code, msg = status_for(cls("what went wrong, and what to do"))
    assert got_code == code and restarts_group(cls("x")) is restarts
    assert msg == "what went wrong, and what to do"  # raised on purpose: its message is for the caller


def test_a_malformed_stream_and_a_bad_file_keep_their_meaning():
    assert status_for(WireError("tensor 'x': checksum mismatch")) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                      "tensor 'x': checksum mismatch")
    code, msg = status_for(CheckpointError("/models/dit.safetensors", "truncated"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "/models/dit.safetensors" in msg
    assert not restarts_group(WireError("x")) and not restarts_group(CheckpointError("f", "p"))


@pytest.mark.parametrize("exc", [ValueError("shapes disagree: [3, 4] vs [4, 3]"), AssertionError("rank order"),
                                 RuntimeError("CUDA error: an illegal memory access"), KeyError("blocks.0.qkv")])
def test_anything_unexpected_is_internal_with_an_id_in_the_log(exc, caplog):
    """An internal ValueError is no longer the caller's fault: INTERNAL, an id in the message, and the same id
    with the traceback in the log (once, however often the status is asked for)."""
    try:
        raise exc
    except Exception as e:  # noqa: BLE001 - the traceback is what the log must carry
        raised = e
    with caplog.at_level(logging.ERROR, logger="stagekit.errors"):
        code, msg = status_for(raised)
        assert status_for(raised) == (code, msg)
    assert code == grpc.StatusCode.INTERNAL and "not caused by the request" in msg
    eid = msg.split("error id ")[1].split(",")[0]
    assert len(eid) == 12
    records = [r for r in caplog.records if eid in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    assert str(exc).strip("'") in records[0].getMessage()
    assert restarts_group(raised)


def test_foreign_errors_of_known_meaning():
    assert status_for(FileNotFoundError("/models/x"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(torch.OutOfMemoryError("CUDA out of memory"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(TimeoutError("collective"))[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_request_validation_raises_the_request_error():
    """The geometry, sampler, keyframe and output-name checks a request reaches say the request is wrong."""
    from minimax_h3.contract import check_upscale
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.contract import video_latent_frames
    from minimax_h3.dit.layout import latent_shape
    from minimax_h3.dit.sampling import SamplerConfig
    from minimax_h3.files import safe_name

    cases = [
        lambda: video_latent_frames(100),
        lambda: latent_shape(DiTConfig.tiny(), 124, 480, 830),
        lambda: SamplerConfig(sampler="heun").validate(),
        lambda: safe_name("../etc/passwd", "out.mp4"),
        lambda: check_upscale(832, 480, 1921, 1080),
    ]
    for case in cases:
        with pytest.raises(InvalidArgument) as e:
            case()
        assert status_for(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


class _LeaderOfTwo:
    """Rank 0 of a two-rank group whose follower lives elsewhere: commands go nowhere, flags are local."""

    info = RankInfo(0, 2, 0)
    world_size = 2

    def broadcast_command(self, command=None):
        return command

    def any_flag(self, local: bool) -> bool:
        return local


class _Raises:
    name = "faulty"

    def __init__(self, exc: BaseException):
        self.exc = exc

    def load(self):
        pass

    def unload(self):
        pass

    def resident_bytes(self):
        return 0

    def estimate_peak_bytes(self, spec, inputs):
        return 0

    def run(self, spec, inputs, ctx):
        raise self.exc


@pytest.mark.parametrize("exc,restarts,code", [
    (InvalidArgument("frames must be of the form 17*n + 5"), False, grpc.StatusCode.INVALID_ARGUMENT),
    (Cancelled("cancelled by the client"), False, grpc.StatusCode.CANCELLED),
    (CheckpointError("dit.safetensors", "truncated"), False, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError("internal invariant broken"), True, grpc.StatusCode.UNAVAILABLE),
    (Internal("decoder: the resizer gave 123 frames for 124"), False, grpc.StatusCode.INTERNAL),
])
def test_the_error_class_decides_whether_a_rank_group_restarts(tmp_path, monkeypatch, exc, restarts, code):
    """On a multi-rank stage a job that fails with an error raised on purpose (a contained Internal included)
    leaves the group serving; an unexpected error restarts it (health NOT_SERVING, then the process exits for torchrun), and the caller is told to retry."""
    exits = threading.Event()
    monkeypatch.setattr(stagekit.runtime, "_hard_exit", exits.set)
    health: list[bool] = []
    rt = StageRuntime(_Raises(exc), _LeaderOfTwo(), DeviceLease(["virt0"], LeaseConfig(tmp_path, "t")),
                      RuntimeConfig(idle_unload_s=-1), on_health=health.append)
    try:
        job = rt.submit(Job(spec="s", inputs={}))
        ev = job.events.get(timeout=60)
        while ev.kind == "progress":
            ev = job.events.get(timeout=60)
        assert ev.kind == "error" and ev.payload is exc
        assert job_status(rt, ev.payload)[0] == code
        assert exits.wait(5) is restarts
        if not restarts:
            time.sleep(0.6)  # past the exit timer a restart would have armed
            assert not exits.is_set() and health[-1] is True
    finally:
        rt.shutdown(False, 2)
