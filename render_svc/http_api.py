"""The render service's HTTP video API: `/v1/videos`, shaped like OpenAI's asynchronous Videos API, over the same
jobs, owners, idempotency keys and limits as the gRPC `Renderer` (render_svc/server.py).

    POST   /v1/videos                     create: a JSON render request -> the video object (status "queued")
    GET    /v1/videos                     list, newest first (`limit`, `after`, `order`)
    GET    /v1/videos/{video_id}          the video object: status, progress, error
    DELETE /v1/videos/{video_id}          delete the job (cancelled first if it has not ended), its record and MP4
    POST   /v1/videos/{video_id}/cancel   cancel a queued or running job -> the video object
    POST   /v1/videos/{video_id}/remix    the job's request again with a new prompt -> the new video object
    POST   /v1/videos/extensions          extend a finished video (`video` id, `prompt`, `seconds` to add) -> a new
                                          video object whose `seconds` is the stitched total (docs/long_video.md)
    GET    /v1/videos/{video_id}/content  the finished MP4 (HTTP Range requests), or `?variant=thumbnail` (its first
                                          frame, WebP) / `?variant=spritesheet` (frames in a grid, JPEG)
    GET    /v1/openapi.json               this API's OpenAPI 3.1 description (render_svc/openapi.json)

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
import email.message
import email.policy
import io
import json
import math
import re
import time
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path
from urllib.parse import parse_qs

import av
import grpc
import numpy as np
from PIL import Image

from h3.v1 import common_pb2, render_pb2
from minimax_h3.contract import (FPS, MAX_PROMPT_BYTES, MAX_REFERENCES, plan_windows, seconds_to_frame, snap_frames,
                                 spec_from_proto)
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
MAX_SMALL_BODY = 64 << 10     # the body a cancel or delete may carry (ignored)
MAX_REMIX_BODY = 6 * MAX_PROMPT_BYTES + (4 << 10)  # {"prompt": ...}: the longest prompt, every byte JSON-escaped
LIST_DEFAULT, LIST_MAX = 20, 100
RETRY_AFTER_S = 1             # Retry-After on 429 / 503
INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
# `?variant=spritesheet`: at most this many frames (the first and the last among them, evenly spaced), row by row in a
# grid of this many columns, each scaled to this width (its height keeps the video's aspect).
SPRITE_FRAMES, SPRITE_COLUMNS, SPRITE_TILE_WIDTH = 16, 4, 256

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


def video_object(rec: JobRecord, queue_position: int = 0, keep_age_s: float = 0.0) -> dict:
    """The job as the HTTP API shows it (the `Video` schema of render_svc/openapi.json). `seconds` is the duration
    asked for, as sent (the frame count's duration when `frames` was given); `rendered_seconds` the MP4's, of the
    17n+5 frames rendered. `expires_at`: when retention removes the finished job at the latest (`keep_age_s`, the
    service's --keep-age-s; null while it runs or without an age limit)."""
    spec = spec_from_proto(rec.request.params)
    req = rec.request
    width, height = req.upscale_width or spec.width, req.upscale_height or spec.height
    error = None
    if rec.state in (FAILED, CANCELLED):
        error = {"code": (rec.error_code or "unknown").lower(), "message": rec.error}
    ended = rec.terminal and rec.finished
    rendered = f"{spec.frames / FPS:.2f}"
    return {
        "id": rec.id, "object": "video", "model": MODEL, "status": STATUS.get(rec.state, "queued"),
        "progress": progress_percent(rec), "created_at": int(rec.created),
        "started_at": int(rec.started) if rec.started else None,
        "completed_at": int(rec.finished) if ended else None,
        "expires_at": int(rec.finished + keep_age_s) if ended and keep_age_s else None,
        "size": f"{width}x{height}", "seconds": rec.seconds or rendered, "rendered_seconds": rendered,
        "frames": spec.frames, "steps": spec.steps, "seed": spec.seed, "quality": spec.quality, "prompt": spec.prompt,
        "label": req.label, "remixed_from_video_id": rec.remixed_from or None,
        "stage": rec.stage, "queue_position": queue_position, "attempts": rec.attempts, "error": error,
        "output_bytes": rec.output_bytes, "content_expired": rec.expired,
        "windows": plan_windows(spec).describe(), "extended_from_video_id": req.extend_job_id or None,
    }


# ---- the request ----------------------------------------------------------------------------------------------------
CREATE_FIELDS = ("prompt", "model", "size", "seconds", "frames", "steps", "seed", "sampler", "scheduler", "quality",
                 "ref_image_size", "video_shift", "audio_shift", "crf", "upscale", "label", "loras", "first_frame",
                 "last_frame", "references", "guides", "workflow", "workflow_set")


def ascii_int(text: str, max_digits: int = 19) -> int | None:
    """`text` as a number if it is ASCII digits alone, at most `max_digits` of them; else None. (str.isdigit takes
    other scripts' digits and superscripts such as '²', which int() then refuses, and int() refuses numbers of over
    4300 digits: a caller's typo, never a server fault.)"""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= max_digits else None


def json_body(raw: bytes):
    """A JSON request body -> its value; InvalidArgument for one that is not JSON or not text (a lone UTF-16 surrogate
    such as "\\ud800" parses, but no string holding one can be stored or sent on)."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"the body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), which is not "
                              "text; send valid Unicode") from None
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"the body is not valid JSON ({str(e)[:120]})") from None
    return body


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


def _seconds(body: dict) -> float | None:
    """`seconds`: a number or a numeric string (as OpenAI's API sends it)."""
    if "frames" in body and "seconds" in body:
        raise InvalidArgument("give seconds or frames, not both")
    if "seconds" not in body:
        return None
    v = body["seconds"]
    try:
        s = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else math.nan
    except ValueError:
        s = math.nan
    if not math.isfinite(s) or s <= 0 or s > 3600:
        raise InvalidArgument(f"seconds must be a positive number of seconds, got {json.dumps(v)[:40]}")
    return s


def requested_seconds(body: dict) -> str:
    """The duration asked for, as the video object's `seconds` shows it ("4" for 4, "4" and "4.0"); "" if none."""
    s = _seconds(body)
    return "" if s is None else f"{s:.15g}"


def _frames(body: dict) -> int | None:
    """`frames` (17n+5), or `seconds`: the smallest valid frame count that lasts at least that long at 24 fps."""
    s = _seconds(body)
    return _int(body, "frames") if s is None else snap_frames(math.ceil(s * FPS - 1e-9))


def render_request(body, idempotency_key: str) -> render_pb2.RenderRequest:
    """A create request's JSON -> the RenderRequest gRPC's Submit takes (InvalidArgument naming the field). The
    render rules themselves are the service's (RenderService.submit checks them as for a gRPC caller)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    unknown = sorted(set(body) - set(CREATE_FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown field(s) {', '.join(unknown)[:200]}; the fields are {', '.join(CREATE_FIELDS)}")
    workflow = body.get("workflow")
    if workflow is not None and not isinstance(workflow, (dict, str)):
        raise InvalidArgument("workflow must be a ComfyUI graph: its JSON object (or that JSON as a string)")
    if not workflow and not _str(body, "prompt").strip():
        raise InvalidArgument("prompt is required: describe the video (and its sound)")
    if body.get("model") not in (None, MODEL):
        raise InvalidArgument(f"model {str(body['model'])[:40]!r} is not served here; this service serves {MODEL!r}")
    size, upscale = _size(body, "size"), _size(body, "upscale")
    frames, steps = _frames(body), _int(body, "steps")
    req = render_pb2.RenderRequest(label=_str(body, "label"), idempotency_key=idempotency_key,
                                   crf=_int(body, "crf", 0, INT32) or 0)
    req.params.prompt = _str(body, "prompt")
    # Fields not given stay unset (the model's defaults), as a gRPC caller's do.
    for name, v in (("width", size and size[0]), ("height", size and size[1]), ("frames", frames), ("steps", steps)):
        if v is not None:
            setattr(req.params, name, v)
    if body.get("seed") is not None:
        req.params.seed = _int(body, "seed", 0, MAX_SEED)
    if workflow:  # a ComfyUI graph: the fields given beside it override its values (docs/workflows.md)
        req.workflow_json = workflow if isinstance(workflow, str) else json.dumps(workflow)
        sets = body.get("workflow_set") or []
        if not isinstance(sets, list) or not all(isinstance(x, str) for x in sets):
            raise InvalidArgument('workflow_set must be a list of "NODE.WIDGET=VALUE" strings')
        req.workflow_set.extend(sets)
    req.params.sampler, req.params.scheduler = _str(body, "sampler"), _str(body, "scheduler")
    req.params.quality, req.params.ref_image_size = _str(body, "quality"), _str(body, "ref_image_size")
    for name in ("video_shift", "audio_shift"):  # 0 / absent: the model's (12, 3); the render rules check the rest
        v = body.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidArgument(f"{name} must be a number (0 = the model's default), got {json.dumps(v)[:40]}")
            setattr(req.params, name, float(v))
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
    guides = body.get("guides") or []
    if not isinstance(guides, list):
        raise InvalidArgument(GUIDE_FORM)
    for i, g in enumerate(guides):
        if not isinstance(g, dict) or set(g) - GUIDE_KEYS or ("frame" in g) == ("seconds" in g):
            raise InvalidArgument(f"guides[{i}]: {GUIDE_FORM}")
        guide = req.guides.add()
        if "frame" in g:
            guide.frame = _int(g, "frame", -INT32, INT32)
        else:
            seconds = g["seconds"]
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                    or abs(seconds) > MAX_GUIDE_SECONDS:
                raise InvalidArgument(f"guides[{i}].seconds must be a number of seconds into the video")
            guide.frame = seconds_to_frame(seconds)
        for part in ("image", "audio"):
            if g.get(part) is not None:
                getattr(guide, part).CopyFrom(common_pb2.Reference(
                    kind=part, name=_str(g, f"{part}_name"), data=_bytes(g[part], f"guides[{i}].{part}")))
    return req


GUIDE_KEYS = {"frame", "seconds", "image", "audio", "image_name", "audio_name"}
GUIDE_FORM = ("guides must be a list of {\"frame\": N or \"seconds\": S, \"image\": BASE64 and / or \"audio\": BASE64, "
              "\"image_name\"?, \"audio_name\"?} (a negative frame counts from the end)")
MAX_GUIDE_SECONDS = 3600.0


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
FORM_FLOATS = ("video_shift", "audio_shift")  # ... and these as numbers
FORM_FILES = {"input_reference": "first_frame", "first_frame": "first_frame", "last_frame": "last_frame"}
FORM_JSON = {"loras": '[{"name": FILE, "strength": 1}]', "workflow_set": '["NODE.WIDGET=VALUE", ...]'}


# A form holds each field once and at most MAX_REFERENCES `reference` files. The parser refuses a body of more parts
# when it meets the first one too many (it would spend about 8 s of CPU per MB of tiny parts).
MAX_FORM_PARTS = len(set(CREATE_FIELDS) - {"references", "guides"} | set(FORM_FILES)) + MAX_REFERENCES


def _counting_parts(limit: int):
    """The email parser's message factory for one form: InvalidArgument once it has made the form and `limit` parts
    (nested parts count too), so the parsing stops there."""
    made = 0

    def part(policy):
        nonlocal made
        made += 1
        if made > limit + 1:
            raise InvalidArgument(f"the form has more than {limit} parts; a create request has one per field and at "
                                  f"most {MAX_REFERENCES} reference files")
        return email.message.EmailMessage(policy=policy)

    return part


def form_parts(content_type: str, raw: bytes) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]]:
    """A multipart/form-data body -> (its text parts by name, its file parts by name: (file name, bytes)); a
    repeated name keeps its last part (form_fields reads repeated `reference` parts itself)."""
    fields: dict[str, str] = {}
    files: dict[str, tuple[str, bytes]] = {}
    for name, filename, _, data in _parts(content_type, raw):
        if filename is None:
            fields[name] = data.decode("utf-8", errors="replace")
        else:
            files[name] = (filename, data)
    return fields, files


def _parts(content_type: str, raw: bytes):
    """(name, file name or None, content main type, bytes) of each part of a multipart/form-data body."""
    if "boundary=" not in content_type:
        raise InvalidArgument("a multipart/form-data body needs the boundary in its Content-Type")
    policy = email.policy.HTTP.clone(message_factory=_counting_parts(MAX_FORM_PARTS))
    msg = BytesParser(policy=policy).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    if not msg.is_multipart():
        raise InvalidArgument("the multipart/form-data body has no parts")
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise InvalidArgument("a form part has no name (Content-Disposition: form-data; name=...)")
        yield name, part.get_filename(), part.get_content_maintype(), part.get_payload(decode=True) or b""


def form_fields(content_type: str, raw: bytes) -> dict:
    """A multipart/form-data create request (as OpenAI's SDK and `curl -F` send it) -> the JSON request's fields.
    Text parts are the scalar fields (`frames`, `steps`, `seed`, `crf` as integers; `loras`, `workflow_set` as JSON,
    `workflow` as the graph's JSON text); file parts are `input_reference` (OpenAI's name: the first frame),
    `first_frame`, `last_frame`, and `reference` (repeated, in order; its kind from the part's Content-Type: image/*,
    video/*, audio/*)."""
    body: dict = {}
    for name, filename, kind, data in _parts(content_type, raw):
        if name == "reference":
            body.setdefault("references", []).append({"kind": kind, "data": data, "name": filename or ""})
        elif name in FORM_FILES:
            body[FORM_FILES[name]] = data
        else:
            text = data.decode("utf-8", errors="replace")
            if name in FORM_INTS and text.strip().isdigit():
                if (number := ascii_int(text.strip())) is None:
                    raise InvalidArgument(f"{name} must be an integer of at most 19 ASCII digits, got {text[:40]!r}")
                body[name] = number
            elif name in FORM_FLOATS:
                try:
                    body[name] = float(text)
                except ValueError:
                    raise InvalidArgument(f"{name} must be a number, got {text[:40]!r}") from None
            elif name in FORM_JSON:
                try:
                    body[name] = json.loads(text)
                except ValueError:
                    raise InvalidArgument(f"{name} (a form field) must be JSON: {FORM_JSON[name]}") from None
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
    Route("DELETE", "/v1/videos/{video_id}", "delete"),
    Route("POST", "/v1/videos/{video_id}/cancel", "cancel"),
    Route("POST", "/v1/videos/{video_id}/remix", "remix"),
    Route("GET", "/v1/videos/{video_id}/content", "content"),
    Route("GET", "/v1/openapi.json", "openapi", auth=False),
)


class VideoAPI:
    """The `/v1/` routes over a RenderService. `handle` is called by the web page's request handler (its thread, its
    connection) after the `Host:` check; the handler's `_send` and `_send_file` write the answer."""

    routes = ROUTES

    def __init__(self, svc, tokens, body_total_s: float):
        self.svc = svc
        self.tokens = tokens
        self.body_total_s = body_total_s
        self.keep_age_s = svc.cfg.keep_age_s
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
        for r in self.routes:
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

    def _video(self, h, rec: JobRecord, queue_position: int | None = None) -> None:
        """Answer with the job's video object (its queue position read now unless given)."""
        if queue_position is None:
            queue_position = self.svc.book.queue_position(rec)
        self._json(h, 200, video_object(rec, queue_position, self.keep_age_s))

    # ---- the request body --------------------------------------------------------------------------------------
    def _body(self, h, limit: int) -> bytes:
        """The request body: a Content-Length of at most `limit`, read within --upload-total-s (each read within the
        connection's idle timeout). Chunked bodies are not taken (411)."""
        if h.headers.get("Transfer-Encoding"):
            raise HttpError(411, "length_required", "send the body with a Content-Length (chunked bodies are not taken)")
        given = h.headers.get("Content-Length") or "0"
        if not (given.isascii() and given.isdigit()):
            raise HttpError(400, "invalid_argument", "Content-Length is not a number")
        size = ascii_int(given.lstrip("0") or "0")
        if size is None or size > limit:
            raise HttpError(413, "payload_too_large", f"the body is {given[:20]} bytes; at most {limit} are taken "
                            "(send large reference files with the gRPC Upload and name them there)")
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
    def _json_body(self, h, limit: int, forms: bool = False):
        """The request body parsed: JSON, or (`forms`) a multipart/form-data form as JSON fields (415 else)."""
        full_type = h.headers.get("Content-Type", "")
        ctype = full_type.split(";")[0].strip().lower()
        if ctype != "application/json" and not (forms and ctype == "multipart/form-data"):
            raise HttpError(415, "unsupported_media_type", "the body must be JSON (Content-Type: application/json)"
                            + (" or a form (multipart/form-data)" if forms else "") + f", got {ctype[:60] or 'none'!r}")
        raw = self._body(h, limit)
        if ctype == "multipart/form-data":
            return form_fields(full_type, raw)
        return json_body(raw)

    def create(self, h, who: Principal, query: dict) -> None:
        body = self._json_body(h, MAX_BODY_BYTES, forms=True)
        req = render_request(body, h.headers.get("Idempotency-Key", ""))
        info = self.svc.submit(req, who.name, seconds=requested_seconds(body))
        self._video(h, self.svc.book.get(info.job_id), info.queue_position)

    def remix(self, h, who: Principal, query: dict, video_id: str) -> None:
        """A new job: the video's request (size, duration, steps, seed, LoRAs, keyframes, references, label) with
        the prompt the body gives; `remixed_from_video_id` names the video."""
        body = self._json_body(h, MAX_REMIX_BODY)
        if not isinstance(body, dict) or set(body) - {"prompt"}:
            raise InvalidArgument('a remix takes {"prompt": "..."} (the new prompt) and nothing else')
        if not _str(body, "prompt").strip():
            raise InvalidArgument("prompt is required: the new prompt, for the video's request")
        rec = self.svc.book.get(video_id, _owner(who))
        req = self.svc.book.request_with_files(rec)
        req.params.prompt, req.idempotency_key = body["prompt"], h.headers.get("Idempotency-Key", "")
        info = self.svc.submit(req, who.name, seconds=rec.seconds, remixed_from=rec.id)
        self._video(h, self.svc.book.get(info.job_id), info.queue_position)

    def extend(self, h, who: Principal, query: dict) -> None:
        ext = extend_request(self._json_body(h, MAX_BODY_BYTES, forms=True), h.headers.get("Idempotency-Key", ""))
        info = self.svc.extend(ext, who.name, who.admin)
        self._video(h, self.svc.book.get(info.job_id), info.queue_position)

    def get(self, h, who: Principal, query: dict, video_id: str) -> None:
        self._video(h, self.svc.book.get(video_id, _owner(who)))

    def delete(self, h, who: Principal, query: dict, video_id: str) -> None:
        self._body(h, MAX_SMALL_BODY)  # a client may send `{}`; nothing in it is read
        self.svc.delete(video_id, _owner(who))
        self._json(h, 200, {"id": video_id, "object": "video.deleted", "deleted": True})

    def list(self, h, who: Principal, query: dict) -> None:  # noqa: A003 - the route's name
        limit = _query_int(query, "limit", LIST_DEFAULT, 1, LIST_MAX)
        order = query.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"order must be 'asc' or 'desc', got {order[:20]!r}")
        past = None
        if after := query.get("after", [""])[0]:
            past = self.svc.book.get(after, _owner(who)).seq
        recs = self.svc.book.list(None, limit + 1, oldest_first=order == "asc", owner=_owner(who), past_seq=past)
        data = [video_object(r, self.svc.book.queue_position(r), self.keep_age_s) for r in recs[:limit]]
        self._json(h, 200, {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                            "last_id": data[-1]["id"] if data else None, "has_more": len(recs) > limit})

    def cancel(self, h, who: Principal, query: dict, video_id: str) -> None:
        self._body(h, MAX_SMALL_BODY)  # a client may send `{}`; nothing in it is read
        info = self.svc.cancel(video_id, _owner(who))
        self._video(h, self.svc.book.get(info.job_id), info.queue_position)

    def content(self, h, who: Principal, query: dict, video_id: str) -> None:
        variant = query.get("variant", ["video"])[0]
        if variant not in VARIANTS:
            raise InvalidArgument(f"variant {variant[:20]!r} is not served; the variants are {', '.join(VARIANTS)}")
        rec = self.svc.book.get(video_id, _owner(who))
        if rec.state != SUCCEEDED:
            why = "; poll GET /v1/videos/{id} until it is completed" if not rec.terminal else f" ({rec.error})"
            raise FailedPrecondition(f"video {rec.id} is {STATUS[rec.state]}, it has no content{why}")
        gone = NotFound(f"video {rec.id}: the MP4 was removed by the retention limits "
                        "(--keep-jobs / --keep-bytes-gb / --keep-age-s)")
        if rec.expired:
            raise gone
        ctype, ext = VARIANTS[variant]
        disposition = {"Content-Disposition": f'attachment; filename="{rec.id}{ext}"'}
        try:
            if variant == "video":
                h._send_file(Path(rec.output), ctype, disposition)
            else:
                image, headers = preview(Path(rec.output), variant, spec_from_proto(rec.request.params).frames)
                h._send(200, image, ctype, {**disposition, **headers})
        except FileNotFoundError:
            raise gone from None

    def openapi(self, h, who: Principal, query: dict) -> None:
        h._send(200, self.spec, "application/json")


# ?variant= -> (Content-Type, file name extension); the MP4 itself, or an image made from its frames on request.
VARIANTS = {"video": ("video/mp4", ".mp4"), "thumbnail": ("image/webp", ".webp"),
            "spritesheet": ("image/jpeg", ".jpg")}


def preview(mp4: Path, variant: str, frames: int) -> tuple[bytes, dict]:
    """An image of the MP4's frames (decoded with PyAV; `frames`: how many it has) and the headers that describe it.
    "thumbnail": the first frame, at the video's size, WebP. "spritesheet": SPRITE_FRAMES frames evenly spaced from
    the first to the last, SPRITE_COLUMNS to a row, each SPRITE_TILE_WIDTH wide, JPEG; `X-Sprite-Frames` lists their
    frame indices in order and `X-Sprite-Tile` their size."""
    buf = io.BytesIO()
    with av.open(str(mp4)) as container:
        stream = container.streams.video[0]
        if variant == "thumbnail":
            next(container.decode(stream)).to_image().save(buf, "WEBP", quality=90)
            return buf.getvalue(), {}
        stream.thread_type = "AUTO"
        picks = set(np.linspace(0, frames - 1, min(frames, SPRITE_FRAMES)).round().astype(int).tolist())
        tile = (SPRITE_TILE_WIDTH, max(1, round(SPRITE_TILE_WIDTH * stream.height / stream.width)))
        tiles = []
        for i, frame in enumerate(container.decode(stream)):
            if i in picks:
                tiles.append((i, frame.to_image().resize(tile, Image.Resampling.LANCZOS)))
                if len(tiles) == len(picks):
                    break
    cols = min(SPRITE_COLUMNS, len(tiles))
    sheet = Image.new("RGB", (cols * tile[0], -(-len(tiles) // cols) * tile[1]))
    for k, (_, im) in enumerate(tiles):
        sheet.paste(im, ((k % cols) * tile[0], (k // cols) * tile[1]))
    sheet.save(buf, "JPEG", quality=90)
    return buf.getvalue(), {"X-Sprite-Frames": ",".join(str(i) for i, _ in tiles), "X-Sprite-Tile": "%dx%d" % tile}


class _Unauthenticated(StageError):
    """No token, or one the service does not know (the gRPC port answers UNAUTHENTICATED for it too)."""

    code = grpc.StatusCode.UNAUTHENTICATED


def _owner(who: Principal) -> str | None:
    return None if who.admin else who.name


def _query_int(query: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = query.get(name, [""])[0]
    if not v:
        return default
    if (number := ascii_int(v)) is None or not lo <= number <= hi:
        raise InvalidArgument(f"{name} must be an integer from {lo} to {hi}, got {v[:20]!r}")
    return number

