"""What a user meets in the first hour, through real processes: configured services that do not answer are errors
(exit 1, the address, the fix; never the tiny model), what the client can check is refused before anything starts
(exit 2, the service's own rule), what only the stages know is refused by a local stack's Submit (exit 2), a bad
--models-dir is one line and leaves nothing behind, -o never overwrites, finished jobs say done, status / loadtest
look at one stage alone, help texts are grouped with real defaults, up.sh / down.sh --help, messages in words, and
no traceback into a closed pipe; a --models-dir / --devices that a running stack does not serve is refused, naming
what it serves; Ctrl-C of the first command says at once that it stops the local stack, and stops it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.render_svc_util import RenderService

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--width", "256", "--height", "256", "--frames", "22", "--steps", "1"]
CLEAN_ENV = {k: "" for k in ("H3_RENDER", "H3_ENCODER", "H3_DIT", "H3_DECODER", "H3_MODELS_DIR")}


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(args: list[str], tmp_path: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m client ARGS` with its own TMPDIR (so a stack it started would show) and no endpoints file."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    full_env = {**os.environ, **CLEAN_ENV, "TMPDIR": str(tmp), **(env or {})}
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def no_stack_started(tmp_path: Path) -> bool:
    return not list((tmp_path / "tmpdir").glob("h3-stack-*"))


@pytest.mark.parametrize("how", ["flag", "env", "file", "stages-env"])
def test_a_configured_service_that_does_not_answer_is_an_error(how, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    none = str(tmp_path / "none.env")
    args, env = ["render", "--prompt", "a fox", "-o", str(tmp_path / "x.mp4"), *SMALL], {}
    if how == "flag":
        args += ["--render", dead, "--endpoints-file", none]
    elif how == "env":
        args += ["--endpoints-file", none]
        env = {"H3_RENDER": dead}
    elif how == "file":
        (tmp_path / "endpoints.env").write_text(f"H3_RENDER={dead}\n")
        args += ["--endpoints-file", str(tmp_path / "endpoints.env")]
    else:
        args += ["--endpoints-file", none]
        env = {"H3_ENCODER": dead, "H3_DIT": dead, "H3_DECODER": dead}
    t0 = time.monotonic()
    r = client(args, tmp_path, env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: no answer from") and dead in r.stderr and "scripts/up.sh" in r.stderr, r.stderr
    source = {"flag": "--render", "env": "H3_RENDER", "file": "endpoints.env", "stages-env": "H3_ENCODER"}[how]
    assert f"(from {source}" in r.stderr or source in r.stderr
    assert not (tmp_path / "x.mp4").exists() and no_stack_started(tmp_path) and time.monotonic() - t0 < 30
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--crf", "60"], "error: crf=60 is not valid: use 1..51"),
    (["--crf", "-1"], "error: crf=-1 is not valid"),
    (["--upscale", "1921x1080"], "error: upscale 1921x1080: H.264 yuv420p needs even width and height"),
    (["--upscale", "1000x1000"], "changes the 832x480 render's aspect by 42% (at most 10%)"),
    (["--upscale", "7680x4320"], "is beyond the largest output"),
    (["--upscale", "big"], "error: --upscale 'big': give WIDTHxHEIGHT"),
    (["--width", "100"], "error: width=100 is not valid"),
    (["--detach"], "error: -o: --detach writes no file here (the output stays with the render service)"),
    (["--models-dir", "{tmp}/missing"], "error: --models-dir {tmp}/missing: models dir {tmp}/missing does not exist"),
    (["--models-dir", "{tmp}/empty"], "no Qwen3-VL text encoder for MiniMax-H3 found under {tmp}/empty: looked "
                                      "for *qwen3vl*minimax_h3*.safetensors"),
])
def test_refused_before_anything_starts_with_exit_2(argv, needle, tmp_path):
    """The client's checks run the render service's own rules (minimax_h3.contract) before any stack or call:
    exit 2 in a second or two, one line, nothing left in the temp dir."""
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = client(["render", "--prompt", "a fox", "-o", str(tmp_path / "x.mp4"), *argv, "--endpoints-file",
                str(tmp_path / "none.env")], tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle.replace("{tmp}", str(tmp_path)) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert no_stack_started(tmp_path) and not (tmp_path / "x.mp4").exists()


def test_a_models_dir_with_a_broken_file_is_one_error_and_leaves_nothing(tmp_path):
    """Files of the right names but broken: the stage that reads one first says why in one line, exit 1, and the
    local stack's temp dir is gone."""
    d = tmp_path / "models"
    for name in ("diffusion_models/minimax_h3_x.safetensors", "text_encoders/qwen3vl_32b_minimax_h3_int8.safetensors",
                 "vae/minimax_h3_video_vae_fp16.safetensors", "vae/minimax_h3_audio_vae_fp32.safetensors"):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text("not a safetensors file")
    r = client(["render", "--prompt", "a fox", "-o", str(tmp_path / "x.mp4"), *SMALL, "--models-dir", str(d),
                "--endpoints-file", str(tmp_path / "none.env")], tmp_path, timeout=300)
    assert r.returncode == 1, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "the local stack could not start:" in err[0] and ": cannot start: " in err[0], r.stderr
    assert str(d) in err[0] and "Traceback" not in r.stderr and no_stack_started(tmp_path)


