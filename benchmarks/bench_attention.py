"""8-bit attention on one GPU: op-level error and speed of each fp8 option, and the DiT's velocity error with it.

    python benchmarks/bench_attention.py --out $OUT                 # full run (one H200: a few minutes)
    python benchmarks/bench_attention.py --check --out $OUT         # GPU self-check only (< 1 min), exit 1 on failure
    python benchmarks/bench_attention.py --layers 2 --out $OUT      # smoke (same code, 2 blocks)
    python benchmarks/bench_attention.py --tiny --out /tmp/att      # CPU dry run (tiny model; the kernel emulated)
    python benchmarks/bench_attention.py --quant --out $OUT         # only the q/k/v quantisers (step 4, < 2 min)

Options compared (minimax_h3/kernels/fp8_attention.py): `naive` (q, k, v per tensor), `head` (V / O per head), `head+k`
(+ K mean subtraction), `head+kv` (+ V mean subtraction), `head+kv+static-qk` (the registry's default: in the
DiT's blocks q and k come in e4m3 from the q/k norm kernel with static scales, unsmoothed; elsewhere as `head+kv`).
Every option feeds the same cuDNN fp8 SDPA kernel (e4m3 q/k/v/P/O on Hopper). The static q/k scales come from a
block's norm gains, so that option is measured in the full forward only (step 3 marks it).

1. Self-check: cuDNN's kernel against the fp32 emulation of the same arithmetic on the same quantised inputs
   (2 heads of the real shape), the forced `--attention-kernel fp8` registry probe, and whether cuDNN accepts
   per-head Q/K descales (a [1, H, 1, 1] descale tensor) and honours them.
2. Full forward (random weights in the int8-ConvRot layout, fp8 row-wise linears, t2va, L = 38): velocity of every
   fp8 option vs the same model with bf16 cuDNN attention, eager s/step of each; q/k/v of two blocks are captured
   for step 3.
3. Op level at the real [1, 56, S, 128] for three data sets (random Gaussian: flat softmax, the worst case;
   "synthetic": RMSNorm'd q/k with a shared component and key offsets, V with channel means and per-head scales;
   "model": q/k/v captured from step 2): rel. error vs an fp32 reference and ms of bf16 cuDNN SDPA, of the fp8
   kernel alone, and of each option including its quantisation (eager, and compiled for `naive` / `head+kv`).
   Where Triton runs, the quantisation is its two-pass op in both; "compiled" then compiles the O dequantisation.
4. `--quant`: the q/k/v quantisation alone at the real [H, S, D] (views of one [3, 1, H, S, D] bf16 buffer, the
   blocks' layout; DiT-shaped synthetic data), for `naive` and `head+kv`: torch eager, torch compiled on its own,
   and the two-pass Triton op under a few launch configurations: ms and effective TB/s (the two-pass minimum
   traffic: q, k, v read twice, e4m3 written once, over the time), and how far Triton's output is from
   `quantize_qkv` (e4m3 steps, share of differing elements, scale deviation); then V alone under the default
   option, as the blocks quantise it when q and k come in e4m3 (`quantize_v_triton` against `quantize_v`, the
   tuned launch in minimax_h3/kernels/tuning.json first). No cuDNN needed.

Writes <out>/attention.json (or check.json, quant.json) after every stage and prints tables. A step that raises is
recorded under "failures" (with its error) and the rest still runs. Exit 1 if anything failed.
--tiny: the same steps on the CPU with the tiny model and small shapes, cuDNN's kernel replaced by its fp32
emulation (so the kernel-vs-emulation check is trivially 0): it checks the script, not the kernel. With --quant
it skips compiling (minutes on the CPU) and runs Triton only under TRITON_INTERPRET=1 (its CPU interpreter).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_dit import T_AUDIO, T_VIDEO, TEXT_LEN, build_model, checkpoint_weights, inputs_for, parse_shape  # noqa: E402
from minimax_h3.dit.config import DiTConfig  # noqa: E402
from minimax_h3.dit.layout import build_layout  # noqa: E402
from minimax_h3.kernels.fp8_attention import (  # noqa: E402
                                              _CUDNN,
                                              DEFAULT_OPTIONS,
                                              E4M3_MAX,
                                              KERNEL_VS_EMULATION_FACTOR,
                                              KERNEL_VS_EMULATION_SLACK,
                                              OPTIONS,
                                              Fp8Attention,
                                              TritonQuantLaunch,
                                              dequantize_o,
                                              e4m3_steps,
                                              quantize_qkv,
                                              quantize_qkv_triton,
                                              quantize_v,
                                              quantize_v_triton,
                                              sdpa_fp8,
                                              sdpa_fp8_emulated,
                                              triton_unsupported,
                                              unavailable,
                                              )
from minimax_h3.kernels.registry import (  # noqa: E402
                                         REL_ERR_BOUND,
                                         AttentionCandidate,
                                         KernelConfig,
                                         attention_reference,
                                         default_attention_candidates,
                                         rel_err,
                                         select_kernels,
                                         time_ms,
                                         )

DEV = torch.device("cuda")  # --tiny: the CPU
TINY_SHAPES = "64x64x22,96x64x22"
COMPILED_OPTIONS = ("naive", "head+kv")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def on_gpu() -> bool:
    return DEV.type == "cuda"


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def empty_cache() -> None:
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()


def guarded(failures: list[str], what: str, fn, *args):
    """fn(*args), or None after recording `what` failed (with its error) in `failures`: one broken step must not
    cost the numbers of the others."""
    try:
        return fn(*args)
    except Exception as e:
        failures.append(f"{what}: {type(e).__name__}: {str(e)[:500]}")
        log(f"{what} FAILED: {type(e).__name__}: {e}")
        empty_cache()
        return None


def fp8_attention(opt, compile_quant: bool = False) -> Fp8Attention:
    """The registry's fp8 attention with these options; on the CPU (--tiny) its emulation, on every sequence."""
    if on_gpu():
        return Fp8Attention(opt, compile_quant=compile_quant)
    return Fp8Attention(replace(opt, min_seq=0), emulate=True)


