"""From a machine to the model files, as a new user meets it, through real processes: `scripts/setup.sh --plan`
picking the torch build with a stand-in `nvidia-smi` on PATH, `client models fetch` from a stand-in Hub on loopback
(HF_ENDPOINT; an interrupted download resumed, a bad checksum, too little disk), `client models check` on a folder of
release-shaped files (full-size inventories written sparse), on broken folders and on the tiny test model under the
release's file names, and `client doctor`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.models_cli import wanted_files
from tests.hub_server import FakeHub, HubFile
from tests.procs import taking_ctrl_c
from tests.safetensors_files import write_release_video_vae

ROOT = Path(__file__).resolve().parents[1]
PART = "diffusion_models/.minimax_h3_fl2va_pruned_int8_convrot.safetensors.part"


def run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def fake_nvidia_smi(bin_dir: Path, lines: list[str], rc: int = 0) -> dict:
    """A stand-in `nvidia-smi` first on PATH that prints `lines` for the query client/machine.py makes."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + "".join(f"echo '{x}'\n" for x in lines) + f"exit {rc}\n")
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


# ---- 1. setup.sh: the torch build that fits the machine ---------------------------------------------------------


@pytest.mark.parametrize("gpus,flag,want", [
    ([], "", ["torch build: cpu (no nvidia-smi on PATH", "plan: pip install --no-deps nvidia-cudnn-frontend"]),
    (["0, NVIDIA H200, 580.65.06, 143771, 9.0"], "", ["torch build: cu130 (driver 580.65.06",
                                                       "--index-url https://download.pytorch.org/whl/cu130",
                                                       "nvidia-cudnn-frontend"]),
    (["0, NVIDIA GeForce RTX 2080 Ti, 570.86.15, 22528, 7.5", "1, NVIDIA GeForce RTX 2080 Ti, 570.86.15, 22528, 7.5"],
     "", ["torch build: cu128 (driver 570.86.15", "whl/cu128", "fp8 attention needs compute capability 9.0+"]),
    (["0, Tesla P40, 535.183.01, 24576, 6.1"], "", ["torch build: cu126", "whl/cu126"]),
    (["0, Tesla T4, 470.82.01, 15360, 7.5"], "", ["torch build: cpu (driver 470.82.01 is older", "update the NVIDIA"]),
    (["0, NVIDIA H200, 580.65.06, 143771, 9.0"], "--cpu", ["torch build: cpu (--cpu given)"]),
])
def test_setup_plan_picks_the_torch_build(gpus, flag, want, tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", gpus) if gpus else {"PATH": "/usr/bin:/bin"}
    if not gpus and shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("a real nvidia-smi is on /usr/bin")
    r = subprocess.run(["bash", "scripts/setup.sh", "--plan", *([flag] if flag else [])], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    for needle in want:
        assert needle in r.stdout, (needle, r.stdout)
    if "build: cpu" in want[0]:
        # the CPU wheels from PyTorch's CPU index, never PyPI's torch (the CUDA build and its nvidia wheels); torch
        # alone from there, one try with a short timeout, so an index out of reach costs seconds
        assert ("plan: pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu --no-deps "
                "--retries 1 --timeout 20\n") in r.stdout, r.stdout
        assert "torch from https://download.pytorch.org/whl/cpu, PyTorch's CPU wheel index: PyPI's torch is the CUDA " \
               "build" in r.stdout, r.stdout
    else:
        assert "plan: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu1" in r.stdout
        assert "+cpu" not in r.stdout and "--no-deps --retries" not in r.stdout and "CPU wheel index" not in r.stdout
    if "fp8 attention needs" in r.stdout:
        assert "cudnn-frontend" not in r.stdout


def test_setup_cuda_without_a_gpu_fails_and_says_why(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", ["NVIDIA-SMI has failed because it couldn't communicate with the "
                                             "NVIDIA driver"], rc=9)
    r = subprocess.run(["bash", "scripts/setup.sh", "--plan", "--cuda"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env, "PYTHON": sys.executable})
    assert r.returncode == 1 and "--cuda given but nvidia-smi failed" in r.stderr, r.stderr
    assert subprocess.run(["bash", "scripts/setup.sh", "--help"], cwd=ROOT, capture_output=True).returncode == 0


# ---- 2. models fetch from a stand-in Hub ------------------------------------------------------------------------


def hub_files(big: int = 24 << 20, **dit) -> dict[str, HubFile]:
    files = {f"{f.repo}/{f.path}": HubFile(os.urandom(1000 + i)) for i, f in enumerate(wanted_files("fl2va-pruned",
                                                                                                      "int8"))}
    key = next(k for k in files if "/diffusion_models/" in k)
    files[key] = HubFile(os.urandom(big), **dit)
    return files


def test_fetch_resumes_an_interrupted_download_and_checks_every_file(tmp_path):
    # The DiT file stalls half-way through its first GET (after more than huggingface_hub's 10 MiB write chunk):
    # the user presses Ctrl-C, runs the same command again, and only the rest is fetched.
    files = hub_files(stall_after=12 << 20)
    to = tmp_path / "models"
    with FakeHub(files) as hub:
        # The stall lasts until the Ctrl-C: huggingface_hub's read timeout (10 s by default) would otherwise give up on
        # it and resume while this test, on a loaded machine, still waits to see the first 10 MiB.
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "600"}
        p = subprocess.Popen(taking_ctrl_c([sys.executable, "-m", "client", "models", "fetch", "--to", str(to)]),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not ((to / PART).is_file() and (to / PART).stat().st_size >= 10 << 20):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        have = (to / PART).stat().st_size
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130 and "run the same command again to resume" in err, err
        assert not (to / "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors").exists()
        for f in files.values():
            f.release.set()

        r = run(["models", "fetch", "--to", str(to)], {"HF_ENDPOINT": hub.url})
        assert r.returncode == 0, r.stderr
        assert f"resuming diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors" in r.stderr
        dit_gets = [rng for key, rng in hub.gets if "/diffusion_models/" in key]
        assert dit_gets == ["", f"bytes={have}-"], dit_gets  # the second run asked only for the rest
        for f in wanted_files("fl2va-pruned", "int8"):
            assert (to / f.local).read_bytes() == files[f"{f.repo}/{f.path}"].data, f.local
        assert not list(to.rglob("*.part"))

        n_gets = len(hub.gets)  # a third run: everything verified, nothing fetched
        r = run(["models", "fetch", "--to", str(to)], {"HF_ENDPOINT": hub.url})
        assert r.returncode == 0 and r.stderr.count("sha256 ok") == 5 and len(hub.gets) == n_gets, r.stderr


def test_fetch_refuses_a_wrong_checksum_and_too_little_disk(tmp_path):
    files = hub_files(big=2000, sha256="ab" * 32)
    with FakeHub(files) as hub:
        r = run(["models", "fetch", "--to", str(tmp_path / "m")], {"HF_ENDPOINT": hub.url})
        assert r.returncode == 1 and "is not the Hub's " + "ab" * 32 in r.stderr and "run the same command again" \
            in r.stderr, r.stderr
        assert not list((tmp_path / "m").rglob("*.part")) and not list((tmp_path / "m").rglob("*convrot.safetensors"))
    files = hub_files(big=2000, size=1 << 60)  # a file larger than any disk: refused before any byte is fetched
    with FakeHub(files) as hub:
        r = run(["models", "fetch", "--to", str(tmp_path / "m2")], {"HF_ENDPOINT": hub.url})
        assert r.returncode == 1 and "free; the download needs" in r.stderr and hub.gets == [], r.stderr
    with FakeHub(hub_files(big=2000)) as hub:  # a variant the repository does not have
        r = run(["models", "fetch", "--to", str(tmp_path / "m3"), "--text-encoder", "bf16"], {"HF_ENDPOINT": hub.url})
        assert r.returncode == 1 and "qwen3vl_32b_minimax_h3_bf16.safetensors is not on" in r.stderr, r.stderr
    r = run(["models", "fetch", "--to", str(tmp_path / "m4")], {"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


# ---- 2. models check --------------------------------------------------------------------------------------------


def write_text_encoder(d: Path) -> None:
    """The release text encoder's full-size bf16 inventory (sparse) and a tokenizer.json, under text_encoders/."""
    from minimax_h3.text.checkpoint import expected_shapes
    from minimax_h3.text.conditioner import ConditionerConfig
    from minimax_h3.text.tiny import build_tiny_tokenizer
    from tests.safetensors_files import write_sparse_safetensors

    (d / "text_encoders").mkdir(parents=True, exist_ok=True)
    specs = {f"model.{k}": ("BF16", s) for k, s in expected_shapes(ConditionerConfig.full()).items()}
    write_sparse_safetensors(d / "text_encoders/qwen3vl_32b_minimax_h3_bf16.safetensors", specs)
    build_tiny_tokenizer().save(str(d / "text_encoders/tokenizer.json"))


def write_release_dit(path: Path) -> Path:
    """The release's pruned int8_convrot DiT as a full-size sparse inventory, its comfy_quant descriptors and
    rope.inv_freq filled in (what start-up reads), no metadata (as the ComfyUI repack)."""
    from minimax_h3.dit.checkpoint import _default_inv_freq
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import _int8_plan, linear_groupsize
    from minimax_h3.kernels.int8 import encode_comfy_quant
    from tests.safetensors_files import write_sparse_safetensors

    full = DiTConfig.full()
    filled = {"rope.inv_freq": _default_inv_freq(full).numpy().tobytes()}
    quant = encode_comfy_quant(linear_groupsize(full)).numpy().tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_sparse_safetensors(path, {k: (dtype, shape, quant if k.endswith(".comfy_quant") else filled.get(k))
                                           for k, shape, dtype in _int8_plan(full, pruned=True)})


def write_models_folder(d: Path) -> Path:
    """A folder the stages accept that is the release model by its shapes: every file a full-size inventory written
    sparse (headers and holes), with the few tensors read at start-up filled in (the DiT's comfy_quant descriptors
    and rope.inv_freq, the audio VAE's latent statistics). Nothing states a config: the release geometry is read."""
    import torch

    from minimax_h3.vae.audio import AudioVAE, AudioVAEConfig
    from minimax_h3.vae.video import VideoVAE, VideoVAEConfig
    from tests.safetensors_files import write_sparse_safetensors

    (d / "vae").mkdir(parents=True, exist_ok=True)
    write_release_dit(d / "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors")
    with torch.device("meta"):
        video = {k: ("F16", tuple(v.shape)) for k, v in VideoVAE(VideoVAEConfig.full()).state_dict().items()}
        audio = {k: ("F32", tuple(v.shape)) for k, v in AudioVAE(AudioVAEConfig.full()).state_dict().items()
                 if not k.endswith((".filter", "zero_k_bias"))}  # rebuilt from their definitions when absent
    write_sparse_safetensors(d / "vae/minimax_h3_video_vae_fp16.safetensors", video)
    stats = {"latents_mean": torch.zeros(32), "latents_std": torch.ones(32)}
    audio.update({k: ("F32", (32,), v.numpy().tobytes()) for k, v in stats.items()})
    write_sparse_safetensors(d / "vae/minimax_h3_audio_vae_fp32.safetensors", audio)
    write_text_encoder(d)
    return d


def write_tiny_models_folder(d: Path) -> Path:
    """The embedded tiny DiT and VAEs (their configs in the metadata) under the release's file names, beside the
    release text encoder: what a user who copied the test model's files gets."""
    from dit_svc.engine import embedded_config
    from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
    from minimax_h3.vae.audio import AudioVAEConfig, write_tiny_audio_vae
    from minimax_h3.vae.video import VideoVAEConfig, write_tiny_video_vae

    for sub in ("diffusion_models", "vae"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    write_tiny_checkpoint(embedded_config(), d / "diffusion_models/minimax_h3_fl2va_bf16.safetensors", "bf16")
    write_tiny_video_vae(str(d / "vae/minimax_h3_video_vae_fp16.safetensors"), VideoVAEConfig.tiny())
    write_tiny_audio_vae(d / "vae/minimax_h3_audio_vae_fp32.safetensors", AudioVAEConfig.tiny(decoder_dim=128))
    write_text_encoder(d)
    return d


def test_models_check_good_and_broken_folders(tmp_path, monkeypatch):
    d = write_models_folder(tmp_path / "models")
    env = fake_nvidia_smi(tmp_path / "bin", ["0, NVIDIA GeForce RTX 2080 Ti, 570.86.15, 22528, 7.5"])
    r = run(["models", "check", str(d)], env)
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("dit      dit        ok", "int8_convrot_pruned, fl2va", "encoder  encoder    ok", "bf16",
                   "decoder  video_vae  ok", "decoder  audio_vae  ok", "geometry from the H3 release geometry",
                   "all 4 parts read correctly and are the release's", "(one 22 GB card)",
                   "H3_DIT_LINEAR_KERNEL=int8 H3_DIT_DTYPE=float16 H3_ENCODER_MODE=compact H3_ENCODER_DTYPE=float16 "
                   f"H3_DECODER_DTYPE=float16 scripts/up.sh --models-dir {d} --devices cuda:0 --gpu-memory-cap-gb 22 "
                   "--residency exclusive"):
        assert needle in r.stdout, (needle, r.stdout)

    # broken: the audio VAE gone, the video VAE truncated, the tokenizer missing
    (d / "vae/minimax_h3_audio_vae_fp32.safetensors").unlink()
    v = d / "vae/minimax_h3_video_vae_fp16.safetensors"
    with open(v, "r+b") as f:
        f.truncate(v.stat().st_size // 2)
    (d / "text_encoders/tokenizer.json").unlink()
    r = run(["models", "check", str(d)], env)
    assert r.returncode == 1, r.stdout
    lines = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.split()[:1] in (["dit"], ["encoder"], ["decoder"])}
    assert " ok " in lines["dit"]
    assert "BAD" in lines["encoder"] and "no tokenizer.json beside" in lines["encoder"]
    assert "BAD" in lines["video_vae"] and "minimax_h3_video_vae_fp16.safetensors" in lines["video_vae"]
    assert "MISSING" in lines["audio_vae"] and "looked for *minimax_h3*audio*vae*.safetensors" in lines["audio_vae"]
    assert "3 of 4 parts missing or wrong" in r.stdout and "Traceback" not in r.stderr
    r = run(["models", "check", str(tmp_path / "nowhere")])
    assert r.returncode == 1 and "is not a folder" in r.stderr and "models fetch --to" in r.stderr


def test_models_check_tells_a_tiny_model_under_release_names_from_the_release(tmp_path):
    """The embedded tiny DiT and VAEs under the release's file names read correctly, but are not the release model:
    each is OTHER with what differs from the release variant its name claims, and the check exits 1 without an
    up.sh line. A release-shaped DiT named as the unpruned int8 file that holds the pruned one is told apart by its
    variant; one whose name states no partition is refused, as its stage refuses it."""
    d = write_tiny_models_folder(tmp_path / "models")
    r = run(["models", "check", str(d)])
    assert r.returncode == 1, r.stdout + r.stderr
    lines = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.split()[:1] in (["dit"], ["encoder"], ["decoder"])}
    assert "OTHER" in lines["dit"] and \
        "a tiny test model, not the release fl2va DiT (hidden 64 vs 5376, num_layers 1 vs 50" in lines["dit"], r.stdout
    assert "OTHER" in lines["video_vae"] and "a tiny test model, not the release video VAE (ch 8 vs 128" in \
        lines["video_vae"]
    assert "OTHER" in lines["audio_vae"] and "not the release audio VAE (latent_dim 256 vs 2048" in lines["audio_vae"]
    assert " ok " in lines["encoder"] and " ok " not in lines["dit"]
    assert "3 of 4 parts are not the MiniMax-H3 release files their names claim" in r.stdout
    assert "up.sh" not in r.stdout and "Traceback" not in r.stderr

    from client.models_cli import check_folder

    (d / "diffusion_models/minimax_h3_fl2va_bf16.safetensors").unlink()
    write_release_dit(d / "diffusion_models/minimax_h3_fl2va_int8_convrot.safetensors")  # holds the pruned one
    (report,) = [x for x in check_folder(d) if x.part == "dit"]
    assert not report.problem and report.variant == "int8_convrot_pruned, fl2va", report
    assert report.not_release == "named as the release's int8_convrot file, but holds int8_convrot_pruned weights"
    # the video VAE: ComfyUI's int8 ConvRot file is the release's; an fp16 one under its name is not
    (d / "vae/minimax_h3_video_vae_fp16.safetensors").unlink()
    int8 = write_release_video_vae(d / "vae/minimax_h3_video_vae_int8_convrot.safetensors", int8=True)
    (report,) = [x for x in check_folder(d) if x.part == "video_vae"]
    assert report.path == int8 and not report.problem and not report.not_release, report
    assert report.variant == "comfy layout, int8_convrot, geometry from the H3 release geometry", report
    write_release_video_vae(int8, int8=False)
    (report,) = [x for x in check_folder(d) if x.part == "video_vae"]
    assert report.not_release == "named as the release's int8_convrot file, but holds fp16 weights", report
    unplaced = write_release_dit(d / "diffusion_models/minimax_h3_pruned_int8_convrot.safetensors")  # no partition
    (d / "diffusion_models/minimax_h3_fl2va_int8_convrot.safetensors").unlink()
    (report,) = [x for x in check_folder(d) if x.part == "dit"]
    assert report.path == unplaced and "cannot tell which MiniMax-H3 partition" in report.problem, report


# ---- 3. doctor --------------------------------------------------------------------------------------------------


def test_doctor_recommends_a_setup_or_names_the_fix(tmp_path):
    none = ["--endpoints-file", str(tmp_path / "none.env")]
    env = fake_nvidia_smi(tmp_path / "bin", ["0, NVIDIA GeForce RTX 2080 Ti, 570.86.15, 22528, 7.5",
                                             "1, NVIDIA GeForce RTX 2080 Ti, 570.86.15, 22528, 7.5"])
    env.update({"H3_ENCODER": "", "H3_DIT": "", "H3_DECODER": "", "H3_RENDER": ""})
    r = run(["doctor", *none], env)
    assert "cuda:1    NVIDIA GeForce RTX 2080 Ti, sm_75, 22.0 GiB, driver 570.86.15" in r.stdout, r.stdout
    assert "host RAM" in r.stdout and "GiB free under" in r.stdout
    # torch here is the CPU build: with a GPU present, that is the one thing to fix
    assert r.returncode == 1 and "fix first:  torch does not see the GPU: run scripts/setup.sh --cuda" in r.stdout
    r = run(["doctor", "--dit", "127.0.0.1:9", "--models-dir", str(tmp_path), *none], {"PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "dit      127.0.0.1:9  DOES NOT ANSWER" in r.stdout, r.stdout
    assert "the models folder lacks encoder, dit, video_vae, audio_vae: " in r.stdout and " -m client models fetch" \
        in r.stdout
    quiet = {"PATH": "/usr/bin:/bin", "H3_ENCODER": "", "H3_DIT": "", "H3_DECODER": "", "H3_RENDER": "",
             **{f"H3_{n}_PORT": "0" for n in ("ENCODER", "DIT", "DECODER", "RENDER", "RENDER_HTTP")}}
    r = run(["doctor", *none], quiet)
    if not shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        assert r.returncode == 0 and "recommended (no GPU that fits the real model)" in r.stdout, r.stdout
    with socket.socket() as held:  # a port up.sh would use, taken by another program
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run(["doctor", *none], {**quiet, "H3_DIT_PORT": str(port)})
    assert r.returncode == 1 and f"{port} (dit) is taken" in r.stdout and "set H3_DIT_PORT" in r.stdout, r.stdout


def test_machine_recommends_the_documented_up_lines():
    from client.machine import GPU, recommend

    t = GPU(0, "NVIDIA GeForce RTX 2080 Ti", "570.86.15", 22528, 7.5)
    assert recommend([t], "M") == ("one-22gb", "H3_DIT_LINEAR_KERNEL=int8 H3_DIT_DTYPE=float16 H3_ENCODER_MODE=compact "
                                   "H3_ENCODER_DTYPE=float16 H3_DECODER_DTYPE=float16 scripts/up.sh --models-dir M "
                                   "--devices cuda:0 --gpu-memory-cap-gb 22 --residency exclusive")
    two = recommend([t, GPU(1, t.name, t.driver, t.memory_mib, 7.5)], "M")
    assert two[0] == "two-22gb" and "--devices cuda:0,cuda:1 --dit-ranks 2 --decoder-ranks 2 --gpu-memory-cap-gb 22" \
        in two[1]
    big = recommend([GPU(0, "NVIDIA H200", "580.65.06", 143771, 9.0)], "M")
    assert big == ("big", "scripts/up.sh --models-dir M --devices cuda:0 --residency shared")
    assert recommend([GPU(0, "GTX 1080", "535.1", 8192, 6.1)], "M")[0] == ""
    assert json.dumps(recommend([], "M"))  # no GPU: says what runs here instead


def test_a_file_put_back_with_the_old_size_and_mtime_is_hashed_again(tmp_path):
    # `cp -p` / `rsync -a` keep size and mtime: the `.sha256` note names the file's identity (inode, ctime), so a
    # replaced file is never taken as verified from the note of the file it replaced.
    from client.models_cli import _stamp, _verified, sha256_of

    f = tmp_path / "vae.safetensors"
    f.write_bytes(b"a" * 4096)
    sha = sha256_of(f)
    f.with_name(f".{f.name}.sha256").write_text(_stamp(sha, f) + "\n")
    assert _verified(f, 4096, sha)
    st = f.stat()
    f.write_bytes(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert not _verified(f, 4096, sha)
