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

With --instructions each of the torch, layer and core loops runs once more in a child under
valgrind's callgrind (valgrind must be installed), which counts the instructions of the trainer's
thread in a second pass of that loop alone: not the import, the setup or the first pass, and not
the emulated device's threads, counted apart. The counts hardly move with the machine's load, as
the times do; they still vary a little, as the trainer's thread polls copy-stream events whose
answers depend on timing. Valgrind's CPU has no AVX-512, so they follow torch's AVX2 paths.

usage: python3 torch_layer_overhead.py [--units 1000] [--per-step 1 10 100] [--steps 200] [--instructions]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

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


def setup(args) -> SimpleNamespace:
    """The units, their plain torch twins and the runtime, as every loop uses them."""
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    modules = [torch.nn.Linear(16, 16).to(dev) for _ in range(args.units)]
    reference = [torch.nn.Linear(16, 16).to(dev) for _ in range(args.units)]
    rt = tt.Runtime(options=options(args.units, args.device))
    units = [rt.register(m, f"u/{i}") for i, m in enumerate(modules)]
    rt.start()
    return SimpleNamespace(cuda=cuda, modules=modules, reference=reference, rt=rt, units=units,
                           optimizers=[torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in reference],
                           stream=rt._current_stream(), x=torch.randn(4, 16, device=dev))


def loops(env: SimpleNamespace, k: int, steps: int) -> dict:
    """The four loops over the same `steps` steps of `k` units each."""
    n = len(env.units)
    plan = [[(s * k + j) % n for j in range(k)] for s in range(steps)]
    reference, optimizers, modules, units, x = env.reference, env.optimizers, env.modules, env.units, env.x
    core, rt, stream = env.rt.core, env.rt, env.stream

    def torch_loop():
        for ids in plan:
            for i in ids:
                reference[i].weight.grad = None
                reference[i].bias.grad = None
                reference[i](x).sum().backward()

    def torch_opt_loop():
        for ids in plan:
            for i in ids:
                optimizers[i].zero_grad(set_to_none=True)
                reference[i](x).sum().backward()
                optimizers[i].step()

    def layer_loop():
        rt.plan([[units[i] for i in ids] for ids in plan])
        for ids in plan:
            with rt.step(*[units[i] for i in ids]):
                for i in ids:
                    modules[i](x).sum().backward()

    def core_loop():
        core.plan([[(i, 0) for i in ids] for ids in plan])
        for ids in plan:
            for i in ids:
                core.acquire(i, stream)
            for i in ids:
                core.grads_ready(i, stream)
                core.step(i, stream)
            for i in ids:
                core.release(i, stream)
            core.end_step()

    return {"torch": torch_loop, "torch+opt": torch_opt_loop, "layer": layer_loop, "core": core_loop}


def timed(args) -> None:
    env = setup(args)
    sync = torch.cuda.synchronize if env.cuda else (lambda: None)
    print(f"taskswap {taskswap.__version__}, torch {torch.__version__}, device {env.rt.device.name}, "
          f"{args.units} units registered, {os.cpu_count()} CPUs")
    print(f"{'units/step':>10} {'torch us/unit':>14} {'layer us/unit':>14} {'overhead us/unit':>17} "
          f"{'/torch':>7} {'core us/unit':>13} {'torch+opt us/unit':>18}")
    for k in args.per_step:
        loop = loops(env, k, args.steps)

        def best(name, k=k, loop=loop):
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                loop[name]()
                sync()
                if not env.cuda:
                    env.stream.synchronize()
                times.append(time.perf_counter() - t0)
            return min(times) / (args.steps * k) * 1e6

        best("layer")  # warm-up: first-touch of views and hooks
        t_torch, t_layer, t_core, t_opt = best("torch"), best("layer"), best("core"), best("torch+opt")
        print(f"{k:>10} {t_torch:>14.1f} {t_layer:>14.1f} {t_layer - t_torch:>17.1f} "
              f"{(t_layer - t_torch) / t_torch:>7.3f} {t_core:>13.1f} {t_opt:>18.1f}")


