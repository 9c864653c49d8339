"""Reference files are refused before anything starts, and a job whose client stopped is fetched with the command
that client printed (real processes):

- what the stages would refuse of a reference (a mix of audio clips alone, a picture over the pixel cap, a cut-off
  PNG, a WAV that is none, audio with NaN samples, a clip too short to encode, a fourth audio clip) the client refuses
  before it starts anything (exit 2, one line naming the --ref, no local stack), and the render service at Submit
  (INVALID_ARGUMENT naming the reference, no job stored);
- the decoder stage refuses audio with NaN samples as the caller's INVALID_ARGUMENT naming the reference (not an
  INTERNAL fault);
- Ctrl-C on `render` prints `jobs fetch ID --wait -o OUT`, which waits for the running job and writes its MP4 (a
  plain `jobs fetch` is refused while the job runs).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from client.render_client import render_request
from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import RenderSpec
from tests.procs import taking_ctrl_c
from tests.render_svc_util import RenderService, holding_the_device, probe, wait_for
from tests.test_first_hour import CLEAN_ENV, ROOT, SMALL, client, no_stack_started
from tests.test_references import media_mp4, media_png, media_wav

FRAMES = 22


def png_of(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of any size: a few KB on disk whatever its pixel count (a 10000x10000 one is 12 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def float_wav(seconds: float = 0.5, rate: int = 32000, nan: bool = False) -> bytes:
    """A 32-bit float WAV, with a NaN among its samples when `nan` (a file a broken script can write)."""
    import soundfile

    wave = np.full((int(seconds * rate), 1), 0.1, dtype=np.float32)
    if nan:
        wave[rate // 10] = np.nan
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


# (files in --ref order, prompt, what the refusal says): each one a file or mix the stages would refuse later.
BAD = {
    "audio alone": ({"voice.wav": media_wav(0.3)}, "<Audio 1> hums",
                    "audio references need at least one image or video reference beside them"),
    "too many pixels": ({"big.png": png_of(10000, 10000)}, "<Picture 1> waves",
                        "--ref {tmp}/big.png: the image reference cannot be used: 10000x10000 is more than 16777216 "
                        "pixels (4096x4096): scale it down first"),
    "cut-off png": ({"cut.png": media_png()[:600]}, "<Picture 1> waves",
                    "--ref {tmp}/cut.png: the image reference cannot be used: image file is truncated"),
    "not a wav": ({"a.png": media_png(), "bad.wav": b"RIFF\x00\x00\x00\x00WAVEjunk" * 64},
                  "<Picture 1> talks like <Audio 1>",
                  "--ref {tmp}/bad.wav: the audio reference cannot be used: FFmpeg cannot read it (invalid data found when "
                  "processing input)"),
    "nan audio": ({"a.png": media_png(), "nan.wav": float_wav(nan=True)}, "<Picture 1> talks like <Audio 1>",
                  "--ref {tmp}/nan.wav: the audio reference cannot be used: its audio holds NaN or infinite samples"),
    "clip too short": ({"short.mp4": media_mp4(n=12, fps=30)}, "a dog walks like <Video 1>",
                       "--ref {tmp}/short.mp4: the video reference cannot be used: it lasts 0.4"),
    "four voices": ({"a.png": media_png(), **{f"v{i}.wav": media_wav(0.3, 32000 + i) for i in range(4)}},
                    "<Picture 1> sings with <Audio 1>, <Audio 2>, <Audio 3> and <Audio 4>",
                    "MiniMax-H3 takes at most 3 audio references, got 4"),
}


def _ref_args(tmp_path, files: dict[str, bytes]) -> list[str]:
    refs = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        refs += ["--ref", str(tmp_path / name)]
    return refs


@pytest.mark.parametrize("case", sorted(BAD))
def test_reference_files_refused_before_anything_starts(case, tmp_path, capsys, monkeypatch):
    """No endpoints configured: a render would start a local stack (~10 s) whose stages refuse the file after the
    job was queued; the client refuses it first, exit 2 in one line naming the --ref, and starts nothing."""
    from client.__main__ import main as client_main
    from client.embedded import EmbeddedStack

    for s in ("RENDER", "ENCODER", "DIT", "DECODER"):
        monkeypatch.delenv(f"H3_{s}", raising=False)
    monkeypatch.setattr(EmbeddedStack, "start", lambda self: pytest.fail("a stack was started"))
    files, prompt, needle = BAD[case]
    assert client_main(["render", "--prompt", prompt, *_ref_args(tmp_path, files), "-o", str(tmp_path / "x.mp4"),
                        *SMALL, "--endpoints-file", str(tmp_path / "none.env")]) == 2
    err = capsys.readouterr().err
    assert needle.replace("{tmp}", str(tmp_path)) in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and not (tmp_path / "x.mp4").exists()


def test_the_command_refuses_them_in_a_second_starting_nothing(tmp_path):
    """The same as a user runs it (its own process, its own temp dir): exit 2, one line, no stack's temp dir."""
    files, prompt, needle = BAD["audio alone"]
    r = client(["render", "--prompt", prompt, *_ref_args(tmp_path, files), "-o", str(tmp_path / "x.mp4"), *SMALL,
                "--endpoints-file", str(tmp_path / "none.env")], tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {needle}: add the picture or clip the voice or sound " \
        "belongs to, and name both in the prompt", r.stderr
    assert no_stack_started(tmp_path) and not (tmp_path / "x.mp4").exists()


def test_the_checks_run_without_torch_or_numpy(tmp_path):
    """The thin client checks an image, a clip with its soundtrack and a float voice file without importing torch or
    numpy (the checks read pixels and samples through Pillow and PyAV alone)."""
    files = {"a.png": media_png(), "walk.mp4": media_mp4(n=30, fps=30), "voice.wav": float_wav()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    refs = [(kind, str(tmp_path / name)) for kind, name in (("image", "a.png"), ("video", "walk.mp4"),
                                                              ("audio", "voice.wav"))]
    code = ("import json, sys\n"
            "from minimax_h3.reference_files import check_reference_file\n"
            f"found = [check_reference_file(k, open(p, 'rb').read(), {FRAMES}) for k, p in {refs!r}]\n"
            "print(json.dumps({'sound': [f.sound for f in found], "
            "'heavy': sorted(m for m in ('torch', 'numpy') if m in sys.modules)}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"sound": [False, True, False], "heavy": []}


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    """A render service of its own over the session's stages."""
    s = RenderService(tmp_path_factory.mktemp("render_refchecks"), stack[1])
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("case", ["audio alone", "too many pixels", "cut-off png", "nan audio", "four voices"])
def test_submit_refuses_them_before_a_job_is_stored(svc, case):
    """A caller of the render service's API (no CLI in front) meets the same rules at Submit: INVALID_ARGUMENT
    naming the reference by position and file name, and no job."""
    files, prompt, needle = BAD[case]
    refs = [common_pb2.Reference(kind="image" if n.endswith(".png") else "audio", data=d, name=n)
            for n, d in files.items()]
    req = render_request(RenderSpec(prompt=prompt, width=256, height=256, frames=FRAMES, steps=1), references=refs)
    before = len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=10).jobs)
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    said = needle.split(": ", 1)[1] if needle.startswith("--ref") else needle
    assert said in e.value.details(), e.value.details()
    if needle.startswith("--ref"):
        name = needle.split(": ", 1)[0].rsplit("/", 1)[1]
        index = list(files).index(name) + 1
        assert e.value.details().startswith(f"reference {index} ({name}): "), e.value.details()
    assert len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=10).jobs) == before


