# SPDX-License-Identifier: Apache-2.0
"""The Python layer's cost per unit per step, with its anchors from the same run.

1,000 units (small linear layers) are registered and resident; each step trains `k` of them.
Loops over the same steps and data:
  torch      forward + backward of the k modules, plain torch (the anchor: what a trainer pays anyway)
  torch+opt  the same with torch.optim.AdamW (foreach) stepping the k modules' parameters and
             zero_grad: what a plain torch training loop pays (context, not the anchor)
  core       taskswap._core's acquire / grads_ready / step / release of the k units, no torch
  layer      forward + backward inside `with rt.step(...)` (taskswap.torch: acquire, aliasing,
             gradient hooks, step, release, end_step)
Reported per unit: layer − torch (the layer's overhead, target ≤ 20 µs), that overhead over torch's
own time (target on a GPU ≤ 0.15) and core (the runtime's own share of it). Emulated device here;
on CUDA the same script runs on torch's current stream.

usage: python3 torch_layer_overhead.py [--units 1000] [--per-step 1 10 100] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import taskswap
import taskswap.torch as tt


def options(units: int, device: str) -> taskswap.Options:
    return taskswap.parse_config(f"""
[device]
backend = "{device}"
budget = "{max(64, units // 4)} MiB"

[defaults]
residency = "pinned"
""", "bench")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=1000)
    ap.add_argument("--per-step", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "emulated")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    modules = [torch.nn.Linear(16, 16).to(dev) for _ in range(args.units)]
    reference = [torch.nn.Linear(16, 16).to(dev) for _ in range(args.units)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in reference]
    rt = tt.Runtime(options=options(args.units, args.device))
    units = [rt.register(m, f"u/{i}") for i, m in enumerate(modules)]
    rt.start()
    core = rt.core
    stream = rt._current_stream()
    x = torch.randn(4, 16, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    print(f"taskswap {taskswap.__version__}, torch {torch.__version__}, device {rt.device.name}, "
          f"{args.units} units registered, {os.cpu_count()} CPUs")
    print(f"{'units/step':>10} {'torch us/unit':>14} {'layer us/unit':>14} {'overhead us/unit':>17} "
          f"{'/torch':>7} {'core us/unit':>13} {'torch+opt us/unit':>18}")
    for k in args.per_step:
        steps = [[(s * k + j) % args.units for j in range(k)] for s in range(args.steps)]

        def torch_loop(steps=steps):
            for ids in steps:
                for i in ids:
                    reference[i].weight.grad = None
                    reference[i].bias.grad = None
                    reference[i](x).sum().backward()

        def torch_opt_loop(steps=steps):
            for ids in steps:
                for i in ids:
                    optimizers[i].zero_grad(set_to_none=True)
                    reference[i](x).sum().backward()
                    optimizers[i].step()

        def layer_loop(steps=steps):
            rt.plan([[units[i] for i in ids] for ids in steps])
            for ids in steps:
                with rt.step(*[units[i] for i in ids]):
                    for i in ids:
                        modules[i](x).sum().backward()

        def core_loop(steps=steps):
            core.plan([[(i, 0) for i in ids] for ids in steps])
            for ids in steps:
                for i in ids:
                    core.acquire(i, stream)
                for i in ids:
                    core.grads_ready(i, stream)
                    core.step(i, stream)
                for i in ids:
                    core.release(i, stream)
                core.end_step()

        def best(loop, k=k):
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                loop()
                sync()
                if not cuda:
                    stream.synchronize()
                times.append(time.perf_counter() - t0)
            return min(times) / (args.steps * k) * 1e6

        best(layer_loop)  # warm-up: first-touch of views and hooks
        t_torch, t_layer, t_core, t_opt = best(torch_loop), best(layer_loop), best(core_loop), best(torch_opt_loop)
        print(f"{k:>10} {t_torch:>14.1f} {t_layer:>14.1f} {t_layer - t_torch:>17.1f} "
              f"{(t_layer - t_torch) / t_torch:>7.3f} {t_core:>13.1f} {t_opt:>18.1f}")


if __name__ == "__main__":
    main()