def test_what_only_the_stages_know_is_refused_by_the_local_stacks_submit(tmp_path, model_cache):
    """A LoRA on the embedded stack, whose DiT has no loras directory: the stack starts, its render service refuses
    the request at Submit from the DiT's Status (no job): exit 2, one error line saying where LoRA files go, no
    MP4, the stack's temp dir gone."""
    env = {f"H3_{s}_CACHE_DIR": str(model_cache) for s in ("ENCODER", "DIT", "DECODER")}
    out = tmp_path / "x.mp4"
    r = client(["render", "--prompt", "a fox", "--lora", "film_grain", "-o", str(out), *SMALL, "--endpoints-file",
                str(tmp_path / "none.env")], tmp_path, env, timeout=300)
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert err == ["error: not found: LoRA 'film_grain': the DiT has no loras directory, so it takes no LoRAs by name; "
                   "LoRA files go in <models-dir>/loras (or the DiT's --loras-dir)"], r.stderr
    assert "Traceback" not in r.stderr and not out.exists() and no_stack_started(tmp_path)


def test_the_service_refuses_by_the_same_rule():
    """One copy of the rule: the render service's request check and the decoder's call `check_output`."""
    from render_svc.admission import check_request
    from stagekit.errors import InvalidArgument
    from tests.render_svc_util import tiny_request

    for kw, needle in (({"crf": 60}, "crf=60 is not valid: use 1..51"),
                       ({"upscale": (1000, 300)}, "changes the 256x256 render's aspect")):
        with pytest.raises(InvalidArgument, match=needle.replace(".", r"\.")):
            check_request(tiny_request(**kw))


