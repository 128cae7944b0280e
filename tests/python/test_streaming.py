# SPDX-License-Identifier: Apache-2.0
"""Layer streaming within a step (Runtime.register_layers): a trunk many times the device budget
trains bitwise equal to the same loop with every layer resident, with trained and frozen layers,
activation checkpointing, evaluation under no_grad and steps that skip layers; and, trained, within
1e-5 of plain torch (torch.optim.AdamW, no taskswap hooks), which the resident loop cannot show."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import taskswap
import taskswap.torch as tt
from loops import BETAS, EPS, LR, WD, config, max_relative

WIDTH, LAYERS, TASKS = 32, 32, 4


class Deep(torch.nn.Module):
    """A trunk of LAYERS residual blocks (each a unit when streamed) and one head per task."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, checkpoint: str | None = None,
                 width: int = WIDTH, aux: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        block = Auxiliary if aux else torch.nn.Sequential
        self.layers = torch.nn.ModuleList(
            block(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                  torch.nn.Linear(2 * width, width)) for _ in range(LAYERS))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, 3) for _ in range(TASKS))
        self.aux = aux
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.to(dtype)
        self.checkpoint = checkpoint  # None, "reentrant" or "non_reentrant"

    def forward(self, x: torch.Tensor, task: int, depth: int = LAYERS) -> torch.Tensor:
        if self.checkpoint == "reentrant" and torch.is_grad_enabled():
            x = x.detach().requires_grad_()  # reentrant checkpointing differentiates a layer only for such inputs
        aux = 0.0
        for layer in self.layers[:depth]:
            if self.aux:  # an auxiliary output whose loss reaches every layer's backward first
                y, a = layer(x)
                x, aux = x + y, aux + a
            elif self.checkpoint is None or not torch.is_grad_enabled():
                x = x + layer(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.checkpoint == "reentrant")
        return self.heads[task](x) + 0.01 * aux


class Auxiliary(torch.nn.Sequential):
    """A block that also returns an auxiliary value (as a mixture of experts' router loss)."""

    def forward(self, x: torch.Tensor):
        y = super().forward(x)
        return y, y.square().mean()


def batch(step: int, dtype: torch.dtype, width: int = WIDTH):
    g = torch.Generator().manual_seed(7919 * step)
    return torch.randn(8, width, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)


def layer_bytes(model: Deep, trained: bool) -> int:
    """A layer's device bytes (trained: whole; frozen: its parameters)."""
    tensors = [taskswap.TensorSpec(n, list(p.shape)) for n, p in model.layers[0].named_parameters()]
    dtype = {torch.float32: taskswap.DType.f32, torch.bfloat16: taskswap.DType.bf16}[next(model.parameters()).dtype]
    spec = taskswap.UnitSpec("l", tensors, dtype, trainable=trained)
    return taskswap.footprint(spec, taskswap.OptimizerPlacement.device).device_bytes


