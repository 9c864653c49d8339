"""GPU memory trace of a running deployment: sampler, residency / cap checker, plot.

A benchmark tool (benchmarks/bench_two_gpu.py, benchmarks/one_card.py): it names each process by the stage module
it runs (`STAGE_MODULES`), so it lives with the benchmarks of this deployment, not in the serving kit.

The 22 GB rule (docs/residency.md, docs/two_cards.md): on each GPU the memory of all our processes together --
every CUDA context included -- stays under the card's size at every instant, and at each instant only one stage
holds weights on a GPU. This module proves it from the outside, the way `nvidia-smi` sees it:

* `MemorySampler` reads, every `period_s` (0.25 s), each GPU's per-process used memory (NVML, through
  `nvml_reader`; any callable with the same shape works, so the logic runs without a GPU), names each process by
  its stage (`role_of`: the module in its command line, or the `--port-file` stem when one stage runs twice, e.g.
  `dit_tp1`), and every `host_every` samples the host memory (RSS and PSS) of all our processes together. Samples
  carry a phase label the caller sets (`rule:...` phases are the ones held to the cap).
* `check_trace` applies the rule to the samples: per GPU, the sum over processes never above the cap in a rule
  phase, and never two roles above their "holds weights" threshold at once (a role's idle footprint -- CUDA
  context, NCCL buffers -- plus a margin; `idle_baseline` measures the footprint while nothing is loaded).
  `check_events` checks the same invariant from the stages' own event log (load_start .. unloaded intervals).
* `summarize` is the plot-free per-phase summary; `plot_trace` draws memory over time per GPU, stacked by stage,
  with the cap and the stage turns marked (matplotlib imported lazily, Agg backend).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2**30
STAGE_MODULES = {"encoder_svc": "encoder", "dit_svc": "dit", "decoder_svc": "decoder", "render_svc": "render"}
STAGE_COLORS = {"encoder": "#1f77b4", "dit": "#ff7f0e", "decoder": "#2ca02c", "render": "#9467bd"}
OTHER = "other"
RULE_PREFIX = "rule"  # phases whose samples are held to the cap

# (gpu index -> [(pid, used bytes)], gpu index -> device-reported used bytes)
GpuReading = tuple[dict[int, list[tuple[int, int]]], dict[int, int]]


# ================================================================================================================
# Samples
# ================================================================================================================


@dataclass(frozen=True)
class ProcMem:
    pid: int
    role: str
    bytes: int


@dataclass
class Sample:
    t: float                                   # time.time()
    phase: str
    gpus: dict[int, list[ProcMem]]             # GPU index -> processes on it
    device_used: dict[int, int] = field(default_factory=dict)  # what the device reports (incl. driver reserve)
    host_rss: int | None = None                # all our processes together (None: not sampled this time)
    host_pss: int | None = None

    def gpu_sum(self, gpu: int) -> int:
        return sum(p.bytes for p in self.gpus.get(gpu, ()))

    def to_json(self) -> dict:
        d = asdict(self)
        d["gpus"] = {str(g): [[p.pid, p.role, p.bytes] for p in procs] for g, procs in self.gpus.items()}
        d["device_used"] = {str(g): b for g, b in self.device_used.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Sample":
        return cls(t=d["t"], phase=d["phase"],
                   gpus={int(g): [ProcMem(int(p), r, int(b)) for p, r, b in procs] for g, procs in d["gpus"].items()},
                   device_used={int(g): int(b) for g, b in d.get("device_used", {}).items()},
                   host_rss=d.get("host_rss"), host_pss=d.get("host_pss"))


def stage_of(role: str) -> str:
    """'dit_tp1' -> 'dit'; roles that are no stage -> 'other'."""
    for stage in STAGE_COLORS:
        if role == stage or role.startswith(stage + "_"):
            return stage
    return OTHER


def role_of(cmdline: list[str]) -> str:
    """A process's role from its command line: the stage module it runs ('dit'), or the stem of its `--port-file`
    when that names a variant of the stage ('dit_tp1'); 'other' for anything else."""
    stage = next((s for mod, s in STAGE_MODULES.items() if any(a == mod or a.endswith("/" + mod) for a in cmdline)),
                 None)
    if stage is None:
        return OTHER
    for i, a in enumerate(cmdline):
        value = cmdline[i + 1] if a == "--port-file" and i + 1 < len(cmdline) else (
            a.split("=", 1)[1] if a.startswith("--port-file=") else None)
        if value:
            stem = Path(value).name.split(".")[0]
            if stem.startswith(stage + "_"):
                return stem
    return stage


def read_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def parent_pid(pid: int) -> int:
    """The parent of `pid` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def role_of_pid(pid: int) -> str:
    """A process's role: from its own command line, else from its parent's (a stage's device worker is a child
    process whose command line names no module)."""
    role = role_of(read_cmdline(pid))
    if role == OTHER:
        parent = parent_pid(pid)
        if parent > 1:
            role = role_of(read_cmdline(parent))
    return role


