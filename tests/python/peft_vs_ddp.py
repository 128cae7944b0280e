# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: samples/python/peft_multitask.py (64 LoRA adapters on a Llama-style model, the base
frozen) with taskswap (MPI communicator, average = "world") against torch DDP (gloo,
find_unused_parameters=True, every adapter in its buckets). Each rank trains its own task schedule.

Checks: per-step losses within 1e-5 of DDP's, the adapters within 1e-4 of DDP's (torch's own
AdamW implementations differ by about that), taskswap's replicas bitwise equal, and gradient
bytes per step counted on both sides (DDP's by a comm hook on its buckets). AdamW's eps is raised
to 1e-3 here, so that an update depends on the gradient's scale: a reduction that summed instead
of averaging would then move the parameters differently, and the comparison would fail.

usage: mpirun -np N python3 peft_vs_ddp.py PORT
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist

import taskswap.torch as tt
from loops import counting_ddp, gloo_under_mpirun

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "samples/python"))
import peft_multitask as sample  # noqa: E402

CONFIG = ROOT / "samples/configs/peft-emulated.toml"
STEPS = 96
EPS = 1e-3


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    with open(CONFIG, "rb") as f:
        tables = tomllib.load(f)
    m, opt = tables["model"], dict(tables["optimizer"], eps=EPS)

    ddp_bytes = [0]
    wrap = counting_ddp(world, ddp_bytes)

    ddp = sample.train_torch(m, opt, STEPS, "for-loop", rank, wrap=wrap)

    options = sample.taskswap.load_config(str(CONFIG), ["model"])
    options.optimizer.eps = EPS
    options.comm.average = sample.taskswap.Average.world
    ts = sample.train_taskswap(m, options, STEPS, comm=tt.mpi())
    assert ts["world"] == world and ts["rank"] == rank and ts["schedule"] == ddp["schedule"]

    loss_diff = max(abs(a - b) for a, b in zip(ts["losses"], ddp["losses"]))
    worst = max((ts["state"][k] - ddp["model_state"][k]).abs().max().item() for k in ts["state"])
    flat = torch.cat([v.flatten() for _, v in sorted(ts["state"].items())])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    replicas_equal = all(torch.equal(g, gathered[0]) for g in gathered)
    trained = {t for g in range(world) for t in sample.schedule(m, STEPS, g)}
    moved = sum(not torch.equal(ts["state"][k], sample.adapter_state(sample.build_model(m), m["tasks"])[k])
                for k in list(ts["state"])[:16])
    ts_bytes = ts["stats"].total.reduced_bytes
    if rank == 0:
        print(f"ranks {world}, {STEPS} steps, {m['tasks']} adapters ({len(trained)} trained by some rank): loss "
              f"difference to DDP {loss_diff:.2e}, adapters {worst:.2e}; taskswap replicas bitwise equal: "
              f"{replicas_equal}")
        print(f"gradient bytes per step: taskswap {ts_bytes / STEPS:.0f}, DDP {ddp_bytes[0] / STEPS:.0f} "
              f"({ddp_bytes[0] / max(ts_bytes, 1):.1f}x)")
    ok = loss_diff < 1e-5 and worst < 1e-4 and replicas_equal and moved > 0 and 0 < ts_bytes < ddp_bytes[0]
    # DDP's reducer and its hooks form reference cycles that keep the Gloo group alive into the
    # interpreter's exit, where its worker thread may drop a tensor after Python finalised and
    # abort the process ("terminate called without an active exception"): free them first.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED (losses {loss_diff:.2e}, adapters {worst:.2e}, replicas equal {replicas_equal}, "
              f"moved {moved}, bytes {ts_bytes} vs {ddp_bytes[0]})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
