"""The render service's read-only web page, in headless Chromium (Debian's `chromium` package; .ci/run
installs it), driven over the DevTools protocol on a pipe (--remote-debugging-pipe: NUL-separated JSON on fds 3/4).

With a token on the service: the page loads once opened with ?token= (the cookie carries it afterwards), a submitted
job appears, its progress moves through the stages, the stages' residency and the stage batches are drawn, and the
finished video plays (a <video> element reports the clip's duration and its time advances). Plain HTTP checks of
the same token rules: no token -> 401, the bearer header -> 200.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from h3.v1 import render_pb2
from tests.render_svc_util import RenderService, tiny_request, token_file, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
TOKEN = "web-test-token"
MD = (("authorization", f"Bearer {TOKEN}"),)


class Chromium:
    """Headless Chromium with the DevTools protocol on a pipe: we write commands to its fd 3, read from its fd 4."""

    def __init__(self, profile_dir, log_path):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 "--mute-audio", "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={profile_dir}",
                 "about:blank"]
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-', CHROMIUM, *flags],
            pass_fds=(cmd_r, out_w), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError("no answer from chromium")
            data = os.read(self._out_r, 1 << 16)
            if not data:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += data
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str = "", timeout_s: float = 30.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            got = self._message(deadline)
            if got.get("id") == self._id:  # events (no id) are not needed here
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got["result"]

    def open(self, url: str) -> str:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        return self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def eval(self, session: str, expr: str):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True}, session)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error in {expr!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self.log.close()


def _get(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_web_page_in_headless_chromium(stack, tmp_path):
    _, endpoints = stack
    svc = RenderService(tmp_path / "run", endpoints, ["--http-port", "0", "--token-file", str(token_file(tmp_path, TOKEN))])
    svc.start()
    browser = None
    try:
        port = int((tmp_path / "run" / "render.port.http").read_text())
        base = f"http://127.0.0.1:{port}/"
        assert _get(base) == 401 and _get(base + "api/state") == 401 and _get(base + "?token=wrong") == 401
        assert _get(base + "api/state", {"Authorization": f"Bearer {TOKEN}"}) == 200

        browser = Chromium(tmp_path / "profile", tmp_path / "chromium.log")
        page = browser.open(f"{base}?token={TOKEN}")  # sets the cookie, then the page polls with it
        # (no body yet while a loaded machine is still parsing the page: that is "not yet", not an error)
        wait_for(lambda: int(browser.eval(page, "(document.body && document.body.dataset.polls) || 0")) >= 1, 60,
                 "the page to load")

        job = svc.stub.Submit(tiny_request("a marching band passing by", steps=200, label="from-the-web-test"),
                              timeout=30, metadata=MD).job_id
        row = f'document.querySelector(\'tr[data-job="{job}"]\')'
        seen = []

        def observe():
            got = browser.eval(page, f"(r => r && [r.dataset.state, r.dataset.stage, +r.dataset.step])({row})")
            if got and got not in seen:
                seen.append(got)
            return got and got[0] == "succeeded"

        wait_for(observe, 180, f"job {job} to succeed on the page (seen {seen})")
        states = [s for s, _, _ in seen]
        assert {"queued", "running"} & set(states[:-1]), f"the job appeared before it finished: {seen}"
        # Progress: at least two distinct (stage, step) points while running (how many depends on machine load).
        assert len({(st, step) for s, st, step in seen if s == "running"}) >= 2, f"the page showed it progress: {seen}"
        assert browser.eval(page, f"{row}.textContent").count("from-the-web-test") == 1
        finished = browser.eval(page, f"[{row}.querySelector('td.stage').textContent, "
                                      f"{row}.querySelector('td.progress span').textContent.trim()]")
        assert finished == ["done", "done"], f"a finished job says done, not its last stage's progress: {finished}"

        video = f'document.querySelector(\'video[data-job="{job}"]\')'
        duration = wait_for(lambda: browser.eval(page, f"(v => v && v.readyState >= 1 && v.duration)({video})"),
                            60, "the video's metadata")
        assert abs(duration - 22 / 24) < 0.1, duration
        t = browser.eval(page, f"(async v => {{ v.muted = true; await v.play(); "
                               f"await new Promise(r => setTimeout(r, 600)); return v.currentTime; }})({video})")
        assert t > 0, "the video plays"

        # The residency lanes are sampled (each stage's Status every 0.5 s, the page every 0.7 s): wait for the
        # sample that shows the decoder resident (it stays so for the stack's 5 s idle-unload after the job). Read
        # at one instant, a loaded machine failed this once, with the decoder's "loading" drawn but not yet its
        # "resident".
        want = {"batches:encoder", "batches:dit", "batches:decoder", "decoder:resident"}
        lanes: list = []

        def drawn():
            lanes[:] = browser.eval(page, "[...document.querySelectorAll('#residency rect.span')]"
                                          ".map(r => r.dataset.lane + ':' + r.dataset.kind)")
            return want <= set(lanes)

        wait_for(drawn, 30, "the residency chart to draw the stage batches and the decoder resident",
                 lambda: f"drawn: {lanes}")
        info = svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=10, metadata=MD)
        assert info.state == render_pb2.JOB_SUCCEEDED
    finally:
        if browser is not None:
            browser.close()
        svc.stop()
