#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots and a markdown table from a kvpolicy-compare CSV (tools/compare/README.md).

    plot.py results.csv [--out-dir DIR] [--print]

Everything is drawn from the CSV alone (rows with layer == "all"). Per workload W:
  W_vs_tokens.png   quality vs budget in tokens per kv head (log2 x), one line per
                    policy, the full cache as a dashed horizontal line (KVCache-Factory style)
  W_vs_ratio.png    quality vs kvpress compression ratio (fraction removed), the full
                    cache plotted at ratio 0 and dashed (kvpress style)
  W_time.png        decision time per layer vs budget (log y)
  W_tradeoff.png    attention-mass recall vs K/V bytes kept per layer
  W_tasks.png       end-to-end accuracy and logit KL vs budget, when the CSV has them
  W_tasks_vs_ratio.png  the same vs kvpress compression ratio (the real model's workloads)
  W_laq.png         the same for LAQ, LAQ++ and the SnapKV variants only (lookahead queries vs SnapKV)
  W_merging.png     accuracy, logit KL and attention-output error vs budget: SnapKV and H2O with and
                    without each merge (the engine's merging rows)
  W_memory.png      end-to-end accuracy vs K/V bytes per layer: eviction, quantization and
                    both on one axis ("at this much memory, evict or quantize?")
  W_stall.png       prefetch workloads: simulated stall and bytes per decode step, late-miss and
                    buffer-hit rates vs the device budget (pages per layer), the prefetch
                    policies against fetch-on-miss and all-resident
and table.md, the same pivot the console table shows. Needs matplotlib
(Debian python3-matplotlib); only the standard library otherwise.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from collections import OrderedDict, defaultdict

QUALITY = [("rel_err", "attention output rel. error", False), ("mass_recall", "attention-mass recall", True),
           ("topk_overlap", "oracle top-k overlap", True), ("needle_hit", "needle hit rate", True)]
TASKS = [("accuracy", "task accuracy", True), ("logit_kl", "logit KL vs full (nats)", False)]
# End-to-end rows with the engine's attention-output error (same query, full cache as reference).
TASKS_ERR = TASKS + [("rel_err", "attention-output rel. error vs full cache", False)]
PREFETCH = [("stall_us_per_step", "simulated stall per decode step (us)", False),
            ("bytes_per_step", "host->device bytes per decode step", False),
            ("sim_late_miss", "late-miss rate (simulated)", False), ("sim_buffer_hit", "buffer-hit rate (simulated)", True)]
TABLE_COLS = [("rel_err", "rel_err", "{:.4f}"), ("mass_recall", "mass_rec", "{:.4f}"), ("topk_overlap", "topk_ovl", "{:.4f}"),
              ("needle_hit", "needle", "{:.4f}"), ("time_ms", "time_ms", "{:.3f}"), ("kv_bytes", "KiB/layer", "{:.1f}"),
              ("accuracy", "accuracy", "{:.4f}"), ("logit_kl", "logit_KL", "{:.4f}"),
              ("pred_recall", "recall", "{:.4f}"), ("buffer_hit", "buf_hit", "{:.4f}"), ("late_miss", "late", "{:.4f}"),
              ("sim_late_miss", "sim_late", "{:.4f}"), ("bytes_per_step", "bytes/step", "{:.0f}"),
              ("stall_us_per_step", "stall_us/step", "{:.2f}")]


def load(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["layer"] == "all"]
    for r in rows:
        r["budget_value"] = float(r["budget_value"])
        r["kept_tokens"] = float(r["kept_tokens"])
        r["value"] = float(r["value"])
    return rows


def pivot(rows):
    """workload -> OrderedDict[(policy, kind, budget)] -> {metric: value, 'kept': k, 'family': f}."""
    out = OrderedDict()
    for r in rows:
        wl = out.setdefault(r["workload"], OrderedDict())
        cell = wl.setdefault((r["policy"], r["budget_kind"], r["budget_value"]), {"kept": r["kept_tokens"], "family": r["family"]})
        cell[r["metric"]] = r["value"]
    return out


def table_markdown(piv):
    lines = []
    for wl, cells in piv.items():
        cols = [c for c in TABLE_COLS if any(c[0] in v for v in cells.values())]
        lines += [f"### {wl}", "", "| policy | budget | kept | " + " | ".join(c[1] for c in cols) + " |",
                  "|---|---:|---:|" + "---:|" * len(cols)]
        for (pol, kind, b), v in cells.items():
            bud = f"{b:.0f}" if kind == "tokens" else (f"r={b:g}" if kind == "ratio_removed" else
                                                       (f"{b:.0f} pages" if kind == "device_pages" else "full"))
            vals = []
            for key, _, fmt in cols:
                x = v.get(key)
                if x is None or math.isnan(x):
                    vals.append("-")
                else:
                    vals.append(fmt.format(x / 1024.0 if key == "kv_bytes" else x))
            lines.append(f"| {pol} | {bud} | {v['kept']:.0f} | " + " | ".join(vals) + " |")
        lines.append("")
    return "\n".join(lines)


def slug(s):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_")


def series(cells, kind, metric):
    """policy -> sorted [(budget, value)] for one budget kind."""
    s = defaultdict(list)
    for (pol, k, b), v in cells.items():
        if k == kind and metric in v and not math.isnan(v[metric]):
            s[pol].append((b, v[metric]))
    return {p: sorted(x) for p, x in s.items()}


def full_value(cells, metric):
    for (pol, k, _), v in cells.items():
        if k == "full" and metric in v:
            return v[metric]
    return None


def plots(piv, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = []
    for cells in piv.values():
        for (pol, k, _), v in cells.items():
            if k != "full" and pol not in policies:
                policies.append(pol)
    cmap = plt.get_cmap("tab20")
    color = {p: cmap(i % 20) for i, p in enumerate(policies)}
    family = {}
    for cells in piv.values():
        for (pol, _, _), v in cells.items():
            family[pol] = v["family"]

    def style(p):
        if family.get(p) == "baseline":  # prefetch baselines (fetch_on_miss, all_resident)
            return dict(color="0.15" if p == "fetch_on_miss" else "0.55", linestyle="--", marker="x")
        if family.get(p) == "oracle":
            return dict(color="0.4", linestyle=":", marker="^")
        if family.get(p) == "selection":
            return dict(color=color[p], linestyle="-.", marker="s")
        if family.get(p) == "quantization":
            return dict(color=color[p], linestyle=":", marker="D")
        if family.get(p) == "evict+quantize":
            return dict(color=color[p], linestyle="--", marker="v")
        if family.get(p) == "merging":
            return dict(color=color[p], linestyle="--", marker="P")
        return dict(color=color[p], linestyle="-", marker="o")

    written = []

    def grid(cells, metrics, kind, title, fname, xlabel, logx):
        present = [m for m in metrics if series(cells, kind, m[0])]
        if not present:
            return
        n = len(present)
        cols = 2 if n > 1 else 1
        rows = (n + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
        for ax, (m, label, higher) in zip(axes.flat, present):
            for p, pts in series(cells, kind, m).items():
                xs, ys = [x for x, _ in pts], [y for _, y in pts]
                if kind == "ratio_removed" and full_value(cells, m) is not None:
                    xs, ys = [0.0] + xs, [full_value(cells, m)] + ys
                ax.plot(xs, ys, label=p, markersize=4, linewidth=1.4, **style(p))
            fv = full_value(cells, m)
            if fv is not None:
                ax.axhline(fv, color="black", linestyle="--", linewidth=1, label="full cache")
            if logx:
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label + (" (higher is better)" if higher else " (lower is better)"))
            ax.grid(True, alpha=0.3)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False)
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) // 5), 1, 0.96))
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def vs_bytes(cells, metric, keep, xlabel, ylabel, title, fname, size):
        """One line per policy of `metric` against the K/V bytes per layer (token budgets), the full cache as a star."""
        pts = defaultdict(set)
        for (pol, k, _), v in cells.items():
            if k == "tokens" and "kv_bytes" in v and metric in v and keep(pol):
                pts[pol].add((v["kv_bytes"] / 1024.0, v[metric]))
        if not pts:
            return
        fig, ax = plt.subplots(figsize=size)
        for p, xy in pts.items():
            xy = sorted(xy)
            kw = dict(markersize=4)
            kw.update(style(p))
            ax.plot([x for x, _ in xy], [y for _, y in xy], label=p, **kw)
        fb, fm = full_value(cells, "kv_bytes"), full_value(cells, metric)
        if fb is not None and fm is not None:
            ax.plot([fb / 1024.0], [fm], "k*", markersize=10, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(title)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for wl, cells in piv.items():
        s = slug(wl)
        grid(cells, QUALITY, "tokens", f"{wl}: quality vs budget", f"{s}_vs_tokens.png", "budget (tokens per kv head, log2)", True)
        grid(cells, QUALITY, "ratio_removed", f"{wl}: quality vs compression ratio", f"{s}_vs_ratio.png",
             "compression ratio (fraction removed)", False)
        grid(cells, TASKS, "tokens", f"{wl}: end-to-end", f"{s}_tasks.png", "budget (tokens per kv head, log2)", True)
        # the real model's workloads sweep kvpress compression ratios
        grid(cells, TASKS, "ratio_removed", f"{wl}: end-to-end", f"{s}_tasks_vs_ratio.png", "compression ratio (fraction removed)", False)
        # lookahead queries: LAQ / LAQ++ against the SnapKV variants alone
        laq = {key: v for key, v in cells.items() if key[1] == "full" or (key[0].startswith(("LAQ", "SnapKV")) and "+" not in key[0])}
        if any(key[0].startswith("LAQ") for key in laq):
            grid(laq, TASKS, "tokens", f"{wl}: lookahead queries (LAQ) vs SnapKV", f"{s}_laq.png", "budget (tokens per kv head, log2)", True)
        grid(cells, PREFETCH, "device_pages", f"{wl}: offload simulation vs device budget", f"{s}_stall.png",
             "device budget (pages per layer)", False)

        # merging: SnapKV and H2O with and without each merge at equal budget (accuracy, KL, attention error)
        mrg = {key: v for key, v in cells.items()
               if key[1] == "full" or key[0] in ("SnapKV", "H2O") or family.get(key[0]) == "merging"}
        if any(family.get(key[0]) == "merging" for key in mrg):
            grid(mrg, TASKS_ERR, "tokens", f"{wl}: eviction with and without merging (SnapKV, H2O)", f"{s}_merging.png",
                 "budget (tokens per kv head, log2)", True)

        # accuracy vs bytes (task workloads; selection reads, it does not hold less) and recall vs bytes
        vs_bytes(cells, "accuracy", lambda pol: family.get(pol) != "selection", "K/V bytes held per layer (KiB, log2)",
                 "task accuracy (higher is better)", f"{wl}: accuracy vs memory (evict, quantize, or both)", f"{s}_memory.png",
                 (7.5, 4.8))
        vs_bytes(cells, "mass_recall", lambda pol: True, "K/V bytes kept or read per layer (KiB, log2)", "attention-mass recall",
                 f"{wl}: recall vs memory", f"{s}_tradeoff.png", (7, 4.6))
    # decision time (log-log: the policies span five orders of magnitude)
    for wl, cells in piv.items():
        ser = series(cells, "tokens", "time_ms")
        if not ser:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.6))
        for p, pts in ser.items():
            ax.plot([x for x, _ in pts], [max(y, 1e-4) for _, y in pts], label=p, markersize=4, **style(p))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("budget (tokens per kv head, log2)")
        ax.set_ylabel("decision time per layer (ms, log)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"{wl}: time per decision")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{slug(wl)}_time.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--out-dir", help="where to write the PNGs and table.md (default: the CSV's directory)")
    ap.add_argument("--print", action="store_true", help="print the markdown table")
    ap.add_argument("--no-plots", action="store_true", help="only write table.md")
    a = ap.parse_args(argv)
    out = a.out_dir or os.path.dirname(os.path.abspath(a.csv))
    os.makedirs(out, exist_ok=True)
    piv = pivot(load(a.csv))
    if not piv:
        print(f"plot.py: {a.csv} has no aggregated rows", file=sys.stderr)
        return 1
    md = table_markdown(piv)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(md + "\n")
    if a.print:
        print(md)
    written = [] if a.no_plots else plots(piv, out)
    print(f"plot.py: wrote {os.path.join(out, 'table.md')}" + (f" and {len(written)} plots in {out}" if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
