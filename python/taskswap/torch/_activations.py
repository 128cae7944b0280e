# SPDX-License-Identifier: Apache-2.0
"""Activation offload (Runtime.register_activations): saved-tensor hooks that copy a step's large
saved activations into the runtime's activation blocks. The runtime sends each block home on its
copy stream once it is full and brings it back ahead of the backward pass in the plan's order; a
step's plan has the blocks where the step before used them, among the streamed layers' uses."""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING

import torch

from .. import _core
from ._units import _FROZEN, _RELEASE, _in_backward

if TYPE_CHECKING:
    from ._runtime import Runtime
    from ._scope import _StepScope

_STASH = 3  # a plan entry's kind: an activation block's write


class _Range:
    """A storage range offloaded: where its bytes are ((block, offset, length) pieces), what it
    holds, how many saves of it are still to be unpacked in this step (`left`), and its unpacked
    copy while some are (`flat`, 1-D). `kept`: the range itself (1-D), where a communicator's plan
    had no room for it (its pieces are where it would have gone, for the next plans)."""

    __slots__ = ("pieces", "numel", "dtype", "device", "step", "round", "left", "flat", "kept")

    def __init__(self, pieces: list[tuple[int, int, int]], x: torch.Tensor, step: int, round_: int,
                 kept: torch.Tensor | None):
        self.pieces = pieces
        self.numel, self.dtype, self.device = x.numel(), x.dtype, x.device
        self.step, self.round = step, round_
        self.left = 1
        self.flat: torch.Tensor | None = None
        self.kept = kept


class _Save:
    """One save of a range: its own shape and strides over it."""

    __slots__ = ("range", "shape", "stride")

    def __init__(self, r: _Range, x: torch.Tensor):
        self.range, self.shape, self.stride = r, x.shape, x.stride()


def _plain(x: torch.Tensor) -> bool:
    """Whether x is a plain strided tensor whose elements fill a range of its storage, each once
    (any order of dimensions): its bytes are that range's."""
    if type(x) is not torch.Tensor or x.layout is not torch.strided or x.is_nested or x.is_conj() or x.is_neg():
        return False
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _cast_of_parameter(fn) -> bool:
    """Autocast's copy of a trained parameter (it caches it on the device anyway)."""
    return fn.name().startswith("ToCopyBackward") and all(
        n is None or n.name() == "torch::autograd::AccumulateGrad" for n, _ in fn.next_functions)


