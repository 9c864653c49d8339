#!/usr/bin/env bash
# Stop what scripts/up.sh started (the render service first, then the stages, every replica of each): SIGTERM
# (graceful drain), then SIGKILL after a grace period.
# Everything a stage started is stopped (its process group from the pid file, and every process with its TMPDIR,
# torchrun's ranks included), even when its launcher is already gone.
#   scripts/down.sh [--run-dir run] [--grace 30]
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir=run; grace=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    --run-dir) run_dir="$2"; shift 2;;
    --grace) grace="$2"; shift 2;;
    -h|--help) sed -n '2,6p' "$0"; exit 0;;
    *) echo "down.sh: unknown option $1 (see --help)" >&2; exit 2;;
  esac
done
[[ -d "$run_dir" ]] && run_dir="$(cd "$run_dir" && pwd)"  # the stages' TMPDIR is absolute
# shellcheck source=scripts/procs.sh
source scripts/procs.sh
# Each stage's pid files: the stage's own, and its replicas' (<stage>.1.pid, <stage>.2.pid, ...).
for pidf in "$run_dir"/render.pid "$run_dir"/{encoder,dit,decoder}{,.*}.pid; do
  [[ -f "$pidf" ]] || continue
  name="$(basename "$pidf" .pid)"
  pid="$(cat "$pidf")"
  if [[ -n "$(stage_pids "$pid" "$run_dir/tmp/$name")" ]]; then
    stop_stage "$pid" "$run_dir/tmp/$name" "$grace"
    echo "stopped $name (pid $pid and every process it started)"
  fi
  rm -f "$pidf" "$run_dir/$name.port" "$run_dir/$name.port.http"
  rm -rf "$run_dir/tmp/$name"
done
rm -f "$run_dir/endpoints.env" "$run_dir/render.stages"