def instrumentation(state: str) -> None:
    """Turns callgrind's counting on or off (vgdb), from another thread, whose instructions are
    counted apart from the trainer's thread, which waits; checks that it took."""
    pid = f"--pid={os.getpid()}"
    said: list = []

    def call():
        try:
            subprocess.run(["vgdb", pid, "instrumentation", state], capture_output=True, timeout=120, check=True)
            said.append(subprocess.run(["vgdb", pid, "instrumentation"], capture_output=True, text=True,
                                       timeout=120, check=True).stdout)
        except (OSError, subprocess.SubprocessError) as e:
            said.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=call)
    t.start()
    t.join()
    if f"instrumentation: {state}" not in said[0]:
        raise RuntimeError(f"torch_layer_overhead: callgrind's instrumentation did not turn {state}: {said[0]!r}")


def counted(args) -> None:
    """The child of --instructions: one loop, its second pass counted by callgrind."""
    env = setup(args)
    loop = loops(env, args.per_step[0], args.steps)[args.count]
    loop()  # first pass: views made, caches warm, as in the timed loops
    env.stream.synchronize()
    instrumentation("on")
    loop()
    instrumentation("off")
    env.stream.synchronize()


def main_thread_instructions(out: str) -> int:
    """The trainer's thread's count: callgrind's first per-thread file (thread 1)."""
    with open(f"{out}-01") as f:
        totals = next((int(line.split()[1]) for line in f if line.startswith("totals:")), 0)
    if totals > 0:
        return totals
    raise RuntimeError(f"torch_layer_overhead: no instructions counted in {out}-01")


def instructions(args) -> None:
    if args.device != "emulated":
        raise SystemExit("torch_layer_overhead: --instructions counts on the emulated device only")
    if shutil.which("valgrind") is None or shutil.which("vgdb") is None:
        raise SystemExit("torch_layer_overhead: --instructions needs valgrind (apt-get install valgrind)")
    print(f"taskswap {taskswap.__version__}, torch {torch.__version__}, emulated device, {args.units} units "
          f"registered, {args.steps} steps, instructions of the trainer's thread (callgrind)")
    print(f"{'units/step':>10} {'torch /unit':>12} {'layer /unit':>12} {'overhead /unit':>15} {'/torch':>7} "
          f"{'core /unit':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.per_step:
            count = {}
            for name in ("torch", "layer", "core"):
                out = os.path.join(tmp, f"{name}.{k}")
                child = subprocess.run(
                    ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                     f"--callgrind-out-file={out}", sys.executable, __file__, "--count", name, "--per-step", str(k),
                     "--steps", str(args.steps), "--units", str(args.units), "--device", "emulated"],
                    capture_output=True, text=True, timeout=7200, env={**os.environ, "PYTHONHASHSEED": "0"})
                if child.returncode != 0:
                    raise SystemExit(f"torch_layer_overhead: the {name} loop under callgrind exited "
                                     f"{child.returncode}:\n{child.stderr[-3000:]}")
                count[name] = main_thread_instructions(out) / (args.steps * k)
            over = count["layer"] - count["torch"]
            print(f"{k:>10} {count['torch']:>12,.0f} {count['layer']:>12,.0f} {over:>15,.0f} "
                  f"{over / count['torch']:>7.3f} {count['core']:>11,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=1000)
    ap.add_argument("--per-step", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", help="cuda or emulated (default: cuda where torch sees one; --instructions: emulated)")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    ap.add_argument("--count", choices=["torch", "layer", "core"], help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.device is None:
        args.device = "cuda" if not args.instructions and torch.cuda.is_available() else "emulated"
    if args.count:
        counted(args)
    elif args.instructions:
        instructions(args)
    else:
        timed(args)


if __name__ == "__main__":
    main()
