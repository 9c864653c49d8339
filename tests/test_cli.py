"""The render CLI as a user meets it: where outputs go, what it refuses by itself (before any stage is asked or
started) and how it says so, and its help."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import av
import pytest

from client.__main__ import main as client_main
from client.embedded import EmbeddedStack, StackConfig

SMALL = ["--width", "256", "--height", "256", "--frames", "22", "--steps", "1"]


def endpoint_args(stack) -> list[str]:
    _, ep = stack
    return ["--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder]


@pytest.fixture()
def no_stages(monkeypatch, tmp_path):
    """No stage configured anywhere, so a render that passed its checks would start an embedded stack."""
    for s in ("ENCODER", "DIT", "DECODER"):
        monkeypatch.delenv(f"H3_{s}", raising=False)
    return ["--endpoints-file", str(tmp_path / "none.env")]


def test_prompts_file_renders_into_a_folder(stack, tmp_path):
    """A trailing slash or an existing directory means "into this folder", with 1 prompt as with 3."""
    one, three = tmp_path / "one.txt", tmp_path / "three.txt"
    one.write_text("rain on a tin roof\n\n")
    three.write_text("a bell\n  \na drum\nwind in reeds\n")
    existing = tmp_path / "existing"
    existing.mkdir()
    umask = os.umask(0o022)
    os.umask(umask)
    for prompts, out, n in ((one, f"{tmp_path}/d1/", 1), (three, f"{tmp_path}/d3/", 3), (one, str(existing), 1)):
        assert client_main(["render", "--prompts-file", str(prompts), "-o", out, *SMALL, *endpoint_args(stack)]) == 0
        got = sorted(p.name for p in Path(out).iterdir())
        assert got == [f"{i:03d}.mp4" for i in range(n)], (out, got)
        for name in got:
            f = os.path.join(out, name)
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o666 & ~umask  # as any new file, not a temp file's 0600
            with av.open(f) as c:
                assert c.streams.video[0].width == 256 and c.streams.audio
    assert not (tmp_path / "d1").is_file()


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", ""], "error: prompt is empty"),
    (["--prompt", "   "], "error: prompt is empty"),
    ([], "error: give --prompt TEXT or --prompts-file FILE"),
    (["--prompt", "x", "--frames", "100"], "error: frames=100 is not valid"),
])
def test_refused_before_any_stage_with_exit_2(argv, needle, no_stages, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(EmbeddedStack, "start", lambda self: pytest.fail("a stack was started"))
    assert client_main(["render", *argv, "-o", str(tmp_path / "x.mp4"), *no_stages]) == 2
    assert needle in capsys.readouterr().err


def test_keyframe_refusals_name_the_file(no_stages, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(EmbeddedStack, "start", lambda self: pytest.fail("a stack was started"))
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")
    for path, needle in ((notes, "keyframe is not a readable PNG/JPEG image"), (tmp_path / "gone.png", "cannot read")):
        assert client_main(["render", "--prompt", "x", "--first-frame", str(path), *no_stages]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and needle in err and "BytesIO" not in err


def test_render_help_shows_defaults_and_ranges(capsys):
    with pytest.raises(SystemExit):
        client_main(["render", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("256..2048", "(default: 832)", "(default: 480)", "22..7196", "(default: 124 = 5.2 s)", "1..200",
                   "(default: 8)", "0..2^63-1", "(default: 0)", "(default: out.mp4; none with --detach)"):
        assert needle in out, needle


def test_embedded_stack_removes_its_temp_dir():
    s = EmbeddedStack(StackConfig())
    assert s.run_dir.is_dir() and s.run_dir.name.startswith("h3-stack-")
    s.stop()
    assert not s.run_dir.exists()


def test_ctrl_c_with_a_local_stack_says_what_it_stops_and_a_second_one_kills_it(tmp_path, capsys):
    """client/embedded.py CtrlC with a stack whose process drains slowly (it ignores SIGTERM): the first Ctrl-C says
    what it stops and interrupts; while the stack stops, a second one kills its processes (SIGKILL), and the stop
    ends there, removing the stack's run dir."""
    import signal
    import subprocess
    import threading

    from client.embedded import CtrlC
    from tests.waits import wait_until

    def ignores_sigterm(pid: int) -> bool:
        ignored = next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("SigIgn:")).split()[1]
        return bool(int(ignored, 16) >> (signal.SIGTERM - 1) & 1)

    stack = EmbeddedStack(StackConfig())
    slow = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 600"], start_new_session=True)
    stack.procs["dit"] = slow
    wait_until(lambda: ignores_sigterm(slow.pid), 30, what="the slow process ignoring SIGTERM")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's foreground process has it
    try:
        with CtrlC() as ctrl_c:
            ctrl_c.stack = stack
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                wait_until(lambda: False, 30, what="the first Ctrl-C")
            assert capsys.readouterr().err == "stopping the local stack (dit) ... (Ctrl-C again kills it)\n"

            def second() -> None:
                wait_until(lambda: not stack.procs, 30, what="the stop under way")  # taken out to be stopped
                os.kill(os.getpid(), signal.SIGINT)

            t = threading.Thread(target=second)
            t.start()
            ctrl_c.stop_stack()
            t.join()
        assert slow.returncode == -signal.SIGKILL and capsys.readouterr().err == "killing the local stack\n"
        assert not stack.run_dir.exists() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        slow.kill()
        slow.wait()
