# SPDX-License-Identifier: Apache-2.0
"""Activation offload (Runtime.register_activations): a step's saved activations go home in
activation blocks and come back for the backward pass. The reference is plain torch: the same
model, batches and tasks trained by torch.optim.AdamW with autograd keeping its saved tensors,
which the offloaded run matches within 1e-5 (as the layers' streaming does); against the same
runtime without offload it is bitwise. The blocks are seen to leave the device and come back,
planned from the second step on."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_streaming import LAYERS, TASKS, WIDTH, Deep

import taskswap
import taskswap.torch as tt
from loops import BETAS, EPS, LR, WD, config, max_relative

ROWS = 64  # a layer saves about 48 KiB at 64 rows of width 32
BLOCK = 16 << 10


def batch(step: int, rows: int = ROWS, width: int = WIDTH):
    g = torch.Generator().manual_seed(7919 * step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, 3, generator=g)


def whole(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def train(*, offload: bool, streamed: bool = True, checkpoint: str | None = None, steps: int = 8,
          host_bytes: int = 4 << 20, keep_last: int = 1, blocks_room: int = 4, retain: bool = False,
          comm="none", extra: str = "", backend: str = "emulated", width: int = WIDTH, rows: int = ROWS,
          block: int = BLOCK, setup=None, micro_batches: int = 1, retain_from: int | None = None):
    """Trains Deep through a runtime, each step planned before it begins (each rank on batches of
    its own); returns its state and each step's stats. `setup(rt, model)` runs once registered.
    With `micro_batches`, the even steps' have half the rows. `retain_from`: the step from which on
    each runs a second backward pass (as `retain` does in every step)."""
    device = "cuda" if backend == "cuda" else "cpu"
    model = Deep(checkpoint=checkpoint, width=width).to(device)
    rt = tt.Runtime(options=config("1 MiB", backend=backend, extra=extra), comm=comm)
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    if streamed:
        rt.register_layers(model.layers, "trunk")
        named = []
    else:
        named = [rt.register(model.layers, "trunk")]
    if offload:
        rt.register_activations(host_bytes, block_bytes=block, min_bytes=1024, keep_last=keep_last)
    if setup is not None:
        setup(rt, model)
    core = taskswap._core
    granule = core.make_device(rt.options.device).granularity

    def device_bytes(u) -> int:
        return whole(core.footprint(u.spec(), core.policy_for(u.spec(), rt.options).optimizer).device_bytes, granule)

    trunk = named or [rt.unit("trunk/0")] * 2
    rt.options.device.budget = (sum(device_bytes(u) for u in heads + trunk)
                                + blocks_room * whole(block, granule))
    stats = []
    try:
        for step in range(steps):
            t = step % TASKS
            rt.plan([[*named, heads[t]]])
            twice = retain or (retain_from is not None and step >= retain_from)
            with rt.step(*named, heads[t], micro_batches=micro_batches * (2 if twice else 1)):  # backward passes
                for k in range(micro_batches):
                    n = rows if step % 2 == 1 or micro_batches == 1 else rows // 2
                    x, y = (v.to(device) for v in batch(step + 100003 * rt.rank + 50021 * k, n, width))
                    loss = torch.nn.functional.mse_loss(model(x, t), y)
                    if twice:  # a second backward pass reads every saved tensor again
                        loss.backward(retain_graph=True)
                    loss.backward()
            stats.append(rt.last_step)
        return rt.state_dict(), stats
    finally:
        rt.close()


def train_plain(*, steps: int = 8, checkpoint: str | None = None, retain: bool = False, streamed: bool = True,
                device: str = "cpu", width: int = WIDTH, rows: int = ROWS) -> dict:
    """The reference: plain torch, no taskswap; keyed as Runtime.state_dict() keys."""
    model = Deep(checkpoint=checkpoint, width=width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(steps):
        x, y = (v.to(device) for v in batch(step, rows, width))
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x, step % TASKS), y)
        if retain:
            loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
    trunk = "trunk/{}.{}" if streamed else "trunk.{}.{}"
    state = {trunk.format(i, n): p.detach().cpu() for i, layer in enumerate(model.layers)
             for n, p in layer.named_parameters()}
    state.update({f"task/{t}.{n}": p.detach().cpu() for t, h in enumerate(model.heads)
                  for n, p in h.named_parameters()})
    return state


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, first {differ[0]}"


def moved(stats, after: int = 1):
    """Blocks' bytes home and back in the steps from `after` on."""
    return sum(s.d2h_bytes for s in stats[after:]), sum(s.h2d_bytes for s in stats[after:])


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_streamed_layers_with_offloaded_activations_train_as_plain_torch(checkpoint):
    offloaded, stats = train(offload=True, checkpoint=checkpoint)
    resident, base = train(offload=False, checkpoint=checkpoint)
    assert_bitwise(offloaded, resident)
    assert max_relative(offloaded, train_plain(checkpoint=checkpoint)) < 1e-5
    # Home and back, each step, beyond what the layers move: what the layers save, the last kept.
    # A block saves LayerNorm's input and output (8 KiB each at 64 rows) and GELU's input and
    # output (16 KiB each); a checkpoint saves its input alone (reentrant: not the first layer's,
    # a leaf).
    saved = {None: (LAYERS - 1) * 48 * 1024, "reentrant": (LAYERS - 2) * 8 * 1024,
             "non_reentrant": LAYERS * 8 * 1024}[checkpoint]
    for s, b in zip(stats[1:], base[1:]):
        assert s.d2h_bytes - b.d2h_bytes >= saved
        assert s.h2d_bytes - b.h2d_bytes >= saved - 4 * BLOCK  # (up to four blocks may stay resident)
    # planned from the second step on: the blocks' uses follow the layers' as the first step had them
    assert stats[0].unplanned > 0
    assert all(s.unplanned == 0 for s in stats[1:])
    assert all(s.misses <= b.misses + 2 for s, b in zip(stats[1:], base[1:]))


