"""The render service's hard edges, through real processes (the shared stage stack + render_svc processes).

- a stage's temporary refusal (RESOURCE_EXHAUSTED ... retry later: its upload slots taken) is waited out, the job
  showing "waiting for the dit stage (busy)", and the job then succeeds;
- a job store that cannot be written (the file-size limit of the service's process set to one byte, as a full disk)
  pauses the scheduler, is reported (Status, Submit's UNAVAILABLE) and is over once writes succeed again;
- Render / Watch streams take no work slot; a finished job's Watch ends, also from an index past its end (2^64-1);
- prompts are checked at submit; the event log does not copy the prompt; job ids are cut in errors;
- a drain (SIGTERM) spends no attempt, and a client following the job through the restart gets its MP4;
- a finished job is in the database file itself (WAL checkpointed); a missing or damaged job store beside outputs
  refuses the start with one line naming both;
- keyframes are stored once, by content, and removed with the last job that needs them;
- retention deletes finished jobs (rows and events) on a timer, and 1,920 jobs under --keep-jobs 100 leave the
  database bounded;
- a tokens file names principals: each sees, watches, fetches and cancels only its own jobs (an admin all), and
  idempotency keys are per principal;
- a stage that refuses the render service's own token or calls (a wrong --stage-token, an address of another
  service) fails the job FAILED_PRECONDITION naming the stage and what the operator fixes.
"""

from __future__ import annotations

import io
import os
import resource
import select
import shutil
import socket
import sqlite3
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from client.embedded import EmbeddedStack, StackConfig
from client.render_client import RenderClient
from h3.v1 import common_pb2, render_pb2, render_pb2_grpc
from minimax_h3.contract import MAX_PROMPT_BYTES
from minimax_h3.services import Endpoints, StageClients
from stagekit.channels import Security
from tests.render_svc_util import (ROOT, SERVER_ENV, TERMINAL, RenderService, holding_the_device, probe,
                                   self_signed_cert, serving, tiny_request, token_file, wait_for)

SUCCEEDED = render_pb2.JOB_SUCCEEDED


