#!/usr/bin/env bash
# The device check of the CUDA backend: builds (or takes prebuilt binaries),
# runs every CUDA test and benchmark once, times PyTorch on the same shapes,
# and writes one JSON summary. Sized for one H200 from a cold start: about
# 3 minutes with prebuilt binaries, 6 with the build.
#
#   tools/gpu_check.sh [--prebuilt DIR] [--out DIR] [--memcheck] [--profile REGEX]
#
#   --prebuilt DIR  DIR/bin holds test_cuda_{args,ops,page_ops,policies} and
#                   bench_cuda{,_policies}; DIR/lib the shared libraries they
#                   need (tools/gpu/stage_prebuilt.sh makes it). Without it
#                   the script configures build-gpu/ for sm_90 (override with
#                   CUDAARCHS) and builds those targets; that needs Catch2 and
#                   Google Benchmark where CMake finds them.
#   --out DIR       results (default: $OUT when set, else build-gpu/check):
#                   gpu_check.json (the summary), tests.log (nvidia-smi, then
#                   every test's and benchmark's whole output), tests.tsv,
#                   bench_cuda.json, bench_cuda_policies.json,
#                   torch_reference.json: six files (seven with --profile).
#   --memcheck      after the benchmarks, each test again under
#                   compute-sanitizer's memcheck (about a minute more); a row
#                   `memcheck:TEST` in the summary passes when the sanitizer
#                   reports 0 errors (the test's own verdict is its other row).
#   --profile REGEX the bench_cuda_policies benchmarks REGEX names, once more
#                   under Nsight Compute (one repetition, 0.01 s each, at most
#                   3,000 launches, clocks as the GPU sets them, caches not
#                   flushed between kernels, as in the benchmarks): every
#                   kernel's gpu__time_duration into profile.csv, and the time
#                   per kernel name (tools/gpu/profile_summary.py) into
#                   tests.log and gpu_check.json's "profile". For example
#                   'CudaExpectedAttention/4096|CudaH2OStep/32768'.
# The run a device session makes (binaries staged here first with
# `tools/gpu/stage_prebuilt.sh build-prebuilt 90`, the folder carried over):
#   tools/gpu_check.sh --prebuilt build-prebuilt --memcheck --profile \
#     'CudaExpectedAttention/4096|CudaH2OStep/32768|CudaTopk/131072/1|CudaAdaKVKeep/32768|CudaQuant/32768/1/0'
# On the H100 of 2026-12-05 the tests, benchmarks and memcheck took 205 s with
# a 150 s benchmark limit; allow about 6 minutes with the profile.
# Exit status: 0 when every test passed, 1 otherwise (benchmarks never fail it).
# A benchmark program that outlives its time limit is killed; the summary
# keeps the benchmarks it finished and lists the file under "truncated".
set -u
cd "$(dirname "$0")/.."
prebuilt="" out="${OUT:-build-gpu/check}" memcheck=0 profile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --memcheck) memcheck=1; shift ;;
    --profile) profile="$2"; shift 2 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
tests="test_cuda_args test_cuda_ops test_cuda_page_ops test_cuda_policies"
benches="bench_cuda bench_cuda_policies"

if [ -n "$prebuilt" ]; then
  bin="$prebuilt/bin"
  export LD_LIBRARY_PATH="$prebuilt/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVP_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDAARCHS:-90}" >"$out/build.log" 2>&1 &&
    cmake --build build-gpu --target $tests $benches >>"$out/build.log" 2>&1 ||
    { echo "gpu_check: build failed, see $out/build.log" >&2; tail -30 "$out/build.log" >&2; exit 1; }
  bin="$(pwd)/build-gpu/bin-gpu"
  mkdir -p "$bin"
  for t in $tests $benches; do cp "$(find build-gpu -name "$t" -type f -perm -u+x | head -1)" "$bin/"; done
fi

: >"$out/tests.tsv"
# record NAME EXIT SECONDS SUMMARY: one row of tests.tsv, and $out/run.log (the
# run's whole output) moved into tests.log under NAME.
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$out/tests.tsv"
  { echo "==== $1 (exit $2)"; cat "$out/run.log"; } >>"$out/tests.log"
  rm -f "$out/run.log"
  echo "gpu_check: $1 exit $2: $4"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/tests.log" 2>&1 || true
