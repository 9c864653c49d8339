"""Errors by meaning (stagekit/errors.py): each class maps to one gRPC status; anything not raised on purpose is
INTERNAL with an error id that the log carries with its traceback; the class, not the exception type, decides
whether a multi-rank stage restarts its rank group; request validation raises the request-error class."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
import torch

from stagekit.checkpoints import CheckpointError
from stagekit.dist import RankInfo
from stagekit.engine import StageEngine
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


class _Raises(StageEngine):
    name = "faulty"

    def __init__(self, exc: BaseException):
        self.exc = exc

    def load(self, source):
        pass

    def unload(self):
        pass

    def resident_bytes(self):
        return 0

    def estimate_peak_bytes(self, spec, inputs):
        return 0

    def run(self, spec, inputs, ctx):
        raise self.exc


def _outcome(job: Job):
    ev = job.events.get(timeout=60)
    while ev.kind == "progress":
        ev = job.events.get(timeout=60)
    return ev


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
        ev = _outcome(job)
        assert ev.kind == "error" and ev.payload is exc
        assert job_status(rt, ev.payload)[0] == code
        if restarts:
            assert exits.wait(30) and health[-1] is False
        else:
            # A restart is armed (health NOT_SERVING, then the exit timer) by the worker right after it delivers the
            # outcome, before it takes the next job: once a second job's outcome is in, the first one's restart
            # would be armed. Health saw the one load and nothing after it.
            assert _outcome(rt.submit(Job(spec="s", inputs={}))).payload is exc
            assert health == [False, True] and not exits.is_set()
    finally:
        rt.shutdown(False, 2)


# ---- every error class of the project says its meaning ---------------------------------------------------------------
PRODUCT = ("stagekit", "client", "render_svc", "dit_svc", "encoder_svc", "decoder_svc", "minimax_h3", "benchmarks",
           "scripts")


def _error_classes() -> list[tuple[str, str]]:
    """(module, class) of every exception class defined in the product's code, found from the source: a class whose
    base is a built-in exception or (transitively) another such class of the project."""
    import ast
    import builtins
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    defined: dict[str, tuple[str, list[str]]] = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))]
                    defined[node.name] = (module, bases)
    errors = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    grown = True
    while grown:
        new = {name for name, (_, bases) in defined.items() if name not in errors and set(bases) & errors}
        errors |= new
        grown = bool(new)
    return sorted((module, name) for name, (module, _) in defined.items() if name in errors)


def test_every_error_class_of_the_project_derives_from_one_meaning():
    """An error class outside the five meanings (a bare ValueError / RuntimeError subclass) would be a server fault
    when raised on purpose, or the caller's when caught as a ValueError: each one derives from stagekit.errors."""
    import importlib

    from stagekit.errors import StageError

    found = _error_classes()
    assert len(found) >= 20 and ("minimax_h3.dit.lora", "LoRAFileError") in found
    loose = [f"{m}.{n}" for m, n in found if not issubclass(getattr(importlib.import_module(m), n), StageError)]
    assert not loose, f"error classes outside stagekit.errors' meanings: {loose}"


@pytest.mark.parametrize("cls,code,restarts", [
    ("minimax_h3.dit.lora:LoRAFileError", grpc.StatusCode.FAILED_PRECONDITION, False),
    ("minimax_h3.kernels.int8:QuantFormatError", grpc.StatusCode.FAILED_PRECONDITION, False),
    ("minimax_h3.dit.tp:TPConfigError", grpc.StatusCode.FAILED_PRECONDITION, False),
    ("minimax_h3.kernels.registry:Fp8Unavailable", grpc.StatusCode.FAILED_PRECONDITION, False),
    ("stagekit.device_worker:WorkerLost", grpc.StatusCode.UNAVAILABLE, True),
])
def test_the_models_and_the_workers_errors_say_who_fixes_them(cls, code, restarts):
    import importlib

    module, name = cls.split(":")
    err = getattr(importlib.import_module(module), name)("what went wrong")
    assert status_for(err) == (code, "what went wrong") and restarts_group(err) is restarts


def test_a_status_from_another_service_becomes_the_class_of_its_meaning():
    from stagekit.errors import error_for

    for cls, code, _ in MEANINGS:
        err = error_for(code, "m")
        assert type(err) is cls and status_for(err) == (code, "m")
    assert type(error_for(grpc.StatusCode.UNKNOWN, "m")) is Internal  # outside the five meanings: a server fault


# ---- deliberate checks raise their meaning; a fault inside them is never the caller's --------------------------------
def _bug(*args, **kwargs):
    raise ValueError("an internal invariant broke")


