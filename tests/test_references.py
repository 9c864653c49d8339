"""ref2va references through the stages: media onto the model's rates (PyAV), the decoder's reference encodes
against diffusers' (oracle), the encoder's presentation, renders through the stages, the CLI and the render
service (real processes, embedded tiny stack), admission and the web page's reference info."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch

from minimax_h3.dit.layout import patchify_audio

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3VideoReference  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep  # noqa: E402
from diffusers.modular_pipelines.modular_pipeline import SequentialPipelineBlocks  # noqa: E402

FRAMES = 22


# ---------------------------------------------------------------------------------------------------------------
# Reference media and the stages (real processes, embedded tiny stack)
# ---------------------------------------------------------------------------------------------------------------
def media_mp4(n: int = 40, fps: int = 30, w: int = 112, h: int = 64, rate: int | None = 44100) -> bytes:
    """An H.264 clip at `fps` with an AAC stereo soundtrack at `rate` (none when rate is None)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        a = c.add_stream("aac", rate=rate) if rate else None
        if a is not None:
            a.layout = "stereo"
        rng = np.random.default_rng(0)
        for _ in range(n):
            for p in v.encode(av.VideoFrame.from_ndarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "rgb24")):
                c.mux(p)
        c.mux(v.encode())
        if a is not None:
            for s in range(0, int(n / fps * rate), 1024):
                t = (s + np.arange(1024)) / rate
                wave = (0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)])).astype(np.float32)
                frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="stereo")
                frame.sample_rate = rate
                c.mux(a.encode(frame))
            c.mux(a.encode())
    return buf.getvalue()


def media_wav(seconds: float = 1.0, rate: int = 32000, channels: int = 1) -> bytes:
    import io
    import wave

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.repeat(pcm[:, None], channels, 1).tobytes())
    return buf.getvalue()


def media_png(w: int = 96, h: int = 64, seed: int = 1) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_reference_media_on_the_model_rates():
    """Images at a 2048 px short edge; a 30 fps clip onto 24 fps, its canvas, 17n + 5 frames and its soundtrack onto
    32 kHz stereo, both cut to the render's duration; a voice at 44.1 kHz resampled; a too-short clip refused."""
    from minimax_h3.media import load_reference
    from stagekit.errors import InvalidArgument

    img = load_reference(media_png(300, 200), "image", FRAMES)
    assert img.frames.shape == (1, 2048, 3072, 3)
    clip = load_reference(media_mp4(n=90, fps=30), "video", 124)  # 3 s at 30 fps -> 72 frames at 24 -> VAE: 56
    assert clip.frames.shape == (72, 768, 1344, 3) and clip.source_fps == 30.0 and clip.source_rate == 44100
    assert clip.vae_frames.shape[0] == 56 and clip.info()["frames"] == 56 and clip.seconds == 56 / 24
    assert clip.audio.shape[0] == 2 and abs(clip.audio.shape[1] - 3 * 32000) < 2048
    voice = load_reference(media_wav(2.0, 44100), "audio", FRAMES)  # cut to 22/24 s, resampled to 32 kHz
    assert voice.audio.shape == (2, round(int(22 / 24 * 44100) * 32000 / 44100)) or \
        abs(voice.audio.shape[1] - 22 / 24 * 32000) < 64
    spectrum = np.abs(np.fft.rfft(voice.audio[0]))
    assert abs(np.argmax(spectrum) * 32000 / voice.audio.shape[1] - 330) < 3  # the same tone after resampling
    with pytest.raises(InvalidArgument, match="at least 22 frames"):
        load_reference(media_mp4(n=20, fps=30, rate=None), "video", 124)
    with pytest.raises(InvalidArgument, match="cannot be used"):
        load_reference(b"not a video", "video", 124)


