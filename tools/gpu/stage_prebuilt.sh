#!/usr/bin/env bash
# Builds the CUDA tests and benchmarks here (no GPU needed: nvcc compiles and
# links) and stages them for tools/gpu_check.sh --prebuilt DIR on a GPU
# machine: DIR/bin (the binaries), DIR/lib (libcudart and Google Benchmark's
# shared libraries, which the GPU machine may lack).
#   tools/gpu/stage_prebuilt.sh DIR [CUDA architectures, default 90]
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="$1" arch="${2:-90}"
targets="test_cuda_args test_cuda_ops test_cuda_page_ops test_cuda_policies bench_cuda bench_cuda_policies"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVP_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
cmake --build build-gpu --target $targets -j2
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/lib"
for t in $targets; do cp "$(find build-gpu -name "$t" -type f -perm -u+x | head -1)" "$dir/bin/"; done
# The README's CUDA example, run on the device as the test `readme_cuda`.
block=$(grep -l "KVP_WITH_CUDA, on by default" build-gpu/tests/readme/readme_block_*.cpp 2>/dev/null | head -1 || true)
if [ -n "$block" ]; then
  name=$(basename "$block" .cpp)
  cmake --build build-gpu --target "$name" -j2
  cp "$(find build-gpu -name "$name" -type f -perm -u+x | head -1)" "$dir/bin/readme_cuda"
fi
for t in $targets; do ldd "$dir/bin/$t"; done | awk '/=> \// {print $3}' | sort -u | grep -E 'libcudart|libbenchmark' |
  while read -r lib; do cp -L "$lib" "$dir/lib/"; done
ls -la "$dir/bin" "$dir/lib"
