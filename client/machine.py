"""What this machine has for MiniMax-H3, and which setup fits it. Standard library only: `scripts/setup.sh` runs it
with the system Python before any virtualenv exists (`python3 -m client.machine torch`), and `client doctor` /
`client models check` import it.

    python3 -m client.machine torch [--cpu | --cuda | --build TAG]   # the torch build to install: `key=value` lines
    python3 -m client.machine gpus                     # the GPUs nvidia-smi sees

The choice of torch build (1. to 4. in `choose_torch`) follows NVIDIA's driver table: a CUDA 13.0 build needs
driver 580+, 12.8 needs 570+, 12.6 runs on 525+ (CUDA minor-version compatibility); the 12.8 and 13.0 builds start
at Turing (compute capability 7.5).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TORCH_VERSION = "2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/"
# (build tag, least driver major version, least compute capability), newest first
CUDA_BUILDS = (("cu130", 580, 7.5), ("cu128", 570, 7.5), ("cu126", 525, 5.0))
BUILDS = ("cpu", *(tag for tag, _, _ in CUDA_BUILDS))
FP8_ATTENTION_CC = 9.0  # cuDNN fp8 attention (nvidia-cudnn-frontend): Hopper and later
FA3_CC = 9.0  # FlashAttention-3 (fa3-fwd): its kernels are built for Hopper alone
GIB = 1 << 30

SETUP_NAMES = {"one-22gb": "one 22 GB card", "two-22gb": "two 22 GB cards", "big": "one big GPU",
               "": "no GPU that fits the real model"}
TURING_ENV = ("H3_DIT_LINEAR_KERNEL=int8 H3_DIT_DTYPE=float16 H3_ENCODER_MODE=compact H3_ENCODER_DTYPE=float16 "
              "H3_DECODER_DTYPE=float16")
MIN_SETUP_VRAM_GIB = 21.0   # a "22 GB" card (2080 Ti 22 GB mod, 3090/4090 24 GB) reports 21.5+ GiB
BIG_VRAM_GIB = 75.0
# Host RAM each setup needs (README "Requirements", one figure everywhere): all our processes together peaked at
# 23.1 GiB RSS on one 22 GB card (docs/one_card.md, "Host memory") and at 37.5 GiB RSS on two (docs/two_cards.md);
# one big GPU keeps the two cards' figure.
HOST_RAM_GB = {"one-22gb": 32, "two-22gb": 64, "big": 64}
MEMINFO_SHARE = 0.9  # MemTotal is the installed RAM less what firmware and kernel keep (a few %); 0.9 leaves room


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    driver: str          # e.g. "570.86.15"
    memory_mib: int
    compute_cap: float   # e.g. 7.5

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


def find_gpus() -> tuple[list[GPU], str]:
    """(GPUs, why none) from `nvidia-smi` on PATH: no nvidia-smi, or one that fails, means no usable NVIDIA GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "no nvidia-smi on PATH (no NVIDIA driver installed)"
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,driver_version,memory.total,compute_cap",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi did not run: {e}"
    if out.returncode != 0:
        said = (out.stderr or out.stdout).strip().splitlines()
        return [], f"nvidia-smi failed: {said[-1] if said else f'exit code {out.returncode}'}"
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(GPU(int(parts[0]), parts[1], parts[2], int(float(parts[3])), float(parts[4])))
        except (IndexError, ValueError):
            return [], f"nvidia-smi printed a line this tool cannot read: {line!r}"
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


@dataclass(frozen=True)
class TorchChoice:
    build: str            # "cpu" | "cu126" | "cu128" | "cu130"
    spec: str             # pip requirement
    index_url: str        # the wheel index torch comes from
    cudnn_frontend: bool  # install nvidia-cudnn-frontend
    why: str
    fa3: bool = False     # install fa3-fwd (FlashAttention-3's forward kernels, built for Hopper)