def test_reference_encodes_match_diffusers(tmp_path):
    """The decoder's reference encodes vs diffusers' (oracle) on tiny random VAEs: the same normalised pixels as
    diffusers' ref2va setup step (an image, a 30 fps clip), then the video VAE's posterior mean and the audio VAE's
    (diffusers' reference-encoder step) within 1e-4."""
    from minimax_h3.vae.audio import AudioVAEConfig, load_audio_vae, write_tiny_audio_vae
    from minimax_h3.vae.video import VideoVAEConfig, load_video_vae, write_tiny_video_vae
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from PIL import Image
    from minimax_h3.media import load_reference
    from tests.test_audio_vae import _oracle as audio_oracle
    from tests.test_video_vae import _oracle as video_oracle

    vcfg, acfg = VideoVAEConfig.tiny(), AudioVAEConfig.tiny()
    write_tiny_video_vae(str(tmp_path / "v.safetensors"), vcfg, 0)
    write_tiny_audio_vae(tmp_path / "a.safetensors", acfg, 0)
    vae = load_video_vae(str(tmp_path / "v.safetensors"), vcfg, torch.float32, parts="all")
    avae = load_audio_vae(tmp_path / "a.safetensors", acfg)
    dv, da = video_oracle(vcfg, vae), audio_oracle(acfg)
    from minimax_h3.vae.audio import unfold_weight_norm_state_dict

    sd = avae.state_dict()
    da.load_state_dict({k: v for k, v in unfold_weight_norm_state_dict(sd, avae).items()
                        if not k.startswith("latents_")})
    da.register_to_config(latents_mean=sd["latents_mean"].flatten().tolist(),
                          latents_std=sd["latents_std"].flatten().tolist())

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # An image: diffusers' setup step resizes it (PIL LANCZOS) to the same pixels.
    png = media_png(150, 100)
    ours = load_reference(png, "image", FRAMES)
    setup = MiniMaxH3Ref2VASetupStep()
    from diffusers.image_processor import VaeImageProcessor

    want = np.asarray(VaeImageProcessor(vae_scale_factor=16).resize(Image.open(__import__("io").BytesIO(png))
                                                                   .convert("RGB"), height=2048, width=3072))
    assert setup.max_images == 9 and np.array_equal(ours.frames[0], want)
    # A clip: our decode + normalisation == diffusers' decode (from_file) + normalisation, pixel for pixel.
    path = tmp_path / "clip.mp4"
    path.write_bytes(media_mp4(n=40, fps=30, rate=32000))
    clip = load_reference(path.read_bytes(), "video", FRAMES)
    ref = MiniMaxH3VideoReference.from_file(str(path))
    frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(ref.frames, ref.fps, FRAMES, 32, 768, 768 * 1344,
                                                                 24.0)
    assert np.array_equal(clip.frames, frames) and clip.vae_frames.shape[0] == 22
    wave = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(ref.audio, ref.sample_rate, 32000, FRAMES / 24)
    assert torch.equal(torch.from_numpy(clip.audio), wave)  # 32 kHz already: cut and kept as is
    # Encodes: video VAE mean (ComfyUI's recipe; diffusers samples it) and the audio VAE as diffusers' step does.
    # The encoders see a 64 x 96 corner of the normalised pixels (the whole 2048 px image is minutes on a CPU).
    for media in (ours, clip):
        pixels = media.vae_frames[:, :64, :96]
        z = vae.encode(torch.from_numpy(pixels).permute(3, 0, 1, 2))
        with torch.no_grad():
            x = (torch.from_numpy(pixels).permute(3, 0, 1, 2)[None].float() / 255
                 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)) / torch.tensor(
                [0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1)
            mean = dv.encode(x).latent_dist.mode()[0]
        m, s = vae._stats(z.device)
        assert rel(z, (mean - m) / s) < 1e-4
    pipe = SequentialPipelineBlocks.from_blocks_dict({"enc": MiniMaxH3Ref2VAReferenceEncoderStep()}).init_pipeline()
    pipe.update_components(vae=dv, audio_vae=da)
    with torch.no_grad():
        out = pipe(normalized_references=[MiniMaxH3AudioReference(audio=wave, sample_rate=32000)],
                   output="audio_condition_latents")
    ours_rows = patchify_audio(avae.normalize(avae.encode(torch.from_numpy(clip.audio).unsqueeze(1))))
    assert rel(ours_rows, out[0]) < 1e-4


def comfy_ref_size(w: int, h: int, mode: str, render_w: int, render_h: int, short_edge: int = 2048) -> tuple[int, int]:
    """ComfyUI's MiniMaxH3ReferenceToVideo sizing of an image reference, as its `ref_image_size` tooltip states it:
    "match" scales down only (aspect kept) to the generation's pixel area, "max" down only to a 2048 px short edge;
    each side then rounded to a multiple of 32 (at least 32). Returns (width, height)."""
    if mode == "match":
        scale = min(1.0, math.sqrt(render_w * render_h / (w * h)))
    else:
        scale = min(1.0, short_edge / min(w, h))
    return tuple(max(32, round(x * scale / 32) * 32) for x in (w, h))


@pytest.mark.parametrize("w,h", [(3000, 2000), (1000, 1500), (640, 360), (200, 300), (4000, 1000)])
def test_image_references_sized_as_the_request_says(w, h):
    """ref_image_size: unset = the model's 2048 px short edge, up or down; "max" / "match" as ComfyUI's node sizes
    them (computed here from its rule); an unknown mode or a "match" without the render's size is refused."""
    from minimax_h3.media import ImageFit, normalize_image
    from stagekit.errors import InvalidArgument

    pixels = np.zeros((h, w, 3), np.uint8)
    own = normalize_image(pixels, 2048, ImageFit.of("", 864, 480))
    assert own.shape[1:3] == tuple(max(32, round(x * 2048 / min(w, h) / 32) * 32) for x in (h, w))
    for mode, (rw, rh) in (("max", (864, 480)), ("match", (864, 480)), ("match", (1344, 768))):
        got = normalize_image(pixels, 2048, ImageFit.of(mode, rw, rh))
        tw, th = comfy_ref_size(w, h, mode, rw, rh)
        assert got.shape == (1, th, tw, 3), (mode, rw, rh)
    with pytest.raises(InvalidArgument, match="choose max or match"):
        ImageFit.of("min", 864, 480)
    with pytest.raises(InvalidArgument, match="send its width and height"):
        ImageFit.of("match", 0, 0)


def test_ref_image_size_in_the_video_api_the_cli_and_the_contract():
    """The field in /v1/videos (and its schema), the CLI flag, and the spec's check of it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from minimax_h3.contract import REF_IMAGE_SIZES, RenderSpec, validate
    from render_svc.http_api import render_request as http_render_request
    from stagekit.errors import InvalidArgument

    root = Path(__file__).resolve().parents[1]
    assert http_render_request({"prompt": "x", "ref_image_size": "match"}, "").params.ref_image_size == "match"
    assert http_render_request({"prompt": "x"}, "").params.ref_image_size == ""
    schema = json.loads((root / "render_svc" / "openapi.json").read_text())["components"]["schemas"]
    assert ("", *schema["CreateVideoRequest"]["properties"]["ref_image_size"]["enum"]) == REF_IMAGE_SIZES
    with pytest.raises(InvalidArgument, match="unknown ref_image_size 'min'"):
        validate(RenderSpec(prompt="x", ref_image_size="min"))
    out = subprocess.run([sys.executable, "-m", "client", "render", "--prompt", "x", "--ref-image-size", "min"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--ref-image-size" in out.stderr and "match" in out.stderr


def test_match_sized_references_through_the_stages(clients, tmp_path):
    """"match" reaches both stages that see an image reference: the decoder's VAE encodes it at the render's area
    and the encoder shows the vision tower the same picture (fewer vision tokens); the render completes."""
    from client.render_client import render_request
    from h3.v1 import common_pb2
    from minimax_h3.contract import RenderSpec
    from render_svc.engine import render
    from render_svc.stage_calls import encode

    refs = [common_pb2.Reference(kind="image", data=media_png(600, 400), name="subject.png")]
    tw, th = comfy_ref_size(600, 400, "match", 256, 256)
    assert (tw, th) == (320, 224)
    spec = RenderSpec(prompt="<Picture 1> waves", width=256, height=256, frames=FRAMES, steps=1, seed=3,
                      ref_image_size="match")
    _, own, _ = encode(clients, spec.prompt, with_tags=True, references=refs, frames=FRAMES)
    _, matched, _ = encode(clients, spec.prompt, with_tags=True, references=refs, frames=FRAMES, width=256,
                           height=256, ref_image_size="match")
    assert (own == 0).sum().item() == (384 // 32) * (256 // 32) + 2  # the embedded family's 256 px short edge
    assert (matched == 0).sum().item() == (tw // 32) * (th // 32) + 2
    res = render(clients, render_request(spec, references=refs), tmp_path / "match.mp4")
    call = res.stages[0].extra  # the decoder's one EncodeReference
    assert call["op"] == "encode_reference" and (call["width"], call["height"]) == (tw, th)
    with pytest.raises(grpc.RpcError) as e:
        encode(clients, spec.prompt, references=refs, frames=FRAMES, width=256, height=256, ref_image_size="big")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "choose max or match" in e.value.details()


def test_ref2va_render_through_the_stages(clients, tmp_path):
    """Image + voice references, W x H render, through decoder EncodeReference, the encoder's presentation and the
    embedded DiT's ref2va file, to a valid MP4; the DiT reports both partitions."""
    import av

    from client.render_client import render_request
    from h3.v1 import common_pb2
    from minimax_h3.contract import RenderSpec
    from render_svc.engine import render
    from render_svc.stage_calls import encode

    st = clients.dit.Status(common_pb2.StatusRequest(), timeout=30)
    assert set(st.partitions) == {"fl2va", "ref2va"}
    refs = [common_pb2.Reference(kind="image", data=media_png(96, 64), name="subject.png"),
            common_pb2.Reference(kind="audio", data=media_wav(0.5), name="voice.wav")]
    spec = RenderSpec(prompt="<Picture 1> sings with the voice of <Audio 1>", width=256, height=256, frames=FRAMES,
                      steps=1, seed=3)
    s, tags, _ = encode(clients, spec.prompt, with_tags=True, references=refs, frames=FRAMES)
    n_pad = (256 // 32) * (384 // 32)  # the embedded family's 256 px short edge (2048 px for H3), 32 px a token
    assert (tags == 0).sum().item() == n_pad + 2 and s.shape[0] == tags.shape[0]
    out = tmp_path / "ref2va.mp4"
    res = render(clients, render_request(spec, references=refs), out)
    assert [r.stage for r in res.stages] == ["decoder", "encoder", "dit", "decoder"]  # both references: one stage
    calls = res.stages[0].extra["calls"]
    assert calls[0]["width"] == 384 and calls[1]["seconds"] == pytest.approx(0.5, abs=0.03)
    with av.open(str(out)) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (256, 256) and c.streams.audio
        assert sum(1 for _ in c.decode(video=0)) == FRAMES


def test_video_reference_presented_by_the_encoder(clients):
    """A clip with its soundtrack, through the encoder stage: "<Audio 1>: <Video 1>: <0.2 seconds>" + one block of
    video pads (22 frames at 24 fps: 2 frames read at 2 fps, one temporal patch) on its canvas (the embedded family's
    256 px short edge: 256 x 448; 768 x 1344 for H3)."""
    from h3.v1 import common_pb2
    from render_svc.stage_calls import encode

    ref = common_pb2.Reference(kind="video", data=media_mp4(n=40, fps=30), name="walk.mp4")
    states, tags, _ = encode(clients, "<Video 1> in the rain", with_tags=True, references=[ref], frames=FRAMES)
    assert (tags == 0).sum().item() == (256 // 32) * (448 // 32) + 2 and states.shape[0] == tags.shape[0]
    assert torch.isfinite(states.float()).all()


def test_cli_ref_labels_checked_before_anything_starts(tmp_path):
    """A label naming no reference, or a reference the prompt never names, exits 2 before any stage starts."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "a.png").write_bytes(media_png())
    (tmp_path / "v.wav").write_bytes(media_wav(0.3))
    base = [sys.executable, "-m", "client", "render", "-o", str(tmp_path / "x.mp4"), "--frames", str(FRAMES),
            "--render", "127.0.0.1:1", "--ref", str(tmp_path / "a.png"), "--ref", str(tmp_path / "v.wav")]
    for prompt, needle in (("<Picture 1> talks like <Audio 2>", "names <Audio 2>"),
                           ("<Picture 1> walks", "never names <Audio 1> (v.wav)"),
                           ("<Picture 2> and <Audio 1>", "names <Picture 2>")):
        r = subprocess.run([*base, "--prompt", prompt], cwd=root, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
    r = subprocess.run([*base, "--prompt", "<Picture 1>", "--first-frame", str(tmp_path / "a.png")], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not combine" in r.stderr, r.stderr


def test_cli_ref_render_through_the_render_service(stack, tmp_path):
    """`render --ref subject.png --ref voice.wav`: the render service's reference stage, encoder, DiT (ref2va) and
    decoder, to an MP4; then a text render on the same stack (the DiT back on fl2va)."""
    import av

    from client.__main__ import main as client_main

    _, ep = stack
    args = ["--width", "256", "--height", "256", "--frames", str(FRAMES), "--steps", "1", "--encoder", ep.encoder,
            "--dit", ep.dit, "--decoder", ep.decoder]
    (tmp_path / "subject.png").write_bytes(media_png(80, 120))
    (tmp_path / "voice.wav").write_bytes(media_wav(0.4, 48000, channels=2))
    out = tmp_path / "ref.mp4"
    assert client_main(["render", "--prompt", "<Picture 1> says hello in <Audio 1>'s voice", "--ref",
                        str(tmp_path / "subject.png"), "--ref", str(tmp_path / "voice.wav"), "-o", str(out),
                        *args]) == 0
    assert client_main(["render", "--prompt", "waves", "-o", str(tmp_path / "t2va.mp4"), *args]) == 0
    for f in (out, tmp_path / "t2va.mp4"):
        with av.open(str(f)) as c:
            assert c.streams.video[0].width == 256 and sum(1 for _ in c.decode(video=0)) == FRAMES


def test_cli_video_reference_render_through_the_render_service(stack, tmp_path):
    """`render --ref walk.mp4 --ref voice.wav`: a 30 fps clip with its soundtrack (<Audio 1>, not named) and a voice
    (<Audio 2>) through the render service: the decoder's encodes, the encoder's presentation of the clip, the DiT's
    ref2va file and the decode, to an MP4."""
    import av

    from client.__main__ import main as client_main

    _, ep = stack
    (tmp_path / "walk.mp4").write_bytes(media_mp4(n=40, fps=30))
    (tmp_path / "voice.wav").write_bytes(media_wav(0.4, 44100))
    out = tmp_path / "video_ref.mp4"
    assert client_main(["render", "--prompt", "a dog walks like <Video 1> and barks in <Audio 2>'s voice",
                        "--ref", str(tmp_path / "walk.mp4"), "--ref", str(tmp_path / "voice.wav"), "-o", str(out),
                        "--width", "256", "--height", "256", "--frames", str(FRAMES), "--steps", "1",
                        "--encoder", ep.encoder, "--dit", ep.dit, "--decoder", ep.decoder]) == 0
    with av.open(str(out)) as c:
        assert c.streams.video[0].width == 256 and c.streams.audio and sum(1 for _ in c.decode(video=0)) == FRAMES


def test_dit_batch_runs_partition_by_partition():
    """A mixed DiT batch is sent one partition after the other, the one the DiT ran last first: one swap."""
    from render_svc.planner import Affinity, QueuedJob, batch_rounds

    jobs = [QueuedJob("j0"), QueuedJob("j1", partition="ref2va"), QueuedJob("j2"), QueuedJob("j3", partition="ref2va")]
    rounds, held = batch_rounds("dit", jobs, Affinity())
    assert rounds == (("j0", "j2"), ("j1", "j3")) and held.partition == "ref2va"
    rounds, held = batch_rounds("dit", jobs, held)  # the DiT holds ref2va now: those go first
    assert rounds == (("j1", "j3"), ("j0", "j2")) and held.partition == "fl2va"
    assert batch_rounds("encoder", jobs, held) == ((("j0", "j1", "j2", "j3"),), None)


def test_render_service_keeps_reference_thumbnails_not_files(tmp_path):
    """Admission fills in each reference's thumbnail, size and duration; JobInfo shows them (no file bytes), and a
    finished job's stored request drops the files but keeps what the web page shows (a video's thumbnail: its first
    frame)."""
    from h3.v1 import common_pb2, render_pb2
    from minimax_h3.contract import RenderSpec, spec_to_proto
    from render_svc.admission import check_request, describe_reference
    from render_svc.store import SUCCEEDED, JobStore
    from stagekit.errors import InvalidArgument

    req = render_pb2.RenderRequest(references=[
        common_pb2.Reference(kind="image", data=media_png(300, 200), name="me.png"),
        common_pb2.Reference(kind="audio", data=media_wav(0.5), name="voice.wav")])
    spec_to_proto(RenderSpec(prompt="<Picture 1> talks like <Audio 1>", frames=FRAMES), req.params)
    check_request(req)
    image, audio = req.references
    assert (image.width, image.height) == (300, 200) and image.thumbnail[:2] == b"\xff\xd8"  # a JPEG
    assert audio.seconds == pytest.approx(0.5, abs=0.01) and not audio.thumbnail
    video = common_pb2.Reference(kind="video", data=media_mp4(n=30, fps=30), name="walk.mp4")
    assert describe_reference(video, 0, FRAMES) is True  # it has a soundtrack: <Audio j> before its <Video k>
    assert (video.width, video.height) == (112, 64) and video.seconds == pytest.approx(1.0, abs=0.1)
    store = JobStore(tmp_path)
    rec, _ = store.submit(req)
    info = store.get(rec.id).info()
    assert [r.name for r in info.references] == ["me.png", "voice.wav"]
    assert all(not r.data for r in info.references) and info.references[0].thumbnail == image.thumbnail
    store.start(rec.id, "keyframes")
    store.finish(rec.id, SUCCEEDED)
    stored = store.get(rec.id).request
    assert all(not r.data for r in stored.references) and stored.references[0].thumbnail == image.thumbnail
    store.close()
    bad = render_pb2.RenderRequest()
    bad.CopyFrom(req)
    bad.params.prompt = "<Picture 1> talks"  # the voice is never named
    with pytest.raises(InvalidArgument, match="never names <Audio 1> \\(voice.wav\\)"):
        check_request(bad)
    bad.params.prompt = "<Picture 1> walks like <Video 1> and talks like <Audio 2>"
    bad.references.insert(1, video)
    check_request(bad)  # a video with its soundtrack (<Audio 1>, optional to name) before the voice (<Audio 2>)


# ---------------------------------------------------------------------------------------------------------------
# Reference files uploaded in chunks (Upload RPCs: render service and stages)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upsvc(stack, tmp_path_factory):
    """A render service of its own over the stack's stages: one upload at a time (--max-uploads 1)."""
    from tests.render_svc_util import RenderService

    s = RenderService(tmp_path_factory.mktemp("render_uploads"), stack[1], extra=["--max-uploads", "1"])
    s.start()
    yield s
    s.stop()


def _stored(svc) -> list[str]:
    """The files in the render service's store of keyframes and uploads (temp files included)."""
    from pathlib import Path

    (store,) = Path(svc.stack.run_dir).rglob("keyframes")
    return sorted(p.name for p in store.iterdir())


def test_reference_larger_than_a_message_uploads_in_chunks_and_renders(upsvc, tmp_path):
    """A 9 MiB voice (past the 8 MiB message cap) beside an image: `render --ref` uploads both in chunks to the render
    service, which uploads them to the decoder and the encoder; the job renders, its record names the files by
    digest (no bytes), and the stored files go once no unfinished job names them."""
    import hashlib

    import av

    from client.__main__ import main as client_main
    from h3.v1 import render_pb2
    from stagekit.transport import MAX_MESSAGE_BYTES

    big = media_wav(75.0, 64000)
    assert len(big) > MAX_MESSAGE_BYTES + (1 << 20)
    (tmp_path / "subject.png").write_bytes(media_png())
    (tmp_path / "voice.wav").write_bytes(big)
    out = tmp_path / "big.mp4"
    assert client_main(["render", "--render", upsvc.target, "--prompt", "<Picture 1> sings in <Audio 1>'s voice",
                        "--ref", str(tmp_path / "subject.png"), "--ref", str(tmp_path / "voice.wav"), "-o", str(out),
                        "--width", "256", "--height", "256", "--frames", str(FRAMES), "--steps", "1"]) == 0
    with av.open(str(out)) as c:
        assert c.streams.audio and sum(1 for _ in c.decode(video=0)) == FRAMES
    (job,) = upsvc.stub.List(render_pb2.ListRequest(), timeout=10).jobs
    assert [r.digest for r in job.references] == [hashlib.sha256(media_png()).hexdigest(),
                                                  hashlib.sha256(big).hexdigest()]
    assert all(not r.data for r in job.references) and job.references[1].seconds == pytest.approx(75.0, abs=0.1)
    assert _stored(upsvc) == []


def test_upload_caps_refusals_and_interruptions(upsvc, clients):
    """A file over 64 MiB is INVALID_ARGUMENT, so is one failing its size/checksum check; a second upload while
    one is in progress is RESOURCE_EXHAUSTED (--max-uploads 1); a Submit or a stage call naming a digest nothing
    uploaded is FAILED_PRECONDITION; none of them, nor an upload cut off mid-file, leaves a file or a job behind."""
    import threading
    import time

    from h3.v1 import common_pb2, decoder_pb2, render_pb2
    from minimax_h3.contract import RenderSpec, spec_to_proto
    from stagekit.transport import file_chunks
    from stagekit.uploads import MAX_FILE_BYTES, upload

    stub = upsvc.stub
    jobs = len(stub.List(render_pb2.ListRequest(), timeout=10).jobs)
    with pytest.raises(grpc.RpcError) as e:
        upload(stub.Upload, bytes(MAX_FILE_BYTES + 1), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"larger than {MAX_FILE_BYTES}" in e.value.details()
    bad = list(file_chunks(b"x" * 1000, "x.wav"))
    bad[-1].crc32c ^= 1
    with pytest.raises(grpc.RpcError) as e:
        stub.Upload(iter(bad), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in e.value.details()

    # An upload held open takes the one slot; it is then cut off half-way.
    release = threading.Event()

    def held():
        chunks = file_chunks(media_wav(20.0, 64000), "held.wav")
        yield next(chunks)
        release.wait(30)

    fut = stub.Upload.future(held(), timeout=60)
    time.sleep(1.0)
    with pytest.raises(grpc.RpcError) as e:
        upload(stub.Upload, media_png(), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-uploads" in e.value.details()
    fut.cancel()
    release.set()
    deadline = time.monotonic() + 10
    while _stored(upsvc) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stored(upsvc) == []

    # Digests nothing uploaded.
    req = render_pb2.RenderRequest(references=[common_pb2.Reference(kind="image", digest="0" * 64, name="a.png")])
    spec_to_proto(RenderSpec(prompt="<Picture 1> waves", frames=FRAMES), req.params)
    with pytest.raises(grpc.RpcError) as e:
        stub.Submit(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "upload it first" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(clients.decoder.EncodeReference(decoder_pb2.EncodeReferenceRequest(
            reference=common_pb2.Reference(kind="image", digest="1" * 64), frames=FRAMES), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "upload it first" in e.value.details()
    assert len(stub.List(render_pb2.ListRequest(), timeout=10).jobs) == jobs and _stored(upsvc) == []
    # A stream that ends without its last chunk fails, even when the bytes it sent are a file the store holds
    # (the decoder stage's store: the render service's stays empty for the checks above).
    upload(clients.decoder.Upload, b"y" * 1000, "y.wav", timeout=10)
    cut = list(file_chunks(b"y" * 1000, "y.wav"))
    cut[-1].last = False
    with pytest.raises(grpc.RpcError) as e:
        clients.decoder.Upload(iter(cut), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "before the file was complete" in e.value.details()
