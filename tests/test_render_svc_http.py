"""The render service's HTTP video API (`/v1/videos`) and its webhooks, through real processes (the session's stage
stack and `python -m render_svc`) with a plain HTTP client (http.client): create -> poll -> download, Range, cancel,
auth and owners, idempotency keys, the queue bound (429), bad requests, and webhook deliveries to a loopback
receiver that refuses the first ones (retried with the same id, every one signed). Every answer is checked against
the schemas of render_svc/openapi.json, and the description against the routes the server serves. Then OpenAI's own
Python SDK (`openai`, pinned in the test extras) against the same routes: `seconds` and `expires_at`, the thumbnail
and sprite sheet, remix and delete."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import io
import json
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import numpy as np
import openai
import pytest
from PIL import Image

from h3.v1 import common_pb2
from render_svc.http_api import OPENAPI, ROUTES
from render_svc.server import RenderConfig
from render_svc.book import JobBook
from render_svc.store import FAILED, JobStore
from render_svc import webhooks
from render_svc.webhooks import WebhookConfig, Webhooks
from stagekit.config import parse_config
from stagekit.errors import FailedPrecondition
from tests.render_svc_util import RenderService, holding_the_device, probe, tiny_request, wait_for
from tests.test_readme import readme_commands
from tests.waits import wait_until

SPEC = json.loads(OPENAPI.read_text())
TINY = {"size": "256x256", "frames": 22, "steps": 1}
SECRET = b"test webhook key"
FAIL_FIRST = 2  # the receiver answers 500 to this many deliveries first
TRICKLE_S = 0.05  # a slow receiver's pace: far below any deadline, so only a deadline over the whole answer ends it


# ---- a small validator for the subset of JSON Schema the description uses -----------------------------------------
def check_schema(value, schema: dict, where: str = "$") -> None:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return check_schema(value, SPEC["components"]["schemas"][name], where)
    if "oneOf" in schema:
        ok = 0
        for s in schema["oneOf"]:
            try:
                check_schema(value, s, where)
                ok += 1
            except AssertionError:
                pass
        assert ok == 1, f"{where}: {value!r} matches {ok} of oneOf"
        return
    types = schema.get("type")
    if types is not None:
        py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
              "integer": int, "number": (int, float)}
        allowed = [types] if isinstance(types, str) else types
        assert any(isinstance(value, py[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                   for t in allowed), f"{where}: {value!r} is not {allowed}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if "minimum" in schema and isinstance(value, (int, float)):
        assert value >= schema["minimum"], f"{where}: {value} < {schema['minimum']}"
    if "maximum" in schema and isinstance(value, (int, float)):
        assert value <= schema["maximum"], f"{where}: {value} > {schema['maximum']}"
    if isinstance(value, dict):
        for k in schema.get("required", []):
            assert k in value, f"{where}: {k} missing"
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                check_schema(v, props[k], f"{where}.{k}")
            else:
                assert schema.get("additionalProperties", True) is not False, f"{where}: {k} not described"
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            check_schema(v, schema["items"], f"{where}[{i}]")


def test_the_openapi_description_is_valid_and_describes_every_route():
    """OpenAPI 3.1's structure (the fields the API uses), every $ref resolving, path parameters declared, and the
    description's operations exactly the server's routes."""
    assert SPEC["openapi"].startswith("3.1.") and SPEC["info"]["title"] and SPEC["info"]["version"]
    described = set()
    op_ids = []
    for path, item in SPEC["paths"].items():
        assert path.startswith("/"), path
        for method, op in item.items():
            if method == "parameters":
                continue
            assert method in ("get", "post", "put", "patch", "delete", "head", "options"), method
            described.add((method.upper(), path))
            op_ids.append(op["operationId"])
            assert op["responses"] and all(k.isdigit() and len(k) == 3 for k in op["responses"]), (path, method)
            params = item.get("parameters", []) + op.get("parameters", [])
            named = {p["name"] if "name" in p else SPEC["components"]["parameters"][p["$ref"].rsplit("/", 1)[1]]["name"]
                     for p in params}
            for seg in path.split("/"):
                if seg.startswith("{"):
                    assert seg[1:-1] in named, f"{path}: {seg} not declared"
    assert len(op_ids) == len(set(op_ids))
    assert described == {(r.method, r.path) for r in ROUTES}

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(SPEC):
        assert ref.startswith("#/components/"), ref
        node = SPEC
        for part in ref[2:].split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]
    for name, scheme in SPEC["components"]["securitySchemes"].items():
        assert scheme["type"] == "http" and scheme["scheme"] == "bearer", name


# ---- the process test ---------------------------------------------------------------------------------------------
class Api:
    def __init__(self, port: int):
        self.port = port

    def call(self, method: str, path: str, body=None, who: str | None = None, headers: dict | None = None,
             raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        hdrs = dict(headers or {})
        if who:
            hdrs["Authorization"] = f"Bearer tok-{who}"
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, data, hdrs)
            r = conn.getresponse()
            payload = r.read()
        finally:
            conn.close()
        return r.status, r.headers, payload

    def json(self, method: str, path: str, body=None, who: str | None = "alice", want: int = 200, **kw) -> dict:
        status, headers, payload = self.call(method, path, body, who, **kw)
        assert status == want, (status, payload[:500])
        assert headers["Content-Type"] == "application/json"
        out = json.loads(payload)
        if status >= 400:
            check_schema(out, SPEC["components"]["schemas"]["Error"])
        return out

    def video(self, method: str, path: str, body=None, who: str = "alice", **kw) -> dict:
        v = self.json(method, path, body, who, **kw)
        check_schema(v, SPEC["components"]["schemas"]["Video"])
        return v


class Receiver:
    """A loopback webhook receiver: answers 500 to the first `fail_first` deliveries, then 204; records each one
    (`got`, in the order they came) and the ones it took (`accepted`).

    A slow receiver too: the first delivery of an event id in `trickle` is answered one byte every TRICKLE_S (a
    status line, then a header that never ends) until `release` is set (the answer is then finished, 204) or the
    sender cuts the connection (`cut`: that event id)."""

    def __init__(self, fail_first: int = FAIL_FIRST):
        self.got: list[tuple[dict, bytes]] = []
        self.accepted: list[bytes] = []
        self.fail_first = fail_first
        self.trickle: set[str] = set()
        self.trickling = threading.Event()     # a trickled answer has begun
        self.release = threading.Event()
        self.cut: list[str] = []
        self.lock = threading.Lock()           # deliveries come at once: each is counted and answered in turn
        receiver = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    slow = headers["webhook-id"] in receiver.trickle
                    receiver.trickle.discard(headers["webhook-id"])
                    if not slow:
                        receiver.got.append((headers, body))
                        take = len(receiver.got) > receiver.fail_first
                        if take:
                            receiver.accepted.append(body)
                if slow:
                    return self.answer_slowly(headers, body)
                self.send_response(204 if take else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def answer_slowly(self, headers: dict, body: bytes):
                self.close_connection = True
                receiver.trickling.set()
                try:
                    for byte in b"HTTP/1.1 204 No Content\r\nX-Slow: ":
                        self.wfile.write(bytes([byte]))
                        receiver.release.wait(TRICKLE_S)
                    while not receiver.release.wait(TRICKLE_S):
                        self.wfile.write(b"a")
                    self.wfile.write(b"\r\nContent-Length: 0\r\n\r\n")
                except OSError:  # the sender cut the connection
                    receiver.cut.append(headers["webhook-id"])
                    return
                with receiver.lock:
                    receiver.got.append((headers, body))
                    receiver.accepted.append(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hooks/h3"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def ids(self) -> list[str]:
        """The event ids it took, in the order it took them."""
        return [json.loads(b)["id"] for b in self.accepted]

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _verify(headers: dict, body: bytes) -> dict:
    """Standard Webhooks verification, written out: HMAC-SHA256 over '<id>.<timestamp>.<body>'."""
    mac = hmac.new(SECRET, f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body,
                   hashlib.sha256).digest()
    version, sig = headers["webhook-signature"].split(",", 1)
    assert version == "v1" and hmac.compare_digest(base64.b64decode(sig), mac)
    event = json.loads(body)
    assert event["id"] == headers["webhook-id"]
    check_schema(event, SPEC["components"]["schemas"]["WebhookEvent"])
    return event


def _png(seed: int = 1) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _png_b64() -> str:
    return base64.b64encode(_png()).decode()


def _form(fields: dict, image: bytes, image_field: str) -> tuple[bytes, str]:
    """A multipart/form-data body written out by hand (what `curl -F` sends) and its Content-Type."""
    boundary = "h3-test-boundary-7d1f"
    out = b""
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{image_field}"; filename="a.png"\r\n'
            f"Content-Type: image/png\r\n\r\n").encode() + image + f"\r\n--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def test_http_video_api_and_webhooks(stack, tmp_path):
    s, endpoints = stack
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-alice\nbob tok-bob\nops tok-ops admin\n")
    secret = tmp_path / "webhook.key"
    secret.write_bytes(SECRET + b"\n")
    receiver = Receiver()
    run = tmp_path / "run"
    svc = RenderService(run, endpoints, ["--tokens-file", str(tokens), "--http-port", "0", "--max-jobs-queued", "1",
                                         "--webhook-url", receiver.url, "--webhook-secret-file", str(secret),
                                         "--webhook-retry-s", "0.2"])
    svc.start()
    try:
        api = Api(int((run / "render.port.http").read_text()))

        # 1. The description is served without a token; everything else needs one (401 names the header).
        status, _, payload = api.call("GET", "/v1/openapi.json")
        assert status == 200 and json.loads(payload) == SPEC
        e = api.json("POST", "/v1/videos", {"prompt": "no token", **TINY}, who=None, want=401)
        assert e["error"]["type"] == "authentication_error" and "Authorization: Bearer" in e["error"]["message"]
        api.json("GET", "/v1/videos", who="mallory", want=401)

        # 2. Bad requests: nothing stored, the message names the fix.
        for body, needle in (({"prompt": "x", "size": "big"}, "WIDTHxHEIGHT"),
                             ({"prompt": "x", "sizes": "256x256"}, "unknown field(s) sizes"),
                             ({"prompt": "x", "size": "256x256", "frames": 23}, "17n+5"),
                             ({"prompt": "x", "seconds": 2, "frames": 22}, "not both"),
                             ({"prompt": "x", "first_frame": "%%%"}, "base64"),
                             ({"prompt": "x", "model": "sora-2"}, "minimax-h3")):
            e = api.json("POST", "/v1/videos", body, want=400)
            assert e["error"]["type"] == "invalid_request_error" and needle in e["error"]["message"], e
        e = api.json("POST", "/v1/videos", raw=b"prompt=x", headers={"Content-Type": "text/plain"}, want=415)
        assert "application/json" in e["error"]["message"] and "multipart/form-data" in e["error"]["message"]
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        conn.putrequest("POST", "/v1/videos")
        for k, v in (("Authorization", "Bearer tok-alice"), ("Content-Type", "application/json"),
                     ("Content-Length", str(1 << 30))):
            conn.putheader(k, v)
        conn.endheaders()  # the body is never sent: the size alone is refused
        r = conn.getresponse()
        assert r.status == 413 and "at most" in json.loads(r.read())["error"]["message"]
        conn.close()
        api.json("DELETE", "/v1/videos", want=405)
        assert api.json("GET", "/v1/videos")["data"] == []

        # 3. A job held in the keyframes stage (the test holds the device lease), one queued behind it, and the queue
        # bound: 429 with Retry-After. Cancelling: the queued one at once, the running one at its stage's boundary.
        with holding_the_device(s.lease_dir):
            held = api.video("POST", "/v1/videos", {"prompt": "from a keyframe", **TINY, "first_frame": _png_b64()})
            wait_for(lambda: api.video("GET", f"/v1/videos/{held['id']}")["stage"] == "keyframes", 120,
                     "the keyframe job in its stage", svc.log)
            form, ctype = _form({"prompt": "behind it", "size": "256x256", "seconds": "0.9", "steps": "1"},
                                _png(2), "input_reference")  # a form, as OpenAI's SDK sends one: the first frame
            queued = api.video("POST", "/v1/videos", who="bob", raw=form, headers={"Content-Type": ctype})
            assert queued["status"] == "queued" and queued["queue_position"] == 1 and queued["frames"] == 22
            assert queued["seconds"] == "0.9" and queued["rendered_seconds"] == "0.92"  # asked for / rendered
            assert (run / "render" / "keyframes" / hashlib.sha256(_png(2)).hexdigest()).exists()  # its first frame
            status, headers, payload = api.call("POST", "/v1/videos", {"prompt": "one too many", **TINY}, "alice")
            assert status == 429 and headers["Retry-After"] and b"--max-jobs-queued" in payload
            api.json("POST", f"/v1/videos/{queued['id']}/cancel", who="alice", want=404)  # bob's job
            c = api.video("POST", f"/v1/videos/{queued['id']}/cancel", who="bob")
            assert c["status"] == "cancelled" and c["error"]["code"] == "cancelled"
            api.video("POST", f"/v1/videos/{held['id']}/cancel", raw=b"{}", headers={"Content-Type": "application/json"})
            held = wait_for(lambda: (v := api.video("GET", f"/v1/videos/{held['id']}"))["status"] == "cancelled" and v,
                            60, "the keyframe job cancelled", svc.log)
            assert held["error"]["code"] == "cancelled" and held["completed_at"]
        e = api.json("GET", f"/v1/videos/{held['id']}/content", want=409)
        assert "cancelled" in e["error"]["message"] and e["error"]["type"] == "conflict_error"

        # 4. Create -> poll -> download, with an idempotency key (the same key again: the same job; with another
        # body: 409 naming the caller's job). Another principal sees none of it; an admin sees it.
        key = {"Idempotency-Key": "render-1"}
        v = api.video("POST", "/v1/videos", {"prompt": "a lighthouse in a storm", **TINY, "seed": 3}, headers=key)
        assert v["status"] in ("queued", "in_progress") and v["size"] == "256x256" and v["frames"] == 22
        again = api.video("POST", "/v1/videos", {"prompt": "a lighthouse in a storm", **TINY, "seed": 3}, headers=key)
        assert again["id"] == v["id"]
        e = api.json("POST", "/v1/videos", {"prompt": "another", **TINY}, headers=key, want=409)
        assert v["id"] in e["error"]["message"] and e["error"]["code"] == "already_exists"
        for path in (f"/v1/videos/{v['id']}", f"/v1/videos/{v['id']}/content"):
            assert api.json("GET", path, who="bob", want=404)["error"]["type"] == "not_found_error"
        seen = []
        done = wait_for(lambda: (x := api.video("GET", f"/v1/videos/{v['id']}")) and (seen.append(x["progress"]) or
                        x["status"] in ("completed", "failed")) and x, 180, "the render done", svc.log)
        assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None, done
        assert v["expires_at"] is None and done["expires_at"] == done["completed_at"] + 7 * 86400  # --keep-age-s
        assert done["seconds"] == done["rendered_seconds"] == "0.92"  # frames given: their duration
        assert seen == sorted(seen), seen
        status, headers, mp4 = api.call("GET", f"/v1/videos/{v['id']}/content", who="alice")
        assert status == 200 and headers["Content-Type"] == "video/mp4" and mp4[4:8] == b"ftyp"
        assert len(mp4) == done["output_bytes"]
        out = tmp_path / "out.mp4"
        out.write_bytes(mp4)
        assert probe(out) == {"width": 256, "height": 256, "frames": 22, "audio": 1}
        status, headers, part = api.call("GET", f"/v1/videos/{v['id']}/content", who="alice",
                                         headers={"Range": "bytes=100-199"})
        assert status == 206 and part == mp4[100:200] and headers["Content-Range"] == f"bytes 100-199/{len(mp4)}"

        # 5. Lists: one's own jobs, newest first, in pages; an admin's has everyone's.
        mine = api.json("GET", "/v1/videos")
        check_schema(mine, SPEC["components"]["schemas"]["VideoList"])
        assert [x["id"] for x in mine["data"]] == [v["id"], held["id"]] and not mine["has_more"]
        assert "from 1 to 100" in api.json("GET", "/v1/videos?limit=101", want=400)["error"]["message"]
        page1 = api.json("GET", "/v1/videos?limit=1")
        assert [x["id"] for x in page1["data"]] == [v["id"]] and page1["has_more"]
        page2 = api.json("GET", f"/v1/videos?limit=1&after={page1['last_id']}")
        assert [x["id"] for x in page2["data"]] == [held["id"]] and not page2["has_more"]
        assert [x["id"] for x in api.json("GET", "/v1/videos?order=asc")["data"]] == [held["id"], v["id"]]
        assert {x["id"] for x in api.json("GET", "/v1/videos", who="ops")["data"]} == {v["id"], held["id"], queued["id"]}
        assert [x["id"] for x in api.json("GET", "/v1/videos", who="bob")["data"]] == [queued["id"]]

        # 6. Webhooks: one event per ended job, each signed; the first ones refused (500) were retried with the
        # same id until the receiver took them.
        wait_for(lambda: len({h["webhook-id"] for h, _ in receiver.got[FAIL_FIRST:]}) >= 3, 60,
                 "three webhook events delivered", svc.log)
        events = [_verify(h, b) for h, b in receiver.got]
        refused, delivered = [e["id"] for e in events[:FAIL_FIRST]], [e["id"] for e in events[FAIL_FIRST:]]
        assert len(delivered) == len(set(delivered)) == 3  # each event taken once, none sent again after
        assert set(refused) <= set(delivered)  # a refused event was retried, with the same id, until taken
        by_job = {e["data"]["id"]: e for e in events[FAIL_FIRST:]}
        assert by_job[queued["id"]]["type"] == by_job[held["id"]]["type"] == "video.cancelled"
        assert by_job[v["id"]]["type"] == "video.completed" and by_job[v["id"]]["data"]["progress"] == 100
    finally:
        svc.stop()
        receiver.close()


def _readme_command(port: int) -> list[str]:
    """README's HTTP example (Running it), pointed at `port` instead of scripts/up.sh's default web port."""
    cmd = next(c for c in readme_commands("Running it") if c[:2] == [".venv/bin/python", "-c"] and "/v1/videos" in c[2])
    assert "http://127.0.0.1:8054/" in cmd[2]
    return [sys.executable, "-c", cmd[2].replace("http://127.0.0.1:8054/", f"http://127.0.0.1:{port}/")]


def test_webhook_attempts_are_bounded(tmp_path):
    """A receiver that always refuses gets --webhook-attempts attempts, spaced by the doubling backoff; then the
    event is kept as failed and nothing more is sent (the outbox over a real job store)."""
    store = JobStore(tmp_path)
    receiver = Receiver(fail_first=1 << 30)
    hooks = Webhooks(WebhookConfig(receiver.url, SECRET, attempts=3, retry_s=0.1), JobBook(store), tmp_path)
    hooks.start()
    try:
        rec, _ = store.submit(tiny_request("refused"))
        store.finish(rec.id, FAILED, "INTERNAL", "a fault")
        wait_for(lambda: len(receiver.got) >= 3, 30, "three attempts")
        time.sleep(1.0)  # past the next backoff (0.4 s): no fourth attempt
        assert len(receiver.got) == 3
        times = [int(h["webhook-timestamp"]) for h, _ in receiver.got]
        assert times == sorted(times) and {_verify(h, b)["type"] for h, b in receiver.got} == {"video.failed"}
        row = sqlite3.connect(tmp_path / "webhooks.sqlite3").execute("SELECT state, attempts, last_error "
                                                                     "FROM deliveries").fetchall()
        assert row == [("failed", 3, "HTTP 500 Internal Server Error")]
    finally:
        hooks.stop()
        receiver.close()
        store.close()


def _outbox(run_dir) -> dict[str, tuple]:
    """The outbox's rows: event id -> (state, attempts, last_error)."""
    db = sqlite3.connect(run_dir / "webhooks.sqlite3")
    try:
        return {r[0]: r[1:] for r in db.execute("SELECT id, state, attempts, last_error FROM deliveries")}
    finally:
        db.close()


