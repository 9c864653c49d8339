#!/usr/bin/env bash
# Stop what scripts/up.sh started (the render service first, then the stages): SIGTERM (graceful drain), then
# SIGKILL after a grace period.
#   scripts/down.sh [--run-dir run] [--grace 30]
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir=run; grace=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    --run-dir) run_dir="$2"; shift 2;;
    --grace) grace="$2"; shift 2;;
    *) echo "down.sh: unknown option $1" >&2; exit 2;;
  esac
done
for stage in render encoder dit decoder; do
  pidf="$run_dir/$stage.pid"
  [[ -f "$pidf" ]] || continue
  pid="$(cat "$pidf")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 $((grace * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "stopped $stage (pid $pid)"
  fi
  rm -f "$pidf" "$run_dir/$stage.port" "$run_dir/$stage.port.http"
done
rm -f "$run_dir/endpoints.env"
