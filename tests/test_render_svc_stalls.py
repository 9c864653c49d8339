"""The render service's progress watchdog rule (render_svc/stalls.py), on its own: when a replica's batch has
stalled, when a stalled job runs once more or fails naming the replicas, and when a suspect replica is back in
rotation. `tests/test_render_svc_replicas.py` stops a real DiT replica's device worker and watches the whole path."""

from __future__ import annotations

import time

from h3.v1 import common_pb2
from render_svc.stalls import StallWatch, Suspects, stall_verdict


def test_a_watch_is_stalled_only_after_its_timeout_without_a_touch():
    watch = StallWatch(3600.0)
    assert not watch.stalled()
    watch._last -= 3601.0  # an hour and a second of silence
    assert watch.stalled() and watch.silent_s() > 3600.0
    watch.touch()
    assert not watch.stalled()
    assert not StallWatch(float("inf")).stalled()  # no timeout given: never


def test_a_job_runs_once_more_after_a_stall_then_fails_naming_the_replicas():
    assert stall_verdict([], "dit/a", "dit", 300.0) is None
    why = stall_verdict(["dit/a"], "dit/b", "dit", 300.0)
    assert why.startswith("the dit stage made no progress on replica dit/b for 300 s (--stall-timeout-s), and this "
                          "job's work had stalled on replica dit/a before: the job runs no more."), why
    assert "SUSPECT" in why and "check their device workers" in why


def _status(running: int, queued: int, done: int) -> common_pb2.StageStatus:
    return common_pb2.StageStatus(running=running, queue_depth=queued, jobs_done=done)


def test_a_suspect_is_back_once_a_status_asked_after_the_stop_shows_it_moving():
    s = Suspects()
    before = time.monotonic()
    s.mark("dit/a", "dit", 300.0)
    s.mark("dit/a", "dit", 300.0)  # a second stall of the same replica keeps the first reason
    assert "dit/a" in s and s and s.reason("dit/a").startswith("no progress on a dit batch for 300 s")
    assert s.reason("dit/b") == "" and "dit/b" not in s

    s.seen("dit/a", _status(0, 0, 7), before)  # asked before the stop: says nothing of it
    assert "dit/a" in s
    after = time.monotonic()
    s.seen("dit/a", _status(1, 2, 7), after)   # still holding its jobs: the first reading after the stop
    s.seen("dit/a", _status(1, 0, 7), after)   # no job done since
    assert "dit/a" in s
    s.seen("dit/a", _status(1, 3, 8), after)   # a job done since the first reading: it moves
    assert "dit/a" not in s and not s

    s.mark("decoder/b", "decoder", 300.0)
    s.seen("decoder/b", _status(0, 0, 0), time.monotonic())  # idle (e.g. started again): nothing holds it
    assert "decoder/b" not in s