def _ref(job_id: str) -> render_pb2.JobRef:
    return render_pb2.JobRef(job_id=job_id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _progress_seen(svc, job_id: str, needle: str, timeout_s: float = 120.0) -> None:
    wait_for(lambda: needle in svc.stub.Get(_ref(job_id), timeout=10).progress.message, timeout_s,
             f"{needle!r} in the progress of job {job_id}", svc.log)


@pytest.fixture(scope="module")
def svc(stack, tmp_path_factory):
    _, endpoints = stack
    s = RenderService(tmp_path_factory.mktemp("render-edges"), endpoints,
                      ["--max-workers", "2", "--max-uploads", "1", "--retention-every-s", "0.5", "--keep-age-s", "600"])
    s.start()
    yield s
    s.stop()


def test_a_busy_stage_is_waited_out(stack, svc):
    """Every upload slot of the DiT taken by stalled uploads: the job waits (backoff) instead of failing."""
    s, endpoints = stack
    stop = threading.Event()

    def stalled():
        stop.wait(60)
        return
        yield  # noqa: unreachable - a request stream that sends nothing until released

    with StageClients(endpoints) as c:
        stalls = [c.stub("dit").Sample(stalled(), timeout=60) for _ in range(8)]  # the DiT's --max-uploads
        try:
            job = svc.stub.Submit(tiny_request("a busy moment"), timeout=30).job_id
            _progress_seen(svc, job, "waiting for the dit stage (busy)")
            assert svc.stub.Get(_ref(job), timeout=10).state == render_pb2.JOB_RUNNING
        finally:
            stop.set()
            for call in stalls:
                call.cancel()
    info = svc.wait_state(job, TERMINAL)
    assert info.state == SUCCEEDED, info


def test_streams_take_no_work_slot_and_a_finished_watch_ends(stack, svc):
    """--max-workers 2: six open Watch streams leave Submit, Get, List free; Watch of a finished job ends."""
    s, _ = stack
    with holding_the_device(s.lease_dir):
        job = svc.stub.Submit(tiny_request("watched by many"), timeout=30).job_id
        watches = [svc.stub.Watch(render_pb2.WatchRequest(job_id=job), timeout=120) for _ in range(6)]
        try:
            for w in watches:
                next(w)  # each stream is open and served
            other = svc.stub.Submit(tiny_request("still accepted", seed=1), timeout=30).job_id
            assert svc.stub.Get(_ref(other), timeout=10).job_id == other
            assert len(svc.stub.List(render_pb2.ListRequest(), timeout=10).jobs) >= 2
        finally:
            for w in watches:
                w.cancel()
    for j in (job, other):
        assert svc.wait_state(j, TERMINAL).state == SUCCEEDED
    n = svc.stub.Get(_ref(job), timeout=10).events
    for start in (n, n + 5, 2**63, 2**64 - 1):
        t0 = time.monotonic()
        assert list(svc.stub.Watch(render_pb2.WatchRequest(job_id=job, from_index=start), timeout=30)) == []
        assert time.monotonic() - t0 < 5
    assert [e.index for e in svc.stub.Watch(render_pb2.WatchRequest(job_id=job, from_index=n - 1), timeout=30)] \
        == [n - 1]


def test_prompts_are_checked_at_submit_and_events_do_not_copy_them(svc):
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(tiny_request("x" * (MAX_PROMPT_BYTES + 1)), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_PROMPT_BYTES} bytes" in e.value.details()
    prompt = "a long and careful description of a storm at sea " * 20  # 1 KB: within the encoder's token limit
    job = svc.stub.Submit(tiny_request(prompt, idempotency_key="long prompt"), timeout=30).job_id
    assert svc.stub.Get(_ref(job), timeout=10).params.prompt == prompt
    events = list(svc.stub.Watch(render_pb2.WatchRequest(job_id=job), timeout=180))
    assert events and all(prompt not in ev.SerializeToString().decode(errors="ignore") for ev in events)
    huge = "f" * (1 << 20)
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Get(_ref(huge), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < 400


def test_retention_runs_on_a_timer(stack, tmp_path):
    """--keep-age-s 2: a finished job is deleted (row and events) with no other job ending after it."""
    _, endpoints = stack
    with serving(tmp_path / "run", endpoints, ["--keep-age-s", "2", "--retention-every-s", "0.5"]) as svc:
        job = svc.stub.Submit(tiny_request("short-lived"), timeout=30).job_id
        assert svc.wait_state(job, TERMINAL).state == SUCCEEDED
        mp4 = tmp_path / "run" / "render" / "outputs" / f"{job}.mp4"
        assert mp4.exists()

        def gone():
            try:
                svc.stub.Get(_ref(job), timeout=10)
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.NOT_FOUND and "--keep-age-s" in e.details()
            return False
        wait_for(gone, 30, "the job deleted by the retention timer", svc.log)
        # The row goes first, then its MP4 (a crash between the two leaves a stray file, swept at the next start).
        wait_for(lambda: not mp4.exists(), 10, "the job's MP4 deleted after its row", svc.log)
        db = sqlite3.connect(tmp_path / "run" / "render" / "render.sqlite3")
        assert db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?", (job,)).fetchone()[0] == 0
        db.close()


def test_a_full_disk_pauses_the_scheduler_and_it_recovers(stack, tmp_path):
    s, endpoints = stack
    with serving(tmp_path / "run", endpoints) as svc:
        with holding_the_device(s.lease_dir):
            job = svc.stub.Submit(tiny_request("through a full disk"), timeout=30).job_id
            wait_for(lambda: svc.stub.Get(_ref(job), timeout=10).stage == "encoder", 60, "the job in the encoder")
            _, hard = resource.prlimit(svc.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(svc.pid, resource.RLIMIT_FSIZE, (1, hard))  # every write past byte 0 fails
        try:
            status = wait_for(lambda: (st := svc.stub.Status(common_pb2.StatusRequest(), timeout=10)).health
                              .startswith("DEGRADED") and st, 120, "the storage error reported", svc.log)
            assert "render.sqlite3" in status.health, status.health
            with pytest.raises(grpc.RpcError) as e:
                svc.stub.Submit(tiny_request("refused for now", seed=3), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "cannot be written" in e.value.details()
        finally:
            resource.prlimit(svc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        assert svc.wait_state(job, TERMINAL).state == SUCCEEDED
        assert svc.stub.Status(common_pb2.StatusRequest(), timeout=10).health == "SERVING"
        after = svc.stub.Submit(tiny_request("after the space came back", seed=4), timeout=30).job_id
        assert svc.wait_state(after, TERMINAL).state == SUCCEEDED


def test_a_drain_spends_no_attempt_and_a_follower_gets_the_mp4(stack, tmp_path):
    """--max-attempts 1: SIGTERM with the job running, restart on the same port; the job runs again and a client
    that followed it through the restart gets the MP4. The finished job is in the database file alone."""
    s, endpoints = stack
    port = _free_port()
    extra = ["--max-attempts", "1", "--drain-s", "1", "--port", str(port)]
    svc = RenderService(tmp_path / "run", endpoints, extra)
    svc.start()
    got: dict = {}
    with holding_the_device(s.lease_dir):
        job = svc.stub.Submit(tiny_request("across a restart"), timeout=30).job_id
        wait_for(lambda: svc.stub.Get(_ref(job), timeout=10).stage == "encoder", 60, "the job in the encoder")
        rc = RenderClient(svc.target)
        follower = threading.Thread(target=lambda: got.update(info=rc.follow(job, tmp_path / "out.mp4")))
        follower.start()
        time.sleep(0.5)
        svc.stop()  # SIGTERM: the drain stops the batch
        svc2 = RenderService(tmp_path / "run", endpoints, extra)
        svc2.start()
    try:
        info = svc2.wait_state(job, TERMINAL)
        assert info.state == SUCCEEDED and info.attempts == 1, info
        follower.join(120)
        assert got["info"].state == SUCCEEDED and probe(tmp_path / "out.mp4")["frames"] == 22
        svc2.kill()  # no checkpoint at exit: the finished job must already be in the database file
        db_only = tmp_path / "copy.sqlite3"
        shutil.copy(tmp_path / "run" / "render" / "render.sqlite3", db_only)
        db = sqlite3.connect(db_only)
        assert db.execute("SELECT state FROM jobs WHERE id = ?", (job,)).fetchone() == (SUCCEEDED,)
        db.close()
    finally:
        rc.close()
        svc2.stop()


def _start_refused(run_dir, endpoints) -> str:
    p = subprocess.run([sys.executable, "-m", "render_svc", "--port", "0", "--run-dir", str(run_dir), "--encoder",
                        endpoints.encoder, "--dit", endpoints.dit, "--decoder", endpoints.decoder],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**SERVER_ENV, **_env(), "TMPDIR": str(run_dir.parent)})  # no other process's temp dirs
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    return lines[0]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH", "TMPDIR")}


def test_a_missing_or_damaged_job_store_beside_outputs_refuses_the_start(stack, tmp_path):
    _, endpoints = stack
    run = tmp_path / "run"
    (run / "outputs").mkdir(parents=True)
    (run / "outputs" / "0123456789abcdef.mp4").write_bytes(b"an earlier job's video")
    line = _start_refused(run, endpoints)
    assert "render.sqlite3" in line and str(run / "outputs") in line and "holds no jobs" in line, line
    (run / "render.sqlite3").write_bytes(b"not a database" * 100)
    line = _start_refused(run, endpoints)
    assert "render.sqlite3" in line and "cannot be read" in line, line


def test_keyframes_are_stored_once(stack, svc):
    s, _ = stack
    png = _png(7)
    kdir = svc.stack.run_dir / "render" / "keyframes"
    with holding_the_device(s.lease_dir):
        jobs = [svc.stub.Submit(tiny_request("from one keyframe", seed=i, first_frame=png, last_frame=png),
                                timeout=30).job_id for i in range(3)]
        assert [p.read_bytes() for p in kdir.iterdir()] == [png]
        db = sqlite3.connect(svc.stack.run_dir / "render" / "render.sqlite3")
        assert db.execute("SELECT MAX(LENGTH(request)) FROM jobs").fetchone()[0] < len(png) // 4
        db.close()
        for j in jobs:
            svc.stub.Cancel(_ref(j), timeout=60)
    assert all(svc.wait_state(j, TERMINAL).state == render_pb2.JOB_CANCELLED for j in jobs)
    assert list(kdir.iterdir()) == []


def test_thousands_of_jobs_leave_the_database_bounded(tmp_path):
    """Stages unreachable (each job fails at once): 1,920 jobs in six rounds through --keep-jobs 100, each round three
    times the jobs kept. The run dir is on tmpfs where there is one: the test is about what the database holds, not
    about the disk's fsync (8 ms here)."""
    dead = f"127.0.0.1:{_free_port()}"
    from minimax_h3.services import Endpoints

    shm = Path("/dev/shm")
    run = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path / "run"
    svc = RenderService(run, Endpoints(dead, dead, dead),
                        ["--keep-jobs", "100", "--max-jobs-queued", "20000", "--stage-retries", "0",
                         "--max-batch", "64", "--max-wait-batches", "64"])
    svc.start()
    db_file = run / "render" / "render.sqlite3"
    try:
        sizes = []
        for rnd in range(6):
            ids = []
            for k in range(0, 320, 32):  # 32 at a time: the service's 64 work slots are the bound here
                calls = [svc.stub.Submit.future(tiny_request(f"job {rnd}.{i}"), timeout=120) for i in range(k, k + 32)]
                ids += [c.result().job_id for c in calls]
            wait_for(lambda: svc.stub.Status(common_pb2.StatusRequest(), timeout=10).queued == 0 and
                     svc.stub.Status(common_pb2.StatusRequest(), timeout=10).running == 0, 300, "the round done")
            sizes.append(db_file.stat().st_size)
        st = svc.stub.Status(common_pb2.StatusRequest(), timeout=10)
        assert st.failed <= 100 and len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=10).jobs) <= 100
        assert svc.stub.Get(_ref(ids[-1]), timeout=10).state == render_pb2.JOB_FAILED
        assert sizes[-1] < 2 * sizes[1], sizes  # freed pages are reused: 3x the jobs, not 3x the file
        svc.stop()  # SIGTERM: drained, the WAL checkpointed
        db = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
        try:
            jobs = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
            events, orphans = db.execute("SELECT COUNT(*), COUNT(*) FILTER (WHERE job_id NOT IN (SELECT id FROM "
                                         "jobs)) FROM events").fetchone()
        finally:
            db.close()
        assert jobs <= 100 and orphans == 0 and events <= 10 * jobs, (jobs, events, orphans)
        wal = db_file.with_name(db_file.name + "-wal")
        assert not wal.exists() or wal.stat().st_size < sizes[-1], "the WAL grew past the database"
    finally:
        svc.stop()
        shutil.rmtree(run, ignore_errors=True)


def test_jobs_belong_to_their_principal(stack, tmp_path):
    _, endpoints = stack
    tokens = tmp_path / "tokens"
    tokens.write_text("# principals\nalice tok-alice\nbob tok-bob\nops tok-ops admin\n")
    svc = RenderService(tmp_path / "run", endpoints, ["--tokens-file", str(tokens), "--http-port", "0"])
    svc.start()
    page = f"http://127.0.0.1:{int((tmp_path / 'run' / 'render.port.http').read_text())}"
    chans = {}
    try:
        from stagekit.channels import open_channel

        def stub(who):
            chans[who] = chans.get(who) or open_channel(svc.target)
            return render_pb2_grpc.RendererStub(chans[who]), [("authorization", f"Bearer tok-{who}")]

        a, amd = stub("alice")
        b, bmd = stub("bob")
        o, omd = stub("ops")
        ja = a.Submit(tiny_request("alice's", idempotency_key="k"), timeout=30, metadata=amd).job_id
        jb = b.Submit(tiny_request("bob's", idempotency_key="k"), timeout=30, metadata=bmd).job_id
        assert ja != jb  # the same key, two principals: two jobs
        with pytest.raises(grpc.RpcError) as e:
            a.Submit(tiny_request("alice's other", idempotency_key="k"), timeout=30, metadata=amd)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and ja in e.value.details() \
            and jb not in e.value.details()
        assert [j.job_id for j in a.List(render_pb2.ListRequest(), timeout=10, metadata=amd).jobs] == [ja]
        assert {j.job_id for j in o.List(render_pb2.ListRequest(), timeout=10, metadata=omd).jobs} == {ja, jb}
        for call in (lambda: b.Get(_ref(ja), timeout=10, metadata=bmd),
                     lambda: b.Cancel(_ref(ja), timeout=10, metadata=bmd),
                     lambda: list(b.Watch(render_pb2.WatchRequest(job_id=ja), timeout=10, metadata=bmd)),
                     lambda: list(b.Fetch(render_pb2.FetchRequest(job_id=ja), timeout=10, metadata=bmd))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        wait_for(lambda: o.Get(_ref(ja), timeout=10, metadata=omd).state in TERMINAL, 180, "alice's job done")
        assert a.Get(_ref(ja), timeout=10, metadata=amd).state == SUCCEEDED
        assert sum(len(c.data) for c in a.Fetch(render_pb2.FetchRequest(job_id=ja), timeout=30, metadata=amd)) > 0
        assert o.Cancel(_ref(jb), timeout=60, metadata=omd).job_id == jb
        assert {j["job_id"] for j in _page_state(page, "bob")["jobs"]} == {jb}
        assert {j["job_id"] for j in _page_state(page, "ops")["jobs"]} == {ja, jb}
        assert _page_status(f"{page}/video/{ja}.mp4", "bob") == 404
        assert _page_status(f"{page}/video/{ja}.mp4", "alice") == 200
    finally:
        for c in chans.values():
            c.close()
        svc.stop()


def _page_status(url: str, who: str) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer tok-{who}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _page_state(page: str, who: str) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(f"{page}/api/state", headers={"Authorization": f"Bearer tok-{who}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_token_on_the_command_line_is_refused(stack, tmp_path):
    _, endpoints = stack
    p = subprocess.run([sys.executable, "-m", "render_svc", "--token", "secret", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env={**SERVER_ENV, **_env()})
    assert p.returncode != 0 and "--token is not accepted on the command line" in p.stderr \
        and "--token-file" in p.stderr and "H3_RENDER_TOKEN" in p.stderr, p.stderr
    c = subprocess.run([sys.executable, "-m", "client", "jobs", "list", "--token", "secret"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**SERVER_ENV, **_env()})
    assert c.returncode == 2 and "--token is not accepted on the command line" in c.stderr \
        and "--token-file" in c.stderr and "H3_TOKEN" in c.stderr, c.stderr


def _https_get(port: int, cafile, host: str = "127.0.0.1", timeout_s: float = 30.0) -> int:
    """GET /api/state over TLS with `Connection: close`, read until the server closes the connection (the page gives
    the connection's slot back before that): the status code."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(f"GET /api/state HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return int(data.split(b" ", 2)[1])


def _heard(conn: socket.socket) -> bool:
    """Whether the server has sent anything on `conn` or closed it (a connection that never sent anything: a
    failed handshake's alert or the close), read without waiting."""
    return bool(select.select([conn], [], [], 0)[0])


def _closed(conn: socket.socket) -> bool:
    """Whether the server has closed `conn`: what it sent before (a failed handshake's alert) read and dropped."""
    while _heard(conn):
        try:
            if not conn.recv(1 << 12):
                return True
        except ConnectionResetError:
            return True
    return False


def test_https_page_handshakes_off_the_accept_loop_with_a_cap_and_a_host_check(stack, tmp_path):
    """An idle TCP connection does not block the HTTPS page; a foreign Host: gets 421; the connection beyond the
    cap is closed at once while the ones in the cap wait for their hello, and the cap frees itself as their
    handshakes time out. Each step waits on what the server did to a connection (closed it, or not yet), never
    on how long something takes."""
    cap_n, header_s = 8, 5.0
    _, endpoints = stack
    cert, key = self_signed_cert(tmp_path)
    svc = RenderService(tmp_path / "run", endpoints,
                        ["--http-port", "0", "--tls-cert", str(cert), "--tls-key", str(key), "--http-header-s",
                         str(header_s), "--http-max-connections", str(cap_n), "--http-max-per-address", str(cap_n),
                         "--http-reserved-connections", "0"])
    svc.stack.cfg.security = Security(tls_ca=str(cert))
    svc.start()
    conns: list[socket.socket] = []
    try:
        port = int((tmp_path / "run" / "render.port.http").read_text())
        # 1. A connection that never says hello holds a slot; the page answers meanwhile, with that connection
        #    still open: its handshake is not waited for on the accept loop.
        idle = socket.create_connection(("127.0.0.1", port))
        conns.append(idle)
        assert _https_get(port, cert) == 200 and not _heard(idle)
        assert _https_get(port, cert, host="localhost") == 200
        assert _https_get(port, cert, host="rebound.example") == 421
        # 2. Every slot free again: the GETs were read to the server's close, and the idle connection ends (our
        #    side shut for writing, so we see the server close it, which it does after giving the slot back).
        idle.shutdown(socket.SHUT_WR)
        wait_for(lambda: _closed(idle), 60, "the server to close the connection that ended")
        # 3. --http-max-connections silent connections fill the cap. The listen queue holds them all, so the server
        #    takes them in the order they connected, and the next one is the first beyond the cap: closed before any
        #    handshake, while all in the cap still wait for their hello. A TLS client is refused the same way.
        cap = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap_n)]
        conns += cap
        beyond = socket.create_connection(("127.0.0.1", port))
        conns.append(beyond)
        wait_for(lambda: _closed(beyond), 60, "the cap to close the connection beyond it")
        assert not [c for c in cap if _heard(c)], "no connection in the cap was closed before the one beyond it"
        with pytest.raises(OSError):
            _https_get(port, cert)
        # 4. The cap frees itself: each silent handshake times out and the server closes it (slot first).
        wait_for(lambda: all(_closed(c) for c in cap), header_s + 60, "the handshakes in the cap to time out")
        assert _https_get(port, cert) == 200
    finally:
        for c in conns:
            c.close()
        svc.stop()


def test_a_stage_refusing_the_services_own_token_or_calls_is_the_operators_to_fix(stack, tmp_path, model_cache):
    """The render service with a wrong --stage-token for a stage that requires one, and with --encoder pointing at
    another service (the decoder): each job fails FAILED_PRECONDITION naming the encoder stage and what the
    operator fixes, never with the stage's UNAUTHENTICATED / UNIMPLEMENTED as if the user's own token or call were
    wrong; the render service's log says the same."""
    _, endpoints = stack
    token = "the-encoders-token"
    encoder = EmbeddedStack(StackConfig(ranks={"encoder": 1}, cache_dir=str(model_cache),
                                        run_dir=str(tmp_path / "enc"), devices="virt0", env=SERVER_ENV, security=Security(token=token),
                                        extra_args={"encoder": ["--token-file", str(token_file(tmp_path, token))]}))
    encoder.start_stage("encoder")
    try:
        encoder.wait_ready("encoder")
        cases = {"UNAUTHENTICATED": (f"127.0.0.1:{encoder.ports['encoder']}", "--stage-token"),
                 "UNIMPLEMENTED": (endpoints.decoder, "--encoder at the encoder stage")}
        for said, (address, fix) in cases.items():
            stages = Endpoints(encoder=address, dit=endpoints.dit, decoder=endpoints.decoder)
            with serving(tmp_path / said, stages, ["--stage-token", "not-the-encoders-token"]) as svc:
                job = svc.stub.Submit(tiny_request(f"refused as {said}"), timeout=30).job_id
                info = svc.wait_state(job, TERMINAL)
                assert info.state == render_pb2.JOB_FAILED and info.error_code == "FAILED_PRECONDITION", info
                assert "cannot use its encoder stage" in info.error and fix in info.error and said in info.error
                wait_for(lambda: info.error in svc.log(), 10, "the refusal in the render service's log", svc.log)
    finally:
        encoder.stop()
