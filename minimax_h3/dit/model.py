"""MiniMax-H3 DiT (33B joint video+audio single-stream transformer), one file, release/ComfyUI parameter names.

Facts: docs/model.md §2 (forward, block, refiner, AdaLN table, RoPE) and §2.10 (curve AdaLN).

A block reads in three files: this one (its numbered steps), minimax_h3/dit/ops.py (the plain math of each step) and
minimax_h3/kernels/layers.py (how each layer's method computes its step, and what it fuses with its neighbour).

Precision: the residual stream is fp32 everywhere (embeddings are scattered into an fp32 buffer, blocks add fp32
updates). `compute_dtype` (bf16/fp16/fp32) is used only inside the block/refiner linears and attention. The release
fp32 islands (patch projections, time embedder, output heads) and the curve-form AdaLN always run in fp32.

Tensor parallel: pass `tp_group` (None = single rank). `H3DiT._tp_plan` declares which linear is column- or
row-parallel (minimax_h3/dit/tp.py): block/refiner attention and MLP are Megatron column->row parallel with a visible fp32
`dist.all_reduce`; the AdaLN projections are column-parallel with a visible `dist.all_gather` of their tiny
[M, out/n] outputs. The checkpoint loader, the LoRA code and the tests slice weights by the same plan.

Sequence parallel (Ulysses): pass `sp_group` too (alone or with `tp_group`). The blocks run on this rank's share of
the rows; attention swaps rows for heads with two visible `dist.all_to_all_single` calls, and the rows are
all-gathered before the output heads. See minimax_h3/dit/sp.py.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minimax_h3.kernels.layers import (AttentionInput, AttentionOutput, Modulation, Residual, attention_input,
                                      linear_method)

from .config import NUM_MODALITIES, DiTConfig
from .layout import COND_VIDEO_T, REF_AUDIO_T, PackedLayout
from . import sp
from .ops import gated_add, rms_norm
from .sp import SeqShards, validate_parallel
from .sparse import VsaStep
from .step_cache import FirstBlockCache
from .tp import (ColumnParallel, ColumnParallelLinear, Linear, RowParallel, RowParallelLinear, TPStyle, group_rank_size,
                 tp_style)

# Parameters that the release ships (and we always run) in fp32.
FP32_PARAM_PREFIXES = (
    "video_patch_proj.",
    "audio_patch_proj.",
    "time_embedder.",
    "final_layer.video_out.",
    "final_layer.audio_out.",
    "adaln_t_table",
)
TIMESTEP_MAX_PERIOD = 10000.0  # sinusoid base; t is used unscaled in [0, 1]

# (name, in_features, out_features, bias, tp style from H3DiT._tp_plan, None = replicated) -> module.
LinearFactory = Callable[[str, int, int, bool, "TPStyle | None"], nn.Module]
# (q, k, v) [1, heads, S, head_dim] in compute dtype -> o, same shape: full non-causal attention, scale 1/sqrt(d).
# minimax_h3.kernels.registry picks one per GPU architecture (cuDNN / flash SDPA, comfy-kitchen int8, 8-bit, ...);
# minimax_h3/kernels/layers.py says how a block feeds it (`attention_input`).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default: torch SDPA with its own backend choice (never materialises the S x S matrix on GPU)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (weight is a plain gain, not 1 + w)."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Ctx:
    """Per-model constants handed to submodules (no global state)."""

    def __init__(self, cfg: DiTConfig, compute_dtype: torch.dtype, chunk_rows: int, group, tp_size: int,
                 factory: LinearFactory, plan: dict[str, TPStyle], attention_fn: AttentionFn = sdpa_attention,
                 sp_group=None):
        self.cfg, self.compute_dtype, self.chunk_rows = cfg, compute_dtype, chunk_rows
        self.group, self.tp_size, self.factory, self.plan = group, tp_size, factory, plan
        self.attention_fn = attention_fn
        self.sp_group = sp_group

    def linear(self, name: str, fin: int, fout: int, bias: bool) -> nn.Module:
        """Linear `name`, column- / row-parallel / replicated as the model's tensor-parallel plan says."""
        return self.factory(name, fin, fout, bias, tp_style(self.plan, name))


