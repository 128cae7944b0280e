# SPDX-License-Identifier: Apache-2.0
"""Frozen units of any dtype: int8, int64, bool, fp8 and float tensors in one unit, packed by the
runtime and given back as they were; and samples/configs/peft-int8.toml, a base of int8 weights
with float scales that streams through a small budget while its LoRA adapters train."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import torch

import taskswap
import taskswap.torch as tt

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations, seen through peft
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "samples/python"))
import peft_multitask as sample  # noqa: E402

INT8 = ROOT / "samples/configs/peft-int8.toml"


def options(budget: str) -> taskswap.Options:
    o = taskswap.Options()
    o.device.backend = taskswap.Backend.emulated
    o.device.budget = taskswap.parse_size(budget)
    return o


def mixed_module(seed: int) -> torch.nn.Module:
    """A module whose tensors are of six dtypes, with odd byte counts."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    m.q = torch.nn.Parameter(torch.randint(-127, 128, (33, 17), dtype=torch.int8, generator=g), requires_grad=False)
    m.h = torch.nn.Parameter(torch.randn(3, generator=g).to(torch.bfloat16), requires_grad=False)
    m.register_buffer("scale", torch.rand(33, generator=g))
    m.register_buffer("index", torch.randint(0, 1 << 40, (5,), generator=g))
    m.register_buffer("flag", torch.tensor(True))
    m.register_buffer("f8", torch.randn(7, generator=g).to(torch.float8_e4m3fn))
    return m


def tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each tensor's bytes (fp8 has no torch.equal) with its dtype and shape."""
    return {n: (t.dtype, tuple(t.shape), t.detach().reshape(-1).view(torch.uint8).clone())
            for n, t in [*m.named_parameters(), *m.named_buffers()]}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n][:2] == b[n][:2] and torch.equal(a[n][2], b[n][2]) for n in a)


def test_a_frozen_unit_of_mixed_dtypes_is_the_same_tensors_in_every_step_and_after_close():
    """Two such units and a float one take turns in a budget that holds one at a time; in every
    step the module's tensors are what they were (dtype, shape, bytes), and so are state_dict's
    and, after close(), the module's own."""
    mods = [mixed_module(1), mixed_module(2)]
    before = [tensors(m) for m in mods]
    rt = tt.Runtime(options=options("6 KiB"))
    units = [rt.register(m, f"q{i}", residency="on_demand") for i, m in enumerate(mods)]
    dense = rt.register(torch.nn.Linear(32, 32), "dense", trainable=False, residency="on_demand")
    assert all(not u.trainable for u in units)
    assert [n for n, _ in units[0].params + units[0].buffers] == ["q", "h", "scale", "index", "flag", "f8"]
    moved = 0
    for k in range(4):
        u = units[k % 2]
        with rt.step(u, dense):
            assert same(tensors(mods[k % 2]), before[k % 2]), f"step {k}"
            assert mods[k % 2].q.data_ptr() != 0 and not mods[k % 2].q.requires_grad
        moved += rt.last_step.h2d_bytes
    assert moved >= 4 * (33 * 17 + 32 * 32 * 4), moved  # every step brought its units in
    state = rt.state_dict()
    for i, kept in enumerate(before):
        for n, (dtype, shape, data) in kept.items():
            t = state[f"q{i}.{n}"]
            assert (t.dtype, tuple(t.shape)) == (dtype, shape) and torch.equal(t.reshape(-1).view(torch.uint8), data)
    rt.close()
    assert all(same(tensors(m), b) for m, b in zip(mods, before))


def test_a_trained_unit_of_integers_and_a_tensor_subclass_are_refused_saying_what_to_do():
    m = mixed_module(3)
    rt = tt.Runtime(options=options("1 MiB"))
    with pytest.raises(taskswap.ConfigError, match="a trained unit's parameters share one dtype of float32"):
        rt.register(m, "q", trainable=True)

    class Wrapped(torch.Tensor):
        pass

    odd = torch.nn.Linear(4, 4)
    odd.register_buffer("packed", torch.Tensor._make_subclass(Wrapped, torch.zeros(4)))
    with pytest.raises(taskswap.ConfigError, match="'packed' of 'odd' is a Wrapped, a tensor subclass"):
        rt.register(odd, "odd", trainable=False)
    assert rt.units == []


def test_torchaos_int8_weights_are_refused_as_a_tensor_subclass():
    """torchao's weight-only int8 replaces the weight with a tensor subclass whose int8 data and
    scales are inner tensors that torch.Tensor.data cannot point elsewhere (docs/python.md)."""
    quant = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    linear = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quant.quantize_(linear, quant.Int8WeightOnlyConfig())
    rt = tt.Runtime(options=options("1 MiB"))
    with pytest.raises(taskswap.ConfigError, match="a tensor subclass"):
        rt.register(linear, "base", trainable=False)


def test_the_int8_base_streams_bitwise_equal_to_resident_and_as_plain_torch_trains():
    """peft-int8.toml: the int8 base's 32 decoder layers stream through a budget a sixth of their
    size; the per-step losses and the adapters are bitwise those of the run with the base
    resident, and the losses within 1e-5 of plain torch + peft + torch.optim.AdamW on the same
    quantized model (no taskswap hooks)."""
    with open(INT8, "rb") as f:
        tables = tomllib.load(f)
    m = tables["model"]
    opts = taskswap.load_config(str(INT8), ["model"])
    streamed, resident = (sample.train_taskswap(m, opts, 8, all_resident=r) for r in (False, True))
    s = streamed["stats"].total
    assert streamed["streamed_bytes"] >= 5 * streamed["budget"], streamed["streamed_bytes"]
    assert s.peak_device_bytes <= streamed["budget"] and s.evictions > 0 and s.misses == 0
    assert streamed["losses"] == resident["losses"]
    differ = [k for k in streamed["state"] if not torch.equal(streamed["state"][k], resident["state"][k])]
    assert not differ, differ[:3]
    plain = sample.train_torch(m, tables["optimizer"], 8)
    worst = max(abs(a - b) for a, b in zip(streamed["losses"], plain["losses"]))
    assert worst < 1e-5, worst
    assert plain["losses"][0] != sample.train_torch({**m, "base_weights": "float"}, tables["optimizer"], 1)["losses"][0]


def test_the_int8_sample_trains_every_task():
    out = subprocess.run([sys.executable, str(ROOT / "samples/python/peft_multitask.py"), str(INT8)],
                         capture_output=True, text=True, env=os.environ, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "loss fell on 4 of 4 tasks" in out.stdout, out.stdout
    assert "streamed base layers: 3.55 MiB, 5.7x the budget" in out.stdout, out.stdout
