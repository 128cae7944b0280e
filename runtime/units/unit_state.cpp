// SPDX-License-Identifier: Apache-2.0
// Names of the unit states and their moves (Note [Unit states]).

#include "runtime/units/unit_state.hpp"

#include "device/message.hpp"

#include <taskswap/error.hpp>

namespace taskswap::detail {

std::string_view to_string(slot_content c) noexcept
{
  switch (c) {
    case slot_content::none: return "none";
    case slot_content::whole: return "whole";
    case slot_content::params: return "params";
    case slot_content::grads: return "grads";
  }
  return "?";
}

std::string_view to_string(coherence c) noexcept
{
  switch (c) {
    case coherence::clean: return "clean";
    case coherence::device_newer: return "device_newer";
    case coherence::home_newer: return "home_newer";
    case coherence::refreshed: return "refreshed";
  }
  return "?";
}

std::string_view to_string(step_phase p) noexcept
{
  switch (p) {
    case step_phase::idle: return "idle";
    case step_phase::train: return "train";
    case step_phase::frozen: return "frozen";
    case step_phase::frozen_reduced: return "frozen_reduced";
    case step_phase::stepped_local: return "stepped_local";
    case step_phase::stepped_reduced: return "stepped_reduced";
    case step_phase::step_deferred: return "step_deferred";
    case step_phase::updated_on_aux: return "updated_on_aux";
    case step_phase::release_deferred: return "release_deferred";
    case step_phase::update_only: return "update_only";
    case step_phase::updated: return "updated";
  }
  return "?";
}

std::string_view to_string(step_path p) noexcept
{
  switch (p) {
    case step_path::local: return "local";
    case step_path::local_guarded: return "local_guarded";
    case step_path::reduced: return "reduced";
    case step_path::reduced_guarded: return "reduced_guarded";
  }
  return "?";
}

std::string_view to_string(phase_move m) noexcept
{
  switch (m) {
    case phase_move::acquire_train: return "acquire_train";
    case phase_move::acquire_frozen: return "acquire_frozen";
    case phase_move::acquire_frozen_reduced: return "acquire_frozen_reduced";
    case phase_move::hold_for_update: return "hold_for_update";
    case phase_move::step_local: return "step_local";
    case phase_move::step_now: return "step_now";
    case phase_move::defer_to_reduction: return "defer_to_reduction";
    case phase_move::defer_to_end_step: return "defer_to_end_step";
    case phase_move::update_on_aux: return "update_on_aux";
    case phase_move::defer_release: return "defer_release";
    case phase_move::release: return "release";
    case phase_move::release_after_update: return "release_after_update";
    case phase_move::update_and_release: return "update_and_release";
    case phase_move::end_step_reset: return "end_step_reset";
  }
  return "?";
}

std::string_view to_string(slot_move m) noexcept
{
  switch (m) {
    case slot_move::place_pinned: return "place_pinned";
    case slot_move::swap_in_whole: return "swap_in_whole";
    case slot_move::swap_in_params: return "swap_in_params";
    case slot_move::map_grads: return "map_grads";
    case slot_move::narrow_to_params: return "narrow_to_params";
    case slot_move::evict: return "evict";
    case slot_move::map_params: return "map_params";
  }
  return "?";
}

std::string_view to_string(coherence_move m) noexcept
{
  switch (m) {
    case coherence_move::fill: return "fill";
    case coherence_move::step_on_device: return "step_on_device";
    case coherence_move::step_on_host: return "step_on_host";
    case coherence_move::write_back: return "write_back";
    case coherence_move::upload_params: return "upload_params";
    case coherence_move::drop: return "drop";
    case coherence_move::stash: return "stash";
  }
  return "?";
}

void illegal_move(std::string_view unit, std::string_view move, std::string_view from, step_path p)
{
  throw error(message("taskswap internal error: unit '", unit, "': the ", to_string(p), " step path has no move ", move,
                      " from ", from, " (Note [Unit states])"));
}

}  // namespace taskswap::detail