def fp8_kernel(p):
    """The bare kernel on quantised inputs (cuDNN; on the CPU its emulation) -> e4m3 O [H, S, D]."""
    kernel = sdpa_fp8 if on_gpu() else sdpa_fp8_emulated
    return kernel(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)


def bf16_attention():
    """bf16 cuDNN SDPA (the baseline); on the CPU the math kernel."""
    return default_attention_candidates()["cudnn" if on_gpu() else "math"].make_fn()


def random_data(s: int, h: int, d: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g, device=DEV).to(torch.bfloat16) for _ in range(3)]


def synthetic_data(s: int, h: int, d: int, seed: int):
    """DiT-shaped (not real) activations: RMSNorm'd q/k with a gain and a component shared across tokens (peaked
    attention), a per-(head, channel) key offset; V with channel means and head scales spanning 100x."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def n(*shape):
        return torch.randn(*shape, generator=g, device=DEV)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    gain = 1.0 + 0.5 * n(d)
    shared = n(1, 1, s, d)
    q = rms(n(1, h, s, d) + 1.5 * shared) * gain * 2.0
    k = rms(n(1, h, s, d) + 1.5 * shared + 2.0 * n(1, h, 1, d)) * gain * 2.0
    v = (n(1, h, s, d) + 3.0 * n(1, h, 1, d)) * torch.logspace(-1, 1, h, device=DEV).view(1, h, 1, 1)
    return [t.to(torch.bfloat16) for t in (q, k, v)]


def per_head_descale_probe(q, k, v, ref) -> dict:
    """Does cuDNN accept (and honour) per-head Q/K descales? q/k quantised per head, descales [H]."""
    if not on_gpu():
        return {"supported": None, "skipped": "needs cuDNN (GPU)"}
    qs, ks = q[0].float(), k[0].float()  # [H, S, D]
    aq = qs.abs().amax(dim=(1, 2)).clamp(min=1e-12)
    ak = ks.abs().amax(dim=(1, 2)).clamp(min=1e-12)
    q8 = (qs * (E4M3_MAX / aq)[:, None, None]).to(torch.float8_e4m3fn)
    k8 = (ks * (E4M3_MAX / ak)[:, None, None]).to(torch.float8_e4m3fn)
    p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)  # V as the default does it
    try:
        o8 = _CUDNN(q8, k8, p.v8, aq / E4M3_MAX, ak / E4M3_MAX)
        torch.cuda.synchronize()
    except Exception as e:  # cuDNN says no: the answer we are after
        return {"supported": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    o = dequantize_o(o8, p.o_scale, p.o_shift, torch.bfloat16).unsqueeze(0)
    return {"supported": True, "rel_err": rel_err(o, ref)}


# =====================================================================================================================
# 1. Self-check
# =====================================================================================================================


def self_check(s: int, h: int, d: int, failures: list[str]) -> dict:
    out: dict = {}
    q, k, v = random_data(s, h, d, seed=10)
    v = v + 1.0
    ref = attention_reference(q, k, v)

    def kernel_vs_emulation():
        # The kernel rounds the softmax numerator against a blockwise running row max, the emulation against the
        # final one: each P~ element rounds differently, so their raw e4m3 O differ by about e4m3's own step on
        # random data (measured 4.5e-2). What must agree is the error each makes against the fp32 reference.
        p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)
        o8 = fp8_kernel(p)
        heads = slice(0, 2)  # the emulation materialises [heads, S, S] fp32
        emu = sdpa_fp8_emulated(p.q8[heads], p.k8[heads], p.v8[heads], p.descale_q, p.descale_k)
        shift = None if p.o_shift is None else p.o_shift[heads]
        o_kernel = dequantize_o(o8[heads], p.o_scale[heads], shift, torch.float32)
        o_emu = dequantize_o(emu, p.o_scale[heads], shift, torch.float32)
        out["kernel_vs_emulation_raw_o8_rel_diff"] = rel_err(o8[heads].float(), emu.float())
        out["kernel_err_vs_fp32"] = rel_err(o_kernel, ref[0, heads].float())
        out["emulation_err_vs_fp32"] = rel_err(o_emu, ref[0, heads].float())
        out["o8_finite"] = bool(torch.isfinite(o8.float()).all())
        bound = KERNEL_VS_EMULATION_FACTOR * out["emulation_err_vs_fp32"] + KERNEL_VS_EMULATION_SLACK
        if not out["o8_finite"] or not out["kernel_err_vs_fp32"] <= bound:
            failures.append(f"cuDNN fp8 kernel vs emulation: kernel error {out['kernel_err_vs_fp32']:.3e} vs fp32, "
                            f"emulation {out['emulation_err_vs_fp32']:.3e} (bound {bound:.3e}); "
                            f"finite {out['o8_finite']}")

    def default_vs_fp32():
        out["default_vs_fp32_rel_err"] = rel_err(fp8_attention(DEFAULT_OPTIONS)(q, k, v), ref)

    def probes():
        if on_gpu():
            cands, small = None, {}
        else:  # the registry's probe over the CPU's math kernel and the emulated fp8 candidate
            cands = {"math": default_attention_candidates()["math"],
                     "fp8": AttentionCandidate("fp8", lambda: fp8_attention(DEFAULT_OPTIONS),
                                               REL_ERR_BOUND["fp8_attention"], archs=("cpu",))}
            small = dict(linear_shapes=((64, 256, 128),), attention_shape=(1, h, 128, d), probe_iters=1,
                         compute_dtype=torch.float32)
        sel = select_kernels(DEV, KernelConfig(linear_kernel="bf16", attention_kernel="fp8", **small),
                             attention_candidates=cands)
        out["forced_probe"] = sel.status_rows()[1]
        auto = select_kernels(DEV, KernelConfig(linear_kernel="bf16", **small), attention_candidates=cands)
        out["auto_probe"] = auto.status_rows()[1]
        out["auto_probe_results"] = [r.__dict__ for r in auto.probes["attention"]]

    guarded(failures, "self-check: kernel vs emulation", kernel_vs_emulation)
    guarded(failures, "self-check: default options vs fp32", default_vs_fp32)
    guarded(failures, "self-check: registry probes (forced fp8, auto)", probes)
    out["per_head_descales"] = guarded(failures, "self-check: per-head descales", per_head_descale_probe, q, k, v,
                                       ref)
    log(f"self-check: {json.dumps(out, default=str)}")
    return out


# =====================================================================================================================
# 2. Full forward
# =====================================================================================================================


class Recorder:
    """Wraps an attention fn; keeps q/k/v of the chosen calls (block indices count refiner blocks first)."""

    def __init__(self, fn, keep: set[int]):
        self.fn, self.keep, self.calls, self.saved = fn, keep, 0, {}

    def __call__(self, q, k, v):
        if self.calls in self.keep:
            self.saved[self.calls] = (q.clone(), k.clone(), v.clone())
        self.calls += 1
        return self.fn(q, k, v)


def full_forward(args, cfg: DiTConfig, shapes, result: dict, failures: list[str]) -> dict:
    """Velocity error of each option vs bf16 cuDNN attention on the same model; returns captured q/k/v by shape."""
    # As the DiT stage builds it with --linear-kernel fp8 --attention-kernel cudnn (bench_dit.py build_model), eager.
    model, _ = build_model(cfg, checkpoint_weights(cfg, args.seed, DEV), "fp8", "cudnn", False, DEV, args.chunk_rows)
    empty_cache()
    base_fn = bf16_attention()
    captured = {}
    first_block = cfg.num_refiner_layers
    keep = {first_block, first_block + cfg.num_layers // 2}
    for shape in shapes:
        key = "x".join(map(str, shape))
        lay, video, audio, text = inputs_for(cfg, shape, DEV)
        tv, ta = (torch.tensor(t, device=DEV) for t in (T_VIDEO, T_AUDIO))
        row = result.setdefault(key, {"S": lay.seq_len})
        fwd = row.setdefault("forward", {})

        def run(fn, iters=1):
            model.set_attention_fn(fn)
            box = {}
            with torch.inference_mode():
                model(video, audio, text, tv, ta, lay)  # warm-up (plans, compiles)
                ms = time_ms(lambda: box.__setitem__("o", model(video, audio, text, tv, ta, lay)), DEV, iters, 0)
            return ms, box["o"]

        rec = Recorder(base_fn, keep)
        model.set_attention_fn(rec)
        with torch.inference_mode():
            model(video, audio, text, tv, ta, lay)
        captured[key] = [rec.saved[i] for i in sorted(rec.saved)]
        ms, (rv, ra) = run(base_fn)
        fwd["cudnn_bf16"] = {"ms": ms}
        log(f"{key}: forward with bf16 cuDNN attention {ms / 1e3:.3f} s/step (eager)")

        def option(name, opt):
            ms, (ov, oa) = run(fp8_attention(opt, compile_quant=True))
            ok = bool(torch.isfinite(ov).all() and torch.isfinite(oa).all())
            r = fwd[name] = {"ms": ms, "finite": ok, "velocity_rel_err_video": rel_err(ov, rv),
                             "velocity_rel_err_audio": rel_err(oa, ra)}
            log(f"{key}: forward fp8 {name}: {ms / 1e3:.3f} s/step, velocity err video "
                f"{r['velocity_rel_err_video']:.3e} audio {r['velocity_rel_err_audio']:.3e}")
            if not ok:
                failures.append(f"{key} forward fp8 {name}: non-finite velocity")

        for name, opt in OPTIONS.items():
            guarded(failures, f"{key} forward fp8 {name}", option, name, opt)
        del lay, video, audio, text, rv, ra
        empty_cache()
    del model
    empty_cache()
    return captured


# =====================================================================================================================
# 3. Op level
# =====================================================================================================================


def op_level(args, data_sets: dict, row: dict, failures: list[str]) -> None:
    base_fn = bf16_attention()
    compiled = {n: fp8_attention(OPTIONS[n], compile_quant=True) for n in COMPILED_OPTIONS}
    for data_name, (q, k, v) in data_sets.items():
        s = q.shape[2]
        flops = 4.0 * s * s * q.shape[1] * q.shape[3]
        ref = attention_reference(q, k, v)
        res = row.setdefault("op", {}).setdefault(data_name, {})
        what = f"S={s} {data_name}"

        def baseline():
            ms = time_ms(lambda: base_fn(q, k, v), DEV, args.iters)
            res["cudnn_bf16"] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": rel_err(base_fn(q, k, v), ref)}

        def kernel_only():
            p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)
            ms = time_ms(lambda: fp8_kernel(p), DEV, args.iters)
            res["fp8_kernel_only"] = {"ms": ms, "tflops": flops / ms / 1e9}

        def option(name, opt):
            fn = fp8_attention(opt)
            r = res[name] = {"rel_err": rel_err(fn(q, k, v), ref),
                             "ms_eager_quant": time_ms(lambda: fn(q, k, v), DEV, args.iters)}
            if name in compiled:
                cfn = compiled[name]
                o = cfn(q, k, v)  # compiles (first shape) / recompiles dynamic (second)
                r["compiled_vs_eager_rel_diff"] = rel_err(o, fn(q, k, v))
                r["ms_compiled_quant"] = time_ms(lambda: cfn(q, k, v), DEV, args.iters)

        guarded(failures, f"{what} bf16 attention", baseline)
        guarded(failures, f"{what} fp8 kernel", kernel_only)
        for name, opt in OPTIONS.items():
            if opt.static_qk:  # its q/k scales come from a block's norm gains: measured in the full forward only
                res[name] = {"note": "static q/k scales need the block's norm gains: see the full forward"}
                continue
            guarded(failures, f"{what} fp8 {name}", option, name, opt)
        res["per_head_descales"] = guarded(failures, f"{what} per-head descales", per_head_descale_probe, q, k, v,
                                           ref)
        log(f"{what}: " + json.dumps({n: ({kk: (round(vv, 4) if isinstance(vv, float) else vv)
                                           for kk, vv in r.items()} if isinstance(r, dict) else r)
                                      for n, r in res.items()}, default=str))
        del ref
        empty_cache()


# =====================================================================================================================
# 4. The quantisers alone (--quant)
# =====================================================================================================================

# Triton launch configurations compared (stats_rows, stats_block_r, stats_warps, quant_block_r, quant_warps), after
# the device's tuned one (minimax_h3/kernels/tuning.json).
QUANT_LAUNCHES = (TritonQuantLaunch(512, 32, 4, 64, 4), TritonQuantLaunch(1024, 64, 8, 128, 8),
                  TritonQuantLaunch(256, 16, 4, 32, 4), TritonQuantLaunch(128, 128, 8, 32, 2),
                  TritonQuantLaunch(1024, 16, 2, 16, 2), TritonQuantLaunch(512, 16, 1, 8, 1),
                  TritonQuantLaunch(512, 16, 2, 16, 2), TritonQuantLaunch(256, 16, 2, 16, 2))


def triton_interpreted() -> bool:
    """Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, read by Triton when the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def quant_label(lp: TritonQuantLaunch) -> str:
    return "triton " + "/".join(map(str, lp))


