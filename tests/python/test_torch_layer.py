# SPDX-License-Identifier: Apache-2.0
"""taskswap.torch on the emulated device (views are CPU tensors)."""

from __future__ import annotations

import pytest
import torch

import taskswap
import taskswap.torch as tt
from loops import (
    BETAS,
    EPS,
    LR,
    WD,
    Model,
    batch,
    config,
    fresh,
    max_relative,
    model_state,
    register,
    schedule,
    torch_param_groups,
    train_taskswap,
    train_torch,
)

TASKS, STEPS = 16, 60


def head_bytes(model: Model) -> int:
    return sum(p.numel() * 4 for p in model.heads[0].parameters())


def test_swapped_equals_all_pinned_bitwise_and_torch():
    model = Model(TASKS)
    sched = schedule(STEPS, TASKS)
    # Room for the trunk (pinned) and about three heads with their AdamW state: heads are evicted.
    swapped = train_taskswap(fresh(model), sched, config("12 KiB"))
    pinned = train_taskswap(fresh(model), sched, config("64 KiB"), pin_all=True)
    stats = swapped.stats().total
    assert stats.evictions > 0 and stats.write_backs > 0, "the budget must force evictions"
    placements = {u.policy.optimizer for u in swapped.stats().units}
    assert placements == {taskswap.OptimizerPlacement.device, taskswap.OptimizerPlacement.host}
    a, b = swapped.state_dict(), pinned.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    reference = model_state(train_torch(fresh(model), sched))
    assert max_relative(a, reference) < 1e-5
    # The loop moved the model: not a comparison of two untouched copies.
    assert max_relative(a, model_state(model)) > 1e-2


def test_disk_homes_train_bitwise_as_host_homes(tmp_path):
    """The heads' homes in unit files behind a host cache smaller than them: a config change only."""
    model = Model(TASKS)
    sched = schedule(STEPS, TASKS)
    host = train_taskswap(fresh(model), sched, config("12 KiB"))
    disk = train_taskswap(fresh(model), sched, config("12 KiB", extra=disk_homes(tmp_path)))
    d = disk.stats().disk
    assert d.host_cache_bytes == 40 << 10 and d.evictions > 0 and d.written_back > 0 and d.misses > 0
    assert host.stats().disk.host_cache_bytes == 0
    assert len(list(tmp_path.glob("task%2f*.unit"))) == TASKS
    a, b = host.state_dict(), disk.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_disk_homes_from_options_built_in_code(tmp_path):
    """No TOML: Options.storage and a rule's home put the heads in unit files, bitwise as above."""
    model = Model(TASKS)
    sched = schedule(STEPS, TASKS)
    host = train_taskswap(fresh(model), sched, config("12 KiB"))
    options = config("12 KiB")
    options.storage.path = tmp_path
    options.storage.host_cache = 40 << 10
    options.storage.queue_depth = 4
    options.add_rule("task/*", home="disk")
    assert options.storage.path == tmp_path and options.storage.lookahead == 4
    disk = train_taskswap(fresh(model), sched, options)
    assert disk.stats().disk.misses > 0 and len(list(tmp_path.glob("task%2f*.unit"))) == TASKS
    a, b = host.state_dict(), disk.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    bad = config("12 KiB")
    bad.add_rule("task/*", home="disk")  # no storage.path
    with pytest.raises(taskswap.ConfigError, match=r"\[storage\]"):
        train_taskswap(fresh(model), sched, bad)


def test_gradients_alias_the_slabs():
    model = Model(4)
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, model)
    x, y = batch(0, 1)
    with rt.step(trunk, heads[1]):
        for u in (trunk, heads[1]):
            params, grads = rt.core.param_tensors(u.id), rt.core.grad_tensors(u.id)
            for (_, p), t, g in zip(u.params, params, grads):
                assert p.data_ptr() == t.data_ptr() and p.grad.data_ptr() == g.data_ptr()
                assert torch.count_nonzero(g) == 0
        torch.nn.functional.mse_loss(model(x, 1), y).backward()
        for (_, p), g in zip(heads[1].params, rt.core.grad_tensors(heads[1].id)):
            assert p.grad.data_ptr() == g.data_ptr() and torch.count_nonzero(g) > 0


