"""DiT sampler service: `python -m dit_svc` (or under torchrun for N tensor-parallel ranks)."""

from __future__ import annotations

import os
import sys
import time
import typing
from dataclasses import dataclass, field

from dit_svc.engine import CACHED_STEPS, SPARSE_STEPS, DiTEngine, DiTEngineConfig
from h3.v1 import dit_pb2, dit_pb2_grpc, common_pb2
from minimax_h3.contract import (KEYFRAME_TENSORS, MAX_GUIDES, PARTITIONS, SAMPLE_INPUTS, SAMPLE_OUTPUTS, TENSORS,
                                 TEXT_STATES, guide_tensor, plan_windows, spec_from_proto, tensor_shapes, validate)
from minimax_h3.dit.checkpoint import QKVLayout
from minimax_h3.dit.step_cache import FAST_THRESHOLD
from minimax_h3.kernels.int8 import Int8Mode
from minimax_h3.kernels.registry import AUTO, default_attention_candidates, default_linear_candidates
from stagekit.budget import GIB, resolve_budget_bytes
from stagekit.config import parse_config
from stagekit.errors import InvalidArgument
from stagekit.metrics import observed
from stagekit.runtime import Job
from stagekit.server import abort_on_error
from stagekit.servicer import LifecycleMixin, stream_job, timing_pb
from stagekit.stage import CommonConfig, run_stage
from stagekit.wire import DTYPE_CLASSES, TensorAssembler, check_finite, tensor_chunks

SERVICE = "h3.v1.DiTSampler"
# Text states are [L, text_dim] of a float dtype; L is the encoder's prompt plus the vision tokens of keyframes and
# references (a 2048 px square image reference adds 4,096 tokens, 40 MiB in bf16): up to ~100k rows of bf16.
MAX_TEXT_BYTES = 1 << 30


@dataclass(frozen=True)
class DiTConfigArgs(CommonConfig):
    port: int = field(default=50052, metadata={"help": "gRPC port"})
    int8_mode: str = field(default="kernel", metadata={
        "choices": typing.get_args(Int8Mode), "help": "CPU int8 linears: kernel (comfy-kitchen eager) | dequant"})
    linear_kernel: str = field(default="auto", metadata={"choices": (AUTO, *default_linear_candidates()),
        "help": "GPU block linears: auto (measured start-up probe) | int8 | fp8 | bf16 | fp16 | fp32"})
    attention_kernel: str = field(default="auto", metadata={"choices": (AUTO, *default_attention_candidates()),
        "help": "GPU attention: auto | cudnn | flash | efficient | math | int8 | fp8 (cuDNN fp8, nvidia-cudnn-frontend) | "
                "fa3 | fa3_fp8 (FlashAttention-3 bf16 / fp8 on Hopper, fa3-fwd)"})
    compile_blocks: bool = field(default=False, metadata={"help": "torch.compile each DiT block (GPU; compiles per shape)"})
    compile_cache: bool = field(default=True, metadata={
        "help": "keep torch.compile results under <cache_dir>/compile, so a restart at a known shape skips compiling"})
    sp_degree: int = field(default=1, metadata={
        "help": "sequence-parallel (Ulysses) degree; the ranks split into TP groups of ranks/sp_degree (1 = pure TP)"})
    chunk_rows: int = field(default=0, metadata={
        "help": "row chunk of all but attention itself (memory vs speed); 0 = auto, tuned per GPU architecture "
                "(minimax_h3/kernels/tuning.json; on an H200: 4096 for eager blocks, with --compile-blocks 65536 on "
                "one TP rank and 16384 on several)"})
    fast_threshold: float = field(default=FAST_THRESHOLD, metadata={
        "help": "requests with quality fast: the First Block Cache threshold (relative L1 change of the first block's "
                "residual below which a step reuses the other blocks' last residual; docs/kernels.md, 'Step caching')"})
    loras_dir: str = field(default="", metadata={"help": "LoRAs requested by file name (default <models_dir>/loras)"})
    allow_lora_paths: bool = field(default=False, metadata={"help": "also accept absolute LoRA paths in requests"})
    qkv_layout: str = field(default="", metadata={"choices": ("", *typing.get_args(QKVLayout)),
        "help": "q/k/v row order of the weights when the files do not show it: stacked (ComfyUI repacks) | "
                "interleaved (MiniMax release shards); default: decided from the files, refused if they cannot tell"})
    partition: str = field(default="", metadata={"choices": ("", *PARTITIONS),
        "help": "the MiniMax-H3 partition of the weights when their name and metadata do not say: fl2va (text, "
                "first/last frame) | ref2va (references); default: decided from the files, refused if they cannot tell"})


