// SPDX-License-Identifier: Apache-2.0
// The unit states' tables (Note [Unit states]): every (phase, move, path) is walked and compared
// with the moves this file lists independently (docs/runtime.md's table), the phases each step
// path reaches, the way back to idle, and the consistency rules.

#include "runtime/units/unit_state.hpp"

#include <taskswap/error.hpp>

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace taskswap::detail {
namespace {

std::string text(step_path p, step_phase from, phase_move m, step_phase to)
{
  return std::string(to_string(p)) + ": " + std::string(to_string(from)) + " --" + std::string(to_string(m)) + "--> " +
         std::string(to_string(to));
}

template <class E>
std::set<E> members(std::uint32_t mask, std::size_t count)
{
  std::set<E> out;
  for (std::size_t i = 0; i < count; ++i) {
    if ((mask >> i) & 1U) { out.insert(static_cast<E>(i)); }
  }
  return out;
}

TEST(unit_state, every_phase_move_on_every_path_is_the_documented_one)
{
  // Written out by hand, not from the table: a change to a path's protocol changes this list.
  const std::set<std::string> expected = {
    // no communicator, unguarded: step on the trainer's stream, release
    "local: idle --acquire_train--> train",
    "local: idle --acquire_frozen--> frozen",
    "local: train --step_local--> stepped_local",
    "local: stepped_local --step_local--> stepped_local",
    "local: train --release--> idle",
    "local: stepped_local --release--> idle",
    "local: frozen --release--> idle",
    // no communicator, guarded: the update and the release wait for end_step
    "local_guarded: idle --acquire_train--> train",
    "local_guarded: idle --acquire_frozen--> frozen",
    "local_guarded: train --defer_to_end_step--> step_deferred",
    "local_guarded: step_deferred --defer_release--> release_deferred",
    "local_guarded: release_deferred --update_and_release--> idle",
    "local_guarded: train --release--> idle",
    "local_guarded: frozen --release--> idle",
    // communicator, unguarded: the update after the unit's reduction, on the trainer's stream or aux
    "reduced: idle --acquire_train--> train",
    "reduced: idle --acquire_frozen--> frozen",
    "reduced: idle --acquire_frozen_reduced--> frozen_reduced",
    "reduced: idle --hold_for_update--> update_only",
    "reduced: train --step_now--> stepped_reduced",
    "reduced: frozen_reduced --step_now--> stepped_reduced",
    "reduced: train --defer_to_reduction--> step_deferred",
    "reduced: frozen_reduced --defer_to_reduction--> step_deferred",
    "reduced: step_deferred --update_on_aux--> updated_on_aux",
    "reduced: step_deferred --defer_release--> release_deferred",
    "reduced: frozen --release--> idle",
    "reduced: stepped_reduced --release_after_update--> updated",
    "reduced: updated_on_aux --release_after_update--> updated",
    "reduced: release_deferred --update_and_release--> updated",
    "reduced: update_only --update_and_release--> updated",
    "reduced: idle --end_step_reset--> idle",
    "reduced: updated --end_step_reset--> idle",
    // communicator, guarded: every update at end_step, after the step's reductions
    "reduced_guarded: idle --acquire_train--> train",
    "reduced_guarded: idle --acquire_frozen--> frozen",
    "reduced_guarded: idle --acquire_frozen_reduced--> frozen_reduced",
    "reduced_guarded: idle --hold_for_update--> update_only",
    "reduced_guarded: train --defer_to_end_step--> step_deferred",
    "reduced_guarded: frozen_reduced --defer_to_end_step--> step_deferred",
    "reduced_guarded: step_deferred --defer_release--> release_deferred",
    "reduced_guarded: frozen --release--> idle",
    "reduced_guarded: release_deferred --update_and_release--> updated",
    "reduced_guarded: update_only --update_and_release--> updated",
    "reduced_guarded: idle --end_step_reset--> idle",
    "reduced_guarded: updated --end_step_reset--> idle",
  };
  std::set<std::string> walked;
  for (std::size_t p = 0; p < path_count; ++p) {
    for (std::size_t f = 0; f < phase_count; ++f) {
      for (std::size_t m = 0; m < phase_move_count; ++m) {
        const auto path = static_cast<step_path>(p);
        const auto from = static_cast<step_phase>(f);
        const auto move = static_cast<phase_move>(m);
        if (const auto to = next(phase_rows, from, move, path)) { walked.insert(text(path, from, move, *to)); }
      }
    }
  }
  for (const std::string& t : expected) { EXPECT_TRUE(walked.contains(t)) << "the table lacks " << t; }
  for (const std::string& t : walked) { EXPECT_TRUE(expected.contains(t)) << "the table allows " << t; }
}

TEST(unit_state, a_move_and_path_select_one_row_per_phase)
{
  for (std::size_t i = 0; i < phase_rows.size(); ++i) {
    for (std::size_t j = i + 1; j < phase_rows.size(); ++j) {
      const phase_row& a = phase_rows[i];
      const phase_row& b = phase_rows[j];
      EXPECT_FALSE(a.move == b.move && (a.paths & b.paths) != 0 && (a.from & b.from) != 0)
        << "rows " << i << " and " << j << " (" << to_string(a.move) << ") overlap";
    }
  }
}

TEST(unit_state, each_path_reaches_its_phases_and_every_one_leads_back_to_idle)
{
  using sp = step_phase;
  const std::set<sp> everything = members<sp>((1U << phase_count) - 1, phase_count);
  std::set<sp> reduced = everything;
  reduced.erase(sp::stepped_local);
  const std::pair<step_path, std::set<sp>> cases[] = {
    {step_path::local, {sp::idle, sp::train, sp::frozen, sp::stepped_local}},
    {step_path::local_guarded, {sp::idle, sp::train, sp::frozen, sp::step_deferred, sp::release_deferred}},
    {step_path::reduced, reduced},
    {step_path::reduced_guarded,
     {sp::idle, sp::train, sp::frozen, sp::frozen_reduced, sp::step_deferred, sp::release_deferred, sp::update_only,
      sp::updated}},
  };
  for (const auto& [path, phases] : cases) {
    EXPECT_EQ(members<sp>(reachable_phases(sp::idle, path), phase_count), phases) << to_string(path);
    for (const sp s : phases) {
      EXPECT_NE(reachable_phases(s, path) & bit(sp::idle), 0U)
        << to_string(path) << ": no way back to idle from " << to_string(s);
    }
  }
}

// What the runtime's check (swap/unit_table.cpp) allows each public call to do to the unit it names.
TEST(unit_state, each_call_makes_only_its_own_moves)
{
  using sp = step_phase;
  const auto from = [](sp s, step_path p, std::uint32_t moves) {
    return members<sp>(reachable_phases(s, p, moves), phase_count);
  };
  EXPECT_EQ(from(sp::idle, step_path::local, acquire_moves), (std::set<sp>{sp::train, sp::frozen}));
  EXPECT_EQ(from(sp::idle, step_path::reduced, acquire_moves),
            (std::set<sp>{sp::train, sp::frozen, sp::frozen_reduced}));
  EXPECT_TRUE(from(sp::updated, step_path::reduced, acquire_moves).empty())
    << "a unit updated in this step is not acquired again";
  EXPECT_EQ(from(sp::train, step_path::local, step_moves), (std::set<sp>{sp::stepped_local}));
  EXPECT_EQ(from(sp::train, step_path::local_guarded, step_moves), (std::set<sp>{sp::step_deferred}));
  // With a communicator: on the trainer's stream once reduced, else on aux (now, or once launched).
  EXPECT_EQ(from(sp::train, step_path::reduced, step_moves),
            (std::set<sp>{sp::stepped_reduced, sp::step_deferred, sp::updated_on_aux}));
  EXPECT_TRUE(from(sp::frozen, step_path::reduced, step_moves).empty()) << "a frozen use is not stepped";
  EXPECT_EQ(from(sp::train, step_path::local, release_moves(step_path::local)), (std::set<sp>{sp::idle}));
  EXPECT_EQ(from(sp::step_deferred, step_path::local_guarded, release_moves(step_path::local_guarded)),
            (std::set<sp>{sp::release_deferred}));
  // With a communicator a trained unit is never released without its update: released after it,
  // or with its release deferred until it runs.
  EXPECT_EQ(
    from(sp::train, step_path::reduced, release_moves(step_path::reduced)),
    (std::set<sp>{sp::stepped_reduced, sp::step_deferred, sp::updated_on_aux, sp::release_deferred, sp::updated}));
  EXPECT_EQ(from(sp::train, step_path::reduced_guarded, release_moves(step_path::reduced_guarded)),
            (std::set<sp>{sp::step_deferred, sp::release_deferred}));
  EXPECT_EQ(from(sp::stepped_local, step_path::local, release_moves(step_path::local)), (std::set<sp>{sp::idle}));
  EXPECT_EQ(
    from(sp::frozen_reduced, step_path::reduced, release_moves(step_path::reduced)),
    (std::set<sp>{sp::stepped_reduced, sp::step_deferred, sp::updated_on_aux, sp::release_deferred, sp::updated}));
  // A skip only drops planned uses without a communicator; with one it completes a use to reduce:
  // held for the update, then updated once its bucket is launched, or (guarded) at end_step.
  EXPECT_EQ(skip_moves(step_path::local), 0U);
  EXPECT_EQ(skip_moves(step_path::local_guarded), 0U);
  EXPECT_EQ(from(sp::idle, step_path::reduced, skip_moves(step_path::reduced)),
            (std::set<sp>{sp::update_only, sp::updated}));
  EXPECT_EQ(from(sp::idle, step_path::reduced_guarded, skip_moves(step_path::reduced_guarded)),
            (std::set<sp>{sp::update_only}));
  EXPECT_TRUE(from(sp::updated, step_path::reduced, skip_moves(step_path::reduced)).empty())
    << "a unit updated in this step is not held for an update again";
}

TEST(unit_state, slot_and_coherence_moves)
{
  const auto any = step_path::local;
  EXPECT_EQ(next(slot_rows, slot_content::none, slot_move::swap_in_params, any), slot_content::params);
  EXPECT_EQ(next(slot_rows, slot_content::whole, slot_move::narrow_to_params, any), slot_content::params);
  EXPECT_FALSE(next(slot_rows, slot_content::params, slot_move::narrow_to_params, any));
  EXPECT_FALSE(next(slot_rows, slot_content::none, slot_move::map_grads, any))
    << "grads alone only with a communicator";
  EXPECT_EQ(next(slot_rows, slot_content::none, slot_move::map_grads, step_path::reduced), slot_content::grads);
  EXPECT_FALSE(next(slot_rows, slot_content::none, slot_move::evict, any));
  EXPECT_FALSE(next(coherence_rows, coherence::device_newer, coherence_move::drop, any)) << "written back first";
  EXPECT_EQ(next(coherence_rows, coherence::device_newer, coherence_move::write_back, any), coherence::clean);
  EXPECT_EQ(next(coherence_rows, coherence::home_newer, coherence_move::upload_params, any), coherence::refreshed);
  EXPECT_FALSE(next(coherence_rows, coherence::clean, coherence_move::upload_params, any));
}

// What the runtime's moves consult: the lookups compiled from the tables, for every triple.
template <class Move, class State, std::size_t Moves, std::size_t States, std::size_t N>
void expect_lookup_is_the_table(const move_lookup<Move, State, Moves, States>& lookup,
                                const std::array<transition_row<Move, State>, N>& rows)
{
  std::size_t moves = 0;
  for (std::size_t p = 0; p < path_count; ++p) {
    for (std::size_t m = 0; m < Moves; ++m) {
      for (std::size_t from = 0; from < States; ++from) {
        const auto path = static_cast<step_path>(p);
        const auto move = static_cast<Move>(m);
        const auto state = static_cast<State>(from);
        EXPECT_EQ(lookup(state, move, path), next(rows, state, move, path))
          << to_string(path) << ": " << to_string(move) << " from " << to_string(state);
        moves += lookup(state, move, path) ? 1U : 0U;
      }
    }
  }
  EXPECT_GT(moves, 0U);
}

TEST(unit_state, the_lookups_the_runtime_moves_by_are_the_tables)
{
  expect_lookup_is_the_table(phase_after, phase_rows);
  expect_lookup_is_the_table(slot_after, slot_rows);
  expect_lookup_is_the_table(coherence_after, coherence_rows);
  EXPECT_EQ(phase_after(step_phase::train, phase_move::release, step_path::reduced), std::nullopt);
  EXPECT_EQ(phase_after(step_phase::train, phase_move::release, step_path::local), step_phase::idle);
}

TEST(unit_state, an_illegal_move_is_an_internal_error_naming_the_unit_move_state_and_path)
{
  try {
    illegal_move("task/3", to_string(phase_move::release), to_string(step_phase::train), step_path::reduced);
    FAIL() << "illegal_move returned";
  } catch (const error& e) {
    EXPECT_STREQ(e.what(),
                 "taskswap internal error: unit 'task/3': the reduced step path has no move release from train "
                 "(Note [Unit states])");
  }
}

TEST(unit_state, consistency_rules)
{
  using sp = step_phase;
  const auto ok = [](unit_states s, bool host, bool pinned, step_path p) { return inconsistency(s, host, pinned, p); };
  EXPECT_EQ(ok({slot_content::none, coherence::clean, sp::idle}, false, false, step_path::local), "");
  EXPECT_EQ(ok({slot_content::whole, coherence::device_newer, sp::stepped_local}, false, false, step_path::local), "");
  EXPECT_EQ(ok({slot_content::params, coherence::refreshed, sp::frozen}, true, false, step_path::local), "");
  EXPECT_EQ(ok({slot_content::grads, coherence::home_newer, sp::update_only}, true, false, step_path::reduced), "");
  EXPECT_NE(ok({slot_content::none, coherence::device_newer, sp::idle}, false, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::whole, coherence::device_newer, sp::idle}, true, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::whole, coherence::home_newer, sp::idle}, false, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::params, coherence::home_newer, sp::frozen}, true, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::params, coherence::clean, sp::train}, false, false, step_path::local), "");
  // A stash in progress: an activation block's parameter slab written on the device, and no other unit's.
  EXPECT_EQ(
    inconsistency({slot_content::params, coherence::device_newer, sp::frozen}, false, false, step_path::local, true),
    "");
  EXPECT_NE(ok({slot_content::params, coherence::device_newer, sp::frozen}, false, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::none, coherence::clean, sp::frozen}, false, false, step_path::local), "");
  EXPECT_NE(ok({slot_content::params, coherence::clean, sp::idle}, false, true, step_path::local), "");
  EXPECT_NE(ok({slot_content::whole, coherence::clean, sp::stepped_local}, false, false, step_path::reduced), "");
  EXPECT_NE(ok({slot_content::whole, coherence::clean, sp::update_only}, false, false, step_path::local_guarded), "");
}

}  // namespace
}  // namespace taskswap::detail
