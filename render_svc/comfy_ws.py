"""ComfyUI's progress websocket, `GET /ws?clientId=ID`, on the web page's listener (its connection thread, its cap).

RFC 6455's handshake, then JSON text frames from the service; the client's frames are read for close and ping only.
What is sent, in ComfyUI's message shapes: `status` (`queue_remaining`, the caller's queued and running prompts) on
connect and whenever it changes; for each prompt queued by `POST /prompt` with this `client_id`: `execution_start`,
`executing` (the saving node), `progress` (`value` / `max`: the running stage's steps), then `executed` (the
output, as `/history` lists it), `execution_success` and `executing` with `node: null`; or `execution_error` /
`execution_interrupted` for a failed / cancelled prompt. Messages come from the job's durable event log
(`JobBook.events`), read after each change of the job book; a prompt queued by another client is not sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import select
import uuid

from render_svc.http_api import HttpError, _owner
from render_svc.store import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from stagekit.errors import NotFound

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's key suffix
POLL_S = 0.5          # a client's frames are looked for this often, and the job store's changes waited for
MAX_CLIENT_FRAME = 64 << 10
OP_TEXT, OP_CLOSE, OP_PING, OP_PONG = 0x1, 0x8, 0x9, 0xA


def serve(api, h, who, client_id: str) -> None:
    """Answer the upgrade and send progress until the client closes, the connection breaks or the service stops."""
    key = h.headers.get("Sec-WebSocket-Key", "")
    if h.headers.get("Upgrade", "").lower() != "websocket" or not key:
        raise HttpError(400, "bad_request", "/ws is ComfyUI's progress websocket: connect with a websocket client "
                        "(Upgrade: websocket)")
    h.send_response(101)
    h.send_header("Upgrade", "websocket")
    h.send_header("Connection", "Upgrade")
    h.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode())
    h.end_headers()
    h.wfile.flush()
    h.close_connection = True
    sid = client_id or uuid.uuid4().hex
    _Session(api, h, who, sid).run()


class _Session:
    def __init__(self, api, h, who, sid: str):
        self.api, self.h, self.who, self.sid = api, h, who, sid
        self.jobs = api.svc.book
        self.next_event: dict[str, int] = {}   # prompt id -> the next event index to read
        self.started: set[str] = set()         # prompts whose execution_start was sent
        self.ended: set[str] = set()           # prompts whose end was sent (or that had ended before the connection)
        self.remaining = -1
        for prompt_id in api.prompts_of(sid):  # what happened before the connection is not sent again
            try:
                rec = self.jobs.get(prompt_id)
            except NotFound:  # removed by retention
                self.ended.add(prompt_id)
                continue
            self.next_event[prompt_id] = rec.n_events
            if rec.terminal:
                self.ended.add(prompt_id)

    def send(self, kind: str, data: dict) -> None:
        payload = json.dumps({"type": kind, "data": data}).encode()
        n = len(payload)
        head = bytes([0x80 | OP_TEXT]) + (bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big")
                                           if n < 1 << 16 else bytes([127]) + n.to_bytes(8, "big"))
        self.h.wfile.write(head + payload)
        self.h.wfile.flush()

    def run(self) -> None:
        try:
            while not self.api.svc.stopping.is_set():
                self.status()
                for prompt_id in self.api.prompts_of(self.sid):
                    if prompt_id not in self.ended:
                        self.follow(prompt_id)
                if not self.client_frames():
                    return
                with self.jobs.changed:
                    self.jobs.changed.wait(POLL_S)
        except (ConnectionError, TimeoutError, OSError):
            return  # the client went away

    def status(self) -> None:
        remaining = len(self.jobs.list([QUEUED, RUNNING], 10_000, owner=_owner(self.who)))
        if remaining != self.remaining:
            self.remaining = remaining
            self.send("status", {"status": {"exec_info": {"queue_remaining": remaining}}, "sid": self.sid})

    def follow(self, prompt_id: str) -> None:
        """Send what happened to a prompt since the last look; forget it once it ended."""
        start = self.next_event.get(prompt_id, 0)
        events = self.jobs.events(prompt_id, start)
        if not events:
            return
        try:
            rec = self.jobs.get(prompt_id)
        except NotFound:  # removed by retention meanwhile
            self.ended.add(prompt_id)
            return
        node, _, _ = self.api.output_of(rec)
        for ev in events:
            self.next_event[prompt_id] = ev.index + 1
            ms = int(ev.time_unix * 1000)
            if ev.WhichOneof("event") == "progress":
                p = ev.progress
                if p.total:
                    self.send("progress", {"value": p.step, "max": p.total, "prompt_id": prompt_id, "node": node})
                continue
            state = ev.job.state
            if state == RUNNING and prompt_id not in self.started:
                self.started.add(prompt_id)
                self.send("execution_start", {"prompt_id": prompt_id, "timestamp": ms})
                self.send("executing", {"node": node, "display_node": node, "prompt_id": prompt_id})
            elif state == SUCCEEDED:
                entry = self.api.history_entry(rec)
                self.send("executed", {"node": node, "display_node": node, "output": entry["outputs"].get(node, {}),
                                       "prompt_id": prompt_id})
                self.send("execution_success", {"prompt_id": prompt_id, "timestamp": ms})
                self.send("executing", {"node": None, "display_node": None, "prompt_id": prompt_id})
            elif state in (FAILED, CANCELLED):
                kind = "execution_interrupted" if state == CANCELLED else "execution_error"
                self.send(kind, {"prompt_id": prompt_id, "node_id": node, "node_type": "", "executed": [],
                                 "exception_message": ev.job.error, "exception_type": ev.job.error_code,
                                 "traceback": [], "timestamp": ms})
            if state in (SUCCEEDED, FAILED, CANCELLED):
                self.ended.add(prompt_id)
                self.next_event.pop(prompt_id, None)
                self.started.discard(prompt_id)
                return

    def client_frames(self) -> bool:
        """Read what the client sent (close, ping); False once it closed."""
        sock = self.h.connection
        while select.select([sock], [], [], 0)[0]:
            head = self.h.rfile.read(2)
            if len(head) < 2:
                return False
            op, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = int.from_bytes(self.h.rfile.read(2), "big")
            elif n == 127:
                n = int.from_bytes(self.h.rfile.read(8), "big")
            if n > MAX_CLIENT_FRAME:
                return False
            mask = self.h.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.h.rfile.read(n)))
            if op == OP_CLOSE:
                self.h.wfile.write(bytes([0x80 | OP_CLOSE, 0]))
                self.h.wfile.flush()
                return False
            if op == OP_PING:
                self.h.wfile.write(bytes([0x80 | OP_PONG, len(data)]) + data[:125])
                self.h.wfile.flush()
        return True

