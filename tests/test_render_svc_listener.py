"""The render service's HTTP listener (the web page and `/v1/videos`, render_svc/web.py) against callers that hold its
connections or send what costs or breaks a parser: a real `python -m render_svc` whose stage addresses have nothing
listening (no stage is needed; a job fails at its first stage), its listener on loopback with small limits set by
flag. Other client addresses are other loopback addresses (127.0.0.2, ...): Linux routes all of 127/8 to the
listener on 127.0.0.1.

- the request line and headers have one deadline (--http-header-s), however slowly they drip: 408, the slots free;
- --http-max-per-address: one address' connections beyond it get 503 while another address is served;
- --http-reserved-connections: once the other slots are taken, a connection is served only with a valid token, and
  connections that send nothing cannot hold those slots;
- a multipart form of more parts than a create request has is refused when the parser meets the first one too many;
- malformed values (a lone surrogate in JSON, 5,000-digit numbers, digits of other scripts) are 4xx, never 500;
- /api/state shows a non-admin principal only its own job ids, in the jobs and in the batches;
- limits that cannot work refuse the start, naming the flag.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import threading

import pytest

from minimax_h3.services import Endpoints
from render_svc.http_api import MAX_FORM_PARTS
from render_svc.server import RenderConfig
from render_svc.store import SUCCEEDED, JobStore
from render_svc.web import Limits
from stagekit.config import parse_config
from stagekit.errors import FailedPrecondition
from tests.render_svc_util import RenderService, tiny_request, wait_for

HEADER_S = 5.0  # --http-header-s: what the drippers run into; every other request here is sent in one write on connecting
MAX_CONNECTIONS, PER_ADDRESS, RESERVED = 6, 3, 2
TINY = {"size": "256x256", "frames": 22, "steps": 1}
VIDEO = bytes(range(256)) * 40  # the seeded job's "MP4": the listener serves bytes, whatever they are


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    """The service (principals alice, bob, and ops an admin) with one finished job of alice's in its job store."""
    d = tmp_path_factory.mktemp("listener")
    tokens = d / "tokens"
    tokens.write_text("alice tok-alice\nbob tok-bob\nops tok-ops admin\n")
    store = JobStore(d / "run" / "render")
    rec, _ = store.submit(tiny_request("a finished one"), owner="alice")
    out = d / "run" / "render" / "outputs" / f"{rec.id}.mp4"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(VIDEO)
    store.start(rec.id, "encoder")
    store.finish(rec.id, SUCCEEDED, output=str(out), output_bytes=len(VIDEO))
    store.close()
    dead = f"127.0.0.1:{_free_port()}"
    s = RenderService(d / "run", Endpoints(dead, dead, dead),
                      ["--tokens-file", str(tokens), "--http-port", "0", "--stage-retries", "0",
                       "--http-header-s", str(HEADER_S), "--http-max-connections", str(MAX_CONNECTIONS),
                       "--http-max-per-address", str(PER_ADDRESS), "--http-reserved-connections", str(RESERVED)])
    s.start()
    s.port = int((d / "run" / "render.port.http").read_text())
    s.finished = rec.id
    yield s
    s.stop()


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:  # the server closed with our unread bytes in its buffer: what it sent is read
        pass
    return data


def _parse(data: bytes) -> tuple[int, dict, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ", 2)[1]), headers, body


def _call(port: int, method: str, path: str, who: str | None = None, source: str = "127.0.0.1",
          headers: dict | None = None, body: bytes = b"") -> tuple[int, dict, bytes]:
    """One request with `Connection: close`, read until the server closes the connection (which it does after giving
    the connection's slot back): status, headers, body."""
    hdrs = {"Host": f"127.0.0.1:{port}", "Connection": "close", "Content-Length": str(len(body)), **(headers or {})}
    if who:
        hdrs["Authorization"] = f"Bearer tok-{who}"
    with _connect(port, source) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
                  .encode("latin-1") + b"\r\n" + body)
        return _parse(_read_to_close(s))


def _refused_at_accept(port: int, source: str) -> tuple[int, bytes]:
    """Connect and send nothing: what the server answers unasked (a refusal at accept), read to its close."""
    with _connect(port, source) as s:
        status, _, body = _parse(_read_to_close(s))
        return status, body


