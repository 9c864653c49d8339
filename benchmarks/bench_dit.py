"""Full-size MiniMax-H3 DiT on one GPU: s/step of several kernel variants vs diffusers, and TP2 per-rank memory.

    python benchmarks/bench_dit.py --json out.json                       # the table (variants a-d, two shapes)
    python benchmarks/bench_dit.py --memory --json mem.json              # TP2 rank peak memory under a 22 GiB cap
    python benchmarks/bench_dit.py --layers 2 --shapes 832x480x22 ...    # smoke run (same code, fewer blocks)
    python benchmarks/bench_dit.py --tiny --json out.json                # CPU dry run: tiny model, emulated fp8

Table mode builds the 50-block DiT from random weights in the real int8-ConvRot checkpoint layout, generated on the
GPU one tensor at a time (minimax_h3.dit.tiny_checkpoint.iter_random_int8_convrot_weights) and kept once as the
loader returns them (int8 as QuantizedWeight). Every variant is then built as the DiT stage builds its model
(dit_svc/engine.py load): the registry's selection with the variant's kernels forced (select_kernels with
KernelConfig(linear_kernel=..., attention_kernel=...): availability and parity checked, as a forced
--linear-kernel / --attention-kernel is), minimax_h3/dit/assembly.py kernel_linears + assemble_dit from a shallow
copy of those weights (block and refiner linears from the selection, every other int8 weight int8 ConvRot, the
attention kernel in every layer, the blocks compiled by the assembly's own call when the variant compiles), and
freed before the next variant:
  (d) diffusers MiniMaxH3Transformer3DModel, bf16, the same dequantised weights (built, timed and freed first)
  (a) int8   comfy-kitchen int8 ConvRot GEMMs            + SDPA cuDNN
  (b) fp8    e4m3 row-wise torch._scaled_mm (from int8)   + SDPA cuDNN
  (c) bf16   dense cuBLAS on the dequantised int8 weights + SDPA cuDNN
  (b+)/(a+) fp8c / int8c: (b)/(a) with every Block torch.compile'd (regional compilation), run last
  (e)/(e+) fp8a / fp8ca: (b)/(b+) with cuDNN fp8 attention; their velocity error vs (b)/(b+) (same linears, bf16
      attention) is the full-forward error of 8-bit attention ("rel_err_vs_bf16_attention")
  (e+f) fp8caf: (e+) with fast-accumulation fp8 GEMMs, what the engine runs (its registry candidates "fp8" / "fp8",
      unchanged); fp8caf-mqk: the same with q/k quantised by the attention's own statistics pass instead of with
      static scales by the q/k norm kernel, fp8caf-mqk-v: that without K smoothing;
      fp8cf: the same GEMMs with bf16 cuDNN attention (their baseline for "rel_err_vs_bf16_attention")
  (e+f3) fp8caf3 / fp8cf3: (e+f) with FlashAttention-3's fp8 / bf16 attention (the registry's fa3_fp8 / fa3,
      fa3-fwd on Hopper); auto: the kernels the registry's start-up probe picks on this machine (what a stage started
      with --attention-kernel auto runs: FA3 where it wins the probe), compiled blocks
  (a)-(e+) run their fp8 GEMMs without fast accumulation (the bench's candidate "fp8-no-fast-accum"); the measured-
  q/k attentions are the bench's candidates too, beside the registry's. Each compiled variant compiles every shape
  afresh, as a stage process whose first job has that shape (a second shape in one process would recompile with
  dynamic sizes).
--quality fast (or exact,fast) adds, per variant and shape, a sampled run of --fast-steps steps with step caching
(minimax_h3/dit/step_cache.py, First Block Cache at --fast-threshold, the product's `quality = "fast"`) beside the
same run without it: the fraction of steps skipped, s/step of each run, a cached step's time against a full one's
("cached_over_full"), and the final latents' error against the exact run; with diffusers in --variants, diffusers'
own `apply_first_block_cache` at the same threshold runs the same loop (its block type registered with the hooks).
One step = one forward (t2va, L = 38 text rows). FLOPs = 2*385,351,680*S*layers + 4*S^2*7168*layers. Peak rates
(bf16 GEMM, fp8 _scaled_mm, int8 _int_mm, SDPA cuDNN at the real S) are measured in the same run; "floor" = linear
FLOPs at the best linear rate (fp8) + attention FLOPs at the cuDNN rate. Also per variant: the time its kernels
alone take at the real shapes (linears + attention, x layers); step minus that is framework / elementwise overhead.
The run fails (exit 1, after printing the table) on NaN/Inf or a velocity error vs diffusers above its bound; a
variant that raises is recorded under "failures" and the others still run.

--tiny runs table mode on the CPU with the tiny model (DiTConfig.tiny(), small shapes): the same selection and
assembly, with each GPU kernel replaced under its name by its CPU stand-in (fp8 linears and fp8 attention as their
fp32 emulations, every SDPA as the math kernel, int8 as comfy-kitchen's eager path). It checks the script, not the
speed.

Memory mode builds one TP2 rank through the same assembly (half the heads / ffn, AdaLN column-sharded, int8 block
linears, Comfy "pruned" curve AdaLN as in the ~19.5 GiB checkpoint) in a TP group of torch.distributed's fake
backend (this process plays one rank: collectives move nothing), caps the process at 22 GiB
(torch.cuda.set_per_process_memory_fraction) and runs the refiner + `--memory-blocks` blocks + final layer (all 50
blocks' weights stay resident; every block has the same activation peak). On OOM under the cap it reruns uncapped
to report the real peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_svc.engine import resolve_chunk_rows  # noqa: E402
from minimax_h3.contract import DEFAULT_STEPS, QUALITIES  # noqa: E402
from minimax_h3.dit.assembly import assemble_dit, kernel_linears  # noqa: E402
from minimax_h3.dit.config import DiTConfig  # noqa: E402
from minimax_h3.dit.keyframes import conditioned_denoise  # noqa: E402
from minimax_h3.dit.layout import build_layout  # noqa: E402
from minimax_h3.dit.sampling import SamplerConfig, sample  # noqa: E402
from minimax_h3.dit.step_cache import FAST_THRESHOLD, FirstBlockCache  # noqa: E402
from minimax_h3.dit.model import FP32_PARAM_PREFIXES, H3DiT  # noqa: E402
from minimax_h3.dit.tiny_checkpoint import convrot_groupsize, diffusers_config, iter_random_int8_convrot_weights  # noqa: E402
from minimax_h3.kernels.fp8 import quantize_fp8_rowwise  # noqa: E402
from minimax_h3.kernels.fp8_attention import DEFAULT_OPTIONS, OPTIONS, Fp8Attention, Fp8AttentionOptions  # noqa: E402
from minimax_h3.kernels.int8 import QuantizedWeight, parse_comfy_quant  # noqa: E402
from minimax_h3.kernels.registry import (  # noqa: E402
                                         AUTO,
                                         REL_ERR_BOUND,
                                         AttentionCandidate,
                                         KernelConfig,
                                         KernelSelection,
                                         LinearCandidate,
                                         default_attention_candidates,
                                         default_linear_candidates,
                                         fp8_builder,
                                         rel_err,
                                         select_kernels,
                                         time_ms,
                                         )
from minimax_h3.kernels.tuning import arch_key  # noqa: E402

TEXT_LEN = 38  # t2va prompt length behind the reference S = 14,882 at 832x480x124
CORE_PARAMS_PER_BLOCK = 385_351_680  # qkv + out + fc1 + fc2 of one block (docs/model.md §9.1)
T_VIDEO, T_AUDIO = 0.4, 0.55  # any mid-schedule noise levels
MEMORY_CAP_GIB = 22.0
GIB = 2**30
BLOCK_LINEAR = re.compile(r"^blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")
# fp8 GEMMs without fast accumulation: the registry's fp8 linear (whose accumulation is the device's tuned one,
# minimax_h3/kernels/tuning.json "fp8_fast_accum": fast on the H200) with cuBLAS's fp32 promotion instead.
FP8_NO_FAST_ACCUM = "fp8-no-fast-accum"
VARIANTS = {  # name -> (linear kernel, attention kernel, torch.compile the blocks, label)
    "int8": ("int8", "cudnn", False, "(a) int8 comfy-kitchen + cuDNN SDPA"),
    "fp8": (FP8_NO_FAST_ACCUM, "cudnn", False, "(b) fp8 row-wise _scaled_mm + cuDNN SDPA"),
    "bf16": ("bf16", "cudnn", False, "(c) bf16 dense (dequantised) + cuDNN SDPA"),
    # Regional compilation: every Block compiled (one graph shared by the 50 blocks), fusing the fp32 norm /
    # modulation / RoPE / gating elementwise passes and the fp8 activation quantisation.
    "fp8c": (FP8_NO_FAST_ACCUM, "cudnn", True, "(b+) fp8 + cuDNN SDPA + torch.compile(blocks)"),
    "int8c": ("int8", "cudnn", True, "(a+) int8 + cuDNN SDPA + torch.compile(blocks)"),
    # 8-bit attention (cuDNN fp8 SDPA via nvidia-cudnn-frontend, minimax_h3/kernels/fp8_attention.py, default options).
    "fp8a": (FP8_NO_FAST_ACCUM, "fp8", False, "(e) fp8 + cuDNN fp8 attention"),
    "fp8ca": (FP8_NO_FAST_ACCUM, "fp8", True, "(e+) fp8 + cuDNN fp8 attention + torch.compile(blocks)"),
    # The same with the fp8 GEMMs' fast (reduced-precision) accumulation: the registry's fp8 linear as the engine
    # makes it on an H200.
    "fp8caf": ("fp8", "fp8", True, "(e+f) fp8 fast-accumulation GEMMs + cuDNN fp8 attention + torch.compile(blocks)"),
    # (e+f) with cuDNN bf16 attention: the baseline of fp8 attention's full-forward error for fp8caf / fp8caf-mqk.
    "fp8cf": ("fp8", "cudnn", True, "(b+f) fp8 fast-accumulation GEMMs + cuDNN bf16 attention + torch.compile(blocks)"),
    # The same with q/k quantised by the attention's own statistics pass (fp8 attention option head+kv), instead of
    # by the q/k norm kernel with static scales (the default, minimax_h3/kernels/fp8_attention.py "static q/k scales").
    "fp8caf-mqk": ("fp8", "fp8-measured-qk", True, "(e+f) with q/k scales measured by the attention's own pass"),
    # fp8caf-mqk without K smoothing: whether an unsmoothed K slows the SDPA kernel (docs/performance_history.md).
    "fp8caf-mqk-v": ("fp8", "fp8-measured-qk-v", True, "(e+f) with measured q/k scales, K not smoothed"),
    # FlashAttention-3 (fa3-fwd, Hopper) in place of cuDNN: fp8 on the same quantised q/k/v, and bf16.
    "fp8caf3": ("fp8", "fa3_fp8", True, "(e+f3) fp8 fast-accumulation GEMMs + FA3 fp8 attention + torch.compile(blocks)"),
    "fp8cf3": ("fp8", "fa3", True, "(b+f3) fp8 fast-accumulation GEMMs + FA3 bf16 attention + torch.compile(blocks)"),
    # The engine's own choice on this machine: both kernels from the start-up probe (as --*-kernel auto).
    "auto": (AUTO, AUTO, True, "the start-up probe's kernels (auto) + torch.compile(blocks)"),
}
# The bench's fp8 attentions beside the registry's: q/k quantised by the attention's own statistics pass.
MEASURED_QK_OPTIONS = {"fp8-measured-qk": OPTIONS["head+kv"],
                       "fp8-measured-qk-v": Fp8AttentionOptions(smooth_k=False)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def variant_names(s: str) -> list[str]:
    """--variants: a comma-separated list of "diffusers" and VARIANTS names, refused at parse otherwise."""
    names = [v for v in s.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS and v != "diffusers"]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown or [s]}; choose from diffusers, "
                                         f"{', '.join(VARIANTS)}")
    return names


def qualities(s: str) -> tuple[str, ...]:
    """--quality: a comma-separated list of minimax_h3.contract.QUALITIES."""
    names = tuple(v for v in s.split(",") if v)
    if not names or any(v not in QUALITIES for v in names):
        raise argparse.ArgumentTypeError(f"unknown quality {s!r}; choose from {', '.join(QUALITIES)}")
    return names


def parse_shape(s: str) -> tuple[int, int, int]:
    w, h, f = (int(v) for v in s.lower().split("x"))
    return w, h, f


DEV = torch.device("cuda")  # where everything runs: the GPU (--tiny: the CPU)
SHAPES = "832x480x124,1344x768x124"
TINY_SHAPES = "64x64x22,96x64x22"
TINY_PROBE = KernelConfig(linear_shapes=((64, 256, 128),), attention_shape=(1, 2, 64, 32), probe_iters=1,
                          compute_dtype=torch.float32)
# Variants whose velocity differs from another only by the attention kernel: the full-forward error of fp8 attention.
ATTENTION_BASELINE = {"fp8a": "fp8", "fp8ca": "fp8c", "fp8caf": "fp8cf", "fp8caf-mqk": "fp8cf",
                      "fp8caf-mqk-v": "fp8cf", "fp8caf3": "fp8cf", "fp8cf3": "fp8cf"}


def on_gpu() -> bool:
    return DEV.type == "cuda"


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if on_gpu():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if on_gpu() else 0.0


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / GIB if on_gpu() else 0.0


def fp8_attention_on(options: Fp8AttentionOptions, device: torch.device, kernel: str = "cudnn") -> Fp8Attention:
    """fp8 attention with `options` as the registry makes its candidate on a GPU; on the CPU (--tiny) its
    emulation, on every sequence (the tiny ones are shorter than min_seq)."""
    if device.type == "cuda":
        return Fp8Attention(options, compile_quant=True, kernel=kernel)
    return Fp8Attention(Fp8AttentionOptions(**{**options.__dict__, "min_seq": 0}), emulate=True, kernel=kernel)


def variant_candidates(device: torch.device) -> tuple[dict[str, LinearCandidate], dict[str, AttentionCandidate]]:
    """The kernels the variants force, by name: on a GPU the registry's own candidates (what the engine selects
    from) plus the bench's `FP8_NO_FAST_ACCUM` linear and measured-q/k attentions; on the CPU (--tiny) each of
    those names served by its CPU stand-in (fp8 as its fp32 emulation, every SDPA as the math kernel, int8 as
    comfy-kitchen's eager path)."""
    lin, att = default_linear_candidates(), default_attention_candidates()
    fp8_attention = att["fp8"]
    extra_att = {name: AttentionCandidate(name, lambda o=opts: fp8_attention_on(o, device), fp8_attention.rel_err_bound,
                                          fp8_attention.unavailable)
                 for name, opts in MEASURED_QK_OPTIONS.items()}
    if device.type == "cuda":
        lin[FP8_NO_FAST_ACCUM] = LinearCandidate(FP8_NO_FAST_ACCUM, fp8_builder(fast_accum=False),
                                                 REL_ERR_BOUND["fp8"], lin["fp8"].unavailable)
        return lin, {**att, **extra_att}
    usable = lambda device: None  # noqa: E731  (the stand-ins run anywhere)
    cpu_lin = {"bf16": lin["bf16"], "int8": LinearCandidate("int8", lin["int8"].build, REL_ERR_BOUND["int8"], usable),
               "fp8": LinearCandidate("fp8", fp8_builder(emulate=True), REL_ERR_BOUND["fp8"], usable),
               FP8_NO_FAST_ACCUM: LinearCandidate(FP8_NO_FAST_ACCUM, fp8_builder(fast_accum=False, emulate=True),
                                                  REL_ERR_BOUND["fp8"], usable)}
    math = att["math"]
    cpu_att = {name: AttentionCandidate(name, math.make_fn, math.rel_err_bound, usable) for name in att}
    cpu_att["fp8"] = AttentionCandidate("fp8", lambda: fp8_attention_on(DEFAULT_OPTIONS, device),
                                        fp8_attention.rel_err_bound, usable)
    cpu_att["fa3_fp8"] = AttentionCandidate("fa3_fp8", lambda: fp8_attention_on(DEFAULT_OPTIONS, device, "fa3"),
                                            fp8_attention.rel_err_bound, usable)
    for name, cand in extra_att.items():
        cpu_att[name] = AttentionCandidate(name, cand.make_fn, cand.rel_err_bound, usable)
    return cpu_lin, cpu_att


def select_variant(linear_kernel: str, attention_kernel: str, device: torch.device) -> KernelSelection:
    """The registry's selection with both kernels forced, as a DiT stage started with --linear-kernel /
    --attention-kernel makes it (availability and the parity probe checked; --tiny: small probe shapes); both auto:
    the start-up probe over the registry's own candidates, as a stage started with auto runs it."""
    base = KernelConfig() if device.type == "cuda" else replace(TINY_PROBE, compute_dtype=torch.bfloat16)
    if (linear_kernel, attention_kernel) == (AUTO, AUTO):  # the engine's own probe, over the registry's candidates
        return select_kernels(device, base)
    lin, att = variant_candidates(device)
    return select_kernels(device, replace(base, linear_kernel=linear_kernel, attention_kernel=attention_kernel),
                          lin, att)


def build_model(cfg: DiTConfig, weights: dict, linear_kernel: str, attention_kernel: str, compile_blocks: bool,
                device: torch.device, chunk_rows: int) -> tuple[H3DiT, KernelSelection]:
    """The DiT as the stage's load builds it (dit_svc/engine.py DiTEngine.load): the selection with these kernels
    forced, then minimax_h3/dit/assembly.py kernel_linears + assemble_dit (blocks compiled by its own call when
    `compile_blocks`). `weights` (as checkpoint_weights returns them) are only read: the assembly takes a shallow
    copy, whose tensors the model shares where no conversion is needed."""
    sel = select_variant(linear_kernel, attention_kernel, device)
    make_linear = kernel_linears(cfg, sel, "kernel", sel.compute_dtype)
    model = assemble_dit(cfg, dict(weights), make_linear, device, sel.compute_dtype, chunk_rows,
                         attention_fn=sel.attention_fn(), compile_blocks=compile_blocks)
    meta = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if meta:
        raise RuntimeError(f"parameters left on meta: {meta[:5]}")
    return model, sel


def build_variant(cfg: DiTConfig, weights: dict, name: str, device: torch.device,
                  chunk_rows: int) -> tuple[H3DiT, KernelSelection]:
    """Variant `name` of VARIANTS, built by `build_model`."""
    lin_k, att_k, compiled, _ = VARIANTS[name]
    return build_model(cfg, weights, lin_k, att_k, compiled, device, chunk_rows)


def step_flops(s: int, layers: int, cfg: DiTConfig) -> tuple[float, float]:
    return 2.0 * CORE_PARAMS_PER_BLOCK * s * layers, 4.0 * s * s * cfg.attn_inner * layers


def inputs_for(cfg: DiTConfig, shape: tuple[int, int, int], device, seed: int = 1):
    w, h, f = shape
    lay = build_layout(cfg, TEXT_LEN, f, h, w).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    video = torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g, device=device)
    audio = torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g, device=device)
    text = torch.randn(lay.text_len, cfg.text_dim, generator=g, device=device).to(torch.bfloat16)
    return lay, video, audio, text


