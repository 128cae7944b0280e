# SPDX-License-Identifier: Apache-2.0
"""taskswap for PyTorch trainers (torch 2.1 and later).

A trainer registers sets of parameters as units: a module (its parameters and buffers), or any
parameters spread across modules (a PEFT adapter: see ``taskswap.torch.peft``). taskswap keeps
their values and AdamW state at home (pinned host memory) and brings the ones a step uses onto
the device. Inside a step scope each registered ``nn.Parameter`` aliases its unit's device slab
(``p.data``) and its gradient aliases the unit's gradient slab (``p.grad``), so autograd
accumulates straight into the memory taskswap reduces and steps::

    rt = taskswap.torch.Runtime("taskswap.toml")
    trunk = rt.register(model.trunk, "trunk", residency="pinned")
    heads = [rt.register(h, f"task/{t}") for t, h in enumerate(model.heads)]
    rt.plan([[trunk, heads[t]] for t in upcoming_tasks])
    for t, (x, y) in zip(upcoming_tasks, batches):
        with rt.step(trunk, heads[t]):
            loss = loss_fn(model(x, t), y)
            loss.backward()
        # leaving the scope: gradients ready, AdamW step, release, end of step
    rt.close()  # the modules get their trained values back

A trunk larger than the device streams layer by layer within each step: ``register_layers``
registers each module of a list (``model.model.layers``) as a unit, and hooks acquire a layer
for its forward, release it, acquire it again for its backward and, a trained layer, step it as
soon as its gradients are complete (see ``Runtime.register_layers``).

Between steps a registered parameter is an empty tensor: using a module outside a step scope fails
at once instead of reading memory the runtime has given to another unit. A tensor taken from a
parameter inside a scope (``w = p.detach()``) still aliases the slot after the scope ends and
cannot be detected; clone it if it must outlive the step.
"""

from __future__ import annotations

import torch

if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
    raise ImportError(f"taskswap.torch needs torch 2.1 or later (register_post_accumulate_grad_hook); this is torch "
                      f"{torch.__version__}")

from ._comm import mpi, nccl_group  # noqa: E402
from ._runtime import Runtime  # noqa: E402
from ._units import Unit  # noqa: E402

__all__ = ["Runtime", "Unit", "nccl_group", "mpi"]
