"""Audio VAE: parity with diffusers' AutoencoderKLMiniMaxH3Audio (oracle only), loading, input checks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimax_h3.contract import AUDIO_HOP
from minimax_h3.vae.audio import (
                                  AudioVAE,
                                  AudioVAEConfig,
                                  detect_layout,
                                  kaiser_sinc_filter,
                                  load_audio_vae,
                                  unfold_weight_norm_state_dict,
                                  write_tiny_audio_vae,
                                  )
from stagekit.checkpoints import CheckpointError

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLMiniMaxH3Audio  # noqa: E402

TA = 9  # latent frames per channel in the parity checks (7200 samples)
REL_TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _oracle(cfg: AudioVAEConfig) -> AutoencoderKLMiniMaxH3Audio:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's legacy weight_norm deprecation
        return AutoencoderKLMiniMaxH3Audio(
            encoder_dim=cfg.encoder_dim,
            encoder_rates=cfg.encoder_rates,
            latent_dim=cfg.latent_dim,
            latent_channels=cfg.latent_channels,
            num_attention_heads=cfg.num_attention_heads,
            decoder_dim=cfg.decoder_dim,
            decoder_rates=cfg.decoder_rates,
            decoder_kernel_sizes=cfg.decoder_kernel_sizes,
            resblock_kernel_sizes=cfg.resblock_kernel_sizes,
            resblock_dilation_sizes=cfg.resblock_dilation_sizes,
        ).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The CI box has 2 shared cores: torch's 2-thread OpenMP spin-waits are 5-20x slower than 1 thread there.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg() -> AudioVAEConfig:
    return AudioVAEConfig.tiny()


@pytest.fixture(scope="module")
def comfy_file(tmp_path_factory, cfg):
    return write_tiny_audio_vae(tmp_path_factory.mktemp("avae") / "audio_vae_comfy.safetensors", cfg, seed=3)


@pytest.fixture(scope="module")
def comfy_sd(comfy_file):
    return load_file(str(comfy_file))


@pytest.fixture(scope="module")
def release_sd(comfy_sd, cfg):
    """Release layout with a *non-trivial* weight-norm split: v = w * r (random positive per-dim0 scale),
    g = ||w||. Folding must normalise v over the right dims to recover w exactly."""
    sd = unfold_weight_norm_state_dict(comfy_sd, AudioVAE(cfg))
    gen = torch.Generator().manual_seed(11)
    out = {}
    for k, t in sd.items():
        if k.endswith(".weight_v"):
            r = 0.5 + 1.5 * torch.rand((t.shape[0],) + (1,) * (t.ndim - 1), generator=gen)
            t = (t * r).contiguous()
        out[k] = t
    # The release keeps latent statistics in config.json, not in the weights file.
    out.pop("latents_mean")
    out.pop("latents_std")
    return out


@pytest.fixture(scope="module")
def release_file(tmp_path_factory, release_sd):
    path = tmp_path_factory.mktemp("avae") / "audio_vae_release.safetensors"
    save_file(release_sd, str(path))
    return path


@pytest.fixture(scope="module")
def stats(comfy_sd):
    return tuple(comfy_sd["latents_mean"].tolist()), tuple(comfy_sd["latents_std"].tolist())


@pytest.fixture(scope="module")
def oracle(cfg, release_sd):
    ref = _oracle(cfg)
    ref.load_state_dict(release_sd, strict=True)  # release keys == diffusers keys (passthrough conversion)
    return ref


@pytest.fixture(scope="module")
def latents():
    return torch.randn(2, 32, TA, generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------------------------


def test_full_config_param_count_and_hop():
    with torch.device("meta"):
        full = AudioVAE(AudioVAEConfig.full())
    assert sum(p.numel() for p in full.parameters()) == 151_282_160  # docs/model.md §9.1 (WN folded)
    assert full.cfg.hop_length == AUDIO_HOP == 800
    assert full.cfg.decoder_kernel_sizes == (9, 9, 4, 4, 4, 4, 4)
    assert AudioVAEConfig.tiny().hop_length == 800


def test_state_dict_keys_match_release_keys(cfg):
    """Our keys == release/diffusers keys with weight norm folded, plus ComfyUI's latent stat buffers."""
    ours = AudioVAE(cfg)
    rel = set(unfold_weight_norm_state_dict(ours.state_dict(), ours))
    assert rel - set(_oracle(cfg).state_dict()) == {"latents_mean", "latents_std"}
    assert set(_oracle(cfg).state_dict()) - rel == set()


