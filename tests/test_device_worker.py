"""Device workers (stagekit/device_worker.py) through real stage processes on CPU (H3_DEVICE_WORKER=1 takes the path
CUDA devices always take): jobs are served by a child process that exists only while the stage holds its weights,
a killed worker fails its job as a server fault and the next job works, and multi-rank stages (2 gloo ranks) give
the same bits with workers as without, with cancellation still agreed across ranks."""

import json
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2
from minimax_h3.contract import RenderSpec
from minimax_h3.services import Endpoints, StageClients
from render_svc.stage_calls import decode_raw, sample
from stagekit.device_worker import WORKER_ENV
from tests.conftest import SERVER_ENV
from tests.procs import alive, descendants
from tests.waits import wait_until

WORKER = {**SERVER_ENV, WORKER_ENV: "1"}
SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=2, seed=11)
SLOW = RenderSpec(prompt="x", width=832, height=480, frames=124, steps=50, seed=1)
TEXT = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))


def start(stage, ranks, run_dir: Path, cache, env, extra=()) -> EmbeddedStack:
    s = EmbeddedStack(StackConfig(ranks={stage: ranks}, cache_dir=str(cache), run_dir=str(run_dir), devices="virt0",
                                  env=env, extra_args={stage: ["--collective-timeout-s", "20", *extra]}))
    s.start_stage(stage)
    s.wait_ready(stage)
    return s


def clients(s: EmbeddedStack, stage: str) -> StageClients:
    port = s.ports[stage]
    return StageClients(Endpoints(**{k: f"127.0.0.1:{port}" for k in ("encoder", "dit", "decoder")}))


