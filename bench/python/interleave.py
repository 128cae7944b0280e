# SPDX-License-Identifier: Apache-2.0
"""Compares two builds of taskswap_bench, run alternately in one session so that both see the same
machine state: before/after a refactor, each benchmark's time (and chosen counters) as medians over
the rounds, and after/before.

    python3 bench/python/interleave.py BEFORE_BENCH AFTER_BENCH \
        --filter 'runtime_acquire_release|runtime_overlap' --rounds 5 [--counter step_time_ratio] [--stat min]

Prints one row per benchmark: median (or with --stat min, the fastest round) before and after,
ratio (after / before), the spread of each side (max / min over rounds), so a ratio inside the
spread is read as noise. --stat all prints both summaries."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile


def run(binary: str, pattern: str, extra: list[str]) -> dict[str, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([binary, f"--benchmark_filter={pattern}", f"--benchmark_out={out.name}",
                        "--benchmark_out_format=json", *extra], check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            data = json.load(f)
    return {b["name"]: b for b in data["benchmarks"]
            if b.get("run_type", "iteration") == "iteration" and not b.get("error_occurred")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--filter", default="runtime_acquire_release|runtime_overlap")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--counter", action="append", default=[], help="also compare this counter (e.g. us_per_op)")
    ap.add_argument("--stat", choices=["median", "min", "all"], default="median",
                    help="how rounds are summarised: the median, or the minimum (a host-time microbenchmark on a "
                         "machine whose rounds fall into fast and slow modes is compared by its fastest rounds)")
    ap.add_argument("extra", nargs="*", help="more arguments for both binaries (after --)")
    args = ap.parse_args()

    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for r in range(args.rounds):
        # Alternate which goes first, so neither always runs on a warmer machine.
        order = [("before", args.before), ("after", args.after)]
        for side, binary in (order if r % 2 == 0 else order[::-1]):
            for name, b in run(binary, args.filter, args.extra).items():
                values = samples[side].setdefault(name, [])
                values.append(b["real_time"])
                for c in args.counter:
                    if c in b:
                        samples[side].setdefault(f"{name} [{c}]", []).append(b[c])
    worst = 0.0
    for stat in (["median", "min"] if args.stat == "all" else [args.stat]):
        summary = statistics.median if stat == "median" else min
        print(f"{args.rounds} alternating rounds; {stat} (real_time in each benchmark's unit, or the counter)")
        print(f"{'benchmark':72} {'before':>10} {'after':>10} {'after/before':>13} {'spread b':>9} {'spread a':>9}")
        for name in samples["before"]:
            b, a = samples["before"][name], samples["after"].get(name)
            if not a:
                continue
            mb, ma = summary(b), summary(a)
            ratio = ma / mb if mb else float("nan")
            if "[" not in name and stat == ("median" if args.stat == "all" else args.stat):
                worst = max(worst, ratio)

            def spread(v: list[float]) -> float:
                return max(v) / min(v) if min(v) > 0 else float("nan")

            print(f"{name:72} {mb:10.4g} {ma:10.4g} {ratio:13.3f} {spread(b):9.3f} {spread(a):9.3f}")
    print(f"largest time ratio after/before ({'median' if args.stat == 'all' else args.stat}): {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
