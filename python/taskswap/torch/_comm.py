# SPDX-License-Identifier: Apache-2.0
"""Communicator factories for Runtime(comm=...)."""

from __future__ import annotations

from typing import Callable

from .. import _core


def mpi(timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: MPI over MPI_COMM_WORLD (the emulated device, under mpirun)."""
    return lambda device: _core.mpi_communicator(device, timeout_s)


def nccl_group(process_group=None, timeout_s: float = 300.0) -> Callable[[_core.Device], _core.Communicator]:
    """A communicator factory: taskswap's own NCCL communicator over the ranks of a
    torch.distributed process group. Rank 0 of the group makes the NCCL unique id and
    torch.distributed broadcasts it; torch's own NCCL communicator is never borrowed. taskswap
    calls the NCCL torch loaded (``taskswap.nccl_library()`` says which)."""
    import torch.distributed as dist

    def make(device: _core.Device) -> _core.Communicator:
        rank = dist.get_rank(process_group)
        size = dist.get_world_size(process_group)
        box = [_core.nccl_unique_id() if rank == 0 else None]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=src, group=process_group)
        return _core.nccl_communicator(device, box[0], rank, size, timeout_s)

    return make
