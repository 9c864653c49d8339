#!/usr/bin/env bash
# Start the three h3-stages servers and the render service beside them, wait until each is SERVING, print endpoints.
# Idempotent: a server whose pid file points at a live process is left alone; leftovers of a stage whose
# launcher died (its process group, e.g. ranks of a killed torchrun agent) are stopped before it is started again.
# A run that fails (a port taken, a stage that dies while starting, Ctrl-C) stops what it started and says so.
# Each stage runs in its own process group (pid file = group id) with TMPDIR=<run-dir>/tmp/<stage>.
#
#   scripts/up.sh [--run-dir run] [--models-dir DIR] [--devices cuda:0,cuda:1]
#                 [--encoder-ranks 1] [--dit-ranks 1] [--decoder-ranks 1]
#                 [--encoder-replicas|--dit-replicas|--decoder-replicas "cuda:0,cuda:1;cuda:2,cuda:3"]
#                 [--encoder-port 50051] [--dit-port 50052] [--decoder-port 50053]
#                 [--render-port 50054] [--web-port 8054 (-1: no web page)]
#                 [--residency exclusive|shared] [--host 127.0.0.1] [--gpu-memory-cap-gb GB (default: no cap)]
#                 [-- extra args for every stage]
# --<stage>-replicas: one replica of the stage per ';'-separated device list, each with --<stage>-ranks ranks
# (default: one per device of its list; a multiple of its device count); --devices is then for the other stages.
# Replica k of 2 or more runs as <stage>.k (run/dit.2.pid, .port, .log, tmp/dit.2) on the stage's port + 100 (k-1)
# (0: a free port each); run/endpoints.env lists them (H3_DIT=1=127.0.0.1:50052,2=127.0.0.1:50152).
# Env H3_* settings (e.g. H3_DIT_IDLE_UNLOAD_S) pass through to the stages; H3_RENDER_* to the render service
# (e.g. H3_RENDER_TOKEN, H3_RENDER_KEEP_JOBS). Its job database and MP4s live in <run-dir>/render.
# H3_<STAGE>_PORT, H3_RENDER_PORT and H3_RENDER_HTTP_PORT (0: a free port) also set the default ports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"  # the project's venv (scripts/setup.sh); PYTHON=... for another interpreter
command -v "$PY" >/dev/null || { echo "up.sh: no $PY: run scripts/setup.sh first (or set PYTHON)" >&2; exit 1; }
run_dir=run; models_dir=""; devices=""; residency=exclusive; host=127.0.0.1; gpu_cap=""
render_port=${H3_RENDER_PORT:-50054}
web_port=${H3_RENDER_HTTP_PORT:-8054}
declare -A ranks=([encoder]=1 [dit]=1 [decoder]=1)
declare -A ports=([encoder]=${H3_ENCODER_PORT:-50051} [dit]=${H3_DIT_PORT:-50052} [decoder]=${H3_DECODER_PORT:-50053})
declare -A module=([encoder]=encoder_svc [dit]=dit_svc [decoder]=decoder_svc)
declare -A replicas=() ranks_given=()  # stage -> its replicas' device lists; stage -> 1 when --<stage>-ranks given
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --run-dir) run_dir="$2"; shift 2;;
    --models-dir) models_dir="$2"; shift 2;;
    --devices) devices="$2"; shift 2;;
    --residency) residency="$2"; shift 2;;
    --host) host="$2"; shift 2;;
    --gpu-memory-cap-gb) gpu_cap="$2"; shift 2;;   # every stage process's CUDA cap (prove a 22 GB card suffices)
    --encoder-ranks|--dit-ranks|--decoder-ranks) s="${1#--}"; ranks[${s%-ranks}]="$2"; ranks_given[${s%-ranks}]=1
      shift 2;;
    --encoder-replicas|--dit-replicas|--decoder-replicas) s="${1#--}"; replicas[${s%-replicas}]="$2"; shift 2;;
    --encoder-port|--dit-port|--decoder-port) s="${1#--}"; ports[${s%-port}]="$2"; shift 2;;
    --render-port) render_port="$2"; shift 2;;
    --web-port) web_port="$2"; shift 2;;
    --) shift; extra=("$@"); break;;
    -h|--help) sed -n '2,21p' "$0"; exit 0;;
    *) echo "up.sh: unknown option $1" >&2; exit 2;;
  esac
