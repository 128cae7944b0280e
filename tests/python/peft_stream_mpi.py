# SPDX-License-Identifier: Apache-2.0
"""Under mpirun: samples/python/peft_multitask.py with its base streamed (samples/configs/peft-stream.toml:
32 frozen decoder layers through a budget an eighth of their size) over an MPI communicator, each rank
training its own task schedule, against the same run with every unit resident (streaming in PyTorch,
with a communicator). Without gradient checkpointing and with it, reentrant and not (each decoder layer's
forward runs again inside its backward, as that backward's planned use of the layer).

Checks: per-step losses and adapters bitwise equal to the all-resident run's on every rank, the
replicas bitwise equal across ranks, the streamed run's peak within its budget (8x smaller than
the base) and, without checkpointing, every layer in time (no miss).

usage: mpirun -np N python3 peft_stream_mpi.py PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
import torch

import taskswap.torch as tt
from loops import end_under_mpirun, gloo_under_mpirun, replicas_bitwise_equal

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "samples/python"))
import peft_multitask as sample  # noqa: E402

CONFIG = ROOT / "samples/configs/peft-stream.toml"
STEPS = 12


def main() -> int:
    rank, world = gloo_under_mpirun(sys.argv[1])
    torch.set_num_threads(1)
    with open(CONFIG, "rb") as f:
        m = tomllib.load(f)["model"]
    failures = []
    for checkpointing in (None, "non_reentrant", "reentrant"):
        runs = [sample.train_taskswap(m, sample.taskswap.load_config(str(CONFIG), ["model"]), STEPS,
                                      all_resident=resident, comm=tt.mpi(), checkpointing=checkpointing)
                for resident in (False, True)]
        streamed, resident = runs
        s = streamed["stats"].total
        ratio = streamed["streamed_bytes"] / streamed["budget"]
        differ = [k for k in streamed["state"] if not torch.equal(streamed["state"][k], resident["state"][k])]
        equal = replicas_bitwise_equal(streamed["state"], world)
        trained = {t for g in range(world) for t in sample.schedule(m, STEPS, g)}
        checks = {
            "world": streamed["world"] == world,
            "8x the budget": ratio >= 8,
            "peak within the budget": s.peak_device_bytes <= streamed["budget"],
            "streamed": s.evictions > 0,
            # (a use off the plan would have raised: with a communicator every use is planned)
            "in time": checkpointing is not None or s.misses == 0,
            "losses bitwise": streamed["losses"] == resident["losses"],
            "adapters bitwise": not differ,
            "replicas bitwise": equal,
            "reduced": s.reduced_bytes > 0,
        }
        if rank == 0:
            print(f"ranks {world}, {STEPS} steps, checkpointing {checkpointing}: base {ratio:.1f}x the budget, "
                  f"{len(trained)} tasks trained by some rank, peak {s.peak_device_bytes} of {streamed['budget']} "
                  f"bytes, unplanned {s.unplanned}, misses {s.misses}, reduced {s.reduced_bytes} bytes; "
                  f"streamed = all-resident bitwise: {not differ}; replicas bitwise equal: {equal}", flush=True)
        failures += [f"{name} (checkpointing {checkpointing})" for name, ok in checks.items() if not ok]
    return end_under_mpirun(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
