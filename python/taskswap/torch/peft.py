# SPDX-License-Identifier: Apache-2.0
"""taskswap for PEFT models: one unit per adapter, the frozen base weights as units that cost
their parameters alone.

An adapter of a PEFT model ("task7") is not one module: it is a ``lora_A``/``lora_B`` pair in
every adapted projection of every layer (``lora_A["task7"]``, ...). ``register`` gathers each
adapter's parameters, wherever they are, into one unit, and the base model's frozen weights into
units registered ``trainable=False`` (one per decoder layer, or one in all). A step then
activates one adapter and acquires the base and that adapter; the other adapters hold no memory::

    model = get_peft_model(base, LoraConfig(...), adapter_name="task0")
    for t in range(1, 64):
        model.add_adapter(f"task{t}", LoraConfig(...))
    rt = taskswap.torch.Runtime("taskswap.toml")
    adapters = taskswap.torch.peft.register(rt, model)            # units "base/0".., "adapter/task0"..
    rt.plan([adapters.uses(f"task{t}") for t in upcoming])
    for t, batch in zip(upcoming, loader):
        with adapters.step(f"task{t}"):                          # set_adapter, then rt.step(...)
            model(**batch).loss.backward()

``model.set_adapter(name)`` followed by ``rt.step(*adapters.uses(name))`` works too: a step makes
the adapters it trains require gradients. ``adapters.step`` switches the active adapter without
PEFT's walk over every adapter of every layer (milliseconds with many adapters).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from typing import Sequence

import torch

from .. import _core
from ._runtime import Runtime
from ._scope import _StepScope
from ._units import Unit, _Entry, _module_entries

__all__ = ["Adapters", "register"]


def _adapter_holders(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that hold adapter weights by adapter name: PEFT's tuner layers (LoRA's
    ``lora_A``, ``lora_B``, ...) and auxiliary wrappers (``modules_to_save``); each names its
    containers in ``adapter_layer_names``."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(type(m), "adapter_layer_names", None), tuple) and m.adapter_layer_names]


def _adapter_entries(model: torch.nn.Module) -> dict[str, list[_Entry]]:
    """Every adapter's parameters, by adapter name, named by their place in the model."""
    out: dict[str, list[_Entry]] = defaultdict(list)
    for mname, holder in _adapter_holders(model):
        prefix = f"{mname}." if mname else ""
        for attr in holder.adapter_layer_names:
            container = getattr(holder, attr, None)
            if isinstance(container, torch.nn.ModuleDict):
                for key, sub in container.items():
                    params, _ = _module_entries(sub)
                    for e in params:
                        e.name = f"{prefix}{attr}.{key}.{e.name}"
                    out[key] += params
            elif isinstance(container, torch.nn.ParameterDict):
                for key, p in container.items():
                    out[key].append(_Entry(f"{prefix}{attr}.{key}", p, container, key, False))
    return dict(out)


def _layer_list(model: torch.nn.Module, adapter_ids: set[int]) -> tuple[str, torch.nn.ModuleList] | None:
    """The model's list of decoder layers: the ModuleList holding the most base parameters."""
    best, best_count = None, 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
            count = sum(p.numel() for p in m.parameters() if id(p) not in adapter_ids)
            if count > best_count:
                best, best_count = (name, m), count
    return best


