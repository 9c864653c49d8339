"""The DiT stage's engine: load this rank's shard, run the sampler, unload.

Every rank runs the same code on the same job (rank 0 broadcast it); the model's
own forward does the tensor-parallel all-reduces, and `ctx.should_stop()` makes
all ranks agree on cancellation at each step boundary.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from minimax_h3.contract import (AUDIO_CHANNELS, AUDIO_LATENTS, CONTINUATION, IMAGE_FRAMES, IMAGE_PROMPT_ONLY,
                                 KEYFRAME_TENSORS, PARTITIONS, SINGLE, TAIL_AUDIO, TAIL_VIDEO, TEXT_STATES, TEXT_TAGS,
                                 VAE_SPATIAL, VIDEO_LATENTS, LatentGeometry, RenderSpec, WindowPlan, check_partition,
                                 has_references, keyframe_anchors, needed_partition, plan_windows, prompt_tensor)
from minimax_h3.dit.assembly import assemble_dit, block_linears, kernel_linears
from minimax_h3.dit.checkpoint import (CheckpointInfo, check_checkpoint, load_dit_weights,
                                       partition_undecided)
from minimax_h3.dit.config import TAG_TEXT, TAG_VIDEO, DiTConfig
from minimax_h3.dit.guides import GUIDES_INPUT, Guides, has_guides, parse_guides
from minimax_h3.dit.keyframes import check_keyframe, check_text_tags, condition_rows, conditioned_denoise
from minimax_h3.dit.layout import (build_layout, build_ref2va_layout, latent_shape, patchify_video, unpatchify_audio,
                                   unpatchify_video)
from minimax_h3.dit.lora import LoRAManager, check_lora_file, config_targets, lora_names, resolve_lora_path
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.references import REFERENCES_INPUT, References, parse_references
from minimax_h3.dit.sampling import SamplerConfig, draw_noise, sample, schedule
from minimax_h3.dit.sp import ParallelGroups, make_groups, validate_parallel
from minimax_h3.dit.sparse import plan_vsa
from minimax_h3.dit.step_cache import FAST_THRESHOLD, FirstBlockCache
from minimax_h3.dit.streaming import BlockStream, Placement, plan_placement
from minimax_h3.dit.windows import sample_continuation, sample_fused, window_rows
from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
from minimax_h3.dit.tp import param_style
from minimax_h3.files import CHECKPOINT_PARTS, ensure_embedded, find_part, shown_models_dir
from minimax_h3.kernels.int8 import Int8ConvRotLinear, QuantizedWeight
from minimax_h3.kernels.registry import (AUTO, VSA_OP, KernelConfig, KernelSelection, select_kernels_remembered,
                                        select_vsa_kernel)
from minimax_h3.kernels.vsa import REFERENCE_CHUNK_BYTES
from minimax_h3.kernels.tuning import chunk_rows as tuned_chunk_rows
from stagekit.checkpoints import WeightSource, derived_key
from stagekit.child import run_in_child
from stagekit.compile_cache import enable_compile_cache
from stagekit.dist import RankGroup
from stagekit.engine import StageEngine
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.runtime import release_device_memory
from stagekit.wire import check_finite

log = logging.getLogger("dit_svc")

# File names users have (ComfyUI) and the diffusers / release folders, per partition: one candidate of each may be
# under --models-dir (docs/references.md); the table is minimax_h3.files.CHECKPOINT_PARTS ("dit", "dit_ref2va").
CHECKPOINT_PATTERNS, CHECKPOINT_EXCLUDE = CHECKPOINT_PARTS["dit"].patterns, CHECKPOINT_PARTS["dit"].exclude
REF2VA_PATTERNS = CHECKPOINT_PARTS["dit_ref2va"].patterns
# The embedded tiny model provides both partitions (other seeds: other weights, as in the release).
EMBEDDED_FILES = {"fl2va": "dit_tiny_bf16.safetensors", "ref2va": "dit_tiny_ref2va_bf16.safetensors"}
EMBEDDED_SEEDS = {"fl2va": 0, "ref2va": 1}


def embedded_config() -> DiTConfig:
    """The embedded default: tiny dims, one block and two heads so an 832x480x124 render stays quick on a
    2-core CPU (attention over ~15k rows dominates). Tests use DiTConfig.tiny() for the multi-block paths."""
    return DiTConfig.tiny(num_layers=1, num_heads=2)
# The DiT result's count of steps whose blocks after the first were skipped (SampleDone.cached_steps), and of steps
# whose blocks ran VSA (SampleDone.sparse_steps).
CACHED_STEPS = "cached_steps"
SPARSE_STEPS = "sparse_steps"
# Text length assumed by estimates made before the text states are known (the encoder's usual prompt budget).
DEFAULT_TEXT_LEN = 512
# The job inputs holding a long render's later prompts' states (in order) and an extension's guide (video, audio).
PROMPTS_INPUT, GUIDE_INPUT = "prompts", "guide"
# Threads that read this rank's tensors and copy them to the GPU concurrently (docs/memory.md: swap-in speed).
LOAD_WORKERS = 8
# cuBLAS / cuDNN workspaces live in PyTorch's caching allocator (measured ~20-30 MiB on an H200 at tiny sizes).
CUDA_WORKSPACE_BYTES = 32 << 20
# Device bytes a job plan leaves unused beside what it counts: allocations outside PyTorch's allocator that appear
# during a job (library handles, a TP group's first communicator) and the allocator's rounding.
CUDA_ROOM_MARGIN = 512 << 20


def resolve_chunk_rows(chunk_rows: int, compile_blocks: bool, tp_size: int, arch: str) -> int:
    """The row chunk a DiT engine runs with: `chunk_rows` if set (> 0), else the default for its mode tuned on GPU
    architecture `arch` (minimax_h3/kernels/tuning.json "chunk_rows"; docs/performance.md, "Row chunks"): eager
    blocks keep their fp32 norm / RoPE / modulation temporaries one chunk at a time (what lets a TP2 rank fit a
    22 GB card); compiled blocks fuse those temporaries away, so the chunk then only trades all-reduce overlap (TP)
    against per-chunk kernel launches and GEMM efficiency."""
    if chunk_rows < 0:
        raise FailedPrecondition(f"--chunk-rows must be a positive row count, or 0 for the default; got {chunk_rows}")
    return chunk_rows or tuned_chunk_rows(arch).pick(compile_blocks, tp_size)


@dataclass
class DiTEngineConfig:
    weights: str                 # file / diffusers dir; "" = embedded tiny model
    models_dir: str
    cache_dir: Path
    device: str
    compute_dtype: torch.dtype
    int8_mode: str = "kernel"    # CPU only: "kernel" (comfy-kitchen eager) | "dequant" (dequantise once at load)
    chunk_rows: int = 0          # row chunk of all but attention (bounds the qkv / MLP / norm temporaries); 0 = auto
    linear_kernel: str = "auto"  # GPU block linears: auto (measured probe) | int8 | fp8 | bf16 | fp16 | fp32
    attention_kernel: str = "auto"  # GPU attention: auto | cudnn | flash | efficient | math | int8 | fp8
    compile_blocks: bool = False    # torch.compile each block on the GPU (~1.4x faster step; compiles per shape)
    compile_cache_dir: Path | None = None  # persistent torch.compile cache root (stagekit/compile_cache.py)
    sp_degree: int = 1           # sequence-parallel degree (minimax_h3/dit/sp.py); TP degree = ranks / sp_degree
    loras_dir: str = ""          # request LoRAs by bare file name from here ("" = LoRAs by name disabled)
    allow_lora_paths: bool = False  # also accept absolute LoRA paths in requests (trusted clients only)
    qkv_layout: str = ""         # "stacked" | "interleaved": q/k/v row order of a file that does not show it ("" =
                                 # decide from evidence, refuse when there is none; docs/checkpoints.md)
    partition: str = ""          # "fl2va" | "ref2va": the partition of a file whose name and metadata do not say
                                 # ("" = decide from them, refuse when they cannot tell; docs/references.md)
    memory_limit_bytes: int = 0  # what one rank may hold on its device (the stage's memory budget; 0 = no limit)
    memory_cap_bytes: int = 0    # the card size all processes on the GPU are held to (--gpu-memory-cap-gb; 0 = the card)
    kernels: KernelSelection | None = None  # GPU kernels already chosen (the stage's start-up probe, handed to its
                                            # device worker); None = probe
    fast_threshold: float = FAST_THRESHOLD  # quality "fast": First Block Cache's skip threshold (step_cache.py)


def target_rows(m: DiTConfig, spec: RenderSpec) -> int:
    """Packed rows of one model call besides text and keyframe rows: the sampled latents' video patches and audio
    frames, or for a render in windows the largest window's (its guide's rows included): a windowed render holds
    one window on the device at a time (docs/long_video.md)."""
    plan = plan_windows(spec)
    if plan.mode == SINGLE:
        shp = latent_shape(m, spec.frames, spec.height, spec.width)
        _, ph, pw = m.patch
        return (shp.latent_frames * (shp.latent_height // ph) * (shp.latent_width // pw)
                + AUDIO_CHANNELS * shp.audio_latents)
    return max(window_rows(m, w, spec.height, spec.width) for w in plan.windows)


def activation_bytes(m: DiTConfig, rows: int, compute_dtype: torch.dtype, chunk_rows: int, tp: int = 1, sp: int = 1,
                     cuda: bool = True, step_cache: bool = False, vsa: bool = False) -> int:
    """Peak activation bytes of a job of `rows` packed rows on one rank of `tp` x `sp` (docs/memory.md).

    Whole-sequence tensors, per packed row: the fp32 residual stream (hidden x 4 B); q, k, v and the attention
    output (4 x local inner x compute-dtype bytes: attention needs them whole); RoPE cos/sin (fp32); the
    sampler's fp32 latent state (~8 copies of a patch row). Everything else lives one row chunk at a time
    (minimax_h3/dit/model.py Block): the larger of the qkv step (projection, fp32 norm/RoPE temporaries, the fp32
    modulated input) and the MLP step ([chunk, 3 x ffn / tp] in the compute dtype). Padded by 15 % for allocator
    slack, plus the cuBLAS / cuDNN workspaces on CUDA. An estimate to budget with (measured peaks:
    docs/memory.md), not a promise. Sequence parallel (minimax_h3/dit/sp.py): the whole-sequence tensors shrink to this
    rank's rows, plus the all-to-all buffers held while attention runs (~5 x local inner per row); the sampler
    state stays whole. `step_cache` (quality "fast", minimax_h3/dit/step_cache.py): three more fp32 copies of the
    residual stream (the cached block-0 and tail residuals, and the current step's block-0 residual). `vsa` (a job
    with sparse attention, minimax_h3/kernels/vsa.py): the gate rows, q, k, v and the output in tile order (the
    padding of the tiles is a few %, not counted), the output back in row order and the fp32 gated coarse branch
    (6 x local inner in the compute dtype and 4 x in fp32 per row), plus one chunk of the reference's gathered keys
    and values.
    """
    e = torch.empty((), dtype=compute_dtype).element_size()
    inner = m.num_heads * m.head_dim // tp
    local = -(-rows // sp)
    residual = m.hidden * 4 * (4 if step_cache else 1)
    per_local_row = residual + (4 + (5 if sp > 1 else 0)) * inner * e + 2 * m.rope_dim * 4
    if vsa:
        per_local_row += (6 * e + 4) * inner
    per_row = 8 * max(m.video_patch_dim, m.audio_in_channels) * 4
    qkv_step = 3 * inner * e + 6 * inner * 4 + 2 * m.hidden * 4 + m.hidden * e
    mlp_step = 3 * (m.ffn // tp) * e + 3 * m.hidden * 4 + m.hidden * e
    chunk = min(local, chunk_rows) * max(qkv_step, mlp_step)
    fixed = (CUDA_WORKSPACE_BYTES if cuda else 0) + (REFERENCE_CHUNK_BYTES if vsa else 0)
    return int((local * per_local_row + rows * per_row + chunk) * 1.15) + fixed


def resolve_weights(cfg: DiTEngineConfig) -> tuple[dict[str, Path | None], bool]:
    """({partition: declared partition or None, for each checkpoint path}, is_embedded): the --weights file, every
    DiT checkpoint under --models-dir (the one candidate of each partition), or the embedded tiny pair."""
    if cfg.weights:
        p = Path(cfg.weights).expanduser()
        if not p.exists():
            raise FailedPrecondition(f"MiniMax-H3 DiT checkpoint weights {p} do not exist")
        return {p: cfg.partition or None}, False
    if cfg.models_dir:
        found: dict[Path, str | None] = {}
        for part in ("dit", "dit_ref2va"):
            try:
                found[find_part(cfg.models_dir, part)] = cfg.partition or None
            except FailedPrecondition as e:
                if not str(e).startswith("no "):  # two candidates of one partition: refused, naming both
                    raise
        if not found:
            raise FailedPrecondition(f"no MiniMax-H3 DiT checkpoint found under {cfg.models_dir}: looked for "
                                     f"{', '.join((*CHECKPOINT_PATTERNS, *REF2VA_PATTERNS))}; pass the file explicitly "
                                     "with --weights")
        return found, False
    paths = {}
    for part, name in EMBEDDED_FILES.items():
        path = ensure_embedded(cfg.cache_dir, name, lambda tmp, part=part: write_tiny_checkpoint(
            embedded_config(), tmp, "bf16", seed=EMBEDDED_SEEDS[part], partition=part))
        paths[path] = part  # ours: known, whatever an older cache's file states
    return paths, True


def check_partitions(cfg: DiTEngineConfig, paths: dict[Path, str | None]) -> dict[str, CheckpointInfo]:
    """Validate every candidate from its headers and keep the first file of each partition; refuses a file whose
    partition cannot be told, and partitions whose configurations differ."""
    infos: dict[str, CheckpointInfo] = {}
    for path, declared in paths.items():
        info = check_checkpoint(path, qkv_layout=cfg.qkv_layout or None, partition=declared)
        if info.partition.partition is None:
            raise partition_undecided(path, info.partition)
        part = info.partition.partition
        if part in infos:
            log.info("%s: another %s file (%s) comes first; not used", path, part, infos[part].path.name)
            continue
        log.info("%s: partition %s (%s)", path, part, info.partition.evidence)
        infos[part] = info
    configs = {p: i.config.replace(vsa_gates=False) for p, i in infos.items()}  # a FastH3 file serves beside a base one
    if len(set(configs.values())) > 1:
        seen = ", ".join(f"{infos[p].path.name}: {c.num_layers} blocks, hidden {c.hidden}" for p, c in configs.items())
        raise FailedPrecondition(f"the DiT files do not share one configuration ({seen}); use files of one model")
    return {p: infos[p] for p in PARTITIONS if p in infos}


class DiTEngine(StageEngine[RenderSpec]):
    name = "dit"

    def __init__(self, cfg: DiTEngineConfig, group: RankGroup):
        self.cfg = cfg
        self.group = group
        paths, self.embedded = resolve_weights(cfg)
        # Every checkpoint is validated here, from its headers, before the stage reports SERVING: a bad file fails
        # start-up naming file and key (stagekit.checkpoints.CheckpointError), never the first job. One file per
        # partition is served; the runtime loads the one a job needs before it runs (`weight_files`).
        self.partitions: dict[str, CheckpointInfo] = check_partitions(cfg, paths)
        self._select(next(iter(self.partitions)))
        m = self.model_cfg  # the latents this DiT takes and makes (minimax_h3.contract's tensor table)
        self.geometry = LatentGeometry(m.in_channels, VAE_SPATIAL, m.audio_in_channels)
        if not cfg.fast_threshold >= 0:
            raise FailedPrecondition(f"--fast-threshold must be >= 0 (default {FAST_THRESHOLD}), got {cfg.fast_threshold}")
        if group.world_size % cfg.sp_degree:
            raise FailedPrecondition(f"--sp-degree {cfg.sp_degree} does not divide the {group.world_size} DiT ranks")
        validate_parallel(self.model_cfg, group.world_size // cfg.sp_degree, cfg.sp_degree)
        # TP x SP groups of the compute group's ranks (every rank builds them, in the same order).
        self.parallel: ParallelGroups = make_groups(group.info.rank, group.world_size, cfg.sp_degree,
                                                    group.collective_timeout)
        # Measured at start-up, before any job, so Status shows it (and a forced kernel that cannot run fails the
        # start); a device worker builds its engine from `self.cfg`, which carries the choice.
        self.kernels = cfg.kernels if cfg.kernels is not None else self._select_kernels()
        self.cfg = replace(cfg, kernels=self.kernels)
        arch = "cpu" if self.kernels is None else self.kernels.arch  # whose tuned row chunks apply
        self.chunk_rows = resolve_chunk_rows(cfg.chunk_rows, cfg.compile_blocks and cfg.device.startswith("cuda"),
                                             self.parallel.tp_size, arch)
        log.info("row chunk: %d rows%s", self.chunk_rows, "" if cfg.chunk_rows else " (default for this mode)")
        self._compile_cache_on = False
        self.model: H3DiT | None = None
        self.stream: BlockStream | None = None  # where the loaded blocks live, job by job (minimax_h3/dit/streaming.py)
        self.placement: Placement | None = None  # the last job's
        self.windows: str = ""  # the last job's window plan (WindowPlan.describe)
        self.loras: LoRAManager | None = None  # per-rank LoRA cache; lives as long as the loaded model
        self._lora_targets = None  # full-size linear shapes for header-only LoRA validation (rank 0)
        self.load_phases: dict[str, float] = {}  # the last load's steps in seconds (the `loaded` event carries them)

    # ---- partitions -----------------------------------------------------------------------------------------------
    def _select(self, partition: str) -> None:
        info = self.partitions[partition]
        self.partition = partition
        self.model_cfg: DiTConfig = info.config  # the partitions' configs differ at most in their VSA gates
        self.path = info.path
        self.variant = info.variant.name
        self._header_shapes = info.shapes  # for weight-size estimates before loading

    def _partition_of(self, files: tuple[Path, ...]) -> str:
        """The partition whose file(s) a load reads (`weight_files`)."""
        for p, info in self.partitions.items():
            if tuple(info.files) == tuple(files):
                return p
        raise ValueError(f"no served DiT partition reads {[str(f) for f in files]}; served: "
                         f"{ {p: [str(f) for f in i.files] for p, i in self.partitions.items()} }")

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_process() -> None:
        """Run by a device worker on standby (stagekit/device_worker.py): the int8 kernel library's import (seconds:
        it loads its CUDA and Triton backends), which the first load would pay otherwise. It touches no device."""
        try:
            import comfy_kitchen  # noqa: F401
        except ImportError:  # the load then uses what the kernel registry chose without it
            pass

    def weight_files(self, spec: RenderSpec | None = None, inputs: Mapping[str, Any] | None = None
                     ) -> tuple[Path, ...]:
        """The files of the partition a job needs (ref2va for references, fl2va otherwise; the selected one for an
        operator's Load): the runtime loads them before the job runs, one partition resident at a time, and the
        stage keeps them in host memory between turns when the host has room (stagekit/host_copy.py)."""
        partition = self.partition if spec is None else needed_partition(REFERENCES_INPUT in (inputs or {}))
        return tuple(self.partitions[partition].files)

    def load_report(self) -> dict:
        """The last load's steps in seconds, for the `loaded` event."""
        return {"load_phases": dict(self.load_phases)} if self.load_phases else {}

    def _select_kernels(self) -> KernelSelection | None:
        """GPU: probe and pick the block-linear and attention kernels (or check the forced ones). CPU has only the
        fallbacks (dense linears in the compute dtype, PyTorch's default SDPA), so nothing is probed there."""
        cfg = self.cfg
        if not cfg.device.startswith("cuda"):
            if (cfg.linear_kernel, cfg.attention_kernel) != (AUTO, AUTO):
                raise FailedPrecondition("--linear-kernel/--attention-kernel choose GPU kernels; on CPU leave them auto")
            return None
        return run_in_child(_probe_kernels, cfg)  # the stage process itself never holds a CUDA context

    def _enable_compile_cache(self) -> None:
        """In the process that compiles (the device worker), before its first compilation."""
        if not self._compile_cache_on and self.cfg.compile_cache_dir is not None and self.cfg.device.startswith("cuda"):
            log.info("torch.compile cache: %s", enable_compile_cache(self.cfg.compile_cache_dir, self.cfg.device))
            self._compile_cache_on = True

    def kernel_rows(self) -> list[tuple[str, str, str]]:
        return self._kernel_rows() + [self._vsa_row(), self._placement_row(), self._windows_row()]

    def _windows_row(self) -> tuple[str, str, str]:
        if not self.windows:
            return ("windows", "one window up to 515 frames", "decided per job: longer renders, renders with several "
                    "prompts and extensions are sampled in windows, one on the device at a time (docs/long_video.md)")
        return ("windows", self.windows, "last job")

    def _vsa_row(self) -> tuple[str, str, str]:
        """Which VSA kernel a job with sparse attention gets (minimax_h3/kernels/vsa.py), or why this DiT takes
        none ("unavailable": the render service refuses such a job at Submit with the reason)."""
        if self.cfg.sp_degree > 1:
            return (VSA_OP, "unavailable", f"VSA attends all rows of a rank at once: this DiT runs --sp-degree "
                    f"{self.cfg.sp_degree}; start it with --sp-degree 1 to take sparse-attention jobs")
        if self.kernels is not None and self.kernels.vsa is not None:
            return self.kernels.vsa.as_tuple()
        return select_vsa_kernel(self.cfg.device, self.cfg.compute_dtype).as_tuple()

    def _placement_row(self) -> tuple[str, str, str]:
        p = self.placement
        if p is None:
            return ("weights", "all blocks resident", "decided per job: blocks stream from host memory when the job's "
                    "activations and the weights do not fit the device")
        return ("weights", p.describe(), f"last job: planned peak {p.need_bytes / 2**30:.2f} GiB of "
                f"{p.room_bytes / 2**30:.2f} GiB room" if p.room_bytes else "last job: no memory limit")

    def _kernel_rows(self) -> list[tuple[str, str, str]]:
        if self.kernels is not None:
            return [r for r in self.kernels.status_rows() if r[0] != VSA_OP]
        dtype = str(self.cfg.compute_dtype).replace("torch.", "")
        lin = f"int8 convrot eager ({self.cfg.int8_mode})" if "int8" in self.variant else f"dense {dtype}"
        return [("linear", lin, "cpu: only the fallback kernels exist"),
                ("attention", "sdpa default", "cpu: only the fallback kernels exist")]

    def load(self, source: WeightSource) -> None:
        if self.model is not None:
            return
        self._select(self._partition_of(source.files))
        self._enable_compile_cache()
        t0 = time.monotonic()
        cfg, dev = self.cfg, self.cfg.device
        quant_mode = "kernel" if self.kernels is not None else cfg.int8_mode  # GPU: the registry decides per linear
        par = self.parallel
        kept = self._kept_conversions(source)  # linears an earlier turn converted, kept by the stage in host memory
        weights = load_dit_weights(self.path, self.model_cfg, par.tp_rank, par.tp_size,
                                   quant_mode=quant_mode, dtype=cfg.compute_dtype, qkv_layout=cfg.qkv_layout or None,
                                   device=dev, workers=LOAD_WORKERS if dev.startswith("cuda") else 1,
                                   skip=[f"{n}.weight" for n in kept], source=source)
        for name, qw in kept.items():
            weights[f"{name}.weight"] = QuantizedWeight(source.to_device(qw.qdata, dev),
                                                        source.to_device(qw.scale, dev), qw.groupsize)
        t1 = time.monotonic()
        phases = dict(weights.timings, kept_conversions=len(kept))
        assembly: dict[str, float] = {}
        make_linear = kernel_linears(self.model_cfg, self.kernels, quant_mode, cfg.compute_dtype)
        converted: dict[str, torch.nn.Module] = {}
        model = assemble_dit(self.model_cfg, weights, make_linear, dev, cfg.compute_dtype, self.chunk_rows,
                             tp_group=par.tp_group, sp_group=par.sp_group,
                             attention_fn=self.kernels.attention_fn() if self.kernels is not None else None,
                             compile_blocks=cfg.compile_blocks, timings=assembly, converted=converted)
        if converted and self._conversions(self.partitions[self.partition]):
            self._keep_conversions(converted, source)
        self.model = model
        self.stream = BlockStream(model.blocks, dev)
        model.block_stream = self.stream
        self.loras = LoRAManager(self.model)
        del weights
        t2 = time.monotonic()
        release_device_memory(dev)  # blocks of converted sources go back to the card, not to this process's cache
        t3 = time.monotonic()
        phases.update({f"assembly_{k}": v for k, v in assembly.items()})
        phases.update(weights_s=t1 - t0, assembly_s=t2 - t1, release_s=t3 - t2)
        self.load_phases = {k: round(v, 4) for k, v in phases.items()}
        log.info("rank %d loaded %s (%s) in %.2f s (weights %.2f s: check %.2f, read %.2f, finite %.2f; assembly "
                 "%.2f s: build %.2f, linears %.2f, state %.2f, finish %.2f; release %.2f s)",
                 self.group.info.rank, self.path.name, self.variant, t3 - t0, t1 - t0, phases["check"],
                 phases["read"], phases["finite"], t2 - t1, assembly["build"], assembly["linears"], assembly["state"],
                 assembly["finish"], t3 - t2)

    # ---- conversions kept between turns (stagekit/host_copy.py, "Derived copies") -----------------------------------
    def _conversions(self, info: CheckpointInfo) -> dict[str, tuple[int, ...]]:
        """{linear name: weight shape} of the linears every load of `info`'s file converts: those the start-up
        probe's int8 kernel serves that the file stores in another dtype (the release's token refiner is bf16). One
        rank only (a stage keeps host copies only then)."""
        if self.kernels is None or self.kernels.linear != "int8" or self.parallel.tp_size != 1:
            return {}
        shapes = info.shapes
        return {n: tuple(shapes[n + ".weight"].shape) for n in sorted(block_linears(self.model_cfg))
                if n + ".weight" in shapes and shapes[n + ".weight"].dtype != "I8"}

    def _conversion_key(self, path: Path) -> str:
        dtype = str(self.cfg.compute_dtype).replace("torch.", "")
        return derived_key(path, f"{self.kernels.linear} linears from {dtype}")

    def derived_copies(self, files: tuple[Path, ...]) -> dict[str, int]:
        """What a load of `files` (a partition's) derives from them that the stage may keep in host memory between
        turns ({key: bytes}): the converted linears' int8 weights and fp32 row scales."""
        info = self.partitions[self._partition_of(files)]
        conv = self._conversions(info)
        if not conv:
            return {}
        return {self._conversion_key(info.path): sum(n * k + 4 * n + 8 for n, k in conv.values())}

    def _kept_conversions(self, source: WeightSource) -> dict[str, QuantizedWeight]:
        """The converted linears an earlier turn kept (host views), those that still fit this file's; {} when none."""
        conv = self._conversions(self.partitions[self.partition])
        kept = source.derived(self._conversion_key(self.path)) if conv else None
        if not kept:
            return {}
        out = {}
        for name, shape in conv.items():
            q, s, g = (kept.get(f"{name}.{part}") for part in ("weight", "weight_scale", "groupsize"))
            if q is None or s is None or g is None or tuple(q.shape) != shape or q.dtype != torch.int8:
                log.warning("kept conversion of %s does not fit %s; converting it again", name, self.path.name)
                continue
            out[name] = QuantizedWeight(q, s, int(g[0]) or None)
        return out

    def _keep_conversions(self, converted: dict[str, torch.nn.Module], source: WeightSource) -> None:
        """Hand this load's converted linears to the stage's derived copy (when it offered one) for the next turns."""
        tensors = {}
        for name, layer in converted.items():
            if not isinstance(layer, Int8ConvRotLinear):
                return
            tensors.update({f"{name}.weight": layer.weight, f"{name}.weight_scale": layer.weight_scale,
                            f"{name}.groupsize": torch.tensor([layer.groupsize or 0])})
        if source.fill(self._conversion_key(self.path), tensors):
            log.info("kept %d converted linears (%.2f GiB) for the next turns", len(converted),
                     sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30)

    def unload(self) -> None:
        if self.stream is not None:
            self.stream.release()
        self.model = self.stream = None
        self.loras = None
        release_device_memory(self.cfg.device)

    def _model_bytes(self) -> int:
        """Bytes of every weight of the loaded model, wherever it lives (LoRA factors included)."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def resident_bytes(self) -> int:
        """Weight bytes on the device: the model less the blocks streaming from host memory, plus their slots."""
        if self.model is None:
            return 0
        s = self.stream
        return self._model_bytes() - sum(s.sizes[i] for i in s.host) + sum(t.numel() for t in s.slots)

    # ---- memory estimates (admission + shared-residency budget) -----------------------------------------------------
    def weight_bytes(self) -> int:
        """This rank's weight bytes once loaded, from the checkpoint header (no tensor data read).

        int8 weights stay 1 byte in `kernel` mode, stored fp32 tensors stay fp32, other floats are held in the
        compute dtype; tensor-parallel tensors are split across the TP ranks, replicated ones are not."""
        return sum(n for _, n in self._rank_tensor_bytes())

    def _rank_tensor_bytes(self):
        """(key, this rank's bytes of it once loaded) for every tensor of the checkpoint header."""
        elem = torch.empty((), dtype=self.cfg.compute_dtype).element_size()
        tp = self.parallel.tp_size
        for key, entry in self._header_shapes.items():
            n = 1
            for d in entry.shape:
                n *= d
            size = 1 if entry.dtype == "I8" and self.cfg.int8_mode == "kernel" else elem
            if entry.dtype == "F32":  # stored fp32 (output heads, tables) stays fp32
                size = 4
            yield key, n * size // (tp if param_style(H3DiT._tp_plan, key) is not None else 1)

    def target_rows(self, spec: RenderSpec) -> int:
        return target_rows(self.model_cfg, spec)

    def activation_bytes(self, spec: RenderSpec, text_len: int) -> int:
        """Peak activation bytes of one job on one rank: `activation_bytes` of its packed rows."""
        return activation_bytes(self.model_cfg, text_len + self.target_rows(spec), self.cfg.compute_dtype,
                                self.chunk_rows, self.parallel.tp_size, self.parallel.sp_size,
                                self.cfg.device.startswith("cuda"), spec.quality == "fast", spec.sparse is not None)

    def block_bytes(self) -> int:
        """One transformer block's weight bytes on this rank (the largest), from the checkpoint header."""
        sizes = [0] * self.model_cfg.num_layers
        for key, nbytes in self._rank_tensor_bytes():
            if key.startswith("blocks."):
                sizes[int(key.split(".")[1])] += nbytes
        return max(sizes, default=0)

    def plan(self, spec: RenderSpec, text_len: int, room_bytes: int | None) -> Placement:
        """Which blocks a job streams from host memory on this rank (minimax_h3/dit/streaming.py), or ResourceExhausted
        naming the numbers when even streaming every block cannot fit `room_bytes`."""
        n = self.model_cfg.num_layers
        if self.stream is not None:  # loaded: the exact sizes
            block = self.stream.block_bytes
            other = self._model_bytes() - sum(self.stream.sizes)
        else:
            block = self.block_bytes()
            other = self.weight_bytes() - n * block
        return plan_placement(n, block, other, self.activation_bytes(spec, text_len), room_bytes,
                              what=f"a {spec.width}x{spec.height}x{spec.frames} DiT job")

    def estimate_bytes(self, spec: RenderSpec | None, text_len: int = DEFAULT_TEXT_LEN) -> int:
        """Per-rank peak bytes of a job: weights alone for `spec=None`; else the planned peak under this rank's
        memory limit (every weight resident when it fits, else what streaming leaves). Raises ResourceExhausted when
        the job cannot fit even streaming every block."""
        if spec is None:
            return self.weight_bytes()
        return self.plan(spec, text_len, self.cfg.memory_limit_bytes or None).need_bytes

    def estimate_peak_bytes(self, spec: RenderSpec | None, inputs: dict) -> int:
        """The runtime's hook (stagekit.engine.StageEngine)."""
        texts = [t for t in (inputs.get(TEXT_STATES), *inputs.get(PROMPTS_INPUT, ())) if t is not None]
        rows = max((int(t.shape[0]) for t in texts), default=DEFAULT_TEXT_LEN)
        if spec is not None:  # keyframe, reference and guide rows cost like text rows; count them with the text
            _, ph, pw = self.model_cfg.patch
            lh, lw = spec.latent_size
            rows += len(keyframe_anchors(inputs)) * (lh // ph) * (lw // pw)
            refs: References | None = inputs.get(REFERENCES_INPUT)
            guides: Guides | None = inputs.get(GUIDES_INPUT)
            visual = (refs.visual if refs else ()) + (guides.images if guides else ())
            sounds = (refs.audio if refs else ()) + (guides.audio if guides else ())
            rows += sum(v.shape[1] * (v.shape[2] // ph) * (v.shape[3] // pw) for v in visual)
            rows += sum(AUDIO_CHANNELS * a.shape[2] for a in sounds)
        return self.estimate_bytes(spec, rows)

    # ---- validation (rank 0, before any rank starts work) ---------------------------------------------------------
    def check_request(self, text_states: torch.Tensor, name: str = TEXT_STATES) -> None:
        """A request's text states (`name`: the first prompt's, or a later one's) against this DiT (its render spec
        is valid: the server validated it on entry, by minimax_h3.contract's rules, which hold the sampler's)."""
        want = self.model_cfg.text_dim
        if text_states.ndim != 2 or text_states.shape[1] != want or text_states.shape[0] == 0:
            raise InvalidArgument(
                f"{name} must be [L, {want}] for this DiT (L >= 1), got {list(text_states.shape)}; "
                f"was it produced by a matching text encoder?")
        if text_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidArgument(f"{name} must be float32, bfloat16 or float16, got {text_states.dtype}")
        check_finite(name, text_states)

    def check_sparse(self, spec: RenderSpec) -> None:
        """A job asking for VSA needs a DiT that runs it (`_vsa_row`). Raises FailedPrecondition with the reason."""
        op, kernel, reason = self._vsa_row()
        if spec.sparse is not None and kernel == "unavailable":
            raise FailedPrecondition(f"this DiT does not run VSA sparse attention: {reason}")

    def check_partition(self, wants_references: bool) -> None:
        """A request must reach the partition trained for it: references need the ref2va file, text / keyframe
        requests the fl2va one (minimax_h3.contract.check_partition). Raises FailedPrecondition."""
        check_partition(wants_references, {p: str(i.path) for p, i in self.partitions.items()})

    def check_conditioning(self, spec: RenderSpec, text_states: torch.Tensor, inputs: dict) -> dict:
        """fl2va extras: optional keyframe latents [24,1,H/16,W/16] and text tags [L]; ref2va: the reference latents
        (minimax_h3/dit/references.py), returned as one References entry; in either, guides
        (minimax_h3/dit/guides.py) as one Guides entry (names: minimax_h3.contract); a long render: the later prompts'
        states (PROMPTS_INPUT); an extension: the source's guide latents (GUIDE_INPUT).
        Returns the validated extras (tags as int64); raises InvalidArgument / FailedPrecondition (partition)."""
        out = {}
        shp = latent_shape(self.model_cfg, spec.frames, spec.height, spec.width)
        refs = has_references(inputs)
        self.check_partition(refs)
        if refs and keyframe_anchors(inputs):
            raise InvalidArgument("references and first/last keyframes do not combine: the ref2va partition takes "
                                  "references only (put the image in as a reference instead)")
        if spec.frames == IMAGE_FRAMES and (refs or keyframe_anchors(inputs) or has_guides(inputs)):
            raise InvalidArgument(IMAGE_PROMPT_ONLY)
        windowed = plan_windows(spec).mode != SINGLE
        if windowed and (refs or keyframe_anchors(inputs) or TEXT_TAGS in inputs):
            raise InvalidArgument(f"a render sampled in windows ({plan_windows(spec).describe()}) takes text prompts "
                                  "only: keyframes and references condition one window, so render at most 515 frames "
                                  "(window_frames >= frames) with them")
        if refs:
            m = self.model_cfg
            out[REFERENCES_INPUT] = parse_references(inputs, m.in_channels, m.audio_in_channels, m.patch)
        for anchor in keyframe_anchors(inputs):
            name = KEYFRAME_TENSORS[anchor]
            check_keyframe(name, inputs[name], self.model_cfg.in_channels, shp.latent_height, shp.latent_width)
            out[name] = inputs[name].float()
        if has_guides(inputs):
            out[GUIDES_INPUT] = parse_guides(inputs, shp, self.model_cfg.in_channels, self.model_cfg.audio_in_channels)
        if TEXT_TAGS in inputs:
            out[TEXT_TAGS] = check_text_tags(inputs[TEXT_TAGS], text_states.shape[0], TAG_TEXT, TAG_VIDEO)
        prompts = []
        for i in range(1, len(spec.prompts)):
            t = inputs.get(prompt_tensor(i))
            if t is None:
                raise InvalidArgument(f"the render has {len(spec.prompts)} prompts but no {prompt_tensor(i)} (the "
                                      f"states of prompt {i + 1}; encode each prompt with the text encoder)")
            self.check_request(t, prompt_tensor(i))
            prompts.append(t)
        extra = sorted(n for n in inputs if n.startswith(TEXT_STATES) and n != TEXT_STATES
                       and n not in {prompt_tensor(i) for i in range(1, len(spec.prompts))})
        if extra:
            raise InvalidArgument(f"{extra[0]} names a prompt the render does not have ({len(spec.prompts)} prompts)")
        if prompts:
            out[PROMPTS_INPUT] = prompts
        guide = (inputs.get(TAIL_VIDEO), inputs.get(TAIL_AUDIO))
        if spec.prefix_frames:
            if guide[0] is None or guide[1] is None:
                raise InvalidArgument(f"an extension needs {TAIL_VIDEO} and {TAIL_AUDIO}: the source clip's latents "
                                      f"of its last {spec.guide_frames} frames")
            for name, t in zip((TAIL_VIDEO, TAIL_AUDIO), guide):
                if not t.is_floating_point():
                    raise InvalidArgument(f"{name} must be a float tensor, got {t.dtype}")
                check_finite(name, t)
            out[GUIDE_INPUT] = (guide[0].float(), guide[1].float())
        elif guide != (None, None):
            raise InvalidArgument(f"{TAIL_VIDEO} / {TAIL_AUDIO} belong to an extension (prefix_frames > 0)")
        return out

    def check_loras(self, loras: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """Request LoRAs (name or path, strength) -> [(resolved path, strength)], checked against this DiT from the
        file headers (minimax_h3/dit/lora.py). Names resolve only inside `loras_dir`. Raises InvalidArgument /
        NotFound (the request names a LoRA this server does not take or have) or LoRAFileError (FAILED_PRECONDITION:
        the server's file does not fit this DiT)."""
        out = []
        for name, strength in loras:
            if not math.isfinite(strength):
                raise InvalidArgument(f"LoRA {name!r}: strength must be finite, got {strength}")
            path = resolve_lora_path(name, self.cfg.loras_dir or None, self.cfg.allow_lora_paths)
            if self._lora_targets is None:
                self._lora_targets = config_targets(self.model_cfg)
            check_lora_file(path, self._lora_targets, self.model_cfg.adaln_form)
            out.append((str(path), float(strength)))
        return out

    # ---- the job --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, spec: RenderSpec, inputs: dict, ctx) -> dict:
        if self.model is None:
            raise FailedPrecondition("DiT not loaded")
        self.loras.activate(inputs.get("loras", ()))  # unmerged, cached per rank; [] restores the base model
        plan = plan_windows(spec)
        self.windows = plan.describe()
        if plan.mode == SINGLE:
            video, audio, cached, sparse = self._run_one(spec, inputs, ctx)
        else:  # step caching and VSA are for one window (the contract refuses them in windows)
            (video, audio), cached, sparse = self._run_windows(spec, plan, inputs, ctx), 0, 0
        # Seed parity (docs/two_cards.md): each rank logs a hash of its final latents; tensor-parallel ranks must
        # agree bit for bit, and a render repeated with the same seed must log the same hashes.
        log.info("final latents rank=%d %dx%dx%d seed=%d video_sha256=%s audio_sha256=%s", self.group.info.rank,
                 spec.width, spec.height, spec.frames, spec.seed, _sha256(video), _sha256(audio))
        return {VIDEO_LATENTS: video, AUDIO_LATENTS: audio, CACHED_STEPS: cached, SPARSE_STEPS: sparse}

    def _place(self, spec: RenderSpec, text_len: int) -> None:
        """Which blocks stream from host memory for this job: from its activations (one window's, for a render in
        windows) and the room the device has now."""
        self.placement = self.plan(spec, text_len, self.device_room())
        self.stream.apply(self.placement)
        log.info("rank %d %dx%dx%d: %s (room %.2f GiB, planned peak %.2f GiB)", self.group.info.rank, spec.width,
                 spec.height, spec.frames, self.placement.describe(), self.placement.room_bytes / 2**30,
                 self.placement.need_bytes / 2**30)

    def _stepper(self, ctx):
        step_t = [time.monotonic()]

        def on_step(i, n):
            now = time.monotonic()
            ctx.progress(i, n, step_ms=(now - step_t[0]) * 1000)
            step_t[0] = now

        return on_step

    def _run_one(self, spec: RenderSpec, inputs: dict, ctx) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The render in one window: its whole packed sequence in every model call. Returns the video and audio
        latents, how many steps the step cache skipped (quality "fast") and how many ran VSA (sparse attention)."""
        mcfg, dev = self.model_cfg, self.cfg.device
        refs: References | None = inputs.get(REFERENCES_INPUT)
        text = inputs[TEXT_STATES].to(dev)
        shape = latent_shape(mcfg, spec.frames, spec.height, spec.width)
        anchors = keyframe_anchors(inputs)  # fl2va: keyframe latents (validated on rank 0 before the job ran)
        guides: Guides = inputs.get(GUIDES_INPUT) or Guides((), (), ())
        tags = inputs.get(TEXT_TAGS)
        if refs is not None:
            layout = build_ref2va_layout(mcfg, text.shape[0], spec.frames, spec.height, spec.width, refs.blocks,
                                         text_tags=tags, guides=guides.blocks).to(dev)
            conditions, sounds = list(refs.visual), [r for r in (refs.audio_rows(),) if r is not None]
        else:
            layout = build_layout(mcfg, text.shape[0], spec.frames, spec.height, spec.width, keyframes=anchors,
                                  text_tags=tags, guides=guides.blocks).to(dev)
            conditions, sounds = [inputs[KEYFRAME_TENSORS[a]] for a in anchors], []
        # Guides follow the keyframes / references, in the layout as in the conditioning-noise draws.
        conditions += guides.images
        sounds += [r for r in (guides.audio_rows(),) if r is not None]
        ref_audio = torch.cat(sounds) if sounds else None
        sampler_cfg = SamplerConfig.from_params(spec)
        self._place(spec, layout.seq_len - self.target_rows(spec))
        # Noise is drawn on the CPU from the seed, exactly as diffusers draws it (docs/checkpoints.md "Seeds"):
        # identical bits on every rank and every device, and the same starting latents as diffusers for a seed.
        video_shape = (mcfg.in_channels, shape.latent_frames, shape.latent_height, shape.latent_width)
        c_noise, v_noise, a_rows = draw_noise(spec.seed, [c.shape for c in conditions], video_shape,
                                              (AUDIO_CHANNELS * shape.audio_latents, mcfg.audio_in_channels))
        v_rows = patchify_video(v_noise, mcfg.patch).to(dev)
        a_rows = a_rows.to(dev)  # drawn in row layout, as diffusers draws it
        cond = condition_rows(conditions, c_noise, mcfg.patch)  # fixed for the whole run; never sampled
        par = self.parallel
        cache = (FirstBlockCache(self.cfg.fast_threshold, par.tp_group, par.sp_group) if spec.quality == "fast"
                 else None)  # one per job: nothing a job caches reaches another
        sigmas = schedule(sampler_cfg)[0][:-1].tolist()  # the video sigma of each model evaluation
        vsa = plan_vsa(spec.sparse, layout, mcfg.patch, sigmas, sampler_cfg.video_shift, self._vsa_row()[1], dev)
        denoise = conditioned_denoise(self.model, text, layout, None if cond is None else cond.to(dev),
                                      None if ref_audio is None else ref_audio.to(dev), cache, vsa)
        ctx.progress(0, sampler_cfg.steps, message=self.placement.describe())
        v0, a0 = sample(denoise, v_rows, a_rows, sampler_cfg, on_step=self._stepper(ctx), should_stop=ctx.should_stop)
        cached = 0 if cache is None else cache.cached_steps
        if cache is not None:
            log.info("rank %d quality fast: %d of %d steps cached (threshold %g; distances %s)", self.group.info.rank,
                     cached, sampler_cfg.steps, cache.threshold, ", ".join(f"{d:.3g}" for d in cache.distances))
        sparse = 0 if vsa is None else vsa.sparse_steps
        if spec.sparse is not None:
            log.info("rank %d VSA (%s kernel, keep %g %%): %d of %d steps sparse%s", self.group.info.rank,
                     self._vsa_row()[1], spec.sparse.keep_percent, sparse, sampler_cfg.steps,
                     "" if vsa is not None else f" ({layout.seq_len} rows < min_tokens {spec.sparse.min_tokens})")
        return unpatchify_video(v0, mcfg.patch, *video_shape).cpu(), unpatchify_audio(a0).cpu(), cached, sparse

    def _run_windows(self, spec: RenderSpec, plan: WindowPlan, inputs: dict, ctx
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A render in windows (minimax_h3/dit/windows.py): the device holds one window's rows at a time; the noise
        is the whole clip's, drawn as a one-window render draws it."""
        mcfg, dev = self.model_cfg, self.cfg.device
        texts = [inputs[TEXT_STATES], *inputs.get(PROMPTS_INPUT, ())]
        sampler_cfg = SamplerConfig.from_params(spec)
        self._place(spec, max(int(t.shape[0]) for t in texts))
        shape = latent_shape(mcfg, spec.frames, spec.height, spec.width)
        video_shape = (mcfg.in_channels, shape.latent_frames, shape.latent_height, shape.latent_width)
        _, v_noise, a_rows = draw_noise(spec.seed, (), video_shape,
                                        (AUDIO_CHANNELS * shape.audio_latents, mcfg.audio_in_channels))
        total = sampler_cfg.steps * (len(plan.windows) if plan.mode == CONTINUATION else 1)
        ctx.progress(0, total, message=f"{plan.describe()}; {self.placement.describe()}")
        common = dict(on_step=self._stepper(ctx), should_stop=ctx.should_stop)
        if plan.mode == CONTINUATION:
            return sample_continuation(self.model, mcfg, plan, texts, spec.height, spec.width, (v_noise, a_rows),
                                       sampler_cfg, dev, guide=inputs.get(GUIDE_INPUT), **common)
        return sample_fused(self.model, mcfg, plan, texts, spec.height, spec.width, (v_noise, a_rows), sampler_cfg,
                            dev, **common)

    def device_room(self) -> int | None:
        """Bytes this rank may hold on its device now (None = no limit): on a GPU, the card (or the cap it is held
        to) less what the device holds outside this process's allocator (contexts, other processes) and a margin,
        and at most the stage's memory limit; elsewhere the memory limit alone."""
        limit = self.cfg.memory_limit_bytes or None
        dev = self.cfg.device
        if not dev.startswith("cuda"):
            return limit
        free, total = torch.cuda.mem_get_info(dev)
        outside = (total - free) - torch.cuda.memory_reserved(dev)
        room = min(total, self.cfg.memory_cap_bytes or total) - outside - CUDA_ROOM_MARGIN
        return room if limit is None else min(room, limit)

    def worker_state(self) -> tuple[Placement | None, str]:
        """What Status shows of the last job (its block placement and window plan), handed by a device worker to its
        stage process after each job (stagekit/device_worker.py)."""
        return self.placement, self.windows

    def set_worker_state(self, state: tuple[Placement | None, str]) -> None:
        self.placement, self.windows = state

    def describe(self) -> dict:
        return {"weights": str(self.path), "variant": self.variant,
                "partitions": {p: str(i.path) for p, i in self.partitions.items()}, "embedded_model": self.embedded,
                "devices": [self.cfg.device], "kernels": self.kernel_rows(),
                "models_dir": shown_models_dir(self.cfg.models_dir),
                "loras": {"directory": self.cfg.loras_dir, "names": lora_names(self.cfg.loras_dir),
                          "paths_allowed": self.cfg.allow_lora_paths}}


def _probe_kernels(cfg: DiTEngineConfig) -> KernelSelection:
    """The start-up kernel probe (minimax_h3.kernels.registry.select_kernels), run in a short-lived child process;
    measured once per machine and read back at later starts when the stage keeps its caches (--compile-cache)."""
    if cfg.compile_cache_dir is not None:  # before the probe: fp8 attention compiles its quantisation there
        log.info("torch.compile cache: %s", enable_compile_cache(cfg.compile_cache_dir, cfg.device))
    config = KernelConfig(linear_kernel=cfg.linear_kernel, attention_kernel=cfg.attention_kernel,
                          compute_dtype=cfg.compute_dtype)
    records = cfg.compile_cache_dir.parent / "kernel_probes" if cfg.compile_cache_dir is not None else None
    sel = select_kernels_remembered(cfg.device, config, records)
    sel.vsa = select_vsa_kernel(cfg.device, cfg.compute_dtype)
    return sel


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()  # 0 rows too
