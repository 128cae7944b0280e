#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_stop_unsaved.sh WORKDIR TRAINER CONFIG
# SIGINT to a trainer without --checkpoint: it stops at a step boundary, says that nothing was
# saved, and exits with the signal's conventional status (130). (A second signal ending the process
# at once is tested deterministically in tests/runtime/stop_signals_test.cpp: two signals sent from
# outside may merge into one.)
set -euo pipefail
work=$1 trainer=$2 config=$3
rm -rf "$work" && mkdir -p "$work"
start() {
  "$trainer" "$config" --steps 1000000 --log-every 10 "$@" >"$work/log" 2>&1 &
  pid=$!
  trap 'kill -KILL "$pid" 2>/dev/null || true' EXIT
  for _ in $(seq 600); do grep -q "^  step " "$work/log" && break; sleep 0.1; done
  grep -q "^  step " "$work/log" || { cat "$work/log"; echo "run_stop_unsaved: the run never started training"; exit 1; }
}
start
kill -INT "$pid"
rc=0; wait "$pid" || rc=$?
tail -n 2 "$work/log"
[ "$rc" -eq 130 ] || { echo "run_stop_unsaved: exit $rc, not 130"; exit 1; }
grep -q "^nothing was saved (no --checkpoint)" "$work/log" || { echo "run_stop_unsaved: no 'nothing was saved'"; exit 1; }
echo "run_stop_unsaved: stopped at a step boundary, nothing saved, exit 130"
