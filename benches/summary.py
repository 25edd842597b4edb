#!/usr/bin/env python3
"""Turns criterion's estimates for `benches/filters.rs` into the tables in BENCHMARKS.md.

    cargo bench --bench filters && python3 benches/summary.py

Every timed iteration of that bench handles a fixed number of keys (criterion's
"throughput"), so ns/key is the mean time divided by that count; the thread
benches report aggregate millions of queries per second.
"""

import json
import pathlib
import sys

CRITERION = pathlib.Path(__file__).resolve().parent.parent / "target" / "criterion"
OPERATIONS = ["insert", "present", "absent"]


def estimates():
    for estimate in CRITERION.glob("**/new/estimates.json"):
        bench = json.loads((estimate.parent / "benchmark.json").read_text())
        mean_ns = json.loads(estimate.read_text())["mean"]["point_estimate"]
        keys = (bench.get("throughput") or {}).get("Elements", 1)
        yield bench["group_id"], bench["function_id"], mean_ns, keys


def main():
    if not CRITERION.exists():
        sys.exit("no criterion results: run `cargo bench --bench filters` first")
    single, threads = {}, {}
    for group, function, mean_ns, keys in estimates():
        if group.startswith("threads/"):
            count, contender = function.split("/", 1)
            threads.setdefault((group.split("=")[1], contender), {})[count] = keys / mean_ns * 1e3
        else:
            operation, contender = function.split("/", 1)
            single.setdefault(contender, {})[(group.split("=")[1], operation)] = mean_ns / keys

    sizes = sorted({size for row in single.values() for size, _ in row}, key=lambda s: int(s.rstrip("M")))
    columns = [(size, op) for size in sizes for op in OPERATIONS]
    print("| contender | " + " | ".join(f"{op} {size}" for size, op in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for contender in sorted(single):
        cells = [f"{single[contender][c]:.1f}" if c in single[contender] else "–" for c in columns]
        print(f"| {contender} | " + " | ".join(cells) + " |")

    if threads:
        counts = sorted({c for row in threads.values() for c in row}, key=lambda c: int(c.rstrip("T")))
        print("\n| contender (n) | " + " | ".join(f"{c} Mops/s" for c in counts) + " | scaling |")
        print("|---|" + "---:|" * (len(counts) + 1))
        for (size, contender), row in sorted(threads.items()):
            cells = [f"{row[c]:.1f}" if c in row else "–" for c in counts]
            scaling = f"{row[counts[-1]] / row[counts[0]]:.2f}×" if len(row) > 1 else "–"
            print(f"| {contender} ({size}) | " + " | ".join(cells) + f" | {scaling} |")


if __name__ == "__main__":
    main()
