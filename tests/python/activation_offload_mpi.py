# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: activation offload (Runtime.register_activations) with an MPI communicator, each
rank on its own batches, every step planned before it begins. test_activation_offload.py's trunk
in one unit and its heads: bitwise equal to the same loop without offload, replicas bitwise equal.
The first step's plan has no blocks, so it keeps its activations (said once); from the second on
each step offloads into the blocks its plan has (a use off the plan would have been refused).
With [comm] reduce = "every_unit" too: the blocks, which have no gradients, are not updated.
Steps of two kinds in turn, one saving a branch its loss never reads, and micro-batches whose
size changes from step to step: a block whose plan does not read it after its stash keeps what
would go there on the device, so no use is off the plan, and a stash no read follows is left out
of the plan (the block is not sent home).

usage: mpirun -np N python3 activation_offload_mpi.py PORT
"""

from __future__ import annotations

import sys
import warnings

import torch
from test_activation_offload import LAYERS, moved, train

import taskswap
import taskswap.torch as tt
from loops import bitwise_equal as same
from loops import checklist, end_under_mpirun, gloo_under_mpirun, replicas_bitwise_equal


def a_branch_never_read_on_even_steps(rt, model) -> None:
    """Even steps also save 64 KiB after the first layer that no backward reads (three blocks whole
    and parts of two); the odd steps' trunk saves fill those blocks and read them."""
    forwards = [0]

    def branch(module, args, output):
        if forwards[0] % 2 == 0:
            torch.nn.functional.gelu(output.repeat(1, 8))  # saved, its graph dropped unread
        forwards[0] += 1

    model.layers[0].register_forward_hook(branch)


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    failures, check = checklist()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi())
    no_branch = stats
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
    # Steps unlike the last: the plan reads what the last step read
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi(),
                                 setup=a_branch_never_read_on_even_steps)
    kept, base = train(offload=False, streamed=False, comm=tt.mpi(), setup=a_branch_never_read_on_even_steps)
    check("steps of two kinds: bitwise equal to the loop without offload", same(offloaded, kept))
    check("steps of two kinds: replicas bitwise equal", replicas_bitwise_equal(offloaded, world))
    d2h, h2d = moved(stats)
    base_d2h, base_h2d = moved(base)
    check("steps of two kinds: the later steps offload and read back",
          d2h > base_d2h + LAYERS * 16 * 1024 and h2d > base_h2d + LAYERS * 16 * 1024)
    # An odd step's plan is an even step's uses: the 64 KiB its branch saved, never read, filled
    # three 16 KiB blocks whole, which the plan leaves out (not sent home)
    check("steps of two kinds: blocks the plan never reads are not sent home",
          all(s.d2h_bytes <= b.d2h_bytes - 3 * 16 * 1024 for s, b in zip(stats[1::2], no_branch[1::2])))
    check("steps of two kinds: said once", sum("offloads into the blocks its plan has" in str(w.message)
                                               for w in said) == 1)
    # Two micro-batches, of half the rows in even steps: an odd step's first fills blocks that the
    # even step's plan has no use of (its two filled the first half twice)
    offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi(), micro_batches=2)
    kept, base = train(offload=False, streamed=False, comm=tt.mpi(), micro_batches=2)
    check("micro-batches: bitwise equal to the loop without offload", same(offloaded, kept))
    check("micro-batches: replicas bitwise equal", replicas_bitwise_equal(offloaded, world))
    check("micro-batches: the later steps offload", moved(stats)[0] > moved(base)[0] + LAYERS * 16 * 1024)
    # A second backward in every step: planned from the second step on, as the first made it
    offloaded, stats = train(offload=True, streamed=False, keep_last=0, comm=tt.mpi(), retain=True, steps=4)
    kept, base = train(offload=False, streamed=False, comm=tt.mpi(), retain=True, steps=4)
    check("a second backward in every step: bitwise equal to the loop without offload", same(offloaded, kept))
    check("a second backward in every step: read back twice", moved(stats)[1] > moved(base)[1] + 2 * LAYERS * 16 * 1024)
    # A second backward from the third step on: the plan (the second step's) reads each block once
    try:
        train(offload=True, streamed=False, keep_last=0, comm=tt.mpi(), retain_from=2, steps=3)
        said = "trained"
    except taskswap.InvalidArgument as e:
        said = str(e)
    check("a read the plan lacks: refused, saying why", "reads an offloaded activation again" in said)
    return end_under_mpirun(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
