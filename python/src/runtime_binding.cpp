// SPDX-License-Identifier: Apache-2.0
// taskswap._core.Runtime: the step protocol, plans, stats, checkpoints, and a unit's tensors as
// DLPack tensors (torch tensors without linking libtorch: nanobind calls torch.utils.dlpack).

#include "bindings.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace taskswap::python {
namespace {

using torch_tensor = nb::ndarray<nb::pytorch>;

/// The runtime as Python holds it, with the views of the units held now: a view is handed out
/// only while its unit is held, so a tensor asked for after release() is refused.
struct py_runtime {
  taskswap::device dev;
  taskswap::runtime rt;
  std::vector<std::optional<unit_view>> held;
  bool reduces = false;  ///< a communicator: the one given, or the one options.comm names

  [[nodiscard]] unit_id id(std::uint32_t u) const
  {
    if (u >= held.size()) {
      throw invalid_argument("taskswap: no unit has id " + std::to_string(u) + "; the runtime has " +
                             std::to_string(held.size()) + " units");
    }
    return unit_id{u};
  }
  [[nodiscard]] const unit_view& view(std::uint32_t u) const
  {
    const auto& v = held[id(u).value];
    if (!v) {
      throw invalid_argument("taskswap: unit '" + std::string(rt.name(unit_id{u})) +
                             "' is not held: its device tensors exist from acquire() until release()");
    }
    return *v;
  }
};

nb::dlpack::dtype dlpack_of(dtype t)
{
  switch (t) {
    case dtype::f32: return nb::dtype<float>();
    case dtype::bf16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case dtype::f16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case dtype::u8: return nb::dtype<std::uint8_t>();
  }
  return nb::dtype<float>();
}

/// One tensor per tensor_info, each a view of `slab` at its offset; `owner` is kept alive by
/// every tensor (the runtime, whose memory it is).
std::vector<torch_tensor> tensors_of(nb::handle owner, std::span<const tensor_info> tensors, const slab_view& slab,
                                     bool on_device, const device& dev)
{
  const int device_type = on_device && dev.kind() == backend_kind::cuda ? static_cast<int>(nb::device::cuda::value)
                                                                        : static_cast<int>(nb::device::cpu::value);
  const int device_id = device_type == static_cast<int>(nb::device::cuda::value) ? dev.index() : 0;
  std::vector<torch_tensor> out;
  out.reserve(tensors.size());
  auto* base = static_cast<std::byte*>(slab.data);
  for (const tensor_info& t : tensors) {
    out.emplace_back(base + t.offset * size_of(slab.type), t.shape.size(), t.shape.data(), owner, nullptr,
                     dlpack_of(slab.type), device_type, device_id);
  }
  return out;
}

slab_view home_slab(const home_view& h, std::string_view kind)
{
  if (kind == "params") { return h.params; }
  if (kind == "master") { return h.master; }
  if (kind == "m") { return h.m; }
  if (kind == "v") { return h.v; }
  throw invalid_argument("taskswap: a home slab is \"params\", \"master\", \"m\" or \"v\", not \"" + std::string(kind) +
                         "\"");
}

void bind_stats(nb::module_& m)
{
  nb::class_<step_stats>(m, "StepStats", "Transfers, hits and stalls of one step (or of all steps).")
    .def_ro("step", &step_stats::step)
    .def_ro("h2d_bytes", &step_stats::h2d_bytes)
    .def_ro("d2h_bytes", &step_stats::d2h_bytes)
    .def_ro("hits", &step_stats::hits)
    .def_ro("misses", &step_stats::misses)
    .def_ro("unplanned", &step_stats::unplanned)
    .def_ro("frozen", &step_stats::frozen)
    .def_ro("swap_ins", &step_stats::swap_ins)
    .def_ro("write_backs", &step_stats::write_backs)
    .def_ro("evictions", &step_stats::evictions)
    .def_ro("stall_ms", &step_stats::stall_ms)
    .def_ro("peak_device_bytes", &step_stats::peak_device_bytes)
    .def_ro("reduced_bytes", &step_stats::reduced_bytes)
    .def_ro("reduce_all_bytes", &step_stats::reduce_all_bytes);
  nb::class_<unit_stats>(m, "UnitStats", "One unit's residency figures.")
    .def_ro("name", &unit_stats::name)
    .def_ro("state", &unit_stats::state)
    .def_ro("dirty", &unit_stats::dirty)
    .def_ro("device_bytes", &unit_stats::device_bytes)
    .def_ro("home_bytes", &unit_stats::home_bytes)
    .def_ro("swap_ins", &unit_stats::swap_ins)
    .def_ro("write_backs", &unit_stats::write_backs)
    .def_ro("step", &unit_stats::step)
    .def_ro("policy", &unit_stats::policy);
  nb::class_<disk_stats>(m, "DiskStats", "The disk home tier's host cache since the runtime began.")
    .def_ro("host_cache_bytes", &disk_stats::host_cache_bytes)
    .def_ro("cached_bytes", &disk_stats::cached_bytes)
    .def_ro("hits", &disk_stats::hits)
    .def_ro("misses", &disk_stats::misses)
    .def_ro("evictions", &disk_stats::evictions)
    .def_ro("written_back", &disk_stats::written_back)
    .def_ro("prefetches", &disk_stats::prefetches)
    .def_ro("wait_ms", &disk_stats::wait_ms)
    .def_ro("read_bytes", &disk_stats::read_bytes)
    .def_ro("written_bytes", &disk_stats::written_bytes)
    .def_ro("requests", &disk_stats::requests);
  nb::class_<runtime_stats>(m, "RuntimeStats", "Cumulative figures, the recent steps, and each unit.")
    .def_ro("total", &runtime_stats::total)
    .def_ro("steps", &runtime_stats::steps)
    .def_ro("units", &runtime_stats::units)
    .def_ro("budget", &runtime_stats::budget)
    .def_ro("pinned_device_bytes", &runtime_stats::pinned_device_bytes)
    .def_ro("device_bytes_in_use", &runtime_stats::device_bytes_in_use)
    .def_ro("home_bytes", &runtime_stats::home_bytes)
    .def_ro("host_bytes_pinned", &runtime_stats::host_bytes_pinned)
    .def_ro("device_granule", &runtime_stats::device_granule)
    .def_ro("device_rounding_bytes", &runtime_stats::device_rounding_bytes)
    .def_ro("disk", &runtime_stats::disk);
}

/// A plan step as Python gives it: (unit, kind) pairs in call order; kind 0 acquires for
/// training, 1 acquires frozen, 2 releases, 3 acquires an activation block for its stash.
step_plan to_step_plan(const py_runtime& self, const std::vector<std::pair<std::uint32_t, int>>& entries)
{
  step_plan step;
  for (const auto& [u, kind] : entries) {
    switch (kind) {
      case 0: step.acquire(self.id(u), unit_use::train); break;
      case 1: step.acquire(self.id(u), unit_use::frozen); break;
      case 2: step.release(self.id(u)); break;
      case 3: step.acquire(self.id(u), unit_use::stash); break;
      default:
        throw invalid_argument(
          "taskswap: a plan entry's kind is 0 (train), 1 (frozen), 2 (release) or 3 (stash), not " +
          std::to_string(kind));
    }
  }
  return step;
}

}  // namespace