def _end(store: JobStore, prompt: str, before=lambda event_id: None) -> str:
    """A job stored and ended (failed); `before(its event id)` runs first. Returns the event id."""
    rec, _ = store.submit(tiny_request(prompt))
    before(f"evt_{rec.id}")
    store.finish(rec.id, FAILED, "INTERNAL", "a fault")
    return f"evt_{rec.id}"


def test_a_slow_receiver_holds_back_no_other_event(tmp_path):
    """While one attempt is answered one byte at a time, the events after it are delivered; the slow answer, once
    finished, delivers its own event (its deadline far off)."""
    store = JobStore(tmp_path)
    receiver = Receiver(fail_first=0)
    hooks = Webhooks(WebhookConfig(receiver.url, SECRET, timeout_s=600), JobBook(store), tmp_path)
    hooks.start()
    try:
        slow = _end(store, "slow", receiver.trickle.add)
        wait_until(receiver.trickling.is_set, 30, what="the slow answer begun")
        others = [_end(store, f"after {i}") for i in range(3)]
        wait_until(lambda: sorted(receiver.ids()) == sorted(others), 30, what="the later events delivered")
        assert not receiver.release.is_set() and not receiver.cut  # all while the slow answer went on
        receiver.release.set()
        wait_until(lambda: {k: v[0] for k, v in _outbox(tmp_path).items()} == dict.fromkeys([slow, *others],
                                                                                           "delivered"),
                   30, what="every row delivered, the slow one once its answer finished")
        assert sorted(receiver.ids()) == sorted([slow, *others])
    finally:
        hooks.stop()
        receiver.close()
        store.close()


