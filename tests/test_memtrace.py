"""benchmarks/memtrace.py: the 22 GB rule checker, event-log residency check, summary, sampler (fake NVML) and plot."""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import memtrace
from benchmarks.memtrace import GIB, HoldRule, MemorySampler, ProcMem, Sample, check_events, check_trace

CAP = 22 * GIB


def sample(t, phase, gpus, **kw):
    return Sample(t, phase, {g: [ProcMem(pid, role, int(gib * GIB)) for pid, role, gib in procs]
                             for g, procs in gpus.items()}, **kw)


def turn_taking_trace():
    """Encoder, then DiT TP2, then decoder TP2 on two GPUs; every process keeps a 0.5 GiB context."""
    ctx = 0.5
    idle = {0: [(1, "encoder", ctx), (2, "dit", ctx), (4, "decoder", ctx)], 1: [(3, "dit", ctx), (5, "decoder", ctx)]}
    enc = {0: [(1, "encoder", 13.7), (2, "dit", ctx), (4, "decoder", ctx)], 1: [(3, "dit", ctx), (5, "decoder", ctx)]}
    dit = {0: [(1, "encoder", ctx), (2, "dit", 20.5), (4, "decoder", ctx)], 1: [(3, "dit", 20.5), (5, "decoder", ctx)]}
    dec = {0: [(1, "encoder", ctx), (2, "dit", 1.1), (4, "decoder", 9.0)], 1: [(3, "dit", 1.1), (5, "decoder", 8.0)]}
    return [sample(0.0, "idle:int8", idle), sample(1.0, "rule:int8:832", enc), sample(2.0, "rule:int8:832", dit),
            sample(3.0, "rule:int8:832", dec), sample(4.0, "free:tp1", {0: [(6, "dit_tp1", 60.0)]})]


def test_turn_taking_passes_and_reports_peaks():
    samples = turn_taking_trace()
    hold = HoldRule(baseline=memtrace.idle_baseline(s for s in samples if s.phase.startswith("idle")))
    check = check_trace(samples, CAP, hold)
    assert check.ok, check.to_json()
    assert check.rule_samples == 3
    assert check.max_sum[0] == int(21.5 * GIB)  # DiT rank 0 + the two idle contexts
    assert check.max_sum_any_phase[0] == 60 * GIB  # the TP1 phase is not held to the cap
    assert check.holders_seen[0] == ["decoder", "dit", "dit_tp1", "encoder"]
    assert check.turns[0] == 4  # none -> encoder -> dit -> decoder -> dit_tp1
    assert check.to_json()["max_sum_gib"][0] == 21.5


def test_over_cap_counts_every_process_context():
    # DiT alone is under 22 GiB, but the idle encoder's and decoder's contexts on the same card push it over.
    s = sample(1.0, "rule:x", {0: [(1, "encoder", 0.6), (2, "dit", 21.0), (4, "decoder", 0.6)]})
    check = check_trace([s], CAP)
    assert not check.ok and check.over_cap_count == 1 and check.co_resident_count == 0
    assert check.over_cap[0]["sum_gib"] == 22.2
    assert check.over_cap[0]["procs_gib"] == {"encoder:1": 0.6, "dit:2": 21.0, "decoder:4": 0.6}


def test_two_weight_holders_on_one_gpu_fail_in_any_phase():
    s = sample(1.0, "free:tp1", {1: [(2, "dit", 10.0), (4, "decoder", 5.0)]})
    check = check_trace([s, sample(2.0, "rule:x", {1: [(2, "dit", 0.5)]})], CAP)
    assert not check.ok and check.co_resident_count == 1
    assert check.co_resident[0]["holders_gib"] == {"dit": 10.0, "decoder": 5.0}