def choose_torch(gpus: list[GPU], none_why: str, force: str = "") -> TorchChoice:
    """The torch build for this machine. `force`: "cpu" | "cuda" (the --cpu / --cuda of setup.sh), or a build tag
    ("cu128", the --build of setup.sh): that build whatever this machine has, for another machine (an image built
    without the GPU it will run on).

    1. --cpu, or no NVIDIA GPU: the CPU build from PyTorch's CPU wheel index (PyPI's torch of the same version is
       the CUDA build, which pulls in the nvidia-* wheels: several GB a machine without a GPU never uses), pinned
       as `+cpu`, which only that index (or a local wheel of it) has; plus the cuDNN frontend: the tests check our
       fp8 attention graph against it on CPU;
    2. the newest CUDA build the driver runs and every GPU's compute capability is built for;
    3. a driver too old for any build: the CPU build, and the driver to install (--cuda refuses instead);
    4. nvidia-cudnn-frontend where fp8 attention can run (compute capability 9.0+);
    5. fa3-fwd (FlashAttention-3, minimax_h3/kernels/fa3_attention.py) where every GPU is a Hopper (sm_90), the
       only architecture its kernels are built for."""
    cpu_spec = f"torch=={TORCH_VERSION}+cpu"

    def cpu(why: str) -> TorchChoice:
        return TorchChoice("cpu", cpu_spec, TORCH_INDEX + "cpu", True, why)

    if force == "cpu":
        return cpu("--cpu given")
    for tag, least_driver, _ in CUDA_BUILDS:
        if force == tag:  # nvidia-cudnn-frontend too: the machine it is for may be a Hopper
            return TorchChoice(tag, f"torch=={TORCH_VERSION}", TORCH_INDEX + tag, True,
                               f"--build {tag} given: for NVIDIA drivers {least_driver}+; this machine's GPUs are "
                               "not asked")
    if not gpus:
        if force == "cuda":
            return TorchChoice("error", "", "", False, f"--cuda given but {none_why}")
        return cpu(none_why)
    driver = int(gpus[0].driver.split(".")[0])
    cc = min(g.compute_cap for g in gpus)
    names = ", ".join(f"{g.name} (sm_{int(g.compute_cap * 10)}, {g.memory_gib:.0f} GiB)" for g in gpus)
    for tag, least_driver, least_cc in CUDA_BUILDS:
        if driver >= least_driver and cc >= least_cc:
            fp8 = cc >= FP8_ATTENTION_CC
            fa3 = all(g.compute_cap == FA3_CC for g in gpus)
            return TorchChoice(tag, f"torch=={TORCH_VERSION}", TORCH_INDEX + tag, fp8,
                               f"driver {gpus[0].driver} runs CUDA builds up to {tag}; GPUs: {names}"
                               + ("" if fp8 else "; fp8 attention needs compute capability 9.0+, so no cuDNN "
                                                 "frontend")
                               + ("" if fa3 else "; FlashAttention-3 runs on Hopper (9.0) only, so no fa3-fwd"),
                               fa3)
    why = (f"driver {gpus[0].driver} is older than any CUDA build of torch {TORCH_VERSION} supports "
           f"(525 at least, 570+ recommended): update the NVIDIA driver")
    if force == "cuda":
        return TorchChoice("error", "", "", False, why)
    return cpu(why + "; installing the CPU build for now")


def host_ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def free_disk_gib(path: str | Path) -> float:
    p = Path(path).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free / GIB


def _no_fit(gpus: list[GPU]) -> str:
    small = f" (the largest has {max(g.memory_gib for g in gpus):.1f} GiB)" if gpus else ""
    return (f"no GPU with {MIN_SETUP_VRAM_GIB:.0f}+ GiB{small}: the real model needs one 22 GB card at least "
            "(README 'Requirements')")


def recommend(gpus: list[GPU], models_dir: str = "DIR") -> tuple[str, str]:
    """(setup key or "", the `scripts/up.sh` command line that fits `gpus`, or what to do instead)."""
    fits = [g for g in gpus if g.memory_gib >= MIN_SETUP_VRAM_GIB]
    if not fits:
        return "", f"{_no_fit(gpus)}; the embedded tiny model runs here: scripts/up.sh"
    turing = min(g.compute_cap for g in fits) < 8.0  # no bf16 / fp8 kernels: int8 linears, fp16 compute
    env = TURING_ENV + " " if turing else ""
    if fits[0].memory_gib >= BIG_VRAM_GIB:
        return "big", f"scripts/up.sh --models-dir {models_dir} --devices cuda:{fits[0].index} --residency shared"
    if len(fits) >= 2:
        devs = ",".join(f"cuda:{g.index}" for g in fits[:2])
        return "two-22gb", (f"{env}scripts/up.sh --models-dir {models_dir} --devices {devs} --dit-ranks 2 "
                            f"--decoder-ranks 2 --gpu-memory-cap-gb 22 --residency exclusive")
    return "one-22gb", (f"{env}scripts/up.sh --models-dir {models_dir} --devices cuda:{fits[0].index} "
                        f"--gpu-memory-cap-gb 22 --residency exclusive")


def real_model_blockers(gpus: list[GPU], ram_gib: float) -> list[str]:
    """Why this machine cannot run the real model (empty when it can): no GPU that fits any setup, or less host RAM
    than the setup that fits needs (HOST_RAM_GB)."""
    setup, _ = recommend(gpus)
    if not setup:
        return [_no_fit(gpus)]
    need = HOST_RAM_GB[setup]
    if ram_gib < need * MEMINFO_SHARE:
        return [f"{ram_gib:.1f} GiB of host RAM: {SETUP_NAMES[setup]} needs {need} GB (README 'Requirements')"]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m client.machine", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("torch", help="the torch build to install, as key=value lines (for scripts/setup.sh)")
    force = t.add_mutually_exclusive_group()
    force.add_argument("--cpu", action="store_const", const="cpu", dest="force", help="the CPU build, whatever is here")
    force.add_argument("--cuda", action="store_const", const="cuda", dest="force",
                       help="a CUDA build; an error when no GPU or driver can run one")
    force.add_argument("--build", choices=BUILDS, dest="force",
                       help="this build whatever the machine has (an image for other machines)")
    sub.add_parser("gpus", help="the GPUs nvidia-smi sees")
    args = ap.parse_args(argv)
    gpus, none_why = find_gpus()
    if args.cmd == "gpus":
        for g in gpus:
            print(f"cuda:{g.index}  {g.name}  sm_{int(g.compute_cap * 10)}  {g.memory_gib:.1f} GiB  driver {g.driver}")
        if not gpus:
            print(none_why)
        return 0
    c = choose_torch(gpus, none_why, args.force or "")
    print(f"build={c.build}\nspec={c.spec}\nindex_url={c.index_url}\ncudnn_frontend={int(c.cudnn_frontend)}\n"
          f"fa3={int(c.fa3)}\nwhy={c.why}")
    return 1 if c.build == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
