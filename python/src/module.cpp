// SPDX-License-Identifier: Apache-2.0
// taskswap._core: exceptions, enums, options and specs, devices, streams, communicators.
// The runtime itself is bound in runtime_binding.cpp.

#include "bindings.hpp"

#include <nanobind/stl/array.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace nb = nanobind;
using namespace nb::literals;

namespace taskswap::python {
namespace {

// The exception classes, created once with two bases each (taskswap.Error and the builtin a
// Python user would catch), kept for the module's lifetime.
struct exception_classes {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* config_error = nullptr;
  PyObject* out_of_memory = nullptr;
  PyObject* cuda_error = nullptr;
  PyObject* comm_error = nullptr;
  PyObject* timeout_error = nullptr;
  PyObject* device_error = nullptr;
  PyObject* checkpoint_error = nullptr;
  PyObject* storage_error = nullptr;
};
exception_classes classes;

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base, PyObject* builtin, const char* doc)
{
  const std::string qualified = std::string("taskswap.") + name;
  nb::object bases = builtin != nullptr ? nb::steal(PyTuple_Pack(2, base, builtin)) : nb::steal(PyTuple_Pack(1, base));
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) { throw nb::python_error(); }
  m.attr(name) = nb::handle(cls);
  return cls;
}

void make_exceptions(nb::module_& m)
{
  classes.error =
    new_exception(m, "Error", PyExc_RuntimeError, nullptr, "Every error taskswap raises (taskswap::error).");
  classes.invalid_argument = new_exception(m, "InvalidArgument", classes.error, PyExc_ValueError,
                                           "A call the runtime's state does not allow, or a bad argument.");
  classes.config_error =
    new_exception(m, "ConfigError", classes.error, PyExc_ValueError,
                  "A configuration, unit or plan that cannot work; the message says what to change.");
  classes.out_of_memory = new_exception(m, "OutOfMemory", classes.error, PyExc_MemoryError,
                                        "Device or pinned memory ran out (attributes requested, available, budget).");
  classes.cuda_error = new_exception(m, "CudaError", classes.error, nullptr, "A CUDA call failed.");
  classes.comm_error =
    new_exception(m, "CommError", classes.error, nullptr, "A collective failed (NCCL or MPI), or the ranks disagree.");
  classes.timeout_error = new_exception(m, "TimeoutError", classes.error, PyExc_TimeoutError,
                                        "A collective or a wait for the device did not finish in time.");
  classes.device_error = new_exception(m, "DeviceError", classes.error, nullptr,
                                       "The device failed an operation (emulated faults included).");
  classes.checkpoint_error = new_exception(m, "CheckpointError", classes.error, nullptr,
                                           "A checkpoint cannot be written, read, or does not match the runtime.");
  classes.storage_error =
    new_exception(m, "StorageError", classes.error, PyExc_OSError,
                  "A unit file of the disk home tier could not be opened, read, written or synced; the message names "
                  "the file, the unit and the system's reason.");
}

void raise_out_of_memory(const out_of_memory& e)
{
  nb::object instance = nb::steal(PyObject_CallFunction(classes.out_of_memory, "s", e.what()));
  if (!instance.is_valid()) { return; }  // the error of the call stays set
  instance.attr("requested") = e.requested();
  instance.attr("available") = e.available();
  instance.attr("budget") = e.budget();
  PyErr_SetObject(classes.out_of_memory, instance.ptr());
}

// Most derived first; anything else goes on to nanobind's own translators.
void translate(const std::exception_ptr& p, void*)
{
  try {
    std::rethrow_exception(p);
  } catch (const out_of_memory& e) {
    raise_out_of_memory(e);
  } catch (const invalid_argument& e) {
    PyErr_SetString(classes.invalid_argument, e.what());
  } catch (const config_error& e) {
    PyErr_SetString(classes.config_error, e.what());
  } catch (const cuda_error& e) {
    PyErr_SetString(classes.cuda_error, e.what());
  } catch (const comm_error& e) {
    PyErr_SetString(classes.comm_error, e.what());
  } catch (const timeout_error& e) {
    PyErr_SetString(classes.timeout_error, e.what());
  } catch (const device_error& e) {
    PyErr_SetString(classes.device_error, e.what());
  } catch (const checkpoint_error& e) {
    PyErr_SetString(classes.checkpoint_error, e.what());
  } catch (const storage_error& e) {
    PyErr_SetString(classes.storage_error, e.what());
  } catch (const error& e) {
    PyErr_SetString(classes.error, e.what());
  }
}

