# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: activation offload (Runtime.register_activations) with an MPI communicator, each
rank on its own batches, every step planned before it begins. test_activation_offload.py's trunk
in one unit and its heads: bitwise equal to the same loop without offload, replicas bitwise equal.
The first step's plan has no blocks, so it keeps its activations (said once); from the second on
each step offloads into the blocks its plan has (a use off the plan would have been refused).
With [comm] reduce = "every_unit" too: the blocks, which have no gradients, are not updated.

usage: mpirun -np N python3 activation_offload_mpi.py PORT
"""

from __future__ import annotations

import sys
import warnings

import torch
from test_activation_offload import LAYERS, moved, train

import taskswap.torch as tt
from loops import bitwise_equal as same
from loops import checklist, end_under_mpirun, gloo_under_mpirun, replicas_bitwise_equal


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    failures, check = checklist()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi())
    kept, base = train(offload=False, streamed=False, comm=tt.mpi())
    check("bitwise equal to the loop without offload", same(offloaded, kept))
    check("replicas bitwise equal", replicas_bitwise_equal(offloaded, world))
    check("the first step keeps its activations", stats[0].d2h_bytes == base[0].d2h_bytes)
    check("the later steps offload", moved(stats)[0] > moved(base)[0] + LAYERS * 16 * 1024)
    check("said once", sum("offloads into the blocks its plan has" in str(w.message) for w in said) == 1)
    # [comm] reduce = "every_unit" updates every unit with gradients; the blocks have none
    every = '[comm]\nreduce = "every_unit"\n'
    offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi(), extra=every)
    kept, base = train(offload=False, streamed=False, comm=tt.mpi(), extra=every)
    check("every_unit: bitwise equal to the loop without offload", same(offloaded, kept))
    check("every_unit: replicas bitwise equal", replicas_bitwise_equal(offloaded, world))
    check("every_unit: the later steps offload", moved(stats)[0] > moved(base)[0] + LAYERS * 16 * 1024)
    return end_under_mpirun(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
