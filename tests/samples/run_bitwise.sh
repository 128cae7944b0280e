#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_bitwise.sh WORKDIR [mpiexec NP] -- TRAINER CONFIG [ARGS...]
# Trains CONFIG as configured and again with --all-resident, and passes when the final home slabs
# (params, master, m, v, step of every unit) are bitwise equal; under mpiexec, also equal on every rank.
set -euo pipefail
source "$(dirname "$0")/launch.sh" "$@"
set -- "${rest[@]}"
cd "$work"  # a configuration's relative paths ([storage] path) land in the test's own folder
"${launch[@]}" "$@" --save-params "$work/swapped.bin" | tail -n 3
"${launch[@]}" "$@" --all-resident --save-params "$work/resident.bin" | tail -n 1
files=("$work"/swapped.bin*)
for f in "${files[@]}"; do
  r=${f/swapped/resident}
  cmp "$f" "$r" || { echo "run_bitwise: $f and $r differ"; exit 1; }
done
for f in "${files[@]}"; do
  cmp "${files[0]}" "$f" || { echo "run_bitwise: the ranks' replicas differ"; exit 1; }
done
echo "run_bitwise: ${#files[@]} file(s), swapped and all-resident runs bitwise equal"