# =====================================================================================================================
# Weights
# =====================================================================================================================


def iter_checkpoint(cfg: DiTConfig, seed: int, device):
    """(key, tensor | QuantizedWeight) in file order: int8 triplets (weight, weight_scale, comfy_quant) merged."""
    held: dict[str, dict] = {}
    for key, t in iter_random_int8_convrot_weights(cfg, seed, device=device, quantize=True):
        m = re.match(r"^(.*)\.(weight|weight_scale|comfy_quant)$", key)
        if m and (t.dtype == torch.int8 or m.group(1) in held):
            part = held.setdefault(m.group(1), {})
            part[m.group(2)] = t
            if len(part) == 3:
                del held[m.group(1)]
                g = parse_comfy_quant(part["comfy_quant"].cpu()).groupsize
                yield m.group(1), QuantizedWeight(part["weight"], part["weight_scale"], g)
            continue
        yield key, t
    if held:
        raise RuntimeError(f"incomplete int8 triplets: {sorted(held)[:5]}")


def checkpoint_weights(cfg: DiTConfig, seed: int, device) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The random int8 checkpoint as the stage's loader returns one (release names; int8 as QuantizedWeight)."""
    return {key + ".weight" if isinstance(t, QuantizedWeight) else key: t
            for key, t in iter_checkpoint(cfg, seed, device)}