def our_pids(markers: Iterable[str]) -> list[int]:
    """Pids of live processes whose command line contains one of `markers` (e.g. the stage modules), and their
    children (device workers)."""
    markers = tuple(markers)
    out, parents = [], {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            cmd = " ".join(read_cmdline(pid))
            if cmd and any(m in cmd for m in markers):
                out.append(pid)
            else:
                parents[pid] = parent_pid(pid)
    ours = set(out)
    out += [pid for pid, parent in parents.items() if parent in ours]
    return out


def host_memory(pids: Iterable[int]) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over `pids` (Linux /proc; vanished processes count 0). PSS splits pages
    shared between processes (the mmap'd checkpoint files), so its sum is what they hold together."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return rss, pss


def nvml_reader() -> Callable[[], GpuReading]:
    """A reader of every GPU's per-process used memory through NVML (`nvidia-ml-py`, imported here)."""
    import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def read() -> GpuReading:
        procs, used = {}, {}
        for i, h in enumerate(handles):
            seen: dict[int, int] = {}
            try:
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    seen[p.pid] = seen.get(p.pid, 0) + int(p.usedGpuMemory or 0)
            except pynvml.NVMLError:
                pass  # no per-process numbers here: the device's total still comes back (check_trace flags it)
            procs[i] = sorted(seen.items())
            used[i] = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        return procs, used

    return read


class MemorySampler(threading.Thread):
    """Samples `read_gpus()` every `period_s` (and host memory every `host_every` samples) until `stop()`.

    Each sample is appended to `samples` and, if `sink` is given, written to it as a JSON line at once (so a run
    killed at its time limit still leaves its trace). `phase` is whatever the caller last set."""

    def __init__(self, read_gpus: Callable[[], GpuReading], period_s: float = 0.25, host_every: int = 4,
                 host_pids: Callable[[], list[int]] | None = None, sink: Path | None = None,
                 role: Callable[[int], str] | None = None):
        super().__init__(name="memtrace", daemon=True)
        self.read_gpus = read_gpus
        self.period_s = period_s
        self.host_every = max(1, host_every)
        self.host_pids = host_pids
        self.sink = open(sink, "a") if sink is not None else None
        self._role = role or role_of_pid
        self._roles: dict[int, str] = {}
        self.phase = "start"
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop_evt = threading.Event()

    def role(self, pid: int) -> str:
        if pid not in self._roles:
            self._roles[pid] = self._role(pid)
        return self._roles[pid]

    def sample_once(self, with_host: bool = True) -> Sample:
        procs, used = self.read_gpus()
        s = Sample(time.time(), self.phase,
                   {g: [ProcMem(pid, self.role(pid), b) for pid, b in lst] for g, lst in procs.items()}, used)
        if with_host and self.host_pids is not None:
            s.host_rss, s.host_pss = host_memory(self.host_pids())
        self.samples.append(s)
        if self.sink is not None:
            self.sink.write(json.dumps(s.to_json()) + "\n")
            self.sink.flush()
        return s

    def run(self) -> None:
        n = 0
        while not self._stop_evt.is_set():
            t0 = time.monotonic()
            try:
                self.sample_once(with_host=n % self.host_every == 0)
            except Exception as e:  # noqa: BLE001 - a failed read is recorded, the trace goes on
                if len(self.errors) < 20:
                    self.errors.append(f"{type(e).__name__}: {e}")
            n += 1
            self._stop_evt.wait(max(0.0, self.period_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop_evt.set()
        if self.is_alive():
            self.join(timeout=5)
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def load_samples(path: Path) -> list[Sample]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        return [Sample.from_json(json.loads(line)) for line in fh if line.strip()]


def compress(path: Path) -> Path:
    """path -> path.gz (the original removed)."""
    out = Path(str(path) + ".gz")
    with open(path, "rb") as src, gzip.open(out, "wb", compresslevel=9) as dst:
        dst.write(src.read())
    path.unlink()
    return out


# ================================================================================================================
# Checks
# ================================================================================================================


def is_rule_phase(phase: str) -> bool:
    return phase == RULE_PREFIX or phase.startswith(RULE_PREFIX + ":")


def idle_baseline(samples: Iterable[Sample]) -> dict[str, dict[int, int]]:
    """role -> GPU -> the largest footprint seen in `samples` (take them while no stage has loaded anything: the
    bare CUDA context plus whatever the process keeps when idle)."""
    out: dict[str, dict[int, int]] = {}
    for s in samples:
        for g, procs in s.gpus.items():
            for p in procs:
                d = out.setdefault(p.role, {})
                d[g] = max(d.get(g, 0), p.bytes)
    return out


@dataclass
class HoldRule:
    """When does a process 'hold weights' on a GPU: above its idle footprint (measured, else `context_bytes`)
    by more than `margin_bytes`."""

    context_bytes: int = GIB // 2
    margin_bytes: int = 3 * GIB // 2
    baseline: dict[str, dict[int, int]] = field(default_factory=dict)

    def threshold(self, role: str, gpu: int) -> int:
        return max(self.baseline.get(role, {}).get(gpu, 0), self.context_bytes) + self.margin_bytes

    def holders(self, s: Sample, gpu: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in s.gpus.get(gpu, ()):
            if p.role != OTHER and p.bytes > self.threshold(p.role, gpu):
                out[p.role] = out.get(p.role, 0) + p.bytes
        return out


@dataclass
class TraceCheck:
    cap_bytes: int
    samples: int
    rule_samples: int
    max_sum: dict[int, int]                     # per GPU, over rule phases
    max_sum_at: dict[int, dict]                 # when and what made that maximum
    max_sum_any_phase: dict[int, int]
    over_cap: list[dict]                        # rule-phase samples above the cap (first few)
    co_resident: list[dict]                     # samples with two weight holders on one GPU (first few)
    over_cap_count: int
    co_resident_count: int
    holders_seen: dict[int, list[str]]
    turns: dict[int, int]                       # holder changes per GPU
    max_device_used: dict[int, int] = field(default_factory=dict)  # what the device reported, over rule phases

    @property
    def attribution_ok(self) -> bool:
        """Per-process numbers account for the device's use (NVML can report processes without their memory)."""
        return all(self.max_sum.get(g, 0) >= used // 2 for g, used in self.max_device_used.items() if used > GIB)

    @property
    def ok(self) -> bool:
        return (self.over_cap_count == 0 and self.co_resident_count == 0 and self.rule_samples > 0
                and self.attribution_ok)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["attribution_ok"] = self.attribution_ok
        d["max_device_used_gib"] = {g: round(b / GIB, 3) for g, b in self.max_device_used.items()}
        d["cap_gib"] = self.cap_bytes / GIB
        d["max_sum_gib"] = {g: round(b / GIB, 3) for g, b in self.max_sum.items()}
        d["max_sum_any_phase_gib"] = {g: round(b / GIB, 3) for g, b in self.max_sum_any_phase.items()}
        return d


def _procs_gib(s: Sample, gpu: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in s.gpus.get(gpu, ()):
        key = f"{p.role}:{p.pid}"
        out[key] = round(out.get(key, 0) + p.bytes / GIB, 3)
    return out


def check_trace(samples: list[Sample], cap_bytes: int, hold: HoldRule | None = None,
                rule_phase: Callable[[str], bool] = is_rule_phase, keep: int = 10) -> TraceCheck:
    """Apply the 22 GB rule to a trace: in rule phases the per-GPU sum never above `cap_bytes`; in every phase
    never two roles holding weights on one GPU at once."""
    hold = hold or HoldRule()
    max_sum: dict[int, int] = {}
    max_at: dict[int, dict] = {}
    max_any: dict[int, int] = {}
    max_used: dict[int, int] = {}
    over, co = [], []
    n_over = n_co = n_rule = 0
    seen: dict[int, set[str]] = {}
    turns: dict[int, int] = {}
    last: dict[int, frozenset[str]] = {}
    for s in samples:
        in_rule = rule_phase(s.phase)
        n_rule += in_rule
        for g in s.gpus:
            total = s.gpu_sum(g)
            max_any[g] = max(max_any.get(g, 0), total)
            if in_rule:
                max_used[g] = max(max_used.get(g, 0), s.device_used.get(g, 0))
                if total > max_sum.get(g, -1):
                    max_sum[g] = total
                    max_at[g] = {"t": s.t, "phase": s.phase, "procs_gib": _procs_gib(s, g)}
                if total > cap_bytes:
                    n_over += 1
                    if len(over) < keep:
                        over.append({"t": s.t, "gpu": g, "phase": s.phase, "sum_gib": round(total / GIB, 3),
                                     "procs_gib": _procs_gib(s, g)})
            holders = hold.holders(s, g)
            seen.setdefault(g, set()).update(holders)
            if len(holders) > 1:
                n_co += 1
                if len(co) < keep:
                    co.append({"t": s.t, "gpu": g, "phase": s.phase,
                               "holders_gib": {r: round(b / GIB, 3) for r, b in holders.items()}})
            key = frozenset(holders)
            if g in last and key != last[g]:
                turns[g] = turns.get(g, 0) + 1
            last[g] = key
    return TraceCheck(cap_bytes, len(samples), n_rule, max_sum, max_at, max_any, over, co, n_over, n_co,
                      {g: sorted(r) for g, r in seen.items()}, turns, max_used)


def residency_intervals(events: Iterable[Mapping]) -> list[dict]:
    """Weight residencies from the stages' event log: [load_start, unloaded] per holder and device set (a holder
    still resident at the end of the log gets end=None)."""
    open_: dict[str, dict] = {}
    out = []
    for ev in sorted(events, key=lambda e: e["t"]):
        who = ev.get("holder", "")
        if ev.get("event") == "load_start":
            open_[who] = {"holder": who, "stage": ev.get("stage", ""), "devices": list(ev.get("devices", [])),
                          "start": ev["t"], "end": None}
        elif ev.get("event") == "unloaded" and who in open_:
            iv = open_.pop(who)
            iv["end"] = ev["t"]
            out.append(iv)
    out.extend(open_.values())
    return sorted(out, key=lambda iv: iv["start"])


def check_events(events: Iterable[Mapping]) -> list[dict]:
    """Overlapping residencies of two holders on one device, from the event log (empty list: the invariant held)."""
    ivs = residency_intervals(events)
    bad = []
    for i, a in enumerate(ivs):
        for b in ivs[i + 1:]:
            a_end = a["end"] if a["end"] is not None else float("inf")
            if b["start"] >= a_end:
                continue
            shared = sorted(set(a["devices"]) & set(b["devices"]))
            if shared and a["holder"] != b["holder"]:
                bad.append({"devices": shared, "a": a["holder"], "b": b["holder"], "at": b["start"]})
    return bad


# ================================================================================================================
# Summary and plot
# ================================================================================================================


def check_idle_neighbours(samples: Iterable[Sample], limit_bytes: int,
                          rule_phase: Callable[[str], bool] = is_rule_phase) -> dict:
    """On a card shared by stages taking turns: per GPU, the most that any role other than the one holding the most
    held at one sample (rule phases only), and whether it stayed within `limit_bytes` throughout."""
    worst: dict[int, int] = {}
    where: dict[int, str] = {}
    for s in samples:
        if not rule_phase(s.phase):
            continue
        for g, procs in s.gpus.items():
            by_role: dict[str, int] = {}
            for p in procs:
                by_role[p.role] = by_role.get(p.role, 0) + p.bytes
            if len(by_role) < 2:
                worst.setdefault(g, 0)
                continue
            holder = max(by_role, key=by_role.get)
            for role, b in by_role.items():
                if role != holder and b > worst.get(g, 0):
                    worst[g] = b
                    where[g] = f"{role} {b / GIB:.2f} GiB while {holder} held {by_role[holder] / GIB:.2f} GiB ({s.phase})"
    return {"max_gib": {g: round(b / GIB, 3) for g, b in worst.items()}, "at": where,
            "limit_gib": round(limit_bytes / GIB, 3), "ok": all(b <= limit_bytes for b in worst.values())}


def summarize(samples: list[Sample]) -> dict[str, dict]:
    """Per phase (in order of first appearance): duration, per-GPU peak sum and per-role peak, host peaks."""
    out: dict[str, dict] = {}
    for s in samples:
        d = out.setdefault(s.phase, {"start": s.t, "end": s.t, "samples": 0, "gpu_peak_gib": {},
                                     "role_peak_gib": {}, "host_rss_peak_gib": None, "host_pss_peak_gib": None})
        d["end"] = s.t
        d["samples"] += 1
        for g, procs in s.gpus.items():
            d["gpu_peak_gib"][g] = max(d["gpu_peak_gib"].get(g, 0.0), round(s.gpu_sum(g) / GIB, 3))
            for p in procs:
                k = f"{p.role}@gpu{g}"
                d["role_peak_gib"][k] = max(d["role_peak_gib"].get(k, 0.0), round(p.bytes / GIB, 3))
        for attr in ("host_rss", "host_pss"):
            v = getattr(s, attr)
            if v is not None:
                key = f"{attr}_peak_gib"
                d[key] = max(d[key] or 0.0, round(v / GIB, 3))
    for d in out.values():
        d["duration_s"] = round(d.pop("end") - d["start"], 2)
    return out


def plot_trace(samples: list[Sample], path: Path, cap_bytes: int, title: str = "",
               hold: HoldRule | None = None, turns: list[tuple[float, str]] | None = None,
               rule_phase: Callable[[str], bool] = is_rule_phase) -> Path:
    """PNG: one panel per GPU, memory (GiB) over time stacked by role and coloured by stage, the cap as a red line,
    rule phases shaded, and stage turns (holder changes, or the given (time, label) marks) as dotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hold = hold or HoldRule()
    gpus = sorted({g for s in samples for g in s.gpus})
    t0 = samples[0].t if samples else 0.0
    ts = [s.t - t0 for s in samples]
    roles = sorted({p.role for s in samples for procs in s.gpus.values() for p in procs},
                   key=lambda r: (list(STAGE_COLORS) + [OTHER]).index(stage_of(r)) if stage_of(r) != OTHER else 99)
    fig, axes = plt.subplots(max(1, len(gpus)), 1, figsize=(12, 3.2 * max(1, len(gpus))), sharex=True, squeeze=False)
    for ax, g in zip(axes[:, 0], gpus):
        series = []
        for r in roles:
            ys = [sum(p.bytes for p in s.gpus.get(g, ()) if p.role == r) / GIB for s in samples]
            if any(ys):
                series.append((r, ys))
        shades = ["", "//", "..", "xx"]
        for i, (r, ys) in enumerate(series):
            base = [sum(v) for v in zip(*(y for _, y in series[:i]))] if i else [0.0] * len(ys)
            top = [b + y for b, y in zip(base, ys)]
            ax.fill_between(ts, base, top, step="post", label=r, color=STAGE_COLORS.get(stage_of(r), "#7f7f7f"),
                            alpha=0.85, hatch=shades[sum(1 for q, _ in series[:i] if stage_of(q) == stage_of(r)) % 4],
                            linewidth=0)
        ax.axhline(cap_bytes / GIB, color="red", linewidth=1.2, label=f"cap {cap_bytes / GIB:g} GiB")
        # Rule phases shaded; phase names written once at their start.
        start = None
        for i, s in enumerate(samples):
            phase_changed = i == 0 or s.phase != samples[i - 1].phase
            if phase_changed:
                if start is not None:
                    ax.axvspan(start, ts[i], color="#eeeeee", zorder=0)
                    start = None
                if rule_phase(s.phase):
                    start = ts[i]
                ax.annotate(s.phase.removeprefix("rule:"), (ts[i], 1.0), xycoords=("data", "axes fraction"),
                            fontsize=6, rotation=90, va="top", ha="right", color="#555555")
        if start is not None and ts:
            ax.axvspan(start, ts[-1], color="#eeeeee", zorder=0)
        marks = turns if turns is not None else [
            (samples[i].t, "") for i in range(1, len(samples))
            if set(hold.holders(samples[i], g)) != set(hold.holders(samples[i - 1], g)) and hold.holders(samples[i], g)]
        for t, _ in marks:
            ax.axvline(t - t0, color="black", linestyle=":", linewidth=0.7)
        ax.set_ylabel(f"GPU {g} GiB")
        ax.set_ylim(0, max(cap_bytes, max((s.gpu_sum(g) for s in samples), default=0)) / GIB * 1.15)
        ax.legend(loc="upper left", fontsize=7, ncol=6)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title or "GPU memory per process, stacked by stage (shaded: phases held to the cap)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