def one_step(model, rt_kwargs, body, micro_batches=1):
    rt = tt.Runtime(options=config("64 KiB"), **rt_kwargs)
    trunk, heads = register(rt, model)
    rt.plan([[trunk, heads[0]]])
    with rt.step(trunk, heads[0], micro_batches=micro_batches):
        body(model)
    return rt.state_dict()


def test_zero_grad_set_to_none_is_repaired():
    model = Model(2)
    x0, y0 = batch(0, 0)
    x1, y1 = batch(1, 0)

    def second_only(m):
        torch.nn.functional.mse_loss(m(x1, 0), y1).backward()

    def reset_first(m):  # the loop torch 2 users write: zero_grad() (set_to_none) then backward
        m.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x1, 0), y1).backward()

    def both_with_reset(m):
        torch.nn.functional.mse_loss(m(x0, 0), y0).backward()
        m.zero_grad(set_to_none=True)  # torch 2's default: drops the slab's alias
        torch.nn.functional.mse_loss(m(x1, 0), y1).backward()

    def reset_only(m):
        torch.nn.functional.mse_loss(m(x0, 0), y0).backward()
        m.zero_grad(set_to_none=True)

    expected = one_step(fresh(model), {}, second_only)
    assert all(torch.equal(v, expected[k]) for k, v in one_step(fresh(model), {}, reset_first).items())
    reset = one_step(fresh(model), {}, both_with_reset, micro_batches=2)
    assert all(torch.equal(v, expected[k]) for k, v in reset.items())
    # set_to_none and no backward after it: the step sees zero gradients, as torch would
    zero = one_step(fresh(model), {}, lambda m: None)
    assert all(torch.equal(v, zero[k]) for k, v in one_step(fresh(model), {}, reset_only, micro_batches=2).items())
    # With a communicator the hooks hand a unit to the reduction at its last backward pass; the
    # same results, and dropping the gradients after that is reported, not ignored.
    mpi = {"comm": tt.mpi()}
    assert all(torch.equal(v, expected[k]) for k, v in one_step(fresh(model), mpi, reset_first).items())
    reset = one_step(fresh(model), mpi, both_with_reset, micro_batches=2)
    assert all(torch.equal(v, expected[k]) for k, v in reset.items())
    with pytest.raises(taskswap.InvalidArgument, match="were replaced"):
        one_step(fresh(model), mpi, reset_only)
    assert not all(torch.equal(v, zero[k]) for k, v in expected.items())


def test_views_after_release():
    model = Model(2)
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, model)
    with rt.step(trunk, heads[0]):
        kept = model.heads[0].weight.detach()  # an alias of the slot: documented, not detectable
        torch.nn.functional.mse_loss(model(*batch(0, 0)[:1], 0), batch(0, 0)[1]).backward()
    # between steps a parameter is empty: a forward outside a step fails at once
    assert model.heads[0].weight.numel() == 0 and model.heads[0].weight.grad is None
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 16), 0)
    with pytest.raises(taskswap.InvalidArgument, match="not held"):
        rt.core.param_tensors(heads[0].id)
    assert kept.shape == (3, 16)


def test_gradient_accumulation_matches_one_large_batch():
    model = Model(2)
    x, y = batch(0, 0, size=32)

    def large(m):
        torch.nn.functional.mse_loss(m(x, 0), y).backward()

    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, fresh_model := fresh(model))
    with rt.step(trunk, heads[0], micro_batches=4):
        for k in range(4):
            xs, ys = x[8 * k:8 * k + 8], y[8 * k:8 * k + 8]
            (torch.nn.functional.mse_loss(fresh_model(xs, 0), ys) / 4).backward()
    accumulated = rt.state_dict()
    assert max_relative(accumulated, one_step(fresh(model), {}, large)) < 1e-6
    # With a communicator the reduction starts at the last micro-batch: one more backward pass is refused.
    with pytest.raises(RuntimeError, match="micro_batches=1"):
        one_step(fresh(model), {"comm": tt.mpi()},
                 lambda m: [torch.nn.functional.mse_loss(m(x, 0), y).backward() for _ in range(2)])