def build_diffusers(cfg: DiTConfig, seed: int, device):
    """diffusers' model on the same random weights (every int8 tensor dequantised to bf16), loaded block by block."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    from minimax_h3.dit.convert_diffusers import to_diffusers

    with torch.device("meta"):
        dm = MiniMaxH3Transformer3DModel.from_config(diffusers_config(cfg))
    dm.rope = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    pending, nbytes = {}, 0
    for key, t in iter_checkpoint(cfg, seed, device):
        if isinstance(t, QuantizedWeight):
            t, key = t.dequantize(torch.bfloat16), key + ".weight"
        pending[key] = t
        nbytes += t.numel() * t.element_size()
        if nbytes > 4 * GIB:
            dm.load_state_dict(to_diffusers(pending), strict=False, assign=True)
            pending, nbytes = {}, 0
    dm.load_state_dict(to_diffusers(pending), strict=False, assign=True)
    meta = [n for n, p in [*dm.named_parameters(), *dm.named_buffers()] if p.is_meta]
    if meta:
        raise RuntimeError(f"diffusers parameters left on meta: {meta[:5]}")
    return dm.eval()


# =====================================================================================================================
# Rates and kernel-only times
# =====================================================================================================================


def peak_rates(iters: int) -> dict:
    """GEMM rates (TFLOP/s) at a DiT fc1-like shape; a rate this machine cannot measure is the bf16 one (noted)."""
    m, k, n = (16384, 5376, 21504) if on_gpu() else (256, 256, 256)
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    fl = 2.0 * m * k * n
    out = {"gemm_shape": [m, k, n]}
    out["bf16_tflops"] = fl / time_ms(lambda: F.linear(a, b), DEV, iters) / 1e9
    aq, as_ = quantize_fp8_rowwise(a)
    bq, bs = quantize_fp8_rowwise(b)
    ai = torch.randint(-127, 128, (m, k), device=DEV, dtype=torch.int8)
    bi = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    for name, fn in (("fp8_rowwise_tflops", lambda: torch._scaled_mm(aq, bq.t(), scale_a=as_, scale_b=bs.t(),
                                                                      out_dtype=torch.bfloat16)),
                     ("int8_int_mm_tops", lambda: torch._int_mm(ai, bi.t()))):
        try:
            out[name] = fl / time_ms(fn, DEV, iters) / 1e9
        except Exception as e:  # e.g. no fp8 / int8 GEMM on this device
            out[name] = out["bf16_tflops"]
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]} (bf16 rate used)"
    return out


def sdpa_rate(s: int, cfg: DiTConfig, fn, iters: int) -> float:
    q, k, v = (torch.randn(1, cfg.num_heads, s, cfg.head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    return 4.0 * s * s * cfg.attn_inner / time_ms(lambda: fn(q, k, v), DEV, iters) / 1e9


def kernel_only_ms(model: H3DiT, s: int, cfg: DiTConfig, chunk_rows: int, iters: int) -> dict:
    """ms per block of the block-0 linears at their real M (MLP token-chunked like the model) and of attention."""
    blk = model.blocks[0]
    x = torch.randn(s, cfg.hidden, device=DEV, dtype=torch.bfloat16)
    o = torch.randn(s, cfg.attn_inner, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(min(s, chunk_rows), cfg.ffn, device=DEV, dtype=torch.bfloat16)
    chunks = [(i, min(s, i + chunk_rows)) for i in range(0, s, chunk_rows)]
    q, k, v = (torch.randn(1, cfg.num_heads, s, cfg.head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    res = {
        "qkv": time_ms(lambda: blk.attn.qkv_proj(x), DEV, iters),
        "out": time_ms(lambda: blk.attn.out_proj(o), DEV, iters),
        "fc1": time_ms(lambda: [blk.mlp.fc1(x[a:b]) for a, b in chunks], DEV, iters),
        "fc2": time_ms(lambda: [blk.mlp.fc2(g[: b - a]) for a, b in chunks], DEV, iters),
        "attention": time_ms(lambda: blk.attn.attention_fn(q, k, v), DEV, iters),
    }
    res["total"] = sum(res.values())
    return res


# Kernel kinds of a profile, first match wins (lower-cased kernel names of cuBLAS / CUTLASS / cuDNN / Inductor).
# Inductor names a fused kernel after the ops it fused ("triton_red_fused__scaled_mm_..._rsqrt" is the activation
# quantisation feeding a GEMM), so its prefixes go first; "triton_tem" is one of its GEMM templates.
KERNEL_KINDS = (("nccl", ("nccl",)),
                ("gemm", ("triton_tem",)),
                ("fused (inductor)", ("triton_",)),
                ("attention", ("fmha", "flash", "sdpa", "attention", "cudnn_generated")),
                ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "scaled_mm", "matmul")),
                ("copy / cast", ("copy", "cast", "convert")))


def kernel_profile(fn, top: int = 25) -> dict:
    """fn() once under torch.profiler (CUDA kernels; CPU ops with --tiny): GPU ms by kind (KERNEL_KINDS, else
    "other") and the `top` kernels by total time, [name, ms, calls]."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if on_gpu() else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    rows = []
    for ev in prof.key_averages():
        t = ev.self_device_time_total if on_gpu() else ev.self_cpu_time_total
        if t > 0:
            rows.append((ev.key, t / 1000, ev.count))
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {"gpu_ms": round(sum(r[1] for r in rows), 2), "by_kind_ms": {k: round(v, 2) for k, v in kinds.items()},
            "top": [[n[:160], round(ms, 3), c] for n, ms, c in rows[:top]], **(idle_gaps(prof) if on_gpu() else {})}


