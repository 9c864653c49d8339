"""MP4 / WAV muxing: stream properties read back with PyAV, exact frame count, atomic writes."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf
import torch

from minimax_h3.contract import AUDIO_SAMPLE_RATE, audio_samples
from minimax_h3.mux import (
                            frames_to_uint8,
                            write_mp4,
                            write_wav,
                            )
import minimax_h3.mux as mux

F, H, W = 29, 48, 64  # 29 frames: not a multiple of anything convenient (1.2083 s)
FRAME_S = 1.0 / 24


def _frames_uint8(f=F, h=H, w=W, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((f, h, w, 3), np.uint8)
    for i in range(f):
        out[i, ..., 0] = (x * 3 + i * 7) % 256
        out[i, ..., 1] = (y * 4 + i * 3) % 256
        out[i, ..., 2] = 128
    return np.clip(out.astype(np.int16) + rng.integers(-3, 4, out.shape), 0, 255).astype(np.uint8)


def _audio(n: int, seed=0) -> np.ndarray:
    t = np.arange(n) / AUDIO_SAMPLE_RATE
    return np.stack([0.4 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 550 * t)]).astype(np.float32)


def _probe(src) -> dict:
    """Read stream properties and decode everything (frame count, frame times, audio samples).

    `src`: a path or the file's bytes."""

    def opened():
        return av.open(io.BytesIO(src) if isinstance(src, bytes) else src)

    with opened() as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = dict(
            vcodec=v.codec_context.name,
            pix_fmt=v.codec_context.pix_fmt,
            width=v.codec_context.width,
            height=v.codec_context.height,
            rate=v.average_rate,
            vdur=float(v.duration * v.time_base),
            acodec=a.codec_context.name,
            sample_rate=a.codec_context.sample_rate,
            channels=a.codec_context.channels,
            adur=float(a.duration * a.time_base),
        )
    with opened() as c:
        info["frame_times"] = sorted(fr.pts * fr.time_base for fr in c.decode(video=0))
        info["decoded_frames"] = len(info["frame_times"])
    with opened() as c:
        info["decoded_samples"] = sum(fr.samples for fr in c.decode(audio=0))
    return info


def _assert_contract(info: dict, f=F, h=H, w=W) -> None:
    assert info["vcodec"] == "h264"
    assert info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == (w, h)
    assert info["rate"] == Fraction(24, 1)
    assert info["decoded_frames"] == f
    # Constant frame rate: frame i is shown at exactly i/24 s.
    assert info["frame_times"] == [Fraction(i, 24) for i in range(f)]
    # Stream duration: F/24 up to the MP4 muxer's B-frame edit-list rounding (4 ticks of 1/12288 s seen).
    assert info["vdur"] == pytest.approx(f / 24, abs=1e-3)
    assert info["acodec"] == "aac"
    assert info["sample_rate"] == 32000
    assert info["channels"] == 2
    assert abs(info["adur"] - info["vdur"]) <= FRAME_S
    # Decoded PCM (incl. AAC's last-frame padding) still ends within one video frame of the video.
    assert abs(info["decoded_samples"] / 32000 - f / 24) <= FRAME_S


def test_mp4_contract_uint8_input(tmp_path):
    n = audio_samples(F)
    info = write_mp4(tmp_path / "out.mp4", _frames_uint8(), _audio(n))
    assert (info.num_frames, info.width, info.height, info.fps, info.audio_samples) == (F, W, H, 24, n)
    _assert_contract(_probe(str(tmp_path / "out.mp4")))
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]  # no temp left behind


def test_mp4_contract_float_torch_input_and_audio_trim(tmp_path):
    frames = torch.from_numpy(_frames_uint8().astype(np.float32) / 255.0).permute(3, 0, 1, 2)  # [3, F, H, W]
    ta = round(F / 24 * 40)  # the DiT's audio latent count -> 800 * Ta samples (a bit longer than F/24 s)
    audio = torch.from_numpy(_audio(800 * ta + 500))
    info = write_mp4(tmp_path / "f.mp4", frames, audio, preset="ultrafast", crf=28)
    assert info.audio_samples == audio_samples(F)
    _assert_contract(_probe(str(tmp_path / "f.mp4")))


def test_short_audio_is_padded(tmp_path):
    info = write_mp4(tmp_path / "s.mp4", _frames_uint8(), _audio(1000))
    assert info.audio_samples == audio_samples(F)
    _assert_contract(_probe(str(tmp_path / "s.mp4")))