def test_a_trickling_answer_is_cut_at_the_deadline_and_retried(tmp_path):
    """A receiver that keeps an answer going byte by byte (each byte far within any socket timeout) is cut at
    --webhook-timeout-s, the attempt counted as failed, and the event retried with the same id."""
    store = JobStore(tmp_path)
    receiver = Receiver(fail_first=0)
    hooks = Webhooks(WebhookConfig(receiver.url, SECRET, attempts=2, retry_s=0.1, timeout_s=1.0), JobBook(store),
                     tmp_path)
    hooks.start()
    try:
        slow = _end(store, "trickled", receiver.trickle.add)
        wait_until(lambda: receiver.cut, 30, what="the trickled answer cut by the sender")
        assert receiver.cut == [slow] and not receiver.release.is_set()
        wait_until(lambda: _outbox(tmp_path).get(slow, ("",))[0] == "delivered", 30, what="the event retried")
        assert _outbox(tmp_path)[slow] == ("delivered", 2, "") and receiver.ids() == [slow]
    finally:
        hooks.stop()
        receiver.close()
        store.close()


def test_a_fault_in_one_event_fails_its_row_and_the_loop_goes_on(tmp_path, monkeypatch, caplog):
    """An exception while sending one event fails that event's attempts (the row says why); one while building
    another's event gives it a failed row; the event after both is still delivered by the same loop."""
    store = JobStore(tmp_path)
    receiver = Receiver(fail_first=0)
    sends, builds = [], []
    real_sign, real_video_object = webhooks.sign, webhooks.video_object

    def sign(secret, msg_id, timestamp, body):
        if msg_id in sends:
            raise RuntimeError("injected into the send")
        return real_sign(secret, msg_id, timestamp, body)

    def video_object(rec, **kw):
        if f"evt_{rec.id}" in builds:
            raise RuntimeError("injected into the event")
        return real_video_object(rec, **kw)

    monkeypatch.setattr(webhooks, "sign", sign)
    monkeypatch.setattr(webhooks, "video_object", video_object)
    hooks = Webhooks(WebhookConfig(receiver.url, SECRET, attempts=2, retry_s=0.1), JobBook(store), tmp_path)
    hooks.start()
    try:
        send_fault = _end(store, "a send fault", sends.append)
        build_fault = _end(store, "a build fault", builds.append)
        after = _end(store, "after the faults")
        wait_until(lambda: receiver.ids() == [after], 30, what="the event after the faults delivered")
        wait_until(lambda: _outbox(tmp_path).get(send_fault, ("",))[0] == "failed", 30,
                   what="the faulty send's row failed")
        rows = _outbox(tmp_path)
        assert rows[send_fault] == ("failed", 2, "RuntimeError: injected into the send")
        assert rows[build_fault] == ("failed", 0, "the event could not be built: RuntimeError: injected into the event")
        assert "injected into the send" in caplog.text and "injected into the event" in caplog.text  # tracebacks
    finally:
        hooks.stop()
        receiver.close()
        store.close()