def quantizers(args, cfg: DiTConfig, shapes, result: dict, failures: list[str]) -> None:
    compiled = torch.compile(quantize_qkv, dynamic=True)  # as Fp8Attention(compile_quant=True) compiles it
    h, d = cfg.num_heads, cfg.head_dim
    for i, shape in enumerate(shapes):
        key = "x".join(map(str, shape))
        s = build_layout(cfg, TEXT_LEN, shape[2], shape[1], shape[0]).seq_len
        row = result.setdefault(key, {"S": s}).setdefault("quant", {})
        buf = torch.stack(synthetic_data(s, h, d, seed=3 + i))  # [3, 1, H, S, D]
        q, k, v = buf[:, 0]
        ideal_bytes = 3 * q.numel() * (2 * q.element_size() + 1)

        def timed(fn) -> dict:
            ms = time_ms(fn, DEV, args.iters)
            return {"ms": ms, "effective_tbps": ideal_bytes / ms / 1e9}

        for name in COMPILED_OPTIONS:
            opt, res = OPTIONS[name], row.setdefault(name, {})
            what = f"S={s} quantiser {name}"
            ref = quantize_qkv(q, k, v, opt)

            def eager():
                res["torch_eager"] = timed(lambda: quantize_qkv(q, k, v, opt))

            def torch_compiled():
                res["torch_compiled"] = timed(lambda: compiled(q, k, v, opt))

            def triton_op(lp):
                got = quantize_qkv_triton(q, k, v, opt, lp)
                steps = [e4m3_steps(a, b) for a, b in zip(ref[:3], got[:3])]
                scales = [(a - b).abs().max().item() / a.abs().max().item()
                          for a, b in zip(ref[3:], got[3:]) if a is not None]
                res[quant_label(lp)] = {**timed(lambda: quantize_qkv_triton(q, k, v, opt, lp)),
                                        "max_e4m3_steps": max(int(t.max()) for t in steps),
                                        "share_differing": sum(int((t > 0).sum()) for t in steps) / (3 * q.numel()),
                                        "max_scale_rel_diff": max(scales)}

            guarded(failures, f"{what} torch eager", eager)
            if on_gpu():  # the CPU dry run checks the script; compiling there needs a C++ toolchain and minutes
                guarded(failures, f"{what} torch compiled", torch_compiled)
            why = triton_unsupported(q, k, v)
            if why and not on_gpu() and triton_interpreted():  # --tiny under TRITON_INTERPRET=1: the script's path
                why = None
            if why:
                res["triton"] = {"skipped": why}
            for lp in (TritonQuantLaunch.tuned(q.device), *QUANT_LAUNCHES) if not why else ():
                guarded(failures, f"{what} {quant_label(lp)}", triton_op, lp)
            log(f"{what}: {json.dumps(res, default=str)}")
        v_alone(args, q, k, v, row.setdefault("v alone " + DEFAULT_OPTIONS.label, {}))
        del buf, q, k, v
        empty_cache()