def test_frame_count_exact_for_several_lengths(tmp_path):
    for f in (1, 5, 24):
        p = tmp_path / f"n{f}.mp4"
        write_mp4(p, _frames_uint8(f=f), _audio(audio_samples(f)), preset="ultrafast")
        _assert_contract(_probe(str(p)), f=f)


def test_decoded_content_is_close(tmp_path):
    frames = _frames_uint8()
    write_mp4(tmp_path / "q.mp4", frames, _audio(audio_samples(F)), crf=12)
    with av.open(str(tmp_path / "q.mp4")) as c:
        got = np.stack([fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)])
    assert got.shape == frames.shape
    assert np.abs(got.astype(np.int16) - frames).mean() < 6.0  # lossy, but the right frames in order


def test_filelike_output_is_faststart(tmp_path):
    """The service streams the finished file as it is written: the index (moov) must come before the media."""
    frames, audio = _frames_uint8(), _audio(audio_samples(F))
    before = set(tmp_path.iterdir())
    buf = io.BytesIO()
    write_mp4(buf, frames, audio)
    assert set(tmp_path.iterdir()) == before
    data = buf.getvalue()
    assert data[4:8] == b"ftyp"
    assert data.find(b"moov") < data.find(b"mdat")  # faststart: playable while streaming
    _assert_contract(_probe(data))


def test_atomic_write_on_mid_encode_failure(tmp_path):
    """A NaN in the last frame fails *during* encoding: no output, no temp file, old file untouched."""
    frames = torch.from_numpy(_frames_uint8().astype(np.float32) / 255.0).permute(3, 0, 1, 2).contiguous()
    frames[:, -1, 0, 0] = float("nan")
    dest = tmp_path / "out.mp4"
    with pytest.raises(ValueError, match="NaN"):
        write_mp4(dest, frames, _audio(audio_samples(F)))
    assert not list(tmp_path.iterdir())
    dest.write_bytes(b"previous good output")
    with pytest.raises(ValueError, match="NaN"):
        write_mp4(dest, frames, _audio(audio_samples(F)))
    assert dest.read_bytes() == b"previous good output"
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]


def test_atomic_write_when_encoder_dies_after_partial_output(tmp_path, monkeypatch):
    def dying_encode(target, *args, **kwargs):
        with open(target, "wb") as fh:
            fh.write(b"\x00\x00\x00\x18ftypisom partial")
        raise RuntimeError("encoder crashed")

    monkeypatch.setattr(mux, "_encode", dying_encode)
    with pytest.raises(RuntimeError, match="crashed"):
        write_mp4(tmp_path / "x.mp4", _frames_uint8(), _audio(1000))
    assert not list(tmp_path.iterdir())
    buf = io.BytesIO()
    with pytest.raises(RuntimeError, match="crashed"):
        write_mp4(buf, _frames_uint8(), _audio(1000))
    assert buf.getvalue() == b""  # a file object never sees partial bytes either


def test_bad_inputs_raise_value_error(tmp_path):
    good_audio = _audio(audio_samples(F))
    with pytest.raises(ValueError, match="even"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(w=63), good_audio)
    with pytest.raises(ValueError, match=r"\[2, samples\]"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(), good_audio[:1])
    with pytest.raises(ValueError, match=r"\[2, samples\]"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(), good_audio.T)
    bad = good_audio.copy()
    bad[0, 10] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(), bad)
    with pytest.raises(ValueError, match="preset"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(), good_audio, preset="warp")
    with pytest.raises(ValueError, match="crf"):
        write_mp4(tmp_path / "a.mp4", _frames_uint8(), good_audio, crf=60)
    with pytest.raises(ValueError, match="shape"):
        write_mp4(tmp_path / "a.mp4", np.zeros((4, H, W), np.uint8), good_audio)
    assert not list(tmp_path.iterdir())


def test_frames_to_uint8():
    x = np.zeros((3, 2, 4, 6), np.float32)
    x[0, 0, 0, 0], x[1, 0, 0, 0], x[2, 0, 0, 0] = 1.0, 0.5, 2.0
    x[0, 1, 3, 5] = -1.0
    u = frames_to_uint8(x)
    assert u.shape == (2, 4, 6, 3) and u.dtype == np.uint8 and u.flags.c_contiguous
    assert tuple(u[0, 0, 0]) == (255, 128, 255)  # 0.5 -> 127.5 rounds up; 2.0 clipped
    assert u[1, 3, 5, 0] == 0
    assert np.array_equal(frames_to_uint8(torch.from_numpy(x).unsqueeze(0)), u)  # [1, 3, F, H, W]
    assert np.array_equal(frames_to_uint8(torch.from_numpy(x).half()), frames_to_uint8(x.astype(np.float16)))
    sym = frames_to_uint8(x * 2 - 1, value_range=(-1.0, 1.0))
    assert np.array_equal(sym, u)
    raw = _frames_uint8(f=2)
    assert frames_to_uint8(raw) is raw or np.array_equal(frames_to_uint8(raw), raw)
    with pytest.raises(ValueError):
        frames_to_uint8(np.zeros((2, 4, 6, 3), np.float32))  # float must be channel-first [3, F, H, W]
    with pytest.raises(ValueError):
        frames_to_uint8(np.zeros((2, 4, 6, 3), np.int32))


