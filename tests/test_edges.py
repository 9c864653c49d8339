"""Process-lifecycle edges (docs/reliability.md "Hard edges"), against real stage processes.

One listener per port; a follower rank that outlives its rank 0 keeps the device leased; temp files never outlive
a failed, cancelled or killed mux (nor a killed client's download); a client that leaves stops the mux.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, decoder_pb2
from minimax_h3.contract import RenderSpec
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import decode, decode_inputs
from stagekit.lease import read_events
from tests.conftest import SERVER_ENV
from tests.procs import alive, open_paths, rank_pids
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]
SMALL = RenderSpec(prompt="x", width=256, height=256, frames=22)
# The clip of the client that leaves mid-mux. The mux checks for a cancel before it hands x264 each frame; x264 holds
# the frames it is given in its lookahead (veryslow: 60 frames) and encodes the last of them only after the last
# frame, past every check. SMALL is in x264's hands within a moment and nearly all of its mux is that final encode,
# where a cancel cannot land. This clip, longer than the lookahead and with 4x the pixels, keeps x264 encoding while
# the mux still takes frames for about 10 s on an idle machine (longer on a loaded one, which slows the mux as it
# delays the cancel); its sound, decoded before the mux starts, stays short.
LEAVER = RenderSpec(prompt="x", width=512, height=512, frames=107)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_cache):
    """A 2-rank DiT and a decoder sharing one lease dir on one virtual device; the decoder keeps its temp files in
    an explicit --temp-dir (so a restart finds what a killed one left) and muxes with x264's slowest preset, so a
    small render's mux lasts seconds and a kill lands inside it (a cancel needs a longer clip: LEAVER)."""
    run_dir = tmp_path_factory.mktemp("edges")
    s = EmbeddedStack(StackConfig(
        ranks={"dit": 2, "decoder": 1}, cache_dir=str(model_cache), run_dir=str(run_dir), devices="virt0",
        env=SERVER_ENV, extra_args={"dit": ["--idle-unload-s", "-1", "--collective-timeout-s", "10"],
                                    "decoder": ["--idle-unload-s", "-1", "--temp-dir", str(run_dir / "dectmp"),
                                                "--preset", "veryslow"]}))
    for stage in ("dit", "decoder"):
        s.start_stage(stage)
    for stage in ("dit", "decoder"):
        s.wait_ready(stage)
    yield s
    s.stop()


def clients_of(s: EmbeddedStack) -> StageClients:
    port = {st: s.ports.get(st, 1) for st in ("encoder", "dit", "decoder")}
    return StageClients(Endpoints(**{st: f"127.0.0.1:{p}" for st, p in port.items()}))


def temp_files(s: EmbeddedStack) -> list[str]:
    """Every file the decoder has in its temp dir (its per-process dirs, their lock files aside)."""
    root = s.run_dir / "dectmp"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".owner")


