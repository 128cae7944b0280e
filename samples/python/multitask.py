#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A PyTorch multi-task trainer on taskswap: a shared trunk (one unit per layer, pinned) and one
adapter per task (swapped in and out of the device budget), one or more tasks per step from a
seeded sampler, planned ahead. The same script runs on the emulated device (CPU tensors) and on
CUDA (torch's current stream), with the model sizes of the C++ sample's [model] table.

    python3 samples/python/multitask.py samples/configs/emulated.toml
    python3 samples/python/multitask.py samples/configs/emulated.toml --all-resident   # the baseline
    mpirun -np 2 python3 samples/python/multitask.py samples/configs/emulated-mpi.toml --comm mpi
"""

from __future__ import annotations

import argparse
import sys
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import torch

import taskswap
import taskswap.torch as tt

PLAN_AHEAD = 64  # steps planned at a time


class Model(torch.nn.Module):
    def __init__(self, m: dict, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(m["seed"])
        w, hidden, out = m["width"], m["adapter_hidden"], m["outputs"]
        self.trunk = torch.nn.ModuleList(torch.nn.Linear(w, w) for _ in range(m["trunk_layers"]))
        self.adapters = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(w, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, out))
            for _ in range(m["tasks"]))
        # Each task's target: a fixed random map of the input, so every task has something to learn.
        self.teachers = torch.randn(m["tasks"], w, out, generator=g) / w ** 0.5
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(p.shape[-1], 1)) ** 0.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        for layer in self.trunk:
            x = torch.nn.functional.gelu(layer(x)) + x
        return self.adapters[task](x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a taskswap configuration with a [model] table (samples/configs/*.toml)")
    ap.add_argument("--steps", type=int, help="override [model] steps")
    ap.add_argument("--batch", type=int, help="override [model] batch")
    ap.add_argument("--tasks-per-step", type=int, default=1, help="tasks (adapters) trained in each step")
    ap.add_argument("--all-resident", action="store_true", help="every unit pinned, budget = their bytes (baseline)")
    ap.add_argument("--comm", choices=["config", "none", "mpi", "nccl"], default="config",
                    help="the communicator: the config's [comm] table, none, MPI (emulated devices, under "
                         "mpirun) or NCCL (over torch.distributed's ranks)")
    ap.add_argument("--save-state", help="torch.save the final parameters (state_dict) to this file")
    args = ap.parse_args()

    with open(args.config, "rb") as f:
        m = tomllib.load(f)["model"]
    m.setdefault("seed", 1)
    steps = args.steps or m["steps"]
    batch = args.batch or m["batch"]
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[m.get("dtype", "f32")]
    comm = "none" if args.comm == "none" else None
    if args.comm == "mpi":
        comm = tt.mpi()
    elif args.comm == "nccl":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        comm = tt.nccl_group()
    rt = tt.Runtime(args.config, own_tables=["model", "headroom"], comm=comm)
    cuda = rt.options.device.backend == taskswap.Backend.cuda
    if cuda:
        torch.cuda.set_device(rt.options.device.index)
    device = torch.device("cuda", rt.options.device.index) if cuda else torch.device("cpu")

    model = Model(m, dtype).to(device)
    pin = "pinned" if args.all_resident else None
    trunk = [rt.register(layer, f"trunk/{i}", residency=pin) for i, layer in enumerate(model.trunk)]
    adapters = [rt.register(a, f"task/{t}", residency=pin) for t, a in enumerate(model.adapters)]
    if args.all_resident:
        rt.options.device.budget = rt.all_pinned_budget()
    rt.start()
    rank, world = rt.rank, rt.world_size
    teachers = model.teachers.to(device=device, dtype=dtype)

    sampler = torch.Generator().manual_seed(1000 + rank)
    k = args.tasks_per_step
    schedule = [torch.randperm(m["tasks"], generator=sampler)[:k].tolist() for _ in range(steps)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    trained: dict[int, int] = {}
    log_every = m.get("log_every", 250)
    data = torch.Generator(device=device).manual_seed(7 + rank)
    t_start = time.perf_counter()
    for i, tasks in enumerate(schedule):
        if i % PLAN_AHEAD == 0:  # the plan: the next steps' units, as the sampler drew them
            rt.plan([[*trunk, *(adapters[t] for t in ts)] for ts in schedule[i:i + PLAN_AHEAD]])
        with rt.step(*trunk, *(adapters[t] for t in tasks)):
            losses = []
            for t in tasks:
                x = torch.randn(batch, m["width"], generator=data, device=device, dtype=dtype)
                y = x @ teachers[t]
                losses.append(torch.nn.functional.mse_loss(model(x, t).float(), y.float()))
            # One backward pass for the step's tasks: the trunk's units get their gradients once,
            # as a scope's micro_batches=1 says (with a communicator, the hooks then hand them over).
            torch.stack(losses).sum().backward()
            for t, loss in zip(tasks, losses):
                first.setdefault(t, loss.item())
                last[t] = loss.item()
                trained[t] = trained.get(t, 0) + 1
        if rank == 0 and (i + 1) % log_every == 0:
            mean = sum(last.values()) / len(last)
            s = rt.last_step
            print(f"step {i + 1:5d}  mean task loss {mean:.4f}  h2d {s.h2d_bytes / 1024:.0f} KiB  "
                  f"hits {s.hits} misses {s.misses}"
                  + (f"  reduced {s.reduced_bytes / 1024:.0f} KiB" if world > 1 else ""))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_start

    fell = sum(1 for t in last if last[t] < first[t])
    total = rt.stats().total
    if rank == 0:
        print(f"{'all-resident' if args.all_resident else 'taskswap'}: {steps} steps in {elapsed:.2f} s "
              f"({1e3 * elapsed / steps:.2f} ms/step), {k} task(s)/step, ranks {world}, device {rt.device.name}")
        print(f"loss fell on {fell} of {len(last)} tasks trained (mean first {sum(first.values()) / len(first):.4f}, "
              f"last {sum(last.values()) / len(last):.4f})")
        print(f"h2d {total.h2d_bytes / 2**20:.1f} MiB, d2h {total.d2h_bytes / 2**20:.1f} MiB, hits {total.hits}, "
              f"misses {total.misses}, unplanned {total.unplanned}, stall {total.stall_ms:.1f} ms, "
              f"peak device {total.peak_device_bytes / 2**20:.2f} MiB of a {rt.stats().budget / 2**20:.2f} MiB budget")
    if args.save_state:
        torch.save(rt.state_dict(), args.save_state if world == 1 else f"{args.save_state}.rank{rank}")
    rt.close()
    # Falling loss, judged on the tasks trained twice or more (a task trained once has one loss):
    # on average, and on at least three tasks in four (a task trained a few times may not fall
    # between two noisy batches). A run too short to train any task twice is not judged.
    again = [t for t in last if trained[t] >= 2]
    if not again:
        print(f"rank {rank}: no task was trained twice: too few steps to judge the loss")
        return 0
    mean_fell = sum(last[t] for t in again) < sum(first[t] for t in again)
    fell_again = sum(1 for t in again if last[t] < first[t])
    if not (mean_fell and 4 * fell_again >= 3 * len(again)):
        print(f"rank {rank}: the loss did not fall: on {fell_again} of the {len(again)} tasks trained twice or more")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
