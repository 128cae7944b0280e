#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_loss_falls.sh TRAINER CONFIG [ARGS...]: passes when the loss fell on every task trained.
set -euo pipefail
out=$("$@")
echo "$out" | grep -v '^  task/'
line=$(grep '^loss fell on' <<<"$out")
read -r fell trained < <(sed -E 's/loss fell on ([0-9]+) of ([0-9]+) .*/\1 \2/' <<<"$line")
[ "$trained" -gt 0 ] && [ "$fell" -eq "$trained" ] || { echo "run_loss_falls: the loss did not fall on every task"; exit 1; }
