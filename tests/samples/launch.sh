# SPDX-License-Identifier: Apache-2.0
# Sourced by the sample's test scripts with their arguments: WORKDIR [mpiexec NP] -- ARGS...
# Sets work (a fresh WORKDIR), launch (empty, or mpiexec with its flags and -np NP) and rest (ARGS),
# and defines rank_pid and resume_equals.
work=$1; shift
launch=()
if [ "$1" != "--" ]; then
  launch=("$1" --allow-run-as-root --oversubscribe --bind-to none -np "$2"); shift 2
fi
shift  # --
rest=("$@")
rm -rf "$work" && mkdir -p "$work"

# rank_pid RANK NEEDLE: the pid of this job's MPI rank RANK (a process whose command line has an
# argument containing NEEDLE, e.g. a path under $work); empty if there is none.
rank_pid() {
  local p
  for p in /proc/[0-9]*; do
    { grep -qzx "OMPI_COMM_WORLD_RANK=$1" "$p/environ" && grep -qzF "$2" "$p/cmdline" &&
      echo "${p#/proc/}" && return 0; } 2>/dev/null || true
  done
}

# resume_equals NAME TRAINER CONFIG STEPS AT: resumes from $work/ck (at step AT) to STEPS steps and
# compares every rank's final home slabs with $work/uninterrupted.bin*; exits 1 naming NAME if not.
resume_equals() {
  local name=$1 trainer=$2 config=$3 steps=$4 at=$5 f
  "${launch[@]}" "$trainer" "$config" --steps "$steps" --resume "$work/ck" --save-params "$work/resumed.bin" \
    | grep "resumed from .* at step $at\$" || { echo "$name: the run did not resume at step $at"; exit 1; }
  for f in "$work"/uninterrupted.bin*; do
    cmp "$f" "${f/uninterrupted/resumed}" || { echo "$name: ${f/uninterrupted/resumed} differs from $f"; exit 1; }
  done
}