def test_kaiser_filters_match_oracle_buffers(cfg):
    ref = _oracle(cfg).state_dict()
    up = ref["decoder.resblocks.0.activations.0.upsample.filter"]
    down = ref["decoder.resblocks.0.activations.0.downsample.lowpass.filter"]
    ours = kaiser_sinc_filter(0.25, 0.3, 12)
    assert ours.shape == (1, 1, 12)
    assert (ours - up).abs().max().item() < 1e-7
    assert (ours - down).abs().max().item() < 1e-7
    assert abs(ours.sum().item() - 1.0) < 1e-6


def test_layout_detection(comfy_sd, release_sd):
    assert detect_layout(comfy_sd) == "comfy"
    assert detect_layout(release_sd) == "release"
    param = {k.replace(".weight_g", ".parametrizations.weight.original0").replace(
        ".weight_v", ".parametrizations.weight.original1"): v for k, v in release_sd.items()}
    assert detect_layout(param) == "parametrized"
    with pytest.raises(CheckpointError, match="not a MiniMax-H3 audio VAE"):
        detect_layout({"foo.weight": torch.zeros(1)})


def test_decode_parity_folded_comfy_file(comfy_file, comfy_sd, cfg, latents):
    ours = load_audio_vae(comfy_file)  # config from the header metadata
    assert ours.cfg == cfg
    ref = _oracle(cfg)
    ref.load_state_dict(
        {k: v for k, v in unfold_weight_norm_state_dict(comfy_sd, ours).items() if not k.startswith("latents_")},
        strict=True,
    )
    with torch.no_grad():
        a, b = ours.decode(latents), ref.decode(latents).sample
    assert a.shape == b.shape == (2, 1, AUDIO_HOP * TA)
    assert b.abs().max() < 1.0, "random test weights saturate the clamp; parity would be vacuous"
    assert b.std() > 1e-2
    assert _rel(a, b) <= REL_TOL
    assert (a - b).abs().max().item() <= 1e-4


def test_decode_parity_unfolded_release_file(release_file, oracle, cfg, stats, latents):
    ours = load_audio_vae(release_file, AudioVAEConfig.tiny(latents_mean=stats[0], latents_std=stats[1]))
    with torch.no_grad():
        a, b = ours.decode(latents), oracle.decode(latents).sample
    assert _rel(a, b) <= REL_TOL
    assert (a - b).abs().max().item() <= 1e-4


def test_folded_and_unfolded_files_give_same_weights(comfy_file, release_file, stats):
    folded = load_audio_vae(comfy_file)
    unfolded = load_audio_vae(release_file, AudioVAEConfig.tiny(latents_mean=stats[0], latents_std=stats[1]))
    sa, sb = folded.state_dict(), unfolded.state_dict()
    assert set(sa) == set(sb)
    worst = max(((sa[k] - sb[k]).abs().max() / sa[k].abs().max().clamp_min(1e-12)).item() for k in sa)
    assert worst < 1e-6


