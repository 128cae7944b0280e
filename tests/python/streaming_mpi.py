# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: streamed layers (Runtime.register_layers) with an MPI communicator, each rank on
its own batches, every step planned (the evaluations too), against the same loop with the layers
pinned. test_streaming.py's trunk of 32 residual blocks and 4 task heads.

- Frozen layers stream through a budget of two layers beside the heads (the trunk 8x the budget
  and more), with and without activation checkpointing (reentrant and not), steps in which the
  ranks exit the trunk at different depths, and evaluations under no_grad (planned forward_only):
  bitwise equal to the pinned run, the peak within the budget, the replicas bitwise equal (a use
  off the plan would have been refused). Non-reentrant checkpoints over two layers too; reentrant
  ones, and micro_batches > 1, are refused with what to change.
- Trained layers: with a communicator a trained layer's room comes back once its gradient
  bucket's reduction is launched. With the default bucket_cap the trunk is one bucket, so the
  streamed budget is refused by the plan check with a message that says so; with a bucket a
  layer, trained layers stream at that budget (with exit_early), bitwise equal to pinned and, with
  ranks exiting early at different depths, within 1e-5 of torch DDP (gloo, find_unused_parameters)
  with torch.optim.AdamW, which runs no taskswap hook. At a
  budget that holds the trained layers, the streamed loop
  (forward and backward uses acquired and released by the hooks, a rank that exits early
  contributing zeros for the layers it skipped) is bitwise equal to the pinned one, and the
  evaluations, planned forward_only, update no layer.

