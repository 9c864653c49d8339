"""Longer fuzzing runs of the tensor wire codec and the request validation (CI runs short versions in tests/).

    python scripts/fuzz.py                       # all targets, 20k examples each
    python scripts/fuzz.py --examples 200000 --target wire-raw

Targets (each property: valid input round-trips / is accepted, anything else raises the one deliberate error
type; any other exception is a bug, and hypothesis prints the shrunk failing example to turn into a
regression test):
  validation  RenderParams -> spec_from_proto -> validate: accepted, or InvalidArgument
  wire-edits  edits to a valid chunk stream (drop/dup/flip/offset/shape/last/swap): exact round-trip or WireError
  wire-raw    arbitrary header fields and arbitrary bytes parsed as TensorChunk: a tensor, WireError, or a
              protobuf DecodeError for bytes that are not a message at all
Uses hypothesis (atheris is not needed; if installed, `--atheris` drives wire-raw with it instead).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TARGETS = ("validation", "wire-edits", "wire-raw")


def wire_raw_property(name: str, dtype: str, shape: list[int], nbytes: int, offset: int, data: bytes, last: bool,
                      crc: int, extra: bytes) -> None:
    from google.protobuf.message import DecodeError

    from h3.v1 import tensor_pb2
    from stagekit.wire import TensorAssembler, WireError

    asm = TensorAssembler(max_bytes=1 << 20)
    h = tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes)
    chunks = [tensor_pb2.TensorChunk(name=name, header=h, offset=offset, data=data, last=last, crc32c=crc)]
    try:
        chunks.append(tensor_pb2.TensorChunk.FromString(extra))
    except DecodeError:
        pass
    try:
        for c in chunks:
            asm.feed(c)
        asm.finish()
    except WireError:
        pass


def run(target: str, examples: int) -> None:
    opts = settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
    if target == "validation":
        from tests.test_reliability import check_params_never_crash, render_params_strategy

        fn = opts(given(render_params_strategy())(check_params_never_crash))
    elif target == "wire-edits":
        from tests.test_wire import test_fuzz_malformed_streams_never_crash as t

        fn = opts(given(data=st.data())(t.hypothesis.inner_test))
    else:
        fn = opts(given(
            name=st.text(max_size=8), dtype=st.sampled_from(["float32", "bfloat16", "int8", "bool", "", "float8", "x"]),
            shape=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-2, 64), max_size=5),
            nbytes=st.integers(0, 2**64 - 1) | st.integers(0, 4096), offset=st.integers(0, 2**64 - 1) | st.integers(0, 64),
            data=st.binary(max_size=256), last=st.booleans(), crc=st.integers(0, 2**32 - 1),
            extra=st.binary(max_size=128))(wire_raw_property))
    t0 = time.monotonic()
    fn()
    print(f"{target}: {examples} examples OK in {time.monotonic() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=20_000)
    ap.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    ap.add_argument("--atheris", action="store_true", help="drive wire-raw with atheris (libFuzzer) if installed")
    args = ap.parse_args(argv)
    if args.atheris:
        try:
            import atheris
        except ImportError:
            print("atheris is not installed; use the hypothesis targets (the default)", file=sys.stderr)
            return 2

        def one(buf: bytes) -> None:
            fdp = atheris.FuzzedDataProvider(buf)
            wire_raw_property(fdp.ConsumeUnicodeNoSurrogates(8), fdp.PickValueInList(["float32", "int8", "x"]),
                              [fdp.ConsumeIntInRange(-2, 64) for _ in range(fdp.ConsumeIntInRange(0, 4))],
                              fdp.ConsumeIntInRange(0, 4096), fdp.ConsumeIntInRange(0, 64), fdp.ConsumeBytes(64),
                              fdp.ConsumeBool(), fdp.ConsumeIntInRange(0, 2**32 - 1), fdp.ConsumeBytes(128))

        atheris.Setup([sys.argv[0], f"-runs={args.examples}"], one)
        atheris.Fuzz()
        return 0
    failed = []
    for target in TARGETS if args.target == "all" else (args.target,):
        try:
            run(target, args.examples)
        except Exception as e:  # noqa: BLE001 - report every target's counterexample, then fail
            print(f"{target}: FAILED ({type(e).__name__}: {e}); the shrunk example is printed above", flush=True)
            failed.append(target)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
