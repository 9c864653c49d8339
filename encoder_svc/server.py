"""Text encoder service: `python -m encoder_svc`."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from encoder_svc.engine import EncodeJob, EncoderEngine, EncoderEngineConfig
from h3.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from minimax_h3.contract import MAX_PROMPT_BYTES, TEXT_STATES, TEXT_TAGS
from minimax_h3.images import admit_keyframe
from minimax_h3.media import ImageFit, ReferenceMedia, admit_reference, load_reference, reference_decode_bytes
from minimax_h3.text.conditioner import MODES
from minimax_h3.text.tokenizer import MAX_PROMPT_TOKENS
from stagekit.config import parse_config
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.metrics import observed
from stagekit.runtime import Job
from stagekit.server import abort_on_error
from stagekit.servicer import LifecycleMixin, UploadMixin, stream_job, timing_pb
from stagekit.stage import CommonConfig, run_stage
from stagekit.uploads import UploadStore, reference_bytes
from stagekit.wire import tensor_chunks

SERVICE = "h3.v1.TextEncoder"
MAX_KEYFRAMES = 2  # fl2va: first and/or last frame


@dataclass(frozen=True)
class EncoderConfigArgs(CommonConfig):
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    mode: str = field(default="resident", metadata={
        "choices": MODES, "help": "resident | stream (weights on host, layers streamed) | compact (quantised on device)"})
    max_prompt_tokens: int = field(default=MAX_PROMPT_TOKENS, metadata={"help": "longest prompt accepted, in tokens"})
    cache_mb: int = field(default=256, metadata={"help": "prompt -> states cache size (0 disables)"})


class EncoderServicer(LifecycleMixin, UploadMixin, encoder_pb2_grpc.TextEncoderServicer):
    def __init__(self, runtime, uploads: UploadStore | None = None):
        self.runtime = runtime
        self.engine: EncoderEngine = runtime.engine
        self.uploads = uploads

    def _prompt(self, request):
        raw = request.prompt_bytes if request.prompt_bytes else request.prompt
        if len(raw) > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"prompt is {len(raw)} bytes; the limit is {MAX_PROMPT_BYTES} bytes "
                                  f"({self.engine.cfg.max_prompt_tokens} tokens)")
        return self.engine.check_prompt(raw)

    def CheckPrompt(self, request, context):
        """`_prompt` alone, as Encode runs it first (the tokenizer is read at start-up: no job, no device, no
        weights): what the render service asks at Submit, so a prompt this encoder refuses is refused there."""
        _, ids = abort_on_error(context, self._prompt, request)
        return encoder_pb2.PromptCheckReply(tokens=len(ids), max_tokens=self.engine.cfg.max_prompt_tokens)

    def _keyframes(self, request) -> list:
        """fl2va keyframe images, admitted from their headers (INVALID_ARGUMENT for bad images / sizes); they are
        decoded as part of the job (docs/reliability.md, "Image bombs")."""
        if not request.keyframes:
            return []
        if len(request.keyframes) > MAX_KEYFRAMES:
            raise InvalidArgument(f"{len(request.keyframes)} keyframes given; fl2va takes at most {MAX_KEYFRAMES} "
                                  "(first, last)")
        if not self.engine.has_vision:
            raise FailedPrecondition(f"the text encoder {self.engine.path.name} has no vision tower ('visual.*'); "
                                     "keyframe renders need the full Qwen3-VL encoder file")
        return [admit_keyframe(img, request.width, request.height) for img in request.keyframes]

    def _references(self, request) -> list:
        """ref2va references in request order, inline or uploaded (their bytes in `data`), admitted before anything
        is decoded (INVALID_ARGUMENT for a bad file); images and videos are decoded as part of the job (audio
        references are labels only here)."""
        if not request.references:
            return []
        if request.keyframes:
            raise InvalidArgument("references and first/last keyframes do not combine (the ref2va partition takes "
                                  "references only)")
        refs = [common_pb2.Reference(kind=r.kind, data=reference_bytes(r, self.uploads)) for r in request.references]
        for ref in refs:
            admit_reference(ref.kind, ref.data, request.frames)
        if not self.engine.has_vision:
            raise FailedPrecondition(f"the text encoder {self.engine.path.name} has no vision tower ('visual.*'); "
                                     "reference renders need the full Qwen3-VL encoder file")
        return refs

    def _send(self, states, tokens: int, cache_hit: bool, timing: dict, tags=None):
        t0 = time.monotonic()
        if tags is None:  # t2va: every row is text
            tags = torch.ones(states.shape[0], dtype=torch.int64)
        # On the wire text states are bf16 whatever the compute dtype (the release encoder's output; half of fp32's
        # bytes, 10 KB per token at full size): a CPU stage computing in fp32 sends what a GPU stage sends.
        for chunk in tensor_chunks(TEXT_STATES, states.to(torch.bfloat16)):
            yield encoder_pb2.EncodeEvent(tensor=chunk)
        for chunk in tensor_chunks(TEXT_TAGS, tags):
            yield encoder_pb2.EncodeEvent(tensor=chunk)
        timing["transfer_s"] = time.monotonic() - t0
        yield encoder_pb2.EncodeEvent(done=encoder_pb2.EncodeDone(
            tokens=tokens, cache_hit=cache_hit, timing=timing_pb(timing), model=self.engine.model_id))

    def Encode(self, request, context):
        text, ids = abort_on_error(context, self._prompt, request)
        keyframes = abort_on_error(context, self._keyframes, request)
        references = abort_on_error(context, self._references, request)
        cached = None if keyframes or references else self.engine.cache.get(self.engine.cache_key(text))
        if cached is not None:  # re-renders never load the encoder
            timing: dict = {}
            yield from self._send(cached, len(ids), True, timing)
            m = self.runtime.metrics
            if m is not None:
                m.observe_timing(timing)
            return
        job = Job(spec=EncodeJob(text, tuple(ids)), inputs={})
        job.job_id = request.job_id or job.job_id
        if keyframes:  # canvas-sized uint8 [H, W, 3] each, decoded on the worker thread
            job.prepare = lambda: {"keyframes": [k.load() for k in keyframes]}
            job.input_bytes = sum(k.decode_bytes for k in keyframes)
        if references:  # on the model's rates and sizes (minimax_h3/media.py), decoded on the worker thread
            fit = abort_on_error(context, ImageFit.of, request.ref_image_size, request.width, request.height)
            job.prepare = lambda: {"references": [
                ReferenceMedia("audio") if r.kind == "audio" else  # a label only: its sound never reaches Qwen
                load_reference(r.data, r.kind, request.frames, self.engine.reference_sizes, fit=fit)
                for r in references]}
            job.input_bytes = sum(reference_decode_bytes(r.kind, request.frames) for r in references
                                  if r.kind != "audio")

        def on_event(ev):
            if ev.kind == "progress":
                yield encoder_pb2.EncodeEvent(progress=common_pb2.Progress(**ev.payload))
            else:
                yield from self._send(ev.payload[TEXT_STATES], ev.payload["tokens"], False, job.timing,
                                      ev.payload.get(TEXT_TAGS))

        yield from stream_job(self.runtime, job, context, observed(self.runtime, job, on_event))


def make_engine(cfg: EncoderConfigArgs, info, group) -> EncoderEngine:
    device = cfg.device_for_rank(info)
    if cfg.mode not in ("resident", "stream", "compact"):
        raise SystemExit(f"--mode {cfg.mode!r}: use resident, stream or compact")
    return EncoderEngine(EncoderEngineConfig(
        weights=cfg.weights, models_dir=cfg.models_dir, cache_dir=cfg.resolved_cache_dir(), device=device,
        dtype=cfg.compute_dtype(device), mode=cfg.mode, max_prompt_tokens=cfg.max_prompt_tokens,
        cache_bytes=cfg.cache_mb << 20), group)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(EncoderConfigArgs, argv, env_prefix="H3_ENCODER_", description="MiniMax-H3 text encoder stage")
    run_stage(cfg, "encoder", make_engine, SERVICE,
              lambda server, runtime, started: encoder_pb2_grpc.add_TextEncoderServicer_to_server(
                  EncoderServicer(runtime, UploadStore(Path(started.run_temp_dir) / "uploads")), server))


if __name__ == "__main__":
    main(sys.argv[1:])