// For the tests of the translation: every kind of error the library throws, by name.
void raise_for_test(std::string_view kind, const std::string& what)
{
  if (kind == "invalid_argument") { throw invalid_argument(what); }
  if (kind == "config_error") { throw config_error(what); }
  if (kind == "out_of_memory") { throw out_of_memory(what, 3, 2, 1); }
  if (kind == "cuda_error") { throw cuda_error(what); }
  if (kind == "comm_error") { throw comm_error(what); }
  if (kind == "timeout_error") { throw timeout_error(what); }
  if (kind == "device_error") { throw device_error(what); }
  if (kind == "checkpoint_error") { throw checkpoint_error(what); }
  if (kind == "storage_error") { throw storage_error(what); }
  if (kind == "error") { throw error(what); }
  throw std::logic_error("unknown error kind " + std::string(kind));
}

nb::dict error_kinds()
{
  nb::dict d;
  d["invalid_argument"] = nb::handle(classes.invalid_argument);
  d["config_error"] = nb::handle(classes.config_error);
  d["out_of_memory"] = nb::handle(classes.out_of_memory);
  d["cuda_error"] = nb::handle(classes.cuda_error);
  d["comm_error"] = nb::handle(classes.comm_error);
  d["timeout_error"] = nb::handle(classes.timeout_error);
  d["device_error"] = nb::handle(classes.device_error);
  d["checkpoint_error"] = nb::handle(classes.checkpoint_error);
  d["storage_error"] = nb::handle(classes.storage_error);
  d["error"] = nb::handle(classes.error);
  return d;
}