def test_frozen_use_keeps_the_unit_and_trains_the_rest():
    model = Model(3)
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, model)
    before = rt.state_dict()
    rt.plan([[trunk.frozen(), heads[t]] for t in (0, 1, 2)])
    for t in (0, 1, 2):
        x, y = batch(t, t)
        with rt.step(trunk.frozen(), heads[t]) as s:
            assert not model.trunk[0].weight.requires_grad
            torch.nn.functional.mse_loss(model(x, t), y).backward()
            assert model.trunk[0].weight.grad is None
        assert s.stats.frozen == 1
    after = rt.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("trunk."))
    assert all(not torch.equal(after[k], before[k]) for k in before if k.startswith("task/"))
    assert model.trunk[0].weight.requires_grad


def disk_homes(path, cache: str = "40 KiB") -> str:
    """The config lines that put the heads' homes in unit files under `path`."""
    return (f'\n[storage]\npath = "{path}"\nhost_cache = "{cache}"\n'
            '\n[[units]]\nmatch = "task/*"\nhome = "disk"\n')


@pytest.mark.parametrize("disk", [False, True], ids=["host-homes", "disk-homes"])
def test_checkpoint_round_trip(tmp_path, disk):
    """Saved after 15 steps and resumed in a fresh runtime: bitwise the uninterrupted run. With disk
    homes the checkpoint holds copies of the unit files (units/), and the resumed run has its own."""
    model = Model(6)
    sched = schedule(30, 6)
    whole = train_taskswap(fresh(model), sched, config("12 KiB"), plan=False)
    first = train_taskswap(fresh(model), sched[:15], config("12 KiB", extra=disk_homes(tmp_path / "a") if disk else ""),
                           plan=False)
    first.save_checkpoint(tmp_path / "ck", {"epoch": "3"})
    assert len(list((tmp_path / "ck").glob("units/*.unit"))) == (6 if disk else 0)
    second = tt.Runtime(options=config("12 KiB", extra=disk_homes(tmp_path / "b") if disk else ""))
    m2 = Model(6, seed=5)  # other initial values: the checkpoint must replace them
    trunk, heads = register(second, m2)
    steps_done, user = second.load_checkpoint(tmp_path / "ck")
    assert (steps_done, user) == (15, {"epoch": "3"})
    for i, t in enumerate(sched[15:], start=15):
        x, y = batch(i, t)
        with second.step(trunk, heads[t]):
            torch.nn.functional.mse_loss(m2(x, t), y).backward()
    a, b = whole.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_exceptions_map_to_python_types():
    assert issubclass(taskswap.ConfigError, ValueError) and issubclass(taskswap.InvalidArgument, ValueError)
    assert issubclass(taskswap.OutOfMemory, MemoryError) and issubclass(taskswap.TimeoutError, TimeoutError)
    for cls in (taskswap.ConfigError, taskswap.InvalidArgument, taskswap.OutOfMemory, taskswap.CudaError,
                taskswap.CommError, taskswap.TimeoutError, taskswap.DeviceError, taskswap.CheckpointError,
                taskswap.StorageError):
        assert issubclass(cls, taskswap.Error) and issubclass(cls, RuntimeError)
    assert issubclass(taskswap.StorageError, OSError)
    for kind, cls in taskswap._core._error_kinds().items():
        with pytest.raises(cls, match=f"raised as {kind}") as info:
            taskswap._core._raise(kind, f"raised as {kind}")
        assert type(info.value) is cls
        if cls is taskswap.OutOfMemory:
            assert (info.value.requested, info.value.available, info.value.budget) == (3, 2, 1)


def test_errors_from_the_runtime(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[device]\nbackend = "emulated"\nbudget = "4 MiB"\n\n[defaults]\nresidency = "sometimes"\n')
    with pytest.raises(taskswap.ConfigError, match=r"bad.toml:6.*residency.*sometimes"):
        tt.Runtime(bad)
    # a unit that can never fit next to the pinned ones: refused at start, with the numbers
    rt = tt.Runtime(options=config("1 KiB"))
    rt.register(torch.nn.Linear(64, 64), "big")
    with pytest.raises(taskswap.ConfigError, match="raise \\[device\\] budget"):
        rt.start()
    # the device cannot hold the budget
    small = config("8 MiB")
    small.device.emulated.memory_bytes = 1 << 20
    rt = tt.Runtime(options=small)
    rt.register(torch.nn.Linear(4, 4), "u")
    with pytest.raises(taskswap.OutOfMemory):
        rt.start()
    # a checkpoint that is not there
    rt = tt.Runtime(options=config("64 KiB"))
    rt.register(torch.nn.Linear(4, 4), "u")
    with pytest.raises(taskswap.CheckpointError):
        rt.load_checkpoint(tmp_path / "missing")
    assert rt.device is None, "a refused load leaves the runtime unstarted"
    # the emulated device has no CUDA streams to wrap
    rt.start()
    with pytest.raises(taskswap.InvalidArgument, match="emulated"):
        taskswap.external_stream(rt.device, 0)
    # steps do not nest, and a module's parameters belong to one unit
    model = Model(2)
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, model)
    with pytest.raises(taskswap.InvalidArgument, match="already open"):
        with rt.step(trunk):
            with rt.step(heads[0]):
                pass
    rt = tt.Runtime(options=config("64 KiB"))
    rt.register(model.trunk, "a")
    with pytest.raises(taskswap.ConfigError, match="already in unit 'a'"):
        rt.register(model.trunk, "b")


