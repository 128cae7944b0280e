// SPDX-License-Identifier: Apache-2.0
#pragma once

// The registered units (runtime::impl::units_): their records in registration order, at stable
// addresses (events are referenced from pending waits), found by id or by name; how many the
// trainer and the runtime hold; the clock that orders their releases; and, with
// TASKSWAP_CHECK_STATES=1, the check of their states after every step call (unit_table.cpp).

#include "device/expects.hpp"
#include "device/message.hpp"
#include "runtime/swap/unit_record.hpp"

#include <taskswap/error.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace taskswap::detail {

class unit_table {
 public:
  /// Registers a unit as the next id; a name registered before is refused (config_error).
  unit_record& add(const device& dev, const std::string& name, unit_policy policy, unit_layout layout)
  {
    const auto index = static_cast<std::uint32_t>(records_.size());
    if (!by_name_.emplace(name, index).second) {
      throw config_error(message("unit '", name, "' is registered twice; unit names must be unique"));
    }
    return records_.emplace_back(dev, index, name, std::move(policy), std::move(layout));
  }
  [[nodiscard]] std::optional<std::uint32_t> find(std::string_view name) const
  {
    const auto it = by_name_.find(std::string(name));
    return it == by_name_.end() ? std::nullopt : std::optional<std::uint32_t>(it->second);
  }

  [[nodiscard]] std::size_t size() const noexcept { return records_.size(); }
  unit_record& operator[](std::size_t i) { return records_[i]; }
  const unit_record& operator[](std::size_t i) const { return records_[i]; }
  [[nodiscard]] auto begin() noexcept { return records_.begin(); }
  [[nodiscard]] auto end() noexcept { return records_.end(); }
  [[nodiscard]] auto begin() const noexcept { return records_.begin(); }
  [[nodiscard]] auto end() const noexcept { return records_.end(); }
  /// The records themselves, for the swap engine.
  [[nodiscard]] std::deque<unit_record>& records() noexcept { return records_; }

  /// The unit `u`, checked against the ids handed out.
  unit_record& at(unit_id u)
  {
    TASKSWAP_EXPECTS(u.value < records_.size(), message("unit id ", u.value, " of ", records_.size(), " units"));
    return records_[u.value];
  }
  /// The unit `u` as the trainer holds it, for the call `what`: not released, not the runtime's.
  unit_record& held_by_trainer(unit_id u, const char* what)
  {
    unit_record& r = at(u);
    TASKSWAP_EXPECTS(r.phase() != step_phase::release_deferred,
                     message(what, "('", r.name, "'): the unit was released already in this step"));
    TASKSWAP_EXPECTS(r.held() && !r.st.runtime_holds(),
                     message(what, "('", r.name, "'): the unit is not acquired; call acquire first"));
    return r;
  }

  /// Units the trainer holds and those held for an update (not a deferred release).
  [[nodiscard]] std::size_t held() const noexcept { return held_; }
  void count_hold() noexcept { ++held_; }
  void count_let_go() noexcept { --held_; }
  /// What the units counted by held() take of the budget (for an error's numbers).
  [[nodiscard]] std::size_t held_bytes() const noexcept
  {
    std::size_t bytes = 0;
    for (const unit_record& r : records_) {
      if (r.held() && r.phase() != step_phase::release_deferred) { bytes += r.held_bytes; }
    }
    return bytes;
  }
  /// Stamps a release: later releases get larger stamps (the least recently released goes first).
  void stamp_release(unit_record& r) noexcept { r.last_release = ++clock_; }

  /// The states' check (Note [Unit states]), off unless turned on.
  void check_states(bool on) noexcept { check_states_ = on; }
  [[nodiscard]] bool checks_states() const noexcept { return check_states_; }
  /// With the check on, the phase of `u` before a call (idle otherwise).
  [[nodiscard]] step_phase phase_before(unit_id u) const;
  /// With the check on: `call` moved `u` from `before` by `moves` of `path`'s table (none: it may
  /// stay), and every unit's states are consistent. Throws taskswap::error otherwise.
  void check_unit(unit_id u, step_phase before, std::uint32_t moves, const char* call, step_path path) const;
  /// With the check on: every unit's states are consistent, and idle where `step_ended`.
  void check_all(const char* call, bool step_ended, step_path path) const;

 private:
  std::deque<unit_record> records_;
  std::unordered_map<std::string, std::uint32_t> by_name_;
  std::size_t held_ = 0;
  std::uint64_t clock_ = 0;
  bool check_states_ = false;
};

}  // namespace taskswap::detail