# Each test once as built (tensor-core logits for fp16 / bf16 keys on sm_80+),
# the policy tests again with the exact logits kernel (KVP_CUDA_EXACT_SCORES=1;
# test_cuda_ops forces both kernels itself), and every test again with its
# device buffers filled with 0xFF bytes (KVP_CUDA_TEST_POISON=1: a read of
# memory nobody wrote then fails every run instead of by chance).
runs="$tests test_cuda_policies:exact"
for t in $tests; do runs="$runs $t:poison"; done
[ -x "$bin/readme_cuda" ] && runs="$runs readme_cuda"
for r in $runs; do
  t="${r%%:*}" name="$r" env=()
  case "$r" in
    *:exact) env=(KVP_CUDA_EXACT_SCORES=1) name="${t}[exact_scores]" ;;
    *:poison) env=(KVP_CUDA_TEST_POISON=1) name="${t}[poisoned_buffers]" ;;
  esac
  start=$(date +%s%N)
  env "${env[@]}" timeout 100 "$bin/$t" >"$out/run.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  record "$name" "$rc" "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))" \
    "$(grep -E "All tests passed|test cases:|SKIPPED|kv head 0 keeps|nothing to run" "$out/run.log" | tail -1)"
done
# Five repetitions of at least 0.2 s of device time each: a kernel's median
# moves by well under 1 % between repetitions on an idle GPU.
for b in $benches; do
  echo "==== $b" >>"$out/tests.log"
  timeout 240 "$bin/$b" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true --benchmark_min_time=0.2 \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json >"$out/run.log" 2>&1
  echo "gpu_check: $b exit $?"
  cat "$out/run.log" >>"$out/tests.log"
  grep -E "median|WARNING|error" "$out/run.log" | tail -60
  rm -f "$out/run.log"
done
if [ "$memcheck" = 1 ]; then
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  for t in $tests; do
    timeout 150 "$sanitizer" --tool memcheck --error-exitcode 86 "$bin/$t" >"$out/run.log" 2>&1
    rc=$?
    errors=$(grep -E "ERROR SUMMARY" "$out/run.log" | tail -1 | sed 's/^=* *//')
    row=1  # passes on a whole run (not cut by the timeout) whose sanitizer found nothing
    [ "$errors" = "ERROR SUMMARY: 0 errors" ] && [ "$rc" != 124 ] && row=0
    record "memcheck:$t" "$row" 0 "${errors:-no sanitizer summary} (sanitizer exit $rc)"
  done
fi
if [ -n "$profile" ]; then
  ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  echo "==== profile: $profile ($ncu)" >>"$out/tests.log"
  timeout 240 "$ncu" --csv --print-units base --print-kernel-base function --clock-control none --cache-control none \
    --launch-count 3000 \
    --metrics gpu__time_duration.sum "$bin/bench_cuda_policies" --benchmark_filter="$profile" --benchmark_repetitions=1 \
    --benchmark_min_time=0.01 >"$out/profile.csv" 2>>"$out/tests.log"
  echo "gpu_check: profile exit $?"
  python3 tools/gpu/profile_summary.py "$out/profile.csv" 2>&1 | tee -a "$out/tests.log" | head -25
fi
timeout 120 python3 tools/gpu/torch_reference.py "$out/torch_reference.json" >/dev/null 2>"$out/torch_reference.err" ||
  { echo "gpu_check: torch reference failed:"; tail -5 "$out/torch_reference.err"; }
[ -s "$out/torch_reference.err" ] || rm -f "$out/torch_reference.err"
python3 tools/gpu/summarize.py "$out" >/dev/null
python3 - "$out/gpu_check.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
for t in s["tests"]:
    print(f"{t['status']:5} {t['test']}: {t['summary']}")
print("peaks:", s["context"])
for k, v in s["benchmarks"].items():
    print(k, v)
for k, v in s["vs_torch"].items():
    print(f"vs torch {k}: kvpolicy {v['kvpolicy_us']:.1f} us, torch {v['torch_us']:.1f} us, speedup {v['speedup']:.2f}x")
PY
python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["all_tests_passed"] else 1)' "$out/gpu_check.json"
