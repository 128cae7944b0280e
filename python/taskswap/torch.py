# SPDX-License-Identifier: Apache-2.0
"""taskswap for PyTorch trainers.

A trainer registers its trunk and per-task modules as units; taskswap keeps their parameters and
AdamW state at home (pinned host memory) and brings the ones a step uses onto the device. Inside
a step scope each registered ``nn.Parameter`` aliases its unit's device slab (``p.data``) and its
gradient aliases the unit's gradient slab (``p.grad``), so autograd accumulates straight into
the memory taskswap reduces and steps::

    rt = taskswap.torch.Runtime("taskswap.toml")
    trunk = rt.register(model.trunk, "trunk", residency="pinned")
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    rt.plan([[trunk, heads[t]] for t in upcoming_tasks])
    for t, (x, y) in zip(upcoming_tasks, batches):
        with rt.step(trunk, heads[t]):
            loss = loss_fn(model(x, t), y)
            loss.backward()
        # leaving the scope: gradients ready, AdamW step, release, end of step

Between steps a registered parameter is an empty tensor: using a module outside a step scope fails
at once instead of reading memory the runtime has given to another unit. A tensor taken from a
parameter inside a scope (``w = p.detach()``) still aliases the slot after the scope ends and
cannot be detected; clone it if it must outlive the step.
"""

from __future__ import annotations

import atexit
import copy
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from . import _core

__all__ = ["Runtime", "Unit", "nccl_group", "mpi"]

_RESIDENCY = {
    "pinned": _core.Residency.pinned,
    "prefetch": _core.Residency.prefetch,
    "on_demand": _core.Residency.on_demand,
}
_PLACEMENT = {"device": _core.OptimizerPlacement.device, "host": _core.OptimizerPlacement.host}
_DTYPES = {torch.float32: _core.DType.f32, torch.bfloat16: _core.DType.bf16, torch.float16: _core.DType.f16}
_TRAIN, _FROZEN = 0, 1
_HAS_POST_ACCUMULATE_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _choice(table: dict, value, what: str):
    try:
        return table[value]
    except KeyError:
        raise _core.ConfigError(f"{what} is one of {', '.join(map(repr, table))}, not {value!r}") from None


@dataclass(frozen=True)
class _Use:
    unit: "Unit"
    kind: int


class Unit:
    """A registered module: the handle a trainer plans and steps with."""

    def __init__(self, owner: "Runtime", module: torch.nn.Module, name: str, policy: dict,
                 no_weight_decay: Callable[[str, torch.nn.Parameter], bool]):
        self.name = name
        self.module = module
        self._owner = owner
        self._policy = policy
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        seen: set[int] = set()
        for pname, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.params.append((pname, p))
        if not self.params:
            raise _core.ConfigError(f"taskswap: module '{name}' has no parameters; register modules that have some")
        dtypes = {p.dtype for _, p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise _core.ConfigError(
                f"taskswap: the parameters of '{name}' are {sorted(map(str, dtypes))}; a unit's parameters share "
                "one dtype of float32, bfloat16 or float16 (register differently typed parts as separate units)")
        self.dtype = next(iter(dtypes))
        fixed = [pname for pname, p in self.params if not p.requires_grad]
        if fixed:
            raise _core.ConfigError(
                f"taskswap: '{name}' has parameters that do not require gradients ({fixed[:5]}); every parameter "
                "of a unit is trained. Freeze a unit per step with unit.frozen(), or leave those out of it")
        self._no_decay = [bool(no_weight_decay(pname, p)) for pname, p in self.params]
        self._shapes = [tuple(p.shape) for _, p in self.params]  # a 0-d parameter is a tensor of [1] in the unit
        self.id: int | None = None
        self._param_addr = None
        self._param_views: list[torch.Tensor] = []
        self._grad_addr = None
        self._grad_views: list[torch.Tensor] = []
        self._accumulators: list = []  # torch < 2.1: the AccumulateGrad nodes whose hooks we hold
        self._hook_handles: list = []
        self._fired = 0
        self._passes = 0
        self._ready = False  # the hooks handed the gradients to the reduction
        self._handed_versions: list[int] | None = None  # their version counters then

    def _grads_changed(self) -> bool:
        """After the hooks handed the gradients to the reduction: replaced, or changed in place."""
        return (any(p.grad is None or p.grad.data_ptr() != g.data_ptr()
                    for (_, p), g in zip(self.params, self._grad_views))
                or [g._version for g in self._grad_views] != self._handed_versions)

    def frozen(self) -> _Use:
        """This unit used frozen (forward only) in a plan or a step: parameters alone on the device,
        no gradients, no update, no communication."""
        return _Use(self, _FROZEN)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, id={self.id})"

    def spec(self) -> _core.UnitSpec:
        """The unit's spec as the runtime registers it (for taskswap.footprint and planning)."""
        return self._spec()

    def _spec(self) -> _core.UnitSpec:
        tensors = [_core.TensorSpec(pname, list(shape) or [1], nd)
                   for (pname, _), shape, nd in zip(self.params, self._shapes, self._no_decay)]
        return _core.UnitSpec(self.name, tensors, _DTYPES[self.dtype])

    def _shaped(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.view(shape) for t, shape in zip(tensors, self._shapes)]


