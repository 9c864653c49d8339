"""Process entry shared by all stages: ranks, lease, runtime, gRPC server, drain.

    python -m dit_svc --port 50052                         # one rank
    torchrun --nproc-per-node 2 -m dit_svc --port 50052    # rank 0 serves, rank 1 follows
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import grpc

from stagekit.budget import BudgetConfig, MemoryBudget, resolve_budget_bytes
from stagekit.device_worker import DeviceWorkerEngine, WorkerConfig, wanted
from stagekit.dist import RankGroup, RankInfo, rank_info_from_env
from stagekit.engine import StageEngine
from stagekit.hosts import GroupBudget, GroupLease, HostResources, NodeInfo, RemoteHosts, host_key, plan_hosts
from stagekit.bootstrap import LOG_LEVELS, Listeners, ProcessTempDir, exit_cleanly, listen, setup_logging
from stagekit.lease import DeviceLease, LeaseConfig, RankHold
from stagekit.procs import die_with_parent
from stagekit.runtime import RESIDENCIES, RuntimeConfig, StageRuntime, follower_loop
from stagekit.server import ServeConfig, startup_errors

log = logging.getLogger("stagekit.stage")

# --dtype spellings -> the torch dtype's name ("": bf16 on a GPU, fp32 on the CPU).
DTYPES = MappingProxyType({"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                           "float32": "float32", "fp32": "float32"})


@dataclass(frozen=True)
class CommonConfig(ServeConfig):
    """Settings every stage has (stage configs subclass this)."""

    devices: list[str] = field(default_factory=list, metadata={
        "help": "devices per rank, comma-separated ('cuda:0,cuda:1', or virtual 'virt0' on CPU); default: cuda:LOCAL_RANK or cpu"})
    cpu_cores: str = field(default="", metadata={
        "help": "CPU cores this stage computes on, a Linux CPU list ('0-4', '5,6'): the process's affinity, and torch's "
                "CPU threads set to their count; default: every core, torch's default threads. Stages on virtual "
                "devices of one machine get disjoint sets, so that each virtual device is its own share of it"})
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
    log_level: str = field(default="INFO", metadata={"choices": LOG_LEVELS, "help": "logging level"})
    gpu_memory_cap_gb: float = field(default=0.0, metadata={
        "help": "hard per-process cap on CUDA memory (GiB), e.g. 22 to prove a 22 GB card suffices; 0 = none"})
    run_temp_dir: str = field(default="", metadata={
        "set_by": "run_stage (rank 0): this process's own temp directory (see ProcessTempDir); not a flag"})

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

    def node_devices(self, info: RankInfo) -> list[str]:
        """The devices this node's ranks use (its host's lease and budget cover all of them)."""
        if self.devices:
            return list(self.devices)
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(info.local_world_size)]
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


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (the kernel's CPU list format, as in /sys/devices/system/cpu/online)."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"--cpu-cores {text!r}: {part.strip()!r} is not a core number or a range like 0-3")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def pin_cpu_cores(text: str) -> list[int]:
    """Run this process (and the processes it starts) on the cores `text` names, with as many torch CPU threads;
    returns them ([] with no `text`: every core, torch's default threads). A virtual device is then a share of the
    machine rather than all of it: stages on other virtual devices compute on other cores."""
    if not text:
        return []
    try:
        cores = parse_cpu_list(text)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--cpu-cores needs Linux (sched_setaffinity); leave it out on this system")
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cores) - allowed):
        raise SystemExit(f"--cpu-cores {text!r}: cores {missing} are not available to this process "
                         f"(available: {','.join(map(str, sorted(allowed)))})")
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(len(cores))  # device workers, subprocesses
    import torch

    torch.set_num_threads(len(cores))
    return cores


def followers_ignore_term(is_leader: bool) -> None:
    """Ranks > 0 ignore SIGTERM/SIGINT. torchrun forwards a SIGTERM to every rank, but only rank 0 decides when
    the group stops: it drains (finishes or cancels the running job), then broadcasts exit to the followers. A
    follower dying on the signal first would break the in-flight job's collectives."""
    if not is_leader:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def run_stage(cfg: CommonConfig, stage: str, make_engine: Callable[[CommonConfig, RankInfo, RankGroup], StageEngine],
              service_name: str, add_servicer: Callable[[grpc.Server, StageRuntime, CommonConfig], None]) -> None:
    setup_logging(cfg.log_level, stage)
    if cores := pin_cpu_cores(cfg.cpu_cores):
        log.info("%s: on CPU cores %s, %d torch threads", stage, cfg.cpu_cores, len(cores))
    info = rank_info_from_env()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by a torchrun agent
        die_with_parent("this rank")
    followers_ignore_term(info.is_leader)
    temp = None
    if info.is_leader:
        with startup_errors(stage):
            temp = ProcessTempDir(Path(cfg.temp_dir or tempfile.gettempdir()), stage)
        cfg = dataclasses.replace(cfg, run_temp_dir=str(temp.path))
    try:
        with startup_errors(stage):
            up = _start(cfg, stage, info, make_engine, service_name, add_servicer)
    except BaseException:
        if temp is not None:
            temp.remove()
        raise
    if up.listeners is None:
        follower_loop(up.engine, up.group, up.hold, up.host)
    else:
        up.listeners.run_until_terminated(up.runtime.shutdown)
    up.group.close()
    if temp is not None:
        temp.remove()
    exit_cleanly()


@dataclass
class _Started:
    group: RankGroup
    engine: StageEngine
    runtime: StageRuntime | None = None  # leader only
    listeners: Listeners | None = None
    hold: RankHold | None = None         # followers: their claim on their own device (exclusive mode)
    host: HostResources | None = None    # other nodes' first ranks: their host's lease and budget


def _start(cfg: CommonConfig, stage: str, info: RankInfo, make_engine, service_name: str, add_servicer):
    """Everything up to serving: listeners (rank 0), device, rank group, engine, lease, budget, runtime, serving
    (followers stop after the engine: rank 0 drives them)."""
    device = cfg.device_for_rank(info)
    # 1. Rank 0 binds its ports first (docs/reliability.md, "One listener per port"): a taken port refuses the start
    #    before any device, rank-group or engine work, and the bound gRPC port is held until it serves.
    listeners = listen(cfg, stage, service_name, device) if info.is_leader else None
    # 2. Rank group. The stage process never initialises CUDA (docs/residency.md, "What an idle stage holds"): on a
    #    GPU its device work runs in a device worker that lives only while it holds weights, so its own group is
    #    gloo (control, and the agreed cancellation); the workers form their own NCCL group at each load.
    if device.startswith("cuda"):
        import torch

        if torch.version.cuda is None:  # a CPU build of torch: say so now, not `_cuda_setDevice` at the first load
            raise SystemExit(f"{stage}: cannot start: --devices {device}, but torch {torch.__version__} is the CPU "
                             "build; run scripts/setup.sh --cuda (python -m client doctor shows what this machine has)")
    group = RankGroup(info, "gloo", cfg.collective_timeout_s)
    # Rank 0 learns which ranks share its node: it kills them when the group breaks (StageRuntime.follower_pids).
    ranks = group.gather_objects((info.node_rank, os.getpid()))
    who = f"{stage}@pid{os.getpid()}"
    # 3. This rank's device hold and its engine.
    hold = None
    if cfg.residency == "exclusive":
        hold = RankHold(cfg.lease_device_for_rank(info), Path(cfg.lease_dir), f"{stage} rank {info.rank}")
    engine = make_engine(cfg, info, group)
    device_work = engine.device_work
    if wanted(device) and device_work:  # an engine with no device work stays in-process
        engine = DeviceWorkerEngine(engine, group, WorkerConfig(
            stage, device, info.rank, info.world_size, cfg.collective_timeout_s, cfg.gpu_memory_cap_gb, cfg.log_level))
        engine.prepare()  # the first turn's worker imports while the stage starts serving
    # 4. Every host's lease and budget (stagekit/hosts.py), held by the first rank of each node: rank 0 for its
    #    own host, the other nodes' first ranks for theirs. The lease object always exists (its event log records
    #    residency in both modes); only exclusive mode takes it. The memory budget gates admission in both modes
    #    and reservations in shared mode; each host resolves its own from its own devices.
    lease = node = None
    if info.is_node_lead:
        lease = DeviceLease(cfg.node_devices(info), LeaseConfig(Path(cfg.lease_dir), who))
        node = NodeInfo(info.node_rank, host_key(cfg.lease_dir), resolve_budget_bytes(
            cfg.node_devices(info), cfg.memory_budget_gb, cfg.reserve_gb, cfg.gpu_memory_cap_gb), tuple(lease.ids))
    nodes = group.gather_objects(node)
    plan = group.broadcast_command(plan_hosts(nodes, cfg.residency == "shared", device_work)
                                   if info.is_leader else None)
    if plan.error:
        raise SystemExit(f"{stage}: cannot start: {plan.error}")
    budget = None
    if node is not None and plan.use_budget:
        budget = MemoryBudget(lease.ids, BudgetConfig(Path(cfg.lease_dir), who, node.budget_bytes,
                                                      cfg.lease_timeout_s), lease.events)
    if not info.is_leader:
        return _Started(group, engine, hold=hold, host=HostResources(node.key, lease, budget) if node else None)
    if len(plan.nodes) > 1:
        remote = RemoteHosts(group, plan.nodes, node.key)
        lease = GroupLease(lease, remote)
        budget = GroupBudget(budget, remote) if budget is not None else None
    rcfg = RuntimeConfig(max_queue=cfg.max_queue, idle_unload_s=cfg.idle_unload_s, residency=cfg.residency,
                         lease_timeout_s=cfg.lease_timeout_s, max_batch_before_yield=cfg.max_batch_before_yield)
    try:
        rcfg.validate()
    except ValueError as e:
        raise SystemExit(f"{stage}: {e}") from None
    runtime = StageRuntime(engine, group, lease, rcfg, on_health=listeners.server.set_serving, budget=budget, hold=hold,
                           follower_pids=tuple(pid for n, pid in ranks[1:] if n == info.node_rank))
    if listeners.metrics is not None:
        listeners.metrics.attach(runtime)
    # 5. Serve.
    listeners.serve(lambda s: add_servicer(s, runtime, cfg), f"ranks={info.world_size}, device={device}")
    return _Started(group, engine, runtime, listeners)
