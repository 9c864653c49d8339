"""LoRA (minimax_h3/dit/lora.py): dialect parsing, unmerged application on dense and int8 bases, TP2 over gloo in real
spawned processes == TP1 with the LoRAs merged into fp32 weights, caching without touching base weights, errors."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import from_diffusers, to_diffusers
from minimax_h3.dit.lora import (LoRAFileError, LoRALinear, LoRAManager, LoRAMethod, LocalAdapter, check_lora_file,
                                 config_targets, load_lora_file, merge_loras, model_targets, parse_lora_state_dict,
                                 resolve_lora_path)
from minimax_h3.dit.model import H3DiT, RMSNorm, curve_state_dict_from_mlp
from minimax_h3.dit.ops import modulate, swiglu
from minimax_h3.dit.tp import Linear, shard_state_dict
from minimax_h3.kernels.fp8_attention import Fp8O
from minimax_h3.kernels.int8 import Int8ConvRotLinear, dequantize_convrot
from minimax_h3.kernels.layers import PLAIN, LinearMethod, Modulation, Residual, linear_method, o_rows
from minimax_h3.kernels.registry import Fp8RowwiseLinear
from stagekit.errors import FailedPrecondition, InvalidArgument, NotFound
from stagekit.checkpoints import WeightSource
from tests.dit_ranks import assert_matches_one_rank, forward, rel, tiny_case
from tests.ranks import run_ranks

TP_RTOL = 1e-5
STRENGTHS = (0.7, -0.3)
INT8_RTOL = 3e-2  # int8 activations in kernel mode (test_quant measures ~1.1e-2 per linear on CPU)


def _cfg() -> DiTConfig:
    return DiTConfig.tiny(num_layers=2, num_refiner_layers=1)


def _ab(g, r, n_in, n_out, amp=0.2):
    return torch.randn(r, n_in, generator=g) * amp, torch.randn(n_out, r, generator=g) * amp


def _comfy_lora(cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """LoRA 1: ComfyUI dialect (`diffusion_model.` prefix, lora_A/lora_B, alpha) on every kind of linear,
    column-parallel, row-parallel, AdaLN (sharded rows) and replicated ones (incl. the time embedder)."""
    g = torch.Generator().manual_seed(10)
    r, alpha = 4, 2.0
    shapes = {"condition_proj": (cfg.text_dim, cfg.hidden), "time_embedder.proj_in": (cfg.freq_dim,
              cfg.time_embed_hidden), "final_layer.adaln_proj.linear": (cfg.adaln_in, cfg.final_adaln_out),
              "final_layer.video_out": (cfg.hidden, cfg.video_patch_dim)}
    for blk in ("blocks.0", "blocks.1", "token_refiner.blocks.0"):
        shapes[f"{blk}.attn.qkv_proj"] = (cfg.hidden, 3 * cfg.attn_inner)
        shapes[f"{blk}.attn.out_proj"] = (cfg.attn_inner, cfg.hidden)
        shapes[f"{blk}.mlp.fc1"] = (cfg.hidden, 2 * cfg.ffn)
        shapes[f"{blk}.mlp.fc2"] = (cfg.ffn, cfg.hidden)
    shapes["blocks.1.adaln_proj.linear"] = (cfg.adaln_in, cfg.adaln_out)
    sd = {}
    for name, (n_in, n_out) in shapes.items():
        a, b = _ab(g, r, n_in, n_out)
        sd[f"diffusion_model.{name}.lora_A.weight"] = a
        sd[f"diffusion_model.{name}.lora_B.weight"] = b
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha)
    return sd


def _diffusers_lora(cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """LoRA 2: PEFT dialect on diffusers names: separate to_q/to_k/to_v, to_out.0, ff.net.0.proj ([value; gate]
    rows), ff.net.2, the final AdaLN (norm_out.linear) and a refiner block; no alpha (scale 1)."""
    g = torch.Generator().manual_seed(20)
    r = 3
    shapes = {"norm_out.linear": (cfg.adaln_in, cfg.final_adaln_out), "proj_in": (cfg.video_patch_dim, cfg.hidden)}
    for blk in ("transformer_blocks.0", "transformer_blocks.1", "token_refiner.refiner_blocks.0"):
        for part in ("to_q", "to_k", "to_v"):
            shapes[f"{blk}.attn.{part}"] = (cfg.hidden, cfg.attn_inner)
        shapes[f"{blk}.attn.to_out.0"] = (cfg.attn_inner, cfg.hidden)
        shapes[f"{blk}.ff.net.0.proj"] = (cfg.hidden, 2 * cfg.ffn)
        shapes[f"{blk}.ff.net.2"] = (cfg.ffn, cfg.hidden)
    del shapes["transformer_blocks.1.attn.to_k"]  # a partial q/k/v LoRA (only to_q and to_v) must work too
    sd = {}
    for name, (n_in, n_out) in shapes.items():
        a, b = _ab(g, r, n_in, n_out)
        sd[f"base_model.model.{name}.lora_A.default.weight"] = a
        sd[f"base_model.model.{name}.lora_B.default.weight"] = b
    return sd


def _write(d: str, name: str, sd: dict) -> str:
    path = os.path.join(d, name)
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    return path


# ---- TP2 over gloo (real processes) == TP1 merged ------------------------------------------------------------------
def _lora_rank(rank: int, world: int, d: str) -> dict:
    group = dist.new_group(list(range(world)))
    cfg, sd, lay, x = tiny_case()
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=group).eval()
    model.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
    ptrs = {k: (v.data_ptr(), id(v)) for k, v in model.state_dict(keep_vars=True).items()}
    keys = list(model.state_dict())
    base = forward(model, lay, x)
    mgr = LoRAManager(model)
    p1, p2 = os.path.join(d, "a.safetensors"), os.path.join(d, "b.safetensors")
    both = [(p1, STRENGTHS[0]), (p2, STRENGTHS[1])]
    mgr.activate(both)
    out = forward(model, lay, x)
    wrapped_keys = list(model.state_dict())
    mgr.activate([(p1, 1.0)])  # another set: cached file, no disk read, no base reload
    other = forward(model, lay, x)
    mgr.activate(both)
    again = forward(model, lay, x)
    loads = mgr.loads
    mgr.clear()
    cleared = forward(model, lay, x)
    ptrs_after = {k: (v.data_ptr(), id(v)) for k, v in model.state_dict(keep_vars=True).items()}
    return dict(base=base, out=out, other=other, again=again, cleared=cleared, loads=loads,
                same_ptrs=ptrs == ptrs_after, same_keys=keys == wrapped_keys)


def test_tp2_unmerged_equals_tp1_merged(tmp_path):
    cfg, sd, lay, x = tiny_case()
    p1 = _write(str(tmp_path), "a.safetensors", _comfy_lora(cfg))
    p2 = _write(str(tmp_path), "b.safetensors", _diffusers_lora(cfg))
    outs = run_ranks(_lora_rank, 2, str(tmp_path))
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    targets = model_targets(ref)
    loras = [(load_lora_file(p1, targets), STRENGTHS[0]), (load_lora_file(p2, targets), STRENGTHS[1])]
    ref.load_state_dict(merge_loras(sd, targets, loras))
    rv, ra = forward(ref, lay, x)
    ref.load_state_dict(merge_loras(sd, targets, [(loras[0][0], 1.0)]))
    ov, oa = forward(ref, lay, x)
    o = outs[0]
    assert_matches_one_rank([r["out"] for r in outs], (rv, ra), TP_RTOL, "TP2 unmerged vs TP1 merged (0.7, -0.3)")
    effect = rel(o["base"][0], rv)
    print(f"LoRA effect on video {effect:.3e}")
    assert effect > 1e-2  # the LoRAs really change the output
    assert rel(o["other"][0], ov) <= TP_RTOL and rel(o["other"][1], oa) <= TP_RTOL
    assert all(torch.equal(a, b) for a, b in zip(o["again"], o["out"]))
    assert all(torch.equal(a, b) for a, b in zip(o["cleared"], o["base"]))
    assert o["loads"] == 2  # both files read once; switching sets reused the per-rank cache
    assert o["same_ptrs"] and o["same_keys"]  # base tensors untouched, state-dict keys unchanged while wrapped


# ---- dialects -------------------------------------------------------------------------------------------------------
def _ours_lora(cfg, g):
    out = {}
    for name, (n_in, n_out) in {"blocks.0.attn.qkv_proj": (cfg.hidden, 3 * cfg.attn_inner),
                                "blocks.1.mlp.fc2": (cfg.ffn, cfg.hidden),
                                "token_refiner.blocks.0.mlp.fc1": (cfg.hidden, 2 * cfg.ffn),
                                "final_layer.audio_out": (cfg.hidden, cfg.audio_in_channels)}.items():
        out[name] = _ab(g, 2, n_in, n_out)
    return out


def _deltas(lw, targets):
    return {n: lw.delta(targets[n]) for n in lw.parts}


def test_dialects_parse_to_the_same_deltas(tmp_path):
    cfg = _cfg()
    targets = config_targets(cfg)
    base = _ours_lora(cfg, torch.Generator().manual_seed(3))
    alpha = 1.0  # rank 2 -> scale 0.5

    def fmt(prefix, a_suf, b_suf, kohya=False, with_alpha=True):
        sd = {}
        for name, (a, b) in base.items():
            mod = prefix + (name.replace(".", "_") if kohya else name)
            sd[mod + a_suf], sd[mod + b_suf] = a, b
            if with_alpha:
                sd[mod + ".alpha"] = torch.tensor(alpha)
        return sd

    dialects = {
        "comfy": fmt("diffusion_model.", ".lora_A.weight", ".lora_B.weight"),
        "comfy_full_prefix_down_up": fmt("model.diffusion_model.", ".lora_down.weight", ".lora_up.weight"),
        "kohya": fmt("lora_unet_", ".lora_down.weight", ".lora_up.weight", kohya=True),
        "unprefixed": fmt("", ".lora_A.weight", ".lora_B.weight"),
    }
    ref = None
    for name, sd in dialects.items():
        lw = parse_lora_state_dict(sd, targets, source=name)
        d = _deltas(lw, targets)
        assert set(d) == set(base), name
        ref = ref or d
        for k in base:
            torch.testing.assert_close(d[k], ref[k], rtol=0, atol=0)
    a, b = base["blocks.1.mlp.fc2"]
    torch.testing.assert_close(ref["blocks.1.mlp.fc2"], 0.5 * b @ a)
    # PEFT (alpha from adapter_config.json next to adapter_model.safetensors), with and without the adapter name
    for suffix in (".default.weight", ".weight"):
        d = tmp_path / suffix.strip(".")
        d.mkdir()
        sd = fmt("base_model.model.", ".lora_A" + suffix, ".lora_B" + suffix, with_alpha=False)
        path = _write(str(d), "adapter_model.safetensors", sd)
        no_cfg = _deltas(load_lora_file(path, targets), targets)
        torch.testing.assert_close(no_cfg["blocks.1.mlp.fc2"], b @ a)  # no alpha anywhere -> scale 1
        (d / "adapter_config.json").write_text(json.dumps({"lora_alpha": 1, "r": 2}))
        with_cfg = _deltas(load_lora_file(path, targets), targets)
        for k in base:
            torch.testing.assert_close(with_cfg[k], ref[k], rtol=0, atol=0)
        assert check_lora_file(path, targets) == len(base)
        (d / "adapter_config.json").write_text(json.dumps({"lora_alpha": 1, "r": 2, "use_rslora": True}))
        rs = _deltas(load_lora_file(path, targets), targets)
        torch.testing.assert_close(rs["blocks.1.mlp.fc2"], b @ a / 2 ** 0.5)  # rsLoRA: alpha / sqrt(rank)


def test_diffusers_names_match_the_converter(tmp_path):
    """Oracle: add B A to the diffusers-named weights and convert back with minimax_h3/dit/convert_diffusers.py; our
    merge of the same LoRA (to_q/to_k/to_v -> qkv thirds, ff.net.0.proj -> fc1 halves swapped) must agree."""
    cfg, sd, _, _ = tiny_case()
    targets = config_targets(cfg)
    lora = _diffusers_lora(cfg)
    lora["base_model.model.transformer_blocks.1.attn.to_qkv.lora_A.default.weight"] = torch.randn(2, cfg.hidden)
    lora["base_model.model.transformer_blocks.1.attn.to_qkv.lora_B.default.weight"] = torch.randn(
        3 * cfg.attn_inner, 2)
    dsd = {k: v.clone() for k, v in to_diffusers(sd).items()}
    dsd["transformer_blocks.1.attn.to_qkv.weight"] = torch.zeros(3 * cfg.attn_inner, cfg.hidden)
    strength = -0.45
    for key in lora:
        if ".lora_A." in key:
            mod = key[len("base_model.model."):-len(".lora_A.default.weight")]
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            dsd[mod + ".weight"] = dsd[mod + ".weight"] + strength * b @ lora[key]
    fused = dsd.pop("transformer_blocks.1.attn.to_qkv.weight")
    for i, part in enumerate(("to_q", "to_k", "to_v")):  # fold the fused-qkv LoRA back into the split weights
        dsd[f"transformer_blocks.1.attn.{part}.weight"] += fused.chunk(3)[i]
    want = from_diffusers(dsd)
    got = merge_loras(sd, targets, [(parse_lora_state_dict(lora, targets), strength)])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    changed = [k for k in want if not torch.equal(want[k], sd[k])]
    assert "blocks.0.mlp.fc1.weight" in changed and "blocks.1.attn.qkv_proj.weight" in changed
    assert "final_layer.adaln_proj.linear.weight" in changed and "video_patch_proj.weight" in changed


def test_errors_list_the_offending_keys(tmp_path):
    cfg = _cfg()
    targets = config_targets(cfg)
    a, b = torch.randn(2, cfg.hidden), torch.randn(3 * cfg.attn_inner, 2)
    sd = {"diffusion_model.blocks.7.attn.qkv_proj.lora_A.weight": a,  # tiny has 2 blocks
          "diffusion_model.blocks.7.attn.qkv_proj.lora_B.weight": b,
          "diffusion_model.vae.conv.lora_A.weight": a, "diffusion_model.vae.conv.lora_B.weight": b,
          "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": a,
          "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": b}
    with pytest.raises(LoRAFileError, match=r"2 module\(s\) match no linear.*blocks\.7\.attn\.qkv_proj.*vae\.conv"):
        parse_lora_state_dict(sd, targets)
    with pytest.raises(LoRAFileError, match=r"neither LoRA A/B/alpha factors nor diff / diff_b patches.*dora_scale"):
        parse_lora_state_dict({"blocks.0.attn.qkv_proj.dora_scale": torch.ones(1)}, targets)
    with pytest.raises(LoRAFileError, match=r"lack their A \(down\) or B \(up\).*blocks\.0\.mlp\.fc2"):
        parse_lora_state_dict({"blocks.0.mlp.fc2.lora_down.weight": torch.randn(2, cfg.ffn)}, targets)
    with pytest.raises(LoRAFileError, match=r"shapes that do not fit.*blocks\.0\.mlp\.fc2"):
        parse_lora_state_dict({"blocks.0.mlp.fc2.lora_A.weight": torch.randn(2, cfg.hidden),
                               "blocks.0.mlp.fc2.lora_B.weight": torch.randn(cfg.hidden, 2)}, targets)
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAFileError, match="not a readable safetensors"):
        check_lora_file(bad, targets)


def test_curve_form_rejects_timestep_modulation_loras():
    cfg, sd, lay, x = tiny_case()
    csd, ccfg = curve_state_dict_from_mlp(sd, cfg)
    model = H3DiT(ccfg, compute_dtype=torch.float32).eval()
    model.load_state_dict(csd)
    targets = model_targets(model)
    g = torch.Generator().manual_seed(5)
    qkv = dict(zip(("diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight",
                    "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight"), _ab(g, 2, cfg.hidden, 3 * cfg.attn_inner)))
    for extra in ({"diffusion_model.blocks.1.adaln_proj.linear.lora_A.weight": torch.randn(2, cfg.time_embed_dim),
                   "diffusion_model.blocks.1.adaln_proj.linear.lora_B.weight": torch.randn(cfg.adaln_out, 2)},
                  {"lora_unet_time_embedder_proj_in.lora_down.weight": torch.randn(2, cfg.freq_dim),
                   "lora_unet_time_embedder_proj_in.lora_up.weight": torch.randn(cfg.time_embed_hidden, 2)},
                  {"transformer.norm_out.linear.lora_A.weight": torch.randn(2, cfg.time_embed_dim),
                   "transformer.norm_out.linear.lora_B.weight": torch.randn(cfg.final_adaln_out, 2)}):
        with pytest.raises(LoRAFileError, match=r"timestep modulation.*curve-form.*unpruned checkpoint"):
            parse_lora_state_dict({**qkv, **extra}, targets, adaln_form=ccfg.adaln_form)
    # the same LoRA without the modulation part is fine on the curve model
    lw = parse_lora_state_dict(qkv, targets, adaln_form="curve")
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "q.safetensors", qkv)
        mgr = LoRAManager(model)
        mgr.activate([(p, 0.5)])
        out = forward(model, lay, x)
    model2 = H3DiT(ccfg, compute_dtype=torch.float32).eval()
    model2.load_state_dict(merge_loras(csd, targets, [(lw, 0.5)]))
    ref = forward(model2, lay, x)
    assert rel(out[0], ref[0]) <= TP_RTOL and rel(out[1], ref[1]) <= TP_RTOL


# ---- int8 bases -----------------------------------------------------------------------------------------------------
def test_int8_base_plus_lora_equals_dequantised_base_plus_lora():
    torch.manual_seed(0)
    n_in, n_out, g = 256, 96, 64
    w = torch.randn(n_out, n_in) * 0.05
    x = torch.randn(40, n_in)
    a, b = torch.randn(4, n_in) * 0.1, torch.randn(n_out, 4) * 0.1
    adapters = [LocalAdapter(a, b, 0.8, 0, n_out), LocalAdapter(a.flip(0), b[:32], -0.3, 32, 64)]
    for mode in ("dequant", "kernel"):
        q = Int8ConvRotLinear.from_float(w, None, groupsize=g, mode=mode, compute_dtype=torch.float32)
        dense = Linear(n_in, n_out, bias=False, compute_dtype=torch.float32)
        with torch.no_grad():
            dense.weight.copy_(dequantize_convrot(q.weight, q.weight_scale, g, torch.float32))
        ptr = q.weight.data_ptr()
        wq, wd = LoRALinear(q, adapters), LoRALinear(dense, adapters)
        with torch.no_grad():
            yq, yd, base_q = wq(x), wd(x), q(x)
        lora_only = 0.8 * (x @ a.T) @ b.T
        lora_only[:, 32:64] += -0.3 * (x @ a.flip(0).T) @ b[:32].T
        err, delta_err = rel(yq, yd), rel(yq - base_q, lora_only)
        print(f"int8 {mode}: (int8 + LoRA) vs (dequantised + LoRA) rel {err:.3e}; LoRA term rel {delta_err:.3e}")
        assert err <= (1e-6 if mode == "dequant" else INT8_RTOL)
        assert delta_err <= 1e-6  # the LoRA term itself is exact on top of the int8 GEMM
        assert q.weight.data_ptr() == ptr and q.weight.dtype == torch.int8
        assert set(wq.state_dict()) == {"weight", "weight_scale"}


def test_int8_model_with_lora_manager():
    """Block linears as int8 ConvRot (g64) modules in a tiny model; LoRAs via the manager == merged dequantised."""
    cfg, sd, lay, x = tiny_case()
    model = H3DiT(cfg, compute_dtype=torch.float32).eval()
    model.load_state_dict(sd)
    dq = dict(sd)
    for name in model_targets(model):
        if name.startswith("blocks.") and not name.endswith("adaln_proj.linear"):
            layer = Int8ConvRotLinear.from_float(sd[name + ".weight"], None, groupsize=64, mode="dequant",
                                                 compute_dtype=torch.float32)
            model.swap_linear(name, layer)
            dq[name + ".weight"] = dequantize_convrot(layer.weight, layer.weight_scale, 64, torch.float32)
    with tempfile.TemporaryDirectory() as d:
        p1 = _write(d, "a.safetensors", _comfy_lora(cfg))
        p2 = _write(d, "b.safetensors", _diffusers_lora(cfg))
        targets = model_targets(model)
        loras = [(load_lora_file(p1, targets), STRENGTHS[0]), (load_lora_file(p2, targets), STRENGTHS[1])]
        LoRAManager(model).activate([(p1, STRENGTHS[0]), (p2, STRENGTHS[1])])
        out = forward(model, lay, x)
    ref = H3DiT(cfg, compute_dtype=torch.float32).eval()
    ref.load_state_dict(merge_loras(dq, targets, loras))
    rv, ra = forward(ref, lay, x)
    ev, ea = rel(out[0], rv), rel(out[1], ra)
    print(f"int8(dequant mode) model + 2 LoRAs vs merged dequantised: video {ev:.3e}, audio {ea:.3e}")
    assert ev <= TP_RTOL and ea <= TP_RTOL


# ---- quantised bases with a method of their own --------------------------------------------------------------------
class _Spy(LinearMethod):
    """Records which layer each call of a method gets, then runs the method."""

    def __init__(self, inner: LinearMethod):
        self.inner, self.layers = inner, []

    def apply(self, layer, x, modulation=None, dtype=torch.bfloat16):
        self.layers.append(layer)
        return self.inner.apply(layer, x, modulation, dtype)

    def apply_added(self, layer, x, residual, modulation, dtype=torch.bfloat16):
        self.layers.append(layer)
        return self.inner.apply_added(layer, x, residual, modulation, dtype)

    def apply_swiglu(self, layer, y):
        self.layers.append(layer)
        return self.inner.apply_swiglu(layer, y)

    def takes_fp8_o(self, dtype):
        return self.inner.takes_fp8_o(dtype)

    def apply_fp8_o(self, layer, o, dtype):
        self.layers.append(layer)
        return self.inner.apply_fp8_o(layer, o, dtype)


def test_lora_keeps_the_base_linear_method():
    """A LoRA-wrapped fp8 linear keeps its method (the fused row quantisation of its input on a GPU): the wrapper's
    method runs the base's on the base layer, then adds the low-rank delta of the op's plain input, for each op the
    block hands a linear (modulated rows, the same after a gated residual add made in place, SwiGLU, fp8 attention's
    e4m3 O). A plain base keeps the plain method."""
    g = torch.Generator().manual_seed(3)
    rows, n_in, n_out, heads = 37, 96, 64, 3
    base = Fp8RowwiseLinear.from_dense(torch.randn(n_out, n_in, generator=g) / 10, out_dtype=torch.float32,
                                       emulate=True)
    spy = base.linear_method = _Spy(base.linear_method)
    down, up = _ab(g, 4, n_in, n_out)
    wrapped = LoRALinear(base, [LocalAdapter(down, up, 0.5, 0, n_out)], dtype=torch.float32)
    method = linear_method(wrapped)
    assert isinstance(method, LoRAMethod) and method.base is spy
    assert linear_method(LoRALinear(Linear(n_in, n_out), [LocalAdapter(down, up, 0.5, 0, n_out)])) is PLAIN

    def delta(h):
        return 0.5 * (h @ down.T) @ up.T

    norm = RMSNorm(n_in, 1e-6)
    x = torch.randn(rows, n_in, generator=g)
    shift, scale = torch.randn(2, 3, n_in, generator=g) * 0.3
    mod = Modulation(norm, shift, scale, torch.randint(0, 3, (rows,), generator=g))
    y = torch.randn(rows, 2 * n_in, generator=g)
    o8 = (torch.randn(heads, rows, n_in // heads, generator=g) * 100).to(torch.float8_e4m3fn)
    o = Fp8O(o8, torch.rand(heads, 1, 1, generator=g), torch.randn(heads, 1, n_in // heads, generator=g))
    assert method.takes_fp8_o(torch.bfloat16) == spy.takes_fp8_o(torch.bfloat16)
    with torch.no_grad():
        cases = [(method.apply(wrapped, x, mod, torch.float32), modulate(x, norm.weight, norm.eps, shift, scale,
                                                                          mod.index, torch.float32)),
                 (method.apply_swiglu(wrapped, y), swiglu(y)),
                 (method.apply_fp8_o(wrapped, o, torch.float32), o_rows(o, torch.float32))]
        residual = Residual(torch.randn(3, n_in, generator=g), torch.randn(rows, n_in, generator=g))
        added = x.clone()  # the add is made once, by the base's method, before the delta's plain input is taken
        cases.append((method.apply_added(wrapped, added, residual, mod, torch.float32),
                      modulate(x + residual.gate[mod.index] * residual.part, norm.weight, norm.eps, shift, scale,
                               mod.index, torch.float32)))
        assert torch.equal(added, x + residual.gate[mod.index] * residual.part)
        for got, h in cases:
            torch.testing.assert_close(got, base(h) + delta(h), rtol=1e-5, atol=1e-5)
        assert spy.layers == [base] * 4  # the base's method ran each time, on the base layer
        wrapped.clear()  # no adapters: the base's method alone
        assert torch.equal(method.apply(wrapped, x, mod, torch.float32), spy.apply(base, x, mod, torch.float32))


# ---- wrapper housekeeping, request paths ----------------------------------------------------------------------------
def test_wrapper_state_dict_round_trip():
    base = Linear(8, 6, bias=True, compute_dtype=torch.float32)
    w = LoRALinear(base, [LocalAdapter(torch.randn(2, 8), torch.randn(6, 2), 1.0, 0, 6)])
    assert set(w.state_dict()) == {"weight", "bias"}
    new = {"weight": torch.randn(6, 8), "bias": torch.randn(6)}
    w.load_state_dict(new)
    assert torch.equal(base.weight, new["weight"]) and torch.equal(base.bias, new["bias"])
    assert set(dict(w.named_buffers())) == {"lora_down", "lora_up_0"}  # follow .to(), not in the state dict
    w.clear()
    x = torch.randn(3, 8)
    assert torch.equal(w(x), base(x)) and not w.active


def test_resolve_lora_path(tmp_path):
    loras = tmp_path / "loras"
    loras.mkdir()
    (loras / "style.safetensors").write_bytes(b"x")
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x")
    assert resolve_lora_path("style.safetensors", loras) == loras / "style.safetensors"
    assert resolve_lora_path("style", loras) == loras / "style.safetensors"
    for bad in ("../secret.safetensors", "sub/style.safetensors", "..", ".hidden", "a\\b"):
        with pytest.raises(InvalidArgument, match="bare file name"):
            resolve_lora_path(bad, loras)
    with pytest.raises(InvalidArgument, match="allow-lora-paths"):
        resolve_lora_path(str(outside), loras)
    assert resolve_lora_path(str(outside), loras, allow_paths=True) == outside
    with pytest.raises(NotFound, match="not found"):
        resolve_lora_path("missing", loras)
    with pytest.raises(NotFound, match="no loras directory"):
        resolve_lora_path("style", None)


# ---- service wiring: engine + servicer request parsing (in process, single rank) ------------------------------------
def test_engine_and_servicer_apply_request_loras(tmp_path):
    from types import SimpleNamespace

    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from dit_svc.server import DiTServicer
    from h3.v1 import dit_pb2
    from minimax_h3.contract import RenderSpec, spec_to_proto
    from stagekit.dist import RankGroup, RankInfo
    from stagekit.runtime import JobContext
    from stagekit.wire import tensor_chunks

    loras_dir = tmp_path / "loras"
    loras_dir.mkdir()
    group = RankGroup(RankInfo(0, 1, 0), "gloo", 10)
    eng = DiTEngine(DiTEngineConfig("", "", tmp_path / "cache", "cpu", torch.float32, loras_dir=str(loras_dir)),
                    group)
    cfg = eng.model_cfg
    g = torch.Generator().manual_seed(7)
    lora = {}
    for name, (n_in, n_out) in {"blocks.0.attn.qkv_proj": (cfg.hidden, 3 * cfg.attn_inner),
                                "blocks.0.mlp.fc2": (cfg.ffn, cfg.hidden)}.items():
        lora[f"lora_unet_{name.replace('.', '_')}.lora_down.weight"], \
            lora[f"lora_unet_{name.replace('.', '_')}.lora_up.weight"] = _ab(g, 2, n_in, n_out, amp=0.5)
    _write(str(loras_dir), "style.safetensors", lora)
    _write(str(loras_dir), "wrong.safetensors", {"diffusion_model.blocks.9.mlp.fc2.lora_A.weight": torch.ones(2, 4),
                                                 "diffusion_model.blocks.9.mlp.fc2.lora_B.weight": torch.ones(4, 2)})
    outside = _write(str(tmp_path), "outside.safetensors", lora)

    spec = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=1)
    text = torch.randn(8, cfg.text_dim, generator=g)

    def request(*loras):
        req = dit_pb2.SampleRequest(job_id="j", loras=[dit_pb2.LoraSpec(**kw) for kw in loras])
        spec_to_proto(spec, req.params)
        yield dit_pb2.SampleInput(request=req)
        for chunk in tensor_chunks("text_states", text):
            yield dit_pb2.SampleInput(tensor=chunk)

    servicer = DiTServicer(SimpleNamespace(engine=eng))
    *_, extras = servicer._read_request(request({"name": "style", "strength": 0.8}, {"name": "style.safetensors"}))
    assert extras["loras"] == [(str(loras_dir / "style.safetensors"), 0.8), (str(loras_dir / "style.safetensors"), 1.0)]
    *_, extras = servicer._read_request(request())
    assert "loras" not in extras
    # By meaning: a name the server does not take or have is the request's fault; a file of the server's that does
    # not fit this DiT is the operator's (FAILED_PRECONDITION: the caller cannot change it).
    for bad, cls, msg in (({"name": "../outside.safetensors"}, InvalidArgument, "bare file name"),
                          ({"name": outside}, InvalidArgument, "allow-lora-paths"),
                          ({"name": "style", "strength": float("nan")}, InvalidArgument, "finite"),
                          ({"name": "nope"}, NotFound, "not found"),
                          ({"name": "wrong"}, LoRAFileError, r"match no linear.*blocks\.9\.mlp\.fc2")):
        with pytest.raises(cls, match=msg):
            servicer._read_request(request(bad))
    assert issubclass(LoRAFileError, FailedPrecondition)

    eng.load(WeightSource(eng.weight_files()))
    ptrs = {k: v.data_ptr() for k, v in eng.model.state_dict().items()}
    ctx = JobContext(group, None, "dit")
    run = lambda loras: eng.run(spec, {"text_states": text, **({"loras": loras} if loras else {})}, ctx)  # noqa
    base = run(None)
    styled = run([(str(loras_dir / "style.safetensors"), 0.8)])
    again = run([(str(loras_dir / "style.safetensors"), 0.8)])
    plain = run(None)
    effect = rel(styled["video_latents"], base["video_latents"])
    print(f"engine: LoRA effect on video latents {effect:.3e}")
    assert effect > 1e-3
    assert torch.equal(styled["video_latents"], again["video_latents"])
    assert torch.equal(plain["video_latents"], base["video_latents"])
    assert eng.loras.loads == 1
    assert ptrs == {k: v.data_ptr() for k, v in eng.model.state_dict().items()}


def test_a_lora_file_put_back_with_the_old_size_and_mtime_is_a_new_version(tmp_path):
    # The per-file caches (finite check, sharded factors) key on `file_identity`: a `cp -p`-style rewrite keeps size
    # and mtime but not the ctime, so the new bytes are read, never the old file's factors.
    from minimax_h3.dit.lora import file_identity

    f = tmp_path / "style.safetensors"
    f.write_bytes(b"a" * 64)
    before = file_identity(f)
    st = f.stat()
    f.write_bytes(b"b" * 64)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns
    assert file_identity(f) != before and file_identity(f)[0] == before[0]
