"""Flood a stage with stalled uploads and measure that it keeps answering (docs/reliability.md, "Stalled and
flooding clients").

    python scripts/flood.py --streams 1000 [--stage dit|decoder] [--idle-s 5]

Starts one stage of the embedded tiny model (CPU, virtual device), opens N uploads at once (one client thread each,
over a few channels) that send their request and a first chunk and then go quiet, and while they are open probes
health and Status. Prints how the streams ended (DEADLINE_EXCEEDED after the idle deadline / RESOURCE_EXHAUSTED at
once), the probe latencies, the stage's resident memory, and whether a good job runs afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from client.embedded import EmbeddedStack, StackConfig  # noqa: E402
from h3.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, dit_pb2, dit_pb2_grpc  # noqa: E402
from minimax_h3.contract import (AUDIO_LATENTS, SAMPLE_OUTPUTS, TEXT_STATES, VIDEO_LATENTS,  # noqa: E402
                                 RenderSpec, spec_to_proto, tensor_shapes)
from minimax_h3.services import SERVICE_NAMES, Endpoints, StageClients  # noqa: E402
from render_svc.stage_calls import decode, sample  # noqa: E402
from stagekit.channels import health_of, open_channel  # noqa: E402
from stagekit.wire import tensor_chunks  # noqa: E402

SPEC = RenderSpec(prompt="x", width=256, height=256, frames=22, steps=1, seed=1)
LATENTS = tensor_shapes(SAMPLE_OUTPUTS, SPEC)  # the shapes the decoder takes for SPEC


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stalled_requests(stage: str, release: threading.Event):
    """The request and a first chunk, then nothing until `release`."""
    if stage == "dit":
        req = dit_pb2.SampleRequest(job_id="flood")
        spec_to_proto(SPEC, req.params)
        yield dit_pb2.SampleInput(request=req)
        yield dit_pb2.SampleInput(tensor=next(tensor_chunks(TEXT_STATES, torch.zeros(9, 64), 256)))
    else:
        req = decoder_pb2.DecodeRequest(job_id="flood")
        spec_to_proto(SPEC, req.params)
        yield decoder_pb2.DecodeInput(request=req)
        video = torch.zeros(LATENTS[VIDEO_LATENTS])
        yield decoder_pb2.DecodeInput(tensor=next(tensor_chunks(VIDEO_LATENTS, video, 256)))
    release.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--stage", choices=("dit", "decoder"), default="dit")
    ap.add_argument("--idle-s", type=float, default=5.0)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="h3-flood-"))
    stack = EmbeddedStack(StackConfig(ranks={args.stage: 1}, run_dir=str(run), devices="virt0",
                                      env={"OMP_NUM_THREADS": "2"},
                                      extra_args={args.stage: ["--upload-idle-s", str(args.idle_s)]}))
    stack.start_stage(args.stage)
    try:
        target = f"127.0.0.1:{stack.wait_ready(args.stage)}"
        pid = stack.procs[args.stage].pid
        chans = [open_channel(target) for _ in range(args.channels)]
        stub_cls = dit_pb2_grpc.DiTSamplerStub if args.stage == "dit" else decoder_pb2_grpc.DecoderStub
        stubs = [stub_cls(c) for c in chans]
        release, stop = threading.Event(), threading.Event()
        ended: dict[str, list[float]] = defaultdict(list)
        lock = threading.Lock()

        def one(i: int) -> None:
            stub = stubs[i % len(stubs)]
            t0 = time.monotonic()
            call = stub.Sample if args.stage == "dit" else stub.Decode
            try:
                for _ in call(stalled_requests(args.stage, release), timeout=120):
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                ended[code].append(time.monotonic() - t0)

        probes: dict[str, list[float]] = {"health": [], "status": []}

        def probe() -> None:
            with StageClients(Endpoints(target, target, target)) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    assert health_of(c.channels[args.stage], SERVICE_NAMES[args.stage], timeout_s=10) == "SERVING"
                    probes["health"].append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    c.stub(args.stage).Status(common_pb2.StatusRequest(), timeout=10)
                    probes["status"].append(time.monotonic() - t0)
                    time.sleep(0.05)

        rss0 = rss_mib(pid)
        prober = threading.Thread(target=probe)
        prober.start()
        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        rss_open = rss_mib(pid)
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        stop.set()
        prober.join()
        release.set()
        for c in chans:
            c.close()
        print(f"{args.streams} stalled {args.stage} uploads over {args.channels} channels (--upload-idle-s "
              f"{args.idle_s:g}, default --max-workers 32 / --max-uploads 8):")
        for code, ts in sorted(ended.items()):
            print(f"  {code:20s} {len(ts):5d}   after {min(ts):.3f} .. {max(ts):.3f} s")
        for name, ts in probes.items():
            print(f"  {name:6s} while flooded: {len(ts)} probes, median {statistics.median(ts) * 1000:.1f} ms, "
                  f"max {max(ts) * 1000:.1f} ms")
        print(f"  stage RSS {rss0:.0f} MiB before, {rss_open:.0f} MiB with the streams open, {rss_mib(pid):.0f} MiB "
              f"after; flood over in {wall:.1f} s")
        with StageClients(Endpoints(target, target, target)) as c:
            t0 = time.monotonic()
            if args.stage == "dit":
                sample(c, SPEC, torch.randn(9, 64), timeout_s=120)
            else:
                decode(c, SPEC, torch.randn(LATENTS[VIDEO_LATENTS]), torch.randn(LATENTS[AUDIO_LATENTS]),
                       run / "ok.mp4", timeout_s=120)
            print(f"  a good job afterwards: OK in {time.monotonic() - t0:.2f} s")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
