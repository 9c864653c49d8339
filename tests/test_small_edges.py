"""Small edges a user meets, each through the part they use: `render --upscale 0x0` refused (not dropped as "no
upscale"); `doctor` saying when this machine cannot run the real model (`--strict`: exit 1); the CLI's hints naming
the interpreter that runs it; a failed `models fetch` leaving no empty folder of its own; messages in words a user
can act on (no PyAV errno, no internal method name, no stage-only `--weights` to `render`); `scripts/up.sh` showing
why a stage died at start; the web page's queue positions one line for the whole service; one host RAM figure per
setup in the README, the docs and `doctor`."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_first_hour import client, free_port, no_stack_started
from tests.test_models_cli import run
from tests.test_scripts import started_by

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"PATH": "/usr/bin:/bin", "H3_ENCODER": "", "H3_DIT": "", "H3_DECODER": "", "H3_RENDER": "",
         **{f"H3_{n}_PORT": "0" for n in ("ENCODER", "DIT", "DECODER", "RENDER", "RENDER_HTTP")}}


def _render(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return client(["render", "--prompt", "a fox", "-o", str(tmp_path / "x.mp4"), *argv, "--endpoints-file",
                   str(tmp_path / "none.env")], tmp_path)


# ---- --upscale ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size,needle", [
    ("0x0", "error: --upscale 0x0: the MP4's width and height must both be above 0"),
    ("0x480", "error: --upscale 0x480: the MP4's width and height must both be above 0"),
    ("", "error: --upscale '': give WIDTHxHEIGHT"),
])
def test_upscale_without_a_size_is_refused_not_ignored(size, needle, tmp_path):
    # a render service that is not there: a size the client let through fails there (exit 1), not here (exit 2)
    r = _render(tmp_path, "--upscale", size, "--render", f"127.0.0.1:{free_port()}")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert no_stack_started(tmp_path) and not (tmp_path / "x.mp4").exists()


def test_upscale_left_out_keeps_the_render_size():
    from client.__main__ import main, parse_size
    from minimax_h3.contract import RenderSpec, check_output

    assert parse_size("1920x1080") == (1920, 1080)
    check_output(RenderSpec(prompt="x"), 0, 0, 0)  # no --upscale: (0, 0) on the wire, allowed
    with pytest.raises(SystemExit):
        main(["render", "--help"])  # the parser builds with --upscale optional


# ---- doctor ------------------------------------------------------------------------------------------------------


def test_doctor_says_when_the_real_model_cannot_run_and_strict_exits_1(tmp_path):
    if shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        pytest.skip("a real nvidia-smi is on /usr/bin")
    none = ["--endpoints-file", str(tmp_path / "none.env")]
    r = run(["doctor", *none], QUIET)
    assert r.returncode == 0, r.stdout + r.stderr  # the embedded tiny model runs here
    assert "real model  CANNOT RUN HERE: no GPU with 21+ GiB" in r.stdout, r.stdout
    r = run(["doctor", "--strict", *none], QUIET)
    assert r.returncode == 1 and "real model  CANNOT RUN HERE" in r.stdout, r.stdout


def test_real_model_blockers_count_vram_and_host_ram():
    from client.machine import GPU, HOST_RAM_GB, real_model_blockers

    ti = GPU(0, "NVIDIA GeForce RTX 2080 Ti", "570.86.15", 22528, 7.5)
    assert real_model_blockers([ti], 31.2) == []  # a 32 GB desktop: MemTotal about 31 GiB
    low = real_model_blockers([ti], 15.5)
    assert len(low) == 1 and "15.5 GiB of host RAM" in low[0] and f"needs {HOST_RAM_GB['one-22gb']} GB" in low[0]
    two = real_model_blockers([ti, GPU(1, ti.name, ti.driver, ti.memory_mib, 7.5)], 31.2)
    assert len(two) == 1 and f"two 22 GB cards needs {HOST_RAM_GB['two-22gb']} GB" in two[0]
    small = real_model_blockers([GPU(0, "GTX 1080", "535.1", 8192, 6.1)], 128.0)
    assert len(small) == 1 and "the largest has 8.0 GiB" in small[0]
    assert real_model_blockers([], 128.0) and real_model_blockers([], 128.0)[0].startswith("no GPU with 21+ GiB")


# ---- hints name the interpreter ----------------------------------------------------------------------------------


def test_self_command_is_the_interpreter_running_the_client(tmp_path, monkeypatch):
    from client.command import self_command

    exe = tmp_path / ".venv" / "bin" / "python"
    monkeypatch.setattr(sys, "executable", str(exe))
    monkeypatch.chdir(tmp_path)
    assert self_command() == ".venv/bin/python -m client"  # from the checkout: what the README types
    monkeypatch.chdir(tmp_path / "..")
    assert self_command() == f"{tmp_path.name}/.venv/bin/python -m client"
    monkeypatch.setattr(sys, "executable", "/opt/py/bin/python3")
    assert self_command() == "/opt/py/bin/python3 -m client"  # outside the working directory: the full path


def test_cli_hints_name_the_interpreter_that_runs_them(tmp_path, monkeypatch):
    from client.command import self_command

    monkeypatch.chdir(ROOT)
    here = self_command()  # the clients below run from the checkout with this interpreter

    def bare(text: str) -> bool:  # a hint that says `python -m client` without the interpreter
        return "python -m client" in text.replace(here, "")

    r = run(["models", "check", str(tmp_path / "nowhere")])
    assert r.returncode == 1 and f"{here} models fetch --to {tmp_path / 'nowhere'}" in r.stderr, r.stderr
    r = run(["doctor", "--models-dir", str(tmp_path), "--endpoints-file", str(tmp_path / "none.env")], QUIET)
    assert f"{here} models fetch --to {tmp_path}" in r.stdout and not bare(r.stdout), r.stdout
    # a part it lacks: named with what up.sh and render pass on to the stage, not the stage's own flag
    assert "env H3_ENCODER_WEIGHTS=FILE" in r.stdout and "--weights" not in r.stdout, r.stdout
    (tmp_path / "empty").mkdir()
    r = _render(tmp_path, "--models-dir", str(tmp_path / "empty"))
    assert r.returncode == 2 and f"({here} models check DIR" in r.stderr and not bare(r.stderr), r.stderr
    r = run(["--help"])
    assert r.stdout.startswith(f"usage: {here} ") and not bare(r.stdout), r.stdout


# ---- models fetch --to -------------------------------------------------------------------------------------------


def test_a_failed_fetch_removes_only_the_empty_folders_it_made(tmp_path):
    dead = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    r = run(["models", "fetch", "--to", str(tmp_path / "new" / "models")], dead)
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:9" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists(), list(tmp_path.rglob("*"))
    mine = tmp_path / "mine"  # the user's own (empty) folder stays
    mine.mkdir()
    r = run(["models", "fetch", "--to", str(mine)], dead)
    assert r.returncode == 1 and mine.is_dir()


# ---- messages in the user's words ----------------------------------------------------------------------------------


def test_refused_media_files_are_said_without_pyav_errno_or_python_objects():
    from h3.v1 import common_pb2
    from minimax_h3.media import load_reference
    from render_svc.admission import describe_reference
    from stagekit.errors import InvalidArgument

    for call, kind in ((lambda: load_reference(b"not a video at all" * 20, "video", 22), "video"),
                       (lambda: describe_reference(common_pb2.Reference(kind="video", data=b"x" * 400), 0, 22), "video"),
                       (lambda: load_reference(b"\x89PNG not really", "image", 22), "image")):
        with pytest.raises(InvalidArgument) as e:
            call()
        msg = e.value.message
        assert "[Errno" not in msg and "<none>" not in msg and "BytesIO" not in msg and " at 0x" not in msg, msg
        assert ("FFmpeg cannot read it (invalid data found when processing input)" if kind == "video" else
                "it is not an image Pillow reads: send a PNG, JPEG or WebP file") in msg, msg


def test_a_ref_file_ffmpeg_cannot_read_is_said_without_errno(tmp_path):
    bad = tmp_path / "clip.mp4"
    bad.write_bytes(b"not a video" * 50)
    r = _render(tmp_path, "--ref", str(bad), "--frames", "22")
    assert r.returncode == 2 and "[Errno" not in r.stderr and "PyAV" not in r.stderr, r.stderr
    assert f"--ref {bad}: the video reference cannot be used: FFmpeg cannot read it" in r.stderr, r.stderr


def test_audio_only_references_at_the_encoder_are_said_in_the_rules_words():
    from minimax_h3.text.conditioner import Conditioner
    from stagekit.errors import InvalidArgument

    encoder = SimpleNamespace(_ensure_visual=lambda: None, tokenizer=object())  # a presentation with no vision item
    with pytest.raises(InvalidArgument) as e:
        Conditioner.vision_inputs(encoder, [1, 2, 3], [])
    assert e.value.message == "audio references need at least one image or video reference beside them"


def test_render_names_what_it_takes_not_the_stages_weights_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _render(tmp_path, "--models-dir", str(tmp_path / "empty"))
    assert r.returncode == 2 and "--weights" not in r.stderr, r.stderr
    assert "pass the file explicitly with env H3_ENCODER_WEIGHTS=FILE" in r.stderr, r.stderr
    two = tmp_path / "two"  # two DiT candidates: name the one to serve
    for name in ("diffusion_models/minimax_h3_a.safetensors", "diffusion_models/minimax_h3_b.safetensors"):
        (two / name).parent.mkdir(parents=True, exist_ok=True)
        (two / name).write_bytes(b"")
    from client.checks import find_for_client
    from stagekit.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition) as e:
        find_for_client(two, "dit")
    assert "name the one to serve with env H3_DIT_WEIGHTS=FILE" in e.value.message and "--weights" not in \
        e.value.message


# ---- scripts/up.sh -----------------------------------------------------------------------------------------------


def test_up_shows_why_a_stage_died_at_start(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    up = ["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--models-dir", str(tmp_path / "nowhere"),
          "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0", "--render-port", "0", "--web-port", "0"]
    try:
        r = subprocess.run(up, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"encoder died while starting; the last 1 lines of {run_dir / 'encoder.log'}:" in r.stderr, r.stderr
        assert f"  encoder: cannot start: models dir {tmp_path / 'nowhere'} does not exist" in r.stderr, r.stderr
    finally:
        subprocess.run(["bash", "scripts/down.sh", "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
    assert not started_by(run_dir)


# ---- the web page's queue ----------------------------------------------------------------------------------------


def test_queued_jobs_have_one_line_of_positions_on_the_web_page(stack, tmp_path):
    """A job blocks in the encoder (the device lease held); behind it a prompt-only job waits for the encoder and a
    keyframe job for the keyframes stage: each first of its own stage queue, but first and second in the service's one line."""
    from PIL import Image

    from h3.v1 import render_pb2
    from tests.render_svc_util import TERMINAL, RenderService, holding_the_device, tiny_request, wait_for

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 80, 40)).save(buf, "PNG")
    s, endpoints = stack
    svc = RenderService(tmp_path / "run", endpoints, ["--http-port", "0"])
    svc.start()
    try:
        url = f"http://127.0.0.1:{int((tmp_path / 'run' / 'render.port.http').read_text())}/api/state"
        with holding_the_device(s.lease_dir):
            first = svc.stub.Submit(tiny_request("in the encoder"), timeout=30).job_id
            wait_for(lambda: svc.stub.Get(render_pb2.JobRef(job_id=first), timeout=10).state == render_pb2.JOB_RUNNING,
                     60, "the first job in the encoder", svc.log)
            plain = svc.stub.Submit(tiny_request("behind it"), timeout=30).job_id
            keyed = svc.stub.Submit(tiny_request("from a keyframe", first_frame=buf.getvalue()), timeout=30).job_id
            with urllib.request.urlopen(url, timeout=30) as resp:
                jobs = json.loads(resp.read())["jobs"]
            shown = {j["job_id"]: (j["state"], j["queue_position"]) for j in jobs}
            assert shown == {first: ("JOB_RUNNING", 0), plain: ("JOB_QUEUED", 1), keyed: ("JOB_QUEUED", 2)}, shown
            assert [svc.stub.Get(render_pb2.JobRef(job_id=i), timeout=10).queue_position
                    for i in (first, plain, keyed)] == [0, 1, 2]
            for i in (plain, keyed):
                svc.stub.Cancel(render_pb2.JobRef(job_id=i), timeout=30)
        assert svc.wait_state(first, TERMINAL, 120).state == render_pb2.JOB_SUCCEEDED
    finally:
        svc.stop()


# ---- one host RAM figure per setup ---------------------------------------------------------------------------------


def test_host_ram_is_one_figure_per_setup_everywhere():
    from client.machine import HOST_RAM_GB, SETUP_NAMES

    readme = (ROOT / "README.md").read_text()
    header = next(ln for ln in readme.splitlines() if ln.startswith("| setup |"))
    col = [c.strip() for c in header.strip("|").split("|")].index("host RAM")
    for key, gb in HOST_RAM_GB.items():
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| {SETUP_NAMES[key]} |"))
        assert [c.strip() for c in row.strip("|").split("|")][col] == f"{gb} GB", (key, row)
    one_card = (ROOT / "docs/one_card.md").read_text()
    assert f"{HOST_RAM_GB['one-22gb']} GB of RAM" in one_card
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):  # no other figure stated anywhere
        for m in re.finditer(r"(\d+) GB of (?:host )?RAM", path.read_text()):
            assert int(m.group(1)) in HOST_RAM_GB.values(), (path.name, m.group(0))
    doctor = (ROOT / "client/doctor.py").read_text()
    assert not re.search(r"\d+ GB", doctor), "doctor states the figures from client.machine.HOST_RAM_GB"
