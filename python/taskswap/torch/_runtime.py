# SPDX-License-Identifier: Apache-2.0
"""Runtime: its life (start, close), plans and step scopes, and the gradient hooks that hand each
unit to the reduction under a communicator. Registration and state are its mixins' concerns."""

from __future__ import annotations

import atexit
import copy
import os
import weakref
from typing import Iterable, Sequence

import torch

from .. import _core
from ._activations import Activations
from ._registration import _Registration
from ._scope import _StepScope
from ._state import _State
from ._streaming import hook_layers
from ._units import _FROZEN, _RELEASE, _TRAIN, Unit, _detach, _exact_glob, _repair_grad, _Use, _use_of


def _raw_stream(index: int) -> int:
    """The handle of torch's current CUDA stream on device `index` (a cudaStream_t as an integer)."""
    return torch.cuda.current_stream(index).cuda_stream


# torch's own accessor for the raw handle (what its compiled code calls every launch) takes a
# fraction of a microsecond; torch.cuda.current_stream() builds a Stream object each time.
if callable(getattr(torch._C, "_cuda_getCurrentRawStream", None)):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def _close_at_exit(ref) -> None:
    rt = ref()
    if rt is not None and rt._scope is None:  # a scope left open at exit keeps its runtime
        rt.close(give_back=False)


