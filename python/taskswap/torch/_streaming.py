# SPDX-License-Identifier: Apache-2.0
"""Streamed layers (Runtime.register_layers): the hooks that acquire a layer for its forward,
release it, acquire it again for its backward and step it once its gradients are complete, and
the layers' state within one step scope (_LayerStream)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .. import _core
from ._units import _FROZEN, _TRAIN, Unit, _detach, _in_backward, _repair_grads, _tensors_in

if TYPE_CHECKING:
    from ._runtime import Runtime
    from ._scope import _StepScope


def hook_layers(rt: Runtime) -> None:
    """Sets the streamed layers' hooks (Runtime.register_layers), at start."""
    if (rt.options.scaler.enabled or rt.options.optimizer.clip > 0) and any(u.trainable for u in rt._layers):
        raise _core.InvalidArgument(
            f"taskswap: the trained layers '{rt._layers[0].name}'.. cannot stream with loss scaling or "
            "clipping: a guarded update waits for the step's end, so each trained layer would stay on the device "
            "to it. Stream frozen layers (trainable=False), or turn off [scaler] and [optimizer] clip")
    # Autograd keeps views of a layer's parameters (nn.Linear saves weight.t()) at the address
    # its forward saw, so the backward's acquisition must find the layer there again. A unit
    # keeps its slot's address, except one of at most half a device granule, which the pool
    # packs into a shared granule at any free place.
    granule = rt.device.granularity
    for u in rt._layers:
        smallest = _core.footprint(u.spec(), _core.OptimizerPlacement.host).frozen_device_bytes
        if -(-smallest // 256) * 256 * 2 <= granule:
            raise _core.InvalidArgument(
                f"taskswap: the streamed layer '{u.name}' has {smallest} bytes of parameters, at most half a "
                f"device granule ({granule} bytes): such units share granules and may come back at another "
                "address for their backward, where autograd's saved views of their parameters would not follow. "
                "Stream larger layers (group small ones into one module), or register them with register()")
    ref = weakref.ref(rt)  # the module's hooks must not keep the runtime alive

    def scope_of():
        live = ref()
        return live._scope if live is not None else None

    for u in rt._layers:
        def pre_hook(module, args, kwargs, u=u):
            scope = scope_of()
            if scope is not None:
                scope.streamed.forward(u)

        def post_hook(module, args, kwargs, output, u=u):
            scope = scope_of()
            if scope is not None:
                scope.streamed.forward_done(u, (args, kwargs), output)

        def grad_hook(param, u=u):
            scope = scope_of()
            if scope is not None:
                scope.streamed.grad(u)

        m = u._layer_module
        u._hook_handles += [m.register_forward_pre_hook(pre_hook, with_kwargs=True),
                            m.register_forward_hook(post_hook, with_kwargs=True)]
        if u.trainable:
            u._hook_handles += [p.register_post_accumulate_grad_hook(grad_hook) for p in u._params]


class _LayerStream:
    """The streamed layers within one step scope: which are held and for what, which ran, which
    were stepped, which a forward inside backward holds, and whether the rest were skipped."""

    __slots__ = ("scope", "rt", "held", "stepped", "rerunning", "awaiting", "ran", "exited")

    def __init__(self, scope: _StepScope):
        self.scope = scope
        self.rt = scope.rt
        # The layers held now: unit id -> (unit, held for its forward, use kind, the stream acquired on).
        self.held: dict[int, tuple[Unit, bool, int, _core.Stream]] = {}
        self.stepped: set[int] = set()  # trained layers updated in this step
        # Layers acquired by a forward inside backward (reentrant checkpointing): running it now, or
        # run and held for their backward, which has not begun.
        self.rerunning: set[int] = set()
        self.awaiting: set[int] = set()
        self.ran: set[int] = set()  # layers whose forward ran in this step
        self.exited = False  # the layers not run were skipped (exit_early, or the backward began)

    def exit_early(self) -> None:
        """See _StepScope.exit_early."""
        if self.exited:
            return
        self.exited = True
        skipped = [u.id for u in reversed(self.rt._layers) if u.id not in self.ran and u.id not in self.held]
        if skipped:  # the last layer first: the order their gradients would have been ready in
            self.rt._core.skip(skipped)

    def zero_grads(self) -> None:
        """An exception in the scope: the held trained layers' gradients are dropped."""
        for u, _, kind, _ in self.held.values():
            if kind == _TRAIN:
                for g in u._grad_views:
                    g.zero_()

    def release_all(self) -> BaseException | None:
        """Releases every held layer, the last first, each whatever the others do; returns the
        first error."""
        first = None
        for u, _, _, stream in sorted(self.held.values(), key=lambda held: -held[0]._layer):
            try:
                self.release(u, stream)  # after its work there, not on whatever stream is current
            except BaseException as e:  # every unit is released
                first = first or e
        return first

    def stream(self) -> _core.Stream:
        rt = self.rt
        return rt._stream or rt._current_stream()  # in backward: the stream autograd runs the node on

    def acquire(self, u: Unit, kind: int, forward: bool) -> None:
        rt = self.rt
        stream = self.stream()
        addrs = rt._core.acquire(u.id, stream, kind == _FROZEN)
        self.held[u.id] = (u, forward, kind, stream)
        if self.scope.offload:
            rt._activations.layer_acquired(u, forward)
        try:
            rt._attach(u, kind, addrs, forward=forward)
        except BaseException:
            self.release(u)
            raise

    def release(self, u: Unit, stream: _core.Stream | None = None) -> None:
        """Releases a held layer on `stream` (None: the current one)."""
        _, _, kind, _ = self.held.pop(u.id)
        self.rerunning.discard(u.id)
        self.awaiting.discard(u.id)
        try:
            self.rt._core.release(u.id, stream if stream is not None else self.stream())
        finally:
            _detach(u, kind)

    def forward(self, u: Unit) -> None:
        """Forward pre-hook: the layer's forward use, unless it is held (a forward re-run inside its
        backward by non-reentrant activation checkpointing uses the backward's acquisition). A
        forward inside backward (reentrant checkpointing re-runs it there, and its backward follows
        at once) is the layer's backward use: acquired as its backward is planned, and kept. In a
        checkpoint over several layers the second re-run comes before the first one's backward:
        from there on, the old way (fetched for the forward, again for the backward; off the plan,
        which a communicator refuses)."""
        if u.id in self.held:
            return
        if u._holders:
            u._check_model()
        if _in_backward():
            if not self.awaiting:
                self.backward(u)
                self.rerunning.add(u.id)
                return
            if self.rt._hooks:
                raise _core.InvalidArgument(
                    f"taskswap: the streamed layer '{u.name}' runs its forward again inside backward before the "
                    f"backward of '{self.held[next(iter(self.awaiting))][0].name}': a checkpoint over several "
                    "streamed layers, whose uses the plan does not foresee, and with a communicator every use is "
                    "planned; checkpoint each streamed layer on its own (as transformers' "
                    "gradient_checkpointing_enable does), or use non-reentrant checkpointing")
        if u._stat_modules:  # the forward use is a frozen one: running statistics would not be kept
            u._check_eval()
        self.acquire(u, _FROZEN, forward=True)
        self.ran.add(u.id)

    def forward_done(self, u: Unit, inputs, output) -> None:
        """Forward hook: releases the layer. If backward will pass through it, the first of its
        outputs' gradients to arrive acquires it again (the backward of that output's path needs
        the parameters: an auxiliary output's, a router loss, may come before the hidden state's;
        autograd runs nodes in reverse creation order, so it comes just before the layer's own
        backward), and a frozen layer is released once its inputs' gradients are in, when its
        backward is over. A forward re-run inside backward keeps the layer for that backward."""
        held = self.held.get(u.id)
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
            self.release(u)
        if not outputs:
            return

        def before_backward(_grad):
            self.backward(u)

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
                self.backward_done(u)

        for t in sources:
            t.register_hook(input_done)

    def backward(self, u: Unit) -> None:
        """The gradients of the layer's outputs are computed: acquires it for its backward."""
        if self.rt._scope is not self.scope:
            raise _core.InvalidArgument(f"taskswap: backward reached the streamed layer '{u.name}' after its step "
                                        "scope closed; call backward inside the step scope")
        if u.id in self.stepped:
            raise _core.InvalidArgument(
                f"taskswap: a second backward pass reached the streamed layer '{u.name}' after its update (a trained "
                "streamed layer is stepped as soon as one backward pass completes its gradients); sum the losses and "
                "call backward once per step")
        self.awaiting.discard(u.id)
        if not self.exited and not self.rt._hooks:  # the layers not run will not come: give their room
            self.exit_early()
        if u.id not in self.held:
            self.acquire(u, _TRAIN if u.trainable else _FROZEN, forward=False)

    def backward_done(self, u: Unit) -> None:
        """The gradients of a frozen layer's inputs are computed: its backward is over."""
        held = self.held.get(u.id)
        if held is not None and not held[1]:
            self.release(u)

    def grad(self, u: Unit) -> None:
        """A trained layer's parameter has its gradient: once all have, the layer is stepped and
        released while backward goes on below it."""
        held = self.held.get(u.id)
        if held is None or held[1]:
            return
        u._fired += 1
        if u._fired == len(u._params):
            u._fired = 0
            self.step_layer(u)

    def step_layer(self, u: Unit, stream: _core.Stream | None = None) -> None:
        """Steps a trained layer and releases it, on `stream` (None: the current one)."""
        _repair_grads(u)  # autograd may have replaced a gradient (create_graph)
        self.stepped.add(u.id)
        stream = stream if stream is not None else self.stream()
        self.rt._core.step(u.id, stream)
        self.release(u, stream)

    def finish(self) -> None:
        """At the scope's end: a trained layer still held (one of its parameters got no gradient) is
        stepped as a named unit is; the other layers are released with the scope's units."""
        for u, _, kind, stream in sorted(self.held.values(), key=lambda held: -held[0]._layer):
            if kind == _TRAIN:
                self.step_layer(u, stream)  # after its work there, not on whatever stream is current
