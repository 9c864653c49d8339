"""Process entry shared by all stages: ranks, lease, runtime, gRPC server, drain.

    python -m dit_svc --port 50052                         # one rank
    torchrun --nproc-per-node 2 -m dit_svc --port 50052    # rank 0 serves, rank 1 follows
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stagekit.budget import BudgetConfig, MemoryBudget, resolve_budget_bytes
from stagekit.device_worker import DeviceWorkerEngine, WorkerConfig, die_with_parent, wanted
from stagekit.dist import RankGroup, RankInfo, rank_info_from_env
from stagekit.lease import DeviceLease, LeaseConfig, RankHold, pid_alive
from stagekit.runtime import RESIDENCIES, Engine, RuntimeConfig, StageRuntime, follower_loop
from stagekit.server import ServeConfig, StageServer, followers_ignore_term, is_loopback, startup_errors

log = logging.getLogger("stagekit.stage")

# --dtype spellings -> the torch dtype's name ("": bf16 on a GPU, fp32 on the CPU).
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}


@dataclass
class CommonConfig(ServeConfig):
    """Settings every stage has (stage configs subclass this)."""

    devices: list[str] = field(default_factory=list, metadata={
        "help": "devices per rank, comma-separated ('cuda:0,cuda:1', or virtual 'virt0' on CPU); default: cuda:LOCAL_RANK or cpu"})
    models_dir: str = field(default="", metadata={"help": "directory with real checkpoints (default: embedded tiny model)"})
    weights: str = field(default="", metadata={"help": "explicit checkpoint path (overrides --models-dir)"})
    cache_dir: str = field(default="", metadata={"help": "where the embedded model is written (default ~/.cache/h3-stages)"})
    temp_dir: str = field(default="", metadata={
        "help": "where the stage keeps temp files (default $TMPDIR): in its own h3-<stage>-<pid> subdirectory, removed "
                "at exit; subdirectories of stages no longer running are removed at start"})
    lease_dir: str = field(default="/tmp/h3-stages-leases", metadata={"help": "host-wide device lease directory"})
    residency: str = field(default="exclusive", metadata={
        "choices": RESIDENCIES, "help": "exclusive (take turns on the GPU) | shared (stay resident)"})
    idle_unload_s: float = field(default=30.0, metadata={"help": "unload after this long idle in exclusive mode (<0: never)"})
    max_queue: int = field(default=16, metadata={"help": "queued jobs beyond this get RESOURCE_EXHAUSTED"})
    max_batch_before_yield: int = field(default=8, metadata={
        "help": "with another stage waiting for the devices, serve at most this many queued jobs before yielding"})
    lease_timeout_s: float = field(default=600.0, metadata={
        "help": "a job waiting longer than this for the device lease / budget room fails"})
    memory_budget_gb: float = field(default=0.0, metadata={
        "help": "per-device memory budget shared by all stages (GiB); 0 = device memory minus --reserve-gb on CUDA, "
                "unlimited on virtual devices. Jobs whose estimate exceeds it get RESOURCE_EXHAUSTED"})
    reserve_gb: float = field(default=1.0, metadata={
        "help": "GiB of each GPU kept out of the automatic budget (CUDA context, workspaces, other processes)"})
    collective_timeout_s: float = field(default=60.0, metadata={"help": "a dead rank fails the job after this long"})
    dtype: str = field(default="", metadata={
        "choices": ("", *DTYPES), "help": "compute dtype: bfloat16 | float16 | float32 (default: bf16 on GPU, fp32 on CPU)"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})
    gpu_memory_cap_gb: float = field(default=0.0, metadata={
        "help": "hard per-process cap on CUDA memory (GiB), e.g. 22 to prove a 22 GB card suffices; 0 = none"})
    # Set by run_stage (rank 0): this process's own temp directory (see StageTempDir); not a flag.
    run_temp_dir: str = field(default="", init=False)

    def device_for_rank(self, info: RankInfo) -> str:
        """The torch device this rank computes on (virtual lease names like 'virt0' compute on the CPU)."""
        if self.devices:
            name = self.devices[info.local_rank % len(self.devices)]
            return name if name.startswith("cuda") or name == "cpu" else "cpu"
        import torch

        return f"cuda:{info.local_rank}" if torch.cuda.is_available() else "cpu"

    def lease_device_for_rank(self, info: RankInfo) -> str:
        """The device this rank holds weights on, by its lease name ('virt0', 'cuda:1', 'cpu')."""
        if self.devices:
            return self.devices[info.local_rank % len(self.devices)]
        return self.device_for_rank(info)

    def group_devices(self, info: RankInfo) -> list[str]:
        """All devices the rank group uses (the lease covers all of them)."""
        if self.devices:
            return list(self.devices)
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(info.world_size)]
        return ["cpu"]

    def compute_dtype(self, device: str):
        import torch

        if self.dtype:
            if self.dtype not in DTYPES:
                raise SystemExit(f"--dtype {self.dtype!r}: use one of bfloat16, float16, float32")
            return getattr(torch, DTYPES[self.dtype])
        return torch.bfloat16 if device.startswith("cuda") else torch.float32

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h3-stages"


def run_stage(cfg: CommonConfig, stage: str, make_engine: Callable[[CommonConfig, RankInfo, RankGroup], Engine],
              service_name: str, add_servicer: Callable[[grpc.Server, StageRuntime], None]) -> None:
    logging.basicConfig(level=cfg.log_level.upper(), format=f"%(asctime)s {stage}[%(process)d] %(levelname)s %(message)s")
    info = rank_info_from_env()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by a torchrun agent
        die_with_parent("this rank")
    followers_ignore_term(info.is_leader)
    temp = None
    if info.is_leader:
        with startup_errors(stage):
            temp = StageTempDir(Path(cfg.temp_dir or tempfile.gettempdir()), stage)
        cfg.run_temp_dir = str(temp.path)
    try:
        with startup_errors(stage):
            up = _start(cfg, stage, info, make_engine, service_name, add_servicer)
    except BaseException:
        if temp is not None:
            temp.remove()
        raise
    if up.server is None:
        follower_loop(up.engine, up.group, up.hold)
    else:
        up.server.run_until_terminated(up.runtime)
        if up.metrics is not None:
            up.metrics.close()
    up.group.close()
    if temp is not None:
        temp.remove()
    _exit_cleanly()


class StageTempDir:
    """This process's own temp directory, `<root>/h3-<stage>-<pid>` (docs/reliability.md, "Temp files").

    The directory holds a `.owner` file locked by this process for its lifetime; at start, directories of stages
    whose lock is free (dead: crashed, killed -9) are removed, whatever the stage, so no temp file outlives the
    next start. A clean exit removes its own directory."""

    PATTERN = re.compile(r"h3-[a-z]+-(\d+)$")

    def __init__(self, root: Path, stage: str):
        root.mkdir(parents=True, exist_ok=True)
        self.swept = self.sweep(root)
        self.path = root / f"h3-{stage}-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)  # a dead process's dir under our recycled pid
        self.path.mkdir()
        self._fd = os.open(self.path / ".owner", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        if self.swept:
            log.info("removed temp dirs of stopped stages: %s", ", ".join(self.swept))

    @classmethod
    def sweep(cls, root: Path) -> list[str]:
        removed = []
        for d in root.iterdir():
            m = cls.PATTERN.match(d.name)
            if not m or not d.is_dir() or int(m.group(1)) == os.getpid():
                continue
            try:
                fd = os.open(d / ".owner", os.O_RDONLY)
            except FileNotFoundError:
                if pid_alive(int(m.group(1))):  # still being set up by a starting stage
                    continue
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live stage's
                finally:
                    os.close(fd)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        return removed

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)


@dataclass
class _Started:
    group: RankGroup
    engine: Engine
    runtime: StageRuntime | None = None  # leader only
    server: StageServer | None = None
    metrics: object | None = None
    hold: RankHold | None = None         # followers: their claim on their own device (exclusive mode)


def _start(cfg: CommonConfig, stage: str, info: RankInfo, make_engine, service_name: str, add_servicer):
    """Everything up to serving: listeners (rank 0), device, rank group, engine, lease, budget, runtime, serving
    (followers stop after the engine: rank 0 drives them)."""
    device = cfg.device_for_rank(info)
    # 1. Rank 0 binds its ports first (docs/reliability.md, "One listener per port"): a taken port refuses the start
    #    before any device, rank-group or engine work, and the bound gRPC port is held until it serves.
    server = metrics = None
    if info.is_leader:
        interceptors = []
        if cfg.metrics_port >= 0:
            from stagekit.metrics import StageMetrics

            metrics = StageMetrics(stage, device)
            interceptors.append(metrics.interceptor())
        server = StageServer(cfg, [service_name], interceptors=interceptors, label=stage)
        if metrics is not None:
            port = metrics.serve(cfg.metrics_host, cfg.metrics_port, cfg.port_file)
            scope = "loopback only; --metrics-host to expose" if is_loopback(cfg.metrics_host) else "plain HTTP, no auth"
            print(f"{stage} metrics on http://{cfg.metrics_host}:{port}/metrics ({scope})", flush=True)
    # 2. Rank group. The stage process never initialises CUDA (docs/residency.md, "What an idle stage holds"): on a
    #    GPU its device work runs in a device worker that lives only while it holds weights, so its own group is
    #    gloo (control, and the agreed cancellation); the workers form their own NCCL group at each load.
    if device.startswith("cuda"):
        import torch

        if torch.version.cuda is None:  # a CPU build of torch: say so now, not `_cuda_setDevice` at the first load
            raise SystemExit(f"{stage}: cannot start: --devices {device}, but torch {torch.__version__} is the CPU "
                             "build; run scripts/setup.sh --cuda (python -m client doctor shows what this machine has)")
    group = RankGroup(info, "gloo", cfg.collective_timeout_s)
    # Rank 0 learns which ranks share its host: it kills them when the group breaks (StageRuntime.follower_pids).
    ranks = group.gather_objects((socket.gethostname(), os.getpid()))
    who = f"{stage}@pid{os.getpid()}"
    # 3. This rank's device hold and its engine.
    hold = None
    if cfg.residency == "exclusive":
        hold = RankHold(cfg.lease_device_for_rank(info), Path(cfg.lease_dir), f"{stage} rank {info.rank}")
    engine = make_engine(cfg, info, group)
    if wanted(device) and getattr(engine, "device_work", True):  # an engine with no device work stays in-process
        engine = DeviceWorkerEngine(engine, group, WorkerConfig(
            stage, device, info.rank, info.world_size, cfg.collective_timeout_s, cfg.gpu_memory_cap_gb, cfg.log_level))
    if not info.is_leader:
        return _Started(group, engine, hold=hold)
    # 4. Rank 0: lease, budget and runtime. The lease object always exists (its event log records residency in both
    #    modes); only exclusive mode takes it. The memory budget gates admission in both modes and reservations in
    #    shared mode.
    lease = DeviceLease(cfg.group_devices(info), LeaseConfig(Path(cfg.lease_dir), who))
    budget_bytes = resolve_budget_bytes(cfg.group_devices(info), cfg.memory_budget_gb, cfg.reserve_gb,
                                        cfg.gpu_memory_cap_gb)
    budget = None
    if (cfg.residency == "shared" or budget_bytes > 0) and getattr(engine, "device_work", True):
        budget = MemoryBudget(lease.ids, BudgetConfig(Path(cfg.lease_dir), who, budget_bytes, cfg.lease_timeout_s),
                              lease.events)
    rcfg = RuntimeConfig(max_queue=cfg.max_queue, idle_unload_s=cfg.idle_unload_s, residency=cfg.residency,
                         lease_timeout_s=cfg.lease_timeout_s, max_batch_before_yield=cfg.max_batch_before_yield)
    try:
        rcfg.validate()
    except ValueError as e:
        raise SystemExit(f"{stage}: {e}") from None
    host = socket.gethostname()
    runtime = StageRuntime(engine, group, lease, rcfg, on_health=server.set_serving, budget=budget, hold=hold,
                           follower_pids=tuple(pid for h, pid in ranks[1:] if h == host))
    if metrics is not None:
        metrics.attach(runtime)
    # 5. Serve.
    server.start(lambda s: add_servicer(s, runtime))
    server.set_serving(True)
    print(f"{stage} serving on {cfg.host}:{server.port} (ranks={info.world_size}, device={device})", flush=True)
    return _Started(group, engine, runtime, server, metrics)


def _exit_cleanly() -> None:
    """Exit 0 once the drain is done, without interpreter finalisation: gRPC's and torch's native threads can
    abort the process (SIGABRT) while Python tears down modules under them, turning a clean drain into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