def test_nan_audio_is_the_callers_invalid_argument_at_the_decoder(clients):
    """The decoder stage's EncodeReference, called directly: a WAV holding NaN is INVALID_ARGUMENT naming the file,
    not an INTERNAL fault of the stage; the same stage then encodes a clean voice."""
    from render_svc.stage_calls import encode_reference

    with pytest.raises(grpc.RpcError) as e:
        encode_reference(clients, common_pb2.Reference(kind="audio", data=float_wav(nan=True), name="nan.wav"), FRAMES)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith("the audio reference nan.wav cannot be used: its audio holds NaN or "
                                        "infinite samples"), e.value.details()
    latents, _ = encode_reference(clients, common_pb2.Reference(kind="audio", data=media_wav(0.5), name="ok.wav"),
                                  FRAMES)
    assert latents["audio"].shape[:2] == (2, 32)


def test_ctrl_c_prints_a_fetch_that_waits_for_the_running_job(stack, svc, tmp_path):
    """The stages' device held, so the job stays in its first stage: Ctrl-C on `render` says how to get the MP4;
    a plain `jobs fetch` is refused while the job runs, the printed command waits for it, and writes the MP4 once the
    device is let go."""
    s, _ = stack
    out = tmp_path / "later.mp4"
    env = {**os.environ, **CLEAN_ENV}
    with holding_the_device(s.lease_dir):
        render = subprocess.Popen(taking_ctrl_c([sys.executable, "-m", "client", "render", "--render", svc.target,
                                                 "--prompt", "a gong, long decay", *SMALL, "-o", str(out)]), cwd=ROOT,
                                  env={**env, "PYTHONFAULTHANDLER": "1"}, text=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(render.stderr), daemon=True)
        reader.start()
        queued = wait_for(lambda: next((ln for ln in list(lines) if " queued" in ln), None), 120, "the job queued",
                          lambda: "".join(lines))
        job_id = queued.split()[1]
        render.send_signal(signal.SIGINT)
        try:
            assert render.wait(timeout=60) == 130
        except subprocess.TimeoutExpired:  # say where it hangs: PYTHONFAULTHANDLER dumps every thread on SIGABRT
            render.send_signal(signal.SIGABRT)
            render.wait(timeout=30)
            reader.join(timeout=10)
            raise AssertionError("render did not exit within 60 s of Ctrl-C; its threads:\n" + "".join(lines))
        reader.join(timeout=10)
        said = "".join(lines)
        hints = [ln.strip() for ln in lines if ln.startswith("  ") and " jobs fetch " in ln]
        assert len(hints) == 1, said
        assert f" jobs fetch {job_id} --wait -o {out} --render {svc.target}" in hints[0], said
        assert hints[0] in queued, "the line at queueing names the same command"
        assert "Traceback" not in said, said
        info = svc.stub.Get(render_pb2.JobRef(job_id=job_id), timeout=10)
        assert info.state in (render_pb2.JOB_QUEUED, render_pb2.JOB_RUNNING), info

        plain = subprocess.run([sys.executable, "-m", "client", "jobs", "fetch", job_id, "-o", str(out), "--render",
                                svc.target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert plain.returncode == 1 and "there is no MP4 to fetch yet" in plain.stderr, plain.stderr

        fetch = subprocess.Popen(shlex.split(hints[0]), cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):
            fetch.wait(timeout=3)  # waiting for the job, which waits for the device
        assert not out.exists()
    stdout, stderr = fetch.communicate(timeout=180)
    assert fetch.returncode == 0, stderr
    assert stdout.strip() == f"wrote {out}" and probe(out) == {"width": 256, "height": 256, "frames": FRAMES,
                                                               "audio": 1}
