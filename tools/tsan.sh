#!/usr/bin/env bash
# ThreadSanitizer pass over the code that runs on several threads: the bundled
# ThreadPool (tests/util), the views/ExecContext tests (tests/core), the CPU
# backend (tests/cpu), the paged attention helpers on a pool (tests/eval),
# Quest's multi-worker selection (tests/policy/selection) and the sharded
# decisions with the ranks as threads (tests/distributed). clang++
# -fsanitize=thread, RelWithDebInfo at -O1 with line tables (the AVX-512 kernel
# units compile in seconds, reports keep file:line), its own build directory.
#   tools/tsan.sh            configure + build build-tsan/, run the tests (halt on the first report)
# Environment: KVP_TSAN_BUILD_DIR (default build-tsan), KVP_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVP_TSAN_BUILD_DIR:-build-tsan}
JOBS=${KVP_JOBS:-$(nproc)}
TARGETS=(test_util test_core test_cpu test_eval test_eval_cpu test_selection test_selection_cpu test_sharding)

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -DKVP_TEST_QUICK=1" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DKVP_WITH_CUDA=OFF -DKVP_BUILD_BENCHMARKS=OFF -DKVP_BUILD_EXAMPLES=OFF -DKVP_PACKAGING_TESTS=OFF
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"
regex="^($(IFS='|'; echo "${TARGETS[*]}")):"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ctest --test-dir "$BUILD_DIR" -R "$regex" --output-on-failure -j "$JOBS"
