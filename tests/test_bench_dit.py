"""benchmarks/bench_dit.py builds its variants as the DiT stage builds its model (the registry's selection with the
variant's kernels forced, minimax_h3/dit/assembly.py kernel_linears + assemble_dit, the assembly's compile call) and
its TP rank in a fake process group: checked on the CPU, where each GPU kernel is its stand-in under the same name."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dit_svc.engine import resolve_chunk_rows
from minimax_h3.dit.config import DiTConfig
from minimax_h3.kernels.fp8_attention import Fp8Attention
from minimax_h3.kernels.int8 import Int8ConvRotLinear
from minimax_h3.kernels.layers import fp8_rows_method
from minimax_h3.kernels.registry import Fp8RowwiseLinear
from minimax_h3.kernels.tuning import arch_key, fp8_fast_accum

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_dit", ROOT / "benchmarks" / "bench_dit.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def weights(bench):
    cfg = DiTConfig.tiny()
    return cfg, bench.checkpoint_weights(cfg, 0, CPU)


def test_engine_variant_is_built_as_the_engine_builds(bench, weights):
    """fp8caf: the registry's fp8 linears (fast accumulation and fused-kernel choices as tuned for the device), fp8
    attention, every block compiled by the assembly, the engine's row chunk for compiled blocks on one rank; the
    other int8 weights (block AdaLN) stay int8 as the stage keeps them. The master weights are only read."""
    cfg, w = weights
    before = dict(w)
    chunk = resolve_chunk_rows(0, compile_blocks=True, tp_size=1, arch=arch_key(CPU))
    model, sel = bench.build_variant(cfg, w, "fp8caf", CPU, chunk)
    assert (sel.linear, sel.attention) == ("fp8", "fp8") and model.chunk_rows == chunk == 65536
    blk = model.blocks[0]
    for lin in (blk.attn.qkv_proj, blk.attn.out_proj, blk.mlp.fc1, blk.mlp.fc2,
                model.token_refiner.blocks[0].mlp.fc2):
        assert isinstance(lin, Fp8RowwiseLinear)
        assert lin.fast_accum is fp8_fast_accum(arch_key(CPU)) is True
        assert lin.linear_method == fp8_rows_method(arch_key(CPU))
    assert isinstance(blk.adaln_proj.linear, Int8ConvRotLinear)
    assert all(isinstance(a.attention_fn, Fp8Attention) for a in (blk.attn, model.token_refiner.blocks[0].attn))
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert w.keys() == before.keys() and all(w[k] is before[k] for k in w)
    # The same linears without fast accumulation, eager blocks: variant fp8.
    model, sel = bench.build_variant(cfg, w, "fp8", CPU, chunk)
    assert sel.linear == bench.FP8_NO_FAST_ACCUM and model.blocks[0].attn.qkv_proj.fast_accum is False
    assert all(b._compiled_call_impl is None for b in model.blocks)


def test_tp_rank_is_one_rank_of_a_fake_group(bench):
    """Memory mode's TP2 rank: half the heads and ffn of the full model's layout, through the assembly, in a TP group
    of torch.distributed's fake backend (no monkeypatched collectives); it runs a forward."""
    cfg = DiTConfig.tiny(adaln_form="curve")
    try:
        model = bench.build_tp_rank(cfg, 2, CPU, 16, seed=0)
        assert (model.tp_rank, model.tp_size) == (0, 2) and dist.get_backend(model.tp_group) == "fake"
        assert model.blocks[0].attn.qkv_proj.weight.shape[0] == 3 * cfg.attn_inner // 2
        lay, video, audio, text = bench.inputs_for(cfg, (64, 64, 22), CPU)
        with torch.inference_mode():
            v, a = model(video, audio, text, bench.T_VIDEO, bench.T_AUDIO, lay)
        assert v.shape == video.shape and a.shape == audio.shape
        assert torch.isfinite(v).all() and torch.isfinite(a).all()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_tiny_table_run(tmp_path):
    """--tiny end to end: diffusers, an eager and the engine's compiled variant at one shape; the JSON records each
    variant's forced kernels and its velocity error against diffusers."""
    out = tmp_path / "dit.json"
    run = subprocess.run([sys.executable, "benchmarks/bench_dit.py", "--tiny", "--variants", "diffusers,fp8,fp8caf",
                          "--shapes", "64x64x22", "--iters", "1", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["chunk_rows"] == 65536 and not res["failures"]
    for name, kernels in (("fp8", ["fp8-no-fast-accum", "cudnn"]), ("fp8caf", ["fp8", "fp8"])):
        var = res["variants"][name]
        assert [k[1] for k in var["kernels"]] == kernels
        row = var["shapes"]["64x64x22"]
        assert row["finite"] and row["rel_err_vs_diffusers"] < 0.05


def _main(bench, monkeypatch, *argv: str) -> int:
    """The script's main() on `argv` in this process (the tiny runs above and below run it as a script)."""
    monkeypatch.setattr(sys, "argv", ["bench_dit.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    return e.value.code


def test_unknown_variant_is_refused_at_parse(bench, monkeypatch, capsys):
    assert _main(bench, monkeypatch, "--tiny", "--variants", "fp8caf,fp8x") == 2
    assert "unknown variants ['fp8x']; choose from diffusers, int8" in capsys.readouterr().err


def test_tiny_fast_quality_and_fa3_rows(tmp_path):
    """--quality fast beside diffusers' own First Block Cache, with the FA3 fp8 variant (its CPU stand-in: the
    emulation of FA3's fp8 kernel) and the engine's own probe (auto): per variant and shape, the skipped steps, both
    runs' s/step and a cached step's time against a full one's."""
    out = tmp_path / "dit.json"
    run = subprocess.run([sys.executable, "benchmarks/bench_dit.py", "--tiny", "--variants", "diffusers,fp8caf3,auto",
                          "--shapes", "64x64x22", "--iters", "1", "--quality", "exact,fast", "--fast-steps", "6",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert not res["failures"] and res["quality"] == ["exact", "fast"] and res["fast_threshold"] == 0.08
    assert [k[1] for k in res["variants"]["fp8caf3"]["kernels"]] == ["fp8", "fa3_fp8"]
    assert res["variants"]["auto"]["kernels"][1][2].startswith("fastest valid on cpu")
    for name in ("diffusers", "fp8caf3", "auto"):
        fast = res["variants"][name]["shapes"]["64x64x22"]["fast"]
        assert fast["steps"] == 6 and len(fast["skipped"]) == 6 and not fast["skipped"][0]
        assert fast["skipped_fraction"] == fast["cached_steps"] / 6 and fast["s_per_step"] > 0
        assert fast["exact_s_per_step"] > 0
        if fast["cached_steps"]:
            assert fast["cached_over_full"] > 0
    assert res["variants"]["fp8caf3"]["shapes"]["64x64x22"]["fast"]["rel_err_vs_exact"] < 0.5
    assert "| quality fast |" in run.stdout


def test_help_names_the_quality_and_fa3_rows(bench, monkeypatch, capsys):
    assert _main(bench, monkeypatch, "--help") == 0
    out = capsys.readouterr().out
    assert "--quality" in out and "fp8caf3" in out
