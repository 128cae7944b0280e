# SPDX-License-Identifier: Apache-2.0
"""Layer streaming within a step (Runtime.register_layers): a trunk many times the device budget
trains bitwise equal to the same loop with every layer resident, with trained and frozen layers,
activation checkpointing, evaluation under no_grad and steps that skip layers."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import taskswap
import taskswap.torch as tt
from loops import config

WIDTH, LAYERS, TASKS = 32, 32, 4


class Deep(torch.nn.Module):
    """A trunk of LAYERS residual blocks (each a unit when streamed) and one head per task."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, checkpoint: str | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(2 * WIDTH, WIDTH)) for _ in range(LAYERS))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(WIDTH, 3) for _ in range(TASKS))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.to(dtype)
        self.checkpoint = checkpoint  # None, "reentrant" or "non_reentrant"

    def forward(self, x: torch.Tensor, task: int, depth: int = LAYERS) -> torch.Tensor:
        if self.checkpoint == "reentrant" and torch.is_grad_enabled():
            x = x.detach().requires_grad_()  # reentrant checkpointing differentiates a layer only for such inputs
        for layer in self.layers[:depth]:
            if self.checkpoint is None or not torch.is_grad_enabled():
                x = x + layer(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.checkpoint == "reentrant")
        return self.heads[task](x)


def batch(step: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7919 * step)
    return torch.randn(8, WIDTH, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)


def layer_bytes(model: Deep, trained: bool) -> int:
    tensors = [taskswap.TensorSpec(n, list(p.shape)) for n, p in model.layers[0].named_parameters()]
    dtype = {torch.float32: taskswap.DType.f32, torch.bfloat16: taskswap.DType.bf16}[next(model.parameters()).dtype]
    spec = taskswap.UnitSpec("l", tensors, dtype, trainable=trained)
    return taskswap.footprint(spec, taskswap.OptimizerPlacement.device).device_bytes


def train(*, streamed: bool, trained_layers: bool = True, dtype: torch.dtype = torch.float32,
          checkpoint: str | None = None, steps: int = 12, depth=lambda step: LAYERS, evaluate: bool = False,
          backend: str = "emulated"):
    """Trains Deep; returns (its state, the runtime's totals, the budget, the layers' bytes)."""
    device = "cuda" if backend == "cuda" else "cpu"
    model = Deep(dtype=dtype, checkpoint=checkpoint).to(device)
    if not trained_layers:
        for p in model.layers.parameters():
            p.requires_grad_(False)
    per_layer = layer_bytes(model, trained_layers)
    rt = tt.Runtime(options=config("1 MiB", backend=backend), comm="none")
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    layers = rt.register_layers(model.layers, "trunk", residency=None if streamed else "pinned")
    # Streamed: room for two layers beside the heads (the backward holds a layer and the one above it).
    budget = rt.all_pinned_budget() - (0 if not streamed else (LAYERS - 2) * per_layer)
    if streamed and backend == "cuda":  # each unit is charged a 2 MiB granule there: the heads and three layers
        budget = (TASKS + 3) * taskswap._core.make_device(rt.options.device).granularity
    rt.options.device.budget = budget
    assert [u.name for u in layers][:2] == ["trunk/0", "trunk/1"]
    tasks = [s % TASKS for s in range(steps)]
    rt.plan([[heads[t]] for t in tasks])
    for step, t in enumerate(tasks):
        x, y = (v.to(device) for v in batch(step, dtype))
        with rt.step(heads[t]):
            loss = torch.nn.functional.mse_loss(model(x, t, depth(step)).float(), y.float())
            loss.backward()
        if evaluate and step % 3 == 0:
            with torch.no_grad(), rt.step(heads[t].frozen()):
                model(x, t)
    totals = rt.stats().total
    state = rt.state_dict()
    rt.close()
    return state, totals, budget, LAYERS * per_layer


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


@pytest.mark.parametrize("checkpoint", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("trained_layers", [True, False], ids=["trained", "frozen"])
def test_activation_checkpointing_streams_bitwise(checkpoint, trained_layers):
    """The checkpointed forward re-runs inside backward: with the layer held for its backward
    (non-reentrant), or acquired once more (reentrant: that forward runs under no_grad)."""
    plain, _, _, _ = train(streamed=False, trained_layers=trained_layers, checkpoint=checkpoint)
    streamed, totals, budget, _ = train(streamed=True, trained_layers=trained_layers, checkpoint=checkpoint)
    assert_same(streamed, plain)
    assert totals.peak_device_bytes <= budget
    if checkpoint == "non_reentrant":  # the same gradients as without checkpointing
        assert_same(streamed, train(streamed=False, trained_layers=trained_layers)[0])


def test_early_exit_and_evaluation_are_fetched_on_demand_and_never_wrong():
    depth = lambda step: LAYERS if step % 2 == 0 else LAYERS // 2  # noqa: E731  odd steps skip the top half
    streamed, totals, budget, _ = train(streamed=True, depth=depth, evaluate=True)
    resident, _, _, _ = train(streamed=False, depth=depth, evaluate=True)
    assert_same(streamed, resident)
    assert totals.peak_device_bytes <= budget
    assert totals.unplanned > 0  # the evaluations and the skipped layers' backward were not planned


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
