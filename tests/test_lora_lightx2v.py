"""LightX2V's Turbo LoRAs in their published "comfyui" format (`minimax_h3_*_turbo_*_comfyui_bf16.safetensors`):
`diffusion_model.` keys, `lora_down` / `lora_up` / `alpha` factors on the linears and full `diff` / `diff_b` deltas on
norm gains and biases, applied unmerged (TP1 and TP2 over gloo in real processes) == the merged weights
W + strength * alpha/rank * up @ down and p + strength * diff, computed here; refusals name the keys."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from minimax_h3.dit.lora import LoRAFileError, LoRAManager, check_lora_file, model_targets, parse_lora_state_dict
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.tp import shard_state_dict
from tests.dit_ranks import assert_matches_one_rank, forward, rel, tiny_case
from tests.ranks import run_ranks

RANK, ALPHA = 4, 8.0  # alpha / rank = 2, as LightX2V's 8-step file (alpha 8) on a small rank
STRENGTH = 0.8
RTOL = 1e-5


def lightx2v_lora(cfg, adaln: bool = True) -> dict[str, torch.Tensor]:
    """A file in LightX2V's ComfyUI naming, bf16: factors on every block linear (and the blocks' AdaLN projections
    when `adaln`), diffs of every block's norm gains and q/k norms, of the final norm, and of the AdaLN, condition
    and output-head biases."""
    g = torch.Generator().manual_seed(44)

    def rnd(*shape, amp=0.1):
        return (torch.randn(*shape, generator=g) * amp).to(torch.bfloat16)

    linears = {"attn.qkv_proj": (cfg.hidden, 3 * cfg.attn_inner), "attn.out_proj": (cfg.attn_inner, cfg.hidden),
               "mlp.fc1": (cfg.hidden, 2 * cfg.ffn), "mlp.fc2": (cfg.ffn, cfg.hidden)}
    if adaln:
        linears["adaln_proj.linear"] = (cfg.adaln_in, cfg.adaln_out)
    sd = {}
    for i in range(cfg.num_layers):
        p = f"diffusion_model.blocks.{i}"
        for name, (n_in, n_out) in linears.items():
            sd[f"{p}.{name}.lora_down.weight"] = rnd(RANK, n_in)
            sd[f"{p}.{name}.lora_up.weight"] = rnd(n_out, RANK)
            sd[f"{p}.{name}.alpha"] = torch.tensor(ALPHA, dtype=torch.bfloat16)
        for norm in ("norm1", "norm2"):
            sd[f"{p}.{norm}.diff"] = rnd(cfg.hidden)
        for norm in ("attn.q_norm", "attn.k_norm"):
            sd[f"{p}.{norm}.diff"] = rnd(cfg.head_dim)
        sd[f"{p}.adaln_proj.linear.diff_b"] = rnd(cfg.adaln_out, amp=0.02)
    sd["diffusion_model.final_layer.norm.diff"] = rnd(cfg.hidden)
    sd["diffusion_model.final_layer.video_out.diff_b"] = rnd(cfg.video_patch_dim)
    sd["diffusion_model.condition_proj.diff_b"] = rnd(cfg.hidden)
    return sd


def merged(sd: dict, lora: dict, strength: float) -> dict:
    """The reference, straight from the file's tensors: each factored linear W + s * alpha/rank * up @ down, each
    patched tensor + s * diff, in fp32, rounded once to the tensor's dtype."""
    out = dict(sd)
    for key in lora:
        if key.endswith(".lora_down.weight"):
            mod = key[len("diffusion_model."): -len(".lora_down.weight")]
            down, up = lora[key].float(), lora[key.replace("lora_down", "lora_up")].float()
            scale = float(lora[key.replace(".lora_down.weight", ".alpha")]) / down.shape[0]
            w = out[mod + ".weight"]
            out[mod + ".weight"] = (w.float() + strength * scale * (up @ down)).to(w.dtype)
        elif key.endswith((".diff", ".diff_b")):
            mod, _, kind = key[len("diffusion_model."):].rpartition(".")
            param = f"{mod}.{'weight' if kind == 'diff' else 'bias'}"
            out[param] = (out[param].float() + strength * lora[key].float()).to(out[param].dtype)
    return out


def _write(d, name: str, sd: dict) -> str:
    path = os.path.join(d, name)
    save_file(sd, path)
    return path


