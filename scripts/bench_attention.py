"""8-bit attention on one GPU: op-level error and speed of each fp8 option, and the DiT's velocity error with it.

    python scripts/bench_attention.py --out $OUT                 # full run (one H200: a few minutes)
    python scripts/bench_attention.py --check --out $OUT         # GPU self-check only (< 1 min), exit 1 on failure
    python scripts/bench_attention.py --layers 2 --out $OUT      # smoke (same code, 2 blocks)

Options compared (stagekit/fp8_attention.py): `naive` (q, k, v per tensor), `head` (V / O per head), `head+k`
(+ K mean subtraction), `head+kv` (+ V mean subtraction; the registry's default). Every option feeds the same cuDNN
fp8 SDPA kernel (e4m3 q/k/v/P/O on Hopper).

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

Writes <out>/attention.json (or check.json) and prints tables. Exit 1 if a self-check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_dit import T_AUDIO, T_VIDEO, TEXT_LEN, build_ours, inputs_for, install_linears, parse_shape  # noqa: E402
from dit_svc.config import DiTConfig  # noqa: E402
from dit_svc.layout import build_layout  # noqa: E402
from stagekit.fp8_attention import (  # noqa: E402
    _CUDNN,
    DEFAULT_OPTIONS,
    E4M3_MAX,
    OPTIONS,
    Fp8Attention,
    dequantize_o,
    quantize_qkv,
    sdpa_fp8,
    sdpa_fp8_emulated,
    unavailable,
)
from stagekit.kernels import KernelConfig, default_attention_candidates, rel_err, select_kernels, time_ms  # noqa: E402

CUDA = torch.device("cuda")
COMPILED_OPTIONS = ("naive", "head+kv")
CHECK_MAX_KERNEL_VS_EMULATION = 3e-2  # same arithmetic; P~ rounds against a blockwise row max in the kernel


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fp32_reference(q, k, v) -> torch.Tensor:
    """fp32 attention without the S x S matrix (memory-efficient SDPA in fp32; math per head as a fallback)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qf, kf, vf = q.float(), k.float(), v.float()
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(qf, kf, vf)
    except RuntimeError:
        return torch.cat([F.scaled_dot_product_attention(qf[:, h:h + 1], kf[:, h:h + 1], vf[:, h:h + 1])
                          for h in range(q.shape[1])], dim=1)


def random_data(s: int, h: int, d: int, seed: int):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g, device=CUDA).to(torch.bfloat16) for _ in range(3)]


def synthetic_data(s: int, h: int, d: int, seed: int):
    """DiT-shaped (not real) activations: RMSNorm'd q/k with a gain and a component shared across tokens (peaked
    attention), a per-(head, channel) key offset; V with channel means and head scales spanning 100x."""
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def n(*shape):
        return torch.randn(*shape, generator=g, device=CUDA)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    gain = 1.0 + 0.5 * n(d)
    shared = n(1, 1, s, d)
    q = rms(n(1, h, s, d) + 1.5 * shared) * gain * 2.0
    k = rms(n(1, h, s, d) + 1.5 * shared + 2.0 * n(1, h, 1, d)) * gain * 2.0
    v = (n(1, h, s, d) + 3.0 * n(1, h, 1, d)) * torch.logspace(-1, 1, h, device=CUDA).view(1, h, 1, 1)
    return [t.to(torch.bfloat16) for t in (q, k, v)]


def per_head_descale_probe(q, k, v, ref) -> dict:
    """Does cuDNN accept (and honour) per-head Q/K descales? q/k quantised per head, descales [H]."""
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
    p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)
    o8 = sdpa_fp8(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)
    heads = slice(0, 2)  # the emulation materialises [heads, S, S] fp32
    emu = sdpa_fp8_emulated(p.q8[heads], p.k8[heads], p.v8[heads], p.descale_q, p.descale_k)
    out["kernel_vs_emulation_rel_err"] = rel_err(o8[heads].float(), emu.float())
    out["o8_finite"] = bool(torch.isfinite(o8.float()).all())
    ref = fp32_reference(q, k, v)
    o = Fp8Attention(DEFAULT_OPTIONS)(q, k, v)
    out["default_vs_fp32_rel_err"] = rel_err(o, ref)
    if not out["o8_finite"] or not out["kernel_vs_emulation_rel_err"] <= CHECK_MAX_KERNEL_VS_EMULATION:
        failures.append(f"cuDNN fp8 kernel vs emulation: {out['kernel_vs_emulation_rel_err']:.3e} "
                        f"(bound {CHECK_MAX_KERNEL_VS_EMULATION}); finite {out['o8_finite']}")
    try:
        sel = select_kernels(CUDA, KernelConfig(linear_kernel="bf16", attention_kernel="fp8"))
        out["forced_probe"] = sel.status_rows()[1]
    except Exception as e:
        out["forced_probe"] = f"{type(e).__name__}: {e}"
        failures.append(f"forced fp8 probe failed: {e}")
    auto = select_kernels(CUDA, KernelConfig(linear_kernel="bf16"))
    out["auto_probe"] = auto.status_rows()[1]
    out["per_head_descales"] = per_head_descale_probe(q, k, v, ref)
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


