"""Residency: who holds a device, proven from the host-wide event log (stagekit/lease.py `events.jsonl`).

Unit level (in-process, fake engines): the lease is dropped by the OS when its holder is `kill -9`ed, the
memory budget ledger refuses what does not fit and forgets dead reservations, health is NOT_SERVING only
while weights load, and stage batching yields to a waiting stage after `max_batch_before_yield` jobs.

Process level (real stage servers on loopback, CPU, virtual device 'virt0', tiny models at 256x256x22):
- exclusive: the real encoder, DiT and decoder; 3 concurrent clients x 2 renders each: no two stages' lease /
  load..unload intervals overlap, every job runs exactly once per stage;
- shared: stages are resident at the same time, jobs of different clients run on different stages at the
  same time, and replaying every budget reservation never exceeds the budget;
- `kill -9` of the lease holder mid-job (two DiT servers as the stages, quickest to start): the waiting stage
  takes the lease at once (well before any timeout), the client of the killed job gets UNAVAILABLE, nothing of the killed stage is
  left running;
- lifecycle RPCs through the generated stubs, idle unload, admission by memory estimate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, dit_pb2_grpc
from minimax_h3.contract import RenderSpec
from minimax_h3.services import StageClients
from render_svc.stage_calls import decode, encode, sample
from stagekit.budget import BudgetConfig, MemoryBudget
from stagekit.channels import Security, health_of, open_channel
from stagekit.dist import RankGroup, RankInfo
from stagekit.engine import StageEngine
from stagekit.errors import ResourceExhausted
from stagekit.checkpoints import WeightSource
from stagekit.lease import DeviceLease, LeaseConfig, read_events
from stagekit.runtime import Job, RuntimeConfig, StageRuntime
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=1)
TEXT = torch.randn(8, 64)  # tiny DiT text_dim = 64


# ---------------------------------------------------------------------------------------------------------------------
# Event-log checks (used by every process test)
# ---------------------------------------------------------------------------------------------------------------------
def lease_intervals(events: list[dict], dead_pids: set[int] = frozenset()) -> list[tuple[str, float, float]]:
    """(holder, acquire t, release t) per residency, checking in *log order* that no two holders hold at once.

    The log is appended while the lease is held, so its order is the order of the lock; a holder killed while
    holding (pid in dead_pids) never logs its release — the next acquire closes its interval."""
    out, cur = [], None
    for e in events:
        if e["event"] == "acquire":
            if cur is not None:
                assert cur[2] in dead_pids, f"{e['holder']} acquired while {cur[0]} still held the lease"
                out.append((cur[0], cur[1], e["t"]))
            cur = (e["holder"], e["t"], e["pid"])
        elif e["event"] == "release":
            assert cur is not None and cur[0] == e["holder"], f"release by {e['holder']} without holding"
            out.append((cur[0], cur[1], e["t"]))
            cur = None
    if cur is not None:
        out.append((cur[0], cur[1], float("inf")))
    return out


def load_intervals(events: list[dict]) -> list[tuple[str, float, float]]:
    """(holder, load_start t, unloaded t) per residency."""
    out, start = [], {}
    for e in events:
        if e["event"] == "load_start":
            start[e["holder"]] = e["t"]
        elif e["event"] == "unloaded" and e["holder"] in start:
            out.append((e["holder"], start.pop(e["holder"]), e["t"]))
    out += [(h, t, float("inf")) for h, t in start.items()]
    return out


def job_intervals(events: list[dict]) -> list[tuple[str, str, float, float]]:
    start, out = {}, []
    for e in events:
        if e["event"] == "job_start":
            start[(e["holder"], e["job"])] = e["t"]
        elif e["event"] == "job_done":
            out.append((e["holder"], e["job"], start.pop((e["holder"], e["job"])), e["t"]))
    return out


def overlapping(intervals) -> list[tuple]:
    """Pairs of intervals of different holders that overlap in time."""
    iv = sorted(intervals, key=lambda x: x[-2])
    return [(a, b) for i, a in enumerate(iv) for b in iv[i + 1:] if a[0] != b[0] and b[-2] < a[-1]]


def replay_budget(events: list[dict]) -> int:
    """Replay every reservation change per device; return the peak total (asserting the log is consistent)."""
    held: dict[str, dict[str, int]] = {}
    peak = 0
    for e in events:
        if e["event"] in ("budget_reserve", "budget_grow", "budget_shrink"):
            for d in e["devices"]:
                held.setdefault(d, {})[e["holder"]] = e["bytes"]
        elif e["event"] == "budget_release":
            for d in e["devices"]:
                held.setdefault(d, {}).pop(e["holder"], None)
        elif e["event"] == "budget_drop_dead":
            held.setdefault(e["device"], {}).pop(e["dead_holder"], None)
        else:
            continue
        for d in e["devices"] if "devices" in e else [e["device"]]:
            total = sum(held[d].values())
            if "totals" in e:
                assert e["totals"][d] == total, f"ledger total {e['totals'][d]} != replayed {total} at {e}"
            peak = max(peak, total)
    return peak


# ---------------------------------------------------------------------------------------------------------------------
# Unit level: lease, budget, runtime scheduling (in-process, fake engines)
# ---------------------------------------------------------------------------------------------------------------------
_HOLD_LEASE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from stagekit.budget import BudgetConfig, MemoryBudget
from stagekit.lease import DeviceLease, LeaseConfig
l = DeviceLease(["virt0"], LeaseConfig(Path({d!r}), "victim"))
l.acquire()
MemoryBudget(["virt0"], BudgetConfig(Path({d!r}), "victim", 100)).reserve(70)
print("held", flush=True)
time.sleep(60)
"""


