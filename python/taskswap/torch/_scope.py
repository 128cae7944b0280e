# SPDX-License-Identifier: Apache-2.0
"""The step scope (Runtime.step): acquires a step's units and aliases their tensors into the
unit slabs; on exit, gradients ready, AdamW step, release, end of step; on an exception, the
cleanup that keeps every rank's replicas equal."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import _core
from ._streaming import _LayerStream
from ._units import _TRAIN, _detach, _repair_grads, _Use

if TYPE_CHECKING:
    from ._runtime import Runtime, _Starting


class _StepScope:
    __slots__ = ("rt", "uses", "micro_batches", "kinds", "stream", "acquired", "attached", "stats", "_starting",
                 "streamed", "offload")

    def __init__(self, rt: Runtime, uses: list[_Use], micro_batches: int, offload: bool = False):
        self.rt = rt
        self.uses = uses
        self.micro_batches = micro_batches
        self.kinds: dict[int, int] = {}
        self.stream = None
        self.acquired: list[_Use] = []
        self.attached: list[_Use] = []
        self.stats: _core.StepStats | None = None
        self._starting: _Starting | None = None
        self.streamed = _LayerStream(self) if rt._layers else None  # the streamed layers in this step
        self.offload = offload  # the saved activations go to the activation blocks

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
        if self.streamed is not None:
            self.streamed.exit_early()

    def __enter__(self) -> _StepScope:
        rt = self.rt
        if rt._scope is not None:
            raise _core.InvalidArgument("taskswap: a step scope is already open; steps do not nest")
        uses = self.uses
        for use in uses:  # before anything is started or acquired: a bad scope changes nothing
            u = use.unit
            if u._owner is not rt or (use.kind == _TRAIN and not u.trainable) or u._layer is not None:
                rt._own(use)
            for holder, attr, tensor in u._holders:  # Unit._check_model, inline: it runs every step
                if holder.get(attr) is not tensor:
                    u._model_changed()
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
        # The step's planned blocks are taken whatever happens next: the runtime's step ends either way.
        planned = rt._activations.take_planned() if rt._activations is not None else None
        try:
            attach = rt._attach
            for use in uses:
                addrs = core.acquire(use.unit.id, stream, use.frozen)
                acquired.append(use)
                attach(use.unit, use.kind, addrs)
                attached.append(use)
            if self.offload:
                rt._activations.begin(self, planned)
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
            if self.streamed is not None:
                self.streamed.finish()
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
                    _repair_grads(u)
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
                if self.streamed is not None:
                    self.streamed.zero_grads()
        except BaseException as e:  # kept, the cleanup goes on
            first = e
        if rt._hooks:
            for use in self.acquired:
                if use.kind == _TRAIN and use.unit.id not in stepped:
                    try:
                        core.step(use.unit.id, self.stream)
                    except BaseException as e:  # each unit is stepped
                        first = first or e
        self._end(first, failed=True)

    def _end(self, first: BaseException | None = None, failed: bool = False) -> None:
        """Closes the activation offload, releases every unit acquired (in reverse order), points
        the parameters back at their empty placeholders and ends the step, each whatever the others
        do; raises the first error (`first`: one from before) after all."""
        rt = self.rt
        core, stream = rt._core, self.stream
        if self.offload:
            closed = rt._activations.end(failed or first is not None)
            first = first or closed
        if self.streamed is not None:
            released = self.streamed.release_all()
            first = first or released
        for use in reversed(self.acquired):
            try:
                core.release(use.unit.id, stream)
            except BaseException as e:  # every unit is released
                first = first or e
        try:
            for use in self.attached:
                _detach(use.unit, use.kind)
        except BaseException as e:  # the step still ends
            first = first or e
        finally:
            rt._scope = None
        try:
            self.stats = rt.last_step = core.end_step()
        except BaseException as e:  # noqa: BLE001
            first = first or e
        if first is not None:
            raise first