class DiTServicer(LifecycleMixin, dit_pb2_grpc.DiTSamplerServicer):
    def __init__(self, runtime):
        self.runtime = runtime
        self.engine: DiTEngine = runtime.engine

    def _read_request(self, request_iterator):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("input") != "request":
            raise InvalidArgument("the first SampleInput must carry the SampleRequest")
        req = first.request
        # Admission from the first message, before any tensor data is accepted (docs/reliability.md, "Uploads"):
        # the render params, the LoRAs, and the dtype/shape of every tensor they imply.
        # The one validation of the spec in this process: the engine's checks and the job take it as valid.
        spec = validate(spec_from_proto(req.params))
        self.engine.check_sparse(spec)
        loras = self.engine.check_loras([(x.name, x.strength if x.HasField("strength") else 1.0) for x in req.loras])
        # The text states, and the fl2va (keyframes, text tags) or ref2va (references) extras: minimax_h3.contract.
        shapes = tensor_shapes(SAMPLE_INPUTS, spec, self.engine.geometry, self.engine.model_cfg.text_dim)
        asm = TensorAssembler(expect={n: (DTYPE_CLASSES[TENSORS[n].dtype], s) for n, s in shapes.items()},
                              max_bytes=MAX_TEXT_BYTES,
                              hints={n: f"this render's canvas needs one normalised VAE latent frame of "
                                        f"{spec.width}x{spec.height} (encode the image with the decoder's EncodeImage "
                                        "at the render size)"
                                     for n in (*KEYFRAME_TENSORS.values(),
                                               *(guide_tensor(g, "image") for g in range(MAX_GUIDES)))})
        try:
            for msg in request_iterator:
                if msg.WhichOneof("input") != "tensor":
                    raise InvalidArgument("only tensor chunks may follow the SampleRequest")
                asm.feed(msg.tensor)
            tensors = asm.finish([TEXT_STATES])
            text = tensors[TEXT_STATES]
            check_finite(TEXT_STATES, text)
            self.engine.check_request(text)  # all validation before any rank starts work
            extras = self.engine.check_conditioning(spec, text, tensors)
        except BaseException:
            asm.discard()  # an abandoned or rejected upload frees its buffers now
            raise
        if loras:
            extras["loras"] = loras  # [(resolved path, strength)], applied by every rank in DiTEngine.run
        return req, spec, text, extras

    def Sample(self, request_iterator, context):
        t_recv = time.monotonic()
        req, spec, text, extras = abort_on_error(context, self._read_request, request_iterator)
        recv_s = time.monotonic() - t_recv  # the upload is part of the job's transfer time
        job = Job(spec=spec, inputs={TEXT_STATES: text, **extras})
        job.job_id = req.job_id or job.job_id
        steps = {"n": 0, "ms": 0.0}

        def on_event(ev):
            if ev.kind == "progress":
                p = ev.payload
                if p["step"]:
                    steps["n"], steps["ms"] = p["step"], steps["ms"] + p["step_ms"]
                yield dit_pb2.SampleEvent(progress=common_pb2.Progress(**p))
            elif ev.kind == "done":
                t0 = time.monotonic()
                for name in SAMPLE_OUTPUTS:
                    for chunk in tensor_chunks(name, ev.payload[name]):
                        yield dit_pb2.SampleEvent(tensor=chunk)
                job.timing["transfer_s"] = recv_s + time.monotonic() - t0
                yield dit_pb2.SampleEvent(done=dit_pb2.SampleDone(
                    timing=timing_pb(job.timing), ms_per_step=steps["ms"] / max(1, steps["n"]),
                    world_size=self.runtime.group.world_size, cached_steps=ev.payload.get(CACHED_STEPS, 0),
                    windows=plan_windows(spec).describe(), sparse_steps=ev.payload.get(SPARSE_STEPS, 0)))

        yield from stream_job(self.runtime, job, context, observed(self.runtime, job, on_event))


def make_engine(cfg: DiTConfigArgs, info, group) -> DiTEngine:
    device = cfg.device_for_rank(info)
    return DiTEngine(DiTEngineConfig(weights=cfg.weights, models_dir=cfg.models_dir, cache_dir=cfg.resolved_cache_dir(),
                                     device=device, compute_dtype=cfg.compute_dtype(device), int8_mode=cfg.int8_mode,
                                     linear_kernel=cfg.linear_kernel, attention_kernel=cfg.attention_kernel,
                                     compile_blocks=cfg.compile_blocks, sp_degree=cfg.sp_degree,
                                     compile_cache_dir=cfg.resolved_cache_dir() / "compile" if cfg.compile_cache else None,
                                     chunk_rows=cfg.chunk_rows, allow_lora_paths=cfg.allow_lora_paths,
                                     qkv_layout=cfg.qkv_layout, partition=cfg.partition,
                                     fast_threshold=cfg.fast_threshold,
                                     memory_limit_bytes=resolve_budget_bytes([device], cfg.memory_budget_gb,
                                                                             cfg.reserve_gb, cfg.gpu_memory_cap_gb),
                                     memory_cap_bytes=int(cfg.gpu_memory_cap_gb * GIB),
                                     loras_dir=cfg.loras_dir or (os.path.join(cfg.models_dir, "loras")
                                                                 if cfg.models_dir else "")), group)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(DiTConfigArgs, argv, env_prefix="H3_DIT_", description="MiniMax-H3 DiT sampler stage")
    run_stage(cfg, "dit", make_engine, SERVICE,
              lambda server, runtime, _cfg: dit_pb2_grpc.add_DiTSamplerServicer_to_server(DiTServicer(runtime), server))


if __name__ == "__main__":
    main(sys.argv[1:])