def test_hold_rule_uses_measured_idle_footprint():
    # A DiT that keeps NCCL buffers and cached probe memory (2.5 GiB) while idle is not "holding weights" ...
    idle = [sample(0.0, "idle", {0: [(2, "dit", 2.5), (4, "decoder", 0.5)]})]
    busy = sample(1.0, "rule:x", {0: [(2, "dit", 2.6), (4, "decoder", 6.0)]})
    assert check_trace([busy], CAP).co_resident_count == 1  # ... unless its footprint is unknown
    hold = HoldRule(baseline=memtrace.idle_baseline(idle))
    assert hold.threshold("dit", 0) == 4 * GIB
    assert check_trace([busy], CAP, hold).co_resident_count == 0
    # Processes that are no stage never count as holders, but their memory counts toward the cap.
    other = sample(1.0, "rule:x", {0: [(9, "other", 21.0), (4, "decoder", 6.0)]})
    c = check_trace([other], CAP, hold)
    assert c.co_resident_count == 0 and c.over_cap_count == 1


def test_processes_without_memory_numbers_are_not_a_pass():
    # NVML may list processes but not their memory (usedGpuMemory None -> 0): the device's own number exposes it.
    s = sample(1.0, "rule:x", {0: [(2, "dit", 0.0)]}, device_used={0: 20 * GIB})
    check = check_trace([s], CAP)
    assert not check.attribution_ok and not check.ok
    assert check.to_json()["max_device_used_gib"] == {0: 20.0}


def test_no_rule_samples_is_not_a_pass():
    assert not check_trace([sample(0.0, "setup", {0: []})], CAP).ok


def test_role_of_names_stage_and_variant():
    py = sys.executable
    assert memtrace.role_of([py, "-m", "dit_svc", "--port-file", "/r/dit.port"]) == "dit"
    assert memtrace.role_of([py, "-m", "dit_svc", "--port-file", "/r/dit_tp1.port"]) == "dit_tp1"
    assert memtrace.role_of([py, "-m", "decoder_svc", "--port-file=/r/decoder_1rank.port"]) == "decoder_1rank"
    assert memtrace.role_of([py, "-m", "torch.distributed.run", "-m", "encoder_svc"]) == "encoder"
    assert memtrace.role_of([py, "-m", "render_svc"]) == "render"
    assert memtrace.role_of([py, "bench.py", "--port-file", "x.port"]) == "other"
    assert memtrace.stage_of("dit_tp1") == "dit" and memtrace.stage_of("weights") == "other"


def test_event_log_residencies():
    ev = [{"t": 1, "event": "load_start", "holder": "encoder@1", "stage": "encoder", "devices": ["G0", "G1"]},
          {"t": 2, "event": "unloaded", "holder": "encoder@1"},
          {"t": 2.5, "event": "load_start", "holder": "dit@2", "stage": "dit", "devices": ["G0", "G1"]},
          {"t": 5, "event": "unloaded", "holder": "dit@2"},
          {"t": 6, "event": "load_start", "holder": "decoder@3", "stage": "decoder", "devices": ["G0", "G1"]}]
    ivs = memtrace.residency_intervals(ev)
    assert [(iv["holder"], iv["end"]) for iv in ivs] == [("encoder@1", 2), ("dit@2", 5), ("decoder@3", None)]
    assert check_events(ev) == []
    overlap = ev + [{"t": 7, "event": "load_start", "holder": "dit_tp1@4", "stage": "dit", "devices": ["G0"]}]
    assert check_events(overlap) == [{"devices": ["G0"], "a": "decoder@3", "b": "dit_tp1@4", "at": 7}]


def test_summarize_per_phase():
    samples = turn_taking_trace()
    samples[1].host_rss, samples[1].host_pss = 30 * GIB, 20 * GIB
    summary = memtrace.summarize(samples)
    assert list(summary) == ["idle:int8", "rule:int8:832", "free:tp1"]
    rule = summary["rule:int8:832"]
    assert rule["samples"] == 3 and rule["duration_s"] == 2.0
    assert rule["gpu_peak_gib"] == {0: 21.5, 1: 21.0}
    assert rule["role_peak_gib"]["encoder@gpu0"] == 13.7
    assert rule["host_pss_peak_gib"] == 20.0 and summary["idle:int8"]["host_pss_peak_gib"] is None


