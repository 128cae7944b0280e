#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_kill_rank.sh MPIEXEC NP EXECUTABLE WHERE (before-plan | in-backward). Passes when every surviving rank ended with an
# error within the timeout and the job as a whole did not hang.
set -uo pipefail
mpiexec=$1 np=$2 exe=$3 where=$4
out=$(timeout 150 "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none --enable-recovery -np "$np" "$exe" "$where" 2>&1)
rc=$?
echo "$out" | grep -v "PMIX ERROR"
if [ "$rc" -eq 124 ]; then
  echo "run_kill_rank: the job was still running after 150 s: a rank hung"
  exit 1
fi
passes=$(grep -c "KILL-TEST-PASS" <<<"$out")
if [ "$passes" -ne $((np - 1)) ]; then
  echo "run_kill_rank: expected $((np - 1)) surviving ranks to end with an error in time, $passes did"
  exit 1
fi
echo "run_kill_rank: all $((np - 1)) surviving ranks ended with an error in time"
