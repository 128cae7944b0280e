# SPDX-License-Identifier: Apache-2.0
"""Activation offload (Runtime.register_activations): saved-tensor hooks that copy a step's large
saved activations into the runtime's activation blocks. The runtime sends each block home on its
copy stream once it is full and brings it back ahead of the backward pass in the plan's order; a
step's plan has the blocks where the step before used them, among the streamed layers' uses."""

from __future__ import annotations

import warnings
from collections import deque
from typing import TYPE_CHECKING

import torch

from .. import _core
from ._units import _FROZEN, _RELEASE, _in_backward

if TYPE_CHECKING:
    from ._runtime import Runtime
    from ._scope import _StepScope

_STASH = 3  # a plan entry's kind: an activation block's write


class _Saved:
    """One offloaded tensor: where its bytes are ((block, offset, length) pieces) and what it was."""

    __slots__ = ("pieces", "shape", "dtype", "device", "step", "unpacked")

    def __init__(self, pieces: list[tuple[int, int, int]], x: torch.Tensor, step: int):
        self.pieces = pieces
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.step = step
        self.unpacked = False


class Activations:
    """A runtime's activation blocks and the hooks that fill them (Runtime.register_activations).

    Per step: the blocks are filled in order from the first, each tensor's bytes after the last
    one's (a tensor may span blocks); a block is acquired for its stash when the first byte goes
    in and released (sent home) once full, or when the backward pass begins. The backward pass
    reads a block back when it unpacks a tensor in it and releases it once every tensor in it is
    unpacked; an unpacked tensor is a copy of its own, so the block's room is free at once."""

    def __init__(self, rt: Runtime, blocks: int, block_bytes: int, min_bytes: int, keep_last: int,
                 every_step: bool, prefix: str):
        self.rt = rt
        self.count, self.block_bytes = blocks, block_bytes
        self.min_bytes, self.keep_last, self.every_step = min_bytes, keep_last, every_step
        self.prefix = prefix
        self.names = [f"{prefix}/{i}" for i in range(blocks)]
        self.ids: list[int] = []  # the blocks' unit ids, once the runtime started
        # The blocks' uses in the last step that offloaded: (anchor, block, kind), the anchor being
        # the streamed layer's use they followed ((unit id, forward) or None: before any).
        self.template: list[tuple[tuple[int, bool] | None, int, int]] = []
        self.planned: deque[int] = deque()  # with a communicator: the blocks each planned step has
        self.said: set[str] = set()
        self.generation = 0
        self._reset()

    # --- registration and plans --------------------------------------------------------------
    def specs(self) -> list[_core.UnitSpec]:
        return [_core.UnitSpec(n, [_core.TensorSpec("bytes", [self.block_bytes])], _core.DType.u8,
                               trainable=False, activation=True) for n in self.names]

    def planned_steps(self, steps: list[list[tuple[int, int]]]) -> None:
        """Steps the runtime accepted: with a communicator, the blocks each may fill."""
        if self.rt._hooks:
            self.planned.extend(sum(kind == _STASH for _, kind in step) for step in steps)

    def planned_step(self, layer_entries: list[tuple[int, int]], keys: list[tuple[int, bool] | None],
                     forward_only: bool) -> list[tuple[int, int]]:
        """The streamed layers' entries with the blocks' uses inserted after the layer use each
        followed in the last step (`keys`: each entry's layer use, None for a release)."""
        blocks = [] if forward_only or not self.ids else self.template
        if not blocks:
            return layer_entries
        after: dict[tuple[int, bool] | None, list[tuple[int, int]]] = {}
        for anchor, b, kind in blocks:
            after.setdefault(anchor if anchor in keys else None, []).append((self.ids[b], kind))
        out = list(after.get(None, []))
        for entry, key in zip(layer_entries, keys):
            out.append(entry)
            if key is not None:
                out += after.get(key, [])
        return out

    # --- a step --------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.scope: _StepScope | None = None
        self.hooks = None
        self.current: int | None = None  # the block being filled, and its bytes so far
        self.fill = 0
        self.next = 0  # the next block not yet filled in this step
        self.limit = self.count
        self.held: dict[int, torch.Tensor] = {}  # block -> its device bytes while acquired
        self.pending: dict[int, int] = {}  # block -> its tensors not yet unpacked
        self.events: list[tuple[tuple[int, bool] | None, int, int]] = []
        self.anchor: tuple[int, bool] | None = None
        self.forward_layer = -1  # the last streamed layer whose forward began
        self.backward_begun = False

    def begin(self, scope: _StepScope) -> None:
        """Opens a step's offload: the hooks are set until end()."""
        self._reset()
        self.generation += 1
        self.scope = scope
        if self.rt._hooks:  # with a communicator a block off the plan is refused: the plan's alone
            self.limit = min(self.count, self.planned.popleft() if self.planned else 0)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()

    def skipped(self) -> None:
        """A planned step that does not offload (a scope opened with offload off)."""
        if self.rt._hooks and self.planned:
            self.planned.popleft()

    def layer_acquired(self, u, forward: bool) -> None:
        """A streamed layer was acquired: the blocks' uses after it follow it in the next plans."""
        self.anchor = (u.id, forward)
        if forward:
            self.forward_layer = u._layer

    def end(self, failed: bool) -> BaseException | None:
        """Closes the step's offload: the hooks go, every block still held is released (each
        whatever the others do); the blocks' uses become the next plans' unless the step failed.
        Returns the first error."""
        first = None
        try:
            if self.hooks is not None:
                self.hooks.__exit__(None, None, None)
        except BaseException as e:  # noqa: BLE001 - the blocks are released all the same
            first = e
        for b in list(self.held):
            try:
                self._release(b)
            except BaseException as e:  # noqa: BLE001 - every block is released
                first = first or e
        if not failed and first is None:
            self.template = self.events
        self._reset()
        return first

    # --- the hooks -----------------------------------------------------------------------------
    def _say_once(self, key: str, what: str) -> None:
        if key not in self.said:
            self.said.add(key)
            warnings.warn(f"taskswap: {what}", RuntimeWarning, stacklevel=3)

    def _pack(self, x: torch.Tensor):
        rt, scope = self.rt, self.scope
        if rt._scope is not scope or scope is None or _in_backward():
            return x.detach()  # a forward re-run in backward (checkpointing) keeps what it saves
        nbytes = x.numel() * x.element_size()
        if nbytes < self.min_bytes:
            return x.detach()
        root = x._base if x._base is not None else x
        if root.grad_fn is None:  # parameters, buffers and the batch are not activations
            return x.detach()
        if rt._layers and self.forward_layer >= len(rt._layers) - self.keep_last:
            return x.detach()  # the last layers' activations: the backward needs them first
        if x.layout != torch.strided or x.device != rt._torch_device or x.is_conj() or x.is_neg():
            self._say_once("kind", f"a saved tensor ({x.layout}, {x.device}) is not a dense tensor on the runtime's "
                                   f"device ({rt._torch_device}): such tensors stay where they are")
            return x.detach()
        room = (self.block_bytes - self.fill if self.current is not None else 0) + \
            (self.limit - self.next) * self.block_bytes
        if nbytes > room:
            if self.limit < self.count:
                self._say_once("plan", "with a communicator a step offloads into the blocks its plan has (as many as "
                                       "the step before used, none before the first step that offloaded); the "
                                       "rest of its activations stay on the device. Plan steps after one has run")
            else:
                self._say_once("full", f"the step's activations outgrow the {self.count} blocks of {self.block_bytes} "
                                       "bytes; the rest stay on the device (register_activations(host_bytes=...) sets "
                                       "how many)")
            return x.detach()
        flat = x.detach().contiguous().view(-1).view(torch.uint8)
        pieces = []
        done = 0
        while done < nbytes:
            if self.current is None:
                self._stash(self.next)
            b = self.current
            n = min(self.block_bytes - self.fill, nbytes - done)
            self.held[b][self.fill:self.fill + n].copy_(flat[done:done + n])
            pieces.append((b, self.fill, n))
            self.pending[b] = self.pending.get(b, 0) + 1
            self.fill += n
            done += n
            if self.fill == self.block_bytes:
                self._close()
        return _Saved(pieces, x, self.generation)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.step != self.generation or self.scope is None:
            raise _core.InvalidArgument("taskswap: backward reached an offloaded activation after its step scope "
                                        "closed; call backward inside the step scope")
        if not self.backward_begun:
            self.backward_begun = True
            if self.current is not None:
                self._close()
        out = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        flat = out.view(-1).view(torch.uint8)
        done = 0
        for b, at, n in saved.pieces:
            view = self.held.get(b)
            if view is None:
                view = self._acquire(b, stash=False)
            flat[done:done + n].copy_(view[at:at + n])
            done += n
        first = not saved.unpacked
        saved.unpacked = True
        for b, _, _ in saved.pieces:
            if first:
                self.pending[b] -= 1
            if self.pending[b] == 0 and b in self.held:
                self._release(b)
        return out

    # --- the blocks ------------------------------------------------------------------------------
    def _stream(self):
        rt = self.rt
        return rt._stream or rt._current_stream()  # in backward: the stream autograd runs the node on

    def _acquire(self, b: int, stash: bool) -> torch.Tensor:
        core = self.rt._core
        core.acquire(self.ids[b], self._stream(), frozen=not stash, stash=stash)
        self.events.append((self.anchor, b, _STASH if stash else _FROZEN))
        try:
            view = self.held[b] = core.param_tensors(self.ids[b])[0].view(-1)
        except BaseException:
            core.release(self.ids[b], self._stream())
            raise
        return view

    def _stash(self, b: int) -> None:
        self._acquire(b, stash=True)
        self.current, self.fill = b, 0
        self.next = b + 1

    def _close(self) -> None:
        """The block being filled goes home."""
        b, self.current = self.current, None
        self._release(b)

    def _release(self, b: int) -> None:
        del self.held[b]
        if self.current == b:
            self.current = None
        self.events.append((self.anchor, b, _RELEASE))
        self.rt._core.release(self.ids[b], self._stream())
