"""The committed stubs are exactly what grpcio-tools generates from the .proto files."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_are_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(rel) for rel in generated
             if not (ROOT / "protos" / rel).exists() or (ROOT / "protos" / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stubs are stale; run scripts/gen_protos.sh and commit: {stale}"


def test_stub_modules_import():
    from h3.v1 import decoder_pb2_grpc, dit_pb2_grpc, encoder_pb2_grpc  # noqa: F401
