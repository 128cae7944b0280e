#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_stalled_rank.sh WORKDIR mpiexec 2 -- TRAINER CONFIG
# One rank of two is stopped (SIGSTOP) in the middle of training, with [comm] timeout = "15 s". Passes
# when the job ends within 90 s (the watchdog ends the other rank's wait) and the failure is told
# once on the rank that saw it (by the trainer; the runtime's teardown and the device pool's do
# not repeat it), not once per unit or once per part. 15 s, not less: under tsan on 2 cores a rank once fell 5 s behind in its first
# steps, before this script had stopped anything.
set -uo pipefail
source "$(dirname "$0")/launch.sh" "$@"
set -- "${rest[@]}"
trainer=$1 config=$2
sed 's/^timeout = .*/timeout = "15 s"/; s/^steps = .*/steps = 1000000/' "$config" >"$work/stall.toml"
grep -q '^timeout = "15 s"' "$work/stall.toml" || { echo "run_stalled_rank: the config has no [comm] timeout to set"; exit 1; }
log="$work/log"
timeout -k 10 90 "${launch[@]}" --output-filename "$work/out" "$trainer" "$work/stall.toml" >"$log" 2>&1 &
runner=$!
trap 'kill -KILL "$runner" 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "^  step " "$log" && break; sleep 0.1; done
target=$(rank_pid 1 "$work/stall.toml")  # rank 1 of this test's job
[ -n "$target" ] || { cat "$log"; echo "run_stalled_rank: rank 1 not found"; exit 1; }
kill -STOP "$target"
rc=0
wait "$runner" || rc=$?
kill -KILL "$target" 2>/dev/null || true
[ "$rc" -ne 124 ] || { echo "run_stalled_rank: the job still ran after 90 s"; exit 1; }
[ "$rc" -ne 0 ] || { echo "run_stalled_rank: the job ended well although a rank stalled"; exit 1; }
rank0=$(find "$work/out" -path '*rank.0*' -name 'std*' -exec cat {} +)
echo "$rank0" | grep -v "^  step " | tail -n 8
count=$(grep -c "did not finish within" <<<"$rank0")
[ "$count" -ge 1 ] || { echo "run_stalled_rank: rank 0 never reported the timeout"; exit 1; }
[ "$count" -eq 1 ] || { echo "run_stalled_rank: the timeout's text appears $count times on rank 0 (once is enough)"; exit 1; }
echo "run_stalled_rank: the job ended (exit $rc); rank 0 told the timeout $count time(s)"