def test_unmerged_equals_merged_and_clears_to_the_base(tmp_path):
    cfg, sd, lay, x = tiny_case()
    lora = lightx2v_lora(cfg)
    path = _write(str(tmp_path), "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", lora)
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    model.load_state_dict(sd)
    targets = model_targets(model)
    n_factors = 5 * cfg.num_layers
    n_patches = 5 * cfg.num_layers + 3
    assert check_lora_file(path, targets, cfg.adaln_form) == n_factors + n_patches
    lw = parse_lora_state_dict(lora, targets)
    assert len(lw.parts) == n_factors and len(lw.patches) == n_patches
    base = forward(model, lay, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = LoRAManager(model)
    mgr.activate([(path, STRENGTH)])
    out = forward(model, lay, x)
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ref.load_state_dict(merged(sd, lora, STRENGTH))
    want = forward(ref, lay, x)
    ev, ea = rel(out[0], want[0]), rel(out[1], want[1])
    print(f"LightX2V LoRA unmerged vs merged: video {ev:.2e} audio {ea:.2e}; effect {rel(base[0], want[0]):.2e}")
    assert ev <= RTOL and ea <= RTOL and rel(base[0], want[0]) > 1e-2
    # the patched parameters hold exactly base + s * diff (one rounding)
    ref_sd = ref.state_dict()
    for name in lw.patches:
        assert torch.equal(model.state_dict()[name], ref_sd[name]), name
    mgr.activate([(path, -STRENGTH)])  # another strength starts from the base again, not from the patched values
    ref.load_state_dict(merged(sd, lora, -STRENGTH))
    assert rel(forward(model, lay, x)[0], forward(ref, lay, x)[0]) <= RTOL
    mgr.clear()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # the base, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(forward(model, lay, x), base))


def _tp_rank(rank: int, world: int, path: str) -> dict:
    group = dist.new_group(list(range(world)))
    cfg, sd, lay, x = tiny_case()
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=group).eval()
    model.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
    base = forward(model, lay, x)
    mgr = LoRAManager(model)
    mgr.activate([(path, STRENGTH)])
    out = forward(model, lay, x)
    mgr.clear()
    return dict(out=out, cleared=all(torch.equal(a, b) for a, b in zip(forward(model, lay, x), base)))


def test_tp2_unmerged_equals_tp1_merged(tmp_path):
    """The column-parallel AdaLN biases take their rows of each diff_b; the norms are whole on every rank."""
    cfg, sd, lay, x = tiny_case()
    lora = lightx2v_lora(cfg)
    path = _write(str(tmp_path), "turbo.safetensors", lora)
    outs = run_ranks(_tp_rank, 2, path)
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ref.load_state_dict(merged(sd, lora, STRENGTH))
    assert_matches_one_rank([o["out"] for o in outs], forward(ref, lay, x), RTOL, "LightX2V LoRA TP2 vs TP1 merged")
    assert all(o["cleared"] for o in outs)


def test_curve_form_takes_the_adaln_bias_diffs_and_refuses_adaln_factors(tmp_path):
    """On the pruned (curve-form) DiT the AdaLN bias is kept whole, so its diff applies exactly; factors on the
    AdaLN projection cannot (its input is the baked table) and are refused, naming them."""
    cfg, sd, lay, x = tiny_case(form="curve")
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    model.load_state_dict(sd)
    targets = model_targets(model)
    with pytest.raises(LoRAFileError, match=r"timestep modulation \(diffusion_model\.blocks\.0\.adaln_proj\.linear"):
        parse_lora_state_dict(lightx2v_lora(cfg), targets, adaln_form="curve")
    lora = lightx2v_lora(cfg, adaln=False)
    path = _write(str(tmp_path), "no_adaln_factors.safetensors", lora)
    LoRAManager(model).activate([(path, STRENGTH)])
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ref.load_state_dict(merged(sd, lora, STRENGTH))
    out, want = forward(model, lay, x), forward(ref, lay, x)
    assert rel(out[0], want[0]) <= RTOL and rel(out[1], want[1]) <= RTOL


QKV = "diffusion_model.blocks.0.attn.qkv_proj"


@pytest.mark.parametrize("extra,problem", [
    ({QKV + ".diff": torch.zeros(1, 1)}, r"full-weight diff\(s\) of a linear.*blocks\.0\.attn\.qkv_proj\.diff "
                                         r"\(blocks\.0\.attn\.qkv_proj\.weight \["),
    ({"diffusion_model.blocks.0.norm1.diff": torch.zeros(3)}, r"shapes that do not fit.*blocks\.0\.norm1\.diff: \[3\]"),
    ({"diffusion_model.blocks.0.norm1.set_weight": torch.zeros(3)}, r"set_weight replacements.*norm1\.set_weight"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.diff_b": torch.zeros(3)}, r"match no linear or parameter.*"
                                                                        r"qkv_proj\.diff_b"),
    ({"diffusion_model.blocks.9.norm1.diff": torch.zeros(3)}, r"match no linear or parameter.*blocks\.9\.norm1\.diff"),
    ({"diffusion_model.blocks.0.norm1.lora_down.weight": torch.zeros(2, 3)},  # factors only on linears
     r"match no linear or parameter.*diffusion_model\.blocks\.0\.norm1(?!\.)"),
])
def test_refusals_name_the_keys(extra, problem):
    cfg, sd, lay, x = tiny_case()
    targets = model_targets(H3DiT(cfg, compute_dtype=torch.float32, device="meta"))
    lora = lightx2v_lora(cfg)
    if QKV + ".diff" in extra:
        extra = {QKV + ".diff": torch.zeros(3 * cfg.attn_inner, cfg.hidden)}
    with pytest.raises(LoRAFileError, match=problem):
        parse_lora_state_dict({**lora, **extra}, targets)
