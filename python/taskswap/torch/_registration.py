# SPDX-License-Identifier: Apache-2.0
"""Runtime's registration: modules, parameter sets and streamed layers become units, before the
runtime starts."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .. import _core
from ._activations import Activations
from ._units import _DTYPES, _PLACEMENT, _RESIDENCY, Unit, _choice, _Entry, _module_entries, _set_entries


class _Registration:
    """Runtime's methods that register units (Runtime inherits them; the state is Runtime's)."""

    def register(self, params, name: str, *, trainable: bool | None = None, residency: str | None = None,
                 lookahead: int | None = None, optimizer: str | None = None, lr_scale: float | None = None,
                 weight_decay: float | None = None,
                 no_weight_decay: Iterable[str] | Callable[[str, torch.nn.Parameter], bool] | None = None) -> Unit:
        """Registers a set of parameters as the unit ``name``.

        ``params`` is a module (its ``named_parameters()``, shared ones once, and its buffers, which
        travel with the unit as state tensors: in a trained unit those of the parameters' dtype), a dict
        ``{name: nn.Parameter}`` or an iterable of ``(name, nn.Parameter)`` pairs (any names, the
        parameters of any modules). A trained unit's parameters share one dtype (float32, bfloat16,
        float16); a unit with ``trainable=False`` may hold tensors of any dtypes (int8 weights with a
        float scale, fp8), packed where they differ. Tensor subclasses
        (torchao's, bitsandbytes') are refused: their inner tensors cannot be aliased.

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

    def register_activations(self, host_bytes: int, *, block_bytes: int = 4 << 20, min_bytes: int = 1 << 20,
                             keep_last: int = 1, every_step: bool = True, prefix: str = "act"):
        """Offloads the steps' saved activations (the tensors autograd keeps for the backward pass)
        to ``host_bytes`` of pinned host memory, in activation blocks of ``block_bytes`` registered as
        units ``{prefix}/0``.. (each counted in the device budget while it is on the device).

        In a step (every step, or those opened with ``step(offload=True)`` when ``every_step`` is
        False) a saved tensor of at least ``min_bytes`` that autograd computed is copied into the
        blocks on torch's current stream; a full block goes home on the runtime's copy stream, and
        the backward pass finds it brought back in the plan's order. Kept where they are: smaller
        tensors, parameters, buffers and inputs, what the last ``keep_last`` streamed layers and
        anything after them save, what a forward re-run in backward saves (checkpointing), and what
        does not fit in the blocks left (said once). Plans made after a step that offloaded have
        the blocks where that step used them; with a communicator a step offloads into those alone."""
        if self._core is not None:
            raise _core.InvalidArgument("taskswap: register_activations before the runtime starts (the first plan "
                                        "or step)")
        if self._activations is not None:
            raise _core.InvalidArgument("taskswap: register_activations once per runtime")
        for what, value in (("host_bytes", host_bytes), ("block_bytes", block_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise _core.ConfigError(f"taskswap: register_activations {what} is a positive number of bytes, "
                                        f"not {value!r}")
        if host_bytes < block_bytes:
            raise _core.ConfigError(f"taskswap: register_activations host_bytes={host_bytes} holds no block of "
                                    f"block_bytes={block_bytes}; give at least one block's bytes")
        if keep_last < 0 or min_bytes < 0:
            raise _core.ConfigError(f"taskswap: register_activations keep_last ({keep_last}) and min_bytes "
                                    f"({min_bytes}) are at least 0")
        self._activations = Activations(self, host_bytes // block_bytes, block_bytes, min_bytes, keep_last, every_step,
                                        prefix)
        return self._activations

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
        for e in params + buffers:
            if type(e.tensor) not in (torch.Tensor, torch.nn.Parameter):
                raise _core.ConfigError(
                    f"taskswap: '{e.name}' of '{name}' is a {type(e.tensor).__name__}, a tensor subclass (as torchao's "
                    "and bitsandbytes' quantized weights are); taskswap points plain tensors at its memory and "
                    "cannot alias a subclass's inner tensors. Keep the quantized data and its scales as plain "
                    "tensors (parameters or buffers) and dequantize in forward (docs/python.md, quantized bases)")
        dtypes = {e.tensor.dtype for e in params}
        trains = [e.tensor.requires_grad for e in params]
        floating = len(dtypes) == 1 and next(iter(dtypes)) in _DTYPES
        if not floating:
            if trainable or (trainable is None and any(trains)):
                raise _core.ConfigError(
                    f"taskswap: the parameters of '{name}' are {sorted(map(str, dtypes))}; a trained unit's "
                    "parameters share one dtype of float32, bfloat16 or float16 (register differently typed parts "
                    "as separate units; a unit with trainable=False may hold tensors of any dtypes)")
            trainable = False
        if trainable is None:
            if all(trains) or not any(trains):
                trainable = all(trains)
            else:
                fixed = [e.name for e, t in zip(params, trains) if not t]
                raise _core.ConfigError(
                    f"taskswap: '{name}' mixes parameters that require gradients with some that do not ({fixed[:5]}); "
                    "pass trainable=True (all are trained) or trainable=False (a frozen unit), or register the "
                    "frozen ones as a unit of their own")
        if trainable:
            # Buffers of another dtype (BatchNorm's integer num_batches_tracked) stay where torch
            # has them; a frozen unit carries every buffer (packed where their dtypes differ).
            buffers = [e for e in buffers if e.tensor.dtype == next(iter(dtypes))]
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
        """A budget that holds every registered unit pinned (an all-resident baseline), as the
        runtime packs pinned units (``taskswap.all_pinned_budget``): their device bytes at 256-byte
        offsets in whole granules of the configured device, and the guarded step's where loss
        scaling or clipping is on."""
        return _core.all_pinned_budget(self.options, [u.spec() for u in self.units])
