"""The render service's HTTP video API: `/v1/videos`, shaped like OpenAI's asynchronous Videos API, over the same
jobs, owners, idempotency keys and limits as the gRPC `Renderer` (render_svc/server.py).

    POST /v1/videos                       create: a JSON render request -> the video object (status "queued")
    GET  /v1/videos                       list, newest first (`limit`, `after`, `order`)
    GET  /v1/videos/{video_id}            the video object: status, progress, error
    POST /v1/videos/{video_id}/cancel     cancel a queued or running job -> the video object
    POST /v1/videos/extensions            extend a finished video (`video` id, `prompt`, `seconds` to add) -> a new
                                          video object whose `seconds` is the stitched total (docs/long_video.md)
    GET  /v1/videos/{video_id}/content    the finished MP4 (HTTP Range requests)
    GET  /v1/openapi.json                 this API's OpenAPI 3.1 description (render_svc/openapi.json)

It is served on the web page's listener (`--http-port`, render_svc/web.py), so it has the page's TLS certificate,
`Host:` check and connection cap. Every `/v1/videos` call needs `Authorization: Bearer <token>` when the service has
a token (the page's cookie and `?token=` are not taken here: an API call carries its token itself); the caller is the
principal its token names (`--tokens-file`), exactly as on gRPC. A video id is the job id gRPC uses.

Errors are JSON `{"error": {"code", "message", "type"}}`; the HTTP status comes from the gRPC status of the same
failure through one table (`HTTP_STATUS`), the message is the one gRPC gives.
"""

from __future__ import annotations

import base64
import binascii
import email.policy
import json
import math
import re
import time
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path
from urllib.parse import parse_qs

import grpc

from h3.v1 import render_pb2
from minimax_h3.contract import FPS, plan_windows, snap_frames, spec_from_proto
from render_svc.store import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, JobRecord
from stagekit.errors import FailedPrecondition, InvalidArgument, NotFound, StageError, status_for
from stagekit.server import ANYONE, Principal
from stagekit.transport import MAX_MESSAGE_BYTES

PREFIX = "/v1/"
MODEL = "minimax-h3"
OPENAPI = Path(__file__).with_name("openapi.json")
# A request body holds what one gRPC Submit may carry inline (its images base64-encoded: 4 bytes per 3) and the JSON
# around it; a larger one is refused (413) before it is read.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES * 4 // 3 + (64 << 10)
MAX_SMALL_BODY = 64 << 10     # the body a cancel may carry (ignored)
LIST_DEFAULT, LIST_MAX = 20, 100
RETRY_AFTER_S = 1             # Retry-After on 429 / 503
INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1

# The one table from a failure's gRPC status to its HTTP status and OpenAI-style error type; a status not named
# here is a server fault (500, "server_error").
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_FAULT = (500, "server_error")

STATUS = {QUEUED: "queued", RUNNING: "in_progress", SUCCEEDED: "completed", FAILED: "failed", CANCELLED: "cancelled"}
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_ID = r"(?P<video_id>[A-Za-z0-9_-]{1,128})"


class HttpError(InvalidArgument):
    """A request refused for how it was sent, with an HTTP status of its own and no gRPC twin (405, 408, 411, 413,
    415): the caller's to fix, as every InvalidArgument. `error_code`: the JSON error body's `code`."""

    def __init__(self, status: int, error_code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.error_code, self.headers = status, error_code, headers or {}


def error_body(code: str, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "type": kind}}).encode()


# ---- the video object ---------------------------------------------------------------------------------------------
def progress_percent(rec: JobRecord) -> int:
    """0-100: the stages of the job's route passed, plus the running stage's step fraction; 100 only when completed.
    A job retried from its first stage (a restart) goes back accordingly."""
    if rec.state == SUCCEEDED:
        return 100
    route = rec.plan
    if rec.stage not in route:
        return 0
    p = rec.progress
    part = p.step / p.total if p.total and p.stage == rec.stage else 0.0
    return min(99, int(100 * (route.index(rec.stage) + min(part, 1.0)) / len(route)))