usage: mpirun -np N python3 streaming_mpi.py PORT
"""

from __future__ import annotations

import sys

import torch
from test_streaming import LAYERS, Deep, checkpointed_pairs, train, train_plain

import taskswap
import taskswap.torch as tt
from loops import bitwise_equal as same
from loops import (
    checklist,
    config,
    counting_ddp,
    end_under_mpirun,
    gloo_under_mpirun,
    max_relative,
    replicas_bitwise_equal,
)


def depth(step: int, rank: int) -> int:
    """The ranks exit the trunk at different depths in alternate steps."""
    return LAYERS if (step + rank) % 2 == 0 else LAYERS // 2 + rank


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    failures, check = checklist()

    common = {"comm": tt.mpi(), "depth": depth, "evaluate": True}
    for checkpoint in (None, "reentrant", "non_reentrant"):
        case = f"frozen layers, checkpointing {checkpoint}"
        streamed, totals, budget, trunk = train(streamed=True, trained_layers=False, checkpoint=checkpoint, **common)
        pinned, _, _, _ = train(streamed=False, trained_layers=False, checkpoint=checkpoint, **common)
        check(f"{case}: bitwise equal to pinned", same(streamed, pinned))
        check(f"{case}: replicas bitwise equal", replicas_bitwise_equal(streamed, world))
        check(f"{case}: trunk 8x the budget", trunk >= 8 * budget)
        check(f"{case}: peak within the budget", totals.peak_device_bytes <= budget)
        check(f"{case}: streamed", totals.evictions > 0)
        check(f"{case}: heads reduced", totals.reduced_bytes > 0)
        if rank == 0:
            print(f"{case}: trunk {trunk / budget:.1f}x the budget, peak {totals.peak_device_bytes} of {budget}, "
                  f"unplanned {totals.unplanned}, misses {totals.misses}, evictions {totals.evictions}", flush=True)
        if checkpoint == "reentrant":  # the early exits say so: the skipped layers' room goes to the backward
            exited, exited_totals, _, _ = train(streamed=True, trained_layers=False, checkpoint=checkpoint,
                                                exit_early=True, **common)
            check(f"{case}, exit_early: bitwise equal to pinned", same(exited, pinned))
            check(f"{case}, exit_early: fewer misses ({exited_totals.misses} < {totals.misses})",
                  exited_totals.misses < totals.misses)
            if rank == 0:
                print(f"{case}, exit_early: misses {exited_totals.misses}", flush=True)

    # A checkpoint over two layers: non-reentrant, each use is planned; reentrant, the second
    # layer's forward re-runs before the first one's backward, off the plan: refused, saying why.
    pairs = {"comm": tt.mpi(), "loss_of": checkpointed_pairs(False)}
    streamed, totals, budget, _ = train(streamed=True, trained_layers=False, **pairs)
    check("two-layer checkpoints, non-reentrant: bitwise equal to pinned",
          same(streamed, train(streamed=False, trained_layers=False, **pairs)[0]))
    check("two-layer checkpoints, non-reentrant: peak within the budget", totals.peak_device_bytes <= budget)
    try:
        train(streamed=True, trained_layers=False, comm=tt.mpi(), loss_of=checkpointed_pairs(True))
        check("two-layer checkpoints, reentrant: refused", False)
    except taskswap.InvalidArgument as e:
        check(f"two-layer checkpoints, reentrant: the message says what to do ({e})",
              "checkpoint each streamed layer on its own" in str(e))

    # micro_batches > 1: the plan has one forward and one backward use per layer; refused up front.
    model = Deep()
    rt = tt.Runtime(options=config("1 MiB"), comm=tt.mpi())
    head = rt.register(model.heads[0], "task/0")
    rt.register_layers(model.layers, "trunk", trainable=False)
    rt.plan([[head]])
    try:
        with rt.step(head, micro_batches=2):
            check("micro_batches=2 with streamed layers: refused", False)
    except taskswap.InvalidArgument as e:
        check(f"micro_batches=2 with streamed layers: the message says why ({e})", "micro_batches=2" in str(e))
    rt.close()

    # Trained layers at the streamed budget (two layers beside the heads): a layer's room comes back
    # once its gradient bucket's reduction is launched. With the default bucket_cap the whole trunk
    # (537 KiB of gradients) is one bucket, launched after the last layer's backward: refused,
    # saying why. With a bucket a layer's gradients
    # each, a layer's room comes back at its backward's release, as without a communicator.
    try:
        train(streamed=True, trained_layers=True, **common)
        check("trained layers at the streamed budget, one bucket: refused", False)
    except taskswap.ConfigError as e:
        check(f"trained layers at the streamed budget, one bucket: the message names the rule ({e})",
              "counts until its gradient bucket's reduction is launched" in str(e))
    layer_grads = sum(p.numel() * p.element_size() for p in Deep().layers[0].parameters())
    for checkpoint in (None, "non_reentrant"):
        case = f"trained layers at the streamed budget, a bucket a layer, checkpointing {checkpoint}"
        pinned = train(streamed=False, trained_layers=True, checkpoint=checkpoint, exit_early=True, **common)[0]
        streamed, totals, budget, trunk = train(streamed=True, trained_layers=True, checkpoint=checkpoint,
                                                exit_early=True, bucket_cap=layer_grads, **common)
        check(f"{case}: bitwise equal to pinned", same(streamed, pinned))
        check(f"{case}: replicas bitwise equal", replicas_bitwise_equal(streamed, world))
        check(f"{case}: trunk 8x the budget", trunk >= 8 * budget)
        check(f"{case}: peak within the budget", totals.peak_device_bytes <= budget)
        if checkpoint is None:  # against plain torch: DDP (gloo) and torch.optim.AdamW, no taskswap
            reference = train_plain(depth=depth, rank=rank, wrap=counting_ddp(world, [0]))
            worst = max_relative(streamed, reference)
            check(f"{case}: within 1e-5 of torch DDP ({worst:.2e})", worst < 1e-5)
            if rank == 0:
                print(f"{case}: max relative difference to torch DDP {worst:.2e}", flush=True)
        if rank == 0:
            print(f"{case}: trunk {trunk / budget:.1f}x the budget, peak {totals.peak_device_bytes} of {budget}, "
                  f"misses {totals.misses}, evictions {totals.evictions}", flush=True)

    for checkpoint in (None, "reentrant", "non_reentrant"):
        case = f"trained layers, checkpointing {checkpoint}"
        pinned, _, pinned_budget, trunk = train(streamed=False, trained_layers=True, checkpoint=checkpoint, **common)
        # Room for the trained trunk whole (held to the step's end) and one head: the heads swap.
        budget = pinned_budget - 3 * 2048
        streamed, totals, _, _ = train(streamed=True, trained_layers=True, checkpoint=checkpoint, budget=budget,
                                       **common)
        check(f"{case}: bitwise equal to pinned", same(streamed, pinned))
        check(f"{case}: replicas bitwise equal", replicas_bitwise_equal(streamed, world))
        check(f"{case}: peak within the budget", trunk <= totals.peak_device_bytes <= budget)
        check(f"{case}: swapped", totals.evictions > 0)
        check(f"{case}: layers reduced", totals.reduced_bytes > 0)
        if checkpoint is None:  # the evaluations (planned forward_only) update no layer
            trained_only = train(streamed=True, trained_layers=True, budget=budget, comm=tt.mpi(), depth=depth)[0]
            check(f"{case}: evaluations change nothing", same(streamed, trained_only))
            # A skipped layer another rank trains takes its update at exit_early, with this rank's zeros.
            exited = train(streamed=True, trained_layers=True, budget=budget, exit_early=True, **common)[0]
            check(f"{case}, exit_early: bitwise equal to pinned", same(exited, pinned))
            check(f"{case}, exit_early: replicas bitwise equal", replicas_bitwise_equal(exited, world))
        start = Deep().state_dict()["layers.3.1.weight"]
        check(f"{case}: the layers trained", not torch.equal(streamed["trunk/3.1.weight"], start))
        if rank == 0:
            print(f"{case}: peak {totals.peak_device_bytes} of {budget} (the trained trunk {trunk}), evictions "
                  f"{totals.evictions}, reduced {totals.reduced_bytes} bytes", flush=True)

    return end_under_mpirun(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
