# SPDX-License-Identifier: Apache-2.0
"""Units: the sets of tensors a trainer registers, how a step uses them (trained or frozen), and
what points a unit's tensors at its device views or back at empty placeholders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

import torch

from .. import _core

if TYPE_CHECKING:
    from ._runtime import Runtime

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

    __slots__ = ("name", "tensor", "owner", "attr", "state", "shape", "dtype", "requires_grad", "device", "original",
                 "original_grad")

    def __init__(self, name: str, tensor: torch.Tensor, owner: torch.nn.Module | None, attr: str | None,
                 state: bool):
        self.name = name
        self.tensor = tensor
        self.owner = owner
        self.attr = attr
        self.state = state
        self.shape = tuple(tensor.shape)  # a 0-d tensor is a tensor of [1] in the unit
        self.dtype = tensor.dtype
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
        # A trained unit's parameters share one float dtype. A frozen unit of other or mixed
        # dtypes (int8 weights with a float scale) is packed: the runtime holds each tensor as
        # raw bytes at a 64-byte boundary, and its views are those bytes read as the tensor's dtype.
        self._packed = len({e.dtype for e in self._entries}) > 1 or params[0].dtype not in _DTYPES
        self.dtype = None if self._packed else params[0].dtype
        self._no_decay = [bool(no_weight_decay(e.name, e.tensor)) for e in params]
        self.id: int | None = None
        self._param_addr = None
        self._grad_addr = None
        self._grad_views: list[torch.Tensor] = []  # the parameters' gradients
        # What a step's attach and detach assign, paired once (set_views, set_placeholders), not each step:
        self._alias: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its device view)
        self._grad_alias: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient's view)
        self._empty: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its placeholder)
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

    def _set_views(self, views: list[torch.Tensor], addr) -> None:
        """The unit's tensors' device views, in spec order, at the slab address `addr` (none: [], None)."""
        self._param_addr = addr
        self._alias = list(zip(self._tensors, views))

    def _set_grad_views(self, views: list[torch.Tensor], addr) -> None:
        """The parameters' gradient views, at the gradient slab address `addr` (none: [], None)."""
        self._grad_views, self._grad_addr = views, addr
        self._grad_alias = list(zip(self._params, views))

    def _set_placeholders(self, placeholders: list[torch.Tensor]) -> None:
        self._placeholders = placeholders
        self._empty = list(zip(self._tensors, placeholders))

    def _grads_changed(self) -> bool:
        """After the hooks handed the gradients to the reduction: replaced, or changed in place."""
        return (any(p.grad is None or p.grad.data_ptr() != g.data_ptr() for p, g in self._grad_alias)
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
        if self._packed:  # each tensor as [shape..., bytes per element] of raw bytes, its dtype in its name
            tensors = [_core.TensorSpec(f"{e.name}:{str(e.dtype).removeprefix('torch.')}",
                                        [*(e.shape or (1,)), e.dtype.itemsize], state=e.state)
                       for e in self._entries]
            return _core.UnitSpec(self.name, tensors, _core.DType.u8, trainable=False)
        tensors = [_core.TensorSpec(e.name, list(e.shape) or [1], nd)
                   for e, nd in zip(self._entries[:n], self._no_decay)]
        tensors += [_core.TensorSpec(e.name, list(e.shape) or [1], state=True) for e in self._entries[n:]]
        return _core.UnitSpec(self.name, tensors, _DTYPES[self.dtype], trainable=self.trainable)

    def _shaped(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The runtime's tensors of this unit (device views or home copies) as the model's tensors."""
        if self._packed:
            return [t.view(e.dtype).view(e.shape) for t, e in zip(tensors, self._entries)]
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


def _detach(u: Unit, kind: int) -> None:
    """Points the unit's tensors back at empty placeholders."""
    for p in u._params:
        p.grad = None
    for t, empty in u._empty:
        t.data = empty
    if kind == _FROZEN and u.trainable:
        for p in u._params:
            p.requires_grad_(True)


def _repair_grads(u: Unit) -> None:
    for p, g in u._grad_alias:
        if p.grad is not g:  # the alias is intact: torch returns the object it was given
            _repair_grad(p, g)