def test_lease_and_budget_released_by_the_os_on_kill(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _HOLD_LEASE.format(root=str(ROOT), d=str(tmp_path))],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        mine = DeviceLease(["virt0"], LeaseConfig(tmp_path, "survivor"))
        assert "victim" in mine.holder_of("virt0")
        with pytest.raises(TimeoutError, match="held by victim"):
            mine.acquire(timeout_s=0.2)
        budget = MemoryBudget(["virt0"], BudgetConfig(tmp_path, "survivor", 100))
        with pytest.raises(ResourceExhausted, match="did not fit"):
            budget.reserve(50, timeout_s=0.2)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        mine.acquire(timeout_s=0)  # free at once (no waiting allowed): the kernel dropped the dead holder's flock
        assert mine.holder_of("virt0").startswith("survivor")
        budget.reserve(50, timeout_s=60)  # the dead stage's 70 bytes were dropped
        assert budget.usage() == {"virt0": 50}
        mine.release()
        budget.release()
        assert mine.holder_of("virt0") == ""
    finally:
        p.kill()
        p.wait()
    ev = read_events(tmp_path)
    assert any(e["event"] == "budget_drop_dead" and e["dead_holder"] == "victim" for e in ev)
    assert replay_budget(ev) <= 100


def test_budget_waits_in_line_and_admission_names_numbers(tmp_path):
    a = MemoryBudget(["virt0"], BudgetConfig(tmp_path, "a", 100))
    b = MemoryBudget(["virt0"], BudgetConfig(tmp_path, "b", 100))
    a.reserve(60)
    with pytest.raises(ResourceExhausted, match=r"needs an estimated 0\.2 KiB .* budget is 0\.1 KiB"):
        b.check_fits(200, "dit job j1")
    got = []
    t = threading.Thread(target=lambda: got.append(b.reserve(60, timeout_s=60)))
    t.start()
    wait_until(a.others_waiting, what="b to wait in line")
    assert not got
    assert not a.try_grow(50) or a.reserved == 60  # growing never waits
    a.release()
    t.join(60)
    assert got and got[0] > 0  # b waited
    assert b.usage() == {"virt0": 60}
    assert a.try_grow(40) and a.reserved == 40  # 60 + 40 fits exactly
    assert not a.try_grow(41)
    b.release()
    a.release()
    assert replay_budget(read_events(tmp_path)) <= 100


class FakeEngine(StageEngine):
    """Load waits for `load_gate` (when given); each job waits for `run_gate` (when given) and records what ran.
    Gates, not durations: a test decides when a load or a job may finish, so a busy machine changes nothing."""

    name = "fake"

    def __init__(self, est=0, load_gate: threading.Event | None = None, run_gate: threading.Event | None = None):
        self.est, self.load_gate, self.run_gate = est, load_gate, run_gate
        self.loaded = False
        self.started: list[str] = []
        self.ran: list[str] = []

    def load(self, source):
        if self.load_gate is not None:
            assert self.load_gate.wait(60), "load gate never opened"
        self.loaded = True

    def unload(self):
        self.loaded = False

    def resident_bytes(self):
        return 10 if self.loaded else 0

    def estimate_peak_bytes(self, spec, inputs):
        return self.est if spec is not None else 10

    def run(self, spec, inputs, ctx):
        self.started.append(spec)
        if self.run_gate is not None:
            assert self.run_gate.wait(60), "run gate never opened"
        self.ran.append(spec)
        return {"spec": spec}


