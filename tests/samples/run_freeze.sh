#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_freeze.sh FREEZE_AT -- LAUNCHER... TRAINER CONFIG [ARGS...]
# Trains with the trunk frozen from step FREEZE_AT (under mpirun: the log lines report the bytes
# allreduced per step) and passes when every interval after the freeze reduces less than 80 % of
# the first interval's (the trunk's gradients no longer travel; the adapters' still do) and the
# loss still fell on every task.
set -euo pipefail
at=$1; shift 2  # FREEZE_AT --
out=$("$@" --freeze-trunk-after "$at")
echo "$out" | grep -v '^  task/'
grep -q "step $at: the trunk is frozen from here on" <<<"$out" || { echo "run_freeze: no freeze at step $at"; exit 1; }
# "step END: mean loss ... ; reduced X KiB/step"
mapfile -t rows < <(sed -nE 's/^  step ([0-9]+): mean loss .*; reduced ([0-9.]+) KiB\/step$/\1 \2/p' <<<"$out")
[ "${#rows[@]}" -ge 3 ] || { echo "run_freeze: expected reduced-bytes log lines"; exit 1; }
read -r _ before <<<"${rows[0]}"
after=0
for row in "${rows[@]}"; do
  read -r end kib <<<"$row"
  # intervals that end more than a log interval after the freeze lie wholly after it
  if [ "$end" -gt $((at + 100)) ]; then
    after=$((after + 1))
    awk -v a="$kib" -v b="$before" 'BEGIN { exit !(a < 0.8 * b) }' ||
      { echo "run_freeze: step $end reduced $kib KiB/step, not less than 80 % of $before before the freeze"; exit 1; }
  fi
done
[ "$after" -gt 0 ] || { echo "run_freeze: no interval after the freeze"; exit 1; }
line=$(grep '^loss fell on' <<<"$out")
read -r fell trained < <(sed -E 's/loss fell on ([0-9]+) of ([0-9]+) .*/\1 \2/' <<<"$line")
[ "$trained" -gt 0 ] && [ "$fell" -eq "$trained" ] || { echo "run_freeze: the loss did not fall on every task"; exit 1; }
echo "run_freeze: $before KiB/step before the freeze, less than 80 % of it in each of $after intervals after"