def test_output_never_overwritten_and_jobs_say_done(stack, tmp_path):
    """-o refuses an existing file (or a folder's 000.mp4) unless --overwrite; `jobs list` / `jobs get` of a finished
    job say done; `jobs get` into a closed pipe exits quietly."""
    _, ep = stack
    svc = RenderService(tmp_path / "render_run", ep)
    target = svc.start()
    try:
        out = tmp_path / "out.mp4"
        out.write_bytes(b"earlier render")
        render = ["render", "--prompt", "a bell", *SMALL, "--render", target, "--endpoints-file", str(tmp_path / "n")]
        r = client([*render, "-o", str(out)], tmp_path)
        assert r.returncode == 2 and f"-o: {out} exists already; pass --overwrite" in r.stderr, r.stderr
        assert out.read_bytes() == b"earlier render"
        (tmp_path / "dir").mkdir()
        (tmp_path / "dir/000.mp4").write_bytes(b"earlier")
        r = client([*render, "-o", str(tmp_path / "dir")], tmp_path)
        assert r.returncode == 2 and "000.mp4 exists already" in r.stderr
        r = client([*render, "-o", str(out), "--overwrite"], tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        assert out.read_bytes()[4:8] == b"ftyp"
        job = r.stderr.split("job ", 1)[1].split()[0]
        jobs = ["--render", target, "--endpoints-file", str(tmp_path / "n")]
        for action in (["list"], ["get", job]):
            r = client(["jobs", *action, *jobs], tmp_path)
            line = next(ln for ln in r.stdout.splitlines() if ln.startswith(job))
            assert " succeeded  done " in line and "running" not in line, line
        r = client(["jobs", "fetch", job, "-o", str(out), *jobs], tmp_path)
        assert r.returncode == 2 and "exists already" in r.stderr
        r = client(["jobs", "get", "nosuchjob", *jobs], tmp_path)
        assert r.returncode == 1 and r.stderr.startswith("error: not found:") and "NOT_FOUND" not in r.stderr
        piped = subprocess.run(f"{sys.executable} -m client jobs list {' '.join(jobs)} --limit 500 | head -c 1",
                               shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60,
                               env={**os.environ, **CLEAN_ENV})
        assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
    finally:
        svc.stop()


def test_status_and_loadtest_on_one_stage_alone(stack, tmp_path):
    """A DiT started alone (the README's torchrun line) is looked at alone: status shows it, loadtest measures it."""
    _, ep = stack
    none = ["--endpoints-file", str(tmp_path / "none.env")]
    r = client(["status", "--dit", ep.dit, *none], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines() if not ln.startswith(" ")] == ["dit"], r.stdout
    r = client(["loadtest", "--stage", "dit", "--requests", "1", "--text-dim", "64", "--dit", ep.dit, "-q", *none],
               tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = client(["loadtest", "--stage", "dit", "--requests", "1", "--dit", ep.dit, *none], tmp_path)
    assert r.returncode == 1 and "needs the encoder stage(s) too" in r.stderr and "--text-dim" in r.stderr
    dead = f"127.0.0.1:{free_port()}"
    r = client(["loadtest", "--stage", "decoder", "--requests", "1", "--decoder", dead, *none], tmp_path)
    assert r.returncode == 1 and f"decoder at {dead} (from --decoder)" in r.stderr and no_stack_started(tmp_path)
    r = client(["status", "--decoder", dead, *none], tmp_path)
    assert r.returncode == 1 and "UNREACHABLE" in r.stdout


def test_help_texts_are_true(tmp_path):
    r = client(["render", "--help"], tmp_path)
    for group in ("what to render:", "size, length and sampling:", "output:", "job:", "local stack",
                  "where the services are:"):
        assert group in r.stdout, group
    text = " ".join(r.stdout.split())
    for needle in ("--crf CRF H.264 quality 1..51, lower is better (default: 18; an image graph's: 1)",
                   "within 10% of the render's aspect",
                   "at most 4096 per side", "aspect at most 4:1", "(default: run/endpoints.env)"):
        assert needle in text, needle
    up = subprocess.run(["bash", "scripts/up.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert up.returncode == 0 and "--dit-ranks 1" in up.stdout and "--dit-ranks 2" not in up.stdout, up.stdout
    down = subprocess.run(["bash", "scripts/down.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert down.returncode == 0 and "down.sh [--run-dir run] [--grace 30]" in down.stdout, down.stdout + down.stderr


def test_a_cuda_device_on_a_cpu_build_of_torch_says_so(tmp_path):
    """The README's GPU up.sh line on a machine whose torch cannot reach a GPU: one line naming the cause and the
    fix, not an AttributeError from inside torch."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this machine's torch is a CUDA build")
    r = subprocess.run([sys.executable, "-m", "dit_svc", "--devices", "cuda:0", "--port", "0", "--lease-dir",
                        str(tmp_path / "leases")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "dit: cannot start: --devices cuda:0, but torch" in r.stderr, r.stderr
    assert "scripts/setup.sh --cuda" in r.stderr and "_cuda_setDevice" not in r.stderr


def stack_processes(tmp: Path) -> dict[int, str]:
    """pid -> command line of the live processes of local stacks started with TMPDIR `tmp` (each inherits
    TMPDIR=<tmp>/h3-stack-*/tmp/<process>)."""
    from tests.procs import alive

    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and alive(int(d.name)):
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if any(e.startswith(f"TMPDIR={tmp}/h3-stack-".encode()) for e in env):
                out[int(d.name)] = cmd
    return out


def test_ctrl_c_of_the_first_command_says_at_once_what_it_stops_and_stops_it(tmp_path, model_cache):
    """Ctrl-C of the README's first command while the DiT runs its job: the line "stopping the local stack (encoder,
    dit, decoder, render) ..." comes first, then the client exits 130 with every process of the stack gone and its
    temp dir removed. The stack's processes take SIGTERM as "cancel the running job" (--cancel-on-term): the stack
    serves this client alone, so no job is left to finish."""
    import json
    import signal
    import threading
    import urllib.request

    from tests.procs import taking_ctrl_c
    from tests.waits import wait_until

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, **CLEAN_ENV, "TMPDIR": str(tmp),
           **{f"H3_{s}_CACHE_DIR": str(model_cache) for s in ("ENCODER", "DIT", "DECODER")}}
    out = tmp_path / "x.mp4"
    p = subprocess.Popen(taking_ctrl_c([sys.executable, "-m", "client", "render", "--prompt",
                                        "a heron waits in the reeds at dawn", "--steps", "200", "-o", str(out),
                                        "--endpoints-file", str(tmp_path / "none.env")]), cwd=ROOT,
                         env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in p.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        web = wait_until(lambda: next((ln.split("web page: ")[1].strip() for ln in lines if "web page: " in ln), None)
                         or p.poll() is not None and "".join(lines), 300, what="the local stack's web page")
        assert web.startswith("http://"), web

        def dit_running() -> bool:
            with urllib.request.urlopen(web + "api/state", timeout=10) as r:
                jobs = json.load(r)["jobs"]
            return any(j["state"] == "JOB_RUNNING" and j["stage"] == "dit" for j in jobs)

        wait_until(dit_running, 300, what="the DiT running the job")
        procs = stack_processes(tmp)
        assert len(procs) >= 4 and all("--cancel-on-term" in c for c in procs.values()), procs
        said = len(lines)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 130, "".join(lines)
        reader.join(timeout=30)
        after = [ln.rstrip("\n") for ln in lines[said:]]
        assert after[0] == "stopping the local stack (encoder, dit, decoder, render) ... (Ctrl-C again kills it)", after
        assert "Traceback" not in "".join(lines), "".join(lines)
        assert not stack_processes(tmp) and no_stack_started(tmp_path) and not out.exists()
    finally:
        p.kill()
        p.wait()


def test_a_local_stack_flag_a_running_stack_does_not_serve_is_refused(stack, tmp_path):
    """With a stack running (a render service as scripts/up.sh's endpoints file names it, or configured stages),
    --models-dir and --devices cannot change what it serves: a folder that does not exist, a folder other than the
    one its stages serve (here: none, the embedded tiny model), given as the flag or as H3_MODELS_DIR, and any
    --devices are refused with exit 2 before a job is queued, naming what the stack serves and how to restart it with
    the flag; no render service is started over configured stages for it."""
    from h3.v1 import render_pb2

    _, ep = stack
    svc = RenderService(tmp_path / "render_run", ep)
    target = svc.start()
    try:
        run_dir = tmp_path / "up"
        run_dir.mkdir()
        (run_dir / "endpoints.env").write_text(f"H3_RENDER={target}\n")
        where = ["--endpoints-file", str(run_dir / "endpoints.env")]
        jobs = len(svc.stub.List(render_pb2.ListRequest(limit=500), timeout=10).jobs)
        out = tmp_path / "x.mp4"
        render = ["render", "--prompt", "a fox", *SMALL, "-o", str(out)]
        folder = tmp_path / "models"
        folder.mkdir()
        restart = f"restart it: scripts/down.sh --run-dir {run_dir}, then scripts/up.sh --run-dir {run_dir}"
        for argv, env, needle in (
                (["--models-dir", str(tmp_path / "missing")], {},
                 f"error: --models-dir {tmp_path}/missing: models dir {tmp_path}/missing does not exist"),
                (["--models-dir", str(folder)], {},
                 f"error: --models-dir {folder}: the stack behind the render service at {target} (from {run_dir}/"
                 f"endpoints.env) serves the embedded tiny model, not {folder}; a running stack keeps the files it "
                 f"was started with. Leave --models-dir out to render with what it serves, or {restart} --models-dir "
                 f"{folder} (with the other flags it was started with)"),
                ([], {"H3_MODELS_DIR": str(folder)}, f"error: --models-dir {folder} (H3_MODELS_DIR): the stack behind"),
                (["--devices", "cuda:1"], {},
                 f"error: --devices cuda:1: the stack behind the render service at {target} (from {run_dir}/"
                 f"endpoints.env) runs on cpu and keeps them: --devices is for a stack started here. Leave --devices "
                 f"out to render on it, or {restart} --devices cuda:1 (with the other flags it was started with)")):
            r = client([*render, *argv, *where], tmp_path, env)
            assert r.returncode == 2, r.stderr
            assert r.stderr.strip() == needle or (needle in r.stderr and len(r.stderr.strip().splitlines()) == 1), \
                r.stderr
        r = client([*render, "--render", target, "--models-dir", str(folder), "--endpoints-file",
                    str(tmp_path / "none.env")], tmp_path)
        assert r.returncode == 2 and f"(from --render) serves the embedded tiny model, not {folder}" in r.stderr
        assert r.stderr.rstrip().endswith(f"or restart its stages with --models-dir {folder}"), r.stderr
        stages = ["--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder, "--endpoints-file",
                  str(tmp_path / "none.env")]
        r = client([*render, *stages, "--models-dir", str(folder)], tmp_path)
        assert r.returncode == 2 and "the stack of the configured stages (from --encoder) serves the embedded tiny " \
                                     "model" in r.stderr, r.stderr
        assert no_stack_started(tmp_path) and not out.exists()
        assert len(svc.stub.List(render_pb2.ListRequest(limit=500), timeout=10).jobs) == jobs
    finally:
        svc.stop()


def test_the_stack_serving_a_folder_takes_it_by_any_path(tmp_path, model_cache):
    """A stage started with --models-dir reports the folder in its Status (absolute, links resolved); the client's
    check takes the same folder named through a link, and refuses another naming what each stage serves."""
    from client.checks import CheckError, check_running_stack
    from client.embedded import EmbeddedStack, StackConfig
    from client.endpoints import served_by
    from dit_svc.engine import embedded_config
    from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
    from minimax_h3.services import Endpoints
    from stagekit.channels import Security
    from tests.render_svc_util import SERVER_ENV

    folder = tmp_path / "models"
    (folder / "diffusion_models").mkdir(parents=True)
    write_tiny_checkpoint(embedded_config(), folder / "diffusion_models/minimax_h3_fl2va_bf16.safetensors", "bf16")
    (tmp_path / "link").symlink_to(folder)
    s = EmbeddedStack(StackConfig(models_dir=str(tmp_path / "link"), cache_dir=str(model_cache), env=SERVER_ENV,
                                  run_dir=str(tmp_path / "run")))
    try:
        s.start_stage("dit")
        port = s.wait_ready("dit")
        served = lambda: served_by(Endpoints(dit=f"127.0.0.1:{port}"), Security())  # noqa: E731
        (name, st), = served()
        assert name == "dit" and st.models_dir == str(folder) and not st.embedded_model, st
        check_running_stack(str(folder), "", "the stack", "--dit", served, "run/endpoints.env")
        check_running_stack(str(tmp_path / "link") + "/", "", "the stack", "--dit", served, "run/endpoints.env")
        other = tmp_path / "other"
        other.mkdir()
        with pytest.raises(CheckError, match=f"the stack \\(from --dit\\) serves {folder}, not {other}"):
            check_running_stack(str(other), "", "the stack", "--dit", served, "run/endpoints.env")
    finally:
        s.stop()
