#!/usr/bin/env bash
# libFuzzer pass over the fuzz targets in tests/fuzz/ (safetensors and trace
# readers, registry spec parser, one-shot eviction, Quest selection, apply/
# compaction, the quantization formats): configure build-fuzz/ with clang++ (-fsanitize=fuzzer,address,
# undefined on every target, RelWithDebInfo at -O1), build the fuzzers, run
# each for N seconds from its committed seed corpus, then print a table of
# executions, coverage (cov:) and corpus size per target.
#   tools/fuzz.sh [seconds] [target...]   default 60 s, every target
# Environment: KVP_FUZZ_BUILD_DIR (default build-fuzz), KVP_JOBS (build jobs, default nproc).
# New corpus entries go to $BUILD_DIR/corpus/<target> (tests/fuzz/corpus/ is only read);
# crashes to $BUILD_DIR/artifacts/<target>/. Exit status 1 if any target crashed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
shift || true
BUILD_DIR=${KVP_FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${KVP_JOBS:-$(nproc)}
ALL=(fuzz_safetensors fuzz_trace fuzz_gguf fuzz_policy_spec fuzz_evict fuzz_quest_select fuzz_compact fuzz_quant fuzz_quant_paged fuzz_merge fuzz_topk fuzz_prefetch fuzz_shard)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL[@]}")

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DKVP_BUILD_FUZZERS=ON -DKVP_BUILD_TESTS=OFF -DKVP_BUILD_BENCHMARKS=OFF -DKVP_BUILD_EXAMPLES=OFF \
  -DKVP_WITH_CUDA=OFF -DKVP_INSTALL=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"

rows=()
status=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD_DIR/corpus/$t" artifacts="$BUILD_DIR/artifacts/$t/" log="$BUILD_DIR/fuzz-$t.log"
  mkdir -p "$corpus" "$artifacts"
  echo "=== $t: ${SECONDS_PER_TARGET}s ==="
  rc=0
  ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:${ASAN_OPTIONS:-}" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$BUILD_DIR/tests/fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts" "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corp=$(find "$corpus" -type f | wc -l)
  result=ok
  if [ "$rc" -ne 0 ]; then
    result="CRASH (rc $rc, $(ls "$artifacts" | head -1))"
    status=1
    grep -E 'ERROR|contract violated|runtime error' "$log" | head -5 || true
  fi
  rows+=("$(printf '%-18s %6s %12s %7s %8s  %s' "$t" "$SECONDS_PER_TARGET" "${execs:-?}" "${cov:-?}" "$corp" "$result")")
done
echo
printf '%-18s %6s %12s %7s %8s  %s\n' target seconds execs cov corpus result
printf '%s\n' "${rows[@]}"
exit $status
