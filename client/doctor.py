"""`python -m client doctor`: what this machine has for MiniMax-H3, and what to do next.

GPUs, driver, the torch build and the CUDA it sees (asked in a child process: this client never imports torch),
VRAM per card, host RAM, free disk, the models folder, the services configured and whether they answer; it ends
with the setup it recommends or the first thing to fix (exit 1 when something must be fixed). A machine that cannot
run the real model (no GPU that fits, too little host RAM) is said plainly; `--strict` makes that exit 1 too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from client.command import self_command
from client.machine import (HOST_RAM_GB, SETUP_NAMES, find_gpus, free_disk_gib, host_ram_gib, real_model_blockers,
                            recommend)

MIN_DISK_GIB = 60.0   # the default variants of `models fetch`: about 52 GiB
# scripts/up.sh's default ports (H3_<NAME>_PORT overrides each)
UP_PORTS = {"encoder": 50051, "dit": 50052, "decoder": 50053, "render": 50054, "render_http": 8054}


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def torch_info() -> tuple[str, str]:
    """(torch version and build, CUDA devices torch sees) from this interpreter, in a child process."""
    code = ("import torch; print(torch.__version__); print(torch.version.cuda or 'cpu'); "
            "print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not usable ({e})", "0"
    if out.returncode != 0:
        return "not installed (run scripts/setup.sh)", "0"
    version, cuda, n = out.stdout.split()
    return f"{version} ({'CUDA ' + cuda if cuda != 'cpu' else 'CPU build'})", n


def cmd_doctor(args) -> int:
    from client.checks import find_for_client
    from client.endpoints import configured_endpoints, configured_render, render_reachable, unreachable_stages
    from minimax_h3.files import CHECKPOINT_PARTS
    from stagekit.channels import Security
    from stagekit.errors import FailedPrecondition

    fixes: list[str] = []
    gpus, none_why = find_gpus()
    print(f"GPUs        {len(gpus) or none_why}")
    for g in gpus:
        print(f"  cuda:{g.index}    {g.name}, sm_{int(g.compute_cap * 10)}, {g.memory_gib:.1f} GiB, driver {g.driver}")
    torch_line, torch_gpus = torch_info()
    print(f"torch       {torch_line}, sees {torch_gpus} GPU(s)")
    if gpus and torch_gpus == "0":
        fixes.append("torch does not see the GPU: run scripts/setup.sh --cuda (it installs the CUDA build the "
                     "driver runs)")
    ram = host_ram_gib()
    print(f"host RAM    {ram:.1f} GiB (the real model needs "
          + ", ".join(f"{gb} GB with {SETUP_NAMES[k]}" for k, gb in HOST_RAM_GB.items()) + ")")
    models = args.models_dir
    disk = free_disk_gib(models or ".")
    print(f"disk        {disk:.1f} GiB free under {models or os.getcwd()}")
    if models:
        root = Path(models).expanduser()
        missing = []
        for part, spec in CHECKPOINT_PARTS.items():
            try:
                found = find_for_client(root, part)
                print(f"models      {part:<10} {found}")
            except FailedPrecondition as e:
                if spec.optional and e.message.startswith("no "):
                    print(f"models      {part:<10} not present (optional)")
                    continue
                missing.append(part)
                print(f"models      {part:<10} missing ({e.message})")
        if missing:
            fixes.append(f"the models folder lacks {', '.join(missing)}: {self_command()} models fetch --to {root}")
    else:
        print("models      no folder given (--models-dir or H3_MODELS_DIR); the embedded tiny model is used")
        if disk < MIN_DISK_GIB and gpus:
            fixes.append(f"{disk:.0f} GiB free here; the model files need about {MIN_DISK_GIB:.0f} GiB")
    security = Security(args.token, args.tls_ca)
    render = configured_render(args)
    if render:
        up = render_reachable(render, security)
        print(f"service     render   {render}  {'answers' if up else 'DOES NOT ANSWER'}")
        if not up:
            fixes.append(f"the render service {render} does not answer: scripts/up.sh (or scripts/down.sh to clear "
                         f"{args.endpoints_file})")
    endpoints = configured_endpoints(args)
    if endpoints is not None:
        down = unreachable_stages(endpoints, security)
        for s in endpoints.stages:
            print(f"service     {s:<8} {endpoints.of(s)}  {'DOES NOT ANSWER' if s in down else 'answers'}")
        if down:
            fixes.append(f"{', '.join(down)} configured but not answering: scripts/up.sh, or scripts/down.sh to "
                         f"clear {args.endpoints_file}")
    if not render and endpoints is None:
        print("service     none configured (render starts the embedded stack)")
        ports = {n: int(os.environ.get(f"H3_{n.upper()}_PORT") or p) for n, p in UP_PORTS.items()}
        taken = [(n, p) for n, p in ports.items() if p and port_taken(p)]
        print("ports       " + ("; ".join(f"{p} ({n}) is taken" for n, p in taken) if taken else
                                f"{', '.join(str(p) for p in ports.values() if p)} free for scripts/up.sh"))
        for n, p in taken:
            fixes.append(f"port {p}, scripts/up.sh's for {n}, is taken by another program: stop it, or set "
                         f"H3_{n.upper()}_PORT to another port (0: any free one)")
    blockers = real_model_blockers(gpus, ram)
    print("real model  " + (f"CANNOT RUN HERE: {'; '.join(blockers)}" if blockers else "fits this machine"))
    if fixes:
        print(f"fix first:  {fixes[0]}" + "".join(f"\nthen:       {f}" for f in fixes[1:]))
        return 1
    setup, line = recommend(gpus, models or "DIR")
    print(f"recommended ({SETUP_NAMES[setup]}):\n  {line}")
    return 1 if blockers and args.strict else 0


def add_parser(sub) -> None:
    from client.endpoints import add_endpoint_args

    d = sub.add_parser("doctor", help="GPUs, driver, torch, VRAM, RAM, disk, models folder, services; what to do next")
    d.add_argument("--models-dir", default=os.environ.get("H3_MODELS_DIR", ""),
                   help="the models folder to look at (default: H3_MODELS_DIR)")
    d.add_argument("--strict", action="store_true",
                   help="exit 1 also when this machine cannot run the real model (default: exit 0 then, as the "
                        "embedded tiny model runs anywhere)")
    add_endpoint_args(d.add_argument_group("where the services are"), render=True)
    d.set_defaults(fn=cmd_doctor)