def workers(s: EmbeddedStack, stage: str) -> list[int]:
    """Live device workers under the stage (multiprocessing's resource tracker, which holds no device, is not one)."""
    out = []
    for pid in descendants(s.procs[stage].pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if alive(pid) and "multiprocessing" in cmd and "resource_tracker" not in cmd:
            out.append(pid)
    return out


def events(s: EmbeddedStack) -> list[dict]:
    return [json.loads(line) for line in (s.lease_dir / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def dit1(tmp_path_factory, model_cache):
    s = start("dit", 1, tmp_path_factory.mktemp("dit1w"), model_cache, WORKER)
    yield s
    s.stop()


def test_worker_serves_jobs_and_nothing_remains_after_unload(dit1, stack):
    standby = workers(dit1, "dit")
    assert len(standby) == 1, "an idle stage keeps only the next turn's worker on standby (imports done, no device)"
    with clients(dit1, "dit") as c:
        v, a, _ = sample(c, SPEC, TEXT, timeout_s=120)
        assert workers(dit1, "dit") == standby, "the loaded stage computes in the worker that waited on standby"
        v2, a2, _ = sample(c, SPEC, TEXT, timeout_s=120)  # resident: the same worker serves the next job
        assert torch.equal(v, v2) and torch.equal(a, a2)
        c.stub("dit").Unload(common_pb2.UnloadRequest(), timeout=60)
        assert not alive(standby[0]), "unload joins the worker: its memory goes back with it"
        assert len(workers(dit1, "dit")) == 1, "the next turn's worker waits on standby"
        assert not c.stub("dit").Status(common_pb2.StatusRequest(), timeout=10).resident
    loaded = [e for e in events(dit1) if e["event"] == "loaded"]
    assert loaded and loaded[-1]["worker_start_s"] > 0 and loaded[-1]["load_s"] >= loaded[-1]["worker_start_s"]
    # Where the worker's load went, step by step (the DiT engine's `load_phases`, through the worker's reply).
    phases = loaded[-1]["load_phases"]
    assert {"check", "read", "finite", "assembly_build", "assembly_linears", "assembly_state", "assembly_finish",
            "weights_s", "assembly_s", "release_s"} <= phases.keys()
    assert all(v >= 0 for v in phases.values()) and phases["weights_s"] + phases["assembly_s"] <= loaded[-1]["load_s"]
    unloaded = [e for e in events(dit1) if e["event"] == "unloaded"]
    assert unloaded[-1]["reason"] == "request"
    print(f"\ndevice worker start on CPU: {loaded[-1]['worker_start_s']:.2f} s of a {loaded[-1]['load_s']:.2f} s load")
    # The same bits as a stage computing in its own process (the session stack's DiT).
    plain = stack[0]
    with clients(plain, "dit") as c:
        pv, pa, _ = sample(c, SPEC, TEXT, timeout_s=120)
    assert workers(plain, "dit") == []
    assert torch.equal(v, pv) and torch.equal(a, pa)


def test_killed_worker_fails_its_job_as_server_fault_then_next_job_works(dit1):
    with clients(dit1, "dit") as c:
        box, stepped = {}, threading.Event()

        def run():
            try:
                sample(c, SLOW, TEXT, timeout_s=120,
                       on_progress=lambda p: stepped.set() if p.stage == "dit" and p.step >= 1 else None)
            except grpc.RpcError as e:
                box["error"] = e
            stepped.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert stepped.wait(120) and "error" not in box, box
        (pid,) = workers(dit1, "dit")
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        err = box["error"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        assert "dit" in err.details() and "device worker" in err.details() and "SIGKILL" in err.details()
        wait_until(lambda: not c.stub("dit").Status(common_pb2.StatusRequest(), timeout=10).resident,
                   what="the stage to unload after losing its worker")
        assert [e["reason"] for e in events(dit1) if e["event"] == "unloaded"][-1] == "worker_lost"
        v, a, _ = sample(c, SPEC, TEXT, timeout_s=120)  # a fresh worker serves the next job
        assert torch.isfinite(v).all() and len(workers(dit1, "dit")) == 1


def test_two_rank_dit_with_workers_same_bits_and_agreed_cancel(tmp_path, model_cache):
    out = {}
    for name, env in (("worker", WORKER), ("plain", SERVER_ENV)):
        s = start("dit", 2, tmp_path / name, model_cache, env)
        try:
            with clients(s, "dit") as c:
                out[name] = sample(c, SPEC, TEXT, timeout_s=120)[:2]
                if name == "worker":
                    assert len(workers(s, "dit")) == 2, "one worker per rank"
                    with pytest.raises(grpc.RpcError) as e:  # a deadline cancels on both ranks at one step boundary
                        sample(c, SLOW, TEXT, timeout_s=6)
                    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    v, _, r = sample(c, SPEC, TEXT, timeout_s=120)  # the workers' group is still in step
                    assert r.extra["ranks"] == 2 and torch.equal(v, out[name][0])
        finally:
            s.stop()
    (wv, wa), (pv, pa) = out["worker"], out["plain"]
    assert torch.equal(wv, pv) and torch.equal(wa, pa)


def test_two_rank_decoder_with_workers_same_bits(tmp_path, model_cache, stack):
    lat_v = torch.randn(24, SPEC.latent_frames, 16, 20, generator=torch.Generator().manual_seed(1))
    lat_a = torch.randn(2, 32, SPEC.audio_latents, generator=torch.Generator().manual_seed(2))
    spec = RenderSpec(prompt="x", width=320, height=256, frames=22)
    s = start("decoder", 2, tmp_path / "dec2", model_cache, WORKER)
    try:
        with clients(s, "decoder") as c:
            f2, a2 = decode_raw(c, spec, lat_v, lat_a, timeout_s=120)[:2]
    finally:
        s.stop()
    # One rank decodes the same bits as two (test_multirank_services): the session stack's decoder, no worker.
    with clients(stack[0], "decoder") as c:
        f1, a1 = decode_raw(c, spec, lat_v, lat_a, timeout_s=120)[:2]
    assert torch.equal(f1, f2) and torch.equal(a1, a2)


def _raise_checkpoint_error(path: str) -> None:
    from stagekit.checkpoints import CheckpointError

    raise CheckpointError(path, "truncated", "blocks.0.weight")


def test_run_in_child_returns_results_and_keeps_the_status_of_errors():
    """Start-up device work (GPU ids, the DiT's kernel probe) runs in a short-lived child: its result comes back, and
    its exception keeps its gRPC status and message even when the exception itself cannot be pickled."""
    from minimax_h3.kernels.registry import KernelConfig, select_kernels
    from stagekit.child import run_in_child
    from stagekit.errors import FailedPrecondition

    # Forced choices (still checked): a measured pick between near-equal CPU kernels could differ between two probes.
    small = KernelConfig(linear_kernel="fp32", attention_kernel="math", compute_dtype=torch.float32,
                         linear_shapes=((8, 16, 16),), attention_shape=(1, 2, 16, 8), probe_iters=1)
    chosen = run_in_child(select_kernels, "cpu", small)  # a KernelSelection crosses without its candidate closures
    local = select_kernels("cpu", small)
    assert (chosen.linear, chosen.attention, chosen.arch) == (local.linear, local.attention, local.arch)
    w = torch.randn(8, 16)
    assert torch.equal(chosen.make_linear(w)(torch.ones(2, 16)), local.make_linear(w)(torch.ones(2, 16)))
    with pytest.raises(FailedPrecondition, match="f.safetensors: blocks.0.weight: truncated"):
        run_in_child(_raise_checkpoint_error, "f.safetensors")