def idle_gaps(prof, top: int = 12) -> dict:
    """Where the GPU waits inside the profiled forward: span (first kernel's start to last kernel's end), idle
    (span minus the union of kernel intervals), and the `top` gaps between kernels summed by the kernel pair around
    them, [idle ms, count, kernel before, kernel after]. Host-bound stretches (many small launches, a
    synchronisation) show up here and not in gpu_ms."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start)
    if not spans:
        return {}
    idle, end, before, pairs = 0.0, spans[0][1], spans[0][2], {}
    for s, e, name in spans[1:]:
        if s > end:
            gap = s - end
            idle += gap
            key = (before[:80], name[:80])
            ms, n = pairs.get(key, (0.0, 0))
            pairs[key] = (ms + gap, n + 1)
        if e >= end:
            end, before = e, name
    worst = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": round((end - spans[0][0]) / 1000, 2), "idle_ms": round(idle / 1000, 2),
            "idle_by_pair": [[round(ms / 1000, 3), n, a, b] for (a, b), (ms, n) in worst]}


# =====================================================================================================================
# Table mode
# =====================================================================================================================


def run_table(args) -> int:
    dev = DEV
    cfg = DiTConfig.tiny() if args.tiny else DiTConfig.full(num_layers=args.layers)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    variants = args.variants
    if any(VARIANTS[v][2] for v in variants if v in VARIANTS):
        # Every (variant, shape) is a compiled graph of Block.forward: the default limit (8) would silently leave
        # later ones eager.
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    result: dict = {"mode": "table", "device": torch.cuda.get_device_name() if on_gpu() else "cpu (--tiny)",
                    "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "layers": cfg.num_layers, "text_len": TEXT_LEN,
                    "iters": args.iters, "warmup": args.warmup, "chunk_rows": args.chunk_rows, "shapes": {},
                    "quality": list(args.quality), "fast_steps": args.fast_steps,
                    "fast_threshold": args.fast_threshold,
                    "variants": {}, "failures": []}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    t0 = time.time()
    try:  # the registry's own start-up choice on this machine (informational: the variants name their kernels)
        sel = select_kernels(dev, KernelConfig() if on_gpu() else TINY_PROBE)
        result["kernel_probe"] = {"choices": sel.status_rows(),
                                  "probes": {op: [r.__dict__ for r in rs] for op, rs in sel.probes.items()}}
        for op, kern, why in sel.status_rows():
            log(f"probe: {op} -> {kern}: {why}")
    except Exception as e:
        result["kernel_probe"] = {"choices": [], "error": f"{type(e).__name__}: {e}"}
        result["failures"].append(f"kernel probe: {type(e).__name__}: {str(e)[:300]}")
    result["rates"] = peak_rates(args.rate_iters)
    cudnn = variant_candidates(dev)[1]["cudnn"].make_fn()
    for shape in shapes:
        lay = build_layout(cfg, TEXT_LEN, shape[2], shape[1], shape[0])
        s = lay.seq_len
        lin_fl, att_fl = step_flops(s, cfg.num_layers, cfg)
        rate = sdpa_rate(s, cfg, cudnn, args.rate_iters)
        r = result["rates"]
        result["shapes"]["x".join(map(str, shape))] = {
            "S": s, "linear_pflop": lin_fl / 1e15, "attention_pflop": att_fl / 1e15, "sdpa_cudnn_tflops": rate,
            "floor_s": lin_fl / (r["fp8_rowwise_tflops"] * 1e12) + att_fl / (rate * 1e12),
            "floor_bf16_s": lin_fl / (r["bf16_tflops"] * 1e12) + att_fl / (rate * 1e12),
            "floor_int8_s": lin_fl / (r["int8_int_mm_tops"] * 1e12) + att_fl / (rate * 1e12)}
    log(f"rates {json.dumps({k: round(v, 1) for k, v in result['rates'].items() if isinstance(v, float)})}; "
        f"shapes {json.dumps(result['shapes'])}")
    save()

    outputs: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    ours = [v for v in variants if v in VARIANTS]
    if "diffusers" in variants:  # first: it needs its own full bf16 copy, built while ours does not exist yet
        try:
            run_diffusers(args, cfg, shapes, dev, result, outputs, save)
        except Exception as e:  # recorded; ours still run
            result["failures"].append(f"diffusers: {type(e).__name__}: {str(e)[:300]}")
            log(f"diffusers FAILED: {type(e).__name__}: {e}")
            save()
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()
    if ours:
        t1 = time.time()
        weights = checkpoint_weights(cfg, args.seed, dev)
        log(f"weights generated in {time.time() - t1:.1f} s; allocated {allocated_gib():.1f} GiB")
        for name in sorted(ours, key=lambda n: VARIANTS[n][2]):  # compiled variants last
            label = VARIANTS[name][3]
            vres = result["variants"].setdefault(name, {"label": label, "shapes": {}})
            try:
                run_variant(args, cfg, shapes, dev, name, weights, result, outputs, save)
            except Exception as e:  # a variant that breaks (e.g. compilation) must not cost the others' numbers
                result["failures"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
                vres["error"] = f"{type(e).__name__}: {e}"
                log(f"{name} FAILED: {type(e).__name__}: {e}")
                save()
            gc.collect()
            if on_gpu():
                torch.cuda.empty_cache()
    for name in ours:  # final comparisons (bf16 may have run after int8 / fp8), bounds enforced here
        for key in result["variants"].get(name, {}).get("shapes", {}):
            _compare(result, outputs, name, key, args, record=True)
    result["wall_s"] = time.time() - t0
    save()
    print_table(result)
    if result["failures"]:
        print("FAILURES:\n  " + "\n  ".join(result["failures"]), flush=True)
        return 1
    return 0


def run_diffusers(args, cfg, shapes, dev, result, outputs, save) -> None:
    t1 = time.time()
    dm = build_diffusers(cfg, args.seed, dev)
    log(f"built diffusers in {time.time() - t1:.1f} s; allocated {allocated_gib():.1f} GiB")
    helper = H3DiT(cfg.replace(num_layers=1), device="meta")  # only for the distinct-timestep table
    vres = result["variants"].setdefault("diffusers", {"label": "(d) diffusers bf16 (default SDPA)", "shapes": {}})
    for shape in shapes:
        key = "x".join(map(str, shape))
        lay, video, audio, text = inputs_for(cfg, shape, dev)
        ts, ti = helper.timestep_table(T_VIDEO, T_AUDIO, lay)
        reset_peak()
        box = {}
        with torch.inference_mode():
            ms = time_ms(lambda: box.__setitem__("o", dm(
                video[None], audio[None], text[None], ts, ti, lay.tag, lay.position_ids, lay.video_idx,
                lay.audio_idx, lay.text_idx, return_dict=False)), dev, args.iters, args.warmup)
        peak = peak_gib()
        v, a = (t[0].float().cpu() for t in box["o"])
        outputs[("diffusers", key)] = (v, a)
        finite = bool(torch.isfinite(v).all() and torch.isfinite(a).all())
        vres["shapes"][key] = _row(result, key, ms, peak, finite, None, cfg)
        if not finite:
            result["failures"].append(f"diffusers {key}: non-finite velocity")
        log(f"diffusers {key}: {ms / 1e3:.3f} s/step, peak {peak:.1f} GiB")
        save()
        if "fast" in args.quality:
            fr = vres["shapes"][key]["fast"] = run_diffusers_fast(args, dm, helper, lay, text, ms, cfg)
            log(f"diffusers {key} fast: {fr['cached_steps']}/{fr['steps']} steps cached, {fr['s_per_step']:.3f} "
                f"s/step")
            save()


def run_variant(args, cfg, shapes, dev, name, weights, result, outputs, save) -> None:
    """Build variant `name` as the stage builds its model (`build_variant`) and time it per shape; the model is
    freed before the next variant is built."""
    compiled = VARIANTS[name][2]
    t1 = time.time()
    model, sel = build_variant(cfg, weights, name, dev, args.chunk_rows)
    vres = result["variants"][name]
    vres["kernels"] = sel.status_rows()  # (op, kernel, the forced probe's result)
    for op, kern, why in sel.status_rows():
        log(f"{name}: {op} -> {kern}: {why}")
    log(f"{name}: built in {time.time() - t1:.1f} s; allocated {allocated_gib():.1f} GiB")
    for shape in shapes:
        key = "x".join(map(str, shape))
        lay, video, audio, text = inputs_for(cfg, shape, dev)
        if compiled:  # a fresh compilation per shape, as in a stage process whose first job has this shape
            torch._dynamo.reset()
        reset_peak()
        with torch.inference_mode():
            t1 = time.time()
            for _ in range(args.warmup):  # includes compilation for compiled variants
                model(video, audio, text, T_VIDEO, T_AUDIO, lay)
            sync()
            warm_s = time.time() - t1
            ms = time_ms(lambda: outputs.__setitem__(
                (name, key), model(video, audio, text, T_VIDEO, T_AUDIO, lay)), dev, args.iters, 0)
            peak = peak_gib()
            kern = kernel_only_ms(model, lay.seq_len, cfg, args.chunk_rows, args.kernel_iters)
        v, a = outputs[(name, key)]
        outputs[(name, key)] = (v.float().cpu(), a.float().cpu())
        finite = bool(torch.isfinite(v).all() and torch.isfinite(a).all())
        row = vres["shapes"][key] = _row(result, key, ms, peak, finite, kern, cfg)
        row["warmup_s"] = warm_s
        if args.profile:
            with torch.inference_mode():
                prof = row["profile"] = kernel_profile(lambda: model(video, audio, text, T_VIDEO, T_AUDIO, lay))
            log(f"{name} {key} profile: {prof['gpu_ms']:.1f} ms of kernels: {json.dumps(prof['by_kind_ms'])}; "
                f"span {prof.get('span_ms')} ms, GPU idle {prof.get('idle_ms')} ms")
            for kernel, kernel_ms, calls in prof["top"][:15]:
                log(f"    {kernel_ms:9.2f} ms {calls:5d}x  {kernel[:120]}")
        if not finite:
            result["failures"].append(f"{name} {key}: non-finite velocity")
        if "fast" in args.quality:
            fr = row["fast"] = run_fast(args, cfg, model, lay, text)
            log(f"{name} {key} fast: {fr['cached_steps']}/{fr['steps']} steps cached, {fr['s_per_step']:.3f} s/step "
                f"(exact {fr['exact_s_per_step']:.3f}), a cached step {fr.get('cached_over_full')} of a full one")
        _compare(result, outputs, name, key, args, record=False)
        log(f"{name} {key}: {ms / 1e3:.3f} s/step, kernels {kern['total'] * cfg.num_layers / 1e3:.3f} s, "
            f"peak {peak:.1f} GiB, finite {finite}, warm-up {warm_s:.1f} s")
        save()


def sampled_steps(denoise, cfg: DiTConfig, lay, steps: int, seed: int) -> tuple[list[float], tuple]:
    """A sampling run of `steps` steps from seeded noise through `denoise` (the sampler's closure): each step's
    seconds (the device synchronised at every step boundary) and the final (video, audio) latents on the CPU."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    video = torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g, device=DEV)
    audio = torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g, device=DEV)
    times = []
    sync()
    last = [time.perf_counter()]

    def on_step(_i, _n):
        sync()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    with torch.inference_mode():
        v, a = sample(denoise, video, audio, SamplerConfig(steps=steps), on_step=on_step)
    return times, (v.float().cpu(), a.float().cpu())


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def fast_row(times_exact: list[float], times_fast: list[float], cache: FirstBlockCache | None, skipped: list[bool],
             exact_out: tuple | None, fast_out: tuple) -> dict:
    """What `quality = "fast"` does to a sampled run: skipped fraction, s/step of both runs (the first step, which
    the exact and the fast run both compute in full, left out of neither), a cached step's median seconds against a
    full step's (the exact run's median), and the fast latents' error against the exact ones."""
    cached = [t for t, sk in zip(times_fast, skipped) if sk]
    full_exact = _median(times_exact) if times_exact else None
    row = {"steps": len(times_fast), "cached_steps": sum(skipped), "skipped_fraction": sum(skipped) / len(skipped),
           "skipped": skipped, "s_per_step": sum(times_fast) / len(times_fast),
           "exact_s_per_step": sum(times_exact) / len(times_exact) if times_exact else None,
           "cached_step_s": _median(cached), "full_step_s_fast_run": _median([t for t, sk in
                                                                               zip(times_fast, skipped) if not sk]),
           "exact_step_s": full_exact}
    if cache is not None:
        row["distances"] = cache.distances
        row["threshold"] = cache.threshold
    if row["cached_step_s"] is not None and full_exact:
        row["cached_over_full"] = row["cached_step_s"] / full_exact
    if row["exact_s_per_step"]:
        row["speedup_vs_exact"] = row["exact_s_per_step"] / row["s_per_step"]
    if exact_out is not None:
        row["rel_err_vs_exact"] = rel_err(fast_out[0], exact_out[0])
        row["rel_err_audio_vs_exact"] = rel_err(fast_out[1], exact_out[1])
    return row


