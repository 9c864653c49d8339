#!/usr/bin/env python
"""Loopback throughput of the tensor wire codec through a real gRPC stream.

A server on 127.0.0.1 receives a tensor as a TensorChunk stream (the codec both
ways: encode, validate, reassemble), and the figure is compared with a plain
in-process bytes copy of the same size in the same run.

    python benchmarks/bench_transport.py [--sizes-mib 16 256] [--repeats 3]
"""

import argparse
import statistics
import time
from concurrent import futures

import grpc
import torch

from h3.v1 import tensor_pb2
from stagekit.server import GRPC_OPTIONS
from stagekit.wire import TensorAssembler, tensor_chunks

METHOD = "/bench.Transport/Upload"


def serve():
    def upload(request_iterator, context):
        asm = TensorAssembler()
        for chunk in request_iterator:
            asm.feed(chunk)
        t = asm.finish(["x"])["x"]
        return tensor_pb2.TensorHeader(name="x", nbytes=t.numel() * t.element_size())

    handler = grpc.method_handlers_generic_handler("bench.Transport", {
        "Upload": grpc.stream_unary_rpc_method_handler(
            upload, request_deserializer=tensor_pb2.TensorChunk.FromString,
            response_serializer=tensor_pb2.TensorHeader.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    server, port = serve()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    upload = ch.stream_unary(METHOD, request_serializer=tensor_pb2.TensorChunk.SerializeToString,
                             response_deserializer=tensor_pb2.TensorHeader.FromString)
    print(f"{'size':>8} {'grpc+codec GB/s':>16} {'bytes copy GB/s':>16} {'ratio':>6}")
    rows = []
    for mib in args.sizes_mib:
        t = torch.randn(mib << 18)  # float32: mib MiB
        nbytes = t.numel() * 4
        grpc_s, copy_s = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            reply = upload(tensor_chunks("x", t))
            grpc_s.append(time.perf_counter() - t0)
            assert reply.nbytes == nbytes
            src = t.numpy().tobytes()
            t0 = time.perf_counter()
            dst = bytearray(src)  # a plain copy of the same bytes
            copy_s.append(time.perf_counter() - t0)
            del src, dst
        g = nbytes / statistics.median(grpc_s) / 1e9
        c = nbytes / statistics.median(copy_s) / 1e9
        rows.append((mib, g, c))
        print(f"{mib:>5} MiB {g:>16.2f} {c:>16.2f} {g / c:>6.2f}")
    server.stop(0)
    return rows


if __name__ == "__main__":
    main()
