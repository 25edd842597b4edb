#!/usr/bin/env python3
"""Turns criterion's estimates for `benches/filters.rs`, `benches/guard.rs` and
`benches/memory.rs` into the tables in BENCHMARKS.md.

    cargo bench --bench filters && python3 benches/summary.py
    cargo bench --bench guard && python3 benches/summary.py guard
    cargo bench --bench guard -- paths/ && python3 benches/summary.py paths
    cargo bench --bench memory && python3 benches/summary.py memory

Every timed iteration of that bench handles a fixed number of keys (criterion's
"throughput"), so ns/key is the mean time divided by that count; the thread
benches report aggregate millions of queries per second.

criterion keeps every result it ever wrote under target/criterion: a size
measured by an earlier run (another BLOOMGUARD_BENCH_SIZES) shows as a column
of its own. Clear the bench's groups first (`rm -rf target/criterion/paths*`)
for a table of one run.
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


# The raw-filter path each guard path is compared with (raw-contains otherwise).
RAW_BASELINE = {"guard-check-many": "raw-contains-many", "guard-insert": "raw-insert",
                "guard-insert-3-generations": "raw-insert"}


def guard_tables():
    """ns per key of each guard path next to the raw filter, per size and thread count."""
    rows = {}
    for group, function, mean_ns, keys in estimates():
        if not group.startswith("guard/"):
            continue
        what, threads, path = function.split("/")
        count = int(threads.rstrip("T"))
        # Each thread handled keys / count of the iteration's keys in the measured time.
        rows.setdefault((group.split("=")[1], what, threads), {})[path] = mean_ns / (keys / count)
    print("| n | keys | threads | path | ns/key | added vs raw |")
    print("|---|---|---:|---|---:|---:|")
    for (size, what, threads), paths in sorted(rows.items(), key=lambda r: (int(r[0][0].rstrip("M")), r[0][1], r[0][2])):
        for path, ns in sorted(paths.items(), key=lambda p: (not p[0].startswith("raw"), p[0])):
            baseline = paths.get(RAW_BASELINE.get(path, "raw-contains"))
            added = "–" if path.startswith("raw") or baseline is None else f"{ns - baseline:+.1f}"
            print(f"| {size} | {what} | {threads} | {path} | {ns:.1f} | {added} |")


# The rows of issue #16's table, in its order, and the peer each is held against.
PATHS = [
    "fastbloom-contains-xxh3", "raw-contains", "raw-contains-many", "guard-check",
    "guard-reader-check", "guard-check-many", "fastbloom-insert-xxh3", "raw-insert",
]
MEMORY_PATHS = [
    "memory-dependent-load", "memory-random-line-reads", "fastbloom-contains-xxh3",
    "raw-contains", "raw-contains-many", "guard-check-many",
]


def rates_table(prefix, paths, references):
    """Aggregate Mops/s of `paths` in the groups under `prefix`, sizes and threads as
    columns, then each path's ratio to each reference path at the most threads."""
    rates = {}
    for group, function, mean_ns, keys in estimates():
        if group.startswith(prefix + "/"):
            path, threads = function.rsplit("/", 1)
            rates[(path, group.split("=")[1], threads)] = keys / mean_ns * 1e3
    sizes = sorted({s for _, s, _ in rates}, key=lambda s: int(s.rstrip("M")))
    counts = sorted({t for _, _, t in rates}, key=lambda t: int(t.rstrip("T")))
    columns = [(size, threads) for size in sizes for threads in counts]
    most = counts[-1]
    ratio_columns = [(name, size) for name in references for size in sizes]
    print("| path | " + " | ".join(f"{size}, {threads}" for size, threads in columns)
          + " | " + " | ".join(f"vs {name}, {size} {most}" for name, size in ratio_columns) + " |")
    print("|---|" + "---:|" * (len(columns) + len(ratio_columns)))
    for path in paths:
        cells = [f"{rates[(path, *c)]:.1f}" if (path, *c) in rates else "–" for c in columns]
        ratios = []
        for name, size in ratio_columns:
            reference = references[name].get(path, references[name][None])
            ratios.append(
                f"{rates[(path, size, most)] / rates[(reference, size, most)]:.2f}×"
                if (path, size, most) in rates and (reference, size, most) in rates else "–")
        print(f"| {path} | " + " | ".join(cells + ratios) + " |")


def paths_table():
    """Issue #16's table: every read path and insert on the seen-items mix against fastbloom."""
    fastbloom = {None: "fastbloom-contains-xxh3", "fastbloom-insert-xxh3": "fastbloom-insert-xxh3",
                 "raw-insert": "fastbloom-insert-xxh3"}
    rates_table("paths", PATHS, {"fastbloom": fastbloom})


def memory_table():
    """Past the cache: the queries against fastbloom and against the memory's random-read rate."""
    rates_table("memory", MEMORY_PATHS, {
        "fastbloom": {None: "fastbloom-contains-xxh3"},
        "random line reads": {None: "memory-random-line-reads"},
    })


def main():
    if not CRITERION.exists():
        sys.exit("no criterion results: run `cargo bench --bench filters` first")
    if sys.argv[1:] == ["guard"]:
        guard_tables()
        return
    if sys.argv[1:] == ["paths"]:
        paths_table()
        return
    if sys.argv[1:] == ["memory"]:
        memory_table()
        return
    single, threads = {}, {}
    for group, function, mean_ns, keys in estimates():
        # `benches/filters.rs` only: `n=…` and `threads/n=…`.
        if not group.startswith(("n=", "threads/n=")):
            continue
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
