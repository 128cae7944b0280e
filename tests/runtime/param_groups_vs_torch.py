#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""param_groups_driver against torch.optim.AdamW with the same param groups and gradients.

Usage: param_groups_vs_torch.py DRIVER WORKDIR
Runs the driver with device and host placement, with and without gradient accumulation, and
torch.optim.AdamW over the same groups (lr x10 for the tasks, no weight decay for biases and for
task/1) on the CPU; the final parameters must agree within 1e-6 relative to each tensor's largest
magnitude. Exits 77 (skipped) when
torch is not installed.
"""
import os
import subprocess
import sys

try:
    import torch
except ImportError:
    print("param_groups_vs_torch: torch is not installed (tools/setup installs python3-torch); skipped")
    sys.exit(77)

SHAPES = [((16, 8), (8,)), ((8, 4), (4,)), ((8, 4), (4,))]  # (w, b) of trunk/0, task/0, task/1
STEPS = 12
LR, WD = 1e-2, 0.1


def offsets(u):
    """Each tensor's first element in its unit's slab (tensors start on 64 elements)."""
    w, b = SHAPES[u]
    nw = w[0] * w[1]
    return [0, (nw + 63) // 64 * 64]


def tensor(u, t, fn):
    shape = SHAPES[u][t]
    n = 1
    for d in shape:
        n *= d
    base = offsets(u)[t]
    return torch.tensor([fn(base + i) for i in range(n)], dtype=torch.float32).reshape(shape)


def initial(u):
    return lambda i: float((i * 13 + u * 3) % 17) * 0.01 - 0.08


def gradient(u, k, m):
    """As param_groups_driver.cpp's: multiples of 1/8, times 1, 2 or 4 by step."""
    return lambda i: (float((i * 7 + k * 3 + u * 5 + m) % 11) * 0.125 - 0.625) * (1 << (k % 3))


def largest_relative(name, got, want):
    """The largest difference per tensor relative to the tensor's largest magnitude (elements that
    cancel to near zero differ by the same few 1e-8 as the rest); exits past 1e-6 or on NaN."""
    err = 0.0
    at = 0
    for u in range(3):
        for shape in SHAPES[u]:
            n = 1
            for d in shape:
                n *= d
            g, w = got[at:at + n], want[at:at + n]
            e = ((g - w).abs().max() / w.abs().max()).item()
            if not e <= 1e-6:  # NaN fails too
                sys.exit(f"{name}: unit {u}, a {shape} tensor: {e:.2e} exceeds 1e-6")
            err = max(err, e)
            at += n
    return err


def model_and_optimizer():
    """The driver's three units as torch parameters, and AdamW over the driver's param groups."""
    params = [[torch.nn.Parameter(tensor(u, t, initial(u))) for t in range(2)] for u in range(3)]
    groups = [
        {"params": [params[0][0]], "lr": LR, "weight_decay": WD},
        {"params": [params[0][1]], "lr": LR, "weight_decay": 0.0},
        {"params": [params[1][0]], "lr": 10 * LR, "weight_decay": WD},
        {"params": [params[1][1], params[2][0], params[2][1]], "lr": 10 * LR, "weight_decay": 0.0},
    ]
    return params, torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)


def torch_run(micro):
    params, opt = model_and_optimizer()
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)  # the task not trained this step has no gradient: not stepped
        for u in (0, 1 + k % 2):
            for t in range(2):
                g = torch.zeros(SHAPES[u][t], dtype=torch.float32)
                for m in range(micro):  # accumulation in f32, in the driver's order
                    g += tensor(u, t, gradient(u, k, m))
                params[u][t].grad = g
        opt.step()
    return torch.cat([p.detach().reshape(-1) for unit in params for p in unit])


def main():
    driver, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    worst = 0.0
    for placement in ("device", "host"):
        for micro in (1, 3):
            out = os.path.join(work, f"groups-{placement}-{micro}.bin")
            subprocess.run([driver, out, str(STEPS), placement, str(micro)], check=True)
            with open(out, "rb") as f:
                got = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
            want = torch_run(micro)
            assert got.numel() == want.numel(), f"{got.numel()} values, expected {want.numel()}"
            err = largest_relative(f"param_groups_vs_torch: {placement}/{micro}", got, want)
            worst = max(worst, err)
            print(f"{placement} placement, {micro} micro-batch(es): largest relative difference {err:.2e}")
            if not err <= 1e-6:
                sys.exit(f"param_groups_vs_torch: {placement}/{micro}: {err:.2e} exceeds 1e-6")
    print(f"param_groups_vs_torch: every run within {worst:.2e} of torch.optim.AdamW (1e-6 allowed)")


if __name__ == "__main__":
    main()
