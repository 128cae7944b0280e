#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guarded steps (loss scaling, global-norm clipping) against torch on the CPU.

Usage: guarded_vs_torch.py DRIVER WORKDIR [MPIRUN]
Runs param_groups_driver with clipping and/or a loss scaler, with device and host placement, with
an injected +inf in some steps, and torch over the same groups and gradients:
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW, with GradScaler's logic written out
(torch 1.13's GradScaler and its _amp_* kernels are CUDA-only, so the CPU run repeats
torch/cuda/amp/grad_scaler.py: inv_scale = scale.double().reciprocal().float(), unscale in
place, skip optimizer.step() when a gradient is not finite, _amp_update_scale_). The final
parameters must agree within 1e-6 relative to each tensor's largest magnitude, the scaler's
scale, growth tracker and skipped steps exactly, and every step's global gradient norm (unscaled)
within 1e-5, its scale and whether it was skipped exactly. The clipping thresholds are chosen from
the steps' norms so that they bind on some steps and not on others: a threshold every step
exceeds would only show "clipped or not", which AdamW (nearly blind to a uniform factor) cannot
tell from a wrong threshold. With MPIRUN (a launcher prefix) the driver also
runs on two ranks reducing over MPI, the inf injected on the last rank only: both ranks must skip,
back off and end with the single-process result. Exits 77 (skipped) when torch is not installed.
"""
import os
import shlex
import subprocess
import sys

try:
    import torch
except ImportError:
    print("guarded_vs_torch: torch is not installed (tools/setup installs python3-torch); skipped")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from param_groups_vs_torch import gradient, largest_relative, model_and_optimizer, tensor  # noqa: E402

STEPS = 12
GROWTH_INTERVAL = 3


class CpuGradScaler:
    """torch.cuda.amp.GradScaler's arithmetic, on CPU tensors."""

    def __init__(self, init_scale):
        self.scale = torch.full((), init_scale, dtype=torch.float32)
        self.growth_tracker = 0
        self.skipped = 0

    def unscale_(self, grads):
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = False
        for g in grads:
            g.mul_(inv_scale)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf):
        if found_inf:
            self.scale = self.scale * 0.5
            self.growth_tracker = 0
            self.skipped += 1
        else:
            successful = self.growth_tracker + 1
            if successful == GROWTH_INTERVAL:
                grown = self.scale * 2.0
                if bool(torch.isfinite(grown)):
                    self.scale = grown
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful


def global_norm(grads):
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def torch_run(clip, init_scale, inf_steps):
    """The final parameters, the scaler's (scale, tracker, skipped), and per step (norm, scale
    after, skipped)."""
    params, opt = model_and_optimizer()
    scaler = CpuGradScaler(init_scale) if init_scale > 0 else None
    steps = []
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        trained = []
        scale = scaler.scale if scaler else torch.ones(())
        for u in (0, 1 + k % 2):
            for t in range(2):
                g = tensor(u, t, gradient(u, k, 0)) * scale  # the backward pass of scale * loss
                if k in inf_steps and u != 0 and t == 0:
                    g.view(-1)[3] = float("inf")
                params[u][t].grad = g
                trained.append(params[u][t])
        found_inf = scaler.unscale_([p.grad for p in trained]) if scaler else False
        norm = global_norm([p.grad for p in trained])
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, clip)
        if not found_inf:
            opt.step()
        if scaler:
            scaler.update(found_inf)
        steps.append((norm, float(scaler.scale) if scaler else 1.0, 1.0 if found_inf else 0.0))
    flat = torch.cat([p.detach().reshape(-1) for unit in params for p in unit])
    state = (float(scaler.scale), scaler.growth_tracker, scaler.skipped) if scaler else None
    return flat, state, steps


def compare(name, got, want, want_state, want_steps, clip):
    n_params = want.numel()
    expected = n_params + 3 + 3 * STEPS
    if got.numel() != expected:
        sys.exit(f"guarded_vs_torch: {name}: {got.numel()} values, expected {expected}")
    worst = largest_relative(f"guarded_vs_torch: {name}", got[:n_params], want)
    state = tuple(got[n_params:n_params + 3].tolist())
    if want_state and state != (want_state[0], float(want_state[1]), float(want_state[2])):
        sys.exit(f"guarded_vs_torch: {name}: scaler (scale, tracker, skipped) {state}, torch {want_state}")
    steps = got[n_params + 3:].reshape(STEPS, 3).tolist()
    for k, ((norm, scale, skipped), (t_norm, t_scale, t_skipped)) in enumerate(zip(steps, want_steps)):
        finite = t_norm == t_norm and abs(t_norm) != float("inf")
        norm_ok = abs(norm - t_norm) <= 1e-5 * t_norm if finite else not (norm == norm and abs(norm) != float("inf"))
        if not norm_ok or skipped != t_skipped or (want_state and scale != t_scale):
            sys.exit(f"guarded_vs_torch: {name}: step {k}: norm {norm}, scale {scale}, skipped {skipped}; torch "
                     f"{t_norm}, {t_scale}, {t_skipped}")
    if clip > 0:  # the threshold binds on some steps only: a wrong one would change the result
        finite = [n for n, _, s in want_steps if s == 0.0]
        clipped = sum(n > clip for n in finite)
        if not 0 < clipped < len(finite):
            sys.exit(f"guarded_vs_torch: {name}: clip {clip} binds on {clipped} of {len(finite)} finite steps")
    return worst