def test_a_view_keeps_the_runtime_alive():
    import gc
    import weakref
    rt = tt.Runtime(options=config("64 KiB"))
    unit = rt.register(torch.nn.Linear(4, 4), "u")
    rt.start()
    home = rt.core.home(unit.id)[0]  # a CPU tensor over the pinned arena
    expected = home.clone()
    core = weakref.ref(rt.core)
    rt.close()
    gc.collect()
    assert core() is not None, "the runtime went away while a tensor still views its memory"
    assert torch.equal(home, expected)
    del home
    gc.collect()
    assert core() is None, "the runtime outlived the last view of its memory"
    with pytest.raises(taskswap.InvalidArgument, match="closed"):
        rt.plan([[unit]])


def test_the_communicator_follows_the_config_unless_told_none():
    with_mpi = config("64 KiB")
    with_mpi.comm.backend = taskswap.CommBackend.mpi
    for comm, reduces in ((None, True), ("none", False)):
        rt = tt.Runtime(options=with_mpi, comm=comm)
        trunk, heads = register(rt, Model(2))
        rt.plan([[trunk, heads[0]]])
        with rt.step(trunk, heads[0]):
            pass
        assert rt.core.has_communicator == reduces and rt._hooks == reduces
        assert (rt.last_step.reduced_bytes > 0) == reduces


def test_an_exception_in_a_step_drops_its_gradients():
    model = Model(2)
    x, y = batch(0, 0)
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, model)
    before = rt.state_dict()
    with pytest.raises(ZeroDivisionError):
        with rt.step(trunk, heads[0]):
            torch.nn.functional.mse_loss(model(x, 0), y).backward()
            raise ZeroDivisionError("the trainer's code fails inside the scope")
    assert rt.last_step is not None and model.heads[0].weight.numel() == 0
    after = rt.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "an abandoned step changed parameters"
    # the next step starts from zero gradients: as the same step in a fresh runtime
    x1, y1 = batch(1, 0)
    with rt.step(trunk, heads[0]):
        torch.nn.functional.mse_loss(model(x1, 0), y1).backward()
    fresh_model = fresh(Model(2))
    expected = one_step(fresh_model, {}, lambda m: torch.nn.functional.mse_loss(m(x1, 0), y1).backward())
    assert all(torch.equal(v, expected[k]) for k, v in rt.state_dict().items())


def test_a_bad_scope_acquires_nothing():
    rt = tt.Runtime(options=config("64 KiB"))
    trunk, heads = register(rt, Model(2))
    other = tt.Runtime(options=config("64 KiB")).register(torch.nn.Linear(2, 2), "x")
    for units, match in (((trunk, other), "another runtime"), ((trunk, heads[0], trunk), "named twice")):
        with pytest.raises(taskswap.InvalidArgument, match=match):
            with rt.step(*units):
                pass
        assert rt.stats().total.step == 0 and rt.core.state(trunk.id) != taskswap.UnitState.held
    with pytest.raises(taskswap.InvalidArgument, match="another runtime"):
        rt.plan([[other]])


