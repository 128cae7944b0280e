# SPDX-License-Identifier: Apache-2.0
"""same_state.py A B: exits 0 when the two torch.save'd state dicts hold the same keys and bitwise
equal tensors (tools/gpu-check compares the sample's swapped and all-resident runs with it)."""

from __future__ import annotations

import sys

import torch


def main() -> int:
    a, b = (torch.load(f) for f in sys.argv[1:3])
    if a.keys() != b.keys():
        print(f"different keys: {sorted(a.keys() ^ b.keys())[:8]}")
        return 1
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if differ:
        print(f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:4]}")
        return 1
    print(f"the {len(a)} tensors are bitwise equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
