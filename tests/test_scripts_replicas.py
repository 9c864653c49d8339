"""scripts/up.sh with several replicas of a stage (`--dit-replicas "virt1;virt2"`): each replica its own process
group, pid/port/log files and TMPDIR (`dit.1`, `dit.2`), endpoints.env listing them as the render service's `--dit`
takes them, a render through them, `client status` with a block per replica, a stage load test over the list, and
down.sh leaving nothing behind; combinations that make no sense are refused before anything starts (exit 2)."""

import os
import re
import sys
from pathlib import Path

import av
import pytest

from client.render_client import RenderClient
from h3.v1 import common_pb2
from minimax_h3.services import Endpoints, StageClients
from tests.test_scripts import run, started_by

SMALL = ["--width", "256", "--height", "256", "--frames", "22", "--steps", "1"]


def _env(model_cache: Path) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "H3_ENCODER_CACHE_DIR": str(model_cache),
            "H3_DIT_CACHE_DIR": str(model_cache), "H3_DECODER_CACHE_DIR": str(model_cache), "OMP_NUM_THREADS": "1",
            "H3_RENDER": "", "H3_ENCODER": "", "H3_DIT": "", "H3_DECODER": ""}


def test_two_dit_replicas_up_render_status_down(tmp_path, model_cache):
    env = _env(model_cache)
    run_dir = tmp_path / "run"
    up = ["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--devices", "virt0", "--dit-replicas", "virt1;virt2",
          "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0", "--render-port", "0", "--web-port", "0"]
    client = [sys.executable, "-m", "client"]
    where = ["--endpoints-file", str(run_dir / "endpoints.env")]
    try:
        r = run(up, env)
        assert r.returncode == 0, r.stdout + r.stderr
        for k in (1, 2):
            assert f"started dit.{k} (pid " in r.stdout and f"ranks 1, devices virt{k}), log" in r.stdout, r.stdout
        endpoints = dict(e.split("=", 1) for e in (run_dir / "endpoints.env").read_text().split())
        ports = {k: (run_dir / f"dit.{k}.port").read_text().strip() for k in (1, 2)}
        assert endpoints["H3_DIT"] == f"1=127.0.0.1:{ports[1]},2=127.0.0.1:{ports[2]}", endpoints
        assert ports[1] != ports[2] and f"H3_DIT={endpoints['H3_DIT']}" in r.stdout
        assert not (run_dir / "dit.pid").exists() and not (run_dir / "dit.port").exists()
        assert all((run_dir / f"dit.{k}.log").exists() and (run_dir / "tmp" / f"dit.{k}").is_dir() for k in (1, 2))
        pids = {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")}
        assert set(pids) == {"encoder", "dit.1", "dit.2", "decoder", "render"}, pids

        r = run(up, env)  # idempotent: every replica left alone, the render service too (its stages did not move)
        assert r.returncode == 0 and r.stdout.count("already running") == 5, r.stdout + r.stderr
        assert {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")} == pids

        out = tmp_path / "out.mp4"
        r = run([*client, "render", "--prompt", "a fox", *SMALL, "-o", str(out), *where], env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        with av.open(str(out)) as c:
            assert (c.streams.video[0].width, c.streams.video[0].height) == (256, 256) and c.streams.audio

        # One block per replica, each answering for its own process and devices.
        r = run([*client, "status", *where], env, timeout=60)
        assert r.returncode == 0 and r.stdout.count("SERVING") == 5, r.stdout + r.stderr  # + encoder, decoder, render
        for k in (1, 2):
            assert re.search(rf"^dit/{k}\s+127\.0\.0\.1:{ports[k]}\s+SERVING$", r.stdout, re.M), r.stdout
            with StageClients(Endpoints(dit=f"127.0.0.1:{ports[k]}")) as c:  # the device it leased: its own
                assert list(c.dit.Status(common_pb2.StatusRequest(), timeout=10).device_ids) == [f"virt{k}"]
        with RenderClient(endpoints["H3_RENDER"]) as rc:  # each replica a resource of its own, beside the others
            groups = set(rc.status().stage_groups)
        assert groups == {"encoder+decoder", "dit/1", "dit/2"}, groups
        assert sum(int(n) for n in re.findall(r"^dit/\d.*\n.*jobs_done=(\d+)", r.stdout, re.M)) == 1, r.stdout

        # A stage load test over the list: one channel, gRPC's round_robin over both replicas.
        r = run([*client, "loadtest", "--stage", "dit", "--requests", "2", "--concurrency", "2", *SMALL, *where],
                env, timeout=120)
        assert r.returncode == 0 and re.search(r"\b2 sent\b.*\b2 ok\b", r.stdout), r.stdout + r.stderr
        done = {}
        for k in (1, 2):
            with StageClients(Endpoints(dit=f"127.0.0.1:{ports[k]}")) as c:
                done[k] = c.dit.Status(common_pb2.StatusRequest(), timeout=10).jobs_done
        assert sum(done.values()) == 3, done  # the render's sample and the load test's two, wherever they ran
        print(f"\nDiT jobs per replica after a render and a 2-request load test: {done}")
    finally:
        r = run(["bash", "scripts/down.sh", "--run-dir", str(run_dir), "--grace", "20"], env)
    assert r.returncode == 0 and r.stdout.count("stopped") == 5, r.stdout + r.stderr
    assert "stopped dit.1 " in r.stdout and "stopped dit.2 " in r.stdout, r.stdout
    assert not started_by(run_dir), f"down.sh left processes running: {started_by(run_dir)}"
    assert not [p.name for p in run_dir.iterdir() if re.search(r"\.(pid|port|port\.http|stages|env)$", p.name)]
    assert not [p for p in (run_dir / "tmp").rglob("*")], "down.sh leaves no temp files"


@pytest.mark.parametrize("argv, message", [
    (["--dit-replicas", "virt0;virt0"], "virt0 is in replicas 1 and 2; each replica of a stage needs devices of its own"),
    (["--dit-replicas", "virt0,virt0"], "replica 1 lists virt0 twice"),
    (["--dit-replicas", "virt0;"], "replica 2's device list \"\" is not a comma-separated list of devices"),
    (["--decoder-replicas", "virt0,,virt1"], "replica 1's device list \"virt0,,virt1\" is not a comma-separated"),
    (["--dit-ranks", "3", "--dit-replicas", "virt0,virt1;virt2,virt3"],
     "--dit-ranks 3 with replica 1's 2 devices (virt0,virt1): each replica's ranks compute on its devices in turn, "
     "so give a multiple of its device count"),
    (["--encoder-ranks", "two"], "--encoder-ranks two: give a whole number, 1 or more"),
])
def test_replicas_that_make_no_sense_are_refused(tmp_path, argv, message):
    run_dir = tmp_path / "run"
    r = run(["bash", "scripts/up.sh", "--run-dir", str(run_dir), *argv], {**os.environ, "PYTHON": sys.executable},
            timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("up.sh: ") and message in r.stderr, r.stderr
    assert not run_dir.exists(), "nothing is started or written"
