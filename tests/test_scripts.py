"""scripts/up.sh and scripts/down.sh: start all stages and the render service, wait for health, idempotent, clean
stop; a failed rank group is started again by the stage's supervisor, its ranks and torchrun agent die with the
supervisor, a stage started again on another port restarts the render service over it, and down.sh stops whatever
up.sh started (docs/reliability.md, "Orphan ranks" and "Restarts")."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minimax_h3.services import SERVICE_NAMES
from stagekit.channels import health_of, open_channel
from tests.procs import alive, rank_pids
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def started_by(run_dir: Path) -> list[int]:
    """Live processes up.sh started for this run dir: each stage and all it started inherit TMPDIR=<run>/tmp/<stage>
    (torchrun's ranks too, though they run in sessions of their own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and alive(int(d.name)):
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(e.startswith(f"TMPDIR={run_dir}/tmp/".encode()) for e in env):
                out.append(int(d.name))
    return out


def test_up_status_down(tmp_path, model_cache):
    env = {**os.environ, "PYTHON": sys.executable, "H3_ENCODER_CACHE_DIR": str(model_cache),
           "H3_DIT_CACHE_DIR": str(model_cache), "H3_DECODER_CACHE_DIR": str(model_cache),
           "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    up = ["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--devices", "virt0", "--dit-ranks", "2",
          "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0", "--render-port", "0", "--web-port", "0"]
    ranks: dict = {}
    try:
        r = run(up, env)
        assert r.returncode == 0, r.stdout + r.stderr
        endpoints = (run_dir / "endpoints.env").read_text()
        assert endpoints.count("=127.0.0.1:") == 4 and "H3_RENDER_WEB=http://127.0.0.1:" in endpoints
        pids = {s: int((run_dir / f"{s}.pid").read_text()) for s in ("encoder", "dit", "decoder", "render")}
        r = run(up, env)  # idempotent: nothing new started
        assert r.returncode == 0 and r.stdout.count("already running") == 4, r.stdout
        assert {s: int((run_dir / f"{s}.pid").read_text()) for s in pids} == pids
        r = run([sys.executable, "-m", "client", "status", "--endpoints-file", str(run_dir / "endpoints.env")], env,
                timeout=60)
        assert r.returncode == 0 and r.stdout.count("SERVING") == 4, r.stdout + r.stderr  # 3 stages + render
        # torchrun keeps its own temp dirs in the stage's TMPDIR, inside the run dir.
        elastic = list((run_dir / "tmp" / "dit").glob("torchelastic_*"))
        assert elastic, list((run_dir / "tmp" / "dit").iterdir())

        # A rank group that fails ends its torchrun; the stage's supervisor starts it again.
        ranks = rank_pids(pids["dit"])
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)

        def new_group():
            """The new ranks, once the new rank 0 serves (on the port it wrote: --dit-port 0 takes a free one)."""
            now = rank_pids(pids["dit"])
            if set(now) != {0, 1} or set(now.values()) & set(ranks.values()):
                return None
            with open_channel(f"127.0.0.1:{(run_dir / 'dit.port').read_text().strip()}") as ch:
                return health_of(ch, SERVICE_NAMES["dit"], 2.0) == "SERVING" and now

        ranks = wait_until(new_group, 120, "a new rank group under the supervisor, serving")
        assert "starting it again (restart 1 of at most 3 in 600 s)" in (run_dir / "dit.log").read_text()

        # kill -9 of the supervisor: the torchrun agent dies with it, and its ranks with the agent (none keeps
        # serving on its own).
        t0 = time.monotonic()
        os.kill(pids["dit"], signal.SIGKILL)
        while any(alive(p) for p in ranks.values()):
            assert time.monotonic() - t0 < 30, f"ranks {ranks} outlived their launcher"  # (the kernel kills them)
            time.sleep(0.05)
        orphan_s = time.monotonic() - t0
        # up.sh starts the dead stage again (and only it), on a fresh temp dir; its new port restarts the render
        # service over it.
        r = run(up, env)
        assert r.returncode == 0 and r.stdout.count("already running") == 2 and "started dit" in r.stdout, r.stdout
        assert "started render" in r.stdout and (run_dir / "endpoints.env").read_text().count("=127.0.0.1:") == 4
        assert not any(p.exists() for p in elastic), "the dead agent's temp dir was removed before the restart"
        assert set(rank_pids(int((run_dir / "dit.pid").read_text()))) == {0, 1}
        running = started_by(run_dir)
        assert len(running) == 7, running  # encoder, decoder, the supervisor, its torchrun agent and 2 ranks, render
    finally:
        r = run(["bash", "scripts/down.sh", "--run-dir", str(run_dir), "--grace", "20"], env)
    assert r.returncode == 0, r.stderr
    assert not started_by(run_dir), f"down.sh left processes running: {started_by(run_dir)}"
    assert not (run_dir / "endpoints.env").exists()
    assert not [p for p in (run_dir / "tmp").rglob("*")], "down.sh leaves no temp files"
    print(f"\nup/down: dit ranks died {orphan_s:.2f}s after kill -9 of their supervisor; down.sh stopped "
          f"{len(running)} processes")



