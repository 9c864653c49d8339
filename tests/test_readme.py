"""README.md's commands, parsed from the file (not copied here) and run as printed, one after another in one copy
of the checkout, in a clean environment whose PATH has no project venv: the first command's render (its
`scripts/setup.sh` half is what `.ci/run` runs; here `.venv` is this checkout's), then "Running it": `scripts/up.sh`,
a render, a detached render, `jobs list`, `jobs watch` of that job, `... -m client status`, the load test and
`scripts/down.sh`. Each exits 0 and does what the README says; none trips over a file another one wrote."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import av

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "run", "outdir", "*.mp4", "__pycache__", "*.pyc", ".pytest_cache",
                              ".hypothesis", "*.egg-info", "build")


def readme_commands(section: str) -> list[list[str]]:
    """The command lines of the ```bash blocks under the README heading `section`, as argv (comments dropped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = re.split(r"^## ", text, flags=re.M)
    part = next(b for b in body if b.startswith(section))
    blocks = re.findall(r"```bash\n(.*?)```", part, flags=re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines() if line.strip()]


def find(cmds: list[list[str]], *head: str, exact: bool = False, having: str = "") -> list[str]:
    """The first command starting with `head` (with `exact`: the command is `head` itself; with `having`: one that
    has that argument too)."""
    for c in cmds:
        if tuple(c[:len(head)]) == head and (not exact or len(c) == len(head)) and (not having or having in c):
            return c
    raise AssertionError(f"README.md has no command {' '.join(head)!r} any more: update this test with it")


def test_readme_commands_run_as_printed(tmp_path, model_cache):
    first = readme_commands("Two commands")[0]
    assert first[:3] == ["bash", "scripts/setup.sh", "&&"], first
    first = first[3:]
    cmds = readme_commands("Running it")
    up, down = find(cmds, "scripts/up.sh", exact=True), find(cmds, "scripts/down.sh", exact=True)
    client = (".venv/bin/python", "-m", "client")
    render = find(cmds, *client, "render", "--prompt")
    detach = find(cmds, *client, "render", having="--detach")
    jobs_list, watch = find(cmds, *client, "jobs", "list", exact=True), find(cmds, *client, "jobs", "watch", "ID")
    fetch = find(cmds, *client, "jobs", "fetch", "ID")
    status = find(cmds, *client, "status")
    loadtest = find(cmds, *client, "loadtest")

    checkout = tmp_path / "checkout"  # run/, the MP4s: everything the commands write stays in here
    shutil.copytree(ROOT, checkout, ignore=SKIP)
    (checkout / ".venv").symlink_to(ROOT / ".venv")
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "TMPDIR": str(tmp),
           "OMP_NUM_THREADS": "1"}  # three stages share the CI's two cores
    for stage in ("ENCODER", "DIT", "DECODER"):
        env[f"H3_{stage}_CACHE_DIR"] = str(model_cache)  # the session's tiny models, not written again
        env[f"H3_{stage}_PORT"] = "0"  # up.sh's default ports, chosen by the OS here (README: H3_<STAGE>_PORT)
    env["H3_RENDER_PORT"] = env["H3_RENDER_HTTP_PORT"] = "0"

    def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        # umask 022 as on most desktops: the MP4 must come out 0644
        r = subprocess.run(["bash", "-c", "umask 022; exec " + shlex.join(argv)], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{shlex.join(argv)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r

    def check_mp4(argv: list[str], r: subprocess.CompletedProcess, size: tuple[int, int, int]) -> str:
        out = checkout / argv[argv.index("-o") + 1]
        assert (out.stat().st_mode & 0o777) == 0o644
        with av.open(str(out)) as c:
            v = c.streams.video[0]
            assert (v.width, v.height) == size[:2] and c.streams.audio
            assert sum(1 for _ in c.decode(video=0)) == size[2]
        assert f"wrote {out.name}" in r.stderr + r.stdout and "done in" in r.stderr
        return out.name

    def flags(argv: list[str]) -> tuple[int, int, int]:
        return tuple(int(argv[argv.index(k) + 1]) for k in ("--width", "--height", "--frames"))

    # 1. The first command, with nothing configured: an embedded stack with the tiny model, the default size.
    r = run(first)
    written = [check_mp4(first, r, (832, 480, 124))]
    assert "noise" in r.stderr, r.stderr  # the CLI says the tiny model's output is noise
    assert not list(tmp.glob("h3-stack-*")), "the embedded stack is gone with the command"
    try:
        r = run(up)
        endpoints = dict(e.split("=", 1) for e in (checkout / "run" / "endpoints.env").read_text().split())
        assert {"H3_ENCODER", "H3_DIT", "H3_DECODER", "H3_RENDER"} <= set(endpoints), endpoints
        assert all(f"{k}={v}" in r.stdout for k, v in endpoints.items())

        # 2. "1. One call", after the first command's MP4 is there: its own file.
        r = run(render)
        written.append(check_mp4(render, r, flags(render)))

        # 3. "2. Jobs": submitted and returned, listed, then watched to its end (ID: the id it printed).
        r = run(detach, timeout=60)
        job = re.fullmatch(r"job (\S+) \w+\n", r.stdout)
        assert job, r.stdout + r.stderr
        job = job[1]
        assert job in run(jobs_list, timeout=60).stdout
        r = run([job if a == "ID" else a for a in watch])
        assert re.search(r"\] succeeded\b", r.stdout), r.stdout
        run([job if a == "ID" else a for a in fetch], timeout=60)
        out = fetch[fetch.index("-o") + 1]
        with av.open(str(checkout / out)) as c:
            assert (c.streams.video[0].width, c.streams.video[0].height) == flags(detach)[:2] and c.streams.audio
        written.append(out)

        # 4. "3. Stage-level stubs": exit 0: every stage and the render service answer SERVING; the load test.
        r = run(status, timeout=60)
        for name in ("render", "encoder", "dit", "decoder"):
            assert re.search(rf"^{name}\s+\S+\s+SERVING", r.stdout, flags=re.M), r.stdout
        assert "embedded tiny model" in r.stdout, r.stdout

        r = run(loadtest)
        n = loadtest[loadtest.index("--requests") + 1]
        assert re.search(rf"\b{n} sent\b.*\b{n} ok\b", r.stdout), r.stdout
    finally:
        r = subprocess.run(down, cwd=checkout, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("stopped") == 4, r.stdout + r.stderr  # 3 stages + render service
    assert not (checkout / "run" / "endpoints.env").exists()
    assert not list(tmp.glob("h3-stack-*")), "no embedded stack was asked for, none may be left"
    assert sorted(p for p in os.listdir(checkout) if p.endswith(".mp4")) == sorted(written)
