# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: mixed-task steps (Adapters.step({adapter: rows})) with an MPI communicator
(average = "world"), each rank routing its own rows to its own two or three adapters of five,
against torch DDP (gloo, find_unused_parameters=True) over test_peft_routing's MaskedLoRA (no PEFT,
no taskswap) with torch.optim.AdamW. AdamW's eps is 1e-3, so that a sum where an average belongs
would move the adapters differently.

Checks: the adapters within 1e-6 of DDP's, taskswap's replicas bitwise equal, and the gradient
bytes per step on both sides (DDP's counted by a comm hook on its buckets; taskswap reduces only
the adapters some rank trained in the step).

usage: mpirun -np N python3 peft_routing_mpi.py PORT
"""

from __future__ import annotations

import sys

import torch
from test_peft_routing import STEPS, train_plain, train_taskswap

import taskswap.torch as tt
from loops import config, counting_ddp, end_under_mpirun, gloo_under_mpirun, max_relative, replicas_bitwise_equal

EPS = 1e-3


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    failures: list[str] = []
    ddp_bytes = [0]
    reference = train_plain(rank, wrap=counting_ddp(world, ddp_bytes), eps=EPS)
    options = config("4 MiB", average="world", eps=EPS)
    got, stats = train_taskswap(comm=tt.mpi(), rank=rank, options=options)
    worst = max_relative(got, reference)
    if worst >= 1e-6:
        failures.append(f"adapters {worst:.2e} from DDP's")
    if not replicas_bitwise_equal(got, world):
        failures.append("replicas differ")
    ts_bytes = stats.total.reduced_bytes
    if not 0 < ts_bytes < ddp_bytes[0]:
        failures.append(f"gradient bytes: taskswap {ts_bytes}, DDP {ddp_bytes[0]}")
    if rank == 0:
        print(f"ranks {world}, {STEPS} mixed-task steps: adapters within {worst:.2e} of DDP's; gradient bytes per "
              f"step: taskswap {ts_bytes / STEPS:.0f}, DDP {ddp_bytes[0] / STEPS:.0f}", flush=True)
    return end_under_mpirun(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
