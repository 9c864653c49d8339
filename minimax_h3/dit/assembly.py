"""The one way a DiT is put together from its weights: the DiT stage's load and the benchmarks both call `assemble_dit`.

Steps: (1) the model on the meta device (this rank's TP shard); (2) every linear that gets a kernel module of its own
(`MakeLinear`: the start-up probe's choice for the block and refiner linears, int8 ConvRot for other int8 weights)
swapped in; (3) every other weight assigned as a parameter in place (no copy); (4) RoPE's table on the device, the
chosen attention kernel in every attention layer, and the blocks compiled if asked.
"""

from __future__ import annotations

import time
from typing import Callable, MutableMapping

import torch
import torch.distributed as dist
from torch import nn

from minimax_h3.kernels.int8 import Int8ConvRotLinear, QuantizedWeight
from minimax_h3.kernels.registry import KernelSelection, WeightSource
from stagekit.errors import FailedPrecondition

from .config import DiTConfig
from .model import AttentionFn, H3DiT

# (linear name, weight, bias or None) -> the module that serves it, or None: a parameter of the model's own linear
# (a quantised weight then dequantised to the compute dtype).
MakeLinear = Callable[[str, WeightSource, "torch.Tensor | None"], "nn.Module | None"]

BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def block_linears(cfg: DiTConfig) -> set[str]:
    """The linears the kernel registry serves: attention and MLP of every block and refiner block, and the blocks'
    VSA gates where the checkpoint has them (FastH3)."""
    prefixes = [f"blocks.{i}" for i in range(cfg.num_layers)]
    gates = {f"{p}.attn.to_gate_compress" for p in prefixes} if cfg.vsa_gates else set()
    prefixes += [f"token_refiner.blocks.{i}" for i in range(cfg.num_refiner_layers)]
    return {f"{p}.{n}" for p in prefixes for n in BLOCK_LINEARS} | gates


def kernel_linears(cfg: DiTConfig, kernels: KernelSelection | None, quant_mode: str,
                   compute_dtype: torch.dtype) -> MakeLinear:
    """The stage's rule: the block and refiner linears get the start-up probe's kernel (`kernels`; None: CPU, no
    probe), every other int8 weight (the unpruned AdaLN, M = 2-3 rows) stays int8 (`quant_mode`), dense weights are
    parameters of the model's own linears."""
    served = block_linears(cfg) if kernels is not None else set()

    def make(name: str, weight: WeightSource, bias: torch.Tensor | None) -> nn.Module | None:
        if name in served:
            return kernels.make_linear(weight, bias)
        if isinstance(weight, QuantizedWeight):
            return Int8ConvRotLinear.from_quantized(weight, bias, mode=quant_mode, compute_dtype=compute_dtype)
        return None

    return make


def assemble_dit(cfg: DiTConfig, weights: MutableMapping[str, WeightSource], make_linear: MakeLinear,
                 device: torch.device | str, compute_dtype: torch.dtype = torch.bfloat16, chunk_rows: int = 4096,
                 tp_group: dist.ProcessGroup | None = None, sp_group: dist.ProcessGroup | None = None,
                 attention_fn: AttentionFn | None = None, compile_blocks: bool = False,
                 timings: dict[str, float] | None = None, converted: dict[str, nn.Module] | None = None) -> H3DiT:
    """The DiT from this rank's weights (release / ComfyUI names; int8 ones as QuantizedWeight), emptied as it goes:
    a weight converted by `make_linear` (int8 -> fp8) never sits on the device beside its source. Raises
    FailedPrecondition when the weights do not fit the model. `timings`, when given, gets the seconds of each step
    ("build", "linears", "state", "finish"), the CPU seconds of this thread in each (`<step>_cpu`: a step far
    slower than its CPU time waits on the device or on another thread), and "convert", the part of "linears" that
    converted weights the file does not hold in their kernel's format (e.g. bf16 -> int8): where a load's assembly
    goes. `converted`, when given, gets {linear name: module} of those converted linears (what a stage may keep so
    that its next load need not convert them again)."""
    cuda = torch.device(device).type == "cuda"
    clock = [time.monotonic(), time.thread_time()]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def lap(step: str) -> None:
        if timings is None:
            return
        sync()  # the step's queued device work (e.g. int8 conversions) is its own
        now, cpu = time.monotonic(), time.thread_time()
        timings[step], timings[f"{step}_cpu"] = now - clock[0], cpu - clock[1]
        clock[:] = [now, cpu]

    # 1. The model, without storage.
    model = H3DiT(cfg, compute_dtype, chunk_rows, tp_group=tp_group, sp_group=sp_group, device="meta")
    lap("build")
    # 2. Linears served by a module of their own.
    swapped = set()
    convert_s = 0.0
    for key in [k for k in weights if k.endswith(".weight")]:
        name = key[: -len(".weight")]
        value = weights[key]
        bias = weights.get(name + ".bias")
        bias = None if bias is None else bias.to(device)
        src = value.to(device)
        timed = timings is not None and not isinstance(src, QuantizedWeight)
        if timed:
            sync()
            t0 = time.monotonic()
        layer = make_linear(name, src, bias)
        if timed and layer is not None:
            sync()
            convert_s += time.monotonic() - t0
        if converted is not None and layer is not None and not isinstance(src, QuantizedWeight):
            converted[name] = layer
        if layer is None:
            if isinstance(value, QuantizedWeight):
                weights[key] = src.dequantize(compute_dtype)
            continue
        del weights[key], src, value
        weights.pop(name + ".bias", None)
        model.swap_linear(name, layer)
        swapped.add(name)
    lap("linears")
    if timings is not None:
        timings["convert"] = convert_s
    # 3. Every other weight, assigned in place.
    dense = {k: weights.pop(k).to(device) for k in list(weights)}
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in swapped]
    if missing or unexpected:
        raise FailedPrecondition(f"DiT weights do not fit the model: missing {missing[:10]}, "
                                 f"unexpected {unexpected[:10]}")
    del dense
    lap("state")
    # 4. RoPE, attention kernel, compilation.
    model.rope.to(device)
    if attention_fn is not None:
        model.set_attention_fn(attention_fn)
    if compile_blocks:
        for blk in model.blocks:
            blk.compile()
    model.eval()
    lap("finish")
    return model