class Adapters:
    """The units ``register`` made: ``base`` (never trained) and one per adapter (``units``)."""

    def __init__(self, rt: Runtime, model: torch.nn.Module, base: list[Unit], units: dict[str, Unit]):
        self.rt = rt
        self.model = model
        self.base = base
        self.units = units
        self._tuners = [m for _, m in _adapter_holders(model) if hasattr(m, "_active_adapter")]
        # The fast switch sets what PEFT's set_adapter sets on each tuner layer (the active names;
        # requires_grad is the step's business); anything else (auxiliary wrappers such as
        # modules_to_save, a merged layer) goes through PEFT's own set_adapter.
        self._fast = (all(type(m).__module__.startswith("peft.tuners.") and not getattr(m, "merged", False)
                           for m in self._tuners)
                      and len(self._tuners) == len(_adapter_holders(model)))
        self._active: tuple[str, ...] | None = None
        self._routed: list = []  # the layers a mixed-task step routes, with the forward each had before

    def __getitem__(self, name: str) -> Unit:
        unit = self.units.get(name)
        if unit is None:
            self._missing(name)
        return unit

    def __len__(self) -> int:
        return len(self.units)

    def __iter__(self):
        return iter(self.units)

    def _missing(self, name: str):
        config = getattr(self.model, "peft_config", {})
        if name in config:
            raise _core.InvalidArgument(f"taskswap: adapter '{name}' was added to the model after registration; "
                                        "add every adapter first, then register the model (with a new runtime)")
        known = sorted(self.units)
        raise _core.InvalidArgument(f"taskswap: the model has no adapter '{name}' (it has {len(known)}: "
                                    f"{', '.join(known[:8])}{', ...' if len(known) > 8 else ''})")

    def _names(self, names: str | Sequence[str]) -> tuple[str, ...]:
        names = (names,) if isinstance(names, str) else tuple(names)
        config = getattr(self.model, "peft_config", None)
        for n in names:
            if n not in self.units:
                self._missing(n)
            if config is not None and n not in config:
                raise _core.InvalidArgument(f"taskswap: adapter '{n}' was deleted from the model after registration; "
                                            "its unit still holds its values (rt.state_dict())")
        return names

    def uses(self, names: str | Sequence[str], *extra) -> list:
        """A step's units as plan() and step() take them: the base (frozen; streamed layers left out,
        their hooks acquire them) and the adapters ``names`` (trained), then ``extra`` units (a
        task head, ...)."""
        return [*(b for b in self.base if b._layer is None), *(self.units[n] for n in self._names(names)), *extra]

    def activate(self, names: str | Sequence[str]) -> None:
        """Makes ``names`` the model's active adapter(s), as ``model.set_adapter`` does."""
        names = self._names(names)
        if names == self._active:
            return
        if self._fast:
            active = list(names)
            for m in self._tuners:
                m._active_adapter = active
            base_model = getattr(self.model, "base_model", None)
            if base_model is not None and hasattr(base_model, "active_adapter"):
                base_model.active_adapter = names[0] if len(names) == 1 else active
        elif len(names) == 1 and hasattr(self.model, "set_adapter"):
            self.model.set_adapter(names[0])
        else:
            self.model.base_model.set_adapter(list(names))
        self._active = names

    def step(self, names: str | Sequence[str] | Mapping[str, object], *extra,
             micro_batches: int = 1) -> _StepScope | _RoutedStep:
        """Activates the adapter(s) ``names`` and opens ``rt.step`` over the base, them and
        ``extra``: the base is used frozen, the adapters are trained.

        ``names`` as a mapping ``{adapter: rows}`` is a mixed-task step: the rows of the batch
        (a sequence or 1-D tensor of row indices along the inputs' first dimension, or a boolean
        mask) go through their own adapter in every adapted layer, in training and in evaluation,
        forward and backward, over one pass of the base; each adapter's gradients come from its
        rows alone, rows no adapter names go through the base alone, and an adapter given no rows
        is not trained in the step. Every adapted layer must see the batch along its inputs' first
        dimension (a row beyond it is refused). The loss and its normalisation are the
        trainer's. Each adapter's dropout applies to its rows. Only un-merged LoRA ``Linear``
        layers without a variant (DoRA, ...) are routed; anything else an adapter of the step
        reaches is refused, saying what to change. ``with`` gives the step scope."""
        if isinstance(names, Mapping):
            routing = _routing(names)
            uses = self.uses(list(routing), *extra)
            layers = self._routable(routing)  # refused before anything changes
            self.activate(list(routing))
            return _RoutedStep(self, layers, self.rt.step(*uses, micro_batches=micro_batches))
        uses = self.uses(names, *extra)
        self.activate(names)
        return self.rt.step(*uses, micro_batches=micro_batches)

    def _routable(self, routing: dict[str, torch.Tensor]) -> list[tuple[torch.nn.Module, list]]:
        """The layers a mixed-task step routes, each with its adapters' rows; refuses what it cannot
        route, saying what to change."""
        layers = []
        for _, m in _adapter_holders(self.model):
            keys = _adapter_keys(m)
            reached = [n for n in routing if n in keys]
            if not reached:
                continue
            kind = f"{type(m).__module__}.{type(m).__qualname__}"
            if kind != "peft.tuners.lora.layer.Linear":
                raise _core.InvalidArgument(
                    f"taskswap: a mixed-task step routes rows through LoRA Linear layers; adapter '{reached[0]}' has "
                    f"a {kind} layer; train its tasks one per step (adapters.step(name))")
            if getattr(m, "merged", False):
                raise _core.InvalidArgument("taskswap: a mixed-task step cannot route through a merged LoRA layer; "
                                            "unmerge the adapters first (model.unmerge_adapter())")
            variant = [n for n in reached if n in getattr(m, "lora_variant", {})]
            if variant:
                raise _core.InvalidArgument(
                    f"taskswap: adapter '{variant[0]}' is a LoRA variant ({type(m.lora_variant[variant[0]]).__name__}, "
                    "as DoRA is) that a mixed-task step does not route; train it one task per step")
            layers.append((m, [(n, rows) for n, rows in routing.items() if n in m.lora_A]))
        return layers

    def _route(self, layers: list[tuple[torch.nn.Module, list]]) -> None:
        """Points every routed layer's forward at the routed one."""
        rows = 1 + max(int(r.max()) for _, routes in layers for _, r in routes) if layers else 0
        batch: dict[str, int] = {}  # the first dimension the first routed layer saw
        self._routed = []
        for m, routes in layers:
            self._routed.append((m, m.__dict__.get("forward")))
            m.forward = functools.partial(_routed_forward, m, routes, rows, batch)

    def _unroute(self) -> None:
        for m, previous in self._routed:
            if previous is None:
                m.__dict__.pop("forward", None)  # the class's forward again
            else:
                m.forward = previous
        self._routed = []


