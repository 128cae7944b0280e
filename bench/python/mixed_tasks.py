#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tokens per second of mixed-task steps (k LoRA adapters per step over one pass of the frozen
base, Adapters.step({adapter: rows})) at k = 1, 2, 4, 8, 16, with the base resident and with it
streamed, against the anchor from the same run: plain torch + PEFT + torch.optim.AdamW, one adapter
per step, on the same model. The model is samples/configs/peft-stream.toml's (32 decoder layers)
with 32 adapters; a step's batch is `batch` rows per task, so a step of k tasks carries k times the
tokens. Each row also prints the host-to-device bytes per token: a streamed base moves once per
step, so its bytes per token fall by about k.

usage: python3 bench/python/mixed_tasks.py [--steps N] [--ks 1,2,4,8,16] [--torch-threads T]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "samples/python"))
import torch  # noqa: E402

import peft_multitask as sample  # noqa: E402
import taskswap  # noqa: E402

CONFIG = ROOT / "samples/configs/peft-stream.toml"


def options(m: dict, streamed: bool, k: int) -> taskswap.Options:
    o = taskswap.load_config(str(CONFIG), ["model"])
    if streamed:  # the config's room (three layers, the rest) and two steps of adapters
        # f32 parameters, gradients, m and v (4 x 4 bytes) of lora_A and lora_B in every target of every layer
        per_adapter = 16 * 2 * m["layers"] * len(m["targets"]) * m["rank"] * m["hidden"]
        o.device.budget += 2 * k * per_adapter
    return o


def run(m: dict, streamed: bool, k: int, steps: int) -> tuple[float, float]:
    """Tokens per second and host-to-device bytes per token of one run."""
    mm = dict(m, stream=streamed)
    r = sample.train_taskswap(mm, options(m, streamed, k), steps, all_resident=not streamed, tasks_per_step=k)
    tokens = steps * k * m["batch"] * m["sequence"]
    return tokens / r["seconds"], r["stats"].total.h2d_bytes / tokens


def anchor(m: dict, steps: int) -> float:
    """Plain torch + PEFT, one adapter per step: tokens per second."""
    with open(CONFIG, "rb") as f:
        opt = tomllib.load(f)["optimizer"]
    r = sample.train_torch(m, opt, steps, "foreach")
    return steps * m["batch"] * m["sequence"] / r["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16, help="steps of each run")
    ap.add_argument("--ks", default="1,2,4,8,16", help="tasks per step")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
    with open(CONFIG, "rb") as f:
        m = dict(tomllib.load(f)["model"], tasks=32)
    ks = [int(k) for k in args.ks.split(",")]
    base = anchor(m, args.steps)
    print(f"anchor: torch + PEFT, one adapter per step: {base:.0f} tokens/s ({args.steps} steps, {m['layers']} layers, "
          f"batch {m['batch']} x {m['sequence']} tokens per task)")
    print("| k | base resident: tokens/s | ratio to anchor | base streamed: tokens/s | ratio to anchor | "
          "streamed h2d bytes/token |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        t0 = time.perf_counter()
        resident, _ = run(m, False, k, args.steps)
        streamed, per_token = run(m, True, k, args.steps)
        print(f"| {k} | {resident:.0f} | {resident / base:.2f} | {streamed:.0f} | {streamed / base:.2f} | "
              f"{per_token:.0f} |  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