def full_forward(args, cfg: DiTConfig, shapes, result: dict) -> dict:
    """Velocity error of each option vs bf16 cuDNN attention on the same model; returns captured q/k/v by shape."""
    model, master = build_ours(cfg, args.seed, CUDA, args.chunk_rows)
    install_linears(model, master, "fp8")
    del master
    gc.collect()
    torch.cuda.empty_cache()
    model.eval()
    cudnn_fn = default_attention_candidates()["cudnn"].make_fn()
    captured = {}
    first_block = cfg.num_refiner_layers
    keep = {first_block, first_block + cfg.num_layers // 2}
    for shape in shapes:
        key = "x".join(map(str, shape))
        lay, video, audio, text = inputs_for(cfg, shape, CUDA)
        tv, ta = (torch.tensor(t, device=CUDA) for t in (T_VIDEO, T_AUDIO))
        row = result.setdefault(key, {"S": lay.seq_len, "forward": {}})

        def run(fn, iters=1):
            model.set_attention_fn(fn)
            box = {}
            with torch.inference_mode():
                model(video, audio, text, tv, ta, lay)  # warm-up (plans, compiles)
                ms = time_ms(lambda: box.__setitem__("o", model(video, audio, text, tv, ta, lay)), CUDA, iters, 0)
            return ms, box["o"]

        rec = Recorder(cudnn_fn, keep)
        model.set_attention_fn(rec)
        with torch.inference_mode():
            model(video, audio, text, tv, ta, lay)
        captured[key] = [rec.saved[i] for i in sorted(rec.saved)]
        ms, (rv, ra) = run(cudnn_fn)
        row["forward"]["cudnn_bf16"] = {"ms": ms}
        log(f"{key}: forward with bf16 cuDNN attention {ms / 1e3:.3f} s/step (eager)")
        for name, opt in OPTIONS.items():
            ms, (ov, oa) = run(Fp8Attention(opt, compile_quant=True))
            ok = bool(torch.isfinite(ov).all() and torch.isfinite(oa).all())
            row["forward"][name] = {"ms": ms, "finite": ok, "velocity_rel_err_video": rel_err(ov, rv),
                                    "velocity_rel_err_audio": rel_err(oa, ra)}
            log(f"{key}: forward fp8 {name}: {ms / 1e3:.3f} s/step, velocity err video "
                f"{row['forward'][name]['velocity_rel_err_video']:.3e} audio "
                f"{row['forward'][name]['velocity_rel_err_audio']:.3e}")
            if not ok:
                result.setdefault("failures", []).append(f"{key} forward fp8 {name}: non-finite velocity")
        del lay, video, audio, text, rv, ra, ov, oa
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return captured


# =====================================================================================================================
# 3. Op level
# =====================================================================================================================


def op_level(args, data_sets: dict, row: dict) -> None:
    cudnn_fn = default_attention_candidates()["cudnn"].make_fn()
    compiled = {n: Fp8Attention(OPTIONS[n], compile_quant=True) for n in COMPILED_OPTIONS}
    for data_name, (q, k, v) in data_sets.items():
        s = q.shape[2]
        flops = 4.0 * s * s * q.shape[1] * q.shape[3]
        ref = fp32_reference(q, k, v)
        res = row.setdefault("op", {}).setdefault(data_name, {})
        ms = time_ms(lambda: cudnn_fn(q, k, v), CUDA, args.iters)
        res["cudnn_bf16"] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": rel_err(cudnn_fn(q, k, v), ref)}
        p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)
        ms = time_ms(lambda: sdpa_fp8(p.q8, p.k8, p.v8, p.descale_q, p.descale_k), CUDA, args.iters)
        res["fp8_kernel_only"] = {"ms": ms, "tflops": flops / ms / 1e9}
        for name, opt in OPTIONS.items():
            fn = Fp8Attention(opt)
            r = res[name] = {"rel_err": rel_err(fn(q, k, v), ref), "ms_eager_quant": time_ms(lambda: fn(q, k, v),
                                                                                              CUDA, args.iters)}
            if name in compiled:
                cfn = compiled[name]
                o = cfn(q, k, v)  # compiles (first shape) / recompiles dynamic (second)
                r["compiled_vs_eager_rel_diff"] = rel_err(o, fn(q, k, v))
                r["ms_compiled_quant"] = time_ms(lambda: cfn(q, k, v), CUDA, args.iters)
        res["per_head_descales"] = per_head_descale_probe(q, k, v, ref)
        log(f"S={s} {data_name}: " + json.dumps({n: {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                                                     for kk, vv in r.items()} for n, r in res.items()}, default=str))
        del ref, p
        torch.cuda.empty_cache()


