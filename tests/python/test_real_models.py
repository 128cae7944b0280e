# SPDX-License-Identifier: Apache-2.0
"""taskswap.torch with the models people train: parameter sets spread across modules, units that are
never trained, buffers that travel with their unit, nothing lost when a call is refused, and
importing taskswap before torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import taskswap
import taskswap.torch as tt
from loops import BETAS, EPS, LR, WD, config, max_relative
from taskswap.torch._units import _TRAIN, _Use


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=os.environ, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# --- import order -------------------------------------------------------------------------------

@pytest.mark.parametrize("first", ["taskswap.torch", "taskswap", "torch"])
def test_import_order_never_matters(first):
    """taskswap loads no NCCL or CUDA runtime of its own at import, and when it loads NCCL it takes
    the one torch loaded (or would load): torch.distributed works whichever comes first."""
    if not taskswap.with_nccl:
        pytest.skip("taskswap was built without NCCL")
    early = "taskswap.nccl_library()  # NCCL before torch: the wheel's" if first == "taskswap" else ""
    out = run_python(f"""
        import {first}
        import taskswap
        {early}
        import taskswap.torch
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29480", rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        dist.destroy_process_group()
        path, version = taskswap.nccl_library()
        print(path)
        print(version, ".".join(map(str, torch.cuda.nccl.version())))
    """)
    path, versions = out.splitlines()[-2:]
    ours, torchs = versions.split()
    assert ours == torchs, f"taskswap uses NCCL {ours} ({path}), torch {torchs}"
    assert "nvidia" in path, f"taskswap loaded {path}, not the nvidia-nccl wheel torch uses"


# --- parameter sets -----------------------------------------------------------------------------

class TwoLayers(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def test_a_unit_is_any_set_of_parameters_and_trains_as_torch_does():
    """Two units made of parameters of both layers (a dict and (name, parameter) pairs, dotted names)
    train as torch.optim.AdamW trains the model."""
    model, ref = TwoLayers(), TwoLayers()
    rt = tt.Runtime(options=config("64 KiB"))
    weights = rt.register({"a.weight": model.a.weight, "b.weight": model.b.weight}, "weights")
    biases = rt.register([("layer.a.bias", model.a.bias), ("layer.b.bias", model.b.bias)], "biases",
                         no_weight_decay=["layer.a.bias", "layer.b.bias"])
    assert [n for n, _ in weights.params] == ["a.weight", "b.weight"] and weights.module is None
    opt = torch.optim.AdamW([{"params": [ref.a.weight, ref.b.weight]},
                             {"params": [ref.a.bias, ref.b.bias], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(12):
        x, y = data(step)
        with rt.step(weights, biases):
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    state = rt.state_dict()
    assert sorted(state) == ["biases.layer.a.bias", "biases.layer.b.bias", "weights.a.weight", "weights.b.weight"]
    expected = {"weights.a.weight": ref.a.weight, "weights.b.weight": ref.b.weight,
                "biases.layer.a.bias": ref.a.bias, "biases.layer.b.bias": ref.b.bias}
    assert max_relative(state, {k: v.detach() for k, v in expected.items()}) < 1e-5
    untouched = TwoLayers()
    initial = {"weights.a.weight": untouched.a.weight, "weights.b.weight": untouched.b.weight,
               "biases.layer.a.bias": untouched.a.bias, "biases.layer.b.bias": untouched.b.bias}
    assert max_relative(state, {k: v.detach() for k, v in initial.items()}) > 1e-2, "training moved them"


def test_parameter_sets_are_checked_before_anything_is_registered():
    model = TwoLayers()
    rt = tt.Runtime(options=config("64 KiB"))
    rt.register({"w": model.a.weight}, "one")
    with pytest.raises(taskswap.ConfigError, match="already in unit 'one'"):
        rt.register({"again": model.a.weight, "b": model.b.weight}, "two")
    with pytest.raises(taskswap.ConfigError, match="not an nn.Parameter"):
        rt.register({"t": torch.zeros(3)}, "three")
    with pytest.raises(taskswap.ConfigError, match="is the parameter 'x' again"):
        rt.register([("x", model.b.weight), ("y", model.b.weight)], "four")
    with pytest.raises(taskswap.ConfigError, match="no parameters"):
        rt.register({}, "five")
    assert [u.name for u in rt.units] == ["one"]
    rt.register({"b": model.b.weight}, "two")  # the refused calls registered nothing


# --- units never trained ------------------------------------------------------------------------

def test_a_frozen_unit_costs_its_parameters_and_is_used_frozen():
    base = torch.nn.Linear(64, 64)
    base.requires_grad_(False)
    head = torch.nn.Linear(64, 4)
    rt = tt.Runtime(options=config("96 KiB"))
    frozen = rt.register(base, "base", residency="pinned")
    trained = rt.register(head, "head")
    assert not frozen.trainable and trained.trainable
    param_bytes = (64 * 64 + 64) * 4
    fp = taskswap.footprint(frozen.spec(), taskswap.OptimizerPlacement.device)
    assert fp.device_bytes < param_bytes + 512 and fp.home_bytes == fp.device_bytes and fp.grad_bytes == 0
    trained_fp = taskswap.footprint(trained.spec(), taskswap.OptimizerPlacement.device)
    with pytest.raises(taskswap.InvalidArgument, match="trainable=False"):
        rt.plan([[_Use(frozen, _TRAIN)]])
    rt.plan([[frozen, trained]] * 3)  # a unit registered trainable=False is used frozen
    x = torch.randn(5, 64)
    for _ in range(3):
        with rt.step(frozen, trained):
            assert not base.weight.requires_grad
            head(torch.relu(base(x))).square().mean().backward()
            assert base.weight.grad is None
    stats = rt.stats()
    units = {u.name: u for u in stats.units}
    assert units["base"].device_bytes == fp.device_bytes and units["base"].home_bytes == fp.home_bytes
    assert units["base"].step == 0 and units["base"].write_backs == 0
    assert stats.home_bytes == fp.home_bytes + trained_fp.home_bytes
    as_trained = frozen.spec()
    as_trained.trainable = True  # parameters, m, v and gradients: four times as much
    assert taskswap.footprint(as_trained, taskswap.OptimizerPlacement.device).device_bytes >= 4 * param_bytes
    rt.close()
    assert not base.weight.requires_grad and base.weight.shape == (64, 64)


def test_trainable_resolves_from_requires_grad_and_can_be_forced():
    rt = tt.Runtime(options=config("64 KiB"))
    mixed = torch.nn.Linear(4, 4)
    mixed.bias.requires_grad_(False)
    with pytest.raises(taskswap.ConfigError, match="mixes parameters"):
        rt.register(mixed, "mixed")
    unit = rt.register(mixed, "mixed", trainable=True)  # every parameter is trained, the bias too
    rt.plan([[unit]])
    with rt.step(unit):
        assert mixed.bias.requires_grad
        mixed(torch.randn(2, 4)).sum().backward()
    rt.close()
    assert not mixed.bias.requires_grad, "close() gives back requires_grad as registered"


# --- buffers ------------------------------------------------------------------------------------

class Normed(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(8, 8, bias=False)  # a bias before a norm has no gradient but noise
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.lin(x))))


def test_buffers_travel_with_their_unit_and_match_torch():
    """BatchNorm's running statistics are state tensors: evicted and brought back with the unit,
    they end where torch's do. Its integer batch count stays with the module."""
    heads = [Normed(t) for t in range(6)]
    ref = [Normed(t) for t in range(6)]
    rt = tt.Runtime(options=config("8 KiB"))  # room for a few heads: they are evicted
    units = [rt.register(h, f"head/{t}") for t, h in enumerate(heads)]
    assert [n for n, _ in units[0].buffers] == ["norm.running_mean", "norm.running_var"]
    sched = [(3 * s) % 6 if s % 2 else s % 6 for s in range(30)]
    opts = [torch.optim.AdamW(r.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD) for r in ref]
    rt.plan([[units[t]] for t in sched])
    for step, t in enumerate(sched):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        with rt.step(units[t]):
            torch.nn.functional.mse_loss(heads[t](x), y).backward()
        opts[t].zero_grad()
        torch.nn.functional.mse_loss(ref[t](x), y).backward()
        opts[t].step()
    assert rt.stats().total.evictions > 0
    state = rt.state_dict()
    expected = {f"head/{t}.{n}": v.detach() for t, r in enumerate(ref)
                for n, v in list(r.named_parameters()) + [("norm.running_mean", r.norm.running_mean),
                                                            ("norm.running_var", r.norm.running_var)]}
    assert max_relative(state, expected) < 1e-5
    assert all(h.norm.num_batches_tracked.item() == r.norm.num_batches_tracked.item() for h, r in zip(heads, ref))
    # An eval-mode frozen use reads the statistics; a train-mode one would change what is not kept.
    frozen = units[1].frozen()
    heads[1].eval()
    rt.plan([[frozen], [frozen]])
    with rt.step(frozen):
        heads[1](torch.randn(4, 8))
    heads[1].train()
    with pytest.raises(taskswap.InvalidArgument, match="BatchNorm1d layers are in train mode.*eval mode"):
        with rt.step(frozen):
            heads[1](torch.randn(4, 8))
    assert torch.equal(rt.state_dict()["head/1.norm.running_mean"], state["head/1.norm.running_mean"])


