#!/usr/bin/env python
"""The DiT's one- and two-GPU benchmark matrix in one run on a two-GPU host, within a wall-time deadline (`--total-s`).

    python benchmarks/bench_fast_dit.py --out $OUT                    # on 2 GPUs: docs/performance.md
    python benchmarks/bench_fast_dit.py --tiny --out /tmp/fastdit     # CPU dry run: the same items, tiny model and shapes
    python benchmarks/bench_fast_dit.py --only attention,tp2 --budget tp2=200 --out $OUT    # a subset, other timeouts

Every item is one subprocess of a benchmark script with a timeout (`--budget`); one that fails, or times out (SIGINT,
then SIGKILL to its process group; leftover stage processes under its work folder are ended by id), is recorded
and the next one still runs. Items (S = 832x480x124 and 1344x768x124):

  phase 1, two GPUs side by side (the phase ends at `--phase1-s`):
    GPU 0  ckpt       a random full-size int8-ConvRot checkpoint (pruned curve AdaLN, ~19.5 GiB) for the engine items
           dit        bench_dit.py --variants diffusers,fp8cf,fp8caf at both S: diffusers vs the engine's default
                      (fp8caf: fast-accumulation fp8 GEMMs, fp8 attention, compiled blocks) and the same with bf16
                      cuDNN attention (fp8cf); full-forward velocity error of fp8 attention vs that bf16-attention
                      path
           tp1        (if at least --min-start-s is left) bench_tp.py on one GPU, both S
    GPU 1  attention  bench_attention.py --layers 2: self-check (kernel vs emulation, registry probes, per-head
                      descales), op-level error and ms per option (naive / head / head+k / head+kv) at both S,
                      velocity error per option through 2 blocks
           service    bench_dit_service.py at 832x480x124: Sample through gRPC vs the bare engine, and the first vs
                      second start of the stage on one compile cache
  phase 2, both GPUs: tp2, sp2 (torchrun bench_tp.py, TP2 and --sp-degree 2, both S), then tp1 if it has not run.
The engine items (service, tp*) use fp8 linears, compiled blocks and fp8 attention when the attention item's
self-check passed (else cuDNN bf16 attention; summary.json says which).

Writes to --out: dit.json, attention.json, service.json, tp1.json, tp2.json, sp2.json,
summary.json (per item: command, status ok / failed / timeout / skipped, exit code, seconds, budget, why) and
run.log (every item's output, each line prefixed with its item). Exit 0 when every item succeeded.
--tiny runs the same plan on the CPU (gloo, emulated fp8, tiny checkpoint, shapes of the scripts' own --tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stagekit.procs import stop_group  # noqa: E402  (stdlib only)

BENCHMARKS = REPO / "benchmarks"
SHAPES = "832x480x124,1344x768x124"
SERVICE_SHAPE = "832x480x124"
# NVLink multicast stays off, as shared GPU hosts require.
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "PYTHONUNBUFFERED": "1"}
PACKAGES = ("torch", "triton", "nvidia-cudnn-frontend", "comfy-kitchen", "diffusers", "grpcio", "protobuf",
            "safetensors", "google-crc32c")
BUDGETS = {"dit": 300, "ckpt": 120, "attention": 150, "service": 240, "tp1": 150, "tp2": 160, "sp2": 160}
KILL_GRACE_S = 15.0
LOG_TAIL_LINES = 8


@dataclass
class Item:
    name: str
    argv: list[str]
    gpus: int = 1
    needs: tuple[str, ...] = ()           # items that must have succeeded first
    copy: dict[str, str] = field(default_factory=dict)  # file it writes in its work folder -> name in --out
    engine: bool = False                  # takes the attention kernel chosen from the self-check
    starts_stages: bool = False           # starts stage servers (own sessions) with its work folder in their args


class Driver:
    def __init__(self, args, out: Path, work: Path):
        self.args, self.out, self.work = args, out, work
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.log = open(out / "run.log", "a", buffering=1, encoding="utf-8")
        self.summary: dict = {"mode": "tiny (CPU)" if args.tiny else "gpu", "started": time.strftime("%F %T %Z"),
                              "total_s": args.total_s, "phase1_s": args.phase1_s, "items": {}}
        self.env = {**os.environ, **DEVICE_ENV}
        paths = [str(REPO), str(REPO / "protos")]
        self.env["PYTHONPATH"] = os.pathsep.join(
            [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p] + paths)

    # ----------------------------------------------------------------------------------------------------- output
    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{self.elapsed():4.0f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            self.log.write(f"[driver] {line}\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        with self.lock:
            self.summary["wall_s"] = round(self.elapsed(), 1)
            tmp = self.out / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=1, default=str))
            tmp.replace(self.out / "summary.json")

    def record(self, name: str, **row) -> dict:
        with self.lock:
            self.summary["items"].setdefault(name, {}).update(row)
            r = self.summary["items"][name]
        self.save()
        return r

    def status(self, name: str) -> str | None:
        return self.summary["items"].get(name, {}).get("status")

    # ------------------------------------------------------------------------------------------------ one item
    def run(self, item: Item, gpus: list[str], deadline: float, share: int = 1) -> str:
        """Run `item` on `gpus` with timeout min(its budget, (deadline - now) / share); returns its status."""
        budget = float(self.args.budgets[item.name])
        while any(self.status(n) == "running" for n in item.needs) and self.elapsed() < deadline:
            time.sleep(1.0)  # e.g. the checkpoint, still being written in the other lane
        missing = [n for n in item.needs if self.status(n) != "ok"]
        left = deadline - self.elapsed()
        timeout = min(budget, left / max(1, share))
        why = ""
        if missing:
            why = f"needs {', '.join(missing)} (not ok)"
        elif timeout < self.args.min_start_s:
            why = f"{left:.0f} s left before the phase deadline (< {self.args.min_start_s:.0f} s to start)"
        if why:
            self.say(f"{item.name}: SKIPPED: {why}")
            self.record(item.name, status="skipped", why=why, budget_s=budget)
            return "skipped"
        argv = list(item.argv)
        note = ""
        if item.engine:
            kernel, note = self.engine_attention()
            argv += ["--attention-kernel", kernel]
        env = dict(self.env)
        if not self.args.tiny:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        item_dir = self.work / item.name
        item_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"{item.name}: start on {','.join(gpus)}, timeout {timeout:.0f} s{note}: {' '.join(argv)}")
        self.record(item.name, status="running", cmd=argv, gpus=gpus, budget_s=budget, timeout_s=round(timeout),
                    started_s=round(self.elapsed(), 1), **({"attention_choice": note.strip("; ")} if note else {}))
        t1 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace", bufsize=1)
        tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        reader = threading.Thread(target=self._pump, args=(item.name, proc, tail), daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = self._stop(item.name, proc)
        if item.starts_stages:
            self._end_leftovers(item.name, item_dir)
        reader.join(timeout=10)
        secs = time.monotonic() - t1
        self._append_stage_logs(item.name, item_dir)
        copied = []
        for src, dst in item.copy.items():
            if (item_dir / src).is_file():
                shutil.copyfile(item_dir / src, self.out / dst)
                copied.append(dst)
        status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        self.record(item.name, status=status, rc=rc, seconds=round(secs, 1), copied=copied)
        with self.lock:
            for line in tail:
                print(f"    {item.name} | {line}", flush=True)
        self.say(f"{item.name}: {status.upper()} (rc {rc}) after {secs:.0f} s")
        return status

    def _pump(self, name: str, proc: subprocess.Popen, tail: deque) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line[:300])
            with self.lock:
                self.log.write(f"[{name}] {line}\n")

    def _stop(self, name: str, proc: subprocess.Popen) -> int:
        """SIGINT to the item's process group (Python unwinds: the service stops its stage, torchrun its ranks),
        then SIGKILL after a grace period."""
        self.say(f"{name}: out of time: SIGINT to its process group")
        rc = stop_group(proc, KILL_GRACE_S, first=signal.SIGINT, kill_wait_s=10.0)
        if rc is None:
            self.say(f"{name}: still running after SIGKILL")
        return -9 if rc is None else rc

    def _end_leftovers(self, name: str, item_dir: Path) -> None:
        """Processes that name a path in this item's work folder on their command line are the stage servers it
        started (in sessions of their own, so its process group did not cover them): SIGKILL each by id."""
        key = str(item_dir) + os.sep
        me = os.getpid()
        for pid_dir in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if key in cmd and int(pid_dir.name) != me:
                self.say(f"{name}: ending leftover process {pid_dir.name}: {cmd[:160]}")
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _append_stage_logs(self, name: str, item_dir: Path, max_lines: int = 300) -> None:
        """Logs that stage processes wrote under the item's folder (their stdout is not the item's)."""
        for path in sorted(item_dir.rglob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            with self.lock:
                self.log.write(f"[{name}] ---- {path.relative_to(item_dir)} ({len(lines)} lines, last {max_lines})\n")
                for line in lines[-max_lines:]:
                    self.log.write(f"[{name}:{path.stem}] {line}\n")

    def engine_attention(self) -> tuple[str, str]:
        """fp8 for the engine items when the attention item's self-check passed, else cuDNN bf16 (and why)."""
        if self.args.tiny:
            return "auto", "; attention auto (CPU)"
        if self.args.engine_attention != "gate":
            return self.args.engine_attention, f"; attention {self.args.engine_attention} (--engine-attention)"
        path = self.work / "attention" / "attention.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            return "cudnn", f"; attention cudnn: no self-check result ({type(e).__name__})"
        bad = [f for f in res.get("failures", []) if f.startswith(("self-check", "cuDNN fp8", "forced fp8"))]
        if "self_check" not in res or bad:
            return "cudnn", f"; attention cudnn: fp8 self-check failed: {(bad or ['not run'])[0][:200]}"
        return "fp8", "; attention fp8 (self-check passed)"

    # ----------------------------------------------------------------------------------------------- the plan
    def lane(self, names: list[str], items: dict[str, Item], gpus: list[str], deadline: float) -> None:
        for n in names:
            if n in items and self.status(n) in (None, "skipped"):
                self.run(items[n], gpus, deadline)

    def main(self, items: dict[str, Item], lanes: list[list[str]], gpu_names: list[list[str]]) -> int:
        self.summary["packages"] = package_versions()
        self.summary["plan"] = {"phase1_lanes": {",".join(g): ln for g, ln in zip(gpu_names, lanes)},
                                "phase2": [n for n in ("tp2", "sp2", "tp1") if n in items]}
        self.save()
        self.say(f"plan: {json.dumps(self.summary['plan'])}; packages {json.dumps(self.summary['packages'])}")
        # Phase 1: the lanes side by side, each on its own GPU(s).
        threads = [threading.Thread(target=self.lane, args=(ln, items, g, self.args.phase1_s))
                   for ln, g in zip(lanes, gpu_names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Phase 2: the items that need both GPUs (the remaining time shared fairly), then tp1 if it never ran.
        every = [g for gs in gpu_names for g in gs]
        phase2 = [n for n in ("tp2", "sp2") if n in items]
        for i, n in enumerate(phase2):
            if len(every) < items[n].gpus:
                self.record(n, status="skipped", why=f"needs {items[n].gpus} GPUs, {len(every)} here")
                continue
            self.run(items[n], every[: items[n].gpus], self.args.total_s, share=len(phase2) - i)
        if "tp1" in items and self.status("tp1") in (None, "skipped"):
            self.run(items["tp1"], every[:1], self.args.total_s)
        for n in items:
            if self.status(n) is None:
                self.record(n, status="skipped", why="not reached")
        rows = self.summary["items"]
        self.say("summary: " + ", ".join(f"{n} {r.get('status')}" + (f" ({r['seconds']:.0f} s)" if "seconds" in r
                                                                     else "") for n, r in rows.items()))
        self.save()
        self.log.close()
        return 0 if all(r.get("status") == "ok" for r in rows.values()) else 1


def package_versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "missing"
    return out


def build_items(args, out: Path, work: Path, ckpt: Path) -> dict[str, Item]:
    py = sys.executable
    tiny = ["--tiny"] if args.tiny else []

    def torchrun(n: int, name: str, extra: list[str]) -> list[str]:
        argv = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                str(BENCHMARKS / "bench_tp.py"), *tiny, "--weights", str(ckpt), "--shapes", args.shapes,
                "--no-reload", "--out", str(out / f"{name}.json"), *extra]
        if args.tiny:
            return argv + ["--iters", "1"]
        return argv + ["--linear-kernel", "fp8", "--compile-blocks", "--chunk-rows", str(args.chunk_rows),
                       "--iters", "2"]

    items = {
        # One GPU, no collective to overlap: rows unchunked (chunk >= S). The chunk loop unrolls into each compiled
        # block's graph; with 16,384-row chunks 1344x768x124 compiled (3 chunks of 16384) in 45 s, 832x480x124 (1 chunk) in 12 s.
        "dit": Item("dit", [py, str(BENCHMARKS / "bench_dit.py"), *tiny, "--variants", "diffusers,fp8cf,fp8caf",
                            "--json", str(out / "dit.json"),
                            *([] if args.tiny else ["--shapes", args.shapes, "--chunk-rows", "65536"])]),
        "ckpt": Item("ckpt", [py, str(Path(__file__).resolve()), *tiny, "--write-checkpoint", str(ckpt)]),
        "attention": Item("attention", [py, str(BENCHMARKS / "bench_attention.py"), *tiny, "--layers", "2",
                                        "--out", str(work / "attention"),
                                        *([] if args.tiny else ["--shapes", args.shapes])],
                          copy={"attention.json": "attention.json"}),
        "service": Item("service", [py, str(BENCHMARKS / "bench_dit_service.py"), *tiny, "--weights", str(ckpt),
                                    "--out", str(work / "service"), "--compile-blocks", "--steps", "4",
                                    *([] if args.tiny else ["--shapes", SERVICE_SHAPE, "--linear-kernel", "fp8",
                                                            "--chunk-rows", str(args.chunk_rows)])],
                        needs=("ckpt",), copy={"dit_service.json": "service.json"}, engine=True,
                        starts_stages=True),
        "tp1": Item("tp1", torchrun(1, "tp1", []), needs=("ckpt",), engine=True),
        "tp2": Item("tp2", torchrun(2, "tp2", ["--profile"]), gpus=2, needs=("ckpt",), engine=True),
        "sp2": Item("sp2", torchrun(2, "sp2", ["--sp-degree", "2", "--profile"]), gpus=2, needs=("ckpt",),
                    engine=True),
    }
    return {n: it for n, it in items.items() if n in args.only}


def write_checkpoint(path: Path, tiny: bool) -> int:
    """The `ckpt` item: a random int8-ConvRot checkpoint (pruned curve AdaLN, the ~19.5 GiB file) at `path`."""
    sys.path.insert(0, str(REPO))
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint

    if path.is_file():
        print(f"{path} exists ({path.stat().st_size / 2**30:.2f} GiB)", flush=True)
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # never a half-written file under the real name
    t0 = time.monotonic()
    write_random_int8_convrot_checkpoint(DiTConfig.tiny() if tiny else DiTConfig.full(), partial,
                                         device="cpu" if tiny else "cuda", quantize=False, pruned=True)
    partial.replace(path)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


def parse_budgets(specs: list[str]) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for spec in specs:
        name, _, secs = spec.partition("=")
        if name not in BUDGETS or not secs:
            raise SystemExit(f"--budget {spec!r}: expected ITEM=SECONDS with ITEM one of {', '.join(BUDGETS)}")
        budgets[name] = float(secs)
    return budgets


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="result folder")
    ap.add_argument("--work", default="", help="scratch folder (checkpoint, caches, stage logs); default: "
                                               "/tmp/h3-fast-dit, or a temp folder with --tiny")
    ap.add_argument("--tiny", "--dry-run", action="store_true", dest="tiny",
                    help="CPU dry run of the whole plan with tiny shapes")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--chunk-rows", type=int, default=16384, help="row chunk of the engine items and bench_dit")
    ap.add_argument("--total-s", type=float, default=540.0, help="wall-time deadline of the whole run")
    ap.add_argument("--phase1-s", type=float, default=320.0, help="deadline of phase 1 (single-GPU lanes)")
    ap.add_argument("--min-start-s", type=float, default=45.0, help="an item with less time than this is skipped")
    ap.add_argument("--budget", action="append", default=[], metavar="ITEM=SECONDS",
                    help=f"override an item's budget (defaults {BUDGETS})")
    ap.add_argument("--only", default=",".join(BUDGETS), help="comma-separated items to run")
    ap.add_argument("--engine-attention", default="gate", choices=("gate", "fp8", "cudnn", "auto"),
                    help="attention of service / tp items; gate: fp8 if the attention self-check passed")
    ap.add_argument("--write-checkpoint", default="", metavar="PATH",
                    help="only write the ckpt item's random checkpoint to PATH (if missing) and exit")
    args = ap.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(Path(args.write_checkpoint), args.tiny)
    if not args.out:
        ap.error("--out is required")
    args.budgets = parse_budgets(args.budget)
    args.only = [n for n in args.only.split(",") if n]
    unknown = [n for n in args.only if n not in BUDGETS]
    if unknown:
        ap.error(f"--only: unknown items {unknown}; items: {', '.join(BUDGETS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or (tempfile.mkdtemp(prefix="h3-fast-dit-") if args.tiny else "/tmp/h3-fast-dit"))
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        gpu_names = [["cpu-lane0"], ["cpu-lane1"]]
    else:
        n = gpu_count()
        if n == 0:
            print("bench_fast_dit.py needs CUDA GPUs (or --tiny)", file=sys.stderr)
            return 2
        gpu_names = [["0"], ["1"]] if n >= 2 else [["0"]]
    ckpt = work / ("dit_tiny_int8_pruned.safetensors" if args.tiny else "dit_random_int8_pruned.safetensors")
    items = build_items(args, out, work, ckpt)
    if len(gpu_names) >= 2:
        lanes = [["ckpt", "dit", "tp1"], ["attention", "service"]]
    else:  # one GPU: one lane (the self-check first: it gates the engine items), the two-GPU items skipped
        lanes = [["attention", "ckpt", "dit", "service"]]
        args.phase1_s = args.total_s  # no second lane to wait for
    driver = Driver(args, out, work)
    driver.summary["work"] = str(work)
    driver.summary["gpus"] = gpu_names
    if "ckpt" not in items and ckpt.is_file():  # a checkpoint already in --work is reused
        driver.record("ckpt", status="ok", why=f"{ckpt} exists")
    try:
        return driver.main(items, lanes, gpu_names)
    finally:
        if args.tiny:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
