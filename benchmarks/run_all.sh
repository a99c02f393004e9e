#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds (if needed) and runs every kvpolicy benchmark program with
# repetitions, then prints one table of medians: name, time, throughput,
# percent of this machine's peak (the in-process probe of benchmarks/peak.hpp)
# and, where an issue states one, the goal and whether the median meets it.
#
#   benchmarks/run_all.sh [build-dir] [extra Google Benchmark flags...]
#
# Environment: KVP_BENCH_REPS (default 5), KVP_BENCH_FILTER (a regex passed as
# --benchmark_filter), KVP_BENCH_PROGRAMS (space-separated subset of the
# programs, default: every bench_* target that was built), KVP_BENCH_JOBS
# (build parallelism, default 2), KVP_KVPRESS_PYTHON (a Python with PyPI torch
# and kvpress 0.5.5, outside the repository: when set, the table ends with
# kvpress side by side on identical shapes, tools/compare_kvpress_speed.py,
# one thread, 32K tokens, with the #15 goal of >= 10x; KVP_KVPRESS_ARGS adds
# flags to it). JSON results are kept in <build>/bench-results/.
# Times are CPU time of the benchmark thread (process CPU time for the pool
# runs; wall time for the /real_time ones), see benchmarks/bench_util.hpp.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-cpu}"
shift || true
reps="${KVP_BENCH_REPS:-5}"
jobs="${KVP_BENCH_JOBS:-2}"

if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVP_BUILD_BENCHMARKS=ON
fi
programs="${KVP_BENCH_PROGRAMS:-}"
if [[ -z "$programs" ]]; then
  for f in "$root"/benchmarks/bench_*.cpp; do programs+=" $(basename "${f%.cpp}")"; done
fi
targets=()
# The target list is read once into a variable: `grep -q` on the pipe could exit before cmake finished
# writing, and pipefail then counted the SIGPIPE as a missing target.
help="$(cmake --build "$build" --target help 2>/dev/null || true)"
for p in $programs; do
  if grep -qE "(^|[ :])$p(:|$| )" <<<"$help"; then targets+=("$p"); fi
done
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "run_all.sh: no benchmark targets in $build (is Google Benchmark installed?)" >&2
  exit 1
fi
cmake --build "$build" --parallel "$jobs" --target "${targets[@]}"

out="$build/bench-results"
mkdir -p "$out"
filter=()
[[ -n "${KVP_BENCH_FILTER:-}" ]] && filter=(--benchmark_filter="$KVP_BENCH_FILTER")
for p in "${targets[@]}"; do
  exe="$(find "$build" -type f -name "$p" -perm -u+x | head -n1)"
  [[ -n "$exe" ]] || { echo "run_all.sh: $p was not built" >&2; continue; }
  echo "== $p" >&2
  "$exe" --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$p.json" --benchmark_out_format=json "${filter[@]}" "$@" >/dev/null
done

rm -f "$out/kvpress.jsonl"
if [[ -n "${KVP_KVPRESS_PYTHON:-}" ]]; then
  driver="$(find "$build" -type f -name kvp_speed_driver -perm -u+x | head -n1)"
  if [[ -z "$driver" ]]; then
    cmake --build "$build" --parallel "$jobs" --target kvp_speed_driver
    driver="$(find "$build" -type f -name kvp_speed_driver -perm -u+x | head -n1)"
  fi
  echo "== kvpress side by side ($KVP_KVPRESS_PYTHON)" >&2
  # shellcheck disable=SC2086
  "$KVP_KVPRESS_PYTHON" "$root/tools/compare_kvpress_speed.py" --driver "$driver" --json ${KVP_KVPRESS_ARGS:-} >"$out/kvpress.jsonl" ||
    echo "run_all.sh: the kvpress comparison failed; its rows are left out" >&2
fi

python3 - "$out" "${targets[@]}" <<'EOF'
import json, os, sys

out, programs = sys.argv[1], sys.argv[2:]
rows, context = [], {}
for p in programs:
    path = os.path.join(out, p + ".json")
    if not os.path.exists(path):
        continue
    with open(path) as f:
        data = json.load(f)
    context.update({k: v for k, v in data.get("context", {}).items() if k.startswith(("peak_", "kvpolicy_"))})
    runs = {}
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            continue
        name = b.get("run_name", b["name"])
        # Medians where repetitions ran; a benchmark with one repetition reports its single run.
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                runs[name] = b
        elif name not in runs:
            runs[name] = b
    for name, b in runs.items():
        rows.append((p, name, b))