def test_a_fault_while_loading_a_reference_is_internal_not_the_files(monkeypatch):
    """load_reference's checks say what is wrong with the file (INVALID_ARGUMENT), and so do the decoders when they
    refuse it; a fault of the loader itself (here a resize that breaks) is INTERNAL with an error id."""
    import minimax_h3.media as media
    from tests.test_references import media_png

    with pytest.raises(InvalidArgument, match="the image reference cannot be used: it is not an image Pillow reads"):
        media.load_reference(b"\x89PNG not really", "image", 22)
    with pytest.raises(InvalidArgument, match="within 1:4 and 4:1"):
        media.load_reference(media_png(500, 100), "image", 22, media.EMBEDDED_REFERENCE_SIZES)
    monkeypatch.setattr(media, "_lanczos", _bug)
    with pytest.raises(ValueError, match="internal invariant") as e:
        media.load_reference(media_png(), "image", 22, media.EMBEDDED_REFERENCE_SIZES)
    assert not isinstance(e.value, InvalidArgument) and status_for(e.value)[0] == grpc.StatusCode.INTERNAL


def test_a_fault_while_describing_a_reference_is_internal_not_the_files(monkeypatch):
    """The render service's look at a reference at submit: a file the decoders refuse is the caller's, a fault of
    the service's own code is not."""
    from PIL import Image

    from h3.v1 import common_pb2
    from render_svc.admission import describe_reference
    from tests.test_references import media_png, media_wav

    with pytest.raises(InvalidArgument, match=r"reference 1 \(voice.wav\): the video reference cannot be used: it "
                                              "has no video stream"):
        describe_reference(common_pb2.Reference(kind="video", data=media_wav(0.2), name="voice.wav"), 0, 22)
    monkeypatch.setattr(Image.Image, "convert", _bug)
    with pytest.raises(ValueError, match="internal invariant") as e:
        describe_reference(common_pb2.Reference(kind="image", data=media_png(), name="a.png"), 0, 22)
    assert not isinstance(e.value, InvalidArgument)


def test_the_encoders_reference_checks_are_the_requests_and_its_faults_internal(tmp_path, monkeypatch):
    """A video reference too short for the vision tower's frame pairs is the request's fault (INVALID_ARGUMENT, not
    FAILED_PRECONDITION); a fault while presenting references is INTERNAL, not the operator's."""
    from types import SimpleNamespace

    import numpy as np

    import encoder_svc.engine as enc
    from minimax_h3.media import ReferenceMedia
    from stagekit.dist import RankGroup, RankInfo

    engine = enc.EncoderEngine(enc.EncoderEngineConfig("", "", tmp_path, "cpu", torch.float32),
                               RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    engine.model = SimpleNamespace(tokenizer=engine.tokenizer, temporal_patch=2)  # the presentation is not reached
    ctx = SimpleNamespace(progress=lambda *a, **k: None)
    short = ReferenceMedia("video", frames=np.zeros((10, 32, 32, 3), dtype=np.uint8))  # one frame at 2 fps
    with pytest.raises(InvalidArgument, match="needs at least 13 frames") as e:
        engine.run(enc.EncodeJob("", (1, 2)), {"references": [short]}, ctx)
    assert status_for(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    monkeypatch.setattr(enc, "reference_parts", _bug)
    with pytest.raises(ValueError, match="internal invariant") as e:
        engine.run(enc.EncodeJob("", (1, 2)), {"references": [short]}, ctx)
    assert status_for(e.value)[0] == grpc.StatusCode.INTERNAL


def test_a_comfy_quant_descriptor_of_the_wrong_types_is_the_files_fault():
    from minimax_h3.kernels.int8 import QuantFormatError, parse_comfy_quant

    for doc in ('{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": "sixteen"}',
                '{"format": "int8_tensorwise", "params": ["convrot"]}'):
        with pytest.raises(QuantFormatError) as e:
            parse_comfy_quant(doc)
        assert status_for(e.value)[0] == grpc.StatusCode.FAILED_PRECONDITION


# ---- start-up -------------------------------------------------------------------------------------------------------
def test_startup_errors_say_a_deliberate_refusal_in_a_line_and_keep_a_faults_traceback():
    from stagekit.server import startup_errors

    with pytest.raises(SystemExit, match="^dit: cannot start: no DiT checkpoint under /models$"):
        with startup_errors("dit"):
            raise FailedPrecondition("no DiT checkpoint under /models")
    with pytest.raises(ValueError, match="internal invariant"):  # a bug: its traceback, not a tidy line
        with startup_errors("dit"):
            _bug()


def test_render_service_without_stage_endpoints_says_so_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "render_svc", "--port", "0", "--run-dir", str(tmp_path / "run"),
                        "--encoder", "127.0.0.1:1"], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert last == "render: cannot start: give the stage endpoints --dit --decoder (scripts/up.sh passes them)", last