def test_state_dict_round_trip_and_its_errors():
    model = Model(3)
    rt = tt.Runtime(options=config("64 KiB"))
    register(rt, model)
    rt.start()
    state = {k: v + 1 for k, v in model_state(fresh(Model(3, seed=1))).items()}
    with pytest.raises(taskswap.InvalidArgument, match="missing keys"):
        rt.load_state_dict({k: v for k, v in state.items() if k != "task/2.bias"})
    with pytest.raises(taskswap.InvalidArgument, match="unexpected keys"):
        rt.load_state_dict({**state, "task/9.weight": torch.zeros(1)})
    with pytest.raises(taskswap.InvalidArgument, match="has shape"):
        rt.load_state_dict({**state, "trunk.0.weight": state["trunk.0.weight"].reshape(-1)})
    rt.load_state_dict(state)
    got = rt.state_dict()
    assert all(torch.equal(got[k], state[k]) for k in state)
    # after state_dict the pinned units are on the device: a load could not reach them
    with pytest.raises(taskswap.InvalidArgument, match="cannot reach"):
        rt.load_state_dict(state)


def test_a_scalar_parameter_and_a_name_with_glob_characters():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.scale = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(3)
    m = Scaled()
    ref = fresh(m)
    rt = tt.Runtime(options=config("64 KiB"))
    unit = rt.register(m, "odd\\name[*]", lr_scale=2.0)
    opt = torch.optim.AdamW(ref.parameters(), lr=2 * 1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for _ in range(3):
        x = torch.randn(5, 4)
        with rt.step(unit):
            assert m.scale.shape == () and m.scale.grad.shape == ()
            m(x).square().mean().backward()
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    got = rt.state_dict()
    assert got["odd\\name[*].scale"].shape == ()
    assert max_relative(got, {f"odd\\name[*].{n}": p.detach() for n, p in ref.named_parameters()}) < 1e-5
    o = rt.optimizer
    o.lr = 5e-3
    rt.optimizer = o
    assert rt.optimizer.lr == 5e-3


def test_long_calls_release_the_gil(tmp_path):
    import threading
    import time
    opts = config("32 MiB")
    opts.device.emulated.link_bytes_per_second = 100e6  # the 12 MiB written home take ~120 ms
    rt = tt.Runtime(options=opts)
    big = rt.register(torch.nn.Linear(1024, 1024), "big")
    with rt.step(big):
        big.module(torch.randn(2, 1024)).sum().backward()
    stamps = []
    done = threading.Event()

    def count():
        while not done.is_set():
            stamps.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        rt.core.flush()  # waits for the write-back with the GIL released: the counter runs meanwhile
        end = time.perf_counter()
    finally:
        done.set()
        counter.join()
    inside = [start] + [t for t in stamps if start < t < end] + [end]
    longest_gap = max(b - a for a, b in zip(inside, inside[1:]))
    assert end - start > 0.06, "the flush was too short to tell"
    assert longest_gap < (end - start) / 2, f"the counter stopped for {longest_gap:.3f} s of {end - start:.3f} s"


def test_with_a_communicator_gradients_are_not_changed_after_the_hand_over():
    model = Model(2)
    x, y = batch(0, 0)
    rt = tt.Runtime(options=config("64 KiB"), comm=tt.mpi())
    trunk, heads = register(rt, model)
    rt.plan([[trunk, heads[0]], [trunk, heads[1]]])
    with pytest.raises(taskswap.InvalidArgument, match="changed in place"):
        with rt.step(trunk, heads[0]):
            torch.nn.functional.mse_loss(model(x, 0), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # after the reduction began
    # a scope entered under no_grad still sets up its hooks (torch 1.13 makes the nodes then)
    with torch.no_grad():
        with rt.step(trunk, heads[1]):
            with torch.enable_grad():
                torch.nn.functional.mse_loss(model(x, 1), y).backward()
    assert rt.last_step.reduced_bytes > 0


def test_a_comm_that_is_not_one_is_refused():
    for comm, match in (("mpi", "not 'mpi'"), (object(), "not a object"), (lambda d: None, "returned NoneType")):
        rt = tt.Runtime(options=config("64 KiB"), comm=comm)
        rt.register(torch.nn.Linear(2, 2), "u")
        with pytest.raises(taskswap.ConfigError, match=match):
            rt.start()


def scaled_torch_run(model, sched, inf_steps, clip, init_scale, interval):
    """GradScaler's arithmetic (written out, as its CPU kernels once were CUDA-only), clip_grad_norm_
    over the step's parameters (clip 0: none) and torch.optim.AdamW. Returns the model and per
    step (global norm of the unscaled gradients, scale after the step, skipped)."""
    ref = fresh(model)
    opt = torch.optim.AdamW(torch_param_groups(ref), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    scale, tracker = torch.tensor(init_scale, dtype=torch.float32), 0
    steps = []
    for i, t in enumerate(sched):
        x, y = batch(i, t)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ref(x, t), y)
        if i in inf_steps:
            loss = loss * float("inf")
        (loss * scale).backward()
        params = [p for p in list(ref.trunk.parameters()) + list(ref.heads[t].parameters())]
        inv = scale.double().reciprocal().float()
        found_inf = False
        for p in params:
            p.grad.mul_(inv)
            found_inf = found_inf or not bool(torch.isfinite(p.grad).all())
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if not found_inf:
            opt.step()
        if found_inf:
            scale, tracker = scale * 0.5, 0
        elif tracker + 1 == interval:
            scale, tracker = scale * 2.0, 0
        else:
            tracker += 1
        steps.append((norm, float(scale), found_inf))
    return ref, steps, tracker


def test_loss_scaling_and_clipping_match_torch_and_skip_an_overflowing_step():
    """rt.scale(loss) and [optimizer] clip against torch: a step whose loss is inf is skipped on
    every unit and backs the scale off. Every step's global norm (unscaled), scale and skip are
    compared, and the clipping threshold lies between the steps' norms, so that it binds on some
    steps only: a threshold every step exceeded would leave only "clipped or not" to see, which
    AdamW, nearly blind to a uniform factor, would not tell from a wrong threshold."""
    tasks, steps, init_scale, interval = 6, 24, 2.0 ** 12, 5
    model = Model(tasks)
    sched = schedule(steps, tasks)
    inf_steps = {7, 8, 15}
    _, unclipped, _ = scaled_torch_run(model, sched, inf_steps, 0.0, init_scale, interval)
    norms = sorted(n for n, _, skipped in unclipped if not skipped)
    clip = norms[len(norms) // 2]
    ref, want, tracker = scaled_torch_run(model, sched, inf_steps, clip, init_scale, interval)
    clipped = sum(n > clip for n, _, skipped in want if not skipped)
    assert 0 < clipped < len(norms), f"clip {clip} binds on {clipped} of {len(norms)} steps"

    options = config("15 KiB")  # as the test above, plus the scaler's state
    options.optimizer.clip = clip
    options.scaler.enabled = True
    options.scaler.init_scale = init_scale
    options.scaler.growth_interval = interval
    rt = tt.Runtime(options=options)
    ours = fresh(model)
    trunk, heads = register(rt, ours)
    assert rt.core.guards_steps
    rt.plan([[trunk, heads[t]] for t in sched])
    for i, t in enumerate(sched):
        x, y = batch(i, t)
        with rt.step(trunk, heads[t]):
            loss = torch.nn.functional.mse_loss(ours(x, t), y)
            if i in inf_steps:
                loss = loss * float("inf")
            rt.scale(loss).backward()
        got = rt.scaler_state()
        norm, scale, skipped = want[i]
        assert got.last_skipped == skipped and got.scale == scale, (i, got.last_skipped, got.scale, want[i])
        if not skipped:
            assert abs(got.last_norm - norm) <= 1e-5 * norm, (i, got.last_norm, norm)
    state = rt.scaler_state()
    assert rt.stats().total.evictions > 0, "the budget must force evictions"
    assert (state.scale, state.growth_tracker, state.skipped_steps) == (want[-1][1], tracker, len(inf_steps))
    assert state.steps == steps
    assert max_relative(rt.state_dict(), model_state(ref)) < 1e-5
    assert max_relative(rt.state_dict(), model_state(model)) > 1e-2


def test_scale_without_a_scaler_is_the_loss_and_clip_needs_a_guarded_runtime():
    rt = tt.Runtime(options=config("64 KiB"))
    model = Model(2)
    trunk, heads = register(rt, model)
    x, y = batch(0, 0)
    with rt.step(trunk, heads[0]):
        loss = torch.nn.functional.mse_loss(model(x, 0), y)
        assert rt.scale(loss) is loss
        loss.backward()
    with pytest.raises(taskswap.InvalidArgument, match="not guarded"):
        rt.scaler_state()
    o = rt.optimizer
    o.clip = 1.0
    with pytest.raises(taskswap.ConfigError, match="without clipping"):
        rt.optimizer = o
