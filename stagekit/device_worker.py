"""The GPU work of a stage, in a child process that touches the device only while the stage holds its weights.

A CUDA context costs 0.5-0.7 GiB of the card for as long as its process lives, weights or not. A stage process
that never initialises CUDA holds nothing on the card while idle: its device work (engine construction on the
device, load, every job, unload) runs in a *device worker*, a `spawn`ed child started by `load` and joined by
`unload`, so the context and every byte the engine allocated go back to the card with it (docs/residency.md,
"What an idle stage holds"). The next turn's worker is spawned ahead, on standby: it imports everything (the
engine's `prepare_process()` included) and waits, touching no device, until `load` sends it "start".

    stage process (rank r)                      device worker (rank r), one per residency
    ----------------------                      ----------------------------------------
    prepare() -> spawn (standby, the   ------>  imports, engine_cls.prepare_process(), gc.freeze(), the
                 host copies held)              copies mapped and prefaulted on a thread  -> ("standby",)
    load()   -> ("start", rendezvous)  ------>  device, engine = type(engine)(engine.cfg, worker group)
             -> ("load", spec, files,  ------>  source = WeightSource.host_copies(files, copies, to_fill);
                 copies, to_fill)               engine.load(source) / load_for(spec, source)
                                                          -> ("ok", (bytes, load report, source.filled))
    run()    -> ("run", spec, inputs)  ------>  engine.run(spec, inputs, ctx)
                answers ctx calls      <------  ("progress"| "should_stop" | "check_cancel"...)
                                       <------  ("done", outputs, bytes) | ("error", exc)
    unload() -> ("exit"), join (kill after `join_timeout_s`), prepare() the next turn's worker

- After each job the worker hands what Status shows of it (the engine's `worker_state()` hook) to the stage
  process's engine (`set_worker_state(state)`): the DiT's block placement and window plan.
- Messages cross the pipe by value (`Channel`: plain pickle, tensors copied), so a killed process leaves nothing
  shared behind. A job's inputs and outputs are latents, states and the MP4: tens to hundreds of MB, copied at
  pipe speed. The weights are the exception: a one-rank stage keeps the files each load reads (the runtime's
  `WeightSource`, the engine's `weight_files` for the job) in memfds it owns, which its worker maps read-only into
  the source it hands its engine's load (stagekit/host_copy.py); the kernel frees them with the stage process.
  What a load derives from the files (the engine's `derived_copies(files)` hook: {key: bytes}) is kept the same
  way once a load has filled it.
- Cancellation stays agreed across ranks: a worker's `ctx.should_stop()` is answered by its stage process, which
  runs the rank group's agreement as before (every rank's worker asks at the same step boundaries).
- Multi-rank stages: the workers form their own process group (NCCL on GPUs, gloo on CPU) at each load, on a
  loopback port rank 0 picks and broadcasts over the stage's control group; the stage processes' own group is gloo.
- A worker dies with its stage process (PR_SET_PDEATHSIG). A worker that dies during a job fails that job as a
  server fault naming the stage; a one-rank stage loads afresh for the next job, a multi-rank stage restarts its
  group the way a dead rank does.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagekit.child import Channel, exit_text, portable, spawn_context
from stagekit.engine import Spec, StageEngine
from stagekit.errors import StageError, Unavailable
from stagekit.host_copy import HostCopies
from stagekit.procs import die_with_parent

if TYPE_CHECKING:
    from stagekit.checkpoints import WeightSource

log = logging.getLogger("stagekit.device_worker")

# "1": run the device work in a worker on CPU devices too (tests exercise the CUDA path this way). CUDA always does.
WORKER_ENV = "H3_DEVICE_WORKER"


def wanted(device: str) -> bool:
    """Whether a stage computing on `device` runs its device work in a worker."""
    return device.startswith("cuda") or os.environ.get(WORKER_ENV) == "1"


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs besides its engine's class and config."""

    stage: str
    device: str                      # the torch device of this rank ("cuda:0", "cpu")
    rank: int = 0
    world_size: int = 1
    collective_timeout_s: float = 60.0
    gpu_memory_cap_gb: float = 0.0   # --gpu-memory-cap-gb: applied in the worker, which owns the context
    log_level: str = "INFO"
    join_timeout_s: float = 30.0     # unload: a worker that has not exited after this long is killed


