"""The stage-level library: one call of one stage (encode, encode an image or a reference, sample, decode) through
the generated stage stubs.

The render service (render_svc/engine.py) orchestrates renders with these calls, and it alone: a whole render
without the service is `render_svc.engine.render_jobs`. The load tester (client/loadtest.py) and tools that want
stage-level control call them directly; the user's `python -m client render` talks to the render service and needs
no torch. Each call streams the stage's progress to `on_progress(Progress)`, hands the call to `on_call` (so another
thread can cancel it), counts each payload chunk's bytes to `on_bytes` (the load tester's byte accounting) and returns
the stage's result plus its timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3.v1 import common_pb2, decoder_pb2, dit_pb2, encoder_pb2
from minimax_h3.contract import (AUDIO_LATENTS, ENCODED_KEYFRAME, ENCODED_REFERENCE_AUDIO, ENCODED_REFERENCE_VIDEO,
                                 RAW_AUDIO, RAW_FRAMES, SAMPLE_OUTPUTS, TEXT_STATES, TEXT_TAGS, VIDEO_LATENTS,
                                 RenderSpec, ref_tensor, result_rules, spec_to_proto)
from minimax_h3.services import StageClients
from stagekit.errors import Internal
from stagekit.transport import FileReceiver
from stagekit.uploads import upload, uploaded
from stagekit.wire import DTYPE_CLASSES, TensorAssembler, WireError, tensor_chunks

ProgressFn = Callable[[common_pb2.Progress], None]
# Receives ("sent" | "received", payload bytes) for each tensor or file chunk of a stage call, as it goes.
BytesFn = Callable[[str, int], None]
# Receives each stage call as it starts (a grpc.Call): a caller that keeps it can cancel the call from another thread.
CallFn = Callable[[object], None]
# Per-stage RPC deadlines (seconds): generous, but a hung stage never hangs the client.
DEADLINES = {"encoder": 1800.0, "dit": 4 * 3600.0, "decoder": 3600.0}


def _noop(*_args) -> None:
    pass


@dataclass
class StageResult:
    stage: str
    wall_s: float
    timing: common_pb2.Timing
    extra: dict = field(default_factory=dict)


def stage_events(stream, what: str, on_progress: ProgressFn = _noop, on_bytes: BytesFn = _noop,
                 **feeds: Callable[[object], None]):
    """Consume a stage's event stream: progress messages to `on_progress`, each payload message to the feed named
    by its kind (`tensor=`, `file=`, its bytes counted to `on_bytes`); returns the done event (a stream that ends
    without one raises)."""
    done = None
    for ev in stream:
        kind = ev.WhichOneof("event")
        if kind == "progress":
            on_progress(ev.progress)
        elif kind == "done":
            done = ev.done
        elif kind in feeds:
            payload = getattr(ev, kind)
            on_bytes("received", len(payload.data))
            feeds[kind](payload)
    if done is None:
        raise RuntimeError(f"{what} stream ended without a done event (the stage stopped mid-call?); retry")
    return done


def _drain(stream, on_progress: ProgressFn, required: list[str], what: str,
           rules: Callable[[], dict[str, tuple[str, tuple]]],
           on_bytes: BytesFn = _noop) -> tuple[dict[str, torch.Tensor], object]:
    """A stage's event stream whose result is tensors: reassembled and checked against the call's `rules()`
    (minimax_h3.contract.result_rules; asked once the stage has accepted the request, so a request the stage refuses
    gets the stage's own answer), with the done event. A result that breaks them is the stage's fault: `Internal`,
    never the caller's."""
    asm: TensorAssembler | None = None

    def assembler() -> TensorAssembler:
        nonlocal asm
        if asm is None:
            asm = TensorAssembler(expect={n: (DTYPE_CLASSES[d], shape) for n, (d, shape) in rules().items()})
        return asm

    try:
        done = stage_events(stream, what, on_progress, on_bytes, tensor=lambda chunk: assembler().feed(chunk))
        return assembler().finish(required), done
    except WireError as e:  # raised by the assembler, so there is one
        asm.discard()
        raise Internal(f"the {what} stage sent a result that breaks the H3 contract: {e}") from e


def sent_references(stub, references: Sequence[common_pb2.Reference], sources: Sequence[Path | None] = (),
                    timeout_s: float | None = None, metadata=None) -> list[common_pb2.Reference]:
    """The references as a stage's request names them: each file uploaded to that stage in chunks (its Upload RPC:
    `sources[i]`, a stored file, else the reference's inline bytes), then named by digest, so no request carries a
    file and a file may be larger than one message (stagekit/uploads.py)."""
    sources = list(sources) + [None] * (len(references) - len(sources))
    return [uploaded(stub.Upload, ref, src, timeout=timeout_s, metadata=metadata)
            for ref, src in zip(references, sources)]


def encode(clients: StageClients, prompt: str, job_id: str = "", on_progress: ProgressFn = _noop,
           timeout_s: float | None = None, keyframes: list[bytes] | None = None, width: int = 0, height: int = 0,
           with_tags: bool = False, on_call: CallFn = _noop,
           references: Sequence[common_pb2.Reference] = (), frames: int = 0, sources: Sequence[Path | None] = (),
           on_bytes: BytesFn = _noop, ref_image_size: str = ""):
    """Prompt (+ fl2va keyframe image bytes, in packed order, fitted to width x height; or ref2va references in
    request order, for a width x height render of `frames` frames, their files inline or in `sources`, images sized
    as `ref_image_size` says) -> text_states.
    `with_tags=True` returns (states, text_tags, result); the tags are all-text when the encoder sends none."""
    t0 = time.monotonic()
    timeout, metadata = timeout_s or DEADLINES["encoder"], clients.security.metadata()
    refs = sent_references(clients.encoder, references, sources, timeout, metadata)
    visual = bool(keyframes or references)
    req = encoder_pb2.EncodeRequest(prompt=prompt, job_id=job_id, keyframes=list(keyframes or []),
                                    width=width if visual else 0, height=height if visual else 0,
                                    references=refs, frames=frames if references else 0,
                                    ref_image_size=ref_image_size if references else "")
    stream = clients.encoder.Encode(req, timeout=timeout, metadata=metadata)
    on_call(stream)
    out, done = _drain(stream, on_progress, [TEXT_STATES], "encoder", lambda: result_rules("Encode"), on_bytes)
    states = out[TEXT_STATES]
    result = StageResult("encoder", time.monotonic() - t0, done.timing,
                         {"tokens": done.tokens, "cache_hit": done.cache_hit})
    if with_tags:
        tags = out.get(TEXT_TAGS)
        if tags is None:
            tags = torch.ones(states.shape[0], dtype=torch.int64)
        return states, tags, result
    return states, result


def encode_image(clients: StageClients, image: bytes, width: int, height: int, job_id: str = "",
                 on_progress: ProgressFn = _noop, timeout_s: float | None = None,
                 on_call: CallFn = _noop, on_bytes: BytesFn = _noop) -> tuple[torch.Tensor, StageResult]:
    """Keyframe image bytes -> its normalised VAE latent [24, 1, height/16, width/16] (decoder stage, fl2va)."""
    t0 = time.monotonic()
    stream = clients.decoder.EncodeImage(
        decoder_pb2.EncodeImageRequest(image=image, width=width, height=height, job_id=job_id),
        timeout=timeout_s or DEADLINES["decoder"], metadata=clients.security.metadata())
    on_call(stream)
    out, done = _drain(stream, on_progress, [ENCODED_KEYFRAME], "decoder EncodeImage",
                       lambda: result_rules("EncodeImage", RenderSpec(width=width, height=height)), on_bytes)
    latents = out[ENCODED_KEYFRAME]
    return latents, StageResult("decoder", time.monotonic() - t0, done.timing, {"op": "encode_image"})


def encode_reference(clients: StageClients, reference: common_pb2.Reference, frames: int, job_id: str = "",
                     on_progress: ProgressFn = _noop, timeout_s: float | None = None,
                     on_call: CallFn = _noop, source: Path | None = None,
                     on_bytes: BytesFn = _noop, ref_image_size: str = "", width: int = 0,
                     height: int = 0) -> tuple[dict[str, torch.Tensor], StageResult]:
    """A ref2va reference (its file inline, or at `source`) -> its latents ({"video": [24, T, h, w]} and/or
    {"audio": [2, 32, Ta]}, decoder stage) for a width x height render of `frames` frames (an image sized as
    `ref_image_size` says); the StageResult's extra holds what the decoder made of the file."""
    t0 = time.monotonic()
    timeout, metadata = timeout_s or DEADLINES["decoder"], clients.security.metadata()
    ref = sent_references(clients.decoder, [reference], [source], timeout, metadata)[0]
    stream = clients.decoder.EncodeReference(
        decoder_pb2.EncodeReferenceRequest(reference=ref, frames=frames, job_id=job_id, ref_image_size=ref_image_size,
                                           width=width, height=height), timeout=timeout, metadata=metadata)
    on_call(stream)
    out, done = _drain(stream, on_progress, [], "decoder EncodeReference", lambda: result_rules("EncodeReference"),
                       on_bytes)
    info = {"op": "encode_reference", "kind": reference.kind, "width": done.width, "height": done.height,
            "frames": done.frames, "seconds": done.seconds, "source_fps": done.source_fps,
            "source_rate": done.source_rate}
    return out, StageResult("decoder", time.monotonic() - t0, done.timing, info)


def encode_tail(clients: StageClients, spec: RenderSpec, source: Path, job_id: str = "",
                on_progress: ProgressFn = _noop, timeout_s: float | None = None, on_call: CallFn = _noop
                ) -> tuple[torch.Tensor, torch.Tensor, StageResult]:
    """An extension's guide from its source MP4 when the source's latents are gone (the decoder's EncodeTail): the
    clip's latents of its last `spec.guide_frames` frames, (video [24, Tg, H/16, W/16], audio [2, 32, Tga])."""
    t0 = time.monotonic()
    timeout, metadata = timeout_s or DEADLINES["decoder"], clients.security.metadata()
    req = decoder_pb2.EncodeTailRequest(digest=upload(clients.decoder.Upload, source, source.name, timeout=timeout,
                                                      metadata=metadata), job_id=job_id)
    spec_to_proto(spec, req.params)
    stream = clients.decoder.EncodeTail(req, timeout=timeout, metadata=metadata)
    on_call(stream)
    out, done = _drain(stream, on_progress, [ENCODED_REFERENCE_VIDEO, ENCODED_REFERENCE_AUDIO], "decoder EncodeTail",
                       lambda: result_rules("EncodeTail", spec))
    return out[ENCODED_REFERENCE_VIDEO], out[ENCODED_REFERENCE_AUDIO], StageResult(
        "decoder", time.monotonic() - t0, done.timing, {"op": "encode_tail", "frames": done.frames})


def reference_tensors(index: int, latents: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """The DiT's wire names of reference `index`'s latents (minimax_h3.contract.ref_tensor)."""
    out = {}
    if ENCODED_REFERENCE_VIDEO in latents:
        out[ref_tensor(index, "image" if kind == "image" else "video")] = latents[ENCODED_REFERENCE_VIDEO]
    if ENCODED_REFERENCE_AUDIO in latents:
        out[ref_tensor(index, "audio")] = latents[ENCODED_REFERENCE_AUDIO]
    return out


def sample_inputs(spec: RenderSpec, job_id: str, text_states: torch.Tensor,
                  extra: dict[str, torch.Tensor] | None = None, loras: Sequence[tuple[str, float]] = (),
                  on_bytes: BytesFn = _noop) -> Iterator[dit_pb2.SampleInput]:
    """The messages a Sample call sends: the request, then each tensor in chunks (also what grpcurl / ghz send)."""
    req = dit_pb2.SampleRequest(job_id=job_id, loras=[dit_pb2.LoraSpec(name=n, strength=s) for n, s in loras])
    spec_to_proto(spec, req.params)
    yield dit_pb2.SampleInput(request=req)
    for name, t in ((TEXT_STATES, text_states), *(extra or {}).items()):
        for chunk in tensor_chunks(name, t):
            on_bytes("sent", len(chunk.data))
            yield dit_pb2.SampleInput(tensor=chunk)


def sample(clients: StageClients, spec: RenderSpec, text_states: torch.Tensor, job_id: str = "",
           on_progress: ProgressFn = _noop, timeout_s: float | None = None,
           extra: dict[str, torch.Tensor] | None = None,
           loras: Sequence[tuple[str, float]] = (), on_call: CallFn = _noop, on_bytes: BytesFn = _noop
           ) -> tuple[torch.Tensor, torch.Tensor, StageResult]:
    """`extra`: fl2va / ref2va tensors (keyframe or reference latents, text tags; minimax_h3.contract). `loras`: (file name in
    the DiT server's loras dir, strength) pairs applied for this request."""
    t0 = time.monotonic()
    stream = clients.dit.Sample(sample_inputs(spec, job_id, text_states, extra, loras, on_bytes),
                                timeout=timeout_s or DEADLINES["dit"], metadata=clients.security.metadata())
    on_call(stream)
    out, done = _drain(stream, on_progress, list(SAMPLE_OUTPUTS), "DiT", lambda: result_rules("Sample", spec),
                       on_bytes)
    return out[VIDEO_LATENTS], out[AUDIO_LATENTS], StageResult(
        "dit", time.monotonic() - t0, done.timing,
        {"ms_per_step": done.ms_per_step, "ranks": done.world_size, "cached_steps": done.cached_steps,
         "windows": done.windows, "sparse_steps": done.sparse_steps})


def decode_inputs(spec: RenderSpec, job_id: str, video: torch.Tensor, audio: torch.Tensor, fmt: int, crf: int,
                  upscale: tuple[int, int] = (0, 0), on_bytes: BytesFn = _noop,
                  prefix_digest: str = "") -> Iterator[decoder_pb2.DecodeInput]:
    """The messages a Decode call sends: the request, then the latents in chunks (also what grpcurl / ghz send)."""
    req = decoder_pb2.DecodeRequest(job_id=job_id, format=fmt, crf=crf, upscale_width=upscale[0],
                                    upscale_height=upscale[1], prefix_digest=prefix_digest)
    spec_to_proto(spec, req.params)
    yield decoder_pb2.DecodeInput(request=req)
    for name, t in ((VIDEO_LATENTS, video), (AUDIO_LATENTS, audio)):
        for chunk in tensor_chunks(name, t):
            on_bytes("sent", len(chunk.data))
            yield decoder_pb2.DecodeInput(tensor=chunk)


def decode(clients: StageClients, spec: RenderSpec, video: torch.Tensor, audio: torch.Tensor, out_path: Path,
           job_id: str = "", on_progress: ProgressFn = _noop, crf: int = 0, fmt: int = decoder_pb2.MP4,
           timeout_s: float | None = None, upscale: tuple[int, int] = (0, 0), on_call: CallFn = _noop,
           on_bytes: BytesFn = _noop, prefix: Path | None = None) -> StageResult:
    """Stream the decoded file into `out_path` (written beside it, renamed only once complete and verified).
    `upscale` (width, height): the MP4's size when it differs from the render's (scaled in the decoder's mux).
    `prefix`: an extension's source MP4 (uploaded to the decoder first), which opens the MP4."""
    t0 = time.monotonic()
    timeout, metadata = timeout_s or DEADLINES["decoder"], clients.security.metadata()
    digest = upload(clients.decoder.Upload, prefix, prefix.name, timeout=timeout, metadata=metadata) if prefix else ""
    with FileReceiver(Path(out_path)) as recv:
        stream = clients.decoder.Decode(decode_inputs(spec, job_id, video, audio, fmt, crf, upscale, on_bytes, digest),
                                        timeout=timeout, metadata=metadata)
        on_call(stream)
        done = stage_events(stream, "decoder", on_progress, on_bytes, file=recv.feed)
        recv.finish()
    return StageResult("decoder", time.monotonic() - t0, done.timing,
                       {"frames": done.frames, "audio_samples": done.audio_samples, "ranks": done.world_size})


def decode_raw(clients: StageClients, spec: RenderSpec, video: torch.Tensor, audio: torch.Tensor, job_id: str = "",
               on_progress: ProgressFn = _noop, timeout_s: float | None = None, on_bytes: BytesFn = _noop
               ) -> tuple[torch.Tensor, torch.Tensor, StageResult]:
    """Decode without muxing: uint8 frames [F, H, W, 3] and float32 stereo audio [2, N] at 32 kHz."""
    t0 = time.monotonic()
    stream = clients.decoder.Decode(decode_inputs(spec, job_id, video, audio, decoder_pb2.RAW, 0, on_bytes=on_bytes),
                                    timeout=timeout_s or DEADLINES["decoder"], metadata=clients.security.metadata())
    out, done = _drain(stream, on_progress, [RAW_FRAMES, RAW_AUDIO], "decoder", lambda: result_rules("Decode", spec),
                       on_bytes)
    return out[RAW_FRAMES], out[RAW_AUDIO], StageResult(
        "decoder", time.monotonic() - t0, done.timing,
        {"frames": done.frames, "audio_samples": done.audio_samples, "ranks": done.world_size})