def _runtime(tmp_path, holder, engine, **cfg):
    group = RankGroup(RankInfo(0, 1, 0), "gloo", 10)
    lease = DeviceLease(["virt0"], LeaseConfig(tmp_path, holder))
    health = []
    rt = StageRuntime(engine, group, lease, RuntimeConfig(**cfg), on_health=health.append)
    return rt, health


def _wait(job: Job, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = job.events.get(timeout=timeout)
        if ev.kind in ("done", "error"):
            return ev
    raise TimeoutError


def test_health_not_serving_only_while_loading(tmp_path):
    gate = threading.Event()
    eng = FakeEngine(load_gate=gate)
    rt, health = _runtime(tmp_path, "h", eng, idle_unload_s=-1)
    try:
        th = threading.Thread(target=rt.request, args=("load",))
        th.start()
        wait_until(lambda: rt.loading, what="the load to start")
        assert health == [False]
        gate.set()
        th.join(60)
        assert rt.resident and health == [False, True]
        rt.request("unload")
        assert not rt.resident and health == [False, True]  # unloaded-and-able is still SERVING
    finally:
        rt.shutdown(False, 2)


def test_stage_batching_yields_after_max_batch(tmp_path):
    """A has 6 queued jobs; B wants the device: B runs after at most max_batch_before_yield of A's jobs, then A
    resumes; FIFO order within each stage is preserved and each job runs exactly once."""
    gate = threading.Event()
    ea, eb = FakeEngine(run_gate=gate), FakeEngine()
    ra, _ = _runtime(tmp_path, "a", ea, idle_unload_s=-1, max_batch_before_yield=2)
    rb, _ = _runtime(tmp_path, "b", eb, idle_unload_s=-1, max_batch_before_yield=2)
    try:
        ja = [ra.submit(Job(spec=f"a{i}", inputs={})) for i in range(6)]
        wait_until(lambda: ea.started, what="A's first job to start")  # A holds the device ...
        jb = [rb.submit(Job(spec=f"b{i}", inputs={})) for i in range(2)]
        wait_until(lambda: list(tmp_path.glob("virt0.wait.*")), what="B to wait for the lease")  # ... B waits
        gate.set()
        assert all(_wait(j).kind == "done" for j in ja + jb)
        assert ea.ran == [f"a{i}" for i in range(6)] and eb.ran == ["b0", "b1"]
        ev = read_events(tmp_path)
        order = [e["holder"] for e in ev if e["event"] == "job_start"]
        assert order[:2] == ["a", "a"] and order[2:4] == ["b", "b"], order
        assert any(e["event"] == "yield" and e["holder"] == "a" and e["served"] == 2 for e in ev)
        lease_intervals(ev)
    finally:
        ra.shutdown(False, 2)
        rb.shutdown(False, 2)


def test_idle_unload_and_step_aside_when_other_waits(tmp_path):
    ea, eb = FakeEngine(), FakeEngine()
    ra, _ = _runtime(tmp_path, "a", ea, idle_unload_s=0.3)
    rb, _ = _runtime(tmp_path, "b", eb, idle_unload_s=-1)  # never unloads on its own
    try:
        assert _wait(ra.submit(Job(spec="a0", inputs={}))).kind == "done"
        wait_until(lambda: not ra.resident, what="a's idle unload")  # idle timeout
        assert _wait(rb.submit(Job(spec="b0", inputs={}))).kind == "done"
        assert rb.resident
        # b never unloads on its own: a1 runs only because idle b steps aside when a waits
        assert _wait(ra.submit(Job(spec="a1", inputs={}))).kind == "done"
        assert not rb.resident
        lease_intervals(read_events(tmp_path))
    finally:
        ra.shutdown(False, 2)
        rb.shutdown(False, 2)


class PartitionedEngine(FakeEngine):
    """Two weight files, one resident at a time (like the DiT's two partitions): a job's spec names the one it
    needs. Records the files of each load it was handed."""

    def __init__(self):
        super().__init__()
        self.loads: list[tuple[Path, ...]] = []
        self.held: tuple[Path, ...] = ()

    def weight_files(self, spec=None, inputs=None):
        return (Path(f"{(spec or 'a0')[0]}.safetensors"),)

    def load(self, source):
        self.loads.append(source.files)
        self.held = source.files
        super().load(source)

    def run(self, spec, inputs, ctx):
        assert self.held == self.weight_files(spec), "the job runs on the weights it needs"
        return super().run(spec, inputs, ctx)


def test_a_job_needing_other_weight_files_is_preceded_by_their_load(tmp_path):
    """The runtime asks the engine which files a job needs before it runs: another partition is a load (logged as
    one, the unload before it with its reason), on devices the stage keeps; jobs on the loaded files load nothing."""
    eng = PartitionedEngine()
    rt, _ = _runtime(tmp_path, "p", eng, idle_unload_s=-1)
    try:
        for spec in ("a0", "a1", "b0", "b1", "a2"):
            assert _wait(rt.submit(Job(spec=spec, inputs={}))).kind == "done"
        assert eng.ran == ["a0", "a1", "b0", "b1", "a2"]
        assert eng.loads == [(Path("a.safetensors"),), (Path("b.safetensors"),), (Path("a.safetensors"),)]
        ev = read_events(tmp_path)
        assert [e["reason"] for e in ev if e["event"] == "unload_start"] == ["files", "files"]
        assert sum(e["event"] == "loaded" for e in ev) == 3
        assert sum(e["event"] == "acquire" for e in ev) == 1, "the devices stay the stage's across the switch"
        assert rt.resident
    finally:
        rt.shutdown(False, 2)


class UnsizedEngine(FakeEngine):
    """No estimate (like the encoder), with or without a header-based `weight_bytes` (the decoder)."""

    def __init__(self, weight_bytes: int | None = None):
        super().__init__()
        self.hint = weight_bytes

    def estimate_peak_bytes(self, spec, inputs):
        return None

    def weight_bytes(self):
        return self.hint


def _shared(tmp_path, holder, engine, budget_bytes=100):
    group = RankGroup(RankInfo(0, 1, 0), "gloo", 10)
    budget = MemoryBudget(["virt0"], BudgetConfig(tmp_path, holder, budget_bytes, timeout_s=60))
    return StageRuntime(engine, group, None, RuntimeConfig(residency="shared"), budget=budget)


@pytest.mark.parametrize("hint", [True, False], ids=["weight_bytes", "no_size"])
def test_shared_stage_stays_loaded_between_jobs_unless_room_is_needed(tmp_path, hint):
    """Shared residency, two identical jobs of a sized stage (the DiT) around the first load of a stage without an
    estimate (the decoder). With the decoder's header-based `weight_bytes` its first load reserves what it needs and
    the DiT serves both jobs in one residency; without any size it must reserve the whole budget, so the idle DiT
    steps aside for it, and its unload says why in the event log."""
    dit, dec = FakeEngine(est=50), UnsizedEngine(10 if hint else None)
    rd, rv = _shared(tmp_path, "dit", dit), _shared(tmp_path, "decoder", dec)
    try:
        assert _wait(rd.submit(Job(spec="d0", inputs={}))).kind == "done"
        assert _wait(rv.submit(Job(spec="v0", inputs={}))).kind == "done"
        assert _wait(rd.submit(Job(spec="d1", inputs={}))).kind == "done"
        ev = read_events(tmp_path)
        unloads = [e for e in ev if e["event"] == "unload_start"]
        if hint:
            assert rd.loads == 1 and rv.loads == 1 and unloads == [], unloads
            assert [e["bytes"] for e in ev if e["event"] == "budget_reserve" and e["holder"] == "decoder"] == [10]
        else:
            assert rd.loads == 2, "the whole-budget reservation makes the idle DiT step aside once"
            assert [(e["holder"], e["reason"]) for e in unloads] == [("dit", "others_waiting")], unloads
        assert replay_budget(ev) <= 100
    finally:
        rd.shutdown(False, 2)
        rv.shutdown(False, 2)


def test_snapshot_agrees_with_what_clients_saw(tmp_path):
    """Status is one moment (docs/testing.md): once a client has its job's outcome the runtime shows the job done and
    nothing running; once it shows "not resident" its lease is back. Checked after every job and every unload."""
    rt, _ = _runtime(tmp_path, "s", FakeEngine(), idle_unload_s=0)
    try:
        for i in range(10):
            assert _wait(rt.submit(Job(spec=f"j{i}", inputs={}))).kind == "done"
            snap = rt.snapshot()
            assert not snap.running and snap.queue_depth == 0 and snap.jobs_done == i + 1, snap
            snap = wait_until(lambda: next((x for x in [rt.snapshot()] if not x.resident), None), what="idle unload")
            assert snap.lease_holder == "", snap
    finally:
        rt.shutdown(False, 2)


def test_a_job_cancelled_while_waiting_for_the_devices_loads_nothing(tmp_path):
    """Its client left while the stage waited in line: once the devices are free the stage gives them straight back,
    without loading weights for nobody (health never leaves SERVING, nobody is evicted for it)."""
    other = DeviceLease(["virt0"], LeaseConfig(tmp_path, "other"))
    other.acquire()
    eng = FakeEngine()
    rt, health = _runtime(tmp_path, "s", eng, idle_unload_s=-1)
    try:
        job = rt.submit(Job(spec="gone", inputs={}))
        wait_until(other.others_waiting, what="the stage to wait for the lease")
        job.close()  # what the RPC does when its client leaves
        other.release()
        wait_until(lambda: not rt.snapshot().running, what="the stage to drop the job")
        assert not any(e["event"] == "load_start" for e in read_events(tmp_path))
        assert eng.started == [] and not eng.loaded and health == [] and rt.snapshot().lease_holder == ""
    finally:
        rt.shutdown(False, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Process level: real stage servers
# ---------------------------------------------------------------------------------------------------------------------
class Stage:
    """One DiT server process standing in for a pipeline stage (own pid = own lease holder)."""

    def __init__(self, name: str, run_dir: Path, cache: Path, lease_dir: Path, args: list[str]):
        self.name = name
        self.port_file = run_dir / f"{name}.port"
        self.log = run_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "dit_svc", "--port", "0", "--port-file", str(self.port_file),
               "--lease-dir", str(lease_dir), "--devices", "virt0", "--cache-dir", str(cache), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **SERVER_ENV}, start_new_session=True)
        self.channel = None
        self.stub = None

    def wait_ready(self, timeout_s=90.0) -> "Stage":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
            if self.port_file.exists():
                self.channel = open_channel(f"127.0.0.1:{self.port_file.read_text()}")
                if health_of(self.channel, "h3.v1.DiTSampler") == "SERVING":
                    self.stub = dit_pb2_grpc.DiTSamplerStub(self.channel)
                    return self
                self.channel.close()
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not serving:\n{self.log.read_text()[-3000:]}")

    @property
    def clients(self):
        class _C:  # what render_svc.stage_calls.sample needs
            pass

        c = _C()
        c.dit, c.security = self.stub, Security()
        return c

    def run(self, spec: RenderSpec, job_id: str):
        return sample(self.clients, spec, TEXT, job_id=job_id, timeout_s=120)

    def stop(self):
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from dit_svc.engine import DiTEngineConfig, resolve_weights

    d = tmp_path_factory.mktemp("h3-cache")
    resolve_weights(DiTEngineConfig("", "", d, "cpu", torch.float32))  # write the tiny model once
    return d


