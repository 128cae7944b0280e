# SPDX-License-Identifier: Apache-2.0
"""The multi-task model and training loops the Python tests compare: taskswap's layer against the
same loop with every unit pinned, against plain torch (torch.optim.AdamW on the CPU), and under
mpirun against torch DDP."""

from __future__ import annotations

import copy
from typing import Callable

import torch

import taskswap
import taskswap.torch as tt

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


class Model(torch.nn.Module):
    """A trunk of two layers and one head per task; `norm`: a BatchNorm after the trunk's first
    layer (which then has no bias: a bias before a norm gets only rounding noise as gradient)."""

    def __init__(self, tasks: int, width: int = 16, seed: int = 0, norm: bool = False, out: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        first = ([torch.nn.Linear(width, width, bias=False), torch.nn.BatchNorm1d(width)] if norm
                 else [torch.nn.Linear(width, width)])
        self.trunk = torch.nn.Sequential(*first, torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh())
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, out) for _ in range(tasks))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def batch(step: int, task: int, rank: int = 0, size: int = 8, width: int = 16, out: int = 3):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * step + task)
    return torch.randn(size, width, generator=g), torch.randn(size, out, generator=g)


def schedule(steps: int, tasks: int, rank: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(42 + rank)
    return torch.randint(0, tasks, (steps,), generator=g).tolist()


def config(budget: str, residency: str = "prefetch", average: str | None = None,
           backend: str = "emulated", eps: float = EPS, extra: str = "") -> taskswap.Options:
    text = f"""
[device]
backend = "{backend}"
budget = "{budget}"

[defaults]
residency = "{residency}"
lookahead = 2

[optimizer]
lr = {LR}
betas = [{BETAS[0]}, {BETAS[1]}]
eps = {eps}
weight_decay = {WD}
"""
    if average:
        text += f'\n[comm]\naverage = "{average}"\n'
    return taskswap.parse_config(text + extra, "test")


def no_decay(name: str, p) -> bool:
    return name.endswith("bias")


def register(rt: tt.Runtime, model: Model, pin_all: bool = False):
    trunk = rt.register(model.trunk, "trunk", residency="pinned", no_weight_decay=no_decay)
    heads = [rt.register(h, f"task/{t}", residency="pinned" if pin_all else None,
                         optimizer="host" if t % 3 == 1 else "device", lr_scale=2.0 if t % 2 else None,
                         no_weight_decay=no_decay)
             for t, h in enumerate(model.heads)]
    return trunk, heads


def train_taskswap(model: Model, sched: list[int], options: taskswap.Options, pin_all: bool = False,
                   comm=None, rank: int = 0, plan: bool = True, device: str = "cpu") -> tt.Runtime:
    """The loop on taskswap; `model` lives on `device` (the runtime's: cpu for the emulated one)."""
    rt = tt.Runtime(options=options, comm=comm)
    trunk, heads = register(rt, model.to(device), pin_all)
    if plan:
        rt.plan([[trunk, heads[t]] for t in sched])
    for i, t in enumerate(sched):
        x, y = (v.to(device) for v in batch(i, t, rank, out=model.heads[0].out_features))
        with rt.step(trunk, heads[t]):
            torch.nn.functional.mse_loss(model(x, t), y).backward()
    return rt


def torch_param_groups(model: Model) -> list[dict]:
    """torch's param groups matching register(): heads at odd indices with 2x lr, biases without decay."""
    groups = []
    for mod, scale in [(model.trunk, 1.0)] + [(h, 2.0 if t % 2 else 1.0) for t, h in enumerate(model.heads)]:
        for name, p in mod.named_parameters():
            groups.append({"params": [p], "lr": LR * scale, "weight_decay": 0.0 if no_decay(name, p) else WD})
    return groups


def train_torch(model: Model, sched: list[int], rank: int = 0, wrap=None, eps: float = EPS) -> torch.nn.Module:
    """Plain torch: AdamW on the CPU; a head not used in a step has no gradient and is skipped."""
    net = wrap(model) if wrap else model
    opt = torch.optim.AdamW(torch_param_groups(model), lr=LR, betas=BETAS, eps=eps, weight_decay=WD)
    for i, t in enumerate(sched):
        x, y = batch(i, t, rank, out=model.heads[0].out_features)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x, t), y).backward()
        opt.step()
    return model


def flat_state(rt: tt.Runtime) -> dict[str, torch.Tensor]:
    return rt.state_dict()


def model_state(model: Model) -> dict[str, torch.Tensor]:
    out = {f"trunk.{n}": p.detach().clone() for n, p in model.trunk.named_parameters()}
    out.update({f"trunk.{n}": b.detach().clone() for n, b in model.trunk.named_buffers() if b.is_floating_point()})
    for t, h in enumerate(model.heads):
        out.update({f"task/{t}.{n}": p.detach().clone() for n, p in h.named_parameters()})
    return out


def max_relative(a: dict, b: dict) -> float:
    """The largest difference of each tensor relative to the tensor's largest magnitude."""
    worst = 0.0
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item()
        scale = b[k].double().abs().max().item()
        if diff != diff:
            return float("inf")
        worst = max(worst, diff / max(scale, 1e-30))
    return worst


def counting_ddp(world: int, counter: list[int]):
    """A wrapper making a model DDP (find_unused_parameters=True) whose buckets are averaged by a
    comm hook that adds the bytes it reduces to counter[0]."""
    import torch.distributed as dist

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)

        def counting_allreduce(state, bucket):
            buf = bucket.buffer()
            counter[0] += buf.numel() * buf.element_size()
            buf.div_(world)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, counting_allreduce)
        return ddp
    return wrap


def gloo_under_mpirun(port: str) -> tuple[int, int]:
    """torch.distributed over gloo among the ranks mpirun started; returns (rank, world)."""
    import os

    import torch.distributed as dist
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and bitwise equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replicas_bitwise_equal(state: dict[str, torch.Tensor], world: int) -> bool:
    """Whether every rank holds the same tensors, bit for bit (a collective over gloo)."""
    import torch.distributed as dist
    flat = torch.cat([v.flatten().float() for _, v in sorted(state.items())])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def checklist() -> tuple[list[str], Callable[[str, bool], None]]:
    """A rank's failures and the check that records one (`check(name, ok)`), for end_under_mpirun."""
    failures: list[str] = []

    def check(name: str, ok: bool) -> None:
        if not ok:
            failures.append(name)

    return failures, check


def end_under_mpirun(rank: int, failures: list[str]) -> int:
    """Ends the gloo group gloo_under_mpirun made; the exit code (each rank says what failed)."""
    import gc
    import sys

    import torch.distributed as dist
    gc.collect()  # DDP's reducer cycles would keep the group alive into the interpreter's exit (mpi_vs_ddp.py)
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print(f"rank {rank}: FAILED: {failures}", file=sys.stderr)
    return 1 if failures else 0


def fresh(model: Model) -> Model:
    return copy.deepcopy(model)