def _kept_alive(port: int, source: str, who: str | None = None) -> http.client.HTTPConnection:
    """A connection that made one request and stays open (HTTP/1.1 keep-alive), idle: it holds its slot."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    c.request("GET", "/v1/videos" if who else "/v1/openapi.json",
              headers={"Authorization": f"Bearer tok-{who}"} if who else {})
    r = c.getresponse()
    r.read()
    assert r.status == 200 and not r.will_close
    return c


def _release(conns: list[http.client.HTTPConnection]) -> None:
    """End kept-alive connections and wait until the server has closed each (after giving its slot back)."""
    for c in conns:
        c.sock.shutdown(socket.SHUT_WR)
    for c in conns:
        assert _read_to_close(c.sock) == b""
        c.close()


def _ended(sock: socket.socket, got: bytearray) -> bool:
    """Whether the server has closed `sock`, read without waiting; what it sent is added to `got`."""
    while select.select([sock], [], [], 0)[0]:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return True
        if not data:
            return True
        got += data
    return False


def test_an_address_past_its_cap_is_refused_and_reserved_slots_take_only_tokens(svc):
    """Kept-alive idle connections hold slots (for up to 30 s, far beyond the test's steps). Three from 127.0.0.1
    are its --http-max-per-address: a fourth from it is refused at accept, 127.0.0.2 is served. With four held, the
    rest are --http-reserved-connections: a request without a token gets 503, one with a token is served, also when
    two connections that send nothing hold the reserved slots: it takes the slot of the one that has waited longest
    (closed without an answer). With all six held by served connections, the next one is refused at accept."""
    held = [_kept_alive(svc.port, "127.0.0.1") for _ in range(PER_ADDRESS)]
    silent: list[socket.socket] = []
    try:
        status, body = _refused_at_accept(svc.port, "127.0.0.1")
        assert status == 503 and b"--http-max-per-address" in body and b"127.0.0.1" in body, body
        assert _call(svc.port, "GET", "/v1/openapi.json", source="127.0.0.2")[0] == 200
        held.append(_kept_alive(svc.port, "127.0.0.2"))  # the last slot that takes requests without a token
        status, headers, body = _call(svc.port, "GET", "/v1/openapi.json", source="127.0.0.3")
        assert status == 503 and headers["Retry-After"] and b"--http-reserved-connections" in body, body
        assert _call(svc.port, "GET", "/v1/videos", who="alice", source="127.0.0.3")[0] == 200

        silent = [_connect(svc.port, "127.0.0.5") for _ in range(RESERVED)]  # every slot taken now
        assert _call(svc.port, "GET", "/v1/videos", who="alice", source="127.0.0.6")[0] == 200
        got = bytearray()
        wait_for(lambda: _ended(silent[0], got), 60, "the longest waiting connection dropped")
        assert got == b"" and not select.select([silent[1]], [], [], 0)[0]  # no 408: dropped, and only it
        silent[1].shutdown(socket.SHUT_WR)  # it leaves: the server closes it once its slot is free
        assert _read_to_close(silent[1]) == b""

        held += [_kept_alive(svc.port, "127.0.0.3", "alice"), _kept_alive(svc.port, "127.0.0.4", "bob")]
        status, body = _refused_at_accept(svc.port, "127.0.0.5")
        assert status == 503 and b"--http-max-connections" in body, body
    finally:
        for s in silent:
            s.close()
        _release(held)
    assert _call(svc.port, "GET", "/v1/openapi.json", source="127.0.0.5")[0] == 200


def test_dripped_or_missing_headers_are_cut_at_their_deadline(svc):
    """Three connections from one address (its whole cap) drip their headers a byte every 0.1 s, far inside any
    idle timeout, and one from another address sends nothing: the server answers each 408 once --http-header-s has
    passed since its accept and closes it, and the address is served again."""
    drippers = [_connect(svc.port, "127.0.0.1") for _ in range(PER_ADDRESS)]
    silent = _connect(svc.port, "127.0.0.2")
    got = {s: bytearray() for s in [*drippers, silent]}
    ended: set[socket.socket] = set()
    stop = threading.Event()

    def drip():
        for s in drippers:
            s.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while not stop.wait(0.1):
            for s in drippers:
                if s not in ended:
                    try:
                        s.send(b"x")
                    except OSError:
                        pass

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        def all_ended():
            ended.update(s for s in got if s not in ended and _ended(s, got[s]))
            return len(ended) == len(got)

        wait_for(all_ended, HEADER_S + 60, "the server to end every connection whose headers did not arrive")
    finally:
        stop.set()
        t.join()
        for s in got:
            s.close()
    for data in got.values():
        status, _, body = _parse(bytes(data))
        assert status == 408 and b"--http-header-s" in body, bytes(data)
    assert _call(svc.port, "GET", "/v1/openapi.json", source="127.0.0.1")[0] == 200


def _form(parts: list[tuple[str, str, bytes]], boundary: str = "b0und") -> tuple[bytes, str]:
    """A multipart/form-data body of (name, extra header lines, content) parts and its Content-Type."""
    out = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n{extra}\r\n'.encode()
                   + content + b"\r\n" for name, extra, content in parts)
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _create(svc, body: bytes, ctype: str, who: str = "alice") -> tuple[int, dict]:
    status, _, payload = _call(svc.port, "POST", "/v1/videos", who, headers={"Content-Type": ctype}, body=body)
    return status, json.loads(payload)


def test_a_form_of_too_many_parts_is_refused_as_it_is_parsed(svc):
    """A create form has at most one part per field and 12 reference files (MAX_FORM_PARTS); a 1 MB body of ~20,000
    tiny parts, and one part nesting 1,000, are refused for their part count; a form of exactly MAX_FORM_PARTS
    parts is taken."""
    tiny = [("label", "", b"x")] * 20_000
    nested, inner = _form([("label", "", b"x")] * 1000, "inner")
    for parts in ([("prompt", "", b"a bomb"), *tiny],
                  [("prompt", "", b"a bomb"), ("reference", f"Content-Type: {inner}\r\n", nested)]):
        status, e = _create(svc, *_form(parts))
        assert status == 400 and f"more than {MAX_FORM_PARTS} parts" in e["error"]["message"], e
    enough = [("prompt", "", b"just enough parts"), *[("label", "", b"x")] * (MAX_FORM_PARTS - 1)]
    status, v = _create(svc, *_form(enough))
    assert status == 200 and v["label"] == "x", v


def test_malformed_values_are_the_callers_400s(svc):
    """Values a parser would take and then fail on: each is the caller's 4xx, with a message naming it."""
    for raw in (b'{"prompt": "\\ud800 a lone surrogate"}', b'{"prompt": "\xed\xa0\x80 as raw bytes"}'):
        status, e = _create(svc, raw, "application/json")
        assert status == 400 and "surrogate" in e["error"]["message"], e
    form, ctype = _form([("prompt", "", b"superscript steps"), ("steps", "", "²".encode())])
    status, e = _create(svc, form, ctype)
    assert status == 400 and "steps must be an integer of at most 19 ASCII digits" in e["error"]["message"], e
    for limit in ("%C2%B2", "%D9%A3", "9" * 5000):  # '²' (isdigit, and int() refuses it), Arabic-Indic 3, too long
        status, _, payload = _call(svc.port, "GET", f"/v1/videos?limit={limit}", "alice")
        assert status == 400 and "limit must be an integer from 1 to 100" in json.loads(payload)["error"]["message"]
    for length, want in (("²", 400), ("9" * 5000, 413)):  # the size alone is refused: no body is sent
        status, _, payload = _call(svc.port, "POST", "/v1/videos", "alice",
                                   headers={"Content-Type": "application/json", "Content-Length": length})
        assert status == want, payload
    size, huge = len(VIDEO), "9" * 5000
    for path in (f"/v1/videos/{svc.finished}/content", f"/video/{svc.finished}.mp4"):
        status, headers, _ = _call(svc.port, "GET", path, "alice", headers={"Range": f"bytes={huge}-"})
        assert status == 416 and headers["Content-Range"] == f"bytes */{size}"
        for rng in (f"bytes=0-{huge}", f"bytes=-{huge}", f"bytes={'0' * 5000}5-{huge}"):
            status, headers, body = _call(svc.port, "GET", path, "alice", headers={"Range": rng})
            start = 5 if "5-" in rng else 0
            assert status == 206 and body == VIDEO[start:], (rng, status, headers)
            assert headers["Content-Range"] == f"bytes {start}-{size - 1}/{size}"


def _state(svc, who: str) -> dict:
    status, _, payload = _call(svc.port, "GET", "/api/state", who)
    assert status == 200
    return json.loads(payload)


def test_the_page_state_shows_a_principal_only_its_own_job_ids(svc):
    """alice's and bob's jobs run (and fail: no stage listens) in the encoder's batches; bob's /api/state names his
    job in them and none of alice's anywhere, with each batch's size; the admin's names both."""
    ids = {}
    for who in ("alice", "bob"):
        status, v = _create(svc, json.dumps({"prompt": f"{who}'s", **TINY}).encode(), "application/json", who)
        assert status == 200, v
        ids[who] = v["id"]

    def batched(state: dict) -> set[str]:
        return {j for b in state["batches"] + state["running"] for j in b["jobs"]}

    wait_for(lambda: set(ids.values()) <= batched(_state(svc, "ops")), 60, "both jobs' batches in the page state",
             svc.log)
    bob = _state(svc, "bob")
    assert batched(bob) == {ids["bob"]} and {j["job_id"] for j in bob["jobs"]} == {ids["bob"]}
    text = json.dumps(bob)
    assert ids["alice"] not in text and svc.finished not in text
    assert any(b["size"] > len(b["jobs"]) for b in bob["batches"])  # a batch with alice's job: its size alone


@pytest.mark.parametrize("flags, needle", [
    (["--http-header-s", "0"], "--http-header-s must be a number of seconds above 0"),
    (["--http-header-s", "nan"], "--http-header-s must be a number of seconds above 0"),
    (["--http-max-per-address", "0"], "--http-max-per-address must be at least 1"),
    (["--http-max-connections", "8"], "--http-reserved-connections must be from 0 to --http-max-connections - 1 (7)"),
])
def test_limits_that_cannot_work_are_refused(flags, needle):
    with pytest.raises(FailedPrecondition, match=re.escape(needle)):
        Limits.of(parse_config(RenderConfig, flags, env_prefix="T_RENDER_"))
    assert Limits.of(parse_config(RenderConfig, [], env_prefix="T_RENDER_")) == Limits(10.0, 64, 16, 8)
