# SPDX-License-Identifier: Apache-2.0
"""taskswap for PyTorch trainers (torch 2.1 and later).

A trainer registers sets of parameters as units: a module (its parameters and buffers), or any
parameters spread across modules (a PEFT adapter: see ``taskswap.torch.peft``). taskswap keeps
their values and AdamW state at home (pinned host memory) and brings the ones a step uses onto
the device. Inside a step scope each registered ``nn.Parameter`` aliases its unit's device slab
(``p.data``) and its gradient aliases the unit's gradient slab (``p.grad``), so autograd
accumulates straight into the memory taskswap reduces and steps::

    rt = taskswap.torch.Runtime("taskswap.toml")
    trunk = rt.register(model.trunk, "trunk", residency="pinned")
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    rt.plan([[trunk, heads[t]] for t in upcoming_tasks])
    for t, (x, y) in zip(upcoming_tasks, batches):
        with rt.step(trunk, heads[t]):
            loss = loss_fn(model(x, t), y)
            loss.backward()
        # leaving the scope: gradients ready, AdamW step, release, end of step
    rt.close()  # the modules get their trained values back

A trunk larger than the device streams layer by layer within each step: ``register_layers``
registers each module of a list (``model.model.layers``) as a unit, and hooks acquire a layer
for its forward, release it, acquire it again for its backward and, a trained layer, step it as
soon as its gradients are complete (see ``Runtime.register_layers``).

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
from collections.abc import Mapping
from typing import Callable, Iterable, Sequence

import torch

from .. import _core

if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
    raise ImportError(f"taskswap.torch needs torch 2.1 or later (register_post_accumulate_grad_hook); this is torch "
                      f"{torch.__version__}")

__all__ = ["Runtime", "Unit", "nccl_group", "mpi"]

_RESIDENCY = {
    "pinned": _core.Residency.pinned,
    "prefetch": _core.Residency.prefetch,
    "on_demand": _core.Residency.on_demand,
}
_PLACEMENT = {"device": _core.OptimizerPlacement.device, "host": _core.OptimizerPlacement.host}
_DTYPES = {torch.float32: _core.DType.f32, torch.bfloat16: _core.DType.bf16, torch.float16: _core.DType.f16}
_TRAIN, _FROZEN, _RELEASE = 0, 1, 2


def _choice(table: dict, value, what: str):
    try:
        return table[value]
    except KeyError:
        raise _core.ConfigError(f"{what} is one of {', '.join(map(repr, table))}, not {value!r}") from None


class _Use:
    """A unit as a plan or a step uses it: trained or frozen. Each unit keeps one of each."""

    __slots__ = ("unit", "kind", "frozen")

    def __init__(self, unit: Unit, kind: int):
        self.unit = unit
        self.kind = kind
        self.frozen = kind == _FROZEN


class _Entry:
    """One tensor of a unit: a parameter, or a buffer that travels as a state tensor. `owner` and
    `attr` say where the model holds it (``owner._parameters[attr]`` or ``owner._buffers[attr]``),
    when known, so that a model changed after registration is noticed."""

    __slots__ = ("name", "tensor", "owner", "attr", "state", "shape", "requires_grad", "device", "original",
                 "original_grad")

    def __init__(self, name: str, tensor: torch.Tensor, owner: torch.nn.Module | None, attr: str | None,
                 state: bool):
        self.name = name
        self.tensor = tensor
        self.owner = owner
        self.attr = attr
        self.state = state
        self.shape = tuple(tensor.shape)  # a 0-d tensor is a tensor of [1] in the unit
        self.requires_grad = tensor.requires_grad  # as registered: given back at close()
        self.device = tensor.device
        # Its values (and gradient) from start() until the call that started the runtime succeeded.
        self.original: torch.Tensor | None = None
        self.original_grad: torch.Tensor | None = None

    def held_by_owner(self) -> bool:
        if self.owner is None:
            return True
        table = self.owner._buffers if self.state else self.owner._parameters
        return table.get(self.attr) is self.tensor


def _module_entries(module: torch.nn.Module) -> tuple[list[_Entry], list[_Entry]]:
    """A module's parameters (as ``named_parameters()`` names them, shared ones once) and buffers."""
    params: list[_Entry] = []
    buffers: list[_Entry] = []
    seen: set[int] = set()
    for mname, mod in module.named_modules():
        prefix = f"{mname}." if mname else ""
        for attr, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(_Entry(prefix + attr, p, mod, attr, False))
        for attr, b in mod._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers.append(_Entry(prefix + attr, b, mod, attr, True))
    return params, buffers


def _set_entries(params, name: str) -> list[_Entry]:
    """Parameters given as a mapping or an iterable of (name, parameter) pairs, any names."""
    items = params.items() if isinstance(params, Mapping) else params
    entries: list[_Entry] = []
    seen: dict[int, str] = {}
    for item in items:
        try:
            pname, p = item
        except (TypeError, ValueError):
            raise _core.ConfigError(f"taskswap: register '{name}': give a module, a dict of parameters or (name, "
                                    f"parameter) pairs; got {type(item).__name__}") from None
        if not isinstance(p, torch.nn.Parameter):
            raise _core.ConfigError(f"taskswap: register '{name}': '{pname}' is a {type(p).__name__}, not an "
                                    "nn.Parameter (a module's buffers travel when the module is registered)")
        if id(p) in seen:
            raise _core.ConfigError(f"taskswap: register '{name}': '{pname}' is the parameter '{seen[id(p)]}' again")
        seen[id(p)] = str(pname)
        entries.append(_Entry(str(pname), p, None, None, False))
    if len({e.name for e in entries}) != len(entries):
        raise _core.ConfigError(f"taskswap: register '{name}': two parameters have the same name")
    return entries