def video_object(rec: JobRecord, queue_position: int = 0) -> dict:
    """The job as the HTTP API shows it (the `Video` schema of render_svc/openapi.json)."""
    spec = spec_from_proto(rec.request.params)
    req = rec.request
    width, height = req.upscale_width or spec.width, req.upscale_height or spec.height
    error = None
    if rec.state in (FAILED, CANCELLED):
        error = {"code": (rec.error_code or "unknown").lower(), "message": rec.error}
    return {
        "id": rec.id, "object": "video", "model": MODEL, "status": STATUS.get(rec.state, "queued"),
        "progress": progress_percent(rec), "created_at": int(rec.created),
        "started_at": int(rec.started) if rec.started else None,
        "completed_at": int(rec.finished) if rec.terminal and rec.finished else None,
        "size": f"{width}x{height}", "seconds": f"{spec.frames / FPS:.2f}", "frames": spec.frames,
        "steps": spec.steps, "seed": spec.seed, "prompt": spec.prompt, "label": req.label,
        "stage": rec.stage, "queue_position": queue_position, "attempts": rec.attempts, "error": error,
        "output_bytes": rec.output_bytes, "content_expired": rec.expired,
        "windows": plan_windows(spec).describe(), "extended_from_video_id": req.extend_job_id or None,
    }


# ---- the request ----------------------------------------------------------------------------------------------------
CREATE_FIELDS = ("prompt", "model", "size", "seconds", "frames", "steps", "seed", "sampler", "scheduler", "crf",
                 "upscale", "label", "loras", "first_frame", "last_frame", "references")


