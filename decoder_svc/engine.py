"""The decoder stage's engine: video VAE decode sharded over ranks, audio VAE decode, MP4 mux on rank 0.

The video decode is split into independent tile x chunk work units
(`plan_decode`); rank r decodes units r, r+N, r+2N, ... and rank 0 receives
them round by round with an all-gather over the compute group (NCCL device to
device on GPUs, gloo on CPU) and blends them on its device (bitwise the same as
a one-rank decode). The audio goes to the rank with the fewest video units, so
it overlaps the video work elsewhere.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minimax_h3.contract import (AUDIO_CHANNELS, AUDIO_HOP, AUDIO_LATENTS, AUDIO_SAMPLE_RATE, DEFAULT_CRF,
                                 ENCODED_KEYFRAME, ENCODED_REFERENCE_AUDIO, ENCODED_REFERENCE_VIDEO, H3_GEOMETRY,
                                 RAW_AUDIO, RAW_FRAMES, SAMPLE_OUTPUTS, VIDEO_LATENTS, LatentGeometry, RenderSpec,
                                 audio_latent_count, tensor_shapes)
from minimax_h3.files import CHECKPOINT_PARTS, ensure_embedded, resolve_checkpoint, shown_models_dir
from minimax_h3.media import EMBEDDED_REFERENCE_SIZES, ReferenceSizes
from minimax_h3.mux import DEFAULT_PRESET
from minimax_h3.vae.audio import AudioVAEConfig, inspect_audio_vae, load_audio_vae, write_tiny_audio_vae
from minimax_h3.vae.tiling import StreamingAssembler, num_decoded_frames, plan_decode
from minimax_h3.vae.video import VideoVAEConfig, decode_unit, inspect_video_vae, load_video_vae, write_tiny_video_vae
from stagekit.checkpoints import CheckpointError, WeightSource
from stagekit.dist import RankGroup
from stagekit.engine import StageEngine
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.runtime import release_device_memory
from stagekit.wire import check_finite, check_result

log = logging.getLogger("decoder_svc")

# Where the VAEs are found (minimax_h3.files.CHECKPOINT_PARTS); each excludes the other VAE's file, which its patterns
# also match.
VIDEO_PATTERNS, VIDEO_EXCLUDE = CHECKPOINT_PARTS["video_vae"].patterns, CHECKPOINT_PARTS["video_vae"].exclude
AUDIO_PATTERNS, AUDIO_EXCLUDE = CHECKPOINT_PARTS["audio_vae"].patterns, CHECKPOINT_PARTS["audio_vae"].exclude
# The embedded model's output is noise, so its decode is made cheap where that changes no key: the video VAE
# decodes whole frames (no spatial tiles, whose overlaps cost 4-6x the decode time on a CPU) and the audio VAE's
# decoder is half as wide (128: the last of its seven halvings has one channel). The names say so, so a cache
# written before keeps its own files. Measurements: docs/performance.md.
EMBEDDED_VIDEO, EMBEDDED_AUDIO = "video_vae_tiny_untiled_fp16.safetensors", "audio_vae_tiny_d128.safetensors"
EMBEDDED_SEED = 0
EMBEDDED_PRESET = "ultrafast"  # x264 on noise: the slower presets spend their time on detail nobody watches
# The latent clock a render spec counts in (frames 17n+5 -> 5n+2 latent frames; 40 audio latents/s at 32 kHz).
H3_VIDEO_CLOCK = VideoVAEConfig.full()


@dataclass
class DecoderEngineConfig:
    video_weights: str
    audio_weights: str
    models_dir: str
    cache_dir: Path
    device: str
    weight_dtype: torch.dtype            # video VAE weights: fp16 on GPUs (as the ComfyUI file), fp32 on CPU
    preset: str = ""                     # x264 speed/size trade-off ("": veryfast, ultrafast for the embedded model)
    out_dir: Path = Path(tempfile.gettempdir())


# An extension's guide audio is encoded from this many of the source's last audio latents (30 s): the audio VAE
# encoder's causal attention sees that much of the track before the guide.
EXTEND_AUDIO_LATENTS = 1200


def resolve_weights(cfg: DecoderEngineConfig) -> tuple[Path, Path, bool]:
    """(video VAE, audio VAE, is_embedded): both explicit, both from --models-dir, or both embedded."""
    if bool(cfg.video_weights) != bool(cfg.audio_weights):
        raise FailedPrecondition("give both --video-weights and --audio-weights (or --models-dir)")
    v, embedded = resolve_checkpoint(cfg.video_weights, cfg.models_dir, "video_vae",
                                     lambda: ensure_embedded(cfg.cache_dir, EMBEDDED_VIDEO, lambda tmp: write_tiny_video_vae(
                                         str(tmp), replace(VideoVAEConfig.tiny(), tiling=False), EMBEDDED_SEED)))
    a, _ = resolve_checkpoint(cfg.audio_weights, cfg.models_dir, "audio_vae",
                              lambda: ensure_embedded(cfg.cache_dir, EMBEDDED_AUDIO, lambda tmp: write_tiny_audio_vae(
                                  tmp, AudioVAEConfig.tiny(decoder_dim=128), EMBEDDED_SEED)))
    return v, a, embedded


def check_latents(spec: RenderSpec, inputs: dict, geometry: LatentGeometry = H3_GEOMETRY) -> None:
    """Shapes must agree with the (valid) spec's frames/size (minimax_h3.contract's tensor table); NaN/Inf
    rejected. Raises InvalidArgument."""
    for name, want in tensor_shapes(SAMPLE_OUTPUTS, spec, geometry).items():
        t = inputs.get(name)
        if t is None:
            raise InvalidArgument(f"missing tensor {name!r}")
        if tuple(t.shape) != want:
            raise InvalidArgument(
                f"{name} has shape {list(t.shape)} but {spec.width}x{spec.height}x{spec.frames} needs {list(want)}")
        if not t.is_floating_point():
            raise InvalidArgument(f"{name} must be a float tensor, got {t.dtype}")
        check_finite(name, t)


@dataclass(frozen=True)
class DecodeJob:
    """A Decode: the (validated) render its latents were sampled for, and how the result is written."""

    spec: RenderSpec
    format: str                         # "mp4" | "raw" | "wav" (FORMATS' values)
    crf: int                            # 0: DEFAULT_CRF
    output_name: str
    size: tuple[int, int] | None = None  # an MP4 upscaled to (width, height)
    prefix: Path | None = None          # an extension's source MP4 (uploaded), which the MP4 opens with


@dataclass(frozen=True)
class EncodeImageJob:
    """An EncodeImage: a keyframe fitted to a `width` x `height` canvas (the image itself is the job's input)."""

    width: int
    height: int


@dataclass(frozen=True)
class EncodeReferenceJob:
    """An EncodeReference: a ref2va reference of `kind` for a render of `frames` frames (the media is the input)."""

    kind: str  # "image" | "video" | "audio"
    frames: int


@dataclass(frozen=True)
class EncodeTailJob:
    """An EncodeTail: an extension's guide, from the last frames of its source MP4 at `path`."""

    path: Path
    spec: RenderSpec


DecoderJob = DecodeJob | EncodeImageJob | EncodeReferenceJob | EncodeTailJob
ENCODE_JOBS = (EncodeImageJob, EncodeReferenceJob, EncodeTailJob)  # jobs that need the encoder halves only


class DecoderEngine(StageEngine[DecoderJob]):
    name = "decoder"

    def __init__(self, cfg: DecoderEngineConfig, group: RankGroup):
        self.cfg = cfg
        self.group = group
        self.video_path, self.audio_path, self.embedded = resolve_weights(cfg)
        # Both checkpoints are validated whole from their headers here, before the stage reports SERVING: a bad
        # file fails start-up naming file and key (stagekit.checkpoints.CheckpointError), never the first job.
        self.video_info = inspect_video_vae(str(self.video_path), parts="decoder")
        self.has_video_encoder = any(k.startswith(("encoder.", "quant_conv.")) for k in self.video_info.ckpt.tensors)
        if self.has_video_encoder:  # keyframe encoding (fl2va) loads this half on first use: check it now too
            inspect_video_vae(str(self.video_path), self.video_info.cfg, parts="encoder")
        self.audio_info = inspect_audio_vae(self.audio_path, with_encoder=False)
        self.geometry = self._check_geometry()
        if cfg.device.startswith("cuda"):
            # The same latents always give the same frames and the same MP4: cuDNN picks its deterministic
            # convolution algorithms, never by a timing race.
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        self.video = None
        self.audio = None
        self.video_encoder = None  # VAE encoder half, for EncodeImage / EncodeReference, rank 0 only
        self.audio_encoder = None  # audio VAE with its encoder, for EncodeReference (ref2va voices), rank 0 only
        self.source: WeightSource | None = None  # where the last load read the weights; a job's later loads too
        self.preset = cfg.preset or (EMBEDDED_PRESET if self.embedded else DEFAULT_PRESET)
        # References on the model's sizes (2048 px images, 768 px clips), smaller ones for a tiny VAE (the embedded
        # family's).
        tiny = self.video_info.cfg.block_channels != VideoVAEConfig.full().block_channels
        self.reference_sizes = EMBEDDED_REFERENCE_SIZES if tiny else ReferenceSizes()

    def _check_geometry(self) -> LatentGeometry:
        """The latent geometry this decoder serves, from the VAEs' configs. A render spec counts latents on the H3
        clock, so a VAE on another clock is refused at start-up rather than at the first job."""
        v, a = self.video_info.cfg, self.audio_info.cfg
        clock = ("temporal_ratio", "clip_length", "token_drop")
        if any(getattr(v, f) != getattr(H3_VIDEO_CLOCK, f) for f in clock):
            raise CheckpointError(self.video_path, f"video VAE config ({self.video_info.config_source}) has another "
                                                   f"latent clock than H3's ({', '.join(clock)}); this decoder "
                                                   "serves latents counted on the H3 clock")
        if (a.hop_length, a.sample_rate) != (AUDIO_HOP, AUDIO_SAMPLE_RATE):
            raise CheckpointError(self.audio_path, f"audio VAE config ({self.audio_info.config_source}) has hop "
                                                   f"{a.hop_length} at {a.sample_rate} Hz; H3 latents are hop "
                                                   f"{AUDIO_HOP} at {AUDIO_SAMPLE_RATE} Hz")
        if not self.audio_info.has_stats:
            raise CheckpointError(self.audio_path, "no latents_mean / latents_std in the file and no config giving "
                                                   "them: decoding needs them; pass the audio_vae folder with its "
                                                   "config.json")
        return LatentGeometry(v.latent_channels, v.spatial_ratio, a.latent_channels)

    def weight_files(self, spec: DecoderJob | None = None, inputs: Mapping[str, Any] | None = None
                     ) -> tuple[Path, ...]:
        """Both VAEs' files, for every job: what the stage keeps in host memory between turns when the host has room
        (stagekit/host_copy.py)."""
        return (*self.video_info.ckpt.files, *self.audio_info.ckpt.files)

    def load(self, source: WeightSource) -> None:
        """The decode path: the video VAE's decoder half and the audio VAE decoder (operators' Load, shared mode)."""
        self.source = source
        if self.video is not None:
            return
        dev = self.cfg.device
        t0 = time.monotonic()
        # Validated again (a file replaced since start-up fails with a CheckpointError: FAILED_PRECONDITION), against
        # the configs the stage started with.
        self.video = load_video_vae(str(self.video_path), self.video_info.cfg, self.cfg.weight_dtype, device=dev,
                                    parts="decoder", source=source)
        t1 = time.monotonic()
        self.audio = load_audio_vae(self.audio_path, self.audio_info.cfg, device=dev, with_encoder=False,
                                    source=source)  # fp32
        log.info("loaded the VAE decoders in %.2f s (video %.2f s, audio %.2f s)", time.monotonic() - t0, t1 - t0,
                 time.monotonic() - t1)

    def load_for(self, job: DecoderJob, source: WeightSource) -> None:
        """Exclusive residency loads what the job needs: a keyframe encode only the video VAE's encoder half (rank 0),
        so fl2va keyframes never swap the whole decoder in (docs/render_service.md)."""
        if isinstance(job, ENCODE_JOBS):
            self.source = source
            self._load_encoder()
        else:
            self.load(source)

    def _load_encoder(self) -> None:
        if not self.group.info.is_leader or self.video_encoder is not None:
            return
        if not self.has_video_encoder:
            raise FailedPrecondition(f"{self.video_path} holds only the video VAE decoder; keyframe renders need "
                                     "the full video VAE (encoder included)")
        self.video_encoder = load_video_vae(str(self.video_path), self.video_info.cfg, self.cfg.weight_dtype,
                                            device=self.cfg.device, parts="encoder", source=self.source)

    def _load_audio_encoder(self) -> None:
        if self.audio_encoder is not None:
            return
        info = inspect_audio_vae(self.audio_path)
        if not info.cfg.with_encoder:
            raise FailedPrecondition(f"{self.audio_path} holds only the audio VAE decoder; audio references need "
                                     "the full audio VAE (encoder included)")
        self.audio_encoder = load_audio_vae(self.audio_path, info.cfg, device=self.cfg.device,
                                            source=self.source)  # fp32

    def unload(self) -> None:
        self.video = self.audio = self.video_encoder = self.audio_encoder = self.source = None
        release_device_memory(self.cfg.device)

    def resident_bytes(self) -> int:
        mods = [m for m in (self.video, self.audio, self.video_encoder, self.audio_encoder) if m is not None]
        return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())

    def weight_bytes(self) -> int:
        """Device bytes of the decode path (the video VAE's decoder half in the weight dtype, the audio VAE without
        its encoder in fp32) from the headers: what shared residency reserves for the first load."""
        elem = torch.empty((), dtype=self.cfg.weight_dtype).element_size()
        video = sum(math.prod(e.shape) for k, e in self.video_info.ckpt.tensors.items()
                    if not k.startswith(("encoder.", "quant_conv.")))
        audio = sum(math.prod(e.shape) for k, e in self.audio_info.ckpt.tensors.items() if not k.startswith("encoder."))
        return video * elem + audio * 4

    def _audio_rank(self, n_units: int) -> int:
        n = self.group.world_size
        counts = [len(range(r, n_units, n)) for r in range(n)]
        return min(range(n), key=lambda r: (counts[r], -r))  # fewest units; prefer a non-leader on ties

    @torch.inference_mode()
    def encode_image(self, image: torch.Tensor, ctx) -> dict:
        """Canvas-sized uint8 [H, W, 3] keyframe -> {"latents": [24, 1, H/16, W/16] float32}: the normalised posterior
        mean (ComfyUI's keyframe recipe, docs/model.md §3.3). The encoder half is loaded on first use and kept while
        resident."""
        if not self.group.info.is_leader:
            return {}  # a single image is one small unit of work: rank 0 does it alone
        if self.video_encoder is None:  # resident for decodes: add the encoder half
            ctx.progress(0, 1, phase="loading", message="video VAE encoder")
            self._load_encoder()
        ctx.progress(0, 1)
        pixels = image.permute(2, 0, 1).contiguous()  # [3, H, W] uint8; encode() scales to [0, 1]
        autocast = None if self.cfg.weight_dtype == torch.float32 else self.cfg.weight_dtype
        latents = self.video_encoder.encode(pixels.to(self.cfg.device), autocast_dtype=autocast).float().cpu()
        check_result("decoder", "keyframe latents (video VAE encode)", latents, "channel")
        ctx.progress(1, 1)
        return {ENCODED_KEYFRAME: latents}

    @torch.inference_mode()
    def encode_reference(self, media, ctx) -> dict:
        """A ref2va reference on the model's rates (minimax_h3.media.ReferenceMedia) -> {"video": [24, T, h, w]}
        and/or {"audio": [2, 32, Ta]}: normalised posterior means (docs/model.md §3.4). Rank 0 alone."""
        if not self.group.info.is_leader:
            return {}
        out = {"info": media.info()}
        if media.frames is not None:
            if self.video_encoder is None:
                ctx.progress(0, 1, phase="loading", message="video VAE encoder")
                self._load_encoder()
            ctx.progress(0, 1, message=f"{media.kind} reference: video VAE")
            pixels = torch.from_numpy(media.vae_frames).permute(3, 0, 1, 2).contiguous()  # [3, N, H, W] uint8
            autocast = None if self.cfg.weight_dtype == torch.float32 else self.cfg.weight_dtype
            out[ENCODED_REFERENCE_VIDEO] = self.video_encoder.encode(pixels.to(self.cfg.device), autocast_dtype=autocast).float().cpu()
        if media.audio is not None:
            if self.audio_encoder is None:
                ctx.progress(0, 1, phase="loading", message="audio VAE encoder")
                self._load_audio_encoder()
            ctx.progress(0, 1, message=f"{media.kind} reference: audio VAE")
            wave = torch.from_numpy(media.audio).to(self.cfg.device).unsqueeze(1)  # [2, 1, samples]
            out[ENCODED_REFERENCE_AUDIO] = self.audio_encoder.normalize(self.audio_encoder.encode(wave)).float().cpu()
        ctx.progress(1, 1)
        return out

    @torch.inference_mode()
    def encode_tail(self, path: Path, spec: RenderSpec, ctx) -> dict:
        """An extension's guide from its source MP4 (docs/long_video.md, "Extend"): the last `guide_frames` frames
        (from a 17-frame clip boundary, so their latents are those a whole-clip encode gives) fitted to the canvas and
        encoded by the video VAE; the soundtrack's last EXTEND_AUDIO_LATENTS latents before `prefix_frames` encoded by
        the audio VAE, of which the guide's frames' are kept (the encoder's causal attention sees those seconds of the
        track, not all of it). Rank 0 alone."""
        if not self.group.info.is_leader:
            return {}
        if self.video_encoder is None:
            ctx.progress(0, 2, phase="loading", message="video VAE encoder")
            self._load_encoder()
        if self.audio_encoder is None:
            ctx.progress(0, 2, phase="loading", message="audio VAE encoder")
            self._load_audio_encoder()
        from minimax_h3.media import clip_audio, clip_frames

        ctx.progress(0, 2, message=f"the source's last {spec.guide_frames} frames: video VAE")
        pixels = np.stack(list(clip_frames(path, spec.span_start, spec.guide_frames, (spec.width, spec.height))))
        autocast = None if self.cfg.weight_dtype == torch.float32 else self.cfg.weight_dtype
        video = self.video_encoder.encode(torch.from_numpy(pixels).permute(3, 0, 1, 2).contiguous().to(
            self.cfg.device), autocast_dtype=autocast).float().cpu()
        ctx.progress(1, 2, message="its soundtrack: audio VAE")
        end = audio_latent_count(spec.prefix_frames)
        first = max(0, end - EXTEND_AUDIO_LATENTS)
        wave = torch.from_numpy(clip_audio(path, first * AUDIO_HOP, (end - first) * AUDIO_HOP))
        z = self.audio_encoder.normalize(self.audio_encoder.encode(wave.to(self.cfg.device).unsqueeze(1))).float()
        audio = z[..., z.shape[-1] - spec.guide_audio_latents:].cpu()
        check_result("decoder", "guide latents (video VAE encode)", video, "channel")
        check_result("decoder", "guide latents (audio VAE encode)", audio, "channel")
        ctx.progress(2, 2)
        return {ENCODED_REFERENCE_VIDEO: video, ENCODED_REFERENCE_AUDIO: audio}

    @torch.inference_mode()
    def run(self, job: DecoderJob, inputs: dict, ctx) -> dict:
        if isinstance(job, EncodeImageJob):
            return self.encode_image(inputs["image"], ctx)
        if isinstance(job, EncodeReferenceJob):
            return self.encode_reference(inputs["media"], ctx)
        if isinstance(job, EncodeTailJob):
            return self.encode_tail(job.path, job.spec, ctx)
        if self.video is None:  # resident for keyframe encodes only: add the decode path
            ctx.progress(0, 1, phase="loading", message="video + audio VAE decoders")
            self.load(self.source)
        video_lat = inputs[VIDEO_LATENTS].float()
        plan = plan_decode(self.video.cfg, *video_lat.shape[1:])
        leader = self.group.info.is_leader
        # The audio first, on the rank with the fewest video units: the mux interleaves it with the frames as they
        # are decoded. The audio is small ([2, samples]): it travels as a pickled object over the control group.
        audio = None
        sound = inputs[AUDIO_LATENTS].shape[-1] > 0  # an image (one frame) has none
        if not sound and job.format == "wav":
            raise InvalidArgument("an image (one frame) has no sound to write as WAV: ask for mp4 or raw")
        if sound and self.group.info.rank == self._audio_rank(len(plan)):
            audio = self.audio.decode_rows(self.audio.batch_to_rows(inputs[AUDIO_LATENTS].float())).cpu()
        gathered = self.group.gather_objects(audio)
        rounds_done = [self.group.world_size == 1]
        chunks = self._frame_chunks(plan, video_lat, ctx, rounds_done)
        if not leader:
            for _ in chunks:  # every rank passes the same rounds; only rank 0 assembles
                pass
            return {}
        audio = next((a for a in gathered if a is not None), None)
        if audio is not None:  # Latents were checked finite on arrival: a NaN now is this server's fault (INTERNAL)
            check_result("decoder", "audio (audio VAE decode)", audio, "sample", axis=1)

        def check_cancel() -> None:  # the mux's check before each frame: rank 0 alone, once no collective is left
            if rounds_done[0]:
                ctx.check_cancel_local()

        return self._output(job, plan[0].geom, chunks, audio, check_cancel)

    def _frame_chunks(self, plan, video_lat: torch.Tensor, ctx, rounds_done: list[bool]) -> Iterator[torch.Tensor]:
        """Decode the video units round by round (rank r decodes units r, r + N, ...; rank 0 gathers and blends them
        on its device) and yield, on rank 0, each stretch of finished frames [3, n, H, W] in [0, 1] on the host the
        moment its temporal chunk is complete: a clip's frames are never held whole. Sets `rounds_done[0]` once
        the last collective has passed."""
        n, rank = self.group.world_size, self.group.info.rank
        rounds = -(-len(plan) // n)
        leader = self.group.info.is_leader
        dev = self.cfg.device
        ready: deque[torch.Tensor] = deque()
        asm = StreamingAssembler(plan, device=dev, sink=ready.append) if leader else None

        total, done = num_decoded_frames(self.video.cfg, video_lat.shape[1]), [0]

        def finished():
            while ready:
                part = ready.popleft().cpu()
                check_result("decoder", "video frames (video VAE decode)", part, "frame", axis=1, offset=done[0],
                             total=total)
                done[0] += part.shape[1]
                yield part

        for k in range(rounds):  # every rank passes the same number of step boundaries
            ctx.check_cancel()
            units = [j for j in range(k * n, (k + 1) * n) if j < len(plan)]  # this round's unit of each rank
            idx = k * n + rank
            out = decode_unit(self.video, video_lat, plan[idx], validate=k == 0) if idx < len(plan) else None
            if self.group.compute is None:
                asm.add(plan[idx], out)
            else:
                # Every rank's unit reaches rank 0 device to device over the compute group's own communicator
                # (NCCL all-gather on GPUs, gloo on CPU), padded to the round's largest unit; fp32 holds any
                # unit dtype exactly.
                size = max(math.prod(plan[j].output_shape()) for j in units)
                flat = torch.zeros(size, dtype=torch.float32, device=dev)
                if out is not None:
                    flat[: out.numel()] = out.reshape(-1)
                parts = self.group.all_gather(flat)
                if leader:
                    for j in units:
                        shape = plan[j].output_shape()
                        asm.add(plan[j], parts[j - k * n][: math.prod(shape)].view(shape))
                del flat, parts
            del out
            ranks = f"{n} rank{'s' if n > 1 else ''}"
            ctx.progress(k + 1, rounds, message=f"video tiles x chunks ({len(plan)} units on {ranks})")
            yield from finished()
        rounds_done[0] = True
        if leader:
            asm.finish()
            yield from finished()

    def _output(self, job: DecodeJob, geom, chunks: Iterator[torch.Tensor], audio: torch.Tensor | None,
                check_cancel) -> dict:
        """The decoded clip as the job asks: raw frames and audio, a WAV, or an MP4 (video only for an image,
        `audio` None)."""
        # Imported here: PyAV/soundfile are needed only to mux, not to decode (RAW output runs without them).
        from minimax_h3.mux import FrameStream, frames_to_uint8, write_mp4, write_wav

        fmt, name, spec = job.format, job.output_name, job.spec
        if fmt == "raw":
            frames = torch.cat(list(chunks), dim=1)
            return {RAW_FRAMES: torch.from_numpy(frames_to_uint8(frames)),
                    RAW_AUDIO: torch.zeros(AUDIO_CHANNELS, 0) if audio is None else audio.float()}
        suffix = ".wav" if fmt == "wav" else ".mp4"
        fd, tmp = tempfile.mkstemp(prefix="h3dec-", suffix=suffix, dir=self.cfg.out_dir)
        os.close(fd)
        t0 = time.monotonic()
        frames = geom.num_frames
        try:
            if fmt == "wav":
                for _ in chunks:  # the rounds end on every rank alike
                    pass
                write_wav(tmp, audio)
            else:  # streamed chunk by chunk; cancellable frame by frame: a client that left stops the mux
                prefix = None
                if spec.prefix_frames:  # an extension: its source clip, then the span past the guide
                    prefix, audio = self._prefix(job, spec, audio)
                    chunks = _skip_frames(chunks, spec.guide_frames)
                    frames = spec.frames - spec.prefix_frames
                write_mp4(tmp, FrameStream(frames, geom.height, geom.width, chunks), audio,
                          crf=job.crf or DEFAULT_CRF, preset=self.preset, size=job.size,
                          check_cancel=check_cancel, prefix=prefix)
                frames += spec.prefix_frames
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)  # a failed or cancelled mux leaves nothing behind
            log.info("mux of %s abandoned after %.2f s (%s)", name, time.monotonic() - t0, type(e).__name__)
            raise
        log.info("muxed %s in %.2f s", name, time.monotonic() - t0)
        samples = 0 if audio is None else audio.shape[-1]
        return {"file": Path(tmp), "name": name, "frames": frames, "audio_samples": samples}

    @staticmethod
    def _prefix(job: DecodeJob, spec: RenderSpec, audio: torch.Tensor) -> tuple[tuple[int, Iterator], torch.Tensor]:
        """An extension's MP4 opens with its source clip: its first `prefix_frames` frames as they are (the MP4's own
        size) and its sound up to the first audio latent the span adds; the span's sound follows from there."""
        from minimax_h3.media import clip_audio, clip_frames, clip_size

        path = job.prefix
        width, height = job.size or (spec.width, spec.height)
        if clip_size(path) != (width, height):
            raise InvalidArgument(f"the source clip is {'x'.join(map(str, clip_size(path)))}, this extension's MP4 "
                                  f"{width}x{height}: an extension keeps its source's size")
        cut = audio_latent_count(spec.prefix_frames) * AUDIO_HOP
        head = torch.from_numpy(clip_audio(path, 0, cut))
        tail = audio[:, spec.guide_audio_latents * AUDIO_HOP:]
        return (spec.prefix_frames, clip_frames(path, 0, spec.prefix_frames)), torch.cat([head, tail], dim=1)

    def describe(self) -> dict:
        v, a = self.video_info, self.audio_info
        stored = f"{v.storage} dequantised to " if v.quant else ""
        variant = (f"video {v.layout} {stored}{str(self.cfg.weight_dtype).replace('torch.', '')} "
                   f"(config: {v.config_source}) / "
                   f"audio {a.layout} fp32 (config: {a.config_source})")
        return {"weights": f"{self.video_path} + {self.audio_path}", "variant": variant,
                "embedded_model": self.embedded, "devices": [self.cfg.device],
                "models_dir": shown_models_dir(self.cfg.models_dir)}


def _skip_frames(chunks: Iterator[torch.Tensor], n: int) -> Iterator[torch.Tensor]:
    """The frames of `chunks` ([3, k, H, W] each) past the first `n`."""
    for part in chunks:
        if n >= part.shape[1]:
            n -= part.shape[1]
            continue
        yield part[:, n:]
        n = 0