class _WorkerContext:
    """The JobContext a worker's engine sees: every call is answered by the stage process's own JobContext."""

    def __init__(self, conn, stage: str):
        self._conn = conn
        self.stage = stage

    def progress(self, step: int, total: int, phase: str = "running", message: str = "", step_ms: float = 0.0) -> None:
        self._conn.send(("progress", (step, total, phase, message, step_ms)))

    def _ask(self, what: str):
        self._conn.send((what,))
        return self._conn.recv()

    def should_stop(self) -> bool:
        return self._ask("should_stop")

    def check_cancel(self) -> None:
        err = self._ask("check_cancel")
        if err is not None:
            raise err

    def check_cancel_local(self) -> None:
        err = self._ask("check_cancel_local")
        if err is not None:
            raise err


def _worker_main(conn, engine_cls: type[StageEngine], engine_cfg: Any, wcfg: WorkerConfig,
                 copies: dict[str, str] | None = None) -> None:
    """The worker: import everything and wait on standby (no device touched, so it holds nothing of the card),
    mapping the stage's host copies of the files its load will read (`copies`) and faulting their pages in
    meanwhile; at "start" set up the device and build the engine, then serve the stage process's commands until
    "exit"."""
    conn = Channel(conn)
    die_with_parent(f"the {wcfg.stage} device worker")
    logging.basicConfig(level=wcfg.log_level.upper(),
                        format=f"%(asctime)s {wcfg.stage}-worker[%(process)d] %(levelname)s %(message)s")
    # torch after the environment: expandable segments must be set before the first CUDA allocation.
    if wcfg.device.startswith("cuda"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # docs/memory.md
    import torch

    from stagekit.checkpoints import WeightSource, prefault_copies
    from stagekit.dist import RankGroup, RankInfo
    from stagekit.runtime import load_engine

    # The engine's own heavy imports (e.g. GPU kernel libraries it would import at its first load), still on
    # standby: they touch no device.
    try:
        engine_cls.prepare_process()
    except Exception as e:  # noqa: BLE001 - the load imports it again and reports a real failure
        log.warning("%s device worker: preparing the process failed (%r); the load does it", wcfg.stage, e)
    # Everything imported so far lives as long as the process: out of the collector's sight, a collection during
    # the turn (the engine's release after a load, allocation-triggered ones) walks only the turn's own objects
    # (measured on a DiT worker: ~300k objects, 0.15 s a full collection on a 2-core CPU, ~0 s after this).
    gc.freeze()
    prefault = None
    if copies:
        try:
            prefault = prefault_copies(copies)
        except OSError as e:  # e.g. the stage dropped a copy meanwhile: the load maps what it is handed
            log.info("%s device worker: host copies not mapped on standby (%r)", wcfg.stage, e)
    conn.send(("standby", None))
    try:
        msg = conn.recv()
    except EOFError:  # the stage process is gone (or closed its standby)
        os._exit(0)
    if msg[0] != "start":
        os._exit(0)
    rendezvous = msg[1]
    t0 = time.monotonic()
    try:
        if wcfg.device.startswith("cuda"):
            torch.cuda.set_device(wcfg.device)
            if wcfg.gpu_memory_cap_gb > 0:
                total = torch.cuda.get_device_properties(wcfg.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, wcfg.gpu_memory_cap_gb * 2**30 / total),
                                                           wcfg.device)
        addr, port, run_id = rendezvous or ("127.0.0.1", 0, "worker")
        info = RankInfo(wcfg.rank, wcfg.world_size, wcfg.rank, master_addr=addr, master_port=port, run_id=run_id)
        group = RankGroup(info, "nccl" if wcfg.device.startswith("cuda") else "gloo", wcfg.collective_timeout_s)
        t1 = time.monotonic()
        engine = engine_cls(engine_cfg, group)
        ready = {"device_s": t1 - t0, "engine_s": time.monotonic() - t1}
        if prefault is not None:  # the host copies' pages: faulted in on standby, or still being (the load's to do)
            ready["prefault_s"] = prefault.seconds if prefault.seconds is not None else -1.0
        conn.send(("ready", ready))
    except BaseException as e:  # noqa: BLE001 - handed to the stage process
        conn.send(("error", portable(e)))
        os._exit(1)
    ctx = _WorkerContext(conn, wcfg.stage)
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the stage process is gone
            break
        if msg[0] == "exit":
            break
        try:
            if msg[0] == "load":
                _, spec, files, copies, to_fill = msg
                source = WeightSource.host_copies(files, copies, to_fill, prefault)
                load_engine(engine, source, spec)
                conn.send(("ok", (engine.resident_bytes(), engine.load_report(), source.filled)))
            elif msg[0] == "run":
                out = engine.run(msg[1], msg[2], ctx)
                conn.send(("done", out, engine.resident_bytes(), engine.worker_state()))
        except BaseException as e:  # noqa: BLE001 - the job's failure, reported by the stage process
            conn.send(("error", portable(e)))
    conn.close()
    os._exit(0)  # the context, the process group and every device byte go with the process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerLost(Unavailable):
    """A multi-rank stage's worker died: the rank group restarts, as for a dead rank (the caller retries)."""

    restarts_group = True


