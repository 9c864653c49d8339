"""What a stage sends back is checked against the contract's `RESULTS` by its caller (render_svc/stage_calls.py), and a
result that breaks it is the stage's fault: INTERNAL naming the stage, never the caller's INVALID_ARGUMENT.

A stand-in DiT servicer (the generated base class, on loopback) answers `Sample` with chosen tensors; the real
stage-level `sample()` call reads them through the generated stub."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from h3.v1 import dit_pb2, dit_pb2_grpc
from minimax_h3.contract import AUDIO_LATENTS, VIDEO_LATENTS, RenderSpec, result_rules, tensor_shapes
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import sample
from stagekit.errors import Internal, status_for
from stagekit.wire import tensor_chunks

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22)


class StandInDiT(dit_pb2_grpc.DiTSamplerServicer):
    def __init__(self, results: dict[str, torch.Tensor]):
        self.results = results

    def Sample(self, request_iterator, context):
        for _ in request_iterator:
            pass
        for name, t in self.results.items():
            for chunk in tensor_chunks(name, t):
                yield dit_pb2.SampleEvent(tensor=chunk)
        yield dit_pb2.SampleEvent(done=dit_pb2.SampleDone(world_size=1))


def _sample_from(results: dict[str, torch.Tensor]):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dit_pb2_grpc.add_DiTSamplerServicer_to_server(StandInDiT(results), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with StageClients(Endpoints(dit=f"127.0.0.1:{port}")) as clients:
            return sample(clients, SPEC, torch.zeros(3, 8), timeout_s=60)
    finally:
        server.stop(None)


def _good() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s) for n, s in tensor_shapes([VIDEO_LATENTS, AUDIO_LATENTS], SPEC).items()}


def test_a_result_that_keeps_the_contract_arrives():
    video, audio, res = _sample_from(_good())
    assert tuple(video.shape) == (24, 7, 16, 16) and tuple(audio.shape) == (2, 32, SPEC.audio_latents)
    assert res.extra["ranks"] == 1


@pytest.mark.parametrize("change, says", [
    ({VIDEO_LATENTS: torch.zeros(24, 6, 16, 16)}, r"'video_latents': shape \[24, 6, 16, 16\] but \[24, 7, 16, 16\]"),
    ({AUDIO_LATENTS: torch.zeros(2, 32, SPEC.audio_latents, dtype=torch.int64)}, "'audio_latents': dtype int64"),
    ({"frames": torch.zeros(2, dtype=torch.uint8)}, "unexpected tensor 'frames'"),
    ({AUDIO_LATENTS: None}, "without required tensors: \\['audio_latents'\\]"),
], ids=["shape", "dtype", "name", "missing"])
def test_a_result_that_breaks_the_contract_is_the_stages_fault(change, says):
    results = {**_good(), **change}
    results = {n: t for n, t in results.items() if t is not None}
    with pytest.raises(Internal, match=says) as err:
        _sample_from(results)
    code, message = status_for(err.value)
    assert code == grpc.StatusCode.INTERNAL and message.startswith("the DiT stage sent a result that breaks")


def test_results_table():
    spec = RenderSpec(width=256, height=512, frames=22)
    assert result_rules("Decode", spec) == {"frames": ("uint8", (22, 512, 256, 3)), "audio": ("float", (2, 37 * 800))}
    assert result_rules("EncodeImage", RenderSpec(width=256, height=512)) == {"latents": ("float", (24, 1, 32, 16))}
    assert result_rules("EncodeReference") == {"video": ("float", (24, None, None, None)),
                                               "audio": ("float", (2, 32, None))}
    assert set(result_rules("Encode")) == {"text_states", "text_tags"}
    assert result_rules("Sample", spec) == {VIDEO_LATENTS: ("float", (24, 7, 32, 16)),
                                            AUDIO_LATENTS: ("float", (2, 32, 37))}