def train(*, streamed: bool, trained_layers: bool = True, dtype: torch.dtype = torch.float32,
          checkpoint: str | None = None, steps: int = 12, depth=lambda step: LAYERS, evaluate: bool = False,
          backend: str = "emulated", width: int = WIDTH, aux: bool = False, loss_of=None, comm="none",
          budget: int | None = None, plan_evaluations: str | None = None, exit_early: bool = False,
          bucket_cap: int | None = None):
    """Trains Deep; returns (its state, the runtime's totals, the budget, the layers' bytes).
    `loss_of(model, x, y, task, step)` runs a step's forward and backward (default: one of each).
    `plan_evaluations`: None (with a communicator "forward_only", else not planned),
    "forward_only" or "training" (planned as a training step is). With a communicator every step
    is planned, each rank draws its own batches, and `depth(step, rank)` gives the layers a step
    runs. `exit_early`: a step that runs fewer than all layers says so as its forward leaves them.
    `bucket_cap`: the communicator's [comm] bucket_cap (None: the default)."""
    device = "cuda" if backend == "cuda" else "cpu"
    model = Deep(dtype=dtype, checkpoint=checkpoint, width=width, aux=aux).to(device)
    if not trained_layers:
        for p in model.layers.parameters():
            p.requires_grad_(False)
    per_layer = layer_bytes(model, trained_layers)
    rt = tt.Runtime(options=config("1 MiB", backend=backend), comm=comm)
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    layers = rt.register_layers(model.layers, "trunk", residency=None if streamed else "pinned")
    # Streamed: room for two layers beside the heads (the backward holds a layer and the one above
    # it), in whole granules of the device (256 bytes on the emulated one, 2 MiB on CUDA).
    granule = taskswap._core.make_device(rt.options.device).granularity

    def whole(n: int) -> int:
        return -(-n // granule) * granule

    if budget is None and not streamed:
        budget = rt.all_pinned_budget()
    elif budget is None:  # each unit that is not pinned is charged whole granules
        core = taskswap._core
        budget = sum(whole(core.footprint(h.spec(), core.policy_for(h.spec(), rt.options).optimizer).device_bytes)
                     for h in heads) + 2 * whole(per_layer)
        if rt.options.scaler.enabled or rt.options.optimizer.clip > 0:
            budget += whole(core.step_guard_device_bytes(len(rt.units)))
    rt.options.device.budget = budget
    if bucket_cap is not None:
        rt.options.comm.bucket_cap = bucket_cap
    assert [u.name for u in layers][:2] == ["trunk/0", "trunk/1"]
    tasks = [s % TASKS for s in range(steps)]
    planned = comm != "none"  # with a communicator every step is planned
    if plan_evaluations is None:
        plan_evaluations = "forward_only" if planned else None
    for s, t in enumerate(tasks):
        rt.plan([[heads[t]]])
        if evaluate and plan_evaluations is not None and s % 3 == 0:
            rt.plan([[heads[t].frozen()]], forward_only=plan_evaluations == "forward_only")
    rank = rt.rank
    for step, t in enumerate(tasks):
        x, y = (v.to(device) for v in batch(step + 100003 * rank, dtype, width))
        with rt.step(heads[t]) as scope:
            if loss_of is not None:
                loss_of(model, x, y, t, step)
            else:
                d = depth(step, rank) if planned else depth(step)
                out = model(x, t, d)
                if exit_early and d < LAYERS:
                    scope.exit_early()
                torch.nn.functional.mse_loss(out.float(), y.float()).backward()
        if evaluate and step % 3 == 0:
            with torch.no_grad(), rt.step(heads[t].frozen()):
                model(x, t)
    totals = rt.stats().total
    state = rt.state_dict()
    rt.close()
    return state, totals, budget, LAYERS * per_layer


def train_plain(*, trained_layers: bool = True, checkpoint: str | None = None, steps: int = 12,
                depth=lambda step: LAYERS, rank: int = 0, wrap=None, width: int = WIDTH, device: str = "cpu") -> dict:
    """The reference: Deep trained by plain torch (torch.optim.AdamW over every parameter, no
    taskswap), on train()'s batches and tasks, keyed as Runtime.state_dict() keys. A head not used
    in a step has no gradient, and AdamW skips it as taskswap does not step it. `wrap`: makes the
    model DDP (then `depth(step, rank)`, as train() with a communicator)."""
    model = Deep(checkpoint=checkpoint, width=width).to(device)
    if not trained_layers:
        for p in model.layers.parameters():
            p.requires_grad_(False)
    net = wrap(model) if wrap else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    for step in range(steps):
        t = step % TASKS
        x, y = (v.to(device) for v in batch(step + 100003 * rank, torch.float32, width))
        opt.zero_grad(set_to_none=True)
        d = depth(step, rank) if wrap else depth(step)
        torch.nn.functional.mse_loss(net(x, t, d), y).backward()
        opt.step()
    state = {f"trunk/{i}.{n}": p.detach().cpu() for i, layer in enumerate(model.layers)
             for n, p in layer.named_parameters()}
    state.update({f"task/{t}.{n}": p.detach().cpu() for t, h in enumerate(model.heads)
                  for n, p in h.named_parameters()})
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, first {differ[0]}"


@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_streamed_trunk_is_bitwise_all_resident_and_stays_in_budget(trained_layers, dtype):
    streamed, totals, budget, trunk = train(streamed=True, trained_layers=trained_layers, dtype=dtype)
    resident, resident_totals, _, _ = train(streamed=False, trained_layers=trained_layers, dtype=dtype)
    assert_same(streamed, resident)
    assert trunk >= 8 * budget, (trunk, budget)  # the trunk is 8x the budget and more
    assert totals.peak_device_bytes <= budget
    assert totals.unplanned == 0 and resident_totals.unplanned == 0
    assert totals.swap_ins >= (LAYERS - 2) * 12  # each layer came in once per step at least (not always the ends)
    # The layers trained (or stayed as they were, frozen).
    start = Deep(dtype=dtype).state_dict()
    changed = not torch.equal(streamed["trunk/3.1.weight"], start["layers.3.1.weight"])
    assert changed == trained_layers


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
def test_streamed_layers_train_as_plain_torch_does(checkpoint):
    """Against plain torch (torch.optim.AdamW, no taskswap hooks), not against taskswap's pinned
    layers, which run the same hooks: a hook that stepped a layer before its last gradient, or
    twice, or not at all, would agree with itself. Odd steps run half the trunk."""
    depth = lambda step: LAYERS if step % 2 == 0 else LAYERS // 2  # noqa: E731
    streamed, totals, budget, _ = train(streamed=True, checkpoint=checkpoint, depth=depth, exit_early=True)
    reference = train_plain(checkpoint=checkpoint, depth=depth)
    worst = max_relative(streamed, reference)
    assert worst < 1e-5, worst
    assert max_relative(reference, train_plain(steps=0)) > 1e-2  # the layers moved
    assert totals.peak_device_bytes <= budget


@pytest.mark.parametrize("checkpoint", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_activation_checkpointing_streams_bitwise(checkpoint, trained_layers):
    """The checkpointed forward re-runs inside backward: with the layer held for its backward
    (non-reentrant), or acquired there for its backward, as planned (reentrant: the first forward
    runs under no_grad, and the layer's backward follows the forward run inside backward)."""
    plain, _, _, _ = train(streamed=False, trained_layers=trained_layers, checkpoint=checkpoint)
    streamed, totals, budget, _ = train(streamed=True, trained_layers=trained_layers, checkpoint=checkpoint)
    assert_same(streamed, plain)
    assert totals.peak_device_bytes <= budget
    assert totals.unplanned == 0 and totals.misses == 0, (totals.unplanned, totals.misses)
    if checkpoint == "non_reentrant":  # the same gradients as without checkpointing
        assert_same(streamed, train(streamed=False, trained_layers=trained_layers)[0])


def checkpointed_pairs(reentrant: bool):
    """A step's loss_of: the trunk checkpointed two layers at a time (checkpoint_sequential's way)."""
    def loss_of(model, x, y, task, step):
        if reentrant:
            x = x.detach().requires_grad_()
        for i in range(0, LAYERS, 2):
            def pair(h, a=model.layers[i], b=model.layers[i + 1]):
                h = h + a(h)
                return h + b(h)
            x = torch.utils.checkpoint.checkpoint(pair, x, use_reentrant=reentrant)
        torch.nn.functional.mse_loss(model.heads[task](x).float(), y.float()).backward()
    return loss_of


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_a_checkpoint_over_two_layers_streams_bitwise_in_two_layers_of_room(reentrant, trained_layers):
    """Non-reentrant, a pair's backward begins at its second layer (held) and re-runs the first
    inside it, as its planned backward use. Reentrant, the pair's forward re-runs whole before
    either backward: the first layer is kept for its backward, the second fetched for its forward
    and again for its backward, off the plan, as before. Either way two layers of room hold, and
    the result is the resident run's."""
    loss_of = checkpointed_pairs(reentrant)
    plain, _, _, _ = train(streamed=False, trained_layers=trained_layers, loss_of=loss_of)
    streamed, totals, budget, _ = train(streamed=True, trained_layers=trained_layers, loss_of=loss_of)
    assert_same(streamed, plain)
    assert totals.peak_device_bytes <= budget
    assert (totals.unplanned > 0) == reentrant, totals.unplanned  # reentrant: each pair's second layer


def test_early_exit_and_evaluation_are_fetched_on_demand_and_never_wrong():
    depth = lambda step: LAYERS if step % 2 == 0 else LAYERS // 2  # noqa: E731  odd steps skip the top half
    streamed, totals, budget, _ = train(streamed=True, depth=depth, evaluate=True)
    resident, _, _, _ = train(streamed=False, depth=depth, evaluate=True)
    assert_same(streamed, resident)
    assert totals.peak_device_bytes <= budget
    assert totals.unplanned > 0  # the evaluations and the skipped layers' backward were not planned


@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_an_early_exit_gives_the_skipped_layers_room_to_the_backward(trained_layers):
    """Odd steps run half the trunk. The skipped layers' planned uses come before the backward's in
    the plan; they are dropped as the backward begins (runtime::skip), or where the forward says
    exit_early() as it leaves the layers, so the prefetch brings the backward's layers: no miss
    (16 per such step before; the first layer's swap-in starts just before its acquisition)."""
    depth = lambda step: LAYERS if step % 2 == 0 else LAYERS // 2  # noqa: E731
    resident, _, _, _ = train(streamed=False, trained_layers=trained_layers, depth=depth)
    for exit_early in (False, True):
        streamed, totals, budget, _ = train(streamed=True, trained_layers=trained_layers, depth=depth,
                                            exit_early=exit_early)
        assert_same(streamed, resident)
        assert totals.peak_device_bytes <= budget
        assert totals.unplanned == 0
        assert totals.misses == 0, (exit_early, totals.misses)


def test_an_evaluation_planned_forward_only_is_all_planned_and_changes_nothing():
    """Evaluations planned with forward_only: every use planned and prefetched (not planned, each
    layer is a miss), no layer fetched whole for a backward that does not come (planned as
    training steps), and the state is the training alone's."""
    evaluated, totals, budget, _ = train(streamed=True, evaluate=True, plan_evaluations="forward_only")
    as_training, training_totals, _, _ = train(streamed=True, evaluate=True, plan_evaluations="training")
    assert_same(evaluated, train(streamed=True)[0])
    assert_same(evaluated, as_training)
    assert totals.unplanned == 0 and totals.misses == 0, (totals.unplanned, totals.misses)
    unplanned_totals = train(streamed=True, evaluate=True, plan_evaluations=None)[1]  # on demand, each a miss
    assert unplanned_totals.unplanned > 0 and unplanned_totals.misses > 0
    assert totals.peak_device_bytes <= budget
    # Planned as training steps, the prefetch brings trained layers whole for their backward.
    assert totals.h2d_bytes < training_totals.h2d_bytes, (totals.h2d_bytes, training_totals.h2d_bytes)


def test_layers_are_refused_in_plans_and_steps_and_with_micro_batches():
    model = Deep()
    rt = tt.Runtime(options=config("4 MiB"), comm="none")
    head = rt.register(model.heads[0], "task/0")
    layers = rt.register_layers(model.layers, "trunk")
    with pytest.raises(taskswap.InvalidArgument, match="streamed layer"):
        rt.plan([[head, layers[0]]])
    with pytest.raises(taskswap.InvalidArgument, match="streamed layer"):
        rt.step(head, layers[1]).__enter__()
    with pytest.raises(taskswap.InvalidArgument, match="micro_batches=2 with trained streamed layers"):
        rt.step(head, micro_batches=2)
    with pytest.raises(taskswap.ConfigError, match="already registered"):
        rt.register_layers(model.layers, "trunk")
    assert len(rt.units) == 1 + LAYERS  # the refused call registered nothing
    rt.close()


@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_an_auxiliary_output_acquires_its_layer_for_backward_in_time(trained_layers):
    """Each block also returns a value with a loss of its own (as a router loss): the first of a
    layer's outputs' gradients to arrive acquires it (autograd runs nodes in reverse creation
    order, so the auxiliary one comes just before the layer's own backward, not all at the start)."""
    streamed, totals, budget, _ = train(streamed=True, trained_layers=trained_layers, aux=True)
    resident, _, _, _ = train(streamed=False, trained_layers=trained_layers, aux=True)
    assert_same(streamed, resident)
    assert totals.peak_device_bytes <= budget


def test_create_graph_gradients_reach_the_update():
    """backward(create_graph=True) makes autograd replace each .grad: the layer's update reads them."""
    def loss_of(model, x, y, task, step):
        torch.nn.functional.mse_loss(model(x, task), y).backward(create_graph=True)
    streamed, _, _, _ = train(streamed=True, loss_of=loss_of, steps=4)
    resident, _, _, _ = train(streamed=False, loss_of=loss_of, steps=4)
    plain, _, _, _ = train(streamed=False, steps=4)
    assert_same(streamed, resident)
    assert_same(streamed, plain)  # the same gradients as a plain backward


@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_a_second_backward_through_a_stepped_layer_is_refused_and_frozen_layers_allow_it(trained_layers):
    def loss_of(model, x, y, task, step):
        out = model(x, task)
        torch.nn.functional.mse_loss(out, y).backward(retain_graph=True)
        out.square().mean().backward()
    if trained_layers:
        with pytest.raises(taskswap.InvalidArgument, match="second backward pass reached the streamed layer"):
            train(streamed=True, loss_of=loss_of, steps=1)
    else:
        streamed, _, _, _ = train(streamed=True, trained_layers=False, loss_of=loss_of, steps=4)
        resident, _, _, _ = train(streamed=False, trained_layers=False, loss_of=loss_of, steps=4)
        assert_same(streamed, resident)


def test_layers_of_half_a_granule_or_less_are_refused_at_start():
    """They would share granules and could come back at another address for their backward."""
    model = Deep()
    tiny = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))  # 16.3 KiB of parameters each
    options = config("1 MiB")
    options.device.emulated.granularity = 64 * 1024  # as CUDA's 2 MiB granule is to a 1 MiB layer
    rt = tt.Runtime(options=options, comm="none")
    rt.register(model.heads[0], "task/0")
    rt.register_layers(tiny, "tiny")
    with pytest.raises(taskswap.InvalidArgument, match="at most half a device granule"):
        rt.start()
    rt.close()
