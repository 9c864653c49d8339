"""The DiT stage with `--sp-degree 2` as a real torchrun process group (gloo on CPU) behind gRPC: its Sample equals
the same job run by a one-rank engine in this process; a job asking for VSA is refused there, naming why, and runs on
the one-rank engine."""

import dataclasses

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from dit_svc.engine import DiTEngine, DiTEngineConfig
from h3.v1 import common_pb2
from minimax_h3.contract import RenderSpec, SparseAttention
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import sample
from stagekit.checkpoints import WeightSource
from stagekit.dist import RankGroup, RankInfo
from tests.conftest import SERVER_ENV
from tests.render_svc_util import serving, tiny_request

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=3, seed=11)
VSA_SPEC = dataclasses.replace(SPEC, sparse=SparseAttention(min_tokens=0))


class _Ctx:
    """The engine's view of a job context: progress sink and the (never raised) stop flag."""

    def progress(self, *args, **kwargs):
        pass

    def should_stop(self) -> bool:
        return False


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_dit_sp2_service_equals_one_rank(tmp_path, model_cache):
    text = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    stack = EmbeddedStack(StackConfig(ranks={"dit": 2}, cache_dir=str(model_cache), run_dir=str(tmp_path / "sp2"),
                                      devices="virt0", env=SERVER_ENV,
                                      extra_args={"dit": ["--sp-degree", "2", "--collective-timeout-s", "20"]}))
    stack.start_stage("dit")
    try:
        stack.wait_ready("dit")
        ep = f"127.0.0.1:{stack.ports['dit']}"
        with StageClients(Endpoints(encoder=ep, dit=ep, decoder=ep)) as c:
            v2, a2, r2 = sample(c, SPEC, text)
            vsa = [k for k in c.dit.Status(common_pb2.StatusRequest(), timeout=30).kernels if k.op == "vsa"]
            assert [k.kernel for k in vsa] == ["unavailable"] and "--sp-degree 1" in vsa[0].reason
            with pytest.raises(grpc.RpcError) as e:
                sample(c, VSA_SPEC, text)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--sp-degree 1" in e.value.details()
        with serving(tmp_path / "render", Endpoints(encoder=ep, dit=ep, decoder=ep)) as svc:  # refused at Submit
            req = tiny_request(steps=3)
            req.params.sparse_attention.method = "vsa"
            req.params.sparse_attention.keep_percent = 10
            with pytest.raises(grpc.RpcError) as e:
                svc.stub.Submit(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--sp-degree 1" in e.value.details()
    finally:
        stack.stop()
    assert r2.extra["ranks"] == 2
    eng = DiTEngine(DiTEngineConfig("", "", model_cache, "cpu", torch.float32), RankGroup(RankInfo(0, 1, 0), "gloo", 10))
    eng.load(WeightSource(eng.weight_files()))
    out = eng.run(SPEC, {"text_states": text}, _Ctx())
    v1, a1 = out["video_latents"], out["audio_latents"]
    assert rel(v2, v1) <= 1e-5 and rel(a2, a1) <= 1e-5, (rel(v2, v1), rel(a2, a1))
    eng.check_sparse(VSA_SPEC)
    out = eng.run(VSA_SPEC, {"text_states": text}, _Ctx())  # 3 steps at shift 12: the first (sigma 1) is dense
    assert out["sparse_steps"] == 2 and not torch.equal(out["video_latents"], v1)