def test_parametrized_layout_loads_like_release(release_sd, tmp_path, stats, cfg):
    param = {
        k.replace(".weight_g", ".parametrizations.weight.original0").replace(
            ".weight_v", ".parametrizations.weight.original1"
        ): v
        for k, v in release_sd.items()
    }
    path = tmp_path / "p.safetensors"
    save_file(param, str(path))
    c = AudioVAEConfig.tiny(latents_mean=stats[0], latents_std=stats[1])
    a = load_audio_vae(path, c).state_dict()
    b = load_audio_vae_from_sd(release_sd, c, tmp_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def load_audio_vae_from_sd(sd, cfg, tmp_path):
    path = tmp_path / "r.safetensors"
    save_file(sd, str(path))
    return load_audio_vae(path, cfg).state_dict()


def test_decode_rows_stereo_layout_and_length(comfy_file, comfy_sd, cfg):
    ours = load_audio_vae(comfy_file)
    ref = _oracle(cfg)
    ref.load_state_dict(
        {k: v for k, v in unfold_weight_norm_state_dict(comfy_sd, ours).items() if not k.startswith("latents_")}
    )
    ta = 5
    rows = torch.randn(2 * ta, 32, generator=torch.Generator().manual_seed(9))
    wav = ours.decode_rows(rows)
    assert wav.shape == (2, AUDIO_HOP * ta) and wav.dtype == torch.float32
    assert wav.abs().max() <= 1.0
    # Oracle path as the diffusers pipeline does it: channel-major rows -> [2, 32, Ta] -> de-normalise.
    z = rows.reshape(2, ta, 32).permute(0, 2, 1)
    z = z * comfy_sd["latents_std"].view(1, -1, 1) + comfy_sd["latents_mean"].view(1, -1, 1)
    with torch.no_grad():
        want = ref.decode(z).sample[:, 0]
    assert _rel(wav, want) <= REL_TOL
    # Channels are independent mono items: the left channel alone decodes to the same waveform.
    with torch.no_grad():
        left = ours.decode(z[:1].contiguous())[:, 0]
    assert (left[0] - wav[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("ta", [1, 4])
def test_output_length_is_800_per_latent(cfg, ta):
    m = AudioVAE(cfg).eval()
    with torch.no_grad():
        out = m.decode(torch.randn(2, 32, ta))
    assert out.shape == (2, 1, 800 * ta)
    assert out.abs().max() <= 1.0


def test_encode_parity_and_rows(comfy_file, comfy_sd, cfg):
    ours = load_audio_vae(comfy_file)
    ref = _oracle(cfg)
    ref.load_state_dict(
        {k: v for k, v in unfold_weight_norm_state_dict(comfy_sd, ours).items() if not k.startswith("latents_")}
    )
    n = 800 * 6 + 123  # not a multiple of the hop: both sides right-pad with zeros
    wav = 0.5 * torch.randn(2, 1, n, generator=torch.Generator().manual_seed(2)).clamp(-2, 2)
    with torch.no_grad():
        a = ours.encode(wav)
        b = ref.encode(wav).latent_dist.mode()
    assert a.shape == b.shape == (2, 32, 7)
    assert _rel(a, b) <= REL_TOL
    rows = ours.encode_rows(wav[:, 0])
    assert rows.shape == (14, 32)
    back = AudioVAE.rows_to_batch(rows)
    assert torch.allclose(ours.denormalize(back), a, atol=1e-5)


def test_decoder_only_load_skips_encoder(comfy_file, latents):
    dec = load_audio_vae(comfy_file, with_encoder=False)
    assert not any(k.startswith(("encoder.", "pre_block.")) for k in dec.state_dict())
    full = load_audio_vae(comfy_file)
    with torch.no_grad():
        assert torch.equal(dec.decode(latents), full.decode(latents))
    with pytest.raises(ValueError, match="without the encoder"):
        dec.encode(torch.zeros(1, 1, 800))


# ---- bad inputs ----------------------------------------------------------------------------


def test_bad_latents_raise_value_error(comfy_file):
    m = load_audio_vae(comfy_file, with_encoder=False)
    z = torch.randn(2, 32, 3)
    z[1, 4, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        m.decode(z)
    with pytest.raises(ValueError, match="NaN"):
        m.decode_rows(torch.full((6, 32), float("inf")))
    with pytest.raises(ValueError, match="shape"):
        m.decode(torch.randn(2, 16, 3))  # wrong latent channel count
    with pytest.raises(ValueError, match="shape"):
        m.decode(torch.randn(32, 3))
    with pytest.raises(ValueError, match="shape"):
        m.decode_rows(torch.randn(6, 31))  # wrong row width
    with pytest.raises(ValueError, match="channel-major"):
        m.decode_rows(torch.randn(7, 32))  # odd row count cannot be stereo
    with pytest.raises(ValueError, match="floating-point"):
        m.decode(torch.zeros(2, 32, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        load_audio_vae(comfy_file).encode(torch.zeros(1, 2, 800))  # stereo must be two batch items


def test_unknown_stats_raise(cfg):
    m = AudioVAE(cfg).eval()  # no stats in config, none loaded
    with pytest.raises(ValueError, match="latents_mean"):
        m.decode_rows(torch.zeros(4, 32))


def test_release_file_without_stats_needs_config(release_file):
    m = load_audio_vae(release_file, AudioVAEConfig.tiny())
    with pytest.raises(ValueError, match="config.json"):
        m.decode_rows(torch.zeros(4, 32))


# ---- checkpoint errors name the keys -----------------------------------------------------------


def _save(tmp_path, sd, name="bad.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_missing_unexpected_and_misshapen_keys(tmp_path, comfy_sd, cfg):
    sd = dict(comfy_sd)
    sd.pop("decoder.conv_post.weight")
    sd["decoder.extra.weight"] = torch.zeros(3)
    sd["dec_in_proj.bias"] = torch.zeros(7)
    with pytest.raises(CheckpointError) as e:
        load_audio_vae(_save(tmp_path, sd), cfg)
    msg = str(e.value)
    assert "decoder.conv_post.weight" in msg and "missing" in msg
    assert "decoder.extra.weight" in msg and "unexpected" in msg
    assert "dec_in_proj.bias F32[7] (expected [256])" in msg and "misshapen" in msg


def test_wrong_config_is_reported(comfy_file):
    with pytest.raises(CheckpointError, match="misshapen"):
        load_audio_vae(comfy_file, AudioVAEConfig.tiny(decoder_dim=128))


def test_incomplete_weight_norm_pair(tmp_path, release_sd, cfg):
    sd = dict(release_sd)
    sd.pop("decoder.conv_pre.weight_v")
    with pytest.raises(CheckpointError, match="decoder.conv_pre.weight_g"):
        load_audio_vae(_save(tmp_path, sd), cfg)


def test_tampered_filter_is_rejected(tmp_path, comfy_sd):
    sd = dict(comfy_sd)
    k = "decoder.activation_post.upsample.filter"
    sd[k] = sd[k].exp()  # e.g. a build that stores/applies the filter in another space
    with pytest.raises(CheckpointError, match="activation_post.upsample.filter"):
        load_audio_vae(_save(tmp_path, sd), AudioVAEConfig.tiny())


def test_prefixed_keys_and_missing_buffers_are_accepted(tmp_path, comfy_sd, comfy_file, latents):
    # Filter buffers and zero_k_bias are rebuilt when absent; a `vae.` prefix is stripped.
    sd = {f"vae.{k}": v for k, v in comfy_sd.items() if not k.endswith((".filter", "zero_k_bias"))}
    m = load_audio_vae(_save(tmp_path, sd, "prefixed.safetensors"), AudioVAEConfig.tiny())
    with torch.no_grad():
        assert torch.equal(m.decode(latents), load_audio_vae(comfy_file).decode(latents))


def test_write_tiny_is_deterministic(tmp_path, cfg):
    a = load_file(str(write_tiny_audio_vae(tmp_path / "a.safetensors", cfg, seed=1)))
    b = load_file(str(write_tiny_audio_vae(tmp_path / "b.safetensors", cfg, seed=1)))
    c = load_file(str(write_tiny_audio_vae(tmp_path / "c.safetensors", cfg, seed=2)))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.conv_pre.weight"], c["decoder.conv_pre.weight"])
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_config_values():
    with pytest.raises(ValueError, match="zero channels"):
        AudioVAEConfig.tiny(decoder_dim=32)
    with pytest.raises(ValueError, match="must match"):
        AudioVAEConfig.tiny(decoder_rates=(5, 5, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="latents_std"):
        AudioVAEConfig.tiny(latents_mean=(0.0,) * 32, latents_std=(0.0,) * 32)
    assert math.prod(AudioVAEConfig.full().decoder_rates) == 800


def test_file_without_config_is_read_with_the_h3_geometry(tmp_path, latents):
    """Files without a config (release / ComfyUI downloads) are checked against the H3 release geometry at once,
    never given widths guessed from shapes (the attention head count cannot be seen in them): a tiny file fails
    naming its first misshapen key; with its config it loads."""
    cfg = AudioVAEConfig.tiny()
    src = write_tiny_audio_vae(tmp_path / "m.safetensors", cfg, seed=4)
    bare = _save(tmp_path, load_file(str(src)), "bare.safetensors")  # same tensors, no metadata
    with pytest.raises(CheckpointError, match=r"bare.safetensors: \S+: does not match the H3 audio VAE \(config from "
                                              r"the H3 release geometry.*config\.json"):
        load_audio_vae(bare)
    with torch.no_grad():
        assert torch.equal(load_audio_vae(bare, cfg).decode(latents), load_audio_vae(src).decode(latents))


def test_reversed_shape_is_named(tmp_path, comfy_sd):
    sd = dict(comfy_sd)
    sd["dec_in_proj.weight"] = sd["dec_in_proj.weight"].transpose(0, 1).contiguous()  # [32, 256, 1]
    p = tmp_path / "rev.safetensors"
    save_file(sd, str(p), metadata={"h3_audio_vae_config": AudioVAEConfig.tiny().to_json()})
    with pytest.raises(CheckpointError, match=r"(?s)rev.safetensors: dec_in_proj.weight: .*F32\[32, 256, 1\] \(expected "
                                              r"\[256, 32, 1\]\)"):
        load_audio_vae(p)


def test_diffusers_folder_with_config_json(tmp_path, cfg, stats, latents):
    """A diffusers `audio_vae/` folder (config.json + weights, as save_pretrained writes it) serves that geometry."""
    ref = _oracle(AudioVAEConfig.tiny(latents_mean=stats[0], latents_std=stats[1]))
    ref.register_to_config(latents_mean=list(stats[0]), latents_std=list(stats[1]))
    ref.save_pretrained(str(tmp_path / "audio_vae"))
    m = load_audio_vae(tmp_path / "audio_vae", with_encoder=False)
    assert m.cfg.decoder_dim == cfg.decoder_dim and m.cfg.num_attention_heads == cfg.num_attention_heads
    with torch.no_grad():
        assert _rel(m.decode(latents), ref.decode(latents).sample) <= REL_TOL


def test_stats_from_file_and_config_must_agree(comfy_file, stats):
    same = AudioVAEConfig.tiny(latents_mean=stats[0], latents_std=stats[1])
    assert torch.equal(load_audio_vae(comfy_file, same).latents_mean, load_audio_vae(comfy_file).latents_mean)
    other = AudioVAEConfig.tiny(latents_mean=(0.0,) * 32, latents_std=(1.0,) * 32)
    with pytest.raises(CheckpointError, match="latents_mean"):
        load_audio_vae(comfy_file, other)


def test_a_long_soundtrack_decodes_in_chunks_like_whole(comfy_file):
    """Past DECODE_CHUNK_LATENTS the decoder works a chunk at a time (bounded memory), each with context beyond its
    receptive field: the waveform is the whole decode's, up to float rounding; a shorter one is decoded whole."""
    ours = load_audio_vae(comfy_file)
    rows = torch.randn(2 * 150, 32, generator=torch.Generator().manual_seed(4))
    whole = ours.decode_rows(rows)
    assert torch.equal(ours.decode_rows(rows, chunk_latents=150), whole)
    chunked = ours.decode_rows(rows, chunk_latents=40)
    assert chunked.shape == whole.shape and _rel(chunked, whole) < 1e-5
