# Process-group helpers shared by scripts/up.sh and scripts/down.sh (sourced, not run).
# up.sh starts each stage with setsid, so the pid it records is also the stage's process group id: every process
# the stage started (torchrun agent, ranks, their children) is in that group, even after the launcher died.

group_alive() {  # group_alive PGID: any process of the group still running?
  kill -0 -- "-$1" 2>/dev/null
}

stop_group() {  # stop_group PGID GRACE_S: SIGTERM the whole group (graceful drain), SIGKILL what is left after GRACE_S
  local pgid="$1" grace="$2"
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  for _ in $(seq 1 $((grace * 10))); do group_alive "$pgid" || return 0; sleep 0.1; done
  kill -KILL -- "-$pgid" 2>/dev/null || true
  for _ in $(seq 1 50); do group_alive "$pgid" || return 0; sleep 0.1; done
}
