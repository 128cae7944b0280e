#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: run_cli.sh TASKSWAP CONFIG_DIR WORK_DIR CASE
# The `taskswap` command line as a user runs it: plan and probe write their JSON; headroom finds a
# larger batch with taskswap than all-resident, within 5 % of the planner; errors say what to change.
set -uo pipefail
taskswap=$1 configs=$2 work=$3 case=$4
rm -rf "$work" && mkdir -p "$work"
fail() { echo "run_cli ($case): $*"; exit 1; }
json() { python3 -c "import json,sys; d=json.load(open('$1')); print($2)"; }

expect_error() {  # expect_error TEXT COMMAND...
  local text=$1; shift
  local out; out=$("$@" 2>&1) && fail "'$*' succeeded; expected an error mentioning: $text"
  echo "$out"
  grep -qF -- "$text" <<<"$out" || fail "the error does not mention: $text"
}

case $case in
plan)
  "$taskswap" plan "$configs/emulated.toml" --json "$work/plan.json" || fail "plan failed"
  [ "$(json "$work/plan.json" "d['max_batch'] > d['max_batch_all_resident'] > 0")" = True ] || fail "max_batch"
  [ "$(json "$work/plan.json" "d['peak_device_bytes'] <= d['budget'] and d['pinned_host_bytes'] > 0")" = True ] || fail "bytes"
  [ "$(json "$work/plan.json" "d['transfer_ms_per_step'] > 0 and d['link_source'] == '[device] link_bandwidth'")" = True ] || fail "link"
  "$taskswap" plan "$configs/emulated.toml" --link-rate "1 GiB/s" --bytes-per-sample "1 MiB" --json "$work/given.json" >/dev/null || fail "plan with given rate"
  [ "$(json "$work/given.json" "d['link_bytes_per_second'] == 1073741824 and d['bytes_per_sample'] == 1048576")" = True ] || fail "given rate"
  # Whole granules: the peak counts them and the rounding is reported.
  sed 's/^budget = .*/budget = "4 MiB"\ngranularity = "64 KiB"/' "$configs/emulated.toml" > "$work/granule.toml"
  "$taskswap" plan "$work/granule.toml" --json "$work/granule.json" > "$work/granule.txt" || fail "plan at 64 KiB granules"
  grep -q "granule rounding .* in whole granules of 64.0 KiB" "$work/granule.txt" || fail "no rounding line"
  [ "$(json "$work/granule.json" "d['granule'] == 65536 and d['rounding_bytes'] > 0 and d['peak_device_bytes'] % 65536 == 0")" = True ] || fail "granule json"
  # The disk time at the [storage] drive's rates, measured there, and whether the drive keeps up.
  sed "s#^path = .*#path = \"$work/drive\"#" "$configs/emulated-disk.toml" > "$work/disk.toml"
  "$taskswap" plan "$work/disk.toml" --measure-disk --json "$work/disk.json" > "$work/disk.txt" || fail "plan --measure-disk"
  grep -q "the drive keeps up  *with steps of" "$work/disk.txt" || fail "no line saying whether the drive keeps up"
  [ "$(json "$work/disk.json" "d['disk_read_bytes_per_second'] > 0 and d['disk_ms_per_step'] > 0 and d['disk_source'].startswith('measured in $work/drive')")" = True ] || fail "measured disk json"
  [ ! -e "$work/drive" ] || fail "plan --measure-disk left the directory it made"
  sed 's/^home = "disk"/home = "host"/' "$work/disk.toml" > "$work/no-disk.toml"
  expect_error "homes no unit on disk" "$taskswap" plan "$work/no-disk.toml" --measure-disk
  expect_error "has none; add [storage] path" "$taskswap" plan "$configs/emulated.toml" --measure-disk
  expect_error "not both" "$taskswap" plan "$work/disk.toml" --measure-disk --disk-read-rate "1 GB/s" --disk-write-rate "1 GB/s"
  ;;
probe)
  "$taskswap" probe --emulated --size "8 MiB" --repeats 2 --json "$work/probe.json" || fail "probe failed"
  [ "$(json "$work/probe.json" "d['devices'][0]['bandwidth'][0]['h2d_bytes_per_second'] > 0 and d['devices'][0]['copy_engines'] == 2")" = True ] || fail "probe json"
  # The disk tier's drive: a unit file written and read in a directory of the work folder.
  "$taskswap" probe --emulated --size "1 MiB" --repeats 2 --storage "$work/drive" --storage-size "5 MiB" --json "$work/storage.json" > "$work/storage.txt" || fail "probe --storage failed"
  grep -q "^storage $work/drive" "$work/storage.txt" || fail "probe --storage printed no rates"
  [ "$(json "$work/storage.json" "d['storage']['read_bytes_per_second'] > 0 and d['storage']['write_bytes_per_second'] > 0 and d['storage']['bytes'] == 5 << 20")" = True ] || fail "probe storage json"
  [ ! -e "$work/drive/taskswap-probe-"* ] || fail "probe left its unit file"
  expect_error "cannot make the directory" "$taskswap" probe --emulated --size "1 MiB" --storage "$work/storage.txt/below"
  ;;