def test_a_failed_up_stops_what_it_started_and_names_what_it_left(tmp_path, model_cache):
    """A port taken (the decoder's): up.sh fails, names the decoder's log, stops the encoder and the DiT it had started
    (each named with its pid), leaves no process, pid file or endpoints file behind; a stage that was running before
    the run is left running and named."""
    import socket

    env = {**os.environ, "PYTHON": sys.executable, "H3_ENCODER_CACHE_DIR": str(model_cache),
           "H3_DIT_CACHE_DIR": str(model_cache), "H3_DECODER_CACHE_DIR": str(model_cache), "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = ["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--devices", "virt0", "--encoder-port", "0",
              "--dit-port", "0", "--decoder-port", str(port), "--render-port", "0", "--web-port", "0"]
        try:
            r = run(up, env)
            assert r.returncode != 0, r.stdout + r.stderr
            assert f"decoder died while starting; the last" in r.stderr and str(port) in r.stderr, r.stderr
            said = [ln for ln in r.stderr.splitlines() if ln.startswith("up.sh: ")]
            pids = {s: int(r.stdout.split(f"started {s} (pid ", 1)[1].split(",")[0]) for s in ("encoder", "dit")}
            assert said[0].startswith("up.sh: failed; stopping what it started: "
                                      f"encoder (pid {pids['encoder']}), dit (pid {pids['dit']}), decoder (pid "), said
            assert said[1:] == ["up.sh: stopped decoder", "up.sh: stopped dit", "up.sh: stopped encoder"], said
            assert not started_by(run_dir) and not any(alive(p) for p in pids.values()), started_by(run_dir)
            assert not list(run_dir.glob("*.pid")) and not (run_dir / "endpoints.env").exists()

            # A stack up before, its decoder gone: up.sh starts the decoder alone, which fails on the taken port; it
            # stops the decoder and names the processes it found running, which it leaves running.
            free = ["0" if a == str(port) else a for a in up]
            r = run(free, env)
            assert r.returncode == 0, r.stdout + r.stderr
            before = {s: int((run_dir / f"{s}.pid").read_text()) for s in ("encoder", "dit", "decoder", "render")}
            subprocess.run(["bash", "-c", f"source scripts/procs.sh; stop_stage {before['decoder']} "
                                          f"{run_dir}/tmp/decoder 20"], cwd=ROOT, check=True)
            r = run(up, env)
            assert r.returncode != 0 and r.stdout.count("already running") == 2, r.stdout + r.stderr
            said = [ln for ln in r.stderr.splitlines() if ln.startswith("up.sh: ")]
            assert said[0].startswith("up.sh: failed; stopping what it started: decoder (pid ") and \
                said[1] == "up.sh: stopped decoder", said
            assert said[2] == (f"up.sh: left running, as it found them: encoder (pid {before['encoder']}), dit (pid "
                               f"{before['dit']}), render (pid {before['render']}) (scripts/down.sh --run-dir "
                               f"{run_dir} stops them)"), said
            assert all(alive(before[s]) for s in ("encoder", "dit", "render"))
        finally:
            run(["bash", "scripts/down.sh", "--run-dir", str(run_dir), "--grace", "20"], env)
    assert not started_by(run_dir)


def test_ctrl_c_of_up_stops_what_it_started(tmp_path, model_cache):
    """Ctrl-C while up.sh waits for its stages (SIGINT to its process group, as a terminal sends it): it says it was
    interrupted and what it stops, and stops it."""
    from tests.procs import taking_ctrl_c

    env = {**os.environ, "PYTHON": sys.executable, "H3_ENCODER_CACHE_DIR": str(model_cache),
           "H3_DIT_CACHE_DIR": str(model_cache), "H3_DECODER_CACHE_DIR": str(model_cache), "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    up = subprocess.Popen(taking_ctrl_c(["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--devices", "virt0",
                                         "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0",
                                         "--render-port", "0", "--web-port", "0"]),
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    try:
        out = ""
        for line in up.stdout:
            out += line
            if line.startswith("started decoder"):
                break
        os.killpg(up.pid, signal.SIGINT)
        _, err = up.communicate(timeout=120)
        assert up.returncode == 130, out + err
        said = [ln for ln in err.splitlines() if ln.startswith("up.sh: ")]
        assert said[0].startswith("up.sh: interrupted; stopping what it started: encoder (pid "), err
        assert said[1:] == ["up.sh: stopped decoder", "up.sh: stopped dit", "up.sh: stopped encoder"], err
        assert "Traceback" not in err and not started_by(run_dir) and not list(run_dir.glob("*.pid"))
    finally:
        up.kill()
        run(["bash", "scripts/down.sh", "--run-dir", str(run_dir), "--grace", "20"], env)
