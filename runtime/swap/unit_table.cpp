// SPDX-License-Identifier: Apache-2.0
// The unit states' check (Note [Unit states]): with TASKSWAP_CHECK_STATES=1, after every public
// step call, each unit's states are consistent across the three machines, and the unit the call named
// reached its phase by the moves that call may make on the step path.

#include "runtime/swap/unit_table.hpp"

namespace taskswap::detail {

step_phase unit_table::phase_before(unit_id u) const
{
  if (!check_states_ || u.value >= records_.size()) { return step_phase::idle; }
  return records_[u.value].phase();
}

void unit_table::check_unit(unit_id u, step_phase before, std::uint32_t moves, const char* call, step_path path) const
{
  if (!check_states_) { return; }
  const unit_record& r = records_[u.value];
  const step_phase now = r.phase();
  const bool unchanged_allowed = moves == 0;  // grads_ready moves nothing
  if (!(unchanged_allowed && now == before) && (reachable_phases(before, path, moves) & bit(now)) == 0) {
    throw error(message("taskswap internal error: ", call, "('", r.name, "') moved the unit from phase ",
                        to_string(before), " to ", to_string(now), ", which the ", to_string(path),
                        " step path's table does not allow (Note [Unit states])"));
  }
  check_all(call, false, path);
}

void unit_table::check_all(const char* call, bool step_ended, step_path path) const
{
  if (!check_states_) { return; }
  for (const unit_record& r : records_) {
    const unit_states& s = r.st;
    const std::string_view wrong =
      inconsistency(s, r.policy.optimizer == optimizer_placement::host, r.pinned(), path, r.layout.activation);
    const bool left_held = step_ended && s.phase != step_phase::idle;
    if (!wrong.empty() || left_held) {
      throw error(message("taskswap internal error: after ", call, " unit '", r.name, "' is ", to_string(s.content),
                          "/", to_string(s.coh), "/", to_string(s.phase), " on the ", to_string(path),
                          " step path: ", left_held ? "not idle after end_step" : wrong, " (Note [Unit states])"));
    }
  }
}

}  // namespace taskswap::detail
