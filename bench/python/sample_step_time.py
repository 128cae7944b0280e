# SPDX-License-Identifier: Apache-2.0
"""A Python sample's step time with taskswap swapping the adapters, against the same loop with
every unit resident (its anchor), from the same run: the two alternate, `--repeats` times each,
and the medians and their ratio are printed. `--sample peft` times samples/python/peft_multitask.py
(its default config: samples/configs/peft-emulated.toml), else samples/python/multitask.py.

Both runs use `--torch-threads` CPU threads for torch (OMP_NUM_THREADS; default 1, 0: torch's
own choice). On the emulated device the copies and the optimizer run on the device's threads, the
GPU's engines' stand-ins: torch's OpenMP threads spin between kernels, and where they take every
core they and the device's threads slow each other.

usage: python3 bench/python/sample_step_time.py [CONFIG] [--sample multitask|peft] [--steps N] [--repeats R]
                                                [--torch-threads T] [sample flags...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SAMPLES = {"multitask": ("samples/python/multitask.py", "samples/configs/emulated.toml"),
           "peft": ("samples/python/peft_multitask.py", "samples/configs/peft-emulated.toml")}


def step_ms(script: str, config: str, steps: int, extra: list[str], env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, str(ROOT / script), config, "--steps", str(steps), *extra],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(out.stdout + out.stderr)
    return float(re.search(r"([0-9.]+) ms/step", out.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?")
    ap.add_argument("--sample", choices=sorted(SAMPLES), default="multitask")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=1)
    args, extra = ap.parse_known_args()
    env = dict(os.environ)
    if args.torch_threads > 0:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    script, default_config = SAMPLES[args.sample]
    args.config = args.config or str(ROOT / default_config)
    swapped, resident = [], []
    for _ in range(args.repeats):
        swapped.append(step_ms(script, args.config, args.steps, extra, env))
        resident.append(step_ms(script, args.config, args.steps, extra + ["--all-resident"], env))
    s, r = statistics.median(swapped), statistics.median(resident)
    print(f"{script}, config {args.config}, {args.steps} steps, {args.repeats} alternating runs each, "
          f"torch threads {env.get('OMP_NUM_THREADS', 'default')}, flags {extra or 'none'}")
    print(f"all-resident (anchor) {r:.3f} ms/step  {resident}")
    print(f"taskswap              {s:.3f} ms/step  {swapped}")
    print(f"ratio taskswap / all-resident: {s / r:.3f}")


if __name__ == "__main__":
    main()