def run_fast(args, cfg, model, lay, text) -> dict:
    """quality fast vs exact on our model: the same sampled run without and with the step cache."""
    times_exact, exact = sampled_steps(conditioned_denoise(model, text, lay, None), cfg, lay, args.fast_steps,
                                       args.seed)
    cache = FirstBlockCache(args.fast_threshold)
    times_fast, fast = sampled_steps(conditioned_denoise(model, text, lay, None, step_cache=cache), cfg, lay,
                                     args.fast_steps, args.seed)
    return fast_row(times_exact, times_fast, cache, cache.skipped, exact, fast)


def run_diffusers_fast(args, dm, helper, lay, text, exact_ms: float, cfg: DiTConfig) -> dict:
    """diffusers' own First Block Cache (`apply_first_block_cache`, same threshold) on its H3 transformer, whose
    block type the hooks' registry does not list: registered here as returning its one residual stream."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    TransformerBlockRegistry.register(MiniMaxH3TransformerBlock, TransformerBlockMetadata(
        return_hidden_states_index=0, return_encoder_hidden_states_index=None))
    dm.enable_cache(FirstBlockCacheConfig(threshold=args.fast_threshold))  # diffusers' apply_first_block_cache
    head = dm.transformer_blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
    skipped = []

    def denoise(xv, xa, tv, ta):
        ts, ti = helper.timestep_table(tv, ta, lay)
        with dm.cache_context("cond"):
            v, a = dm(xv[None], xa[None], text[None], ts, ti, lay.tag, lay.position_ids, lay.video_idx,
                      lay.audio_idx, lay.text_idx, return_dict=False)
            skipped.append(not head.state_manager.get_state().should_compute)
        return v[0].float(), a[0].float()

    try:
        times, out = sampled_steps(denoise, cfg, lay, args.fast_steps, args.seed)
    finally:
        dm.disable_cache()
    row = fast_row([exact_ms / 1e3], times, None, skipped, None, out)
    row["exact_s_per_step"] = exact_ms / 1e3  # its timed forward
    row["speedup_vs_exact"] = row["exact_s_per_step"] / row["s_per_step"]
    return row


def _compare(result, outputs, name, key, args, record: bool) -> None:
    """Velocity error of variant `name` vs diffusers (bounded), vs our bf16 variant and, for fp8 attention, vs the
    same linears with bf16 cuDNN attention (informational)."""
    row = result["variants"][name]["shapes"][key]
    ov, oa = outputs[(name, key)]
    if ("bf16", key) in outputs:
        row["rel_err_vs_bf16"] = rel_err(ov, outputs[("bf16", key)][0])
    base = ATTENTION_BASELINE.get(name)
    if (base, key) in outputs:
        bv, ba = outputs[(base, key)]
        row["rel_err_vs_bf16_attention"] = rel_err(ov, bv)
        row["rel_err_audio_vs_bf16_attention"] = rel_err(oa, ba)
    if ("diffusers", key) in outputs:
        dv, da = outputs[("diffusers", key)]
        row["rel_err_vs_diffusers"] = rel_err(ov, dv)
        row["rel_err_audio_vs_diffusers"] = rel_err(oa, da)
        row["speedup_vs_diffusers"] = result["variants"]["diffusers"]["shapes"][key]["ms"] / row["ms"]
        bound = args.max_err_bf16 if VARIANTS[name][0] == "bf16" else args.max_err_quant
        if record and not row["rel_err_vs_diffusers"] <= bound:
            result["failures"].append(f"{name} {key}: velocity rel err vs diffusers "
                                      f"{row['rel_err_vs_diffusers']:.3e} > bound {bound}")


def _row(result, key, ms, peak, finite, kern, cfg) -> dict:
    sh = result["shapes"][key]
    s = sh["S"]
    fl = (sh["linear_pflop"] + sh["attention_pflop"]) * 1e15
    row = {"S": s, "ms": ms, "s_per_step": ms / 1e3, "tflops": fl / (ms / 1e3) / 1e12, "peak_gib": peak,
           "finite": finite, "x_floor": (ms / 1e3) / sh["floor_s"]}
    if kern is not None:
        row["kernel_ms_per_block"] = kern
        row["kernels_s"] = kern["total"] * cfg.num_layers / 1e3
        row["overhead_s"] = ms / 1e3 - row["kernels_s"]
    return row


def print_table(result) -> None:
    print("\n| variant | shape | S | s/step | TFLOP/s | x floor | kernels s | overhead s | peak GiB | "
          "err vs diffusers | err vs bf16 | err vs bf16 attention | speed vs diffusers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for vres in result["variants"].values():
        for key, r in vres["shapes"].items():
            print(f"| {vres['label']} | {key} | {r['S']} | {r['s_per_step']:.3f} | {r['tflops']:.0f} | "
                  f"{r['x_floor']:.2f} | {f(r.get('kernels_s'), '.3f')} | {f(r.get('overhead_s'), '.3f')} | "
                  f"{r['peak_gib']:.1f} | {f(r.get('rel_err_vs_diffusers'), '.2e')} | "
                  f"{f(r.get('rel_err_vs_bf16'), '.2e')} | {f(r.get('rel_err_vs_bf16_attention'), '.2e')} | "
                  f"{f(r.get('speedup_vs_diffusers'), '.2f')} |")
    fast = [(vres["label"], key, r["fast"]) for vres in result["variants"].values()
            for key, r in vres["shapes"].items() if "fast" in r]
    if fast:
        print("\n| quality fast | shape | steps cached | s/step fast | s/step exact | cached step / full | "
              "err vs exact |")
        print("|---|---|---|---|---|---|---|")
        for label, key, fr in fast:
            print(f"| {label} | {key} | {fr['cached_steps']}/{fr['steps']} | {fr['s_per_step']:.3f} | "
                  f"{f(fr.get('exact_s_per_step'), '.3f')} | {f(fr.get('cached_over_full'), '.3f')} | "
                  f"{f(fr.get('rel_err_vs_exact'), '.2e')} |")
    r = result["rates"]
    print(f"\nrates: bf16 GEMM {r['bf16_tflops']:.0f} TFLOP/s, fp8 row-wise {r['fp8_rowwise_tflops']:.0f}, "
          f"int8 _int_mm {r['int8_int_mm_tops']:.0f} TOPS")
    for key, sh in result["shapes"].items():
        print(f"{key}: S={sh['S']}, SDPA cuDNN {sh['sdpa_cudnn_tflops']:.0f} TFLOP/s, floor {sh['floor_s']:.3f} s "
              f"(fp8 linears), {sh['floor_bf16_s']:.3f} s (bf16 linears)")
    for op, kern, why in result["kernel_probe"]["choices"]:
        print(f"probe {op} -> {kern}: {why}")


# =====================================================================================================================
# Memory mode (one TP2 rank)
# =====================================================================================================================


def fake_tp_group(tp: int) -> dist.ProcessGroup:
    """A TP group of `tp` ranks in which this process plays rank 0 alone: torch.distributed's fake backend, whose
    collectives move nothing (an all-reduce leaves this rank's partial sums, an all-gather repeats its own part).
    For one rank's weights and activation peak without its peers; its velocities are not the model's."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    if dist.get_backend() != "fake" or dist.get_world_size() != tp:
        raise RuntimeError(f"this process already has a {dist.get_backend()} process group of "
                           f"{dist.get_world_size()} ranks; a fake TP{tp} group needs a process of its own")
    return dist.group.WORLD


def tp_rank_weights(model: H3DiT, tp: int, device, seed: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Random weights of one TP rank of `model` (a meta model of that rank's shapes): int8 ConvRot block linears, the
    pruned file's fp16 [out, 8] curve AdaLN projections, fp32 islands, bf16 elsewhere."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name in [n for n in model.linear_names() if BLOCK_LINEAR.match(n)]:
        n_out, n_in = model.get_submodule(name).weight.shape
        q = torch.randint(-127, 128, (n_out, n_in), generator=gen, device=device, dtype=torch.int8)
        full_in = n_in * (tp if name.endswith(("out_proj", "fc2")) else 1)
        scale = torch.full((n_out, 1), 1.0 / (73.3 * math.sqrt(full_in)), device=device)
        weights[name + ".weight"] = QuantizedWeight(q, scale, convrot_groupsize(n_in, cap=256))
    for full, p in model.named_parameters():
        if full in weights:
            continue
        pname, mname = full.rsplit(".", 1)[-1], full.rsplit(".", 1)[0] if "." in full else ""
        if full.startswith(FP32_PARAM_PREFIXES):
            dt = torch.float32
        elif ".adaln_proj.linear." in full:
            dt = torch.float16  # the pruned file's [out, 8] curve projections
        else:
            dt = torch.bfloat16
        t = torch.randn(p.shape, generator=gen, device=device)
        if "norm" in pname or "norm" in mname:
            t = 1.0 + 0.1 * t
        elif pname == "bias":
            t = 0.02 * t
        elif t.ndim == 2:
            t = t / math.sqrt(t.shape[1])
        weights[full] = t.to(dt)
    return weights


def build_tp_rank(cfg: DiTConfig, tp: int, device, chunk_rows: int, seed: int) -> H3DiT:
    """One rank of a TP group through the stage's assembly (minimax_h3/dit/assembly.py; no kernel selection: int8
    block linears), in a fake TP group (`fake_tp_group`), from random weights (`tp_rank_weights`)."""
    group = fake_tp_group(tp)
    shapes = H3DiT(cfg, torch.bfloat16, chunk_rows, tp_group=group, device="meta")
    weights = tp_rank_weights(shapes, tp, device, seed)
    return assemble_dit(cfg, weights, kernel_linears(cfg, None, "kernel", torch.bfloat16), device, torch.bfloat16,
                        chunk_rows, tp_group=group)


def run_memory(args) -> int:
    dev = torch.device("cuda")
    tp = args.tp
    cfg = DiTConfig.full(num_layers=args.layers, adaln_form="curve")
    shapes = [parse_shape(s) for s in args.memory_shapes.split(",")]
    result = {"mode": "memory", "device": torch.cuda.get_device_name(), "tp": tp, "cap_gib": args.cap_gib,
              "layers": cfg.num_layers, "blocks_run": args.memory_blocks, "adaln_form": "curve (pruned int8 file)",
              "linears": "int8 comfy-kitchen", "attention": "cudnn", "chunk_rows": args.chunk_rows, "shapes": {}}
    model = build_tp_rank(cfg, tp, dev, args.chunk_rows, args.seed)
    model.set_attention_fn(default_attention_candidates()["cudnn"].make_fn())
    all_blocks = list(model.blocks)
    model.blocks = nn.ModuleList(all_blocks[: args.memory_blocks])  # all 50 stay resident via all_blocks
    gc.collect()
    torch.cuda.empty_cache()
    weights_gib = torch.cuda.memory_allocated() / GIB
    result["weights_gib"] = weights_gib
    log(f"TP{tp} rank built: {weights_gib:.2f} GiB resident")
    total = torch.cuda.get_device_properties(dev).total_memory

    def attempt(lay, video, audio, text, cap_gib):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total) if cap_gib else 1.0)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        with torch.inference_mode():
            v, a = model(video, audio, text, T_VIDEO, T_AUDIO, lay)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(v).all() and torch.isfinite(a).all())
        return (torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB, finite,
                time.time() - t0)

    for shape in shapes:
        key = "x".join(map(str, shape))
        lay, video, audio, text = inputs_for(cfg, shape, dev)
        row = {"S": lay.seq_len}
        try:
            alloc, reserved, finite, secs = attempt(lay, video, audio, text, args.cap_gib)
            row.update(fits=True, peak_alloc_gib=alloc, peak_reserved_gib=reserved, finite=finite, secs=secs)
        except torch.OutOfMemoryError as e:
            row.update(fits=False, oom=str(e).splitlines()[0][:200])
            try:
                alloc, reserved, finite, secs = attempt(lay, video, audio, text, None)
                row.update(peak_alloc_gib=alloc, peak_reserved_gib=reserved, finite=finite, secs=secs)
            except torch.OutOfMemoryError as e2:
                row.update(uncapped_oom=str(e2).splitlines()[0][:200])
        torch.cuda.set_per_process_memory_fraction(1.0)
        result["shapes"][key] = row
        log(f"memory {key}: {json.dumps(row)}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        del lay, video, audio, text
    print(f"\nTP{tp} rank, cap {args.cap_gib} GiB, weights resident {weights_gib:.2f} GiB "
          f"(curve AdaLN; the unpruned int8 AdaLN would add ~{13.01e9 / tp / GIB:.2f} GiB)")
    print("| shape | S | peak allocated GiB | peak reserved GiB | fits in cap |")
    print("|---|---|---|---|---|")
    for key, r in result["shapes"].items():
        pa = r.get("peak_alloc_gib")
        pr = r.get("peak_reserved_gib")
        print(f"| {key} | {r['S']} | {'' if pa is None else f'{pa:.2f}'} | {'' if pr is None else f'{pr:.2f}'} | "
              f"{'yes' if r['fits'] else 'no'} |")
    bad = [k for k, r in result["shapes"].items() if r.get("finite") is False]
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="WxHxF list (pixels, frames), t2va")
    ap.add_argument("--variants", type=variant_names, default="int8,fp8,bf16,diffusers",
                    help=f"comma-separated, of diffusers, {', '.join(VARIANTS)}")
    ap.add_argument("--layers", type=int, default=50, help="DiT blocks (50 = full model; fewer for a smoke run)")
    ap.add_argument("--iters", type=int, default=2, help="timed forwards per variant and shape (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rate-iters", type=int, default=10)
    ap.add_argument("--kernel-iters", type=int, default=3)
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="row chunk of everything but attention (default: the engine's on this device, "
                         "minimax_h3/kernels/tuning.json: in table mode as for compiled blocks on one rank, 65536 "
                         "on an H200; in memory mode as for eager blocks, 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-err-bf16", type=float, default=0.05, help="bound: bf16 variant velocity vs diffusers")
    ap.add_argument("--max-err-quant", type=float, default=0.25, help="bound: int8/fp8 variants vs diffusers")
    ap.add_argument("--memory", action="store_true", help="TP rank peak-memory mode instead of the table")
    ap.add_argument("--memory-shapes", default="1600x896x124,1920x1088x124,1920x1088x362")
    ap.add_argument("--memory-blocks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=MEMORY_CAP_GIB)
    ap.add_argument("--profile", action="store_true",
                    help="table mode: one more forward per variant and shape under torch.profiler (kernel breakdown)")
    ap.add_argument("--quality", type=qualities, default="exact",
                    help="exact: the forward timings; fast (or exact,fast): also a sampled run with step caching "
                         "beside one without, per variant and shape")
    ap.add_argument("--fast-steps", type=int, default=DEFAULT_STEPS,
                    help=f"steps of the --quality fast sampled runs (default: the product's {DEFAULT_STEPS})")
    ap.add_argument("--fast-threshold", type=float, default=FAST_THRESHOLD,
                    help=f"First Block Cache threshold of --quality fast (default: the product's {FAST_THRESHOLD})")
    ap.add_argument("--json", default="", help="write results here")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run of table mode (tiny model, emulated fp8)")
    args = ap.parse_args()
    global DEV
    if args.tiny:
        if args.memory:
            print("--tiny covers table mode only", file=sys.stderr)
            return 2
        DEV = torch.device("cpu")
        if args.shapes == SHAPES:
            args.shapes = TINY_SHAPES
        args.rate_iters = args.kernel_iters = 1
    elif not torch.cuda.is_available():
        print("bench_dit.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    if args.chunk_rows is None:  # the DiT engine's defaults on this device (dit_svc/engine.py resolve_chunk_rows)
        args.chunk_rows = resolve_chunk_rows(0, compile_blocks=not args.memory, tp_size=args.tp if args.memory else 1,
                                             arch=arch_key(DEV))
    return run_memory(args) if args.memory else run_table(args)


if __name__ == "__main__":
    sys.exit(main())