void bind_runtime(nb::module_& m)
{
  bind_stats(m);
  nb::class_<py_runtime>(m, "Runtime", nb::is_weak_referenceable(), "The taskswap runtime (see taskswap::runtime).")
    .def(
      "__init__",
      [](py_runtime* self, const device& dev, const runtime_options& options, const std::vector<unit_spec>& units,
         std::shared_ptr<communicator> comm) {
        const std::size_t count = units.size();
        const bool reduces = comm != nullptr || options.comm.backend != comm_backend::none;
        nb::gil_scoped_release release;
        runtime rt = comm ? runtime(dev, options, units, std::move(comm)) : runtime(dev, options, units);
        new (self) py_runtime{dev, std::move(rt), std::vector<std::optional<unit_view>>(count), reduces};
      },
      "device"_a, "options"_a, "units"_a, "comm"_a = nb::none(),
      "Lays out every unit's home copy, applies the policies, brings pinned units in; with a "
      "communicator (`comm`, or None: the one options.comm names, if any), collective.")
    .def_prop_ro(
      "has_communicator", [](const py_runtime& self) { return self.reduces; },
      "Whether gradients are reduced over a communicator (even of one rank).")
    .def_prop_ro("device", [](const py_runtime& self) { return self.dev; })
    .def_prop_ro("unit_count", [](const py_runtime& self) { return self.rt.unit_count(); })
    .def_prop_ro("rank", [](const py_runtime& self) { return self.rt.rank(); })
    .def_prop_ro("world_size", [](const py_runtime& self) { return self.rt.world_size(); })
    .def(
      "find", [](const py_runtime& self, std::string_view name) { return self.rt.find(name).value; }, "name"_a)
    .def(
      "name", [](const py_runtime& self, std::uint32_t u) { return std::string(self.rt.name(self.id(u))); }, "unit"_a)
    .def(
      "policy", [](const py_runtime& self, std::uint32_t u) { return self.rt.policy(self.id(u)); }, "unit"_a)
    .def(
      "device_bytes", [](const py_runtime& self, std::uint32_t u) { return self.rt.device_bytes(self.id(u)); },
      "unit"_a)
    .def(
      "state", [](const py_runtime& self, std::uint32_t u) { return self.rt.state(self.id(u)); }, "unit"_a)
    .def(
      "tensors",
      [](py_runtime& self, std::uint32_t u) {
        std::vector<std::tuple<std::string, std::vector<std::size_t>, bool>> out;
        for (const tensor_info& t : self.rt.home(self.id(u)).tensors) {
          out.emplace_back(t.name, t.shape, t.no_weight_decay);
        }
        return out;
      },
      "unit"_a, "The unit's tensors: (name, shape, no_weight_decay).")
    .def(
      "plan",
      [](py_runtime& self, const std::vector<std::vector<std::pair<std::uint32_t, int>>>& steps) {
        std::vector<step_plan> plans;
        plans.reserve(steps.size());
        for (const auto& s : steps) { plans.push_back(to_step_plan(self, s)); }
        nb::gil_scoped_release release;
        self.rt.plan(plans);
      },
      "steps"_a, "Appends upcoming steps: each a list of (unit, kind), kind 0 train, 1 frozen, 2 release, 3 stash.")
    .def(
      "acquire",
      [](py_runtime& self, std::uint32_t u, const py_stream& s, bool frozen, bool stash) {
        const unit_id id = self.id(u);
        const unit_use use = stash ? unit_use::stash : frozen ? unit_use::frozen : unit_use::train;
        unit_view v;
        {
          nb::gil_scoped_release release;  // back-pressure may wait for a copy
          v = self.rt.acquire(id, s.view, use);
        }
        self.held[u] = v;
        // NOLINTBEGIN(cppcoreguidelines-pro-type-reinterpret-cast): addresses as numbers
        return std::make_pair(reinterpret_cast<std::uintptr_t>(v.params.data),
                              reinterpret_cast<std::uintptr_t>(v.grads.data));
        // NOLINTEND(cppcoreguidelines-pro-type-reinterpret-cast)
      },
      "unit"_a, "stream"_a, "frozen"_a = false, "stash"_a = false,
      "Acquires a unit on `stream` (does not synchronise); returns the addresses of its "
      "parameter and gradient slabs (0 for a frozen use's gradients). `stash`: an activation block's write.")
    .def(
      "param_tensors",
      [](nb::handle owner, std::uint32_t u) {
        const py_runtime& self = nb::cast<const py_runtime&>(owner);
        const unit_view& v = self.view(u);
        return tensors_of(owner, v.tensors, v.params, true, self.dev);
      },
      "unit"_a, "The held unit's parameters, one tensor per registered tensor (views of the slab).")
    .def(
      "grad_tensors",
      [](nb::handle owner, std::uint32_t u) {
        const py_runtime& self = nb::cast<const py_runtime&>(owner);
        const unit_view& v = self.view(u);
        if (v.frozen) {
          throw invalid_argument("taskswap: unit '" + std::string(self.rt.name(unit_id{u})) +
                                 "' is used frozen: it has no gradients this step");
        }
        return tensors_of(owner, v.tensors, v.grads, true, self.dev);
      },
      "unit"_a, "The held unit's gradients, one tensor per registered tensor (views of the slab).")
    .def(
      "grads_ready",
      [](py_runtime& self, std::uint32_t u, const py_stream& s) { self.rt.grads_ready(self.id(u), s.view); }, "unit"_a,
      "stream"_a)
    .def(
      "step", [](py_runtime& self, std::uint32_t u, const py_stream& s) { self.rt.step(self.id(u), s.view); }, "unit"_a,
      "stream"_a)
    .def(
      "release",
      [](py_runtime& self, std::uint32_t u, const py_stream& s) {
        self.rt.release(self.id(u), s.view);
        self.held[u].reset();
      },
      "unit"_a, "stream"_a)
    .def(
      "skip",
      [](py_runtime& self, const std::vector<std::uint32_t>& units) {
        std::vector<unit_id> ids;
        ids.reserve(units.size());
        for (const std::uint32_t u : units) { ids.push_back(self.id(u)); }
        nb::gil_scoped_release release;
        self.rt.skip(ids);
      },
      "units"_a,
      "The current step will not acquire these units again: their planned acquisitions still ahead in the "
      "step are dropped (with a communicator, a use to reduce is completed with zero gradients, in the order "
      "given).")
    .def(
      "end_step", [](py_runtime& self) { return self.rt.end_step(); }, nb::call_guard<nb::gil_scoped_release>())
    .def(
      "agree_stop", [](py_runtime& self, int local) { return self.rt.agree_stop(local); }, "local"_a,
      nb::call_guard<nb::gil_scoped_release>())
    .def(
      "flush", [](py_runtime& self) { self.rt.flush(); }, nb::call_guard<nb::gil_scoped_release>(),
      "Writes dirty units back and waits until every home copy is current.")
    .def(
      "home",
      [](nb::handle owner, std::uint32_t u, std::string_view kind) {
        py_runtime& self = nb::cast<py_runtime&>(owner);
        const home_view h = self.rt.home(self.id(u));
        return tensors_of(owner, h.tensors, home_slab(h, kind), false, self.dev);
      },
      "unit"_a, "kind"_a = "params",
      "The home copy's tensors (CPU tensors aliasing the pinned arena): kind params, master, m or v. "
      "Current after flush() until the unit is next acquired.")
    .def(
      "home_step", [](py_runtime& self, std::uint32_t u) { return self.rt.home(self.id(u)).step; }, "unit"_a)
    .def(
      "save_checkpoint",
      [](py_runtime& self, const std::filesystem::path& dir, const std::map<std::string, std::string>& user) {
        self.rt.save_checkpoint(dir, user);
      },
      "dir"_a, "user"_a = std::map<std::string, std::string>{}, nb::call_guard<nb::gil_scoped_release>())
    .def(
      "load_checkpoint",
      [](py_runtime& self, const std::filesystem::path& dir) {
        const checkpoint_manifest manifest = self.rt.load_checkpoint(dir);
        return std::make_tuple(manifest.steps_done, manifest.user, manifest.world);
      },
      "dir"_a, nb::call_guard<nb::gil_scoped_release>(),
      "Restores every unit's home state; returns (steps_done, user entries, world).")
    .def_prop_rw(
      "optimizer", [](const py_runtime& self) { return self.rt.optimizer(); },
      [](py_runtime& self, const adamw_options& o) { self.rt.set_optimizer(o); })
    .def("stats", [](const py_runtime& self) { return self.rt.stats(); })
    .def_prop_ro(
      "guards_steps", [](const py_runtime& self) { return self.rt.guards_steps(); },
      "Loss scaling or clipping: the step's units are updated together at end_step.")
    .def(
      "loss_scale_tensor",
      [](nb::handle owner) {
        const py_runtime& self = nb::cast<const py_runtime&>(owner);
        const float* scale = self.rt.loss_scale();
        const bool cuda = self.dev.kind() == backend_kind::cuda;
        const std::size_t shape[1] = {1};
        // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast)
        return torch_tensor(const_cast<float*>(scale), 1, shape, owner, nullptr, nb::dtype<float>(),
                            cuda ? static_cast<int>(nb::device::cuda::value) : static_cast<int>(nb::device::cpu::value),
                            cuda ? self.dev.index() : 0);
      },
      "The loss scale in device memory, one float (read it on the step's stream; the runtime changes "
      "it at end_step).")
    .def(
      "scaler_state", [](py_runtime& self) { return self.rt.scaler_state(); }, nb::call_guard<nb::gil_scoped_release>(),
      "The loss scaler's state, read from the device. Synchronises.")
    .def(
      "write_trace", [](py_runtime& self, const std::filesystem::path& file) { self.rt.write_trace(file); }, "file"_a,
      nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace taskswap::python