class DeviceWorkerEngine(StageEngine[Spec]):
    """A `StageEngine` whose device work runs in a worker; everything else is `engine`'s.

    `engine` is the stage's engine built in the stage process (header checks, estimates, Status, request
    validation: CPU only); the worker builds `type(engine)(engine.cfg, <its own rank group>)` at each load.
    `group` is the stage process's rank group (gloo): it carries the rendezvous and the agreed cancellation."""

    def __init__(self, engine: StageEngine[Spec], group: Any, cfg: WorkerConfig):
        self.engine = engine
        self.group = group
        self.wcfg = cfg
        self.name = engine.name
        self.spawn_s = 0.0        # the last worker's start (process, imports, device, engine): part of the load
        self.start_parts: dict[str, float] = {}  # where spawn_s went: standby wait, device, engine
        self._proc = None
        self._conn = None
        self._standby = None      # (process, channel, ready?): the next turn's worker, imports done, no device
        self._closed = False
        self._bytes = 0
        self._report: dict = {}   # what the worker's engine said of the last load (its `load_report`)
        self._lost = False
        self._loads = 0
        # Checkpoint files kept in host memory between turns, when the host has room (stagekit/host_copy.py). One
        # rank: each rank of a group would hold a whole copy of its files.
        self.host_copies = HostCopies(self.name) if engine.weight_files() and group.world_size == 1 else None
        atexit.register(self.close)

    def __getattr__(self, item: str) -> Any:  # request checks and Status are the stage engine's own
        return getattr(self.__dict__["engine"], item)

    @property
    def pid(self) -> int | None:
        """The running worker's pid (None when no worker runs)."""
        return self._proc.pid if self._proc is not None else None

    # ---- Engine -------------------------------------------------------------------------------------------------
    def load(self, source: WeightSource) -> None:
        self._load(None, source.files)

    def load_for(self, spec: Spec, source: WeightSource) -> None:
        self._load(spec, source.files)

    def resident_bytes(self) -> int:
        return self._bytes if self._proc is not None else 0

    # The stage engine's own answers (it is built in the stage process, from the headers: CPU only).
    def estimate_peak_bytes(self, spec: Spec | None, inputs: dict) -> int | None:
        return self.engine.estimate_peak_bytes(spec, inputs)

    def weight_bytes(self) -> int | None:
        return self.engine.weight_bytes()

    def weight_files(self, spec: Spec | None = None, inputs: Mapping[str, Any] | None = None) -> tuple[Path, ...]:
        return self.engine.weight_files(spec, inputs)

    def derived_copies(self, files: tuple[Path, ...]) -> dict[str, int]:
        return self.engine.derived_copies(files)

    def on_result(self, spec: Spec, result: dict) -> None:
        self.engine.on_result(spec, result)

    def load_report(self) -> dict:
        """The worker's start (part of the load), the host copies' bytes, then the worker's engine's own report."""
        report = {"worker_start_s": self.spawn_s, "worker_start": self.start_parts}
        if self.host_copies is not None:
            report["host_copy_bytes"] = self.host_copies.nbytes
        return {**report, **self._report}

    def describe(self) -> dict:
        """The stage engine's Status fields, with the host-copy choice added to its kernel rows."""
        d = dict(self.engine.describe())
        if self.host_copies is not None:
            d["kernels"] = [*d.get("kernels", []), self.host_copies.status_row()]
        return d

    def prepare(self) -> None:
        """Start the next turn's worker now, on standby: its interpreter and imports (the bulk of a worker's start)
        happen while the stage is idle or waits for the devices. It touches no device, so it holds nothing of the
        card."""
        if self._standby is None and not self._closed:
            self._standby = (*self._start_process(), False)

    def close(self) -> None:
        """Stop the standby worker and free the host copies (the stage process is ending)."""
        self._closed = True
        standby, self._standby = self._standby, None
        if standby is not None:  # it holds no device state and nothing of ours: it can just go
            proc, conn, _ = standby
            conn.close()
            proc.kill()
            proc.join()
        if self.host_copies is not None:
            self.host_copies.release()

    def lost(self) -> bool:
        """True after the worker died: the runtime unloads, and the next job loads afresh."""
        return self._lost

    def unload(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        t0 = time.monotonic()
        try:
            conn.send(("exit",))
        except OSError:  # already gone
            pass
        proc.join(timeout=self.wcfg.join_timeout_s)
        if proc.is_alive():
            log.error("%s device worker (pid %d) did not exit within %.0f s of unload; killing it", self.name,
                      proc.pid, self.wcfg.join_timeout_s)
            proc.kill()
            proc.join()
        conn.close()
        self._proc = self._conn = None
        self._bytes = 0
        self._lost = False
        log.info("%s device worker (pid %d) exited in %.2f s (%s)", self.name, proc.pid, time.monotonic() - t0,
                 exit_text(proc.exitcode))
        self.prepare()

    def run(self, spec: Spec, inputs: dict, ctx: Any) -> dict:
        if self._proc is None:
            raise Unavailable(f"{self.name}: no device worker runs (not loaded)")
        self._send(("run", spec, inputs))
        try:
            kind, value = self._serve_job(ctx)
        except Unavailable:  # a lost worker (WorkerLost) included
            raise
        except BaseException:
            if self._proc is not None and self._proc.is_alive():
                # The stage process failed while its worker waits for an answer (a broken rank group): the worker's
                # state is unknown, so it goes; the next job loads afresh.
                self._proc.kill()
                self._lost = True
            raise
        if kind == "error":
            raise value  # the job's own failure, raised in the worker, which waits for the next command
        return value

    def _serve_job(self, ctx: Any) -> tuple[str, Any]:
        """Answer the worker's context calls until it reports the job's outcome: ("done", outputs) or ("error", e)."""
        while True:
            msg = self._recv()
            kind = msg[0]
            if kind == "progress":
                ctx.progress(*msg[1])
            elif kind == "should_stop":
                self._send(ctx.should_stop())
            elif kind in ("check_cancel", "check_cancel_local"):
                try:
                    getattr(ctx, kind)()
                    self._send(None)
                except StageError as e:
                    self._send(e)
            elif kind == "done":
                self._bytes = msg[2]
                if msg[3] is not None:  # what Status shows of the last job (worker_state / set_worker_state)
                    self.engine.set_worker_state(msg[3])
                return "done", msg[1]
            else:
                return "error", msg[1]

    # ---- the worker -------------------------------------------------------------------------------------------------
    def _load(self, spec: Spec | None, files: tuple[Path, ...]) -> None:
        rendezvous = None
        if self.group.world_size > 1:
            # First, before anything can fail: every rank's stage process is in this broadcast.
            host = self.group.info.master_addr
            rendezvous = self.group.broadcast_command((host, _free_port(), f"worker-{os.getpid()}-{self._loads}")
                                                      if self.group.info.is_leader else None)
        self._loads += 1
        if self._proc is None:
            self._spawn(rendezvous)
        copies, to_fill = {}, {}
        if self.host_copies is not None:
            derived = self.engine.derived_copies(files)
            copies = self.host_copies.ensure(list(files), derived)
            to_fill = self.host_copies.to_fill(list(derived)) if copies else {}
        self._send(("load", spec, files, copies, to_fill))
        kind, value = self._recv()
        if kind == "error":
            raise value
        self._bytes, self._report, filled = value
        if filled:
            self.host_copies.filled(filled)

    def _start_process(self):
        ours, theirs = spawn_context().Pipe()
        # The copies the next load will read, when the stage holds them already (from its second turn on): the
        # worker maps them and faults their pages in while on standby.
        copies = self.host_copies.held(self.engine.weight_files()) if self.host_copies is not None else {}
        proc = spawn_context().Process(target=_worker_main, name=f"{self.name}-worker",
                                  args=(theirs, type(self.engine), self.engine.cfg, self.wcfg, copies))
        proc.start()
        theirs.close()
        return proc, Channel(ours)

    def _spawn(self, rendezvous) -> None:
        """Make the standby worker (or a new one) this turn's: wait for its imports, then start its device."""
        t0 = time.monotonic()
        standby, self._standby = self._standby, None
        if standby is not None and not standby[0].is_alive():
            standby[1].close()
            standby = None
        proc, conn, ready = standby if standby is not None else (*self._start_process(), False)
        self._proc, self._conn = proc, conn
        if not ready:
            kind, value = self._recv()  # ("standby", None): interpreter and imports done
            if kind == "error":
                raise value
        t1 = time.monotonic()
        self._send(("start", rendezvous))
        kind, value = self._recv()
        if kind == "error":
            raise value
        self.spawn_s = time.monotonic() - t0
        self.start_parts = {"standby_wait_s": round(t1 - t0, 3), **{k: round(v, 3) for k, v in value.items()}}
        log.info("%s device worker (pid %d, rank %d, %s) started in %.2f s (%s, %s)", self.name, proc.pid,
                 self.wcfg.rank, self.wcfg.device, self.spawn_s,
                 "prepared" if standby is not None else "spawned now",
                 ", ".join(f"{k} {v:.2f}" for k, v in self.start_parts.items()))

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except OSError as e:
            log.error("%s: sending to the device worker failed (%r)", self.name, e)
            raise self._died() from None

    def _recv(self):
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                break
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            if self._proc.is_alive():  # the connection broke under a live worker: it cannot be trusted any more
                log.error("%s: reading from the device worker failed (%r); stopping it", self.name, e)
                self._proc.kill()
            raise self._died() from None

    def _died(self) -> BaseException:
        proc = self._proc
        proc.join(timeout=5)
        self._lost = True
        what = (f"{self.name}: its device worker (pid {proc.pid}, rank {self.wcfg.rank}) died "
                f"({exit_text(proc.exitcode)})")
        log.error("%s", what)
        if self.group.world_size > 1:
            if not self.group.info.is_leader:  # a dead worker is a dead rank: the group restarts (torchrun)
                log.error("rank %d leaves its group so that it restarts", self.group.info.rank)
                os._exit(70)
            return WorkerLost(f"{what}; the rank group restarts")
        return Unavailable(f"{what}; this job failed on the server, the stage loads again for the next one: retry it")