headroom)
  "$taskswap" headroom "$configs/../../tests/tools/headroom-small.toml" --json "$work/headroom.json" --trace "$work/trace.json" --rounds 1 --steps 4 || fail "headroom failed"
  [ "$(json "$work/headroom.json" "d['max_batch_taskswap'] > d['max_batch_resident'] > 0")" = True ] || fail "taskswap's batch is not larger"
  [ "$(json "$work/headroom.json" "abs(d['predicted_max_batch_taskswap'] - d['max_batch_taskswap']) <= 0.05 * d['max_batch_taskswap']")" = True ] || fail "prediction off by more than 5 %"
  [ "$(json "$work/headroom.json" "d['step_time_ratio'] > 0")" = True ] || fail "step_time_ratio"
  # The trunk's activations offloaded: a larger batch still, the planner's within 5 %.
  [ "$(json "$work/headroom.json" "d['max_batch_offloaded'] > d['max_batch_taskswap']")" = True ] || fail "offloading activations gives no larger batch"
  [ "$(json "$work/headroom.json" "abs(d['predicted_max_batch_offloaded'] - d['max_batch_offloaded']) <= 0.05 * d['max_batch_offloaded']")" = True ] || fail "offloaded prediction off by more than 5 %"
  [ "$(json "$work/headroom.json" "d['step_time_ratio_offloaded'] > 0 and d['d2h_bytes_per_step_offloaded'] > d['d2h_bytes_per_step']")" = True ] || fail "offloaded timings"
  # With 64 KiB granules the prediction still holds: the planner counts them as the pool does.
  sed 's/^budget = .*/budget = "1 MiB"\ngranularity = "64 KiB"/' "$configs/../../tests/tools/headroom-small.toml" > "$work/granule.toml"
  "$taskswap" headroom "$work/granule.toml" --json "$work/granule.json" --rounds 1 --steps 4 > /dev/null || fail "headroom at 64 KiB granules"
  [ "$(json "$work/granule.json" "abs(d['predicted_max_batch_taskswap'] - d['max_batch_taskswap']) <= 0.05 * d['max_batch_taskswap']")" = True ] || fail "prediction at 64 KiB granules off by more than 5 %"
  python3 -c "import json; t=json.load(open('$work/trace.json')); assert any('swap-in' in e.get('name','') for e in t['traceEvents'])" || fail "trace"
  # The trunk not pinned: it streams, and the deepest trunk each trains at the batch is found too.
  sed '/^\[\[units\]\]/,/^residency = "pinned"/d' "$configs/../../tests/tools/headroom-small.toml" > "$work/stream.toml"
  "$taskswap" headroom "$work/stream.toml" --json "$work/stream.json" --rounds 1 --steps 4 > /dev/null || fail "headroom, streamed trunk"
  [ "$(json "$work/stream.json" "d['max_trunk_layers_streamed'] > d['max_trunk_layers_resident'] > 0")" = True ] || fail "the streamed trunk is not deeper"
  [ "$(json "$work/stream.json" "abs(d['predicted_max_trunk_layers_streamed'] - d['max_trunk_layers_streamed']) <= 0.05 * d['max_trunk_layers_streamed']")" = True ] || fail "trunk depth prediction off by more than 5 %"
  [ "$(json "$work/stream.json" "abs(d['predicted_max_batch_offloaded'] - d['max_batch_offloaded']) <= 0.05 * d['max_batch_offloaded']")" = True ] || fail "offloaded prediction, streamed trunk, off by more than 5 %"
  ;;
errors)
  expect_error "the configuration '$work/missing.toml' does not exist" "$taskswap" headroom "$work/missing.toml"
  expect_error "the configuration '$work' is a directory" "$taskswap" plan "$work"
  sed 's/match = "trunk\/\*"/match = "trnk\/*"/' "$configs/emulated.toml" > "$work/unknown-unit.toml"
  expect_error 'match = "trnk/*" matches no unit' "$taskswap" plan "$work/unknown-unit.toml"
  sed 's/^budget = .*/budget = "64 MiB"/' "$configs/emulated.toml" > "$work/no-batch.toml"
  expect_error "leaves no room for a batch" "$taskswap" headroom "$work/no-batch.toml"
  sed 's/^budget = .*/budget = "400 KiB"/' "$configs/emulated.toml" > "$work/small-budget.toml"
  expect_error "the pinned units need" "$taskswap" plan "$work/small-budget.toml"
  expect_error "is not a rate" "$taskswap" plan "$configs/emulated.toml" --link-rate "fast"
  printf '[activations]\noffload = "disk"\n' | cat "$configs/emulated.toml" - > "$work/offload-disk.toml"
  expect_error '[activations] offload: use "host"' "$taskswap" plan "$work/offload-disk.toml"
  # Activation blocks count in the plan check: a batch whose blocks do not fit is refused, naming them.
  printf '[activations]\noffload = "host"\n' | cat "$configs/emulated.toml" - | sed 's/^batch = .*/batch = 4096/' > "$work/offload-big.toml"
  expect_error "'act/0/input'" "$taskswap" plan "$work/offload-big.toml"
  # At the configured budget the blocks stop the batch; with the rest of the device it grows past all-resident.
  sed 's/^batch = .*/batch = 256/' "$work/offload-big.toml" > "$work/offload.toml"
  "$taskswap" plan "$work/offload.toml" --json "$work/offload.json" > /dev/null || fail "plan, offloaded"
  [ "$(json "$work/offload.json" "d['max_batch_offloaded'] > d['max_batch_all_resident'] > d['max_batch'] > 256")" = True ] || fail "offloaded batches"
  ;;
*) fail "unknown case" ;;
esac
echo "run_cli ($case): passed"
