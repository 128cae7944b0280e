# SPDX-License-Identifier: Apache-2.0
# Sourced by run_bitwise.sh and run_resume.sh with their arguments: WORKDIR [mpiexec NP] -- ARGS...
# Sets work (a fresh WORKDIR), launch (empty, or mpiexec with its flags and -np NP) and rest (ARGS).
work=$1; shift
launch=()
if [ "$1" != "--" ]; then
  launch=("$1" --allow-run-as-root --oversubscribe --bind-to none -np "$2"); shift 2
fi
shift  # --
rest=("$@")
rm -rf "$work" && mkdir -p "$work"
