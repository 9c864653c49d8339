"""ComfyUI's own HTTP routes over the render service: a script or tool written for a ComfyUI server queues MiniMax-H3
graphs here unchanged (docs/workflows.md, "ComfyUI's routes").

    POST /prompt          {"prompt": API-format graph, "client_id"?} -> {"prompt_id", "number", "node_errors": {}}
    GET  /prompt          {"exec_info": {"queue_remaining": N}}
    GET  /history/{id}    the finished prompt: {id: {"prompt", "outputs": {node: {"images": [...]}}, "status"}}
    GET  /history         every finished prompt of the caller (`max_items`)
    GET  /view            an output (`filename`, `subfolder`, `type=output`) or an uploaded input (`type=input`)
    GET  /queue           {"queue_running": [...], "queue_pending": [...]}
    POST /upload/image    a form with an `image` file (ComfyUI's input folder, per principal) -> {"name", ...}
    GET  /ws              progress as ComfyUI's websocket sends it (render_svc/comfy_ws.py)

A prompt is a render job (`prompt_id` is the job id, gRPC's and `/v1/videos`'): `POST /prompt` submits the graph
through the same `RenderService.submit` (minimax_h3/comfy/workflow.py reads it), so the same checks, owners, tokens and
limits hold; a graph this product does not run is answered 400 with ComfyUI's `node_errors`, one entry per node. The
output's file name is `<filename_prefix>_<prompt id>.mp4` (`.png` for an image graph) in the prefix's subfolder.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from pathlib import Path, PurePosixPath

from h3.v1 import render_pb2
from minimax_h3.comfy import MediaRef, WorkflowRefused, interpret, read_workflow
from minimax_h3.comfy.workflow import PNG, first_frame_png, input_name
from render_svc.http_api import MAX_BODY_BYTES, HttpError, Route, VideoAPI, _owner, form_parts
from render_svc.store import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, JobRecord
from stagekit.errors import InvalidArgument, NotFound
from stagekit.server import Principal

ROUTES = (
    Route("POST", "/prompt", "prompt"),
    Route("GET", "/prompt", "prompt_status"),
    Route("GET", "/history", "history_all"),
    Route("GET", "/history/{video_id}", "history"),
    Route("GET", "/view", "view"),
    Route("GET", "/queue", "queue"),
    Route("POST", "/upload/image", "upload_image"),
    Route("GET", "/ws", "ws"),
)
PATHS = ("/prompt", "/history", "/view", "/queue", "/upload/image", "/ws")  # what the page's dispatcher sends here
HISTORY_MAX = 200
CLIENT_IDS_KEPT = 10_000  # prompt id -> client_id, for the websocket: the newest prompts' (older ones ended long ago)
_OUTPUT = re.compile(r"^(?P<base>.*)_(?P<id>[0-9a-f]{16})\.(?P<ext>mp4|png)$")
_SAFE = re.compile(r"^[A-Za-z0-9._ ()+,=@-]{1,200}$")  # an input file or subfolder name (no separators)
INPUTS = "comfy_inputs"  # under the run dir: the uploaded inputs, one folder per principal


def handles(path: str) -> bool:
    return path in PATHS or path.startswith("/history/")


class ComfyAPI(VideoAPI):
    """The routes above over a RenderService (the `/v1/` API's auth, body limits and error answers)."""

    routes = ROUTES

    def __init__(self, svc, tokens, body_total_s: float):
        super().__init__(svc, tokens, body_total_s)
        self.inputs = Path(svc.cfg.run_dir) / INPUTS
        self._client_ids: OrderedDict[str, str] = OrderedDict()  # prompt id -> its client_id (the websocket's sid)
        self._lock = threading.Lock()

    def client_id(self, prompt_id: str) -> str:
        with self._lock:
            return self._client_ids.get(prompt_id, "")

    def prompts_of(self, client_id: str) -> list[str]:
        """The prompts queued with `client_id`, oldest first."""
        with self._lock:
            return [p for p, c in self._client_ids.items() if c == client_id]

    # ---- the graph of a job --------------------------------------------------------------------------------------
    @staticmethod
    def output_of(rec: JobRecord) -> tuple[str, str, str]:
        """(the saving node's id, the output's file name, its subfolder) of a job with a graph."""
        try:
            render = interpret(read_workflow(rec.request.workflow_json), lambda ref: (1024, 1024)).render
        except InvalidArgument:
            render = None
        node, prefix = (render.save_node, render.filename_prefix) if render else ("", "ComfyUI")
        ext = "png" if rec.request.output_format == PNG else "mp4"
        path = PurePosixPath(prefix)
        return node, f"{path.name or 'ComfyUI'}_{rec.id}.{ext}", str(path.parent) if str(path.parent) != "." else ""

    def queue_item(self, rec: JobRecord) -> list:
        node, _, _ = self.output_of(rec)
        try:
            graph = read_workflow(rec.request.workflow_json).api()
        except InvalidArgument:
            graph = {}
        return [rec.seq, rec.id, graph, {"client_id": self.client_id(rec.id)}, [node] if node else []]

    def history_entry(self, rec: JobRecord) -> dict:
        node, filename, subfolder = self.output_of(rec)
        item = self.queue_item(rec)
        outputs = {}
        if rec.state == SUCCEEDED and not rec.expired:
            out = {"images": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}
            if rec.request.output_format != PNG:
                out["animated"] = [True]
            outputs[node] = out
        ok = rec.state == SUCCEEDED
        end = ("execution_success", {"prompt_id": rec.id, "timestamp": int(rec.finished * 1000)}) if ok else (
            "execution_interrupted" if rec.state == CANCELLED else "execution_error",
            {"prompt_id": rec.id, "node_id": node, "exception_message": rec.error, "exception_type": rec.error_code,
             "timestamp": int(rec.finished * 1000)})
        return {"prompt": item, "outputs": outputs,
                "status": {"status_str": "success" if ok else "error", "completed": ok,
                           "messages": [["execution_start", {"prompt_id": rec.id,
                                                             "timestamp": int((rec.started or rec.created) * 1000)}],
                                        list(end)]},
                "meta": {node: {"node_id": node, "display_node": node, "parent_node": None, "real_node_id": node}}
                if node else {}}

    def _graph_jobs(self, who: Principal, states, limit: int) -> list[JobRecord]:
        return [r for r in self.svc.book.list(states, limit, owner=_owner(who)) if r.request.workflow_json]

    # ---- the routes -------------------------------------------------------------------------------------------
    def prompt(self, h, who: Principal, query: dict) -> None:
        try:
            body = json.loads(self._body(h, MAX_BODY_BYTES))
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"the body is not valid JSON ({str(e)[:120]})") from None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), dict):
            raise InvalidArgument('the body is {"prompt": {...an API-format graph...}, "client_id": "..."}')
        client_id = str(body.get("client_id") or "")[:100]
        req = render_pb2.RenderRequest(workflow_json=json.dumps(body["prompt"]),
                                       label=f"ComfyUI prompt{' from ' + client_id if client_id else ''}")
        try:
            info = self.svc.submit(req, who.name, read_input=self.reader(who))
        except InvalidArgument as e:
            self._json(h, 400, _node_errors(e))
            return
        with self._lock:
            self._client_ids[info.job_id] = client_id
            while len(self._client_ids) > CLIENT_IDS_KEPT:
                self._client_ids.popitem(last=False)
        rec = self.svc.book.get(info.job_id)
        self._json(h, 200, {"prompt_id": info.job_id, "number": rec.seq, "node_errors": {}})

    def prompt_status(self, h, who: Principal, query: dict) -> None:
        queued = self.svc.book.list([QUEUED, RUNNING], 10_000, owner=_owner(who))
        self._json(h, 200, {"exec_info": {"queue_remaining": len(queued)}})

    def history(self, h, who: Principal, query: dict, video_id: str) -> None:
        try:
            rec = self.svc.book.get(video_id, _owner(who))
        except NotFound:  # ComfyUI answers an unknown (or not yet finished) prompt with an empty object
            rec = None
        self._json(h, 200, {rec.id: self.history_entry(rec)} if rec and rec.terminal and rec.request.workflow_json
                   else {})

    def history_all(self, h, who: Principal, query: dict) -> None:
        limit = _int(query, "max_items", HISTORY_MAX)
        recs = self._graph_jobs(who, [SUCCEEDED, FAILED, CANCELLED], limit)
        self._json(h, 200, {r.id: self.history_entry(r) for r in reversed(recs)})

    def queue(self, h, who: Principal, query: dict) -> None:
        running = self._graph_jobs(who, [RUNNING], 10_000)
        pending = self._graph_jobs(who, [QUEUED], 10_000)
        self._json(h, 200, {"queue_running": [self.queue_item(r) for r in running],
                            "queue_pending": [self.queue_item(r) for r in reversed(pending)]})

    def view(self, h, who: Principal, query: dict) -> None:
        filename = query.get("filename", [""])[0]
        kind = query.get("type", ["output"])[0]
        subfolder = query.get("subfolder", [""])[0]
        if kind == "input":
            path = self._input_path(who, filename, subfolder)
            if not path.is_file():
                raise NotFound(f"no uploaded input {filename!r}")
            h._send_file(path, _content_type(path.name))
            return
        if kind != "output":
            raise InvalidArgument(f"type {kind[:20]!r}: the files here are 'output' (renders) and 'input' (uploads)")
        m = _OUTPUT.match(filename)
        if m is None:
            raise NotFound(f"no output {filename[:80]!r} (outputs are named <prefix>_<prompt id>.mp4 or .png)")
        rec = self.svc.book.get(m.group("id"), _owner(who))
        _, name, folder = self.output_of(rec)
        if name != filename or folder != subfolder or rec.state != SUCCEEDED or rec.expired:
            raise NotFound(f"no output {filename[:80]!r} in {subfolder[:80]!r} (not finished, another name, or "
                           "removed by the retention limits)")
        try:
            if m.group("ext") == "png":
                h._send(200, first_frame_png(Path(rec.output)), "image/png")
            else:
                h._send_file(Path(rec.output), "video/mp4")
        except FileNotFoundError:  # removed by retention meanwhile
            raise NotFound(f"output {filename[:80]!r} was removed by the retention limits") from None

    def upload_image(self, h, who: Principal, query: dict) -> None:
        ctype = h.headers.get("Content-Type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise HttpError(415, "unsupported_media_type", "upload the image as a multipart/form-data form with an "
                            "'image' file part")
        fields, files = form_parts(ctype, self._body(h, MAX_BODY_BYTES))
        if "image" not in files:
            raise InvalidArgument("the form has no 'image' file part")
        name, data = files["image"]
        subfolder = fields.get("subfolder", "")
        path = self._input_path(who, Path(name or "image.png").name, subfolder)
        if path.exists() and fields.get("overwrite", "").lower() not in ("true", "1") and path.read_bytes() != data:
            stem, suffix, n = path.stem, path.suffix, 1
            while path.exists():
                path = path.with_name(f"{stem} ({n}){suffix}")
                n += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        self._json(h, 200, {"name": path.name, "subfolder": subfolder, "type": "input"})

    def ws(self, h, who: Principal, query: dict) -> None:
        from render_svc.comfy_ws import serve

        serve(self, h, who, query.get("clientId", [""])[0])

    # ---- inputs ------------------------------------------------------------------------------------------------
    def _input_path(self, who: Principal, filename: str, subfolder: str = "") -> Path:
        for part in [filename, *(p for p in subfolder.split("/") if p)]:
            if not _SAFE.match(part) or part in (".", ".."):
                raise InvalidArgument(f"{part[:80]!r} is not a file or folder name an input can have")
        return self.inputs / (who.name or "_") / subfolder / filename

    def reader(self, who: Principal):
        """A loader node's file from the caller's uploads (ComfyUI's `name [input]` and `subfolder/name` forms)."""
        def read(ref: MediaRef) -> bytes:
            folder, _, base = input_name(ref.name.value).rpartition("/")
            path = self._input_path(who, base, folder)
            if not path.is_file():
                raise InvalidArgument(f"{ref.name.value} (loaded by node {ref.node}) was not uploaded: POST it to "
                                      "/upload/image first")
            return path.read_bytes()
        return read


def _node_errors(e: InvalidArgument) -> dict:
    """A refused graph as ComfyUI answers one: `error` and, per node, its `node_errors`."""
    nodes = {}
    for r in e.refusals if isinstance(e, WorkflowRefused) else []:
        if r.node:
            entry = nodes.setdefault(r.node, {"errors": [], "dependent_outputs": [], "class_type": r.type})
            entry["errors"].append({"type": "not_supported", "message": r.why, "details": r.why, "extra_info": {}})
    return {"error": {"type": "prompt_outputs_failed_validation" if nodes else "invalid_prompt",
                      "message": "Prompt outputs failed validation" if nodes else "Invalid prompt",
                      "details": e.message, "extra_info": {}},
            "node_errors": nodes}


def _content_type(name: str) -> str:
    return {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
            ".mp4": "video/mp4", ".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg"}.get(
        Path(name).suffix.lower(), "application/octet-stream")


def _int(query: dict, name: str, default: int) -> int:
    v = query.get(name, [""])[0]
    if not v:
        return default
    if not v.isdigit() or not 1 <= int(v) <= HISTORY_MAX:
        raise InvalidArgument(f"{name} must be an integer from 1 to {HISTORY_MAX}, got {v[:20]!r}")
    return int(v)
