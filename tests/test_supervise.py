"""`python -m stagekit.supervise` (scripts/up.sh runs a multi-rank stage's torchrun under it): a failed command
starts again while fewer than --max-restarts restarts were made in the last --restart-window-s, so a crash loop ends
and a failure now and then never uses the budget up; a stop signal is passed on and nothing restarts after it; the
command dies with its supervisor. Real processes (a small Python command that counts its runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stagekit.supervise import RestartBudget
from tests.procs import alive
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]

# Appends a line to the file argv[1] (a run counted), writes its pid to argv[2]; then exits with the status the
# run's number picks from argv[3:] (the last one for later runs), or, given "wait", waits for SIGTERM and exits 0.
COMMAND = r"""
import os, signal, sys, time
runs, pid_file, plan = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(runs, "a") as f:
    f.write("run\n")
n = len(open(runs).read().splitlines())
what = plan[min(n, len(plan)) - 1]
if what == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    open(pid_file, "w").write(str(os.getpid()))
    while True:
        time.sleep(60)
sys.exit(int(what))
"""


def supervised(tmp_path: Path, plan: list[str], *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stagekit.supervise", *flags, "--", sys.executable, "-c", COMMAND,
                             str(tmp_path / "runs"), str(tmp_path / "pid"), *plan],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text().splitlines())


def test_the_budget_counts_restarts_in_a_sliding_window():
    now = [0.0]
    budget = RestartBudget(2, 600.0, clock=lambda: now[0])
    assert budget.take() and budget.take()          # restarts at 0 s and 0 s
    now[0] = 599.0
    assert not budget.take() and budget.in_window() == 2  # a third within 600 s of them: refused
    now[0] = 600.0
    assert budget.in_window() == 0 and budget.take()  # 600 s on, both places are free again
    now[0] = 900.0
    assert budget.take() and not budget.take()       # at 600 s and 900 s: the budget is spent until 1200 s
    assert not RestartBudget(0, 1.0).take()
    with pytest.raises(ValueError):
        RestartBudget(3, 0.0)


def test_a_crash_loop_ends_once_the_window_holds_max_restarts(tmp_path):
    p = supervised(tmp_path, ["3"], "--max-restarts", "2", "--restart-window-s", "3600")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3 and runs(tmp_path) == 3, err  # the first run and two restarts
    assert err.count("ended (exit code 3); starting it again (restart ") == 2, err
    assert "restart 2 of at most 2 in 3600 s" in err
    assert err.rstrip().endswith("ended (exit code 3); it failed 3 times within 3600 s (--max-restarts 2 "
                                 "--restart-window-s 3600): not starting it again"), err


def test_a_command_that_succeeds_after_a_failure_ends_the_supervisor(tmp_path):
    p = supervised(tmp_path, ["1", "0"], "--max-restarts", "3")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and runs(tmp_path) == 2, err


def test_a_stop_signal_is_passed_on_and_nothing_restarts(tmp_path):
    p = supervised(tmp_path, ["wait"])
    try:
        wait_until(lambda: (tmp_path / "pid").exists(), 60, "the command waiting for its signal")
        p.send_signal(signal.SIGTERM)  # to the supervisor alone: it passes it on
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0 and runs(tmp_path) == 1, err
    finally:
        p.kill()
        p.wait()


def test_the_command_dies_with_its_supervisor(tmp_path):
    p = supervised(tmp_path, ["wait"])
    try:
        pid = int(wait_until(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), 60,
                             "the command running"))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        wait_until(lambda: not alive(pid), 30, "the command gone with its supervisor")
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("argv, message", [
    ([], "give the command to run after --"),
    (["--max-restarts", "-1", "--", "true"], "--max-restarts must be 0 or more and --restart-window-s above 0"),
    (["--restart-window-s", "0", "--", "true"], "--max-restarts must be 0 or more and --restart-window-s above 0"),
])
def test_settings_that_make_no_sense_are_refused(argv, message):
    r = subprocess.run([sys.executable, "-m", "stagekit.supervise", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