def v_alone(args, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, res: dict) -> None:
    """V alone under the default options, as the blocks quantise it where q and k come in e4m3 (FA3 fp8, cuDNN fp8
    with static q/k scales): `quantize_v_triton` per launch against `quantize_v`; bytes: V read twice, e4m3 written."""
    ideal_bytes = v.numel() * (2 * v.element_size() + 1)
    ref = quantize_v(v, DEFAULT_OPTIONS)

    def timed(fn) -> dict:
        ms = time_ms(fn, DEV, args.iters)
        return {"ms": ms, "effective_tbps": ideal_bytes / ms / 1e9}

    res["torch_eager"] = timed(lambda: quantize_v(v, DEFAULT_OPTIONS))
    why = triton_unsupported(q, k, v)
    if why and not (not on_gpu() and triton_interpreted()):
        res["triton"] = {"skipped": why}
        return
    for lp in (TritonQuantLaunch.tuned(v.device), *QUANT_LAUNCHES):
        got = quantize_v_triton(v, DEFAULT_OPTIONS, lp)
        steps = e4m3_steps(ref[0], got[0])
        res[quant_label(lp)] = {**timed(lambda: quantize_v_triton(v, DEFAULT_OPTIONS, lp)),
                                "max_e4m3_steps": int(steps.max()),
                                "share_differing": int((steps > 0).sum()) / v.numel(),
                                "max_scale_rel_diff": ((ref[1] - got[1]).abs().max() / ref[1].abs().max()).item()}
    log(f"V alone, {DEFAULT_OPTIONS.label}: {json.dumps(res)}")