# --- nothing lost on a refusal -------------------------------------------------------------------

def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def same(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = snapshot(model)
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)


def test_a_refused_call_leaves_the_model_and_the_runtime_as_they_were(tmp_path):
    model = Normed(0)
    before = snapshot(model)
    grads = torch.ones(8, 8)
    model.lin.weight.grad = grads
    rt = tt.Runtime(options=config("4 KiB"))
    lin = rt.register(model.lin, "lin")
    rest = rt.register({"out.weight": model.out.weight, "out.bias": model.out.bias}, "out")
    norm = rt.register(model.norm, "norm")
    # A plan the budget refuses: the runtime it started is undone, the model is as it was.
    with pytest.raises(taskswap.ConfigError, match="budget"):
        rt.plan([[lin, rest, norm]])
    assert rt.device is None and same(model, before) and model.lin.weight.grad is grads
    # A checkpoint that is not there, a step naming a unit twice, a step of another runtime's unit.
    with pytest.raises(taskswap.CheckpointError):
        rt.load_checkpoint(tmp_path / "missing")
    assert rt.device is None and same(model, before)
    other = tt.Runtime(options=config("4 KiB")).register(torch.nn.Linear(2, 2), "other")
    for bad in ([lin, lin], [lin, other]):
        with pytest.raises(taskswap.InvalidArgument):
            with rt.step(*bad):
                pass
        assert rt.device is None and same(model, before)
    # A load_state_dict with a wrong key changes nothing either.
    with pytest.raises(taskswap.InvalidArgument, match="missing keys"):
        rt.load_state_dict({"lin.weight": torch.zeros(8, 8)})
    assert same(model, before)
    # Registering is still open; then a plan that fits, training, and close(): the model has its
    # trained values and carries on in plain torch.
    rt.plan([[lin], [rest], [norm]])
    for u in (lin, rest, norm):
        with rt.step(u):
            pass
    rt.plan([[lin, rest]])
    with rt.step(lin, rest):
        model.out(model.lin(torch.randn(3, 8))).sum().backward()
    state = rt.state_dict()
    rt.close()
    assert torch.equal(model.lin.weight, state["lin.weight"]) and torch.equal(model.out.bias, state["out.out.bias"])
    assert torch.equal(model.norm.running_var, state["norm.running_var"])
    assert not torch.equal(model.lin.weight, before["lin.weight"])
    assert model.lin.weight.requires_grad and model.lin.weight.grad is None
    model(torch.randn(4, 8)).sum().backward()  # plain torch again
    assert model.lin.weight.grad is not None


def test_a_failed_start_loses_nothing():
    model = Normed(1)
    before = snapshot(model)
    rt = tt.Runtime(options=config("1 KiB"))
    rt.register(model, "all")
    with pytest.raises(taskswap.ConfigError, match="raise \\[device\\] budget"):
        rt.start()
    assert rt.device is None and same(model, before)


def test_a_model_changed_after_registration_is_refused_before_the_step():
    model = TwoLayers()
    rt = tt.Runtime(options=config("64 KiB"))
    unit = rt.register(model, "model")
    rt.plan([[unit]] * 2)
    with rt.step(unit):
        pass
    model.a.weight = torch.nn.Parameter(torch.zeros(8, 8))  # replaced: the unit holds the old one
    with pytest.raises(taskswap.InvalidArgument, match="model changed after registration.*a.weight"):
        with rt.step(unit):
            pass
    assert rt.last_step.step == 0, "the refused scope began no step"
