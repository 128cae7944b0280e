#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_resume.sh WORKDIR [mpiexec NP] -- TRAINER CONFIG STEPS STOP
# Trains STEPS steps uninterrupted; then STOP steps with a checkpoint (every STOP/2 steps too) and a
# run that resumes from it. Passes when the resumed run's final home slabs are bitwise those of the
# uninterrupted run (on every rank under mpiexec).
set -euo pipefail
source "$(dirname "$0")/launch.sh" "$@"
set -- "${rest[@]}"
cd "$work"  # a configuration's relative paths ([storage] path) land in the test's own folder
trainer=$1 config=$2 steps=$3 stop=$4
"${launch[@]}" "$trainer" "$config" --steps "$steps" --save-params "$work/uninterrupted.bin" | tail -n 1
"${launch[@]}" "$trainer" "$config" --steps "$steps" --stop-after "$stop" --checkpoint "$work/ck" \
  --checkpoint-every $((stop / 2)) | tail -n 1
grep -q "^steps_done = $stop\$" "$work/ck/manifest.toml" || { echo "run_resume: the checkpoint is not at step $stop"; exit 1; }
resume_equals run_resume "$trainer" "$config" "$steps" "$stop"
echo "run_resume: resumed at step $stop of $steps: bitwise equal to the uninterrupted run"