def print_tables(result: dict) -> None:
    def cell(r, fmt_keys):
        return " / ".join("-" if r.get(k) is None else format(r[k], f) for k, f in fmt_keys) if r else "failed"

    for key, row in result["shapes"].items():
        if row.get("quant"):
            print(f"\n{key} (S={row['S']}): the q/k/v quantisation alone, ms / effective TB/s (Triton: launch "
                  "stats_rows/stats_block_r/stats_warps/quant_block_r/quant_warps; max e4m3 steps and share of "
                  "elements differing from quantize_qkv)")
            print("| option | quantiser | ms | TB/s | max steps | share differing | scale rel diff |")
            print("|---|---|---|---|---|---|---|")
            for name, res in row["quant"].items():
                for impl, r in res.items():
                    if "ms" not in r:
                        print(f"| {name} | {impl} | {r} | | | | |")
                        continue
                    dev = ([str(r["max_e4m3_steps"]), f"{r['share_differing']:.1e}", f"{r['max_scale_rel_diff']:.1e}"]
                           if "max_e4m3_steps" in r else ["", "", ""])
                    print(f"| {name} | {impl} | {r['ms']:.3f} | {r['effective_tbps']:.2f} | " + " | ".join(dev) + " |")
        if "op" not in row and "forward" not in row:
            continue
        print(f"\n{key} (S={row['S']}): op level, [1, heads, S, head_dim]")
        print("| data | bf16 cuDNN ms / err | fp8 kernel ms | " + " | ".join(
            f"{n} err / ms eager{' / ms compiled' if n in COMPILED_OPTIONS else ''}" for n in OPTIONS) + " |")
        print("|---" * (3 + len(OPTIONS)) + "|")
        for data, res in row.get("op", {}).items():
            cells = [cell(res.get("cudnn_bf16"), [("ms", ".2f"), ("rel_err", ".1e")]),
                     cell(res.get("fp8_kernel_only"), [("ms", ".2f")])]
            for n in OPTIONS:
                keys = [("rel_err", ".2e"), ("ms_eager_quant", ".2f")]
                if n in COMPILED_OPTIONS:
                    keys.append(("ms_compiled_quant", ".2f"))
                cells.append(cell(res.get(n), keys))
            print(f"| {data} | " + " | ".join(cells) + " |")
        if row.get("forward"):
            print(f"\n{key}: full forward (eager, fp8 linears), velocity rel err vs bf16 cuDNN attention")
            print("| attention | s/step | err video | err audio |")
            print("|---|---|---|---|")
            for n, r in row["forward"].items():
                print(f"| {n} | {r['ms'] / 1e3:.3f} | {r.get('velocity_rel_err_video', 0):.2e} | "
                      f"{r.get('velocity_rel_err_audio', 0):.2e} |")