def start_stages(names, tmp_path, cache, args) -> tuple[list[Stage], Path]:
    lease_dir = tmp_path / "leases"
    stages = [Stage(n, tmp_path, cache, lease_dir, args) for n in names]
    try:
        for s in stages:
            s.wait_ready()
    except BaseException:
        for s in stages:
            s.stop()
        raise
    return stages, lease_dir


STAGE_NAMES = ("encoder", "dit", "decoder")


@pytest.fixture()
def stack_factory(tmp_path, cache):
    """Start the real three stages (EmbeddedStack) on virtual device virt0 with the given residency flags."""
    started = []

    def start(residency="exclusive", args=()):
        s = EmbeddedStack(StackConfig(cache_dir=str(cache), run_dir=str(tmp_path / f"stack{len(started)}"),
                                      devices="virt0", residency=residency, env=SERVER_ENV,
                                      extra_args={n: list(args) for n in STAGE_NAMES}))
        started.append(s)
        return s, s.start()

    yield start
    for s in started:
        s.stop()


def run_clients(endpoints, out_dir: Path, clients=3, jobs=2) -> dict[str, list[str]]:
    """`clients` concurrent clients, each rendering `jobs` jobs encode -> sample -> decode (distinct prompts, so
    no encoder cache hits); returns job id -> stages completed, in order."""
    done: dict[str, list[str]] = {}
    lock = threading.Lock()

    def client(c):
        with StageClients(endpoints) as cl:
            for k in range(jobs):
                jid = f"c{c}j{k}"
                spec = RenderSpec(**{**TINY.__dict__, "prompt": f"client {c} job {k}: waves", "seed": c * 10 + k})
                states, _ = encode(cl, spec.prompt, jid, timeout_s=120)
                video, audio, _ = sample(cl, spec, states, jid, timeout_s=120)
                decode(cl, spec, video, audio, out_dir / f"{jid}.mp4", jid, timeout_s=120)
                with lock:
                    done[jid] = ["encoder", "dit", "decoder"]

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client, c) for c in range(clients)]:
            f.result()
    return done


