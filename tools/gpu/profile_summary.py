#!/usr/bin/env python3
"""Kernel time per kernel name from an Nsight Compute CSV (tools/gpu_check.sh
--profile runs `ncu --csv --metrics gpu__time_duration.sum` over the
benchmarks it names and saves the output as profile.csv).

    profile_summary.py profile.csv [--json]

Prints (or returns as JSON with --json) one row per kernel name: launches, the
sum and the mean of gpu__time_duration in microseconds, the share of the total
and the grid / block size of its first launch, the largest total first. Kernel
names are cut to the function's own name, so that the template instances of
one kernel add up. ncu serialises the launches, so the sums are the kernels' own
time, without overlap or launch gaps.
"""
import csv
import io
import json
import sys


def kernel_rows(path):
    """The CSV's records: ncu writes '==PROF==' lines and the program's own
    output before the header, which starts with "ID"."""
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def short_name(name):
    """'void ns::(anonymous namespace)::k<float>(args)' -> 'k' (ncu's --print-kernel-base function
    already gives 'k')."""
    name = name.replace("(anonymous namespace)", "").strip()
    if name.startswith("void "):
        name = name[5:]
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name.split("::")[-1] or "?"


def summarize(path):
    totals = {}
    for r in kernel_rows(path):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            value = float(r.get("Metric Value", "").replace(",", ""))
        except ValueError:
            continue
        unit = r.get("Metric Unit", "")
        us = value / 1e3 if unit in ("ns", "nsecond") else value * 1e3 if unit in ("ms", "msecond") else value
        name = short_name(r.get("Kernel Name", "?"))
        t = totals.setdefault(name, {"kernel": name, "launches": 0, "total_us": 0.0,
                                     "grid": r.get("Grid Size", ""), "block": r.get("Block Size", "")})
        t["launches"] += 1
        t["total_us"] += us
    rows = sorted(totals.values(), key=lambda t: -t["total_us"])
    whole = sum(t["total_us"] for t in rows) or 1.0
    for t in rows:
        t["mean_us"] = t["total_us"] / t["launches"]
        t["share"] = t["total_us"] / whole
    return rows


def main():
    rows = summarize(sys.argv[1])
    if "--json" in sys.argv[2:]:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'kernel':48} {'launches':>9} {'total us':>12} {'mean us':>10} {'share':>7}  grid / block")
    for t in rows:
        print(f"{t['kernel'][:48]:48} {t['launches']:9d} {t['total_us']:12.1f} {t['mean_us']:10.2f} {100 * t['share']:6.1f}%  "
              f"{t['grid']} / {t['block']}")


if __name__ == "__main__":
    main()
