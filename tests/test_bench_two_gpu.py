"""benchmarks/bench_two_gpu.py: the pieces of the two-card run that need no GPU (weight writers at tiny size, the MP4
check, the log / event / loadtest parsers). The whole script runs end to end on the CPU with --tiny (see
docs/two_cards.md); that dry run takes minutes, so CI tests its parts here."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_two_gpu", ROOT / "benchmarks" / "bench_two_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their module
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_pruned_random_dit_checkpoint_loads_as_curve_form(tmp_path):
    from minimax_h3.dit.checkpoint import inspect_checkpoint, load_dit_weights
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint

    path = write_random_int8_convrot_checkpoint(DiTConfig.tiny(), tmp_path / "dit.safetensors", quantize=False,
                                                pruned=True)
    info = inspect_checkpoint(path)
    assert info.variant.name == "int8_convrot_pruned" and info.config.adaln_form == "curve"
    assert "time_embedder.proj_in.weight" not in info.shapes and info.shapes["adaln_t_table"].dtype == "F32"
    assert info.shapes["blocks.0.adaln_proj.linear.weight"].dtype == "F16"
    w = load_dit_weights(path, info.config, 1, 2, quant_mode="dequant", dtype=torch.float32)
    qkv = w["blocks.0.attn.qkv_proj.weight"]
    assert qkv.shape[0] == 3 * info.config.attn_inner // 2  # this rank's heads only
    assert 0.5 < float(qkv.std()) * math.sqrt(qkv.shape[1]) < 2.0  # ~N(0, 1/fan_in) after dequantisation


def test_random_nvfp4_text_encoder_reads_back(bench, tmp_path):
    from minimax_h3.dit.tiny_checkpoint import write_safetensors_streaming
    from minimax_h3.text.checkpoint import TextEncoderCheckpoint
    from minimax_h3.text.config import ConditionerConfig

    cfg = ConditionerConfig.tiny(vocab_size=512)
    plan, makers = bench.te_random_plan(cfg, "cpu")
    path = write_safetensors_streaming(tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", plan,
                                       ((k, make()) for k, make in makers))
    ckpt = TextEncoderCheckpoint(path, cfg)
    assert ckpt.info.variant == "nvfp4_awq" and ckpt.info.has_visual
    w = ckpt.read_layer(0)["mlp.down_proj.weight"].dense(torch.float32)
    assert w.shape == (cfg.hidden_size, cfg.intermediate_size)
    assert 0.8 < float(w.std()) * math.sqrt(cfg.intermediate_size) < 1.2
    emb = ckpt.read_embed().rows(torch.tensor([0, 5]), torch.float32)
    assert 0.8 < float(emb.std()) < 1.2
    ckpt.close()


def test_random_lora_matches_the_dit(bench, tmp_path):
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.lora import check_lora_file, config_targets

    cfg = DiTConfig.tiny(adaln_form="curve")
    path = tmp_path / "lora.safetensors"
    bench.write_lora(path, cfg, rank=4, device="cpu")
    assert check_lora_file(path, config_targets(cfg), cfg.adaln_form) == 4 * cfg.num_layers


def test_check_mp4(bench, tmp_path):
    from minimax_h3.mux import write_mp4

    frames = np.zeros((22, 64, 96, 3), dtype=np.uint8)
    frames[:, :, :, 1] = np.arange(22, dtype=np.uint8)[:, None, None] * 10
    audio = np.zeros((2, 32000), dtype=np.float32)
    path = tmp_path / "x.mp4"
    write_mp4(path, frames, audio)
    info = bench.check_mp4(path, 22, 96, 64)
    assert info["ok"], info
    assert (info["video_codec"], info["audio_codec"], info["sample_rate"], info["channels"]) == ("h264", "aac", 32000, 2)
    assert not bench.check_mp4(path, 23, 96, 64)["ok"]
    write_mp4(path, frames)  # no audio track
    assert not bench.check_mp4(path, 22, 96, 64)["ok"]


def test_latent_hashes_pair_ranks_by_job(bench):
    line = "2026 dit[1] INFO final latents rank={} 832x480x124 seed=1 video_sha256={} audio_sha256={}\n"
    log = line.format(0, "a" * 64, "b" * 64) + line.format(1, "a" * 64, "b" * 64) + "noise\n"
    log += line.format(1, "c" * 64, "d" * 64) + line.format(0, "c" * 64, "e" * 64)
    got = bench.latent_hashes(log)
    assert got["ranks"] == [0, 1] and [j["ranks_equal"] for j in got["jobs"]] == [True, False]
    assert not got["ranks_equal"]
    assert bench.latent_hashes(line.format(0, "a" * 64, "b" * 64))["ranks_equal"] is False  # one rank proves nothing
    assert bench.latent_hashes("")["jobs"] == []


def test_stage_timing_from_events(bench):
    ev = [{"t": 0.5, "event": "loaded", "stage": "dit", "load_s": 9.0, "bytes": 1},
          {"t": 10, "event": "acquire", "holder": "dit@2"},  # lease events carry no stage: ignored
          {"t": 10, "event": "load_start", "stage": "dit", "holder": "dit@2", "waited_s": 0.5},
          {"t": 15, "event": "loaded", "stage": "dit", "holder": "dit@2", "load_s": 5.0, "bytes": 10_000_000_000},
          {"t": 15.1, "event": "job_start", "stage": "dit", "holder": "dit@2"},
          {"t": 45.1, "event": "job_done", "stage": "dit", "holder": "dit@2"},
          {"t": 46, "event": "unloaded", "stage": "dit", "holder": "dit@2", "unload_s": 1.0},
          {"t": 47, "event": "loaded", "stage": "decoder", "holder": "decoder@3", "load_s": 2.0, "bytes": 0},
          {"t": 47, "event": "job_start", "stage": "decoder", "holder": "decoder@3"},
          {"t": 57, "event": "job_done", "stage": "decoder", "holder": "decoder@3"}]
    t = bench.stage_timing(ev, 1.0, 60.0)
    dit = t["stages"]["dit"]
    assert (dit["lease_wait_s"], dit["load_s"], dit["unload_s"], dit["compute_s"]) == (0.5, 5.0, 1.0, 30.0)
    assert dit["load_gbps"] == [2.0] and t["stages"]["decoder"]["load_gbps"] == []
    assert (t["swap_s"], t["compute_s"], t["lease_wait_s"]) == (8.0, 40.0, 0.5)
    assert t["swap_share"] == round(8 / 48, 3)


def test_loadtest_parsers(bench):
    dit = {"summary": {"errors": {}}, "requests": [
        {"code": "OK", "step_ms": [900.0, 500.0, 520.0, 510.0], "stages": [{"timing": {"load_s": 7.0}}]}]}
    assert bench.step_seconds(dit) == {"s_per_step": 0.51, "steps_timed": 3, "load_s": [7.0], "errors": {}}
    dec = {"summary": {"errors": {"UNAVAILABLE": 1}}, "requests": [
        {"code": "OK", "stages": [{"timing": {"compute_s": 4.0}}]},
        {"code": "OK", "stages": [{"timing": {"compute_s": 3.5}}]},
        {"code": "UNAVAILABLE", "stages": []}]}
    assert bench.decode_seconds(dec) == {"compute_s": [4.0, 3.5], "best_s": 3.5, "errors": {"UNAVAILABLE": 1}}
    assert bench.step_seconds({"requests": []})["s_per_step"] is None


def test_cli_tail_drops_progress_bars(bench):
    text = "encoder ━━━━ 1/1\n\n  wrote out.mp4  \n dit ━━━ 8/8\nerror: x\n"
    assert bench.cli_tail(text) == "  wrote out.mp4\nerror: x"


def test_events_gpu_synthesises_residency(bench, tmp_path):
    import os

    lease = tmp_path / "leases"
    lease.mkdir()
    me = os.getpid()
    ev = [{"t": 1, "event": "load_start", "pid": me, "stage": "dit", "devices": ["virt0", "virt1"]},
          {"t": 2, "event": "job_done", "pid": me, "stage": "dit", "devices": ["virt0", "virt1"]}]
    (lease / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    procs, used = bench.EventsGpu(lease)()
    assert procs[0] == procs[1] == [(me, bench.EventsGpu.CONTEXT + bench.EventsGpu.WEIGHTS["dit"])]
    with open(lease / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"t": 3, "event": "unloaded", "pid": me, "stage": "dit", "devices": ["virt0", "virt1"]})
                 + "\n")
    procs, _ = bench.EventsGpu(lease)()
    assert procs[0] == [(me, bench.EventsGpu.CONTEXT)]


def test_one_card_dit_part_dry_run(tmp_path):
    """benchmarks/one_card.py --part dit --tiny: the DiT engine's resident vs streamed sample on the CPU, end to end
    (weights written, JSON with the placements, bitwise-equal latents and the verdicts)."""
    import subprocess

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "one_card.py"), "--part", "dit", "--tiny",
                        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "one_card_dit.json").read_text())
    d = res["items"]["dit"]
    assert "error" not in d, d
    assert set(d["shapes"]) == {"256x256x39", "256x256x22"}
    assert all(row["bitwise_equal"] for row in d["shapes"].values())
    assert res["verdicts"]["streamed_equals_resident_bitwise"] is True


def test_a_benchmark_whose_items_fail_exits_non_zero(tmp_path):
    """An item that fails (here the weight writer, --models-dir being a file) is recorded in the JSON, named on
    stderr, and the run exits 1, not 0 as if it had measured something; the renders that needed it are skipped."""
    import subprocess

    out, not_a_dir = tmp_path / "out", tmp_path / "models"
    not_a_dir.write_text("a file where the weights would go\n")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "one_card.py"), "--part", "renders", "--tiny",
                        "--models-dir", str(not_a_dir), "--work-dir", str(tmp_path / "work"), "--out", str(out),
                        "--skip", "stack:int8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED weights: RuntimeError: weight writer failed" in r.stderr, r.stderr[-2000:]
    assert "1 of 1 items failed" in r.stderr, r.stderr[-2000:]
    res = json.loads((out / "one_card_renders.json").read_text())
    assert set(res["items"]) == {"weights"} and "error" in res["items"]["weights"], res["items"]
    assert {s["item"] for s in res["skipped"]} == {"render:a", "render:c832", "render:c1344", "parity"}
