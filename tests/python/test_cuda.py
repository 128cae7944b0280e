# SPDX-License-Identifier: Apache-2.0
"""taskswap.torch on a CUDA device (label gpu): views are CUDA tensors, the step protocol runs on
torch's current stream, and taskswap's own NCCL communicator is bootstrapped over torch.distributed.
Skips where torch has no CUDA device or taskswap was built without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import taskswap
import taskswap.torch as tt
from loops import (
    Model,
    batch,
    config,
    fresh,
    max_relative,
    model_state,
    register,
    schedule,
    train_taskswap,
    train_torch,
)

pytestmark = pytest.mark.skipif(not (taskswap.with_cuda and torch.cuda.is_available()
                                     and taskswap.cuda_device_count() > 0),
                                reason="needs a CUDA device and taskswap built with CUDA")

TASKS, STEPS = 16, 60
# The CUDA activation tests' model: streamed layers of width 512 at 256 rows, blocks of one 2 MiB
# granule, four of which fit the budget beside the heads and two layers
ACTIVATIONS = {"backend": "cuda", "width": 512, "rows": 256, "block": 2 << 20, "blocks_room": 4}


def test_swapped_equals_all_pinned_bitwise_and_torch_on_cuda():
    # The CUDA pool maps 2 MiB granules: heads of 8192 outputs (2.1 MiB with their AdamW state)
    # take two each, so a 16 MiB budget holds the trunk's granule and three heads, and the 16
    # heads swap.
    model = Model(TASKS, out=8192)
    sched = schedule(STEPS, TASKS)
    swapped = train_taskswap(fresh(model), sched, config("16 MiB", backend="cuda"), device="cuda")
    pinned = train_taskswap(fresh(model), sched, config("72 MiB", backend="cuda"), pin_all=True, device="cuda")
    assert swapped.stats().total.evictions > 0
    a, b = swapped.state_dict(), pinned.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    emulated = train_taskswap(fresh(model), sched, config("16 MiB"))
    assert emulated.stats().total.evictions > 0
    e = emulated.state_dict()
    # torch's CUDA matmuls round differently from its CPU ones, so the gradients (not the AdamW
    # formula, which is one on both backends) differ in the last bits, and AdamW's m/sqrt(v) lifts
    # that where gradients are small: 3.4e-5 after 60 steps on an H200 (2026-11-26); close, not bitwise
    assert max_relative(a, e) < 1e-4
    assert max_relative(a, model_state(train_torch(fresh(model), sched))) < 1e-4


def test_views_are_cuda_tensors_on_torch_current_stream():
    model = Model(4).cuda()
    rt = tt.Runtime(options=config("8 MiB", backend="cuda"))
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


needs_nccl = pytest.mark.skipif(not taskswap.with_nccl, reason="taskswap was built without NCCL")


@needs_nccl
def test_nccl_communicator_over_torch_distributed(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = Model(4)
        sched = schedule(20, 4)
        rt = train_taskswap(fresh(model), sched, config("8 MiB", backend="cuda"), comm=tt.nccl_group(),
                            device="cuda")
        assert rt.world_size == 1 and rt.stats().total.reduced_bytes > 0
        alone = train_taskswap(fresh(model), sched, config("8 MiB", backend="cuda"), device="cuda")
        a, b = rt.state_dict(), alone.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        dist.destroy_process_group()


def test_streamed_layers_equal_all_resident_bitwise_on_cuda():
    """register_layers on CUDA: the backward's hooks run on autograd's device thread and acquire on
    its current stream; a 32-layer trunk (4.2 MiB of parameters a layer: larger than half a 2 MiB
    granule, so each keeps its address) through a budget of the heads and two layers; trained, also
    against plain torch (torch.optim.AdamW on CUDA, no taskswap hooks)."""
    from test_streaming import train, train_plain
    for trained in (True, False):
        streamed, totals, budget, _ = train(streamed=True, trained_layers=trained, backend="cuda", width=512)
        resident, _, _, _ = train(streamed=False, trained_layers=trained, backend="cuda", width=512)
        assert totals.evictions > 0 and totals.peak_device_bytes <= budget
        assert all(torch.equal(streamed[k], resident[k]) for k in streamed)
        if trained:
            streamed = {k: v.cpu() for k, v in streamed.items()}
            assert max_relative(streamed, train_plain(width=512, device="cuda")) < 1e-5


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_activation_offload_on_cuda_is_bitwise_the_run_without(checkpoint):
    """register_activations on CUDA: the pack hook's copies into the blocks and the unpack's reads
    on torch's current stream, the blocks sent home and brought back on the runtime's copy
    streams. The streamed layers (ACTIVATIONS) save 3 MiB each (LayerNorm's input and output,
    GELU's input and output; a checkpoint its input alone)."""
    from test_activation_offload import LAYERS, assert_bitwise, moved, train, train_plain
    offloaded, stats = train(offload=True, checkpoint=checkpoint, host_bytes=192 << 20, **ACTIVATIONS)
    kept, base = train(offload=False, checkpoint=checkpoint, **ACTIVATIONS)
    offloaded = {k: v.cpu() for k, v in offloaded.items()}
    assert_bitwise(offloaded, {k: v.cpu() for k, v in kept.items()})
    # taskswap's AdamW and torch's round differently, and m/sqrt(v) lifts that where gradients are
    # small: this model measures 1.0e-4 after 8 steps on the CPU (the same with or without offload);
    # activations read back wrong would be off by far more
    width, rows, block = ACTIVATIONS["width"], ACTIVATIONS["rows"], ACTIVATIONS["block"]
    plain = train_plain(checkpoint=checkpoint, device="cuda", width=width, rows=rows)
    assert max_relative(offloaded, plain) < 1e-3
    # What a step sends home at least: each layer's saves but the last layer's (keep_last=1), less
    # the first layer's input, the batch (no grad_fn: kept); with checkpointing, each checkpoint's
    # input (the last one's too, as the emulated device measures; not counted here)
    rows_bytes = rows * width * 4
    saved = ((LAYERS - 1) * 6 - 1) * rows_bytes if checkpoint is None else (LAYERS - 1) * rows_bytes
    (d2h, h2d), (base_d2h, base_h2d) = moved(stats), moved(base)
    assert d2h - base_d2h >= (len(stats) - 1) * saved
    stay = ACTIVATIONS["blocks_room"] * block  # blocks that may stay on the device
    assert h2d - base_h2d >= (len(stats) - 1) * (saved - stay)
    assert all(s.unplanned == 0 for s in stats[1:])


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_activation_offload_on_cuda_with_a_layer_on_a_stream_of_its_own(checkpoint):
    """One streamed layer's forward on a stream of its own (so its backward too, and a
    non-reentrant checkpoint's recomputation, which reads the input offloaded on the step's
    stream): what that stream saves stays on the device (said once), the rest offloads, bitwise
    the run without offload on the same streams."""
    from test_activation_offload import assert_bitwise, moved, train

    def own_stream(rt, model):
        side, entered = torch.cuda.Stream(), []

        def enter(module, args):
            # Before taskswap's own hooks (set when the runtime starts): the layer is acquired on
            # `side`, after the step's stream's work so far, and released after `leave`'s wait.
            side.wait_stream(torch.cuda.current_stream())
            entered.append(torch.cuda.stream(side))
            entered[-1].__enter__()

        def leave(module, args, output):
            entered.pop().__exit__(None, None, None)
            torch.cuda.current_stream().wait_stream(side)
            output.record_stream(torch.cuda.current_stream())

        model.layers[1].register_forward_pre_hook(enter)
        model.layers[1].register_forward_hook(leave, always_call=True)

    shape = {**ACTIVATIONS, "checkpoint": checkpoint, "setup": own_stream}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offloaded, stats = train(offload=True, host_bytes=192 << 20, **shape)
    kept, base = train(offload=False, **shape)
    assert_bitwise({k: v.cpu() for k, v in offloaded.items()}, {k: v.cpu() for k, v in kept.items()})
    on_own = [w for w in said if "other than the step's is current" in str(w.message)]
    assert len(on_own) == (1 if checkpoint is None else 0)  # a checkpoint saves nothing inside the layer
    assert moved(stats)[0] > moved(base)[0] + (len(stats) - 1) * ACTIVATIONS["rows"] * ACTIVATIONS["width"] * 4


def test_disk_homes_on_cuda_equal_host_homes_and_resume_bitwise(tmp_path):
    """The heads' homes in unit files behind a host cache of three heads, on CUDA: the cache's
    blocks are the sources and targets of the device copies. Bitwise the host-homed run; a
    checkpoint after half the steps (units/ holds the files' copies) resumes bitwise."""
    from test_torch_layer import disk_homes
    model = Model(TASKS, out=8192)
    sched = schedule(STEPS, TASKS)
    cache = "7 MiB"  # three heads' state (2.1 MiB each), not all sixteen
    host = train_taskswap(fresh(model), sched, config("16 MiB", backend="cuda"), device="cuda")
    on_disk = config("16 MiB", backend="cuda", extra=disk_homes(tmp_path / "a", cache))
    disk = train_taskswap(fresh(model), sched, on_disk, device="cuda")
    d = disk.stats().disk
    assert d.evictions > 0 and d.written_back > 0 and d.misses > 0
    a, b = host.state_dict(), disk.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    half = STEPS // 2
    first = train_taskswap(fresh(model), sched[:half],
                           config("16 MiB", backend="cuda", extra=disk_homes(tmp_path / "b", cache)), device="cuda")
    first.save_checkpoint(tmp_path / "ck", {})
    assert len(list((tmp_path / "ck").glob("units/*.unit"))) == TASKS
    del first
    second = tt.Runtime(options=config("16 MiB", backend="cuda", extra=disk_homes(tmp_path / "c", cache)))
    m2 = Model(TASKS, out=8192, seed=5).to("cuda")  # other initial values: the checkpoint replaces them
    trunk, heads = register(second, m2)
    assert second.load_checkpoint(tmp_path / "ck")[0] == half
    for i, t in enumerate(sched[half:], start=half):
        x, y = (v.to("cuda") for v in batch(i, t, out=8192))
        with second.step(trunk, heads[t]):
            torch.nn.functional.mse_loss(m2(x, t), y).backward()
    c = second.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)