class Unit:
    """A registered set of parameters (and buffers): the handle a trainer plans and steps with."""

    def __init__(self, owner: Runtime, name: str, params: list[_Entry], buffers: list[_Entry], trainable: bool,
                 policy: dict, no_weight_decay: Callable[[str, torch.nn.Parameter], bool],
                 module: torch.nn.Module | None):
        self.name = name
        self.module = module
        self.trainable = trainable
        self._owner = owner
        self._policy = policy
        self._entries = params + buffers  # the unit's tensors in spec order: parameters, then state tensors
        self._params = [e.tensor for e in params]
        self._buffers = [e.tensor for e in buffers]
        self._tensors = self._params + self._buffers  # as _entries
        self._owned = [e for e in self._entries if e.owner is not None]
        # (the dict that holds it, its key, the tensor): what _check_model compares at each attach
        self._holders = [(e.owner._buffers if e.state else e.owner._parameters, e.attr, e.tensor) for e in self._owned]
        self.params: list[tuple[str, torch.nn.Parameter]] = [(e.name, e.tensor) for e in params]
        self.buffers: list[tuple[str, torch.Tensor]] = [(e.name, e.tensor) for e in buffers]
        self.dtype = params[0].tensor.dtype
        self._no_decay = [bool(no_weight_decay(e.name, e.tensor)) for e in params]
        self.id: int | None = None
        self._param_addr = None
        self._views: list[torch.Tensor] = []  # every tensor's device view, in spec order
        self._grad_addr = None
        self._grad_views: list[torch.Tensor] = []  # the parameters' gradients
        # Norm layers whose train mode updates the unit's buffers (running statistics) in forward.
        self._stat_modules = ([m for m in module.modules() if getattr(m, "track_running_stats", False)
                               and any(b is getattr(m, "running_mean", None) for b in self._buffers)]
                              if module is not None and self._buffers else [])
        self._placeholders: list[torch.Tensor] = []  # per tensor, between steps (set at start)
        self._train_use = _Use(self, _TRAIN)
        self._frozen_use = _Use(self, _FROZEN)
        self._hook_handles: list = []
        self._fired = 0
        self._passes = 0
        self._ready = False  # the hooks handed the gradients to the reduction
        self._handed_versions: list[int] | None = None  # their version counters then
        self._layer: int | None = None  # its place in the streamed layers (register_layers)
        self._layer_module: torch.nn.Module | None = None

    def _grads_changed(self) -> bool:
        """After the hooks handed the gradients to the reduction: replaced, or changed in place."""
        return (any(p.grad is None or p.grad.data_ptr() != g.data_ptr() for p, g in zip(self._params, self._grad_views))
                or [g._version for g in self._grad_views] != self._handed_versions)

    def frozen(self) -> _Use:
        """This unit used frozen (forward only) in a plan or a step: parameters alone on the device,
        no gradients, no update, no communication. A unit registered with ``trainable=False`` is
        always used so."""
        return self._frozen_use

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, id={self.id}{'' if self.trainable else ', trainable=False'})"

    def spec(self) -> _core.UnitSpec:
        """The unit's spec as the runtime registers it (for taskswap.footprint and planning)."""
        n = len(self._params)
        tensors = [_core.TensorSpec(e.name, list(e.shape) or [1], nd)
                   for e, nd in zip(self._entries[:n], self._no_decay)]
        tensors += [_core.TensorSpec(e.name, list(e.shape) or [1], state=True) for e in self._entries[n:]]
        return _core.UnitSpec(self.name, tensors, _DTYPES[self.dtype], trainable=self.trainable)

    def _shaped(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.view(e.shape) for t, e in zip(tensors, self._entries)]

    def _check_model(self) -> None:
        for holder, attr, t in self._holders:
            if holder.get(attr) is not t:
                self._model_changed()

    def _check_eval(self) -> None:
        training = [type(m).__name__ for m in self._stat_modules if m.training]
        if training:
            raise _core.InvalidArgument(
                f"taskswap: unit '{self.name}' is used frozen while its {training[0]} layers are in train mode, which "
                "would update running statistics in forward; a frozen use only reads a unit and keeps no change. "
                "Put those modules in eval mode (module.eval()) for frozen uses, or train the unit")

    def _model_changed(self) -> None:
        for e in self._owned:
            if not e.held_by_owner():
                kind = "buffer" if e.state else "parameter"
                raise _core.InvalidArgument(
                    f"taskswap: the model changed after registration: the {kind} '{e.name}' of unit '{self.name}' is "
                    f"no longer {type(e.owner).__name__}.{e.attr} (replaced, removed or re-created, as adding an "
                    "adapter, merging or re-wrapping does); build the model first and register it after, or close() "
                    "this runtime and register the new model with a new one")


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
        rt.close(give_back=False)


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples, lists and dicts (a ModelOutput) of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (torch.utils.checkpoint asks the
    same, on autograd's device threads too)."""
    return torch._C._current_graph_task_id() != -1


def _use_of(entry) -> _Use:
    if type(entry) is Unit:
        return entry._train_use if entry.trainable else entry._frozen_use
    if isinstance(entry, _Use):
        return entry
    if isinstance(entry, Unit):
        return entry._train_use if entry.trainable else entry._frozen_use
    raise TypeError(f"taskswap: a step names registered units (or unit.frozen()), not {type(entry).__name__}")


def mpi(timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: MPI over MPI_COMM_WORLD (the emulated device, under mpirun)."""
    return lambda device: _core.mpi_communicator(device, timeout_s)


def nccl_group(process_group=None, timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: taskswap's own NCCL communicator over the ranks of a
    torch.distributed process group. Rank 0 of the group makes the NCCL unique id and
    torch.distributed broadcasts it; torch's own NCCL communicator is never borrowed. taskswap
    calls the NCCL torch loaded (``taskswap.nccl_library()`` says which)."""
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

    A call that is refused changes nothing: the modules keep their values, and a call refused
    while starting the runtime leaves it unstarted. ``close()`` gives the modules their current
    values back.
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
        self._owner_of: dict[int, str] = {}  # id(tensor) -> its unit
        self._core: _core.Runtime | None = None
        self.device: _core.Device | None = None
        self._stream = None
        self._external: dict[int, _core.Stream] = {}
        self._scope: _StepScope | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._hooks = False  # gradient hooks: with a communicator
        self._layers: list[Unit] = []  # the streamed layers, in forward order
        self._scale_view: torch.Tensor | None = None  # the device's loss scale, once asked for
        self.last_step: _core.StepStats | None = None
        self._closed = False
        self._began = False  # a plan or a step was made: home copies are no longer what the device sees
        self._at_exit = False

    # --- registration --------------------------------------------------------------------------
    def register(self, params, name: str, *, trainable: bool | None = None, residency: str | None = None,
                 lookahead: int | None = None, optimizer: str | None = None, lr_scale: float | None = None,
                 weight_decay: float | None = None,
                 no_weight_decay: Iterable[str] | Callable[[str, torch.nn.Parameter], bool] | None = None) -> Unit:
        """Registers a set of parameters as the unit ``name``.

        ``params`` is a module (its ``named_parameters()``, shared ones once, and its floating-point
        buffers of the parameters' dtype, which travel with the unit as state tensors), a dict
        ``{name: nn.Parameter}`` or an iterable of ``(name, nn.Parameter)`` pairs (any names, the
        parameters of any modules). The parameters share one dtype (float32, bfloat16, float16).

        ``trainable``: True trains every parameter (each gets ``requires_grad`` in a step that
        trains the unit); False registers a unit that is never trained (a frozen base): it costs
        its parameters alone, at home and on the device, and every use of it is frozen; None (the
        default) is True when every parameter requires gradients and False when none does.

        Settings left None come from the config's [defaults] and [[units]] rules.
        ``no_weight_decay``: parameter names, or a predicate ``(name, param) -> bool``, of the
        tensors AdamW steps without weight decay (torch's no-decay group)."""
        if self._core is not None:
            raise _core.InvalidArgument(f"taskswap: register '{name}' before the runtime starts (the first plan or "
                                        "step)")
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if not isinstance(name, str) or not name:
            raise _core.ConfigError(f"taskswap: a unit's name is a non-empty string, not {name!r}")
        if name in self._by_name:
            raise _core.ConfigError(f"taskswap: a unit named '{name}' is already registered")
        module = params if isinstance(params, torch.nn.Module) else None
        if module is not None:
            param_entries, buffer_entries = _module_entries(module)
        else:
            param_entries, buffer_entries = _set_entries(params, name), []
        return self._register_entries(name, param_entries, buffer_entries, module, trainable=trainable,
                                      residency=residency, lookahead=lookahead, optimizer=optimizer,
                                      lr_scale=lr_scale, weight_decay=weight_decay, no_weight_decay=no_weight_decay)

    def register_layers(self, layers: Iterable[torch.nn.Module], prefix: str, *, trainable: bool | None = None,
                        residency: str | None = None, lookahead: int | None = None, optimizer: str | None = None,
                        lr_scale: float | None = None, weight_decay: float | None = None,
                        no_weight_decay: Iterable[str] | Callable[[str, torch.nn.Parameter], bool] | None = None
                        ) -> list[Unit]:
        """Registers each module of ``layers``, in the order the forward pass runs them, as the unit
        ``f"{prefix}/{i}"`` and streams it within each step: a trunk larger than the device trains.

        The layers are not named in ``plan`` or ``step``: the plan of each step is the units it
        names (acquired when the scope opens, held to its end), then every layer used in forward
        order, then in backward order, and hooks make those acquisitions. A forward pre-hook
        acquires a layer (its parameters alone; the prefetch brought it ahead), a forward hook
        releases it, a hook on its outputs' gradients acquires it again before its backward (with
        its gradient slab, where it is trained), and a trained layer is stepped and released as
        soon as autograd has accumulated all its gradients; a frozen one is released once its
        inputs' gradients are computed. A layer's tensors that another unit holds already (a PEFT
        adapter inside the layer: register it first) stay that unit's.

        Correct whatever the step does: with ``torch.no_grad()`` a layer is released after its
        forward, with activation checkpointing (``torch.utils.checkpoint``) the forward re-run
        inside backward is the layer's backward use (held for it, or acquired for it), a layer a
        step skips (early exit) is not acquired and its planned uses are dropped when the backward
        begins (or at the scope's ``exit_early()``), and one used off the plan (a reentrant checkpoint
        over several layers) is fetched on demand and counted as unplanned. Each layer runs once per
        forward pass; a trained layer is stepped when the step's backward pass completes its
        gradients (micro_batches 1; a second backward reaching it is refused), and not stepped in a
        step whose backward does not reach it.

        With a communicator a use off the plan is refused (the ranks agree on each step's uses),
        and so is micro_batches > 1; a trained layer's room comes back once its gradient
        bucket's reduction is launched (with [comm] bucket_cap near a layer's gradients, at its
        backward's release; call exit_early() on an early exit, or the skipped layers keep the
        bucket waiting to the step's end), and one a step's backward did not reach is updated
        with this rank's zeros, as every unit planned trained is (plan evaluations with
        ``forward_only``). Trained layers need a step without loss scaling or clipping (a guarded
        update waits for the step's end, so every trained layer would be held to it); a layer of
        at most half a device granule is refused at start (such units share granules and may move
        between forward and backward, where autograd's saved views of the weights would not
        follow). The other arguments are register()'s, for every layer. Refused, it registers
        nothing."""
        if self._core is not None:
            raise _core.InvalidArgument(f"taskswap: register_layers '{prefix}' before the runtime starts (the first "
                                        "plan or step)")
        modules = list(layers)
        if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
            raise _core.ConfigError(f"taskswap: register_layers '{prefix}': give the layers as a non-empty list of "
                                    "modules in forward order (a ModuleList such as model.model.layers)")
        if len({id(m) for m in modules}) != len(modules):
            raise _core.ConfigError(f"taskswap: register_layers '{prefix}': a module is listed twice; each layer "
                                    "runs once per forward pass")
        settings = {"trainable": trainable, "residency": residency, "lookahead": lookahead, "optimizer": optimizer,
                    "lr_scale": lr_scale, "weight_decay": weight_decay, "no_weight_decay": no_weight_decay}
        made: list[Unit] = []
        try:
            for i, layer in enumerate(modules):
                params, buffers = _module_entries(layer)
                params = [e for e in params if id(e.tensor) not in self._owner_of]
                buffers = [e for e in buffers if id(e.tensor) not in self._owner_of]
                made.append(self._register_entries(f"{prefix}/{i}", params, buffers, layer, **settings))
        except BaseException:
            self._unregister(made)
            raise
        self._stream_layers(made, modules)
        return made

    def _stream_layers(self, units: list[Unit], modules: list[torch.nn.Module]) -> None:
        """Marks registered units as streamed layers run by `modules` (forward order)."""
        for u, m in zip(units, modules):
            u._layer, u._layer_module = len(self._layers), m
            self._layers.append(u)

    def _unregister(self, units: list[Unit]) -> None:
        """Takes back units registered by a call that failed (the runtime has not started)."""
        for u in units:
            self.units.remove(u)
            del self._by_name[u.name]
            for e in u._entries:
                self._owner_of.pop(id(e.tensor), None)

    def _register_entries(self, name: str, params: list[_Entry], buffers: list[_Entry],
                          module: torch.nn.Module | None, *, trainable, residency, lookahead, optimizer, lr_scale,
                          weight_decay, no_weight_decay) -> Unit:
        """register() for tensors already collected; refuses before changing anything."""
        if self._core is not None:
            raise _core.InvalidArgument(f"taskswap: register '{name}' before the runtime starts (the first plan or "
                                        "step)")
        if name in self._by_name:
            raise _core.ConfigError(f"taskswap: a unit named '{name}' is already registered")
        if not params:
            raise _core.ConfigError(f"taskswap: '{name}' has no parameters; register a set that has some")
        for e in params + buffers:
            other = self._owner_of.get(id(e.tensor))
            if other is not None:
                raise _core.ConfigError(f"taskswap: '{e.name}' of '{name}' is already in unit '{other}'; a parameter "
                                        "or buffer belongs to one unit")
        dtypes = {e.tensor.dtype for e in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise _core.ConfigError(
                f"taskswap: the parameters of '{name}' are {sorted(map(str, dtypes))}; a unit's parameters share "
                "one dtype of float32, bfloat16 or float16 (register differently typed parts as separate units)")
        dtype = next(iter(dtypes))
        # Buffers of another dtype (BatchNorm's integer num_batches_tracked) stay where torch has them.
        buffers = [e for e in buffers if e.tensor.dtype == dtype]
        trains = [e.tensor.requires_grad for e in params]
        if trainable is None:
            if all(trains) or not any(trains):
                trainable = all(trains)
            else:
                fixed = [e.name for e, t in zip(params, trains) if not t]
                raise _core.ConfigError(
                    f"taskswap: '{name}' mixes parameters that require gradients with some that do not ({fixed[:5]}); "
                    "pass trainable=True (all are trained) or trainable=False (a frozen unit), or register the "
                    "frozen ones as a unit of their own")
        if no_weight_decay is None:
            predicate = lambda n, p: False  # noqa: E731
        elif callable(no_weight_decay):
            predicate = no_weight_decay
        else:
            names = set(no_weight_decay)
            known = {e.name for e in params}
            if names - known:
                raise _core.ConfigError(f"taskswap: no_weight_decay names {sorted(names - known)}, which '{name}' "
                                        f"does not have (it has {sorted(known)[:10]})")
            predicate = lambda n, p: n in names  # noqa: E731
        policy = {"residency": None if residency is None else _choice(_RESIDENCY, residency, "residency"),
                  "lookahead": lookahead,
                  "optimizer": None if optimizer is None else _choice(_PLACEMENT, optimizer, "optimizer"),
                  "lr_scale": lr_scale, "weight_decay": weight_decay}
        unit = Unit(self, name, params, buffers, bool(trainable), policy, predicate, module)
        self._owner_of.update((id(e.tensor), name) for e in unit._entries)
        self.units.append(unit)
        self._by_name[name] = unit
        return unit

    def unit(self, name: str) -> Unit:
        return self._by_name[name]

    def all_pinned_budget(self) -> int:
        """A budget that holds every registered unit pinned (an all-resident baseline): each unit's
        device bytes rounded up to whole granules of the configured device (2 MiB on CUDA), so at
        most a granule per unit above what the runtime's packing needs, and the guarded step's
        bytes where loss scaling or clipping is on."""
        granule = _core.make_device(self.options.device).granularity

        def whole(n: int) -> int:
            return -(-n // granule) * granule

        total = sum(whole(_core.footprint(u.spec(), _core.policy_for(u.spec(), self.options).optimizer).device_bytes)
                    for u in self.units)
        if self.options.scaler.enabled or self.options.optimizer.clip > 0:
            total += whole(_core.step_guard_device_bytes(len(self.units)))
        return total

    # --- start and close ---------------------------------------------------------------------
    def start(self) -> None:
        """Lays out every unit at home (the modules' current values move there), and brings the
        pinned units onto the device. With a communicator: collective. Refused, it changes nothing."""
        if self._core is not None:
            return
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if not self.units:
            raise _core.InvalidArgument("taskswap: register at least one unit before the runtime starts")
        for u in self.units:
            u._check_model()
        specs = [u.spec() for u in self.units]
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
                raise _core.ConfigError(f"taskswap: the comm factory returned {type(comm).__name__}, not a "
                                        "Communicator")
        elif comm is not None and not isinstance(comm, _core.Communicator):
            raise _core.ConfigError(f"taskswap: comm is None, \"config\", \"none\", a factory or a Communicator; "
                                    f"not a {type(comm).__name__} (for a torch process group: nccl_group(pg))")
        core = _core.Runtime(device, options, specs, comm)
        ids = [core.find(u.name) for u in self.units]
        for u, uid in zip(self.units, ids):
            self._write_home(core, u, uid)
        # The modules' values are at home, the runtime is started. The values stay referenced
        # until the call that started the runtime succeeded (_starting); a failure from here on
        # gives them back.
        self._core, self.device = core, device
        # Gradient hooks hand each unit to the reduction as soon as backward completes it, so the
        # allreduce overlaps the rest of backward. Without a communicator there is nothing to
        # overlap (step() follows the backward on the same stream): no hooks, no per-parameter cost.
        self._hooks = core.has_communicator
        self._torch_device = (torch.device("cuda", device.index)
                              if device.kind == _core.Backend.cuda else torch.device("cpu"))
        if not self._at_exit:
            atexit.register(_close_at_exit, weakref.ref(self))
            self._at_exit = True
        try:
            # On the emulated device torch computes on the host, after the step's swap-ins and the
            # last step's updates: the scope's stream runs its work in this thread as it is
            # enqueued (the copy streams stay asynchronous), so no step waits for a worker to wake.
            self._stream = (_core.Stream(device, host_synchronous=True) if device.kind == _core.Backend.emulated
                            else None)
            for u, uid in zip(self.units, ids):
                u.id = uid
                u._placeholders = [self._placeholder(e.tensor.dtype) for e in u._entries]
                for e, empty in zip(u._entries, u._placeholders):
                    e.original = e.tensor.data
                    if not e.state:
                        e.original_grad, e.tensor.grad = e.tensor.grad, None
                    e.tensor.data = empty
                # A unit never trained never requires gradients; a trained one always does (a
                # PEFT adapter that is not active was registered without), so hooks can be set.
                for p in u._params:
                    if p.requires_grad != u.trainable:
                        p.requires_grad_(u.trainable)
                if u.trainable and self._hooks and u._layer is None:  # a streamed layer's own hooks step it
                    for j, p in enumerate(u._params):
                        u._hook_handles.append(p.register_hook(self._make_pre_hook(u)))
                        u._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(u, j)))
            if self._layers:
                self._hook_layers()
        except BaseException:
            self._unstart()
            raise

    def _starting(self):
        """A context for a call that may start the runtime: if the call fails, a runtime it
        started is undone (the modules get their values back, the runtime is unstarted); if it
        succeeds, the values the modules had are let go."""
        return _Starting(self)

    def _unstart(self) -> None:
        """Undoes start(): the modules' tensors get back what they had; the runtime underneath is
        dropped. Nothing has trained yet, so those are the current values."""
        for u in self.units:
            for h in u._hook_handles:
                h.remove()
            u._hook_handles = []
            for e in u._entries:
                if e.original is not None:
                    e.tensor.data = e.original
                    if not e.state:
                        e.tensor.grad = e.original_grad
                    e.original = e.original_grad = None
                if not e.state and e.tensor.requires_grad != e.requires_grad:
                    e.tensor.requires_grad_(e.requires_grad)
            u.id, u._views, u._grad_views, u._param_addr, u._grad_addr = None, [], [], None, None
        self._external.clear()
        self._core = self._stream = self.device = None
        self._scale_view = None
        self._began = False

    @staticmethod
    def _write_home(core: _core.Runtime, u: Unit, uid: int) -> None:
        kinds = ["params"] if u.dtype == torch.float32 or not u.trainable else ["params", "master"]
        with torch.no_grad():
            for kind in kinds:
                for home, e in zip(core.home(uid, kind), u._entries):
                    home.copy_(e.tensor.detach().reshape(home.shape))

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._placeholders.get(dtype)
        if t is None:
            t = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self._torch_device)
        return t

    def close(self, give_back: bool = True) -> None:
        """Ends the runtime. ``give_back`` (the default): every registered parameter and buffer
        gets its current value back (written home first; on the device it had when registered)
        and its ``requires_grad`` as registered, so the model carries on in plain torch. Then this
        object drops its reference to the runtime; the C++ destructor runs once no tensor viewing
        its memory is left (a ``home()`` tensor or an alias kept from a step defers it). At exit
        a runtime still open is closed without giving the values back.
        Raises InvalidArgument inside a step scope; if writing home fails (the device failed),
        the modules get the values home has and the error is raised after."""
        if self._scope is not None:
            raise _core.InvalidArgument("taskswap: close() inside a step scope; leave the scope first")
        self._closed = True
        if self._core is None:
            return
        failure = None
        if give_back:
            try:
                self._core.flush()
            except BaseException as e:  # the values home has are given back, then it is raised
                failure = e
        for u in self.units:
            for h in u._hook_handles:
                h.remove()
            u._hook_handles = []
            home = self._core.home(u.id, "params") if give_back else [None] * len(u._entries)
            for e, h in zip(u._entries, home):
                e.original = e.original_grad = None
                if give_back:
                    if not e.state:
                        e.tensor.grad = None
                    e.tensor.data = h.reshape(e.shape).to(e.device, copy=True)
                    if not e.state and e.tensor.requires_grad != e.requires_grad:
                        e.tensor.requires_grad_(e.requires_grad)
            u._views, u._grad_views, u._param_addr, u._grad_addr = [], [], None, None
        self._external.clear()
        self._stream = None
        self._scale_view = None
        self._core = None  # the last reference: views that still alias its memory keep it alive
        if failure is not None:
            raise failure

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def core(self) -> _core.Runtime:
        """The runtime underneath (taskswap._core.Runtime), started."""
        if self._core is None:
            with self._starting():
                pass
        return self._core

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def world_size(self) -> int:
        return self.core.world_size

    # --- plan and steps ---------------------------------------------------------------------
    def plan(self, steps: Iterable[Sequence[Unit | _Use]], *, forward_only: bool = False) -> None:
        """Appends upcoming steps, each the units it acquires in order (``unit.frozen()`` for a
        forward-only use; a unit registered ``trainable=False`` is always used frozen). Checks
        that each step fits the budget; a refused plan changes nothing.

        ``forward_only``: these steps run forward passes alone (evaluation under ``no_grad``): the
        streamed layers are planned for their forward uses only, so the prefetch brings no layer
        whole for a backward that will not come, and with a communicator a trained layer is not
        updated in them (planned for its backward, it would be, with zeros from this rank)."""
        plan = [[self._own(_use_of(e)) for e in step] for step in steps]
        with self._starting():
            self._core.plan([self._planned(step, forward_only) for step in plan])
            self._began = True

    def _planned(self, uses: list[_Use], forward_only: bool = False) -> list[tuple[int, int]]:
        """A step's plan: its units, then the streamed layers forward (each released before the next)
        and, unless ``forward_only``, backward (each released once the layer below is acquired, as
        the hooks do)."""
        entries = [(e.unit.id, e.kind) for e in uses]
        above = None
        for u in self._layers:
            entries += [(u.id, _FROZEN), (u.id, _RELEASE)]
        for u in [] if forward_only else reversed(self._layers):
            entries.append((u.id, _TRAIN if u.trainable else _FROZEN))
            if above is not None:
                entries.append((above.id, _RELEASE))
            above = u
        if above is not None:
            entries.append((above.id, _RELEASE))
        return entries

    def _own(self, use: _Use) -> _Use:
        if use.unit._owner is not self:
            raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' belongs to another runtime")
        if use.kind == _TRAIN and not use.unit.trainable:
            raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' was registered trainable=False; it is "
                                        "used frozen only")
        if use.unit._layer is not None:
            raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' is a streamed layer (register_layers): "
                                        "its hooks acquire it in forward and backward; leave it out of plan() and "
                                        "step()")
        return use

    def step(self, *units: Unit | _Use, micro_batches: int = 1) -> _StepScope:
        """A step scope: acquires ``units`` in order on torch's current stream, aliases their
        parameters and gradients into the unit slabs; on exit, gradients ready, AdamW step,
        release, end of step. ``micro_batches``: backward passes accumulated before the reduction
        (gradient accumulation: call backward that many times inside the scope)."""
        if micro_batches < 1:
            raise _core.InvalidArgument(f"taskswap: micro_batches is at least 1, not {micro_batches}")
        if micro_batches > 1 and any(u.trainable for u in self._layers):
            raise _core.InvalidArgument(
                f"taskswap: micro_batches={micro_batches} with trained streamed layers: a streamed layer is stepped "
                "as soon as one backward pass completes its gradients; sum the micro-batches' losses and call "
                "backward once, or register the layers with register()")
        return _StepScope(self, list(map(_use_of, units)), micro_batches)

    def _current_stream(self) -> _core.Stream:
        if self._stream is not None:
            return self._stream
        handle = torch.cuda.current_stream(self._torch_device).cuda_stream
        s = self._external.get(handle)
        if s is None:
            s = self._external[handle] = _core.external_stream(self.device, handle)
        return s

    def _hook_layers(self) -> None:
        """The streamed layers' hooks (register_layers)."""
        if (self.options.scaler.enabled or self.options.optimizer.clip > 0) and any(u.trainable for u in self._layers):
            raise _core.InvalidArgument(
                f"taskswap: the trained layers '{self._layers[0].name}'.. cannot stream with loss scaling or "
                "clipping: a guarded update waits for the step's end, so each trained layer would stay on the device "
                "to it. Stream frozen layers (trainable=False), or turn off [scaler] and [optimizer] clip")
        # Autograd keeps views of a layer's parameters (nn.Linear saves weight.t()) at the address
        # its forward saw, so the backward's acquisition must find the layer there again. A unit
        # keeps its slot's address, except one of at most half a device granule, which the pool
        # packs into a shared granule at any free place.
        granule = self.device.granularity
        for u in self._layers:
            smallest = _core.footprint(u.spec(), _core.OptimizerPlacement.host).frozen_device_bytes
            if -(-smallest // 256) * 256 * 2 <= granule:
                raise _core.InvalidArgument(
                    f"taskswap: the streamed layer '{u.name}' has {smallest} bytes of parameters, at most half a "
                    f"device granule ({granule} bytes): such units share granules and may come back at another "
                    "address for their backward, where autograd's saved views of their parameters would not follow. "
                    "Stream larger layers (group small ones into one module), or register them with register()")
        ref = weakref.ref(self)  # the module's hooks must not keep the runtime alive

        def scope_of():
            rt = ref()
            return rt._scope if rt is not None else None

        for u in self._layers:
            def pre_hook(module, args, kwargs, u=u):
                scope = scope_of()
                if scope is not None:
                    scope._layer_forward(u)

            def post_hook(module, args, kwargs, output, u=u):
                scope = scope_of()
                if scope is not None:
                    scope._layer_forward_done(u, (args, kwargs), output)

            def grad_hook(param, u=u):
                scope = scope_of()
                if scope is not None:
                    scope._layer_grad(u)

            m = u._layer_module
            u._hook_handles += [m.register_forward_pre_hook(pre_hook, with_kwargs=True),
                                m.register_forward_hook(post_hook, with_kwargs=True)]
            if u.trainable:
                u._hook_handles += [p.register_post_accumulate_grad_hook(grad_hook) for p in u._params]

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
            _repair_grad(u._params[j], u._grad_views[j])
            u._fired += 1
            if u._fired == len(u._params):
                u._fired = 0
                u._passes += 1
                if u._passes == scope.micro_batches:
                    # On the stream autograd accumulated on (the node's; it may not be the scope's)
                    rt._core.grads_ready(u.id, rt._current_stream())
                    u._ready = True
                    u._handed_versions = [g._version for g in u._grad_views]
        return hook

    def _attach(self, u: Unit, kind: int, addrs: tuple[int, int], forward: bool = False) -> None:
        """Points the unit's tensors at its device views. ``forward``: a streamed layer's forward
        use (parameters alone), which autograd records for a trained layer all the same."""
        core = self._core
        # Every view first (the scope checked the model): a failure then leaves the tensors as they were.
        if u._param_addr != addrs[0]:
            u._views, u._param_addr = u._shaped(core.param_tensors(u.id)), addrs[0]
        if kind == _TRAIN and u._grad_addr != addrs[1]:
            u._grad_views, u._grad_addr = u._shaped(core.grad_tensors(u.id))[:len(u._params)], addrs[1]
        try:
            for t, v in zip(u._tensors, u._views):
                t.data = v
            if kind == _FROZEN:
                if forward and u.trainable:  # its gradient slab comes with the backward's acquisition
                    return
                for p in u._params:
                    if p.requires_grad:
                        p.requires_grad_(False)
                return
            for p, g in zip(u._params, u._grad_views):
                if not p.requires_grad:
                    p.requires_grad_(True)
                p.grad = g
            u._fired = u._passes = 0
            u._ready = False
            u._handed_versions = None
        except BaseException:
            self._detach(u, kind)
            raise

    @staticmethod
    def _detach(u: Unit, kind: int) -> None:
        """Points the unit's tensors back at empty placeholders."""
        for p in u._params:
            p.grad = None
        for t, empty in zip(u._tensors, u._placeholders):
            t.data = empty
        if kind == _FROZEN and u.trainable:
            for p in u._params:
                p.requires_grad_(True)

    @staticmethod
    def _repair_grads(u: Unit) -> None:
        for p, g in zip(u._params, u._grad_views):
            if p.grad is not g:  # the alias is intact: torch returns the object it was given
                _repair_grad(p, g)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every unit's parameters and buffers from the home copies, keyed ``"<unit>.<name>"``
        (CPU tensors, copies). Writes dirty units back first (synchronises)."""
        core = self.core
        self._expect_between_steps("state_dict")
        self._began = True  # flush() brings the pinned units onto the device
        core.flush()
        out = {}
        for u in self.units:
            for e, t in zip(u._entries, core.home(u.id, "params")):
                out[f"{u.name}.{e.name}"] = t.clone().view(e.shape)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Sets every unit's parameters and buffers (and f32 master copy) from ``state``, keyed as
        state_dict gives them: every key, no other, each with its tensor's shape. Before the
        first plan, step, state_dict or checkpoint save (units on the device would not see it).
        AdamW moments and step counts keep their values, and a bf16/f16 unit's master copy is the
        loaded value: a checkpoint is the exact resume. Refused, it changes nothing."""
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if self._began:
            raise _core.InvalidArgument("taskswap: load_state_dict after the first plan, step, state_dict or "
                                        "checkpoint save cannot reach units already on the device; call it "
                                        "before, or use load_checkpoint")
        expected = {f"{u.name}.{e.name}": (u, j) for u in self.units for j, e in enumerate(u._entries)}
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise _core.InvalidArgument(f"taskswap: load_state_dict: missing keys {missing[:5]}, unexpected keys "
                                        f"{unexpected[:5]}")
        for key, (u, j) in expected.items():
            if tuple(state[key].shape) != u._entries[j].shape:
                raise _core.InvalidArgument(f"taskswap: load_state_dict: '{key}' has shape {tuple(state[key].shape)}, "
                                            f"the tensor {u._entries[j].shape}")
        with torch.no_grad():
            if self._core is None:
                for key, (u, j) in expected.items():
                    u._entries[j].tensor.copy_(state[key])
                return
            for u in self.units:
                kinds = ["params"] if u.dtype == torch.float32 or not u.trainable else ["params", "master"]
                for kind in kinds:
                    for home, e in zip(self._core.home(u.id, kind), u._entries):
                        home.copy_(state[f"{u.name}.{e.name}"].reshape(home.shape))

    def save_checkpoint(self, path: str | os.PathLike, user: dict[str, str] | None = None) -> None:
        """Writes every unit's home state (parameters, master, moments, steps) and the plan
        position to the directory ``path``, atomically (see docs/reliability.md)."""
        self._expect_between_steps("save_checkpoint")
        core = self.core
        self._began = True  # it writes dirty units back, bringing the pinned units onto the device
        core.save_checkpoint(os.fspath(path), user or {})

    def load_checkpoint(self, path: str | os.PathLike) -> tuple[int, dict[str, str]]:
        """Restores every unit from a checkpoint before the first plan or step; returns
        (steps done, the trainer's own entries). Refused, it changes nothing."""
        with self._starting():
            steps_done, user, _ = self._core.load_checkpoint(os.fspath(path))
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


class _Starting:
    """See Runtime._starting."""

    __slots__ = ("rt", "started_here")

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.started_here = False

    def __enter__(self) -> _Starting:
        if self.rt._core is None:
            self.rt.start()
            self.started_here = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.started_here:
            return
        if exc_type is not None:
            self.rt._unstart()
            return
        for u in self.rt.units:
            for e in u._entries:
                e.original = e.original_grad = None


class _StepScope:
    __slots__ = ("rt", "uses", "micro_batches", "kinds", "stream", "acquired", "attached", "stats", "_starting",
                 "layers", "stepped_layers", "rerunning", "awaiting", "ran", "exited")

    def __init__(self, rt: Runtime, uses: list[_Use], micro_batches: int):
        self.rt = rt
        self.uses = uses
        self.micro_batches = micro_batches
        self.kinds: dict[int, int] = {}
        self.stream = None
        self.acquired: list[_Use] = []
        self.attached: list[_Use] = []
        self.stats: _core.StepStats | None = None
        self._starting: _Starting | None = None
        # The streamed layers held now: unit id -> (unit, held for its forward, use kind).
        self.layers: dict[int, tuple[Unit, bool, int]] = {}
        self.stepped_layers: set[int] = set()  # trained layers updated in this step
        # Layers acquired by a forward inside backward (reentrant checkpointing): running it now, or
        # run and held for their backward, which has not begun.
        self.rerunning: set[int] = set()
        self.awaiting: set[int] = set()
        self.ran: set[int] = set()  # layers whose forward ran in this step
        self.exited = False  # the layers not run were skipped (exit_early, or the backward began)

    def exit_early(self) -> None:
        """The forward pass left the streamed layers early (an early exit): the layers it has not
        run will not run in this step. Their planned uses are dropped now (``runtime::skip`` in
        C++), so the prefetch brings the layers the backward needs instead of keeping room for the
        skipped ones. Without a communicator the backward's first layer does this anyway (a layer
        that still runs after it is fetched on demand, never wrong); called as the forward leaves
        the layers, it also lets that first layer be prefetched. With a communicator only this
        call does it (a layer skipped and then run would be off the plan, which is refused), and a
        skipped trained layer takes its update now, with zero gradients from this rank, as it
        would at the step's end."""
        if self.rt._scope is not self:
            raise _core.InvalidArgument("taskswap: call exit_early() inside its step scope")
        if self.exited:
            return
        self.exited = True
        skipped = [u.id for u in reversed(self.rt._layers) if u.id not in self.ran and u.id not in self.layers]
        if skipped:  # the last layer first: the order their gradients would have been ready in
            self.rt._core.skip(skipped)

    def __enter__(self) -> _StepScope:
        rt = self.rt
        if rt._scope is not None:
            raise _core.InvalidArgument("taskswap: a step scope is already open; steps do not nest")
        uses = self.uses
        for use in uses:  # before anything is started or acquired: a bad scope changes nothing
            u = use.unit
            if u._owner is not rt or (use.kind == _TRAIN and not u.trainable) or u._layer is not None:
                rt._own(use)
            if u._holders:
                u._check_model()
            if use.frozen and u._stat_modules:
                u._check_eval()
        if len(uses) > 1 and len({id(use.unit) for use in uses}) != len(uses):
            seen: set[int] = set()
            for use in uses:
                if id(use.unit) in seen:
                    raise _core.InvalidArgument(f"taskswap: unit '{use.unit.name}' is named twice in one step")
                seen.add(id(use.unit))
        core = rt._core
        if core is None:
            self._starting = rt._starting()
            self._starting.__enter__()
            core = rt._core
        if rt._hooks and rt._layers and self.micro_batches > 1:
            self._started(_core.InvalidArgument)
            raise _core.InvalidArgument(
                f"taskswap: micro_batches={self.micro_batches} with streamed layers and a communicator: a step's plan "
                "has one forward and one backward use of each layer, and with a communicator every use is planned; "
                "sum the micro-batches' losses and call backward once")
        if rt._hooks:  # what the gradient hooks look up
            self.kinds = {use.unit.id: use.kind for use in uses}
        stream = self.stream = rt._stream or rt._current_stream()
        rt._scope = self
        rt._began = True
        acquired, attached = self.acquired, self.attached
        try:
            addrs = []
            for use in uses:
                addrs.append(core.acquire(use.unit.id, stream, use.frozen))
                acquired.append(use)
            attach = rt._attach
            for use, a in zip(uses, addrs):
                attach(use.unit, use.kind, a)
                attached.append(use)
        except BaseException as e:
            try:
                self._abandon()
            finally:
                self._started(type(e))
            raise
        if self._starting is not None:
            self._started(None)
        return self

    def _started(self, failure) -> None:
        """The scope's first part is over: a runtime this scope started is kept (or, failed, undone)."""
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.__exit__(failure, None, None)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abandon()
            return
        core, stream = self.rt._core, self.stream
        changed = None
        stepped = set()
        try:
            self._finish_layers()
            for use in self.acquired:
                if use.kind != _TRAIN:
                    continue
                u = use.unit
                # Units the hooks handed to the reduction already must still alias their slabs;
                # the others are repaired now. step() implies grads_ready().
                if u._ready:
                    if u._grads_changed():
                        changed = (changed or []) + [u.name]
                else:
                    for p, g in zip(u._params, u._grad_views):
                        if p.grad is not g:  # the alias is intact: torch returns the object it was given
                            _repair_grad(p, g)
                stepped.add(u.id)  # before the call: a step that fails halfway is not retried
                core.step(u.id, stream)
        except BaseException:
            self._abandon(stepped)
            raise
        self._end()
        if changed:
            raise _core.InvalidArgument(
                f"taskswap: the gradients of {changed} were replaced or changed in place (zero_grad, clipping, "
                "scaling) after the last backward pass had handed them to the reduction, which may have been "
                "reading them; the step used them as the reduction found them. With a communicator, change "
                "gradients before the last backward pass (or raise micro_batches); for global-norm clipping set "
                "[optimizer] clip")

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
                for u, _, kind in self.layers.values():
                    if kind == _TRAIN:
                        for g in u._grad_views:
                            g.zero_()
        except BaseException as e:  # kept, the cleanup goes on
            first = e
        if rt._hooks:
            for use in self.acquired:
                if use.kind == _TRAIN and use.unit.id not in stepped:
                    try:
                        core.step(use.unit.id, self.stream)
                    except BaseException as e:  # each unit is stepped
                        first = first or e
        self._end(first)

    def _end(self, first: BaseException | None = None) -> None:
        """Releases every unit and ends the step, each whatever the other does; raises the first
        error (`first`: one from before) after both."""
        try:
            self._release()
        except BaseException as e:  # the step still ends
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
        core, stream = self.rt._core, self.stream
        for u, _, _ in sorted(self.layers.values(), key=lambda held: -held[0]._layer):
            try:
                self._layer_release(u)
            except BaseException as e:  # every unit is released
                first = first or e
        for use in reversed(self.acquired):
            try:
                core.release(use.unit.id, stream)
            except BaseException as e:  # every unit is released
                first = first or e
        try:
            detach = Runtime._detach
            for use in self.attached:
                detach(use.unit, use.kind)
        finally:
            self.rt._scope = None
        if first is not None:
            raise first

    # --- streamed layers (Runtime.register_layers) -------------------------------------------
    def _layer_stream(self) -> _core.Stream:
        rt = self.rt
        return rt._stream or rt._current_stream()  # in backward: the stream autograd runs the node on

    def _layer_acquire(self, u: Unit, kind: int, forward: bool) -> None:
        rt = self.rt
        addrs = rt._core.acquire(u.id, self._layer_stream(), kind == _FROZEN)
        self.layers[u.id] = (u, forward, kind)
        try:
            rt._attach(u, kind, addrs, forward=forward)
        except BaseException:
            self._layer_release(u)
            raise

    def _layer_release(self, u: Unit) -> None:
        _, _, kind = self.layers.pop(u.id)
        self.rerunning.discard(u.id)
        self.awaiting.discard(u.id)
        try:
            self.rt._core.release(u.id, self._layer_stream())
        finally:
            Runtime._detach(u, kind)

    def _layer_forward(self, u: Unit) -> None:
        """Forward pre-hook: the layer's forward use, unless it is held (a forward re-run inside its
        backward by non-reentrant activation checkpointing uses the backward's acquisition). A
        forward inside backward (reentrant checkpointing re-runs it there, and its backward follows
        at once) is the layer's backward use: acquired as its backward is planned, and kept. In a
        checkpoint over several layers the second re-run comes before the first one's backward:
        from there on, the old way (fetched for the forward, again for the backward; off the plan,
        which a communicator refuses)."""
        if u.id in self.layers:
            return
        if u._holders:
            u._check_model()
        if _in_backward():
            if not self.awaiting:
                self._layer_backward(u)
                self.rerunning.add(u.id)
                return
            if self.rt._hooks:
                raise _core.InvalidArgument(
                    f"taskswap: the streamed layer '{u.name}' runs its forward again inside backward before the "
                    f"backward of '{self.layers[next(iter(self.awaiting))][0].name}': a checkpoint over several "
                    "streamed layers, whose uses the plan does not foresee, and with a communicator every use is "
                    "planned; checkpoint each streamed layer on its own (as transformers' "
                    "gradient_checkpointing_enable does), or use non-reentrant checkpointing")
        if u._stat_modules:  # the forward use is a frozen one: running statistics would not be kept
            u._check_eval()
        self._layer_acquire(u, _FROZEN, forward=True)
        self.ran.add(u.id)

    def _layer_forward_done(self, u: Unit, inputs, output) -> None:
        """Forward hook: releases the layer. If backward will pass through it, the first of its
        outputs' gradients to arrive acquires it again (the backward of that output's path needs
        the parameters: an auxiliary output's, a router loss, may come before the hidden state's;
        autograd runs nodes in reverse creation order, so it comes just before the layer's own
        backward), and a frozen layer is released once its inputs' gradients are in, when its
        backward is over. A forward re-run inside backward keeps the layer for that backward."""
        held = self.layers.get(u.id)
        if held is None:
            return
        rerun = u.id in self.rerunning
        if not rerun and not held[1]:
            return
        self.rerunning.discard(u.id)
        outputs = [t for t in _tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if rerun:
            if outputs:
                self.awaiting.add(u.id)
        else:
            self._layer_release(u)
        if not outputs:
            return

        def before_backward(_grad):
            self._layer_backward(u)

        for t in outputs:
            t.register_hook(before_backward)
        if not u.trainable:
            self._release_after_backward(u, inputs)

    def _release_after_backward(self, u: Unit, inputs) -> None:
        """A frozen layer's backward is over once its inputs' gradients are in: released then (one
        whose inputs need none is held to the scope's end: nothing says when its backward ends)."""
        sources = [t for t in _tensors_in(inputs) if t.requires_grad]
        if not sources:
            return
        left = [len(sources)]

        def input_done(_grad):  # (each input's gradient is computed once per backward pass)
            left[0] -= 1
            if left[0] == 0:
                left[0] = len(sources)
                self._layer_backward_done(u)

        for t in sources:
            t.register_hook(input_done)

    def _layer_backward(self, u: Unit) -> None:
        """The gradients of the layer's outputs are computed: acquires it for its backward."""
        if self.rt._scope is not self:
            raise _core.InvalidArgument(f"taskswap: backward reached the streamed layer '{u.name}' after its step "
                                        "scope closed; call backward inside the step scope")
        if u.id in self.stepped_layers:
            raise _core.InvalidArgument(
                f"taskswap: a second backward pass reached the streamed layer '{u.name}' after its update (a trained "
                "streamed layer is stepped as soon as one backward pass completes its gradients); sum the losses and "
                "call backward once per step")
        self.awaiting.discard(u.id)
        if not self.exited and not self.rt._hooks:  # the layers not run will not come: give their room
            self.exit_early()
        if u.id not in self.layers:
            self._layer_acquire(u, _TRAIN if u.trainable else _FROZEN, forward=False)

    def _layer_backward_done(self, u: Unit) -> None:
        """The gradients of a frozen layer's inputs are computed: its backward is over."""
        held = self.layers.get(u.id)
        if held is not None and not held[1]:
            self._layer_release(u)

    def _layer_grad(self, u: Unit) -> None:
        """A trained layer's parameter has its gradient: once all have, the layer is stepped and
        released while backward goes on below it."""
        held = self.layers.get(u.id)
        if held is None or held[1]:
            return
        u._fired += 1
        if u._fired == len(u._params):
            u._fired = 0
            self._step_layer(u)

    def _step_layer(self, u: Unit) -> None:
        """Steps a trained layer and releases it."""
        Runtime._repair_grads(u)  # autograd may have replaced a gradient (create_graph)
        self.stepped_layers.add(u.id)
        self.rt._core.step(u.id, self._layer_stream())
        self._layer_release(u)

    def _finish_layers(self) -> None:
        """At the scope's end: a trained layer still held (one of its parameters got no gradient) is
        stepped as a named unit is; the other layers are released with the scope's units."""
        for u, _, kind in sorted(self.layers.values(), key=lambda held: -held[0]._layer):
            if kind == _TRAIN:
                self._step_layer(u)
