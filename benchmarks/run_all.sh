#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds (if needed) and runs every kvpolicy benchmark program with
# repetitions, then prints one table of medians (benchmarks/summarize.py):
# name, time, throughput, percent of this machine's peak (the in-process probe
# of benchmarks/peak.hpp) and, where an issue states one, the goal and whether
# the median meets it; then the goals stated as ratios (top-k / read pass,
# 2-thread / 1-thread scaling) and kvpress side by side.
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

python3 "$root/benchmarks/summarize.py" "$out" "${targets[@]}"
