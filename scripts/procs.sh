# Process helpers shared by scripts/up.sh and scripts/down.sh (sourced, not run).
# up.sh starts each stage with setsid (the pid it records is the stage's process group id) and with
# TMPDIR=<run-dir>/tmp/<stage>. torchrun starts its ranks in sessions of their own, so a stage's processes are found
# by both: its process group, and the TMPDIR every process it started inherits (ranks of a killed agent included).
# A zombie (dead, not yet reaped) counts as gone.

pid_alive() {  # pid_alive PID: running (not a zombie)?
  awk '{ sub(/^.*\) /, ""); exit ($1 == "Z") }' "/proc/$1/stat" 2>/dev/null
}

stage_pids() {  # stage_pids PGID TMPDIR: the live processes of one stage, one per line
  {
    cat /proc/[0-9]*/stat 2>/dev/null | awk -v pg="$1" '{ pid = $1; sub(/^.*\) /, ""); if ($1 != "Z" && $3 == pg) print pid }'
    grep -lzxF "TMPDIR=$2" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/\([0-9]*\)/environ$#\1#' |
      while read -r p; do pid_alive "$p" && echo "$p"; done
  } | sort -u || true  # (some /proc entries vanish or are unreadable mid-scan: never a failure, under pipefail too)
}

stop_stage() {  # stop_stage PGID TMPDIR GRACE_S: SIGTERM (graceful drain), SIGKILL whatever is left after GRACE_S
  local pgid="$1" tmp="$2" grace="$3" pids
  pids="$(stage_pids "$pgid" "$tmp")"
  [[ -n "$pids" ]] || return 0
  kill -TERM -- "-$pgid" $pids 2>/dev/null || true
  for _ in $(seq 1 $((grace * 4))); do
    [[ -n "$(stage_pids "$pgid" "$tmp")" ]] || return 0
    sleep 0.25
  done
  pids="$(stage_pids "$pgid" "$tmp")"
  [[ -n "$pids" ]] && kill -KILL -- "-$pgid" $pids 2>/dev/null || true
  for _ in $(seq 1 20); do [[ -n "$(stage_pids "$pgid" "$tmp")" ]] || return 0; sleep 0.25; done
}