std::chrono::milliseconds to_ms(double seconds)
{
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    throw invalid_argument("taskswap: a timeout must be a positive number of seconds, not " + std::to_string(seconds));
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

double to_seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

void bind_enums(nb::module_& m)
{
  nb::enum_<dtype>(m, "DType", "Element types of a unit's slabs.")
    .value("f32", dtype::f32)
    .value("bf16", dtype::bf16)
    .value("f16", dtype::f16)
    .value("u8", dtype::u8);
  nb::enum_<residency>(m, "Residency", "Where a unit lives between uses.")
    .value("pinned", residency::pinned)
    .value("prefetch", residency::prefetch)
    .value("on_demand", residency::on_demand);
  nb::enum_<optimizer_placement>(m, "OptimizerPlacement", "Where a unit's AdamW step runs.")
    .value("device", optimizer_placement::device)
    .value("host", optimizer_placement::host);
  nb::enum_<backend_kind>(m, "Backend", "A device backend.")
    .value("cuda", backend_kind::cuda)
    .value("emulated", backend_kind::emulated);
  nb::enum_<average_mode>(m, "Average", "What reduced gradients are divided by.")
    .value("contributors", average_mode::contributors)
    .value("world", average_mode::world);
  nb::enum_<comm_backend>(m, "CommBackend", "The communicator a config names.")
    .value("none", comm_backend::none)
    .value("nccl", comm_backend::nccl)
    .value("mpi", comm_backend::mpi);
  nb::enum_<unit_state>(m, "UnitState", "Where a unit is now.")
    .value("home", unit_state::home)
    .value("resident", unit_state::resident)
    .value("held", unit_state::held);
}

void bind_options(nb::module_& m)
{
  nb::class_<adamw_options>(m, "AdamW", "AdamW hyperparameters.")
    .def(nb::init<>())
    .def_rw("lr", &adamw_options::lr)
    .def_rw("beta1", &adamw_options::beta1)
    .def_rw("beta2", &adamw_options::beta2)
    .def_rw("eps", &adamw_options::eps)
    .def_rw("weight_decay", &adamw_options::weight_decay)
    .def_rw("clip", &adamw_options::clip, "Global-norm gradient clipping (0: none).");

  nb::class_<loss_scaler_options>(m, "LossScaler", "Dynamic loss scaling, as torch.cuda.amp.GradScaler.")
    .def(nb::init<>())
    .def_rw("enabled", &loss_scaler_options::enabled)
    .def_rw("init_scale", &loss_scaler_options::init_scale)
    .def_rw("growth_factor", &loss_scaler_options::growth_factor)
    .def_rw("backoff_factor", &loss_scaler_options::backoff_factor)
    .def_rw("growth_interval", &loss_scaler_options::growth_interval);

  nb::class_<loss_scaler_state>(m, "LossScalerState", "The loss scaler's state and the last step's norm.")
    .def_ro("scale", &loss_scaler_state::scale)
    .def_ro("growth_tracker", &loss_scaler_state::growth_tracker)
    .def_ro("skipped_steps", &loss_scaler_state::skipped_steps)
    .def_ro("steps", &loss_scaler_state::steps)
    .def_ro("last_skipped", &loss_scaler_state::last_skipped)
    .def_ro("last_norm", &loss_scaler_state::last_norm);

  nb::class_<unit_policy>(m, "UnitPolicy", "A unit's residency, optimizer placement and hyperparameters.")
    .def(nb::init<>())
    .def_rw("residency", &unit_policy::residency)
    .def_rw("lookahead", &unit_policy::lookahead)
    .def_rw("optimizer", &unit_policy::optimizer)
    .def_rw("lr_scale", &unit_policy::lr_scale)
    .def_rw("weight_decay", &unit_policy::weight_decay)
    .def_rw("home", &unit_policy::home,
            "The home tier that keeps its home copy (\"host\", or \"disk\" with Options.storage).");

  nb::class_<emulated_options>(m, "EmulatedOptions", "The emulated device's memory and link model.")
    .def_rw("memory_bytes", &emulated_options::memory_bytes)
    .def_rw("granularity", &emulated_options::granularity)
    .def_prop_rw(
      "link_bytes_per_second", [](const emulated_options& o) { return o.link.bytes_per_second; },
      [](emulated_options& o, double v) { o.link.bytes_per_second = v; })
    .def_prop_rw(
      "link_latency_s", [](const emulated_options& o) { return o.link.latency_seconds; },
      [](emulated_options& o, double v) { o.link.latency_seconds = v; });

  nb::class_<device_options>(m, "DeviceOptions", "Which device, and the budget.")
    .def(nb::init<>())
    .def_rw("backend", &device_options::backend)
    .def_rw("index", &device_options::index)
    .def_rw("budget", &device_options::budget)
    .def_rw("emulated", &device_options::emulated);

  nb::class_<comm_options>(m, "CommOptions", "The [comm] table.")
    .def(nb::init<>())
    .def_rw("backend", &comm_options::backend)
    .def_rw("bucket_cap", &comm_options::bucket_cap)
    .def_rw("average", &comm_options::average)
    .def_rw("reduce_every_unit", &comm_options::reduce_every_unit)
    .def_prop_rw(
      "timeout_s", [](const comm_options& o) { return to_seconds(o.timeout); },
      [](comm_options& o, double s) { o.timeout = to_ms(s); });

  nb::class_<storage_options>(m, "StorageOptions",
                              "The [storage] table: the disk home tier's directory, host cache and requests.")
    .def(nb::init<>())
    .def_rw("path", &storage_options::path, "The directory of the unit files (made if missing).")
    .def_rw("host_cache", &storage_options::host_cache,
            "Pinned host bytes caching disk homes; at least the largest disk-homed unit.")
    .def_rw("queue_depth", &storage_options::queue_depth, "Reads and writes in flight at once.")
    .def_rw("block", &storage_options::block, "Bytes per request, a multiple of 4 KiB.")
    .def_rw("lookahead", &storage_options::lookahead, "Steps ahead the plan's disk homes are read into the host cache.")
    .def_prop_rw(
      "timeout_s", [](const storage_options& o) { return to_seconds(o.timeout); },
      [](storage_options& o, double s) { o.timeout = to_ms(s); },
      "Seconds a wait for the drive may go with no request answered before a StorageError.");

  nb::class_<runtime_options>(m, "Options", "Everything a taskswap TOML configuration holds.")
    .def(nb::init<>())
    .def("__copy__", [](const runtime_options& o) { return o; })
    .def(
      "__deepcopy__", [](const runtime_options& o, nb::handle) { return o; }, "memo"_a)
    .def_rw("device", &runtime_options::device)
    .def_rw("defaults", &runtime_options::defaults)
    .def_rw("optimizer", &runtime_options::optimizer)
    .def_rw("scaler", &runtime_options::scaler)
    .def_rw("comm", &runtime_options::comm)
    .def_rw("storage", &runtime_options::storage)
    .def_rw("measure_stall", &runtime_options::measure_stall)
    .def_rw("trace", &runtime_options::trace)
    .def_rw("source", &runtime_options::source)
    .def_prop_ro(
      "rules", [](const runtime_options& o) { return o.units.size(); }, "The number of [[units]] rules.")
    .def(
      "add_rule",
      [](runtime_options& o, std::string match, std::optional<residency> r, std::optional<int> lookahead,
         std::optional<optimizer_placement> placement, std::optional<double> lr_scale,
         std::optional<double> weight_decay, std::string origin, std::optional<std::string> home) {
        o.units.push_back(unit_rule{std::move(match), r, lookahead, placement, std::move(origin), lr_scale,
                                    weight_decay, std::move(home)});
      },
      "match"_a, "residency"_a = nb::none(), "lookahead"_a = nb::none(), "optimizer"_a = nb::none(),
      "lr_scale"_a = nb::none(), "weight_decay"_a = nb::none(), "origin"_a = "python", "home"_a = nb::none(),
      "Appends a [[units]] rule (later rules win); `origin` names it in error messages; `home`: the "
      "home tier (\"host\" or \"disk\", which needs `storage`).")
    .def_prop_rw(
      "timeout_s", [](const runtime_options& o) { return to_seconds(o.timeout); },
      [](runtime_options& o, double s) { o.timeout = to_ms(s); })
    .def_prop_rw(
      "optimizer_threads", [](const runtime_options& o) { return o.host.optimizer_threads; },
      [](runtime_options& o, int n) { o.host.optimizer_threads = n; })
    .def_prop_rw(
      "numa_node", [](const runtime_options& o) { return o.host.numa_node; },
      [](runtime_options& o, int n) { o.host.numa_node = n; });

  nb::class_<tensor_spec>(m, "TensorSpec", "A named tensor of a unit.")
    .def(nb::init<std::string, std::vector<std::size_t>, bool, bool>(), "name"_a, "shape"_a,
         "no_weight_decay"_a = false, "state"_a = false)
    .def_rw("name", &tensor_spec::name)
    .def_rw("shape", &tensor_spec::shape)
    .def_rw("no_weight_decay", &tensor_spec::no_weight_decay)
    .def_rw("state", &tensor_spec::state,
            "A non-trainable state tensor: travels and is written home with the update; never stepped or reduced.");

  nb::class_<unit_spec>(m, "UnitSpec", "What a trainer registers: a named set of tensors.")
    .def(
      "__init__",
      [](unit_spec* self, std::string name, std::vector<tensor_spec> tensors, dtype compute, std::optional<dtype> grad,
         std::optional<unit_policy> policy, bool trainable, bool activation) {
        new (self)
          unit_spec{std::move(name), std::move(tensors), compute, grad, std::move(policy), trainable, activation};
      },
      "name"_a, "tensors"_a, "compute"_a = dtype::f32, "grad"_a = nb::none(), "policy"_a = nb::none(),
      "trainable"_a = true, "activation"_a = false)
    .def_rw("name", &unit_spec::name)
    .def_rw("tensors", &unit_spec::tensors)
    .def_rw("compute", &unit_spec::compute)
    .def_rw("grad", &unit_spec::grad)
    .def_rw("policy", &unit_spec::policy)
    .def_rw("trainable", &unit_spec::trainable,
            "False: never trained (a frozen base): the parameters alone at home and on the device, every use frozen.")
    .def_rw("activation", &unit_spec::activation,
            "An activation block: written in a stash use, read back in frozen uses; never trained, homed on the host.");

  nb::class_<unit_footprint>(m, "UnitFootprint", "What one unit costs, from its spec and placement.")
    .def_ro("device_bytes", &unit_footprint::device_bytes)
    .def_ro("home_bytes", &unit_footprint::home_bytes)
    .def_ro("swap_in_bytes", &unit_footprint::swap_in_bytes)
    .def_ro("write_back_bytes", &unit_footprint::write_back_bytes)
    .def_ro("grad_bytes", &unit_footprint::grad_bytes)
    .def_ro("reduce_bytes", &unit_footprint::reduce_bytes)
    .def_ro("param_bytes", &unit_footprint::param_bytes)
    .def_ro("frozen_device_bytes", &unit_footprint::frozen_device_bytes);

  m.def(
    "load_config",
    [](const std::filesystem::path& file, const std::vector<std::string>& own_tables) {
      const std::vector<std::string_view> views(own_tables.begin(), own_tables.end());
      return load_config(file, views);
    },
    "file"_a, "own_tables"_a = std::vector<std::string>{},
    "Reads a TOML configuration; raises ConfigError naming the file, line and key. `own_tables`: "
    "top-level tables the trainer reads itself (e.g. [model]), which the loader then ignores.");
  m.def(
    "parse_config", [](std::string_view text, std::string_view source) { return parse_config(text, source); }, "text"_a,
    "source"_a = "config", "Parses a TOML configuration held in a string.");
  m.def("parse_size", &parse_size, "text"_a, "Parses a size such as \"4 MiB\" into bytes.");
  m.def("policy_for", &policy_for, "spec"_a, "options"_a,
        "The policy the runtime gives a unit: its own, else the defaults with matching rules applied.");
  m.def("footprint", &footprint, "spec"_a, "placement"_a, "A unit's footprint under a placement.");
  m.def(
    "all_pinned_budget",
    [](const runtime_options& options, const std::vector<unit_spec>& units) {
      return all_pinned_budget(options, units);
    },
    "options"_a, "units"_a,
    "The budget that holds every unit pinned (an all-resident baseline), as the runtime packs pinned units.");
  m.def("step_guard_device_bytes", &step_guard_device_bytes, "units"_a,
        "The device bytes guarded steps (loss scaling or clipping) take of the budget for this many units, "
        "before granule rounding.");
}

void bind_devices(nb::module_& m)
{
  nb::class_<device>(m, "Device", "A device: a backend and its index.")
    .def_prop_ro("kind", &device::kind)
    .def_prop_ro("index", &device::index)
    .def_prop_ro("name", &device::name)
    .def_prop_ro("granularity", &device::granularity,
                 "The granule in which the device pool maps memory: a unit takes whole granules of the budget.")
    .def("synchronize", &device::synchronize, nb::call_guard<nb::gil_scoped_release>(),
         "Waits for every stream of the device (tests and tools).")
    .def("__eq__", [](const device& a, const device& b) { return a == b; });
  m.def("make_device", &make_device, "options"_a, "The device a configuration's [device] table names.");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices usable by this process (0 without CUDA).");

  nb::class_<py_stream>(m, "Stream", "A stream the runtime created, or a view of another library's.")
    .def(
      "__init__",
      [](py_stream* self, const device& dev, bool host_synchronous) {
        stream owned(dev, stream_options{.priority = 0, .host_synchronous = host_synchronous});
        const stream_view view = owned.view();
        new (self) py_stream{dev, std::move(owned), view};
      },
      "device"_a, "host_synchronous"_a = false,
      "A new stream on `device`. host_synchronous (emulated device only): each operation runs in the "
      "calling thread before the call returns (for a trainer computing on the host).")
    .def_prop_ro("device", [](const py_stream& s) { return s.dev; })
    .def_prop_ro("handle",
                 [](const py_stream& s) {
                   // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a handle as a number
                   return reinterpret_cast<std::uintptr_t>(s.view.native_handle());
                 })
    .def_prop_ro("external", [](const py_stream& s) { return !s.owned.has_value(); })
    .def(
      "synchronize", [](const py_stream& s) { s.view.synchronize(); }, nb::call_guard<nb::gil_scoped_release>(),
      "Blocks until the work queued on the stream is done.")
    .def("query", [](const py_stream& s) { return s.view.query(); });
  m.def(
    "external_stream",
    [](const device& dev, std::uintptr_t handle) {
      return py_stream{dev, std::nullopt, external_stream(dev, handle)};
    },
    "device"_a, "handle"_a,
    "A view of a CUDA stream another library owns (torch.cuda.current_stream().cuda_stream; 0 is "
    "the legacy default stream). Raises InvalidArgument on the emulated device.");
}

void bind_comm(nb::module_& m)
{
  nb::class_<communicator>(m, "Communicator", "A communicator the runtime reduces gradients over.")
    .def_prop_ro("rank", &communicator::rank)
    .def_prop_ro("size", &communicator::size)
    .def_prop_ro("backend", &communicator::backend);
  m.def(
    "mpi_communicator",
    [](const device& dev, double timeout_s) { return make_mpi_communicator(dev, to_ms(timeout_s)); }, "device"_a,
    "timeout_s"_a = 300.0, nb::call_guard<nb::gil_scoped_release>(),
    "An MPI communicator over MPI_COMM_WORLD (initialises MPI when needed).");
  m.def(
    "nccl_library",
    []() {
      nccl_library_info info;
      {
        nb::gil_scoped_release release;
        info = nccl_library();
      }
      return nb::make_tuple(info.path, info.version);
    },
    "Loads the NCCL taskswap uses (if not yet loaded) and returns (its file, its version): the file "
    "TASKSWAP_NCCL_LIBRARY names, else an NCCL the process has already (torch's), else the one "
    "prefer_nccl_library named, else the build's, else libnccl.so.2 on the loader's path.");
  m.def("prefer_nccl_library", &prefer_nccl_library, "path"_a,
        "The NCCL file to try before the build's when the process has none loaded yet (taskswap names "
        "the nvidia-nccl wheel's at import).");
  m.def(
    "nccl_unique_id",
    []() {
      const nccl_unique_id id = make_nccl_unique_id();
      return nb::bytes(id.data(), id.size());
    },
    "A new NCCL unique id (128 bytes), made on one rank and given to all.");
  m.def(
    "nccl_communicator",
    [](const device& dev, const nb::bytes& id, int rank, int size, double timeout_s) {
      nccl_unique_id raw{};
      if (id.size() != raw.size()) {
        throw invalid_argument("taskswap: an NCCL unique id has " + std::to_string(raw.size()) + " bytes, this one " +
                               std::to_string(id.size()) + "; pass what nccl_unique_id() returned on one rank");
      }
      std::memcpy(raw.data(), id.c_str(), raw.size());
      nb::gil_scoped_release release;
      return make_nccl_communicator(dev, raw, rank, size, to_ms(timeout_s));
    },
    "device"_a, "unique_id"_a, "rank"_a, "size"_a, "timeout_s"_a = 300.0,
    "taskswap's own NCCL communicator (collective over the `size` ranks).");
  m.def("make_communicator", &make_communicator, "device"_a, "options"_a, nb::call_guard<nb::gil_scoped_release>(),
        "The communicator [comm] backend names (None for none).");
}

}  // namespace
}  // namespace taskswap::python

NB_MODULE(_core, m)
{
  using namespace taskswap::python;
  m.doc() = "taskswap's runtime for Python (no libtorch link; views are DLPack tensors)";
  // Tensors a script still holds at exit keep the runtime alive past the module's teardown; that
  // is not a leak worth a report (taskswap.torch closes its runtimes at exit).
  nb::set_leak_warnings(false);
  make_exceptions(m);
  nb::register_exception_translator(&translate);
  m.def("_raise", &raise_for_test, "kind"_a, "what"_a, "Throws the C++ error `kind` (tests of the translation).");
  m.def("_error_kinds", &error_kinds, "The exception class of each C++ error kind.");
  bind_enums(m);
  bind_options(m);
  bind_devices(m);
  bind_comm(m);
  bind_runtime(m);
  const taskswap::build_info info = taskswap::build_features();  // loads no library: Note [NCCL at run time]
  m.attr("__version__") = info.version;
  m.attr("with_cuda") = info.cuda;
  m.attr("with_nccl") = info.nccl;
  m.attr("with_mpi") = info.mpi;
}