def read(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.float32)


def main():
    driver, work = sys.argv[1], sys.argv[2]
    mpirun = shlex.split(sys.argv[3]) if len(sys.argv) > 3 else None
    os.makedirs(work, exist_ok=True)
    # The steps' gradient norms (they do not depend on the parameters): thresholds between them.
    _, _, plain = torch_run(0.0, 0.0, set())
    norms = sorted(n for n, _, _ in plain)
    median, low = norms[len(norms) // 2], norms[len(norms) // 4]
    # (clip, init_scale, inf steps): clipping alone, the scaler alone, both (the last with two
    # skipped steps in a row, and a growth that a skip resets).
    cases = [(median, 0.0, []), (0.0, 1024.0, [4]), (median, 1024.0, [4, 5, 10]), (low, 2.0 ** 20, [])]
    worst = 0.0
    for clip, init_scale, inf_steps in cases:
        want, want_state, want_steps = torch_run(clip, init_scale, set(inf_steps))
        infs = ",".join(str(k) for k in inf_steps) or "-"
        for placement in ("device", "host"):
            name = f"clip {clip:.4g}, scale {init_scale}, inf at {infs}, {placement}"
            out = os.path.join(work, f"guarded-{placement}-{clip}-{init_scale}.bin")
            subprocess.run([driver, out, str(STEPS), placement, "1", str(clip), str(init_scale), infs], check=True)
            err = compare(name, read(out), want, want_state, want_steps, clip)
            worst = max(worst, err)
            print(f"{name}: largest relative difference {err:.2e}, scaler {want_state}")
        if mpirun and inf_steps and init_scale > 0:
            out = os.path.join(work, f"guarded-mpi-{clip}-{init_scale}.bin")
            env = dict(os.environ, TASKSWAP_TEST_MPI="1")
            subprocess.run(mpirun + ["-np", "2", driver, out, str(STEPS), "device", "1", str(clip), str(init_scale),
                                     infs], check=True, env=env)
            for rank in (0, 1):
                name = f"clip {clip:.4g}, scale {init_scale}, inf on rank 1 only at {infs}, rank {rank} of 2"
                err = compare(name, read(f"{out}.{rank}"), want, want_state, want_steps, clip)
                worst = max(worst, err)
                print(f"{name}: largest relative difference {err:.2e}, scaler {want_state}")
            if read(f"{out}.0").tolist() != read(f"{out}.1").tolist():
                sys.exit("guarded_vs_torch: the two ranks' parameters or scalers differ")
            # f16 units (f16 gradients, scaled): the inf on rank 1 alone skips the step on both
            # ranks, which back the scale off alike; the replicas stay bitwise equal.
            out16 = os.path.join(work, f"guarded-mpi-f16-{clip}-{init_scale}.bin")
            env16 = dict(env, TASKSWAP_TEST_COMPUTE="f16")
            subprocess.run(mpirun + ["-np", "2", driver, out16, str(STEPS), "device", "1", str(clip), str(init_scale),
                                     infs], check=True, env=env16)
            r0, r1 = read(f"{out16}.0"), read(f"{out16}.1")
            if r0.tolist() != r1.tolist():
                sys.exit("guarded_vs_torch: f16: the two ranks' parameters or scalers differ")
            if not bool(torch.isfinite(r0[:-3 - 3 * STEPS]).all()):
                sys.exit("guarded_vs_torch: f16: a parameter is not finite (the skipped step was applied)")
            state16 = tuple(r0[-3 - 3 * STEPS:-3 * STEPS].tolist())
            if state16 != (want_state[0], float(want_state[1]), float(want_state[2])):
                sys.exit(f"guarded_vs_torch: f16: scaler {state16}, expected {want_state}")
            print(f"clip {clip}, scale {init_scale}, f16 units, inf on rank 1 only at {infs}: both ranks equal, "
                  f"scaler {state16}")
    print(f"guarded_vs_torch: every run within {worst:.2e} of torch (1e-6 allowed), scalers equal")


if __name__ == "__main__":
    main()
