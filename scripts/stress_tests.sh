#!/usr/bin/env bash
# The flake hunt (docs/testing.md): run the whole suite several times while every core is kept busy by another
# process, alternating the default test order and a shuffled one, and tally what failed in which run.
#
#   scripts/stress_tests.sh [--runs 5] [--hogs N] [--order both|default|shuffled] [--out DIR] [-- pytest args]
#
# --hogs: CPU hogs beside the tests (default: one per core; stress-ng if installed, else busy shell loops).
# Shuffled runs need pytest-randomly (.venv/bin/python -m pip install pytest-randomly); each prints its seed
# (--randomly-seed=N replays it). Default-order runs pass -p no:randomly, so the plugin being
# installed never changes them. Results: DIR/run<i>.xml (JUnit) and DIR/summary.txt, also printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
command -v "$PY" >/dev/null || { echo "stress_tests.sh: no $PY: run scripts/setup.sh first (or set PYTHON)" >&2; exit 1; }
runs=5; hogs="$(nproc)"; order=both; out="${TMPDIR:-/tmp}/h3-stress-$(date +%Y%m%d-%H%M%S)"; extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs="$2"; shift 2;;
    --hogs) hogs="$2"; shift 2;;
    --order) order="$2"; shift 2;;
    --out) out="$2"; shift 2;;
    --) shift; extra=("$@"); break;;
    -h|--help) sed -n '2,10p' "$0"; exit 0;;
    *) echo "stress_tests.sh: unknown option $1" >&2; exit 2;;
  esac
done
if [[ "$order" != default ]] && ! "$PY" -c "import pytest_randomly" 2>/dev/null; then
  echo "stress_tests.sh: shuffled runs need pytest-randomly: $PY -m pip install pytest-randomly" >&2; exit 2
fi
mkdir -p "$out"

hog_pids=()
stop_hogs() { for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop_hogs EXIT
if [[ "$hogs" -gt 0 ]]; then
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$hogs" --timeout 0 --quiet & hog_pids+=($!)
  else
    for _ in $(seq "$hogs"); do (while :; do :; done) & hog_pids+=($!); done
  fi
  echo "load: $hogs CPU hog(s) beside the tests ($(command -v stress-ng >/dev/null && echo stress-ng || echo shell loops))"
fi

for i in $(seq "$runs"); do
  if [[ "$order" == shuffled || ( "$order" == both && $((i % 2)) -eq 0 ) ]]; then
    seed=$RANDOM$RANDOM; how=(-p randomly "--randomly-seed=$seed"); label="shuffled (seed $seed)"
  else
    how=(-p no:randomly); label="default order"
  fi
  t=$SECONDS
  echo "run $i/$runs, $label ..."
  "$PY" -m pytest "${how[@]}" -rs --junitxml="$out/run$i.xml" "${extra[@]}" > "$out/run$i.log" 2>&1 || true
  echo "  $(tail -n 1 "$out/run$i.log") [$((SECONDS - t)) s]"
  echo "$i|$label|$((SECONDS - t))" >> "$out/runs.txt"
done

"$PY" - "$out" <<'PYEOF' | tee "$out/summary.txt"
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

out = Path(sys.argv[1])
failed = defaultdict(list)
print(f"{'run':>3}  {'order':<28} {'tests':>5} {'failed':>6} {'skipped':>7} {'wall':>7}")
for line in (out / "runs.txt").read_text().splitlines():
    i, label, wall = line.split("|")
    xml = out / f"run{i}.xml"
    if not xml.exists():
        print(f"{i:>3}  {label:<28} no report (pytest crashed? see run{i}.log)")
        continue
    suite = ET.parse(xml).getroot().find("testsuite")
    bad = 0
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed[f"{case.get('classname')}::{case.get('name')}"].append(i)
            bad += 1
    print(f"{i:>3}  {label:<28} {suite.get('tests'):>5} {bad:>6} {suite.get('skipped'):>7} {wall:>6}s")
print("failures by test:" if failed else "no test failed in any run")
for name, rs in sorted(failed.items()):
    print(f"  {name}: run(s) {', '.join(rs)}")
PYEOF
echo "logs and JUnit reports: $out"