class Attention(nn.Module):
    """Self-attention over all S rows, in three steps that a caller may run row chunk by row chunk:
    `project_qkv` (rows -> this rank's q, k, v heads, RMS-normed and roped, into an `empty_qkv` input), `attend`
    over all rows, `project_out` (rows of the output -> [rows, hidden], summed over TP ranks by the caller). Chunking
    bounds the fp32 norm/RoPE temporaries and the [rows, 3 * inner] projection to `chunk_rows` (docs/memory.md).
    How each step computes is the method's of its linear and of the attention kernel
    (minimax_h3/kernels/layers.py)."""

    def __init__(self, ctx: _Ctx, name: str):
        super().__init__()
        cfg = ctx.cfg
        self.group = ctx.group
        self.sp_group = ctx.sp_group
        self.compute_dtype = ctx.compute_dtype
        self.attention_fn = ctx.attention_fn
        self.local_heads = cfg.num_heads // ctx.tp_size
        self.head_dim = cfg.head_dim
        # qkv rows: [q_all; k_all; v_all] (head-major inside each third); local shard keeps that order.
        self.qkv_proj = ctx.linear(f"{name}.qkv_proj", cfg.hidden, 3 * cfg.attn_inner, False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.out_proj = ctx.linear(f"{name}.out_proj", cfg.attn_inner, cfg.hidden, False)
        # FastH3 (VSA-distilled) blocks: the gate of VSA's coarse branch, one value per row and channel of each head.
        self.to_gate_compress = (ctx.linear(f"{name}.to_gate_compress", cfg.hidden, cfg.attn_inner, False)
                                 if cfg.vsa_gates and name.startswith("blocks.") else None)

    def empty_qkv(self, s: int, device: torch.device, sequence_parallel: bool = False,
                  whole: bool = False) -> AttentionInput:
        """Uninitialised attention input for S rows, in the layout the attention kernel takes (sequence parallel:
        compute-dtype q, k, v, which the all-to-all moves). whole: one `project_qkv` call writes all S rows."""
        return attention_input(self.attention_fn, self.local_heads, s, self.head_dim, self.compute_dtype, device,
                               self.q_norm, self.k_norm, sequence_parallel, whole)

    def project_qkv(self, qkv: AttentionInput, start: int, end: int, h: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor] | None, modulation: Modulation | None = None,
                    gate: torch.Tensor | None = None, residual: Residual | None = None) -> None:
        """Rows [start, end) of `qkv` from h [rows, hidden] (compute dtype; with `modulation`, the fp32 residual
        rows it modulates first, after `residual`'s gated add into them, made in place); rope (cos, sin)
        [rows, rope_dim] fp32 or None. `gate` [S, local inner]: rows [start, end) of the VSA gate from the same
        input (to_gate_compress)."""
        proj, dtype = self.qkv_proj, self.compute_dtype
        y = (linear_method(proj).apply(proj, h, modulation, dtype) if residual is None
             else linear_method(proj).apply_added(proj, h, residual, modulation, dtype))
        y = y.reshape(end - start, 3, self.local_heads, self.head_dim)
        qkv.write(start, end, y, self.q_norm, self.k_norm, rope)
        if gate is not None:
            g = self.to_gate_compress
            gate[start:end] = linear_method(g).apply(g, h, modulation, self.compute_dtype)

    def attend(self, qkv: AttentionInput, shards: SeqShards | None = None, sparse: Callable | None = None,
               gate: torch.Tensor | None = None) -> AttentionOutput:
        """Attention over all rows of `qkv`. Sequence parallel (Ulysses, minimax_h3/dit/sp.py): an all-to-all trades
        this rank's rows of every local head for every row of 1/sp of them; another brings the output rows back.
        `sparse`: VSA (minimax_h3/kernels/vsa.py VsaAttention) in place of the dense kernel, with the rows' `gate`."""
        if sparse is not None:
            if shards is not None:
                raise ValueError("VSA attention runs on all rows of a rank (no sequence parallelism)")
            return AttentionOutput(sparse(qkv.qkv[0], qkv.qkv[1], qkv.qkv[2], gate))
        if shards is None:
            return qkv.attend(self.attention_fn, self.out_proj, self.compute_dtype)
        hs, d = self.local_heads // shards.n, self.head_dim
        sends, recvs = sp.qkv_splits(shards, hs, d)
        send = sp.qkv_send(qkv.pop(), shards.n)  # the buffer goes once the send copy exists
        recv = send.new_empty(sum(recvs))
        dist.all_to_all_single(recv, send, recvs, sends, group=self.sp_group)
        o = self.attention_fn(*sp.qkv_received(recv, shards, hs, d))
        del send, recv
        sends, recvs = sp.o_splits(shards, hs, d)
        send = sp.o_send(o, shards)
        recv = send.new_empty(sum(recvs))
        dist.all_to_all_single(recv, send, recvs, sends, group=self.sp_group)
        return AttentionOutput(sp.o_received(recv, shards, hs, d))

    def project_out(self, o: AttentionOutput, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of an `attend` output -> [rows, hidden] in the compute dtype: this rank's partial sum
        of the row-parallel out_proj (the caller all-reduces it in fp32)."""
        return o.project(self.out_proj, start, end)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Unchunked (the token refiner's short text): h [S, hidden] (compute dtype) -> fp32 [S, hidden], summed
        over TP ranks."""
        s = h.shape[0]
        qkv = self.empty_qkv(s, h.device)
        self.project_qkv(qkv, 0, s, h, rope)
        out = self.project_out(self.attend(qkv), 0, s).float()
        if self.group is not None:
            dist.all_reduce(out, group=self.group)  # fp32 partial sums of the row-parallel out_proj
        return out


class MLP(nn.Module):
    """SwiGLU: fc2(silu(gate) * value), fc1 rows [gate; value]. Callers pass at most `chunk_rows` rows at a time
    (Block) or a short sequence (token refiner), which bounds the [rows, 2 * ffn / tp] activation."""

    def __init__(self, ctx: _Ctx, name: str):
        super().__init__()
        cfg = ctx.cfg
        self.group = ctx.group
        self.compute_dtype = ctx.compute_dtype
        self.fc1 = ctx.linear(f"{name}.fc1", cfg.hidden, 2 * cfg.ffn, False)
        self.fc2 = ctx.linear(f"{name}.fc2", cfg.ffn, cfg.hidden, False)

    def partial(self, h: torch.Tensor, modulation: Modulation | None = None,
                residual: Residual | None = None) -> torch.Tensor:
        """h [rows, hidden] (compute dtype; with `modulation`, the fp32 residual rows it modulates first, after
        `residual`'s gated add into them, made in place) -> [rows, hidden] in the compute dtype: this rank's partial
        sum of the row-parallel fc2."""
        fc1, dtype = self.fc1, self.compute_dtype
        y = (linear_method(fc1).apply(fc1, h, modulation, dtype) if residual is None
             else linear_method(fc1).apply_added(fc1, h, residual, modulation, dtype))  # [rows, 2 * ffn / tp]
        return linear_method(self.fc2).apply_swiglu(self.fc2, y)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, hidden] (compute dtype) -> fp32 [rows, hidden], summed over TP ranks."""
        out = self.partial(h).float()
        if self.group is not None:
            dist.all_reduce(out, group=self.group)  # fp32 partial sums of the row-parallel fc2
        return out


class AdaLNProj(nn.Module):
    """`adaln_proj.linear`: column-parallel over its output features; outputs are all-gathered (only [M, out])."""

    def __init__(self, ctx: _Ctx, name: str, out_features: int):
        super().__init__()
        self.group = ctx.group
        self.tp_size = ctx.tp_size
        self.linear = ctx.linear(f"{name}.linear", ctx.cfg.adaln_in, out_features, True)

    def forward(self, ada_in: torch.Tensor) -> torch.Tensor:
        """ada_in [M, adaln_in] fp32 -> [M, out] fp32 (full width on every rank)."""
        local = self.linear(ada_in).float().contiguous()
        if self.group is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local, group=self.group)  # contiguous output row ranges, rank order
        return torch.cat(parts, dim=-1)


class RefinerBlock(nn.Module):
    """token_refiner block: plain pre-norm transformer block, no AdaLN, no RoPE."""

    def __init__(self, ctx: _Ctx, name: str):
        super().__init__()
        self.compute_dtype = ctx.compute_dtype
        self.norm1 = RMSNorm(ctx.cfg.hidden, ctx.cfg.eps)
        self.attn = Attention(ctx, f"{name}.attn")
        self.norm2 = RMSNorm(ctx.cfg.hidden, ctx.cfg.eps)
        self.mlp = MLP(ctx, f"{name}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x).to(self.compute_dtype), None)
        return x + self.mlp(self.norm2(x).to(self.compute_dtype))


class TokenRefiner(nn.Module):
    def __init__(self, ctx: _Ctx):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(ctx, f"token_refiner.blocks.{i}")
                                    for i in range(ctx.cfg.num_refiner_layers))
        self.final_norm = RMSNorm(ctx.cfg.hidden, ctx.cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.final_norm(x)


class Block(nn.Module):
    """AdaLN-modulated block. The residual stream x stays fp32; every other activation lives one row chunk at a
    time except q, k, v and the attention output, which attention needs whole (docs/memory.md: per-row peak)."""

    def __init__(self, ctx: _Ctx, name: str):
        super().__init__()
        self.compute_dtype = ctx.compute_dtype
        self.chunk_rows = ctx.chunk_rows
        self.index = int(name.rsplit(".", 1)[1])  # blocks.{i}
        self.norm1 = RMSNorm(ctx.cfg.hidden, ctx.cfg.eps)
        self.attn = Attention(ctx, f"{name}.attn")
        self.norm2 = RMSNorm(ctx.cfg.hidden, ctx.cfg.eps)
        self.mlp = MLP(ctx, f"{name}.mlp")
        self.adaln_proj = AdaLNProj(ctx, f"{name}.adaln_proj", ctx.cfg.adaln_out)

    def forward(self, x: torch.Tensor, ada_in: torch.Tensor, rows: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], shards: SeqShards | None = None,
                sparse: Callable | None = None, added: Residual | None = None) -> Residual | None:
        """x [S, hidden] fp32 residual (updated in place); ada_in [M, adaln_in] fp32;
        rows [S] = timestep_index * 3 + tag (AdaLN table row); rope (cos, sin) [S, rope_dim] fp32.
        Sequence parallel: S is this rank's share `shards.local` of the sequence (minimax_h3/dit/sp.py).
        `sparse`: this block's VSA attention (minimax_h3/dit/sparse.py), None for dense.

        A gated residual add is left to the next modulation of the same rows where one row chunk covers them on one
        rank (`defers`): the linear's method then makes it in its modulation's pass over x (`apply_added`).
        `added`: the previous block's last add, still to be made (this block makes it in its first modulation).
        Returns this block's own last add when it is left to the next block (`H3DiT.forward` makes the last
        block's), else None: x is then complete."""
        m, s_all = ada_in.shape[0], x.shape[0]
        chunks = [(s, min(s + self.chunk_rows, s_all)) for s in range(0, s_all, self.chunk_rows)]
        defer = self.defers(x)
        if added is not None and not defer:
            raise RuntimeError(f"blocks.{self.index}: handed a gated residual add it cannot make in its modulation "
                               f"({len(chunks)} row chunks, TP group {self.attn.group})")
        cos, sin = rope
        # 1. AdaLN modulation: shift / scale / gate rows [M * 3, hidden] (row m * 3 + tag) for attention and MLP.
        mod = self.adaln_proj(ada_in).view(m * NUM_MODALITIES, -1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        # 2. q, k, v of every row (the previous block's last add, norm1, modulation, qkv projection, q/k norm, RoPE),
        #    a row chunk at a time. VSA takes compute-dtype q, k, v (as sequence parallelism does), and the rows'
        #    gate where blocks have one.
        qkv = self.attn.empty_qkv(s_all, x.device, sequence_parallel=shards is not None or sparse is not None,
                                  whole=len(chunks) == 1)
        gate = (x.new_empty(s_all, self.attn.local_heads * self.attn.head_dim, dtype=self.compute_dtype)
                if sparse is not None and self.attn.to_gate_compress is not None else None)
        for s, e in chunks:
            self.attn.project_qkv(qkv, s, e, x[s:e], (cos[s:e], sin[s:e]),
                                  Modulation(self.norm1, shift1, scale1, rows[s:e]), gate, added)
        del added
        # 3. Attention over all rows.
        o = self.attn.attend(qkv, shards, sparse, gate)
        del qkv, gate
        # 4. Output projection and gated residual add, a row chunk at a time (deferred: left to step 5).
        if defer:
            added = Residual(gate1, self.attn.project_out(o, 0, s_all))
        else:
            self._reduce_add(x, gate1, rows, chunks, lambda s, e: self.attn.project_out(o, s, e))
        del o
        # 5. MLP (norm2, modulation, fc1, SwiGLU, fc2) and gated residual add, a row chunk at a time (chunk i's
        #    input is untouched by chunk i-1's add; deferred: step 4's add made in fc1's modulation, this one left to
        #    the next block).
        if defer:
            return Residual(gate2, self.mlp.partial(x, Modulation(self.norm2, shift2, scale2, rows), added))
        self._reduce_add(x, gate2, rows, chunks, lambda s, e: self.mlp.partial(
            x[s:e], Modulation(self.norm2, shift2, scale2, rows[s:e])))
        return None

    def defers(self, x: torch.Tensor) -> bool:
        """Whether this block leaves its gated residual adds on the rows x to the next modulation: on a GPU (where a
        linear's method can make both in one kernel; on the CPU, Inductor's C++ code generation fails on compiled
        blocks that add inside fc1's modulation), with one row chunk on one rank (several chunks: chunk i's add must
        be made before chunk i + 1 is modulated; TP: the partial sums are all-reduced first)."""
        return x.is_cuda and x.shape[0] <= self.chunk_rows and self.attn.group is None

    def _reduce_add(self, x, gate, rows, chunks, partial) -> None:
        """x[s:e] += gate[rows[s:e]] * all_reduce(partial(s, e)) for every chunk (`gated_add`). Each chunk's fp32
        all-reduce runs on NCCL's stream while the next chunk's partial sum is computed; it is waited for just before
        its add."""
        group = self.attn.group
        pending = None  # the previous chunk: (s, e, partial sum, its all-reduce)

        def add(s, e, part, work):
            if work is not None:
                work.wait()
            gated_add(x[s:e], gate, part, rows[s:e])

        for s, e in chunks:
            part = partial(s, e)
            work = None
            if group is not None:
                part = part.float()  # partial sums in fp32
                work = dist.all_reduce(part, group=group, async_op=True)
            if pending is not None:
                add(*pending)
            pending = (s, e, part, work)
        add(*pending)


class FinalLayer(nn.Module):
    def __init__(self, ctx: _Ctx):
        super().__init__()
        cfg = ctx.cfg
        self.chunk_rows = ctx.chunk_rows
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.adaln_proj = AdaLNProj(ctx, "final_layer.adaln_proj", cfg.final_adaln_out)
        self.video_out = ctx.linear("final_layer.video_out", cfg.hidden, cfg.video_patch_dim, True)
        self.audio_out = ctx.linear("final_layer.audio_out", cfg.hidden, cfg.audio_in_channels, True)

    def forward(self, x, ada_in, row_ti, video_idx, audio_idx):
        """x [S, hidden] fp32, ada_in [M, adaln_in], row_ti [S] timestep index, video_idx [Nv] / audio_idx [Na] row
        indices -> (video [Nv, video_patch_dim], audio [Na, audio_in_channels]) fp32."""
        # Modulated per *timestep* only (no modality split); heads run only on their own rows, a chunk at a time.
        shift, scale = self.adaln_proj(ada_in).chunk(2, dim=-1)

        def head(idx, proj):
            outs = []
            for i in idx.split(self.chunk_rows):
                ti = row_ti.index_select(0, i)
                y = self.norm(x.index_select(0, i)) * (1.0 + scale.index_select(0, ti)) + shift.index_select(0, ti)
                outs.append(proj(y).float())
            return torch.cat(outs)  # every layout has video and audio rows

        return head(video_idx, self.video_out), head(audio_idx, self.audio_out)


class TimeEmbedder(nn.Module):
    def __init__(self, ctx: _Ctx):
        super().__init__()
        cfg = ctx.cfg
        self.proj_in = ctx.linear("time_embedder.proj_in", cfg.freq_dim, cfg.time_embed_hidden, True)
        self.proj_out = ctx.linear("time_embedder.proj_out", cfg.time_embed_hidden, cfg.time_embed_dim, True)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_in(e).float())).float()