def _int(body: dict, name: str, lo: int = -INT32, hi: int = INT32) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidArgument(f"{name} must be an integer, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise InvalidArgument(f"{name} must be between {lo} and {hi}, got {v}")
    return v


def _str(body: dict, name: str) -> str:
    v = body.get(name, "")
    if not isinstance(v, str):
        raise InvalidArgument(f"{name} must be a string, got {json.dumps(v)[:40]}")
    return v


def _size(body: dict, name: str) -> tuple[int, int] | None:
    v = _str(body, name)
    if not v:
        return None
    m = _SIZE.match(v)
    if m is None:
        raise InvalidArgument(f"{name} must be 'WIDTHxHEIGHT' (e.g. '832x480'), got {v[:40]!r}")
    return int(m.group(1)), int(m.group(2))


def _bytes(value, what: str) -> bytes:
    """Base64 (standard alphabet, padding optional) or a `data:<type>;base64,` URL -> bytes; a multipart file part's
    bytes as they are."""
    if isinstance(value, bytes) and value:
        return value
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty base64 string (or a data: URL)")
    if value.startswith("data:"):
        head, sep, value = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise InvalidArgument(f"{what}: a data: URL must be base64 ('data:image/png;base64,...')")
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{what} is not valid base64") from None


def _frames(body: dict) -> int | None:
    """`frames` (17n+5), or `seconds` (a number or a numeric string, as OpenAI's API sends it): the smallest valid
    frame count that lasts at least that long at 24 fps."""
    if "frames" in body and "seconds" in body:
        raise InvalidArgument("give seconds or frames, not both")
    if "seconds" not in body:
        return _int(body, "frames")
    v = body["seconds"]
    try:
        s = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else math.nan
    except ValueError:
        s = math.nan
    if not math.isfinite(s) or s <= 0 or s > 3600:
        raise InvalidArgument(f"seconds must be a positive number of seconds, got {json.dumps(v)[:40]}")
    return snap_frames(math.ceil(s * FPS - 1e-9))


def render_request(body, idempotency_key: str) -> render_pb2.RenderRequest:
    """A create request's JSON -> the RenderRequest gRPC's Submit takes (InvalidArgument naming the field). The
    render rules themselves are the service's (RenderService.submit checks them as for a gRPC caller)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    unknown = sorted(set(body) - set(CREATE_FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown field(s) {', '.join(unknown)[:200]}; the fields are {', '.join(CREATE_FIELDS)}")
    if not _str(body, "prompt").strip():
        raise InvalidArgument("prompt is required: describe the video (and its sound)")
    if body.get("model") not in (None, MODEL):
        raise InvalidArgument(f"model {str(body['model'])[:40]!r} is not served here; this service serves {MODEL!r}")
    size, upscale = _size(body, "size"), _size(body, "upscale")
    frames, steps = _frames(body), _int(body, "steps")
    req = render_pb2.RenderRequest(label=_str(body, "label"), idempotency_key=idempotency_key,
                                   crf=_int(body, "crf", 0, INT32) or 0)
    req.params.prompt = body["prompt"]
    # Fields not given stay unset (the model's defaults), as a gRPC caller's do.
    for name, v in (("width", size and size[0]), ("height", size and size[1]), ("frames", frames), ("steps", steps)):
        if v is not None:
            setattr(req.params, name, v)
    req.params.seed = _int(body, "seed", 0, MAX_SEED) or 0
    req.params.sampler, req.params.scheduler = _str(body, "sampler"), _str(body, "scheduler")
    if upscale:
        req.upscale_width, req.upscale_height = upscale
    loras = body.get("loras") or []
    if not isinstance(loras, list):
        raise InvalidArgument("loras must be a list of {\"name\": FILE, \"strength\": NUMBER}")
    for i, lo in enumerate(loras):
        if not isinstance(lo, dict) or set(lo) - {"name", "strength"} or not isinstance(lo.get("name"), str):
            raise InvalidArgument(f"loras[{i}] must be {{\"name\": FILE, \"strength\": NUMBER}}")
        lora = req.loras.add(name=lo["name"])
        if lo.get("strength") is not None:
            if isinstance(lo["strength"], bool) or not isinstance(lo["strength"], (int, float)):
                raise InvalidArgument(f"loras[{i}].strength must be a number")
            lora.strength = float(lo["strength"])
    for name in ("first_frame", "last_frame"):
        if body.get(name) is not None:
            setattr(req, name, _bytes(body[name], name))
    refs = body.get("references") or []
    if not isinstance(refs, list):
        raise InvalidArgument("references must be a list of {\"kind\": \"image\"|\"video\"|\"audio\", \"data\": BASE64}")
    for i, ref in enumerate(refs):
        if not isinstance(ref, dict) or set(ref) - {"kind", "data", "name"}:
            raise InvalidArgument(f"references[{i}] must be {{\"kind\", \"data\", \"name\"?}}")
        req.references.add(kind=_str(ref, "kind"), name=_str(ref, "name"),
                           data=_bytes(ref.get("data"), f"references[{i}].data"))
    return req


EXTEND_FIELDS = ("prompt", "seconds", "video", "model", "steps", "seed", "label")


def extend_request(body, idempotency_key: str) -> render_pb2.ExtendRequest:
    """An extension request's JSON (or form: `video[id]`, as OpenAI's SDK sends a video reference) -> the
    ExtendRequest gRPC's Extend takes. `video` names a finished video of this service: {"id": ID} or the id itself;
    `seconds` is the length to add (the new video's `seconds` is the stitched total)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    if "video[id]" in body:
        body = {**{k: v for k, v in body.items() if k != "video[id]"}, "video": {"id": body["video[id]"]}}
    unknown = sorted(set(body) - set(EXTEND_FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown field(s) {', '.join(unknown)[:200]}; the fields are {', '.join(EXTEND_FIELDS)}")
    video = body.get("video")
    video_id = video.get("id") if isinstance(video, dict) else video
    if not isinstance(video_id, str) or not video_id:
        raise InvalidArgument("video must name a finished video of this service: {\"id\": VIDEO_ID} (a file upload "
                              "is not taken: extend a video this service rendered)")
    if body.get("model") not in (None, MODEL):
        raise InvalidArgument(f"model {str(body['model'])[:40]!r} is not served here; this service serves {MODEL!r}")
    try:
        seconds = float(body.get("seconds", "nan"))
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= 3600:
        raise InvalidArgument(f"seconds must be the positive number of seconds to add, got "
                              f"{json.dumps(body.get('seconds'))[:40]}")
    ext = render_pb2.ExtendRequest(job_id=video_id, seconds=seconds, label=_str(body, "label"),
                                   idempotency_key=idempotency_key)
    ext.params.prompt = _str(body, "prompt")
    if (steps := _int(body, "steps")) is not None:
        ext.params.steps = steps
    ext.params.seed = _int(body, "seed", 0, MAX_SEED) or 0
    return ext


FORM_INTS = ("frames", "steps", "seed", "crf")  # form fields are text: these are read as integers
FORM_FILES = {"input_reference": "first_frame", "first_frame": "first_frame", "last_frame": "last_frame"}


def form_fields(content_type: str, raw: bytes) -> dict:
    """A multipart/form-data create request (as OpenAI's SDK and `curl -F` send it) -> the JSON request's fields.
    Text parts are the scalar fields (`frames`, `steps`, `seed`, `crf` as integers; `loras` as JSON); file parts
    are `input_reference` (OpenAI's name: the first frame), `first_frame`, `last_frame`, and `reference` (repeated,
    in order; its kind from the part's Content-Type: image/*, video/*, audio/*)."""
    if "boundary=" not in content_type:
        raise InvalidArgument("a multipart/form-data body needs the boundary in its Content-Type")
    msg = BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    if not msg.is_multipart():
        raise InvalidArgument("the multipart/form-data body has no parts")
    body: dict = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise InvalidArgument("a form part has no name (Content-Disposition: form-data; name=...)")
        data = part.get_payload(decode=True) or b""
        if name == "reference":
            kind = part.get_content_maintype()
            body.setdefault("references", []).append({"kind": kind, "data": data, "name": part.get_filename() or ""})
        elif name in FORM_FILES:
            body[FORM_FILES[name]] = data
        else:
            text = data.decode("utf-8", errors="replace")
            if name in FORM_INTS and text.strip().isdigit():
                body[name] = int(text)
            elif name == "loras":
                try:
                    body[name] = json.loads(text)
                except ValueError:
                    raise InvalidArgument("loras (a form field) must be JSON: [{\"name\": FILE, \"strength\": 1}]") \
                        from None
            else:
                body[name] = text
    return body


# ---- routes ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    method: str
    path: str        # as the OpenAPI description writes it
    action: str      # VideoAPI's method that serves it
    auth: bool = True

    @property
    def pattern(self) -> re.Pattern:
        return re.compile("^" + self.path.replace("{video_id}", _ID) + "$")


ROUTES = (
    Route("POST", "/v1/videos", "create"),
    Route("POST", "/v1/videos/extensions", "extend"),
    Route("GET", "/v1/videos", "list"),
    Route("GET", "/v1/videos/{video_id}", "get"),
    Route("POST", "/v1/videos/{video_id}/cancel", "cancel"),
    Route("GET", "/v1/videos/{video_id}/content", "content"),
    Route("GET", "/v1/openapi.json", "openapi", auth=False),
)


class VideoAPI:
    """The `/v1/` routes over a RenderService. `handle` is called by the web page's request handler (its thread, its
    connection) after the `Host:` check; the handler's `_send` and `_send_file` write the answer."""

    def __init__(self, svc, tokens, body_total_s: float):
        self.svc = svc
        self.tokens = tokens
        self.body_total_s = body_total_s
        self.spec = OPENAPI.read_bytes()

    def handle(self, h, method: str, path: str, query: str) -> None:
        """Route one request (`method` GET for a HEAD); any failure becomes a JSON error."""
        h.body_read = False
        try:
            route, params = self._route(method, path)
            who = self._caller(h) if route.auth else ANYONE
            getattr(self, route.action)(h, who, parse_qs(query), **params)
        except HttpError as e:
            self._fail(h, e.status, e.error_code, "invalid_request_error", e.message, e.headers)
        except ConnectionError:  # the caller left (mid-download): nothing more can be sent
            h.close_connection = True
        except Exception as e:  # noqa: BLE001 - every failure is answered, by the gRPC status of its meaning
            code, message = status_for(e)
            status, kind = HTTP_STATUS.get(code, SERVER_FAULT)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
            if code == grpc.StatusCode.UNAUTHENTICATED:
                headers["WWW-Authenticate"] = 'Bearer realm="h3-render"'
            self._fail(h, status, code.name.lower(), kind, message, headers)

    def _route(self, method: str, path: str) -> tuple[Route, dict]:
        allowed = []
        for r in ROUTES:
            if (m := r.pattern.match(path)) is not None:
                if r.method == method:
                    return r, m.groupdict()
                allowed.append(r.method)
        if allowed:
            raise HttpError(405, "method_not_allowed", f"{method} is not served on {path[:80]}; it takes "
                            f"{', '.join(sorted(set(allowed)))}", {"Allow": ", ".join(sorted(set(allowed)))})
        raise NotFound(f"no route {method} {path[:80]}; the API is described at /v1/openapi.json")

    def _caller(self, h) -> Principal:
        if self.tokens is None:
            return ANYONE
        who = self.tokens.principal(h.headers.get("Authorization", ""))
        if who is None:
            raise _Unauthenticated("missing or wrong token: send 'Authorization: Bearer <token>' (a token of the "
                                   "service's --token-file / --tokens-file)")
        return who

    @staticmethod
    def _fail(h, status: int, code: str, kind: str, message: str, headers: dict) -> None:
        if not h.body_read and (h.headers.get("Content-Length", "0").strip() not in ("", "0")
                                or h.headers.get("Transfer-Encoding")):
            h.close_connection = True  # its body was not read: the connection cannot carry another request
        h._send(status, error_body(code, message, kind), "application/json", headers)

    def _json(self, h, status: int, obj: dict) -> None:
        h._send(status, json.dumps(obj).encode(), "application/json")

    # ---- the request body --------------------------------------------------------------------------------------
    def _body(self, h, limit: int) -> bytes:
        """The request body: a Content-Length of at most `limit`, read within --upload-total-s (each read within the
        connection's idle timeout). Chunked bodies are not taken (411)."""
        if h.headers.get("Transfer-Encoding"):
            raise HttpError(411, "length_required", "send the body with a Content-Length (chunked bodies are not taken)")
        size = h.headers.get("Content-Length") or "0"
        if not size.isdigit():
            raise HttpError(400, "invalid_argument", "Content-Length is not a number")
        size = int(size)
        if size > limit:
            raise HttpError(413, "payload_too_large", f"the body is {size} bytes; at most {limit} are taken (send "
                            "large reference files with the gRPC Upload and name them there)")
        deadline = time.monotonic() + self.body_total_s
        parts, left = [], size
        while left > 0:
            if time.monotonic() > deadline:
                h.close_connection = True
                raise HttpError(408, "request_timeout", f"the body did not arrive within {self.body_total_s:g} s "
                                "(--upload-total-s)")
            try:
                data = h.rfile.read1(min(left, 1 << 20))
            except TimeoutError:  # nothing for the connection's idle timeout
                h.close_connection = True
                raise HttpError(408, "request_timeout", f"the body stalled ({left} of {size} bytes not sent)") from None
            if not data:
                h.close_connection = True
                raise HttpError(400, "invalid_argument", f"the body ended {left} bytes short of its Content-Length")
            parts.append(data)
            left -= len(data)
        h.body_read = True
        return b"".join(parts)

    # ---- the actions ------------------------------------------------------------------------------------------------
    def _request_body(self, h) -> dict:
        """A JSON or multipart/form-data body (415 for another type)."""
        full_type = h.headers.get("Content-Type", "")
        ctype = full_type.split(";")[0].strip().lower()
        if ctype not in ("application/json", "multipart/form-data"):
            raise HttpError(415, "unsupported_media_type", "the body must be JSON (Content-Type: application/json) or "
                            f"a form (multipart/form-data), got {ctype[:60] or 'none'!r}")
        raw = self._body(h, MAX_BODY_BYTES)
        if ctype == "multipart/form-data":
            return form_fields(full_type, raw)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"the body is not valid JSON ({str(e)[:120]})") from None

    def create(self, h, who: Principal, query: dict) -> None:
        req = render_request(self._request_body(h), h.headers.get("Idempotency-Key", ""))
        info = self.svc.submit(req, who.name, who.admin)
        self._json(h, 200, video_object(self.svc.store.get(info.job_id), info.queue_position))

    def extend(self, h, who: Principal, query: dict) -> None:
        ext = extend_request(self._request_body(h), h.headers.get("Idempotency-Key", ""))
        info = self.svc.extend(ext, who.name, who.admin)
        self._json(h, 200, video_object(self.svc.store.get(info.job_id), info.queue_position))

    def get(self, h, who: Principal, query: dict, video_id: str) -> None:
        rec = self.svc.store.get(video_id, _owner(who))
        self._json(h, 200, video_object(rec, self.svc.info(rec.id, rec).queue_position))

    def list(self, h, who: Principal, query: dict) -> None:  # noqa: A003 - the route's name
        limit = _query_int(query, "limit", LIST_DEFAULT, 1, LIST_MAX)
        order = query.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"order must be 'asc' or 'desc', got {order[:20]!r}")
        past = None
        if after := query.get("after", [""])[0]:
            past = self.svc.store.get(after, _owner(who)).seq
        recs = self.svc.store.list(None, limit + 1, oldest_first=order == "asc", owner=_owner(who), past_seq=past)
        data = [video_object(r, self.svc.info(r.id, r).queue_position) for r in recs[:limit]]
        self._json(h, 200, {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                            "last_id": data[-1]["id"] if data else None, "has_more": len(recs) > limit})

    def cancel(self, h, who: Principal, query: dict, video_id: str) -> None:
        self._body(h, MAX_SMALL_BODY)  # a client may send `{}`; nothing in it is read
        info = self.svc.cancel(video_id, _owner(who))
        self._json(h, 200, video_object(self.svc.store.get(info.job_id), info.queue_position))

    def content(self, h, who: Principal, query: dict, video_id: str) -> None:
        variant = query.get("variant", ["video"])[0]
        if variant != "video":
            raise InvalidArgument(f"variant {variant[:20]!r} is not served; the content is the MP4 ('video')")
        rec = self.svc.store.get(video_id, _owner(who))
        if rec.state != SUCCEEDED:
            why = "; poll GET /v1/videos/{id} until it is completed" if not rec.terminal else f" ({rec.error})"
            raise FailedPrecondition(f"video {rec.id} is {STATUS[rec.state]}, it has no content{why}")
        gone = NotFound(f"video {rec.id}: the MP4 was removed by the retention limits "
                        "(--keep-jobs / --keep-bytes-gb / --keep-age-s)")
        if rec.expired:
            raise gone
        try:
            h._send_file(Path(rec.output), "video/mp4", {"Content-Disposition": f'attachment; filename="{rec.id}.mp4"'})
        except FileNotFoundError:
            raise gone from None

    def openapi(self, h, who: Principal, query: dict) -> None:
        h._send(200, self.spec, "application/json")


class _Unauthenticated(StageError):
    """No token, or one the service does not know (the gRPC port answers UNAUTHENTICATED for it too)."""

    code = grpc.StatusCode.UNAUTHENTICATED


def _owner(who: Principal) -> str | None:
    return None if who.admin else who.name


def _query_int(query: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = query.get(name, [""])[0]
    if not v:
        return default
    if not v.isdigit() or not lo <= int(v) <= hi:
        raise InvalidArgument(f"{name} must be an integer from {lo} to {hi}, got {v[:20]!r}")
    return int(v)

