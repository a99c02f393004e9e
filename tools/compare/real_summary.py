#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Accuracy tables of the real model's task workloads from a kvpolicy-compare CSV (markdown on stdout).

    real_summary.py results.csv [--plot FILE.png]

Reads the rows of workloads `tasks-aware:<task>:<haystack>:<length>` and `tasks-agnostic:...` (metric
`accuracy`, each the mean over `n` samples) and prints
  1. policy x budget rows, one column per (setup, length): accuracy over every task and haystack, weighted by n;
  2. the same per task (columns: setup x task, over every length and haystack);
  3. logit KL vs the full cache per (setup, length), same rows.
--plot also draws accuracy vs compression ratio, question-aware and question-agnostic side by side, one line per
policy (over every task, haystack and length; needs matplotlib). Standard library only otherwise.
"""
import csv
import re
import sys
from collections import OrderedDict, defaultdict


def plot(path, rows, store, setups):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(setups), figsize=(12, 4.6), sharey=True)
    colors = plt.get_cmap("tab20")
    policies = OrderedDict()
    for (pol, budget) in rows:
        policies.setdefault(pol, []).append(budget)
    for ax, setup in zip(axes, setups):
        full = None
        for pol, budgets in policies.items():
            pts = []
            for b in budgets:
                s, n = [0.0, 0]
                for (p2, b2, col), (v, m) in store.items():
                    if p2 == pol and b2 == b and col[0] == setup:
                        s += v
                        n += m
                if not n:
                    continue
                if b == "full":
                    full = s / n
                elif b.startswith("r="):
                    pts.append((float(b[2:]), s / n))
            if pts:
                pts.sort()
                quant = re.search(r"(^|\+)(q\d|KIVI|int4|fp8)", pol) is not None  # dashed: every token kept, quantized
                ax.plot([x for x, _ in pts], [y for _, y in pts], "--" if quant else "-", marker="o", label=pol,
                        color=colors(list(policies).index(pol) % 20))
        if full is not None:
            ax.axhline(full, color="black", linestyle=":", label="full cache")
        ax.set_title(f"question-{setup}")
        ax.set_xlabel("compression ratio (fraction of the prompt removed)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (all tasks, haystacks, lengths)")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    plot_path = None
    if "--plot" in sys.argv:
        i = sys.argv.index("--plot")
        if i + 1 >= len(sys.argv):
            sys.exit(__doc__)
        plot_path = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    acc = defaultdict(lambda: [0.0, 0])  # (policy, budget, column) -> [sum of value*n, n]
    kl = defaultdict(lambda: [0.0, 0])
    per_task = defaultdict(lambda: [0.0, 0])
    rows, lengths, tasks = OrderedDict(), set(), OrderedDict()
    with open(sys.argv[1], newline="") as f:
        for r in csv.DictReader(f):
            wl = r["workload"]
            if not wl.startswith(("tasks-aware:", "tasks-agnostic:")) or r["layer"] != "all":
                continue
            parts = wl.split(":")
            if len(parts) != 4:
                continue
            setup, task, _filler, length = parts[0].split("-")[1], parts[1], parts[2], int(parts[3])
            budget = "full" if r["budget_kind"] == "full" else (f"r={float(r['budget_value']):g}" if r["budget_kind"].startswith("ratio")
                                                                  else f"{r['budget_kind']} {r['budget_value']}")
            key = (r["policy"], budget)
            n = int(r["n"])
            v = float(r["value"])
            if r["metric"] == "accuracy":
                rows.setdefault(key, None)
                lengths.add(length)
                tasks.setdefault(task, None)
                a = acc[key + ((setup, length),)]
                a[0] += v * n
                a[1] += n
                t = per_task[key + ((setup, task),)]
                t[0] += v * n
                t[1] += n
            elif r["metric"] == "logit_kl":
                k = kl[key + ((setup, length),)]
                k[0] += v * n
                k[1] += n
    if not rows:
        sys.exit("real_summary: no tasks-aware / tasks-agnostic accuracy rows in " + sys.argv[1])
    setups = ["aware", "agnostic"]
    cols = [(s, length) for s in setups for length in sorted(lengths)]

    def table(title, store, columns, head, fmt):
        print(f"### {title}\n")
        print("| policy | budget | " + " | ".join(head(c) for c in columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        for key in rows:
            cells = []
            for c in columns:
                s, n = store.get(key + (c,), (0.0, 0))
                cells.append(fmt(s / n, n) if n else "-")
            print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
        print()

    table("Accuracy by setup and prompt length (every task and haystack)", acc, cols, lambda c: f"{c[0]} {c[1]}",
          lambda v, n: f"{v:.2f}")
    table("Accuracy by setup and task (every length and haystack)", per_task, [(s, t) for s in setups for t in tasks],
          lambda c: f"{c[0]} {c[1]}", lambda v, n: f"{v:.2f}")
    table("Logit KL vs the full cache (nats) by setup and prompt length", kl, cols, lambda c: f"{c[0]} {c[1]}",
          lambda v, n: f"{v:.3f}")
    first = next(iter(rows))
    counts = ", ".join(f"{c[0]} {c[1]}: {acc[first + (c,)][1]}" for c in cols if acc[first + (c,)][1])
    print(f"Samples per column of the first table (every task and haystack of that setup and length): {counts}.")
    if plot_path:
        plot(plot_path, rows, acc, setups)


if __name__ == "__main__":
    main()
