# SPDX-License-Identifier: Apache-2.0
"""samples/python/multitask.py: trains (the loss falls) and is bitwise equal swapped and all-resident."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *flags: str, config: str = "emulated.toml", steps: int = 300) -> tuple[str, dict]:
    state = tmp_path / f"state{len(flags)}.pt"
    out = subprocess.run([sys.executable, str(ROOT / "samples/python/multitask.py"),
                          str(ROOT / "samples/configs" / config), "--steps", str(steps), "--save-state", str(state),
                          *flags], capture_output=True, text=True, env=os.environ, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, torch.load(state)


def test_swapped_and_all_resident_agree_bitwise(tmp_path):
    swapped, a = run(tmp_path)
    resident, b = run(tmp_path, "--all-resident")
    assert "loss fell on" in swapped
    # The run's totals (not a step's log line): every acquisition planned and prefetched in time.
    totals = [line for line in swapped.splitlines() if line.startswith("h2d ")]
    assert len(totals) == 1 and re.search(r", misses 0, unplanned 0,", totals[0]), swapped
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_tasks_per_step(tmp_path):
    out, _ = run(tmp_path, "--tasks-per-step", "2")
    assert "2 task(s)/step" in out


def test_disk_homes_with_a_config_change_only(tmp_path):
    """emulated-disk.toml: the same script, the adapters' homes in unit files (state 8x the host cache)."""
    disk, a = run(tmp_path, config="emulated-disk.toml", steps=120)
    resident, b = run(tmp_path, "--all-resident", config="emulated-disk.toml", steps=120)
    assert "loss fell on" in disk
    assert any(p.suffix == ".unit" for p in (tmp_path / "taskswap-disk").iterdir())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