def test_a_webhook_outlives_a_kill(stack, tmp_path):
    """An event the receiver refused until the service was killed (SIGKILL) is delivered by the restarted service,
    from the outbox in its run dir, with the same id. The job comes from the README's HTTP example."""
    s, endpoints = stack
    secret = tmp_path / "webhook.key"
    secret.write_bytes(SECRET)
    receiver = Receiver(fail_first=1 << 30)
    args = ["--http-port", "0", "--webhook-url", receiver.url, "--webhook-secret-file", str(secret),
            "--webhook-retry-s", "0.2", "--webhook-attempts", "1000"]
    svc = RenderService(tmp_path / "run", endpoints, args)
    svc.start()
    try:
        api = Api(int((tmp_path / "run" / "render.port.http").read_text()))
        with holding_the_device(s.lease_dir):  # the README's command creates the job, which is then cancelled
            r = subprocess.run(_readme_command(api.port), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            v = api.video("GET", f"/v1/videos/{r.stdout.strip()}", who=None)
            assert v["size"] == "512x288" and v["frames"] == 56 and v["steps"] == 4  # "seconds": 2 -> 56 frames
            assert api.video("POST", f"/v1/videos/{v['id']}/cancel", who=None)["status"] == "cancelled"
        wait_for(lambda: len(receiver.got) >= 2, 60, "the event refused twice", svc.log)
        svc.kill()
        receiver.fail_first = 0
        svc = RenderService(tmp_path / "run", endpoints, args)
        svc.start()
        wait_for(lambda: receiver.accepted, 60, "the event delivered after the restart", svc.log)
        ids = {_verify(h, b)["id"] for h, b in receiver.got}
        assert ids == {f"evt_{v['id']}"} and len(receiver.accepted) == 1
    finally:
        svc.stop()
        receiver.close()


def test_webhook_flags_are_checked_at_start(tmp_path):
    """A webhook that could not be signed or sent refuses the start, in one line naming the flag, before any port is
    bound or the job store opened (one process; the other cases through the same RenderConfig.webhook)."""
    key = tmp_path / "key"
    key.write_text("k")
    r = subprocess.run([sys.executable, "-m", "render_svc", "--encoder", "127.0.0.1:9", "--dit", "127.0.0.1:9",
                        "--decoder", "127.0.0.1:9", "--port", "0", "--run-dir", str(tmp_path / "run"),
                        "--webhook-url", "http://127.0.0.1:9/h"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "render: cannot start: --webhook-url needs --webhook-secret-file" in r.stderr, \
        r.stderr[-1000:]
    assert not (tmp_path / "run").exists()
    for flags, needle in ((["--webhook-url", "ftp://127.0.0.1/h", "--webhook-secret-file", str(key)],
                           "is not an http:// or https:// URL"),
                          (["--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret-file", str(tmp_path / "none")],
                           "cannot read it"),
                          (["--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret-file", str(key),
                            "--webhook-attempts", "0"], "at least 1"),
                          (["--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret-file", str(key),
                            "--webhook-timeout-s", "0"], "--webhook-timeout-s above 0")):
        with pytest.raises(FailedPrecondition, match=needle):
            parse_config(RenderConfig, flags, env_prefix="T_RENDER_").webhook()
    # URLs http.client could not send (they passed once and ended the delivery thread at the first event): refused
    # by the flags and by the outbox itself, before its database is made
    store = JobStore(tmp_path)
    for url, needle in (("http://127.0.0.1:99999/hook", "out of range.*give a port from 1 to 65535"),
                        ("http://127.0.0.1:port/hook", "give a port from 1 to 65535"),
                        ("http://127.0.0.1:0/hook", "port 0 cannot be connected to"),
                        ("http://[::1/hook", "IPv6 host in brackets"),
                        ("http://127.0.0.1:9/h\u00e9", "in ASCII.*percent-encode"),
                        ("http://127.0.0.1:9/a b", "without spaces or control characters"),
                        ("https://h\u00e9.example/x", "xn-- form")):
        with pytest.raises(FailedPrecondition, match=f"--webhook-url .*{needle}"):
            parse_config(RenderConfig, ["--webhook-url", url, "--webhook-secret-file", str(key)],
                         env_prefix="T_RENDER_").webhook()
        with pytest.raises(FailedPrecondition, match=needle):
            Webhooks(WebhookConfig(url, SECRET), JobBook(store), tmp_path)
    store.close()
    assert not (tmp_path / "webhooks.sqlite3").exists()
    cfg = parse_config(RenderConfig, ["--webhook-url", "https://h.example/x", "--webhook-secret-file", str(key)],
                       env_prefix="T_RENDER_").webhook()
    assert cfg.secret == b"k" and cfg.attempts == 8 and cfg.timeout_s == 10
    assert parse_config(RenderConfig, ["--webhook-url", "http://[::1]:8080/x?a=%C3%A9", "--webhook-secret-file",
                                       str(key), "--webhook-timeout-s", "2.5"],
                        env_prefix="T_RENDER_").webhook().timeout_s == 2.5
    key.write_text("whsec_" + base64.b64encode(b"\x00raw key bytes").decode() + "\n")  # a Standard Webhooks secret
    assert parse_config(RenderConfig, ["--webhook-url", "http://h/x", "--webhook-secret-file", str(key)],
                        env_prefix="T_RENDER_").webhook().secret == b"\x00raw key bytes"


# ---- OpenAI's SDK ----------------------------------------------------------------------------------------------------
# The SDK marks its video calls deprecated (its own service's schedule); the calls are what is tested here.
sdk_calls = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
TINY_SDK = {"size": "256x256", "seconds": "0.9", "extra_body": {"steps": 1}}  # 0.9 s: 22 frames


@dataclass
class Sdk:
    svc: RenderService
    run: Path
    lease_dir: Path
    alice: openai.OpenAI
    bob: openai.OpenAI

    def rows(self, job_id: str) -> tuple[int, int]:
        """The job's rows in the job store: (jobs, events)."""
        db = sqlite3.connect(f"file:{self.run / 'render' / 'render.sqlite3'}?mode=ro", uri=True)
        try:
            return db.execute("SELECT (SELECT COUNT(*) FROM jobs WHERE id = ?), (SELECT COUNT(*) FROM events "
                              "WHERE job_id = ?)", (job_id, job_id)).fetchone()
        finally:
            db.close()

    def cancel(self, video_id: str):
        return self.alice.post(f"/videos/{video_id}/cancel", cast_to=openai.types.Video)  # not in the SDK

    def rendered(self, prompt: str, **kw):
        """A completed video of alice's (created, then polled to its end)."""
        v = self.alice.videos.poll(self.alice.videos.create(prompt=prompt, **TINY_SDK, **kw).id, poll_interval_ms=50)
        assert v.status == "completed", v
        return v


@pytest.fixture(scope="module")
def sdk(stack, tmp_path_factory):
    """A render service (principals alice and bob, --keep-age-s 3600) and OpenAI's SDK (pinned in the test extras)
    pointed at its /v1, one client per principal."""
    s, endpoints = stack
    d = tmp_path_factory.mktemp("sdk")
    (d / "tokens").write_text("alice tok-alice\nbob tok-bob\n")
    svc = RenderService(d / "run", endpoints, ["--tokens-file", str(d / "tokens"), "--http-port", "0",
                                               "--keep-age-s", "3600"])
    svc.start()
    try:
        base = f"http://127.0.0.1:{int((d / 'run' / 'render.port.http').read_text())}/v1"
        yield Sdk(svc, d / "run", Path(s.lease_dir), *(openai.OpenAI(base_url=base, api_key=f"tok-{who}", max_retries=0,
                                                                     timeout=60) for who in ("alice", "bob")))
    finally:
        svc.stop()


def _frames_of(mp4: bytes, tmp: Path) -> list[np.ndarray]:
    path = tmp / "frames.mp4"
    path.write_bytes(mp4)
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24").astype(np.float32) for f in c.decode(video=0)]


def _closest(image: np.ndarray, frames: list[np.ndarray]) -> int:
    """The index of the frame `image` is nearest to (mean absolute difference)."""
    return int(np.argmin([np.abs(image - f).mean() for f in frames]))


@sdk_calls
def test_seconds_is_what_was_asked_for_and_expires_at_follows_the_age_limit(sdk):
    """`seconds` is the duration asked for, as OpenAI's SDK sends it; `rendered_seconds` the MP4's (22 frames: the
    smallest 17n+5 count lasting 0.9 s). `expires_at` is null until the job ends, then completed_at + --keep-age-s."""
    v = sdk.alice.videos.create(prompt="a lighthouse in a storm, thunder", model="minimax-h3", **TINY_SDK)
    assert v.status in ("queued", "in_progress") and v.expires_at is None
    assert (v.seconds, v.rendered_seconds, v.frames) == ("0.9", "0.92", 22)
    v = sdk.alice.videos.poll(v.id, poll_interval_ms=50)
    assert v.status == "completed" and v.progress == 100 and v.expires_at == v.completed_at + 3600, v
    assert (v.seconds, v.rendered_seconds) == ("0.9", "0.92")


@sdk_calls
def test_thumbnail_and_spritesheet_are_frames_of_the_video(sdk, tmp_path):
    """`download_content(variant="thumbnail")`: the first frame, WebP, at the video's size; `"spritesheet"`: 16
    frames evenly spaced from the first to the last, 4 to a row, 256 pixels wide, JPEG. Each image is compared with
    the MP4's decoded frames: the nearest frame is the one it claims to be."""
    v = sdk.rendered("waves on a rocky shore, wind")
    frames = _frames_of(sdk.alice.videos.download_content(v.id).content, tmp_path)
    assert len(frames) == v.frames == 22
    raw = sdk.alice.videos.with_raw_response.download_content(v.id, variant="thumbnail")
    thumb = Image.open(io.BytesIO(raw.content))
    assert raw.headers["content-type"] == "image/webp" and thumb.format == "WEBP" and thumb.size == (256, 256)
    assert _closest(np.asarray(thumb.convert("RGB"), np.float32), frames) == 0
    raw = sdk.alice.videos.with_raw_response.download_content(v.id, variant="spritesheet")
    sheet = Image.open(io.BytesIO(raw.content))
    picks = [int(i) for i in raw.headers["x-sprite-frames"].split(",")]
    assert raw.headers["content-type"] == "image/jpeg" and sheet.format == "JPEG"
    assert raw.headers["x-sprite-tile"] == "256x256" and sheet.size == (1024, 1024)
    assert picks == [0, 1, 3, 4, 6, 7, 8, 10, 11, 13, 14, 15, 17, 18, 20, 21]
    sheet = np.asarray(sheet.convert("RGB"), np.float32)
    for k, i in enumerate(picks):
        row, col = divmod(k, 4)
        assert _closest(sheet[row * 256:(row + 1) * 256, col * 256:(col + 1) * 256], frames) == i, (k, i)
    with pytest.raises(openai.BadRequestError, match="variant 'poster' is not served"):
        sdk.alice.videos.download_content(v.id, variant="poster")
    with pytest.raises(openai.NotFoundError):
        sdk.bob.videos.download_content(v.id, variant="thumbnail")


@sdk_calls
def test_remix_repeats_the_request_with_a_new_prompt(sdk):
    """`videos.remix(id, prompt=...)`: a new job with the video's request (size, duration, steps, seed) and the new
    prompt, `remixed_from_video_id` naming the source. A keyframe job's remix carries its first frame: the stored
    image stays while the remix waits, after its source was cancelled, and goes when both have ended; a remix of the
    source then is refused (409) naming the image. Jobs stay where they are while the test holds the device."""
    with holding_the_device(sdk.lease_dir):
        v = sdk.alice.videos.create(prompt="a lighthouse in a storm", size="256x256", seconds="0.9",
                                    extra_body={"steps": 1, "seed": 5})
        r = sdk.alice.videos.remix(v.id, prompt="the same lighthouse at dawn, gulls")
        assert r.id != v.id and r.remixed_from_video_id == v.id and r.prompt == "the same lighthouse at dawn, gulls"
        assert (r.size, r.seconds, r.frames, r.steps, r.seed) == ("256x256", "0.9", 22, 1, 5)
        assert sdk.alice.videos.retrieve(r.id).remixed_from_video_id == v.id
        with pytest.raises(openai.NotFoundError):
            sdk.bob.videos.remix(v.id, prompt="not mine")
        with pytest.raises(openai.BadRequestError, match="nothing else"):
            sdk.alice.videos.remix(v.id, prompt="more", extra_body={"seed": 1})
        with pytest.raises(openai.BadRequestError, match="prompt is required"):
            sdk.alice.videos.remix(v.id, prompt=" ")
        src = sdk.alice.videos.create(prompt="from a keyframe", **TINY_SDK, input_reference=("a.png", _png(3),
                                                                                              "image/png"))
        stored = sdk.run / "render" / "keyframes" / hashlib.sha256(_png(3)).hexdigest()
        rk = sdk.alice.videos.remix(src.id, prompt="from the same keyframe, at night")
        assert rk.remixed_from_video_id == src.id
        assert sdk.cancel(src.id).status == "cancelled" and stored.exists()  # the remix still needs it
        for job in (rk, v, r):
            assert sdk.cancel(job.id).status == "cancelled"
        assert not stored.exists()
        with pytest.raises(openai.ConflictError, match="first frame is no longer kept"):
            sdk.alice.videos.remix(src.id, prompt="once more")
    with pytest.raises(openai.NotFoundError):
        sdk.alice.videos.remix("no-such-video", prompt="x")


def test_a_remix_reads_back_keyframes_and_references_while_they_are_kept(tmp_path):
    """The job store's side of a remix (no processes): a queued job's request comes back with its first frame and
    its reference files, byte for byte; once the job has ended they are no longer kept, and the refusal names the
    file."""
    store = JobStore(tmp_path)
    try:
        refs = [common_pb2.Reference(kind="image", data=_png(7)), common_pb2.Reference(kind="audio", data=b"RIFF-wav")]
        req = tiny_request("with references", first_frame=_png(8), references=refs)
        rec, _ = store.submit(req, "alice")
        back = store.files.request_with_files(rec)
        assert back.first_frame == _png(8) and [r.data for r in back.references] == [_png(7), b"RIFF-wav"]
        assert back.params == req.params
        store.finish(rec.id, FAILED, "INTERNAL", "a fault")
        with pytest.raises(FailedPrecondition, match="first frame is no longer kept|reference 1 .image. is no longer"):
            store.files.request_with_files(store.get(rec.id))
        rec2, _ = store.submit(tiny_request("references only", references=refs[1:]), "alice")
        store.finish(rec2.id, FAILED, "INTERNAL", "a fault")
        with pytest.raises(FailedPrecondition, match=r"reference 1 \(audio\) is no longer kept"):
            store.files.request_with_files(store.get(rec2.id))
    finally:
        store.close()


@sdk_calls
def test_delete_cancels_and_removes_the_job_and_its_files(sdk):
    """`videos.delete(id)`: `{id, object: "video.deleted", deleted: true}`; a running job is cancelled first; the
    record, its events and the MP4 are gone and the id is unknown to every call after. Another principal's delete is
    404 and removes nothing. Listing (auto-paginated by the SDK) no longer has it."""
    v = sdk.rendered("a red fox in the snow, wind")
    mp4 = sdk.run / "render" / "outputs" / f"{v.id}.mp4"
    assert mp4.exists() and sdk.rows(v.id)[0] == 1
    with holding_the_device(sdk.lease_dir):
        held = sdk.alice.videos.create(prompt="held in its first stage", **TINY_SDK)
        wait_for(lambda: sdk.alice.videos.retrieve(held.id).status == "in_progress", 60, "the job running",
                 sdk.svc.log)
        with pytest.raises(openai.NotFoundError):
            sdk.bob.videos.delete(held.id)
        gone = sdk.alice.videos.delete(held.id)
        assert (gone.id, gone.object, gone.deleted) == (held.id, "video.deleted", True)
        assert sdk.rows(held.id) == (0, 0)
    with pytest.raises(openai.NotFoundError):
        sdk.bob.videos.delete(v.id)
    assert sdk.alice.videos.retrieve(v.id).status == "completed"
    assert sdk.alice.videos.delete(v.id).deleted and sdk.rows(v.id) == (0, 0) and not mp4.exists()
    for call in (lambda: sdk.alice.videos.retrieve(v.id), lambda: sdk.alice.videos.download_content(v.id),
                 lambda: sdk.alice.videos.delete(v.id), lambda: sdk.alice.videos.remix(v.id, prompt="x")):
        with pytest.raises(openai.NotFoundError):
            call()
    paged = [x.id for x in sdk.alice.videos.list(limit=1)]  # one per page: the SDK follows `after`
    assert paged == [x.id for x in sdk.alice.videos.list(limit=100)] and not {v.id, held.id} & set(paged)


def test_create_request_takes_the_sigma_shifts():
    """ComfyUI's MiniMaxH3SigmaShift (video, audio) as the create request's `video_shift` / `audio_shift`, in JSON and
    in a form; 0 or absent is the model's (12, 3); the render rules refuse what the sampler does not take."""
    from render_svc.http_api import form_fields, render_request
    from render_svc.admission import check_request
    from stagekit.errors import InvalidArgument

    req = render_request({"prompt": "x", "video_shift": 10, "audio_shift": 3.0}, "")
    assert (req.params.video_shift, req.params.audio_shift) == (10.0, 3.0)
    check_request(req)
    assert render_request({"prompt": "x"}, "").params.video_shift == 0.0
    form = (b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"video_shift\"\r\n\r\n6.5\r\n--b--\r\n")
    assert render_request(form_fields("multipart/form-data; boundary=b", form), "").params.video_shift == 6.5
    with pytest.raises(InvalidArgument, match="video_shift must be a number"):
        render_request({"prompt": "x", "video_shift": "ten"}, "")
    with pytest.raises(InvalidArgument, match=r"audio_shift=500.0 is not valid: use 0 \(model default\) or 0.1..100"):
        check_request(render_request({"prompt": "x", "audio_shift": 500}, ""))