def test_sampler_with_fake_reader_writes_a_readable_trace(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "dit_svc",
                              "--port-file", "x/dit_tp1.port"])
    try:
        calls = []

        def read():
            calls.append(1)
            return {0: [(child.pid, (len(calls) % 3) * GIB)], 1: []}, {0: 3 * GIB, 1: 0}

        sink = tmp_path / "trace.jsonl"
        s = MemorySampler(read, period_s=0.01, host_every=2, host_pids=lambda: [os.getpid(), child.pid], sink=sink)
        s.phase = "rule:test"
        s.start()
        deadline = time.monotonic() + 30
        while len(s.samples) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.stop()
    finally:
        child.kill()
        child.wait()
    assert len(s.samples) >= 6 and not s.errors
    assert {p.role for x in s.samples for p in x.gpus[0]} == {"dit_tp1"}
    with_host = [x for x in s.samples if x.host_rss is not None]
    assert with_host and all(x.host_rss > 0 and 0 < x.host_pss <= x.host_rss for x in with_host)
    loaded = memtrace.load_samples(memtrace.compress(sink))
    assert [x.to_json() for x in loaded] == [x.to_json() for x in s.samples]
    with gzip.open(tmp_path / "trace.jsonl.gz", "rt") as fh:
        assert json.loads(fh.readline())["phase"] == "rule:test"


def test_sampler_records_read_errors_and_goes_on():
    n = []

    def read():
        n.append(1)
        if len(n) == 2:
            raise RuntimeError("NVML hiccup")
        return {0: []}, {0: 0}

    s = MemorySampler(read, period_s=0.005)
    s.start()
    deadline = time.monotonic() + 30
    while len(s.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    assert s.errors == ["RuntimeError: NVML hiccup"] and len(s.samples) >= 3


def test_plot_trace_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    samples = turn_taking_trace()
    path = memtrace.plot_trace(samples, tmp_path / "trace.png", CAP, "test", turns=[(2.0, "dit")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stage_child_counts_as_its_stage(tmp_path):
    """A stage's device worker (a child whose command line names no module) is attributed to its stage, and its
    host memory is counted with ours."""
    import subprocess
    import sys

    from benchmarks.memtrace import our_pids, role_of_pid

    script = ("import subprocess, sys; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True); "
              "sys.stdin.read(); p.kill()")
    parent = subprocess.Popen([sys.executable, "-c", script, "dit_svc"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert role_of_pid(parent.pid) == "dit" and role_of_pid(child) == "dit"
        pids = our_pids(["dit_svc"])
        assert parent.pid in pids and child in pids
    finally:
        parent.stdin.close()
        parent.wait(timeout=10)


def test_idle_neighbours_on_one_card():
    """One card, stages taking turns: every stage that does not hold the card must stay within the limit."""
    limit = int(0.1 * GIB)
    lean = [sample(1.0, "rule:a", {0: [(1, "encoder", 13.2), (2, "dit", 0.0), (4, "decoder", 0.05)]}),
            sample(2.0, "rule:a", {0: [(2, "dit", 20.6), (4, "decoder", 0.05)]}),
            sample(3.0, "rule:a", {0: [(4, "decoder", 9.0)]}),
            sample(4.0, "setup:weights", {0: [(9, "other", 30.0), (2, "dit", 0.7)]})]  # not held to the rule
    r = memtrace.check_idle_neighbours(lean, limit)
    assert r["ok"] and r["max_gib"][0] == 0.05, r
    fat = lean + [sample(5.0, "rule:b", {0: [(2, "dit", 20.6), (1, "encoder", 0.51), (4, "decoder", 0.05)]})]
    r = memtrace.check_idle_neighbours(fat, limit)
    assert not r["ok"] and r["max_gib"][0] == 0.51 and r["at"][0].startswith("encoder 0.51 GiB while dit held 20.60")