def main() -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--shapes", default="832x480x124,1344x768x124", help="WxHxF list (t2va, L = 38)")
    ap.add_argument("--layers", type=int, default=50, help="DiT blocks in the full-forward part (0: skip it)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per op measurement (median)")
    ap.add_argument("--chunk-rows", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="only the self-check (< 1 min)")
    ap.add_argument("--quant", action="store_true", help="only the q/k/v quantisers (step 4; no cuDNN needed)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, small shapes, emulated kernel")
    args = ap.parse_args()
    versions: dict = {}
    if args.tiny:
        DEV = torch.device("cpu")
        if args.shapes == ap.get_default("shapes"):
            args.shapes = TINY_SHAPES
        args.iters = min(args.iters, 2)
        cfg = DiTConfig.tiny()
    else:
        if not torch.cuda.is_available():
            print("bench_attention.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
            return 2
        why = None if args.quant else unavailable(DEV)
        if why:
            print(f"fp8 attention is unavailable here: {why}", file=sys.stderr)
            return 2
        if not args.quant:
            import cudnn

            versions = {"cudnn_backend": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__,
                        "cudnn_torch": torch.backends.cudnn.version()}
        cfg = DiTConfig.full(num_layers=max(1, args.layers))
    # Every option x shape is its own compiled quantiser; the default limit (8) would silently fall back to eager.
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    result: dict = {"device": torch.cuda.get_device_name() if on_gpu() else "cpu (--tiny)", "torch": torch.__version__,
                    **versions, "options": {n: o.__dict__ for n, o in OPTIONS.items()},
                    "default": DEFAULT_OPTIONS.label,
                    "layers": args.layers, "failures": [], "shapes": {}}
    failures = result["failures"]
    path = out / ("check.json" if args.check else "quant.json" if args.quant else "attention.json")

    def save():
        path.write_text(json.dumps(result, indent=1, default=str))

    t0 = time.time()
    if args.quant:
        guarded(failures, "quantisers", quantizers, args, cfg, shapes, result["shapes"], failures)
    else:
        s_small = build_layout(cfg, TEXT_LEN, shapes[0][2], shapes[0][1], shapes[0][0]).seq_len
        result["self_check"] = self_check(s_small, cfg.num_heads, cfg.head_dim, failures)
        save()
        if not args.check:
            captured = {}
            if args.layers > 0:
                captured = guarded(failures, "full forward", full_forward, args, cfg, shapes, result["shapes"],
                                   failures) or {}
                save()
            for i, shape in enumerate(shapes):
                key = "x".join(map(str, shape))
                s = build_layout(cfg, TEXT_LEN, shape[2], shape[1], shape[0]).seq_len
                row = result["shapes"].setdefault(key, {"S": s})
                data = {"random": random_data(s, cfg.num_heads, cfg.head_dim, seed=1 + i),
                        "synthetic": synthetic_data(s, cfg.num_heads, cfg.head_dim, seed=2 + i)}
                for j, qkv in enumerate(captured.get(key, [])):
                    data[f"model_block{j}"] = qkv
                guarded(failures, f"{key} op level", op_level, args, data, row, failures)
                del data
                captured.pop(key, None)
                empty_cache()
                save()
    result["wall_s"] = time.time() - t0
    save()
    guarded(failures, "printing the tables", print_tables, result)
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
