#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_preempt.sh WORKDIR [mpiexec NP] -- TRAINER CONFIG
# Preemption as a cluster does it: SIGTERM to a training run (under mpiexec, to rank 1 only) with
# --checkpoint. Passes when the run stops at a step boundary, saves, exits 0 and prints the resume
# command, and a run resumed from that checkpoint ends bitwise equal (every rank's home slabs) to
# a run that was never interrupted.
set -euo pipefail
source "$(dirname "$0")/launch.sh" "$@"
set -- "${rest[@]}"
trainer=$1 config=$2
log="$work/preempted.log"

# A loss line every 10 steps: the signal comes soon after training starts (and the runs stay short).
"${launch[@]}" "$trainer" "$config" --steps 1000000 --log-every 10 --checkpoint "$work/ck" >"$log" 2>&1 &
runner=$!
trap 'kill -KILL "$runner" 2>/dev/null || true' EXIT  # nothing left running if this script fails
# Wait until it trains (a loss line), then send the signal to one process.
for _ in $(seq 600); do grep -q "^  step " "$log" && break; sleep 0.1; done
grep -q "^  step " "$log" || { cat "$log"; echo "run_preempt: the run never started training"; exit 1; }
target=$runner
if [ ${#launch[@]} -gt 0 ]; then
  target=$(rank_pid 1 "$work/ck")  # rank 1 of this test's job
  [ -n "$target" ] || { echo "run_preempt: rank 1 not found"; exit 1; }
fi
kill -TERM "$target"
rc=0
wait "$runner" || rc=$?
cat "$log" | tail -n 4
[ "$rc" -eq 0 ] || { echo "run_preempt: the preempted run exited $rc, not 0"; exit 1; }
grep -q "^stopped at step [0-9]* of 1000000 on signal 15" "$log" || { echo "run_preempt: no 'stopped at step'"; exit 1; }
grep -q "^resume with: .* --resume $work/ck" "$log" || { echo "run_preempt: no resume command"; exit 1; }
stopped=$(sed -n 's/^steps_done = \([0-9]*\)$/\1/p' "$work/ck/manifest.toml")
[ -n "$stopped" ] || { echo "run_preempt: the checkpoint has no steps_done"; exit 1; }
steps=$((stopped + 40))
"${launch[@]}" "$trainer" "$config" --steps "$steps" --save-params "$work/uninterrupted.bin" | tail -n 1
resume_equals run_preempt "$trainer" "$config" "$steps" "$stopped"
echo "run_preempt: SIGTERM at step $stopped, resumed to $steps: bitwise equal to the uninterrupted run"