class RoPE(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.rope_freq_dim = cfg.rope_freq_dim
        k = torch.arange(0, 2 * cfg.rope_freq_dim, 2, dtype=torch.float32)
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (k / (2 * cfg.rope_freq_dim)), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [S, 3] -> cos, sin [S, 6*rope_freq_dim] fp32: angles [t | h | w] duplicated (rotate_half)."""
        ang = (pos.float()[:, :, None] * self.inv_freq.to(pos.device)).reshape(pos.shape[0], -1)
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos(), ang.sin()


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[M] -> [M, dim] = [cos(t f_k), sin(t f_k)], f_k = exp(-ln(10000) k / (dim/2)); t unscaled, fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(TIMESTEP_MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    arg = t.float()[:, None] * freqs[None]
    return torch.cat((arg.cos(), arg.sin()), dim=-1)


class H3DiT(nn.Module):
    """The DiT. state_dict() keys == release / ComfyUI keys (minus the recomputed `rope.inv_freq` buffer).

    Args:
        cfg: DiTConfig (adaln_form selects release "mlp" or Comfy pruned "curve").
        compute_dtype: dtype of the block/refiner linears and attention.
        chunk_rows: row chunk of everything but attention itself (bounds the qkv / MLP / fp32 norm temporaries).
        tp_group: torch.distributed group for tensor parallelism, None = single rank.
        sp_group: torch.distributed group for sequence parallelism (Ulysses, minimax_h3/dit/sp.py), None = off; ranks of
            one SP group hold the same TP shard.
        linear_factory: optional (name, in, out, bias, tp style) -> module; default = tp.Linear variants.
        device / dtype: parameter storage (use device="meta" + load_state_dict(assign=True) for full size).
        attention_fn: (q, k, v) -> o attention kernel (default torch SDPA); see minimax_h3.kernels.registry.
    """

    # Tensor-parallel plan (Megatron vocabulary), by module-name suffix; linears not listed are replicated. The one
    # declaration of how every weight is sliced across ranks: read here (which module each linear becomes), by the
    # checkpoint loader (which rows / columns of a file a rank reads), by LoRA (which factor is sliced) and by the
    # reference slicer the tests use (minimax_h3/dit/tp.py shard_state_dict).
    _tp_plan: dict[str, TPStyle] = {
        "attn.qkv_proj": ColumnParallel(sections=3),  # rows [q; k; v], each cut by heads
        "attn.out_proj": RowParallel(),  # input columns of those heads; fp32 all-reduce after it
        "attn.to_gate_compress": ColumnParallel(),  # FastH3's VSA gate: rows cut by heads, as q
        "mlp.fc1": ColumnParallel(sections=2),  # rows [gate; value], each cut alike
        "mlp.fc2": RowParallel(),  # fp32 all-reduce after it
        "adaln_proj.linear": ColumnParallel(),  # blocks and final layer; outputs all-gathered
    }

    def __init__(self, cfg: DiTConfig, compute_dtype: torch.dtype = torch.bfloat16, chunk_rows: int = 4096,
                 tp_group: dist.ProcessGroup | None = None, linear_factory: LinearFactory | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 attention_fn: AttentionFn | None = None, sp_group: dist.ProcessGroup | None = None):
        super().__init__()
        if chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.chunk_rows = chunk_rows
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = group_rank_size(tp_group)
        self.sp_group = sp_group
        self.sp_rank, self.sp_size = group_rank_size(sp_group)
        validate_parallel(cfg, self.tp_size, self.sp_size)
        factory = linear_factory or self._default_factory(cfg, compute_dtype, self.tp_size, device, dtype)
        ctx = _Ctx(cfg, compute_dtype, chunk_rows, tp_group, self.tp_size, factory, self._tp_plan,
                   attention_fn or sdpa_attention, sp_group)

        self.video_patch_proj = ctx.linear("video_patch_proj", cfg.video_patch_dim, cfg.hidden, True)
        self.audio_patch_proj = ctx.linear("audio_patch_proj", cfg.audio_in_channels, cfg.hidden, True)
        self.condition_proj = ctx.linear("condition_proj", cfg.text_dim, cfg.hidden, True)
        if cfg.adaln_form == "mlp":
            self.time_embedder = TimeEmbedder(ctx)
        else:
            # Comfy "pruned" curve: rank-r coordinates of silu(temb(t)) on a uniform t grid (docs/model.md §2.10).
            self.adaln_t_table = nn.Parameter(torch.zeros(cfg.adaln_curve_grid, cfg.adaln_curve_rank,
                                                          device=device, dtype=torch.float32), requires_grad=False)
        self.rope = RoPE(cfg)
        self.token_refiner = TokenRefiner(ctx)
        self.blocks = nn.ModuleList(Block(ctx, f"blocks.{i}") for i in range(cfg.num_layers))
        self.final_layer = FinalLayer(ctx)
        # Set by the engine when some blocks stream from host memory (minimax_h3/dit/streaming.py); None = all resident.
        self.block_stream = None
        for mod in self.modules():  # norms are created without device/dtype above
            if isinstance(mod, RMSNorm) and (device is not None or dtype is not None):
                mod.to(device=device, dtype=dtype)

    # ---- construction helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _default_factory(cfg, compute_dtype, tp_size, device, dtype) -> LinearFactory:
        def make(name: str, fin: int, fout: int, bias: bool, style: TPStyle | None) -> nn.Module:
            kw = dict(device=device, dtype=dtype)
            if (name + ".").startswith(FP32_PARAM_PREFIXES):  # release fp32 islands
                return Linear(fin, fout, bias, compute_dtype=torch.float32, **kw)
            if isinstance(style, ColumnParallel):
                # Curve-form AdaLN runs in fp32 (its [.., 8] weights are tiny); release AdaLN in compute dtype.
                curve = cfg.adaln_form == "curve" and name.endswith(".adaln_proj.linear")
                cd = torch.float32 if curve else compute_dtype
                return ColumnParallelLinear(fin, fout, tp_size, bias, compute_dtype=cd, **kw)
            if isinstance(style, RowParallel):
                return RowParallelLinear(fin, fout, tp_size, bias, compute_dtype=compute_dtype, **kw)
            return Linear(fin, fout, bias, compute_dtype=compute_dtype, **kw)

        return make

    def linear_names(self) -> list[str]:
        """Qualified names of every linear module (swap targets)."""
        return [n for n, m in self.named_modules()
                if isinstance(m, (Linear, nn.Linear)) or n.rsplit(".", 1)[-1] in _LINEAR_LEAF_NAMES]

    def swap_linear(self, name: str, module: nn.Module) -> None:
        """Replace linear `name` (e.g. "blocks.3.attn.qkv_proj") with any module computing y = x W^T (+ b)."""
        # The module now at `name`, checked as `linear_names` does (a lookup, not a walk of all ~700 modules: a load
        # swaps ~200 linears).
        try:
            current = self.get_submodule(name)
        except AttributeError:
            current = None
        if current is None or not (isinstance(current, (Linear, nn.Linear))
                                   or name.rsplit(".", 1)[-1] in _LINEAR_LEAF_NAMES):
            raise KeyError(f"{name!r} is not a linear of this model; see H3DiT.linear_names()")
        self.set_submodule(name, module)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        """Use attention kernel `fn` in every block and refiner block (e.g. after a minimax_h3.kernels.registry probe)."""
        for mod in self.modules():
            if isinstance(mod, Attention):
                mod.attention_fn = fn

    def cast_release_dtypes(self, dtype: torch.dtype = torch.bfloat16) -> "H3DiT":
        """Store params like the release: fp32 islands stay fp32, everything else in `dtype`."""
        for name, p in self.named_parameters():
            p.data = p.data.float() if name.startswith(FP32_PARAM_PREFIXES) else p.data.to(dtype)
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # `rope.inv_freq` is in release/Comfy files; it is a deterministic function of the config, so check & drop.
        sd = dict(state_dict)
        inv = sd.pop("rope.inv_freq", None)
        if inv is not None and inv.numel() != self.cfg.rope_freq_dim:
            raise ValueError(f"checkpoint rope.inv_freq has {inv.numel()} entries, config rope_freq_dim is "
                             f"{self.cfg.rope_freq_dim}")
        return super().load_state_dict(sd, strict=strict, assign=assign)

    # ---- forward pieces -------------------------------------------------------------------------------------------
    def timestep_table(self, t_video, t_audio, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The timestep of every kind [NUM_KINDS] (fp32; kinds absent from the layout included: AdaLN rows are
        cheap) and each row's index into it [S], which is its kind. Device ops only: no host sync per step (a
        dedupe with torch.unique would wait for the GPU to learn its output size)."""
        dev = layout.kind.device
        tv = torch.as_tensor(t_video, dtype=torch.float32, device=dev).reshape(())
        ta = torch.as_tensor(t_audio, dtype=torch.float32, device=dev).reshape(())
        per_kind = torch.stack([tv, torch.clamp(tv, min=COND_VIDEO_T), ta, torch.clamp(ta, min=REF_AUDIO_T)])
        return per_kind, layout.kind

    def adaln_input(self, ts: torch.Tensor) -> torch.Tensor:
        """[M] timesteps -> [M, adaln_in] fp32 input of every AdaLN projection."""
        cfg = self.cfg
        if cfg.adaln_form == "mlp":
            return F.silu(self.time_embedder(timestep_sinusoid(ts, cfg.freq_dim)))
        table = self.adaln_t_table.float()
        last = cfg.adaln_curve_grid - 1
        pos = ts.float().clamp(0.0, 1.0) * last
        i0 = pos.floor().long().clamp(max=last - 1)
        frac = (pos - i0.float())[:, None]
        return torch.lerp(table.index_select(0, i0), table.index_select(0, i0 + 1), frac)

    def forward(self, video_rows: torch.Tensor, audio_rows: torch.Tensor, text_states: torch.Tensor,
                t_video: torch.Tensor | float, t_audio: torch.Tensor | float,
                layout: PackedLayout, step_cache: FirstBlockCache | None = None,
                sparse: VsaStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising evaluation.

        video_rows [Nv, 96] (conditioning rows first, then target rows), audio_rows [Na, 32] (channel-major),
        text_states [L, text_dim], t_video / t_audio scalars (t = 1 - sigma, 1 = clean). `step_cache`: the sampling
        run's First Block Cache (`quality = "fast"`, minimax_h3/dit/step_cache.py), which may skip blocks 1.. of this
        evaluation; None runs every block. `sparse`: VSA block-sparse attention in the blocks of this evaluation
        (minimax_h3/dit/sparse.py); None: dense.
        Returns data-ward velocities (x0 - noise) (video [Nv, 96], audio [Na, 32]) in fp32, conditioning rows included.
        """
        cfg = self.cfg
        if video_rows.shape != (layout.num_video_rows, cfg.video_patch_dim):
            raise ValueError(f"video_rows must be [{layout.num_video_rows}, {cfg.video_patch_dim}], "
                             f"got {tuple(video_rows.shape)}")
        if audio_rows.shape != (layout.num_audio_rows, cfg.audio_in_channels):
            raise ValueError(f"audio_rows must be [{layout.num_audio_rows}, {cfg.audio_in_channels}], "
                             f"got {tuple(audio_rows.shape)}")
        if text_states.shape != (layout.text_len, cfg.text_dim):
            raise ValueError(f"text_states must be [{layout.text_len}, {cfg.text_dim}], got {tuple(text_states.shape)}")

        ts, row_ti = self.timestep_table(t_video, t_audio, layout)
        ada_in = self.adaln_input(ts)
        rows = row_ti * NUM_MODALITIES + layout.tag  # AdaLN table row of each sequence row
        rope = self.rope(layout.position_ids)

        x = torch.zeros(layout.seq_len, cfg.hidden, dtype=torch.float32, device=video_rows.device)
        text = self.token_refiner(self.condition_proj(text_states.to(self.compute_dtype)).float())
        x.index_copy_(0, layout.text_idx, text)
        for idx, inp, proj in ((layout.video_idx, video_rows, self.video_patch_proj),
                               (layout.audio_idx, audio_rows, self.audio_patch_proj)):
            for i, r in zip(idx.split(self.chunk_rows), inp.split(self.chunk_rows)):  # bounds the fp32 [rows, hidden]
                x.index_copy_(0, i, proj(r.float()).float())

        shards = None
        if self.sp_group is not None:
            # Sequence parallel: the blocks run on this rank's contiguous share of the rows (minimax_h3/dit/sp.py).
            shards = SeqShards.split(layout.seq_len, self.sp_rank, self.sp_size)
            part = shards.rows()
            x, rows, rope = x[part].clone(), rows[part], (rope[0][part], rope[1][part])
        blocks = self.blocks if self.block_stream is None else self.block_stream.iterate(self.blocks)

        def run_blocks(blocks, x):
            """The blocks in order on x (in place, returned), each block's deferred gated add made by the next one's
            first modulation (`Block.forward`), the last one's here."""
            added = None
            for blk in blocks:
                added = blk(x, ada_in, rows, rope, shards, None if sparse is None else sparse.for_block(blk.index),
                            added)
            if added is not None:
                gated_add(x, added.gate, added.part, rows)
            return x

        x = run_blocks(blocks, x) if step_cache is None else step_cache.run(blocks, x, run_blocks)
        if shards is not None:
            # Every rank's rows in rank (= row) order, padded to one size for the all-gather: all ranks then run
            # the output heads on the same bits.
            padded = x.new_zeros(max(shards.sizes), x.shape[1])
            padded[: shards.local] = x
            parts = [torch.empty_like(padded) for _ in range(shards.n)]
            dist.all_gather(parts, padded, group=self.sp_group)
            x = torch.cat([p[:n] for p, n in zip(parts, shards.sizes)])
        return self.final_layer(x, ada_in, row_ti, layout.video_idx, layout.audio_idx)


_LINEAR_LEAF_NAMES = ("qkv_proj", "out_proj", "fc1", "fc2", "linear", "video_out", "audio_out", "proj_in",
                      "proj_out", "video_patch_proj", "audio_patch_proj", "condition_proj", "to_gate_compress")


# ---------------------------------------------------------------------------------------------------------------------
# Curve-form AdaLN construction from an unpruned (mlp-form) state dict
# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def curve_state_dict_from_mlp(full_sd: dict[str, torch.Tensor], cfg: DiTConfig) -> tuple[dict[str, torch.Tensor],
                                                                                         DiTConfig]:
    """Build the Comfy "pruned" curve-form checkpoint from a release one (docs/model.md §2.10 item 3):
    curve c(t_k) = silu(temb(t_k)), t_k = k/(G-1); table = U_r S_r of the rank-r SVD of (c - mean);
    W' = W V_r, b' = b + W mean for every AdaLN projection. Exact when rank(c - mean) <= r at grid points."""
    if cfg.adaln_form != "mlp":
        raise ValueError("curve_state_dict_from_mlp expects an mlp-form config")
    ccfg = cfg.replace(adaln_form="curve")
    grid = torch.linspace(0.0, 1.0, cfg.adaln_curve_grid, dtype=torch.float64)
    w1, b1 = full_sd["time_embedder.proj_in.weight"].double(), full_sd["time_embedder.proj_in.bias"].double()
    w2, b2 = full_sd["time_embedder.proj_out.weight"].double(), full_sd["time_embedder.proj_out.bias"].double()
    e = timestep_sinusoid(grid.float(), cfg.freq_dim).double()
    curve = F.silu(F.silu(e @ w1.T + b1) @ w2.T + b2)  # [G, time_embed_dim]
    mean = curve.mean(0)
    u, s, vh = torch.linalg.svd(curve - mean, full_matrices=False)
    r = cfg.adaln_curve_rank
    basis = vh[:r].T  # [time_embed_dim, r] (zero-padded if rank r exceeds the width)
    table = u[:, :r] * s[:r]
    if basis.shape[1] < r:
        basis = F.pad(basis, (0, r - basis.shape[1]))
        table = F.pad(table, (0, r - table.shape[1]))
    out = {k: v for k, v in full_sd.items() if not k.startswith("time_embedder.")}
    out["adaln_t_table"] = table.float()
    for k in list(out):
        if k.endswith("adaln_proj.linear.weight"):
            w = full_sd[k].double()
            b = full_sd[k[:-len("weight")] + "bias"].double()
            out[k] = (w @ basis).to(full_sd[k].dtype)
            out[k[:-len("weight")] + "bias"] = (b + w @ mean).to(full_sd[k].dtype)
    return out, ccfg
