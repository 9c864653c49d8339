"""Text encoder service: `python -m encoder_svc`."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from encoder_svc.engine import EncoderEngine, EncoderEngineConfig
from h3.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from stagekit.config import parse_config
from stagekit.errors import InvalidArgument
from stagekit.runtime import Job
from stagekit.server import abort_on_error, stream_job
from stagekit.servicer import LifecycleMixin
from stagekit.stage import CommonConfig, run_stage
from stagekit.wire import tensor_chunks

SERVICE = "h3.v1.TextEncoder"
MAX_PROMPT_BYTES = 64 << 10  # far above any prompt that fits max_prompt_tokens; refuses abuse before tokenizing


@dataclass
class EncoderConfigArgs(CommonConfig):
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    mode: str = field(default="resident", metadata={"help": "resident | stream (weights on host, layers streamed) | compact (quantised on device)"})
    max_prompt_tokens: int = field(default=1024, metadata={"help": "longest prompt accepted, in tokens"})
    cache_mb: int = field(default=256, metadata={"help": "prompt -> states cache size (0 disables)"})


def timing_pb(t: dict) -> common_pb2.Timing:
    return common_pb2.Timing(**{k: v for k, v in t.items() if k in common_pb2.Timing.DESCRIPTOR.fields_by_name})


class EncoderServicer(LifecycleMixin, encoder_pb2_grpc.TextEncoderServicer):
    def __init__(self, runtime):
        self.runtime = runtime
        self.engine: EncoderEngine = runtime.engine

    def describe(self) -> dict:
        return self.engine.describe()

    def _prompt(self, request):
        raw = request.prompt_bytes if request.prompt_bytes else request.prompt
        if len(raw) > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"prompt is {len(raw)} bytes; the limit is {MAX_PROMPT_BYTES} bytes "
                                  f"({self.engine.cfg.max_prompt_tokens} tokens)")
        return self.engine.check_prompt(raw)

    def _send(self, states, tokens: int, cache_hit: bool, timing: dict):
        t0 = time.monotonic()
        for chunk in tensor_chunks("text_states", states):
            yield encoder_pb2.EncodeEvent(tensor=chunk)
        timing["transfer_s"] = time.monotonic() - t0
        yield encoder_pb2.EncodeEvent(done=encoder_pb2.EncodeDone(
            tokens=tokens, cache_hit=cache_hit, timing=timing_pb(timing), model=self.engine.model_id))

    def Encode(self, request, context):
        text, ids = abort_on_error(context, self._prompt, request)
        cached = self.engine.cache.get(self.engine.cache_key(text))
        if cached is not None:  # re-renders never load the encoder
            yield from self._send(cached, len(ids), True, {})
            return
        job = Job(spec={"text": text, "ids": ids}, inputs={})
        job.job_id = request.job_id or job.job_id

        def on_event(ev):
            if ev.kind == "progress":
                yield encoder_pb2.EncodeEvent(progress=common_pb2.Progress(**ev.payload))
            else:
                yield from self._send(ev.payload["text_states"], ev.payload["tokens"], False, job.timing)

        yield from stream_job(self.runtime, job, context, on_event)


def make_engine(cfg: EncoderConfigArgs, info, group) -> EncoderEngine:
    device = cfg.device_for_rank(info)
    if cfg.mode not in ("resident", "stream", "compact"):
        raise SystemExit(f"--mode {cfg.mode!r}: use resident, stream or compact")
    return EncoderEngine(EncoderEngineConfig(
        weights=cfg.weights, models_dir=cfg.models_dir, cache_dir=cfg.resolved_cache_dir(), device=device,
        dtype=cfg.compute_dtype(device), mode=cfg.mode, max_prompt_tokens=cfg.max_prompt_tokens,
        cache_bytes=cfg.cache_mb << 20), group)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(EncoderConfigArgs, argv, env_prefix="H3_ENCODER_", description="MiniMax-H3 text encoder stage")
    run_stage(cfg, "encoder", make_engine, SERVICE,
              lambda server, runtime: encoder_pb2_grpc.add_TextEncoderServicer_to_server(EncoderServicer(runtime), server))


if __name__ == "__main__":
    main(sys.argv[1:])