def fmt_time(b):
    t, unit = b["cpu_time"] if "real_time" not in b["name"] else b["real_time"], b.get("time_unit", "ns")
    ns = t * {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[unit]
    for u, f in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= f:
            return f"{ns / f:9.3f} {u}"
    return f"{ns:9.1f} ns"

def throughput(b):
    if "GFLOP/s" in b:
        # A row run at the AVX2 level is compared with the AVX2 FMA kernel's rate (an AVX2 machine's peak).
        return f'{b["GFLOP/s"]:8.2f} GFLOP/s', b.get("pct_peak_fma_avx2", b.get("pct_peak_fma"))
    if "GB/s" in b:
        return f'{b["GB/s"]:8.2f} GB/s   ', b.get("pct_peak_bw")
    if "pct_read_bw" in b:  # paired with a read pass of the same process (bench_quest estimate_vs_read_cold)
        return f'{b["est_GBps"]:8.2f} GB/s   ', b["pct_read_bw"]
    return "", None

print()
if context:
    print("peak probe: %s GFLOP/s FP32 FMA (%s; AVX2 kernel %s, the peak of the avx2 rows), %s GB/s read; kvpolicy::cpu best ISA %s" % (
        context.get("peak_fma_gflops", "?")[:7], context.get("peak_fma_isa", "?"), context.get("peak_fma_avx2_gflops", "?")[:7],
        context.get("peak_read_gbps", "?")[:6], context.get("kvpolicy_cpu_best_isa", "?")))
# The goals the issues state, as a share of the in-process peak: (name pattern, goal %, issue item).
import re
GOALS = [
    (r"^window_scores(_layer)?/cpu/avx512/(f16|bf16)", 80, "#15.1"),
    (r"^window_scores(_layer)?/cpu/avx2/", 60, "#15.1"),
    (r"^estimate_vs_read_cold", 85, "#15.2"),
    (r"^expected_attention", 50, "#15.5"),
    (r"^(quantize|quantize_op|dequantize)/", 80, "#11.5"),
]
def goal_of(name):
    for pat, pct, item in GOALS:
        if re.search(pat, name):
            return pct, item
    return None, None

width = max([len(n) for _, n, _ in rows] + [9])
print(f'{"benchmark":<{width}}  {"time (median)":>13}  {"throughput":>16}  {"% of peak":>9}  {"goal":>12}')
print("-" * (width + 60))
for p, name, b in rows:
    tp, pct = throughput(b)
    pct_s = f"{pct:8.1f}%" if pct is not None else ""
    g, item = goal_of(name)
    goal_s = ""
    if g is not None:
        met = "" if pct is None else (" met" if pct >= g else " not")
        goal_s = f">={g}% {item}{met}"
    print(f"{name:<{width}}  {fmt_time(b):>13}  {tp:>16}  {pct_s:>9}  {goal_s}")

# Ratios the targets are stated in: top-k against one read pass over the same rows; scoring quantized keys
# against the same scorer on the fp16 keys.
by_name = {n: b for _, n, b in rows}
fp16 = next((b for n, b in by_name.items() if n.startswith("score/snapkv_fp16")), None)
for n, b in by_name.items():
    if fp16 is not None and n.startswith("score/snapkv_") and not n.startswith("score/snapkv_fp16"):
        print(f"ratio {n} / score/snapkv_fp16 (time): {b['cpu_time'] / fp16['cpu_time']:.2f}x")
kvpress = os.path.join(out, "kvpress.jsonl")
if os.path.exists(kvpress) and os.path.getsize(kvpress) > 0:
    print()
    print("side by side with kvpress (same shapes and threads; median wall time per decision; goal #15.7: >= 10x)")
    print(f'{"policy":<19} {"tokens":>6} {"threads":>7} {"kvpress":>11} {"kvpolicy":>11} {"ratio":>8}  goal')
    with open(kvpress) as f:
        for line in f:
            r = json.loads(line)
            met = "met" if r["speedup"] >= 10 else "not"
            print(f'{r["policy"]:<19} {r["tokens"]:>6} {r["threads"]:>7} {r["kvpress_median_ms"]:>8.1f} ms {r["kvpolicy_median_ms"]:>8.1f} ms '
                  f'{r["speedup"]:>7.2f}x  >=10x #15.7 {met}')
for n, b in by_name.items():
    if "pct_pattern_bw" in b:
        print(f"{n}: {b['est_GBps']:.2f} GB/s = {b['pct_read_bw']:.0f}% of a read pass ({b['read_GBps']:.2f} GB/s), "
              f"{b['pct_pattern_bw']:.0f}% of a read of the same pages in the same order ({b['pages_GBps']:.2f} GB/s)")
for n, b in by_name.items():
    if n.startswith("topk/") and "/scalar" not in n:
        shape = n[n.index("/n:"):]
        base = by_name.get("read_pass" + shape)
        if base:
            print(f"ratio {n} / read_pass{shape}: {b['cpu_time'] / base['cpu_time']:.2f}x")
EOF