def latents(spec: RenderSpec, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (scale * torch.randn(24, spec.latent_frames, spec.height // 16, spec.width // 16, generator=g),
            torch.randn(2, 32, spec.audio_latents, generator=g))


def restart_decoder(s: EmbeddedStack) -> None:
    s.stop_stage("decoder")
    s.start_stage("decoder")
    s.wait_ready("decoder")


# ---- 4. one listener per port -------------------------------------------------------------------------------------
# A second server on a taken port refuses to start, and before any expensive work: its ports are bound first
# (stagekit/stage.py `_start`, step 1), so it writes nothing it would write while building its engine (the embedded
# model into --cache-dir, its device hold into --lease-dir) or starting its job service (the render job database).
TAKEN = {  # case -> (module, flags; {taken} is a port the stack serves, {d} this case's folder), flag named, untouched
    "grpc": ("decoder_svc", ["--port", "{taken}"], "--port", ["cache", "leases"]),
    "metrics": ("decoder_svc", ["--port", "0", "--metrics-port", "{taken}"], "--metrics-port", ["cache", "leases"]),
    "render grpc": ("render_svc", ["--port", "{taken}", "--run-dir", "{d}/run"], "--port", ["run"]),
    "render web": ("render_svc", ["--port", "0", "--http-port", "{taken}", "--run-dir", "{d}/run"], "--http-port",
                   ["run/render.sqlite3"]),
}


@pytest.mark.parametrize("case", TAKEN)
def test_a_second_server_on_a_taken_port_refuses_before_any_work(stack, tmp_path, case):
    module, flags, flag, untouched = TAKEN[case]
    port = stack.ports["decoder"]
    common = {"decoder_svc": ["--devices", "virt0", "--cache-dir", f"{tmp_path}/cache", "--lease-dir",
                              f"{tmp_path}/leases", "--temp-dir", str(tmp_path)],
              "render_svc": ["--encoder", "127.0.0.1:1", "--dit", "127.0.0.1:1", "--decoder", "127.0.0.1:1",
                             "--temp-dir", str(tmp_path)]}[module]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", module, *common, *(f.format(taken=port, d=tmp_path) for f in flags)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **SERVER_ENV})
    took = time.monotonic() - t0
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    stage = module.split("_")[0]
    assert r.returncode != 0 and "serving on" not in r.stdout, r.stdout + r.stderr[-2000:]
    assert last.startswith(f"{stage}: cannot start: cannot listen on 127.0.0.1:{port}: ") and "in use" in last, last
    assert last.endswith(f"pick another {flag}") and "Traceback" not in r.stderr, last
    assert not [u for u in untouched if (tmp_path / u).exists()], f"{case}: work done before the refusal"
    with clients_of(stack) as c:  # the first one still serves every call
        assert c.decoder.Status(common_pb2.StatusRequest(), timeout=10).stage == "decoder"
    print(f"\nsecond listener ({case}): exit {r.returncode} after {took:.1f}s: {last}")


# ---- 7. temp files -----------------------------------------------------------------------------------------------
def test_a_failed_mux_leaves_no_temp_file(stack, tmp_path):
    """Huge finite latents decode to non-finite pixels and the mux fails (without care an empty h3dec-*.mp4 is left
    in the system temp dir for every such request)."""
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("h3dec-*"))
    v, a = latents(SMALL, scale=1e30)
    with clients_of(stack) as c, pytest.raises(grpc.RpcError) as e:
        decode(c, SMALL, v, a, tmp_path / "bad.mp4", timeout_s=120)
    # Not an error the request check can see (the latents are finite): a fault the decoder finds in its own result,
    # INTERNAL naming the stage (stagekit/errors.py `Internal`), never the client's fault.
    assert e.value.code() == grpc.StatusCode.INTERNAL and e.value.details().startswith("decoder: "), e.value
    assert temp_files(stack) == [] and set(Path(os.environ.get("TMPDIR", "/tmp")).glob("h3dec-*")) <= before
    assert not list(tmp_path.iterdir()), "nothing next to the output either"


def test_mux_is_cancelled_when_the_client_leaves(stack, tmp_path):
    """The client cancels while the decoder muxes: the mux stops at the next frame (nothing is
    encoded for nobody), no file is kept, and the decoder is free for the next job. The leaving client's clip is
    LEAVER, whose mux takes frames long enough for the cancel to land there on a loaded machine too."""
    log = stack.run_dir / "decoder.log"
    seen = len(log.read_text(errors="replace"))
    with clients_of(stack) as c:
        call = c.decoder.Decode(decode_inputs(LEAVER, "leaver", *latents(LEAVER), decoder_pb2.MP4, 0), timeout=300)
        threading.Thread(target=lambda: [None for _ in _ignore_errors(call)], daemon=True).start()
        wait_for_mux(stack)
        t_cancel = time.monotonic()
        call.cancel()
        deadline = time.monotonic() + 60
        while c.decoder.Status(common_pb2.StatusRequest(), timeout=10).running:
            assert time.monotonic() < deadline, "the job never ended"
            time.sleep(0.02)
        stopped_s = time.monotonic() - t_cancel
        tail = log.read_text(errors="replace")[seen:]
        # This job's lines only: a decode another test left behind may finish meanwhile.
        assert "mux of leaver.mp4 abandoned" in tail and "(Cancelled)" in tail and "muxed leaver" not in tail, \
            tail[-2000:]
        assert temp_files(stack) == []
        r = decode(c, SMALL, *latents(SMALL), tmp_path / "next.mp4", timeout_s=120)
        assert r.extra["frames"] == 22
    line = next(x for x in tail.splitlines() if "leaver.mp4 abandoned" in x)
    # The log above proves the mux stopped short of the file; this bound only catches a wedged one (how long the
    # stop takes depends on the machine's load).
    assert stopped_s < 30, f"the decoder was busy {stopped_s:.2f}s after the client left"
    print(f"\nmux cancel: decoder idle {stopped_s:.2f}s after the client left; log: {line.split('INFO ')[-1]}")


def _ignore_errors(call):
    try:
        yield from call
    except grpc.RpcError:
        return


def wait_for_mux(s: EmbeddedStack, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(".mux-" in f for f in temp_files(s)):
        assert time.monotonic() < deadline, "the mux never started"
        time.sleep(0.01)


def test_kill_9_during_the_mux_leaves_nothing_after_a_restart(stack):
    pid = stack.procs["decoder"].pid
    out = stack.run_dir / "killed.mp4"
    t = threading.Thread(target=lambda: _quiet_decode(stack, *latents(SMALL), out), daemon=True)
    t.start()
    wait_for_mux(stack)
    os.killpg(pid, signal.SIGKILL)
    t.join(30)
    left = temp_files(stack)
    assert any(".mux-" in f for f in left), left  # what a kill -9 leaves ...
    restart_decoder(stack)
    assert temp_files(stack) == [], "... is removed when the next decoder starts"
    assert f"h3-decoder-{pid}" not in {p.name for p in (stack.run_dir / "dectmp").iterdir()}
    print(f"\nkill -9 mid-mux left {left}; removed at the next start")


def _quiet_decode(s: EmbeddedStack, v, a, out) -> None:
    try:
        with clients_of(s) as c:
            decode(c, SMALL, v, a, out, timeout_s=300)
    except grpc.RpcError:
        pass


CLIENT = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from minimax_h3.contract import RenderSpec
    from minimax_h3.services import Endpoints, StageClients
    from render_svc.stage_calls import decode
    spec = RenderSpec(prompt="x", width=256, height=256, frames=22)
    ep = f"127.0.0.1:{sys.argv[1]}"
    with StageClients(Endpoints(ep, ep, ep)) as c:
        decode(c, spec, torch.randn(24, spec.latent_frames, 16, 16), torch.randn(2, 32, spec.audio_latents),
               Path(sys.argv[2]), timeout_s=300)
""")


def test_a_killed_client_leaves_no_partial_output(stack, tmp_path):
    """`kill -9` of a client while it downloads: nothing is left next to -o (the partial file has no name until it
    is complete; no hidden `.v.mp4.*` is left behind)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(stack.ports["decoder"]), str(out_dir / "v.mp4")],
                            cwd=ROOT, env={**os.environ, **SERVER_ENV})
    try:
        deadline = time.monotonic() + 120
        while not any(p.startswith(str(out_dir)) for p in open_paths(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "the client never opened its output"
            time.sleep(0.01)
        opened = [p for p in open_paths(proc.pid) if p.startswith(str(out_dir))]
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(out_dir.iterdir()) == [], f"left behind: {list(out_dir.iterdir())} (the client had {opened} open)"
    print(f"\nkilled client had {opened} open; {out_dir} is empty")


# ---- 6. every rank holds its device ------------------------------------------------------------------------------
def test_a_follower_outliving_rank_0_keeps_the_device_leased(stack):
    """A 2-rank DiT holds its weights on virt0. Rank 1 hangs (SIGSTOP), rank 0 is killed: the decoder asking for
    virt0 must wait until rank 1 is gone too (it must not load 0.1 s after rank 0's death)."""
    lease_dir = stack.lease_dir
    with clients_of(stack) as c:
        c.decoder.Unload(common_pb2.UnloadRequest(), timeout=60)
        c.dit.Load(common_pb2.LoadRequest(), timeout=120)
        ranks = rank_pids(stack.procs["dit"].pid)
        assert set(ranks) == {0, 1}, ranks
        # rank 1 takes its hold as it loads, just after rank 0 answered
        wait_until(lambda: {"dit rank 0", "dit rank 1"} <= {e["holder"] for e in read_events(lease_dir)
                                                            if e["event"] == "rank_hold"},
                   what="both ranks to hold virt0 once loaded")
        os.kill(ranks[1], signal.SIGSTOP)
        os.kill(ranks[0], signal.SIGKILL)
        t_kill0 = time.time()
        box: dict = {}

        def load():
            try:
                c.decoder.Load(common_pb2.LoadRequest(), timeout=120)
                box["t"] = time.time()
            except grpc.RpcError as e:
                box["error"] = e

        t = threading.Thread(target=load, daemon=True)
        t.start()
        # The decoder has the lease (rank 0 is dead) and waits for rank 1, however long it took to get there ...
        waits = wait_until(lambda: [e for e in read_events(lease_dir) if e["event"] == "wait_ranks"
                                    and e["holder"].startswith("decoder")], what="the decoder to wait for rank 1")
        assert any("dit rank 1" in h for h in waits[-1]["holders"]), waits
        # ... and does not load while rank 1 lives
        assert not box, f"the decoder loaded {box.get('t', 0) - t_kill0:.2f}s after rank 0 died, rank 1 still holding"
        os.kill(ranks[1], signal.SIGKILL)
        t_kill1 = time.time()
        t.join(120)
        assert "t" in box, box
        assert box["t"] >= t_kill1 and box["t"] - t_kill1 < 60, (box["t"] - t_kill1)  # lease, then a load
    assert not alive(ranks[0]) and not alive(ranks[1])
    acquired = [e["t"] for e in read_events(lease_dir) if e["event"] == "acquire" and e["holder"].startswith("decoder")]
    assert acquired[-1] >= t_kill1
    print(f"\nfollower outliving rank 0: the decoder's lease came {acquired[-1] - t_kill0:.2f}s after rank 0's death, "
          f"{acquired[-1] - t_kill1:.2f}s after rank 1's; loaded {box['t'] - t_kill1:.2f}s after it")
