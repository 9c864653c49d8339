"""scripts/up.sh and scripts/down.sh: start all stages, wait for health, idempotent, clean stop."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_up_status_down(tmp_path, model_cache):
    env = {**os.environ, "PYTHON": sys.executable, "H3_ENCODER_CACHE_DIR": str(model_cache),
           "H3_DIT_CACHE_DIR": str(model_cache), "H3_DECODER_CACHE_DIR": str(model_cache),
           "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    up = ["bash", "scripts/up.sh", "--run-dir", str(run_dir), "--devices", "virt0",
          "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0", "--render-port", "0", "--web-port", "0"]
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
    finally:
        r = run(["bash", "scripts/down.sh", "--run-dir", str(run_dir), "--grace", "20"], env)
    assert r.returncode == 0, r.stderr
    assert not any(alive(p) for p in pids.values()), "down.sh left a stage running"
    assert not (run_dir / "endpoints.env").exists()
