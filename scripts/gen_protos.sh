#!/usr/bin/env bash
# Regenerate the committed Python stubs from protos/h3/v1/*.proto.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: protos/, next to the .proto files)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-protos}"
mkdir -p "$out"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/h3/v1/*.proto
