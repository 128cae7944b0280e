# SPDX-License-Identifier: Apache-2.0
"""taskswap.torch on a CUDA device (label gpu): views are CUDA tensors, the step protocol runs on
torch's current stream, and taskswap's own NCCL communicator is bootstrapped over torch.distributed.
Skips where torch has no CUDA device or taskswap was built without CUDA."""

from __future__ import annotations

import pytest
import torch

import taskswap
import taskswap.torch as tt
from loops import Model, config, fresh, max_relative, model_state, register, schedule, train_taskswap, train_torch

pytestmark = pytest.mark.skipif(not (taskswap.with_cuda and torch.cuda.is_available()
                                     and taskswap.cuda_device_count() > 0),
                                reason="needs a CUDA device and taskswap built with CUDA")

TASKS, STEPS = 16, 60


def test_swapped_equals_all_pinned_bitwise_and_torch_on_cuda():
    model = Model(TASKS)
    sched = schedule(STEPS, TASKS)
    swapped = train_taskswap(fresh(model), sched, config("12 KiB", backend="cuda"), device="cuda")
    pinned = train_taskswap(fresh(model), sched, config("64 KiB", backend="cuda"), pin_all=True, device="cuda")
    assert swapped.stats().total.evictions > 0
    a, b = swapped.state_dict(), pinned.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    emulated = train_taskswap(fresh(model), sched, config("12 KiB"))
    e = emulated.state_dict()
    # one formula on both backends: the CUDA run equals the emulated one to the bit
    assert all(torch.equal(a[k], e[k]) for k in a)
    assert max_relative(a, model_state(train_torch(fresh(model), sched))) < 1e-5


def test_views_are_cuda_tensors_on_torch_current_stream():
    model = Model(4).cuda()
    rt = tt.Runtime(options=config("64 KiB", backend="cuda"))
    trunk, heads = register(rt, model)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with rt.step(trunk, heads[2]) as scope:
            assert scope.stream.handle == side.cuda_stream
            w = model.heads[2].weight
            assert w.is_cuda and w.grad.is_cuda and w.data_ptr() == rt.core.param_tensors(heads[2].id)[0].data_ptr()
            x = torch.randn(8, 16, device="cuda")
            torch.nn.functional.mse_loss(model(x, 2), torch.zeros(8, 3, device="cuda")).backward()
    torch.cuda.synchronize()
    assert model.heads[2].weight.numel() == 0
    # the legacy default stream is a stream too (handle 0)
    assert taskswap.external_stream(rt.device, 0).external


def test_nccl_communicator_over_torch_distributed(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = Model(4)
        sched = schedule(20, 4)
        rt = train_taskswap(fresh(model), sched, config("64 KiB", backend="cuda"), comm=tt.nccl_group(),
                            device="cuda")
        assert rt.world_size == 1 and rt.stats().total.reduced_bytes > 0
        alone = train_taskswap(fresh(model), sched, config("64 KiB", backend="cuda"), device="cuda")
        a, b = rt.state_dict(), alone.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        dist.destroy_process_group()