@needs_nccl
def test_streamed_trained_layers_through_nccl_equal_all_resident_bitwise_on_cuda(tmp_path):
    """Streamed trained layers with taskswap's NCCL communicator (world size 1, bootstrapped over
    torch.distributed) and a bucket a layer: each layer's reduction is launched as its backward
    completes (its update then runs after it, on the runtime's aux stream where the reduction has
    not finished at step()), and its room comes back at that launch, so the trunk streams through a
    budget of the heads and two layers. At world size 1 the reduction is the identity: bitwise the
    all-resident run without a communicator."""
    import torch.distributed as dist
    from test_streaming import LAYERS, Deep, train
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        layer_grads = sum(p.numel() * p.element_size() for p in Deep(width=512).layers[0].parameters())
        streamed, totals, budget, _ = train(streamed=True, trained_layers=True, backend="cuda", width=512,
                                            comm=tt.nccl_group(), bucket_cap=layer_grads,
                                            depth=lambda step, rank: LAYERS)
        resident, _, _, _ = train(streamed=False, trained_layers=True, backend="cuda", width=512)
        assert totals.evictions > 0 and totals.peak_device_bytes <= budget and totals.reduced_bytes > 0
        assert all(torch.equal(streamed[k], resident[k]) for k in streamed)
    finally:
        dist.destroy_process_group()
