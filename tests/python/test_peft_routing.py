# SPDX-License-Identifier: Apache-2.0
"""Mixed-task steps (Adapters.step({adapter: rows})): a batch whose rows go through different LoRA
adapters over one pass of the frozen base. Against a plain-torch masked multi-adapter LoRA with
torch.optim.AdamW (no PEFT, no taskswap); swapped against all-resident, bitwise; and what a
mixed-task step cannot route is refused, saying what to change."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import taskswap
import taskswap.torch as tt
import taskswap.torch.peft as tpeft
from loops import BETAS, EPS, LR, WD, config, max_relative

peft = pytest.importorskip("peft")
warnings.filterwarnings("ignore", category=FutureWarning)

TASKS, RANK, ALPHA, STEPS, ROWS = 5, 4, 8, 12, 12
ROOT = Path(__file__).resolve().parents[2]


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def peft_model(use_dora: bool = False) -> torch.nn.Module:
    torch.manual_seed(11)  # PEFT draws lora_A (and, not initialised to zero, lora_B) from torch's generator
    cfg = dict(r=RANK, lora_alpha=ALPHA, target_modules=["fc1", "fc2"], lora_dropout=0.0, init_lora_weights=False,
               use_dora=use_dora)
    model = peft.get_peft_model(Base(), peft.LoraConfig(**cfg), adapter_name="t0")
    for t in range(1, TASKS):
        model.add_adapter(f"t{t}", peft.LoraConfig(**cfg))
    return model


def routing(step: int, rank: int = 0) -> dict[str, list[int]]:
    """Step `step`'s rows per adapter on `rank`: two or three of the tasks, rows dealt in turn (one
    row of every fourth step goes through the base alone)."""
    g = torch.Generator().manual_seed(500 + step + 7919 * rank)
    tasks = torch.randperm(TASKS, generator=g)[: 2 + step % 2].tolist()
    rows: dict[str, list[int]] = {f"t{t}": [] for t in tasks}
    for r in range(ROWS - (1 if step % 4 == 0 else 0)):
        rows[f"t{tasks[r % len(tasks)]}"].append(r)
    return rows


def batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(900 + step + 100003 * rank)
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 8, generator=g)


def train_taskswap(budget: str | None = None, route=routing, comm="none", rank: int = 0,
                   options: taskswap.Options | None = None) -> tuple[dict[str, torch.Tensor], taskswap.RuntimeStats]:
    """The adapters' state after STEPS mixed-task steps, and the runtime's stats."""
    model = peft_model()
    rt = tt.Runtime(options=options or config("4 MiB"), comm=comm)
    adapters = tpeft.register(rt, model, base="one", base_residency="pinned")
    if budget is not None:
        rt.options.device.budget = taskswap.parse_size(budget)
    rt.plan([adapters.uses(list(route(s, rank))) for s in range(STEPS)])
    for s in range(STEPS):
        x, y = batch(s, rank)
        with adapters.step(route(s, rank)):
            torch.nn.functional.mse_loss(model(x), y).backward()
    state = {k: v for k, v in rt.state_dict().items() if k.startswith("adapter/")}
    stats = rt.stats()
    rt.close()
    return state, stats


class MaskedLoRA(torch.nn.Module):
    """The reference: the same base (frozen) and adapters as plain parameters; each layer adds, for
    every adapter of the step, mask_t * (x A_t^T B_t^T) * alpha / r, where mask_t is 1 on the
    adapter's rows (no gathers, no PEFT). Adapters a step does not name take no part in it."""

    def __init__(self):
        super().__init__()
        model = peft_model()
        self.base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
        self.lora = torch.nn.ParameterDict({n.replace(".", "|"): torch.nn.Parameter(p.detach().clone())
                                            for n, p in model.named_parameters() if "lora_" in n})

    def layer(self, x, name, rows):
        w = self.base[f"base_model.model.{name}.base_layer.weight"]
        b = self.base[f"base_model.model.{name}.base_layer.bias"]
        out = x @ w.T + b
        for t, rs in rows.items():
            mask = torch.zeros(x.shape[0], 1)
            mask[rs] = 1.0
            a = self.lora[f"base_model|model|{name}|lora_A|{t}|weight"]
            bb = self.lora[f"base_model|model|{name}|lora_B|{t}|weight"]
            out = out + mask * ((x @ a.T) @ bb.T) * (ALPHA / RANK)
        return out

    def forward(self, x, rows):
        return self.layer(torch.tanh(self.layer(x, "fc1", rows)), "fc2", rows)

    def state(self) -> dict[str, torch.Tensor]:
        """Keyed as the adapter units' state: "adapter/t3.<place>.lora_A.t3.weight"."""
        out = {}
        for key, p in self.lora.items():
            n = key.replace("|", ".")
            out[f"adapter/{n.split('.')[-2]}.{n}"] = p.detach().clone()
        return out