done
refuse() { echo "up.sh: $*" >&2; exit 2; }
for stage in encoder dit decoder; do
  [[ "${ranks[$stage]}" =~ ^[1-9][0-9]*$ ]] || refuse "--$stage-ranks ${ranks[$stage]}: give a whole number, 1 or more"
  [[ "${ports[$stage]}" =~ ^[0-9]+$ ]] || refuse "--$stage-port ${ports[$stage]}: give a port number (0: a free one)"
done

# 1. The instances to run: per stage one (named as the stage), or one per replica (<stage>.1, <stage>.2, ...), each
#    with its devices, ranks and port. A replica's ranks compute on its devices in turn (rank r on device r mod n),
#    so its rank count is a multiple of its device count: fewer would lease devices no rank computes on.
names=(); declare -A inst_stage=() inst_devices=() inst_ranks=() inst_port=()
for stage in encoder dit decoder; do
  if [[ -z "${replicas[$stage]+x}" ]]; then
    names+=("$stage"); inst_stage[$stage]=$stage; inst_devices[$stage]=$devices
    inst_ranks[$stage]=${ranks[$stage]}; inst_port[$stage]=${ports[$stage]}
    continue
  fi
  IFS=';' read -r -a lists <<< "${replicas[$stage]};"
  declare -A owner=()
  for k in "${!lists[@]}"; do
    list="${lists[$k]}"; n=$((k + 1))
    IFS=',' read -r -a devs <<< "$list,"
    [[ -n "$list" && ! "$list" =~ [[:space:]] && ! "$list" =~ ,, && "${list:0:1}" != , && "${list: -1}" != , ]] ||
      refuse "--$stage-replicas \"${replicas[$stage]}\": replica $n's device list \"$list\" is not a comma-separated" \
             "list of devices (one list per replica, lists separated by ';', e.g. \"cuda:0,cuda:1;cuda:2,cuda:3\")"
    for d in "${devs[@]}"; do
      [[ "${owner[$d]:-$n}" != "$n" ]] && refuse "--$stage-replicas \"${replicas[$stage]}\": $d is in replicas" \
        "${owner[$d]} and $n; each replica of a stage needs devices of its own"
      [[ -z "${owner[$d]+x}" ]] || refuse "--$stage-replicas \"${replicas[$stage]}\": replica $n lists $d twice"
      owner[$d]=$n
    done
    r=${#devs[@]}
    if [[ -n "${ranks_given[$stage]+x}" ]]; then
      r=${ranks[$stage]}
      (( r % ${#devs[@]} == 0 )) || refuse "--$stage-ranks $r with replica $n's ${#devs[@]} devices ($list):" \
        "each replica's ranks compute on its devices in turn, so give a multiple of its device count" \
        "(or leave --$stage-ranks out: one rank per device)"
    fi
    name=$stage; port=${ports[$stage]}
    if [[ ${#lists[@]} -gt 1 ]]; then
      name=$stage.$n; (( port == 0 )) || port=$((port + 100 * k))
    fi
    names+=("$name"); inst_stage[$name]=$stage; inst_devices[$name]=$list; inst_ranks[$name]=$r; inst_port[$name]=$port
  done
  unset owner
done

mkdir -p "$run_dir"
run_dir="$(cd "$run_dir" && pwd)"
# shellcheck source=scripts/procs.sh
source scripts/procs.sh
alive() { [[ -f "$1" ]] && pid_alive "$(cat "$1")"; }

# A run that fails (a port taken, a stage that died while starting, Ctrl-C) stops what it started itself, says so,
# and names what it found running and leaves so; run/endpoints.env goes with what it named.
started=()  # the instances up.sh started, in order ("render" last)
why=failed
stop_started() {
  local rc=$? name pidf what="" before=""
  trap - EXIT TERM; trap '' INT  # a second Ctrl-C does not cut the stopping short (10 s at most a stage)
  (( rc != 0 )) || return 0
  [[ -z "${waiter:-}" ]] || kill "$waiter" 2>/dev/null || true
  if (( ${#started[@]} )); then
    for name in "${started[@]}"; do what+="${what:+, }$name (pid $(cat "$run_dir/$name.pid"))"; done
    echo "up.sh: $why; stopping what it started: $what" >&2
    for (( i = ${#started[@]} - 1; i >= 0; i-- )); do
      name=${started[$i]}; pidf="$run_dir/$name.pid"
      stop_stage "$(cat "$pidf")" "$run_dir/tmp/$name" 10
      rm -f "$pidf" "$run_dir/$name.port" "$run_dir/$name.port.http"; rm -rf "$run_dir/tmp/$name"
      echo "up.sh: stopped $name" >&2
    done
    rm -f "$run_dir/endpoints.env" "$run_dir/render.stages"
  fi
  for name in "${names[@]}" render; do
    if [[ " ${started[*]} " != *" $name "* ]] && alive "$run_dir/$name.pid"; then
      before+="${before:+, }$name (pid $(cat "$run_dir/$name.pid"))"
    fi
  done
  [[ -z "$before" ]] || echo "up.sh: left running, as it found them: $before (scripts/down.sh --run-dir $run_dir" \
                             "stops them)" >&2
  exit "$rc"
}
trap stop_started EXIT
trap 'why=interrupted; exit 130' INT
trap 'exit 143' TERM

# 2. A stage's instances not asked for now (the single one when it is to run as replicas, or replicas beyond the
#    count) are stopped first: they would hold the ports and devices of the new ones.
for pidf in "$run_dir"/{encoder,dit,decoder}.pid "$run_dir"/{encoder,dit,decoder}.*.pid; do
  [[ -f "$pidf" ]] || continue
  name="$(basename "$pidf" .pid)"
  [[ -z "${inst_stage[$name]+x}" ]] || continue
  if [[ -n "$(stage_pids "$(cat "$pidf")" "$run_dir/tmp/$name")" ]]; then
    echo "$name: not among the instances asked for now (the stage's replicas changed); stopping it"
    stop_stage "$(cat "$pidf")" "$run_dir/tmp/$name" 30
  fi
  rm -f "$pidf" "$run_dir/$name.port"; rm -rf "$run_dir/tmp/$name"
done

# 3. Start each instance that is not running.
for name in "${names[@]}"; do
  stage=${inst_stage[$name]}
  pidf="$run_dir/$name.pid"
  if alive "$pidf"; then echo "$name already running (pid $(cat "$pidf"))"; continue; fi
  stage_tmp="$run_dir/tmp/$name"  # the stage's temp files and torchrun's torchelastic_* dirs
  if [[ -f "$pidf" && -n "$(stage_pids "$(cat "$pidf")" "$stage_tmp")" ]]; then
    echo "$name: its launcher (pid $(cat "$pidf")) is gone but processes it started remain; stopping them"
    stop_stage "$(cat "$pidf")" "$stage_tmp" 10
  fi
  rm -rf "$stage_tmp"; mkdir -p "$stage_tmp"
  args=(--host "$host" --port "${inst_port[$name]}" --port-file "$run_dir/$name.port"
        --lease-dir "$run_dir/leases" --residency "$residency")
  [[ -n "$models_dir" ]] && args+=(--models-dir "$models_dir")
  [[ -n "${inst_devices[$name]}" ]] && args+=(--devices "${inst_devices[$name]}")
  [[ -n "$gpu_cap" ]] && args+=(--gpu-memory-cap-gb "$gpu_cap")
  rm -f "$run_dir/$name.port"
  if [[ "${inst_ranks[$name]}" -gt 1 ]]; then
    # A failed rank group ends torchrun (it restarts nothing: its count would never refill); the supervisor starts
    # it again, at most 3 times in any 10 minutes (docs/reliability.md, "Restarts").
    cmd=("$PY" -m stagekit.supervise --max-restarts 3 --restart-window-s 600 --
         "$PY" -m torch.distributed.run --standalone --nproc-per-node "${inst_ranks[$name]}" --max-restarts 0
         -m "${module[$stage]}" "${args[@]}" "${extra[@]}")
  else
    cmd=("$PY" -m "${module[$stage]}" "${args[@]}" "${extra[@]}")
  fi
  TMPDIR="$stage_tmp" setsid "${cmd[@]}" >>"$run_dir/$name.log" 2>&1 < /dev/null &
  echo $! > "$pidf"; started+=("$name")
  on=""; [[ -z "${replicas[$stage]+x}" ]] || on=", devices ${inst_devices[$name]}"
  echo "started $name (pid $!, ranks ${inst_ranks[$name]}$on), log $run_dir/$name.log"
done

# 4. Wait until every instance is SERVING; endpoints.env gets one line per stage, its replicas listed as the render
#    service's --dit takes them (1=HOST:PORT,2=HOST:PORT).
#    The waiters run in the background (SIGINT ignored, as for every background job of a script), and up.sh waits for
#    them: a Ctrl-C interrupts the wait, never a Python start-up half-way (a traceback), and the trap stops the waiter.
"$PY" - "$run_dir" "${names[@]}" <<'PYEOF' &
import os, sys, time
from pathlib import Path
from minimax_h3.services import SERVICE_NAMES
from stagekit.channels import health_of, open_channel
run = Path(sys.argv[1]); deadline = time.time() + 600; addrs = {}
def failed(name, what):  # the log's last lines say why; the whole log stays there
    log = run / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    sys.exit(f"{name} {what}; the last {len(tail)} lines of {log}:\n" + "\n".join(f"  {x}" for x in tail))
for name in sys.argv[2:]:
    stage, _, replica = name.partition(".")
    while True:
        pf, pid = run / f"{name}.port", run / f"{name}.pid"
        if pf.exists():
            ch = open_channel(f"127.0.0.1:{pf.read_text().strip()}")
            if health_of(ch, SERVICE_NAMES[stage]) == "SERVING":
                addr = f"127.0.0.1:{pf.read_text().strip()}"
                addrs.setdefault(stage, []).append(f"{replica}={addr}" if replica else addr); break
        try:
            os.kill(int(pid.read_text()), 0)
        except (OSError, ValueError):
            failed(name, "died while starting")
        if time.time() > deadline:
            failed(name, "not SERVING after 600 s")
        time.sleep(0.2)
lines = [f"H3_{stage.upper()}={','.join(a)}" for stage, a in addrs.items()]
(run / "endpoints.env").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
waiter=$!; wait "$waiter"

# The render service: after the stages, whose endpoints it is given (and restarted when they moved: a stage started
# again on another port). Users call it (.venv/bin/python -m client render).
pidf="$run_dir/render.pid"; render_tmp="$run_dir/tmp/render"; stages_now="$(cat "$run_dir/endpoints.env")"
if alive "$pidf" && [[ "$(cat "$run_dir/render.stages" 2>/dev/null)" == "$stages_now" ]]; then
  echo "render already running (pid $(cat "$pidf"))"
else
  if alive "$pidf"; then echo "render: the stages moved; restarting it"; fi
  if [[ -f "$pidf" && -n "$(stage_pids "$(cat "$pidf")" "$render_tmp")" ]]; then
    stop_stage "$(cat "$pidf")" "$render_tmp" 30
  fi
  rm -rf "$render_tmp"; mkdir -p "$render_tmp"
  ep() { sed -n "s/^H3_$1=//p" "$run_dir/endpoints.env"; }
  rm -f "$run_dir/render.port" "$run_dir/render.port.http"
  TMPDIR="$render_tmp" setsid "$PY" -m render_svc --host "$host" --port "$render_port" \
    --port-file "$run_dir/render.port" --run-dir "$run_dir/render" --http-port "$web_port" \
    --encoder "$(ep ENCODER)" --dit "$(ep DIT)" --decoder "$(ep DECODER)" >>"$run_dir/render.log" 2>&1 < /dev/null &
  echo $! > "$pidf"; started+=(render)
  echo "$stages_now" > "$run_dir/render.stages"
  echo "started render (pid $!), log $run_dir/render.log"
fi
"$PY" - "$run_dir" <<'PYEOF' &
import os, sys, time
from pathlib import Path
from minimax_h3.services import SERVICE_NAMES
from stagekit.channels import health_of, open_channel
run = Path(sys.argv[1]); deadline = time.time() + 300
pf, pid = run / "render.port", run / "render.pid"
def failed(what):  # the log's last lines say why; the whole log stays there
    log = run / "render.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    sys.exit(f"render {what}; the last {len(tail)} lines of {log}:\n" + "\n".join(f"  {x}" for x in tail))
while not (pf.exists() and health_of(open_channel(f"127.0.0.1:{pf.read_text().strip()}"), SERVICE_NAMES["render"]) == "SERVING"):
    try:
        os.kill(int(pid.read_text()), 0)
    except (OSError, ValueError):
        failed("died while starting")
    if time.time() > deadline:
        failed("not SERVING after 300 s")
    time.sleep(0.2)
lines = [f"H3_RENDER=127.0.0.1:{pf.read_text().strip()}"]
web = run / "render.port.http"
if web.exists():
    lines.append(f"H3_RENDER_WEB=http://127.0.0.1:{web.read_text().strip()}/")
with open(run / "endpoints.env", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
waiter=$!; wait "$waiter"
echo "endpoints written to $run_dir/endpoints.env (.venv/bin/python -m client reads run/endpoints.env by default)"
