"""Decoder service: `python -m decoder_svc` (or torchrun for a decode sharded over N ranks)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoder_svc.engine import (DecodeJob, DecoderEngine, DecoderEngineConfig, EncodeImageJob, EncodeReferenceJob,
                               EncodeTailJob, check_latents)
from h3.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc
from minimax_h3.contract import (ENCODED_KEYFRAME, ENCODED_REFERENCE_AUDIO, ENCODED_REFERENCE_VIDEO, FPS, RAW_AUDIO,
                                 RAW_FRAMES, SAMPLE_OUTPUTS, RenderSpec, check_output, spec_from_proto, tensor_shapes,
                                 validate)
from minimax_h3.files import safe_name
from minimax_h3.images import Keyframe, admit_keyframe, check_canvas
from minimax_h3.media import ImageFit, admit_reference, load_reference, reference_decode_bytes
from minimax_h3.mux import X264_PRESETS
from stagekit.config import parse_config
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.metrics import observed
from stagekit.runtime import Job
from stagekit.server import abort_on_error
from stagekit.servicer import LifecycleMixin, UploadMixin, stream_job, timing_pb
from stagekit.stage import CommonConfig, run_stage
from stagekit.transport import file_chunks
from stagekit.uploads import UploadStore, reference_bytes
from stagekit.wire import FLOAT_DTYPES, TensorAssembler, tensor_chunks

SERVICE = "h3.v1.Decoder"
FORMATS = {decoder_pb2.MP4: "mp4", decoder_pb2.RAW: "raw", decoder_pb2.WAV: "wav"}
# One uploaded file: an extension's source MP4 (a long upscaled clip runs to hundreds of MB); reference files keep
# their own 64 MiB limit (minimax_h3.reference_files.admit_reference).
UPLOAD_FILE_BYTES = 2 << 30


@dataclass(frozen=True)
class DecoderConfigArgs(CommonConfig):
    port: int = field(default=50053, metadata={"help": "gRPC port"})
    video_weights: str = field(default="", metadata={"help": "video VAE file (overrides --models-dir)"})
    audio_weights: str = field(default="", metadata={"help": "audio VAE file (overrides --models-dir)"})
    preset: str = field(default="", metadata={"choices": ("", *X264_PRESETS),
                                              "help": "x264 preset, ultrafast..veryslow (default: veryfast; "
                                                      "ultrafast for the embedded model, whose output is noise)"})


class DecoderServicer(LifecycleMixin, UploadMixin, decoder_pb2_grpc.DecoderServicer):
    def __init__(self, runtime, uploads: UploadStore | None = None):
        self.runtime = runtime
        self.engine: DecoderEngine = runtime.engine
        self.uploads = uploads

    @staticmethod
    def _spec(params) -> RenderSpec:
        """The one validation of a render spec in this process (Decode, EncodeTail): the job takes it as valid."""
        return validate(spec_from_proto(params))

    def _source(self, digest: str) -> Path:
        """An extension's source MP4, uploaded to this server (Upload) and named by digest."""
        if self.uploads is None:
            raise FailedPrecondition("this decoder keeps no uploads: an extension's source MP4 is uploaded first")
        return self.uploads.path(digest)

    def _read_request(self, request_iterator):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("input") != "request":
            raise InvalidArgument("the first DecodeInput must carry the DecodeRequest")
        req = first.request
        # Admission from the first message, before any tensor data is accepted (docs/reliability.md, "Uploads"):
        # the render params, then exactly the shapes they imply, in a float dtype (at most 4 bytes an element).
        spec = self._spec(req.params)
        if req.format not in FORMATS:
            raise InvalidArgument(f"unknown output format {req.format}; use MP4, RAW or WAV")
        check_output(spec, req.crf, req.upscale_width, req.upscale_height)
        fmt = FORMATS[req.format]
        size = None
        if req.upscale_width or req.upscale_height:
            if fmt != "mp4":
                raise InvalidArgument("upscale_width/upscale_height apply to MP4 output only")
            size = (req.upscale_width, req.upscale_height)
        prefix = None
        if spec.prefix_frames or req.prefix_digest:
            if not (spec.prefix_frames and req.prefix_digest and fmt == "mp4"):
                raise InvalidArgument("an extension's decode (params.prefix_frames > 0) names its source MP4 "
                                      "(prefix_digest, uploaded first) and writes an MP4; neither goes without the other")
            prefix = self._source(req.prefix_digest)
        default_name = f"{req.job_id or 'render'}.{'wav' if fmt == 'wav' else 'mp4'}"
        name = safe_name(req.output_name, safe_name(default_name, "render.mp4"))
        # The shapes of a validated spec: a failure here is a server fault, not the caller's.
        shapes = tensor_shapes(SAMPLE_OUTPUTS, spec, self.engine.geometry)
        asm = TensorAssembler(expect={n: (FLOAT_DTYPES, s) for n, s in shapes.items()},
                              max_bytes=4 * max(math.prod(s) for s in shapes.values()),
                              hints={n: f"a {spec.width}x{spec.height}x{spec.frames} render needs it" for n in shapes})
        try:
            for msg in request_iterator:
                if msg.WhichOneof("input") != "tensor":
                    raise InvalidArgument("only tensor chunks may follow the DecodeRequest")
                asm.feed(msg.tensor)
            inputs = asm.finish(list(shapes))
            check_latents(spec, inputs, self.engine.geometry)
        except BaseException:
            asm.discard()  # an abandoned or rejected upload frees its buffers now
            raise
        return req, DecodeJob(spec, fmt, req.crf, name, size, prefix), inputs

    def Decode(self, request_iterator, context):
        t_recv = time.monotonic()
        req, job_spec, inputs = abort_on_error(context, self._read_request, request_iterator)
        recv_s = time.monotonic() - t_recv  # the latent upload is part of the job's transfer time
        job = Job(spec=job_spec, inputs=inputs, cleanup=_remove_file)
        job.job_id = req.job_id or job.job_id

        def on_event(ev):
            if ev.kind == "progress":
                yield decoder_pb2.DecodeEvent(progress=common_pb2.Progress(**ev.payload))
                return
            out = ev.payload
            t0 = time.monotonic()
            if "file" in out:
                try:
                    mime = "audio/wav" if job_spec.format == "wav" else "video/mp4"
                    yield from (decoder_pb2.DecodeEvent(file=c) for c in file_chunks(out["file"], out["name"], mime))
                finally:
                    out["file"].unlink(missing_ok=True)
                frames, samples = out["frames"], out["audio_samples"]
            else:
                for name in (RAW_FRAMES, RAW_AUDIO):
                    for chunk in tensor_chunks(name, out[name]):
                        yield decoder_pb2.DecodeEvent(tensor=chunk)
                frames, samples = out[RAW_FRAMES].shape[0], out[RAW_AUDIO].shape[-1]
            job.timing["transfer_s"] = recv_s + time.monotonic() - t0
            yield decoder_pb2.DecodeEvent(done=decoder_pb2.DecodeDone(
                timing=timing_pb(job.timing), frames=frames, audio_samples=samples,
                world_size=self.runtime.group.world_size))

        yield from stream_job(self.runtime, job, context, observed(self.runtime, job, on_event))

    def _read_image(self, request) -> Keyframe:
        """EncodeImageRequest -> the keyframe, admitted from its header (docs/reliability.md, "Image bombs"); every
        bad input is INVALID_ARGUMENT. It is decoded as part of the job."""
        check_canvas(request.width, request.height)
        src = request.WhichOneof("source")
        if src == "image":
            return admit_keyframe(request.image, request.width, request.height)
        if src == "pixels":
            px = request.pixels
            if px.width <= 0 or px.height <= 0 or len(px.rgb) != px.width * px.height * 3:
                raise InvalidArgument(f"raw keyframe pixels: {len(px.rgb)} bytes do not make a {px.width}x{px.height} "
                                      "RGB image (need width*height*3 uint8, row-major)")
            rgb = torch.frombuffer(bytearray(px.rgb), dtype=torch.uint8).reshape(px.height, px.width, 3)
            return admit_keyframe(rgb, request.width, request.height)
        raise InvalidArgument("EncodeImageRequest needs `image` (PNG/JPEG bytes) or `pixels` (raw RGB)")

    def _encode_job(self, job, context, event, names: tuple[str, ...], done):
        """Stream an encode job (EncodeImage / EncodeReference): progress, the result's tensors `names` that it
        holds, then `done(timing, payload)`."""
        def on_event(ev):
            if ev.kind == "progress":
                yield event(progress=common_pb2.Progress(**ev.payload))
                return
            t0 = time.monotonic()
            for name in names:
                if name in ev.payload:
                    for chunk in tensor_chunks(name, ev.payload[name]):
                        yield event(tensor=chunk)
            job.timing["transfer_s"] = time.monotonic() - t0
            yield event(done=done(timing_pb(job.timing), ev.payload))

        yield from stream_job(self.runtime, job, context, observed(self.runtime, job, on_event))

    def EncodeImage(self, request, context):
        keyframe = abort_on_error(context, self._read_image, request)
        job = Job(spec=EncodeImageJob(request.width, request.height), inputs={},
                  prepare=lambda: {"image": keyframe.load()}, input_bytes=keyframe.decode_bytes)
        job.job_id = request.job_id or job.job_id
        yield from self._encode_job(job, context, decoder_pb2.EncodeImageEvent, (ENCODED_KEYFRAME,),
                                    lambda timing, _: decoder_pb2.EncodeImageDone(timing=timing, width=request.width,
                                                                                  height=request.height))

    def EncodeReference(self, request, context):
        ref = request.reference
        data = abort_on_error(context, reference_bytes, ref, self.uploads)  # inline, or uploaded before
        abort_on_error(context, admit_reference, ref.kind, data, request.frames)
        fit = abort_on_error(context, ImageFit.of, request.ref_image_size, request.width, request.height)
        job = Job(spec=EncodeReferenceJob(ref.kind, request.frames), inputs={},
                  prepare=lambda: {"media": load_reference(data, ref.kind, request.frames,
                                                           self.engine.reference_sizes, ref.name, fit)},
                  input_bytes=reference_decode_bytes(ref.kind, request.frames))
        job.job_id = request.job_id or job.job_id
        yield from self._encode_job(job, context, decoder_pb2.EncodeReferenceEvent,
                                    (ENCODED_REFERENCE_VIDEO, ENCODED_REFERENCE_AUDIO),
                                    lambda timing, out: decoder_pb2.EncodeReferenceDone(timing=timing, **out["info"]))


    def EncodeTail(self, request, context):
        def admit():
            spec = self._spec(request.params)
            if not spec.prefix_frames:
                raise InvalidArgument("EncodeTail encodes an extension's guide: params.prefix_frames names the source "
                                      "clip's length")
            return spec, self._source(request.digest)

        spec, path = abort_on_error(context, admit)
        job = Job(spec=EncodeTailJob(path, spec), inputs={})
        job.job_id = request.job_id or job.job_id
        yield from self._encode_job(job, context, decoder_pb2.EncodeReferenceEvent,
                                    (ENCODED_REFERENCE_VIDEO, ENCODED_REFERENCE_AUDIO),
                                    lambda timing, _: decoder_pb2.EncodeReferenceDone(
                                        timing=timing, width=spec.width, height=spec.height, frames=spec.guide_frames,
                                        seconds=spec.guide_frames / FPS))