def print_tables(result: dict) -> None:
    for key, row in result["shapes"].items():
        print(f"\n{key} (S={row['S']}): op level, [1, 56, S, 128]")
        print("| data | bf16 cuDNN ms (err) | fp8 kernel ms | " + " | ".join(
            f"{n} err / ms eager{' / ms compiled' if n in COMPILED_OPTIONS else ''}" for n in OPTIONS) + " |")
        print("|---" * (3 + len(OPTIONS)) + "|")
        for data, res in row.get("op", {}).items():
            cells = [f"{res['cudnn_bf16']['ms']:.2f} ({res['cudnn_bf16']['rel_err']:.1e})",
                     f"{res['fp8_kernel_only']['ms']:.2f}"]
            for n in OPTIONS:
                r = res[n]
                c = f"{r['rel_err']:.2e} / {r['ms_eager_quant']:.2f}"
                if "ms_compiled_quant" in r:
                    c += f" / {r['ms_compiled_quant']:.2f}"
                cells.append(c)
            print(f"| {data} | " + " | ".join(cells) + " |")
        if row.get("forward"):
            print(f"\n{key}: full forward (eager, fp8 linears), velocity rel err vs bf16 cuDNN attention")
            print("| attention | s/step | err video | err audio |")
            print("|---|---|---|---|")
            for n, r in row["forward"].items():
                print(f"| {n} | {r['ms'] / 1e3:.3f} | {r.get('velocity_rel_err_video', 0):.2e} | "
                      f"{r.get('velocity_rel_err_audio', 0):.2e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--shapes", default="832x480x124,1344x768x124", help="WxHxF list (t2va, L = 38)")
    ap.add_argument("--layers", type=int, default=50, help="DiT blocks in the full-forward part (0: skip it)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per op measurement (median)")
    ap.add_argument("--chunk-rows", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="only the self-check (< 1 min)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    why = unavailable(CUDA)
    if why:
        print(f"fp8 attention is unavailable here: {why}", file=sys.stderr)
        return 2
    import cudnn

    # Every option x shape is its own compiled quantiser; the default limit (8) would silently fall back to eager.
    torch._dynamo.config.cache_size_limit = 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DiTConfig.full(num_layers=max(1, args.layers))
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn_backend": cudnn.backend_version(), "cudnn_frontend": getattr(cudnn, "__version__", "?"),
                    "options": {n: o.__dict__ for n, o in OPTIONS.items()}, "default": DEFAULT_OPTIONS.label,
                    "layers": args.layers, "failures": [], "shapes": {}}
    path = out / ("check.json" if args.check else "attention.json")

    def save():
        path.write_text(json.dumps(result, indent=1, default=str))

    t0 = time.time()
    s_small = build_layout(cfg, TEXT_LEN, shapes[0][2], shapes[0][1], shapes[0][0]).seq_len
    result["self_check"] = self_check(s_small, cfg.num_heads, cfg.head_dim, result["failures"])
    save()
    if not args.check:
        captured = {}
        if args.layers > 0:
            captured = full_forward(args, cfg, shapes, result["shapes"])
            save()
        for i, shape in enumerate(shapes):
            key = "x".join(map(str, shape))
            s = build_layout(cfg, TEXT_LEN, shape[2], shape[1], shape[0]).seq_len
            row = result["shapes"].setdefault(key, {"S": s})
            data = {"random": random_data(s, cfg.num_heads, cfg.head_dim, seed=1 + i),
                    "synthetic": synthetic_data(s, cfg.num_heads, cfg.head_dim, seed=2 + i)}
            for j, qkv in enumerate(captured.get(key, [])):
                data[f"model_block{j}"] = qkv
            op_level(args, data, row)
            del data
            captured.pop(key, None)
            torch.cuda.empty_cache()
            save()
    result["wall_s"] = time.time() - t0
    save()
    print_tables(result)
    if result["failures"]:
        print("FAILURES:\n  " + "\n  ".join(result["failures"]), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