def _repair_grad(p: torch.nn.Parameter, slab: torch.Tensor) -> None:
    """zero_grad(set_to_none=True) or an assignment replaced the slab's alias: the gradient it left
    (none: zero) is what the user meant, so it goes into the slab and the alias returns."""
    grad = p.grad
    if grad is not None and grad.data_ptr() == slab.data_ptr():
        return
    with torch.no_grad():
        if grad is None:
            slab.zero_()
        else:
            slab.copy_(grad)
    p.grad = slab


def _exact_glob(name: str) -> str:
    """An fnmatch pattern that matches `name` alone."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in name)  # fnmatch without FNM_NOESCAPE


def _close_at_exit(ref) -> None:
    rt = ref()
    if rt is not None and rt._scope is None:  # a scope left open at exit keeps its runtime
        rt.close()


def _use_of(entry) -> _Use:
    if isinstance(entry, _Use):
        return entry
    if isinstance(entry, Unit):
        return _Use(entry, _TRAIN)
    raise TypeError(f"taskswap: a step names registered units (or unit.frozen()), not {type(entry).__name__}")


def mpi(timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: MPI over MPI_COMM_WORLD (the emulated device, under mpirun)."""
    return lambda device: _core.mpi_communicator(device, timeout_s)


def nccl_group(process_group=None, timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: taskswap's own NCCL communicator over the ranks of a
    torch.distributed process group. Rank 0 of the group makes the NCCL unique id and
    torch.distributed broadcasts it; torch's own NCCL communicator is never borrowed."""
    import torch.distributed as dist

    def make(device: _core.Device) -> _core.Communicator:
        rank = dist.get_rank(process_group)
        size = dist.get_world_size(process_group)
        box = [_core.nccl_unique_id() if rank == 0 else None]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=src, group=process_group)
        return _core.nccl_communicator(device, box[0], rank, size, timeout_s)

    return make


