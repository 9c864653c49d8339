"""benchmarks/bench_pipeline.py and the stages' `--cpu-cores`: the pieces that need no full run (a run takes minutes,
docs/performance.md "Pipelining" has its command). A virtual device is a share of the machine: disjoint core sets
per device; a stage pinned to a set computes on those cores with as many torch threads; a bad set is refused at
start with the cores that exist. The bar's verdict says per criterion whether a run met it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagekit.stage import parse_cpu_list

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "benchmarks" / "bench_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_core_sets_are_disjoint_shares(bench):
    sixteen = list(range(16))
    sets = bench.core_sets(sixteen, ["virt0", "virt1", "virt2"])
    assert sets == {"virt0": [0, 1, 2, 3, 4], "virt1": [5, 6, 7, 8, 9], "virt2": [10, 11, 12, 13, 14]}
    assert bench.core_sets(sixteen, ["virt0", "virt0", "virt0"]) == {"virt0": sixteen}  # one device: the machine
    assert bench.core_sets([0, 1], ["virt0", "virt1", "virt2"]) == {"virt0": [0], "virt1": [1], "virt2": [0]}


def test_prompts_have_the_asked_length_and_differ_per_job(bench):
    a, b = bench.prompt_text("pipelined take 0", 1000), bench.prompt_text("pipelined take 1", 1000)
    assert len(a.encode()) == len(b.encode()) == 1000 and a != b
    assert bench.prompt_text("x", 0) == "x: rain on a tin roof, a bell, footsteps"


def test_bar_verdict_per_criterion(bench):
    mode = {"wall_s": 20.0, "one_job_s": 3.0, "busy_over_bottleneck": {"encoder": 0.5, "dit": 1.0, "decoder": 0.9}}
    assert bench.bar_setting(["virt0", "virt1", "virt2"], (384, 384, 39)) == "cpu"
    assert bench.bar_setting(["virt0"], (384, 384, 39)) == ""  # the stages take turns: not the bar's setting
    assert bench.bar_setting(["cuda:0"], (832, 480, 124)) == "gpu"
    assert bench.bar_setting(["cuda:0"], (1344, 768, 124)) == ""
    cpu = bench.bar_verdict({"pipelined": mode, "pipelined_over_serial": 0.55}, "cpu", 8)
    assert cpu["pipelined_over_serial"]["ok"] and cpu["busy_over_bottleneck.decoder"]["ok"]
    assert not cpu["busy_over_bottleneck.encoder"]["ok"] and not cpu["ok"]
    gpu = bench.bar_verdict({"pipelined": {**mode, "wall_s": 70.0}}, "gpu", 4)
    assert gpu == {"four_jobs_wall_s": {"value": 70.0, "max": 71.0, "ok": True},
                   "one_job_s": {"value": 3.0, "max": 16.4, "ok": True}, "ok": True}
    assert bench.bar_verdict({"pipelined": mode}, "", 4) == {"ok": False}


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("2") == [2]
    for bad in ("", "a", "3-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match="not a core number"):
            parse_cpu_list(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pinned_process_runs_on_its_cores_with_as_many_threads():
    core = min(os.sched_getaffinity(0))
    code = ("import os, torch; from stagekit.stage import pin_cpu_cores; pin_cpu_cores(%r); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])" % str(core))
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [f"[{core}]", "1", "1"], out.stderr


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_stage_refuses_cores_it_cannot_use_before_serving(tmp_path):
    """A real stage process with a core this machine lacks exits at start, naming the cores it has."""
    out = subprocess.run([sys.executable, "-m", "encoder_svc", "--port", "0", "--cpu-cores", "4096",
                          "--lease-dir", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--cpu-cores '4096': cores [4096] are not available to this process (available:" in out.stderr


def test_balance_median_and_the_bench_encoder_depth(bench, tmp_path):
    """The calibration takes medians; the bench's text encoder is a tiny-family file whose depth the encoder reads
    from the file (the embedded model keeps its 2 layers)."""
    from minimax_h3.text.checkpoint import conditioner_config_for

    assert bench.median([3.0, 1.0, 2.0]) == 2.0 and bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    path = bench.encoder_file(tmp_path, 7)
    assert path.parent.name == "text_encoder_L7" and (path.parent / "tokenizer.json").exists()
    assert conditioner_config_for(path).num_layers == 7 and conditioner_config_for(path).hidden_size == 64


def test_calibration_averages_the_pre_runs_ratios(bench):
    """Each pre-run implies the counts that would have matched the decoder; the next runs their geometric mean, so
    a run twice too slow and one twice too fast cancel. A balanced pre-run ends the calibration above the bar."""
    assert bench.geometric_mean([40.0]) == pytest.approx(40.0)
    assert bench.geometric_mean([20.0, 80.0]) == pytest.approx(40.0)
    assert bench.CPU_SHARE < bench.BALANCED < 1.0