def _adapter_keys(m: torch.nn.Module) -> set[str]:
    """The adapter names a tuner layer holds weights for."""
    keys: set[str] = set()
    for attr in getattr(m, "adapter_layer_names", ()):
        container = getattr(m, attr, None)
        if isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
            keys.update(container.keys())
    return keys


def _routing(rows_of: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A mixed-task step's rows per adapter, as 1-D int64 tensors of distinct row indices; an
    adapter with no rows takes no part (it is not trained in the step)."""
    routing: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, rows in rows_of.items():
        t = torch.as_tensor(rows)
        if t.dtype == torch.bool:
            t = t.nonzero().flatten()
        if t.dim() != 1 or (t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex)):
            raise _core.InvalidArgument(f"taskswap: the rows of adapter '{name}' are row indices (a 1-D sequence or "
                                        f"tensor of integers) or a 1-D boolean mask, not a tensor of shape "
                                        f"{tuple(t.shape)} and dtype {t.dtype}")
        t = t.to(torch.int64)
        for r in t.tolist():
            if r < 0:
                raise _core.InvalidArgument(f"taskswap: adapter '{name}' names row {r}; rows count from 0")
            if r in seen:
                raise _core.InvalidArgument(f"taskswap: row {r} is routed to both '{seen[r]}' and '{name}'; each row "
                                            "goes through one adapter")
            seen[r] = name
        if t.numel():
            routing[name] = t
    if not routing:
        raise _core.InvalidArgument("taskswap: a mixed-task step names at least one adapter and its rows")
    return routing


def _routed_forward(layer: torch.nn.Module, routes: list[tuple[str, torch.Tensor]], rows: int, batch: dict[str, int],
                    x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA Linear layer's forward in a mixed-task step: the base over every row, then each
    adapter's low-rank update over its own rows (gathered, computed, added back). `rows`: one more
    than the largest row routed; `batch`: the first dimension the step's first routed layer saw,
    which every routed layer must see too (rows index it)."""
    if "adapter_names" in kwargs:
        raise _core.InvalidArgument("taskswap: a mixed-task step routes the rows itself; drop adapter_names")
    if layer.disable_adapters:  # inside model.disable_adapter(): the base alone, as PEFT's forward
        return layer.base_layer(x, *args, **kwargs)
    first = batch.setdefault("rows", x.shape[0])
    if x.shape[0] != first or first < rows:
        raise _core.InvalidArgument(
            f"taskswap: a mixed-task step routes rows along the inputs' first dimension, {first} at the first "
            f"adapted layer, up to row {rows - 1}; this layer's input has {x.shape[0]} along it. Give the rows of "
            "a batch whose first dimension every adapted layer keeps (batch first)")
    result = layer.base_layer(x, *args, **kwargs)
    dtype = result.dtype
    for name, index in routes:
        if index.device != x.device:
            index = index.to(x.device, non_blocking=True)
        lora_a = layer.lora_A[name]
        part = layer._cast_input_dtype(x.index_select(0, index), lora_a.weight.dtype)
        update = layer.lora_B[name](lora_a(layer.lora_dropout[name](part))) * layer.scaling[name]
        result = result.index_add(0, index, update.to(dtype))
    return result


class _RoutedStep:
    """A mixed-task step (Adapters.step with a mapping): the routed forwards for the step scope's
    life, then the layers' own again."""

    __slots__ = ("adapters", "layers", "scope")

    def __init__(self, adapters: Adapters, layers: list, scope: _StepScope):
        self.adapters = adapters
        self.layers = layers
        self.scope = scope

    def __enter__(self) -> _StepScope:
        self.adapters._route(self.layers)
        try:
            return self.scope.__enter__()
        except BaseException:
            self.adapters._unroute()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.scope.__exit__(exc_type, exc, tb)
        finally:
            self.adapters._unroute()


def register(rt: Runtime, model: torch.nn.Module, *, adapters: Sequence[str] | None = None,
             base: str | None = "per_layer", prefix: str = "adapter/", base_prefix: str = "base/",
             base_residency: str | None = None, stream: bool = False, **adapter_settings) -> Adapters:
    """Registers a PEFT model with ``rt``: one unit per adapter (``prefix + name``, trained) and
    the base model's weights, which PEFT froze, as units registered ``trainable=False``.

    ``adapters``: the adapters to register (default: all the model has). ``base``:
    ``"per_layer"`` (a unit per decoder layer, ``base_prefix + index``, and one for the rest,
    ``base_prefix + "rest"``), ``"one"`` (one unit, ``base_prefix + "all"``) or None (the base is
    not registered: it stays where torch has it). A base unit may hold tensors of any dtypes
    (quantized weights with float scales): frozen units are packed. ``base_residency`` and
    ``adapter_settings`` (residency, lookahead, optimizer, lr_scale, weight_decay, no_weight_decay)
    are passed to ``register``;
    left out, the config's rules decide. ``stream`` (with ``base="per_layer"``): the decoder layers'
    base units stream within each step, as ``Runtime.register_layers`` does (a base larger than the
    device trains); ``uses`` then leaves them out. Refused, it registers nothing."""
    if stream and base != "per_layer":
        raise _core.ConfigError(f"taskswap: stream=True streams the base's decoder layers: it needs "
                                f"base=\"per_layer\", not {base!r}")
    if base not in ("per_layer", "one", None):
        raise _core.ConfigError(f"taskswap: base is \"per_layer\", \"one\" or None, not {base!r}")
    found = _adapter_entries(model)
    if not found:
        raise _core.ConfigError("taskswap: the model has no PEFT adapter layers (lora_A, lora_B, ...); make it with "
                                "peft.get_peft_model and add the adapters first")
    names = list(found) if adapters is None else list(adapters)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise _core.InvalidArgument(f"taskswap: the model has no adapter {unknown[:5]} (it has {len(found)}: "
                                    f"{', '.join(sorted(found)[:8])}{', ...' if len(found) > 8 else ''})")
    adapter_ids = {id(e.tensor) for entries in found.values() for e in entries}

    groups: list[tuple[str, list[_Entry], list[_Entry], torch.nn.Module | None]] = []  # name, params, buffers, layer
    if base is not None:
        params, buffers = _module_entries(model)
        params = [e for e in params if id(e.tensor) not in adapter_ids]
        if base == "one":
            groups.append((f"{base_prefix}all", params, buffers, None))
        else:
            layers = _layer_list(model, adapter_ids)
            if layers is None:
                raise _core.ConfigError("taskswap: base=\"per_layer\" found no list of layers in the model; pass "
                                        "base=\"one\"")
            lname, layer_list = layers
            placed: set[int] = set()
            for i, layer in enumerate(layer_list):
                lp, lb = _module_entries(layer)
                lp = [e for e in lp if id(e.tensor) not in adapter_ids]
                for e in lp + lb:
                    e.name = f"{lname}.{i}.{e.name}"
                placed.update(id(e.tensor) for e in lp + lb)
                groups.append((f"{base_prefix}{i}", lp, lb, layer))
            rest_p = [e for e in params if id(e.tensor) not in placed]
            rest_b = [e for e in buffers if id(e.tensor) not in placed]
            if rest_p:
                groups.append((f"{base_prefix}rest", rest_p, rest_b, None))
    # A group whose tensors differ in dtype (int8 weights and their float scales, bf16 weights
    # and f32 norms) is one frozen unit all the same: the runtime packs it.
    split = [g for g in groups if g[1]]

    made: list[Unit] = []
    try:
        base_units = [rt._register_entries(gname, gp, gb, None, trainable=False, residency=base_residency,
                                           lookahead=None, optimizer=None, lr_scale=None, weight_decay=None,
                                           no_weight_decay=None)
                      for gname, gp, gb, _ in split]
        made += base_units
        units: dict[str, Unit] = {}
        for n in names:
            settings = {k: adapter_settings.get(k) for k in
                        ("residency", "lookahead", "optimizer", "lr_scale", "weight_decay", "no_weight_decay")}
            unexpected = set(adapter_settings) - set(settings)
            if unexpected:
                raise _core.ConfigError(f"taskswap: register() takes no {sorted(unexpected)}")
            units[n] = rt._register_entries(f"{prefix}{n}", found[n], [], None, trainable=True, **settings)
            made.append(units[n])
    except BaseException:
        rt._unregister(made)
        raise
    if stream:
        streamed = [(u, layer) for u, (_, _, _, layer) in zip(base_units, split) if layer is not None]
        rt._stream_layers([u for u, _ in streamed], [layer for _, layer in streamed])
    return Adapters(rt, model, base_units, units)