class Runtime:
    """taskswap's runtime for a PyTorch trainer.

    ``config`` is a TOML file (or ``options`` an ``_core.Options``; ``own_tables``: the file's
    top-level tables the trainer reads itself, such as [model]). ``comm`` is None (the
    communicator the [comm] table names, if any), ``"none"`` (no communicator, whatever the
    table says), a factory such as ``mpi()`` or ``nccl_group(pg)``, or an ``_core.Communicator``.
    Units are registered first; the runtime starts at the first plan, step or ``start()``.
    """

    def __init__(self, config: str | os.PathLike | None = None, *, options: _core.Options | None = None,
                 comm=None, own_tables: Sequence[str] = ()):
        if (config is None) == (options is None):
            raise _core.InvalidArgument("taskswap: give a config file or options, one of them")
        # A copy: register() settings become rules of this runtime's options alone.
        self.options = (_core.load_config(os.fspath(config), list(own_tables)) if config is not None
                        else copy.copy(options))
        self._comm_request = comm
        self.units: list[Unit] = []
        self._by_name: dict[str, Unit] = {}
        self._owner_of: dict[int, str] = {}  # id(parameter) -> its unit
        self._core: _core.Runtime | None = None
        self.device: _core.Device | None = None
        self._stream = None
        self._external: dict[int, _core.Stream] = {}
        self._scope: _StepScope | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._scale_view: torch.Tensor | None = None  # the device's loss scale, once asked for
        self.last_step: _core.StepStats | None = None
        self._closed = False
        self._began = False  # a plan or a step was made: home copies are no longer what the device sees

    # --- registration --------------------------------------------------------------------------
    def register(self, module: torch.nn.Module, name: str, *, residency: str | None = None,
                 lookahead: int | None = None, optimizer: str | None = None, lr_scale: float | None = None,
                 weight_decay: float | None = None,
                 no_weight_decay: Iterable[str] | Callable[[str, torch.nn.Parameter], bool] | None = None) -> Unit:
        """Registers ``module``'s parameters as the unit ``name``. Settings left None come from the
        config's [defaults] and [[units]] rules. ``no_weight_decay``: parameter names (as
        ``module.named_parameters()`` gives them), or a predicate ``(name, param) -> bool``, of the
        tensors AdamW steps without weight decay (torch's no-decay group)."""
        if self._core is not None:
            raise _core.InvalidArgument(f"taskswap: register '{name}' before the runtime starts (the first plan or step)")
        if name in self._by_name:
            raise _core.ConfigError(f"taskswap: a unit named '{name}' is already registered")
        for q in module.parameters():
            other = self._owner_of.get(id(q))
            if other is not None:
                raise _core.ConfigError(f"taskswap: module '{name}' shares parameters with unit '{other}'; "
                                        "a parameter belongs to one unit")
        if no_weight_decay is None:
            predicate = lambda n, p: False  # noqa: E731
        elif callable(no_weight_decay):
            predicate = no_weight_decay
        else:
            names = set(no_weight_decay)
            known = {n for n, _ in module.named_parameters()}
            if names - known:
                raise _core.ConfigError(f"taskswap: no_weight_decay names {sorted(names - known)}, which '{name}' "
                                        f"does not have (it has {sorted(known)})")
            predicate = lambda n, p: n in names  # noqa: E731
        policy = {"residency": None if residency is None else _choice(_RESIDENCY, residency, "residency"),
                  "lookahead": lookahead,
                  "optimizer": None if optimizer is None else _choice(_PLACEMENT, optimizer, "optimizer"),
                  "lr_scale": lr_scale, "weight_decay": weight_decay}
        unit = Unit(self, module, name, policy, predicate)
        self._owner_of.update((id(p), name) for _, p in unit.params)
        self.units.append(unit)
        self._by_name[name] = unit
        return unit

    def unit(self, name: str) -> Unit:
        return self._by_name[name]

    # --- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Lays out every unit at home (the modules' current values move there), and brings the
        pinned units onto the device. With a communicator: collective."""
        if self._core is not None:
            return
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if not self.units:
            raise _core.InvalidArgument("taskswap: register at least one module before the runtime starts")
        specs = [u._spec() for u in self.units]
        # The runtime's own options: the user's, with a register() setting as a rule that matches
        # the unit's name alone, after the config's rules (it wins over them, and the config's
        # rules still count the unit as matched).
        options = copy.copy(self.options)
        for u in self.units:
            overrides = {k: v for k, v in u._policy.items() if v is not None}
            if overrides:
                options.add_rule(_exact_glob(u.name), origin=f"register('{u.name}')", **overrides)
        comm = self._comm_request
        if isinstance(comm, str) and comm not in ("none", "config"):
            raise _core.ConfigError(f"taskswap: comm is None, \"config\", \"none\", a factory such as "
                                    f"taskswap.torch.mpi() or nccl_group(pg), or a Communicator; not {comm!r}")
        device = _core.make_device(options.device)
        if comm == "none":
            options.comm.backend = _core.CommBackend.none
            comm = None
        elif comm == "config":
            comm = None
        elif callable(comm):
            comm = comm(device)
            if not isinstance(comm, _core.Communicator):
                raise _core.ConfigError(f"taskswap: the comm factory returned {type(comm).__name__}, not a Communicator")
        elif comm is not None and not isinstance(comm, _core.Communicator):
            raise _core.ConfigError(f"taskswap: comm is None, \"config\", \"none\", a factory or a Communicator; "
                                    f"not a {type(comm).__name__} (for a torch process group: nccl_group(pg))")
        core = _core.Runtime(device, options, specs, comm)
        self.device = device
        # Gradient hooks hand each unit to the reduction as soon as backward completes it, so the
        # allreduce overlaps the rest of backward. Without a communicator there is nothing to
        # overlap (step() follows the backward on the same stream): no hooks, no per-parameter cost.
        self._hooks = core.has_communicator
        self._torch_device = (torch.device("cuda", device.index)
                              if device.kind == _core.Backend.cuda else torch.device("cpu"))
        stream = _core.Stream(device) if device.kind == _core.Backend.emulated else None
        for u in self.units:
            u.id = core.find(u.name)
            self._write_home(core, u)
        # Nothing below can fail: the modules' parameters move home, the runtime is started.
        self._core, self._stream = core, stream
        atexit.register(_close_at_exit, weakref.ref(self))
        for u in self.units:
            for _, p in u.params:
                p.grad = None
                p.data = self._placeholder(p.dtype)
            if self._hooks:
                for j, (_, p) in enumerate(u.params):
                    u._hook_handles.append(p.register_hook(self._make_pre_hook(u)))
                    if _HAS_POST_ACCUMULATE_HOOK:
                        u._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(u, j)))

    @staticmethod
    def _write_home(core: _core.Runtime, u: Unit) -> None:
        kinds = ["params"] if u.dtype == torch.float32 else ["params", "master"]
        with torch.no_grad():
            for kind in kinds:
                for home, (_, p) in zip(core.home(u.id, kind), u.params):
                    home.copy_(p.detach().reshape(home.shape))

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._placeholders.get(dtype)
        if t is None:
            t = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self._torch_device)
        return t

    def close(self) -> None:
        """Ends the runtime: drops this object's reference to it, so that the C++ destructor (dirty
        units written home, streams drained) runs once no tensor viewing its memory is left: a
        `home()` tensor or an alias kept from a step defers it. The modules keep empty parameters.
        Called at exit for a runtime still open.
        Raises InvalidArgument inside a step scope."""
        if self._scope is not None:
            raise _core.InvalidArgument("taskswap: close() inside a step scope; leave the scope first")
        self._closed = True
        if self._core is None:
            return
        for u in self.units:
            u._param_views, u._grad_views, u._param_addr, u._grad_addr = [], [], None, None
            for h in u._hook_handles:
                h.remove()
            u._hook_handles, u._accumulators = [], []
        self._external.clear()
        self._stream = None
        self._scale_view = None
        self._closed = True
        self._core = None  # the last reference: views that still alias its memory keep it alive

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def core(self) -> _core.Runtime:
        """The runtime underneath (taskswap._core.Runtime), started."""
        self.start()
        return self._core

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def world_size(self) -> int:
        return self.core.world_size

    # --- plan and steps ---------------------------------------------------------------------
    def plan(self, steps: Iterable[Sequence[Unit | _Use]]) -> None:
        """Appends upcoming steps, each the units it acquires in order (``unit.frozen()`` for a
        forward-only use). Checks that each step fits the budget."""
        core = self.core
        plan = [[self._own(_use_of(e)) for e in step] for step in steps]
        self._began = True
        core.plan([[(e.unit.id, e.kind) for e in step] for step in plan])

    def _own(self, use: _Use) -> _Use:
        if use.unit._owner is not self:
            raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' belongs to another runtime")
        return use

    def step(self, *units: Unit | _Use, micro_batches: int = 1) -> "_StepScope":
        """A step scope: acquires ``units`` in order on torch's current stream, aliases their
        parameters and gradients into the unit slabs; on exit, gradients ready, AdamW step,
        release, end of step. ``micro_batches``: backward passes accumulated before the reduction
        (gradient accumulation: call backward that many times inside the scope)."""
        if micro_batches < 1:
            raise _core.InvalidArgument(f"taskswap: micro_batches is at least 1, not {micro_batches}")
        return _StepScope(self, [_use_of(u) for u in units], micro_batches)

    def _current_stream(self) -> _core.Stream:
        if self._stream is not None:
            return self._stream
        handle = torch.cuda.current_stream(self._torch_device).cuda_stream
        s = self._external.get(handle)
        if s is None:
            s = self._external[handle] = _core.external_stream(self.device, handle)
        return s

    def _make_pre_hook(self, u: Unit):
        # Before autograd accumulates into the slab: one pass more than the scope's micro_batches
        # would write into gradients the reduction may be reading.
        ref = weakref.ref(self)  # the module's hooks must not keep the runtime alive

        def pre_hook(grad):
            rt = ref()
            scope = rt._scope if rt is not None else None
            if scope is not None and u._ready and scope.kinds.get(u.id) == _TRAIN:
                raise _core.InvalidArgument(
                    f"taskswap: a backward pass reached unit '{u.name}' after its gradients were handed to the "
                    f"reduction; the step scope was opened with micro_batches={scope.micro_batches} (count the "
                    "backward passes through the unit, shared units included, or sum the losses first)")
            return None
        return pre_hook

    def _make_hook(self, u: Unit, j: int):
        ref = weakref.ref(self)

        def hook(*_):
            rt = ref()
            scope = rt._scope if rt is not None else None
            if scope is None or scope.kinds.get(u.id) != _TRAIN or u._ready:
                return
            _repair_grad(u.params[j][1], u._grad_views[j])
            u._fired += 1
            if u._fired == len(u.params):
                u._fired = 0
                u._passes += 1
                if u._passes == scope.micro_batches:
                    # On the stream autograd accumulated on (the node's; it may not be the scope's)
                    rt._core.grads_ready(u.id, rt._current_stream())
                    u._ready = True
                    u._handed_versions = [g._version for g in u._grad_views]
        return hook

    def _attach(self, u: Unit, kind: int, addrs: tuple[int, int]) -> None:
        core = self._core
        # Every view first: a failure then leaves the parameters as they were.
        if u._param_addr != addrs[0]:
            u._param_views, u._param_addr = u._shaped(core.param_tensors(u.id)), addrs[0]
        if kind == _TRAIN and u._grad_addr != addrs[1]:
            u._grad_views, u._grad_addr = u._shaped(core.grad_tensors(u.id)), addrs[1]
        try:
            for (_, p), t in zip(u.params, u._param_views):
                p.data = t
            if kind == _FROZEN:
                for _, p in u.params:
                    p.requires_grad_(False)
                return
            for (_, p), g in zip(u.params, u._grad_views):
                p.grad = g
            u._fired = u._passes = 0
            u._ready = False
            u._handed_versions = None
            if self._hooks and not _HAS_POST_ACCUMULATE_HOOK and not u._accumulators:
                # torch < 2.1: a post hook on each parameter's AccumulateGrad node, made while the
                # parameter has its real shape and device (grad mode on: a scope may be entered
                # under no_grad), and held so that autograd keeps using it.
                with torch.enable_grad():
                    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for _, p in u.params]
                for j, acc in enumerate(accumulators):
                    u._hook_handles.append(acc.register_hook(self._make_hook(u, j)))
                u._accumulators = accumulators
        except BaseException:
            self._detach(u, kind)
            raise

    def _detach(self, u: Unit, kind: int) -> None:
        for _, p in u.params:
            p.grad = None
            p.data = self._placeholder(p.dtype)
            if kind == _FROZEN:
                p.requires_grad_(True)

    @staticmethod
    def _repair_grads(u: Unit) -> None:
        for (_, p), g in zip(u.params, u._grad_views):
            _repair_grad(p, g)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every unit's parameters from the home copies, keyed ``"<unit>.<parameter>"`` (CPU
        tensors, copies). Writes dirty units back first (synchronises)."""
        core = self.core
        self._expect_between_steps("state_dict")
        self._began = True  # flush() brings the pinned units onto the device
        core.flush()
        out = {}
        for u in self.units:
            for (pname, _), t, shape in zip(u.params, core.home(u.id, "params"), u._shapes):
                out[f"{u.name}.{pname}"] = t.clone().view(shape)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Sets every unit's parameters (and f32 master copy) from ``state``, keyed as state_dict
        gives them: every key, no other, each with its parameter's shape. Before the first plan,
        step, state_dict or checkpoint save (units on the device would not see it). AdamW moments
        and step counts keep their values, and a bf16/f16 unit's master copy is the loaded value:
        a checkpoint is the exact resume."""
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if self._began:
            raise _core.InvalidArgument("taskswap: load_state_dict after the first plan, step, state_dict or "
                                        "checkpoint save cannot reach units already on the device; call it "
                                        "before, or use load_checkpoint")
        expected = {f"{u.name}.{n}": (u, j) for u in self.units for j, (n, _) in enumerate(u.params)}
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise _core.InvalidArgument(f"taskswap: load_state_dict: missing keys {missing[:5]}, unexpected keys "
                                        f"{unexpected[:5]}")
        for key, (u, j) in expected.items():
            if tuple(state[key].shape) != u._shapes[j]:
                raise _core.InvalidArgument(f"taskswap: load_state_dict: '{key}' has shape {tuple(state[key].shape)}, "
                                            f"the parameter {u._shapes[j]}")
        with torch.no_grad():
            if self._core is None:
                for key, (u, j) in expected.items():
                    u.params[j][1].copy_(state[key])
                return
            for u in self.units:
                kinds = ["params"] if u.dtype == torch.float32 else ["params", "master"]
                for kind in kinds:
                    for home, (pname, _) in zip(self._core.home(u.id, kind), u.params):
                        home.copy_(state[f"{u.name}.{pname}"].reshape(home.shape))

    def save_checkpoint(self, path: str | os.PathLike, user: dict[str, str] | None = None) -> None:
        """Writes every unit's home state (parameters, master, moments, steps) and the plan
        position to the directory ``path``, atomically (see docs/reliability.md)."""
        self._expect_between_steps("save_checkpoint")
        self._began = True  # it writes dirty units back, bringing the pinned units onto the device
        self.core.save_checkpoint(os.fspath(path), user or {})

    def load_checkpoint(self, path: str | os.PathLike) -> tuple[int, dict[str, str]]:
        """Restores every unit from a checkpoint before the first plan or step; returns
        (steps done, the trainer's own entries)."""
        steps_done, user, _ = self.core.load_checkpoint(os.fspath(path))
        return steps_done, user

    def stats(self) -> _core.RuntimeStats:
        return self.core.stats()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the runtime's loss scale, as ``GradScaler.scale``: call ``backward()`` on
        the result inside the step. The scale stays on the device (no synchronisation); the
        runtime unscales the gradients in the update, skips a step whose gradients are not finite
        on any rank, and changes the scale at the step's end. Without ``[scaler] enabled`` the
        loss itself."""
        if not self.options.scaler.enabled:
            return loss
        if self._scale_view is None:
            self._scale_view = self.core.loss_scale_tensor().reshape(())
        return loss * self._scale_view

    def scaler_state(self) -> _core.LossScalerState:
        """The loss scaler's scale, growth tracker, skipped steps and the last step's global
        gradient norm (with ``[scaler]`` or ``[optimizer] clip``). Synchronises."""
        return self.core.scaler_state()

    @property
    def optimizer(self) -> _core.AdamW:
        """The AdamW hyperparameters (a copy); assign to change them between steps."""
        return self.core.optimizer

    @optimizer.setter
    def optimizer(self, options: _core.AdamW) -> None:
        self.core.optimizer = options

    def set_lr(self, lr: float) -> None:
        """Sets the optimizer's learning rate (each unit's is this times its lr_scale)."""
        o = self.core.optimizer
        o.lr = lr
        self.core.optimizer = o

    def agree_stop(self, local: int = 0) -> int:
        """Agrees with the other ranks whether to stop, at a step boundary (see runtime::agree_stop)."""
        return self.core.agree_stop(local)

    def _expect_between_steps(self, what: str) -> None:
        if self._scope is not None:
            raise _core.InvalidArgument(f"taskswap: {what} inside a step scope; call it between steps")


class _StepScope:
    def __init__(self, rt: Runtime, uses: list[_Use], micro_batches: int):
        self.rt = rt
        self.uses = uses
        self.micro_batches = micro_batches
        self.kinds: dict[int, int] = {}
        self.stream = None
        self.acquired: list[_Use] = []
        self.attached: list[_Use] = []
        self.stats: _core.StepStats | None = None

    def __enter__(self) -> "_StepScope":
        rt = self.rt
        core = rt.core
        if rt._scope is not None:
            raise _core.InvalidArgument("taskswap: a step scope is already open; steps do not nest")
        for use in self.uses:  # before anything is acquired: a bad scope changes nothing
            rt._own(use)
            if use.unit.id in self.kinds:
                raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' is named twice in one step")
            self.kinds[use.unit.id] = use.kind
        self.stream = rt._current_stream()
        rt._scope = self
        rt._began = True
        try:
            addrs = []
            for use in self.uses:
                addrs.append(core.acquire(use.unit.id, self.stream, use.kind == _FROZEN))
                self.acquired.append(use)
            if rt._stream is not None:
                rt._stream.synchronize()  # emulated: torch computes on the host, after the swap-ins
            for use, a in zip(self.uses, addrs):
                rt._attach(use.unit, use.kind, a)
                self.attached.append(use)
        except BaseException:
            self._abandon()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abandon()
            return
        rt, core = self.rt, self.rt._core
        trained = [use.unit for use in self.acquired if use.kind == _TRAIN]
        # Units the hooks handed to the reduction already must still alias their slabs; the
        # others are repaired now. step() implies grads_ready().
        changed = [u.name for u in trained if u._ready and u._grads_changed()]
        stepped = set()
        try:
            for u in trained:
                if not u._ready:
                    rt._repair_grads(u)
                stepped.add(u.id)  # before the call: a step that fails halfway is not retried
                core.step(u.id, self.stream)
        except BaseException:
            self._abandon(stepped)
            raise
        self._end()
        if changed:
            raise _core.InvalidArgument(
                f"taskswap: the gradients of {changed} were replaced or changed in place (zero_grad, clipping, "
                "scaling) after the last backward pass had handed them to the reduction, which may have been "
                "reading them; the step used them as the reduction found them. With a communicator, change "
                "gradients before the last backward pass (or raise micro_batches); global-norm clipping after "
                "the reduction is not yet in taskswap")

    def _abandon(self, stepped: frozenset | set = frozenset()) -> None:
        """An exception in the scope: the gradients of the units not yet handed to the reduction
        nor stepped are zeroed (a resident unit does not carry them into the next step); with a
        communicator every trained unit is still stepped (this rank contributing those zeros, and
        the gradients of units the hooks handed over already), so replicas stay equal. Every unit
        is released and the step ends; the first error of this cleanup is raised after it."""
        rt, core = self.rt, self.rt._core
        first = None
        try:
            with torch.no_grad():
                for use in self.attached:
                    if use.kind == _TRAIN and not use.unit._ready and use.unit.id not in stepped:
                        for g in use.unit._grad_views:
                            g.zero_()
        except BaseException as e:  # noqa: BLE001: kept, the cleanup goes on
            first = e
        if rt._hooks:
            for use in self.acquired:
                if use.kind == _TRAIN and use.unit.id not in stepped:
                    try:
                        core.step(use.unit.id, self.stream)
                    except BaseException as e:  # noqa: BLE001: each unit is stepped
                        first = first or e
        self._end(first)

    def _end(self, first: BaseException | None = None) -> None:
        """Releases every unit and ends the step, each whatever the other does; raises the first
        error (`first`: one from before) after both."""
        try:
            self._release()
        except BaseException as e:  # noqa: BLE001: the step still ends
            first = first or e
        try:
            self.stats = self.rt.last_step = self.rt._core.end_step()
        except BaseException as e:  # noqa: BLE001
            first = first or e
        if first is not None:
            raise first

    def _release(self) -> None:
        """Releases every unit acquired (in reverse order, each whatever the others do) and points
        the parameters back at their empty placeholders; raises the first error after all."""
        first = None
        for use in reversed(self.acquired):
            try:
                self.rt._core.release(use.unit.id, self.stream)
            except BaseException as e:  # noqa: BLE001: every unit is released
                first = first or e
        try:
            for use in self.attached:
                self.rt._detach(use.unit, use.kind)
        finally:
            self.rt._scope = None
        if first is not None:
            raise first
