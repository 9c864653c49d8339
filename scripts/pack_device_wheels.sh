#!/usr/bin/env bash
# Pack the Python packages a GPU host's image lacks (or has in versions our generated code refuses) into ONE xz tar
# of an unpacked site dir, for a GPU host without a package index. The script fails when the tar is above --max-mib
# (default 60). Only the tar is left in --out (downloads and the unpacked site are built under $TMPDIR).
#
#   bash scripts/pack_device_wheels.sh [--out .devpkgs] [--max-mib 60] [--with-cudnn-frontend]
#   bash scripts/pack_device_wheels.sh --fast-dit      # .devpkgs/fast_dit.tar.xz: benchmarks/bench_fast_dit.py
#   bash scripts/pack_device_wheels.sh --fast-dit --with-fa3   # .devpkgs/fast_dit_fa3.tar.xz: bench_dit.py with FA3
#
# The two bundles have their own names; a host needs only the one its run uses. On the GPU host (from the repo root,
# with .devpkgs/site.tar.xz copied there):
#   mkdir -p /tmp/site && tar -xJf .devpkgs/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD:$PWD/protos
#
# What goes in and why (against the GPU image's own packages):
#   grpcio 1.85.1, grpcio-health-checking/-reflection 1.85.1: protos/h3/v1/*_pb2_grpc.py refuse an older grpcio, and
#       the image's grpcio version is not documented.
#   protobuf 7.x: the generated *_pb2.py files validate a 7.x runtime.
#   comfy-kitchen 0.2.40 (without backends/hip/*.so: AMD-only, and most of the wheel), av 18.1.0 (PyAV: the MP4 mux
#       and the run's MP4 checks), soundfile + cffi (+ pycparser), google-crc32c: not in the image.
#   --with-cudnn-frontend adds nvidia-cudnn-frontend 1.32.0 (+5 MiB: the cuDNN fp8 attention candidate of
#       minimax_h3/kernels/fp8_attention.py; without it that candidate is skipped). With it the tar is ~62 MiB: pass
#       --max-mib 64.
#   --fast-dit packs what the DiT benchmarks need and nothing of the decoder: the gRPC wheels,
#       comfy-kitchen, google-crc32c, nvidia-cudnn-frontend 1.32.0 (--no-deps: its CuTe DSL / TVM FFI extras serve
#       Blackwell-only engines; cuda-bindings, which it uses when present, is in the image) and diffusers 0.42.1 (the
#       baseline of benchmarks/bench_dit.py; pure Python, without its pipelines). No PyAV / soundfile. 43 MiB.
#   --with-fa3 (with --fast-dit) adds fa3-fwd 0.0.3 (FlashAttention-3 forward, Hopper: the `fa3` / `fa3_fp8` attention
#       candidates) and leaves comfy-kitchen's CUDA library out to stay under 64 MiB with the repo: the kernel probe
#       then names the int8 candidates unavailable (Hopper runs fp8 linears; int8 serves Turing).
# Not packed: transformers (the image's 5.17 runs the encoder's Qwen3-VL path; only a test oracle API differs),
# torch, numpy, safetensors, tokenizers, pillow, rich, pyyaml, prometheus-client, psutil, nvidia-ml-py, matplotlib.
# Compressed sizes (xz -9e): comfy-kitchen's CUDA library ~32 MiB (a fat binary for sm_75..sm_120), PyAV's FFmpeg
# libraries ~18 MiB (libavcodec links x265 and SVT-AV1, 27 MiB unpacked, so they cannot be left out), grpcio ~5 MiB;
# 57 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.devpkgs; max_mib=60; extra_pkgs=(); fast_dit=0; fa3=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2;;
    --max-mib) max_mib="$2"; shift 2;;
    --with-cudnn-frontend) extra_pkgs+=(nvidia-cudnn-frontend==1.32.0); shift;;
    --fast-dit) fast_dit=1; shift;;
    --with-fa3) fa3=1; shift;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0;;
    *) echo "pack_device_wheels.sh: unknown option $1" >&2; exit 2;;
  esac
done
PY="${PYTHON:-python3}"
GRPC=(grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2)
name=site.tar.xz
if (( fast_dit )); then
  name=fast_dit.tar.xz
  PKGS=("${GRPC[@]}" comfy-kitchen==0.2.40 google-crc32c==1.9.0 nvidia-cudnn-frontend==1.32.0 diffusers==0.42.1)
  if (( fa3 )); then name=fast_dit_fa3.tar.xz; PKGS+=(fa3-fwd==0.0.3); fi
else
  PKGS=("${GRPC[@]}" comfy-kitchen==0.2.40 av==18.1.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
        google-crc32c==1.9.0 "${extra_pkgs[@]}")
fi
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 any)
plat_args=(); for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
target=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all: "${plat_args[@]}")

build="${TMPDIR:-/tmp}/h3-devpkgs-build"
mkdir -p "$out" "$build/wheels"
rm -rf "$build/site" "$out/$name"
"$PY" -m pip download -q --no-deps "${target[@]}" -d "$build/wheels" "${PKGS[@]}"
# Keep exactly one wheel per package (an older download of another version would make two).
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$build/site" "${target[@]}" \
  $(for spec in "${PKGS[@]}"; do n="${spec%%==*}"; v="${spec##*==}"; ls "$build/wheels/"*.whl \
      | grep -i -E "/${n//-/[-_]}-${v}-" | head -1; done)

# Leave out: AMD (HIP) kernels, caches, tests, type stubs, the pip-generated bin/. PyAV's Cython modules ship with
# debug symbols (31 MiB -> 5 MiB stripped; checked: the stripped modules import and encode/decode H.264 + AAC). The
# bundled libraries (av.libs, grpc, comfy-kitchen) are already stripped and were patched by auditwheel: left as is.
rm -f "$build/site/comfy_kitchen/backends/hip/"*.so
if (( fa3 )); then find "$build/site/comfy_kitchen/backends/cuda" -name "*.so" -delete; fi
rm -rf "$build/site/bin" "$build/site/include"  # console scripts; cudnn-frontend's C++ headers
find "$build/site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$build/site" -type d \( -name tests -o -name test \) -path "*/site/*/*" -prune -exec rm -rf {} +
find "$build/site" -name "*.pyi" -delete
if [[ -d "$build/site/av" ]]; then find "$build/site/av" -name "*.so" -type f -exec strip --strip-unneeded {} +; fi
if [[ -d "$build/site/diffusers" ]]; then  # only the transformer is used: drop every pipeline (lazily imported)
  find "$build/site/diffusers/pipelines" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
  find "$build/site/diffusers/modular_pipelines" -mindepth 1 -maxdepth 1 -type d ! -name minimax_h3 -exec rm -rf {} +
fi
printf '%s\n' "${PKGS[@]}" > "$build/site/H3_BUNDLE.txt"  # what this bundle holds (the driver records it)

XZ_OPT="-9e -T0" tar -cJf "$out/$name" -C "$build/site" .
size=$(stat -c %s "$out/$name")
echo "wrote $out/$name: $((size / 1048576)) MiB ($(du -sh "$build/site" | cut -f1) unpacked)"
du -sh "$build/site/"* 2>/dev/null | sort -h | tail -8
if (( size > max_mib * 1048576 )); then
  echo "pack_device_wheels.sh: $((size / 1048576)) MiB is over --max-mib $max_mib" >&2
  exit 1
fi
echo "device: mkdir -p /tmp/site && tar -xJf $out/$name -C /tmp/site && export PYTHONPATH=/tmp/site:\$PWD:\$PWD/protos"
