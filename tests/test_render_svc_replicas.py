"""Named replicas: the render service holds one channel per stage replica and schedules each as its own resource.

- Pure: endpoint lists (`name=host:port,...`, unnamed lists, the `ipv4:` form, `dns:`) and the plain client's target.
- Real processes: two text encoders (encoder/a, encoder/b), two DiTs and one decoder, each on its own virtual
  device. DiT "a" is the embedded pair (fl2va + ref2va) without LoRAs; DiT "b" serves the fl2va file alone and has a
  LoRA. The render service reads each replica's Status: a ref2va job samples on "a" (the partition), a job with the
  LoRA on "b"; reference uploads and their use land on the same encoder replica (both replicas used, every job
  renders); a DiT replica killed while it holds a job gives the job back: it finishes on the other, its DiT run
  recorded once; a DiT replica whose device worker is stopped (SIGSTOP: its gRPC server still answers Status) loses
  its jobs to the other after --stall-timeout-s, each job sampled once, and is SUSPECT in the render service's
  Status until it moves again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, dit_pb2_grpc, render_pb2
from minimax_h3.services import Endpoints
from stagekit.channels import grpc_target, open_channel, replicas_of
from stagekit.device_worker import WORKER_ENV
from stagekit.errors import FailedPrecondition
from tests.render_svc_util import SERVER_ENV, holding_the_device, serving, tiny_request, wait_for
from tests.test_device_worker import workers
from tests.test_references import media_png

ENV = {**SERVER_ENV, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DIT_ENV = {**ENV, WORKER_ENV: "1"}  # the DiTs compute in device workers, as on a GPU (the hung-replica test stops one)
# Far above any silence of a working stage on a loaded machine (a load reports once, then its first step), so only
# a stopped worker reaches it.
STALL_S = 12
DEVICES = {"encoder/a": "virt0", "encoder/b": "virt1", "dit/a": "virt2", "dit/b": "virt3", "decoder": "virt4"}


def test_endpoint_lists_name_their_replicas():
    assert replicas_of("127.0.0.1:5") == [("", "127.0.0.1:5")]
    assert replicas_of("a=10.0.0.1:5,b=10.0.0.2:5") == [("a", "10.0.0.1:5"), ("b", "10.0.0.2:5")]
    assert replicas_of("ipv4:10.0.0.1:5,10.0.0.2:5") == [("1", "10.0.0.1:5"), ("2", "10.0.0.2:5")]
    assert replicas_of("dns:///dit.internal:5") == [("", "dns:///dit.internal:5")]
    for bad in ("a=10.0.0.1:5,a=10.0.0.2:5", "a b=10.0.0.1:5"):
        with pytest.raises(FailedPrecondition):
            replicas_of(bad)
    # the plain client balances over the addresses (gRPC round_robin), names dropped
    assert grpc_target("a=10.0.0.1:5,b=10.0.0.2:5") == "ipv4:10.0.0.1:5,10.0.0.2:5"
    assert grpc_target("a=dit.internal:5") == "dit.internal:5" and grpc_target("127.0.0.1:5") == "127.0.0.1:5"


def _lora(path) -> None:
    """A tiny LoRA on the embedded DiT's first block (ComfyUI dialect)."""
    import torch
    from safetensors.torch import save_file

    from dit_svc.engine import embedded_config

    cfg = embedded_config()
    g = torch.Generator().manual_seed(5)
    key = "diffusion_model.blocks.0.mlp.fc2"
    save_file({f"{key}.lora_A.weight": 0.2 * torch.randn(2, cfg.ffn, generator=g),
               f"{key}.lora_B.weight": 0.2 * torch.randn(cfg.hidden, 2, generator=g)}, str(path))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_cache):
    """{replica: (stack, stage)}, the lease directory, and the render service's stage endpoints."""
    root = tmp_path_factory.mktemp("replicas")
    leases = root / "leases"
    (root / "loras").mkdir()
    _lora(root / "loras" / "style.safetensors")
    started: dict[str, tuple[EmbeddedStack, str]] = {}

    def start(node: str, extra: list[str] = ()) -> str:
        stage = node.split("/")[0]
        s = EmbeddedStack(StackConfig(cache_dir=str(model_cache), run_dir=str(root / node.replace("/", "-")),
                                      lease_dir=str(leases), env=DIT_ENV if stage == "dit" else ENV, extra_args={
                                          stage: ["--devices", DEVICES[node], "--idle-unload-s", "5", *extra]}))
        started[node] = (s, stage)
        s.start_stage(stage)
        return s

    try:
        for node in ("encoder/a", "encoder/b", "dit/a", "decoder"):
            start(node)
        for node in ("encoder/a", "encoder/b", "dit/a", "decoder"):
            started[node][0].wait_ready(started[node][1])
        fl2va = next(model_cache.glob("*/dit_tiny_bf16.safetensors"))  # written by dit/a's first start
        start("dit/b", ["--weights", str(fl2va), "--loras-dir", str(root / "loras")]).wait_ready("dit")

        def addr(node: str) -> str:
            s, stage = started[node]
            return f"127.0.0.1:{s.ports[stage]}"

        endpoints = Endpoints(encoder=f"a={addr('encoder/a')},b={addr('encoder/b')}",
                              dit=f"a={addr('dit/a')},b={addr('dit/b')}", decoder=addr("decoder"))
        yield started, leases, endpoints
    finally:
        for s, _ in started.values():
            s.stop()