class Runtime(_Registration, _State):
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
        self._activations: Activations | None = None  # register_activations
        self._scale_view: torch.Tensor | None = None  # the device's loss scale, once asked for
        self.last_step: _core.StepStats | None = None
        self._closed = False
        self._began = False  # a plan or a step was made: home copies are no longer what the device sees
        self._at_exit = False

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
        if self._activations is not None:
            specs += self._activations.specs()
        # The runtime's own options: the user's, with a register() setting as a rule that matches
        # the unit's name alone, after the config's rules (it wins over them, and the config's
        # rules still count the unit as matched).
        options = copy.copy(self.options)
        for u in self.units:
            overrides = {k: v for k, v in u._policy.items() if v is not None}
            if overrides:
                options.add_rule(_exact_glob(u.name), origin=f"register('{u.name}')", **overrides)
        if self._activations is not None:  # blocks come and go, whatever [defaults] says of units
            options.add_rule(_exact_glob(self._activations.prefix) + "/*", origin="register_activations",
                             residency=_core.Residency.prefetch, home="host")
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
        try:
            core = _core.Runtime(device, options, specs, comm)
        except _core.OutOfMemory as e:
            if self._activations is None or "pinned arena" not in str(e):
                raise
            pool = self._activations
            raise type(e)(f"{e} (the activation blocks take {pool.count * pool.block_bytes} bytes of it: lower "
                          "register_activations(host_bytes=...))") from e
        ids = [core.find(u.name) for u in self.units]
        if self._activations is not None:
            self._activations.set_ids([core.find(n) for n in self._activations.names])
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
                u._set_placeholders([self._placeholder(e.tensor.dtype) for e in u._entries])
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
                hook_layers(self)
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
            u.id = None
            u._set_views([], None)
            u._set_grad_views([], None)
        self._external.clear()
        if self._activations is not None:
            self._activations.set_ids([])
        self._core = self._stream = self.device = None
        self._scale_view = None
        self._began = False

    @staticmethod
    def _write_home(core: _core.Runtime, u: Unit, uid: int) -> None:
        kinds = ["params"] if u.dtype == torch.float32 or not u.trainable else ["params", "master"]
        with torch.no_grad():
            for kind in kinds:
                for home, e in zip(u._shaped(core.home(uid, kind)), u._entries):
                    home.copy_(e.tensor.detach())

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
            home = u._shaped(self._core.home(u.id, "params")) if give_back else [None] * len(u._entries)
            for e, h in zip(u._entries, home):
                e.original = e.original_grad = None
                if give_back:
                    if not e.state:
                        e.tensor.grad = None
                    e.tensor.data = h.to(e.device, copy=True)
                    if not e.state and e.tensor.requires_grad != e.requires_grad:
                        e.tensor.requires_grad_(e.requires_grad)
            u._set_views([], None)
            u._set_grad_views([], None)
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
    def plan(self, steps: Iterable[Sequence[Unit | _Use]], *, forward_only: bool = False,
             offload: bool | None = None) -> None:
        """Appends upcoming steps, each the units it acquires in order (``unit.frozen()`` for a
        forward-only use; a unit registered ``trainable=False`` is always used frozen). Checks
        that each step fits the budget; a refused plan changes nothing.

        ``forward_only``: these steps run forward passes alone (evaluation under ``no_grad``): the
        streamed layers are planned for their forward uses only, so the prefetch brings no layer
        whole for a backward that will not come, and with a communicator a trained layer is not
        updated in them (planned for its backward, it would be, with zeros from this rank).

        ``offload``: whether these steps offload their activations (register_activations; None:
        ``every_step``); their plans then have the blocks where the last step that offloaded
        used them."""
        plan = [[self._own(_use_of(e)) for e in step] for step in steps]
        with self._starting():
            pool = self._activations
            no_blocks = pool is None or not pool.offloads(offload)
            planned = [self._planned(step, forward_only, no_blocks) for step in plan]
            self._core.plan(planned)
            self._began = True
            if pool is not None:
                pool.planned_steps(planned)

    def _planned(self, uses: list[_Use], forward_only: bool = False, no_blocks: bool = True) -> list[tuple[int, int]]:
        """A step's plan: its units, then the streamed layers forward (each released before the next)
        and, unless ``forward_only``, backward (each released once the layer below is acquired, as
        the hooks do); the activation blocks' uses among them, where the step before had them."""
        if not self._layers and self._activations is None:
            return [(e.unit.id, e.kind) for e in uses]
        layers: list[tuple[int, int]] = []
        above = None
        for u in self._layers:
            layers += [(u.id, _FROZEN), (u.id, _RELEASE)]
        for u in [] if forward_only else reversed(self._layers):
            layers.append((u.id, _TRAIN if u.trainable else _FROZEN))
            if above is not None:
                layers.append((above.id, _RELEASE))
            above = u
        if above is not None:
            layers.append((above.id, _RELEASE))
        if self._activations is not None:
            layers = self._activations.planned_step(layers, forward_only or no_blocks)
        return [(e.unit.id, e.kind) for e in uses] + layers

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

    def step(self, *units: Unit | _Use, micro_batches: int = 1, offload: bool | None = None) -> _StepScope:
        """A step scope: acquires ``units`` in order on torch's current stream, aliases their
        parameters and gradients into the unit slabs; on exit, gradients ready, AdamW step,
        release, end of step. ``micro_batches``: backward passes accumulated before the reduction
        (gradient accumulation: call backward that many times inside the scope). ``offload``:
        whether the step's saved activations go to the activation blocks (register_activations;
        None: as it set, ``every_step``)."""
        if micro_batches != 1:
            if micro_batches < 1:
                raise _core.InvalidArgument(f"taskswap: micro_batches is at least 1, not {micro_batches}")
            if any(u.trainable for u in self._layers):
                raise _core.InvalidArgument(
                    f"taskswap: micro_batches={micro_batches} with trained streamed layers: a streamed layer is "
                    "stepped as soon as one backward pass completes its gradients; sum the micro-batches' losses and "
                    "call backward once, or register the layers with register()")
        pool = self._activations
        if pool is not None:
            offload = pool.offloads(offload)
        elif offload:
            raise _core.InvalidArgument("taskswap: step(offload=True) needs activation blocks; call "
                                        "register_activations() before the runtime starts")
        else:
            offload = False
        return _StepScope(self, list(map(_use_of, units)), micro_batches, offload)

    def _current_stream(self) -> _core.Stream:
        if self._stream is not None:
            return self._stream
        handle = _raw_stream(self._torch_device.index)
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
            u._set_views(u._shaped(core.param_tensors(u.id)), addrs[0])
        if kind == _TRAIN and u._grad_addr != addrs[1]:
            u._set_grad_views(u._shaped(core.grad_tensors(u.id))[:len(u._params)], addrs[1])
        try:
            for t, v in u._alias:
                t.data = v
            if kind == _FROZEN:
                if forward and u.trainable:  # its gradient slab comes with the backward's acquisition
                    return
                for p in u._params:
                    if p.requires_grad:
                        p.requires_grad_(False)
                return
            for p, g in u._grad_alias:
                if not p.requires_grad:
                    p.requires_grad_(True)
                p.grad = g
            if self._hooks or u._layer is not None:  # what the gradient hooks count; nothing else reads it
                u._fired = u._passes = 0
                u._ready = False
                u._handed_versions = None
        except BaseException:
            _detach(u, kind)
            raise


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