class Activations:
    """A runtime's activation blocks and the hooks that fill them (Runtime.register_activations).

    Per step: the blocks are filled in order from the first, each tensor's bytes after the last
    one's (a tensor may span blocks); a block is acquired for its stash when the first byte goes
    in and released (sent home) once full, or when the backward pass begins. The backward pass
    reads a block back when it unpacks a tensor in it and releases it once every tensor in it is
    unpacked; an unpacked tensor is a copy of its own, so the block's room is free at once.

    The step's uses of the blocks are recorded, each after the how-manieth streamed layer
    acquisition it followed, and the next plans have them there. With a communicator a step
    fills only the blocks its plan has and reads only those it reads (any other use would be
    refused); the others are filled in name alone (the tensors stay where they are), so that the
    next plans have them."""

    def __init__(self, rt: Runtime, blocks: int, block_bytes: int, min_bytes: int, keep_last: int,
                 every_step: bool, prefix: str):
        self.rt = rt
        self.count, self.block_bytes = blocks, block_bytes
        self.min_bytes, self.keep_last, self.every_step = min_bytes, keep_last, every_step
        self.prefix = prefix
        self.names = [f"{prefix}/{i}" for i in range(blocks)]
        self.ids: list[int] = []  # the blocks' unit ids, once the runtime started
        self.block_of: dict[int, int] = {}  # unit id -> block; set with `ids` by `set_ids` alone
        # The blocks' uses in the last step that offloaded and ran a backward: (layer acquisitions
        # before it, block, kind).
        self.template: list[tuple[int, int, int]] = []
        # With a communicator, per planned step: each block's planned uses in order (stash, read).
        self.planned: deque[dict[int, deque[int]]] = deque()
        self.said: set[str] = set()
        self.generation = 0
        self._reset()

    # --- registration and plans --------------------------------------------------------------
    def specs(self) -> list[_core.UnitSpec]:
        return [_core.UnitSpec(n, [_core.TensorSpec("bytes", [self.block_bytes])], _core.DType.u8,
                               trainable=False, activation=True) for n in self.names]

    def set_ids(self, ids: list[int]) -> None:
        """The blocks' unit ids as the runtime starts (empty when a failed start is undone)."""
        self.ids = ids
        self.block_of = {i: b for b, i in enumerate(ids)}

    def planned_steps(self, steps: list[list[tuple[int, int]]]) -> None:
        """Steps the runtime accepted: with a communicator, each block's uses in each, in order
        (the runtime matches an acquisition with the unit's next planned use)."""
        if not self.rt._hooks:
            return
        for step in steps:
            uses: dict[int, deque[int]] = {}
            for i, kind in step:
                b = self.block_of.get(i)
                if b is not None and kind != _RELEASE:
                    uses.setdefault(b, deque()).append(kind)
            self.planned.append(uses)

    def planned_step(self, layers: list[tuple[int, int]], forward_only: bool) -> list[tuple[int, int]]:
        """The streamed layers' plan entries with the blocks' uses where the last step had them;
        none for a step that does not offload (`forward_only`), or where the record does not
        replay (each block stashed before it is read, acquired when not held, released when held)."""
        if forward_only or not self.ids or not self.template:
            return layers
        held: set[int] = set()
        stashed: set[int] = set()
        for _, b, kind in self.template:
            if (kind == _RELEASE) != (b in held) or (kind == _FROZEN and b not in stashed):
                return layers
            if kind == _RELEASE:
                held.discard(b)
            else:
                held.add(b)
                stashed.add(b)
        out, uses, acquired = [], iter(self._read_back() if self.rt._hooks else self.template), 0
        use = next(uses, None)
        for entry in [None, *layers]:
            if entry is not None:
                out.append(entry)
                acquired += entry[1] != _RELEASE
            while use is not None and use[0] <= acquired:
                out.append((self.ids[use[1]], use[2]))
                use = next(uses, None)
        while use is not None:
            out.append((self.ids[use[1]], use[2]))
            use = next(uses, None)
        return out

    def _read_back(self) -> list[tuple[int, int, int]]:
        """The template less each block's last stash where no read follows it in the step, and
        its release: with a communicator the hooks fill such a block in name alone (the tensors
        stay on the device), so planning its stash would only send the block home for nothing.
        (A stash that a later stash of the block follows unread stays: dropping it would make an
        earlier round's fill real, whose second read the plan would lack.)"""
        stash: dict[int, int] = {}  # block -> its last stash's index, while no read followed it
        for k, (_, b, kind) in enumerate(self.template):
            if kind == _FROZEN:
                stash.pop(b, None)
            elif kind == _STASH:
                stash[b] = k
        dead = set(stash.values())  # template indices dropped
        out, drop = [], set()  # drop: blocks whose next event, a release, goes with a dropped stash
        for k, (at, b, kind) in enumerate(self.template):
            if k in dead:
                drop.add(b)
            elif kind == _RELEASE and b in drop:
                drop.discard(b)
            else:
                out.append((at, b, kind))
        return out

    def offloads(self, asked: bool | None) -> bool:
        """Whether a step (or a plan's steps) offloads: as asked, else as registered."""
        return self.every_step if asked is None else asked

    def take_planned(self) -> dict[int, deque[int]] | None:
        """A step scope opens: with a communicator its plan's uses of each block (none planned:
        empty); without one None, every use is the runtime's."""
        if not self.rt._hooks:
            return None
        return self.planned.popleft() if self.planned else {}

    # --- a step --------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.scope: _StepScope | None = None
        self.hooks = None
        self.current: int | None = None  # the block being filled, and its bytes so far
        self.fill = 0
        self.next = 0  # the next block not yet filled in this step
        # With a communicator: each block's planned uses not yet made; a use the plan does not have
        # next is made in name alone (recorded, not acquired), the tensors staying on the device.
        self.uses: dict[int, deque[int]] | None = None
        self.step_stream: torch.cuda.Stream | None = None
        self.held: dict[int, torch.Tensor | None] = {}  # block -> its device bytes while acquired
        self.pending: dict[int, int] = {}  # block -> the saves in it not yet unpacked
        # (root id, storage offset, numel, dtype) -> (the root's weak reference, its version, the record)
        self.by_range: dict[tuple, tuple] = {}
        self.round = 0  # forwards whose backward ran before the next in this step (micro-batches)
        self.events: list[tuple[int, int, int]] = []
        self.acquired = 0  # streamed layer acquisitions so far
        self.forward_layer = -1  # the last streamed layer whose forward began
        self.backward_begun = False

    def begin(self, scope: _StepScope, planned: dict[int, deque[int]] | None) -> None:
        """Opens a step's offload (`planned`: take_planned()'s): the hooks are set until end()."""
        self._reset()
        self.generation += 1
        self.scope = scope
        self.uses = planned
        # torch's stream for the scope's (current as the scope opens; none on the emulated device)
        dev = self.rt._torch_device
        self.step_stream = torch.cuda.current_stream(dev) if dev.type == "cuda" and self.rt._stream is None else None
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()

    def layer_acquired(self, u, forward: bool) -> None:
        """A streamed layer was acquired: the blocks' uses after it follow it in the next plans."""
        self.acquired += 1
        if forward:
            self.forward_layer = u._layer

    def end(self, failed: bool) -> BaseException | None:
        """Closes the step's offload: the hooks go, every block still held is released (each
        whatever the others do); the blocks' uses become the next plans' if the step stashed and
        read back and did not fail. Returns the first error."""
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
        kinds = {kind for _, _, kind in self.events}
        if not failed and first is None and _STASH in kinds and _FROZEN in kinds:
            self.template = self.events
        self._reset()
        return first

    # --- the hooks -----------------------------------------------------------------------------
    def _say_once(self, key: str, what: str) -> None:
        if key not in self.said:
            self.said.add(key)
            warnings.warn(f"taskswap: {what}", RuntimeWarning, stacklevel=3)

    def _offloads(self, x: torch.Tensor, root: torch.Tensor, nbytes: int) -> bool:
        """Whether a saved tensor (a plain one, in a step's forward) goes to the blocks."""
        rt = self.rt
        if nbytes < max(self.min_bytes, 1):
            return False
        if root.grad_fn is None or _cast_of_parameter(root.grad_fn):
            return False  # parameters, their autocast copies, buffers and the batch are not activations
        if rt._layers and self.forward_layer >= len(rt._layers) - self.keep_last:
            return False  # the last layers' activations: the backward needs them first
        room = (self.block_bytes - self.fill if self.current is not None else 0) + \
            (self.count - self.next) * self.block_bytes
        if nbytes > room:
            self._say_once("full", f"the step's activations outgrow the {self.count} blocks of {self.block_bytes} "
                                   "bytes; the rest stay on the device (register_activations(host_bytes=...) sets "
                                   "how many)")
            return False
        return True

    def _pack(self, x: torch.Tensor):
        rt, scope = self.rt, self.scope
        if rt._scope is not scope or scope is None or _in_backward():
            return x.detach()  # a forward re-run in backward (checkpointing) keeps what it saves
        if not _plain(x) or x.device != rt._torch_device:
            if x.numel() * x.element_size() >= self.min_bytes:
                self._say_once("kind", f"a saved tensor ({type(x).__name__}, {x.layout}, {x.device}) is a subclass, "
                                       f"not on the runtime's device ({rt._torch_device}), or not a dense strided "
                                       "tensor: such tensors stay where they are")
            return x.detach()
        root = x._base if x._base is not None else x
        # The same range saved again (one input of several projections, each saving a view of its
        # own), its root unchanged since: the same record. Its root object, not its address: a
        # tensor freed after its offload leaves its memory to the next one.
        key = (id(root), x.storage_offset(), x.numel(), x.dtype)
        seen = self.by_range.get(key)
        if seen is not None and seen[0]() is root and seen[1] == root._version:
            r = seen[2]
            r.left += 1
            for b, _, _ in r.pieces:
                self.pending[b] += 1
            return _Save(r, x)
        if self.backward_begun and not self.held and not any(self.pending.values()):
            self._next_round()  # a micro-batch's forward after the last one's backward: the blocks again
        nbytes = x.numel() * x.element_size()
        if not self._offloads(x, root, nbytes):
            return x.detach()
        if rt._current_stream() is not scope.stream:  # a range saved again needs no copy: not asked above
            self._say_once("stream", "a tensor saved while a CUDA stream other than the step's is current stays on the "
                                     "device: the blocks are filled on the step's stream")
            return x.detach()
        first, fill = (self.current, self.fill) if self.current is not None else (self.next, 0)
        kept = None
        last = first + (fill + nbytes - 1) // self.block_bytes
        if self.uses is not None and not all(self._planned_to_read(b) for b in range(first, last + 1)):
            kept = x.detach().as_strided((x.numel(),), (1,))
            self._say_once("plan", "with a communicator a step offloads into the blocks its plan has (those the last "
                                   "step that offloaded filled, and read back where it read them); the rest of its "
                                   "activations stay on the device, and the next plans have them")
        flat = x.detach().as_strided((x.numel(),), (1,)).view(torch.uint8)  # its storage range
        pieces = []
        done = 0
        while done < nbytes:
            if self.current is None:
                self._acquire(self.next, stash=True)
                self.current, self.fill = self.next, 0
                self.next += 1
            b = self.current
            n = min(self.block_bytes - self.fill, nbytes - done)
            view = self.held[b]
            if view is not None and kept is None:
                view[self.fill:self.fill + n].copy_(flat[done:done + n])
            pieces.append((b, self.fill, n))
            self.pending[b] = self.pending.get(b, 0) + 1
            self.fill += n
            done += n
            if self.fill == self.block_bytes:
                self._close()
        r = _Range(pieces, x, self.generation, self.round, kept)
        self.by_range[key] = (weakref.ref(root), root._version, r)
        return _Save(r, x)

    def _planned_to_read(self, b: int) -> bool:
        """With a communicator: whether block b, filled now, is stashed and then read as planned."""
        q = self.uses.get(b)
        if b == self.current:  # its stash is made
            return self.held[b] is not None and bool(q) and q[0] == _FROZEN
        return q is not None and len(q) > 1 and q[0] == _STASH and q[1] == _FROZEN

    def _next_round(self) -> None:
        """The blocks are filled from the first again (records of the rounds before are spent)."""
        self.round += 1
        self.next, self.current, self.fill = 0, None, 0
        self.pending.clear()
        self.by_range.clear()
        self.backward_begun = False
        self.forward_layer = -1

    def _unpack(self, save):
        if not isinstance(save, _Save):
            return save
        r = save.range
        if r.step != self.generation or self.scope is None:
            raise _core.InvalidArgument("taskswap: backward reached an offloaded activation after its step scope "
                                        "closed; call backward inside the step scope")
        if r.round != self.round:
            raise _core.InvalidArgument("taskswap: a backward pass reached an offloaded activation of a forward whose "
                                        "blocks a later forward in the step filled again; run each forward's "
                                        "backward before the next forward, or offload in another step")
        if not self.backward_begun:
            self.backward_begun = True
            if self.current is not None:
                self._close()
        other = self._other_stream()
        flat = r.flat if r.flat is not None else r.kept
        if flat is None:
            views = [self.held[b] if b in self.held else self._acquire(b, stash=False) for b, _, _ in r.pieces]
            if any(v is None for v in views):  # with a communicator: a read the plan does not have
                raise _core.InvalidArgument(
                    "taskswap: a backward pass reads an offloaded activation again, and with a communicator a step's "
                    "plan reads each block as often as the last step that offloaded did: run the second backward in "
                    "every offloading step (the first keeps its activations), or step(..., offload=False) in this one")
            if other is not None:
                other.wait_stream(self.step_stream)  # after the blocks' arrival, which the step's stream waits for
            flat = torch.empty(r.numel, dtype=r.dtype, device=r.device)
            raw = flat.view(torch.uint8)
            done = 0
            for view, (_, at, n) in zip(views, r.pieces):
                raw[done:done + n].copy_(view[at:at + n])
                done += n
            if other is not None:
                self.step_stream.wait_stream(other)  # the blocks' release after the read
                flat.record_stream(self.step_stream)  # kept for this range's next saves (r.flat)
        else:
            if r.kept is not None:  # blocks filled in name alone: their uses, for the next plans
                for b, _, _ in r.pieces:
                    if b not in self.held:
                        self._acquire(b, stash=False)
            if other is not None:  # made on the step's stream
                other.wait_stream(self.step_stream)
                flat.record_stream(other)
        if r.left > 0:  # this step's saves of it; a second backward reads the blocks again
            r.left -= 1
            r.flat = flat if r.left > 0 else None
            for b, _, _ in r.pieces:
                self.pending[b] -= 1
        for b, _, _ in r.pieces:
            if self.pending[b] == 0 and b in self.held:
                self._release(b)
        return flat.as_strided(save.shape, save.stride)

    # --- the blocks ------------------------------------------------------------------------------
    def _stream(self):
        """The step's stream: the blocks are acquired and released on it, whatever stream is current."""
        return self.scope.stream

    def _other_stream(self):
        """torch's current CUDA stream where it is not the step's, else None. A backward node
        runs on its forward's stream, and every offloaded range was saved on the step's; but a
        non-reentrant checkpoint's input is read by its recomputation, on the stream of the
        checkpointed layer."""
        if self.step_stream is None or self.rt._current_stream() is self.scope.stream:
            return None
        return torch.cuda.current_stream(self.rt._torch_device)

    def _acquire(self, b: int, stash: bool) -> torch.Tensor | None:
        """Acquires block b (its device bytes), or, with a communicator where the plan's next use
        of it is not this one, records the use alone."""
        kind = _STASH if stash else _FROZEN
        self.events.append((self.acquired, b, kind))
        if self.uses is not None:
            q = self.uses.get(b)
            if not q or q[0] != kind:
                self.held[b] = None
                return None
            q.popleft()
        core = self.rt._core
        core.acquire(self.ids[b], self._stream(), frozen=not stash, stash=stash)
        try:
            view = self.held[b] = core.param_tensors(self.ids[b])[0].view(-1)
        except BaseException:
            core.release(self.ids[b], self._stream())
            raise
        return view

    def _close(self) -> None:
        """The block being filled goes home."""
        b, self.current = self.current, None
        self._release(b)

    def _release(self, b: int) -> None:
        if self.current == b:
            self.current = None
        self.events.append((self.acquired, b, _RELEASE))
        try:
            if self.held[b] is not None:  # else held in name alone
                self.rt._core.release(self.ids[b], self._stream())
        finally:
            del self.held[b]