def test_exclusive_three_clients_never_overlap(stack_factory, tmp_path):
    stack, endpoints = stack_factory("exclusive", ["--idle-unload-s", "5"])
    done = run_clients(endpoints, tmp_path)
    stack.stop()
    assert sorted(done) == sorted(f"c{c}j{k}" for c in range(3) for k in range(2))
    assert all((tmp_path / f"{j}.mp4").stat().st_size > 0 for j in done)
    ev = read_events(stack.lease_dir)
    leases = lease_intervals(ev)  # asserts one holder at a time, in lock order
    assert not overlapping(leases), overlapping(leases)
    loads = load_intervals(ev)
    assert not overlapping(loads), overlapping(loads)
    for h, t0, t1 in loads:  # weights only while the lease is held
        assert any(lh == h and la <= t0 and t1 <= lr for lh, la, lr in leases), (h, t0, t1)
    jobs = [(e["stage"], e["job"]) for e in ev if e["event"] == "job_done"]
    assert len(jobs) == len(set(jobs)) == 18, jobs  # every job exactly once per stage
    assert {s for s, _ in jobs} == set(STAGE_NAMES)


def resident_bytes_of(module: str, cls: str, cache: Path) -> tuple[int, object]:
    """Load a stage's engine in-process as its server would (tiny model on CPU); its resident bytes + engine."""
    import importlib

    from stagekit.config import parse_config

    m = importlib.import_module(f"{module}.server")
    cfg = parse_config(getattr(m, cls), ["--cache-dir", str(cache), "--devices", "virt0"])
    eng = m.make_engine(cfg, RankInfo(0, 1, 0), RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    eng.load(WeightSource(eng.weight_files()))
    n = eng.resident_bytes()
    eng.unload()
    return n, eng


def test_shared_pipelines_within_budget(stack_factory, tmp_path, cache):
    dec_bytes, _ = resident_bytes_of("decoder_svc", "DecoderConfigArgs", cache)
    _, dit = resident_bytes_of("dit_svc", "DiTConfigArgs", cache)
    dit_need = dit.estimate_bytes(TINY, 16)
    # The decoder fits beside the (small) encoder, the DiT beside the encoder, but the DiT and the decoder do
    # not fit together: so stages overlap *and* some reservations must wait for room.
    budget = dec_bytes + dit_need // 2
    stack, endpoints = stack_factory("shared", ["--memory-budget-gb", str(budget / 2**30)])
    with StageClients(endpoints) as cl:
        assert cl.dit.Status(common_pb2.StatusRequest()).residency == "shared"
    done = run_clients(endpoints, tmp_path)
    stack.stop()
    assert len(done) == 6
    ev = read_events(stack.lease_dir)
    assert not any(e["event"] == "acquire" for e in ev)  # shared mode never takes the exclusive lease
    peak = replay_budget(ev)
    assert 0 < peak <= budget, (peak, budget)
    assert all(t <= budget for e in ev if "totals" in e for t in e["totals"].values())
    assert any(e["event"] == "budget_wait" for e in ev), "the DiT and the decoder cannot fit together"
    assert overlapping(load_intervals(ev)), "stages should be resident at the same time"
    assert overlapping(job_intervals(ev)), "jobs should run on different stages at the same time"
    resident = {e["holder"] for e in ev if e["event"] == "loaded"}
    assert len(resident) == 3


def test_kill_holder_mid_job(tmp_path, cache):
    """Two stage processes on virt0 (DiT servers: fast to start); kill -9 the holder while its job runs."""
    stages, lease_dir = start_stages(["victim", "next"], tmp_path, cache, ["--idle-unload-s", "30"])
    victim, nxt = stages
    try:
        err, result = [], []
        started = threading.Event()
        long = RenderSpec(**{**TINY.__dict__, "steps": 200})

        def run_victim():
            try:
                sample(victim.clients, long, TEXT, "doomed", on_progress=lambda p: p.step >= 1 and started.set(),
                       timeout_s=120)
            except grpc.RpcError as e:
                err.append(e)

        tv = threading.Thread(target=run_victim)
        tv.start()
        assert started.wait(60), victim.log.read_text()[-2000:]
        tn = threading.Thread(target=lambda: result.append(nxt.run(TINY, "survivor")))
        tn.start()
        # until the next stage is waiting for the lease the victim holds
        wait_until(lambda: list(lease_dir.glob("virt0.wait.*")), what="the next stage to wait for the lease")
        t_kill = time.time()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        tv.join(30)
        tn.join(120)  # (its sample has a 120 s deadline)
        assert err and err[0].code() == grpc.StatusCode.UNAVAILABLE, err
        assert result, nxt.log.read_text()[-2000:]
        ev = read_events(lease_dir)
        acq = [e for e in ev if e["event"] == "acquire" and e["pid"] == nxt.proc.pid]
        # at once, not after some timeout (the bound only has to be far below the stage's lease timeout)
        assert acq and acq[0]["t"] - t_kill < 30.0, (acq, t_kill)
        lease_intervals(ev, dead_pids={victim.proc.pid})
        assert not any(e["event"] == "job_done" and e["job"] == "doomed" for e in ev)
        with pytest.raises(ProcessLookupError):  # nothing of the killed stage's process group is left
            os.killpg(victim.proc.pid, 0)
    finally:
        for s in stages:
            s.stop()
    with pytest.raises(ProcessLookupError):  # the survivor drained and exited with its whole group
        os.killpg(nxt.proc.pid, 0)


def test_lifecycle_rpcs_idle_unload_and_admission(tmp_path, cache):
    from dit_svc.engine import DiTEngine, DiTEngineConfig

    eng = DiTEngine(DiTEngineConfig("", "", cache, "cpu", torch.float32), RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    need = eng.estimate_bytes(TINY, TEXT.shape[0])
    budget = int(need * 1.5)
    (s,), lease_dir = start_stages(["op"], tmp_path, cache,
                                   ["--idle-unload-s", "1", "--memory-budget-gb", str(budget / 2**30)])
    try:
        st = s.stub.Status(common_pb2.StatusRequest())
        assert not st.resident and st.health == "SERVING" and st.lease_holder == "" and st.queue_depth == 0
        r = s.stub.Load(common_pb2.LoadRequest())
        assert r.resident
        st = s.stub.Status(common_pb2.StatusRequest())
        assert st.resident and st.memory_bytes == eng.weight_bytes() and st.lease_holder.startswith("dit@pid")
        assert st.weights.endswith(".safetensors") and st.devices and st.residency == "exclusive"
        r = s.stub.Unload(common_pb2.UnloadRequest())
        assert not r.resident
        assert s.stub.Status(common_pb2.StatusRequest()).lease_holder == ""
        assert s.stub.Warmup(common_pb2.WarmupRequest()).resident
        s.run(TINY, "fits")
        big = RenderSpec(**{**TINY.__dict__, "width": 512, "height": 512})
        with pytest.raises(grpc.RpcError) as ei:
            s.run(big, "too-big")
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "needs an estimated" in ei.value.details() and "memory budget is" in ei.value.details()
        wait_until(lambda: not s.stub.Status(common_pb2.StatusRequest()).resident, what="the idle unload (1 s)")
        st = s.stub.Status(common_pb2.StatusRequest())
        assert not st.resident and st.jobs_done == 1 and st.lease_holder == ""
    finally:
        s.stop()
    ev = read_events(lease_dir)
    # Load+Unload, then Warmup..idle: two residencies, or three when the 1 s idle unload came between the Warmup and
    # the job (a loaded machine can take that long to send it); each load ends in its unload.
    swaps = [e["event"] for e in ev if e["event"] in ("loaded", "unloaded")]
    assert swaps in (["loaded", "unloaded"] * 2, ["loaded", "unloaded"] * 3), swaps
    assert not any(e.get("job") == "too-big" for e in ev)