def test_write_wav(tmp_path):
    audio = _audio(32000 + 17)
    audio[0, :5] = [1.5, -1.5, 0.0, 0.5, -0.5]  # out of range -> clipped
    p = write_wav(tmp_path / "a.wav", audio)
    data, sr = sf.read(str(p), dtype="float32", always_2d=True)
    assert sr == 32000 and data.shape == (32017, 2)
    assert np.abs(data.T - np.clip(audio, -1, 1)).max() < 1e-4
    assert [q.name for q in tmp_path.iterdir()] == ["a.wav"]
    with pytest.raises(ValueError):
        write_wav(tmp_path / "b.wav", audio[0])
    assert not (tmp_path / "b.wav").exists()


@pytest.mark.slow
def test_default_render_size_832x480x124(tmp_path):
    """The tiny default render (832x480, 124 frames = 5.17 s): the contract holds at full size."""
    f, h, w = 124, 480, 832
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    frames = np.empty((f, h, w, 3), np.uint8)
    for i in range(f):  # smooth moving pattern, roughly like generated video (not white noise)
        base = (np.sin((x + 4 * i) / 40.0) * 0.5 + 0.5) * 200 + np.cos((y - 3 * i) / 30.0) * 30
        frames[i, ..., 0] = np.clip(base, 0, 255)
        frames[i, ..., 1] = np.clip(base * 0.7 + x % 64, 0, 255)
        frames[i, ..., 2] = np.clip(255 - base, 0, 255)
    ta = round(f / 24 * 40)
    info = write_mp4(tmp_path / "big.mp4", frames, _audio(800 * ta))
    _assert_contract(_probe(str(tmp_path / "big.mp4")), f=f, h=h, w=w)
    print(f"\nmux 832x480x124 preset={mux.DEFAULT_PRESET}: {info.encode_seconds:.2f} s, {info.num_bytes / 1e6:.2f} MB")
    assert info.encode_seconds > 0  # its speed is for a benchmark, not a test


def test_a_frame_stream_is_muxed_chunk_by_chunk(tmp_path):
    """Long clips stream: chunks are pulled while the mux runs (never held whole) and give the clip's frames as one
    array does; an extension's prefix frames open the MP4; a stream short of its frames fails, leaving nothing."""
    frames = _frames_uint8()
    audio = _audio(audio_samples(F))
    pulled = []

    def chunks():
        for i in range(0, F, 7):
            pulled.append(i)
            yield torch.from_numpy(frames[i:i + 7].astype(np.float32) / 255).permute(3, 0, 1, 2)

    muxed = []

    def check():  # the mux calls it before each frame: the chunks arrive as it goes, never all before it starts
        muxed.append(len(pulled))

    write_mp4(tmp_path / "stream.mp4", mux.FrameStream(F, H, W, chunks()), audio, check_cancel=check)
    _assert_contract(_probe(str(tmp_path / "stream.mp4")))
    with av.open(str(tmp_path / "stream.mp4")) as c:
        got = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    mse = np.mean((got.astype(np.float64) - frames) ** 2)
    assert 10 * np.log10(255 ** 2 / mse) > 25  # the clip's frames in order, through H.264 (noise aside)
    assert muxed[0] == 1 and muxed[-1] == len(pulled) == 5
    # An extension: its source frames first, as they are, then the stream.
    prefix = _frames_uint8(f=10, seed=3)
    info = write_mp4(tmp_path / "ext.mp4", mux.FrameStream(F, H, W, iter([frames])), _audio(audio_samples(F + 10)),
                     prefix=(10, iter(prefix)))
    _assert_contract(_probe(str(tmp_path / "ext.mp4")), f=F + 10)
    assert info.num_frames == F + 10
    with pytest.raises(ValueError, match="ended after 28 of its 29 frames"):
        write_mp4(tmp_path / "short.mp4", mux.FrameStream(F, H, W, iter([frames[:28]])), audio)
    assert not (tmp_path / "short.mp4").exists() and not list(tmp_path.glob(".mux-*"))
