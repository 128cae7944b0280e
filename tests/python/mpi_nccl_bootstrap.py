# SPDX-License-Identifier: Apache-2.0
"""Under mpirun -np 3: taskswap.torch.nccl_group's bootstrap. Rank 0 of the process group makes
an NCCL unique id and torch.distributed (gloo) carries it to the group's other ranks, which pass
it with their group rank and size to taskswap's own NCCL communicator. NCCL communicators need
GPUs, so here taskswap._core.nccl_communicator is replaced by one that records its arguments;
the check is that every rank of a group got the same id from the group's first rank, for the
whole world and for a group of ranks 1 and 2 (whose first rank is global rank 1).

usage: mpirun -np 3 python3 mpi_nccl_bootstrap.py PORT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import taskswap
import taskswap.torch as tt
from loops import gloo_under_mpirun


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    made = []
    real = taskswap._core.nccl_communicator

    def recording(device, unique_id, group_rank, size, timeout_s):
        made.append((bytes(unique_id), group_rank, size))
        return "communicator"

    taskswap._core.nccl_communicator = recording
    device = taskswap.make_device(taskswap.parse_config('[device]\nbackend = "emulated"\nbudget = "1 MiB"\n').device)
    ok = True
    pair = dist.new_group([1, 2])  # every rank takes part in making it
    for group, members in ((None, list(range(world))), (pair, [1, 2])):
        if rank not in members:
            continue
        assert tt.nccl_group(group)(device) == "communicator"
        unique_id, group_rank, size = made[-1]
        ok &= group_rank == members.index(rank) and size == len(members) and len(unique_id) == 128
        ids = [torch.zeros(128, dtype=torch.uint8) for _ in members]
        dist.all_gather(ids, torch.frombuffer(bytearray(unique_id), dtype=torch.uint8), group=group)
        ok &= all(torch.equal(i, ids[0]) for i in ids)
    if len(made) == 2:
        ok &= made[0][0] != made[1][0]  # each group its own id
    taskswap._core.nccl_communicator = real
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {'ok' if ok else 'FAILED'} ({len(made)} communicators)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
