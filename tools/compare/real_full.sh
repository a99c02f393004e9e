#!/usr/bin/env bash
# The whole real-model table (SmolLM2-135M-Instruct), resumable: one kvpolicy-compare run per (length, haystack)
# cell, each into OUT/<length>-<haystack>/results.csv; a cell whose CSV exists is skipped, so an interrupted run
# continues where it stopped. Then the cells' CSVs are merged into OUT/results.csv, plotted (plot.py) and
# summarised as accuracy tables and a plot (real_summary.py -> OUT/accuracy.md, OUT/accuracy.png: policy x ratio x
# setup x length).
#
#   tools/compare/real_full.sh [OUT] [-- extra kvpolicy-compare options, e.g. --policies A,B --threads 1]
# Environment: KVP_SMOLLM2_GGUF (tools/kvp.sh sets it), KVP_BUILD_DIR (default build), KVP_REAL_RATIOS
# (default 0.1,0.25,0.5,0.75), KVP_REAL_SAMPLES (default 6), KVP_REAL_LENGTHS (default "512 1024 2048"),
# KVP_REAL_FILLERS (default "prose repeat").
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${KVP_BUILD_DIR:-build}/compare-real-full}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
bin=${KVP_BUILD_DIR:-build}/examples/kvpolicy-compare
[ -x "$bin" ] || { echo "real_full: $bin not built (./tools/kvp.sh build)" >&2; exit 1; }
[ -n "${KVP_SMOLLM2_GGUF:-}" ] && [ -f "$KVP_SMOLLM2_GGUF" ] || { echo "real_full: KVP_SMOLLM2_GGUF does not name the model file" >&2; exit 1; }
mkdir -p "$out"
for len in ${KVP_REAL_LENGTHS:-512 1024 2048}; do
  for filler in ${KVP_REAL_FILLERS:-prose repeat}; do
    cell="$out/$len-$filler"
    if [ -f "$cell/results.csv" ]; then echo "real_full: $cell done, skipped"; continue; fi
    echo "real_full: $len tokens, $filler haystack ($(date +%H:%M:%S))"
    "$bin" --synthetic 0 --task-samples 0 --prefetch-samples 0 --real-traces 0 --no-progress \
      --real-model "$KVP_SMOLLM2_GGUF" --real-samples "${KVP_REAL_SAMPLES:-6}" --real-lengths "$len" --real-fillers "$filler" \
      --real-ratios "${KVP_REAL_RATIOS:-0.1,0.25,0.5,0.75}" --csv "$cell.partial.csv" "$@" > "$cell.log"
    mkdir -p "$cell" && mv "$cell.partial.csv" "$cell/results.csv"
  done
done
first=1
for f in "$out"/*/results.csv; do
  if [ $first = 1 ]; then cat "$f"; first=0; else tail -n +2 "$f"; fi
done > "$out/results.csv"
py=/usr/bin/python3; [ -x "$py" ] || py=python3
"$py" tools/compare/real_summary.py "$out/results.csv" --plot "$out/accuracy.png" > "$out/accuracy.md"
"$py" tools/compare/plot.py "$out/results.csv" --out-dir "$out" > /dev/null || echo "real_full: plotting failed (needs python3-matplotlib)" >&2
echo "real_full: $out/results.csv, $out/accuracy.md and the plots"