def train_plain(rank: int = 0, wrap=None, eps: float = EPS) -> dict[str, torch.Tensor]:
    """MaskedLoRA trained with torch.optim.AdamW (which skips an adapter without a gradient);
    `wrap`: makes it DDP."""
    ref = MaskedLoRA()
    net = wrap(ref) if wrap else ref
    opt = torch.optim.AdamW(ref.lora.values(), lr=LR, betas=BETAS, eps=eps, weight_decay=WD)
    for s in range(STEPS):
        x, y = batch(s, rank)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x, routing(s, rank)), y).backward()
        opt.step()
    return ref.state()


def test_a_mixed_task_step_trains_each_adapter_on_its_rows_as_plain_torch_does():
    got, _ = train_taskswap()
    want = train_plain()
    assert got.keys() == want.keys()
    worst = max_relative(got, want)
    assert worst < 1e-6, worst
    assert max_relative(want, MaskedLoRA().state()) > 1e-2  # the adapters trained


def test_a_mixed_task_step_swapped_equals_all_resident_bitwise():
    resident, _ = train_taskswap()
    swapped, _ = train_taskswap(budget="40 KiB")  # the base and about two adapters
    assert all(torch.equal(resident[k], swapped[k]) for k in resident)


def test_what_a_mixed_task_step_cannot_route_is_refused_and_changes_nothing():
    model = peft_model(use_dora=True)
    rt = tt.Runtime(options=config("4 MiB"), comm="none")
    adapters = tpeft.register(rt, model, base="one", base_residency="pinned")
    active = [list(m.active_adapters) for m in model.modules() if hasattr(m, "lora_variant")]
    with pytest.raises(taskswap.InvalidArgument, match="LoRA variant"):
        adapters.step({"t0": [0, 1], "t1": [2]})
    assert all("forward" not in m.__dict__ for m in model.modules())  # the layers' own forwards
    assert [list(m.active_adapters) for m in model.modules() if hasattr(m, "lora_variant")] == active  # unchanged
    with pytest.raises(taskswap.InvalidArgument, match="routed to both"):
        adapters.step({"t0": [0, 1], "t1": [1]})
    with pytest.raises(taskswap.InvalidArgument, match="row indices"):
        adapters.step({"t0": [[0, 1]]})
    with pytest.raises(taskswap.InvalidArgument, match="has no adapter 't9'"):
        adapters.step({"t9": [0]})
    rt.close()
    # A row beyond the batch, and a layer whose input's first dimension is not the batch's: refused
    # inside the forward (before any device sees an index), and the forwards come back.
    model = peft_model()
    rt = tt.Runtime(options=config("4 MiB"), comm="none")
    adapters = tpeft.register(rt, model, base="one", base_residency="pinned")
    x, y = batch(0)
    for rows, inputs in (({"t0": [0, ROWS]}, x), ({"t0": [0, 1]}, x[:1])):
        with pytest.raises(taskswap.InvalidArgument, match="first dimension"):
            with adapters.step(rows):
                model(inputs)
        assert all("forward" not in m.__dict__ for m in model.modules())
    with adapters.step({"t0": [0, 1], "t1": []}):  # t1 has no rows: not trained in this step
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert rt.last_step is not None
    rt.close()


def test_the_peft_sample_trains_eight_tasks_per_step_and_swapped_equals_all_resident(tmp_path):
    """samples/python/peft_multitask.py --tasks-per-step 8: the loss falls on every task (its exit
    code), with no miss, and the adapters equal the all-resident run's bitwise."""
    states = []
    for flags in ([], ["--all-resident"]):
        save = tmp_path / f"run{len(flags)}.pt"
        out = subprocess.run([sys.executable, str(ROOT / "samples/python/peft_multitask.py"),
                              str(ROOT / "samples/configs/peft-mixed.toml"), "--tasks-per-step", "8", "--steps", "160",
                              "--save", str(save), *flags], capture_output=True, text=True, env=os.environ)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "loss fell on 64 of 64 tasks" in out.stdout, out.stdout
        if not flags:
            assert ", misses 0, unplanned 0," in out.stdout, out.stdout
        states.append(torch.load(save)["model_state"])
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