def _runs(info: render_pb2.JobInfo, stage: str) -> list[str]:
    return [r.replica for r in info.stages if r.stage == stage]


def _holder(started) -> str | None:
    """The DiT replica whose queue holds a job (it waits there for its device), if any."""
    for node in ("dit/a", "dit/b"):
        with open_channel(f"127.0.0.1:{started[node][0].ports['dit']}") as ch:
            st = dit_pb2_grpc.DiTSamplerStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
        if st.queue_depth + st.running:
            return node
    return None


def test_replicas_are_resources_of_their_own(replicas, tmp_path):
    _, _, endpoints = replicas
    with serving(tmp_path / "render", endpoints, ["--max-batch", "1"]) as svc:
        def status():
            return svc.stub.Status(common_pb2.StatusRequest(), timeout=10)

        wait_for(lambda: list(status().stage_groups) == ["encoder/a", "encoder/b", "dit/a", "dit/b", "decoder"], 30,
                 "one group per replica", svc.log)
        named = {s.stage: s.health for s in status().stages}
        assert all(named[n] == "SERVING" for n in ("encoder/a", "encoder/b", "dit/a", "dit/b")), named

        # 1. Partitions and LoRAs: only dit/a serves ref2va; only dit/b has the LoRA.
        ref = tiny_request("<Picture 1> waves in the rain")
        ref.references.append(common_pb2.Reference(kind="image", data=media_png(), name="a.png"))
        lora = tiny_request("a lighthouse, thunder", loras=[("style", 0.7)])
        ids = {"ref": svc.stub.Submit(ref, timeout=30).job_id, "lora": svc.stub.Submit(lora, timeout=30).job_id}
        # 2. Uploads: four ref2va jobs at once, one job per batch: both encoder replicas take some; each job's
        #    references are uploaded to the replica that encodes it (else: "no uploaded file").
        for i in range(4):
            r = tiny_request(f"<Picture 1> take {i}: a bell rings", seed=i)
            r.references.append(common_pb2.Reference(kind="image", data=media_png(seed=i + 2), name=f"{i}.png"))
            ids[f"up{i}"] = svc.stub.Submit(r, timeout=30).job_id
        done = {k: svc.wait_state(j, (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED), 150) for k, j in ids.items()}
        assert all(i.state == render_pb2.JOB_SUCCEEDED for i in done.values()), \
            {k: (i.error_code, i.error) for k, i in done.items() if i.state != render_pb2.JOB_SUCCEEDED}
        assert _runs(done["ref"], "dit") == ["dit/a"] and _runs(done["lora"], "dit") == ["dit/b"]
        encoders = [r for k in ids if k.startswith("up") for r in _runs(done[k], "encoder")]
        assert set(encoders) == {"encoder/a", "encoder/b"}, encoders