def test_a_trunk_in_one_unit_offloads_its_activations_bitwise():
    offloaded, stats = train(offload=True, streamed=False, keep_last=0)
    resident, base = train(offload=False, streamed=False)
    assert_bitwise(offloaded, resident)
    assert max_relative(offloaded, train_plain(streamed=False)) < 1e-5
    assert moved(stats)[0] > moved(base)[0] + LAYERS * 16 * 1024
    assert all(s.unplanned == 0 for s in stats[1:])


def test_a_second_backward_reads_the_blocks_again():
    offloaded, _ = train(offload=True, streamed=False, retain=True, steps=4)
    assert max_relative(offloaded, train_plain(retain=True, steps=4, streamed=False)) < 1e-5
    assert_bitwise(offloaded, train(offload=False, streamed=False, retain=True, steps=4)[0])


def test_activations_beyond_the_blocks_stay_on_the_device_said_once():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, host_bytes=4 * BLOCK, steps=4)
    full = [w for w in said if "outgrow the 4 blocks" in str(w.message)]
    assert len(full) == 1
    assert_bitwise(offloaded, train(offload=False, steps=4)[0])
    assert moved(stats)[0] > 0


def assert_one_layer_kept(setup, said: str, reference_setup=None) -> None:
    """`setup` makes what one layer (48 KiB a step) saves unfit for the blocks: trained with it,
    that is said once (a warning containing `said`), the run is bitwise the one without offload
    (with `reference_setup`), and exactly that layer's 48 KiB a step stay on the device."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, setup=setup)
    assert len([w for w in warned if said in str(w.message)]) == 1
    assert_bitwise(offloaded, train(offload=False, setup=reference_setup)[0])
    _, all_offloaded = train(offload=True)
    for s, a in zip(stats[1:], all_offloaded[1:]):  # the layer's 48 KiB stay, and only they
        assert 48 * 1024 <= a.d2h_bytes - s.d2h_bytes < 48 * 1024 + BLOCK


def test_what_a_layer_saves_on_another_stream_stays_on_the_device_said_once():
    """A block is filled and read on the step's stream alone: one layer's forward runs with
    another stream current (on CUDA, torch.cuda.stream(side)); what it saves is kept."""
    def on_a_side_stream(rt, model):
        def enter(module, args):
            side = taskswap._core.Stream(rt.device, host_synchronous=True)
            rt._current_stream = lambda: side  # what torch.cuda.stream(side) makes current

        def leave(module, args, output):
            del rt._current_stream

        model.layers[1].register_forward_pre_hook(enter)
        model.layers[1].register_forward_hook(leave, always_call=True)

    assert_one_layer_kept(on_a_side_stream, "other than the step's is current stays on the device")


class Tagged(torch.Tensor):
    """A tensor subclass (as a quantisation or tracing library wraps its tensors)."""


def test_what_a_layer_saves_as_a_tensor_subclass_stays_on_the_device_said_once():
    """A saved tensor's bytes are offloaded only from a plain strided tensor: one layer runs on a
    subclass of its input (turned back into a plain tensor after it), and what it saves is kept."""
    def tag_layer_one(rt, model):
        model.layers[1].register_forward_pre_hook(lambda module, args: (args[0].as_subclass(Tagged),))
        model.layers[1].register_forward_hook(lambda module, args, output: output.as_subclass(torch.Tensor))

    assert_one_layer_kept(tag_layer_one, "(Tagged, torch.strided, cpu) is a subclass", reference_setup=tag_layer_one)


def test_per_step_opt_in_and_errors():
    model = Deep()
    rt = tt.Runtime(options=config("4 MiB"), comm="none")
    head = rt.register(model.heads[0], "task/0")
    with pytest.raises(taskswap.InvalidArgument, match="register_activations"):
        rt.step(head, offload=True)
    with pytest.raises(taskswap.ConfigError, match="holds no block"):
        rt.register_activations(1000, block_bytes=4096)
    rt.register_layers(model.layers, "trunk")
    rt.register_activations(8 << 20, block_bytes=BLOCK, min_bytes=0, keep_last=0, every_step=False)
    with pytest.raises(taskswap.InvalidArgument, match="once per runtime"):
        rt.register_activations(1 << 20)
    x, y = batch(0)
    with rt.step(head):  # every_step=False: not offloaded
        torch.nn.functional.mse_loss(model(x, 0), y).backward()
    assert rt.last_step.d2h_bytes < 1 << 16
    with rt.step(head, offload=True):
        out = model(x, 0)
        loss = torch.nn.functional.mse_loss(out, y) + out[:, :0].exp().sum()  # an empty tensor saved too
        loss.backward(retain_graph=True)
    assert rt.last_step.d2h_bytes > LAYERS * 16 * 1024
    with pytest.raises(taskswap.InvalidArgument, match="after its step scope closed"):
        loss.backward()
    with pytest.raises(taskswap.InvalidArgument, match="before the runtime starts"):
        rt.register_activations(1 << 20)
    rt.close()


class Projections(torch.nn.Module):
    """Blocks whose normed input feeds three projections (as q, k and v do): saved three times."""

    def __init__(self, layers: int = 8):
        super().__init__()
        torch.manual_seed(3)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(WIDTH) for _ in range(layers))
        self.qkv = torch.nn.ModuleList(torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
                                       for _ in range(layers))

    def forward(self, x):
        for norm, (q, k, v) in zip(self.norms, self.qkv):
            h = norm(x)
            x = x + q(h) * k(h) + v(h)
        return x


@pytest.mark.parametrize("tokens", [None, 16], ids=["rows", "batch-tokens"])
def test_a_tensor_saved_three_times_is_offloaded_once(tokens):
    """2-D inputs: linear saves h itself; 3-D: each projection saves a view of h of its own."""

    def run(offload: bool):
        model = Projections()
        rt = tt.Runtime(options=config("4 MiB"), comm="none")
        unit = rt.register(model, "model")
        if offload:
            rt.register_activations(1 << 20, block_bytes=BLOCK, min_bytes=1024)
        for step in range(3):
            x, _ = batch(step)
            if tokens:
                x = x.view(ROWS // tokens, tokens, WIDTH)
            with rt.step(unit):
                model(x).square().mean().backward()
        stashes = sum(kind == 3 for _, _, kind in rt._activations.template) if offload else 0
        state = rt.state_dict()
        rt.close()
        return state, stashes

    offloaded, stashes = run(True)
    assert_bitwise(offloaded, run(False)[0])
    # per block: its input, h once, q(h) and k(h) (8 KiB each at 64 rows); h three times would be 48 KiB
    assert 8 * 32 * 1024 // BLOCK <= stashes <= 8 * 32 * 1024 // BLOCK + 1


def test_blocks_the_host_cannot_pin_are_refused_at_start_and_nothing_is_lost():
    model = Deep()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = tt.Runtime(options=config("256 MiB"), comm="none")
    head = rt.register(model.heads[0], "task/0")
    rt.register_layers(model.layers, "trunk")
    rt.register_activations(4 << 40, block_bytes=128 << 20)  # 4 TiB of pinned host memory
    with pytest.raises(taskswap.OutOfMemory, match=r"register_activations\(host_bytes"):
        rt.plan([[head]])
    assert rt._core is None
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_micro_batches_fill_the_blocks_again_after_each_backward():
    def run(offload: bool):
        model = Deep()
        rt = tt.Runtime(options=config("4 MiB"), comm="none")
        heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
        trunk = rt.register(model.layers, "trunk")
        if offload:  # room for one micro-batch's activations, not two
            rt.register_activations(LAYERS * 48 * 1024, block_bytes=BLOCK, min_bytes=1024)
        for step in range(4):
            with rt.step(trunk, heads[0], micro_batches=2):
                for half in range(2):
                    x, y = batch(2 * step + half)
                    torch.nn.functional.mse_loss(model(x, 0), y).backward()
        stats = rt.stats().total
        state = rt.state_dict()
        rt.close()
        return state, stats

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = run(True)
    assert not [w for w in said if "outgrow" in str(w.message)]
    resident, base = run(False)
    assert_bitwise(offloaded, resident)
    assert stats.d2h_bytes > base.d2h_bytes + 8 * LAYERS * 16 * 1024