def _remove_file(result: dict) -> None:
    """A finished MP4/WAV that no client will read (it left before the result was streamed)."""
    if "file" in result:
        result["file"].unlink(missing_ok=True)


def make_engine(cfg: DecoderConfigArgs, info, group) -> DecoderEngine:
    device = cfg.device_for_rank(info)
    # The reference decodes in fp16; fp16 weights compute in fp16 directly (autocast over fp32 weights would
    # re-cast 4.8 GB of weights on every unit). --dtype float32 keeps everything fp32.
    wdtype = torch.float32 if cfg.dtype in ("float32", "fp32") or not device.startswith("cuda") else torch.float16
    return DecoderEngine(DecoderEngineConfig(
        video_weights=cfg.video_weights, audio_weights=cfg.audio_weights, models_dir=cfg.models_dir,
        cache_dir=cfg.resolved_cache_dir(), device=device, weight_dtype=wdtype, preset=cfg.preset,
        **({"out_dir": Path(cfg.run_temp_dir)} if cfg.run_temp_dir else {})), group)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(DecoderConfigArgs, argv, env_prefix="H3_DECODER_", description="MiniMax-H3 VAE decoder stage")
    run_stage(cfg, "decoder", make_engine, SERVICE,
              lambda server, runtime, started: decoder_pb2_grpc.add_DecoderServicer_to_server(
                  DecoderServicer(runtime, UploadStore(Path(started.run_temp_dir) / "uploads",
                                                       max_file_bytes=UPLOAD_FILE_BYTES)), server))


if __name__ == "__main__":
    main(sys.argv[1:])