def test_a_replica_killed_mid_job_gives_its_job_to_the_other(replicas, tmp_path):
    started, leases, endpoints = replicas
    with serving(tmp_path / "render", endpoints) as svc:
        wait_for(lambda: len(svc.stub.Status(common_pb2.StatusRequest(), timeout=10).stage_groups) == 5, 30,
                 "one group per replica", svc.log)
        with holding_the_device(leases, DEVICES["dit/a"]), holding_the_device(leases, DEVICES["dit/b"]):
            job = svc.stub.Submit(tiny_request("waves on the rocks at night"), timeout=30).job_id
            wait_for(lambda: svc.stub.Get(render_pb2.JobRef(job_id=job), timeout=10).stage == "dit", 60,
                     "the job at the DiT", svc.log)
            victim = wait_for(lambda: _holder(started), 30, "a DiT replica holding the job", svc.log)
            stack = started[victim][0]
            port = stack.ports["dit"]
            proc = stack.procs.pop("dit")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            info = svc.wait_state(job, (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED), 120)
            assert info.state == render_pb2.JOB_SUCCEEDED, (info.error_code, info.error, svc.log())
            other = ({"dit/a", "dit/b"} - {victim}).pop()
            assert _runs(info, "dit") == [other], info.stages  # one DiT run, on the replica that lived
            assert [r.stage for r in info.stages] == ["encoder", "dit", "decoder"]
        finally:  # the module's other tests use both replicas at the addresses they were given
            stack.cfg.extra_args["dit"] = [*stack.cfg.extra_args["dit"], "--port", str(port)]
            stack.start_stage("dit")
            stack.wait_ready("dit")


def test_a_hung_replica_loses_its_jobs_to_the_other_and_is_suspect(replicas, tmp_path):
    started, leases, endpoints = replicas
    with serving(tmp_path / "render", endpoints, ["--stall-timeout-s", str(STALL_S)]) as svc:
        def health() -> dict[str, str]:
            return {s.stage: s.health for s in svc.stub.Status(common_pb2.StatusRequest(), timeout=10).stages}

        wait_for(lambda: len(svc.stub.Status(common_pb2.StatusRequest(), timeout=10).stage_groups) == 5, 30,
                 "one group per replica", svc.log)
        # Jobs reach a DiT replica while the test holds both DiT devices: they wait in its queue, its device worker
        # on standby. That worker is stopped; the replica, given its device, waits for it for good, answering Status.
        with holding_the_device(leases, DEVICES["dit/a"]), holding_the_device(leases, DEVICES["dit/b"]):
            jobs = [svc.stub.Submit(tiny_request(f"a bell in the fog, take {i}", seed=i), timeout=30).job_id
                    for i in range(3)]
            victim = wait_for(lambda: _holder(started), 60, "a DiT replica holding a job", svc.log)
            (worker,) = workers(started[victim][0], "dit")
            os.kill(worker, signal.SIGSTOP)
            stopped_at = time.monotonic()
        other = ({"dit/a", "dit/b"} - {victim}).pop()
        try:
            done = {j: svc.wait_state(j, (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED), 180) for j in jobs}
            done_s = time.monotonic() - stopped_at
            assert all(i.state == render_pb2.JOB_SUCCEEDED for i in done.values()), \
                {j: (i.error_code, i.error) for j, i in done.items()}
            for info in done.values():  # each job sampled once, on the replica that moves; every stage ran once
                assert _runs(info, "dit") == [other], info.stages
                assert [r.stage for r in info.stages] == ["encoder", "dit", "decoder"], info.stages
            moved = {j for j in jobs for ev in svc.stub.Watch(render_pb2.WatchRequest(job_id=j), timeout=30)
                     if ev.WhichOneof("event") == "progress" and ev.progress.phase == "retrying"
                     and f"replica {victim} made no progress on the dit stage for {STALL_S} s" in ev.progress.message}
            assert moved, "no job was taken from the hung replica"
            assert health()[victim].startswith(f"SUSPECT (no progress on a dit batch for {STALL_S} s "
                                               "(--stall-timeout-s)"), health()
            assert health()[other] == "SERVING"
            assert f"replica {victim} sent nothing on the dit batch's" in svc.log()
        finally:
            os.kill(worker, signal.SIGCONT)
            resumed_at = time.monotonic()
        # Going again, the replica finds its jobs' callers gone and empties its queue: back in rotation.
        wait_for(lambda: not health()[victim].startswith("SUSPECT"), 60, "the replica back in rotation", svc.log)
        assert f"replica {victim} moves again (idle); back in rotation" in svc.log()
        print(f"\nhung replica: {len(moved)} of {len(jobs)} jobs moved from {victim} to {other}, all done "
              f"{done_s:.1f} s after its worker stopped (--stall-timeout-s {STALL_S}); back in rotation "
              f"{time.monotonic() - resumed_at:.1f} s after SIGCONT")
